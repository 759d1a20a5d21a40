//! The health port: `/healthz`, `/readyz`, `/ready` (ANP's bodies and codes).

use std::sync::Arc;

use axum::{Router, extract::State, http::StatusCode, routing::get};

use crate::{metrics::SharedMetrics, tunnels::Tunnels};

/// Body of `/readyz` when no agent is connected.
pub const NOT_READY: &str = "no connection to any proxy agent";

/// What the health handlers read.
#[derive(Clone)]
pub(crate) struct HealthState {
    /// Shared proxy state.
    pub(crate) tunnels: Arc<Tunnels>,
    /// Metrics registry.
    pub(crate) metrics: SharedMetrics,
}

/// Routes of the health port.
pub(crate) fn router(state: HealthState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/ready", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn metrics(
    State(state): State<HealthState>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(&state.tunnels),
    )
}

async fn readyz(State(state): State<HealthState>) -> (StatusCode, &'static str) {
    if state.tunnels.backends.is_ready() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, NOT_READY)
    }
}
