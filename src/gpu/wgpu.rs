//! wgpu on the timeline (feature `wgpu`), at two levels:
//!
//! - **wgpu-level scopes**, [`WgpuProfiler`]: scopes on `wgpu::CommandEncoder`s, on compute and render passes
//!   (timed by the pass descriptor's `timestamp_writes`) and inside passes, on every backend wgpu runs, safe to
//!   call. The replacement for wgpu-profiler, with its API's shape, that places each GPU slice on the CPU's time
//!   axis, with its uncertainty and a flow from the CPU code that recorded it.
//! - **hal-level scopes**, [`WgpuGpu`]: [`gpu_scope!`](macro@crate::gpu_scope) on wgpu-hal Vulkan command
//!   encoders (`unsafe` to set up; for code that records hal commands itself). See
//!   [below](#wgpu-hal-scopes-wgpugpu).
//!
//! # wgpu-level scopes: `WgpuProfiler`
//!
//! ```no_run
//! use tickline::gpu::wgpu::{request_device, WgpuProfiler, WgpuProfilerSettings};
//!
//! # #[allow(dead_code)]
//! # fn demo(adapter: &wgpu::Adapter, pipeline: &wgpu::ComputePipeline) -> Result<(), Box<dyn std::error::Error>> {
//! // `adapter.request_device`, plus calibrated timestamps where wgpu runs on Vulkan.
//! let (device, queue) = request_device(adapter, &wgpu::DeviceDescriptor {
//!     required_features: adapter.features() & WgpuProfiler::ALL_WGPU_TIMER_FEATURES,
//!     ..Default::default()
//! })?;
//! let timeline = tickline::Timeline::builder().start()?; // with an exporter: a Perfetto file, Tracy...
//! let profiler = WgpuProfiler::new(&timeline, &device, &queue, WgpuProfilerSettings::default())?;
//!
//! for frame in 0..3u64 {
//!     let mut encoder = device.create_command_encoder(&Default::default());
//!     {
//!         // On the encoder (needs TIMESTAMP_QUERY_INSIDE_ENCODERS), with a field:
//!         let mut scope = tickline::wgpu_scope!(profiler, &mut encoder, "frame", frame = frame);
//!         // A pass timed by its own boundary timestamps (needs only TIMESTAMP_QUERY):
//!         let mut pass = scope.scoped_compute_pass("simulate");
//!         pass.set_pipeline(pipeline);
//!         // Inside the pass (needs TIMESTAMP_QUERY_INSIDE_PASSES):
//!         let mut step = pass.scope("step 1");
//!         step.dispatch_workgroups(64, 1, 1);
//!     }
//!     profiler.resolve_queries(&mut encoder);
//!     queue.submit([encoder.finish()]);
//!     profiler.end_frame()?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! ## How a scope reaches the timeline
//!
//! A [`WgpuProfiler`] is a GPU device on the timeline like any other (its backend is a [`GpuBackend`] registered
//! with [`Timeline::gpu`](crate::Timeline::gpu), with one queue track), so its scopes go through the same machinery
//! as [`gpu_scope!`](macro@crate::gpu_scope): a scope takes a timestamp pair from the device's free list and
//! pushes one record group into the CPU thread's ring (the CPU tick, the call site, the device/queue/pair key,
//! the fields); the collector reads the pair back, converts it with the device clock's live calibration, and
//! exports the slice with its `uncertainty_ns` and a flow from the scope's CPU point. What differs is only who
//! writes the timestamps: wgpu records through `&mut` encoders and passes, so the guard ([`WgpuScope`],
//! [`WgpuOwningScope`]) borrows the encoder or pass, dereferences to it for the scope's own commands, and writes
//! the end timestamp when dropped; a pass scope hands its pair to the pass descriptor's `timestamp_writes`. No
//! handle outlives its encoder: the guard borrows it (or owns the pass).
//!
//! ## Read-back without stalling
//!
//! Query sets (4096 timestamps each) are pooled for the profiler's life; a pair returns to the pool once the
//! collector has converted its slice. [`resolve_queries`](WgpuProfiler::resolve_queries) resolves the frame's pairs into a
//! pooled read-back buffer and asks wgpu to map it when the command buffer is submitted
//! (`CommandEncoder::map_buffer_on_submit`); the collector thread polls the device without blocking
//! (`Device::poll(PollType::Poll)`, at most every 200 µs) and copies out what was mapped. Nothing ever waits on
//! the application's queue or device. At most `max_num_pending_frames` read-backs are in flight; a frame that finds
//! none free is deferred to the next (counted), never dropped; the timestamp pool bounds what is pending, and a
//! scope that finds it empty is counted as starved ([`WgpuProfiler::stats`]).
//!
//! ## Calibration
//!
//! Where wgpu runs on Vulkan and the device has `VK_KHR/EXT_calibrated_timestamps` enabled (open it with
//! [`request_device`]), the device clock is sampled through the hal device's raw handle (`as_hal`), a few ns
//! each, never touching the queue. Everywhere else (Metal, DX12, GL, or Vulkan without the extension) a tiny probe
//! submitted to the queue writes one timestamp, bracketed by `CLOCK_MONOTONIC` reads before the submit and when
//! wgpu's mapping callback runs: an honest, wide uncertainty (tens to hundreds of µs; the calibration keeps the
//! tightest samples). [`WgpuProfiler::calibration_path`] says which, and why. A device without
//! `Features::TIMESTAMP_QUERY` is refused with an error that names it.
//!
//! ## Moving from wgpu-profiler 0.28
//!
//! The same frame, with wgpu-profiler:
//!
//! ```text
//! let mut profiler = GpuProfiler::new(&device, GpuProfilerSettings::default())?;
//! // per frame:
//! {
//!     let mut scope = profiler.scope("frame", &mut encoder);
//!     let mut pass = scope.scoped_compute_pass("simulate");
//!     pass.set_pipeline(&pipeline);
//!     pass.dispatch_workgroups(64, 1, 1);
//! }
//! profiler.resolve_queries(&mut encoder);
//! queue.submit([encoder.finish()]);
//! profiler.end_frame()?;
//! if let Some(results) = profiler.process_finished_frame(queue.get_timestamp_period()) {
//!     wgpu_profiler::chrometrace::write_chrometrace(Path::new("trace.json"), &results)?;
//! }
//! ```
//!
//! and with tickline (the scope and pass lines do not change):
//!
//! ```text
//! let timeline = tickline::Timeline::builder()
//!     .exporter(tickline_perfetto::PerfettoExporter::create("trace.pftrace")?)
//!     .start()?;
//! let profiler = WgpuProfiler::new(&timeline, &device, &queue, WgpuProfilerSettings::default())?;
//! // per frame:
//! {
//!     let mut scope = profiler.scope("frame", &mut encoder);
//!     let mut pass = scope.scoped_compute_pass("simulate");
//!     pass.set_pipeline(&pipeline);
//!     pass.dispatch_workgroups(64, 1, 1);
//! }
//! profiler.resolve_queries(&mut encoder);
//! queue.submit([encoder.finish()]);
//! profiler.end_frame()?;
//! // no process_finished_frame: the GPU slices are in the trace, on the CPU's time axis.
//! ```
//!
//! - `GpuProfiler::new(&device, settings)` becomes `WgpuProfiler::new(&timeline, &device, &queue, settings)`;
//!   `GpuProfilerSettings`' three fields keep their names and defaults ([`WgpuProfilerSettings`]).
//! - `scope`, `owning_scope`, `Scope::scope`, `scoped_compute_pass`, `scoped_render_pass`, `resolve_queries` and
//!   `end_frame` keep their signatures (they take `&self` where wgpu-profiler takes `&mut self`); the guards
//!   dereference to the encoder or pass as wgpu-profiler's do. `begin_query`/`end_query` and
//!   `ManualOwningScope` have no counterpart: drop a guard to end its scope.
//! - `process_finished_frame` goes: results are on the timeline (Perfetto, Tracy, or
//!   [`MemoryExporter`](crate::MemoryExporter) for in-process use), in `CLOCK_MONOTONIC` ns rather than device
//!   ticks, with an uncertainty.
//! - Create the device with [`request_device`] (instead of `adapter.request_device`) for ns-tight calibration on
//!   Vulkan; [`wgpu_scope!`](macro@crate::wgpu_scope) is the cheaper `scope` with fields.
//!
//! ## Caveats
//!
//! - The collector's `Device::poll` runs whatever mapping and work-done callbacks are due, the application's
//!   included, on the collector thread (wgpu runs callbacks on whichever thread polls); and wgpu's own `log`
//!   records from those polls show up on the collector's track when `log` is bridged into `tracing`
//!   (`tracing_subscriber`'s `init()` installs that bridge; `examples/wgpu_frame.rs` does without it).
//! - On the probe path, each calibration burst submits probes to the application's queue and polls for them
//!   for up to the burst budget (2 ms by default), as often as every 20 ms while the fit is less certain than
//!   1 µs, which a probe's bracket always is.
//! - [`resolve_queries`](WgpuProfiler::resolve_queries)' encoder must be submitted after the encoders whose
//!   scopes it resolves; one submitted earlier reads nothing and its pairs are resolved again at the next frame
//!   ([`WgpuProfilerStats::retried_pairs`]).
//! - With `InstanceFlags::AUTOMATIC_TIMESTAMP_NORMALIZATION` on a device whose timestamp period is not 1 ns,
//!   resolved timestamps are no longer the device clock the Vulkan extension samples: the profiler notices at
//!   setup and uses the probe.
//! - Timestamps inside a pass or encoder are not ordered against its other commands on every backend (wgpu's
//!   `write_timestamp` docs); pass boundary timestamps are.
//!
//! # wgpu-hal scopes: `WgpuGpu`
//!
//! [`WgpuGpu`] puts scopes recorded into wgpu-hal command encoders on the timeline, aligned to the CPU clock.
//!
//! wgpu-hal has timestamp query sets but no calibration API (its `get_presentation_timestamp` only reads a host
//! clock), does no masking by valid bits, and reads results by copying them with `WAIT`. So this backend works
//! under hal, on hal's **Vulkan** backend: it takes the raw `ash` handles hal exposes (`raw_device`,
//! `raw_physical_device`, `shared_instance().raw_instance()`, the queue) and runs tickline's
//! [`VulkanGpu`] on them. One implementation of query pools, host or command reset, non-blocking reads with
//! availability, masking, scaling by `timestampPeriod` and calibration serves both backends; this module only
//! opens the hal device with what that machinery wants ([`open_device`]) and adapts hal's types.
//!
//! Why not hal's own `QuerySet` and `CommandEncoder::write_timestamp`: hal's encoder methods take `&mut self`,
//! so a scope guard that borrowed the encoder would stop the scope's own commands from being recorded; hal
//! writes every timestamp at `BOTTOM_OF_PIPE` (a scope's begin would then wait for earlier work); and hal's
//! read-back (`copy_query_results` with `WAIT`) blocks the GPU timeline or the reader. A scope therefore records
//! into [`WgpuCommands`], the encoder's active `vk::CommandBuffer` taken while it encodes.
//!
//! ```no_run
//! use tickline::gpu::wgpu::{hal, open_device, wgt, WgpuCommands, WgpuGpu};
//! use hal::{CommandEncoder as _, Device as _};
//!
//! # #[allow(dead_code)]
//! # fn demo(adapter: &hal::vulkan::Adapter) -> Result<(), Box<dyn std::error::Error>> {
//! // Open the hal device with calibrated timestamps and hostQueryReset when the adapter offers them.
//! // SAFETY: the adapter is alive; the features and limits are ones it supports.
//! let (open, options) = unsafe {
//!     open_device(adapter, wgt::Features::empty(), &wgt::Limits::default(), &Default::default())?
//! };
//! // SAFETY: the handles are alive and outlive the backend; see `WgpuGpu::new` for the whole contract.
//! let backend = unsafe { WgpuGpu::new(&open.device, &open.queue, options)? };
//! let timeline = tickline::Timeline::builder().start()?;
//! let gpu = timeline.gpu(backend)?;
//! let compute = gpu.queue("compute")?;
//!
//! // SAFETY: hal's contract for encoders.
//! let mut encoder = unsafe {
//!     open.device.create_command_encoder(&hal::CommandEncoderDescriptor { label: None, queue: &open.queue })?
//! };
//! unsafe { encoder.begin_encoding(Some("frame"))? };
//! let commands = WgpuCommands::of(&encoder).expect("the encoder is encoding");
//! {
//!     let _frame = tickline::gpu_scope!(compute, &commands, "frame");
//!     // ... encoder.copy_buffer_to_buffer(..), encoder.dispatch(..) ...
//! }
//! // ... let buffer = encoder.end_encoding()?, then submit while holding `gpu.backend().lock_queue()` ...
//! # Ok(())
//! # }
//! ```
//!
//! ## From a `wgpu::Device`
//!
//! A `wgpu` user who records hal commands reaches this backend through
//! wgpu's `as_hal` accessors: open the device through [`open_device`] and hand it to wgpu with
//! `Adapter::create_device_from_hal` (so the calibrated-timestamps extension is enabled), then take the hal
//! device and queue back out. wgpu and tickline must agree on the wgpu-hal version (30).
//!
//! ```no_run
//! use tickline::gpu::wgpu::{open_device, WgpuCommands, WgpuGpu};
//! use tickline::gpu::vulkan::CalibrationPath;
//! use wgpu::hal::api::Vulkan;
//!
//! # #[allow(dead_code)]
//! # fn demo(adapter: &wgpu::Adapter, timeline: &tickline::Timeline) -> Result<(), Box<dyn std::error::Error>> {
//! let desc = wgpu::DeviceDescriptor::default();
//! // SAFETY: the hal adapter is the wgpu adapter's; the features and limits are the descriptor's.
//! let (open, options) = unsafe {
//!     let hal_adapter = adapter.as_hal::<Vulkan>().ok_or("not a Vulkan adapter")?;
//!     open_device(&hal_adapter, desc.required_features, &desc.required_limits, &desc.memory_hints)?
//! };
//! // SAFETY: `open` was opened on this adapter with the descriptor's features and limits.
//! let (device, queue) = unsafe { adapter.create_device_from_hal(open, &desc)? };
//! // SAFETY: `device` and `queue` outlive the backend; see `WgpuGpu::new`.
//! let backend = unsafe {
//!     let hal_device = device.as_hal::<Vulkan>().ok_or("not Vulkan")?;
//!     let hal_queue = queue.as_hal::<Vulkan>().ok_or("not Vulkan")?;
//!     WgpuGpu::new(&hal_device, &hal_queue, options)?
//! };
//! // wgpu-core submits to the queue without tickline's lock: use the extension path only.
//! assert!(matches!(backend.vulkan().calibration_path(), CalibrationPath::Extension(_)));
//! let gpu = timeline.gpu(backend)?;
//! let gpu_queue = gpu.queue("wgpu")?;
//!
//! let mut raw = device.create_command_encoder(&Default::default());
//! // SAFETY: only timestamps are recorded into wgpu's hal encoder.
//! unsafe {
//!     raw.as_hal_mut::<Vulkan, _, _>(|hal_encoder| {
//!         let commands = hal_encoder.and_then(|e| WgpuCommands::of(e)).expect("an open Vulkan encoder");
//!         let _scope = tickline::gpu_scope!(gpu_queue, &commands, "raw work");
//!         // ... hal commands on `hal_encoder` ...
//!     })
//! };
//! queue.submit([raw.finish()]);
//! # Ok(())
//! # }
//! ```
//!
//! wgpu 30 panics when one `wgpu::CommandEncoder` mixes its own encoding API with `as_hal_mut` ("Mixing the
//! wgpu encoding API with the raw encoding API is not permitted"), and a scope's two timestamps go into one
//! command buffer: so with a `wgpu::Device`, scopes bracket hal commands recorded inside `as_hal_mut`, not
//! wgpu-level passes: time those with [`WgpuProfiler`]. `tests/it/wgpu.rs` runs this path on lavapipe.
//! On lavapipe, whose query calls must not overlap a submission, wgpu-core's submissions (made without
//! tickline's queue lock) can still overlap the collector's reads, and a scope may then be lost (see
//! [the Vulkan backend](super::vulkan#lavapipe-query-calls-hold-the-queue-lock)).
//!
//! ## Other hal backends
//!
//! Metal, DX12 and GLES are not supported: [`WgpuGpu::from_hal`] returns [`GpuError::Invalid`] naming what is
//! missing (non-blocking timestamp reads with availability, and a way to sample the device clock against
//! `CLOCK_MONOTONIC`, which hal does not expose on those backends).
//!
//! ## Submitting
//!
//! When the device offers no calibrated-timestamps extension the backend calibrates by submitting a probe to the
//! queue from tickline's collector thread (see [the Vulkan backend](super::vulkan#calibration)); Vulkan wants submits
//! externally synchronised, so every `hal::Queue::submit` (and `present`) to the queue happens under
//! [`WgpuGpu::lock_queue`], or through [`WgpuGpu::submit`].

