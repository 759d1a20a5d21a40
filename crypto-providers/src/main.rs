//! ring against aws-lc-rs, the two crypto providers rustls offers, on
//! what a Konnectivity server and agent pay for TLS: a signature with the
//! serving key, a full mutual-TLS handshake on each side (an RSA-2048
//! leaf as kubeadm makes them, or ECDSA P-256 as `make-certs` does; the
//! agent's client certificate ECDSA P-256, as the storm's agents), and the
//! bytes sealed and opened per GiB in 16 KiB records (AES-128-GCM, which
//! our servers prefer, and AES-256-GCM, which rustls lists first).
//!
//! Everything runs in memory on one thread, both providers in the same
//! run, interleaved round by round so that a noisy neighbour slows both;
//! each figure is the median of the rounds. The handshakes are full ones
//! (no tickets, no session cache), with X25519 alone (both providers have
//! it; aws-lc-rs would otherwise lead with X25519MLKEM768, which ring has
//! not), as the grpc-go agents of an ANP cluster make them after a server
//! restart.
//!
//! ```sh
//! cargo run --release --locked --manifest-path crypto-providers/Cargo.toml
//! cargo run --release --locked --manifest-path crypto-providers/Cargo.toml -- --rounds 3 --row-seconds 0.2
//! ```

use std::{
    io::{Read as _, Write as _},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use certs::{Ca, KeyAlgorithm};
use rustls::{
    CipherSuite, ClientConfig, ClientConnection, Connection, NamedGroup, RootCertStore,
    ServerConfig, ServerConnection, SignatureScheme,
    client::Resumption,
    crypto::{CryptoProvider, aws_lc_rs, ring},
    server::{NoServerSessionStorage, WebPkiClientVerifier},
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject as _};

/// One 16 KiB record's worth of plaintext: the largest TLS record.
const RECORD: usize = 16 * 1024;
/// Bytes moved per bulk measurement: 64 MiB.
const BULK: usize = 64 << 20;
/// A handshake that needs more flights than this is broken.
const MOST_FLIGHTS: usize = 8;

/// A provider rustls can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Ring,
    AwsLc,
}

impl Which {
    const BOTH: [Self; 2] = [Self::Ring, Self::AwsLc];

    fn name(self) -> &'static str {
        match self {
            Self::Ring => "ring",
            Self::AwsLc => "aws-lc-rs",
        }
    }

    /// The provider, with X25519 its only key exchange and `suite` its
    /// only cipher suite when one is named.
    fn provider(self, suite: Option<CipherSuite>) -> Arc<CryptoProvider> {
        // rustls 0.23.48 deprecates ring's provider (it has no
        // post-quantum key exchange); ours is what the servers run.
        #[allow(deprecated)]
        let mut provider = match self {
            Self::Ring => ring::default_provider(),
            Self::AwsLc => aws_lc_rs::default_provider(),
        };
        provider
            .kx_groups
            .retain(|group| group.name() == NamedGroup::X25519);
        if let Some(suite) = suite {
            provider.cipher_suites.retain(|s| s.suite() == suite);
        }
        Arc::new(provider)
    }
}

/// A certificate chain and its key.
struct Leaf {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

/// The server's CA and leaf (of the key type measured) and the agent's
/// (ECDSA P-256).
struct Pki {
    server_ca: CertificateDer<'static>,
    server: Leaf,
    agent_ca: CertificateDer<'static>,
    agent: Leaf,
}

impl Pki {
    fn new(server_keys: KeyAlgorithm) -> Result<Self> {
        let server_ca = Ca::with_keys("crypto-providers server CA", server_keys)?;
        let agent_ca = Ca::with_keys("crypto-providers agent CA", KeyAlgorithm::EcdsaP256)?;
        let server = server_ca.server_cert("proxy-server", &["localhost".to_owned()])?;
        let agent = agent_ca.client_cert("proxy-agent")?;
        let leaf = |pem: &certs::CertKey| -> Result<Leaf> {
            Ok(Leaf {
                chain: vec![CertificateDer::from_pem_slice(pem.cert_pem.as_bytes())?],
                key: PrivateKeyDer::from_pem_slice(pem.key_pem.as_bytes())?,
            })
        };
        Ok(Self {
            server_ca: CertificateDer::from_pem_slice(server_ca.cert_pem().as_bytes())?,
            server: leaf(&server)?,
            agent_ca: CertificateDer::from_pem_slice(agent_ca.cert_pem().as_bytes())?,
            agent: leaf(&agent)?,
        })
    }

