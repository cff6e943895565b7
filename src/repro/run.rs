//! Runs the experiment: for each variant, a fresh D (actors, ZMQ, bootstrap client, TCP target
//! with audit) and a fresh simulated P engine whose workers write real stamped bytes; the trace
//! drives a host loop that allocates blocks from the bounded pool, calls `load_kv` and drains
//! once per step.

#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Notify;

use crate::actors::block_pool::PoolError;
use crate::block_ownership::owner_tag;
use crate::actors::Coordinator;
use crate::config::DRank;
use crate::config::KvRecvConfig;
use crate::control::{BootstrapConfig, ZmqTransportConfig};
use crate::layout::KvLayout;
use crate::messages::{
    Allocate, Cause, GetLedgerStats, KvEvent, KvRequest, LoadKv, ReqId, SettleOutcome,
};
use crate::rdma::audit::AuditCounters;
use crate::rdma::TcpTarget;
use crate::KvRecvBuilder;
use crate::sim::initiator::InitiatorConfig;
use crate::sim::te_writer::TeWriter;
use crate::sim::{Faults, Malformed, PrefillSim, SimConfig};

use super::counting_writer::CountingWriter;
use super::error::ReproError;
use super::report::{Report, VariantReport};
use super::scenario::{Scenario, Soak, Variant};
use super::trace::{self, TraceRequest};

/// Run every variant of `scn` inside a fresh actix System (with a multi-thread tokio runtime
/// for the data plane and the simulator), blocking the caller.
pub fn run_blocking(scn: &Scenario, progress: bool) -> Result<Report, ReproError> {
    let sys = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime")
    });
    sys.block_on(run(scn, progress))
}

/// Run every variant (inside an actix System).
pub async fn run(scn: &Scenario, progress: bool) -> Result<Report, ReproError> {
    scn.validate().map_err(ReproError::Scenario)?;
    let trace = trace::load(&scn.trace, Some(scn.requests))?;
    let mut variants = Vec::new();
    for &v in &scn.variants {
        variants.push(run_variant(scn, v, &trace, progress).await?);
    }
    Ok(Report { variants })
}

/// What the event observer accumulates.
#[derive(Default)]
struct Track {
    loaded_at: HashMap<ReqId, Instant>,
    completions: HashMap<ReqId, usize>,
    settled: usize,
    injected: usize,
    latency_us: Option<Histogram<u64>>,
}

fn blocks_needed(r: &TraceRequest, scn: &Scenario) -> usize {
    r.blocks(scn.block_tokens)
}

/// One variant's D: the TCP target (audit on), the coordinator with the built-in pool.
struct DSide {
    target: TcpTarget,
    coord: Coordinator,
    audit: Arc<AuditCounters>,
}

async fn start_d(
    scn: &Scenario,
    v: Variant,
) -> Result<(DSide, UnboundedReceiver<KvEvent>), ReproError> {
    let config = KvRecvConfig {
        policy: v.policy(),
        pull_timeout: scn.pull_timeout,
        quarantine_deadline: scn.quarantine_deadline,
        peer_backoff_base: Duration::from_millis(20),
        peer_backoff_max: Duration::from_millis(500),
        d_rank: DRank {
            tp_size: scn.d_tp,
            tp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
        },
        layout: KvLayout::uniform(scn.layers, scn.block_bytes, scn.pool_blocks),
        ..KvRecvConfig::default()
    };
    // The front door's wiring, run on this thread's System (P's simulator shares it).
    let wiring = KvRecvBuilder::new(config)
        .target(|t| {
            t.permits = v.permits();
            t.epoch_rule = v.epoch_rule();
            t.windows = scn.windows;
        })
        .bootstrap(BootstrapConfig {
            expected_p_sizes: Some((scn.p_tp, scn.p_pp)),
            ..BootstrapConfig::default()
        })
        // The control plane on one CPU, as `serve` runs it (the library's default pins nothing).
        .zmq(ZmqTransportConfig {
            control_cpu: crate::control::ControlCpu::Current,
            ..ZmqTransportConfig::default()
        })
        .builtin_pool(true)
        .events(true)
        .wire()?;
    let (landing, _, keep) = wiring.data.start().await?;
    // The audit reads the TCP target's own counters.
    let target = keep
        .downcast::<TcpTarget>()
        .map_err(|_| ReproError::Scenario("repro runs on the TCP target".into()))?;
    let (coord, _) = wiring.control.coordinator(landing);
    let events = wiring
        .events
        .ok_or_else(|| ReproError::Scenario("no event stream".into()))?;
    let ownership = coord
        .ownership()
        .ok_or_else(|| ReproError::Scenario("no pool".into()))?;
    let audit = target.install_audit(ownership);
    Ok((
        DSide {
            target: *target,
            coord,
            audit,
        },
        events,
    ))
}

