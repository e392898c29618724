//! The processing stage: the input log in, the timeline out. A function of the log alone (see the
//! collector's `input.rs`), so the same code runs live, behind the drain stage, and when a raw capture is
//! converted later.
//!
//! # Order and identity
//!
//! Each ring's records are processed in the order they were written: span creation, `record`, enter, exit
//! and close interleave as they happened. A record that names a span created on another thread whose
//! creation has not been processed yet stalls its ring until it is (the creation was pushed before the
//! record, so it is in the same drain pass or the next), then processing resumes where it stopped. Spans are
//! known by their serial (see [`TicklineLayer`](crate::TicklineLayer)), never by `tracing`'s reusable id.
//!
//! # Fields at the end of a slice
//!
//! A slice shows the values its span had when the slice ended. A span slice's begin is therefore *held*,
//! with everything after it on the same thread track (which must follow it in order), until the slice has
//! ended and one more drain pass has been processed (so values recorded on other threads before the end
//! have arrived), then the span's values as of the end go on the begin and the held events go out. A slice
//! still open after [`HOLD_LIMIT_NS`] (or a flush) is released with the values it has then; values changed
//! later go on its end event, which waits a pass after the end in the same way. Nothing cuts that pass short
//! but the timeline's end: not the hold limit, not the end of the slice's thread (its track goes a pass
//! later), not a flush. A flush drains twice; a slice that ended in the second pass ended after the flush
//! was called, and its begin and what it holds go out with the flush, its end (with the values that came
//! late) a pass later. A span whose close says no `record` reached it (`codec::VALUES_FINAL`, which
//! the layer sets: most spans, `#[instrument]`'s included) has its creation values for good: its ended
//! slices go out at its close, without the pass, and a slice whose enter sees that close a few records on in
//! its chunk is not held at all (its begin goes out with the values, and what it contains straight after).
//!
//! # Async tasks
//!
//! A span entered a second time, or on a second thread (with [`AsyncTasks::Auto`]; every span with
//! `Always`), gets a task track under its parent's task track (or the process): its lifetime, creation (stamped
//! by `SpanNew`) to close, as one slice, and each poll (an enter to its exit that is not nested in another
//! enter of the span on the same thread) as a `poll` child ending a flow from the poll's slice on the thread
//! track. Polls are buffered per task and written a few passes after the close (or as they come once a task
//! has [`MAX_BUFFERED_POLLS`]). Whether a span's *first* poll needs its flow is known only at the span's next
//! record after that poll: its close (synchronous: no flow, the trace exactly as without tasks) or another
//! enter (a task). Until then that poll's end waits at the head of its thread track's held queue (as a span
//! begin waits for its values), released at once when the decision comes on the same thread, otherwise at the
//! pass's end, and after [`HOLD_LIMIT_NS`] at the latest, with its flow (a span kept open that long after its
//! only poll may then show a flow with one end, which Perfetto ignores).
//!
//! # Leaf spans
//!
//! Most spans are leaves: created, entered, exited and closed with nothing recorded on their thread in
//! between (`info_span!(..).entered()` around code that records nothing itself). Their four records, one after
//! another in a chunk, are processed at once (`Processor::leaf_span`, recognized by `codec::LeafSpan`): the
//! same events, span-table entry and counts as the records one by one, with one span-table access instead of
//! four and no per-record dispatch. A leaf span with fields (a creation group with values, then its enter, exit
//! and close: `#[instrument]`'s spans) is processed at once too (`Processor::leaf_span_with_fields`): with
//! final values and nothing held before it, its begin and end go straight into the batch; otherwise its begin
//! waits in the held queue for its values, with its end already known. Anything the general path would
//! treat differently (held events for a field-less leaf, undated creations, `AsyncTasks::Always`, ...) takes
//! the general path. A differential property test holds the two to the same output.
//!
//! # Losses
//!
//! A `Gap` record (records dropped right there) becomes an instant named `tickline: records dropped` with the
//! count, and every slice open around it carries `tickline.dropped_inside`. A slice that cannot end where
//! the program ended it (its thread exited with it open, the timeline shut down inside it) ends at the last
//! time known and carries `tickline.truncated = true`; it is counted in
//! [`TimelineStats::truncated_slices`](crate::TimelineStats::truncated_slices). No slice is ever ended by an
//! unrelated end, and none lasts longer than it did.
//!
//! # Where the code is
//!
//! - `mod.rs` (this file): the types, the inputs, drain passes and ring processing, reporting, export and
//!   shutdown.
//! - `records.rs`: one record of a ring (`Processor::item`), a leaf span's records at once
//!   (`Processor::leaf_span`, `Processor::leaf_span_with_fields`), with the decoding they need: ticks to time,
//!   callsite names, field payloads.
//! - `slices.rs`: slices on thread tracks and the held queue: nesting, fields at the end, truncation.
//! - `tasks.rs`: async task tracks, and whether a span's first poll gets its flow.
//! - `tests.rs`: the unit tests.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::drain::{Budget, ChunkPool};
use super::input::{CallsiteDef, Chunk, Input};
use super::output::Output;
use super::process_gpu::GpuCollector;
use super::spans::{IdMap, Spans, TaskPlace};
use super::stats::SharedStats;
use super::AsyncTasks;
use crate::calibration::{CalibrationHistory, ClockDomain, HistoryConfig};
use crate::clock::{FastConverter, TickSource};
use crate::codec::{Decoder, Item, LeafSpan, LeafTail};
use crate::export::{CpuClock, EventKind, FieldValue, NameId, TraceField, TrackId, TrackKind};
use crate::gpu::GpuCalibrationConfig;

mod losses;
mod records;
mod slices;
mod tasks;

/// Longest a span slice's begin (and what follows it on its track) is held for its final field values.
pub(crate) const HOLD_LIMIT_NS: u64 = 200_000_000;
/// Most events held on one track; beyond, the track is released as if the hold limit had passed.
const HOLD_MAX_EVENTS: usize = 1 << 16;
/// Passes a record waits for the creation of the span it names before that span counts as unknown.
const MAX_WAIT_PASSES: u32 = 2;

