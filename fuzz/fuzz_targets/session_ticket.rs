//! Session tickets a client presents: `ops::fuzzing::session_ticket`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(data, ops::fuzzing::session_ticket_alloc_bound, |data| {
        ops::fuzzing::session_ticket(data);
    });
});
