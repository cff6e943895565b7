//! The check lines both probes print: `PASS|FAIL|SKIPPED <check> <detail>`, one per check, the
//! format `scripts/device-check` counts and turns into JSON.

use std::fmt::Display;

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    Skipped,
}

impl Verdict {
    fn word(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Skipped => "SKIPPED",
        }
    }
}

/// Prints the lines and remembers whether any failed (the probe's exit status).
#[derive(Debug, Default)]
pub struct Report {
    failed: bool,
    /// Checks reported so far.
    seen: Vec<String>,
}

impl Report {
    /// One check's line; the detail is kept on one line (newlines would split the record).
    pub fn line(&mut self, verdict: Verdict, check: &str, detail: impl Display) {
        self.failed |= verdict == Verdict::Fail;
        self.seen.push(check.to_owned());
        let detail = detail.to_string().replace(['\n', '\r'], " ");
        println!("{} {check} {detail}", verdict.word());
    }

    pub fn pass(&mut self, check: &str, detail: impl Display) {
        self.line(Verdict::Pass, check, detail);
    }

    pub fn fail(&mut self, check: &str, detail: impl Display) {
        self.line(Verdict::Fail, check, detail);
    }

    pub fn skip(&mut self, check: &str, detail: impl Display) {
        self.line(Verdict::Skipped, check, detail);
    }

    /// Whether `check` has its line already.
    #[allow(dead_code)] // one of the two probes that include this file has no use for it
    pub fn reported(&self, check: &str) -> bool {
        self.seen.iter().any(|c| c == check)
    }

    /// Whether any check failed.
    pub fn failed(&self) -> bool {
        self.failed
    }
}
