//! Flow-control headers, credit packets and one connection's flow state: `proxy_agent::fuzzing::flow_control`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(
        data,
        proxy_agent::fuzzing::flow_control_alloc_bound,
        |data| {
            proxy_agent::fuzzing::flow_control(data);
        },
    );
});
