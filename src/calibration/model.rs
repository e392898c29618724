//! [`ClockCalibration`]: one linear segment mapping a source clock to the reference clock.

use super::{fit_line, CalibrationError, CalibrationSample, FitOptions, LineFit};

/// What is known about a source clock before calibrating it: how many bits of its ticks are valid, how long
/// one tick nominally lasts, and how often the counter actually changes (its update resolution).
///
/// The resolution matters when a counter is coarser than its ticks: CUDA's `%globaltimer` counts in 1 ns ticks
/// but on many GPUs changes only every 32 ns or 1 µs. A value read from such a counter says the true time lies
/// somewhere in an interval one resolution wide, so a calibration that knows the resolution widens every sample's
/// bracket by half of it on both sides and adds half of it to every conversion's uncertainty.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClockDomain {
    valid_bits: u32,
    nominal_ns_per_tick: f64,
    resolution_ns: f64,
}

impl ClockDomain {
    /// A domain with `valid_bits` significant tick bits (Vulkan's `timestampValidBits`, 36..=64 for
    /// timestamps; 64 for the TSC) and a nominal tick period in ns (Vulkan's `timestampPeriod`; 1.0 for CUDA's
    /// `%globaltimer`; `1e9 / tsc_hz` for the TSC). Drift is reported relative to that period.
    ///
    /// ```
    /// let gpu = tickline::calibration::ClockDomain::new(36, 1.0).unwrap();
    /// assert_eq!(gpu.valid_bits(), 36);
    /// assert!(tickline::calibration::ClockDomain::new(0, 1.0).is_err());
    /// ```
    pub fn new(valid_bits: u32, nominal_ns_per_tick: f64) -> Result<Self, CalibrationError> {
        if !(1..=64).contains(&valid_bits) {
            return Err(CalibrationError::InvalidValidBits { bits: valid_bits });
        }
        if !(nominal_ns_per_tick.is_finite() && nominal_ns_per_tick > 0.0) {
            return Err(CalibrationError::InvalidPeriod);
        }
        Ok(ClockDomain {
            valid_bits,
            nominal_ns_per_tick,
            resolution_ns: nominal_ns_per_tick,
        })
    }

    /// The same domain with a counter that changes only every `resolution_ns` (measured by the backend where it
    /// can, declared otherwise). Values below one tick act as one tick: a counter cannot change more often than
    /// it ticks.
    ///
    /// ```
    /// // %globaltimer: 1 ns ticks that change every microsecond on some GPUs.
    /// let timer = tickline::calibration::ClockDomain::new(64, 1.0).unwrap().with_resolution_ns(1_000.0).unwrap();
    /// assert_eq!(timer.resolution_ns(), 1_000.0);
    /// assert_eq!(timer.half_resolution_ns(), 500.0);
    /// assert_eq!(tickline::calibration::ClockDomain::new(36, 52.08).unwrap().resolution_ns(), 52.08);
    /// assert!(timer.with_resolution_ns(f64::NAN).is_err());
    /// ```
    pub fn with_resolution_ns(mut self, resolution_ns: f64) -> Result<Self, CalibrationError> {
        if !(resolution_ns.is_finite() && resolution_ns > 0.0) {
            return Err(CalibrationError::InvalidPeriod);
        }
        self.resolution_ns = resolution_ns.max(self.nominal_ns_per_tick);
        Ok(self)
    }

    /// The same domain counted without wrapping (64 valid bits): the history fits and converts in its own
    /// unwrapped count, where a counter narrower than the distance from a fit's anchor to a tick (a 30-bit ns
    /// counter wraps every 1.07 s; a fit's anchor sits seconds back) must not be taken the short way round.
    pub(crate) fn unwrapped(self) -> ClockDomain {
        ClockDomain { valid_bits: 64, ..self }
    }

    /// How often the counter changes, in ns: at least one tick ([`nominal_ns_per_tick`](Self::nominal_ns_per_tick)
    /// unless [`with_resolution_ns`](Self::with_resolution_ns) said more).
    pub fn resolution_ns(&self) -> f64 {
        self.resolution_ns
    }

    /// Half the resolution: how far a timestamp's true time can lie from the middle of the interval its value
    /// stands for. Every conversion's uncertainty includes it.
    pub fn half_resolution_ns(&self) -> f64 {
        self.resolution_ns / 2.0
    }

