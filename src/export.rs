//! The converted event model exporters consume, and the [`Exporter`] trait.
//!
//! The collector hands exporters [`Batch`]es: new tracks and names first, then events already converted to
//! reference-clock (`CLOCK_MONOTONIC`) nanoseconds, in timestamp order per track. Strings travel once, as
//! interned [`NameId`]s; an event carries only ids and a range into the batch's field arena, so a batch of a
//! million events is a few flat vectors.

use std::fmt;
use std::ops::Range;

use crate::calibration::ClockCalibration;
use crate::clock::{RawTicks, TickSource};

pub use crate::callsite::NativeCallsite;
pub use crate::live::{LiveSink, LiveSpanData};
pub use crate::trace_file::TraceFile;

/// A track: a thread, the process, a counter, a GPU queue. Unique per timeline; never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TrackId(pub u64);

/// An interned string (event name, field name, category). Unique per timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NameId(pub u32);

/// What a track shows.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum TrackKind {
    /// The process itself (the root track).
    Process {
        /// OS process id.
        pid: u32,
        /// Process name.
        name: String,
    },
    /// One OS thread.
    Thread {
        /// OS process id.
        pid: u32,
        /// OS thread id.
        tid: u32,
        /// Thread name (or `thread-<tid>`).
        name: String,
    },
    /// A counter: values over time.
    Counter {
        /// Counter name.
        name: String,
        /// Unit shown next to the values (e.g. "ns", "ppm", "records"); empty for none.
        unit: String,
    },
    /// A named group of child tracks.
    Group {
        /// Display name.
        name: String,
    },
    /// A GPU device (a [`crate::gpu::GpuBackend`]): its queue tracks and its clock's counter tracks are its
    /// children.
    GpuDevice {
        /// The device's name, as its driver reports it.
        name: String,
        /// Its API, as the backend names it ("Vulkan", "CUDA", "wgpu-hal (Vulkan)", "simulated"...).
        api: String,
    },
    /// One lane of a GPU queue (parent: its device): GPU slices, each with its `uncertainty_ns`. A queue whose
    /// slices overlap without nesting gets more lanes.
    GpuQueue {
        /// The queue's name.
        name: String,
        /// 0 for the queue's first lane, 1.. for the lanes added for overlapping slices.
        lane: u32,
    },
    /// An async task: a span that lives across polls (see [`crate::AsyncTasks`]). It holds one slice for the
    /// span's life (creation to close) with the polls as its children; its child tasks are its child tracks.
    AsyncTask {
        /// The span's name and identifying fields, for display.
        name: String,
    },
}

/// A track's description, sent once before its first event.
#[derive(Clone, Debug, PartialEq)]
pub struct TrackDescriptor {
    /// The track.
    pub id: TrackId,
    /// Its parent, if any (a thread's parent is the process track).
    pub parent: Option<TrackId>,
    /// What it is.
    pub kind: TrackKind,
}

/// A field value: span fields, event fields, annotations.
#[derive(Clone, Debug, PartialEq)]
pub enum FieldValue {
    /// A signed integer.
    I64(i64),
    /// An unsigned integer.
    U64(u64),
    /// A float.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// Text (including `Debug`-formatted values).
    Str(String),
}

/// One named field of an event.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceField {
    /// The field's name.
    pub name: NameId,
    /// Its value.
    pub value: FieldValue,
}

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EventKind {
    /// A slice opens on the track.
    SliceBegin,
    /// The innermost open slice on the track closes.
    SliceEnd,
    /// A point in time.
    Instant,
    /// A counter track takes a new value.
    Counter(f64),
}

/// One converted event.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// Reference-clock (`CLOCK_MONOTONIC`) nanoseconds.
    pub ts_ns: u64,
    /// The track it belongs to.
    pub track: TrackId,
    /// What happened.
    pub kind: EventKind,
    /// Its name (for `SliceEnd` the name of the slice it closes; exporters may ignore it).
    pub name: NameId,
    /// Its fields: a range into [`Batch::fields`].
    pub fields: Range<u32>,
    /// A flow that starts at this event (towards another track), if any.
    pub flow_out: Option<u64>,
    /// A flow that ends at this event, if any.
    pub flow_in: Option<u64>,
}

