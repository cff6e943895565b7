//! A host that owns its own tokio runtime drives custom coordinator parts (the advanced path)
//! through the same handle as the front door.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use kvrecv::actors::block_ledger::DEFAULT_MAX_LIVE;
use kvrecv::actors::topology::StaticTopology;
use kvrecv::actors::{CoordinatorParts, EventSink, OpenedPull, ScriptedTransport};
use kvrecv::config::KvRecvConfig;
use kvrecv::embed::KvRecv;
use kvrecv::layout::KvLayout;
use kvrecv::messages::{BatchError, KvEvent, KvRequest, Outcome, ReqId, XferStatus};
use kvrecv::rdma::StaticLanding;
use tokio::sync::mpsc::UnboundedReceiver;

/// A handle on custom parts: one scripted peer of engine "e0", one layer of 8 blocks, at most
/// `max_live` requests live; the pulls it opens and every event come back with it.
fn scripted(
    max_live: usize,
) -> (
    KvRecv,
    UnboundedReceiver<OpenedPull>,
    UnboundedReceiver<KvEvent>,
) {
    let (tx, rx) = std::sync::mpsc::channel();
    let kv = KvRecv::from_parts(move || {
        let (transport, opened) = ScriptedTransport::new();
        let (events, rx) = EventSink::channel();
        tx.send((opened, rx)).unwrap();
        CoordinatorParts {
            config: KvRecvConfig {
                layout: KvLayout::uniform(1, 64, 8),
                max_live_requests: max_live,
                ..Default::default()
            },
            topology: Rc::new(StaticTopology::new([StaticTopology::grid("e0", 1, 1)])),
            transport: Rc::new(transport),
            landing: Arc::new(StaticLanding::new("127.0.0.1", 1, vec![0x1000])),
            events,
            builtin_pool: false,
        }
    })
    .unwrap();
    let (opened, events) = rx.recv().unwrap();
    (kv, opened, events)
}

/// A request of engine "e0" for `block`.
fn req(id: &str, block: u32) -> KvRequest {
    KvRequest {
        req_id: id.into(),
        transfer_id: Some(format!("t-{id}")),
        remote_engine_id: Some("e0".into()),
        remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
        block_ids: vec![vec![block]],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_runtime_loads_and_drains_through_the_handle() {
    let (kv, mut opened, mut events) = scripted(DEFAULT_MAX_LIVE);
    let r1 = || req("r1", 3);
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
    // The host drains at its next step; here the step comes once kvrecv released the blocks.
    released(&mut events, "r1").await;
    assert_eq!(
        kv.drain().await.unwrap().finished_recving,
        vec![ReqId::from("r1")]
    );
    kv.shutdown().await;
}

/// Wait (bounded) for kvrecv's event that `id`'s blocks were released.
async fn released(events: &mut UnboundedReceiver<KvEvent>, id: &str) -> Option<Outcome> {
    let mut outcome = None;
    let found = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(ev) = events.recv().await {
            match &ev {
                KvEvent::Completion {
                    req_id, outcome: o, ..
                } if &**req_id == id => outcome = Some(o.clone()),
                KvEvent::Released { req_id, .. } if &**req_id == id => return true,
                _ => {}
            }
        }
        false
    })
    .await;
    assert_eq!(found.ok(), Some(true), "{id} released");
    outcome
}

/// A topology whose first lookup waits for the test's go-ahead.
struct GatedTopology {
    gate: std::cell::RefCell<Option<tokio::sync::oneshot::Receiver<()>>>,
    inner: StaticTopology,
}

impl kvrecv::actors::TopologySource for GatedTopology {
    fn lookup(
        &self,
        bootstrap: &str,
        engine_id: &str,
    ) -> futures::future::LocalBoxFuture<
        'static,
        Result<kvrecv::actors::EngineTopology, kvrecv::actors::TopologyError>,
    > {
        let gate = self.gate.borrow_mut().take();
        let found = self.inner.lookup(bootstrap, engine_id);
        Box::pin(async move {
            if let Some(g) = gate {
                let _ = g.await;
            }
            found.await
        })
    }

