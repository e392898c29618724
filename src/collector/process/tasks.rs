//! Async task tracks: which spans get one, where it goes, what it shows, and whether a span's first poll
//! gets its flow.
//!
//! A span becomes a task when it is entered a second time or on a second thread (`AsyncTasks::Auto`), or
//! at its creation (`Always`). Its track nests under its parent's task track (a parent without one gets
//! one: a span with child tasks holds them), and is written once no poll of it can still come: its lifetime
//! as one slice, its polls as children on lanes, each ending the flow from the poll's slice on a thread
//! track.
//!
//! The first poll is the hard case. When it ends, the span may still turn out synchronous (closed next: no
//! flow, so the trace is exactly as without tasks) or a task (entered again: the flow stays). So its end
//! carries a flow on speculation, decided at the ring's next record (`decide_flow`); when that record is
//! not the span's, the end waits undecided at the head of its track's held queue (`park`,
//! `mark_undecided`) until the span closes or is entered again (`release_decided`, `release`). See
//! *Async tasks* in the module docs.

use super::slices::held_at;
use super::{losses, EventSlot, HeldEvent, Processor, Track};
use crate::codec::Item;
use crate::collector::spans::{TaskData, TaskPlace};
use crate::export::{EventKind, FieldValue, TraceField, TrackId, TrackKind};

/// Ancestors followed up from a span when its task track is placed (deeper nesting goes under the process).
const MAX_TASK_DEPTH: usize = 64;
/// Deepest a task track nests under the process track. Perfetto's importer drops a track with more than 100
/// ancestors, and everything on it; a task deeper than this goes beside its parent task (under the
/// grandparent), so a chain of any length keeps every track, the deepest tasks side by side.
const MAX_TASK_TRACK_DEPTH: u32 = 64;
/// Bytes of a task track's name (its span's name and creation values), beyond which it is cut.
const MAX_TASK_NAME: usize = 80;
/// Written tasks whose tracks are remembered for children that outlive them.
pub(super) const WRITTEN_TASKS_KEPT: usize = 1 << 16;

/// How far before the oldest span still known a loss is kept: a span whose creation record has not been
/// processed yet (its ring is behind) may be older than every span known.
const LOSS_HORIZON_MARGIN_NS: u64 = 10_000_000_000;

impl Processor {
    /// Notes that `dropped` records were lost on some thread within `from..=to`, for the task lifetimes
    /// around it. Memory stays bounded: losses older than every span that may still become a task are
    /// forgotten, and past that neighbouring windows merge (marking more lifetimes, never fewer).
    pub(super) fn note_loss(&mut self, from: u64, to: u64, dropped: u64) {
        if self.async_tasks == super::AsyncTasks::Never {
            return;
        }
        self.losses.note(from, to, dropped);
        if self.losses.len() > losses::LOSS_WINDOWS_MAX {
            let oldest = self.spans.oldest_created_ns().unwrap_or(to);
            self.losses.forget_before(oldest.saturating_sub(LOSS_HORIZON_MARGIN_NS));
            if self.losses.len() > losses::LOSS_WINDOWS_MAX / 2 {
                self.losses.coarsen();
            }
        }
    }

    /// Gives span `serial` an async task track (if it has none), under its parent's (a parent that has none
    /// gets one too: a span with child tasks holds them); returns the track.
    pub(super) fn make_task(&mut self, serial: u64) -> Option<TrackId> {
        // The chain of spans without a track, innermost first, up to one that has a track (or none).
        let mut chain = Vec::new();
        let mut at = serial;
        let process = self.out.process_track();
        let mut parent = TaskPlace {
            track: process,
            depth: 0,
            parent: process,
        };
        while at != 0 && chain.len() < MAX_TASK_DEPTH {
            if let Some(&place) = self.written_tasks.get(&at) {
                parent = place;
                break;
            }
            let Some(span) = self.spans.get(at) else { break };
            if let Some(task) = &span.task {
                parent = task.place;
                break;
            }
            chain.push(at);
            at = span.parent;
        }
        let mut track = None;
        for &s in chain.iter().rev() {
            let name = self.task_name(s);
            // As deep as a track may go: beside its parent task instead of under it.
            let (under, depth) = if parent.depth >= MAX_TASK_TRACK_DEPTH {
                (parent.parent, parent.depth)
            } else {
                (parent.track, parent.depth + 1)
            };
            let t = self.out.new_track(Some(under), TrackKind::AsyncTask { name });
            let place = TaskPlace {
                track: t,
                depth,
                parent: under,
            };
            if let Some(span) = self.spans.get_mut(s) {
                // Its first poll, kept in case it became a task, is now the task's.
                let first = (span.first_poll.end_ns != 0).then_some(span.first_poll);
                span.task = Some(Box::new(TaskData {
                    place,
                    polls: first.into_iter().collect(),
                    begun: None,
                    lanes: vec![(t, 0)],
                    written: false,
                    last_poll: span.first_poll.end_ns,
                }));
            }
            self.spans.closed_task(s);
            parent = place;
            track = Some(t);
        }
        track.or_else(|| {
            self.spans
                .get(serial)
                .and_then(|s| s.task.as_ref())
                .map(|t| t.place.track)
        })
    }

