//! The rate's wander: measured from the second differences of burst points (the prior is only a floor), the
//! figures for how far a straight line misses a wandering clock, and the window length that wander allows.

use std::collections::VecDeque;

use super::segment::Segment;
use super::{median, CalibrationHistory};
use crate::calibration::model::wander_sigma_ns;

/// Share of the window's wander phase a line fit misses at the window's centroid (fitted on the simulated pair:
/// it makes ~95 % of true times fall inside the stated range at 0.05 ppm/√s over a 4 s window).
pub(super) const WINDOW_BOW: f64 = 0.15;

/// Share a line fit misses at its newest burst, where conversions before the next knot happen: 0.17 of the
/// window's wander phase by Monte Carlo over a random walk (0.098 at the centroid), rounded up.
pub(super) const END_BOW: f64 = 0.2;

/// Predicting beyond the window, the fitted rate misses the current one by up to this many times the wander
/// over the window (`ppm_per_sqrt_s * √window`): 0.9-1.5 by Monte Carlo for 1-4 s windows.
pub(super) const RATE_MISS: f64 = 1.5;

/// The wander is measured over triples of burst points this far apart, each lag on its own, and the larger
/// estimate taken. One lag alone is blind to a rate that oscillates with a period dividing it (the triple's
/// points then sit at the same phase): a rate swinging ±10 ppm every 2 s measured no wander at 2 s, and a
/// second of conversions fell to 88 % inside their stated uncertainty. The two lags share no such period above
/// 0.1 s, which bursts 250 ms apart show as scatter.
pub(super) const WANDER_LAGS_NS: [u64; 2] = [2_000_000_000, 1_300_000_000];

/// Second differences remembered for the wander estimate: 32 s of bursts at the default 250 ms (a clock's
/// wander is a property of the clock; a long memory steadies the estimate).
const WANDER_MEMORY: usize = 128;

/// The wander estimate replaces the prior once this many second differences were seen.
const WANDER_MIN_INNOVATIONS: usize = 5;

/// Until the wander is measured, the stated uncertainty allows for this many times the prior.
const WARMUP_WANDER: f64 = 5.0;

/// The fewest bursts a shortened window spans: fewer leave a robust fit too few samples to outvote an outlier.
pub(super) const MIN_WINDOW: usize = 3;

/// The most wander the estimate may state, ppm/√s.
const MAX_WANDER: f64 = 100.0;

/// The newest point's triple at least about `lag_ns` apart (further when the bursts are: the points
/// before the newest that lie nearest that far back): how far the middle point misses the chord of the outer
/// two (a straight line, whatever its slope, misses by nothing), squared, and the part of that the points' own
/// variances explain, both in units of what a 1 ppm/√s wander gives: `Var = a²·b² / (3·(a + b))` for gaps of
/// `a` and `b` seconds (`τ³ / 6` for a symmetric triple of half-span τ), times 10⁶ ns² per ppm²·s.
fn second_difference(points: &VecDeque<(u64, u64, f64)>, lag_ns: u64) -> Option<Innovation> {
    let &(x3, t3, v3) = points.back()?;
    // The point before `before` nearest to `target`.
    let closest = |target: u64, before: u64| {
        points
            .iter()
            .filter(|p| p.1 < before)
            .min_by_key(|p| p.1.abs_diff(target))
            .copied()
    };
    let (x2, t2, v2) = closest(t3.saturating_sub(lag_ns), t3)?;
    let (x1, t1, v1) = closest(t2.saturating_sub(t3 - t2), t2)?;
    let (a, b) = ((t2 - t1) as f64, (t3 - t2) as f64);
    let lag = lag_ns as f64;
    // Gaps shorter than the lag carry little wander beside the points' noise; very unequal ones weigh one
    // outer point far more than the other.
    if a < 0.75 * lag || b < 0.75 * lag || a.max(b) > 4.0 * a.min(b) {
        return None;
    }
    let (dx1, dx3) = (x2 as i128 - x1 as i128, x3 as i128 - x2 as i128);
    if dx1 <= 0 || dx3 <= 0 {
        return None;
    }
    let (w1, w3) = (dx3 as f64 / (dx1 + dx3) as f64, dx1 as f64 / (dx1 + dx3) as f64);
    let chord = w1 * (t1 as i128 - t2 as i128) as f64 + w3 * (t3 as i128 - t2 as i128) as f64;
    let miss = -chord;
    let (a_s, b_s) = (a * 1e-9, b * 1e-9);
    let unit = a_s * a_s * b_s * b_s / (3.0 * (a_s + b_s)) * 1e6;
    Some(Innovation {
        miss_squared: miss * miss / unit,
        noise: (v2 + w1 * w1 * v1 + w3 * w3 * v3) / unit,
        from_ns: t1,
        to_ns: t3,
    })
}

