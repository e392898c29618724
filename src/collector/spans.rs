//! The processing stage's span table: every span by its serial, with its name, parent and the history of
//! its field values, so that a slice can carry the values its span had when the slice ended.

use std::collections::{HashMap, VecDeque};

use crate::export::{NameId, TraceField};
use crate::recorder::span_serial;

/// Hashes u64 keys (serials, callsite keys) with one multiply: the collector looks one up per record, and
/// SipHash's DoS resistance buys nothing for keys the process made itself.
#[derive(Clone, Copy, Default)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, key: u64) {
        // A folded 64x64->128 multiply spreads the key over both halves: keys are addresses (16-byte
        // aligned) and serials (counters), and the table indexes with the low bits and tags with the high.
        let product = u128::from(self.0 ^ key) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }
}

pub(crate) type IdMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Most field updates kept per span before the oldest are folded into its base values.
const MAX_UPDATES: usize = 64;

/// One span, from its creation record to a little after its close. Kept small (a ring's window holds every
/// span of the last few passes): values, rare, live behind a box.
pub(crate) struct SpanState {
    pub(crate) name: NameId,
    /// Slices of this span open on some thread track.
    pub(crate) open_slices: u32,
    /// Begins of this span's slices held for their values (see `process/slices.rs`): the span must outlive them.
    pub(crate) held_begins: u32,
    /// Enters seen.
    pub(crate) enters: u32,
    /// The callsite key (field names come from the callsite).
    pub(crate) callsite: u64,
    /// Creation time (reference ns).
    pub(crate) created_ns: u64,
    /// The explicit or inferred parent span's serial (0: none).
    pub(crate) parent: u64,
    /// The pass in which its close was processed (0: still open).
    pub(crate) closed_in: u64,
    /// When it closed (reference ns; meaningful once `closed_in` is set).
    pub(crate) closed_ns: u64,
    /// Fields cut or left out at creation or in updates (the marker's value).
    pub(crate) fields_truncated: u32,
    /// Its callsite declares no fields, so its values never change: its slices need not wait for them.
    pub(crate) fieldless: bool,
    /// Its close said no `record` reached it ([`crate::codec::VALUES_FINAL`]): its creation values are final,
    /// so its slices need not wait for values recorded on other threads.
    pub(crate) values_final: bool,
    /// Its close said it may be an async task ([`crate::codec::MAY_BE_TASK`]: entered more than once on any
    /// threads, or named as a parent): its first poll is not taken for its only one until no ring can still
    /// hold an enter from before the close (see `process/tasks.rs`).
    pub(crate) close_may_be_task: bool,
    /// It was entered on more than one thread track.
    pub(crate) multi_track: bool,
    /// The thread track of its first enter (0: never entered).
    pub(crate) first_track: u64,
    /// Its first poll (an enter to its exit), kept for the async task track it may turn out to need.
    pub(crate) first_poll: Poll,
    values: Option<Box<SpanValues>>,
    /// Set once it has an async task track (see `process/tasks.rs`).
    pub(crate) task: Option<Box<TaskData>>,
}

/// One poll of a span: an enter to its exit on some thread, and the flow from that thread's slice (0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Poll {
    pub(crate) begin_ns: u64,
    pub(crate) end_ns: u64,
    pub(crate) flow: u64,
}

/// A span shown as an async task: its track, and its polls not yet written.
#[derive(Debug)]
pub(crate) struct TaskData {
    /// Its track (`place.track`), its depth under the process track (1 for a task without a parent task) and
    /// its parent track.
    pub(crate) place: TaskPlace,
    /// Polls not written yet (the first included once it is a task), in the order they ended.
    pub(crate) polls: Vec<Poll>,
    /// The values its lifetime slice began with, once that begin is written (a task with many polls is
    /// written as it goes, so memory stays bounded).
    pub(crate) begun: Option<Vec<crate::export::TraceField>>,
    /// The track each lane of polls goes on (the task's own first) and when its last poll ended.
    pub(crate) lanes: Vec<(crate::export::TrackId, u64)>,
    /// Its lifetime and polls were written (at its sweep, or at shutdown).
    pub(crate) written: bool,
    /// When its last poll ended (reference ns): a task still open at the end whose close may have been
    /// dropped after it ends there.
    pub(crate) last_poll: u64,
}

