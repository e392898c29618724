//! The CUDA backend (feature `cuda`): [`CudaGpu`] puts scopes recorded on `cudarc` streams on the timeline.
//!
//! The driver library (`libcuda.so`) is opened at run time (cudarc's `fallback-dynamic-loading` with a fixed
//! CUDA version), so building needs no CUDA toolkit and a machine without a driver gets a [`GpuError`], never a
//! crash: [`open`] checks that the library is there before cudarc would panic on it, and every call into the
//! driver during setup runs under `catch_unwind`, so a driver that lacks a symbol cudarc expects is a
//! [`GpuError::Api`] too.
//!
//! ```no_run
//! use tickline::gpu::cuda::{open, CudaGpu, CudaOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = open(0)?; // GpuError::NoLoader without libcuda.so, NoDevice without a GPU
//! let backend = CudaGpu::new(&ctx, CudaOptions::default())?;
//! println!("%globaltimer updates every {} ns", backend.clock().resolution_ns);
//!
//! let timeline = tickline::Timeline::builder().start()?;
//! let gpu = timeline.gpu(backend)?;
//! let stream = ctx.new_stream()?;
//! let lane = gpu.queue("stream 0")?;
//! {
//!     let _scope = tickline::gpu_scope!(lane, &stream, "upload"); // &Arc<CudaStream> derefs to &CudaStream
//!     // ... copies and kernel launches on `stream` ...
//! }
//! stream.synchronize()?;
//! # Ok(())
//! # }
//! ```
//!
//! # Design
//!
//! - **Timestamps: a one-thread kernel.** A scope's begin and end each launch `tickline_stamp`, a one-thread
//!   PTX kernel that reads `%globaltimer` (nanoseconds, 64 bits) and stores it into the scope's slot. Launches
//!   on one stream run in order, so the begin is read once the work launched before the scope has finished and
//!   the end once the scope's own work has. The PTX text is loaded by the driver (`cuModuleLoadData`): no NVRTC
//!   at run time. The alternative, CUDA events anchored to a calibrated reference, gives relative times in f32
//!   milliseconds (about 0.5 µs); it is implemented too ([`CudaTiming::Events`], below) so the two can be
//!   compared on a GPU (the crate's issue 6). [`CudaTiming::Auto`] (the default) takes the kernel and falls back
//!   to events only where the kernel cannot be used.
//! - **Slots in mapped pinned host memory.** The slots are `cuMemHostAlloc(DEVICEMAP)` memory that the kernel
//!   writes through its device alias, so reading finished timestamps is a volatile load on the host: no copy, no
//!   stream, no synchronisation with the application's streams. A slot holding 0 is unwritten (`%globaltimer`
//!   counts ns since an epoch long past: it is never 0 when read); [`GpuBackend::recycle`] stores 0 again.
//! - **Calibration.** Each sample zeroes a private word, reads `CLOCK_MONOTONIC`, launches `tickline_stamp` on
//!   a private non-blocking stream, spins until the word turns non-zero and reads `CLOCK_MONOTONIC` again. The
//!   timer was read inside that bracket, and the sample's deviation is half of it, launch and PCIe latency
//!   included. The measured resolution goes into the device's [`ClockDomain`] (see
//!   [`ClockDomain::with_resolution_ns`]): a value of a timer that changes every `r` ns stands for an interval
//!   `r` wide, so the calibration widens every bracket by `r / 2` on *both* sides and adds `r / 2` to every
//!   conversion's uncertainty. (Widening only the bracket's start by `r`, as this backend once did, places every
//!   event early by `r / 2`: the fit then maps a value to the moment the timer reached it, while a timestamp
//!   lies anywhere up to `r` after that moment.) A burst stops at its budget; a probe still in flight then (the GPU is
//!   full) is waited for by the next burst, which returns no sample until the private stream is idle.
//! - **Batched reads.** [`CudaGpu::read_clock_batch`] takes N consecutive `%globaltimer` reads from one launch
//!   (one thread, one store per read). Calibration does *not* use it: every sample needs a bracket of its own,
//!   and N reads from one launch share one bracket.
//! - **Resolution, measured.** [`CudaGpu::new`] launches `tickline_steps`, which spins on `%globaltimer` and
//!   records the first values it sees change; the smallest step is the timer's update granularity
//!   ([`CudaClock::resolution_ns`]): 32 ns on Hopper (measured on an H200), 1 µs before it (32 ns while NVIDIA's tools run). A
//!   timer that does not advance at all is not used (events instead, or [`GpuError::NoTimestamps`] with
//!   [`CudaTiming::GlobalTimer`]).
//! - **Clock frequency.** `%globaltimer` is nominally 1 GHz (1 ns per tick; [`GpuDeviceInfo::clock`]); the SM
//!   clock the driver reports (`CU_DEVICE_ATTRIBUTE_CLOCK_RATE`) is [`CudaClock::sm_clock_khz`], for reference.
//! - **Event fallback.** Where the kernel cannot be used (compute capability below 5.0, the PTX target; the
//!   module does not load; `%globaltimer` does not advance), [`CudaTiming::Auto`] records a CUDA event per
//!   timestamp instead ([`CudaGpu::timing`] says which and why). Events are relative: each slot reads as the
//!   `cuEventElapsedTime` since an anchor event of known tick value, and every calibration sample (an event on
//!   the private stream, bracketed like the kernel's) becomes the next anchor, so the f32 milliseconds span at
//!   most a burst period. Their resolution is the documented 0.5 µs ([`CudaClock::resolution_ns`]); batched
//!   reads need the kernel.
//!
//! # Limits
//!
//! - Run on one GPU so far (an H200, 2026-11-28; figures in the README): the PTX, the mapped-memory reads, both
//!   timings and 20,400 scopes placed inside their `[launch, synchronize]` windows; the fix to calibration bursts
//!   that ended after one or two samples ([`CudaGpu`]'s `private_idle`) took the stated uncertainty from p50/p99
//!   5.9/20.2 µs to 4.8/5.5 µs there.
//! - A probe's bracket is lopsided: on an idle H200 the kernel starts some 27 µs after the launch call and its
//!   store is seen about 0.4 µs after it ran, so the read sits near the bracket's end, and the stated uncertainty
//!   is a few µs (p50 4.8 µs there). On a real GPU the truth is known only up to each scope's window, and every
//!   slice lay inside its window.
//! - The PTX is `.version 7.0`, `.target sm_50`: a CUDA 11.0 or newer driver.
//! - `write_timestamp` costs one `cuLaunchKernel` (or one `cuEventRecord`) and one entry in the stream; the
//!   CPU cost is to be measured on a GPU machine (`benches/cuda_scope.rs`).
//! - A launch that fails on the hot path is counted ([`CudaGpu::failed_writes`]); its slot is never written,
//!   and the collector treats the scope as it treats any timestamp that never arrives.
//! - Streams given to scopes must belong to the context the backend was made with. `type Commands` is
//!   [`CudaStream`]; an `&Arc<CudaStream>` (what cudarc hands out) derefs to it in [`gpu_scope!`](crate::gpu_scope).
//! - A scope recorded while its stream is being captured into a CUDA graph puts its timestamp kernels into the
//!   graph: they write the same pair at every replay. Record scopes outside stream capture.
//! - The backend never calls cudarc's `bind_to_thread`, `attribute` or `name`: those take and clear the error
//!   cudarc stores for the application (`check_err`); the backend uses the raw driver calls instead.
//! - Dropping the backend synchronises the whole context (`cuCtxSynchronize`): a timestamp kernel or event still
//!   queued on an application stream must not write into freed memory or outlive its event. Drop it after the
//!   timeline is shut down.

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use cudarc;
use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};

