//! The cluster's service-account signing keys, as the kube API publishes
//! them (`GET /openid/v1/jwks`, a JWK set: RFC 7517 §5), and what they say
//! of a token's signature before any review.
//!
//! kube-apiserver names each key by a hash of its public key (`kid`) and
//! writes that name in the header of every token it signs (RS256 for an
//! RSA key, ES256 or ES384 for an EC key). So:
//! - a token whose `kid` names a key held here, with an algorithm that key
//!   signs with, is [`Signature::Valid`] if its signature verifies under
//!   that key and [`Signature::Forged`] if it does not: no API would admit
//!   it, and it is refused without a review;
//! - anything else is [`Signature::Unknown`] (no `kid`, a `kid` not held
//!   here, as after a key rotation not read yet, an algorithm not checked
//!   here, no keys read at all) and is reviewed as any token is.
//!
//! A valid signature proves the cluster made the token, not that it is
//! still good (its pod may be gone): the review stays the authority. What
//! it buys is the right to wait: a peer slowed for failing reviews still
//! has its connects with signed tokens reviewed, in turn ([`super::peers`]),
//! since no flood can sign its tokens.
//!
//! Keys with parameters ring does not verify with (an RSA modulus outside
//! 2,048 to 8,192 bits, an exponent over 32 bits, curves other than P-256
//! and P-384) are left out, so that their tokens are reviewed rather than
//! judged forged. At most [`MAX_KEYS`] keys are read.

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
    time::Duration,
};

use ring::signature::{self, RsaPublicKeyComponents, UnparsedPublicKey};
use serde::Deserialize;
use tokio::time::Instant;
use tracing::{info, warn};

use super::claims::decode;

/// Where kube-apiserver publishes the keys (readable by every service
/// account by default: ClusterRole `system:service-account-issuer-discovery`).
pub const JWKS_PATH: &str = "/openid/v1/jwks";
/// The most keys read from one set (clusters hold one or two).
pub const MAX_KEYS: usize = 64;
/// How long after a read of the keys a token they cannot judge makes
/// them read again (a key rotated in since, or keys never read).
pub const REREAD_AFTER: Duration = Duration::from_secs(60);

/// What a token's signature says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Signature {
    /// It verifies under the cluster's key its header names.
    Valid,
    /// Its header names a cluster key, and it does not verify under it.
    Forged {
        /// The key's id.
        kid: String,
    },
    /// Not judged here: see the module documentation.
    Unknown,
}

