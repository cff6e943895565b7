//! The bench's CPU measure (`kvrecv::repro::bench::process_cpu_s`, what `kvrecv bench` reports
//! per request) counts CPU, not time, and agrees with /proc's utime + stime. One test in its own
//! binary: no other test thread spends CPU in this process meanwhile.

use std::time::Duration;

use kvrecv::repro::bench::{proc_stat_cpu_s, process_cpu_s};

#[test]
fn process_cpu_is_cpu_time_and_agrees_with_proc() {
    let c0 = process_cpu_s().unwrap();
    // The thing measured is a sleep: it must cost (next to) no CPU.
    std::thread::sleep(Duration::from_millis(200));
    let slept = process_cpu_s().unwrap() - c0;
    assert!(slept < 0.02, "a 200 ms sleep cost {slept} s of CPU");

    let (c0, p0) = (process_cpu_s().unwrap(), proc_stat_cpu_s().unwrap());
    let mut x = 0u64;
    while process_cpu_s().unwrap() - c0 < 0.3 {
        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
    }
    let clock = process_cpu_s().unwrap() - c0;
    let ticks = proc_stat_cpu_s().unwrap() - p0;
    // /proc rounds each reading down to 10 ms ticks.
    assert!(
        (clock - ticks).abs() <= 0.05,
        "clock {clock} s vs /proc {ticks} s"
    );
}