/// Events a batch may gather within a pass before it goes to the exporters: a busy thread's pass makes tens of
/// thousands, and a batch that size (about 80 bytes an event) no longer fits in the L2 cache between being
/// made and being encoded. Handed over between records, where no event of the batch is still referred to by
/// its place (a poll's end that its span's close may take back: `Track::speculative`).
const EXPORT_MID_PASS_EVENTS: usize = 1024;

/// How the processing stage converts CPU ticks.
pub(crate) enum CpuTime {
    /// Live: the newest fit, extrapolated forwards from the newest calibration point.
    Live {
        source: TickSource,
        history: CalibrationHistory,
        fast: Option<Box<FastConverter>>,
    },
    /// Converting a capture: the whole history is known, so every tick is placed between calibration points
    /// on both sides.
    Complete { history: CalibrationHistory },
}

impl CpuTime {
    fn to_ns(&self, ticks: u64) -> Option<u64> {
        match self {
            CpuTime::Live { fast, .. } => fast.as_ref().map(|f| f.to_ns(ticks)),
            CpuTime::Complete { history } => history.peek(ticks).map(|c| c.ns),
        }
    }

    /// Converts `ticks` and widens `stated` to cover it: live, the ticks converted (the newest fit's
    /// uncertainty is largest at one end of any range of ticks: see [`CpuUncertainty`]); converting a
    /// capture, the placement's own uncertainty.
    #[inline]
    fn convert_noting(&self, ticks: u64, stated: &mut CpuUncertainty) -> Option<u64> {
        match self {
            CpuTime::Live { fast, .. } => {
                let ns = fast.as_ref().map(|f| f.to_ns(ticks))?;
                stated.ticks = Some(
                    stated
                        .ticks
                        .map_or((ticks, ticks), |(lo, hi)| (lo.min(ticks), hi.max(ticks))),
                );
                Some(ns)
            }
            CpuTime::Complete { history } => {
                let converted = history.peek(ticks)?;
                stated.known(converted.uncertainty_ns);
                Some(converted.ns)
            }
        }
    }

    /// Live: states the ticks noted so far with the newest fit (the one they were converted with), before a
    /// burst replaces it.
    fn settle(&self, stated: &mut CpuUncertainty) {
        if let (CpuTime::Live { history, .. }, Some((lo, hi))) = (self, stated.ticks) {
            if let Some(fit) = history.latest() {
                stated.ticks = None;
                stated.known(fit.uncertainty_ns(lo).max(fit.uncertainty_ns(hi)).ceil() as u64);
            }
        }
    }

    /// The uncertainty (about 95 %) of every CPU timestamp converted since `stated` was last taken, in ns.
    fn stated_uncertainty(&self, stated: &mut CpuUncertainty) -> Option<u64> {
        self.settle(stated);
        std::mem::take(stated).known_ns
    }

    fn history(&self) -> &CalibrationHistory {
        match self {
            CpuTime::Live { history, .. } | CpuTime::Complete { history } => history,
        }
    }
}

/// What the CPU timestamps converted since the last report need to be covered by a statement of their
/// uncertainty. Live, every tick is converted with the newest fit, whose uncertainty (two standard errors of
/// the line, which grow with the distance from its anchor, and the wander and the rate miss beyond its window,
/// all convex in the tick) is largest at one end of any range of ticks: the lowest and highest ticks converted
/// are enough.
#[derive(Default)]
struct CpuUncertainty {
    /// Live: the lowest and highest ticks converted with the newest fit.
    ticks: Option<(u64, u64)>,
    /// The largest uncertainty already known: a converted capture's placements, or ticks converted with a fit
    /// a burst has since replaced.
    known_ns: Option<u64>,
}

impl CpuUncertainty {
    fn known(&mut self, ns: u64) {
        self.known_ns = Some(self.known_ns.map_or(ns, |known| known.max(ns)));
    }
}

/// What the processing stage knows about a call site.
struct CallsiteInfo {
    name: NameId,
    fields: Vec<NameId>,
    counter_track: Option<TrackId>,
}

/// Every known call site by key. The last one looked up is remembered: a loop's events come from one call
/// site, and each event needs its call site twice (its name, its fields' names), so most lookups are a compare
/// instead of a hash probe. Call sites are never replaced once known.
#[derive(Default)]
struct Callsites {
    index: IdMap<u32>,
    infos: Vec<CallsiteInfo>,
    /// The last key looked up and its index in `infos`.
    last: Option<(u64, u32)>,
}

impl Callsites {
    fn contains(&self, key: u64) -> bool {
        self.index.contains_key(&key)
    }

    /// Adds call site `key` (the caller checked it is new).
    fn insert(&mut self, key: u64, info: CallsiteInfo) {
        self.index.insert(key, self.infos.len() as u32);
        self.infos.push(info);
    }

    #[inline]
    fn slot(&mut self, key: u64) -> Option<usize> {
        match self.last {
            Some((last, slot)) if last == key => Some(slot as usize),
            _ => {
                let slot = *self.index.get(&key)?;
                self.last = Some((key, slot));
                Some(slot as usize)
            }
        }
    }

    #[inline]
    fn get(&mut self, key: u64) -> Option<&CallsiteInfo> {
        let slot = self.slot(key)?;
        self.infos.get(slot)
    }

    fn get_mut(&mut self, key: u64) -> Option<&mut CallsiteInfo> {
        let slot = self.slot(key)?;
        self.infos.get_mut(slot)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum OpenKind {
    Span(u64),
    /// A native scope: its callsite and tag (its begin's number on the ring, so that guards of one callsite
    /// dropped out of order each end their own slice). A `u16`: the enum stays two words, and `OpenSlice` one
    /// cache line.
    Scope(u64, u16),
}

/// A slice open on a thread track.
struct OpenSlice {
    kind: OpenKind,
    name: NameId,
    /// When it began (reference ns): a span slice's poll.
    begin_ns: u64,
    /// The sequence number of its begin in the track's held queue, while it is held.
    held: Option<u64>,
    /// The values its begin carried when it was released before the slice ended (rare: boxed, so the
    /// struct every enter pushes stays one cache line).
    #[allow(
        clippy::box_collection,
        reason = "one pointer, not a Vec's three words, in the struct every enter pushes"
    )]
    released_values: Option<Box<Vec<TraceField>>>,
    /// Records dropped while it was open.
    dropped_inside: u64,
}

