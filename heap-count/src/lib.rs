//! A global allocator that counts the heap each thread holds, and its
//! peak: the fuzz targets' heap bounds (`<target>_alloc_bound` in each
//! crate's `fuzzing` module) are checked with it in fuzz runs
//! (`fuzz/src/lib.rs`) and when the corpora are replayed by the ordinary
//! tests (`fuzz/replay.rs`; each crate with replay tests installs
//! [`Counting`] in its own test build only, `#[cfg(test)]`).
//!
//! Counting per thread, not per process: the tests of one process run on
//! threads at once, and each replay measures only its own. What a target
//! has other threads allocate is not seen (the harnesses run on one
//! thread: current-thread runtimes); memory one thread frees for another
//! counts against the thread that frees it, so a run is measured from
//! what its thread held when it started.

use std::{
    alloc::{GlobalAlloc, Layout},
    cell::Cell,
    fmt,
    hint::black_box,
};

/// `A`, counting the bytes each thread has allocated and not freed, and
/// their peak.
pub struct Counting<A>(A);

impl<A> Counting<A> {
    /// Counts what `inner` allocates.
    pub const fn new(inner: A) -> Self {
        Self(inner)
    }
}

thread_local! {
    /// Bytes this thread allocated less those it freed.
    static LIVE: Cell<isize> = const { Cell::new(0) };
    /// The highest `LIVE` since [`peak_during`] last started measuring.
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

/// Adds `by` (negative: freed) to this thread's count.
fn count(by: isize) {
    // Neither cell has a destructor: they stay usable while the thread
    // ends, and reading them never allocates.
    let _ = LIVE.try_with(|live| {
        let now = live.get().wrapping_add(by);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

/// A size as a count (no allocation is larger than `isize::MAX`).
fn signed(size: usize) -> isize {
    isize::try_from(size).unwrap_or(isize::MAX)
}

// SAFETY: every call is passed to `A` unchanged; the counting around it
// touches only two thread-local cells and never allocates.
#[allow(unsafe_code)]
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let ptr = unsafe { self.0.alloc(layout) };
        if !ptr.is_null() {
            count(signed(layout.size()));
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let ptr = unsafe { self.0.alloc_zeroed(layout) };
        if !ptr.is_null() {
            count(signed(layout.size()));
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.dealloc(ptr, layout) };
        count(-signed(layout.size()));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let new = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            count(signed(new_size).wrapping_sub(signed(layout.size())));
        }
        new
    }
}

/// Whether [`Counting`] is this process's global allocator: without it a
/// run would measure nothing and pass every bound.
pub fn installed() -> bool {
    let before = LIVE.with(Cell::get);
    let probe = black_box(Vec::<u8>::with_capacity(64));
    let counted = LIVE.with(Cell::get) != before;
    drop(probe);
    counted
}

/// Runs `f` and returns what it returned and the most heap this thread
/// held during it above what it held before (0 if [`Counting`] is not
/// the global allocator).
pub fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    let outer = PEAK.replace(base);
    let output = f();
    let peak = PEAK.get();
    // A measure inside another leaves the outer one's peak whole.
    PEAK.set(outer.max(peak));
    (output, usize::try_from(peak - base).unwrap_or(0))
}

/// A run's heap above its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverBound {
    /// The most heap the run held.
    pub used: usize,
    /// Its bound.
    pub bound: usize,
}

impl fmt::Display for OverBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes of heap at the peak (bound {})",
            self.used, self.bound
        )
    }
}

/// Runs `f` and checks that the heap it used at its peak stays within
/// `bound`.
///
/// # Errors
/// [`OverBound`] with what it used, after `f` has run.
pub fn within<R>(bound: usize, f: impl FnOnce() -> R) -> Result<R, OverBound> {
    let (output, used) = peak_during(f);
    if used <= bound {
        Ok(output)
    } else {
        Err(OverBound { used, bound })
    }
}

#[cfg(test)]
mod tests {
    use std::alloc::System;

    use super::*;

    #[global_allocator]
    static ALLOCATOR: Counting<System> = Counting::new(System);

    /// The peak is what the run held at once, not what it allocated in
    /// all, and not what the thread held before.
    #[test]
    fn a_run_is_measured_at_its_peak_above_what_it_started_with() {
        assert!(installed());
        let held = black_box(vec![0u8; 1 << 20]);
        let ((), used) = peak_during(|| {
            for _ in 0..10 {
                drop(black_box(vec![0u8; 4096]));
            }
            let a = black_box(vec![0u8; 10_000]);
            let b = black_box(vec![0u8; 20_000]);
            drop((a, b));
        });
        assert!((30_000..31_000).contains(&used), "{used}");
        drop(held);
        assert_eq!(
            within(100, || black_box(vec![0u8; 1000]).len()),
            Err(OverBound {
                used: 1000,
                bound: 100
            })
        );
        assert_eq!(within(1000, || black_box(vec![0u8; 1000]).len()), Ok(1000));
    }

    /// A measure inside another leaves the outer one's peak whole; other
    /// threads' heap is not counted.
    #[test]
    fn measures_nest_and_stay_on_their_thread() {
        let ((), outer) = peak_during(|| {
            let big = black_box(vec![0u8; 50_000]);
            drop(big);
            let ((), inner) = peak_during(|| drop(black_box(vec![0u8; 1000])));
            assert!((1000..1100).contains(&inner), "{inner}");
            std::thread::spawn(|| drop(black_box(vec![0u8; 1 << 20])))
                .join()
                .unwrap();
        });
        assert!((50_000..60_000).contains(&outer), "{outer}");
    }
}
