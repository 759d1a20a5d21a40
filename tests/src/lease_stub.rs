//! A local stand-in for the kube API's `coordination.k8s.io/v1` Lease
//! endpoints: list (with label selectors), watch (resume by resourceVersion,
//! streaming lists, 410 Gone once history is gone), get, create, replace,
//! merge-patch and delete with preconditions, answered as the real
//! kube-apiserver does, over HTTPS on loopback with the kubeconfig of
//! [`kube_stub`]. Every request is recorded.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    convert::Infallible,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::{Method, Request, Response, body::Incoming, http::request::Parts};
use hyper_util::rt::TokioIo;
use k8s_openapi::{api::coordination::v1::Lease, apimachinery::pkg::apis::meta::v1::Time};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::{Pki, kube_stub};

/// Path prefix of the namespaced Lease API.
const PREFIX: &str = "/apis/coordination.k8s.io/v1/namespaces/";
/// Changes remembered for resuming watches; older resourceVersions get 410 Gone.
const HISTORY: usize = 1000;
/// Watch lines buffered per watch before its task waits for the client.
const WATCH_BUFFER: usize = 64;

type Body = BoxBody<Bytes, Infallible>;
/// A failure Status response (boxed: responses are large).
type Failed = Box<Response<Body>>;
/// A handler's answer.
type Answer = Result<Response<Body>, Failed>;
/// A lease's (namespace, name).
type Key = (String, String);

/// One change: the resourceVersion it made and its watch event
/// (`{"type": "ADDED"|"MODIFIED"|"DELETED", "object": ..}`).
type Change = (u64, Value);

/// The stub's state, behind one lock so that a watch reads history and
/// subscribes atomically.
struct Store {
    /// The global resourceVersion: the last one handed out.
    rv: u64,
    /// Leases with kind and apiVersion, as GET answers them.
    leases: BTreeMap<Key, Value>,
    /// The last [`HISTORY`] changes, oldest first.
    history: VecDeque<Arc<Change>>,
    /// The newest resourceVersion dropped from `history`; watches from older
    /// ones are expired.
    evicted: u64,
    /// Wakes open watches; sent to only under the lock, in rv order.
    changes_tx: broadcast::Sender<Arc<Change>>,
    /// `METHOD path?query` of every request.
    requests: Vec<String>,
    /// Answer 503 to everything while set.
    down: bool,
    /// Cancelled (and replaced) when the API goes down, cutting open watches.
    outage: CancellationToken,
}

/// The running stub; stops (closing every connection) when dropped.
pub struct LeaseStub {
    /// Where it listens.
    pub addr: SocketAddr,
    /// A kubeconfig for it, with [`kube_stub::SERVER_TOKEN`].
    pub kubeconfig: PathBuf,
    /// State shared with the connection tasks.
    store: Arc<Mutex<Store>>,
    /// Stops the listener, the connections and the watches.
    stop: CancellationToken,
    /// Holds the kubeconfig.
    _dir: tempfile::TempDir,
}

