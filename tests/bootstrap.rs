//! The HTTP bootstrap client against the simulator's bootstrap server (and two broken servers):
//! caching, refusal of partial topologies, de-duplication, refresh after failure, timeouts, caps,
//! and the server's status codes (PROTOCOL.md §3).

use std::time::Duration;

use futures::future::join_all;
use hyper::{Method, StatusCode};
use kvrecv::actors::{TopologyError, TopologySource};
use kvrecv::control::http::{request, BaseUrl};
use kvrecv::control::{BootstrapConfig, HttpTopology};
use kvrecv::messages::bootstrap::RegisterWorker;
use kvrecv::sim::{PrefillSim, SimConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn w(engine: &str, dp: u32, tp: u32, pp: u32, addr: &str) -> RegisterWorker {
    RegisterWorker {
        engine_id: engine.into(),
        dp_rank: dp,
        tp_rank: tp,
        pp_rank: pp,
        addr: addr.into(),
    }
}

#[tokio::test]
async fn topology_is_fetched_once_and_cached_until_invalidated() {
    let s = PrefillSim::start(SimConfig {
        tp_size: 2,
        pp_size: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let t = HttpTopology::new(BootstrapConfig::default());
    let url = s.bootstrap_url();
    let topo = t.lookup(&url, s.engine_id()).await.unwrap();
    assert_eq!((topo.tp_size, topo.pp_size), (2, 2));
    assert_eq!(topo.workers[1][0].addr(), s.worker(1, 0).addr());
    t.lookup(&url, s.engine_id()).await.unwrap();
    assert_eq!(
        s.bootstrap().query_count(),
        1,
        "second lookup served from the cache"
    );
    // What the Receiver asks first: the same topology, shared, each time, and no query.
    let a = t
        .cached(&url, s.engine_id())
        .expect("cached after a lookup");
    let b = t.cached(&url, s.engine_id()).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert_eq!(*a, topo);
    assert_eq!(s.bootstrap().query_count(), 1);
    t.invalidate(&url, s.engine_id());
    assert!(t.cached(&url, s.engine_id()).is_none(), "invalidated");
    t.lookup(&url, s.engine_id()).await.unwrap();
    assert_eq!(s.bootstrap().query_count(), 2);
    // A new topology after the new query: the Receiver derives its peers again.
    let c = t.cached(&url, s.engine_id()).unwrap();
    assert!(!std::sync::Arc::ptr_eq(&a, &c));
}

#[tokio::test]
async fn concurrent_lookups_share_one_query() {
    let s = PrefillSim::start(SimConfig::default()).await.unwrap();
    let t = HttpTopology::new(BootstrapConfig::default());
    let url = s.bootstrap_url();
    let all = join_all((0..8).map(|_| t.lookup(&url, s.engine_id()))).await;
    assert!(all.iter().all(|r| r.is_ok()));
    assert_eq!(s.bootstrap().query_count(), 1);
}

#[tokio::test]
async fn partial_topology_is_refused_not_cached_and_accepted_once_complete() {
    let s = PrefillSim::start(SimConfig {
        tp_size: 2,
        register: false,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let t = HttpTopology::new(BootstrapConfig::default());
    let url = s.bootstrap_url();
    // A query racing P's startup: only TP rank 0 registered.
    s.register(s.worker(0, 0).rank(), s.worker(0, 0).addr())
        .await
        .unwrap();
    // Without sizes, a lone rank 0 looks like TP1 (PROTOCOL.md §3 hazard); configured sizes
    // refuse it, and so do sizes in /query.
    let known = HttpTopology::new(BootstrapConfig {
        expected_p_sizes: Some((2, 1)),
        ..BootstrapConfig::default()
    });
    let e = known.lookup(&url, s.engine_id()).await.unwrap_err();
    assert!(matches!(e, TopologyError::Incomplete { .. }), "{e:?}");
    assert!(!known.is_cached(&url, s.engine_id()));
    s.bootstrap().advertise_sizes(0, 2, 1);
    let e = t.lookup(&url, s.engine_id()).await.unwrap_err();
    assert!(matches!(e, TopologyError::Incomplete { .. }), "{e:?}");
    assert!(!t.is_cached(&url, s.engine_id()));
    s.register(s.worker(1, 0).rank(), s.worker(1, 0).addr())
        .await
        .unwrap();
    let topo = t.lookup(&url, s.engine_id()).await.unwrap();
    assert_eq!(topo.tp_size, 2);
    assert!(t.is_cached(&url, s.engine_id()));
    assert_eq!(known.lookup(&url, s.engine_id()).await.unwrap().tp_size, 2);
}

#[tokio::test]
async fn missing_rank_zero_is_refused() {
    let s = PrefillSim::start(SimConfig {
        tp_size: 2,
        register: false,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    s.register(s.worker(1, 0).rank(), s.worker(1, 0).addr())
        .await
        .unwrap();
    let t = HttpTopology::new(BootstrapConfig::default());
    let e = t
        .lookup(&s.bootstrap_url(), s.engine_id())
        .await
        .unwrap_err();
    assert!(matches!(e, TopologyError::Incomplete { .. }), "{e:?}");
}

#[tokio::test]
async fn unreachable_bootstrap_fails_and_is_asked_again() {
    // The port is this test's for its whole life: bound, not listening, a connection to it is
    // refused (no number is released and taken again, which another test could take between).
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}", socket.local_addr().unwrap());
    let t = HttpTopology::new(BootstrapConfig::default());
    let e = t.lookup(&url, "e").await.unwrap_err();
    assert!(matches!(e, TopologyError::Bootstrap { .. }), "{e:?}");
    // The server comes up on that port (the same socket listens): the next lookup asks again
    // and succeeds.
    query_server_on(socket.listen(16).unwrap(), query_addrs(1));
    assert!(t.lookup(&url, "e").await.is_ok());
    assert!(matches!(
        t.lookup("https://x:1", "e").await,
        Err(TopologyError::Bootstrap { .. })
    ));
}

/// A server that accepts and then does `f` with the connection.
async fn raw_server<F, Fut>(f: F) -> String
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    serve_on(l, f);
    url
}

/// Accept on `l` and do `f` with each connection.
fn serve_on<F, Fut>(l: tokio::net::TcpListener, f: F)
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            f(s).await;
        }
    });
}

/// Worker addresses of `tp` TP ranks (never dialled: a lookup only lists them).
fn query_addrs(tp: u32) -> Vec<String> {
    (0..tp)
        .map(|r| format!("tcp://127.0.0.1:{}", 20000 + r))
        .collect()
}

/// A `/query` answer listing `tp` TP ranks of one PP stage each, for engine "e".
async fn query_server(tp: u32) -> String {
    query_server_of(query_addrs(tp)).await
}

/// A `/query` answer listing one worker per TP rank at `addrs`, for engine "e".
async fn query_server_of(addrs: Vec<String>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    query_server_on(l, addrs);
    url
}

/// Answer `/query` on `l`, listing one worker per TP rank at `addrs`, for engine "e".
fn query_server_on(l: tokio::net::TcpListener, addrs: Vec<String>) {
    let ranks: Vec<String> = addrs
        .iter()
        .enumerate()
        .map(|(r, a)| format!("\"{r}\":{{\"0\":{}}}", serde_json::json!(a)))
        .collect();
    let body = format!(
        "{{\"0\":{{\"engine_id\":\"e\",\"worker_addr\":{{{}}}}}}}",
        ranks.join(",")
    );
    serve_on(l, move |mut s| {
        let body = body.clone();
        async move {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        }
    });
}

/// A `/query` listing thousands of workers (hostile or broken) is refused before any socket is
/// opened for them, unless the operator configured those sizes.
#[tokio::test]
async fn an_implausible_worker_count_is_refused_unless_configured() {
    let url = query_server(5000).await;
    let t = HttpTopology::new(BootstrapConfig::default());
    let e = t.lookup(&url, "e").await.unwrap_err();
    assert!(
        matches!(
            e,
            TopologyError::Implausible {
                workers: 5000,
                max: 256,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(!t.is_cached(&url, "e"));
    let known = HttpTopology::new(BootstrapConfig {
        expected_p_sizes: Some((5000, 1)),
        ..BootstrapConfig::default()
    });
    assert_eq!(known.lookup(&url, "e").await.unwrap().tp_size, 5000);
    // At the cap it is accepted.
    let url = query_server(256).await;
    assert_eq!(t.lookup(&url, "e").await.unwrap().tp_size, 256);
}

#[tokio::test]
async fn silent_server_times_out_and_oversized_body_is_refused() {
    let silent = raw_server(|s| async move {
        tokio::spawn(async move {
            let _keep = s;
            std::future::pending::<()>().await;
        });
    })
    .await;
    let t = HttpTopology::new(BootstrapConfig {
        timeout: Duration::from_millis(200),
        max_body: 1024,
        ..BootstrapConfig::default()
    });
    let e = t.lookup(&silent, "e").await.unwrap_err();
    assert!(e.to_string().contains("no answer within"), "{e}");

    let big = raw_server(|mut s| async move {
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf).await;
        let body = format!(
            "{{\"0\":{{\"engine_id\":\"{}\",\"worker_addr\":{{}}}}}}",
            "e".repeat(4000)
        );
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let _ = s.write_all(resp.as_bytes()).await;
    })
    .await;
    let e = t.lookup(&big, "e").await.unwrap_err();
    assert!(e.to_string().contains("cap"), "{e}");

    let bad = raw_server(|mut s| async move {
        let mut buf = [0u8; 4096];
        let _ = s.read(&mut buf).await;
        let _ = s
            .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
            .await;
    })
    .await;
    let e = t.lookup(&bad, "e").await.unwrap_err();
    assert!(e.to_string().contains("500"), "{e}");
}

#[tokio::test]
async fn register_status_codes_follow_vllm() {
    let s = PrefillSim::start(SimConfig {
        register: false,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let base = BaseUrl::parse(&s.bootstrap_url()).unwrap();
    let post = |body: Vec<u8>| {
        let base = base.clone();
        async move {
            request(
                Method::POST,
                &base,
                "/register",
                Some(body),
                Duration::from_secs(5),
                1 << 16,
            )
            .await
            .unwrap()
        }
    };
    let j = |r: &RegisterWorker| serde_json::to_vec(r).unwrap();
    assert_eq!(
        post(j(&w("e0", 0, 0, 0, "tcp://1.2.3.4:1"))).await.0,
        StatusCode::OK
    );
    assert_eq!(
        post(j(&w("e0", 0, 0, 0, "tcp://1.2.3.4:1"))).await.0,
        StatusCode::OK,
        "idempotent"
    );
    let (st, body) = post(j(&w("e0", 0, 0, 0, "tcp://1.2.3.4:2"))).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&body).contains("already registered at tcp://1.2.3.4:1"));
    let (st, body) = post(j(&w("e1", 0, 1, 0, "tcp://1.2.3.4:3"))).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&body).contains("Engine ID mismatch for dp_rank=0"));
    assert_eq!(
        post(b"{\"engine_id\": 5}".to_vec()).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let (st, body) = request(
        Method::GET,
        &base,
        "/query",
        None,
        Duration::from_secs(5),
        1 << 16,
    )
    .await
    .unwrap();
    assert_eq!(st, StatusCode::OK);
    let q: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(q["0"]["worker_addr"]["0"]["0"], "tcp://1.2.3.4:1");
}

/// A worker address no ZMQ socket can dial (a hostile or broken `/query`): the pull fails as
/// not sent, so its blocks are released at once (no peer can hold them), and the reason names
/// the address, not a refused connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_address_that_cannot_be_dialled_fails_the_pull_as_not_sent() {
    use kvrecv::config::KvRecvConfig;
    use kvrecv::embed::KvRecv;
    use kvrecv::layout::KvLayout;
    use kvrecv::messages::{KvEvent, KvRequest, Outcome};
    let url = query_server_of(vec!["not-an-endpoint".into()]).await;
    let kv = KvRecv::builder(KvRecvConfig {
        layout: KvLayout::uniform(1, 4096, 16),
        ..KvRecvConfig::default()
    })
    .events(true)
    .start()
    .unwrap();
    let mut events = kv.events().unwrap();
    let reply = kv
        .load_kv(vec![KvRequest {
            req_id: "d-1".into(),
            transfer_id: Some("t-1".into()),
            remote_engine_id: Some("e".into()),
            remote_bootstrap_addr: Some(url),
            block_ids: vec![vec![1]],
        }])
        .await
        .unwrap();
    assert_eq!(reply.awaiting, 1);
    let completion = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match events.recv().await.expect("the event stream stays open") {
                KvEvent::Completion {
                    outcome,
                    uncertain_peers,
                    ..
                } => return (outcome, uncertain_peers),
                _ => continue,
            }
        }
    })
    .await
    .expect("a completion");
    match completion {
        (Outcome::Failed { reason, .. }, uncertain) => {
            assert!(reason.contains("cannot be dialled"), "{reason}");
            assert!(uncertain.is_empty(), "nothing was sent: {uncertain:?}");
        }
        other => panic!("{other:?}"),
    }
}
