"""A long-lived Mooncake TransferEngine (PyPI mooncake-transfer-engine-non-cuda) as P, for
examples/rdma_probe: one TE and one registered source buffer for the whole session, so that a
write after D's fence goes out on the TE's existing endpoint, as a real P's retry does.

Usage: te_session.py <protocol: rdma|tcp> <local device, "" for the TE's choice>
Prints {"ready": true} (or {"error": ...}) once, then answers each stdin line
{"op": "write", "target": "host:port", "writes": [{"addr": int, "len": int, "seed": int}]}
with {"rc": int, "seconds": float} (one batch_transfer_sync_write). The TE logs to stderr.
Payload: pattern(seed, len), the formula of te_writer.py and the Rust probes.
"""
import ctypes
import json
import resource
import sys
import time

from mooncake.engine import TransferEngine

CAPACITY = 4 << 20


def pattern(seed, n):
    return bytes(((seed * 31) + (i % 251) + (i // 251)) & 0xFF for i in range(n))


def say(obj):
    print(json.dumps(obj), flush=True)


def main():
    protocol, device = sys.argv[1], sys.argv[2]
    # P's registration pins its buffer: take the hard memlock limit (P's side only; kvrecv's
    # own handling of the limit is what the check observes on D's side).
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    except (ValueError, OSError):
        pass
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        say({"error": f"initialize({protocol}, {device!r}) returned {rc}"})
        return 2
    buf = ctypes.create_string_buffer(CAPACITY)
    base = ctypes.addressof(buf)
    rc = te.register_memory(base, CAPACITY)
    if rc != 0:
        say({"error": f"register_memory returned {rc}"})
        return 2
    say({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        writes = cmd["writes"]
        if sum(w["len"] for w in writes) > CAPACITY:
            say({"error": "writes larger than the source buffer"})
            continue
        srcs, off = [], 0
        for w in writes:
            ctypes.memmove(base + off, pattern(w["seed"], w["len"]), w["len"])
            srcs.append(base + off)
            off += w["len"]
        t0 = time.monotonic()
        rc = te.batch_transfer_sync_write(
            cmd["target"], srcs, [w["addr"] for w in writes], [w["len"] for w in writes]
        )
        say({"rc": rc, "seconds": round(time.monotonic() - t0, 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