impl Drop for LeaseStub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl LeaseStub {
    /// Starts the stub with no lease.
    pub async fn start() -> Self {
        let pki = Pki::get();
        let (crt, key) = (pki.path("cluster.crt"), pki.path("cluster.key"));
        let tls = ops::tls::server_config_with_alpn(&crt, &key, None, &[ops::tls::ALPN_HTTP11])
            .expect("stub TLS");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let store = Arc::new(Mutex::new(Store {
            // etcd never reports 0, and watches take "0" as "any version".
            rv: 1,
            leases: BTreeMap::new(),
            history: VecDeque::new(),
            evicted: 0,
            changes_tx: broadcast::channel(HISTORY).0,
            requests: Vec::new(),
            down: false,
            outage: CancellationToken::new(),
        }));
        let stop = CancellationToken::new();
        let mut incoming = edge::listen::tls_incoming(
            listener,
            tls,
            stop.clone(),
            "lease-stub",
            64,
            std::sync::Arc::new(|| {}),
        );
        let (accepting, accept_stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            // `tls_incoming` ends when `stop` fires.
            while let Some(conn) = incoming.next().await {
                let Ok(conn) = conn else { continue };
                let (store, stop) = (accepting.clone(), accept_stop.clone());
                let service =
                    hyper::service::service_fn(move |req| answer(req, store.clone(), stop.clone()));
                let serving = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(conn), service);
                tokio::spawn(accept_stop.clone().run_until_cancelled_owned(serving));
            }
        });
        let dir = tempfile::tempdir().expect("temp dir");
        let kubeconfig = kube_stub::write_kubeconfig(dir.path(), addr);
        Self {
            addr,
            kubeconfig,
            store,
            stop,
            _dir: dir,
        }
    }

    /// The leases of `namespace`, by name.
    pub fn leases(&self, namespace: &str) -> Vec<Lease> {
        let store = self.store.lock().expect("lock");
        let ours = store.leases.iter().filter(|((ns, _), _)| ns == namespace);
        ours.map(|(_, object)| to_lease(object)).collect()
    }

    /// Stores `lease` (`metadata.namespace` and `name` required) as if a
    /// client had created or replaced it unconditionally: bumps the
    /// resourceVersion, keeps the uid and creationTimestamp of an existing one
    /// and tells the watches. Returns the lease as stored.
    pub fn put(&self, lease: Lease) -> Lease {
        let namespace = lease.metadata.namespace.clone().expect("put: a namespace");
        let key = (namespace, lease.metadata.name.clone().expect("put: a name"));
        let mut object = serde_json::to_value(lease).expect("a lease is JSON");
        let mut store = self.store.lock().expect("lock");
        let kind = if let Some(old) = store.leases.get(&key) {
            keep_identity(&mut object, old);
            "MODIFIED"
        } else {
            store.stamp(&mut object, &key.0);
            "ADDED"
        };
        to_lease(&store.record(kind, key, object))
    }

    /// Deletes a lease as a client would (watches see `DELETED`); returns it.
    pub fn remove(&self, namespace: &str, name: &str) -> Option<Lease> {
        let mut store = self.store.lock().expect("lock");
        let key = (namespace.to_owned(), name.to_owned());
        let object = store.leases.get(&key)?.clone();
        Some(to_lease(&store.record("DELETED", key, object)))
    }

    /// `METHOD path?query` of every request so far, oldest first.
    pub fn requests(&self) -> Vec<String> {
        self.store.lock().expect("lock").requests.clone()
    }

    /// Takes the API down (503 to everything, open watches cut) or brings it
    /// back.
    pub fn set_down(&self, down: bool) {
        let mut store = self.store.lock().expect("lock");
        store.down = down;
        if down {
            store.outage.cancel();
            store.outage = CancellationToken::new();
        }
    }
}

impl Store {
    /// Applies a change: bumps the resourceVersion, stores or removes the
    /// object, remembers the change and wakes the watches. Returns the object
    /// as stored (as last stored, for `DELETED`).
    fn record(&mut self, kind: &'static str, key: Key, mut object: Value) -> Value {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        if kind == "DELETED" {
            self.leases.remove(&key);
        } else {
            self.leases.insert(key, object.clone());
        }
        let change = Arc::new((self.rv, json!({"type": kind, "object": object})));
        self.history.push_back(change.clone());
        if self.history.len() > HISTORY {
            self.evicted = self.history.pop_front().map_or(0, |old| old.0);
        }
        let _ = self.changes_tx.send(change);
        object
    }

    /// Fills in what the apiserver sets on create.
    fn stamp(&self, object: &mut Value, namespace: &str) {
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let meta = &mut object["metadata"];
        meta["namespace"] = json!(namespace);
        // Unique: the resourceVersion the create will get.
        meta["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", self.rv + 1));
        meta["creationTimestamp"] = serde_json::to_value(now).expect("a time is JSON");
        object["apiVersion"] = json!("coordination.k8s.io/v1");
        object["kind"] = json!("Lease");
    }
}

/// Carries over from the stored object what an update cannot change.
fn keep_identity(object: &mut Value, old: &Value) {
    for field in ["name", "namespace", "uid", "creationTimestamp"] {
        object["metadata"][field] = old["metadata"][field].clone();
    }
    object["apiVersion"] = old["apiVersion"].clone();
    object["kind"] = old["kind"].clone();
}

fn to_lease(object: &Value) -> Lease {
    serde_json::from_value(object.clone()).expect("stored objects are leases")
}

fn respond(code: u16, body: Body) -> Response<Body> {
    let response = Response::builder().status(code);
    let response = response.header(hyper::header::CONTENT_TYPE, "application/json");
    response.body(body).expect("a valid response")
}

fn object(code: u16, object: &Value) -> Answer {
    Ok(respond(code, Full::from(object.to_string()).boxed()))
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code
    })
}

/// A failure Status response.
fn failure(code: u16, reason: &str, message: &str) -> Failed {
    let body = status_object(code, reason, message).to_string();
    Box::new(respond(code, Full::from(body).boxed()))
}

