//! What the brackets say on their own, whatever the fit: where a majority of them agree (Marzullo's
//! intersection, as NTP picks its truechimers), how well a line through them can be known at best, and a
//! burst's point.

use super::median;
use crate::calibration::{CalibrationSample, LineFit};

/// How far the truth at `knot_ticks` can lie from `knot_ns` if the brackets hold it: each bracket
/// `reference ± deviation`, carried to `knot_ticks` along `ns_per_tick`, is an interval; where more than half
/// of them overlap (Marzullo's intersection, as NTP picks its truechimers) the truth lies if most brackets are
/// honest. The result is the distance from `knot_ns` to that region's far edge, or 0 when no majority agrees.
pub(super) fn bracket_agreement_ns(
    samples: &[CalibrationSample],
    knot_ticks: u64,
    line: &LineFit,
    knot_ns: u64,
) -> f64 {
    let mut edges: Vec<(f64, i32)> = Vec::with_capacity(2 * samples.len());
    for s in samples {
        let distance = (knot_ticks as i128 - s.source_ticks as i128) as f64;
        let at_knot = (s.reference_ns as i128 - knot_ns as i128) as f64 + distance * line.slope_ns_per_tick;
        // Carried with a fitted rate, a bracket also carries twice the rate's error over the distance.
        let half_width = s.max_deviation_ns as f64 + 2.0 * (distance * line.slope_sigma_ns_per_tick).abs();
        edges.push((at_knot - half_width, 1));
        edges.push((at_knot + half_width, -1));
    }
    // Closed intervals: at equal values, an opening counts before a closing.
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
    let (mut count, mut best) = (0i32, 0i32);
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for (i, &(value, step)) in edges.iter().enumerate() {
        count += step;
        if step > 0 && count >= best {
            let end = edges.get(i + 1).map_or(value, |e| e.0);
            if count > best {
                (lo, hi) = (value, end);
            } else {
                hi = hi.max(end);
            }
            best = count;
        }
    }
    if 2 * best as usize <= samples.len() || !lo.is_finite() || !hi.is_finite() {
        return 0.0;
    }
    lo.abs().max(hi.abs())
}

/// Raises a line's standard errors to what its samples' brackets imply: each sample's midpoint lies within
/// its deviation of the truth, uniformly at worst (σ = deviation / √3), and a weighted fit through such samples
/// cannot know its intercept and rate better than that. A fit over few samples can state less by luck (its
/// residuals happened to line up), which is exactly when the data does not support it.
pub(super) fn bracket_floor(mut line: LineFit, samples: &[CalibrationSample]) -> LineFit {
    let weights: Vec<(f64, f64)> = samples
        .iter()
        .map(|s| {
            let x = s.source_ticks.wrapping_sub(line.origin_ticks) as i64 as f64;
            let sigma = (s.max_deviation_ns as f64 / 3f64.sqrt()).max(0.5);
            (x, 1.0 / (sigma * sigma))
        })
        .collect();
    let total: f64 = weights.iter().map(|(_, w)| w).sum();
    if !(total.is_finite() && total > 0.0) {
        return line;
    }
    let mean_x = weights.iter().map(|(x, w)| x * w).sum::<f64>() / total;
    let spread: f64 = weights.iter().map(|(x, w)| w * (x - mean_x).powi(2)).sum();
    // At the origin, which may sit off the weighted centroid: the rate's error reaches it over that distance.
    let intercept_var = 1.0 / total + mean_x.powi(2) / spread.max(f64::MIN_POSITIVE);
    line.intercept_sigma_ns = line.intercept_sigma_ns.max(intercept_var.sqrt());
    if spread > 0.0 {
        line.slope_sigma_ns_per_tick = line.slope_sigma_ns_per_tick.max(1.0 / spread.sqrt());
    }
    line
}

/// A burst's point: the tightest sample's ticks, where most of the burst's brackets agree the true reference
/// time lies there (each carried along `ns_per_tick`: a burst spans microseconds), the middle of that
/// agreement, and its variance (uniform across it). Marzullo's majority, so a few hidden outliers cannot
/// move it; as narrow as the tightest bracket or narrower, far better than any one sample's midpoint. When no
/// majority agrees, the median midpoint with the brackets' typical spread.
pub(super) fn burst_point(samples: &[CalibrationSample], ns_per_tick: f64) -> (u64, u64, f64) {
    let first = samples[0];
    let x = first.source_ticks;
    let carried = |s: &CalibrationSample| {
        (s.reference_ns as i128 - first.reference_ns as i128) as f64
            + (x as i128 - s.source_ticks as i128) as f64 * ns_per_tick
    };
    let mut edges: Vec<(f64, i32)> = Vec::with_capacity(2 * samples.len());
    for s in samples {
        let at = carried(s);
        edges.push((at - s.max_deviation_ns as f64, 1));
        edges.push((at + s.max_deviation_ns as f64, -1));
    }
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
    let (mut count, mut best, mut region) = (0i32, 0i32, (0.0, 0.0));
    for (i, &(value, step)) in edges.iter().enumerate() {
        count += step;
        if step > 0 && count > best {
            best = count;
            region = (value, edges.get(i + 1).map_or(value, |e| e.0));
        }
    }
    let (offset, variance) = if 2 * best as usize > samples.len() {
        let half = (region.1 - region.0) / 2.0;
        (region.0 + half, (half * half / 3.0).max(0.25))
    } else {
        let mut midpoints: Vec<f64> = samples.iter().map(carried).collect();
        let mean_dev = samples.iter().map(|s| s.max_deviation_ns as f64).sum::<f64>() / samples.len() as f64;
        // A median's variance is π/2 times the mean's.
        (
            median(&mut midpoints),
            std::f64::consts::FRAC_PI_2 * (mean_dev / 3f64.sqrt()).powi(2) / samples.len() as f64,
        )
    };
    let y = (first.reference_ns as i128)
        .saturating_add(offset.round() as i128)
        .clamp(0, u64::MAX as i128) as u64;
    (x, y, variance)
}
