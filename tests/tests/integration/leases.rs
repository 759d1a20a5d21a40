//! Lease-based server counting against a local stand-in of the Lease API:
//! the server publishes, renews, garbage-collects and finally deletes its
//! Lease (`--enable-lease-controller`); the agent counts the valid Leases
//! that match its selector (`--count-server-leases`,
//! `--server-count-source`).

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

use std::{collections::BTreeMap, time::Duration};

use integration_tests::{
    AgentOpts, ServerOpts, TestAgent, TestServer, lease_stub::LeaseStub, wait_for,
};
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::{SignedDuration, Timestamp},
};
use proxy_agent::config::{LeaseCountConfig, ServerCountSource};
use proxy_server::lease::LeaseConfig;

const NAMESPACE: &str = "kube-system";
const LABEL: (&str, &str) = ("k8s-app", "konnectivity-server");

/// A lease renewed `ago` seconds ago for `seconds`, with `labels`.
fn lease(name: &str, labels: &[(&str, &str)], ago: i64, seconds: i32) -> Lease {
    let renewed = MicroTime(
        Timestamp::now()
            .checked_sub(SignedDuration::from_secs(ago))
            .unwrap(),
    );
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(NAMESPACE.to_owned()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(name.to_owned()),
            lease_duration_seconds: Some(seconds),
            acquire_time: Some(renewed.clone()),
            renew_time: Some(renewed),
            ..LeaseSpec::default()
        }),
    }
}

fn find(stub: &LeaseStub, name: &str) -> Option<Lease> {
    stub.leases(NAMESPACE)
        .into_iter()
        .find(|l| l.metadata.name.as_deref() == Some(name))
}

