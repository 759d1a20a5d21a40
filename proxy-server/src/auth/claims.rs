//! What a token says of itself, read without checking its signature: the
//! checks made before a TokenReview (`--token-review-local-checks`), and
//! the expiry that bounds how long a review's answer is kept.
//!
//! A Kubernetes service-account token is a JWS in compact form (RFC 7515
//! §7.1): three base64url segments joined by dots, a JSON object header, a
//! JSON object of claims (RFC 7519), a signature. Before a review, a token
//! is refused here when kube-apiserver's service-account authenticator
//! would refuse it whatever its signature:
//! - not three non-empty base64url segments (trailing `=` allowed, as
//!   go-jose trims them), or a header or claims that are not JSON objects;
//! - an `aud` that is neither a string nor an array of strings, or `exp`,
//!   `nbf` that are not numbers (`null` counts as absent, as in Go);
//! - an `aud` that does not name the audience, when one is required (a
//!   token without `aud`, a legacy secret-based token, is refused too);
//! - `exp` more than [`CLOCK_SKEW`] in the past, `nbf` more than
//!   [`CLOCK_SKEW`] in the future.
//!
//! The review stays the authority: a token these checks pass may still be
//! refused by it. The error text never quotes the token nor its claims.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use serde_json::{Map, Value};

/// How far `exp` may be past and `nbf` ahead of this server's clock:
/// kube-apiserver allows 1 minute (go-jose's `DefaultLeeway`), and its
/// clock and ours may differ by a few more. The checks only spare the API
/// tokens no clock could make valid: a larger skew costs nothing.
pub const CLOCK_SKEW: Duration = Duration::from_secs(300);

/// Why a token cannot be a valid service-account token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimsError {
    /// Not a JWT, or claims of the wrong type: says which part.
    #[error("the token is not a JWT: {0}")]
    Malformed(&'static str),
    /// `aud` does not name the audience.
    #[error("the token's aud claim does not name {want:?}")]
    Audience {
        /// The audience required (`--authentication-audience`).
        want: String,
    },
    /// `exp` is past, by more than the skew.
    #[error("the token expired {ago:?} ago (its exp claim; {CLOCK_SKEW:?} of clock skew allowed)")]
    Expired {
        /// How long ago, in whole seconds.
        ago: Duration,
    },
    /// `nbf` is ahead, by more than the skew.
    #[error(
        "the token is not valid for another {wait:?} (its nbf claim; {CLOCK_SKEW:?} of clock skew allowed)"
    )]
    NotYetValid {
        /// How long until it is, in whole seconds.
        wait: Duration,
    },
}

/// The claims of a JWT-shaped token.
#[derive(Debug)]
pub(crate) struct Claims {
    /// The claims object.
    claims: Map<String, Value>,
}

impl Claims {
    /// Reads `token` as a compact JWS whose header and payload are JSON
    /// objects.
    ///
    /// # Errors
    /// [`ClaimsError::Malformed`], naming the part that is not right.
    pub(crate) fn read(token: &str) -> Result<Self, ClaimsError> {
        let mut segments = token.split('.');
        let (Some(header), Some(payload), Some(signature), None) = (
            segments.next(),
            segments.next(),
            segments.next(),
            segments.next(),
        ) else {
            return Err(ClaimsError::Malformed("not three dot-separated segments"));
        };
        let header = decode(header).ok_or(ClaimsError::Malformed("its header is not base64url"))?;
        let payload =
            decode(payload).ok_or(ClaimsError::Malformed("its payload is not base64url"))?;
        if decode(signature).is_none_or(|s| s.is_empty()) {
            return Err(ClaimsError::Malformed(
                "its signature is empty or not base64url",
            ));
        }
        serde_json::from_slice::<Map<String, Value>>(&header)
            .map_err(|_| ClaimsError::Malformed("its header is not a JSON object"))?;
        let claims = serde_json::from_slice::<Map<String, Value>>(&payload)
            .map_err(|_| ClaimsError::Malformed("its payload is not a JSON object"))?;
        Ok(Self { claims })
    }

    /// The checks before a review, at `now`: `aud` names `audience` (unless
    /// it is empty: none required), `exp` and `nbf` hold within
    /// [`CLOCK_SKEW`].
    ///
    /// # Errors
    /// The first check that fails.
    pub(crate) fn check(&self, audience: &str, now: SystemTime) -> Result<(), ClaimsError> {
        let audiences = self.audiences()?;
        let exp = self.date("exp", "its exp claim is not a number")?;
        let nbf = self.date("nbf", "its nbf claim is not a number")?;
        if !audience.is_empty() && !audiences.contains(&audience) {
            return Err(ClaimsError::Audience {
                want: audience.to_owned(),
            });
        }
        let now = unix_seconds(now);
        let skew = CLOCK_SKEW.as_secs_f64();
        if let Some(exp) = exp
            && exp + skew < now
        {
            return Err(ClaimsError::Expired {
                ago: whole_seconds(now - exp),
            });
        }
        if let Some(nbf) = nbf
            && nbf - skew > now
        {
            return Err(ClaimsError::NotYetValid {
                wait: whole_seconds(nbf - now),
            });
        }
        Ok(())
    }