fn bad_request(message: &str) -> Failed {
    failure(400, "BadRequest", message)
}

fn not_found(name: &str) -> Failed {
    let message = format!("leases.coordination.k8s.io \"{name}\" not found");
    failure(404, "NotFound", &message)
}

fn conflict(name: &str, why: &str) -> Failed {
    let message =
        format!("Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": {why}");
    failure(409, "Conflict", &message)
}

fn invalid(name: &str, why: &str) -> Failed {
    let message = format!("Lease.coordination.k8s.io \"{name}\" is invalid: {why}");
    failure(422, "Invalid", &message)
}

/// Label selector terms: (key, value for `k=v`/`k!=v` or none for `k`/`!k`,
/// negated for `!=`/`!`). `k!=v` also holds without the label, as upstream.
type Selector = Vec<(String, Option<String>, bool)>;

/// Parses equality and existence selectors; set-based ones are refused.
fn parse_selector(selector: &str) -> Result<Selector, Failed> {
    let term = |term: &str| {
        let (term, negated) = term.strip_prefix('!').map_or((term, false), |t| (t, true));
        let (key, value, negated) = match term.split_once("!=") {
            Some((key, value)) => (key, Some(value), true),
            None => match term.split_once("==").or_else(|| term.split_once('=')) {
                Some((key, value)) => (key, Some(value), negated),
                None => (term, None, negated),
            },
        };
        let (key, value) = (key.trim().to_owned(), value.map(|v| v.trim().to_owned()));
        let valid = !key.is_empty() && !key.contains([' ', '(', ')']);
        valid.then_some((key, value, negated))
    };
    let unparsable = |t: &str| bad_request(&format!("unable to parse requirement: {t}"));
    let terms = selector.split(',').map(str::trim).filter(|t| !t.is_empty());
    terms
        .map(|t| term(t).ok_or_else(|| unparsable(t)))
        .collect()
}

fn selects(selector: &Selector, object: &Value) -> bool {
    let labels = &object["metadata"]["labels"];
    selector.iter().all(|(key, value, negated)| {
        let holds = match value {
            Some(value) => labels[key].as_str() == Some(value),
            None => labels.get(key).is_some(),
        };
        holds != *negated
    })
}

async fn answer(
    req: Request<Incoming>,
    store: Arc<Mutex<Store>>,
    stop: CancellationToken,
) -> Result<Response<Body>, hyper::Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    let mut store = store.lock().expect("lock");
    let target = parts.uri.to_string();
    let request = format!("{} {}", parts.method, target.trim_end_matches('?'));
    store.requests.push(request);
    Ok(route(&mut store, &stop, &parts, &body).unwrap_or_else(|failed| *failed))
}

fn route(store: &mut Store, stop: &CancellationToken, parts: &Parts, body: &[u8]) -> Answer {
    if store.down {
        let message = "the server is currently unable to handle the request";
        return Err(failure(503, "ServiceUnavailable", message));
    }
    let token = parts.headers.get(hyper::header::AUTHORIZATION);
    if token.and_then(|v| v.to_str().ok()) != Some(&format!("Bearer {}", kube_stub::SERVER_TOKEN)) {
        return Err(failure(401, "Unauthorized", "Unauthorized"));
    }
    let path = parts.uri.path().strip_prefix(PREFIX).unwrap_or_default();
    let (namespace, name) = match path.split('/').collect::<Vec<_>>().as_slice() {
        [ns, "leases"] if !ns.is_empty() => ((*ns).to_owned(), None),
        [ns, "leases", name] if !ns.is_empty() && !name.is_empty() => {
            ((*ns).to_owned(), Some((*name).to_owned()))
        }
        _ => {
            let message = "the server could not find the requested resource";
            return Err(failure(404, "NotFound", message));
        }
    };
    let query = parts.uri.query().unwrap_or_default().as_bytes();
    let query: HashMap<String, String> = form_urlencoded::parse(query).into_owned().collect();
    let flag = |key: &str| matches!(query.get(key).map(String::as_str), Some("true" | "1"));
    let selector = parse_selector(query.get("labelSelector").map_or("", String::as_str))?;
    let content_type = parts.headers.get(hyper::header::CONTENT_TYPE);
    let merge =
        content_type.is_some_and(|v| v.as_bytes().starts_with(b"application/merge-patch+json"));
    match (&parts.method, name) {
        (&Method::GET, None) if flag("watch") => {
            let initial = flag("sendInitialEvents");
            let bookmark = initial && flag("allowWatchBookmarks");
            let cut = [store.outage.clone(), stop.clone()];
            watch(store, namespace, selector, &query, (initial, bookmark), cut)
        }
        (&Method::GET, None) => {
            let ours =
                |((ns, _), lease): &(&Key, &Value)| *ns == namespace && selects(&selector, lease);
            let items: Vec<&Value> = store.leases.iter().filter(ours).map(|(_, l)| l).collect();
            let metadata = json!({"resourceVersion": store.rv.to_string()});
            let list = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "LeaseList", "metadata": metadata, "items": items});
            object(200, &list)
        }
        (&Method::GET, Some(name)) => match store.leases.get(&(namespace, name.clone())) {
            Some(lease) => object(200, lease),
            None => Err(not_found(&name)),
        },
        (&Method::POST, None) => create(store, namespace, body),
        (&Method::PUT, Some(name)) => {
            let lease = parse_lease(body, &namespace, Some(&name))?;
            update(store, (namespace, name), lease)
        }
        (&Method::PATCH, Some(name)) if merge => patch(store, (namespace, name), body),
        (&Method::PATCH, Some(_)) => {
            let message = "accepted media types include: application/merge-patch+json";
            Err(failure(415, "UnsupportedMediaType", message))
        }
        (&Method::DELETE, Some(name)) => delete(store, (namespace, name), body),
        _ => Err(failure(405, "MethodNotAllowed", "")),
    }
}