    /// How many low bits of a tick value are significant.
    pub fn valid_bits(&self) -> u32 {
        self.valid_bits
    }

    /// The nominal length of one tick in ns.
    pub fn nominal_ns_per_tick(&self) -> f64 {
        self.nominal_ns_per_tick
    }

    /// The mask of the valid bits.
    pub fn mask(&self) -> u64 {
        if self.valid_bits == 64 {
            u64::MAX
        } else {
            (1u64 << self.valid_bits) - 1
        }
    }

    /// The signed distance `to - from` in ticks on a counter that wraps at `2^valid_bits`: the shorter way
    /// round, so a counter that wrapped between the two reads still gives the right small delta.
    #[inline]
    pub fn delta_ticks(&self, from: u64, to: u64) -> i64 {
        let raw = to.wrapping_sub(from) & self.mask();
        if self.valid_bits == 64 {
            raw as i64
        } else {
            // Sign-extend from bit valid_bits-1.
            let shift = 64 - self.valid_bits;
            ((raw << shift) as i64) >> shift
        }
    }
}

/// A converted timestamp: reference-clock nanoseconds and the half-width of the range the true time lies in.
///
/// From a single [`ClockCalibration`]: two standard errors of the fit (about 95 % of single timestamps), plus
/// extrapolation and half the counter's resolution. From a [`CalibrationHistory`](super::CalibrationHistory)
/// (what timelines use): three standard errors of its map (one fit's error is shared by a whole second of
/// timestamps; three keep at least 95 % inside in every second), never less than what the burst points and
/// the brackets show the map may be off by, plus half the resolution.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Converted {
    /// `CLOCK_MONOTONIC` nanoseconds.
    pub ns: u64,
    /// The true time lies within `ns ± uncertainty_ns` (at least about 95 % of the time; see above).
    pub uncertainty_ns: u64,
}

impl Converted {
    /// `(ns - uncertainty, ns + uncertainty)`, saturating.
    pub fn range(&self) -> (u64, u64) {
        (
            self.ns.saturating_sub(self.uncertainty_ns),
            self.ns.saturating_add(self.uncertainty_ns),
        )
    }
}

/// Scale of the fixed-point rates: Q64.64.
const FRAC_BITS: u32 = 64;

/// One linear segment mapping a source clock's ticks to reference (`CLOCK_MONOTONIC`) ns:
/// `ns = anchor_ns + (ticks - anchor_ticks) * ns_per_tick`, with the rate held as a Q64.64 fixed-point number so
/// conversions are exact integer arithmetic (no f64 rounding, whatever the distance from the anchor).
///
/// It carries what DotCompute's `ClockCalibration` carries: offset, drift in PPM, error bound (±1σ of the fit
/// residuals), sample count and calibration time; conversions both ways; an uncertainty range that grows with
/// distance from the samples; and [`should_recalibrate`](Self::should_recalibrate).
///
/// ```
/// use tickline::calibration::{CalibrationSample, ClockCalibration, ClockDomain, FitOptions};
/// // A 1 GHz GPU clock running 100 ppm fast, 5 µs behind the reference.
/// let samples: Vec<_> = (0..20u64)
///     .map(|i| {
///         let ns = 1_000_000_000 + i * 1_000_000;
///         let ticks = ((ns - 5_000) as f64 * 1.0001) as u64;
///         CalibrationSample { source_ticks: ticks, reference_ns: ns, max_deviation_ns: 50 }
///     })
///     .collect();
/// let domain = ClockDomain::new(64, 1.0).unwrap();
/// let cal = ClockCalibration::fit(&samples, &FitOptions::default(), domain, 1_020_000_000).unwrap();
/// assert!((cal.drift_ppm() - 100.0).abs() < 0.1, "{}", cal.drift_ppm());
/// let back = cal.to_reference_ns(cal.from_reference_ns(1_010_000_000));
/// assert!(back.abs_diff(1_010_000_000) <= 1);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClockCalibration {
    domain: ClockDomain,
    anchor_ticks: u64,
    anchor_ns: u64,
    ns_per_tick_q64: u128,
    ticks_per_ns_q64: u128,
    first_ticks: u64,
    last_ticks: u64,
    intercept_sigma_ns: f64,
    slope_sigma_rel: f64,
    residual_sigma_ns: f64,
    max_deviation_ns: u64,
    sample_count: u32,
    calibrated_at_ns: u64,
    wander_ppm: f64,
}

