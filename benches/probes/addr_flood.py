"""Probe: `kvrecv serve` fed N requests, each naming a different bootstrap address that refuses
connections; prints serve's RSS per address retained.

  python3 benches/probes/addr_flood.py N                # e.g. 3000
"""
import json, subprocess, sys, time, os
n = int(sys.argv[1]); kind = sys.argv[2] if len(sys.argv) > 2 else "refused"
p = subprocess.Popen([os.environ.get("KVRECV", "target/release/kvrecv"), "serve", "--layers", "1", "--block-len", "64",
                      "--num-blocks", "64", "--events", "completions", "--log-level", "error"],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
rd = p.stdout
def rss():
    for l in open(f"/proc/{p.pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])
ready = rd.readline()
r0 = rss()
done = 0
for i in range(n):
    port = 1024 + (i % 60000)
    addr = f"http://127.0.0.{1 + i // 60000}:{port}" if kind == "refused" else f"http://10.255.{i//250}.{i%250}:8998"
    line = {"op": "load_kv", "requests": [{"req_id": f"r{i}", "transfer_id": f"t{i}", "remote_engine_id": f"e{i}",
            "remote_bootstrap_addr": addr, "block_ids": [[i % 64]]}]}
    p.stdin.write((json.dumps(line) + "\n").encode())
    # wait for completion of this one, drain every 32
    while True:
        l = rd.readline()
        if b'"completion"' in l: break
    if i % 32 == 31:
        p.stdin.write(b'{"op":"drain"}\n')
        while b'"drain"' not in rd.readline(): pass
print("rss_kb before", r0, "after", rss(), "per address B", (rss() - r0) * 1024 // n)
p.stdin.write(b'{"op":"shutdown"}\n'); p.stdin.close(); p.wait()
