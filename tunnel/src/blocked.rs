//! [`when_blocked`]: notices when a wait on the data path really waits.

/// Runs `fut`; if it cannot finish at once (a full buffer or queue ahead),
/// `on_block` makes a guard that lives until it does — for counting
/// blocked readers and the time they wait, at no cost when nothing blocks.
pub async fn when_blocked<F: std::future::Future, G>(
    fut: F,
    on_block: impl FnOnce() -> G,
) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    if let std::task::Poll::Ready(out) = futures_util::poll!(fut.as_mut()) {
        return out;
    }
    let _guard = on_block();
    fut.await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn blocking_is_noticed_only_when_it_happens() {
        let blocked = AtomicUsize::new(0);
        let note = || {
            blocked.fetch_add(1, Ordering::Relaxed);
        };
        assert_eq!(when_blocked(async { 1 }, note).await, 1);
        assert_eq!(blocked.load(Ordering::Relaxed), 0);
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move { tx.send(2) });
        assert_eq!(when_blocked(async { rx.await.unwrap() }, note).await, 2);
        assert_eq!(blocked.load(Ordering::Relaxed), 1);
    }
}
