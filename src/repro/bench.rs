//! `kvrecv bench`: control-plane throughput and latency on loopback (no faults, no data bytes):
//! kvrecv's D against the in-process prefill simulator with `peers` workers, or against a P in
//! its own process (`--bootstrap`, e.g. `kvrecv prefill-sim`), where the process CPU it reports
//! is D's alone (`benches/baseline.py` runs it so, next to a Python D). The host loop runs on
//! the actors' thread (`Via::Actors`, as `serve`'s does) or on a multi-thread tokio runtime
//! through the embedding handle (`Via::Handle`, as an embedding host's does).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{poll_fn, Stream, StreamExt};
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::actors::{Coordinator, EventSink};
use crate::config::KvRecvConfig;
use crate::control::{ControlCpu, ZmqTransportConfig};
use crate::layout::KvLayout;
use crate::messages::{KvEvent, KvRequest, LoadKv, LoadKvReply};
use crate::rdma::StaticLanding;
use crate::sim::{PrefillSim, SimConfig};

use super::error::ReproError;

/// What to measure.
#[derive(Debug, Clone, Serialize)]
pub struct BenchConfig {
    /// P TP size; D is TP1, so every request is pulled from this many peers.
    pub peers: u32,
    /// Requests kept in flight.
    pub in_flight: usize,
    /// Requests per `load_kv` (one pull per peer each).
    pub batch: usize,
    /// Requests in the measured phase.
    pub requests: usize,
    /// A P in another process: its bootstrap URL (`None`: start the simulator in this one).
    pub bootstrap: Option<String>,
    /// That P's engine id.
    pub engine_id: Option<String>,
    /// How the measured host reaches kvrecv.
    pub via: Via,
    /// Where kvrecv's control plane runs ([`ZmqTransportConfig::control_cpu`]).
    #[serde(serialize_with = "as_text")]
    pub control_cpu: ControlCpu,
    /// The in-process P evicts its layout cache before every Nth pull of each worker (vLLM
    /// 0.33-style peers: `LAYOUT_MISS`, resent with the layout).
    pub evict_layouts_every: Option<u32>,
    /// Idle connections flood D's handshake and data ports through the run (`Via::Handle`).
    pub flood: bool,
}

fn as_text<S: serde::Serializer>(v: &ControlCpu, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// How the bench's host drives kvrecv.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// On the actors' own thread, through [`Coordinator`] (as `serve` does).
    #[default]
    Actors,
    /// Through the embedding handle ([`KvRecv`](crate::KvRecv), the README's path) from a multi-thread
    /// tokio runtime, as `#[tokio::main]` builds it: every call and event crosses from the
    /// host's threads to kvrecv's; the TCP target with landing permits is the data plane.
    Handle,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            peers: 2,
            in_flight: 64,
            batch: 1,
            requests: 5000,
            bootstrap: None,
            engine_id: None,
            via: Via::Actors,
            // Measured so (docs/PERFORMANCE.md): the library's default pins nothing.
            control_cpu: ControlCpu::Current,
            evict_layouts_every: None,
            flood: false,
        }
    }
}

/// The figures.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub config: BenchConfig,
    pub pulls_per_s: f64,
    pub requests_per_s: f64,
    pub completion_p50_us: u64,
    pub completion_p90_us: u64,
    pub completion_p99_us: u64,
    /// From the last peer's settle of a request to the request's completion, each stamped
    /// where the coordinator emits it (the Peer's `settled` event, the aggregator's
    /// `completion`): how long D takes to publish a completion once the last answer is in.
    /// `None` through the handle (its events carry no emission stamp).
    pub after_last_settle_p50_us: Option<u64>,
    /// The same, 99th percentile.
    pub after_last_settle_p99_us: Option<u64>,
    /// The same interval as an observer task on the actors' thread sees it (both events stamped
    /// when that task reads them): it adds the wait for the observer's turn on the thread,
    /// which depends on what else the host runs there (this bench's own loop, its load_kv).
    pub after_last_settle_observed_p99_us: u64,
    /// Resident memory growth while `in_flight` requests were outstanding, per request.
    pub bytes_per_in_flight_request: Option<f64>,
    /// Completions that were not ok, in either phase (none is expected: the simulator is
    /// healthy).
    pub failed_completions: usize,
    /// Their causes, with counts (a failure always carries one).
    pub failure_causes: std::collections::BTreeMap<String, usize>,
    pub duration_s: f64,
    /// This process's CPU time (user + sys, [`process_cpu_s`]) over the measured phase, per
    /// request, µs. D's alone only when P runs in another process (`bootstrap`).
    pub cpu_us_per_request: Option<f64>,
}