use crate::calibration::{CalibrationSample, ClockDomain};
use crate::clock::monotonic_ns;
use crate::gpu::{GpuBackend, GpuDeviceInfo, GpuError, GpuTicks};

/// The backend's kernels. `tickline_stamp(dst)`: one `%globaltimer` read stored to `dst`.
/// `tickline_stamps(dst, n)`: `n` consecutive reads stored to `dst[0..n]`. `tickline_steps(dst, n, max_spins)`:
/// spins on `%globaltimer` (at most `max_spins` reads) and stores each of the first `n` values that differ from
/// the previous read. Stores are `volatile` so each one reaches memory (the host polls it).
/// `.version 7.0` is CUDA 11.0's PTX ISA; `%globaltimer` needs sm_30 and ISA 3.1 (PTX ISA manual, "Special
/// Registers"); sm_50 is the oldest target CUDA 12 still compiles.
pub(crate) const PTX: &str = r#"
.version 7.0
.target sm_50
.address_size 64

.visible .entry tickline_stamp(.param .u64 dst)
{
    .reg .b64 %rd<3>;
    ld.param.u64 %rd1, [dst];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u64 %rd2, %globaltimer;
    st.volatile.global.u64 [%rd1], %rd2;
    ret;
}

.visible .entry tickline_stamps(.param .u64 dst, .param .u32 n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<3>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [dst];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u32 %r1, [n];
    mov.u32 %r2, 0;
STAMPS_LOOP:
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra STAMPS_DONE;
    mov.u64 %rd2, %globaltimer;
    mul.wide.u32 %rd3, %r2, 8;
    add.s64 %rd4, %rd1, %rd3;
    st.volatile.global.u64 [%rd4], %rd2;
    add.u32 %r2, %r2, 1;
    bra STAMPS_LOOP;
STAMPS_DONE:
    ret;
}

.visible .entry tickline_steps(.param .u64 dst, .param .u32 n, .param .u32 max_spins)
{
    .reg .pred %p<3>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [dst];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u32 %r1, [n];
    ld.param.u32 %r2, [max_spins];
    mov.u32 %r3, 0;
    mov.u32 %r4, 0;
    mov.u64 %rd2, %globaltimer;
STEPS_LOOP:
    setp.ge.u32 %p1, %r3, %r1;
    @%p1 bra STEPS_DONE;
    setp.ge.u32 %p2, %r4, %r2;
    @%p2 bra STEPS_DONE;
    add.u32 %r4, %r4, 1;
    mov.u64 %rd3, %globaltimer;
    setp.eq.u64 %p1, %rd3, %rd2;
    @%p1 bra STEPS_LOOP;
    mov.u64 %rd2, %rd3;
    mul.wide.u32 %rd4, %r3, 8;
    add.s64 %rd5, %rd1, %rd4;
    st.volatile.global.u64 [%rd5], %rd3;
    add.u32 %r3, %r3, 1;
    bra STEPS_LOOP;
STEPS_DONE:
    ret;
}
"#;

/// Most timestamp slots one backend takes (8 MiB of pinned host memory).
const MAX_SLOTS: u32 = 1 << 20;
/// Words after the slots for calibration, batched reads and the resolution probe.
const BATCH_WORDS: u32 = 4096;
/// Timer steps the resolution probe records.
const RESOLUTION_STEPS: u32 = 64;
/// Reads the resolution probe spins at most: 1 µs steps over 64 steps is 64 µs, far below 2^24 reads of a few
/// ns each (about 0.1 s at most on any GPU).
const RESOLUTION_SPINS: u32 = 1 << 24;
/// How long past its budget a calibration burst spins for a probe it launched.
const PROBE_GRACE: Duration = Duration::from_micros(500);

/// Event timing's resolution: "around 0.5 microseconds" (CUDA Driver API, `cuEventElapsedTime`). Documented,
/// not measured.
const EVENT_RESOLUTION_NS: u64 = 500;
/// The event clock's tick value at the first anchor (ticks are ns after it, offset so they are never 0 and an
/// event recorded just before a later anchor still maps above 0).
const EVENT_ORIGIN: u64 = 1 << 40;

/// How [`CudaGpu`] timestamps scopes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudaTiming {
    /// `%globaltimer` when it works on the device, else CUDA events ([`CudaGpu::timing`] says which, and why).
    #[default]
    Auto,
    /// The one-thread `%globaltimer` kernel, or an error.
    GlobalTimer,
    /// CUDA events: `cuEventRecord` per timestamp, read back as `cuEventElapsedTime` from an anchor event that
    /// each calibration sample moves forward. About 0.5 µs resolution; no kernel, no PTX.
    Events,
}

/// What the application asks of [`CudaGpu::new`].
///
/// ```
/// use tickline::gpu::cuda::{CudaOptions, CudaTiming};
/// let options = CudaOptions::default();
/// assert_eq!((options.timestamp_slots, options.timing), (4096, CudaTiming::Auto));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Timestamp slots (even, 2..=1 Mi): each scope in flight holds two. 8 bytes of pinned host memory each
    /// (and one CUDA event each with [`CudaTiming::Events`]).
    pub timestamp_slots: u32,
    /// `%globaltimer` kernel or CUDA events.
    pub timing: CudaTiming,
}

impl Default for CudaOptions {
    /// 4096 slots (2048 scopes in flight, 32 KiB), [`CudaTiming::Auto`].
    fn default() -> Self {
        CudaOptions {
            timestamp_slots: 4096,
            timing: CudaTiming::Auto,
        }
    }
}

