//! Generates the gRPC code for `proto/skipper/*.proto` with a pure-Rust proto
//! compiler (protox), so building needs no `protoc`, and records the commit
//! the binary is built from for `skipper --version`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(
        [
            "skipper/types.proto",
            "skipper/controller.proto",
            "skipper/fixture.proto",
        ],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    revision();
    Ok(())
}

/// Sets `SKIPPER_REVISION`: `SKIPPER_REVISION` from the environment when
/// set (builds from a source archive), else the checkout's commit, else
/// `unknown`.
fn revision() {
    println!("cargo:rerun-if-env-changed=SKIPPER_REVISION");
    let revision = std::env::var("SKIPPER_REVISION")
        .ok()
        .filter(|r| !r.trim().is_empty())
        .or_else(|| {
            for path in git_files() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
            git(&["rev-parse", "--short=12", "HEAD"])
        })
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=SKIPPER_REVISION={}", revision.trim());
}

/// The files whose change moves HEAD: HEAD itself, the branch it names and
/// the packed refs (in a worktree, HEAD is the worktree's, refs are shared).
fn git_files() -> Vec<PathBuf> {
    let (Some(dir), Some(common)) = (
        git(&["rev-parse", "--git-dir"]),
        git(&["rev-parse", "--git-common-dir"]),
    ) else {
        return Vec::new();
    };
    let (dir, common) = (PathBuf::from(dir.trim()), PathBuf::from(common.trim()));
    let mut files = vec![dir.join("HEAD"), common.join("packed-refs")];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        files.push(common.join(branch.trim()));
    }
    files.retain(|f| Path::new(f).exists());
    files
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        .filter(|s| !s.trim().is_empty())
}