mod calibrate;
mod device;
mod profiler;
mod queries;
mod scope;

pub use device::request_device;
pub use profiler::{EndFrameError, WgpuProfiler, WgpuProfilerSettings, WgpuProfilerStats};
#[doc(hidden)]
pub use queries::RawTicksLog;
pub use scope::{WgpuOwningScope, WgpuRecorder, WgpuScope};

use std::any::Any;
use std::sync::MutexGuard;
use std::time::Duration;

pub use wgpu_hal as hal;
pub use wgpu_types as wgt;

use ash::vk;
use hal::vulkan as hv;

use super::vulkan::{
    offered_calibration_extension, supports_host_query_reset, CalibrationExtension, VulkanGpu, VulkanOptions,
};
use crate::calibration::CalibrationSample;
use crate::gpu::{GpuBackend, GpuDeviceInfo, GpuError, GpuTicks};

/// The command stream a wgpu-hal scope records into: the active `vk::CommandBuffer` of a hal Vulkan
/// `CommandEncoder`, taken between `begin_encoding` and `end_encoding`.
///
/// A copy of the handle, not a borrow of the encoder, so the encoder can record the scope's commands (hal's
/// recording methods take `&mut self`) while the scope's guard is alive. [`WgpuGpu::new`]'s contract says when
/// it may be used.
///
/// ```no_run
/// # #[allow(dead_code)]
/// # fn demo(encoder: &tickline::gpu::wgpu::hal::vulkan::CommandEncoder) {
/// use tickline::gpu::wgpu::WgpuCommands;
/// match WgpuCommands::of(encoder) {
///     Some(commands) => println!("recording into {:?}", commands.raw()),
///     None => println!("call begin_encoding first"),
/// }
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WgpuCommands(vk::CommandBuffer);