/// Which timing a [`CudaGpu`] uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaTimingInUse {
    /// The `%globaltimer` kernel.
    GlobalTimer,
    /// CUDA events.
    Events {
        /// Why not `%globaltimer`: asked for, or what went wrong with it under [`CudaTiming::Auto`].
        reason: String,
    },
}

/// The device clock as [`CudaGpu::new`] found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaClock {
    /// The update granularity of `%globaltimer`, measured on the device: the smallest step seen between two
    /// differing reads (an upper bound if the probe kernel's loop is slower than the timer). With CUDA events:
    /// their documented 500 ns.
    pub resolution_ns: u64,
    /// The SM clock the driver reports (`CU_DEVICE_ATTRIBUTE_CLOCK_RATE`), in kHz. `%globaltimer` does not run
    /// on it: its nominal rate is 1 GHz (1 ns per tick).
    pub sm_clock_khz: u32,
    /// `%globaltimer`'s nominal frequency: 1 GHz.
    pub timer_hz: u64,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
}

fn api(call: &'static str) -> impl Fn(DriverError) -> GpuError {
    move |e| GpuError::Api {
        call,
        detail: describe(&e),
    }
}

fn describe(e: &DriverError) -> String {
    // `error_string` calls into the driver library, which cudarc panics on when it is missing (a test builds
    // errors without one).
    match catch_unwind(|| e.error_string().map(|s| s.to_string_lossy().into_owned())) {
        Ok(Ok(s)) => format!("{:?}: {s}", e.0),
        _ => format!("{:?}", e.0),
    }
}

fn invalid(detail: String) -> GpuError {
    GpuError::Invalid { detail }
}

/// The message of a caught panic.
fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic".to_owned()
    }
}

/// Runs `f`, turning a panic inside cudarc (a driver symbol it cannot resolve) into a [`GpuError::Api`].
fn contain<T>(what: &'static str, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        Err(GpuError::Api {
            call: what,
            detail: format!(
                "cudarc panicked (the driver lacks an entry point it expects?): {}",
                panic_text(&*payload)
            ),
        })
    })
}

/// Whether the CUDA driver library (`libcuda.so`, `nvcuda.dll`) can be opened: [`GpuError::NoLoader`] if not.
/// Call it before anything in `cudarc::driver`, which panics without the library.
///
/// ```
/// match tickline::gpu::cuda::driver_library() {
///     Ok(()) => println!("a CUDA driver is installed"),
///     Err(e) => println!("{e}"), // GpuError::NoLoader
/// }
/// ```
pub fn driver_library() -> Result<(), GpuError> {
    // SAFETY: `is_culib_present` opens the system's CUDA driver library by its standard names and closes it,
    // running its initialisers, which is how the driver is meant to be loaded; no invariant of ours is involved.
    let present = contain("dlopen(libcuda)", || Ok(unsafe { sys::is_culib_present() }))?;
    if present {
        Ok(())
    } else {
        Err(GpuError::NoLoader {
            detail: "the CUDA driver library (libcuda.so) could not be opened: no NVIDIA driver installed".into(),
        })
    }
}

/// Maps a driver error from device lookup to [`GpuError::NoDevice`] where it means "no such device".
fn device_error(call: &'static str, ordinal: usize, e: DriverError) -> GpuError {
    use sys::cudaError_enum as E;
    match e.0 {
        E::CUDA_ERROR_NO_DEVICE | E::CUDA_ERROR_INVALID_DEVICE => GpuError::NoDevice {
            detail: format!("CUDA device {ordinal}: {}", describe(&e)),
        },
        _ => api(call)(e),
    }
}

/// The primary context of CUDA device `ordinal`, or a typed error: [`GpuError::NoLoader`] without a driver
/// library, [`GpuError::NoDevice`] without such a device, never a panic.
///
/// ```
/// match tickline::gpu::cuda::open(0) {
///     Ok(ctx) => println!("CUDA device 0: {:?}", ctx.name()),
///     Err(e) => println!("{e}"),
/// }
/// ```
pub fn open(ordinal: usize) -> Result<Arc<CudaContext>, GpuError> {
    driver_library()?;
    contain("cuInit/cuDeviceGetCount", || {
        result::init().map_err(|e| device_error("cuInit", ordinal, e))?;
        let count = result::device::get_count().map_err(|e| device_error("cuDeviceGetCount", ordinal, e))?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::NoDevice {
                detail: format!("CUDA device {ordinal} asked for, the driver sees {count}"),
            });
        }
        CudaContext::new(ordinal).map_err(|e| device_error("cuDevicePrimaryCtxRetain", ordinal, e))
    })
}

/// Makes `ctx` current on this thread. Unlike `CudaContext::bind_to_thread` it leaves the error cudarc stores
/// for the application alone (`check_err` there takes and clears it, so the application would never see it).
fn bind(ctx: &CudaContext) -> Result<(), DriverError> {
    let want = ctx.cu_ctx();
    if result::ctx::get_current()? != Some(want) {
        // SAFETY: `want` is the live context `ctx` holds (retained until the last Arc of it drops).
        unsafe { result::ctx::set_current(want) }?;
    }
    Ok(())
}

/// A device attribute, read without touching cudarc's stored error (see [`bind`]).
fn attribute(ctx: &CudaContext, attribute: sys::CUdevice_attribute) -> Result<i32, GpuError> {
    // SAFETY: `cu_device` is the device `ctx` was made on; the call only reads an attribute.
    unsafe { result::device::get_attribute(ctx.cu_device(), attribute) }.map_err(api("cuDeviceGetAttribute"))
}

fn check_options(options: &CudaOptions) -> Result<(), GpuError> {
    let slots = options.timestamp_slots;
    if slots < 2 || slots % 2 != 0 || slots > MAX_SLOTS {
        return Err(invalid(format!(
            "timestamp_slots must be even and in 2..={MAX_SLOTS}, not {slots}"
        )));
    }
    Ok(())
}

/// The smallest step between consecutive non-zero values, or `None` with fewer than two (the timer did not move).
fn min_step(values: &[u64]) -> Option<u64> {
    let seen: Vec<u64> = values.iter().copied().take_while(|&v| v != 0).collect();
    seen.windows(2)
        .filter_map(|w| w[1].checked_sub(w[0]))
        .filter(|&d| d > 0)
        .min()
}

