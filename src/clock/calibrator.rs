//! [`TscCalibrator`]: the CPU tick counter's live calibration against `CLOCK_MONOTONIC`.
//!
//! Every `interval` it takes a burst of sandwiched samples (MONOTONIC, ticks, MONOTONIC), keeps the
//! tightest-bracketed ones and feeds them to a [`CalibrationHistory`]. The rate and offset come from the
//! history's fit over a growing baseline, so the calibration improves as the run goes on instead of trusting
//! one startup measurement (one-shot startup calibrations on this project's test VM were off by 100-260 ppm
//! at times).

use std::sync::Mutex;
use std::time::Duration;

use super::{bracketed_sample, monotonic_ns, FastConverter, Nanos, RawTicks, TickSource};
use crate::calibration::{
    CalibrationError, CalibrationHistory, CalibrationSample, ClockDomain, Converted, HistoryConfig,
};

/// How the CPU clock is sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TscCalibratorConfig {
    /// Samples per burst, [`MIN_BURST_SAMPLES`](Self::MIN_BURST_SAMPLES) to
    /// [`MAX_BURST_SAMPLES`](Self::MAX_BURST_SAMPLES) (others are an
    /// [`InvalidConfig`](CalibrationError::InvalidConfig) error). Each costs two `clock_gettime` calls and one
    /// counter read (~50-100 ns here).
    pub burst_samples: usize,
    /// Time between bursts. They are taken by the collector's drain passes, so at most one per pass (see
    /// `TimelineBuilder::poll_interval`): a shorter interval, zero included, means a burst every pass.
    pub interval: Duration,
    /// The history's filters and fit.
    pub history: HistoryConfig,
    /// How long the startup rate measurement spans (a baseline for the first fits; refined live afterwards).
    ///
    /// Measured once per process and counter: a later calibrator starts from the newest rate a calibrator of
    /// this process fitted (the live fit, or the first baseline), as long as that rate's standard error is no
    /// larger than [`HistoryConfig::nominal_rate_sigma_ppm`], so a second timeline starts without this wait.
    /// `CLOCK_MONOTONIC` ([`TickSource::Monotonic`]) needs no baseline: its rate is 1 ns per tick by definition.
    /// A timeline that lets the process decide its tick source (no `TimelineBuilder::tick_source`) measures
    /// the first baseline during that decision's TSC check, over the default 20 ms, and does not use this
    /// setting; a forced tick source, or a calibrator made directly, does.
    pub startup_baseline: Duration,
}

impl TscCalibratorConfig {
    /// The fewest samples a burst may take: the history keeps the tightest quarter of each burst
    /// ([`HistoryConfig::burst_keep`]), and a first fit from bursts of 3 or 4 (one sample kept) failed at start
    /// in about half of the tries here.
    pub const MIN_BURST_SAMPLES: usize = 8;
    /// The most samples a burst may take: about 0.4 ms of the collector's time at ~100 ns each.
    pub const MAX_BURST_SAMPLES: usize = 4096;

    /// Whether every setting is in its range.
    ///
    /// ```
    /// use tickline::clock::TscCalibratorConfig;
    /// assert!(TscCalibratorConfig::default().validate().is_ok());
    /// let none = TscCalibratorConfig { burst_samples: 0, ..Default::default() };
    /// assert!(none.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), CalibrationError> {
        if !(Self::MIN_BURST_SAMPLES..=Self::MAX_BURST_SAMPLES).contains(&self.burst_samples) {
            return Err(CalibrationError::InvalidConfig {
                what: "burst_samples must be 8 to 4096",
            });
        }
        if self.startup_baseline > Self::MAX_STARTUP_BASELINE {
            return Err(CalibrationError::InvalidConfig {
                what: "startup_baseline must be at most 60 s",
            });
        }
        self.history.validate()
    }

    /// The longest [`startup_baseline`](Self::startup_baseline): a start that sleeps longer is a mistake.
    pub const MAX_STARTUP_BASELINE: Duration = Duration::from_secs(60);
}

impl Default for TscCalibratorConfig {
    fn default() -> Self {
        TscCalibratorConfig {
            burst_samples: 32,
            // 32 samples × ~100 ns every 100 ms: ~0.003 % of one core.
            interval: Duration::from_millis(100),
            history: HistoryConfig {
                // The startup baseline measures the rate to a few ppm: a much tighter prior than a GPU's.
                nominal_rate_sigma_ppm: 20.0,
                // A CPU crystal's rate wanders by well under 0.01 ppm per √s (temperature-driven).
                wander_ppm_per_sqrt_s: 0.01,
                ..HistoryConfig::default()
            },
            startup_baseline: Duration::from_millis(20),
        }
    }
}

