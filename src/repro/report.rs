//! The table `kvrecv repro` prints, one column per variant, and its JSON form.

#![forbid(unsafe_code)]

use std::fmt::Write as _;

use serde::Serialize;

use super::scenario::Variant;

/// What one variant measured. Field names are the table's rows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct VariantReport {
    pub variant: String,
    pub requests: usize,
    /// Requests both peers wrote bytes for (the ones the bug can hit).
    pub written_by_both_peers: usize,
    /// Per-peer failures P reported after writing (the seed's fault).
    pub injected_failures: usize,
    /// Requests with at least one write that landed after D had freed the block.
    pub requests_written_after_free: u64,
    /// Block writes that landed after D had freed the block (including reallocated ones).
    pub writes_after_free: u64,
    /// Of those, writes into a block that already belonged to another request.
    pub writes_after_realloc: u64,
    /// Late writes the landing permits refused.
    pub late_writes_rejected: u64,
    /// Pulls P answered `LAYOUT_MISS` (its layout cache evicted, `--soak`) and D resent with
    /// their layout (a lower bound when the soak restarted a worker).
    pub layout_resends: u64,
    /// Idle connections the soak's floods held open on D's handshake and data ports.
    pub idle_connections_flooded: usize,
    /// Landing windows poisoned because their pull's writer may still write (the epoch rule).
    pub windows_poisoned: u64,
    /// Pulls that found no clean window and failed safe (their writes refused at P).
    pub pulls_without_window: u64,
    /// Awaited requests that never completed.
    pub leaked: usize,
    /// Smallest and largest number of completions of one awaited request (must be 1 and 1).
    pub completions_min: usize,
    pub completions_max: usize,
    pub pulls_per_s: f64,
    pub completion_p50_ms: f64,
    pub completion_p99_ms: f64,
    /// Stamped block writes the audit checked.
    pub audited_writes: u64,
    /// Blocks still quarantined at the end.
    pub quarantined_at_end: usize,
    pub duration_s: f64,
}

impl VariantReport {
    /// The invariants kvrecv promises (checked for the `settle` column).
    pub fn violations(&self) -> Vec<String> {
        let mut v = vec![];
        if self.writes_after_free > 0 || self.requests_written_after_free > 0 {
            v.push(format!("{} writes after free", self.writes_after_free));
        }
        if self.leaked > 0 {
            v.push(format!("{} leaked requests", self.leaked));
        }
        if self.completions_min != 1 || self.completions_max != 1 {
            v.push(format!(
                "completions per awaited request in {}..={}",
                self.completions_min, self.completions_max
            ));
        }
        v
    }
}

/// How one table cell is rendered from a column's report.
type Cell = Box<dyn Fn(&VariantReport) -> String>;

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub variants: Vec<VariantReport>,
}

impl Report {
    pub fn get(&self, v: Variant) -> Option<&VariantReport> {
        self.variants.iter().find(|r| r.variant == v.label())
    }

    /// Violations of the `settle` column (empty when it holds or was not run).
    pub fn settle_violations(&self) -> Vec<String> {
        self.get(Variant::Settle)
            .map(|r| r.violations())
            .unwrap_or_default()
    }

    /// A fixed-width table.
    pub fn table(&self) -> String {
        let rows: Vec<(&str, Cell)> = vec![
            ("requests", Box::new(|r| r.requests.to_string())),
            (
                "written by both peers",
                Box::new(|r| r.written_by_both_peers.to_string()),
            ),
            (
                "injected failures",
                Box::new(|r| r.injected_failures.to_string()),
            ),
            (
                "requests written after free",
                Box::new(|r| r.requests_written_after_free.to_string()),
            ),
            (
                "block writes after free",
                Box::new(|r| r.writes_after_free.to_string()),
            ),
            (
                "  of those after realloc",
                Box::new(|r| r.writes_after_realloc.to_string()),
            ),
            (
                "late block writes rejected",
                Box::new(|r| r.late_writes_rejected.to_string()),
            ),
            (
                "layout resends (LAYOUT_MISS)",
                Box::new(|r| r.layout_resends.to_string()),
            ),
            (
                "idle connections flooded",
                Box::new(|r| r.idle_connections_flooded.to_string()),
            ),
            (
                "windows poisoned",
                Box::new(|r| r.windows_poisoned.to_string()),
            ),
            (
                "pulls without a clean window",
                Box::new(|r| r.pulls_without_window.to_string()),
            ),
            ("leaked requests", Box::new(|r| r.leaked.to_string())),
            (
                "completions per request",
                Box::new(|r| {
                    if r.completions_min == r.completions_max {
                        r.completions_min.to_string()
                    } else {
                        format!("{}..{}", r.completions_min, r.completions_max)
                    }
                }),
            ),
            ("pulls/s", Box::new(|r| format!("{:.0}", r.pulls_per_s))),
            (
                "completion p50 (ms)",
                Box::new(|r| format!("{:.1}", r.completion_p50_ms)),
            ),
            (
                "completion p99 (ms)",
                Box::new(|r| format!("{:.1}", r.completion_p99_ms)),
            ),
        ];
        let w0 = rows.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
        let widths: Vec<usize> = self
            .variants
            .iter()
            .map(|v| {
                rows.iter()
                    .map(|(_, f)| f(v).len())
                    .chain([v.variant.len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        let _ = write!(out, "{:w0$}", "");
        for (v, w) in self.variants.iter().zip(&widths) {
            let _ = write!(out, "  {:>w$}", v.variant);
        }
        out.push('\n');
        for (name, f) in &rows {
            let _ = write!(out, "{name:w0$}");
            for (v, w) in self.variants.iter().zip(&widths) {
                let _ = write!(out, "  {:>w$}", f(v));
            }
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settle_violations_name_what_broke() {
        let ok = VariantReport {
            variant: "settle".into(),
            completions_min: 1,
            completions_max: 1,
            ..Default::default()
        };
        let bad = VariantReport {
            writes_after_free: 3,
            leaked: 1,
            completions_max: 2,
            ..ok.clone()
        };
        assert!(Report {
            variants: vec![ok.clone()]
        }
        .settle_violations()
        .is_empty());
        let v = Report {
            variants: vec![bad],
        }
        .settle_violations();
        assert_eq!(v.len(), 3, "{v:?}");
        let t = Report { variants: vec![ok] }.table();
        assert!(t.contains("block writes after free") && t.contains("settle"));
    }
}
