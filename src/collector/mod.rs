//! The collector: two background threads per timeline, one per stage of the flow.
//!
//! ```text
//!  rings ──drain (copy, bounded budget)──▶ input log ──process──▶ batches ──▶ exporters
//!  control channel, CPU/GPU clocks ──┘          └──▶ raw capture file (.tickline), converted later
//! ```
//!
//! - `drain.rs` (thread `tickline-drain`): the live side. Moves raw records out of the rings into chunks,
//!   reads registrations, takes calibration bursts of every clock, polls GPUs (`drain_gpu.rs`: bursts, reads
//!   of timestamp pairs, pairs released and retired). Cheap and bounded, so an ordinary burst never fills a
//!   ring.
//! - `input.rs`: the log between the stages; `capture.rs` writes it to a file and reads it back.
//! - `process/` (thread `tickline-collector`): decode, name, order, convert (`mod.rs` the stage and its
//!   passes, `records.rs` each record, `slices.rs` thread-track slices and the held queue, `tasks.rs` async
//!   task tracks); `spans.rs` its span table; `process_gpu.rs` the GPU side (scopes matched with their
//!   ticks, the device clock's tracker, lanes).
//! - `output.rs`: tracks, names, batches and the exporters.
//! - `stats.rs`: [`TimelineStats`].

pub(crate) mod capture;
pub(crate) mod drain;
mod drain_gpu;
pub(crate) mod input;
pub(crate) mod output;
mod process;
mod process_gpu;
mod spans;
pub(crate) mod stats;

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Receiver;

pub(crate) use process::{CpuTime, Processor, Recycler};
pub use stats::TimelineStats;

use crate::calibration::{ClockDomain, HistoryConfig};
use crate::clock::TickSource;
use crate::control::Control;
use crate::export::Exporter;
use crate::gpu::GpuControl;
use crate::recorder::Shared;
use capture::CaptureWriter;
use drain::{Budget, ChunkPool, Drain, DrainConfig};
use input::Input;
use output::Output;
use stats::SharedStats;

/// Which spans get their own async task track: a lifetime slice from the span's creation to its close,
/// with every poll (each enter..exit) as a child slice, so the gaps between polls (awaits) show, and a flow
/// from each poll on the worker thread's track to the same poll on the task's track. Polls that overlap (the
/// span entered on two threads at once) go on a child track of the task's, `<span name> (polls 2)` (and 3...),
/// so no slice partly overlaps another.
///
/// ```
/// let timeline = tickline::Timeline::builder()
///     .async_tasks(tickline::AsyncTasks::Never)
///     .start()
///     .unwrap();
/// # drop(timeline);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncTasks {
    /// A span becomes a task once it is entered again after an exit, or entered on more than one thread: what
    /// a future that is polled, awaits and is polled again looks like. (Entering a span again while it is
    /// entered on the same thread is not a new poll: the outer enter is the poll.) A span entered once on one
    /// thread (an ordinary synchronous scope) is shown exactly as with `Never`, unless it holds child tasks
    /// (spans created inside it, or naming it as their parent, that became tasks): it then gets a task track too,
    /// from its creation to its close, with its poll, so that its children's tracks nest under it. The first
    /// poll's flow is drawn only once
    /// the span is known to be a task, so a span that turns out to be synchronous gets no flow, nor does one
    /// cut short by its thread's end or the timeline's. One exception: a first poll still undecided when a
    /// [`flush`](crate::Timeline::flush) or the 200 ms hold limit sends it out keeps its flow's start, in case
    /// the span is a task; if it is not, nothing ends that flow (Perfetto draws nothing for it).
    #[default]
    Auto,
    /// Every span gets a task track, from its creation.
    Always,
    /// No task tracks: every enter..exit is a slice on its thread's track only; span creations are not
    /// timestamped, which saves one clock read per span.
    Never,
}

/// Spare chunk buffers kept for reuse (each a ring's size).
const POOL_BUFFERS: usize = 32;

