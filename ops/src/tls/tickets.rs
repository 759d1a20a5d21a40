//! TLS session tickets that every replica and every restart can open.
//!
//! rustls's own ticketer draws its keys at random, so a restarted server
//! cannot open the tickets it issued before, and every agent of a reconnect
//! storm costs it a full handshake: a private-key signature (about a
//! millisecond of CPU for RSA-2048). [`TicketKeys`] derives its keys instead,
//! with HKDF-SHA256, from
//! - a secret every replica holds (`--tls-session-ticket-key`, or the serving
//!   key itself),
//! - what the ticket is bound to: the CA bundle client certificates must
//!   chain to, so that a session is never resumed past a CA rotation (a
//!   certificate the new bundle would not admit would otherwise come back
//!   without being checked),
//! - and the rotation period the ticket was issued in.
//!
//! A ticket is opened in the period it was issued in and the next one, never
//! later: its lifetime is kept by the keys (as
//! [`rustls::server::ProducesTickets`] asks). It also carries the second it
//! was issued at, authenticated, and is not opened before that second less
//! [`MAX_CLOCK_SKEW`]: a ticket dated in the future (by a replica whose clock
//! runs ahead, or by whoever holds the secret) would otherwise open for up
//! to three periods. Each is sealed with
//! AES-256-GCM under a fresh random nonce. A resumed TLS 1.3 handshake still
//! does an (EC)DHE key exchange (rustls resumes only in `psk_dhe_ke` mode),
//! so traffic keeps forward secrecy; what the secret protects is the
//! resumption itself: whoever holds it and has seen a ticket can resume that
//! session as its client until the ticket's window closes.
//!
//! Only TLS 1.3 sessions are sealed or opened. A TLS 1.2 ticket carries the
//! session's master secret, from which every key of the connection comes:
//! whoever holds the secret and recorded the connection could read it. rustls
//! asks one ticketer for both versions, so [`TicketKeys`] reads the version
//! from the session it is handed (see [`is_tls13`]) and seals nothing else;
//! a TLS 1.2 client then gets an empty ticket, which RFC 5077 (3.3) defines
//! as "no ticket".
//!
//! Whoever holds the secret can also seal a session of their own making,
//! with any client certificate chain or none. The chain a resumed session
//! brings back is therefore verified again ([`verify_resumed`]).

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use ring::{aead, digest, hkdf, rand::SecureRandom};
use rustls::server::danger::ClientCertVerifier;
use rustls_pki_types::UnixTime;

/// What the key derivation says it is for (HKDF salt, with the binding).
/// v2: a ticket starts with the second it was issued at (v1: its period).
const LABEL: &[u8] = b"konnectivity-rs TLS session tickets v2";
/// Bytes of the issue time (seconds since the Unix epoch) at the start of a
/// ticket.
const ISSUED_LEN: usize = 8;
/// The shortest secret accepted: one AES-256 key's worth.
pub const MIN_SECRET_LEN: usize = 32;
/// The longest a ticket may be offered for (RFC 8446 4.6.1: 7 days).
pub const MAX_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// How far in the future a ticket's issue time may be and still open: the
/// clock difference tolerated between the replica that sealed it and the
/// one that opens it. Replicas' clocks are synchronised (NTP keeps them
/// within milliseconds); a ticket refused costs one full handshake.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);

/// Seconds since the Unix epoch; tests give their own.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Session tickets sealed with keys derived from a shared secret; see the
/// module documentation.
pub struct TicketKeys {
    /// HKDF's pseudo-random key, from the secret and the binding.
    prk: hkdf::Prk,
    /// Seconds per key; a ticket is opened for at most two of them.
    rotation: u64,
    /// Now, in seconds.
    clock: Clock,
}

impl std::fmt::Debug for TicketKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TicketKeys")
            .field("rotation", &self.rotation)
            .finish_non_exhaustive()
    }
}

impl TicketKeys {
    /// Keys from `secret`, bound to `binding` (the client CA bundle's bytes,
    /// or nothing), rotated every `rotation` (at least a second).
    pub fn new(secret: &[u8], binding: &[u8], rotation: Duration) -> Self {
        Self::with_clock(secret, binding, rotation, Arc::new(unix_now))
    }

    /// [`new`](Self::new) reading the time from `clock`.
    pub fn with_clock(secret: &[u8], binding: &[u8], rotation: Duration, clock: Clock) -> Self {
        let mut salt = digest::Context::new(&digest::SHA256);
        salt.update(LABEL);
        salt.update(digest::digest(&digest::SHA256, binding).as_ref());
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt.finish().as_ref()).extract(secret);
        Self {
            prk,
            rotation: rotation.as_secs().max(1),
            clock,
        }
    }

    /// The key of `period`.
    fn key(&self, period: u64) -> aead::LessSafeKey {
        let info = period.to_be_bytes();
        let info = [info.as_slice()];
        let okm = self
            .prk
            .expand(&info, &aead::AES_256_GCM)
            .expect("32 bytes is within HKDF-SHA256's output limit");
        aead::LessSafeKey::new(aead::UnboundKey::from(okm))
    }
}