/// Starts a watch. The lines it opens with are computed under the store lock
/// together with the subscription, so no change is lost or sent twice; it
/// ends at `timeoutSeconds` or when a `cut` token fires.
fn watch(
    store: &Store,
    namespace: String,
    selector: Selector,
    query: &HashMap<String, String>,
    (send_initial, bookmark): (bool, bool),
    [outage, stop]: [CancellationToken; 2],
) -> Answer {
    let since = match query.get("resourceVersion").map(String::as_str) {
        None | Some("" | "0") => None,
        Some(rv) => {
            let invalid = |_| bad_request(&format!("invalid resource version: {rv}"));
            Some(rv.parse::<u64>().map_err(invalid)?)
        }
    };
    let timeout = query.get("timeoutSeconds").and_then(|s| s.parse().ok());
    let ours = move |object: &Value| {
        object["metadata"]["namespace"].as_str() == Some(&namespace) && selects(&selector, object)
    };
    let line = |event: &Value| Bytes::from(format!("{event}\n"));
    let event = |kind: &str, object: &Value| line(&json!({"type": kind, "object": object}));
    let mut first = Vec::new();
    match since {
        Some(since) if since < store.evicted => {
            // An expired watch is one ERROR line.
            let message = format!("too old resource version: {since} ({})", store.evicted + 1);
            let gone = status_object(410, "Expired", &message);
            return Ok(respond(200, Full::new(event("ERROR", &gone)).boxed()));
        }
        Some(since) if !send_initial => {
            let newer = store
                .history
                .iter()
                .filter(|c| c.0 > since && ours(&c.1["object"]));
            first.extend(newer.map(|c| line(&c.1)));
        }
        // rv "0"/unset, or a streaming list: the current state first.
        _ => {
            let leases = store.leases.values().filter(|lease| ours(lease));
            first.extend(leases.map(|lease| event("ADDED", lease)));
            if bookmark {
                let annotations = json!({"k8s.io/initial-events-end": "true"});
                let metadata =
                    json!({"resourceVersion": store.rv.to_string(), "annotations": annotations});
                let mark = json!({"kind": "Lease", "apiVersion": "coordination.k8s.io/v1", "metadata": metadata});
                first.push(event("BOOKMARK", &mark));
            }
        }
    }
    let seen = store.rv;
    let mut changes_rx = store.changes_tx.subscribe();
    let (lines_tx, lines_rx) = mpsc::channel::<Bytes>(WATCH_BUFFER);
    tokio::spawn(async move {
        for bytes in first {
            if lines_tx.send(bytes).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::sleep(timeout.map_or(Duration::MAX, Duration::from_secs));
        tokio::pin!(deadline);
        loop {
            // Biased: once `set_down` returns, no later change goes out.
            let change = tokio::select! {
                biased;
                () = stop.cancelled() => return,
                () = outage.cancelled() => return,
                () = &mut deadline => return,
                () = lines_tx.closed() => return,
                // Lagging behind ends the watch; the client resumes from its last rv.
                change = changes_rx.recv() => match change {
                    Ok(change) => change,
                    Err(_) => return,
                },
            };
            let (rv, event) = &*change;
            if *rv > seen && ours(&event["object"]) && lines_tx.send(line(event)).await.is_err() {
                return;
            }
        }
    });
    let stream = ReceiverStream::new(lines_rx).map(|bytes| Ok(hyper::body::Frame::data(bytes)));
    Ok(respond(200, BodyExt::boxed(StreamBody::new(stream))))
}

/// Parses a request body as a Lease in `namespace` (named `name`, for a
/// replace), keeping it as JSON.
fn parse_lease(body: &[u8], namespace: &str, name: Option<&str>) -> Result<Value, Failed> {
    let object: Value =
        serde_json::from_slice(body).map_err(|e| bad_request(&format!("invalid JSON: {e}")))?;
    serde_json::from_value::<Lease>(object.clone())
        .map_err(|e| bad_request(&format!("not a Lease: {e}")))?;
    if !object["metadata"].is_object() {
        return Err(bad_request("a Lease needs metadata"));
    }
    let field = |field: &str| object["metadata"][field].as_str().unwrap_or_default();
    if !["", namespace].contains(&field("namespace")) {
        let what =
            "the namespace of the provided object does not match the namespace sent on the request";
        return Err(bad_request(what));
    }
    if let Some(name) = name.filter(|name| field("name") != *name) {
        let what = format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            field("name")
        );
        return Err(bad_request(&what));
    }
    Ok(object)
}