impl WgpuCommands {
    /// The encoder's active command buffer, or `None` when it is not encoding (hal's handle is null then).
    pub fn of(encoder: &hv::CommandEncoder) -> Option<WgpuCommands> {
        // SAFETY: hal's only requirement on `raw_handle` is that the handle is not destroyed by hand; tickline
        // never destroys it (it only records timestamp commands into it).
        let raw = unsafe { encoder.raw_handle() };
        (raw != vk::CommandBuffer::null()).then_some(WgpuCommands(raw))
    }

    /// The raw command buffer.
    pub fn raw(&self) -> vk::CommandBuffer {
        self.0
    }
}

/// Opens a wgpu-hal Vulkan device the way tickline wants it: hal's own extensions and features for `features`,
/// plus the calibrated-timestamps extension (KHR preferred, else EXT) and the `hostQueryReset` feature when
/// the adapter offers them. Returns the device and queue with the [`VulkanOptions`] that describe what was
/// enabled, ready for [`WgpuGpu::new`].
///
/// hostQueryReset is enabled only where it is core (instance and device at Vulkan 1.2 or newer).
///
/// # Safety
///
/// As hal's `Adapter::open`: `features` and `limits` are supported by the adapter, and the adapter (and its
/// instance) outlive the device.
///
/// ```no_run
/// # #[allow(dead_code)]
/// # fn demo(adapter: &tickline::gpu::wgpu::hal::vulkan::Adapter) -> Result<(), tickline::gpu::GpuError> {
/// use tickline::gpu::wgpu::{open_device, wgt};
/// // SAFETY: the adapter is alive and supports these (no) features and the default limits.
/// let (open, options) = unsafe {
///     open_device(adapter, wgt::Features::empty(), &wgt::Limits::default(), &Default::default())?
/// };
/// println!("calibration: {:?}, host reset: {}", options.calibrated_timestamps, options.host_query_reset);
/// # drop(open);
/// # Ok(())
/// # }
/// ```
pub unsafe fn open_device(
    adapter: &hv::Adapter,
    features: wgt::Features,
    limits: &wgt::Limits,
    memory_hints: &wgt::MemoryHints,
) -> Result<(hal::OpenDevice<hv::Api>, VulkanOptions), GpuError> {
    let shared = adapter.shared_instance();
    let (entry, instance, physical) = (shared.entry(), shared.raw_instance(), adapter.raw_physical_device());
    // SAFETY: the adapter's instance is alive (the caller's contract) and the physical device is the adapter's.
    let extension = unsafe { offered_calibration_extension(instance, physical)? };
    // SAFETY: as above.
    let device_api = unsafe { instance.get_physical_device_properties(physical) }.api_version;
    let host_query_reset = shared.instance_api_version() >= vk::API_VERSION_1_2
        && device_api >= vk::API_VERSION_1_2
        // SAFETY: as above; hal created the instance from `entry`.
        && unsafe { supports_host_query_reset(entry, instance, physical) } == Some(true);
    let mut host_reset = vk::PhysicalDeviceHostQueryResetFeatures::default().host_query_reset(true);
    let host_reset = &mut host_reset;
    let callback: Box<hv::CreateDeviceCallback<'_>> = Box::new(move |args| {
        if let Some(extension) = extension {
            if !args.extensions.contains(&extension.name()) {
                args.extensions.push(extension.name());
            }
        }
        if host_query_reset {
            // hal chains no VkPhysicalDeviceVulkan12Features (its adapter code says so), so this struct may
            // be chained on its own.
            *args.create_info = args.create_info.push_next(host_reset);
        }
    });
    // SAFETY: the caller's contract covers `open`'s; the callback only adds an extension the adapter offers and
    // enables a feature it supports (both checked above), which is what `open_with_callback` allows.
    let open = unsafe { adapter.open_with_callback(features, limits, memory_hints, Some(callback)) }.map_err(|e| {
        GpuError::Api {
            call: "vkCreateDevice (wgpu-hal Adapter::open_with_callback)",
            detail: e.to_string(),
        }
    })?;
    let options = VulkanOptions {
        host_query_reset,
        calibrated_timestamps: extension,
        ..VulkanOptions::default()
    };
    Ok((open, options))
}