// Every enter pushes one: a cache line.
const _: () = assert!(std::mem::size_of::<OpenSlice>() <= 64);

/// Polls a task keeps before its track is written as it goes (a span polled for the whole run stays bounded).
const MAX_BUFFERED_POLLS: usize = 4096;

/// Where an emitted event went: the batch (index) or the track's held queue (sequence number).
#[derive(Clone, Copy, Debug)]
enum EventSlot {
    Batch(usize),
    Held(u64),
}

/// A span slice's begin, held for its values.
struct HeldSpan {
    serial: u64,
    /// `(end ns, pass its end was processed in)` once the slice ended.
    end: Option<(u64, u64)>,
    /// Where the slice's end waits in the held queue, once it ended.
    end_seq: Option<u64>,
}

/// A slice end whose begin a flush sent out before values recorded on other threads before the end could
/// have come: it waits a pass, then carries the values that differ from what the begin showed.
struct LateValues {
    serial: u64,
    end_ns: u64,
    /// The pass its end was processed in.
    end_pass: u64,
    /// The values its begin went out with.
    released: Vec<TraceField>,
}

/// How far [`Processor::release`] sends out a track's held events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Release {
    /// What the holds allow: span begins ended before this pass (or with final values), decided first polls.
    Ready,
    /// Also slices still open, with their values now (the hold limit passed). A slice that ended in this pass
    /// still waits for it: one pass, however long it was open.
    Open,
    /// A flush: slices still open too, and a slice that ended in the flush's last drain pass (after the flush
    /// was called: see `drain.rs`) up to its end, which waits a pass for values recorded elsewhere before it.
    Flush,
    /// Everything: nothing can come later.
    All,
}

struct HeldEvent {
    ts_ns: u64,
    kind: EventKind,
    name: NameId,
    fields: Vec<TraceField>,
    flow_out: Option<u64>,
    span: Option<HeldSpan>,
    /// The end of the first poll of this span, which was still open after it: its flow stays only if the
    /// span turns out to be an async task (entered again), and goes if it closes first. Undecided, it holds
    /// its track (up to the hold limit, after which the flow stays).
    undecided: Option<u64>,
    /// A slice end waiting for values that came late (see [`LateValues`]).
    late: Option<Box<LateValues>>,
}

/// A thread track's state.
struct Track {
    id: TrackId,
    /// This ring's number: the top bits of the serials of spans created on it.
    ring: u32,
    /// Spans created on this ring so far: the low bits of the next one's serial.
    spans_created: u64,
    /// Spans created since the last timed record: their creation time is the next timed record's.
    undated: Vec<u64>,
    open: Vec<OpenSlice>,
    held: VecDeque<HeldEvent>,
    /// Sequence number of `held[0]`.
    held_base: u64,
    last_ns: u64,
    /// The last exit: `(serial, ns)`, for a close right after it.
    last_exit: Option<(u64, u64)>,
    /// Records dropped on this ring that the trace shows so far (its `Gap` records, and the drops after its
    /// last record, shown when it ends).
    losses_shown: u64,
    /// A span's first poll just ended with a flow in case the span is a task: `(serial, its end event)`.
    /// Taken off again if the next record is the span's close.
    speculative: Option<(u64, EventSlot)>,
}

/// A ring's records waiting to be processed.
struct RingInput {
    pending: VecDeque<Chunk>,
    /// Records of `pending[0]` already processed.
    cursor: usize,
    /// Passes the ring has been stalled on its current record.
    stalled_passes: u32,
    /// The thread exited and its ring was drained to the end.
    ended: bool,
    /// The pass in which the ended ring was first found processed to its end, while its track still held
    /// events (it goes in a later pass).
    ended_in: Option<u64>,
}

struct Ring {
    input: RingInput,
    track: Track,
    dropped_total: u64,
}

/// Names the processing stage uses for what it adds.
struct OwnNames {
    unknown_span: NameId,
    unknown_callsite: NameId,
    gap: NameId,
    records: NameId,
    truncated: NameId,
    fields_truncated: NameId,
    dropped_inside: NameId,
    split: NameId,
    clock: NameId,
    clock_decision: NameId,
    clock_fallback: NameId,
    clock_doubt: NameId,
}

/// Counter tracks of the timeline's own state.
struct OwnTracks {
    dropped: TrackId,
    truncated: TrackId,
    buffered: TrackId,
    cpu_drift: TrackId,
    cpu_error: TrackId,
    /// The uncertainty of the CPU timestamps converted (see [`Processor::report`]).
    cpu_uncertainty: TrackId,
    /// 0: the hardware counter; 1: CLOCK_MONOTONIC instead (a fallback); 2: the hardware counter, found
    /// unreliable after the start.
    cpu_clock: TrackId,
}

/// Counts that end up in [`crate::TimelineStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Counts {
    truncated_slices: u64,
    fields_truncated: u64,
    unmatched_ends: u64,
    unknown_spans: u64,
    unknown_callsites: u64,
    framing_errors: u64,
    monotonic_clamps: u64,
    gap_markers: u64,
}

/// Where processed chunk memory goes back to (live only).
pub(crate) struct Recycler {
    pub(crate) pool: Arc<ChunkPool>,
    pub(crate) budget: Arc<Budget>,
}

