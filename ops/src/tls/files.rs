//! TLS material that follows its files: [`TlsFiles`] hands each new
//! handshake the configuration built from the files as they are now, and
//! keeps the last good one when they cannot be used.
//!
//! Each call to [`TlsFiles::current`] reads the files (following symlinks,
//! as a Kubernetes Secret volume's `..data` swap needs) and compares them
//! with what it saw last. Only when they changed is the configuration
//! built again. A reload that fails (a file missing, half written,
//! a key that does not match its certificate) logs one error naming the
//! flag and the file, is counted, and leaves the last good configuration in
//! use; the next change of the files is tried again. Established
//! connections never see any of it: a configuration only serves handshakes.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{family::Family, gauge::Gauge},
};
use rustls_pki_types::CertificateDer;
use tracing::{error, info};

use super::{TlsError, load_certs};
use crate::metrics::{Counter, Metrics};

/// One file a TLS configuration is built from.
#[derive(Debug, Clone)]
pub struct TlsFile {
    /// The flag that names the file (`cluster-cert`, `ca-cert`, …); also the
    /// `certificate` label of its metrics.
    pub flag: &'static str,
    /// The path.
    pub path: PathBuf,
    /// Whether the file holds certificates whose expiry is exported (a
    /// certificate chain or a CA bundle; not a key).
    pub certificates: bool,
    /// The flag whose metrics count this file's failures: the certificate
    /// for its key, itself otherwise.
    pub counted_as: &'static str,
}

impl TlsFile {
    /// A certificate chain or CA bundle named by `flag`.
    pub fn certs(flag: &'static str, path: PathBuf) -> Self {
        Self {
            flag,
            path,
            certificates: true,
            counted_as: flag,
        }
    }

    /// The private key named by `flag`, of the certificate named by `cert_flag`.
    pub fn key(flag: &'static str, path: PathBuf, cert_flag: &'static str) -> Self {
        Self {
            flag,
            path,
            certificates: false,
            counted_as: cert_flag,
        }
    }
}

/// A file and the flag that names it.
pub type Named = (&'static str, PathBuf);

/// The files of one TLS side, each named by its flag: a certificate chain
/// and its key (a server's; a client's for mTLS) and the CA bundle the
/// peer's certificate must chain to. Both binaries read them the same way:
/// once ([`CertFiles::load`]) or following them ([`CertFiles::follow`]);
/// what configuration they make (server or client, ALPN, policy) is the
/// binary's `build`.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The certificate chain and its private key.
    pub identity: Option<(Named, Named)>,
    /// The CA bundle peers must chain to.
    pub ca: Option<Named>,
    /// A secret file read with them (`--tls-session-ticket-key`), so that a
    /// change of it is followed too.
    pub secret: Option<Named>,
}

impl CertFiles {
    /// The files, certificate chain first.
    fn files(&self) -> Vec<TlsFile> {
        let mut files = Vec::new();
        if let Some(((cert_flag, cert), (key_flag, key))) = &self.identity {
            files.push(TlsFile::certs(cert_flag, cert.clone()));
            files.push(TlsFile::key(key_flag, key.clone(), cert_flag));
        }
        if let Some((flag, ca)) = &self.ca {
            files.push(TlsFile::certs(flag, ca.clone()));
        }
        if let Some((flag, secret)) = &self.secret {
            files.push(TlsFile {
                flag,
                path: secret.clone(),
                certificates: false,
                counted_as: flag,
            });
        }
        files
    }

    /// Reads the files once into the configuration `build` makes of them.
    ///
    /// # Errors
    /// A file cannot be read or parsed, or the key does not match the
    /// certificate; the error names the flag of the file.
    pub fn load<C>(
        &self,
        build: impl Fn() -> Result<Arc<C>, TlsError>,
    ) -> Result<Arc<C>, StartError> {
        load_once(&self.files(), build)
    }

