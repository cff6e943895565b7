//! The unsafe fence (issue 38): every module file under `src/` that has no `unsafe` of its own
//! (and, for a parent module, none below it) forbids it, so new unsafe code can only appear
//! where it is already reviewed; the crate roots deny undocumented unsafe blocks.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

const FORBID: &str = "#![forbid(unsafe_code)]";

/// Whether the source has unsafe code (ignoring the word in comments and prose).
fn has_unsafe(src: &str) -> bool {
    [
        "unsafe {",
        "unsafe fn",
        "unsafe impl",
        "unsafe extern",
        "unsafe trait",
    ]
    .iter()
    .any(|t| {
        src.lines()
            .any(|l| !l.trim_start().starts_with("//") && l.contains(t))
    })
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn subtree_has_unsafe(dir: &Path) -> bool {
    let mut files = Vec::new();
    if dir.is_dir() {
        rust_files(dir, &mut files);
    }
    files
        .iter()
        .any(|f| has_unsafe(&std::fs::read_to_string(f).unwrap()))
}

#[test]
fn every_module_without_unsafe_forbids_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut missing = Vec::new();
    for f in &files {
        if f == &src.join("lib.rs") || f == &src.join("main.rs") {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        // A parent module's forbid would cover its children: only where none has unsafe.
        let below = if f.file_name().is_some_and(|n| n == "mod.rs") {
            f.parent().unwrap().to_path_buf()
        } else {
            f.with_extension("")
        };
        let wants = !has_unsafe(&text) && !subtree_has_unsafe(&below);
        if wants && !text.contains(FORBID) {
            missing.push(f.strip_prefix(&src).unwrap().display().to_string());
        }
    }
    assert!(missing.is_empty(), "add {FORBID} to: {missing:?}");
}

#[test]
fn the_crate_roots_fence_unsafe() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for root in ["lib.rs", "main.rs"] {
        let text = std::fs::read_to_string(src.join(root)).unwrap();
        for lint in [
            "#![deny(unsafe_op_in_unsafe_fn)]",
            "#![deny(clippy::undocumented_unsafe_blocks)]",
        ] {
            assert!(text.contains(lint), "{root} lacks {lint}");
        }
    }
}
