//! Both-sided sanity of converted GPU timestamps, per queue: pure logic, no clock read.
//!
//! The CPU knows two things about every GPU scope that no calibration can contradict: the GPU cannot have
//! begun it before the CPU recorded it, and cannot have ended it after the collector read its timestamps back.
//! Real drivers break the calibration model in ways a fit of the device clock cannot see: AMD's calibrated
//! timestamps and query timestamps on different epochs (kvark/blade#388), queues of one Intel device without a
//! common time domain (KhronosGroup/Vulkan-Docs#1517), counters that restart (gpuweb#4069). So each queue's
//! conversions are checked against their `[recorded, read back]` window:
//!
//! - a conversion outside its window (beyond its stated uncertainty) is a **violation**: counted, placed
//!   inside the window with the window as its uncertainty, marked, and the queue's later conversions in the
//!   same calibration segment state at least as much uncertainty as the violation showed; the tracker takes a
//!   calibration burst at once;
//! - a queue whose timestamps keep violating after fresh calibration bursts gets a **calibration of its own**:
//!   the offset from the device calibration that every recent window allows (where most of them agree,
//!   Marzullo's intersection), with that agreement's width as its uncertainty, and says so
//!   ([`SliceMarks::queue_calibration`]). It goes back to the device calibration once that agrees again.
//!
//! Every placed timestamp is finally narrowed to its window: the point moves to the nearest place inside
//! both its uncertainty range and the window, and the uncertainty covers what is left of both, so the truth
//! stays inside the stated range whenever it was inside either.

use std::collections::VecDeque;

use crate::calibration::{Converted, Placement};

/// Slices remembered per queue for the violation rate and the queue's own offset.
const RECENT: usize = 32;
/// The violation rate is judged over this many recent slices...
const JUDGED: usize = 16;
/// ... and a queue takes its own calibration when at least this many of them violated.
const PERSISTENT: usize = 8;
/// Bursts that must have been added since a queue's violations began before they count as persistent: the
/// one taken at once on the first violation, and one more.
const BURSTS_BEFORE_OWN: u64 = 2;

/// How a placed GPU slice is marked for the viewer. The exporter shows a marked slice with the
/// [`CALIBRATION_BREAK`] annotation (and friends), so nothing bent is shown as if it were not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SliceMarks {
    /// The slice straddles a clock break (its begin and end were converted by different calibration segments),
    /// or a timestamp lies between the last calibration point before a break and the first after it: it was
    /// placed by the hull of both sides, narrowed to the CPU's window.
    pub calibration_break: bool,
    /// A timestamp's conversion lay outside what the CPU knows (begun before it was recorded, or ended after
    /// it was read back): it was placed inside that window, with the window as its uncertainty.
    pub outside_window: bool,
    /// The slice was converted with its queue's own calibration, because the queue's timestamps persistently
    /// disagree with the device calibration.
    pub queue_calibration: bool,
}

impl SliceMarks {
    /// Whether a break or a window violation marks the slice (the queue's own calibration alone does not: it is
    /// a property of the queue, said by [`QUEUE_CALIBRATION`]).
    pub fn any(&self) -> bool {
        self.calibration_break || self.outside_window
    }

    /// The value of the [`CALIBRATION_BREAK`] annotation for a marked slice, `None` for an unmarked one.
    ///
    /// ```
    /// use tickline::gpu::SliceMarks;
    /// let marks = SliceMarks { calibration_break: true, ..SliceMarks::default() };
    /// assert_eq!(marks.annotation(), Some("break"));
    /// assert_eq!(SliceMarks::default().annotation(), None);
    /// ```
    pub fn annotation(&self) -> Option<&'static str> {
        match (self.calibration_break, self.outside_window) {
            (true, true) => Some("break, outside window"),
            (true, false) => Some("break"),
            (false, true) => Some("outside window"),
            (false, false) => None,
        }
    }
}

/// The annotation a marked slice carries in an exported trace; its value ([`SliceMarks::annotation`]) says what
/// marked it: `"break"` (placed across or next to a clock break, by the hull of both sides) or
/// `"outside window"` (the calibration disagreed with what the CPU knows; placed inside `[recorded, read
/// back]`, that window as its uncertainty).
pub const CALIBRATION_BREAK: &str = "tickline.calibration_break";

