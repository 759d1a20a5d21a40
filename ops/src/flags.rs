//! Flag syntax shared by both binaries, so ANP manifests parse unchanged:
//! Go booleans (`--x`, `--x=false`), Go durations, and the klog flags.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use clap::Args;

/// Parses a boolean as Go's `strconv.ParseBool` does: how ANP reads its
/// boolean flags and the `default-route` agent identifier.
///
/// # Errors
/// Anything but `1 t T TRUE true True 0 f F FALSE false False`.
pub fn go_bool(text: &str) -> Result<bool, String> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("invalid boolean {text:?} (want true or false)")),
    }
}

/// A path flag's value, taken as written: unlike clap's own parser it
/// accepts an empty one (ANP's flags are strings, and `--x=` is how a
/// manifest leaves one unset).
///
/// # Errors
/// None.
pub fn path(text: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(text))
}

/// A path flag's value when given: an empty one counts as not given
/// (ANP's flags are strings, and `--x=` is how a manifest leaves one unset).
pub fn given_path(path: Option<&PathBuf>) -> Option<PathBuf> {
    path.filter(|p| !p.as_os_str().is_empty()).cloned()
}

/// A Go boolean flag as pflag parses one: `--x` alone is true, `--x=false`
/// (only with `=`) sets it, and the values are [`go_bool`]'s. Used in a
/// derive as `#[arg(long, go_bool = DEFAULT)]` (`Some(bool)` for a flag
/// with a default; `None` for an `Option<bool>` that is absent unless given).
pub trait GoBoolArg {
    /// Makes this argument a Go boolean with `default`.
    #[must_use]
    fn go_bool(self, default: Option<bool>) -> Self;
}

impl GoBoolArg for clap::Arg {
    fn go_bool(self, default: Option<bool>) -> Self {
        let arg = self
            .action(clap::ArgAction::Set)
            .num_args(0..=1)
            .require_equals(true)
            .default_missing_value("true")
            .value_parser(go_bool);
        match default {
            Some(true) => arg.default_value("true"),
            Some(false) => arg.default_value("false"),
            None => arg,
        }
    }
}

/// Parses a Go duration (`1h0m0s`, `100ms`); see [`crate::duration`].
///
/// # Errors
/// See [`crate::duration::parse`].
pub fn go_duration(text: &str) -> Result<Duration, String> {
    crate::duration::parse(text)
}

/// A flag value or combination that cannot work; the message names the flag
/// (print it with [`crate::error::DisplayErrorStack`] for the cause).
#[derive(Debug, thiserror::Error)]
pub enum FlagError {
    /// A flag has a value outside what it allows.
    #[error("invalid value for --{flag}: {reason}")]
    Invalid {
        /// The flag, without dashes.
        flag: &'static str,
        /// Why.
        reason: String,
    },
    /// TLS material named by a flag cannot be used.
    #[error("--{flag}")]
    Tls {
        /// The flag, without dashes.
        flag: &'static str,
        /// Why.
        #[source]
        source: crate::tls::TlsError,
    },
}

impl From<crate::tls::files::StartError> for FlagError {
    fn from(e: crate::tls::files::StartError) -> Self {
        Self::Tls {
            flag: e.flag,
            source: e.source,
        }
    }
}

/// [`FlagError::Invalid`] for `flag`.
pub fn invalid(flag: &'static str, reason: impl Into<String>) -> FlagError {
    FlagError::Invalid {
        flag,
        reason: reason.into(),
    }
}

/// Checks that a file named by `flag` exists and can be read, so that a
/// mistyped path stops start-up instead of the first use.
///
/// # Errors
/// [`FlagError::Invalid`] naming the flag and the path.
pub fn check_readable_file(flag: &'static str, path: &Path) -> Result<(), FlagError> {
    let shown = path.display();
    let unreadable = |e: std::io::Error| invalid(flag, format!("cannot read {shown}: {e}"));
    // The type first: opening a FIFO for reading would wait for a writer.
    if !std::fs::metadata(path).map_err(unreadable)?.is_file() {
        return Err(invalid(flag, format!("{shown} is not a file")));
    }
    std::fs::File::open(path).map_err(unreadable)?;
    Ok(())
}

