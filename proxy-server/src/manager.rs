//! [`BackendManager`]: the connected agent streams, indexed once per
//! strategy, as plain data (ids), owned by the routing core.

use std::{collections::HashSet, net::IpAddr};

use ipnet::IpNet;

use crate::{
    ids::BackendId,
    strategy::{AgentIdentifiers, ProxyStrategy, host_of},
};

/// Backends under one strategy: key → streams, both in insertion order.
#[derive(Default)]
struct Store {
    /// `(key, backends)`; the first backend of a key is preferred.
    entries: Vec<(String, Vec<BackendId>)>,
    /// `cidr` identifiers (destHost only), same shape.
    nets: Vec<(IpNet, Vec<BackendId>)>,
}

/// Appends `backend` under `key`, keeping keys and backends in insertion order.
fn add_to<K: PartialEq>(list: &mut Vec<(K, Vec<BackendId>)>, key: K, backend: BackendId) {
    match list.iter_mut().find(|(k, _)| *k == key) {
        Some((_, backends)) => backends.push(backend),
        None => list.push((key, vec![backend])),
    }
}

fn remove_from<K>(list: &mut Vec<(K, Vec<BackendId>)>, backend: BackendId) {
    for (_, backends) in list.iter_mut() {
        backends.retain(|b| *b != backend);
    }
    list.retain(|(_, backends)| !backends.is_empty());
}

/// The candidates a pick chose among: a retry or a hedge of its dial
/// stays among them, so that it never reaches an agent the operator's
/// strategies would not have given that destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Scope {
    /// The strategy's place in `--proxy-strategies`.
    strategy: usize,
    /// Within it: every backend (`default`, `defaultRoute`), or the
    /// destHost key (host or network) that matched.
    key: Key,
}

/// The part of a strategy's backends a pick chose among.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Key {
    /// Every backend of the strategy.
    Any,
    /// The backends that announced this host, IPv4 or IPv6 address.
    Host(String),
    /// The backends that announced this network (`cidr=`).
    Net(IpNet),
}

/// What a pick avoids and weighs.
pub(crate) struct Pick<'a> {
    /// Backends that announced DRAIN: taken only when nothing else fits.
    draining: &'a HashSet<BackendId>,
    /// Backends the dial was already sent to.
    exclude: &'a [BackendId],
    /// Each backend's open connections and pending dials, weighed;
    /// `usize::MAX` for one that takes no more dials (at its cap).
    load: &'a dyn Fn(BackendId) -> usize,
    /// Where random choices come from.
    rng: &'a mut fastrand::Rng,
}

impl Pick<'_> {
    /// Whether `backend` may take the dial (`draining`: also if draining).
    fn allows(&self, backend: BackendId, draining: bool) -> bool {
        !self.exclude.contains(&backend)
            && (draining || !self.draining.contains(&backend))
            && (self.load)(backend) != usize::MAX
    }

    /// The less loaded of `a` and `b` (`a` on a tie).
    fn lighter(&self, a: BackendId, b: BackendId) -> BackendId {
        if (self.load)(b) < (self.load)(a) {
            b
        } else {
            a
        }
    }

    /// The better of two random backends of `list` that it allows ("power
    /// of two choices"); `None` if it allows none.
    fn two_choices(&mut self, list: &[BackendId], draining: bool) -> Option<BackendId> {
        let allowed = list.iter().filter(|b| self.allows(**b, draining)).count();
        let nth = |pick: &Self, n: usize| {
            list.iter()
                .copied()
                .filter(|b| pick.allows(*b, draining))
                .nth(n)
        };
        match allowed {
            0 => None,
            1 => nth(self, 0),
            n => {
                let first = self.rng.usize(..n);
                let second = (first + 1 + self.rng.usize(..n - 1)) % n;
                let (a, b) = (nth(self, first)?, nth(self, second)?);
                Some(self.lighter(a, b))
            }
        }
    }
}

/// How many random keys `default` samples before it walks them all.
const SAMPLES: usize = 8;

impl Store {
    fn remove(&mut self, backend: BackendId) {
        remove_from(&mut self.entries, backend);
        remove_from(&mut self.nets, backend);
    }

    /// Distinct keys (hosts and networks).
    fn len(&self) -> usize {
        self.entries.len() + self.nets.len()
    }

