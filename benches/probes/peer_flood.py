"""Hostile-bootstrap probe: a bootstrap server that answers every `GET /query` with a new engine
of TP workers that refuse connections, and `kvrecv serve` driven over stdin with one request per
engine. Two rounds of N engines, WAIT seconds apart; prints serve's RSS after each round and
after each wait (peers and engines no pull named for `peer_retire_after` are forgotten, so the
second round reuses the first's memory), and its open descriptors.

  python3 benches/probes/peer_flood.py N TP WAIT        # e.g. 300 16 75
"""
import http.server, itertools, json, os, subprocess, sys, threading
n = int(sys.argv[1]); tp = int(sys.argv[2])
count = itertools.count()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        k = next(count)
        body = json.dumps({"0": {"engine_id": f"e{k}", "worker_addr": {str(t): {"0": f"tcp://127.0.0.1:{20000 + (k * tp + t) % 40000}"} for t in range(tp)}}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
bport = srv.server_address[1]
p = subprocess.Popen([os.environ.get("KVRECV", "target/release/kvrecv"), "serve", "--layers", "1", "--block-len", "64",
                      "--num-blocks", "64", "--events", "completions", "--log-level", "error", "--pull-timeout-ms", "2000"],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
rd = p.stdout
def rss():
    for l in open(f"/proc/{p.pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])
def fds(): import os; return len(os.listdir(f"/proc/{p.pid}/fd"))
rd.readline(); r0 = rss(); f0 = fds()
outcomes = {}
def flood(base):
  for i in range(base, base + n):
    line = {"op": "load_kv", "requests": [{"req_id": f"r{i}", "transfer_id": f"t{i}", "remote_engine_id": f"e{i}",
            "remote_bootstrap_addr": f"http://127.0.0.1:{bport}", "block_ids": [[i % 64]]}]}
    p.stdin.write((json.dumps(line) + "\n").encode())
    while True:
        l = rd.readline()
        if b'"completion"' in l:
            o = json.loads(l); outcomes[o["outcome"]] = outcomes.get(o["outcome"], 0) + 1; break
    if i % 8 == 7:
        p.stdin.write(b'{"op":"drain"}\n')
        while b'"drain"' not in rd.readline(): pass
import time
w = float(sys.argv[3])
flood(0); a1 = rss(); time.sleep(w); a2 = rss()
flood(n); b1 = rss(); time.sleep(w); b2 = rss()
print("outcomes", outcomes, "rss_kb start", r0, "round1", a1, "after wait", a2, "round2", b1, "after wait", b2, "fds", f0, "->", fds())
p.stdin.write(b'{"op":"shutdown"}\n'); p.stdin.close(); p.wait()
