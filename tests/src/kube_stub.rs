//! A local stand-in for the kube API's TokenReview endpoint: HTTPS on
//! loopback, JSON in and out as the real API answers, bearer auth of the
//! server's own kubeconfig, and a kubeconfig file pointing at it.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode, body::Incoming};
use hyper_util::rt::TokioIo;
use tokio_util::sync::CancellationToken;

use crate::Pki;

/// The token the stub expects from proxy-server itself (in the kubeconfig).
pub const SERVER_TOKEN: &str = "proxy-server-kubeconfig-token";

/// Who a token belongs to, for the stub.
#[derive(Clone, Debug)]
pub struct Identity {
    /// `system:serviceaccount:<ns>:<name>` for service accounts.
    pub username: String,
    /// Audiences the token is valid for.
    pub audiences: Vec<String>,
    /// The node a bound token's pod runs on
    /// (`authentication.kubernetes.io/node-name`), if it is bound to one.
    pub node: Option<String>,
}

/// How the stub answers a review of a token given to [`TokenReviewStub::echo`]:
/// with the token in the body, the way a broken API or proxy might.
#[derive(Clone, Copy, Debug)]
pub enum Echo {
    /// 201 with the request's spec and a `status` that is not an object.
    Garbled,
    /// 400 with a plain-text body quoting the token.
    PlainError,
}

/// How slowly the stub answers, and the most reviews it had at once.
#[derive(Default)]
struct Load {
    /// Each review waits this long before its answer.
    delay: Mutex<std::time::Duration>,
    /// Reviews being answered now.
    in_flight: std::sync::atomic::AtomicUsize,
    /// The most at once so far.
    most: std::sync::atomic::AtomicUsize,
    /// While true, reviews wait (after [`Load::delay`]) for the test to
    /// release them.
    held: tokio::sync::watch::Sender<bool>,
}

/// One review being answered: counted in [`Load`] while it lives.
struct Answering<'a>(&'a Load);

impl<'a> Answering<'a> {
    fn new(load: &'a Load) -> Self {
        let now = load.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        load.most.fetch_max(now, Ordering::SeqCst);
        Self(load)
    }
}

impl Drop for Answering<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The running stub.
pub struct TokenReviewStub {
    /// Where it listens.
    pub addr: SocketAddr,
    /// A kubeconfig for it.
    pub kubeconfig: PathBuf,
    /// Known tokens.
    tokens: Arc<Mutex<HashMap<String, Identity>>>,
    /// Tokens answered with an [`Echo`].
    echoes: Arc<Mutex<HashMap<String, Echo>>>,
    /// Answer 503 to everything while set.
    down: Arc<AtomicBool>,
    /// Reviews answered so far.
    reviews: Arc<std::sync::atomic::AtomicUsize>,
    /// Every token reviewed so far (the tests send at most tens of
    /// thousands).
    seen: Arc<Mutex<HashSet<String>>>,
    /// How slowly it answers, and how many reviews it has had at once.
    load: Arc<Load>,
    /// The signing keys it publishes (`GET /openid/v1/jwks`), and how
    /// often they were read.
    keys: Arc<Published>,
    /// Stops it.
    stop: CancellationToken,
    /// Holds the kubeconfig.
    _dir: tempfile::TempDir,
}

