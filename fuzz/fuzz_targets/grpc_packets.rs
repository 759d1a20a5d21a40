//! GRPC request bodies through our codec into packets: `proto::fuzzing::grpc_packets`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(data, proto::fuzzing::grpc_packets_alloc_bound, |data| {
        proto::fuzzing::grpc_packets(data);
    });
});