impl rustls::server::ProducesTickets for TicketKeys {
    fn enabled(&self) -> bool {
        true
    }

    /// A ticket is offered for one rotation after it is issued (clients
    /// drop it then), never more than [`MAX_LIFETIME`], and opened for at
    /// most two rotations.
    fn lifetime(&self) -> u32 {
        u32::try_from(self.rotation.min(MAX_LIFETIME.as_secs())).unwrap_or(u32::MAX)
    }

    /// `issued ‖ nonce ‖ AES-256-GCM(plain)`, the issue time
    /// authenticated; a session other than TLS 1.3 is not sealed.
    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        if !is_tls13(plain) {
            return None;
        }
        self.seal(plain)
    }

    /// Opens a ticket of this period or the one before, not dated in the
    /// future, of a TLS 1.3 session; anything else, whatever its bytes, is
    /// `None` (a full handshake).
    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.open(cipher).filter(|plain| is_tls13(plain))
    }
}

impl TicketKeys {
    /// `issued ‖ nonce ‖ AES-256-GCM(plain)` under the key of the period
    /// `issued` falls in, the issue time authenticated.
    fn seal(&self, plain: &[u8]) -> Option<Vec<u8>> {
        // One reading of the clock: the time named and the key used must
        // be the same at a boundary.
        let now = (self.clock)();
        let issued = now.to_be_bytes();
        let mut nonce = [0u8; aead::NONCE_LEN];
        ring::rand::SystemRandom::new().fill(&mut nonce).ok()?;
        let mut out =
            Vec::with_capacity(ISSUED_LEN + nonce.len() + plain.len() + aead::MAX_TAG_LEN);
        out.extend_from_slice(&issued);
        out.extend_from_slice(&nonce);
        let mut sealed = plain.to_vec();
        self.key(now / self.rotation)
            .seal_in_place_append_tag(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(issued),
                &mut sealed,
            )
            .ok()?;
        out.extend_from_slice(&sealed);
        Some(out)
    }

    /// Opens a ticket issued in this period or the one before, and not
    /// after now plus [`MAX_CLOCK_SKEW`].
    fn open(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        let (issued_bytes, rest) = cipher.split_first_chunk::<ISSUED_LEN>()?;
        let (nonce, sealed) = rest.split_first_chunk::<{ aead::NONCE_LEN }>()?;
        let issued = u64::from_be_bytes(*issued_bytes);
        let now = (self.clock)();
        // Dated in the future: refused, beyond the clock skew between
        // replicas (which also covers a replica a little ahead at a
        // period boundary).
        if issued > now.saturating_add(MAX_CLOCK_SKEW.as_secs()) {
            return None;
        }
        // Issued two periods ago or earlier: refused.
        let period = issued / self.rotation;
        if period.saturating_add(1) < now / self.rotation {
            return None;
        }
        let mut plain = sealed.to_vec();
        let opened = self
            .key(period)
            .open_in_place(
                aead::Nonce::assume_unique_for_key(*nonce),
                aead::Aad::from(*issued_bytes),
                &mut plain,
            )
            .ok()?
            .len();
        plain.truncate(opened);
        Some(plain)
    }
}

/// Whether `session`, as rustls hands it to a ticketer, is a TLS 1.3 one.
///
/// rustls encodes a session (its `ServerSessionValue`) as: the server name
/// if any (a byte 1 and the name with a one-byte length, or a byte 0), then
/// the protocol version and the cipher suite, two bytes each. A session is
/// TLS 1.3 only if it says version 0x0304 and a TLS 1.3 suite (0x13xx), so
/// that an encoding this code does not know seals nothing rather than a
/// master secret (the tests of this crate and of the server catch such a
/// change: TLS 1.3 resumption would stop).
pub fn is_tls13(session: &[u8]) -> bool {
    let after_name = match session.split_first() {
        Some((0, rest)) => Some(rest),
        Some((1, rest)) => rest
            .split_first()
            .and_then(|(len, name)| name.get(usize::from(*len)..)),
        _ => None,
    };
    matches!(after_name, Some([0x03, 0x04, 0x13, _, ..]))
}

