//! Telemetry: metric names, their descriptions, the per-worker labels and the handles actors
//! keep. Every counter an operator asks about in DESIGN.md §8 is named here, once. The exporter
//! (Prometheus text exposition through `metrics-exporter-prometheus`, `GET /metrics`, feature
//! `cli`) is `metrics_endpoint.rs`. (Named `telemetry` so it does not shadow the `metrics`
//! crate.)

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use crate::fast_hash::FastMap;

use metrics::{Counter, Gauge, Histogram, Label, SharedString};
#[cfg(feature = "cli")]
use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

/// The labels every series of one coordinator carries: `engine` (this D worker's engine id) and
/// `tp_rank`/`pp_rank`, so two coordinators in one process (one per rank, or one per engine) keep
/// distinct series in the host's recorder. Built once per coordinator and cloned (an `Arc`) into
/// every actor and data-plane core that records.
///
/// Handles are registered once per metric (and extra label) and cached: recording on the hot
/// path is a lookup, not a key built and registered per event. They are registered with the
/// recorder installed when first used, so a host installs its recorder before it starts a
/// worker.
#[derive(Clone)]
pub struct Labels(Arc<LabelsInner>);

struct LabelsInner {
    labels: Vec<Label>,
    /// foldhash, not SipHash: looked up for every settle and completion (SipHash of the key
    /// was 2% of the coordinator's time in `perf record` of the core bench).
    handles: Mutex<FastMap<HandleKey, Handle>>,
}

/// (metric name, extra label key, extra label value), each by address and length: the names
/// are `'static` constants, so those identify them without hashing their text (one literal
/// placed at two addresses only costs a second, equal handle).
type HandleKey = [(usize, usize); 3];

#[derive(Clone)]
enum Handle {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

impl std::fmt::Debug for Labels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Labels").field(&self.0.labels).finish()
    }
}

impl PartialEq for Labels {
    fn eq(&self, other: &Self) -> bool {
        self.0.labels == other.0.labels
    }
}

impl Eq for Labels {}

fn key(name: &'static str, k: &'static str, v: &'static str) -> HandleKey {
    [name, k, v].map(|s| (s.as_ptr() as usize, s.len()))
}

impl Labels {
    /// Labels of D worker `engine` at (TP, PP) rank (`tp_rank`, `pp_rank`).
    pub fn new(engine: &str, tp_rank: u32, pp_rank: u32) -> Self {
        // Shared values: registering a series clones the labels, and an `Arc` clone does not
        // allocate.
        let shared = |v: &str| SharedString::from_shared(Arc::<str>::from(v));
        Labels(Arc::new(LabelsInner {
            labels: vec![
                Label::new("engine", shared(engine)),
                Label::new("tp_rank", shared(&tp_rank.to_string())),
                Label::new("pp_rank", shared(&pp_rank.to_string())),
            ],
            handles: Mutex::new(FastMap::default()),
        }))
    }

    /// The labels of the coordinator `cfg` configures.
    pub fn for_config(cfg: &crate::config::KvRecvConfig) -> Self {
        Self::new(&cfg.engine_id, cfg.d_rank.tp_rank, cfg.d_rank.pp_rank)
    }

    fn with(&self, key: &'static str, value: &'static str) -> Vec<Label> {
        let mut v = self.0.labels.clone();
        if !key.is_empty() {
            v.push(Label::from_static_parts(key, value));
        }
        v
    }

    /// The cached handle for (`name`, extra label), registered by `make` on first use.
    fn handle(
        &self,
        name: &'static str,
        k: &'static str,
        v: &'static str,
        make: impl FnOnce(Vec<Label>) -> Handle,
    ) -> Handle {
        let mut handles = self.0.handles.lock().unwrap_or_else(|e| e.into_inner());
        handles
            .entry(key(name, k, v))
            .or_insert_with(|| make(self.with(k, v)))
            .clone()
    }

    /// Counter `name` in the current recorder (a no-op without one).
    pub fn counter(&self, name: &'static str) -> Counter {
        self.counter_by(name, "", "")
    }

    /// Counter `name` with one more label (`outcome`, `reason`, ...).
    pub fn counter_by(
        &self,
        name: &'static str,
        key: &'static str,
        value: &'static str,
    ) -> Counter {
        match self.handle(name, key, value, |l| {
            Handle::Counter(metrics::counter!(name, l))
        }) {
            Handle::Counter(c) => c,
            // One name is one kind of metric (the constants below); a mismatch records nothing.
            _ => Counter::noop(),
        }
    }