/// The seed's faults: peer 0 reports failures after writing; the other peer writes late.
fn base_faults(scn: &Scenario) -> impl Fn(u32) -> Faults + Clone + 'static {
    let (fail_rate, delay_ms, p_tp) = (scn.fail_rate, scn.delay_ms, scn.p_tp);
    // The soak's layout evictions are on for every worker all along, under every other fault.
    let evict = scn.soak.as_ref().and_then(|s| s.evict_layouts_every);
    move |tp: u32| {
        let mut f = Faults {
            evict_layouts_every: evict,
            ..Faults::default()
        };
        if tp == 0 {
            f.failure_rate = fail_rate;
        }
        if tp == 1 % p_tp {
            f.write_delay_ms = delay_ms;
        }
        f
    }
}

/// One variant's P: the simulator whose workers write real stamped bytes, with the seed's faults.
async fn start_p(
    scn: &Scenario,
    v: Variant,
) -> Result<(PrefillSim, Arc<CountingWriter<TeWriter>>), ReproError> {
    let writer = Arc::new(CountingWriter::new(TeWriter::new(
        InitiatorConfig::default(),
    )));
    let sim = PrefillSim::start_with_writer(
        SimConfig {
            engine_id: format!("prefill-{}", v.label()),
            tp_size: scn.p_tp,
            pp_size: scn.p_pp,
            seed: scn.seed,
            ..SimConfig::default()
        },
        writer.clone(),
    )
    .await?;
    let faults = base_faults(scn);
    for tp in 0..scn.p_tp {
        for pp in 0..scn.p_pp {
            sim.set_faults(tp, pp, faults(tp));
        }
    }
    Ok((sim, writer))
}

fn progress_bar(show: bool, len: usize, v: Variant) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len as u64);
    b.set_style(
        ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos}/{len} completed {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b.set_prefix(v.label());
    b
}

/// Wake-ups the observer gives the host loop.
#[derive(Clone, Default)]
struct Signals {
    /// Blocks went back to the pool.
    released: Rc<Notify>,
    /// A completion or a settle arrived.
    progressed: Rc<Notify>,
}

/// The observer: completions, latencies, settles, injected failures (peer 0's transport-engine
/// failures); wakes the host loop.
fn observe(
    mut events: UnboundedReceiver<KvEvent>,
    track: Rc<RefCell<Track>>,
    signals: Signals,
    bar: ProgressBar,
    failing_peer: String,
) -> tokio::task::JoinHandle<()> {
    actix::spawn(async move {
        while let Some(ev) = events.recv().await {
            let mut t = track.borrow_mut();
            match ev {
                KvEvent::Completion { req_id, .. } => {
                    if let (Some(at), Some(h)) =
                        (t.loaded_at.get(&req_id).copied(), t.latency_us.as_mut())
                    {
                        let _ = h.record(at.elapsed().as_micros() as u64);
                    }
                    *t.completions.entry(req_id).or_default() += 1;
                    bar.inc(1);
                    signals.progressed.notify_one();
                }
                KvEvent::Settled { outcome, peer, .. } => {
                    t.settled += 1;
                    // The seed's fault is peer 0's; peer 1 may fail too when permits refuse
                    // its late write, which is not an injected failure.
                    let injected = matches!(
                        &outcome,
                        SettleOutcome::Failed {
                            cause: Cause::TransportEngine,
                            ..
                        }
                    );
                    if injected && peer.addr() == failing_peer {
                        t.injected += 1;
                    }
                    signals.progressed.notify_one();
                }
                KvEvent::Released { .. } => signals.released.notify_one(),
                _ => {}
            }
        }
    })
}

