//! Fuzzing entry points (cargo-fuzz targets in `fuzz/`, and their corpora
//! replayed by the tests below). Not an API: compiled for tests and under
//! the `fuzzing` feature only, which no binary enables.
//!
//! Each function takes bytes someone else controls and panics when an
//! invariant the code promises does not hold (see `docs/fuzzing.md`).

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use rustls::server::ProducesTickets;

use crate::tls::{
    self, TlsError,
    tickets::{MAX_CLOCK_SKEW, TicketKeys},
};

/// The heap a [`tls_files`] run may use at its peak for `len` bytes: the
/// files' bytes, their decoded DER, the parsed certificates and a rustls
/// configuration.
pub fn tls_files_alloc_bound(len: usize) -> usize {
    64 * len + 1024 * 1024
}

/// A directory of its own for the files of one [`tls_files`] run (or one
/// test), removed when dropped: the tests of one process run at once, and
/// one must not delete another's files.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "konnectivity-fuzz-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An error about a file must name that file.
fn names(error: &TlsError, paths: &[&Path]) {
    assert!(
        paths.contains(&error.path()),
        "{error} names {}, not one of {paths:?}",
        error.path().display()
    );
    assert!(
        error
            .to_string()
            .contains(&error.path().display().to_string()),
        "the message does not show the path: {error}"
    );
}

/// The certificate, key and CA files an operator hands over
/// (`--server-cert`, `--server-key`, `--cluster-ca-cert`, …), with the
/// bytes after the first three: the first byte says which file is which
/// part, the next two where the certificate file ends and the key file
/// begins. They are loaded as the binaries load them (PEM certificates,
/// the first private key, a CA store, a server configuration with client
/// authentication), and read for their expiry as the metrics do. Checks:
/// a bad file is an error naming that file (never a panic); what is
/// loaded is no larger than the file; a configuration is built only from
/// files that load one by one.
pub fn tls_files(data: &[u8]) {
    let (&choice, rest) = data.split_first().unwrap_or((&0, &[]));
    let (split, rest) = match rest.split_first_chunk::<2>() {
        Some((split, rest)) => (usize::from(u16::from_be_bytes(*split)), rest),
        None => (0, rest),
    };
    let (cert_bytes, key_bytes) = rest.split_at(split.min(rest.len()));
    let scratch = Scratch::new();
    let dir = &scratch.0;
    let cert = dir.join("cert.pem");
    let key = dir.join("key.pem");
    let ca = dir.join("ca.pem");
    std::fs::write(&cert, cert_bytes).expect("writing the cert file");
    std::fs::write(&key, key_bytes).expect("writing the key file");
    // The CA is the certificate file, or the key file (a mix-up), or both.
    let ca_bytes = match choice % 3 {
        0 => cert_bytes.to_vec(),
        1 => key_bytes.to_vec(),
        _ => [cert_bytes, key_bytes].concat(),
    };
    std::fs::write(&ca, &ca_bytes).expect("writing the CA file");

    let certs = tls::load_certs(&cert);
    match &certs {
        Ok(certs) => {
            assert!(!certs.is_empty(), "no certificate loaded without an error");
            let total: usize = certs.iter().map(|c| c.len()).sum();
            assert!(
                total <= cert_bytes.len(),
                "{total} DER bytes from a {} byte file",
                cert_bytes.len()
            );
            let _ = tls::files::earliest_expiry(certs);
        }
        Err(error) => names(error, &[&cert]),
    }
    let loaded_key = tls::load_key(&key);
    match &loaded_key {
        Ok(k) => assert!(k.secret_der().len() <= key_bytes.len()),
        Err(error) => names(error, &[&key]),
    }
    match tls::load_roots(&ca) {
        Ok(roots) => assert!(roots.len() <= ca_bytes.len() / 64 + 1),
        Err(error) => names(&error, &[&ca]),
    }
    let client_ca = (choice & 0x80 != 0).then_some(ca.as_path());
    match tls::server_config(&cert, &key, client_ca) {
        Ok(config) => {
            assert!(
                certs.is_ok() && loaded_key.is_ok(),
                "a configuration from files that do not load"
            );
            assert_eq!(config.alpn_protocols, vec![tls::ALPN_H2.to_vec()]);
        }
        Err(error) => names(&error, &[&cert, &key, &ca]),
    }
    // A file that is not there is an error naming it.
    let missing = dir.join("missing.pem");
    match tls::load_certs(&missing) {
        Ok(_) => panic!("a missing file loaded"),
        Err(error) => names(&error, &[&missing]),
    }
}

/// The heap a [`session_ticket`] run may use at its peak for `len` bytes.
pub fn session_ticket_alloc_bound(len: usize) -> usize {
    16 * len + 64 * 1024
}

include!("../../fuzz/input.rs");

