//! A deterministic simulated clock pair: a source clock (TSC, GPU timestamp counter, ...) against the
//! reference clock (`CLOCK_MONOTONIC`), with a known truth to check calibrations against.
//!
//! Used by tests, benches and the quickstart; the same config, seed and sequence of calls always give the same
//! samples and the same truth.
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

use super::{CalibrationError, CalibrationSample, ClockDomain, SplitMix64};
use std::collections::VecDeque;
use std::fmt;

/// The interval at which the drift's random walk steps: 10 ms of reference time.
pub const WANDER_STEP_NS: u64 = 10_000_000;

/// The smallest and largest tick periods accepted, in ns (1 THz down to 1 Hz).
const MIN_NS_PER_TICK: f64 = 1e-3;
const MAX_NS_PER_TICK: f64 = 1e9;
/// The effective drift (configured plus walk) is clamped to this range, in ppm.
const MIN_DRIFT_PPM: f64 = -999_999.0;
const MAX_DRIFT_PPM: f64 = 1_000_000.0;
const FRAC_MASK: u128 = u64::MAX as u128;

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
    /// [`WANDER_STEP_NS`]). `0` for a constant drift.
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

    /// Checks every field; [`SimClockPair::new`] calls it.
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

/// One simulated sample together with the truth behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimSample {
    /// What a real read would give.
    pub sample: CalibrationSample,
    /// The true reference time of the source read (the pair's `now_ns()` when sampled).
    pub true_ns: u64,
    /// The honest part of the error: the bracket midpoint minus `true_ns`, always within
    /// `±sample.max_deviation_ns`.
    pub read_error_ns: i64,
    /// The hidden part: `±round(outlier_ns)` for an outlier, 0 otherwise. `sample.reference_ns` is
    /// `true_ns + read_error_ns + outlier_error_ns` (saturating at 0 and `u64::MAX`).
    pub outlier_error_ns: i64,
}

