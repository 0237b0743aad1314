//! Generates the gRPC code for `proto/skipper/*.proto` with a pure-Rust proto
//! compiler (protox), so building needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["skipper/types.proto", "skipper/controller.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
