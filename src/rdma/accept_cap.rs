//! Connection caps of the data plane's listeners (data server, handshake daemon): a connection
//! over the cap is closed at accept, never queued.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::telemetry::{self as m, Labels};

/// Refuse a connection over a listener's cap: close it at once, count it, and warn (on the
/// 1st, 2nd, 4th, 8th... refusal, so a connection flood does not also flood the log).
pub(crate) fn refuse_over_cap(
    labels: &Labels,
    listener: &'static str,
    cap: usize,
    refused: &AtomicU64,
) {
    let n = refused.fetch_add(1, Ordering::Relaxed) + 1;
    labels
        .counter_by(m::CONNECTIONS_REFUSED, "listener", listener)
        .increment(1);
    if n.is_power_of_two() {
        tracing::warn!(
            listener,
            cap,
            refused_total = n,
            "connection refused: too many open connections"
        );
    }
}
