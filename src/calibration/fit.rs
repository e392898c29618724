//! Fit strategies: a line `reference_ns = intercept + slope * (ticks - origin)` through calibration samples.
//! STUB: to be replaced by the real implementation.

use super::{CalibrationError, CalibrationSample};

/// How the line is fitted through the (filtered) samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum FitStrategy {
    /// Ordinary least squares.
    LeastSquares,
    /// Least squares weighted by `1 / max_deviation²`.
    Weighted,
    /// Huber M-estimator by iteratively reweighted least squares: outliers lose weight.
    #[default]
    Huber,
    /// Theil-Sen: the median of pairwise slopes, the median intercept.
    TheilSen,
    /// RANSAC: the line with the most inliers among random sample pairs, refitted on its inliers.
    Ransac,
}

/// A fit strategy plus the minimum-deviation prefilter applied before it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitOptions {
    /// The fit.
    pub strategy: FitStrategy,
    /// Keep only this fraction (0, 1] of the samples, those with the smallest `max_deviation_ns`
    /// (as NTP keeps the lowest round trips). `1.0` keeps all.
    pub keep_tightest: f64,
    /// Fewer usable samples than this is [`CalibrationError::TooFewSamples`]. At least 2.
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

pub(crate) fn fit_line(_samples: &[CalibrationSample], _options: &FitOptions) -> Result<LineFit, CalibrationError> {
    Err(CalibrationError::DegenerateTicks)
}
