//! Certificate, key and CA files an operator hands over: `ops::fuzzing::tls_files`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(data, ops::fuzzing::tls_files_alloc_bound, |data| {
        ops::fuzzing::tls_files(data);
    });
});