impl SimSample {
    /// Whether this sample carries a hidden outlier error.
    pub fn is_outlier(&self) -> bool {
        self.outlier_error_ns != 0
    }
}

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

    /// The source's ticks (masked to the valid bits) at reference time `reference_ns`: `floor(count(t))`.
    ///
    /// Times before the start (or before the oldest kept knot) saturate to it. A time after now is allowed and
    /// does not move time; with wander it generates the walk up to there (the same walk as advancing would),
    /// which costs time and memory linear in the distance: 100 knots per simulated second, so ask hours ahead
    /// only without wander (then any time is O(1)).
    pub fn true_ticks_at(&mut self, reference_ns: u64) -> u64 {
        ((self.count_q64_at(reference_ns) >> 64) as u64) & self.domain.mask()
    }

    /// The true drift in ppm in force at reference time `reference_ns` (configured drift plus the walk,
    /// clamped; saturating like [`true_ticks_at`](Self::true_ticks_at)).
    pub fn true_drift_ppm_at(&mut self, reference_ns: u64) -> f64 {
        let t = self.clamp_time(reference_ns);
        self.extend_to(t);
        self.knots[self.segment_of(t)].drift_ppm
    }

    /// The reference time at which the source showed `ticks` (masked to the valid bits): the latest such time
    /// at or before now. Same as [`true_reference_ns_before`](Self::true_reference_ns_before)`(ticks, now)`.
    pub fn true_reference_ns(&mut self, ticks: u64) -> u64 {
        self.true_reference_ns_before(ticks, self.now_ns)
    }

    /// The latest reference time `t ≤ at_ns` at which the source showed `ticks` (masked to the valid bits).
    ///
    /// The wrap is resolved by counting back from the ticks at `at_ns`: at most one full wrap of `2^valid_bits`
    /// ticks. The result is the first whole ns at which the source showed `ticks` in that pass: the real time
    /// at which the count reached `ticks`, rounded up to the ns. So for a time `t` with
    /// `true_ticks_at(t) == ticks` (and `t ≤ at_ns`, within one wrap), the result lies in
    /// `(t - ns_per_tick - 1, t]`. When that pass began before the start (or the oldest kept knot), the result
    /// saturates to the start (or that knot's time), consistent with [`true_ticks_at`](Self::true_ticks_at).
    pub fn true_reference_ns_before(&mut self, ticks: u64, at_ns: u64) -> u64 {
        let at = self.clamp_time(at_ns);
        self.extend_to(at);
        let mask = self.domain.mask();
        let count_at = self.count_q64_at(at);
        // How far back the target tick's start lies from count_at, Q64.64: less than 2^64 ticks.
        let back_ticks = ((count_at >> 64) as u64).wrapping_sub(ticks) & mask;
        let back_q64 = ((back_ticks as u128) << 64) | (count_at & FRAC_MASK);

        let j = self.segment_of(at);
        let knot_j = self.knots[j];
        let knot_j_time = self.knot_time(j);
        let span_j = ((at - knot_j_time) as u128).checked_mul(knot_j.rate_q64);
        if span_j.is_none_or(|span| span >= back_q64) {
            // In the segment that contains `at`: the smallest t with count(t) >= count_at - back,
            // i.e. (at - t) * rate <= back.
            return at - (back_q64 / knot_j.rate_q64).min((at - knot_j_time) as u128) as u64;
        }
        // Earlier: the latest knot k < j whose count is at most the target (counts are increasing).
        let elapsed_at = knot_j.elapsed_q64.wrapping_add(span_j.unwrap_or(0));
        let back_of = |knot: &Knot| elapsed_at.wrapping_sub(knot.elapsed_q64);
        let (mut lo, mut hi) = (0usize, j); // invariant: knots[..lo] qualify, knots[hi..j] do not
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if back_of(&self.knots[mid]) >= back_q64 {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if lo == 0 {
            return self.knot_time(0);
        }
        let k = lo - 1;
        let knot = self.knots[k];
        let excess = back_of(&knot) - back_q64; // count from knot k to the target tick
        knot_time_plus(self.knot_time(k), excess.div_ceil(knot.rate_q64))
    }

    /// One bracketed read at the current reference time (see the [module docs](self) for the distribution).
    pub fn sample(&mut self) -> CalibrationSample {
        self.sample_with_truth().sample
    }

    /// One bracketed read at the current reference time, with the truth behind it.
    pub fn sample_with_truth(&mut self) -> SimSample {
        let t = self.now_ns;
        let ticks = self.true_ticks_at(t);
        let jitter = self.config.jitter_ns;
        // Always four draws, so the stream stays aligned whatever the config.
        let a = self.sample_rng.uniform() * jitter;
        let b = self.sample_rng.uniform() * jitter;
        let outlier_draw = self.sample_rng.uniform();
        let sign_draw = self.sample_rng.next_u64();

        // The reference reads at real times t - a and t + b read whole ns (floor).
        let before = t.saturating_sub(a.ceil() as u64);
        let after = t.saturating_add(b.floor() as u64);
        let width = after - before;
        let midpoint = before + width / 2;
        let max_deviation_ns = width.div_ceil(2);

        let outlier_error_ns = if outlier_draw < self.config.outlier_fraction {
            let size = self.config.outlier_ns.round() as i64;
            if sign_draw >> 63 == 0 {
                size
            } else {
                -size
            }
        } else {
            0
        };
        let reference_ns = (midpoint as i128 + outlier_error_ns as i128).clamp(0, u64::MAX as i128) as u64;
        SimSample {
            sample: CalibrationSample {
                source_ticks: ticks,
                reference_ns,
                max_deviation_ns,
            },
            true_ns: t,
            read_error_ns: (midpoint as i128 - t as i128) as i64,
            outlier_error_ns,
        }
    }

    /// `n` samples `spacing_ns` apart: the first at the current time, then advancing before each of the
    /// others; time ends at the last sample.
    pub fn sample_burst(&mut self, n: usize, spacing_ns: u64) -> Vec<CalibrationSample> {
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            if i > 0 {
                self.advance_by(spacing_ns);
            }
            samples.push(self.sample());
        }
        samples
    }

    // ---- internals ----

    fn clamp_time(&self, reference_ns: u64) -> u64 {
        reference_ns.max(self.knot_time(0))
    }

    /// The reference time of the `j`-th kept knot.
    fn knot_time(&self, j: usize) -> u64 {
        // Kept knots always have representable times.
        self.config.start_ns + (self.first_knot + j as u64) * WANDER_STEP_NS
    }

    /// The index (into `knots`) of the segment containing `t` (`t` at or after the oldest kept knot).
    fn segment_of(&self, t: u64) -> usize {
        if self.knots.len() == 1 {
            return 0;
        }
        let global = (t - self.config.start_ns) / WANDER_STEP_NS;
        (global.saturating_sub(self.first_knot) as usize).min(self.knots.len() - 1)
    }

    /// The extended count at `reference_ns` (clamped), Q64.64 modulo 2^128.
    fn count_q64_at(&mut self, reference_ns: u64) -> u128 {
        let t = self.clamp_time(reference_ns);
        self.extend_to(t);
        let j = self.segment_of(t);
        let knot = self.knots[j];
        let since = (t - self.knot_time(j)) as u128;
        self.base_q64
            .wrapping_add(knot.elapsed_q64)
            .wrapping_add(since.wrapping_mul(knot.rate_q64))
    }

    /// Generates knots until the one in force at `t` exists (only with wander).
    fn extend_to(&mut self, t: u64) {
        if self.config.wander_ppm_per_sqrt_s == 0.0 {
            return;
        }
        let step_sigma = self.config.wander_ppm_per_sqrt_s * (WANDER_STEP_NS as f64 * 1e-9).sqrt();
        while !self.knots_exhausted {
            let index = self.first_knot + self.knots.len() as u64;
            let time = index
                .checked_mul(WANDER_STEP_NS)
                .and_then(|offset| self.config.start_ns.checked_add(offset));
            let Some(time) = time else {
                self.knots_exhausted = true;
                break;
            };
            if time > t {
                break;
            }
            let last = *self.knots.back().expect("at least one knot");
            self.walk_ppm += step_sigma * self.walk_rng.normal();
            let drift = self.effective_drift(self.walk_ppm);
            self.knots.push_back(Knot {
                elapsed_q64: last
                    .elapsed_q64
                    .wrapping_add((WANDER_STEP_NS as u128).wrapping_mul(last.rate_q64)),
                rate_q64: self.rate_q64(drift),
                drift_ppm: drift,
            });
        }
    }

    /// Drops knots whose segment ended more than `retention_ns` before now.
    fn apply_retention(&mut self) {
        let Some(retention) = self.retention_ns else {
            return;
        };
        let cutoff = self.now_ns.saturating_sub(retention);
        if cutoff <= self.config.start_ns {
            return;
        }
        // The knot in force at the cutoff stays; everything before it goes.
        let keep_from = ((cutoff - self.config.start_ns) / WANDER_STEP_NS).saturating_sub(self.first_knot);
        let drop = (keep_from as usize).min(self.knots.len() - 1);
        if drop > 0 {
            self.knots.drain(..drop);
            self.first_knot += drop as u64;
        }
    }

    fn effective_drift(&self, walk_ppm: f64) -> f64 {
        let drift = self.config.drift_ppm + walk_ppm;
        if drift.is_nan() {
            self.config.drift_ppm
        } else {
            drift.clamp(MIN_DRIFT_PPM, MAX_DRIFT_PPM)
        }
    }

    /// `floor((1 + drift * 1e-6) / ns_per_tick * 2^64)`, exactly for the f64 factor, and at least 1.
    fn rate_q64(&self, drift_ppm: f64) -> u128 {
        let factor = 1.0 + drift_ppm * 1e-6;
        let (mantissa, exponent) = decompose(factor);
        let shift = exponent + 64 - self.period_exponent;
        mul_pow2_div_floor(mantissa as u128, shift, self.period_mantissa)
            .0
            .max(1)
    }
}

