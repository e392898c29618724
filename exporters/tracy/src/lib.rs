//! tickline-tracy: a tickline timeline, live in the [Tracy profiler](https://github.com/wolfpld/tracy)
//! (0.14.x, protocol 82: the client that `tracy-client` 0.19 bundles).
//!
//! tickline's CPU spans and native scopes appear as Tracy zones on their own threads (span fields as zone
//! text, the name and source location from the call site), `tracing` events and `instant!`s as Tracy
//! messages, `frame_mark!`s as frame marks, its GPU scopes as GPU zones in one Tracy GPU context per GPU
//! queue lane, and every counter track (tickline's calibration health: TSC drift and error bound, dropped
//! records; the GPU clocks' drift, error bound and offset; the app's `counter!`s) as a Tracy plot.
//!
//! ```
//! use tracing_subscriber::layer::SubscriberExt;
//!
//! let tracy = tickline_tracy::TracyExporter::new();
//! let timeline = tracy.install(tickline::Timeline::builder()).start().unwrap();
//! let subscriber = tracing_subscriber::registry().with(timeline.layer());
//! tracing::subscriber::with_default(subscriber, || {
//!     let _frame = tracing::info_span!("frame", n = 1).entered();
//!     let _physics = tickline::scope!("physics");
//!     tracing::info!(bodies = 12, "stepped");
//! });
//! tickline::frame_mark!();
//! timeline.shutdown().unwrap();
//! ```
//!
//! # Design
//!
//! **CPU zones are emitted on the thread itself, at the moment tickline records** (through
//! [`tickline::export::LiveSink`]), with one leaked, static Tracy source location per call site (`tracing` metadata or
//! native callsite), found again with two atomic loads and no lock or allocation. Tracy's public API offers no
//! other way: its zone calls stamp "now" on the calling thread (tracy#1154, #1440 ask for more). Tracy and
//! tickline both read the TSC, a few nanoseconds apart, so a Tracy zone and tickline's slice of the same
//! span agree to within the cost of the calls between the two reads.
//!
//! The alternative was to let tickline's collector be the only Tracy emitter, replaying each thread's zones
//! with their recorded ticks through a small C++ shim over the bundled client's serial queue (the queue
//! Tracy's `fibers` build routes every zone through). It was assessed from the client's sources and not
//! built:
//! - it needs `TRACY_FIBERS`, which moves *all* Tracy instrumentation in the process (the app's own
//!   `tracy_client::span!`s too) from per-thread lock-free queues onto one spin-locked serial queue, a cost and
//!   a contention point for every thread;
//! - the shim writes Tracy's private `QueueItem` layouts, so it must be compiled with exactly
//!   `tracy-client-sys`'s defines and pinned to its exact version, and breaks silently on any protocol bump;
//! - its only gain is a cheaper hot path (tickline's record alone); the zones would still reach Tracy no
//!   sooner, and alignment is already at the TSC-read level.
//!
//! What the hot path costs with this exporter on, against `tracing-tracy` (which allocates a source
//! location on every enter), is measured by `benches/overhead.rs` (`*/tickline_tracy`).
//!
//! **GPU zones are uploaded by the collector** ([`Exporter::export`]), once tickline has converted them:
//! one Tracy GPU context per GPU lane track (a queue's track, or a sibling lane tickline opened for
//! partially overlapping slices: slices within one lane nest strictly, as a Tracy context requires), created
//! with period 1.0 and fed with timestamps already on Tracy's CPU axis. Tracy's CPU time is the raw TSC: each
//! slice's reference-ns time goes back to the TSC through the batch's [`tickline::export::CpuClock`] (the collector's
//! calibration), then to ns with a rate frozen when the exporter first sees a clock. Tracy converts its own
//! TSC readings with a rate it measured once at startup, which no API exposes; so before each upload the
//! context is re-anchored (`sync_gpu_time`) to the TSC read just before the call, and the only error left is
//! the distance from that anchor to the slice (a few hundred ms: tickline's GPU latency) times the difference
//! between the two rates (well under a ppm), plus the latency of the anchor call (measured:
//! [`TracyStats::anchor_latency_max_ns`]). A lane's slices are held until its outermost slice ends and then
//! uploaded in increasing time order, subtrees of all lanes oldest first.
//!
//! # Measured
//!
//! On this project's 2-core test VM (`cargo bench -p tickline-benches --bench overhead`, one run, medians):
//! - Hot path, Tracy in on-demand mode with no profiler (Tracy queues nothing, so the exporter's own cost
//!   shows): a span created, entered, exited and closed costs 174 ns with tickline + this exporter against
//!   231 ns with `tracing-tracy` (tickline alone 117 ns, an empty layer 88 ns); a precreated span's
//!   enter + exit 58 ns against 58 ns (tickline alone 24 ns); a native `scope!` 20 ns (tickline alone 20 ns,
//!   `tracy_client::span!` 5 ns).
//! - Tracy's default mode with no profiler (every zone queued in memory, page faults included): 234 ns
//!   against 303 ns per created span; precreated enter + exit 337 ns against 228 ns (both dominated by Tracy's
//!   growing queue, several GB by the end of the run).
//! - GPU zone placement over a 60 s live session (`TICKLINE_TRACY_SECONDS=60 cargo test --release -p
//!   tickline-tracy --test live_server`), as a Tracy server places them, against tickline's own conversion:
//!   40,464 zones, median 188 ns, p99 199 ns, max 210 ns (max 208 ns in the last 10 s). The steady ~190 ns is
//!   the anchor-to-slice distance (about 0.4 s with a 500 ms GPU latency bound) times the difference between
//!   tickline's TSC rate and the one Tracy measured at startup (about 0.5 ppm here); the anchoring calls
//!   themselves took 58 ns on average, 241 ns at most. CPU zones lie a median 10 ns (p99 0.7 µs) from
//!   tickline's own ticks.
//!
//! # On-demand mode and memory
//!
//! With the `ondemand` feature (Tracy's `TRACY_ON_DEMAND`), nothing is queued while no profiler is connected:
//! a zone costs Tracy one flag test, span fields are not formatted, events are not formatted, and GPU slices
//! are dropped as they close (counted in [`TracyStats::gpu_zones_not_captured`]). A span created while no
//! profiler was connected has no zone text when it is entered after one connects (its fields were not
//! formatted when they were known). Without it Tracy keeps every
//! zone in memory from the start of the process until a profiler connects (Tracy's default, unbounded). The
//! exporter's own memory is bounded either way: per call site a source location, per GPU lane a context and
//! the open slices of its current outermost slice, per counter track a plot name.
//!
//! # Caveats
//!
//! - The layer needs a `LookupSpan` subscriber (any `tracing_subscriber::registry()` stack) to find a span's
//!   call site at enter.
//! - `tracing` allows exiting spans out of order; Tracy zones nest strictly, so such an exit closes the
//!   innermost zone (tickline's own timeline closes and reopens instead). A span exited on another thread
//!   than the one that entered it (only `Dispatch::exit` can) ends no zone there; its zone on the entering
//!   thread stays open, as it stays that thread's current span in `tracing` (tickline's own timeline ends it
//!   at that thread's last record, marked truncated).
//! - A thread's first zone begins later in Tracy than in tickline (8-11 µs on the test VM, median over 64
//!   threads): Tracy sets up the thread's queue on its first zone, after tickline read the time. Naming the
//!   thread for Tracy, a system call, is done before that read ([`LiveSink::thread_started`]); before, the
//!   offset was 14-37 µs. Later zones lie within the figures above.
//! - Plots are stamped by Tracy when the collector exports them (a millisecond or two after the value was
//!   recorded): Tracy's C API has no plot call with a timestamp.
//! - GPU zones show the collector thread's upload time as their CPU-side time, and carry no fields (Tracy has
//!   no GPU zone text). tickline's flows from the CPU submit to the GPU slice are not shown.
//! - A GPU slice uploaded more than 1.5 s after it ended is not shown (Tracy would read it as a counter
//!   wrap): keep [`tickline::TimelineBuilder::gpu_latency_bound`] under a second for live sessions.
//! - Tracy holds at most 255 GPU contexts per process (shared with any `tracy_client::GpuContext` the app
//!   makes) and cannot delete one. A lane's context outlives its exporter: a later exporter's lane of the same
//!   name and kind takes it over, so a process that starts and stops timelines (a test suite) does not run
//!   out. Beyond 255 lanes of different names, further lanes' zones are counted
//!   ([`TracyStats::gpu_zones_without_context`]), not shown.
//! - Events are Tracy messages; instants are literal messages (their name).
//! - Tracy is one per process: a second timeline with a Tracy exporter running at the same time names its
//!   plots (drift, drops, counters) `... [timeline 2]`, so Tracy draws each timeline's values apart. CPU zones
//!   and messages of both go to the threads that made them.
//! - Async tasks (see [`tickline::AsyncTasks`]) are not shown as tasks: each poll is a zone on the worker
//!   thread that ran it, as with any span, but no lifetime slice and no task track. Tracy's only way to show
//!   work apart from OS threads is its fiber API (`___tracy_fiber_enter`/`leave`), which attributes the zones
//!   that follow to a fiber *as they are recorded*, on the thread, at the moment of the switch, with Tracy's own
//!   clock: it cannot place a slice after the fact. tickline decides that a span is a task only when it is
//!   entered a second time (in the collector, later), and a task's lifetime slice spans its awaits, when no
//!   thread runs it, which a fiber zone cannot. Calling the fiber API on every enter of every span instead
//!   would cost each synchronous span two more Tracy calls and turn every span into a fiber (the reason the
//!   tracy-client fiber prototype was dropped, rust_tracy_client issue 35). Use the Perfetto exporter, in the
//!   same run if needed, for the task view.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![doc(test(attr(deny(warnings))))]

