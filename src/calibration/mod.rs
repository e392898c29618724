//! Pure calibration math: paired samples in, [`ClockCalibration`] and [`CalibrationHistory`] out.
//!
//! Nothing in this module reads a clock; samples come from [`crate::bracketed_sample`], a GPU backend or
//! the simulated pair in [`sim`].

mod fit;
mod history;
mod model;
pub mod sim;

pub(crate) use fit::{fit_line, LineFit};
pub use fit::{FitOptions, FitStrategy};
pub use history::{CalibrationHistory, HistoryConfig, HistoryStats, Placement};
pub use model::{ClockCalibration, ClockDomain, Converted};

use std::fmt;

/// One paired reading of a source clock and the reference clock (`CLOCK_MONOTONIC` ns).
///
/// `reference_ns` is the midpoint of a bracket (reference, source, reference) and `max_deviation_ns` half its
/// width: the true reference time of the source read lies within `reference_ns ± max_deviation_ns`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CalibrationSample {
    /// The source clock's raw ticks (TSC, GPU timestamp, ...), possibly fewer than 64 valid bits.
    pub source_ticks: u64,
    /// The reference clock (`CLOCK_MONOTONIC`) in nanoseconds at the source read.
    pub reference_ns: u64,
    /// Half the bracket width: how far the true reference time may be from `reference_ns`.
    pub max_deviation_ns: u64,
}

impl CalibrationSample {
    /// A sample whose source read `source_ticks` happened somewhere in `[before_ns, after_ns]` on the reference
    /// clock: the midpoint, and half the width rounded up (at least 1 ns) as the deviation. The two reads in
    /// the other order (a reference clock read backwards, or arguments swapped) bracket the same interval.
    ///
    /// ```
    /// use tickline::calibration::CalibrationSample;
    /// let s = CalibrationSample::from_bracket(42, 1_000, 1_010);
    /// assert_eq!((s.reference_ns, s.max_deviation_ns), (1_005, 5));
    /// assert_eq!(CalibrationSample::from_bracket(42, 1_010, 1_000), s);
    /// ```
    pub fn from_bracket(source_ticks: u64, before_ns: u64, after_ns: u64) -> CalibrationSample {
        let (before_ns, after_ns) = (before_ns.min(after_ns), before_ns.max(after_ns));
        let width = after_ns - before_ns;
        CalibrationSample {
            source_ticks,
            reference_ns: before_ns + width / 2,
            // Rounded up so the bound still holds when the width is odd.
            max_deviation_ns: width.div_ceil(2).max(1),
        }
    }
}

/// Why a calibration could not be computed. Never a panic, never a NaN.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum CalibrationError {
    /// The fit needs at least `needed` samples (after filtering) and got `got`.
    TooFewSamples {
        /// The minimum for the chosen strategy.
        needed: usize,
        /// How many were usable.
        got: usize,
    },
    /// Every sample has the same source tick (or the same reference time): no rate can be fitted.
    DegenerateTicks,
    /// The inputs produced a non-finite or non-positive rate (e.g. the reference runs backwards against the
    /// source, or values overflow).
    NonFinite {
        /// What was not finite or out of range.
        what: &'static str,
    },
    /// `valid_bits` must lie in 1..=64 (Vulkan allows 36..=64 for timestamps).
    InvalidValidBits {
        /// The value given.
        bits: u32,
    },
    /// A nominal tick period must be finite and positive.
    InvalidPeriod,
    /// A calibration setting is out of its range.
    InvalidConfig {
        /// Which setting, and its range.
        what: &'static str,
    },
}

impl fmt::Display for CalibrationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CalibrationError::TooFewSamples { needed, got } => {
                write!(f, "calibration needs at least {needed} samples, got {got}")
            }
            CalibrationError::DegenerateTicks => {
                write!(
                    f,
                    "calibration samples span no time: all source ticks (or reference times) are equal"
                )
            }
            CalibrationError::NonFinite { what } => {
                write!(
                    f,
                    "calibration produced an unusable {what} (not finite or not positive)"
                )
            }
            CalibrationError::InvalidValidBits { bits } => {
                write!(f, "valid tick bits must be in 1..=64, got {bits}")
            }
            CalibrationError::InvalidPeriod => {
                write!(f, "the nominal tick period must be finite and positive")
            }
            CalibrationError::InvalidConfig { what } => write!(f, "invalid calibration setting: {what}"),
        }
    }
}

impl std::error::Error for CalibrationError {}

/// SplitMix64: the small deterministic generator the fits (RANSAC, pair subsampling) and the simulated
/// clocks draw from, so results repeat exactly for a seed without a `rand` dependency.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    /// Uniform in `[0, 1)` with 53 random bits (tests' own clock models).
    #[cfg(test)]
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}