    /// Gauge `name` in the current recorder.
    pub fn gauge(&self, name: &'static str) -> Gauge {
        match self.handle(name, "", "", |l| Handle::Gauge(metrics::gauge!(name, l))) {
            Handle::Gauge(g) => g,
            _ => Gauge::noop(),
        }
    }

    /// Histogram `name` in the current recorder.
    pub fn histogram(&self, name: &'static str) -> Histogram {
        match self.handle(name, "", "", |l| {
            Handle::Histogram(metrics::histogram!(name, l))
        }) {
            Handle::Histogram(h) => h,
            _ => Histogram::noop(),
        }
    }
}

/// Engine `""`, ranks 0: the same label set as a configured coordinator, so every series of a
/// metric has the same label names.
impl Default for Labels {
    fn default() -> Self {
        Labels::new("", 0, 0)
    }
}

/// Pulls sent to prefill peers.
pub const PULLS: &str = "kvrecv_pulls_total";
/// Per-peer settles of a request, by outcome; label outcome.
pub const SETTLES: &str = "kvrecv_settles_total";
/// Reply ids not pending for that pull (unknown, duplicate, late), and settles that reach the
/// aggregator after their request completed (the naive policy completes early).
pub const STALE_SETTLES: &str = "kvrecv_stale_settles_total";
/// Undecodable or multi-frame replies.
pub const MALFORMED_REPLIES: &str = "kvrecv_malformed_replies_total";
/// Pulls abandoned at the D-side deadline.
pub const DEADLINE_EXPIRIES: &str = "kvrecv_pull_deadline_expiries_total";
/// Replies that named none of their pull's requests (a stray of an earlier exchange).
pub const STRAY_REPLIES: &str = "kvrecv_stray_replies_total";
/// Pulls sent again with their layout after P answered LAYOUT_MISS (vLLM 0.33 layout ids).
pub const LAYOUT_RESENDS: &str = "kvrecv_layout_resends_total";
/// Pulls sent without their layout (P echoed the layout id of their window).
pub const LAYOUT_OMITTED: &str = "kvrecv_layout_omitted_total";
/// Supervised restarts of a peer actor.
pub const PEER_RESTARTS: &str = "kvrecv_peer_restarts_total";
/// Peer actors (one per P worker D pulls from) the Receiver holds now.
pub const PEERS: &str = "kvrecv_peers";
/// Peer actors retired after `peer_retire_after` without a pull.
pub const PEERS_RETIRED: &str = "kvrecv_peers_retired_total";
/// Requests whose first failure was reported.
pub const FIRST_FAILURES: &str = "kvrecv_first_failures_total";
/// Completions, by outcome; label outcome.
pub const COMPLETIONS: &str = "kvrecv_completions_total";
/// Batches failed because the P topology was unavailable.
pub const TOPOLOGY_FAILURES: &str = "kvrecv_topology_failures_total";
/// Cached topologies dropped and asked again because a peer they name failed.
pub const TOPOLOGY_REFRESHES: &str = "kvrecv_topology_refreshes_total";
/// Pulls failed at once without being sent: peer down, or bootstrap in backoff (by reason); label reason.
pub const UNREACHABLE_BATCHES: &str = "kvrecv_unreachable_batches_total";
/// Destination blocks held until a fence.
pub const QUARANTINED_BLOCKS: &str = "kvrecv_quarantined_blocks";
/// Quarantines released by the last-resort deadline.
pub const QUARANTINE_FORCED: &str = "kvrecv_quarantine_forced_releases_total";
/// Completion to fence confirmation.
pub const FENCE_LATENCY: &str = "kvrecv_fence_latency_seconds";
/// Pull sent to its last reply.
pub const PULL_LATENCY: &str = "kvrecv_pull_latency_seconds";
/// load_kv to completion.
pub const COMPLETION_LATENCY: &str = "kvrecv_completion_latency_seconds";
/// Bytes written into destination memory.
pub const BYTES_LANDED: &str = "kvrecv_bytes_landed_total";
/// One staged copy of a write's chunk into device memory, from the hand-off to the blocking pool
/// to the device holding the bytes (waiting for a staging slot included): GPU copy cost and
/// staging contention.
pub const DEVICE_COPY_LATENCY: &str = "kvrecv_device_copy_seconds";
/// Writes landed in destination memory.
pub const WRITES_LANDED: &str = "kvrecv_writes_landed_total";
/// Requests refused by the data plane (writes, and reads while they are off), by reason; label
/// reason.
pub const WRITES_REJECTED: &str = "kvrecv_writes_rejected_total";
/// Open landing permits.
pub const LIVE_PERMITS: &str = "kvrecv_live_permits";
/// Landing windows poisoned because their writer may still write.
pub const WINDOWS_POISONED: &str = "kvrecv_windows_poisoned_total";
/// Landing windows out of rotation until their last-resort deadline.
pub const POISONED_WINDOWS: &str = "kvrecv_poisoned_windows";
/// Pulls that found no clean landing window: not sent (the Receiver fails their batch first),
/// or, opened one at a time (`PermitTable::open`), given the window that refuses every write.
pub const WINDOWS_EXHAUSTED: &str = "kvrecv_windows_exhausted_total";
/// Pulls refused a landing window because their P deployment held its share of the poisoned
/// ones.
pub const WINDOWS_REFUSED_SHARE: &str = "kvrecv_windows_refused_share_total";
/// Awaited requests failed before any of their batch's pulls was sent, because the pulls could
/// not all get a clean landing window; label reason (exhausted, deployment_share, invalid_pull).
pub const REQUESTS_REFUSED_NO_WINDOW: &str = "kvrecv_requests_refused_no_window_total";
/// Connections closed at accept because the listener's cap was reached (data, handshake); label listener.
pub const CONNECTIONS_REFUSED: &str = "kvrecv_connections_refused_total";
/// Idle connections closed to make room for a new one at a listener's cap or at its
/// per-address cap (data, handshake); label listener.
pub const CONNECTIONS_EVICTED: &str = "kvrecv_connections_evicted_total";
/// Connections closed at accept because their peer address held its share of the listener,
/// every one inside a request (data, handshake); label listener.
pub const CONNECTIONS_REFUSED_PER_ADDRESS: &str = "kvrecv_connections_refused_per_address_total";
/// Side-channel failures (local, bad_address, connect, send, recv, closed); label kind.
pub const TRANSPORT_ERRORS: &str = "kvrecv_transport_errors_total";
/// Side-channel DEALERs handed to pulls; label how (opened, reused).
pub const SIDE_CHANNELS: &str = "kvrecv_side_channels_total";
/// Topology lookups, by result (cached, queried, joined, failed); label result.
pub const BOOTSTRAP_LOOKUPS: &str = "kvrecv_bootstrap_lookups_total";
/// GET /query requests sent, by result (ok, error); label result.
pub const BOOTSTRAP_QUERIES: &str = "kvrecv_bootstrap_queries_total";
/// GET /query round trip.
pub const BOOTSTRAP_LATENCY: &str = "kvrecv_bootstrap_query_seconds";
/// Pulls not sent because their metadata could not be encoded (settled Failed).
pub const UNSENT_PULLS: &str = "kvrecv_unsent_pulls_total";
/// Requests refused at load_kv, by reason (invalid, duplicate, still live, block in use); label reason.
pub const LOAD_KV_REJECTED: &str = "kvrecv_load_kv_rejected_total";
#[cfg(feature = "cli")]
/// Times `kvrecv serve` stopped reading stdin because its host was not reading stdout.
pub const STDIN_PAUSES: &str = "kvrecv_serve_stdin_pauses_total";
/// Requests aborted by the host, by stage (in_flight, before_dispatch, unknown); label stage.
pub const ABORTS: &str = "kvrecv_aborts_total";
/// 1 while the worker is paused (sleep mode: admission closed, the landing closing or closed).
pub const PAUSED: &str = "kvrecv_paused";