mod gpu;
mod live;
mod srcloc;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tickline::{
    export::{Batch, EventKind, ExportError, Exporter, LiveSink, NameId, TrackId, TrackKind},
    TimelineBuilder,
};
use tracy_client::{Client, PlotName};

use gpu::{GpuZones, Lane};
use live::TracyLive;

/// Why Tracy could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TracyError {
    /// No Tracy profiler connected within the time given ([`TracyExporter::wait_for_connection`]).
    NotConnected {
        /// How long it was waited for.
        waited: std::time::Duration,
    },
}

impl std::fmt::Display for TracyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TracyError::NotConnected { waited } => write!(
                f,
                "no Tracy profiler connected to this process within {:.1} s (start the Tracy profiler and \
                 connect it to this process's address, port 8086 by default)",
                waited.as_secs_f64()
            ),
        }
    }
}

impl std::error::Error for TracyError {}

/// What the exporter did so far. Read with [`TracyExporter::stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TracyStats {
    /// GPU zones uploaded.
    pub gpu_zones: u64,
    /// Tracy GPU contexts this exporter's GPU lanes took (one per lane that had a zone): made, or taken over
    /// from an earlier exporter's lane of the same name (see the crate caveats).
    pub gpu_contexts: u64,
    /// GPU zones dropped because no profiler was connected when their outermost slice began (on-demand mode).
    pub gpu_zones_not_captured: u64,
    /// GPU zones not uploaded because they were older than the re-anchoring allows (see the crate caveats).
    pub stale_gpu_zones: u64,
    /// GPU zones not uploaded because Tracy had no GPU context left (255 per process).
    pub gpu_zones_without_context: u64,
    /// Re-anchorings of GPU contexts (one per context per export that uploads to it).
    pub anchors: u64,
    /// Anchoring calls repeated because they took longer than 250 ns (a preemption, a wait for Tracy's lock).
    pub anchor_retries: u64,
    /// Longest time an accepted anchoring call took (an upper bound on the offset it can introduce), in ns.
    pub anchor_latency_max_ns: f64,
    /// Sum of the anchoring calls' times, in ns (divide by `anchors` for the mean).
    pub anchor_latency_sum_ns: f64,
    /// Plot points sent.
    pub plot_points: u64,
}

