//! Every CUDA kernel, copy and memset on the timeline without a scope (feature `cupti`): [`CuptiCapture`]
//! turns CUPTI's activity records into GPU slices, one track per stream, each with a flow from the CPU code
//! that launched it.
//!
//! ```no_run
//! use tickline::gpu::cupti::{CuptiCapture, CuptiOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let timeline = tickline::Timeline::builder().start()?;
//! let ctx = tickline::gpu::cuda::open(0)?;
//! // GpuError::NoLoader without libcupti.so; GpuError::Api when another CUPTI client (Nsight) holds it.
//! let capture = CuptiCapture::start(&timeline, &ctx, CuptiOptions::default())?;
//! // ... launch kernels, copies, graphs on any stream, through the runtime or the driver API ...
//! ctx.synchronize()?;
//! let stats = capture.stop(); // delivers what CUPTI still holds
//! println!("{} launches captured, {} records dropped by CUPTI", stats.launches, stats.dropped_records);
//! timeline.shutdown()?;
//! # Ok(())
//! # }
//! ```
//!
//! # Design
//!
//! - **The CPU side: CUPTI's driver API callbacks.** Every launch, copy, memset and graph launch calls back on
//!   the launching thread, before the call. The callback records a GPU scope's begin there (what
//!   [`gpu_scope!`](crate::gpu_scope) records), on the queue of the call's stream, named after the kernel
//!   (CUPTI's `symbolName`) or the copy's direction, with fields `correlation_id`, `api` and, for kernels,
//!   `grid` and `block`. So the flow starts inside the `tracing` span that launched the work, with no CUPTI
//!   external correlation ids pushed on every span entry. Only the driver domain is subscribed: a runtime
//!   call calls back again from its driver call with the same correlation id (seen on CUDA 13.0), so each
//!   launch is seen once.
//! - **The GPU side: activity records.** CUPTI's records (concurrent kernels, memcpy, memset) arrive in
//!   buffers, on CUPTI's thread or in a flush. Each record's correlation id finds the scope its launch
//!   opened; its start and end become the scope's two timestamps. Kernels named `tickline_*` (the CUDA
//!   backend's timestamp kernels) are not captured.
//! - **CUDA graphs: a slice per node, from a graph's second launch.** A graph launch has one correlation id
//!   and one record per node (CUPTI's `graphNodeId`). A scope's begin is recorded by the launching thread, which
//!   does not know the nodes of a graph it has never seen run: the first launch of a graph executable is one
//!   slice (`graph launch`) spanning its nodes, and its records teach the capture the graph's nodes. Every
//!   later launch opens a scope per node, named by its kernel (CUPTI's name) or its copy's direction, with a
//!   `graph_node` field. A call that changes which nodes a graph executable runs (`cuGraphExecUpdate`,
//!   `cuGraphNodeSetEnabled`, `cuGraphExecChildGraphNodeSetParams`, `cuGraphExecNodeSetParams`) or destroys it
//!   (its handle may come back for another graph) makes the capture forget its nodes: its next launch is one
//!   slice again, and records of launches from before the change teach nothing. Nodes a graph's records show
//!   that it did not have (a change CUPTI did not call back for) are learned at its next launch; a node scope no
//!   record came for is lost (never read back). The first launch's
//!   nodes delivered in a later buffer than its first node are counted in
//!   [`CuptiStats::unattributed_records`] (its slice spans those delivered together).
//! - **The clock.** CUPTI maps the GPU's timer to CPU time itself, by default onto `CLOCK_REALTIME` (which
//!   can step). The capture registers a timestamp callback returning `CLOCK_MONOTONIC` (tickline's
//!   reference), and still calibrates CUPTI's timestamps as a device clock of their own: each calibration
//!   sample is a one-thread kernel launched on a private stream between two `CLOCK_MONOTONIC` reads (the CUDA
//!   backend's probe), whose CUPTI record says when, in CUPTI's time, it started: after the launch call and
//!   before the host saw its store, so inside the bracket. So CUPTI's own interpolation error is measured, and
//!   stated in every slice's uncertainty, like any device clock's. The domain's resolution is the GPU timer's,
//!   measured at start (32 ns on an H200: CUPTI's durations there are multiples of it).
//! - **Losses are counted.** Records CUPTI drops (full buffers) are read with
//!   `cuptiActivityGetNumDroppedRecords` and counted in the timeline's dropped records (with the trace's
//!   "records dropped" marker) and [`CuptiStats::dropped_records`]; their scopes are lost (never read back) and
//!   shown as such. A launch with no free timestamp pair is counted starved, and dropped.
//!
//! # Limits
//!
//! - **Run on one GPU** (an H200, CUDA 13.0, 2026-11-28): the device test (`cargo test --features cupti --test
//!   it cupti`) and `cuda_kernels --cupti` (256 of 256 launches captured) pass; figures in the README. The whole
//!   path is also tested without a GPU, against a stand-in for CUPTI and the GPU whose clock is 1 ms ahead and
//!   30 ppm fast, with every kernel's true times known (unit tests `end_to_end`), and every entry point binds
//!   against NVIDIA's real libcupti in CI.
//! - Dropped records are counted on the next thread that launches work (or the one that stops the capture):
//!   a drop is counted on a recording thread's ring, and CUPTI hands records out on its own threads.
//! - One capture per process: CUPTI allows one subscriber, and its activity buffers are process-wide.
//! - A call that fails leaves its scope never read back: it is counted lost after the GPU loss bound
//!   (`GpuCalibrationConfig::lost_after`), and its pair serves again (the capture refuses late writes).
//! - The capture shows the work of the CUDA context it was started with; launches in other contexts (another
//!   GPU) are counted in [`CuptiStats::other_context_launches`].
//! - Work recorded into a stream being captured into a graph is not shown when recorded (it does not run then);
//!   each launch of the graph is.
//! - Calibration samples come from records CUPTI hands out at a non-forced flush; a buffer holding a record of
//!   a kernel still running is not handed out, so a burst during a long kernel may bring no sample.

mod apis;
#[cfg(test)]
mod fake;
mod ffi;

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::ffi::{c_char, c_void, CStr};
use std::fmt;
use std::io::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;

use self::apis::{Api, ApiKind};
use self::ffi::{CallbackData, Cupti, Record};
use crate::calibration::{CalibrationSample, ClockDomain};
use crate::export::NativeCallsite;
use crate::gpu::cuda::{CudaGpu, CudaOptions, CudaTiming};
use crate::gpu::{GpuBackend, GpuDevice, GpuDeviceInfo, GpuError, GpuFieldEncoder, GpuQueue, GpuTicks, GpuTimeline};

/// How a [`CuptiCapture`] runs.
#[derive(Clone, Debug)]
pub struct CuptiOptions {
    /// Where `libcupti.so` is; `None`: `TICKLINE_CUPTI_LIBRARY`, then the loader's search path, then the CUDA
    /// toolkit's usual folders.
    pub library: Option<PathBuf>,
    /// Launches whose records may be outstanding at once (each holds a timestamp pair); past it a launch is
    /// counted starved and not shown. Even, 2..=2 Mi.
    pub timestamp_slots: u32,
    /// Bytes of each activity buffer handed to CUPTI (8..=256 MiB; CUPTI drops records when it has no buffer).
    pub buffer_bytes: usize,
    /// How often CUPTI hands out buffers whose records are complete (`cuptiActivityFlushPeriod`; where CUPTI
    /// lacks it, tickline flushes at most this often itself). 1 ms..=1 s.
    pub flush_period: Duration,
}

