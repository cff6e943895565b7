//! `kvrecv serve`'s output lines: `ready`, the data plane's part of `stats`, and the answers to
//! `drain` and `load_kv`.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use serde_json::{json, Value};

use crate::config::KvRecvConfig;
use crate::embed::DataPlaneHandle;
use crate::messages::{Interner, KvRequestRef, LoadMetas, ReqId, StepOutput};

/// The `ready` line: where P and the host reach this worker, and the layout it serves.
pub(super) fn ready_line(
    metrics: Option<SocketAddr>,
    cfg: &KvRecvConfig,
    endpoint: (&str, u32),
    data: &DataPlaneHandle,
    control_cpu: Option<usize>,
) -> Value {
    let (host, port) = endpoint;
    let regions: Vec<_> = cfg
        .layout
        .regions
        .iter()
        .zip(&data.region_bases)
        .map(|(r, b)| {
            json!({"layer_name": r.layer_name, "layer_index": r.layer_index, "group_index": r.group_index,
                   "block_len": r.block_len, "kv_block_len": r.kv_block_len, "base_addr": b})
        })
        .collect();
    let d = cfg.d_rank;
    let mut v = json!({
        "event": "ready", "version": env!("CARGO_PKG_VERSION"), "pid": std::process::id(),
        "endpoint": {"host": host, "port": port},
        "metrics": metrics.map(|a| a.to_string()), "control_cpu": control_cpu,
        "policy": cfg.policy.as_str(), "pull_timeout_ms": cfg.pull_timeout.as_millis() as u64,
        "d_rank": {"tp_size": d.tp_size, "tp_rank": d.tp_rank, "pp_size": d.pp_size, "pp_rank": d.pp_rank},
        "num_blocks": cfg.layout.num_blocks, "num_groups": cfg.layout.num_groups, "regions": regions,
    });
    if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), data_plane_ready(data)) {
        v.extend(extra);
    }
    v
}

/// The `ready` line's data-plane part.
fn data_plane_ready(data: &DataPlaneHandle) -> Value {
    let handshake =
        json!({"listen": data.handshake_addr.to_string(), "segment_name": data.segment_name});
    match &data.tcp {
        Some(t) => {
            let d = &data.descriptor;
            json!({
                "protocol": "tcp",
                "handshake": handshake,
                "data": {"listen": t.data_addr.to_string(), "host": d.tcp_data_host,
                         "port": d.tcp_data_port, "proto_version": d.tcp_proto_version},
                "permits": t.landing.permits().enabled(), "windows": data.windows,
            })
        }
        None => json!({
            "protocol": "rdma",
            "handshake": handshake,
            "devices": data.descriptor.devices.iter().map(|d| d.name.clone()).collect::<Vec<_>>(),
            "windows": data.windows,
        }),
    }
}

fn n(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// The `stats` answer's data-plane part.
pub(super) fn data_plane_stats(data: &DataPlaneHandle) -> Value {
    let h = &data.handshake;
    let handshake = json!({"metadata": n(&h.metadata), "notify": n(&h.notify), "probe": n(&h.probe),
                           "connection": n(&h.connection), "refused": n(&h.refused),
                           "refused_over_cap": n(&h.refused_over_cap),
                           "refused_per_address": n(&h.refused_per_address),
                           "evicted": n(&h.evicted)});
    let Some(t) = &data.tcp else {
        return json!({ "handshake": handshake });
    };
    let d = &t.stats;
    json!({
        "data": {"connections": n(&d.connections), "bytes_landed": n(&d.bytes_landed),
                 "writes_landed": n(&d.writes_landed), "reads_served": n(&d.reads_served),
                 "rejected_out_of_range": n(&d.rejected_out_of_range),
                 "rejected_bad_opcode": n(&d.rejected_bad_opcode),
                 "rejected_reads_off": n(&d.rejected_reads_off),
                 "rejected_no_permit": n(&d.rejected_no_permit),
                 "rejected_revoked": n(&d.rejected_revoked), "idle_timeouts": n(&d.idle_timeouts),
                 "v1_requests": n(&d.v1_requests), "broken": n(&d.broken),
                 "refused_over_cap": n(&d.refused_over_cap),
                 "refused_per_address": n(&d.refused_per_address),
                 "evicted": n(&d.evicted)},
        "handshake": handshake,
        "live_permits": t.landing.permits().live(),
    })
}

/// A `drain` answer: its keys in the order of every other answer's (serde_json's map sorts
/// them), its lists written straight from the step's (a drain hands over up to thousands of
/// ids; a `serde_json::Value` of them copied each one).
#[derive(Serialize)]
struct DrainLine<'a> {
    event: &'static str,
    failed_recving: &'a [ReqId],
    finished_recving: &'a [ReqId],
    invalid_block_ids: &'a [u32],
    line: u64,
}

/// The answer line to a `drain` (line `n`) that handed `s` over.
pub(super) fn drain_line(s: &StepOutput, n: u64) -> String {
    let line = DrainLine {
        event: "drain",
        failed_recving: &s.failed_recving,
        finished_recving: &s.finished_recving,
        invalid_block_ids: &s.invalid_block_ids,
        line: n,
    };
    serde_json::to_string(&line).unwrap_or_else(|e| {
        json!({"event": "error", "line": n, "error": format!("drain answer: {e}")}).to_string()
    })
}

/// A `load_kv` line's requests, each read into its metadata (or refused) here, where the line
/// is: the Receiver gets what it keeps, and no copy of an id is made only to be dropped.
pub(super) fn metas(requests: Vec<KvRequestRef<'_>>, interner: &mut Interner) -> LoadMetas {
    LoadMetas {
        requests: requests
            .into_iter()
            .map(|r| r.into_meta(interner))
            .collect(),
    }
}

/// The answer line to a `load_kv` (line `n`).
pub(super) fn load_kv_answer(
    r: Result<crate::messages::LoadKvReply, actix::MailboxError>,
    n: u64,
) -> serde_json::Value {
    match r {
        Ok(r) => {
            json!({"event": "load_kv", "line": n, "accepted": r.accepted, "awaiting": r.awaiting,
                   "rejected": r.rejected.iter().map(|e| e.to_string()).collect::<Vec<_>>()})
        }
        Err(e) => json!({"event": "error", "line": n, "error": e.to_string()}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drain's answer written from the step's lists is the line the `serde_json::Value` of
    /// them gave: the same keys in the same order, the same escapes.
    #[test]
    fn a_drain_line_is_what_the_json_value_gave() {
        let steps = [
            StepOutput::default(),
            StepOutput {
                finished_recving: vec![ReqId::from("d-1"), ReqId::from("q\"\\\nü")],
                failed_recving: vec![ReqId::from("d-2")],
                invalid_block_ids: vec![7, 0, u32::MAX],
            },
        ];
        for s in &steps {
            let want = json!({"event": "drain", "line": 42, "finished_recving": s.finished_recving,
                              "failed_recving": s.failed_recving, "invalid_block_ids": s.invalid_block_ids});
            assert_eq!(drain_line(s, 42), want.to_string());
        }
    }
}
