#!/usr/bin/env python3
"""kvrecv's D against a Python D that follows vLLM's MooncakeConnector receive loop, side by side
in one run, against the same P (`kvrecv prefill-sim`, in its own process).

The Python D (`py-d`, run by the driver as a child process) is what vLLM 0.33.0's D does per
step: asyncio, one pyzmq DEALER per (batch, P worker) connected for the pull and closed after it,
the metadata encoded and every reply decoded with msgspec (0.33's structs,
tests/py/mooncake_structs_033.py), a layout id per run and the layout omitted to a worker that
echoed it (resent on LAYOUT_MISS), a request done when every P worker reported it (0.33 settles
per peer). `python032` is vLLM 0.32.0's loop (layout in every pull, its structs). kvrecv's D runs
as a library (`lib`: `kvrecv bench --bootstrap`, its own process, the host loop on the actors'
thread), through the embedding handle (`embed`: `kvrecv bench --via handle`, `KvRecv` called from
a multi-thread tokio runtime, the TCP target with permits included) and as `kvrecv serve --events
completions --answers failures` (a host that learns of its requests from their completions)
driven over its pipes by this script from one blocking thread (the driver's own CPU is not
counted); `serve_all` is the same with every input line answered (`--answers all`, serve's
default: one more pipe write, and wake-up of the host, per batch).

Per D, measured over the same workload after one warm-up batch: D-process CPU per request
(user+sys of every thread from the kernel's process CPU clock, exact where /proc/<pid>/stat
rounds to 10 ms ticks; never wall time), pulls/s, latency p50/p99 from submit to
completion, failed completions. Pairs are interleaved (the order alternates) and medians are
reported with the ratios kvrecv / Python.

  .venv/bin/python benches/baseline.py --kvrecv target/release/kvrecv            # full grid
  .venv/bin/python benches/baseline.py --kvrecv target/release/kvrecv --small --json   # CI
  .venv/bin/python benches/baseline.py --kvrecv target/release/kvrecv --layout          # layout ids
  .venv/bin/python benches/baseline.py --kvrecv target/release/kvrecv --before /tmp/old/kvrecv  # A/B
"""

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "py"))

LAYERS = 2
BLOCK_LEN = 4096


def cpu_s(pid="self"):
    """user + sys CPU seconds of a process (every thread, exited ones included): the kernel's
    CPU clock of the process, the sum that /proc/<pid>/stat's utime and stime are rounded from
    to 10 ms ticks (a tick is 1 us per request over 10,000 requests: a seventh of serve's CPU per
    request at batch 16, so ticks decided the ratio's second digit). /proc where the clock fails."""
    try:
        if pid == "self":
            return time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID) / 1e9
        # clock_getcpuclockid(pid): MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) in Linux.
        return time.clock_gettime_ns(((~int(pid)) << 3) | 2) / 1e9
    except (OSError, AttributeError):
        return proc_cpu_s(pid)


