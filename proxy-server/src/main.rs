//! proxy-server binary: parse flags, set up logging, bind, serve until a signal.

use anyhow::Context;
use clap::{CommandFactory, Parser, error::ErrorKind};
use proxy_server::{
    config::{Args, Config},
    server::ProxyServer,
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
    args.runtime.clone().block_on("proxy-server", serve(args))
}

async fn serve(args: Args) -> std::process::ExitCode {
    if let Err(e) = ops::telemetry::init(&args.log) {
        Args::command().error(ErrorKind::ValueValidation, e).exit();
    }
    // The flags, then the files they name: either failing is a usage
    // error (exit 2) before anything is bound.
    let config = match Config::try_from(args).and_then(|config| {
        config.load_tls()?;
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
            error!(error = format!("{e:#}"), "proxy-server failed");
            eprintln!("proxy-server: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let bound = ProxyServer::bind(config)
        .await
        .context("binding listeners")?;
    bound
        .serve(ops::signal::shutdown())
        .await
        .context("serving")
}