fn knot_time_plus(time: u64, delta: u128) -> u64 {
    (time as u128 + delta).min(u64::MAX as u128) as u64
}

/// `x = mantissa * 2^exponent` exactly, for a positive finite `x`.
fn decompose(x: f64) -> (u64, i32) {
    let bits = x.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i32;
    let fraction = bits & ((1u64 << 52) - 1);
    if biased == 0 {
        (fraction, -1074)
    } else {
        (fraction | (1u64 << 52), biased - 1075)
    }
}

/// `floor(n * 2^shift / d)` modulo 2^128, and whether the division left a remainder. `d > 0`.
fn mul_pow2_div_floor(n: u128, shift: i32, d: u64) -> (u128, bool) {
    let d = d as u128;
    if shift <= 0 {
        let k = shift.unsigned_abs();
        let (shifted, lost) = if k >= 128 {
            (0, n != 0)
        } else {
            (n >> k, n & ((1u128 << k) - 1) != 0)
        };
        return (shifted / d, lost || shifted % d != 0);
    }
    // n * 2^s / d = (n / d) * 2^s + (n % d) * 2^s / d, the second by long division in chunks of 64 bits
    // (the remainder stays below d < 2^64, so remainder * 2^64 fits).
    let mut quotient = n / d;
    let mut remainder = n % d;
    let mut left = shift.unsigned_abs();
    while left > 0 {
        let k = left.min(64);
        let widened = remainder << k;
        quotient = shl_wrapping(quotient, k).wrapping_add(widened / d);
        remainder = widened % d;
        left -= k;
    }
    (quotient, remainder != 0)
}

