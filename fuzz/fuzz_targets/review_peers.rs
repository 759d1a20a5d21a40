//! Peers' token checks entering, calling, failing and leaving:
//! `proxy_server::fuzzing::review_peers`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(
        data,
        proxy_server::fuzzing::review_peers_alloc_bound,
        |data| {
            proxy_server::fuzzing::review_peers(data);
        },
    );
});
