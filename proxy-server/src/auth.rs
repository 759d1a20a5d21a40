//! Service-account token authentication of agents: each `Connect` carries
//! `authorization: Bearer <token>`, checked with a TokenReview against the
//! kube API (`--agent-namespace`, `--agent-service-account`,
//! `--authentication-audience`, `--kubeconfig`). Tokens are never logged.
//! A token that cannot be a valid service-account token is refused before
//! any review ([`claims`], `--token-review-local-checks`). Answers are
//! cached, and concurrent reviews of one token coalesced and bounded
//! ([`reviews`]: `--token-review-cache-ttl`, `--token-review-max-inflight`,
//! `--token-review-max-pending`); a peer whose tokens keep failing review
//! is slowed ([`peers`]).
//!
//! # Layout
//! - [`claims`]: the local checks of a token's shape and claims.
//! - [`keys`]: the cluster's signing keys, and what they say of a token's
//!   signature.
//! - [`peers`]: which peers' tokens keep failing, and their caps.
//! - [`reviews`]: the cache, coalescing and bounds of the reviews.

pub mod claims;
pub mod keys;
pub mod peers;
pub mod reviews;

use std::{
    net::IpAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use http_body_util::BodyExt;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::{Client, Resource, api::PostParams};
use proto::header;
use tonic::metadata::MetadataMap;

/// How long one TokenReview may take.
const REVIEW_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What token auth checks, from the flags.
#[derive(Debug, Clone)]
pub struct TokenAuthConfig {
    /// Expected service-account namespace.
    pub namespace: String,
    /// Expected service-account name.
    pub service_account: String,
    /// Audience the token must be valid for.
    pub audience: String,
    /// Kubeconfig; `None` means in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
    /// `--token-review-cache-ttl`: how long an accepted token's review is
    /// reused (never past the token's own expiry).
    pub cache_ttl: Duration,
    /// `--token-review-max-inflight`: TokenReview calls in flight at once.
    pub max_in_flight: usize,
    /// `--token-review-max-pending`: connects waiting for a review at once.
    pub max_pending: usize,
    /// `--token-review-local-checks`: refuse tokens that cannot be valid
    /// service-account tokens before a review ([`claims`]).
    pub local_checks: bool,
}

/// `--token-review-cache-ttl`'s default (kube-apiserver's own webhook token
/// cache keeps an answer as long).
pub const DEFAULT_CACHE_TTL: Duration = Duration::from_secs(120);
/// `--token-review-max-inflight`'s default.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 32;
/// `--token-review-max-pending`'s default: a restart of a server under
/// 10,000 agents with tokens of their own has them all waiting at once.
pub const DEFAULT_MAX_PENDING: usize = 16_384;

/// The kube client could not be set up.
pub use ops::kube::KubeSetupError as AuthSetupError;

/// Why an agent was refused; the text goes back to the agent (gRPC
/// `Unauthenticated`, or `Unavailable` for [`is_load`](Self::is_load)) and
/// to the log, and never contains the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `authorization` metadata.
    #[error("Authentication context was not found in metadata")]
    NoToken,
    /// More than one `authorization` value.
    #[error("too many ({0}) tokens are received")]
    TooMany(usize),
    /// Not `Bearer <token>`.
    #[error("received token does not have \"Bearer \" prefix")]
    NoBearer,
    /// The TokenReview call failed (API unreachable, forbidden, …).
    #[error("TokenReview failed: {0}")]
    Review(String),
    /// The API reported an error for this token.
    #[error("token review error: {0}")]
    StatusError(String),
    /// The token is not authenticated.
    #[error("the token is not authenticated")]
    NotAuthenticated,
    /// The token is not valid for our audience.
    #[error("the token is not valid for audience {want:?} (it is for {got:?})")]
    Audience {
        /// Our audience.
        want: String,
        /// The token's audiences.
        got: Vec<String>,
    },
    /// The user is not a service account.
    #[error("user {0:?} is not a service account")]
    NotServiceAccount(String),
    /// Wrong namespace.
    #[error("service account namespace {got:?} is not {want:?}")]
    Namespace {
        /// Expected.
        want: String,
        /// Seen.
        got: String,
    },
    /// Wrong service account.
    #[error("service account {got:?} is not {want:?}")]
    ServiceAccount {
        /// Expected.
        want: String,
        /// Seen.
        got: String,
    },
    /// `--token-review-max-pending` connects are waiting for a review.
    #[error("{limit} agent token reviews are pending (--token-review-max-pending); retry later")]
    TooManyPending {
        /// The limit.
        limit: usize,
    },
    /// Refused before a review: the token cannot be a valid service-account
    /// token.
    #[error("{0} (refused without a TokenReview; --token-review-local-checks)")]
    Claims(claims::ClaimsError),
    /// Refused before a review: the token names one of the cluster's
    /// signing keys and its signature does not verify under it.
    #[error(
        "the token's signature does not verify under the cluster's service-account key {kid:?} (refused without a TokenReview; --token-review-local-checks)"
    )]
    Forged {
        /// The key the token names.
        kid: String,
    },
    /// The peer's tokens keep failing review, and it has its share of
    /// connects waiting for one.
    #[error(
        "token reviews of connects from {peer} keep failing ({failed} recently); at most {limit} of its connects may wait for a review at once; retry later"
    )]
    PeerSlowed {
        /// The peer (an address, or an IPv6 /64).
        peer: String,
        /// Its failed reviews, counted as [`peers`] does.
        failed: u32,
        /// How many of its connects may wait.
        limit: usize,
    },
    /// No TokenReview call could start in time: `--token-review-max-inflight`
    /// calls were in flight all along.
    #[error(
        "no TokenReview call could start within {waited:?} (--token-review-max-inflight); retry later"
    )]
    NoPermit {
        /// How long the call waited.
        waited: Duration,
    },
}

