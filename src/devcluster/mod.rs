//! The Kubernetes API simulator and `skipper dev`, the local playground.

use std::process::ExitCode;

use crate::cli::NotAvailable;

/// Flags of `skipper dev`.
#[derive(Debug, Clone, clap::Args)]
pub struct DevArgs {}

/// Runs the playground until Ctrl-C.
///
/// # Errors
/// Not yet available in this build.
pub async fn main(_args: DevArgs) -> Result<ExitCode, NotAvailable> {
    Err(NotAvailable("dev"))
}