/// The host's scheduler step: drain once every few milliseconds.
fn step_host(coord: Coordinator) -> tokio::task::JoinHandle<()> {
    actix::spawn(async move {
        let mut iv = tokio::time::interval(Duration::from_millis(5));
        loop {
            iv.tick().await;
            if coord.drain().await.is_err() {
                break;
            }
        }
    })
}

/// Replay the trace: allocate blocks from the bounded pool (waiting for releases when it is
/// empty), `load_kv` each due batch. Returns the awaited request ids.
async fn replay(
    scn: &Scenario,
    v: Variant,
    trace: &[TraceRequest],
    coord: &Coordinator,
    (url, engine): (&str, &str),
    track: &Rc<RefCell<Track>>,
    released: &Notify,
) -> Result<Vec<ReqId>, ReproError> {
    let start = Instant::now();
    let ts0 = trace.first().map_or(0, |r| r.timestamp);
    let due = |r: &TraceRequest| {
        start + Duration::from_secs_f64((r.timestamp - ts0) as f64 / 1000.0 / scn.time_scale)
    };
    let mut awaited = Vec::new();
    let mut i = 0;
    while i < trace.len() {
        tokio::time::sleep_until(due(&trace[i]).into()).await;
        let now = Instant::now();
        let mut batch = Vec::new();
        while i < trace.len() && due(&trace[i]) <= now {
            let (req_id, transfer_id) =
                (format!("{}-r{i}", v.label()), format!("{}-t{i}", v.label()));
            let n = blocks_needed(&trace[i], scn).min(scn.pool_blocks as usize);
            let rid = ReqId::from(req_id.as_str());
            let a = Allocate {
                req_id: rid.clone(),
                owner_tag: owner_tag(&transfer_id),
                n,
            };
            let blocks = match coord.block_manager.send(a).await? {
                Ok(b) => b,
                // Blocks held by this very batch come back only once it is loaded: send it
                // first, and wait for a release only when nothing of ours is pending.
                Err(PoolError::Exhausted { .. }) if !batch.is_empty() => break,
                Err(PoolError::Exhausted { .. }) => {
                    released.notified().await;
                    continue;
                }
                Err(e) => return Err(ReproError::Scenario(e.to_string())),
            };
            track
                .borrow_mut()
                .loaded_at
                .insert(rid.clone(), Instant::now());
            awaited.push(rid);
            batch.push(KvRequest {
                req_id,
                transfer_id: Some(transfer_id),
                remote_engine_id: Some(engine.to_owned()),
                remote_bootstrap_addr: Some(url.to_owned()),
                block_ids: vec![blocks],
            });
            i += 1;
        }
        if !batch.is_empty() {
            let reply = coord.load_kv(LoadKv { requests: batch }).await?;
            if let Some(e) = reply.rejected.first() {
                return Err(ReproError::Scenario(format!(
                    "load_kv refused a request: {e}"
                )));
            }
        }
    }
    Ok(awaited)
}

/// Wait until every awaited request completed (or is counted as leaked) and every peer's write
/// for it is over: P writes before it answers, so a settle from every peer means no write is
/// left. Gives up after the deadlines could all have passed.
async fn settle_down(
    scn: &Scenario,
    awaited: &[ReqId],
    peers: usize,
    track: &Rc<RefCell<Track>>,
    writer: &CountingWriter<TeWriter>,
    progressed: &Notify,
) {
    let give_up =
        Instant::now() + scn.pull_timeout * 3 + scn.quarantine_deadline + Duration::from_secs(10);
    let expected_settles = awaited.len() * peers;
    loop {
        let (done, settled) = {
            let t = track.borrow();
            (
                awaited.iter().all(|r| t.completions.contains_key(r)),
                t.settled,
            )
        };
        if done && settled >= expected_settles && writer.in_flight() == 0 {
            break;
        }
        let wait = give_up.saturating_duration_since(Instant::now());
        if wait.is_zero()
            || tokio::time::timeout(wait, progressed.notified())
                .await
                .is_err()
        {
            tracing::warn!(
                "gave up waiting: some requests never completed or some peers never answered"
            );
            break;
        }
    }
}