/// A public key and the algorithms it verifies.
#[derive(Debug)]
enum Key {
    /// RSA: the modulus and exponent, big-endian.
    Rsa { n: Vec<u8>, e: Vec<u8> },
    /// ECDSA: the curve's JWS algorithm (`ES256`, `ES384`) and the point,
    /// uncompressed.
    Ec { alg: &'static str, point: Vec<u8> },
}

impl Key {
    /// Whether `signature` over `message` verifies with `alg`; `None` if
    /// this key does not sign with `alg`.
    fn verifies(&self, alg: &str, message: &[u8], signature: &[u8]) -> Option<bool> {
        match self {
            Self::Rsa { n, e } => {
                let params = match alg {
                    "RS256" => &signature::RSA_PKCS1_2048_8192_SHA256,
                    "RS384" => &signature::RSA_PKCS1_2048_8192_SHA384,
                    "RS512" => &signature::RSA_PKCS1_2048_8192_SHA512,
                    _ => return None,
                };
                let key = RsaPublicKeyComponents { n, e };
                Some(key.verify(params, message, signature).is_ok())
            }
            Self::Ec { alg: own, point } => {
                if alg != *own {
                    return None;
                }
                let algorithm = match alg {
                    "ES256" => &signature::ECDSA_P256_SHA256_FIXED,
                    _ => &signature::ECDSA_P384_SHA384_FIXED,
                };
                let key = UnparsedPublicKey::new(algorithm, point);
                Some(key.verify(message, signature).is_ok())
            }
        }
    }
}

/// One JWK as the set holds it; fields this reader does not use are
/// ignored.
#[derive(Deserialize)]
struct Jwk {
    kty: Option<String>,
    kid: Option<String>,
    #[serde(rename = "use")]
    usage: Option<String>,
    n: Option<String>,
    e: Option<String>,
    crv: Option<String>,
    x: Option<String>,
    y: Option<String>,
}

/// A JWK set.
#[derive(Deserialize)]
struct Jwks {
    keys: Vec<serde_json::Value>,
}

impl Jwk {
    /// Its id and key, if it is a signing key ring verifies with.
    fn read(self) -> Option<(String, Key)> {
        if self.usage.as_deref().is_some_and(|u| u != "sig") {
            return None;
        }
        let kid = self.kid.filter(|kid| !kid.is_empty())?;
        let key = match self.kty.as_deref()? {
            "RSA" => {
                let n = strip_zeros(decode(self.n.as_deref()?)?);
                let e = strip_zeros(decode(self.e.as_deref()?)?);
                let bits = n.len() * 8 - n.first().map_or(8, |b| b.leading_zeros() as usize);
                if !(2048..=8192).contains(&bits) || e.is_empty() || e.len() > 4 {
                    return None;
                }
                Key::Rsa { n, e }
            }
            "EC" => {
                let (alg, size) = match self.crv.as_deref()? {
                    "P-256" => ("ES256", 32),
                    "P-384" => ("ES384", 48),
                    _ => return None,
                };
                let (x, y) = (decode(self.x.as_deref()?)?, decode(self.y.as_deref()?)?);
                if x.len() != size || y.len() != size {
                    return None;
                }
                let point = [&[4u8][..], &x, &y].concat();
                Key::Ec { alg, point }
            }
            _ => return None,
        };
        Some((kid, key))
    }
}

/// The cluster's signing keys by id; see the module documentation.
#[derive(Debug, Default)]
pub(crate) struct SigningKeys {
    /// Keys by `kid`.
    by_id: HashMap<String, Key>,
}

impl SigningKeys {
    /// The keys of a JWK set (the body of [`JWKS_PATH`]): those ring
    /// verifies with, at most [`MAX_KEYS`].
    ///
    /// # Errors
    /// The body is not a JSON object with a `keys` array.
    pub(crate) fn from_jwks(body: &[u8]) -> Result<Self, String> {
        // serde's message may quote the body: only the error's place.
        let set: Jwks = serde_json::from_slice(body).map_err(|e| {
            format!(
                "not a JWK set (a JSON object with a keys array): {:?} error at line {} column {}",
                e.classify(),
                e.line(),
                e.column()
            )
        })?;
        let by_id = set
            .keys
            .into_iter()
            .filter_map(|jwk| serde_json::from_value::<Jwk>(jwk).ok()?.read())
            .take(MAX_KEYS)
            .collect();
        Ok(Self { by_id })
    }

    /// How many keys are held.
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// What the cluster's keys say of `token`'s signature.
    pub(crate) fn judge(&self, token: &str) -> Signature {
        let Some((message, signature)) = token.rsplit_once('.') else {
            return Signature::Unknown;
        };
        let Some(header) = message.split('.').next().and_then(decode) else {
            return Signature::Unknown;
        };
        let Ok(header) = serde_json::from_slice::<Header>(&header) else {
            return Signature::Unknown;
        };
        let (Some(alg), Some(kid)) = (header.alg, header.kid) else {
            return Signature::Unknown;
        };
        let Some(key) = self.by_id.get(&kid) else {
            return Signature::Unknown;
        };
        let signature = decode(signature).unwrap_or_default();
        match key.verifies(&alg, message.as_bytes(), &signature) {
            Some(true) => Signature::Valid,
            Some(false) => Signature::Forged { kid },
            None => Signature::Unknown,
        }
    }
}

/// The keys last read, read again when they cannot judge a token, at
/// most once per [`REREAD_AFTER`] and by one check at a time (the others
/// go on with the keys held).
#[derive(Default)]
pub(crate) struct ClusterKeys {
    /// The keys last read.
    held: RwLock<Arc<SigningKeys>>,
    /// When a read last started, and why it failed if it did (logged once
    /// per new reason).
    reading: tokio::sync::Mutex<(Option<Instant>, Option<String>)>,
}

impl ClusterKeys {
    /// What the cluster's keys say of `token`'s signature; when the keys
    /// held cannot judge it and a read is due, `read` fetches the JWK set
    /// first.
    ///
    /// # Cancel safety
    /// Dropping the future drops its read; the next one is due
    /// [`REREAD_AFTER`] after it started.
    pub(crate) async fn judge<F>(&self, token: &str, read: F) -> Signature
    where
        F: AsyncFnOnce() -> Result<Vec<u8>, String>,
    {
        let held = self
            .held
            .read()
            .map_or_else(|e| e.into_inner().clone(), |k| k.clone());
        let signature = held.judge(token);
        if signature != Signature::Unknown {
            return signature;
        }
        let Ok(mut reading) = self.reading.try_lock() else {
            return signature;
        };
        let (last, failed) = &mut *reading;
        if last.is_some_and(|at| at.elapsed() < REREAD_AFTER) {
            return signature;
        }
        *last = Some(Instant::now());
        match read().await.and_then(|body| SigningKeys::from_jwks(&body)) {
            Ok(keys) => {
                if failed.take().is_some() || keys.len() != held.len() {
                    info!(
                        keys = keys.len(),
                        "read the cluster's service-account signing keys from {JWKS_PATH}"
                    );
                }
                let keys = Arc::new(keys);
                *self.held.write().unwrap_or_else(|e| e.into_inner()) = keys.clone();
                keys.judge(token)
            }
            Err(reason) => {
                if failed.as_ref() != Some(&reason) {
                    warn!(
                        %reason,
                        "cannot read the cluster's service-account signing keys from {JWKS_PATH}; \
                         tokens are reviewed without a signature check, and a slowed peer's signed \
                         tokens are capped as others (grant proxy-server's user get on that path: \
                         deploy/rbac.yaml)"
                    );
                }
                *failed = Some(reason);
                signature
            }
        }
    }
}

/// The header fields a judgement reads.
#[derive(Deserialize)]
struct Header {
    alg: Option<String>,
    kid: Option<String>,
}

/// `bytes` without leading zero bytes (a JWK's big-endian integers may
/// carry them).
fn strip_zeros(mut bytes: Vec<u8>) -> Vec<u8> {
    let zeros = bytes.iter().take_while(|&&b| b == 0).count();
    bytes.drain(..zeros);
    bytes
}

#[cfg(test)]
mod tests {
    use ring::{
        rand::SystemRandom,
        signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair, RSA_PKCS1_SHA256},
    };

