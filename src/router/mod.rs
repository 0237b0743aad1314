//! `skipper router`: proxies tenant traffic to function instances.

use std::process::ExitCode;

use crate::cli::NotAvailable;

/// Flags of `skipper router`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub telemetry: crate::telemetry::Args,
}

/// Runs the router until SIGTERM/SIGINT.
///
/// # Errors
/// Not yet available in this build.
pub async fn main(_args: Args) -> Result<ExitCode, NotAvailable> {
    Err(NotAvailable("router"))
}
