//! [`BackendManager`]: the connected backends, indexed once per strategy.

use std::sync::{Arc, Mutex};

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
}

impl Store {
    fn add(&mut self, key: &str, backend: &Arc<Backend>) {
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some((_, list)) => list.push(backend.clone()),
            None => self.entries.push((key.to_owned(), vec![backend.clone()])),
        }
    }

    fn remove(&mut self, uid: u64) {
        for (_, list) in &mut self.entries {
            list.retain(|b| b.uid != uid);
        }
        self.entries.retain(|(_, list)| !list.is_empty());
    }

    /// First non-draining backend among `candidates` (keys in order), else
    /// the first draining one.
    fn pick<'a>(
        &'a self,
        keys: impl Iterator<Item = &'a (String, Vec<Arc<Backend>>)>,
    ) -> Option<Arc<Backend>> {
        let mut fallback = None;
        for (_, list) in keys {
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
                ProxyStrategy::DestHost => {
                    let host = host_of(address);
                    store.pick(store.entries.iter().filter(|(k, _)| k == host))
                }
            }
        })
    }

    /// Ready when the first strategy has at least one backend (ANP).
    pub fn is_ready(&self) -> bool {
        self.stores
            .first()
            .is_some_and(|(_, store)| !lock(store).entries.is_empty())
    }

    /// Distinct keys per strategy (ANP's `ready_backends` gauge).
    pub fn ready_backends(&self) -> Vec<(ProxyStrategy, usize)> {
        self.stores
            .iter()
            .map(|(s, store)| (*s, lock(store).entries.len()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;
    use tokio_util::sync::CancellationToken;
    use tunnel::ids::AgentId;

    use super::*;
    use crate::backend::strategy::AgentIdentifiers;

    fn backend(uid: u64, agent: &str, ids: &str) -> Arc<Backend> {
        let (tx, _rx) = mpsc::channel(1);
        Arc::new(Backend::new(
            uid,
            AgentId(agent.to_owned()),
            AgentIdentifiers::parse(ids),
            None,
            tx,
            CancellationToken::new(),
            false,
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
}
