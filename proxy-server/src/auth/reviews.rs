//! Reviews of agent tokens without a flood: each answer is cached by a
//! hash of the token, concurrent reviews of one token are one call, and
//! both the calls in flight and the checks waiting are bounded.
//!
//! - A token the API accepted is not reviewed again until its own expiry
//!   (the `exp` of a bound service-account token) or `ttl`
//!   (`--token-review-cache-ttl`), whichever is first: a revoked service
//!   account keeps its agents admitted for at most `ttl` after its last
//!   review.
//! - A token the API refused is refused from the cache for at most
//!   [`REFUSAL_TTL`]. A call that failed (API unreachable, timed out) or an
//!   answer with `status.error` set (which the API also uses for its own
//!   transient failures) is not cached at all.
//! - While a review of a token is in flight, every other stream with the
//!   same token waits for its answer. If the stream that made the call ends
//!   first, the next waiter calls again.
//! - Calls wait for one of `max_in_flight` permits
//!   (`--token-review-max-inflight`), for at most [`PERMIT_TIMEOUT`].
//! - At most `max_pending` checks (`--token-review-max-pending`) wait at
//!   once, for a permit, a call or another stream's call; more are refused
//!   at once. Both refusals tell the agent to retry ([`AuthError::is_load`]).
//! - A peer whose tokens keep failing review is slowed ([`super::peers`]):
//!   its checks past its cap are refused at once, on entering and again
//!   when a permit comes to them. Both refusals tell the agent to retry.
//!   Checks of tokens the cluster's keys sign are never capped.
//! - A check is a future its stream owns: when the stream or its connection
//!   ends (or the server shuts down), the check is dropped, and with it its
//!   place among the waiting, its permit and its call.
//!
//! The cache holds at most [`MAX_CACHED`] answers; past that, answers are
//! not kept until expired ones make room. Answers are indexed by expiry, and
//! each answer kept drops at most [`SWEEP`] expired ones: no operation
//! scans the cache. The token itself is never kept.

use std::{
    collections::{BTreeSet, HashMap, hash_map},
    sync::Mutex,
    time::{Duration, SystemTime},
};

use ring::digest;
use tokio::{
    sync::{Semaphore, watch},
    time::Instant,
};
use tracing::warn;

use super::{
    AuthError,
    peers::{Outcome, PeerKey, Peers, Place, Slowed},
};

/// How long a refusal from the API is reused.
pub const REFUSAL_TTL: Duration = Duration::from_secs(5);
/// Most answers kept (about 150 bytes each, with their index).
pub const MAX_CACHED: usize = 100_000;
/// How long a call waits for a permit: with the review's own 10 s, an
/// agent is answered within 25 s, before its 30 s wait for the server's
/// answer ends (`proxy_agent::client::CONNECT_TIMEOUT`).
pub const PERMIT_TIMEOUT: Duration = Duration::from_secs(15);
/// Most expired answers dropped per answer kept: more than one, so that
/// they go faster than answers come, and few, so that no answer waits on
/// a sweep of the cache.
const SWEEP: usize = 4;

/// What a review said.
pub(crate) type Verdict = Result<super::Admitted, AuthError>;

/// A SHA-256 of a token.
type Key = [u8; 32];

ops::label_enum! {
    /// What answered a check (`source` of
    /// `konnectivity_rs_server_token_reviews_total`).
    pub(crate) enum Source {
        /// This check's own call to the TokenReview API.
        Api = "api",
        /// A call another check of the same token was making.
        Coalesced = "coalesced",
        /// The cache.
        Cache = "cache",
    }
}

/// A cached answer.
struct Answer {
    /// What the API said.
    verdict: Verdict,
    /// Reused until then.
    until: Instant,
}

/// A call in flight.
struct Call {
    /// Tells this call from a later one of the same token.
    id: u64,
    /// Its answer comes here; closed if its check ended before it.
    answer: watch::Receiver<Option<Verdict>>,
}

/// The cache, the calls in flight and the checks waiting.
#[derive(Default)]
struct State {
    /// Answers by token hash.
    answers: HashMap<Key, Answer>,
    /// The keys of `answers` by expiry, earliest first.
    expiries: BTreeSet<(Instant, Key)>,
    /// Calls in flight by token hash; each is removed by its check when it
    /// is answered or dropped.
    calls: HashMap<Key, Call>,
    /// The id of the next call.
    next_call: u64,
    /// Checks not answered from the cache yet: callers and waiters.
    waiting: usize,
    /// Whether a check was refused at `max_pending` since the count was
    /// last below it (the limit is logged once).
    at_cap: bool,
    /// Whether a call waited out [`PERMIT_TIMEOUT`] since one last got a
    /// permit in time (logged once).
    starved: bool,
    /// Which peers' tokens keep failing review.
    peers: Peers,
}

impl State {
    /// The answer kept for `key`, if still good at `now`; an expired one is
    /// dropped.
    fn cached(&mut self, key: Key, now: Instant) -> Option<Verdict> {
        let hash_map::Entry::Occupied(entry) = self.answers.entry(key) else {
            return None;
        };
        if now < entry.get().until {
            return Some(entry.get().verdict.clone());
        }
        self.expiries.remove(&(entry.get().until, key));
        entry.remove();
        None
    }