/// Everything the collector threads need to start.
pub(crate) struct CollectorSetup {
    pub(crate) drain: DrainConfig,
    pub(crate) process_name: String,
    pub(crate) cpu_domain: ClockDomain,
    pub(crate) cpu_history: HistoryConfig,
    pub(crate) exporters: Vec<Box<dyn Exporter>>,
    pub(crate) capture: Option<CaptureWriter>,
    /// The CPU tick-source decision the timeline started with.
    pub(crate) decision: crate::clock::TickSourceDecision,
    /// Which spans get async task tracks.
    pub(crate) async_tasks: AsyncTasks,
}

/// The collector's two threads.
pub(crate) struct Collector {
    pub(crate) drain: JoinHandle<()>,
    pub(crate) process: JoinHandle<()>,
}

/// What the collector is told, on two channels so that neither sending side depends on the other: the
/// recording side's control messages (rings, callsites, flush, shutdown) and the GPU layer's registrations
/// (devices, queues). Both are sent before any record that needs them; the drain stage reads both after
/// draining the rings, the control channel first, so a registration sent before a flush is seen by it.
pub(crate) struct Inbox {
    pub(crate) control: Receiver<Control>,
    pub(crate) gpu: Receiver<GpuControl>,
}

/// Starts the drain and processing threads of the timeline `shared`.
pub(crate) fn spawn(
    shared: &Arc<Shared>,
    inbox: Inbox,
    setup: CollectorSetup,
    stats: Arc<SharedStats>,
) -> std::io::Result<Collector> {
    let (tx, rx) = crossbeam_channel::unbounded::<Input>();
    let budget = Arc::new(Budget::default());
    let pool = Arc::new(ChunkPool::new(POOL_BUFFERS));
    let source = shared.source;
    let mut origin = crate::export::RecordingOrigin::this_process();
    origin.process_name = setup.process_name.clone();

    let mut capture = setup.capture;
    if let Some(capture) = &mut capture {
        capture.write_header(
            origin.pid,
            &origin.process_name,
            source,
            setup.cpu_domain,
            origin.recording,
        );
        capture.write_host(&origin.host);
    }
    // Without exporters a capture alone is kept: nothing needs converting now.
    let processor = (capture.is_none() || !setup.exporters.is_empty()).then(|| {
        let out = Output::new(&origin, setup.exporters);
        let recycler = Recycler {
            pool: pool.clone(),
            budget: budget.clone(),
        };
        let mut processor = Processor::new(out, setup.drain.gpu, Some(recycler), stats.clone());
        processor.live_cpu_clock(source, setup.cpu_domain, setup.cpu_history);
        processor.set_async_tasks(setup.async_tasks);
        processor
    });
    let process = {
        let stats = stats.clone();
        let (budget, pool, shared) = (budget.clone(), pool.clone(), shared.clone());
        std::thread::Builder::new()
            .name("tickline-collector".into())
            .spawn(move || {
                crate::recorder::mark_collector_thread(shared.id);
                run_processing(rx, processor, capture, &budget, &pool, &stats, &shared)
            })?
    };
    let drain = Drain::new(
        setup.drain,
        shared.clone(),
        (inbox, tx),
        (budget, pool, stats),
        setup.decision,
    );
    let drain = std::thread::Builder::new()
        .name("tickline-drain".into())
        .spawn(move || drain.run())?;
    let _ = shared.drain_thread.set(drain.thread().clone());
    Ok(Collector { drain, process })
}

