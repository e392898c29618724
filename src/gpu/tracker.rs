//! The live calibration of one GPU device clock, as the collector runs it: when to take a burst, how long to
//! hold a slice for a later calibration point, and the conversion. Pure logic: time is passed in, so the same
//! code runs on the collector's real clock and on simulated time in tests.

use std::time::Duration;

use crate::calibration::HistoryConfig;
use crate::calibration::{CalibrationError, CalibrationHistory, CalibrationSample, ClockDomain, Converted};

/// How the collector calibrates each GPU clock. The defaults are the plan `examples/calibration_accuracy.rs`
/// measures (p99 placement error 66 ns with 200 ppm drift, 1 µs jitter and 5 % outliers).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuCalibrationConfig {
    /// Samples per burst (each a bracketed read of the device clock against `CLOCK_MONOTONIC`).
    pub burst_samples: usize,
    /// Time between bursts.
    pub burst_period: Duration,
    /// Most time one burst may take; a burst stops early rather than wait for a tight sample (Tracy's loop
    /// could spin forever waiting for a low deviation, tracy#872).
    pub burst_budget: Duration,
    /// A burst is taken sooner when the newest fit, extrapolated to now, is less certain than this.
    pub max_uncertainty_ns: u64,
    /// Shortest time between two bursts, whatever the uncertainty.
    pub min_burst_gap: Duration,
    /// A finished GPU slice waits at most this long for a calibration point after it (a two-sided,
    /// interpolated conversion); then it is converted with the newest fit.
    pub latency_bound: Duration,
    /// A scope whose timestamps have not been written after this long (its commands were never submitted) is
    /// counted as lost; its timestamp pair is retired, not reused.
    pub lost_after: Duration,
    /// The fit and window of each device's calibration history.
    pub history: HistoryConfig,
}

impl Default for GpuCalibrationConfig {
    fn default() -> Self {
        GpuCalibrationConfig {
            burst_samples: 16,
            burst_period: Duration::from_millis(250),
            burst_budget: Duration::from_millis(2),
            max_uncertainty_ns: 1_000,
            min_burst_gap: Duration::from_millis(20),
            latency_bound: Duration::from_secs(5),
            lost_after: Duration::from_secs(10),
            history: HistoryConfig::default(),
        }
    }
}

/// One device clock's live calibration: burst schedule, history, hold-or-convert decisions.
#[derive(Clone, Debug)]
pub struct GpuClockTracker {
    config: GpuCalibrationConfig,
    history: CalibrationHistory,
    last_burst_ns: Option<u64>,
    failed_bursts: u64,
}

impl GpuClockTracker {
    /// A tracker for a device clock of `domain`.
    pub fn new(domain: ClockDomain, config: GpuCalibrationConfig) -> Self {
        GpuClockTracker {
            history: CalibrationHistory::new(domain, config.history),
            config,
            last_burst_ns: None,
            failed_bursts: 0,
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

    /// Whether a burst should be taken at `now_ns` (reference ns): on schedule, or sooner when the newest fit
    /// extrapolated to now is less certain than the bound.
    pub fn burst_due(&self, now_ns: u64) -> bool {
        let Some(last) = self.last_burst_ns else {
            return true;
        };
        let since = now_ns.saturating_sub(last);
        if since >= self.config.burst_period.as_nanos() as u64 {
            return true;
        }
        if since < self.config.min_burst_gap.as_nanos() as u64 {
            return false;
        }
        self.history.latest().is_some_and(|fit| {
            let ticks = fit.from_reference_ns(now_ns);
            fit.uncertainty_ns(ticks) > self.config.max_uncertainty_ns as f64
        })
    }

    /// Adds the burst taken at `now_ns`. An error says the history could not use it (counted in
    /// [`failed_bursts`](Self::failed_bursts)); the schedule moves on either way.
    pub fn add_burst(&mut self, now_ns: u64, samples: &[CalibrationSample]) -> Result<(), CalibrationError> {
        self.last_burst_ns = Some(now_ns);
        let result = self.history.add_burst(samples);
        if result.is_err() {
            self.failed_bursts += 1;
        }
        result
    }

    /// Whether a slice that ends at device tick `end_ticks`, finished at `finished_ns`, should be converted at
    /// `now_ns`: a calibration point after it exists, or it has waited the latency bound.
    pub fn ready(&self, end_ticks: u64, finished_ns: u64, now_ns: u64) -> bool {
        self.history.latest().is_some()
            && (self.history.is_bracketed(end_ticks)
                || now_ns.saturating_sub(finished_ns) >= self.config.latency_bound.as_nanos() as u64)
    }

    /// Converts device ticks to reference ns with their uncertainty (monotonic for inputs in increasing order).
    /// `None` before the first fit.
    pub fn convert(&mut self, ticks: u64) -> Option<Converted> {
        self.history.convert(ticks)
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
    fn slices_wait_for_a_later_point_or_the_latency_bound() {
        let mut pair = SimClockPair::new(SimClockConfig::default()).unwrap();
        let mut tracker = GpuClockTracker::new(pair.domain(), GpuCalibrationConfig::default());
        let event_ticks = pair.true_ticks_at(pair.now_ns());
        let finished = pair.now_ns();
        assert!(!tracker.ready(event_ticks, finished, finished), "no fit yet");
        for _ in 0..40 {
            let burst = pair.sample_burst(16, 3_000);
            tracker.add_burst(pair.now_ns(), &burst).unwrap();
            if tracker.history().is_bracketed(event_ticks) {
                break;
            }
            assert!(!tracker.ready(event_ticks, pair.now_ns(), pair.now_ns()));
            pair.advance_by(250 * MS);
        }
        assert!(tracker.ready(event_ticks, pair.now_ns(), pair.now_ns()), "bracketed");
        let late = pair.true_ticks_at(pair.now_ns());
        assert!(!tracker.ready(late, pair.now_ns(), pair.now_ns()));
        assert!(
            tracker.ready(late, pair.now_ns(), pair.now_ns() + 5_000 * MS),
            "latency bound"
        );
    }
}
