//! Slices on thread tracks, and the held queue behind them.
//!
//! A span slice's begin waits in its track's held queue, with everything after it on the track, until it
//! can carry the span's values as of the slice's end (see *Fields at the end of a slice* in the module
//! docs): `emit` queues behind it, `release` sends out what may go. An end out of stack order (`tracing`
//! allows it) ends the slices opened inside and opens them again at once (`close_slice`, `reopen`), so
//! every track nests; slices that cannot end where the program ended them end at the last time known,
//! marked truncated (`truncate_open`). `end_slice` also records each poll for its span's task track (see
//! `tasks.rs`).

use super::{
    EventSlot, HeldEvent, HeldSpan, LateValues, OpenKind, OpenSlice, Processor, Release, Track, MAX_BUFFERED_POLLS,
};
use crate::collector::spans::Poll;
use crate::collector::AsyncTasks;
use crate::export::{EventKind, FieldValue, NameId, TraceField};

/// Most emptied field vectors kept for events held behind a span begin (a pass's worth of `info!` inside
/// `#[instrument]` spans), and the longest kept.
const SPARE_FIELD_VECS: usize = 16_384;
const SPARE_FIELD_VEC_LEN: usize = 16;

impl Processor {
    /// Ends every open slice of `track` at `end_ns`, marked truncated.
    pub(super) fn truncate_open(&mut self, track: &mut Track, end_ns: u64) {
        let end_ns = end_ns.max(track.last_ns);
        while let Some(slice) = track.open.pop() {
            self.counts.truncated_slices += 1;
            self.end_slice(track, slice, end_ns, true, false);
        }
    }

    /// Emits an event on `track`: held behind a held span begin, or straight into the batch.
    pub(super) fn emit(
        &mut self,
        track: &mut Track,
        ts_ns: u64,
        kind: EventKind,
        name: NameId,
        fields: Vec<TraceField>,
        flow_out: Option<u64>,
    ) -> EventSlot {
        if track.held.is_empty() {
            let mut fields = fields;
            let event = self.out.push_event_owned(ts_ns, track.id, kind, name, &mut fields);
            event.flow_out = flow_out;
            self.recycle_field_vec(fields);
            EventSlot::Batch(self.out.batch.events.len() - 1)
        } else {
            track.held.push_back(HeldEvent {
                ts_ns,
                kind,
                name,
                fields,
                flow_out,
                span: None,
                undecided: None,
                late: None,
            });
            EventSlot::Held(track.held_base + track.held.len() as u64 - 1)
        }
    }

    /// [`emit`](Self::emit) of an event without fields: straight into the batch when nothing is held (no
    /// empty `Vec` handed over: its three words, stored by the caller and loaded here as two, cost a failed
    /// store-to-load forward per event).
    #[inline]
    pub(super) fn emit_bare(
        &mut self,
        track: &mut Track,
        ts_ns: u64,
        kind: EventKind,
        name: NameId,
        flow_out: Option<u64>,
    ) -> EventSlot {
        if !track.held.is_empty() {
            return self.emit(track, ts_ns, kind, name, Vec::new(), flow_out);
        }
        let start = self.out.batch.fields.len() as u32;
        let event = self.out.push_event_with_fields_from(start, ts_ns, track.id, kind, name);
        event.flow_out = flow_out;
        EventSlot::Batch(self.out.batch.events.len() - 1)
    }

    /// Ends the innermost open slice of `kind` on `track` at `ts_ns`. Slices opened inside it and still open
    /// (ends out of stack order, which `tracing` allows) end there too and open again right after, so every
    /// track nests; an end with no open slice is counted and dropped.
    pub(super) fn close_slice(&mut self, track: &mut Track, kind: OpenKind, ts_ns: u64) {
        let Some(pos) = track.open.iter().rposition(|o| o.kind == kind) else {
            self.counts.unmatched_ends += 1;
            return;
        };
        if pos + 1 == track.open.len() {
            // The innermost slice: the common case.
            let slice = track.open.pop().expect("pos exists");
            self.end_slice(track, slice, ts_ns, false, false);
            return;
        }
        let inner: Vec<OpenSlice> = track.open.drain(pos + 1..).collect();
        let mut reopen = Vec::new();
        for slice in inner.into_iter().rev() {
            reopen.push((slice.kind, slice.name, slice.begin_ns));
            self.end_slice(track, slice, ts_ns, false, true);
        }
        let slice = track.open.pop().expect("pos exists");
        self.end_slice(track, slice, ts_ns, false, false);
        if let Some((serial, EventSlot::Batch(index))) = track.speculative {
            // Its end carries a flow on speculation, taken back if the span turns out synchronous: parked now,
            // while it is the batch's last event, before the reopened slices' begins go out behind it.
            track.speculative = self
                .park(track, serial, index)
                .map(|seq| (serial, EventSlot::Held(seq)));
        }
        for (kind, name, begin_ns) in reopen.into_iter().rev() {
            self.reopen(track, kind, name, ts_ns, begin_ns);
        }
    }

