//! [`SimClockConfig`]: what a simulated source clock is, and the checks of its fields.

use crate::calibration::CalibrationError;

/// The smallest and largest tick periods accepted, in ns (1 THz down to 1 Hz).
const MIN_NS_PER_TICK: f64 = 1e-3;
const MAX_NS_PER_TICK: f64 = 1e9;
/// The effective drift (configured plus walk) is clamped to this range, in ppm.
pub(super) const MIN_DRIFT_PPM: f64 = -999_999.0;
pub(super) const MAX_DRIFT_PPM: f64 = 1_000_000.0;

/// Parameters of a simulated source clock against the reference clock.
///
/// Build one with struct-update syntax on [`Default`] or with the `with_*` helpers:
///
/// ```
/// use tickline::calibration::sim::SimClockConfig;
/// let config = SimClockConfig::default().with_drift_ppm(200.0).with_jitter_ns(100.0).with_seed(7);
/// assert_eq!(config, SimClockConfig { drift_ppm: 200.0, jitter_ns: 100.0, seed: 7, ..Default::default() });
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimClockConfig {
    /// Source time minus reference time at the start, in ns (the source's `count * ns_per_tick` at
    /// `start_ns` is `start_ns + offset_ns`).
    pub offset_ns: i64,
    /// Constant rate error of the source, in ppm (positive: the source runs fast). Must lie in
    /// `(-1_000_000, 1_000_000]`.
    pub drift_ppm: f64,
    /// Random walk of the drift: standard deviation of its change over one second, in ppm (stepped every
    /// [`WANDER_STEP_NS`](super::WANDER_STEP_NS)). `0` for a constant drift.
    pub wander_ppm_per_sqrt_s: f64,
    /// Read jitter in ns: each bracketing reference read lands uniformly up to this far from the source read.
    pub jitter_ns: f64,
    /// Fraction of samples, in `[0, 1]`, that are outliers (hidden errors the bracket does not show).
    pub outlier_fraction: f64,
    /// Size of an outlier's hidden error in ns (rounded to whole ns, random sign).
    pub outlier_ns: f64,
    /// Nominal tick period in ns, in `[1e-3, 1e9]` (1.0 for a 1 GHz counter or CUDA's `%globaltimer`).
    pub ns_per_tick: f64,
    /// Valid bits of the source ticks, in `1..=64` (the counter wraps at 2^valid_bits).
    pub valid_bits: u32,
    /// Reference time at the start, in ns.
    pub start_ns: u64,
    /// Seed of the deterministic random streams.
    pub seed: u64,
}

impl Default for SimClockConfig {
    /// A perfect 1 GHz, 64-bit source in step with the reference: no offset, drift, wander, jitter or
    /// outliers, starting at 1 s, seed 0.
    fn default() -> Self {
        SimClockConfig {
            offset_ns: 0,
            drift_ppm: 0.0,
            wander_ppm_per_sqrt_s: 0.0,
            jitter_ns: 0.0,
            outlier_fraction: 0.0,
            outlier_ns: 0.0,
            ns_per_tick: 1.0,
            valid_bits: 64,
            start_ns: 1_000_000_000,
            seed: 0,
        }
    }
}

impl SimClockConfig {
    /// A plausible, imperfect source: 5 µs ahead, 50 ppm fast, wandering 0.05 ppm/√s, 200 ns read jitter and
    /// 1 % outliers of 20 µs, otherwise as [`Default`].
    pub fn realistic(seed: u64) -> Self {
        SimClockConfig {
            offset_ns: 5_000,
            drift_ppm: 50.0,
            wander_ppm_per_sqrt_s: 0.05,
            jitter_ns: 200.0,
            outlier_fraction: 0.01,
            outlier_ns: 20_000.0,
            seed,
            ..Default::default()
        }
    }

    /// Sets [`offset_ns`](Self::offset_ns).
    pub fn with_offset_ns(mut self, offset_ns: i64) -> Self {
        self.offset_ns = offset_ns;
        self
    }

    /// Sets [`drift_ppm`](Self::drift_ppm).
    pub fn with_drift_ppm(mut self, drift_ppm: f64) -> Self {
        self.drift_ppm = drift_ppm;
        self
    }

    /// Sets [`wander_ppm_per_sqrt_s`](Self::wander_ppm_per_sqrt_s).
    pub fn with_wander_ppm_per_sqrt_s(mut self, wander: f64) -> Self {
        self.wander_ppm_per_sqrt_s = wander;
        self
    }

    /// Sets [`jitter_ns`](Self::jitter_ns).
    pub fn with_jitter_ns(mut self, jitter_ns: f64) -> Self {
        self.jitter_ns = jitter_ns;
        self
    }

    /// Sets [`outlier_fraction`](Self::outlier_fraction) and [`outlier_ns`](Self::outlier_ns).
    pub fn with_outliers(mut self, fraction: f64, outlier_ns: f64) -> Self {
        self.outlier_fraction = fraction;
        self.outlier_ns = outlier_ns;
        self
    }

    /// Sets [`ns_per_tick`](Self::ns_per_tick) and [`valid_bits`](Self::valid_bits).
    pub fn with_ticks(mut self, ns_per_tick: f64, valid_bits: u32) -> Self {
        self.ns_per_tick = ns_per_tick;
        self.valid_bits = valid_bits;
        self
    }

    /// Sets [`start_ns`](Self::start_ns).
    pub fn with_start_ns(mut self, start_ns: u64) -> Self {
        self.start_ns = start_ns;
        self
    }

    /// Sets [`seed`](Self::seed).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Checks every field; [`SimClockPair::new`](super::SimClockPair::new) calls it.
    ///
    /// Errors: [`CalibrationError::InvalidValidBits`] for `valid_bits` outside `1..=64`,
    /// [`CalibrationError::InvalidPeriod`] for a tick period that is not finite or outside `[1e-3, 1e9]` ns,
    /// and [`CalibrationError::NonFinite`] naming the field for a drift that is not finite or outside
    /// `(-1e6, 1e6]` ppm, or a wander, jitter, outlier size that is negative or not finite, or an outlier
    /// fraction outside `[0, 1]`.
    pub fn validate(&self) -> Result<(), CalibrationError> {
        if !(1..=64).contains(&self.valid_bits) {
            return Err(CalibrationError::InvalidValidBits { bits: self.valid_bits });
        }
        if !(self.ns_per_tick.is_finite() && (MIN_NS_PER_TICK..=MAX_NS_PER_TICK).contains(&self.ns_per_tick)) {
            return Err(CalibrationError::InvalidPeriod);
        }
        if !(self.drift_ppm.is_finite() && self.drift_ppm > -1_000_000.0 && self.drift_ppm <= MAX_DRIFT_PPM) {
            return Err(CalibrationError::NonFinite { what: "drift_ppm" });
        }
        let non_negative = |x: f64| x.is_finite() && x >= 0.0;
        if !non_negative(self.wander_ppm_per_sqrt_s) {
            return Err(CalibrationError::NonFinite {
                what: "wander_ppm_per_sqrt_s",
            });
        }
        if !non_negative(self.jitter_ns) {
            return Err(CalibrationError::NonFinite { what: "jitter_ns" });
        }
        if !(self.outlier_fraction.is_finite() && (0.0..=1.0).contains(&self.outlier_fraction)) {
            return Err(CalibrationError::NonFinite {
                what: "outlier_fraction",
            });
        }
        if !non_negative(self.outlier_ns) {
            return Err(CalibrationError::NonFinite { what: "outlier_ns" });
        }
        Ok(())
    }
}
