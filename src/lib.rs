//! tickline: one timeline of what your CPU threads and your GPUs did.
//!
//! Add one `tracing` layer (and, where `tracing` is not used, [`scope!`](macro@scope)s): every span
//! enter/exit, event and scope is recorded as a raw tick into a lock-free per-thread ring, and a background
//! collector converts the ticks to `CLOCK_MONOTONIC` nanoseconds with a **live** calibration and hands them
//! to exporters (a Perfetto trace file with the `tickline-perfetto` crate, or memory).
//!
//! ```
//! use tracing_subscriber::layer::SubscriberExt;
//!
//! let memory = tickline::export::MemoryExporter::default();
//! let timeline = tickline::Timeline::builder().exporter(memory.clone()).start().unwrap();
//! let subscriber = tracing_subscriber::registry().with(timeline.layer());
//! tracing::subscriber::with_default(subscriber, || {
//!     let _frame = tracing::info_span!("frame", n = 1).entered();
//!     let _physics = tickline::scope!("physics");
//! });
//! timeline.flush().unwrap();
//! assert_eq!(memory.snapshot().slice_count("frame"), 1);
//! ```
//!
//! GPU work joins the same timeline through a [`gpu::GpuBackend`] (Vulkan with the `vulkan` feature, CUDA with
//! `cuda`, wgpu-hal's Vulkan backend with `wgpu`, or the [simulated GPU](gpu::sim)) and
//! [`gpu_scope!`](macro@gpu_scope)s recorded into its command streams: each GPU
//! slice is placed on the CPU's time axis by the device clock's own live calibration, carries its
//! uncertainty, and has a flow from the CPU code that recorded it.
//!
//! ```
//! use std::time::Duration;
//! use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
//!
//! let memory = tickline::export::MemoryExporter::default();
//! let timeline = tickline::Timeline::builder().exporter(memory.clone()).start().unwrap();
//! let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
//! let queue = gpu.queue("compute").unwrap();
//! let commands = SimCommands::new();
//! {
//!     let _pass = tickline::gpu_scope!(queue, &commands, "blur", radius = 4);
//!     commands.work(Duration::from_micros(100));
//! }
//! gpu.backend().submit(commands).wait();
//! timeline.shutdown().unwrap();
//! assert_eq!(memory.snapshot().slice_count("blur"), 1);
//! ```
//!
//! # Where things are
//!
//! The crate root holds what an application calls: [`Timeline`], [`TimelineBuilder`], [`TicklineLayer`],
//! [`TimelineStats`], [`AsyncTasks`], [`TicklineError`], [`ScopeGuard`] and the macros. The rest is grouped by
//! who needs it:
//!
//! - [`gpu`]: GPU devices, queues and backends (Vulkan, CUDA, wgpu, a simulated GPU).
//! - [`export`]: the model exporters consume (batches, events, typed tracks), the [`export::Exporter`] trait,
//!   [`export::MemoryExporter`], and the [`export::LiveSink`] hook of live viewers.
//! - [`clock`]: the CPU tick counter, the reference clock, the TSC decision and its reliability check.
//! - [`calibration`]: clock-pair calibration (samples, fits, the live history) and its simulator of known truth.
//! - [`sync`]: traces that describe themselves (machine, process, trace UUID, clock snapshots) and clocks
//!   compared across processes and hosts.
//! - [`capture`]: raw capture files, converted later.
//!
//! How the stages fit together, which module owns what, and the one direction of dependencies: see
//! `ARCHITECTURE.md` in the repository.
//!
//! # Design
//!
//! Record cheap raw ticks now; convert them later with the best calibration known then. The hot path reads
//! the TSC and writes one 16-byte record into a ring only its own thread writes: no conversion, no
//! allocation, no lock, no system call after the thread's first record (and its first record with fields,
//! which sizes its scratch space for the largest payload). One exception, in drop mode with the default
//! growing rings: a ring that fills moves on to one four times as large, allocated by the recording thread
//! then (see [`TimelineBuilder::max_ring_capacity`]; a fixed [`TimelineBuilder::ring_capacity`] never
//! grows). Everything else happens on the collector thread, which owns the calibration state.
//!
//! Clocks are mapped to the reference by a [`CalibrationHistory`]: bursts of bracketed samples
//! `(source ticks, reference ns, max deviation)`, the tightest kept, a robust fit over a sliding window, and
//! knots at the window's centroid. A tick between knots is interpolated between calibration points on
//! both sides; a newer one is extrapolated by the newest fit. Every conversion comes with an uncertainty
//! ([`Converted`]), and the output never runs backwards across a refit. GPU slices carry theirs
//! (`uncertainty_ns`); CPU timestamps, too many to annotate one by one, have the `tickline CPU timestamp
//! uncertainty` counter track (ns, about 95 %): a CPU timestamp at `t` lies within ± the larger of its values
//! just before and just after `t` (`tickline TSC error bound` is the fit's residual spread, not a bound).
//!
//! A GPU scope writes a pair of device timestamps (begin now, end when its guard drops) and pushes one record
//! group into the CPU thread's ring: the CPU tick, the call site, the device/queue/timestamp pair. The
//! collector polls the backend for finished pairs without blocking the app (a pair is reused as soon as both
//! values are read), calibrates each device clock in time-bounded bursts, splits its calibration where the clock
//! jumps or changes rate, holds a finished slice until a calibration burst after its read-back exists (then up to
//! [`TimelineBuilder::gpu_latency_bound`] for a two-sided conversion), checks it against what the CPU knows
//! (begun after it was recorded, ended before it was read back), and lays a queue's slices out on tracks that
//! never hold a partial overlap.
//!
//! # Internals
//!
//! - `ring`: the SPSC ring (checked with loom and Miri); `record`: the 16-byte record and field payloads.
//! - `recorder`: each thread's ring per timeline; `layer`, `scope`: what records; `live`: the optional
//!   [`LiveSink`] they call as they record, for live viewers that must emit on the thread itself (Tracy).
//! - `collector`: drains every ring each `poll_interval`, resolves span names and fields, converts, keeps
//!   per-track order, batches for the [`Exporter`]s.
//! - [`gpu`]: the backend trait, the scope guard and handles; on the collector side, per device, the scopes in
//!   flight, the clock tracker ([`gpu::GpuCalibrationConfig`]) and the queue lanes.
//! - `sync`: what makes traces of several processes and hosts mergeable: [`HostInfo`] (machine id, host),
//!   [`TraceUuid`], bracketed [`read_host_clocks`], the kernel's [`time_sync_state`], and the
//!   [`ClockExchange`] between two processes over a socket.
//! - [`calibration`]: pure math (fits, histories, the simulated clock pair); `clock`: reading counters, the
//!   TSC reliability check and the process's cached tick-source decision ([`TscDecider`]), the check against an
//!   independent clock, the live TSC calibrator, the division-free [`FastConverter`].
//!
//! # Caveats
//!
//! - **Non-invariant or unsynchronised TSC.** The TSC is checked once per process ([`TscDecider`]): the first
//!   timeline start runs a short check (shift between CPUs, a CAS-ordered monotonicity run, the rate on every
//!   CPU) and a fuller one follows in the background; later starts reuse the decision. Only a failure measured
//!   twice rejects the TSC (a preempted probe is not evidence); then tickline records `CLOCK_MONOTONIC` and
//!   [`Timeline::tsc_fallback_reason`] says why. A timeline never switches source while it runs: if the
//!   background check rejects the TSC after a timeline started, that timeline keeps the TSC and
//!   [`TickSourceDecision::note_for_timeline`] states the measured problem. `tickline clock` prints the report.
//! - **Suspend.** Timestamps are `CLOCK_MONOTONIC`, which stops while suspended; the Perfetto exporter writes
//!   BOOTTIME and records a new clock snapshot after a suspend.
//! - **VMs.** A hypervisor may migrate vCPUs between hosts with different TSC offsets; the reliability check
//!   sees the state at start only. The live calibration follows rate changes, not per-CPU jumps.
//! - **Separate GPU clock domains.** Each GPU clock gets its own calibration history against the same
//!   reference; their accuracy is stated per conversion (the `uncertainty_ns` annotation), never assumed. A
//!   GPU slice that converts to before the CPU recorded it, or after the collector read it back, is a
//!   calibration failure: counted ([`TimelineStats::gpu_causality_violations`]), placed inside that window with
//!   the window as its uncertainty and marked ([`gpu::CALIBRATION_BREAK`]); a queue that keeps disagreeing with
//!   its device's calibration (another epoch) gets one of its own ([`gpu::QUEUE_CALIBRATION`]). Slices next to
//!   a clock jump or rate step are placed by the hull of both sides and marked too. A counter coarser than its
//!   ticks must declare its resolution ([`ClockDomain::with_resolution_ns`]), or its stated uncertainty is too
//!   small.
//! - **GPU scopes need their commands submitted once.** A scope's timestamp pair is read back after the GPU
//!   wrote it and then reused. Commands recorded but never submitted leave their scope lost after
//!   [`gpu::GpuCalibrationConfig::lost_after`] (counted; its flow has no GPU end, its pair is retired). A
//!   command buffer submitted several times rewrites the same pair: record scopes per submission.
//! - **Losses in drop mode** (the default; [`TimelineBuilder::lossless`] waits instead). A ring that fills
//!   (after growing as far as [`TimelineBuilder::max_ring_capacity`] allows) drops records, never half a
//!   slice: a begin that would not leave room for its end is dropped with its end
//!   ([`TimelineStats::dropped_slices`]). Every dropped record is counted ([`TimelineStats::dropped_records`],
//!   and the `tickline dropped records` counter track); where records went missing, the thread's track has an
//!   instant `tickline: records dropped` with their count (`records`), and every slice open around the loss
//!   carries `tickline.dropped_inside` (records dropped while it was open). An async task's lifetime slice
//!   carries it when records were dropped on any thread while the task lived, since its polls run on any
//!   thread: their count there is of all of them, an upper bound of the task's own. A slice is never
//!   stretched to cover a loss. A span created while the enter of the span around it was dropped cannot be
//!   known to be its child (the contextual parent is what its thread had entered, as recorded): its task
//!   track, if it gets one, nests under the nearest task its thread is known to have entered, or the process.
//! - **Records that cannot be taken.** A record made while its thread is making another (a field's `Debug`
//!   that logs or creates a span with fields, a signal handler that records) is dropped and counted, in
//!   lossless mode too (its thread's ring is in use): the spans it created lose their slices, counted in
//!   [`TimelineStats::dropped_slices`]. What no ring can take is counted in
//!   [`TimelineStats::unrecorded_records`]: `tracing` calls on the collector's own thread (an exporter's or a
//!   GPU backend's logging: recorded, they would be the timeline's own input, and in lossless mode the
//!   collector would wait on itself), records from a thread-local destructor that runs after tickline's own
//!   per-thread state is gone (a thread-local first used before the thread's first record), and what a child
//!   made by `fork` records on its threads' first records (the collector's threads stay in the parent; in the
//!   child `flush` and `shutdown` fail at once with [`TicklineError::CollectorGone`] and the exit hook does not
//!   wait). **Not counted:** records a forked child makes on the thread that forked, if that thread had
//!   recorded before: they go into the child's copy of its ring, which nothing drains (stop the timeline, or
//!   record nothing on that thread, in a child that goes on working). A
//!   thread's first record registers its ring, which allocates: a signal handler must not make a thread's
//!   first record (it may have interrupted the allocator).
//! - **Span ids.** `tracing`'s registry reuses a span's id once it closes; tickline gives every span a serial
//!   of its own instead (see [`TicklineLayer`]), so a slice always carries its own span's name and fields.
//!   Track ids in exported traces are unique per timeline.
//! - **Exits out of stack order.** `tracing` lets a thread exit a span before one it entered later
//!   (`let a = s1.entered(); let b = s2.entered(); drop(a);`). A thread track must nest, so the inner slice
//!   is cut where the outer one ends, marked `tickline.split`, and goes on at once in a second slice of the
//!   same name until its own exit: one enter, two slices.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![doc(test(attr(deny(warnings))))]

