//! Which Mooncake segments a fence must stop for a peer, when nobody told D.
//!
//! The control plane knows a peer by its ZMQ side-channel address (`tcp://host:port`, from the
//! bootstrap's `/query`); the endpoint handshake knows P's TE by its segment name (`host:port`,
//! the server part of P's NIC path). Nothing in vLLM's protocol links the two, but both carry the
//! host P's worker runs on (vLLM builds both from `get_ip()`). So, by default, a peer is bound to
//! every segment on its host ([`PeerBinding::ByHost`]). That fences co-located P workers too, which
//! only fails their in-flight writes (they are retried as failed requests); it never leaves a
//! writer running.
//!
//! A segment whose host is no known peer's host (P's TE on another interface than its side
//! channel, a hostname against an IP) cannot be attributed to anyone, so every fence also stops
//! those *orphans*: D cannot tell whether they are the failed peer's. When no connected segment
//! can be the peer's, the fence fails: the peer may still connect and write (it has D's
//! addresses), so its blocks wait for the last-resort deadline rather than be released.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::net::IpAddr;

/// How peers are bound to the segments their TE writes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PeerBinding {
    /// Only what `bind_peer` recorded: an unbound peer cannot be fenced, so its blocks wait for
    /// the last-resort deadline.
    Explicit,
    /// `bind_peer`'s bindings, every segment on the peer's host, and the segments no known peer
    /// can claim (orphans).
    #[default]
    ByHost,
}

/// The host of a ZMQ endpoint (`tcp://10.0.0.5:41233`, `tcp://[::1]:5555`), canonical.
pub fn peer_host(peer: &str) -> Option<String> {
    let rest = peer.split_once("://").map_or(peer, |(_, r)| r);
    split_host(rest)
}

/// The host of a segment name (`10.0.0.5:16001`, `[fe80::1]:16001`), canonical.
pub fn segment_host(segment: &str) -> Option<String> {
    split_host(segment)
}

/// `host:port` → host; IP literals in their canonical text form so that `::1` and
/// `0:0:0:0:0:0:0:1` (or a bracketed form) compare equal.
fn split_host(s: &str) -> Option<String> {
    let host = match s.rsplit_once(':') {
        Some((h, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => s,
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() {
        return None;
    }
    Some(match host.parse::<IpAddr>() {
        Ok(ip) => ip.to_string(),
        Err(_) => host.to_ascii_lowercase(),
    })
}

/// The segments to fence for `peer` (its canonical host `host`): `explicit` (what `bind_peer`
/// recorded for it), plus, with [`PeerBinding::ByHost`], every connected segment in `segments`
/// on that host and every segment on no host in `known_hosts` and bound to no one (`claimed`).
/// Empty means no connected segment can be the peer's: the caller must not call that fenced.
pub fn segments_to_fence<'a>(
    mode: PeerBinding,
    host: Option<&str>,
    explicit: &BTreeSet<String>,
    segments: impl IntoIterator<Item = &'a str>,
    known_hosts: &BTreeSet<String>,
    claimed: &BTreeSet<String>,
) -> BTreeSet<String> {
    let mut out = explicit.clone();
    if mode == PeerBinding::Explicit {
        return out;
    }
    for s in segments {
        let h = segment_host(s);
        let same_host = h.is_some() && h.as_deref() == host;
        let orphan = !claimed.contains(s) && h.as_ref().is_none_or(|h| !known_hosts.contains(h));
        if same_host || orphan {
            out.insert(s.to_owned());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn hosts_are_read_from_both_address_forms_and_compared_canonically() {
        assert_eq!(
            peer_host("tcp://10.0.0.5:41233").as_deref(),
            Some("10.0.0.5")
        );
        assert_eq!(peer_host("tcp://[::1]:5555").as_deref(), Some("::1"));
        assert_eq!(
            peer_host("tcp://[0:0:0:0:0:0:0:1]:5555"),
            segment_host("[::1]:16001")
        );
        assert_eq!(segment_host("10.0.0.5:16001").as_deref(), Some("10.0.0.5"));
        assert_eq!(peer_host("tcp://P-Node:1").as_deref(), Some("p-node"));
        assert_eq!(peer_host("tcp://e0-0-0").as_deref(), Some("e0-0-0"));
        assert_eq!(peer_host("tcp://:5"), None);
        assert_eq!(segment_host(""), None);
    }

    #[test]
    fn by_host_fences_every_segment_on_the_peers_host_and_no_other() {
        let segs = ["10.0.0.5:16001", "10.0.0.5:16002", "10.0.0.6:16001"];
        let got = segments_to_fence(
            PeerBinding::ByHost,
            Some("10.0.0.5"),
            &set(&[]),
            segs,
            &set(&["10.0.0.5", "10.0.0.6"]),
            &set(&[]),
        );
        assert_eq!(got, set(&["10.0.0.5:16001", "10.0.0.5:16002"]));
    }

    #[test]
    fn orphans_are_fenced_even_when_the_peers_host_has_a_segment() {
        // 10.0.0.5's own TE answers on 192.168.0.5; another worker's TE is on 10.0.0.5.
        let segs = ["10.0.0.5:16002", "192.168.0.5:16001", "10.0.0.6:16001"];
        let got = segments_to_fence(
            PeerBinding::ByHost,
            Some("10.0.0.5"),
            &set(&["10.0.0.5:16009"]),
            segs,
            &set(&["10.0.0.5", "10.0.0.6"]),
            &set(&["10.0.0.5:16009"]),
        );
        assert_eq!(
            got,
            set(&["10.0.0.5:16002", "10.0.0.5:16009", "192.168.0.5:16001"]),
            "explicit, same host and orphans; never another known peer's"
        );
    }

    #[test]
    fn a_peer_on_no_segments_host_fences_the_orphans_only() {
        // The peer's TE answers on another interface: its segment's host is nobody's side
        // channel host. 10.0.0.6 is another known peer's; 10.0.0.8 was bound explicitly.
        let segs = ["192.168.0.5:16001", "10.0.0.6:16001", "10.0.0.8:16001"];
        let got = segments_to_fence(
            PeerBinding::ByHost,
            Some("10.0.0.5"),
            &set(&[]),
            segs,
            &set(&["10.0.0.5", "10.0.0.6"]),
            &set(&["10.0.0.8:16001"]),
        );
        assert_eq!(got, set(&["192.168.0.5:16001"]));
    }

    #[test]
    fn explicit_bindings_are_kept_and_are_all_explicit_mode_fences() {
        let segs = ["10.0.0.5:16001", "10.0.0.5:16002"];
        let explicit = set(&["10.0.0.5:16001"]);
        let known = set(&["10.0.0.5"]);
        let none = set(&[]);
        assert_eq!(
            segments_to_fence(
                PeerBinding::Explicit,
                Some("10.0.0.5"),
                &explicit,
                segs,
                &known,
                &none
            ),
            explicit
        );
        assert!(segments_to_fence(
            PeerBinding::Explicit,
            Some("10.0.0.5"),
            &none,
            segs,
            &known,
            &none
        )
        .is_empty());
        // ByHost adds the rest of the host.
        assert_eq!(
            segments_to_fence(
                PeerBinding::ByHost,
                Some("10.0.0.5"),
                &explicit,
                segs,
                &known,
                &none
            ),
            set(&segs)
        );
    }
}
