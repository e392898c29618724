//! Fit strategies: a line `reference_ns = origin_ns + intercept + slope * (ticks - origin_ticks)` through
//! calibration samples.
//!
//! All regression arithmetic works on small deltas: ticks and reference ns are first taken relative to an
//! integer frame origin (the sample with the median tick), so the f64 math never sees absolute values such as
//! 1e15 TSC ticks or 1e18 GPU ns. The final origin is an integer tick at the (weighted) centroid of the samples
//! that carried the fit, which makes the errors of the intercept and of the slope (nearly) uncorrelated, as
//! [`ClockCalibration::uncertainty_ns`](super::ClockCalibration::uncertainty_ns) assumes.
//!
//! # Where the code is
//!
//! This file holds the options, the strategy enum and the dispatch, with what every strategy shares: the
//! prefilter, the delta frame, the median, the pair sampler and `finish` (standard errors and the integer
//! origin). One file per strategy beside it: `least_squares` (plain and weighted, and the weighted solver the
//! robust fits refit with), `huber`, `theil_sen` and `ransac`.

use super::SplitMix64;
use super::{CalibrationError, CalibrationSample};

mod huber;
mod least_squares;
mod ransac;
#[cfg(test)]
mod tests;
mod theil_sen;

/// How the line is fitted through the (filtered) samples.
///
/// Every strategy runs after the minimum-deviation prefilter of [`FitOptions`]. The minimum number of samples
/// each needs is [`FitStrategy::min_samples`]: 2 for [`LeastSquares`](Self::LeastSquares) and
/// [`Weighted`](Self::Weighted), 3 for [`Huber`](Self::Huber) and [`TheilSen`](Self::TheilSen), 4 for
/// [`Ransac`](Self::Ransac).
///
/// # When to pick which
///
/// Measured on 64 simulated samples with known truth (the unit test `each_strategy_earns_its_place` in
/// `fit/tests.rs` holds each claim below, with the figures):
///
/// - [`Huber`](Self::Huber), the default: honest brackets with up to ~20 % hidden outliers scattered in time.
///   With no outlier it is the same fit as `Weighted`; with 10 % of samples 5-50 µs late it stays within
///   ~10 ns where the least-squares fits miss by ~5 µs. It breaks down at ~30 % late on one side (~20 % when
///   they cluster at one end of the window).
/// - [`Weighted`](Self::Weighted): honest brackets of very different widths and no outliers (~50x better than
///   `LeastSquares` with brackets 100x apart). It never beats `Huber`, only costs less and accepts 2 samples.
/// - [`LeastSquares`](Self::LeastSquares): brackets whose width says nothing about the error (the read sits at
///   the same moment of a call whose length varies), no outliers: weighing by the brackets would throw good
///   samples away (15 ns against 26 ns).
/// - [`TheilSen`](Self::TheilSen): outliers among such uninformative brackets. It ignores the brackets, which
///   hide the outliers from `Huber` and widen `Ransac`'s threshold (42 ns against 500-1000 ns at 20 %).
/// - [`Ransac`](Self::Ransac): many outliers clustered in time, up to ~45 % on one side (a stretch of delayed
///   reads), where `Huber` and `TheilSen` break down (8 ns against 16-27 µs at 40 %). It matches or beats
///   `Huber` wherever the brackets are honest, at about ten times the cost.
///
/// ```
/// use tickline::calibration::{CalibrationError, CalibrationSample, ClockCalibration, ClockDomain, FitOptions, FitStrategy};
/// let domain = ClockDomain::new(64, 1.0).unwrap();
/// let three: Vec<_> = (0..3u64)
///     .map(|i| CalibrationSample { source_ticks: 1_000 + i * 1_000, reference_ns: 5_000 + i * 1_000, max_deviation_ns: 10 })
///     .collect();
/// // Three samples are enough for a robust Huber fit, not for RANSAC (which needs 4).
/// assert!(ClockCalibration::fit(&three, &FitOptions::new(FitStrategy::Huber), domain, 0).is_ok());
/// assert_eq!(FitStrategy::Ransac.min_samples(), 4);
/// assert_eq!(
///     ClockCalibration::fit(&three, &FitOptions::new(FitStrategy::Ransac), domain, 0),
///     Err(CalibrationError::TooFewSamples { needed: 4, got: 3 })
/// );
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum FitStrategy {
    /// Ordinary least squares: every sample weighs the same.
    LeastSquares,
    /// Least squares weighted by `1 / max(max_deviation_ns, 1)²`: tight brackets count more (deviations are
    /// floored at a quarter of the median, so no sample weighs more than 16 typical ones).
    Weighted,
    /// Huber M-estimator by iteratively reweighted (deviation-weighted) least squares, `k = 1.345` times a
    /// MAD-based scale: samples far outside both the scale and their own bracket lose weight.
    #[default]
    Huber,
    /// Theil-Sen: the median of pairwise slopes (all pairs up to ~300 samples, a deterministic subsample of
    /// pairs beyond), the median intercept.
    TheilSen,
    /// RANSAC: among deterministic pseudo-random sample pairs, the line with the best consensus (inlier
    /// threshold from a least-median scale and the samples' deviations), refitted by weighted least squares
    /// on its inliers.
    Ransac,
}

