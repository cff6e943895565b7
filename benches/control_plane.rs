//! Loopback control-plane benchmark: kvrecv's D (Coordinator + ZmqTransport + HTTP bootstrap)
//! against the in-process prefill simulator (TP1, ready at once, no-op writer). Each request is
//! its own `load_kv`, hence its own pull on a fresh DEALER.
//!
//! `cargo bench --bench control_plane` (env `PULLS`, `INFLIGHT` to change the sizes).

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvrecv::actors::{Coordinator, CoordinatorParts, EventSink};
use kvrecv::config::KvRecvConfig;
use kvrecv::control::{BootstrapConfig, HttpTopology, ZmqTransport};
use kvrecv::layout::KvLayout;
use kvrecv::messages::{KvEvent, KvRequest, LoadKv};
use kvrecv::rdma::StaticLanding;
use kvrecv::sim::{PrefillSim, SimConfig};

fn env(name: &str, dflt: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(dflt)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` probes with --list
    }
    let pulls = env("PULLS", 5000);
    let inflight = env("INFLIGHT", 64);
    let sys = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    });
    sys.block_on(async move {
        let sim = PrefillSim::start(SimConfig {
            serving_tasks: 256,
            ..SimConfig::default()
        })
        .await
        .unwrap();
        let (events, mut rx) = EventSink::channel();
        let cfg = KvRecvConfig {
            layout: KvLayout::uniform(2, 4096, 4096),
            pull_timeout: Duration::from_secs(30),
            ..KvRecvConfig::default()
        };
        let coord = Coordinator::start(CoordinatorParts {
            config: cfg,
            topology: Rc::new(HttpTopology::new(BootstrapConfig::default())),
            transport: Rc::new(ZmqTransport::default()),
            landing: Arc::new(StaticLanding::new(
                "127.0.0.1",
                15000,
                vec![1 << 40, 1 << 41],
            )),
            events,
            builtin_pool: false,
        });
        let url = sim.bootstrap_url();
        let mk = |i: usize| KvRequest {
            req_id: format!("d-{i}"),
            transfer_id: Some(format!("t-{i}")),
            remote_engine_id: Some(sim.engine_id().to_owned()),
            remote_bootstrap_addr: Some(url.clone()),
            block_ids: vec![vec![(i % 4096) as u32]],
        };
        // Wait for the completion of one request (every event is for our own requests).
        async fn done(rx: &mut tokio::sync::mpsc::UnboundedReceiver<KvEvent>) -> bool {
            loop {
                match rx.recv().await {
                    Some(KvEvent::Completion { outcome, .. }) => return outcome.is_ok(),
                    Some(_) => {}
                    None => return false,
                }
            }
        }
        // Warm-up (bootstrap lookup cached, libzmq threads up).
        coord
            .load_kv(LoadKv {
                requests: vec![mk(0)],
            })
            .await
            .unwrap();
        assert!(done(&mut rx).await);

        // 1. Latency: one pull at a time, load_kv -> completion.
        let mut lat = Histogram::<u64>::new(3).unwrap();
        let n = pulls.min(2000);
        for i in 1..=n {
            let t = Instant::now();
            coord
                .load_kv(LoadKv {
                    requests: vec![mk(i)],
                })
                .await
                .unwrap();
            assert!(done(&mut rx).await);
            lat.record(t.elapsed().as_micros() as u64).unwrap();
        }
        println!(
            "sequential: {n} pulls, latency us p50 {} p90 {} p99 {} max {}",
            lat.value_at_quantile(0.5),
            lat.value_at_quantile(0.9),
            lat.value_at_quantile(0.99),
            lat.max()
        );

        // 2. Throughput: keep `inflight` pulls outstanding.
        let t = Instant::now();
        let mut next = n + 1;
        let end = next + pulls;
        let mut outstanding = 0;
        let mut completed = 0;
        while completed < pulls {
            while outstanding < inflight && next < end {
                coord
                    .load_kv(LoadKv {
                        requests: vec![mk(next)],
                    })
                    .await
                    .unwrap();
                next += 1;
                outstanding += 1;
            }
            assert!(done(&mut rx).await);
            outstanding -= 1;
            completed += 1;
        }
        let secs = t.elapsed().as_secs_f64();
        println!(
            "pipelined: {pulls} pulls, {inflight} in flight, {:.0} pulls/s ({secs:.2} s)",
            pulls as f64 / secs
        );
        actix_rt::System::current().stop();
    });
}