impl BenchReport {
    pub fn table(&self) -> String {
        let c = &self.config;
        format!(
            "peers {}  in flight {}  batch {}  requests {}  via {:?}\n\
             pulls/s                 {:>10.0}\n\
             requests/s              {:>10.0}\n\
             completion p50 (us)     {:>10}\n\
             completion p90 (us)     {:>10}\n\
             completion p99 (us)     {:>10}\n\
             after last settle p99 (us){:>8}\n\
             ... as observed (us)    {:>10}\n\
             bytes per in-flight req {:>10}\n\
             failed completions      {:>10}\n\
             process CPU per req (us){:>10}\n{}",
            c.peers,
            c.in_flight,
            c.batch,
            c.requests,
            c.via,
            self.pulls_per_s,
            self.requests_per_s,
            self.completion_p50_us,
            self.completion_p90_us,
            self.completion_p99_us,
            self.after_last_settle_p99_us
                .map_or("n/a".into(), |u| u.to_string()),
            self.after_last_settle_observed_p99_us,
            self.bytes_per_in_flight_request
                .map_or("n/a".into(), |b| format!("{b:.0}")),
            self.failed_completions,
            self.cpu_us_per_request
                .map_or("n/a".into(), |c| format!("{c:.1}")),
            self.failure_causes
                .iter()
                .map(|(c, n)| format!("  {n} x {c}\n"))
                .collect::<String>(),
        )
    }
}

/// Resident set size from /proc (Linux), bytes.
fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Peak resident set size of this process so far (`VmHWM`), bytes: read once at the end, so
/// measuring memory costs the measured phase no syscalls.
fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// This process's CPU time so far (user + sys, every thread, exited ones included), seconds.
///
/// The kernel's process CPU clock (`CLOCK_PROCESS_CPUTIME_ID`): the sum that /proc/self/stat's
/// utime and stime are rounded from, to 10 ms ticks. A tick is 1 µs per request over 10,000
/// requests, about a seventh of serve's CPU per request at batch 16, so ticks decided the
/// ratio's second digit; the clock is exact. /proc is the fallback where the clock fails.
pub fn process_cpu_s() -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } == 0 {
        return Some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9);
    }
    proc_stat_cpu_s()
}

/// This process's CPU time from /proc/self/stat (utime + stime, in ticks), seconds.
pub fn proc_stat_cpu_s() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces, hence the last ')'): utime and
    // stime are fields 14 and 15 of the whole line, in clock ticks.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // In USER_HZ, which Linux fixes at 100 on x86 and arm64 whatever the kernel's HZ.
    Some(ticks as f64 / 100.0)
}

/// Memory per in-flight request, driven from outside (`benches/baseline.py`): start a
/// coordinator against the P at `cfg.bootstrap` (which must hold every pull unanswered, e.g.
/// `kvrecv prefill-sim --wait-ready`), print `{"event":"idle"}` and wait for a line on stdin;
/// then load `hold` requests in batches of `cfg.batch`, print `{"event":"loaded"}` and wait for
/// another line. The driver reads this process's RSS from /proc before and after (once P has
/// received every pull), so measuring costs this process nothing.
pub fn run_hold(cfg: BenchConfig, hold: usize) -> Result<(), ReproError> {
    // The actors on a current-thread runtime, as kvrecv runs them (`embed`, `serve`).
    let sys = actix_rt::System::new();
    sys.block_on(hold_requests(cfg, hold))
}

