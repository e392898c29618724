//! RANSAC: candidate lines from sample pairs, the best consensus under an MSAC score, refitted by weighted
//! least squares on its inliers.

use super::least_squares::wls;
use super::{median, pairs, Frame, Line, Solution, MAD_TO_SIGMA, SCALE_FLOOR_NS};
use crate::calibration::CalibrationError;

/// RANSAC tries all pairs up to this many candidates, a deterministic random subset beyond.
const RANSAC_MAX_CANDIDATES: usize = 256;
/// Rounds of "refit on inliers, reclassify" after RANSAC's consensus.
const RANSAC_REFINE_ROUNDS: usize = 8;

/// RANSAC with an MSAC score: candidates from sample pairs, a threshold from the least-median scale of the
/// candidates and the deviations, weighted least squares on the best candidate's inliers until they settle.
pub(super) fn ransac(frame: &Frame) -> Result<Solution, CalibrationError> {
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