/// Joins the occurrences of a pflag `StringSlice` flag: each is a
/// comma-separated list (`[]` and `[a,b]` as pflag prints them), and a
/// repeated flag appends, so `--x=a --x=b` equals `--x=a,b`.
pub fn string_slice(occurrences: &[String]) -> Vec<String> {
    occurrences
        .iter()
        .flat_map(|text| {
            let text = text.trim();
            text.strip_prefix('[')
                .and_then(|t| t.strip_suffix(']'))
                .unwrap_or(text)
                .split(',')
        })
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A deprecated flag that was given, for the start-up warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deprecated {
    /// The flag, without dashes.
    pub flag: &'static str,
    /// What it does now, or what to use instead.
    pub note: &'static str,
}

/// Logs, by name, the flags given that have no effect in this build and
/// the deprecated flags given. Both binaries call it before they bind
/// anything, so the warning is there even when start-up fails.
pub fn warn_flags(not_implemented: &[&'static str], deprecated: &[Deprecated], notices: &[Notice]) {
    for Notice { flag, text } in notices {
        tracing::warn!(flag = %format_args!("--{flag}"), "{text}");
    }
    if !not_implemented.is_empty() {
        tracing::warn!(flags = ?not_implemented, "flags accepted but not implemented yet in this build; they have no effect");
    }
    for Deprecated { flag, note } in deprecated {
        tracing::warn!(flag = %format_args!("--{flag}"), note, "deprecated flag given");
    }
}

/// A flag value accepted with a caveat (logged at start-up, where the
/// other flag warnings are).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The flag, without dashes.
    pub flag: &'static str,
    /// What to know about its value.
    pub text: String,
}

/// A listen address from a bind-address flag and a port, as ANP reads them:
/// empty means all interfaces (IPv6 and IPv4), `localhost` the IPv4
/// loopback, else an IP address (brackets allowed).
///
/// # Errors
/// The host is not an IP address (the text suits a flag error).
pub fn bind_addr(host: &str, port: u16) -> Result<SocketAddr, String> {
    let ip = match host {
        "" => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        other => other
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| format!("{other:?} is not an IP address"))?,
    };
    Ok(SocketAddr::new(ip, port))
}

/// Output format of the log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `--flow-control-window`'s default (and v1's fixed window).
pub const DEFAULT_FLOW_WINDOW: usize = 1024 * 1024;
/// `--flow-control-max-chunk`'s default (and v1's fixed chunk).
pub const DEFAULT_FLOW_MAX_CHUNK: usize = 256 * 1024;

/// The per-connection flow-control window this side announces to peers
/// that negotiate credit (both binaries; ours, not ANP's).
#[derive(Debug, Clone, Args)]
pub struct FlowArgs {
    /// Bytes a peer may have in flight per tunneled connection towards
    /// this process (payload plus 64 per packet; 16 KiB to 64 MiB), which
    /// is what one stalled connection can make it buffer. Against peers of
    /// builds before flow control v2, 1 MiB.
    #[arg(long, default_value_t = DEFAULT_FLOW_WINDOW, value_name = "BYTES")]
    pub flow_control_window: usize,
    /// Largest DATA payload a peer may send this process (1 KiB to 1 MiB).
    #[arg(long, default_value_t = DEFAULT_FLOW_MAX_CHUNK, value_name = "BYTES")]
    pub flow_control_max_chunk: usize,
    /// Flow control as this process announces it: v2 announces its window
    /// and honours the peer's; v1 behaves on the wire as builds before
    /// flow control v2 (no window announced, a peer's ignored, 1 MiB
    /// windows of 256 KiB chunks both ways), to change nothing on the wire
    /// until every replica runs v2.
    #[arg(long, value_enum, default_value_t = FlowControlVersion::V2, value_name = "VERSION")]
    pub flow_control_version: FlowControlVersion,
}

