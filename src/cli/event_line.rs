//! `kvrecv serve`'s event lines: each [`KvEvent`] as one JSON object.
//!
//! The line of a clean completion (ok, no peer left uncertain or unsettled), one per request
//! and the bulk of what serve prints, is written directly; every other event goes through
//! serde. Both give the same bytes (the tests compare them): serde's `flatten` of the outcome
//! made a completion line a map of unknown length, a third of the cost of printing it.

#![forbid(unsafe_code)]

use crate::messages::{KvEvent, Outcome};
use serde_json::json;

/// Append `ev`'s line and a newline to `chunk` (an `error` line if it cannot be serialized).
pub fn event_line(chunk: &mut Vec<u8>, ev: &KvEvent) {
    let start = chunk.len();
    let written = match ev {
        KvEvent::Completion {
            req_id,
            outcome: Outcome::Ok,
            uncertain_peers,
            unsettled_peers,
        } if uncertain_peers.is_empty() && unsettled_peers.is_empty() => {
            chunk.extend_from_slice(br#"{"event":"completion","req_id":"#);
            serde_json::to_writer(&mut *chunk, &**req_id).map(|()| {
                chunk.extend_from_slice(
                    br#","outcome":"ok","uncertain_peers":[],"unsettled_peers":[]}"#,
                )
            })
        }
        _ => serde_json::to_writer(&mut *chunk, ev),
    };
    if let Err(e) = written {
        chunk.truncate(start);
        let err = json!({"event": "error", "error": format!("event not serializable: {e}")});
        chunk.extend_from_slice(err.to_string().as_bytes());
    }
    chunk.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{PeerId, ReqId};

    fn completion(req_id: &str, outcome: Outcome, uncertain: Vec<PeerId>) -> KvEvent {
        KvEvent::Completion {
            req_id: ReqId::from(req_id),
            outcome,
            uncertain_peers: uncertain,
            unsettled_peers: vec![],
        }
    }

    #[test]
    fn every_line_is_what_serde_writes() {
        let peer = PeerId::new("tcp://127.0.0.1:5555");
        let ids = [
            "d-1",
            "",
            "quote\"back\\slash",
            "tab\tnl\nctl\u{1}",
            "ünï©ødé 🦀",
        ];
        let mut events: Vec<KvEvent> = ids
            .iter()
            .map(|id| completion(id, Outcome::Ok, vec![]))
            .collect();
        events.push(completion("d-2", Outcome::Ok, vec![peer.clone()]));
        events.push(completion(
            "d-3",
            Outcome::Failed {
                peer: Some(peer),
                cause: crate::messages::Cause::PeerError,
                reason: "peer said \"no\"".into(),
            },
            vec![],
        ));
        for ev in &events {
            let mut chunk = b"earlier\n".to_vec();
            event_line(&mut chunk, ev);
            let want = format!("earlier\n{}\n", serde_json::to_string(ev).unwrap());
            assert_eq!(String::from_utf8(chunk).unwrap(), want, "{ev:?}");
        }
    }
}
