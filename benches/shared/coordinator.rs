// The body of `benches/core.rs` and `benches/core_mimalloc.rs` (see `core.rs`).

use std::cell::RefCell;
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
use kvrecv::messages::{KvEvent, KvRequest, LoadKv, MooncakeXferResponse, PeerId, XferStatus};
use kvrecv::rdma::StaticLanding;

include!("instant_peer.rs");

const BATCHES: [usize; 2] = [1, 64];

/// How a sample's requests reach the coordinator.
#[derive(Clone, Copy, PartialEq)]
enum Harness {
    /// Every batch of the sample built before the clock starts, the sample timed whole.
    Prebuilt,
    /// Each batch built just before it is loaded, as a host builds what it loads, and timed
    /// alone (its two clock reads, ~50 ns, are counted): the requests are in cache and the
    /// allocator takes back the host's allocations as fast as the host makes them. Prebuilt,
    /// a sample's requests (up to tens of thousands of batches) are read from memory long
    /// since cold, and freeing them outruns glibc's per-thread cache.
    Fresh,
}

fn bench(c: &mut Criterion) {
    for harness in [Harness::Prebuilt, Harness::Fresh] {
        bench_with(c, harness);
    }
}

fn bench_with(c: &mut Criterion, harness: Harness) {
    let layers: u32 = std::env::var("LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let mut g = c.benchmark_group(match harness {
        Harness::Prebuilt => "core_requests",
        Harness::Fresh => "core_requests_fresh",
    });
    g.measurement_time(Duration::from_secs(4));
    for (batch, peers) in BATCHES
        .into_iter()
        .flat_map(|b| [1u32, 2, 4].map(|p| (b, p)))
    {
        g.throughput(Throughput::Elements(batch as u64));
        let sys = actix::System::new();
        let reply = Rc::new(RefCell::new(Vec::new()));
        let transport = Rc::new(InstantPeer {
            reply: reply.clone(),
        });
        let (coord, events) = sys.block_on(async { start_coordinator(transport, peers, layers) });
        let mut events = Some(events);
        let next = Rc::new(std::cell::Cell::new(0u64));
        let id = BenchmarkId::new(format!("batch{batch}"), format!("peers{peers}"));
        g.bench_with_input(id, &peers, |b, _| {
            b.iter_custom(|iters| {
                // Prebuilt: every batch's requests and P's answer, made before the clock starts.
                let mut n = next.get();
                let prebuilt: Vec<(Vec<KvRequest>, Vec<u8>)> = match harness {
                    Harness::Prebuilt => (0..iters).map(|_| make_batch(batch, &mut n)).collect(),
                    Harness::Fresh => Vec::new(),
                };
                next.set(n);
                // The host's loop is a task on the actors' thread (as `kvrecv bench --via
                // actors` runs it), not the runtime's root future: every wake of that one
                // goes through the driver (an eventfd write and an epoll turn), a cost of the
                // harness, not of the coordinator.
                let (coord, reply, next) = (coord.clone(), reply.clone(), next.clone());
                let mut rx = events.take().expect("returned by the last run");
                let host = async move {
                    let mut batches = prebuilt.into_iter();
                    let mut timed = Duration::ZERO;
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        let (requests, answer, started) = match harness {
                            Harness::Prebuilt => {
                                let (r, a) = batches.next().expect("one per iteration");
                                (r, a, None)
                            }
                            Harness::Fresh => {
                                let mut n = next.get();
                                let (r, a) = make_batch(batch, &mut n);
                                next.set(n);
                                (r, a, Some(Instant::now()))
                            }
                        };
                        *reply.borrow_mut() = answer;
                        coord.receiver.send(LoadKv { requests }).await.unwrap();
                        // The host's step comes once kvrecv said the batch's blocks are free
                        // (a release is announced after it is ready to drain): one drain.
                        let mut released = 0;
                        while released < batch {
                            if let Some(KvEvent::Released { .. }) = rx.recv().await {
                                released += 1;
                            }
                        }
                        let step = coord.drain().await.unwrap();
                        assert_eq!(step.finished_recving.len(), batch);
                        if let Some(t) = started {
                            timed += t.elapsed();
                        }
                    }
                    let elapsed = match harness {
                        Harness::Prebuilt => t0.elapsed(),
                        Harness::Fresh => timed,
                    };
                    (elapsed, rx)
                };
                let (elapsed, rx) = sys.block_on(async { actix::spawn(host).await.unwrap() });
                events = Some(rx);
                elapsed
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