/// `x * 2^k` modulo 2^128 (k ≤ 64 here, but any k works).
fn shl_wrapping(x: u128, k: u32) -> u128 {
    if k >= 128 {
        0
    } else {
        x << k
    }
}

/// xoshiro256**, with a cached second normal from Box-Muller.
#[derive(Clone, Debug)]
struct Rng {
    state: [u64; 4],
    spare_normal: Option<f64>,
}

impl Rng {
    fn from_splitmix(seeder: &mut SplitMix64) -> Self {
        let state = [
            seeder.next_u64(),
            seeder.next_u64(),
            seeder.next_u64(),
            seeder.next_u64(),
        ];
        Rng {
            state,
            spare_normal: None,
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare_normal.take() {
            return z;
        }
        let u1 = 1.0 - self.uniform(); // (0, 1]: ln is finite
        let u2 = self.uniform();
        let radius = (-2.0 * u1.ln()).sqrt();
        let angle = std::f64::consts::TAU * u2;
        self.spare_normal = Some(radius * angle.sin());
        radius * angle.cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(config: SimClockConfig) -> SimClockPair {
        SimClockPair::new(config).unwrap()
    }

    #[test]
    fn same_seed_same_samples_other_seed_differs() {
        let config = SimClockConfig::realistic(42).with_outliers(0.1, 10_000.0);
        let run = |config: SimClockConfig| {
            let mut p = pair(config);
            let mut out = p.sample_burst(500, 7_000_000);
            out.push(CalibrationSample {
                source_ticks: p.true_ticks_at(p.now_ns() + 1_234_567),
                reference_ns: p.true_reference_ns(12345),
                max_deviation_ns: p.true_drift_ppm_at(p.now_ns()).to_bits(),
            });
            out
        };
        let a = run(config);
        assert_eq!(a, run(config));
        let b = run(config.with_seed(43));
        assert_ne!(a, b);
        assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 10);
    }

    #[test]
    fn walk_does_not_depend_on_when_knots_are_made() {
        let config = SimClockConfig::realistic(3).with_jitter_ns(0.0).with_outliers(0.0, 0.0);
        let mut early = pair(config);
        let _ = early.true_ticks_at(config.start_ns + 5_000_000_000); // generate the future first
        let mut late = pair(config);
        for i in 0..50u64 {
            let t = config.start_ns + i * 97_000_000;
            early.advance_to(t);
            late.advance_to(t);
            assert_eq!(early.sample(), late.sample());
            assert_eq!(early.true_drift_ppm_at(t), late.true_drift_ppm_at(t));
        }
    }

    #[test]
    fn no_noise_samples_lie_on_the_linear_truth() {
        let config = SimClockConfig::default().with_drift_ppm(200.0);
        let mut p = pair(config);
        let start = p.now_ns();
        let s = p.sample();
        assert_eq!(
            s,
            CalibrationSample {
                source_ticks: start,
                reference_ns: start,
                max_deviation_ns: 0
            }
        );
        for i in 1..=10u64 {
            p.advance_to(start + i * 100_000_000);
            let s = p.sample();
            assert_eq!(s.reference_ns, p.now_ns());
            assert_eq!(s.max_deviation_ns, 0);
            let elapsed = p.now_ns() - start;
            let expected = start + elapsed + elapsed / 5_000; // 200 ppm
            assert!(
                s.source_ticks.abs_diff(expected) <= 1,
                "{} vs {expected}",
                s.source_ticks
            );
        }
        assert_eq!(p.now_ns(), start + 1_000_000_000);
        let advanced = p.true_ticks_at(p.now_ns()) - start;
        assert!(advanced.abs_diff(1_000_200_000) <= 1, "{advanced}");
        assert_eq!(p.true_drift_ppm_at(p.now_ns()), 200.0);
    }

    #[test]
    fn offset_and_period_set_the_start() {
        let mut p = pair(SimClockConfig::default().with_offset_ns(-5_000));
        assert_eq!(p.true_ticks_at(p.now_ns()), 1_000_000_000 - 5_000);
        // 52.08 ns ticks (19.2 MHz), 2 µs ahead.
        let mut p = pair(SimClockConfig::default().with_offset_ns(2_000).with_ticks(52.08, 36));
        let expected = (1_000_002_000.0f64 / 52.08).floor() as u64;
        assert_eq!(p.true_ticks_at(p.now_ns()), expected);
        let later = p.true_ticks_at(p.now_ns() + 1_000_000_000);
        let expected = (2_000_002_000.0f64 / 52.08).floor() as u64;
        assert!(later.abs_diff(expected) <= 1);
        // A negative source time wraps around like a counter would.
        let mut p = pair(SimClockConfig::default().with_offset_ns(-1_000_000_010));
        assert_eq!(p.true_ticks_at(p.now_ns()), u64::MAX - 9);
        assert_eq!(p.true_ticks_at(p.now_ns() + 20), 10);
        let mut p = pair(
            SimClockConfig::default()
                .with_offset_ns(-1_000_000_010)
                .with_ticks(1.0, 36),
        );
        assert_eq!(p.true_ticks_at(p.now_ns()), (1u64 << 36) - 10);
    }

    #[test]
    fn exact_at_1e18_ticks() {
        let mut p = pair(SimClockConfig::default().with_start_ns(1_000_000_000_000_000_000));
        let start = p.now_ns();
        assert_eq!(p.true_ticks_at(start + 123_456_789_012), start + 123_456_789_012);
        // Quarter-ns ticks: 4e18 ticks, exact.
        let mut p = pair(
            SimClockConfig::default()
                .with_start_ns(1_000_000_000_000_000_000)
                .with_ticks(0.25, 64),
        );
        assert_eq!(p.true_ticks_at(start + 777), 4 * (start + 777));
        // 200 ppm at 1e18: floor(1e9 * 1.0002 as f64 factor) exactly.
        let mut p = pair(
            SimClockConfig::default()
                .with_start_ns(1_000_000_000_000_000_000)
                .with_drift_ppm(200.0),
        );
        let factor = 1.0 + 200.0 * 1e-6;
        let (m, e) = decompose(factor);
        // 1e9 * m * 2^e, with e < 0: floor(1e9 * m / 2^-e).
        let expected = (1_000_000_000u128 * m as u128) >> (-e) as u32;
        assert_eq!(p.true_ticks_at(start + 1_000_000_000) - start, expected as u64);
        assert_eq!(expected, 1_000_199_999);
    }

    #[test]
    fn wraps_at_36_bits_and_inverts() {
        for period in [1.0, 52.08, 0.3] {
            let wrap_ns = ((1u64 << 36) as f64 * period) as i64;
            // Start 1 ms of ticks before the wrap.
            let offset = wrap_ns - 1_000_000 - 1_000_000_000;
            let config = SimClockConfig::default()
                .with_ticks(period, 36)
                .with_offset_ns(offset)
                .with_drift_ppm(-37.0)
                .with_wander_ppm_per_sqrt_s(0.5)
                .with_seed(9);
            let mut p = pair(config);
            let start = p.now_ns();
            let mask = p.domain().mask();
            let first = p.true_ticks_at(start);
            assert!(first > mask - 4_000_000, "{first}");
            let mut wrapped = false;
            let mut previous = first;
            for i in 1..=3_000u64 {
                let t = start + i * 1_001;
                p.advance_to(t);
                let ticks = p.true_ticks_at(t);
                assert!(ticks <= mask);
                if ticks < previous {
                    wrapped = true;
                }
                previous = ticks;
                let back = p.true_reference_ns(ticks);
                assert!(
                    back <= t && (t - back) as f64 <= period + 1.0,
                    "{period}: {t} -> {ticks} -> {back}"
                );
                assert_eq!(p.true_ticks_at(back) & mask, ticks, "period {period}");
            }
            assert!(wrapped, "period {period}");
            // Ticks from before the wrap still resolve to before the wrap (counting back from now).
            let back = p.true_reference_ns(first);
            assert_eq!(back, start);
            let mid = start + 1_500 * 1_001;
            let mid_ticks = p.true_ticks_at(mid);
            let back = p.true_reference_ns(mid_ticks);
            assert!(back <= mid && (mid - back) as f64 <= period + 1.0);
            // A tick not shown since the start saturates to the start.
            assert_eq!(p.true_reference_ns(first.wrapping_sub(10) & mask), start);
        }
    }

    #[test]
    fn inverse_across_many_segments() {
        let config = SimClockConfig::realistic(11).with_wander_ppm_per_sqrt_s(3.0);
        let mut p = pair(config);
        p.advance_to(config.start_ns + 20_000_000_000);
        for i in 0..2_000u64 {
            let t = config.start_ns + i * 9_999_991 + 3;
            let ticks = p.true_ticks_at(t);
            let back = p.true_reference_ns(ticks);
            assert!(back <= t && t - back <= 1, "{t} {back}");
            assert_eq!(p.true_ticks_at(back), ticks);
        }
        // Before a given time.
        let t = config.start_ns + 5_000_000_123;
        let ticks = p.true_ticks_at(t);
        assert_eq!(p.true_reference_ns_before(ticks, t + 7), t);
    }

    #[test]
    fn jittered_brackets_are_honest() {
        let jitter = 1_000.0;
        let mut p = pair(
            SimClockConfig::default()
                .with_jitter_ns(jitter)
                .with_drift_ppm(10.0)
                .with_seed(5),
        );
        let mut total = 0u64;
        let n = 10_000u64;
        for _ in 0..n {
            p.advance_by(1_000_000);
            let s = p.sample_with_truth();
            assert_eq!(s.true_ns, p.now_ns());
            assert!(!s.is_outlier());
            assert_eq!(s.sample.source_ticks, p.true_ticks_at(s.true_ns));
            let error = s.sample.reference_ns as i64 - s.true_ns as i64;
            assert_eq!(error, s.read_error_ns);
            assert!(error.unsigned_abs() <= s.sample.max_deviation_ns);
            assert!(s.sample.max_deviation_ns <= jitter as u64);
            total += s.sample.max_deviation_ns;
        }
        let mean = total as f64 / n as f64;
        assert!((mean - jitter / 2.0).abs() < 20.0, "{mean}");
    }

    #[test]
    fn outliers_have_the_configured_fraction_and_size() {
        let config = SimClockConfig::default()
            .with_jitter_ns(300.0)
            .with_outliers(0.1, 50_000.0)
            .with_seed(77);
        let mut p = pair(config);
        let (mut outliers, mut positive) = (0u32, 0u32);
        let n = 10_000;
        for _ in 0..n {
            p.advance_by(10_000_000);
            let s = p.sample_with_truth();
            let error = s.sample.reference_ns as i64 - s.true_ns as i64;
            assert_eq!(error, s.read_error_ns + s.outlier_error_ns);
            assert!(s.read_error_ns.unsigned_abs() <= s.sample.max_deviation_ns);
            if s.is_outlier() {
                outliers += 1;
                assert_eq!(s.outlier_error_ns.abs(), 50_000);
                positive += (s.outlier_error_ns > 0) as u32;
                // Hidden: the bracket does not cover it.
                assert!(error.unsigned_abs() > s.sample.max_deviation_ns);
            }
        }
        let fraction = outliers as f64 / n as f64;
        assert!((fraction - 0.1).abs() < 0.015, "{fraction}");
        assert!(
            positive > outliers / 3 && positive < 2 * outliers / 3,
            "{positive}/{outliers}"
        );
        // Fractions 0 and 1.
        let mut all = pair(config.with_outliers(1.0, 7.0));
        assert!((0..100).all(|_| all.sample_with_truth().outlier_error_ns.abs() == 7));
        let mut none = pair(config.with_outliers(0.0, 7.0));
        assert!((0..100).all(|_| !none.sample_with_truth().is_outlier()));
    }

    #[test]
    fn wander_walk_has_sqrt_time_spread() {
        let sigma = 0.1;
        let seeds = 40;
        let mut sum_sq = 0.0;
        for seed in 0..seeds {
            let config = SimClockConfig::default()
                .with_drift_ppm(20.0)
                .with_wander_ppm_per_sqrt_s(sigma)
                .with_seed(seed);
            let mut p = pair(config);
            let d = p.true_drift_ppm_at(config.start_ns + 100_000_000_000) - 20.0;
            sum_sq += d * d;
        }
        let std = (sum_sq / seeds as f64).sqrt();
        let expected = sigma * 100f64.sqrt();
        assert!(std > 0.6 * expected && std < 1.5 * expected, "{std} vs {expected}");
    }

    #[test]
    fn piecewise_truth_is_the_sum_over_knots() {
        let config = SimClockConfig::default()
            .with_drift_ppm(-80.0)
            .with_wander_ppm_per_sqrt_s(5.0)
            .with_ticks(52.08, 64)
            .with_seed(21);
        let mut p = pair(config);
        let start = config.start_ns;
        let (t1, t2) = (start + 1_234_567_891, start + 61_987_654_321);
        p.advance_to(t2);
        let c1 = p.count_q64_at(t1);
        let c2 = p.count_q64_at(t2);
        // Exact: integrate the fixed-point rates segment by segment.
        let mut exact: u128 = 0;
        let mut approx = 0.0f64;
        let mut t = t1;
        while t < t2 {
            let j = p.segment_of(t);
            let end = (p.knot_time(j) + WANDER_STEP_NS).min(t2);
            exact += (end - t) as u128 * p.knots[j].rate_q64;
            approx += (end - t) as f64 * (1.0 + p.knots[j].drift_ppm * 1e-6) / 52.08;
            t = end;
        }
        assert_eq!(c2.wrapping_sub(c1), exact);
        let ticks = (p.true_ticks_at(t2) - p.true_ticks_at(t1)) as f64;
        assert!((ticks - approx).abs() <= 1.0 + 1e-6, "{ticks} vs {approx}");
        assert!((exact as f64 / 2f64.powi(64) - approx).abs() < 1e-4);
        // The walk moved the drift.
        assert_ne!(p.true_drift_ppm_at(t2), -80.0);
        assert_eq!(p.true_drift_ppm_at(start + 9_999_999), -80.0);
    }

    #[test]
    fn invalid_configs_are_typed_errors() {
        let ok = SimClockConfig::default();
        let err = |c: SimClockConfig| SimClockPair::new(c).unwrap_err();
        assert_eq!(
            err(ok.with_ticks(1.0, 0)),
            CalibrationError::InvalidValidBits { bits: 0 }
        );
        assert_eq!(
            err(ok.with_ticks(1.0, 65)),
            CalibrationError::InvalidValidBits { bits: 65 }
        );
        for period in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-9, 1e12] {
            assert_eq!(
                err(ok.with_ticks(period, 64)),
                CalibrationError::InvalidPeriod,
                "{period}"
            );
        }
        let what = |c: SimClockConfig| match err(c) {
            CalibrationError::NonFinite { what } => what,
            other => panic!("{other:?}"),
        };
        for drift in [f64::NAN, f64::INFINITY, -1e6, 2e6] {
            assert_eq!(what(ok.with_drift_ppm(drift)), "drift_ppm");
        }
        assert_eq!(what(ok.with_wander_ppm_per_sqrt_s(-0.1)), "wander_ppm_per_sqrt_s");
        assert_eq!(what(ok.with_wander_ppm_per_sqrt_s(f64::NAN)), "wander_ppm_per_sqrt_s");
        assert_eq!(what(ok.with_jitter_ns(-1.0)), "jitter_ns");
        assert_eq!(what(ok.with_jitter_ns(f64::INFINITY)), "jitter_ns");
        for fraction in [-0.1, 1.1, f64::NAN] {
            assert_eq!(what(ok.with_outliers(fraction, 1.0)), "outlier_fraction");
        }
        assert_eq!(what(ok.with_outliers(0.5, -1.0)), "outlier_ns");
        assert_eq!(what(ok.with_outliers(0.5, f64::NAN)), "outlier_ns");
        // Edges that are fine.
        assert!(SimClockPair::new(ok.with_ticks(1e-3, 1).with_drift_ppm(1e6)).is_ok());
        assert!(SimClockPair::new(ok.with_ticks(1e9, 64).with_drift_ppm(-999_999.9)).is_ok());
        assert!(SimClockPair::new(ok.with_outliers(1.0, 0.0).with_offset_ns(i64::MIN).with_start_ns(0)).is_ok());
    }

