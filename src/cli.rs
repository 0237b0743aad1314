//! The `skipper` command line. Each subcommand's flags live in its own module;
//! every flag also reads `SKIPPER_<FLAG>` from the environment.

use clap::{Parser, Subcommand};

/// `skipper --version`: the release and the commit it is built from
/// (`SKIPPER_REVISION` at build time, else the checkout's, else `unknown`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (revision ",
    env!("SKIPPER_REVISION"),
    ")"
);

/// One binary, every Skipper role.
#[derive(Debug, Parser)]
#[command(
    name = "skipper",
    version = VERSION,
    about = "On-demand per-tenant servers on Kubernetes",
    long_about = "On-demand per-tenant servers on Kubernetes.\n\nEvery flag also reads the environment variable SKIPPER_<FLAG> (e.g. --heartbeat-timeout reads SKIPPER_HEARTBEAT_TIMEOUT); a flag on the command line wins.",
    propagate_version = true,
    term_width = 100
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
// Parsed once at start-up and moved into its subcommand: the size of the
// largest flag set does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a controller replica: assigns pool pods to functions and scales them
    Controller(crate::controller::Args),
    /// Run a router: proxies tenant traffic to the function's instances
    Router(crate::router::Args),
    /// Show which controller owns a function, ring balance and what moves on membership changes
    RingInspect(crate::ring_inspect::Args),
    /// Run the reference pod program (assign endpoint, echo, WebSocket ping/pong)
    Fixture(crate::fixture::Args),
    /// Run the local playground: simulated cluster, controllers, router and a pool
    #[cfg(feature = "dev")]
    Dev(crate::dev::DevArgs),
    /// Write an Ed25519 key pair (PKCS#8 / SPKI PEM) for assignment tokens
    ///
    /// Rotating the key fails no request in this order, each step rolled out completely before the
    /// next: (1) pools trust the old and the new public key (both PEM blocks in SKIPPER_PUBLIC_KEY),
    /// (2) controllers sign with the new private key, (3) pools trust the new public key only. The
    /// README's "Rotating the assignment key" gives the commands.
    Keygen(crate::keygen::Args),
}
