//! PEM loading and rustls configurations, always with the ring provider.
//!
//! Every error names the file it is about; callers add the flag.
//!
//! # Layout
//! - [`files`]: configurations that follow their files (reload without a
//!   restart, certificate expiry metrics).
//! - [`tickets`]: session tickets every replica and restart can open.

pub mod files;
pub mod tickets;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    crypto::{CryptoProvider, ring},
    server::{WebPkiClientVerifier, danger::ClientCertVerifier},
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

/// ALPN id of HTTP/2, which gRPC peers (grpc-go included) require.
pub const ALPN_H2: &[u8] = b"h2";

/// Failure to build a TLS configuration from files.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate file could not be read or parsed.
    #[error("cannot read certificates from {path}")]
    Certs {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls_pki_types::pem::Error,
    },
    /// A certificate file held no certificate.
    #[error("no certificate found in {path}")]
    NoCerts {
        /// The file.
        path: PathBuf,
    },
    /// A private key file could not be read or parsed.
    #[error("cannot read a private key from {path}")]
    Key {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls_pki_types::pem::Error,
    },
    /// A CA certificate was rejected by the trust store.
    #[error("invalid CA certificate in {path}")]
    Ca {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls::Error,
    },
    /// rustls refused the combination (key does not match cert, …).
    #[error("invalid TLS configuration with {path}")]
    Config {
        /// The certificate file of the configuration.
        path: PathBuf,
        /// Why.
        source: rustls::Error,
    },
    /// The private key is not the certificate's.
    #[error("the private key in {key} does not match the certificate in {cert}")]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
    },
    /// The client-certificate verifier could not be built.
    #[error("cannot verify client certificates with CA {path}")]
    Verifier {
        /// The CA file.
        path: PathBuf,
        /// Why.
        source: rustls::server::VerifierBuilderError,
    },
    /// The session-ticket secret could not be read.
    #[error("cannot read the session-ticket secret {path}")]
    Secret {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The session-ticket secret is too short to derive keys from.
    #[error(
        "the session-ticket secret {path} holds {len} bytes; at least {} are needed",
        tickets::MIN_SECRET_LEN
    )]
    ShortSecret {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: usize,
    },
}

impl TlsError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            Self::Certs { path, .. }
            | Self::NoCerts { path }
            | Self::Key { path, .. }
            | Self::Ca { path, .. }
            | Self::Config { path, .. }
            | Self::Verifier { path, .. }
            | Self::Secret { path, .. }
            | Self::ShortSecret { path, .. } => path,
            Self::KeyMismatch { key, .. } => key,
        }
    }
}

/// The name of the crypto provider [`provider`] returns, as the bench
/// prints it beside its figures.
pub const PROVIDER_NAME: &str = "ring";

/// The ring crypto provider (we never use aws-lc), with AES-128-GCM
/// preferred: as secure for this use and markedly cheaper per byte than
/// AES-256-GCM, which rustls lists first. Every suite stays available.
pub fn provider() -> Arc<CryptoProvider> {
    let mut provider = ring::default_provider();
    provider.cipher_suites.sort_by_key(|suite| {
        !matches!(
            suite.suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
        )
    });
    Arc::new(provider)
}

/// What `--cipher-suites` and `--tls-min-version` allow on the server's
/// listeners. As in Go, the TLS 1.3 suites are never restricted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsPolicy {
    /// TLS 1.2 suites allowed; `None` allows every one.
    pub tls12_suites: Option<Vec<rustls::CipherSuite>>,
    /// Refuse TLS 1.2 (`VersionTLS13`).
    pub tls13_only: bool,
}

/// Go's names of the suites rustls offers (`tls.CipherSuites()` minus the
/// CBC ones, which rustls does not implement), with the legacy ChaCha names.
const SUITE_NAMES: [(&str, rustls::CipherSuite); 11] = {
    use rustls::CipherSuite as S;
    [
        ("TLS_AES_128_GCM_SHA256", S::TLS13_AES_128_GCM_SHA256),
        ("TLS_AES_256_GCM_SHA384", S::TLS13_AES_256_GCM_SHA384),
        (
            "TLS_CHACHA20_POLY1305_SHA256",
            S::TLS13_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
            S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
            S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
            S::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305",
            S::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        ),
        (
            "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
            S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        ),
        (
            "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
            S::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
        (
            "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305",
            S::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ),
    ]
};

/// Secure suites Go accepts that rustls does not implement (ECDHE with
/// AES-CBC-SHA1; rustls has no CBC mode).
const CBC_SUITES: [&str; 4] = [
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA",
];

/// `--cipher-suites`, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CipherSuites {
    /// The suites to allow; `None` (an empty flag) allows every one.
    pub suites: Option<Vec<rustls::CipherSuite>>,
    /// Names Go accepts that this build cannot offer (the ECDHE CBC
    /// suites); they are left out, with a warning.
    pub left_out: Vec<&'static str>,
}

