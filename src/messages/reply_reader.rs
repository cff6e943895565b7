//! A reply from P read in one pass over its bytes (`XferReplyRef::decode_bounded`).
//!
//! It accepts and refuses what the strict check followed by serde did (and what msgspec
//! decodes on P's side): one msgpack map, no `bin`, `ext` or reserved marker anywhere, nesting
//! no deeper than the strict check allows, no trailing bytes; `status` an int in {0, 1, 2, 3};
//! `layout_id` (vLLM 0.33) any int, a negative one read as 0;
//! `ok_reqs` / `err_reqs` nil or an array of `str`, their lengths together capped at their
//! headers before anything is read; `err_msg` nil or a `str`; a known key twice is refused,
//! unknown keys are skipped. One difference, on purpose: a key must be a `str` (serde took an
//! int key as a field's index; msgspec refuses it). The ids and the message borrow the frame.
//! The strict check and serde walked a reply twice; a reply is read on every pull, so this is
//! on the receive path's hot side (docs/PERFORMANCE.md, tenth round).

#![forbid(unsafe_code)]

use rmp::Marker;

use super::msgpack_strict::{be_len, skip_value, take, StrictError};
use super::wire::{IdList, WireError, XferReplyRef, XferStatus};

/// The keys whose arrays count against the cap on ids.
const STATUS: &[u8] = b"status";
const OK_REQS: &[u8] = b"ok_reqs";
const ERR_REQS: &[u8] = b"err_reqs";
const ERR_MSG: &[u8] = b"err_msg";
const LAYOUT_ID: &[u8] = b"layout_id";

impl<'a> XferReplyRef<'a> {
    /// Decode a reply that came off a socket, refusing one whose `ok_reqs` and `err_reqs` name
    /// more than `max_ids` ids together. The count is read from the list headers before
    /// anything is decoded, so a hostile reply (a million ids under the frame cap) is cheap to
    /// refuse. Never panics. (Here, beside its reader, so that `wire` does not import back the
    /// module that reads its types.)
    pub fn decode_bounded(buf: &'a [u8], max_ids: usize) -> Result<Self, WireError> {
        read_reply(buf, max_ids)
    }
}

/// Read `buf` as a reply naming at most `max_ids` ids in `ok_reqs` and `err_reqs` together.
fn read_reply(buf: &[u8], max_ids: usize) -> Result<XferReplyRef<'_>, WireError> {
    let mut r = Reader { buf, pos: 0 };
    let n = r.map_header()?;
    let (mut status, mut ok, mut err, mut msg, mut layout) = (None, None, None, None, None);
    let mut ids = 0usize;
    for _ in 0..n {
        let key = r.key()?;
        match key {
            STATUS => {
                once(&status, "status")?;
                status = Some(r.status()?);
            }
            OK_REQS | ERR_REQS => {
                let (slot, name) = if key == OK_REQS {
                    (&mut ok, "ok_reqs")
                } else {
                    (&mut err, "err_reqs")
                };
                once(slot, name)?;
                *slot = Some(r.id_list(name, &mut ids, max_ids)?);
            }
            ERR_MSG => {
                once(&msg, "err_msg")?;
                msg = Some(r.nil_or(|r| r.str("err_msg"))?);
            }
            LAYOUT_ID => {
                once(&layout, "layout_id")?;
                // No id D draws is negative: a negative echo acks nothing.
                layout = Some(u64::try_from(r.int("layout_id")?).unwrap_or(0));
            }
            _ => skip_value(buf, &mut r.pos, 1)?,
        }
    }
    if r.pos != buf.len() {
        return Err(StrictError::Trailing(buf.len() - r.pos).into());
    }
    Ok(XferReplyRef {
        status: status.ok_or_else(|| syntax("missing field `status`".into()))?,
        ok_reqs: ok.flatten(),
        err_reqs: err.flatten(),
        err_msg: msg.flatten(),
        layout_id: layout.unwrap_or(0),
    })
}

/// A known key may come once.
fn once<T>(seen: &Option<T>, key: &str) -> Result<(), WireError> {
    match seen {
        Some(_) => Err(syntax(format!("duplicate field `{key}`"))),
        None => Ok(()),
    }
}

