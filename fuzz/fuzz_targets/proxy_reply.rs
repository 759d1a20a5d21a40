//! SOCKS5 and HTTP CONNECT proxies' replies to the agent: `proxy_agent::fuzzing::proxy_reply`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    konnectivity_fuzz::run(
        data,
        proxy_agent::fuzzing::proxy_reply_alloc_bound,
        |data| {
            proxy_agent::fuzzing::proxy_reply(data);
        },
    );
});
