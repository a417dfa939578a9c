//! Generates the envd protobuf types from the checked-in FileDescriptorSet
//! (`proto/envd.fds.bin`, extracted from the e2b SDK by `scripts/e2b/extract-descriptors.py`):
//! prost for the messages, pbjson for their proto3 JSON mapping. No protoc is needed.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fds_path = "proto/envd.fds.bin";
    println!("cargo:rerun-if-changed={fds_path}");
    let bytes = std::fs::read(fds_path)?;
    let fds = prost_types::FileDescriptorSet::decode(bytes.as_slice())?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);

    let mut config = prost_build::Config::new();
    config
        .out_dir(&out)
        // Timestamp comes from pbjson-types, which carries its JSON mapping (RFC 3339).
        .extern_path(".google.protobuf.Timestamp", "::pbjson_types::Timestamp")
        .compile_fds(fds)?;

    pbjson_build::Builder::new()
        .register_descriptors(&bytes)?
        .out_dir(&out)
        .ignore_unknown_fields()
        .build(&[".process", ".filesystem"])?;
    Ok(())
}
