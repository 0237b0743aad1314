//! `--help` output of every subcommand, pinned by snapshot files in
//! `tests/data/help/`. After an intended change, regenerate them with
//! `SKIPPER_BLESS=1 cargo test --test cli_help` and review the diff.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions
use std::path::PathBuf;
use std::process::Command;

use clap::CommandFactory;

const SUBCOMMANDS: &[&str] = &[
    "",
    "controller",
    "router",
    "ring-inspect",
    "fixture",
    "dev",
    "keygen",
];

fn help_of(sub: &str) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_skipper"));
    cmd.env_clear();
    if !sub.is_empty() {
        cmd.arg(sub);
    }
    let out = cmd.arg("--help").output().expect("run skipper --help");
    String::from_utf8(skipper_test_support::process::succeeded(
        &format!("skipper {sub} --help"),
        out,
    ))
    .expect("utf-8 help")
}

#[test]
fn clap_definition_is_consistent() {
    skipper::cli::Cli::command().debug_assert();
}

#[test]
fn help_matches_snapshots() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/help");
    let bless = std::env::var_os("SKIPPER_BLESS").is_some();
    let mut stale = Vec::new();
    for sub in SUBCOMMANDS {
        let name = if sub.is_empty() { "skipper" } else { sub };
        let path = dir.join(format!("{name}.txt"));
        let actual = help_of(sub);
        if bless {
            std::fs::write(&path, &actual).expect("write snapshot");
            continue;
        }
        let expected = std::fs::read_to_string(&path).unwrap_or_default();
        if expected != actual {
            stale.push(format!("--- {}\n{actual}", path.display()));
        }
    }
    assert!(
        stale.is_empty(),
        "help output changed; if intended, run SKIPPER_BLESS=1 cargo test --test cli_help\n{}",
        stale.join("\n")
    );
}

#[test]
fn every_flag_names_its_environment_variable() {
    let cli = skipper::cli::Cli::command();
    for sub in cli.get_subcommands() {
        for arg in sub.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version") || arg.is_positional() {
                continue;
            }
            // Repeatable lookups of ring-inspect are per-invocation inputs, not configuration.
            if sub.get_name() == "ring-inspect"
                && matches!(long, "function" | "hash" | "add" | "remove" | "distribution")
            {
                continue;
            }
            let want = format!("SKIPPER_{}", long.to_uppercase().replace('-', "_"));
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            assert_eq!(
                env.as_deref(),
                Some(want.as_str()),
                "skipper {} --{long}",
                sub.get_name()
            );
        }
    }
}
