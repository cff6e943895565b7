//! Property tests of every decoder of untrusted input (bytes from P, from a bootstrap server, or
//! from anyone who reaches the handshake daemon or the data server): random bytes and random
//! mutations of valid encodings never panic, and the memory a decoder allocates stays within a
//! small multiple of its input plus a constant. A counting `#[global_allocator]` (per thread, so
//! tests running in parallel do not disturb each other) measures the peak of each decode.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use kvrecv::actors::topology::{DRank, EngineTopology};
use kvrecv::layout::KvLayout;
use kvrecv::messages::bootstrap::{parse_query, DpEntry, QueryResponse};
use kvrecv::messages::handshake::{HandShakeDesc, SegmentDescriptor};
use kvrecv::messages::msgpack_strict::check_map_document;
use kvrecv::messages::{
    MooncakeXferMetadata, MooncakeXferResponse, PeerId, RequestMeta, XferStatus,
};
use kvrecv::rdma::handshake_daemon::{read_frame, Daemon, MAX_FRAME};
use kvrecv::rdma::tcp::wire::{Header, ProtoVersion, HEADER_LEN, STATUS_OK};
use kvrecv::rdma::{Landing, PullWindow, TargetConfig, TcpTarget};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ---------------------------------------------------------------------------------------------
// Counting allocator

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    // `try_with`: the allocator also runs while thread-locals are being torn down.
    let _ = LIVE.try_with(|live| {
        let v = live.get() + delta;
        live.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            track(l.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            track(l.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        track(-(l.size() as isize));
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            // A moving realloc holds both blocks for a moment.
            track(new as isize);
            track(-(l.size() as isize));
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Run `f` and return its result and the peak of bytes allocated on this thread meanwhile
/// (what `f` still holds at the end, its result included, counts).
fn peak<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let top = PEAK.with(Cell::get) - base;
    (r, usize::try_from(top).unwrap_or(0))
}

/// The allocation bound: `factor` bytes per input byte plus a constant.
fn within(what: &str, input: &[u8], got: usize, factor: usize, constant: usize) {
    let cap = factor * input.len() + constant;
    assert!(
        got <= cap,
        "{what}: {got} bytes allocated for a {}-byte input (cap {cap}); input {:02x?}",
        input.len(),
        &input[..input.len().min(64)]
    );
}

// ---------------------------------------------------------------------------------------------
// Inputs: random bytes, and random edits of valid encodings

#[path = "common/edits.rs"]
mod edits;
use edits::{apply, edit};

fn random_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

/// Either random bytes or an edited valid encoding drawn from `valid`.
fn untrusted(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        1 => random_bytes(512),
        3 => (valid, proptest::collection::vec(edit(), 0..6)).prop_map(|(v, e)| apply(v, &e)),
    ]
}

fn ids() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec("[a-z0-9-]{0,12}", 0..6)
}

fn valid_response() -> impl Strategy<Value = Vec<u8>> {
    (
        0u8..3,
        proptest::option::of(ids()),
        proptest::option::of(ids()),
        proptest::option::of("[ -~]{0,40}"),
    )
        .prop_map(|(st, ok, err, msg)| {
            MooncakeXferResponse {
                status: match st {
                    0 => XferStatus::Finish,
                    1 => XferStatus::Continue,
                    _ => XferStatus::Error,
                },
                ok_reqs: ok,
                err_reqs: err,
                err_msg: msg,
                layout_id: 0,
            }
            .encode()
            .expect("encodable")
        })
}

fn valid_metadata() -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::collection::vec(
            (
                "[a-z0-9-]{1,8}",
                proptest::collection::vec(any::<u64>(), 0..4),
            ),
            0..4,
        ),
        proptest::collection::vec(any::<u64>(), 0..3),
    )
        .prop_map(|(reqs, bases)| {
            let mut m = MooncakeXferMetadata::minimal("10.0.0.7", 15000, 1, 0);
            for (r, blocks) in reqs {
                m.req_blocks
                    .insert(r.clone(), (format!("t-{r}"), vec![blocks]));
            }
            m.block_lens = bases.iter().map(|_| 4096).collect();
            m.kv_block_lens = m.block_lens.clone();
            m.kv_caches_base_addr = bases;
            m.encode().expect("encodable")
        })
}

