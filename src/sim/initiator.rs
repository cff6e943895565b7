//! A Rust Transfer Engine initiator: the P side of the TCP data plane. It fetches the segment
//! descriptor from the handshake daemon (Metadata, type 1), keeps up to N persistent lanes to
//! `tcp_data_host:tcp_data_port`, and sends one header + payload per request, awaiting the v2
//! status frame (v1: none). Used by the prefill-peer simulator and the tests to write real bytes.

#![forbid(unsafe_code)]

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use crate::messages::handshake::SegmentDescriptor;

use crate::rdma::handshake_daemon::{self, FrameType};
use crate::rdma::tcp::wire::{Header, ProtoVersion, STATUS_MAGIC, STATUS_OK, STATUS_REJECT};

/// Initiator settings.
#[derive(Debug, Clone)]
pub struct InitiatorConfig {
    /// Persistent lanes (Mooncake: `MC_TCP_LANES_PER_PEER`, default 4).
    pub lanes: usize,
    /// Framing; v2 is used only if the target advertises it.
    pub version: ProtoVersion,
    /// Wait for a status frame (Mooncake: `MC_TCP_STATUS_TIMEOUT_SEC`, 30 s).
    pub status_timeout: Duration,
    pub handshake_timeout: Duration,
}

impl Default for InitiatorConfig {
    fn default() -> Self {
        InitiatorConfig {
            lanes: 4,
            version: ProtoVersion::V2,
            status_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Error)]
pub enum InitError {
    #[error("handshake with {addr}: {source}")]
    Handshake { addr: SocketAddr, source: io::Error },
    #[error("handshake reply type {got:?}, expected Metadata")]
    WrongType { got: Option<u8> },
    #[error("bad segment descriptor: {0}")]
    Descriptor(String),
}

#[derive(Debug, Error)]
pub enum WriteError {
    #[error("the target rejected the request (v2 reject frame)")]
    Rejected,
    #[error("bad status frame {0:#018x}")]
    BadStatus(u64),
    #[error("no status frame within the timeout")]
    StatusTimeout,
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

/// A connected initiator for one target segment.
#[derive(Debug)]
pub struct TeInitiator {
    descriptor: SegmentDescriptor,
    data_addr: SocketAddr,
    version: ProtoVersion,
    status_timeout: Duration,
    idle: Mutex<Vec<TcpStream>>,
    lanes: Semaphore,
}

/// Fetch a segment descriptor from the handshake daemon at `addr`.
pub async fn fetch_descriptor(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<SegmentDescriptor, InitError> {
    // Mooncake sends its own descriptor; the target ignores it, so a minimal one will do.
    let body = b"{\"buffers\":[],\"name\":\"kvrecv-initiator\",\"protocol\":\"tcp\"}\n";
    let (ty, reply) = handshake_daemon::request(addr, Some(FrameType::Metadata), body, timeout)
        .await
        .map_err(|source| InitError::Handshake { addr, source })?;
    if ty != Some(FrameType::Metadata as u8) {
        return Err(InitError::WrongType { got: ty });
    }
    let d: SegmentDescriptor =
        serde_json::from_slice(&reply).map_err(|e| InitError::Descriptor(e.to_string()))?;
    if d.protocol != "tcp" {
        return Err(InitError::Descriptor(format!("protocol {:?}", d.protocol)));
    }
    if d.buffers
        .iter()
        .any(|b| b.name.is_empty() || b.addr == 0 || b.length == 0)
    {
        // Mooncake discards such a descriptor too.
        return Err(InitError::Descriptor(
            "a buffer has an empty name, addr 0 or length 0".into(),
        ));
    }
    Ok(d)
}

impl TeInitiator {
    /// Handshake with the daemon at `handshake` and prepare up to `cfg.lanes` lanes (opened lazily).
    pub async fn connect(handshake: SocketAddr, cfg: InitiatorConfig) -> Result<Self, InitError> {
        let descriptor = fetch_descriptor(handshake, cfg.handshake_timeout).await?;
        let ip: IpAddr = descriptor.data_host().parse().unwrap_or(handshake.ip());
        let data_addr = SocketAddr::new(ip, descriptor.tcp_data_port);
        let version = if descriptor.tcp_proto_version >= 2 {
            cfg.version
        } else {
            ProtoVersion::V1
        };
        Ok(TeInitiator {
            descriptor,
            data_addr,
            version,
            status_timeout: cfg.status_timeout,
            idle: Mutex::new(Vec::new()),
            lanes: Semaphore::new(cfg.lanes.max(1)),
        })
    }

    /// The target's descriptor.
    pub fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    /// Framing in use.
    pub fn version(&self) -> ProtoVersion {
        self.version
    }

    fn take_lane(&self) -> Option<TcpStream> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    fn return_lane(&self, s: TcpStream) {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(s);
    }

    async fn lane(&self) -> io::Result<TcpStream> {
        match self.take_lane() {
            Some(s) => Ok(s),
            None => {
                let s = TcpStream::connect(self.data_addr).await?;
                s.set_nodelay(true)?;
                Ok(s)
            }
        }
    }

    async fn status(&self, s: &mut TcpStream) -> Result<(), WriteError> {
        let v = tokio::time::timeout(self.status_timeout, s.read_u64_le())
            .await
            .map_err(|_| WriteError::StatusTimeout)??;
        match v {
            STATUS_OK => Ok(()),
            STATUS_REJECT => Err(WriteError::Rejected),
            v if v & 0xFFFF_FFFF_0000_0000 == STATUS_MAGIC => Err(WriteError::BadStatus(v)),
            v => Err(WriteError::BadStatus(v)),
        }
    }

    /// Write `data` at advertised address `addr`. v2: returns once the target acknowledged that
    /// every byte is in its memory. v1: once the bytes were handed to the socket (a rejection
    /// shows up as an error on a later request of that lane).
    pub async fn write(&self, addr: u64, data: &[u8]) -> Result<(), WriteError> {
        let _permit = self
            .lanes
            .acquire()
            .await
            .map_err(|_| io::Error::other("initiator closed"))?;
        let mut s = self.lane().await?;
        let h = Header::new(true, addr, data.len() as u64, self.version);
        let r = async {
            s.write_all(&h.encode()).await?;
            s.write_all(data).await?;
            if self.version == ProtoVersion::V2 {
                self.status(&mut s).await?;
            }
            Ok(())
        }
        .await;
        if r.is_ok() {
            // A failed lane is dropped: the target closes it after a rejection.
            self.return_lane(s);
        }
        r
    }

    /// Write every `(addr, bytes)` concurrently over the lanes; one result per entry, in order.
    pub async fn write_batch(&self, writes: &[(u64, &[u8])]) -> Vec<Result<(), WriteError>> {
        futures::future::join_all(writes.iter().map(|&(a, d)| self.write(a, d))).await
    }

    /// Read `len` bytes at advertised address `addr`.
    pub async fn read(&self, addr: u64, len: u64) -> Result<Vec<u8>, WriteError> {
        let _permit = self
            .lanes
            .acquire()
            .await
            .map_err(|_| io::Error::other("initiator closed"))?;
        let mut s = self.lane().await?;
        let h = Header::new(false, addr, len, self.version);
        let r = async {
            s.write_all(&h.encode()).await?;
            if self.version == ProtoVersion::V2 {
                self.status(&mut s).await?;
            }
            let mut buf = vec![0u8; usize::try_from(len).map_err(|_| io::Error::other("length"))?];
            s.read_exact(&mut buf).await?;
            Ok(buf)
        }
        .await;
        if r.is_ok() {
            self.return_lane(s);
        }
        r
    }
}
