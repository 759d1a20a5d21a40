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
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn metrics(
    State(state): State<Arc<AgentState>>,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            tunnel::metrics::CONTENT_TYPE,
        )],
        state.metrics.render(),
    )
}

/// Routes of the admin port: `/metrics` answers 301 to the same path on the
/// health port (ANP), and with `--enable-profiling` CPU profiles are served
/// under `/debug/pprof/`.
pub(crate) fn admin_router(health_port: u16, profiling: bool) -> Router {
    let router = Router::new().route(
        "/metrics",
        get(move |headers: axum::http::HeaderMap| async move {
            // The host the client used, on the health port.
            let host = headers
                .get(axum::http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(host_without_port)
                .unwrap_or("127.0.0.1")
                .to_owned();
            let location = format!("http://{host}:{health_port}/metrics");
            (
                StatusCode::MOVED_PERMANENTLY,
                [(axum::http::header::LOCATION, location)],
                "",
            )
        }),
    );
    if profiling {
        router.merge(tunnel::profiling::router())
    } else {
        router
    }
}

/// `host` of `host:port` or `[v6]:port` (kept bracketed).
fn host_without_port(authority: &str) -> &str {
    match authority.rfind(':') {
        Some(i) if !authority[i..].contains(']') => &authority[..i],
        _ => authority,
    }
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