fn lease_config(stub: &LeaseStub) -> LeaseConfig {
    LeaseConfig {
        renew_interval: Duration::from_millis(200),
        ..LeaseConfig::new(
            NAMESPACE.to_owned(),
            BTreeMap::from([(LABEL.0.to_owned(), LABEL.1.to_owned())]),
            Some(stub.kubeconfig.clone()),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_publishes_renews_collects_and_deletes_its_lease() {
    let stub = LeaseStub::start().await;
    stub.put(lease("konnectivity-proxy-server-gone", &[LABEL], 120, 30));
    stub.put(lease("konnectivity-proxy-server-live", &[LABEL], 0, 30));
    stub.put(lease("someone-elses", &[("app", "other")], 120, 30));

    let server = TestServer::start_with(ServerOpts {
        server_id: Some("replica-a".to_owned()),
        lease: Some(lease_config(&stub)),
        ..ServerOpts::default()
    })
    .await;
    let own = "konnectivity-proxy-server-replica-a";
    wait_for("the server's lease", || find(&stub, own).is_some()).await;
    let first = find(&stub, own).unwrap();
    let spec = first.spec.clone().unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("replica-a"));
    assert_eq!(spec.lease_duration_seconds, Some(30));
    assert_eq!(
        first
            .metadata
            .labels
            .unwrap()
            .get(LABEL.0)
            .map(String::as_str),
        Some(LABEL.1)
    );

    // Expired leases with our labels are collected; others stay.
    wait_for("the expired lease to be deleted", || {
        find(&stub, "konnectivity-proxy-server-gone").is_none()
    })
    .await;
    assert!(find(&stub, "konnectivity-proxy-server-live").is_some());
    assert!(
        find(&stub, "someone-elses").is_some(),
        "other labels are not ours"
    );
    assert!(
        stub.requests()
            .iter()
            .any(|r| r.starts_with("DELETE") && r.contains("konnectivity-proxy-server-gone")),
        "{:?}",
        stub.requests()
    );

    // Renewed in place.
    let renewed = spec.renew_time.unwrap().0;
    wait_for("a renewal", || {
        find(&stub, own)
            .and_then(|l| l.spec?.renew_time)
            .is_some_and(|t| t.0 > renewed)
    })
    .await;
    assert!(
        stub.requests()
            .iter()
            .any(|r| r.starts_with("PUT") && r.contains(own))
    );

    // Shutting down deletes it.
    server.stop().await;
    assert!(find(&stub, own).is_none(), "the lease outlived the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_does_not_stop_the_server_and_the_lease_follows_recovery() {
    let stub = LeaseStub::start().await;
    stub.set_down(true);
    let server = TestServer::start_with(ServerOpts {
        server_id: Some("replica-b".to_owned()),
        lease: Some(lease_config(&stub)),
        ..ServerOpts::default()
    })
    .await;
    let agent = TestAgent::start(&server).await;
    let echo = integration_tests::destination::echo().await;
    let conn = server.dial(&echo.address()).await.unwrap();
    conn.finish().await.unwrap();
    assert!(find(&stub, "konnectivity-proxy-server-replica-b").is_none());

    stub.set_down(false);
    wait_for("the lease after the outage", || {
        find(&stub, "konnectivity-proxy-server-replica-b").is_some()
    })
    .await;
    drop(agent);
}

fn count_config(stub: &LeaseStub) -> LeaseCountConfig {
    LeaseCountConfig {
        namespace: NAMESPACE.to_owned(),
        selector: format!("{}={}", LABEL.0, LABEL.1),
        kubeconfig: Some(stub.kubeconfig.clone()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_counts_valid_matching_leases() {
    let stub = LeaseStub::start().await;
    for name in ["s1", "s2", "s3"] {
        stub.put(lease(name, &[LABEL], 0, 30));
    }
    stub.put(lease("expired", &[LABEL], 120, 30));
    stub.put(lease("unrelated", &[("app", "other")], 0, 30));

    // The server announces a count of 1; the leases say 3.
    let server = TestServer::start().await;
    let agent = TestAgent::start_with(
        server.agent_addr,
        AgentOpts {
            leases: Some(count_config(&stub)),
            ..AgentOpts::default()
        },
    )
    .await;
    server.wait_for_backends(1).await;
    let handle = agent.handle.clone();
    wait_for("a count of 3 from the leases", || {
        handle.known_server_count() == 3
    })
    .await;

    // A deleted lease is seen through the watch.
    stub.remove(NAMESPACE, "s3");
    wait_for("a count of 2", || handle.known_server_count() == 2).await;

    // A lease that expires in three seconds stops counting once it has.
    stub.put(lease("short", &[LABEL], 27, 30));
    wait_for("a count of 3 with the short lease", || {
        handle.known_server_count() == 3
    })
    .await;
    wait_for("the short lease to expire", || {
        handle.known_server_count() == 2
    })
    .await;

    // An outage keeps the last count: once the watch has been cut and its
    // retry refused, a lease deleted meanwhile is not seen.
    let before = stub.requests().len();
    stub.set_down(true);
    stub.remove(NAMESPACE, "s2");
    wait_for("the watch to retry against the outage", || {
        stub.requests().len() > before
    })
    .await;
    assert_eq!(handle.known_server_count(), 2, "the last count stands");
    stub.set_down(false);
    wait_for("the count after the outage", || {
        handle.known_server_count() == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_count_source_max_takes_the_larger_of_leases_and_answers() {
    let stub = LeaseStub::start().await;
    for name in ["s1", "s2"] {
        stub.put(lease(name, &[LABEL], 0, 30));
    }
    let server = TestServer::start_with(ServerOpts {
        server_count: 3,
        ..ServerOpts::default()
    })
    .await;
    let start = |source| {
        TestAgent::start_with(
            server.agent_addr,
            AgentOpts {
                leases: Some(count_config(&stub)),
                server_count_source: source,
                ..AgentOpts::default()
            },
        )
    };
    let by_leases = start(ServerCountSource::Default).await;
    let by_max = start(ServerCountSource::Max).await;
    server.wait_for_backends(2).await;
    let (a, b) = (by_leases.handle.clone(), by_max.handle.clone());
    wait_for("default: the leases (2); max: the answers (3)", || {
        a.known_server_count() == 2 && b.known_server_count() == 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_counts_the_leases_servers_publish() {
    let stub = LeaseStub::start().await;
    let mut servers = Vec::new();
    for id in ["p1", "p2"] {
        servers.push(
            TestServer::start_with(ServerOpts {
                server_id: Some(id.to_owned()),
                lease: Some(lease_config(&stub)),
                ..ServerOpts::default()
            })
            .await,
        );
    }
    let agent = TestAgent::start_with(
        servers[0].agent_addr,
        AgentOpts {
            leases: Some(count_config(&stub)),
            ..AgentOpts::default()
        },
    )
    .await;
    let handle = agent.handle.clone();
    wait_for("both servers counted", || handle.known_server_count() == 2).await;
    servers.pop().unwrap().stop().await;
    wait_for("the stopped server uncounted", || {
        handle.known_server_count() == 1
    })
    .await;
}
