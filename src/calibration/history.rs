//! [`CalibrationHistory`]: the live, piecewise-linear map of one source clock to the reference clock.
//!
//! Samples arrive in bursts (a handful of bracketed reads taken back to back). Each burst keeps only its
//! tightest-bracketed samples; the kept samples of the last `window_bursts` bursts are fitted with the
//! configured strategy, and the fitted line's value at the window's centroid becomes a **knot**
//! `(ticks, ns)`. Knots are where the line is known best (at the centroid the rate's error does not
//! contribute), they never move once placed, and consecutive knots strictly increase in both coordinates.
//!
//! A tick between two knots is converted by interpolating between them (the Metal seed's two-point
//! conversion, with calibration points on both sides of the event). A tick after the newest knot is
//! converted by the newest fit, which passes through that knot, so the map is continuous. A tick before the
//! oldest knot is extrapolated backwards along the oldest segment.
//!
//! Memory is bounded: the sample window is `window_bursts` bursts, and when `max_knots` is reached the older
//! half of the knots is thinned to every second one, so the map covers hours at coarser resolution where it
//! is old.

use std::collections::VecDeque;

use super::model::{unwrap_ticks, wander_sigma_ns};

/// Share of the window's wander phase a line fit misses at the window's centroid.
const WINDOW_BOW: f64 = 0.15;
use super::{
    fit_line, CalibrationError, CalibrationSample, ClockCalibration, ClockDomain, Converted, FitOptions, FitStrategy,
    LineFit,
};

/// How a [`CalibrationHistory`] filters, fits and remembers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HistoryConfig {
    /// The fit over the window (its `keep_tightest` applies to the whole window).
    pub fit: FitOptions,
    /// Fraction (0, 1] of each burst kept, the tightest-bracketed first.
    pub burst_keep: f64,
    /// How many recent bursts the fit spans.
    pub window_bursts: usize,
    /// At most this many knots are kept (at least 4); older ones are thinned.
    pub max_knots: usize,
    /// How much the source's rate wanders, as a random walk in ppm per √second (a crystal's temperature
    /// drift): the part of the error a straight-line fit cannot follow. It widens the stated uncertainty
    /// inside the window (the line cannot bend with the rate) and beyond it (see
    /// [`ClockCalibration::with_wander`]).
    pub wander_ppm_per_sqrt_s: f64,
    /// Until the window spans this much reference time, only the offset is fitted and the rate is the
    /// domain's nominal one: a rate fitted over a few microseconds is worse than the nominal rate.
    pub min_rate_span_ns: u64,
    /// The standard error, in ppm, assumed for the nominal rate while it is in use.
    pub nominal_rate_sigma_ppm: f64,
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
            wander_ppm_per_sqrt_s: 0.05,
            min_rate_span_ns: 20_000_000,
            nominal_rate_sigma_ppm: 500.0,
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
    /// Knots currently held.
    pub knots: usize,
    /// Bursts whose fit failed (too few samples, degenerate) or whose knot would have broken monotonicity.
    pub rejected: u64,
    /// Conversions whose result was held back to keep the output monotonic across a refit.
    pub monotonic_clamps: u64,
    /// Drift of the newest fit, in ppm of the nominal rate.
    pub drift_ppm: f64,
    /// ±1σ of the newest fit's residuals, ns.
    pub error_bound_ns: f64,
    /// The largest bracket half-width the newest fit used, ns.
    pub max_deviation_ns: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Knot {
    /// Unwrapped ticks.
    ticks: u64,
    ns: u64,
    /// Standard error of `ns`.
    sigma_ns: f64,
}

/// The live, piecewise-linear map of one source clock domain to the reference clock.
///
/// ```
/// use tickline::calibration::sim::{SimClockConfig, SimClockPair};
/// use tickline::{CalibrationHistory, HistoryConfig};
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
    /// Kept samples of the recent bursts (unwrapped ticks), one entry per burst.
    window: VecDeque<Vec<CalibrationSample>>,
    knots: VecDeque<Knot>,
    latest: Option<ClockCalibration>,
    /// The newest sample's raw (masked) and unwrapped ticks: the unwrapping reference.
    unwrap_ref: Option<(u64, u64)>,
    /// The largest input converted so far and its output, for monotonic output.
    high_water: Option<(u64, u64)>,
    stats: HistoryStats,
}