/// Where a task track sits (see `process/tasks.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TaskPlace {
    pub(crate) track: crate::export::TrackId,
    /// Tracks above it, the process track's 0.
    pub(crate) depth: u32,
    pub(crate) parent: crate::export::TrackId,
}

/// A span's field values: as of creation (and every update folded in), and later updates `(ns, field)`,
/// oldest first.
#[derive(Default)]
pub(crate) struct SpanValues {
    pub(crate) base: Vec<TraceField>,
    updates: Vec<(u64, TraceField)>,
}

/// Most emptied [`SpanValues`] kept for the next spans with fields (about a pass's worth under load: a
/// `#[instrument]` loop creates ~10,000 per ms). A fresh one costs two allocations and, a few passes later,
/// two frees of memory long out of cache.
const SPARE_VALUES: usize = 16_384;

/// Values whose vectors grew past this many entries are freed rather than kept.
const SPARE_VALUES_MAX_LEN: usize = 64;

impl SpanState {
    pub(crate) fn new(
        name: NameId,
        callsite: u64,
        created_ns: u64,
        parent: Option<u64>,
        values: Option<Box<SpanValues>>,
    ) -> Self {
        SpanState {
            name,
            open_slices: 0,
            held_begins: 0,
            enters: 0,
            callsite,
            created_ns,
            parent: parent.unwrap_or(0),
            closed_in: 0,
            closed_ns: 0,
            fields_truncated: 0,
            fieldless: false,
            values_final: false,
            close_may_be_task: false,
            multi_track: false,
            first_track: 0,
            first_poll: Poll::default(),
            task: None,
            values,
        }
    }

    /// Whether its close has been processed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed_in != 0
    }

    /// Records new values at `ts_ns` (updates from several threads may arrive out of time order).
    pub(crate) fn update(&mut self, ts_ns: u64, fields: impl IntoIterator<Item = TraceField>) {
        let values = self.values.get_or_insert_with(Box::default);
        for field in fields {
            let pos = values.updates.partition_point(|(ts, _)| *ts <= ts_ns);
            values.updates.insert(pos, (ts_ns, field));
        }
        if values.updates.len() > MAX_UPDATES {
            // Fold the oldest half: slices that end before them were released long ago (a slice is held at
            // most the hold limit).
            let fold: Vec<(u64, TraceField)> = values.updates.drain(..MAX_UPDATES / 2).collect();
            for (_, field) in fold {
                set_field(&mut values.base, 0, field);
            }
        }
    }

    /// The span's values at `ts_ns`: its creation values with every update at or before `ts_ns` applied.
    pub(crate) fn values_at(&self, ts_ns: u64, out: &mut Vec<TraceField>) {
        out.clear();
        self.append_values_at(ts_ns, out);
    }

    /// [`values_at`](Self::values_at) appended to what `out` holds (a batch's field arena).
    pub(crate) fn append_values_at(&self, ts_ns: u64, out: &mut Vec<TraceField>) {
        let Some(values) = &self.values else { return };
        let from = out.len();
        out.extend_from_slice(&values.base);
        for (ts, field) in &values.updates {
            if *ts > ts_ns {
                break;
            }
            set_field(out, from, field.clone());
        }
    }

    /// Whether a sweep in pass `pass` may forget it: closed a few passes ago, and no slice refers to it.
    fn forgettable(&self, pass: u64) -> bool {
        self.is_closed()
            && pass >= self.closed_in + KEEP_CLOSED_PASSES
            && self.open_slices == 0
            && self.held_begins == 0
    }

    /// Its creation values (for a task track's name).
    pub(crate) fn creation_values(&self) -> &[TraceField] {
        self.values.as_ref().map_or(&[], |v| &v.base)
    }
}

/// Sets `field` in `fields`, replacing the value of a field of the same name from index `from` on.
///
/// Inlined: called with a field its caller has just built, its wide loads of the field waited on the caller's
/// narrower stores (a failed store-to-load forward: two thirds of this function's time for `info!` events).
#[inline(always)]
pub(crate) fn set_field(fields: &mut Vec<TraceField>, from: usize, field: TraceField) {
    match fields[from..].iter_mut().find(|f| f.name == field.name) {
        Some(existing) => existing.value = field.value,
        None => fields.push(field),
    }
}

