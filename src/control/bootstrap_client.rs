//! [`TopologySource`] over HTTP: `GET <remote_bootstrap_addr>/query` (PROTOCOL.md §3).
//!
//! - Cached per (bootstrap, engine) once a *complete* topology was seen; a partial one (a query
//!   racing P's startup) is refused by [`EngineTopology::from_query`] and not cached, so the next
//!   batch asks again.
//! - Failures are not cached either; `invalidate` drops the entry (DESIGN.md §4 rule 7).
//! - Concurrent lookups against one bootstrap address share one request (one shared future per
//!   address, registered synchronously in `lookup`, so lookups issued together always join).
//! - Every request has a timeout and a body cap.

#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{LocalBoxFuture, Shared};
use futures::FutureExt;
use hyper::{Method, StatusCode};

use crate::actors::topology::{EngineTopology, TopologyError, TopologySource};
use crate::messages::bootstrap::{parse_query, QueryResponse};
use crate::messages::peer_text::peer_text;
use crate::telemetry::{self as m, Labels};

use super::http::{request, BaseUrl};

/// Knobs of the bootstrap client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootstrapConfig {
    /// Whole-request timeout (vLLM: the HTTP client default, 5 s).
    pub timeout: Duration,
    /// Largest `/query` body accepted. Parsed into nested maps, a body can take ~40x its size in
    /// memory (`tests/untrusted_decoders.rs`); a real one is a few KiB (about 30 bytes a worker).
    pub max_body: usize,
    /// P's (TP, PP) sizes when the operator knows them. `/query` infers the TP size from how many
    /// ranks registered, so a query racing P's startup can see a TP2 engine as TP1; with the sizes
    /// known (here, or as `tp_size`/`pp_size` in `/query`), such a view is refused.
    pub expected_p_sizes: Option<(u32, u32)>,
    /// Most P workers (TP x PP ranks) an engine may list when `expected_p_sizes` is not given.
    /// Each worker a D rank pulls from costs sockets and file descriptors; a `/query` answer
    /// listing thousands (hostile or broken) would exhaust them. Configured sizes are trusted
    /// over this cap.
    pub max_p_workers: u32,
}

impl Default for BootstrapConfig {
    fn default() -> Self {
        BootstrapConfig {
            timeout: Duration::from_secs(5),
            max_body: 1024 * 1024,
            expected_p_sizes: None,
            max_p_workers: 256,
        }
    }
}

type QueryResult = Result<Rc<QueryResponse>, TopologyError>;
type SharedQuery = Shared<LocalBoxFuture<'static, QueryResult>>;

#[derive(Default)]
struct Inner {
    /// bootstrap -> engine id -> topology (nested, so a lookup by `&str` allocates nothing).
    cache: HashMap<String, HashMap<String, Arc<EngineTopology>>>,
    /// bootstrap -> (generation, the request in flight).
    inflight: HashMap<String, (u64, SharedQuery)>,
    next_gen: u64,
}

/// The HTTP bootstrap client. Single-threaded (`Rc`): it lives on the Receiver's arbiter.
#[derive(Clone, Default)]
pub struct HttpTopology {
    inner: Rc<RefCell<Inner>>,
    cfg: BootstrapConfig,
    labels: Labels,
}

impl HttpTopology {
    /// A client with no cached topology; a lookup queries `GET /query` and caches complete engines.
    pub fn new(cfg: BootstrapConfig) -> Self {
        HttpTopology {
            inner: Rc::default(),
            cfg,
            labels: Labels::default(),
        }
    }

    /// Record metrics under `labels` (the coordinator's engine and ranks).
    pub(crate) fn with_labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// Whether a topology is cached (for tests and operators).
    pub fn is_cached(&self, bootstrap: &str, engine_id: &str) -> bool {
        self.cached_topology(bootstrap, engine_id).is_some()
    }

    fn cached_topology(&self, bootstrap: &str, engine_id: &str) -> Option<Arc<EngineTopology>> {
        self.inner
            .borrow()
            .cache
            .get(bootstrap)
            .and_then(|engines| engines.get(engine_id))
            .cloned()
    }

    fn query(&self, bootstrap: &str) -> (u64, SharedQuery, bool) {
        let mut inner = self.inner.borrow_mut();
        if let Some((gen, q)) = inner.inflight.get(bootstrap) {
            return (*gen, q.clone(), true);
        }
        let gen = inner.next_gen;
        inner.next_gen += 1;
        let fut = fetch(bootstrap.to_owned(), self.cfg, self.labels.clone())
            .boxed_local()
            .shared();
        inner
            .inflight
            .insert(bootstrap.to_owned(), (gen, fut.clone()));
        (gen, fut, false)
    }
}

