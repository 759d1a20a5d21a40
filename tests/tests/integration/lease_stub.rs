#![allow(clippy::unwrap_used)]
//! The Lease API stand-in, driven by the real kube client and kube-runtime's
//! watcher, so that tests built on it exercise what a real apiserver does.

use std::collections::BTreeMap;

use futures_util::{Stream, StreamExt};
use integration_tests::{DEADLINE, lease_stub::LeaseStub, wait_for};
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client,
    api::{
        DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions, WatchEvent,
        WatchParams,
    },
    config::{KubeConfigOptions, Kubeconfig},
    runtime::watcher,
};

const NS: &str = "kube-system";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases";

async fn config(stub: &LeaseStub) -> kube::Config {
    let file = Kubeconfig::read_from(&stub.kubeconfig).unwrap();
    kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
        .await
        .unwrap()
}

async fn api(stub: &LeaseStub, namespace: &str) -> Api<Lease> {
    Api::namespaced(Client::try_from(config(stub).await).unwrap(), namespace)
}

fn lease(name: &str, labels: &[(&str, &str)]) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(name.to_owned()),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }),
    }
}

/// Creates `lease(name, labels)` through the API.
async fn create(api: &Api<Lease>, name: &str, labels: &[(&str, &str)]) -> Lease {
    let lease = lease(name, labels);
    api.create(&PostParams::default(), &lease).await.unwrap()
}