    /// Opens a slice whose begin needs no values (a scope, a span whose callsite has no fields): emitted now,
    /// held only behind what is already held on the track.
    pub(super) fn begin_unheld(&mut self, track: &mut Track, kind: OpenKind, name: NameId, ts_ns: u64) {
        self.begin_unheld_since(track, kind, name, ts_ns, ts_ns);
    }

    /// [`begin_unheld`](Self::begin_unheld) of a slice (a poll) that began at `begin_ns`, reopened at `ts_ns`.
    fn begin_unheld_since(&mut self, track: &mut Track, kind: OpenKind, name: NameId, ts_ns: u64, begin_ns: u64) {
        let held = next_held_seq(track);
        self.emit_bare(track, ts_ns, EventKind::SliceBegin, name, None);
        open_unheld(track, kind, name, begin_ns, held);
    }

    /// Keeps an emptied field vector for the next event held behind a span begin (up to the pool's bounds).
    fn recycle_field_vec(&mut self, fields: Vec<TraceField>) {
        if fields.capacity() != 0
            && fields.capacity() <= SPARE_FIELD_VEC_LEN
            && self.spare_field_vecs.len() < SPARE_FIELD_VECS
        {
            debug_assert!(fields.is_empty());
            self.spare_field_vecs.push(fields);
        }
    }

    /// Opens a slice of span `serial` whose values are final (no `record` reached it: its close, ahead on the
    /// ring, says so): its begin goes out now with them, emitted like a field-less span's, never held for them.
    pub(super) fn begin_with_final_values(&mut self, track: &mut Track, serial: u64, name: NameId, ts_ns: u64) {
        let held = self.emit_final_begin(track, serial, name, ts_ns);
        open_unheld(track, OpenKind::Span(serial), name, ts_ns, held);
    }

    /// Emits the begin, at `ts_ns`, of a slice of span `serial` whose values are final, with its values then:
    /// straight into the batch's field arena when nothing is held on the track, else behind what is held.
    /// Returns the begin's place in the held queue, if it waits there.
    pub(super) fn emit_final_begin(&mut self, track: &mut Track, serial: u64, name: NameId, ts_ns: u64) -> Option<u64> {
        if track.held.is_empty() {
            let start = self.out.batch.fields.len() as u32;
            if let Some(span) = self.spans.get(serial) {
                span.append_values_at(ts_ns, &mut self.out.batch.fields);
            }
            self.out
                .push_event_with_fields_from(start, ts_ns, track.id, EventKind::SliceBegin, name);
            return None;
        }
        let held = next_held_seq(track);
        let mut values = self.spare_field_vecs.pop().unwrap_or_default();
        if let Some(span) = self.spans.get(serial) {
            span.values_at(ts_ns, &mut values);
        }
        self.emit(track, ts_ns, EventKind::SliceBegin, name, values, None);
        held
    }

    /// Opens again a slice ended only to keep nesting (see [`close_slice`](Self::close_slice)); a span's poll
    /// goes on from `begin_ns`.
    fn reopen(&mut self, track: &mut Track, kind: OpenKind, name: NameId, ts_ns: u64, begin_ns: u64) {
        let fieldless_span = match kind {
            OpenKind::Span(serial) => self.spans.get(serial).is_none_or(|s| s.fieldless),
            OpenKind::Scope(..) => false,
        };
        if fieldless_span {
            if let OpenKind::Span(serial) = kind {
                if let Some(span) = self.spans.get_mut(serial) {
                    span.open_slices += 1;
                }
            }
            self.begin_unheld_since(track, kind, name, ts_ns, begin_ns);
            return;
        }
        match kind {
            OpenKind::Span(serial) => {
                if let Some(span) = self.spans.get_mut(serial) {
                    span.open_slices += 1;
                    span.held_begins += 1;
                }
                begin_held_span(track, serial, name, ts_ns, begin_ns);
            }
            OpenKind::Scope(..) => self.begin_unheld(track, kind, name, ts_ns),
        }
    }

