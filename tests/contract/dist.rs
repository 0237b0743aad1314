//! The product build (`make dist`, the `skipper` package without its `dev`
//! feature) carries none of what only the playground and the tests need:
//! the simulator's crate and what it alone pulls in, tokio's test clock,
//! kube's WebSocket client, nix's namespace and mount calls.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::process::Command;

/// `cargo tree` of the product's normal dependencies, one `name vX` per line.
fn product_tree(edges: &str) -> String {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "-p",
            "skipper",
            "--no-default-features",
            "--prefix",
            "none",
            "-e",
            edges,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    String::from_utf8(skipper_test_support::process::succeeded("cargo tree", out)).unwrap()
}

#[test]
fn the_product_build_has_no_playground_dependency() {
    let tree = product_tree("normal");
    // Each a line's start: `name vVERSION`.
    for dev_only in [
        "skipper-devcluster v",
        "skipper-test-support v",
        "rcgen v",
        "x509-cert v",
        "serde_yaml_ng v",
        "json-patch v5.",
    ] {
        assert!(
            !tree.lines().any(|l| l.starts_with(dev_only)),
            "the product build depends on {dev_only}:\n{tree}"
        );
    }
    // A sanity check that the tree is the product's: it has its runtime.
    assert!(tree.lines().any(|l| l.starts_with("tonic ")), "{tree}");
}

#[test]
fn the_product_build_enables_no_test_or_playground_feature() {
    let tree = product_tree("normal,features");
    for (krate, feature) in [
        ("tokio", "test-util"),
        ("kube", "ws"),
        ("kube-client", "ws"),
        ("nix", "mount"),
        ("nix", "sched"),
        ("nix", "user"),
    ] {
        let line = format!("{krate} feature \"{feature}\"");
        assert!(
            !tree.lines().any(|l| l.starts_with(&line)),
            "the product build enables {line}"
        );
    }
    assert!(
        tree.lines()
            .any(|l| l.starts_with("tokio feature \"rt-multi-thread\"")),
        "{tree}"
    );
}
