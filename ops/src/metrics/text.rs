//! The exposition text exactly as Go's client writes it (`expfmt`, text
//! format 0.0.4), rewritten from what prometheus-client's encoder writes.
//!
//! The two agree on names, HELP, TYPE and label escaping; they differ where
//! a strict comparer or a Prometheus 2 server notices:
//! - numbers: Go prints `%g`-style shortest floats (`1e-06`, `1`, `86400`,
//!   `1.234567e+06`) where prometheus-client prints `0.000001`, `1.0`; `le`
//!   is a label, so `le="1.0"` and `le="1"` are different series to
//!   Prometheus before 3.0;
//! - histograms: Go writes the buckets, then `_sum`, then `_count`;
//! - order: Go sorts families by name and series by label values;
//! - a family with no series is left out entirely (Go's `Gather`).

use std::{cmp::Ordering, fmt::Write as _};

/// One sample line: `name{labels} value`.
#[derive(Debug)]
struct Sample<'a> {
    /// The sample's name (with `_bucket`, `_sum` or `_count` for histograms).
    name: &'a str,
    /// Labels in the order written, values unescaped.
    labels: Vec<(&'a str, String)>,
    /// The value.
    value: f64,
}

/// One family: its `# HELP` and `# TYPE` text and its samples.
#[derive(Debug)]
struct Family<'a> {
    /// The family name.
    name: &'a str,
    /// The HELP text, as written.
    help: &'a str,
    /// The TYPE (`counter`, `gauge`, `histogram`, …).
    kind: &'a str,
    /// The samples.
    samples: Vec<Sample<'a>>,
}

/// Rewrites prometheus-client's text encoding (without `# EOF`) as Go's
/// client would write the same metrics. Lines it cannot parse are left out;
/// the encoder only writes what this module parses.
pub(crate) fn go_text(text: &str) -> String {
    let mut families: Vec<Family<'_>> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            families.push(Family {
                name,
                help,
                kind: "untyped",
                samples: Vec::new(),
            });
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let (Some(family), Some((_, kind))) = (families.last_mut(), rest.split_once(' ')) {
                family.kind = kind;
            }
        } else if line.starts_with('#') || line.is_empty() {
            continue;
        } else if let (Some(family), Some(sample)) = (families.last_mut(), parse_sample(line)) {
            family.samples.push(sample);
        }
    }
    families.retain(|f| !f.samples.is_empty());
    families.sort_by(|a, b| a.name.cmp(b.name));

    let mut out = String::new();
    for family in &mut families {
        let _ = writeln!(out, "# HELP {} {}", family.name, family.help);
        let _ = writeln!(out, "# TYPE {} {}", family.name, family.kind);
        if family.kind == "histogram" {
            write_histogram(&mut out, family);
        } else {
            for sample in &mut family.samples {
                sample.labels.sort_by(|a, b| a.0.cmp(b.0));
            }
            family
                .samples
                .sort_by(|a, b| compare_labels(&a.labels, &b.labels));
            for sample in &family.samples {
                write_sample(&mut out, sample.name, &sample.labels, None, sample.value);
            }
        }
    }
    out
}

