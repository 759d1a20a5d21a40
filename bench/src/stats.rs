//! Pure numbers: median/min/max of repetitions, Jain's fairness index,
//! latency histograms.

use std::time::Duration;

use hdrhistogram::Histogram;

/// Median, minimum and maximum of a set of values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// The median (mean of the two middle values for an even count).
    pub median: f64,
    /// The smallest value.
    pub min: f64,
    /// The largest value.
    pub max: f64,
}

/// Median, min and max of `values`; `None` when there are none. NaNs are
/// ignored.
pub fn summarize(values: &[f64]) -> Option<Summary> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    Some(Summary {
        median,
        min: sorted[0],
        max: sorted[n - 1],
    })
}

/// Jain's fairness index of per-stream amounts: `(Σx)² / (n·Σx²)`, 1 when
/// all are equal, `1/n` when one stream got everything. `None` for no
/// streams or when nothing moved at all.
pub fn jain_index(amounts: &[f64]) -> Option<f64> {
    let n = amounts.len() as f64;
    let sum: f64 = amounts.iter().sum();
    let squares: f64 = amounts.iter().map(|x| x * x).sum();
    (n > 0.0 && squares > 0.0).then(|| sum * sum / (n * squares))
}

/// Largest latency a histogram records (longer ones saturate).
const MAX_LATENCY: Duration = Duration::from_secs(60);

/// A latency histogram in nanoseconds, 3 significant digits.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY.as_nanos() as u64, 3)
        .expect("the bounds are constants that hdrhistogram accepts")
}

/// Records `d` in a histogram made by [`latency_histogram`].
pub fn record(histogram: &mut Histogram<u64>, d: Duration) {
    histogram.saturating_record(d.as_nanos().try_into().unwrap_or(u64::MAX));
}

/// The `q` quantile (0..=1) of a nanosecond histogram, in microseconds.
pub fn quantile_us(histogram: &Histogram<u64>, q: f64) -> f64 {
    histogram.value_at_quantile(q) as f64 / 1_000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_count_takes_the_middle() {
        let s = summarize(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!(
            s,
            Summary {
                median: 3.0,
                min: 1.0,
                max: 5.0
            }
        );
    }

    #[test]
    fn even_count_averages_the_middle_two() {
        let s = summarize(&[4.0, 1.0, 3.0, 10.0]).unwrap();
        assert_eq!(s.median, 3.5);
        assert_eq!((s.min, s.max), (1.0, 10.0));
    }

    #[test]
    fn single_and_empty() {
        assert_eq!(summarize(&[2.5]).unwrap().median, 2.5);
        assert!(summarize(&[]).is_none());
        assert!(summarize(&[f64::NAN]).is_none());
    }

    #[test]
    fn jain_equal_shares_is_one() {
        assert!((jain_index(&[7.0; 16]).unwrap() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn jain_one_takes_all_is_one_over_n() {
        let mut shares = [0.0; 4];
        shares[2] = 100.0;
        assert!((jain_index(&shares).unwrap() - 0.25).abs() < 1e-12);
    }

    #[test]
    fn jain_known_value() {
        // (1+2+3)² / (3·(1+4+9)) = 36/42
        assert!((jain_index(&[1.0, 2.0, 3.0]).unwrap() - 36.0 / 42.0).abs() < 1e-12);
        assert!(jain_index(&[]).is_none());
        assert!(jain_index(&[0.0, 0.0]).is_none());
    }

    #[test]
    fn histogram_quantiles_in_microseconds() {
        let mut h = latency_histogram();
        for us in 1..=100 {
            record(&mut h, Duration::from_micros(us));
        }
        assert!((quantile_us(&h, 0.5) - 50.0).abs() < 0.1);
        assert!((quantile_us(&h, 0.99) - 99.0).abs() < 0.1);
    }
}