/// How far the truth at `knot_ticks` can lie from `knot_ns` if every sample's bracket holds it: each bracket
/// `reference ± deviation`, carried to `knot_ticks` along `ns_per_tick`, is intersected; the result is the
/// distance from `knot_ns` to the intersection's far edge, or 0 when the brackets do not all overlap.
fn bracket_agreement_ns(samples: &[CalibrationSample], knot_ticks: u64, ns_per_tick: f64, knot_ns: u64) -> f64 {
    let (mut lo, mut hi) = (f64::NEG_INFINITY, f64::INFINITY);
    for s in samples {
        let carried = (knot_ticks as i128 - s.source_ticks as i128) as f64 * ns_per_tick;
        let at_knot = (s.reference_ns as i128 - knot_ns as i128) as f64 + carried;
        lo = lo.max(at_knot - s.max_deviation_ns as f64);
        hi = hi.min(at_knot + s.max_deviation_ns as f64);
    }
    if lo > hi || !lo.is_finite() || !hi.is_finite() {
        return 0.0;
    }
    lo.abs().max(hi.abs())
}

impl CalibrationHistory {
    /// An empty history for `domain`.
    pub fn new(domain: ClockDomain, config: HistoryConfig) -> Self {
        let config = HistoryConfig {
            window_bursts: config.window_bursts.max(1),
            max_knots: config.max_knots.max(4),
            burst_keep: if config.burst_keep.is_finite() {
                config.burst_keep.clamp(f64::MIN_POSITIVE, 1.0)
            } else {
                1.0
            },
            wander_ppm_per_sqrt_s: if config.wander_ppm_per_sqrt_s.is_finite() {
                config.wander_ppm_per_sqrt_s.abs()
            } else {
                0.0
            },
            nominal_rate_sigma_ppm: if config.nominal_rate_sigma_ppm.is_finite() {
                config.nominal_rate_sigma_ppm.abs()
            } else {
                500.0
            },
            ..config
        };
        CalibrationHistory {
            domain,
            config,
            window: VecDeque::new(),
            knots: VecDeque::new(),
            latest: None,
            unwrap_ref: None,
            high_water: None,
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

    /// The newest fit, passing through the newest knot: what converts ticks after it.
    pub fn latest(&self) -> Option<&ClockCalibration> {
        self.latest.as_ref()
    }

    /// Counters and the newest figures.
    pub fn stats(&self) -> HistoryStats {
        HistoryStats {
            knots: self.knots.len(),
            ..self.stats
        }
    }

    /// The unwrapped tick of the newest knot: ticks up to here convert two-sided.
    pub fn newest_knot_ticks(&self) -> Option<u64> {
        self.knots.back().map(|k| k.ticks)
    }

    /// Adds one burst of samples (taken close together, in any order) and refits.
    ///
    /// The burst's samples are kept even when the fit fails (they may carry a later fit); the error says why
    /// this burst produced no knot.
    pub fn add_burst(&mut self, samples: &[CalibrationSample]) -> Result<(), CalibrationError> {
        self.stats.bursts += 1;
        self.stats.samples_offered += samples.len() as u64;
        if samples.is_empty() {
            self.stats.rejected += 1;
            return Err(CalibrationError::TooFewSamples { needed: 1, got: 0 });
        }
        let mut burst = self.unwrap_burst(samples);
        burst.sort_by_key(|s| s.max_deviation_ns);
        let keep = ((burst.len() as f64 * self.config.burst_keep).ceil() as usize).clamp(1, burst.len());
        burst.truncate(keep);
        self.window.push_back(burst);
        while self.window.len() > self.config.window_bursts {
            self.window.pop_front();
        }
        match self.refit() {
            Ok(()) => Ok(()),
            Err(e) => {
                self.stats.rejected += 1;
                Err(e)
            }
        }
    }

    /// Unwraps a burst's ticks against the newest sample seen, so the window holds one continuous count.
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
            None => 0,
        };
        for s in &mut sorted {
            s.source_ticks = s.source_ticks.wrapping_add(shift);
        }
        if let Some(last) = sorted.last() {
            self.unwrap_ref = Some((last.source_ticks & mask, last.source_ticks));
        }
        sorted
    }