/// Reads slots `first..first + out.len()` of `slots` through `load`: 0 is unwritten.
fn read_slots(slots: u32, first: u32, out: &mut [Option<GpuTicks>], load: impl Fn(u32) -> u64) -> Result<(), GpuError> {
    let end = u64::from(first) + out.len() as u64;
    if end > u64::from(slots) {
        return Err(invalid(format!("slots {first}..{end} past {slots}")));
    }
    for (i, value) in out.iter_mut().enumerate() {
        let ticks = load(first + i as u32);
        *value = (ticks != 0).then_some(GpuTicks(ticks));
    }
    Ok(())
}

/// Marks slots `first..first + count` of `slots` unwritten through `clear`.
fn clear_slots(slots: u32, first: u32, count: u32, clear: impl Fn(u32)) -> Result<(), GpuError> {
    let end = u64::from(first) + u64::from(count);
    if end > u64::from(slots) {
        return Err(invalid(format!("slots {first}..{end} past {slots}")));
    }
    (first..first + count).for_each(clear);
    Ok(())
}

/// Loads the `%globaltimer` kernels into `owned.module` and measures the timer's resolution.
fn load_timer(owned: &mut Owned, slots: u32, name: &str) -> Result<(Stamps, u64), GpuError> {
    let ptx = std::ffi::CString::new(PTX).map_err(|_| invalid("PTX text holds a NUL".into()))?;
    // SAFETY: `ptx` is a NUL-terminated PTX text that outlives the call; the caller bound the context.
    owned.module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }.map_err(api("cuModuleLoadData"))?;
    let module = owned.module;
    let function = |name: &CStr| {
        // SAFETY: the module was just loaded in the bound context and is unloaded only when `owned` drops,
        // after every use of its functions.
        unsafe { result::module::get_function(module, name.to_owned()) }.map_err(api("cuModuleGetFunction"))
    };
    let stamp = function(c"tickline_stamp")?;
    let stamps = function(c"tickline_stamps")?;
    let steps = function(c"tickline_steps")?;

    // The resolution probe: the first RESOLUTION_STEPS changes of the timer, into the batch words.
    let base = owned.device + u64::from(slots) * 8;
    let mut dst = base;
    let mut n = RESOLUTION_STEPS;
    let mut spins = RESOLUTION_SPINS;
    let mut params = [
        (&mut dst as *mut sys::CUdeviceptr).cast::<c_void>(),
        (&mut n as *mut u32).cast::<c_void>(),
        (&mut spins as *mut u32).cast::<c_void>(),
    ];
    // SAFETY: `steps` takes (u64 pointer, u32, u32), as `params` holds; `dst` points to BATCH_WORDS mapped
    // words, at least RESOLUTION_STEPS; the private stream belongs to the bound context; `params` outlives
    // the call (the driver copies the arguments at launch).
    unsafe { result::launch_kernel(steps, (1, 1, 1), (1, 1, 1), 0, owned.private, &mut params) }
        .map_err(api("cuLaunchKernel"))?;
    // SAFETY: our stream, alive until `owned` drops.
    unsafe { result::stream::synchronize(owned.private) }.map_err(api("cuStreamSynchronize"))?;
    let values: Vec<u64> = (0..RESOLUTION_STEPS).map(|i| owned.load(slots + i)).collect();
    let Some(resolution_ns) = min_step(&values) else {
        return Err(GpuError::NoTimestamps {
            detail: format!("%globaltimer on {name} did not advance over {RESOLUTION_SPINS} reads"),
        });
    };
    for i in 0..RESOLUTION_STEPS {
        owned.store(slots + i, 0);
    }
    Ok((Stamps::Timer { stamp, stamps }, resolution_ns))
}

/// How scopes' timestamps are taken.
enum Stamps {
    /// The `%globaltimer` kernels of our module.
    Timer {
        stamp: sys::CUfunction,
        stamps: sys::CUfunction,
    },
    Events(EventStamps),
}

/// CUDA-event timestamps: one event per slot, read as the time elapsed since an anchor event whose tick value
/// is known. Each calibration sample records a probe event on the private stream, and once the probe has
/// completed it becomes the new anchor (its ticks: the old anchor's plus the elapsed time), so the f32
/// milliseconds `cuEventElapsedTime` returns span at most a burst period (f32 has a 24-bit mantissa: 100 ms is
/// resolved to about 6 ns, 100 s would be to 6 µs).
struct EventStamps {
    ctx: Arc<CudaContext>,
    events: Vec<sys::CUevent>,
    /// Whether slot `i`'s event was recorded since its last recycle (`cuEventQuery` of an event never recorded
    /// says complete).
    recorded: Vec<AtomicBool>,
    clock: Mutex<EventClock>,
}

struct EventClock {
    anchor: sys::CUevent,
    anchor_ticks: u64,
    probe: sys::CUevent,
    /// The probe was recorded and not seen complete (a burst ran out of budget).
    probe_pending: bool,
}

/// `anchor_ticks` plus `elapsed_ms` in ns, rounded; never 0. `cuEventElapsedTime` is negative for an event
/// that completed before the anchor.
fn event_ticks(anchor_ticks: u64, elapsed_ms: f32) -> u64 {
    let ns = anchor_ticks as f64 + f64::from(elapsed_ms) * 1e6;
    ns.round().max(1.0) as u64
}

impl EventStamps {
    fn new(ctx: &Arc<CudaContext>, slots: u32, private: sys::CUstream) -> Result<EventStamps, GpuError> {
        let mut stamps = EventStamps {
            ctx: ctx.clone(),
            events: Vec::with_capacity(slots as usize),
            recorded: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            clock: Mutex::new(EventClock {
                anchor: std::ptr::null_mut(),
                anchor_ticks: EVENT_ORIGIN,
                probe: std::ptr::null_mut(),
                probe_pending: false,
            }),
        };
        let create = || result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(api("cuEventCreate"));
        for _ in 0..slots {
            stamps.events.push(create()?);
        }
        let clock = stamps.clock.get_mut().unwrap_or_else(|e| e.into_inner());
        clock.anchor = create()?;
        clock.probe = create()?;
        // SAFETY: the anchor event and the private stream were created in the bound context and are alive.
        unsafe { result::event::record(clock.anchor, private) }.map_err(api("cuEventRecord"))?;
        // SAFETY: as above.
        unsafe { result::event::synchronize(clock.anchor) }.map_err(api("cuEventSynchronize"))?;
        Ok(stamps)
    }

