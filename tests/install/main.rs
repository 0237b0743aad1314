//! What an operator installs: the manifests (their objects, RBAC verb by
//! verb), the README's deploy steps run verbatim, and an install from zero
//! that serves a request end to end.

mod install_from_zero;
mod manifests;
mod rbac_manifests;
mod readme_deploy;
