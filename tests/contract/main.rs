//! The contracts Skipper keeps with Go Skipper and with operators: the Go
//! test vectors, the wire formats, the ring's properties, `ring-inspect`,
//! the CLI's help texts, the product build's dependencies and the
//! controller's import graph.

mod cli_help;
mod dist;
mod flags_reference;
mod go_vectors;
mod imports;
mod ring_inspect;
mod ring_properties;
mod wire;