    /// The server's side: client certificates required, no session kept.
    fn server_config(&self, provider: &Arc<CryptoProvider>) -> Result<Arc<ServerConfig>> {
        let mut roots = RootCertStore::empty();
        roots.add(self.agent_ca.clone())?;
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()?;
        let mut config = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.server.chain.clone(), self.server.key.clone_key())?;
        config.send_tls13_tickets = 0;
        config.session_storage = Arc::new(NoServerSessionStorage {});
        Ok(Arc::new(config))
    }

    /// The agent's side: its client certificate, no resumption.
    fn client_config(&self, provider: &Arc<CryptoProvider>) -> Result<Arc<ClientConfig>> {
        let mut roots = RootCertStore::empty();
        roots.add(self.server_ca.clone())?;
        let mut config = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(self.agent.chain.clone(), self.agent.key.clone_key())?;
        config.resumption = Resumption::disabled();
        Ok(Arc::new(config))
    }
}

/// Time spent by each side.
#[derive(Debug, Default, Clone, Copy)]
struct Spent {
    server: Duration,
    client: Duration,
}

/// Feeds `wire` to `to`, reading every plaintext byte it yields into
/// `scratch`; returns how many it yielded.
fn deliver(mut wire: &[u8], to: &mut Connection, scratch: &mut [u8]) -> Result<usize> {
    let mut plaintext = 0;
    while !wire.is_empty() {
        to.read_tls(&mut wire)?;
        let state = to.process_new_packets()?;
        let mut left = state.plaintext_bytes_to_read();
        while left > 0 {
            let n = to.reader().read(scratch)?;
            left -= n;
            plaintext += n;
        }
    }
    Ok(plaintext)
}

/// Everything `from` has to send.
fn flight(from: &mut Connection, wire: &mut Vec<u8>) -> Result<()> {
    wire.clear();
    while from.wants_write() {
        from.write_tls(wire)?;
    }
    Ok(())
}

/// One full handshake, each side's time added to `spent`; returns the
/// server's connection and the client's, established.
fn handshake(
    server: &Arc<ServerConfig>,
    client: &Arc<ClientConfig>,
    spent: &mut Spent,
) -> Result<(Connection, Connection)> {
    let (mut wire, mut scratch) = (Vec::new(), vec![0; RECORD]);
    let start = Instant::now();
    let mut c = Connection::from(ClientConnection::new(
        client.clone(),
        ServerName::try_from("localhost")?,
    )?);
    spent.client += start.elapsed();
    let start = Instant::now();
    let mut s = Connection::from(ServerConnection::new(server.clone())?);
    spent.server += start.elapsed();
    for _ in 0..MOST_FLIGHTS {
        if !c.is_handshaking() && !s.is_handshaking() && !c.wants_write() && !s.wants_write() {
            return Ok((s, c));
        }
        let start = Instant::now();
        flight(&mut c, &mut wire)?;
        spent.client += start.elapsed();
        let start = Instant::now();
        deliver(&wire, &mut s, &mut scratch)?;
        flight(&mut s, &mut wire)?;
        spent.server += start.elapsed();
        let start = Instant::now();
        deliver(&wire, &mut c, &mut scratch)?;
        spent.client += start.elapsed();
    }
    bail!("the handshake did not finish in {MOST_FLIGHTS} flights")
}

