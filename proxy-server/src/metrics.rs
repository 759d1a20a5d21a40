//! Prometheus metrics of the server, served on the health port's `/metrics`.
//!
//! This holds the konnectivity-rs additions (names that cannot clash with
//! ANP's `konnectivity_network_proxy_server_*`); values derived from the
//! live state are read when scraped.

use std::sync::Arc;

use prometheus_client::{encoding::text::encode, metrics::gauge::Gauge, registry::Registry};

use crate::tunnels::Tunnels;

/// The server's metrics and what they are computed from.
pub(crate) struct Metrics {
    /// Everything registered.
    registry: Registry,
    /// Bytes (payload plus per-packet overhead) the fullest connection has
    /// queued towards its frontend.
    max_buffered: Gauge,
    /// Same, summed over all connections.
    buffered: Gauge,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::default();
        let max_buffered = Gauge::default();
        let buffered = Gauge::default();
        registry.register(
            "konnectivity_rs_server_max_buffered_bytes",
            "Bytes the fullest connection has queued towards its frontend (bounded by the flow window)",
            max_buffered.clone(),
        );
        registry.register(
            "konnectivity_rs_server_buffered_bytes",
            "Bytes queued towards frontends over all connections",
            buffered.clone(),
        );
        Self {
            registry,
            max_buffered,
            buffered,
        }
    }

    /// The exposition text, with the derived gauges refreshed from `tunnels`.
    pub(crate) fn render(&self, tunnels: &Tunnels) -> String {
        let (max, total) = tunnels.buffered();
        self.max_buffered
            .set(i64::try_from(max).unwrap_or(i64::MAX));
        self.buffered.set(i64::try_from(total).unwrap_or(i64::MAX));
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

/// Shared handle for the HTTP handler.
pub(crate) type SharedMetrics = Arc<Metrics>;