    /// Emits `slice`'s end at `ts_ns` (`truncated`: the slice really ended later) with its markers: on its
    /// begin while that is held, else on the end.
    /// `split`: the slice ends only to keep nesting and opens again at once (its poll goes on).
    fn end_slice(&mut self, track: &mut Track, mut slice: OpenSlice, ts_ns: u64, truncated: bool, split: bool) {
        // Most slices carry nothing on their end: no field vector is built or moved for them.
        let end_fields = if truncated || split || slice.dropped_inside > 0 || slice.held.is_some() {
            self.end_fields(track, &slice, ts_ns, truncated, split)
        } else {
            Vec::new()
        };
        // A span slice whose begin went out before it ended (the hold limit, a flush): the values that changed
        // since go on its end, which waits a pass for those recorded on other threads before it.
        let late = match (slice.kind, slice.released_values.take()) {
            (OpenKind::Span(serial), Some(released)) => {
                if let Some(span) = self.spans.get_mut(serial) {
                    // Known until its end goes.
                    span.held_begins += 1;
                }
                Some(Box::new(LateValues {
                    serial,
                    end_ns: ts_ns,
                    end_pass: self.pass,
                    released: *released,
                }))
            }
            _ => None,
        };
        let mut flow = None;
        let mut speculative = false;
        let mut stream_task = None;
        if let OpenKind::Span(serial) = slice.kind {
            // A span entered again while entered on this thread: the outer enter is the poll.
            let nested = track.open.iter().any(|o| o.kind == slice.kind);
            let mode = if nested { AsyncTasks::Never } else { self.async_tasks };
            // A poll: linked by a flow to its copy on the task's track, when the span is (or, still open after
            // its first poll, may turn out to be) a task.
            let mut stream = false;
            if let Some(span) = self.spans.get_mut(serial) {
                let (known_task, maybe_task) = if !split && mode != AsyncTasks::Never {
                    (
                        span.task.is_some(),
                        // Closed by the ring's next record, or on another ring processed earlier, saying it
                        // was entered only once: synchronous, decided now (no flow to take back). Cut short
                        // (its thread ended, or the timeline): no second poll will come to answer it.
                        mode == AsyncTasks::Auto
                            && span.task.is_none()
                            && (!span.is_closed() || span.close_may_be_task)
                            && span.enters == 1
                            && !self.exit_before_close
                            && !truncated,
                    )
                } else {
                    (false, false)
                };
                let id = if known_task || maybe_task {
                    self.gpu.next_flow()
                } else {
                    0
                };
                speculative = maybe_task;
                span.open_slices = span.open_slices.saturating_sub(1);
                if !split && mode != AsyncTasks::Never {
                    let poll = Poll {
                        begin_ns: slice.begin_ns,
                        end_ns: ts_ns.max(slice.begin_ns).max(1),
                        flow: id,
                    };
                    if truncated {
                        // Cut short on the task's track too (rare: a thread's end, the timeline's). Kept for
                        // the task's track, if it gets one; bounded, for spans that never do.
                        if self.truncated_polls.len() >= MAX_BUFFERED_POLLS {
                            self.truncated_polls.remove(0);
                        }
                        self.truncated_polls.push((serial, poll.begin_ns));
                    }
                    if let Some(task) = &mut span.task {
                        task.last_poll = poll.end_ns;
                        task.polls.push(poll);
                        stream = task.polls.len() >= MAX_BUFFERED_POLLS;
                    } else if span.first_poll.end_ns == 0 {
                        span.first_poll = poll;
                    }
                    flow = (id != 0).then_some(id);
                }
            }
            if stream {
                stream_task = Some(serial);
            }
        }
        let slot = if let Some(late) = late {
            let seq = track.held_base + track.held.len() as u64;
            track.held.push_back(HeldEvent {
                ts_ns,
                kind: EventKind::SliceEnd,
                name: slice.name,
                fields: end_fields,
                flow_out: flow,
                span: None,
                undecided: None,
                late: Some(late),
            });
            EventSlot::Held(seq)
        } else if end_fields.is_empty() {
            self.emit_bare(track, ts_ns, EventKind::SliceEnd, slice.name, flow)
        } else {
            self.emit(track, ts_ns, EventKind::SliceEnd, slice.name, end_fields, flow)
        };
        if let Some(begin) = slice.held {
            note_end(track, begin, slot);
        }
        if speculative {
            if let OpenKind::Span(serial) = slice.kind {
                track.speculative = Some((serial, slot));
            }
        }
        if let Some(serial) = stream_task {
            // A long-lived task: its lifetime begins now and its polls go out as they come, after this slice's
            // end (the start of its poll's flow: see `write_task_polls`).
            self.write_task_begin(serial, ts_ns);
            self.write_task_polls(serial);
        }
    }

