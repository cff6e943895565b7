//! The prefill simulator seen from a bare DEALER: P's answers to bad metadata, to a D rank it
//! is not paired with, and to a multi-frame request (PROTOCOL.md §2.1, §2.5, §2.6).

use std::time::Duration;

use kvrecv::control::AsyncSocket;
use kvrecv::messages::{MooncakeXferMetadata, MooncakeXferResponse, XferStatus};
use kvrecv::sim::{PrefillSim, SimConfig};

const SAFETY: Duration = Duration::from_secs(20);

fn dealer(ctx: &zmq::Context, addr: &str) -> AsyncSocket {
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.connect(addr).unwrap();
    AsyncSocket::new(s).unwrap()
}

async fn ask(d: &mut AsyncSocket, frames: &[&[u8]]) -> MooncakeXferResponse {
    d.send_multipart(frames).await.unwrap();
    let reply = tokio::time::timeout(SAFETY, d.recv_multipart())
        .await
        .expect("an answer")
        .unwrap();
    assert_eq!(reply.len(), 1);
    MooncakeXferResponse::decode(&reply[0]).unwrap()
}

fn metadata(tp_size: u32, tp_rank: u32) -> MooncakeXferMetadata {
    let mut m = MooncakeXferMetadata::minimal("127.0.0.1", 15000, tp_size, tp_rank);
    m.req_blocks
        .insert("d-1".into(), ("t-1".into(), vec![vec![1, 2]]));
    m.kv_caches_base_addr = vec![0x7e00_0000_0000];
    m.block_lens = vec![4096];
    m.kv_block_lens = vec![4096];
    m.registered_layer_names = vec!["model.layers.0.self_attn.attn".into()];
    m.registered_layer_indices = vec![0];
    m.registered_group_indices = vec![0];
    m
}

#[tokio::test]
async fn undecodable_metadata_gets_error_with_the_decoder_message() {
    let s = PrefillSim::start(SimConfig::default()).await.unwrap();
    let ctx = zmq::Context::new();
    let mut d = dealer(&ctx, s.worker(0, 0).addr());
    // The array form of the struct (rmp-serde's positional encoding), which msgspec rejects.
    let r = ask(&mut d, &[&[0x91, 0xa1, b'h']]).await;
    assert_eq!(r.status, XferStatus::Error);
    assert!(r.err_msg.as_deref().is_some_and(|m| !m.is_empty()));
    assert!(r.err().is_empty());
    // A good one on a fresh DEALER is served.
    let mut d = dealer(&ctx, s.worker(0, 0).addr());
    let r = ask(&mut d, &[&metadata(1, 0).encode().unwrap()]).await;
    assert_eq!(
        (r.status, r.ok()),
        (XferStatus::Finish, &["d-1".to_string()][..])
    );
}

#[tokio::test]
async fn unpaired_d_rank_gets_one_peer_wide_error() {
    let s = PrefillSim::start(SimConfig {
        tp_size: 2,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let ctx = zmq::Context::new();
    // D TP2 rank 1 pairs with P rank 1 only.
    let mut d = dealer(&ctx, s.worker(0, 0).addr());
    let r = ask(&mut d, &[&metadata(2, 1).encode().unwrap()]).await;
    assert_eq!(r.status, XferStatus::Error);
    assert!(r.err_msg.unwrap().contains("not paired"));
    let mut d = dealer(&ctx, s.worker(1, 0).addr());
    assert_eq!(
        ask(&mut d, &[&metadata(2, 1).encode().unwrap()])
            .await
            .status,
        XferStatus::Finish
    );
}

#[tokio::test]
async fn multi_frame_request_stops_the_workers_side_channel_like_vllm() {
    let s = PrefillSim::start(SimConfig::default()).await.unwrap();
    let ctx = zmq::Context::new();
    let mut d = dealer(&ctx, s.worker(0, 0).addr());
    // What a REQ socket would send: an empty delimiter frame, then the payload.
    d.send_multipart(&[b"", &metadata(1, 0).encode().unwrap()])
        .await
        .unwrap();
    let w = s.worker(0, 0);
    tokio::time::timeout(SAFETY, async {
        while w.is_running() {
            tokio::time::sleep(Duration::from_millis(5)).await; // polling a state, not ordering
        }
    })
    .await
    .expect("the worker's sender loop exits");
}
