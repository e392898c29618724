//! [`CalibrationHistory`]: the live, piecewise-linear map of one source clock to the reference clock, kept in
//! segments that end where the clock broke.
//!
//! Samples arrive in bursts (a handful of bracketed reads taken back to back). Each burst's brackets are
//! widened by half the counter's resolution on both sides ([`ClockDomain::half_resolution_ns`]: a value read
//! from a coarse counter stands for an interval that wide) and only its tightest-bracketed samples are kept;
//! the kept samples of the recent bursts are fitted with the configured strategy, and the fitted line's value at
//! the window's centroid becomes a **knot** `(ticks, ns)`. Knots are where the line is known best (at the
//! centroid the rate's error does not contribute), they never move once placed, and consecutive knots of a
//! segment strictly increase in both coordinates.
//!
//! A tick between two knots is converted by interpolating between them (the Metal seed's two-point
//! conversion, with calibration points on both sides of the event). A tick after the newest knot is
//! converted by the newest fit, which passes through that knot, so the map is continuous. A tick before the
//! oldest knot is extrapolated backwards along the oldest segment.
//!
//! # Breaks and segments
//!
//! A clock can jump (a device reset, a power-state change) or change its rate at once (a thermal step). Each
//! burst is first checked against the newest fit's prediction: when most of its tighter half disagrees with it
//! by more than the samples' own brackets plus [`HistoryConfig::break_sigmas`] standard errors of the
//! prediction, the clock broke between the previous burst and this one. The history then closes the current
//! segment and starts a new one at this burst, with the old rate as a loose prior. No sample after a break
//! enters a fit before it, so conversions before the break keep the old segment's map. A backend can report a
//! reset it knows of ([`CalibrationHistory::report_reset`]): the next burst starts a segment unconditionally.
//!
//! Each segment answers for the reference times from the last burst before it to the first burst after it. A
//! tick in that gap can lie on either side of the break (its moment is unknown): every segment whose answer
//! falls in its own range is a candidate, and with two the conversion is their hull, marked
//! [`Placement::ambiguous`], narrowed by a window the caller knows (the CPU's `[recorded, read back]` for a GPU
//! timestamp). After a backwards jump one tick value occurs twice; the same rule tells the two apart.
//!
//! # Wander
//!
//! [`HistoryConfig::wander_ppm_per_sqrt_s`] is a prior, not a promise. The history measures the wander
//! itself: each burst gives a point (its tightest samples' offset), and the miss of a point from the chord of
//! two others about a second before and after it is what a wandering rate bends the phase by (a straight line
//! cancels exactly, whatever the drift). Less what the brackets explain, the median of those misses estimates
//! the wander, and the history uses the larger of the prior and that estimate in its stated uncertainty; when it
//! is larger it also shortens the fitted window to the length where a straight line's miss of the bending clock
//! costs no more than averaging gains.
//!
//! Memory is bounded: the sample window is `window_bursts` bursts, when `max_knots` is reached the older half of
//! a segment's knots is thinned to every second one, and at most `max_segments` segments are kept.
//!
//! # Where the code is
//!
//! This file holds the public types and the intake of a burst (unwrap, widen, check, push, refit). Beside it,
//! each using only the ones named before it: `segment` (one stretch of the map between breaks, its knots, and
//! the burst it holds as a suspect of a break), `brackets` (what the brackets say whatever the fit: Marzullo
//! agreement, floors, a burst's point), `wander` (measuring the rate's wander and what it does to the
//! window), `breaks` (the check of a burst against the prediction, restoring a suspect, starting a segment),
//! `refit` (the window's fit and the knot it places) and `placement` (converting a tick: choosing among
//! segments, interpolating between knots, the monotonic guard).

use std::collections::VecDeque;

use super::model::unwrap_ticks;
use super::{CalibrationError, CalibrationSample, ClockCalibration, ClockDomain, Converted, FitOptions, FitStrategy};

mod brackets;
mod breaks;
mod placement;
mod refit;
mod segment;
#[cfg(test)]
mod tests;
mod wander;

use brackets::burst_point;
use breaks::BurstCheck;
use segment::{Segment, Suspect};
use wander::{Innovation, MIN_WINDOW, WANDER_LAGS_NS};

/// Burst points kept per segment for the second differences.
const POINTS: usize = 64;

/// [`HistoryConfig::wander_ppm_per_sqrt_s`]'s default.
const DEFAULT_WANDER_PRIOR: f64 = 0.05;