/// The processing stage. Feed it the input log with [`input`](Self::input).
pub(crate) struct Processor {
    out: Output,
    callsites: Callsites,
    /// Native counters' tracks by name: `counter!` with one name at several call sites sets one track.
    counter_tracks: HashMap<NameId, TrackId>,
    /// The last span callsite looked up, its name and whether it declares no fields (a loop creates one
    /// span after another from the same callsite; callsites are never replaced once known).
    last_span_callsite: Option<(u64, NameId, bool)>,
    /// The record being processed is a span's exit and the next record in its ring is that span's close: the
    /// span is synchronous, its poll needs no speculative flow (see `tasks.rs`).
    exit_before_close: bool,
    /// Leaf spans take their fast path ([`LeafSpan`]); off only to test it against the general one.
    leaf_spans: bool,
    /// Events a batch gathers within a pass before it is handed over ([`EXPORT_MID_PASS_EVENTS`]; other values
    /// only to test that a pass handed over in pieces makes the same trace).
    export_mid_pass_events: usize,
    /// Leaf spans that took the fast path (tests).
    #[cfg(test)]
    leaf_spans_taken: u64,
    #[cfg(test)]
    leaf_spans_with_fields_taken: u64,
    /// Rings by slot, in the order they were registered (taken out while one is processed).
    rings: Vec<Option<Ring>>,
    /// Ring number -> slot in `rings`: numbers come from the input, which a corrupt capture may fill with any
    /// value, so they never size anything.
    ring_slots: IdMap<u32>,
    /// Slots of the rings still live.
    active: Vec<u32>,
    /// Slots of finished rings, for the next rings registered: a program that starts and ends threads for
    /// hours keeps as many slots as it had threads at once (a slot is 248 bytes).
    free_slots: Vec<u32>,
    /// The last value written on the buffered-records counter track.
    buffered_shown: Option<u64>,
    spans: Spans,
    cpu: Option<CpuTime>,
    /// The CPU timestamps converted since the last report, for the uncertainty counter.
    cpu_converted: CpuUncertainty,
    /// The last value written on the CPU timestamp uncertainty counter.
    cpu_uncertainty_shown: Option<u64>,
    gpu: GpuCollector,
    /// Drain passes that drained every ring so far (a pass that did not counts with the one before it).
    pass: u64,
    /// The rings' records of the current pass are being processed (some rings' are not in yet).
    mid_pass: bool,
    /// Polls cut short (`(span serial, poll begin ns)`) not written to their task's track yet.
    truncated_polls: Vec<(u64, u64)>,
    counts: Counts,
    names: OwnNames,
    tracks: OwnTracks,
    payload: Vec<u8>,
    /// Released span begins' values, on their way into the batch (empty between releases).
    release_fields: Vec<TraceField>,
    /// Emptied field vectors of released events, for the next events held behind a span begin.
    spare_field_vecs: Vec<Vec<TraceField>>,
    scratch_fields: Vec<TraceField>,
    recycler: Option<Recycler>,
    stats: Arc<SharedStats>,
    last_export_ns: u64,
    last_drain_ns: u64,
    reported_dropped: u64,
    reported_truncated: u64,
    reported_fit_ns: u64,
    hold_limit_ns: u64,
    finished: bool,
    /// The newest CPU clock note not exported yet: `(fallback, doubt, text)`.
    clock_note: Option<(bool, bool, String)>,
    async_tasks: AsyncTasks,
    /// Task tracks of spans already written and forgotten, by serial: a child that outlives its parent still
    /// nests under it. The oldest are forgotten beyond
    /// [`WRITTEN_TASKS_KEPT`](tasks::WRITTEN_TASKS_KEPT).
    written_tasks: IdMap<TaskPlace>,
    written_order: VecDeque<u64>,
    /// `"poll"`, for the task tracks' poll slices.
    task_names: Option<NameId>,
    tasks_written: u64,
    /// Records the rings had dropped, in all (rings that ended included), as far as the chunks processed so far
    /// say: the dropped-records counter's value.
    drops_seen: u64,
    /// When records were dropped, on any thread, as far as the chunks processed so far tell (each window ends
    /// at the drain of the chunk whose ring's drop count rose), for the task lifetimes they may have cut into
    /// (kept only while spans may become tasks).
    losses: losses::LossLog,
    /// Polls written on task tracks.
    polls_written: u64,
    /// The timeline is shutting down: a span polled once and still open is not a task.
    ending: bool,
    to_write: Vec<u64>,
}

/// What happened to a record.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    Done,
    /// It names a span not known yet: try again later.
    Stall,
}

impl Processor {
    pub(crate) fn new(
        out: Output,
        gpu: GpuCalibrationConfig,
        recycler: Option<Recycler>,
        stats: Arc<SharedStats>,
    ) -> Self {
        let mut out = out;
        let names = OwnNames {
            unknown_span: out.intern("unknown span"),
            unknown_callsite: out.intern("unknown callsite"),
            gap: out.intern("tickline: records dropped"),
            records: out.intern("records"),
            truncated: out.intern("tickline.truncated"),
            fields_truncated: out.intern("tickline.fields_truncated"),
            dropped_inside: out.intern("tickline.dropped_inside"),
            split: out.intern("tickline.split"),
            clock: out.intern("tickline: CPU clock"),
            clock_decision: out.intern("decision"),
            clock_fallback: out.intern("fallback"),
            clock_doubt: out.intern("doubt"),
        };
        let tracks = OwnTracks {
            dropped: out.new_counter_track("tickline dropped records", "records"),
            truncated: out.new_counter_track("tickline truncated slices", "slices"),
            buffered: out.new_counter_track("tickline buffered records", "bytes"),
            cpu_drift: out.new_counter_track("tickline TSC drift", "ppm"),
            cpu_error: out.new_counter_track("tickline TSC error bound", "ns"),
            cpu_uncertainty: out.new_counter_track("tickline CPU timestamp uncertainty", "ns"),
            cpu_clock: out.new_counter_track("tickline CPU clock fallback", ""),
        };
        Processor {
            out,
            callsites: Callsites::default(),
            counter_tracks: HashMap::new(),
            last_span_callsite: None,
            exit_before_close: false,
            leaf_spans: true,
            export_mid_pass_events: EXPORT_MID_PASS_EVENTS,
            #[cfg(test)]
            leaf_spans_taken: 0,
            #[cfg(test)]
            leaf_spans_with_fields_taken: 0,
            rings: Vec::new(),
            ring_slots: IdMap::default(),
            free_slots: Vec::new(),
            buffered_shown: None,
            active: Vec::new(),
            spans: Spans::default(),
            cpu: None,
            cpu_converted: CpuUncertainty::default(),
            cpu_uncertainty_shown: None,
            gpu: GpuCollector::new(gpu),
            pass: 0,
            mid_pass: false,
            truncated_polls: Vec::new(),
            counts: Counts::default(),
            names,
            tracks,
            payload: Vec::new(),
            scratch_fields: Vec::new(),
            release_fields: Vec::new(),
            spare_field_vecs: Vec::new(),
            recycler,
            stats,
            last_export_ns: 0,
            last_drain_ns: 0,
            reported_dropped: 0,
            reported_truncated: 0,
            reported_fit_ns: 0,
            hold_limit_ns: HOLD_LIMIT_NS,
            finished: false,
            clock_note: None,
            async_tasks: AsyncTasks::default(),
            written_tasks: IdMap::default(),
            written_order: VecDeque::new(),
            task_names: None,
            tasks_written: 0,
            drops_seen: 0,
            losses: losses::LossLog::default(),
            polls_written: 0,
            ending: false,
            to_write: Vec::new(),
        }
    }

