//! Observability for a host (issue 10, item 5): what kvrecv logs inside a pull or while
//! handling a settle is in a span naming the request (`req_id`) and the peer (`peer`), so a
//! host's subscriber can tie any log line to both.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use kvrecv::messages::XferStatus::Finish;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Span name and its fields, as recorded at creation.
type SpanRecord = (String, HashMap<String, String>);

#[derive(Clone, Default)]
struct SpanRecorder {
    spans: Arc<Mutex<Vec<SpanRecord>>>,
    next: Arc<AtomicU64>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}"));
    }
}

impl Subscriber for SpanRecorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = HashMap::new();
        span.record(&mut Fields(&mut fields));
        let name = span.metadata().name().to_owned();
        self.spans.lock().unwrap().push((name, fields));
        Id::from_u64(self.next.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

impl SpanRecorder {
    fn named(&self, name: &str) -> Vec<HashMap<String, String>> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, f)| f.clone())
            .collect()
    }
}

#[actix::test]
async fn pull_and_settle_spans_name_the_request_and_the_peer() {
    let rec = SpanRecorder::default();
    // The actors run on this test's thread (actix's current-thread system).
    let _guard = tracing::subscriber::set_default(rec.clone());
    let mut h = Harness::start(Setup {
        p_tp: 1,
        ..Setup::default()
    });
    h.load(vec![req("r1", &[1])]).await;
    let pull = h.next_pull().await;
    pull.respond(Finish, &["r1"], &[], None);
    h.wait_for("completion", is_completion("r1")).await;

    let peer = pull.peer.to_string();
    let pulls = rec.named("pull");
    assert_eq!(pulls.len(), 1, "{pulls:?}");
    assert_eq!(pulls[0].get("peer"), Some(&peer), "{pulls:?}");
    assert!(
        pulls[0].get("req_id").is_some_and(|v| v.contains("\"r1\"")),
        "{pulls:?}"
    );
    let settles = rec.named("settle");
    assert_eq!(settles.len(), 1, "{settles:?}");
    assert_eq!(settles[0].get("req_id").map(String::as_str), Some("r1"));
    assert_eq!(settles[0].get("peer"), Some(&peer), "{settles:?}");
}
