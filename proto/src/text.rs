//! Text a peer sent, shown in our own messages (errors, logs, replies)
//! without repeating more than a bounded prefix of it: a CONNECT with a
//! 100 KB `Host` must not get a 200 KB error page back.

use std::fmt;

/// How much of a peer's text a message repeats.
pub const ECHO_LIMIT: usize = 256;

/// How much of a peer's text a record keeps (an audit record's field, a
/// span's attribute): a host name and port (259 bytes) whole, and any
/// error text a destination or a resolver gives.
pub const RECORD_LIMIT: usize = 1024;

/// Shows at most [`ECHO_LIMIT`] bytes of a peer's text (cut at a character
/// boundary), then `…` and how many bytes were left out.
#[derive(Debug, Clone, Copy)]
pub struct Elided<'a>(pub &'a str);

impl fmt::Display for Elided<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match split(self.0, ECHO_LIMIT) {
            None => f.write_str(self.0),
            Some((kept, left)) => write!(f, "{kept}…({left} more bytes)"),
        }
    }
}

/// The first `limit` bytes of `text` at most (cut at a character boundary)
/// and how many bytes were left out, if it is longer.
fn split(text: &str, limit: usize) -> Option<(&str, usize)> {
    if text.len() <= limit {
        return None;
    }
    let mut cut = limit;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    Some((&text[..cut], text.len() - cut))
}

/// `text` for a record: whole up to [`RECORD_LIMIT`] bytes, past that its
/// first [`RECORD_LIMIT`] bytes marked as cut, `…(N more bytes)`. Takes
/// the text by value so that the common case moves it.
pub fn for_record(text: String) -> String {
    match split(&text, RECORD_LIMIT) {
        None => text,
        Some((kept, left)) => format!("{kept}…({left} more bytes)"),
    }
}

/// `text` with every long run of `echoed` (a peer's text that a third
/// party, such as an ANP agent, may have repeated in full) shown as
/// [`Elided`]; then the whole bounded to a few times [`ECHO_LIMIT`].
pub fn elide_echo(text: &str, echoed: &[&str]) -> String {
    let mut out = text.to_owned();
    for echo in echoed {
        if echo.len() > ECHO_LIMIT && out.contains(echo) {
            out = out.replace(echo, &Elided(echo).to_string());
        }
    }
    if out.len() > 4 * ECHO_LIMIT {
        out = Elided(&out).to_string();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_shown_whole_and_long_text_is_cut() {
        assert_eq!(Elided("10.0.0.1:443").to_string(), "10.0.0.1:443");
        let long = "a".repeat(100_000);
        let shown = Elided(&long).to_string();
        assert!(shown.len() < ECHO_LIMIT + 32, "{}", shown.len());
        assert!(shown.ends_with(&format!("…({} more bytes)", 100_000 - ECHO_LIMIT)));
        // Never inside a character.
        let wide = "é".repeat(ECHO_LIMIT);
        assert!(
            Elided(&wide)
                .to_string()
                .starts_with(&"é".repeat(ECHO_LIMIT / 2))
        );
    }

    #[test]
    fn a_record_keeps_a_host_and_port_whole_and_marks_a_longer_text_cut() {
        let longest = format!("{}:65535", "h".repeat(253));
        assert_eq!(for_record(longest.clone()), longest);
        let huge = "x".repeat(4 << 20);
        let kept = for_record(huge);
        assert!(kept.len() < RECORD_LIMIT + 32, "{}", kept.len());
        assert!(kept.ends_with(&format!("…({} more bytes)", (4 << 20) - RECORD_LIMIT)));
        let wide = "é".repeat(RECORD_LIMIT);
        assert!(for_record(wide).starts_with(&"é".repeat(RECORD_LIMIT / 2)));
    }

    #[test]
    fn an_echo_of_a_long_host_is_cut_wherever_it_appears() {
        let host = "h".repeat(100_000);
        let error = format!("dial tcp {host}:80: lookup {host}: no such host");
        let shown = elide_echo(&error, &[&format!("{host}:80"), &host]);
        assert!(shown.len() < 3 * ECHO_LIMIT, "{}", shown.len());
        assert!(shown.starts_with("dial tcp hhh"), "{shown}");
        assert!(shown.ends_with(": no such host"), "{shown}");
        assert_eq!(
            elide_echo("connection refused", &[&host]),
            "connection refused"
        );
    }
}
