//! Configuration: vLLM's `kv_transfer_config` JSON plus kvrecv's own keys (under
//! `kv_connector_extra_config.kvrecv`), so an operator can reuse what they already write.

#![forbid(unsafe_code)]

use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use crate::layout::KvLayout;

/// When a request's receive is over (DESIGN.md §4 rule 9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Complete only when every peer settled (the fix). Default.
    #[default]
    Settle,
    /// Upstream vLLM: complete on the first failure. For the demo and the detector tests only.
    Naive,
}

impl Policy {
    /// The name used in config and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Settle => "settle",
            Policy::Naive => "naive",
        }
    }
}

/// vLLM's `kv_load_failure_policy`: what the host scheduler does with a request whose KV load
/// failed (PROTOCOL.md §4). Both values are honoured, because both are the scheduler's action on
/// the signals kvrecv hands out, and kvrecv's signals serve either: the failure is drained at
/// once (`invalid_block_ids`, block-level, or `failed_recving` for multi-group caches) and the
/// completion (`finished_recving`) comes only when no peer can write into the blocks any more.
/// **fail**: the host ends the request with an error at once but keeps its blocks until the
/// completion. **recompute**: the host keeps the request waiting, and at the completion
/// recomputes from the first invalid block into the same blocks; this is safe only because
/// kvrecv never releases a block a late writer can still reach. The host reads the value from
/// [`KvRecvConfig::load_failure_policy`] (or `KvRecv::load_failure_policy`). Any other value is
/// refused at parse time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadFailurePolicy {
    #[default]
    /// End the request with an error at once; keep its blocks until the completion.
    Fail,
    /// Keep the request waiting and recompute into the same blocks after the completion.
    Recompute,
}

/// This D worker's place in its own engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DRank {
    /// D's tensor-parallel size (maps D ranks onto P ranks).
    pub tp_size: u32,
    /// This D worker's TP rank.
    pub tp_rank: u32,
    /// D's pipeline-parallel size.
    pub pp_size: u32,
    /// This D worker's PP rank.
    pub pp_rank: u32,
}

impl Default for DRank {
    fn default() -> Self {
        DRank {
            tp_size: 1,
            tp_rank: 0,
            pp_size: 1,
            pp_rank: 0,
        }
    }
}

/// The Mooncake transport P writes with (vLLM's `mooncake_protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MooncakeProtocol {
    /// TCP: kvrecv's own target, landing permits revoke per request.
    #[default]
    Tcp,
    /// RDMA: one-sided writes; a transfer-engine failure is fenced like an uncertain peer.
    Rdma,
}

