// A transport that answers every pull at once with the current batch's FINISH, and the batches
// it answers: shared by `benches/core.rs` (through `coordinator.rs`) and `examples/core_loop.rs`.

/// A peer that has everything ready: the current batch's FINISH, naming every request.
struct InstantPeer {
    reply: Rc<RefCell<Vec<u8>>>,
}

impl PeerTransport for InstantPeer {
    fn pull(&self, _peer: &PeerId, _request: Vec<u8>, _finish: CleanFinish) -> ReplyStream {
        Box::pin(stream::iter([Ok(vec![self.reply.borrow().clone()])]))
    }
}

/// The FINISH naming `ids`, as P would encode it.
fn finish(ids: Vec<String>) -> Vec<u8> {
    let mut r = MooncakeXferResponse::new(XferStatus::Finish);
    r.ok_reqs = Some(ids);
    r.encode().unwrap()
}

/// Batch `batch` of requests numbered from `next`, and the FINISH naming them.
fn make_batch(batch: usize, next: &mut u64) -> (Vec<KvRequest>, Vec<u8>) {
    let requests: Vec<KvRequest> = (0..batch)
        .map(|i| {
            *next += 1;
            KvRequest {
                req_id: format!("r{next}"),
                transfer_id: Some(format!("t{next}")),
                remote_engine_id: Some("e0".into()),
                remote_bootstrap_addr: Some("http://b:1".into()),
                block_ids: vec![vec![i as u32]],
            }
        })
        .collect();
    let ids = requests.iter().map(|r| r.req_id.clone()).collect();
    (requests, finish(ids))
}

/// The coordinator over `transport` for one engine of `peers` peers and `layers` layers, on a
/// static landing, with its event stream (call inside the actix system).
fn start_coordinator(
    transport: Rc<InstantPeer>,
    peers: u32,
    layers: u32,
) -> (Coordinator, tokio::sync::mpsc::UnboundedReceiver<KvEvent>) {
    let (events, rx) = EventSink::channel();
    let coord = Coordinator::start(CoordinatorParts {
        config: KvRecvConfig {
            layout: KvLayout::uniform(layers, 64, 1024),
            ..Default::default()
        },
        topology: Rc::new(StaticTopology::new([StaticTopology::grid("e0", peers, 1)])),
        transport,
        landing: Arc::new(StaticLanding::new(
            "127.0.0.1",
            1,
            (0..layers as u64).map(|i| 0x1000 + (i << 24)).collect(),
        )),
        events,
        builtin_pool: false,
    });
    (coord, rx)
}