async fn run_variant(
    scn: &Scenario,
    v: Variant,
    trace: &[TraceRequest],
    progress: bool,
) -> Result<VariantReport, ReproError> {
    let span = tracing::info_span!("variant", variant = v.label());
    let _g = span.enter();
    let (d, events) = start_d(scn, v).await?;
    let (sim, writer) = start_p(scn, v).await?;
    let failing_peer = sim.worker(0, 0).addr().to_owned();
    let (url, engine) = (sim.bootstrap_url(), sim.engine_id().to_owned());
    let sim = Rc::new(tokio::sync::Mutex::new(sim));
    let peers = ((scn.p_tp * scn.p_pp) as usize / scn.d_tp.min(scn.p_tp) as usize).max(1);
    let track = Rc::new(RefCell::new(Track {
        latency_us: Histogram::new(3).ok(),
        ..Track::default()
    }));
    let signals = Signals::default();
    let bar = progress_bar(progress, trace.len(), v);
    let observer = observe(
        events,
        track.clone(),
        signals.clone(),
        bar.clone(),
        failing_peer,
    );
    let stepper = step_host(d.coord.clone());
    let flooded = Rc::new(std::cell::Cell::new(0usize));
    let soaker = spawn_soak(scn, &sim, &d, &flooded);

    let start = Instant::now();
    let awaited = replay(
        scn,
        v,
        trace,
        &d.coord,
        (&url, &engine),
        &track,
        &signals.released,
    )
    .await?;
    let load_phase = start.elapsed();
    settle_down(scn, &awaited, peers, &track, &writer, &signals.progressed).await;
    if let Some(s) = soaker {
        s.abort();
    }
    bar.finish();
    stepper.abort();
    let (pulls, layout_resends) = p_counts(&sim).await;
    let stats = d.coord.block_manager.send(GetLedgerStats).await?;
    let audit = d.audit.snapshot();
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    let late = d.target.stats().rejected_revoked.load(relaxed);
    let landing = d.target.landing();
    let epochs = landing.permits().epochs();
    let t = track.borrow();
    let counts: Vec<usize> = awaited
        .iter()
        .map(|r| t.completions.get(r).copied().unwrap_or(0))
        .collect();
    let q = |p: f64| {
        t.latency_us
            .as_ref()
            .map_or(0.0, |h| h.value_at_quantile(p) as f64 / 1000.0)
    };
    let report = VariantReport {
        variant: v.label().into(),
        requests: awaited.len(),
        written_by_both_peers: writer.written_by_all(&peer_ranks(scn)),
        injected_failures: t.injected,
        requests_written_after_free: audit.requests_written_after_free,
        writes_after_free: audit.writes_after_free + audit.writes_after_realloc,
        writes_after_realloc: audit.writes_after_realloc,
        late_writes_rejected: late,
        layout_resends,
        idle_connections_flooded: flooded.get(),
        windows_poisoned: epochs.poisoned.load(relaxed),
        pulls_without_window: epochs.exhausted.load(relaxed),
        leaked: counts.iter().filter(|c| **c == 0).count(),
        completions_min: counts.iter().copied().min().unwrap_or(0),
        completions_max: counts.iter().copied().max().unwrap_or(0),
        pulls_per_s: pulls as f64 / load_phase.as_secs_f64().max(1e-9),
        completion_p50_ms: q(0.5),
        completion_p99_ms: q(0.99),
        audited_writes: audit.audited,
        quarantined_at_end: stats.quarantined_blocks,
        duration_s: start.elapsed().as_secs_f64(),
    };
    drop(t);
    observer.abort();
    Ok(report)
}

/// The soak's faults over the run, when the scenario has a soak.
fn spawn_soak(
    scn: &Scenario,
    sim: &Rc<tokio::sync::Mutex<PrefillSim>>,
    d: &DSide,
    flooded: &Rc<std::cell::Cell<usize>>,
) -> Option<tokio::task::JoinHandle<()>> {
    let s = scn.soak.clone()?;
    Some(actix::spawn(soak(
        s,
        sim.clone(),
        SoakCtx {
            p_tp: scn.p_tp,
            p_pp: scn.p_pp,
            seed: scn.seed,
            pull_timeout: scn.pull_timeout,
            flood_to: [d.target.handshake_addr(), d.target.data_addr()],
            flooded: flooded.clone(),
        },
        base_faults(scn),
    )))
}