impl Default for CuptiOptions {
    /// 131,072 slots (65,536 launches in flight, 1 MiB), 4 MiB buffers, a flush every 10 ms.
    fn default() -> Self {
        CuptiOptions {
            library: None,
            timestamp_slots: 1 << 17,
            buffer_bytes: 4 << 20,
            flush_period: Duration::from_millis(10),
        }
    }
}

impl CuptiOptions {
    fn validate(&self) -> Result<(), GpuError> {
        let invalid = |detail: String| Err(GpuError::Invalid { detail });
        if self.timestamp_slots < 2 || self.timestamp_slots % 2 != 0 || self.timestamp_slots > 1 << 21 {
            return invalid(format!(
                "CuptiOptions::timestamp_slots is {}; it must be even, 2..=2097152",
                self.timestamp_slots
            ));
        }
        if !(8..=256 << 20).contains(&self.buffer_bytes) {
            return invalid(format!(
                "CuptiOptions::buffer_bytes is {}; it must be 8..=268435456",
                self.buffer_bytes
            ));
        }
        if !(Duration::from_millis(1)..=Duration::from_secs(1)).contains(&self.flush_period) {
            return invalid(format!(
                "CuptiOptions::flush_period is {:?}; it must be 1 ms..=1 s",
                self.flush_period
            ));
        }
        Ok(())
    }
}

/// What a [`CuptiCapture`] saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CuptiStats {
    /// Launches (kernels, copies, memsets, graph launches) whose scope was opened.
    pub launches: u64,
    /// Activity records read (kernels, copies, memsets; a graph launch brings one per node; the capture's own
    /// calibration probes included).
    pub records: u64,
    /// Records shown on no slice: work launched before the capture started or by a starved launch, the CUDA
    /// backend's own timestamp kernels (two per `gpu_scope!` on a `CudaGpu`), nodes of a graph's first launch
    /// (or copies of a batch) delivered after its slice was written, nodes a graph did not have when launched,
    /// and records that came after their launch was counted lost.
    pub unattributed_records: u64,
    /// Records CUPTI delivered without timestamps (their scope is counted lost).
    pub incomplete_records: u64,
    /// Records CUPTI dropped (no buffer free), also in the timeline's dropped records.
    pub dropped_records: u64,
    /// Launches not shown because every timestamp pair was in flight (also in the timeline's dropped records);
    /// for a graph launch, its node scopes.
    pub starved_launches: u64,
    /// Launches in other CUDA contexts than the capture's (not shown: their GPU's clock is not the one the
    /// capture calibrates).
    pub other_context_launches: u64,
}

/// The GPU backend behind a [`CuptiCapture`]: its timestamps are CUPTI's, written by the capture when
/// records arrive. Made by [`CuptiCapture::start`]; nothing else records into it (`Commands` is
/// uninhabited, so [`gpu_scope!`](crate::gpu_scope) cannot take it).
pub struct CuptiGpu {
    shared: Arc<Shared>,
}

impl fmt::Debug for CuptiGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CuptiGpu")
            .field("device", &self.shared.info.name)
            .finish()
    }
}

/// CUPTI's activity capture on a timeline. Stop it with [`stop`](Self::stop) (or drop it) after
/// synchronising your streams and before shutting the timeline down, so CUPTI's last records reach it.
pub struct CuptiCapture {
    device: GpuDevice<CuptiGpu>,
    shared: Arc<Shared>,
    stopped: bool,
}

impl fmt::Debug for CuptiCapture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CuptiCapture")
            .field("device", &self.shared.info.name)
            .field("cupti", &self.shared.cupti.path)
            .field("stopped", &self.stopped)
            .finish()
    }
}

/// The running capture, for CUPTI's buffer callbacks (which carry no user pointer).
static ACTIVE: Mutex<Option<Arc<Shared>>> = Mutex::new(None);
/// The capture CUPTI's API callbacks go to (null: none), and how many callbacks are using it now: stopping
/// clears the first and waits for the second to reach 0, so no callback uses a capture after it stopped
/// (CUPTI does not promise that `cuptiUnsubscribe` waits for callbacks running on other threads).
static CALLBACK_TARGET: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
static CALLBACKS_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Addresses of the buffers handed to CUPTI and not yet back: a buffer CUPTI hands back that is not among them
/// belongs to another CUPTI client (its callbacks were replaced by ours) and is left alone.
static OUR_BUFFERS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);
/// A number per thread, for the queues of per-thread default streams.
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);
/// Bytes of the buffers handed to CUPTI (set at start, read by the buffer callbacks).
static BUFFER_BYTES: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// While this thread takes calibration samples: the correlation ids of its probe launches, in order.
    static PROBES: RefCell<Option<Vec<u32>>> = const { RefCell::new(None) };
    /// This thread's number (its per-thread default stream is a queue of its own).
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

/// Most kernel names interned (each a leaked call site); past it kernels are named [`OVERFLOW`] with their
/// name as a field.
const MAX_NAMES: usize = 4096;
const FIELDS: &[&str] = &["correlation_id", "api", "grid", "block", "kernel", "graph_node"];
static OVERFLOW: NativeCallsite =
    NativeCallsite::with_fields("CUDA kernel (name table full)", FIELDS, file!(), line!());

/// The GPU side of a capture: what the device is called, its timer's resolution, how probes are launched and
/// how stream capture is seen.
struct Gpu {
    name: String,
    resolution_ns: f64,
    probe: Prober,
    capturing: fn(usize) -> bool,
    context: usize,
}

/// Takes bracketed probe launches: `(ticks, reference ns, max deviation ns)` per probe, in launch order, each
/// launch calling CUPTI back on this thread.
enum Prober {
    /// The CUDA backend's `%globaltimer` stamp kernel on its private stream.
    Cuda(Box<CudaGpu>),
    /// A test's stand-in for the GPU.
    #[cfg(test)]
    Fake(Box<FakeProbes>),
}

/// A test's probe launcher: `(samples, budget, out)`, as [`GpuBackend::calibrate`].
#[cfg(test)]
type FakeProbes = dyn Fn(usize, Duration, &mut Vec<CalibrationSample>) -> Result<(), GpuError> + Send + Sync;

impl Prober {
    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        match self {
            Prober::Cuda(gpu) => gpu.calibrate(samples, budget, out),
            #[cfg(test)]
            Prober::Fake(f) => f(samples, budget, out),
        }
    }
}

struct Shared {
    cupti: Cupti,
    info: GpuDeviceInfo,
    /// Word `2p` and `2p + 1`: pair `p`'s start and end in CUPTI's ns; 0 until written.
    slots: Box<[AtomicU64]>,
    /// Launches calibration probes on a private stream.
    probe: Prober,
    /// Whether a stream is being captured into a graph.
    capturing: fn(usize) -> bool,
    /// The context whose work is captured (`CUcontext`); work of other contexts is counted, not shown.
    context: usize,
    /// Whether activity recording was turned on (so stopping turns it off, and leaves another client's alone).
    kinds_enabled: AtomicBool,
    other_contexts: AtomicU64,
    state: Mutex<State>,
    subscriber: AtomicUsize,
    flush_period: Duration,
    /// Where CUPTI lacks a flush period of its own: when tickline last flushed.
    last_flush: Mutex<Instant>,
    launches: AtomicU64,
    records: AtomicU64,
    unattributed: AtomicU64,
    incomplete: AtomicU64,
    dropped: AtomicU64,
    /// CUPTI's drops not yet counted in the timeline's: counted on the next launching thread (a drop counts on
    /// a recording thread's ring, and records are handed out on CUPTI's or tickline's threads).
    drops_to_count: AtomicU64,
    starved: AtomicU64,
}

