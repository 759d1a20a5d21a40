//! The data plane of `proxy-server` and `proxy-agent`: what moves a
//! connection's bytes and bounds them. No flags, no telemetry, no kube, no
//! metrics exposition (those are `ops`'s), no socket, listener or TLS
//! (those are `edge`'s).
//!
//! # Layout
//! - [`ids`]: newtypes for connection, dial, agent and server ids.
//! - [`flow`]: per-connection windows, credit and bounded receive queues.
//! - [`queue`]: byte-bounded outbound queues of shared streams; waiting
//!   senders get room in order of arrival.
//! - [`budget`]: a process-wide byte budget over every stream, on the
//!   same accounting.
//! - [`sync`]: the primitives under the queues and flow waits (std's, or
//!   loom's with the `loom` feature), and the audit of which streams take
//!   which lock.
//! - [`mover`]: one connection's bytes between its socket and its DATA
//!   packets, both ways.
//! - [`compact`]: id-keyed tables give their memory back after a burst.

/// The test build counts each thread's heap, so that tests can bound what
/// an idle queue holds.
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: heap_count::Counting<std::alloc::System> =
    heap_count::Counting::new(std::alloc::System);

pub mod blocked;
pub mod budget;
pub mod flow;
pub mod ids;
pub mod mover;
pub mod queue;
pub mod sync;

#[cfg(all(test, feature = "loom"))]
mod loom_tests;

/// Gives a table's memory back once it is mostly empty: a burst of 10,000
/// tunnels must not leave tables that size behind for good. Amortised
/// O(1): a table shrinks to twice its entries, so it must lose half of
/// them again before the next shrink. Used by the server's router, its
/// control core and its drivers' tables, and the agent's stream table.
pub fn compact<K: Eq + std::hash::Hash, V>(map: &mut std::collections::HashMap<K, V>) {
    if map.capacity() > 64 && map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}
