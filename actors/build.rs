//! Compiles `proto/archipelago.proto` into tonic clients and servers with `protox` (pure Rust,
//! no `protoc` binary), as DEPENDENCIES.md prescribes.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/archipelago.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .bytes(".")
        .compile_fds(descriptors)?;
    Ok(())
}