/// The CPU clock a batch's timestamps were converted with: its tick source and the calibration (the
/// collector's newest fit of the live CPU calibration). With it an exporter maps a reference-ns timestamp back
/// to the raw counter, for viewers whose time axis is the raw counter (Tracy's is the TSC).
///
/// ```
/// use tickline::{calibration::{ClockCalibration, ClockDomain}, clock::{RawTicks, TickSource}, export::CpuClock};
/// let domain = ClockDomain::new(64, 0.4).unwrap();
/// let calibration = ClockCalibration::from_anchor(domain, 1_000_000, 5_000_000_000, 0.4).unwrap();
/// let clock = CpuClock { source: TickSource::Tsc, calibration };
/// assert_eq!(clock.to_ns(RawTicks(3_500_000)), 5_001_000_000);
/// assert_eq!(clock.to_ticks(5_001_000_000), RawTicks(3_500_000));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuClock {
    /// The counter the threads' ticks were read from.
    pub source: TickSource,
    /// Raw ticks to reference (`CLOCK_MONOTONIC`) ns, as the batch's CPU events were converted.
    pub calibration: ClockCalibration,
}

impl CpuClock {
    /// Raw ticks of `source` at reference time `ns` (the inverse of [`to_ns`](Self::to_ns) to within a tick).
    pub fn to_ticks(&self, ns: u64) -> RawTicks {
        RawTicks(self.calibration.from_reference_ns(ns))
    }

    /// Reference ns of raw ticks, as the collector converts CPU ticks.
    pub fn to_ns(&self, ticks: RawTicks) -> u64 {
        self.calibration.to_reference_ns(ticks.0)
    }
}

/// A fact about a track that is no event: which CPU clock the process records and why, say. Exporters show
/// it as the viewer allows (Perfetto: an instant carrying the value on that track; memory: a list of its own).
#[derive(Clone, Debug, PartialEq)]
pub struct TrackMetadata {
    /// The track it describes (the process track for process-wide facts).
    pub track: TrackId,
    /// When it became known (reference-clock ns).
    pub ts_ns: u64,
    /// What it is about ("tickline: CPU clock").
    pub name: NameId,
    /// Its fields: a range into [`Batch::fields`].
    pub fields: Range<u32>,
}

/// A batch handed to exporters: new tracks and names first, then events.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// Tracks first used in this batch, parents before children.
    pub new_tracks: Vec<TrackDescriptor>,
    /// Names first used in this batch.
    pub new_names: Vec<(NameId, String)>,
    /// Events, in timestamp order per track.
    pub events: Vec<TraceEvent>,
    /// The field arena the events' `fields` ranges point into.
    pub fields: Vec<TraceField>,
    /// Facts about tracks that are no events, in the order they became known.
    pub metadata: Vec<TrackMetadata>,
    /// The CPU clock the events were converted with: the live calibration's newest fit, set by a running
    /// timeline's collector on every batch it exports. `None` in batches made by hand, and in a raw capture's
    /// conversion ([`crate::capture::convert`]), whose CPU timestamps come from the whole calibration history,
    /// piecewise, which no single line describes.
    pub cpu_clock: Option<CpuClock>,
}

impl Batch {
    /// Empties the batch, keeping its allocations.
    pub fn clear(&mut self) {
        self.new_tracks.clear();
        self.new_names.clear();
        self.events.clear();
        self.fields.clear();
        self.metadata.clear();
    }

    /// The fields of `event`.
    pub fn fields_of(&self, event: &TraceEvent) -> &[TraceField] {
        &self.fields[event.fields.start as usize..event.fields.end as usize]
    }

    /// The fields of `metadata`.
    pub fn metadata_fields(&self, metadata: &TrackMetadata) -> &[TraceField] {
        &self.fields[metadata.fields.start as usize..metadata.fields.end as usize]
    }

    /// True when there is nothing in it.
    pub fn is_empty(&self) -> bool {
        self.new_tracks.is_empty() && self.new_names.is_empty() && self.events.is_empty() && self.metadata.is_empty()
    }
}

/// Why an exporter failed. The collector keeps running and reports it through the timeline handle.
#[derive(Debug)]
#[non_exhaustive]
pub enum ExportError {
    /// Writing failed (disk full, file closed, pipe gone).
    Io(std::io::Error),
    /// The exporter's own failure, in words.
    Other(String),
    /// The exporter panicked (the panic's message): it is called no more, the other exporters go on.
    Panicked(String),
}

impl fmt::Display for ExportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExportError::Io(e) => write!(f, "export I/O error: {e}"),
            ExportError::Other(s) => write!(f, "export error: {s}"),
            ExportError::Panicked(s) => write!(f, "the exporter panicked: {s}"),
        }
    }
}

