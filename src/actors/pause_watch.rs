//! Sleep mode's wait (DESIGN.md §7, "pause and resume"): the requests that held blocks when a
//! pause began, and how each one's blocks came back. The BlockManager, which releases every
//! block, feeds it each release; the pause resolves once nothing it waited for holds a block.

#![forbid(unsafe_code)]

use tokio::sync::oneshot;

use crate::fast_hash::FastSet;
use crate::messages::{AbandonedRequest, PauseReport, ReqId};

/// A pause waiting for the releases of the requests that held blocks.
#[derive(Debug, Default)]
pub struct PauseWatch {
    waiting: FastSet<ReqId>,
    report: PauseReport,
    /// Every pause waiting (a pause dropped midway and called again waits too).
    replies: Vec<oneshot::Sender<PauseReport>>,
}

impl PauseWatch {
    /// Wait (also) for `holders`; `reply` gets the report.
    pub fn watch(&mut self, holders: &[ReqId], reply: oneshot::Sender<PauseReport>) {
        self.waiting.extend(holders.iter().cloned());
        self.replies.push(reply);
    }

    /// `req_id`'s blocks were released (`fenced`: its suspects fenced first; `forced`: by the
    /// last-resort deadline). Releases of requests the pause does not wait for are ignored.
    pub fn released(&mut self, req_id: &ReqId, blocks: Vec<u32>, fenced: bool, forced: bool) {
        if self.waiting.remove(req_id) {
            self.report.abandoned.push(AbandonedRequest {
                req_id: req_id.clone(),
                blocks,
                fenced,
                forced,
            });
        }
    }

    /// Whether every request waited for was released.
    pub fn done(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Send the report to every pause waiting.
    pub fn finish(self) {
        for reply in self.replies {
            let _ = reply.send(self.report.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_comes_once_every_holder_was_released_and_lists_only_them() {
        let mut w = PauseWatch::default();
        let (tx, mut rx) = oneshot::channel();
        w.watch(&["a".into(), "b".into()], tx);
        w.released(&"other".into(), vec![9], false, false);
        w.released(&"a".into(), vec![1, 2], true, false);
        assert!(!w.done(), "b still holds its blocks");
        w.released(&"b".into(), vec![3], false, true);
        assert!(w.done());
        w.finish();
        let report = rx.try_recv().expect("sent once done");
        let ids: Vec<&str> = report.abandoned.iter().map(|a| &*a.req_id).collect();
        assert_eq!(ids, ["a", "b"]);
        assert!(report.abandoned[0].fenced && report.abandoned[1].forced);
        assert_eq!(report.abandoned[0].blocks, vec![1, 2]);
    }
}
