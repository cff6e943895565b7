//! msgpack conformance against Python msgspec 0.23, both directions (PROTOCOL.md §2.5).

#[path = "common/python.rs"]
mod python;

use std::io::Write;
use std::process::{Command, Stdio};

use kvrecv::messages::{MooncakeXferMetadata, MooncakeXferResponse, XferStatus};
use serde_json::{json, Value};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn rust_vectors() -> Vec<(&'static str, Vec<u8>, bool)> {
    let mut md = MooncakeXferMetadata::minimal("10.0.0.7", 15000, 1, 0);
    md.req_blocks
        .insert("d-1".into(), ("t-1".into(), vec![vec![5, 6]]));
    md.req_blocks.insert("d-2".into(), ("t-2".into(), vec![])); // empty pull
    md.kv_caches_base_addr = vec![0x7e00_0000_0000, 0x1f_ffff_ffff_ffff];
    md.block_lens = vec![4096, 4096];
    md.kv_block_lens = vec![4096, 2048];
    md.registered_layer_names = vec![
        "model.layers.0.self_attn.attn".into(),
        "model.layers.1.self_attn.attn".into(),
    ];
    md.registered_layer_indices = vec![0, 1];
    md.registered_group_indices = vec![0, 0];
    let mut pp = md.clone();
    pp.remote_pp_size = 2;
    let minimal = MooncakeXferMetadata::minimal("h", 1, 1, 0);
    let mut r = MooncakeXferResponse::new(XferStatus::Continue);
    r.ok_reqs = Some(vec!["a".into()]);
    r.err_reqs = Some(vec!["b".into()]);
    r.err_msg = Some("x".repeat(33));
    // Invalid documents kvrecv must never send; msgspec must refuse them too.
    let array_form = rmp_serde::to_vec(&minimal).unwrap();
    let mut nil_port = minimal.encode().unwrap();
    let at = nil_port
        .windows(12)
        .position(|w| w == b"\xabremote_port")
        .unwrap()
        + 12;
    nil_port[at] = 0xc0;
    vec![
        ("metadata", md.encode().unwrap(), true),
        ("metadata", pp.encode().unwrap(), true),
        ("metadata", minimal.encode().unwrap(), true),
        ("response", r.encode().unwrap(), true),
        (
            "response",
            MooncakeXferResponse::new(XferStatus::Finish)
                .encode()
                .unwrap(),
            true,
        ),
        ("metadata", array_form, false),
        ("metadata", nil_port, false),
    ]
    .into_iter()
    .chain(vectors_033())
    .collect()
}

/// vLLM 0.33.0 (layout ids), checked against its own struct definitions
/// (`tests/py/mooncake_structs_033.py`): the pulls kvrecv sends with and without the layout,
/// encoded as the Receiver encodes them (pre-encoded tails), and every response shape.
fn vectors_033() -> Vec<(&'static str, Vec<u8>, bool)> {
    use kvrecv::messages::{MetadataRef, MetadataTail, ReqBlocksRef, RequestMeta};
    let id = 0x5a5a_1234_5678_9abd_u64;
    let meta = RequestMeta::new("d-1", "t-1", "e", "http://b:1", &[vec![5u32, 6]]);
    let req_blocks = [("d-1", "t-1", meta.block_ids())];
    let names = ["model.layers.0.self_attn.attn".to_string()];
    let full = MetadataRef {
        remote_hostname: "10.0.0.7",
        remote_port: 15000,
        remote_tp_size: 1,
        remote_tp_rank: 0,
        req_blocks: &ReqBlocksRef(&req_blocks),
        kv_caches_base_addr: &[0x7e00_0000_0000],
        block_lens: &[4096],
        kv_block_lens: &[4096],
        registered_layer_names: &names,
        registered_layer_indices: &[0],
        registered_group_indices: &[0],
        remote_pp_size: 1,
        layout_id: id,
    };
    let bare = MetadataRef {
        kv_caches_base_addr: &[],
        block_lens: &[],
        kv_block_lens: &[],
        registered_layer_names: &[],
        registered_layer_indices: &[],
        registered_group_indices: &[],
        ..full.clone()
    };
    let with_tail = |md: &MetadataRef<'_>| {
        let tail = MetadataTail::of(md).unwrap().with_head(md).unwrap();
        md.encode_with(&tail).unwrap()
    };
    let response = |status, ok: &[&str], err: &[&str], msg: Option<&str>, layout_id| {
        let list = |v: &[&str]| (!v.is_empty()).then(|| v.iter().map(|s| s.to_string()).collect());
        MooncakeXferResponse {
            status,
            ok_reqs: list(ok),
            err_reqs: list(err),
            err_msg: msg.map(str::to_owned),
            layout_id,
        }
        .encode()
        .unwrap()
    };
    let mut bad_status = response(XferStatus::Finish, &[], &[], None, 0);
    *bad_status.last_mut().unwrap() = 4;
    vec![
        ("metadata033", with_tail(&full), true),
        ("metadata033", with_tail(&bare), true),
        ("metadata033", bare.encode().unwrap(), true),
        (
            "response033",
            response(XferStatus::Continue, &["a"], &[], None, id),
            true,
        ),
        (
            "response033",
            response(XferStatus::Finish, &["a"], &["b"], Some("x"), id),
            true,
        ),
        (
            "response033",
            response(
                XferStatus::LayoutMiss,
                &[],
                &[],
                Some("Mooncake KV layout 0x1 from h:1 is not cached."),
                0,
            ),
            true,
        ),
        ("response033", bad_status, false),
    ]
}

