//! `skipper fixture`: the reference pod program.

use std::process::ExitCode;

use crate::cli::NotAvailable;

/// Flags of `skipper fixture`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub telemetry: crate::telemetry::Args,
}

/// Runs the fixture until SIGTERM/SIGINT.
///
/// # Errors
/// Not yet available in this build.
pub async fn main(_args: Args) -> Result<ExitCode, NotAvailable> {
    Err(NotAvailable("fixture"))
}