impl Drop for TokenReviewStub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl TokenReviewStub {
    /// Starts the stub with no known token.
    pub async fn start() -> Self {
        let pki = Pki::get();
        let tls = ops::tls::server_config_with_alpn(
            &pki.path("cluster.crt"),
            &pki.path("cluster.key"),
            None,
            &[ops::tls::ALPN_HTTP11],
        )
        .expect("stub TLS");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let stop = CancellationToken::new();
        let tokens: Arc<Mutex<HashMap<String, Identity>>> = Arc::default();
        let echoes: Arc<Mutex<HashMap<String, Echo>>> = Arc::default();
        let down = Arc::new(AtomicBool::new(false));
        let reviews = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen: Arc<Mutex<HashSet<String>>> = Arc::default();
        let load = Arc::new(Load::default());
        let keys = Arc::new(Published::default());
        let mut incoming = edge::listen::tls_incoming(
            listener,
            tls,
            stop.clone(),
            "kube-stub",
            64,
            std::sync::Arc::new(|| {}),
        );
        {
            let (tokens, echoes, down, reviews, seen, load, keys, stop) = (
                tokens.clone(),
                echoes.clone(),
                down.clone(),
                reviews.clone(),
                seen.clone(),
                load.clone(),
                keys.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                use futures_util::StreamExt;
                loop {
                    let conn = tokio::select! {
                        () = stop.cancelled() => return,
                        next = incoming.next() => match next {
                            Some(Ok(conn)) => conn,
                            Some(Err(_)) => continue,
                            None => return,
                        },
                    };
                    let (tokens, echoes, down, reviews, seen, load, keys) = (
                        tokens.clone(),
                        echoes.clone(),
                        down.clone(),
                        reviews.clone(),
                        seen.clone(),
                        load.clone(),
                        keys.clone(),
                    );
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |req| {
                            answer(
                                req,
                                tokens.clone(),
                                echoes.clone(),
                                down.clone(),
                                Counted {
                                    reviews: reviews.clone(),
                                    seen: seen.clone(),
                                },
                                load.clone(),
                                keys.clone(),
                            )
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(conn), service)
                            .await;
                    });
                }
            });
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let kubeconfig = write_kubeconfig(dir.path(), addr);
        Self {
            addr,
            kubeconfig,
            tokens,
            echoes,
            down,
            reviews,
            seen,
            load,
            keys,
            stop,
            _dir: dir,
        }
    }

    /// Makes `token` valid for `identity`.
    pub fn allow(&self, token: &str, identity: Identity) {
        self.tokens
            .lock()
            .expect("lock")
            .insert(token.to_owned(), identity);
    }

    /// Answers reviews of `token` with `echo`, the token in the body.
    pub fn echo(&self, token: &str, echo: Echo) {
        self.echoes
            .lock()
            .expect("lock")
            .insert(token.to_owned(), echo);
    }

    /// Makes `token` unknown again.
    pub fn revoke(&self, token: &str) {
        self.tokens.lock().expect("lock").remove(token);
    }

    /// Makes each review wait `delay` before its answer.
    pub fn set_delay(&self, delay: std::time::Duration) {
        *self.load.delay.lock().expect("lock") = delay;
    }

    /// Makes every review wait, from now on, until [`release`](Self::release).
    pub fn hold(&self) {
        self.load.held.send_replace(true);
    }

    /// Lets the held reviews (and all later ones) answer.
    pub fn release(&self) {
        self.load.held.send_replace(false);
    }

    /// Reviews being answered now (held ones included).
    pub fn in_flight(&self) -> usize {
        self.load.in_flight.load(Ordering::SeqCst)
    }

    /// Reviews answered so far.
    pub fn review_count(&self) -> usize {
        self.reviews.load(Ordering::SeqCst)
    }

    /// Whether `token` was ever reviewed.
    pub fn reviewed(&self, token: &str) -> bool {
        self.seen.lock().expect("lock").contains(token)
    }

    /// The most reviews it was answering at once so far.
    pub fn most_in_flight(&self) -> usize {
        self.load.most.load(Ordering::SeqCst)
    }

    /// Publishes `key` among the cluster's signing keys, as kube-apiserver
    /// does its service-account keys; until one is, the path answers 404.
    pub fn publish(&self, key: &ClusterKey) {
        self.keys.jwks.lock().expect("lock").push(key.jwk());
    }

    /// How often the signing keys were read.
    pub fn key_reads(&self) -> usize {
        self.keys.reads.load(Ordering::SeqCst)
    }

    /// Takes the API down (503) or brings it back.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }
}

/// A token shaped as a bound service-account token: a JWT whose claims
/// name `audience` and expire in 2100, told apart by `id` (its `jti`).
/// The same arguments make the same token. Its signature is not one: the
/// stub knows tokens by their text, as [`TokenReviewStub::allow`] was
/// given them.
pub fn service_account_token(audience: &str, id: &str) -> String {
    jwt(&service_account_claims(audience, id))
}

