//! Tests of the Peer's sans-IO core.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use super::*;
use crate::messages::{MooncakeXferResponse, Pull, RequestMeta};

impl PeerState {
    fn start_pull(&mut self, p: Pull) {
        self.start(p.pull_id, p.requests);
    }
}

fn pull(id: PullId, reqs: &[&str]) -> Pull {
    Pull {
        pull_id: id,
        payload: vec![],
        handed_at: tokio::time::Instant::now(),
        layout: crate::messages::PullLayout::default(),
        with_layout: None,
        requests: reqs
            .iter()
            .map(|r| crate::messages::PullRequest {
                meta: Arc::new(RequestMeta::new(*r, &format!("t-{r}"), "e", "http://b:1", &[vec![1]])),
            })
            .collect(),
    }
}

fn reply(status: XferStatus, ok: Vec<String>, err: Vec<String>) -> Frames {
    let r = MooncakeXferResponse {
        status,
        ok_reqs: Some(ok),
        err_reqs: Some(err),
        err_msg: None,
        layout_id: 0,
    };
    vec![r.encode().unwrap()]
}

/// Every settle is an event; only those an aggregator awaits go to it, in order, whether
/// the reply names them or the FINISH settles the rest.
#[test]
fn only_awaited_settles_go_to_the_aggregator() {
    let mut st = PeerState::new(PeerId::new("tcp://p:1"));
    let mut p = pull(1, &["a", "cleanup", "b", "c"]);
    p.requests[1] = crate::messages::pull_requests::test_unawaited_request("cleanup");
    st.start_pull(p);
    let ok = vec!["cleanup".to_string(), "a".to_string(), "c".to_string()];
    let mut fx = st.on_reply(1, reply(XferStatus::Finish, ok, vec![]));
    let all: Vec<String> = fx.settles.iter().map(|s| s.req_id.to_string()).collect();
    assert_eq!(all, ["cleanup", "a", "c", "b"], "every settle, in order");
    let sent: Vec<(String, bool)> = fx
        .awaited()
        .iter()
        .map(|s| (s.req_id.to_string(), s.outcome.is_ok()))
        .collect();
    assert_eq!(
        sent,
        [("a".into(), true), ("c".into(), true), ("b".into(), false)],
        "the aggregator gets the awaited ones: b omitted by the FINISH"
    );
}

fn outcomes(fx: &Effects) -> Vec<(String, SettleOutcome)> {
    fx.settles
        .iter()
        .map(|s| (s.req_id.to_string(), s.outcome.clone()))
        .collect()
}

fn aborted() -> SettleOutcome {
    SettleOutcome::uncertain(Cause::Aborted, "aborted by the host")
}

/// P answered an aborted request ok: its writes are done, so it is Failed, not Uncertain.
fn aborted_answered() -> SettleOutcome {
    SettleOutcome::failed(Cause::Aborted, "aborted by the host")
}