def proc_cpu_s(pid="self"):
    """user + sys CPU seconds of a process, from /proc/<pid>/stat (10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    rest = s[s.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(lat_us, cpu, secs, requests, batch, peers, failed):
    pulls = -(-requests // batch) * peers
    return {
        "cpu_us_per_request": cpu * 1e6 / requests,
        "pulls_per_s": pulls / secs,
        "p50_us": pct(lat_us, 0.5),
        "p99_us": pct(lat_us, 0.99),
        "failed": failed,
    }


# ---------------------------------------------------------------- the Python D (vLLM's loop)


async def py_d(a):
    import secrets

    import msgspec
    import zmq
    import zmq.asyncio

    if a.vllm == "0.32":
        from mooncake_structs import (
            MooncakeXferMetadata,
            MooncakeXferResponse,
            MooncakeXferResponseStatus,
        )
    else:
        from mooncake_structs_033 import (
            MooncakeXferMetadata,
            MooncakeXferResponse,
            MooncakeXferResponseStatus,
        )

    ctx = zmq.asyncio.Context()
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(MooncakeXferResponse)
    # vLLM queries the bootstrap server once per engine and caches the workers.
    with urllib.request.urlopen(a.bootstrap + "/query", timeout=5) as r:
        q = json.load(r)
    workers = [
        addr
        for _, pp in sorted(q["0"]["worker_addr"].items(), key=lambda kv: int(kv[0]))
        for _, addr in sorted(pp.items())
    ]
    blocks = (a.in_flight + a.batch) * 4 + 64  # as `kvrecv bench`
    remaining = {}  # req_id -> P workers still to report (vLLM's per-request bookkeeping)
    failed = set()
    submitted = {}
    lat_us = []
    state = {"outstanding": 0, "done": 0, "failed": 0}
    wake = asyncio.Event()
    layers = a.layers
    # vLLM 0.33: a random odd 63-bit id per register_kv_caches; workers that echoed it get
    # pulls without the layout (`_acked_layout_peers`).
    layout_id = secrets.randbits(63) | 1 if a.vllm == "0.33" else 0
    acked = set()
    layout = dict(
        kv_caches_base_addr=[(1 << 40) + i * (1 << 30) for i in range(layers)],
        block_lens=[BLOCK_LEN] * layers,
        kv_block_lens=[BLOCK_LEN] * layers,
        registered_layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        registered_layer_indices=list(range(layers)),
        registered_group_indices=[0] * layers,
    )
    no_layout = dict(kv_caches_base_addr=[], block_lens=[], kv_block_lens=[])

    def finish_one(req_id, ok):
        if not ok:
            failed.add(req_id)
        n = remaining[req_id] - 1
        if n:
            remaining[req_id] = n
            return
        del remaining[req_id]
        t0 = submitted.pop(req_id)
        lat_us.append((time.perf_counter() - t0) * 1e6)
        if req_id in failed:
            failed.discard(req_id)
            state["failed"] += 1
        state["outstanding"] -= 1
        state["done"] += 1
        wake.set()

    def metadata(req_blocks, include_layout):
        extra = {"layout_id": layout_id} if layout_id else {}
        return MooncakeXferMetadata(
            remote_hostname="127.0.0.1",
            remote_port=15000,
            remote_tp_size=1,
            remote_tp_rank=0,
            req_blocks=req_blocks,
            **(layout if include_layout else no_layout),
            **extra,
        )

    async def receive_kv(path, req_blocks):
        # vLLM (0.32 and 0.33): make_zmq_socket(DEALER, bind=False, linger=0) per (batch, P
        # worker), closed after; 0.33 omits the layout to a worker that echoed the id, and on
        # LAYOUT_MISS resends the same pull with it on a new socket.
        pending = set(req_blocks)
        include_layout = not layout_id or path not in acked
        while True:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(path)
            resend = False
            try:
                data = encoder.encode(metadata(req_blocks, include_layout))
                await sock.send(data)
                sent["n"] += 1
                sent["bytes"] += len(data)
                while pending:
                    resp = decoder.decode(await sock.recv())
                    if a.vllm == "0.33" and resp.status == MooncakeXferResponseStatus.LAYOUT_MISS:
                        acked.discard(path)
                        if not include_layout:
                            include_layout, resend = True, True
                        break
                    if layout_id and getattr(resp, "layout_id", 0) == layout_id:
                        acked.add(path)
                    for r in resp.err_reqs or ():
                        if r in pending:
                            pending.discard(r)
                            finish_one(r, False)
                    for r in resp.ok_reqs or ():
                        if r in pending:
                            pending.discard(r)
                            finish_one(r, True)
                    if resp.status != MooncakeXferResponseStatus.CONTINUE:
                        break
            finally:
                sock.close()
                if not resend:
                    for r in pending:  # ERROR, LAYOUT_MISS or FINISH without them: failed
                        finish_one(r, False)
            if not resend:
                return

    tasks = set()
    sent = {"n": 0, "bytes": 0}

    def submit(first, n):
        now = time.perf_counter()
        req_blocks = {}
        for i in range(first, first + n):
            rid = f"d-{i}"
            req_blocks[rid] = (f"t-{i}", [[i % blocks]])
            remaining[rid] = len(workers)
            submitted[rid] = now
        state["outstanding"] += n
        for w in workers:
            t = asyncio.ensure_future(receive_kv(w, req_blocks))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    if a.hold:
        # Memory mode: the driver reads this process's RSS before and after.
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        ctx.set(zmq.MAX_SOCKETS, 1 << 20)
        loop = asyncio.get_running_loop()
        print(json.dumps({"event": "idle", "pid": os.getpid()}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        nxt = 0
        while nxt < a.hold:
            n = min(a.batch, a.hold - nxt)
            submit(nxt, n)
            nxt += n
        pulls = -(-a.hold // a.batch) * len(workers)
        while sent["n"] < pulls:
            await asyncio.sleep(0.01)
        print(json.dumps({"event": "loaded", "requests": a.hold}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        os._exit(0)

    # Warm-up: one batch.
    submit(0, 1)
    while state["done"] < 1:
        wake.clear()
        await wake.wait()
    lat_us.clear()
    state.update(done=0, failed=0, drained=0)
    sent.update(n=0, bytes=0)
    c0, t0 = cpu_s(), time.perf_counter()
    nxt, end = 1, a.requests + 1
    while state["done"] < a.requests:
        while state["outstanding"] + a.batch <= max(a.in_flight, a.batch) and nxt < end:
            n = min(a.batch, end - nxt)
            submit(nxt, n)
            nxt += n
        wake.clear()
        if state["done"] < a.requests:
            await wake.wait()
    secs, cpu = time.perf_counter() - t0, cpu_s() - c0
    out = summary(lat_us, cpu, secs, a.requests, a.batch, len(workers), state["failed"])
    out["metadata_bytes_per_pull"] = sent["bytes"] / max(1, sent["n"])
    out["pulls_sent"] = sent["n"]
    print(json.dumps(out))


# ---------------------------------------------------------------- the driver


def run(cmd):
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(cmd)} exited {e.returncode}: {e.stderr[-2000:]}") from None


def run_py(a, cfg, vllm="0.33", layers=LAYERS):
    out = run(
        [sys.executable, os.path.abspath(__file__), "py-d", "--bootstrap", cfg["bootstrap"],
         "--batch", str(cfg["batch"]), "--in-flight", str(cfg["in_flight"]),
         "--requests", str(cfg["requests"]), "--vllm", vllm, "--layers", str(layers)],
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_py032(a, cfg):
    """vLLM 0.32.0's loop: the layout in every pull (no layout id)."""
    return run_py(a, cfg, vllm="0.32")


