//! proxy-agent binary: parse flags, set up logging, bind, serve until a signal.

use anyhow::Context;
use clap::{CommandFactory, Parser, error::ErrorKind};
use proxy_agent::{
    agent::Agent,
    config::{Args, Config},
};
use tracing::error;

/// jemalloc, configured in `.cargo/config.toml` to give freed memory back
/// to the system within a second (glibc keeps what bursts of connections
/// leave behind).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    args.runtime.clone().block_on("proxy-agent", serve(args))
}

async fn serve(args: Args) -> std::process::ExitCode {
    if let Err(e) = ops::telemetry::init(&args.log) {
        Args::command().error(ErrorKind::ValueValidation, e).exit();
    }
    // The flags, then the files they name: either failing is a usage
    // error (exit 2) before anything is bound.
    let config = match Config::try_from(args).and_then(|config| {
        config.tls.load()?;
        Ok(config)
    }) {
        Ok(config) => config,
        Err(e) => Args::command()
            .error(
                ErrorKind::ValueValidation,
                ops::error::DisplayErrorStack(&e),
            )
            .exit(),
    };
    match run(config).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            error!(error = format!("{e:#}"), "proxy-agent failed");
            eprintln!("proxy-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let bound = Agent::bind(config).await.context("binding listeners")?;
    // First SIGTERM/SIGINT drains, the second stops at once (as ANP).
    let (first, second) = ops::signal::twice();
    bound.serve_with_drain(first, second).await;
    Ok(())
}
