//! The kube API client both binaries use (TokenReview, Leases): from
//! `--kubeconfig`, else the in-cluster configuration; [`selector`] checks
//! label selector flags.

pub mod selector;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::{
    api::coordination::v1::Lease,
    jiff::{SignedDuration, Timestamp},
};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// The kube client could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum KubeSetupError {
    /// The kubeconfig file could not be read or used.
    #[error("cannot use --kubeconfig {path}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No kubeconfig was given and the in-cluster configuration is missing.
    #[error("--kubeconfig is empty and there is no in-cluster configuration")]
    InCluster(#[source] kube::config::InClusterError),
    /// The client could not be built.
    #[error("cannot build the kube client")]
    Client(#[source] kube::Error),
}

/// What a lease call was, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `GET` of a collection.
    List,
    /// `GET` of a collection with `watch=true`.
    Watch,
    /// `DELETE`.
    Delete,
    /// Anything else.
    Other,
}

/// One kube API call as an observer sees it.
#[derive(Debug, Clone)]
pub struct Call {
    /// Its kind.
    pub kind: CallKind,
    /// The HTTP status, or 0 when no answer came.
    pub status: u16,
    /// Until the response headers (or the failure).
    pub took: Duration,
}

/// Told of every call a client makes.
pub type Observer = Arc<dyn Fn(&Call) + Send + Sync>;

/// The API's `reason` for an HTTP status, as `apierrors.ReasonForError`
/// gives it for the errors the API returns ("" on success or no answer).
pub fn status_reason(status: u16) -> &'static str {
    match status {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Expired",
        413 => "RequestEntityTooLarge",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "",
    }
}

/// A client from `kubeconfig` (or in-cluster) whose requests each give up
/// after `timeout` and are not retried by kube itself: callers retry on
/// their own schedule.
///
/// # Errors
/// See [`KubeSetupError`].
pub async fn client(
    kubeconfig: Option<&Path>,
    timeout: Duration,
) -> Result<kube::Client, KubeSetupError> {
    observed_client(kubeconfig, timeout, None).await
}

/// [`client`], with `observer` told of every call.
///
/// # Errors
/// See [`KubeSetupError`].
pub async fn observed_client(
    kubeconfig: Option<&Path>,
    timeout: Duration,
    observer: Option<Observer>,
) -> Result<kube::Client, KubeSetupError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let wrap =
                |source: Box<dyn std::error::Error + Send + Sync>| KubeSetupError::Kubeconfig {
                    path: path.to_owned(),
                    source,
                };
            let file = Kubeconfig::read_from(path).map_err(|e| wrap(Box::new(e)))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| wrap(Box::new(e)))?
        }
        None => kube::Config::incluster().map_err(KubeSetupError::InCluster)?,
    };
    config.default_retry = false;
    config.connect_timeout = Some(timeout);
    config.read_timeout = Some(timeout);
    let builder = kube::client::ClientBuilder::try_from(config).map_err(KubeSetupError::Client)?;
    Ok(match observer {
        Some(observer) => builder
            .with_layer(&tower::layer::layer_fn(move |inner| Observed {
                inner,
                observer: observer.clone(),
            }))
            .build(),
        None => builder.build(),
    })
}

/// Tells an [`Observer`] of each call through `inner`.
struct Observed<S> {
    inner: S,
    observer: Observer,
}

fn kind_of<B>(request: &http::Request<B>) -> CallKind {
    let collection = request.uri().path().ends_with("/leases");
    let watch = request
        .uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    match *request.method() {
        http::Method::GET if collection && watch => CallKind::Watch,
        http::Method::GET if collection => CallKind::List,
        http::Method::DELETE => CallKind::Delete,
        _ => CallKind::Other,
    }
}

impl<S, B, R> tower::Service<http::Request<B>> for Observed<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let kind = kind_of(&request);
        let started = std::time::Instant::now();
        let observer = self.observer.clone();
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await;
            let status = response.as_ref().map_or(0, |r| r.status().as_u16());
            observer(&Call {
                kind,
                status,
                took: started.elapsed(),
            });
            response
        })
    }
}

/// Whether `lease` is still valid at `now` (ANP's rule, shared by the
/// server's garbage collection and the agents' count): renewTime, else
/// acquireTime, plus leaseDurationSeconds is in the future. A lease without
/// those fields is not valid.
pub fn lease_is_valid(lease: &Lease, now: Timestamp) -> bool {
    let Some(spec) = &lease.spec else {
        return false;
    };
    let (Some(since), Some(seconds)) = (
        spec.renew_time.as_ref().or(spec.acquire_time.as_ref()),
        spec.lease_duration_seconds,
    ) else {
        return false;
    };
    since
        .0
        .checked_add(SignedDuration::from_secs(i64::from(seconds)))
        .is_ok_and(|end| end > now)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::coordination::v1::LeaseSpec, apimachinery::pkg::apis::meta::v1::MicroTime,
    };

    use super::*;

    #[test]
    fn validity_uses_renew_then_acquire_time() {
        let now = Timestamp::now();
        let at = |ago: i64| MicroTime(now.checked_sub(SignedDuration::from_secs(ago)).unwrap());
        let lease = |acquire: Option<i64>, renew: Option<i64>, secs: Option<i32>| Lease {
            spec: Some(LeaseSpec {
                acquire_time: acquire.map(at),
                renew_time: renew.map(at),
                lease_duration_seconds: secs,
                ..LeaseSpec::default()
            }),
            ..Lease::default()
        };
        assert!(lease_is_valid(&lease(Some(100), Some(10), Some(30)), now));
        assert!(
            !lease_is_valid(&lease(Some(10), Some(40), Some(30)), now),
            "renewTime wins"
        );
        assert!(lease_is_valid(&lease(Some(10), None, Some(30)), now));
        assert!(!lease_is_valid(&lease(Some(10), None, None), now));
        assert!(!lease_is_valid(&Lease::default(), now));
    }
}