    /// destHost: the exact host key (ANP), else — for an IP destination —
    /// the networks containing it, longest prefix first; within a key, the
    /// better of two. The key that gave the backend comes with it.
    fn pick_dest(&self, address: &str, pick: &mut Pick<'_>) -> Option<(BackendId, Key)> {
        let host = host_of(address);
        if let Some(backend) = self.pick_host(host, pick) {
            return Some((backend, Key::Host(host.to_owned())));
        }
        let ip = host.parse::<IpAddr>().ok()?;
        let mut nets: Vec<_> = self.nets.iter().filter(|(n, _)| n.contains(&ip)).collect();
        // Stable: equal prefixes keep insertion order.
        nets.sort_by_key(|(n, _)| std::cmp::Reverse(n.prefix_len()));
        let lists = nets.into_iter().map(|(net, list)| (*net, list.as_slice()));
        pick_first(lists, pick).map(|(backend, net)| (backend, Key::Net(net)))
    }

    /// The better of two of the backends that announced `host`.
    fn pick_host(&self, host: &str, pick: &mut Pick<'_>) -> Option<BackendId> {
        let lists = self
            .entries
            .iter()
            .filter(|(k, _)| k == host)
            .map(|(_, list)| ((), list.as_slice()));
        pick_first(lists, pick).map(|(backend, ())| backend)
    }

    /// The better of two of the backends that announced `net`.
    fn pick_net(&self, net: IpNet, pick: &mut Pick<'_>) -> Option<BackendId> {
        let lists = self
            .nets
            .iter()
            .filter(|(n, _)| *n == net)
            .map(|(_, list)| ((), list.as_slice()));
        pick_first(lists, pick).map(|(backend, ())| backend)
    }

    /// The better of two random keys by load ("power of two choices";
    /// each key's first allowed backend); with few keys allowed, every key
    /// from a random start (ANP's default), a draining one last.
    fn pick_random(&self, pick: &mut Pick<'_>) -> Option<BackendId> {
        let n = self.entries.len();
        if n == 0 {
            return None;
        }
        let first_allowed = |pick: &Pick<'_>, list: &[BackendId], draining: bool| {
            list.iter().copied().find(|b| pick.allows(*b, draining))
        };
        let mut chosen: Vec<BackendId> = Vec::with_capacity(2);
        for _ in 0..SAMPLES {
            let (_, list) = &self.entries[pick.rng.usize(..n)];
            if let Some(backend) = first_allowed(pick, list, false)
                && !chosen.contains(&backend)
            {
                chosen.push(backend);
                if chosen.len() == 2 {
                    break;
                }
            }
        }
        match chosen[..] {
            [a, b] => return Some(pick.lighter(a, b)),
            [a] if n == 1 => return Some(a),
            _ => {}
        }
        let start = pick.rng.usize(..n);
        let (tail, head) = self.entries.split_at(start);
        let walk = || head.iter().chain(tail).map(|(_, list)| list.as_slice());
        let mut allowed = walk().filter_map(|list| first_allowed(pick, list, false));
        let first = allowed.next();
        let second = allowed.next();
        match (first, second) {
            (Some(a), Some(b)) => Some(pick.lighter(a, b)),
            (Some(a), None) => Some(a),
            _ => walk().find_map(|list| first_allowed(pick, list, true)),
        }
    }
}

/// Within the first of `lists` with a backend the pick allows, the better
/// of two, and that list's key; else the same among draining backends.
fn pick_first<'a, K>(
    lists: impl Iterator<Item = (K, &'a [BackendId])> + Clone,
    pick: &mut Pick<'_>,
) -> Option<(BackendId, K)> {
    for draining in [false, true] {
        for (key, list) in lists.clone() {
            if let Some(backend) = pick.two_choices(list, draining) {
                return Some((backend, key));
            }
        }
    }
    None
}

/// Every connected backend, indexed for each configured strategy.
pub(crate) struct BackendManager {
    /// One store per `--proxy-strategies` entry, in order.
    stores: Vec<(ProxyStrategy, Store)>,
    /// Backends that announced DRAIN (or were retired): other backends are
    /// preferred for new dials.
    draining: HashSet<BackendId>,
    /// Where `default`'s random start comes from (seeded in tests).
    rng: fastrand::Rng,
}

impl BackendManager {
    /// An empty manager for `strategies` (tried in this order).
    pub(crate) fn new(strategies: &[ProxyStrategy], rng: fastrand::Rng) -> Self {
        Self {
            stores: strategies.iter().map(|s| (*s, Store::default())).collect(),
            draining: HashSet::new(),
            rng,
        }
    }

