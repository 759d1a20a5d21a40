//! Peers whose tokens keep failing review, slowed without slowing peers
//! whose tokens pass. Plain data with the clock given; [`super::reviews`]
//! holds it under its lock.
//!
//! A peer is a source address: an IPv4 address, or an IPv6 /64 (what one
//! host is usually given). An IPv6 /64 is also counted in its /48 (what
//! one site is usually given): a /48 that rotates its /64s, each new one
//! with a clean record, is slowed as one peer, and its /64s with it.
//! Agents behind a NAT or a load balancer share one, and reconnect
//! together when a server restarts, so a peer is never capped for the
//! number of its connects, only for its failures:
//! - Each review the API answers counts for the peer whose connect made
//!   the call: passed (the token was admitted) or failed (refused, or the
//!   API reported an error for it). A call abandoned by its stream while
//!   the API had it counts as failed: otherwise a peer could make the API
//!   work and never be told. Calls that failed (API unreachable) or never
//!   started count for nothing.
//! - The counts halve every [`HALF_LIFE`] and stop at [`MAX_COUNT`].
//! - A peer is **slowed** while its failed reviews outnumber its passed
//!   ones by [`SLOW_AFTER`] or more. A slowed peer may have at most
//!   [`SLOWED_PENDING`] connects waiting for a review, plus one for each of
//!   its passed reviews; its connects past that are refused at once
//!   (`Unavailable`, retried by agents), and so are those already waiting
//!   when a permit comes to them while that many of its calls are in
//!   flight. So a flood of bad tokens from one address keeps a handful of
//!   reviews, and agents sharing its address still get theirs, each one
//!   that passes raising the cap, until passes outweigh failures and the
//!   cap is gone.
//! - A check whose token is signed by the cluster's keys
//!   ([`super::keys`]) is never capped, on entering or calling: it waits
//!   its turn as any peer's check does. No flood can sign its tokens, so
//!   agents sharing a flood's address are admitted on their first connect;
//!   a queue alone would put them behind the flood, and a cap alone
//!   refuses them with it, since nothing else tells them apart before a
//!   review. Its reviews count as any other's.
//! - A /64 is capped when it, or its /48, is slowed and at its cap; its
//!   checks, calls and reviews count in both records.
//! - At most [`MAX_PEERS`] peers are remembered; past that, the one seen
//!   least recently is forgotten.

use std::{
    collections::{BTreeSet, HashMap, hash_map},
    fmt,
    net::{IpAddr, Ipv6Addr},
    time::Duration,
};

use tokio::time::Instant;

/// How many more failed reviews than passed ones slow a peer.
pub const SLOW_AFTER: u32 = 8;
/// Connects a slowed peer may have waiting for a review at once, before
/// its passed reviews add one each.
pub const SLOWED_PENDING: usize = 4;
/// The failed and passed counts halve this often.
pub const HALF_LIFE: Duration = Duration::from_secs(30);
/// The most either count reaches: a peer that stops failing is slowed for
/// at most log2(MAX_COUNT / SLOW_AFTER) + 1 = 8 half-lives (4 minutes) more.
pub const MAX_COUNT: u32 = 1024;
/// Peers remembered (about 100 bytes each).
pub const MAX_PEERS: usize = 16_384;

/// A peer: an IPv4 address, or the /64 (or, as the wider peer, the /48)
/// of an IPv6 address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerKey(IpAddr, u8);

/// The prefix of a peer's IPv6 addresses (one host).
const HOST_PREFIX: u8 = 64;
/// The prefix of a wider peer's IPv6 addresses (one site).
const SITE_PREFIX: u8 = 48;

