//! The example inference host (`examples/inference_host.rs`, the same code) against the
//! simulator's TP2 prefill engine writing real bytes: one rank fails 20% of its requests, the
//! other delays its writes, and a P worker crashes and comes back mid-run; clients cancel.
//! Asserts one completion per attempt, one outcome per request, and that every block the host
//! was told is loaded holds exactly the bytes of its own attempt (a block released early and
//! reused would show another attempt's bytes), with every block back in the allocator.

#[path = "../examples/inference_host.rs"]
mod inference_host;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use inference_host::{InferenceHost, Prefilled, Report};
use kvrecv::actors::block_pool::owner_tag;
use kvrecv::config::KvRecvConfig;
use kvrecv::layout::KvLayout;
use kvrecv::rdma::audit::stamp_write;
use kvrecv::sim::initiator::InitiatorConfig;
use kvrecv::sim::te_writer::TeWriter;
use kvrecv::sim::{Faults, PrefillSim, SimConfig};

const BLOCK: usize = 4096;
const BLOCKS: u32 = 48;
const LAYERS: usize = 2;

/// What the two P ranks write into `block` for `transfer_id`: each its stamped half.
fn expected(transfer_id: &str, block: u32) -> Vec<u8> {
    let tag = owner_tag(transfer_id);
    let half = BLOCK / 2;
    let mut out = Vec::with_capacity(BLOCK);
    for slice in 0..2 {
        let mut p = vec![(tag & 0xff) as u8; half];
        let at = u64::from(block) * BLOCK as u64 + (slice * half) as u64;
        stamp_write(&mut p, at, BLOCK as u64, tag, |_| 0);
        out.extend(p);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_host_survives_failures_delays_cancels_and_a_p_restart() {
    let mut sim = PrefillSim::start_with_writer(
        SimConfig {
            tp_size: 2,
            seed: 7,
            ..SimConfig::default()
        },
        Arc::new(TeWriter::new(InitiatorConfig::default())),
    )
    .await
    .unwrap();
    sim.set_faults(
        0,
        0,
        Faults {
            failure_rate: 0.2,
            ..Faults::default()
        },
    );
    sim.set_faults(
        1,
        0,
        Faults {
            write_delay_ms: (0, 30),
            ..Faults::default()
        },
    );
    let config = KvRecvConfig {
        layout: KvLayout::uniform(LAYERS as u32, BLOCK as u64, BLOCKS),
        // A crashed worker's pulls end on the loss of their connection, not on a deadline (an
        // hour: none is raced, however slow the machine); its peer comes back quickly.
        pull_timeout: Duration::from_secs(3600),
        peer_backoff_base: Duration::from_millis(20),
        peer_backoff_max: Duration::from_millis(100),
        ..KvRecvConfig::default()
    };
    let mut host = InferenceHost::start(config, 8).unwrap();
    let (engine_id, bootstrap) = (sim.engine_id().to_owned(), sim.bootstrap_url());
    let req = |i: usize| Prefilled {
        id: format!("req-{i}"),
        engine_id: engine_id.clone(),
        bootstrap: bootstrap.clone(),
        blocks: 1 + i % 4,
    };
    for i in 0..40 {
        host.submit(req(i));
    }
    let mut outcome: HashMap<String, Vec<Report>> = HashMap::new();
    let mut loaded = 0;
    let mut crashed = false;
    let mut restarted_at: Option<usize> = None;
    let mut loaded_after_restart = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(2)); // the model's step
    let mut steps = 0;
    while !host.idle() {
        tick.tick().await;
        steps += 1;
        assert!(steps < 20_000, "the host never went idle");
        if steps == 3 {
            // Two clients disconnect while their loads are in flight.
            host.cancel("req-1").await.unwrap();
            host.cancel("req-2").await.unwrap();
        }
        let reports = host.step().await.unwrap();
        for r in &reports {
            let (id, terminal) = match r {
                Report::Loaded { id, .. } => (id, true),
                Report::GaveUp { id } | Report::Cancelled { id } => (id, true),
                Report::Retrying { id, .. } => (id, false),
            };
            if terminal {
                outcome.entry(id.clone()).or_default().push(r.clone());
            }
            if let Report::Loaded {
                transfer_id,
                blocks,
                ..
            } = r
            {
                loaded += 1;
                if restarted_at.is_some() {
                    loaded_after_restart += 1;
                }
                // The model runner reads its KV: every block holds this attempt's bytes.
                for &b in blocks {
                    let want = expected(transfer_id, b);
                    for layer in 0..LAYERS {
                        assert!(
                            host.read_block(layer, b).unwrap() == want,
                            "{r:?}: layer {layer} block {b} holds other bytes"
                        );
                    }
                }
            }
        }
        if !crashed && loaded >= 10 {
            sim.crash_worker(1, 0).await;
            crashed = true;
            for i in 40..50 {
                host.submit(req(i));
            }
        } else if crashed
            && restarted_at.is_none()
            && reports.iter().any(|r| matches!(r, Report::Retrying { .. }))
        {
            sim.restart_worker(1, 0).await.unwrap();
            restarted_at = Some(steps);
            for i in 50..60 {
                host.submit(req(i));
            }
        }
    }
    assert!(restarted_at.is_some(), "the crash was seen and P restarted");
    assert_eq!(outcome.len(), 60, "every request has an outcome");
    for (id, o) in &outcome {
        assert_eq!(o.len(), 1, "{id}: one outcome, got {o:?}");
    }
    assert!(matches!(
        outcome["req-1"][0],
        Report::Cancelled { .. } | Report::Loaded { .. }
    ));
    assert!(
        loaded_after_restart > 0,
        "loads succeed again after the restart"
    );
    // One completion per attempt: idle means every attempt completed; none came twice.
    assert_eq!(host.unexpected_completions, 0);
    assert_eq!(
        host.refused, 0,
        "kvrecv never had to refuse a block still in use"
    );
    assert!(
        host.attempts > 60,
        "failures were retried: {}",
        host.attempts
    );
    assert_eq!(
        host.alloc.free(),
        BLOCKS as usize,
        "every block came back to the host"
    );
    let data = host.kv.stats().await.unwrap().data.unwrap();
    assert_eq!(data.live_permits, 0);
    let report = host.shutdown().await;
    assert_eq!(report.abandoned, vec![], "an idle host abandons nothing");
}
