//! Random edits of valid encodings, for the tests that feed untrusted input to a decoder or a
//! process: set, insert, remove a byte, truncate, forge a length.

use proptest::prelude::*;

/// One edit of a valid encoding.
#[derive(Debug, Clone)]
pub enum Edit {
    Set(usize, u8),
    Insert(usize, u8),
    Remove(usize),
    Truncate(usize),
    /// Overwrite 4 bytes with a large big-endian count (forged container / string lengths).
    Forge(usize, u32),
}

pub fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<usize>().prop_map(Edit::Remove),
        any::<usize>().prop_map(Edit::Truncate),
        (any::<usize>(), any::<u32>()).prop_map(|(i, n)| Edit::Forge(i, n)),
    ]
}

pub fn apply(mut v: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let n = v.len();
        match *e {
            Edit::Set(i, b) if n > 0 => v[i % n] = b,
            Edit::Insert(i, b) => v.insert(i % (n + 1), b),
            Edit::Remove(i) if n > 0 => {
                v.remove(i % n);
            }
            Edit::Truncate(i) => v.truncate(i % (n + 1)),
            Edit::Forge(i, c) if n >= 4 => {
                let at = i % (n - 3);
                v[at..at + 4].copy_from_slice(&c.to_be_bytes());
            }
            _ => {}
        }
    }
    v
}