    /// Sets which spans get an async task track.
    pub(crate) fn set_async_tasks(&mut self, mode: AsyncTasks) {
        self.async_tasks = mode;
    }

    /// Sets how CPU ticks are converted: live (the newest fit) or from a complete history (a capture).
    pub(crate) fn set_cpu_clock(&mut self, cpu: CpuTime) {
        self.cpu = Some(cpu);
    }

    /// Starts the live CPU clock of `source` (its calibration samples come as inputs).
    pub(crate) fn live_cpu_clock(&mut self, source: TickSource, domain: ClockDomain, history: HistoryConfig) {
        self.cpu = Some(CpuTime::Live {
            source,
            history: CalibrationHistory::new(domain, history),
            fast: None,
        });
    }

    /// Whether the Shutdown input has been processed.
    pub(crate) fn is_finished(&self) -> bool {
        self.finished
    }

    /// Empties the batch being built (benches).
    pub(crate) fn clear_batch(&mut self) {
        self.out.clear_batch();
    }

    /// Ends `passes` drain passes after everything queued (benches): returns the events exported meanwhile.
    pub(crate) fn finish_passes_for_bench(&mut self, passes: u64, drain_ticks: u64) -> u64 {
        let before = self.stats.events.load(Ordering::Relaxed);
        let drain_ns = self.last_drain_ns.max(1_000_000_000) + 1;
        for k in 0..passes {
            self.input(Input::PassEnd {
                drain_ns: drain_ns + k,
                drain_ticks,
                buffered_bytes: 0,
                rings_drained: true,
            });
        }
        self.stats.events.load(Ordering::Relaxed) - before
    }

    /// Ends one drain pass at `drain_ns` (benches): returns the events exported by it.
    pub(crate) fn pass_end_for_bench(&mut self, drain_ns: u64, drain_ticks: u64) -> u64 {
        let before = self.stats.events.load(Ordering::Relaxed);
        self.input(Input::PassEnd {
            drain_ns,
            drain_ticks,
            buffered_bytes: 0,
            rings_drained: true,
        });
        self.stats.events.load(Ordering::Relaxed) - before
    }

    /// Processes what is queued and returns the batch, without releasing, reporting or exporting (benches): the
    /// whole batch, none of it handed over mid-pass.
    pub(crate) fn process_for_bench(&mut self) -> &crate::export::Batch {
        let drain = self.last_drain_ns;
        let pieces = std::mem::replace(&mut self.export_mid_pass_events, usize::MAX);
        self.process_rings(drain, false, true);
        self.export_mid_pass_events = pieces;
        &self.out.batch
    }

    /// Takes one input.
    pub(crate) fn input(&mut self, input: Input) {
        match input {
            Input::Thread { ring, tid, name } => self.add_ring(ring, tid, name),
            Input::Callsite(def) => self.add_callsite(def),
            Input::Chunk(chunk) => self.add_chunk(chunk),
            Input::ThreadEnd { ring } => {
                if let Some(Some(r)) = self.slot_of(ring).and_then(|slot| self.rings.get_mut(slot)) {
                    r.input.ended = true;
                }
            }
            Input::CpuCalibration(samples) => self.cpu_burst(&samples),
            Input::CpuClockNote { fallback, doubt, text } => self.clock_note = Some((fallback, doubt, text)),
            Input::Gpu(gpu) => self.gpu.input(&mut self.out, gpu),
            Input::PassEnd {
                drain_ns,
                buffered_bytes,
                rings_drained,
                ..
            } => {
                self.pass_end(drain_ns, rings_drained);
                // Only when it changed: a counter holds its value until the next, and an idle program's trace
                // must not grow by a value per pass (a thousand a second).
                if self.buffered_shown != Some(buffered_bytes) {
                    self.buffered_shown = Some(buffered_bytes);
                    let value = self.out.value_name();
                    self.out
                        .push_counter(self.tracks.buffered, drain_ns, value, buffered_bytes as f64);
                }
                self.export(drain_ns, false);
            }
            Input::Flush(reply) => {
                let drain_ns = self.last_drain_ns;
                // The flush's own drain passes came just before (their `PassEnd`s); nothing new was drained, so
                // this is no pass of its own: a slice that ended in the last of them ended after the flush was
                // called, and values recorded elsewhere before its end may come in the next pass.
                self.process_rings_again(drain_ns, true, false);
                self.finish_pass(Release::Flush, false);
                self.export(drain_ns, true);
                let result = self.out.flush_exporters(&self.stats, false);
                let _ = reply.send(result);
            }
            Input::Shutdown(reply) => {
                let result = self.shutdown();
                let _ = reply.send(result);
            }
        }
    }