/// Everything the coordinator needs.
#[derive(Debug, Clone, PartialEq)]
pub struct KvRecvConfig {
    /// When a request's receive is over (`settle` unless proving the bug).
    pub policy: Policy,
    /// vLLM's `kv_load_failure_policy`, for the host scheduler to act on.
    pub load_failure_policy: LoadFailurePolicy,
    /// `kv_connector_extra_config.mooncake_protocol`.
    pub mooncake_protocol: MooncakeProtocol,
    /// D-side per-pull deadline: the longest a pull waits for a reply that restarts it (one
    /// that settles a request; DESIGN.md §6). The default allows P's 480 s readiness wait plus
    /// time queued behind P's 20 serving tasks.
    pub pull_timeout: Duration,
    /// How long D still waits for P's answer to a request the host aborted (once its pull owes
    /// nothing else): P's answer proves its writes stopped, so the pull's landing window goes
    /// back into rotation; without one by then the window is poisoned until
    /// `quarantine_deadline` (DESIGN.md §5). The aborted request's blocks are held meanwhile.
    pub abort_grace: Duration,
    /// Last resort for a quarantine that cannot be fenced.
    pub quarantine_deadline: Duration,
    /// Backoff before a failed peer is used again; doubled per consecutive failure.
    pub peer_backoff_base: Duration,
    /// Cap of the peer backoff.
    pub peer_backoff_max: Duration,
    /// A Peer (one P worker's actor, its state and pooled sockets) no pull was handed for this
    /// long is retired, once nothing of it is in flight: peers that came and went do not
    /// accumulate (a bootstrap server may list up to `max_p_workers` new ones per engine).
    pub peer_retire_after: Duration,
    /// Requests live at once (loaded, not yet drained); more are refused with
    /// `BatchError::Backpressure`.
    pub max_live_requests: usize,
    /// Backoff between topology lookups of an engine that is unhealthy (its last lookup failed,
    /// or a peer it names is down): base, doubled per attempt, capped. The cap bounds how long
    /// after a P engine comes back on new ports D keeps failing its requests.
    pub topology_retry_base: Duration,
    /// Cap of the topology lookup backoff.
    pub topology_retry_max: Duration,
    /// This D worker's TP/PP rank and sizes (which P ranks it pulls from).
    pub d_rank: DRank,
    /// Where P writes: regions, block sizes, block count. Required: the default is none, and a
    /// start without one is refused ([`ConfigError::NoLayout`]).
    pub layout: KvLayout,
    /// This D worker's engine id (vLLM's `engine_id`): the `engine` label of every metric, so
    /// coordinators sharing one process and recorder keep their series apart. Empty (the
    /// default) or missing from a kv-transfer config: a random UUID, as vLLM gives it.
    pub engine_id: String,
    /// vLLM 0.33's layout ids (PROTOCOL.md §2.7): each pull names its landing window's layout
    /// by an id, and pulls to a P worker that echoed it omit the layout. Off: `layout_id` is
    /// never sent (0) and every pull carries the layout, as with vLLM 0.32.
    pub layout_ids: bool,
}

/// Default cap on live requests: far above any real scheduler's in-flight count, low enough
/// that a host that never drains is told before memory runs away.
pub const DEFAULT_MAX_LIVE: usize = 1 << 17;

impl Default for KvRecvConfig {
    fn default() -> Self {
        KvRecvConfig {
            policy: Policy::Settle,
            load_failure_policy: LoadFailurePolicy::Fail,
            mooncake_protocol: MooncakeProtocol::Tcp,
            pull_timeout: Duration::from_secs(600),
            abort_grace: Duration::from_secs(30),
            quarantine_deadline: Duration::from_secs(900),
            peer_backoff_base: Duration::from_millis(100),
            peer_backoff_max: Duration::from_secs(10),
            peer_retire_after: Duration::from_secs(60),
            max_live_requests: DEFAULT_MAX_LIVE,
            topology_retry_base: Duration::from_millis(100),
            topology_retry_max: Duration::from_secs(2),
            d_rank: DRank::default(),
            // None: a start without one is refused (`NoLayout`), as from JSON.
            layout: KvLayout {
                regions: Vec::new(),
                num_blocks: 0,
                num_groups: 0,
            },
            engine_id: String::new(),
            layout_ids: true,
        }
    }
}

#[derive(Debug, Error)]
/// Why a configuration is refused.
#[non_exhaustive]
pub enum ConfigError {
    #[error(
        "kv_transfer_config {what}: {err}",
        err = .0,
        what = if .0.is_data() { "does not have the expected fields and types" } else { "is not valid JSON" }
    )]
    /// Not JSON, or a typed key with the wrong type.
    Json(#[from] serde_json::Error),
    #[error("kv_role must be \"kv_consumer\" for kvrecv, got {0:?}")]
    /// kvrecv is the consumer side only.
    Role(String),
    #[error("kv_connector must be \"MooncakeConnector\", got {0:?}")]
    /// kvrecv speaks only Mooncake's protocol.
    Connector(String),
    #[error("mooncake_protocol must be \"tcp\" or \"rdma\", got {0:?}")]
    /// Mooncake's transfer engine protocols kvrecv serves.
    Protocol(String),
    #[error("{key} must be > 0")]
    /// A count or duration that must be positive.
    Zero {
        /// The key.
        key: &'static str,
    },
    #[error("invalid layout: {0}")]
    /// The layout is inconsistent (empty, overlapping groups, zero sizes).
    Layout(String),
    #[error("D rank outside its world size: {0}")]
    /// `tp_rank`/`pp_rank` not below `tp_size`/`pp_size`.
    Rank(String),
    /// A silently assumed layout would advertise addresses P writes real bytes to.
    #[error(
        "no destination layout: give kv_connector_extra_config.kvrecv.layout \
         ({{num_blocks, num_groups, regions: [{{layer_name, layer_index, group_index, block_len, kv_block_len}}]}})"
    )]
    NoLayout,
}

