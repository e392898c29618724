//! The processing stage: the input log in, the timeline out. A function of the log alone (see `input.rs`),
//! so the same code runs live, behind the drain stage, and when a raw capture is converted later.
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
//! later go on its end event.
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
//! # Losses
//!
//! A `Gap` record (records dropped right there) becomes an instant named `tickline: records dropped` with the
//! count, and every slice open around it carries `tickline.dropped_inside`. A slice that cannot end where
//! the program ended it (its thread exited with it open, the timeline shut down inside it) ends at the last
//! time known and carries `tickline.truncated = true`; it is counted in
//! [`TimelineStats::truncated_slices`](crate::TimelineStats::truncated_slices). No slice is ever ended by an
//! unrelated end, and none lasts longer than it did.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::drain::{Budget, ChunkPool};
use super::input::{CallsiteDef, Chunk, Input};
use super::output::Output;
use super::process_gpu::GpuCollector;
use super::spans::{set_field, IdMap, Poll, SpanState, Spans, TaskData};
use super::stats::SharedStats;
use crate::calibration::{CalibrationHistory, ClockDomain, HistoryConfig};
use crate::clock::{FastConverter, TickSource};
use crate::codec::{decode_fields, restore_ticks, Decoder, Item, Parent, Payload, RawValue, META_INDEX};
use crate::export::{CpuClock, EventKind, FieldValue, NameId, TraceField, TrackId, TrackKind};
use crate::gpu::GpuCalibrationConfig;

/// Longest a span slice's begin (and what follows it on its track) is held for its final field values.
pub(crate) const HOLD_LIMIT_NS: u64 = 200_000_000;
/// Most events held on one track; beyond, the track is released as if the hold limit had passed.
const HOLD_MAX_EVENTS: usize = 1 << 16;
/// Passes a record waits for the creation of the span it names before that span counts as unknown.
const MAX_WAIT_PASSES: u32 = 2;

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

    fn history(&self) -> &CalibrationHistory {
        match self {
            CpuTime::Live { history, .. } | CpuTime::Complete { history } => history,
        }
    }
}

/// What the processing stage knows about a call site.
struct CallsiteInfo {
    name: NameId,
    fields: Vec<NameId>,
    counter_track: Option<TrackId>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum OpenKind {
    Span(u64),
    Scope(u64),
}

/// A slice open on a thread track.
struct OpenSlice {
    kind: OpenKind,
    name: NameId,
    /// When it began (reference ns): a span slice's poll.
    begin_ns: u64,
    /// The sequence number of its begin in the track's held queue, while it is held.
    held: Option<u64>,
    /// The values its begin carried when it was released before the slice ended.
    released_values: Option<Vec<TraceField>>,
    /// Records dropped while it was open.
    dropped_inside: u64,
}

use super::AsyncTasks;

/// Ancestors followed up from a span when its task track is placed (deeper nesting goes under the process).
const MAX_TASK_DEPTH: usize = 64;
/// Bytes of a task track's name (its span's name and creation values), beyond which it is cut.
const MAX_TASK_NAME: usize = 80;
/// Written tasks whose tracks are remembered for children that outlive them.
const WRITTEN_TASKS_KEPT: usize = 1 << 16;
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
    /// 0: the hardware counter; 1: CLOCK_MONOTONIC instead (a fallback); 2: the hardware counter, found
    /// unreliable after the start.
    cpu_clock: TrackId,
}

/// Counts that end up in [`crate::TimelineStats`].
#[derive(Default)]
struct Counts {
    truncated_slices: u64,
    fields_truncated: u64,
    unmatched_ends: u64,
    unknown_spans: u64,
    unknown_callsites: u64,
    framing_errors: u64,
    monotonic_clamps: u64,
}

/// Where processed chunk memory goes back to (live only).
pub(crate) struct Recycler {
    pub(crate) pool: Arc<ChunkPool>,
    pub(crate) budget: Arc<Budget>,
}

/// The processing stage. Feed it the input log with [`input`](Self::input).
pub(crate) struct Processor {
    out: Output,
    callsites: IdMap<CallsiteInfo>,
    rings: Vec<Option<Ring>>,
    active: Vec<u32>,
    spans: Spans,
    cpu: Option<CpuTime>,
    gpu: GpuCollector,
    pass: u64,
    counts: Counts,
    names: OwnNames,
    tracks: OwnTracks,
    payload: Vec<u8>,
    scratch_fields: Vec<TraceField>,
    recycler: Option<Recycler>,
    stats: Arc<SharedStats>,
    last_export_ns: u64,
    last_drain_ns: u64,
    reported_dropped: u64,
    reported_truncated: u64,
    reported_fit_ns: u64,
    /// Dropped-record totals of rings that ended.
    dropped_of_ended: u64,
    hold_limit_ns: u64,
    finished: bool,
    /// The newest CPU clock note not exported yet: `(fallback, doubt, text)`.
    clock_note: Option<(bool, bool, String)>,
    async_tasks: AsyncTasks,
    /// Task tracks of spans already written and forgotten, by serial: a child that outlives its parent still
    /// nests under it. The oldest are forgotten beyond [`WRITTEN_TASKS_KEPT`].
    written_tasks: IdMap<TrackId>,
    written_order: VecDeque<u64>,
    /// `"poll"`, for the task tracks' poll slices.
    task_names: Option<NameId>,
    tasks_written: u64,
    /// Polls written on task tracks.
    polls_written: u64,
    /// The timeline is shutting down: a span polled once and still open is not a task.
    ending: bool,
    to_write: Vec<u64>,
}

