//! The certificate a server presents, read as a client sees it: the
//! certificate rotation's evidence that the server serves the new file,
//! not only that an agent with the new files was admitted (an agent
//! trusts the same CA either way).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context;
use rustls::{
    DigitallySignedStruct, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::CryptoProvider,
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject};

/// A verifier that keeps the server's certificate and accepts it: the
/// handshake is only there to read it.
#[derive(Debug)]
struct Keep {
    provider: Arc<CryptoProvider>,
    seen: Mutex<Option<CertificateDer<'static>>>,
}

impl ServerCertVerifier for Keep {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(end_entity.clone().into_owned());
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The serial of a DER certificate, in hex.
fn serial(der: &[u8]) -> anyhow::Result<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| anyhow::anyhow!("not an X.509 certificate: {e}"))?;
    Ok(cert.tbs_certificate.raw_serial_as_string())
}

/// The serial of the first certificate of PEM text.
///
/// # Errors
/// It holds no certificate.
pub fn serial_of_pem(pem: &str) -> anyhow::Result<String> {
    let der =
        CertificateDer::from_pem_slice(pem.as_bytes()).context("reading a PEM certificate")?;
    serial(&der)
}

/// The serial of the certificate the TLS server at `addr` presents to a
/// new handshake (which may then fail for want of a client certificate:
/// the server's comes first).
///
/// # Errors
/// No certificate within 5 s.
pub async fn presented_serial(addr: SocketAddr) -> anyhow::Result<String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let keep = Arc::new(Keep {
        provider: provider.clone(),
        seen: Mutex::new(None),
    });
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(keep.clone())
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = ServerName::try_from("localhost")?;
    let handshake = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        connector.connect(name, tcp).await
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), handshake).await;
    let seen = keep.seen.lock().unwrap_or_else(|e| e.into_inner()).take();
    serial(&seen.with_context(|| format!("{addr} presented no certificate within 5 s"))?)
}