/// The bench's D on the current actix System: the real control plane (HTTP bootstrap, ZMQ),
/// landing nowhere (P writes no bytes here; the data plane has its own bench). Wired by the
/// front door's builder, as every D is.
async fn start_d(
    config: KvRecvConfig,
    events: EventSink,
    control_cpu: ControlCpu,
) -> Result<Coordinator, ReproError> {
    let wiring = crate::KvRecvBuilder::new(config)
        .zmq(ZmqTransportConfig {
            control_cpu,
            ..ZmqTransportConfig::default()
        })
        .landing(Arc::new(StaticLanding::new(
            "127.0.0.1",
            15000,
            vec![1 << 40, 1 << 41],
        )))
        .event_sink(events)
        .wire()?;
    let (landing, _, _) = wiring.data.start().await?;
    Ok(wiring.control.coordinator(landing).0)
}

async fn hold_requests(cfg: BenchConfig, hold: usize) -> Result<(), ReproError> {
    use tokio::io::AsyncBufReadExt;
    let (Some(url), Some(engine)) = (cfg.bootstrap.clone(), cfg.engine_id.clone()) else {
        return Err(ReproError::Scenario(
            "--hold needs --bootstrap (a P in its own process)".into(),
        ));
    };
    if cfg.batch == 0 || hold == 0 {
        return Err(ReproError::Scenario("batch and hold must be > 0".into()));
    }
    let blocks =
        u32::try_from(hold + 64).map_err(|_| ReproError::Scenario("--hold is too large".into()))?;
    let coord = start_d(
        KvRecvConfig {
            layout: KvLayout::uniform(2, 4096, blocks),
            pull_timeout: Duration::from_secs(3600),
            max_live_requests: hold + 64,
            ..KvRecvConfig::default()
        },
        EventSink::none(),
        cfg.control_cpu,
    )
    .await?;
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    println!(
        "{}",
        serde_json::json!({"event": "idle", "pid": std::process::id()})
    );
    let _ = stdin.next_line().await;
    let mut next = 0usize;
    while next < hold {
        let n = cfg.batch.min(hold - next);
        let requests = (next..next + n)
            .map(|i| KvRequest {
                req_id: format!("d-{i}"),
                transfer_id: Some(format!("t-{i}")),
                remote_engine_id: Some(engine.clone()),
                remote_bootstrap_addr: Some(url.clone()),
                block_ids: vec![vec![i as u32]],
            })
            .collect();
        let reply = coord.load_kv(LoadKv { requests }).await?;
        if let Some(e) = reply.rejected.first() {
            return Err(ReproError::Scenario(format!(
                "load_kv refused a request: {e}"
            )));
        }
        next += n;
    }
    println!(
        "{}",
        serde_json::json!({"event": "loaded", "requests": hold})
    );
    let _ = stdin.next_line().await;
    Ok(())
}

/// Run the benchmark in a fresh actix System (blocking).
pub fn run_bench(cfg: BenchConfig) -> Result<BenchReport, ReproError> {
    // The in-process P, when there is one, runs on threads of its own as a separate P would;
    // the actors on a current-thread runtime, as kvrecv runs them (`embed`, `serve`).
    let sim_rt = match cfg.bootstrap {
        Some(_) => None,
        None => Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("prefill-sim")
                .enable_all()
                .build()
                .map_err(|e| ReproError::Scenario(format!("simulator runtime: {e}")))?,
        ),
    };
    let sim = match &sim_rt {
        None => None,
        Some(rt) => {
            let sim = rt.block_on(PrefillSim::start(SimConfig {
                tp_size: cfg.peers,
                serving_tasks: 256,
                ..SimConfig::default()
            }))?;
            if cfg.evict_layouts_every.is_some() {
                for tp in 0..cfg.peers {
                    sim.set_faults(
                        tp,
                        0,
                        crate::sim::Faults {
                            evict_layouts_every: cfg.evict_layouts_every,
                            ..crate::sim::Faults::default()
                        },
                    );
                }
            }
            Some(sim)
        }
    };
    let (url, engine) = match (&sim, &cfg.bootstrap) {
        (Some(s), _) => (s.bootstrap_url(), s.engine_id().to_owned()),
        (None, Some(b)) => (
            b.clone(),
            cfg.engine_id.clone().unwrap_or_else(|| "prefill-0".into()),
        ),
        (None, None) => unreachable!("the simulator starts when no bootstrap is given"),
    };
    let report = match cfg.via {
        Via::Actors => {
            let sys = actix_rt::System::new();
            // A task on the actors' LocalSet, as `serve` runs its loop: the future `block_on`
            // polls has a waker that writes the runtime's eventfd every time an actor wakes it.
            sys.block_on(async move {
                actix_rt::spawn(bench(cfg, url, engine))
                    .await
                    .unwrap_or_else(|e| Err(ReproError::Scenario(format!("bench task: {e}"))))
            })
        }
        // The host's runtime as `#[tokio::main]` builds it (a worker per core).
        Via::Handle => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| ReproError::Scenario(format!("host runtime: {e}")))?
            .block_on(bench(cfg, url, engine)),
    };
    drop(sim);
    drop(sim_rt);
    report
}