    /// The configuration that follows the files (see [`TlsFiles`]); `what`
    /// names its user in logs, `metrics` shows the certificates' expiry
    /// and counts failed reloads.
    ///
    /// # Errors
    /// As [`load`](Self::load): at start-up there is nothing to keep.
    pub fn follow<C>(
        &self,
        what: &'static str,
        metrics: CertMetrics,
        build: impl Fn() -> Result<Arc<C>, TlsError> + Send + Sync + 'static,
    ) -> Result<TlsFiles<C>, StartError> {
        TlsFiles::load(what, self.files(), metrics, build)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CertLabels {
    certificate: &'static str,
    file: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabel {
    certificate: &'static str,
}

/// The certificate metrics of one binary: `<prefix>certificate_expiry_timestamp_seconds`
/// and `<prefix>certificate_reload_failures_total`.
#[derive(Clone, Debug, Default)]
pub struct CertMetrics {
    expiry: Family<CertLabels, Gauge>,
    failures: Family<FailureLabel, Counter>,
}

impl CertMetrics {
    /// Adds both families to `metrics` under `prefix`
    /// (`konnectivity_rs_server_`, …); they may be in use already.
    pub fn register(&self, metrics: &mut Metrics, prefix: &str) {
        metrics.register_family(
            format!("{prefix}certificate_expiry_timestamp_seconds"),
            "When a loaded certificate file stops being valid (the earliest notAfter of its certificates), in seconds since the epoch, by the flag naming the file",
            &["certificate", "file"],
            self.expiry.clone(),
        );
        metrics.register_family(
            format!("{prefix}certificate_reload_failures_total"),
            "Times changed TLS files could not be loaded and the last good ones were kept, by the flag of the certificate",
            &["certificate"],
            self.failures.clone(),
        );
    }

    /// The failures counted for `flag` so far (tests).
    pub fn failures(&self, flag: &'static str) -> f64 {
        self.failures
            .get_or_create(&FailureLabel { certificate: flag })
            .get()
    }

    fn show_expiry(&self, file: &TlsFile, not_after: i64) {
        let _ = self
            .expiry
            .get_or_create(&CertLabels {
                certificate: file.flag,
                file: file.path.display().to_string(),
            })
            .set(not_after);
    }
}

/// A file's bytes; `None` when it cannot be read. Comparing bytes (a few
/// KiB per handshake) catches every change, where metadata can miss a
/// rewrite of the same size within the file system's clock tick.
type Seen = Option<Vec<u8>>;

fn read(path: &Path) -> Seen {
    std::fs::read(path).ok()
}

/// A configuration built by the binary from the files (ALPN, policy, …).
type Build<C> = dyn Fn() -> Result<Arc<C>, TlsError> + Send + Sync;

/// The configuration in use and the files it was last tried with.
struct State<C> {
    /// The files at the last attempt, good or bad.
    seen: Vec<Seen>,
    /// The last configuration built without error.
    current: Arc<C>,
}

struct Inner<C> {
    /// Which listener or client this is, for the logs.
    what: &'static str,
    files: Vec<TlsFile>,
    build: Box<Build<C>>,
    metrics: CertMetrics,
    state: Mutex<State<C>>,
}

/// A TLS configuration (`rustls::ServerConfig` or `ClientConfig`) that
/// follows its files; see the module documentation. Clones share it.
pub struct TlsFiles<C> {
    inner: Arc<Inner<C>>,
}

impl<C> Clone for TlsFiles<C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<C> std::fmt::Debug for TlsFiles<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("what", &self.inner.what)
            .field("files", &self.inner.files)
            .finish_non_exhaustive()
    }
}

/// The files could not be used at start-up: the flag of the file, and why.
#[derive(Debug)]
pub struct StartError {
    /// The flag naming the file the error is about.
    pub flag: &'static str,
    /// Why.
    pub source: TlsError,
}

impl<C> TlsFiles<C> {
    /// Builds the configuration from `files` with `build` (which reads
    /// them), and shows their expiry in `metrics`. `what` names it in logs
    /// (`agent listener`, `frontend listener`, `server connections`).
    ///
    /// # Errors
    /// The files cannot be used now: there is no last good configuration
    /// to keep at start-up.
    pub fn load(
        what: &'static str,
        files: Vec<TlsFile>,
        metrics: CertMetrics,
        build: impl Fn() -> Result<Arc<C>, TlsError> + Send + Sync + 'static,
    ) -> Result<Self, StartError> {
        let seen = files.iter().map(|f| read(&f.path)).collect();
        let current = load_once(&files, &build)?;
        show_expiries(&files, &metrics);
        Ok(Self {
            inner: Arc::new(Inner {
                what,
                files,
                build: Box::new(build),
                metrics,
                state: Mutex::new(State { seen, current }),
            }),
        })
    }

