//! What a finished stateright run found, shared by `tests/model_check.rs` and
//! `tests/model_check_rdma.rs`.

use stateright::{Checker, Model};

/// Each violated property's name and the actions of its counterexample, one per line.
pub fn discoveries<M: Model>(checker: &impl Checker<M>) -> Vec<(String, String)>
where
    M::State: Clone + PartialEq,
    M::Action: Clone + PartialEq + std::fmt::Debug,
{
    let mut found = vec![];
    for p in checker.model().properties() {
        if let Some(path) = checker.discovery(p.name) {
            let actions: Vec<String> = path
                .into_actions()
                .iter()
                .map(|a| format!("{a:?}"))
                .collect();
            found.push((p.name.to_string(), actions.join("\n  ")));
        }
    }
    found
}
