"""What a pipe write that wakes a sleeping reader costs the writer, by where the reader runs:
the writer on CPU W writes 1,584 bytes (a batch of 16 completion lines) to a reader blocked in
read(2) on CPU R (`any`: not pinned), which answers one byte after WORK µs of busy work; the
writer's write(2) is timed alone (wall clock, p50 and p90 of 5,000). On a VM whose idle vCPUs
halt at once, waking a reader on an idle CPU is an inter-processor interrupt the writer waits
for; this is the cost `kvrecv serve` pays per stdout write that wakes its host.

  python3 benches/probes/pipe_wake.py W R WORK      # e.g. 1 1 0, then 1 0 0
"""
import os, sys, time
N = 5000
w_cpu, r_cpu, work = sys.argv[1], sys.argv[2], float(sys.argv[3]) * 1e-6
r1, w1 = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w1)
    if r_cpu != "any":
        os.sched_setaffinity(0, {int(r_cpu)})
    while True:
        if not os.read(r1, 65536):
            os._exit(0)
        t = time.perf_counter()
        while time.perf_counter() - t < work:
            pass
        os.write(w2, b"x")
if w_cpu != "any":
    os.sched_setaffinity(0, {int(w_cpu)})
msg, ws = b"y" * 1584, []
for _ in range(N):
    time.sleep(0.0002)  # the reader is blocked in read(2) by now
    t0 = time.perf_counter(); os.write(w1, msg); ws.append(time.perf_counter() - t0)
    os.read(r2, 1)
ws.sort()
print(f"writer CPU {w_cpu}, reader CPU {r_cpu}, reader work {sys.argv[3]} us: "
      f"write(2) p50 {ws[N // 2] * 1e6:.1f} us, p90 {ws[N * 9 // 10] * 1e6:.1f} us")
os.close(w1); os.waitpid(pid, 0)
