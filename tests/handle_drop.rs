//! Where kvrecv's threads run, and that dropping the last handle waits for them (its actors'
//! thread, the data target's runtime and libzmq's threads), so that nothing of the worker can
//! write into the host's memory once the drop returned: a host that leaves early (`?`) frees
//! its KV cache right after. By default nothing is pinned (a library leaves its host's thread
//! placement alone); asked to, the control plane is pinned to one CPU. Alone in its binary: it
//! counts this process's threads by name (its tests take turns).

use std::time::{Duration, Instant};

use kvrecv::config::KvRecvConfig;
use kvrecv::control::{ControlCpu, ZmqTransportConfig};
use kvrecv::layout::KvLayout;
use kvrecv::{HostMemory, KvRecv, KvRecvBuilder};

/// The tests count every kvrecv thread of the process: one at a time.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The kernel's flag of a task inside `exit()`: past its last instruction of user code, and
/// already joined as far as `pthread_join` is concerned; it stays listed in /proc until the
/// kernel has released it, which on a busy CPU takes a while.
const PF_EXITING: u64 = 0x4;

/// One thread of this process: its name and the CPUs it may run on.
#[derive(Debug, Clone)]
struct Task {
    name: String,
    cpus: String,
}

/// kvrecv's threads still running code: named `kvrecv*` and not exiting.
fn kvrecv_threads() -> Vec<Task> {
    std::fs::read_dir("/proc/self/task")
        .expect("procfs")
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            // After the name's `)`: state, ppid, pgrp, session, tty_nr, tpgid, flags.
            let flags: u64 = stat[stat.rfind(')')? + 2..]
                .split(' ')
                .nth(6)?
                .parse()
                .ok()?;
            (flags & PF_EXITING == 0).then(|| Task {
                name: comm.trim().to_owned(),
                cpus: cpus(dir.join("status")),
            })
        })
        .filter(|t| t.name.starts_with("kvrecv"))
        .collect()
}

fn cpus(status: impl AsRef<std::path::Path>) -> String {
    std::fs::read_to_string(status)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// kvrecv's threads once `actors` threads are named `kvrecv`: a thread the actors' thread
/// just spawned (the data runtime's) carries its name until it names itself `kvrecv-io`,
/// which it does first thing. Gives up after 5 s (then the assertions say what is there).
fn settled(actors: usize) -> Vec<Task> {
    let t0 = Instant::now();
    loop {
        let now = kvrecv_threads();
        let named = now.iter().filter(|t| t.name == "kvrecv").count();
        if named == actors || t0.elapsed() > Duration::from_secs(5) {
            return now;
        }
        std::thread::yield_now();
    }
}

/// A worker on memory the host hands over (two layers of 8 blocks).
fn builder() -> KvRecvBuilder {
    KvRecv::builder(KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, 8),
        ..KvRecvConfig::default()
    })
    .host_memory(HostMemory::owned(vec![vec![0u8; 8 * 4096]; 2]).unwrap())
}

fn count(threads: &[Task], name: &str) -> usize {
    threads.iter().filter(|t| t.name == name).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_pin_nothing_and_the_last_handle_dropped_leaves_no_kvrecv_thread() {
    let _alone = ALONE.lock().await;
    let all = cpus("/proc/thread-self/status");
    assert!(
        all.contains(['-', ',']),
        "this test needs a process allowed more than one CPU, got {all}"
    );
    for round in 0..3 {
        let one = builder().start().unwrap();
        let two = builder().start().unwrap();
        let clone = one.clone();
        let threads = settled(2);
        assert_eq!(
            count(&threads, "kvrecv"),
            2,
            "one actors' thread each: {threads:?}"
        );
        // libzmq's I/O thread and reaper, per instance, under a name of their own.
        assert!(count(&threads, "kvrecv-zmq") >= 4, "{threads:?}");
        assert!(count(&threads, "kvrecv-io") >= 2, "{threads:?}");
        // The data connections' thread, one per instance by default.
        assert_eq!(count(&threads, "kvrecv-conn-0"), 2, "{threads:?}");
        assert_eq!(count(&threads, "kvrecv-conn-1"), 0, "{threads:?}");
        for t in &threads {
            assert_eq!(t.cpus, all, "{} pinned by default: {threads:?}", t.name);
        }
        assert_eq!(
            cpus("/proc/thread-self/status"),
            all,
            "the host's own thread is left as it was"
        );
        assert!(clone.drain().await.unwrap().is_empty());
        drop(one);
        drop(clone);
        drop(two);
        let left: Vec<String> = kvrecv_threads().into_iter().map(|t| t.name).collect();
        assert_eq!(left, Vec::<String>::new(), "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asked_to_the_control_plane_runs_on_one_cpu() {
    let _alone = ALONE.lock().await;
    let all = cpus("/proc/thread-self/status");
    let kv = builder()
        .zmq(ZmqTransportConfig {
            control_cpu: ControlCpu::Current,
            ..ZmqTransportConfig::default()
        })
        .start()
        .unwrap();
    let threads = settled(1);
    let actors: Vec<&Task> = threads.iter().filter(|t| t.name == "kvrecv").collect();
    assert_eq!(actors.len(), 1, "{threads:?}");
    let cpu = &actors[0].cpus;
    assert!(cpu.parse::<usize>().is_ok(), "actors on one CPU: {cpu}");
    // libzmq's I/O thread is placed on it; its reaper inherits the actors' thread's mask.
    let zmq: Vec<&Task> = threads.iter().filter(|t| t.name == "kvrecv-zmq").collect();
    assert!(zmq.len() >= 2, "{threads:?}");
    for t in zmq {
        assert_eq!(&t.cpus, cpu, "{threads:?}");
    }
    // The data plane's threads (its runtime's, the connections') gave the pinned CPU back.
    assert_eq!(count(&threads, "kvrecv-conn-0"), 1, "{threads:?}");
    for t in threads
        .iter()
        .filter(|t| t.name == "kvrecv-io" || t.name.starts_with("kvrecv-conn-"))
    {
        assert_eq!(t.cpus, all, "{threads:?}");
    }
    assert_eq!(cpus("/proc/thread-self/status"), all, "the host's thread");
    drop(kv);
    assert!(kvrecv_threads().is_empty(), "{:?}", kvrecv_threads());
}
