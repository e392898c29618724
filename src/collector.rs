//! The collector: one background thread that drains every ring in batches, converts raw ticks with the live
//! calibration, keeps per-track order and hands [`Batch`]es to the exporters. Also [`Timeline`], its handle.
//!
//! The thread is never woken per event: it polls the rings every `poll_interval` (1 ms by default) and
//! wakes early only for control messages (a new ring, flush, shutdown).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};
use tracing::Metadata;

use crate::clock::{monotonic_ns, FastConverter, TickSource, TscCalibrator};
use crate::clock::{TickSourceDecision, TscCalibratorConfig, TscDecider};
use crate::error::TicklineError;
use crate::export::{
    Batch, CpuClock, Event, EventKind, ExportError, Exporter, Field, FieldValue, NameId, TrackDescriptor, TrackId,
    TrackKind,
};
use crate::gpu::{GpuBackend, GpuCalibrationConfig, GpuCollector, GpuControl, GpuDevice};
use crate::layer::TicklineLayer;
use crate::live::{self, LiveSink};
use crate::record::{collect_payload, decode_fields, restore_ticks, Kind, RawValue, Record};
use crate::recorder::{self, Control, Shared};
use crate::ring::Consumer;
use crate::scope::Callsite;

/// Configures and starts a [`Timeline`].
///
/// ```
/// let timeline = tickline::Timeline::builder()
///     .lossless(true)
///     .ring_capacity(1 << 14)
///     .start()
///     .unwrap();
/// timeline.flush().unwrap();
/// ```
#[must_use = "a builder does nothing until `start()`"]
pub struct TimelineBuilder {
    exporters: Vec<Box<dyn Exporter>>,
    lossless: bool,
    ring_capacity: usize,
    poll_interval: Duration,
    tick_source: Option<TickSource>,
    calibration: TscCalibratorConfig,
    gpu_calibration: GpuCalibrationConfig,
    max_records_per_pass: usize,
    live: Option<Arc<dyn LiveSink>>,
}

impl std::fmt::Debug for TimelineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimelineBuilder")
            .field("exporters", &self.exporters.len())
            .field("lossless", &self.lossless)
            .field("ring_capacity", &self.ring_capacity)
            .field("poll_interval", &self.poll_interval)
            .field("tick_source", &self.tick_source)
            .field("live_sink", &self.live.is_some())
            .finish()
    }
}

impl Default for TimelineBuilder {
    fn default() -> Self {
        TimelineBuilder {
            exporters: Vec::new(),
            lossless: false,
            // 64 Ki records = 1 MiB per thread: ~30 ms of a thread recording a span every 250 ns.
            ring_capacity: 1 << 16,
            poll_interval: Duration::from_millis(1),
            tick_source: None,
            calibration: TscCalibratorConfig::default(),
            gpu_calibration: GpuCalibrationConfig::default(),
            max_records_per_pass: 1 << 16,
            live: None,
        }
    }
}

impl TimelineBuilder {
    /// Adds an exporter (Perfetto file, Tracy, memory...). Every exporter gets every batch.
    pub fn exporter(mut self, exporter: impl Exporter + 'static) -> Self {
        self.exporters.push(Box::new(exporter));
        self
    }

    /// Lossless mode: a thread whose ring is full waits for the collector instead of dropping the record.
    /// For tests and offline captures; the default (drop and count) never stalls the application.
    pub fn lossless(mut self, lossless: bool) -> Self {
        self.lossless = lossless;
        self
    }

    /// Records per thread ring (rounded up to a power of two, at least 64). Each record is 16 bytes.
    pub fn ring_capacity(mut self, records: usize) -> Self {
        self.ring_capacity = records.max(64);
        self
    }

    /// How often the collector drains the rings.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(Duration::from_micros(50));
        self
    }

    /// Forces the CPU tick source instead of checking the TSC's reliability at start.
    pub fn tick_source(mut self, source: TickSource) -> Self {
        self.tick_source = Some(source);
        self
    }

    /// How the CPU clock is calibrated (burst size and interval, history).
    pub fn calibration(mut self, config: TscCalibratorConfig) -> Self {
        self.calibration = config;
        self
    }

    /// How GPU device clocks are calibrated: burst size, schedule and time budget, and how long a finished
    /// GPU slice may wait for a calibration point after it.
    pub fn gpu_calibration(mut self, config: GpuCalibrationConfig) -> Self {
        self.gpu_calibration = config;
        self
    }

    /// Longest time a finished GPU slice is held for a two-sided (interpolated) conversion before it is
    /// converted with the newest fit and exported (default 5 s). Shorter: less latency (live viewers); longer:
    /// more slices placed by interpolation.
    pub fn gpu_latency_bound(mut self, bound: Duration) -> Self {
        self.gpu_calibration.latency_bound = bound;
        self
    }

    /// Installs a [`LiveSink`]: hooks called on the instrumented thread as the layer and the native macros
    /// record (for live viewers, such as the Tracy exporter, that must emit on the thread itself). The sink
    /// is kept for the rest of the process (see [`LiveSink`]).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # struct Nothing;
    /// # impl tickline::LiveSink for Nothing {
    /// #     fn span_enter(&self, _: &'static tracing::Metadata<'static>, _: Option<&tickline::LiveSpanData>) {}
    /// #     fn span_exit(&self) {}
    /// #     fn scope_begin(&self, _: &'static tickline::Callsite) {}
    /// #     fn scope_end(&self, _: &'static tickline::Callsite) {}
    /// # }
    /// let timeline = tickline::Timeline::builder().live_sink(Arc::new(Nothing)).start().unwrap();
    /// # drop(timeline);
    /// ```
    pub fn live_sink(mut self, sink: Arc<dyn LiveSink>) -> Self {
        self.live = Some(sink);
        self
    }

    /// Checks the tick source, calibrates it, and starts the collector thread.
    pub fn start(self) -> Result<Timeline, TicklineError> {
        // The process's cached decision: the first start runs the short up-front check (the full one finishes in
        // the background), later starts reuse it (issue 14).
        let decision = match self.tick_source {
            Some(source) => TickSourceDecision::forced(source),
            None => TscDecider::process().decide(),
        };
        let (source, tsc_fallback_reason) = (decision.source, decision.fallback_reason);
        let calibrator = TscCalibrator::new(source, self.calibration)?;
        let (control_tx, control_rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared {
            id: recorder::next_timeline_id(),
            control: control_tx,
            lossless: self.lossless,
            ring_capacity: self.ring_capacity,
            source,
            running: AtomicBool::new(true),
        });
        let stats = Arc::new(SharedStats::default());
        let mut collector = Collector {
            rx: control_rx,
            exporters: self
                .exporters
                .into_iter()
                .map(|e| ExporterSlot {
                    exporter: e,
                    failed: false,
                })
                .collect(),
            calibrator,
            processor: Processor::new(std::process::id(), self.gpu_calibration),
            rings: Vec::new(),
            stats: stats.clone(),
            poll_interval: self.poll_interval,
            max_records_per_pass: self.max_records_per_pass,
        };
        let thread = std::thread::Builder::new()
            .name("tickline-collector".into())
            .spawn(move || collector.run())
            .map_err(TicklineError::CollectorSpawn)?;
        let live = self.live.map(live::leak);
        recorder::set_current(&shared);
        live::set_current(shared.id, live);
        Ok(Timeline {
            shared,
            thread: Some(thread),
            stats,
            source,
            tsc_fallback_reason,
            live,
        })
    }
}

