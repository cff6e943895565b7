//! Revoking a request's permits and the epoch rule's poison: which windows stay out of rotation,
//! and when they come back.

#![forbid(unsafe_code)]

use super::*;

impl PermitTable {
    /// Whether closed window `w` may be handed out: not poisoned, or its poison expired.
    pub(super) fn clean(&self, inner: &mut Inner, w: u32, now: Instant) -> bool {
        match inner.poisoned.get(&w) {
            None => true,
            Some((until, _)) if *until <= now => {
                self.unpoison(inner, w);
                tracing::warn!(
                    window = w,
                    "poisoned landing window back in rotation at its last-resort deadline"
                );
                true
            }
            Some(_) => false,
        }
    }

    /// Window `w`'s poison has expired: back in rotation, off its deployment's count.
    pub(super) fn unpoison(&self, inner: &mut Inner, w: u32) {
        let Some((_, deployment)) = inner.poisoned.remove(&w) else {
            return;
        };
        if let Some(n) = inner.poisoned_by_deployment.get_mut(&deployment) {
            *n -= 1;
            if *n == 0 {
                inner.poisoned_by_deployment.remove(&deployment);
            }
        }
        self.epochs.poison_expired.fetch_add(1, Ordering::Relaxed);
        self.labels
            .gauge(m::POISONED_WINDOWS)
            .set(inner.poisoned.len() as f64);
    }

    /// Unpoison every window whose poison has expired, if one is due (windows are otherwise
    /// unpoisoned when the rotation reaches them, which a capped engine's pulls never do).
    pub(super) fn expire(&self, inner: &mut Inner, now: Instant) {
        if inner.next_expiry.is_none_or(|t| t > now) {
            return;
        }
        let due: Vec<u32> = inner
            .poisoned
            .iter()
            .filter(|(_, (until, _))| *until <= now)
            .map(|(w, _)| *w)
            .collect();
        if !due.is_empty() {
            tracing::warn!(
                windows = due.len(),
                "poisoned landing windows back in rotation at their last-resort deadline"
            );
        }
        for w in due {
            self.unpoison(inner, w);
        }
        inner.next_expiry = inner.poisoned.values().map(|(until, _)| *until).min();
    }

    /// Most windows one P deployment (bootstrap server) may hold poisoned before its pulls get
    /// no window, once half of all windows are poisoned: an eighth of the usable ones (2,047 of
    /// the default 16,384), all of them in tables too small to share (under 64 usable: tests,
    /// `repro`). Pulls already open when it is reached may still add theirs.
    pub fn deployment_poison_cap(&self) -> usize {
        let usable = self.reserved() as usize;
        if usable >= 64 {
            usable / 8
        } else {
            usable
        }
    }

    /// Close `r.req` in every pull that carries it and poison the windows of the pulls of
    /// `r.suspects`. No write is admitted into the request's blocks after this returns; reads
    /// admitted before it may still be finishing: wait for [`Revoked::quiesced`].
    pub fn revoke(&self, r: &RevokeRequest<'_>) -> Revoked {
        if !self.enabled {
            return Revoked::not_exact();
        }
        let mut inner = self.lock();
        let pairs = inner.by_req.remove(&r.req.req_id);
        if !inner.windowless.is_empty() {
            inner.windowless.remove(&r.req.req_id);
        }
        // The permits are looked at in place under the lock (no `Arc` clone each); only one
        // with a socket read still copying is kept, to wait for.
        let Inner {
            by_pull,
            poisoned: poisoned_windows,
            poisoned_by_deployment,
            next_expiry,
            ..
        } = &mut *inner;
        let mut poisoned = 0;
        let mut busy: Vec<Arc<Permit>> = Vec::new();
        let mut closed: SmallVec<[PullId; 2]> = SmallVec::new();
        for (pull, i) in pairs {
            let Some(p) = by_pull.get(&pull) else {
                // Cannot happen (see `by_req`); were it to, that pull's permit is gone with its
                // window, and nothing of it can admit a write.
                tracing::error!(pull_id = pull, "request indexed in a pull with no permit");
                continue;
            };
            if p.open[i].swap(false, Ordering::SeqCst)
                && p.open_count.fetch_sub(1, Ordering::AcqRel) == 1
            {
                let live = self.live.fetch_sub(1, Ordering::Relaxed) - 1;
                self.labels.gauge(m::LIVE_PERMITS).set(live as f64);
                closed.push(pull);
            }
            // Coverage only backs an ok before the revocation: a closed permit keeps none of it
            // (a write still copying may hold the permit a while). Nothing to drop, and no lock
            // to take, while nothing has landed through the permit.
            if p.covered.load(Ordering::Acquire) {
                let mut cov = p.coverage.lock().unwrap_or_else(|e| e.into_inner());
                if p.is_closed() {
                    *cov = Vec::new();
                } else if let Some(spans) = cov.get_mut(i) {
                    *spans = Vec::new();
                }
            }
            if self.poison && r.suspects.contains(&p.peer) {
                match poisoned_windows.get_mut(&p.window) {
                    Some((until, _)) => *until = (*until).max(r.poison_until),
                    None => {
                        poisoned_windows.insert(p.window, (r.poison_until, p.deployment.clone()));
                        *poisoned_by_deployment
                            .entry(p.deployment.clone())
                            .or_default() += 1;
                    }
                }
                *next_expiry = Some(next_expiry.map_or(r.poison_until, |t| t.min(r.poison_until)));
                poisoned += 1;
                tracing::info!(window = p.window, pull_id = p.pull_id, peer = %p.peer,
                    req_id = %r.req.req_id, "landing window poisoned: its writer may still write");
            }
            // Reads admitted before the swap finish their current socket read (bounded: one
            // non-blocking read syscall, or one device copy); every later one sees the closed
            // permit.
            p.draining.store(true, Ordering::SeqCst);
            if p.inflight.load(Ordering::SeqCst) != 0 {
                busy.push(p.clone());
            }
        }
        // No request indexes a closed pull any more: it leaves the table, and its window
        // refuses what comes late without it (a write still copying holds its own reference).
        for pull in closed {
            if let Some(p) = by_pull.remove(&pull) {
                let mut slot = self.slots[p.window as usize]
                    .write()
                    .unwrap_or_else(|e| e.into_inner());
                if matches!(&*slot, Slot::Open(q) if Arc::ptr_eq(q, &p)) {
                    *slot = Slot::Closed;
                }
            }
        }
        if poisoned > 0 {
            self.epochs
                .poisoned
                .fetch_add(poisoned as u64, Ordering::Relaxed);
            self.labels
                .counter(m::WINDOWS_POISONED)
                .increment(poisoned as u64);
            self.labels
                .gauge(m::POISONED_WINDOWS)
                .set(inner.poisoned.len() as f64);
        }
        drop(inner);
        Revoked {
            revocation: Revocation::Exact,
            poisoned,
            quiesced: (!busy.is_empty())
                .then(|| Box::pin(quiesce(busy)) as futures::future::BoxFuture<'static, ()>),
        }
    }
}