/// The annotation (`true`) of a slice converted with its queue's own calibration.
pub const QUEUE_CALIBRATION: &str = "tickline.queue_calibration";

/// The annotation of the instant that stands for a lost GPU scope (counted in
/// [`TimelineStats::gpu_lost_scopes`](crate::TimelineStats)): on its queue's track, at the time its CPU recorded
/// it (the GPU cannot have started it earlier; when it ran is unknown), with the scope's name and fields and
/// the end of the flow from that CPU point. The value says why: `"never read back"` (its ticks did not come
/// within `lost_after`: commands never submitted, or reads that kept failing), `"timeline ended"` (still on
/// the GPU at shutdown), `"device never calibrated"` or `"not placeable"`.
pub const GPU_SCOPE_LOST: &str = "tickline.gpu_scope_lost";

/// One slice as the sanity check sees it: its two placements (with their segments) and its CPU window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SliceInput {
    pub(crate) begin: Placement,
    pub(crate) end: Placement,
    /// When the CPU recorded the scope, reference ns.
    pub(crate) recorded_ns: u64,
    /// When the collector read both timestamps back, reference ns (at least `recorded_ns`).
    pub(crate) read_ns: u64,
}

/// What the sanity check made of a slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SliceOutcome {
    pub(crate) begin: Converted,
    pub(crate) end: Converted,
    pub(crate) marks: SliceMarks,
    /// The device calibration put a timestamp outside the window: counted, and a burst is due.
    pub(crate) violation: bool,
    /// The queue took its own calibration with this slice.
    pub(crate) took_own_calibration: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Recent {
    violated: bool,
    /// The offsets (ns) that would move the device conversion of this slice inside its window: `[recorded -
    /// begin, read - end]`; empty when `lo > hi`.
    lo: i128,
    hi: i128,
}

/// A queue's own offset from the device calibration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OwnCalibration {
    /// Added to the device conversion, ns.
    pub(crate) offset_ns: i64,
    /// Half the width of the offsets the recent windows agree on, ns.
    pub(crate) uncertainty_ns: u64,
}

/// The sanity state of one queue.
#[derive(Clone, Debug, Default)]
pub(crate) struct QueueSanity {
    /// The device segment the widening below belongs to.
    segment: Option<u64>,
    /// Extra uncertainty for this queue's conversions in `segment`, learned from violations, ns.
    extra_ns: u64,
    recent: VecDeque<Recent>,
    /// Bursts added when the current run of violations began.
    violations_since_bursts: Option<u64>,
    own: Option<OwnCalibration>,
    violations: u64,
}

/// Where most of `intervals` overlap (Marzullo): `(lo, hi, how many)`, `None` for no interval.
fn majority_overlap(intervals: impl Iterator<Item = (i128, i128)>) -> Option<(i128, i128, usize)> {
    let mut edges: Vec<(i128, i32)> = Vec::new();
    for (lo, hi) in intervals {
        edges.push((lo, 1));
        edges.push((hi, -1));
    }
    edges.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    let (mut count, mut best, mut range) = (0i32, 0i32, None);
    for (i, &(value, step)) in edges.iter().enumerate() {
        count += step;
        if step > 0 && count > best {
            best = count;
            range = Some((value, edges.get(i + 1).map_or(value, |e| e.0)));
        }
    }
    range.map(|(lo, hi)| (lo, hi, best as usize))
}

/// `c` moved to the nearest point of `[lo, hi]`, with the whole window as its uncertainty.
fn outside(c: Converted, lo: u64, hi: u64) -> (Converted, bool) {
    let ns = c.ns.clamp(lo, hi);
    (
        Converted {
            ns,
            uncertainty_ns: (ns - lo).max(hi - ns),
        },
        true,
    )
}

