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

use std::collections::VecDeque;

use super::model::{unwrap_ticks, wander_sigma_ns};
use super::{
    fit_line, CalibrationError, CalibrationSample, ClockCalibration, ClockDomain, Converted, FitOptions, FitStrategy,
    LineFit,
};

/// Share of the window's wander phase a line fit misses at the window's centroid (fitted on the simulated pair:
/// it makes ~95 % of true times fall inside the stated range at 0.05 ppm/√s over a 4 s window).
const WINDOW_BOW: f64 = 0.15;
/// Share a line fit misses at its newest burst, where conversions before the next knot happen: 0.17 of the
/// window's wander phase by Monte Carlo over a random walk (0.098 at the centroid), rounded up.
const END_BOW: f64 = 0.2;
/// Predicting beyond the window, the fitted rate misses the current one by up to this many times the wander
/// over the window (`ppm_per_sqrt_s * √window`): 0.9-1.5 by Monte Carlo for 1-4 s windows.
const RATE_MISS: f64 = 1.5;
/// The wander is measured over triples of burst points this far apart.
const WANDER_LAG_NS: u64 = 2_000_000_000;
/// Second differences remembered for the wander estimate: 32 s of bursts at the default 250 ms (a clock's
/// wander is a property of the clock; a long memory steadies the estimate).
const WANDER_MEMORY: usize = 128;
/// The wander estimate replaces the prior once this many second differences were seen.
const WANDER_MIN_INNOVATIONS: usize = 5;
/// Until the wander is measured, the stated uncertainty allows for this many times the prior.
const WARMUP_WANDER: f64 = 5.0;
/// Burst points kept per segment for the second differences.
const POINTS: usize = 64;
/// The fewest bursts a shortened window spans: fewer leave a robust fit too few samples to outvote an outlier.
const MIN_WINDOW: usize = 3;
/// The most wander the estimate may state, ppm/√s.
const MAX_WANDER: f64 = 100.0;

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
    /// At most this many segments are kept (at least 2); the oldest are dropped with their knots.
    pub max_segments: usize,
    /// How many standard errors of the map a conversion states (plus half the counter's resolution). Every
    /// timestamp converted with one fit shares that fit's error, so the errors of a whole second of timestamps
    /// move together: two standard errors (95 % of single timestamps) would leave the worst of a run's seconds
    /// largely outside, three keep at least 95 % inside in every second (measured in `tests/it/gpu_clocks.rs`).
    pub uncertainty_sigmas: f64,
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
    /// after it): `converted` is the hull of their answers, narrowed by the window when one was given.
    pub ambiguous: bool,
    /// No segment's answer (with its uncertainty) meets the window given: the calibration and the window
    /// disagree. `converted` is the calibration's own answer.
    pub outside_window: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Knot {
    /// Unwrapped ticks.
    ticks: u64,
    ns: u64,
    /// Standard error of `ns`.
    sigma_ns: f64,
}

/// The newest burst of a segment when the fit before it predicted it worse than two standard errors: maybe
/// noise, maybe the first sign of a break that the next burst will show. Until then, conversions after the
/// burst before it state the difference between the fits with and without it, and if the next burst breaks
/// on the same side, this burst moves to the new segment, so that it never bends the map before the break.
#[derive(Clone, Debug)]
struct Suspect {
    /// The segment's fit before the burst joined, and whether that fit had a rate.
    pre_fit: Option<ClockCalibration>,
    pre_has_rate: bool,
    /// The segment's newest burst before it.
    pre_last_burst: (u64, u64),
    /// Whether its refit placed a knot, and the window burst and point its joining pushed out.
    knot_placed: bool,
    popped_burst: Option<Vec<CalibrationSample>>,
    popped_point: Option<(u64, u64, f64)>,
    /// The burst (kept samples), its point and its representative sample.
    burst: Vec<CalibrationSample>,
    point: (u64, u64, f64),
    /// Whether it lay after (later than) the prediction.
    late: bool,
}

/// What a burst's check against the open segment's prediction found.
#[derive(Clone, Copy, Debug, Default)]
struct BurstCheck {
    /// Most of its tighter half disagrees with the prediction on one side: the clock broke before it.
    broken: bool,
    /// The prediction missed it by more than three standard errors: the window is too long for how the clock
    /// bends.
    too_long: bool,
    /// Missed by more than two: maybe the first burst after a break (whether it lay late).
    suspect: Option<bool>,
}

/// One stretch of the map between breaks.
#[derive(Clone, Debug)]
struct Segment {
    id: u64,
    /// Kept samples of the recent bursts (unwrapped ticks), one entry per burst.
    window: VecDeque<Vec<CalibrationSample>>,
    knots: VecDeque<Knot>,
    latest: Option<ClockCalibration>,
    /// Whether `latest` fitted a rate (false: offset only, with the prior or nominal rate).
    has_rate: bool,
    /// `(unwrapped ticks, reference ns)` of the tightest sample of the first and of the newest burst.
    first_burst: (u64, u64),
    last_burst: (u64, u64),
    /// The rate carried over a break: ns per tick and its standard error in ppm.
    rate_prior: Option<(f64, f64)>,
    /// The largest input converted so far and its output, for monotonic output within the segment.
    high_water: Option<(u64, u64)>,
    /// Recent burst points: `(unwrapped ticks, reference ns, variance ns²)` of each burst's offset.
    points: VecDeque<(u64, u64, f64)>,
    /// Per point, how far it says the map may be off there (see `point_floor`), as of the newest refit.
    floors: Vec<f64>,
    /// The most bursts the fit may span now (see `add_burst`).
    window_limit: usize,
    /// The newest burst, when its prediction missed it by more than three standard errors.
    suspect: Option<Suspect>,
}

