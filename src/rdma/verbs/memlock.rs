//! `RLIMIT_MEMLOCK` before registering: every `ibv_reg_mr` pins its pages and the kernel charges
//! them to the process's pinned memory (`VmPin`), once per registration, so the whole KV layout
//! registered on N NICs needs N times its size under the limit (unless the process has
//! `CAP_IPC_LOCK`). Distributions default to 64 KiB–8 MiB; past the limit `ibv_reg_mr` fails
//! with a bare ENOMEM. Checked up front instead: the soft limit is raised to the hard limit when
//! that is enough, otherwise the start fails saying what to raise and by how much.

#![forbid(unsafe_code)]

/// `RLIM_INFINITY`.
pub const UNLIMITED: u64 = u64::MAX;

/// What to do about the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemlockPlan {
    /// The soft limit already allows it (or the process is exempt).
    Enough,
    /// Raise the soft limit to `to` (the hard limit), which allows it.
    RaiseSoft { to: u64 },
    /// Even the hard limit does not allow it.
    TooLow,
}

/// Decide from the soft and hard limits, what is already pinned, the bytes about to be pinned,
/// and whether the process has `CAP_IPC_LOCK` (which the kernel exempts from the limit).
pub fn plan(
    soft: u64,
    hard: u64,
    already_pinned: u64,
    need: u64,
    cap_ipc_lock: bool,
) -> MemlockPlan {
    let total = already_pinned.saturating_add(need);
    let allows = |limit: u64| limit == UNLIMITED || total <= limit;
    if cap_ipc_lock || allows(soft) {
        MemlockPlan::Enough
    } else if allows(hard) {
        MemlockPlan::RaiseSoft { to: hard }
    } else {
        MemlockPlan::TooLow
    }
}

/// Bytes `ibv_reg_mr` pins for regions of `lengths` on `nics` devices: each region rounded up
/// to whole pages (assumed page-aligned, as kvrecv's and the host's KV buffers are), per NIC.
pub fn pinned_bytes(lengths: impl IntoIterator<Item = u64>, nics: usize, page: u64) -> u64 {
    let page = page.max(1);
    let per_nic = lengths.into_iter().fold(0u64, |acc, len| {
        acc.saturating_add(len.div_ceil(page).saturating_mul(page))
    });
    per_nic.saturating_mul(nics as u64)
}

/// `"unlimited"` or the number of bytes (for messages).
pub fn show(limit: u64) -> String {
    if limit == UNLIMITED {
        "unlimited".into()
    } else {
        format!("{limit} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn enough_raise_or_too_low() {
        assert_eq!(
            plan(64 * MIB, 64 * MIB, 0, 64 * MIB, false),
            MemlockPlan::Enough
        );
        assert_eq!(
            plan(8 * MIB, UNLIMITED, 0, 64 * MIB, false),
            MemlockPlan::RaiseSoft { to: UNLIMITED }
        );
        assert_eq!(
            plan(8 * MIB, 128 * MIB, 0, 64 * MIB, false),
            MemlockPlan::RaiseSoft { to: 128 * MIB }
        );
        assert_eq!(
            plan(8 * MIB, 8 * MIB, 0, 64 * MIB, false),
            MemlockPlan::TooLow
        );
        assert_eq!(
            plan(UNLIMITED, UNLIMITED, 0, u64::MAX, false),
            MemlockPlan::Enough
        );
    }

    #[test]
    fn what_is_already_pinned_counts_and_cap_ipc_lock_exempts() {
        // 60 MiB pinned already (e.g. CUDA host buffers): 8 more do not fit under 64.
        assert_eq!(
            plan(64 * MIB, 64 * MIB, 60 * MIB, 8 * MIB, false),
            MemlockPlan::TooLow
        );
        assert_eq!(
            plan(64 * MIB, 64 * MIB, 60 * MIB, 8 * MIB, true),
            MemlockPlan::Enough
        );
    }

    #[test]
    fn each_nic_pins_whole_pages_of_every_region() {
        assert_eq!(
            pinned_bytes([4096, 1, 8192], 2, 4096),
            2 * (4096 + 4096 + 8192)
        );
        assert_eq!(pinned_bytes([], 8, 4096), 0);
        assert_eq!(pinned_bytes([u64::MAX], 2, 4096), u64::MAX);
    }
}