/// The processing thread: every input goes to the raw capture (if any) and to the processor (if any).
fn run_processing(
    rx: Receiver<Input>,
    mut processor: Option<Processor>,
    mut capture: Option<CaptureWriter>,
    budget: &Budget,
    pool: &ChunkPool,
    stats: &SharedStats,
    shared: &Shared,
) {
    for input in rx.iter() {
        while shared.processing_paused.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if let Some(writer) = &mut capture {
            writer.write(&input, stats);
        }
        match &mut processor {
            Some(p) => {
                if let (Some(writer), Input::Shutdown(_)) = (&mut capture, &input) {
                    // A failure is recorded in `stats` and reported by the processor's answer.
                    let _ = writer.finish(stats);
                } else if let (Some(writer), Input::Flush(_)) = (&mut capture, &input) {
                    let _ = writer.flush(stats);
                }
                p.input(input);
                if p.is_finished() {
                    return;
                }
            }
            None => match input {
                Input::Chunk(chunk) => {
                    budget.release(chunk.records.len() * std::mem::size_of::<crate::codec::Record>());
                    let mut records = chunk.records;
                    records.clear();
                    let _ = pool.push(records);
                }
                Input::Flush(reply) => {
                    let result = capture.as_mut().map_or(Ok(()), |w| w.flush(stats));
                    let _ = reply.send(result);
                }
                Input::Shutdown(reply) => {
                    let result = capture.as_mut().map_or(Ok(()), |w| w.finish(stats));
                    let _ = reply.send(result);
                    return;
                }
                _ => {}
            },
        }
    }
}

/// Support for `benches/`: the processing stage's per-record work and the drain stage's copy, on synthetic
/// records, without threads in the way.
#[doc(hidden)]
pub mod bench_support {
    pub use super::drain::drain_bench;
    use super::*;
    use crate::calibration::{CalibrationHistory, ClockCalibration, ClockDomain};
    use crate::clock::FastConverter;
    use crate::codec::{Kind, Record};
    use crate::export::Batch;
    use input::{CallsiteDef, CallsiteKind, Chunk};

    /// The processing stage fed with `spans` begin/end pairs of one native scope per load (or, with
    /// [`ConvertBench::tracing_spans`], the records of `spans` field-less `tracing` spans).
    pub struct ConvertBench {
        processor: Processor,
        records: Vec<Record>,
        now_ticks: u64,
    }

    /// The first tick of the benches' records, and their CPU calibration: a 2.5 GHz TSC anchored there.
    const BASE_TICKS: u64 = 1 << 44;

    fn bench_calibration() -> (ClockDomain, ClockCalibration) {
        let domain = ClockDomain::new(64, 0.4).expect("valid domain");
        let cal = ClockCalibration::from_anchor(domain, BASE_TICKS, 1_000_000_000, 0.4).expect("valid calibration");
        (domain, cal)
    }

    /// The four records the layer writes for `info_span!(..).entered()` dropped: a bare creation stamped
    /// `new_ticks` (0: untimed), the enter and exit, and the close at the last exit (no `record` reached the
    /// span: its values are final).
    fn span_lifecycle(serial: u64, callsite: u64, new_ticks: u64, enter: u64, exit: u64) -> [Record; 4] {
        [
            crate::codec::span_new_bare(new_ticks, callsite),
            Record::timed(Kind::SpanEnter, enter, serial),
            Record::timed(Kind::SpanExit, exit, serial),
            Record::head(
                Kind::SpanClose,
                crate::codec::AT_LAST_EXIT | crate::codec::VALUES_FINAL,
                0,
                serial,
            ),
        ]
    }

    /// The callsite of the benches' `tracing` spans.
    const SPAN_CALLSITE: u64 = 0x2000;

    /// The benches' `tracing` span callsite `key`, named "span", declaring `fields`.
    fn span_callsite_def(key: u64, fields: Vec<String>) -> CallsiteDef {
        CallsiteDef {
            key,
            kind: CallsiteKind::Span,
            name: "span".into(),
            target: String::new(),
            level: 2,
            file: String::new(),
            line: 0,
            fields,
        }
    }

    impl ConvertBench {
        /// `spans` scope begin/end pairs, 100 ticks apart, on one thread track; a 2.5 GHz TSC calibration.
        pub fn new(spans: usize) -> Self {
            Self::exporting(spans, Vec::new())
        }

