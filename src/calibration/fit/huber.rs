//! Huber's M-estimator by iteratively reweighted least squares, on top of the deviation weights.

use super::least_squares::wls;
use super::{median, Frame, Solution, MAD_TO_SIGMA, SCALE_FLOOR_NS};
use crate::calibration::CalibrationError;

/// Huber's tuning constant (95 % efficiency under Gaussian noise).
const HUBER_K: f64 = 1.345;
/// Iteration cap of the Huber IRLS.
const HUBER_MAX_ITERATIONS: usize = 100;
/// Huber IRLS stops when no weight moves by more than this.
const HUBER_TOLERANCE: f64 = 1e-9;

/// Huber M-estimator by IRLS on top of the deviation weights.
pub(super) fn huber(frame: &Frame) -> Result<Solution, CalibrationError> {
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