    #[test]
    fn extreme_but_valid_configs_do_not_panic() {
        let configs = [
            SimClockConfig::default()
                .with_start_ns(u64::MAX - 5)
                .with_offset_ns(i64::MAX),
            SimClockConfig::default()
                .with_start_ns(0)
                .with_offset_ns(i64::MIN)
                .with_ticks(1e-3, 64),
            SimClockConfig::default()
                .with_jitter_ns(1e300)
                .with_outliers(0.5, 1e300)
                .with_start_ns(0),
            SimClockConfig::default()
                .with_drift_ppm(-999_999.0)
                .with_wander_ppm_per_sqrt_s(1e6)
                .with_ticks(1e9, 1),
            SimClockConfig::default()
                .with_start_ns(u64::MAX - 25_000_000)
                .with_wander_ppm_per_sqrt_s(1.0),
        ];
        for config in configs {
            let mut p = pair(config);
            for step in [0, 1, 1_000, 15_000_000, 100_000_000] {
                p.advance_by(step);
                let s = p.sample_with_truth();
                let _ = p.true_reference_ns(s.sample.source_ticks);
                let _ = p.true_reference_ns(0);
                let _ = p.true_ticks_at(p.now_ns().saturating_add(1_000_000_000));
                let _ = p.true_drift_ppm_at(p.now_ns());
            }
        }
        // Far future without wander is O(1) and exact.
        let mut p = pair(SimClockConfig::default().with_start_ns(0));
        p.advance_to(u64::MAX);
        assert_eq!(p.true_ticks_at(u64::MAX), u64::MAX);
        assert_eq!(p.true_reference_ns(5), 5);
    }