/// The live calibration of the CPU tick counter against `CLOCK_MONOTONIC`.
///
/// ```
/// use tickline::clock::{TickSource, TscCalibrator, TscCalibratorConfig};
/// let source = TickSource::hardware().unwrap_or(TickSource::Monotonic);
/// let mut calibrator = TscCalibrator::new(source, TscCalibratorConfig::default()).unwrap();
/// let ticks = source.read();
/// let now = tickline::clock::monotonic_ns();
/// let converted = calibrator.convert(ticks).unwrap();
/// assert!(converted.ns.abs_diff(now.0) < 1_000_000);
/// ```
#[derive(Debug)]
pub struct TscCalibrator {
    source: TickSource,
    config: TscCalibratorConfig,
    history: CalibrationHistory,
    next_burst_ns: u64,
    /// A calibrator started from a cached rate takes no burst before this (see [`TscCalibrator::burst`]).
    quiet_until_ns: u64,
}

impl TscCalibrator {
    /// Measures the counter's rate over `startup_baseline` (the first time in a process; later calibrators of
    /// the same counter start from the newest rate this process fitted) and takes the first burst.
    ///
    /// Fails if a setting is out of its range ([`TscCalibratorConfig::validate`]), or if the counter does not
    /// advance against `CLOCK_MONOTONIC` (a broken or virtualised-away counter), which the error says.
    pub fn new(source: TickSource, config: TscCalibratorConfig) -> Result<Self, CalibrationError> {
        config.validate()?;
        let (ns_per_tick, baseline) = match (take_baseline(source), startup_rate(source, &config)) {
            (Some(pair), _) => (pair_rate(&pair).ok_or(CalibrationError::DegenerateTicks)?, Some(pair)),
            (None, Some(ns_per_tick)) => (ns_per_tick, None),
            (None, None) => {
                let burst = config.burst_samples.max(4);
                let first = best_sample(source, burst);
                std::thread::sleep(config.startup_baseline);
                let second = best_sample(source, burst);
                let pair = [first, second];
                (pair_rate(&pair).ok_or(CalibrationError::DegenerateTicks)?, Some(pair))
            }
        };
        let domain = ClockDomain::new(64, ns_per_tick)?;
        let mut history = CalibrationHistory::new(domain, config.history);
        if let Some(pair) = baseline {
            history.add_burst(&pair)?;
        }
        let mut calibrator = TscCalibrator {
            source,
            config,
            history,
            next_burst_ns: 0,
            quiet_until_ns: 0,
        };
        calibrator.burst()?;
        if baseline.is_none() {
            // Started from a known rate, without a baseline pair: the window must span the baseline before the
            // rate can be fitted, and offset-only refits of bursts closer together than that only churn knots.
            let span = config
                .startup_baseline
                .max(Duration::from_nanos(config.history.min_rate_span_ns))
                + Duration::from_millis(1);
            calibrator.quiet_until_ns = monotonic_ns().0.saturating_add(crate::clock::saturating_ns(span));
            calibrator.next_burst_ns = calibrator.quiet_until_ns;
        }
        Ok(calibrator)
    }

    /// The counter this calibrator reads.
    pub fn source(&self) -> TickSource {
        self.source
    }

    /// The history: knots, newest fit, statistics.
    pub fn history(&self) -> &CalibrationHistory {
        &self.history
    }

    /// Takes one burst now, whatever the schedule says; except that a calibrator started from a cached rate
    /// (no baseline of its own) takes none until `startup_baseline` has passed since its first burst, and
    /// returns `Ok` without sampling: the window must span that long before its rate can be fitted.
    pub fn burst(&mut self) -> Result<(), CalibrationError> {
        if monotonic_ns().0 < self.quiet_until_ns {
            self.next_burst_ns = self.quiet_until_ns;
            return Ok(());
        }
        let samples: Vec<_> = (0..self.config.burst_samples.max(1))
            .map(|_| bracketed_sample(self.source, monotonic_ns))
            .collect();
        self.next_burst_ns = monotonic_ns()
            .0
            .saturating_add(crate::clock::saturating_ns(self.config.interval));
        self.history.add_burst(&samples)?;
        if let Some(latest) = self.history.latest() {
            remember_rate(self.source, latest.ns_per_tick(), latest.rate_sigma_ppm());
        }
        Ok(())
    }

    /// Takes a burst if one is due at `now`. Returns whether it did. Call this from a background thread on
    /// any period shorter than the interval.
    pub fn poll(&mut self, now: Nanos) -> Result<bool, CalibrationError> {
        if now.0 < self.next_burst_ns {
            return Ok(false);
        }
        self.burst().map(|()| true)
    }