#[cfg(feature = "cli")]
/// Register descriptions (shown as `# HELP` lines).
pub fn describe() {
    describe_requests();
    describe_pulls();
    describe_quarantine();
    describe_landing();
    describe_discovery();
}

/// Requests at the host boundary: admission, aborts, pause, completion.
#[cfg(feature = "cli")]
fn describe_requests() {
    describe_counter!(
        LOAD_KV_REJECTED,
        "Requests refused at load_kv, by reason (invalid, duplicate, still live, block in use)"
    );
    describe_counter!(
        REQUESTS_REFUSED_NO_WINDOW,
        "Awaited requests failed before any pull was sent: their batch's pulls could not all get a clean landing window"
    );
    describe_counter!(
        ABORTS,
        "Requests aborted by the host, by stage (in_flight, before_dispatch, unknown)"
    );
    describe_gauge!(
        PAUSED,
        "1 while the worker is paused (sleep mode): nothing admitted, nothing landing"
    );
    describe_counter!(
        STDIN_PAUSES,
        "kvrecv serve: stdin left unread because the host was not reading stdout"
    );
    describe_counter!(FIRST_FAILURES, "Requests whose first failure was reported");
    describe_counter!(COMPLETIONS, "Completions, by outcome");
    describe_histogram!(COMPLETION_LATENCY, Unit::Seconds, "load_kv to completion");
}