/// A calibration probe: its reference bracket (once its burst returned, if it finished in time), CUPTI's
/// (start, end) of it (once its record came), and the burst that launched it.
#[derive(Clone, Copy, Default)]
struct Probe {
    bracket: Option<CalibrationSample>,
    span: Option<(u64, u64)>,
    burst: u64,
}

/// A launch whose records have not come yet.
enum Launch {
    /// One scope for all its records (a graph launch's nodes merged, when the graph's nodes are not known).
    One {
        pair: u32,
        /// The pair's state word when handed out.
        state: u32,
        /// The graph executable launched (0: not a graph launch): its records teach its nodes.
        graph: usize,
        /// The graph's version at the launch ([`State::graph_version`]): records of a launch from before a
        /// change teach nothing.
        version: u64,
    },
    /// A launch of a graph whose nodes are known: one scope per node.
    Nodes {
        graph: usize,
        version: u64,
        /// (node id, pair or [`NO_PAIR`] or [`DONE`], the pair's state word when handed out), in node order.
        pairs: Vec<(u64, u32, u32)>,
    },
}

/// A node of a graph executable: CUPTI's id for it and the call site its slices are named by.
#[derive(Clone)]
struct GraphNode {
    id: u64,
    callsite: &'static NativeCallsite,
    /// The node's name where the name table was full (the call site is then [`OVERFLOW`]).
    overflowed: Option<Arc<str>>,
}

#[derive(Default)]
struct State {
    /// Correlation id -> (pair, the pair's state word when handed out).
    open: HashMap<u32, Launch>,
    /// A graph executable (its handle) -> its nodes in id order, learned from the records of its launches.
    graphs: HashMap<usize, Vec<GraphNode>>,
    /// Correlation id -> graph executable and its version, of graph launches shown as one slice (their later
    /// records still teach the graph's nodes). Cleared when it reaches [`MAX_GRAPH_LAUNCHES`].
    graph_launches: HashMap<u32, (usize, u64)>,
    /// Graph executables changed or destroyed since the capture started -> their version now (see
    /// [`State::graph_version`]); cleared, with everything known of graphs, when it reaches
    /// [`MAX_GRAPH_LAUNCHES`].
    graph_versions: HashMap<usize, u64>,
    /// The version the next change gives its graph.
    next_graph_version: u64,
    /// Correlation ids of calibration probes -> what is known of them.
    probes: HashMap<u32, Probe>,
    /// Calibration bursts so far.
    bursts: u64,
    /// (context, stream handle, thread number for a per-thread default stream, else 0) -> its queue.
    queues: HashMap<(usize, usize, u64), GpuQueue<CuptiGpu>>,
    names: HashMap<Box<str>, &'static NativeCallsite>,
    /// The device, for queues made later; `None` once stopped (breaks the device -> backend -> state cycle).
    device: Option<GpuDevice<CuptiGpu>>,
}

/// A node scope that could not be opened (no free pair).
const NO_PAIR: u32 = u32::MAX;
/// A node whose record came.
const DONE: u32 = u32::MAX - 1;
/// Graph launches remembered for their late records.
const MAX_GRAPH_LAUNCHES: usize = 4096;

impl State {
    /// Graph `graph`'s version: 0 until a call changes the nodes it runs (an update, a node enabled or disabled,
    /// a child graph or a node's parameters set) or destroys it (its handle may come back for another graph),
    /// then a new one at each. A launch's records teach the graph's nodes only if no change came since the
    /// launch.
    fn graph_version(&self, graph: usize) -> u64 {
        self.graph_versions.get(&graph).copied().unwrap_or(0)
    }

    /// Forgets what is known of graph `graph`'s nodes: its next launch is one slice again, whose records teach
    /// them anew. A graph whose nodes were kept across an update would have a scope opened, and lost, for a
    /// removed node at every launch.
    fn graph_changed(&mut self, graph: usize) {
        if self.graph_versions.len() >= MAX_GRAPH_LAUNCHES {
            // Bounded: every graph is learned again from its next launch; launches from before learn nothing.
            self.graph_versions.clear();
            self.graphs.clear();
            self.graph_launches.clear();
            for launch in self.open.values_mut() {
                match launch {
                    Launch::One { version, .. } | Launch::Nodes { version, .. } => *version = u64::MAX,
                }
            }
        }
        self.next_graph_version += 1;
        self.graph_versions.insert(graph, self.next_graph_version);
        self.graphs.remove(&graph);
    }

    /// Adds the nodes `records` ran as to what is known of graph `graph` (kept in node id order), if they are
    /// of a launch of its current `version`.
    ///
    /// # Safety
    ///
    /// `records` were read from a buffer CUPTI handed out, which is still being read (a kernel's name pointer
    /// is then CUPTI's string, alive).
    unsafe fn learn(&mut self, graph: usize, version: u64, records: &[Record]) {
        if version != self.graph_version(graph) {
            return;
        }
        for r in records.iter().filter(|r| r.graph_node != 0) {
            let known = self
                .graphs
                .get(&graph)
                .map(|nodes| nodes.binary_search_by_key(&r.graph_node, |n| n.id));
            if let Some(Ok(_)) = known {
                continue;
            }
            // SAFETY: the caller's guarantee.
            let name = unsafe { node_name(r) };
            let (callsite, overflowed) = self.callsite(&name);
            let overflowed = overflowed.then(|| Arc::from(name.as_ref()));
            let nodes = self.graphs.entry(graph).or_default();
            let at = nodes
                .binary_search_by_key(&r.graph_node, |n| n.id)
                .unwrap_or_else(|at| at);
            nodes.insert(
                at,
                GraphNode {
                    id: r.graph_node,
                    callsite,
                    overflowed,
                },
            );
        }
    }

