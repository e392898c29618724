//! A deterministic simulated clock pair: a source clock (TSC, GPU timestamp counter, ...) against the
//! reference clock (`CLOCK_MONOTONIC`), with a known truth to check calibrations against.
//!
//! # Why it is public
//!
//! A calibration can only be judged against a clock whose truth is known, and a real clock's is not. This
//! module is that clock, for tickline's own tests and `examples/calibration_accuracy.rs`, and for a user who
//! tunes a [`HistoryConfig`](super::HistoryConfig), compares [`FitStrategy`](super::FitStrategy)s or writes
//! a backend. It deliberately models more than the calibration assumes, so that a test sees what happens when
//! those assumptions fail:
//!
//! - the rate wanders as a random walk, which no straight line follows;
//! - outliers carry an error their bracket does not show, while the fits take every bracket as honest;
//! - ticks are quantized and wrap at `valid_bits`.
//!
//! It does not model jumps or rate steps: the tests of break detection build their own clocks.
//!
//! Nothing needs it at run time. It reads no clock and starts no thread; the only non-test user is the
//! simulated GPU ([`crate::gpu::sim`]), which runs its device clock on it to give a machine without a GPU
//! GPU tracks with known errors.
//!
//! The same config, seed and sequence of calls always give the same samples and the same truth.
//!
//! ```
//! use tickline::calibration::sim::{SimClockConfig, SimClockPair};
//! use tickline::calibration::{CalibrationHistory, HistoryConfig};
//!
//! // 50 ppm fast and wandering, 200 ns read jitter, 1 % of reads 20 µs off with honest-looking brackets.
//! let mut pair = SimClockPair::new(SimClockConfig::realistic(7)).unwrap();
//! let mut history = CalibrationHistory::new(pair.domain(), HistoryConfig::default());
//! for _ in 0..40 {
//!     history.add_burst(&pair.sample_burst(16, 3_000)).unwrap();
//!     pair.advance_by(250_000_000);
//! }
//! // The truth says where a tick of one second ago belongs; the history must place it within what it states.
//! let t = pair.now_ns() - 1_000_000_000;
//! let placed = history.peek(pair.true_ticks_at(t)).unwrap();
//! assert!(placed.ns.abs_diff(t) <= placed.uncertainty_ns, "{placed:?} for {t}");
//! ```
//!
//! # The model
//!
//! Reference time `t` is an integer number of ns; it starts at [`SimClockConfig::start_ns`] and only moves
//! forward ([`SimClockPair::advance_to`]).
//!
//! **The source.** Its extended (never wrapping) tick count is
//!
//! ```text
//! count(t) = (start_ns + offset_ns) / ns_per_tick  +  ∫_{start_ns}^{t} rate(u) du
//! rate(u)  = (1 + drift(u) · 1e-6) / ns_per_tick                                     [ticks per ns]
//! ```
//!
//! so `offset_ns` is "source minus reference" at the start and a positive drift makes the source run fast.
//! The drift is piecewise constant on a fixed grid of [`WANDER_STEP_NS`] (10 ms) starting at `start_ns`:
//! segment `k` (reference times `[start + k·10 ms, start + (k+1)·10 ms)`) has
//! `drift_k = drift_ppm + W_k`, where `W_0 = 0` and `W_{k+1} = W_k + N(0, (wander_ppm_per_sqrt_s · √0.01 s)²)`,
//! a Gaussian random walk whose standard deviation after `T` seconds is `wander_ppm_per_sqrt_s · √T`. The
//! effective drift is clamped to `[-999_999, 1_000_000]` ppm so the source never stops or runs backwards.
//! `count(t)` is therefore piecewise linear, with a knot every 10 ms; without wander it is one straight line
//! and no knots are made at all.
//!
//! What the source shows at `t` is `floor(count(t))` masked to [`SimClockConfig::valid_bits`]: the tick
//! quantization is part of the truth ([`SimClockPair::true_ticks_at`]). A negative `start_ns + offset_ns`
//! is fine: the count is kept modulo 2^64 ticks, and only the masked low bits are observable anyway.
//!
//! **Exactness.** No absolute tick or ns value ever passes through an `f64`. The count is an unsigned
//! Q64.64 fixed-point number (64 integer bits modulo 2^64, 64 fraction bits) and each segment's rate is a
//! Q64.64 number of ticks per ns, computed *exactly* (floor to 2^-64) from the `f64` factor
//! `1 + drift_k · 1e-6` and the `f64` `ns_per_tick` by integer long division. Counts at knots are exact
//! integer sums of `10 ms × rate_k` and `count(t)` within a segment is an exact integer product, so no
//! rounding accumulates, whether after ten simulated minutes or at 10^18 ticks: the only roundings are the
//! start count and each segment's rate, both floored to 2^-64. Only the drift values themselves (the random
//! walk) use `f64`; the rate's 2^-64 ticks/ns quantizes them by less than 10^-9 ppm for ticks up to about
//! 18 µs (5·10^-5 ppm at the longest, 1 s ticks).
//!
//! **Samples.** [`SimClockPair::sample`] reads the source at the current reference time `t` and brackets it
//! with two reference reads, as [`crate::bracketed_sample`] does: the first lands at the real time `t - a`,
//! the second at `t + b`, with `a` and `b` independent and uniform in `[0, jitter_ns)`; the reference clock
//! reads whole ns, so `before = t - ceil(a)` and `after = t + floor(b)`. The sample reports
//! `reference_ns = before + (after - before) / 2` and `max_deviation_ns = ceil((after - before) / 2)`, an
//! honest bracket: `|reference_ns - t| ≤ max_deviation_ns` always, and the deviation averages about
//! `jitter_ns / 2`. With probability `outlier_fraction` the sample is an outlier: its `reference_ns` is moved
//! by a further `±round(outlier_ns)` (random sign) which `max_deviation_ns` does *not* reveal, the worst case
//! for a fit. `source_ticks` is the truth, `floor(count(t))` masked.
//!
//! **Determinism.** A small internal PRNG (xoshiro256** seeded through splitmix64) drives two independent
//! streams: one for the random walk (indexed by segment, so generating knots early or late gives the same
//! walk) and one for samples (four draws per sample). Samples use only integer and basic float arithmetic and
//! are bit-identical on every platform; the walk uses `ln`, `sin` and `cos` (Box-Muller), whose last bit may
//! differ between math libraries.
//!
//! **Memory.** With wander, one knot (48 bytes) is kept per 10 ms of simulated time that was reached, by
//! advancing or by a truth query about the future: 100 per simulated second, 60 000 (about 3 MB) for ten
//! simulated minutes. [`SimClockPair::set_knot_retention_ns`] drops knots older than a window; truth queries
//! before the oldest kept knot then saturate to it. Generating knots costs time linear in the simulated time
//! (well under a µs per knot in release builds): fine for hours, but a simulated day with wander is 8.64
//! million knots (about 400 MB unless retention is set). Without wander there is a single knot and any time,
//! up to `u64::MAX`, is O(1).
//!
//! # Where the code is
//!
//! This file holds [`SimClockPair`] and the moving of time. Beside it: `config` ([`SimClockConfig`] and its
//! checks), `truth` (the piecewise-linear count, its knots, and the truth queries both ways), `exact` (the
//! fixed-point arithmetic that keeps the truth exact), `sample` (bracketed reads and [`SimSample`]) and `rng`
//! (the simulator's own generator).