/// Session tickets (`--tls-session-ticket-key`): keys from a secret and a
/// binding, a clock and a rotation chosen by the bytes, then tickets a
/// client presents, which it controls entirely. Checks: a ticket we did
/// not seal never opens (whatever its bytes, issue time or length); one we
/// sealed opens to the same session in its period and the next, and not
/// two periods later, nor under another binding, nor with any byte
/// changed, nor when it is dated further in the future than the clock
/// skew allows; what opens is never longer than the ticket.
pub fn session_ticket(data: &[u8]) {
    let mut input = Input(data);
    let secret = input.bytes(64);
    let binding = input.bytes(32);
    let rotation = [1u64, 60, 3600, 86_400][usize::from(input.byte() % 4)];
    let start = u64::from_be_bytes({
        let mut b = [0u8; 8];
        for byte in b.iter_mut().skip(2) {
            *byte = input.byte();
        }
        b
    });
    let clock = Arc::new(AtomicU64::new(start));
    let reader = clock.clone();
    let keys = TicketKeys::with_clock(
        secret,
        binding,
        Duration::from_secs(rotation),
        Arc::new(move || reader.load(Ordering::Relaxed)),
    );
    let session = input.bytes(96).to_vec();
    let presented = input.0;
    // A client's own bytes never open (AES-GCM: forging a tag is out of
    // reach, so a success here is a bug in what is checked).
    if let Some(plain) = keys.decrypt(presented) {
        panic!("a ticket we did not seal opened to {} bytes", plain.len());
    }
    let Some(ticket) = keys.encrypt(&session) else {
        return;
    };
    let opened = keys.decrypt(&ticket).expect("our own ticket opens");
    assert_eq!(opened, session);
    assert!(opened.len() <= ticket.len());
    forged_tickets_do_not_open(&keys, &ticket, presented);
    // Under another binding (a rotated CA): nothing opens.
    let other = TicketKeys::with_clock(
        secret,
        &[binding, b"rotated"].concat(),
        Duration::from_secs(rotation),
        Arc::new(move || start),
    );
    assert_eq!(
        other.decrypt(&ticket),
        None,
        "a ticket opened past a CA rotation"
    );
    dated_ahead_opens_within_the_skew(&keys, (&clock, start), rotation, &session, presented);
    // The next period still opens it, the one after does not.
    if let Some(next) = start.checked_add(rotation) {
        clock.store(next, Ordering::Relaxed);
        assert_eq!(keys.decrypt(&ticket).as_deref(), Some(session.as_slice()));
    }
    if let Some(later) = start.checked_add(2 * rotation + rotation) {
        clock.store(later, Ordering::Relaxed);
        assert_eq!(
            keys.decrypt(&ticket),
            None,
            "a ticket opened after two rotations"
        );
    }
}

/// Any byte of `ticket` changed (where `presented` says), or its last
/// byte cut: nothing opens.
fn forged_tickets_do_not_open(keys: &TicketKeys, ticket: &[u8], presented: &[u8]) {
    if presented.is_empty() {
        return;
    }
    let mut forged = ticket.to_vec();
    let at = usize::from(presented[0]) % forged.len();
    forged[at] ^= presented.get(1).copied().unwrap_or(1).max(1);
    assert_eq!(keys.decrypt(&forged), None, "a changed ticket opened");
    assert_eq!(
        keys.decrypt(&ticket[..ticket.len() - 1]),
        None,
        "a cut ticket opened"
    );
}

/// `session` sealed by `clock` set `ahead` seconds past `start` (a
/// replica ahead, or whoever holds the secret dating a ticket in the
/// future; how far, `presented` says): it opens at `start` only within
/// the clock skew, and never beyond it, whatever the period. Leaves
/// `clock` at `start`.
fn dated_ahead_opens_within_the_skew(
    keys: &TicketKeys,
    (clock, start): (&AtomicU64, u64),
    rotation: u64,
    session: &[u8],
    presented: &[u8],
) {
    let choice = u16::from_be_bytes([
        presented.get(2).copied().unwrap_or(0),
        presented.get(3).copied().unwrap_or(0),
    ]);
    let skew = MAX_CLOCK_SKEW.as_secs();
    let ahead = if choice & 0x8000 == 0 {
        u64::from(choice) % (skew + 1)
    } else {
        skew + 1 + u64::from(choice & 0x7fff) % (3 * rotation)
    };
    let Some(at) = start.checked_add(ahead) else {
        return;
    };
    clock.store(at, Ordering::Relaxed);
    let future = keys.encrypt(session).expect("sealed above");
    clock.store(start, Ordering::Relaxed);
    let opened = keys.decrypt(&future);
    if ahead > skew {
        assert_eq!(opened, None, "a ticket dated {ahead} s ahead opened");
    } else {
        assert_eq!(opened.as_deref(), Some(session), "{ahead} s ahead");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    include!("../../fuzz/replay.rs");

    replay!(
        fuzz_corpus_tls_files => tls_files within tls_files_alloc_bound,
        fuzz_corpus_session_ticket => session_ticket within session_ticket_alloc_bound,
    );

    /// The harness reaches a configuration from a real certificate and key.
    #[test]
    fn tls_files_builds_a_configuration_from_a_real_pair() {
        let ca = certs::Ca::new("fuzz CA").unwrap();
        let pair = ca.server_cert("server", &["localhost".to_owned()]).unwrap();
        let cert = pair.cert_pem.as_bytes();
        let mut input = vec![0u8];
        input.extend_from_slice(&u16::try_from(cert.len()).unwrap().to_be_bytes());
        input.extend_from_slice(cert);
        input.extend_from_slice(pair.key_pem.as_bytes());
        tls_files(&input);
        let scratch = Scratch::new();
        let dir = &scratch.0;
        std::fs::write(dir.join("c.pem"), cert).unwrap();
        std::fs::write(dir.join("k.pem"), pair.key_pem.as_bytes()).unwrap();
        assert!(tls::server_config(&dir.join("c.pem"), &dir.join("k.pem"), None).is_ok());
    }

    /// Each run and each test has a directory of its own, gone once it is
    /// done: under `cargo test` the corpus replay and the test above ran
    /// at once in one process, and each deleted the other's files.
    #[test]
    fn each_run_has_a_scratch_directory_of_its_own() {
        let (a, b) = (Scratch::new(), Scratch::new());
        assert_ne!(a.0, b.0);
        assert!(a.0.is_dir() && b.0.is_dir());
        let path = a.0.clone();
        drop(a);
        assert!(!path.exists(), "{} left behind", path.display());
        assert!(b.0.is_dir(), "dropping one removed the other");
    }
}
