//! The cluster Skipper runs on in tests and in `skipper dev`: the Kubernetes
//! API simulator (REST, watch, auth, RBAC, kubectl), the node agent's pods
//! and the fixture in them, the real control plane's harness, and the
//! differential conformance suite that holds the simulator to the real
//! control plane. `make bench-sim` runs the ignored benchmarks of [`bench`].

mod auth;
mod bench;
mod conformance;
mod control_plane;
mod fixture;
mod kubectl;
mod kubelet_conformance;
mod kubelet_nodes;
mod metrics_api;
mod pool;
mod rbac;
mod real_cluster;
mod watch;
