//! One simulated P worker (one TP x PP rank): a ROUTER on its own task, and one task per pull,
//! bounded like P's serving pool (PROTOCOL.md §2.2: a pull holds its task for its whole life;
//! beyond the pool, pulls wait in the queue without any reply).

#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

use crate::control::AsyncSocket;
use crate::messages::{MooncakeXferMetadata, MooncakeXferResponse, XferStatus};

use super::faults::{FaultRng, Faults, Malformed};
use super::layout_cache::LayoutCache;
use super::readiness::Readiness;
use super::writer::{SharedWriter, WorkerRank, WriteJob};
use super::SimError;

/// The largest pull frame the simulator's ROUTER takes (kvrecv's own replies cap, PROTOCOL.md
/// §7.2).
pub const MAX_PULL_MESSAGE: i64 = 16 << 20;

/// P's readiness-timeout message (PROTOCOL.md §2.5 reference vector).
pub const READINESS_TIMEOUT_MSG: &str = "Timeout waiting for P side ready.";

/// Static settings of a worker.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub rank: WorkerRank,
    /// Pulls served at once (P: `2 x num_workers`, default 20).
    pub serving_tasks: usize,
    /// P's readiness wait, restarted after each ready subset (vLLM: 480 s).
    pub readiness_timeout: Duration,
    /// KV-cache groups P holds per request (`None`: not checked).
    pub num_groups: Option<usize>,
    /// P's layer names (`None`: not checked). P answers ERROR when one has no match in D's.
    pub layer_names: Option<Vec<String>>,
}

/// State shared by a worker's incarnations and its pull tasks.
pub struct WorkerShared {
    pub cfg: WorkerConfig,
    faults: Mutex<Faults>,
    rng: Mutex<FaultRng>,
    readiness: Arc<Readiness>,
    writer: SharedWriter,
    pulls: AtomicUsize,
    /// Routing identities pulls came from: one per D connection (the ROUTER assigns them).
    identities: Mutex<HashSet<Vec<u8>>>,
    ctx: zmq::Context,
    /// D layouts this worker holds (vLLM 0.33); lost on a restart.
    layouts: Mutex<LayoutCache>,
    layout_stats: Mutex<LayoutStats>,
}

/// What a worker saw of vLLM 0.33's layout ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayoutStats {
    /// Pulls that carried the layout (a non-empty `kv_caches_base_addr`).
    pub with_layout: u64,
    /// Pulls with a layout id and no layout.
    pub without_layout: u64,
    /// `LAYOUT_MISS` answers.
    pub misses: u64,
    /// Bytes of every pull's metadata received.
    pub metadata_bytes: u64,
    /// The largest pull received, in bytes.
    pub largest: u64,
    /// The smallest pull received, in bytes (0 before the first).
    pub smallest: u64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl WorkerShared {
    pub fn new(
        cfg: WorkerConfig,
        faults: Faults,
        seed: u64,
        readiness: Arc<Readiness>,
        writer: SharedWriter,
        ctx: zmq::Context,
    ) -> Self {
        WorkerShared {
            cfg,
            faults: Mutex::new(faults),
            rng: Mutex::new(FaultRng::new(seed)),
            readiness,
            writer,
            pulls: AtomicUsize::new(0),
            identities: Mutex::new(HashSet::new()),
            ctx,
            layouts: Mutex::new(LayoutCache::default()),
            layout_stats: Mutex::new(LayoutStats::default()),
        }
    }
}

enum Out {
    Send(Vec<Vec<u8>>),
    Crash,
}

