//! Admitting a write or read into a window, and checking a peer's ok against what landed.

#![forbid(unsafe_code)]

use super::*;

impl PermitTable {
    /// Admission check for `[addr, addr + size)` already resolved to `r`, for `access`. A v1
    /// write (no acknowledgement) makes its pull's oks checked against the byte count; so does
    /// a write that ends without [`Admitted::landed`].
    pub fn admit(&self, r: &Resolved, size: u64, access: Access) -> Result<Admitted, RejectReason> {
        if self.paused.load(Ordering::SeqCst) {
            return Err(RejectReason::Paused);
        }
        if !self.enabled {
            return Ok(Admitted {
                permit: None,
                reqs: vec![],
                pieces: SmallVec::new(),
                open_write: AtomicBool::new(false),
            });
        }
        let permit = match self
            .slots
            .get(r.window as usize)
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()).clone())
        {
            Some(Slot::Open(p)) => p,
            // A late write: its pull's every request was revoked.
            Some(Slot::Closed) => return Err(RejectReason::Revoked),
            Some(Slot::Unused) | None => return Err(RejectReason::NoPermit),
        };
        if access
            == (Access::Write {
                acknowledged: false,
            })
        {
            permit.unproven.store(true, Ordering::Release);
        }
        let group = self.map.group(r.region) as usize;
        let (first, last) = self.map.blocks(r.region, r.offset, size);
        let owners = permit.blocks.groups.get(group).ok_or(RejectReason::NoPermit)?;
        let bl = self.map.block_len(r.region);
        // Only the first `kv_block_len` bytes of a block are KV data: bytes written into the
        // padding after them back nothing.
        let kv = self.map.kv_block_len(r.region).min(bl);
        let mut reqs: Vec<usize> = Vec::with_capacity(1);
        let mut pieces: SmallVec<[Piece; 1]> = SmallVec::new();
        for b in first..=last {
            let i = owners.get(b).ok_or(RejectReason::NoPermit)?;
            let lo = u64::from(b) * bl;
            if !reqs.contains(&i) {
                reqs.push(i);
            }
            let (start, end) = (r.offset.max(lo), (r.offset + size).min(lo + kv));
            if start < end {
                pieces.push(Piece {
                    req: i as u32,
                    span: (r.region as u32, start, end),
                });
            }
        }
        if reqs.iter().any(|&i| !permit.open[i].load(Ordering::SeqCst)) {
            return Err(RejectReason::Revoked);
        }
        let write = matches!(access, Access::Write { .. });
        if write {
            permit.open_writes.fetch_add(1, Ordering::AcqRel);
        }
        Ok(Admitted {
            permit: Some(permit),
            reqs,
            pieces,
            open_write: AtomicBool::new(write),
        })
    }

    /// Whether a pull of `req` got the reserved window (its writes are all refused).
    pub fn windowless(&self, req: &ReqId) -> bool {
        self.lock().is_windowless(req)
    }

    /// Whether every peer's ok for `req` is backed by what landed (PROTOCOL.md §5.3): a pull
    /// that got no window landed nothing, and where an ok is unproven (a v1 write was seen, or
    /// a write ended before its last byte, or one is still open) the bytes landed in the
    /// request's blocks must add up to what its blocks receive. Otherwise v2 acknowledgements
    /// already prove placement, so the request passes. Call before the request is revoked.
    pub fn verify_ok(&self, req: &RequestMeta) -> Result<(), String> {
        if !self.enabled || !req.is_awaiting() {
            return Ok(());
        }
        let inner = self.lock();
        if inner.is_windowless(&req.req_id) {
            return Err(
                "a pull of this request got no landing window: its writes were refused".into(),
            );
        }
        let pairs = inner.by_req.get(&req.req_id);
        // `open_writes` first: a write that ends unlanded sets `unproven` before it leaves
        // `open_writes`, so reading them the other way round could miss both. Looked at in
        // place (no permit is cloned) for the common case: every ok already proven.
        if !pairs.iter().any(|(pull, _)| {
            inner.by_pull.get(pull).is_some_and(|p| {
                p.open_writes.load(Ordering::Acquire) > 0 || p.unproven.load(Ordering::Acquire)
            })
        }) {
            return Ok(());
        }
        let entries = inner.permits_of(pairs);
        // Offsets within a region are the same in every window: the union over every pull of
        // the request is what physically landed in its blocks.
        let mut ranges: Vec<Span> = Vec::new();
        for (p, i) in &entries {
            let cov = p.coverage.lock().unwrap_or_else(|e| e.into_inner());
            ranges.extend(cov.get(*i).into_iter().flatten());
        }
        drop(inner);
        let landed = union_len(ranges);
        let expected: u64 = req
            .block_ids()
            .iter()
            .enumerate()
            .map(|(g, ids)| ids.len() as u64 * self.map.kv_bytes_per_block(g as u32))
            .sum();
        if landed < expected {
            return Err(format!(
                "peers reported ok but {landed} of {expected} bytes landed (a v1 \
                 unacknowledged write, or a write cut short or still open)"
            ));
        }
        Ok(())
    }

    /// Byte accounting of `pull` while its permit is open.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // for the crate's tests
    pub fn pull_bytes(&self, pull: PullId) -> Option<PullBytes> {
        let inner = self.lock();
        let p = inner.by_pull.get(&pull)?;
        Some(PullBytes {
            window: p.window,
            bytes_landed: p.bytes_landed.load(Ordering::Relaxed),
            writes_landed: p.writes_landed.load(Ordering::Relaxed),
            open: !p.is_closed(),
        })
    }
}