/// The wgpu-hal [`GpuBackend`]: tickline's [`VulkanGpu`] on the raw handles of a hal Vulkan device. See the
/// [module docs](self).
#[derive(Debug)]
pub struct WgpuGpu {
    inner: VulkanGpu,
    info: GpuDeviceInfo,
}

impl WgpuGpu {
    /// Sets the backend up on a hal Vulkan device and its queue.
    ///
    /// `options.calibrated_timestamps`: when `None`, the extension the device was opened with (hal knows its
    /// enabled extensions) is used, if any. `options.host_query_reset` is the caller's word, as for
    /// [`VulkanGpu::new`] ([`open_device`] reports it).
    ///
    /// Errors: as [`VulkanGpu::new`], and [`GpuError::Invalid`] when `queue` is not the device's queue.
    ///
    /// # Safety
    ///
    /// [`VulkanGpu::new`]'s contract, in hal's words:
    /// - `device` and `queue` (and their instance) stay alive until this backend is dropped (shut the timeline
    ///   down and drop every [`GpuDevice`](crate::gpu::GpuDevice)/[`GpuQueue`](crate::gpu::GpuQueue) first);
    /// - every `submit`/`present` to `queue` from now on holds [`lock_queue`](Self::lock_queue) (or goes
    ///   through [`submit`](Self::submit));
    /// - every [`WgpuCommands`] given to [`gpu_scope!`](macro@crate::gpu_scope) comes from an encoder of
    ///   `device` that is still encoding (between `begin_encoding` and `end_encoding`) and is not used on another
    ///   thread meanwhile; its command buffer is submitted at most once; without `host_query_reset`, scopes sit
    ///   outside render passes;
    /// - the backend is dropped only when no command buffer holding its scopes is pending;
    /// - `options.host_query_reset` is true only if the device was opened with `hostQueryReset` enabled.
    pub unsafe fn new(device: &hv::Device, queue: &hv::Queue, mut options: VulkanOptions) -> Result<WgpuGpu, GpuError> {
        if queue.as_raw() != device.raw_queue() {
            return Err(GpuError::Invalid {
                detail: "the hal queue is not the hal device's queue".into(),
            });
        }
        if options.calibrated_timestamps.is_none() {
            let enabled = device.enabled_device_extensions();
            options.calibrated_timestamps = [CalibrationExtension::Khr, CalibrationExtension::Ext]
                .into_iter()
                .find(|e| enabled.contains(&e.name()));
        }
        let shared = device.shared_instance();
        // SAFETY: hal hands out the handles of one device: its loader, instance, physical device, device, queue
        // family and queue are related and alive (this function's contract keeps them so); the rest of
        // `VulkanGpu::new`'s contract is this function's.
        let inner = unsafe {
            VulkanGpu::new(
                shared.entry(),
                shared.raw_instance(),
                device.raw_physical_device(),
                device.raw_device(),
                device.queue_family_index(),
                queue.as_raw(),
                options,
            )?
        };
        let info = GpuDeviceInfo {
            api: "wgpu-hal (Vulkan)",
            ..inner.info()
        };
        Ok(WgpuGpu { inner, info })
    }

