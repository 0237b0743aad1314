//! The `skipper` executable: parse the command line, set up logging, dispatch.

use std::process::ExitCode;

use clap::Parser;
use skipper::cli::{Cli, Command};

/// mimalloc: see `Cargo.toml` for why.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // The playground's pod sandbox shim works on namespaces, which needs a
    // process with a single thread: it runs before the async runtime (or
    // anything else) starts. The product build has no such subcommand.
    #[cfg(feature = "dev")]
    {
        use skipper_devcluster::kubelet::sandbox;
        let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
        if args.get(1).is_some_and(|a| a == sandbox::SUBCOMMAND) {
            return sandbox::main(&args[2..]);
        }
    }
    let cli = Cli::parse();
    let runtime = match runtime(&cli.command) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: anyhow::Result<ExitCode> = runtime.block_on(async move {
        match cli.command {
            Command::Controller(args) => skipper::controller::main(args).await.map_err(Into::into),
            Command::Router(args) => skipper::router::main(args).await.map_err(Into::into),
            Command::RingInspect(args) => skipper::ring_inspect::main(args).await,
            Command::Fixture(args) => skipper::fixture::main(args).await.map_err(Into::into),
            #[cfg(feature = "dev")]
            Command::Dev(args) => skipper::dev::main(args).await.map_err(Into::into),
            Command::Keygen(args) => skipper::keygen::main(&args).map_err(Into::into),
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The async runtime: a worker thread per CPU (`TOKIO_WORKER_THREADS`
/// overrides the count, which follows the CPU quota of the process's
/// cgroup). A router with one CPU runs on one thread (the current-thread
/// runtime): a request never wakes another thread, and no work is stolen.
/// Its blocking work (profiles) still runs on the blocking pool.
fn runtime(command: &Command) -> std::io::Result<tokio::runtime::Runtime> {
    let workers = std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get));
    if matches!(command, Command::Router(_)) && workers == 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().enable_all().build()
    }
}

/// The error and its causes on one line, leaving out a cause whose text the
/// line already holds (errors that print their source in their own message).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}