impl Segment {
    fn new(id: u64, rate_prior: Option<(f64, f64)>, window_limit: usize) -> Self {
        Segment {
            id,
            window: VecDeque::new(),
            knots: VecDeque::new(),
            latest: None,
            has_rate: false,
            first_burst: (0, 0),
            last_burst: (0, 0),
            rate_prior,
            high_water: None,
            points: VecDeque::new(),
            floors: Vec::new(),
            window_limit,
            suspect: None,
        }
    }
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
    /// A reset was reported: the next burst starts a segment.
    reset_pending: bool,
    /// Recent second differences of burst points: `(squared miss, the brackets' share of it)`, both in units
    /// of what a wander of 1 ppm/√s would give.
    innovations: VecDeque<(f64, f64)>,
    /// The wander in use (ppm/√s).
    wander: f64,
    stats: HistoryStats,
}

/// How far the truth at `knot_ticks` can lie from `knot_ns` if the brackets hold it: each bracket
/// `reference ± deviation`, carried to `knot_ticks` along `ns_per_tick`, is an interval; where more than half
/// of them overlap (Marzullo's intersection, as NTP picks its truechimers) the truth lies if most brackets are
/// honest. The result is the distance from `knot_ns` to that region's far edge, or 0 when no majority agrees.
fn bracket_agreement_ns(samples: &[CalibrationSample], knot_ticks: u64, line: &LineFit, knot_ns: u64) -> f64 {
    let mut edges: Vec<(f64, i32)> = Vec::with_capacity(2 * samples.len());
    for s in samples {
        let distance = (knot_ticks as i128 - s.source_ticks as i128) as f64;
        let at_knot = (s.reference_ns as i128 - knot_ns as i128) as f64 + distance * line.slope_ns_per_tick;
        // Carried with a fitted rate, a bracket also carries twice the rate's error over the distance.
        let half_width = s.max_deviation_ns as f64 + 2.0 * (distance * line.slope_sigma_ns_per_tick).abs();
        edges.push((at_knot - half_width, 1));
        edges.push((at_knot + half_width, -1));
    }
    // Closed intervals: at equal values, an opening counts before a closing.
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
    let (mut count, mut best) = (0i32, 0i32);
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for (i, &(value, step)) in edges.iter().enumerate() {
        count += step;
        if step > 0 && count >= best {
            let end = edges.get(i + 1).map_or(value, |e| e.0);
            if count > best {
                (lo, hi) = (value, end);
            } else {
                hi = hi.max(end);
            }
            best = count;
        }
    }
    if 2 * best as usize <= samples.len() || !lo.is_finite() || !hi.is_finite() {
        return 0.0;
    }
    lo.abs().max(hi.abs())
}

/// Raises a line's standard errors to what its samples' brackets imply: each sample's midpoint lies within
/// its deviation of the truth, uniformly at worst (σ = deviation / √3), and a weighted fit through such samples
/// cannot know its intercept and rate better than that. A fit over few samples can state less by luck (its
/// residuals happened to line up), which is exactly when the data does not support it.
fn bracket_floor(mut line: LineFit, samples: &[CalibrationSample]) -> LineFit {
    let weights: Vec<(f64, f64)> = samples
        .iter()
        .map(|s| {
            let x = s.source_ticks.wrapping_sub(line.origin_ticks) as i64 as f64;
            let sigma = (s.max_deviation_ns as f64 / 3f64.sqrt()).max(0.5);
            (x, 1.0 / (sigma * sigma))
        })
        .collect();
    let total: f64 = weights.iter().map(|(_, w)| w).sum();
    if !(total.is_finite() && total > 0.0) {
        return line;
    }
    let mean_x = weights.iter().map(|(x, w)| x * w).sum::<f64>() / total;
    let spread: f64 = weights.iter().map(|(x, w)| w * (x - mean_x).powi(2)).sum();
    // At the origin, which may sit off the weighted centroid: the rate's error reaches it over that distance.
    let intercept_var = 1.0 / total + mean_x.powi(2) / spread.max(f64::MIN_POSITIVE);
    line.intercept_sigma_ns = line.intercept_sigma_ns.max(intercept_var.sqrt());
    if spread > 0.0 {
        line.slope_sigma_ns_per_tick = line.slope_sigma_ns_per_tick.max(1.0 / spread.sqrt());
    }
    line
}

/// A burst's point: the tightest sample's ticks, where most of the burst's brackets agree the true reference
/// time lies there (each carried along the nominal rate: a burst spans microseconds), the middle of that
/// agreement, and its variance (uniform across it). Marzullo's majority, so a few hidden outliers cannot
/// move it; as narrow as the tightest bracket or narrower, far better than any one sample's midpoint. When no
/// majority agrees, the median midpoint with the brackets' typical spread.
fn burst_point(samples: &[CalibrationSample], ns_per_tick: f64) -> (u64, u64, f64) {
    let first = samples[0];
    let x = first.source_ticks;
    let carried = |s: &CalibrationSample| {
        (s.reference_ns as i128 - first.reference_ns as i128) as f64
            + (x as i128 - s.source_ticks as i128) as f64 * ns_per_tick
    };
    let mut edges: Vec<(f64, i32)> = Vec::with_capacity(2 * samples.len());
    for s in samples {
        let at = carried(s);
        edges.push((at - s.max_deviation_ns as f64, 1));
        edges.push((at + s.max_deviation_ns as f64, -1));
    }
    edges.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
    let (mut count, mut best, mut region) = (0i32, 0i32, (0.0, 0.0));
    for (i, &(value, step)) in edges.iter().enumerate() {
        count += step;
        if step > 0 && count > best {
            best = count;
            region = (value, edges.get(i + 1).map_or(value, |e| e.0));
        }
    }
    let (offset, variance) = if 2 * best as usize > samples.len() {
        let half = (region.1 - region.0) / 2.0;
        (region.0 + half, (half * half / 3.0).max(0.25))
    } else {
        let mut midpoints: Vec<f64> = samples.iter().map(carried).collect();
        let mean_dev = samples.iter().map(|s| s.max_deviation_ns as f64).sum::<f64>() / samples.len() as f64;
        // A median's variance is π/2 times the mean's.
        (
            median(&mut midpoints),
            std::f64::consts::FRAC_PI_2 * (mean_dev / 3f64.sqrt()).powi(2) / samples.len() as f64,
        )
    };
    let y = (first.reference_ns as i128 + offset.round() as i128).clamp(0, u64::MAX as i128) as u64;
    (x, y, variance)
}

