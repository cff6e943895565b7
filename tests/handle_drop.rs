//! Dropping the last handle waits for kvrecv's threads (its actors' thread and the data
//! target's runtime) — which run where they should, the actors' thread on one CPU — so that nothing of the worker can write into the host's memory once the
//! drop returned: a host that leaves early (`?`) frees its KV cache right after. Alone in its
//! binary: it counts this process's threads by name.

use kvrecv::config::KvRecvConfig;
use kvrecv::layout::KvLayout;
use kvrecv::{HostMemory, HostRegion, KvRecv};

/// The kernel's flag of a task inside `exit()`: past its last instruction of user code, and
/// already joined as far as `pthread_join` is concerned; it stays listed in /proc until the
/// kernel has released it, which on a busy CPU (the control plane's is pinned) takes a while.
const PF_EXITING: u64 = 0x4;

/// kvrecv's threads still running code: named `kvrecv*` and not exiting.
fn kvrecv_threads() -> Vec<String> {
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
            (flags & PF_EXITING == 0).then(|| comm.trim().to_owned())
        })
        .filter(|c| c.starts_with("kvrecv"))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_handle_dropped_leaves_no_kvrecv_thread() {
    let mut kv_cache = vec![vec![0u8; 8 * 4096]; 2];
    for round in 0..3 {
        let regions = kv_cache
            .iter_mut()
            // SAFETY: the Vecs outlive the worker: the drop below waits for its threads.
            .map(|v| unsafe { HostRegion::new(v.as_mut_ptr(), v.len()) })
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let kv = KvRecv::builder(KvRecvConfig {
            layout: KvLayout::uniform(2, 4096, 8),
            ..KvRecvConfig::default()
        })
        .host_memory(HostMemory::new(regions))
        .start()
        .unwrap();
        let clone = kv.clone();
        assert!(!kvrecv_threads().is_empty(), "the worker runs");
        // Its actors' thread pinned to one CPU (ZmqTransportConfig::control_cpu), its data
        // runtime's threads and the host's own left with every CPU.
        let all = cpus("/proc/thread-self/status");
        let mut actors = 0;
        for t in std::fs::read_dir("/proc/self/task").unwrap() {
            let dir = t.unwrap().path();
            let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            match name.trim() {
                "kvrecv" => {
                    let one = cpus(dir.join("status"));
                    if one.parse::<usize>().is_ok() {
                        actors += 1;
                        continue;
                    }
                    // A thread the worker's thread just spawned carries its name until it names
                    // itself (the data runtime's, as `kvrecv-io`): wait for that rename, which
                    // the thread does first thing; one that keeps the name unpinned is a failure.
                    let t0 = std::time::Instant::now();
                    let renamed = loop {
                        let now = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
                        if now.trim() != "kvrecv" {
                            break true;
                        }
                        if t0.elapsed() > std::time::Duration::from_secs(5) {
                            break false;
                        }
                        std::thread::yield_now();
                    };
                    assert!(renamed, "a kvrecv thread on more than one CPU: {one}");
                }
                "kvrecv-io" => assert_eq!(cpus(dir.join("status")), all),
                _ => {}
            }
        }
        // libzmq's threads, once a pull made them, carry their creator's name and CPU.
        assert!(actors >= 1);
        assert!(clone.drain().await.unwrap().is_empty());
        drop(kv);
        drop(clone);
        assert_eq!(kvrecv_threads(), Vec::<String>::new(), "round {round}");
    }
}