impl FitStrategy {
    /// The fewest samples (after the prefilter) this strategy accepts: 2 for least squares (plain or
    /// weighted), 3 for Huber and Theil-Sen (a robust scale needs a residual), 4 for RANSAC (a candidate pair
    /// plus at least two samples to vote on it).
    pub const fn min_samples(self) -> usize {
        match self {
            FitStrategy::LeastSquares | FitStrategy::Weighted => 2,
            FitStrategy::Huber | FitStrategy::TheilSen => 3,
            FitStrategy::Ransac => 4,
        }
    }
}

/// A fit strategy plus the minimum-deviation prefilter applied before it.
///
/// The prefilter keeps the `ceil(keep_tightest * n)` samples with the smallest `max_deviation_ns` (ties: the
/// earlier sample), but never fewer than `max(min_samples, strategy.min_samples())` when that many exist.
///
/// ```
/// use tickline::calibration::{CalibrationSample, ClockCalibration, ClockDomain, FitOptions, FitStrategy};
/// // A 3 GHz TSC (1/3 ns per tick) far from zero; every tenth reference is 50 µs late (a preempted read).
/// let base_ticks = 1_000_000_000_000_000u64;
/// let samples: Vec<CalibrationSample> = (0..40u64)
///     .map(|i| CalibrationSample {
///         source_ticks: base_ticks + i * 3_000_000,
///         reference_ns: 2_000_000_000 + i * 1_000_000 + if i % 10 == 3 { 50_000 } else { 0 },
///         max_deviation_ns: 20 + i % 7,
///     })
///     .collect();
/// let domain = ClockDomain::new(64, 1.0).unwrap();
/// for strategy in [FitStrategy::Huber, FitStrategy::TheilSen, FitStrategy::Ransac] {
///     let options = FitOptions { keep_tightest: 1.0, ..FitOptions::new(strategy) };
///     let cal = ClockCalibration::fit(&samples, &options, domain, 0).unwrap();
///     let ns = cal.to_reference_ns(base_ticks + 60_000_000);
///     assert!(ns.abs_diff(2_020_000_000) <= 2, "{strategy:?}: {ns}");
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitOptions {
    /// The fit.
    pub strategy: FitStrategy,
    /// Keep only this fraction (0, 1] of the samples, those with the smallest `max_deviation_ns`
    /// (as NTP keeps the lowest round trips). `1.0` keeps all; values above 1 act as 1, values at or below 0
    /// as "the minimum count", NaN as 1.
    pub keep_tightest: f64,
    /// Fewer usable samples than this is [`CalibrationError::TooFewSamples`]. Values below the strategy's own
    /// minimum ([`FitStrategy::min_samples`], at least 2) act as that minimum.
    pub min_samples: usize,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            strategy: FitStrategy::Huber,
            keep_tightest: 0.5,
            min_samples: 3,
        }
    }
}

impl FitOptions {
    /// `strategy` with the default prefilter (keep the tightest half) and minimum (3 samples).
    pub fn new(strategy: FitStrategy) -> Self {
        FitOptions {
            strategy,
            ..FitOptions::default()
        }
    }

    /// The number of samples (after the prefilter) below which the fit fails:
    /// `max(min_samples, strategy.min_samples())`.
    pub fn needed_samples(&self) -> usize {
        self.min_samples.max(self.strategy.min_samples())
    }
}

/// A fitted line and its statistics. Deltas from `origin_ticks` are `ticks.wrapping_sub(origin_ticks) as i64`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LineFit {
    pub origin_ticks: u64,
    pub origin_ns: u64,
    pub intercept_ns: f64,
    pub slope_ns_per_tick: f64,
    pub intercept_sigma_ns: f64,
    pub slope_sigma_ns_per_tick: f64,
    pub residual_sigma_ns: f64,
    pub used_samples: usize,
    pub first_ticks: u64,
    pub last_ticks: u64,
    pub max_deviation_ns: u64,
}