/// Streams a tickline timeline to Tracy. Make one, [`install`](Self::install) it on a
/// [`TimelineBuilder`] (it is both the timeline's [`LiveSink`] and one of its exporters), start the timeline,
/// and point the Tracy profiler at the process.
///
/// ```
/// let tracy = tickline_tracy::TracyExporter::new();
/// let stats = tracy.stats();
/// let timeline = tracy.install(tickline::Timeline::builder()).start().unwrap();
/// drop(tickline::scope!("load"));
/// timeline.shutdown().unwrap();
/// assert_eq!(stats.get().gpu_zones, 0);
/// ```
pub struct TracyExporter {
    client: Client,
    /// Which of the exporters running at once this is (0 for the first): Tracy is one per process.
    number: ExporterNumber,
    live: Arc<TracyLive>,
    names: HashMap<NameId, String>,
    /// GPU device tracks: name, whether the API is Vulkan.
    devices: HashMap<TrackId, (String, bool)>,
    plots: HashMap<TrackId, PlotName>,
    gpu: GpuZones,
    stats: TracyStats,
    shared_stats: StatsHandle,
}

impl std::fmt::Debug for TracyExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TracyExporter").field("stats", &self.stats).finish()
    }
}

impl Default for TracyExporter {
    fn default() -> Self {
        Self::new()
    }
}

