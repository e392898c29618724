//! The live calibration of one GPU device clock, as the collector runs it: when to take a burst, how long to
//! hold a slice for a later calibration point, and the conversion with its both-sided checks. Pure logic: time
//! is passed in, so the same code runs on the collector's real clock and on simulated time in tests. The
//! policy is described on [`GpuCalibrationConfig`].

use std::time::Duration;

use super::sanity::{QueueSanity, SliceInput, SliceMarks};
use crate::calibration::HistoryConfig;
use crate::calibration::{CalibrationError, CalibrationHistory, CalibrationSample, ClockDomain, Converted};

/// How the collector calibrates each GPU clock and when it exports a slice.
///
/// # Latency against accuracy
///
/// A finished slice is never converted before a calibration burst taken after its timestamps were read back:
/// that burst is what shows a jump or a rate step that happened before the slice ended, so a slice is never
/// placed with a fit that the next burst would call broken (a burst that its prediction missed by more than two
/// standard errors holds the slices before it for one more burst, which tells a break from noise). With the
/// default 250 ms burst period that wait is at most a period.
///
/// After that, a slice may wait up to [`latency_bound`](Self::latency_bound) (from its read-back) for a knot
/// after it, a fit centred on it. The default 500 ms gives most slices a second burst after them, so they lie
/// inside the fitted data rather than at its end: on the simulated 10-minute clock of `tests/it/gpu.rs` (200 ppm,
/// wander, 1 µs jitter, 5 % outliers) p99 89 ns, against 109 ns at 250 ms (one burst after) and 73 ns at 5 s
/// (centred knots, the old default); slices are exported about 0.5 s after they end (p50 and p99), where they
/// used to wait about 2 s. `0` exports as soon as one burst after the slice exists (p50 about 0.13 s); 2.5 s or
/// more gets the centred conversion for every slice.
///
/// A slice between the last burst before a break and the first after it also waits until the new segment's
/// rate reaches back to it, and a calibration that does not come (a device whose bursts fail after it was
/// calibrated) releases slices after `latency_bound` plus two burst periods, converted by extrapolation with
/// the uncertainty that implies. A device never calibrated cannot place its slices at all: they are held, and
/// counted lost at shutdown.
///
/// The defaults place slices with ≥ 95 % of true times inside the stated uncertainty, in every second, on every
/// device-clock model of `tests/it/gpu_clocks.rs` (the README's table).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuCalibrationConfig {
    /// Samples per burst (each a bracketed read of the device clock against `CLOCK_MONOTONIC`).
    pub burst_samples: usize,
    /// Time between bursts. It bounds how long a slice waits for the calibration point after it (see
    /// [latency against accuracy](Self#latency-against-accuracy)): a shorter period lowers latency and costs
    /// `burst_samples` calibrated reads more often.
    pub burst_period: Duration,
    /// Most time one burst may take; a burst stops early rather than wait for a tight sample (Tracy's loop
    /// could spin forever waiting for a low deviation, tracy#872).
    pub burst_budget: Duration,
    /// A burst is taken sooner when the newest fit, extrapolated to now, is less certain than this.
    pub max_uncertainty_ns: u64,
    /// Shortest time between two bursts, whatever the uncertainty (also for bursts a violation asks for).
    pub min_burst_gap: Duration,
    /// Once a calibration burst after a finished slice exists, the slice waits at most this long (from its
    /// read-back) for a knot after it, a fit centred on it, before it is converted by the newest fit. `0`
    /// exports as soon as possible; 2.5 s or more gets the centred, most accurate conversion for every slice.
    /// See [latency against accuracy](Self#latency-against-accuracy).
    pub latency_bound: Duration,
    /// A scope whose timestamps have not been written after this long (its commands were never submitted) is
    /// counted as lost; its timestamp pair is retired, not reused.
    pub lost_after: Duration,
    /// The fit, window and break detection of each device's calibration history.
    pub history: HistoryConfig,
}

impl GpuCalibrationConfig {
    /// The fewest samples a burst may take (the history keeps the tightest quarter of each).
    pub const MIN_BURST_SAMPLES: usize = 4;
    /// The most samples a burst may take.
    pub const MAX_BURST_SAMPLES: usize = 4096;
    /// The longest a burst may take: the collector waits for it.
    pub const MAX_BURST_BUDGET: Duration = Duration::from_secs(1);