/// The newest point's triple about [`WANDER_LAG_NS`] apart: how far the middle point misses the chord of the
/// outer two (a straight line, whatever its slope, misses by nothing), squared, and the part of that the
/// points' own variances explain, both in units of what a 1 ppm/√s wander gives: `Var = τ³ / 6` for a
/// symmetric triple of half-span τ seconds, times 10⁶ ns² per ppm²·s.
fn second_difference(points: &VecDeque<(u64, u64, f64)>) -> Option<(f64, f64)> {
    let &(x3, t3, v3) = points.back()?;
    let closest = |target: u64| points.iter().min_by_key(|p| p.1.abs_diff(target)).copied();
    let (x2, t2, v2) = closest(t3.checked_sub(WANDER_LAG_NS)?)?;
    let (x1, t1, v1) = closest(t2.checked_sub(t3 - t2)?)?;
    let (a, b) = (t2.checked_sub(t1)? as f64, t3.checked_sub(t2)? as f64);
    let lag = WANDER_LAG_NS as f64;
    if a < 0.75 * lag || b < 0.75 * lag || (a - b).abs() > 0.25 * lag {
        return None;
    }
    let (dx1, dx3) = (x2 as i128 - x1 as i128, x3 as i128 - x2 as i128);
    if dx1 <= 0 || dx3 <= 0 {
        return None;
    }
    let (w1, w3) = (dx3 as f64 / (dx1 + dx3) as f64, dx1 as f64 / (dx1 + dx3) as f64);
    let chord = w1 * (t1 as i128 - t2 as i128) as f64 + w3 * (t3 as i128 - t2 as i128) as f64;
    let miss = -chord;
    let tau_s = (a + b) / 2.0 * 1e-9;
    let unit = tau_s.powi(3) / 6.0 * 1e6;
    Some((miss * miss / unit, (v2 + w1 * w1 * v1 + w3 * w3 * v3) / unit))
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
            config,
            segments: VecDeque::new(),
            next_segment: 0,
            unwrap_ref: None,
            reset_pending: false,
            innovations: VecDeque::new(),
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
        self.open().and_then(|s| s.knots.back()).map(|k| k.ticks)
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
            }
        }

        // The burst's point, from all its samples (before the tightest are kept for the fit).
        let burst_point = burst_point(&burst, self.domain.nominal_ns_per_tick());
        let keep = ((burst.len() as f64 * self.config.burst_keep).ceil() as usize).clamp(1, burst.len());
        burst.truncate(keep);
        let suspect = check.suspect.filter(|_| !broken && !reported);
        self.push_burst(burst, burst_point, suspect)
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
        if let Some(innovation) = second_difference(&points_snapshot) {
            self.add_innovation(innovation);
        }
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

    /// Takes a suspect burst out of the open segment again: its fit, knot, window and points as before it.
    fn restore(&mut self, suspect: &Suspect) {
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
        segment.has_rate = suspect.pre_has_rate;
        segment.last_burst = suspect.pre_last_burst;
        self.refresh_floors();
    }

    /// Closes the open segment and opens a new one, carrying the old rate as a loose prior.
    fn start_segment(&mut self) {
        let prior = self
            .latest()
            .map(|c| (c.ns_per_tick(), self.config.break_rate_sigma_ppm));
        self.segments
            .push_back(Segment::new(self.next_segment, prior, self.config.window_bursts));
        self.next_segment += 1;
        while self.segments.len() > self.config.max_segments {
            self.segments.pop_front();
        }
    }

    /// Checks a burst (unwrapped, widened, tightest first) against the open segment's prediction.
    fn check_burst(&self, burst: &[CalibrationSample]) -> BurstCheck {
        let Some(fit) = self.latest() else {
            return BurstCheck::default();
        };
        let mask = self.domain.mask();
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
        let bow = END_BOW * wander_sigma_ns(self.stated_wander(), span_s);
        let (mut above, mut below) = (0usize, 0usize);
        let mut residuals = Vec::with_capacity(test.len());
        let mut prediction_sigma = 0.0f64;
        for s in test {
            let ticks = s.source_ticks & mask;
            let residual = (s.reference_ns as i128 - fit.to_reference_ns(ticks) as i128) as f64;
            residuals.push(residual);
            let rate_miss = RATE_MISS * self.stated_wander() * 1e-6 * span_s.sqrt() * fit.beyond_window_s(ticks) * 1e9;
            let sigma = ((fit.uncertainty_ns(ticks) / 2.0).powi(2) + bow.powi(2) + rate_miss.powi(2)).sqrt();
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
        let point = burst_point(burst, self.domain.nominal_ns_per_tick());
        let miss = (point.1 as i128 - fit.to_reference_ns(point.0 & mask) as i128) as f64;
        let sigmas = miss.abs() / (prediction_sigma.powi(2) + point.2).sqrt();
        let rated = broken || self.open().is_some_and(|s| s.has_rate);
        BurstCheck {
            broken,
            too_long: rated && sigmas > 3.0,
            suspect: (rated && sigmas > 2.0).then_some(miss > 0.0),
        }
    }

    /// The wander the stated uncertainty allows for: the one in use, five times the prior until it has been
    /// measured (the first seconds of a history: a clock may wander more than the prior says, and the
    /// measurement needs a few seconds of bursts).
    fn stated_wander(&self) -> f64 {
        if self.innovations.len() < WANDER_MIN_INNOVATIONS {
            self.wander.max(WARMUP_WANDER * self.config.wander_ppm_per_sqrt_s)
        } else {
            self.wander
        }
    }

    /// Adds one second difference and updates the wander in use: the larger of the prior and the estimate.
    fn add_innovation(&mut self, innovation: (f64, f64)) {
        self.innovations.push_back(innovation);
        while self.innovations.len() > WANDER_MEMORY {
            self.innovations.pop_front();
        }
        let prior = self.config.wander_ppm_per_sqrt_s;
        self.wander = if self.innovations.len() < WANDER_MIN_INNOVATIONS {
            prior
        } else {
            // Medians, not means: a miss that an outlier inflates must not shorten the window (a shorter window
            // is more sensitive to the next outlier). A squared Gaussian's median is 0.455 times its mean.
            let mut misses: Vec<f64> = self.innovations.iter().map(|i| i.0).collect();
            let mut noise: Vec<f64> = self.innovations.iter().map(|i| i.1).collect();
            let noise = median(&mut noise);
            let squared = median(&mut misses) / 0.455 - noise;
            // Only a wander that stands out of the points' own noise is news.
            if squared > noise {
                // Overlapping triples make only a dozen or so independent ones: state the wander about a
                // standard error above the estimate, not at it.
                (1.4 * squared.sqrt()).max(prior).min(MAX_WANDER)
            } else {
                prior
            }
        };
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

    /// How many of the open segment's recent bursts to fit: all of them while the wander is the prior's;
    /// fewer when it is larger, where a line over more bursts would miss the bending clock at its end by more
    /// than the extra bursts average away.
    fn effective_window(&self, segment: &Segment) -> usize {
        let n = segment.window.len().min(segment.window_limit.max(MIN_WINDOW));
        // Within twice the prior the estimate is noise more than news: the full window (its knots are the most
        // accurate conversion, and more samples outvote an outlier).
        if n <= MIN_WINDOW || self.wander <= 2.0 * self.config.wander_ppm_per_sqrt_s {
            return n;
        }
        // One burst's offset error as its brackets imply it (uniform within ± the deviation).
        let mut burst_var: Vec<f64> = segment
            .window
            .iter()
            .map(|b| {
                let mean_dev = b.iter().map(|s| s.max_deviation_ns as f64).sum::<f64>() / b.len().max(1) as f64;
                (mean_dev / 3f64.sqrt()).powi(2) / b.len().max(1) as f64
            })
            .collect();
        let burst_var = median(&mut burst_var);
        let first = segment.window.front().map_or(0, |b| b[0].reference_ns);
        let last = segment.window.back().map_or(0, |b| b[0].reference_ns);
        let spacing_s = last.saturating_sub(first) as f64 * 1e-9 / (n - 1) as f64;
        (MIN_WINDOW..=n)
            .map(|m| {
                let m_f = m as f64;
                let statistical = burst_var * (4.0 * m_f - 2.0) / (m_f * (m_f + 1.0));
                let bow = END_BOW * wander_sigma_ns(self.wander, (m_f - 1.0) * spacing_s);
                (m, statistical + bow * bow)
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(n, |(m, _)| m)
    }

    fn refit(&mut self) -> Result<(), CalibrationError> {
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
        let wander = self.stated_wander();
        let fitted = ClockCalibration::from_line(&line, self.domain, calibrated_at)?.with_wander(wander);
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
                .map(|&&(x, y, _)| (y as i128 - fitted.to_reference_ns(x & self.domain.mask()) as i128) as f64)
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
        let max_knots = self.config.max_knots;
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
        let origin_ns = (origin.reference_ns as i128 + value.round() as i128).clamp(0, u64::MAX as i128) as u64;
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

    /// Extends a raw (masked) tick to the history's unwrapped count: the nearest value to the newest sample.
    fn extend(&self, raw: u64) -> Option<u64> {
        let (ref_raw, ref_ext) = self.unwrap_ref?;
        Some(ref_ext.wrapping_add(self.domain.delta_ticks(ref_raw, raw & self.domain.mask()) as u64))
    }

    /// True when the conversion of `ticks` is final: it has a calibration point after it (a knot of its
    /// segment, or a break that closed its segment).
    pub fn is_bracketed(&self, ticks: u64) -> bool {
        let Some(ext) = self.extend(ticks) else {
            return false;
        };
        let Some((index, _)) = self.candidates(ext).into_iter().flatten().next() else {
            return false;
        };
        index + 1 < self.segments.len() || self.segments[index].knots.back().is_some_and(|k| ext <= k.ticks)
    }

    /// True when every segment that may hold `ticks` has fitted a rate, over at least as long as it reaches
    /// back to `ticks` before its first burst (a tick just after a break, or between the bursts around it, is
    /// converted far better once the new segment's rate does not have to be carried further than it was
    /// measured), and `ticks` is not next to a burst that its prediction missed (the next burst tells whether
    /// that one was the first after a break).
    pub fn is_settled(&self, ticks: u64) -> bool {
        let Some(ext) = self.extend(ticks) else {
            return false;
        };
        let candidates = self.candidates(ext);
        candidates.iter().flatten().next().is_some()
            && candidates.iter().flatten().all(|&(index, c)| {
                let segment = &self.segments[index];
                let span = segment.last_burst.1.saturating_sub(segment.first_burst.1);
                let suspect = segment.suspect.as_ref().is_some_and(|s| ext > s.pre_last_burst.0);
                segment.has_rate && segment.first_burst.1.saturating_sub(c.ns) <= span && !suspect
            })
    }

    /// Converts `ext` with one segment's map, without the monotonic guard, stating at least how far the map
    /// misses the burst points on either side of `ext` (and, for a miss beyond their noise, that noise too):
    /// whatever the model says,
    /// the data shows the map is that far off there (a bend the wander estimate has not caught up with, a step
    /// too small to call a break).
    fn peek_segment(&self, segment: &Segment, ext: u64) -> Option<Converted> {
        let mut converted = self.map_segment(segment, ext)?;
        let after = segment.points.partition_point(|p| p.0 <= ext);
        let neighbours = after
            .checked_sub(1)
            .into_iter()
            .chain((after < segment.points.len()).then_some(after));
        let mut floor = 0.0f64;
        for index in neighbours {
            // Cached at each refit (the map changes only then); computed here when the cache is stale.
            let miss = match segment.floors.get(index) {
                Some(&miss) if segment.floors.len() == segment.points.len() => Some(miss),
                _ => self.point_floor(segment, segment.points[index]),
            };
            floor = floor.max(miss.unwrap_or(0.0));
        }
        let floor = (floor + self.domain.half_resolution_ns()).ceil() as u64;
        converted.uncertainty_ns = converted.uncertainty_ns.max(floor);
        // After the burst before a suspect one, the fit without it may be the right one (the suspect may be
        // the first burst after a break): state the difference.
        if let Some(suspect) = segment.suspect.as_ref().filter(|s| ext > s.pre_last_burst.0) {
            if let Some(pre) = suspect.pre_fit.as_ref() {
                let without = self.scaled(pre, ext & self.domain.mask());
                let apart = without.ns.abs_diff(converted.ns).saturating_add(without.uncertainty_ns);
                converted.uncertainty_ns = converted.uncertainty_ns.max(apart);
            }
        }
        Some(converted)
    }

    /// A fit's conversion stating `uncertainty_sigmas` standard errors instead of its two.
    fn scaled(&self, fit: &ClockCalibration, ticks: u64) -> Converted {
        let half_resolution = self.domain.half_resolution_ns();
        let sigmas = (fit.uncertainty_ns(ticks) - half_resolution).max(0.0) / 2.0;
        Converted {
            ns: fit.to_reference_ns(ticks),
            uncertainty_ns: (self.config.uncertainty_sigmas * sigmas + half_resolution).ceil() as u64,
        }
    }

    /// How far one burst point says the segment's map may be off at its tick: the map's miss of the point, and
    /// for a miss beyond the point's own noise (a misfit) up to two of the point's standard errors more (the
    /// truth can lie that far beyond what was measured); a miss within the noise adds nothing to the model's
    /// statement (blended in between, so the floor does not jump).
    fn point_floor(&self, segment: &Segment, (x, y, variance): (u64, u64, f64)) -> Option<f64> {
        let at = self.map_segment(segment, x)?;
        let miss = (y as i128 - at.ns as i128).unsigned_abs() as f64;
        let sigma = variance.sqrt();
        let beyond_noise = if sigma > 0.0 {
            ((miss - sigma) / sigma).clamp(0.0, 1.0)
        } else {
            1.0
        };
        Some(miss + 2.0 * sigma * beyond_noise)
    }

    /// Recomputes the open segment's cached point floors (after its map changed).
    fn refresh_floors(&mut self) {
        let Some(segment) = self.segments.back() else {
            return;
        };
        let floors: Vec<f64> = segment
            .points
            .iter()
            .map(|&point| self.point_floor(segment, point).unwrap_or(0.0))
            .collect();
        if let Some(segment) = self.segments.back_mut() {
            segment.floors = floors;
        }
    }

    /// Converts `ext` with one segment's map (knots, the newest fit), nothing else.
    fn map_segment(&self, segment: &Segment, ext: u64) -> Option<Converted> {
        let latest = segment.latest.as_ref()?;
        let newest = match segment.knots.back() {
            Some(&k) if ext < k.ticks => k,
            _ => return Some(self.scaled(latest, ext & self.domain.mask())),
        };
        let half_resolution = self.domain.half_resolution_ns();
        let oldest = segment.knots[0];
        if ext < oldest.ticks {
            return Some(self.extrapolate_back(segment, ext, oldest, half_resolution));
        }
        // The last knot with ticks <= ext; its successor exists because ext < newest.ticks.
        let i = segment.knots.partition_point(|k| k.ticks <= ext) - 1;
        let (a, b) = (segment.knots[i], segment.knots[i + 1]);
        debug_assert!(b.ticks <= newest.ticks);
        let span = (b.ticks - a.ticks) as u128;
        let into = (ext - a.ticks) as u128;
        let rise = (b.ns - a.ns) as u128;
        let ns = a.ns + ((into * rise + span / 2) / span) as u64;
        let w = into as f64 / span as f64;
        let sigma = a.sigma_ns * (1.0 - w) + b.sigma_ns * w;
        // Between knots the truth can bow away from the chord by the wander over the segment.
        let bow = WINDOW_BOW * wander_sigma_ns(self.stated_wander(), (b.ns - a.ns) as f64 * 1e-9);
        Some(Converted {
            ns,
            uncertainty_ns: (self.config.uncertainty_sigmas * (sigma.powi(2) + bow.powi(2)).sqrt() + half_resolution)
                .ceil() as u64,
        })
    }

    fn extrapolate_back(&self, segment: &Segment, ext: u64, oldest: Knot, half_resolution: f64) -> Converted {
        // The rate of the segment's first second (knots closer together than that carry their own noise into
        // the rate: two knots 20 ms apart after a break are 50 ns off each, several ppm), else the newest fit's.
        let ns_per_tick = match segment.knots.iter().find(|k| k.ns >= oldest.ns + 1_000_000_000) {
            Some(next) => (next.ns - oldest.ns) as f64 / (next.ticks - oldest.ticks) as f64,
            None => segment
                .latest
                .as_ref()
                .map_or(self.domain.nominal_ns_per_tick(), |c| c.ns_per_tick()),
        };
        let back_ns = (oldest.ticks - ext) as f64 * ns_per_tick;
        let ns = (oldest.ns as f64 - back_ns).max(0.0).round() as u64;
        let wander = wander_sigma_ns(self.stated_wander(), back_ns * 1e-9);
        let rate = segment
            .latest
            .as_ref()
            .map_or(0.0, |c| c.rate_sigma_ppm() * 1e-6 * back_ns);
        let uncertainty = self.config.uncertainty_sigmas
            * (oldest.sigma_ns.powi(2) + wander.powi(2) + rate.powi(2)).sqrt()
            + half_resolution;
        Converted {
            ns,
            uncertainty_ns: uncertainty.ceil() as u64,
        }
    }

    /// The reference times segment `index` answers for: from the newest burst of the segment before it to the
    /// first burst of the segment after it.
    fn range_of(&self, index: usize) -> (u64, u64) {
        let from = match index.checked_sub(1) {
            Some(before) => self.segments[before].last_burst.1,
            None => 0,
        };
        let to = self
            .segments
            .get(index + 1)
            .map_or(u64::MAX, |after| after.first_burst.1);
        (from, to)
    }

    /// The segments whose answer for `ext` falls in their range, newest first (at most four), with the answer.
    fn candidates(&self, ext: u64) -> [Option<(usize, Converted)>; 4] {
        let mut found = [None; 4];
        let mut n = 0;
        for index in (0..self.segments.len()).rev() {
            let (from, to) = self.range_of(index);
            // A cheap look first (one multiplication): only segments that may hold `ext` are asked properly.
            let segment = &self.segments[index];
            let ns_per_tick = segment
                .latest
                .as_ref()
                .map_or(self.domain.nominal_ns_per_tick(), |c| c.ns_per_tick());
            let distance = ext.wrapping_sub(segment.last_burst.0) as i64 as f64 * ns_per_tick;
            let roughly = segment.last_burst.1 as f64 + distance;
            let margin = 0.01 * distance.abs() + 1e6;
            if roughly + margin < from as f64 || roughly - margin > to as f64 {
                continue;
            }
            let Some(c) = self.peek_segment(segment, ext) else {
                continue;
            };
            if from <= c.ns && c.ns <= to {
                found[n] = Some((index, c));
                n += 1;
                if n == found.len() {
                    break;
                }
            }
        }
        found
    }

    /// Converts `ticks` to reference ns with its uncertainty, choosing among segments by what `window`
    /// (reference ns, `(earliest, latest)`) says of the true time, without the monotonic guard. `None` until
    /// the first successful fit.
    pub fn place(&self, ticks: u64, window: Option<(u64, u64)>) -> Option<Placement> {
        let ext = self.extend(ticks)?;
        let candidates = self.candidates(ext);
        let meets = |c: &Converted| match window {
            Some((lo, hi)) => {
                c.ns.saturating_add(c.uncertainty_ns) >= lo && c.ns.saturating_sub(c.uncertainty_ns) <= hi
            }
            None => true,
        };
        let in_window = candidates.iter().flatten().filter(|(_, c)| meets(c)).count();
        let outside_window = in_window == 0 && window.is_some();
        let chosen: Vec<(usize, Converted)> = candidates
            .iter()
            .flatten()
            .filter(|(_, c)| outside_window || meets(c))
            .copied()
            .collect();
        match chosen.as_slice() {
            [] => {
                // No segment claims the tick (a tick the counter skipped, or garbage): the nearest answer.
                let (index, converted) = (0..self.segments.len())
                    .rev()
                    .filter_map(|index| {
                        let c = self.peek_segment(&self.segments[index], ext)?;
                        let (from, to) = self.range_of(index);
                        Some((index, c, from.saturating_sub(c.ns).max(c.ns.saturating_sub(to))))
                    })
                    .min_by_key(|&(_, _, distance)| distance)
                    .map(|(index, c, _)| (index, c))?;
                Some(Placement {
                    converted,
                    segment: self.segments[index].id,
                    ambiguous: true,
                    outside_window,
                })
            }
            [(index, converted)] => Some(Placement {
                converted: *converted,
                segment: self.segments[*index].id,
                ambiguous: false,
                outside_window,
            }),
            several => {
                let lo = several.iter().map(|(_, c)| c.range().0).min().unwrap_or(0);
                let hi = several.iter().map(|(_, c)| c.range().1).max().unwrap_or(0);
                let (lo, hi) = match window {
                    Some((w_lo, w_hi)) if !outside_window && lo.max(w_lo) <= hi.min(w_hi) => {
                        (lo.max(w_lo), hi.min(w_hi))
                    }
                    _ => (lo, hi),
                };
                Some(Placement {
                    converted: Converted {
                        ns: lo + (hi - lo) / 2,
                        uncertainty_ns: (hi - lo).div_ceil(2),
                    },
                    segment: self.segments[several[0].0].id,
                    ambiguous: true,
                    outside_window,
                })
            }
        }
    }

    /// Converts `ticks` with the current map, without the monotonic guard. `None` before the first fit.
    pub fn peek(&self, ticks: u64) -> Option<Converted> {
        self.place(ticks, None).map(|p| p.converted)
    }

    /// [`place`](Self::place), and for a placement in one segment the monotonic guard of
    /// [`convert`](Self::convert) within that segment.
    pub fn convert_within(&mut self, ticks: u64, window: Option<(u64, u64)>) -> Option<Placement> {
        let mut placement = self.place(ticks, window)?;
        if placement.ambiguous {
            return Some(placement);
        }
        let ext = self.extend(ticks)?;
        let Some(segment) = self.segments.iter_mut().find(|s| s.id == placement.segment) else {
            return Some(placement);
        };
        let converted = &mut placement.converted;
        match segment.high_water {
            Some((hw_ticks, hw_ns)) if ext >= hw_ticks => {
                if converted.ns < hw_ns {
                    converted.ns = hw_ns;
                    self.stats.monotonic_clamps += 1;
                }
                segment.high_water = Some((ext, converted.ns));
            }
            Some((_, hw_ns)) => {
                if converted.ns > hw_ns {
                    converted.ns = hw_ns;
                    self.stats.monotonic_clamps += 1;
                }
            }
            None => segment.high_water = Some((ext, converted.ns)),
        }
        Some(placement)
    }

    /// Converts `ticks` to reference ns with its uncertainty. `None` until the first successful fit.
    ///
    /// Monotonic within a segment: for inputs converted in increasing order the outputs never decrease, even
    /// across refits; an output that a refit would have moved before an earlier one is held at the earlier one
    /// (and counted in [`HistoryStats::monotonic_clamps`]). Across a break, see [`place`](Self::place).
    pub fn convert(&mut self, ticks: u64) -> Option<Converted> {
        self.convert_within(ticks, None).map(|p| p.converted)
    }
}

fn push_knot(knots: &mut VecDeque<Knot>, knot: Knot, max_knots: usize) {
    if knots.len() >= max_knots {
        // Thin the older half to every second knot: old regions keep coarser coverage, memory stays flat.
        let half = knots.len() / 2;
        let mut thinned: VecDeque<Knot> = VecDeque::with_capacity(max_knots);
        for (i, k) in knots.iter().enumerate() {
            if i >= half || i % 2 == 0 {
                thinned.push_back(*k);
            }
        }
        *knots = thinned;
    }
    knots.push_back(knot);
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
        assert!(h.segments.iter().all(|s| s.window.len() <= config.window_bursts));
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

    /// A device clock of the tests' own: `rate` ticks per ns from `start`, plus jumps and rate steps.
    struct Clock {
        start_ns: u64,
        start_ticks: f64,
        ppm: f64,
        /// `(reference ns, ns the clock jumps by)`.
        jumps: Vec<(u64, f64)>,
        /// `(reference ns, new ppm)`.
        steps: Vec<(u64, f64)>,
        /// The counter changes every this many ticks.
        resolution: f64,
    }

    impl Clock {
        fn new(ppm: f64) -> Self {
            Clock {
                start_ns: 1_000_000_000,
                start_ticks: 9e12,
                ppm,
                jumps: Vec::new(),
                steps: Vec::new(),
                resolution: 1.0,
            }
        }

        fn ticks(&self, t: u64) -> u64 {
            let mut ticks = self.start_ticks;
            let (mut from, mut ppm) = (self.start_ns, self.ppm);
            for &(at, next) in &self.steps {
                if at >= t {
                    break;
                }
                ticks += (at - from) as f64 * (1.0 + ppm * 1e-6);
                (from, ppm) = (at, next);
            }
            ticks += (t - from) as f64 * (1.0 + ppm * 1e-6);
            ticks += self.jumps.iter().filter(|j| j.0 <= t).map(|j| j.1).sum::<f64>();
            ((ticks / self.resolution).floor() * self.resolution) as u64
        }

        /// A burst of 16 samples at `t`, brackets 200-1200 ns wide, the read anywhere inside.
        fn burst(&self, t: u64, rng: &mut crate::calibration::SplitMix64) -> Vec<CalibrationSample> {
            (0..16u64)
                .map(|i| {
                    // Reads at random phases: a counter coarser than its ticks is seen at every phase.
                    let read = t + i * 3_000 + rng.next_u64() % 1_000;
                    let width = 200 + rng.next_u64() % 1_000;
                    let before = read - rng.next_u64() % (width + 1);
                    CalibrationSample::from_bracket(self.ticks(read), before, before + width)
                })
                .collect()
        }
    }

    fn feed(history: &mut CalibrationHistory, clock: &Clock, from: u64, to: u64, period: u64, seed: u64) {
        let mut rng = crate::calibration::SplitMix64(seed);
        let mut t = from;
        while t < to {
            let _ = history.add_burst(&clock.burst(t, &mut rng));
            t += period;
        }
    }

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    #[test]
    fn a_jump_starts_a_segment_and_never_bends_the_map_before_it() {
        let mut clock = Clock::new(80.0);
        let jump_at = clock.start_ns + 10 * S + 100 * MS;
        clock.jumps.push((jump_at, 2e6));
        let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
        feed(&mut history, &clock, clock.start_ns, jump_at, 250 * MS, 1);
        let before: Vec<(u64, Converted)> = (0..20)
            .map(|i| clock.start_ns + 6 * S + i * 200 * MS)
            .map(|t| (t, history.peek(clock.ticks(t)).unwrap()))
            .collect();
        feed(&mut history, &clock, jump_at + 150 * MS, jump_at + 5 * S, 250 * MS, 2);
        let stats = history.stats();
        assert_eq!((stats.breaks, stats.segments), (1, 2), "{stats:?}");
        for (t, was) in before {
            let now = history.peek(clock.ticks(t)).unwrap();
            assert!(now.ns.abs_diff(t) <= now.uncertainty_ns, "{t}: {now:?}");
            assert!(
                now.ns.abs_diff(was.ns) <= 2,
                "the map before the jump moved: {was:?} -> {now:?}"
            );
        }
        // After it: the new segment, within its uncertainty.
        for i in 0..10 {
            let t = jump_at + 500 * MS + i * 300 * MS;
            let p = history.place(clock.ticks(t), None).unwrap();
            assert!(!p.ambiguous && p.segment == 1, "{p:?}");
            assert!(p.converted.ns.abs_diff(t) <= p.converted.uncertainty_ns, "{t}: {p:?}");
        }
        // Between the last burst before it and the first after: either side; the window decides.
        let t = jump_at + 20 * MS;
        let ticks = clock.ticks(t);
        let open = history.place(ticks, None).unwrap();
        assert!(open.ambiguous, "{open:?}");
        assert!(open.converted.ns.abs_diff(t) <= open.converted.uncertainty_ns);
        let windowed = history.place(ticks, Some((t - 500_000, t + 500_000))).unwrap();
        assert!(!windowed.ambiguous && windowed.segment == 1, "{windowed:?}");
        assert!(windowed.converted.ns.abs_diff(t) <= windowed.converted.uncertainty_ns);
        assert!(windowed.converted.uncertainty_ns < 1_000, "{windowed:?}");
    }

    #[test]
    fn after_a_backwards_jump_one_tick_value_is_placed_by_its_window() {
        let mut clock = Clock::new(-40.0);
        let jump_at = clock.start_ns + 8 * S + 60 * MS;
        clock.jumps.push((jump_at, -2e6));
        let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
        feed(&mut history, &clock, clock.start_ns, jump_at + 4 * S, 250 * MS, 3);
        assert_eq!(history.stats().breaks, 1);
        // The same tick values (within the 80 ns the rate makes of 2 ms) 1 ms before the jump and 1 ms after.
        let early = jump_at - MS;
        let late = early + 2 * MS;
        assert!(clock.ticks(late).abs_diff(clock.ticks(early)) < 100);
        for t in [early, late] {
            let p = history.place(clock.ticks(t), Some((t - 300_000, t + 300_000))).unwrap();
            assert!(p.converted.ns.abs_diff(t) <= p.converted.uncertainty_ns, "{t}: {p:?}");
            assert!(p.converted.uncertainty_ns < 1_000, "{p:?}");
        }
    }

    #[test]
    fn a_rate_step_is_detected_and_the_burst_before_it_moves_after_the_break() {
        let mut clock = Clock::new(80.0);
        let step_at = clock.start_ns + 9 * S + 240 * MS;
        clock.steps.push((step_at, 110.0));
        let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
        feed(&mut history, &clock, clock.start_ns, step_at + 5 * S, 250 * MS, 4);
        let stats = history.stats();
        assert_eq!(stats.breaks, 1, "{stats:?}");
        assert!((stats.drift_ppm - 110.0).abs() < 0.5, "{stats:?}");
        // Before the step the map is the old rate's, unbent; across it, honest.
        let mut t = step_at - 3 * S;
        while t < step_at + 3 * S {
            let c = history.peek(clock.ticks(t)).unwrap();
            assert!(
                c.ns.abs_diff(t) <= c.uncertainty_ns,
                "{} ms from the step: {c:?}",
                (t as i64 - step_at as i64) / 1_000_000
            );
            if t + 300 * MS < step_at {
                assert!(c.ns.abs_diff(t) < 100, "{t}: {c:?}");
            }
            t += 7 * MS;
        }
    }

    #[test]
    fn a_reported_reset_starts_a_segment_whatever_the_samples_say() {
        let clock = Clock::new(10.0);
        let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
        feed(
            &mut history,
            &clock,
            clock.start_ns,
            clock.start_ns + 2 * S,
            250 * MS,
            5,
        );
        let before = history.current_segment();
        history.report_reset();
        feed(
            &mut history,
            &clock,
            clock.start_ns + 2 * S,
            clock.start_ns + 3 * S,
            250 * MS,
            6,
        );
        assert_ne!(history.current_segment(), before);
        let stats = history.stats();
        assert_eq!((stats.resets, stats.breaks, stats.segments), (1, 0, 2));
    }

    #[test]
    fn a_coarse_counter_is_unbiased_and_its_resolution_is_stated() {
        // 1 ns ticks that change every microsecond (%globaltimer on some GPUs).
        let mut clock = Clock::new(30.0);
        clock.resolution = 1_000.0;
        let domain = ClockDomain::new(64, 1.0).unwrap().with_resolution_ns(1_000.0).unwrap();
        let mut history = CalibrationHistory::new(domain, HistoryConfig::default());
        feed(
            &mut history,
            &clock,
            clock.start_ns,
            clock.start_ns + 20 * S,
            250 * MS,
            7,
        );
        assert!(
            history.stats().max_deviation_ns >= 500,
            "brackets widened by half the resolution"
        );
        let (mut sum, mut n, mut inside) = (0i64, 0i64, 0);
        let mut t = clock.start_ns + 5 * S + 17;
        while t < clock.start_ns + 19 * S {
            let c = history.peek(clock.ticks(t)).unwrap();
            sum += c.ns as i64 - t as i64;
            n += 1;
            inside += usize::from(c.ns.abs_diff(t) <= c.uncertainty_ns);
            assert!(c.uncertainty_ns >= 500, "{c:?}");
            t += 1_234_567;
        }
        let mean = sum / n;
        assert!(mean.abs() < 60, "placed {mean} ns off on average");
        assert_eq!(inside as i64, n);
    }

    #[test]
    fn the_wander_is_measured_not_assumed() {
        for (wander, lo, hi) in [(0.0, 0.0, 0.2), (0.05, 0.0, 0.2), (1.0, 0.5, 3.0)] {
            let mut p = SimClockPair::new(SimClockConfig {
                drift_ppm: 200.0,
                wander_ppm_per_sqrt_s: wander,
                jitter_ns: 1_000.0,
                seed: 7,
                ..Default::default()
            })
            .unwrap();
            let h = run(&mut p, HistoryConfig::default(), 200, 250_000_000);
            let stats = h.stats();
            assert!(
                (lo..=hi).contains(&stats.wander_ppm_per_sqrt_s),
                "true {wander}: {stats:?}"
            );
            assert_eq!(stats.breaks, 0, "wander is no break: {stats:?}");
            if wander > 0.5 {
                assert!(
                    stats.window_bursts < 8,
                    "a shorter window for a wandering clock: {stats:?}"
                );
            }
        }
    }
}