    /// [`new`](Self::new) for any hal backend: fails with [`GpuError::Invalid`], saying what is missing, unless
    /// `A` is hal's Vulkan backend.
    ///
    /// # Safety
    ///
    /// As [`new`](Self::new).
    ///
    /// ```no_run
    /// # #[allow(dead_code)]
    /// # fn demo<A: tickline::gpu::wgpu::hal::Api>(device: &A::Device, queue: &A::Queue) {
    /// use tickline::gpu::{vulkan::VulkanOptions, wgpu::WgpuGpu};
    /// // SAFETY: the handles outlive the backend; see `WgpuGpu::new`.
    /// match unsafe { WgpuGpu::from_hal::<A>(device, queue, VulkanOptions::default()) } {
    ///     Ok(backend) => println!("{:?}", backend.vulkan().calibration_path()),
    ///     Err(e) => println!("{e}"),
    /// }
    /// # }
    /// ```
    pub unsafe fn from_hal<A: hal::Api>(
        device: &A::Device,
        queue: &A::Queue,
        options: VulkanOptions,
    ) -> Result<WgpuGpu, GpuError> {
        let device = (device as &dyn Any).downcast_ref::<hv::Device>();
        let queue = (queue as &dyn Any).downcast_ref::<hv::Queue>();
        match (device, queue) {
            // SAFETY: this function's contract is `new`'s.
            (Some(device), Some(queue)) => unsafe { WgpuGpu::new(device, queue, options) },
            _ => Err(unsupported(A::VARIANT)),
        }
    }