/// MAD to standard deviation for Gaussian noise.
const MAD_TO_SIGMA: f64 = 1.4826;
/// Deviations below this count as this for weighting (no division by zero).
const DEV_FLOOR_NS: f64 = 1.0;
/// The robust scale never drops below this (reference ns are integers: ±0.5 ns rounding at least).
const SCALE_FLOOR_NS: f64 = 0.5;
/// Inlier thresholds never drop below this.
const THRESHOLD_FLOOR_NS: f64 = 1.0;
/// Seed of the internal generator (Theil-Sen pair subsampling, RANSAC candidates).
const SEED: u64 = 0x7469_636b_6c69_6e65; // "tickline"

/// Fits a line through `samples` (ticks already unwrapped into a continuous count) after the prefilter.
pub(crate) fn fit_line(samples: &[CalibrationSample], options: &FitOptions) -> Result<LineFit, CalibrationError> {
    let needed = options.needed_samples();
    if samples.len() < needed {
        return Err(CalibrationError::TooFewSamples {
            needed,
            got: samples.len(),
        });
    }
    let kept = prefilter(samples, options.keep_tightest, needed);
    if kept.len() < needed {
        return Err(CalibrationError::TooFewSamples {
            needed,
            got: kept.len(),
        });
    }
    let frame = Frame::new(&kept)?;
    let solution = match options.strategy {
        FitStrategy::LeastSquares => least_squares::plain(&frame)?,
        FitStrategy::Weighted => least_squares::weighted(&frame)?,
        FitStrategy::Huber => huber::huber(&frame)?,
        FitStrategy::TheilSen => theil_sen::theil_sen(&frame)?,
        FitStrategy::Ransac => ransac::ransac(&frame)?,
    };
    finish(&frame, &kept, &solution)
}

/// The minimum-deviation prefilter: the `ceil(keep_tightest * n)` samples with the smallest deviation (stable),
/// at least `floor` of them when that many exist, in their original order.
fn prefilter(samples: &[CalibrationSample], keep_tightest: f64, floor: usize) -> Vec<CalibrationSample> {
    let n = samples.len();
    let fraction = if keep_tightest.is_nan() {
        1.0
    } else {
        keep_tightest.clamp(f64::MIN_POSITIVE, 1.0)
    };
    let raw = fraction * n as f64;
    // Shave a relative 1e-12 so that 0.3 * 10 = 3.0000000000000004 keeps 3, not 4.
    let keep = ((raw - raw * 1e-12).ceil() as usize).max(1).max(floor).min(n);
    if keep >= n {
        return samples.to_vec();
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| samples[i].max_deviation_ns); // stable: ties keep the earlier sample
    order.truncate(keep);
    order.sort_unstable();
    order.into_iter().map(|i| samples[i]).collect()
}

/// The samples as f64 deltas from an integer frame origin (the sample with the median tick).
struct Frame {
    t0: u64,
    r0: u64,
    /// Ticks from `t0` (wrapping, as the model does).
    dx: Vec<i64>,
    /// `dx` as f64.
    x: Vec<f64>,
    /// Reference ns from `r0`.
    y: Vec<f64>,
    /// `max_deviation_ns` as f64 (unfloored).
    dev: Vec<f64>,
    /// `max(dev, DEV_FLOOR_NS)`.
    dev_floored: Vec<f64>,
    /// `min(dev_floored) / dev_floored`: 1 for the tightest sample.
    ratio: Vec<f64>,
    /// Base weights `ratio²` (`1 / dev²`, normalized so the tightest sample weighs 1).
    base: Vec<f64>,
}