/// Pulls and their replies (the Peers).
#[cfg(feature = "cli")]
fn describe_pulls() {
    describe_counter!(PULLS, "Pulls sent to prefill peers");
    describe_counter!(
        UNSENT_PULLS,
        "Pulls not sent because their metadata could not be encoded (settled Failed)"
    );
    describe_counter!(
        UNREACHABLE_BATCHES,
        "Pulls failed at once without being sent: peer down, or bootstrap in backoff (by reason)"
    );
    describe_counter!(SETTLES, "Per-peer settles of a request, by outcome");
    describe_counter!(
        STALE_SETTLES,
        "Reply ids not pending for that pull (unknown, duplicate, late)"
    );
    describe_counter!(MALFORMED_REPLIES, "Undecodable or multi-frame replies");
    describe_counter!(DEADLINE_EXPIRIES, "Pulls abandoned at the D-side deadline");
    describe_counter!(
        STRAY_REPLIES,
        "Replies that named none of their pull's requests (ignored; the channel is not reused)"
    );
    describe_counter!(
        LAYOUT_RESENDS,
        "Pulls sent again with their layout after P answered LAYOUT_MISS"
    );
    describe_counter!(
        LAYOUT_OMITTED,
        "Pulls sent without their layout: P holds it under the window's layout id"
    );
    describe_counter!(PEER_RESTARTS, "Supervised restarts of a peer actor");
    describe_histogram!(PULL_LATENCY, Unit::Seconds, "Pull sent to its last reply");
}

/// Blocks held until a fence.
#[cfg(feature = "cli")]
fn describe_quarantine() {
    describe_gauge!(QUARANTINED_BLOCKS, "Destination blocks held until a fence");
    describe_counter!(
        QUARANTINE_FORCED,
        "Quarantines released by the last-resort deadline"
    );
    describe_histogram!(
        FENCE_LATENCY,
        Unit::Seconds,
        "Completion to fence confirmation"
    );
}

/// The data plane: bytes landed, permits, windows, connections.
#[cfg(feature = "cli")]
fn describe_landing() {
    describe_counter!(
        BYTES_LANDED,
        Unit::Bytes,
        "Bytes written into destination memory"
    );
    describe_counter!(WRITES_LANDED, "Writes landed in destination memory");
    describe_histogram!(
        DEVICE_COPY_LATENCY,
        Unit::Seconds,
        "Staged copy of one chunk into device memory, slot wait and synchronisation included"
    );
    describe_counter!(
        WRITES_REJECTED,
        "Writes refused by the data plane, by reason"
    );
    describe_gauge!(LIVE_PERMITS, "Open landing permits");
    describe_counter!(
        WINDOWS_POISONED,
        "Landing windows poisoned because their writer may still write"
    );
    describe_gauge!(
        POISONED_WINDOWS,
        "Landing windows out of rotation until their last-resort deadline"
    );
    describe_counter!(
        WINDOWS_EXHAUSTED,
        "Pulls that found no clean landing window (their writes are refused)"
    );
    describe_counter!(
        WINDOWS_REFUSED_SHARE,
        "Pulls refused a landing window because their P deployment held its share of the \
         poisoned ones while half the windows were poisoned"
    );
    describe_counter!(
        CONNECTIONS_REFUSED,
        "Connections closed at accept because the listener's cap was reached (data, handshake)"
    );
    describe_counter!(
        CONNECTIONS_EVICTED,
        "Idle connections closed to make room for a new one at a listener's cap or per-address cap"
    );
    describe_counter!(
        CONNECTIONS_REFUSED_PER_ADDRESS,
        "Connections closed at accept: their address held its share, every one inside a request"
    );
}

