//! Compiles the gRPC API with protox (pure Rust), so building needs no system protoc, and derives
//! proto3's JSON mapping for the HTTP edge from the same descriptors (pbjson).
use protox::prost::Message as _;
use std::{env, fs, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["retrace/v1/retrace.proto"], ["proto"])?;
    // Cargo hands a build script its output folder only through the environment.
    #[allow(clippy::disallowed_methods)]
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    // compile_fds does not write the descriptor set; reflection needs it.
    let descriptors = fds.encode_to_vec();
    fs::write(out_dir.join("retrace_descriptor.bin"), &descriptors)?;
    // Field names as the proto spells them (what gRPC users read), every field emitted even at
    // its default (a JSON reader should see `first_error_index: 0`, not a missing key).
    pbjson_build::Builder::new()
        .register_descriptors(&descriptors)?
        .preserve_proto_field_names()
        .emit_fields()
        .build(&[".retrace.v1"])?;
    // prost's codec, except that a request which does not decode is INVALID_ARGUMENT naming it,
    // not INTERNAL (src/api/codec.rs).
    tonic_prost_build::configure()
        .codec_path("crate::api::codec::ProtoCodec")
        .build_client(true)
        .build_server(true)
        .type_attribute(".", "#[allow(clippy::all)]")
        .compile_fds(fds)?;
    Ok(())
}
