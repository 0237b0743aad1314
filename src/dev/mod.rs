//! `skipper dev`: the local playground (the `dev` cargo feature).
//!
//! The cluster it runs on — the Kubernetes API simulator, the node agent and
//! the real control plane's harness — is the `skipper-devcluster` crate; this
//! module is what makes it a Skipper playground: the command line, the
//! controllers, the router and the pool it starts ([`playground`]), and
//! `skipper dev apiserver`. The product build (`make dist`) leaves it out.

pub mod kubelet;
pub mod playground;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use skipper_devcluster::{Cluster, ClusterError, Config};

use crate::config::parse_duration;

/// Flags of `skipper dev`.
#[derive(Debug, Clone, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct DevArgs {
    /// A part to run on its own; none runs the whole playground.
    #[command(subcommand)]
    pub command: Option<DevCommand>,

    /// Flags of the whole playground.
    #[command(flatten)]
    pub playground: playground::PlaygroundArgs,
}

/// Parts of the playground that run on their own.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DevCommand {
    /// Run only the simulated Kubernetes API server (until Ctrl-C)
    Apiserver(ApiserverArgs),
}

/// Flags of `skipper dev apiserver`.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiserverArgs {
    /// Listen address of the API server
    #[arg(long, env = "SKIPPER_LISTEN", default_value = "127.0.0.1:6443")]
    pub listen: SocketAddr,

    /// Write a kubeconfig for this cluster here (for kubectl and skipper controller)
    #[arg(long, env = "SKIPPER_KUBECONFIG")]
    pub kubeconfig: PathBuf,

    /// Zones of the simulated nodes (comma-separated)
    #[arg(
        long,
        env = "SKIPPER_ZONES",
        default_value = "zone-a,zone-b,zone-c",
        value_delimiter = ','
    )]
    pub zones: Vec<String>,

    /// Namespaces to create at start (comma-separated)
    #[arg(long, env = "SKIPPER_NAMESPACES", value_delimiter = ',')]
    pub namespaces: Vec<String>,

    /// Bookmark period of watches that ask for bookmarks
    #[arg(long, env = "SKIPPER_BOOKMARK_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    pub bookmark_interval: Duration,

    /// Logging and telemetry flags.
    #[command(flatten)]
    pub telemetry: crate::telemetry::Args,
}

/// Why `skipper dev` failed.
#[derive(Debug, thiserror::Error)]
pub enum DevError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("--kubeconfig {path}: {source}")]
    Kubeconfig { path: PathBuf, source: std::io::Error },
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
    #[error(transparent)]
    Playground(#[from] playground::PlaygroundError),
}

/// Runs the playground (`skipper dev`) or `skipper dev apiserver`.
///
/// # Errors
/// [`DevError`] for bad flags, a busy address, or a part that does not start.
pub async fn main(args: DevArgs) -> Result<ExitCode, DevError> {
    let Some(DevCommand::Apiserver(args)) = args.command else {
        return Ok(playground::run(args.playground).await?);
    };
    crate::telemetry::init(&args.telemetry);
    // Signal handlers first: a Ctrl-C right after the kubeconfig appears
    // must still stop the pods and remove the work directory.
    let shutdown = crate::shutdown::Shutdown::new();
    shutdown.trigger_on_signals().map_err(DevError::Signals)?;
    let cluster = Cluster::start(Config {
        listen: args.listen,
        zones: args.zones.clone(),
        namespaces: args.namespaces.clone(),
        bookmark_interval: args.bookmark_interval,
        ..Config::default()
    })
    .await?;
    cluster
        .write_kubeconfig(&args.kubeconfig)
        .map_err(|source| DevError::Kubeconfig {
            path: args.kubeconfig.clone(),
            source,
        })?;
    eprintln!(
        "skipper dev apiserver: serving {} (kubeconfig: {})",
        cluster.base_url(),
        args.kubeconfig.display()
    );
    shutdown.cancelled().await;
    cluster.shutdown().await;
    Ok(ExitCode::SUCCESS)
}