/// Why a resumed session is refused.
#[derive(Debug, thiserror::Error)]
pub enum ResumedError {
    /// The session brings back no client certificate chain, although client
    /// certificates are required: its ticket did not come from a handshake
    /// of this listener.
    #[error("the resumed session carries no client certificate")]
    NoChain,
    /// The chain does not verify against the client CA as it is now.
    #[error("the resumed session's client certificate does not verify")]
    Invalid(#[source] rustls::Error),
}

/// Verifies again the client certificate chain that a resumed session
/// brings back, with `verifier` (the listener's client CA as it is now) as a
/// full handshake would: its signatures up to the CA, the dates at `now`,
/// the client-auth usage. A full handshake, or a listener without client
/// certificates (`verifier` `None`), passes: rustls verified the former,
/// the latter has nothing to verify.
///
/// rustls resumes a session from its ticket alone: whoever holds the
/// ticket secret can make one with any chain, or none, and a certificate
/// that has expired, or a CA that has changed, since the first handshake
/// would otherwise come back unchecked.
///
/// # Errors
/// [`ResumedError`]: no chain, or one that does not verify.
pub fn verify_resumed(
    connection: &rustls::ServerConnection,
    verifier: Option<&dyn ClientCertVerifier>,
    now: UnixTime,
) -> Result<(), ResumedError> {
    let Some(verifier) = verifier else {
        return Ok(());
    };
    if connection.handshake_kind() != Some(rustls::HandshakeKind::Resumed) {
        return Ok(());
    }
    let Some((end_entity, intermediates)) = connection
        .peer_certificates()
        .and_then(|chain| chain.split_first())
    else {
        return Err(ResumedError::NoChain);
    };
    verifier
        .verify_client_cert(end_entity, intermediates, now)
        .map(|_| ())
        .map_err(ResumedError::Invalid)
}

/// Seconds since the Unix epoch (0 for a clock before it).
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use rustls::server::ProducesTickets;

    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const HOUR: Duration = Duration::from_secs(3600);
    /// The start of a TLS 1.3 session as rustls encodes it: no server name,
    /// TLS 1.3, TLS_AES_128_GCM_SHA256, then the rest.
    const SESSION: &[u8] = &[0, 0x03, 0x04, 0x13, 0x01, 32, 1, 2, 3];
    /// The same for TLS 1.2 (TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256).
    const TLS12_SESSION: &[u8] = &[0, 0x03, 0x03, 0xc0, 0x2b, 48, 1, 2, 3];

    /// Keys whose clock the test moves.
    fn keys(secret: &[u8], binding: &[u8], now: &Arc<AtomicU64>) -> TicketKeys {
        let now = now.clone();
        TicketKeys::with_clock(
            secret,
            binding,
            HOUR,
            Arc::new(move || now.load(Ordering::Relaxed)),
        )
    }

    #[test]
    fn another_instance_with_the_secret_opens_a_ticket() {
        let now = Arc::new(AtomicU64::new(10 * 3600 + 5));
        let ticket = keys(SECRET, b"ca", &now).encrypt(SESSION).unwrap();
        // A restart, or another replica.
        let again = keys(SECRET, b"ca", &now);
        assert_eq!(again.decrypt(&ticket).as_deref(), Some(SESSION));
        assert_eq!(again.lifetime(), 3600);
    }

    #[test]
    fn a_ticket_is_opened_in_its_period_and_the_next_only() {
        let now = Arc::new(AtomicU64::new(10 * 3600 + 3599));
        let keys = keys(SECRET, b"ca", &now);
        let ticket = keys.encrypt(SESSION).unwrap();
        now.store(11 * 3600, Ordering::Relaxed);
        assert!(keys.decrypt(&ticket).is_some(), "the next period");
        now.store(11 * 3600 + 3599, Ordering::Relaxed);
        assert!(
            keys.decrypt(&ticket).is_some(),
            "the end of the next period"
        );
        now.store(12 * 3600, Ordering::Relaxed);
        assert_eq!(keys.decrypt(&ticket), None, "two periods on");
    }