/// How a [`CalibrationHistory`] filters, fits, detects breaks and remembers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HistoryConfig {
    /// The fit over the window (its `keep_tightest` applies to the whole window).
    pub fit: FitOptions,
    /// Fraction (0, 1] of each burst kept, the tightest-bracketed first.
    pub burst_keep: f64,
    /// How many recent bursts the fit spans at most (fewer when the clock wanders more than the prior says).
    pub window_bursts: usize,
    /// At most this many knots are kept per segment (at least 4); older ones are thinned.
    pub max_knots: usize,
    /// How much the source's rate wanders, as a random walk in ppm per √second (a crystal's temperature
    /// drift): the part of the error a straight-line fit cannot follow. A prior: the history measures the
    /// wander from its bursts and uses the larger of the two. It widens the stated uncertainty
    /// inside the window (the line cannot bend with the rate) and beyond it (see
    /// [`ClockCalibration::with_wander`]).
    ///
    /// The measurement needs five second differences of burst points at least about 1.5 s apart: about 5 s of
    /// bursts at 250 ms, seven bursts when they come seconds apart. Until then the stated uncertainty allows
    /// for five times this prior, and the estimate takes a few more to settle, so a clock that wanders far
    /// more than that is understated in its first seconds (an audit's clocks at 1 and 5 ppm/√s, 20-100 times
    /// the default prior, converted live with 250 ms bursts: seconds with 77-87 % of truths inside up to 11 s
    /// in; at 5 ppm/√s with bursts 2-10 s apart, such seconds during the first minute, none after): set the
    /// prior near what the clock is known to do.
    pub wander_ppm_per_sqrt_s: f64,
    /// Until the window spans this much reference time, only the offset is fitted and the rate is the
    /// previous segment's (or the domain's nominal one): a rate fitted over a few microseconds is worse.
    pub min_rate_span_ns: u64,
    /// The standard error, in ppm, assumed for the nominal rate while it is in use.
    pub nominal_rate_sigma_ppm: f64,
    /// A burst whose tighter half mostly disagrees with the newest fit's prediction, on one side, by more than
    /// the samples' brackets plus this many standard errors of the prediction starts a new segment (a detected
    /// break). `f64::INFINITY` turns detection off.
    pub break_sigmas: f64,
    /// The standard error, in ppm, of the rate a segment starts with after a break (the previous segment's
    /// rate: a step in rate is not known until the new segment spans `min_rate_span_ns`).
    pub break_rate_sigma_ppm: f64,
    /// At most this many segments are kept (at least 2); the oldest are dropped with their knots. A tick of a
    /// dropped segment then converts by the oldest segment kept (extrapolated back across the breaks between),
    /// wrong by those breaks and not marked: convert ticks before their segment goes.
    pub max_segments: usize,
    /// How many standard errors of the map a conversion states (plus half the counter's resolution). Every
    /// timestamp converted with one fit shares that fit's error, so the errors of a whole second of timestamps
    /// move together: two standard errors (95 % of single timestamps) would leave the worst of a run's seconds
    /// largely outside, three keep at least 95 % inside in every second (measured in `tests/it/gpu_clocks.rs`).
    pub uncertainty_sigmas: f64,
}

impl HistoryConfig {
    /// Whether every setting is in its range: `burst_keep` and the fit's `keep_tightest` in (0, 1],
    /// `window_bursts` at least 1, `max_knots` at least 4, `max_segments` at least 2, the ppm and sigma settings
    /// finite and not negative (`break_sigmas` may be `f64::INFINITY`: no break detection), `uncertainty_sigmas`
    /// above 0.
    ///
    /// ```
    /// use tickline::calibration::HistoryConfig;
    /// assert!(HistoryConfig::default().validate().is_ok());
    /// let none_kept = HistoryConfig { burst_keep: 0.0, ..Default::default() };
    /// assert!(none_kept.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), CalibrationError> {
        let fraction = |v: f64| v > 0.0 && v <= 1.0;
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        let checks: [(bool, &'static str); 10] = [
            (fraction(self.burst_keep), "burst_keep must be in (0, 1]"),
            (fraction(self.fit.keep_tightest), "fit.keep_tightest must be in (0, 1]"),
            (self.window_bursts >= 1, "window_bursts must be at least 1"),
            (self.max_knots >= 4, "max_knots must be at least 4"),
            (self.max_segments >= 2, "max_segments must be at least 2"),
            (
                non_negative(self.wander_ppm_per_sqrt_s),
                "wander_ppm_per_sqrt_s must be finite and not negative",
            ),
            (
                non_negative(self.nominal_rate_sigma_ppm),
                "nominal_rate_sigma_ppm must be finite and not negative",
            ),
            (
                self.break_sigmas > 0.0,
                "break_sigmas must be above 0 (infinity: no break detection)",
            ),
            (
                non_negative(self.break_rate_sigma_ppm),
                "break_rate_sigma_ppm must be finite and not negative",
            ),
            (
                self.uncertainty_sigmas.is_finite() && self.uncertainty_sigmas > 0.0,
                "uncertainty_sigmas must be finite and above 0",
            ),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some(&(_, what)) => Err(CalibrationError::InvalidConfig { what }),
            None => Ok(()),
        }
    }
}