    #[test]
    fn time_only_moves_forward_and_the_past_saturates() {
        let config = SimClockConfig::default()
            .with_drift_ppm(100.0)
            .with_wander_ppm_per_sqrt_s(1.0);
        let mut p = pair(config);
        let start = config.start_ns;
        p.advance_to(start + 1_000_000);
        p.advance_to(start + 10);
        assert_eq!(p.now_ns(), start + 1_000_000);
        assert_eq!(p.true_ticks_at(0), p.true_ticks_at(start));
        assert_eq!(p.true_drift_ppm_at(0), 100.0);
        assert_eq!(p.true_reference_ns_before(0, 0), start);
    }

    #[test]
    fn retention_drops_old_knots() {
        let config = SimClockConfig::default().with_wander_ppm_per_sqrt_s(1.0).with_seed(4);
        let mut kept = pair(config);
        let mut all = pair(config);
        kept.set_knot_retention_ns(Some(1_000_000_000));
        let start = config.start_ns;
        for i in 1..=600u64 {
            let t = start + i * 100_000_000;
            kept.advance_to(t);
            all.advance_to(t);
            assert_eq!(kept.sample(), all.sample());
        }
        assert_eq!(all.knot_count(), 6_001);
        assert!(kept.knot_count() <= 102, "{}", kept.knot_count());
        let now = kept.now_ns();
        let recent = now - 999_999_999;
        assert_eq!(kept.true_ticks_at(recent), all.true_ticks_at(recent));
        let ticks = all.true_ticks_at(recent);
        assert_eq!(kept.true_reference_ns(ticks), all.true_reference_ns(ticks));
        // Older than the window: saturates to the oldest kept knot.
        let oldest = kept.knot_time(0);
        assert!(oldest <= now - 1_000_000_000);
        assert_eq!(kept.true_ticks_at(start), all.true_ticks_at(oldest));
    }

