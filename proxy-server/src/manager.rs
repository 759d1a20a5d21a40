//! [`BackendManager`]: the connected agent streams, indexed once per
//! strategy, as plain data (ids), owned by the routing core.

use std::{collections::HashSet, net::IpAddr};

use ipnet::IpNet;
use tunnel::ids::AgentId;

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

/// What a pick avoids and weighs.
pub(crate) struct Pick<'a> {
    /// Backends that announced DRAIN: taken only when nothing else fits.
    draining: &'a HashSet<BackendId>,
    /// Backends the dial was already sent to.
    exclude: &'a [BackendId],
    /// Each backend's open connections and pending dials.
    load: &'a dyn Fn(BackendId) -> usize,
    /// Where random choices come from.
    rng: &'a mut fastrand::Rng,
}

impl Pick<'_> {
    /// Whether `backend` may take the dial (`draining`: also if draining).
    fn allows(&self, backend: BackendId, draining: bool) -> bool {
        !self.exclude.contains(&backend) && (draining || !self.draining.contains(&backend))
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
    /// better of two.
    fn pick_dest(&self, address: &str, pick: &mut Pick<'_>) -> Option<BackendId> {
        let host = host_of(address);
        let exact = self
            .entries
            .iter()
            .filter(|(k, _)| k == host)
            .map(|(_, list)| list.as_slice());
        if let Some(backend) = pick_first(exact, pick) {
            return Some(backend);
        }
        let ip = host.parse::<IpAddr>().ok()?;
        let mut nets: Vec<_> = self.nets.iter().filter(|(n, _)| n.contains(&ip)).collect();
        // Stable: equal prefixes keep insertion order.
        nets.sort_by_key(|(n, _)| std::cmp::Reverse(n.prefix_len()));
        pick_first(nets.into_iter().map(|(_, list)| list.as_slice()), pick)
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
/// of two; else the same among draining backends.
fn pick_first<'a>(
    lists: impl Iterator<Item = &'a [BackendId]> + Clone,
    pick: &mut Pick<'_>,
) -> Option<BackendId> {
    for draining in [false, true] {
        for list in lists.clone() {
            if let Some(backend) = pick.two_choices(list, draining) {
                return Some(backend);
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

    /// Indexes a new backend under every strategy it fits.
    pub(crate) fn add(
        &mut self,
        backend: BackendId,
        agent_id: &AgentId,
        identifiers: &AgentIdentifiers,
    ) {
        for (strategy, store) in &mut self.stores {
            match strategy {
                ProxyStrategy::Default => add_to(&mut store.entries, agent_id.0.clone(), backend),
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
                        add_to(&mut store.entries, agent_id.0.clone(), backend);
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
    /// of two random ones (`load`: open connections and pending dials).
    pub(crate) fn pick(
        &mut self,
        address: &str,
        exclude: &[BackendId],
        load: &dyn Fn(BackendId) -> usize,
    ) -> Option<BackendId> {
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
        stores.iter().find_map(|(strategy, store)| match strategy {
            ProxyStrategy::Default | ProxyStrategy::DefaultRoute => store.pick_random(&mut pick),
            ProxyStrategy::DestHost => store.pick_dest(address, &mut pick),
        })
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
        m.pick(address, &[], &|_| 0)
    }

    fn add(m: &mut BackendManager, id: u64, agent: &str, ids: &str) -> BackendId {
        let backend = BackendId(id);
        m.add(
            backend,
            &AgentId(agent.to_owned()),
            &AgentIdentifiers::parse(ids),
        );
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
            .filter(|_| m.pick("x:1", &[], &load) == Some(busy))
            .count();
        // Only when both random choices are the busy agent's: never, as
        // two distinct keys are drawn.
        assert_eq!(to_busy, 0);
        let picks: HashSet<_> = (0..64).filter_map(|_| m.pick("x:1", &[], &load)).collect();
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
        assert_eq!(m.pick("node-1:10250", &[], &|_| 0), Some(host));
        // Its one destHost candidate tried: default, after it, serves.
        assert_eq!(m.pick("node-1:10250", &[host], &|_| 0), Some(other));
        assert_eq!(m.pick("node-1:10250", &[host, other], &|_| 0), None);
        // A draining agent still serves when nothing else is left.
        m.set_draining(other);
        assert_eq!(m.pick("x:1", &[host], &|_| 0), Some(other));
    }
}