    /// What goes on `slice`'s end at `ts_ns`: its markers (`truncated`, `split`, records dropped inside it).
    /// While its begin is still held, the markers go on the begin instead (which then also learns when the slice ended), and nothing on
    /// the end.
    #[inline(never)]
    fn end_fields(
        &mut self,
        track: &mut Track,
        slice: &OpenSlice,
        ts_ns: u64,
        truncated: bool,
        split: bool,
    ) -> Vec<TraceField> {
        let mut markers = Vec::new();
        if truncated {
            markers.push(TraceField {
                name: self.names.truncated,
                value: FieldValue::Bool(true),
            });
        }
        if split {
            // Cut to keep the track nested: it goes on in the next slice of its name.
            markers.push(TraceField {
                name: self.names.split,
                value: FieldValue::Bool(true),
            });
        }
        if slice.dropped_inside > 0 {
            markers.push(TraceField {
                name: self.names.dropped_inside,
                value: FieldValue::U64(slice.dropped_inside),
            });
        }
        if let Some(begin) = slice.held.and_then(|seq| held_at(track, seq)) {
            begin.fields.extend(markers);
            if let Some(span) = &mut begin.span {
                span.end = Some((ts_ns, self.pass));
            }
            return Vec::new();
        }
        markers
    }

    /// Sends out `track`'s held events up to the first span begin that must wait longer: still open, or
    /// ended in this pass (values recorded on other threads before its end may come next pass). `mode` says
    /// how much further it goes (see [`Release`]); a span slice still open goes with its current values.
    pub(super) fn release(&mut self, track: &mut Track, mode: Release, now_ns: u64) {
        // Ends processed before this pass have had a pass to bring other threads' records since, once this
        // pass is processed whole: while it is being processed (a release at a close), only those before the
        // pass before have.
        let settled = if self.mid_pass {
            self.pass.saturating_sub(1)
        } else {
            self.pass
        };
        while let Some(front) = track.held.front_mut() {
            if let Some(serial) = front.undecided {
                // A close saying the span may be a task decides only once the pass after it is processed
                // whole: an enter from before the close, on a ring processed after the close's, is in the
                // close's pass or the next.
                let (task, closed, settled_close) = self.spans.get(serial).map_or((false, true, true), |s| {
                    let closed = s.is_closed();
                    (
                        s.task.is_some(),
                        closed,
                        closed && (!s.close_may_be_task || s.closed_in < settled),
                    )
                });
                if !task && !settled_close && mode == Release::Ready {
                    break;
                }
                front.undecided = None;
                // Closed (or the timeline ends) without a second poll: a synchronous span after all.
                let synchronous = !task && (closed || self.ending);
                if synchronous {
                    front.flow_out = None;
                }
                if let Some(span) = self.spans.get_mut(serial) {
                    span.held_begins = span.held_begins.saturating_sub(1);
                    if synchronous {
                        span.first_poll.flow = 0;
                    }
                }
            }
            let late_waits = front.late.as_ref().is_some_and(|late| {
                late.end_pass >= settled
                    && mode != Release::All
                    && !self.spans.get(late.serial).is_some_and(|s| s.values_final)
            });
            if late_waits {
                // An end whose begin a flush sent out: values recorded before it may come next pass.
                break;
            }
            // A flush sends this begin out before its slice's end, which waits for values that may come late.
            let mut before_its_end = false;
            if let Some(span) = &front.span {
                // Ended a pass ago (values recorded on other threads before the end have come), or ended
                // with values that no `record` changed.
                let ready = match span.end {
                    Some((_, end_pass)) => {
                        end_pass < settled
                            || mode == Release::All
                            || self.spans.get(span.serial).is_some_and(|s| s.values_final)
                    }
                    None => mode != Release::Ready,
                };
                if !ready {
                    let end_held = span.end_seq.is_some_and(|seq| seq > track.held_base);
                    if mode != Release::Flush || !end_held {
                        break;
                    }
                    before_its_end = true;
                }
            }
            let mut event = track.held.pop_front().expect("front exists");
            let seq = track.held_base;
            track.held_base += 1;
            // A span begin goes out with the span's values at its end, gathered in a reused vector.
            let span_begin = event.span.take();
            if let Some(span) = &span_begin {
                let at = span.end.map_or(now_ns, |(end, _)| end);
                let mut values = std::mem::take(&mut self.release_fields);
                if let Some(state) = self.spans.get_mut(span.serial) {
                    state.values_at(at, &mut values);
                    if !before_its_end {
                        state.held_begins = state.held_begins.saturating_sub(1);
                    }
                }
                if span.end.is_none() {
                    // Released before it ended: remember what went out, for its end.
                    if let Some(open) = track.open.iter_mut().find(|o| o.held == Some(seq)) {
                        open.released_values = Some(Box::new(values.clone()));
                    }
                }
                if let (true, Some((end_ns, end_pass)), Some(end_seq)) = (before_its_end, span.end, span.end_seq) {
                    // Its end waits (the span stays known, `held_begins`, until it goes).
                    if let Some(end) = held_at(track, end_seq) {
                        end.late = Some(Box::new(LateValues {
                            serial: span.serial,
                            end_ns,
                            end_pass,
                            released: values.clone(),
                        }));
                    }
                }
                values.append(&mut event.fields);
                event.fields = values;
            }
            if let Some(late) = event.late.take() {
                self.add_late_values(&late, &mut event.fields);
            }
            let event_out = self
                .out
                .push_event_owned(event.ts_ns, track.id, event.kind, event.name, &mut event.fields);
            event_out.flow_out = event.flow_out;
            if span_begin.is_some() {
                // Emptied by the batch: kept for the next begin.
                self.release_fields = event.fields;
            } else {
                self.recycle_field_vec(event.fields);
            }
        }
        for open in &mut track.open {
            if open.held.is_some_and(|seq| seq < track.held_base) {
                open.held = None;
            }
        }
    }

