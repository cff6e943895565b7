//! A shared string behind one thin pointer: what many requests repeat (a P engine's id and its
//! bootstrap address, interned by [`Interner`](super::Interner)) costs each request 8 bytes, where an
//! `Arc<str>` (a fat pointer) cost 16. Two fields of [`RequestMeta`](super::RequestMeta) so, and its `Arc`
//! falls to mimalloc's 80-byte class from the 96-byte one (docs/PERFORMANCE.md, "Where the
//! bytes per in-flight request go").

#![forbid(unsafe_code)]

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// An immutable string shared by reference count, one pointer wide. Compares, hashes and
/// orders as its text.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(unnameable_types)] // opaque outside: see `crate::actors` (module doc)
pub struct SharedStr(Arc<Box<str>>);

impl SharedStr {
    /// Whether `a` and `b` are one allocation (interned together).
    pub fn ptr_eq(a: &SharedStr, b: &SharedStr) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl Deref for SharedStr {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for SharedStr {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for SharedStr {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl From<&str> for SharedStr {
    fn from(s: &str) -> Self {
        SharedStr(Arc::new(s.into()))
    }
}

impl From<String> for SharedStr {
    fn from(s: String) -> Self {
        SharedStr(Arc::new(s.into_boxed_str()))
    }
}

impl PartialEq<str> for SharedStr {
    fn eq(&self, other: &str) -> bool {
        **self.0 == *other
    }
}

impl PartialEq<&str> for SharedStr {
    fn eq(&self, other: &&str) -> bool {
        **self.0 == **other
    }
}

impl fmt::Display for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self.0, f)
    }
}

impl serde::Serialize for SharedStr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn one_pointer_wide() {
        assert_eq!(std::mem::size_of::<SharedStr>(), 8);
    }

    #[test]
    fn compares_hashes_and_orders_as_its_text() {
        use std::collections::HashSet;
        let (a, b) = (SharedStr::from("x"), SharedStr::from(String::from("x")));
        assert!(a == b && !SharedStr::ptr_eq(&a, &b));
        assert!(SharedStr::ptr_eq(&a, &a.clone()));
        let (x, y) = (SharedStr::from("a"), SharedStr::from("b"));
        assert!(x < y);
        let set: HashSet<SharedStr> = [a].into_iter().collect();
        assert!(set.contains("x"), "found by its text");
        assert_eq!(format!("{b} {b:?}"), "x \"x\"");
    }
}
