//! TokenReview answers (status and JSON body): `proxy_server::fuzzing::token_review`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(
        data,
        proxy_server::fuzzing::token_review_alloc_bound,
        |data| {
            proxy_server::fuzzing::token_review(data);
        },
    );
});