impl PeerKey {
    /// The peer of a connection from `ip`; an IPv4-mapped IPv6 address is
    /// its IPv4 address.
    pub fn of(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(v4) => Self(IpAddr::V4(v4), 32),
            IpAddr::V6(v6) => Self::v6(v6, HOST_PREFIX),
        }
    }

    /// The /`prefix` of `v6`.
    fn v6(v6: Ipv6Addr, prefix: u8) -> Self {
        let mask = !(u128::MAX >> prefix);
        Self(IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask)), prefix)
    }

    /// The wider peer an IPv6 /64 is also counted in: its /48.
    pub fn wider(self) -> Option<Self> {
        match self.0 {
            IpAddr::V6(v6) if self.1 > SITE_PREFIX => Some(Self::v6(v6, SITE_PREFIX)),
            _ => None,
        }
    }
}

impl fmt::Display for PeerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            IpAddr::V4(v4) => write!(f, "{v4}"),
            IpAddr::V6(v6) => write!(f, "{v6}/{}", self.1),
        }
    }
}

/// A slowed peer at its cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slowed {
    /// The peer slowed: the check's own, or its /48.
    pub(crate) key: PeerKey,
    /// Its failed reviews (decayed).
    pub(crate) failed: u32,
    /// How many of its connects may wait for a review.
    pub(crate) limit: usize,
}

/// What a review said of a peer's token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Admitted.
    Passed,
    /// Refused, or abandoned while the API had it.
    Failed,
}

/// A check's place, counted in its peer's record (and its wider peer's)
/// until it [`leave`](Peers::leave)s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    /// Whose.
    pub(crate) key: PeerKey,
    /// Which record: a forgotten peer's places count for nothing.
    born: u64,
    /// The wider peer's record it also counts in, if any.
    wide: Option<(PeerKey, u64)>,
    /// Whether its token is signed by the cluster's keys: never capped.
    pub(crate) signed: bool,
}

impl Place {
    /// The records it counts in: `(key, born)`.
    fn records(self) -> impl Iterator<Item = (PeerKey, u64)> {
        std::iter::once((self.key, self.born)).chain(self.wide)
    }
}

/// What is known of one peer.
#[derive(Debug)]
struct Peer {
    /// When the record was made (tells it from a later one of the peer).
    born: u64,
    /// When it was last seen, for forgetting the oldest.
    seen: u64,
    /// Its checks waiting for a review now.
    waiting: usize,
    /// Of those, the ones making a call (holding a permit).
    calling: usize,
    /// Failed reviews, halved every [`HALF_LIFE`].
    failed: u32,
    /// Passed reviews, halved every [`HALF_LIFE`].
    passed: u32,
    /// When the counts were last halved.
    decayed: Instant,
}

impl Peer {
    /// Halves the counts once per [`HALF_LIFE`] since they last were.
    fn decay(&mut self, now: Instant) {
        let halvings =
            now.saturating_duration_since(self.decayed).as_nanos() / HALF_LIFE.as_nanos();
        if halvings == 0 {
            return;
        }
        let (failed, passed) = match u32::try_from(halvings) {
            Ok(n) if n < 32 => (self.failed >> n, self.passed >> n),
            _ => (0, 0),
        };
        (self.failed, self.passed) = (failed, passed);
        self.decayed = u32::try_from(halvings)
            .ok()
            .and_then(|n| HALF_LIFE.checked_mul(n))
            .and_then(|d| self.decayed.checked_add(d))
            .unwrap_or(now);
    }

    fn slowed(&self) -> bool {
        self.failed >= self.passed.saturating_add(SLOW_AFTER)
    }

    /// How many of its connects may wait, if it is slowed.
    fn limit(&self) -> usize {
        SLOWED_PENDING.saturating_add(self.passed as usize)
    }

    /// `Some` if slowed and `count` of its connects are already at the cap.
    fn at_cap(&self, key: PeerKey, count: usize) -> Option<Slowed> {
        (self.slowed() && count >= self.limit()).then(|| Slowed {
            key,
            failed: self.failed,
            limit: self.limit(),
        })
    }
}

