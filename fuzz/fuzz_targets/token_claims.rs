//! Bearer tokens through the checks before a TokenReview:
//! `proxy_server::fuzzing::token_claims`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(
        data,
        proxy_server::fuzzing::token_claims_alloc_bound,
        |data| {
            proxy_server::fuzzing::token_claims(data);
        },
    );
});
