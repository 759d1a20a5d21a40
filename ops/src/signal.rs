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

/// Two futures: the first resolves on the first SIGINT/SIGTERM, the second
/// on the one after it.
///
/// # Panics
/// If the signal handlers cannot be installed (only at start-up).
pub fn twice() -> (
    impl std::future::Future<Output = ()>,
    impl std::future::Future<Output = ()>,
) {
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let (second_tx, second_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        shutdown().await;
        let _ = first_tx.send(());
        shutdown().await;
        let _ = second_tx.send(());
    });
    (
        async move {
            let _ = first_rx.await;
        },
        async move {
            let _ = second_rx.await;
        },
    )
}