impl CipherSuites {
    /// Whether TLS 1.2 has no suite left although names were given: every
    /// TLS 1.2 name was left out.
    pub fn no_tls12_suite_left(&self) -> bool {
        !self.left_out.is_empty()
            && self.suites.as_ref().is_some_and(|suites| {
                !suites.iter().any(|suite| {
                    provider()
                        .cipher_suites
                        .iter()
                        .any(|s| s.suite() == *suite && s.version() == &rustls::version::TLS12)
                })
            })
    }
}

/// Parses the names of `--cipher-suites` (already split, see
/// `flags::string_slice`): `None` for no names; TLS 1.3 names are
/// accepted and, as in Go, have no effect; Go's ECDHE CBC suites are
/// accepted and left out (rustls has none).
///
/// # Errors
/// An unknown or insecure name, named.
pub fn parse_cipher_suites(names: &[String]) -> Result<CipherSuites, String> {
    if names.is_empty() {
        return Ok(CipherSuites::default());
    }
    let mut suites = Vec::new();
    let mut left_out = Vec::new();
    for name in names {
        if let Some((_, suite)) = SUITE_NAMES.iter().find(|(n, _)| n == name) {
            suites.push(*suite);
        } else if let Some(cbc) = CBC_SUITES.iter().find(|n| *n == name) {
            left_out.push(*cbc);
        } else {
            return Err(format!("{name} is not a known secure cipher suite"));
        }
    }
    Ok(CipherSuites {
        suites: Some(suites),
        left_out,
    })
}

/// Parses `--tls-min-version`: whether only TLS 1.3 is allowed, and a
/// warning for versions below 1.2 (accepted as ANP does, but rustls never
/// speaks them, so 1.2 is the minimum).
///
/// # Errors
/// A value other than "", `VersionTLS10`…`VersionTLS13`.
pub fn parse_min_version(text: &str) -> Result<(bool, Option<&'static str>), String> {
    match text {
        "" | "VersionTLS12" => Ok((false, None)),
        "VersionTLS13" => Ok((true, None)),
        "VersionTLS10" | "VersionTLS11" => Ok((
            false,
            Some(
                "TLS versions below 1.2 are insecure and not supported; the minimum stays TLS 1.2",
            ),
        )),
        other => Err(format!(
            "{other:?} is not VersionTLS10, VersionTLS11, VersionTLS12 or VersionTLS13"
        )),
    }
}

/// [`provider`] restricted by `policy`.
fn provider_for(policy: &TlsPolicy) -> Arc<CryptoProvider> {
    let mut provider = (*provider()).clone();
    if let Some(allowed) = &policy.tls12_suites {
        provider.cipher_suites.retain(|suite| {
            suite.version() == &rustls::version::TLS13 || allowed.contains(&suite.suite())
        });
    }
    Arc::new(provider)
}

/// Reads every certificate of a PEM file (a chain or a CA bundle).
///
/// # Errors
/// [`TlsError::Certs`] or [`TlsError::NoCerts`].
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    parse_certs(path, &read_pem(path)?)
}

/// The bytes of the PEM file `path`.
fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Certs {
        path: path.to_owned(),
        source: rustls_pki_types::pem::Error::Io(source),
    })
}

/// Every certificate of `pem`, the bytes of the file `path`.
fn parse_certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Certs {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCerts {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// Reads the first private key (PKCS#8, PKCS#1 or SEC1) of a PEM file.
///
/// # Errors
/// [`TlsError::Key`].
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TlsError::Key {
        path: path.to_owned(),
        source,
    })
}

/// A trust store with every certificate of a CA bundle.
///
/// # Errors
/// Unreadable file or a certificate the store rejects.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    roots_of(path, &read_pem(path)?)
}

