"""Drive the real Mooncake TransferEngine (PyPI mooncake-transfer-engine-non-cuda) as P against a
kvrecv target. Usage: te_writer.py <segment name host:port> <command JSON>

The command JSON: {"writes": [{"addr": int, "len": int, "seed": int}], "batch": bool,
"read_back": bool}. Each write's payload is pattern(seed, len) (same formula as the Rust tests).
Prints one JSON line: {"results": [int per write or batch], "read_back_ok": bool|null}.

The TE's transport is TCP unless KVRECV_TE_PROTOCOL says otherwise (scripts/device-check sets
"rdma", with KVRECV_TE_DEVICE naming the local RDMA device to write from).
"""
import ctypes
import json
import os
import sys

from mooncake.engine import TransferEngine


def pattern(seed, n):
    return bytes(((seed * 31) + (i % 251) + (i // 251)) & 0xFF for i in range(n))


def main():
    target = sys.argv[1]
    cmd = json.loads(sys.argv[2])
    te = TransferEngine()
    protocol = os.environ.get("KVRECV_TE_PROTOCOL", "tcp")
    device = os.environ.get("KVRECV_TE_DEVICE", "")
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        print(json.dumps({"error": f"initialize returned {rc}"}))
        return 2
    writes = cmd["writes"]
    total = sum(w["len"] for w in writes) or 1
    buf = ctypes.create_string_buffer(total)
    base = ctypes.addressof(buf)
    rc = te.register_memory(base, total)
    if rc != 0:
        print(json.dumps({"error": f"register_memory returned {rc}"}))
        return 2
    srcs = []
    off = 0
    for w in writes:
        data = pattern(w["seed"], w["len"])
        ctypes.memmove(base + off, data, len(data))
        srcs.append(base + off)
        off += w["len"]
    if cmd.get("batch"):
        results = [te.batch_transfer_sync_write(target, srcs, [w["addr"] for w in writes], [w["len"] for w in writes])]
    else:
        results = [te.transfer_sync_write(target, s, w["addr"], w["len"]) for s, w in zip(srcs, writes)]
    read_back_ok = None
    if cmd.get("read_back"):
        back = ctypes.create_string_buffer(total)
        bbase = ctypes.addressof(back)
        te.register_memory(bbase, total)
        off = 0
        read_back_ok = True
        for w in writes:
            r = te.transfer_sync_read(target, bbase + off, w["addr"], w["len"])
            if r != 0 or back.raw[off:off + w["len"]] != pattern(w["seed"], w["len"]):
                read_back_ok = False
            off += w["len"]
    print(json.dumps({"results": results, "read_back_ok": read_back_ok}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
