//! `kvrecv serve --kv-transfer-config` takes vLLM's JSON as vLLM writes it: an unknown key is
//! accepted, and a config without a layout is refused unless the three layout flags give one
//! (never a silent default layout).

use std::process::Command;

fn serve(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvrecv"))
        .arg("serve")
        .args(args)
        .stdin(std::process::Stdio::null()) // end of input: serve shuts down after `ready`
        .output()
        .expect("kvrecv binary");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

const NO_LAYOUT: &str = r#"{"kv_role":"kv_consumer","enable_permute_local_kv":false}"#;

#[test]
fn a_config_without_a_layout_is_refused_and_the_flags_can_give_it() {
    let (code, out) = serve(&["--kv-transfer-config", NO_LAYOUT]);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("no destination layout"), "{out}");
    let (code, out) = serve(&[
        "--kv-transfer-config",
        NO_LAYOUT,
        "--layers",
        "2",
        "--block-len",
        "4096",
        "--num-blocks",
        "8",
    ]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(r#""event":"ready""#), "{out}");
    assert!(out.contains(r#""num_blocks":8"#), "{out}");
}
