//! `docs/flags.md`, the operator's flag reference, is generated from the
//! CLI's definitions: this test renders it from clap and compares it with the
//! file (`SKIPPER_BLESS=1` rewrites the file).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use clap::CommandFactory as _;
use skipper_test_support::workspace_root;

/// The subcommands an operator configures, in the reference's order.
const SUBCOMMANDS: [&str; 5] = ["controller", "router", "fixture", "ring-inspect", "keygen"];

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// The reference as Markdown: one table per subcommand.
fn reference() -> String {
    let cli = skipper::cli::Cli::command();
    let mut out = String::from(
        "# Flags\n\n\
         Every flag of the `skipper` subcommands an operator runs, generated from the command line's \
         definitions (`tests/contract/flags_reference.rs` checks it; `SKIPPER_BLESS=1` rewrites it). \
         Every flag also reads the environment variable named beside it; a flag on the command line wins. \
         Durations use the usual syntax (`90s`, `1m30s`, `100ms`); booleans accept `1`, `t`, `true`, `0`, \
         `f`, `false` in any of Go's spellings, and a bare `--flag` means true. In the Helm chart, \
         `controller.flags` and `router.flags` take these names without the dashes.\n",
    );
    for name in SUBCOMMANDS {
        let sub = cli.find_subcommand(name).unwrap();
        out.push_str(&format!(
            "\n## `skipper {name}`\n\n{}\n\n| Flag | Environment | Default | What it does |\n|---|---|---|---|\n",
            sub.get_about().map(ToString::to_string).unwrap_or_default()
        ));
        for a in sub.get_arguments() {
            let Some(long) = a.get_long() else { continue };
            if long == "help" || long == "version" {
                continue;
            }
            let env = a
                .get_env()
                .map(|e| format!("`{}`", e.to_string_lossy()))
                .unwrap_or_default();
            let default = if a.is_required_set() {
                "required".to_owned()
            } else if a.is_hide_default_value_set() {
                String::new()
            } else {
                let d: Vec<String> = a
                    .get_default_values()
                    .iter()
                    .map(|v| format!("`{}`", v.to_string_lossy()))
                    .collect();
                d.join(", ")
            };
            let mut help = a.get_help().map(ToString::to_string).unwrap_or_default();
            let values: Vec<String> = a
                .get_possible_values()
                .iter()
                .filter(|v| !v.is_hide_set())
                .map(|v| format!("`{}`", v.get_name()))
                .collect();
            if !values.is_empty() && values != ["`true`", "`false`"] {
                help.push_str(&format!(" (one of {})", values.join(", ")));
            }
            out.push_str(&format!(
                "| `--{long}` | {env} | {} | {} |\n",
                cell(&default),
                cell(&help)
            ));
        }
    }
    out
}

#[test]
fn docs_flags_md_is_the_reference_the_cli_defines() {
    let path = workspace_root().join("docs/flags.md");
    let want = reference();
    if std::env::var_os("SKIPPER_BLESS").is_some() {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != want {
        let line = have.lines().zip(want.lines()).position(|(a, b)| a != b);
        panic!(
            "docs/flags.md is not what the CLI defines (SKIPPER_BLESS=1 rewrites it); first difference at line {}:\n  file: {:?}\n  cli:  {:?}",
            line.unwrap_or_else(|| have.lines().count().min(want.lines().count())) + 1,
            line.and_then(|l| have.lines().nth(l)),
            line.and_then(|l| want.lines().nth(l)),
        );
    }
    // Every controller and router flag is there.
    for name in ["controller", "router"] {
        let cli = skipper::cli::Cli::command();
        for a in cli.find_subcommand(name).unwrap().get_arguments() {
            if let Some(long) = a.get_long() {
                assert!(
                    long == "help" || long == "version" || have.contains(&format!("| `--{long}` |")),
                    "--{long} of skipper {name} is missing"
                );
            }
        }
    }
}