/// A trust store with every certificate of `pem`, the bytes of the CA
/// bundle `path`.
fn roots_of(path: &Path, pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in parse_certs(path, pem)? {
        roots.add(cert).map_err(|source| TlsError::Ca {
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(roots)
}

/// ALPN id of HTTP/1.1 (the HTTP-CONNECT frontend speaks nothing else).
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// A server configuration presenting `cert`/`key`; with `client_ca`, clients
/// must present a certificate that chains to it (mTLS). ALPN offers `h2`.
///
/// # Errors
/// Any file problem, or a key that does not match the certificate.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_with_alpn(cert, key, client_ca, &[ALPN_H2])
}

/// [`server_config`] offering the given ALPN protocols instead of `h2`.
///
/// # Errors
/// Any file problem, or a key that does not match the certificate.
pub fn server_config_with_alpn(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_with_policy(cert, key, client_ca, alpn, &TlsPolicy::default())
}

/// [`server_config_with_alpn`] restricted by `policy` (`--cipher-suites`,
/// `--tls-min-version`).
///
/// # Errors
/// Any file problem, or a key that does not match the certificate.
pub fn server_config_with_policy(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
    policy: &TlsPolicy,
) -> Result<Arc<ServerConfig>, TlsError> {
    Ok(listener_config(cert, key, client_ca, alpn, policy, Resumption::Cache)?.server)
}

/// Session tickets of a listener (see [`tickets`]).
#[derive(Debug, Clone, Copy)]
pub struct TicketSettings<'a> {
    /// The file the ticket keys are derived from.
    pub secret: &'a Path,
    /// How long each key is used.
    pub rotation: std::time::Duration,
}

/// Whether and how a listener resumes TLS sessions.
#[derive(Debug, Clone, Copy)]
pub enum Resumption<'a> {
    /// Never: no session cache, no tickets, so every handshake is a full
    /// one and every client certificate chain is verified by it.
    Off,
    /// rustls's default: an in-memory cache of this process's sessions
    /// (TLS 1.2 session ids, TLS 1.3 tickets naming a cache entry). A
    /// resumed session's chain is not verified again by rustls: the
    /// listener must ([`tickets::verify_resumed`]).
    Cache,
    /// TLS 1.3 session tickets sealed with keys derived from a secret (see
    /// [`tickets`]); the same re-verification applies.
    Tickets(TicketSettings<'a>),
}

/// What a TLS listener hands each handshake, and what it checks after one:
/// built from one reading of each file, so that the client CA that verifies
/// full handshakes, the one that verifies resumed ones and the one session
/// tickets are bound to are the same bytes.
#[derive(Debug)]
pub struct ListenerConfig {
    /// The configuration of its handshakes.
    pub server: Arc<ServerConfig>,
    /// With client certificates (mTLS), their verifier: the one `server`
    /// uses, for the chains resumed sessions bring back
    /// ([`tickets::verify_resumed`]).
    pub client_verifier: Option<Arc<dyn ClientCertVerifier>>,
}

/// A listener presenting `cert`/`key`, offering `alpn`, restricted by
/// `policy`; with `client_ca`, clients must present a certificate that
/// chains to it (mTLS); resuming sessions as `resumption` says: with
/// tickets, it issues and resumes TLS 1.3 session tickets sealed with keys
/// derived from their secret and bound to the bytes of `client_ca`. Each
/// file is read once.
///
/// # Errors
/// Any file problem, a key that does not match the certificate, or a ticket
/// secret shorter than [`tickets::MIN_SECRET_LEN`].
pub fn listener_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
    policy: &TlsPolicy,
    resumption: Resumption<'_>,
) -> Result<ListenerConfig, TlsError> {
    let versions: &[&rustls::SupportedProtocolVersion] = if policy.tls13_only {
        &[&rustls::version::TLS13]
    } else {
        rustls::DEFAULT_VERSIONS
    };
    let builder = ServerConfig::builder_with_provider(provider_for(policy))
        .with_protocol_versions(versions)
        .map_err(|source| TlsError::Config {
            path: cert.to_owned(),
            source,
        })?;
    let client_ca = client_ca
        .map(|ca| read_pem(ca).map(|pem| (ca, pem)))
        .transpose()?;
    let client_verifier = match &client_ca {
        Some((ca, pem)) => Some(
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots_of(ca, pem)?), provider())
                .build()
                .map_err(|source| TlsError::Verifier {
                    path: (*ca).to_owned(),
                    source,
                })?,
        ),
        None => None,
    };
    let builder = match &client_verifier {
        Some(verifier) => builder.with_client_cert_verifier(verifier.clone()),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .map_err(|source| pair_error(cert, key, source))?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    match resumption {
        Resumption::Off => {
            config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
            config.send_tls13_tickets = 0;
        }
        Resumption::Cache => {}
        Resumption::Tickets(tickets) => {
            let binding = client_ca
                .as_ref()
                .map_or(&[][..], |(_, pem)| pem.as_slice());
            config.ticketer = ticket_keys(tickets, binding)?;
        }
    }
    Ok(ListenerConfig {
        server: Arc::new(config),
        client_verifier,
    })
}

