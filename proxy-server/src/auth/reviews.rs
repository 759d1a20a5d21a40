//! Reviews of agent tokens without a flood: each answer is cached by a
//! hash of the token, concurrent reviews of one token are one call, and at
//! most a bounded number of calls are in flight.
//!
//! - A token the API accepted is not reviewed again until its own expiry
//!   (the `exp` of a bound service-account token) or `ttl`
//!   (`--token-review-cache-ttl`), whichever is first: a revoked service
//!   account keeps its agents admitted for at most `ttl` after its last
//!   review.
//! - A token the API refused is refused from the cache for at most
//!   [`REFUSAL_TTL`]; a call that failed (API unreachable, timed out) is
//!   not cached at all.
//! - While a review of a token is in flight, every other stream with the
//!   same token waits for its answer. If the stream that made the call ends
//!   first, the next waiter calls again.
//! - Calls wait for one of `max_in_flight` permits
//!   (`--token-review-max-inflight`).
//!
//! The cache holds at most [`MAX_CACHED`] answers; past that, answers are
//! not kept until expired ones make room. The token itself is never kept.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, SystemTime},
};

use base64::Engine as _;
use ring::digest;
use tokio::{
    sync::{Semaphore, watch},
    time::Instant,
};

use super::AuthError;

/// How long a refusal from the API is reused.
pub const REFUSAL_TTL: Duration = Duration::from_secs(5);
/// Most answers kept (about 100 bytes each).
pub const MAX_CACHED: usize = 100_000;

/// What a review said.
pub(crate) type Verdict = Result<(), AuthError>;

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

/// One token's review.
enum Entry {
    /// In flight: its answer comes on the channel; a closed channel means
    /// the check that made the call ended before it.
    Pending(watch::Receiver<Option<Verdict>>),
    /// Answered, reused until `until`.
    Done { verdict: Verdict, until: Instant },
}

/// What a lookup found.
enum Lookup {
    Cached(Verdict),
    Wait(watch::Receiver<Option<Verdict>>),
    Call(watch::Sender<Option<Verdict>>),
}

/// The cache, the calls in flight and their bound; see the module
/// documentation.
pub(crate) struct Reviews {
    entries: Mutex<HashMap<Key, Entry>>,
    permits: Semaphore,
    ttl: Duration,
    /// Most entries kept, answered or in flight ([`MAX_CACHED`]).
    capacity: usize,
}

impl Reviews {
    /// Answers kept for at most `ttl`, at most `max_in_flight` calls.
    pub(crate) fn new(ttl: Duration, max_in_flight: usize) -> Self {
        Self::with_capacity(ttl, max_in_flight, MAX_CACHED)
    }