    /// A task track's name: the span's name and its creation values.
    fn task_name(&self, serial: u64) -> String {
        let Some(span) = self.spans.get(serial) else {
            return String::new();
        };
        let mut name = self.out.name_of(span.name).to_owned();
        // tickline's own fields (`tickline.flow_out`, ...) say nothing of which task it is.
        for field in span
            .creation_values()
            .iter()
            .filter(|f| !self.out.name_of(f.name).starts_with("tickline."))
        {
            if name.len() >= MAX_TASK_NAME {
                break;
            }
            name.push(' ');
            name.push_str(self.out.name_of(field.name));
            name.push('=');
            match &field.value {
                FieldValue::Str(s) => name.push_str(s),
                FieldValue::I64(v) => name.push_str(&v.to_string()),
                FieldValue::U64(v) => name.push_str(&v.to_string()),
                FieldValue::F64(v) => name.push_str(&v.to_string()),
                FieldValue::Bool(v) => name.push_str(&v.to_string()),
            }
        }
        if name.len() > MAX_TASK_NAME {
            let mut cut = MAX_TASK_NAME;
            while !name.is_char_boundary(cut) {
                cut -= 1;
            }
            name.truncate(cut);
            name.push('…');
        }
        name
    }

    /// Writes task `serial`'s track: one slice for its life (creation to close; to `end_ns`, marked
    /// truncated, when it never closed) with its values at the end, and its polls as children, each the end
    /// of the flow from its slice on a thread track. Polls that overlap (a span entered on two threads at
    /// once) go on child lanes.
    pub(super) fn write_task(&mut self, serial: u64, end_ns: u64) {
        let Some(span) = self.spans.get(serial) else { return };
        let Some(task) = span.task.as_ref() else { return };
        if task.written {
            return;
        }
        let closed = span.is_closed();
        let last_end = task.polls.iter().map(|p| p.end_ns).max().unwrap_or(0);
        // Still open at the end: ended then, unless a record may have been dropped after its last poll, on any
        // thread (its close may have been one of them): then at its last poll, the last moment it is known to
        // have lived. Marked truncated either way, and never past its real end.
        let open_until = if self.losses.latest_ns() > task.last_poll {
            task.last_poll
        } else {
            end_ns
        };
        let end = if closed { span.closed_ns } else { open_until }
            .max(last_end)
            .max(span.created_ns);
        // Records dropped on any thread while it lived may have been its polls or its values.
        let first_poll = (span.first_poll.end_ns != 0).then_some(span.first_poll.begin_ns);
        let begin = span.created_ns.min(first_poll.unwrap_or(u64::MAX));
        let dropped_inside = self.losses.dropped_within(begin, end);
        let begun = task.begun.is_some();
        self.write_task_begin(serial, end);
        self.write_task_polls(serial);
        let Some(span) = self.spans.get_mut(serial) else { return };
        let name = span.name;
        let mut fields = Vec::new();
        span.values_at(end, &mut fields);
        let Some(task) = span.task.as_mut() else { return };
        task.written = true;
        let place = task.place;
        let track = place.track;
        let mut end_fields = if begun {
            // Its begin went out early with the values of then: the end carries what changed since.
            let sent = task.begun.take().unwrap_or_default();
            fields.retain(|f| !sent.contains(f));
            fields
        } else {
            Vec::new()
        };
        if !closed {
            self.counts.truncated_slices += 1;
            end_fields.push(TraceField {
                name: self.names.truncated,
                value: FieldValue::Bool(true),
            });
        }
        if dropped_inside > 0 {
            end_fields.push(TraceField {
                name: self.names.dropped_inside,
                value: FieldValue::U64(dropped_inside),
            });
        }
        self.out
            .push_event_owned(end, track, EventKind::SliceEnd, name, &mut end_fields);
        self.tasks_written += 1;
        self.written_tasks.insert(serial, place);
        self.written_order.push_back(serial);
        if self.written_order.len() > WRITTEN_TASKS_KEPT {
            if let Some(old) = self.written_order.pop_front() {
                self.written_tasks.remove(&old);
            }
        }
    }