        /// [`new`](Self::new), its batches going to `exporters` at each pass's end.
        fn exporting(spans: usize, exporters: Vec<Box<dyn Exporter>>) -> Self {
            const KEY: u64 = 0x1000;
            let base = BASE_TICKS;
            let records: Vec<Record> = (0..spans as u64 * 2)
                .map(|i| {
                    let kind = if i % 2 == 0 { Kind::ScopeBegin } else { Kind::ScopeEnd };
                    Record::timed(kind, base + i * 100, KEY)
                })
                .collect();
            let now_ticks = base + spans as u64 * 200 + 1_000;
            let (domain, cal) = bench_calibration();
            let out = Output::new(&crate::export::RecordingOrigin::this_process(), exporters);
            let stats = Arc::new(SharedStats::default());
            let mut processor = Processor::new(out, Default::default(), None, stats);
            processor.set_cpu_clock(CpuTime::Live {
                source: TickSource::Tsc,
                history: CalibrationHistory::new(domain, HistoryConfig::default()),
                fast: Some(Box::new(FastConverter::new(&cal))),
            });
            processor.input(Input::Callsite(CallsiteDef {
                key: KEY,
                kind: CallsiteKind::Native,
                name: "bench scope".into(),
                target: String::new(),
                level: 0,
                file: String::new(),
                line: 0,
                fields: Vec::new(),
            }));
            processor.input(Input::Thread {
                ring: 1,
                tid: 1,
                name: "bench".into(),
            });
            ConvertBench {
                processor,
                records,
                now_ticks,
            }
        }

        /// `spans` field-less `tracing` spans each created, entered, exited and closed (four records, as the
        /// layer writes them for `info_span!("span").entered()` dropped), 100 ticks apart.
        pub fn tracing_spans(spans: usize) -> Self {
            Self::tracing_spans_exporting(spans, Vec::new())
        }

        fn tracing_spans_exporting(spans: usize, exporters: Vec<Box<dyn Exporter>>) -> Self {
            let mut bench = ConvertBench::exporting(0, exporters);
            let base = BASE_TICKS;
            let mut records = Vec::with_capacity(spans * 4);
            for i in 0..spans as u64 {
                let serial = crate::recorder::span_serial(1, i + 1);
                let t = base + i * 200;
                records.extend(span_lifecycle(serial, SPAN_CALLSITE, 0, t, t + 100));
            }
            bench.now_ticks = base + spans as u64 * 200 + 1_000;
            bench.records = records;
            bench
                .processor
                .input(Input::Callsite(span_callsite_def(SPAN_CALLSITE, Vec::new())));
            bench
        }

        /// `tasks` field-less `tracing` spans, each created, then entered and exited `polls` times (as a future
        /// polled `polls` times), then closed; in groups of 8 polled in turn, as a worker thread polls several
        /// tasks. Async task tracks chosen by `mode`. Run with [`ConvertBench::convert_and_write`]: tasks are
        /// written a few passes after their close.
        pub fn async_tasks(tasks: usize, polls: usize, mode: crate::AsyncTasks) -> Self {
            const GROUP: u64 = 8;
            let mut bench = ConvertBench::tracing_spans(0);
            bench.processor.set_async_tasks(mode);
            let base = BASE_TICKS;
            let mut records = Vec::with_capacity(tasks * (2 + 2 * polls));
            let mut t = base;
            let tasks = tasks as u64;
            for first in (0..tasks).step_by(GROUP as usize) {
                let group = first..(first + GROUP).min(tasks);
                for _ in group.clone() {
                    records.push(crate::codec::span_new_bare(t, SPAN_CALLSITE));
                    t += 10;
                }
                for _ in 0..polls {
                    for i in group.clone() {
                        let serial = crate::recorder::span_serial(1, i + 1);
                        records.push(Record::timed(Kind::SpanEnter, t + 100, serial));
                        records.push(Record::timed(Kind::SpanExit, t + 200, serial));
                        t += 300;
                    }
                }
                for i in group {
                    let serial = crate::recorder::span_serial(1, i + 1);
                    records.push(Record::head(Kind::SpanClose, crate::codec::VALUES_FINAL, t, serial));
                    t += 10;
                }
            }
            bench.now_ticks = t + 1_000;
            bench.records = records;
            bench
        }

