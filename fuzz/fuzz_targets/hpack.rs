//! HPACK header blocks through the authority shim's decoder: `authority::fuzzing::hpack`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(data, authority::fuzzing::hpack_alloc_bound, |data| {
        authority::fuzzing::hpack(data);
    });
});