/// `kv_transfer_config` as parsed, before a layout is required: for callers that supply the
/// layout another way (`kvrecv serve`'s flags).
#[derive(Debug, Clone)]
pub struct ParsedKvTransfer {
    /// The configuration; its `layout` is the default unless `layout_given`.
    pub config: KvRecvConfig,
    /// Whether `kv_connector_extra_config.kvrecv.layout` was present.
    pub layout_given: bool,
    /// Top-level keys kvrecv does not know (vLLM adds keys every release): accepted, ignored.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub ignored_keys: Vec<String>,
}

/// vLLM's top level: known keys typed, any other key kept to be named in one warning (vLLM adds
/// keys every release, e.g. `enable_permute_local_kv`, and must not break a deployment).
#[derive(Deserialize)]
struct RawKvTransfer {
    #[serde(default)]
    kv_connector: Option<String>,
    kv_role: String,
    #[serde(default)]
    kv_load_failure_policy: LoadFailurePolicy,
    #[serde(default)]
    kv_connector_extra_config: RawExtra,
    #[serde(default)]
    engine_id: Option<String>,
    #[serde(flatten)]
    unknown: std::collections::BTreeMap<String, serde_json::Value>,
}

#[derive(Deserialize, Default)]
struct RawExtra {
    #[serde(default)]
    mooncake_protocol: Option<String>,
    #[serde(default)]
    kvrecv: RawKvRecv,
}

/// `kv_transfer_config` keys that configure vLLM itself: accepted without a warning.
const VLLM_KEYS: &[&str] = &[
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_connector_module_path",
];

/// kvrecv's own keys: unknown ones are refused, because they can only be typos of ours.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawKvRecv {
    policy: Option<Policy>,
    pull_timeout_ms: Option<u64>,
    abort_grace_ms: Option<u64>,
    quarantine_deadline_ms: Option<u64>,
    peer_backoff_base_ms: Option<u64>,
    peer_backoff_max_ms: Option<u64>,
    peer_retire_after_ms: Option<u64>,
    max_live_requests: Option<usize>,
    topology_retry_base_ms: Option<u64>,
    topology_retry_max_ms: Option<u64>,
    tp_size: Option<u32>,
    tp_rank: Option<u32>,
    pp_size: Option<u32>,
    pp_rank: Option<u32>,
    layout: Option<KvLayout>,
    layout_ids: Option<bool>,
}

/// Top-level keys neither kvrecv nor vLLM knows. vLLM's own keys configure vLLM itself: they
/// are accepted silently; anything else is named.
fn ignored_keys(raw: &RawKvTransfer) -> Vec<String> {
    raw.unknown
        .keys()
        .filter(|k| !VLLM_KEYS.contains(&k.as_str()))
        .cloned()
        .collect()
}

