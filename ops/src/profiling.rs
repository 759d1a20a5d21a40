//! Go-style `/debug/pprof/` endpoints for the admin port (ANP `--enable-profiling`).
//!
//! Only the CPU profile exists here: `GET /debug/pprof/profile?seconds=N` samples the whole
//! process at [`SAMPLE_FREQUENCY_HZ`] for N seconds and answers with a gzipped pprof protobuf,
//! as Go's `net/http/pprof` does, so `go tool pprof http://HOST:PORT/debug/pprof/profile` works.
//! One profile runs at a time; a concurrent request gets Go's 500 "cpu profiling already in use".
//! Unlike Go, a `seconds` that is not a whole number in `1..=300` is a 400, not a silent 30.

use std::{
    error::Error,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use axum::{
    Router,
    extract::{Path, RawQuery},
    http::{HeaderValue, Method, StatusCode, header},
    response::{IntoResponse, Response},
    routing::any,
};
use flate2::{Compression, write::GzEncoder};
use pprof::{ProfilerGuard, ProfilerGuardBuilder, protos::Message};
use tracing::{info, warn};

use crate::error::DisplayErrorStack;

/// How long a profile samples when the request gives no `seconds` (Go's default).
pub const DEFAULT_PROFILE_DURATION: Duration = Duration::from_secs(30);

/// The longest profile a request may ask for; it bounds how long the profiler stays busy.
pub const MAX_PROFILE_DURATION: Duration = Duration::from_secs(300);

/// Samples per second of CPU time, the same as Go's `runtime/pprof`.
pub const SAMPLE_FREQUENCY_HZ: i32 = 100;

/// Shared objects whose frames are not unwound: unwinding through them from a signal handler
/// can deadlock or read bad DWARF (pprof-rs README).
const UNWIND_BLOCKLIST: [&str; 4] = ["libc", "libgcc", "pthread", "vdso"];

/// Go profile names that this build does not serve.
const UNAVAILABLE_PROFILES: [&str; 9] = [
    "allocs",
    "block",
    "cmdline",
    "goroutine",
    "heap",
    "mutex",
    "symbol",
    "threadcreate",
    "trace",
];

/// Set while a CPU profile runs; the profiler is process-wide, so there is one slot.
static PROFILE_SLOT: AtomicBool = AtomicBool::new(false);

/// The `/debug/pprof/` routes, to be merged into an admin server's router;
/// like Go's handlers they answer every method.
pub fn router() -> Router {
    Router::new()
        .route("/debug/pprof", any(redirect_to_index))
        .route("/debug/pprof/", any(index))
        .route("/debug/pprof/profile", any(profile))
        .route("/debug/pprof/{name}", any(unavailable))
}

/// Why a profile request failed.
#[derive(Debug, thiserror::Error)]
enum ProfileError {
    /// `seconds` is not a whole number.
    #[error("invalid seconds {0:?}: want a whole number of seconds from 1 to 300")]
    InvalidSeconds(String),
    /// `seconds` is a number outside `1..=300`.
    #[error("seconds {0} out of range: want a whole number of seconds from 1 to 300")]
    SecondsOutOfRange(i64),
    /// Another request holds the profiler (Go's `StartCPUProfile` error text).
    #[error("cpu profiling already in use")]
    AlreadyRunning,
    /// The profiler could not start (signal handler or timer set-up).
    #[error("starting the profiler")]
    Start(#[source] pprof::Error),
    /// Collecting or symbolizing the samples failed.
    #[error("building the report")]
    Report(#[source] pprof::Error),
    /// Encoding or compressing the protobuf failed.
    #[error("encoding the profile")]
    Encode(#[source] Box<dyn Error + Send + Sync>),
    /// A blocking task panicked or was cancelled.
    #[error("profiling task failed")]
    Task(#[source] tokio::task::JoinError),
}

impl IntoResponse for ProfileError {
    fn into_response(self) -> Response {
        let (status, text) = match &self {
            Self::InvalidSeconds(_) | Self::SecondsOutOfRange(_) => {
                (StatusCode::BAD_REQUEST, self.to_string())
            }
            Self::AlreadyRunning => (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("Could not enable CPU profiling: {self}"),
            ),
            Self::Start(err) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("Could not enable CPU profiling: {err}"),
            ),
            Self::Report(_) | Self::Encode(_) | Self::Task(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("Could not build CPU profile: {}", DisplayErrorStack(&self)),
            ),
        };
        if status.is_server_error() && !matches!(self, Self::AlreadyRunning) {
            warn!(error = %DisplayErrorStack(&self), "cpu profile failed");
        }
        go_error(status, text)
    }
}

/// A text error shaped like Go's `net/http/pprof` `serveError`.
fn go_error(status: StatusCode, text: String) -> Response {
    let mut response = (status, format!("{text}\n")).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert("x-go-pprof", HeaderValue::from_static("1"));
    response
}

/// `/debug/pprof`: redirected to the index as ANP's `util.RedirectTo` does.
async fn redirect_to_index(method: Method) -> Response {
    crate::http::redirect(&method, "/debug/pprof/", StatusCode::MOVED_PERMANENTLY)
}

/// `GET /debug/pprof/`: what this build serves.
async fn index() -> Response {
    let text = format!(
        "/debug/pprof/\n\
         \n\
         profile  CPU profile in pprof format (gzipped protobuf), sampled at {SAMPLE_FREQUENCY_HZ} Hz.\n\
         \x20        ?seconds=N: 1 to {max}, default {default}; one profile at a time.\n\
         \x20        go tool pprof http://HOST:PORT/debug/pprof/profile?seconds={default}\n\
         \n\
         Not available in this build: {unavailable}.\n",
        max = MAX_PROFILE_DURATION.as_secs(),
        default = DEFAULT_PROFILE_DURATION.as_secs(),
        unavailable = UNAVAILABLE_PROFILES.join(", "),
    );
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response()
}

/// `GET /debug/pprof/{name}` for any name other than `profile`.
async fn unavailable(Path(name): Path<String>) -> Response {
    let text = if UNAVAILABLE_PROFILES.contains(&name.as_str()) {
        format!(
            "profile {name:?} is not available in this build; only the CPU profile is \
             (/debug/pprof/profile)"
        )
    } else {
        format!("Unknown profile: {name:?}")
    };
    go_error(StatusCode::NOT_FOUND, text)
}

/// `GET /debug/pprof/profile?seconds=N`.
async fn profile(RawQuery(query): RawQuery) -> Response {
    match run_profile(query.as_deref()).await {
        Ok(body) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (
                    header::CONTENT_DISPOSITION,
                    r#"attachment; filename="profile""#,
                ),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            body,
        )
            .into_response(),
        Err(err) => err.into_response(),
    }
}

/// Samples the process for the requested time and returns the gzipped pprof protobuf.
///
/// # Cancel safety
/// Dropping the future (the client went away) stops the profiler and frees the slot; a
/// blocking step already under way finishes first and then frees it.
async fn run_profile(query: Option<&str>) -> Result<Vec<u8>, ProfileError> {
    let duration = profile_duration(query)?;
    let slot = ProfileSlot::acquire().ok_or(ProfileError::AlreadyRunning)?;
    // Building the guard symbolizes a first backtrace and lists shared objects: blocking work.
    let active = tokio::task::spawn_blocking(move || ActiveProfile::start(slot))
        .await
        .map_err(ProfileError::Task)??;
    info!(profile.seconds = duration.as_secs(), "cpu profile started");
    tokio::time::sleep(duration).await;
    let body = tokio::task::spawn_blocking(move || active.finish())
        .await
        .map_err(ProfileError::Task)??;
    info!(profile.bytes = body.len(), "cpu profile finished");
    Ok(body)
}

/// Reads `seconds` from the query string as Go's `r.FormValue("seconds")` does (first value
/// wins; absent or empty means the default).
fn profile_duration(query: Option<&str>) -> Result<Duration, ProfileError> {
    let value = query.and_then(|query| {
        form_urlencoded::parse(query.as_bytes())
            .find(|(key, _)| key == "seconds")
            .map(|(_, value)| value.into_owned())
    });
    let Some(value) = value.filter(|value| !value.is_empty()) else {
        return Ok(DEFAULT_PROFILE_DURATION);
    };
    let seconds: i64 = value
        .parse()
        .map_err(|_| ProfileError::InvalidSeconds(value.clone()))?;
    match u64::try_from(seconds) {
        Ok(secs @ 1..) if secs <= MAX_PROFILE_DURATION.as_secs() => Ok(Duration::from_secs(secs)),
        _ => Err(ProfileError::SecondsOutOfRange(seconds)),
    }
}

/// Ownership of [`PROFILE_SLOT`]; dropping it frees the slot.
struct ProfileSlot(());

impl ProfileSlot {
    /// Takes the slot, or `None` when a profile is already running.
    fn acquire() -> Option<Self> {
        PROFILE_SLOT
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Self(()))
    }
}

impl Drop for ProfileSlot {
    fn drop(&mut self) {
        PROFILE_SLOT.store(false, Ordering::Release);
    }
}

/// A running profiler and the slot it holds.
struct ActiveProfile {
    /// Sampling stops when this drops; declared first so it drops before the slot is freed.
    guard: ProfilerGuard<'static>,
    /// Freed last, once the profiler has stopped.
    _slot: ProfileSlot,
}

impl ActiveProfile {
    /// Starts sampling the whole process (`setitimer(ITIMER_PROF)` + `SIGPROF`); blocking.
    fn start(slot: ProfileSlot) -> Result<Self, ProfileError> {
        let guard = ProfilerGuardBuilder::default()
            .frequency(SAMPLE_FREQUENCY_HZ)
            .blocklist(&UNWIND_BLOCKLIST)
            .build()
            .map_err(|err| match err {
                pprof::Error::Running => ProfileError::AlreadyRunning,
                err => ProfileError::Start(err),
            })?;
        Ok(Self { guard, _slot: slot })
    }

    /// Stops sampling, symbolizes and returns the gzipped pprof protobuf; blocking.
    fn finish(self) -> Result<Vec<u8>, ProfileError> {
        let Self { guard, _slot } = self;
        let report = guard.report().build().map_err(ProfileError::Report);
        drop(guard);
        let profile = report?.pprof().map_err(ProfileError::Report)?;
        let mut gzip = GzEncoder::new(Vec::new(), Compression::default());
        profile
            .write_to_writer(&mut gzip)
            .map_err(|err| ProfileError::Encode(err.into()))?;
        gzip.finish()
            .map_err(|err| ProfileError::Encode(err.into()))
    }
}

#[cfg(test)]
mod tests {
    use std::{
        future::{Future, poll_fn},
        io::Read,
        pin::pin,
        sync::{Arc, atomic::AtomicBool},
        task::Poll,
        thread::JoinHandle,
    };

    use axum::body::Body;
    use flate2::read::GzDecoder;
    use http::Request;
    use http_body_util::BodyExt;
    use pprof::protos::Profile;
    use tower::ServiceExt;

    use super::*;

    /// Serializes the tests that run a real profile when they share a process (`cargo test`).
    static PROFILER_TESTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// A thread spinning on the CPU until dropped, so a profile has samples to take.
    struct Burner {
        stop: Arc<AtomicBool>,
        thread: Option<JoinHandle<u64>>,
    }

    impl Burner {
        fn start() -> Self {
            let stop = Arc::new(AtomicBool::new(false));
            let flag = stop.clone();
            let thread = std::thread::spawn(move || {
                let mut x = 0u64;
                while !flag.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
                x
            });
            Self {
                stop,
                thread: Some(thread),
            }
        }
    }

    impl Drop for Burner {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(thread) = self.thread.take() {
                thread.join().unwrap();
            }
        }
    }

    fn get(uri: &str) -> Request<Body> {
        Request::get(uri).body(Body::empty()).unwrap()
    }

    async fn body_bytes(response: Response) -> Vec<u8> {
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec()
    }

    async fn body_text(response: Response) -> String {
        String::from_utf8(body_bytes(response).await).unwrap()
    }

    fn decode_profile(gzipped: &[u8]) -> Profile {
        assert_eq!(&gzipped[..2], &[0x1f, 0x8b], "not gzip");
        let mut raw = Vec::new();
        GzDecoder::new(gzipped).read_to_end(&mut raw).unwrap();
        Profile::parse_from_bytes(&raw).unwrap()
    }

    #[tokio::test]
    async fn one_second_profile_is_gzipped_pprof_with_samples() {
        let _serial = PROFILER_TESTS.lock().await;
        let burner = Burner::start();
        let response = router()
            .oneshot(get("/debug/pprof/profile?seconds=1"))
            .await
            .unwrap();
        drop(burner);

        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/octet-stream"
        );
        let profile = decode_profile(&body_bytes(response).await);
        assert!(!profile.sample.is_empty(), "no samples in {profile:?}");
        // 100 Hz: one sample stands for 10ms of CPU.
        assert_eq!(profile.period, 10_000_000);
        let cpu = profile
            .string_table
            .iter()
            .position(|s| s == "cpu")
            .unwrap();
        assert!(
            profile
                .sample_type
                .iter()
                .any(|t| usize::try_from(t.ty).unwrap() == cpu)
        );
        assert!(!PROFILE_SLOT.load(Ordering::Acquire), "slot not freed");
    }

    #[tokio::test]
    async fn second_concurrent_profile_gets_go_error() {
        let _serial = PROFILER_TESTS.lock().await;
        let router = router();
        let mut first = pin!(
            router
                .clone()
                .oneshot(get("/debug/pprof/profile?seconds=1"))
        );
        // One poll runs the handler up to its first await, which is after taking the slot.
        poll_fn(|cx| {
            assert!(first.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        assert!(
            PROFILE_SLOT.load(Ordering::Acquire),
            "first profile not running"
        );

        let second = router
            .oneshot(get("/debug/pprof/profile?seconds=1"))
            .await
            .unwrap();
        assert_eq!(second.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            second.headers()[header::CONTENT_TYPE],
            "text/plain; charset=utf-8"
        );
        assert_eq!(
            body_text(second).await,
            "Could not enable CPU profiling: cpu profiling already in use\n"
        );

        let first = first.await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        decode_profile(&body_bytes(first).await);
        assert!(!PROFILE_SLOT.load(Ordering::Acquire), "slot not freed");
    }

    #[tokio::test]
    async fn bad_seconds_are_rejected() {
        for (query, want) in [
            ("seconds=abc", "invalid seconds \"abc\""),
            ("seconds=1.5", "invalid seconds \"1.5\""),
            ("seconds=0", "seconds 0 out of range"),
            ("seconds=-1", "seconds -1 out of range"),
            ("seconds=301", "seconds 301 out of range"),
        ] {
            let response = router()
                .oneshot(get(&format!("/debug/pprof/profile?{query}")))
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{query}");
            let text = body_text(response).await;
            assert!(text.starts_with(want), "{query}: {text}");
            assert!(text.contains("from 1 to 300"), "{query}: {text}");
        }
    }

    #[test]
    fn seconds_default_and_bounds() {
        assert_eq!(profile_duration(None).unwrap(), DEFAULT_PROFILE_DURATION);
        assert_eq!(
            profile_duration(Some("debug=1&seconds=")).unwrap(),
            DEFAULT_PROFILE_DURATION
        );
        assert_eq!(
            profile_duration(Some("seconds=1&seconds=9")).unwrap(),
            Duration::from_secs(1)
        );
        assert_eq!(
            profile_duration(Some("seconds=300")).unwrap(),
            MAX_PROFILE_DURATION
        );
    }

    #[tokio::test]
    async fn index_lists_the_cpu_profile() {
        let response = router().oneshot(get("/debug/pprof/")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/plain; charset=utf-8"
        );
        let text = body_text(response).await;
        assert!(
            text.contains("profile  CPU profile in pprof format"),
            "{text}"
        );
        assert!(text.contains("?seconds=N: 1 to 300, default 30"), "{text}");
        assert!(
            text.contains("Not available in this build: allocs,"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn bare_path_redirects_to_index() {
        let response = router().oneshot(get("/debug/pprof")).await.unwrap();
        assert_eq!(response.status(), StatusCode::MOVED_PERMANENTLY);
        assert_eq!(response.headers()[header::LOCATION], "/debug/pprof/");
        assert_eq!(
            body_text(response).await,
            "<a href=\"/debug/pprof/\">Moved Permanently</a>.\n\n"
        );
    }

    #[tokio::test]
    async fn other_go_profiles_are_not_available() {
        for name in ["heap", "goroutine", "trace", "symbol"] {
            let response = router()
                .oneshot(get(&format!("/debug/pprof/{name}")))
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::NOT_FOUND, "{name}");
            let text = body_text(response).await;
            assert_eq!(
                text,
                format!(
                    "profile \"{name}\" is not available in this build; only the CPU profile is \
                     (/debug/pprof/profile)\n"
                )
            );
        }
        let response = router().oneshot(get("/debug/pprof/nope")).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(body_text(response).await, "Unknown profile: \"nope\"\n");
    }
}