impl Default for HistoryConfig {
    fn default() -> Self {
        HistoryConfig {
            fit: FitOptions {
                keep_tightest: 1.0,
                strategy: FitStrategy::Huber,
                ..FitOptions::default()
            },
            burst_keep: 0.25,
            window_bursts: 16,
            max_knots: 4096,
            wander_ppm_per_sqrt_s: DEFAULT_WANDER_PRIOR,
            min_rate_span_ns: 20_000_000,
            nominal_rate_sigma_ppm: 500.0,
            break_sigmas: 5.0,
            break_rate_sigma_ppm: 50.0,
            max_segments: 64,
            uncertainty_sigmas: 3.0,
        }
    }
}

/// Counters and the latest figures of a [`CalibrationHistory`], for reports and counter tracks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HistoryStats {
    /// Bursts added.
    pub bursts: u64,
    /// Samples offered in those bursts.
    pub samples_offered: u64,
    /// Knots currently held (all segments).
    pub knots: usize,
    /// Bursts whose fit failed (too few samples, degenerate) or would have broken monotonicity.
    pub rejected: u64,
    /// Conversions whose result was held back to keep the output monotonic across a refit.
    pub monotonic_clamps: u64,
    /// Segments currently held.
    pub segments: usize,
    /// Breaks detected from the samples (jumps, rate steps).
    pub breaks: u64,
    /// Resets reported by the source ([`CalibrationHistory::report_reset`]) and applied.
    pub resets: u64,
    /// The rate wander in use, ppm/√s: the larger of the prior and the one measured.
    pub wander_ppm_per_sqrt_s: f64,
    /// Bursts the newest fit spans.
    pub window_bursts: usize,
    /// Drift of the newest fit, in ppm of the nominal rate.
    pub drift_ppm: f64,
    /// ±1σ of the newest fit's residuals, ns.
    pub error_bound_ns: f64,
    /// The largest bracket half-width the newest fit used (widened by half the resolution), ns.
    pub max_deviation_ns: u64,
}

/// Where a tick lies on the reference clock, with what the history knows about the choice it made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// The conversion and its uncertainty.
    pub converted: Converted,
    /// The segment used (numbered from 0 in the order they started); for an ambiguous placement, the newest
    /// of the candidates.
    pub segment: u64,
    /// The tick lies where two segments both claim it (between the last burst before a break and the first
    /// after it; after a reset to a lower count, also a tick of either count that the other reaches too: see
    /// [`CalibrationHistory::place`]): `converted` is the hull of their answers, narrowed by the window when one
    /// was given.
    pub ambiguous: bool,
    /// No segment's answer (with its uncertainty) meets the window given: the calibration and the window
    /// disagree. `converted` is the calibration's own answer.
    pub outside_window: bool,
}