/// Finding P: the bootstrap lookups and the ZMQ side channels.
#[cfg(feature = "cli")]
fn describe_discovery() {
    describe_counter!(
        TOPOLOGY_FAILURES,
        "Batches failed because the P topology was unavailable"
    );
    describe_counter!(
        TOPOLOGY_REFRESHES,
        "Cached topologies dropped and asked again because a peer they name failed"
    );
    describe_counter!(
        BOOTSTRAP_LOOKUPS,
        "Topology lookups, by result (cached, queried, joined, failed)"
    );
    describe_counter!(
        BOOTSTRAP_QUERIES,
        "GET /query requests sent, by result (ok, error)"
    );
    describe_histogram!(BOOTSTRAP_LATENCY, Unit::Seconds, "GET /query round trip");
    describe_counter!(
        TRANSPORT_ERRORS,
        "Side-channel failures (local, bad_address, connect, send, recv, closed)"
    );
    describe_counter!(
        SIDE_CHANNELS,
        "Pulls by how their DEALER was obtained: opened (new connection) or reused (pooled)"
    );
}

/// Handles an actor uses for every request, kept by that actor after their first use: the same
/// series [`Labels`] hands out (bound, like those, to the recorder of their first use), without
/// the shared table's lock, hash and reference count per use.
#[derive(Default)]
pub struct KeptHandles {
    counters: std::cell::RefCell<smallvec::SmallVec<[(HandleKey, Counter); 6]>>,
    histograms: std::cell::RefCell<smallvec::SmallVec<[(&'static str, Histogram); 2]>>,
}

impl KeptHandles {
    /// Add `n` to counter `name` (with `label` = `value`, no extra label if `label` is empty).
    pub fn increment(
        &self,
        labels: &Labels,
        name: &'static str,
        label: &'static str,
        value: &'static str,
        n: u64,
    ) {
        let k = key(name, label, value);
        let mut kept = self.counters.borrow_mut();
        if let Some((_, c)) = kept.iter().find(|(kk, _)| *kk == k) {
            return c.increment(n);
        }
        let c = labels.counter_by(name, label, value);
        c.increment(n);
        kept.push((k, c));
    }

    /// Record `value` into histogram `name`.
    pub fn record(&self, labels: &Labels, name: &'static str, value: f64) {
        let mut kept = self.histograms.borrow_mut();
        if let Some((_, h)) = kept.iter().find(|(n, _)| std::ptr::eq(*n, name)) {
            return h.record(value);
        }
        let h = labels.histogram(name);
        h.record(value);
        kept.push((name, h));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept handle is the shared one: what it records is in the recorder's series.
    #[cfg(feature = "cli")]
    #[test]
    fn kept_handles_record_into_the_labels_series() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let labels = Labels::new("d", 0, 0);
            let kept = KeptHandles::default();
            kept.increment(&labels, SETTLES, "outcome", "ok", 2);
            kept.increment(&labels, SETTLES, "outcome", "ok", 3);
            kept.increment(&labels, SETTLES, "outcome", "failed", 1);
            labels.counter_by(SETTLES, "outcome", "ok").increment(1);
            kept.record(&labels, PULL_LATENCY, 0.5);
            kept.record(&labels, PULL_LATENCY, 1.5);
        });
        let text = handle.render();
        let line = |needle: &str| {
            text.lines()
                .find(|l| l.starts_with(SETTLES) && l.contains(needle))
                .map(|l| l.rsplit(' ').next().unwrap().to_string())
        };
        assert_eq!(line("outcome=\"ok\"").as_deref(), Some("6"));
        assert_eq!(line("outcome=\"failed\"").as_deref(), Some("1"));
        let count = text
            .lines()
            .find(|l| l.starts_with(&format!("{PULL_LATENCY}_count{{")))
            .and_then(|l| l.rsplit(' ').next());
        assert_eq!(count, Some("2"), "{text}");
    }

    #[test]
    fn a_coordinators_labels_name_its_engine_and_ranks() {
        let mut cfg = crate::config::KvRecvConfig {
            engine_id: "d-7".into(),
            ..Default::default()
        };
        cfg.d_rank.tp_size = 4;
        cfg.d_rank.tp_rank = 3;
        cfg.d_rank.pp_size = 2;
        cfg.d_rank.pp_rank = 1;
        let l = Labels::for_config(&cfg);
        let pairs: Vec<(&str, &str)> = l.0.labels.iter().map(|l| (l.key(), l.value())).collect();
        assert_eq!(
            pairs,
            [("engine", "d-7"), ("tp_rank", "3"), ("pp_rank", "1")]
        );
        let by = l.with("outcome", "ok");
        assert_eq!(by.len(), 4);
        assert_eq!((by[3].key(), by[3].value()), ("outcome", "ok"));
    }
}