    /// Records slot `slot`'s event on `stream` (the hot path).
    fn record(&self, slot: u32, stream: sys::CUstream) -> Result<(), DriverError> {
        // SAFETY: the event is ours (alive until `self` drops), created in the context the caller bound; the
        // stream is the application's, of the same context (the backend's contract).
        unsafe { result::event::record(self.events[slot as usize], stream) }?;
        // Release: the record above happens before the collector's query; pairs with Acquire in `read`.
        self.recorded[slot as usize].store(true, Ordering::Release);
        Ok(())
    }

    fn clear(&self, slot: u32) {
        // Relaxed: the pair goes back to the scopes through the timeline's free-pair queue, which orders this
        // store before the next `record` of the slot.
        self.recorded[slot as usize].store(false, Ordering::Relaxed);
    }

    /// Slots `first..first + out.len()` (range checked by the caller), the context bound.
    fn read(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        let clock = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        for (i, value) in out.iter_mut().enumerate() {
            let slot = first as usize + i;
            *value = None;
            // Acquire: pairs with the Release in `record`.
            if !self.recorded[slot].load(Ordering::Acquire) {
                continue;
            }
            let event = self.events[slot];
            // SAFETY: our event, alive until `self` drops.
            match unsafe { sys::cuEventQuery(event) } {
                sys::cudaError_enum::CUDA_SUCCESS => {}
                sys::cudaError_enum::CUDA_ERROR_NOT_READY => continue,
                e => return Err(api("cuEventQuery")(DriverError(e))),
            }
            // SAFETY: both events are ours, alive, recorded and complete (the anchor since `new` or the burst
            // that made it the anchor; the slot's just queried).
            let ms = unsafe { result::event::elapsed(clock.anchor, event) }.map_err(api("cuEventElapsedTime"))?;
            *value = Some(GpuTicks(event_ticks(clock.anchor_ticks, ms)));
        }
        Ok(())
    }

    /// A burst of event samples on the private stream, the context bound.
    fn calibrate(
        &self,
        private: sys::CUstream,
        samples: usize,
        budget: Duration,
        out: &mut Vec<CalibrationSample>,
    ) -> Result<(), GpuError> {
        let started = Instant::now();
        let mut clock = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        let query = |event| {
            // SAFETY: our event, alive until `self` drops.
            match unsafe { sys::cuEventQuery(event) } {
                sys::cudaError_enum::CUDA_SUCCESS => Ok(true),
                sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
                e => Err(api("cuEventQuery")(DriverError(e))),
            }
        };
        if clock.probe_pending {
            if !query(clock.probe)? {
                return Ok(()); // still queued behind the GPU's work: no sample this time
            }
            clock.probe_pending = false;
        }
        for _ in 0..samples {
            if started.elapsed() >= budget {
                break;
            }
            let before_ns = monotonic_ns().0;
            // SAFETY: our probe event (not pending: checked above or completed below) and our private stream.
            unsafe { result::event::record(clock.probe, private) }.map_err(api("cuEventRecord"))?;
            let done = loop {
                if query(clock.probe)? {
                    break true;
                }
                if started.elapsed() >= budget + PROBE_GRACE {
                    break false;
                }
                std::hint::spin_loop();
            };
            let after_ns = monotonic_ns().0;
            if !done {
                clock.probe_pending = true;
                break;
            }
            // SAFETY: both events are ours, alive, recorded and complete.
            let ms = unsafe { result::event::elapsed(clock.anchor, clock.probe) }.map_err(api("cuEventElapsedTime"))?;
            let ticks = event_ticks(clock.anchor_ticks, ms);
            // The event's 0.5 µs resolution is in the domain: the history widens the bracket by half of it on
            // both sides.
            out.push(CalibrationSample::from_bracket(ticks, before_ns, after_ns));
            // The probe becomes the anchor; the old anchor is the next probe.
            let EventClock { anchor, probe, .. } = &mut *clock;
            std::mem::swap(anchor, probe);
            clock.anchor_ticks = ticks;
        }
        Ok(())
    }
}

impl Drop for EventStamps {
    fn drop(&mut self) {
        let _ = contain("cleanup", || {
            let _ = bind(&self.ctx);
            // An event still pending on an application stream must not be destroyed under it.
            let _ = result::ctx::synchronize();
            let clock = self.clock.get_mut().unwrap_or_else(|e| e.into_inner());
            for event in self.events.iter().copied().chain([clock.anchor, clock.probe]) {
                if !event.is_null() {
                    // SAFETY: our event, created in `self.ctx` (alive: we hold an Arc), complete after the
                    // synchronisation above, destroyed once.
                    let _ = unsafe { result::event::destroy(event) };
                }
            }
            Ok(())
        });
    }
}

/// Driver objects the backend created; released on drop (also when `new` fails half-way).
struct Owned {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    /// Our non-blocking stream for calibration, batched reads and the resolution probe.
    private: sys::CUstream,
    /// Pinned, mapped host memory: `slots` timestamp slots, then `BATCH_WORDS` words.
    host: *mut u64,
    /// The device alias of `host`.
    device: sys::CUdeviceptr,
    /// Words at `host`: the slots, then `BATCH_WORDS`; 0 until allocated.
    words: u32,
}

impl Owned {
    /// Word `index` of the mapped memory (a slot, or a word after them).
    fn load(&self, index: u32) -> u64 {
        assert!(index < self.words);
        // SAFETY: `host` holds `words` aligned u64s (allocated in `setup` before `words` is set, freed only when
        // `self` drops); the device writes whole aligned words, so a volatile load sees the old or the new value.
        unsafe { self.host.add(index as usize).read_volatile() }
    }

    fn store(&self, index: u32, value: u64) {
        assert!(index < self.words);
        // SAFETY: as in `load`; no kernel of ours writes this word now (a slot is recycled only once read, and
        // the words after the slots are stored to only while the private stream is idle).
        unsafe { self.host.add(index as usize).write_volatile(value) }
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = contain("cleanup", || {
            let _ = bind(&self.ctx);
            // Kernels of ours may still be queued on application streams and write into `host`: wait for every
            // stream of the context before freeing it.
            let _ = result::ctx::synchronize();
            // SAFETY: each handle was created by `CudaGpu::new` in `self.ctx`, which is alive (we hold an Arc)
            // and bound; nothing of ours is pending after the synchronisation above. Null handles are skipped.
            unsafe {
                if !self.private.is_null() {
                    let _ = result::stream::destroy(self.private);
                }
                if !self.host.is_null() {
                    let _ = result::free_host(self.host.cast());
                }
                if !self.module.is_null() {
                    let _ = result::module::unload(self.module);
                }
            }
            Ok(())
        });
    }
}