/// The live, piecewise-linear map of one source clock domain to the reference clock.
///
/// ```
/// use tickline::calibration::sim::{SimClockConfig, SimClockPair};
/// use tickline::calibration::{CalibrationHistory, HistoryConfig};
///
/// let mut pair = SimClockPair::new(SimClockConfig { drift_ppm: 200.0, jitter_ns: 1_000.0, ..Default::default() })
///     .unwrap();
/// let mut history = CalibrationHistory::new(pair.domain(), HistoryConfig::default());
/// for _ in 0..40 {
///     let burst: Vec<_> = (0..16).map(|_| pair.sample()).collect();
///     history.add_burst(&burst).unwrap();
///     let next = pair.now_ns() + 250_000_000;
///     pair.advance_to(next);
/// }
/// let t = pair.now_ns() - 3_000_000_000;
/// let converted = history.convert(pair.true_ticks_at(t)).unwrap();
/// assert!(converted.ns.abs_diff(t) < 200, "{converted:?} vs {t}");
/// ```
#[derive(Clone, Debug)]
pub struct CalibrationHistory {
    domain: ClockDomain,
    config: HistoryConfig,
    /// Oldest first; the last one is open (takes new bursts).
    segments: VecDeque<Segment>,
    next_segment: u64,
    /// The newest sample's raw (masked) and unwrapped ticks: the unwrapping reference.
    unwrap_ref: Option<(u64, u64)>,
    /// The source tick the history's own count starts from: unwrapped ticks are `raw - origin` (wrapping), so
    /// that a 64-bit counter first seen in the top half of its range (an arbitrary epoch) is not counted past
    /// 2^64 as it wraps, which would put every later tick before the earlier ones. 0 otherwise (a counter of
    /// fewer bits, or one read low: 2^63 ticks from overflowing), so the count is the source's ticks.
    origin: u64,
    /// A reset was reported: the next burst starts a segment.
    reset_pending: bool,
    /// Recent second differences of burst points, one list per lag of [`WANDER_LAGS_NS`].
    innovations: [VecDeque<Innovation>; WANDER_LAGS_NS.len()],
    /// The wander in use (ppm/√s): the estimate, for the window's length.
    wander: f64,
    /// The wander the stated uncertainty allows for once measured (ppm/√s): the estimate's upper confidence
    /// bound, wider while few independent second differences stand behind it.
    wander_bound: f64,
    /// The longest reference time between two consecutive bursts so far: how long the history has gone
    /// without one, which bounds how far past its newest burst a tick converted now can plausibly lie.
    longest_burst_gap_ns: u64,
    stats: HistoryStats,
}

/// The median of `values` (0 for none); reorders them.
fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

impl CalibrationHistory {
    /// An empty history for `domain`.
    pub fn new(domain: ClockDomain, config: HistoryConfig) -> Self {
        let positive_or = |value: f64, fallback: f64| {
            if value.is_finite() {
                value.abs()
            } else {
                fallback
            }
        };
        let config = HistoryConfig {
            window_bursts: config.window_bursts.max(1),
            max_knots: config.max_knots.max(4),
            max_segments: config.max_segments.max(2),
            burst_keep: if config.burst_keep.is_finite() {
                config.burst_keep.clamp(f64::MIN_POSITIVE, 1.0)
            } else {
                1.0
            },
            wander_ppm_per_sqrt_s: positive_or(config.wander_ppm_per_sqrt_s, 0.0),
            nominal_rate_sigma_ppm: positive_or(config.nominal_rate_sigma_ppm, 500.0),
            break_rate_sigma_ppm: positive_or(config.break_rate_sigma_ppm, 50.0),
            uncertainty_sigmas: if config.uncertainty_sigmas.is_finite() && config.uncertainty_sigmas > 0.0 {
                config.uncertainty_sigmas
            } else {
                3.0
            },
            break_sigmas: if config.break_sigmas.is_nan() {
                5.0
            } else {
                config.break_sigmas.abs()
            },
            ..config
        };
        CalibrationHistory {
            domain,
            wander: config.wander_ppm_per_sqrt_s,
            wander_bound: config.wander_ppm_per_sqrt_s,
            longest_burst_gap_ns: 0,
            config,
            segments: VecDeque::new(),
            next_segment: 0,
            unwrap_ref: None,
            origin: 0,
            reset_pending: false,
            innovations: Default::default(),
            stats: HistoryStats::default(),
        }
    }

    /// The source domain this history maps.
    pub fn domain(&self) -> ClockDomain {
        self.domain
    }

    /// The configuration in force (sanitised).
    pub fn config(&self) -> &HistoryConfig {
        &self.config
    }

    fn open(&self) -> Option<&Segment> {
        self.segments.back()
    }

    /// The newest fit, passing through the newest knot: what converts ticks after it.
    pub fn latest(&self) -> Option<&ClockCalibration> {
        self.open().and_then(|s| s.latest_public.as_ref())
    }

    /// The newest fit in the history's own count (see `origin`).
    fn latest_internal(&self) -> Option<&ClockCalibration> {
        self.open().and_then(|s| s.latest.as_ref())
    }

