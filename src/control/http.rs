//! A one-shot HTTP/1.1 request on hyper (no pool, no TLS): what the bootstrap client and the
//! simulator's workers need. Every call opens a connection, sends one request, reads a capped
//! body and closes; the whole exchange is under one timeout.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use thiserror::Error;
use tokio::net::TcpStream;

/// Why an HTTP exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HttpError {
    #[error("bad URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("connect to {addr} failed: {reason}")]
    Connect { addr: String, reason: String },
    #[error("HTTP exchange failed: {0}")]
    Protocol(String),
    #[error("no answer within {}", crate::millis::Millis::of(.0))]
    Timeout(Duration),
    #[error("response body over the {cap}-byte cap")]
    TooLarge { cap: usize },
}

/// `http://host[:port][/prefix]`, split for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    pub host: String,
    pub port: u16,
    /// `host:port` as given (the `Host` header).
    pub authority: String,
    /// Path prefix without a trailing slash (`""` for none).
    pub prefix: String,
}

impl BaseUrl {
    /// Parse a base URL. Only `http` is supported (vLLM's bootstrap server speaks plain HTTP).
    ///
    /// ```
    /// let b = kvrecv::control::http::BaseUrl::parse("http://127.0.0.1:8998/").unwrap();
    /// assert_eq!((b.host.as_str(), b.port, b.prefix.as_str()), ("127.0.0.1", 8998, ""));
    /// assert!(kvrecv::control::http::BaseUrl::parse("https://x").is_err());
    /// ```
    pub fn parse(url: &str) -> Result<Self, HttpError> {
        let bad = |reason: &str| HttpError::BadUrl {
            url: url.into(),
            reason: reason.into(),
        };
        let uri: Uri = url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("only http:// is supported"));
        }
        let auth = uri.authority().ok_or_else(|| bad("no host"))?;
        let host = auth
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(BaseUrl {
            host,
            port: auth.port_u16().unwrap_or(80),
            authority: auth.as_str().to_owned(),
            prefix: uri.path().trim_end_matches('/').to_owned(),
        })
    }
}

/// One request. Returns the status and the body (at most `cap` bytes).
pub async fn request(
    method: Method,
    base: &BaseUrl,
    path: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
    cap: usize,
) -> Result<(StatusCode, Bytes), HttpError> {
    tokio::time::timeout(timeout, exchange(method, base, path, body, cap))
        .await
        .map_err(|_| HttpError::Timeout(timeout))?
}

async fn exchange(
    method: Method,
    base: &BaseUrl,
    path: &str,
    body: Option<Vec<u8>>,
    cap: usize,
) -> Result<(StatusCode, Bytes), HttpError> {
    let addr = format!("{}:{}", base.host, base.port);
    let stream = TcpStream::connect((base.host.as_str(), base.port))
        .await
        .map_err(|e| HttpError::Connect {
            addr: addr.clone(),
            reason: e.to_string(),
        })?;
    let _ = stream.set_nodelay(true);
    let proto = |e: hyper::Error| HttpError::Protocol(e.to_string());
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(proto)?;
    let mut req = Request::builder()
        .method(method)
        .uri(format!("{}{}", base.prefix, path))
        .header(hyper::header::HOST, base.authority.as_str())
        .header(hyper::header::CONNECTION, "close");
    if body.is_some() {
        req = req.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| HttpError::Protocol(e.to_string()))?;
    let exchange = async move {
        let resp = sender.send_request(req).await.map_err(proto)?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), cap)
            .collect()
            .await
            .map_err(|e| {
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    HttpError::TooLarge { cap }
                } else {
                    HttpError::Protocol(e.to_string())
                }
            })?;
        Ok((status, body.to_bytes()))
    };
    // Drive the connection and the exchange together on this task (no spawn: callers may run
    // on actix's current-thread arbiter or a plain runtime alike).
    let mut conn = pin!(conn);
    let mut exchange = pin!(exchange);
    let mut conn_done = false;
    std::future::poll_fn(|cx| {
        if !conn_done {
            if let Poll::Ready(r) = conn.as_mut().poll(cx) {
                conn_done = true;
                if let Err(e) = r {
                    return Poll::Ready(Err(proto(e)));
                }
            }
        }
        exchange.as_mut().poll(cx)
    })
    .await
}