    /// Converts raw ticks to `CLOCK_MONOTONIC` ns with the live history (monotonic in the input).
    pub fn convert(&mut self, ticks: RawTicks) -> Option<Converted> {
        self.history.convert(ticks.0)
    }

    /// A division-free converter for the newest fit: valid from the newest knot onwards; rebuild it after
    /// every burst (it is cheap).
    pub fn fast_converter(&self) -> Option<FastConverter> {
        self.history.latest().map(FastConverter::new)
    }

    /// The counter's frequency according to the newest fit, in Hz.
    pub fn rate_hz(&self) -> Option<f64> {
        self.history.latest().map(|c| c.ticks_per_second())
    }
}

/// The newest rate a calibrator of this process fitted for the hardware counter: `(ns per tick, standard error in
/// ppm)`. One slot: a process has one hardware counter (`CLOCK_MONOTONIC` needs none).
static HARDWARE_RATE: Mutex<Option<(f64, f64)>> = Mutex::new(None);

/// A baseline pair measured alongside other start-up work ([`measure_rate_while`]), waiting for the first
/// calibrator of the hardware counter.
static HARDWARE_BASELINE: Mutex<Option<[CalibrationSample; 2]>> = Mutex::new(None);

/// Where a new calibrator's rate comes from without a baseline: 1 ns per tick for `CLOCK_MONOTONIC`, the cached
/// rate for the hardware counter when it is at least as good as the history assumes.
fn startup_rate(source: TickSource, config: &TscCalibratorConfig) -> Option<f64> {
    if source == TickSource::Monotonic {
        return Some(1.0);
    }
    let cached = *HARDWARE_RATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    cached
        .filter(|&(ns_per_tick, sigma_ppm)| {
            ns_per_tick.is_finite() && ns_per_tick > 0.0 && sigma_ppm <= config.history.nominal_rate_sigma_ppm
        })
        .map(|(ns_per_tick, _)| ns_per_tick)
}

/// Runs `during` while measuring the hardware counter's rate over at least `baseline`: the measurement the first
/// [`TscCalibrator::new`] of the process would otherwise make by sleeping, overlapped with other start-up work
/// (the up-front reliability check). `wanted(&result)` says whether the counter will be used; if not, the rest
/// of the baseline is not waited for. Does nothing beyond `during` when a rate is cached already.
pub(crate) fn measure_rate_while<T>(
    source: TickSource,
    baseline: Duration,
    during: impl FnOnce() -> T,
    wanted: impl FnOnce(&T) -> bool,
) -> T {
    if source == TickSource::Monotonic || HARDWARE_RATE.lock().map_or(true, |rate| rate.is_some()) {
        return during();
    }
    let burst = TscCalibratorConfig::default().burst_samples.max(4);
    let first = best_sample(source, burst);
    let started = std::time::Instant::now();
    let result = during();
    if !wanted(&result) {
        return result;
    }
    std::thread::sleep(baseline.saturating_sub(started.elapsed()));
    let second = best_sample(source, burst);
    let ticks = second.source_ticks.wrapping_sub(first.source_ticks);
    let ns = second.reference_ns.saturating_sub(first.reference_ns);
    if ticks > 0 && ns > 0 && ticks <= i64::MAX as u64 {
        // Each midpoint is off by at most its half-width: a bound, wider than the 1-sigma a fit states.
        let bound_ppm = (first.max_deviation_ns + second.max_deviation_ns) as f64 / ns as f64 * 1e6;
        let mut cached = HARDWARE_RATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if cached.is_none() {
            *cached = Some((ns as f64 / ticks as f64, bound_ppm));
            *HARDWARE_BASELINE
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some([first, second]);
        }
    }
    result
}

/// The baseline pair [`measure_rate_while`] measured, for the next calibrator of the hardware counter, if it is
/// still fresh (its second sample under a second old): that calibrator then starts exactly as if it had measured
/// the pair itself. Taken once.
fn take_baseline(source: TickSource) -> Option<[CalibrationSample; 2]> {
    if source == TickSource::Monotonic {
        return None;
    }
    let pair = HARDWARE_BASELINE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take()?;
    (monotonic_ns().0.saturating_sub(pair[1].reference_ns) < 1_000_000_000).then_some(pair)
}

