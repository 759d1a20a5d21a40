//! The kube API client both binaries use (TokenReview, Leases): from
//! `--kubeconfig`, else the in-cluster configuration.

use std::{
    path::{Path, PathBuf},
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
    kube::Client::try_from(config).map_err(KubeSetupError::Client)
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
