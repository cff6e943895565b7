//! A flood of idle connections (`repro --soak`): a host that opens sockets to D's handshake
//! daemon and data server and never speaks, as a TE leaking connections (or anyone on the
//! network) would. D's caps must close such connections before they keep a P out (DESIGN.md §6).

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::{TcpSocket, TcpStream};

/// Loopback address the flood comes from: another host than the P workers (127.0.0.1), so the
/// per-address caps apply to it and not to them.
pub const FLOOD_FROM: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

/// Open up to `per_target` idle connections to each of `targets` from `from`, hold them for
/// `hold`, then close them. Returns how many were opened; a refused or failed connect ends that
/// target's flood early (D at its cap refusing is a result, not an error).
pub async fn hold_idle(
    targets: Vec<SocketAddr>,
    per_target: usize,
    from: IpAddr,
    hold: Duration,
) -> usize {
    let mut held: Vec<TcpStream> = Vec::with_capacity(per_target * targets.len());
    for to in targets {
        for _ in 0..per_target {
            match connect_from(from, to).await {
                Ok(s) => held.push(s),
                Err(e) => {
                    tracing::debug!(%to, error = %e, "soak flood: connect failed");
                    break;
                }
            }
        }
    }
    let opened = held.len();
    tokio::time::sleep(hold).await;
    drop(held);
    opened
}

async fn connect_from(from: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = match to {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn holds_the_connections_it_opened_until_the_end() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to = listener.local_addr().unwrap();
        let flood = tokio::spawn(hold_idle(
            vec![to],
            3,
            FLOOD_FROM,
            Duration::from_millis(50),
        ));
        let mut peers = Vec::new();
        for _ in 0..3 {
            let (s, peer) = listener.accept().await.unwrap();
            assert_eq!(peer.ip(), FLOOD_FROM, "from the flood's own address");
            peers.push(s);
        }
        assert_eq!(flood.await.unwrap(), 3);
        // Closed at the end: every accepted socket reads EOF.
        for s in peers {
            let mut buf = [0u8; 1];
            s.readable().await.unwrap();
            assert_eq!(s.try_read(&mut buf).unwrap(), 0);
        }
    }
}
