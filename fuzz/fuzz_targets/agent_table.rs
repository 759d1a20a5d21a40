//! The agent's connection table fed packet sequences: `proxy_agent::fuzzing::agent_table`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(
        data,
        proxy_agent::fuzzing::agent_table_alloc_bound,
        |data| {
            proxy_agent::fuzzing::agent_table(data);
        },
    );
});