    /// Drops at most `most` expired answers, the earliest first.
    fn sweep(&mut self, now: Instant, most: usize) {
        for _ in 0..most {
            match self.expiries.first() {
                Some(&(until, key)) if until <= now => {
                    self.expiries.pop_first();
                    self.answers.remove(&key);
                }
                _ => return,
            }
        }
    }
}

/// The cache's key of `token`.
fn key_of(token: &str) -> Key {
    digest::digest(&digest::SHA256, token.as_bytes())
        .as_ref()
        .try_into()
        .expect("SHA-256 is 32 bytes")
}

/// What a check found on entering.
enum Enter {
    /// A cached answer.
    Cached(Verdict),
    /// `max_pending` checks are waiting.
    Refused,
    /// The check's peer (or its /48) is slowed, at its cap.
    Slowed(Slowed),
    /// Counted among the waiting (and in its peer's record) until the
    /// guard drops.
    Waiting(Option<Place>),
}

/// What a waiting check is to do.
enum Join {
    /// Another check's answer was kept meanwhile.
    Cached(Verdict),
    /// Wait for the call in flight.
    Wait(watch::Receiver<Option<Verdict>>),
    /// Make the call, with this id, and answer on the channel.
    Call(u64, watch::Sender<Option<Verdict>>),
}

/// The cache, the calls in flight and their bounds; see the module
/// documentation.
pub(crate) struct Reviews {
    /// Everything the checks share, locked only between awaits.
    state: Mutex<State>,
    /// The calls in flight (`max_in_flight`).
    permits: Semaphore,
    /// `--token-review-cache-ttl`.
    ttl: Duration,
    /// Most checks waiting at once (`--token-review-max-pending`).
    max_pending: usize,
    /// Most answers kept ([`MAX_CACHED`]).
    capacity: usize,
}

impl Reviews {
    /// Answers kept for at most `ttl`, at most `max_in_flight` calls, at
    /// most `max_pending` checks waiting.
    pub(crate) fn new(ttl: Duration, max_in_flight: usize, max_pending: usize) -> Self {
        Self::with_capacity(ttl, max_in_flight, max_pending, MAX_CACHED)
    }

    /// [`new`](Self::new) keeping at most `capacity` answers.
    fn with_capacity(
        ttl: Duration,
        max_in_flight: usize,
        max_pending: usize,
        capacity: usize,
    ) -> Self {
        Self {
            state: Mutex::new(State::default()),
            permits: Semaphore::new(max_in_flight.max(1)),
            ttl,
            max_pending: max_pending.max(1),
            capacity,
        }
    }

    /// The answer kept for `token`, if any is still good.
    pub(crate) fn cached(&self, token: &str) -> Option<Verdict> {
        self.lock().cached(key_of(token), Instant::now())
    }

    /// Checks waiting now, for a permit, a call or another check's call.
    pub(crate) fn pending(&self) -> usize {
        self.lock().waiting
    }

    /// [`check_from`](Self::check_from) with no peer.
    #[cfg(test)]
    pub(crate) async fn check<R>(&self, token: &str, review: R) -> (Verdict, Option<Source>)
    where
        R: AsyncFnOnce() -> Verdict,
    {
        self.check_from(token, None, false, review).await
    }

    /// The verdict on `token`, presented by `peer`: cached, from a call in
    /// flight, or from `review`, called at most once and only with a
    /// permit; and what answered, `None` for a refusal under load or of a
    /// slowed peer ([`AuthError::is_load`]). A `signed` token (its
    /// signature verifies under the cluster's keys: [`super::keys`]) is
    /// never refused for its peer's slowdown: it waits its turn.
    ///
    /// # Cancel safety
    /// Dropping the future gives back everything it held: its place among
    /// the waiting, its permit, its call (the next waiter calls again).
    pub(crate) async fn check_from<R>(
        &self,
        token: &str,
        peer: Option<PeerKey>,
        signed: bool,
        review: R,
    ) -> (Verdict, Option<Source>)
    where
        R: AsyncFnOnce() -> Verdict,
    {
        let key = key_of(token);
        let place = match self.enter(key, peer, signed) {
            Enter::Cached(verdict) => return (verdict, Some(Source::Cache)),
            Enter::Refused => {
                let limit = self.max_pending;
                return (Err(AuthError::TooManyPending { limit }), None);
            }
            Enter::Slowed(slowed) => return (Err(slowed_error(slowed)), None),
            Enter::Waiting(place) => place,
        };
        let _waiting = Waiting(self, place);
        loop {
            match self.join(key) {
                Join::Cached(verdict) => return (verdict, Some(Source::Cache)),
                Join::Wait(mut answer) => {
                    if let Ok(verdict) = answer.wait_for(Option::is_some).await {
                        let verdict = verdict.clone().expect("waited for an answer");
                        let source = (!is_load(&verdict)).then_some(Source::Coalesced);
                        return (verdict, source);
                    }
                    // The caller ended before its answer: call again.
                }
                Join::Call(id, answer) => {
                    let _call = Calling {
                        reviews: self,
                        key,
                        id,
                    };
                    let verdict = self.call(review, place).await;
                    self.settle(key, id, &verdict, token);
                    let _ = answer.send(Some(verdict.clone()));
                    let source = (!is_load(&verdict)).then_some(Source::Api);
                    return (verdict, source);
                }
            }
        }
    }

