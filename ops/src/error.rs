//! Printing an error with its whole `source()` chain on one line.

use std::{error::Error, fmt};

/// Displays an error and its sources as `outer: inner: innermost`.
pub struct DisplayErrorStack<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for DisplayErrorStack<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(err) = source {
            write!(f, ": {err}")?;
            source = err.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn prints_the_chain() {
        let err = Outer(std::io::Error::other("inner"));
        assert_eq!(DisplayErrorStack(&err).to_string(), "outer: inner");
    }
}