fn frame(ty: Option<u8>, body: &[u8]) -> Vec<u8> {
    let mut f = ((body.len() + usize::from(ty.is_some())) as u64)
        .to_le_bytes()
        .to_vec();
    f.extend(ty);
    f.extend_from_slice(body);
    f
}

fn valid_handshake_frame() -> impl Strategy<Value = Vec<u8>> {
    let conn = HandShakeDesc {
        local_nic_path: "10.0.0.1:15000@mlx5_0".into(),
        peer_nic_path: "10.0.0.7:15001@mlx5_1".into(),
        ..Default::default()
    };
    let mut conn = serde_json::to_vec(&conn).unwrap();
    conn.push(b'\n');
    let bodies: Vec<(Option<u8>, Vec<u8>)> = vec![
        (Some(0), conn.clone()),
        (Some(1), br#"{"name":"10.0.0.1:15000","protocol":"tcp"}"#.to_vec()),
        (Some(2), b"{\"name\":\"p\",\"notify_msg\":\"x\"}\n".to_vec()),
        (Some(3), b"{}\n".to_vec()),
        (None, conn),
        (
            None,
            br#"{"local_gid":"fe:80:00:00:00:00:00:00:00:00:00:00:00:00:00:01","local_lid":3,"qp_num":[1,2],"ready_ack":true}"#
                .to_vec(),
        ),
    ];
    proptest::sample::select(bodies).prop_map(|(t, b)| frame(t, &b))
}

fn valid_descriptor_json() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec((1u64..1 << 50, 1u64..1 << 30), 0..4).prop_map(|bufs| {
        SegmentDescriptor {
            buffers: bufs
                .into_iter()
                .map(|(addr, length)| kvrecv::messages::handshake::BufferDesc {
                    addr,
                    length,
                    name: "10.0.0.7:15000".into(),
                    ..Default::default()
                })
                .collect(),
            devices: vec![],
            name: "10.0.0.7:15000".into(),
            priority_matrix: Default::default(),
            protocol: "tcp".into(),
            rdma_server_name: String::new(),
            tcp_data_host: Some("10.0.0.7".into()),
            tcp_data_port: 16000,
            tcp_proto_version: 2,
            timestamp: "1.5".into(),
        }
        .to_wire()
    })
}