    fn add_ring(&mut self, ring: u32, tid: u32, name: String) {
        let pid = self.out.pid();
        let parent = Some(self.out.process_track());
        let track = self.out.new_track(parent, TrackKind::Thread { pid, tid, name });
        // A ring registered twice (corrupt input) starts over in its slot.
        let slot = match self.slot_of(ring) {
            Some(slot) => slot,
            None => {
                let slot = self.free_slots.pop().map(|s| s as usize).unwrap_or_else(|| {
                    self.rings.push(None);
                    self.rings.len() - 1
                });
                self.ring_slots.insert(u64::from(ring), slot as u32);
                slot
            }
        };
        let was_active = self.rings[slot].is_some();
        self.rings[slot] = Some(Ring {
            input: RingInput {
                pending: VecDeque::new(),
                cursor: 0,
                stalled_passes: 0,
                ended: false,
                ended_in: None,
            },
            track: Track {
                id: track,
                ring,
                spans_created: 0,
                undated: Vec::new(),
                open: Vec::new(),
                held: VecDeque::new(),
                held_base: 0,
                losses_shown: 0,
                last_ns: 0,
                last_exit: None,
                speculative: None,
            },
            dropped_total: 0,
        });
        if !was_active {
            self.active.push(slot as u32);
        }
    }

    /// The slot of ring number `ring` in `rings`, if it was registered.
    fn slot_of(&self, ring: u32) -> Option<usize> {
        self.ring_slots.get(&u64::from(ring)).map(|&slot| slot as usize)
    }

    fn add_callsite(&mut self, def: CallsiteDef) {
        if self.callsites.contains(def.key) {
            return;
        }
        let name = self.out.intern(&def.name);
        let fields = def.fields.iter().map(|f| self.out.intern(f)).collect();
        self.callsites.insert(
            def.key,
            CallsiteInfo {
                name,
                fields,
                counter_track: None,
            },
        );
    }

    fn add_chunk(&mut self, chunk: Chunk) {
        match self.slot_of(chunk.ring).and_then(|slot| self.rings.get_mut(slot)) {
            Some(Some(ring)) => ring.input.pending.push_back(chunk),
            _ => {
                // A chunk of a ring never registered: corrupt input. Every record is a framing error.
                self.counts.framing_errors += chunk.records.len() as u64;
                self.recycle(chunk);
            }
        }
    }

    fn recycle(&mut self, chunk: Chunk) {
        if let Some(r) = &self.recycler {
            r.budget
                .release(chunk.records.len() * std::mem::size_of::<crate::codec::Record>());
            let mut records = chunk.records;
            records.clear();
            let _ = r.pool.push(records);
        }
    }

    fn cpu_burst(&mut self, samples: &[crate::calibration::CalibrationSample]) {
        // The ticks converted so far were converted with the fit this burst replaces: stated with it.
        if let Some(cpu) = &self.cpu {
            cpu.settle(&mut self.cpu_converted);
        }
        let Some(CpuTime::Live { history, fast, .. }) = &mut self.cpu else {
            return;
        };
        if history.add_burst(samples).is_ok() {
            *fast = history.latest().map(|c| Box::new(FastConverter::new(c)));
        }
    }

    /// Processes every ring as far as it can go, then releases holds, converts GPU slices and reports.
    /// `rings_drained`: see [`Input::PassEnd`].
    fn pass_end(&mut self, drain_ns: u64, rings_drained: bool) {
        self.process_rings(drain_ns, false, rings_drained);
        self.finish_pass(Release::Ready, rings_drained);
    }

    /// Processes every ring as far as it can go (`force`: past records that name unknown spans). A stall
    /// counts towards giving up only in a pass that drained every ring (`rings_drained`).
    fn process_rings(&mut self, drain_ns: u64, force: bool, rings_drained: bool) {
        // Only a pass that drained every ring brings what other threads recorded before the records processed
        // in the passes before it: what waits for that (a slice's values, a closed span's late records, a
        // task's polls) counts such passes alone.
        if rings_drained {
            self.pass += 1;
        }
        self.process_rings_again(drain_ns, force, rings_drained);
    }

    /// [`process_rings`](Self::process_rings) within the current pass (no new drain pass came).
    fn process_rings_again(&mut self, drain_ns: u64, force: bool, rings_drained: bool) {
        self.mid_pass = true;
        self.last_drain_ns = self.last_drain_ns.max(drain_ns);
        // Rings wait on each other (a span created on one, entered on another): go round until nothing moves.
        loop {
            let mut progress = false;
            for k in 0..self.active.len() {
                progress |= self.process_ring(self.active[k], false);
            }
            if !progress {
                break;
            }
        }
        // Rings stalled too long: the span they wait for was never announced. Go on without it.
        for k in 0..self.active.len() {
            let slot = self.active[k];
            let stalled = self.rings[slot as usize]
                .as_ref()
                .is_some_and(|r| !r.input.pending.is_empty() && (force || r.input.stalled_passes >= MAX_WAIT_PASSES));
            if stalled {
                self.process_ring(slot, true);
            } else if let Some(r) = self.rings[slot as usize].as_mut() {
                if !r.input.pending.is_empty() && rings_drained {
                    r.input.stalled_passes += 1;
                }
            }
        }
        self.mid_pass = false;
        self.finish_ended_rings();
    }

    /// Releases what the holds allow (`mode`: how much more), converts GPU slices, reports.
    fn finish_pass(&mut self, mode: Release, rings_drained: bool) {
        let force = mode != Release::Ready;
        let drain = self.last_drain_ns;
        for k in 0..self.active.len() {
            let slot = self.active[k];
            if let Some(mut r) = self.rings[slot as usize].take() {
                let expired = r
                    .track
                    .held
                    .front()
                    .is_some_and(|e| drain.saturating_sub(e.ts_ns) > self.hold_limit_ns)
                    || r.track.held.len() > HOLD_MAX_EVENTS;
                let mode = if expired && mode == Release::Ready {
                    Release::Open
                } else {
                    mode
                };
                self.release(&mut r.track, mode, drain);
                self.rings[slot as usize] = Some(r);
            }
        }
        self.gpu.pass_end(&mut self.out, drain, force, rings_drained);
        // Closed tasks none of whose polls can still come: their tracks, before the sweep forgets them.
        let mut to_write = std::mem::take(&mut self.to_write);
        self.spans.tasks_to_write(self.pass, &mut to_write);
        for serial in to_write.drain(..) {
            self.write_task(serial, drain);
        }
        self.to_write = to_write;
        self.report(drain);
        self.spans.sweep(self.pass);
    }