impl FlowArgs {
    /// What to know about these flags at start-up: with
    /// `--flow-control-version=v1`, a window or chunk set to anything but
    /// v1's numbers has no effect, nor has the pin with flow control off
    /// (`offered` false).
    pub fn notice(&self, offered: bool) -> Option<Notice> {
        if self.flow_control_version != FlowControlVersion::V1 {
            return None;
        }
        let text = if self.flow_control_window != DEFAULT_FLOW_WINDOW
            || self.flow_control_max_chunk != DEFAULT_FLOW_MAX_CHUNK
        {
            "v1: --flow-control-window and --flow-control-max-chunk have no effect; v1 receives and sends within 1 MiB windows of 256 KiB chunks"
        } else if !offered {
            "v1: no effect with --flow-control=false (nothing is announced)"
        } else {
            return None;
        };
        Some(Notice {
            flag: "flow-control-version",
            text: text.to_owned(),
        })
    }
}

/// `--flow-control-version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FlowControlVersion {
    /// As builds before flow control v2.
    V1,
    /// Windows announced by each side.
    #[default]
    V2,
}

/// The size of the async runtime (both binaries; ours, not ANP's).
#[derive(Debug, Clone, Args)]
pub struct RuntimeArgs {
    /// Threads that run connections: 0 = one per CPU (tokio's default).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub worker_threads: usize,
}

impl RuntimeArgs {
    /// The tokio runtime these flags ask for.
    ///
    /// # Errors
    /// The runtime's threads or I/O driver cannot be created.
    pub fn build(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        if self.worker_threads > 0 {
            builder.worker_threads(self.worker_threads);
        }
        builder.enable_all().build()
    }

    /// Runs a binary's `main` future on the runtime these flags ask for;
    /// failure to start the runtime is named after `binary`.
    pub fn block_on(
        &self,
        binary: &str,
        main: impl std::future::Future<Output = std::process::ExitCode>,
    ) -> std::process::ExitCode {
        raise_open_file_limit();
        match self.build() {
            Ok(runtime) => runtime.block_on(main),
            Err(e) => {
                eprintln!("{binary}: cannot start the async runtime: {e}");
                std::process::ExitCode::FAILURE
            }
        }
    }
}

/// Raises the soft limit on open files to the hard limit, as the Go runtime
/// does for ANP's binaries (since Go 1.19): a server holds a socket per
/// agent and per tunnel, thousands of them, and a container's soft limit
/// may be 1,024. Failure leaves the limit as it was (it is only a ceiling).
fn raise_open_file_limit() {
    if let Err(error) = rlimit::increase_nofile_limit(u64::MAX) {
        eprintln!("cannot raise the open-file limit: {error}");
    }
}