    /// Counters and the newest figures.
    pub fn stats(&self) -> HistoryStats {
        HistoryStats {
            knots: self.segments.iter().map(|s| s.knots.len()).sum(),
            segments: self.segments.len(),
            wander_ppm_per_sqrt_s: self.wander,
            ..self.stats
        }
    }

    /// The number of the segment new bursts go to (0 before the first break), `None` before the first burst.
    pub fn current_segment(&self) -> Option<u64> {
        self.open().map(|s| s.id)
    }

    /// The unwrapped tick of the newest knot of the current segment: ticks up to here convert two-sided.
    pub fn newest_knot_ticks(&self) -> Option<u64> {
        self.open()
            .and_then(|s| s.knots.back())
            .map(|k| k.ticks.wrapping_add(self.origin))
    }

    /// The reference time (ns) of the newest burst, `None` before the first: a tick read before it converts
    /// with a calibration point after it, and any break before it has been seen.
    pub fn newest_burst_ns(&self) -> Option<u64> {
        self.open().filter(|s| !s.window.is_empty()).map(|s| s.last_burst.1)
    }

    /// Says that the source clock was reset (a device lost and recreated, a counter restarted): the next burst
    /// starts a new segment whatever its samples say.
    pub fn report_reset(&mut self) {
        self.reset_pending = true;
    }

    /// Adds one burst of samples (taken close together, in any order) and refits.
    ///
    /// The burst is first checked against the current fit; a break starts a new segment with it. Its samples
    /// are kept even when the fit fails (they may carry a later fit); the error says why this burst produced no
    /// fit.
    pub fn add_burst(&mut self, samples: &[CalibrationSample]) -> Result<(), CalibrationError> {
        self.stats.bursts += 1;
        self.stats.samples_offered += samples.len() as u64;
        if samples.is_empty() {
            self.stats.rejected += 1;
            return Err(CalibrationError::TooFewSamples { needed: 1, got: 0 });
        }
        let mut burst = self.unwrap_burst(samples);
        if let Some(newest) = self.segments.back() {
            let at = burst.iter().map(|s| s.reference_ns).min().unwrap_or(0);
            self.longest_burst_gap_ns = self.longest_burst_gap_ns.max(at.saturating_sub(newest.last_burst.1));
        }
        // A value read from a counter that changes every `resolution` stands for an interval that wide: its
        // middle lies within half of it either side of the read.
        let widen = self.domain.half_resolution_ns().floor() as u64;
        for s in &mut burst {
            s.max_deviation_ns = s.max_deviation_ns.saturating_add(widen);
        }
        burst.sort_by_key(|s| s.max_deviation_ns);

        let reported = std::mem::take(&mut self.reset_pending);
        let check = if reported {
            BurstCheck::default()
        } else {
            self.check_burst(&burst)
        };
        let (broken, too_long) = (check.broken, check.too_long);
        if let Some(segment) = self.segments.back_mut().filter(|_| !broken) {
            // The window's length adapts before the wander estimate can (it needs seconds of points): a burst
            // the current fit predicts worse than its own statistics allow halves it, every other burst lets it
            // grow back by one.
            segment.window_limit = if too_long {
                (self.stats.window_bursts / 2).max(MIN_WINDOW)
            } else {
                (segment.window_limit + 1).min(self.config.window_bursts)
            };
        }
        let previous_suspect = self.segments.back_mut().and_then(|s| s.suspect.take());
        let mut moved_across_break = false;
        if reported || broken || self.segments.is_empty() {
            if reported {
                self.stats.resets += 1;
            } else if broken {
                self.stats.breaks += 1;
            }
            // The burst before a detected break, already off on the same side, belongs after the break: it
            // leaves the old segment (which gets back its fit from before it) and starts the new one.
            let moved = previous_suspect.filter(|s| broken && check.suspect == Some(s.late));
            if let Some(suspect) = &moved {
                self.restore(suspect);
            }
            self.start_segment();
            if let Some(suspect) = moved {
                let _ = self.push_burst(suspect.burst, suspect.point, None);
                moved_across_break = true;
            }
        }

        // The burst's point, from all its samples (before the tightest are kept for the fit).
        let burst_point = burst_point(&burst, self.burst_rate());
        let keep = ((burst.len() as f64 * self.config.burst_keep).ceil() as usize).clamp(1, burst.len());
        burst.truncate(keep);
        let suspect = check.suspect.filter(|_| !broken && !reported);
        let pushed = self.push_burst(burst, burst_point, suspect);
        if moved_across_break {
            // The moved burst only missed its prediction: the break may lie after it, up to this burst.
            if let Some(segment) = self.segments.back_mut() {
                segment.sure_from = segment.last_burst;
            }
        }
        pushed
    }