/// P's words are bounded and escaped before they are repeated per request: a FINISH failing
/// every request with a 4 MB message holding a newline and an escape sequence, an ERROR
/// with one, and a megabyte-long id D never sent.
#[test]
fn a_peers_text_is_bounded_and_escaped_before_it_reaches_every_request() {
    use crate::messages::peer_text::MAX_PEER_TEXT;
    let printable = |r: &str| r.len() < MAX_PEER_TEXT + 64 && !r.chars().any(char::is_control);
    let ids: Vec<String> = (0..64).map(|i| format!("r{i}")).collect();
    let names: Vec<&str> = ids.iter().map(String::as_str).collect();
    let mut st = PeerState::new(PeerId::new("tcp://p:1"));
    st.start_pull(pull(1, &names));
    let huge = MooncakeXferResponse {
        status: XferStatus::Finish,
        ok_reqs: Some(vec!["x".repeat(1 << 20)]),
        err_reqs: Some(ids.clone()),
        err_msg: Some(format!("line1\nforged\x1b[31m{}", "E".repeat(4 << 20))),
        layout_id: 0,
    };
    let fx = st.on_reply(1, vec![huge.encode().unwrap()]);
    assert_eq!(fx.settles.len(), 64);
    for s in &fx.settles {
        let SettleOutcome::Failed { cause, reason } = &s.outcome else {
            panic!("{:?}", s.outcome);
        };
        assert_eq!(*cause, Cause::PeerError);
        assert!(printable(reason), "{} bytes: {reason:?}", reason.len());
        assert!(
            reason.starts_with("line1\\nforged\\u{1b}[31mEEE"),
            "{reason:?}"
        );
    }
    assert_eq!(fx.stale.count, 1);
    assert!(
        printable(&fx.stale.sample[0]),
        "the stale id is sampled bounded"
    );

    st.start_pull(pull(2, &["a"]));
    let error = MooncakeXferResponse {
        status: XferStatus::Error,
        ok_reqs: Some(vec![]),
        err_reqs: Some(vec![]),
        err_msg: Some(format!("\r{}", "boom".repeat(1 << 18))),
        layout_id: 0,
    };
    let fx = st.on_reply(2, vec![error.encode().unwrap()]);
    let reason = fx.settles[0].outcome.reason().unwrap();
    assert!(printable(reason), "{reason:?}");
    assert!(reason.starts_with("peer ERROR: \\rboom"), "{reason:?}");
}

/// An abort settles nothing by itself: P's answer does, as aborted, keeping what the
/// answer proves (ok: Failed; a transfer-engine failure keeps its cause).
#[test]
fn an_abort_waits_for_p_and_its_answer_settles_the_request_as_aborted() {
    let mut st = PeerState::new(PeerId::new("tcp://p:1"));
    st.start_pull(pull(1, &["a", "b"]));
    st.start_pull(pull(2, &["a"]));
    assert_eq!(
        st.abort("a", "aborted by the host"),
        vec![1, 2],
        "both pulls owed it"
    );
    assert!(
        st.only_aborted_pending(2),
        "pull 2 owes only the aborted request"
    );
    assert!(!st.only_aborted_pending(1), "pull 1 still owes b");
    assert_eq!(st.pending_count(), 3, "nothing settled: a twice, and b");
    assert_eq!(st.abort("a", "again"), vec![1, 2]);
    let fx = st.on_reply(
        1,
        reply(XferStatus::Continue, vec!["a".into(), "b".into()], vec![]),
    );
    assert_eq!(
        outcomes(&fx),
        vec![
            ("a".into(), aborted_answered()),
            ("b".into(), SettleOutcome::Ok)
        ]
    );
    assert!(fx.stale.is_empty(), "{:?}", fx.stale);
    let te = MooncakeXferResponse {
        status: XferStatus::Finish,
        ok_reqs: Some(vec![]),
        err_reqs: Some(vec!["a".into()]),
        err_msg: Some(format!("{TE_FAILURE} -1")),
        layout_id: 0,
    };
    let fx = st.on_reply(2, vec![te.encode().unwrap()]);
    assert_eq!(
        outcomes(&fx),
        vec![(
            "a".into(),
            SettleOutcome::failed(
                Cause::TransportEngine,
                format!("aborted by the host (P: {TE_FAILURE} -1)")
            )
        )]
    );
    // Settled once: a later ok for it is stale.
    let late = st.on_reply(1, reply(XferStatus::Continue, vec!["a".into()], vec![]));
    assert!(late.settles.is_empty());
    assert_eq!(late.stale.count, 1);
}