/// Seals `records` full records on the client and opens them on the
/// server; the time of each.
fn bulk(which: Which, suite: CipherSuite, pki: &Pki, records: usize) -> Result<Spent> {
    let provider = which.provider(Some(suite));
    let (mut s, mut c) = handshake(
        &pki.server_config(&provider)?,
        &pki.client_config(&provider)?,
        &mut Spent::default(),
    )?;
    let negotiated = c.negotiated_cipher_suite().map(|s| s.suite());
    ensure!(
        negotiated == Some(suite),
        "{}: negotiated {negotiated:?}, not {suite:?}",
        which.name()
    );
    let plaintext = vec![0x5a; RECORD];
    let (mut wire, mut scratch) = (Vec::with_capacity(2 * RECORD), vec![0; RECORD]);
    let mut spent = Spent::default();
    for _ in 0..records {
        let start = Instant::now();
        c.writer().write_all(&plaintext)?;
        flight(&mut c, &mut wire)?;
        spent.client += start.elapsed();
        let start = Instant::now();
        let opened = deliver(&wire, &mut s, &mut scratch)?;
        spent.server += start.elapsed();
        ensure!(
            opened == RECORD,
            "{} opened {opened} of {RECORD} bytes",
            which.name()
        );
    }
    Ok(spent)
}

/// The time of one signature with `scheme` by `key`, over `row`.
fn sign(
    which: Which,
    key: &PrivateKeyDer<'static>,
    scheme: SignatureScheme,
    row: Duration,
) -> Result<Duration> {
    let provider = which.provider(None);
    let key = provider.key_provider.load_private_key(key.clone_key())?;
    let signer = key
        .choose_scheme(&[scheme])
        .with_context(|| format!("{}: no signer for {scheme:?}", which.name()))?;
    // What TLS 1.3 signs: 64 spaces, a context string, a transcript hash.
    let message = [0x20; 64 + 34 + 32];
    let (start, mut n) = (Instant::now(), 0u32);
    while start.elapsed() < row || n == 0 {
        ensure!(!signer.sign(&message)?.is_empty(), "an empty signature");
        n += 1;
    }
    Ok(start.elapsed() / n)
}

/// Each side's time per full handshake, over `row`.
fn handshakes(which: Which, pki: &Pki, row: Duration) -> Result<Spent> {
    let provider = which.provider(None);
    let (server, client) = (pki.server_config(&provider)?, pki.client_config(&provider)?);
    let (start, mut n, mut spent) = (Instant::now(), 0u32, Spent::default());
    while start.elapsed() < row || n == 0 {
        handshake(&server, &client, &mut spent)?;
        n += 1;
    }
    Ok(Spent {
        server: spent.server / n,
        client: spent.client / n,
    })
}

/// A measure: its name, its unit, and one figure per provider per round.
struct Row {
    name: String,
    unit: Unit,
    figures: [Vec<f64>; 2],
}

#[derive(Clone, Copy)]
enum Unit {
    /// Milliseconds per operation.
    Ms,
    /// CPU seconds per GiB.
    SecondsPerGib,
}

impl Row {
    fn new(name: String, unit: Unit) -> Self {
        Self {
            name,
            unit,
            figures: [Vec::new(), Vec::new()],
        }
    }

    fn add(&mut self, which: Which, time: Duration) {
        let figure = match self.unit {
            Unit::Ms => time.as_secs_f64() * 1e3,
            Unit::SecondsPerGib => time.as_secs_f64() * (1u64 << 30) as f64 / BULK as f64,
        };
        self.figures[which as usize].push(figure);
    }

    fn median(&self, which: Which) -> f64 {
        let mut figures = self.figures[which as usize].clone();
        figures.sort_by(f64::total_cmp);
        figures[figures.len() / 2]
    }

    fn line(&self) -> String {
        let (ring, aws) = (self.median(Which::Ring), self.median(Which::AwsLc));
        let unit = match self.unit {
            Unit::Ms => "ms",
            Unit::SecondsPerGib => "CPU-s/GiB",
        };
        format!(
            "| {} | {ring:.3} {unit} | {aws:.3} {unit} | {:.2} |",
            self.name,
            aws / ring
        )
    }
}

/// The measures, in the table's order.
struct Table {
    rows: Vec<Row>,
}

impl Table {
    fn new() -> Self {
        let mut rows = Vec::new();
        for (keys, _) in KEYS {
            rows.push(Row::new(format!("sign, {keys}"), Unit::Ms));
        }
        for (keys, _) in KEYS {
            for side in ["server", "agent"] {
                rows.push(Row::new(
                    format!("full mTLS handshake, {side}, {keys} leaf"),
                    Unit::Ms,
                ));
            }
        }
        for (suite, _) in SUITES {
            for way in ["seal", "open"] {
                rows.push(Row::new(format!("{suite}, {way}"), Unit::SecondsPerGib));
            }
        }
        Self { rows }
    }