    /// Indexes a new backend under every strategy it fits: `default` and
    /// `defaultRoute` by its voice (its credential, else its agent id), so
    /// that one voice is one candidate however many streams it opens.
    pub(crate) fn add(&mut self, backend: BackendId, voice: &str, identifiers: &AgentIdentifiers) {
        for (strategy, store) in &mut self.stores {
            match strategy {
                ProxyStrategy::Default => add_to(&mut store.entries, voice.to_owned(), backend),
                ProxyStrategy::DestHost => {
                    for key in identifiers.dest_host_keys() {
                        add_to(&mut store.entries, key.to_owned(), backend);
                    }
                    for net in &identifiers.cidrs {
                        add_to(&mut store.nets, *net, backend);
                    }
                }
                ProxyStrategy::DefaultRoute => {
                    if identifiers.default_route {
                        add_to(&mut store.entries, voice.to_owned(), backend);
                    }
                }
            }
        }
    }

    /// Takes a backend out of every strategy.
    pub(crate) fn remove(&mut self, backend: BackendId) {
        for (_, store) in &mut self.stores {
            store.remove(backend);
        }
        self.draining.remove(&backend);
    }

    /// Prefers other backends to this one from now on.
    pub(crate) fn set_draining(&mut self, backend: BackendId) {
        self.draining.insert(backend);
    }

    /// Whether the backend announced DRAIN.
    pub(crate) fn is_draining(&self, backend: BackendId) -> bool {
        self.draining.contains(&backend)
    }

    /// The backend for a dial to `address`, other than those in
    /// `exclude` (already tried): the strategies in order, the first that
    /// has one wins; among the backends a strategy offers, the less loaded
    /// of two random ones (`load`: open connections and pending dials,
    /// weighed). With it, the candidates it was chosen among: a retry or a
    /// hedge of the dial goes only to them ([`BackendManager::pick_within`]).
    pub(crate) fn pick(
        &mut self,
        address: &str,
        exclude: &[BackendId],
        load: &dyn Fn(BackendId) -> usize,
    ) -> Option<(BackendId, Scope)> {
        let Self {
            stores,
            draining,
            rng,
        } = self;
        let mut pick = Pick {
            draining,
            exclude,
            load,
            rng,
        };
        stores
            .iter()
            .enumerate()
            .find_map(|(strategy, (kind, store))| {
                let (backend, key) = match kind {
                    ProxyStrategy::Default | ProxyStrategy::DefaultRoute => {
                        (store.pick_random(&mut pick)?, Key::Any)
                    }
                    ProxyStrategy::DestHost => store.pick_dest(address, &mut pick)?,
                };
                Some((backend, Scope { strategy, key }))
            })
    }

    /// Another backend among the candidates of `scope` (a pick's), other
    /// than those in `exclude`, as [`BackendManager::pick`] weighs them;
    /// `None` when none is left there, whatever other strategies offer.
    pub(crate) fn pick_within(
        &mut self,
        scope: &Scope,
        exclude: &[BackendId],
        load: &dyn Fn(BackendId) -> usize,
    ) -> Option<BackendId> {
        let Self {
            stores,
            draining,
            rng,
        } = self;
        let (_, store) = stores.get(scope.strategy)?;
        let mut pick = Pick {
            draining,
            exclude,
            load,
            rng,
        };
        match &scope.key {
            Key::Any => store.pick_random(&mut pick),
            Key::Host(host) => store.pick_host(host, &mut pick),
            Key::Net(net) => store.pick_net(*net, &mut pick),
        }
    }

