//! Theil-Sen: the median of pairwise slopes and the median intercept, with a distribution-free standard
//! error of that median.

use super::{median, pairs, Frame, Line, Solution, MAD_TO_SIGMA, SCALE_FLOOR_NS};
use crate::calibration::CalibrationError;

/// Theil-Sen uses all pairs up to this many (about 300 samples), a deterministic random subset beyond.
const THEIL_SEN_MAX_PAIRS: usize = 45_000;

/// Theil-Sen: median pairwise slope, median intercept; inliers by a MAD threshold for the statistics.
pub(super) fn theil_sen(frame: &Frame) -> Result<Solution, CalibrationError> {
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

/// Distribution-free standard error of the median of `values` (reordered in place), McKean-Schrader: the
/// distance between the order statistics around the median that bound a 95 % interval, over `2 * 1.96`.
pub(super) fn median_standard_error(values: &mut [f64]) -> f64 {
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