    /// When the token expires (`exp`), if it says and it is a time.
    pub(crate) fn expiry(&self) -> Option<SystemTime> {
        let exp = self.date("exp", "").ok()??;
        let after = Duration::try_from_secs_f64(exp).ok()?;
        SystemTime::UNIX_EPOCH.checked_add(after)
    }

    /// The `aud` claim: a string, an array of strings, or absent.
    fn audiences(&self) -> Result<Vec<&str>, ClaimsError> {
        const NOT_STRINGS: ClaimsError =
            ClaimsError::Malformed("its aud claim is not a string or an array of strings");
        match self.claims.get("aud") {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(one)) => Ok(vec![one.as_str()]),
            Some(Value::Array(many)) => {
                many.iter().map(|a| a.as_str().ok_or(NOT_STRINGS)).collect()
            }
            Some(_) => Err(NOT_STRINGS),
        }
    }

    /// A NumericDate claim (seconds since the epoch), if present.
    fn date(&self, name: &str, not_a_number: &'static str) -> Result<Option<f64>, ClaimsError> {
        match self.claims.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => n
                .as_f64()
                .map(Some)
                .ok_or(ClaimsError::Malformed(not_a_number)),
            Some(_) => Err(ClaimsError::Malformed(not_a_number)),
        }
    }
}

/// The `exp` of `token`, read without checking its signature (the API
/// checked the token; this only bounds how long its answer is reused).
pub(crate) fn expiry(token: &str) -> Option<SystemTime> {
    Claims::read(token).ok()?.expiry()
}

/// One base64url segment, padded or not; `None` if it is not one.
pub(super) fn decode(segment: &str) -> Option<Vec<u8>> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(segment.trim_end_matches('='))
        .ok()
}

/// `time` as seconds since the epoch (negative before it).
fn unix_seconds(time: SystemTime) -> f64 {
    match time.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => after.as_secs_f64(),
        Err(before) => -before.duration().as_secs_f64(),
    }
}