/// How long the loop waits for an event before it awaits a batch's reply it has not read.
const TICKET_CHECK: Duration = Duration::from_millis(100);

/// Requests of the second phase, which observes every settle for the after-settle latency.
const SETTLE_PHASE_REQUESTS: usize = 4000;

async fn bench(cfg: BenchConfig, url: String, engine: String) -> Result<BenchReport, ReproError> {
    if cfg.peers == 0 || cfg.in_flight == 0 || cfg.batch == 0 || cfg.requests == 0 {
        return Err(ReproError::Scenario(
            "peers, in_flight, batch and requests must be > 0".into(),
        ));
    }
    // CPU, throughput and latency with the observer a host has (completions only, as `serve
    // --events completions`): building, sending and stamping every settle for the host cost
    // this process 6% of its CPU at batch 16 (A/B, `kvrecv bench --bootstrap`). The latency
    // from the last settle to the completion needs the settles, so it comes from a second,
    // shorter phase on a coordinator of its own.
    let main = phase(&cfg, &url, &engine, cfg.requests, false).await?;
    let settles = phase(
        &cfg,
        &url,
        &engine,
        cfg.requests.min(SETTLE_PHASE_REQUESTS),
        true,
    )
    .await?;
    let pulls = cfg.requests.div_ceil(cfg.batch) * cfg.peers as usize;
    let mut failure_causes = main.failure_causes;
    for (c, n) in settles.failure_causes {
        *failure_causes.entry(c).or_insert(0) += n;
    }
    Ok(BenchReport {
        pulls_per_s: pulls as f64 / main.secs,
        requests_per_s: cfg.requests as f64 / main.secs,
        completion_p50_us: main.hist.value_at_quantile(0.5),
        completion_p90_us: main.hist.value_at_quantile(0.9),
        completion_p99_us: main.hist.value_at_quantile(0.99),
        after_last_settle_p50_us: (!settles.after_settle.is_empty())
            .then(|| settles.after_settle.value_at_quantile(0.5)),
        after_last_settle_p99_us: (!settles.after_settle.is_empty())
            .then(|| settles.after_settle.value_at_quantile(0.99)),
        after_last_settle_observed_p99_us: settles.after_settle_observed.value_at_quantile(0.99),
        bytes_per_in_flight_request: match (main.rss0, main.rss_peak) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / cfg.in_flight as f64),
            _ => None,
        },
        duration_s: main.secs,
        cpu_us_per_request: main.cpu.map(|c| c * 1e6 / cfg.requests as f64),
        failed_completions: failure_causes.values().sum(),
        failure_causes,
        config: cfg,
    })
}

/// What one phase measured.
struct Phase {
    hist: Histogram<u64>,
    after_settle: Histogram<u64>,
    after_settle_observed: Histogram<u64>,
    failure_causes: std::collections::BTreeMap<String, usize>,
    secs: f64,
    cpu: Option<f64>,
    rss0: Option<u64>,
    rss_peak: Option<u64>,
}

