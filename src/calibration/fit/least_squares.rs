//! The two plain fits: ordinary least squares (every sample weighs the same) and least squares weighted by
//! the brackets (`1 / deviation²`), and the weighted solver that the robust fits refit with.

use super::{Frame, Line, Solution};
use crate::calibration::CalibrationError;

/// Ordinary least squares: every sample weighs the same.
pub(super) fn plain(frame: &Frame) -> Result<Solution, CalibrationError> {
    let w = vec![1.0; frame.len()];
    let line = wls(&frame.x, &frame.y, &w).ok_or(CalibrationError::DegenerateTicks)?;
    Ok(Solution::all_used(line, w, false))
}

/// Least squares weighted by the brackets: tight brackets count more.
pub(super) fn weighted(frame: &Frame) -> Result<Solution, CalibrationError> {
    let w = frame.base.clone();
    let line = wls(&frame.x, &frame.y, &w).ok_or(CalibrationError::DegenerateTicks)?;
    Ok(Solution::all_used(line, w, true))
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
pub(super) fn wls(x: &[f64], y: &[f64], w: &[f64]) -> Option<Line> {
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