    use base64::Engine as _;

    use super::*;

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    /// A 2,048-bit RSA key made once with
    /// `openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048`
    /// (ring signs with RSA keys but does not make them).
    const RSA_KEY: &str = include_str!("testdata/rsa-2048.pk8.pem");

    fn rsa_pair() -> signature::RsaKeyPair {
        let der = RSA_KEY
            .lines()
            .filter(|line| !line.starts_with("-----"))
            .collect::<String>();
        let der = base64::engine::general_purpose::STANDARD
            .decode(der)
            .unwrap();
        signature::RsaKeyPair::from_pkcs8(&der).unwrap()
    }

    fn ec_pair() -> EcdsaKeyPair {
        let rng = SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng).unwrap()
    }

    fn rsa_jwk(pair: &signature::RsaKeyPair, kid: &str) -> serde_json::Value {
        let public = pair.public().modulus_len();
        assert_eq!(public, 256);
        let components: RsaPublicKeyComponents<Vec<u8>> = pair.public().into();
        serde_json::json!({
            "use": "sig", "kty": "RSA", "kid": kid, "alg": "RS256",
            // A leading zero byte, as some writers keep the sign byte.
            "n": b64(&[&[0u8][..], &components.n].concat()),
            "e": b64(&components.e),
        })
    }

    fn ec_jwk(pair: &EcdsaKeyPair, kid: &str) -> serde_json::Value {
        let point = pair.public_key().as_ref();
        serde_json::json!({
            "use": "sig", "kty": "EC", "kid": kid, "alg": "ES256", "crv": "P-256",
            "x": b64(&point[1..33]), "y": b64(&point[33..]),
        })
    }

    fn keys(jwks: &[serde_json::Value]) -> SigningKeys {
        SigningKeys::from_jwks(serde_json::json!({ "keys": jwks }).to_string().as_bytes()).unwrap()
    }

    fn unsigned(alg: &str, kid: &str) -> String {
        let header = b64(serde_json::json!({ "alg": alg, "kid": kid })
            .to_string()
            .as_bytes());
        format!(
            "{header}.{}",
            b64(br#"{"aud":["system:konnectivity-server"]}"#)
        )
    }

    fn rsa_token(pair: &signature::RsaKeyPair, kid: &str) -> String {
        let message = unsigned("RS256", kid);
        let mut signature = vec![0; pair.public().modulus_len()];
        pair.sign(
            &RSA_PKCS1_SHA256,
            &SystemRandom::new(),
            message.as_bytes(),
            &mut signature,
        )
        .unwrap();
        format!("{message}.{}", b64(&signature))
    }

    fn ec_token(pair: &EcdsaKeyPair, kid: &str) -> String {
        let message = unsigned("ES256", kid);
        let signature = pair.sign(&SystemRandom::new(), message.as_bytes()).unwrap();
        format!("{message}.{}", b64(signature.as_ref()))
    }

    /// `token` with one bit of its signature flipped.
    fn tampered(token: &str) -> String {
        let (message, signature) = token.rsplit_once('.').unwrap();
        let mut bytes = decode(signature).unwrap();
        bytes[0] ^= 1;
        format!("{message}.{}", b64(&bytes))
    }

    #[test]
    fn a_token_signed_by_a_cluster_key_is_valid_and_a_tampered_one_forged() {
        let (rsa, ec) = (rsa_pair(), ec_pair());
        let keys = keys(&[rsa_jwk(&rsa, "rsa-key"), ec_jwk(&ec, "ec-key")]);
        assert_eq!(keys.len(), 2);
        for (token, kid) in [
            (rsa_token(&rsa, "rsa-key"), "rsa-key"),
            (ec_token(&ec, "ec-key"), "ec-key"),
        ] {
            assert_eq!(keys.judge(&token), Signature::Valid);
            let forged = Signature::Forged {
                kid: kid.to_owned(),
            };
            assert_eq!(keys.judge(&tampered(&token)), forged);
        }
        // Signed by another key under a held key's name.
        let other = ec_pair();
        assert_eq!(
            keys.judge(&ec_token(&other, "ec-key")),
            Signature::Forged {
                kid: "ec-key".to_owned()
            }
        );
        // No signature at all.
        let bare = format!("{}.", unsigned("ES256", "ec-key"));
        assert!(matches!(keys.judge(&bare), Signature::Forged { .. }));
    }

    #[test]
    fn what_the_keys_cannot_judge_is_unknown() {
        let ec = ec_pair();
        let keys = keys(&[ec_jwk(&ec, "ec-key")]);
        let signed = ec_token(&ec, "ec-key");
        let cases = [
            // A key not read yet (rotated in since).
            ec_token(&ec, "another-key"),
            // An algorithm the key does not sign with.
            format!("{}.c2ln", unsigned("RS256", "ec-key")),
            format!("{}.c2ln", unsigned("none", "ec-key")),
            // No kid.
            format!(
                "{}.{}",
                b64(br#"{"alg":"ES256"}"#),
                signed.split_once('.').unwrap().1
            ),
            // Not a JWS.
            "not-a-token".to_owned(),
        ];
        for token in cases {
            assert_eq!(keys.judge(&token), Signature::Unknown, "{token}");
        }
        assert_eq!(
            SigningKeys::default().judge(&signed),
            Signature::Unknown,
            "no keys read"
        );
    }

    #[test]
    fn keys_ring_cannot_verify_with_are_left_out() {
        let ec = ec_pair();
        let point = ec.public_key().as_ref();
        let jwks = [
            // A 1,024-bit modulus.
            serde_json::json!({"kty": "RSA", "kid": "small", "n": b64(&[0xc5; 128]), "e": "AQAB"}),
            // An exponent of 40 bits.
            serde_json::json!({"kty": "RSA", "kid": "big-e", "n": b64(&[0xc5; 256]), "e": b64(&[1; 5])}),
            serde_json::json!({"kty": "EC", "kid": "p521", "crv": "P-521", "x": "AA", "y": "AA"}),
            serde_json::json!({"kty": "EC", "kid": "short", "crv": "P-256", "x": b64(&point[1..32]), "y": b64(&point[33..])}),
            serde_json::json!({"kty": "EC", "kid": "enc", "use": "enc", "crv": "P-256", "x": b64(&point[1..33]), "y": b64(&point[33..])}),
            serde_json::json!({"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"}),
            serde_json::json!({"kty": "EC", "crv": "P-256", "x": b64(&point[1..33]), "y": b64(&point[33..])}),
            serde_json::json!("not an object"),
        ];
        assert_eq!(keys(&jwks).len(), 0);
        let many: Vec<_> = (0..100).map(|n| ec_jwk(&ec, &format!("k{n}"))).collect();
        assert_eq!(keys(&many).len(), MAX_KEYS);
    }

    #[test]
    fn a_body_that_is_not_a_set_names_what_it_lacks() {
        for body in [&b"[]"[..], b"{}", b"<html>", b"{\"keys\": 1}"] {
            let error = SigningKeys::from_jwks(body).unwrap_err();
            assert!(error.contains("not a JWK set"), "{error}");
        }
    }
}