fn to_q64(value: f64) -> Result<u128, CalibrationError> {
    let scaled = value * 2f64.powi(FRAC_BITS as i32);
    if !(scaled.is_finite() && scaled >= 1.0 && scaled < 2f64.powi(127)) {
        return Err(CalibrationError::NonFinite { what: "rate" });
    }
    Ok(scaled as u128)
}

/// `round(delta * rate_q64 / 2^64)`, exact for any i64 delta and any rate below 2^63 ns per tick.
#[inline]
fn mul_q64(delta: i64, rate_q64: u128) -> i128 {
    let whole = (rate_q64 >> FRAC_BITS) as i128;
    let frac = (rate_q64 as u64) as i128;
    let delta = delta as i128;
    // |delta * frac| < 2^63 * 2^64 = 2^127: fits i128. The shift floors, +2^63 makes it round-half-up. The
    // whole part saturates: a rate of more than 2^64 ns per tick (a nonsensical domain) must not overflow.
    delta
        .saturating_mul(whole)
        .saturating_add((delta * frac + (1i128 << 63)) >> FRAC_BITS)
}

fn clamp_ns(value: i128) -> u64 {
    value.clamp(0, u64::MAX as i128) as u64
}

impl ClockCalibration {
    /// Fits a calibration through `samples` with `options` (prefilter + strategy). `calibrated_at_ns` is the
    /// reference time at which the calibration was made (for [`should_recalibrate`](Self::should_recalibrate)).
    ///
    /// Samples may come in any order and their ticks may wrap at `2^valid_bits`: they are unwrapped in
    /// reference-time order, so consecutive samples must be less than half the counter's range apart.
    ///
    /// The stated uncertainty is never less than what the brackets allow: the fitted line may lie anywhere
    /// that most samples' brackets (`reference_ns ± max_deviation_ns`) agree on, and reads that all lean one
    /// way in their brackets (a read late in each) move every sample, and the line, to the same side, which
    /// the residuals cannot show.
    pub fn fit(
        samples: &[CalibrationSample],
        options: &FitOptions,
        domain: ClockDomain,
        calibrated_at_ns: u64,
    ) -> Result<Self, CalibrationError> {
        let unwrapped = unwrap_ticks(samples, domain);
        let line = fit_line(&unwrapped, options)?;
        let fit = Self::from_line(&line, domain, calibrated_at_ns)?;
        // Two standard errors at the anchor reach the far edge of the region the brackets agree on.
        let floor = bracket_agreement_ns(&fit, &unwrapped);
        Ok(fit.with_min_intercept_sigma(floor / 2.0))
    }

    /// The same calibration in `domain` (the same rate and nominal period; ticks masked to its valid bits): a
    /// fit made in a history's unwrapped count, given out in the source's own domain.
    pub(crate) fn in_domain(self, domain: ClockDomain) -> Self {
        let mask = domain.mask();
        ClockCalibration {
            domain,
            anchor_ticks: self.anchor_ticks & mask,
            first_ticks: self.first_ticks & mask,
            last_ticks: self.last_ticks & mask,
            ..self
        }
    }

    /// Builds the fixed-point segment from a fitted line (whose ticks are unwrapped).
    /// The same calibration for a count `by` ticks ahead (every tick it knows moved by `by`, modulo the
    /// domain's range): a history that counts from its own origin gives out its fits in the source's ticks.
    pub(crate) fn with_ticks_shifted(self, by: u64) -> Self {
        let mask = self.domain.mask();
        ClockCalibration {
            anchor_ticks: self.anchor_ticks.wrapping_add(by) & mask,
            first_ticks: self.first_ticks.wrapping_add(by) & mask,
            last_ticks: self.last_ticks.wrapping_add(by) & mask,
            ..self
        }
    }