    /// `review`, once a permit is had within [`PERMIT_TIMEOUT`] and unless
    /// `place`'s peer is slowed with that many calls in flight; the
    /// answer counts for the peer.
    async fn call<R>(&self, review: R, place: Option<Place>) -> Verdict
    where
        R: AsyncFnOnce() -> Verdict,
    {
        let Ok(Ok(_permit)) = tokio::time::timeout(PERMIT_TIMEOUT, self.permits.acquire()).await
        else {
            let mut state = self.lock();
            if !state.starved {
                warn!(
                    waited = ?PERMIT_TIMEOUT,
                    "no --token-review-max-inflight permit in time; refusing agents with Unavailable"
                );
            }
            state.starved = true;
            return Err(AuthError::NoPermit {
                waited: PERMIT_TIMEOUT,
            });
        };
        let peer_call = {
            let mut state = self.lock();
            state.starved = false;
            match place {
                Some(place) => match state.peers.start_call(place, Instant::now()) {
                    Ok(()) => Some(PeerCall {
                        reviews: self,
                        place,
                        answered: false,
                    }),
                    Err(slowed) => return Err(slowed_error(slowed)),
                },
                None => None,
            }
        };
        let verdict = review().await;
        if let Some(call) = peer_call {
            call.answered(&verdict);
        }
        verdict
    }

    /// A cached answer, a refusal at a cap, or a place among the waiting.
    fn enter(&self, key: Key, peer: Option<PeerKey>, signed: bool) -> Enter {
        let mut state = self.lock();
        let now = Instant::now();
        if let Some(verdict) = state.cached(key, now) {
            return Enter::Cached(verdict);
        }
        let place = match peer {
            Some(peer) if signed => Some(state.peers.enter_signed(peer, now)),
            Some(peer) => match state.peers.enter(peer, now) {
                Ok(place) => Some(place),
                Err(slowed) => return Enter::Slowed(slowed),
            },
            None => None,
        };
        if state.waiting >= self.max_pending {
            if let Some(place) = place {
                state.peers.leave(place);
            }
            if !state.at_cap {
                warn!(
                    limit = self.max_pending,
                    "--token-review-max-pending reached; refusing agents with Unavailable"
                );
            }
            state.at_cap = true;
            return Enter::Refused;
        }
        state.waiting += 1;
        Enter::Waiting(place)
    }

    /// What a waiting check of `key` is to do now.
    fn join(&self, key: Key) -> Join {
        let mut state = self.lock();
        if let Some(verdict) = state.cached(key, Instant::now()) {
            return Join::Cached(verdict);
        }
        if let Some(call) = state.calls.get(&key)
            && call.answer.has_changed().is_ok()
        {
            return Join::Wait(call.answer.clone());
        }
        let id = state.next_call;
        state.next_call = state.next_call.wrapping_add(1);
        let (answer, waiting) = watch::channel(None);
        state.calls.insert(
            key,
            Call {
                id,
                answer: waiting,
            },
        );
        Join::Call(id, answer)
    }

    /// Ends call `id` of `key`, keeping `verdict` on `token` for as long as
    /// it may be reused; drops up to [`SWEEP`] expired answers.
    fn settle(&self, key: Key, id: u64, verdict: &Verdict, token: &str) {
        let mut state = self.lock();
        end_call(&mut state, key, id);
        let Some(keep) = self.keep_for(verdict, token) else {
            return;
        };
        let now = Instant::now();
        state.sweep(now, SWEEP);
        if let Some(old) = state.answers.remove(&key) {
            state.expiries.remove(&(old.until, key));
        }
        if state.answers.len() >= self.capacity {
            return;
        }
        let until = now + keep;
        state.expiries.insert((until, key));
        state.answers.insert(
            key,
            Answer {
                verdict: verdict.clone(),
                until,
            },
        );
    }

    /// How long `verdict` may be reused: `None` for not at all.
    fn keep_for(&self, verdict: &Verdict, token: &str) -> Option<Duration> {
        match verdict {
            Ok(_) => {
                let keep = match token_expiry(token) {
                    Some(expiry) => expiry.duration_since(SystemTime::now()).ok()?.min(self.ttl),
                    None => self.ttl,
                };
                (!keep.is_zero()).then_some(keep)
            }
            // The call failed, or the API reported an error (possibly its
            // own, transient): nothing certain was said about the token.
            Err(AuthError::Review(_) | AuthError::StatusError(_)) => None,
            Err(error) if error.is_load() => None,
            Err(_) => Some(REFUSAL_TTL.min(self.ttl)).filter(|keep| !keep.is_zero()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves the state whole.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether `verdict` is a refusal under load.
fn is_load(verdict: &Verdict) -> bool {
    verdict.as_ref().is_err_and(AuthError::is_load)
}

/// Removes call `id` of `key`, if it is still the one in flight.
fn end_call(state: &mut State, key: Key, id: u64) {
    if let hash_map::Entry::Occupied(call) = state.calls.entry(key)
        && call.get().id == id
    {
        call.remove();
    }
}

/// A check counted among the waiting, and in its peer's record, until
/// dropped.
struct Waiting<'a>(&'a Reviews, Option<Place>);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        if let Some(place) = self.1 {
            state.peers.leave(place);
        }
        state.waiting -= 1;
        if state.waiting < self.0.max_pending {
            state.at_cap = false;
        }
    }
}

/// A call in flight, removed from the calls when dropped: answered, or
/// abandoned by its check.
struct Calling<'a> {
    /// Whose call.
    reviews: &'a Reviews,
    /// Its token's hash.
    key: Key,
    /// Its id.
    id: u64,
}

