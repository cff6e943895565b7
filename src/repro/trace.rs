//! The request trace the demo replays (Mooncake FAST'25 conversation trace, Apache-2.0; see
//! `data/README.md`).

#![forbid(unsafe_code)]

use std::path::Path;

use serde::Deserialize;
use thiserror::Error;

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival, milliseconds from the start of the trace.
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot read trace {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("trace line {line}: {source}")]
    Line {
        line: usize,
        source: serde_json::Error,
    },
    #[error("trace is empty")]
    Empty,
}

/// The trace shipped with the crate.
pub const BUILTIN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/mooncake_conversation.jsonl"
);

/// Read up to `limit` requests (all when `None`), sorted by arrival.
pub fn load(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRequest>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text, limit)
}

/// Parse JSON lines (blank lines skipped).
///
/// ```
/// let t = kvrecv::repro::trace::parse(
///     "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [0, 1]}\n", None).unwrap();
/// assert_eq!(t[0].blocks(512), 2);
/// ```
pub fn parse(text: &str, limit: Option<usize>) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(line).map_err(|source| TraceError::Line {
                line: i + 1,
                source,
            })?,
        );
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    out.sort_by_key(|r: &TraceRequest| r.timestamp);
    Ok(out)
}

impl TraceRequest {
    /// Destination blocks needed at `block_tokens` tokens per block (at least one).
    pub fn blocks(&self, block_tokens: u64) -> usize {
        self.input_length.div_ceil(block_tokens.max(1)).max(1) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_trace_loads_sorted() {
        let t = load(Path::new(BUILTIN), Some(100)).unwrap();
        assert_eq!(t.len(), 100);
        assert!(t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        assert!(t.iter().all(|r| r.input_length > 0));
    }

    #[test]
    fn a_bad_line_names_its_number() {
        let e = parse(
            "{\"timestamp\":1,\"input_length\":1,\"output_length\":1}\nnot json\n",
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        assert!(matches!(parse("\n\n", None), Err(TraceError::Empty)));
    }
}