    pub(crate) fn from_line(
        line: &LineFit,
        domain: ClockDomain,
        calibrated_at_ns: u64,
    ) -> Result<Self, CalibrationError> {
        let slope = line.slope_ns_per_tick;
        if !(slope.is_finite() && slope > 0.0) {
            return Err(CalibrationError::NonFinite { what: "rate" });
        }
        if !line.intercept_ns.is_finite() {
            return Err(CalibrationError::NonFinite { what: "offset" });
        }
        let anchor_ns = clamp_ns((line.origin_ns as i128).saturating_add(line.intercept_ns.round() as i128));
        let mask = domain.mask();
        Ok(ClockCalibration {
            domain,
            anchor_ticks: line.origin_ticks & mask,
            anchor_ns,
            ns_per_tick_q64: to_q64(slope)?,
            ticks_per_ns_q64: to_q64(1.0 / slope)?,
            first_ticks: line.first_ticks & mask,
            last_ticks: line.last_ticks & mask,
            intercept_sigma_ns: finite_or_zero(line.intercept_sigma_ns),
            slope_sigma_rel: finite_or_zero(line.slope_sigma_ns_per_tick / slope),
            residual_sigma_ns: finite_or_zero(line.residual_sigma_ns),
            max_deviation_ns: line.max_deviation_ns,
            sample_count: line.used_samples.min(u32::MAX as usize) as u32,
            calibrated_at_ns,
            wander_ppm: 0.0,
        })
    }

    /// A calibration through one exact point with a given rate: `ns = anchor_ns + (ticks - anchor_ticks) *
    /// ns_per_tick`, with no statistics (error bound 0, one sample). Useful for known mappings and tests.
    pub fn from_anchor(
        domain: ClockDomain,
        anchor_ticks: u64,
        anchor_ns: u64,
        ns_per_tick: f64,
    ) -> Result<Self, CalibrationError> {
        if !(ns_per_tick.is_finite() && ns_per_tick > 0.0) {
            return Err(CalibrationError::NonFinite { what: "rate" });
        }
        let mask = domain.mask();
        Ok(ClockCalibration {
            domain,
            anchor_ticks: anchor_ticks & mask,
            anchor_ns,
            ns_per_tick_q64: to_q64(ns_per_tick)?,
            ticks_per_ns_q64: to_q64(1.0 / ns_per_tick)?,
            first_ticks: anchor_ticks & mask,
            last_ticks: anchor_ticks & mask,
            intercept_sigma_ns: 0.0,
            slope_sigma_rel: 0.0,
            residual_sigma_ns: 0.0,
            max_deviation_ns: 0,
            sample_count: 1,
            calibrated_at_ns: anchor_ns,
            wander_ppm: 0.0,
        })
    }

    /// Allow for drift that the fit cannot see (temperature, ageing): the source's rate does a random walk of
    /// `ppm_per_sqrt_s` ppm per √second, so a conversion `d` seconds beyond the sampled window gains an error
    /// of about `ppm_per_sqrt_s · d^1.5 / √3` µs (the integral of that walk) and
    /// `0.6 · ppm_per_sqrt_s · √span · d` µs (the fitted rate is about the window's mean rate, not its newest),
    /// which the uncertainty includes. Inside the sampled window the statement is the line's alone: a clock
    /// that wanders strongly bends away from a line fitted over a long window (measured at 1 ppm/√s over a 2 s
    /// window: about half of single timestamps inside, 80 % in the second after it). Fit a window no longer
    /// than the wander allows, or use a [`CalibrationHistory`](super::CalibrationHistory), which shortens its
    /// window to the wander it measures.
    pub fn with_wander(mut self, ppm_per_sqrt_s: f64) -> Self {
        self.wander_ppm = if ppm_per_sqrt_s.is_finite() {
            ppm_per_sqrt_s.abs()
        } else {
            0.0
        };
        self
    }

    /// The domain this calibration maps.
    pub fn domain(&self) -> ClockDomain {
        self.domain
    }

    /// The anchor tick (masked to the valid bits).
    pub fn anchor_ticks(&self) -> u64 {
        self.anchor_ticks
    }

    /// The reference ns at the anchor tick.
    pub fn anchor_ns(&self) -> u64 {
        self.anchor_ns
    }

    /// The rate as a Q64.64 fixed-point number of ns per tick (what conversions use).
    pub fn ns_per_tick_q64(&self) -> u128 {
        self.ns_per_tick_q64
    }