/// Pulls P received, and the pulls D resent with their layout.
async fn p_counts(sim: &tokio::sync::Mutex<PrefillSim>) -> (usize, u64) {
    let sim = sim.lock().await;
    // Every LAYOUT_MISS P answered is a pull that omitted its layout (a pull that carried it
    // is cached before the lookup): D resent each with its layout. A worker restarted by the
    // soak starts counting again, so this is a lower bound.
    let layout_resends = sim.workers().iter().map(|w| w.layout_stats().misses).sum();
    (sim.pulls_received(), layout_resends)
}

/// The P workers one D worker (rank 0) pulls from, as (tp, pp).
fn peer_ranks(scn: &Scenario) -> Vec<(u32, u32)> {
    let r = if scn.d_tp >= scn.p_tp {
        1
    } else {
        scn.p_tp / scn.d_tp
    };
    (0..r)
        .flat_map(|tp| (0..scn.p_pp).map(move |pp| (tp, pp)))
        .collect()
}

/// Soak: every period one random worker misbehaves one random way for a while, then recovers.
/// What the soak needs of the run besides P.
struct SoakCtx {
    p_tp: u32,
    p_pp: u32,
    seed: u64,
    pull_timeout: Duration,
    /// D's handshake daemon and data server: where idle-connection floods go.
    flood_to: [std::net::SocketAddr; 2],
    /// Idle connections the floods opened, for the report.
    flooded: Rc<std::cell::Cell<usize>>,
}

/// Idle connections a flood opens per port: past every cap (handshake 64, data 1,024 by
/// default; 16 and 256 per address), so only eviction keeps the P workers in.
const FLOOD_PER_PORT: usize = 1100;

async fn soak(
    s: Soak,
    sim: Rc<tokio::sync::Mutex<PrefillSim>>,
    c: SoakCtx,
    base: impl Fn(u32) -> Faults,
) {
    let (p_tp, p_pp, pull_timeout) = (c.p_tp, c.p_pp, c.pull_timeout);
    let mut rng = SmallRng::seed_from_u64(c.seed ^ 0x50a6);
    loop {
        tokio::time::sleep(s.period).await;
        let (tp, pp) = (rng.random_range(0..p_tp), rng.random_range(0..p_pp));
        let mut f = base(tp);
        let kind = rng.random_range(0..8);
        if kind == 7 {
            let opened = crate::repro::flood::hold_idle(
                c.flood_to.to_vec(),
                FLOOD_PER_PORT,
                crate::repro::flood::FLOOD_FROM,
                s.fault_for,
            )
            .await;
            tracing::info!(opened, "soak: idle-connection flood held");
            c.flooded.set(c.flooded.get() + opened);
            continue;
        }
        if kind == 5 {
            tracing::info!(tp, pp, "soak: crash");
            sim.lock().await.crash_worker(tp, pp).await;
            tokio::time::sleep(s.fault_for).await;
            if let Err(e) = sim.lock().await.restart_worker(tp, pp).await {
                tracing::warn!(error = %e, "soak: restart failed");
            }
            continue;
        }
        match kind {
            0 => f.hang = true,
            1 => f.malformed = Some(Malformed::Garbage),
            2 => f.omission_rate = 0.3,
            3 => f.error_after_subsets = Some(0),
            // A late writer: D gives up at its deadline, P still writes afterwards (as a real
            // TE re-sends queued writes after a reconnect).
            6 => {
                let ms = pull_timeout.as_millis() as u64;
                f.write_delay_ms = (ms + 100, ms + 1500);
            }
            _ => {
                f.unknown_ids = true;
                f.duplicate_ids = true;
            }
        }
        tracing::info!(tp, pp, kind, "soak: fault on");
        sim.lock().await.set_faults(tp, pp, f);
        tokio::time::sleep(s.fault_for).await;
        sim.lock().await.set_faults(tp, pp, base(tp));
    }
}