/// On a reused channel, P's answer to an earlier pull (sent again after its FINISH) can
/// arrive first: it names only requests this pull never carried, so it is stale and does
/// not end the pull; P's real FINISH then settles the pull's request.
#[test]
fn a_reply_naming_none_of_the_pulls_requests_does_not_end_it() {
    let mut st = PeerState::new(PeerId::new("tcp://p:1"));
    st.start_pull(pull(2, &["r1"]));
    let fx = st.on_reply(2, reply(XferStatus::Finish, vec![], vec!["r0".into()]));
    assert!(fx.stray && !fx.pull_done && !fx.finished_cleanly);
    assert!(fx.settles.is_empty());
    assert_eq!(fx.stale.count, 1);
    let fx = st.on_reply(2, reply(XferStatus::Finish, vec!["r1".into()], vec![]));
    assert_eq!(outcomes(&fx), vec![("r1".into(), SettleOutcome::Ok)]);
    assert!(fx.finished_cleanly && fx.pull_done && !fx.stray);
    // A reply naming one of the pull's requests is the pull's, whatever else it names;
    // one naming nothing at all is a FINISH that omitted everything.
    st.start_pull(pull(3, &["r2", "r3"]));
    let fx = st.on_reply(
        3,
        reply(XferStatus::Continue, vec!["r2".into(), "zz".into()], vec![]),
    );
    assert!(!fx.stray);
    assert_eq!(outcomes(&fx), vec![("r2".into(), SettleOutcome::Ok)]);
    // Settled already, still the pull's own: a repeat is stale but not stray.
    let fx = st.on_reply(3, reply(XferStatus::Continue, vec!["r2".into()], vec![]));
    assert!(!fx.stray && fx.stale.count == 1);
    let fx = st.on_reply(3, reply(XferStatus::Finish, vec![], vec![]));
    assert!(!fx.stray && fx.pull_done);
    assert_eq!(
        outcomes(&fx),
        vec![("r3".into(), SettleOutcome::failed(Cause::Omitted, OMITTED))]
    );
}

fn layout_reply(status: XferStatus, ok: &[&str], layout_id: u64) -> Frames {
    let mut r = MooncakeXferResponse::new(status);
    r.ok_reqs = Some(ok.iter().map(|s| s.to_string()).collect());
    r.layout_id = layout_id;
    r.err_msg = (status == XferStatus::LayoutMiss).then(|| "not cached".into());
    vec![r.encode().unwrap()]
}

/// vLLM 0.33: an echo of the pull's own id acks it; LAYOUT_MISS on a pull that omitted
/// its layout settles nothing and asks for one resend with it (the pull stays in flight);
/// a second miss, or a miss on a pull that carried it, fails the pull.
#[test]
fn layout_miss_resends_an_omitted_layout_once_and_fails_a_carried_one() {
    let mut st = PeerState::new(PeerId::new("tcp://p:1"));
    st.start_pull(pull(1, &["a", "b"]));
    st.set_layout(
        1,
        PullLayout {
            id: 7,
            carried: true,
        },
    );
    let fx = st.on_reply(1, layout_reply(XferStatus::Continue, &["a"], 9));
    assert_eq!(fx.layout_echoed, None, "not this pull's id");
    let fx = st.on_reply(1, layout_reply(XferStatus::Finish, &["b"], 7));
    assert_eq!(fx.layout_echoed, Some(7));

    st.start_pull(pull(2, &["c"]));
    st.set_layout(
        2,
        PullLayout {
            id: 7,
            carried: false,
        },
    );
    let fx = st.on_reply(2, layout_reply(XferStatus::LayoutMiss, &[], 0));
    assert!(fx.layout_miss && fx.resend_with_layout);
    assert!(
        fx.settles.is_empty() && !fx.pull_done,
        "nothing reaches the host"
    );
    assert_eq!(st.pending_requests(2).len(), 1, "the same request, resent");
    // The resend carried the layout: another miss breaks the protocol and fails it.
    let fx = st.on_reply(2, layout_reply(XferStatus::LayoutMiss, &[], 0));
    assert!(fx.layout_miss && !fx.resend_with_layout && fx.pull_done);
    let [(id, SettleOutcome::Uncertain { cause, reason })] = &outcomes(&fx)[..] else {
        panic!("{:?}", outcomes(&fx));
    };
    assert_eq!((id.as_str(), *cause), ("c", Cause::PeerWideError));
    assert!(
        reason.contains("LAYOUT_MISS") && reason.contains("not cached"),
        "{reason}"
    );
    // A pull without an id (layout ids off) is never resent.
    st.start_pull(pull(3, &["d"]));
    let fx = st.on_reply(3, layout_reply(XferStatus::LayoutMiss, &[], 0));
    assert!(!fx.resend_with_layout && fx.pull_done && fx.settles.len() == 1);
}

