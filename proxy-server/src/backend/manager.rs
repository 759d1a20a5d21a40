//! [`BackendManager`]: the connected backends, indexed once per strategy.

use std::{
    net::IpAddr,
    sync::{Arc, Mutex},
};

use ipnet::IpNet;

use super::{
    Backend,
    strategy::{ProxyStrategy, host_of},
};
use crate::lock;

/// Backends under one strategy: key → streams, both in insertion order.
#[derive(Default)]
struct Store {
    /// `(key, backends)`; the first backend of a key is preferred.
    entries: Vec<(String, Vec<Arc<Backend>>)>,
    /// `cidr` identifiers (destHost only), same shape.
    nets: Vec<(IpNet, Vec<Arc<Backend>>)>,
}

/// Appends `backend` under `key`, keeping keys and backends in insertion order.
fn add_to<K: PartialEq>(list: &mut Vec<(K, Vec<Arc<Backend>>)>, key: K, backend: &Arc<Backend>) {
    match list.iter_mut().find(|(k, _)| *k == key) {
        Some((_, backends)) => backends.push(backend.clone()),
        None => list.push((key, vec![backend.clone()])),
    }
}

fn remove_from<K>(list: &mut Vec<(K, Vec<Arc<Backend>>)>, uid: u64) {
    for (_, backends) in list.iter_mut() {
        backends.retain(|b| b.uid != uid);
    }
    list.retain(|(_, backends)| !backends.is_empty());
}

impl Store {
    fn add(&mut self, key: &str, backend: &Arc<Backend>) {
        add_to(&mut self.entries, key.to_owned(), backend);
    }

    fn add_net(&mut self, net: IpNet, backend: &Arc<Backend>) {
        add_to(&mut self.nets, net, backend);
    }

    fn remove(&mut self, uid: u64) {
        remove_from(&mut self.entries, uid);
        remove_from(&mut self.nets, uid);
    }

    /// Distinct keys (hosts and networks).
    fn len(&self) -> usize {
        self.entries.len() + self.nets.len()
    }

    /// destHost: the exact host key (ANP), else — for an IP destination —
    /// the networks containing it, longest prefix first.
    fn pick_dest(&self, address: &str) -> Option<Arc<Backend>> {
        let host = host_of(address);
        let exact = self.pick(self.entries.iter().filter(|(k, _)| k == host));
        if exact.is_some() {
            return exact;
        }
        let ip = host.parse::<IpAddr>().ok()?;
        let mut nets: Vec<_> = self.nets.iter().filter(|(n, _)| n.contains(&ip)).collect();
        // Stable: equal prefixes keep insertion order.
        nets.sort_by_key(|(n, _)| std::cmp::Reverse(n.prefix_len()));
        Self::pick_from(nets.into_iter().map(|(_, backends)| backends))
    }

    /// First non-draining backend among the keys' lists (in order), else
    /// the first draining one.
    fn pick<'a, K: 'a>(
        &self,
        keys: impl Iterator<Item = &'a (K, Vec<Arc<Backend>>)>,
    ) -> Option<Arc<Backend>> {
        let lists = keys.map(|(_, list)| list);
        Self::pick_from(lists)
    }

    fn pick_from<'a>(lists: impl Iterator<Item = &'a Vec<Arc<Backend>>>) -> Option<Arc<Backend>> {
        let mut fallback = None;
        for list in lists {
            for backend in list {
                if !backend.is_draining() {
                    return Some(backend.clone());
                }
                fallback.get_or_insert_with(|| backend.clone());
            }
        }
        fallback
    }

    /// Starts at a random key and walks all keys in order (ANP's default).
    fn pick_random(&self) -> Option<Arc<Backend>> {
        if self.entries.is_empty() {
            return None;
        }
        let start = fastrand::usize(..self.entries.len());
        let (tail, head) = self.entries.split_at(start);
        self.pick(head.iter().chain(tail))
    }
}

/// Every connected backend, indexed for each configured strategy.
pub struct BackendManager {
    /// One store per `--proxy-strategies` entry, in order.
    stores: Vec<(ProxyStrategy, Mutex<Store>)>,
}

impl BackendManager {
    /// An empty manager for `strategies` (tried in this order).
    pub fn new(strategies: &[ProxyStrategy]) -> Self {
        Self {
            stores: strategies
                .iter()
                .map(|s| (*s, Mutex::new(Store::default())))
                .collect(),
        }
    }

    pub(crate) fn add(&self, backend: &Arc<Backend>) {
        for (strategy, store) in &self.stores {
            let mut store = lock(store);
            match strategy {
                ProxyStrategy::Default => store.add(&backend.agent_id.0, backend),
                ProxyStrategy::DestHost => {
                    for key in backend.identifiers.dest_host_keys() {
                        store.add(key, backend);
                    }
                    for net in &backend.identifiers.cidrs {
                        store.add_net(*net, backend);
                    }
                }
                ProxyStrategy::DefaultRoute => {
                    if backend.identifiers.default_route {
                        store.add(&backend.agent_id.0, backend);
                    }
                }
            }
        }
    }

    pub(crate) fn remove(&self, backend: &Backend) {
        for (_, store) in &self.stores {
            lock(store).remove(backend.uid);
        }
    }