/// The klog flags ANP registers on both binaries, plus `--log-format`.
///
/// `-v`/`--v` picks the level (0–4 info, 5–8 debug, 9+ trace; ANP's default
/// is 4); `RUST_LOG` overrides it. The other klog flags are accepted so that
/// manifests keep working; only those documented here have an effect.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log verbosity as klog's -v: 0-4 info, 5-8 debug, 9+ trace (RUST_LOG overrides).
    #[arg(short = 'v', long = "v", default_value_t = 4, value_name = "LEVEL")]
    pub verbosity: u8,
    /// Log to standard error instead of files (klog; when true, --log-file is ignored).
    #[arg(long, go_bool = Some(true))]
    pub logtostderr: bool,
    /// Also log to standard error when logging to a file (klog).
    #[arg(long, go_bool = Some(false))]
    pub alsologtostderr: bool,
    /// Log file to write to when --logtostderr=false (klog).
    #[arg(long, alias = "log_file", value_name = "PATH")]
    pub log_file: Option<PathBuf>,
    /// Maximum size of the log file in MB before it is started afresh; 0 = unlimited (klog).
    #[arg(
        long,
        alias = "log_file_max_size",
        default_value_t = 1800,
        value_name = "MB"
    )]
    pub log_file_max_size: u64,
    /// Log line format: text or json.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, alias = "log_dir", hide = true)]
    pub log_dir: Option<String>,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, hide = true)]
    pub vmodule: Option<String>,
    /// With --logtostderr=false and --log-file, lines at or above this severity also go to standard error: INFO, WARNING, ERROR or FATAL, or 0-3 (klog; default ERROR).
    #[arg(long, value_name = "SEVERITY")]
    pub stderrthreshold: Option<String>,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, hide = true)]
    pub alsologtostderrthreshold: Option<String>,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, alias = "log_backtrace_at", hide = true)]
    pub log_backtrace_at: Option<String>,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, alias = "add_dir_header", hide = true, go_bool = None)]
    pub add_dir_header: Option<bool>,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, alias = "one_output", hide = true, go_bool = None)]
    pub one_output: Option<bool>,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, alias = "skip_headers", hide = true, go_bool = None)]
    pub skip_headers: Option<bool>,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, alias = "skip_log_headers", hide = true, go_bool = None)]
    pub skip_log_headers: Option<bool>,
    /// Accepted for klog compatibility; no effect.
    #[arg(long, alias = "legacy_stderr_threshold_behavior", hide = true, go_bool = None)]
    pub legacy_stderr_threshold_behavior: Option<bool>,
}

