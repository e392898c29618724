//! [`Timeline`] and [`TimelineBuilder`]: the handle an application keeps, and how it is configured.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Once};
use std::time::Duration;

use crate::clock::{TickSource, TickSourceDecision, TscCalibrator, TscCalibratorConfig, TscDecider};
use crate::collector::capture::CaptureWriter;
use crate::collector::drain::DrainConfig;
use crate::collector::stats::SharedStats;
use crate::collector::{self, AsyncTasks, Collector, CollectorSetup, TimelineStats};
use crate::control::Control;
use crate::error::TicklineError;
use crate::export::{ExportError, Exporter};
use crate::gpu::{GpuBackend, GpuCalibrationConfig, GpuControl, GpuDevice};
use crate::layer::TicklineLayer;
use crate::live::{self, LiveSink};
use crate::recorder::{self, Shared};

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
    max_ring_capacity: usize,
    poll_interval: Duration,
    chunk_budget_bytes: u64,
    tick_source: Option<TickSource>,
    decision: Option<TickSourceDecision>,
    calibration: TscCalibratorConfig,
    gpu_calibration: GpuCalibrationConfig,
    live: Option<Arc<dyn LiveSink>>,
    raw_capture: Option<PathBuf>,
    async_tasks: AsyncTasks,
}

impl std::fmt::Debug for TimelineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimelineBuilder")
            .field("exporters", &self.exporters.len())
            .field("lossless", &self.lossless)
            .field("ring_capacity", &self.ring_capacity)
            .field("max_ring_capacity", &self.max_ring_capacity)
            .field("poll_interval", &self.poll_interval)
            .field("chunk_budget_bytes", &self.chunk_budget_bytes)
            .field("tick_source", &self.tick_source)
            .field("live_sink", &self.live.is_some())
            .field("raw_capture", &self.raw_capture)
            .field("async_tasks", &self.async_tasks)
            .finish()
    }
}

/// The default chunk budget: 256 MiB of drained records may wait for the processing stage.
const DEFAULT_CHUNK_BUDGET: u64 = 256 << 20;

impl Default for TimelineBuilder {
    fn default() -> Self {
        TimelineBuilder {
            exporters: Vec::new(),
            lossless: false,
            // 64 Ki records = 1 MiB per thread: several milliseconds of a thread recording flat out, and the
            // drain stage wakes when a ring passes half full. A ring that fills anyway grows (4x at a time)
            // up to 1 Mi records = 16 MiB before it drops: a burst costs memory, not records.
            ring_capacity: 1 << 16,
            max_ring_capacity: 1 << 20,
            poll_interval: Duration::from_millis(1),
            chunk_budget_bytes: DEFAULT_CHUNK_BUDGET,
            tick_source: None,
            decision: None,
            calibration: TscCalibratorConfig::default(),
            gpu_calibration: GpuCalibrationConfig::default(),
            live: None,
            raw_capture: None,
            async_tasks: AsyncTasks::Auto,
        }
    }
}

impl TimelineBuilder {
    /// Adds an exporter (Perfetto file, Tracy, memory...). Every exporter gets every batch.
    pub fn exporter(mut self, exporter: impl Exporter + 'static) -> Self {
        self.exporters.push(Box::new(exporter));
        self
    }

    /// Lossless mode: a thread whose ring is full waits for the collector instead of dropping records.
    /// For tests and offline captures; the default (drop whole slices and count them) never stalls the
    /// application. A record made while its thread is making another (from a field's `Debug`, or a signal
    /// handler) is still dropped and counted, as is a launch's begin recorded by CUPTI's capture when its ring is
    /// full (that runs inside the application's CUDA call, which must not wait on the collector), and what no
    /// ring can take (on the collector's own thread, in a
    /// child made by `fork`) is counted in [`TimelineStats::unrecorded_records`] (see the crate's Caveats).
    pub fn lossless(mut self, lossless: bool) -> Self {
        self.lossless = lossless;
        self
    }

