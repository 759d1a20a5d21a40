//! Makes the two PKIs a Konnectivity deployment needs, as ANP's `make certs` does.
//!
//! The frontend PKI secures kube-apiserver → proxy-server (the mTLS frontend),
//! the agent PKI secures proxy-agent → proxy-server (the agent port). Keys are
//! ECDSA P-256, or RSA-2048 as kubeadm makes them ([`KeyAlgorithm`]);
//! certificates use rcgen's default validity (1975 to 4096).
//!
//! # Layout
//!
//! - [`Ca`]: a self-signed certificate authority that signs server and client
//!   certificates.
//! - [`CertKey`]: a PEM certificate with its PEM (PKCS#8) private key.
//! - [`ClusterPki`]: both PKIs with every leaf certificate, and
//!   [`ClusterPki::write_to`] to lay them out as files for the flags.
//! - `make-certs` (`src/main.rs`): the operator's command line over
//!   [`ClusterPki`].

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// Names every server certificate carries besides the caller's: loopback and
/// the in-cluster Service names of upstream's manifests.
const DEFAULT_SANS: [&str; 6] = [
    "localhost",
    "127.0.0.1",
    "::1",
    "konnectivity-server",
    "konnectivity-server.kube-system.svc",
    "konnectivity-server.kube-system.svc.cluster.local",
];

/// A PEM certificate and its PEM private key.
#[derive(Clone)]
pub struct CertKey {
    /// The certificate, PEM `CERTIFICATE`.
    pub cert_pem: String,
    /// The private key, PEM `PRIVATE KEY` (PKCS#8).
    pub key_pem: String,
}

impl std::fmt::Debug for CertKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertKey")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// The keys a PKI is made of; a flag's value too (`make-certs
/// --key-algorithm`, `bench --agents-key-algorithm`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyAlgorithm {
    /// ECDSA on P-256, signed with SHA-256: small and cheap to sign with.
    #[default]
    #[value(name = "ecdsa-p256")]
    EcdsaP256,
    /// RSA-2048 (PKCS#1 v1.5 with SHA-256), kubeadm's default: every full
    /// TLS handshake costs the server a signature of about a millisecond.
    #[value(name = "rsa-2048")]
    Rsa2048,
}

impl KeyAlgorithm {
    /// A fresh key. ring, rcgen's signer here, cannot make RSA keys: the
    /// `rsa` crate makes them, ring signs with them.
    fn generate(self) -> Result<KeyPair, rcgen::Error> {
        match self {
            Self::EcdsaP256 => KeyPair::generate(),
            Self::Rsa2048 => {
                use rsa::pkcs8::EncodePrivateKey as _;
                let key = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048)
                    .map_err(|_| rcgen::Error::KeyGenerationUnavailable)?;
                let der = key
                    .to_pkcs8_der()
                    .map_err(|_| rcgen::Error::KeyGenerationUnavailable)?;
                KeyPair::from_pkcs8_der_and_sign_algo(
                    &rustls_pki_types::PrivatePkcs8KeyDer::from(der.as_bytes()),
                    &rcgen::PKCS_RSA_SHA256,
                )
            }
        }
    }
}

/// A certificate authority that can sign leaf certificates.
pub struct Ca {
    /// The self-signed CA certificate, PEM.
    cert_pem: String,
    /// The CA's subject and signing key, used to sign leaves.
    issuer: Issuer<'static, KeyPair>,
    /// The keys of its leaves.
    leaves: KeyAlgorithm,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

impl Ca {
    /// Generates a new self-signed CA with a fresh key, named `common_name`.
    ///
    /// # Errors
    ///
    /// Fails if key generation or signing fails.
    pub fn new(common_name: &str) -> Result<Self, rcgen::Error> {
        Self::with_keys(common_name, KeyAlgorithm::default())
    }