    /// Writes task `serial`'s lifetime begin (at its creation, or its first poll if earlier) with its values
    /// as of `values_ns`, unless it was written already.
    pub(super) fn write_task_begin(&mut self, serial: u64, values_ns: u64) {
        let Some(span) = self.spans.get_mut(serial) else { return };
        let Some(task) = span.task.as_ref() else { return };
        if task.begun.is_some() {
            return;
        }
        let first_begin = task.polls.iter().map(|p| p.begin_ns).min().unwrap_or(u64::MAX);
        let begin = span.created_ns.min(first_begin);
        let mut fields = Vec::new();
        span.values_at(values_ns, &mut fields);
        let (name, track) = (span.name, task.place.track);
        if let Some(task) = span.task.as_mut() {
            task.begun = Some(fields.clone());
        }
        let lifetime = self
            .out
            .push_event_owned(begin, track, EventKind::SliceBegin, name, &mut fields);
        lifetime.flow_out = None;
    }

    /// Writes task `serial`'s buffered polls (its lifetime begin must be out): each a `poll` slice whose end
    /// ends the flow from its slice on a thread track, on the first lane free at its start.
    pub(super) fn write_task_polls(&mut self, serial: u64) {
        let poll_name = *self.task_names.get_or_insert_with(|| self.out.intern("poll"));
        let Some(span) = self.spans.get_mut(serial) else { return };
        let name = span.name;
        let Some(task) = span.task.as_mut() else { return };
        let mut polls = std::mem::take(&mut task.polls);
        let mut lanes = std::mem::take(&mut task.lanes);
        polls.sort_by_key(|p| (p.begin_ns, p.end_ns));
        for poll in &polls {
            let lane = match lanes.iter().position(|&(_, busy_until)| busy_until <= poll.begin_ns) {
                Some(lane) => lane,
                None => {
                    let lane_name = format!("{} (polls {})", self.out.name_of(name), lanes.len() + 1);
                    let t = self
                        .out
                        .new_track(Some(lanes[0].0), TrackKind::AsyncTask { name: lane_name });
                    lanes.push((t, 0));
                    lanes.len() - 1
                }
            };
            lanes[lane].1 = poll.end_ns;
            let lane_track = lanes[lane].0;
            self.out.push_event_owned(
                poll.begin_ns,
                lane_track,
                EventKind::SliceBegin,
                poll_name,
                &mut Vec::new(),
            );
            let mut end_fields = Vec::new();
            if !self.truncated_polls.is_empty() {
                if let Some(k) = self.truncated_polls.iter().position(|&p| p == (serial, poll.begin_ns)) {
                    // Its thread slice was cut short: so is this copy, marked and counted the same way.
                    self.truncated_polls.swap_remove(k);
                    self.counts.truncated_slices += 1;
                    end_fields.push(TraceField {
                        name: self.names.truncated,
                        value: FieldValue::Bool(true),
                    });
                }
            }
            // The flow ends on the poll's end, at the time its thread slice (which starts it) ends: Perfetto's
            // importer reads events in time order, and takes the first of two slices that began together
            // (they did) for the flow's start, so the thread slice's end, written earlier, must not come later.
            let end_event =
                self.out
                    .push_event_owned(poll.end_ns, lane_track, EventKind::SliceEnd, poll_name, &mut end_fields);
            end_event.flow_in = (poll.flow != 0).then_some(poll.flow);
        }
        self.polls_written += polls.len() as u64;
        polls.clear();
        if let Some(task) = self.spans.get_mut(serial).and_then(|s| s.task.as_mut()) {
            task.polls = polls;
            task.lanes = lanes;
        }
    }