/// One histogram series: its labels (without `le`), buckets, sum and count.
#[derive(Debug, Default)]
struct Series<'a> {
    labels: Vec<(&'a str, String)>,
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

fn write_histogram(out: &mut String, family: &Family<'_>) {
    let mut series: Vec<Series<'_>> = Vec::new();
    for sample in &family.samples {
        let Some(suffix) = sample.name.strip_prefix(family.name) else {
            continue;
        };
        let mut labels: Vec<(&str, String)> = Vec::new();
        let mut le = None;
        for (name, value) in &sample.labels {
            if *name == "le" {
                le = parse_value(value);
            } else {
                labels.push((name, value.clone()));
            }
        }
        labels.sort_by(|a, b| a.0.cmp(b.0));
        let index = match series.iter().position(|s| s.labels == labels) {
            Some(index) => index,
            None => {
                series.push(Series {
                    labels,
                    ..Series::default()
                });
                series.len() - 1
            }
        };
        let entry = &mut series[index];
        match (suffix, le) {
            ("_bucket", Some(le)) => entry.buckets.push((le, sample.value)),
            ("_sum", _) => entry.sum = sample.value,
            ("_count", _) => entry.count = sample.value,
            _ => {}
        }
    }
    series.sort_by(|a, b| compare_labels(&a.labels, &b.labels));
    let bucket = format!("{}_bucket", family.name);
    let sum = format!("{}_sum", family.name);
    let count = format!("{}_count", family.name);
    for s in &mut series {
        s.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !s.buckets.last().is_some_and(|b| b.0 == f64::INFINITY) {
            s.buckets.push((f64::INFINITY, s.count));
        }
        for (le, value) in &s.buckets {
            write_sample(out, &bucket, &s.labels, Some(*le), *value);
        }
        write_sample(out, &sum, &s.labels, None, s.sum);
        write_sample(out, &count, &s.labels, None, s.count);
    }
}

/// Go's order of two label sets of one family: by label values in the
/// order of the (sorted) label names.
fn compare_labels(a: &[(&str, String)], b: &[(&str, String)]) -> Ordering {
    a.iter()
        .map(|(_, v)| v)
        .cmp(b.iter().map(|(_, v)| v))
        .then_with(|| a.iter().map(|(n, _)| n).cmp(b.iter().map(|(n, _)| n)))
}

fn write_sample(
    out: &mut String,
    name: &str,
    labels: &[(&str, String)],
    le: Option<f64>,
    value: f64,
) {
    out.push_str(name);
    if !labels.is_empty() || le.is_some() {
        out.push('{');
        let mut first = true;
        for (label, v) in labels {
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str(label);
            out.push_str("=\"");
            escape_into(out, v);
            out.push('"');
        }
        if let Some(le) = le {
            if !first {
                out.push(',');
            }
            out.push_str("le=\"");
            out.push_str(&go_float(le));
            out.push('"');
        }
        out.push('}');
    }
    out.push(' ');
    out.push_str(&go_float(value));
    out.push('\n');
}

/// Escapes a label value as the text format requires.
fn escape_into(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// See [`super::mismatches`]: `text` is an exposition as
/// [`go_text`] writes it (`# HELP`, `# TYPE`, then the samples).
pub(crate) fn mismatches(described: &[super::Descriptor], text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    // The family of the last `# HELP`, which its samples follow.
    let mut family: Option<&super::Descriptor> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            family = described.iter().find(|d| d.name == name);
            match family {
                None => problems.push(format!("{name}: not described")),
                Some(d) if d.help != help => {
                    problems.push(format!("{name}: HELP {help:?}, described as {:?}", d.help))
                }
                Some(_) => {}
            }
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if let Some(d) = described.iter().find(|d| d.name == name)
                && d.kind != kind
            {
                problems.push(format!("{name}: TYPE {kind}, described as {}", d.kind));
            }
        } else if line.starts_with('#') || line.is_empty() {
            continue;
        } else if let Some(sample) = parse_sample(line) {
            let Some(d) = family else {
                continue;
            };
            let histogram = d.kind == "histogram";
            let le = match sample.name.strip_prefix(d.name.as_str()) {
                Some("") if !histogram => false,
                Some("_bucket") if histogram => true,
                Some("_sum" | "_count") if histogram => false,
                _ => {
                    problems.push(format!("{}: sample {line:?} is not one of its", d.name));
                    continue;
                }
            };
            let mut got: Vec<&str> = sample.labels.iter().map(|(name, _)| *name).collect();
            got.sort_unstable();
            let mut want = d.labels.clone();
            if le {
                want.push("le");
                want.sort_unstable();
            }
            if got != want {
                problems.push(format!("{line}: labels {got:?}, described as {want:?}"));
            }
            for (label, value) in &sample.labels {
                if let Some(values) = d.values.get(label)
                    && !values.contains(&value.as_str())
                {
                    problems.push(format!(
                        "{line}: {label}={value:?} is none of the described {values:?}"
                    ));
                }
            }
        } else {
            problems.push(format!("not a sample: {line:?}"));
        }
    }
    problems
}

/// Parses `name{a="x",b="y"} value` (label values escaped); `None` if the
/// line is not of that shape.
fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        rest = inner;
        loop {
            rest = rest.trim_start_matches(',');
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let (label, after) = rest.split_once("=\"")?;
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.push((label, value));
            rest = &after[end + 1..];
        }
    }
    let value = rest.split_whitespace().next()?;
    Some(Sample {
        name,
        labels,
        value: parse_value(value)?,
    })
}

fn parse_value(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => text.parse().ok(),
    }
}