    fn invalidate(&self, bootstrap: &str, engine_id: &str) {
        self.inner.invalidate(bootstrap, engine_id)
    }
}

/// An abort that arrives while the request's topology lookup is in flight: nothing is ever sent
/// for it (no peer has its addresses), it completes Failed at once, before the lookup ends, and
/// its blocks come back. The id, drained, may be loaded again while the first lookup still
/// runs: that new request is sent once the lookup ends, the aborted one never is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_before_dispatch_fails_the_request_without_sending_it() {
    let (tx, rx) = std::sync::mpsc::channel();
    let (go, gate) = tokio::sync::oneshot::channel();
    let kv = KvRecv::from_parts(move || {
        let (transport, opened) = ScriptedTransport::new();
        let (events, released) = EventSink::channel();
        tx.send((opened, released)).unwrap();
        CoordinatorParts {
            config: KvRecvConfig {
                layout: KvLayout::uniform(1, 64, 8),
                ..Default::default()
            },
            topology: Rc::new(GatedTopology {
                gate: std::cell::RefCell::new(Some(gate)),
                inner: StaticTopology::new([StaticTopology::grid("e0", 1, 1)]),
            }),
            transport: Rc::new(transport),
            landing: Arc::new(StaticLanding::new("127.0.0.1", 1, vec![0x1000])),
            events,
            builtin_pool: false,
        }
    })
    .unwrap();
    let (mut opened, mut events) = rx.recv().unwrap();
    let r = KvRequest {
        req_id: "r1".into(),
        transfer_id: Some("t1".into()),
        remote_engine_id: Some("e0".into()),
        remote_bootstrap_addr: Some("http://127.0.0.1:1".into()),
        block_ids: vec![vec![3]],
    };
    assert_eq!(kv.load_kv(vec![r.clone()]).await.unwrap().awaiting, 1);
    let ab = kv.abort("r1").await.unwrap();
    assert!(ab.before_dispatch, "{ab:?}");
    // The host's next step, once kvrecv released the blocks: the failure's invalid blocks
    // and the completion in one drain, the failure first.
    let outcome = released(&mut events, "r1").await;
    assert!(
        matches!(
            outcome,
            Some(Outcome::Failed {
                cause: kvrecv::Cause::Aborted,
                peer: None,
                ..
            })
        ),
        "{outcome:?}"
    );
    let step = kv.drain().await.unwrap();
    assert_eq!(
        step.finished_recving,
        vec![ReqId::from("r1")],
        "before the lookup ends"
    );
    assert_eq!(step.invalid_block_ids, vec![3]);
    // The same id again, blocks 4, while the first lookup is still held.
    let again = KvRequest {
        block_ids: vec![vec![4]],
        ..r.clone()
    };
    assert_eq!(kv.load_kv(vec![again]).await.unwrap().awaiting, 1);
    go.send(()).unwrap();
    let pull = tokio::time::timeout(std::time::Duration::from_secs(30), opened.recv())
        .await
        .expect("the new request is sent")
        .expect("transport open");
    let md = pull.metadata();
    let blocks: Vec<_> = md.req_blocks.values().map(|(_, b)| b.clone()).collect();
    assert_eq!(blocks, vec![vec![vec![4]]], "only the new request, once");
    assert!(opened.try_recv().is_err(), "one pull");
    kv.shutdown().await;
}

/// The README's embedding example carries a vLLM `kv_transfer_config`: it must be one kvrecv
/// accepts, layout included (a new user copies it as is).
#[test]
fn the_readme_kv_transfer_config_is_accepted() {
    let readme = include_str!("../README.md");
    let start = readme
        .find("const KV_TRANSFER_CONFIG: &str = r#\"")
        .expect("the README shows a kv_transfer_config")
        + "const KV_TRANSFER_CONFIG: &str = r#\"".len();
    let len = readme[start..].find("\"#;").expect("raw string end");
    let json = &readme[start..start + len];
    let cfg = kvrecv::config::KvRecvConfig::from_kv_transfer_config(json)
        .unwrap_or_else(|e| panic!("README config refused: {e}"));
    assert_eq!(cfg.layout.regions.len(), 2);
    assert_eq!(cfg.layout.num_blocks, 16);
}