impl Frame {
    fn new(samples: &[CalibrationSample]) -> Result<Self, CalibrationError> {
        let first = samples[0].source_ticks;
        let mut order: Vec<(i64, usize)> = samples
            .iter()
            .enumerate()
            .map(|(i, s)| (s.source_ticks.wrapping_sub(first) as i64, i))
            .collect();
        let mid = order.len() / 2;
        order.select_nth_unstable(mid);
        let median = samples[order[mid].1];
        let (t0, r0) = (median.source_ticks, median.reference_ns);
        let dx: Vec<i64> = samples.iter().map(|s| s.source_ticks.wrapping_sub(t0) as i64).collect();
        if dx.iter().all(|&d| d == dx[0]) {
            return Err(CalibrationError::DegenerateTicks);
        }
        if samples.iter().all(|s| s.reference_ns == samples[0].reference_ns) {
            return Err(CalibrationError::DegenerateTicks);
        }
        let x = dx.iter().map(|&d| d as f64).collect();
        let y = samples
            .iter()
            .map(|s| (s.reference_ns as i128 - r0 as i128) as f64)
            .collect();
        let dev: Vec<f64> = samples.iter().map(|s| s.max_deviation_ns as f64).collect();
        // A bracket far tighter than the typical one is luck more than a better measurement: weighting it by
        // 1/dev² without a floor lets one hidden outlier with a tiny bracket outweigh all the others (seen
        // on the simulated pair: a 8 ns bracket rotated a 64-sample Huber fit by 46 µs). Floor the deviation
        // at a quarter of the median so no sample weighs more than 16 typical ones.
        let mut sorted_dev = dev.clone();
        sorted_dev.sort_by(f64::total_cmp);
        let typical_floor = sorted_dev[sorted_dev.len() / 2] / 4.0;
        let dev_floored: Vec<f64> = dev.iter().map(|&d| d.max(DEV_FLOOR_NS).max(typical_floor)).collect();
        let tightest = dev_floored.iter().copied().fold(f64::INFINITY, f64::min);
        let ratio: Vec<f64> = dev_floored.iter().map(|&d| tightest / d).collect();
        let base = ratio.iter().map(|&r| r * r).collect();
        Ok(Frame {
            t0,
            r0,
            dx,
            x,
            y,
            dev,
            dev_floored,
            ratio,
            base,
        })
    }

    fn len(&self) -> usize {
        self.x.len()
    }

    fn residuals(&self, line: &Line) -> Vec<f64> {
        self.x.iter().zip(&self.y).map(|(&x, &y)| y - line.value(x)).collect()
    }

    /// The inlier threshold of the robust fits: `max(3 * scale, 2 * median deviation, 1 ns)`.
    fn threshold(&self, scale: f64) -> f64 {
        let mut devs = self.dev.clone();
        (3.0 * scale).max(2.0 * median(&mut devs)).max(THRESHOLD_FLOOR_NS)
    }
}

/// A line in frame coordinates: `y = ym + slope * (x - xm)`.
#[derive(Clone, Copy, Debug)]
struct Line {
    xm: f64,
    ym: f64,
    slope: f64,
}

impl Line {
    fn value(&self, x: f64) -> f64 {
        self.ym + self.slope * (x - self.xm)
    }
}

/// What a strategy hands to [`finish`]: the line, the effective least-squares weights of its final (re)fit
/// (for the standard errors), and which samples carried it.
struct Solution {
    line: Line,
    weights: Vec<f64>,
    used: Vec<bool>,
    /// A floor for the intercept's standard error from the estimator itself (Theil-Sen's median).
    intercept_sigma_floor: f64,
    /// Whether the residual variance model is `sigma² / base weight` (the deviation-weighted fits) rather
    /// than the same `sigma²` for every sample (least squares, Theil-Sen).
    weighted: bool,
}

impl Solution {
    fn all_used(line: Line, weights: Vec<f64>, weighted: bool) -> Self {
        let used = vec![true; weights.len()];
        Solution {
            line,
            weights,
            used,
            intercept_sigma_floor: 0.0,
            weighted,
        }
    }
}

/// The median of `values` (reordered in place); 0 for an empty slice.
fn median(values: &mut [f64]) -> f64 {
    let n = values.len();
    if n == 0 {
        return 0.0;
    }
    let mid = n / 2;
    let (lower, upper, _) = values.select_nth_unstable_by(mid, f64::total_cmp);
    let upper = *upper;
    if n % 2 == 1 {
        upper
    } else {
        let lower = lower.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        lower + (upper - lower) / 2.0
    }
}

impl SplitMix64 {
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// A uniform pair of distinct indices in `0..n` (`n >= 2`).
    fn pair(&mut self, n: usize) -> (usize, usize) {
        let i = self.below(n);
        let mut j = self.below(n - 1);
        if j >= i {
            j += 1;
        }
        (i, j)
    }
}

/// Index pairs: all `i < j` when there are at most `cap`, else `cap` deterministic pseudo-random ones.
fn pairs(n: usize, cap: usize) -> Vec<(usize, usize)> {
    let all = n.saturating_mul(n.saturating_sub(1)) / 2;
    if all <= cap {
        (0..n).flat_map(|i| (i + 1..n).map(move |j| (i, j))).collect()
    } else {
        let mut rng = SplitMix64(SEED ^ n as u64);
        (0..cap).map(|_| rng.pair(n)).collect()
    }
}

