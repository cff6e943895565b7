//! What the BlockManager does with one completion, without the actor (DESIGN.md §5): revoke
//! first, whatever the outcome (an ok from a v1 writer or a timed-out TE batch is no proof that
//! the bytes stopped moving), poisoning the suspects' windows for as long as a quarantine may
//! last; then, once the revocation is quiet, release the blocks, or quarantine them until the
//! peers the revocation could not fence are fenced. The BlockManager actor and the model check
//! (`tests/model_check.rs`) both run exactly this.

#![forbid(unsafe_code)]

use std::time::Instant;

use futures::future::BoxFuture;

use crate::config::Policy;
use crate::messages::Completion;
use crate::rdma::{Revocation, RevokeRequest, Revoked};

use super::block_ledger::{peers_to_fence, BlockLedger, Disposition};

/// A completion whose landing permits are revoked: what its disposal needs.
#[derive(Debug)]
pub struct RevokedCompletion {
    /// The completion.
    pub completion: Completion,
    /// What the revocation proves.
    pub revocation: Revocation,
    /// Whether any peer was a suspect (then an exact revocation is what fenced it).
    pub had_suspects: bool,
}

impl RevokedCompletion {
    /// The exact revocation fenced the peers that may still write.
    pub fn fenced(&self) -> bool {
        self.had_suspects && self.revocation == Revocation::Exact
    }
}

/// Revoke `c`'s permits through `revoke` (the data plane's [`Landing::revoke`](crate::rdma::Landing::revoke)) at
/// `now`, poisoning its suspects' windows until the ledger's quarantine deadline. Returns the
/// completion to [`dispose`] of, and what to wait for first: a landing read still copying into
/// the request's blocks (`None`: nothing was).
pub fn revoke(
    ledger: &BlockLedger,
    c: Completion,
    now: Instant,
    revoke: impl FnOnce(&RevokeRequest<'_>) -> Revoked,
) -> (RevokedCompletion, Option<BoxFuture<'static, ()>>) {
    let suspects = c.suspects();
    let revoked = revoke(&RevokeRequest {
        req: &c.req,
        suspects: &suspects,
        poison_until: now + ledger.quarantine_deadline(),
    });
    let done = RevokedCompletion {
        completion: c,
        revocation: revoked.revocation,
        had_suspects: !suspects.is_empty(),
    };
    (done, revoked.quiesced)
}

/// Once the revocation is quiet: release the blocks, or quarantine them until the peers it did
/// not fence are (policy `settle`; `naive` fences nothing).
pub fn dispose(
    ledger: &mut BlockLedger,
    policy: Policy,
    r: &RevokedCompletion,
    now: Instant,
) -> Disposition {
    let fence = match policy {
        Policy::Settle => peers_to_fence(&r.completion, r.revocation),
        Policy::Naive => vec![],
    };
    ledger.on_completion(&r.completion, fence, now)
}
