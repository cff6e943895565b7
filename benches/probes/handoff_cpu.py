"""What one hand-off between two processes costs each side in CPU time (what /proc counts), by
where they run: A and B ping-pong one byte over two pipes, each blocked in read(2) until the
other writes; A's thread CPU time (`time.thread_time_ns`) is summed separately over its write(2)
calls (waking B) and its read(2) calls (asleep until B's write wakes it), per round trip, over
20,000 round trips. On a VM whose idle vCPUs halt at once, a hand-off to a process on the other,
idle, CPU is an inter-processor interrupt for the waker and an idle exit for the woken one,
and both show up as the thread's own CPU time; on one CPU it is a run-queue insert.

`kvrecv serve` has two such hand-offs per batch that the library and the Python D do not (its
host's line waking it, its completions waking the host): the host is a third process, and on
two CPUs it, serve and P cannot all share one.

  python3 benches/probes/handoff_cpu.py 0 0      # A on CPU 0, B on CPU 0
  python3 benches/probes/handoff_cpu.py 0 1      # A on CPU 0, B on CPU 1
"""
import os
import sys
import time

N = 20000
a_cpu, b_cpu = int(sys.argv[1]), int(sys.argv[2])
r1, w1 = os.pipe()
r2, w2 = os.pipe()
if os.fork() == 0:
    os.sched_setaffinity(0, {b_cpu})
    for _ in range(N + 100):
        os.read(r1, 1)
        os.write(w2, b"x")
    os._exit(0)
os.sched_setaffinity(0, {a_cpu})
clock = time.thread_time_ns
wake = sleep = 0
for i in range(N + 100):
    t0 = clock()
    os.write(w1, b"x")
    t1 = clock()
    os.read(r2, 1)
    t2 = clock()
    if i >= 100:  # after a warm-up
        wake += t1 - t0
        sleep += t2 - t1
os.wait()
print(f"A on CPU {a_cpu}, B on CPU {b_cpu}: per round trip, A's CPU in write(2) waking B "
      f"{wake / N / 1000:.1f} us, in read(2) until woken {sleep / N / 1000:.1f} us")