/// The status code and reason of a failed API call.
fn api_error<T: std::fmt::Debug>(result: kube::Result<T>) -> (u16, String) {
    match result {
        Err(kube::Error::Api(status)) => (status.code, status.reason),
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn next<S: Stream + Unpin>(stream: &mut S) -> S::Item {
    tokio::time::timeout(DEADLINE, stream.next())
        .await
        .expect("timed out waiting for a watch event")
        .expect("the watch ended")
}

fn rv(lease: &Lease) -> u64 {
    let rv = lease.metadata.resource_version.as_ref().unwrap();
    rv.parse().unwrap()
}

#[tokio::test]
async fn create_get_replace_patch() {
    let stub = LeaseStub::start().await;
    let api = api(&stub, NS).await;
    let created = create(&api, "a", &[]).await;
    assert_eq!(created.metadata.namespace.as_deref(), Some(NS));
    assert!(created.metadata.uid.is_some());
    assert!(created.metadata.creation_timestamp.is_some());
    let again = api.create(&PostParams::default(), &lease("a", &[])).await;
    assert_eq!(api_error(again), (409, "AlreadyExists".to_owned()));
    let mut nameless = lease("", &[]);
    nameless.metadata.name = None;
    let nameless = api.create(&PostParams::default(), &nameless).await;
    assert_eq!(api_error(nameless), (422, "Invalid".to_owned()));

    assert_eq!(api.get("a").await.unwrap(), created);
    assert_eq!(
        api_error(api.get("missing").await),
        (404, "NotFound".to_owned())
    );

    let mut renewed = created.clone();
    renewed.spec.as_mut().unwrap().lease_transitions = Some(1);
    let replaced = api
        .replace("a", &PostParams::default(), &renewed)
        .await
        .unwrap();
    assert!(rv(&replaced) > rv(&created));
    assert_eq!(replaced.metadata.uid, created.metadata.uid);
    assert_eq!(replaced.spec.as_ref().unwrap().lease_transitions, Some(1));
    // `renewed` still carries the resourceVersion `created` had.
    let stale = api.replace("a", &PostParams::default(), &renewed).await;
    assert_eq!(api_error(stale), (409, "Conflict".to_owned()));
    let missing = api
        .replace("b", &PostParams::default(), &lease("b", &[]))
        .await;
    assert_eq!(api_error(missing), (404, "NotFound".to_owned()));

    let merge = Patch::Merge(serde_json::json!({"spec": {"holderIdentity": "other"}}));
    let patched = api
        .patch("a", &PatchParams::default(), &merge)
        .await
        .unwrap();
    assert_eq!(
        patched.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("other")
    );
    assert_eq!(patched.spec.as_ref().unwrap().lease_transitions, Some(1));
    assert!(rv(&patched) > rv(&replaced));
    let stale = Patch::Merge(serde_json::json!({"metadata": {"resourceVersion": "2"}}));
    let stale = api.patch("a", &PatchParams::default(), &stale).await;
    assert_eq!(api_error(stale), (409, "Conflict".to_owned()));
    let apply = Patch::Apply(lease("a", &[]));
    let apply = api.patch("a", &PatchParams::apply("test"), &apply).await;
    assert_eq!(api_error(apply).0, 415);
    assert_eq!(stub.leases(NS), vec![patched]);
}

#[tokio::test]
async fn list_with_label_selector() {
    let stub = LeaseStub::start().await;
    let api = api(&stub, NS).await;
    let server = [("k8s-app", "konnectivity-server")];
    for (name, labels) in [("s1", &server[..]), ("s2", &server[..]), ("other", &[][..])] {
        create(&api, name, labels).await;
    }
    // Same labels in another namespace: never listed here.
    stub.put(Lease {
        metadata: ObjectMeta {
            namespace: Some("default".to_owned()),
            ..lease("s3", &server).metadata
        },
        spec: None,
    });
    let names = async |selector: &str| -> Vec<String> {
        let list = api
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap();
        assert_eq!(list.metadata.resource_version.as_deref(), Some("5"));
        list.items
            .into_iter()
            .map(|l| l.metadata.name.unwrap())
            .collect()
    };
    assert_eq!(names("").await, ["other", "s1", "s2"]);
    assert_eq!(names("k8s-app=konnectivity-server").await, ["s1", "s2"]);
    assert_eq!(names("k8s-app==konnectivity-server").await, ["s1", "s2"]);
    assert_eq!(names("k8s-app!=konnectivity-server").await, ["other"]);
    assert_eq!(names("k8s-app").await, ["s1", "s2"]);
    assert_eq!(names("!k8s-app").await, ["other"]);
    assert_eq!(names("k8s-app,!k8s-app").await, Vec::<String>::new());
    let set_based = api
        .list(&ListParams::default().labels("k8s-app in (a, b)"))
        .await;
    assert_eq!(api_error(set_based).0, 400);
    assert!(
        stub.requests()
            .iter()
            .any(|r| r.starts_with(&format!("GET {LEASES}?"))
                && r.contains("labelSelector=k8s-app%21%3Dkonnectivity-server"))
    );
}

#[tokio::test]
async fn delete_with_preconditions() {
    let stub = LeaseStub::start().await;
    let api = api(&stub, NS).await;
    let created = create(&api, "a", &[]).await;
    let with = |resource_version: Option<String>, uid: Option<String>| DeleteParams {
        preconditions: Some(Preconditions {
            resource_version,
            uid,
        }),
        ..DeleteParams::default()
    };
    let wrong_rv = api.delete("a", &with(Some("1".to_owned()), None)).await;
    assert_eq!(api_error(wrong_rv), (409, "Conflict".to_owned()));
    let wrong_uid = api
        .delete("a", &with(None, Some("someone-else".to_owned())))
        .await;
    assert_eq!(api_error(wrong_uid), (409, "Conflict".to_owned()));
    assert_eq!(stub.leases(NS).len(), 1);

    let right = with(
        created.metadata.resource_version.clone(),
        created.metadata.uid.clone(),
    );
    let deleted = api.delete("a", &right).await.unwrap().left().unwrap();
    assert_eq!(deleted.metadata.uid, created.metadata.uid);
    assert!(stub.leases(NS).is_empty());
    assert_eq!(api_error(api.get("a").await), (404, "NotFound".to_owned()));
    assert_eq!(
        api_error(api.delete("a", &DeleteParams::default()).await).0,
        404
    );
    let deletes = stub
        .requests()
        .into_iter()
        .filter(|r| *r == format!("DELETE {LEASES}/a"));
    assert_eq!(deletes.count(), 4);
}

#[tokio::test]
async fn default_watcher_sees_creates_and_deletes() {
    let stub = LeaseStub::start().await;
    let api = api(&stub, NS).await;
    stub.put(Lease {
        metadata: ObjectMeta {
            namespace: Some(NS.to_owned()),
            ..lease("seeded", &[]).metadata
        },
        spec: None,
    });
    // Driven by its own task, as a controller would, so that the watch
    // request goes out while the test waits for it.
    let config = watcher::Config::default().labels("!ignored");
    let (events_tx, events_rx) = tokio::sync::mpsc::channel(16);
    let mut events = tokio_stream::wrappers::ReceiverStream::new(events_rx);
    let watching = tokio::spawn(watcher(api.clone(), config).for_each(move |event| {
        let events_tx = events_tx.clone();
        async move {
            let _ = events_tx.send(event.unwrap()).await;
        }
    }));
    assert!(matches!(next(&mut events).await, watcher::Event::Init));
    let watcher::Event::InitApply(seeded) = next(&mut events).await else {
        panic!("expected the seeded lease");
    };
    assert_eq!(seeded.metadata.name.as_deref(), Some("seeded"));
    assert!(matches!(next(&mut events).await, watcher::Event::InitDone));

    // Wait until the watch is open, so that the create is a watch event.
    wait_for("the watch request", || {
        stub.requests().iter().any(|r| r.contains("watch=true"))
    })
    .await;
    create(&api, "ignored", &[("ignored", "")]).await;
    create(&api, "new", &[]).await;
    let watcher::Event::Apply(new) = next(&mut events).await else {
        panic!("expected the created lease");
    };
    assert_eq!(new.metadata.name.as_deref(), Some("new"));
    stub.remove(NS, "seeded").unwrap();
    let watcher::Event::Delete(gone) = next(&mut events).await else {
        panic!("expected the deleted lease");
    };
    assert_eq!(gone.metadata.name.as_deref(), Some("seeded"));

    // What kube 5's default watcher sends: a paged, consistent list (no
    // resourceVersion), then a watch from the list's resourceVersion with
    // bookmarks and no sendInitialEvents.
    let requests = stub.requests();
    let list = format!("GET {LEASES}?&labelSelector=%21ignored&limit=500");
    assert_eq!(requests[0], list);
    let watch = format!(
        "GET {LEASES}?&watch=true&timeoutSeconds=290&labelSelector=%21ignored&allowWatchBookmarks=true&resourceVersion=2"
    );
    assert_eq!(requests[1], watch);
    watching.abort();
}

#[tokio::test]
async fn streaming_list_watcher_ends_initial_events_with_a_bookmark() {
    let stub = LeaseStub::start().await;
    let api = api(&stub, NS).await;
    create(&api, "a", &[]).await;
    let mut events = watcher(api.clone(), watcher::Config::default().streaming_lists()).boxed();
    let mut event = async || next(&mut events).await.unwrap();
    assert!(matches!(event().await, watcher::Event::Init));
    assert!(matches!(event().await, watcher::Event::InitApply(_)));
    assert!(matches!(event().await, watcher::Event::InitDone));
    create(&api, "b", &[]).await;
    let watcher::Event::Apply(b) = event().await else {
        panic!("expected the created lease");
    };
    assert_eq!(b.metadata.name.as_deref(), Some("b"));
    assert!(stub.requests()[1].contains("sendInitialEvents=true"));
}

#[tokio::test]
async fn watch_resumes_expires_and_times_out() {
    let stub = LeaseStub::start().await;
    let api = api(&stub, NS).await;
    let first = create(&api, "a", &[]).await;
    let second = create(&api, "b", &[]).await;

    // Resuming from `first` replays `second`; the watch ends at its timeout.
    let params = WatchParams::default().timeout(1);
    let from = first.metadata.resource_version.clone().unwrap();
    let mut resumed = api.watch(&params, &from).await.unwrap().boxed();
    let WatchEvent::Added(replayed) = next(&mut resumed).await.unwrap() else {
        panic!("expected the second lease");
    };
    assert_eq!(replayed, second);
    let end = tokio::time::timeout(DEADLINE, resumed.next())
        .await
        .unwrap();
    assert!(end.is_none(), "the watch outlived timeoutSeconds: {end:?}");

    // After 1000 more changes, `first`'s version is out of history.
    let mut renewed = lease("b", &[]);
    renewed.metadata.namespace = Some(NS.to_owned());
    for _ in 0..1000 {
        stub.put(renewed.clone());
    }
    let mut expired = api.watch(&params, &from).await.unwrap().boxed();
    let WatchEvent::Error(status) = next(&mut expired).await.unwrap() else {
        panic!("expected 410 Gone");
    };
    assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
    assert!(
        tokio::time::timeout(DEADLINE, expired.next())
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn down_answers_503_and_cuts_watches() {
    let stub = LeaseStub::start().await;
    let api = api(&stub, NS).await;
    let mut watch = api
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    stub.set_down(true);
    let end = tokio::time::timeout(DEADLINE, watch.next()).await.unwrap();
    assert!(end.is_none(), "the watch survived the outage: {end:?}");

    // kube retries 503 by default (15 times, backing off up to minutes) …
    let get = tokio::spawn(async move { api.get("a").await });
    let gets = || {
        stub.requests()
            .iter()
            .filter(|r| r.ends_with("/leases/a"))
            .count()
    };
    wait_for("a retried GET", || gets() >= 2).await;
    stub.set_down(false);
    let (code, _) = api_error(tokio::time::timeout(DEADLINE, get).await.unwrap().unwrap());
    assert_eq!(code, 404);

    // … so the 503 itself is seen only without that retry layer.
    let mut config = config(&stub).await;
    config.default_retry = false;
    let api: Api<Lease> = Api::namespaced(Client::try_from(config).unwrap(), NS);
    stub.set_down(true);
    let (code, reason) = api_error(api.get("a").await);
    assert_eq!((code, reason.as_str()), (503, "ServiceUnavailable"));

    // Dropping the stub ends its watches too.
    stub.set_down(false);
    let mut watch = api
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    drop(stub);
    let end = tokio::time::timeout(DEADLINE, watch.next()).await.unwrap();
    assert!(end.is_none(), "the watch outlived the stub: {end:?}");
}
