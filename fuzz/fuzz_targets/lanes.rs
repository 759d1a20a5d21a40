//! A `Proxy` stream's read-ahead fed DATA, closes, uploads and cuts: `proxy_server::fuzzing::lanes`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(data, proxy_server::fuzzing::lanes_alloc_bound, |data| {
        proxy_server::fuzzing::lanes(data);
    });
});
