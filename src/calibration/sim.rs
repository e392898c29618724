//! A deterministic simulated clock pair (a source clock against the reference) with known truth.
//! STUB: to be replaced by the real implementation.

use super::{CalibrationError, CalibrationSample, ClockDomain};

/// Parameters of a simulated source clock.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimClockConfig {
    /// Source time minus reference time at the start, in ns.
    pub offset_ns: i64,
    /// Constant rate error of the source, in ppm (positive: the source runs fast).
    pub drift_ppm: f64,
    /// Random walk of the drift: standard deviation of its change over one second, in ppm.
    pub wander_ppm_per_sqrt_s: f64,
    /// Read jitter in ns: each bracketing reference read lands up to this far from the source read.
    pub jitter_ns: f64,
    /// Fraction of samples that are outliers (hidden errors the bracket does not show).
    pub outlier_fraction: f64,
    /// Size of an outlier's error in ns.
    pub outlier_ns: f64,
    /// Nominal tick period in ns.
    pub ns_per_tick: f64,
    /// Valid bits of the source ticks (the counter wraps at 2^valid_bits).
    pub valid_bits: u32,
    /// Reference time at the start, in ns.
    pub start_ns: u64,
    /// Seed of the deterministic random stream.
    pub seed: u64,
}

/// A simulated source clock and the reference clock.
#[derive(Clone, Debug)]
pub struct SimClockPair {
    _config: SimClockConfig,
}

impl SimClockPair {
    /// A new pair.
    pub fn new(config: SimClockConfig) -> Result<Self, CalibrationError> {
        Ok(SimClockPair { _config: config })
    }
    /// The source's domain.
    pub fn domain(&self) -> ClockDomain {
        ClockDomain::new(self._config.valid_bits, self._config.ns_per_tick).unwrap()
    }
    /// Reference time now.
    pub fn now_ns(&self) -> u64 {
        0
    }
    /// Moves reference time forward.
    pub fn advance_to(&mut self, _reference_ns: u64) {}
    /// The source ticks (masked) at a reference time.
    pub fn true_ticks_at(&mut self, _reference_ns: u64) -> u64 {
        0
    }
    /// The reference time at which the source showed `ticks`.
    pub fn true_reference_ns(&mut self, _ticks: u64) -> u64 {
        0
    }
    /// One bracketed read now.
    pub fn sample(&mut self) -> CalibrationSample {
        CalibrationSample::default()
    }
}