    /// Every backend indexed under a strategy or marked draining, for
    /// the routing core's `check`.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn indexed(&self) -> impl Iterator<Item = BackendId> + '_ {
        self.stores
            .iter()
            .flat_map(|(_, store)| {
                let keys = store.entries.iter().map(|(_, list)| list);
                let nets = store.nets.iter().map(|(_, list)| list);
                keys.chain(nets).flatten().copied()
            })
            .chain(self.draining.iter().copied())
    }

    /// Whether a strategy indexes `backend` (a retired one is not).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn is_indexed(&self, backend: BackendId) -> bool {
        self.stores.iter().any(|(_, store)| {
            let keys = store.entries.iter().map(|(_, list)| list);
            let nets = store.nets.iter().map(|(_, list)| list);
            keys.chain(nets).any(|list| list.contains(&backend))
        })
    }

    /// Whether `backend` is among the candidates of `scope` (a pick's).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn in_scope(&self, scope: &Scope, backend: BackendId) -> bool {
        let Some((_, store)) = self.stores.get(scope.strategy) else {
            return false;
        };
        let has = |list: &Vec<BackendId>| list.contains(&backend);
        match &scope.key {
            Key::Any => store.entries.iter().any(|(_, list)| has(list)),
            Key::Host(host) => store.entries.iter().any(|(k, list)| k == host && has(list)),
            Key::Net(net) => store.nets.iter().any(|(n, list)| n == net && has(list)),
        }
    }

    /// Ready when the first strategy has at least one backend (ANP).
    pub(crate) fn is_ready(&self) -> bool {
        self.stores
            .first()
            .is_some_and(|(_, store)| store.len() > 0)
    }

    /// Distinct keys per strategy (ANP's `ready_backends` gauge).
    pub(crate) fn ready_backends(&self) -> Vec<(ProxyStrategy, usize)> {
        self.stores
            .iter()
            .map(|(s, store)| (*s, store.len()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manager(strategies: &[ProxyStrategy]) -> BackendManager {
        BackendManager::new(strategies, fastrand::Rng::with_seed(7))
    }

    /// A pick with nothing excluded and every backend idle.
    fn pick(m: &mut BackendManager, address: &str) -> Option<BackendId> {
        m.pick(address, &[], &|_| 0).map(|(backend, _)| backend)
    }

    fn add(m: &mut BackendManager, id: u64, agent: &str, ids: &str) -> BackendId {
        let backend = BackendId(id);
        m.add(backend, agent, &AgentIdentifiers::parse(ids));
        backend
    }

    #[test]
    fn default_prefers_non_draining_and_falls_back() {
        let mut m = manager(&[ProxyStrategy::Default]);
        assert!(pick(&mut m, "x:1").is_none());
        assert!(!m.is_ready());
        let a = add(&mut m, 1, "a", "");
        let b = add(&mut m, 2, "b", "");
        assert!(m.is_ready());
        m.set_draining(a);
        for _ in 0..20 {
            assert_eq!(pick(&mut m, "x:1"), Some(b));
        }
        m.set_draining(b);
        assert!(
            pick(&mut m, "x:1").is_some(),
            "a draining agent is the fallback"
        );
        m.remove(b);
        assert_eq!(pick(&mut m, "x:1"), Some(a));
        m.remove(a);
        assert!(pick(&mut m, "x:1").is_none());
        assert!(!m.is_ready());
    }

    #[test]
    fn default_starts_at_random_keys() {
        let mut m = manager(&[ProxyStrategy::Default]);
        let a = add(&mut m, 1, "a", "");
        let b = add(&mut m, 2, "b", "");
        let picks: HashSet<_> = (0..64).filter_map(|_| pick(&mut m, "x:1")).collect();
        assert_eq!(picks, HashSet::from([a, b]));
    }

    #[test]
    fn dest_host_matches_exact_keys_then_networks_longest_first() {
        let mut m = manager(&[ProxyStrategy::DestHost, ProxyStrategy::Default]);
        let host = add(&mut m, 1, "a", "host=node-1&ipv4=10.0.0.7");
        let wide = add(&mut m, 2, "b", "cidr=10.0.0.0/8");
        let narrow = add(&mut m, 3, "c", "cidr=10.0.0.0/24");
        assert_eq!(pick(&mut m, "node-1:10250"), Some(host));
        assert_eq!(pick(&mut m, "10.0.0.7:443"), Some(host));
        assert_eq!(pick(&mut m, "10.0.0.9:443"), Some(narrow));
        assert_eq!(pick(&mut m, "10.9.0.9:443"), Some(wide));
        // No destHost match: the next strategy (default) takes it.
        assert!(pick(&mut m, "192.168.0.1:80").is_some());
        assert_eq!(
            m.ready_backends(),
            [(ProxyStrategy::DestHost, 4), (ProxyStrategy::Default, 3)]
        );
    }

    #[test]
    fn default_route_takes_only_agents_that_announce_it() {
        let mut m = manager(&[ProxyStrategy::DefaultRoute]);
        add(&mut m, 1, "a", "");
        assert!(pick(&mut m, "x:1").is_none());
        assert!(!m.is_ready());
        let b = add(&mut m, 2, "b", "default-route=true");
        assert_eq!(pick(&mut m, "x:1"), Some(b));
    }

    #[test]
    fn two_streams_of_one_agent_are_two_backends() {
        let mut m = manager(&[ProxyStrategy::Default]);
        let first = add(&mut m, 1, "a", "");
        let second = add(&mut m, 2, "a", "");
        assert_eq!(m.ready_backends(), [(ProxyStrategy::Default, 1)]);
        m.remove(first);
        assert_eq!(pick(&mut m, "x:1"), Some(second));
    }

    #[test]
    fn default_takes_the_less_loaded_of_two() {
        let mut m = manager(&[ProxyStrategy::Default]);
        let busy = add(&mut m, 1, "busy", "");
        let idle = [add(&mut m, 2, "a", ""), add(&mut m, 3, "b", "")];
        let load = |b: BackendId| if b == busy { 100 } else { 0 };
        let to_busy = (0..900)
            .filter(|_| m.pick("x:1", &[], &load).map(|(b, _)| b) == Some(busy))
            .count();
        // Only when both random choices are the busy agent's: never, as
        // two distinct keys are drawn.
        assert_eq!(to_busy, 0);
        let picks: HashSet<_> = (0..64)
            .filter_map(|_| m.pick("x:1", &[], &load).map(|(b, _)| b))
            .collect();
        assert_eq!(
            picks,
            HashSet::from(idle),
            "both idle agents share the dials"
        );
    }

    #[test]
    fn a_pick_avoids_the_backends_already_tried() {
        let mut m = manager(&[ProxyStrategy::DestHost, ProxyStrategy::Default]);
        let host = add(&mut m, 1, "a", "host=node-1");
        let other = add(&mut m, 2, "b", "");
        let idle = |_| 0;
        let picked = |m: &mut BackendManager, exclude: &[BackendId]| {
            m.pick("node-1:10250", exclude, &idle).map(|(b, _)| b)
        };
        assert_eq!(picked(&mut m, &[]), Some(host));
        // A fresh pick with its one destHost candidate tried: default,
        // after it, serves.
        assert_eq!(picked(&mut m, &[host]), Some(other));
        assert_eq!(picked(&mut m, &[host, other]), None);
        // A draining agent still serves when nothing else is left.
        m.set_draining(other);
        assert_eq!(pick(&mut m, "x:1"), Some(host));
        assert_eq!(m.pick("x:1", &[host], &idle).map(|(b, _)| b), Some(other));
    }

    #[test]
    fn a_pick_within_its_scope_never_leaves_the_strategy_and_key() {
        let mut m = manager(&[ProxyStrategy::DestHost, ProxyStrategy::Default]);
        let a = add(&mut m, 1, "a", "ipv4=10.0.0.5");
        let twin = add(&mut m, 2, "twin", "ipv4=10.0.0.5");
        let wide = add(&mut m, 3, "wide", "cidr=10.0.0.0/8");
        let narrow = add(&mut m, 4, "narrow", "cidr=10.1.0.0/16");
        let narrow_twin = add(&mut m, 5, "narrow-twin", "cidr=10.1.0.0/16");
        let other = add(&mut m, 6, "other", "");
        let idle = |_| 0;
        let (first, scope) = m.pick("10.0.0.5:443", &[], &idle).unwrap();
        assert!([a, twin].contains(&first));
        let second = m.pick_within(&scope, &[first], &idle);
        assert!(second.is_some() && second != Some(first));
        assert_eq!(
            m.pick_within(&scope, &[a, twin], &idle),
            None,
            "not wide, not default"
        );
        // A network key: only its own network's agents, not a wider one.
        let (first, scope) = m.pick("10.1.2.3:443", &[], &idle).unwrap();
        assert!([narrow, narrow_twin].contains(&first));
        assert_eq!(m.pick_within(&scope, &[narrow, narrow_twin], &idle), None);
        // `default`'s scope is every agent.
        let (first, scope) = m.pick("192.168.0.1:80", &[], &idle).unwrap();
        let rest: HashSet<_> = (0..64)
            .filter_map(|_| m.pick_within(&scope, &[first], &idle))
            .collect();
        assert!(!rest.contains(&first));
        assert!(rest.len() >= 2, "{rest:?}");
        let _ = (wide, other);
    }
}
