//! The truth of a [`SimClockPair`]: the piecewise-linear count, generated knot by knot as time is reached,
//! read forwards (ticks at a time) and backwards (the time at which the source showed a tick).

use super::config::{MAX_DRIFT_PPM, MIN_DRIFT_PPM};
use super::exact::{decompose, mul_pow2_div_floor};
use super::{Knot, SimClockPair, WANDER_STEP_NS};

const FRAC_MASK: u128 = u64::MAX as u128;

impl SimClockPair {
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

    fn clamp_time(&self, reference_ns: u64) -> u64 {
        reference_ns.max(self.knot_time(0))
    }

    /// The reference time of the `j`-th kept knot.
    pub(super) fn knot_time(&self, j: usize) -> u64 {
        // Kept knots always have representable times.
        self.config.start_ns + (self.first_knot + j as u64) * WANDER_STEP_NS
    }

    /// The index (into `knots`) of the segment containing `t` (`t` at or after the oldest kept knot).
    pub(super) fn segment_of(&self, t: u64) -> usize {
        if self.knots.len() == 1 {
            return 0;
        }
        let global = (t - self.config.start_ns) / WANDER_STEP_NS;
        (global.saturating_sub(self.first_knot) as usize).min(self.knots.len() - 1)
    }

    /// The extended count at `reference_ns` (clamped), Q64.64 modulo 2^128.
    pub(super) fn count_q64_at(&mut self, reference_ns: u64) -> u128 {
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
    pub(super) fn extend_to(&mut self, t: u64) {
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
    pub(super) fn apply_retention(&mut self) {
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

    pub(super) fn effective_drift(&self, walk_ppm: f64) -> f64 {
        let drift = self.config.drift_ppm + walk_ppm;
        if drift.is_nan() {
            self.config.drift_ppm
        } else {
            drift.clamp(MIN_DRIFT_PPM, MAX_DRIFT_PPM)
        }
    }

    /// `floor((1 + drift * 1e-6) / ns_per_tick * 2^64)`, exactly for the f64 factor, and at least 1.
    pub(super) fn rate_q64(&self, drift_ppm: f64) -> u128 {
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
