//! Tests of the load batch: parsing, validation and the interner.

#![forbid(unsafe_code)]

use super::*;

/// A request read in place is the request read whole: the same keys accepted and refused,
/// the same metadata or the same error, escapes included; plain ids borrow the line.
#[test]
fn a_request_read_in_place_validates_as_the_owned_one() {
    let ok = r#""transfer_id":"t","remote_engine_id":"e","remote_bootstrap_addr":"http://h:1/""#;
    let long = "x".repeat(MAX_ID_BYTES + 1);
    let lines = [
        format!(r#"{{"req_id":"d-1",{ok},"block_ids":[[1,2]]}}"#),
        format!(r#"{{"req_id":"d\"q\u00e9",{ok},"block_ids":[[3]],"extra":{{"a":1}}}}"#),
        format!(r#"{{"req_id":"d-2",{ok},"block_ids":[]}}"#),
        format!(r#"{{"req_id":"d-3",{ok},"block_ids":[[4,4]]}}"#),
        r#"{"req_id":"","transfer_id":"t","block_ids":[[1]]}"#.to_string(),
        r#"{"req_id":"d-4","transfer_id":null,"remote_engine_id":"e","remote_bootstrap_addr":"http://h:1","block_ids":[[1]]}"#.to_string(),
        r#"{"req_id":"d-5","transfer_id":"t","remote_engine_id":"","remote_bootstrap_addr":"http://h:1","block_ids":[[1]]}"#.to_string(),
        r#"{"req_id":"d-6","transfer_id":"t","remote_engine_id":"e","remote_bootstrap_addr":"ftp://h","block_ids":[[1]]}"#.to_string(),
        format!(r#"{{"req_id":"{long}",{ok},"block_ids":[[1]]}}"#),
        format!(r#"{{"req_id":"d-7",{ok}}}"#),
        format!(r#"{{"req_id":7,{ok},"block_ids":[[1]]}}"#),
        format!(r#"{{"req_id":"d-8",{ok},"block_ids":[["1"]]}}"#),
        r#"{"req_id":"d-9","transfer_id":"t\n\u00e9","remote_engine_id":"e","remote_bootstrap_addr":"http://h:1","block_ids":[[5]]}"#.to_string(),
    ];
    let (mut a, mut b) = (Interner::default(), Interner::default());
    for line in &lines {
        let owned = serde_json::from_str::<KvRequest>(line);
        let view = serde_json::from_str::<KvRequestRef<'_>>(line);
        assert_eq!(owned.is_ok(), view.is_ok(), "{line}");
        if let (Ok(owned), Ok(view)) = (owned, view) {
            assert_eq!(owned.into_meta(&mut a), view.into_meta(&mut b), "{line}");
        }
    }
    let plain: KvRequestRef<'_> = serde_json::from_str(&lines[0]).unwrap();
    assert!(matches!(plain.req_id, Cow::Borrowed(_)));
    for id in [
        plain.transfer_id,
        plain.remote_engine_id,
        plain.remote_bootstrap_addr,
    ] {
        assert!(matches!(id, Some(Cow::Borrowed(_))));
    }
    let escaped: KvRequestRef<'_> = serde_json::from_str(&lines[1]).unwrap();
    assert!(matches!(escaped.req_id, Cow::Owned(_)) && escaped.req_id == "d\"qé");
}

/// Block lists are read at exactly their length (no slack for `into_meta` to reallocate
/// away), and anything but lists of u32 lists is refused.
#[test]
fn block_ids_are_read_exactly_and_strictly() {
    let many: Vec<u32> = (0..40).collect();
    let line = format!(r#"{{"req_id":"d","block_ids":[[1,2,3],[],{many:?}]}}"#);
    let r: KvRequest = serde_json::from_str(&line).unwrap();
    assert_eq!(r.block_ids, vec![vec![1, 2, 3], vec![], many]);
    assert_eq!(r.block_ids.capacity(), 3);
    for g in &r.block_ids {
        assert_eq!(g.capacity(), g.len());
    }
    for bad in [
        r#"[1,2]"#,
        r#"[[1,"2"]]"#,
        r#"[[-1]]"#,
        r#"[[4294967296]]"#,
        r#""x""#,
        r#"[[1],{}]"#,
    ] {
        let line = format!(r#"{{"req_id":"d","block_ids":{bad}}}"#);
        assert!(
            serde_json::from_str::<KvRequest>(&line).is_err(),
            "{bad} was accepted"
        );
    }
}

fn req() -> KvRequest {
    KvRequest {
        req_id: "d-1".into(),
        transfer_id: Some("t-1".into()),
        remote_engine_id: Some("e0".into()),
        remote_bootstrap_addr: Some("http://127.0.0.1:8998/".into()),
        block_ids: vec![vec![1, 2]],
    }
}

#[test]
fn missing_keys_are_refused_with_the_key_name() {
    for (field, mut r) in [
        (
            "transfer_id",
            KvRequest {
                transfer_id: None,
                ..req()
            },
        ),
        (
            "remote_engine_id",
            KvRequest {
                remote_engine_id: None,
                ..req()
            },
        ),
        (
            "remote_bootstrap_addr",
            KvRequest {
                remote_bootstrap_addr: None,
                ..req()
            },
        ),
    ] {
        let err = r.validate().unwrap_err();
        assert_eq!(
            err,
            BatchError::MissingField {
                req_id: "d-1".into(),
                field
            }
        );
        r.req_id.clear();
    }
}

#[test]
fn ids_and_addresses_over_the_limit_are_refused_with_the_field_named() {
    let long = "x".repeat(MAX_ID_BYTES + 1);
    let fits = "y".repeat(MAX_ID_BYTES);
    let host = format!("http://{}:1", "h".repeat(MAX_ID_BYTES));
    for (field, r) in [
        (
            "req_id",
            KvRequest {
                req_id: long.clone(),
                ..req()
            },
        ),
        (
            "transfer_id",
            KvRequest {
                transfer_id: Some(long.clone()),
                ..req()
            },
        ),
        (
            "remote_engine_id",
            KvRequest {
                remote_engine_id: Some(long.clone()),
                ..req()
            },
        ),
        (
            "remote_bootstrap_addr",
            KvRequest {
                remote_bootstrap_addr: Some(host.clone()),
                ..req()
            },
        ),
    ] {
        match r.validate() {
            Err(BatchError::TooLong {
                field: f, req_id, ..
            }) => {
                assert_eq!(f, field);
                assert!(req_id.len() <= 64, "the error carries a cut id");
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    let at_limit = KvRequest {
        req_id: fits.clone(),
        transfer_id: Some(fits.clone()),
        remote_engine_id: Some(fits),
        ..req()
    };
    assert!(at_limit.validate().is_ok());
}

#[test]
fn valid_request_keeps_its_blocks_and_trims_the_bootstrap_slash() {
    let m = req().validate().unwrap();
    assert_eq!(&*m.bootstrap_addr, "http://127.0.0.1:8998");
    assert!(m.is_awaiting());
    let empty = KvRequest {
        block_ids: vec![vec![], vec![]],
        ..req()
    }
    .validate()
    .unwrap();
    assert!(!empty.is_awaiting());
}

#[test]
fn bootstrap_addr_must_be_http_host_port() {
    for good in [
        "http://127.0.0.1:8998",
        "http://127.0.0.1:8998/",
        "http://p-0.svc:1",
        "HTTP://h:65535",
        "http://[::1]:8998",
    ] {
        let r = KvRequest {
            remote_bootstrap_addr: Some(good.into()),
            ..req()
        };
        assert!(r.validate().is_ok(), "{good} refused");
    }
    for (bad, why) in [
        ("http://127.0.0.1:99999", "1..=65535"),
        ("http://127.0.0.1:0", "1..=65535"),
        ("http://127.0.0.1", "no port"),
        ("http://127.0.0.1:", "decimal"),
        ("http://:8998", "empty host"),
        ("https://h:8998", "http"),
        ("127.0.0.1:8998", "http"),
        ("http://h:80x", "decimal"),
        ("http://h:8998/prefix", "only scheme"),
        ("http://u@h:8998", "only scheme"),
        ("http://::1:8998", "brackets"),
        ("http://[::1]", "no port"),
        ("http://[]:1", "IPv6"),
        ("http://h :1", "only scheme"),
        // Accepted once, then failed at the lookup as "invalid uri character".
        ("http://p%31:8998", "letters, digits"),
        ("http://h\0:1", "letters, digits"),
        ("http://h\u{e9}:1", "letters, digits"),
        ("http://h|x:1", "letters, digits"),
        ("http://h\\x:1", "letters, digits"),
        ("http://h]:1", "letters, digits"),
        ("http://h\u{7f}:1", "letters, digits"),
    ] {
        let r = KvRequest {
            remote_bootstrap_addr: Some(bad.into()),
            ..req()
        };
        match r.validate() {
            Err(BatchError::BadBootstrapAddr { reason, .. }) => {
                assert!(reason.contains(why), "{bad}: {reason}")
            }
            other => panic!("{bad} accepted or refused otherwise: {other:?}"),
        }
    }
}

#[test]
fn a_block_listed_twice_in_a_group_is_refused_but_not_across_groups() {
    let twice = KvRequest {
        block_ids: vec![vec![1], vec![4, 5, 4]],
        ..req()
    };
    assert_eq!(
        twice.validate().unwrap_err(),
        BatchError::DuplicateBlock {
            req_id: "d-1".into(),
            group: 1,
            block: 4
        }
    );
    let across = KvRequest {
        block_ids: vec![vec![4], vec![4]],
        ..req()
    };
    assert!(across.validate().is_ok(), "ids are unique per group only");
    // Long lists are checked through a set, short ones pairwise: both find the repeat.
    for len in [2u32, 32, 33, 500] {
        let mut ids: Vec<u32> = (0..len).collect();
        ids.push(len / 2);
        let long = KvRequest {
            block_ids: vec![ids],
            ..req()
        };
        assert!(
            matches!(long.validate(), Err(BatchError::DuplicateBlock { block, .. }) if block == len / 2),
            "{len} blocks"
        );
        let unique = KvRequest {
            block_ids: vec![(0..len).collect()],
            ..req()
        };
        assert!(unique.validate().is_ok(), "{len} blocks");
    }
}

/// A request's metadata lives as long as the request: its block lists are one allocation of
/// exactly their ids and the groups' ends, no spare capacity from parsing (at 100k in flight
/// that was ~80 B per request; the outer list's buffer was ~24 B more).
#[test]
fn metadata_block_lists_are_one_exact_allocation() {
    let r: KvRequest = serde_json::from_str(
        r#"{"req_id":"d-1","transfer_id":"t-1","remote_engine_id":"e",
            "remote_bootstrap_addr":"http://127.0.0.1:1","block_ids":[[1],[2,3,4,5,6]]}"#,
    )
    .unwrap();
    let m = r.into_meta(&mut Interner::default()).unwrap();
    assert_eq!(m.block_ids(), vec![vec![1], vec![2, 3, 4, 5, 6]]);
    assert_eq!(m.transfer_id(), "t-1");
    assert_eq!(
        m.tail.stored_len(),
        1 + 2 + 6 + 1 + 1,
        "the group count, 2 ends, 6 ids, the transfer id's length and its 3 bytes in a word"
    );
}

/// An address is checked once per interner, and only one that passed is remembered: a bad
/// one is refused every time.
#[test]
fn the_interner_remembers_only_bootstrap_addresses_that_passed() {
    let mut interner = Interner::default();
    let bad = KvRequest {
        remote_bootstrap_addr: Some("ftp://x:1".into()),
        ..req()
    };
    for _ in 0..2 {
        assert!(matches!(
            bad.validate_with(&mut interner),
            Err(BatchError::BadBootstrapAddr { .. })
        ));
    }
    let good = req();
    let a = good.validate_with(&mut interner).unwrap();
    let b = good.clone().into_meta(&mut interner).unwrap();
    assert!(SharedStr::ptr_eq(&a.bootstrap_addr, &b.bootstrap_addr));
    assert_eq!(a, b);
    assert!(matches!(
        bad.into_meta(&mut interner),
        Err(BatchError::BadBootstrapAddr { .. })
    ));
}

/// One copy per distinct value, in whatever order values repeat.
#[test]
fn the_interner_hands_out_one_copy_per_value() {
    let mut interner = Interner::default();
    let names = [
        "e0",
        "http://a:1",
        "e1",
        "http://b:2",
        "e0",
        "e0",
        "http://a:1",
        "e2",
    ];
    let mut first: Vec<(&str, SharedStr)> = Vec::new();
    for round in 0..3 {
        for name in names.iter().skip(round) {
            let got = interner.intern(name);
            assert_eq!(&*got, *name);
            match first.iter().find(|(n, _)| n == name) {
                Some((_, a)) => assert!(SharedStr::ptr_eq(a, &got), "{name} copied again"),
                None => first.push((name, got)),
            }
        }
    }
    assert_eq!(first.len(), 5);
}

/// A request in flight keeps one `Arc<RequestMeta>`: with its counts 64 bytes, mimalloc's
/// 64-byte class (it was 104, in the 112-byte class, then 80: the block lists as one 16-byte
/// allocation handle, the engine id and bootstrap address as one pointer each, and the
/// transfer id in the block lists' allocation since).
#[test]
#[cfg(target_pointer_width = "64")]
fn a_request_with_its_counts_is_64_bytes() {
    assert_eq!(std::mem::size_of::<RequestMeta>() + 16, 64);
}