    /// Adds a burst's kept samples (tightest first) and its point to the open segment and refits; for a
    /// `suspect` (`Some(whether it lay late)`), remembers what is needed to take it out again.
    fn push_burst(
        &mut self,
        burst: Vec<CalibrationSample>,
        burst_point: (u64, u64, f64),
        suspect: Option<bool>,
    ) -> Result<(), CalibrationError> {
        let point = (burst[0].source_ticks, burst[0].reference_ns);
        let window_bursts = self.config.window_bursts;
        let segment = self.segments.back_mut().expect("a segment was just ensured");
        let pre = suspect.map(|late| {
            (
                late,
                segment.latest,
                segment.has_rate,
                segment.last_burst,
                segment.knots.back().copied(),
                burst.clone(),
            )
        });
        if segment.window.is_empty() {
            segment.first_burst = point;
            segment.sure_from = point;
        }
        segment.last_burst = point;
        segment.points.push_back(burst_point);
        let popped_point = (segment.points.len() > POINTS)
            .then(|| segment.points.pop_front())
            .flatten();
        segment.window.push_back(burst);
        let popped_burst = (segment.window.len() > window_bursts)
            .then(|| segment.window.pop_front())
            .flatten();
        let points_snapshot = segment.points.clone();
        self.add_innovations(&points_snapshot);
        let result = self.refit();
        if result.is_err() {
            self.stats.rejected += 1;
        }
        self.refresh_floors();
        let segment = self.segments.back_mut().expect("a segment was just ensured");
        segment.suspect = pre.map(
            |(late, pre_fit, pre_has_rate, pre_last_burst, pre_knot, burst)| Suspect {
                pre_fit,
                pre_has_rate,
                pre_last_burst,
                knot_placed: segment.knots.back().copied() != pre_knot,
                popped_burst,
                popped_point,
                burst,
                point: burst_point,
                late,
            },
        );
        result
    }

    /// The rate a burst's brackets are carried along to its point: the newest fit's, once it measured one (the
    /// nominal rate can be hundreds of ppm off: over a burst of tens of µs, several ns that the point's stated
    /// width would not hold), else the nominal one.
    fn burst_rate(&self) -> f64 {
        match self.open() {
            Some(segment) if segment.has_rate => segment
                .latest
                .as_ref()
                .map_or(self.domain.nominal_ns_per_tick(), |c| c.ns_per_tick()),
            _ => self.domain.nominal_ns_per_tick(),
        }
    }

    /// Unwraps a burst's ticks against the newest sample seen, so the history holds one continuous count.
    fn unwrap_burst(&mut self, samples: &[CalibrationSample]) -> Vec<CalibrationSample> {
        let mut sorted = unwrap_ticks(samples, self.domain);
        let mask = self.domain.mask();
        let first_raw = samples
            .iter()
            .min_by_key(|s| s.reference_ns)
            .map(|s| s.source_ticks & mask)
            .unwrap_or(0);
        let shift = match self.unwrap_ref {
            // unwrap_ticks started the burst at its first raw value; move it next to the previous sample.
            Some((prev_raw, prev_ext)) => prev_ext
                .wrapping_add(self.domain.delta_ticks(prev_raw, first_raw) as u64)
                .wrapping_sub(first_raw),
            None => {
                const TOP_HALF: u64 = 1 << 63;
                if mask == u64::MAX && first_raw >= TOP_HALF {
                    // Counted from 2^62 below the first tick: 2^62 ticks of room either way.
                    self.origin = first_raw - (1 << 62);
                }
                0u64.wrapping_sub(self.origin)
            }
        };
        for s in &mut sorted {
            s.source_ticks = s.source_ticks.wrapping_add(shift);
        }
        if let Some(last) = sorted.last() {
            self.unwrap_ref = Some((last.source_ticks.wrapping_add(self.origin) & mask, last.source_ticks));
        }
        sorted
    }

    /// Extends a raw (masked) tick to the history's unwrapped count: the nearest value to the newest sample.
    fn extend(&self, raw: u64) -> Option<u64> {
        let (ref_raw, ref_ext) = self.unwrap_ref?;
        Some(ref_ext.wrapping_add(self.domain.delta_ticks(ref_raw, raw & self.domain.mask()) as u64))
    }
}