    /// The fitted tick period in ns.
    pub fn ns_per_tick(&self) -> f64 {
        self.ns_per_tick_q64 as f64 / 2f64.powi(FRAC_BITS as i32)
    }

    /// The fitted tick frequency in Hz.
    pub fn ticks_per_second(&self) -> f64 {
        1e9 / self.ns_per_tick()
    }

    /// Drift of the source against the reference in parts per million, relative to the domain's nominal
    /// period. Positive: the source runs fast (it ticks more often than nominal), as in DotCompute.
    pub fn drift_ppm(&self) -> f64 {
        (self.domain.nominal_ns_per_tick / self.ns_per_tick() - 1.0) * 1e6
    }

    /// The offset in ns between the source's nominal time and the reference at the anchor:
    /// `anchor_ticks * nominal_ns_per_tick - anchor_ns` (source ahead: positive), as DotCompute's
    /// `GPU_time - CPU_time`.
    pub fn offset_ns(&self) -> i64 {
        let source_ns = self.anchor_ticks as f64 * self.domain.nominal_ns_per_tick;
        (source_ns - self.anchor_ns as f64).round() as i64
    }

    /// ±1σ of the fit residuals in ns (DotCompute's `ErrorBoundNanos`).
    pub fn error_bound_ns(&self) -> f64 {
        self.residual_sigma_ns
    }

    /// The largest bracket half-width among the samples the fit used.
    pub fn max_deviation_ns(&self) -> u64 {
        self.max_deviation_ns
    }

    /// Standard error of the fitted rate, in ppm.
    pub fn rate_sigma_ppm(&self) -> f64 {
        self.slope_sigma_rel * 1e6
    }

    /// How many samples carried the fit.
    pub fn sample_count(&self) -> u32 {
        self.sample_count
    }

    /// The reference time at which this calibration was made.
    pub fn calibrated_at_ns(&self) -> u64 {
        self.calibrated_at_ns
    }

    /// True when the calibration is older than `max_age_ns` at reference time `now_ns`.
    pub fn should_recalibrate(&self, now_ns: u64, max_age_ns: u64) -> bool {
        now_ns.saturating_sub(self.calibrated_at_ns) > max_age_ns
    }

    /// Signed ticks from the anchor to `ticks` (wrap-aware).
    #[inline]
    pub fn ticks_from_anchor(&self, ticks: u64) -> i64 {
        self.domain.delta_ticks(self.anchor_ticks, ticks)
    }

    /// Converts source ticks to reference ns, exactly (integer math, rounded to the nearest ns).
    #[inline]
    pub fn to_reference_ns(&self, ticks: u64) -> u64 {
        let delta = self.ticks_from_anchor(ticks);
        clamp_ns((self.anchor_ns as i128).saturating_add(mul_q64(delta, self.ns_per_tick_q64)))
    }

    /// Converts reference ns to source ticks (masked to the valid bits), the inverse of
    /// [`to_reference_ns`](Self::to_reference_ns) to within one tick where a tick lasts at least a nanosecond.
    /// A shorter tick (a GHz counter) is finer than the whole nanoseconds `to_reference_ns` rounds to, so a
    /// round trip ticks -> ns -> ticks is then exact to within half a nanosecond's ticks, plus one: 2 ticks
    /// at 0.3125 ns per tick. That holds up to about a day from the anchor: further away the inverse rate's
    /// rounding adds a few ticks per year of distance (measured: 4 ticks at a year, 33 at ten, for 1 ns
    /// ticks), and beyond 2^63 ns the distance is clamped.
    pub fn from_reference_ns(&self, ns: u64) -> u64 {
        let delta_ns = ns as i128 - self.anchor_ns as i128;
        let delta_ns = delta_ns.clamp(i64::MIN as i128, i64::MAX as i128) as i64;
        let delta_ticks = mul_q64(delta_ns, self.ticks_per_ns_q64);
        (self.anchor_ticks as i128 + delta_ticks) as u64 & self.domain.mask()
    }

    /// Raises the standard error at the anchor to at least `sigma_ns` (a bound the fit's statistics cannot see,
    /// such as brackets that all lean the same way).
    pub(crate) fn with_min_intercept_sigma(mut self, sigma_ns: f64) -> Self {
        if sigma_ns.is_finite() {
            self.intercept_sigma_ns = self.intercept_sigma_ns.max(sigma_ns);
        }
        self
    }