    /// [`new`](Self::new) with keys of `algorithm`, its own and its
    /// leaves'.
    ///
    /// # Errors
    ///
    /// Fails if key generation or signing fails.
    pub fn with_keys(common_name: &str, algorithm: KeyAlgorithm) -> Result<Self, rcgen::Error> {
        let mut params = CertificateParams::default();
        params.distinguished_name = subject(common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = algorithm.generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Self {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
            leaves: algorithm,
        })
    }

    /// The same CA, signing leaves with keys of `algorithm` from now on: an
    /// ECDSA serving certificate from an RSA CA (kubeadm's), which costs
    /// the server an ECDSA signature per full handshake, not an RSA one.
    #[must_use]
    pub fn with_leaf_keys(self, algorithm: KeyAlgorithm) -> Self {
        Self {
            leaves: algorithm,
            ..self
        }
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// TLS server certificate (serverAuth EKU) with the given SANs; each SAN that
    /// parses as an IP address becomes an IP SAN, else a DNS SAN.
    ///
    /// # Errors
    ///
    /// Fails if a SAN is not a valid DNS name (not IA5), or if key generation
    /// or signing fails.
    pub fn server_cert(&self, common_name: &str, sans: &[String]) -> Result<CertKey, rcgen::Error> {
        self.leaf(
            common_name,
            sans.to_vec(),
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// TLS client certificate (clientAuth EKU) naming `sans` as
    /// [`server_cert`](Self::server_cert) does: an agent's names and
    /// addresses, to which proxy-server's `--verify-agent-identifiers`
    /// binds the identifiers it announces; a `urn:` name is a URI SAN
    /// (`urn:konnectivity:default-route` grants `default-route=true`).
    ///
    /// # Errors
    ///
    /// As [`server_cert`](Self::server_cert).
    pub fn client_cert_naming(
        &self,
        common_name: &str,
        sans: &[String],
    ) -> Result<CertKey, rcgen::Error> {
        self.leaf(
            common_name,
            sans.to_vec(),
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    /// TLS client certificate (clientAuth EKU), no SANs.
    ///
    /// # Errors
    ///
    /// Fails if key generation or signing fails.
    pub fn client_cert(&self, common_name: &str) -> Result<CertKey, rcgen::Error> {
        self.leaf(common_name, Vec::new(), ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// Signs a fresh key for `common_name` with one extended key usage.
    fn leaf(
        &self,
        common_name: &str,
        sans: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<CertKey, rcgen::Error> {
        // `new` makes an IP SAN of whatever parses as `IpAddr`, else a DNS
        // SAN; a `urn:` name is a URI (`urn:konnectivity:default-route`).
        let mut params = CertificateParams::new(sans)?;
        for san in &mut params.subject_alt_names {
            if let SanType::DnsName(name) = san
                && name.as_str().starts_with("urn:")
            {
                *san = SanType::URI(name.clone());
            }
        }
        params.distinguished_name = subject(common_name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![usage];
        params.use_authority_key_identifier_extension = true;
        let key = self.leaves.generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(CertKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// Everything a deployment needs: two PKIs, as ANP's `make certs` makes them.
#[derive(Debug, Clone)]
pub struct ClusterPki {
    /// Frontend CA (kube-apiserver → proxy-server mTLS frontend), PEM; proxy-server
    /// `--server-ca-cert` and the egress selector's `caBundle`.
    pub frontend_ca: String,
    /// proxy-server `--server-cert`/`--server-key`, signed by the frontend CA.
    pub frontend_server: CertKey,
    /// kube-apiserver egress client certificate (CN `kube-apiserver`), signed by
    /// the frontend CA.
    pub frontend_client: CertKey,
    /// Agent CA (proxy-agent → proxy-server agent port), PEM; proxy-server
    /// `--cluster-ca-cert` and proxy-agent `--ca-cert`.
    pub agent_ca: String,
    /// proxy-server `--cluster-cert`/`--cluster-key`, signed by the agent CA.
    pub cluster_server: CertKey,
    /// proxy-agent `--agent-cert`/`--agent-key` (CN `proxy-agent`), signed by the
    /// agent CA.
    pub agent_client: CertKey,
}

impl ClusterPki {
    /// Generates both CAs and all four leaves.
    ///
    /// `sans` are the names/IPs the server is reached by; both server
    /// certificates also always carry `localhost`, `127.0.0.1`, `::1`,
    /// `konnectivity-server`, `konnectivity-server.kube-system.svc` and
    /// `konnectivity-server.kube-system.svc.cluster.local`. Blank entries are
    /// skipped and duplicates removed.
    ///
    /// # Errors
    ///
    /// Fails if a SAN is not a valid DNS name (not IA5), or if key generation
    /// or signing fails.
    pub fn generate(sans: &[String]) -> Result<Self, rcgen::Error> {
        Self::generate_with(sans, KeyAlgorithm::default())
    }

    /// [`generate`](Self::generate) with keys of `algorithm`.
    ///
    /// # Errors
    ///
    /// As [`generate`](Self::generate).
    pub fn generate_with(sans: &[String], algorithm: KeyAlgorithm) -> Result<Self, rcgen::Error> {
        Self::generate_with_leaves(sans, algorithm, algorithm)
    }

    /// [`generate`](Self::generate) with CAs of `cas` keys signing leaves
    /// of `leaves` keys.
    ///
    /// # Errors
    ///
    /// As [`generate`](Self::generate).
    pub fn generate_with_leaves(
        sans: &[String],
        cas: KeyAlgorithm,
        leaves: KeyAlgorithm,
    ) -> Result<Self, rcgen::Error> {
        let all_sans = server_sans(sans);
        let frontend_ca = Ca::with_keys("konnectivity-frontend-ca", cas)?.with_leaf_keys(leaves);
        let agent_ca = Ca::with_keys("konnectivity-agent-ca", cas)?.with_leaf_keys(leaves);
        Ok(Self {
            frontend_server: frontend_ca.server_cert("konnectivity-server", &all_sans)?,
            frontend_client: frontend_ca.client_cert("kube-apiserver")?,
            frontend_ca: frontend_ca.cert_pem,
            cluster_server: agent_ca.server_cert("konnectivity-server", &all_sans)?,
            agent_client: agent_ca.client_cert("proxy-agent")?,
            agent_ca: agent_ca.cert_pem,
        })
    }

    /// Writes the files below into `dir` (created if missing), keys with mode
    /// 0600, certificates 0644, replacing existing files; returns the paths
    /// written, in this order:
    ///
    /// | file | content |
    /// | --- | --- |
    /// | `frontend-ca.crt` | [`Self::frontend_ca`] |
    /// | `proxy-frontend.crt`, `.key` | [`Self::frontend_server`] |
    /// | `proxy-client.crt`, `.key` | [`Self::frontend_client`] |
    /// | `agent-ca.crt` | [`Self::agent_ca`] |
    /// | `cluster.crt`, `.key` | [`Self::cluster_server`] |
    /// | `proxy-agent.crt`, `.key` | [`Self::agent_client`] |
    ///
    /// # Errors
    ///
    /// Fails on the first directory or file that cannot be created, written or
    /// chmodded; the error message names the path.
    pub fn write_to(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        fs::create_dir_all(dir).map_err(|e| with_path("creating directory", dir, e))?;
        let files: [(&str, &str, u32); 10] = [
            ("frontend-ca.crt", &self.frontend_ca, 0o644),
            ("proxy-frontend.crt", &self.frontend_server.cert_pem, 0o644),
            ("proxy-frontend.key", &self.frontend_server.key_pem, 0o600),
            ("proxy-client.crt", &self.frontend_client.cert_pem, 0o644),
            ("proxy-client.key", &self.frontend_client.key_pem, 0o600),
            ("agent-ca.crt", &self.agent_ca, 0o644),
            ("cluster.crt", &self.cluster_server.cert_pem, 0o644),
            ("cluster.key", &self.cluster_server.key_pem, 0o600),
            ("proxy-agent.crt", &self.agent_client.cert_pem, 0o644),
            ("proxy-agent.key", &self.agent_client.key_pem, 0o600),
        ];
        let mut written = Vec::with_capacity(files.len());
        for (name, contents, mode) in files {
            let path = dir.join(name);
            write_file(&path, contents, mode).map_err(|e| with_path("writing", &path, e))?;
            written.push(path);
        }
        Ok(written)
    }
}

/// [`DEFAULT_SANS`] followed by the non-blank, trimmed `given` ones, first
/// occurrence kept.
fn server_sans(given: &[String]) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    let given = given.iter().map(|s| s.trim()).filter(|s| !s.is_empty());
    for san in DEFAULT_SANS.into_iter().chain(given) {
        if !all.iter().any(|s| s == san) {
            all.push(san.to_owned());
        }
    }
    all
}

/// A distinguished name holding only a common name.
fn subject(common_name: &str) -> rcgen::DistinguishedName {
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

/// Writes `contents` to `path`, setting `mode` before any byte is written so a
/// key is never readable by others, even when replacing an older file.
fn write_file(path: &Path, contents: &str, mode: u32) -> io::Result<()> {
    let mut options = OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
    let mut file = options.open(path)?;
    // `mode` above only applies to new files; an existing one keeps its bits.
    #[cfg(unix)]
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    #[cfg(not(unix))]
    let _ = mode;
    file.write_all(contents.as_bytes())?;
    file.sync_all()
}

/// Prefixes an I/O error with what was done to which path.
fn with_path(action: &str, path: &Path, err: io::Error) -> io::Error {
    io::Error::new(err.kind(), format!("{action} {}: {err}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::Arc;

    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::crypto::CryptoProvider;
    use rustls::server::WebPkiClientVerifier;
    use rustls::{CertificateError, RootCertStore};
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

    use super::*;

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn der(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    fn roots(ca_pem: &str) -> Arc<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots.add(der(ca_pem)).unwrap();
        Arc::new(roots)
    }

    /// Verifies `cert` as a server certificate for `name` against `ca_pem`.
    fn verify_server(ca_pem: &str, cert: &CertKey, name: &str) -> Result<(), rustls::Error> {
        let verifier = WebPkiServerVerifier::builder_with_provider(roots(ca_pem), provider())
            .build()
            .unwrap();
        let name = ServerName::try_from(name.to_owned()).unwrap();
        verifier
            .verify_server_cert(&der(&cert.cert_pem), &[], &name, &[], UnixTime::now())
            .map(|_| ())
    }

    /// Verifies `cert` as a client certificate against `ca_pem`.
    fn verify_client(ca_pem: &str, cert: &CertKey) -> Result<(), rustls::Error> {
        let verifier = WebPkiClientVerifier::builder_with_provider(roots(ca_pem), provider())
            .build()
            .unwrap();
        verifier
            .verify_client_cert(&der(&cert.cert_pem), &[], UnixTime::now())
            .map(|_| ())
    }

    fn is_unknown_issuer(result: Result<(), rustls::Error>) -> bool {
        matches!(
            result,
            Err(rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer
            ))
        )
    }

    #[test]
    fn cluster_server_cert_verifies_for_default_and_custom_sans() {
        let pki = ClusterPki::generate(&["proxy.example.com".into(), "10.0.0.7".into()]).unwrap();
        for name in [
            "localhost",
            "127.0.0.1",
            "::1",
            "konnectivity-server.kube-system.svc.cluster.local",
            "proxy.example.com",
            "10.0.0.7",
        ] {
            let result = verify_server(&pki.agent_ca, &pki.cluster_server, name);
            assert!(result.is_ok(), "{name}: {result:?}");
        }

        let wrong_name = verify_server(&pki.agent_ca, &pki.cluster_server, "other.example.com");
        assert!(
            matches!(
                wrong_name,
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName
                        | CertificateError::NotValidForNameContext { .. }
                ))
            ),
            "{wrong_name:?}"
        );
        let wrong_ca = verify_server(&pki.frontend_ca, &pki.cluster_server, "localhost");
        assert!(is_unknown_issuer(wrong_ca));
    }

    #[test]
    fn frontend_server_cert_chains_to_frontend_ca() {
        let pki = ClusterPki::generate(&[]).unwrap();
        let result = verify_server(&pki.frontend_ca, &pki.frontend_server, "127.0.0.1");
        assert!(result.is_ok(), "{result:?}");
        let result = verify_server(&pki.frontend_ca, &pki.frontend_client, "localhost");
        assert!(
            matches!(
                result,
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::InvalidPurpose
                        | CertificateError::InvalidPurposeContext { .. }
                ))
            ),
            "client cert accepted as server cert: {result:?}"
        );
    }

    #[test]
    fn client_certs_verify_only_against_their_own_ca() {
        let pki = ClusterPki::generate(&[]).unwrap();
        assert_eq!(verify_client(&pki.agent_ca, &pki.agent_client), Ok(()));
        assert!(is_unknown_issuer(verify_client(
            &pki.frontend_ca,
            &pki.agent_client
        )));
        assert_eq!(
            verify_client(&pki.frontend_ca, &pki.frontend_client),
            Ok(())
        );
        assert!(is_unknown_issuer(verify_client(
            &pki.agent_ca,
            &pki.frontend_client
        )));
    }

    #[test]
    fn server_cert_maps_ip_sans_to_ip_and_names_to_dns() {
        let ca = Ca::new("test-ca").unwrap();
        let cert = ca
            .server_cert("srv", &["192.0.2.1".into(), "192.0.2.1.nip.io".into()])
            .unwrap();
        // webpki matches an IP server name only against IP SANs.
        let ip = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)).to_string();
        assert_eq!(verify_server(ca.cert_pem(), &cert, &ip), Ok(()));
        assert_eq!(
            verify_server(ca.cert_pem(), &cert, "192.0.2.1.nip.io"),
            Ok(())
        );
    }

    #[test]
    fn server_sans_adds_defaults_and_deduplicates() {
        let given = ["localhost", " extra ", "extra", "", "10.0.0.7"].map(String::from);
        let mut want: Vec<String> = DEFAULT_SANS.map(String::from).to_vec();
        want.extend(["extra".to_owned(), "10.0.0.7".to_owned()]);
        assert_eq!(server_sans(&given), want);
        assert_eq!(server_sans(&[]), DEFAULT_SANS.map(String::from));
    }

    #[test]
    fn mtls_handshake_succeeds_with_agent_pki() {
        mtls_handshake(KeyAlgorithm::EcdsaP256);
    }

    #[test]
    fn mtls_handshake_succeeds_with_rsa_keys() {
        let pki = mtls_handshake(KeyAlgorithm::Rsa2048);
        for pem in [&pki.cluster_server.key_pem, &pki.agent_client.key_pem] {
            let key = PrivateKeyDer::from_pem_slice(pem.as_bytes()).unwrap();
            // PKCS#8 of rsaEncryption, as kubeadm's keys load.
            let pkcs8 = match key {
                PrivateKeyDer::Pkcs8(der) => der,
                other => panic!("not PKCS#8: {other:?}"),
            };
            assert!(
                provider()
                    .key_provider
                    .load_private_key(pkcs8.into())
                    .is_ok()
            );
        }
    }

    #[test]
    fn mtls_handshake_succeeds_with_ecdsa_leaves_of_an_rsa_ca() {
        let pki = handshake_with(
            ClusterPki::generate_with_leaves(&[], KeyAlgorithm::Rsa2048, KeyAlgorithm::EcdsaP256)
                .unwrap(),
        );
        let key_type = |pem: &str| {
            let der = der(pem);
            let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
            cert.public_key().algorithm.algorithm.to_id_string()
        };
        let (rsa, ec) = ("1.2.840.113549.1.1.1", "1.2.840.10045.2.1");
        assert_eq!(key_type(&pki.agent_ca), rsa);
        assert_eq!(key_type(&pki.frontend_ca), rsa);
        for leaf in [&pki.cluster_server, &pki.agent_client, &pki.frontend_server] {
            assert_eq!(key_type(&leaf.cert_pem), ec);
        }
    }

    /// A full mTLS handshake with a PKI of `algorithm` keys.
    fn mtls_handshake(algorithm: KeyAlgorithm) -> ClusterPki {
        handshake_with(ClusterPki::generate_with(&[], algorithm).unwrap())
    }

    /// A full mTLS handshake with `pki`'s agent-port certificates.
    fn handshake_with(pki: ClusterPki) -> ClusterPki {
        let key = |pem: &str| PrivateKeyDer::from_pem_slice(pem.as_bytes()).unwrap();

        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(roots(&pki.agent_ca), provider())
                .build()
                .unwrap();
        let server_config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(
                vec![der(&pki.cluster_server.cert_pem)],
                key(&pki.cluster_server.key_pem),
            )
            .unwrap();
        let client_config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots(&pki.agent_ca))
            .with_client_auth_cert(
                vec![der(&pki.agent_client.cert_pem)],
                key(&pki.agent_client.key_pem),
            )
            .unwrap();

        let name = ServerName::try_from("localhost").unwrap();
        let mut client = rustls::ClientConnection::new(Arc::new(client_config), name).unwrap();
        let mut server = rustls::ServerConnection::new(Arc::new(server_config)).unwrap();
        for _ in 0..10 {
            if !client.is_handshaking() && !server.is_handshaking() {
                break;
            }
            let mut buf = Vec::new();
            client.write_tls(&mut buf).unwrap();
            server.read_tls(&mut buf.as_slice()).unwrap();
            server.process_new_packets().unwrap();
            buf.clear();
            server.write_tls(&mut buf).unwrap();
            client.read_tls(&mut buf.as_slice()).unwrap();
            client.process_new_packets().unwrap();
        }
        assert!(!client.is_handshaking() && !server.is_handshaking());
        let presented = server.peer_certificates().unwrap();
        assert_eq!(presented, [der(&pki.agent_client.cert_pem)]);
        pki
    }

    #[cfg(unix)]
    #[test]
    fn write_to_writes_ten_files_with_key_modes() {
        use std::os::unix::fs::PermissionsExt;

        let pki = ClusterPki::generate(&[]).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("nested/out");
        let written = pki.write_to(&dir).unwrap();

        let names: Vec<_> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "frontend-ca.crt",
                "proxy-frontend.crt",
                "proxy-frontend.key",
                "proxy-client.crt",
                "proxy-client.key",
                "agent-ca.crt",
                "cluster.crt",
                "cluster.key",
                "proxy-agent.crt",
                "proxy-agent.key",
            ]
        );
        for path in &written {
            assert_eq!(path.parent(), Some(dir.as_path()));
            let mode = fs::metadata(path).unwrap().permissions().mode() & 0o777;
            let want = if path.extension().unwrap() == "key" {
                0o600
            } else {
                0o644
            };
            assert_eq!(mode, want, "{}", path.display());
        }
        assert_eq!(
            fs::read_to_string(dir.join("cluster.key")).unwrap(),
            pki.cluster_server.key_pem
        );
        assert_eq!(
            fs::read_to_string(dir.join("agent-ca.crt")).unwrap(),
            pki.agent_ca
        );
    }

    #[cfg(unix)]
    #[test]
    fn write_to_tightens_mode_of_existing_key() {
        use std::os::unix::fs::PermissionsExt;

        let pki = ClusterPki::generate(&[]).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let key = tmp.path().join("proxy-agent.key");
        fs::write(&key, "old").unwrap();
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();

        pki.write_to(tmp.path()).unwrap();
        let mode = fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(fs::read_to_string(&key).unwrap(), pki.agent_client.key_pem);
    }

    #[test]
    fn write_to_error_names_the_path() {
        let pki = ClusterPki::generate(&[]).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-a-dir");
        fs::write(&file, "").unwrap();

        let err = pki.write_to(&file).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&file.display().to_string()), "{msg}");
    }
}
