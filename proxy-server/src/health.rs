//! The health port: `/healthz`, `/readyz`, `/ready`, `/metrics` (ANP's
//! bodies and codes, any method), and the admin port.

use std::sync::Arc;

use axum::{Router, extract::State, http::StatusCode, routing::any};

use crate::control::Control;

/// Body of `/readyz` when no agent is connected.
pub const NOT_READY: &str = "no connection to any proxy agent";

/// What the health handlers read.
#[derive(Clone)]
pub(crate) struct HealthState {
    /// The control core (and the metrics).
    pub(crate) control: Arc<Control>,
}

/// Routes of the admin port: `/metrics` (as on the health port) and, with
/// `--enable-profiling`, CPU profiles under `/debug/pprof/`.
pub(crate) fn admin_router(state: HealthState, profiling: bool) -> Router {
    let router = Router::new()
        .route("/metrics", any(metrics))
        .with_state(state);
    if profiling {
        router.merge(ops::profiling::router())
    } else {
        router
    }
}

/// Routes of the health port.
pub(crate) fn router(state: HealthState) -> Router {
    Router::new()
        .route("/healthz", any(|| async { "ok" }))
        .route("/readyz", any(readyz))
        .route("/ready", any(readyz))
        .route("/metrics", any(metrics))
        .with_state(state)
}

pub(crate) async fn metrics(
    State(state): State<HealthState>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(axum::http::header::CONTENT_TYPE, ops::metrics::CONTENT_TYPE)],
        state.control.metrics.render(&state.control.live()),
    )
}

async fn readyz(State(state): State<HealthState>) -> (StatusCode, &'static str) {
    if state.control.is_ready() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, NOT_READY)
    }
}