    /// The values span `late.serial` had at its slice's end that its begin did not show (recorded on other
    /// threads and drained after a flush sent the begin out), onto the end's `fields`.
    #[cold]
    fn add_late_values(&mut self, late: &LateValues, fields: &mut Vec<TraceField>) {
        if let Some(state) = self.spans.get_mut(late.serial) {
            let mut at_end = Vec::new();
            state.values_at(late.end_ns, &mut at_end);
            fields.extend(at_end.into_iter().filter(|field| !late.released.contains(field)));
            state.held_begins = state.held_begins.saturating_sub(1);
        }
    }
}

/// Where an event emitted on `track` now waits in its held queue (behind what is held), if anything is held.
fn next_held_seq(track: &Track) -> Option<u64> {
    (!track.held.is_empty()).then(|| track.held_base + track.held.len() as u64)
}

/// Pushes a slice of `kind` that began at `begin_ns` and whose begin was just emitted, not held for values
/// (`held`: where that begin waits behind held events, if it does).
fn open_unheld(track: &mut Track, kind: OpenKind, name: NameId, begin_ns: u64, held: Option<u64>) {
    track.open.push(OpenSlice {
        kind,
        name,
        begin_ns,
        held,
        released_values: None,
        dropped_inside: 0,
    });
}

/// A held span begin (`begin`, a sequence number) learns where its slice's end went (`end`), so that a flush
/// can send the begin out and keep the end (see [`Release::Flush`]).
pub(super) fn note_end(track: &mut Track, begin: u64, end: EventSlot) {
    if let EventSlot::Held(end_seq) = end {
        if let Some(span) = held_at(track, begin).and_then(|b| b.span.as_mut()) {
            span.end_seq = Some(end_seq);
        }
    }
}

/// The held event with sequence number `seq`, if still held.
pub(super) fn held_at(track: &mut Track, seq: u64) -> Option<&mut HeldEvent> {
    let index = seq.checked_sub(track.held_base)?;
    track.held.get_mut(index as usize)
}

/// Holds a begin of span `serial`'s slice at `ts_ns` in `track`'s held queue, for the values the span has at the
/// slice's end (`end`: that end's time and pass, once known); returns its sequence number.
pub(super) fn hold_span_begin(
    track: &mut Track,
    serial: u64,
    name: NameId,
    ts_ns: u64,
    end: Option<(u64, u64)>,
) -> u64 {
    let seq = track.held_base + track.held.len() as u64;
    track.held.push_back(HeldEvent {
        ts_ns,
        kind: EventKind::SliceBegin,
        name,
        fields: Vec::new(),
        flow_out: None,
        span: Some(HeldSpan {
            serial,
            end,
            end_seq: None,
        }),
        undecided: None,
        late: None,
    });
    seq
}

/// Opens a slice of span `serial` whose begin is held until the slice ends, so that it shows the values the
/// span had then: the begin at `ts_ns`, the slice (for nesting) from `begin_ns`.
pub(super) fn begin_held_span(track: &mut Track, serial: u64, name: NameId, ts_ns: u64, begin_ns: u64) {
    let seq = hold_span_begin(track, serial, name, ts_ns, None);
    track.open.push(OpenSlice {
        kind: OpenKind::Span(serial),
        name,
        begin_ns,
        held: Some(seq),
        released_values: None,
        dropped_inside: 0,
    });
}