fn valid_query() -> impl Strategy<Value = Vec<u8>> {
    (1u32..4, 1u32..3, any::<bool>()).prop_map(|(tp, pp, sizes)| {
        let q: QueryResponse = [(
            "0".to_string(),
            DpEntry {
                engine_id: "e0".into(),
                worker_addr: (0..tp)
                    .map(|t| {
                        (
                            t.to_string(),
                            (0..pp)
                                .map(|p| {
                                    (
                                        p.to_string(),
                                        format!("tcp://10.0.0.5:{}", 40000 + t * 10 + p),
                                    )
                                })
                                .collect(),
                        )
                    })
                    .collect(),
                tp_size: sizes.then_some(tp),
                pp_size: sizes.then_some(pp),
            },
        )]
        .into_iter()
        .collect();
        serde_json::to_vec(&q).unwrap()
    })
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Decoders

// A msgpack string or list element becomes a `String` (24 bytes) per input byte at worst
// (`ok_reqs` of 10,000 empty strings measured 23x).
const MSGPACK_FACTOR: usize = 32;
// JSON objects become B-tree nodes: a one-entry map of strings costs a whole node (~0.5 KiB)
// for 12 input bytes (`"0":{"0":""}`); a /query body made only of those measured ~40x.
const JSON_FACTOR: usize = 64;
const CONSTANT: usize = 16 * 1024;

proptest! {
    #![proptest_config(config(384))]

    #[test]
    fn msgpack_reply_decoder_and_strict_check(b in untrusted(valid_response())) {
        let (strict, n) = peak(|| check_map_document(&b));
        within("check_map_document", &b, n, 0, 0);
        let (r, n) = peak(|| MooncakeXferResponse::decode(&b));
        within("MooncakeXferResponse::decode", &b, n, MSGPACK_FACTOR, CONSTANT);
        // The strict check is a precondition of a successful decode.
        if r.is_ok() {
            prop_assert!(strict.is_ok());
        }
    }

    #[test]
    fn msgpack_metadata_decoder(b in untrusted(valid_metadata())) {
        let (_, n) = peak(|| MooncakeXferMetadata::decode(&b));
        within("MooncakeXferMetadata::decode", &b, n, MSGPACK_FACTOR, CONSTANT);
    }

    #[test]
    fn handshake_frames_and_their_json(b in untrusted(valid_handshake_frame())) {
        let daemon = daemon();
        let (frame, n) = peak(|| futures::executor::block_on(read_frame(&mut b.as_slice())));
        within("read_frame", &b, n, 4, 256);
        if let Ok(f) = frame {
            prop_assert!(f.body.len() as u64 <= MAX_FRAME);
            let (reply, n) = peak(|| daemon.reply(f.ty, &f.body));
            within("Daemon::reply", &b, n, JSON_FACTOR, CONSTANT);
            prop_assert_eq!(reply.last(), Some(&b'\n'));
            let (_, n) = peak(|| kvrecv::rdma::verbs::HandShakeDesc::from_json(&f.body));
            within("verbs::HandShakeDesc::from_json", &b, n, JSON_FACTOR, CONSTANT);
            let (_, n) = peak(|| serde_json::from_slice::<HandShakeDesc>(&f.body));
            within("HandShakeDesc", &b, n, JSON_FACTOR, CONSTANT);
        }
    }

    #[test]
    fn segment_descriptor_json(b in untrusted(valid_descriptor_json())) {
        let (_, n) = peak(|| serde_json::from_slice::<SegmentDescriptor>(&b));
        within("SegmentDescriptor", &b, n, JSON_FACTOR, CONSTANT);
    }

    #[test]
    fn bootstrap_query_json_and_topology(b in untrusted(valid_query())) {
        let (topo, n) = peak(|| {
            parse_query(&b).map(|q| {
                q.values()
                    .map(|e| {
                        EngineTopology::from_query("http://b:1", &e.engine_id, &q)
                            .and_then(|t| t.peers_for(DRank::default()))
                    })
                    .collect::<Vec<_>>()
            })
        });
        within("parse_query + from_query", &b, n, JSON_FACTOR, CONSTANT);
        drop(topo);
    }

    #[test]
    fn data_header_decoder(raw in any::<[u8; HEADER_LEN]>()) {
        let (h, n) = peak(|| Header::decode(&raw));
        prop_assert_eq!(n, 0);
        prop_assert_eq!(h.version() == ProtoVersion::V2, raw[16] & 0x80 != 0);
        prop_assert_eq!(h.op(), raw[16] & 0x7f);
        // Padding is ignored: the header re-encodes to the same first 17 bytes.
        prop_assert_eq!(&h.encode()[..17], &raw[..17]);
    }
}

fn daemon() -> Daemon {
    let d = SegmentDescriptor {
        buffers: vec![],
        devices: vec![],
        name: "127.0.0.1:1".into(),
        priority_matrix: Default::default(),
        protocol: "tcp".into(),
        rdma_server_name: String::new(),
        tcp_data_host: None,
        tcp_data_port: 2,
        tcp_proto_version: 2,
        timestamp: String::new(),
    };
    Daemon::new(&d)
}

/// A frame announcing the largest allowed length, with only a few bytes behind it, costs a few
/// bytes: the buffer follows the bytes that arrive, not the announced length.
#[test]
fn a_forged_handshake_length_does_not_allocate_it() {
    let mut b = MAX_FRAME.to_le_bytes().to_vec();
    b.extend_from_slice(b"\x01{}");
    let (r, n) = peak(|| futures::executor::block_on(read_frame(&mut b.as_slice())));
    assert!(r.is_err());
    within("read_frame", &b, n, 4, 256);
}

// ---------------------------------------------------------------------------------------------
// The data server over a real socket

static PANICS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static WATCHED: Cell<bool> = const { Cell::new(false) };
}