/// The peers' records; see the module documentation.
#[derive(Debug)]
pub(crate) struct Peers {
    /// Records by peer.
    peers: HashMap<PeerKey, Peer>,
    /// The records by when their peer was last seen, oldest first.
    by_age: BTreeSet<(u64, PeerKey)>,
    /// Stamps `seen` and `born`; grows by one per stamp.
    clock: u64,
    /// Most records kept.
    capacity: usize,
}

impl Default for Peers {
    fn default() -> Self {
        Self::with_capacity(MAX_PEERS)
    }
}

impl Peers {
    /// Keeping at most `capacity` records (at least one).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            peers: HashMap::new(),
            by_age: BTreeSet::new(),
            clock: 0,
            capacity: capacity.max(1),
        }
    }

    /// Peers remembered now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.peers.len()
    }

    /// A check of `key` starts waiting for a review, unless `key`, or its
    /// wider peer, is slowed and at its cap.
    pub(crate) fn enter(&mut self, key: PeerKey, now: Instant) -> Result<Place, Slowed> {
        self.admit(key, now, false)
    }

    /// A check of `key` whose token is signed by the cluster's keys
    /// ([`super::keys`]) starts waiting for a review, slowed or not.
    pub(crate) fn enter_signed(&mut self, key: PeerKey, now: Instant) -> Place {
        self.admit(key, now, true)
            .expect("a signed token's check is never capped")
    }

    /// [`enter`](Self::enter), capped unless `signed`.
    fn admit(&mut self, key: PeerKey, now: Instant, signed: bool) -> Result<Place, Slowed> {
        let peer = self.touch(key, now);
        if let Some(slowed) = peer.at_cap(key, peer.waiting).filter(|_| !signed) {
            return Err(slowed);
        }
        let wide = match key.wider() {
            Some(wide) => {
                let record = self.touch(wide, now);
                if let Some(slowed) = record.at_cap(wide, record.waiting).filter(|_| !signed) {
                    return Err(slowed);
                }
                record.waiting += 1;
                Some((wide, record.born))
            }
            None => None,
        };
        // Touched first, the wider record never evicts this one (unless
        // only one is kept: then its place counts for nothing).
        let born = match self.peers.get_mut(&key) {
            Some(peer) => {
                peer.waiting += 1;
                peer.born
            }
            None => 0,
        };
        Ok(Place {
            key,
            born,
            wide,
            signed,
        })
    }

    /// `place`'s check got a permit: it may call unless its peer, or its
    /// wider peer, is slowed and that many of its calls are in flight
    /// (a signed token's check may call whatever).
    pub(crate) fn start_call(&mut self, place: Place, now: Instant) -> Result<(), Slowed> {
        for (key, born) in place.records() {
            if let Some(peer) = self.record(key, born) {
                peer.decay(now);
                if let Some(slowed) = peer.at_cap(key, peer.calling).filter(|_| !place.signed) {
                    return Err(slowed);
                }
            }
        }
        for (key, born) in place.records() {
            if let Some(peer) = self.record(key, born) {
                peer.calling += 1;
            }
        }
        Ok(())
    }

    /// `place`'s call ended.
    pub(crate) fn end_call(&mut self, place: Place) {
        for (key, born) in place.records() {
            if let Some(peer) = self.record(key, born) {
                peer.calling = peer.calling.saturating_sub(1);
            }
        }
    }

    /// `place`'s check ended; a record with nothing in it is dropped.
    pub(crate) fn leave(&mut self, place: Place) {
        for (key, born) in place.records() {
            let Some(peer) = self.record(key, born) else {
                continue;
            };
            peer.waiting = peer.waiting.saturating_sub(1);
            if peer.waiting == 0 && peer.calling == 0 && peer.failed == 0 && peer.passed == 0 {
                let seen = peer.seen;
                self.peers.remove(&key);
                self.by_age.remove(&(seen, key));
            }
        }
    }

    /// Counts a review of `key`'s token, in its wider peer's record too;
    /// the peer that this slowed, if it did.
    pub(crate) fn count(
        &mut self,
        key: PeerKey,
        outcome: Outcome,
        now: Instant,
    ) -> Option<PeerKey> {
        let mut slowed = None;
        for key in std::iter::once(key).chain(key.wider()) {
            let peer = self.touch(key, now);
            let was = peer.slowed();
            match outcome {
                Outcome::Passed => peer.passed = (peer.passed + 1).min(MAX_COUNT),
                Outcome::Failed => peer.failed = (peer.failed + 1).min(MAX_COUNT),
            }
            if !was && peer.slowed() {
                slowed.get_or_insert(key);
            }
        }
        slowed
    }

    /// Panics unless the records are whole: indexed by age exactly, within
    /// the capacity, counts within [`MAX_COUNT`], no more calls than
    /// checks waiting.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn check(&self) {
        assert!(
            self.peers.len() <= self.capacity,
            "{} records",
            self.peers.len()
        );
        assert_eq!(self.by_age.len(), self.peers.len());
        for (key, peer) in &self.peers {
            assert!(
                self.by_age.contains(&(peer.seen, *key)),
                "{key} not indexed"
            );
            assert!(
                peer.failed <= MAX_COUNT && peer.passed <= MAX_COUNT,
                "{peer:?}"
            );
            assert!(peer.calling <= peer.waiting, "{key}: {peer:?}");
            assert!(
                peer.born <= peer.seen && peer.seen <= self.clock,
                "{peer:?}"
            );
        }
    }

    /// Whether no check is counted in any record.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn idle(&self) -> bool {
        self.peers
            .values()
            .all(|peer| peer.waiting == 0 && peer.calling == 0)
    }

    /// Whether `key` is slowed now.
    #[cfg(test)]
    pub(crate) fn is_slowed(&mut self, key: PeerKey, now: Instant) -> bool {
        self.peers.get_mut(&key).is_some_and(|peer| {
            peer.decay(now);
            peer.slowed()
        })
    }

    /// `key`'s record born at `born`, if it is still the peer's.
    fn record(&mut self, key: PeerKey, born: u64) -> Option<&mut Peer> {
        self.peers.get_mut(&key).filter(|peer| peer.born == born)
    }

    /// `key`'s record (made, and the oldest forgotten, if need be), seen
    /// now, its counts decayed.
    fn touch(&mut self, key: PeerKey, now: Instant) -> &mut Peer {
        self.clock += 1;
        let stamp = self.clock;
        if !self.peers.contains_key(&key)
            && self.peers.len() >= self.capacity
            && let Some((_, oldest)) = self.by_age.pop_first()
        {
            self.peers.remove(&oldest);
        }
        let peer = match self.peers.entry(key) {
            hash_map::Entry::Occupied(entry) => {
                let peer = entry.into_mut();
                self.by_age.remove(&(peer.seen, key));
                peer
            }
            hash_map::Entry::Vacant(entry) => entry.insert(Peer {
                born: stamp,
                seen: stamp,
                waiting: 0,
                calling: 0,
                failed: 0,
                passed: 0,
                decayed: now,
            }),
        };
        peer.seen = stamp;
        self.by_age.insert((stamp, key));
        peer.decay(now);
        peer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(n: u8) -> PeerKey {
        PeerKey::of(IpAddr::from([10, 0, 0, n]))
    }

    /// `n` failed reviews of `key`.
    fn fail(peers: &mut Peers, key: PeerKey, n: u32, now: Instant) {
        for _ in 0..n {
            peers.count(key, Outcome::Failed, now);
        }
    }

    #[test]
    fn a_peer_is_an_ipv4_address_or_an_ipv6_64() {
        let v6 = |s: &str| PeerKey::of(s.parse().unwrap());
        assert_eq!(v6("2001:db8:1:2:aaaa::1"), v6("2001:db8:1:2:bbbb::2"));
        assert_ne!(v6("2001:db8:1:2::1"), v6("2001:db8:1:3::1"));
        assert_eq!(v6("2001:db8:1:2:aaaa::1").to_string(), "2001:db8:1:2::/64");
        assert_eq!(
            v6("2001:db8:1:2:aaaa::1").wider().unwrap().to_string(),
            "2001:db8:1::/48"
        );
        assert_eq!(
            v6("2001:db8:1:2::1").wider(),
            v6("2001:db8:1:ffff::9").wider()
        );
        assert_eq!(peer(1).wider(), None, "an IPv4 address is one peer");
        assert_eq!(v6("2001:db8:1:2::1").wider().unwrap().wider(), None);
        assert_eq!(v6("::ffff:10.0.0.1"), peer(1));
        assert_eq!(peer(1).to_string(), "10.0.0.1");
        assert_ne!(peer(1), peer(2));
    }

    /// A peer whose reviews pass is never capped, however many of its
    /// connects wait at once (a restart storm behind a NAT).
    #[test]
    fn a_peer_whose_reviews_pass_is_never_capped() {
        let now = Instant::now();
        let mut peers = Peers::default();
        let places: Vec<_> = (0..20_000)
            .map(|_| peers.enter(peer(1), now).unwrap())
            .collect();
        for place in &places {
            peers.start_call(*place, now).unwrap();
            peers.count(peer(1), Outcome::Passed, now);
            peers.end_call(*place);
        }
        // A few failures among many passes change nothing.
        fail(&mut peers, peer(1), 100, now);
        for _ in 0..1000 {
            peers.enter(peer(1), now).unwrap();
        }
    }

    /// [`SLOW_AFTER`] failures slow a peer: [`SLOWED_PENDING`] of its
    /// connects may wait, the next is refused; other peers are not slowed.
    #[test]
    fn a_peer_whose_reviews_fail_is_capped() {
        let now = Instant::now();
        let mut peers = Peers::default();
        let flood: Vec<_> = (0..100)
            .map(|_| peers.enter(peer(1), now).unwrap())
            .collect();
        fail(&mut peers, peer(1), SLOW_AFTER - 1, now);
        peers.enter(peer(1), now).unwrap();
        assert_eq!(
            peers.count(peer(1), Outcome::Failed, now),
            Some(peer(1)),
            "slowed"
        );
        let slowed = Slowed {
            key: peer(1),
            failed: SLOW_AFTER,
            limit: SLOWED_PENDING,
        };
        assert_eq!(peers.enter(peer(1), now), Err(slowed));
        // Of the 101 already waiting, SLOWED_PENDING may call.
        let calls: Vec<_> = flood.iter().map(|t| peers.start_call(*t, now)).collect();
        assert_eq!(calls.iter().filter(|c| c.is_ok()).count(), SLOWED_PENDING);
        assert_eq!(calls[SLOWED_PENDING], Err(slowed));
        // The waiting leave; a place comes back only below the cap.
        for place in &flood[SLOWED_PENDING..] {
            peers.leave(*place);
        }
        assert_eq!(peers.enter(peer(1), now), Err(slowed), "5 still wait");
        for place in &flood[..2] {
            peers.end_call(*place);
            peers.leave(*place);
        }
        peers.enter(peer(1), now).unwrap();
        // Another peer is not slowed.
        for _ in 0..100 {
            peers.enter(peer(2), now).unwrap();
        }
    }

    /// Each passed review raises a slowed peer's cap by one, and passes
    /// that outweigh its failures end the slowdown: agents sharing a
    /// flooding address converge.
    #[test]
    fn passed_reviews_lift_the_cap() {
        let now = Instant::now();
        let mut peers = Peers::default();
        fail(&mut peers, peer(1), 20, now);
        let mut waiting = Vec::new();
        while let Ok(place) = peers.enter(peer(1), now) {
            waiting.push(place);
        }
        assert_eq!(waiting.len(), SLOWED_PENDING);
        // Slowed while 20 failed >= passed + 8.
        for passes in 1..=12 {
            peers.count(peer(1), Outcome::Passed, now);
            let place = peers.enter(peer(1), now).expect("the cap rose by one");
            waiting.push(place);
            assert!(peers.enter(peer(1), now).is_err(), "after {passes} passes");
        }
        peers.count(peer(1), Outcome::Passed, now);
        for _ in 0..1000 {
            peers.enter(peer(1), now).unwrap();
        }
    }

    /// The counts halve every [`HALF_LIFE`]: a peer that stops failing is
    /// not slowed for long, even after [`MAX_COUNT`] failures.
    #[test]
    fn a_slowed_peer_recovers_as_its_failures_age() {
        let start = Instant::now();
        let mut peers = Peers::default();
        fail(&mut peers, peer(1), 100_000, start);
        let refused = |peers: &mut Peers, at| {
            (0..=SLOWED_PENDING)
                .map(|_| peers.enter(peer(1), at))
                .any(|r| r.is_err())
        };
        assert!(refused(&mut peers, start));
        assert!(refused(&mut peers, start + HALF_LIFE * 7));
        assert!(!refused(&mut peers, start + HALF_LIFE * 8));
    }

    /// At most `capacity` peers are remembered, the least recently seen
    /// forgotten first; a forgotten peer's checks count for nothing in a
    /// new record of it.
    #[test]
    fn the_records_are_bounded_and_the_oldest_go_first() {
        let now = Instant::now();
        let mut peers = Peers::with_capacity(3);
        let old = peers.enter(peer(1), now).unwrap();
        fail(&mut peers, peer(2), SLOW_AFTER, now);
        fail(&mut peers, peer(3), SLOW_AFTER, now);
        // peer 2 seen again: peer 1 is the oldest.
        assert!(peers.enter(peer(2), now).is_ok());
        fail(&mut peers, peer(4), 1, now);
        assert_eq!(peers.len(), 3);
        assert!(!peers.peers.contains_key(&peer(1)));
        assert!(peers.peers.contains_key(&peer(2)));
        // peer 1 again: a new record; the old place changes nothing.
        let new = peers.enter(peer(1), now).unwrap();
        assert_ne!(old, new);
        peers.leave(old);
        assert_eq!(peers.peers[&peer(1)].waiting, 1);
        peers.leave(new);
        assert!(!peers.peers.contains_key(&peer(1)), "an empty record stays");
        assert!(peers.len() <= 3);
    }

    /// Issue 51: a /48 that rotates its /64s, each with a clean record and
    /// under the failures that slow one, is slowed as one peer: a fresh
    /// /64 of it is capped at once, and the refusal names the /48; a /64
    /// of another /48 is not. Before, each /64 had its own record and
    /// none was ever slowed (nor would a /48 of them fit in the records).
    #[test]
    fn a_48_rotating_its_64s_is_slowed_as_one_peer() {
        let now = Instant::now();
        let mut peers = Peers::default();
        let v6 = |s: String| PeerKey::of(s.parse().unwrap());
        for i in 0..SLOW_AFTER {
            let key = v6(format!("2001:db8:7:{i:x}::1"));
            peers.count(key, Outcome::Failed, now);
            assert!(!peers.is_slowed(key, now), "one failure each");
        }
        let fresh = v6("2001:db8:7:ffff::1".to_owned());
        let site = fresh.wider().unwrap();
        let mut waiting: Vec<_> = (0..SLOWED_PENDING)
            .map(|_| peers.enter(fresh, now).unwrap())
            .collect();
        assert_eq!(
            peers.enter(fresh, now),
            Err(Slowed {
                key: site,
                failed: SLOW_AFTER,
                limit: SLOWED_PENDING,
            })
        );
        assert!(peers.enter(v6("2001:db8:8::1".to_owned()), now).is_ok());
        // Passes in the /48 lift its cap, as a NAT's do.
        peers.count(v6("2001:db8:7:1::9".to_owned()), Outcome::Passed, now);
        waiting.push(peers.enter(fresh, now).expect("the cap rose by one"));
        for place in waiting {
            peers.leave(place);
        }
        peers.check();
    }
}
