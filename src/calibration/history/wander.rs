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

/// The wander is measured over triples of burst points this far apart.
const WANDER_LAG_NS: u64 = 2_000_000_000;

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

/// The newest point's triple at least about [`WANDER_LAG_NS`] apart (further when the bursts are: the points
/// before the newest that lie nearest that far back): how far the middle point misses the chord of the outer
/// two (a straight line, whatever its slope, misses by nothing), squared, and the part of that the points' own
/// variances explain, both in units of what a 1 ppm/√s wander gives: `Var = a²·b² / (3·(a + b))` for gaps of
/// `a` and `b` seconds (`τ³ / 6` for a symmetric triple of half-span τ), times 10⁶ ns² per ppm²·s.
pub(super) fn second_difference(points: &VecDeque<(u64, u64, f64)>) -> Option<(f64, f64)> {
    let &(x3, t3, v3) = points.back()?;
    // The point before `before` nearest to `target`.
    let closest = |target: u64, before: u64| {
        points
            .iter()
            .filter(|p| p.1 < before)
            .min_by_key(|p| p.1.abs_diff(target))
            .copied()
    };
    let (x2, t2, v2) = closest(t3.saturating_sub(WANDER_LAG_NS), t3)?;
    let (x1, t1, v1) = closest(t2.saturating_sub(t3 - t2), t2)?;
    let (a, b) = ((t2 - t1) as f64, (t3 - t2) as f64);
    let lag = WANDER_LAG_NS as f64;
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
    Some((miss * miss / unit, (v2 + w1 * w1 * v1 + w3 * w3 * v3) / unit))
}

impl CalibrationHistory {
    /// The wander the stated uncertainty allows for: the one in use, five times the prior until it has been
    /// measured (the first seconds of a history: a clock may wander more than the prior says, and the
    /// measurement needs a few seconds of bursts).
    pub(super) fn stated_wander(&self) -> f64 {
        if self.innovations.len() < WANDER_MIN_INNOVATIONS {
            self.wander.max(WARMUP_WANDER * self.config.wander_ppm_per_sqrt_s)
        } else {
            self.wander
        }
    }

    /// Adds one second difference and updates the wander in use: the larger of the prior and the estimate.
    pub(super) fn add_innovation(&mut self, innovation: (f64, f64)) {
        self.innovations.push_back(innovation);
        while self.innovations.len() > WANDER_MEMORY {
            self.innovations.pop_front();
        }
        let prior = self.config.wander_ppm_per_sqrt_s;
        self.wander = if self.innovations.len() < WANDER_MIN_INNOVATIONS {
            prior
        } else {
            // Medians, not means: a miss that an outlier inflates must not shorten the window (a shorter window
            // is more sensitive to the next outlier). A squared Gaussian's median is 0.455 times its mean.
            let mut misses: Vec<f64> = self.innovations.iter().map(|i| i.0).collect();
            let mut noise: Vec<f64> = self.innovations.iter().map(|i| i.1).collect();
            let noise = median(&mut noise);
            let squared = median(&mut misses) / 0.455 - noise;
            // Only a wander that stands out of the points' own noise is news.
            if squared > noise {
                // Overlapping triples make only a dozen or so independent ones: state the wander about a
                // standard error above the estimate, not at it.
                (1.4 * squared.sqrt()).max(prior).min(MAX_WANDER)
            } else {
                prior
            }
        };
    }

    /// How many of the open segment's recent bursts to fit: all of them while the wander is the prior's;
    /// fewer when it is larger, where a line over more bursts would miss the bending clock at its end by more
    /// than the extra bursts average away.
    pub(super) fn effective_window(&self, segment: &Segment) -> usize {
        let n = segment.window.len().min(segment.window_limit.max(MIN_WINDOW));
        // Within twice the prior the estimate is noise more than news: the full window (its knots are the most
        // accurate conversion, and more samples outvote an outlier).
        if n <= MIN_WINDOW || self.wander <= 2.0 * self.config.wander_ppm_per_sqrt_s {
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