/// Every live span, by serial.
///
/// A ring's serials are consecutive (its `n`-th `SpanNew`), and most spans live briefly, so each ring keeps
/// its spans in a window indexed by `n`: a lookup is an index, neighbours share cache lines, and a sweep
/// drops the window's front. A span still open with more than [`WINDOW_MAX`] younger ones behind it moves to
/// `spilled`, so one long-lived span cannot make its ring's window grow without bound.
#[derive(Default)]
pub(crate) struct Spans {
    /// Windows by dense index, and ring number → dense index (ring numbers come from the input, which a
    /// corrupt capture may fill with any value).
    windows: Vec<SpanWindow>,
    ring_index: IdMap<u32>,
    /// The last ring looked up and its dense index: most lookups are for the ring being processed.
    last: Option<(u64, usize)>,
    spilled: IdMap<SpanState>,
    /// Closed spans with an async task track, and the pass their close was processed in: written once no
    /// slice of theirs can still come.
    closing_tasks: Vec<(u64, u64)>,
    /// Values of forgotten spans, emptied, for new spans with fields.
    #[allow(
        clippy::vec_box,
        reason = "the boxes are what is reused: a span holds its values boxed"
    )]
    spare_values: Vec<Box<SpanValues>>,
}

/// One ring's spans: `slots[k]` holds span `n = base + k`.
#[derive(Default)]
struct SpanWindow {
    /// The ring's number (the key of `ring_index` pointing here).
    ring: u64,
    base: u64,
    slots: VecDeque<Option<SpanState>>,
    /// Sweeps in a row that found the window empty.
    empty_sweeps: u32,
}

/// Sweeps in a row a window stays empty before it is let go: a thread that ended (or went quiet) costs the
/// sweep nothing after, and a busy thread whose window empties between bursts keeps its allocation.
const EMPTY_SWEEPS_BEFORE_FORGET: u32 = 64;

/// Slots a ring's window may hold behind a span still open before that span moves to the spilled map: 16,384
/// slots of 112 bytes, about 2 MB per ring at most (65,536 left 15-20 MB more per thread that held a span open
/// around a busy loop, measured).
const WINDOW_MAX: usize = 1 << 14;

/// Passes a closed span is kept (its last exits may still be on rings processed later).
const KEEP_CLOSED_PASSES: u64 = 2;

fn split(serial: u64) -> (u64, u64) {
    (serial >> 40, serial & ((1 << 40) - 1))
}

impl Spans {
    /// Empty values for a new span with fields to decode into (reused from a forgotten span when one is
    /// spare); hand them back with [`recycle_values`](Self::recycle_values) if they stay empty.
    pub(crate) fn take_values(&mut self) -> Box<SpanValues> {
        self.spare_values.pop().unwrap_or_default()
    }

    /// Keeps `values` (emptied) for the next [`take_values`](Self::take_values), up to the pool's bound.
    pub(crate) fn recycle_values(&mut self, values: Box<SpanValues>) {
        Self::recycle_into(&mut self.spare_values, values);
    }

