//! Compiles the rate limit service's protocol (proto/rls.proto) with the protoc that
//! `protoc-bin-vendored` ships, so that no protoc needs installing.

fn main() {
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("protoc-bin-vendored has no protoc for this platform");
    std::env::set_var("PROTOC", protoc);
    println!("cargo:rerun-if-changed=proto/rls.proto");
    tonic_build::configure().build_client(false).compile_protos(&["proto/rls.proto"], &["proto"]).expect("proto/rls.proto");
}