/// Counters of a running timeline. Every record is accounted for: `records + dropped_records` is what the
/// threads produced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimelineStats {
    /// Records taken from the rings.
    pub records: u64,
    /// Records dropped because a ring was full (drop mode).
    pub dropped_records: u64,
    /// Events handed to the exporters.
    pub events: u64,
    /// Thread rings registered so far.
    pub threads: u64,
    /// Exits or scope ends with no matching open slice on their thread (dropped from the output).
    pub unmatched_ends: u64,
    /// Span records whose span was never announced (shown as "unknown span").
    pub unknown_spans: u64,
    /// Timestamps held back to keep a track's time from going backwards across a recalibration.
    pub monotonic_clamps: u64,
    /// Exporter failures (each failed exporter is counted once and then skipped).
    pub export_failures: u64,
    /// GPU scopes whose begin reached the collector.
    pub gpu_scopes: u64,
    /// GPU scopes never finished by the GPU within the loss bound (their commands were not submitted), or whose
    /// device was unknown. Their flows have no GPU end.
    pub gpu_lost_scopes: u64,
    /// GPU slices that converted to before the CPU recorded them: calibration failures (clamped for display).
    pub gpu_causality_violations: u64,
    /// GPU calibration bursts that failed or gave no usable sample.
    pub gpu_failed_calibrations: u64,
}

#[derive(Default)]
struct SharedStats {
    records: AtomicU64,
    dropped_records: AtomicU64,
    events: AtomicU64,
    threads: AtomicU64,
    unmatched_ends: AtomicU64,
    unknown_spans: AtomicU64,
    monotonic_clamps: AtomicU64,
    export_failures: AtomicU64,
    gpu_scopes: AtomicU64,
    gpu_lost_scopes: AtomicU64,
    gpu_causality_violations: AtomicU64,
    gpu_failed_calibrations: AtomicU64,
    first_export_error: Mutex<Option<(std::io::ErrorKind, String)>>,
}

/// A running timeline: a collector thread and its exporters. Dropping it drains everything recorded before
/// the drop, finishes the exporters and joins the thread.
///
/// ```
/// use tracing_subscriber::layer::SubscriberExt;
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// let subscriber = tracing_subscriber::registry().with(timeline.layer());
/// tracing::subscriber::with_default(subscriber, || {
///     tracing::info_span!("step").in_scope(|| {});
/// });
/// let stats = timeline.shutdown().unwrap();
/// assert_eq!(stats.dropped_records, 0);
/// ```
pub struct Timeline {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    stats: Arc<SharedStats>,
    source: TickSource,
    tsc_fallback_reason: Option<String>,
    live: Option<&'static dyn LiveSink>,
}

impl std::fmt::Debug for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timeline")
            .field("id", &self.shared.id)
            .field("source", &self.source)
            .finish()
    }
}

impl Timeline {
    /// A builder with the defaults: drop mode, 64 Ki records per thread, 1 ms polling, TSC checked at start.
    pub fn builder() -> TimelineBuilder {
        TimelineBuilder::default()
    }

    /// The `tracing` layer that records into this timeline.
    pub fn layer(&self) -> TicklineLayer {
        TicklineLayer::new(self.shared.clone(), self.live)
    }

    /// The CPU tick source in use.
    pub fn tick_source(&self) -> TickSource {
        self.source
    }

    /// Why the TSC is not used, when it is not.
    pub fn tsc_fallback_reason(&self) -> Option<&str> {
        self.tsc_fallback_reason.as_deref()
    }

    /// Counters so far.
    pub fn stats(&self) -> TimelineStats {
        let s = &self.stats;
        TimelineStats {
            records: s.records.load(Ordering::Relaxed),
            dropped_records: s.dropped_records.load(Ordering::Relaxed),
            events: s.events.load(Ordering::Relaxed),
            threads: s.threads.load(Ordering::Relaxed),
            unmatched_ends: s.unmatched_ends.load(Ordering::Relaxed),
            unknown_spans: s.unknown_spans.load(Ordering::Relaxed),
            monotonic_clamps: s.monotonic_clamps.load(Ordering::Relaxed),
            export_failures: s.export_failures.load(Ordering::Relaxed),
            gpu_scopes: s.gpu_scopes.load(Ordering::Relaxed),
            gpu_lost_scopes: s.gpu_lost_scopes.load(Ordering::Relaxed),
            gpu_causality_violations: s.gpu_causality_violations.load(Ordering::Relaxed),
            gpu_failed_calibrations: s.gpu_failed_calibrations.load(Ordering::Relaxed),
        }
    }

    /// Adds a GPU device to the timeline: its clock is calibrated live by the collector, and
    /// [`gpu_scope!`](macro@crate::gpu_scope)s recorded through its queues appear under a "GPU" track.
    ///
    /// ```
    /// use tickline::gpu::sim::{SimGpu, SimGpuConfig};
    /// let timeline = tickline::Timeline::builder().start().unwrap();
    /// let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
    /// let queue = gpu.queue("compute").unwrap();
    /// # let _ = queue;
    /// ```
    pub fn gpu<B: GpuBackend>(&self, backend: B) -> Result<GpuDevice<B>, TicklineError> {
        GpuDevice::register(&self.shared, backend)
    }