/// A running (or crashed) worker.
pub struct Worker {
    shared: Arc<WorkerShared>,
    addr: String,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Worker {
    /// Bind a ROUTER on `bind` (`tcp://ip:port`, port 0 for any) and serve.
    pub async fn start(shared: Arc<WorkerShared>, bind: &str) -> Result<Worker, SimError> {
        let mut w = Worker {
            shared,
            addr: bind.to_owned(),
            stop: None,
            task: None,
        };
        w.spawn(bind).await?;
        Ok(w)
    }

    async fn spawn(&mut self, bind: &str) -> Result<(), SimError> {
        // A (re)started P process holds no D layout.
        lock(&self.shared.layouts).clear();
        let zerr = |e: zmq::Error| SimError::Zmq(e.to_string());
        let router = self.shared.ctx.socket(zmq::ROUTER).map_err(zerr)?;
        router.set_linger(0).map_err(zerr)?;
        // A pull is KBs; one over this drops its connection instead of being queued (vLLM's P
        // sets no cap: a 200k-region layout per pull grew the simulator 20 MB a pull).
        router.set_maxmsgsize(MAX_PULL_MESSAGE).map_err(zerr)?;
        // A restarted worker rebinds its old port; the previous listener closes asynchronously
        // in libzmq's I/O thread, so EADDRINUSE is retried for a moment.
        let mut tries = 0;
        loop {
            match router.bind(bind) {
                Ok(()) => break,
                Err(zmq::Error::EADDRINUSE) if tries < 100 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(zerr(e)),
            }
        }
        self.addr = router
            .get_last_endpoint()
            .map_err(zerr)?
            .map_err(|_| SimError::Zmq("endpoint is not UTF-8".into()))?;
        let router = AsyncSocket::new(router).map_err(|e| SimError::Zmq(e.to_string()))?;
        let (stop_tx, stop_rx) = oneshot::channel();
        self.stop = Some(stop_tx);
        self.task = Some(tokio::spawn(run(router, self.shared.clone(), stop_rx)));
        Ok(())
    }

    /// The side-channel address (`tcp://ip:port`), what the worker registers.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn rank(&self) -> &WorkerRank {
        &self.shared.cfg.rank
    }

    /// Pulls received since start (all incarnations).
    pub fn pulls_received(&self) -> usize {
        self.shared.pulls.load(Ordering::SeqCst)
    }

    /// Distinct D connections pulls came over since start (all incarnations).
    pub fn connections_seen(&self) -> usize {
        lock(&self.shared.identities).len()
    }

    /// What this worker saw of layout ids.
    pub fn layout_stats(&self) -> LayoutStats {
        *lock(&self.shared.layout_stats)
    }

    /// Forget every cached D layout now (as vLLM's LRU or a restart would).
    pub fn evict_layouts(&self) {
        lock(&self.shared.layouts).clear();
    }

    pub fn set_faults(&self, f: Faults) {
        *lock(&self.shared.faults) = f;
    }

    pub fn faults(&self) -> Faults {
        lock(&self.shared.faults).clone()
    }

