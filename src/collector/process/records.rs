//! One record of a ring: what each kind does to its thread track, the span table and the batch (`item`),
//! and the decoding it needs: ticks to reference ns (kept monotonic per track; spans created untimed are
//! dated by the ring's next timed record), callsite names, field payloads, counter tracks.

use super::{OpenKind, Processor, Step, Track};
use crate::codec::{
    decode_fields, restore_ticks, Item, LeafSpan, LeafTail, Parent, Payload, RawValue, Record, META_INDEX,
};
use crate::collector::spans::{set_field, Poll, SpanState, SpanValues};
use crate::collector::AsyncTasks;
use crate::export::{EventKind, FieldValue, NameId, TraceField, TrackId};

impl Processor {
    /// One decoded record of a ring; `ahead`: the ring's records after it in this chunk (a span's enter looks
    /// there for its close).
    pub(super) fn item(
        &mut self,
        track: &mut Track,
        item: Item<'_>,
        ahead: &[Record],
        now_ticks: u64,
        force: bool,
    ) -> Step {
        if let Some((serial, slot)) = track.speculative.take() {
            self.decide_flow(track, serial, slot, &item);
        }
        match item {
            Item::SpanNew {
                ticks,
                callsite,
                parent,
                fields,
            } => {
                track.spans_created += 1;
                let serial = crate::recorder::span_serial(u64::from(track.ring), track.spans_created);
                let ts = if ticks != 0 {
                    self.ticks_to_ns(track, ticks, now_ticks)
                } else {
                    // Untimed: dated by the ring's next timed record.
                    track.undated.push(serial);
                    track.last_ns
                };
                let (name, fieldless) = match self.span_callsite(callsite) {
                    Some(found) => found,
                    None => (self.callsite_name(callsite), true),
                };
                let (values, truncated) = self.span_values(callsite, fields);
                let parent = creation_parent(track, parent);
                let mut span = SpanState::new(name, callsite, ts, parent, values);
                span.fields_truncated = u32::try_from(truncated).unwrap_or(u32::MAX);
                span.fieldless = fieldless && truncated == 0;
                self.spans.insert(serial, span);
                if self.async_tasks == AsyncTasks::Always {
                    self.make_task(serial);
                }
            }
            Item::SpanRecord { ticks, serial, fields } => {
                let Some(span) = self.span_serial(serial) else {
                    if !force {
                        return Step::Stall;
                    }
                    self.counts.unknown_spans += 1;
                    return Step::Done;
                };
                let callsite = span.callsite;
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let mut values = std::mem::take(&mut self.scratch_fields);
                values.clear();
                let truncated = self.decode_payload(callsite, fields, &mut values);
                if let Some(span) = self.spans.get_mut(serial) {
                    if truncated > 0 {
                        // The marker counts the span's cuts so far, not only this record's: its slices show every
                        // value cut since its creation.
                        span.fields_truncated = span
                            .fields_truncated
                            .saturating_add(u32::try_from(truncated).unwrap_or(u32::MAX));
                        let marker = self.names.fields_truncated;
                        for field in values.iter_mut().filter(|f| f.name == marker) {
                            field.value = FieldValue::U64(u64::from(span.fields_truncated));
                        }
                    }
                    span.update(ts, values.drain(..));
                }
                self.scratch_fields = values;
            }
            Item::SpanEnter { ticks, serial } => {
                // Entered again while entered on this thread: not a new poll.
                let nested = track.open.iter().any(|o| o.kind == OpenKind::Span(serial));
                // One lookup: the span's name, and its enter counted.
                let (name, fieldless, becomes_task, final_ahead) = match self.spans.get_mut(serial) {
                    Some(span) => {
                        // Its close a few records on says its values are final: its slice need not wait.
                        let final_ahead = !span.fieldless && closes_with_final_values(ahead, serial);
                        span.open_slices += 1;
                        span.held_begins += u32::from(!span.fieldless && !final_ahead);
                        span.enters = span.enters.saturating_add(u32::from(!nested));
                        if span.first_track == 0 {
                            span.first_track = track.id.0;
                        } else if span.first_track != track.id.0 {
                            span.multi_track = true;
                        }
                        // Entered again, or on another thread: a span that lives across polls.
                        let becomes_task = self.async_tasks == AsyncTasks::Auto
                            && span.task.is_none()
                            && (span.enters > 1 || span.multi_track);
                        (span.name, span.fieldless, becomes_task, final_ahead)
                    }
                    None if !force => return Step::Stall,
                    None => {
                        self.counts.unknown_spans += 1;
                        (self.names.unknown_span, true, false, false)
                    }
                };
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                if becomes_task {
                    self.make_task(serial);
                    self.release_decided(track, serial, ts);
                }
                if fieldless {
                    // No values to wait for: out at once (behind anything already held on the track).
                    self.begin_unheld(track, OpenKind::Span(serial), name, ts);
                    return Step::Done;
                }
                if final_ahead {
                    // Its values now are its values at the slice's end: out at once with them.
                    self.begin_with_final_values(track, serial, name, ts);
                    return Step::Done;
                }
                // Held until the slice ends: it shows the values the span had then.
                super::slices::begin_held_span(track, serial, name, ts, ts);
            }
            Item::SpanExit { ticks, serial } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                track.last_exit = Some((serial, ts));
                self.close_slice(track, OpenKind::Span(serial), ts);
            }
            Item::SpanClose {
                ticks,
                serial,
                values_final,
                may_be_task,
            } => {
                if self.span_serial(serial).is_none() {
                    if !force {
                        return Step::Stall;
                    }
                    self.counts.unknown_spans += 1;
                    return Step::Done;
                }
                let ts = match ticks {
                    Some(ticks) => self.ticks_to_ns(track, ticks, now_ticks),
                    None => match track.last_exit {
                        Some((s, ns)) if s == serial => ns,
                        _ => track.last_ns,
                    },
                };
                self.spans.close(serial, self.pass, ts, values_final, may_be_task);
                self.release_decided(track, serial, ts);
                if values_final && !track.held.is_empty() {
                    // Its held begins need not wait for the next pass: out now, with what follows them.
                    self.release(track, super::Release::Ready, ts);
                }
            }
            Item::Event {
                ticks,
                callsite,
                parent: _,
                fields,
            } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let name = self.callsite_name(callsite);
                if track.held.is_empty() {
                    // Nothing held on the track: decoded straight into the batch's field arena (no `Vec` per
                    // event).
                    let mut arena = std::mem::take(&mut self.out.batch.fields);
                    let start = arena.len() as u32;
                    self.decode_payload(callsite, fields, &mut arena);
                    self.out.batch.fields = arena;
                    self.out
                        .push_event_with_fields_from(start, ts, track.id, EventKind::Instant, name);
                } else {
                    let mut values = self.spare_field_vecs.pop().unwrap_or_default();
                    self.decode_payload(callsite, fields, &mut values);
                    self.emit(track, ts, EventKind::Instant, name, values, None);
                }
            }
            Item::ScopeBegin { ticks, callsite, tag } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let name = self.callsite_name(callsite);
                self.begin_unheld(track, OpenKind::Scope(callsite, tag), name, ts);
            }
            Item::ScopeEnd { ticks, callsite, tag } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                self.close_slice(track, OpenKind::Scope(callsite, tag), ts);
            }
            Item::Instant { ticks, callsite } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let name = self.callsite_name(callsite);
                self.emit(track, ts, EventKind::Instant, name, Vec::new(), None);
            }
            Item::Counter { ticks, callsite, value } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let (name, counter_track) = self.counter_track(callsite);
                self.out.push_counter(counter_track, ts, name, value);
            }
            Item::GpuBegin {
                ticks,
                callsite,
                key,
                fields,
            } => {
                let (ts, name, values) = self.stamped_values(track, (ticks, now_ticks), callsite, fields);
                // Where this thread recorded the GPU work: the flow's start (its end is the GPU slice, or the
                // instant that stands for the scope if it is lost; none for a scope with no queue to go to).
                let flow = self.gpu.begin(&mut self.out, key, name, values, ts);
                self.emit(track, ts, EventKind::Instant, name, Vec::new(), flow);
            }
            Item::Gap { ticks, dropped } => {
                self.counts.gap_markers += 1;
                // With none dropped, its thread exited here: the track's time moves to it, where the slices the
                // thread left open end (the last moment it lived).
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                if dropped > 0 {
                    self.mark_loss(track, ts, dropped);
                }
            }
        }
        Step::Done
    }

    /// Shows `dropped` records lost on `track` at `ts`: an instant with their count, and the count on every
    /// slice open there.
    pub(super) fn mark_loss(&mut self, track: &mut Track, ts: u64, dropped: u64) {
        track.losses_shown = track.losses_shown.saturating_add(dropped);
        for slice in &mut track.open {
            slice.dropped_inside = slice.dropped_inside.saturating_add(dropped);
        }
        let fields = vec![TraceField {
            name: self.names.records,
            value: FieldValue::U64(dropped),
        }];
        self.emit(track, ts, EventKind::Instant, self.names.gap, fields, None);
    }

    fn span_serial(&self, serial: u64) -> Option<&SpanState> {
        self.spans.get(serial)
    }

    /// A record's time in reference ns, its callsite's name and its decoded field values.
    fn stamped_values(
        &mut self,
        track: &mut Track,
        (ticks, now_ticks): (u64, u64),
        callsite: u64,
        fields: Payload<'_>,
    ) -> (u64, NameId, Vec<TraceField>) {
        let ts = self.ticks_to_ns(track, ticks, now_ticks);
        let name = self.callsite_name(callsite);
        let mut values = Vec::new();
        self.decode_payload(callsite, fields, &mut values);
        (ts, name, values)
    }

    fn ticks_to_ns(&mut self, track: &mut Track, low: u64, now_ticks: u64) -> u64 {
        let ticks = restore_ticks(low, now_ticks);
        let ns = self
            .cpu
            .as_ref()
            .and_then(|c| c.convert_noting(ticks, &mut self.cpu_converted))
            .unwrap_or(track.last_ns);
        let ns = if ns < track.last_ns {
            self.counts.monotonic_clamps += 1;
            track.last_ns
        } else {
            track.last_ns = ns;
            ns
        };
        if !track.undated.is_empty() {
            self.date_creations(track, ns);
        }
        ns
    }

    /// Spans created since the ring's last timed record were created before `ns` (the next timed record's
    /// time; for a span entered at once, its enter) and after the record before.
    #[cold]
    fn date_creations(&mut self, track: &mut Track, ns: u64) {
        for serial in track.undated.drain(..) {
            if let Some(span) = self.spans.get_mut(serial) {
                span.created_ns = ns;
            }
        }
    }

    /// A span callsite's name and whether it declares no fields; `None` if it is unknown.
    #[inline]
    fn span_callsite(&mut self, callsite: u64) -> Option<(NameId, bool)> {
        match self.last_span_callsite {
            Some((key, name, fieldless)) if key == callsite => Some((name, fieldless)),
            _ => {
                let c = self.callsites.get(callsite)?;
                let found = (c.name, c.fields.is_empty());
                // A loop's spans come from one callsite: the next lookup is a compare.
                self.last_span_callsite = Some((callsite, found.0, found.1));
                Some(found)
            }
        }
    }

    /// A [`LeafSpan`]'s four records at once: the same events, span-table entry and counts as [`item`](Self::item)
    /// on each in turn (`leaf_spans_make_the_same_trace_as_their_records_one_by_one` checks this against random
    /// rings), with one span-table access instead of four and no per-record dispatch. Returns false, having
    /// changed nothing, where the general path is needed: a callsite with fields or unknown, events held on
    /// the track, spans waiting for a creation time, a speculative flow to decide, `AsyncTasks::Always`, a
    /// serial that is not the ring's next, or one with a slice already open on the track.
    ///
    /// What the general path decides for such a span: entered once on its own thread and closed right after its
    /// exit, it is synchronous (no task, no flow); its slice needs no held begin (no fields to wait for); its
    /// first poll is kept unless tasks are off; it is closed in this pass at its exit's time.
    pub(super) fn leaf_span(&mut self, track: &mut Track, leaf: LeafSpan, now_ticks: u64) -> bool {
        let serial = leaf.serial;
        // Behind held events its slice would be held too: the general path.
        if !self.leaf_fits(track, serial) || !track.held.is_empty() {
            return false;
        }
        let Some((name, true)) = self.span_callsite(leaf.callsite) else {
            return false;
        };
        track.spans_created += 1;
        // In the order the general path converts them (each keeps the track's time monotonic).
        let created = (leaf.created_ticks != 0).then(|| self.ticks_to_ns(track, leaf.created_ticks, now_ticks));
        let parent = creation_parent(track, Parent::Contextual);
        let begin = self.ticks_to_ns(track, leaf.enter_ticks, now_ticks);
        let end = self.ticks_to_ns(track, leaf.exit_ticks, now_ticks);
        // Untimed: dated by the ring's next timed record, its enter.
        let mut span = self.closed_leaf(
            track,
            SpanState::new(name, leaf.callsite, created.unwrap_or(begin), parent, None),
            (begin, end),
        );
        span.fieldless = true;
        self.spans.insert(serial, span);
        self.emit_bare(track, begin, EventKind::SliceBegin, name, None);
        self.emit_bare(track, end, EventKind::SliceEnd, name, None);
        track.last_exit = Some((serial, end));
        true
    }

    /// A leaf span with fields at once: its creation group (`ticks`, `callsite`, `parent`, `fields`, decoded by
    /// the caller) and `tail` (its enter, exit and close) have the effects the general path gives those
    /// records one by one: the span-table entry (closed, its first poll, its values), and its slice: begin and
    /// end straight into the batch when its values are final and nothing is held on the track, else its begin
    /// held for its values with its end known and the end behind it. False, having changed nothing, where the
    /// general path is needed (the same cases as [`leaf_span`](Self::leaf_span), and a callsite declaring no
    /// fields, whose slice would not wait).
    pub(super) fn leaf_span_with_fields(
        &mut self,
        track: &mut Track,
        (ticks, callsite, parent, fields): (u64, u64, Parent, Payload<'_>),
        tail: LeafTail,
        now_ticks: u64,
    ) -> bool {
        let serial = tail.serial;
        if !self.leaf_fits(track, serial) {
            return false;
        }
        let Some((name, false)) = self.span_callsite(callsite) else {
            return false;
        };
        track.spans_created += 1;
        // In the order the general path converts them (each keeps the track's time monotonic).
        let created = (ticks != 0).then(|| self.ticks_to_ns(track, ticks, now_ticks));
        let (values, truncated) = self.span_values(callsite, fields);
        let parent = creation_parent(track, parent);
        let begin = self.ticks_to_ns(track, tail.enter_ticks, now_ticks);
        let end = self.ticks_to_ns(track, tail.exit_ticks, now_ticks);
        // Untimed: dated by the ring's next timed record, its enter.
        let mut span = self.closed_leaf(
            track,
            SpanState::new(name, callsite, created.unwrap_or(begin), parent, values),
            (begin, end),
        );
        span.fields_truncated = u32::try_from(truncated).unwrap_or(u32::MAX);
        span.values_final = tail.values_final;
        track.last_exit = Some((serial, end));
        if tail.values_final {
            // Its values are final: its begin goes out with them now, as the general path's does
            // (`emit_final_begin`), which finds them in the span table: with nothing held, from the span at hand
            // instead (the lookup was 4 % of `collector_steady_spans/with_field`).
            if track.held.is_empty() {
                let start = self.out.batch.fields.len() as u32;
                self.out.batch.fields.extend_from_slice(span.creation_values());
                self.spans.insert(serial, span);
                self.out
                    .push_event_with_fields_from(start, begin, track.id, EventKind::SliceBegin, name);
            } else {
                self.spans.insert(serial, span);
                self.emit_final_begin(track, serial, name, begin);
            }
            self.emit_bare(track, end, EventKind::SliceEnd, name, None);
            // As the general path does at a close with final values: what is held goes as far as it may.
            if !track.held.is_empty() {
                self.release(track, super::Release::Ready, end);
            }
            return true;
        }
        // Its begin waits for its values (released a pass after its end, which is known).
        span.held_begins = 1;
        self.spans.insert(serial, span);
        let begin_seq = super::slices::hold_span_begin(track, serial, name, begin, Some((end, self.pass)));
        let end_slot = self.emit_bare(track, end, EventKind::SliceEnd, name, None);
        super::slices::note_end(track, begin_seq, end_slot);
        true
    }

    /// Whether a leaf span naming `serial` may take a fast path on `track`: it is the ring's next span, and
    /// nothing the general path treats differently is pending (a speculative flow, undated creations,
    /// `AsyncTasks::Always`, a slice already open under this serial: an enter processed as unknown before the
    /// creation came, which the general path treats as nested).
    fn leaf_fits(&self, track: &Track, serial: u64) -> bool {
        serial == crate::recorder::span_serial(u64::from(track.ring), track.spans_created + 1)
            && self.async_tasks != AsyncTasks::Always
            && track.speculative.is_none()
            && track.undated.is_empty()
            && !track.open.iter().any(|o| o.kind == OpenKind::Span(serial))
    }

    /// `span` as a leaf leaves it: entered once on `track` from `begin` to `end` (its first poll), closed at
    /// `end` in this pass.
    fn closed_leaf(&self, track: &Track, mut span: SpanState, (begin, end): (u64, u64)) -> SpanState {
        span.enters = 1;
        span.first_track = track.id.0;
        if self.async_tasks != AsyncTasks::Never {
            span.first_poll = Poll {
                begin_ns: begin,
                end_ns: end.max(begin).max(1),
                flow: 0,
            };
        }
        span.closed_in = self.pass.max(1);
        span.closed_ns = end;
        span
    }

    /// A new span's values decoded from its creation's `fields` (callsite `callsite`), in reused values (a
    /// pool of forgotten spans'), kept only if there are any; and how many fields were cut.
    fn span_values(&mut self, callsite: u64, fields: Payload<'_>) -> (Option<Box<SpanValues>>, u64) {
        let mut values = self.spans.take_values();
        let truncated = self.decode_payload(callsite, fields, &mut values.base);
        if values.base.is_empty() {
            self.spans.recycle_values(values);
            (None, truncated)
        } else {
            (Some(values), truncated)
        }
    }

    fn callsite_name(&mut self, key: u64) -> NameId {
        match self.callsites.get(key) {
            Some(c) => c.name,
            None => {
                self.counts.unknown_callsites += 1;
                self.names.unknown_callsite
            }
        }
    }

    /// Decodes a field payload of callsite `key` into `out` (appending); a truncation marker becomes the
    /// `tickline.fields_truncated` field. Returns how many fields were cut.
    fn decode_payload(&mut self, key: u64, payload: Payload<'_>, out: &mut Vec<TraceField>) -> u64 {
        if payload.len() == 0 {
            return 0;
        }
        payload.bytes_into(&mut self.payload);
        let Some(callsite) = self.callsites.get(key) else {
            return 0;
        };
        let mut truncated = 0;
        // Fields already in `out` are not this payload's (`out` may be a batch's whole field arena).
        let from = out.len();
        for (index, value) in decode_fields(&self.payload) {
            let (name, value) = match value {
                RawValue::Truncated(n) if index == META_INDEX => {
                    truncated = u64::from(n);
                    (self.names.fields_truncated, FieldValue::U64(u64::from(n)))
                }
                RawValue::Truncated(_) => continue,
                RawValue::I64(v) => (field_name(&callsite.fields, index), FieldValue::I64(v)),
                RawValue::U64(v) => (field_name(&callsite.fields, index), FieldValue::U64(v)),
                RawValue::F64(v) => (field_name(&callsite.fields, index), FieldValue::F64(v)),
                RawValue::Bool(v) => (field_name(&callsite.fields, index), FieldValue::Bool(v)),
                RawValue::Str(s) => (field_name(&callsite.fields, index), FieldValue::Str(self.out.string(s))),
            };
            if name == NameId(0) {
                continue;
            }
            set_field(out, from, TraceField { name, value });
        }
        if truncated > 0 {
            self.counts.fields_truncated += 1;
        }
        truncated
    }

    fn counter_track(&mut self, key: u64) -> (NameId, TrackId) {
        if let Some(c) = self.callsites.get(key) {
            if let Some(track) = c.counter_track {
                return (c.name, track);
            }
        }
        let name = self.callsite_name(key);
        let track = match self.counter_tracks.get(&name) {
            Some(&track) => track,
            None => {
                let label = self.out.name_of(name).to_owned();
                let track = self.out.new_counter_track(&label, "");
                self.counter_tracks.insert(name, track);
                track
            }
        };
        if let Some(c) = self.callsites.get_mut(key) {
            c.counter_track = Some(track);
        }
        (name, track)
    }
}