    /// Records per thread ring (rounded up to a power of two, at least 64 and at most
    /// [`MAX_RING_CAPACITY`](Self::MAX_RING_CAPACITY)), fixed (unless
    /// [`max_ring_capacity`](Self::max_ring_capacity) is called after this): a full ring drops records (drop
    /// mode) or waits (lossless mode). Each record is 16 bytes. Without this call rings start at 64 Ki records
    /// and grow, when one fills, up to [`max_ring_capacity`](Self::max_ring_capacity).
    ///
    /// ```
    /// use tickline::{Timeline, TimelineBuilder};
    /// // Clamped: a thread's ring is allocated on its first record, where no error could be returned.
    /// let builder = Timeline::builder().ring_capacity(usize::MAX);
    /// let max = TimelineBuilder::MAX_RING_CAPACITY;
    /// assert!(format!("{builder:?}").contains(&format!("ring_capacity: {max}")));
    /// // Rounded up to a power of two.
    /// let builder = Timeline::builder().ring_capacity(100);
    /// assert!(format!("{builder:?}").contains("ring_capacity: 128"));
    /// ```
    pub fn ring_capacity(mut self, records: usize) -> Self {
        // MAX_RING_CAPACITY is a power of two: the clamped value rounds up to at most it.
        self.ring_capacity = records.clamp(64, Self::MAX_RING_CAPACITY).next_power_of_two();
        self.max_ring_capacity = self.ring_capacity;
        self
    }

    /// The largest ring, in records: 2^26, 1 GiB per thread. Larger capacities are clamped to it (a ring is
    /// allocated on its thread's first record, on the hot path, which has no way to report an allocation
    /// that cannot succeed).
    pub const MAX_RING_CAPACITY: usize = 1 << 26;

    /// How large a thread's ring may grow, in records (default 1 Mi = 16 MiB; at least the starting
    /// capacity, at most [`MAX_RING_CAPACITY`](Self::MAX_RING_CAPACITY)), when it fills in drop mode: it moves
    /// on to a ring four times as large instead of dropping, up to this, unless the
    /// [`chunk_budget`](Self::chunk_budget) is full. Records are dropped (whole slices, counted) only when a
    /// ring this large is full, or the budget is. The larger ring is allocated by the recording thread, at that
    /// moment: the one allocation the hot path makes after warm-up. For none at all, fix the size with
    /// [`ring_capacity`](Self::ring_capacity) (called after this, it fixes the size; called before, it sets
    /// the starting size this grows from). Until the rings a thread grew out of are drained, it holds them
    /// too: at most a third more (64 Ki + 256 Ki + 1 Mi records by default, 21 MiB).
    pub fn max_ring_capacity(mut self, records: usize) -> Self {
        self.max_ring_capacity = records
            .clamp(self.ring_capacity, Self::MAX_RING_CAPACITY)
            .next_power_of_two();
        self
    }

