//! Go's `time.ParseDuration` syntax, so manifests written for ANP keep working:
//! `1h`, `1h0m0s`, `100ms`, `1.5s`, `0`.

use std::time::Duration;

/// Parses a non-negative Go duration; the error text suits a clap message.
///
/// # Errors
/// Empty input, a missing or unknown unit, a negative value, or overflow.
pub fn parse(text: &str) -> Result<Duration, String> {
    let bad = || format!("invalid duration {text:?} (want Go syntax such as 1h0m0s, 30s, 100ms)");
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest.starts_with('-') {
        return Err(format!("negative duration {text:?} is not allowed"));
    }
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total_nanos: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let (number, tail) = rest.split_at(number_len);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let unit_nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(bad()),
        };
        let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && frac.is_empty() {
            return Err(bad());
        }
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| bad())?
        };
        let mut nanos = whole.checked_mul(unit_nanos).ok_or_else(bad)?;
        let mut scale = unit_nanos;
        for digit in frac.chars() {
            let digit = u128::from(digit.to_digit(10).ok_or_else(bad)?);
            scale /= 10;
            nanos += digit * scale;
        }
        total_nanos = total_nanos.checked_add(nanos).ok_or_else(bad)?;
        rest = tail;
    }
    let secs = u64::try_from(total_nanos / 1_000_000_000).map_err(|_| bad())?;
    let sub = u32::try_from(total_nanos % 1_000_000_000).map_err(|_| bad())?;
    Ok(Duration::new(secs, sub))
}

/// Formats a duration the way Go prints it (`1h0m0s`, `100ms`), for `--help`
/// defaults and logs.
pub fn format(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_owned();
    }
    if nanos < 1_000_000_000 {
        return if nanos.is_multiple_of(1_000_000) {
            format!("{}ms", nanos / 1_000_000)
        } else if nanos.is_multiple_of(1_000) {
            format!("{}µs", nanos / 1_000)
        } else {
            format!("{nanos}ns")
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let frac = d.subsec_nanos();
    let s = if frac == 0 {
        s.to_string()
    } else {
        let f = format!("{frac:09}");
        format!("{s}.{}", f.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, m) => format!("{m}m{s}s"),
        (h, m) => format!("{h}h{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations() {
        let cases = [
            ("0", Duration::ZERO),
            ("0s", Duration::ZERO),
            ("1h", Duration::from_secs(3600)),
            ("1h0m0s", Duration::from_secs(3600)),
            ("100ms", Duration::from_millis(100)),
            ("1.5s", Duration::from_millis(1500)),
            (".5s", Duration::from_millis(500)),
            ("2m30s", Duration::from_secs(150)),
            ("10us", Duration::from_micros(10)),
            ("10µs", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
            ("+5s", Duration::from_secs(5)),
        ];
        for (text, want) in cases {
            assert_eq!(parse(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn rejects_bad_durations() {
        for text in [
            "",
            "1",
            "10",
            "1x",
            "h",
            "-1s",
            "1.2.3s",
            "s1",
            ".s",
            "99999999999999999999h",
        ] {
            assert!(parse(text).is_err(), "{text} should fail");
        }
        assert!(parse("-1s").unwrap_err().contains("negative"));
    }

    #[test]
    fn formats_like_go() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(3600), "1h0m0s"),
            (Duration::from_secs(10), "10s"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_millis(100), "100ms"),
            (Duration::from_millis(1500), "1.5s"),
        ];
        for (d, want) in cases {
            assert_eq!(format(d), want);
            assert_eq!(parse(want), Ok(d), "round trip {want}");
        }
    }
}