/// Records looked through after a span's enter for its close: an `#[instrument]` function's few events fit.
const CLOSE_LOOKAHEAD: usize = 64;

/// Whether span `serial`'s close is among the first [`CLOSE_LOOKAHEAD`] records of `ahead` (a ring's next
/// records) and is marked [`VALUES_FINAL`](crate::codec::VALUES_FINAL). Only the first close the decoder accepts
/// counts ([`codec::is_close_of`](crate::codec::is_close_of)): a corrupt ring may close a span twice, and the
/// records between are processed before any later one.
fn closes_with_final_values(ahead: &[Record], serial: u64) -> bool {
    ahead
        .iter()
        .take(CLOSE_LOOKAHEAD)
        .find(|r| crate::codec::is_close_of(r, serial))
        .is_some_and(|close| close.aux() & crate::codec::VALUES_FINAL != 0)
}

fn field_name(names: &[NameId], index: u8) -> NameId {
    names.get(index as usize).copied().unwrap_or(NameId(0))
}

/// A new span's parent: the one it names, none, or (contextual) the span current on its thread when it was
/// created, the track's innermost open span slice.
fn creation_parent(track: &Track, parent: Parent) -> Option<u64> {
    match parent {
        Parent::Explicit(serial) => Some(serial),
        Parent::Root => None,
        Parent::Contextual => track.open.iter().rev().find_map(|o| match o.kind {
            OpenKind::Span(serial) => Some(serial),
            OpenKind::Scope(..) => None,
        }),
    }
}

