//! The health port: `/healthz`, `/readyz`, `/ready` (ANP's bodies and codes).

use std::sync::Arc;

use axum::{Router, extract::State, http::StatusCode, routing::get};

use crate::tunnels::Tunnels;

/// Body of `/readyz` when no agent is connected.
pub const NOT_READY: &str = "no connection to any proxy agent";

/// Routes of the health port.
pub(crate) fn router(tunnels: Arc<Tunnels>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/ready", get(readyz))
        .with_state(tunnels)
}

async fn readyz(State(tunnels): State<Arc<Tunnels>>) -> (StatusCode, &'static str) {
    if tunnels.backends.is_ready() {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, NOT_READY)
    }
}