    /// Drains everything recorded before this call, exports it and flushes the exporters.
    ///
    /// Fails if an exporter has failed since the start (the first failure is reported), or if the collector
    /// is gone.
    pub fn flush(&self) -> Result<(), TicklineError> {
        self.request(Control::Flush)
    }

    fn request(&self, make: fn(crossbeam_channel::Sender<Result<(), String>>) -> Control) -> Result<(), TicklineError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.shared
            .control
            .send(make(tx))
            .map_err(|_| TicklineError::CollectorGone)?;
        match rx.recv() {
            Err(_) => Err(TicklineError::CollectorGone),
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(self.export_error()),
        }
    }

    fn export_error(&self) -> TicklineError {
        let first = self
            .stats
            .first_export_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match first {
            Some((kind, message)) => TicklineError::Export(ExportError::Io(std::io::Error::new(kind, message))),
            None => TicklineError::CollectorGone,
        }
    }

    /// Stops recording, drains everything, finishes the exporters and joins the collector. Returns the final
    /// counters, or the first export failure.
    pub fn shutdown(mut self) -> Result<TimelineStats, TicklineError> {
        self.stop()?;
        Ok(self.stats())
    }

    fn stop(&mut self) -> Result<(), TicklineError> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        self.shared.running.store(false, Ordering::Release);
        recorder::clear_current(self.shared.id);
        live::clear_current(self.shared.id);
        let result = self.request(Control::Shutdown);
        let joined = thread.join();
        match (result, joined) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(e), _) => Err(e),
            (Ok(()), Err(_)) => Err(TicklineError::CollectorGone),
        }
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("tickline: {e}");
        }
    }
}

struct ExporterSlot {
    exporter: Box<dyn Exporter>,
    failed: bool,
}

/// One thread's ring and its track state.
struct RingState {
    consumer: Consumer<Record>,
    track: TrackId,
    /// Records drained but not yet turned into events (a span not yet announced holds back the rest).
    staging: Vec<Record>,
    /// Index in `staging` up to which span announcements have been applied.
    announced_upto: usize,
    /// Passes the head of `staging` has waited for an unknown span.
    waited_passes: u32,
    open: Vec<Open>,
    last_ns: u64,
    closed: bool,
}

#[derive(Clone, Copy)]
struct Open {
    key: u64,
    name: NameId,
}

/// A span announced by `SpanNew` or `SpanNewBare`: its name and fields.
struct SpanInfo {
    name: NameId,
    meta: u64,
    fields: Vec<Field>,
    /// The pass in which it closed; removed two passes later (a thread's last exit may still be in flight).
    closed_in: Option<u64>,
}

/// Hashes u64 keys (addresses, span ids) with one multiply: the collector looks one up per event, and
/// SipHash's DoS resistance buys nothing for keys the process made itself.
#[derive(Clone, Copy, Default)]
struct IdHasher(u64);

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
        // A folded 64x64->128 multiply spreads the key over both halves: addresses are 16-byte aligned, and
        // the table indexes with the low bits and tags with the high ones.
        let product = u128::from(self.0 ^ key) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }
}

type IdMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;

/// A field payload kept raw: its data records and length in bytes.
type RawPayload = (Vec<Record>, usize);

/// What the collector knows about a callsite address.
struct CallsiteInfo {
    name: NameId,
    field_names: Vec<NameId>,
    counter_track: Option<TrackId>,
}

/// Turns drained records into a batch. Single-threaded; owns the interning tables.
pub(crate) struct Processor {
    pid: u32,
    batch: Batch,
    names: HashMap<&'static str, NameId>,
    callsites: IdMap<CallsiteInfo>,
    spans: IdMap<SpanInfo>,
    /// Field updates (`record`) seen before their span's announcement: raw payloads, applied on announcement.
    /// Keyed by span id: the pass first seen, and the payloads. Forgotten after a few passes (the
    /// announcement was dropped by a full ring).
    pending_span_records: IdMap<(u64, Vec<RawPayload>)>,
    closed_spans: Vec<(u64, u64)>,
    next_track: u64,
    process_track: TrackId,
    own_counters: Option<OwnCounters>,
    counter_events: Vec<Event>,
    counter_last_ns: HashMap<TrackId, u64>,
    pass: u64,
    payload: Vec<u8>,
    stats: TimelineStats,
    gpu: GpuCollector,
}

struct OwnCounters {
    dropped: TrackId,
    drift: TrackId,
    error_bound: TrackId,
    value_name: NameId,
}

const UNKNOWN_SPAN: &str = "unknown span";
/// Longest a shutdown waits for GPU scopes still in flight.
const GPU_SHUTDOWN_WAIT: Duration = Duration::from_secs(1);
/// Passes a record waits for its span's announcement before it is shown as unknown. One pass is enough in
/// theory (the announcement happened before the enter, so the next pass's drain sees it); two give margin.
const MAX_WAIT_PASSES: u32 = 2;

/// Recovers the `'static` metadata whose address a record carries.
fn metadata_at(addr: u64) -> &'static Metadata<'static> {
    let ptr = std::ptr::with_exposed_provenance::<Metadata<'static>>(addr as usize);
    debug_assert!(!ptr.is_null());
    // SAFETY: the address was written by `layer::meta_addr` from a `&'static Metadata<'static>` of this
    // process (records never cross processes), and `'static` data is never freed.
    unsafe { &*ptr }
}

/// Recovers the native callsite whose address a record carries.
fn callsite_at(addr: u64) -> &'static Callsite {
    let ptr = std::ptr::with_exposed_provenance::<Callsite>(addr as usize);
    debug_assert!(!ptr.is_null());
    // SAFETY: the address was written by `Callsite::addr` from a `&'static Callsite` (a `static` in a macro
    // expansion) of this process, and statics are never freed.
    unsafe { &*ptr }
}

