//! `kvrecv serve`'s input lines: one JSON command each, parsed where the line is (a `load_kv`'s
//! requests borrow it).

#![forbid(unsafe_code)]

use serde::Deserialize;

use crate::messages::KvRequestRef;

/// One input line (a `load_kv`'s requests borrow it).
pub(super) enum Op<'a> {
    LoadKv { requests: Vec<KvRequestRef<'a>> },
    Abort { req_id: String },
    Drain,
    Stats,
    Shutdown,
}

/// An input line as parsed: a plain struct, not an internally tagged enum, so that a `load_kv`
/// line's requests are parsed once, straight into [`KvRequestRef`]s that borrow the line (a
/// tagged enum buffers the whole object first).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpLine<'a> {
    op: OpName,
    #[serde(borrow)]
    requests: Option<Vec<KvRequestRef<'a>>>,
    req_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(try_from = "String")]
enum OpName {
    LoadKv,
    Abort,
    Drain,
    Stats,
    Shutdown,
}

impl TryFrom<String> for OpName {
    type Error = String;

    fn try_from(s: String) -> Result<OpName, String> {
        Ok(match s.as_str() {
            "load_kv" => OpName::LoadKv,
            "abort" => OpName::Abort,
            "drain" => OpName::Drain,
            "stats" => OpName::Stats,
            "shutdown" => OpName::Shutdown,
            _ => {
                return Err(format!(
                    "unknown op {s:?}; ops: load_kv, abort, drain, stats, shutdown"
                ))
            }
        })
    }
}

impl<'a> Op<'a> {
    pub(super) fn parse(line: &'a str) -> Result<Op<'a>, String> {
        if !line.trim_start().starts_with('{') {
            return Err("a line is one JSON object, e.g. {\"op\":\"drain\"}".into());
        }
        let l: OpLine = serde_json::from_str(line).map_err(|e| e.to_string())?;
        match (l.op, l.requests, l.req_id) {
            (OpName::LoadKv, Some(requests), None) => Ok(Op::LoadKv { requests }),
            (OpName::LoadKv, None, _) => Err("load_kv needs `requests`".into()),
            (OpName::LoadKv, Some(_), Some(_)) => Err("only abort takes `req_id`".into()),
            (OpName::Abort, None, Some(req_id))
                if !req_id.is_empty() && req_id.len() <= crate::messages::batch::MAX_ID_BYTES =>
            {
                Ok(Op::Abort { req_id })
            }
            (OpName::Abort, None, _) => Err(format!(
                "abort needs a non-empty `req_id` of at most {} bytes",
                crate::messages::batch::MAX_ID_BYTES
            )),
            (_, Some(_), _) => Err("only load_kv takes `requests`".into()),
            (_, _, Some(_)) => Err("only abort takes `req_id`".into()),
            (OpName::Drain, None, None) => Ok(Op::Drain),
            (OpName::Stats, None, None) => Ok(Op::Stats),
            (OpName::Shutdown, None, None) => Ok(Op::Shutdown),
        }
    }
}
