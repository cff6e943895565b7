//! The coordinator core alone: requests through Receiver -> Peer (a transport that answers
//! FINISH ok at once) -> RequestAggregator -> BlockManager, for 1, 2 and 4 peers, batches of 1
//! and 64, events on (an observer drains them, as `serve` does).
//!
//! `cargo bench --bench core` ; per-request cost = time per batch / batch size.

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use futures::stream;

use kvrecv::actors::topology::StaticTopology;
use kvrecv::actors::{
    CleanFinish, Coordinator, CoordinatorParts, EventSink, PeerTransport, ReplyStream,
};
use kvrecv::config::KvRecvConfig;
use kvrecv::layout::KvLayout;
use kvrecv::messages::{
    KvRequest, LoadKv, MooncakeXferMetadata, MooncakeXferResponse, PeerId, XferStatus,
};
use kvrecv::rdma::StaticLanding;

/// A peer that has everything ready: one FINISH naming every request.
struct InstantPeer;

impl PeerTransport for InstantPeer {
    fn pull(&self, _peer: &PeerId, request: Vec<u8>, _finish: CleanFinish) -> ReplyStream {
        let md = MooncakeXferMetadata::decode(&request).expect("own metadata");
        let mut r = MooncakeXferResponse::new(XferStatus::Finish);
        r.ok_reqs = Some(md.req_blocks.into_keys().collect());
        Box::pin(stream::iter([Ok(vec![r.encode().unwrap()])]))
    }
}

const BATCHES: [usize; 2] = [1, 64];

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("core_requests");
    g.measurement_time(Duration::from_secs(4));
    for (batch, peers) in BATCHES
        .into_iter()
        .flat_map(|b| [1u32, 2, 4].map(|p| (b, p)))
    {
        g.throughput(Throughput::Elements(batch as u64));
        let sys = actix::System::new();
        let coord = sys.block_on(async {
            let (events, mut rx) = EventSink::channel();
            actix::spawn(async move { while rx.recv().await.is_some() {} });
            Coordinator::start(CoordinatorParts {
                config: KvRecvConfig {
                    layout: KvLayout::uniform(2, 64, 1024),
                    ..Default::default()
                },
                topology: Rc::new(StaticTopology::new([StaticTopology::grid("e0", peers, 1)])),
                transport: Rc::new(InstantPeer),
                landing: Arc::new(StaticLanding::new("127.0.0.1", 1, vec![0x1000, 0x100_0000])),
                events,
                builtin_pool: false,
            })
        });
        let mut next = 0u64;
        let id = BenchmarkId::new(format!("batch{batch}"), format!("peers{peers}"));
        g.bench_with_input(id, &peers, |b, _| {
            b.iter_custom(|iters| {
                sys.block_on(async {
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        let requests = (0..batch)
                            .map(|i| {
                                next += 1;
                                KvRequest {
                                    req_id: format!("r{next}"),
                                    transfer_id: Some(format!("t{next}")),
                                    remote_engine_id: Some("e0".into()),
                                    remote_bootstrap_addr: Some("http://b:1".into()),
                                    block_ids: vec![vec![i as u32]],
                                }
                            })
                            .collect();
                        coord.receiver.send(LoadKv { requests }).await.unwrap();
                        // The host's step loop: drain until the whole batch completed.
                        let mut finished = 0;
                        while finished < batch {
                            finished += coord.drain().await.unwrap().finished_recving.len();
                        }
                    }
                    t0.elapsed()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
