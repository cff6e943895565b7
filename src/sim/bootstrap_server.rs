//! The bootstrap server of a simulated P engine group (PROTOCOL.md §3): `POST /register` and
//! `GET /query`, with vLLM's status codes (the idempotent-re-registration revision).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use crate::messages::bootstrap::{DpEntry, QueryResponse, RegisterWorker};

/// The longest worker address taken (a `tcp://host:port`): anyone can register, and every
/// D's `/query` reads every address (500 of 1 MiB made the answer 524 MB, over D's cap).
pub const MAX_ADDR_BYTES: usize = 256;
/// The most workers registered at once, every DP rank together.
pub const MAX_WORKERS: usize = 4096;
/// Connections served at once; one more is closed at once.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a request's headers may take to arrive (a slow client holds a connection).
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Registered workers, shared by the server's connections.
#[derive(Default)]
struct Registry {
    /// dp_rank -> entry.
    engines: BTreeMap<u32, DpEntry>,
}

#[derive(Default)]
struct State {
    registry: Mutex<Registry>,
    queries: AtomicUsize,
    /// Add `tp_size`/`pp_size` to `/query` entries (some vLLM branches do).
    sizes: Mutex<BTreeMap<u32, (u32, u32)>>,
}

/// A running bootstrap server. Dropping the handle stops it.
pub struct BootstrapServer {
    addr: SocketAddr,
    state: Arc<State>,
    /// `None` while stopped (a crashed P engine).
    task: Option<JoinHandle<()>>,
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// Accept until aborted; aborting drops the set, which closes every open connection too.
async fn accept_loop(listener: TcpListener, st: Arc<State>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                // Connections that ended and were not reaped yet do not count.
                while conns.try_join_next().is_some() {}
                if conns.len() >= MAX_CONNECTIONS {
                    continue; // dropped: closed at once
                }
                let st = st.clone();
                conns.spawn(async move {
                    let svc = service_fn(move |req| handle(req, st.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .timer(hyper_util::rt::TokioTimer::new())
                        .header_read_timeout(HEADER_READ_TIMEOUT)
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

impl BootstrapServer {
    /// Bind `addr` (port 0 for any) and serve on the current tokio runtime.
    pub async fn start(addr: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        let task = tokio::spawn(accept_loop(listener, state.clone()));
        Ok(BootstrapServer {
            addr,
            state,
            task: Some(task),
        })
    }

    /// Stop serving and close every connection; the registry is lost (vLLM's bootstrap server
    /// lives in P's TP0/PP0 worker and dies with the engine). Returns once the port is free.
    pub async fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
        lock(&self.state.registry).engines.clear();
    }

    /// Serve again on the same address (after [`Self::stop`]), with an empty registry.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        self.stop().await;
        let listener = TcpListener::bind(self.addr).await?;
        self.task = Some(tokio::spawn(accept_loop(listener, self.state.clone())));
        Ok(())
    }

    /// Whether it is serving.
    pub fn is_running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ip:port`, what D receives as `remote_bootstrap_addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many `GET /query` were served.
    pub fn query_count(&self) -> usize {
        self.state.queries.load(Ordering::SeqCst)
    }

    /// Advertise `tp_size`/`pp_size` for a DP rank in `/query`.
    pub fn advertise_sizes(&self, dp_rank: u32, tp_size: u32, pp_size: u32) {
        lock(&self.state.sizes).insert(dp_rank, (tp_size, pp_size));
    }

    /// Register a worker directly (same rules as `POST /register`).
    pub fn register(&self, w: &RegisterWorker) -> Result<(), String> {
        register(&self.state, w)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn register(state: &State, w: &RegisterWorker) -> Result<(), String> {
    if w.addr.len() > MAX_ADDR_BYTES {
        return Err(format!(
            "worker address of {} bytes, over {MAX_ADDR_BYTES}",
            w.addr.len()
        ));
    }
    let mut reg = lock(&state.registry);
    let workers: usize = reg
        .engines
        .values()
        .flat_map(|e| e.worker_addr.values())
        .map(BTreeMap::len)
        .sum();
    let known = reg.engines.get(&w.dp_rank).is_some_and(|e| {
        e.worker_addr
            .get(&w.tp_rank.to_string())
            .is_some_and(|s| s.contains_key(&w.pp_rank.to_string()))
    });
    if !known && workers >= MAX_WORKERS {
        return Err(format!("{MAX_WORKERS} workers registered already"));
    }
    let entry = reg.engines.entry(w.dp_rank).or_insert_with(|| DpEntry {
        engine_id: w.engine_id.clone(),
        worker_addr: BTreeMap::new(),
        tp_size: None,
        pp_size: None,
    });
    if entry.engine_id != w.engine_id {
        return Err(format!("Engine ID mismatch for dp_rank={}", w.dp_rank));
    }
    let stages = entry.worker_addr.entry(w.tp_rank.to_string()).or_default();
    match stages.get(&w.pp_rank.to_string()) {
        Some(a) if *a != w.addr => Err(format!(
            "Worker with dp_rank={}, tp_rank={}, pp_rank={} is already registered at {a}",
            w.dp_rank, w.tp_rank, w.pp_rank
        )),
        _ => {
            stages.insert(w.pp_rank.to_string(), w.addr.clone());
            Ok(())
        }
    }
}

fn reply(status: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

async fn handle(
    req: Request<Incoming>,
    state: Arc<State>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/query") => {
            state.queries.fetch_add(1, Ordering::SeqCst);
            let sizes = lock(&state.sizes).clone();
            let q: QueryResponse = lock(&state.registry)
                .engines
                .iter()
                .map(|(dp, e)| {
                    let mut e = e.clone();
                    if let Some((t, p)) = sizes.get(dp) {
                        e.tp_size = Some(*t);
                        e.pp_size = Some(*p);
                    }
                    (dp.to_string(), e)
                })
                .collect();
            reply(StatusCode::OK, serde_json::to_value(q).unwrap_or_default())
        }
        (&Method::POST, "/register") => {
            let body = match Limited::new(req.into_body(), 1 << 20).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return Ok(reply(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        json!({"detail": e.to_string()}),
                    ))
                }
            };
            match serde_json::from_slice::<RegisterWorker>(&body) {
                Err(e) => reply(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    json!({"detail": e.to_string()}),
                ),
                Ok(w) => match register(&state, &w) {
                    Ok(()) => reply(StatusCode::OK, json!({"status": "ok"})),
                    Err(detail) => reply(StatusCode::BAD_REQUEST, json!({"detail": detail})),
                },
            }
        }
        _ => reply(StatusCode::NOT_FOUND, json!({"detail": "Not Found"})),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(tp_rank: u32, addr: &str) -> RegisterWorker {
        RegisterWorker {
            engine_id: "e".into(),
            dp_rank: 7,
            tp_rank,
            pp_rank: 0,
            addr: addr.into(),
        }
    }

    /// Anyone can register, and every D reads every address: the registry is bounded.
    #[test]
    fn registration_is_bounded_in_address_length_and_workers() {
        let state = State::default();
        let long = "x".repeat(MAX_ADDR_BYTES + 1);
        let e = register(&state, &worker(0, &long)).expect_err("a 257-byte address");
        assert!(e.contains("over 256"), "{e}");
        for tp in 0..MAX_WORKERS as u32 {
            register(&state, &worker(tp, "tcp://10.0.0.1:5555")).unwrap();
        }
        let e = register(&state, &worker(MAX_WORKERS as u32, "tcp://10.0.0.1:5555"))
            .expect_err("one worker too many");
        assert!(e.contains("registered already"), "{e}");
        // Re-registering a known worker at its address stays idempotent at the cap.
        register(&state, &worker(3, "tcp://10.0.0.1:5555")).unwrap();
    }

    /// Connections that send nothing hold their place only until the cap: one more is closed at
    /// once, and the server still answers once they go.
    #[tokio::test]
    async fn connections_over_the_cap_are_closed_at_once() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let server = BootstrapServer::start("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(tokio::net::TcpStream::connect(server.addr()).await.unwrap());
        }
        let mut extra = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(std::time::Duration::from_secs(20), extra.read(&mut buf))
            .await
            .expect("closed, not held");
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
        // By the cap, not the header timeout: that would have closed the older ones first.
        assert!(
            matches!(idle[0].try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "the first idle connection is still open"
        );
        drop(idle);
        let answered = async {
            loop {
                let mut c = tokio::net::TcpStream::connect(server.addr()).await.unwrap();
                c.write_all(b"GET /query HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                    .await
                    .unwrap();
                let mut reply = Vec::new();
                let _ = c.read_to_end(&mut reply).await;
                if reply.starts_with(b"HTTP/1.1 200") {
                    break;
                }
                // The closed connections' tasks end as the server notices them: try again.
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(20), answered)
            .await
            .expect("served again once the idle connections went");
    }
}