    #[test]
    fn ten_simulated_minutes_are_fast() {
        let started = std::time::Instant::now();
        let mut p = pair(SimClockConfig::realistic(1));
        let samples = p.sample_burst(6_001, 100_000_000);
        let elapsed = started.elapsed();
        assert_eq!(samples.len(), 6_001);
        assert_eq!(p.now_ns(), 1_000_000_000 + 600_000_000_000);
        assert_eq!(p.knot_count(), 60_001);
        assert!(elapsed.as_secs_f64() < 1.0, "{elapsed:?}");
    }

    #[test]
    fn long_division_is_exact() {
        assert_eq!(mul_pow2_div_floor(10, 0, 3), (3, true));
        assert_eq!(mul_pow2_div_floor(9, 0, 3), (3, false));
        assert_eq!(mul_pow2_div_floor(1, 64, 1), (1u128 << 64, false));
        assert_eq!(mul_pow2_div_floor(1, 64, 3), ((1u128 << 64) / 3, true));
        assert_eq!(mul_pow2_div_floor(5, -1, 1), (2, true));
        assert_eq!(mul_pow2_div_floor(5, -200, 1), (0, true));
        // floor(2^130 / 3) = (2^130 - 1) / 3, whose low 128 bits are (2^128 - 1) / 3.
        assert_eq!(mul_pow2_div_floor(1, 130, 3), (u128::MAX / 3, true));
        assert_eq!(decompose(1.0), (1u64 << 52, -52));
        assert_eq!(decompose(0.25), (1u64 << 52, -54));
    }
}