#[test]
fn an_aborted_request_p_answered_is_not_settled_again() {
    let mut st = PeerState::new(PeerId::new("tcp://p:1"));
    st.start_pull(pull(1, &["a", "b", "c"]));
    st.abort("a", "aborted by the host");
    let fx = st.on_reply(1, reply(XferStatus::Continue, vec!["a".into()], vec![]));
    assert_eq!(outcomes(&fx), vec![("a".into(), aborted_answered())]);
    let fx = st.on_reply(1, reply(XferStatus::Continue, vec!["b".into()], vec![]));
    assert_eq!(outcomes(&fx), vec![("b".into(), SettleOutcome::Ok)]);
    assert!(fx.stale.is_empty(), "{:?}", fx.stale);
    // Aborting the last one leaves it to P's answer, which settles it with nothing stale.
    assert_eq!(st.abort("c", "aborted by the host"), vec![1]);
    assert!(st.only_aborted_pending(1));
    let fx = st.on_reply(1, reply(XferStatus::Finish, vec!["c".into()], vec![]));
    assert_eq!(outcomes(&fx), vec![("c".into(), aborted_answered())]);
    assert!(fx.stale.is_empty() && fx.pull_done && fx.finished_cleanly);
}

#[test]
fn a_pull_left_with_only_aborted_requests_waits_for_p_or_its_deadline() {
    let mut st = PeerState::new(PeerId::new("tcp://p:1"));
    st.start_pull(pull(1, &["a", "b", "c"]));
    assert!(st.abort("a", "aborted by the host").len() == 1);
    let fx = st.on_reply(1, reply(XferStatus::Continue, vec!["b".into()], vec![]));
    assert_eq!(outcomes(&fx), vec![("b".into(), SettleOutcome::Ok)]);
    assert!(!st.only_aborted_pending(1));
    let fx = st.on_reply(1, reply(XferStatus::Continue, vec![], vec!["c".into()]));
    assert_eq!(
        outcomes(&fx),
        vec![(
            "c".into(),
            SettleOutcome::failed(Cause::PeerError, "peer reported failure")
        )]
    );
    assert!(st.only_aborted_pending(1), "only a is left");
    assert_eq!(st.pending_count(), 1, "a waits for P");
    // No answer before the deadline: D cannot know P stopped.
    let fx = st.abandon(1, Cause::Timeout, "deadline".into());
    assert_eq!(outcomes(&fx), vec![("a".into(), aborted())]);
    assert_eq!(st.pending_count(), 0);
}

#[test]
fn an_aborted_request_still_held_settles_as_aborted_when_the_pull_ends() {
    for end in ["deadline", "finish", "error"] {
        let mut st = PeerState::new(PeerId::new("tcp://p:1"));
        st.start_pull(pull(1, &["a", "b"]));
        st.abort("a", "aborted by the host");
        let fx = match end {
            "deadline" => st.abandon(1, Cause::Timeout, "deadline".into()),
            "finish" => st.on_reply(1, reply(XferStatus::Finish, vec!["b".into()], vec![])),
            _ => st.on_reply(1, reply(XferStatus::Error, vec![], vec![])),
        };
        let a: Vec<_> = outcomes(&fx)
            .into_iter()
            .filter(|(id, _)| id == "a")
            .collect();
        // A FINISH that omits it is P's answer (rule 3: it did not write it).
        let want = match end {
            "finish" => SettleOutcome::failed(
                Cause::Omitted,
                format!("aborted by the host (P: {OMITTED})"),
            ),
            _ => aborted(),
        };
        assert_eq!(a, vec![("a".into(), want)], "{end}");
        assert!(fx.pull_done, "{end}");
        assert_eq!(st.pending_count(), 0, "{end}");
    }
}