/// A handle on a [`TracyExporter`]'s statistics, readable while the timeline runs (the exporter itself
/// belongs to the collector thread).
#[derive(Clone, Debug, Default)]
pub struct StatsHandle(Arc<Mutex<TracyStats>>);

impl StatsHandle {
    /// The statistics as of the last batch exported.
    pub fn get(&self) -> TracyStats {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl TracyExporter {
    /// An exporter on this process's Tracy client (started if it is not running yet).
    pub fn new() -> Self {
        TracyExporter {
            client: Client::start(),
            number: ExporterNumber::claim(),
            live: Arc::new(TracyLive::new()),
            names: HashMap::new(),
            devices: HashMap::new(),
            plots: HashMap::new(),
            gpu: GpuZones::default(),
            stats: TracyStats::default(),
            shared_stats: StatsHandle::default(),
        }
    }

    /// The hot-path half, to give to [`TimelineBuilder::live_sink`]. [`install`](Self::install) does it.
    pub fn live_sink(&self) -> Arc<dyn LiveSink> {
        self.live.clone()
    }

    /// Installs the exporter on `builder`: as its live sink (CPU zones, messages, frame marks) and as an
    /// exporter (GPU zones, plots).
    pub fn install(self, builder: TimelineBuilder) -> TimelineBuilder {
        builder.live_sink(self.live_sink()).exporter(self)
    }

    /// A handle on the exporter's statistics.
    pub fn stats(&self) -> StatsHandle {
        self.shared_stats.clone()
    }

    /// Whether a Tracy profiler is connected to this process now.
    pub fn is_connected() -> bool {
        Client::is_connected()
    }

    /// Waits up to `timeout` for a Tracy profiler to connect to this process: for a program that should record
    /// only while someone is watching (with `ondemand`, nothing is captured before), or that must not run
    /// unobserved. A profiler that does not come is an error that says so, never a hang.
    ///
    /// ```
    /// use std::time::Duration;
    /// // No profiler runs beside the doc tests.
    /// let err = tickline_tracy::TracyExporter::wait_for_connection(Duration::from_millis(50)).unwrap_err();
    /// assert!(err.to_string().contains("no Tracy profiler connected"));
    /// ```
    pub fn wait_for_connection(timeout: std::time::Duration) -> Result<(), TracyError> {
        // Tracy's client starts with the process (or here, if it was not running yet).
        let _client = Client::start();
        let start = std::time::Instant::now();
        loop {
            if Client::is_connected() {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(TracyError::NotConnected { waited });
            }
            std::thread::sleep((timeout - waited).min(std::time::Duration::from_millis(5)));
        }
    }

    fn add_track(&mut self, track: &tickline::export::TrackDescriptor) {
        match &track.kind {
            TrackKind::GpuDevice { name, api } => {
                // Tracy's Vulkan context type for Vulkan devices, however they are reached (ash, wgpu-hal).
                let vulkan = api.contains("Vulkan");
                self.devices.insert(track.id, (format!("{name} ({api})"), vulkan));
            }
            TrackKind::GpuQueue { name, lane } => {
                if let Some((device, vulkan)) = track.parent.and_then(|p| self.devices.get(&p)) {
                    let name = match lane {
                        0 => format!("{device} / {name}"),
                        lane => format!("{device} / {name} ({})", lane + 1),
                    };
                    self.gpu.add_lane(track.id, Lane::new(name, *vulkan));
                }
            }
            TrackKind::Counter { name, unit } => {
                let label = if unit.is_empty() {
                    name.clone()
                } else {
                    format!("{name} ({unit})")
                };
                self.plots.insert(track.id, plot_name(self.number.label(label)));
            }
            _ => {}
        }
    }
}

/// Exporters alive now, by number: an exporter takes the lowest free one.
static EXPORTER_NUMBERS: Mutex<Vec<bool>> = Mutex::new(Vec::new());

/// An exporter's number among those alive at once, given back when it is dropped.
struct ExporterNumber(usize);

impl ExporterNumber {
    fn claim() -> Self {
        let mut taken = EXPORTER_NUMBERS.lock().unwrap_or_else(|e| e.into_inner());
        let number = taken.iter().position(|t| !t).unwrap_or(taken.len());
        if number == taken.len() {
            taken.push(true);
        } else {
            taken[number] = true;
        }
        ExporterNumber(number)
    }

    /// A plot's label as this exporter shows it: the second exporter running at once (two timelines) puts
    /// its number after it, or Tracy would draw both timelines' values as one plot.
    fn label(&self, label: String) -> String {
        match self.0 {
            0 => label,
            n => format!("{label} [timeline {}]", n + 1),
        }
    }
}

impl Drop for ExporterNumber {
    fn drop(&mut self) {
        let mut taken = EXPORTER_NUMBERS.lock().unwrap_or_else(|e| e.into_inner());
        taken[self.0] = false;
    }
}

/// Tracy keeps a plot's name for the whole process: each label is leaked once, however many timelines
/// show it.
fn plot_name(label: String) -> PlotName {
    static NAMES: Mutex<Option<HashMap<String, PlotName>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    *names
        .get_or_insert_with(HashMap::new)
        .entry(label)
        .or_insert_with_key(|label| PlotName::new_leak(label.clone()))
}

impl Exporter for TracyExporter {
    fn export(&mut self, batch: &Batch) -> Result<(), ExportError> {
        for track in &batch.new_tracks {
            self.add_track(track);
        }
        for (id, name) in &batch.new_names {
            self.names.insert(*id, name.clone());
        }
        let capturing = live::capturing();
        for event in &batch.events {
            match event.kind {
                EventKind::SliceBegin if self.gpu.is_lane(event.track) => {
                    self.gpu.begin(event.track, event.name, event.ts_ns, capturing);
                }
                EventKind::SliceEnd if self.gpu.is_lane(event.track) => {
                    self.gpu.end(event.track, event.ts_ns, &mut self.stats);
                }
                EventKind::Counter(value) => {
                    if let Some(plot) = self.plots.get(&event.track) {
                        if capturing {
                            self.client.plot(*plot, value);
                            self.stats.plot_points += 1;
                        }
                    }
                }
                // CPU slices, events and instants reached Tracy on their own threads (the live sink).
                _ => {}
            }
        }
        if capturing {
            self.gpu
                .upload(&self.client, batch.cpu_clock, &self.names, &mut self.stats);
        } else {
            self.gpu.drop_ready(&mut self.stats);
        }
        *self.shared_stats.0.lock().unwrap_or_else(|e| e.into_inner()) = self.stats;
        Ok(())
    }

    fn flush(&mut self) -> Result<(), ExportError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tickline::export::{TrackDescriptor, TrackKind};

    fn counter(exporter: &mut TracyExporter) -> PlotName {
        let track = TrackDescriptor {
            id: TrackId(7),
            parent: None,
            kind: TrackKind::Counter {
                name: "tickline TSC drift".into(),
                unit: "ppm".into(),
            },
        };
        exporter.add_track(&track);
        exporter.plots[&TrackId(7)]
    }

    #[test]
    fn exporters_running_at_once_name_their_plots_apart_and_numbers_are_reused() {
        let mut first = TracyExporter::new();
        let mut second = TracyExporter::new();
        let (a, b) = (counter(&mut first), counter(&mut second));
        assert_ne!(a, b, "two timelines' drift would be one plot");
        // The only exporters in this test binary: the first is number 0 and shows the plain name.
        assert_eq!(first.number.0, 0);
        assert_eq!(a, plot_name("tickline TSC drift (ppm)".into()));
        assert_eq!(
            b,
            plot_name(format!("tickline TSC drift (ppm) [timeline {}]", second.number.0 + 1))
        );
        let number = second.number.0;
        drop(second);
        // The next exporter takes the free number: a program that restarts timelines keeps its plot names.
        let mut third = TracyExporter::new();
        assert_eq!(third.number.0, number);
        assert_eq!(counter(&mut third), b);
    }
}