/// A parsed group: the record, its payload header `(len, meta)` and data records.
struct Group<'a> {
    head: Record,
    kind: Option<Kind>,
    header: Option<(usize, u64)>,
    data: &'a [Record],
    len: usize,
}

fn group_at(records: &[Record], i: usize) -> Group<'_> {
    let head = records[i];
    let kind = head.kind();
    match kind {
        Some(Kind::SpanNew | Kind::SpanRecord | Kind::Event | Kind::GpuBegin) => {
            let Some(h) = records.get(i + 1) else {
                return Group {
                    head,
                    kind: None,
                    header: None,
                    data: &[],
                    len: 1,
                };
            };
            let len = h.ticks_low() as usize;
            let n = Record::data_records(len);
            let end = (i + 2 + n).min(records.len());
            Group {
                head,
                kind,
                header: Some((len, h.word1)),
                data: &records[i + 2..end],
                len: end - i,
            }
        }
        Some(Kind::Counter) => {
            let end = (i + 2).min(records.len());
            Group {
                head,
                kind,
                header: None,
                data: &records[i + 1..end],
                len: end - i,
            }
        }
        _ => Group {
            head,
            kind,
            header: None,
            data: &[],
            len: 1,
        },
    }
}

impl Processor {
    pub(crate) fn new(pid: u32, gpu_calibration: GpuCalibrationConfig) -> Self {
        let mut p = Processor {
            pid,
            batch: Batch::default(),
            names: HashMap::new(),
            callsites: IdMap::default(),
            spans: IdMap::default(),
            pending_span_records: IdMap::default(),
            closed_spans: Vec::new(),
            next_track: 1,
            process_track: TrackId(0),
            own_counters: None,
            counter_events: Vec::new(),
            counter_last_ns: HashMap::new(),
            pass: 0,
            payload: Vec::new(),
            stats: TimelineStats::default(),
            gpu: GpuCollector::new(gpu_calibration),
        };
        let process_name = std::env::args()
            .next()
            .and_then(|a| {
                std::path::Path::new(&a)
                    .file_name()
                    .map(|f| f.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| format!("process {pid}"));
        p.process_track = p.new_track(
            None,
            TrackKind::Process {
                pid,
                name: process_name,
            },
        );
        let dropped = p.new_counter_track("tickline dropped records", "records");
        let drift = p.new_counter_track("tickline TSC drift", "ppm");
        let error_bound = p.new_counter_track("tickline TSC error bound", "ns");
        let value_name = p.intern("value");
        p.own_counters = Some(OwnCounters {
            dropped,
            drift,
            error_bound,
            value_name,
        });
        p
    }

    pub(crate) fn new_track(&mut self, parent: Option<TrackId>, kind: TrackKind) -> TrackId {
        let id = TrackId(self.next_track);
        self.next_track += 1;
        self.batch.new_tracks.push(TrackDescriptor { id, parent, kind });
        id
    }

    fn new_counter_track(&mut self, name: &str, unit: &str) -> TrackId {
        let parent = Some(self.process_track);
        self.new_track(
            parent,
            TrackKind::Counter {
                name: name.to_owned(),
                unit: unit.to_owned(),
            },
        )
    }

    pub(crate) fn new_thread_track(&mut self, tid: u32, name: String) -> TrackId {
        let (pid, parent) = (self.pid, Some(self.process_track));
        self.new_track(parent, TrackKind::Thread { pid, tid, name })
    }

    /// The process track (the root).
    pub(crate) fn process_track(&self) -> TrackId {
        self.process_track
    }

    /// The name of counter values ("value").
    pub(crate) fn value_name(&self) -> NameId {
        self.own_counters.as_ref().expect("created in new").value_name
    }

    pub(crate) fn intern(&mut self, s: &'static str) -> NameId {
        if let Some(&id) = self.names.get(s) {
            return id;
        }
        let id = NameId(self.names.len() as u32 + 1);
        self.names.insert(s, id);
        self.batch.new_names.push((id, s.to_owned()));
        id
    }

    fn metadata_info(&mut self, addr: u64) -> &CallsiteInfo {
        if !self.callsites.contains_key(&addr) {
            let meta = metadata_at(addr);
            let name = self.intern(meta.name());
            let field_names = meta.fields().iter().map(|f| self.intern(f.name())).collect();
            self.callsites.insert(
                addr,
                CallsiteInfo {
                    name,
                    field_names,
                    counter_track: None,
                },
            );
        }
        &self.callsites[&addr]
    }

    fn callsite_info(&mut self, addr: u64) -> &mut CallsiteInfo {
        if !self.callsites.contains_key(&addr) {
            let callsite = callsite_at(addr);
            let name = self.intern(callsite.name());
            let field_names = callsite.fields().iter().map(|f| self.intern(f)).collect();
            self.callsites.insert(
                addr,
                CallsiteInfo {
                    name,
                    field_names,
                    counter_track: None,
                },
            );
        }
        self.callsites.get_mut(&addr).expect("inserted above")
    }

    fn decode_fields(&mut self, meta: u64, data: &[Record], len: usize, out: &mut Vec<Field>) {
        if meta != 0 {
            self.metadata_info(meta);
        }
        self.decode_known_fields(meta, data, len, out);
    }

    /// Decodes a payload whose field names are already in `callsites[key]` (nothing decoded otherwise).
    fn decode_known_fields(&mut self, meta: u64, data: &[Record], len: usize, out: &mut Vec<Field>) {
        collect_payload(data, len, &mut self.payload);
        let names: &[NameId] = self.callsites.get(&meta).map_or(&[], |c| &c.field_names);
        for (index, value) in decode_fields(&self.payload) {
            let Some(&name) = names.get(index as usize) else {
                continue;
            };
            let value = match value {
                RawValue::I64(v) => FieldValue::I64(v),
                RawValue::U64(v) => FieldValue::U64(v),
                RawValue::F64(v) => FieldValue::F64(v),
                RawValue::Bool(v) => FieldValue::Bool(v),
                RawValue::Str(s) => FieldValue::Str(s.to_owned()),
            };
            match out.iter_mut().find(|f| f.name == name) {
                Some(existing) => existing.value = value,
                None => out.push(Field { name, value }),
            }
        }
    }

    /// Learns span `id`'s name and fields from its announcement: metadata at address `meta`, field payload
    /// `len` bytes in `data`.
    fn announce_span(&mut self, id: u64, meta: u64, data: &[Record], len: usize) {
        let name = self.metadata_info(meta).name;
        let mut announced = Vec::new();
        self.decode_fields(meta, data, len, &mut announced);
        // Values recorded later (seen first because another thread was drained first) win.
        let pending = self
            .pending_span_records
            .remove(&id)
            .map(|(_, p)| p)
            .unwrap_or_default();
        for (data, len) in pending {
            self.decode_fields(meta, &data, len, &mut announced);
        }
        self.spans.insert(
            id,
            SpanInfo {
                name,
                meta,
                fields: announced,
                closed_in: None,
            },
        );
    }

    /// Phase 1: applies span announcements and field updates found in `ring.staging` past `announced_upto`.
    fn announce(&mut self, ring: &mut RingState) {
        let mut i = ring.announced_upto;
        let staging = std::mem::take(&mut ring.staging);
        while i < staging.len() {
            let g = group_at(&staging, i);
            match (g.kind, g.header) {
                (Some(Kind::SpanNew), Some((len, meta))) => self.announce_span(g.head.word1, meta, g.data, len),
                // Untimed: the tick bits carry the metadata address.
                (Some(Kind::SpanNewBare), _) => self.announce_span(g.head.word1, g.head.ticks_low(), &[], 0),
                (Some(Kind::SpanRecord), Some((len, _))) => {
                    let id = g.head.word1;
                    let meta = self.spans.get(&id).map(|s| s.meta);
                    match meta {
                        Some(meta) => {
                            let mut fields = std::mem::take(&mut self.spans.get_mut(&id).expect("known").fields);
                            self.decode_fields(meta, g.data, len, &mut fields);
                            self.spans.get_mut(&id).expect("known").fields = fields;
                        }
                        // The announcement is on a ring not drained yet and field names need its metadata:
                        // keep the raw payload until it arrives.
                        None => {
                            let pass = self.pass;
                            let entry = self
                                .pending_span_records
                                .entry(id)
                                .or_insert_with(|| (pass, Vec::new()));
                            entry.1.push((g.data.to_vec(), len));
                        }
                    }
                }
                _ => {}
            }
            i += g.len;
        }
        ring.staging = staging;
        ring.announced_upto = i;
    }

    fn convert(&mut self, ring: &mut RingState, ticks_low: u64, now_ticks: u64, conv: &FastConverter) -> u64 {
        let ns = conv.to_ns(restore_ticks(ticks_low, now_ticks));
        if ns < ring.last_ns {
            self.stats.monotonic_clamps += 1;
            return ring.last_ns;
        }
        ring.last_ns = ns;
        ns
    }

    fn push_event(&mut self, ts_ns: u64, track: TrackId, kind: EventKind, name: NameId, fields: &[Field]) {
        let start = self.batch.fields.len() as u32;
        self.batch.fields.extend_from_slice(fields);
        let end = self.batch.fields.len() as u32;
        self.batch.events.push(Event {
            ts_ns,
            track,
            kind,
            name,
            fields: start..end,
            flow_out: None,
            flow_in: None,
        });
    }

    /// Queues a GPU slice event (a flow ends at its begin).
    pub(crate) fn push_gpu_event(
        &mut self,
        ts_ns: u64,
        track: TrackId,
        kind: EventKind,
        name: NameId,
        fields: &[Field],
        flow_in: Option<u64>,
    ) {
        self.push_event(ts_ns, track, kind, name, fields);
        self.batch.events.last_mut().expect("just pushed").flow_in = flow_in;
    }

    /// The GPU side: device registration, polling.
    pub(crate) fn gpu_control(&mut self, message: GpuControl) {
        let mut gpu = std::mem::take(&mut self.gpu);
        match message {
            GpuControl::Device { device, info, link } => gpu.add_device(self, device, info, link),
            GpuControl::Queue { device, queue, name } => gpu.add_queue(self, device, queue, name),
        }
        self.gpu = gpu;
    }

    /// Whether GPU scopes are in flight or waiting to be exported.
    pub(crate) fn gpu_busy(&self) -> bool {
        self.gpu.busy()
    }

    /// Counts every GPU scope still in flight as lost (shutdown).
    pub(crate) fn gpu_abandon_in_flight(&mut self) {
        self.stats.gpu_lost_scopes += self.gpu.abandon_in_flight();
    }

    /// One GPU pass; see [`GpuCollector::poll`].
    pub(crate) fn poll_gpu(&mut self, now_ns: u64, drain_ns: u64, force: bool) {
        let mut gpu = std::mem::take(&mut self.gpu);
        gpu.poll(self, now_ns, drain_ns, force);
        let s = gpu.stats;
        self.gpu = gpu;
        self.stats.gpu_scopes = s.scopes;
        self.stats.gpu_lost_scopes = s.lost_scopes;
        self.stats.gpu_causality_violations = s.causality_violations;
        self.stats.gpu_failed_calibrations = s.failed_calibrations;
    }

    fn close_slice(&mut self, ring: &mut RingState, key: u64, ts_ns: u64) {
        let Some(pos) = ring.open.iter().rposition(|o| o.key == key) else {
            self.stats.unmatched_ends += 1;
            return;
        };
        // Ends out of stack order (exit A while B, entered inside A, is open) would be mis-paired by viewers:
        // close the inner ones too and reopen them right away, so nesting always holds.
        let reopen: Vec<Open> = ring.open.drain(pos + 1..).collect();
        for o in reopen.iter().rev() {
            self.push_event(ts_ns, ring.track, EventKind::SliceEnd, o.name, &[]);
        }
        let closed = ring.open.pop().expect("pos exists");
        self.push_event(ts_ns, ring.track, EventKind::SliceEnd, closed.name, &[]);
        for o in reopen {
            self.push_event(ts_ns, ring.track, EventKind::SliceBegin, o.name, &[]);
            ring.open.push(o);
        }
    }

    /// Phase 2: turns the ring's staged records into events until one needs a span not announced yet.
    fn emit(&mut self, ring: &mut RingState, now_ticks: u64, conv: &FastConverter, force: bool) {
        let staging = std::mem::take(&mut ring.staging);
        let mut i = 0;
        let mut scratch_fields: Vec<Field> = Vec::new();
        while i < staging.len() {
            let g = group_at(&staging, i);
            let ticks = g.head.ticks_low();
            match g.kind {
                Some(Kind::SpanEnter) => {
                    let id = g.head.word1;
                    let (name, fields) = match self.spans.get(&id) {
                        Some(span) => (span.name, Some(span.fields.clone())),
                        None if !force && ring.waited_passes < MAX_WAIT_PASSES => {
                            ring.waited_passes += 1;
                            break;
                        }
                        None => {
                            self.stats.unknown_spans += 1;
                            (self.intern(UNKNOWN_SPAN), None)
                        }
                    };
                    let ts = self.convert(ring, ticks, now_ticks, conv);
                    self.push_event(
                        ts,
                        ring.track,
                        EventKind::SliceBegin,
                        name,
                        fields.as_deref().unwrap_or(&[]),
                    );
                    ring.open.push(Open { key: id, name });
                }
                Some(Kind::SpanExit) | Some(Kind::ScopeEnd) => {
                    let ts = self.convert(ring, ticks, now_ticks, conv);
                    self.close_slice(ring, g.head.word1, ts);
                }
                Some(Kind::SpanClose) => {
                    let id = g.head.word1;
                    if let Some(span) = self.spans.get_mut(&id) {
                        span.closed_in.get_or_insert(self.pass);
                        self.closed_spans.push((id, self.pass));
                    }
                }
                Some(Kind::Event) => {
                    if let Some((len, meta)) = g.header {
                        let name = self.metadata_info(meta).name;
                        scratch_fields.clear();
                        self.decode_fields(meta, g.data, len, &mut scratch_fields);
                        let ts = self.convert(ring, ticks, now_ticks, conv);
                        self.push_event(ts, ring.track, EventKind::Instant, name, &scratch_fields);
                    }
                }
                Some(Kind::ScopeBegin) => {
                    let name = self.callsite_info(g.head.word1).name;
                    let ts = self.convert(ring, ticks, now_ticks, conv);
                    self.push_event(ts, ring.track, EventKind::SliceBegin, name, &[]);
                    ring.open.push(Open {
                        key: g.head.word1,
                        name,
                    });
                }
                Some(Kind::GpuBegin) => {
                    if let Some((len, key)) = g.header {
                        let callsite = g.head.word1;
                        let name = self.callsite_info(callsite).name;
                        let mut fields = Vec::new();
                        if len > 0 {
                            self.decode_known_fields(callsite, g.data, len, &mut fields);
                        }
                        let ts = self.convert(ring, ticks, now_ticks, conv);
                        let flow = self.gpu.next_flow();
                        // Where this thread recorded the GPU work: the flow's start.
                        self.push_event(ts, ring.track, EventKind::Instant, name, &[]);
                        self.batch.events.last_mut().expect("just pushed").flow_out = Some(flow);
                        let now_ns = conv.to_ns(now_ticks);
                        self.gpu.begin(key, name, fields, ts, flow, now_ns);
                    }
                }
                Some(Kind::Instant) => {
                    let name = self.callsite_info(g.head.word1).name;
                    let ts = self.convert(ring, ticks, now_ticks, conv);
                    self.push_event(ts, ring.track, EventKind::Instant, name, &[]);
                }
                Some(Kind::Counter) => {
                    if let Some(value) = g.data.first().map(|r| f64::from_bits(r.word0)) {
                        let track = self.counter_track(g.head.word1);
                        let name = self.callsite_info(g.head.word1).name;
                        let ts = self.convert(ring, ticks, now_ticks, conv);
                        self.push_counter(track, ts, name, value);
                    }
                }
                Some(Kind::SpanNew | Kind::SpanNewBare | Kind::SpanRecord | Kind::Data) | None => {}
            }
            ring.waited_passes = 0;
            i += g.len;
        }
        ring.staging = staging;
        ring.staging.drain(..i);
        ring.announced_upto = ring.announced_upto.saturating_sub(i);
    }

    fn counter_track(&mut self, addr: u64) -> TrackId {
        if let Some(track) = self.callsite_info(addr).counter_track {
            return track;
        }
        let name = callsite_at(addr).name();
        let track = self.new_counter_track(name, "");
        self.callsite_info(addr).counter_track = Some(track);
        track
    }

    /// Counter tracks are shared by threads: their events are sorted and kept monotonic per track before they
    /// join the batch.
    fn flush_counters(&mut self) {
        self.counter_events.sort_by_key(|e| e.ts_ns);
        for mut e in self.counter_events.drain(..) {
            let last = self.counter_last_ns.entry(e.track).or_insert(0);
            if e.ts_ns < *last {
                e.ts_ns = *last;
                self.stats.monotonic_clamps += 1;
            }
            *last = e.ts_ns;
            self.batch.events.push(e);
        }
    }

    fn own_counter(&mut self, track: TrackId, ts_ns: u64, value: f64) {
        let name = self.own_counters.as_ref().expect("created in new").value_name;
        self.push_counter(track, ts_ns, name, value);
    }

    /// Queues a counter value; [`flush_counters`](Self::flush_counters) orders them into the batch.
    pub(crate) fn push_counter(&mut self, track: TrackId, ts_ns: u64, name: NameId, value: f64) {
        self.counter_events.push(Event {
            ts_ns,
            track,
            kind: EventKind::Counter(value),
            name,
            fields: 0..0,
            flow_out: None,
            flow_in: None,
        });
    }

    /// Forgets spans closed two or more passes ago.
    fn sweep_closed(&mut self) {
        let pass = self.pass;
        let spans = &mut self.spans;
        self.closed_spans.retain(|&(id, closed)| {
            if pass < closed + 2 {
                return true;
            }
            if spans.get(&id).is_some_and(|s| s.closed_in == Some(closed)) {
                spans.remove(&id);
            }
            false
        });
        self.pending_span_records
            .retain(|_, (seen, _)| pass < *seen + MAX_WAIT_PASSES as u64 + 2);
        self.pass += 1;
    }
}

struct Collector {
    rx: Receiver<Control>,
    exporters: Vec<ExporterSlot>,
    calibrator: TscCalibrator,
    processor: Processor,
    rings: Vec<RingState>,
    stats: Arc<SharedStats>,
    poll_interval: Duration,
    max_records_per_pass: usize,
}

impl Collector {
    fn run(&mut self) {
        let mut converter = self.calibrator.fast_converter();
        let mut dropped_reported = u64::MAX;
        let mut dropped_of_freed = 0u64;
        let mut last_calibration_report = 0u64;
        loop {
            let message = match self.rx.recv_timeout(self.poll_interval) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => Some(Control::Shutdown(crossbeam_channel::bounded(1).0)),
            };
            let now = monotonic_ns();
            if let Ok(true) = self.calibrator.poll(now) {
                converter = self.calibrator.fast_converter();
            }
            let Some(conv) = converter else {
                // Unreachable in practice: the calibrator is created with a fit.
                continue;
            };
            if let Some(latest) = self.calibrator.history().latest().copied() {
                if latest.calibrated_at_ns() != last_calibration_report {
                    last_calibration_report = latest.calibrated_at_ns();
                    let own = self.processor.own_counters.as_ref().map(|o| (o.drift, o.error_bound));
                    if let Some((drift, error_bound)) = own {
                        self.processor.own_counter(drift, now.0, latest.drift_ppm());
                        self.processor.own_counter(error_bound, now.0, latest.error_bound_ns());
                    }
                }
            }
            // Take every message waiting: registrations (rings, GPU devices and queues) must be known before
            // the drain below meets their first records.
            let mut finishing = false;
            let mut replies = Vec::new();
            for message in message
                .into_iter()
                .chain(std::iter::from_fn(|| self.rx.try_recv().ok()))
            {
                match message {
                    Control::NewRing { consumer, tid, name } => {
                        let track = self.processor.new_thread_track(tid, name);
                        self.rings.push(RingState {
                            consumer,
                            track,
                            staging: Vec::new(),
                            announced_upto: 0,
                            waited_passes: 0,
                            open: Vec::new(),
                            last_ns: 0,
                            closed: false,
                        });
                        self.stats.threads.fetch_add(1, Ordering::Relaxed);
                    }
                    Control::Gpu(gpu) => self.processor.gpu_control(gpu),
                    Control::Flush(reply) => replies.push(reply),
                    Control::Shutdown(reply) => {
                        finishing = true;
                        replies.push(reply);
                    }
                }
            }
            let reply = (!replies.is_empty()).then_some(());
            // A flush or shutdown must see everything recorded before it: drain until the rings are empty and
            // nothing waits for an announcement (bounded: a record waits at most MAX_WAIT_PASSES passes).
            let passes = if reply.is_some() {
                MAX_WAIT_PASSES as usize + 2
            } else {
                1
            };
            for pass in 0..passes {
                let force = reply.is_some() && pass + 1 == passes;
                // Unbounded drains: everything recorded before the request is in the rings now (a ring holds
                // at most its capacity), so one drain per ring takes all of it.
                let max = if reply.is_some() {
                    usize::MAX
                } else {
                    self.max_records_per_pass
                };
                let more = self.pass(&conv, max, force, &mut dropped_of_freed, &mut dropped_reported);
                if reply.is_some() && !more && pass > 0 {
                    break;
                }
            }
            if reply.is_some() && !finishing {
                // A flush exports every finished GPU slice now, with a fresh calibration burst.
                let drain_ns = conv.to_ns(self.calibrator.source().read().0);
                self.processor.poll_gpu(monotonic_ns().0, drain_ns, true);
            }
            if finishing {
                self.finish_gpu(&conv);
                self.close_all_open(&conv);
            }
            self.export();
            if !replies.is_empty() {
                let result = self.flush_exporters(finishing);
                for reply in replies {
                    let _ = reply.send(result.clone());
                }
                if finishing {
                    return;
                }
            }
        }
    }

    /// At shutdown: waits a bounded time for GPU scopes still in flight (the app should wait for its GPU
    /// work before shutting down), then exports everything finished. What is left is counted as lost.
    fn finish_gpu(&mut self, conv: &FastConverter) {
        let deadline = monotonic_ns().0 + GPU_SHUTDOWN_WAIT.as_nanos() as u64;
        loop {
            let now = monotonic_ns().0;
            self.processor
                .poll_gpu(now, conv.to_ns(self.calibrator.source().read().0), true);
            if !self.processor.gpu_busy() || now >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.processor.gpu_abandon_in_flight();
        self.publish_gpu_stats();
    }

    fn publish_gpu_stats(&self) {
        let (p, s) = (&self.processor.stats, &self.stats);
        s.gpu_scopes.store(p.gpu_scopes, Ordering::Relaxed);
        s.gpu_lost_scopes.store(p.gpu_lost_scopes, Ordering::Relaxed);
        s.gpu_causality_violations
            .store(p.gpu_causality_violations, Ordering::Relaxed);
        s.gpu_failed_calibrations
            .store(p.gpu_failed_calibrations, Ordering::Relaxed);
    }

    /// One pass over every ring. Returns whether anything is left to do (records staged or not drained).
    fn pass(
        &mut self,
        conv: &FastConverter,
        max: usize,
        force: bool,
        dropped_of_freed: &mut u64,
        dropped_reported: &mut u64,
    ) -> bool {
        let mut drained = 0u64;
        for ring in &mut self.rings {
            ring.closed = !ring.consumer.is_producer_alive();
            let staging = &mut ring.staging;
            drained += ring.consumer.drain(max, |chunk| staging.extend_from_slice(chunk)) as u64;
        }
        // Read after draining: every drained record's tick is older (up to cross-CPU skew, which
        // `restore_ticks` allows for).
        let now_ticks = self.calibrator.source().read().0;
        for ring in &mut self.rings {
            self.processor.announce(ring);
        }
        let mut left = false;
        for ring in &mut self.rings {
            self.processor.emit(ring, now_ticks, conv, force);
            left |= !ring.staging.is_empty() || ring.consumer.len() > 0;
        }
        self.processor.poll_gpu(monotonic_ns().0, conv.to_ns(now_ticks), false);
        self.processor.flush_counters();
        // Free the rings of exited threads once drained; their open slices end at their last timestamp.
        let mut i = 0;
        while i < self.rings.len() {
            let ring = &self.rings[i];
            if ring.closed && ring.staging.is_empty() && ring.consumer.len() == 0 {
                let mut ring = self.rings.swap_remove(i);
                *dropped_of_freed += ring.consumer.dropped_records();
                let last = ring.last_ns;
                while let Some(o) = ring.open.pop() {
                    self.processor
                        .push_event(last, ring.track, EventKind::SliceEnd, o.name, &[]);
                }
            } else {
                i += 1;
            }
        }
        let dropped = *dropped_of_freed + self.rings.iter().map(|r| r.consumer.dropped_records()).sum::<u64>();
        if dropped != *dropped_reported {
            *dropped_reported = dropped;
            let track = self.processor.own_counters.as_ref().map(|o| o.dropped);
            if let Some(track) = track {
                let ts = conv.to_ns(self.calibrator.source().read().0);
                self.processor.own_counter(track, ts, dropped as f64);
                self.processor.flush_counters();
            }
        }
        self.processor.sweep_closed();
        let s = &self.stats;
        s.records.fetch_add(drained, Ordering::Relaxed);
        s.dropped_records.store(dropped, Ordering::Relaxed);
        left
    }

    fn close_all_open(&mut self, conv: &FastConverter) {
        let end = conv.to_ns(self.calibrator.source().read().0);
        for ring in &mut self.rings {
            let ts = end.max(ring.last_ns);
            while let Some(o) = ring.open.pop() {
                self.processor
                    .push_event(ts, ring.track, EventKind::SliceEnd, o.name, &[]);
            }
        }
    }

    fn export(&mut self) {
        let p = &mut self.processor;
        p.flush_counters();
        if p.batch.is_empty() {
            return;
        }
        p.batch.cpu_clock = self.calibrator.history().latest().map(|&calibration| CpuClock {
            source: self.calibrator.source(),
            calibration,
        });
        let s = &self.stats;
        s.events.fetch_add(p.batch.events.len() as u64, Ordering::Relaxed);
        s.unmatched_ends.store(p.stats.unmatched_ends, Ordering::Relaxed);
        s.unknown_spans.store(p.stats.unknown_spans, Ordering::Relaxed);
        s.monotonic_clamps.store(p.stats.monotonic_clamps, Ordering::Relaxed);
        self.publish_gpu_stats();
        let (p, s) = (&mut self.processor, &self.stats);
        for slot in &mut self.exporters {
            if slot.failed {
                continue;
            }
            if let Err(e) = slot.exporter.export(&p.batch) {
                Self::record_failure(s, slot, e);
            }
        }
        p.batch.clear();
    }

    fn record_failure(stats: &SharedStats, slot: &mut ExporterSlot, e: ExportError) {
        slot.failed = true;
        stats.export_failures.fetch_add(1, Ordering::Relaxed);
        let mut first = stats.first_export_error.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            let kind = match &e {
                ExportError::Io(io) => io.kind(),
                _ => std::io::ErrorKind::Other,
            };
            *first = Some((kind, e.to_string()));
        }
    }

    fn flush_exporters(&mut self, finishing: bool) -> Result<(), String> {
        for slot in &mut self.exporters {
            if slot.failed {
                continue;
            }
            let result = if finishing {
                slot.exporter.finish()
            } else {
                slot.exporter.flush()
            };
            if let Err(e) = result {
                Self::record_failure(&self.stats, slot, e);
            }
        }
        match self
            .stats
            .first_export_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            Some((_, message)) => Err(message.clone()),
            None => Ok(()),
        }
    }
}

