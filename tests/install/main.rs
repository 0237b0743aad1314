//! What an operator installs: the manifests (their objects, RBAC verb by
//! verb), the README's deploy steps run verbatim, and an install from zero
//! that serves a request end to end.

mod chart;
mod helm_lifecycle;
mod install_from_zero;
mod install_order;
mod manifests;
mod pod_security;
mod rbac_manifests;
mod readme_deploy;
mod steps;
mod uninstall;