/// `v` as Go's `expfmt` writes a float: `strconv.FormatFloat(v, 'g', -1,
/// 64)`, i.e. the shortest digits that read back as `v`, in exponent form
/// when the decimal exponent is below -4 or at least 6 (`1e-05`,
/// `1.234567e+06`), else fixed (`0.0001`, `86400`); `+Inf`, `-Inf` and
/// `NaN` spelled out.
pub(crate) fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".to_owned();
    }
    if v.is_infinite() {
        return if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned();
    }
    if v == 0.0 {
        return "0".to_owned();
    }
    // Rust's `{:e}` gives the shortest digits that read back as `v`.
    let sci = format!("{:e}", v.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: Vec<u8> = mantissa.bytes().filter(u8::is_ascii_digit).collect();
    let nd = i32::try_from(digits.len()).unwrap_or(i32::MAX);
    let mut out = String::new();
    if v < 0.0 {
        out.push('-');
    }
    if !(-4..6).contains(&exp) {
        out.push(char::from(digits[0]));
        if digits.len() > 1 {
            out.push('.');
            out.extend(digits[1..].iter().map(|&d| char::from(d)));
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
        return out;
    }
    // Fixed notation: the point sits after `dp` digits.
    let dp = exp + 1;
    let digit = |i: i32| {
        usize::try_from(i)
            .ok()
            .and_then(|i| digits.get(i))
            .map_or('0', |&d| char::from(d))
    };
    if dp > 0 {
        (0..dp).for_each(|i| out.push(digit(i)));
    } else {
        out.push('0');
    }
    let decimals = (nd - dp).max(0);
    if decimals > 0 {
        out.push('.');
        (0..decimals).for_each(|i| out.push(digit(dp + i)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_go_prints_them() {
        for (v, go) in [
            (1e-6, "1e-06"),
            (1e-5, "1e-05"),
            (1e-4, "0.0001"),
            (0.000123, "0.000123"),
            (3.14e-7, "3.14e-07"),
            (0.005, "0.005"),
            (0.25, "0.25"),
            (1.0, "1"),
            (-1.0, "-1"),
            (12.5, "12.5"),
            (86400.0, "86400"),
            (123456.0, "123456"),
            (999999.0, "999999"),
            (1e6, "1e+06"),
            (1234567.0, "1.234567e+06"),
            (1e21, "1e+21"),
            (1.5e300, "1.5e+300"),
            (0.1 + 0.2, "0.30000000000000004"),
            (0.0, "0"),
            (f64::INFINITY, "+Inf"),
            (f64::NEG_INFINITY, "-Inf"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(go_float(v), go, "{v:?}");
        }
    }

    #[test]
    fn histograms_are_rewritten_in_go_order_and_format() {
        let text = "# HELP h Latency\n\
                    # TYPE h histogram\n\
                    h_sum{code=\"200\"} 0.5\n\
                    h_count{code=\"200\"} 1\n\
                    h_bucket{code=\"200\",le=\"0.000001\"} 0\n\
                    h_bucket{code=\"200\",le=\"1.0\"} 1\n\
                    h_bucket{code=\"200\",le=\"+Inf\"} 1\n\
                    h_sum{code=\"100\"} 0.0\n\
                    h_count{code=\"100\"} 0\n\
                    h_bucket{code=\"100\",le=\"0.000001\"} 0\n\
                    h_bucket{code=\"100\",le=\"1.0\"} 0\n\
                    h_bucket{code=\"100\",le=\"+Inf\"} 0\n";
        assert_eq!(
            go_text(text),
            "# HELP h Latency\n\
             # TYPE h histogram\n\
             h_bucket{code=\"100\",le=\"1e-06\"} 0\n\
             h_bucket{code=\"100\",le=\"1\"} 0\n\
             h_bucket{code=\"100\",le=\"+Inf\"} 0\n\
             h_sum{code=\"100\"} 0\n\
             h_count{code=\"100\"} 0\n\
             h_bucket{code=\"200\",le=\"1e-06\"} 0\n\
             h_bucket{code=\"200\",le=\"1\"} 1\n\
             h_bucket{code=\"200\",le=\"+Inf\"} 1\n\
             h_sum{code=\"200\"} 0.5\n\
             h_count{code=\"200\"} 1\n"
        );
    }

    #[test]
    fn families_are_sorted_series_sorted_and_empty_families_dropped() {
        let text = "# HELP z_total Zs\n\
                    # TYPE z_total counter\n\
                    z_total{reason=\"b\",segment=\"x\"} 2\n\
                    z_total{reason=\"a\",segment=\"y\"} 1234567\n\
                    # HELP empty Nothing yet\n\
                    # TYPE empty gauge\n\
                    # HELP a_gauge A gauge\n\
                    # TYPE a_gauge gauge\n\
                    a_gauge{} 3\n\
                    # HELP esc Escapes\n\
                    # TYPE esc counter\n\
                    esc{reason=\"say \\\"hi\\\"\\n\\\\\"} 1\n";
        assert_eq!(
            go_text(text),
            "# HELP a_gauge A gauge\n\
             # TYPE a_gauge gauge\n\
             a_gauge 3\n\
             # HELP esc Escapes\n\
             # TYPE esc counter\n\
             esc{reason=\"say \\\"hi\\\"\\n\\\\\"} 1\n\
             # HELP z_total Zs\n\
             # TYPE z_total counter\n\
             z_total{reason=\"a\",segment=\"y\"} 1.234567e+06\n\
             z_total{reason=\"b\",segment=\"x\"} 2\n"
        );
    }
}
