//! Opening a pull's permit: choosing its window (the peer's ring first, then the cursor, never a
//! poisoned or open one, within the deployment's share of poison) and installing the permit.

#![forbid(unsafe_code)]

use super::*;

impl PermitTable {
    /// Open a window for `pull`; returns the window index.
    pub fn open(&self, pull: &PullWindow<'_>) -> u32 {
        self.open_at(pull, Instant::now())
    }

    /// [`PermitTable::open`] at time `now` (poison deadlines are compared with it): for
    /// deterministic drivers such as the model checker. A pull refused a window gets the
    /// reserved one, which admits nothing; the Receiver uses [`PermitTable::open_all_at`]
    /// instead, which refuses, so that no such pull is ever sent.
    pub fn open_at(&self, pull: &PullWindow<'_>, now: Instant) -> u32 {
        match self.open_all_at(std::slice::from_ref(pull), now) {
            Ok(w) => w[0],
            Err(_) => Self::refuse(&mut self.lock(), pull, self.reserved()),
        }
    }

    /// Open a window for each of one batch's pulls, all or none, under one lock: `Err` (and
    /// nothing opened) when any pull would get no clean window. A pull with no request to
    /// admit gets the reserved window (nothing is expected through it).
    pub fn open_all_at(
        &self,
        pulls: &[PullWindow<'_>],
        now: Instant,
    ) -> Result<Vec<u32>, NoWindow> {
        if !self.enabled {
            return Ok(vec![0; pulls.len()]);
        }
        let reserved = self.reserved();
        let mut inner = self.lock();
        let mut chosen: SmallVec<[Option<u32>; 4]> = SmallVec::with_capacity(pulls.len());
        for (i, pull) in pulls.iter().enumerate() {
            if pull.requests.is_empty() || reserved == 0 {
                chosen.push(None);
                continue;
            }
            let repeated = pulls[..i].iter().any(|p| p.pull_id == pull.pull_id);
            match self.select(&mut inner, pull, repeated, &chosen, now) {
                Ok(w) => chosen.push(Some(w)),
                Err(why) => {
                    return Err(NoWindow {
                        needed: pulls.iter().filter(|p| !p.requests.is_empty()).count(),
                        in_use: self.live.load(Ordering::Relaxed) as usize,
                        poisoned: inner.poisoned.len(),
                        usable: reserved as usize,
                        why,
                    })
                }
            }
        }
        // The batch's pulls carry the same requests: one set of blocks for their permits.
        let mut last = None;
        Ok(pulls
            .iter()
            .zip(chosen)
            .map(|(pull, w)| match w {
                Some(w) => self.install(&mut inner, pull, w, &mut last),
                None => reserved,
            })
            .collect())
    }

    /// The clean window `pull` would get, none of `taken`; moves the cursor past it. Refusals
    /// are counted and logged (rate-limited) here.
    pub(super) fn select(
        &self,
        inner: &mut Inner,
        pull: &PullWindow<'_>,
        repeated: bool,
        taken: &[Option<u32>],
        now: Instant,
    ) -> Result<u32, NoWindowReason> {
        let reserved = self.reserved();
        // A request's permits are found through their pull ids (`by_req`), so an id must name
        // one open permit at a time. Pull ids are process-unique (`messages::next_pull_ids`); a
        // caller of this table that repeats one while its permit is open gets no window, as
        // does a pull of more than u32::MAX requests (the index is a u32; the live-request cap
        // is far lower).
        let duplicate = repeated
            || inner
                .by_pull
                .get(&pull.pull_id)
                .is_some_and(|p| !p.is_closed());
        if duplicate || u32::try_from(pull.requests.len()).is_err() {
            tracing::error!(pull_id = pull.pull_id, duplicate, requests = pull.requests.len(),
                "pull refused a landing window: its id already has an open permit, or it is too large");
            return Err(NoWindowReason::InvalidPull);
        }
        // One P deployment whose writers keep ending up suspects (one that times out or
        // garbles every pull, whatever its DP ranks) may hold at most its share of the windows
        // poisoned once half of them are; past it its pulls get none, and every other
        // deployment keeps its windows.
        let deployment = &pull.requests[0].bootstrap_addr;
        let cap = self.deployment_poison_cap();
        let over = |inner: &Inner| {
            inner.poisoned.len() >= reserved as usize / 2
                && inner
                    .poisoned_by_deployment
                    .get(deployment)
                    .copied()
                    .unwrap_or(0)
                    >= cap
        };
        if over(inner) {
            self.expire(inner, now);
        }
        if over(inner) {
            self.labels.counter(m::WINDOWS_REFUSED_SHARE).increment(1);
            if let Some(unlogged) = inner.log_refusal(now) {
                tracing::error!(pull_id = pull.pull_id, peer = %pull.peer,
                    engine = %pull.requests[0].engine_id, bootstrap = %deployment, share = cap,
                    refused_unlogged = unlogged,
                    "P deployment holds its share of poisoned landing windows; this pull gets no window (further refusals logged at most every 10 s)");
            }
            return Err(NoWindowReason::DeploymentShare);
        }
        let free = |w: u32| {
            !taken.contains(&Some(w))
                && self.slots[w as usize]
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .permit()
                    .is_none_or(|p| p.is_closed())
        };
        // The peer's own windows first, oldest first: closed (the previous permit gone) and
        // clean, the cursor's test, except that a poisoned one leaves the ring even once its
        // poison expired. Cost: at most PEER_RING slot reads and one hash lookup per pull.
        let held = &mut *inner;
        let from_ring = match held.rings.get_mut(pull.peer) {
            Some(ring) => {
                let poisoned = &held.poisoned;
                ring.retain(|w| !poisoned.contains_key(w));
                ring.iter().copied().find(|&w| free(w))
            }
            None => None,
        };
        if let Some(w) = from_ring {
            return Ok(w);
        }
        let cursor = inner.cursor;
        let Some(window) = (0..reserved)
            .map(|i| (cursor + i) % reserved)
            .find(|&w| free(w) && self.clean(inner, w, now))
        else {
            self.epochs.exhausted.fetch_add(1, Ordering::Relaxed);
            self.labels.counter(m::WINDOWS_EXHAUSTED).increment(1);
            if let Some(unlogged) = inner.log_refusal(now) {
                tracing::error!(pull_id = pull.pull_id, peer = %pull.peer,
                    poisoned = inner.poisoned.len(), refused_unlogged = unlogged,
                    "no clean landing window is free; this pull gets none (further refusals logged at most every 10 s)");
            }
            return Err(NoWindowReason::Exhausted);
        };
        inner.cursor = (window + 1) % reserved;
        Ok(window)
    }

    /// Open `pull`'s permit in `window` (chosen by [`PermitTable::select`]). `last`: the
    /// blocks of the batch's previous pull, shared when this pull carries the same requests.
    pub(super) fn install<'p>(
        &self,
        inner: &mut Inner,
        pull: &PullWindow<'p>,
        window: u32,
        last: &mut Option<(&'p [SharedRequest], Arc<PullBlocks>)>,
    ) -> u32 {
        let deployment: Deployment = pull.requests[0].bootstrap_addr.clone();
        Self::ring_used(inner, pull.peer, window);
        let blocks = match last {
            Some((reqs, b)) if std::ptr::eq(*reqs, pull.requests) => b.clone(),
            _ => {
                let b = Arc::new(self.pull_blocks(pull.requests));
                *last = Some((pull.requests, b.clone()));
                b
            }
        };
        let n = pull.requests.len();
        let permit = Arc::new(Permit {
            pull_id: pull.pull_id,
            peer: pull.peer.clone(),
            deployment: deployment.clone(),
            window,
            blocks,
            open: (0..n).map(|_| AtomicBool::new(true)).collect(),
            open_count: AtomicUsize::new(n),
            inflight: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            quiet: Notify::new(),
            coverage: Mutex::new(Vec::new()),
            covered: AtomicBool::new(false),
            unproven: AtomicBool::new(false),
            open_writes: AtomicU64::new(0),
            bytes_landed: AtomicU64::new(0),
            writes_landed: AtomicU64::new(0),
        });
        // The window's previous permit closed and went then (`revoke`).
        *self.slots[window as usize]
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Slot::Open(permit.clone());
        for (i, r) in (0u32..).zip(pull.requests) {
            inner.by_req.add(r, pull.pull_id, i);
        }
        inner.by_pull.insert(pull.pull_id, permit);
        let live = self.live.fetch_add(1, Ordering::Relaxed) + 1;
        self.labels.gauge(m::LIVE_PERMITS).set(live as f64);
        window
    }

    /// `requests`' blocks by group, each with the index of its request, and their span caps.
    fn pull_blocks(&self, requests: &[SharedRequest]) -> PullBlocks {
        let groups = requests
            .iter()
            .map(|r| r.block_ids().len())
            .max()
            .unwrap_or(0);
        // Each group's list allocated once at its length (grown push by push, then shrunk, it
        // was four allocations per group and pull).
        let mut blocks: Vec<BlockOwners> = (0..groups)
            .map(|g| {
                let n = requests
                    .iter()
                    .filter_map(|r| r.block_ids().get(g))
                    .map(<[u32]>::len);
                BlockOwners(Vec::with_capacity(n.sum()))
            })
            .collect();
        for (i, r) in requests.iter().enumerate() {
            for (g, ids) in r.block_ids().iter().enumerate() {
                blocks[g].0.extend(ids.iter().map(|&b| (b, i as u32)));
            }
        }
        for g in &mut blocks {
            // The ledger admits a block to one live request at a time; were it listed twice,
            // the first owner keeps it.
            g.0.sort_by_key(|&(b, _)| b);
            let n = g.0.len();
            g.0.dedup_by_key(|&mut (b, _)| b);
            if g.0.len() < n {
                g.0.shrink_to_fit();
            }
        }
        let span_cap = requests
            .iter()
            .map(|r| {
                let pieces: u64 = (0u32..)
                    .zip(r.block_ids().iter())
                    .map(|(g, ids)| ids.len() as u64 * self.map.regions_in_group(g))
                    .sum();
                u32::try_from(pieces.saturating_mul(2).saturating_add(16)).unwrap_or(u32::MAX)
            })
            .collect();
        PullBlocks {
            groups: blocks,
            span_cap,
        }
    }

    /// `peer`'s pull got `window`: the newest of its ring.
    pub(super) fn ring_used(inner: &mut Inner, peer: &PeerId, window: u32) {
        if !inner.rings.contains_key(peer) && inner.rings.len() >= MAX_RINGS {
            inner.rings.clear();
        }
        let ring = inner.rings.entry(peer.clone()).or_default();
        ring.retain(|&mut w| w != window);
        if ring.len() == PEER_RING {
            ring.remove(0);
        }
        ring.push(window);
    }

    /// The windows in `peer`'s ring, oldest first (tests).
    #[cfg(test)]
    pub fn ring_of(&self, peer: &PeerId) -> Vec<u32> {
        self.lock()
            .rings
            .get(peer)
            .map(|r| r.to_vec())
            .unwrap_or_default()
    }

    /// Give `pull` the reserved window (it admits nothing): its requests' writes are refused
    /// and they fail with the reason [`NO_WINDOW`](super::NO_WINDOW).
    pub(super) fn refuse(inner: &mut Inner, pull: &PullWindow<'_>, reserved: u32) -> u32 {
        for r in pull.requests {
            inner.windowless.insert(r.req_id.clone());
        }
        reserved
    }
}