/// One second difference of burst points: how far the middle point of a triple missed the chord of the outer
/// two, squared, and the part of that the points' own noise explains, both in units of what a wander of
/// 1 ppm/√s would give; and the reference times the triple spans.
#[derive(Clone, Copy, Debug)]
pub(super) struct Innovation {
    miss_squared: f64,
    noise: f64,
    from_ns: u64,
    to_ns: u64,
}

/// How many times the wander estimate (a median of `n` independent squared misses, taken about a standard
/// error high) is stated, so that the truth's wander lies below the statement 19 times in 20: `1.4` once
/// eight independent triples (32 s of bursts at the default 250 ms) stand behind it, as `√(q(8) / q(n))` more
/// below, with `q(n)` the 5 % quantile of χ²ₙ / n (Wilson-Hilferty). An audit's clock wandering 1 ppm/√s
/// (20x the prior) was estimated at 0.16 from the first 7 s of bursts (two independent triples), and 23.5 % of
/// one second's live conversions then lay outside their stated uncertainty.
fn confidence_factor(independent: f64) -> f64 {
    const Z_05: f64 = -1.6449;
    let q = |n: f64| {
        let s = 2.0 / (9.0 * n);
        (1.0 - s + Z_05 * s.sqrt()).max(0.0).powi(3)
    };
    // Fewer than 1.25 triples' worth never reaches here (at least WANDER_MIN_INNOVATIONS overlapping ones).
    let n = independent.clamp(1.25, 8.0);
    STANDARD_ERROR_HIGH * (q(8.0) / q(n)).sqrt()
}

/// The estimate is stated about a standard error above the median when a dozen or so independent triples stand
/// behind it.
const STANDARD_ERROR_HIGH: f64 = 1.4;

/// The wander one lag's second differences measure and its upper bound, if they measure one that stands out of
/// the points' own noise (and they are at least [`WANDER_MIN_INNOVATIONS`]).
fn estimate(innovations: &VecDeque<Innovation>, prior: f64) -> Option<(f64, f64)> {
    if innovations.len() < WANDER_MIN_INNOVATIONS {
        return None;
    }
    // Medians, not means: a miss that an outlier inflates must not shorten the window (a shorter window is more
    // sensitive to the next outlier). A squared Gaussian's median is 0.455 times its mean.
    let mut misses: Vec<f64> = innovations.iter().map(|i| i.miss_squared).collect();
    let mut noise: Vec<f64> = innovations.iter().map(|i| i.noise).collect();
    let noise = median(&mut noise);
    let squared = median(&mut misses) / 0.455 - noise;
    // Only a wander that stands out of the points' own noise is news.
    if squared <= noise {
        return None;
    }
    let estimate = squared.sqrt();
    let bound = |factor: f64| (factor * estimate).max(prior).min(MAX_WANDER);
    Some((
        bound(STANDARD_ERROR_HIGH),
        bound(confidence_factor(independent_triples(innovations))),
    ))
}

/// How many independent triples the remembered second differences amount to: overlapping triples (a new one
/// every burst, each spanning two lags) share most of their points, so the time they cover in all, in units of
/// one triple's span, and never more than their number.
fn independent_triples(innovations: &VecDeque<Innovation>) -> f64 {
    let (Some(first), Some(last)) = (innovations.front(), innovations.back()) else {
        return 0.0;
    };
    let mut spans: Vec<f64> = innovations
        .iter()
        .map(|i| i.to_ns.saturating_sub(i.from_ns) as f64)
        .collect();
    let span = median(&mut spans).max(1.0);
    let covered = last.to_ns.saturating_sub(first.from_ns) as f64;
    (covered / span).min(innovations.len() as f64)
}