    /// Adds `sigma_ns` in quadrature to the standard error at the anchor (an error the fit's statistics cannot
    /// see, such as a straight line's miss of a wandering rate).
    pub(crate) fn with_model_sigma(mut self, sigma_ns: f64) -> Self {
        if sigma_ns.is_finite() {
            self.intercept_sigma_ns = (self.intercept_sigma_ns.powi(2) + sigma_ns.powi(2)).sqrt();
        }
        self
    }

    /// One standard error of the fitted line at `ticks` (intercept and rate only: no wander, no resolution).
    pub(crate) fn line_sigma_ns(&self, ticks: u64) -> f64 {
        let from_anchor_ns = self.ticks_from_anchor(ticks) as f64 * self.ns_per_tick();
        (self.intercept_sigma_ns.powi(2) + (from_anchor_ns * self.slope_sigma_rel).powi(2)).sqrt()
    }

    /// The reference time the sampled window spans, in seconds.
    pub(crate) fn span_s(&self) -> f64 {
        self.domain.delta_ticks(self.first_ticks, self.last_ticks).max(0) as f64 * self.ns_per_tick() * 1e-9
    }

    /// How far `ticks` lies outside the sampled window, in seconds (0 inside).
    pub(crate) fn beyond_window_s(&self, ticks: u64) -> f64 {
        let before = self.domain.delta_ticks(ticks, self.first_ticks).max(0) as f64;
        let after = self.domain.delta_ticks(self.last_ticks, ticks).max(0) as f64;
        (before + after) * self.ns_per_tick() * 1e-9
    }

    /// The uncertainty (about 95 %) of converting `ticks`: two standard errors of the fitted line at that
    /// point (growing with the distance from the anchor through the rate's error), outside the sampled window
    /// two standard deviations of the wander (see [`with_wander`](Self::with_wander)), and half the counter's
    /// resolution ([`ClockDomain::half_resolution_ns`]): a timestamp stands for an interval that wide.
    pub fn uncertainty_ns(&self, ticks: u64) -> f64 {
        // A line through a wandering rate has about the window's mean rate, not its newest one: beyond the
        // window the phase moves away at their difference.
        let rate_miss = rate_miss_sigma_ppm(self.wander_ppm, self.span_s()) * 1e3 * self.beyond_window_s(ticks);
        2.0 * (self.line_and_wander_variance(ticks, self.wander_ppm) + rate_miss.powi(2)).sqrt()
            + self.domain.half_resolution_ns()
    }

    /// The variance (ns²) of the fitted line at `ticks` and of a wander of `wander_ppm` ppm/√s beyond the
    /// sampled window: the conversion's error without the rate miss and the resolution.
    pub(crate) fn line_and_wander_variance(&self, ticks: u64, wander_ppm: f64) -> f64 {
        self.line_sigma_ns(ticks).powi(2) + wander_sigma_ns(wander_ppm, self.beyond_window_s(ticks)).powi(2)
    }

    /// Converts `ticks` and states its uncertainty.
    #[inline]
    pub fn convert(&self, ticks: u64) -> Converted {
        Converted {
            ns: self.to_reference_ns(ticks),
            uncertainty_ns: self.uncertainty_ns(ticks).ceil() as u64,
        }
    }

    /// DotCompute's `GetUncertaintyRange`: `(min, max)` reference ns for `ticks`.
    pub fn uncertainty_range(&self, ticks: u64) -> (u64, u64) {
        self.convert(ticks).range()
    }
}

/// Standard deviation, in ppm, of how far a line fitted over `span_s` seconds of a clock whose rate does a
/// random walk of `ppm_per_sqrt_s` misses the rate at the span's newest end: `0.6 σ √span` (the walk's end less
/// the least-squares slope over the span, by Monte Carlo: 0.62 for dense points, 0.57 for three).
pub(crate) fn rate_miss_sigma_ppm(ppm_per_sqrt_s: f64, span_s: f64) -> f64 {
    0.6 * ppm_per_sqrt_s * span_s.max(0.0).sqrt()
}

