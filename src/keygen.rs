//! `skipper keygen`: writes an Ed25519 key pair for assignment tokens.

use std::process::ExitCode;

use crate::cli::NotAvailable;

/// Flags of `skipper keygen`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {}

/// Writes the key pair.
///
/// # Errors
/// Not yet available in this build.
pub fn main(_args: &Args) -> Result<ExitCode, NotAvailable> {
    Err(NotAvailable("keygen"))
}