pub mod calibration;
mod callsite;
pub mod capture;
pub mod clock;
mod codec;
mod collector;
mod control;
mod error;
pub mod export;
pub mod gpu;
mod layer;
mod live;
mod recorder;
mod ring;
mod scope;
mod span_table;
pub mod sync;
mod timeline;
mod trace_file;

// What an application calls. The rest lives in the modules above: `export` (the exporter-facing model),
// `clock` (the CPU clock), `calibration`, `sync` (hosts and processes), `gpu`, `capture`.
pub use collector::{AsyncTasks, TimelineStats};
pub use error::TicklineError;
pub use layer::TicklineLayer;
pub use scope::ScopeGuard;
pub use timeline::{Timeline, TimelineBuilder};

// The crate-root paths of 0.1's first layout, kept so that code written against them still compiles; hidden
// from the docs, which name each item at its module (see CHANGELOG.md).
#[doc(hidden)]
pub use calibration::{
    CalibrationError, CalibrationHistory, CalibrationSample, ClockCalibration, ClockDomain, Converted, FitOptions,
    FitStrategy, HistoryConfig, HistoryStats, Placement,
};
#[doc(hidden)]
pub use clock::{
    bracketed_sample, check_independent_reference, check_tsc_reliability, monotonic_ns, monotonic_raw_ns, read_ticks,
    source_name, CheckVerdict, CpuRate, CpuShift, DeciderOptions, DecisionFigures, DecisionStage, FastConverter,
    IndependentCheck, IndependentRate, InjectedPreemption, Nanos, PassSummary, ProbeFaults, ProbePhase, RawTicks,
    ReferenceClock, ReliabilityOptions, SkippedCpu, TickSource, TickSourceDecision, TscCalibrator, TscCalibratorConfig,
    TscCheck, TscDecider, TscDecision, TscReport, Verdict,
};
#[doc(hidden)]
pub use collector::bench_support;
#[doc(hidden)]
pub use export::{
    Batch, CpuClock, EventKind, ExportError, Exporter, FieldValue, LiveSink, LiveSpanData, MemoryExporter, MemoryTrace,
    NameId, NativeCallsite as Callsite, RecordedEvent, RecordedMetadata, RecordedSlice, RecordingOrigin,
    TraceEvent as Event, TraceField as Field, TrackDescriptor, TrackId, TrackKind, TrackMetadata,
};
#[doc(hidden)]
pub use scope::{
    record_counter_value as __record_counter, record_frame_mark as __record_frame_mark,
    record_instant as __record_instant,
};
#[doc(hidden)]
pub use sync::{
    host_boottime_ns, process_name, read_host_clocks, read_real_clocks, simulation, time_sync_state, ClockExchange,
    ClockExchangeConfig, ClockReadings, ExchangeSample, HostInfo, MachineId, MachineIdSource, SimulatedClock,
    TimeSyncState, TraceUuid, MACHINE_ID_ENV, SIMULATE_CLOCK_ENV,
};

/// Most bytes of fields one span, `record` or event carries (a ring smaller than 8 Ki records allows less): the
/// string or `Debug` value that reaches it is cut to fit (with "…"), the fields after it are left out, and
/// each is counted (`tickline.fields_truncated`).
pub const MAX_PAYLOAD_BYTES: usize = codec::MAX_PAYLOAD_BYTES;
/// Most bytes of one string or `Debug` field value kept; a longer value keeps at most this many (cut at a
/// character boundary), then "…" (3 bytes more), and is counted (`tickline.fields_truncated`).
pub const MAX_FIELD_BYTES: usize = codec::MAX_STR;