/// `requests` requests through a D of its own (`cfg.via`); `settles`: observe every event (for
/// the after-settle latency), else completions only.
async fn phase(
    cfg: &BenchConfig,
    url: &str,
    engine: &str,
    requests: usize,
    settles: bool,
) -> Result<Phase, ReproError> {
    // Blocks come from a free list and go back at their request's completion: the BlockManager
    // handles that completion (and releases the block) before any later load_kv can ask for it.
    // (Block `i % blocks` failed when one slow pull outlived the rotation.)
    let blocks = (cfg.in_flight + cfg.batch) as u32 * 4 + 64;
    let config = KvRecvConfig {
        layout: KvLayout::uniform(2, 4096, blocks),
        pull_timeout: Duration::from_secs(30),
        ..KvRecvConfig::default()
    };
    let run = Run {
        cfg,
        url,
        engine,
        tag: if settles { "s" } else { "" },
        blocks,
        requests,
    };
    match cfg.via {
        Via::Actors => {
            let (events, mut rx) = EventSink::stamped_channel(!settles);
            let coord = start_d(config, events, run.cfg.control_cpu).await?;
            // Events are stamped as they arrive, by a task of their own on the actors' thread
            // (no wake-up of another thread), so the latencies do not include the time the
            // loop spends awaiting its own load_kv.
            let (stamped_tx, mut stamped) = tokio::sync::mpsc::unbounded_channel();
            actix_rt::spawn(async move {
                while let Some((emitted, ev)) = rx.recv().await {
                    if stamped_tx
                        .send((Some(emitted), Instant::now(), ev))
                        .is_err()
                    {
                        break;
                    }
                }
            });
            run.drive(&coord, poll_fn(move |cx| stamped.poll_recv(cx)))
                .await
        }
        Via::Handle => {
            let builder = crate::KvRecvBuilder::new(config).zmq(ZmqTransportConfig {
                control_cpu: cfg.control_cpu,
                ..ZmqTransportConfig::default()
            });
            let kv = match settles {
                true => builder.events(true),
                false => builder.completion_events(),
            }
            .start()
            .map_err(|e| ReproError::Scenario(format!("kvrecv: {e}")))?;
            // Read in the loop, as a host's step loop reads them: a task of its own would run
            // on another of the runtime's threads and add a wake-up per burst of events.
            let events = kv
                .events()
                .map_err(|e| ReproError::Scenario(e.to_string()))?;
            let flood = match (cfg.flood, kv.listen_addrs()) {
                (true, Some((handshake, data))) => {
                    Some(tokio::spawn(flood_until_aborted(vec![handshake, data])))
                }
                _ => None,
            };
            let phase = run
                .drive(&kv, events.map(|ev| (None, Instant::now(), ev)))
                .await;
            if let Some(f) = flood {
                f.abort();
            }
            kv.shutdown().await;
            phase
        }
    }
}