    /// How often the collector drains the rings (it also wakes when a ring passes half full); 1 ms by default.
    /// At least 50 µs (a shorter interval, zero included, is taken as 50 µs): each pass costs the collector's
    /// threads some CPU even when idle (about half a core at 50 µs here, 7 % at 1 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval.max(Duration::from_micros(50));
        self
    }

    /// Memory, in bytes, that drained records may take while they wait to be processed (default 256 MiB; at
    /// least 64 KiB). Draining stops when it is full, and rings stop growing, so rings fill and drop (or,
    /// lossless, wait) only then. It is checked once per drain pass, which moves whole rings: the pass that
    /// fills it may take it over by up to one ring per thread, and a ring a thread grew out of or ended with
    /// is drained whatever the budget (its own memory is freed as it is). Its use is the
    /// `tickline buffered records` counter track.
    pub fn chunk_budget(mut self, bytes: u64) -> Self {
        self.chunk_budget_bytes = bytes.max(1 << 16);
        self
    }

    /// Forces the CPU tick source instead of checking the TSC's reliability at start.
    pub fn tick_source(mut self, source: TickSource) -> Self {
        self.tick_source = Some(source);
        self
    }

    /// Test hook: start with this tick-source decision instead of the process's (a decider with injected
    /// faults, say), as if the process had made it.
    #[doc(hidden)]
    pub fn tick_source_decision(mut self, decision: TickSourceDecision) -> Self {
        self.decision = Some(decision);
        self
    }

    /// How the CPU clock is calibrated (burst size and interval, history). A setting out of its range makes
    /// [`start`](Self::start) fail with [`TicklineError::Calibration`] (see [`TscCalibratorConfig::validate`]).
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
    /// converted with the newest fit and exported. Shorter: less latency (live viewers); longer: more slices
    /// placed by interpolation.
    pub fn gpu_latency_bound(mut self, bound: Duration) -> Self {
        self.gpu_calibration.latency_bound = bound;
        self
    }

    /// Writes everything drained, raw, to a `.tickline` file at `path`, to be converted later with
    /// [`crate::capture::convert`] or `tickline convert`: the cheapest recording. Without exporters nothing is
    /// converted while the program runs.
    pub fn raw_capture(mut self, path: impl Into<PathBuf>) -> Self {
        self.raw_capture = Some(path.into());
        self
    }

    /// Installs a [`LiveSink`]: hooks called on the instrumented thread as the layer and the native macros
    /// record (for live viewers, such as the Tracy exporter, that must emit on the thread itself). The sink
    /// is kept for the rest of the process (see [`LiveSink`]).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # struct Nothing;
    /// # impl tickline::export::LiveSink for Nothing {
    /// #     fn span_enter(&self, _: &'static tracing::Metadata<'static>, _: Option<&tickline::export::LiveSpanData>) {}
    /// #     fn span_exit(&self) {}
    /// #     fn scope_begin(&self, _: &'static tickline::export::NativeCallsite) {}
    /// #     fn scope_end(&self, _: &'static tickline::export::NativeCallsite) {}
    /// # }
    /// let timeline = tickline::Timeline::builder().live_sink(Arc::new(Nothing)).start().unwrap();
    /// # drop(timeline);
    /// ```
    pub fn live_sink(mut self, sink: Arc<dyn LiveSink>) -> Self {
        self.live = Some(sink);
        self
    }

    /// Which spans get an async task track in the trace (default [`AsyncTasks::Auto`]: spans entered more
    /// than once or on several threads, such as `#[instrument]`ed futures). Exporters that have no async
    /// tracks (Tracy) show the polls on the worker threads only.
    pub fn async_tasks(mut self, mode: AsyncTasks) -> Self {
        self.async_tasks = mode;
        self
    }

    /// Checks the tick source, calibrates it, and starts the collector's threads.
    ///
    /// Fails with [`TicklineError::Calibration`] for a calibration setting out of its range
    /// ([`TscCalibratorConfig::validate`](crate::clock::TscCalibratorConfig::validate)) or a forced tick source
    /// this CPU does not have, with [`TicklineError::Gpu`] for a [`GpuCalibrationConfig`] out of its range
    /// ([`GpuCalibrationConfig::validate`]), and with [`TicklineError::Export`] when the raw capture file
    /// cannot be created.
    pub fn start(self) -> Result<Timeline, TicklineError> {
        if let Some(source) = self.tick_source {
            if source != TickSource::Monotonic && TickSource::hardware() != Some(source) {
                return Err(crate::calibration::CalibrationError::InvalidConfig {
                    what: "tick_source: this CPU has no such counter (Tsc is x86_64's, ArmVirtualCounter aarch64's)",
                }
                .into());
            }
        }
        self.gpu_calibration.validate().map_err(|e| {
            TicklineError::Gpu(crate::gpu::GpuError::Invalid {
                detail: format!("GpuCalibrationConfig: {e}"),
            })
        })?;
        // The process's decision, made once (a short check now, a fuller one in the background) and reused
        // by every later start; a running timeline never switches source.
        let decision = match (self.tick_source, self.decision) {
            (Some(source), _) => TickSourceDecision::forced(source),
            (None, Some(decision)) => decision,
            (None, None) => TscDecider::process().decide(),
        };
        let (source, tsc_fallback_reason) = (decision.source, decision.fallback_reason.clone());
        let calibrator = TscCalibrator::new(source, self.calibration)?;
        let capture = match &self.raw_capture {
            Some(path) => Some(CaptureWriter::create(path).map_err(|e| TicklineError::Export(ExportError::Io(e)))?),
            None => None,
        };
        let (control_tx, control_rx) = crossbeam_channel::unbounded();
        let mut shared = Shared::with_growth(
            control_tx,
            self.lossless,
            self.ring_capacity,
            self.max_ring_capacity,
            source,
        );
        shared.time_creations = self.async_tasks != AsyncTasks::Never;
        shared.every_span_a_task = self.async_tasks == AsyncTasks::Always;
        let shared = Arc::new(shared);
        let stats = Arc::new(SharedStats::default());
        let setup = CollectorSetup {
            drain: DrainConfig {
                poll_interval: self.poll_interval,
                chunk_budget_bytes: self.chunk_budget_bytes,
                cpu_burst_samples: self.calibration.burst_samples,
                cpu_burst_interval: self.calibration.interval,
                gpu: self.gpu_calibration,
            },
            process_name: crate::sync::process_name(),
            cpu_domain: calibrator.history().domain(),
            cpu_history: self.calibration.history,
            exporters: self.exporters,
            capture,
            decision: decision.clone(),
            async_tasks: self.async_tasks,
        };
        let (gpu_registrations, gpu_rx) = crossbeam_channel::unbounded();
        let inbox = collector::Inbox {
            control: control_rx,
            gpu: gpu_rx,
        };
        let collector =
            collector::spawn(&shared, inbox, setup, stats.clone()).map_err(TicklineError::CollectorSpawn)?;
        if let Some(live) = self.live.map(live::leak) {
            let _ = shared.live.set(live);
        }
        recorder::started(&shared);
        register_exit_flush();
        Ok(Timeline {
            shared,
            gpu_registrations,
            collector: Some(collector),
            stats,
            source,
            tsc_fallback_reason,
            decision,
        })
    }
}