impl CalibrationHistory {
    /// The wander the stated uncertainty allows for: five times the prior until it has been measured (the
    /// first seconds of a history: a clock may wander more than the prior says, and the measurement needs a few
    /// seconds of bursts), then the measurement's upper bound.
    pub(super) fn stated_wander(&self) -> f64 {
        if !self.wander_measured() {
            self.wander.max(WARMUP_WANDER * self.config.wander_ppm_per_sqrt_s)
        } else {
            self.wander_bound
        }
    }

    /// The wander break detection allows for: as stated until measured, then the estimate itself. A more
    /// careful statement must not make detection blunter: with the upper bound here, rate steps were found
    /// later and the seconds before them fell to 92.5 % inside (2 of 70 runs of the ±30 ppm model).
    pub(super) fn detection_wander(&self) -> f64 {
        if !self.wander_measured() {
            self.stated_wander()
        } else {
            self.wander
        }
    }

    /// Whether the wander has been measured: the longest lag has [`WANDER_MIN_INNOVATIONS`] second differences
    /// (the shorter one has them sooner, from fewer seconds of bursts).
    fn wander_measured(&self) -> bool {
        self.innovations[0].len() >= WANDER_MIN_INNOVATIONS
    }

    /// Adds the newest of `points`' second differences over each lag of [`WANDER_LAGS_NS`] (where the points
    /// reach that far back), then updates, once for all of them, the wander in use (the larger of the prior and
    /// the estimates) and the wander stated (the estimates' upper bound).
    pub(super) fn add_innovations(&mut self, points: &VecDeque<(u64, u64, f64)>) {
        let mut added = false;
        for (innovations, &lag_ns) in self.innovations.iter_mut().zip(&WANDER_LAGS_NS) {
            if let Some(innovation) = second_difference(points, lag_ns) {
                innovations.push_back(innovation);
                while innovations.len() > WANDER_MEMORY {
                    innovations.pop_front();
                }
                added = true;
            }
        }
        if !added {
            return;
        }
        let prior = self.config.wander_ppm_per_sqrt_s;
        (self.wander, self.wander_bound) = if !self.wander_measured() {
            (prior, prior)
        } else {
            self.innovations
                .iter()
                .filter_map(|innovations| estimate(innovations, prior))
                .fold((prior, prior), |(w, b), (ew, eb)| (w.max(ew), b.max(eb)))
        };
    }

    /// How many of the open segment's recent bursts to fit: all of them while the wander is small; fewer when
    /// it is larger, where a line over more bursts would miss the bending clock at its end by more than the
    /// extra bursts average away.
    pub(super) fn effective_window(&self, segment: &Segment) -> usize {
        let n = segment.window.len().min(segment.window_limit.max(MIN_WINDOW));
        // Within twice a small prior (the default's, or a smaller one) the estimate is noise more than news:
        // the full window (its knots are the most accurate conversion, and more samples outvote an outlier).
        // A larger prior is news itself (the clock is known to wander that much): the window fits it, as it
        // fits an estimate that large. (Compared with the prior as given, a prior set to the clock's true
        // wander of 1 ppm/√s kept the full window, 4 s, and converted ten times worse than the default prior
        // whose estimate found the same wander.)
        let noise_floor = 2.0 * self.config.wander_ppm_per_sqrt_s.min(super::DEFAULT_WANDER_PRIOR);
        if n <= MIN_WINDOW || self.wander <= noise_floor {
            return n;
        }
        // One burst's offset error as its brackets imply it (uniform within ± the deviation).
        let mut burst_var: Vec<f64> = segment
            .window
            .iter()
            .map(|b| {
                let mean_dev = b.iter().map(|s| s.max_deviation_ns as f64).sum::<f64>() / b.len().max(1) as f64;
                (mean_dev / 3f64.sqrt()).powi(2) / b.len().max(1) as f64
            })
            .collect();
        let burst_var = median(&mut burst_var);
        let first = segment.window.front().map_or(0, |b| b[0].reference_ns);
        let last = segment.window.back().map_or(0, |b| b[0].reference_ns);
        let spacing_s = last.saturating_sub(first) as f64 * 1e-9 / (n - 1) as f64;
        (MIN_WINDOW..=n)
            .map(|m| {
                let m_f = m as f64;
                let statistical = burst_var * (4.0 * m_f - 2.0) / (m_f * (m_f + 1.0));
                let bow = END_BOW * wander_sigma_ns(self.wander, (m_f - 1.0) * spacing_s);
                (m, statistical + bow * bow)
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(n, |(m, _)| m)
    }
}