/// Count panics on this thread (a panic in a server task would otherwise only end that task,
/// silently; other tests' threads are not watched).
fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if WATCHED.with(Cell::get) {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            prev(info);
        }));
    });
    WATCHED.with(|w| w.set(true));
}

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 512;

/// Requests aimed at an open window (so some are admitted and land), then edited.
fn data_stream(bases: Vec<u64>) -> impl Strategy<Value = Vec<u8>> {
    let one = (
        0..bases.len(),
        0u64..BLOCKS * BLOCK,
        prop_oneof![
            Just(0u64),
            1u64..64,
            1u64..2 * BLOCK,
            BLOCK..300 * BLOCK,
            any::<u64>()
        ],
        prop_oneof![
            Just(0x81u8),
            Just(0x80),
            Just(0x01),
            Just(0x00),
            any::<u8>()
        ],
        0usize..256,
    )
        .prop_map(move |(region, off, size, opcode, payload)| {
            let mut v = Header {
                size,
                addr: bases[region].wrapping_add(off),
                opcode,
            }
            .encode()
            .to_vec();
            v.extend(std::iter::repeat_n(0xa5u8, payload.min(size as usize)));
            v
        });
    let valid = proptest::collection::vec(one, 1..4).prop_map(|v| v.concat());
    prop_oneof![
        1 => random_bytes(256),
        3 => (valid, proptest::collection::vec(edit(), 0..4)).prop_map(|(v, e)| apply(v, &e)),
    ]
}

#[test]
fn data_server_survives_random_and_mutated_requests() {
    count_panics();
    // Current-thread runtime: the server's tasks run on this thread, so the counting allocator
    // sees what the server allocates for each connection.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut cfg = TargetConfig::loopback(KvLayout::uniform(2, BLOCK, BLOCKS as u32));
    cfg.windows = Some(4);
    cfg.idle_timeout = Duration::from_secs(5);
    let t = rt.block_on(TcpTarget::start(cfg)).unwrap();
    // Most of the window is admitted, so large READs and WRITEs get past the checks.
    let req = Arc::new(RequestMeta::new(
        "r",
        "t",
        "e",
        "http://127.0.0.1:1",
        &[(1..400).collect::<Vec<u32>>()],
    ));
    let peer = PeerId::new("tcp://127.0.0.1:1");
    let bases = t.landing().open_pull(&PullWindow {
        pull_id: 1,
        peer: &peer,
        requests: std::slice::from_ref(&req),
    });
    let addr = t.data_addr();
    let panics_before = PANICS.load(Ordering::SeqCst);
    let mut runner = proptest::test_runner::TestRunner::new(config(64));
    runner
        .run(&data_stream(bases.to_vec()), |b| {
            let (_, n) = peak(|| {
                rt.block_on(async {
                    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                    // The server may close early (a rejection): later writes can fail.
                    let _ = s.write_all(&b).await;
                    let _ = s.shutdown().await;
                    // Drain what comes back (READ bytes, status frames) into a fixed buffer, so
                    // only the server's allocations grow with the request.
                    let drain = async {
                        let mut buf = [0u8; 4096];
                        while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                    };
                    let r = tokio::time::timeout(Duration::from_secs(20), drain).await;
                    assert!(r.is_ok(), "the server neither answered nor closed");
                })
            });
            // The server reads payloads straight into destination memory and serves READs in
            // 64 KiB chunks; the rest is the connection's task and the socket.
            within("data server connection", &b, n, 4, 256 * 1024);
            Ok(())
        })
        .unwrap();
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        panics_before,
        "a server task panicked"
    );
    // Still serving: a valid v2 write into the open window lands and is acknowledged.
    rt.block_on(async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&Header::new(true, bases[0] + BLOCK, 16, ProtoVersion::V2).encode())
            .await
            .unwrap();
        s.write_all(&[7u8; 16]).await.unwrap();
        assert_eq!(s.read_u64_le().await.unwrap(), STATUS_OK);
    });
}