fn create(store: &mut Store, namespace: String, body: &[u8]) -> Answer {
    let mut lease = parse_lease(body, &namespace, None)?;
    let Some(name) = lease["metadata"]["name"].as_str().filter(|n| !n.is_empty()) else {
        let why = "metadata.name: Required value: name or generateName is required";
        return Err(invalid("", why));
    };
    let key = (namespace, name.to_owned());
    if store.leases.contains_key(&key) {
        let message = format!("leases.coordination.k8s.io \"{}\" already exists", key.1);
        return Err(failure(409, "AlreadyExists", &message));
    }
    store.stamp(&mut lease, &key.0);
    object(201, &store.record("ADDED", key, lease))
}

/// Stores `lease` over the stored one unless the resourceVersion it names is
/// stale.
fn update(store: &mut Store, key: Key, mut lease: Value) -> Answer {
    let old = store.leases.get(&key).ok_or_else(|| not_found(&key.1))?;
    if let Some(rv) = lease["metadata"]["resourceVersion"].as_str()
        && !rv.is_empty()
        && Some(rv) != old["metadata"]["resourceVersion"].as_str()
    {
        let why = "the object has been modified; please apply your changes to the latest version and try again";
        return Err(conflict(&key.1, why));
    }
    keep_identity(&mut lease, old);
    object(200, &store.record("MODIFIED", key, lease))
}

fn patch(store: &mut Store, key: Key, body: &[u8]) -> Answer {
    let patch: Value = serde_json::from_slice(body)
        .map_err(|e| bad_request(&format!("invalid merge patch: {e}")))?;
    let mut lease = store
        .leases
        .get(&key)
        .ok_or_else(|| not_found(&key.1))?
        .clone();
    merge_patch(&mut lease, &patch);
    if !lease["metadata"].is_object() || serde_json::from_value::<Lease>(lease.clone()).is_err() {
        return Err(invalid(&key.1, "the patched object is not a Lease"));
    }
    // A resourceVersion in the patch is a precondition; none means "any".
    lease["metadata"]["resourceVersion"] = patch["metadata"]["resourceVersion"].clone();
    update(store, key, lease)
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(entries) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(fields) = target {
        for (key, value) in entries {
            if value.is_null() {
                fields.remove(key);
            } else {
                merge_patch(fields.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

fn delete(store: &mut Store, key: Key, body: &[u8]) -> Answer {
    let options: Value = match body {
        [] => Value::Null,
        _ => serde_json::from_slice(body)
            .map_err(|e| bad_request(&format!("invalid DeleteOptions: {e}")))?,
    };
    let old = store.leases.get(&key).ok_or_else(|| not_found(&key.1))?;
    for (field, label) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
        let actual = old["metadata"][field].as_str().unwrap_or_default();
        if let Some(wanted) = options["preconditions"][field].as_str()
            && wanted != actual
        {
            let why = format!(
                "Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {actual}"
            );
            return Err(conflict(&key.1, &why));
        }
    }
    let lease = old.clone();
    object(200, &store.record("DELETED", key, lease))
}