impl Drop for Calling<'_> {
    fn drop(&mut self) {
        end_call(&mut self.reviews.lock(), self.key, self.id);
    }
}

/// A call of a peer's check in flight: counted in its record until
/// dropped; if it was not answered, the API had it for nothing, and it
/// counts as failed.
struct PeerCall<'a> {
    /// Whose call.
    reviews: &'a Reviews,
    /// The check's place in its peer's record.
    place: Place,
    /// Whether the API answered (and the answer was counted).
    answered: bool,
}

impl PeerCall<'_> {
    /// The API answered `verdict`: counted for the peer, if it says
    /// anything of the token.
    fn answered(mut self, verdict: &Verdict) {
        self.answered = true;
        if let Some(outcome) = outcome(verdict) {
            count(&mut self.reviews.lock(), self.place.key, outcome);
        }
    }
}

impl Drop for PeerCall<'_> {
    fn drop(&mut self) {
        let mut state = self.reviews.lock();
        state.peers.end_call(self.place);
        if !self.answered {
            count(&mut state, self.place.key, Outcome::Failed);
        }
    }
}

/// Counts `outcome` for `peer`; logs when that slows it.
fn count(state: &mut State, peer: PeerKey, outcome: Outcome) {
    if let Some(slowed) = state.peers.count(peer, outcome, Instant::now()) {
        warn!(
            peer.addr = %slowed,
            "token reviews of connects from this peer keep failing; slowing it"
        );
    }
}

/// What `verdict` counts for its peer: a pass, a failure, or nothing (the
/// call failed, or never started).
fn outcome(verdict: &Verdict) -> Option<Outcome> {
    match verdict {
        Ok(_) => Some(Outcome::Passed),
        Err(AuthError::Review(_)) => None,
        Err(error) if error.is_load() => None,
        Err(_) => Some(Outcome::Failed),
    }
}

/// The refusal of a connect, its peer (or the /48 it is in: `slowed.key`)
/// slowed and at its cap.
fn slowed_error(slowed: Slowed) -> AuthError {
    AuthError::PeerSlowed {
        peer: slowed.key.to_string(),
        failed: slowed.failed,
        limit: slowed.limit,
    }
}

/// The `exp` claim of a JWT, read without checking its signature (the API
/// checked the token; this only bounds how long its answer is reused).
fn token_expiry(token: &str) -> Option<SystemTime> {
    super::claims::expiry(token)
}

#[cfg(test)]
mod tests {
    use super::super::Admitted;
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use base64::Engine as _;

    use super::*;

    const TTL: Duration = Duration::from_secs(120);

    /// A review that counts its calls and the most in flight, and answers
    /// `verdict` after `delay`.
    #[derive(Default)]
    struct Api {
        calls: AtomicUsize,
        in_flight: AtomicUsize,
        most: AtomicUsize,
    }

    impl Api {
        async fn review(&self, delay: Duration, verdict: Verdict) -> Verdict {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(delay).await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            verdict
        }

        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
    }

    /// A JWT-shaped token with `exp` and `n` for uniqueness.
    fn jwt(exp: u64, n: usize) -> String {
        let claims = serde_json::json!({ "exp": exp, "n": n }).to_string();
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(claims);
        format!("eyJhbGciOiJSUzI1NiJ9.{payload}.c2ln")
    }

