//! Skipper: on-demand per-tenant servers on Kubernetes.
//!
//! A Deployment keeps a pool of running, unassigned pods. `skipper router`
//! reads the tenant's function from the `X-Skipper-Function` header and asks
//! `skipper controller` for an instance; the controller claims a pool pod with
//! an atomic JSON Patch, sends it a signed assignment token and returns its
//! address; the router proxies HTTP and WebSocket traffic to it. While a
//! function is active the router keeps a table of its instances, streamed by
//! the controller, and routes without asking.
//!
//! # Layout
//!
//! - [`domain`]: pure data — [`domain::Function`] (header JSON, validation),
//!   [`domain::FunctionId`] (the XXH64 identity). No async code.
//! - [`ring`]: the consistent hash ring (immutable value) and its async handle.
//! - [`api`]: generated protobuf/gRPC types and conversions to domain types.
//! - [`cli`]: the `skipper` command line; each subcommand's flags live in its module.
//! - [`client`]: the typed `ControllerService` client (retry table, endpoint spreading).
//! - [`controller`], [`router`]: the two long-running components. They meet only
//!   at the proto: neither imports the other.
//! - [`ring_inspect`]: the operator tool for ring ownership.
//! - [`fixture`], [`keygen`], [`token`]: the reference pod program, key
//!   generation and PASETO assignment tokens.
//! - `dev` (the `dev` cargo feature, on by default, left out of the product
//!   build): `skipper dev`, the playground on the `skipper-devcluster` crate
//!   (the Kubernetes API simulator, the node agent, the real control plane's
//!   harness).
//! - [`telemetry`], [`profiling`], [`shutdown`], [`config`]: logging,
//!   metrics and traces, CPU profiles, cancellation, shared flag parsing;
//!   [`watch_access`]: watches the API server refuses, reported in the
//!   health of the controller and the router.
//! - [`credentials`]: the ServiceAccount token routers and controllers
//!   present to controllers; [`net`]: accepted sockets with `TCP_NODELAY`.

pub mod api;
pub mod cli;
pub mod client;
pub mod config;
pub mod controller;
pub mod credentials;
#[cfg(feature = "dev")]
pub mod dev;
pub mod domain;
pub mod fixture;
pub mod keygen;
pub mod net;
pub mod profiling;
pub mod ring;
pub mod ring_inspect;
pub mod router;
pub mod shutdown;
pub mod telemetry;
pub mod token;
pub mod watch_access;