    /// The configuration for a new handshake: built from the files as they
    /// are now, or the last good one if they cannot be used.
    pub fn current(&self) -> Arc<C> {
        let inner = &*self.inner;
        let now: Vec<Seen> = inner.files.iter().map(|f| read(&f.path)).collect();
        // A poisoned lock only means a panic elsewhere while holding it;
        // the state itself is always whole.
        let mut state = inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.seen == now {
            return state.current.clone();
        }
        state.seen = now;
        match (inner.build)() {
            Ok(config) => {
                state.current = config;
                show_expiries(&inner.files, &inner.metrics);
                info!(
                    tls = inner.what,
                    "TLS files changed; new handshakes use them"
                );
            }
            Err(source) => {
                let (flag, counted_as) = flags_of(&inner.files, source.path());
                inner
                    .metrics
                    .failures
                    .get_or_create(&FailureLabel {
                        certificate: counted_as,
                    })
                    .inc();
                error!(
                    tls = inner.what,
                    flag,
                    file = %source.path().display(),
                    error = %crate::error::DisplayErrorStack(&source),
                    "TLS files changed but cannot be used; new handshakes keep the last good ones"
                );
            }
        }
        state.current.clone()
    }

    /// The configuration [`current`](Self::current) last gave, without
    /// looking at the files: what the latest handshake started with.
    pub fn last(&self) -> Arc<C> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .current
            .clone()
    }
}

/// The flag of the file at `path` among `files`, and the flag its failures
/// count as (the first file's when none is at `path`).
fn flags_of(files: &[TlsFile], path: &Path) -> (&'static str, &'static str) {
    files
        .iter()
        .find(|f| f.path == path)
        .or_else(|| files.first())
        .map_or(("", ""), |f| (f.flag, f.counted_as))
}

/// Builds a configuration from `files` once (a check, a client of its
/// own), without following them.
///
/// # Errors
/// The files cannot be used; the error names the flag of the file.
pub fn load_once<C>(
    files: &[TlsFile],
    build: impl Fn() -> Result<Arc<C>, TlsError>,
) -> Result<Arc<C>, StartError> {
    build().map_err(|source| StartError {
        flag: flags_of(files, source.path()).0,
        source,
    })
}

/// Sets the expiry gauge of every certificate file (read again: the build
/// does not hand back what it parsed). A file that changed in between
/// shows what it holds now, which the next handshake will load anyway.
fn show_expiries(files: &[TlsFile], metrics: &CertMetrics) {
    for file in files.iter().filter(|f| f.certificates) {
        if let Some(not_after) = load_certs(&file.path)
            .ok()
            .and_then(|c| earliest_expiry(&c))
        {
            metrics.show_expiry(file, not_after);
        }
    }
}

/// The earliest notAfter of `certs`, in seconds since the epoch; `None` if
/// none parses.
pub fn earliest_expiry(certs: &[CertificateDer<'_>]) -> Option<i64> {
    certs
        .iter()
        .filter_map(|der| x509_parser::parse_x509_certificate(der).ok())
        .map(|(_, cert)| cert.validity().not_after.timestamp())
        .min()
}

/// The subject of `cert` as its distinguished name reads
/// (`CN=kube-apiserver, O=system:masters`); `None` if it does not parse as
/// X.509.
pub fn subject(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    Some(parsed.subject().to_string())
}

/// What a certificate names its peer by: its subject's common name and
/// its subject alternative names (DNS names, IP addresses, URIs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AltNames {
    /// The subject's (first) common name, if it has one as text.
    pub common_name: Option<String>,
    /// DNS names, as written.
    pub dns: Vec<String>,
    /// IP addresses.
    pub ips: Vec<std::net::IpAddr>,
    /// URIs, as written.
    pub uris: Vec<String>,
}

