//! Converting a tick: which segments may hold it, interpolation between knots, extrapolation beyond them, the
//! floors the burst points set, and the monotonic guard.

use super::segment::{Knot, Segment};
use super::wander::WINDOW_BOW;
use super::{CalibrationHistory, Placement};
use crate::calibration::model::wander_sigma_ns;
use crate::calibration::{ClockCalibration, Converted};

impl CalibrationHistory {
    /// True when the conversion of `ticks` is final: it has a calibration point after it (a knot of its
    /// segment, or a break that closed its segment).
    pub fn is_bracketed(&self, ticks: u64) -> bool {
        let Some(ext) = self.extend(ticks) else {
            return false;
        };
        let Some((index, _)) = self.claimants(ext).into_iter().flatten().next() else {
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
        let candidates = self.claimants(ext);
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
                let without = self.scaled(pre, ext);
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

    /// How far one burst point says the segment's map may be off at its tick: the map's miss of the point plus
    /// the half-width of the region where the burst's brackets agree (the point is that region's middle, its
    /// variance the region's as a uniform one: half-width² / 3), in which the truth lies if most brackets hold
    /// it. A miss within the point's noise is no news, but the truth can still lie at the region's far edge:
    /// brackets that all lean one way (a read made late in each) put every point, and every fit through them,
    /// off to the same side, which neither the fit's residuals nor the misses show.
    fn point_floor(&self, segment: &Segment, (x, y, variance): (u64, u64, f64)) -> Option<f64> {
        let at = self.map_segment(segment, x)?;
        let miss = (y as i128 - at.ns as i128).unsigned_abs() as f64;
        Some(miss + (3.0 * variance).sqrt())
    }

    /// Recomputes the open segment's cached point floors (after its map changed).
    pub(super) fn refresh_floors(&mut self) {
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
    pub(super) fn map_segment(&self, segment: &Segment, ext: u64) -> Option<Converted> {
        let latest = segment.latest.as_ref()?;
        let newest = match segment.knots.back() {
            Some(&k) if ext < k.ticks => k,
            _ => return Some(self.scaled(latest, ext)),
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
        let ns_per_tick = match segment
            .knots
            .iter()
            .find(|k| k.ns >= oldest.ns.saturating_add(1_000_000_000))
        {
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
    /// first burst of the segment after it (the burst that found the break, when the one before it was moved
    /// across: see `Segment::sure_from`).
    fn range_of(&self, index: usize) -> (u64, u64) {
        let from = match index.checked_sub(1) {
            Some(before) => self.segments[before].last_burst.1,
            None => 0,
        };
        let to = self.segments.get(index + 1).map_or(u64::MAX, |after| after.sure_from.1);
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

    /// How far past its newest burst the open segment claims a tick when another segment claims it too: twice
    /// the longest the history has gone without a burst, and a second. A tick converted now that lies further
    /// ahead would have waited longer for its conversion than calibration ever waited for a burst.
    fn forward_reach_ns(&self) -> u64 {
        self.longest_burst_gap_ns
            .saturating_mul(2)
            .saturating_add(1_000_000_000)
    }

    /// [`candidates`](Self::candidates), less the open segment's answer when another segment claims `ext` too
    /// and that answer lies further past the open segment's newest burst than [`forward_reach_ns`]
    /// (Self::forward_reach_ns). After a reset to a lower count, the new count reaches every old tick's value
    /// by extrapolating forward, minutes or hours past its newest burst: without this, every tick of the old
    /// segment would be ambiguous between its own time and that future one.
    fn claimants(&self, ext: u64) -> [Option<(usize, Converted)>; 4] {
        let mut found = self.candidates(ext);
        if found.iter().flatten().count() < 2 {
            return found;
        }
        let open = self.segments.len() - 1;
        let reach_end = self.segments[open].last_burst.1.saturating_add(self.forward_reach_ns());
        let too_far = |&(index, c): &(usize, Converted)| index == open && c.ns > reach_end;
        if found.iter().flatten().all(too_far) {
            return found;
        }
        for slot in &mut found {
            if slot.as_ref().is_some_and(too_far) {
                *slot = None;
            }
        }
        found
    }

    /// Converts `ticks` to reference ns with its uncertainty, choosing among segments by what `window`
    /// (reference ns, `(earliest, latest)`) says of the true time, without the monotonic guard. `None` until
    /// the first successful fit.
    ///
    /// Limits:
    /// - A counter of fewer than 64 bits is unwrapped to the count nearest the newest sample's: a tick read
    ///   more than half the counter's range (2^(valid_bits − 1) ticks: 34 s for a 36-bit counter of 1 ns ticks)
    ///   before or after the newest burst is taken a whole wrap away, with no sign of it. Convert ticks within
    ///   that distance of the calibration.
    /// - After a reset to a lower count, one tick value names two moments. A tick of the new count may also be
    ///   one the old segment would have shown long before the history began (extrapolated back); a tick of the
    ///   old count is one the new count reaches later. The old segment keeps its ticks unless the new count
    ///   reaches their value within twice the longest gap between bursts so far, plus a second, past its
    ///   newest burst (no tick converted now can lie further ahead than calibration ever waited); otherwise
    ///   both segments claim the tick and, with no window, the answer is their hull, [`Placement::ambiguous`].
    ///   A window (a GPU timestamp's `[recorded, read back]`) tells them apart.
    pub fn place(&self, ticks: u64, window: Option<(u64, u64)>) -> Option<Placement> {
        let ext = self.extend(ticks)?;
        let candidates = self.claimants(ext);
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
    /// (and counted in [`HistoryStats::monotonic_clamps`](super::HistoryStats::monotonic_clamps)). Across a
    /// break, see [`place`](Self::place).
    pub fn convert(&mut self, ticks: u64) -> Option<Converted> {
        self.convert_within(ticks, None).map(|p| p.converted)
    }
}
