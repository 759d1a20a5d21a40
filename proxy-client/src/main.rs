//! proxy-client binary: parse flags, then run one of the tool's commands.

use anyhow::Context;
use clap::{CommandFactory, Parser, error::ErrorKind};
use proxy_client::{self as tool, Args, Command};
use tokio::net::TcpListener;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber_filter(args.verbosity);
    ops::telemetry::init_simple(&filter);
    let dialer = match args.frontend.dialer() {
        Ok(dialer) => dialer,
        Err(e) => Args::command()
            .error(
                ErrorKind::ValueValidation,
                ops::error::DisplayErrorStack(&e),
            )
            .exit(),
    };
    let result: anyhow::Result<bool> = match args.command {
        Command::Request {
            url,
            method,
            request_ca_cert,
        } => {
            let status = tool::request(
                &dialer,
                &url,
                &method,
                &request_ca_cert,
                &mut tokio::io::stdout(),
            )
            .await
            .with_context(|| format!("{method} {url}"));
            status.map(|s| s.is_success())
        }
        Command::Socks5 {
            listen,
            username,
            password,
        } => {
            let credentials = match (username, password) {
                (Some(u), Some(p)) => Some((u, p)),
                (None, None) => None,
                _ => Args::command()
                    .error(
                        ErrorKind::ArgumentConflict,
                        "--username and --password go together",
                    )
                    .exit(),
            };
            let listener = TcpListener::bind(listen)
                .await
                .with_context(|| format!("listening on {listen}"));
            match listener {
                Ok(l) => serve_until_signal(tool::serve_socks5(l, dialer, credentials)).await,
                Err(e) => Err(e),
            }
        }
        Command::HttpProxy { listen } => match TcpListener::bind(listen)
            .await
            .with_context(|| format!("listening on {listen}"))
        {
            Ok(l) => serve_until_signal(tool::serve_http_proxy(l, dialer)).await,
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("proxy-client: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

async fn serve_until_signal(serve: impl std::future::Future<Output = ()>) -> anyhow::Result<bool> {
    tokio::select! {
        () = serve => {}
        () = ops::signal::shutdown() => {}
    }
    Ok(true)
}

fn tracing_subscriber_filter(verbosity: u8) -> String {
    ops::telemetry::level_for_verbosity(verbosity).to_owned()
}