/// Idle-connection floods, one after another, until the task is aborted.
async fn flood_until_aborted(to: Vec<std::net::SocketAddr>) {
    use super::flood::{hold_idle, FLOOD_FROM};
    loop {
        let n = hold_idle(to.clone(), 1100, FLOOD_FROM, Duration::from_millis(700)).await;
        tracing::info!(opened = n, "bench: idle-connection flood held");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// An event as the loop sees it: when the coordinator emitted it (if stamped there), when it
/// was read, the event.
type Stamped = (Option<Instant>, Instant, KvEvent);

/// When an event was emitted (if stamped there) and observed.
type Seen = (Option<Instant>, Instant);

/// What a phase measured so far, and the blocks it has free.
struct Tally {
    free: std::collections::VecDeque<u32>,
    /// Per request in flight: when loaded, its last settle, its block.
    loaded_at: crate::fast_hash::FastMap<String, (Instant, Option<Seen>, u32)>,
    hist: Histogram<u64>,
    after_settle: Histogram<u64>,
    after_settle_observed: Histogram<u64>,
    failure_causes: std::collections::BTreeMap<String, usize>,
}

impl Tally {
    /// The requests `ids`, each on a free block, loaded now.
    fn batch(&mut self, run: &Run<'_>, ids: std::ops::Range<usize>) -> Vec<KvRequest> {
        let reqs: Vec<KvRequest> = ids
            .map(|i| {
                let block = self
                    .free
                    .pop_front()
                    .expect("more blocks than requests in flight");
                run.request(i, block)
            })
            .collect();
        let now = Instant::now();
        for r in &reqs {
            self.loaded_at
                .insert(r.req_id.clone(), (now, None, r.block_ids[0][0]));
        }
        reqs
    }

    /// One event: a completion frees its block and records its latencies (true); a settle is
    /// its request's last so far.
    fn on_event(&mut self, emitted: Option<Instant>, at: Instant, ev: KvEvent) -> bool {
        match ev {
            KvEvent::Completion {
                req_id, outcome, ..
            } => {
                if let crate::messages::Outcome::Failed { reason, .. } = outcome {
                    *self.failure_causes.entry(reason).or_insert(0) += 1;
                }
                if let Some((t, last_settle, block)) = self.loaded_at.remove(&*req_id) {
                    self.free.push_back(block);
                    let _ = self.hist.record((at - t).as_micros() as u64);
                    if let Some((s_emitted, s_at)) = last_settle {
                        let us = |d: Duration| d.as_micros() as u64;
                        if let (Some(e), Some(s)) = (emitted, s_emitted) {
                            let _ = self
                                .after_settle
                                .record(us(e.saturating_duration_since(s)));
                        }
                        let _ = self
                            .after_settle_observed
                            .record(us(at.saturating_duration_since(s_at)));
                    }
                }
                true
            }
            KvEvent::Settled { req_id, .. } => {
                if let Some(e) = self.loaded_at.get_mut(&*req_id) {
                    e.1 = Some((emitted, at));
                }
                false
            }
            _ => false,
        }
    }
}

/// What the measured loop needs from the D under test.
trait BenchD {
    async fn load_kv(&self, requests: Vec<KvRequest>) -> Result<LoadKvReply, ReproError>;
    /// Hand a batch over; its reply may be read later (as a step-driven host does).
    async fn submit(&self, requests: Vec<KvRequest>) -> Result<Ticket, ReproError>;
    async fn drain(&self) -> Result<(), ReproError>;
}

/// A batch's reply: there already, or to be read when the loop next looks.
enum Ticket {
    Ready(LoadKvReply),
    Pending(crate::LoadTicket),
}

impl Ticket {
    /// The reply if it is there, else the ticket back.
    fn try_reply(self) -> Result<Result<LoadKvReply, ReproError>, Ticket> {
        match self {
            Ticket::Ready(r) => Ok(Ok(r)),
            Ticket::Pending(t) => t
                .try_reply()
                .map(|r| r.map_err(|e| ReproError::Scenario(e.to_string())))
                .map_err(Ticket::Pending),
        }
    }

    async fn wait(self) -> Result<LoadKvReply, ReproError> {
        match self {
            Ticket::Ready(r) => Ok(r),
            Ticket::Pending(t) => t.await.map_err(|e| ReproError::Scenario(e.to_string())),
        }
    }
}

/// A refused request would never complete: stop instead of waiting for it.
fn refused(reply: &LoadKvReply) -> Result<(), ReproError> {
    match reply.rejected.first() {
        Some(e) => Err(ReproError::Scenario(format!(
            "load_kv refused a request: {e}"
        ))),
        None => Ok(()),
    }
}

impl BenchD for Coordinator {
    async fn load_kv(&self, requests: Vec<KvRequest>) -> Result<LoadKvReply, ReproError> {
        Ok(Coordinator::load_kv(self, LoadKv { requests }).await?)
    }

    /// On the actors' thread the reply costs no wake-up: await it.
    async fn submit(&self, requests: Vec<KvRequest>) -> Result<Ticket, ReproError> {
        Ok(Ticket::Ready(BenchD::load_kv(self, requests).await?))
    }

    async fn drain(&self) -> Result<(), ReproError> {
        Coordinator::drain(self).await?;
        Ok(())
    }
}

impl BenchD for crate::KvRecv {
    async fn load_kv(&self, requests: Vec<KvRequest>) -> Result<LoadKvReply, ReproError> {
        crate::KvRecv::load_kv(self, requests)
            .await
            .map_err(|e| ReproError::Scenario(e.to_string()))
    }

    /// `submit`: the reply is read after the next event, not awaited (no wake-up for it).
    async fn submit(&self, requests: Vec<KvRequest>) -> Result<Ticket, ReproError> {
        Ok(Ticket::Pending(crate::KvRecv::submit(self, requests)))
    }

    async fn drain(&self) -> Result<(), ReproError> {
        crate::KvRecv::drain(self)
            .await
            .map_err(|e| ReproError::Scenario(e.to_string()))?;
        Ok(())
    }
}

/// One phase's workload.
struct Run<'a> {
    cfg: &'a BenchConfig,
    url: &'a str,
    engine: &'a str,
    /// Prefix of the phase's ids (a P may remember the transfers it served).
    tag: &'static str,
    blocks: u32,
    requests: usize,
}

impl Run<'_> {
    fn request(&self, i: usize, block: u32) -> KvRequest {
        let tag = self.tag;
        KvRequest {
            req_id: format!("{tag}d-{i}"),
            transfer_id: Some(format!("{tag}t-{i}")),
            remote_engine_id: Some(self.engine.to_owned()),
            remote_bootstrap_addr: Some(self.url.to_owned()),
            block_ids: vec![vec![block]],
        }
    }

    /// A warm-up request, then the measured loop: `in_flight` requests kept outstanding in
    /// batches, a drain every 1,024 completions.
    async fn drive(
        self,
        d: &impl BenchD,
        mut stamped: impl Stream<Item = Stamped> + Unpin,
    ) -> Result<Phase, ReproError> {
        let cfg = self.cfg;
        let requests = self.requests;
        let hist = Histogram::<u64>::new(3).map_err(|e| ReproError::Scenario(e.to_string()))?;
        let mut tally = Tally {
            free: (0..self.blocks).collect(),
            loaded_at: crate::fast_hash::FastMap::default(),
            after_settle: hist.clone(),
            after_settle_observed: hist.clone(),
            hist,
            failure_causes: std::collections::BTreeMap::new(),
        };
        // Warm-up: bootstrap lookup cached, libzmq threads up.
        let warm = d.load_kv(vec![self.request(0, 0)]).await?;
        refused(&warm)?;
        while !matches!(
            stamped.next().await,
            Some((_, _, KvEvent::Completion { .. })) | None
        ) {}
        let rss0 = rss_bytes();
        let cpu0 = process_cpu_s();
        let start = Instant::now();
        let (mut next, mut outstanding, mut completed) = (1usize, 0usize, 0usize);
        let end = requests + 1;
        let mut tickets = std::collections::VecDeque::new();
        while completed < requests {
            while outstanding + cfg.batch <= cfg.in_flight.max(cfg.batch) && next < end {
                let n = cfg.batch.min(end - next);
                let reqs = tally.batch(&self, next..next + n);
                tickets.push_back(d.submit(reqs).await?);
                next += n;
                outstanding += n;
            }
            // Replies read when they are there (an awaited one, on the actors' thread, at
            // once); one still missing after a quiet spell is awaited (a refused request would
            // never complete: the loop stops on it).
            while let Some(t) = tickets.pop_front() {
                match t.try_reply() {
                    Ok(reply) => refused(&reply?)?,
                    Err(t) => {
                        tickets.push_front(t);
                        break;
                    }
                }
            }
            let ev = match tickets.is_empty() {
                true => stamped.next().await,
                false => match tokio::time::timeout(TICKET_CHECK, stamped.next()).await {
                    Ok(ev) => ev,
                    Err(_) => {
                        while let Some(t) = tickets.pop_front() {
                            refused(&t.wait().await?)?;
                        }
                        continue;
                    }
                },
            };
            let Some((emitted, at, ev)) = ev else {
                return Err(ReproError::Scenario("event stream closed".into()));
            };
            if tally.on_event(emitted, at, ev) {
                outstanding -= 1;
                completed += 1;
                // A host drains what finished (vLLM's get_finished, every step): the
                // coordinator keeps a finished request until drained, within its live limit.
                if completed % 1024 == 0 {
                    d.drain().await?;
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let cpu = process_cpu_s().zip(cpu0).map(|(b, a)| b - a);
        Ok(Phase {
            hist: tally.hist,
            after_settle: tally.after_settle,
            after_settle_observed: tally.after_settle_observed,
            failure_causes: tally.failure_causes,
            secs,
            cpu,
            rss0,
            rss_peak: peak_rss_bytes(),
        })
    }
}