/// The common name and the DNS, IP and URI subject alternative names of
/// `cert` (no names without the extension); `None` if it does not parse
/// as X.509.
pub fn alt_names(cert: &CertificateDer<'_>) -> Option<AltNames> {
    use x509_parser::extensions::GeneralName;

    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    let mut names = AltNames {
        common_name: parsed
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_owned),
        ..AltNames::default()
    };
    let Ok(Some(san)) = parsed.subject_alternative_name() else {
        return Some(names);
    };
    for name in &san.value.general_names {
        match name {
            GeneralName::DNSName(dns) => names.dns.push((*dns).to_owned()),
            GeneralName::URI(uri) => names.uris.push((*uri).to_owned()),
            GeneralName::IPAddress(bytes) => {
                if let Ok(v4) = <[u8; 4]>::try_from(*bytes) {
                    names.ips.push(v4.into());
                } else if let Ok(v6) = <[u8; 16]>::try_from(*bytes) {
                    names.ips.push(v6.into());
                }
            }
            _ => {}
        }
    }
    Some(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dir(PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir() -> Dir {
        let dir = std::env::temp_dir().join(format!("ops-tls-files-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }

    /// Writes a fresh PKI into `dir`.
    fn write_pki(dir: &Path) {
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(dir)
            .unwrap();
    }

    /// The agent listener's files in `dir`, and their reloading config.
    fn listener(dir: &Path, metrics: &CertMetrics) -> TlsFiles<rustls::ServerConfig> {
        let (cert, key, ca) = (
            dir.join("cluster.crt"),
            dir.join("cluster.key"),
            dir.join("agent-ca.crt"),
        );
        let files = vec![
            TlsFile::certs("cluster-cert", cert.clone()),
            TlsFile::key("cluster-key", key.clone(), "cluster-cert"),
            TlsFile::certs("cluster-ca-cert", ca.clone()),
        ];
        TlsFiles::load("agent listener", files, metrics.clone(), move || {
            super::super::server_config(&cert, &key, Some(&ca))
        })
        .unwrap()
    }

    #[test]
    fn unchanged_files_give_the_same_configuration() {
        let d = dir();
        write_pki(&d.0);
        let files = listener(&d.0, &CertMetrics::default());
        assert!(Arc::ptr_eq(&files.current(), &files.current()));
    }

    #[test]
    fn a_rotation_is_used_by_the_next_handshake() {
        let d = dir();
        write_pki(&d.0);
        let metrics = CertMetrics::default();
        let files = listener(&d.0, &metrics);
        let before = files.current();
        write_pki(&d.0);
        assert!(Arc::ptr_eq(&files.last(), &before), "last reads no file");
        let after = files.current();
        assert!(!Arc::ptr_eq(&before, &after));
        assert!(Arc::ptr_eq(&files.last(), &after));
        assert_eq!(metrics.failures("cluster-cert"), 0.0);
    }

    /// A key that does not match its certificate, then a missing CA: the
    /// last good configuration stays, and each bad state is counted once.
    #[test]
    fn bad_files_keep_the_last_good_configuration() {
        let d = dir();
        write_pki(&d.0);
        let metrics = CertMetrics::default();
        let files = listener(&d.0, &metrics);
        let good = files.current();

        let other = dir();
        write_pki(&other.0);
        std::fs::copy(other.0.join("cluster.key"), d.0.join("cluster.key")).unwrap();
        assert!(Arc::ptr_eq(&files.current(), &good));
        assert!(Arc::ptr_eq(&files.current(), &good));
        assert_eq!(metrics.failures("cluster-cert"), 1.0);

        std::fs::remove_file(d.0.join("agent-ca.crt")).unwrap();
        assert!(Arc::ptr_eq(&files.current(), &good));
        assert_eq!(metrics.failures("cluster-ca-cert"), 1.0);

        // Whole again (the other PKI's cert, key and CA): loaded.
        for name in ["cluster.crt", "cluster.key", "agent-ca.crt"] {
            std::fs::copy(other.0.join(name), d.0.join(name)).unwrap();
        }
        assert!(!Arc::ptr_eq(&files.current(), &good));
        assert_eq!(metrics.failures("cluster-cert"), 1.0);
    }

    #[test]
    fn a_half_written_certificate_is_refused_at_start_by_its_flag() {
        let d = dir();
        write_pki(&d.0);
        let cert = std::fs::read(d.0.join("cluster.crt")).unwrap();
        std::fs::write(d.0.join("cluster.crt"), &cert[..cert.len() / 2]).unwrap();
        let (c, k) = (d.0.join("cluster.crt"), d.0.join("cluster.key"));
        let err = TlsFiles::load(
            "agent listener",
            vec![
                TlsFile::certs("cluster-cert", c.clone()),
                TlsFile::key("cluster-key", k.clone(), "cluster-cert"),
            ],
            CertMetrics::default(),
            move || super::super::server_config(&c, &k, None),
        )
        .unwrap_err();
        assert_eq!(err.flag, "cluster-cert");
    }

    /// Each certificate file's expiry is exported under its flag and path;
    /// a bundle shows its earliest certificate's.
    #[test]
    fn expiries_are_exported_by_flag_and_file() {
        let d = dir();
        write_pki(&d.0);
        // A CA bundle of the PKI's CA (valid to 4096) and one that ends
        // on 2030-01-01: the bundle shows 2030-01-01.
        let mut params = rcgen::CertificateParams::new(Vec::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.not_after = rcgen::date_time_ymd(2030, 1, 1);
        let ending = params
            .self_signed(&rcgen::KeyPair::generate().unwrap())
            .unwrap();
        let bundle = std::fs::read_to_string(d.0.join("agent-ca.crt")).unwrap();
        std::fs::write(d.0.join("agent-ca.crt"), bundle + &ending.pem()).unwrap();
        let expiry = |name: &str| earliest_expiry(&load_certs(&d.0.join(name)).unwrap()).unwrap();
        let mut m = Metrics::default();
        let metrics = CertMetrics::default();
        metrics.register(&mut m, "x_");
        let _files = listener(&d.0, &metrics);
        let m = Arc::new(m);
        let text = m.render();
        // The series carry the labels the families were registered with.
        let _ = metrics.failures("cluster-cert");
        assert_eq!(m.mismatches(), Vec::<String>::new());
        // Go's text format writes large values with an exponent.
        let value = |flag: &str, name: &str| -> i64 {
            let series = format!(
                "x_certificate_expiry_timestamp_seconds{{certificate=\"{flag}\",file=\"{}\"}} ",
                d.0.join(name).display()
            );
            let line = text.lines().find_map(|l| l.strip_prefix(&series));
            let seconds: f64 = line
                .unwrap_or_else(|| panic!("{series} in {text}"))
                .parse()
                .unwrap();
            seconds as i64
        };
        assert_eq!(value("cluster-cert", "cluster.crt"), expiry("cluster.crt"));
        assert_eq!(value("cluster-ca-cert", "agent-ca.crt"), 1_893_456_000);
        assert!(!text.contains("cluster-key"), "{text}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(expiry("cluster.crt") > i64::try_from(now).unwrap());
    }

    #[test]
    fn alt_names_are_a_certificates_dns_names_and_addresses() {
        let ca = certs::Ca::new("ca").unwrap();
        let leaf = ca
            .client_cert_naming(
                "node-a",
                &[
                    "node-a".to_owned(),
                    "10.0.0.5".to_owned(),
                    "fd00::5".to_owned(),
                ],
            )
            .unwrap();
        let der = rustls_pki_types::pem::PemObject::from_pem_slice(leaf.cert_pem.as_bytes())
            .map(|c: CertificateDer<'static>| c)
            .unwrap();
        let names = alt_names(&der).unwrap();
        assert_eq!(names.common_name.as_deref(), Some("node-a"));
        assert_eq!(names.dns, ["node-a"]);
        assert_eq!(
            names.ips,
            [
                "10.0.0.5".parse::<std::net::IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        let plain = ca.client_cert("proxy-agent").unwrap();
        let der: CertificateDer<'static> =
            rustls_pki_types::pem::PemObject::from_pem_slice(plain.cert_pem.as_bytes()).unwrap();
        assert_eq!(
            alt_names(&der),
            Some(AltNames {
                common_name: Some("proxy-agent".to_owned()),
                ..AltNames::default()
            }),
            "its common name, no SANs"
        );
        assert_eq!(alt_names(&CertificateDer::from(vec![1, 2, 3])), None);
    }
}