impl KvRecvConfig {
    /// Parse vLLM's `--kv-transfer-config` JSON.
    ///
    /// ```
    /// let c = kvrecv::KvRecvConfig::from_kv_transfer_config(r#"{
    ///   "kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
    ///   "kv_connector_extra_config": {"mooncake_protocol": "tcp",
    ///     "kvrecv": {"policy": "settle", "pull_timeout_ms": 30000,
    ///       "layout": {"num_blocks": 1024, "num_groups": 1, "regions": [{"layer_name": "l0",
    ///         "layer_index": 0, "group_index": 0, "block_len": 16384, "kv_block_len": 16384}]}}}}"#).unwrap();
    /// assert_eq!(c.pull_timeout.as_secs(), 30);
    /// ```
    ///
    /// Unknown top-level keys are accepted with one warning; unknown keys under `kvrecv` are
    /// refused; the layout is required ([`ConfigError::NoLayout`]).
    pub fn from_kv_transfer_config(json: &str) -> Result<Self, ConfigError> {
        let p = Self::parse_kv_transfer_config(json)?;
        if !p.layout_given {
            return Err(ConfigError::NoLayout);
        }
        Ok(p.config)
    }

    /// Parse without requiring a layout; logs one warning naming every ignored key.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    pub(crate) fn parse_kv_transfer_config(json: &str) -> Result<ParsedKvTransfer, ConfigError> {
        let raw: RawKvTransfer = serde_json::from_str(json)?;
        let ignored_keys = ignored_keys(&raw);
        if !ignored_keys.is_empty() {
            tracing::warn!(keys = ?ignored_keys, "kv_transfer_config keys kvrecv does not know; ignored");
        }
        if raw.kv_role != "kv_consumer" {
            return Err(ConfigError::Role(raw.kv_role));
        }
        if let Some(c) = raw.kv_connector {
            if c != "MooncakeConnector" {
                return Err(ConfigError::Connector(c));
            }
        }
        let mut cfg = KvRecvConfig {
            load_failure_policy: raw.kv_load_failure_policy,
            // vLLM's `KVTransferConfig` gives an engine without an id a random UUID.
            engine_id: raw
                .engine_id
                .unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            ..KvRecvConfig::default()
        };
        if let Some(p) = raw.kv_connector_extra_config.mooncake_protocol {
            cfg.mooncake_protocol = match p.as_str() {
                "tcp" => MooncakeProtocol::Tcp,
                "rdma" => MooncakeProtocol::Rdma,
                _ => return Err(ConfigError::Protocol(p)),
            };
        }
        let k = raw.kv_connector_extra_config.kvrecv;
        cfg.policy = k.policy.unwrap_or_default();
        cfg.layout_ids = k.layout_ids.unwrap_or(cfg.layout_ids);
        cfg.apply_limits(&k)?;
        cfg.d_rank = DRank {
            tp_size: k.tp_size.unwrap_or(1),
            tp_rank: k.tp_rank.unwrap_or(0),
            pp_size: k.pp_size.unwrap_or(1),
            pp_rank: k.pp_rank.unwrap_or(0),
        };
        if cfg.d_rank.tp_size == 0 || cfg.d_rank.pp_size == 0 {
            return Err(ConfigError::Zero {
                key: "tp_size/pp_size",
            });
        }
        let layout_given = k.layout.is_some();
        if let Some(l) = k.layout {
            cfg.layout = l;
        }
        match layout_given {
            true => cfg.validate()?,
            false => cfg.validate_ranks()?,
        }
        Ok(ParsedKvTransfer {
            config: cfg,
            layout_given,
            ignored_keys,
        })
    }

    /// The `kvrecv` section's durations (`*_ms`) and live-request cap over the defaults, none
    /// of them 0.
    fn apply_limits(&mut self, k: &RawKvRecv) -> Result<(), ConfigError> {
        let ms = |v: Option<u64>, key: &'static str, dflt: Duration| match v {
            Some(0) => Err(ConfigError::Zero { key }),
            Some(v) => Ok(Duration::from_millis(v)),
            None => Ok(dflt),
        };
        self.pull_timeout = ms(k.pull_timeout_ms, "pull_timeout_ms", self.pull_timeout)?;
        self.abort_grace = ms(k.abort_grace_ms, "abort_grace_ms", self.abort_grace)?;
        self.quarantine_deadline = ms(
            k.quarantine_deadline_ms,
            "quarantine_deadline_ms",
            self.quarantine_deadline,
        )?;
        self.peer_retire_after = ms(
            k.peer_retire_after_ms,
            "peer_retire_after_ms",
            self.peer_retire_after,
        )?;
        self.peer_backoff_base = ms(
            k.peer_backoff_base_ms,
            "peer_backoff_base_ms",
            self.peer_backoff_base,
        )?;
        self.peer_backoff_max = ms(
            k.peer_backoff_max_ms,
            "peer_backoff_max_ms",
            self.peer_backoff_max,
        )?;
        if let Some(n) = k.max_live_requests {
            if n == 0 {
                return Err(ConfigError::Zero {
                    key: "max_live_requests",
                });
            }
            self.max_live_requests = n;
        }
        self.topology_retry_base = ms(
            k.topology_retry_base_ms,
            "topology_retry_base_ms",
            self.topology_retry_base,
        )?;
        self.topology_retry_max = ms(
            k.topology_retry_max_ms,
            "topology_retry_max_ms",
            self.topology_retry_max,
        )?;
        Ok(())
    }

    /// The whole configuration, layout included: what a start checks.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_layout()?;
        self.validate_ranks()
    }

    /// The layout: given ([`ConfigError::NoLayout`] otherwise) and consistent.
    fn validate_layout(&self) -> Result<(), ConfigError> {
        let l = &self.layout;
        if l.regions.is_empty() && l.num_blocks == 0 && l.num_groups == 0 {
            return Err(ConfigError::NoLayout);
        }
        if l.regions.is_empty() || l.num_blocks == 0 || l.num_groups == 0 {
            return Err(ConfigError::Layout(
                "need at least one region, block and group".into(),
            ));
        }
        if l.regions.len() > crate::layout::MAX_REGIONS {
            return Err(ConfigError::Layout(format!(
                "{} regions: at most {}",
                l.regions.len(),
                crate::layout::MAX_REGIONS
            )));
        }
        for r in &l.regions {
            if r.block_len == 0 || r.kv_block_len == 0 || r.kv_block_len > r.block_len {
                return Err(ConfigError::Layout(format!(
                    "{}: kv_block_len {} must be in 1..=block_len {}",
                    r.layer_name, r.kv_block_len, r.block_len
                )));
            }
            if r.group_index >= l.num_groups {
                return Err(ConfigError::Layout(format!(
                    "{}: group {} >= num_groups {}",
                    r.layer_name, r.group_index, l.num_groups
                )));
            }
        }
        Ok(())
    }

    /// This D worker's ranks, inside their world sizes.
    fn validate_ranks(&self) -> Result<(), ConfigError> {
        let d = &self.d_rank;
        if d.tp_rank >= d.tp_size || d.pp_rank >= d.pp_size {
            return Err(ConfigError::Rank(format!(
                "tp_rank {} of tp_size {}, pp_rank {} of pp_size {}",
                d.tp_rank, d.tp_size, d.pp_rank, d.pp_size
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn producer_role_and_unknown_keys_are_refused() {
        let e = KvRecvConfig::from_kv_transfer_config(r#"{"kv_role":"kv_producer"}"#).unwrap_err();
        assert!(e.to_string().contains("kv_consumer"), "{e}");
        let e = KvRecvConfig::from_kv_transfer_config(
            r#"{"kv_role":"kv_consumer","kv_connector_extra_config":{"kvrecv":{"polcy":"naive"}}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("polcy"), "{e}");
        let e = KvRecvConfig::from_kv_transfer_config(
            r#"{"kv_role":"kv_consumer","kv_connector_extra_config":{"mooncake_protocol":"ib"}}"#,
        )
        .unwrap_err();
        assert!(matches!(e, ConfigError::Protocol(_)));
        assert!(KvRecvConfig::from_kv_transfer_config("{").is_err());
    }

    const LAYOUT: &str = r#""layout":{"num_blocks":8,"num_groups":1,"regions":[{"layer_name":"l0",
        "layer_index":0,"group_index":0,"block_len":64,"kv_block_len":64}]}"#;

    #[test]
    fn unknown_vllm_keys_are_accepted_and_named_and_the_layout_is_required() {
        let json = format!(
            r#"{{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",
                "enable_permute_local_kv":false,"some_future_key":{{"a":1}},
                "kv_rank":1,"kv_buffer_size":1e9,
                "kv_connector_extra_config":{{"kvrecv":{{{LAYOUT}}}}}}}"#
        );
        let p = KvRecvConfig::parse_kv_transfer_config(&json).unwrap();
        assert_eq!(
            p.ignored_keys,
            vec!["enable_permute_local_kv", "some_future_key"],
            "vLLM's own keys are not named"
        );
        assert!(p.layout_given);
        assert_eq!(p.config.layout.num_blocks, 8);
        assert_eq!(
            KvRecvConfig::from_kv_transfer_config(&json).unwrap().layout,
            p.config.layout
        );
        // No layout: refused, never the default one.
        let e = KvRecvConfig::from_kv_transfer_config(
            r#"{"kv_role":"kv_consumer","enable_permute_local_kv":true}"#,
        )
        .unwrap_err();
        assert!(matches!(e, ConfigError::NoLayout), "{e}");
        assert!(e.to_string().contains("kvrecv.layout"), "{e}");
        // Both failure policies parse; anything else is refused by name.
        for (v, want) in [
            ("fail", LoadFailurePolicy::Fail),
            ("recompute", LoadFailurePolicy::Recompute),
        ] {
            let j = format!(
                r#"{{"kv_role":"kv_consumer","kv_load_failure_policy":"{v}","kv_connector_extra_config":{{"kvrecv":{{{LAYOUT}}}}}}}"#
            );
            assert_eq!(
                KvRecvConfig::from_kv_transfer_config(&j)
                    .unwrap()
                    .load_failure_policy,
                want
            );
        }
        let e = KvRecvConfig::from_kv_transfer_config(
            r#"{"kv_role":"kv_consumer","kv_load_failure_policy":"retry"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("retry"), "{e}");
    }

    #[test]
    fn vllm_keys_and_kvrecv_keys_are_read() {
        let c = KvRecvConfig::parse_kv_transfer_config(
            r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_load_failure_policy":"recompute",
                "engine_id":"x","kv_connector_extra_config":{"mooncake_protocol":"rdma","num_workers":10,
                "kvrecv":{"policy":"naive","tp_size":2,"tp_rank":1,"quarantine_deadline_ms":5}}}"#,
        )
        .unwrap()
        .config;
        assert_eq!(c.policy, Policy::Naive);
        assert_eq!(c.load_failure_policy, LoadFailurePolicy::Recompute);
        assert_eq!(c.mooncake_protocol, MooncakeProtocol::Rdma);
        assert_eq!(c.d_rank.tp_rank, 1);
        assert_eq!(c.engine_id, "x", "the metrics' engine label");
        assert_eq!(c.quarantine_deadline, Duration::from_millis(5));
        assert_eq!(KvRecvConfig::default().policy, Policy::Settle);
    }

    #[test]
    fn a_config_without_an_engine_id_gets_a_random_uuid_as_vllm_gives_it() {
        let parse = || {
            KvRecvConfig::parse_kv_transfer_config(r#"{"kv_role":"kv_consumer"}"#)
                .unwrap()
                .config
                .engine_id
        };
        let (a, b) = (parse(), parse());
        assert!(uuid::Uuid::parse_str(&a).is_ok(), "{a:?}");
        assert_ne!(a, b, "one id per engine, never a shared empty label");
    }
}