    /// Marks the held first-poll end `seq` of span `serial` undecided (it holds its track); returns `seq`.
    pub(super) fn mark_undecided(&mut self, track: &mut Track, serial: u64, seq: u64) -> Option<u64> {
        let event = held_at(track, seq)?;
        if event.undecided.is_none() {
            event.undecided = Some(serial);
            if let Some(span) = self.spans.get_mut(serial) {
                // Kept while the decision waits.
                span.held_begins += 1;
            }
        }
        Some(seq)
    }

    /// Moves the first-poll end at batch position `index` (the batch's last event, the track holding nothing)
    /// to the track's held queue, undecided; returns its place there.
    pub(super) fn park(&mut self, track: &mut Track, serial: u64, index: usize) -> Option<u64> {
        if !track.held.is_empty() {
            return None;
        }
        let (event, fields) = self.out.take_last_event(index)?;
        track.held.push_back(HeldEvent {
            ts_ns: event.ts_ns,
            kind: event.kind,
            name: event.name,
            fields,
            flow_out: event.flow_out,
            span: None,
            undecided: Some(serial),
            late: None,
        });
        if let Some(span) = self.spans.get_mut(serial) {
            // Kept while the decision waits.
            span.held_begins += 1;
        }
        Some(track.held_base)
    }

    /// Takes the flow off an event emitted earlier in this pass (a speculative flow that turned out not to be
    /// needed).
    fn clear_flow(&mut self, track: &mut Track, slot: EventSlot) {
        match slot {
            EventSlot::Batch(index) => {
                if let Some(event) = self.out.batch.events.get_mut(index) {
                    event.flow_out = None;
                }
            }
            EventSlot::Held(seq) => {
                if let Some(event) = held_at(track, seq) {
                    event.flow_out = None;
                }
            }
        }
    }

    /// A span's first poll ended while it was open, so it got a flow in case it is a task; `next` is the
    /// ring's next record. If it is the span's close, the span is synchronous: no flow. Otherwise the poll's
    /// end waits on the track, undecided, until the span closes or is entered again (see `release`).
    #[cold]
    pub(super) fn decide_flow(&mut self, track: &mut Track, serial: u64, slot: EventSlot, next: &Item<'_>) {
        // Its close, saying it was entered only once: synchronous. A close saying it may be a task leaves it
        // undecided: another thread's enter may be on a ring processed later.
        let closes = matches!(next, Item::SpanClose { serial: closed, may_be_task: false, .. } if *closed == serial);
        match slot {
            EventSlot::Held(seq) => {
                let Some(event) = held_at(track, seq) else { return };
                let was_undecided = event.undecided.is_some();
                if closes {
                    event.flow_out = None;
                    event.undecided = None;
                    if let Some(span) = self.spans.get_mut(serial) {
                        span.first_poll.flow = 0;
                        if was_undecided {
                            span.held_begins = span.held_begins.saturating_sub(1);
                        }
                    }
                    // Decided: if it headed the queue, it and what waited behind it go out now, as
                    // `release_decided` does for an undecided end (it no longer sees this one as undecided).
                    // Left held, it would hold every later event on the track until the pass's end, and keep
                    // the track's leaf spans off their fast path for that long.
                    if seq == track.held_base {
                        self.release(track, super::Release::Ready, track.last_ns);
                    }
                } else {
                    self.mark_undecided(track, serial, seq);
                }
            }
            EventSlot::Batch(index) => {
                if closes {
                    self.clear_flow(track, slot);
                    if let Some(span) = self.spans.get_mut(serial) {
                        span.first_poll.flow = 0;
                    }
                } else {
                    // Out of reach if the track has events after it: then the flow stays (with one end
                    // only, if the span turns out synchronous; Perfetto draws nothing for it).
                    self.park(track, serial, index);
                }
            }
        }
    }

    /// Span `serial` was just closed or made a task: if its first poll's end heads `track`'s held queue,
    /// undecided, it is decided now, and what waited behind it goes out without waiting for the pass's end.
    #[inline]
    pub(super) fn release_decided(&mut self, track: &mut Track, serial: u64, now_ns: u64) {
        if track.held.front().is_some_and(|e| e.undecided == Some(serial)) {
            self.release(track, super::Release::Ready, now_ns);
        }
    }
}