/// The CUDA [`GpuBackend`]: `%globaltimer` written by a one-thread kernel on the application's streams, read
/// back from mapped host memory without blocking, the device clock calibrated against `CLOCK_MONOTONIC`. See
/// the [module docs](self).
pub struct CudaGpu {
    /// Declared before `owned`: dropped first, while the context is surely alive.
    stamps: Stamps,
    owned: Owned,
    timing: CudaTimingInUse,
    slots: u32,
    info: GpuDeviceInfo,
    clock: CudaClock,
    failed_writes: AtomicU64,
    /// Serialises use of the private stream and the words after the slots.
    private_lock: Mutex<()>,
}

// SAFETY: the raw handles (module, functions, stream, events) are driver objects usable from any thread once
// their context is bound, which every method does first (events are recorded by one scope at a time per slot,
// handed out by the timeline's pair queue; the anchor and probe are used under `EventStamps::clock`); the host memory behind `owned.host` is only accessed with
// volatile loads and stores of whole aligned u64 words (slots: one writer at a time, handed out by the
// timeline's pair queue; the words after them: under `private_lock`).
unsafe impl Send for CudaGpu {}
// SAFETY: as for `Send`: no method hands out references into the host memory, and the private stream and its
// words are used under `private_lock`.
unsafe impl Sync for CudaGpu {}

impl fmt::Debug for CudaGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaGpu")
            .field("name", &self.info.name)
            .field("slots", &self.slots)
            .field("clock", &self.clock)
            .finish()
    }
}

impl CudaGpu {
    /// Sets the backend up in `ctx` (the context the application's streams belong to): maps the timestamp slots,
    /// creates a private stream, loads the PTX kernels and measures the timer's resolution (a blocking launch of
    /// well under a second), or, with [`CudaTiming::Events`] or where the kernels cannot be used under
    /// [`CudaTiming::Auto`], creates one CUDA event per slot and an anchor.
    ///
    /// Errors: [`GpuError::Invalid`] for bad options; [`GpuError::NoTimestamps`] for a device that cannot map
    /// host memory, and with [`CudaTiming::GlobalTimer`] for one below compute capability 5.0 or whose
    /// `%globaltimer` does not advance; [`GpuError::Api`] for a failing call or a driver entry point cudarc
    /// cannot find.
    pub fn new(ctx: &Arc<CudaContext>, options: CudaOptions) -> Result<CudaGpu, GpuError> {
        check_options(&options)?;
        contain("CudaGpu::new", || Self::setup(ctx, &options))
    }

