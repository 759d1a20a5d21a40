//! The health port: `/healthz`, `/metrics`, and `/readyz`/`/ready` with
//! ANP's check-by-check body; the admin port: `/metrics` redirected to the
//! health port, profiles. Every route answers any method, as Go's mux does.

use std::sync::Arc;

use axum::{
    Router,
    body::Body,
    extract::{RawQuery, State},
    http::{HeaderMap, Method, Response, StatusCode, Uri, header},
    routing::any,
};

use crate::metrics::{AgentMetrics, Live};

/// Routes of the health port.
pub(crate) fn router(metrics: Arc<AgentMetrics>, state: Arc<dyn Live>) -> Router {
    let render = move || metrics.render();
    Router::new()
        .route("/healthz", any(|| async { "ok" }))
        .route("/readyz", any(readyz))
        .route("/ready", any(readyz))
        .route(
            "/metrics",
            any(move || {
                let text = render();
                async move { ([(header::CONTENT_TYPE, ops::metrics::CONTENT_TYPE)], text) }
            }),
        )
        .with_state(state)
}

/// Routes of the admin port: `/metrics` answers 301 to the same URL on the
/// health port (ANP), and with `--enable-profiling` CPU profiles are served
/// under `/debug/pprof/`.
pub(crate) fn admin_router(health_port: u16, profiling: bool) -> Router {
    let router = Router::new().route(
        "/metrics",
        any(
            move |method: Method, uri: Uri, headers: HeaderMap| async move {
                metrics_redirect(&method, &uri, &headers, health_port)
            },
        ),
    );
    if profiling {
        router.merge(ops::profiling::router())
    } else {
        router
    }
}

/// ANP's admin `/metrics`: the request URL with its host moved to the health
/// port (`//host:port/metrics?query`, scheme-less as Go's `URL.String` gives
/// it for a server request), answered with `http.Redirect(…, 301)`.
fn metrics_redirect(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    health_port: u16,
) -> Response<Body> {
    // Go's `r.Host`: the request target's authority, else the Host header.
    let host_header = headers
        .get(header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
    let request_host = uri
        .authority()
        .map(|a| a.as_str().to_owned())
        .or(host_header)
        .unwrap_or_default();
    // No port (or not splittable): Go keeps the whole of it.
    let host = ops::http::split_host(&request_host).unwrap_or(&request_host);
    let mut url = String::new();
    if let Some(scheme) = uri.scheme_str() {
        url.push_str(scheme);
        url.push(':');
    }
    url.push_str("//");
    url.push_str(&ops::http::join_host_port(host, health_port));
    url.push_str(uri.path());
    if let Some(query) = uri.query() {
        url.push('?');
        url.push_str(query);
    }
    ops::http::redirect(method, &url, StatusCode::MOVED_PERMANENTLY)
}

async fn readyz(
    State(state): State<Arc<dyn Live>>,
    RawQuery(query): RawQuery,
) -> (StatusCode, String) {
    // Go's `r.URL.Query()["verbose"]`: the key present, with any value.
    let verbose = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .any(|(key, _)| key == "verbose");
    readiness(state.server_connections() > 0, verbose)
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

    fn location(uri: &str, host: Option<&str>) -> String {
        let mut headers = HeaderMap::new();
        if let Some(host) = host {
            headers.insert(header::HOST, host.parse().unwrap());
        }
        let response = metrics_redirect(&Method::GET, &uri.parse().unwrap(), &headers, 8093);
        assert_eq!(response.status(), StatusCode::MOVED_PERMANENTLY);
        response.headers()[header::LOCATION]
            .to_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn metrics_redirect_is_gos_url() {
        for (uri, host, want) in [
            ("/metrics", Some("node-1:8094"), "//node-1:8093/metrics"),
            (
                "/metrics?a=1&b",
                Some("10.0.0.1:8094"),
                "//10.0.0.1:8093/metrics?a=1&b",
            ),
            ("/metrics?", Some("h:1"), "//h:8093/metrics?"),
            ("/metrics", Some("[::1]:8094"), "//[::1]:8093/metrics"),
            ("/metrics", Some("node-1"), "//node-1:8093/metrics"),
            ("/metrics", None, "//:8093/metrics"),
            (
                "http://a:1/metrics?x",
                Some("b:2"),
                "http://a:8093/metrics?x",
            ),
        ] {
            assert_eq!(location(uri, host), want, "{uri} {host:?}");
        }
    }
}
