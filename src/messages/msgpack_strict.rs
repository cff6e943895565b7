//! A structural pre-check of untrusted msgpack before serde sees it.
//!
//! msgspec (what P runs) rejects things serde would quietly accept: a struct in array form, `bin`
//! where a `str` is expected. kvrecv applies the same rules to what it decodes, and bounds every
//! container by the bytes actually present so a forged length cannot make a decoder allocate.

#![forbid(unsafe_code)]

use rmp::Marker;
use thiserror::Error;

/// Nesting deeper than any message of the protocol needs.
const MAX_DEPTH: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub enum StrictError {
    #[error("Expected `object`, got `{0}`")]
    NotAMap(&'static str),
    #[error("truncated msgpack at byte {0}")]
    Truncated(usize),
    #[error("`bin` where only `str` is allowed, at byte {0}")]
    Binary(usize),
    #[error("unsupported msgpack type `{kind}` at byte {at}")]
    Unsupported { kind: &'static str, at: usize },
    #[error("nesting deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("{0} trailing bytes after the document")]
    Trailing(usize),
    #[error("`{key}` brings the listed ids to {total}, more than the {max} this message may name")]
    TooManyItems {
        key: &'static str,
        total: usize,
        max: usize,
    },
}

/// A cap on the arrays under some top-level keys, all together (e.g. the ids a reply names).
#[derive(Debug, Clone, Copy)]
pub struct ListCap<'a> {
    pub keys: &'a [&'static str],
    pub max_items: usize,
}

/// Check that `buf` is exactly one msgpack map containing no `bin`, `ext` or reserved markers.
pub fn check_map_document(buf: &[u8]) -> Result<(), StrictError> {
    check_map_document_capped(buf, None)
}

/// [`check_map_document`], and the arrays under `cap.keys` hold at most `cap.max_items`
/// elements together. Each array's length is checked at its header, before its elements are
/// walked or anything is decoded, so an oversized list costs nothing to refuse.
pub fn check_map_document_capped(buf: &[u8], cap: Option<ListCap<'_>>) -> Result<(), StrictError> {
    let first = *buf.first().ok_or(StrictError::Truncated(0))?;
    match Marker::from_u8(first) {
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {}
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            return Err(StrictError::NotAMap("array"))
        }
        _ => return Err(StrictError::NotAMap("scalar")),
    }
    let mut pos = 0;
    match cap {
        None => skip_value(buf, &mut pos, 0)?,
        Some(cap) => skip_top_map_capped(buf, &mut pos, cap)?,
    }
    if pos != buf.len() {
        return Err(StrictError::Trailing(buf.len() - pos));
    }
    Ok(())
}

/// Walk the top-level map, counting the elements of the capped arrays as their headers pass.
fn skip_top_map_capped(buf: &[u8], pos: &mut usize, cap: ListCap<'_>) -> Result<(), StrictError> {
    let at = *pos;
    *pos += 1;
    let n = match Marker::from_u8(buf[at]) {
        Marker::FixMap(n) => usize::from(n),
        Marker::Map16 => be_len(buf, pos, 2)?,
        Marker::Map32 => be_len(buf, pos, 4)?,
        _ => return Err(StrictError::NotAMap("scalar")),
    };
    if n.checked_mul(2).is_none_or(|e| e > buf.len() - *pos) {
        return Err(StrictError::Truncated(at));
    }
    let mut total = 0usize;
    for _ in 0..n {
        let key_at = *pos;
        skip_value(buf, pos, 1)?;
        let capped = str_payload(&buf[key_at..*pos])
            .and_then(|k| cap.keys.iter().find(|c| c.as_bytes() == k));
        if let Some(key) = capped {
            if let Some(len) = array_len(buf, *pos)? {
                total = total.saturating_add(len);
                if total > cap.max_items {
                    return Err(StrictError::TooManyItems {
                        key,
                        total,
                        max: cap.max_items,
                    });
                }
            }
        }
        skip_value(buf, pos, 1)?;
    }
    Ok(())
}

/// The bytes of a complete msgpack `str` value, or `None` if `v` is not a `str`.
fn str_payload(v: &[u8]) -> Option<&[u8]> {
    let skip = match Marker::from_u8(*v.first()?) {
        Marker::FixStr(_) => 1,
        Marker::Str8 => 2,
        Marker::Str16 => 3,
        Marker::Str32 => 5,
        _ => return None,
    };
    v.get(skip..)
}

/// The element count of the array starting at `at`, or `None` if the value there is not an array.
fn array_len(buf: &[u8], at: usize) -> Result<Option<usize>, StrictError> {
    let b = *buf.get(at).ok_or(StrictError::Truncated(at))?;
    let mut pos = at + 1;
    Ok(match Marker::from_u8(b) {
        Marker::FixArray(n) => Some(usize::from(n)),
        Marker::Array16 => Some(be_len(buf, &mut pos, 2)?),
        Marker::Array32 => Some(be_len(buf, &mut pos, 4)?),
        _ => None,
    })
}

pub(crate) fn take(buf: &[u8], pos: &mut usize, n: usize) -> Result<(), StrictError> {
    let end = pos.checked_add(n).ok_or(StrictError::Truncated(*pos))?;
    if end > buf.len() {
        return Err(StrictError::Truncated(*pos));
    }
    *pos = end;
    Ok(())
}

pub(crate) fn be_len(buf: &[u8], pos: &mut usize, n: usize) -> Result<usize, StrictError> {
    let start = *pos;
    take(buf, pos, n)?;
    Ok(buf[start..*pos]
        .iter()
        .fold(0usize, |acc, b| (acc << 8) | usize::from(*b)))
}

