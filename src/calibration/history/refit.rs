//! The fit over the open segment's window, the knot it places, and the offset-only fit used until the window
//! spans enough time for a rate.

use super::brackets::{bracket_agreement_ns, bracket_floor};
use super::segment::{push_knot, Knot};
use super::wander::{END_BOW, WINDOW_BOW};
use super::CalibrationHistory;
use crate::calibration::model::wander_sigma_ns;
use crate::calibration::{fit_line, CalibrationError, CalibrationSample, ClockCalibration, LineFit};

impl CalibrationHistory {
    pub(super) fn refit(&mut self) -> Result<(), CalibrationError> {
        let segment = self.open().expect("refit after a burst");
        let bursts = self.effective_window(segment);
        let samples: Vec<CalibrationSample> = segment
            .window
            .iter()
            .skip(segment.window.len() - bursts)
            .flatten()
            .copied()
            .collect();
        let span_ns = match (
            samples.iter().map(|s| s.reference_ns).min(),
            samples.iter().map(|s| s.reference_ns).max(),
        ) {
            (Some(lo), Some(hi)) => hi - lo,
            _ => 0,
        };
        let has_rate = span_ns >= self.config.min_rate_span_ns;
        let line = if has_rate {
            bracket_floor(fit_line(&samples, &self.config.fit)?, &samples)
        } else {
            self.fit_offset_only(&samples, segment.rate_prior)?
        };
        let calibrated_at = samples.iter().map(|s| s.reference_ns).max().unwrap_or(0);
        // In the history's unwrapped count: see `ClockDomain::unwrapped`.
        let fitted = ClockCalibration::from_line(&line, self.domain.unwrapped(), calibrated_at)?
            .with_wander(self.stated_wander());
        // The line's bow by the wander: what the estimate says (the statement beyond the window allows for its
        // upper bound, through `with_wander`); the line's error also sets how large a miss is a break.
        let wander = self.detection_wander();
        // A straight line through a wandering rate misses the truth at the centroid by a share of the phase
        // the walk accumulates over the window, and by more towards the window's newest end. What the burst
        // points show beats what the wander says: when they scatter about the line by more than their noise,
        // the line misfits by that excess (at the window's end about twice its RMS, by Monte Carlo over a random
        // walk), even before the wander has been measured.
        let span_s = span_ns as f64 * 1e-9;
        let misfit = self.open().map_or(0.0, |segment| {
            let points: Vec<&(u64, u64, f64)> = segment.points.iter().rev().take(bursts).collect();
            if points.len() < 3 {
                return 0.0;
            }
            let squares: f64 = points
                .iter()
                .map(|&&(x, y, _)| (y as i128 - fitted.to_reference_ns(x) as i128) as f64)
                .map(|r| r * r)
                .sum();
            // Only the scatter beyond what noise alone reaches at one standard deviation of its chi-square
            // counts: noise alone must not widen every statement.
            let dof = (points.len() - 2) as f64;
            let noise = points.iter().map(|p| p.2).sum::<f64>() / points.len() as f64;
            (squares / dof - noise * (1.0 + (2.0 / dof).sqrt())).max(0.0).sqrt()
        });
        let model_sigma = (WINDOW_BOW * wander_sigma_ns(wander, span_s)).max(1.2 * misfit);
        let end_sigma = (END_BOW * wander_sigma_ns(wander, span_s)).max(2.0 * misfit);
        // Averaging shrinks the error of unbiased brackets; brackets lopsided the same way (a driver that makes a
        // timestamp readable late, so every midpoint is late: lavapipe's submit probe, ~14 µs) do not average
        // out. Each bracket still holds its truth, so the truth at the knot lies where the window's brackets,
        // carried along the fitted line, agree: never state less than the distance from the knot to the far
        // edge of that agreement. Unbiased brackets agree on a narrow interval around the fit, so this costs them
        // nothing.
        let agreement_ns = bracket_agreement_ns(&samples, line.origin_ticks, &line, fitted.anchor_ns());
        let fitted = fitted
            .with_min_intercept_sigma(agreement_ns / 2.0)
            .with_model_sigma(end_sigma);
        let sigma_ns = (line.intercept_sigma_ns.powi(2) + model_sigma.powi(2))
            .sqrt()
            .max(agreement_ns / 2.0);
        let knot = Knot {
            ticks: line.origin_ticks,
            ns: fitted.anchor_ns(),
            sigma_ns,
        };
        let (max_knots, origin) = (self.config.max_knots, self.origin);
        let segment = self.segments.back_mut().expect("refit after a burst");
        let mut place_knot = true;
        if let Some(prev) = segment.knots.back() {
            // A knot before the previous one: the window shrank back (the wander grew); keep the old knots.
            // A knot later in ticks but not in time is a fit gone wrong.
            if knot.ticks <= prev.ticks {
                place_knot = false;
            } else if knot.ns <= prev.ns {
                return Err(CalibrationError::NonFinite {
                    what: "knot (not after the previous one)",
                });
            }
        }
        if place_knot {
            push_knot(&mut segment.knots, knot, max_knots);
        }
        segment.has_rate = has_rate;
        segment.latest = Some(fitted);
        segment.latest_public = Some(fitted.in_domain(self.domain).with_ticks_shifted(origin));
        self.stats.window_bursts = bursts;
        self.stats.drift_ppm = fitted.drift_ppm();
        self.stats.error_bound_ns = fitted.error_bound_ns();
        self.stats.max_deviation_ns = fitted.max_deviation_ns();
        Ok(())
    }