/// What rustls said of a certificate and its key: a mismatch names both.
fn pair_error(cert: &Path, key: &Path, source: rustls::Error) -> TlsError {
    match source {
        rustls::Error::InconsistentKeys(_) => TlsError::KeyMismatch {
            cert: cert.to_owned(),
            key: key.to_owned(),
        },
        source => TlsError::Config {
            path: cert.to_owned(),
            source,
        },
    }
}

/// Ticket keys from the secret of `tickets`, bound to `binding` (the
/// client CA bundle's bytes, or nothing), rotated every `tickets.rotation`.
///
/// # Errors
/// The secret cannot be read, or is shorter than
/// [`tickets::MIN_SECRET_LEN`].
fn ticket_keys(
    tickets: TicketSettings<'_>,
    binding: &[u8],
) -> Result<Arc<tickets::TicketKeys>, TlsError> {
    let secret = tickets.secret;
    let key = std::fs::read(secret).map_err(|source| TlsError::Secret {
        path: secret.to_owned(),
        source,
    })?;
    if key.len() < tickets::MIN_SECRET_LEN {
        return Err(TlsError::ShortSecret {
            path: secret.to_owned(),
            len: key.len(),
        });
    }
    Ok(Arc::new(tickets::TicketKeys::new(
        &key,
        binding,
        tickets.rotation,
    )))
}