        /// Hands a prepared chunk over as a drain would (moved, not copied) and ends a drain pass; returns the
        /// events exported.
        fn pass(&mut self, chunk: SteadyChunk, cal: &ClockCalibration) -> u64 {
            self.processor.input(Input::Chunk(Chunk {
                ring: 1,
                now_ticks: chunk.now_ticks,
                dropped_total: 0,
                dropped_slices_total: 0,
                records: chunk.records,
            }));
            let drain_ns = cal.to_reference_ns(chunk.now_ticks);
            self.processor.pass_end_for_bench(drain_ns, chunk.now_ticks)
        }

        /// Processes the queued records and ends enough drain passes for everything to be written (closed
        /// tasks included); returns how many events went out.
        pub fn convert_and_write(&mut self) -> u64 {
            self.processor.finish_passes_for_bench(4, self.now_ticks)
        }

        /// Queues the records as a drain would, and empties the previous batch.
        pub fn load(&mut self) {
            self.processor.clear_batch();
            self.processor.input(Input::Chunk(Chunk {
                ring: 1,
                now_ticks: self.now_ticks,
                dropped_total: 0,
                dropped_slices_total: 0,
                records: self.records.clone(),
            }));
        }

        /// Processes the queued records into the batch and returns it.
        pub fn convert(&mut self) -> &Batch {
            self.processor.process_for_bench()
        }
    }

    /// The callsite of the benches' `tracing` events: `info!(i, "event")`, fields `message` and `i`.
    const EVENT_CALLSITE: u64 = 0x4000;

    /// The processing stage in its steady state for events: one processor takes chunk after chunk of
    /// `info!(i, "event")` events (a message and a `u64`, encoded as the layer encodes them) and ends a drain pass
    /// after each (export to its exporters).
    pub struct SteadyEvents {
        bench: ConvertBench,
        events_done: u64,
        cal: ClockCalibration,
        payload: Vec<u8>,
        group: Vec<Record>,
    }

    impl SteadyEvents {
        /// A processor exporting to `exporters`.
        pub fn new(exporters: Vec<Box<dyn Exporter>>) -> Self {
            let mut bench = ConvertBench::exporting(0, exporters);
            bench.processor.input(Input::Callsite(CallsiteDef {
                key: EVENT_CALLSITE,
                kind: CallsiteKind::Event,
                name: "event".into(),
                target: String::new(),
                level: 2,
                file: String::new(),
                line: 0,
                fields: vec!["message".into(), "i".into()],
            }));
            SteadyEvents {
                bench,
                events_done: 0,
                cal: bench_calibration().1,
                payload: Vec::new(),
                group: Vec::new(),
            }
        }

        /// Processes one chunk of `events` events and ends the pass; returns the events exported.
        pub fn chunk(&mut self, events: usize) -> u64 {
            let chunk = self.prepare(events);
            self.process(chunk)
        }

        /// The next `events` events as the drain hands them over (encoded as the layer encodes them: the
        /// recording thread's work, not the processing stage's, so benches keep it out of what they time).
        pub fn prepare(&mut self, events: usize) -> SteadyChunk {
            let mut records = Vec::with_capacity(events * 4);
            for _ in 0..events {
                let i = self.events_done;
                self.events_done += 1;
                let mut encoder = crate::codec::FieldEncoder::new(&mut self.payload, crate::MAX_PAYLOAD_BYTES);
                encoder.str(0, "event");
                encoder.u64(1, i);
                encoder.finish();
                let ticks = BASE_TICKS + i * 100;
                // One group at a time: `encode_event` writes its group over what `group` held.
                crate::codec::encode_event(
                    &mut self.group,
                    ticks,
                    EVENT_CALLSITE,
                    crate::codec::Parent::Contextual,
                    &self.payload,
                );
                records.extend_from_slice(&self.group);
            }
            SteadyChunk {
                records,
                now_ticks: BASE_TICKS + self.events_done * 100 + 1_000,
            }
        }