impl AuthError {
    /// Whether the agent was refused because the server was busy with
    /// other reviews, not for anything about its token: it is to retry.
    pub fn is_load(&self) -> bool {
        matches!(
            self,
            Self::TooManyPending { .. } | Self::NoPermit { .. } | Self::PeerSlowed { .. }
        )
    }

    /// This error with `token` masked in every text an answer of the API
    /// put in it: an answer may echo the token in `status.error`, the user
    /// name, the audiences, a Status message or a failed call's text, and
    /// the error goes to the log and back to the agent.
    fn masked(self, token: &str) -> Self {
        let mask = |text: String| mask(text, token);
        match self {
            Self::Review(text) => Self::Review(mask(text)),
            Self::StatusError(text) => Self::StatusError(mask(text)),
            Self::Audience { want, got } => Self::Audience {
                want,
                got: got.into_iter().map(mask).collect(),
            },
            Self::NotServiceAccount(user) => Self::NotServiceAccount(mask(user)),
            Self::Namespace { want, got } => Self::Namespace {
                want,
                got: mask(got),
            },
            Self::ServiceAccount { want, got } => Self::ServiceAccount {
                want,
                got: mask(got),
            },
            other => other,
        }
    }

    /// The gRPC status of the refusal: `Unavailable` under load (clients
    /// retry it), `Unauthenticated` otherwise.
    pub fn status(&self) -> tonic::Status {
        let code = if self.is_load() {
            tonic::Code::Unavailable
        } else {
            tonic::Code::Unauthenticated
        };
        tonic::Status::new(code, self.to_string())
    }
}

/// `text` with `token` masked wherever it is in it.
fn mask(text: String, token: &str) -> String {
    if token.is_empty() || !text.contains(token) {
        text
    } else {
        text.replace(token, "MASKED")
    }
}

ops::label_enum! {
    /// Why a check was answered without a TokenReview (`reason` of
    /// `konnectivity_rs_server_token_reviews_skipped_total`).
    pub(crate) enum Skipped {
        /// Not a JWT, or claims of the wrong type.
        Malformed = "malformed",
        /// Its `aud` does not name `--authentication-audience`.
        Audience = "audience",
        /// Its `exp` is past.
        Expired = "expired",
        /// Its `nbf` is ahead.
        NotYetValid = "not_yet_valid",
        /// Its signature does not verify under the cluster key it names.
        Signature = "signature",
        /// Its peer is slowed, at its cap.
        PeerSlowed = "peer_slowed",
    }
}

/// How a check ended, for the server's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Checked {
    /// Answered by the cache, a call, or another check's call.
    Answered(reviews::Source),
    /// Refused under load (`--token-review-max-pending`, no permit).
    Load,
    /// Refused without a review.
    Skipped(Skipped),
}

/// Told how each check ended (the server's metrics).
pub(crate) type OnReview = Arc<dyn Fn(Checked) + Send + Sync>;

/// Checks agent tokens with TokenReview.
pub struct TokenAuth {
    /// The checks.
    config: TokenAuthConfig,
    /// The kube client.
    client: Client,
    /// Cached, coalesced and bounded reviews.
    reviews: reviews::Reviews,
    /// The cluster's signing keys, read from the API.
    keys: keys::ClusterKeys,
    /// Told what answered each check.
    on_review: OnReview,
}

impl TokenAuth {
    /// Builds the kube client from `--kubeconfig` (or in-cluster).
    ///
    /// # Errors
    /// See [`AuthSetupError`].
    pub(crate) async fn new(
        config: TokenAuthConfig,
        on_review: OnReview,
    ) -> Result<Self, AuthSetupError> {
        // The agent retries with its own backoff; kube's default retries
        // (up to 15, for minutes) would hold its Connect open instead.
        let client = ops::kube::client(config.kubeconfig.as_deref(), REVIEW_TIMEOUT).await?;
        Ok(Self::with_client(config, client, on_review))
    }

