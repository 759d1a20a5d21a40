//! bench binary: parse flags, run the scenarios, exit non-zero on failure.

use clap::Parser;

#[tokio::main(worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let opt = bench::Opt::parse();
    let result = if opt.hold_backend {
        bench::backends::hold_backend_main().await
    } else {
        bench::run(opt).await.map(drop)
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
