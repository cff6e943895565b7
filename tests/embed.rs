//! A host that owns its own tokio runtime drives the coordinator through `KvRecvHandle`.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::topology::StaticTopology;
use kvrecv::actors::{CoordinatorParts, EventSink, ScriptedTransport};
use kvrecv::config::KvRecvConfig;
use kvrecv::embed::KvRecvHandle;
use kvrecv::layout::KvLayout;
use kvrecv::messages::{BatchError, KvRequest, ReqId, XferStatus};
use kvrecv::rdma::StaticLanding;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_runtime_loads_and_drains_through_the_handle() {
    let (tx, rx) = std::sync::mpsc::channel();
    let kv = KvRecvHandle::spawn(move || {
        let (transport, opened) = ScriptedTransport::new();
        tx.send(opened).unwrap();
        CoordinatorParts {
            config: KvRecvConfig {
                layout: KvLayout::uniform(1, 64, 8),
                ..Default::default()
            },
            topology: Rc::new(StaticTopology::new([StaticTopology::grid("e0", 1, 1)])),
            transport: Rc::new(transport),
            landing: Arc::new(StaticLanding::new("127.0.0.1", 1, vec![0x1000])),
            events: EventSink::none(),
            builtin_pool: false,
        }
    })
    .unwrap();
    let mut opened = rx.recv().unwrap();
    let r1 = || KvRequest {
        req_id: "r1".into(),
        transfer_id: Some("t1".into()),
        remote_engine_id: Some("e0".into()),
        remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
        block_ids: vec![vec![3]],
    };
    let reply = kv.load_kv(vec![r1()]).await.unwrap();
    assert_eq!(reply.awaiting, 1);
    let twice = kv.load_kv(vec![r1()]).await.unwrap();
    assert!(
        matches!(&twice.rejected[..], [BatchError::AlreadyLive { .. }]),
        "a request in flight cannot be loaded again: {twice:?}"
    );
    let pull = tokio::time::timeout(Duration::from_secs(10), opened.recv())
        .await
        .unwrap()
        .unwrap();
    pull.respond(XferStatus::Finish, &["r1"], &[], None);
    // The host polls once per step, as a scheduler does.
    let mut finished = vec![];
    for _ in 0..10_000 {
        finished.extend(kv.drain().await.unwrap().finished_recving);
        if !finished.is_empty() {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(finished, vec![ReqId::from("r1")]);
    kv.shutdown();
}