    /// [`new`](Self::new) with a kube client made elsewhere (the
    /// `token_review` fuzz target's stub API).
    pub(crate) fn with_client(
        config: TokenAuthConfig,
        client: Client,
        on_review: OnReview,
    ) -> Self {
        let reviews =
            reviews::Reviews::new(config.cache_ttl, config.max_in_flight, config.max_pending);
        Self {
            config,
            client,
            reviews,
            keys: keys::ClusterKeys::default(),
            on_review,
        }
    }

    /// Connects waiting for a review now.
    pub fn pending_reviews(&self) -> usize {
        self.reviews.pending()
    }

    /// Authenticates one `Connect` by its metadata, from `peer`: what the
    /// review said of its token (the node it is bound to).
    ///
    /// # Errors
    /// See [`AuthError`].
    ///
    /// # Cancel safety
    /// Dropping the future (the stream or its connection ended, shutdown)
    /// ends its wait and gives back what it held ([`reviews`]).
    pub async fn authenticate(
        &self,
        metadata: &MetadataMap,
        peer: Option<IpAddr>,
    ) -> Result<Admitted, AuthError> {
        let values: Vec<_> = metadata.get_all(header::AUTHORIZATION).iter().collect();
        let value = match values.as_slice() {
            [] => return Err(AuthError::NoToken),
            [one] => *one,
            many => return Err(AuthError::TooMany(many.len())),
        };
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix(header::BEARER_PREFIX))
            .ok_or(AuthError::NoBearer)?;
        if self.config.local_checks
            && let Err(error) = claims::Claims::read(token)
                .and_then(|claims| claims.check(&self.config.audience, SystemTime::now()))
        {
            (self.on_review)(Checked::Skipped(skipped(&error)));
            return Err(AuthError::Claims(error));
        }
        let signed = if self.config.local_checks {
            if let Some(verdict) = self.reviews.cached(token) {
                (self.on_review)(Checked::Answered(reviews::Source::Cache));
                return verdict;
            }
            match self
                .keys
                // Logged if it fails: whatever the API answered, the error
                // does not quote the token whose check made the read.
                .judge(token, async || {
                    self.read_keys().await.map_err(|e| mask(e, token))
                })
                .await
            {
                keys::Signature::Valid => true,
                keys::Signature::Unknown => false,
                keys::Signature::Forged { kid } => {
                    (self.on_review)(Checked::Skipped(Skipped::Signature));
                    return Err(AuthError::Forged { kid });
                }
            }
        } else {
            false
        };
        let peer = peer.map(peers::PeerKey::of);
        let (verdict, source) = self
            .reviews
            .check_from(token, peer, signed, async || self.review_token(token).await)
            .await;
        (self.on_review)(match (source, &verdict) {
            (Some(source), _) => Checked::Answered(source),
            (None, Err(AuthError::PeerSlowed { .. })) => Checked::Skipped(Skipped::PeerSlowed),
            (None, _) => Checked::Load,
        });
        verdict
    }

    /// One TokenReview of `token`, and what its answer says of it.
    async fn review_token(&self, token: &str) -> Result<Admitted, AuthError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: Some(vec![self.config.audience.clone()]),
            },
            ..TokenReview::default()
        };
        let reviewed = tokio::time::timeout(REVIEW_TIMEOUT, self.review(&review))
            .await
            .map_err(|_| AuthError::Review(format!("no answer within {REVIEW_TIMEOUT:?}")))?
            .map_err(|reason| AuthError::Review(reason).masked(token))?;
        let expected = Expected {
            namespace: &self.config.namespace,
            service_account: &self.config.service_account,
            audience: &self.config.audience,
        };
        verdict(&expected, reviewed).map_err(|error| error.masked(token))
    }

    /// The cluster's JWK set ([`keys::JWKS_PATH`]), within [`REVIEW_TIMEOUT`].
    async fn read_keys(&self) -> Result<Vec<u8>, String> {
        let request = http::Request::get(keys::JWKS_PATH)
            .body(Vec::new())
            .map_err(|e| format!("building the request: {e}"))?;
        let (code, body) = tokio::time::timeout(REVIEW_TIMEOUT, self.send(request))
            .await
            .map_err(|_| format!("no answer within {REVIEW_TIMEOUT:?}"))??;
        if !code.is_success() {
            return Err(format!("the API answered {code}"));
        }
        Ok(body.to_vec())
    }

    /// POSTs `review` and reads the answer. Not `Api::create`: kube's
    /// request helpers log a body they cannot parse (`warn`) and error
    /// bodies (`debug`), and both request and answer hold the token. The
    /// error text never quotes the body.
    async fn review(&self, review: &TokenReview) -> Result<TokenReview, String> {
        let body = serde_json::to_vec(review).map_err(|e| format!("encoding: {e}"))?;
        let request = kube::core::Request::new(TokenReview::url_path(&(), None))
            .create(&PostParams::default(), body)
            .map_err(|e| format!("building the request: {e}"))?;
        let (code, body) = self.send(request).await?;
        read_answer(code, &body)
    }

    /// Sends `request` through the kube client: the answer's status code
    /// and whole body. The error text never quotes the body.
    async fn send(
        &self,
        request: http::Request<Vec<u8>>,
    ) -> Result<(http::StatusCode, bytes::Bytes), String> {
        let response = self
            .client
            .send(request.map(kube::client::Body::from))
            .await
            .map_err(|e| e.to_string())?;
        let code = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        Ok((code, body))
    }
}

