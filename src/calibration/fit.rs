//! Fit strategies: a line `reference_ns = origin_ns + intercept + slope * (ticks - origin_ticks)` through
//! calibration samples.
//!
//! All regression arithmetic works on small deltas: ticks and reference ns are first taken relative to an
//! integer frame origin (the sample with the median tick), so the f64 math never sees absolute values such as
//! 1e15 TSC ticks or 1e18 GPU ns. The final origin is an integer tick at the (weighted) centroid of the samples
//! that carried the fit, which makes the errors of the intercept and of the slope (nearly) uncorrelated, as
//! [`ClockCalibration::uncertainty_ns`](super::ClockCalibration::uncertainty_ns) assumes.

use super::SplitMix64;
use super::{CalibrationError, CalibrationSample};

/// How the line is fitted through the (filtered) samples.
///
/// Every strategy runs after the minimum-deviation prefilter of [`FitOptions`]. The minimum number of samples
/// each needs is [`FitStrategy::min_samples`]: 2 for [`LeastSquares`](Self::LeastSquares) and
/// [`Weighted`](Self::Weighted), 3 for [`Huber`](Self::Huber) and [`TheilSen`](Self::TheilSen), 4 for
/// [`Ransac`](Self::Ransac).
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
    /// Least squares weighted by `1 / max(max_deviation_ns, 1)²`: tight brackets count more.
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

/// Huber's tuning constant (95 % efficiency under Gaussian noise).
const HUBER_K: f64 = 1.345;
/// MAD to standard deviation for Gaussian noise.
const MAD_TO_SIGMA: f64 = 1.4826;
/// Deviations below this count as this for weighting (no division by zero).
const DEV_FLOOR_NS: f64 = 1.0;
/// The robust scale never drops below this (reference ns are integers: ±0.5 ns rounding at least).
const SCALE_FLOOR_NS: f64 = 0.5;
/// Inlier thresholds never drop below this.
const THRESHOLD_FLOOR_NS: f64 = 1.0;
/// Iteration cap of the Huber IRLS.
const HUBER_MAX_ITERATIONS: usize = 100;
/// Huber IRLS stops when no weight moves by more than this.
const HUBER_TOLERANCE: f64 = 1e-9;
/// Theil-Sen uses all pairs up to this many (about 300 samples), a deterministic random subset beyond.
const THEIL_SEN_MAX_PAIRS: usize = 45_000;
/// RANSAC tries all pairs up to this many candidates, a deterministic random subset beyond.
const RANSAC_MAX_CANDIDATES: usize = 256;
/// Rounds of "refit on inliers, reclassify" after RANSAC's consensus.
const RANSAC_REFINE_ROUNDS: usize = 8;
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
        FitStrategy::LeastSquares => {
            let w = vec![1.0; frame.len()];
            let line = wls(&frame.x, &frame.y, &w).ok_or(CalibrationError::DegenerateTicks)?;
            Solution::all_used(line, w, false)
        }
        FitStrategy::Weighted => {
            let w = frame.base.clone();
            let line = wls(&frame.x, &frame.y, &w).ok_or(CalibrationError::DegenerateTicks)?;
            Solution::all_used(line, w, true)
        }
        FitStrategy::Huber => huber(&frame)?,
        FitStrategy::TheilSen => theil_sen(&frame)?,
        FitStrategy::Ransac => ransac(&frame)?,
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

/// True when the samples with positive weight have at least two distinct ticks.
fn spans_ticks(x: &[f64], w: &[f64]) -> bool {
    let mut positive = x.iter().zip(w).filter(|(_, &w)| w > 0.0).map(|(&x, _)| x);
    match positive.next() {
        Some(first) => positive.any(|x| x != first),
        None => false,
    }
}

