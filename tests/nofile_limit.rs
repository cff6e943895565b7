//! `RLIMIT_NOFILE`: kvrecv raises the process's soft limit to the hard one when its transport
//! starts, unless the host turned that off (a host that keeps a low limit on purpose). Alone in
//! its binary: the limit is process-wide.

use kvrecv::config::KvRecvConfig;
use kvrecv::control::ZmqTransportConfig;
use kvrecv::layout::KvLayout;
use kvrecv::KvRecv;
use rlimit::Resource;

fn worker(raise: bool) -> KvRecv {
    KvRecv::builder(KvRecvConfig {
        layout: KvLayout::uniform(1, 4096, 4),
        ..KvRecvConfig::default()
    })
    .zmq(ZmqTransportConfig {
        raise_nofile_limit: raise,
        ..ZmqTransportConfig::default()
    })
    .start()
    .unwrap()
}

#[tokio::test]
async fn the_fd_limit_is_raised_only_when_the_host_lets_it() {
    let (_, hard) = Resource::NOFILE.get().unwrap();
    let low = 256.min(hard);
    Resource::NOFILE.set(low, hard).unwrap();
    let kv = worker(false);
    assert_eq!(
        Resource::NOFILE.get().unwrap().0,
        low,
        "left as the host set it"
    );
    kv.shutdown().await;
    let kv = worker(true);
    assert_eq!(
        Resource::NOFILE.get().unwrap().0,
        hard,
        "raised to the hard limit"
    );
    kv.shutdown().await;
}