pub(crate) fn skip_value(buf: &[u8], pos: &mut usize, depth: usize) -> Result<(), StrictError> {
    if depth > MAX_DEPTH {
        return Err(StrictError::TooDeep);
    }
    let at = *pos;
    let b = *buf.get(at).ok_or(StrictError::Truncated(at))?;
    *pos += 1;
    let (items, per_item) = match Marker::from_u8(b) {
        Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
            return Ok(())
        }
        Marker::U8 | Marker::I8 => return take(buf, pos, 1),
        Marker::U16 | Marker::I16 => return take(buf, pos, 2),
        Marker::U32 | Marker::I32 | Marker::F32 => return take(buf, pos, 4),
        Marker::U64 | Marker::I64 | Marker::F64 => return take(buf, pos, 8),
        Marker::FixStr(n) => return take(buf, pos, usize::from(n)),
        Marker::Str8 => {
            let n = be_len(buf, pos, 1)?;
            return take(buf, pos, n);
        }
        Marker::Str16 => {
            let n = be_len(buf, pos, 2)?;
            return take(buf, pos, n);
        }
        Marker::Str32 => {
            let n = be_len(buf, pos, 4)?;
            return take(buf, pos, n);
        }
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => return Err(StrictError::Binary(at)),
        Marker::FixArray(n) => (usize::from(n), 1),
        Marker::Array16 => (be_len(buf, pos, 2)?, 1),
        Marker::Array32 => (be_len(buf, pos, 4)?, 1),
        Marker::FixMap(n) => (usize::from(n), 2),
        Marker::Map16 => (be_len(buf, pos, 2)?, 2),
        Marker::Map32 => (be_len(buf, pos, 4)?, 2),
        Marker::FixExt1
        | Marker::FixExt2
        | Marker::FixExt4
        | Marker::FixExt8
        | Marker::FixExt16
        | Marker::Ext8
        | Marker::Ext16
        | Marker::Ext32 => return Err(StrictError::Unsupported { kind: "ext", at }),
        Marker::Reserved => {
            return Err(StrictError::Unsupported {
                kind: "reserved",
                at,
            })
        }
    };
    // Every element takes at least one byte: a count larger than what is left is a lie.
    let elems = items
        .checked_mul(per_item)
        .ok_or(StrictError::Truncated(at))?;
    if elems > buf.len() - *pos {
        return Err(StrictError::Truncated(at));
    }
    for _ in 0..elems {
        skip_value(buf, pos, depth + 1)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_a_plain_map_and_rejects_array_form() {
        assert_eq!(check_map_document(&[0x81, 0xa1, b'a', 0x01]), Ok(()));
        assert_eq!(
            check_map_document(&[0x91, 0x01]),
            Err(StrictError::NotAMap("array"))
        );
        assert_eq!(
            check_map_document(&[0xc0]),
            Err(StrictError::NotAMap("scalar"))
        );
    }

    #[test]
    fn rejects_bin_anywhere_and_forged_lengths() {
        assert_eq!(
            check_map_document(&[0x81, 0xa1, b'a', 0xc4, 0x01, b'x']),
            Err(StrictError::Binary(3))
        );
        // map32 claiming four billion entries in a six-byte buffer
        assert!(matches!(
            check_map_document(&[0xdf, 0xff, 0xff, 0xff, 0xff, 0x00]),
            Err(StrictError::Truncated(_))
        ));
        assert_eq!(
            check_map_document(&[0x81, 0xa1, b'a', 0x01, 0x00]),
            Err(StrictError::Trailing(1))
        );
        assert_eq!(check_map_document(&[]), Err(StrictError::Truncated(0)));
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let mut doc = vec![0x81, 0xa1, b'a'];
        doc.extend(std::iter::repeat_n(0x91, 10_000));
        doc.push(0x00);
        assert_eq!(check_map_document(&doc), Err(StrictError::TooDeep));
    }

    #[test]
    fn capped_lists_are_refused_at_their_header_together() {
        const IDS: ListCap<'static> = ListCap {
            keys: &["ok_reqs", "err_reqs"],
            max_items: 3,
        };
        // {"ok_reqs":["a","b"],"err_reqs":["c"]}: 3 ids, at the cap
        let mut doc = vec![0x82, 0xa7];
        doc.extend(b"ok_reqs");
        doc.extend([0x92, 0xa1, b'a', 0xa1, b'b', 0xa8]);
        doc.extend(b"err_reqs");
        doc.extend([0x91, 0xa1, b'c']);
        assert_eq!(check_map_document_capped(&doc, Some(IDS)), Ok(()));
        // one more id in err_reqs: 4 > 3
        let mut over = doc[..doc.len() - 3].to_vec();
        over.extend([0x92, 0xa1, b'c', 0xa1, b'd']);
        assert_eq!(
            check_map_document_capped(&over, Some(IDS)),
            Err(StrictError::TooManyItems {
                key: "err_reqs",
                total: 4,
                max: 3
            })
        );
        assert_eq!(check_map_document(&over), Ok(()), "no cap, no limit");
        // an array32 header claiming 10^6 elements is refused by the cap before its body is
        // looked at (here there is none: without the cap it is a truncation)
        let mut big = vec![0x81, 0xa7];
        big.extend(b"ok_reqs");
        big.extend([0xdd, 0x00, 0x0f, 0x42, 0x40]);
        assert!(matches!(
            check_map_document_capped(&big, Some(IDS)),
            Err(StrictError::TooManyItems {
                total: 1_000_000,
                ..
            })
        ));
        // other keys and non-array values are not counted
        let mut other = vec![0x82, 0xa4];
        other.extend(b"zzzz");
        other.extend([0x94, 1, 2, 3, 4, 0xa7]);
        other.extend(b"ok_reqs");
        other.push(0xc0);
        assert_eq!(check_map_document_capped(&other, Some(IDS)), Ok(()));
    }
}