    /// The call site slices named `name` are recorded with (made once per name); the boolean says the name
    /// table was full (the name then goes in the `kernel` field of [`OVERFLOW`]).
    fn callsite(&mut self, name: &str) -> (&'static NativeCallsite, bool) {
        match self.names.get(name) {
            Some(&callsite) => (callsite, false),
            None if self.names.len() >= MAX_NAMES => (&OVERFLOW, true),
            None => {
                // Leaked on purpose: the collector resolves a scope's name through its call site at any later
                // time; MAX_NAMES bounds the leak.
                let leaked: &'static str = Box::leak(name.into());
                let callsite: &'static NativeCallsite =
                    Box::leak(Box::new(NativeCallsite::with_fields(leaked, FIELDS, file!(), line!())));
                self.names.insert(name.into(), callsite);
                (callsite, false)
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A NUL-terminated string CUPTI passed, or `None`.
///
/// # Safety
///
/// `text` is null or a NUL-terminated string alive for `'a`.
unsafe fn c_text<'a>(text: *const c_char) -> Option<&'a str> {
    if text.is_null() {
        return None;
    }
    // SAFETY: the caller's guarantee.
    unsafe { CStr::from_ptr(text) }.to_str().ok()
}

impl CuptiCapture {
    /// Starts capturing every kernel, copy and memset launched in `ctx`'s process onto `timeline`, on a GPU
    /// device of its own (tracks "`<GPU name>` (CUPTI)", one queue per stream, named `stream <CUPTI id>`).
    ///
    /// Errors: [`GpuError::NoLoader`] when `libcupti.so` is not found (the message names where it looked);
    /// [`GpuError::Api`] when CUPTI refuses (another CUPTI client, such as Nsight Systems, holds its one
    /// subscription; no permission to profile); [`GpuError::Invalid`] for bad options or a capture already
    /// running in this process; [`GpuError::NoTimestamps`] when the device's `%globaltimer` cannot calibrate
    /// CUPTI's clock. The timeline keeps running in every case.
    pub fn start(
        timeline: &impl GpuTimeline,
        ctx: &Arc<CudaContext>,
        options: CuptiOptions,
    ) -> Result<CuptiCapture, GpuError> {
        options.validate()?;
        let cupti = Cupti::open(options.library.as_deref())?;
        let probe = CudaGpu::new(
            ctx,
            CudaOptions {
                timestamp_slots: 2,
                timing: CudaTiming::GlobalTimer,
            },
        )?;
        let resolution_ns = probe.clock().resolution_ns.max(1) as f64;
        let name = format!("{} (CUPTI)", probe.info().name);
        let gpu = Gpu {
            name,
            resolution_ns,
            probe: Prober::Cuda(Box::new(probe)),
            capturing,
            context: ctx.cu_ctx() as usize,
        };
        CuptiCapture::start_with(timeline, cupti, gpu, options)
    }

    /// [`start`](Self::start) with CUPTI and the GPU side given: the real ones, or a test's.
    fn start_with(
        timeline: &impl GpuTimeline,
        cupti: Cupti,
        gpu: Gpu,
        options: CuptiOptions,
    ) -> Result<CuptiCapture, GpuError> {
        options.validate()?;
        let mut active = lock(&ACTIVE);
        if active.is_some() {
            return Err(GpuError::Invalid {
                detail: "a CuptiCapture is already running in this process (CUPTI allows one)".into(),
            });
        }
        let info = GpuDeviceInfo {
            name: gpu.name,
            api: "CUDA (CUPTI)",
            // CUPTI's timestamps: ns (tickline's CLOCK_MONOTONIC through the timestamp callback), 64 bits,
            // derived from the GPU timer, which changes every `resolution_ns`.
            clock: ClockDomain::new(64, 1.0)
                .and_then(|d| d.with_resolution_ns(gpu.resolution_ns))
                .map_err(|e| GpuError::Invalid {
                    detail: format!("CUPTI clock domain: {e}"),
                })?,
            timestamp_slots: options.timestamp_slots,
        };
        let shared = Arc::new(Shared {
            cupti,
            info,
            slots: (0..options.timestamp_slots).map(|_| AtomicU64::new(0)).collect(),
            probe: gpu.probe,
            capturing: gpu.capturing,
            context: gpu.context,
            kinds_enabled: AtomicBool::new(false),
            other_contexts: AtomicU64::new(0),
            state: Mutex::new(State::default()),
            subscriber: AtomicUsize::new(0),
            flush_period: options.flush_period,
            last_flush: Mutex::new(Instant::now()),
            launches: AtomicU64::new(0),
            records: AtomicU64::new(0),
            unattributed: AtomicU64::new(0),
            incomplete: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            drops_to_count: AtomicU64::new(0),
            starved: AtomicU64::new(0),
        });
        BUFFER_BYTES.store(options.buffer_bytes, Ordering::Relaxed);
        *active = Some(shared.clone());
        drop(active);
        // Subscribed before the device joins the timeline, so its first calibration burst sees its probes. A
        // launch in between finds no device and is not shown; its record is counted unattributed.
        if let Err(e) = shared.enable(options.flush_period) {
            shared.disable();
            return Err(e);
        }
        let device = match timeline.add_gpu(CuptiGpu { shared: shared.clone() }) {
            Ok(device) => device,
            Err(e) => {
                shared.disable();
                return Err(GpuError::Invalid {
                    detail: format!("the timeline refused CUPTI's device: {e}"),
                });
            }
        };
        lock(&shared.state).device = Some(device.clone());
        Ok(CuptiCapture {
            device,
            shared,
            stopped: false,
        })
    }

    /// The GPU device the captured work is shown on (its calibration, its backend).
    pub fn device(&self) -> &GpuDevice<CuptiGpu> {
        &self.device
    }

    /// The counts so far.
    pub fn stats(&self) -> CuptiStats {
        self.shared.stats()
    }

    /// Which `libcupti.so` is in use, and its API version (`cuptiGetVersion`: 130001 for CUDA 13.0).
    pub fn library(&self) -> (&std::path::Path, u32) {
        (&self.shared.cupti.path, self.shared.cupti.version)
    }

    /// Stops capturing: no more callbacks, CUPTI's remaining records delivered (a forced flush; records of
    /// work still running come without timestamps and their scopes are counted lost), activity recording
    /// disabled. Returns the final counts.
    pub fn stop(mut self) -> CuptiStats {
        self.stop_now();
        self.shared.stats()
    }

    fn stop_now(&mut self) {
        if !std::mem::replace(&mut self.stopped, true) {
            self.shared.disable();
        }
    }
}

impl Drop for CuptiCapture {
    fn drop(&mut self) {
        self.stop_now();
    }
}

impl Shared {
    fn stats(&self) -> CuptiStats {
        CuptiStats {
            launches: self.launches.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
            unattributed_records: self.unattributed.load(Ordering::Relaxed),
            incomplete_records: self.incomplete.load(Ordering::Relaxed),
            dropped_records: self.dropped.load(Ordering::Relaxed),
            starved_launches: self.starved.load(Ordering::Relaxed),
            other_context_launches: self.other_contexts.load(Ordering::Relaxed),
        }
    }

    /// Subscribes to CUPTI's callbacks, then registers the buffer and timestamp callbacks and turns recording
    /// on. Subscribing comes first: when another client holds CUPTI, nothing of its activity settings is touched.
    fn enable(self: &Arc<Self>, flush_period: Duration) -> Result<(), GpuError> {
        let c = &self.cupti;
        CALLBACK_TARGET.store(Arc::as_ptr(self).cast_mut(), Ordering::SeqCst);
        let mut subscriber: *mut c_void = std::ptr::null_mut();
        // SAFETY: `on_api` matches `CUpti_CallbackFunc` and catches every panic; it finds the capture through
        // CALLBACK_TARGET (the user pointer is not used).
        let result = unsafe { (c.subscribe)(&mut subscriber, on_api, std::ptr::null_mut()) };
        if result == ffi::MULTIPLE_SUBSCRIBERS {
            return Err(GpuError::Api {
                call: "cuptiSubscribe",
                detail: format!(
                    "{}: another CUPTI client (Nsight Systems, Nsight Compute, another profiler) holds CUPTI in \
                     this process",
                    c.describe(result)
                ),
            });
        }
        c.check("cuptiSubscribe", result)?;
        self.subscriber.store(subscriber as usize, Ordering::Release);
        if let Some(register) = c.register_timestamp_callback {
            // SAFETY: `monotonic` is an `extern "C" fn() -> u64` that never unwinds; registered before any
            // activity kind is enabled, as CUPTI asks.
            c.check("cuptiActivityRegisterTimestampCallback", unsafe { register(monotonic) })?;
        }
        // SAFETY: both are `extern "C"` functions of the types CUPTI expects, valid for the process' life; they
        // catch every panic.
        c.check("cuptiActivityRegisterCallbacks", unsafe {
            (c.register_callbacks)(buffer_requested, buffer_completed)
        })?;
        if let Some(period) = c.flush_period {
            // SAFETY: plain value argument.
            c.check("cuptiActivityFlushPeriod", unsafe {
                period(flush_period.as_millis() as u32)
            })?;
        }
        for api in apis::APIS {
            // SAFETY: our live subscriber handle; plain values.
            let result = unsafe { (c.enable_callback)(1, subscriber, ffi::DOMAIN_DRIVER, api.cbid) };
            c.check("cuptiEnableCallback", result)?;
        }
        self.kinds_enabled.store(true, Ordering::Release);
        for kind in [ffi::KIND_CONCURRENT_KERNEL, ffi::KIND_MEMCPY, ffi::KIND_MEMSET] {
            // SAFETY: plain value argument.
            c.check("cuptiActivityEnable", unsafe { (c.enable)(kind) })?;
        }
        Ok(())
    }

    /// Unsubscribes, waits for callbacks still running, delivers what CUPTI holds (drops counted on this
    /// thread), disables recording, and lets go of the device.
    fn disable(&self) {
        let c = &self.cupti;
        if std::ptr::eq(CALLBACK_TARGET.load(Ordering::SeqCst), self) {
            CALLBACK_TARGET.store(std::ptr::null_mut(), Ordering::SeqCst);
        }
        // A callback that took the old target counted itself in before it did (both SeqCst): once the count is 0,
        // none uses this capture.
        while CALLBACKS_IN_FLIGHT.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        let subscriber = self.subscriber.swap(0, Ordering::AcqRel);
        if subscriber != 0 {
            // SAFETY: the handle `cuptiSubscribe` gave, unsubscribed once (swapped out above).
            let _ = unsafe { (c.unsubscribe)(subscriber as *mut c_void) };
        }
        if self.kinds_enabled.swap(false, Ordering::AcqRel) {
            // SAFETY: plain value argument; the buffer callbacks run during the call and catch every panic.
            let _ = unsafe { (c.flush_all)(ffi::FLUSH_FORCED) };
            let mut dropped = 0usize;
            // SAFETY: null context and stream 0: the records dropped outside any context's buffers; writes one
            // usize through a live local.
            if unsafe { (c.dropped_records)(std::ptr::null_mut(), 0, &mut dropped) } == ffi::SUCCESS && dropped > 0 {
                self.dropped.fetch_add(dropped as u64, Ordering::Relaxed);
                self.drops_to_count.fetch_add(dropped as u64, Ordering::Relaxed);
            }
            self.count_drops();
            for kind in [ffi::KIND_CONCURRENT_KERNEL, ffi::KIND_MEMCPY, ffi::KIND_MEMSET] {
                // SAFETY: plain value argument.
                let _ = unsafe { (c.disable)(kind) };
            }
        }
        {
            let mut active = lock(&ACTIVE);
            if active.as_ref().is_some_and(|a| std::ptr::eq(&**a, self)) {
                *active = None;
            }
        }
        let mut state = lock(&self.state);
        state.queues.clear();
        state.device = None;
    }

    /// An API callback: opens the scope of a launch at its entry.
    fn on_api(&self, api: &Api, data: &CallbackData) {
        if api.kind == ApiKind::GraphChange {
            // Once the call is made: a launch after it runs the changed graph.
            if data.site != ffi::API_ENTER && data.context as usize == self.context {
                // SAFETY: `function_params` is CUPTI's parameter struct for this call (`api`'s, by its callback id).
                let params = unsafe { apis::launch_params(api, data.function_params) };
                if params.graph != 0 {
                    lock(&self.state).graph_changed(params.graph);
                }
            }
            return;
        }
        if data.site != ffi::API_ENTER {
            return;
        }
        let correlation = data.correlation_id;
        let symbol = match api.kind {
            // SAFETY: CUPTI's symbol name for a launch (valid for launch callbacks only), alive during the callback.
            ApiKind::Kernel => unsafe { c_text(data.symbol_name) },
            _ => None,
        };
        let probing = PROBES
            .try_with(|p| {
                let mut p = p.borrow_mut();
                if let Some(ids) = p.as_mut() {
                    ids.push(correlation);
                    true
                } else {
                    false
                }
            })
            .unwrap_or(false);
        if probing {
            let mut state = lock(&self.state);
            let burst = state.bursts;
            state.probes.insert(
                correlation,
                Probe {
                    burst,
                    ..Probe::default()
                },
            );
            return;
        }
        if symbol.is_some_and(|s| s.starts_with("tickline_")) {
            return; // the CUDA backend's timestamp kernels
        }
        if data.context as usize != self.context {
            self.other_contexts.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.count_drops();
        // SAFETY: `function_params` is CUPTI's parameter struct for this call (`api`'s, by its callback id).
        let params = unsafe { apis::launch_params(api, data.function_params) };
        // The per-thread default stream's handle is CU_STREAM_PER_THREAD (2); the legacy one cannot be captured.
        let handle = if params.stream == 0 && api.per_thread {
            2
        } else {
            params.stream
        };
        if handle != 0 && (self.capturing)(handle) {
            return; // recorded into a graph, not run: the graph's launches are captured
        }
        let Some((queue, callsite, overflowed)) = self.queue_and_name(api, symbol, data.context, params.stream) else {
            // Stopped, or the device refused another queue: not shown, counted.
            self.starved.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let mut grid = [0u8; 40];
        let mut block = [0u8; 40];
        let grid = dims_text(&mut grid, params.grid);
        let block = dims_text(&mut block, params.block);
        let kernel = if overflowed { symbol } else { None };
        let fields = |e: &mut GpuFieldEncoder<'_, '_>| {
            e.field(0, &u64::from(correlation));
            e.field(1, api.name);
            if let Some(grid) = grid {
                e.field(2, grid);
            }
            if let Some(block) = block {
                e.field(3, block);
            }
            if let Some(kernel) = kernel {
                e.field(4, kernel);
            }
        };
        let (nodes, version) = match params.graph {
            0 => (None, 0),
            graph => {
                let state = lock(&self.state);
                (state.graphs.get(&graph).cloned(), state.graph_version(graph))
            }
        };
        if let Some(nodes) = nodes {
            // A graph whose nodes are known: a scope per node, each with the node's name and id.
            let mut pairs = Vec::with_capacity(nodes.len());
            for node in &nodes {
                let fields = |e: &mut GpuFieldEncoder<'_, '_>| {
                    e.field(0, &u64::from(correlation));
                    e.field(1, api.name);
                    if let Some(name) = &node.overflowed {
                        e.field(4, name.as_ref());
                    }
                    e.field(5, &node.id);
                };
                match queue.begin_external(node.callsite, Some(&fields), |_| {}) {
                    Some(pair) => pairs.push((node.id, pair, queue.pair_state(pair))),
                    None => {
                        // Kept without a pair: its record is then known, not a stranger to the graph.
                        pairs.push((node.id, NO_PAIR, 0));
                        self.starved.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if pairs.iter().any(|&(_, pair, _)| pair != NO_PAIR) {
                self.launches.fetch_add(1, Ordering::Relaxed);
            }
            let launch = Launch::Nodes {
                graph: params.graph,
                version,
                pairs,
            };
            lock(&self.state).open.insert(correlation, launch);
            return;
        }
        match queue.begin_external(callsite, Some(&fields), |_| {}) {
            Some(pair) => {
                let launch = Launch::One {
                    pair,
                    state: queue.pair_state(pair),
                    graph: params.graph,
                    version,
                };
                lock(&self.state).open.insert(correlation, launch);
                self.launches.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                self.starved.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Counts CUPTI's drops so far in the timeline's dropped records, on this (an application's) thread.
    fn count_drops(&self) {
        if self.drops_to_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let n = self.drops_to_count.swap(0, Ordering::Relaxed);
        if let Some(device) = lock(&self.state).device.as_ref() {
            device.count_dropped(n as usize);
        }
    }

    /// The queue of a call's stream (made on first use) and the call site naming its work; `None` once
    /// stopped. The boolean says the name table was full (the name then goes in the `kernel` field).
    fn queue_and_name(
        &self,
        api: &Api,
        symbol: Option<&str>,
        context: *mut c_void,
        stream: usize,
    ) -> Option<(GpuQueue<CuptiGpu>, &'static NativeCallsite, bool)> {
        let per_thread = api.per_thread && stream == 0;
        // Each thread's per-thread default stream is a stream of its own.
        let thread = if per_thread {
            THREAD.try_with(|t| *t).unwrap_or(0)
        } else {
            0
        };
        let key = (context as usize, stream, thread);
        let known = {
            let state = lock(&self.state);
            state.device.as_ref()?;
            state.queues.get(&key).cloned()
        };
        let queue = match known {
            Some(queue) => queue,
            None => {
                // CUPTI's id for the stream, asked without holding the capture's lock (CUPTI may hold a lock of
                // its own here that its buffer callbacks, which take the capture's lock, run under).
                let mut id = 0u32;
                // SAFETY: the call's context and stream handle as CUPTI passed them (live during the callback);
                // writes one u32 through a live local.
                let result =
                    unsafe { (self.cupti.stream_id)(context, stream as *mut c_void, u8::from(per_thread), &mut id) };
                let name = if result == ffi::SUCCESS {
                    format!("stream {id}")
                } else {
                    format!("stream {stream:#x}")
                };
                let mut state = lock(&self.state);
                match state.queues.get(&key) {
                    Some(queue) => queue.clone(),
                    None => {
                        let queue = state.device.as_ref()?.queue(&name).ok()?;
                        state.queues.insert(key, queue.clone());
                        queue
                    }
                }
            }
        };
        let (callsite, overflowed) = lock(&self.state).callsite(work_name(api, symbol));
        Some((queue, callsite, overflowed))
    }

    /// Reads one buffer CUPTI handed back.
    ///
    /// # Safety
    ///
    /// `buffer` is a buffer CUPTI filled, `valid` bytes of it with records.
    unsafe fn take_buffer(&self, context: *mut c_void, stream: u32, buffer: *mut u8, valid: usize) {
        let mut records = Vec::new();
        let mut cursor: *mut u8 = std::ptr::null_mut();
        loop {
            // SAFETY: CUPTI walks its own buffer (the caller's guarantee) and writes the next record's address.
            if unsafe { (self.cupti.next_record)(buffer, valid, &mut cursor) } != ffi::SUCCESS {
                break; // MAX_LIMIT_REACHED: the end; any other result: nothing more can be read
            }
            let offset = (cursor as usize).wrapping_sub(buffer as usize);
            if cursor.is_null() || offset >= valid {
                break;
            }
            // SAFETY: `cursor` lies inside the buffer's valid part (checked above), which CUPTI filled.
            let bytes = unsafe { std::slice::from_raw_parts(cursor, valid - offset) };
            if let Some(record) = ffi::parse(bytes) {
                records.push(record);
            }
        }
        let mut dropped = 0usize;
        // SAFETY: the context and stream CUPTI passed with this buffer; writes one usize through a live local.
        if unsafe { (self.cupti.dropped_records)(context, stream, &mut dropped) } == ffi::SUCCESS && dropped > 0 {
            self.dropped.fetch_add(dropped as u64, Ordering::Relaxed);
            self.drops_to_count.fetch_add(dropped as u64, Ordering::Relaxed);
        }
        self.apply(&records);
    }

    /// Writes what records say into the slots of the launches they belong to.
    fn apply(&self, records: &[Record]) {
        self.records.fetch_add(records.len() as u64, Ordering::Relaxed);
        let mut records = records.to_vec();
        records.sort_by_key(|r| (r.correlation, r.graph_node));
        let mut state = lock(&self.state);
        for group in records.chunk_by(|a, b| a.correlation == b.correlation) {
            let m = merge(group);
            if let Some(probe) = state.probes.get_mut(&m.correlation) {
                probe.span = m.span;
                continue;
            }
            match state.open.remove(&m.correlation) {
                None => {
                    self.unattributed.fetch_add(u64::from(m.records), Ordering::Relaxed);
                    // Nodes of a graph's first launch delivered after its slice was written still teach the graph.
                    if let Some(&(graph, version)) = state.graph_launches.get(&m.correlation) {
                        // SAFETY: records CUPTI handed out in the buffer being read.
                        unsafe { state.learn(graph, version, group) };
                    }
                }
                Some(Launch::One {
                    pair,
                    state: handed_out,
                    graph,
                    version,
                }) => {
                    self.incomplete.fetch_add(u64::from(m.incomplete), Ordering::Relaxed);
                    if graph != 0 {
                        // SAFETY: records CUPTI handed out in the buffer being read.
                        unsafe { state.learn(graph, version, group) };
                        if state.graph_launches.len() >= MAX_GRAPH_LAUNCHES {
                            state.graph_launches.clear();
                        }
                        state.graph_launches.insert(m.correlation, (graph, version));
                    }
                    if let Some((start, end)) = m.span {
                        self.write(&state, pair, handed_out, start, end, m.records);
                    } // else no timestamps: the scope is lost (never read back)
                }
                Some(Launch::Nodes {
                    graph,
                    version,
                    mut pairs,
                }) => {
                    // `pairs` is in node order, as the graph's nodes are: records are found by binary search.
                    let mut strangers = Vec::new();
                    for r in group {
                        let Ok(at) = pairs.binary_search_by_key(&r.graph_node, |&(id, ..)| id) else {
                            strangers.push(*r);
                            continue;
                        };
                        let (_, pair, handed_out) = std::mem::replace(&mut pairs[at], (r.graph_node, DONE, 0));
                        if pair >= DONE {
                            // Starved (no scope), or a second record of the node: counted, not shown.
                            self.unattributed.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        match merge(std::slice::from_ref(r)).span {
                            Some((start, end)) => self.write(&state, pair, handed_out, start, end, 1),
                            None => {
                                self.incomplete.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    if !strangers.is_empty() {
                        // Nodes the graph did not have (a change CUPTI did not call back for): counted, and known
                        // from its next launch on. Node scopes no record comes for are lost.
                        self.unattributed.fetch_add(strangers.len() as u64, Ordering::Relaxed);
                        // SAFETY: records CUPTI handed out in the buffer being read.
                        unsafe { state.learn(graph, version, &strangers) };
                    }
                    if pairs.iter().any(|&(_, pair, _)| pair < DONE) {
                        // Nodes still to come, in a later buffer.
                        state
                            .open
                            .insert(m.correlation, Launch::Nodes { graph, version, pairs });
                    }
                }
            }
        }
        // Launches whose record never came (a failed call, a dropped record) keep their entry after the
        // collector retired their pairs as lost: once there are more entries than pairs, those go.
        if state.open.len() > self.slots.len() / 2 {
            let State { open, device, .. } = &mut *state;
            if let Some(device) = device.as_ref() {
                open.retain(|_, launch| match launch {
                    Launch::One { pair, state, .. } => device.pair_state(*pair) == *state,
                    Launch::Nodes { pairs, .. } => pairs.iter().any(|&(_, p, s)| p < DONE && device.pair_state(p) == s),
                });
            }
        }
    }

    /// Writes a launch's start and end into its pair, if the pair still belongs to it (else the `records` are
    /// counted unattributed: the pair moved on, retired as lost).
    fn write(&self, state: &State, pair: u32, handed_out: u32, start: u64, end: u64, records: u32) {
        if state.device.as_ref().map(|d| d.pair_state(pair)) != Some(handed_out) {
            self.unattributed.fetch_add(u64::from(records), Ordering::Relaxed);
            return;
        }
        let (b, e) = (2 * pair as usize, 2 * pair as usize + 1);
        // Release: the collector's Acquire load that sees a timestamp sees the pair's other writes.
        self.slots[b].store(start.max(1), Ordering::Release);
        self.slots[e].store(end.max(start).max(1), Ordering::Release);
    }

    /// Flushes CUPTI's complete buffers, at most once a flush period, where CUPTI has no period of its own.
    fn flush_if_due(&self) {
        if self.cupti.flush_period.is_some() {
            return;
        }
        {
            let mut last = lock(&self.last_flush);
            if last.elapsed() < self.flush_period {
                return;
            }
            *last = Instant::now();
        }
        // SAFETY: plain value argument; the buffer callbacks run during the call and catch every panic.
        let _ = unsafe { (self.cupti.flush_all)(0) };
    }
}

/// Whether `stream` is being captured into a CUDA graph (work recorded into it does not run, so it brings no
/// activity record; what runs is the graph, when launched). An error reads as not capturing.
fn capturing(stream: usize) -> bool {
    let mut status = cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the stream handle the application passed to the call being made (live for the call's duration);
    // writes one status through a live local. The driver was loaded by the context the capture started with,
    // and `cuStreamIsCapturing` is not among the calls CUPTI calls back for here (no recursion).
    let result = unsafe { cudarc::driver::sys::cuStreamIsCapturing(stream as _, &mut status) };
    result == cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS
        && status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

/// What a slice is called: the kernel's name, the copy's direction.
fn work_name<'a>(api: &Api, symbol: Option<&'a str>) -> &'a str {
    match api.kind {
        ApiKind::Kernel => symbol.filter(|s| !s.is_empty()).unwrap_or("kernel"),
        ApiKind::Graph => "graph launch",
        ApiKind::GraphChange => "graph change",
        ApiKind::Memset => "memset",
        ApiKind::Memcpy => {
            let n = api.name;
            if n.contains("Peer") {
                "memcpy peer"
            } else if n.contains("HtoD") {
                "memcpy HtoD"
            } else if n.contains("DtoH") {
                "memcpy DtoH"
            } else if n.contains("DtoD") {
                "memcpy DtoD"
            } else if n.contains("Batch") {
                "memcpy batch"
            } else {
                "memcpy"
            }
        }
    }
}

/// `x×y×z` in `buffer`, without allocating.
fn dims_text(buffer: &mut [u8; 40], dims: Option<[u32; 3]>) -> Option<&str> {
    let [x, y, z] = dims?;
    let mut cursor = std::io::Cursor::new(&mut buffer[..]);
    write!(cursor, "{x}x{y}x{z}").ok()?;
    let len = cursor.position() as usize;
    std::str::from_utf8(&buffer[..len]).ok()
}

/// A buffer's records of one correlation id: the earliest start and latest end among those with timestamps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Merged {
    correlation: u32,
    /// `None` when no record of it had timestamps.
    span: Option<(u64, u64)>,
    records: u32,
    /// Records without timestamps (start and end 0).
    incomplete: u32,
}

/// Merges the records of one correlation id (a graph launch's nodes, a batch copy's copies): the first's id,
/// the earliest start and latest end of those with timestamps.
fn merge(records: &[Record]) -> Merged {
    let mut m = Merged {
        correlation: records.first().map_or(0, |r| r.correlation),
        span: None,
        records: 0,
        incomplete: 0,
    };
    for r in records {
        let complete = !(r.start == 0 && r.end == 0) && r.end >= r.start;
        m.records += 1;
        m.incomplete += u32::from(!complete);
        if complete {
            m.span = Some(m.span.map_or((r.start, r.end), |(a, b)| (a.min(r.start), b.max(r.end))));
        }
    }
    m
}

/// What a graph node is called: its kernel's name (CUPTI's), or its copy's direction.
///
/// # Safety
///
/// `record` was read from a buffer CUPTI handed out and is still being read: a kernel's `detail` is then null
/// or CUPTI's NUL-terminated name.
unsafe fn node_name(record: &Record) -> std::borrow::Cow<'static, str> {
    match record.kind {
        ffi::RecordKind::Kernel => {
            let name = std::ptr::with_exposed_provenance::<c_char>(record.detail);
            // SAFETY: the caller's guarantee.
            match unsafe { c_text(name) } {
                Some(name) if !name.is_empty() => name.to_owned().into(),
                _ => "kernel".into(),
            }
        }
        ffi::RecordKind::Memset => "memset".into(),
        // CUpti_ActivityMemcpyKind: 1 HtoD, 2 DtoH, 8 DtoD, 10 PtoP.
        ffi::RecordKind::Memcpy => match record.detail {
            1 => "memcpy HtoD",
            2 => "memcpy DtoH",
            8 => "memcpy DtoD",
            10 => "memcpy peer",
            _ => "memcpy",
        }
        .into(),
    }
}

/// A calibration sample of CUPTI's clock: a probe kernel CUPTI saw start at `start` (its ns) was launched and
/// its store seen by the host inside the reference bracket of `bracket` (the CUDA backend's sample of the same
/// launch). The kernel cannot start before its launch call, and its store, which comes after its start, was seen
/// before the bracket closed: the start lies inside the bracket, whatever the kernel's end (CUPTI's end may
/// come after the host saw the store: the stream retires later). `None` when CUPTI's duration does not fit the
/// bracket (CUPTI's clock and the reference disagree about this probe).
fn cupti_sample(bracket: &CalibrationSample, start: u64, end: u64) -> Option<CalibrationSample> {
    if end.saturating_sub(start) > 2 * bracket.max_deviation_ns {
        return None;
    }
    Some(CalibrationSample {
        source_ticks: start,
        reference_ns: bracket.reference_ns,
        max_deviation_ns: bracket.max_deviation_ns,
    })
}

impl GpuBackend for CuptiGpu {
    type Commands = Infallible;

    fn info(&self) -> GpuDeviceInfo {
        self.shared.info.clone()
    }

    fn write_timestamp(&self, commands: &Infallible, _slot: u32) {
        match *commands {}
    }

    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        let slots = &self.shared.slots;
        let first = first as usize;
        if first + out.len() > slots.len() {
            return Err(GpuError::Invalid {
                detail: format!("slots {first}..{} of {}", first + out.len(), slots.len()),
            });
        }
        self.shared.flush_if_due();
        for (slot, out) in slots[first..].iter().zip(out.iter_mut()) {
            let ticks = slot.load(Ordering::Acquire);
            *out = (ticks != 0).then_some(GpuTicks(ticks));
        }
        Ok(())
    }

    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        // Under the capture's lock: a record's write (which checks who holds the pair under it) comes wholly
        // before or after this, so a late record never fills a recycled pair.
        let _state = lock(&self.shared.state);
        let slots = &self.shared.slots;
        let range = first as usize..first as usize + count as usize;
        let Some(slots) = slots.get(range) else {
            return Err(GpuError::Invalid {
                detail: format!("recycle {count} slots from {first} of {}", slots.len()),
            });
        };
        for slot in slots {
            slot.store(0, Ordering::Release);
        }
        Ok(())
    }

    fn guards_late_writes(&self) -> bool {
        // `Shared::write` checks the pair's state word under the capture's lock, which `recycle` takes.
        true
    }

    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        let shared = &self.shared;
        if shared.subscriber.load(Ordering::Acquire) == 0 {
            return Ok(()); // stopped (or not started): no probe would be seen
        }
        let _ = PROBES.try_with(|p| *p.borrow_mut() = Some(Vec::new()));
        lock(&shared.state).bursts += 1;
        let mut brackets = Vec::new();
        let result = shared.probe.calibrate(samples, budget, &mut brackets);
        let launched = PROBES
            .try_with(|p| p.borrow_mut().take())
            .ok()
            .flatten()
            .unwrap_or_default();
        if let Err(e) = result {
            let mut state = lock(&shared.state);
            for id in &launched {
                state.probes.remove(id);
            }
            return Err(e);
        }
        {
            // Probe launches and the backend's samples are in launch order; a last probe that did not finish
            // within the budget has no sample (its record, if it comes, no bracket).
            let mut state = lock(&shared.state);
            for (id, bracket) in launched.iter().zip(&brackets) {
                if let Some(probe) = state.probes.get_mut(id) {
                    probe.bracket = Some(*bracket);
                }
            }
        }
        // Complete buffers now, so this burst's probe records come back.
        // SAFETY: plain value argument; the buffer callbacks run during the call and catch every panic.
        let _ = unsafe { (shared.cupti.flush_all)(0) };
        let mut state = lock(&shared.state);
        // Samples of this burst's probes and of the last burst's whose records came since (CUPTI hands a buffer
        // out once all its records are complete): in launch order, which is time order, so a late probe of the
        // last burst (launched after all its delivered ones) comes before this burst's. Older ones are dropped:
        // they would come out of order.
        let burst = state.bursts;
        let mut ready: Vec<(u32, CalibrationSample)> = Vec::new();
        state.probes.retain(|&id, probe| {
            if probe.burst + 1 < burst {
                return false;
            }
            match (probe.bracket, probe.span) {
                (Some(bracket), Some((start, end))) => {
                    ready.extend(cupti_sample(&bracket, start, end).map(|s| (id, s)));
                    false
                }
                _ => true,
            }
        });
        ready.sort_unstable_by_key(|&(id, _)| id);
        out.extend(ready.into_iter().map(|(_, s)| s));
        Ok(())
    }
}

/// CUPTI's timestamp source: tickline's reference clock.
unsafe extern "C" fn monotonic() -> u64 {
    crate::clock::monotonic_ns().0
}

/// Bytes before each buffer handed to CUPTI, holding the allocation's size: freeing never relies on the size
/// CUPTI passes back, nor on [`BUFFER_BYTES`] not having changed since.
const BUFFER_HEADER: usize = 8;

/// CUPTI asks for a buffer to fill.
unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    let _ = catch_unwind(|| {
        let bytes = BUFFER_BYTES.load(Ordering::Relaxed).max(8);
        let memory = match std::alloc::Layout::from_size_align(BUFFER_HEADER + bytes, 8) {
            // SAFETY: a non-zero size. Zeroed: the records are read as bytes, padding CUPTI leaves included.
            Ok(layout) => unsafe { std::alloc::alloc_zeroed(layout) },
            Err(_) => std::ptr::null_mut(),
        };
        let handed = if memory.is_null() {
            memory
        } else {
            // SAFETY: the allocation holds BUFFER_HEADER + bytes bytes, 8-aligned: the header is a u64 at its start,
            // and what CUPTI gets starts after it (8-aligned, as CUPTI requires).
            unsafe {
                memory.cast::<u64>().write(bytes as u64);
                memory.add(BUFFER_HEADER)
            }
        };
        if !handed.is_null() {
            lock(&OUR_BUFFERS)
                .get_or_insert_with(HashSet::new)
                .insert(handed as usize);
        }
        // SAFETY: CUPTI passes three writable out-parameters. A null buffer tells CUPTI none is free: it then
        // drops records and counts them.
        unsafe {
            *buffer = handed;
            *size = if handed.is_null() { 0 } else { bytes };
            *max_records = 0;
        }
    });
}

/// CUPTI hands back a buffer: its records are read, then it is freed. A buffer tickline did not hand out
/// (another client's, from before its callbacks were replaced by ours) is left alone.
unsafe extern "C" fn buffer_completed(context: *mut c_void, stream: u32, buffer: *mut u8, size: usize, valid: usize) {
    let ours = lock(&OUR_BUFFERS)
        .as_mut()
        .is_some_and(|set| set.remove(&(buffer as usize)));
    if buffer.is_null() || !ours {
        return;
    }
    // SAFETY: `buffer` is one `buffer_requested` handed out (it was in OUR_BUFFERS): its header, the
    // allocation's size, lies just before it.
    let (memory, bytes) = unsafe {
        let memory = buffer.sub(BUFFER_HEADER);
        (memory, memory.cast::<u64>().read() as usize)
    };
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let active = lock(&ACTIVE).clone();
        if let Some(shared) = active {
            // SAFETY: CUPTI filled `valid` bytes of this buffer (zeroed beyond), which holds `bytes`.
            unsafe { shared.take_buffer(context, stream, buffer, valid.min(size).min(bytes)) };
        }
    }));
    if let Ok(layout) = std::alloc::Layout::from_size_align(BUFFER_HEADER + bytes, 8) {
        // SAFETY: allocated by `buffer_requested` with this layout (its size read from the header), freed once
        // (removed from OUR_BUFFERS above).
        unsafe { std::alloc::dealloc(memory, layout) };
    }
}

/// CUPTI's API callback: it goes to the capture in CALLBACK_TARGET, counted in CALLBACKS_IN_FLIGHT while it
/// runs (see there).
unsafe extern "C" fn on_api(_userdata: *mut c_void, domain: u32, cbid: u32, data: *const c_void) {
    if domain != ffi::DOMAIN_DRIVER || data.is_null() {
        return;
    }
    let Some(api) = apis::lookup(cbid) else {
        return;
    };
    CALLBACKS_IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
    let target = CALLBACK_TARGET.load(Ordering::SeqCst);
    if !target.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: a capture stays alive while it is the target and for as long as a callback counted in
            // CALLBACKS_IN_FLIGHT may use it: `disable` clears the target, then waits for the count to reach 0,
            // before the capture can drop.
            let shared = unsafe { &*target };
            // SAFETY: for the driver domain CUPTI passes a live `CUpti_CallbackData`, laid out as `CallbackData`.
            let data = unsafe { &*(data as *const CallbackData) };
            // Inside the application's driver call: a full lossless ring drops and counts rather than waits.
            crate::recorder::never_waiting(|| shared.on_api(api, data));
        }));
    }
    CALLBACKS_IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
}

#[cfg(test)]
mod tests;