    /// Whether every setting is in its range: `burst_samples` from
    /// [`MIN_BURST_SAMPLES`](Self::MIN_BURST_SAMPLES) to [`MAX_BURST_SAMPLES`](Self::MAX_BURST_SAMPLES),
    /// `burst_budget` above 0 and at most [`MAX_BURST_BUDGET`](Self::MAX_BURST_BUDGET), and the history's
    /// ([`HistoryConfig::validate`]). Durations may be as long as `Duration::MAX` (never). `TimelineBuilder::start`
    /// refuses a configuration that fails this.
    ///
    /// ```
    /// use tickline::gpu::GpuCalibrationConfig;
    /// assert!(GpuCalibrationConfig::default().validate().is_ok());
    /// let no_samples = GpuCalibrationConfig { burst_samples: 0, ..Default::default() };
    /// assert!(no_samples.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), crate::calibration::CalibrationError> {
        use crate::calibration::CalibrationError;
        if !(Self::MIN_BURST_SAMPLES..=Self::MAX_BURST_SAMPLES).contains(&self.burst_samples) {
            return Err(CalibrationError::InvalidConfig {
                what: "GPU burst_samples must be 4 to 4096",
            });
        }
        if self.burst_budget.is_zero() || self.burst_budget > Self::MAX_BURST_BUDGET {
            return Err(CalibrationError::InvalidConfig {
                what: "GPU burst_budget must be above 0 and at most 1 s",
            });
        }
        self.history.validate()
    }
}

impl Default for GpuCalibrationConfig {
    fn default() -> Self {
        GpuCalibrationConfig {
            burst_samples: 16,
            burst_period: Duration::from_millis(250),
            burst_budget: Duration::from_millis(2),
            max_uncertainty_ns: 1_000,
            min_burst_gap: Duration::from_millis(20),
            latency_bound: Duration::from_millis(500),
            lost_after: Duration::from_secs(10),
            history: HistoryConfig::default(),
        }
    }
}

/// What the collector knows of one finished GPU scope when it converts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuScopeTicks {
    /// The queue's index on its device.
    pub queue: u16,
    /// The begin timestamp, raw device ticks.
    pub begin: u64,
    /// The end timestamp, raw device ticks.
    pub end: u64,
    /// When the CPU recorded the scope (reference ns): the GPU cannot have begun it before.
    pub recorded_ns: u64,
    /// When the collector read both timestamps back (reference ns): the GPU ended it before.
    pub read_ns: u64,
}

/// A GPU slice placed on the reference clock: never an end before its begin, both inside
/// `[recorded, read back]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuSlicePlacement {
    /// The begin and its uncertainty.
    pub begin: Converted,
    /// The end and its uncertainty.
    pub end: Converted,
    /// What marks the slice (a break, a window violation, the queue's own calibration).
    pub marks: SliceMarks,
}

/// What the calibration history says of a held slice's conversion (see [`GpuClockTracker::readiness`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Readiness {
    burst_after: bool,
    settled: bool,
    bracketed: bool,
}

/// Counters of a [`GpuClockTracker`]'s placements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GpuClockStats {
    /// Slices placed.
    pub slices: u64,
    /// Slices marked ([`SliceMarks::any`]): placed across or next to a break, or outside their window.
    pub marked_slices: u64,
    /// Slices whose device conversion lay outside `[recorded, read back]` (beyond its uncertainty).
    pub window_violations: u64,
    /// Bursts taken early because of a violation.
    pub requested_bursts: u64,
    /// Queues that took a calibration of their own (counted each time one does).
    pub own_calibrations: u64,
    /// Timestamp reads and recycles the backend answered with an error, each call (the collector retries them;
    /// a scope never read is counted lost after `lost_after`, while the timeline runs).
    pub read_errors: u64,
}

/// One device clock's live calibration: burst schedule, history, hold-or-convert decisions, both-sided checks.
#[derive(Clone, Debug)]
pub struct GpuClockTracker {
    config: GpuCalibrationConfig,
    history: CalibrationHistory,
    last_burst_ns: Option<u64>,
    failed_bursts: u64,
    burst_requested: bool,
    queues: Vec<QueueSanity>,
    stats: GpuClockStats,
}