/// `seconds` (positive) as whole seconds, saturating.
fn whole_seconds(seconds: f64) -> Duration {
    Duration::try_from_secs_f64(seconds.floor()).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUDIENCE: &str = "system:konnectivity-server";

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    /// A token with `claims` (JSON text), an RS256 header and a signature.
    fn token(claims: &str) -> String {
        format!(
            "{}.{}.{}",
            b64(br#"{"alg":"RS256"}"#),
            b64(claims.as_bytes()),
            b64(b"sig")
        )
    }

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)
    }

    fn check(token: &str, audience: &str) -> Result<(), ClaimsError> {
        Claims::read(token)?.check(audience, now())
    }

    #[test]
    fn a_service_account_token_passes() {
        let good = token(
            r#"{"aud":["https://kubernetes.default.svc","system:konnectivity-server"],"exp":1800003600,"iat":1800000000,"nbf":1800000000,"iss":"https://kubernetes.default.svc","sub":"system:serviceaccount:kube-system:konnectivity-agent"}"#,
        );
        assert_eq!(check(&good, AUDIENCE), Ok(()));
        // aud as one string; exp and nbf as fractions; padding kept.
        let one = token(r#"{"aud":"system:konnectivity-server","exp":1800000000.5,"nbf":1.8e9}"#);
        assert_eq!(check(&one, AUDIENCE), Ok(()));
        assert_eq!(check(&format!("{one}=="), AUDIENCE), Ok(()));
        // No exp, no nbf: only the review can say.
        assert_eq!(
            check(&token(r#"{"aud":"system:konnectivity-server"}"#), AUDIENCE),
            Ok(())
        );
        // No audience required: any aud, or none.
        assert_eq!(check(&token("{}"), ""), Ok(()));
        assert_eq!(check(&token(r#"{"aud":"api"}"#), ""), Ok(()));
    }

    /// Each way a token can fail, and what the error says.
    #[test]
    fn each_local_check_refuses_with_its_reason() {
        let header = b64(br#"{"alg":"RS256"}"#);
        let claims = b64(br#"{"aud":"system:konnectivity-server"}"#);
        let malformed = [
            ("not-a-jwt".to_owned(), "not three dot-separated segments"),
            (
                format!("{header}.{claims}"),
                "not three dot-separated segments",
            ),
            (
                format!("{header}.{claims}.c2ln.c2ln"),
                "not three dot-separated segments",
            ),
            (format!("{header}.{claims}."), "its signature is empty"),
            (
                format!("{header}.{claims}.c2ln!"),
                "its signature is empty or not base64url",
            ),
            (
                format!("{header}!.{claims}.c2ln"),
                "its header is not base64url",
            ),
            (
                format!("{header}.{claims}*.c2ln"),
                "its payload is not base64url",
            ),
            (
                format!("{}.{claims}.c2ln", b64(b"[1]")),
                "its header is not a JSON object",
            ),
            (
                format!("{header}.{}.c2ln", b64(b"\"x\"")),
                "its payload is not a JSON object",
            ),
            (
                format!("{header}.{}.c2ln", b64(b"{\"aud\":")),
                "its payload is not a JSON object",
            ),
            (
                token(r#"{"aud":7}"#),
                "its aud claim is not a string or an array of strings",
            ),
            (token(r#"{"aud":["a",7]}"#), "its aud claim is not a string"),
            (
                token(r#"{"aud":"system:konnectivity-server","exp":"1"}"#),
                "its exp claim is not a number",
            ),
            (
                token(r#"{"aud":"system:konnectivity-server","nbf":true}"#),
                "its nbf claim is not a number",
            ),
        ];
        for (token, why) in malformed {
            let error = check(&token, AUDIENCE).unwrap_err();
            assert!(
                matches!(error, ClaimsError::Malformed(_)) && error.to_string().contains(why),
                "{token}: {error}"
            );
        }
        let other = token(r#"{"aud":["api","konnectivity"]}"#);
        assert_eq!(
            check(&other, AUDIENCE),
            Err(ClaimsError::Audience {
                want: AUDIENCE.to_owned()
            })
        );
        // A legacy token (no aud) where an audience is required.
        assert!(matches!(
            check(&token("{}"), AUDIENCE),
            Err(ClaimsError::Audience { .. })
        ));
        let expired = token(r#"{"aud":"system:konnectivity-server","exp":1799999000}"#);
        assert_eq!(
            check(&expired, AUDIENCE),
            Err(ClaimsError::Expired {
                ago: Duration::from_secs(1000)
            })
        );
        let early = token(r#"{"aud":"system:konnectivity-server","nbf":1800001000}"#);
        assert_eq!(
            check(&early, AUDIENCE),
            Err(ClaimsError::NotYetValid {
                wait: Duration::from_secs(1000)
            })
        );
    }

    /// A clock behind or ahead by less than [`CLOCK_SKEW`] refuses nothing.
    #[test]
    fn the_clock_skew_is_allowed_both_ways() {
        let skew = CLOCK_SKEW.as_secs();
        let at = |claim: &str, seconds: u64| {
            token(&format!(
                r#"{{"aud":"system:konnectivity-server","{claim}":{seconds}}}"#
            ))
        };
        let now = 1_800_000_000;
        assert_eq!(check(&at("exp", now - skew), AUDIENCE), Ok(()));
        assert!(check(&at("exp", now - skew - 1), AUDIENCE).is_err());
        assert_eq!(check(&at("nbf", now + skew), AUDIENCE), Ok(()));
        assert!(check(&at("nbf", now + skew + 1), AUDIENCE).is_err());
    }

    /// No error quotes the token or a claim: an attacker's text never
    /// reaches the log.
    #[test]
    fn errors_never_quote_the_token() {
        let secret = "s3cr3t-claim-text";
        let tokens = [
            secret.to_owned(),
            token(&format!(r#"{{"aud":"{secret}"}}"#)),
            token(&format!(r#"{{"aud":["{secret}"],"exp":"{secret}"}}"#)),
            token(&format!(r#"{{"aud":"{AUDIENCE}","exp":1,"x":"{secret}"}}"#)),
        ];
        for token in tokens {
            let error = check(&token, AUDIENCE).unwrap_err().to_string();
            assert!(
                !error.contains(secret) && !error.contains(&token),
                "{error}"
            );
        }
    }

    #[test]
    fn the_expiry_is_read_from_exp() {
        let at = |exp: &str| expiry(&token(&format!(r#"{{"exp":{exp}}}"#)));
        assert_eq!(at("1800000000"), Some(now()));
        assert_eq!(at("1800000000.5"), Some(now() + Duration::from_millis(500)));
        assert_eq!(at("-1"), None);
        assert_eq!(at("\"1800000000\""), None);
        assert_eq!(expiry("not-a-jwt"), None);
        assert_eq!(expiry(&token("{}")), None);
    }
}
