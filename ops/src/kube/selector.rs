//! Kubernetes label selector syntax (`k8s.io/apimachinery/pkg/labels.Parse`),
//! checked so that a bad `--lease-label-selector` stops start-up the way
//! ANP's flag parsing does, instead of failing every watch later.
//!
//! ```text
//! selector    = "" | requirement ("," requirement)*
//! requirement = key | "!" key | key ("=" | "==" | "!=") value
//!             | key ("in" | "notin") "(" value ("," value)* ")"
//!             | key (">" | "<") integer
//! ```
//! Keys are qualified names (`[prefix/]name`), values label values (both
//! at most 63 characters, alphanumeric at the ends); whitespace between
//! tokens is ignored.

/// One lexical token of a selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token<'a> {
    /// A key, value or keyword (`in`, `notin`).
    Word(&'a str),
    /// `!`, `!=`, `=`, `==`, `>`, `<`, `(`, `)` or `,`.
    Symbol(&'static str),
    /// The end of the text.
    End,
}

impl std::fmt::Display for Token<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Word(word) => write!(f, "{word:?}"),
            Self::Symbol(symbol) => write!(f, "'{symbol}'"),
            Self::End => f.write_str("the end"),
        }
    }
}

/// Characters that end a word.
const SPECIAL: &[char] = &['!', '=', '>', '<', '(', ')', ','];

/// Splits `text` into tokens (the longest symbol wins: `!=` over `!`).
fn tokens(text: &str) -> Vec<Token<'_>> {
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let symbol = ["!=", "==", "!", "=", ">", "<", "(", ")", ","]
            .into_iter()
            .find(|s| rest.starts_with(s));
        let len = match symbol {
            Some(symbol) => {
                out.push(Token::Symbol(symbol));
                symbol.len()
            }
            None => {
                let len = rest
                    .find(|c: char| c.is_whitespace() || SPECIAL.contains(&c))
                    .unwrap_or(rest.len());
                out.push(Token::Word(&rest[..len]));
                len
            }
        };
        rest = rest[len..].trim_start();
    }
    out.push(Token::End);
    out
}

/// Checks a label selector as `labels.Parse` does; the empty selector
/// (everything) is valid.
///
/// # Errors
/// The first problem, naming the offending token, key or value.
pub fn check_label_selector(text: &str) -> Result<(), String> {
    let tokens = tokens(text);
    let mut at = 0;
    let mut next = || {
        let token = tokens[at.min(tokens.len() - 1)];
        at += 1;
        token
    };
    let mut token = next();
    if token == Token::End {
        return Ok(());
    }
    loop {
        let negated = token == Token::Symbol("!");
        if negated {
            token = next();
        }
        let Token::Word(key) = token else {
            return Err(format!("found {token}, expected a label key"));
        };
        check_key(key)?;
        token = next();
        if !negated && !matches!(token, Token::Symbol(",") | Token::End) {
            match token {
                Token::Symbol(operator @ ("=" | "==" | "!=" | ">" | "<")) => {
                    token = next();
                    let value = match token {
                        Token::Word(value) => {
                            token = next();
                            value
                        }
                        Token::Symbol(",") | Token::End => "",
                        other => return Err(format!("found {other}, expected a value")),
                    };
                    check_value(key, value)?;
                    if matches!(operator, ">" | "<") && value.parse::<i64>().is_err() {
                        return Err(format!("{key}{operator}{value}: want an integer"));
                    }
                }
                Token::Word(operator @ ("in" | "notin")) => {
                    token = next();
                    if token != Token::Symbol("(") {
                        return Err(format!("found {token}, expected '(' after {operator}"));
                    }
                    loop {
                        token = next();
                        if let Token::Word(value) = token {
                            check_value(key, value)?;
                            token = next();
                        }
                        match token {
                            Token::Symbol(",") => {}
                            Token::Symbol(")") => break,
                            other => return Err(format!("found {other}, expected ',' or ')'")),
                        }
                    }
                    token = next();
                }
                other => {
                    return Err(format!(
                        "found {other} after {key:?}, expected =, ==, !=, in, notin, > or <"
                    ));
                }
            }
        }
        match token {
            Token::End => return Ok(()),
            Token::Symbol(",") => token = next(),
            other => return Err(format!("found {other}, expected ',' or the end")),
        }
    }
}

/// A label name or value body: alphanumeric at both ends, `-_.` inside.
fn is_name(text: &str) -> bool {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    text.starts_with(alnum)
        && text.ends_with(alnum)
        && text
            .chars()
            .all(|c| alnum(c) || matches!(c, '-' | '_' | '.'))
}

/// A DNS-1123 subdomain (the optional key prefix).
fn is_dns_subdomain(text: &str) -> bool {
    text.len() <= 253
        && text.split('.').all(|part| {
            let edge = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
            part.starts_with(edge)
                && part.ends_with(edge)
                && part.chars().all(|c| edge(c) || c == '-')
        })
}

/// A qualified name: `[prefix/]name`.
fn check_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let prefix_ok = prefix.is_none_or(is_dns_subdomain);
    if !prefix_ok || name.len() > 63 || !is_name(name) {
        return Err(format!(
            "{key:?} is not a label key ([prefix/]name: up to 63 letters, digits, '-', '_' or '.', alphanumeric at both ends)"
        ));
    }
    Ok(())
}

/// A label value: empty, or up to 63 characters like a name.
fn check_value(key: &str, value: &str) -> Result<(), String> {
    if value.is_empty() || (value.len() <= 63 && is_name(value)) {
        Ok(())
    } else {
        Err(format!(
            "{value:?} (for {key:?}) is not a label value (up to 63 letters, digits, '-', '_' or '.', alphanumeric at both ends)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_labels_parse_accepts() {
        for good in [
            "",
            "  ",
            "k8s-app=konnectivity-server",
            "k8s-app=konnectivity-server,component=proxy",
            "k8s-app == konnectivity-server , tier!=web",
            "a=",
            "a",
            "!a",
            "a,!b",
            "example.com/app in (a, b,c)",
            "app notin (a)",
            "app in ()",
            "app in (a,,b)",
            "replicas>1,replicas < 10",
            "in=notin",
        ] {
            assert_eq!(check_label_selector(good), Ok(()), "{good:?}");
        }
    }

    #[test]
    fn selectors_labels_parse_refuses_name_the_problem() {
        for (bad, needle) in [
            ("*notavalidlabel*", "*notavalidlabel*"),
            ("a=b,", "expected a label key"),
            (",a", "expected a label key"),
            ("a=b c", "expected ',' or the end"),
            ("!a=b", "expected ',' or the end"),
            ("a in b", "expected '('"),
            ("a in (b", "expected ',' or ')'"),
            ("a=-b", "\"-b\""),
            ("a>b", "want an integer"),
            ("a=(", "expected a value"),
            ("a ! b", "expected =, =="),
            ("Example.com/app=x", "Example.com/app"),
            ("a/b/c=x", "a/b/c"),
            ("x".repeat(64).as_str(), "not a label key"),
            (
                format!("a={}", "v".repeat(64)).as_str(),
                "not a label value",
            ),
        ] {
            let err = check_label_selector(bad).expect_err(bad);
            assert!(err.contains(needle), "{bad:?}: {err}");
        }
    }
}
