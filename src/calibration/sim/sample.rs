//! Bracketed reads of the simulated source: [`SimSample`] and the sampling methods of [`SimClockPair`].

use super::SimClockPair;
use crate::calibration::CalibrationSample;

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

impl SimClockPair {
    /// One bracketed read at the current reference time (see the [module docs](super) for the distribution).
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
}