#[test]
fn rust_and_msgspec_agree_byte_for_byte_both_ways() {
    let Some(py) = python::python() else { return };
    let vectors = rust_vectors();
    let input = json!({"rust": vectors.iter().map(|(k, b, _)| json!({"kind": k, "hex": hex(b)})).collect::<Vec<_>>()});
    let mut child = Command::new(py)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/py/msgspec_conformance.py"
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python starts");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "python failed");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();

    // Rust -> msgspec: valid documents decode and re-encode to the same bytes; invalid ones are
    // refused by msgspec as well.
    for ((kind, bytes, valid), res) in vectors.iter().zip(v["rust"].as_array().unwrap()) {
        assert_eq!(
            res["ok"].as_bool().unwrap(),
            *valid,
            "{kind} {}: {}",
            hex(bytes),
            res["error"]
        );
        if *valid {
            assert_eq!(
                res["reencoded"].as_str().unwrap(),
                hex(bytes),
                "{kind} differs after msgspec round trip"
            );
        }
    }

    // msgspec -> Rust: the same acceptance, and byte-identical re-encoding.
    let py_vectors = v["python"].as_array().unwrap();
    assert!(py_vectors.len() >= 20);
    for pv in py_vectors {
        let (kind, what, valid) = (
            pv["kind"].as_str().unwrap(),
            pv["what"].as_str().unwrap(),
            pv["valid"].as_bool().unwrap(),
        );
        let bytes = unhex(pv["hex"].as_str().unwrap());
        let reencoded = match kind {
            "response" | "response033" => {
                MooncakeXferResponse::decode(&bytes).map(|r| r.encode().unwrap())
            }
            _ => MooncakeXferMetadata::decode(&bytes).map(|m| m.encode().unwrap()),
        };
        // 3 is not a 0.32 status, but kvrecv reads replies of both generations: a 0.32 P never
        // sends it, and for 0.33 it is LAYOUT_MISS (checked against 0.33's own enum below).
        if kind == "response" && what == "status 3" {
            assert!(reencoded.is_ok(), "LAYOUT_MISS is read");
            continue;
        }
        match (valid, reencoded) {
            (true, Ok(b)) => {
                // Keys kvrecv does not model (replay checkpoints, unknown keys) are dropped.
                if !what.contains("unknown")
                    && !what.contains("replay")
                    && !what.contains("nil, empty")
                {
                    assert_eq!(hex(&b), hex(&bytes), "{what}: Rust re-encoding differs");
                }
            }
            (true, Err(e)) => panic!("{what}: Rust refused a valid msgspec document: {e}"),
            (false, Ok(_)) => panic!("{what}: Rust accepted what msgspec rejects"),
            (false, Err(_)) => {}
        }
    }
}