impl std::error::Error for ExportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ExportError::Io(e) => Some(e),
            ExportError::Other(_) | ExportError::Panicked(_) => None,
        }
    }
}

impl From<std::io::Error> for ExportError {
    fn from(e: std::io::Error) -> Self {
        ExportError::Io(e)
    }
}

/// Where and when the events an exporter gets were recorded: this process now, or, for a raw capture
/// converted later ([`crate::capture::convert`]), the process that wrote the capture.
///
/// An exporter that writes identity or clock snapshots of its own (the Perfetto exporter does) takes them
/// from here when [`replay`](Self::replay) is set, instead of from the process it runs in.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RecordingOrigin {
    /// The machine the events were recorded on.
    pub host: crate::HostInfo,
    /// The recording process's id.
    pub pid: u32,
    /// The recording process's name.
    pub process_name: String,
    /// The host clocks read together while recording (at its start, about every second, at its end), oldest
    /// first; empty for a live timeline, whose exporters read the clocks themselves.
    pub clocks: Vec<crate::ClockReadings>,
    /// The host's time-sync state (`adjtimex`) read with each of [`clocks`](Self::clocks), where the recording
    /// kept it (`None` for a reading without it; shorter than `clocks`, or empty, for a capture from before it).
    pub clock_sync: Vec<Option<crate::sync::TimeSyncState>>,
    /// The events are a capture converted after the fact: the exporting process is not the recording one.
    pub replay: bool,
    /// Identifies the recording: drawn when a timeline starts, and kept in its raw capture, so every trace
    /// made of one recording (written live, converted from its capture, converted again) carries the same.
    /// `tickline merge` refuses two traces of one recording.
    pub recording: crate::sync::TraceUuid,
    /// Whether the recording ended with its timeline stopped (a live timeline's exporters are finished only
    /// then: `true`), or was cut short: a converted capture that its process never finished (killed,
    /// aborted). Exporters say so in the trace (the Perfetto exporter's end marker).
    pub finished: bool,
}

impl RecordingOrigin {
    /// This process, recording live.
    ///
    /// ```
    /// let origin = tickline::export::RecordingOrigin::this_process();
    /// assert_eq!(origin.pid, std::process::id());
    /// assert!(!origin.replay);
    /// ```
    pub fn this_process() -> RecordingOrigin {
        RecordingOrigin {
            host: crate::HostInfo::current().clone(),
            pid: std::process::id(),
            process_name: crate::process_name(),
            clocks: Vec::new(),
            clock_sync: Vec::new(),
            replay: false,
            recording: crate::sync::TraceUuid::new_random(),
            finished: true,
        }
    }
}

/// A sink for converted events: a trace file, a live viewer, memory.
///
/// `origin` comes first, once, on the thread that starts the timeline (or converts a capture); the others
/// are called from the collector thread only: `export` gets every batch in order; `flush` makes everything
/// exported so far durable or visible; `finish` is the last call (the timeline is shutting down).
///
/// An exporter that returns an error, or panics, in any of them is called no more; the timeline keeps
/// running for the other exporters, counts it in `TimelineStats::export_failures`, and returns the first
/// failure from `Timeline::flush` and `Timeline::shutdown` ([`ExportError::Panicked`] for a panic, whose
/// message the panic hook also prints; a program built with `panic = "abort"` ends there instead).
pub trait Exporter: Send {
    /// Where the events were recorded (this process, or a converted capture's), before the first batch.
    /// The default ignores it.
    fn origin(&mut self, origin: &RecordingOrigin) {
        let _ = origin;
    }
    /// Takes one batch.
    fn export(&mut self, batch: &Batch) -> Result<(), ExportError>;
    /// Makes what was exported so far durable/visible.
    fn flush(&mut self) -> Result<(), ExportError>;
    /// The timeline is done: flush and close.
    fn finish(&mut self) -> Result<(), ExportError> {
        self.flush()
    }
}

/// One event as a [`MemoryExporter`] keeps it: names resolved to strings.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedEvent {
    /// Reference-clock ns.
    pub ts_ns: u64,
    /// Its track.
    pub track: TrackId,
    /// What happened.
    pub kind: EventKind,
    /// Its name.
    pub name: String,
    /// Its fields, by name.
    pub fields: Vec<(String, FieldValue)>,
    /// A flow starting here.
    pub flow_out: Option<u64>,
    /// A flow ending here.
    pub flow_in: Option<u64>,
}

