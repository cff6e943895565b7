//! The HandShakeDesc JSON of a type-0 (Connection) frame, both directions (PROTOCOL.md §6).
//!
//! Fields are declared in alphabetical order because serde writes them in declaration order and
//! the daemon's frames must be compact JSON with alphabetical keys (PROTOCOL.md §5.1, §7.2), as
//! jsoncpp writes them on the Mooncake side.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// One HandShakeDesc. Unknown keys (`efa_addr`, `cxi_addr`, `jetty_num`, `barex_port`, …) are
/// ignored when decoding and never emitted.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct HandShakeDesc {
    /// Sender's port GID as 16 `:`-joined hex bytes; empty = "use my segment descriptor".
    pub local_gid: String,
    /// Sender's port LID.
    pub local_lid: u16,
    /// Sender's NIC path, `server@nic`.
    pub local_nic_path: String,
    /// Opaque, build-specific; kept as Mooncake sends it (always present, usually empty).
    pub payload: String,
    /// The NIC path the sender wants on the receiver.
    pub peer_nic_path: String,
    /// Mooncake fills it on the active side only; kept for round-tripping.
    pub protocol: String,
    /// Sender's QP numbers, one per QP of the endpoint.
    pub qp_num: Vec<u32>,
    /// Absent = no confirmation round offered; `false` = offered / asked for; `true` = the
    /// confirmation itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_ack: Option<bool>,
    /// Non-empty = rejection.
    pub reply_msg: String,
}

/// A HandShakeDesc body that cannot be used. Mooncake answers these with `ERR_INVALID_ARGUMENT`
/// (a JSON value of the wrong type included); kvrecv answers with a `reply_msg`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HandShakeDescError {
    #[error("malformed handshake JSON: {0}")]
    /// Not a JSON object, or a value of the wrong type.
    Malformed(String),
}

impl HandShakeDesc {
    /// Decode one frame body (JSON; a trailing `\n` is fine). Values of the wrong type (a string
    /// LID, a negative or fractional QP number, `null`) are errors, never panics.
    pub fn from_json(body: &[u8]) -> Result<HandShakeDesc, HandShakeDescError> {
        let malformed = |e: serde_json::Error| HandShakeDescError::Malformed(e.to_string());
        let value: serde_json::Value = serde_json::from_slice(body).map_err(malformed)?;
        // serde would also accept a struct in array form (`[]`); Mooncake requires an object.
        if !value.is_object() {
            return Err(HandShakeDescError::Malformed(
                "expected a JSON object".into(),
            ));
        }
        serde_json::from_value(value).map_err(malformed)
    }

    /// Encode for a reply frame: compact, alphabetical keys, terminated by `\n`.
    pub fn to_json_line(&self) -> Vec<u8> {
        // Serializing plain strings, integers and bools into a Vec cannot fail.
        let mut out = serde_json::to_vec(self).unwrap_or_default();
        out.push(b'\n');
        out
    }

    /// A rejection reply: only `reply_msg` is meaningful to the initiator.
    pub fn rejection(reply_msg: String) -> HandShakeDesc {
        HandShakeDesc {
            reply_msg,
            ..HandShakeDesc::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_compact_alphabetical_with_newline() {
        let d = HandShakeDesc {
            local_gid: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07".into(),
            local_lid: 0,
            local_nic_path: "10.0.0.7:15000@mlx5_0".into(),
            peer_nic_path: "10.0.0.5:16001@mlx5_1".into(),
            qp_num: vec![257, 258],
            ready_ack: Some(false),
            ..HandShakeDesc::default()
        };
        let line = String::from_utf8(d.to_json_line()).unwrap();
        assert_eq!(
            line,
            "{\"local_gid\":\"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07\",\"local_lid\":0,\
             \"local_nic_path\":\"10.0.0.7:15000@mlx5_0\",\"payload\":\"\",\
             \"peer_nic_path\":\"10.0.0.5:16001@mlx5_1\",\"protocol\":\"\",\"qp_num\":[257,258],\
             \"ready_ack\":false,\"reply_msg\":\"\"}\n"
        );
        assert_eq!(HandShakeDesc::from_json(line.as_bytes()).unwrap(), d);
    }

    #[test]
    fn ready_ack_absent_is_not_emitted_and_decodes_to_none() {
        let line = HandShakeDesc::default().to_json_line();
        assert!(!String::from_utf8_lossy(&line).contains("ready_ack"));
        let d = HandShakeDesc::from_json(br#"{"qp_num":[1,2]}"#).unwrap();
        assert_eq!(d.ready_ack, None);
        assert_eq!(d.qp_num, vec![1, 2]);
        assert_eq!(d.local_nic_path, "");
    }

    #[test]
    fn ignores_unknown_keys() {
        let d = HandShakeDesc::from_json(
            br#"{"efa_addr":"x","jetty_num":[1],"barex_port":3,"qp_num":[9],"ready_ack":true}"#,
        )
        .unwrap();
        assert_eq!((d.qp_num, d.ready_ack), (vec![9], Some(true)));
    }

    #[test]
    fn wrong_types_and_garbage_are_typed_errors() {
        for bad in [
            &b""[..],
            b"{",
            b"[]",
            b"null",
            b"\xff\xfe",
            br#"{"qp_num":"1"}"#,
            br#"{"qp_num":[-1]}"#,
            br#"{"qp_num":[1.5]}"#,
            br#"{"qp_num":[4294967296]}"#,
            br#"{"local_lid":"1"}"#,
            br#"{"local_lid":65536}"#,
            br#"{"local_gid":null}"#,
            br#"{"ready_ack":"yes"}"#,
            br#"{"reply_msg":7}"#,
        ] {
            assert!(
                matches!(
                    HandShakeDesc::from_json(bad),
                    Err(HandShakeDescError::Malformed(_))
                ),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