/// `submit` queues a batch at once and in order, and its reply waits in the ticket: read
/// without ever awaiting it, once the batch's pull is out (the Receiver answers before any
/// Peer has the pull). After shutdown a ticket says the worker stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submitted_batches_keep_their_order_and_their_replies_wait_in_the_ticket() {
    let (kv, mut opened, _events) = scripted(DEFAULT_MAX_LIVE);
    // Neither ticket is polled before both batches are queued: the second is refused only if
    // the first was taken before it.
    let first = kv.submit(vec![req("r1", 1)]);
    let second = kv.submit(vec![req("r1", 2), req("r2", 3)]);
    let pull = tokio::time::timeout(Duration::from_secs(10), opened.recv())
        .await
        .unwrap()
        .unwrap();
    let first = first
        .try_reply()
        .expect("answered before the pull went out")
        .unwrap();
    assert_eq!((first.awaiting, first.rejected.len()), (1, 0));
    let second = second.await.unwrap();
    assert_eq!(second.awaiting, 1);
    assert!(
        matches!(&second.rejected[..], [BatchError::AlreadyLive { req_id }] if req_id == "r1"),
        "{second:?}"
    );
    // A `load_kv` after a `submit` is taken after it too.
    let third = kv.submit(vec![req("r3", 4)]);
    let again = kv.load_kv(vec![req("r3", 5)]).await.unwrap();
    assert!(
        matches!(&again.rejected[..], [BatchError::AlreadyLive { .. }]),
        "{again:?}"
    );
    assert_eq!(third.await.unwrap().awaiting, 1);
    drop(pull);
    kv.shutdown().await;
    let late = kv.submit(vec![req("r4", 6)]);
    assert!(matches!(
        late.await,
        Err(kvrecv::embed::KvRecvError::Stopped)
    ));
}

/// Requests submitted and not yet taken count against `max_live_requests`: a batch that would
/// go over it is refused at once, whole, as backpressure (the ticket holds the reply before
/// kvrecv saw anything); once kvrecv took a batch its requests count as live instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submits_over_the_live_limit_are_refused_at_once_as_backpressure() {
    // Pulls stay open, unanswered.
    let (kv, _opened, _events) = scripted(3);
    let over = kv
        .submit((0..4).map(|i| req(&format!("o{i}"), i)).collect())
        .try_reply()
        .expect("refused before kvrecv saw it")
        .unwrap();
    assert_eq!((over.accepted, over.rejected.len()), (0, 4));
    // A batch over the limit itself can never fit: said so, not "drain, then retry".
    assert!(over.rejected.iter().all(|e| matches!(
        e,
        BatchError::BatchOverLimit {
            batch: 4,
            limit: 3,
            ..
        }
    )));
    assert!(
        over.rejected[0]
            .to_string()
            .contains("submit smaller batches"),
        "{}",
        over.rejected[0]
    );
    // Nothing of it was loaded: its ids and blocks are free.
    let first = kv.submit(vec![req("o0", 0), req("o1", 1)]).await.unwrap();
    assert_eq!((first.awaiting, first.rejected.len()), (2, 0));
    // Taken, those two no longer count as queued: this batch reaches kvrecv, whose live limit
    // takes one of the two (queued ones still counted, both would be refused here).
    let second = kv.submit(vec![req("o2", 2), req("o3", 3)]).await.unwrap();
    assert_eq!(second.awaiting, 1, "{second:?}");
    assert!(
        matches!(&second.rejected[..], [BatchError::Backpressure { .. }]),
        "{second:?}"
    );
    kv.shutdown().await;
}
