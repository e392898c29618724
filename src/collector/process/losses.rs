//! Where records went missing, on any thread: an async task's polls run on any thread, so its lifetime is
//! marked with the records dropped anywhere while it lived (see `tasks.rs`).

use std::collections::BTreeMap;

/// Windows kept before the oldest are forgotten (or, when every one may still matter, neighbours merged).
pub(super) const LOSS_WINDOWS_MAX: usize = 4096;

/// Records dropped, by the window of time they were dropped in: disjoint windows, so a lookup walks back only
/// over the windows that overlap it.
#[derive(Default)]
pub(super) struct LossLog {
    /// `start -> (end, dropped)`, both ends inclusive (reference ns); no two windows overlap.
    windows: BTreeMap<u64, (u64, u64)>,
}

impl LossLog {
    pub(super) fn len(&self) -> usize {
        self.windows.len()
    }

    /// The latest moment a record may have been dropped (0: none was): the newest window's end, since the
    /// windows are disjoint and the newest is never forgotten.
    pub(super) fn latest_ns(&self) -> u64 {
        self.windows.last_key_value().map_or(0, |(_, &(end, _))| end)
    }

    /// Notes `dropped` records lost at some moment within `from..=to`. Windows it overlaps merge with it.
    pub(super) fn note(&mut self, from: u64, to: u64, dropped: u64) {
        let (mut from, mut to, mut dropped) = (from.min(to), from.max(to), dropped);
        let overlapping: Vec<u64> = self.overlapping(from, to).map(|(start, _)| start).collect();
        for start in overlapping {
            if let Some((end, more)) = self.windows.remove(&start) {
                from = from.min(start);
                to = to.max(end);
                dropped = dropped.saturating_add(more);
            }
        }
        self.windows.insert(from, (to, dropped));
    }

    /// Records dropped in the windows that overlap `from..=to`: all that may have been lost within it (a
    /// window that reaches outside counts whole).
    pub(super) fn dropped_within(&self, from: u64, to: u64) -> u64 {
        self.overlapping(from, to)
            .fold(0u64, |sum, (_, dropped)| sum.saturating_add(dropped))
    }

    /// `(start, dropped)` of each window overlapping `from..=to`, latest first. Windows are disjoint, so their
    /// ends rise with their starts: walking back from the last start at or before `to`, the first window
    /// ending before `from` ends the walk.
    fn overlapping(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.windows
            .range(..=to)
            .rev()
            .take_while(move |(_, &(end, _))| end >= from)
            .map(|(&start, &(_, dropped))| (start, dropped))
    }

    /// Forgets the windows that end before `ns` (no lifetime still to be written reaches back that far), but
    /// the newest, which [`latest_ns`](Self::latest_ns) reads.
    pub(super) fn forget_before(&mut self, ns: u64) {
        while self.windows.len() > 1 {
            match self.windows.first_key_value() {
                Some((_, &(end, _))) if end < ns => {
                    self.windows.pop_first();
                }
                _ => break,
            }
        }
    }

    /// Halves the windows: each two neighbours become one window spanning both. A lifetime that overlapped
    /// either still overlaps it, so a loss is never missed; one that fell between them is now counted as
    /// possibly affected.
    pub(super) fn coarsen(&mut self) {
        let mut old = std::mem::take(&mut self.windows).into_iter();
        while let Some((start, (end, dropped))) = old.next() {
            let (end, dropped) = match old.next() {
                Some((_, (next_end, more))) => (next_end, dropped.saturating_add(more)),
                None => (end, dropped),
            };
            self.windows.insert(start, (end, dropped));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lifetime_counts_the_windows_it_overlaps_whole() {
        let mut log = LossLog::default();
        log.note(100, 200, 3);
        log.note(300, 300, 5);
        log.note(400, 450, 7);
        assert_eq!(log.dropped_within(0, 99), 0);
        assert_eq!(log.dropped_within(0, 100), 3);
        assert_eq!(log.dropped_within(150, 160), 3, "inside a window");
        assert_eq!(log.dropped_within(201, 299), 0, "between two");
        assert_eq!(log.dropped_within(200, 300), 8);
        assert_eq!(log.dropped_within(250, 1000), 12);
        assert_eq!(log.dropped_within(451, u64::MAX), 0);
        assert_eq!(log.dropped_within(0, u64::MAX), 15);
    }

    #[test]
    fn overlapping_windows_merge_so_that_none_is_counted_twice() {
        let mut log = LossLog::default();
        log.note(100, 200, 1);
        log.note(300, 400, 2);
        log.note(500, 600, 4);
        // Out of order, reversed bounds, and spanning the first two.
        log.note(350, 150, 8);
        assert_eq!(log.len(), 2);
        assert_eq!(log.dropped_within(0, 250), 11, "the merged window counts whole");
        assert_eq!(log.dropped_within(550, 550), 4);
        assert_eq!(log.dropped_within(0, u64::MAX), 15);
        log.note(600, 600, 16);
        assert_eq!(log.len(), 2, "a window touching another at an end merges with it");
        assert_eq!(log.dropped_within(500, 500), 20);
    }

    #[test]
    fn forgetting_and_coarsening_never_lose_a_loss_a_later_lifetime_overlaps() {
        let mut log = LossLog::default();
        for k in 0..101u64 {
            log.note(k * 100, k * 100 + 10, 1);
        }
        log.forget_before(1005);
        assert_eq!(
            log.len(),
            91,
            "windows ending before 1005 are gone, the one reaching past it stays"
        );
        assert_eq!(log.dropped_within(1005, 1005), 1);
        let before: Vec<(u64, u64)> = (1000..=10_010)
            .step_by(7)
            .map(|t| (t, log.dropped_within(t, t + 20)))
            .collect();
        log.coarsen();
        assert_eq!(log.len(), 46);
        assert_eq!(log.dropped_within(0, u64::MAX), 91, "every record still counted once");
        for (t, was) in before {
            assert!(log.dropped_within(t, t + 20) >= was, "{t}: a loss went missing");
        }
        // The newest window stays, whatever is forgotten: it says when the latest loss may have been.
        assert_eq!(log.latest_ns(), 10_010);
        log.forget_before(u64::MAX);
        assert_eq!((log.len(), log.latest_ns()), (1, 10_010));
    }
}