    /// Offset-only fit with a known rate (carried over a break, or the domain's nominal one): the median of the
    /// samples' offsets from that line, robust to outliers, with the rate's assumed error as its slope error.
    fn fit_offset_only(
        &self,
        samples: &[CalibrationSample],
        rate_prior: Option<(f64, f64)>,
    ) -> Result<LineFit, CalibrationError> {
        let mut kept: Vec<CalibrationSample> = samples.to_vec();
        kept.sort_by_key(|s| s.max_deviation_ns);
        let keep = ((kept.len() as f64 * self.config.fit.keep_tightest).ceil() as usize).clamp(1, kept.len().max(1));
        kept.truncate(keep);
        let Some(origin) = kept.iter().min_by_key(|s| s.source_ticks).copied() else {
            return Err(CalibrationError::TooFewSamples { needed: 1, got: 0 });
        };
        let (slope, sigma_ppm) =
            rate_prior.unwrap_or((self.domain.nominal_ns_per_tick(), self.config.nominal_rate_sigma_ppm));
        let mut offsets: Vec<f64> = kept
            .iter()
            .map(|s| {
                let dx = s.source_ticks.wrapping_sub(origin.source_ticks) as i64 as f64;
                (s.reference_ns as i128 - origin.reference_ns as i128) as f64 - slope * dx
            })
            .collect();
        offsets.sort_by(f64::total_cmp);
        let median = offsets[offsets.len() / 2];
        let mean_dev = kept.iter().map(|s| s.max_deviation_ns as f64).sum::<f64>() / kept.len() as f64;
        let max_dev = kept.iter().map(|s| s.max_deviation_ns).max().unwrap_or(0);
        let mut abs_dev: Vec<f64> = offsets.iter().map(|o| (o - median).abs()).collect();
        abs_dev.sort_by(f64::total_cmp);
        let spread = 1.4826 * abs_dev[abs_dev.len() / 2];
        let sigma = spread.max(mean_dev / 3f64.sqrt()).max(1.0);
        // Sample at the median tick of the kept samples as the origin, so the knot sits inside the data.
        let mut ticks: Vec<u64> = kept.iter().map(|s| s.source_ticks).collect();
        ticks.sort_unstable();
        let mid_ticks = ticks[ticks.len() / 2];
        let dx_mid = mid_ticks.wrapping_sub(origin.source_ticks) as i64 as f64;
        let value = median + slope * dx_mid;
        let origin_ns = (origin.reference_ns as i128)
            .saturating_add(value.round() as i128)
            .clamp(0, u64::MAX as i128) as u64;
        Ok(LineFit {
            origin_ticks: mid_ticks,
            origin_ns,
            intercept_ns: 0.0,
            slope_ns_per_tick: slope,
            intercept_sigma_ns: sigma / (kept.len() as f64).sqrt(),
            slope_sigma_ns_per_tick: slope * sigma_ppm * 1e-6,
            residual_sigma_ns: spread,
            used_samples: kept.len(),
            first_ticks: ticks[0],
            last_ticks: ticks[ticks.len() - 1],
            max_deviation_ns: max_dev,
        })
    }
}