    /// A ticket issued later than now (by a replica whose clock is ahead,
    /// or by whoever holds the secret) opens only within the clock skew:
    /// it would otherwise live for up to three periods.
    #[test]
    fn a_ticket_dated_in_the_future_is_refused() {
        let now = Arc::new(AtomicU64::new(10 * 3600 + 100));
        let keys = keys(SECRET, b"ca", &now);
        let skew = MAX_CLOCK_SKEW.as_secs();
        let sealed_at = |at: u64| {
            now.store(at, Ordering::Relaxed);
            let ticket = keys.encrypt(SESSION).unwrap();
            now.store(10 * 3600 + 100, Ordering::Relaxed);
            ticket
        };
        // One period ahead, and one second past the skew in this period.
        assert_eq!(keys.decrypt(&sealed_at(11 * 3600 + 100)), None);
        assert_eq!(keys.decrypt(&sealed_at(10 * 3600 + 101 + skew)), None);
        // Within the skew, in this period and across its end.
        assert!(keys.decrypt(&sealed_at(10 * 3600 + 100 + skew)).is_some());
        now.store(11 * 3600 + 5, Ordering::Relaxed);
        let boundary = keys.encrypt(SESSION).unwrap();
        now.store(11 * 3600 - 10, Ordering::Relaxed);
        assert!(
            keys.decrypt(&boundary).is_some(),
            "a replica 15 s ahead, across a period's end"
        );
        // An issue time moved forward in the bytes is refused too (its
        // tag no longer matches, or it is past the skew).
        let mut moved = sealed_at(10 * 3600 + 100);
        moved[..ISSUED_LEN].copy_from_slice(&(11u64 * 3600).to_be_bytes());
        assert_eq!(keys.decrypt(&moved), None);
    }

    #[test]
    fn another_binding_or_secret_does_not_open_it() {
        let now = Arc::new(AtomicU64::new(3600 * 5));
        let ticket = keys(SECRET, b"old ca", &now).encrypt(SESSION).unwrap();
        assert_eq!(keys(SECRET, b"new ca", &now).decrypt(&ticket), None);
        let other = b"another secret of thirty-two byte";
        assert_eq!(keys(other, b"old ca", &now).decrypt(&ticket), None);
    }

    #[test]
    fn a_changed_byte_or_a_moved_period_is_refused() {
        let now = Arc::new(AtomicU64::new(3600 * 5));
        let keys = keys(SECRET, b"ca", &now);
        let ticket = keys.encrypt(SESSION).unwrap();
        for at in [0, 7, 8, 19, 20, ticket.len() - 1] {
            let mut bad = ticket.clone();
            bad[at] ^= 1;
            // Period bytes moved by one stay in the window: the AEAD refuses.
            assert_eq!(keys.decrypt(&bad), None, "byte {at} changed");
        }
        for len in 0..ticket.len() {
            assert_eq!(keys.decrypt(&ticket[..len]), None, "cut to {len}");
        }
        assert_eq!(keys.decrypt(&[0xff; 64]), None);
    }

    #[test]
    fn two_tickets_of_one_session_differ() {
        let now = Arc::new(AtomicU64::new(3600 * 5));
        let keys = keys(SECRET, b"ca", &now);
        assert_ne!(keys.encrypt(SESSION), keys.encrypt(SESSION));
    }

    #[test]
    fn the_version_is_read_after_the_server_name() {
        assert!(is_tls13(SESSION));
        assert!(!is_tls13(TLS12_SESSION));
        let named = |name: &[u8], rest: &[u8]| {
            let mut session = vec![1, u8::try_from(name.len()).unwrap()];
            session.extend_from_slice(name);
            session.extend_from_slice(rest);
            session
        };
        assert!(is_tls13(&named(b"localhost", &SESSION[1..])));
        assert!(!is_tls13(&named(b"localhost", &TLS12_SESSION[1..])));
        // A name whose bytes look like TLS 1.3 does not fool it.
        assert!(!is_tls13(&named(&[3, 4, 0x13, 1], &TLS12_SESSION[1..])));
        // TLS 1.3 with a suite that is not, and anything unknown or cut.
        assert!(!is_tls13(&[0, 0x03, 0x04, 0xc0, 0x2b, 0]));
        for bad in [&[][..], &[2, 3, 4, 0x13, 1], &[0, 3, 4], &[1, 9, 1, 2]] {
            assert!(!is_tls13(bad), "{bad:?}");
        }
    }

    /// A TLS 1.2 ticket would carry the master secret: none is sealed, and
    /// one sealed with the secret anyway is not opened.
    #[test]
    fn tls12_sessions_are_neither_sealed_nor_opened() {
        let now = Arc::new(AtomicU64::new(3600 * 5));
        let keys = keys(SECRET, b"ca", &now);
        assert_eq!(keys.encrypt(TLS12_SESSION), None);
        let forged = keys.seal(TLS12_SESSION).unwrap();
        assert_eq!(keys.decrypt(&forged), None);
        let ticket = keys.encrypt(SESSION).unwrap();
        assert_eq!(keys.decrypt(&ticket).as_deref(), Some(SESSION));
    }

    #[test]
    fn a_ticket_is_never_offered_for_more_than_seven_days() {
        let now = Arc::new(AtomicU64::new(0));
        let week = TicketKeys::with_clock(SECRET, b"", 2 * MAX_LIFETIME, {
            let now = now.clone();
            Arc::new(move || now.load(Ordering::Relaxed))
        });
        assert_eq!(week.lifetime(), 604_800);
    }
}
