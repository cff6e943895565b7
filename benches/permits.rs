//! The landing-permit table on its own: one batch's permits opened (one pull per peer, the same
//! requests in each, as the coordinator opens them), then each request checked (`verify_ok`) and
//! revoked, as the BlockManager does at its completion. This is the data plane's share of
//! `kvrecv serve`'s CPU per request (A/B of serve with `--no-permits`: about 9% at batch 16).
//!
//! `cargo bench --bench permits` ; per-request cost = time per batch / batch size.

use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use kvrecv::layout::KvLayout;
use kvrecv::messages::ids::next_pull_ids;
use kvrecv::messages::{PeerId, RequestMeta};
use kvrecv::rdma::tcp::permits::PermitTable;
use kvrecv::rdma::tcp::windows::WindowMap;
use kvrecv::rdma::{PullWindow, RevokeRequest};

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("permits");
    for &(peers, batch) in &[(2usize, 16usize), (2, 1), (4, 64)] {
        let blocks = batch as u32;
        let map = WindowMap::new(&KvLayout::uniform(2, 4096, blocks), 0x7e00_0000_0000, 1024)
            .expect("window map");
        let table = PermitTable::new(Arc::new(map), true);
        let peer_ids: Vec<PeerId> = (0..peers)
            .map(|p| PeerId::new(format!("tcp://127.0.0.1:{}", 20000 + p)))
            .collect();
        // Built once: every iteration revokes each request, so the same ids are open again in
        // the next one, and only the table's work is timed.
        let reqs: Vec<Arc<RequestMeta>> = (0..batch)
            .map(|n| {
                Arc::new(RequestMeta::new(
                    format!("d-{n}").as_str(),
                    &format!("t-{n}"),
                    "prefill-0",
                    "http://127.0.0.1:8998",
                    &[vec![n as u32]],
                ))
            })
            .collect();
        g.throughput(Throughput::Elements(batch as u64));
        g.bench_function(BenchmarkId::new(format!("{peers}_peers"), batch), |b| {
            b.iter(|| {
                for (pull_id, peer) in next_pull_ids(peers as u64).zip(&peer_ids) {
                    table.open(&PullWindow {
                        pull_id,
                        peer,
                        requests: &reqs,
                    });
                }
                let until = Instant::now();
                for r in &reqs {
                    assert!(table.verify_ok(r).is_ok());
                    let revoked = table.revoke(&RevokeRequest {
                        req: r,
                        suspects: &[],
                        poison_until: until,
                    });
                    assert!(revoked.quiesced.is_none());
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