    /// One round: every measure, for one provider.
    fn round(&mut self, which: Which, pkis: &[Pki; 2], row: Duration) -> Result<()> {
        let mut rows = self.rows.iter_mut();
        let mut next = || rows.next().context("a measure with no row");
        for ((_, scheme), pki) in KEYS.iter().zip(pkis) {
            next()?.add(which, sign(which, &pki.server.key, *scheme, row)?);
        }
        for pki in pkis {
            let spent = handshakes(which, pki, row)?;
            next()?.add(which, spent.server);
            next()?.add(which, spent.client);
        }
        for (_, suite) in SUITES {
            let spent = bulk(which, suite, &pkis[1], BULK / RECORD)?;
            next()?.add(which, spent.client);
            next()?.add(which, spent.server);
        }
        Ok(())
    }
}

/// The serving keys measured, and the scheme TLS 1.3 signs with.
const KEYS: [(&str, SignatureScheme); 2] = [
    ("RSA-2048 (PSS)", SignatureScheme::RSA_PSS_SHA256),
    ("ECDSA P-256", SignatureScheme::ECDSA_NISTP256_SHA256),
];

/// The suites measured.
const SUITES: [(&str, CipherSuite); 2] = [
    ("AES-128-GCM", CipherSuite::TLS13_AES_128_GCM_SHA256),
    ("AES-256-GCM", CipherSuite::TLS13_AES_256_GCM_SHA384),
];

/// `--rounds N` and `--row-seconds S`.
fn options() -> Result<(usize, Duration)> {
    let (mut rounds, mut row) = (5, Duration::from_millis(500));
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--rounds" => {
                rounds = value.parse().with_context(|| format!("--rounds {value}"))?;
                ensure!(rounds > 0, "--rounds must be at least 1");
            }
            "--row-seconds" => {
                row = Duration::try_from_secs_f64(value.parse()?)
                    .with_context(|| format!("--row-seconds {value}"))?;
            }
            _ => bail!("unknown flag {flag} (known: --rounds N, --row-seconds S)"),
        }
    }
    Ok((rounds, row))
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".to_owned())
}

fn main() -> Result<()> {
    let (rounds, row) = options()?;
    let pkis = [
        Pki::new(KeyAlgorithm::Rsa2048)?,
        Pki::new(KeyAlgorithm::EcdsaP256)?,
    ];
    let mut table = Table::new();
    for round in 0..rounds {
        // Alternate which goes first, so that neither always runs warm.
        let order = if round % 2 == 0 {
            Which::BOTH
        } else {
            [Which::AwsLc, Which::Ring]
        };
        for which in order {
            table.round(which, &pkis, row)?;
        }
        eprintln!("crypto-providers: round {} of {rounds} done", round + 1);
    }
    println!(
        "crypto-providers: {}, {} CPUs; medians of {rounds} rounds, one thread",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    println!("| measure | ring | aws-lc-rs | aws-lc-rs / ring |");
    println!("| --- | --- | --- | --- |");
    for row in &table.rows {
        println!("{}", row.line());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_providers_finish_a_full_mutual_handshake_with_either_key_and_move_every_byte() {
        for keys in [KeyAlgorithm::Rsa2048, KeyAlgorithm::EcdsaP256] {
            let pki = Pki::new(keys).unwrap();
            for which in Which::BOTH {
                let provider = which.provider(None);
                let (s, c) = handshake(
                    &pki.server_config(&provider).unwrap(),
                    &pki.client_config(&provider).unwrap(),
                    &mut Spent::default(),
                )
                .unwrap();
                assert_eq!(
                    c.negotiated_key_exchange_group().map(|g| g.name()),
                    Some(NamedGroup::X25519)
                );
                assert!(
                    s.peer_certificates().is_some_and(|c| c.len() == 1),
                    "no client certificate"
                );
                for (_, suite) in SUITES {
                    bulk(which, suite, &pki, 64).unwrap();
                }
            }
        }
    }
}