    /// The backend for a dial to `address`: the strategies in order, the first
    /// that has one wins.
    pub(crate) fn pick(&self, address: &str) -> Option<Arc<Backend>> {
        self.stores.iter().find_map(|(strategy, store)| {
            let store = lock(store);
            match strategy {
                ProxyStrategy::Default | ProxyStrategy::DefaultRoute => store.pick_random(),
                ProxyStrategy::DestHost => store.pick_dest(address),
            }
        })
    }

    /// Ready when the first strategy has at least one backend (ANP).
    pub fn is_ready(&self) -> bool {
        self.stores
            .first()
            .is_some_and(|(_, store)| lock(store).len() > 0)
    }

    /// Distinct keys per strategy (ANP's `ready_backends` gauge).
    pub fn ready_backends(&self) -> Vec<(ProxyStrategy, usize)> {
        self.stores
            .iter()
            .map(|(s, store)| (*s, lock(store).len()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use tokio_util::sync::CancellationToken;
    use tunnel::ids::AgentId;

    use super::*;
    use crate::backend::strategy::AgentIdentifiers;

    fn backend(uid: u64, agent: &str, ids: &str) -> Arc<Backend> {
        let (tx, _rx) = tunnel::queue::queue(1, 0);
        Arc::new(Backend::new(
            uid,
            AgentId(agent.to_owned()),
            AgentIdentifiers::parse(ids),
            None,
            crate::backend::BackendStream {
                tx,
                end: crate::stream_end::StreamEnd::new(CancellationToken::new()),
                flow_control: false,
                metrics: Arc::new(crate::metrics::ServerMetrics::new(&[])),
            },
        ))
    }

    #[test]
    fn default_prefers_non_draining_and_falls_back() {
        let m = BackendManager::new(&[ProxyStrategy::Default]);
        assert!(m.pick("x:1").is_none());
        assert!(!m.is_ready());
        let a = backend(1, "a", "");
        let b = backend(2, "b", "");
        m.add(&a);
        m.add(&b);
        assert!(m.is_ready());
        a.set_draining();
        for _ in 0..20 {
            assert_eq!(m.pick("x:1").unwrap().uid, 2);
        }
        b.set_draining();
        assert!(
            m.pick("x:1").is_some(),
            "draining backends are the fallback"
        );
        m.remove(&a);
        m.remove(&b);
        assert!(m.pick("x:1").is_none());
        assert!(!m.is_ready());
    }

    #[test]
    fn two_streams_of_one_agent_share_a_key() {
        let m = BackendManager::new(&[ProxyStrategy::Default]);
        let first = backend(1, "a", "");
        let second = backend(2, "a", "");
        m.add(&first);
        m.add(&second);
        assert_eq!(m.ready_backends(), vec![(ProxyStrategy::Default, 1)]);
        assert_eq!(m.pick("x:1").unwrap().uid, 1);
        m.remove(&first);
        assert_eq!(m.pick("x:1").unwrap().uid, 2);
    }

    #[test]
    fn strategies_are_tried_in_order() {
        let m = BackendManager::new(&[ProxyStrategy::DestHost, ProxyStrategy::DefaultRoute]);
        let node = backend(1, "node", "host=node-1&ipv4=10.0.0.1");
        let gateway = backend(2, "gw", "default-route=true");
        m.add(&node);
        m.add(&gateway);
        assert_eq!(m.pick("node-1:10250").unwrap().uid, 1);
        assert_eq!(m.pick("10.0.0.1:22").unwrap().uid, 1);
        assert_eq!(m.pick("elsewhere:80").unwrap().uid, 2);
        m.remove(&gateway);
        assert!(m.pick("elsewhere:80").is_none());
        assert!(m.is_ready(), "readiness follows the first strategy");
    }

    #[test]
    fn cidrs_route_ip_destinations_longest_prefix_first() {
        let m = BackendManager::new(&[ProxyStrategy::DestHost, ProxyStrategy::Default]);
        let wide = backend(1, "wide", "cidr=10.0.0.0/8");
        let narrow = backend(2, "narrow", "cidr=10.1.0.0/16&cidr=fd00::/64");
        let exact = backend(3, "exact", "ipv4=10.1.2.3");
        m.add(&wide);
        m.add(&narrow);
        m.add(&exact);
        assert_eq!(m.ready_backends()[0], (ProxyStrategy::DestHost, 4));
        assert_eq!(m.pick("10.1.2.3:80").unwrap().uid, 3, "exact host first");
        assert_eq!(m.pick("10.1.9.9:80").unwrap().uid, 2, "longest prefix");
        assert_eq!(m.pick("10.200.0.1:80").unwrap().uid, 1);
        assert_eq!(m.pick("[fd00::5]:443").unwrap().uid, 2);
        narrow.set_draining();
        assert_eq!(
            m.pick("10.1.9.9:80").unwrap().uid,
            1,
            "a draining match yields to a wider live one"
        );
        m.remove(&narrow);
        assert_eq!(m.pick("10.1.9.9:80").unwrap().uid, 1);
        // Names never match a network; they fall through to `default`.
        let other = m.pick("node-1:10250").unwrap().uid;
        assert!([1, 3].contains(&other));
    }
}