        /// Processes a chunk from [`prepare`](Self::prepare) and ends the pass; returns the events exported.
        pub fn process(&mut self, chunk: SteadyChunk) -> u64 {
            self.bench.pass(chunk, &self.cal)
        }
    }

    /// A chunk of records made ahead by a steady-state bench, for its processing stage to take.
    pub struct SteadyChunk {
        records: Vec<Record>,
        now_ticks: u64,
    }

    /// The processing stage in its steady state, as it runs under load: one processor (tables and buffers
    /// warm) takes chunk after chunk of field-less `tracing` spans, each span created (timed, as with
    /// [`AsyncTasks::Auto`]), entered, exited and closed, and ends a drain pass after each chunk (release,
    /// export to its exporters, sweep).
    pub struct SteadySpans {
        bench: ConvertBench,
        spans_done: u64,
        cal: ClockCalibration,
        /// Each span created with a value for its field `i` (`info_span!("span", i)`), encoded as the layer
        /// encodes it: its slice waits for its values (see the processing stage's docs).
        with_field: Option<(Vec<u8>, Vec<Record>)>,
    }

    /// The callsite of the benches' `tracing` spans with a field `i`.
    const FIELD_SPAN_CALLSITE: u64 = 0x3000;

    impl SteadySpans {
        /// A processor exporting to `exporters`, with task tracks chosen by `mode`.
        pub fn new(exporters: Vec<Box<dyn Exporter>>, mode: AsyncTasks) -> Self {
            let mut bench = ConvertBench::tracing_spans_exporting(0, exporters);
            bench.processor.set_async_tasks(mode);
            SteadySpans {
                bench,
                spans_done: 0,
                cal: bench_calibration().1,
                with_field: None,
            }
        }

        /// [`new`](Self::new) for spans with a field: `info_span!("span", i)`.
        pub fn with_field(exporters: Vec<Box<dyn Exporter>>, mode: AsyncTasks) -> Self {
            let mut steady = Self::new(exporters, mode);
            steady.bench.processor.input(Input::Callsite(span_callsite_def(
                FIELD_SPAN_CALLSITE,
                vec!["i".into()],
            )));
            steady.with_field = Some((Vec::new(), Vec::new()));
            steady
        }

        /// Processes one chunk of `spans` spans and ends the pass; returns the events exported.
        pub fn chunk(&mut self, spans: usize) -> u64 {
            let chunk = self.prepare(spans);
            self.process(chunk)
        }

        /// The next `spans` span lifecycles as the drain hands them over (made outside what benches time).
        pub fn prepare(&mut self, spans: usize) -> SteadyChunk {
            let base = BASE_TICKS;
            let mut records = Vec::with_capacity(spans * 4);
            for _ in 0..spans {
                let i = self.spans_done;
                self.spans_done += 1;
                let serial = crate::recorder::span_serial(1, i + 1);
                let t = base + i * 200;
                match &mut self.with_field {
                    None => records.extend(span_lifecycle(serial, SPAN_CALLSITE, t, t + 10, t + 110)),
                    Some((payload, group)) => {
                        let mut encoder = crate::codec::FieldEncoder::new(payload, crate::MAX_PAYLOAD_BYTES);
                        encoder.u64(0, i);
                        encoder.finish();
                        crate::codec::encode_span_new(
                            group,
                            t,
                            FIELD_SPAN_CALLSITE,
                            crate::codec::Parent::Contextual,
                            payload,
                        );
                        records.extend_from_slice(group);
                        records.extend_from_slice(&span_lifecycle(serial, SPAN_CALLSITE, t, t + 10, t + 110)[1..]);
                    }
                }
            }
            SteadyChunk {
                records,
                now_ticks: base + self.spans_done * 200 + 1_000,
            }
        }

        /// Processes a chunk from [`prepare`](Self::prepare) and ends the pass; returns the events exported.
        pub fn process(&mut self, chunk: SteadyChunk) -> u64 {
            self.bench.pass(chunk, &self.cal)
        }
    }
}
