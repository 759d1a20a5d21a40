//! SIGINT/SIGTERM as futures.

use tokio::signal::unix::{SignalKind, signal};

/// Resolves on the first SIGINT or SIGTERM.
///
/// # Panics
/// If the signal handlers cannot be installed (only at start-up, before any
/// work is accepted).
pub async fn shutdown() {
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!(signal = "SIGTERM", "shutting down"),
        _ = int.recv() => tracing::info!(signal = "SIGINT", "shutting down"),
    }
}