impl LogArgs {
    /// The klog flags given that have no effect here, by name, for the
    /// start-up warning (a flag is never ignored silently).
    pub fn without_effect(&self) -> Vec<&'static str> {
        [
            ("log-dir", self.log_dir.is_some()),
            ("vmodule", self.vmodule.is_some()),
            (
                "alsologtostderrthreshold",
                self.alsologtostderrthreshold.is_some(),
            ),
            ("log-backtrace-at", self.log_backtrace_at.is_some()),
            ("add-dir-header", self.add_dir_header.is_some()),
            ("one-output", self.one_output.is_some()),
            ("skip-headers", self.skip_headers.is_some()),
            ("skip-log-headers", self.skip_log_headers.is_some()),
            (
                "legacy-stderr-threshold-behavior",
                self.legacy_stderr_threshold_behavior.is_some(),
            ),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    #[test]
    fn bind_addresses() {
        assert_eq!(bind_addr("", 1).unwrap().to_string(), "[::]:1");
        assert_eq!(
            bind_addr("localhost", 2).unwrap().to_string(),
            "127.0.0.1:2"
        );
        assert_eq!(bind_addr("[::1]", 3).unwrap().to_string(), "[::1]:3");
        assert_eq!(bind_addr("10.0.0.1", 4).unwrap().to_string(), "10.0.0.1:4");
        assert!(bind_addr("node-1", 5).unwrap_err().contains("node-1"));
    }

    #[test]
    fn go_bools() {
        for t in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(go_bool(t), Ok(true));
        }
        for f in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(go_bool(f), Ok(false));
        }
        assert!(go_bool("yes").is_err());
    }

    #[test]
    fn klog_flags_parse_as_manifests_write_them() {
        let cli = Cli::try_parse_from([
            "x",
            "--logtostderr=false",
            "--log-file=/var/log/konnectivity.log",
            "--log_file_max_size=10",
            "--v=2",
            "--alsologtostderr",
            "--skip-headers=true",
        ])
        .unwrap();
        assert!(!cli.log.logtostderr);
        assert!(cli.log.alsologtostderr);
        assert_eq!(
            cli.log.log_file.as_deref(),
            Some(std::path::Path::new("/var/log/konnectivity.log"))
        );
        assert_eq!(cli.log.log_file_max_size, 10);
        assert_eq!(cli.log.verbosity, 2);

        let cli = Cli::try_parse_from(["x", "-v=5"]).unwrap();
        assert_eq!(cli.log.verbosity, 5);
        let cli = Cli::try_parse_from(["x", "-v", "6"]).unwrap();
        assert_eq!(cli.log.verbosity, 6);
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.log.verbosity, 4);
        assert!(cli.log.logtostderr);
    }

    /// ANP renames the klog flags to dashes; the underscore spellings are
    /// our extension, and no alias repeats its own flag's name.
    #[test]
    fn klog_aliases_are_the_underscore_spellings() {
        use clap::CommandFactory;
        let cmd = Cli::command();
        for arg in cmd.get_arguments() {
            let long = arg.get_long().unwrap_or_default();
            for alias in arg.get_all_aliases().unwrap_or_default() {
                assert_ne!(alias, long, "--{long} has itself as an alias");
                assert_eq!(alias.replace('_', "-"), long, "--{alias}");
            }
        }
        let cli = Cli::try_parse_from(["x", "--log_file=/tmp/a.log", "--log_dir=/tmp"]).unwrap();
        assert_eq!(
            cli.log.log_file.as_deref(),
            Some(std::path::Path::new("/tmp/a.log"))
        );
        assert_eq!(cli.log.without_effect(), ["log-dir"]);
    }

    #[test]
    fn string_slices_append_like_pflag() {
        let slice = |occurrences: &[&str]| {
            string_slice(
                &occurrences
                    .iter()
                    .map(|s| (*s).to_owned())
                    .collect::<Vec<_>>(),
            )
        };
        assert!(slice(&[]).is_empty());
        assert!(slice(&["[]"]).is_empty());
        assert!(slice(&[""]).is_empty());
        assert_eq!(slice(&["x"]), ["x"]);
        assert_eq!(slice(&["[a, b]"]), ["a", "b"]);
        assert_eq!(slice(&["a", "b,c"]), slice(&["a,b,c"]));
        assert_eq!(slice(&["[]", "[a]", "b"]), ["a", "b"]);
    }

    #[test]
    fn readable_files_are_checked_naming_flag_and_path() {
        let dir = std::env::temp_dir().join(format!("tunnel-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("kubeconfig");
        std::fs::write(&file, "apiVersion: v1\n").unwrap();
        assert!(check_readable_file("kubeconfig", &file).is_ok());
        let err = check_readable_file("kubeconfig", Path::new("/nonexistent/kubeconfig"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("invalid value for --kubeconfig: cannot read /nonexistent/kubeconfig"),
            "{err}"
        );
        let err = check_readable_file("kubeconfig", &dir)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--kubeconfig") && err.contains("is not a file"),
            "{err}"
        );
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let err = check_readable_file("kubeconfig", &fifo)
            .unwrap_err()
            .to_string();
        assert!(err.contains("is not a file"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// pflag reads `--logtostderr false` as `--logtostderr` plus a stray
    /// `false`, which ANP ignores (the flag ends up true); clap refuses the
    /// stray word instead, so the mistake cannot pass unnoticed.
    #[test]
    fn a_bool_flag_takes_its_value_only_after_equals() {
        let err = Cli::try_parse_from(["x", "--logtostderr", "false"])
            .err()
            .unwrap();
        assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument);
        assert!(err.to_string().contains("'false'"), "{err}");
        assert!(
            !Cli::try_parse_from(["x", "--logtostderr=false"])
                .unwrap()
                .log
                .logtostderr
        );
    }

    #[test]
    fn bad_klog_values_name_the_flag() {
        let err = Cli::try_parse_from(["x", "--logtostderr=maybe"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--logtostderr"), "{err}");
        let err = Cli::try_parse_from(["x", "--v=loud"])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("--v"), "{err}");
    }
}
