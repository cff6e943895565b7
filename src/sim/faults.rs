//! Per-worker fault knobs of the prefill simulator, and its seedable randomness.

#![forbid(unsafe_code)]

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// A reply that breaks the wire format (PROTOCOL.md §2.5, §7.2 rule 4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Malformed {
    /// Bytes that are not msgpack.
    Garbage,
    /// A valid response split over two frames.
    MultiFrame,
    /// `{"status": 4}` (3 is `LAYOUT_MISS` since vLLM 0.33).
    BadStatus,
    /// A frame of this many bytes (over D's `ZMQ_MAXMSGSIZE` when large enough), at most
    /// [`MAX_OVERSIZED`].
    Oversized(#[serde(deserialize_with = "bounded_frame")] usize),
}

/// Largest `Oversized` frame: well past any `ZMQ_MAXMSGSIZE` worth testing (D's default is
/// 16 MiB), small enough that the simulator can build it.
pub const MAX_OVERSIZED: usize = 256 * 1024 * 1024;

fn bounded_frame<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let n = usize::deserialize(d)?;
    if n > MAX_OVERSIZED {
        return Err(serde::de::Error::custom(format!(
            "oversized frame of {n} bytes: at most {MAX_OVERSIZED}"
        )));
    }
    Ok(n)
}

/// What a worker does wrong. The default is a healthy worker. Rates are probabilities in 0..=1.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// A written request is reported in `err_reqs` (after its write was done).
    pub failure_rate: f64,
    /// A ready request is silently left out of both lists ("expired before sending on P side").
    pub omission_rate: f64,
    /// Write duration per subset, uniform in `[min, max]` milliseconds.
    pub write_delay_ms: (u64, u64),
    /// Answer ERROR instead of the subset that follows this many answered subsets (0: the first).
    pub error_after_subsets: Option<u32>,
    /// That ERROR names the current subset in `err_reqs` (vLLM's replay-fence case).
    pub error_names_subset: bool,
    /// Refuse every pull with one peer-wide ERROR without `err_reqs` (a validation failure).
    pub reject_pulls: Option<String>,
    /// Never answer (the pull's task hangs; the worker keeps serving other pulls).
    pub hang: bool,
    /// Close the ROUTER (the worker process dies) after this many answered subsets of a pull
    /// (0: as soon as the pull arrives).
    pub crash_after_subsets: Option<u32>,
    /// Replace every answer with a malformed one.
    pub malformed: Option<Malformed>,
    /// Add an id D never asked for to every `ok_reqs`.
    pub unknown_ids: bool,
    /// Report every `ok_reqs` id twice, and repeat the previous answer's ids.
    pub duplicate_ids: bool,
    /// Forget every cached D layout before each `n`-th pull (vLLM 0.33's LRU evicting, or a P
    /// restart): a pull that omits its layout then gets `LAYOUT_MISS`.
    pub evict_layouts_every: Option<u32>,
    /// Behave as vLLM 0.32 and older: ignore `layout_id`, never cache a layout, never echo.
    pub legacy_0_32: bool,
}

impl Faults {
    /// Parse the JSON form used by `kvrecv prefill-sim --faults`.
    pub fn from_json(s: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(s)
    }
}

/// The simulator's randomness: seeded, so a failing run can be replayed.
pub struct FaultRng(SmallRng);

impl FaultRng {
    pub fn new(seed: u64) -> Self {
        FaultRng(SmallRng::seed_from_u64(seed))
    }

    /// True with probability `p` (clamped to 0..=1; 0 never draws).
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (p >= 1.0 || self.0.random_bool(p))
    }

    /// A delay uniform in `[min, max]` ms.
    pub fn delay(&mut self, (min, max): (u64, u64)) -> Duration {
        let ms = if max > min {
            self.0.random_range(min..=max)
        } else {
            min
        };
        Duration::from_millis(ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_zero_and_one_are_exact_and_json_round_trips() {
        let mut r = FaultRng::new(7);
        assert!((0..100).all(|_| !r.chance(0.0)));
        assert!((0..100).all(|_| r.chance(1.0)));
        assert_eq!(r.delay((5, 5)), Duration::from_millis(5));
        let e = Faults::from_json(r#"{"malformed":{"oversized":1000000000000000}}"#).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        let f = Faults::from_json(r#"{"failure_rate":0.5,"malformed":{"oversized":100}}"#).unwrap();
        assert_eq!(f.malformed, Some(Malformed::Oversized(100)));
        assert!(Faults::from_json(r#"{"failure_rat":0.5}"#).is_err());
    }
}