/// Statistics, origin choice and the finiteness checks shared by every strategy.
fn finish(frame: &Frame, samples: &[CalibrationSample], solution: &Solution) -> Result<LineFit, CalibrationError> {
    let line = solution.line;
    if !(line.slope.is_finite() && line.slope > 0.0) {
        return Err(CalibrationError::NonFinite { what: "rate" });
    }
    let w = &solution.weights;
    let used = &solution.used;
    let n = frame.len();
    let r = frame.residuals(&line);

    // Residual scale of the used samples, per unit model weight (variance of sample i: sigma2 / model_i).
    let model = |i: usize| if solution.weighted { frame.base[i] } else { 1.0 };
    let n_used = used.iter().filter(|&&u| u).count();
    let (mut sum_br2, mut sum_b) = (0.0, 0.0);
    for i in (0..n).filter(|&i| used[i]) {
        sum_br2 += model(i) * r[i] * r[i];
        sum_b += model(i);
    }
    let (sigma2_unit, residual_sigma) = if n_used > 2 && sum_b > 0.0 {
        let dof = (n_used - 2) as f64;
        (sum_br2 / dof, (sum_br2 / sum_b * n_used as f64 / dof).sqrt())
    } else {
        (0.0, 0.0)
    };

    // Sandwich standard errors of the final (re)weighted least-squares fit, at its weighted centroid. Each
    // sample's variance is the larger of the residual-based one and its bracket's (uniform within
    // ±max_deviation, plus ±0.5 ns rounding); a sample that did not carry the fit counts its whole residual.
    let sw: f64 = w.iter().sum();
    if !(sw > 0.0 && sw.is_finite()) {
        return Err(CalibrationError::DegenerateTicks);
    }
    let xw = frame.x.iter().zip(w).map(|(&x, &w)| w * x).sum::<f64>() / sw;
    let sxx: f64 = frame.x.iter().zip(w).map(|(&x, &w)| w * (x - xw) * (x - xw)).sum();
    if !(sxx > 0.0 && sxx.is_finite()) {
        return Err(CalibrationError::DegenerateTicks);
    }
    let (mut var_intercept, mut var_slope) = (0.0, 0.0);
    for i in 0..n {
        if w[i] == 0.0 {
            continue;
        }
        let bracket = (frame.dev[i] * frame.dev[i] + 0.25) / 3.0;
        let mut v = (sigma2_unit / model(i)).max(bracket);
        if !used[i] {
            v = v.max(r[i] * r[i]);
        }
        let a = w[i] / sw;
        let b = w[i] * (frame.x[i] - xw) / sxx;
        var_intercept += a * a * v;
        var_slope += b * b * v;
    }
    let intercept_sigma = var_intercept.sqrt().max(solution.intercept_sigma_floor);
    let slope_sigma = var_slope.sqrt();
    if !(intercept_sigma.is_finite() && slope_sigma.is_finite() && residual_sigma.is_finite()) {
        return Err(CalibrationError::NonFinite { what: "uncertainty" });
    }

    // Integer origin at the weighted centroid; the integer part of the line's value there goes to origin_ns.
    if !xw.is_finite() {
        return Err(CalibrationError::NonFinite { what: "offset" });
    }
    let xc = xw.round() as i64; // within the samples' i64 deltas: no saturation in practice
    let origin_ticks = frame.t0.wrapping_add(xc as u64);
    let value = line.value(xc as f64);
    if !value.is_finite() {
        return Err(CalibrationError::NonFinite { what: "offset" });
    }
    let origin_ns = (frame.r0 as i128)
        .saturating_add(value.round() as i128)
        .clamp(0, u64::MAX as i128);
    let intercept_ns = value - (origin_ns - frame.r0 as i128) as f64;
    if !intercept_ns.is_finite() {
        return Err(CalibrationError::NonFinite { what: "offset" });
    }

    let mut first = i64::MAX;
    let mut last = i64::MIN;
    let mut max_deviation_ns = 0;
    for i in (0..n).filter(|&i| used[i]) {
        first = first.min(frame.dx[i]);
        last = last.max(frame.dx[i]);
        max_deviation_ns = max_deviation_ns.max(samples[i].max_deviation_ns);
    }
    if n_used == 0 {
        (first, last) = (xc, xc);
    }
    Ok(LineFit {
        origin_ticks,
        origin_ns: origin_ns as u64,
        intercept_ns,
        slope_ns_per_tick: line.slope,
        intercept_sigma_ns: intercept_sigma,
        slope_sigma_ns_per_tick: slope_sigma,
        residual_sigma_ns: residual_sigma,
        used_samples: n_used,
        first_ticks: frame.t0.wrapping_add(first as u64),
        last_ticks: frame.t0.wrapping_add(last as u64),
        max_deviation_ns,
    })
}