/// `c` moved to the nearest point inside both its range and `[lo, hi]`, with an uncertainty that covers what
/// is left of both; when they do not meet, the window itself (`true`: outside).
fn narrow(c: Converted, lo: u64, hi: u64) -> (Converted, bool) {
    let (a, z) = c.range();
    if z < lo || a > hi {
        return outside(c, lo, hi);
    }
    let (a, z) = (a.max(lo), z.min(hi));
    let ns = c.ns.clamp(a, z);
    (
        Converted {
            ns,
            uncertainty_ns: (ns - a).max(z - ns),
        },
        false,
    )
}

fn shift(c: Converted, own: OwnCalibration) -> Converted {
    Converted {
        ns: (c.ns as i128 + own.offset_ns as i128).clamp(0, u64::MAX as i128) as u64,
        uncertainty_ns: c.uncertainty_ns.saturating_add(own.uncertainty_ns),
    }
}

fn widen(c: Converted, by_ns: u64) -> Converted {
    Converted {
        ns: c.ns,
        uncertainty_ns: c.uncertainty_ns.saturating_add(by_ns),
    }
}

impl QueueSanity {
    /// The queue's own calibration, when it has one.
    pub(crate) fn own(&self) -> Option<OwnCalibration> {
        self.own
    }

    /// Violations counted on this queue.
    #[cfg(test)]
    pub(crate) fn violations(&self) -> u64 {
        self.violations
    }

