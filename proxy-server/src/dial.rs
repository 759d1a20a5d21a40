//! [`PendingDials`]: dials forwarded to an agent and not yet answered, keyed
//! by the frontend-chosen dial id (global, as in ANP, shared by all frontends).

use std::{collections::HashMap, sync::Arc, sync::Mutex, time::Instant};

use tunnel::ids::DialId;

use crate::{backend::Backend, frontend::Frontend, lock};

/// A dial in flight.
pub(crate) struct PendingDial {
    /// Who asked.
    pub(crate) frontend: Arc<Frontend>,
    /// Which agent stream it went to.
    pub(crate) backend: Arc<Backend>,
    /// When it was received, for the dial latency.
    pub(crate) started: Instant,
}

/// The pending-dial table.
#[derive(Default)]
pub(crate) struct PendingDials {
    /// Dial id → dial.
    map: Mutex<HashMap<DialId, PendingDial>>,
}

impl PendingDials {
    /// Adds a dial; `false` if the id is already pending (nothing changes).
    pub(crate) fn insert(&self, id: DialId, dial: PendingDial) -> bool {
        let mut map = lock(&self.map);
        if map.contains_key(&id) {
            return false;
        }
        map.insert(id, dial);
        true
    }

    /// Removes the dial if `belongs` says it is the caller's to remove.
    pub(crate) fn remove_if(
        &self,
        id: DialId,
        belongs: impl FnOnce(&PendingDial) -> bool,
    ) -> Option<PendingDial> {
        let mut map = lock(&self.map);
        if map.get(&id).is_some_and(belongs) {
            map.remove(&id)
        } else {
            None
        }
    }

    /// Removes every dial that went to the backend `uid`.
    pub(crate) fn remove_for_backend(&self, uid: u64) -> Vec<(DialId, PendingDial)> {
        let mut map = lock(&self.map);
        let ids: Vec<DialId> = map
            .iter()
            .filter(|(_, d)| d.backend.uid == uid)
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| map.remove(&id).map(|d| (id, d)))
            .collect()
    }

    /// Number of pending dials.
    pub(crate) fn len(&self) -> usize {
        lock(&self.map).len()
    }
}
