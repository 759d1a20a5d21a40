//! Counting servers by their Leases (`--count-server-leases`): a watch on
//! the Leases of `--lease-namespace` that match `--lease-label-selector`,
//! counted when still valid (ANP's rule, see `ops::kube::lease_is_valid`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures_util::{FutureExt, StreamExt};
use k8s_openapi::{api::coordination::v1::Lease, jiff::Timestamp};
use kube::{
    Api,
    runtime::{WatchStreamExt, reflector, watcher},
};
use tokio_util::sync::CancellationToken;

use crate::{config::LeaseCountConfig, metrics::LeaseMetrics};
use ops::{
    error::DisplayErrorStack,
    kube::{KubeSetupError, lease_is_valid},
};
use tracing::{debug, warn};

/// How long one kube API request may take (a watch is re-established by
/// kube-runtime with its own backoff).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// The current count of valid leases, kept up to date by [`LeaseWatch`].
pub(crate) struct LeaseCounter {
    /// Leases seen by the watch.
    store: reflector::Store<Lease>,
    /// The last count taken after the first complete list (0: none yet).
    last: AtomicUsize,
}

impl LeaseCounter {
    /// Valid leases now; never below 1. Until the first list has arrived
    /// (or while the API is unreachable) the last count stands.
    pub(crate) fn count(&self) -> usize {
        let listed = self
            .store
            .wait_until_ready()
            .now_or_never()
            .is_some_and(|ready| ready.is_ok());
        if listed {
            let now = Timestamp::now();
            let valid = self
                .store
                .state()
                .iter()
                .filter(|lease| lease_is_valid(lease, now))
                .count();
            self.last.store(valid, Ordering::Relaxed);
        }
        self.last.load(Ordering::Relaxed).max(1)
    }
}

/// The watch that feeds a [`LeaseCounter`]; [`run`](Self::run) it.
pub(crate) struct LeaseWatch {
    api: Api<Lease>,
    selector: String,
    writer: reflector::store::Writer<Lease>,
}

/// Sets up the kube client and an empty counter.
///
/// # Errors
/// The kubeconfig (or in-cluster configuration) cannot be used.
pub(crate) async fn counter(
    config: &LeaseCountConfig,
    metrics: LeaseMetrics,
) -> Result<(Arc<LeaseCounter>, LeaseWatch), KubeSetupError> {
    let observer: ops::kube::Observer = Arc::new(move |call| metrics.lease_call(call));
    let client = ops::kube::observed_client(
        config.kubeconfig.as_deref(),
        REQUEST_TIMEOUT,
        Some(observer),
    )
    .await?;
    let (store, writer) = reflector::store();
    Ok((
        Arc::new(LeaseCounter {
            store,
            last: AtomicUsize::new(0),
        }),
        LeaseWatch {
            api: Api::namespaced(client, &config.namespace),
            selector: config.selector.clone(),
            writer,
        },
    ))
}

impl LeaseWatch {
    /// Lists and watches until `stop`, retrying with kube-runtime's backoff.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let Self {
            api,
            selector,
            writer,
        } = self;
        let events = reflector(
            writer,
            watcher(api, watcher::Config::default().labels(&selector)),
        )
        .default_backoff();
        tokio::pin!(events);
        let mut failing = false;
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                event = events.next() => event,
            };
            match event {
                Some(Ok(_)) => {
                    if std::mem::take(&mut failing) {
                        debug!("lease watch recovered");
                    }
                }
                Some(Err(error)) => {
                    // Logged once per outage; the last count stands meanwhile.
                    if !std::mem::replace(&mut failing, true) {
                        warn!(error = %DisplayErrorStack(&error), "cannot watch server leases; keeping the last count");
                    }
                }
                None => return,
            }
        }
    }
}
