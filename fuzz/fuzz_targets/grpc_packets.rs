//! A frontend's gRPC request body: through our codec into packets
//! (`proto::fuzzing::grpc_packets`), then through a server's own handling,
//! a Proxy stream and an agent stream with the control core between them
//! (`proxy_server::fuzzing::grpc_packets`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(data, proxy_server::fuzzing::grpc_packets_alloc_bound, |data| {
        proto::fuzzing::grpc_packets(data);
        proxy_server::fuzzing::grpc_packets(data);
    });
});