/// Standard deviation, in ns, of the phase error a rate random walk of `ppm_per_sqrt_s` accumulates over
/// `seconds`: the walk's integral has variance `σ² t³ / 3`.
pub(crate) fn wander_sigma_ns(ppm_per_sqrt_s: f64, seconds: f64) -> f64 {
    ppm_per_sqrt_s * 1e3 * seconds.powf(1.5) / 3f64.sqrt()
}

fn finite_or_zero(x: f64) -> f64 {
    if x.is_finite() {
        x.abs()
    } else {
        0.0
    }
}

/// How far the line through `fit` may lie from the truth by what the samples' brackets say, whatever the
/// residuals: each bracket holds the truth, so the line's error lies in `[residual - deviation, residual +
/// deviation]` of every sample; where most of those intervals overlap (Marzullo's count, robust to the few an
/// outlier contributes), the farther edge of that region from 0. 0 when fewer than half agree anywhere.
fn bracket_agreement_ns(fit: &ClockCalibration, samples: &[CalibrationSample]) -> f64 {
    let mut edges: Vec<(f64, i32)> = Vec::with_capacity(2 * samples.len());
    for s in samples {
        let residual = s.reference_ns as f64 - fit.to_reference_ns(s.source_ticks & fit.domain.mask()) as f64;
        let deviation = s.max_deviation_ns as f64;
        if residual.is_finite() && deviation.is_finite() {
            edges.push((residual - deviation, 1));
            edges.push((residual + deviation, -1));
        }
    }
    // Openings before closings at one point: touching brackets agree there.
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
    let (mut count, mut best, mut region) = (0, 0, (0.0, 0.0));
    for (k, &(at, step)) in edges.iter().enumerate() {
        count += step;
        if step > 0 && count > best {
            best = count;
            // The region runs to the next closing edge.
            let end = edges[k + 1..].iter().find(|e| e.1 < 0).map_or(at, |e| e.0);
            region = (at, end);
        }
    }
    if (best as usize) * 2 < samples.len() || best == 0 {
        return 0.0;
    }
    region.0.abs().max(region.1.abs())
}