    fn refit(&mut self) -> Result<(), CalibrationError> {
        let samples: Vec<CalibrationSample> = self.window.iter().flatten().copied().collect();
        let span_ns = match (
            samples.iter().map(|s| s.reference_ns).min(),
            samples.iter().map(|s| s.reference_ns).max(),
        ) {
            (Some(lo), Some(hi)) => hi - lo,
            _ => 0,
        };
        let line = if span_ns < self.config.min_rate_span_ns {
            self.fit_offset_only(&samples)?
        } else {
            fit_line(&samples, &self.config.fit)?
        };
        let calibrated_at = samples.iter().map(|s| s.reference_ns).max().unwrap_or(0);
        let fitted = ClockCalibration::from_line(&line, self.domain, calibrated_at)?
            .with_wander(self.config.wander_ppm_per_sqrt_s);
        // A straight line through a wandering rate misses the truth at the centroid by a share of the phase
        // the walk accumulates over the window (the coefficient was fitted on the simulated pair: it makes
        // ~95 % of true times fall inside the stated range at 0.05 ppm/√s over a 4 s window).
        let model_sigma = WINDOW_BOW * wander_sigma_ns(self.config.wander_ppm_per_sqrt_s, span_ns as f64 * 1e-9);
        // Averaging shrinks the error of unbiased brackets; brackets lopsided the same way (a driver that makes a
        // timestamp readable late, so every midpoint is late: lavapipe's submit probe, ~14 µs) do not average
        // out. Each bracket still holds its truth, so the truth at the knot lies where all the window's
        // brackets, carried along the fitted line, agree: never state less than the distance from the knot to
        // the far edge of that agreement. Unbiased brackets agree on a narrow interval around the fit, so this
        // costs them nothing; when they do not agree at all (outliers, wander) there is no such bound.
        let agreement_ns = bracket_agreement_ns(&samples, line.origin_ticks, fitted.ns_per_tick(), fitted.anchor_ns());
        let fitted = fitted.with_min_intercept_sigma(agreement_ns / 2.0);
        let sigma_ns = (line.intercept_sigma_ns.powi(2) + model_sigma.powi(2))
            .sqrt()
            .max(agreement_ns / 2.0);
        let knot = Knot {
            ticks: line.origin_ticks,
            ns: fitted.anchor_ns(),
            sigma_ns,
        };
        if let Some(prev) = self.knots.back() {
            // The window slid, so its centroid moved forward; a knot that does not is a fit gone wrong.
            if knot.ticks <= prev.ticks || knot.ns <= prev.ns {
                return Err(CalibrationError::NonFinite {
                    what: "knot (not after the previous one)",
                });
            }
        }
        self.push_knot(knot);
        self.stats.drift_ppm = fitted.drift_ppm();
        self.stats.error_bound_ns = fitted.error_bound_ns();
        self.stats.max_deviation_ns = fitted.max_deviation_ns();
        self.latest = Some(fitted);
        Ok(())
    }

    /// Offset-only fit with the domain's nominal rate: the median of the samples' offsets from the nominal
    /// line, robust to outliers, with the rate's assumed error as its slope error.
    fn fit_offset_only(&self, samples: &[CalibrationSample]) -> Result<LineFit, CalibrationError> {
        let mut kept: Vec<CalibrationSample> = samples.to_vec();
        kept.sort_by_key(|s| s.max_deviation_ns);
        let keep = ((kept.len() as f64 * self.config.fit.keep_tightest).ceil() as usize).clamp(1, kept.len().max(1));
        kept.truncate(keep);
        let Some(origin) = kept.iter().min_by_key(|s| s.source_ticks).copied() else {
            return Err(CalibrationError::TooFewSamples { needed: 1, got: 0 });
        };
        let slope = self.domain.nominal_ns_per_tick();
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
        let origin_ns = (origin.reference_ns as i128 + value.round() as i128).clamp(0, u64::MAX as i128) as u64;
        Ok(LineFit {
            origin_ticks: mid_ticks,
            origin_ns,
            intercept_ns: 0.0,
            slope_ns_per_tick: slope,
            intercept_sigma_ns: sigma / (kept.len() as f64).sqrt(),
            slope_sigma_ns_per_tick: slope * self.config.nominal_rate_sigma_ppm * 1e-6,
            residual_sigma_ns: spread,
            used_samples: kept.len(),
            first_ticks: ticks[0],
            last_ticks: ticks[ticks.len() - 1],
            max_deviation_ns: max_dev,
        })
    }

