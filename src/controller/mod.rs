//! `skipper controller`: assigns pool pods to functions, scales them and
//! serves `skipper.ControllerService`.

use std::process::ExitCode;

use crate::cli::NotAvailable;

/// Flags of `skipper controller`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub telemetry: crate::telemetry::Args,
}

/// Runs the controller until SIGTERM/SIGINT.
///
/// # Errors
/// Not yet available in this build.
pub async fn main(_args: Args) -> Result<ExitCode, NotAvailable> {
    Err(NotAvailable("controller"))
}