/// Samples sorted by reference time with their ticks unwrapped into a continuous u64 count.
pub(crate) fn unwrap_ticks(samples: &[CalibrationSample], domain: ClockDomain) -> Vec<CalibrationSample> {
    let mut sorted: Vec<CalibrationSample> = samples.to_vec();
    sorted.sort_by_key(|s| s.reference_ns);
    let mut previous: Option<(u64, u64)> = None; // (raw masked, unwrapped)
    for s in &mut sorted {
        let raw = s.source_ticks & domain.mask();
        let unwrapped = match previous {
            None => raw,
            Some((prev_raw, prev_unwrapped)) => prev_unwrapped.wrapping_add(domain.delta_ticks(prev_raw, raw) as u64),
        };
        previous = Some((raw, unwrapped));
        s.source_ticks = unwrapped;
    }
    sorted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domain(bits: u32, period: f64) -> ClockDomain {
        ClockDomain::new(bits, period).unwrap()
    }

    #[test]
    fn delta_ticks_handles_wrap_at_36_bits() {
        let d = domain(36, 1.0);
        let max = d.mask();
        assert_eq!(d.delta_ticks(max - 5, 4), 10);
        assert_eq!(d.delta_ticks(4, max - 5), -10);
        assert_eq!(domain(64, 1.0).delta_ticks(u64::MAX, 1), 2);
    }

    #[test]
    fn exact_conversion_far_from_anchor() {
        // 1/3 ns per tick (a 3 GHz TSC); 3 days of ticks away the result must be exact to the ns.
        let cal = ClockCalibration::from_anchor(domain(64, 1.0 / 3.0), 1_000, 5_000, 1.0 / 3.0).unwrap();
        let three_days_ticks = 3 * 86_400 * 3_000_000_000u64;
        let ns = cal.to_reference_ns(1_000 + three_days_ticks);
        assert_eq!(ns, 5_000 + 3 * 86_400 * 1_000_000_000);
        assert_eq!(cal.to_reference_ns(1_000 - 3), 4_999);
    }

    #[test]
    fn round_trip_within_one_tick_across_wrap() {
        let d = domain(36, 52.08);
        let cal = ClockCalibration::from_anchor(d, d.mask() - 1_000, 10_000_000_000, 52.08).unwrap();
        for ticks in [d.mask() - 900_000, d.mask(), 0, 5, 1_000_000] {
            let ns = cal.to_reference_ns(ticks);
            let back = cal.from_reference_ns(ns);
            assert!(d.delta_ticks(back, ticks).abs() <= 1, "{ticks} -> {ns} -> {back}");
        }
        // After the wrap, later ticks map to later ns.
        assert!(cal.to_reference_ns(5) > cal.to_reference_ns(d.mask()));
    }

    #[test]
    fn a_round_trip_is_as_close_as_from_reference_ns_says_for_ticks_shorter_than_a_nanosecond() {
        for period in [0.3125, 0.5, 1.0 / 3.0, 1.0, 83.33] {
            let d = domain(64, period);
            let cal = ClockCalibration::from_anchor(d, 123_456_789, 10_000_000_000, period).unwrap();
            // Half a nanosecond's ticks, plus one; one tick where a tick lasts a nanosecond or more.
            let bound = if period < 1.0 {
                (0.5 / period).floor() as i64 + 1
            } else {
                1
            };
            let mut worst = 0;
            for k in 0..20_000u64 {
                let ticks = 123_456_789 + k * 7_919;
                let back = cal.from_reference_ns(cal.to_reference_ns(ticks));
                worst = worst.max(d.delta_ticks(back, ticks).abs());
            }
            assert!(worst <= bound, "period {period}: off by {worst} ticks, bound {bound}");
        }
    }

    #[test]
    fn bad_domains_and_rates_are_errors() {
        assert_eq!(
            ClockDomain::new(65, 1.0),
            Err(CalibrationError::InvalidValidBits { bits: 65 })
        );
        assert_eq!(ClockDomain::new(64, f64::NAN), Err(CalibrationError::InvalidPeriod));
        assert!(matches!(
            ClockCalibration::from_anchor(domain(64, 1.0), 0, 0, 0.0),
            Err(CalibrationError::NonFinite { .. })
        ));
        assert!(matches!(
            ClockCalibration::from_anchor(domain(64, 1.0), 0, 0, f64::INFINITY),
            Err(CalibrationError::NonFinite { .. })
        ));
    }

    #[test]
    fn drift_offset_and_recalibration_age() {
        let cal = ClockCalibration::from_anchor(domain(64, 1.0), 2_000_000, 1_000_000, 1.0 / 1.0002).unwrap();
        assert!((cal.drift_ppm() - 200.0).abs() < 1e-6);
        assert_eq!(cal.offset_ns(), 1_000_000);
        assert!(!cal.should_recalibrate(1_000_000 + 10, 10));
        assert!(cal.should_recalibrate(1_000_000 + 11, 10));
    }

    #[test]
    fn unwrap_orders_by_reference_and_extends() {
        let d = domain(36, 1.0);
        let s = |t: u64, r: u64| CalibrationSample {
            source_ticks: t,
            reference_ns: r,
            max_deviation_ns: 1,
        };
        let u = unwrap_ticks(&[s(5, 30), s(d.mask() - 5, 10), s(d.mask(), 20)], d);
        let ticks: Vec<u64> = u.iter().map(|s| s.source_ticks).collect();
        assert_eq!(ticks, vec![d.mask() - 5, d.mask(), d.mask() + 6]);
    }

    #[test]
    fn uncertainty_grows_outside_the_window() {
        let cal = ClockCalibration::from_anchor(domain(64, 1.0), 1_000, 1_000, 1.0)
            .unwrap()
            .with_wander(1.0);
        // At the anchor: only half the 1 ns resolution.
        assert_eq!(cal.uncertainty_ns(1_000), 0.5);
        // 1 ppm/√s over 1 s: σ = 1000 ns / √3; the range is two σ.
        let expected = 2.0 * 1_000.0 / 3f64.sqrt() + 0.5;
        assert!((cal.uncertainty_ns(1_000 + 1_000_000_000) - expected).abs() < 1e-6);
        // 4 s out: eight times as much (t^1.5).
        assert!((cal.uncertainty_ns(1_000 + 4_000_000_000) - 0.5 - 8.0 * (expected - 0.5)).abs() < 1e-3);
    }
}
