//! The server's Lease (`--enable-lease-controller`): agents that count
//! leases (`--count-server-leases`) learn how many servers run from them.
//!
//! As ANP: the lease `konnectivity-proxy-server-<server id>` in
//! `--lease-namespace`, labelled with `--lease-label`, held by the server id
//! for 30 s and renewed every 15 s; every 15 s the leases with those labels
//! that have expired are deleted (with a resourceVersion precondition, so a
//! lease renewed meanwhile survives); on shutdown the server deletes its own.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PostParams, Preconditions},
};
use ops::{error::DisplayErrorStack, kube::lease_is_valid};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use tunnel::ids::ServerId;

use crate::metrics::ServerMetrics;

/// How long one kube API request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What the lease controller publishes, from the flags.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// `--lease-namespace`.
    pub namespace: String,
    /// `--lease-label`, parsed.
    pub labels: BTreeMap<String, String>,
    /// `--kubeconfig`; `None` means in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
    /// `leaseDurationSeconds` (ANP: 30 s).
    pub duration: Duration,
    /// Renewal and garbage-collection interval (ANP: 15 s).
    pub renew_interval: Duration,
}

impl LeaseConfig {
    /// ANP's timings for `namespace` and `labels`.
    pub fn new(
        namespace: String,
        labels: BTreeMap<String, String>,
        kubeconfig: Option<PathBuf>,
    ) -> Self {
        Self {
            namespace,
            labels,
            kubeconfig,
            duration: Duration::from_secs(30),
            renew_interval: Duration::from_secs(15),
        }
    }
}

/// Parses `--lease-label`: comma-separated `key=value` pairs.
///
/// # Errors
/// An empty list, or an entry that is not `key=value` with a non-empty key.
pub fn parse_labels(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    for entry in text.split(',').map(str::trim) {
        match entry.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => {
                labels.insert(key.trim().to_owned(), value.trim().to_owned());
            }
            _ => return Err(format!("{entry:?} is not key=value")),
        }
    }
    Ok(labels)
}

/// The lease's name for `server_id`.
pub fn lease_name(server_id: &ServerId) -> String {
    format!("konnectivity-proxy-server-{}", server_id.0)
}

/// Publishes and renews this server's lease until `stop`, then deletes it.
pub(crate) async fn run(
    config: LeaseConfig,
    server_id: ServerId,
    metrics: Arc<ServerMetrics>,
    stop: CancellationToken,
) {
    let client = match ops::kube::client(config.kubeconfig.as_deref(), REQUEST_TIMEOUT).await {
        Ok(client) => client,
        Err(error) => {
            warn!(error = %DisplayErrorStack(&error), "lease controller cannot start; this server is not counted by lease-counting agents");
            return;
        }
    };
    let controller = Controller::new(client, config, server_id, metrics);
    info!(lease = %controller.name, namespace = %controller.config.namespace, "lease controller started");
    loop {
        if let Err(error) = controller.renew().await {
            warn!(lease = %controller.name, error = %DisplayErrorStack(&error), "cannot renew the lease; will retry");
        }
        controller.collect_garbage().await;
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(controller.config.renew_interval) => {}
        }
    }
    match controller
        .api
        .delete(&controller.name, &DeleteParams::default())
        .await
    {
        Ok(_) => info!(lease = %controller.name, "lease deleted"),
        Err(error) => {
            warn!(lease = %controller.name, error = %DisplayErrorStack(&error), "cannot delete the lease; it expires on its own");
        }
    }
}

struct Controller {
    api: Api<Lease>,
    config: LeaseConfig,
    name: String,
    server_id: ServerId,
    metrics: Arc<ServerMetrics>,
}

/// ANP's labels for a kube call's outcome: the HTTP status (0 when there
/// was no answer) and the API's reason.
fn outcome<T>(result: &Result<T, kube::Error>) -> (u16, String) {
    match result {
        Ok(_) => (200, String::new()),
        Err(kube::Error::Api(status)) => (status.code, status.reason.clone()),
        Err(_) => (0, String::new()),
    }
}

impl Controller {
    fn new(
        client: Client,
        config: LeaseConfig,
        server_id: ServerId,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            name: lease_name(&server_id),
            config,
            server_id,
            metrics,
        }
    }

    fn duration_seconds(&self) -> i32 {
        i32::try_from(self.config.duration.as_secs()).unwrap_or(i32::MAX)
    }

    /// Creates the lease, or takes it over and renews it.
    async fn renew(&self) -> Result<(), kube::Error> {
        let now = MicroTime(Timestamp::now());
        match self.api.get_opt(&self.name).await? {
            Some(mut lease) => {
                let labels = lease.metadata.labels.get_or_insert_with(BTreeMap::new);
                labels.extend(self.config.labels.clone());
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                if spec.holder_identity.as_deref() != Some(&self.server_id.0) {
                    spec.holder_identity = Some(self.server_id.0.clone());
                    spec.acquire_time = Some(now.clone());
                }
                spec.lease_duration_seconds = Some(self.duration_seconds());
                spec.renew_time = Some(now);
                // `lease` carries the resourceVersion we read: a concurrent
                // writer makes this fail with 409, retried next round.
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await?;
                debug!(lease = %self.name, "lease renewed");
            }
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        namespace: Some(self.config.namespace.clone()),
                        labels: Some(self.config.labels.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.server_id.0.clone()),
                        lease_duration_seconds: Some(self.duration_seconds()),
                        acquire_time: Some(now.clone()),
                        renew_time: Some(now),
                        ..LeaseSpec::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await?;
                info!(lease = %self.name, "lease created");
            }
        }
        Ok(())
    }

    /// Deletes the expired leases that carry our labels.
    async fn collect_garbage(&self) {
        let selector = self
            .config
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let started = Instant::now();
        let listed = self
            .api
            .list(&ListParams::default().labels(&selector))
            .await;
        let (code, reason) = outcome(&listed);
        self.metrics
            .lease_call(false, code, &reason, started.elapsed());
        let leases = match listed {
            Ok(list) => list.items,
            Err(error) => {
                warn!(error = %DisplayErrorStack(&error), "cannot list leases for garbage collection");
                return;
            }
        };
        let now = Timestamp::now();
        for lease in leases.iter().filter(|l| !lease_is_valid(l, now)) {
            let Some(name) = lease.metadata.name.as_deref() else {
                continue;
            };
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: lease.metadata.resource_version.clone(),
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            let started = Instant::now();
            let deleted = self.api.delete(name, &params).await;
            let (code, reason) = outcome(&deleted);
            self.metrics
                .lease_call(true, code, &reason, started.elapsed());
            match deleted {
                Ok(_) => {
                    self.metrics.lease_culled();
                    info!(lease = %name, "deleted an expired lease");
                }
                // Renewed or deleted meanwhile: not ours to remove.
                Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                    debug!(lease = %name, code = status.code, "expired lease changed meanwhile");
                }
                Err(error) => {
                    warn!(lease = %name, error = %DisplayErrorStack(&error), "cannot delete an expired lease");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_parse_like_anp() {
        assert_eq!(
            parse_labels("k8s-app=konnectivity-server").unwrap(),
            BTreeMap::from([("k8s-app".to_owned(), "konnectivity-server".to_owned())])
        );
        assert_eq!(parse_labels("a=1, b=").unwrap().len(), 2);
        assert!(parse_labels("").is_err());
        assert!(parse_labels("novalue").is_err());
        assert!(parse_labels("=x").is_err());
    }
}