    #[allow(
        clippy::vec_box,
        reason = "the boxes are what is reused: a span holds its values boxed"
    )]
    fn recycle_into(spare: &mut Vec<Box<SpanValues>>, mut values: Box<SpanValues>) {
        if spare.len() < SPARE_VALUES
            && values.base.capacity() <= SPARE_VALUES_MAX_LEN
            && values.updates.capacity() <= SPARE_VALUES_MAX_LEN
        {
            values.base.clear();
            values.updates.clear();
            spare.push(values);
        }
    }

    fn window_of(&mut self, ring: u64) -> Option<usize> {
        if let Some((r, index)) = self.last {
            if r == ring {
                return Some(index);
            }
        }
        let index = *self.ring_index.get(&ring)? as usize;
        self.last = Some((ring, index));
        Some(index)
    }

    fn window_of_shared(&self, ring: u64) -> Option<usize> {
        match self.last {
            Some((r, index)) if r == ring => Some(index),
            _ => self.ring_index.get(&ring).map(|&i| i as usize),
        }
    }

    /// Where span `serial` sits in its ring's window, `(window, slot)`; `None` when it is not in one (spilled,
    /// forgotten, or its ring's window was let go).
    fn place_of(&self, serial: u64, index: Option<usize>) -> Option<(usize, usize)> {
        let (_, n) = split(serial);
        let index = index?;
        let window = &self.windows[index];
        let k = n.checked_sub(window.base)? as usize;
        (k < window.slots.len()).then_some((index, k))
    }

    pub(crate) fn get(&self, serial: u64) -> Option<&SpanState> {
        match self.place_of(serial, self.window_of_shared(split(serial).0)) {
            Some((index, k)) => self.windows[index].slots[k].as_ref(),
            None => self.spilled.get(&serial),
        }
    }

    pub(crate) fn get_mut(&mut self, serial: u64) -> Option<&mut SpanState> {
        let index = self.window_of(split(serial).0);
        match self.place_of(serial, index) {
            Some((index, k)) => self.windows[index].slots[k].as_mut(),
            None => self.spilled.get_mut(&serial),
        }
    }

    /// Adds span `serial`. Serials of a ring come in order; one out of order (a corrupt capture) goes to the
    /// spilled map.
    pub(crate) fn insert(&mut self, serial: u64, span: SpanState) {
        let (ring, n) = split(serial);
        let index = match self.window_of(ring) {
            Some(index) => index,
            None => {
                let index = self.windows.len();
                self.windows.push(SpanWindow {
                    ring,
                    base: n,
                    slots: VecDeque::new(),
                    empty_sweeps: 0,
                });
                self.ring_index.insert(ring, index as u32);
                self.last = Some((ring, index));
                index
            }
        };
        let window = &mut self.windows[index];
        if window.slots.is_empty() && n >= window.base {
            window.base = n;
        }
        match n.checked_sub(window.base) {
            Some(k) if k == window.slots.len() as u64 => window.slots.push_back(Some(span)),
            Some(k) if (k as usize) < window.slots.len() => window.slots[k as usize] = Some(span),
            _ => {
                self.spilled.insert(serial, span);
            }
        }
    }

    /// Notes span `serial`'s close, processed in pass `pass` (passes count from 1).
    /// Notes that span `serial` closed at `ts_ns`, in pass `pass`; `values_final`: see
    /// [`SpanState::values_final`].
    pub(crate) fn close(&mut self, serial: u64, pass: u64, ts_ns: u64, values_final: bool, may_be_task: bool) {
        if let Some(span) = self.get_mut(serial) {
            span.closed_in = pass.max(1);
            span.closed_ns = ts_ns;
            span.values_final = values_final;
            span.close_may_be_task = may_be_task;
            if span.task.is_some() {
                self.closing_tasks.push((serial, pass.max(1)));
            }
        }
    }

    /// Notes that span `serial`, already closed, got a task track (a child made it a container).
    pub(crate) fn closed_task(&mut self, serial: u64) {
        if let Some(span) = self.get(serial) {
            if span.is_closed() {
                let closed_in = span.closed_in;
                self.closing_tasks.push((serial, closed_in));
            }
        }
    }

    /// Closed tasks whose slices have all been seen by pass `pass` (closed a few passes ago, no slice open):
    /// their serials go to `out`, to be written.
    pub(crate) fn tasks_to_write(&mut self, pass: u64, out: &mut Vec<u64>) {
        let mut closing = std::mem::take(&mut self.closing_tasks);
        closing.retain(|&(serial, closed_in)| {
            if pass < closed_in + KEEP_CLOSED_PASSES {
                return true;
            }
            match self.get(serial) {
                Some(span) if span.open_slices > 0 => true,
                Some(_) => {
                    out.push(serial);
                    false
                }
                None => false,
            }
        });
        self.closing_tasks = closing;
    }

    /// The earliest creation time of the spans still here (`None`: none is).
    pub(crate) fn oldest_created_ns(&self) -> Option<u64> {
        // A ring's spans come in creation order: its first one still here is its oldest.
        let windows = self
            .windows
            .iter()
            .filter_map(|w| w.slots.iter().flatten().next().map(|s| s.created_ns));
        windows.chain(self.spilled.values().map(|s| s.created_ns)).min()
    }

    /// Every span still here whose task track was not written (shutdown), by serial.
    pub(crate) fn unwritten_tasks(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (&ring, &index) in &self.ring_index {
            let window = &self.windows[index as usize];
            for (k, slot) in window.slots.iter().enumerate() {
                if slot
                    .as_ref()
                    .is_some_and(|s| s.task.as_ref().is_some_and(|t| !t.written))
                {
                    out.push(span_serial(ring, window.base + k as u64));
                }
            }
        }
        for (&serial, span) in &self.spilled {
            if span.task.as_ref().is_some_and(|t| !t.written) {
                out.push(serial);
            }
        }
        out.sort_unstable();
        out
    }

    /// Forgets spans closed a few passes ago that no open slice refers to: each window's front, and spilled
    /// spans. A window that grew long behind a span still open moves that span to the spilled map; a window
    /// empty for [`EMPTY_SWEEPS_BEFORE_FORGET`] sweeps is let go.
    pub(crate) fn sweep(&mut self, pass: u64) {
        let mut index = 0;
        while index < self.windows.len() {
            let window = &mut self.windows[index];
            loop {
                match window.slots.front() {
                    Some(None) => {}
                    Some(Some(span)) if span.forgettable(pass) => {}
                    Some(Some(span)) if window.slots.len() > WINDOW_MAX && !span.is_closed() => {
                        let span = window.slots.pop_front().flatten().expect("checked above");
                        self.spilled.insert(span_serial(window.ring, window.base), span);
                        window.base += 1;
                        continue;
                    }
                    _ => break,
                }
                // Its values (if any) go back to the pool: the next span with fields decodes into them.
                if let Some(Some(SpanState {
                    values: Some(values), ..
                })) = window.slots.pop_front()
                {
                    Self::recycle_into(&mut self.spare_values, values);
                }
                window.base += 1;
            }
            // A window empty for a while is let go, so that every thread that ever recorded does not cost each
            // sweep (a program that starts threads all the time). A span its ring makes later opens a new one.
            if !window.slots.is_empty() {
                window.empty_sweeps = 0;
            } else {
                window.empty_sweeps += 1;
                if window.empty_sweeps >= EMPTY_SWEEPS_BEFORE_FORGET {
                    let ring = window.ring;
                    self.windows.swap_remove(index);
                    self.ring_index.remove(&ring);
                    if let Some(moved) = self.windows.get(index) {
                        self.ring_index.insert(moved.ring, index as u32);
                    }
                    self.last = None;
                    continue;
                }
            }
            index += 1;
        }
        if !self.spilled.is_empty() {
            self.spilled.retain(|_, span| !span.forgettable(pass));
        }
    }

    /// Spans held now (tests).
    #[cfg(test)]
    fn live(&self) -> usize {
        self.windows
            .iter()
            .map(|w| w.slots.iter().flatten().count())
            .sum::<usize>()
            + self.spilled.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::FieldValue;

    fn field(name: u32, v: i64) -> TraceField {
        TraceField {
            name: NameId(name),
            value: FieldValue::I64(v),
        }
    }

    #[test]
    fn values_at_a_time_apply_only_earlier_updates_in_time_order() {
        let mut span = SpanState::new(
            NameId(1),
            0,
            100,
            None,
            Some(Box::new(SpanValues {
                base: vec![field(1, 0)],
                updates: Vec::new(),
            })),
        );
        span.update(300, [field(1, 3)]);
        span.update(200, [field(1, 2), field(2, 20)]);
        let mut out = Vec::new();
        span.values_at(150, &mut out);
        assert_eq!(out, [field(1, 0)]);
        span.values_at(250, &mut out);
        assert_eq!(out, [field(1, 2), field(2, 20)]);
        span.values_at(300, &mut out);
        assert_eq!(out, [field(1, 3), field(2, 20)]);
    }

    #[test]
    fn closed_spans_are_forgotten_once_no_slice_needs_them() {
        let mut spans = Spans::default();
        spans.insert(7, SpanState::new(NameId(1), 0, 0, None, None));
        spans.get_mut(7).unwrap().open_slices = 1;
        spans.close(7, 10, 5, false, false);
        spans.sweep(20);
        assert!(spans.get(7).is_some(), "an open slice still refers to it");
        spans.get_mut(7).unwrap().open_slices = 0;
        spans.sweep(21);
        assert!(spans.get(7).is_none());
    }

    fn serial(ring: u64, n: u64) -> u64 {
        span_serial(ring, n)
    }

    #[test]
    fn rings_keep_their_spans_apart_and_a_long_lived_span_does_not_hold_the_window() {
        let mut spans = Spans::default();
        let state = || SpanState::new(NameId(1), 0, 0, None, None);
        // Ring 1: one span that stays, then many that close at once.
        spans.insert(serial(1, 1), state());
        spans.insert(serial(2, 1), state());
        for n in 2..=(WINDOW_MAX as u64 * 3) {
            spans.insert(serial(1, n), state());
            spans.close(serial(1, n), 1, 0, false, false);
        }
        spans.sweep(10);
        assert!(
            spans.get(serial(1, 1)).is_some(),
            "the long-lived span is still there (spilled)"
        );
        assert!(spans.get(serial(2, 1)).is_some(), "another ring's span is untouched");
        assert!(spans.get(serial(1, 2)).is_none());
        assert_eq!(spans.live(), 2, "everything closed was forgotten");
        assert!(spans.windows.iter().all(|w| w.slots.len() <= WINDOW_MAX));
        // The spilled span closes and goes too; a serial never created is unknown.
        spans.close(serial(1, 1), 20, 0, false, false);
        spans.sweep(30);
        assert!(spans.get(serial(1, 1)).is_none());
        assert!(spans.get(serial(3, 1)).is_none());
        assert!(spans.get(serial(1, WINDOW_MAX as u64 * 10)).is_none());
    }

    /// A program that starts threads all the time: each ring's window is let go once it stays empty, so the
    /// sweep's cost follows the rings in use, not every ring ever seen. A ring's spans after that, and one of
    /// its spans spilled before, are still found.
    #[test]
    fn windows_of_rings_gone_quiet_are_let_go() {
        let mut spans = Spans::default();
        let state = || SpanState::new(NameId(1), 0, 0, None, None);
        // Ring 1 holds a span that spills (more than WINDOW_MAX behind it), then goes quiet.
        spans.insert(serial(1, 1), state());
        for n in 2..=(WINDOW_MAX as u64 + 2) {
            spans.insert(serial(1, n), state());
            spans.close(serial(1, n), 1, 0, false, false);
        }
        for ring in 2..1_002 {
            spans.insert(serial(ring, 1), state());
            spans.close(serial(ring, 1), 1, 0, false, false);
        }
        assert_eq!(spans.windows.len(), 1_001);
        for pass in 10..10 + u64::from(EMPTY_SWEEPS_BEFORE_FORGET) + 1 {
            spans.sweep(pass);
        }
        assert_eq!(spans.windows.len(), 0, "every window stayed empty");
        assert_eq!(spans.ring_index.len(), 0);
        assert!(spans.get(serial(1, 1)).is_some(), "the spilled span is still found");
        // A ring let go records again: a new window, and lookups of every ring stay right.
        spans.insert(serial(7, 2), state());
        spans.insert(serial(9, 2), state());
        assert!(spans.get(serial(7, 2)).is_some() && spans.get(serial(9, 2)).is_some());
        assert!(spans.get(serial(7, 1)).is_none(), "forgotten before");
        // One busy window among quiet ones: removing the others keeps the index right for it.
        spans.close(serial(9, 2), 100, 0, false, false);
        for pass in 200..200 + u64::from(EMPTY_SWEEPS_BEFORE_FORGET) {
            spans.sweep(pass);
        }
        assert_eq!(spans.windows.len(), 1, "ring 7's span is open");
        assert!(spans.get(serial(7, 2)).is_some());
    }

    #[test]
    fn serials_out_of_order_are_kept_too() {
        let mut spans = Spans::default();
        let state = |name| SpanState::new(NameId(name), 0, 0, None, None);
        spans.insert(serial(1, 5), state(5));
        spans.insert(serial(1, 3), state(3));
        spans.insert(serial(1, 9), state(9));
        spans.insert(serial(1, 6), state(6));
        for n in [5, 3, 9, 6] {
            assert_eq!(spans.get(serial(1, n)).map(|s| s.name), Some(NameId(n as u32)), "{n}");
        }
    }

    #[test]
    fn values_of_forgotten_spans_are_reused_empty() {
        let mut spans = Spans::default();
        let mut values = spans.take_values();
        values.base.push(field(1, 7));
        let address = &*values as *const SpanValues;
        let mut span = SpanState::new(NameId(1), 0, 0, None, Some(values));
        span.update(5, [field(1, 8)]);
        spans.insert(serial(1, 1), span);
        spans.close(serial(1, 1), 1, 0, false, false);
        spans.sweep(10);
        assert!(spans.get(serial(1, 1)).is_none());
        let reused = spans.take_values();
        assert_eq!(&*reused as *const SpanValues, address, "the forgotten span's values");
        assert!(reused.base.is_empty() && reused.updates.is_empty());
        // None spare: fresh ones.
        assert!(spans.take_values().base.is_empty());
    }
}
