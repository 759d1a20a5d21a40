//! What every fuzz target shares: a global allocator that counts, so that
//! each run's peak heap is checked against the bound its workspace crate
//! states for the input's size (`*_alloc_bound`).
//!
//! The logic of each target lives in the workspace crates (`fuzzing`
//! modules, the `fuzzing` feature), where the committed corpora are
//! replayed as ordinary tests on the stable toolchain; the targets in
//! `fuzz_targets/` only wrap it.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicUsize, Ordering},
};

/// The system allocator, counting live bytes and their peak.
struct Counting;

/// Bytes allocated and not yet freed.
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The highest `LIVE` since the last reset.
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        new
    }
}

fn grew(by: usize) {
    let live = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `target` on `data` and checks that the heap it used at its peak
/// (above what was live before) stays within `bound(data.len())`.
pub fn run(data: &[u8], bound: fn(usize) -> usize, target: impl FnOnce(&[u8])) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    target(data);
    let used = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    let limit = bound(data.len());
    assert!(
        used <= limit,
        "{used} bytes of heap at the peak for {} input bytes (bound {limit})",
        data.len()
    );
}