use std::collections::VecDeque;
use std::fmt;

use super::{CalibrationError, ClockDomain, SplitMix64};

mod config;
mod exact;
mod rng;
mod sample;
#[cfg(test)]
mod tests;
mod truth;

pub use config::SimClockConfig;
pub use sample::SimSample;

use exact::{decompose, mul_pow2_div_floor};
use rng::Rng;

/// The interval at which the drift's random walk steps: 10 ms of reference time.
pub const WANDER_STEP_NS: u64 = 10_000_000;

/// A knot of the piecewise-linear count: from its time on (until the next knot) the count grows at `rate_q64`.
#[derive(Clone, Copy, Debug)]
struct Knot {
    /// Ticks since the start at this knot, Q64.64, modulo 2^128.
    elapsed_q64: u128,
    /// Ticks per ns, Q64.64, at least 1.
    rate_q64: u128,
    /// The effective drift of this segment in ppm.
    drift_ppm: f64,
}

/// A simulated source clock and the reference clock, with the truth of both (see the [module docs](self) for
/// the exact model).
///
/// ```
/// use tickline::calibration::sim::{SimClockConfig, SimClockPair};
///
/// // A 1 GHz source running 200 ppm fast, read with up to 100 ns of jitter.
/// let config = SimClockConfig { drift_ppm: 200.0, jitter_ns: 100.0, seed: 7, ..SimClockConfig::default() };
/// let mut pair = SimClockPair::new(config).unwrap();
/// let start = pair.now_ns();
/// let start_ticks = pair.true_ticks_at(start);
///
/// // 100 samples, one every 10 ms; time ends at the last one.
/// let samples = pair.sample_burst(100, 10_000_000);
/// assert_eq!(pair.now_ns(), start + 990_000_000);
/// for s in &samples {
///     assert!(s.max_deviation_ns <= 100);
/// }
///
/// // The truth: after one more 10 ms, the source has advanced 1.0002 s worth of ticks.
/// pair.advance_to(start + 1_000_000_000);
/// let ticks = pair.true_ticks_at(pair.now_ns());
/// assert!(ticks.abs_diff(start_ticks + 1_000_200_000) <= 1);
/// let at = pair.true_reference_ns(ticks);
/// assert!(at.abs_diff(start + 1_000_000_000) <= 1);
///
/// // A calibration fitted on the samples should find the drift.
/// let fit = tickline::calibration::ClockCalibration::fit(
///     &samples,
///     &tickline::calibration::FitOptions::default(),
///     pair.domain(),
///     pair.now_ns(),
/// );
/// if let Ok(cal) = fit {
///     assert!((cal.drift_ppm() - 200.0).abs() < 2.0, "{}", cal.drift_ppm());
/// }
/// ```
#[derive(Clone)]
pub struct SimClockPair {
    config: SimClockConfig,
    domain: ClockDomain,
    now_ns: u64,
    /// The count at the start, Q64.64 modulo 2^128.
    base_q64: u128,
    /// `ns_per_tick = period_mantissa * 2^period_exponent`, exactly.
    period_mantissa: u64,
    period_exponent: i32,
    /// Knot `j` is at `start_ns + (first_knot + j) * WANDER_STEP_NS`; without wander there is only knot 0.
    knots: VecDeque<Knot>,
    first_knot: u64,
    /// The random walk (ppm) of the next knot to generate, unclamped.
    walk_ppm: f64,
    /// No further knot fits in u64 time.
    knots_exhausted: bool,
    retention_ns: Option<u64>,
    walk_rng: Rng,
    sample_rng: Rng,
}