/// The claims of [`service_account_token`].
fn service_account_claims(audience: &str, id: &str) -> serde_json::Value {
    serde_json::json!({
        "aud": [audience],
        "exp": 4_102_444_800_u64,
        "iat": 1_700_000_000_u64,
        "nbf": 1_700_000_000_u64,
        "iss": "https://kubernetes.default.svc.cluster.local",
        "jti": id,
        "sub": "system:serviceaccount:kube-system:konnectivity-agent",
    })
}

/// The signing keys the stub publishes.
#[derive(Default)]
struct Published {
    /// Their JWKs.
    jwks: Mutex<Vec<serde_json::Value>>,
    /// Reads of `/openid/v1/jwks`.
    reads: std::sync::atomic::AtomicUsize,
}

/// A service-account signing key of the stub's cluster: ECDSA P-256 (a
/// cluster with an EC key signs ES256), named by a hash of its public key
/// as kube-apiserver names its keys.
#[derive(Clone)]
pub struct ClusterKey {
    /// The key pair.
    pair: Arc<ring::signature::EcdsaKeyPair>,
    /// Its `kid`.
    kid: String,
}

impl Default for ClusterKey {
    fn default() -> Self {
        use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING as ALG, EcdsaKeyPair, KeyPair};
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ALG, &rng).expect("an EC key");
        let pair = EcdsaKeyPair::from_pkcs8(&ALG, pkcs8.as_ref(), &rng).expect("its pair");
        let hash = ring::digest::digest(&ring::digest::SHA256, pair.public_key().as_ref());
        let kid = b64(hash.as_ref());
        Self {
            pair: Arc::new(pair),
            kid,
        }
    }
}

impl ClusterKey {
    /// Its id, as a token's header names it.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// Its public JWK, as `/openid/v1/jwks` lists it.
    fn jwk(&self) -> serde_json::Value {
        use ring::signature::KeyPair;
        let point = self.pair.public_key().as_ref();
        serde_json::json!({
            "use": "sig", "kty": "EC", "kid": self.kid, "crv": "P-256", "alg": "ES256",
            "x": b64(&point[1..33]), "y": b64(&point[33..]),
        })
    }

    /// [`service_account_token`]'s claims, signed with this key.
    pub fn sign(&self, audience: &str, id: &str) -> String {
        let header = b64(serde_json::json!({"alg": "ES256", "kid": self.kid})
            .to_string()
            .as_bytes());
        let claims = b64(service_account_claims(audience, id).to_string().as_bytes());
        let message = format!("{header}.{claims}");
        let signature = self
            .pair
            .sign(&ring::rand::SystemRandom::new(), message.as_bytes())
            .expect("signing");
        format!("{message}.{}", b64(signature.as_ref()))
    }

    /// A token naming this key whose signature is not one.
    pub fn forge(&self, audience: &str, id: &str) -> String {
        let signed = self.sign(audience, id);
        let (message, _) = signed.rsplit_once('.').expect("three segments");
        format!("{message}.{}", b64(&[7; 64]))
    }
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// A JWT with `claims`, an RS256 header and a signature that is not one.
pub fn jwt(claims: &serde_json::Value) -> String {
    let header = b64(br#"{"alg":"RS256","kid":"stub"}"#);
    let payload = b64(claims.to_string().as_bytes());
    let signature = b64(format!("sig:{payload}").as_bytes());
    format!("{header}.{payload}.{signature}")
}

/// Writes `<dir>/kubeconfig` pointing at a stub on `addr`: the test CA, and
/// [`SERVER_TOKEN`] as the bearer token. Returns its path.
pub(crate) fn write_kubeconfig(dir: &Path, addr: SocketAddr) -> PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stub\n  cluster:\n    server: https://127.0.0.1:{}\n    certificate-authority: {}\nusers:\n- name: proxy-server\n  user:\n    token: {SERVER_TOKEN}\ncontexts:\n- name: stub\n  context:\n    cluster: stub\n    user: proxy-server\ncurrent-context: stub\n",
            addr.port(),
            Pki::get().path("agent-ca.crt").display()
        ),
    )
    .expect("writing the kubeconfig");
    path
}

