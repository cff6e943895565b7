//! What one `kvrecv repro` run does: the workload, the fault injection and the variants compared.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::config::Policy;

/// One column of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// Upstream vLLM: complete on the first failure, no landing permits.
    Naive,
    /// Upstream completion, but kvrecv's landing permits refuse late writes.
    NaivePermits,
    /// kvrecv's default: settle rules and landing permits.
    Settle,
    /// `settle` with the epoch rule off: a window whose writer may still write is reused as
    /// soon as it closes. Shows what the rule prevents once late writers meet recycled windows.
    SettleNoEpochs,
}

impl Variant {
    pub fn policy(self) -> Policy {
        match self {
            Variant::Naive | Variant::NaivePermits => Policy::Naive,
            Variant::Settle | Variant::SettleNoEpochs => Policy::Settle,
        }
    }

    /// Whether the epoch rule is on (it matters only with permits).
    pub fn epoch_rule(self) -> bool {
        !matches!(self, Variant::SettleNoEpochs)
    }

    pub fn permits(self) -> bool {
        !matches!(self, Variant::Naive)
    }

    pub fn label(self) -> &'static str {
        match self {
            Variant::Naive => "naive",
            Variant::NaivePermits => "naive+permits",
            Variant::Settle => "settle",
            Variant::SettleNoEpochs => "settle-no-epochs",
        }
    }
}

/// Faults beyond the seed's, switched on by `--soak`: every `period`, one peer misbehaves in one
/// way for a while (hang past the deadline, garbage replies, omissions, crash and restart, peer-
/// wide ERROR, unknown and duplicate ids, late writes landing after the deadline), then recovers.
/// Throughout, every P worker evicts its cached D layouts (vLLM 0.33's LRU) before every
/// `evict_layouts_every`-th pull: pulls that omitted their layout get `LAYOUT_MISS` and D
/// resends them with it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Soak {
    pub period: Duration,
    pub fault_for: Duration,
    /// Evict P's layout cache before every n-th pull of each worker (`None`: never).
    pub evict_layouts_every: Option<u32>,
}

/// Default of [`Soak::evict_layouts_every`]: often enough that every soak resends.
pub const SOAK_EVICT_LAYOUTS_EVERY: u32 = 5;

impl Default for Soak {
    fn default() -> Self {
        Soak {
            period: Duration::from_millis(1500),
            fault_for: Duration::from_millis(700),
            evict_layouts_every: Some(SOAK_EVICT_LAYOUTS_EVERY),
        }
    }
}

/// The whole experiment.
#[derive(Debug, Clone, Serialize)]
pub struct Scenario {
    pub trace: PathBuf,
    /// Requests taken from the start of the trace.
    pub requests: usize,
    /// Trace time is divided by this (arrivals only; write delays stay real).
    pub time_scale: f64,
    /// Tokens per destination block (the trace's hash blocks are 512 tokens).
    pub block_tokens: u64,
    /// Bytes per block per layer.
    pub block_bytes: u64,
    pub layers: u32,
    /// Destination blocks in D's pool (bounded, so freed blocks are reused quickly).
    pub pool_blocks: u32,
    pub p_tp: u32,
    pub p_pp: u32,
    pub d_tp: u32,
    /// Peer 0 reports this fraction of requests failed after writing them.
    pub fail_rate: f64,
    /// Peer 1 delays each write uniformly in this range (ms).
    pub delay_ms: (u64, u64),
    pub seed: u64,
    pub variants: Vec<Variant>,
    pub pull_timeout: Duration,
    pub quarantine_deadline: Duration,
    /// Landing windows (epochs) of D's target; `None`: the target's default.
    pub windows: Option<u32>,
    pub soak: Option<Soak>,
}

impl Scenario {
    /// Refuse values the run cannot honour (before anything is allocated for them).
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("--p-tp", self.p_tp),
            ("--p-pp", self.p_pp),
            ("--d-tp", self.d_tp),
            ("--layers", self.layers),
            ("--pool-blocks", self.pool_blocks),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{flag} must be > 0"));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(format!(
                "time scale {} must be a positive number",
                self.time_scale
            ));
        }
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(format!("fail rate {} must be in 0..=1", self.fail_rate));
        }
        if self.layers as usize > crate::layout::MAX_REGIONS {
            return Err(format!("--layers: at most {}", crate::layout::MAX_REGIONS));
        }
        if self.pool_blocks > MAX_POOL_BLOCKS {
            return Err(format!("--pool-blocks: at most {MAX_POOL_BLOCKS}"));
        }
        if self.block_bytes == 0 || self.block_tokens == 0 {
            return Err("block bytes and block tokens must be > 0".into());
        }
        if self.pull_timeout.is_zero() {
            return Err("the pull timeout must be > 0".into());
        }
        // PROTOCOL.md §3: one TP size divides the other, or no D rank finds its P ranks (every
        // request would wait out its bootstrap retries instead).
        if self.p_tp % self.d_tp != 0 && self.d_tp % self.p_tp != 0 {
            return Err(format!(
                "--p-tp {} and --d-tp {}: one must divide the other",
                self.p_tp, self.d_tp
            ));
        }
        if self.windows.is_some_and(|w| w < 2) {
            return Err("--windows: at least 2 (one is reserved)".into());
        }
        Ok(())
    }
}

/// Most destination blocks a repro pool may have (the demo replays a bounded pool; each block
/// has per-block state in the pool and the ledger).
pub const MAX_POOL_BLOCKS: u32 = 1 << 20;

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            trace: PathBuf::from(super::trace::BUILTIN),
            requests: 800,
            time_scale: 20.0,
            block_tokens: 512,
            block_bytes: 4096,
            layers: 2,
            pool_blocks: 1024,
            p_tp: 2,
            p_pp: 1,
            d_tp: 1,
            fail_rate: 0.05,
            delay_ms: (0, 500),
            seed: 1,
            variants: vec![Variant::Naive, Variant::NaivePermits, Variant::Settle],
            pull_timeout: Duration::from_secs(10),
            quarantine_deadline: Duration::from_secs(30),
            windows: None,
            soak: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_the_run_cannot_honour_are_refused_before_anything_is_built() {
        assert_eq!(Scenario::default().validate(), Ok(()));
        let bad = [
            Scenario {
                time_scale: f64::NAN,
                ..Scenario::default()
            },
            Scenario {
                fail_rate: 2.0,
                ..Scenario::default()
            },
            Scenario {
                fail_rate: f64::NAN,
                ..Scenario::default()
            },
            Scenario {
                pool_blocks: u32::MAX,
                ..Scenario::default()
            },
            Scenario {
                layers: u32::MAX,
                ..Scenario::default()
            },
            Scenario {
                pull_timeout: Duration::ZERO,
                ..Scenario::default()
            },
            Scenario {
                d_tp: 0,
                ..Scenario::default()
            },
            Scenario {
                p_tp: 2,
                d_tp: 3,
                ..Scenario::default()
            },
            Scenario {
                windows: Some(1),
                ..Scenario::default()
            },
        ];
        for s in bad {
            assert!(s.validate().is_err(), "{s:?}");
        }
    }
}
