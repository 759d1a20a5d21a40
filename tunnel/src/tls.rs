//! PEM loading and rustls configurations, always with the ring provider.
//!
//! Every error names the file it is about; callers add the flag.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    crypto::{CryptoProvider, ring},
    server::WebPkiClientVerifier,
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
    /// The client-certificate verifier could not be built.
    #[error("cannot verify client certificates with CA {path}")]
    Verifier {
        /// The CA file.
        path: PathBuf,
        /// Why.
        source: rustls::server::VerifierBuilderError,
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
            | Self::Verifier { path, .. } => path,
        }
    }
}

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

/// Reads every certificate of a PEM file (a chain or a CA bundle).
///
/// # Errors
/// [`TlsError::Certs`] or [`TlsError::NoCerts`].
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
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
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
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
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Config {
            path: cert.to_owned(),
            source,
        })?;
    let builder = match client_ca {
        Some(ca) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(load_roots(ca)?), provider())
                    .build()
                    .map_err(|source| TlsError::Verifier {
                        path: ca.to_owned(),
                        source,
                    })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .map_err(|source| TlsError::Config {
            path: cert.to_owned(),
            source,
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
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
            .map_err(|source| TlsError::Config {
                path: cert.to_owned(),
                source,
            })?,
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

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tunnel-tls-{}", fastrand::u64(..)));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