    /// Processes the pending records of the ring in `slot` until one stalls. `force`: a record naming an
    /// unknown span is processed as unknown instead of stalling. Returns whether any record was processed.
    fn process_ring(&mut self, slot: u32, force: bool) -> bool {
        let Some(mut r) = self.rings.get_mut(slot as usize).and_then(Option::take) else {
            return false;
        };
        let mut progress = false;
        'chunks: while let Some(chunk) = r.input.pending.pop_front() {
            if chunk.dropped_total > r.dropped_total {
                let dropped = chunk.dropped_total - r.dropped_total;
                self.drops_seen += dropped;
                r.dropped_total = chunk.dropped_total;
                // Dropped before this chunk was drained: as late as that, for all the trace can tell; and after
                // the ring's last record processed so far.
                let drained = self.cpu.as_ref().and_then(|c| c.to_ns(chunk.now_ticks));
                self.note_loss(r.track.last_ns, drained.unwrap_or(u64::MAX), dropped);
            }
            let mut decoder = Decoder::new(&chunk.records[r.input.cursor..]);
            let mut processed = 0;
            loop {
                if self.out.batch.events.len() >= self.export_mid_pass_events && r.track.speculative.is_none() {
                    self.export(self.last_drain_ns, false);
                }
                if self.leaf_spans {
                    if let Some(taken) = self.leaf_at(&mut r.track, decoder.clone(), chunk.now_ticks) {
                        decoder.skip_decoded(taken);
                        processed += taken;
                        progress = true;
                        r.input.stalled_passes = 0;
                        continue;
                    }
                }
                let Some((item, len)) = decoder.next_with_len() else {
                    break;
                };
                match item {
                    Err(_) => {
                        self.counts.framing_errors += len as u64;
                    }
                    Ok(item) => {
                        // An exit right before its span's close, which says it was entered only once: a
                        // synchronous span's only poll, no task.
                        self.exit_before_close = matches!(item, Item::SpanExit { serial, .. }
                            if decoder.next_closes_synchronous(serial));
                        let step = self.item(&mut r.track, item, decoder.rest(), chunk.now_ticks, force);
                        self.exit_before_close = false;
                        if step == Step::Stall {
                            r.input.cursor += processed;
                            r.input.pending.push_front(chunk);
                            break 'chunks;
                        }
                    }
                }
                processed += len;
                progress = true;
                r.input.stalled_passes = 0;
            }
            r.input.cursor = 0;
            self.recycle(chunk);
        }
        if let Some((serial, slot)) = r.track.speculative {
            // The ring's next record (the span's close, or not) comes later: the poll's end waits for it.
            r.track.speculative = match slot {
                EventSlot::Batch(index) => self.park(&mut r.track, serial, index),
                EventSlot::Held(seq) => self.mark_undecided(&mut r.track, serial, seq),
            }
            .map(|seq| (serial, EventSlot::Held(seq)));
        }
        self.rings[slot as usize] = Some(r);
        progress
    }

    /// Processes the leaf span `decoder`'s next records make, if they make one that can take a fast path
    /// (`Processor::leaf_span`, `Processor::leaf_span_with_fields`); returns how many records it took.
    #[inline]
    fn leaf_at(&mut self, track: &mut Track, mut decoder: Decoder<'_>, now_ticks: u64) -> Option<usize> {
        let rest = decoder.rest();
        if let Some(leaf) = LeafSpan::at(rest) {
            if self.leaf_span(track, leaf, now_ticks) {
                #[cfg(test)]
                {
                    self.leaf_spans_taken += 1;
                }
                return Some(LeafSpan::RECORDS);
            }
        }
        if !LeafSpan::group_at(rest) {
            return None;
        }
        // A creation with fields: decoded, then a leaf tail looked for after it.
        let (
            Ok(Item::SpanNew {
                ticks,
                callsite,
                parent,
                fields,
            }),
            len,
        ) = decoder.next_with_len()?
        else {
            return None;
        };
        let tail = rest.get(len..).and_then(LeafTail::at)?;
        if !self.leaf_span_with_fields(track, (ticks, callsite, parent, fields), tail, now_ticks) {
            return None;
        }
        #[cfg(test)]
        {
            self.leaf_spans_with_fields_taken += 1;
        }
        Some(len + LeafTail::RECORDS)
    }

    /// Rings whose thread exited and whose records are all processed: their open slices end at their last
    /// time, marked truncated; their held events go out.
    fn finish_ended_rings(&mut self) {
        let mut k = 0;
        while k < self.active.len() {
            let slot = self.active[k];
            let done = self.rings[slot as usize]
                .as_ref()
                .is_some_and(|r| r.input.ended && r.input.pending.is_empty());
            if !done {
                k += 1;
                continue;
            }
            let mut r = self.rings[slot as usize].take().expect("checked above");
            let end = r.track.last_ns;
            self.show_last_losses(&mut r, end);
            self.truncate_open(&mut r.track, end);
            // A slice that ended in this pass waits for values recorded on other threads before its end, as
            // on a live thread's track: the track goes a pass later (at once when the timeline ends).
            let waits = !self.ending && !r.track.held.is_empty() && r.input.ended_in.is_none_or(|p| p >= self.pass);
            if waits {
                r.input.ended_in.get_or_insert(self.pass);
                self.rings[slot as usize] = Some(r);
                k += 1;
                continue;
            }
            self.release(&mut r.track, Release::All, end);
            self.active.swap_remove(k);
            // Its number is forgotten: a later chunk of it (corrupt input) is a framing error, as one of a
            // ring never registered, and never lands on the ring that takes the slot next.
            self.ring_slots.remove(&u64::from(r.track.ring));
            self.free_slots.push(slot);
        }
    }

    /// Records a ring dropped after its last record (no `Gap` record came after them: the thread recorded
    /// nothing more, or ended): shown at `at`, the ring's last time, on the slices still open.
    fn show_last_losses(&mut self, r: &mut Ring, at: u64) {
        let unshown = r.dropped_total.saturating_sub(r.track.losses_shown);
        if unshown > 0 {
            self.mark_loss(&mut r.track, at, unshown);
        }
    }

    /// Counter tracks of the timeline's own state, and the stats.
    fn report(&mut self, drain_ns: u64) {
        let value = self.out.value_name();
        if let Some((fallback, doubt, text)) = self.clock_note.take() {
            // The CPU clock decision, on the process track, loud: what the timeline records and why.
            let fields = vec![
                TraceField {
                    name: self.names.clock_decision,
                    value: FieldValue::Str(text),
                },
                TraceField {
                    name: self.names.clock_fallback,
                    value: FieldValue::Bool(fallback),
                },
                TraceField {
                    name: self.names.clock_doubt,
                    value: FieldValue::Bool(doubt),
                },
            ];
            let process = self.out.process_track();
            self.out.push_metadata(drain_ns, process, self.names.clock, &fields);
            let level = if fallback {
                1.0
            } else if doubt {
                2.0
            } else {
                0.0
            };
            self.out.push_counter(self.tracks.cpu_clock, drain_ns, value, level);
        }
        let dropped = self.drops_seen;
        if dropped != self.reported_dropped {
            self.reported_dropped = dropped;
            self.out
                .push_counter(self.tracks.dropped, drain_ns, value, dropped as f64);
        }
        if self.counts.truncated_slices != self.reported_truncated {
            self.reported_truncated = self.counts.truncated_slices;
            self.out.push_counter(
                self.tracks.truncated,
                drain_ns,
                value,
                self.counts.truncated_slices as f64,
            );
        }
        self.report_cpu_uncertainty(drain_ns);
        if let Some(fit) = self.cpu.as_ref().and_then(|c| c.history().latest().copied()) {
            if fit.calibrated_at_ns() != self.reported_fit_ns {
                self.reported_fit_ns = fit.calibrated_at_ns();
                self.out
                    .push_counter(self.tracks.cpu_drift, drain_ns, value, fit.drift_ppm());
                self.out
                    .push_counter(self.tracks.cpu_error, drain_ns, value, fit.error_bound_ns());
            }
        }
        self.publish_stats();
    }

    /// The uncertainty counter of CPU timestamps: a timestamp at `t` lies within ± the larger of the values
    /// written just before and just after `t` (about 95 %). A value is written when the timestamps converted
    /// since the last report need more than the value shown (or less than 60 % of it: a new fit), with a
    /// quarter's headroom, so a steady program writes a few values per calibration interval, not one per pass.
    fn report_cpu_uncertainty(&mut self, drain_ns: u64) {
        let Some(stated) = self
            .cpu
            .as_ref()
            .and_then(|c| c.stated_uncertainty(&mut self.cpu_converted))
        else {
            return;
        };
        let write = match self.cpu_uncertainty_shown {
            None => true,
            Some(shown) => stated > shown || stated.saturating_mul(5) < shown.saturating_mul(3),
        };
        if write {
            let shown = stated.saturating_add(stated.div_ceil(4)).max(1);
            self.cpu_uncertainty_shown = Some(shown);
            let value = self.out.value_name();
            self.out
                .push_counter(self.tracks.cpu_uncertainty, drain_ns, value, shown as f64);
        }
    }

    fn publish_stats(&self) {
        let (c, s) = (&self.counts, &self.stats);
        s.truncated_slices.store(c.truncated_slices, Ordering::Relaxed);
        s.fields_truncated.store(c.fields_truncated, Ordering::Relaxed);
        s.unmatched_ends.store(c.unmatched_ends, Ordering::Relaxed);
        s.unknown_spans.store(c.unknown_spans, Ordering::Relaxed);
        s.unknown_callsites.store(c.unknown_callsites, Ordering::Relaxed);
        s.framing_errors.store(c.framing_errors, Ordering::Relaxed);
        s.gap_markers.store(c.gap_markers, Ordering::Relaxed);
        s.monotonic_clamps
            .store(c.monotonic_clamps + self.out.monotonic_clamps, Ordering::Relaxed);
        let g = self.gpu.stats;
        s.gpu_scopes.store(g.scopes, Ordering::Relaxed);
        s.gpu_lost_scopes.store(g.lost_scopes, Ordering::Relaxed);
        s.gpu_causality_violations
            .store(g.causality_violations, Ordering::Relaxed);
        s.gpu_failed_calibrations
            .store(g.failed_calibrations, Ordering::Relaxed);
        s.gpu_read_failures.store(g.read_failures, Ordering::Relaxed);
        s.async_tasks.store(self.tasks_written, Ordering::Relaxed);
        s.async_polls.store(self.polls_written, Ordering::Relaxed);
    }

    /// Hands the batch to the exporters: after every pass that made events, and at least every 100 ms (an
    /// empty batch then), so exporters that write on a clock can.
    fn export(&mut self, now_ns: u64, always: bool) {
        const EXPORT_AT_LEAST_EVERY_NS: u64 = 100_000_000;
        let due = always || now_ns.saturating_sub(self.last_export_ns) >= EXPORT_AT_LEAST_EVERY_NS;
        self.out.batch.cpu_clock = match &self.cpu {
            Some(CpuTime::Live { source, history, .. }) => history.latest().map(|&calibration| CpuClock {
                source: *source,
                calibration,
            }),
            _ => None,
        };
        if due || !self.out.batch.is_empty() {
            self.last_export_ns = now_ns;
            self.out.export(&self.stats, due);
        }
    }

    fn shutdown(&mut self) -> Result<(), String> {
        let end = self.last_drain_ns;
        self.process_rings(end, true, false);
        // Threads still running: their open slices go on past the end of the trace.
        for k in 0..self.active.len() {
            let slot = self.active[k];
            if let Some(mut r) = self.rings[slot as usize].take() {
                let last = r.track.last_ns;
                self.show_last_losses(&mut r, last);
                self.truncate_open(&mut r.track, end);
                self.rings[slot as usize] = Some(r);
            }
        }
        self.ending = true;
        self.finish_pass(Release::All, false);
        // Tasks still open (or closed too recently to have been written): written now, the open ones
        // truncated at the end.
        for serial in self.spans.unwritten_tasks() {
            self.write_task(serial, end);
        }
        self.gpu.abandon(&mut self.out, end);
        self.report(end);
        self.export(end, true);
        self.finished = true;
        self.out.flush_exporters(&self.stats, true)
    }
}

#[cfg(test)]
mod tests;