/// A complete slice as [`MemoryTrace::slices`] pairs it.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedSlice {
    /// Its track.
    pub track: TrackId,
    /// Its name.
    pub name: String,
    /// Begin, reference-clock ns.
    pub begin_ns: u64,
    /// End, reference-clock ns.
    pub end_ns: u64,
    /// Its fields: the begin's, with the end's added or replacing.
    pub fields: Vec<(String, FieldValue)>,
    /// How many slices enclose it on its track.
    pub depth: usize,
    /// A flow that ends at it: at its begin (a GPU slice's flow from the CPU), or at its end (an async task's
    /// poll, from its slice on the thread that polled it, which ends then too).
    pub flow_in: Option<u64>,
    /// A flow that starts at it (on its begin or its end): a poll of an async task on a thread track. The flow
    /// to a GPU slice starts at an instant, not a slice: a [`RecordedEvent`] named after the GPU scope, on the
    /// thread that recorded it, where the scope began. (`tickline.flow_out` fields stay fields here: the
    /// Perfetto exporter and `tickline merge` turn them into flows.)
    pub flow_out: Option<u64>,
}

impl RecordedSlice {
    /// The value of field `name`, if it has one.
    pub fn field(&self, name: &str) -> Option<&FieldValue> {
        self.fields.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

/// A [`TrackMetadata`] as a [`MemoryExporter`] keeps it: names resolved to strings.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedMetadata {
    /// The track it describes.
    pub track: TrackId,
    /// When it became known (reference-clock ns).
    pub ts_ns: u64,
    /// What it is about.
    pub name: String,
    /// Its fields, by name.
    pub fields: Vec<(String, FieldValue)>,
}

impl RecordedMetadata {
    /// The value of field `name`, if it has one.
    pub fn field(&self, name: &str) -> Option<&FieldValue> {
        self.fields.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

/// Everything a [`MemoryExporter`] received.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryTrace {
    /// Track descriptions, in the order they arrived.
    pub tracks: Vec<TrackDescriptor>,
    /// Events, in the order they arrived (timestamp order per track).
    pub events: Vec<RecordedEvent>,
    /// Facts about tracks, in the order they arrived (the CPU clock decision, say).
    pub metadata: Vec<RecordedMetadata>,
    /// Batches received.
    pub batches: u64,
    /// `flush` calls.
    pub flushes: u64,
    /// Whether `finish` was called.
    pub finished: bool,
}

impl MemoryTrace {
    /// The track with this id.
    pub fn track(&self, id: TrackId) -> Option<&TrackDescriptor> {
        self.tracks.iter().find(|t| t.id == id)
    }

    /// The thread track of the OS thread named `name`.
    pub fn thread_track(&self, name: &str) -> Option<TrackId> {
        self.tracks.iter().find_map(|t| match &t.kind {
            TrackKind::Thread { name: n, .. } if n == name => Some(t.id),
            _ => None,
        })
    }

    /// Whether `track` is an OS thread's track.
    pub fn is_thread_track(&self, track: TrackId) -> bool {
        self.track(track)
            .is_some_and(|t| matches!(t.kind, TrackKind::Thread { .. }))
    }

    /// The async task tracks (see [`crate::AsyncTasks`]), in the order they arrived: each holds its span's
    /// lifetime slice with the polls as children; a child task's track has its parent task's as parent. A task
    /// whose polls overlapped (entered on two threads at once) also has lanes for them, tracks of this kind
    /// named `"{name} (polls 2)"` and so on, whose parent is the task's track.
    pub fn async_task_tracks(&self) -> Vec<&TrackDescriptor> {
        self.tracks
            .iter()
            .filter(|t| matches!(t.kind, TrackKind::AsyncTask { .. }))
            .collect()
    }

    /// Events on `track`.
    pub fn events_on(&self, track: TrackId) -> impl Iterator<Item = &RecordedEvent> {
        self.events.iter().filter(move |e| e.track == track)
    }

