//! The health port: `/healthz`, and `/readyz`/`/ready` with ANP's
//! check-by-check body.

use std::sync::Arc;

use axum::{
    Router,
    extract::{Query, State},
    http::StatusCode,
    routing::get,
};

use crate::agent::AgentState;

/// Routes of the health port.
pub(crate) fn router(state: Arc<AgentState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/ready", get(readyz))
        .with_state(state)
}

async fn readyz(
    State(state): State<Arc<AgentState>>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> (StatusCode, String) {
    readiness(
        state.server_connections() > 0,
        query.contains_key("verbose"),
    )
}

/// ANP's healthz-style answer for the checks `ping` and `server-connected`.
fn readiness(connected: bool, verbose: bool) -> (StatusCode, String) {
    if !connected {
        tracing::info!("readiness check failed: no servers connected");
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "[+]ping ok\n[-]server-connected failed: no servers connected\n".to_owned(),
        );
    }
    if verbose {
        (
            StatusCode::OK,
            "[+]ping ok\n[+]server-connected ok\ncheck passed\n".to_owned(),
        )
    } else {
        (StatusCode::OK, "ok".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_match_anp() {
        assert_eq!(
            readiness(false, false),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "[+]ping ok\n[-]server-connected failed: no servers connected\n".to_owned()
            )
        );
        assert_eq!(readiness(true, false), (StatusCode::OK, "ok".to_owned()));
        assert_eq!(
            readiness(true, true).1,
            "[+]ping ok\n[+]server-connected ok\ncheck passed\n"
        );
    }
}
