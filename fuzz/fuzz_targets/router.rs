//! The server's routing core fed event and packet sequences: `proxy_server::fuzzing::router`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(data, proxy_server::fuzzing::router_alloc_bound, |data| {
        proxy_server::fuzzing::router(data);
    });
});