impl GpuClockTracker {
    /// A tracker for a device clock of `domain`.
    pub fn new(domain: ClockDomain, config: GpuCalibrationConfig) -> Self {
        GpuClockTracker {
            history: CalibrationHistory::new(domain, config.history),
            config,
            last_burst_ns: None,
            failed_bursts: 0,
            burst_requested: false,
            queues: Vec::new(),
            stats: GpuClockStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &GpuCalibrationConfig {
        &self.config
    }

    /// The calibration history.
    pub fn history(&self) -> &CalibrationHistory {
        &self.history
    }

    /// When the last burst was taken (reference ns), if any.
    pub fn last_burst_ns(&self) -> Option<u64> {
        self.last_burst_ns
    }

    /// Bursts the history rejected (no usable sample).
    pub fn failed_bursts(&self) -> u64 {
        self.failed_bursts
    }

    /// Counters of the placements.
    pub fn stats(&self) -> GpuClockStats {
        self.stats
    }

    /// Whether queue `queue` currently converts with a calibration of its own.
    pub fn queue_has_own_calibration(&self, queue: u16) -> bool {
        self.queues.get(queue as usize).is_some_and(|q| q.own().is_some())
    }

    /// Whether a burst should be taken at `now_ns` (reference ns): on schedule; sooner when a violation asked
    /// for one or the newest fit extrapolated to now is less certain than the bound (never sooner than the
    /// minimum gap).
    pub fn burst_due(&self, now_ns: u64) -> bool {
        let Some(last) = self.last_burst_ns else {
            return true;
        };
        let since = now_ns.saturating_sub(last);
        if since >= crate::clock::saturating_ns(self.config.burst_period) {
            return true;
        }
        if since < crate::clock::saturating_ns(self.config.min_burst_gap) {
            return false;
        }
        self.burst_requested
            || self.history.latest().is_some_and(|fit| {
                let ticks = fit.from_reference_ns(now_ns);
                fit.uncertainty_ns(ticks) > self.config.max_uncertainty_ns as f64
            })
    }

    /// Adds the burst taken at `now_ns`. An error says the history could not use it (counted in
    /// [`failed_bursts`](Self::failed_bursts)); the schedule moves on either way.
    pub fn add_burst(&mut self, now_ns: u64, samples: &[CalibrationSample]) -> Result<(), CalibrationError> {
        self.last_burst_ns = Some(now_ns);
        self.burst_requested = false;
        let result = self.history.add_burst(samples);
        if result.is_err() {
            self.failed_bursts += 1;
        }
        result
    }

    /// Counts a `read_timestamps` that returned an error: never ignored (see [`GpuClockStats::read_errors`]).
    pub fn count_read_error(&mut self) {
        self.stats.read_errors += 1;
    }

    /// Says that the device clock was reset (the backend knows: a device lost and recreated, a counter
    /// restarted): the next burst starts a new calibration segment, and comes at the minimum gap.
    pub fn report_reset(&mut self) {
        self.history.report_reset();
        self.burst_requested = true;
    }

    /// Whether a slice that ends at device tick `end_ticks`, read back at `finished_ns`, should be converted at
    /// `now_ns`. See [`GpuCalibrationConfig`]: a burst after its read-back must exist (and a segment that began
    /// at a break must have fitted its rate), then it waits up to the latency bound for a knot after it;
    /// without calibration it goes after the latency bound plus two burst periods.
    pub fn ready(&self, end_ticks: u64, finished_ns: u64, now_ns: u64) -> bool {
        self.history.latest().is_some() && self.ready_by(self.readiness(end_ticks, finished_ns), finished_ns, now_ns)
    }

    /// What [`ready`](Self::ready) asks of the history about a slice: it changes only when a burst comes, so a
    /// caller holding many slices asks once per burst, not once per pass (480,000 held slices re-asked every
    /// millisecond held the export 14 s behind).
    pub(crate) fn readiness(&self, end_ticks: u64, finished_ns: u64) -> Readiness {
        Readiness {
            burst_after: self.history.newest_burst_ns().is_some_and(|t| t > finished_ns),
            settled: self.history.is_settled(end_ticks),
            bracketed: self.history.is_bracketed(end_ticks),
        }
    }

    /// [`ready`](Self::ready) from a [`readiness`](Self::readiness) taken since the last burst.
    pub(crate) fn ready_by(&self, r: Readiness, finished_ns: u64, now_ns: u64) -> bool {
        let waited = now_ns.saturating_sub(finished_ns);
        let bound = crate::clock::saturating_ns(self.config.latency_bound);
        let period = crate::clock::saturating_ns(self.config.burst_period);
        waited >= bound.saturating_add(period.saturating_mul(2))
            || (r.burst_after && r.settled && (waited >= bound || r.bracketed))
    }

    /// Converts device ticks to reference ns with their uncertainty (monotonic for inputs in increasing order
    /// within a calibration segment), without what the CPU knows. `None` before the first fit.
    pub fn convert(&mut self, ticks: u64) -> Option<Converted> {
        self.history.convert(ticks)
    }

    /// Places one finished scope: both timestamps converted (choosing across a break by the scope's CPU
    /// window), checked against `[recorded, read back]` on its queue (a violation is counted, widens the
    /// queue's uncertainty in this segment and makes a burst due; a queue that keeps violating takes its own
    /// calibration), narrowed to that window, end never before begin. Convert scopes in begin-tick order so
    /// the monotonic guard holds. `None` before the first fit.
    pub fn place(&mut self, scope: GpuScopeTicks) -> Option<GpuSlicePlacement> {
        let window = (scope.recorded_ns, scope.read_ns.max(scope.recorded_ns));
        let begin = self.history.convert_within(scope.begin, Some(window))?;
        let end = self.history.convert_within(scope.end, Some(window))?;
        let bursts = self.history.stats().bursts;
        let index = scope.queue as usize;
        if self.queues.len() <= index {
            self.queues.resize_with(index + 1, QueueSanity::default);
        }
        let outcome = self.queues[index].check(
            SliceInput {
                begin,
                end,
                recorded_ns: window.0,
                read_ns: window.1,
            },
            bursts,
        );
        self.stats.slices += 1;
        if outcome.marks.any() {
            self.stats.marked_slices += 1;
        }
        if outcome.violation {
            self.stats.window_violations += 1;
            if !self.burst_requested {
                self.burst_requested = true;
                self.stats.requested_bursts += 1;
            }
        }
        if outcome.took_own_calibration {
            self.stats.own_calibrations += 1;
        }
        Some(GpuSlicePlacement {
            begin: outcome.begin,
            end: outcome.end,
            marks: outcome.marks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::sim::{SimClockConfig, SimClockPair};

    const MS: u64 = 1_000_000;

    #[test]
    fn bursts_follow_the_schedule_and_come_sooner_when_uncertain() {
        let mut pair = SimClockPair::new(SimClockConfig {
            drift_ppm: 100.0,
            jitter_ns: 200.0,
            ..Default::default()
        })
        .unwrap();
        let config = GpuCalibrationConfig {
            max_uncertainty_ns: 1_000_000,
            ..Default::default()
        };
        let mut tracker = GpuClockTracker::new(pair.domain(), config);
        assert!(tracker.burst_due(pair.now_ns()), "first burst at once");
        let burst = pair.sample_burst(16, 3_000);
        tracker.add_burst(pair.now_ns(), &burst).unwrap();
        let t0 = pair.now_ns();
        assert!(!tracker.burst_due(t0 + 10 * MS));
        assert!(!tracker.burst_due(t0 + 249 * MS));
        assert!(tracker.burst_due(t0 + 250 * MS));

        // A tight bound: the nominal-rate extrapolation grows past it within the period.
        let tight = GpuCalibrationConfig {
            max_uncertainty_ns: 50,
            ..Default::default()
        };
        let mut tracker = GpuClockTracker::new(pair.domain(), tight);
        let burst = pair.sample_burst(16, 3_000);
        tracker.add_burst(pair.now_ns(), &burst).unwrap();
        let t0 = pair.now_ns();
        assert!(!tracker.burst_due(t0 + 5 * MS), "never sooner than the minimum gap");
        assert!(tracker.burst_due(t0 + 30 * MS), "uncertainty past the bound");
    }

    #[test]
    fn slices_wait_for_a_burst_after_them_then_the_latency_bound_or_a_knot() {
        let mut pair = SimClockPair::new(SimClockConfig::default()).unwrap();
        let config = GpuCalibrationConfig {
            latency_bound: Duration::from_millis(250),
            ..Default::default()
        };
        let mut tracker = GpuClockTracker::new(pair.domain(), config);
        let event_ticks = pair.true_ticks_at(pair.now_ns());
        let finished = pair.now_ns();
        assert!(!tracker.ready(event_ticks, finished, finished), "no fit yet");
        let burst = pair.sample_burst(16, 3_000);
        tracker.add_burst(pair.now_ns(), &burst).unwrap();
        // The first burst came after the read-back, but the fit has no rate yet: it waits for the second.
        assert!(!tracker.ready(event_ticks, finished, pair.now_ns() + 10 * MS));
        pair.advance_by(250 * MS);
        let burst = pair.sample_burst(16, 3_000);
        tracker.add_burst(pair.now_ns(), &burst).unwrap();
        assert!(
            tracker.ready(event_ticks, finished, pair.now_ns()),
            "past the latency bound"
        );

        // A slice read back after the newest burst waits for the next one, however long.
        pair.advance_by(10 * MS);
        let late = pair.true_ticks_at(pair.now_ns());
        let read = pair.now_ns();
        assert!(!tracker.ready(late, read, read + 240 * MS));
        pair.advance_by(240 * MS);
        let burst = pair.sample_burst(16, 3_000);
        tracker.add_burst(pair.now_ns(), &burst).unwrap();
        assert!(
            tracker.ready(late, read, read + 250 * MS),
            "a burst after it and the bound passed"
        );
        assert!(
            !tracker.ready(late, read, read + 249 * MS),
            "a burst after it, not bracketed, bound not yet"
        );

        // With a long bound it waits for a knot after it (the centred fit).
        let patient = GpuCalibrationConfig {
            latency_bound: Duration::from_secs(10),
            ..config
        };
        let mut tracker = GpuClockTracker::new(pair.domain(), patient);
        for _ in 0..8 {
            let burst = pair.sample_burst(16, 3_000);
            tracker.add_burst(pair.now_ns(), &burst).unwrap();
            pair.advance_by(250 * MS);
        }
        let event = pair.true_ticks_at(pair.now_ns());
        let read = pair.now_ns();
        let mut bursts = 0;
        while !tracker.history().is_bracketed(event) {
            pair.advance_by(250 * MS);
            let burst = pair.sample_burst(16, 3_000);
            tracker.add_burst(pair.now_ns(), &burst).unwrap();
            bursts += 1;
            if !tracker.history().is_bracketed(event) {
                assert!(!tracker.ready(event, read, pair.now_ns()));
            }
        }
        assert!(tracker.ready(event, read, pair.now_ns()));
        assert!(bursts > 4, "a knot lags the newest burst: {bursts} bursts");

        // A device that stops calibrating: slices go after the bound plus two periods.
        let stale = pair.true_ticks_at(pair.now_ns());
        let read = pair.now_ns() + MS;
        assert!(!tracker.ready(stale, read, read + 5_000 * MS));
        assert!(tracker.ready(stale, read, read + 10_500 * MS));
        assert_eq!(
            GpuCalibrationConfig::default().latency_bound,
            Duration::from_millis(500)
        );
    }

    #[test]
    fn a_violation_asks_for_a_burst_and_a_reset_starts_a_segment() {
        let mut pair = SimClockPair::new(SimClockConfig {
            drift_ppm: 30.0,
            jitter_ns: 300.0,
            ..Default::default()
        })
        .unwrap();
        let mut tracker = GpuClockTracker::new(pair.domain(), GpuCalibrationConfig::default());
        for _ in 0..8 {
            let burst = pair.sample_burst(16, 3_000);
            tracker.add_burst(pair.now_ns(), &burst).unwrap();
            pair.advance_by(250 * MS);
        }
        let t = pair.now_ns() - 300 * MS;
        let ticks = pair.true_ticks_at(t);
        let good = tracker
            .place(GpuScopeTicks {
                queue: 1,
                begin: ticks,
                end: ticks + 1_000,
                recorded_ns: t - 20_000,
                read_ns: t + 500_000,
            })
            .unwrap();
        assert!(!good.marks.any() && good.begin.ns.abs_diff(t) <= good.begin.uncertainty_ns);
        assert!(!tracker.burst_due(pair.now_ns() - 240 * MS + 30 * MS));
        // The CPU says this scope was recorded 1 ms after the calibration places its begin.
        let bad = tracker
            .place(GpuScopeTicks {
                queue: 1,
                begin: ticks,
                end: ticks + 1_000,
                recorded_ns: t + 1_000_000,
                read_ns: t + 2_000_000,
            })
            .unwrap();
        assert!(bad.marks.outside_window && bad.begin.ns >= t + 1_000_000);
        assert_eq!(
            (tracker.stats().window_violations, tracker.stats().requested_bursts),
            (1, 1)
        );
        let last = tracker.last_burst_ns().unwrap();
        assert!(tracker.burst_due(last + 20 * MS), "asked for at the minimum gap");
        assert!(!tracker.queue_has_own_calibration(1));

        tracker.report_reset();
        assert!(tracker.burst_due(last + 20 * MS));
        let before = tracker.history().current_segment();
        let burst = pair.sample_burst(16, 3_000);
        tracker.add_burst(pair.now_ns(), &burst).unwrap();
        assert_ne!(tracker.history().current_segment(), before);
        assert_eq!(tracker.history().stats().resets, 1);
    }
}
