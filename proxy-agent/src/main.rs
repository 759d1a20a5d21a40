//! proxy-agent binary: parse flags, set up logging, bind, serve until a signal.

use anyhow::Context;
use clap::Parser;
use proxy_agent::{
    agent::Agent,
    config::{Args, Config},
};

/// jemalloc, configured in `.cargo/config.toml` to give freed memory back
/// to the system within a second (glibc keeps what bursts of connections
/// leave behind).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    #[cfg(feature = "jemalloc")]
    ops::metrics::jemalloc::expose();
    let args = Args::parse();
    args.runtime.clone().block_on("proxy-agent", serve(args))
}

async fn serve(args: Args) -> std::process::ExitCode {
    // The flags, then the files they name: either failing is a usage
    // error (exit 2) before anything is bound.
    let log = args.log.clone();
    let config = ops::cli::start::<Args, _, _>(&log, || {
        let config = Config::try_from(args)?;
        config.tls.load()?;
        Ok::<_, proxy_agent::config::ConfigError>(config)
    });
    ops::cli::finish("proxy-agent", run(config).await)
}

async fn run(mut config: Config) -> anyhow::Result<()> {
    if let Some(tracing) = &config.tracing_config {
        config.tracing =
            ops::otel::Tracing::start(tracing, "konnectivity-agent", Default::default())
                .map_err(|e| anyhow::anyhow!("--tracing-config-file: {e}"))?;
    }
    let tracing = config.tracing.clone();
    let bound = Agent::bind(config).await.context("binding listeners")?;
    // First SIGTERM/SIGINT drains, the second stops at once (as ANP).
    let (first, second) = ops::signal::twice();
    bound.serve_with_drain(first, second).await;
    // Off the runtime: the flush blocks until the exporter is done.
    let _ = tokio::task::spawn_blocking(move || tracing.shutdown()).await;
    Ok(())
}
