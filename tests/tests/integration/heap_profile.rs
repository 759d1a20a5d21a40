//! `scripts/heap-per-agent.py`, which reads a DHAT profile of the server
//! with N idle agents and puts each live byte down to its owner, fed a
//! profile whose owners are known: an allocation is charged to the first
//! frame named with its path that is not a container or the allocator,
//! inlined frames (named without a path) are passed over, and a task's
//! memory goes to the code that spawned it.

use std::process::Command;

use integration_tests::workspace;

/// A DHAT profile (valgrind's format) of 4 agents: each with h2's 16 KiB
/// write buffer (behind an inlined `with_capacity` and `BytesMut`), a task
/// spawned by our stream driver, and one block of the fixed base.
fn profile() -> String {
    let frames = [
        "[root]",
        "0x48417B4: malloc (in /usr/libexec/valgrind/vgpreload_dhat-amd64-linux.so)",
        "0x930532: alloc::raw_vec::RawVecInner<A>::try_allocate_in (library/alloc/src/raw_vec/mod.rs:464)",
        "0x947ECD: with_capacity<u8> (library/alloc/src/vec/mod.rs:524)",
        "0x947ECD: bytes::bytes_mut::BytesMut::with_capacity (src/bytes_mut.rs:157)",
        "0x947ECD: h2::codec::framed_write::FramedWrite<T,B>::new (src/codec/framed_write.rs:96)",
        "0x74C12A: h2::codec::Codec<T,B>::new (src/codec/mod.rs:36)",
        "0x5A0000: tokio::runtime::task::core::Cell<T,S>::new (src/runtime/task/core.rs:200)",
        "0x5A0100: tokio::runtime::task::spawn<F> (src/task/spawn.rs:168)",
        "0x5A0200: proxy_server::stream::spawn_driver (proxy-server/src/stream.rs:90)",
        "0x5A0300: ops::metrics::Metrics::new (ops/src/metrics.rs:10)",
    ];
    let ftbl = frames.map(|f| format!("{f:?}")).join(",");
    format!(
        r#"{{"dhatFileVersion":2,"mode":"heap","pps":[
            {{"tb":65536,"tbk":4,"eb":65536,"ebk":4,"fs":[1,2,3,4,5,6]}},
            {{"tb":4096,"tbk":4,"eb":4096,"ebk":4,"fs":[1,2,7,8,9]}},
            {{"tb":640,"tbk":1,"eb":640,"ebk":1,"fs":[1,2,10]}},
            {{"tb":999,"tbk":1,"eb":0,"ebk":0,"fs":[1,2,10]}}
        ],"ftbl":[{ftbl}]}}"#
    )
}

#[test]
fn each_live_byte_is_charged_to_its_owner_per_agent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dhat.json");
    std::fs::write(&path, profile()).unwrap();
    let out = Command::new("python3")
        .arg(workspace().join("scripts/heap-per-agent.py"))
        .arg(&path)
        .arg("4")
        .output()
        .expect("running python3");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.starts_with("live at the end: 70272 bytes in all, 17568 per agent"),
        "{text}"
    );
    for row in [
        "| h2: write buffer | 16384 | 1.0 | 65536 |",
        "| task spawned by ours: proxy_server::stream::spawn_driver | 1024 | 1.0 | 4096 |",
        "| ours: ops::metrics::Metrics | 160 | 0.2 | 640 |",
    ] {
        assert!(text.contains(row), "no row {row:?} in:\n{text}");
    }
}