async fn fetch(bootstrap: String, cfg: BootstrapConfig, labels: Labels) -> QueryResult {
    let started = Instant::now();
    let span = tracing::info_span!("bootstrap_query", %bootstrap);
    let fail = |reason: String| TopologyError::Bootstrap {
        bootstrap: bootstrap.clone(),
        reason,
    };
    let result = async {
        let base = BaseUrl::parse(&bootstrap).map_err(|e| fail(e.to_string()))?;
        let (status, body) = request(
            Method::GET,
            &base,
            "/query",
            None,
            cfg.timeout,
            cfg.max_body,
        )
        .await
        .map_err(|e| fail(e.to_string()))?;
        if status != StatusCode::OK {
            return Err(fail(format!("GET /query answered {status}")));
        }
        // serde's complaint may quote the body (a string where a number belongs): P's text.
        let q = parse_query(&body)
            .map_err(|e| fail(format!("bad /query JSON: {}", peer_text(&e.to_string()))))?;
        Ok(Rc::new(q))
    }
    .await;
    let _g = span.enter();
    labels
        .histogram(m::BOOTSTRAP_LATENCY)
        .record(started.elapsed().as_secs_f64());
    match &result {
        Ok(q) => {
            labels
                .counter_by(m::BOOTSTRAP_QUERIES, "result", "ok")
                .increment(1);
            tracing::debug!(engines = q.len(), "bootstrap answered");
        }
        Err(e) => {
            labels
                .counter_by(m::BOOTSTRAP_QUERIES, "result", "error")
                .increment(1);
            tracing::warn!(error = %e, "bootstrap query failed");
        }
    }
    result
}

/// Refuse a topology whose sizes differ from the configured ones, or, with none configured, one
/// listing more than `cfg.max_p_workers` workers (not cached: asked again).
fn check_sizes(t: EngineTopology, cfg: &BootstrapConfig) -> Result<EngineTopology, TopologyError> {
    let workers = u64::from(t.tp_size) * u64::from(t.pp_size);
    match cfg.expected_p_sizes {
        Some((tp, pp)) if (t.tp_size, t.pp_size) != (tp, pp) => Err(TopologyError::Incomplete {
            engine_id: t.engine_id.clone(),
            reason: format!(
                "{} TP x {} PP registered, {tp} x {pp} configured",
                t.tp_size, t.pp_size
            ),
        }),
        None if workers > u64::from(cfg.max_p_workers) => Err(TopologyError::Implausible {
            engine_id: t.engine_id.clone(),
            workers,
            max: cfg.max_p_workers,
        }),
        _ => Ok(t),
    }
}

impl TopologySource for HttpTopology {
    fn lookup(
        &self,
        bootstrap: &str,
        engine_id: &str,
    ) -> LocalBoxFuture<'static, Result<EngineTopology, TopologyError>> {
        if let Some(t) = self.cached(bootstrap, engine_id) {
            let t = EngineTopology::clone(&t);
            return Box::pin(async move { Ok(t) });
        }
        let key = (bootstrap.to_owned(), engine_id.to_owned());
        let (gen, fut, joined) = self.query(bootstrap);
        let inner = self.inner.clone();
        let cfg = self.cfg;
        let labels = self.labels.clone();
        Box::pin(async move {
            let q = fut.await;
            let mut st = inner.borrow_mut();
            // The first waiter to wake retires the shared request, so a later lookup asks again
            // (after a failure, or for an engine that was not complete yet).
            if st.inflight.get(&key.0).is_some_and(|(g, _)| *g == gen) {
                st.inflight.remove(&key.0);
            }
            let topo = q
                .and_then(|q| EngineTopology::from_query(&key.0, &key.1, &q))
                .and_then(|t| check_sizes(t, &cfg));
            match &topo {
                Ok(t) => {
                    labels
                        .counter_by(
                            m::BOOTSTRAP_LOOKUPS,
                            "result",
                            if joined { "joined" } else { "queried" },
                        )
                        .increment(1);
                    st.cache
                        .entry(key.0)
                        .or_default()
                        .insert(key.1, Arc::new(t.clone()));
                }
                Err(e) => {
                    labels
                        .counter_by(m::BOOTSTRAP_LOOKUPS, "result", "failed")
                        .increment(1);
                    tracing::warn!(bootstrap = %key.0, engine = %key.1, error = %e, "topology lookup failed");
                }
            }
            topo
        })
    }

    fn cached(&self, bootstrap: &str, engine_id: &str) -> Option<Arc<EngineTopology>> {
        let t = self.cached_topology(bootstrap, engine_id)?;
        self.labels
            .counter_by(m::BOOTSTRAP_LOOKUPS, "result", "cached")
            .increment(1);
        Some(t)
    }

    fn invalidate(&self, bootstrap: &str, engine_id: &str) {
        let mut st = self.inner.borrow_mut();
        if let Some(engines) = st.cache.get_mut(bootstrap) {
            engines.remove(engine_id);
            if engines.is_empty() {
                st.cache.remove(bootstrap);
            }
        }
    }
}