/// ns per tick between a baseline pair's samples; `None` if the counter did not advance.
fn pair_rate(pair: &[CalibrationSample; 2]) -> Option<f64> {
    let ticks = pair[1].source_ticks.wrapping_sub(pair[0].source_ticks);
    let ns = pair[1].reference_ns.saturating_sub(pair[0].reference_ns);
    (ticks > 0 && ns > 0 && ticks <= i64::MAX as u64).then(|| ns as f64 / ticks as f64)
}

/// Keeps a fitted rate for the next calibrator of `source`.
fn remember_rate(source: TickSource, ns_per_tick: f64, sigma_ppm: f64) {
    if source != TickSource::Monotonic && ns_per_tick.is_finite() && ns_per_tick > 0.0 && sigma_ppm.is_finite() {
        *HARDWARE_RATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some((ns_per_tick, sigma_ppm));
    }
}

/// The tightest of `n` bracketed samples.
fn best_sample(source: TickSource, n: usize) -> CalibrationSample {
    (0..n)
        .map(|_| bracketed_sample(source, monotonic_ns))
        .min_by_key(|s| s.max_deviation_ns)
        .expect("n >= 1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_source_calibrates_to_identity() {
        let mut c = TscCalibrator::new(TickSource::Monotonic, TscCalibratorConfig::default()).unwrap();
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(5));
            c.burst().unwrap();
        }
        let rate = c.rate_hz().unwrap();
        assert!((rate / 1e9 - 1.0).abs() < 1e-4, "{rate}");
        let t = TickSource::Monotonic.read();
        let got = c.convert(t).unwrap();
        assert!(got.ns.abs_diff(t.0) < 1_000, "{got:?} vs {t:?}");
    }

    #[test]
    fn a_rate_measured_alongside_is_reused() {
        let Some(source) = TickSource::hardware() else {
            eprintln!("skipped: no hardware tick counter on this architecture");
            return;
        };
        // Whatever ran before in this test process may have cached a rate already; either way a cached rate
        // must exist afterwards and a new calibrator must not sleep the baseline.
        let value = measure_rate_while(source, Duration::from_millis(20), || 7, |_| true);
        assert_eq!(value, 7);
        let config = TscCalibratorConfig {
            startup_baseline: Duration::from_secs(5),
            ..TscCalibratorConfig::default()
        };
        let rate = startup_rate(source, &config).expect("a cached rate");
        assert!(rate > 0.0 && rate < 10.0, "{rate} ns per tick");
        let started = std::time::Instant::now();
        let mut c = TscCalibrator::new(source, config).unwrap();
        assert!(started.elapsed() < Duration::from_secs(1), "slept the 5 s baseline");
        let s = bracketed_sample(source, monotonic_ns);
        let got = c.convert(RawTicks(s.source_ticks)).unwrap();
        assert!(
            got.ns.abs_diff(s.reference_ns) < 50_000 + s.max_deviation_ns,
            "{got:?} vs {s:?}"
        );
        // CLOCK_MONOTONIC never needs a baseline.
        assert_eq!(startup_rate(TickSource::Monotonic, &config), Some(1.0));
    }

    #[test]
    fn a_calibrator_from_a_cached_rate_waits_for_a_baseline_span_before_fitting() {
        // CLOCK_MONOTONIC always starts from its known rate, without a baseline pair.
        let mut c = TscCalibrator::new(TickSource::Monotonic, TscCalibratorConfig::default()).unwrap();
        let bursts = c.history().stats().bursts;
        c.burst().unwrap();
        assert_eq!(
            c.history().stats().bursts,
            bursts,
            "a burst inside the baseline span was taken"
        );
        assert!(!c.poll(monotonic_ns()).unwrap());
        std::thread::sleep(Duration::from_millis(25));
        assert!(
            c.poll(monotonic_ns()).unwrap(),
            "the burst after the baseline span is due"
        );
        assert_eq!(c.history().stats().bursts, bursts + 1);
    }

    #[test]
    fn hardware_counter_tracks_monotonic() {
        let Some(source) = TickSource::hardware() else {
            eprintln!("skipped: no hardware tick counter on this architecture");
            return;
        };
        let mut c = TscCalibrator::new(source, TscCalibratorConfig::default()).unwrap();
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(10));
            c.burst().unwrap();
        }
        let s = bracketed_sample(source, monotonic_ns);
        let got = c.convert(RawTicks(s.source_ticks)).unwrap();
        // Loose: a loaded 2-core VM can preempt between the reads; the accuracy figures come from
        // `tickline clock`.
        assert!(
            got.ns.abs_diff(s.reference_ns) < 50_000 + s.max_deviation_ns,
            "{got:?} vs {s:?}"
        );
        assert!(!c.poll(Nanos(0)).unwrap(), "a burst just ran, none is due");
    }
}
