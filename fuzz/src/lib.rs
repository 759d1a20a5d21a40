//! What every fuzz target shares: a global allocator that counts
//! (`heap-count`), so that each run's peak heap is checked against the
//! bound its workspace crate states for the input's size (`*_alloc_bound`),
//! as the replay of the corpora does (`replay.rs`).
//!
//! The logic of each target lives in the workspace crates (`fuzzing`
//! modules, the `fuzzing` feature), where the committed corpora are
//! replayed as ordinary tests on the stable toolchain; the targets in
//! `fuzz_targets/` only wrap it.

use std::alloc::System;

#[global_allocator]
static ALLOCATOR: heap_count::Counting<System> = heap_count::Counting::new(System);

/// Runs `target` on `data` and checks that the heap it used at its peak
/// (above what was live before) stays within `bound(data.len())`.
pub fn run(data: &[u8], bound: fn(usize) -> usize, target: impl FnOnce(&[u8])) {
    if let Err(over) = heap_count::within(bound(data.len()), || target(data)) {
        panic!("{over} for {} input bytes", data.len());
    }
}
