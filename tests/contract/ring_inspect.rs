//! `skipper ring-inspect` as an operator runs it: output shapes and the
//! one-line errors (exit 2) for bad input.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions
use std::process::{Command, Output};

use serde_json::Value;

const FN: &str = r#"{"namespace":"ns","deployment":"dep","tenant":"tenant","scale":{"max_instances":1}}"#;

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_skipper"))
        .env_clear()
        .arg("ring-inspect")
        .args(args)
        .output()
        .expect("run skipper ring-inspect")
}

fn json(args: &[&str]) -> Value {
    let out = run(args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// The JSON answer of a lookup of `function` on the three members of the
/// Go vectors.
fn lookup(function: &str) -> Value {
    json(&[
        "--members",
        "10.0.0.1,10.0.0.2,10.0.0.3",
        "--function",
        function,
        "--output",
        "json",
    ])
}

#[test]
fn owner_of_a_function_matches_the_go_vector() {
    let v = lookup(FN);
    let f = &v["functions"][0];
    assert_eq!(f["hash"], "13873020088491798334");
    assert_eq!(f["key"], "0x60efb17a");
    assert_eq!(f["owner"], "10.0.0.2");
    assert_eq!(
        (f["namespace"].as_str(), f["oneshot"].as_bool()),
        (Some("ns"), Some(false))
    );
    assert!(v.get("moved").is_none());
    let members = v["members"].as_array().unwrap();
    assert_eq!(members.len(), 3);
    assert!(members.iter().all(|m| m["vnodes"] == 1024));
    let total: f64 = members.iter().map(|m| m["share"].as_f64().unwrap()).sum();
    assert!((total - 1.0).abs() < 0.001, "{total}");
}

#[test]
fn a_lookup_needs_no_scale_block() {
    let with_scale = lookup(FN);
    let without = lookup(r#"{"namespace":"ns","deployment":"dep","tenant":"tenant"}"#);
    assert_eq!(
        without["functions"], with_scale["functions"],
        "the same function, the same owner"
    );
    assert_eq!(without["functions"][0]["owner"], "10.0.0.2");
}

#[test]
fn raw_hash_lookup_and_removal() {
    let v = json(&[
        "--members",
        "10.0.0.1,10.0.0.2,10.0.0.3",
        "--hash",
        "13873020088491798334",
        "--remove",
        "10.0.0.2",
        "--output",
        "json",
    ]);
    assert_eq!(v["functions"][0]["owner"], "10.0.0.2");
    let moved = &v["moved"];
    assert_eq!(moved["functions"][0]["new_owner"], "10.0.0.1");
    let share = moved["share"].as_f64().unwrap();
    let member_2 = v["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["ip"] == "10.0.0.2")
        .unwrap();
    assert!((share - member_2["share"].as_f64().unwrap()).abs() < 0.0002);
}

#[test]
fn adding_a_member_moves_about_a_quarter() {
    let v = json(&[
        "--members",
        "10.0.0.1,10.0.0.2,10.0.0.3",
        "--add",
        "10.0.0.4",
        "--output",
        "json",
    ]);
    let share = v["moved"]["share"].as_f64().unwrap();
    assert!((0.18..0.32).contains(&share), "{share}");
    assert_eq!(v["moved"]["functions"], Value::Array(vec![]));
}

#[test]
fn table_output_names_the_owner_and_spread() {
    let out = run(&[
        "--members",
        "10.0.0.1,10.0.0.2,10.0.0.3",
        "--function",
        FN,
        "--distribution",
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success());
    assert!(text.contains("spread (max/min share):"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("ns/dep/tenant") && l.ends_with("10.0.0.2")),
        "{text}"
    );
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["--function", FN], "no ring members"),
        (
            &["--members", "10.0.0.1,not-an-ip"],
            "invalid member \"not-an-ip\"",
        ),
        (
            &["--members", "10.0.0.1", "--function", "{"],
            "failed to unmarshal",
        ),
        (
            &["--members", "10.0.0.1", "--function", r#"{"namespace":"ns"}"#],
            "missing deployment",
        ),
        (
            &[
                "--members",
                "10.0.0.1",
                "--function",
                r#"{"namespace":"ns","deployment":"d","tenant":"a b","scale":{"max_instances":1}}"#,
            ],
            "invalid tenant",
        ),
        (
            &["--members", "10.0.0.1", "--remove", "10.0.0.9"],
            "not a ring member",
        ),
        (&["--members", "10.0.0.1", "--add", "x"], "invalid member \"x\""),
    ];
    for (args, needle) in cases {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(out.stdout.is_empty());
    }
}
