//! The 16-byte port GID and its Mooncake text form: 16 two-digit hex bytes joined by `:`
//! (PROTOCOL.md §6). The same text appears in the segment descriptor's `devices[].gid` and in a
//! HandShakeDesc's `local_gid`.

#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// A port GID (IPv6-shaped, big-endian bytes as the NIC reports them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

/// Why a GID string was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GidParseError {
    #[error("GID must have 16 ':'-separated bytes, got {0}")]
    WrongByteCount(usize),
    #[error("GID byte {index} is not a two-digit hex number: {text:?}")]
    BadByte { index: usize, text: String },
}

impl Gid {
    /// True for the all-zero GID, which a port reports for an unpopulated table entry.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

}

impl fmt::Display for Gid {
    /// Lower-case hex, as Mooncake prints it (`%02x`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for Gid {
    type Err = GidParseError;

    /// Strict: exactly 16 parts of exactly two hex digits. Mooncake's own parser is lenient, but
    /// a GID that does not round-trip would program a wrong destination into the QP, which then
    /// fails only at the first write; refusing at the handshake gives the peer a clear reason.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = s.split(':').collect();
        if parts.len() != 16 {
            return Err(GidParseError::WrongByteCount(parts.len()));
        }
        let mut raw = [0u8; 16];
        for (index, (part, out)) in parts.iter().zip(raw.iter_mut()).enumerate() {
            let ok = part.len() == 2 && part.bytes().all(|b| b.is_ascii_hexdigit());
            *out = match (ok, u8::from_str_radix(part, 16)) {
                (true, Ok(v)) => v,
                _ => {
                    return Err(GidParseError::BadByte {
                        index,
                        text: (*part).to_owned(),
                    })
                }
            };
        }
        Ok(Gid(raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROCE_V2: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:07";

    #[test]
    fn prints_sixteen_lowercase_two_digit_bytes() {
        let mut raw = [0u8; 16];
        raw[0] = 0xFE;
        raw[1] = 0x80;
        raw[15] = 0x0A;
        assert_eq!(
            Gid(raw).to_string(),
            "fe:80:00:00:00:00:00:00:00:00:00:00:00:00:00:0a"
        );
    }

    #[test]
    fn parses_what_it_prints_and_accepts_upper_case() {
        let g: Gid = ROCE_V2.parse().unwrap();
        assert_eq!(g.to_string(), ROCE_V2);
        let upper: Gid = ROCE_V2.to_uppercase().parse().unwrap();
        assert_eq!(upper, g);
    }

    #[test]
    fn refuses_malformed_text() {
        assert_eq!("".parse::<Gid>(), Err(GidParseError::WrongByteCount(1)));
        assert_eq!(
            "00:11".parse::<Gid>(),
            Err(GidParseError::WrongByteCount(2))
        );
        let one_digit = ROCE_V2.replacen("00", "0", 1);
        assert!(matches!(
            one_digit.parse::<Gid>(),
            Err(GidParseError::BadByte { index: 0, .. })
        ));
        let not_hex = ROCE_V2.replace("0a", "zz");
        assert!(matches!(
            not_hex.parse::<Gid>(),
            Err(GidParseError::BadByte { index: 12, .. })
        ));
        let signed = ROCE_V2.replacen("00", "+0", 1);
        assert!(signed.parse::<Gid>().is_err());
    }
}