impl fmt::Debug for SimClockPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimClockPair")
            .field("config", &self.config)
            .field("now_ns", &self.now_ns)
            .field("knots", &self.knots.len())
            .field("first_knot", &self.first_knot)
            .field("retention_ns", &self.retention_ns)
            .finish_non_exhaustive()
    }
}

impl SimClockPair {
    /// A new pair at reference time `config.start_ns`, after checking the config
    /// ([`SimClockConfig::validate`]).
    pub fn new(config: SimClockConfig) -> Result<Self, CalibrationError> {
        config.validate()?;
        let domain = ClockDomain::new(config.valid_bits, config.ns_per_tick)?;
        let (period_mantissa, period_exponent) = decompose(config.ns_per_tick);

        // count(start) = (start + offset) / ns_per_tick = n * 2^(64 - e) / m in Q64.64, floored.
        let source_ns = config.start_ns as i128 + config.offset_ns as i128;
        let (magnitude, inexact) = mul_pow2_div_floor(source_ns.unsigned_abs(), 64 - period_exponent, period_mantissa);
        let base_q64 = if source_ns >= 0 {
            magnitude
        } else {
            magnitude.wrapping_add(inexact as u128).wrapping_neg()
        };

        let mut seeder = SplitMix64(config.seed);
        let walk_rng = Rng::from_splitmix(&mut seeder);
        let sample_rng = Rng::from_splitmix(&mut seeder);

        let mut pair = SimClockPair {
            config,
            domain,
            now_ns: config.start_ns,
            base_q64,
            period_mantissa,
            period_exponent,
            knots: VecDeque::new(),
            first_knot: 0,
            walk_ppm: 0.0,
            knots_exhausted: false,
            retention_ns: None,
            walk_rng,
            sample_rng,
        };
        let drift = pair.effective_drift(0.0);
        let first = Knot {
            elapsed_q64: 0,
            rate_q64: pair.rate_q64(drift),
            drift_ppm: drift,
        };
        pair.knots.push_back(first);
        Ok(pair)
    }

    /// The config this pair was built from.
    pub fn config(&self) -> &SimClockConfig {
        &self.config
    }

    /// The source's domain: `valid_bits` and the nominal `ns_per_tick`.
    pub fn domain(&self) -> ClockDomain {
        self.domain
    }

    /// The current reference time in ns.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Moves reference time forward to `reference_ns`. Time never goes back: an earlier time is a no-op.
    pub fn advance_to(&mut self, reference_ns: u64) {
        if reference_ns > self.now_ns {
            self.now_ns = reference_ns;
            self.extend_to(reference_ns);
            self.apply_retention();
        }
    }

    /// Moves reference time forward by `delta_ns` (saturating at `u64::MAX`).
    pub fn advance_by(&mut self, delta_ns: u64) {
        self.advance_to(self.now_ns.saturating_add(delta_ns));
    }

    /// Keeps only the knots of the last `retention_ns` of reference time before now (plus the one in force
    /// then), or all of them with `None` (the default). Truth queries about times before the oldest kept knot
    /// saturate to that knot's time. Has no effect without wander (there is only one knot).
    pub fn set_knot_retention_ns(&mut self, retention_ns: Option<u64>) {
        self.retention_ns = retention_ns;
        self.apply_retention();
    }

    /// How many knots of the piecewise-linear truth are kept (memory: 48 bytes each).
    pub fn knot_count(&self) -> usize {
        self.knots.len()
    }
}
