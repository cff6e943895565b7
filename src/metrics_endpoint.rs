//! `GET /metrics` for the binary (feature `cli`): the global Prometheus recorder and a small,
//! bounded HTTP responder in front of it.
//!
//! The exporter's own listener keeps every connection a client opens and waits on a request
//! head for as long as the client likes (3,000 half-sent requests held 66 MB). This one caps
//! open connections, reads at most 8 KiB of request head within 5 s, answers, and closes.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::rdma::accept_cap::refuse_over_cap;
use crate::telemetry::Labels;

/// Connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 64;
/// Longest request head read.
const MAX_HEAD: usize = 8 * 1024;
/// Time a client has to send its request head, and to take the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Install the global Prometheus recorder and serve `/metrics` on `addr`; returns the address
/// bound (a port 0 resolved). Needs a tokio runtime, on which the listener keeps running.
pub fn serve_prometheus(addr: SocketAddr) -> Result<SocketAddr, String> {
    let std_listener =
        std::net::TcpListener::bind(addr).map_err(|e| format!("bind {addr}: {e}"))?;
    std_listener
        .set_nonblocking(true)
        .map_err(|e| e.to_string())?;
    let bound = std_listener.local_addr().map_err(|e| e.to_string())?;
    let listener = TcpListener::from_std(std_listener).map_err(|e| e.to_string())?;
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| e.to_string())?;
    crate::telemetry::describe();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(accept_loop(listener, handle));
    Ok(bound)
}

async fn accept_loop(listener: TcpListener, handle: PrometheusHandle) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let refused = AtomicU64::new(0);
    let labels = Labels::default();
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Over the cap the connection is dropped (closed) at once, and counted as the data
        // plane's listeners count theirs.
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refuse_over_cap(&labels, "metrics", MAX_CONNECTIONS, &refused);
            continue;
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut stream = stream;
            let _ = tokio::time::timeout(CLIENT_TIMEOUT, answer(&mut stream, &handle)).await;
            // The slot is free before the client sees the close: a client that waits for the
            // close to open its next connection finds a slot.
            drop(slot);
            let _ = stream.shutdown().await;
        });
    }
}

/// Read one request head and answer it; the connection then closes.
async fn answer(stream: &mut TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    // Where the search for the blank line resumes: only bytes not yet scanned (and the three
    // before them, which a terminator may straddle). A bare-LF head (some clients) ends too.
    let ends =
        |h: &[u8]| h.windows(4).any(|w| w == b"\r\n\r\n") || h.windows(2).any(|w| w == b"\n\n");
    let mut scanned = 0;
    while !ends(&head[scanned..]) {
        if head.len() >= MAX_HEAD {
            return respond(stream, "431 Request Header Fields Too Large", "").await;
        }
        scanned = head.len().saturating_sub(3);
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let path = |p: &[u8]| p.split(|&b| b == b'?').next() == Some(b"/metrics".as_slice());
    match (parts.next(), parts.next()) {
        (Some(b"GET"), Some(p)) if path(p) => respond(stream, "200 OK", &handle.render()).await,
        (Some(b"GET"), Some(_)) => respond(stream, "404 Not Found", "").await,
        _ => respond(stream, "405 Method Not Allowed", "").await,
    }
}

async fn respond(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn ask(head: &[u8], byte_by_byte: bool) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handle = PrometheusBuilder::new().build_recorder().handle();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            answer(&mut s, &handle).await
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        if byte_by_byte {
            for b in head {
                c.write_all(&[*b]).await.unwrap();
                c.flush().await.unwrap();
                tokio::task::yield_now().await;
            }
        } else {
            c.write_all(head).await.unwrap();
        }
        server.await.unwrap().unwrap();
        let mut reply = String::new();
        c.read_to_string(&mut reply).await.unwrap();
        reply
    }

    /// Heads ending in bare LFs, and a query string after the path, are answered.
    #[tokio::test]
    async fn bare_lf_heads_and_query_strings_are_answered() {
        for head in [
            b"GET /metrics HTTP/1.1\n\n".as_slice(),
            b"GET /metrics?name=x HTTP/1.1\r\n\r\n",
        ] {
            let reply = ask(head, false).await;
            assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
        }
        let reply = ask(b"GET /other HTTP/1.1\r\n\r\n", false).await;
        assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
    }

    /// A head that arrives a byte at a time (its blank line split across reads) is answered.
    #[tokio::test]
    async fn a_head_sent_byte_by_byte_is_answered() {
        let reply = ask(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n", true).await;
        assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    }
}
