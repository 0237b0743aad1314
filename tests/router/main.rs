//! The router's integration suite: real routers on loopback in front of a
//! scriptable fake controller and real upstream servers, the controller
//! client's retry table, discovery, the warm path, the edge (forwarding
//! headers, Host, half-close, slow clients, refused credentials) and
//! profiling.

mod admission;
mod client;
mod common;
mod discovery;
mod edge;
mod grpc;
mod http2;
mod profiling;
mod proxy;
mod shutdown;
mod warm;