    fn setup(ctx: &Arc<CudaContext>, options: &CudaOptions) -> Result<CudaGpu, GpuError> {
        bind(ctx).map_err(api("cuCtxSetCurrent"))?;
        use sys::CUdevice_attribute as A;
        let name = result::device::get_name(ctx.cu_device()).map_err(api("cuDeviceGetName"))?;
        let compute_capability = (
            attribute(ctx, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attribute(ctx, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let can_map = attribute(ctx, A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)?;
        if can_map == 0 {
            return Err(GpuError::NoTimestamps {
                detail: format!("{name} cannot map host memory (CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY is 0)"),
            });
        }
        let sm_clock_khz = attribute(ctx, A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?.max(0) as u32;

        let mut owned = Owned {
            ctx: ctx.clone(),
            module: std::ptr::null_mut(),
            private: std::ptr::null_mut(),
            host: std::ptr::null_mut(),
            device: 0,
            words: 0,
        };
        let words = (options.timestamp_slots + BATCH_WORDS) as usize;
        let bytes = words * std::mem::size_of::<u64>();
        // SAFETY: the context is bound; the memory is zeroed below before any read.
        let host =
            unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) }.map_err(api("cuMemHostAlloc"))?;
        owned.host = host.cast();
        debug_assert!(owned.host.is_aligned());
        // SAFETY: `host` points to `bytes` bytes just allocated, page-aligned.
        unsafe { std::ptr::write_bytes(owned.host, 0, words) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP in the bound context; `device` is a valid out pointer.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }
            .result()
            .map_err(api("cuMemHostGetDevicePointer"))?;
        owned.device = device;
        owned.words = words as u32;
        owned.private =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(api("cuStreamCreate"))?;

        let timer = match options.timing {
            CudaTiming::Events => Err(GpuError::Invalid {
                detail: "CudaTiming::Events asked for".into(),
            }),
            _ if compute_capability.0 < 5 => Err(GpuError::NoTimestamps {
                detail: format!(
                    "{name} has compute capability {}.{}; the %globaltimer kernels target sm_50",
                    compute_capability.0, compute_capability.1
                ),
            }),
            _ => load_timer(&mut owned, options.timestamp_slots, &name),
        };
        let (stamps, timing, resolution_ns) = match (timer, options.timing) {
            (Ok((stamps, resolution_ns)), _) => (stamps, CudaTimingInUse::GlobalTimer, resolution_ns),
            (Err(e), CudaTiming::GlobalTimer) => return Err(e),
            (Err(e), _) => (
                Stamps::Events(EventStamps::new(ctx, options.timestamp_slots, owned.private)?),
                CudaTimingInUse::Events {
                    reason: match e {
                        GpuError::Invalid { detail } => detail,
                        e => e.to_string(),
                    },
                },
                EVENT_RESOLUTION_NS,
            ),
        };

        Ok(CudaGpu {
            stamps,
            owned,
            timing,
            slots: options.timestamp_slots,
            info: GpuDeviceInfo {
                name: name.clone(),
                api: "CUDA",
                // %globaltimer: 64 valid bits, 1 ns per tick (PTX ISA manual, "Special Registers"), changing every
                // `resolution_ns` (measured; events: documented); event ticks are ns after the first anchor,
                // plus EVENT_ORIGIN.
                clock: ClockDomain::new(64, 1.0)
                    .and_then(|d| d.with_resolution_ns(resolution_ns.max(1) as f64))
                    .expect("64 bits, 1 ns and a positive resolution are a valid domain"),
                timestamp_slots: options.timestamp_slots,
            },
            clock: CudaClock {
                resolution_ns,
                sm_clock_khz,
                timer_hz: 1_000_000_000,
                compute_capability,
            },
            failed_writes: AtomicU64::new(0),
            private_lock: Mutex::new(()),
        })
    }

    /// The device clock: measured `%globaltimer` resolution, SM clock, compute capability.
    pub fn clock(&self) -> CudaClock {
        self.clock
    }

    /// The context the backend lives in (scopes' streams must belong to it).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.owned.ctx
    }

    /// Which timing the backend uses (`%globaltimer` or CUDA events, and why).
    pub fn timing(&self) -> &CudaTimingInUse {
        &self.timing
    }

    /// Timestamp launches that failed on the hot path (their scopes never complete).
    pub fn failed_writes(&self) -> u64 {
        self.failed_writes.load(Ordering::Relaxed)
    }

    /// `count` (1..=4096) consecutive `%globaltimer` reads from one launch on the backend's private stream,
    /// in ns. Blocks until the kernel has run. All reads lie within a few µs of each other.
    pub fn read_clock_batch(&self, count: usize) -> Result<Vec<GpuTicks>, GpuError> {
        if count == 0 || count > BATCH_WORDS as usize {
            return Err(invalid(format!("a batch holds 1..={BATCH_WORDS} reads, not {count}")));
        }
        let Stamps::Timer { stamps, .. } = self.stamps else {
            return Err(GpuError::NoTimestamps {
                detail: "batched reads need the %globaltimer kernel; this backend uses CUDA events".into(),
            });
        };
        let _guard = self.private_lock.lock().unwrap_or_else(|e| e.into_inner());
        bind(&self.owned.ctx).map_err(api("cuCtxSetCurrent"))?;
        // SAFETY: our stream, alive until `owned` drops; waiting makes any earlier probe of ours finish before
        // the words are reused.
        unsafe { result::stream::synchronize(self.owned.private) }.map_err(api("cuStreamSynchronize"))?;
        let mut dst = self.batch_base();
        let mut n = count as u32;
        let mut params = [
            (&mut dst as *mut sys::CUdeviceptr).cast::<c_void>(),
            (&mut n as *mut u32).cast::<c_void>(),
        ];
        // SAFETY: `stamps` takes (u64 pointer, u32); `dst` points to BATCH_WORDS mapped words, `n` of them
        // written; our stream is in the bound context; `params` outlives the call.
        unsafe { result::launch_kernel(stamps, (1, 1, 1), (1, 1, 1), 0, self.owned.private, &mut params) }
            .map_err(api("cuLaunchKernel"))?;
        // SAFETY: as above.
        unsafe { result::stream::synchronize(self.owned.private) }.map_err(api("cuStreamSynchronize"))?;
        Ok((0..n).map(|i| GpuTicks(self.load_word(self.slots + i))).collect())
    }

    /// One `%globaltimer` read, in ns ([`read_clock_batch`](Self::read_clock_batch) of 1). Blocks until the
    /// kernel has run.
    pub fn read_clock(&self) -> Result<GpuTicks, GpuError> {
        Ok(self.read_clock_batch(1)?[0])
    }

    /// The device address of the first word after the slots.
    fn batch_base(&self) -> sys::CUdeviceptr {
        self.owned.device + u64::from(self.slots) * 8
    }

    fn load_word(&self, index: u32) -> u64 {
        self.owned.load(index)
    }

    fn store_word(&self, index: u32, value: u64) {
        self.owned.store(index, value)
    }

    /// Launches `tickline_stamp` into word `index` on `stream`.
    fn launch_stamp(&self, stamp: sys::CUfunction, stream: sys::CUstream, index: u32) -> Result<(), DriverError> {
        debug_assert!(index < self.slots + BATCH_WORDS);
        let mut dst = self.owned.device + u64::from(index) * 8;
        let mut params = [(&mut dst as *mut sys::CUdeviceptr).cast::<c_void>()];
        // SAFETY: `stamp` takes one u64 pointer, as `params` holds; `dst` is word `index` of our mapped memory
        // (asserted above), which stays allocated until every stream of the context is synchronised in
        // `Owned::drop`; `params` outlives the call (the driver copies the arguments at launch).
        unsafe { result::launch_kernel(stamp, (1, 1, 1), (1, 1, 1), 0, stream, &mut params) }
    }

    /// Whether the private stream is idle, so a probe launched now runs at once. At a burst's start
    /// (`wait == false`) a busy stream means a probe of an earlier burst is still queued behind the GPU's work:
    /// `false` at once. Within a burst (`wait`), the stream is busy only while this burst's last probe retires
    /// (its store is visible to the host a few µs before the stream reports it complete): spin until it does,
    /// within the burst's budget. (Returning at the first busy answer, as this once did,
    /// ended every burst after one or two samples: seen on an H200, "2 samples in 50 ms".)
    fn private_idle(&self, wait: bool, started: Instant, budget: Duration) -> Result<bool, GpuError> {
        loop {
            // SAFETY: our stream, alive until `owned` drops.
            match unsafe { sys::cuStreamQuery(self.owned.private) } {
                sys::cudaError_enum::CUDA_SUCCESS => return Ok(true),
                sys::cudaError_enum::CUDA_ERROR_NOT_READY => {
                    if !wait || started.elapsed() >= budget {
                        return Ok(false);
                    }
                    std::hint::spin_loop();
                }
                e => return Err(api("cuStreamQuery")(DriverError(e))),
            }
        }
    }
}

impl GpuBackend for CudaGpu {
    type Commands = CudaStream;

    fn info(&self) -> GpuDeviceInfo {
        self.info.clone()
    }