/// A running timeline: the collector's threads and their exporters. Dropping it drains everything recorded
/// before the drop, finishes the exporters and joins the threads.
///
/// Several timelines may run at once (each test its own, say): `tracing` spans and events go to the timeline of
/// the [`layer`](Timeline::layer) in their subscriber; native macros ([`scope!`](macro@crate::scope) and the
/// others) on a thread that started a timeline go to it, elsewhere to the most recently started one (see
/// [`scope!`'s "Which timeline"](macro@crate::scope#which-timeline)).
///
/// # When the process ends
///
/// On a normal exit, `std::process::exit` included, every running timeline is flushed first (an `atexit`
/// hook), so the trace holds everything recorded before the exit; the exporters are flushed, not finished.
/// A [`shutdown`](Timeline::shutdown) under way on another thread is waited for. The hook waits at most 5 s per
/// timeline, and 5 s for the shutdowns (an exporter that blocks cannot hold the exit longer).
/// A process killed with `SIGKILL`, or ended by `abort()` (a panic with `panic = "abort"`), runs no code:
/// the Perfetto exporter writes whole packets at least every `flush_interval` (500 ms by default), and a raw
/// capture is written out as often, so such a trace loses at most about its last 0.6 s and still loads.
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
    /// The collector's GPU channel (devices and queues joining).
    gpu_registrations: crossbeam_channel::Sender<GpuControl>,
    collector: Option<Collector>,
    stats: Arc<SharedStats>,
    source: TickSource,
    tsc_fallback_reason: Option<String>,
    decision: TickSourceDecision,
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
    /// A builder with the defaults: drop mode, rings of 64 Ki records per thread growing up to 1 Mi, 1 ms
    /// polling, TSC checked at start.
    pub fn builder() -> TimelineBuilder {
        TimelineBuilder::default()
    }

    /// The `tracing` layer that records into this timeline. Use one per subscriber.
    pub fn layer(&self) -> TicklineLayer {
        TicklineLayer::new(self.shared.clone(), self.shared.live.get().copied())
    }

    /// The CPU tick source in use.
    pub fn tick_source(&self) -> TickSource {
        self.source
    }

    /// Why the TSC was found unusable, when tickline fell back from it to `CLOCK_MONOTONIC`. `None` when the
    /// TSC is in use, and when [`TimelineBuilder::tick_source`] chose the source (see
    /// [`tick_source_decision`](Self::tick_source_decision)).
    pub fn tsc_fallback_reason(&self) -> Option<&str> {
        self.tsc_fallback_reason.as_deref()
    }

    /// The tick-source decision this timeline started with (the trace carries it too, on the process track,
    /// with any later finding of the background check).
    pub fn tick_source_decision(&self) -> &TickSourceDecision {
        &self.decision
    }

    /// Counters so far.
    pub fn stats(&self) -> TimelineStats {
        let mut stats = self.stats.snapshot();
        stats.unrecorded_records = self.shared.unrecorded.load(Ordering::Relaxed);
        stats
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
        GpuDevice::register(&self.shared, &self.gpu_registrations, backend)
    }

    /// Drains everything recorded before this call, exports it and flushes the exporters. Slices still open
    /// go out with the values their spans have now; values recorded later go on their ends. A slice that
    /// ended while the flush ran (after this call) goes out up to its end, which follows with the next
    /// export, so that it still shows values recorded on other threads before it ended.
    ///
    /// Fails if an exporter has failed since the start (the first failure is reported), or if the collector
    /// is gone.
    pub fn flush(&self) -> Result<(), TicklineError> {
        self.shared.processing_paused.store(false, Ordering::Relaxed);
        request(&self.shared, Control::Flush, None).map_err(|e| self.error(e))
    }

    fn error(&self, e: RequestError) -> TicklineError {
        match e {
            RequestError::Gone => TicklineError::CollectorGone,
            RequestError::Export => match self.stats.first_export_error() {
                Some(first) => TicklineError::Export(first.to_export_error()),
                None => TicklineError::CollectorGone,
            },
        }
    }

    /// Test hook: while `paused`, the collector drains the rings only for a flush or shutdown, as a
    /// collector that cannot keep up would. Lets tests fill rings on purpose (in lossless mode, a thread whose
    /// ring is full then waits for the next flush).
    #[doc(hidden)]
    pub fn pause_drain(&self, paused: bool) {
        self.shared.drain_paused.store(paused, Ordering::Relaxed);
    }

    /// Test hook: while `paused`, the processing stage takes nothing from the drain stage, which goes on
    /// draining into chunk memory (up to the budget), as a processing stage far behind would. A flush or
    /// shutdown ends the pause.
    #[doc(hidden)]
    pub fn pause_processing(&self, paused: bool) {
        self.shared.processing_paused.store(paused, Ordering::Relaxed);
    }

    /// Stops recording, drains everything, finishes the exporters and joins the collector. Returns the final
    /// counters, or the first export failure.
    pub fn shutdown(mut self) -> Result<TimelineStats, TicklineError> {
        self.stop()?;
        Ok(self.stats())
    }

    fn stop(&mut self) -> Result<(), TicklineError> {
        let Some(collector) = self.collector.take() else {
            return Ok(());
        };
        // Counted until the collector is joined: an exit meanwhile (another thread calls `process::exit`)
        // waits for it, as it flushes a running timeline, instead of ending the process mid-shutdown.
        let _stopping = Stopping::begin();
        self.shared.running.store(false, Ordering::Release);
        self.shared.processing_paused.store(false, Ordering::Relaxed);
        recorder::stopped(self.shared.id);
        if self.shared.in_forked_child() {
            // The collector's threads live in the parent only: nothing to ask, nothing to join here.
            std::mem::forget(collector);
            return Err(TicklineError::CollectorGone);
        }
        let result = request(&self.shared, Control::Shutdown, None).map_err(|e| self.error(e));
        let drain = collector.drain.join();
        let process = collector.process.join();
        match (result, drain, process) {
            (Ok(()), Ok(()), Ok(())) => Ok(()),
            (Err(e), _, _) => Err(e),
            _ => Err(TicklineError::CollectorGone),
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

enum RequestError {
    Gone,
    Export,
}

/// Sends a flush or shutdown request to `shared`'s collector and waits for the answer (at most `timeout`).
fn request(
    shared: &Shared,
    make: fn(crate::control::Reply) -> Control,
    timeout: Option<Duration>,
) -> Result<(), RequestError> {
    if shared.in_forked_child() {
        return Err(RequestError::Gone);
    }
    let (tx, rx) = crossbeam_channel::bounded(1);
    shared.control.send(make(tx)).map_err(|_| RequestError::Gone)?;
    if let Some(drain) = shared.drain_thread.get() {
        drain.unpark();
    }
    let answer = match timeout {
        Some(timeout) => rx.recv_timeout(timeout).map_err(|_| RequestError::Gone)?,
        None => rx.recv().map_err(|_| RequestError::Gone)?,
    };
    answer.map_err(|_| RequestError::Export)
}

/// Longest the exit hook waits for one timeline's flush.
const EXIT_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Timelines whose shutdown is under way (no longer running, not joined yet), and its change.
static STOPPING: (std::sync::Mutex<usize>, std::sync::Condvar) = (std::sync::Mutex::new(0), std::sync::Condvar::new());

/// One shutdown under way, counted in [`STOPPING`] while it lives.
struct Stopping;

impl Stopping {
    fn begin() -> Stopping {
        *STOPPING.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Stopping
    }

    /// Waits until no shutdown is under way, at most `timeout`.
    fn wait_all(timeout: Duration) {
        let count = STOPPING.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = STOPPING.1.wait_timeout_while(count, timeout, |count| *count > 0);
    }
}

impl Drop for Stopping {
    fn drop(&mut self) {
        let mut count = STOPPING.0.lock().unwrap_or_else(|e| e.into_inner());
        *count = count.saturating_sub(1);
        STOPPING.1.notify_all();
    }
}

/// Registers, once per process, an `atexit` hook that flushes every running timeline, so a program that
/// ends with `std::process::exit` (or returns from `main` with a timeline still alive, say in a static)
/// keeps everything it recorded.
fn register_exit_flush() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        extern "C" fn flush_running_timelines() {
            // Never unwind out of an `extern "C"` function.
            let _ = std::panic::catch_unwind(|| {
                for shared in recorder::running_timelines() {
                    let _ = request(&shared, Control::Flush, Some(EXIT_FLUSH_TIMEOUT));
                }
                // A shutdown under way on another thread finishes its exporters first.
                Stopping::wait_all(EXIT_FLUSH_TIMEOUT);
            });
        }
        // SAFETY: `atexit` takes a function pointer with the C ABI and no arguments, which this is; the
        // function stays valid for the life of the process (it is a plain `fn`). A non-zero result (no
        // room for more hooks) only means the exit flush is not installed.
        let _ = unsafe { libc::atexit(flush_running_timelines) };
    });
}

impl crate::gpu::sealed::Sealed for Timeline {}

impl crate::gpu::GpuTimeline for Timeline {
    fn add_gpu<B: GpuBackend>(&self, backend: B) -> Result<GpuDevice<B>, TicklineError> {
        self.gpu(backend)
    }
}