/// Weighted least squares (two-pass, centered). `None` when the weighted samples span no ticks or the sums
/// are not finite.
fn wls(x: &[f64], y: &[f64], w: &[f64]) -> Option<Line> {
    if !spans_ticks(x, w) {
        return None;
    }
    let sw: f64 = w.iter().sum();
    let xm = x.iter().zip(w).map(|(&x, &w)| w * x).sum::<f64>() / sw;
    let ym = y.iter().zip(w).map(|(&y, &w)| w * y).sum::<f64>() / sw;
    let (mut sxx, mut sxy) = (0.0, 0.0);
    for ((&x, &y), &w) in x.iter().zip(y).zip(w) {
        let dx = x - xm;
        sxx += w * dx * dx;
        sxy += w * dx * (y - ym);
    }
    let slope = sxy / sxx;
    (sw > 0.0 && sxx > 0.0 && xm.is_finite() && ym.is_finite() && slope.is_finite()).then_some(Line { xm, ym, slope })
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

/// Distribution-free standard error of the median of `values` (reordered in place), McKean-Schrader: the
/// distance between the order statistics around the median that bound a 95 % interval, over `2 * 1.96`.
fn median_standard_error(values: &mut [f64]) -> f64 {
    let n = values.len();
    if n < 2 {
        return 0.0;
    }
    values.sort_unstable_by(f64::total_cmp);
    let z = 1.959_963_984_540_054;
    // 1-based rank, floored (conservative), at least 1.
    let k = ((n as f64 + 1.0) / 2.0 - z * (n as f64 / 4.0).sqrt()).floor().max(1.0) as usize;
    let k = k.min(n.div_ceil(2));
    (values[n - k] - values[k - 1]).abs() / (2.0 * z)
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

/// Huber M-estimator by IRLS on top of the deviation weights.
fn huber(frame: &Frame) -> Result<Solution, CalibrationError> {
    let n = frame.len();
    let mut line = wls(&frame.x, &frame.y, &frame.base).ok_or(CalibrationError::DegenerateTicks)?;
    let mut h = vec![1.0; n];
    let mut weights = frame.base.clone();
    let mut scratch = vec![0.0; n];
    for _ in 0..HUBER_MAX_ITERATIONS {
        let r = frame.residuals(&line);
        let scale = standardized_scale(frame, &r, &mut scratch);
        let mut moved: f64 = 0.0;
        let mut next_h = vec![1.0; n];
        for i in 0..n {
            // The sample's own scale is `scale / ratio`; a residual inside the sample's bracket is never an
            // outlier.
            let clip = (HUBER_K * scale / frame.ratio[i]).max(frame.dev_floored[i]);
            let a = r[i].abs();
            next_h[i] = if a <= clip { 1.0 } else { clip / a };
            moved = moved.max((next_h[i] - h[i]).abs());
        }
        let next_weights: Vec<f64> = frame.base.iter().zip(&next_h).map(|(&b, &h)| b * h).collect();
        match wls(&frame.x, &frame.y, &next_weights) {
            Some(next) => {
                line = next;
                h = next_h;
                weights = next_weights;
            }
            None => break,
        }
        if moved <= HUBER_TOLERANCE {
            break;
        }
    }
    let r = frame.residuals(&line);
    let scale = standardized_scale(frame, &r, &mut scratch);
    let used = (0..n)
        .map(|i| r[i].abs() <= (3.0 * scale / frame.ratio[i]).max(frame.dev_floored[i]))
        .collect();
    Ok(Solution {
        line,
        weights,
        used,
        intercept_sigma_floor: 0.0,
        weighted: true,
    })
}

/// `1.4826 * median |r * ratio|` (residuals standardized to the tightest sample's deviation), floored.
fn standardized_scale(frame: &Frame, r: &[f64], scratch: &mut [f64]) -> f64 {
    for ((s, &r), &q) in scratch.iter_mut().zip(r).zip(&frame.ratio) {
        *s = (r * q).abs();
    }
    (MAD_TO_SIGMA * median(scratch)).max(SCALE_FLOOR_NS)
}

/// Theil-Sen: median pairwise slope, median intercept; inliers by a MAD threshold for the statistics.
fn theil_sen(frame: &Frame) -> Result<Solution, CalibrationError> {
    let n = frame.len();
    let (x, y) = (&frame.x, &frame.y);
    let mut slopes: Vec<f64> = pairs(n, THEIL_SEN_MAX_PAIRS)
        .into_iter()
        .filter(|&(i, j)| x[i] != x[j])
        .map(|(i, j)| (y[j] - y[i]) / (x[j] - x[i]))
        .filter(|s| s.is_finite())
        .collect();
    if slopes.is_empty() {
        return Err(CalibrationError::DegenerateTicks);
    }
    let slope = median(&mut slopes);
    let mut z: Vec<f64> = x.iter().zip(y).map(|(&x, &y)| y - slope * x).collect();
    let intercept = median(&mut z.clone());
    let line = Line {
        xm: 0.0,
        ym: intercept,
        slope,
    };
    let r = frame.residuals(&line);
    let mut abs: Vec<f64> = r.iter().map(|r| r.abs()).collect();
    let scale = (MAD_TO_SIGMA * median(&mut abs)).max(SCALE_FLOOR_NS);
    let threshold = frame.threshold(scale);
    let used: Vec<bool> = r.iter().map(|r| r.abs() <= threshold).collect();
    let weights = used.iter().map(|&u| if u { 1.0 } else { 0.0 }).collect();
    Ok(Solution {
        line,
        weights,
        used,
        intercept_sigma_floor: median_standard_error(&mut z),
        weighted: false,
    })
}

/// RANSAC with an MSAC score: candidates from sample pairs, a threshold from the least-median scale of the
/// candidates and the deviations, weighted least squares on the best candidate's inliers until they settle.
fn ransac(frame: &Frame) -> Result<Solution, CalibrationError> {
    let n = frame.len();
    let (x, y) = (&frame.x, &frame.y);
    let candidates: Vec<Line> = pairs(n, RANSAC_MAX_CANDIDATES)
        .into_iter()
        .filter(|&(i, j)| x[i] != x[j])
        .map(|(i, j)| Line {
            xm: x[i],
            ym: y[i],
            slope: (y[j] - y[i]) / (x[j] - x[i]),
        })
        .filter(|l| l.slope.is_finite() && l.slope > 0.0)
        .collect();
    if candidates.is_empty() {
        return Err(CalibrationError::NonFinite { what: "rate" });
    }
    // Least-median scale over the candidates (with Rousseeuw's small-sample factor).
    let mut abs = vec![0.0; n];
    let mut best_median = f64::INFINITY;
    for line in &candidates {
        for ((a, &x), &y) in abs.iter_mut().zip(x).zip(y) {
            *a = (y - line.value(x)).abs();
        }
        best_median = best_median.min(median(&mut abs));
    }
    let scale = (MAD_TO_SIGMA * (1.0 + 5.0 / (n as f64 - 2.0)) * best_median).max(SCALE_FLOOR_NS);
    let threshold = frame.threshold(scale);
    // Consensus: the smallest truncated squared loss (MSAC), first candidate on ties.
    let cap = threshold * threshold;
    let mut best = candidates[0];
    let mut best_cost = f64::INFINITY;
    for line in &candidates {
        let cost: f64 = x
            .iter()
            .zip(y)
            .map(|(&x, &y)| (y - line.value(x)).powi(2).min(cap))
            .sum();
        if cost < best_cost {
            best_cost = cost;
            best = *line;
        }
    }
    let classify = |line: &Line| -> Vec<bool> {
        x.iter()
            .zip(y)
            .map(|(&x, &y)| (y - line.value(x)).abs() <= threshold)
            .collect()
    };
    let weigh = |inliers: &[bool]| -> Vec<f64> {
        frame
            .base
            .iter()
            .zip(inliers)
            .map(|(&b, &inlier)| if inlier { b } else { 0.0 })
            .collect()
    };
    let mut inliers = classify(&best);
    let mut weights = weigh(&inliers);
    // The candidate's own pair lies on it, so its inliers span two ticks: this refit exists.
    let mut line = wls(x, y, &weights).ok_or(CalibrationError::DegenerateTicks)?;
    for _ in 0..RANSAC_REFINE_ROUNDS {
        let next_inliers = classify(&line);
        if next_inliers == inliers {
            break;
        }
        let next_weights = weigh(&next_inliers);
        match wls(x, y, &next_weights) {
            Some(next) => {
                line = next;
                inliers = next_inliers;
                weights = next_weights;
            }
            None => break,
        }
    }
    Ok(Solution {
        line,
        weights,
        used: inliers,
        intercept_sigma_floor: 0.0,
        weighted: true,
    })
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
    let origin_ns = (frame.r0 as i128 + value.round() as i128).clamp(0, u64::MAX as i128);
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ALL: [FitStrategy; 5] = [
        FitStrategy::LeastSquares,
        FitStrategy::Weighted,
        FitStrategy::Huber,
        FitStrategy::TheilSen,
        FitStrategy::Ransac,
    ];

    #[test]
    fn a_hidden_outlier_with_a_tiny_bracket_does_not_capture_weighted_fits() {
        // 64 samples bracketed to ~300 ns, one of them 50 µs off but claiming an 8 ns bracket: before the
        // deviation floor it outweighed the rest and rotated a Huber fit by tens of µs.
        let truth = Truth {
            t0: 1 << 40,
            r0: 1 << 38,
            slope: 0.9998,
        };
        let mut samples: Vec<CalibrationSample> = (0..64u64)
            .map(|i| {
                let ticks = truth.t0 + i * 60_000_000;
                let ns = truth.r0 + (truth.slope * (i * 60_000_000) as f64).round() as u64;
                sample(ticks, ns, 200 + (i * 37) % 200)
            })
            .collect();
        samples[63].reference_ns += 50_000;
        samples[63].max_deviation_ns = 8;
        // (Plain Weighted least squares is not robust to a 50 µs outlier at all; only the robust fits are held
        // to this.)
        for strategy in [FitStrategy::Huber, FitStrategy::Ransac, FitStrategy::TheilSen] {
            let fit = fit_line(&samples, &all_kept(strategy)).unwrap();
            let worst = samples[..63]
                .iter()
                .map(|s| error_at(&fit, truth, s.source_ticks).abs())
                .fold(0.0, f64::max);
            assert!(worst < 100.0, "{strategy:?}: {worst} ns");
        }
    }

    fn all_kept(strategy: FitStrategy) -> FitOptions {
        FitOptions {
            strategy,
            keep_tightest: 1.0,
            min_samples: 2,
        }
    }

    fn sample(source_ticks: u64, reference_ns: u64, max_deviation_ns: u64) -> CalibrationSample {
        CalibrationSample {
            source_ticks,
            reference_ns,
            max_deviation_ns,
        }
    }

    /// The true line: `r0 + slope * (ticks - t0)`.
    #[derive(Clone, Copy)]
    struct Truth {
        t0: u64,
        r0: u64,
        slope: f64,
    }

    /// `fit(ticks) - truth(ticks)` in ns, computed on deltas.
    fn error_at(fit: &LineFit, truth: Truth, ticks: u64) -> f64 {
        let fitted = (fit.origin_ns as i128 - truth.r0 as i128) as f64
            + fit.intercept_ns
            + fit.slope_ns_per_tick * (ticks.wrapping_sub(fit.origin_ticks) as i64 as f64);
        let true_ns = truth.slope * (ticks.wrapping_sub(truth.t0) as i64 as f64);
        fitted - true_ns
    }

    fn assert_finite(fit: &LineFit) {
        for (name, v) in [
            ("intercept", fit.intercept_ns),
            ("slope", fit.slope_ns_per_tick),
            ("intercept_sigma", fit.intercept_sigma_ns),
            ("slope_sigma", fit.slope_sigma_ns_per_tick),
            ("residual_sigma", fit.residual_sigma_ns),
        ] {
            assert!(v.is_finite(), "{name} = {v} in {fit:?}");
        }
        assert!(fit.slope_ns_per_tick > 0.0, "{fit:?}");
        assert!(fit.intercept_sigma_ns >= 0.0 && fit.slope_sigma_ns_per_tick >= 0.0);
    }

    /// Uniform in [-1, 1).
    fn symmetric(rng: &mut SplitMix64) -> f64 {
        (rng.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    /// `n` samples `step` ticks apart from `truth.t0`, reference = truth + noise (rounded), given deviations.
    fn noisy(
        truth: Truth,
        n: usize,
        step: u64,
        mut dev: impl FnMut(usize) -> u64,
        mut noise: impl FnMut(usize, u64) -> f64,
    ) -> Vec<CalibrationSample> {
        (0..n)
            .map(|i| {
                let ticks = truth.t0.wrapping_add(i as u64 * step);
                let d = dev(i);
                let ns = truth.slope * (i as u64 * step) as f64 + noise(i, d);
                sample(ticks, (truth.r0 as i128 + ns.round() as i128) as u64, d)
            })
            .collect()
    }

    #[test]
    fn every_strategy_recovers_an_exact_line() {
        // (t0, r0, slope, ticks step, ns step): every reference is an exact integer on the line.
        let cases = [
            (
                1_000_000_000_000_000u64,
                5_000_000_000u64,
                1.0 / 3.0,
                3_000u64,
                1_000u64,
            ),
            (123_456_789_012_345, 2_000_000_000_000, 52.08, 25 * 1_000, 1_302 * 1_000),
            (
                1_000_000_000_000_000_000,
                900_000_000_000_000,
                1.0002,
                5_000 * 200,
                5_001 * 200,
            ),
        ];
        for (t0, r0, slope, step, ns_step) in cases {
            let samples: Vec<_> = (0..37u64)
                .map(|i| sample(t0 + i * step, r0 + i * ns_step, 10 + i % 5))
                .collect();
            let truth = Truth { t0, r0, slope };
            for strategy in ALL {
                let fit = fit_line(&samples, &all_kept(strategy)).unwrap();
                assert_finite(&fit);
                assert!(
                    (fit.slope_ns_per_tick / slope - 1.0).abs() < 1e-12,
                    "{strategy:?} slope {} vs {slope}",
                    fit.slope_ns_per_tick
                );
                for ticks in [t0, fit.origin_ticks, t0 + 36 * step, t0 + 1_000 * step] {
                    let err = error_at(&fit, truth, ticks);
                    assert!(err.abs() < 1e-3, "{strategy:?} at {ticks}: {err} ns");
                }
                assert_eq!(fit.used_samples, 37, "{strategy:?}");
                assert_eq!((fit.first_ticks, fit.last_ticks), (t0, t0 + 36 * step));
                assert_eq!(fit.max_deviation_ns, 14);
                // The origin sits at the centroid, the intercept is the sub-ns remainder.
                assert!(fit.origin_ticks.abs_diff(t0 + 18 * step) <= step, "{strategy:?}");
                assert!(fit.intercept_ns.abs() <= 0.5 + 1e-9, "{strategy:?}");
                // Bracket-based floor: never claims zero error.
                assert!(fit.intercept_sigma_ns > 0.0 && fit.slope_sigma_ns_per_tick > 0.0);
            }
        }
    }

    #[test]
    fn sigmas_are_honest_under_bracket_noise() {
        let trials = 200;
        let mut inside_intercept = [0usize; 5];
        let mut inside_slope = [0usize; 5];
        let mut rng = SplitMix64(42);
        for trial in 0..trials {
            let truth = Truth {
                t0: 1_000_000_000_000_000 + rng.next_u64() % 1_000_000_000,
                r0: 1_000_000_000 + rng.next_u64() % 1_000_000_000,
                slope: [1.0 / 3.0, 52.08, 1.0002][trial % 3],
            };
            let n = 8 + trial % 25;
            let devs: Vec<u64> = (0..n).map(|_| 20 + rng.next_u64() % 80).collect();
            let noise: Vec<f64> = devs.iter().map(|&d| d as f64 * symmetric(&mut rng)).collect();
            let step = (1_000_000.0 / truth.slope) as u64;
            let samples = noisy(truth, n, step, |i| devs[i], |i, _| noise[i]);
            for (k, strategy) in ALL.into_iter().enumerate() {
                let fit = fit_line(&samples, &all_kept(strategy)).unwrap();
                assert_finite(&fit);
                if error_at(&fit, truth, fit.origin_ticks).abs() <= 2.0 * fit.intercept_sigma_ns {
                    inside_intercept[k] += 1;
                }
                if (fit.slope_ns_per_tick - truth.slope).abs() <= 2.0 * fit.slope_sigma_ns_per_tick {
                    inside_slope[k] += 1;
                }
            }
        }
        for k in 0..5 {
            assert!(
                inside_intercept[k] * 10 >= trials * 9 && inside_slope[k] * 10 >= trials * 9,
                "{:?}: intercept {}/{trials}, slope {}/{trials} inside 2 sigma",
                ALL[k],
                inside_intercept[k],
                inside_slope[k]
            );
        }
    }

    #[test]
    fn robust_fits_ignore_gross_outliers() {
        for seed in 0..6u64 {
            let mut rng = SplitMix64(seed);
            let truth = Truth {
                t0: 3_000_000_000_000_000 + seed,
                r0: 10_000_000_000,
                slope: 1.0 / 3.0,
            };
            let n = 100;
            let outlier: Vec<bool> = (0..n).map(|i| i % 10 == (seed as usize + 3) % 10).collect();
            let noise: Vec<f64> = (0..n)
                .map(|i| 20.0 * symmetric(&mut rng) + if outlier[i] { 50_000.0 } else { 0.0 })
                .collect();
            let samples = noisy(truth, n, 3_000_000, |_| 20, |i, _| noise[i]);
            let ends = [
                samples[0].source_ticks,
                samples[n / 2].source_ticks,
                samples[n - 1].source_ticks,
            ];
            let worst = |fit: &LineFit| ends.iter().map(|&t| error_at(fit, truth, t).abs()).fold(0.0, f64::max);
            let ls = fit_line(&samples, &all_kept(FitStrategy::LeastSquares)).unwrap();
            assert!(worst(&ls) > 1_000.0, "least squares should be dragged: {}", worst(&ls));
            for strategy in [FitStrategy::Huber, FitStrategy::TheilSen, FitStrategy::Ransac] {
                let fit = fit_line(&samples, &all_kept(strategy)).unwrap();
                assert_finite(&fit);
                assert!(worst(&fit) < 100.0, "seed {seed} {strategy:?}: {} ns", worst(&fit));
                assert_eq!(fit.used_samples, 90, "seed {seed} {strategy:?}");
                assert!(fit.residual_sigma_ns < 30.0, "{strategy:?}: {}", fit.residual_sigma_ns);
                assert!(
                    fit.intercept_sigma_ns < 10.0,
                    "{strategy:?}: {}",
                    fit.intercept_sigma_ns
                );
            }
        }
    }

    #[test]
    fn weighted_beats_least_squares_on_mixed_deviations() {
        let mut rng = SplitMix64(7);
        let (mut sq_ls, mut sq_w) = (0.0, 0.0);
        let (mut slope_ls, mut slope_w) = (0.0, 0.0);
        let truth = Truth {
            t0: 77_000_000_000_000,
            r0: 5_000_000_000,
            slope: 52.08,
        };
        for _ in 0..60 {
            let noise: Vec<f64> = (0..40).map(|_| symmetric(&mut rng)).collect();
            let samples = noisy(
                truth,
                40,
                20_000,
                |i| if i % 2 == 0 { 30 } else { 300 },
                |i, d| noise[i] * d as f64,
            );
            let mid = samples[20].source_ticks;
            let ls = fit_line(&samples, &all_kept(FitStrategy::LeastSquares)).unwrap();
            let w = fit_line(&samples, &all_kept(FitStrategy::Weighted)).unwrap();
            sq_ls += error_at(&ls, truth, mid).powi(2);
            sq_w += error_at(&w, truth, mid).powi(2);
            slope_ls += (ls.slope_ns_per_tick - truth.slope).powi(2);
            slope_w += (w.slope_ns_per_tick - truth.slope).powi(2);
        }
        assert!(sq_w * 4.0 < sq_ls, "weighted {sq_w} vs least squares {sq_ls}");
        assert!(
            slope_w * 4.0 < slope_ls,
            "weighted {slope_w} vs least squares {slope_ls}"
        );
    }

    #[test]
    fn prefilter_keeps_exactly_the_tightest() {
        let devs = [50u64, 10, 30, 10, 70, 20, 90, 40, 60, 80];
        let samples: Vec<_> = devs
            .iter()
            .enumerate()
            .map(|(i, &d)| sample(i as u64 * 1_000, i as u64 * 1_000, d))
            .collect();
        let kept_devs = |f: f64, floor: usize| -> Vec<u64> {
            prefilter(&samples, f, floor)
                .iter()
                .map(|s| s.max_deviation_ns)
                .collect()
        };
        assert_eq!(kept_devs(0.3, 2), vec![10, 10, 20]); // ceil(0.3 * 10) = 3, original order
        assert_eq!(kept_devs(0.25, 2), vec![10, 10, 20]); // ceil(2.5) = 3
        assert_eq!(kept_devs(0.5, 2), vec![10, 30, 10, 20, 40]);
        assert_eq!(kept_devs(0.1, 4), vec![10, 30, 10, 20]); // never below the floor
        assert_eq!(kept_devs(0.0, 2), vec![10, 10]);
        assert_eq!(kept_devs(-3.0, 2), vec![10, 10]);
        assert_eq!(kept_devs(f64::NAN, 2).len(), 10);
        assert_eq!(kept_devs(7.0, 2).len(), 10);
        assert_eq!(kept_devs(0.7, 20).len(), 10); // floor above n: everything
                                                  // Stable on ties: the earlier of equal deviations wins.
        let tied: Vec<_> = (0..6u64).map(|i| sample(i * 10, i * 10, 5)).collect();
        let kept: Vec<u64> = prefilter(&tied, 0.5, 2).iter().map(|s| s.source_ticks).collect();
        assert_eq!(kept, vec![0, 10, 20]);
        // Through fit_line: the used samples are the tightest ceil(f * n).
        let options = FitOptions {
            strategy: FitStrategy::LeastSquares,
            keep_tightest: 0.3,
            min_samples: 2,
        };
        let fit = fit_line(&samples, &options).unwrap();
        assert_eq!((fit.used_samples, fit.max_deviation_ns), (3, 20));
        assert_eq!((fit.first_ticks, fit.last_ticks), (1_000, 5_000));
    }

    #[test]
    fn too_few_samples_is_an_error() {
        assert_eq!(
            fit_line(&[], &FitOptions::default()),
            Err(CalibrationError::TooFewSamples { needed: 3, got: 0 })
        );
        let one = [sample(1, 1, 1)];
        let options = FitOptions {
            strategy: FitStrategy::LeastSquares,
            keep_tightest: 1.0,
            min_samples: 0,
        };
        assert_eq!(
            fit_line(&one, &options),
            Err(CalibrationError::TooFewSamples { needed: 2, got: 1 })
        );
        let three = [sample(1, 1, 1), sample(2, 2, 1), sample(3, 3, 1)];
        assert_eq!(
            fit_line(&three, &all_kept(FitStrategy::Ransac)),
            Err(CalibrationError::TooFewSamples { needed: 4, got: 3 })
        );
        let options = FitOptions {
            min_samples: 5,
            ..FitOptions::new(FitStrategy::TheilSen)
        };
        assert_eq!(
            fit_line(&three, &options),
            Err(CalibrationError::TooFewSamples { needed: 5, got: 3 })
        );
        for strategy in ALL {
            assert_eq!(
                FitOptions::new(strategy).needed_samples(),
                strategy.min_samples().max(3)
            );
            let four = [three[0], three[1], three[2], sample(4, 4, 1)];
            assert!(fit_line(&four, &all_kept(strategy)).is_ok(), "{strategy:?}");
        }
        // Two samples are a line for least squares.
        let fit = fit_line(&three[..2], &all_kept(FitStrategy::LeastSquares)).unwrap();
        assert_finite(&fit);
        assert_eq!(fit.residual_sigma_ns, 0.0);
    }

    #[test]
    fn degenerate_inputs_are_errors() {
        let same_ticks: Vec<_> = (0..10u64).map(|i| sample(42, 1_000 + i * 100, 5)).collect();
        let same_ns: Vec<_> = (0..10u64).map(|i| sample(1_000 + i * 100, 42, 5)).collect();
        for strategy in ALL {
            assert_eq!(
                fit_line(&same_ticks, &all_kept(strategy)),
                Err(CalibrationError::DegenerateTicks)
            );
            assert_eq!(
                fit_line(&same_ns, &all_kept(strategy)),
                Err(CalibrationError::DegenerateTicks)
            );
        }
        // The prefilter can leave only equal ticks: still an error, not a NaN.
        let mut mixed = same_ticks.clone();
        mixed.push(sample(7_000, 9_000, 1_000));
        let options = FitOptions {
            keep_tightest: 0.5,
            ..all_kept(FitStrategy::Weighted)
        };
        assert_eq!(fit_line(&mixed, &options), Err(CalibrationError::DegenerateTicks));
    }

    #[test]
    fn reference_running_backwards_is_a_rate_error() {
        let samples: Vec<_> = (0..20u64)
            .map(|i| sample(1_000_000 + i * 1_000, 1_000_000_000 - i * 333 + (i % 3) * 7, 5 + i % 4))
            .collect();
        for strategy in ALL {
            assert_eq!(
                fit_line(&samples, &all_kept(strategy)),
                Err(CalibrationError::NonFinite { what: "rate" }),
                "{strategy:?}"
            );
        }
    }

    #[test]
    fn ticks_and_references_near_u64_max_do_not_overflow() {
        // Unwrapped ticks that run past u64::MAX (they wrap, as the model's wrapping deltas expect).
        let truth = Truth {
            t0: u64::MAX - 50_000,
            r0: u64::MAX - 10_000_000,
            slope: 1.0 / 3.0,
        };
        let samples: Vec<_> = (0..30u64)
            .map(|i| sample(truth.t0.wrapping_add(i * 3_000), truth.r0 + i * 1_000, 3))
            .collect();
        for strategy in ALL {
            let fit = fit_line(&samples, &all_kept(strategy)).unwrap();
            assert_finite(&fit);
            assert!((fit.slope_ns_per_tick * 3.0 - 1.0).abs() < 1e-12, "{strategy:?}");
            assert!(error_at(&fit, truth, truth.t0.wrapping_add(90_000)).abs() < 1e-3);
            assert_eq!(
                (fit.first_ticks, fit.last_ticks),
                (truth.t0, truth.t0.wrapping_add(29 * 3_000))
            );
        }
        // Extreme spreads: garbage in, an answer or an error out, never a panic or NaN.
        let extreme = [
            sample(0, 0, 0),
            sample(u64::MAX, u64::MAX, u64::MAX),
            sample(1 << 63, 1 << 62, 1),
            sample(u64::MAX / 3, u64::MAX / 2, 0),
            sample(12, u64::MAX - 1, 3),
        ];
        for strategy in ALL {
            if let Ok(fit) = fit_line(&extreme, &all_kept(strategy)) {
                assert_finite(&fit);
            }
        }
    }

    #[test]
    fn huge_deviations_do_not_panic() {
        let line: Vec<_> = (0..12u64)
            .map(|i| sample(1_000 + i * 3_000, 1_000_000 + i * 1_000, u64::MAX))
            .collect();
        let mut mixed = line.clone();
        for s in mixed.iter_mut().step_by(2) {
            s.max_deviation_ns = 0;
        }
        for samples in [&line, &mixed] {
            for strategy in ALL {
                let fit = fit_line(samples, &all_kept(strategy)).unwrap();
                assert_finite(&fit);
                assert!((fit.slope_ns_per_tick * 3.0 - 1.0).abs() < 1e-12, "{strategy:?}");
            }
        }
        let fit = fit_line(&line, &all_kept(FitStrategy::LeastSquares)).unwrap();
        assert_eq!(fit.max_deviation_ns, u64::MAX);
        assert!(fit.intercept_sigma_ns > 1e18);
    }

    #[test]
    fn feeds_a_clock_calibration() {
        let samples: Vec<_> = (0..40u64)
            .map(|i| sample(1_000_000_000_000_000 + i * 3_000_000, 7_000_000_000 + i * 1_000_000, 25))
            .collect();
        let domain = super::super::ClockDomain::new(64, 1.0 / 3.0).unwrap();
        for strategy in ALL {
            let fit = fit_line(&samples, &all_kept(strategy)).unwrap();
            let cal = super::super::ClockCalibration::from_line(&fit, domain, 0).unwrap();
            assert_eq!(cal.to_reference_ns(1_000_000_000_000_000 + 300_000_000), 7_100_000_000);
            let u = cal.uncertainty_ns(1_000_000_000_000_000 + 60_000_000);
            assert!(u > 0.0 && u < 25.0, "{strategy:?}: {u}");
        }
    }

    #[test]
    fn pair_subsampling_is_deterministic_and_valid() {
        assert_eq!(pairs(4, 100), vec![(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]);
        let a = pairs(1_000, 500);
        assert_eq!(a.len(), 500);
        assert_eq!(a, pairs(1_000, 500));
        assert!(a.iter().all(|&(i, j)| i != j && i < 1_000 && j < 1_000));
        assert!(pairs(1, 10).is_empty() && pairs(0, 10).is_empty());
        // Theil-Sen on more samples than the all-pairs cap still recovers the line.
        let samples: Vec<_> = (0..400u64)
            .map(|i| sample(5_000 + i * 3_000, 9_000 + i * 1_000, 4))
            .collect();
        let fit = fit_line(&samples, &all_kept(FitStrategy::TheilSen)).unwrap();
        assert!((fit.slope_ns_per_tick * 3.0 - 1.0).abs() < 1e-12);
        assert_eq!(fit.used_samples, 400);
    }

    #[test]
    fn median_helpers() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        let mut v: Vec<f64> = (0..101).map(|i| i as f64).collect();
        let se = median_standard_error(&mut v);
        assert!(se > 0.0 && se.is_finite());
        assert_eq!(median_standard_error(&mut [1.0]), 0.0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn never_panics_and_never_nan(
            slope in 0.25f64..60.0,
            t0 in 0u64..(1u64 << 62),
            r0 in 0u64..(1u64 << 50),
            n in 3usize..200,
            step in 1u64..2_000_000,
            noise in 0.0f64..200.0,
            seed in any::<u64>(),
            keep in 0.1f64..1.0,
        ) {
            let mut rng = SplitMix64(seed);
            let truth = Truth { t0, r0, slope };
            let devs: Vec<u64> = (0..n).map(|_| rng.next_u64() % 500).collect();
            let jitter: Vec<f64> = (0..n).map(|_| noise * symmetric(&mut rng)).collect();
            let samples = noisy(truth, n, step, |i| devs[i], |i, _| jitter[i]);
            for strategy in ALL {
                let options = FitOptions { strategy, keep_tightest: keep, min_samples: 3 };
                match fit_line(&samples, &options) {
                    Ok(fit) => {
                        prop_assert!(fit.slope_ns_per_tick > 0.0);
                        for v in [
                            fit.intercept_ns,
                            fit.slope_ns_per_tick,
                            fit.intercept_sigma_ns,
                            fit.slope_sigma_ns_per_tick,
                            fit.residual_sigma_ns,
                        ] {
                            prop_assert!(v.is_finite());
                        }
                        prop_assert!(fit.used_samples >= 2);
                    }
                    Err(e) => {
                        let typed = matches!(
                            e,
                            CalibrationError::TooFewSamples { .. }
                                | CalibrationError::DegenerateTicks
                                | CalibrationError::NonFinite { .. }
                        );
                        prop_assert!(typed, "unexpected error {:?}", e);
                    }
                }
            }
        }
    }
}