    /// The Vulkan backend underneath: its calibration path, reset mode, queue lock.
    pub fn vulkan(&self) -> &VulkanGpu {
        &self.inner
    }

    /// Locks the queue: hold the guard across every hal `Queue::submit` and `present`.
    ///
    /// ```no_run
    /// # #[allow(dead_code)]
    /// # fn demo(gpu: &tickline::gpu::wgpu::WgpuGpu) {
    /// let queue = gpu.lock_queue();
    /// // ... hal `Queue::submit` / `present` to this queue while `queue` is held ...
    /// drop(queue);
    /// # }
    /// ```
    pub fn lock_queue(&self) -> MutexGuard<'_, vk::Queue> {
        self.inner.lock_queue()
    }

    /// hal's `Queue::submit` under [`lock_queue`](Self::lock_queue).
    ///
    /// # Safety
    ///
    /// hal's contract for `Queue::submit`; `queue` is the queue the backend was made with.
    pub unsafe fn submit(
        &self,
        queue: &hv::Queue,
        command_buffers: &[&hv::CommandBuffer],
        fence: &hv::Fence,
        value: hal::FenceValue,
    ) -> Result<(), GpuError> {
        use hal::Queue as _;
        let guard = self.lock_queue();
        debug_assert_eq!(*guard, queue.as_raw());
        // SAFETY: the queue is externally synchronised by the lock every submitter takes (`new`'s contract); the
        // rest is hal's contract, this function's.
        unsafe { queue.submit(command_buffers, &[], (fence, value)) }.map_err(|e| GpuError::Api {
            call: "vkQueueSubmit (wgpu-hal Queue::submit)",
            detail: e.to_string(),
        })
    }
}