#[test]
fn an_id_in_both_lists_of_one_reply_settles_failed() {
    let mut st = PeerState::new(PeerId::new("p"));
    st.start_pull(pull(1, &["r1", "r2"]));
    let fx = st.on_reply(
        1,
        reply(
            XferStatus::Continue,
            vec!["r1".into(), "r2".into()],
            vec!["r1".into()],
        ),
    );
    assert_eq!(
        outcomes(&fx),
        vec![
            (
                "r1".into(),
                SettleOutcome::failed(Cause::PeerError, "peer reported failure")
            ),
            ("r2".into(), SettleOutcome::Ok),
        ]
    );
    assert_eq!(fx.stale.count, 1, "the ok entry of r1 is a duplicate");
}

#[test]
fn stale_ids_are_counted_with_a_short_sample() {
    let mut st = PeerState::new(PeerId::new("p"));
    st.start_pull(pull(1, &["r1"]));
    // 2 x 1 + slack: the most a reply to this pull may name
    let mut ids: Vec<String> = (0..max_reply_ids(1) - 1).map(|i| format!("x{i}")).collect();
    ids.push("r1".into());
    let fx = st.on_reply(1, reply(XferStatus::Continue, ids, vec![]));
    assert!(fx.malformed.is_none());
    assert_eq!(outcomes(&fx), vec![("r1".into(), SettleOutcome::Ok)]);
    assert_eq!(fx.stale.count, max_reply_ids(1) - 1);
    assert_eq!(fx.stale.sample.len(), STALE_SAMPLE);
    assert_eq!(&*fx.stale.sample[0], "x0");
}

#[test]
fn a_reply_naming_a_million_ids_is_refused_as_malformed_without_decoding_them() {
    let mut st = PeerState::new(PeerId::new("p"));
    st.start_pull(pull(1, &["r1", "r2"]));
    let ids: Vec<String> = (0..1_000_000).map(|i| format!("id-{i:07}")).collect();
    let frames = reply(XferStatus::Continue, ids, vec![]);
    assert!(frames[0].len() < 16 << 20, "under the frame cap");
    let t = Instant::now();
    let fx = st.on_reply(1, frames);
    // Informational only (not asserted): the refusal reads list headers, not the ids.
    eprintln!("1,000,000-id reply refused in {:?}", t.elapsed());
    let reason = fx.malformed.as_deref().expect("malformed");
    assert!(
        reason.contains("1000000") && reason.contains("more than the 20"),
        "{reason}"
    );
    assert!(fx.stale.is_empty(), "nothing was decoded, nothing echoed");
    assert!(fx.pull_done);
    assert!(outcomes(&fx)
        .iter()
        .all(|(_, o)| matches!(o, SettleOutcome::Uncertain { .. })));
    assert_eq!(
        fx.settles.len(),
        2,
        "the pull's pending requests settle Uncertain"
    );
}

#[test]
fn an_unsent_pull_settles_each_request_failed_once() {
    let st = PeerState::new(PeerId::new("p"));
    let p = pull(3, &["r1", "r1", "r2"]);
    let fx = st.unsent(&UnsentPull {
        pull_id: 3,
        requests: p.requests,
        reason: "not sent".into(),
    });
    assert_eq!(
        outcomes(&fx),
        vec![
            (
                "r1".into(),
                SettleOutcome::failed(Cause::NotSent, "not sent")
            ),
            (
                "r2".into(),
                SettleOutcome::failed(Cause::NotSent, "not sent")
            ),
        ]
    );
    assert_eq!(st.in_flight(), 0);
}