def run_lib(a, cfg, via="actors"):
    cmd = [a.kvrecv, "bench", "--bootstrap", cfg["bootstrap"], "--engine-id", cfg["engine_id"],
           "--peers", str(cfg["tp"]), "--batch", str(cfg["batch"]), "--via", via,
           "--in-flight", str(cfg["in_flight"]), "--requests", str(cfg["requests"]), "--json"]
    # Exit 1: the run completed with failed completions (reported below, not raised).
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    r = json.loads(out.stdout)
    row = {
        "cpu_us_per_request": r["cpu_us_per_request"],
        "pulls_per_s": r["pulls_per_s"],
        "p50_us": r["completion_p50_us"],
        "p99_us": r["completion_p99_us"],
        "failed": r["failed_completions"],
    }
    if via == "actors":
        # Stamped where the coordinator emits the last settle and the completion; "observed":
        # stamped where a task on the same thread reads them.
        row["after_settle_p99_us"] = r["after_last_settle_p99_us"]
        row["after_settle_observed_p99_us"] = r["after_last_settle_observed_p99_us"]
    return row


def run_embed(a, cfg):
    """kvrecv through its embedding handle (`KvRecv`, the README's path) from a multi-thread
    tokio runtime: every call and event crosses from the host's threads to kvrecv's."""
    return run_lib(a, cfg, via="handle")


# ---------------------------------------------------------------- kvrecv serve, over its pipes