/// Support for `benches/export.rs`: the collector's per-event work (tick restore, conversion, interning,
/// per-track order, batch assembly) on synthetic records, without threads or rings in the way.
#[doc(hidden)]
pub mod bench_support {
    use super::*;
    use crate::calibration::{ClockCalibration, ClockDomain};

    static BENCH_SCOPE: Callsite = Callsite::new("bench scope", file!(), line!());

    /// A collector-side pipeline fed with `spans` begin/end pairs of one native scope per load.
    pub struct ConvertBench {
        processor: Processor,
        ring: RingState,
        records: Vec<Record>,
        conv: FastConverter,
        now_ticks: u64,
        _producer: crate::ring::Producer<Record>,
    }

    impl ConvertBench {
        /// `spans` scope begin/end pairs, 100 ticks apart, on one thread track; a 2.5 GHz TSC calibration.
        pub fn new(spans: usize) -> Self {
            let base = 1u64 << 44;
            let records: Vec<Record> = (0..spans as u64 * 2)
                .map(|i| {
                    let kind = if i % 2 == 0 { Kind::ScopeBegin } else { Kind::ScopeEnd };
                    Record::new(kind, base + i * 100, BENCH_SCOPE.addr())
                })
                .collect();
            let now_ticks = base + spans as u64 * 200 + 1_000;
            let domain = ClockDomain::new(64, 0.4).expect("valid domain");
            let cal = ClockCalibration::from_anchor(domain, base, 1_000_000_000, 0.4).expect("valid calibration");
            let (producer, consumer) = crate::ring::channel(64);
            let mut processor = Processor::new(1, GpuCalibrationConfig::default());
            let track = processor.new_thread_track(1, "bench".into());
            let ring = RingState {
                consumer,
                track,
                staging: Vec::with_capacity(records.len()),
                announced_upto: 0,
                waited_passes: 0,
                open: Vec::new(),
                last_ns: 0,
                closed: false,
            };
            ConvertBench {
                processor,
                ring,
                records,
                conv: FastConverter::new(&cal),
                now_ticks,
                _producer: producer,
            }
        }

        /// Stages the records as a drain would, and empties the previous batch.
        pub fn load(&mut self) {
            self.processor.batch.clear();
            self.ring.staging.clear();
            self.ring.staging.extend_from_slice(&self.records);
            self.ring.announced_upto = 0;
            self.ring.last_ns = 0;
        }

        /// Converts the staged records into the batch and returns it.
        pub fn convert(&mut self) -> &Batch {
            self.processor.announce(&mut self.ring);
            self.processor.emit(&mut self.ring, self.now_ticks, &self.conv, true);
            self.processor.flush_counters();
            &self.processor.batch
        }
    }
}