    /// [`new`](Self::new) keeping at most `capacity` entries.
    fn with_capacity(ttl: Duration, max_in_flight: usize, capacity: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            permits: Semaphore::new(max_in_flight.max(1)),
            ttl,
            capacity,
        }
    }

    /// The verdict on `token`: cached, from a call in flight, or from
    /// `review`, called at most once and only with a permit.
    pub(crate) async fn check<R>(&self, token: &str, review: R) -> (Verdict, Source)
    where
        R: AsyncFnOnce() -> Verdict,
    {
        let key: Key = digest::digest(&digest::SHA256, token.as_bytes())
            .as_ref()
            .try_into()
            .expect("SHA-256 is 32 bytes");
        loop {
            match self.lookup(key) {
                Lookup::Cached(verdict) => return (verdict, Source::Cache),
                Lookup::Call(answer) => {
                    let verdict = {
                        let _permit = self.permits.acquire().await;
                        review().await
                    };
                    self.settle(key, &verdict, token);
                    let _ = answer.send(Some(verdict.clone()));
                    return (verdict, Source::Api);
                }
                Lookup::Wait(mut answer) => {
                    if let Ok(verdict) = answer.wait_for(Option::is_some).await {
                        let verdict = verdict.clone().expect("waited for an answer");
                        return (verdict, Source::Coalesced);
                    }
                    // The caller ended before its answer: call again.
                }
            }
        }
    }

    /// The entry of `key`, or a new pending one this check is to answer.
    fn lookup(&self, key: Key) -> Lookup {
        let mut entries = self.lock();
        match entries.get(&key) {
            Some(Entry::Done { verdict, until }) if Instant::now() < *until => {
                return Lookup::Cached(verdict.clone());
            }
            Some(Entry::Pending(answer)) if answer.has_changed().is_ok() => {
                return Lookup::Wait(answer.clone());
            }
            _ => {}
        }
        let (answer, waiting) = watch::channel(None);
        entries.insert(key, Entry::Pending(waiting));
        Lookup::Call(answer)
    }

    /// Keeps `verdict` on `token` for as long as it may be reused, or
    /// forgets the review.
    fn settle(&self, key: Key, verdict: &Verdict, token: &str) {
        let mut entries = self.lock();
        let Some(keep) = self.keep_for(verdict, token) else {
            entries.remove(&key);
            return;
        };
        let now = Instant::now();
        // `key` is in the map (pending since its lookup): over the cap it
        // would take room no expired entry left.
        if entries.len() > self.capacity {
            entries.retain(|_, entry| match entry {
                Entry::Done { until, .. } => now < *until,
                Entry::Pending(answer) => answer.has_changed().is_ok(),
            });
        }
        if entries.len() > self.capacity {
            entries.remove(&key);
            return;
        }
        entries.insert(
            key,
            Entry::Done {
                verdict: verdict.clone(),
                until: now + keep,
            },
        );
    }

    /// How long `verdict` may be reused: `None` for not at all.
    fn keep_for(&self, verdict: &Verdict, token: &str) -> Option<Duration> {
        match verdict {
            Ok(()) => {
                let keep = match token_expiry(token) {
                    Some(expiry) => expiry.duration_since(SystemTime::now()).ok()?.min(self.ttl),
                    None => self.ttl,
                };
                (!keep.is_zero()).then_some(keep)
            }
            // The call failed: nothing was said about the token.
            Err(AuthError::Review(_)) => None,
            Err(_) => Some(REFUSAL_TTL.min(self.ttl)).filter(|keep| !keep.is_zero()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Entry>> {
        // A panic elsewhere while holding the lock leaves the map whole.
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The `exp` claim of a JWT, read without checking its signature (the API
/// checked the token; this only bounds how long its answer is reused).
fn token_expiry(token: &str) -> Option<SystemTime> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let exp = claims.get("exp")?.as_u64()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(exp))
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

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
        let reviews = Reviews::new(TTL, 4);
        let api = Api::default();
        let ask = || reviews.check("t", async || api.review(Duration::ZERO, Ok(())).await);
        assert_eq!(ask().await, (Ok(()), Source::Api));
        assert_eq!(ask().await, (Ok(()), Source::Cache));
        tokio::time::advance(TTL - Duration::from_millis(1)).await;
        assert_eq!(ask().await, (Ok(()), Source::Cache));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            ask().await,
            (Ok(()), Source::Api),
            "reviewed again at the ttl"
        );
        assert_eq!(api.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_is_not_cached_past_its_own_expiry() {
        let reviews = Reviews::new(TTL, 4);
        let api = Api::default();
        // The test's paused clock does not move SystemTime: expiry 3 s
        // after now, against a 120 s ttl, caches for under 3 s.
        let soon = jwt(unix_now() + 3, 1);
        let ask = |t: String| {
            let (reviews, api) = (&reviews, &api);
            async move {
                reviews
                    .check(&t, async || api.review(Duration::ZERO, Ok(())).await)
                    .await
                    .1
            }
        };
        assert_eq!(ask(soon.clone()).await, Source::Api);
        assert_eq!(ask(soon.clone()).await, Source::Cache);
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(ask(soon).await, Source::Api);
        // Expired already: never cached.
        let past = jwt(unix_now() - 1, 2);
        assert_eq!(ask(past.clone()).await, Source::Api);
        assert_eq!(ask(past).await, Source::Api);
        // A long-lived token: the ttl bounds it.
        let late = jwt(unix_now() + 3600, 3);
        assert_eq!(ask(late.clone()).await, Source::Api);
        tokio::time::advance(TTL).await;
        assert_eq!(ask(late).await, Source::Api);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_checks_of_one_token_make_one_call() {
        let reviews = Reviews::new(TTL, 4);
        let api = Api::default();
        let checks = (0..50).map(|_| {
            reviews.check("same", async || {
                api.review(Duration::from_millis(200), Ok(())).await
            })
        });
        let answers = futures_util::future::join_all(checks).await;
        assert_eq!(api.calls(), 1);
        assert!(answers.iter().all(|(v, _)| v.is_ok()));
        let coalesced = answers
            .iter()
            .filter(|(_, s)| *s == Source::Coalesced)
            .count();
        assert_eq!(coalesced, 49);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_in_flight_stay_within_the_bound() {
        let reviews = Reviews::new(TTL, 3);
        let api = Api::default();
        let tokens: Vec<String> = (0..20).map(|n| format!("token-{n}")).collect();
        let checks = tokens.iter().map(|t| {
            reviews.check(t, async || {
                api.review(Duration::from_millis(100), Ok(())).await
            })
        });
        futures_util::future::join_all(checks).await;
        assert_eq!(api.calls(), 20);
        assert_eq!(api.most.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_call_is_not_cached_and_a_refusal_only_briefly() {
        let reviews = Reviews::new(TTL, 4);
        let api = Api::default();
        let failed = || AuthError::Review("the API answered 503".to_owned());
        let (verdict, _) = reviews
            .check("t", async || {
                api.review(Duration::ZERO, Err(failed())).await
            })
            .await;
        assert!(matches!(verdict, Err(AuthError::Review(_))));
        let (verdict, source) = reviews
            .check("t", async || api.review(Duration::ZERO, Ok(())).await)
            .await;
        assert_eq!((verdict.is_ok(), source), (true, Source::Api));

        let refuse = async || {
            api.review(Duration::ZERO, Err(AuthError::NotAuthenticated))
                .await
        };
        assert_eq!(reviews.check("bad", refuse).await.1, Source::Api);
        let (verdict, source) = reviews.check("bad", refuse).await;
        assert!(matches!(verdict, Err(AuthError::NotAuthenticated)));
        assert_eq!(source, Source::Cache);
        tokio::time::advance(REFUSAL_TTL).await;
        assert_eq!(reviews.check("bad", refuse).await.1, Source::Api);
    }

    #[tokio::test(start_paused = true)]
    async fn answers_past_the_capacity_are_not_kept_until_expired_ones_make_room() {
        let reviews = Reviews::with_capacity(TTL, 4, 3);
        let api = Api::default();
        let ask = |t: &'static str| {
            let (reviews, api) = (&reviews, &api);
            async move {
                reviews
                    .check(t, async || api.review(Duration::ZERO, Ok(())).await)
                    .await
                    .1
            }
        };
        for t in ["a", "b", "c"] {
            assert_eq!(ask(t).await, Source::Api);
        }
        assert_eq!(ask("d").await, Source::Api);
        assert_eq!(reviews.lock().len(), 3, "the fourth answer was kept");
        assert_eq!(ask("d").await, Source::Api, "not cached");
        assert_eq!(ask("a").await, Source::Cache);
        // Expired answers make room.
        tokio::time::advance(TTL).await;
        assert_eq!(ask("d").await, Source::Api);
        assert_eq!(ask("d").await, Source::Cache);
        assert!(reviews.lock().len() <= 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_calls_again_when_the_caller_ends_first() {
        let reviews = Arc::new(Reviews::new(TTL, 4));
        let api = Arc::new(Api::default());
        let first = {
            let (reviews, api) = (reviews.clone(), api.clone());
            tokio::spawn(async move {
                reviews
                    .check("t", async || {
                        api.review(Duration::from_secs(10), Ok(())).await
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
                        api.review(Duration::from_millis(5), Ok(())).await
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        first.abort();
        let (verdict, source) = second.await.unwrap();
        assert_eq!((verdict.is_ok(), source), (true, Source::Api));
        assert_eq!(api.calls(), 2);
    }
}