/// The error for a hal backend this module cannot drive.
fn unsupported(backend: wgt::Backend) -> GpuError {
    GpuError::Invalid {
        detail: format!(
            "wgpu-hal backend {backend:?} is not supported: tickline reads timestamps without blocking (with \
             availability) and calibrates the device clock against CLOCK_MONOTONIC through hal's Vulkan backend \
             (VK_KHR/EXT_calibrated_timestamps, or a bracketed probe submit); hal offers neither on {backend:?}"
        ),
    }
}

impl GpuBackend for WgpuGpu {
    type Commands = WgpuCommands;

    fn info(&self) -> GpuDeviceInfo {
        self.info.clone()
    }

    #[inline]
    fn write_timestamp(&self, commands: &WgpuCommands, slot: u32) {
        self.inner.write_timestamp(&commands.0, slot);
    }

    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        self.inner.read_timestamps(first, out)
    }

    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        self.inner.recycle(first, count)
    }

    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        self.inner.calibrate(samples, budget, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_backends_are_refused_with_what_is_missing() {
        let message = unsupported(wgt::Backend::Metal).to_string();
        assert!(message.contains("Metal") && message.contains("calibrat"), "{message}");
    }

    #[test]
    fn backend_is_send_and_sync() {
        fn assert_backend<B: GpuBackend>() {}
        assert_backend::<WgpuGpu>();
    }
}
