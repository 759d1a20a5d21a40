//! HTTP CONNECT request heads, cut into pieces: `proxy_server::fuzzing::connect_head`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(
        data,
        proxy_server::fuzzing::connect_head_alloc_bound,
        |data| {
            proxy_server::fuzzing::connect_head(data);
        },
    );
});