fn syntax(msg: String) -> WireError {
    WireError::Decode(rmp_serde::decode::Error::Syntax(msg))
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn marker(&mut self) -> Result<(Marker, usize), StrictError> {
        let at = self.pos;
        let b = *self.buf.get(at).ok_or(StrictError::Truncated(at))?;
        self.pos += 1;
        Ok((Marker::from_u8(b), at))
    }

    fn map_header(&mut self) -> Result<usize, WireError> {
        let (m, at) = self.marker()?;
        let n = match m {
            Marker::FixMap(n) => usize::from(n),
            Marker::Map16 => be_len(self.buf, &mut self.pos, 2)?,
            Marker::Map32 => be_len(self.buf, &mut self.pos, 4)?,
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
                return Err(StrictError::NotAMap("array").into())
            }
            _ => return Err(StrictError::NotAMap("scalar").into()),
        };
        // Every entry takes at least two bytes: a count larger than what is left is a lie.
        if n.checked_mul(2)
            .is_none_or(|e| e > self.buf.len() - self.pos)
        {
            return Err(StrictError::Truncated(at).into());
        }
        Ok(n)
    }

    /// The payload of a `str`, or `None` (nothing consumed but the marker) if the value is
    /// of another type: the caller decides.
    fn str_payload(&mut self) -> Result<Result<&'a [u8], (Marker, usize)>, StrictError> {
        let (m, at) = self.marker()?;
        let n = match m {
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 => be_len(self.buf, &mut self.pos, 1)?,
            Marker::Str16 => be_len(self.buf, &mut self.pos, 2)?,
            Marker::Str32 => be_len(self.buf, &mut self.pos, 4)?,
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => return Err(StrictError::Binary(at)),
            other => return Ok(Err((other, at))),
        };
        let start = self.pos;
        take(self.buf, &mut self.pos, n)?;
        Ok(Ok(&self.buf[start..self.pos]))
    }

    /// A map key: a `str`, compared as bytes.
    fn key(&mut self) -> Result<&'a [u8], WireError> {
        match self.str_payload()? {
            Ok(k) => Ok(k),
            Err((m, at)) => {
                // Refused whatever it is, but a malformed one is reported as malformed.
                self.pos = at;
                skip_value(self.buf, &mut self.pos, 1)?;
                Err(syntax(format!("a key must be a str, got {m:?}")))
            }
        }
    }

    /// A `str` value of `field`, UTF-8.
    fn str(&mut self, field: &str) -> Result<&'a str, WireError> {
        match self.str_payload()? {
            Ok(b) => std::str::from_utf8(b)
                .map_err(|_| syntax(format!("`{field}`: invalid UTF-8 in a str"))),
            Err((m, at)) => self.wrong_type(m, at, field, "a str"),
        }
    }

    /// A wrong type for `field`: refused, with whatever is malformed in it reported first.
    fn wrong_type<T>(
        &mut self,
        m: Marker,
        at: usize,
        field: &str,
        expected: &str,
    ) -> Result<T, WireError> {
        self.pos = at;
        skip_value(self.buf, &mut self.pos, 1)?;
        Err(syntax(format!(
            "`{field}`: invalid type {m:?}, expected {expected}"
        )))
    }

    /// `None` for nil, else what `read` reads.
    fn nil_or<T>(
        &mut self,
        read: impl FnOnce(&mut Self) -> Result<T, WireError>,
    ) -> Result<Option<T>, WireError> {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(None);
        }
        read(self).map(Some)
    }

    /// `status`: any msgpack int in {0, 1, 2, 3}.
    fn status(&mut self) -> Result<XferStatus, WireError> {
        match self.int("status")? {
            0 => Ok(XferStatus::Finish),
            1 => Ok(XferStatus::Continue),
            2 => Ok(XferStatus::Error),
            3 => Ok(XferStatus::LayoutMiss),
            v => Err(syntax(format!(
                "`status`: invalid value {v}, expected one of 0, 1, 2, 3"
            ))),
        }
    }

    /// Any msgpack int, in any width, as `field`'s value.
    fn int(&mut self, field: &str) -> Result<i128, WireError> {
        let (m, at) = self.marker()?;
        let mut be = |n: usize| -> Result<u64, StrictError> {
            let start = self.pos;
            take(self.buf, &mut self.pos, n)?;
            Ok(self.buf[start..self.pos]
                .iter()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
        };
        let v: i128 = match m {
            Marker::FixPos(v) => i128::from(v),
            Marker::FixNeg(v) => i128::from(v),
            Marker::U8 => i128::from(be(1)?),
            Marker::U16 => i128::from(be(2)?),
            Marker::U32 => i128::from(be(4)?),
            Marker::U64 => i128::from(be(8)?),
            Marker::I8 => i128::from(be(1)? as u8 as i8),
            Marker::I16 => i128::from(be(2)? as u16 as i16),
            Marker::I32 => i128::from(be(4)? as u32 as i32),
            Marker::I64 => i128::from(be(8)? as i64),
            other => return self.wrong_type(other, at, field, "an int"),
        };
        Ok(v)
    }

    /// `ok_reqs` / `err_reqs`: nil, or an array of `str` whose length, added to `ids`, stays
    /// within `max` (checked at the header, before an element is read).
    fn id_list(
        &mut self,
        field: &'static str,
        ids: &mut usize,
        max: usize,
    ) -> Result<Option<IdList<'a>>, WireError> {
        self.nil_or(|r| {
            let (m, at) = r.marker()?;
            let n = match m {
                Marker::FixArray(n) => usize::from(n),
                Marker::Array16 => be_len(r.buf, &mut r.pos, 2)?,
                Marker::Array32 => be_len(r.buf, &mut r.pos, 4)?,
                other => return r.wrong_type(other, at, field, "an array of str"),
            };
            *ids = ids.saturating_add(n);
            if *ids > max {
                return Err(StrictError::TooManyItems {
                    key: field,
                    total: *ids,
                    max,
                }
                .into());
            }
            if n > r.buf.len() - r.pos {
                return Err(StrictError::Truncated(at).into());
            }
            let mut v = IdList::with_capacity(n);
            for _ in 0..n {
                v.push(r.str(field)?);
            }
            Ok(v)
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rmp::encode as w;

    use super::*;

    /// A msgpack value to encode, each kind in every encoding a peer might choose.
    #[derive(Debug, Clone)]
    enum V {
        Nil,
        Bool(bool),
        /// An int and the width to write it with (0 = the most compact).
        Int(i64, u8),
        Uint(u64, u8),
        F64(f64),
        Str(Vec<u8>),
        Bin(Vec<u8>),
        Ext,
        Array(Vec<V>),
        Map(Vec<(V, V)>),
    }

    fn put(buf: &mut Vec<u8>, v: &V) {
        match v {
            V::Nil => w::write_nil(buf).unwrap(),
            V::Bool(b) => w::write_bool(buf, *b).unwrap(),
            V::Int(i, width) => match width {
                1 => w::write_i8(buf, *i as i8).unwrap(),
                2 => w::write_i16(buf, *i as i16).unwrap(),
                3 => w::write_i32(buf, *i as i32).unwrap(),
                4 => w::write_i64(buf, *i).unwrap(),
                _ => {
                    w::write_sint(buf, *i).unwrap();
                }
            },
            V::Uint(u, width) => match width {
                1 => w::write_u8(buf, *u as u8).unwrap(),
                2 => w::write_u16(buf, *u as u16).unwrap(),
                3 => w::write_u32(buf, *u as u32).unwrap(),
                4 => w::write_u64(buf, *u).unwrap(),
                _ => {
                    w::write_uint(buf, *u).unwrap();
                }
            },
            V::F64(f) => w::write_f64(buf, *f).unwrap(),
            V::Str(s) => {
                w::write_str_len(buf, s.len() as u32).unwrap();
                buf.extend_from_slice(s);
            }
            V::Bin(b) => w::write_bin(buf, b).unwrap(),
            V::Ext => w::write_ext_meta(buf, 1, 3).map(|_| buf.push(0)).unwrap(),
            V::Array(items) => {
                w::write_array_len(buf, items.len() as u32).unwrap();
                items.iter().for_each(|i| put(buf, i));
            }
            V::Map(entries) => {
                w::write_map_len(buf, entries.len() as u32).unwrap();
                for (k, v) in entries {
                    put(buf, k);
                    put(buf, v);
                }
            }
        }
    }

    fn text() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            "[a-z0-9-]{0,6}".prop_map(String::into_bytes),
            Just(b"status".to_vec()),
            Just(b"ok_reqs".to_vec()),
            Just(b"layout_id".to_vec()),
            proptest::collection::vec(any::<u8>(), 0..4),
        ]
    }

    fn scalar() -> impl Strategy<Value = V> {
        prop_oneof![
            Just(V::Nil),
            any::<bool>().prop_map(V::Bool),
            (-3i64..4, 0u8..5).prop_map(|(i, w)| V::Int(i, w)),
            (any::<i64>(), 0u8..5).prop_map(|(i, w)| V::Int(i, w)),
            (0u64..4, 0u8..5).prop_map(|(u, w)| V::Uint(u, w)),
            (any::<u64>(), 0u8..5).prop_map(|(u, w)| V::Uint(u, w)),
            Just(V::F64(1.0)),
            text().prop_map(V::Str),
            Just(V::Bin(b"r1".to_vec())),
            Just(V::Ext),
        ]
    }

    fn value() -> impl Strategy<Value = V> {
        scalar().prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(V::Array),
                proptest::collection::vec((inner.clone(), inner), 0..3).prop_map(V::Map),
            ]
        })
    }

    /// An id list: mostly strs, now and then something else in it.
    fn ids() -> impl Strategy<Value = V> {
        prop_oneof![
            4 => proptest::collection::vec(text().prop_map(V::Str), 0..5).prop_map(V::Array),
            1 => proptest::collection::vec(scalar(), 0..3).prop_map(V::Array),
            1 => scalar(),
        ]
    }

    /// A reply's top-level entries: the known keys with plausible and implausible values,
    /// unknown keys, now and then a key twice or a key that is not a str.
    fn entry() -> impl Strategy<Value = (V, V)> {
        let key = |k: &str| V::Str(k.as_bytes().to_vec());
        prop_oneof![
            4 => prop_oneof![(0u64..5, 0u8..5).prop_map(|(u, w)| V::Uint(u, w)), scalar()]
                .prop_map(move |v| (key("status"), v)),
            2 => scalar().prop_map(move |v| (key("layout_id"), v)),
            3 => ids().prop_map(move |v| (key("ok_reqs"), v)),
            3 => ids().prop_map(move |v| (key("err_reqs"), v)),
            2 => scalar().prop_map(move |v| (key("err_msg"), v)),
            2 => (text(), value()).prop_map(|(k, v)| (V::Str(k), v)),
            1 => (scalar(), scalar()),
        ]
    }

    /// A reply P could send: `status` once, the lists of strs or nil or absent, a message,
    /// unknown keys, in any order.
    fn reply() -> impl Strategy<Value = Vec<(V, V)>> {
        let key = |k: &str| V::Str(k.as_bytes().to_vec());
        let list = || {
            proptest::option::of(prop_oneof![
                Just(V::Nil),
                proptest::collection::vec(text().prop_map(V::Str), 0..5).prop_map(V::Array),
            ])
        };
        (
            (0u64..4, 0u8..5),
            list(),
            list(),
            proptest::option::of(prop_oneof![Just(V::Nil), text().prop_map(V::Str)]),
            proptest::collection::vec(("[a-z_]{1,8}", value()), 0..2),
            any::<proptest::sample::Index>(),
            proptest::option::of((any::<u64>(), 0u8..5)),
        )
            .prop_map(move |((st, w), ok, err, msg, unknown, rot, id)| {
                let mut e = vec![(key("status"), V::Uint(st, w))];
                e.extend(id.map(|(u, w)| (key("layout_id"), V::Uint(u, w))));
                e.extend(ok.map(|v| (key("ok_reqs"), v)));
                e.extend(err.map(|v| (key("err_reqs"), v)));
                e.extend(msg.map(|v| (key("err_msg"), v)));
                e.extend(
                    unknown
                        .into_iter()
                        .map(|(k, v)| (V::Str(k.into_bytes()), v)),
                );
                let n = e.len();
                e.rotate_left(rot.index(n));
                e
            })
    }

    fn document() -> impl Strategy<Value = Vec<u8>> {
        let doc =
            prop_oneof![reply(), proptest::collection::vec(entry(), 0..6)].prop_map(|entries| {
                let mut b = Vec::new();
                put(&mut b, &V::Map(entries));
                b
            });
        // As made, or cut, extended or with one byte changed.
        (doc, 0u8..6, any::<usize>(), any::<u8>()).prop_map(|(mut b, how, at, byte)| {
            let at = at % (b.len() + 1);
            match how {
                3 => b.truncate(at),
                4 => b.push(byte),
                5 if at < b.len() => b[at] = byte,
                _ => {}
            }
            b
        })
    }

    /// Whether a top-level key of `b` is not a `str` (where the two readers differ on
    /// purpose: serde took an int key as a field index).
    fn has_non_str_key(b: &[u8]) -> bool {
        let mut r = Reader { buf: b, pos: 0 };
        let Ok(n) = r.map_header() else { return false };
        for _ in 0..n {
            match r.str_payload() {
                Ok(Ok(_)) => {}
                Ok(Err(_)) => return true,
                Err(_) => return false,
            }
            if skip_value(b, &mut r.pos, 1).is_err() {
                return false;
            }
        }
        false
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The one-pass reader accepts exactly what the strict check and serde accepted, and
        /// reads the same reply from it, for any cap on the ids.
        #[test]
        fn reads_what_the_strict_check_and_serde_read(b in document(), cap in 0usize..12) {
            let one_pass = read_reply(&b, cap);
            let reference = XferReplyRef::decode_by_serde(&b, cap);
            match (&one_pass, &reference) {
                (Ok(a), Ok(r)) => prop_assert_eq!(a, r),
                (Err(_), Err(_)) => {}
                (Err(_), Ok(_)) if has_non_str_key(&b) => {}
                _ => prop_assert!(false, "{:02x?}: one pass {:?}, reference {:?}", b, one_pass, reference),
            }
        }
    }

    #[test]
    fn a_reply_is_read_in_place() {
        let mut b = Vec::new();
        put(
            &mut b,
            &V::Map(vec![
                (V::Str(b"err_msg".to_vec()), V::Str(b"boom".to_vec())),
                (V::Str(b"status".to_vec()), V::Uint(2, 3)),
                (V::Str(b"x".to_vec()), V::Array(vec![V::Nil])),
                (
                    V::Str(b"err_reqs".to_vec()),
                    V::Array(vec![V::Str(b"r1".to_vec())]),
                ),
                (V::Str(b"ok_reqs".to_vec()), V::Nil),
            ]),
        );
        let r = read_reply(&b, 1).unwrap();
        assert_eq!(r.status, XferStatus::Error);
        assert_eq!(
            (r.ok(), r.err(), r.err_msg),
            (&[][..], &["r1"][..], Some("boom"))
        );
        assert!(matches!(
            read_reply(&b, 0),
            Err(WireError::Structure(StrictError::TooManyItems {
                key: "err_reqs",
                ..
            }))
        ));
    }

    #[test]
    fn a_known_key_twice_an_int_key_and_a_missing_status_are_refused() {
        let twice = [
            0x82, 0xa6, b's', b't', b'a', b't', b'u', b's', 0x00, 0xa6, b's', b't', b'a', b't',
            b'u', b's', 0x01,
        ];
        assert!(read_reply(&twice, 8)
            .unwrap_err()
            .to_string()
            .contains("duplicate field `status`"));
        let int_key = [0x81, 0x00, 0x00];
        assert!(read_reply(&int_key, 8)
            .unwrap_err()
            .to_string()
            .contains("key must be a str"));
        let none = [0x80];
        assert!(read_reply(&none, 8)
            .unwrap_err()
            .to_string()
            .contains("missing field `status`"));
    }
}