    #[inline]
    fn write_timestamp(&self, stream: &CudaStream, slot: u32) {
        debug_assert!(slot < self.slots, "slot {slot} of {}", self.slots);
        debug_assert!(**stream.context() == *self.owned.ctx, "a stream of another context");
        // Every entry point used here was resolved in `new` (it launched a kernel or recorded an event, bound
        // the context), so nothing below can panic.
        let result = bind(&self.owned.ctx).and_then(|()| match &self.stamps {
            Stamps::Timer { stamp, .. } => self.launch_stamp(*stamp, stream.cu_stream(), slot),
            Stamps::Events(events) => events.record(slot, stream.cu_stream()),
        });
        if result.is_err() {
            self.failed_writes.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        match &self.stamps {
            Stamps::Timer { .. } => read_slots(self.slots, first, out, |index| self.load_word(index)),
            Stamps::Events(events) => {
                read_slots(self.slots, first, out, |_| 0)?; // the range check
                bind(&self.owned.ctx).map_err(api("cuCtxSetCurrent"))?;
                events.read(first, out)
            }
        }
    }

    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        match &self.stamps {
            Stamps::Timer { .. } => clear_slots(self.slots, first, count, |index| self.store_word(index, 0)),
            Stamps::Events(events) => clear_slots(self.slots, first, count, |index| events.clear(index)),
        }
    }

    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        let started = Instant::now();
        let _guard = self.private_lock.lock().unwrap_or_else(|e| e.into_inner());
        bind(&self.owned.ctx).map_err(api("cuCtxSetCurrent"))?;
        let stamp = match &self.stamps {
            Stamps::Timer { stamp, .. } => *stamp,
            Stamps::Events(events) => return events.calibrate(self.owned.private, samples, budget, out),
        };
        let word = self.slots;
        for taken in 0..samples {
            if started.elapsed() >= budget {
                break;
            }
            if !self.private_idle(taken > 0, started, budget)? {
                // A probe of an earlier burst is still queued behind the GPU's work, or this burst's last probe
                // has not retired within the budget: no further sample this time.
                break;
            }
            self.store_word(word, 0);
            let before_ns = monotonic_ns().0;
            self.launch_stamp(stamp, self.owned.private, word)
                .map_err(api("cuLaunchKernel"))?;
            let deadline = budget + PROBE_GRACE;
            let ticks = loop {
                let ticks = self.load_word(word);
                if ticks != 0 || started.elapsed() >= deadline {
                    break ticks;
                }
                std::hint::spin_loop();
            };
            let after_ns = monotonic_ns().0;
            if ticks == 0 {
                break; // the probe stays pending; the next burst checks the stream first
            }
            // The read happened inside [before, after]. The timer's resolution is in the domain: the history
            // widens this bracket by half of it on both sides (not by all of it at the start, which would
            // place every event early by half the resolution).
            out.push(CalibrationSample::from_bracket(ticks, before_ns, after_ns));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_is_loadable_text() {
        assert!(std::ffi::CString::new(PTX).is_ok(), "no interior NUL");
        for entry in ["tickline_stamp(", "tickline_stamps(", "tickline_steps("] {
            assert!(PTX.contains(&format!(".visible .entry {entry}")), "{entry}");
        }
        assert!(PTX.contains("%globaltimer"));
        assert!(PTX.contains(".address_size 64"));
        // Every label branched to is defined once.
        for label in ["STAMPS_LOOP", "STAMPS_DONE", "STEPS_LOOP", "STEPS_DONE"] {
            assert_eq!(PTX.matches(&format!("{label}:")).count(), 1, "{label}");
        }
    }

    #[test]
    fn options_are_checked() {
        assert!(check_options(&CudaOptions::default()).is_ok());
        for slots in [0, 1, 3, MAX_SLOTS + 2] {
            let e = check_options(&CudaOptions {
                timestamp_slots: slots,
                ..CudaOptions::default()
            })
            .unwrap_err();
            assert!(matches!(e, GpuError::Invalid { .. }), "{slots}: {e}");
        }
    }

    #[test]
    fn resolution_is_the_smallest_step() {
        assert_eq!(min_step(&[1000, 1032, 1096, 1128, 0, 0]), Some(32));
        assert_eq!(min_step(&[5_000, 6_000, 8_000]), Some(1000));
        // Zeroes end the recorded values (the probe stopped spinning).
        assert_eq!(min_step(&[5_000, 0, 5_001]), None);
        assert_eq!(min_step(&[7, 7, 7]), None);
        assert_eq!(min_step(&[]), None);
    }

    #[test]
    fn slots_read_zero_as_unwritten_and_recycle_to_zero() {
        use std::cell::Cell;
        let words: Vec<Cell<u64>> = (0..8).map(|_| Cell::new(0)).collect();
        words[2].set(1_700_000_000_000_000_000);
        words[3].set(1_700_000_000_000_000_500);
        let mut out = [Some(GpuTicks(9)); 4];
        read_slots(8, 1, &mut out, |i| words[i as usize].get()).unwrap();
        assert_eq!(
            out,
            [
                None,
                Some(GpuTicks(1_700_000_000_000_000_000)),
                Some(GpuTicks(1_700_000_000_000_000_500)),
                None
            ]
        );
        // Past the slots: refused, nothing read.
        let e = read_slots(8, 6, &mut out, |_| unreachable!()).unwrap_err();
        assert!(matches!(e, GpuError::Invalid { .. }), "{e}");
        assert!(read_slots(8, u32::MAX, &mut out, |_| unreachable!()).is_err());
        clear_slots(8, 2, 2, |i| words[i as usize].set(0)).unwrap();
        assert!(words.iter().all(|w| w.get() == 0));
        assert!(clear_slots(8, 7, 2, |_| unreachable!()).is_err());
        assert!(clear_slots(8, u32::MAX, u32::MAX, |_| unreachable!()).is_err());
    }

    #[test]
    fn event_ticks_count_ns_from_the_anchor() {
        assert_eq!(event_ticks(EVENT_ORIGIN, 0.0), EVENT_ORIGIN);
        assert_eq!(event_ticks(EVENT_ORIGIN, 1.5), EVENT_ORIGIN + 1_500_000);
        // Before the anchor (a slot read after a newer anchor): negative milliseconds.
        assert_eq!(event_ticks(EVENT_ORIGIN, -0.25), EVENT_ORIGIN - 250_000);
        assert_eq!(event_ticks(5, -1.0), 1, "never 0, never wrapped");
        // f32 at 100 ms: within 8 ns (24-bit mantissa).
        let t = event_ticks(0, 100.000_001);
        assert!(t.abs_diff(100_000_001) <= 8, "{t}");
    }

    #[test]
    fn brackets_are_half_their_width() {
        let s = CalibrationSample::from_bracket(42, 1_000, 1_010);
        assert_eq!((s.source_ticks, s.reference_ns, s.max_deviation_ns), (42, 1_005, 5));
        assert_eq!(CalibrationSample::from_bracket(1, 7, 7).max_deviation_ns, 1);
        // Reads in the other order bracket the same interval.
        let reversed = CalibrationSample::from_bracket(1, 10, 3);
        assert_eq!((reversed.reference_ns, reversed.max_deviation_ns), (6, 4));
    }

    #[test]
    fn panics_in_cudarc_become_errors() {
        let e = contain::<()>("cuSomething", || panic!("Expected symbol in library: DlSym")).unwrap_err();
        assert!(matches!(e, GpuError::Api { call: "cuSomething", ref detail } if detail.contains("DlSym")));
        assert_eq!(contain("x", || Ok(3)).unwrap(), 3);
    }

    #[test]
    fn no_such_device_is_typed() {
        let e = device_error(
            "cuDeviceGet",
            3,
            DriverError(sys::cudaError_enum::CUDA_ERROR_INVALID_DEVICE),
        );
        assert!(matches!(e, GpuError::NoDevice { .. }), "{e}");
        let e = device_error("cuInit", 0, DriverError(sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(matches!(e, GpuError::Api { call: "cuInit", .. }), "{e}");
    }

    #[test]
    fn backend_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<CudaGpu>();
    }
}