fn json(status: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn api_status(code: StatusCode, reason: &str, message: &str) -> Response<Full<Bytes>> {
    json(
        code,
        serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": reason, "code": code.as_u16()
        }),
    )
}

/// What the stub counts of the reviews it answers.
struct Counted {
    /// How many.
    reviews: Arc<std::sync::atomic::AtomicUsize>,
    /// Which tokens.
    seen: Arc<Mutex<HashSet<String>>>,
}

async fn answer(
    req: Request<Incoming>,
    tokens: Arc<Mutex<HashMap<String, Identity>>>,
    echoes: Arc<Mutex<HashMap<String, Echo>>>,
    down: Arc<AtomicBool>,
    counted: Counted,
    load: Arc<Load>,
    keys: Arc<Published>,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    if down.load(Ordering::SeqCst) {
        return Ok(api_status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
        ));
    }
    let authorized = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {SERVER_TOKEN}"));
    if !authorized {
        return Ok(api_status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "Unauthorized",
        ));
    }
    if req.method() == hyper::Method::GET && req.uri().path() == "/openid/v1/jwks" {
        let jwks = keys.jwks.lock().expect("lock").clone();
        if !jwks.is_empty() {
            keys.reads.fetch_add(1, Ordering::SeqCst);
            return Ok(json(StatusCode::OK, serde_json::json!({ "keys": jwks })));
        }
    }
    if req.method() != hyper::Method::POST
        || req.uri().path() != "/apis/authentication.k8s.io/v1/tokenreviews"
    {
        return Ok(api_status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        ));
    }
    let body = req.into_body().collect().await?.to_bytes();
    let Ok(review) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return Ok(api_status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "invalid JSON",
        ));
    };
    counted.reviews.fetch_add(1, Ordering::SeqCst);
    let token = review["spec"]["token"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    counted.seen.lock().expect("lock").insert(token.clone());
    let _answering = Answering::new(&load);
    let delay = *load.delay.lock().expect("lock");
    tokio::time::sleep(delay).await;
    // Until the test releases it (its runtime's end drops it otherwise).
    let _ = load.held.subscribe().wait_for(|held| !held).await;
    let wanted: Vec<String> = review["spec"]["audiences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    match echoes.lock().expect("lock").get(&token) {
        Some(Echo::Garbled) => {
            return Ok(json(
                StatusCode::CREATED,
                serde_json::json!({
                    "kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
                    "spec": review["spec"], "status": token
                }),
            ));
        }
        Some(Echo::PlainError) => {
            let mut response = Response::new(Full::new(Bytes::from(format!(
                "cannot review token {token}"
            ))));
            *response.status_mut() = StatusCode::BAD_REQUEST;
            return Ok(response);
        }
        None => {}
    }
    let identity = tokens.lock().expect("lock").get(&token).cloned();
    let status = match identity {
        None => serde_json::json!({"user": {}, "error": "[invalid bearer token, unknown]"}),
        Some(identity) => {
            let common: Vec<String> = identity
                .audiences
                .iter()
                .filter(|a| wanted.is_empty() || wanted.contains(a))
                .cloned()
                .collect();
            if common.is_empty() {
                serde_json::json!({"user": {}, "error": format!(
                    "[invalid bearer token, token audiences {:?} is invalid for the target audiences {:?}, unknown]",
                    identity.audiences, wanted)})
            } else {
                let mut user = serde_json::json!({"username": identity.username, "uid": "u-1", "groups": ["system:serviceaccounts"]});
                if let Some(node) = &identity.node {
                    user["extra"] =
                        serde_json::json!({"authentication.kubernetes.io/node-name": [node]});
                }
                serde_json::json!({
                    "authenticated": true,
                    "user": user,
                    "audiences": common
                })
            }
        }
    };
    Ok(json(
        StatusCode::CREATED,
        serde_json::json!({
            "kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": null},
            "spec": review["spec"],
            "status": status
        }),
    ))
}