    /// Checks and places one slice. `bursts` is how many calibration bursts the device has had so far.
    pub(crate) fn check(&mut self, input: SliceInput, bursts: u64) -> SliceOutcome {
        let SliceInput {
            begin,
            end,
            recorded_ns,
            read_ns,
        } = input;
        let read_ns = read_ns.max(recorded_ns);
        let (b, e) = (begin.converted, end.converted);
        if self.segment != Some(end.segment) {
            // A new calibration segment: what was learned about the old one does not carry over.
            self.segment = Some(end.segment);
            self.extra_ns = 0;
        }

        // How far outside its window a conversion lies, beyond its stated uncertainty.
        let excess = |b: Converted, e: Converted| {
            let early = recorded_ns.saturating_sub(b.ns.saturating_add(b.uncertainty_ns));
            let late = e.ns.saturating_sub(e.uncertainty_ns).saturating_sub(read_ns);
            early.max(late)
        };
        // The device calibration's verdict feeds the queue's statistics; an ambiguous placement (next to a
        // break) is not the queue's fault.
        let device_excess = excess(b, e);
        let device_violated = device_excess > 0 && !begin.ambiguous && !end.ambiguous;
        self.recent.push_back(Recent {
            violated: device_violated,
            lo: recorded_ns as i128 - b.ns as i128,
            hi: read_ns as i128 - e.ns as i128,
        });
        while self.recent.len() > RECENT {
            self.recent.pop_front();
        }
        if device_violated {
            self.violations_since_bursts.get_or_insert(bursts);
        }
        let recent_violations = self.recent.iter().rev().take(JUDGED).filter(|r| r.violated).count();
        if recent_violations == 0 {
            self.violations_since_bursts = None;
        }

        // The queue's own offset: where most recent windows agree.
        let agreed = majority_overlap(self.recent.iter().filter(|r| r.lo <= r.hi).map(|r| (r.lo, r.hi)))
            .filter(|&(_, _, n)| 2 * n > self.recent.len());
        let own_from = |(lo, hi, _): (i128, i128, usize)| OwnCalibration {
            offset_ns: ((lo + hi) / 2).clamp(i64::MIN as i128, i64::MAX as i128) as i64,
            uncertainty_ns: ((hi - lo) as u128).div_ceil(2).min(u64::MAX as u128) as u64,
        };
        let mut took_own_calibration = false;
        match (self.own, agreed) {
            (None, Some(agreed)) => {
                let persistent = recent_violations >= PERSISTENT
                    && self
                        .violations_since_bursts
                        .is_some_and(|since| bursts >= since + BURSTS_BEFORE_OWN);
                if persistent {
                    self.own = Some(own_from(agreed));
                    took_own_calibration = true;
                }
            }
            // The device calibration agrees again (no offset needed, nothing violated lately).
            (Some(_), Some((lo, hi, _))) if lo <= 0 && 0 <= hi && recent_violations == 0 => self.own = None,
            (Some(_), Some(agreed)) => self.own = Some(own_from(agreed)),
            _ => {}
        }

        let (b, e) = match self.own {
            Some(own) => (shift(b, own), shift(e, own)),
            None => (b, e),
        };
        let violated = excess(b, e) > 0 && !begin.ambiguous && !end.ambiguous;
        let ((b, b_outside), (mut e, e_outside)) = if violated {
            // The calibration is wrong here: what is left is the window. Later slices of this queue in this
            // segment state at least the miss this one showed.
            self.violations += 1;
            self.extra_ns = self.extra_ns.max(excess(b, e));
            (outside(b, recorded_ns, read_ns), outside(e, recorded_ns, read_ns))
        } else {
            let extra = if self.own.is_some() { 0 } else { self.extra_ns };
            (
                narrow(widen(b, extra), recorded_ns, read_ns),
                narrow(widen(e, extra), recorded_ns, read_ns),
            )
        };
        if e.ns < b.ns {
            // Never an end before its begin: the end moves up, its range still covering where it was.
            let by = b.ns - e.ns;
            e = Converted {
                ns: b.ns,
                uncertainty_ns: e.uncertainty_ns.saturating_add(by),
            };
        }
        SliceOutcome {
            begin: b,
            end: e,
            marks: SliceMarks {
                calibration_break: begin.ambiguous || end.ambiguous || begin.segment != end.segment,
                outside_window: b_outside
                    || e_outside
                    || (self.own.is_none() && (begin.outside_window || end.outside_window)),
                queue_calibration: self.own.is_some(),
            },
            violation: violated,
            took_own_calibration,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed(ns: u64, uncertainty_ns: u64) -> Placement {
        Placement {
            converted: Converted { ns, uncertainty_ns },
            ..Placement::default()
        }
    }

    fn slice(begin: Placement, end: Placement, recorded_ns: u64, read_ns: u64) -> SliceInput {
        SliceInput {
            begin,
            end,
            recorded_ns,
            read_ns,
        }
    }

    #[test]
    fn a_slice_inside_its_window_passes_and_is_narrowed_to_it() {
        let mut q = QueueSanity::default();
        let out = q.check(slice(placed(1_000, 50), placed(2_000, 50), 980, 2_500), 1);
        assert!(!out.violation && !out.marks.any() && !out.marks.queue_calibration);
        assert_eq!(
            out.end,
            Converted {
                ns: 2_000,
                uncertainty_ns: 50
            }
        );
        // The begin's range reaches before the record: the part before it is cut off.
        assert_eq!(
            out.begin,
            Converted {
                ns: 1_000,
                uncertainty_ns: 50
            }
        );
        let out = q.check(slice(placed(1_000, 50), placed(2_000, 50), 1_020, 2_500), 1);
        assert!(!out.violation);
        assert_eq!(
            out.begin,
            Converted {
                ns: 1_020,
                uncertainty_ns: 30
            },
            "moved inside, still covering"
        );
    }

    #[test]
    fn both_sides_are_checked_and_a_violation_widens_the_segment() {
        let mut q = QueueSanity::default();
        // The end lies after the read-back by 400 ns beyond its uncertainty.
        let out = q.check(slice(placed(1_000, 50), placed(3_000, 100), 900, 2_500), 1);
        assert!(out.violation && out.marks.outside_window);
        assert_eq!(
            out.end,
            Converted {
                ns: 2_500,
                uncertainty_ns: 1_600
            },
            "the window, from its edge"
        );
        assert!(out.begin.ns >= 900 && out.begin.ns <= out.end.ns);
        // The next slice in the same segment carries the 400 ns the violation showed.
        let out = q.check(slice(placed(5_000, 50), placed(6_000, 50), 4_000, 9_000), 1);
        assert!(!out.violation);
        assert_eq!(out.begin.uncertainty_ns, 450);
        // A new segment starts clean.
        let next = Placement {
            segment: 1,
            ..placed(7_000, 50)
        };
        let out = q.check(slice(next, next, 6_000, 9_000), 2);
        assert_eq!(out.begin.uncertainty_ns, 50);
        assert_eq!(q.violations(), 1);
        // Begin before the record: the other side.
        let out = q.check(slice(placed(8_000, 50), placed(9_000, 50), 8_500, 9_500), 2);
        assert!(out.violation && out.begin.ns >= 8_500);
    }

    #[test]
    fn ends_never_precede_begins() {
        let mut q = QueueSanity::default();
        let out = q.check(slice(placed(2_000, 10), placed(1_990, 10), 1_000, 3_000), 1);
        assert!(out.end.ns >= out.begin.ns);
        assert!(out.end.uncertainty_ns >= 20, "{out:?}");
    }

    #[test]
    fn a_queue_on_another_epoch_gets_its_own_calibration_and_returns() {
        const EPOCH: u64 = 11_850_000_000;
        let mut q = QueueSanity::default();
        let mut bursts = 10;
        let mut own_at = None;
        for i in 0..40u64 {
            let recorded = 100_000_000 + i * 10_000_000;
            // Truth: begins 100-300 µs after the record, lasts 200 µs, read back 50-1050 µs after its end.
            let begin = recorded + 100_000 + (i * 37_000) % 200_000;
            let end = begin + 200_000;
            let read = end + 50_000 + (i * 91_000) % 1_000_000;
            // The device calibration maps this queue's ticks 11.85 s late.
            let out = q.check(
                slice(placed(begin + EPOCH, 100), placed(end + EPOCH, 100), recorded, read),
                bursts,
            );
            if i % 3 == 0 {
                bursts += 1;
            }
            assert!(out.begin.ns >= recorded && out.end.ns <= read && out.begin.ns <= out.end.ns);
            assert!(
                out.begin.ns.abs_diff(begin) <= out.begin.uncertainty_ns,
                "{i}: {out:?} vs {begin}"
            );
            assert!(
                out.end.ns.abs_diff(end) <= out.end.uncertainty_ns,
                "{i}: {out:?} vs {end}"
            );
            if out.took_own_calibration {
                own_at = Some(i);
            }
            if own_at.is_some() {
                assert!(out.marks.queue_calibration && !out.marks.outside_window, "{i}: {out:?}");
            } else {
                assert!(out.violation && out.marks.outside_window);
            }
        }
        let own_at = own_at.expect("own calibration");
        assert!(own_at < 16, "took its own calibration after {own_at} slices");
        let own = q.own().unwrap();
        assert!(own.offset_ns.unsigned_abs().abs_diff(EPOCH) <= own.uncertainty_ns);
        assert!(own.uncertainty_ns < 200_000, "{own:?}");
        // The device calibration becomes right for this queue (the driver fixed its epoch): back to it.
        for i in 40..80u64 {
            let recorded = 100_000_000 + i * 10_000_000;
            let begin = recorded + 150_000;
            let end = begin + 200_000;
            let read = end + 300_000 + (i * 91_000) % 1_000_000;
            let _ = q.check(slice(placed(begin, 100), placed(end, 100), recorded, read), bursts);
        }
        assert_eq!(q.own(), None);
    }

    #[test]
    fn transient_violations_do_not_take_the_queue_off_the_device_calibration() {
        let mut q = QueueSanity::default();
        for i in 0..20u64 {
            let recorded = 1_000_000_000 + i * 1_000_000;
            // Ten violations in a row, but no burst came between them.
            let out = q.check(
                slice(
                    placed(recorded - 5_000, 10),
                    placed(recorded + 100, 10),
                    recorded,
                    recorded + 500_000,
                ),
                3,
            );
            assert!(!out.marks.queue_calibration, "{i}");
        }
    }

    #[test]
    fn majority_overlap_finds_where_most_agree() {
        let intervals = [(0, 10), (5, 15), (8, 20), (100, 110)];
        assert_eq!(majority_overlap(intervals.into_iter()), Some((8, 10, 3)));
        assert_eq!(majority_overlap(std::iter::empty()), None);
    }
}