    /// Whether the ROUTER is open (false after a crash or `stop`).
    pub fn is_running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Close the ROUTER and abandon every pull in progress (the process died).
    pub async fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }

    /// Come back on the same address (a restarted P worker).
    pub async fn restart(&mut self) -> Result<(), SimError> {
        self.stop().await;
        let addr = self.addr.clone();
        self.spawn(&addr).await
    }

    /// Come back on a different port of `host` (a restarted P process binds a new random
    /// port, as vLLM's workers do). The caller registers the new address.
    pub async fn restart_on_new_port(&mut self, host: &str) -> Result<(), SimError> {
        let old = self.addr.clone();
        self.stop().await;
        for _ in 0..16 {
            self.spawn(&format!("tcp://{host}:0")).await?;
            if self.addr != old {
                return Ok(());
            }
            // The kernel handed the old port out again: try another.
            self.stop().await;
        }
        Err(SimError::Zmq(format!("no new port other than {old}")))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

async fn run(mut router: AsyncSocket, shared: Arc<WorkerShared>, mut stop: oneshot::Receiver<()>) {
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Out>();
    // Dropping the set when the loop ends aborts every pull in progress, hung ones included.
    let mut tasks = JoinSet::new();
    let pool = Arc::new(Semaphore::new(shared.cfg.serving_tasks.max(1)));
    let rank = shared.cfg.rank.clone();
    loop {
        tokio::select! {
            _ = &mut stop => break,
            Some(out) = out_rx.recv() => match out {
                Out::Send(frames) => {
                    // ROUTER never blocks: an unroutable identity (D closed its DEALER) is
                    // dropped silently, as on P (no ROUTER_MANDATORY).
                    let _ = router.socket().send_multipart(frames, zmq::DONTWAIT);
                }
                Out::Crash => {
                    tracing::warn!(?rank, "simulated crash: closing the ROUTER");
                    break;
                }
            },
            msg = router.recv_multipart() => match msg {
                Ok(mut frames) if frames.len() == 2 => {
                    let n = shared.pulls.fetch_add(1, Ordering::SeqCst) + 1;
                    let every = lock(&shared.faults).evict_layouts_every;
                    if every.is_some_and(|e| e > 0 && n % e as usize == 0) {
                        tracing::info!(?rank, "simulated layout eviction");
                        lock(&shared.layouts).clear();
                    }
                    let payload = frames.pop().unwrap_or_default();
                    let identity = frames.pop().unwrap_or_default();
                    lock(&shared.identities).insert(identity.clone());
                    let (sh, out, pool) = (shared.clone(), out_tx.clone(), pool.clone());
                    tasks.spawn(async move {
                        let Ok(_permit) = pool.acquire_owned().await else { return };
                        serve_pull(&sh, identity, payload, &out).await;
                    });
                }
                Ok(frames) => {
                    // vLLM's sender thread unpacks exactly two frames; anything else raises and
                    // the thread exits: the side channel stops for every client (PROTOCOL §2.1).
                    tracing::error!(?rank, frames = frames.len(), "Error in Mooncake sender thread; exiting");
                    break;
                }
                Err(e) => {
                    tracing::error!(?rank, error = %e, "ROUTER failed");
                    break;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

fn response(
    status: XferStatus,
    ok: Vec<String>,
    err: Vec<String>,
    msg: Option<String>,
) -> MooncakeXferResponse {
    MooncakeXferResponse {
        status,
        ok_reqs: (!ok.is_empty()).then_some(ok),
        err_reqs: (!err.is_empty()).then_some(err),
        err_msg: msg,
        layout_id: 0,
    }
}

/// Whether D rank `d_rank` of `d_tp` pulls from P rank `p_rank` of `p_tp` (PROTOCOL.md §3).
fn paired(d_tp: u32, d_rank: u32, p_tp: u32, p_rank: u32) -> bool {
    if d_tp == 0 || p_tp == 0 {
        return false;
    }
    if d_tp >= p_tp {
        d_tp % p_tp == 0 && d_rank / (d_tp / p_tp) == p_rank
    } else {
        p_tp % d_tp == 0 && p_rank / (p_tp / d_tp) == d_rank
    }
}

/// The pairing check, P's first (before it looks at the layout).
fn validate_pairing(cfg: &WorkerConfig, md: &MooncakeXferMetadata) -> Result<(), String> {
    let r = &cfg.rank;
    if !paired(md.remote_tp_size, md.remote_tp_rank, r.tp_size, r.tp_rank) {
        return Err(format!(
            "This D tp_rank {} is not paired with P tp_rank {}",
            md.remote_tp_rank, r.tp_rank
        ));
    }
    Ok(())
}

/// The pull-wide checks of PROTOCOL.md §2.6 step 1.
fn validate(cfg: &WorkerConfig, md: &MooncakeXferMetadata) -> Result<(), String> {
    validate_pairing(cfg, md)?;
    let r = &cfg.rank;
    let n = md.kv_caches_base_addr.len();
    let lens = [
        md.block_lens.len(),
        md.kv_block_lens.len(),
        md.registered_layer_names.len(),
        md.registered_layer_indices.len(),
    ];
    if lens.iter().any(|&l| l != n)
        || (!md.registered_group_indices.is_empty() && md.registered_group_indices.len() != n)
    {
        return Err("AssertionError: region lists of different lengths".into());
    }
    if let Some(names) = &cfg.layer_names {
        let skip_unlisted = md.remote_pp_size > 1 && md.remote_pp_size != r.pp_size;
        for name in names {
            if !md.registered_layer_names.contains(name) && !skip_unlisted {
                return Err(format!("P region {name} has no matching region on D"));
            }
        }
    }
    Ok(())
}

async fn serve_pull(
    sh: &WorkerShared,
    identity: Vec<u8>,
    payload: Vec<u8>,
    out: &mpsc::UnboundedSender<Out>,
) {
    let faults = lock(&sh.faults).clone();
    // vLLM 0.33 echoes the pull's layout id in every CONTINUE and FINISH (set once accepted).
    let echo = std::sync::atomic::AtomicU64::new(0);
    let send = |r: &MooncakeXferResponse| {
        let mut r = r.clone();
        if matches!(r.status, XferStatus::Continue | XferStatus::Finish) {
            r.layout_id = echo.load(Ordering::Relaxed);
        }
        let _ = out.send(Out::Send(reply_frames(&faults, &identity, &r)));
    };
    if faults.hang {
        std::future::pending::<()>().await;
    }
    if faults.crash_after_subsets == Some(0) {
        let _ = out.send(Out::Crash);
        return;
    }
    let md = match accept_pull(sh, &faults, &payload) {
        Ok(md) => md,
        Err(refusal) => return send(&refusal),
    };
    if !faults.legacy_0_32 {
        echo.store(md.layout_id, Ordering::Relaxed);
    }
    let mut pending: Vec<(String, String)> = md
        .req_blocks
        .iter()
        .map(|(req, (tid, _))| (req.clone(), tid.clone()))
        .collect();
    let mut answered = 0u32;
    let mut previous_ok: Vec<String> = vec![];
    loop {
        // Subscribe before looking, so a mark between the look and the wait is not missed.
        let mut changed = sh.readiness.subscribe();
        let (ready, rest): (Vec<_>, Vec<_>) = pending
            .into_iter()
            .partition(|(_, tid)| sh.readiness.is_ready(tid));
        pending = rest;
        if ready.is_empty() {
            if pending.is_empty() {
                return send(&response(XferStatus::Finish, vec![], vec![], None));
            }
            match tokio::time::timeout(sh.cfg.readiness_timeout, changed.changed()).await {
                Ok(_) => continue,
                Err(_) => {
                    let err = pending.into_iter().map(|(r, _)| r).collect();
                    let msg = Some(READINESS_TIMEOUT_MSG.to_owned());
                    return send(&response(XferStatus::Finish, vec![], err, msg));
                }
            }
        }
        let subset: Vec<String> = ready.into_iter().map(|(r, _)| r).collect();
        if faults.crash_after_subsets == Some(answered) {
            let _ = out.send(Out::Crash);
            return;
        }
        if faults.error_after_subsets == Some(answered) {
            let err = if faults.error_names_subset {
                subset
            } else {
                vec![]
            };
            let msg = Some("simulated exception while serving the pull".to_owned());
            return send(&response(XferStatus::Error, vec![], err, msg));
        }
        let (ok, err, reasons) = write_subset(sh, &faults, &md, subset).await;
        let status = if pending.is_empty() {
            XferStatus::Finish
        } else {
            XferStatus::Continue
        };
        let ok_list = ok_with_faults(&faults, &ok, &previous_ok);
        previous_ok = ok;
        let msg = (!reasons.is_empty()).then(|| reasons.join("; "));
        send(&response(status, ok_list, err, msg));
        answered += 1;
        if status == XferStatus::Finish {
            return;
        }
    }
}

/// The frames of one answer, broken the way `faults.malformed` asks.
fn reply_frames(faults: &Faults, identity: &[u8], r: &MooncakeXferResponse) -> Vec<Vec<u8>> {
    let body = match &faults.malformed {
        None => r.encode().unwrap_or_default(),
        Some(Malformed::Garbage) => b"\xc1 this is not msgpack".to_vec(),
        Some(Malformed::BadStatus) => vec![0x81, 0xa6, b's', b't', b'a', b't', b'u', b's', 0x04],
        Some(Malformed::Oversized(n)) => vec![0xc0; *n],
        Some(Malformed::MultiFrame) => {
            return vec![
                identity.to_vec(),
                r.encode().unwrap_or_default(),
                b"extra".to_vec(),
            ]
        }
    };
    vec![identity.to_vec(), body]
}

/// Decode and check a pull as P does; `Err` is the peer-wide ERROR to answer instead.
fn accept_pull(
    sh: &WorkerShared,
    faults: &Faults,
    payload: &[u8],
) -> Result<Arc<MooncakeXferMetadata>, MooncakeXferResponse> {
    let error = |msg: String| response(XferStatus::Error, vec![], vec![], Some(msg));
    let mut md = MooncakeXferMetadata::decode(payload).map_err(|e| error(e.to_string()))?;
    if let Some(msg) = &faults.reject_pulls {
        return Err(error(msg.clone()));
    }
    let bare = md.layout_id != 0 && md.kv_caches_base_addr.is_empty();
    {
        let mut st = lock(&sh.layout_stats);
        let n = payload.len() as u64;
        st.metadata_bytes += n;
        st.largest = st.largest.max(n);
        st.smallest = if st.smallest == 0 {
            n
        } else {
            st.smallest.min(n)
        };
        if bare {
            st.without_layout += 1;
        } else {
            st.with_layout += 1;
        }
    }
    if faults.legacy_0_32 {
        // A 0.32 P does not know the field: it reads the (possibly empty) layout as sent.
        validate(&sh.cfg, &md).map_err(error)?;
        return Ok(Arc::new(md));
    }
    validate_pairing(&sh.cfg, &md).map_err(error)?;
    if bare {
        // vLLM 0.33: served from the cached layout, or LAYOUT_MISS (nothing written).
        let Some(layout) = lock(&sh.layouts).lookup(&md) else {
            lock(&sh.layout_stats).misses += 1;
            return Err(response(
                XferStatus::LayoutMiss,
                vec![],
                vec![],
                Some(format!(
                    "Mooncake KV layout {:#x} from {}:{} is not cached.",
                    md.layout_id, md.remote_hostname, md.remote_port
                )),
            ));
        };
        layout.fill(&mut md);
        validate(&sh.cfg, &md).map_err(error)?;
        return Ok(Arc::new(md));
    }
    validate(&sh.cfg, &md).map_err(error)?;
    lock(&sh.layouts).remember(&md);
    Ok(Arc::new(md))
}

/// `ok_reqs` as a faulty P words it: duplicates, ids of the previous answer, unknown ids.
fn ok_with_faults(faults: &Faults, ok: &[String], previous: &[String]) -> Vec<String> {
    let mut list = ok.to_vec();
    if faults.duplicate_ids {
        list.extend(ok.iter().cloned());
        list.extend(previous.iter().cloned());
    }
    if faults.unknown_ids {
        list.push("never-asked-for".to_owned());
    }
    list
}

/// One ready subset: omissions, checks, one write, injected failures. Returns (ok, err, reasons).
async fn write_subset(
    sh: &WorkerShared,
    faults: &Faults,
    md: &Arc<MooncakeXferMetadata>,
    subset: Vec<String>,
) -> (Vec<String>, Vec<String>, Vec<String>) {
    let (mut ok, mut err, mut reasons) = (vec![], vec![], vec![]);
    let mut to_write = vec![];
    let delay;
    {
        let mut rng = lock(&sh.rng);
        delay = rng.delay(faults.write_delay_ms);
        for req in subset {
            if rng.chance(faults.omission_rate) {
                tracing::debug!(%req, "expired before sending on P side (simulated omission)");
                continue;
            }
            let groups = md
                .req_blocks
                .get(&req)
                .map(|(_, g)| g.as_slice())
                .unwrap_or(&[]);
            if groups.iter().all(|g| g.is_empty()) {
                ok.push(req); // nothing to write
            } else if sh.cfg.num_groups.is_some_and(|n| n != groups.len()) {
                err.push(req);
                if !reasons.iter().any(|r| r == "KV group count mismatch") {
                    reasons.push("KV group count mismatch".to_owned());
                }
            } else {
                to_write.push(req);
            }
        }
    }
    if to_write.is_empty() {
        return (ok, err, reasons);
    }
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let job = WriteJob {
        rank: sh.cfg.rank.clone(),
        metadata: md.clone(),
        req_ids: to_write.clone(),
    };
    match sh.writer.write(job).await {
        Err(e) => {
            err.extend(to_write);
            reasons.push(e);
        }
        Ok(()) => {
            let mut rng = lock(&sh.rng);
            for req in to_write {
                // The bytes are written; P still reports a failure (e.g. a TE timeout).
                if rng.chance(faults.failure_rate) {
                    err.push(req);
                    if !reasons
                        .iter()
                        .any(|r| r.starts_with("Mooncake transfer engine"))
                    {
                        reasons.push("Mooncake transfer engine returned -1".to_owned());
                    }
                } else {
                    ok.push(req);
                }
            }
        }
    }
    (ok, err, reasons)
}

#[cfg(test)]
mod tests {
    use super::paired;

    #[test]
    fn pairing_follows_the_tp_ratio() {
        assert!(paired(1, 0, 2, 0) && paired(1, 0, 2, 1)); // P TP2 -> D TP1
        assert!(paired(2, 1, 1, 0)); // P TP1 -> D TP2
        assert!(paired(4, 3, 2, 1) && !paired(4, 3, 2, 0));
        assert!(!paired(2, 0, 4, 2) && paired(2, 1, 4, 2));
        assert!(!paired(3, 0, 2, 0));
    }
}