    /// Every complete slice, begins paired with their ends per track (as a viewer pairs them), in the order
    /// their ends were received: by end time on each track, not across tracks (the collector sends each track's
    /// events in time order, and tracks' events interleave as the batches bring them). A slice's fields are its begin's, with what its end carries added or replacing (a slice
    /// exported before it ended carries later values on its end; markers such as `tickline.truncated` may be
    /// on either), which is what Perfetto shows.
    ///
    /// ```
    /// let memory = tickline::export::MemoryExporter::default();
    /// let timeline = tickline::Timeline::builder().exporter(memory.clone()).start().unwrap();
    /// drop(tickline::scope!("load"));
    /// timeline.flush().unwrap();
    /// let slices = memory.snapshot().slices();
    /// assert_eq!(slices.len(), 1);
    /// assert!(slices[0].end_ns >= slices[0].begin_ns);
    /// ```
    pub fn slices(&self) -> Vec<RecordedSlice> {
        let mut open: std::collections::HashMap<TrackId, Vec<&RecordedEvent>> = std::collections::HashMap::new();
        let mut slices = Vec::new();
        for e in &self.events {
            match e.kind {
                EventKind::SliceBegin => open.entry(e.track).or_default().push(e),
                EventKind::SliceEnd => {
                    let Some(begin) = open.get_mut(&e.track).and_then(Vec::pop) else {
                        continue;
                    };
                    let mut fields = begin.fields.clone();
                    for (name, value) in &e.fields {
                        match fields.iter_mut().find(|(n, _)| n == name) {
                            Some(f) => f.1 = value.clone(),
                            None => fields.push((name.clone(), value.clone())),
                        }
                    }
                    slices.push(RecordedSlice {
                        track: e.track,
                        name: begin.name.clone(),
                        begin_ns: begin.ts_ns,
                        end_ns: e.ts_ns,
                        fields,
                        depth: open.get(&e.track).map_or(0, Vec::len),
                        flow_in: begin.flow_in.or(e.flow_in),
                        flow_out: begin.flow_out.or(e.flow_out),
                    });
                }
                _ => {}
            }
        }
        slices
    }

    /// How many slices named `name` began.
    pub fn slice_count(&self, name: &str) -> usize {
        self.events
            .iter()
            .filter(|e| e.kind == EventKind::SliceBegin && e.name == name)
            .count()
    }
}

/// An exporter that keeps everything in memory, for tests and for inspecting a timeline in-process.
/// Clones share the same storage: keep one to read what the timeline exported.
///
/// ```
/// let memory = tickline::export::MemoryExporter::default();
/// let timeline = tickline::Timeline::builder().exporter(memory.clone()).start().unwrap();
/// {
///     let _s = tickline::scope!("load");
/// }
/// timeline.flush().unwrap();
/// assert_eq!(memory.snapshot().slice_count("load"), 1);
/// ```
#[derive(Clone, Debug, Default)]
pub struct MemoryExporter {
    inner: std::sync::Arc<std::sync::Mutex<(MemoryTrace, std::collections::HashMap<NameId, String>)>>,
}

impl MemoryExporter {
    /// An empty one (the same as `MemoryExporter::default()`); keep a clone to read what it receives.
    ///
    /// ```
    /// let memory = tickline::export::MemoryExporter::new();
    /// let timeline = tickline::Timeline::builder().exporter(memory.clone()).start().unwrap();
    /// drop(tickline::scope!("work"));
    /// timeline.shutdown().unwrap();
    /// assert_eq!(memory.snapshot().slice_count("work"), 1);
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of everything received so far.
    pub fn snapshot(&self) -> MemoryTrace {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).0.clone()
    }
}

impl Exporter for MemoryExporter {
    fn export(&mut self, batch: &Batch) -> Result<(), ExportError> {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (trace, names) = &mut *guard;
        trace.batches += 1;
        trace.tracks.extend(batch.new_tracks.iter().cloned());
        names.extend(batch.new_names.iter().cloned());
        let name_of = |id: NameId| names.get(&id).cloned().unwrap_or_else(|| format!("<name {}>", id.0));
        for e in &batch.events {
            trace.events.push(RecordedEvent {
                ts_ns: e.ts_ns,
                track: e.track,
                kind: e.kind,
                name: name_of(e.name),
                fields: batch
                    .fields_of(e)
                    .iter()
                    .map(|f| (name_of(f.name), f.value.clone()))
                    .collect(),
                flow_out: e.flow_out,
                flow_in: e.flow_in,
            });
        }
        for m in &batch.metadata {
            trace.metadata.push(RecordedMetadata {
                track: m.track,
                ts_ns: m.ts_ns,
                name: name_of(m.name),
                fields: batch
                    .metadata_fields(m)
                    .iter()
                    .map(|f| (name_of(f.name), f.value.clone()))
                    .collect(),
            });
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), ExportError> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).0.flushes += 1;
        Ok(())
    }

    fn finish(&mut self) -> Result<(), ExportError> {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        guard.0.flushes += 1;
        guard.0.finished = true;
        Ok(())
    }
}