#[cfg(test)]
mod lookahead_tests {
    use super::*;
    use crate::codec::{Kind, AT_LAST_EXIT, MAY_BE_TASK, VALUES_FINAL};

    #[test]
    fn a_spans_first_close_within_the_window_says_whether_its_values_are_final() {
        let close = |serial, aux| Record::head(Kind::SpanClose, aux, 0, serial);
        let other = Record::timed(Kind::SpanEnter, 5, 8);
        assert!(closes_with_final_values(
            &[other, close(7, AT_LAST_EXIT | VALUES_FINAL)],
            7
        ));
        assert!(closes_with_final_values(&[close(7, VALUES_FINAL)], 7));
        assert!(!closes_with_final_values(&[close(7, AT_LAST_EXIT)], 7), "not marked");
        assert!(
            !closes_with_final_values(&[close(8, VALUES_FINAL)], 7),
            "another span's"
        );
        assert!(
            !closes_with_final_values(&[close(7, 0), close(7, VALUES_FINAL)], 7),
            "only the first close counts"
        );
        // A close with a flag the decoder does not know is a framing error, not a close: the next one counts.
        assert!(!closes_with_final_values(&[close(7, 8 | VALUES_FINAL), close(7, 0)], 7));
        assert!(closes_with_final_values(&[close(7, 8), close(7, VALUES_FINAL)], 7));
        // A close saying the span may be a task says whether its values are final all the same.
        assert!(closes_with_final_values(&[close(7, MAY_BE_TASK | VALUES_FINAL)], 7));
        // A data record whose words look like a marked close of the span is not a close.
        let data = Record::data(1, (Kind::SpanClose as u64) << 12 | VALUES_FINAL, 7);
        assert!(!closes_with_final_values(&[data], 7));
        // Beyond the window: not looked at.
        let mut far = vec![other; CLOSE_LOOKAHEAD];
        far.push(close(7, VALUES_FINAL));
        assert!(!closes_with_final_values(&far, 7));
        far.remove(0);
        assert!(closes_with_final_values(&far, 7));
    }
}
