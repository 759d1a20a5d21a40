//! jemalloc's own figures as metrics, for a process whose global allocator
//! is jemalloc: what the program holds (`allocated`), the pages that hold
//! it (`active`), what the allocator keeps resident besides (freed pages
//! not yet given back, `dirty`; its `metadata`), and the address space it
//! keeps unmapped for reuse (`retained`). Set beside the process's RSS,
//! they tell live memory from memory the allocator has not returned yet.
//!
//! A binary turns them on with [`expose`] (before it builds its metrics):
//! only it knows its allocator, and a test process linking this crate on
//! another allocator shows none.

use prometheus_client::metrics::MetricType;
use tikv_jemalloc_ctl::{Access, AsName, epoch, stats};

use super::Metrics;

/// Exposes jemalloc's figures in every [`Metrics`] that
/// [`super::register_process`] fills from now on. Call it only where
/// jemalloc is the global allocator.
pub fn expose() {
    let _ = super::ALLOCATOR_PROBES.set(register);
}

/// Bytes of the dirty pages of every arena: freed, still resident, not yet
/// purged (given back to the system after `dirty_decay_ms`).
fn dirty() -> Option<f64> {
    // `stats.arenas.<MALLCTL_ARENAS_ALL>`: the arenas merged.
    let pages: usize = b"stats.arenas.4096.pdirty\0".name().read().ok()?;
    let page: usize = b"arenas.page\0".name().read().ok()?;
    Some((pages * page) as f64)
}

/// Registers the gauges.
///
/// jemalloc's statistics are a snapshot taken when its epoch advances. The
/// first probe (probes are read in registration order) advances it, so
/// that one scrape reads every figure from the same snapshot.
fn register(metrics: &mut Metrics) {
    let bytes = |read: tikv_jemalloc_ctl::Result<usize>| read.ok().map(|b| b as f64);
    metrics.probe(
        "konnectivity_rs_jemalloc_allocated_bytes",
        "Bytes allocated by the program and not freed, including objects held in jemalloc's thread caches (jemalloc stats.allocated; konnectivity-rs).",
        MetricType::Gauge,
        move || {
            epoch::advance().ok()?;
            bytes(stats::allocated::read())
        },
    );
    metrics.probe(
        "konnectivity_rs_jemalloc_active_bytes",
        "Bytes in the pages that hold allocated objects (jemalloc stats.active; konnectivity-rs).",
        MetricType::Gauge,
        move || bytes(stats::active::read()),
    );
    metrics.probe(
        "konnectivity_rs_jemalloc_dirty_bytes",
        "Bytes in freed pages jemalloc keeps resident until its decay purges them (jemalloc stats.arenas.<all>.pdirty; konnectivity-rs).",
        MetricType::Gauge,
        dirty,
    );
    metrics.probe(
        "konnectivity_rs_jemalloc_metadata_bytes",
        "Bytes of jemalloc's own metadata (jemalloc stats.metadata; konnectivity-rs).",
        MetricType::Gauge,
        move || bytes(stats::metadata::read()),
    );
    metrics.probe(
        "konnectivity_rs_jemalloc_resident_bytes",
        "Bytes in pages jemalloc has mapped that are resident, at most (jemalloc stats.resident; konnectivity-rs).",
        MetricType::Gauge,
        move || bytes(stats::resident::read()),
    );
    metrics.probe(
        "konnectivity_rs_jemalloc_retained_bytes",
        "Bytes of address space jemalloc keeps for reuse, not resident (jemalloc stats.retained; konnectivity-rs).",
        MetricType::Gauge,
        move || bytes(stats::retained::read()),
    );
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// The figures of one scrape, by the name's end (`allocated`, …).
    fn figures(text: &str) -> std::collections::BTreeMap<String, f64> {
        text.lines()
            .filter_map(|l| l.strip_prefix("konnectivity_rs_jemalloc_"))
            .filter_map(|l| {
                let (name, value) = l.split_once("_bytes ")?;
                Some((name.to_owned(), value.parse().ok()?))
            })
            .collect()
    }

    /// This test binary allocates with jemalloc (`lib.rs`), as the binaries
    /// do: the figures are there, consistent, and follow an allocation.
    #[test]
    fn the_figures_follow_what_the_program_holds() {
        let scrape = || {
            let mut m = Metrics::default();
            super::super::register_process(&mut m);
            figures(&Arc::new(m).render())
        };
        assert!(scrape().is_empty(), "shown before expose()");
        expose();
        let before = scrape();
        let names: Vec<&str> = before.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "active",
                "allocated",
                "dirty",
                "metadata",
                "resident",
                "retained"
            ]
        );
        assert!(before["allocated"] > 0.0, "{before:?}");
        assert!(before["allocated"] <= before["active"], "{before:?}");
        assert!(before["active"] <= before["resident"], "{before:?}");

        // 64 MiB, every page touched: a large allocation of its own.
        const BIG: usize = 64 << 20;
        let held = vec![1u8; BIG];
        let during = scrape();
        assert!(
            during["allocated"] >= before["allocated"] + BIG as f64,
            "{before:?} {during:?}"
        );
        assert!(
            during["resident"] >= before["resident"] + BIG as f64,
            "{before:?} {during:?}"
        );
        drop(held);
        let after = scrape();
        // Less by the 64 MiB, give or take what the scrape allocates.
        assert!(
            after["allocated"] < during["allocated"] - (BIG / 2) as f64,
            "{during:?} {after:?}"
        );
    }
}
