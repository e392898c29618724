//! Breaks: each burst checked against the open segment's prediction, a burst that may be the first after a
//! break held as a suspect (and moved after the break when the next burst confirms it), and a new segment
//! started at a break or a reported reset.

use super::brackets::burst_point;
use super::segment::{Segment, Suspect};
use super::wander::{END_BOW, RATE_MISS};
use super::CalibrationHistory;
use crate::calibration::model::wander_sigma_ns;
use crate::calibration::CalibrationSample;

/// What a burst's check against the open segment's prediction found.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct BurstCheck {
    /// Most of its tighter half disagrees with the prediction on one side: the clock broke before it.
    pub(super) broken: bool,
    /// The prediction missed it by more than three standard errors: the window is too long for how the clock
    /// bends.
    pub(super) too_long: bool,
    /// Missed by more than two: maybe the first burst after a break (whether it lay late).
    pub(super) suspect: Option<bool>,
}

impl CalibrationHistory {
    /// Takes a suspect burst out of the open segment again: its fit, knot, window and points as before it.
    pub(super) fn restore(&mut self, suspect: &Suspect) {
        let Some(segment) = self.segments.back_mut() else {
            return;
        };
        segment.window.pop_back();
        if let Some(front) = suspect.popped_burst.clone() {
            segment.window.push_front(front);
        }
        segment.points.pop_back();
        if let Some(front) = suspect.popped_point {
            segment.points.push_front(front);
        }
        if suspect.knot_placed {
            segment.knots.pop_back();
        }
        segment.latest = suspect.pre_fit;
        segment.latest_public = suspect
            .pre_fit
            .map(|c| c.in_domain(self.domain).with_ticks_shifted(self.origin));
        segment.has_rate = suspect.pre_has_rate;
        segment.last_burst = suspect.pre_last_burst;
        self.refresh_floors();
    }

    /// Closes the open segment and opens a new one, carrying the old rate as a loose prior.
    ///
    /// A segment that broke before it fitted a rate of its own ran on a prior (the nominal rate, or one carried
    /// across an earlier break), and a burst that misses a prior's prediction may as well say the prior rate is
    /// off as that the clock jumped: the new segment's prior is four times looser than the old one's. Carried
    /// on with `break_rate_sigma_ppm` instead, a nominal rate a few hundred ppm off (after an early jump) or a
    /// few thousand (alone) made every later burst a break, and the history never fitted a rate.
    pub(super) fn start_segment(&mut self) {
        let carried_sigma = match self.open() {
            Some(open) if !open.has_rate => {
                let prior_sigma = open
                    .rate_prior
                    .map_or(self.config.nominal_rate_sigma_ppm, |(_, sigma)| sigma);
                (4.0 * prior_sigma).max(self.config.break_rate_sigma_ppm)
            }
            _ => self.config.break_rate_sigma_ppm,
        };
        let prior = self.latest_internal().map(|c| (c.ns_per_tick(), carried_sigma));
        self.segments
            .push_back(Segment::new(self.next_segment, prior, self.config.window_bursts));
        self.next_segment += 1;
        while self.segments.len() > self.config.max_segments {
            self.segments.pop_front();
        }
    }

    /// Checks a burst (unwrapped, widened, tightest first) against the open segment's prediction.
    pub(super) fn check_burst(&self, burst: &[CalibrationSample]) -> BurstCheck {
        let Some(fit) = self.latest_internal() else {
            return BurstCheck::default();
        };
        // The burst's ticks are unwrapped, as the fit is: no mask (a narrow counter wraps between the fit's
        // anchor and the burst, which the short way round would take for a break).
        let test = &burst[..burst.len().div_ceil(2)];
        let span_s = fit.span_s();
        // How far the map already misses its newest burst points: a line that bends away from a wandering
        // clock at its end misses the next burst by about twice as much, and that is no break.
        let recent_miss = self.open().map_or(0.0, |segment| {
            segment
                .points
                .iter()
                .rev()
                .take(2)
                .filter_map(|&(x, y, _)| {
                    let at = self.map_segment(segment, x)?;
                    Some((y as i128 - at.ns as i128).unsigned_abs() as f64)
                })
                .fold(0.0, f64::max)
        });
        // What the prediction can miss by beyond the line's own error: its bend at the window's end, and the
        // rate the clock has wandered to since.
        let wander = self.detection_wander();
        let bow = END_BOW * wander_sigma_ns(wander, span_s);
        let (mut above, mut below) = (0usize, 0usize);
        let mut residuals = Vec::with_capacity(test.len());
        let mut prediction_sigma = 0.0f64;
        for s in test {
            let ticks = s.source_ticks;
            let residual = (s.reference_ns as i128 - fit.to_reference_ns(ticks) as i128) as f64;
            residuals.push(residual);
            let beyond_s = fit.beyond_window_s(ticks);
            let rate_miss = RATE_MISS * wander * 1e-6 * span_s.sqrt() * beyond_s * 1e9;
            // The line's own error and the wander beyond its window (not the conversion's statement, which
            // allows for the wander's upper bound and states a rate miss of its own: `rate_miss` is this one's).
            let line = fit.line_and_wander_variance(ticks, wander).sqrt() + self.domain.half_resolution_ns() / 2.0;
            let sigma = (line.powi(2) + bow.powi(2) + rate_miss.powi(2)).sqrt();
            prediction_sigma = prediction_sigma.max(sigma);
            // Plus one resolution: a clock read with no bracket at all (a simulation) still rounds to its ticks.
            let tolerance = s.max_deviation_ns as f64
                + self.config.break_sigmas * sigma
                + 2.0 * recent_miss
                + self.domain.resolution_ns().max(1.0);
            if residual > tolerance {
                above += 1;
            } else if residual < -tolerance {
                below += 1;
            }
        }
        let broken = 2 * above.max(below) > test.len();
        let point = burst_point(burst, self.burst_rate());
        let miss = (point.1 as i128 - fit.to_reference_ns(point.0) as i128) as f64;
        let sigmas = miss.abs() / (prediction_sigma.powi(2) + point.2).sqrt();
        let rated = broken || self.open().is_some_and(|s| s.has_rate);
        BurstCheck {
            broken,
            too_long: rated && sigmas > 3.0,
            suspect: (rated && sigmas > 2.0).then_some(miss > 0.0),
        }
    }
}
