//! One measurement of a deployment with both clients, as the scenarios
//! that compare deployments side by side take it (`policy`, `overhead`):
//! single-use tunnels (dial, 1 KiB each way, close) at a concurrency, with
//! our client and then with grpc-go.

use std::time::Duration;

use crate::{
    backends::Backends,
    grpc_go::GoFrontend,
    scenarios::{self, Target},
};

/// One client's single-use tunnels through a deployment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientRun {
    /// CPU per tunnel, (server, agent), µs.
    pub cpu_us: Option<(f64, f64)>,
    /// Failed dials.
    pub errors: u64,
    /// Tunnels made.
    pub tunnels: f64,
}

/// Single-use tunnels through `target` for `duration` at `concurrency`:
/// our client's run, then grpc-go's (empty without `go`).
///
/// # Errors
/// A run fails.
pub async fn both(
    target: &Target,
    backends: &Backends,
    go: Option<&GoFrontend>,
    concurrency: usize,
    duration: Duration,
) -> anyhow::Result<[ClientRun; 2]> {
    let seconds = duration.as_secs_f64();
    let ours = scenarios::dial_rate(target, backends, concurrency, duration).await?;
    let ours = ClientRun {
        cpu_us: ours.cpu_us,
        errors: ours.errors,
        tunnels: ours.rate * seconds,
    };
    let theirs = match go {
        Some(go) => {
            let d = go
                .dials(target, backends, concurrency, duration, false)
                .await?;
            ClientRun {
                cpu_us: d.cpu_us,
                errors: d.errors,
                tunnels: d.rate * seconds,
            }
        }
        None => ClientRun::default(),
    };
    Ok([ours, theirs])
}