/// What happened to a record.
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
            cpu_clock: out.new_counter_track("tickline CPU clock fallback", ""),
        };
        Processor {
            out,
            callsites: IdMap::default(),
            rings: Vec::new(),
            active: Vec::new(),
            spans: Spans::default(),
            cpu: None,
            gpu: GpuCollector::new(gpu),
            pass: 0,
            counts: Counts::default(),
            names,
            tracks,
            payload: Vec::new(),
            scratch_fields: Vec::new(),
            recycler,
            stats,
            last_export_ns: 0,
            last_drain_ns: 0,
            reported_dropped: 0,
            reported_truncated: 0,
            reported_fit_ns: 0,
            dropped_of_ended: 0,
            hold_limit_ns: HOLD_LIMIT_NS,
            finished: false,
            clock_note: None,
            async_tasks: AsyncTasks::default(),
            written_tasks: IdMap::default(),
            written_order: VecDeque::new(),
            task_names: None,
            tasks_written: 0,
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
        self.out.batch.clear();
    }

    /// Processes what is queued and returns the batch, without releasing, reporting or exporting (benches).
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

    pub(crate) fn process_for_bench(&mut self) -> &crate::export::Batch {
        let drain = self.last_drain_ns;
        self.process_rings(drain, false, true);
        &self.out.batch
    }

    /// Takes one input.
    pub(crate) fn input(&mut self, input: Input) {
        match input {
            Input::Thread { ring, tid, name } => self.add_ring(ring, tid, name),
            Input::NativeCallsite(def) => self.add_callsite(def),
            Input::Chunk(chunk) => self.add_chunk(chunk),
            Input::ThreadEnd { ring } => {
                if let Some(Some(r)) = self.rings.get_mut(ring as usize) {
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
                self.pass_end(drain_ns, false, rings_drained);
                let value = self.out.value_name();
                self.out
                    .push_counter(self.tracks.buffered, drain_ns, value, buffered_bytes as f64);
                self.export(drain_ns, false);
            }
            Input::Flush(reply) => {
                let drain_ns = self.last_drain_ns;
                // The flush's own drain pass came just before (its `PassEnd`); nothing new was drained.
                self.pass_end(drain_ns, true, false);
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
        let index = ring as usize;
        if self.rings.len() <= index {
            self.rings.resize_with(index + 1, || None);
        }
        self.rings[index] = Some(Ring {
            input: RingInput {
                pending: VecDeque::new(),
                cursor: 0,
                stalled_passes: 0,
                ended: false,
            },
            track: Track {
                id: track,
                ring,
                spans_created: 0,
                undated: Vec::new(),
                open: Vec::new(),
                held: VecDeque::new(),
                held_base: 0,
                last_ns: 0,
                last_exit: None,
                speculative: None,
            },
            dropped_total: 0,
        });
        self.active.push(ring);
    }

    fn add_callsite(&mut self, def: CallsiteDef) {
        if self.callsites.contains_key(&def.key) {
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
        match self.rings.get_mut(chunk.ring as usize) {
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
        let Some(CpuTime::Live { history, fast, .. }) = &mut self.cpu else {
            return;
        };
        if history.add_burst(samples).is_ok() {
            *fast = history.latest().map(|c| Box::new(FastConverter::new(c)));
        }
    }

    /// Processes every ring as far as it can go, then releases holds, converts GPU slices and reports.
    /// `rings_drained`: see [`Input::PassEnd`].
    fn pass_end(&mut self, drain_ns: u64, force: bool, rings_drained: bool) {
        self.process_rings(drain_ns, force, rings_drained);
        self.finish_pass(force, rings_drained);
    }

    /// Processes every ring as far as it can go (`force`: past records that name unknown spans). A stall
    /// counts towards giving up only in a pass that drained every ring (`rings_drained`).
    fn process_rings(&mut self, drain_ns: u64, force: bool, rings_drained: bool) {
        self.pass += 1;
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
            let ring = self.active[k];
            let stalled = self.rings[ring as usize]
                .as_ref()
                .is_some_and(|r| !r.input.pending.is_empty() && (force || r.input.stalled_passes >= MAX_WAIT_PASSES));
            if stalled {
                self.process_ring(ring, true);
            } else if let Some(r) = self.rings[ring as usize].as_mut() {
                if !r.input.pending.is_empty() && rings_drained {
                    r.input.stalled_passes += 1;
                }
            }
        }
        self.finish_ended_rings();
    }

    /// Releases what the holds allow (`force`: everything), converts GPU slices, reports.
    fn finish_pass(&mut self, force: bool, rings_drained: bool) {
        let drain = self.last_drain_ns;
        for k in 0..self.active.len() {
            let ring = self.active[k];
            if let Some(mut r) = self.rings[ring as usize].take() {
                let expired = r
                    .track
                    .held
                    .front()
                    .is_some_and(|e| drain.saturating_sub(e.ts_ns) > self.hold_limit_ns)
                    || r.track.held.len() > HOLD_MAX_EVENTS;
                self.release(&mut r.track, force || expired, drain);
                self.rings[ring as usize] = Some(r);
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

    /// Gives span `serial` an async task track (if it has none), under its parent's (a parent that has none
    /// gets one too: a span with child tasks holds them); returns the track.
    fn make_task(&mut self, serial: u64) -> Option<TrackId> {
        // The chain of spans without a track, innermost first, up to one that has a track (or none).
        let mut chain = Vec::new();
        let mut at = serial;
        let mut parent_track = self.out.process_track();
        while at != 0 && chain.len() < MAX_TASK_DEPTH {
            if let Some(&track) = self.written_tasks.get(&at) {
                parent_track = track;
                break;
            }
            let Some(span) = self.spans.get(at) else { break };
            if let Some(task) = &span.task {
                parent_track = task.track;
                break;
            }
            chain.push(at);
            at = span.parent;
        }
        let mut track = None;
        for &s in chain.iter().rev() {
            let name = self.task_name(s);
            let t = self.out.new_track(Some(parent_track), TrackKind::AsyncTask { name });
            if let Some(span) = self.spans.get_mut(s) {
                // Its first poll, kept in case it became a task, is now the task's.
                let first = (span.first_poll.end_ns != 0).then_some(span.first_poll);
                span.task = Some(Box::new(TaskData {
                    track: t,
                    polls: first.into_iter().collect(),
                    begun: None,
                    lanes: vec![(t, 0)],
                    written: false,
                }));
            }
            self.spans.closed_task(s);
            parent_track = t;
            track = Some(t);
        }
        track.or_else(|| self.spans.get(serial).and_then(|s| s.task.as_ref()).map(|t| t.track))
    }

    /// A task track's name: the span's name and its creation values.
    fn task_name(&self, serial: u64) -> String {
        let Some(span) = self.spans.get(serial) else {
            return String::new();
        };
        let mut name = self.out.name_of(span.name).to_owned();
        for field in span.creation_values() {
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
    fn write_task(&mut self, serial: u64, end_ns: u64) {
        let Some(span) = self.spans.get(serial) else { return };
        let Some(task) = span.task.as_ref() else { return };
        if task.written {
            return;
        }
        let closed = span.is_closed();
        let last_end = task.polls.iter().map(|p| p.end_ns).max().unwrap_or(0);
        let end = if closed { span.closed_ns } else { end_ns }
            .max(last_end)
            .max(span.created_ns);
        let begun = task.begun.is_some();
        self.write_task_begin(serial, end);
        self.write_task_polls(serial);
        let Some(span) = self.spans.get_mut(serial) else { return };
        let name = span.name;
        let mut fields = Vec::new();
        span.values_at(end, &mut fields);
        let Some(task) = span.task.as_mut() else { return };
        task.written = true;
        let track = task.track;
        let mut end_fields = if begun {
            // Its begin went out early with the values of then: the end carries what changed since.
            let sent = task.begun.take().unwrap_or_default();
            fields.retain(|f| !sent.contains(f));
            fields
        } else {
            Vec::new()
        };
        if !closed {
            end_fields.push(TraceField {
                name: self.names.truncated,
                value: FieldValue::Bool(true),
            });
        }
        self.out
            .push_event_owned(end, track, EventKind::SliceEnd, name, &mut end_fields);
        self.tasks_written += 1;
        self.written_tasks.insert(serial, track);
        self.written_order.push_back(serial);
        if self.written_order.len() > WRITTEN_TASKS_KEPT {
            if let Some(old) = self.written_order.pop_front() {
                self.written_tasks.remove(&old);
            }
        }
    }

    /// Writes task `serial`'s lifetime begin (at its creation, or its first poll if earlier) with its values
    /// as of `values_ns`, unless it was written already.
    fn write_task_begin(&mut self, serial: u64, values_ns: u64) {
        let Some(span) = self.spans.get_mut(serial) else { return };
        let Some(task) = span.task.as_ref() else { return };
        if task.begun.is_some() {
            return;
        }
        let first_begin = task.polls.iter().map(|p| p.begin_ns).min().unwrap_or(u64::MAX);
        let begin = span.created_ns.min(first_begin);
        let mut fields = Vec::new();
        span.values_at(values_ns, &mut fields);
        let (name, track) = (span.name, task.track);
        if let Some(task) = span.task.as_mut() {
            task.begun = Some(fields.clone());
        }
        let lifetime = self
            .out
            .push_event_owned(begin, track, EventKind::SliceBegin, name, &mut fields);
        lifetime.flow_out = None;
    }

    /// Writes task `serial`'s buffered polls (its lifetime begin must be out): each a `poll` slice ending the
    /// flow from its slice on a thread track, on the first lane free at its start.
    fn write_task_polls(&mut self, serial: u64) {
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
            let begin_event = self.out.push_event_owned(
                poll.begin_ns,
                lane_track,
                EventKind::SliceBegin,
                poll_name,
                &mut Vec::new(),
            );
            begin_event.flow_in = (poll.flow != 0).then_some(poll.flow);
            self.out
                .push_event_owned(poll.end_ns, lane_track, EventKind::SliceEnd, poll_name, &mut Vec::new());
        }
        self.polls_written += polls.len() as u64;
        polls.clear();
        if let Some(task) = self.spans.get_mut(serial).and_then(|s| s.task.as_mut()) {
            task.polls = polls;
            task.lanes = lanes;
        }
    }

    /// Processes ring `ring`'s pending records until one stalls. `force`: a record naming an unknown span is
    /// processed as unknown instead of stalling. Returns whether any record was processed.
    fn process_ring(&mut self, ring: u32, force: bool) -> bool {
        let Some(mut r) = self.rings.get_mut(ring as usize).and_then(Option::take) else {
            return false;
        };
        let mut progress = false;
        'chunks: while let Some(chunk) = r.input.pending.pop_front() {
            r.dropped_total = r.dropped_total.max(chunk.dropped_total);
            let mut decoder = Decoder::new(&chunk.records[r.input.cursor..]);
            let mut processed = 0;
            while let Some((item, len)) = decoder.next_with_len() {
                match item {
                    Err(_) => {
                        self.counts.framing_errors += len as u64;
                    }
                    Ok(item) => match self.item(&mut r.track, item, chunk.now_ticks, force) {
                        Step::Done => {}
                        Step::Stall => {
                            r.input.cursor += processed;
                            r.input.pending.push_front(chunk);
                            break 'chunks;
                        }
                    },
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
        self.rings[ring as usize] = Some(r);
        progress
    }

    /// Marks the held first-poll end `seq` of span `serial` undecided (it holds its track); returns `seq`.
    fn mark_undecided(&mut self, track: &mut Track, serial: u64, seq: u64) -> Option<u64> {
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
    fn park(&mut self, track: &mut Track, serial: u64, index: usize) -> Option<u64> {
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
        });
        if let Some(span) = self.spans.get_mut(serial) {
            // Kept while the decision waits.
            span.held_begins += 1;
        }
        Some(track.held_base)
    }

    /// Rings whose thread exited and whose records are all processed: their open slices end at their last
    /// time, marked truncated; their held events go out.
    fn finish_ended_rings(&mut self) {
        let mut k = 0;
        while k < self.active.len() {
            let ring = self.active[k];
            let done = self.rings[ring as usize]
                .as_ref()
                .is_some_and(|r| r.input.ended && r.input.pending.is_empty());
            if !done {
                k += 1;
                continue;
            }
            let mut r = self.rings[ring as usize].take().expect("checked above");
            let end = r.track.last_ns;
            self.truncate_open(&mut r.track, end);
            self.release(&mut r.track, true, end);
            self.dropped_of_ended += r.dropped_total;
            self.active.swap_remove(k);
        }
    }

    /// Ends every open slice of `track` at `end_ns`, marked truncated.
    fn truncate_open(&mut self, track: &mut Track, end_ns: u64) {
        let end_ns = end_ns.max(track.last_ns);
        while let Some(slice) = track.open.pop() {
            self.counts.truncated_slices += 1;
            self.end_slice(track, slice, end_ns, true, false);
        }
    }

    fn ticks_to_ns(&mut self, track: &mut Track, low: u64, now_ticks: u64) -> u64 {
        let ticks = restore_ticks(low, now_ticks);
        let ns = self.cpu.as_ref().and_then(|c| c.to_ns(ticks)).unwrap_or(track.last_ns);
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

    fn callsite_name(&mut self, key: u64) -> NameId {
        match self.callsites.get(&key) {
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
        let Some(callsite) = self.callsites.get(&key) else {
            return 0;
        };
        let mut truncated = 0;
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
                RawValue::Str(s) => (field_name(&callsite.fields, index), FieldValue::Str(s.to_owned())),
            };
            if name == NameId(0) {
                continue;
            }
            set_field(out, TraceField { name, value });
        }
        if truncated > 0 {
            self.counts.fields_truncated += 1;
        }
        truncated
    }

    /// Emits an event on `track`: held behind a held span begin, or straight into the batch.
    fn emit(
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
            });
            EventSlot::Held(track.held_base + track.held.len() as u64 - 1)
        }
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
    fn decide_flow(&mut self, track: &mut Track, serial: u64, slot: EventSlot, next: &Item<'_>) {
        let closes = matches!(next, Item::SpanClose { serial: closed, .. } if *closed == serial);
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
    fn release_decided(&mut self, track: &mut Track, serial: u64, now_ns: u64) {
        if track.held.front().is_some_and(|e| e.undecided == Some(serial)) {
            self.release(track, false, now_ns);
        }
    }

    fn span_serial(&self, serial: u64) -> Option<&SpanState> {
        self.spans.get(serial)
    }

    /// One decoded record of a ring.
    fn item(&mut self, track: &mut Track, item: Item<'_>, now_ticks: u64, force: bool) -> Step {
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
                let (name, fieldless) = match self.callsites.get(&callsite) {
                    Some(c) => (c.name, c.fields.is_empty()),
                    None => (self.callsite_name(callsite), true),
                };
                let mut values = Vec::new();
                let truncated = self.decode_payload(callsite, fields, &mut values);
                let parent = match parent {
                    Parent::Explicit(serial) => Some(serial),
                    Parent::Root => None,
                    // The span current on this thread when it was created: the innermost open span slice.
                    Parent::Contextual => track.open.iter().rev().find_map(|o| match o.kind {
                        OpenKind::Span(serial) => Some(serial),
                        OpenKind::Scope(_) => None,
                    }),
                };
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
                    span.fields_truncated = span.fields_truncated.max(u32::try_from(truncated).unwrap_or(u32::MAX));
                    span.update(ts, values.drain(..));
                }
                self.scratch_fields = values;
            }
            Item::SpanEnter { ticks, serial } => {
                let (name, fieldless) = match self.span_serial(serial) {
                    Some(span) => (span.name, span.fieldless),
                    None if !force => return Step::Stall,
                    None => {
                        self.counts.unknown_spans += 1;
                        (self.names.unknown_span, true)
                    }
                };
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let mut becomes_task = false;
                // Entered again while entered on this thread: not a new poll.
                let nested = track.open.iter().any(|o| o.kind == OpenKind::Span(serial));
                if let Some(span) = self.spans.get_mut(serial) {
                    span.open_slices += 1;
                    span.held_begins += u32::from(!fieldless);
                    span.enters = span.enters.saturating_add(u32::from(!nested));
                    if span.first_track == 0 {
                        span.first_track = track.id.0;
                    } else if span.first_track != track.id.0 {
                        span.multi_track = true;
                    }
                    // Entered again, or on another thread: a span that lives across polls.
                    becomes_task = self.async_tasks == AsyncTasks::Auto
                        && span.task.is_none()
                        && (span.enters > 1 || span.multi_track);
                }
                if becomes_task {
                    self.make_task(serial);
                    self.release_decided(track, serial, ts);
                }
                if fieldless {
                    // No values to wait for: out at once (behind anything already held on the track).
                    self.begin_unheld(track, OpenKind::Span(serial), name, ts);
                    return Step::Done;
                }
                // Held until the slice ends: it shows the values the span had then.
                let seq = track.held_base + track.held.len() as u64;
                track.held.push_back(HeldEvent {
                    ts_ns: ts,
                    kind: EventKind::SliceBegin,
                    name,
                    fields: Vec::new(),
                    flow_out: None,
                    span: Some(HeldSpan { serial, end: None }),
                    undecided: None,
                });
                track.open.push(OpenSlice {
                    kind: OpenKind::Span(serial),
                    name,
                    begin_ns: ts,
                    held: Some(seq),
                    released_values: None,
                    dropped_inside: 0,
                });
            }
            Item::SpanExit { ticks, serial } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                track.last_exit = Some((serial, ts));
                self.close_slice(track, OpenKind::Span(serial), ts);
            }
            Item::SpanClose { ticks, serial } => {
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
                self.spans.close(serial, self.pass, ts);
                self.release_decided(track, serial, ts);
            }
            Item::Event {
                ticks,
                callsite,
                parent: _,
                fields,
            } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let name = self.callsite_name(callsite);
                let mut values = Vec::new();
                self.decode_payload(callsite, fields, &mut values);
                self.emit(track, ts, EventKind::Instant, name, values, None);
            }
            Item::ScopeBegin { ticks, callsite } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let name = self.callsite_name(callsite);
                self.begin_unheld(track, OpenKind::Scope(callsite), name, ts);
            }
            Item::ScopeEnd { ticks, callsite } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                self.close_slice(track, OpenKind::Scope(callsite), ts);
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
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                let name = self.callsite_name(callsite);
                let mut values = Vec::new();
                self.decode_payload(callsite, fields, &mut values);
                let flow = self.gpu.next_flow();
                // Where this thread recorded the GPU work: the flow's start.
                self.emit(track, ts, EventKind::Instant, name, Vec::new(), Some(flow));
                self.gpu.begin(key, name, values, ts, flow);
            }
            Item::Gap { ticks, dropped } => {
                let ts = self.ticks_to_ns(track, ticks, now_ticks);
                for slice in &mut track.open {
                    slice.dropped_inside = slice.dropped_inside.saturating_add(dropped);
                }
                let fields = vec![TraceField {
                    name: self.names.records,
                    value: FieldValue::U64(dropped),
                }];
                self.emit(track, ts, EventKind::Instant, self.names.gap, fields, None);
            }
        }
        Step::Done
    }

    fn counter_track(&mut self, key: u64) -> (NameId, TrackId) {
        if let Some(c) = self.callsites.get(&key) {
            if let Some(track) = c.counter_track {
                return (c.name, track);
            }
        }
        let name = self.callsite_name(key);
        let label = self.out.name_of(name).to_owned();
        let track = self.out.new_counter_track(&label, "");
        if let Some(c) = self.callsites.get_mut(&key) {
            c.counter_track = Some(track);
        }
        (name, track)
    }

    /// Ends the innermost open slice of `kind` on `track` at `ts_ns`. Slices opened inside it and still open
    /// (ends out of stack order, which `tracing` allows) end there too and open again right after, so every
    /// track nests; an end with no open slice is counted and dropped.
    fn close_slice(&mut self, track: &mut Track, kind: OpenKind, ts_ns: u64) {
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
        for (kind, name, begin_ns) in reopen.into_iter().rev() {
            self.reopen(track, kind, name, ts_ns, begin_ns);
        }
    }

    /// Opens a slice whose begin needs no values (a scope, a span whose callsite has no fields): emitted now,
    /// held only behind what is already held on the track.
    fn begin_unheld(&mut self, track: &mut Track, kind: OpenKind, name: NameId, ts_ns: u64) {
        self.begin_unheld_since(track, kind, name, ts_ns, ts_ns);
    }

    /// [`begin_unheld`](Self::begin_unheld) of a slice (a poll) that began at `begin_ns`, reopened at `ts_ns`.
    fn begin_unheld_since(&mut self, track: &mut Track, kind: OpenKind, name: NameId, ts_ns: u64, begin_ns: u64) {
        let held = (!track.held.is_empty()).then(|| track.held_base + track.held.len() as u64);
        self.emit(track, ts_ns, EventKind::SliceBegin, name, Vec::new(), None);
        track.open.push(OpenSlice {
            kind,
            name,
            begin_ns,
            held,
            released_values: None,
            dropped_inside: 0,
        });
    }

    /// Opens again a slice ended only to keep nesting (see [`close_slice`](Self::close_slice)); a span's poll
    /// goes on from `begin_ns`.
    fn reopen(&mut self, track: &mut Track, kind: OpenKind, name: NameId, ts_ns: u64, begin_ns: u64) {
        let fieldless_span = match kind {
            OpenKind::Span(serial) => self.spans.get(serial).is_none_or(|s| s.fieldless),
            OpenKind::Scope(_) => false,
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
                let seq = track.held_base + track.held.len() as u64;
                track.held.push_back(HeldEvent {
                    ts_ns,
                    kind: EventKind::SliceBegin,
                    name,
                    fields: Vec::new(),
                    flow_out: None,
                    span: Some(HeldSpan { serial, end: None }),
                    undecided: None,
                });
                track.open.push(OpenSlice {
                    kind,
                    name,
                    begin_ns,
                    held: Some(seq),
                    released_values: None,
                    dropped_inside: 0,
                });
            }
            OpenKind::Scope(_) => self.begin_unheld(track, kind, name, ts_ns),
        }
    }

    /// Emits `slice`'s end at `ts_ns` (`truncated`: the slice really ended later) with its markers: on its
    /// begin while that is held, else on the end.
    /// `split`: the slice ends only to keep nesting and opens again at once (its poll goes on).
    fn end_slice(&mut self, track: &mut Track, slice: OpenSlice, ts_ns: u64, truncated: bool, split: bool) {
        let mut markers = Vec::new();
        if truncated {
            markers.push(TraceField {
                name: self.names.truncated,
                value: FieldValue::Bool(true),
            });
        }
        if slice.dropped_inside > 0 {
            markers.push(TraceField {
                name: self.names.dropped_inside,
                value: FieldValue::U64(slice.dropped_inside),
            });
        }
        let mut end_fields = Vec::new();
        match slice.held.and_then(|seq| held_at(track, seq)) {
            Some(begin) => {
                begin.fields.extend(markers);
                if let Some(span) = &mut begin.span {
                    span.end = Some((ts_ns, self.pass));
                }
            }
            None => {
                end_fields = markers;
                if let (OpenKind::Span(serial), Some(released)) = (slice.kind, &slice.released_values) {
                    // Released before it ended: the values that changed since go on its end.
                    if let Some(span) = self.spans.get(serial) {
                        let mut now = Vec::new();
                        span.values_at(ts_ns, &mut now);
                        for field in now {
                            if !released.contains(&field) {
                                end_fields.push(field);
                            }
                        }
                    }
                }
            }
        }
        let mut flow = None;
        let mut speculative = false;
        if let OpenKind::Span(serial) = slice.kind {
            // A span entered again while entered on this thread: the outer enter is the poll.
            let nested = track.open.iter().any(|o| o.kind == slice.kind);
            let mode = if nested { AsyncTasks::Never } else { self.async_tasks };
            // A poll: linked by a flow to its copy on the task's track, when the span is (or, still open after
            // its first poll, may turn out to be) a task.
            let (known_task, maybe_task) = match self.spans.get(serial) {
                Some(span) if !split && mode != AsyncTasks::Never => (
                    span.task.is_some(),
                    mode == AsyncTasks::Auto && span.task.is_none() && !span.is_closed() && span.enters == 1,
                ),
                _ => (false, false),
            };
            let id = if known_task || maybe_task {
                self.gpu.next_flow()
            } else {
                0
            };
            speculative = maybe_task;
            if let Some(span) = self.spans.get_mut(serial) {
                span.open_slices = span.open_slices.saturating_sub(1);
                if !split && mode != AsyncTasks::Never {
                    let poll = Poll {
                        begin_ns: slice.begin_ns,
                        end_ns: ts_ns.max(slice.begin_ns).max(1),
                        flow: id,
                    };
                    let mut stream = false;
                    if let Some(task) = &mut span.task {
                        task.polls.push(poll);
                        stream = task.polls.len() >= MAX_BUFFERED_POLLS;
                    } else if span.first_poll.end_ns == 0 {
                        span.first_poll = poll;
                    }
                    flow = (id != 0).then_some(id);
                    if stream {
                        // A long-lived task: its lifetime begins now and its polls go out as they come.
                        self.write_task_begin(serial, ts_ns);
                        self.write_task_polls(serial);
                    }
                }
            }
        }
        let slot = self.emit(track, ts_ns, EventKind::SliceEnd, slice.name, end_fields, flow);
        if speculative {
            if let OpenKind::Span(serial) = slice.kind {
                track.speculative = Some((serial, slot));
            }
        }
    }

    /// Sends out `track`'s held events up to the first span begin that must wait longer: still open, or
    /// ended in this pass (values recorded on other threads before its end may come next pass). With
    /// `force`, everything goes out; a span slice still open goes with its current values.
    fn release(&mut self, track: &mut Track, force: bool, now_ns: u64) {
        while let Some(front) = track.held.front_mut() {
            if let Some(serial) = front.undecided {
                let (task, closed) = self
                    .spans
                    .get(serial)
                    .map_or((false, true), |s| (s.task.is_some(), s.is_closed()));
                if !task && !closed && !force {
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
            if let Some(span) = &front.span {
                match span.end {
                    Some((_, end_pass)) if end_pass < self.pass || force => {}
                    None if force => {}
                    _ => break,
                }
            }
            let mut event = track.held.pop_front().expect("front exists");
            let seq = track.held_base;
            track.held_base += 1;
            if let Some(span) = event.span.take() {
                let at = span.end.map_or(now_ns, |(end, _)| end);
                let mut values = Vec::new();
                if let Some(state) = self.spans.get_mut(span.serial) {
                    state.values_at(at, &mut values);
                    state.held_begins = state.held_begins.saturating_sub(1);
                }
                if span.end.is_none() {
                    // Released before it ended: remember what went out, for its end.
                    if let Some(open) = track.open.iter_mut().find(|o| o.held == Some(seq)) {
                        open.released_values = Some(values.clone());
                    }
                }
                let markers = std::mem::take(&mut event.fields);
                values.extend(markers);
                event.fields = values;
            }
            let event_out = self
                .out
                .push_event_owned(event.ts_ns, track.id, event.kind, event.name, &mut event.fields);
            event_out.flow_out = event.flow_out;
        }
        for open in &mut track.open {
            if open.held.is_some_and(|seq| seq < track.held_base) {
                open.held = None;
            }
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
        let dropped = self.dropped_of_ended
            + self
                .active
                .iter()
                .filter_map(|&r| self.rings[r as usize].as_ref())
                .map(|r| r.dropped_total)
                .sum::<u64>();
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

    fn publish_stats(&self) {
        let (c, s) = (&self.counts, &self.stats);
        s.truncated_slices.store(c.truncated_slices, Ordering::Relaxed);
        s.fields_truncated.store(c.fields_truncated, Ordering::Relaxed);
        s.unmatched_ends.store(c.unmatched_ends, Ordering::Relaxed);
        s.unknown_spans.store(c.unknown_spans, Ordering::Relaxed);
        s.unknown_callsites.store(c.unknown_callsites, Ordering::Relaxed);
        s.framing_errors.store(c.framing_errors, Ordering::Relaxed);
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
            let ring = self.active[k];
            if let Some(mut r) = self.rings[ring as usize].take() {
                self.truncate_open(&mut r.track, end);
                self.rings[ring as usize] = Some(r);
            }
        }
        self.ending = true;
        self.finish_pass(true, false);
        // Tasks still open (or closed too recently to have been written): written now, the open ones
        // truncated at the end.
        for serial in self.spans.unwritten_tasks() {
            self.write_task(serial, end);
        }
        self.gpu.abandon();
        self.report(end);
        self.export(end, true);
        self.finished = true;
        self.out.flush_exporters(&self.stats, true)
    }
}

fn field_name(names: &[NameId], index: u8) -> NameId {
    names.get(index as usize).copied().unwrap_or(NameId(0))
}

/// The held event with sequence number `seq`, if still held.
fn held_at(track: &mut Track, seq: u64) -> Option<&mut HeldEvent> {
    let index = seq.checked_sub(track.held_base)?;
    track.held.get_mut(index as usize)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::calibration::ClockCalibration;
    use crate::codec::{self, Kind, Record};
    use crate::collector::input::CallsiteKind;
    use crate::export::{MemoryExporter, TrackKind};

    const KNOWN: u64 = 0x1000;

    fn processor(memory: &MemoryExporter) -> Processor {
        let out = Output::new(
            &crate::export::RecordingOrigin::this_process(),
            vec![Box::new(memory.clone())],
        );
        let mut p = Processor::new(
            out,
            GpuCalibrationConfig::default(),
            None,
            Arc::new(SharedStats::default()),
        );
        let domain = ClockDomain::new(64, 1.0).unwrap();
        let cal = ClockCalibration::from_anchor(domain, 0, 0, 1.0).unwrap();
        p.set_cpu_clock(CpuTime::Live {
            source: TickSource::Monotonic,
            history: CalibrationHistory::new(domain, HistoryConfig::default()),
            fast: Some(Box::new(FastConverter::new(&cal))),
        });
        p.input(Input::NativeCallsite(CallsiteDef {
            key: KNOWN,
            kind: CallsiteKind::Native,
            name: "known".into(),
            target: String::new(),
            level: 0,
            file: String::new(),
            line: 0,
            fields: vec!["x".into()],
        }));
        p.input(Input::Thread {
            ring: 1,
            tid: 1,
            name: "t".into(),
        });
        p
    }

    fn arbitrary_record() -> impl Strategy<Value = Record> {
        let key = prop_oneof![Just(KNOWN), any::<u64>()];
        prop_oneof![
            any::<(u64, u64)>().prop_map(|(word0, word1)| Record { word0, word1 }),
            (0u64..16, 0u64..4, 0u64..1_000_000, key).prop_map(|(kind, aux, t, w1)| {
                let kind = match kind {
                    1 => Kind::SpanNew,
                    2 => Kind::SpanRecord,
                    3 => Kind::SpanEnter,
                    4 => Kind::SpanExit,
                    5 => Kind::SpanClose,
                    6 => Kind::Event,
                    7 => Kind::ScopeBegin,
                    8 => Kind::ScopeEnd,
                    9 => Kind::Instant,
                    10 => Kind::Counter,
                    11 => Kind::GpuBegin,
                    12 => Kind::Gap,
                    _ => Kind::Data,
                };
                Record::head(kind, aux, t, w1)
            }),
        ]
    }

    const SPAN: u64 = 0x2000;

    fn register_span_callsite(p: &mut Processor) {
        p.input(Input::NativeCallsite(CallsiteDef {
            key: SPAN,
            kind: CallsiteKind::Span,
            name: "job".into(),
            target: String::new(),
            level: 3,
            file: String::new(),
            line: 0,
            fields: vec!["x".into()],
        }));
    }

    fn ring(p: &mut Processor, ring: u32) {
        p.input(Input::Thread {
            ring,
            tid: ring,
            name: format!("t{ring}"),
        });
    }

    fn chunk(p: &mut Processor, ring: u32, records: Vec<Record>) {
        p.input(Input::Chunk(Chunk {
            ring,
            now_ticks: 1_000_000,
            dropped_total: 0,
            records,
        }));
    }

    fn pass(p: &mut Processor) {
        p.input(Input::PassEnd {
            drain_ns: 1_000_000,
            drain_ticks: 1_000_000,
            buffered_bytes: 0,
            rings_drained: true,
        });
    }

    fn u64_field(v: u64) -> Vec<u8> {
        let mut payload = vec![0, codec::TAG_U64];
        payload.extend_from_slice(&v.to_le_bytes());
        payload
    }

    fn group(f: impl FnOnce(&mut Vec<Record>)) -> Vec<Record> {
        let mut out = Vec::new();
        f(&mut out);
        out
    }

    #[test]
    fn a_span_slice_waits_a_pass_after_its_end_and_shows_its_values_then() {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        register_span_callsite(&mut p);
        let serial = crate::recorder::span_serial(1, 1);
        let mut records = group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(1)));
        records.push(Record::timed(Kind::SpanEnter, 100, serial));
        records.extend(group(|g| codec::encode_span_record(g, 150, serial, &u64_field(2))));
        records.push(Record::timed(Kind::SpanExit, 200, serial));
        records.extend(group(|g| codec::encode_span_record(g, 250, serial, &u64_field(3))));
        records.push(Record::timed(Kind::SpanClose, 260, serial));
        chunk(&mut p, 1, records);
        pass(&mut p);
        assert_eq!(
            memory.snapshot().slice_count("job"),
            0,
            "held: values from other threads may still come"
        );
        pass(&mut p);
        let slices = memory.snapshot().slices();
        assert_eq!(slices.len(), 1);
        assert_eq!((slices[0].begin_ns, slices[0].end_ns), (100, 200));
        assert_eq!(
            slices[0].field("x"),
            Some(&FieldValue::U64(2)),
            "the value at the slice's end"
        );
    }

    #[test]
    fn a_span_entered_on_another_thread_waits_for_its_creation_there() {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        register_span_callsite(&mut p);
        ring(&mut p, 2);
        let serial = crate::recorder::span_serial(1, 1);
        // Ring 2 (processed first) enters a span whose creation, on ring 1, comes only next pass.
        chunk(
            &mut p,
            2,
            vec![
                Record::timed(Kind::SpanEnter, 100, serial),
                Record::timed(Kind::SpanExit, 200, serial),
                Record::timed(Kind::SpanClose, 201, serial),
            ],
        );
        pass(&mut p);
        chunk(
            &mut p,
            1,
            group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Root, &u64_field(9))),
        );
        pass(&mut p);
        pass(&mut p);
        let trace = memory.snapshot();
        let slices = trace.slices();
        assert_eq!(slices.len(), 1, "{:?}", trace.events);
        assert_eq!(slices[0].name, "job");
        assert_eq!(slices[0].field("x"), Some(&FieldValue::U64(9)));
        assert_eq!(
            trace.track(slices[0].track).map(|t| &t.kind),
            Some(&TrackKind::Thread {
                pid: std::process::id(),
                tid: 2,
                name: "t2".into()
            })
        );
    }

    #[test]
    fn open_slices_of_an_exited_thread_end_at_its_last_record_marked_truncated() {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        register_span_callsite(&mut p);
        let serial = crate::recorder::span_serial(1, 1);
        chunk(
            &mut p,
            1,
            vec![
                codec::span_new_bare(0, SPAN),
                Record::timed(Kind::SpanEnter, 100, serial),
                Record::timed(Kind::ScopeBegin, 150, KNOWN),
                Record::timed(Kind::Instant, 300, KNOWN),
            ],
        );
        p.input(Input::ThreadEnd { ring: 1 });
        pass(&mut p);
        let slices = memory.snapshot().slices();
        assert_eq!(slices.len(), 2);
        for s in &slices {
            assert_eq!(s.end_ns, 300, "ended at the thread's last record, never later");
            assert_eq!(s.field("tickline.truncated"), Some(&FieldValue::Bool(true)), "{s:?}");
        }
        assert_eq!(p.stats.truncated_slices.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_gap_shows_where_records_went_missing_and_marks_the_slices_around_it() {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        chunk(
            &mut p,
            1,
            vec![
                Record::timed(Kind::ScopeBegin, 100, KNOWN),
                Record::timed(Kind::Gap, 150, 6),
                Record::timed(Kind::ScopeEnd, 200, KNOWN),
            ],
        );
        pass(&mut p);
        let trace = memory.snapshot();
        let gap = trace
            .events
            .iter()
            .find(|e| e.name == "tickline: records dropped")
            .unwrap();
        assert_eq!(gap.fields, [("records".to_owned(), FieldValue::U64(6))]);
        let slice = &trace.slices()[0];
        assert_eq!(slice.field("tickline.dropped_inside"), Some(&FieldValue::U64(6)));
    }

    #[test]
    fn a_span_closed_long_before_its_held_slice_goes_out_keeps_its_values() {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        register_span_callsite(&mut p);
        let (outer, inner) = (crate::recorder::span_serial(1, 1), crate::recorder::span_serial(1, 2));
        let mut records = vec![
            codec::span_new_bare(0, SPAN),
            Record::timed(Kind::SpanEnter, 100, outer),
        ];
        records.extend(group(|g| {
            codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(5))
        }));
        records.push(Record::timed(Kind::SpanEnter, 110, inner));
        records.push(Record::timed(Kind::SpanExit, 120, inner));
        records.push(Record::timed(Kind::SpanClose, 121, inner));
        chunk(&mut p, 1, records);
        // Many passes while the outer slice (and the inner one behind it) is held.
        for _ in 0..10 {
            pass(&mut p);
        }
        chunk(
            &mut p,
            1,
            vec![
                Record::timed(Kind::SpanExit, 200, outer),
                Record::timed(Kind::SpanClose, 201, outer),
            ],
        );
        pass(&mut p);
        pass(&mut p);
        let slices = memory.snapshot().slices();
        assert_eq!(slices.len(), 2);
        assert_eq!(slices[0].field("x"), Some(&FieldValue::U64(5)), "{slices:?}");
    }

    /// A span's first poll ends while it stays open; the next record (in a later pass) decides: its close
    /// (a synchronous span: no flow at all), or a second enter (a task: the first poll's flow reaches it).
    #[test]
    fn a_first_poll_waits_for_its_span_to_close_or_be_entered_again() {
        for second_enter in [false, true] {
            let memory = MemoryExporter::default();
            let mut p = processor(&memory);
            register_span_callsite(&mut p);
            let serial = crate::recorder::span_serial(1, 1);
            chunk(
                &mut p,
                1,
                vec![
                    codec::span_new_bare(90, SPAN),
                    Record::timed(Kind::SpanEnter, 100, serial),
                    Record::timed(Kind::SpanExit, 110, serial),
                ],
            );
            for _ in 0..3 {
                pass(&mut p);
            }
            assert_eq!(
                memory.snapshot().slices().len(),
                0,
                "the poll's end waits for the decision"
            );
            let mut next = Vec::new();
            if second_enter {
                next.push(Record::timed(Kind::SpanEnter, 300, serial));
                next.push(Record::timed(Kind::SpanExit, 310, serial));
            }
            next.push(Record::timed(Kind::SpanClose, 400, serial));
            chunk(&mut p, 1, next);
            for _ in 0..6 {
                pass(&mut p);
            }
            let trace = memory.snapshot();
            let slices = trace.slices();
            let outs: Vec<u64> = trace.events.iter().filter_map(|e| e.flow_out).collect();
            let ins: Vec<u64> = trace.events.iter().filter_map(|e| e.flow_in).collect();
            if second_enter {
                let lifetime = slices
                    .iter()
                    .find(|s| s.depth == 0 && !trace.is_thread_track(s.track))
                    .unwrap();
                assert_eq!((lifetime.begin_ns, lifetime.end_ns), (90, 400));
                let polls: Vec<_> = slices
                    .iter()
                    .filter(|s| s.name == "poll")
                    .map(|s| (s.begin_ns, s.end_ns))
                    .collect();
                assert_eq!(polls, [(100, 110), (300, 310)]);
                assert_eq!(outs.len(), 2);
                assert_eq!(outs, ins, "each poll's flow, both ends");
            } else {
                assert_eq!(slices.len(), 1);
                assert!(outs.is_empty() && ins.is_empty(), "a synchronous span has no flow");
                assert!(trace.async_task_tracks().is_empty());
            }
        }
    }

    #[test]
    fn an_end_out_of_stack_order_keeps_every_track_nested() {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        register_span_callsite(&mut p);
        let (a, b) = (crate::recorder::span_serial(1, 1), crate::recorder::span_serial(1, 2));
        chunk(
            &mut p,
            1,
            vec![
                codec::span_new_bare(0, SPAN),
                codec::span_new_bare(0, SPAN),
                Record::timed(Kind::SpanEnter, 100, a),
                Record::timed(Kind::SpanEnter, 110, b),
                Record::timed(Kind::SpanExit, 120, a),
                Record::timed(Kind::SpanExit, 130, b),
                Record::timed(Kind::SpanExit, 140, b),
                Record::timed(Kind::SpanClose, 150, a),
                Record::timed(Kind::SpanClose, 151, b),
            ],
        );
        pass(&mut p);
        pass(&mut p);
        let slices = memory.snapshot().slices();
        // a [100, 120] holding b's first part; b again [120, 130]; the stray exit is counted.
        let spans: Vec<(u64, u64, usize)> = slices.iter().map(|s| (s.begin_ns, s.end_ns, s.depth)).collect();
        assert_eq!(spans, [(110, 120, 1), (100, 120, 0), (120, 130, 0)]);
        assert_eq!(p.stats.unmatched_ends.load(Ordering::Relaxed), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 8 } else { 512 }))]

        /// Corrupt and torn input never panics, and nothing is named after a callsite nobody registered.
        #[test]
        fn corrupt_records_never_panic_nor_name_an_unregistered_callsite(
            records in prop::collection::vec(arbitrary_record(), 0..96),
            valid in prop::collection::vec(0u64..1_000, 0..8),
        ) {
            let memory = MemoryExporter::default();
            let mut p = processor(&memory);
            let mut all = records;
            // Some well-formed groups in between, naming the known callsite.
            let mut group = Vec::new();
            for v in valid {
                codec::encode_event(&mut group, v, KNOWN, codec::Parent::Contextual, &[0, codec::TAG_U64, 1, 0, 0, 0, 0, 0, 0, 0]);
                all.extend_from_slice(&group);
            }
            p.input(Input::Chunk(Chunk { ring: 1, now_ticks: 2_000_000, dropped_total: 0, records: all }));
            p.input(Input::PassEnd { drain_ns: 2_000_000, drain_ticks: 2_000_000, buffered_bytes: 0, rings_drained: true });
            let (tx, rx) = crossbeam_channel::bounded(1);
            p.input(Input::Shutdown(tx));
            prop_assert!(rx.recv().unwrap().is_ok());
            let allowed = ["known", "unknown span", "unknown callsite", "tickline: records dropped", "value"];
            for e in memory.snapshot().events {
                prop_assert!(allowed.contains(&e.name.as_str()), "{:?}", e.name);
            }
        }
    }
}