def serve_d(a):
    """serve driven as a compiled host would drive it: one thread, blocking reads of whatever
    stdout has, the next batch written as soon as the in-flight limit allows. (An asyncio driver,
    until a0a84f1, put two event-loop task switches per round trip on serve's critical path,
    which at one batch in flight capped serve's pulls/s at the driver's speed.)"""
    blocks = (a.in_flight + a.batch) * 4 + 64  # as `kvrecv bench`
    p = subprocess.Popen(
        [a.kvrecv, "serve", "--layers", str(LAYERS), "--block-len", str(BLOCK_LEN),
         "--num-blocks", str(blocks), "--events", "completions", "--answers", a.answers,
         "--log-level", "warn"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
    )
    rd, wr = p.stdout.fileno(), p.stdin.fileno()
    rest = [b""]

    def lines():
        chunk = os.read(rd, 1 << 16)
        if not chunk:
            raise RuntimeError("serve closed its stdout")
        *whole, rest[0] = (rest[0] + chunk).split(b"\n")
        return whole

    def write(b):
        view = memoryview(b)
        while view:
            view = view[os.write(wr, view):]

    pending = []
    while not pending:
        pending = lines()
    ready = json.loads(pending.pop(0))
    assert ready["event"] == "ready", ready
    submitted, lat_us = {}, []
    free, block_of = collections.deque(range(blocks)), {}
    st = {"outstanding": 0, "done": 0, "failed": 0, "drained": 0}

    def take(line):
        if line.startswith(b'{"event":"completion","req_id":"'):
            rid = line[32 : line.index(b'"', 32)].decode()
            ok = b'"outcome":"ok"' in line
        else:
            v = json.loads(line)
            e = v["event"]
            if e == "load_kv":
                assert not v["rejected"], v
                return
            if e == "error":
                raise RuntimeError(v)
            if e != "completion":
                return
            rid, ok = v["req_id"], v["outcome"] == "ok"
        t0 = submitted.pop(rid, None)
        if t0 is not None:
            lat_us.append((time.perf_counter() - t0) * 1e6)
        free.append(block_of.pop(rid))
        st["failed"] += 0 if ok else 1
        st["outstanding"] -= 1
        st["done"] += 1

    def prepare(first, n):
        reqs = []
        for i in range(first, first + n):
            b = free.popleft()
            block_of[f"d-{i}"] = b
            reqs.append({"req_id": f"d-{i}", "transfer_id": f"t-{i}", "remote_engine_id": a.engine_id,
                         "remote_bootstrap_addr": a.bootstrap, "block_ids": [[b]]})
        return (json.dumps({"op": "load_kv", "requests": reqs}) + "\n").encode(), [r["req_id"] for r in reqs]

    prepared = {}

    def submit(first, n):
        line, ids = prepared.pop(first, None) or prepare(first, n)
        now = time.perf_counter()
        for rid in ids:
            submitted[rid] = now
        st["outstanding"] += n
        write(line)

    def settle_lines(ls):
        for line in ls:
            if line:
                take(line)

    settle_lines(pending)
    submit(0, 1)
    while st["done"] < 1:
        settle_lines(lines())
    lat_us.clear()
    st.update(done=0, failed=0, drained=0)
    c0, t0 = cpu_s(p.pid), time.perf_counter()
    nxt, end = 1, a.requests + 1
    while st["done"] < a.requests:
        while st["outstanding"] + a.batch <= max(a.in_flight, a.batch) and nxt < end:
            n = min(a.batch, end - nxt)
            submit(nxt, n)
            nxt += n
        # vLLM's get_finished, every step: serve keeps a finished request until
        # drained and refuses new ones past its live-request limit.
        if st["done"] - st["drained"] >= 1024:
            st["drained"] = st["done"]
            write(b'{"op":"drain"}\n')
        # The next batch is built while this one is in flight.
        if nxt < end and nxt not in prepared:
            prepared[nxt] = prepare(nxt, min(a.batch, end - nxt))
        if st["done"] < a.requests:
            settle_lines(lines())
    secs, cpu = time.perf_counter() - t0, cpu_s(p.pid) - c0
    write(b'{"op":"shutdown"}\n')
    p.stdin.close()
    while os.read(rd, 1 << 16):
        pass
    p.wait(timeout=60)
    return summary(lat_us, cpu, secs, a.requests, a.batch, a.peers, st["failed"])


def run_serve(a, cfg, answers="failures"):
    ns = argparse.Namespace(kvrecv=a.kvrecv, bootstrap=cfg["bootstrap"],
                            engine_id=cfg["engine_id"], batch=cfg["batch"],
                            in_flight=cfg["in_flight"], requests=cfg["requests"], peers=cfg["tp"],
                            answers=answers)
    return serve_d(ns)


def run_serve_all(a, cfg):
    return run_serve(a, cfg, answers="all")


def start_p(a, tp, wait_ready=False):
    p = subprocess.Popen(
        [a.kvrecv, "prefill-sim", "--bootstrap-port", "0", "--tp", str(tp), "--log-level", "warn"]
        + (["--wait-ready"] if wait_ready else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    ready = json.loads(p.stdout.readline())
    assert ready["event"] == "ready", ready
    return p, ready


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def p_stats(p):
    p.stdin.write('{"op":"stats"}\n')
    p.stdin.flush()
    while True:
        v = json.loads(p.stdout.readline())
        if v.get("event") == "stats":
            return v["pulls_received"]


def held_rss(a, p, ready, d):
    """RSS per in-flight request of D `d`: `a.memory` requests loaded in batches of
    `a.memory_batch` into a D in its own process, against P (`--wait-ready`: it answers nothing);
    RSS read from /proc by this driver before the first load and once P received every pull."""
    n, batch, tp = a.memory, a.memory_batch, 2
    pulls = -(-n // batch) * tp
    if d == "python":
        cmd = [sys.executable, os.path.abspath(__file__), "py-d", "--bootstrap", ready["bootstrap"],
               "--batch", str(batch), "--hold", str(n)]
    elif d == "lib":
        cmd = [a.kvrecv, "bench", "--bootstrap", ready["bootstrap"], "--engine-id", ready["engine_id"],
               "--peers", str(tp), "--batch", str(batch), "--hold", str(n)]
    else:
        cmd = [a.kvrecv, "serve", "--layers", str(LAYERS), "--block-len", "64",
               "--num-blocks", str(n + 64), "--events", "none", "--log-level", "warn",
               "--pull-timeout-ms", "3600000"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        assert first["event"] in ("idle", "ready"), first
        before_p = p_stats(p)
        rss0 = rss_bytes(proc.pid)
        if d == "serve":
            for i in range(0, n, batch):
                reqs = [{"req_id": f"d-{j}", "transfer_id": f"t-{j}", "remote_engine_id": ready["engine_id"],
                         "remote_bootstrap_addr": ready["bootstrap"], "block_ids": [[j]]}
                        for j in range(i, min(n, i + batch))]
                proc.stdin.write(json.dumps({"op": "load_kv", "requests": reqs}) + "\n")
            proc.stdin.flush()
            answered = 0
            while answered < -(-n // batch):
                v = json.loads(proc.stdout.readline())
                if v["event"] == "load_kv":
                    assert not v["rejected"], v
                    answered += 1
                elif v["event"] == "error":
                    raise RuntimeError(v)
        else:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            v = json.loads(proc.stdout.readline())
            assert v["event"] == "loaded", v
        deadline = time.time() + 120
        while p_stats(p) - before_p < pulls:
            if time.time() > deadline:
                raise RuntimeError(f"{d}: P received {p_stats(p) - before_p} of {pulls} pulls")
            time.sleep(0.05)
        rss1 = rss_bytes(proc.pid)
        return {"requests": n, "batch": batch, "rss_before": rss0, "rss_after": rss1,
                "bytes_per_request": (rss1 - rss0) / n}
    finally:
        proc.kill()
        proc.wait()


def memory_phase(a, ds):
    p, ready = start_p(a, 2, wait_ready=True)
    try:
        out = {d: held_rss(with_binary(a, a.before) if d.endswith("@before") else a, p, ready,
                           d.split("@")[0])
               for d in ds}
    finally:
        p.stdin.write('{"op":"shutdown"}\n')
        p.stdin.flush()
        p.wait(timeout=30)
    if "python" in out:
        base = out["python"]["bytes_per_request"]
        for d, r in out.items():
            if d != "python":
                r["ratio"] = r["bytes_per_request"] / base if base else None
    return out


def median_of(runs):
    keys = runs[0].keys()
    return {
        k: (sum(r[k] for r in runs) if k == "failed" else statistics.median(r[k] for r in runs))
        for k in keys
    }


KVRECV_DS = ("lib", "embed", "serve", "serve_all")


def with_binary(a, binary):
    """`a` with another kvrecv binary as D (P stays the same process for both)."""
    b = argparse.Namespace(**vars(a))
    b.kvrecv = binary
    return b


def main_driver(a):
    ds = {"python": run_py, "python032": run_py032, "lib": run_lib, "embed": run_embed,
          "serve": run_serve, "serve_all": run_serve_all}
    ds = {k: v for k, v in ds.items() if k in a.ds.split(",")}
    if a.before:
        # A/B in one invocation: each kvrecv D again with the `--before` binary, interleaved in
        # the same pairs against the same P.
        for k in [k for k in ds if k in KVRECV_DS]:
            ds[k + "@before"] = (lambda f: lambda a, cfg: f(with_binary(a, a.before), cfg))(ds[k])
    ints = lambda s: [int(x) for x in s.split(",")]
    rows = []
    for tp in ints(a.tp) if not a.memory_only else []:
        p, ready = start_p(a, tp)
        try:
            for batch in ints(a.batch):
                for in_flight in ints(a.in_flight):
                    if in_flight < batch:
                        continue
                    # Larger batches cost less per request: more requests keep the CPU figure
                    # well above /proc's 10 ms tick.
                    requests = a.requests * max(1, batch // 4)
                    cfg = {"tp": tp, "batch": batch, "in_flight": in_flight,
                           "requests": requests, "bootstrap": ready["bootstrap"],
                           "engine_id": ready["engine_id"]}
                    runs = {k: [] for k in ds}
                    order = list(ds)
                    for i in range(a.pairs):
                        for k in (order if i % 2 == 0 else order[::-1]):
                            runs[k].append(ds[k](a, cfg))
                    row = {"tp": tp, "batch": batch, "in_flight": in_flight,
                           "requests": requests, "pairs": a.pairs}
                    for k, rs in runs.items():
                        row[k] = median_of(rs)
                    if "python" in row:
                        base = row["python"]
                        for k in ds:
                            if k == "python":
                                continue
                            row[k]["cpu_ratio"] = row[k]["cpu_us_per_request"] / base["cpu_us_per_request"] if base["cpu_us_per_request"] else None
                            row[k]["pulls_ratio"] = row[k]["pulls_per_s"] / base["pulls_per_s"]
                    rows.append(row)
                    if not a.json:
                        print_row(row, ds)
        finally:
            p.stdin.write('{"op":"shutdown"}\n')
            p.stdin.flush()
            p.wait(timeout=30)
    memory = None
    if a.memory:
        # The handle holds what the library holds (the same coordinator on its own thread).
        memory = memory_phase(a, [d for d in ds if d.split("@")[0] not in ("embed", "serve_all")])
        if not a.json:
            print(f"RSS per in-flight request, {a.memory} requests in batches of {a.memory_batch}, P TP2:")
            for d, r in memory.items():
                ratio = f"  {r['ratio']:.2f}x" if "ratio" in r else ""
                print(f"  {d:<13} {r['bytes_per_request']:8.0f} B{ratio}")
    if a.json:
        print(json.dumps({"rows": rows, "memory": memory}))


def layout_bench(a):
    """What layout ids save P and the wire: P (`prefill-sim`, its own process, TP1) driven by
    the Python D with vLLM 0.32's loop (layout in every pull) and 0.33's (layout omitted once P
    echoed the id), pairs interleaved; P's CPU per pull from the kernel's process clock, and the
    metadata bytes per pull the D sent."""
    rows = []
    for layers in (2, 64):
        p, ready = start_p(a, 1)
        try:
            cfg = {"batch": 1, "in_flight": 1, "requests": a.requests,
                   "bootstrap": ready["bootstrap"]}
            runs = {"0.32": [], "0.33": []}
            for i in range(a.pairs):
                for v in (["0.32", "0.33"] if i % 2 == 0 else ["0.33", "0.32"]):
                    pulls0, c0 = p_stats(p), cpu_s(p.pid)
                    r = run_py(a, cfg, vllm=v, layers=layers)
                    pulls, cpu = p_stats(p) - pulls0, cpu_s(p.pid) - c0
                    runs[v].append({"p_cpu_us_per_pull": cpu * 1e6 / max(1, pulls),
                                    "metadata_bytes_per_pull": r["metadata_bytes_per_pull"],
                                    "failed": r["failed"]})
            row = {"layers": layers, "pulls": a.requests, "pairs": a.pairs}
            for v, rs in runs.items():
                row[v] = median_of(rs)
            row["p_cpu_ratio"] = row["0.33"]["p_cpu_us_per_pull"] / row["0.32"]["p_cpu_us_per_pull"]
            rows.append(row)
            if not a.json:
                print(f"{layers:>2} layers: P CPU/pull {row['0.32']['p_cpu_us_per_pull']:.1f} us (layout every pull)"
                      f" -> {row['0.33']['p_cpu_us_per_pull']:.1f} us (layout ids), {row['p_cpu_ratio']:.2f}x;"
                      f" metadata {row['0.32']['metadata_bytes_per_pull']:.0f} B -> "
                      f"{row['0.33']['metadata_bytes_per_pull']:.0f} B per pull;"
                      f" failed {row['0.32']['failed']}/{row['0.33']['failed']}")
                sys.stdout.flush()
        finally:
            p.stdin.write('{"op":"shutdown"}\n')
            p.stdin.flush()
            p.wait(timeout=30)
    if a.json:
        print(json.dumps({"layout": rows}))


def print_row(row, ds):
    head = f"P TP{row['tp']} D TP1  batch {row['batch']:>2}  in flight {row['in_flight']:>3}"
    print(head)
    for k in ds:
        r = row[k]
        ratio = ""
        if "cpu_ratio" in r:
            cpu = "n/a" if r["cpu_ratio"] is None else f"{r['cpu_ratio']:.3f}x"
            ratio = f"  CPU {cpu}  pulls/s {r['pulls_ratio']:.2f}x"
        after = (f"  after last settle p99 {r['after_settle_p99_us']} us"
                 f" (observed {r['after_settle_observed_p99_us']} us)") if "after_settle_p99_us" in r else ""
        print(f"  {k:<13} CPU/req {r['cpu_us_per_request']:8.2f} us  pulls/s {r['pulls_per_s']:9.0f}"
              f"  p50 {r['p50_us']:8.0f} us  p99 {r['p99_us']:8.0f} us  failed {r['failed']}{ratio}{after}")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    d = sub.add_parser("py-d", help="the Python D alone (run by the driver)")
    d.add_argument("--bootstrap", required=True)
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--in-flight", type=int, default=1)
    d.add_argument("--requests", type=int, default=2000)
    d.add_argument("--hold", type=int, default=0, help="memory mode (driven by the driver)")
    d.add_argument("--vllm", choices=["0.32", "0.33"], default="0.33",
                   help="whose receive loop: 0.33 sends a layout id and omits the layout once P echoed it")
    d.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--kvrecv", default=os.path.join(HERE, "..", "target", "release", "kvrecv"))
    ap.add_argument("--before", help="a second kvrecv binary (e.g. main before a change): its Ds run "
                    "interleaved with --kvrecv's in the same pairs, as `lib@before` etc.")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--in-flight", default="1,16,64,256")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--ds", default="python,lib,embed,serve", help="Ds to run, comma-separated")
    ap.add_argument("--small", action="store_true", help="CI scale: TP2, batch 1 and 16, 16 in flight, 200 requests, 1 pair")
    ap.add_argument("--memory", type=int, default=100000,
                    help="requests held in flight for the RSS measurement (0: skip)")
    ap.add_argument("--memory-batch", type=int, default=256)
    ap.add_argument("--memory-only", action="store_true", help="skip the throughput grid")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layout", action="store_true",
                    help="only the layout-id bench: P CPU and metadata bytes per pull, 2 and 64 layers")
    a = ap.parse_args()
    if a.cmd == "py-d":
        asyncio.run(py_d(a))
        return
    if a.small:
        a.tp, a.batch, a.in_flight, a.requests, a.pairs = "2", "1,16", "16", 200, 1
        a.memory = min(a.memory, 2000)
    if a.layout:
        layout_bench(a)
        return
    main_driver(a)


if __name__ == "__main__":
    main()
