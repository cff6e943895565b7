"""Loopback write-throughput helper for examples/dataplane_bench.rs (not a test).

  te_bench.py target <bytes>
      Start a real Mooncake TE as the *target*; print {"segment": name, "addr": base} and serve
      until stdin closes. Its region is a ctypes buffer, or with KVRECV_BENCH_TE_HUGE=1 a private
      mapping advised onto transparent huge pages (as kvrecv's own landing memory is).
  te_bench.py write <segment> <base addr> <region bytes> <write size> <total bytes> [batch]
      Real TE as P: write <total bytes> into [base, base + region bytes) in <write size> requests,
      <batch> per batch_transfer_sync_write; print {"seconds": s, "bytes": n} (timed writes only).
"""
import ctypes
import os
import mmap
import json
import sys
import time

from mooncake.engine import TransferEngine


def engine():
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"initialize returned {rc}")
    return te


def target(size):
    te = engine()
    if os.environ.get("KVRECV_BENCH_TE_HUGE"):
        # The same huge-page advice as kvrecv's landing memory, touched like the buffer below.
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        ctypes.memset(addr, 0, size)
    else:
        buf = ctypes.create_string_buffer(size)
        addr = ctypes.addressof(buf)
    if te.register_memory(addr, size) != 0:
        raise SystemExit("register_memory failed")
    print(json.dumps({"segment": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr}), flush=True)
    sys.stdin.read()


def write(segment, base, region, size, total, batch):
    te = engine()
    src = ctypes.create_string_buffer(size * batch)
    saddr = ctypes.addressof(src)
    ctypes.memset(saddr, 0x5A, size * batch)
    if te.register_memory(saddr, size * batch) != 0:
        raise SystemExit("register_memory failed")
    slots = region // size
    srcs = [saddr + i * size for i in range(batch)]
    lens = [size] * batch
    # Warm-up: handshake and lanes.
    rc = te.batch_transfer_sync_write(segment, srcs, [base + (i % slots) * size for i in range(batch)], lens)
    if rc != 0:
        raise SystemExit(f"warm-up write returned {rc}")
    n = total // (size * batch)
    k = 0
    t0 = time.perf_counter()
    for _ in range(n):
        dsts = [base + ((k + i) % slots) * size for i in range(batch)]
        k += batch
        rc = te.batch_transfer_sync_write(segment, srcs, dsts, lens)
        if rc != 0:
            raise SystemExit(f"write returned {rc}")
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "bytes": n * batch * size}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "target":
        target(int(sys.argv[2]))
    else:
        a = sys.argv[2:]
        write(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]) if len(a) > 5 else 16)
