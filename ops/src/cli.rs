//! The start and the end of both binaries' `main`: flags and files
//! checked before anything is bound (a usage error, exit 2, in clap's
//! format), and the outcome as an exit code.

use std::{fmt, process::ExitCode};

use clap::{CommandFactory, error::ErrorKind};

use crate::{error::DisplayErrorStack, flags::LogArgs};

/// Sets up logging from `log`, then makes the configuration with `config`
/// (the flags validated and the files they name read); either failing
/// exits with a usage error of `A`'s command, before anything is bound.
pub fn start<A, C, E>(log: &LogArgs, config: impl FnOnce() -> Result<C, E>) -> C
where
    A: CommandFactory,
    E: std::error::Error + 'static,
{
    if let Err(e) = crate::telemetry::init(log) {
        A::command().error(ErrorKind::ValueValidation, e).exit();
    }
    match config() {
        Ok(config) => config,
        Err(e) => A::command()
            .error(ErrorKind::ValueValidation, DisplayErrorStack(&e))
            .exit(),
    }
}

/// The exit code of `binary`'s run: a failure is logged and printed with
/// its causes (`{:#}`).
pub fn finish<E: fmt::Display>(binary: &str, result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "{binary} failed");
            eprintln!("{binary}: {e:#}");
            ExitCode::FAILURE
        }
    }
}