    fn unix_now() -> u64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    #[tokio::test(start_paused = true)]
    async fn an_accepted_token_is_answered_from_the_cache_until_the_ttl() {
        let reviews = Reviews::new(TTL, 4, 1000);
        let api = Api::default();
        let ask = || {
            reviews.check("t", async || {
                api.review(Duration::ZERO, Ok(Admitted::default())).await
            })
        };
        assert_eq!(ask().await, (Ok(Admitted::default()), Some(Source::Api)));
        assert_eq!(ask().await, (Ok(Admitted::default()), Some(Source::Cache)));
        tokio::time::advance(TTL - Duration::from_millis(1)).await;
        assert_eq!(ask().await, (Ok(Admitted::default()), Some(Source::Cache)));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            ask().await,
            (Ok(Admitted::default()), Some(Source::Api)),
            "reviewed again at the ttl"
        );
        assert_eq!(api.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_is_not_cached_past_its_own_expiry() {
        let reviews = Reviews::new(TTL, 4, 1000);
        let api = Api::default();
        // The test's paused clock does not move SystemTime: expiry 3 s
        // after now, against a 120 s ttl, caches for under 3 s.
        let soon = jwt(unix_now() + 3, 1);
        let ask = |t: String| {
            let (reviews, api) = (&reviews, &api);
            async move {
                reviews
                    .check(&t, async || {
                        api.review(Duration::ZERO, Ok(Admitted::default())).await
                    })
                    .await
                    .1
            }
        };
        assert_eq!(ask(soon.clone()).await, Some(Source::Api));
        assert_eq!(ask(soon.clone()).await, Some(Source::Cache));
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(ask(soon).await, Some(Source::Api));
        // Expired already: never cached.
        let past = jwt(unix_now() - 1, 2);
        assert_eq!(ask(past.clone()).await, Some(Source::Api));
        assert_eq!(ask(past).await, Some(Source::Api));
        // A long-lived token: the ttl bounds it.
        let late = jwt(unix_now() + 3600, 3);
        assert_eq!(ask(late.clone()).await, Some(Source::Api));
        tokio::time::advance(TTL).await;
        assert_eq!(ask(late).await, Some(Source::Api));
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_checks_of_one_token_make_one_call() {
        let reviews = Reviews::new(TTL, 4, 1000);
        let api = Api::default();
        let checks = (0..50).map(|_| {
            reviews.check("same", async || {
                api.review(Duration::from_millis(200), Ok(Admitted::default()))
                    .await
            })
        });
        let answers = futures_util::future::join_all(checks).await;
        assert_eq!(api.calls(), 1);
        assert!(answers.iter().all(|(v, _)| v.is_ok()));
        let coalesced = answers
            .iter()
            .filter(|(_, s)| *s == Some(Source::Coalesced))
            .count();
        assert_eq!(coalesced, 49);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_in_flight_stay_within_the_bound() {
        let reviews = Reviews::new(TTL, 3, 1000);
        let api = Api::default();
        let tokens: Vec<String> = (0..20).map(|n| format!("token-{n}")).collect();
        let checks = tokens.iter().map(|t| {
            reviews.check(t, async || {
                api.review(Duration::from_millis(100), Ok(Admitted::default()))
                    .await
            })
        });
        futures_util::future::join_all(checks).await;
        assert_eq!(api.calls(), 20);
        assert_eq!(api.most.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_call_is_not_cached_and_a_refusal_only_briefly() {
        let reviews = Reviews::new(TTL, 4, 1000);
        let api = Api::default();
        let failed = || AuthError::Review("the API answered 503".to_owned());
        let (verdict, _) = reviews
            .check("t", async || {
                api.review(Duration::ZERO, Err(failed())).await
            })
            .await;
        assert!(matches!(verdict, Err(AuthError::Review(_))));
        let (verdict, source) = reviews
            .check("t", async || {
                api.review(Duration::ZERO, Ok(Admitted::default())).await
            })
            .await;
        assert_eq!((verdict.is_ok(), source), (true, Some(Source::Api)));

        let refuse = async || {
            api.review(Duration::ZERO, Err(AuthError::NotAuthenticated))
                .await
        };
        assert_eq!(reviews.check("bad", refuse).await.1, Some(Source::Api));
        let (verdict, source) = reviews.check("bad", refuse).await;
        assert!(matches!(verdict, Err(AuthError::NotAuthenticated)));
        assert_eq!(source, Some(Source::Cache));
        tokio::time::advance(REFUSAL_TTL).await;
        assert_eq!(reviews.check("bad", refuse).await.1, Some(Source::Api));
    }

    #[tokio::test(start_paused = true)]
    async fn answers_past_the_capacity_are_not_kept_until_expired_ones_make_room() {
        let reviews = Reviews::with_capacity(TTL, 4, 1000, 3);
        let api = Api::default();
        let ask = |t: &'static str| {
            let (reviews, api) = (&reviews, &api);
            async move {
                reviews
                    .check(t, async || {
                        api.review(Duration::ZERO, Ok(Admitted::default())).await
                    })
                    .await
                    .1
            }
        };
        for t in ["a", "b", "c"] {
            assert_eq!(ask(t).await, Some(Source::Api));
        }
        assert_eq!(ask("d").await, Some(Source::Api));
        assert_eq!(
            reviews.lock().answers.len(),
            3,
            "the fourth answer was kept"
        );
        assert_eq!(ask("d").await, Some(Source::Api), "not cached");
        assert_eq!(ask("a").await, Some(Source::Cache));
        // Expired answers make room.
        tokio::time::advance(TTL).await;
        assert_eq!(ask("d").await, Some(Source::Api));
        assert_eq!(ask("d").await, Some(Source::Cache));
        assert!(reviews.lock().answers.len() <= 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_calls_again_when_the_caller_ends_first() {
        let reviews = Arc::new(Reviews::new(TTL, 4, 1000));
        let api = Arc::new(Api::default());
        let first = {
            let (reviews, api) = (reviews.clone(), api.clone());
            tokio::spawn(async move {
                reviews
                    .check("t", async || {
                        api.review(Duration::from_secs(10), Ok(Admitted::default()))
                            .await
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        let second = {
            let (reviews, api) = (reviews.clone(), api.clone());
            tokio::spawn(async move {
                reviews
                    .check("t", async || {
                        api.review(Duration::from_millis(5), Ok(Admitted::default()))
                            .await
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        first.abort();
        let (verdict, source) = second.await.unwrap();
        assert_eq!((verdict.is_ok(), source), (true, Some(Source::Api)));
        assert_eq!(api.calls(), 2);
    }

    /// An answer whose `status.error` is set may be the API's own transient
    /// failure: the next check asks again.
    #[tokio::test(start_paused = true)]
    async fn an_error_the_api_reports_in_its_answer_is_not_cached() {
        let reviews = Reviews::new(TTL, 4, 1000);
        let api = Api::default();
        let error = || AuthError::StatusError("[etcd unavailable]".to_owned());
        let (verdict, source) = reviews
            .check("t", async || api.review(Duration::ZERO, Err(error())).await)
            .await;
        assert_eq!((verdict, source), (Err(error()), Some(Source::Api)));
        let (verdict, source) = reviews
            .check("t", async || {
                api.review(Duration::ZERO, Ok(Admitted::default())).await
            })
            .await;
        assert_eq!(
            (verdict, source),
            (Ok(Admitted::default()), Some(Source::Api))
        );
        assert_eq!(api.calls(), 2);
    }

    /// Past `max_pending` checks waiting (a TokenReview outage, a flood of
    /// distinct tokens), more are refused at once, with no call and no
    /// entry; cached answers are still given; room comes back as checks end.
    #[tokio::test(start_paused = true)]
    async fn checks_past_the_pending_bound_are_refused_at_once() {
        let reviews = Arc::new(Reviews::new(TTL, 1, 3));
        let api = Arc::new(Api::default());
        let ask = |token: String, delay: Duration| {
            let (reviews, api) = (reviews.clone(), api.clone());
            tokio::spawn(async move {
                reviews
                    .check(&token, async || {
                        api.review(delay, Ok(Admitted::default())).await
                    })
                    .await
            })
        };
        assert_eq!(
            ask("cached".to_owned(), Duration::ZERO).await.unwrap(),
            (Ok(Admitted::default()), Some(Source::Api))
        );
        let slow: Vec<_> = (0..3)
            .map(|n| ask(format!("slow-{n}"), Duration::from_secs(5)))
            .collect();
        while reviews.pending() < 3 {
            tokio::task::yield_now().await;
        }
        let (verdict, source) = ask("one-more".to_owned(), Duration::ZERO).await.unwrap();
        assert_eq!(verdict, Err(AuthError::TooManyPending { limit: 3 }));
        assert_eq!(source, None);
        assert!(verdict.unwrap_err().status().code() == tonic::Code::Unavailable);
        assert_eq!(
            ask("cached".to_owned(), Duration::ZERO).await.unwrap(),
            (Ok(Admitted::default()), Some(Source::Cache))
        );
        assert_eq!(reviews.lock().calls.len(), 3, "one per token");
        assert_eq!(api.calls(), 2, "one in flight, two waiting for a permit");
        for check in slow {
            assert!(check.await.unwrap().0.is_ok());
        }
        assert_eq!(reviews.pending(), 0);
        assert_eq!(
            ask("one-more".to_owned(), Duration::ZERO).await.unwrap(),
            (Ok(Admitted::default()), Some(Source::Api))
        );
        assert_eq!(api.calls(), 5);
    }

    /// A call waits for a permit for at most [`PERMIT_TIMEOUT`], then is
    /// refused (not cached): a flood cannot hold it forever.
    #[tokio::test(start_paused = true)]
    async fn a_call_waits_for_a_permit_at_most_the_timeout() {
        let reviews = Arc::new(Reviews::new(TTL, 1, 1000));
        let api = Arc::new(Api::default());
        let hold = {
            let (reviews, api) = (reviews.clone(), api.clone());
            tokio::spawn(async move {
                reviews
                    .check("holder", async || {
                        api.review(Duration::from_secs(3600), Ok(Admitted::default()))
                            .await
                    })
                    .await
            })
        };
        while api.calls() == 0 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        let waited = tokio::time::timeout(
            2 * PERMIT_TIMEOUT,
            reviews.check("t", async || {
                api.review(Duration::ZERO, Ok(Admitted::default())).await
            }),
        )
        .await
        .expect("still waiting for a permit");
        assert_eq!(
            waited,
            (
                Err(AuthError::NoPermit {
                    waited: PERMIT_TIMEOUT
                }),
                None
            )
        );
        assert_eq!(started.elapsed(), PERMIT_TIMEOUT);
        assert!(!reviews.lock().answers.contains_key(&key_of("t")));
        assert_eq!(reviews.pending(), 1, "the holder");
        hold.abort();
        let _ = hold.await;
        assert_eq!(reviews.pending(), 0);
        let (verdict, source) = reviews
            .check("t", async || {
                api.review(Duration::ZERO, Ok(Admitted::default())).await
            })
            .await;
        assert_eq!(
            (verdict, source),
            (Ok(Admitted::default()), Some(Source::Api))
        );
    }

    fn key_of(token: &str) -> Key {
        digest::digest(&digest::SHA256, token.as_bytes())
            .as_ref()
            .try_into()
            .unwrap()
    }

    /// Checks whose streams end (the future is dropped) leave nothing: no
    /// call, no place among the waiting, whatever they were waiting for.
    #[tokio::test(start_paused = true)]
    async fn checks_that_end_early_leave_nothing_behind() {
        let reviews = Arc::new(Reviews::new(TTL, 1, 1000));
        let api = Arc::new(Api::default());
        let checks: Vec<_> = ["a", "a", "b", "c"]
            .into_iter()
            .map(|token| {
                let (reviews, api) = (reviews.clone(), api.clone());
                tokio::spawn(async move {
                    reviews
                        .check(token, async || {
                            api.review(Duration::from_secs(3600), Ok(Admitted::default()))
                                .await
                        })
                        .await
                })
            })
            .collect();
        // "a" calls, its twin waits on it, "b" and "c" wait for the permit.
        while reviews.pending() < 4 || api.calls() == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(reviews.lock().calls.len(), 3);
        for check in checks {
            check.abort();
            let _ = check.await;
        }
        assert_eq!(reviews.pending(), 0);
        assert!(reviews.lock().calls.is_empty());
        assert!(reviews.lock().answers.is_empty());
    }

    /// Expired answers are dropped a few per answer kept, so the cache
    /// empties of them without a scan; before, they stayed until the cache
    /// was full.
    #[tokio::test(start_paused = true)]
    async fn expired_answers_go_a_few_at_a_time_as_answers_come() {
        let reviews = Reviews::new(TTL, 4, 1000);
        let ok = async || Ok(Admitted::default());
        for n in 0..40 {
            let _ = reviews.check(&format!("old-{n}"), ok).await;
        }
        assert_eq!(reviews.lock().answers.len(), 40);
        tokio::time::advance(TTL).await;
        let _ = reviews.check("new-0", ok).await;
        {
            let state = reviews.lock();
            assert_eq!(state.answers.len(), 40 - SWEEP + 1);
            assert_eq!(state.expiries.len(), state.answers.len());
        }
        for n in 1..10 {
            let _ = reviews.check(&format!("new-{n}"), ok).await;
        }
        let state = reviews.lock();
        assert_eq!(state.answers.len(), 10, "only the new answers are left");
        assert_eq!(state.expiries.len(), 10);
    }

    fn peer(n: u8) -> PeerKey {
        PeerKey::of(std::net::IpAddr::from([10, 0, 0, n]))
    }

    /// A check of `token` from `peer` against an API that answers
    /// `verdict` after 50 ms.
    fn ask_from(
        reviews: &Arc<Reviews>,
        api: &Arc<Api>,
        peer: PeerKey,
        token: String,
        verdict: Verdict,
    ) -> tokio::task::JoinHandle<(Verdict, Option<Source>)> {
        ask(reviews, api, peer, (token, false), verdict)
    }

    /// [`ask_from`] with `token` signed by the cluster's keys (or not).
    fn ask(
        reviews: &Arc<Reviews>,
        api: &Arc<Api>,
        peer: PeerKey,
        (token, signed): (String, bool),
        verdict: Verdict,
    ) -> tokio::task::JoinHandle<(Verdict, Option<Source>)> {
        let (reviews, api) = (reviews.clone(), api.clone());
        tokio::spawn(async move {
            reviews
                .check_from(&token, Some(peer), signed, async || {
                    api.review(Duration::from_millis(50), verdict).await
                })
                .await
        })
    }

    /// 16,000 checks of bad tokens from one peer, all at once: once a
    /// few reviews have failed, the peer keeps a handful of calls, those
    /// waiting give their places up when a permit comes to them, and a
    /// check from another peer is answered within a few reviews' time.
    #[tokio::test(start_paused = true)]
    async fn a_flood_from_one_peer_keeps_a_handful_of_reviews() {
        let reviews = Arc::new(Reviews::new(TTL, 32, 16_384));
        let api = Arc::new(Api::default());
        let flood: Vec<_> = (0..16_000)
            .map(|n| {
                let bad = Err(AuthError::NotAuthenticated);
                ask_from(&reviews, &api, peer(1), format!("bad-{n}"), bad)
            })
            .collect();
        while reviews.pending() < 16_000 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        let good = ask_from(
            &reviews,
            &api,
            peer(2),
            "good".to_owned(),
            Ok(Admitted::default()),
        );
        assert_eq!(
            good.await.unwrap(),
            (Ok(Admitted::default()), Some(Source::Api))
        );
        let waited = started.elapsed();
        assert!(waited <= Duration::from_millis(150), "waited {waited:?}");
        let mut slowed = 0;
        for check in flood {
            match check.await.unwrap().0 {
                Err(AuthError::PeerSlowed { .. }) => slowed += 1,
                Err(AuthError::NotAuthenticated) => {}
                other => panic!("{other:?}"),
            }
        }
        // The first 32 calls, then at most SLOWED_PENDING at a time.
        assert!(api.calls() <= 64, "{} calls", api.calls());
        assert_eq!(
            slowed + api.calls(),
            16_000 + 1,
            "each flood check, and the good one"
        );
        eprintln!(
            "{} calls, {slowed} refused slowed, the good check waited {waited:?}",
            api.calls()
        );
        assert_eq!(reviews.pending(), 0);
        // Past its cap, new connects of the peer are refused at once.
        let slow: Vec<_> = (0..4)
            .map(|n| {
                ask_from(
                    &reviews,
                    &api,
                    peer(1),
                    format!("bad-y{n}"),
                    Ok(Admitted::default()),
                )
            })
            .collect();
        while reviews.pending() < 4 {
            tokio::task::yield_now().await;
        }
        let refused = ask_from(
            &reviews,
            &api,
            peer(1),
            "bad-z".to_owned(),
            Ok(Admitted::default()),
        );
        let (verdict, source) = refused.await.unwrap();
        assert!(
            matches!(verdict, Err(AuthError::PeerSlowed { limit: 4, .. })),
            "{verdict:?}"
        );
        assert_eq!(source, None);
        assert!(verdict.unwrap_err().is_load());
        for check in slow {
            assert!(check.await.unwrap().0.is_ok());
        }
    }

    /// 100 flooders behind one address, each a bad token every 10 ms
    /// (10,000 a second), until `stop`.
    fn flood_from(
        reviews: &Arc<Reviews>,
        api: &Arc<Api>,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        (0..100)
            .map(|f| {
                let (reviews, api, stop) = (reviews.clone(), api.clone(), stop.clone());
                tokio::spawn(async move {
                    for n in 0.. {
                        let bad = Err(AuthError::NotAuthenticated);
                        let check = ask_from(&reviews, &api, peer(1), format!("bad-{f}-{n}"), bad);
                        tokio::select! {
                            () = stop.cancelled() => return,
                            () = tokio::time::sleep(Duration::from_millis(10)) => {}
                        }
                        drop(check);
                    }
                })
            })
            .collect()
    }

    /// `agents` agents behind the flooding address, each connecting until
    /// admitted, 100 ms apart, with tokens `signed` or not: how long until
    /// all were admitted, and how many connects that took.
    async fn converge(agents: usize, signed: bool) -> (Duration, usize, usize) {
        let reviews = Arc::new(Reviews::new(TTL, 32, 16_384));
        let api = Arc::new(Api::default());
        let stop = tokio_util::sync::CancellationToken::new();
        let flood = flood_from(&reviews, &api, &stop);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            reviews.lock().peers.is_slowed(peer(1), Instant::now()),
            "the flood slowed its address"
        );
        let started = Instant::now();
        let agents: Vec<_> = (0..agents)
            .map(|a| {
                let (reviews, api) = (reviews.clone(), api.clone());
                tokio::spawn(async move {
                    let mut tries = 0;
                    loop {
                        tries += 1;
                        let token = (format!("agent-{a}"), signed);
                        match ask(&reviews, &api, peer(1), token, Ok(Admitted::default()))
                            .await
                            .unwrap()
                        {
                            (Ok(_), _) => return tries,
                            (Err(error), _) => assert!(error.is_load(), "{error:?}"),
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                })
            })
            .collect();
        let mut tries = 0;
        for agent in agents {
            tries += agent.await.unwrap();
        }
        let converged = started.elapsed();
        stop.cancel();
        for flooder in flood {
            flooder.await.unwrap();
        }
        (converged, tries, api.calls())
    }

    /// Agents behind one address with a flood of bad tokens from the same
    /// address, tokens the cluster's keys cannot vouch for: every agent,
    /// retrying as agents do, is admitted, and each pass lets more of them
    /// through.
    #[tokio::test(start_paused = true)]
    async fn agents_sharing_a_flooding_address_converge() {
        const AGENTS: usize = 200;
        let (converged, tries, calls) = converge(AGENTS, false).await;
        eprintln!("{AGENTS} agents admitted in {converged:?}, {tries} connects, {calls} reviews");
        assert!(converged <= Duration::from_secs(60), "{converged:?}");
    }

    /// The same with tokens signed by the cluster's keys: none is refused
    /// for the flood that slowed its address; each waits its turn, so all
    /// are admitted on their first connect, within the time the API takes
    /// to review them beside the flood's capped share (32 calls at once,
    /// 50 ms each).
    #[tokio::test(start_paused = true)]
    async fn signed_tokens_behind_a_flooding_address_wait_their_turn() {
        const AGENTS: usize = 200;
        let (converged, tries, calls) = converge(AGENTS, true).await;
        eprintln!("{AGENTS} agents admitted in {converged:?}, {tries} connects, {calls} reviews");
        assert_eq!(tries, AGENTS, "an agent was refused");
        assert!(converged <= Duration::from_secs(2), "{converged:?}");
    }

    /// What counts against a peer: a refusal, or a call its stream gave up
    /// while the API had it (a peer could otherwise make the API work and
    /// leave before the answer); not a call that failed (API unreachable).
    #[tokio::test(start_paused = true)]
    async fn calls_abandoned_while_the_api_has_them_count_as_failed() {
        let reviews = Arc::new(Reviews::new(TTL, 32, 1000));
        let api = Arc::new(Api::default());
        let slowed = |reviews: &Reviews| reviews.lock().peers.is_slowed(peer(1), Instant::now());
        for n in 0..20 {
            let down = Err(AuthError::Review("the API answered 503".to_owned()));
            let _ = ask_from(&reviews, &api, peer(1), format!("down-{n}"), down).await;
        }
        assert_eq!(api.calls(), 20);
        assert!(!slowed(&reviews), "slowed by an outage");
        for n in 0..super::super::peers::SLOW_AFTER {
            let check = ask_from(
                &reviews,
                &api,
                peer(1),
                format!("gone-{n}"),
                Ok(Admitted::default()),
            );
            while api.calls() == 20 + n as usize {
                tokio::task::yield_now().await;
            }
            check.abort();
            let _ = check.await;
        }
        assert!(slowed(&reviews), "not slowed by abandoned calls");
        assert_eq!(reviews.pending(), 0);
    }
}