    fn push_knot(&mut self, knot: Knot) {
        if self.knots.len() >= self.config.max_knots {
            // Thin the older half to every second knot: old regions keep coarser coverage, memory stays flat.
            let half = self.knots.len() / 2;
            let mut thinned: VecDeque<Knot> = VecDeque::with_capacity(self.config.max_knots);
            for (i, k) in self.knots.iter().enumerate() {
                if i >= half || i % 2 == 0 {
                    thinned.push_back(*k);
                }
            }
            self.knots = thinned;
        }
        self.knots.push_back(knot);
    }

    /// Extends a raw (masked) tick to the history's unwrapped count: the nearest value to the newest sample.
    fn extend(&self, raw: u64) -> Option<u64> {
        let (ref_raw, ref_ext) = self.unwrap_ref?;
        Some(ref_ext.wrapping_add(self.domain.delta_ticks(ref_raw, raw & self.domain.mask()) as u64))
    }

    /// True when a knot exists at or after `ticks`: the conversion is interpolated between calibration points
    /// on both sides, not extrapolated.
    pub fn is_bracketed(&self, ticks: u64) -> bool {
        match (self.extend(ticks), self.knots.back()) {
            (Some(ext), Some(k)) => ext <= k.ticks,
            _ => false,
        }
    }

    /// Converts `ticks` with the current map, without the monotonic guard. `None` before the first knot.
    pub fn peek(&self, ticks: u64) -> Option<Converted> {
        let ext = self.extend(ticks)?;
        let newest = *self.knots.back()?;
        if ext >= newest.ticks {
            let latest = self.latest.as_ref()?;
            return Some(latest.convert(ticks));
        }
        let oldest = self.knots[0];
        if ext < oldest.ticks {
            return Some(self.extrapolate_back(ext, oldest));
        }
        // The last knot with ticks <= ext; its successor exists because ext < newest.ticks.
        let i = self.knots.partition_point(|k| k.ticks <= ext) - 1;
        let (a, b) = (self.knots[i], self.knots[i + 1]);
        let span = (b.ticks - a.ticks) as u128;
        let into = (ext - a.ticks) as u128;
        let rise = (b.ns - a.ns) as u128;
        let ns = a.ns + ((into * rise + span / 2) / span) as u64;
        let w = into as f64 / span as f64;
        let sigma = a.sigma_ns * (1.0 - w) + b.sigma_ns * w;
        // Between knots the truth can bow away from the chord by the wander over the segment.
        let bow = WINDOW_BOW * wander_sigma_ns(self.config.wander_ppm_per_sqrt_s, (b.ns - a.ns) as f64 * 1e-9);
        Some(Converted {
            ns,
            uncertainty_ns: (2.0 * (sigma.powi(2) + bow.powi(2)).sqrt()).ceil() as u64,
        })
    }

    fn extrapolate_back(&self, ext: u64, oldest: Knot) -> Converted {
        let ns_per_tick = match self.knots.get(1) {
            Some(next) => (next.ns - oldest.ns) as f64 / (next.ticks - oldest.ticks) as f64,
            None => self
                .latest
                .as_ref()
                .map_or(self.domain.nominal_ns_per_tick(), |c| c.ns_per_tick()),
        };
        let back_ns = (oldest.ticks - ext) as f64 * ns_per_tick;
        let ns = (oldest.ns as f64 - back_ns).max(0.0).round() as u64;
        let wander = wander_sigma_ns(self.config.wander_ppm_per_sqrt_s, back_ns * 1e-9);
        let uncertainty = 2.0 * (oldest.sigma_ns.powi(2) + wander.powi(2)).sqrt();
        Converted {
            ns,
            uncertainty_ns: uncertainty.ceil() as u64,
        }
    }