/// A client configuration trusting only `ca`, presenting `client_cert`
/// (cert, key) if given, and offering `alpn` followed by `h2`.
///
/// # Errors
/// Any file problem, or a key that does not match the certificate.
pub fn client_config(
    ca: &Path,
    client_cert: Option<(&Path, &Path)>,
    alpn: &[String],
) -> Result<Arc<ClientConfig>, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Config {
            path: ca.to_owned(),
            source,
        })?
        .with_root_certificates(load_roots(ca)?);
    let mut config = match client_cert {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|source| pair_error(cert, key, source))?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn
        .iter()
        .map(|p| p.as_bytes().to_vec())
        .chain(std::iter::once(ALPN_H2.to_vec()))
        .collect();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_provider_is_the_one_named() {
        let key_provider = format!("{:?}", provider().key_provider).to_lowercase();
        assert_eq!(
            key_provider, PROVIDER_NAME,
            "the bench would name the wrong provider"
        );
    }

    #[test]
    fn missing_files_are_named() {
        let err = load_certs(Path::new("/nonexistent/cert.pem")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/cert.pem"), "{err}");
        let err = load_key(Path::new("/nonexistent/key.pem")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/key.pem"), "{err}");
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let dir = tempfile_dir();
        let path = dir.join("empty.pem");
        std::fs::write(&path, "not a pem\n").unwrap();
        let err = load_certs(&path).unwrap_err();
        assert!(matches!(err, TlsError::NoCerts { .. }), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A `--cipher-suites` value split as pflag splits it.
    fn names(text: &str) -> Vec<String> {
        text.trim_matches(['[', ']'])
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn cipher_suites_parse_like_go() {
        assert_eq!(
            parse_cipher_suites(&names("[]")),
            Ok(CipherSuites::default())
        );
        assert_eq!(parse_cipher_suites(&names("")), Ok(CipherSuites::default()));
        assert_eq!(
            parse_cipher_suites(&names(
                "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305"
            )),
            Ok(CipherSuites {
                suites: Some(vec![
                    rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
                    rustls::CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256
                ]),
                left_out: Vec::new(),
            })
        );
        assert!(
            parse_cipher_suites(&names("TLS_RSA_WITH_RC4_128_SHA"))
                .unwrap_err()
                .contains("TLS_RSA_WITH_RC4_128_SHA")
        );
    }

    /// Go's ECDHE CBC suites are accepted and left out (rustls has no CBC);
    /// only a list whose every TLS 1.2 suite was left out is unusable.
    #[test]
    fn cbc_suites_are_left_out_by_name() {
        let mixed = parse_cipher_suites(&names(
            "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA,TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA",
        ))
        .unwrap();
        assert_eq!(
            mixed.suites,
            Some(vec![
                rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
            ])
        );
        assert_eq!(
            mixed.left_out,
            [
                "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
                "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA"
            ]
        );
        assert!(!mixed.no_tls12_suite_left());
        let only_cbc = parse_cipher_suites(&names("TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA")).unwrap();
        assert_eq!(only_cbc.left_out, ["TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA"]);
        assert!(only_cbc.no_tls12_suite_left());
        let cbc_and_tls13 = parse_cipher_suites(&names(
            "TLS_AES_128_GCM_SHA256,TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA",
        ))
        .unwrap();
        assert!(cbc_and_tls13.no_tls12_suite_left());
        // Without CBC names nothing is left out, whatever the list.
        let tls13 = parse_cipher_suites(&names("TLS_AES_128_GCM_SHA256")).unwrap();
        assert!(!tls13.no_tls12_suite_left());
    }

    #[test]
    fn tls_min_versions_parse_like_go() {
        assert_eq!(parse_min_version(""), Ok((false, None)));
        assert_eq!(parse_min_version("VersionTLS13"), Ok((true, None)));
        assert!(parse_min_version("VersionTLS10").unwrap().1.is_some());
        assert!(parse_min_version("TLS1.3").is_err());
    }

    /// Whether a client limited to `client_suites`/`client_versions`
    /// completes a handshake with a server under `policy`.
    async fn handshake(
        policy: &TlsPolicy,
        client_suite: rustls::CipherSuite,
        client_tls12_only: bool,
    ) -> bool {
        let dir = tempfile_dir();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(&dir)
            .unwrap();
        let server = server_config_with_policy(
            &dir.join("cluster.crt"),
            &dir.join("cluster.key"),
            None,
            &[ALPN_H2],
            policy,
        )
        .unwrap();
        let mut client_provider = (*provider()).clone();
        client_provider
            .cipher_suites
            .retain(|s| s.suite() == client_suite);
        let versions: &[&rustls::SupportedProtocolVersion] = if client_tls12_only {
            &[&rustls::version::TLS12]
        } else {
            rustls::DEFAULT_VERSIONS
        };
        let client = ClientConfig::builder_with_provider(Arc::new(client_provider))
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(load_roots(&dir.join("agent-ca.crt")).unwrap())
            .with_no_client_auth();
        std::fs::remove_dir_all(&dir).unwrap();
        let (a, b) = tokio::io::duplex(64 * 1024);
        let accept = tokio_rustls::TlsAcceptor::from(server).accept(a);
        let connect = tokio_rustls::TlsConnector::from(Arc::new(client)).connect(
            rustls_pki_types::ServerName::try_from("localhost").unwrap(),
            b,
        );
        let (accepted, connected) = tokio::join!(accept, connect);
        accepted.is_ok() && connected.is_ok()
    }

    #[tokio::test]
    async fn the_policy_restricts_handshakes() {
        use rustls::CipherSuite as S;
        let open = TlsPolicy::default();
        assert!(handshake(&open, S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, true).await);
        let tls13 = TlsPolicy {
            tls12_suites: None,
            tls13_only: true,
        };
        assert!(!handshake(&tls13, S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, true).await);
        assert!(handshake(&tls13, S::TLS13_AES_128_GCM_SHA256, false).await);
        let only_256 = TlsPolicy {
            tls12_suites: Some(vec![S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384]),
            tls13_only: false,
        };
        assert!(!handshake(&only_256, S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, true).await);
        assert!(handshake(&only_256, S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, true).await);
        // TLS 1.3 suites are not restricted (Go).
        assert!(handshake(&only_256, S::TLS13_CHACHA20_POLY1305_SHA256, false).await);
    }

    /// One connection of `client` to `server`: a byte from the server
    /// (the session tickets come before it), then a close. How the
    /// server's handshake went, or why either side failed.
    async fn exchange(
        server: Arc<ServerConfig>,
        client: Arc<ClientConfig>,
    ) -> Result<rustls::HandshakeKind, String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, b) = tokio::io::duplex(64 * 1024);
        let accept = async move {
            let mut tls = tokio_rustls::TlsAcceptor::from(server)
                .accept(a)
                .await
                .map_err(|e| format!("server: {e}"))?;
            tls.write_all(b"x").await.map_err(|e| e.to_string())?;
            tls.flush().await.map_err(|e| e.to_string())?;
            let mut end = [0u8; 1];
            let _ = tls.read(&mut end).await;
            Ok::<_, String>(tls.get_ref().1.handshake_kind())
        };
        let connect = async move {
            let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
            let mut tls = tokio_rustls::TlsConnector::from(client)
                .connect(name, b)
                .await
                .map_err(|e| format!("client: {e}"))?;
            let mut byte = [0u8; 1];
            tls.read_exact(&mut byte)
                .await
                .map_err(|e| format!("client: {e}"))?;
            let _ = tls.shutdown().await;
            Ok::<_, String>(())
        };
        let (accepted, connected) = tokio::join!(accept, connect);
        let kind = accepted?;
        connected?;
        kind.ok_or_else(|| "no handshake kind".to_owned())
    }

    /// An agent's session resumes on a new configuration from the same
    /// files (a restart, another replica), without a signature; never past
    /// its ticket's window, nor after the client CA changed under it.
    #[tokio::test]
    async fn tickets_resume_across_a_restart_within_their_window_and_ca() {
        use std::sync::atomic::{AtomicU64, Ordering};

        use rustls::HandshakeKind::{Full, Resumed};
        let dir = tempfile_dir();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(&dir)
            .unwrap();
        let (cert, key) = (dir.join("cluster.crt"), dir.join("cluster.key"));
        let client_ca = dir.join("client-ca.crt");
        std::fs::copy(dir.join("agent-ca.crt"), &client_ca).unwrap();
        let hour = std::time::Duration::from_secs(3600);
        let server = || {
            let tickets = TicketSettings {
                secret: &key,
                rotation: hour,
            };
            let policy = TlsPolicy::default();
            listener_config(
                &cert,
                &key,
                Some(&client_ca),
                &[ALPN_H2],
                &policy,
                Resumption::Tickets(tickets),
            )
            .unwrap()
            .server
        };
        let agent = || {
            client_config(
                &dir.join("agent-ca.crt"),
                Some((&dir.join("proxy-agent.crt"), &dir.join("proxy-agent.key"))),
                &[],
            )
            .unwrap()
        };
        let client = agent();
        assert_eq!(exchange(server(), client.clone()).await, Ok(Full));
        assert_eq!(exchange(server(), client.clone()).await, Ok(Resumed));
        assert_eq!(exchange(server(), client.clone()).await, Ok(Resumed));
        // rustls's own keys are drawn at random: a restart cannot resume.
        let random = server_config(&cert, &key, Some(&client_ca)).unwrap();
        assert_eq!(exchange(random.clone(), client.clone()).await, Ok(Full));

        // Two rotations on, the ticket's key is gone.
        let now = Arc::new(AtomicU64::new(100 * 3600));
        let clocked = || {
            let now = now.clone();
            let mut config = Arc::unwrap_or_clone(server());
            config.ticketer = Arc::new(tickets::TicketKeys::with_clock(
                &std::fs::read(&key).unwrap(),
                &std::fs::read(&client_ca).unwrap(),
                hour,
                Arc::new(move || now.load(Ordering::Relaxed)),
            ));
            Arc::new(config)
        };
        let client = agent();
        assert_eq!(exchange(clocked(), client.clone()).await, Ok(Full));
        now.fetch_add(3600, Ordering::Relaxed);
        assert_eq!(exchange(clocked(), client.clone()).await, Ok(Resumed));
        now.fetch_add(2 * 3600, Ordering::Relaxed);
        assert_eq!(exchange(clocked(), client.clone()).await, Ok(Full));

        // The client CA rotates to one that does not admit the agent's
        // certificate: its ticket does not bring it back unchecked.
        let client = agent();
        assert_eq!(exchange(server(), client.clone()).await, Ok(Full));
        let other = certs::ClusterPki::generate(&[]).unwrap();
        std::fs::write(&client_ca, &other.agent_ca).unwrap();
        let refused = exchange(server(), client.clone()).await.unwrap_err();
        assert!(refused.contains("server:"), "{refused}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A client limited to TLS 1.2 gets no ticket (it would carry the
    /// master secret): a restarted server cannot resume its session, while
    /// a TLS 1.3 client's resumes.
    #[tokio::test]
    async fn tickets_are_issued_for_tls13_sessions_only() {
        use rustls::HandshakeKind::{Full, Resumed};
        let dir = tempfile_dir();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(&dir)
            .unwrap();
        let (cert, key) = (dir.join("cluster.crt"), dir.join("cluster.key"));
        // A new configuration each time: a restart, so that only a ticket
        // (never rustls's in-memory session cache) can resume.
        let server = || {
            let tickets = TicketSettings {
                secret: &key,
                rotation: std::time::Duration::from_secs(3600),
            };
            listener_config(
                &cert,
                &key,
                None,
                &[ALPN_H2],
                &TlsPolicy::default(),
                Resumption::Tickets(tickets),
            )
            .unwrap()
            .server
        };
        let client = |versions: &[&'static rustls::SupportedProtocolVersion]| {
            let config = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(versions)
                .unwrap()
                .with_root_certificates(load_roots(&dir.join("agent-ca.crt")).unwrap())
                .with_no_client_auth();
            Arc::new(config)
        };
        let tls12 = client(&[&rustls::version::TLS12]);
        assert_eq!(exchange(server(), tls12.clone()).await, Ok(Full));
        assert_eq!(exchange(server(), tls12.clone()).await, Ok(Full));
        let tls13 = client(&[&rustls::version::TLS13]);
        assert_eq!(exchange(server(), tls13.clone()).await, Ok(Full));
        assert_eq!(exchange(server(), tls13).await, Ok(Resumed));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Without resumption, a second connection on the same configuration
    /// is a full handshake again, in TLS 1.2 and 1.3 alike; rustls's
    /// default in-memory cache (what a listener without tickets had) would
    /// resume both without verifying the client's chain again.
    #[tokio::test]
    async fn a_listener_without_resumption_resumes_nothing() {
        use rustls::HandshakeKind::{Full, Resumed};
        let dir = tempfile_dir();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(&dir)
            .unwrap();
        let (cert, key) = (dir.join("cluster.crt"), dir.join("cluster.key"));
        let client_ca = dir.join("agent-ca.crt");
        let server = |resumption| {
            listener_config(
                &cert,
                &key,
                Some(&client_ca),
                &[ALPN_H2],
                &TlsPolicy::default(),
                resumption,
            )
            .unwrap()
            .server
        };
        let client = |version: &'static rustls::SupportedProtocolVersion| {
            let config = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(&[version])
                .unwrap()
                .with_root_certificates(load_roots(&dir.join("agent-ca.crt")).unwrap())
                .with_client_auth_cert(
                    load_certs(&dir.join("proxy-agent.crt")).unwrap(),
                    load_key(&dir.join("proxy-agent.key")).unwrap(),
                )
                .unwrap();
            Arc::new(config)
        };
        for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
            let cached = server(Resumption::Cache);
            let resuming = client(version);
            assert_eq!(exchange(cached.clone(), resuming.clone()).await, Ok(Full));
            assert_eq!(
                exchange(cached, resuming).await,
                Ok(Resumed),
                "{version:?}: the cache resumes"
            );
            let off = server(Resumption::Off);
            let resuming = client(version);
            assert_eq!(exchange(off.clone(), resuming.clone()).await, Ok(Full));
            assert_eq!(
                exchange(off, resuming).await,
                Ok(Full),
                "{version:?}: resumed without resumption"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// One connection of `client` to `server` as [`exchange`] makes it;
    /// what [`tickets::verify_resumed`] says of it with `verifier` at `now`.
    async fn resumed_verdict(
        server: Arc<ServerConfig>,
        client: Arc<ClientConfig>,
        verifier: Arc<dyn ClientCertVerifier>,
        now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::HandshakeKind, String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, b) = tokio::io::duplex(64 * 1024);
        let accept = async move {
            let mut tls = tokio_rustls::TlsAcceptor::from(server)
                .accept(a)
                .await
                .map_err(|e| format!("server: {e}"))?;
            tickets::verify_resumed(tls.get_ref().1, Some(&*verifier), now)
                .map_err(|e| format!("refused: {e}"))?;
            tls.write_all(b"x").await.map_err(|e| e.to_string())?;
            tls.flush().await.map_err(|e| e.to_string())?;
            let mut end = [0u8; 1];
            let _ = tls.read(&mut end).await;
            Ok::<_, String>(tls.get_ref().1.handshake_kind())
        };
        let connect = async move {
            let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
            let mut tls = tokio_rustls::TlsConnector::from(client)
                .connect(name, b)
                .await?;
            let mut byte = [0u8; 1];
            let read = tls.read_exact(&mut byte).await;
            let _ = tls.shutdown().await;
            read.map(|_| ())
        };
        let (accepted, _) = tokio::join!(accept, connect);
        accepted?.ok_or_else(|| "no handshake kind".to_owned())
    }

    /// Whoever holds the ticket secret (by default the serving key) can
    /// seal a session of their own, with any client chain or none, bound to
    /// the CA bundle (which is no secret). The chain a resumed session
    /// brings back is verified again, as a full handshake would: without
    /// one, or with one the CA did not sign, or past its dates, it is
    /// refused; a real agent's session resumes.
    #[tokio::test]
    async fn a_ticket_made_with_the_secret_admits_no_one_without_a_valid_chain() {
        use rustls::HandshakeKind::{Full, Resumed};
        let dir = tempfile_dir();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(&dir)
            .unwrap();
        let other = dir.join("other");
        std::fs::create_dir_all(&other).unwrap();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(&other)
            .unwrap();
        let (cert, key, ca) = (
            dir.join("cluster.crt"),
            dir.join("cluster.key"),
            dir.join("agent-ca.crt"),
        );
        let hour = std::time::Duration::from_secs(3600);
        let tickets = TicketSettings {
            secret: &key,
            rotation: hour,
        };
        let policy = TlsPolicy::default();
        let listener = listener_config(
            &cert,
            &key,
            Some(&ca),
            &[ALPN_H2],
            &policy,
            Resumption::Tickets(tickets),
        )
        .unwrap();
        let verifier = listener.client_verifier.clone().unwrap();
        let now = rustls_pki_types::UnixTime::now();
        // The forger's server: the secret, the CA's bytes, and a client CA
        // of its choosing (none, or another PKI's).
        let forger = |client_ca: Option<&Path>| {
            let mut config = Arc::unwrap_or_clone(server_config(&cert, &key, client_ca).unwrap());
            config.ticketer = Arc::new(tickets::TicketKeys::new(
                &std::fs::read(&key).unwrap(),
                &std::fs::read(&ca).unwrap(),
                hour,
            ));
            Arc::new(config)
        };
        let agent = |pki: &Path, with_cert: bool| {
            let cert =
                with_cert.then(|| (pki.join("proxy-agent.crt"), pki.join("proxy-agent.key")));
            let cert = cert.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
            client_config(&ca, cert, &[]).unwrap()
        };
        let real = || listener.server.clone();

        // No chain.
        let client = agent(&dir, false);
        assert_eq!(exchange(forger(None), client.clone()).await, Ok(Full));
        let refused = resumed_verdict(real(), client, verifier.clone(), now).await;
        assert_eq!(
            refused,
            Err("refused: the resumed session carries no client certificate".to_owned())
        );
        // Another CA's chain.
        let client = agent(&other, true);
        let forged = forger(Some(&other.join("agent-ca.crt")));
        assert_eq!(exchange(forged, client.clone()).await, Ok(Full));
        let refused = resumed_verdict(real(), client, verifier.clone(), now).await;
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.contains("does not verify")),
            "{refused:?}"
        );
        // A real agent: resumed; past its certificate's dates, refused.
        let client = agent(&dir, true);
        assert_eq!(exchange(real(), client.clone()).await, Ok(Full));
        let resumed = resumed_verdict(real(), client.clone(), verifier.clone(), now).await;
        assert_eq!(resumed, Ok(Resumed));
        let late = rustls_pki_types::UnixTime::since_unix_epoch(std::time::Duration::from_secs(
            u64::from(u32::MAX) * 40,
        ));
        let refused = resumed_verdict(real(), client, verifier, late).await;
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.contains("does not verify")),
            "{refused:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_short_or_missing_secret_is_named() {
        let dir = tempfile_dir();
        certs::ClusterPki::generate(&[])
            .unwrap()
            .write_to(&dir)
            .unwrap();
        let with_tickets = |secret: &Path| {
            let tickets = TicketSettings {
                secret,
                rotation: std::time::Duration::from_secs(3600),
            };
            listener_config(
                &dir.join("cluster.crt"),
                &dir.join("cluster.key"),
                None,
                &[ALPN_H2],
                &TlsPolicy::default(),
                Resumption::Tickets(tickets),
            )
        };
        let short = dir.join("short");
        std::fs::write(&short, [7u8; 31]).unwrap();
        let err = with_tickets(&short).unwrap_err();
        assert!(
            matches!(err, TlsError::ShortSecret { len: 31, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("short"), "{err}");
        let missing = dir.join("missing");
        let err = with_tickets(&missing).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tunnel-tls-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