/// The metric reason of a local refusal.
fn skipped(error: &claims::ClaimsError) -> Skipped {
    match error {
        claims::ClaimsError::Malformed(_) => Skipped::Malformed,
        claims::ClaimsError::Audience { .. } => Skipped::Audience,
        claims::ClaimsError::Expired { .. } => Skipped::Expired,
        claims::ClaimsError::NotYetValid { .. } => Skipped::NotYetValid,
    }
}

/// The extra of a TokenReview's user naming the node of a token bound to
/// a pod (kube-apiserver 1.30+: `ServiceAccountTokenPodNodeInfo`).
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

/// What a review that admitted a token said of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admitted {
    /// The node its token is bound to ([`NODE_NAME_EXTRA`]), if it is.
    pub node: Option<String>,
}

/// What [`verdict`] admits: the flags' namespace, service account and
/// audience.
pub(crate) struct Expected<'a> {
    /// `--agent-namespace`.
    pub(crate) namespace: &'a str,
    /// `--agent-service-account`.
    pub(crate) service_account: &'a str,
    /// `--authentication-audience`.
    pub(crate) audience: &'a str,
}

/// The API's answer to a TokenReview, from its status code and body; the
/// error text never quotes the body.
pub(crate) fn read_answer(code: http::StatusCode, body: &[u8]) -> Result<TokenReview, String> {
    if !code.is_success() {
        // An API Status says why; its message never holds the token.
        let why = serde_json::from_slice::<kube::core::Status>(body)
            .map(|s| format!(": {} ({})", s.message, s.reason))
            .unwrap_or_default();
        return Err(format!("the API answered {code}{why}"));
    }
    serde_json::from_slice(body).map_err(|e| {
        // serde's message may quote a value from the body: only its place.
        format!(
            "unreadable TokenReview answer ({:?} error at line {} column {})",
            e.classify(),
            e.line(),
            e.column()
        )
    })
}

/// What a TokenReview's answer says of its token: admitted only if it is
/// authenticated, for `config`'s audience, as its service account.
pub(crate) fn verdict(config: &Expected<'_>, reviewed: TokenReview) -> Result<Admitted, AuthError> {
    let status = reviewed.status.unwrap_or_default();
    if let Some(error) = status.error.filter(|e| !e.is_empty()) {
        return Err(AuthError::StatusError(error));
    }
    if status.authenticated != Some(true) {
        return Err(AuthError::NotAuthenticated);
    }
    let audiences = status.audiences.unwrap_or_default();
    if !audiences.iter().any(|a| a == config.audience) {
        return Err(AuthError::Audience {
            want: config.audience.to_owned(),
            got: audiences,
        });
    }
    let user = status.user.unwrap_or_default();
    let node = user
        .extra
        .as_ref()
        .and_then(|extra| extra.get(NODE_NAME_EXTRA))
        .and_then(|names| names.first())
        .filter(|name| !name.is_empty())
        .map(|name| proto::text::for_record(name.clone()));
    let username = user.username.unwrap_or_default();
    let parts: Vec<&str> = username.split(':').collect();
    let [system, serviceaccount, namespace, name] = parts.as_slice() else {
        return Err(AuthError::NotServiceAccount(username));
    };
    if *system != "system" || *serviceaccount != "serviceaccount" {
        return Err(AuthError::NotServiceAccount(username));
    }
    if *namespace != config.namespace {
        return Err(AuthError::Namespace {
            want: config.namespace.to_owned(),
            got: (*namespace).to_owned(),
        });
    }
    if *name != config.service_account {
        return Err(AuthError::ServiceAccount {
            want: config.service_account.to_owned(),
            got: (*name).to_owned(),
        });
    }
    Ok(Admitted { node })
}