    /// Converts `ticks` to reference ns with its uncertainty. `None` until the first successful fit.
    ///
    /// Monotonic: for inputs converted in increasing order the outputs never decrease, even across refits; an
    /// output that a refit would have moved before an earlier one is held at the earlier one (and counted in
    /// [`HistoryStats::monotonic_clamps`]).
    pub fn convert(&mut self, ticks: u64) -> Option<Converted> {
        let mut converted = self.peek(ticks)?;
        let ext = self.extend(ticks)?;
        match self.high_water {
            Some((hw_ticks, hw_ns)) if ext >= hw_ticks => {
                if converted.ns < hw_ns {
                    converted.ns = hw_ns;
                    self.stats.monotonic_clamps += 1;
                }
                self.high_water = Some((ext, converted.ns));
            }
            Some((_, hw_ns)) => {
                if converted.ns > hw_ns {
                    converted.ns = hw_ns;
                    self.stats.monotonic_clamps += 1;
                }
            }
            None => self.high_water = Some((ext, converted.ns)),
        }
        Some(converted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::sim::{SimClockConfig, SimClockPair};

    fn pair(config: SimClockConfig) -> SimClockPair {
        SimClockPair::new(config).unwrap()
    }

    /// Runs `bursts` bursts of 16 samples every `period_ns` and returns the history.
    fn run(pair: &mut SimClockPair, config: HistoryConfig, bursts: usize, period_ns: u64) -> CalibrationHistory {
        let mut history = CalibrationHistory::new(pair.domain(), config);
        for _ in 0..bursts {
            let burst: Vec<_> = (0..16)
                .map(|_| {
                    let s = pair.sample();
                    let next = pair.now_ns() + 3_000;
                    pair.advance_to(next);
                    s
                })
                .collect();
            let _ = history.add_burst(&burst);
            let next = pair.now_ns() + period_ns;
            pair.advance_to(next);
        }
        history
    }

    #[test]
    fn empty_history_converts_nothing_and_rejects_empty_bursts() {
        let mut h = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
        assert_eq!(h.convert(5), None);
        assert!(matches!(h.add_burst(&[]), Err(CalibrationError::TooFewSamples { .. })));
        assert_eq!(h.stats().rejected, 1);
    }

    #[test]
    fn noiseless_drifting_clock_is_exact_between_knots() {
        let mut p = pair(SimClockConfig {
            drift_ppm: 200.0,
            offset_ns: -7_000,
            ..Default::default()
        });
        let mut h = run(&mut p, HistoryConfig::default(), 40, 100_000_000);
        let start = p.now_ns() - 3_000_000_000;
        for i in 0..1_000u64 {
            let t = start + i * 1_234_567;
            let got = h.convert(p.true_ticks_at(t)).unwrap();
            assert!(got.ns.abs_diff(t) <= 2, "at {t}: {got:?}");
        }
        assert!((h.stats().drift_ppm - 200.0).abs() < 0.01, "{:?}", h.stats());
    }

    #[test]
    fn two_sided_conversion_tracks_wander_within_its_uncertainty() {
        let mut p = pair(SimClockConfig {
            drift_ppm: 200.0,
            wander_ppm_per_sqrt_s: 0.05,
            jitter_ns: 1_000.0,
            outlier_fraction: 0.05,
            outlier_ns: 50_000.0,
            seed: 7,
            ..Default::default()
        });
        let mut h = run(&mut p, HistoryConfig::default(), 400, 250_000_000);
        let (mut inside, mut total, mut worst) = (0, 0, 0);
        let first = p.now_ns() - 90_000_000_000;
        let mut t = first;
        while t < p.now_ns() - 3_000_000_000 {
            let ticks = p.true_ticks_at(t);
            assert!(h.is_bracketed(ticks));
            let got = h.convert(ticks).unwrap();
            let err = got.ns.abs_diff(t);
            worst = worst.max(err);
            inside += usize::from(err <= got.uncertainty_ns);
            if total % 500 == 0 {
                eprintln!("err {err} unc {}", got.uncertainty_ns);
            }
            total += 1;
            t += 7_777_777;
        }
        eprintln!("worst {worst} inside {inside}/{total} stats {:?}", h.stats());
        assert!(worst < 200, "worst error {worst} ns");
        assert!(
            inside * 100 >= total * 95,
            "{inside}/{total} inside the stated uncertainty"
        );
    }

    #[test]
    fn brackets_that_all_lean_one_way_widen_the_stated_uncertainty() {
        // Like lavapipe's submit probe: each read happens 1-4 µs into a 25-35 µs bracket, so every midpoint is
        // ~12 µs late. The fit cannot see it; the brackets' agreement can.
        let mut pair = pair(SimClockConfig::default());
        let mut history = CalibrationHistory::new(pair.domain(), HistoryConfig::default());
        let mut rng = crate::calibration::SplitMix64(3);
        for _ in 0..24 {
            let burst: Vec<CalibrationSample> = (0..16)
                .map(|_| {
                    let t = pair.now_ns();
                    let before = t - 1_000 - rng.next_u64() % 3_000;
                    let after = t + 24_000 + rng.next_u64() % 10_000;
                    pair.advance_by(40_000);
                    CalibrationSample {
                        source_ticks: pair.true_ticks_at(t),
                        reference_ns: (before + after) / 2,
                        max_deviation_ns: (after - before).div_ceil(2),
                    }
                })
                .collect();
            history.add_burst(&burst).unwrap();
            pair.advance_by(250_000_000);
        }
        for back_ms in [3_000u64, 1_000, 0] {
            let t = pair.now_ns() - back_ms * 1_000_000;
            let c = history.convert(pair.true_ticks_at(t)).unwrap();
            let error = c.ns.abs_diff(t);
            assert!(error > 5_000, "the bias is real: {error} ns");
            assert!(
                error <= c.uncertainty_ns,
                "{error} ns off, {} ns stated",
                c.uncertainty_ns
            );
        }
    }

    #[test]
    fn output_is_monotonic_across_refits() {
        let mut p = pair(SimClockConfig {
            drift_ppm: -150.0,
            jitter_ns: 2_000.0,
            seed: 3,
            ..Default::default()
        });
        let mut h = CalibrationHistory::new(p.domain(), HistoryConfig::default());
        let mut last = 0;
        for _ in 0..200 {
            let burst: Vec<_> = (0..8).map(|_| p.sample()).collect();
            let _ = h.add_burst(&burst);
            for _ in 0..20 {
                let next = p.now_ns() + 1_000_000;
                p.advance_to(next);
                let now_ticks = p.true_ticks_at(p.now_ns());
                if let Some(c) = h.convert(now_ticks) {
                    assert!(c.ns >= last, "went back from {last} to {}", c.ns);
                    last = c.ns;
                }
            }
        }
    }

    #[test]
    fn wrapping_36_bit_counter_converts_across_the_wrap() {
        // 2^36 ns is about 68.7 s: run long enough to wrap twice.
        let mut p = pair(SimClockConfig {
            valid_bits: 36,
            drift_ppm: 50.0,
            jitter_ns: 200.0,
            ..Default::default()
        });
        let mut h = run(&mut p, HistoryConfig::default(), 700, 200_000_000);
        // 36 bits of 1 ns wrap every 68.7 s: a tick is unambiguous within half of that from the newest sample.
        let mut t = p.now_ns() - 30_000_000_000;
        while t < p.now_ns() - 1_000_000_000 {
            let got = h.convert(p.true_ticks_at(t)).unwrap();
            assert!(got.ns.abs_diff(t) < 100, "at {t}: {got:?}");
            t += 333_333_333;
        }
    }

    #[test]
    fn memory_stays_bounded_and_old_times_still_convert() {
        let config = HistoryConfig {
            max_knots: 64,
            ..HistoryConfig::default()
        };
        let mut p = pair(SimClockConfig {
            drift_ppm: 30.0,
            jitter_ns: 100.0,
            ..Default::default()
        });
        let start = p.now_ns();
        let mut h = run(&mut p, config, 1_000, 100_000_000);
        assert!(h.stats().knots <= 64);
        assert!(h.window.len() <= config.window_bursts);
        let t = start + 10_000_000_000;
        let got = h.convert(p.true_ticks_at(t)).unwrap();
        assert!(got.ns.abs_diff(t) < 100, "{got:?} vs {t}");
    }

    #[test]
    fn early_bursts_use_the_nominal_rate() {
        let mut p = pair(SimClockConfig {
            drift_ppm: 100.0,
            jitter_ns: 1_000.0,
            ..Default::default()
        });
        let mut h = run(&mut p, HistoryConfig::default(), 1, 0);
        let latest = h.latest().unwrap();
        assert!(latest.drift_ppm().abs() < 1e-6, "{}", latest.drift_ppm());
        // One burst: extrapolating 1 ms ahead is off by the 100 ppm the nominal rate misses, and says so.
        let t = p.now_ns() + 1_000_000;
        let got = h.convert(p.true_ticks_at(t)).unwrap();
        assert!(got.ns.abs_diff(t) <= got.uncertainty_ns, "{got:?} vs {t}");
    }
}
