//! [`WgpuProfiler`]: wgpu-level GPU scopes on tickline's timeline, with wgpu-profiler's shape.

use std::fmt;
use std::panic::Location;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::calibrate;
use super::queries::{RawTicksLog, WgpuQueries};
use super::scope::{self, WgpuOwningScope, WgpuRecorder, WgpuScope};
use crate::calibration::ClockDomain;
use crate::callsite::NativeCallsite;
use crate::gpu::vulkan::CalibrationPath;
use crate::gpu::{GpuCalibrationReport, GpuDevice, GpuDeviceInfo, GpuError, GpuFieldEncoder, GpuQueue};
use crate::{TicklineError, Timeline};

/// How a [`WgpuProfiler`] records. The first three fields are wgpu-profiler's `GpuProfilerSettings`, with the
/// same names and defaults.
///
/// ```
/// use tickline::gpu::wgpu::WgpuProfilerSettings;
/// let settings = WgpuProfilerSettings {
///     enable_debug_groups: false,
///     ..WgpuProfilerSettings::default()
/// };
/// assert_eq!((settings.max_num_pending_frames, settings.timestamp_slots), (3, 8192));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WgpuProfilerSettings {
    /// Write timestamps. When false, scopes write nothing and record nothing (debug groups still apply): a run-time
    /// off switch.
    pub enable_timer_queries: bool,
    /// Push a debug group named after each scope on its encoder or pass (for RenderDoc and the like).
    pub enable_debug_groups: bool,
    /// Read-back buffers in flight at once (each holds one [`resolve_queries`](WgpuProfiler::resolve_queries)'s
    /// timestamps until the collector has read them). At least 1. Unlike wgpu-profiler, which drops a frame past
    /// this bound, a resolve that finds every buffer in flight is *deferred*: its timestamps stay in their query
    /// sets and go into the next frame's read-back; deferrals are counted
    /// ([`WgpuProfilerStats::deferred_resolves`]).
    pub max_num_pending_frames: usize,
    /// Timestamp queries (even, 2 ..= 1 Mi; wgpu query sets of 4096 each): every scope holds two from when it
    /// opens until the collector has read both back (a frame or so after its submission; the slots are
    /// released as soon as the ticks are read, before the slice is converted). The default, 8192, holds 4096
    /// scopes in flight (about 400 KiB of host memory and 64 KiB of query sets). A scope that finds none free
    /// is not recorded and is counted ([`WgpuProfilerStats::starved_scopes`]).
    pub timestamp_slots: u32,
    /// The name of the queue's track in the trace.
    pub queue_name: String,
}

impl Default for WgpuProfilerSettings {
    /// Timer queries and debug groups on, 3 read-backs in flight, 8192 timestamps, the track "wgpu queue".
    fn default() -> Self {
        WgpuProfilerSettings {
            enable_timer_queries: true,
            enable_debug_groups: true,
            max_num_pending_frames: 3,
            timestamp_slots: 8192,
            queue_name: "wgpu queue".to_owned(),
        }
    }
}

/// Most timestamp slots one profiler takes (256 query sets; 8 MiB of read-back at most).
const MAX_SLOTS: u32 = 1 << 20;

/// Why [`WgpuProfiler::end_frame`] objects: wgpu-profiler's `EndFrameError`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndFrameError {
    /// Scopes still open (their guards not dropped).
    UnclosedQueries(u32),
    /// Scopes ended since the last [`resolve_queries`](WgpuProfiler::resolve_queries): call it on the frame's last
    /// encoder before submitting.
    UnresolvedQueries(u32),
}

impl fmt::Display for EndFrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndFrameError::UnclosedQueries(n) => write!(f, "{n} wgpu scopes are still open at the end of the frame"),
            EndFrameError::UnresolvedQueries(n) => write!(
                f,
                "{n} wgpu scopes ended since the last resolve_queries: call it on the frame's last encoder"
            ),
        }
    }
}

impl std::error::Error for EndFrameError {}

/// What a [`WgpuProfiler`] counted. Nothing is dropped silently: every scope either reaches the trace, or is
/// counted here or in the timeline's stats (`gpu_lost_scopes` for scopes whose commands never ran).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WgpuProfilerStats {
    /// Scopes not recorded because every timestamp pair was in flight (also in the timeline's dropped records).
    pub starved_scopes: u64,
    /// Scopes not timed because the device lacks the feature their encoder or pass needs
    /// (`TIMESTAMP_QUERY_INSIDE_ENCODERS` or `TIMESTAMP_QUERY_INSIDE_PASSES`).
    pub untimed_scopes: u64,
    /// `resolve_queries` calls that found every read-back buffer in flight: their timestamps waited a frame.
    pub deferred_resolves: u64,
    /// Pairs resolved again because a read-back held no timestamps written by their scope yet (the resolving
    /// command buffer was submitted before the scope's, or never).
    pub retried_pairs: u64,
    /// Pairs given up after 4 such read-backs: their scopes' commands never ran (the timeline counts them as
    /// lost once its `lost_after` passes).
    pub unreadable_pairs: u64,
    /// The collector's `Device::poll` calls that failed (a lost device: its scopes are lost).
    pub failed_polls: u64,
}

/// What a scope wrote when it opened, so that its end writes the rest.
#[derive(Clone, Copy, Debug)]
pub(super) struct Opened {
    /// The timestamp pair, or [`NO_PAIR`].
    pair: u32,
    /// Whether the end timestamp is the scope's to write (false for pass scopes: the pass writes it).
    write_end: bool,
    debug_group: bool,
}

const NO_PAIR: u32 = u32::MAX;

/// wgpu-level GPU scopes on tickline's timeline: the replacement for wgpu-profiler's `GpuProfiler` that places
/// each GPU slice on the CPU's time axis. See the [module docs](super#wgpu-level-scopes-wgpuprofiler).
///
/// Cheap to share: every method takes `&self` (scopes may be opened on several threads at once).
pub struct WgpuProfiler {
    gpu: GpuDevice<WgpuQueries>,
    queue: GpuQueue<WgpuQueries>,
    settings: WgpuProfilerSettings,
    features: wgpu::Features,
    path: CalibrationPath,
    open_scopes: AtomicU32,
    untimed: AtomicU64,
}

impl fmt::Debug for WgpuProfiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuProfiler")
            .field("device", &self.gpu.info().name)
            .field("api", &self.gpu.info().api)
            .field("calibration", &self.path)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl WgpuProfiler {
    /// Every timestamp feature the profiler uses: wgpu-profiler's `ALL_WGPU_TIMER_FEATURES`. Request the ones
    /// the adapter offers (`adapter.features() & WgpuProfiler::ALL_WGPU_TIMER_FEATURES`).
    pub const ALL_WGPU_TIMER_FEATURES: wgpu::Features = wgpu::Features::TIMESTAMP_QUERY
        .union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS)
        .union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);

    /// Puts `device`'s work on `timeline`, on a queue track named by `settings.queue_name`: creates the query sets
    /// and the resolve buffer, picks the clock calibration (the Vulkan device's calibrated timestamps where wgpu runs
    /// on Vulkan and the device has them, else a bracketed probe submitted to `queue`), and reads one probe
    /// timestamp back to check the whole path. That probe is the only wait, here at setup (at most 2 s).
    ///
    /// Errors: [`GpuError::NoTimestamps`] naming the missing `Features::TIMESTAMP_QUERY`; [`GpuError::Invalid`] for
    /// bad settings; [`GpuError::Api`] when no timestamp comes back.
    ///
    /// ```no_run
    /// # #[allow(dead_code)]
    /// # fn demo(device: &wgpu::Device, queue: &wgpu::Queue) -> Result<(), Box<dyn std::error::Error>> {
    /// use tickline::gpu::wgpu::{WgpuProfiler, WgpuProfilerSettings};
    /// let timeline = tickline::Timeline::builder().start()?;
    /// let profiler = WgpuProfiler::new(&timeline, device, queue, WgpuProfilerSettings::default())?;
    /// println!("calibration: {:?}", profiler.calibration_path());
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(
        timeline: &Timeline,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        settings: WgpuProfilerSettings,
    ) -> Result<WgpuProfiler, TicklineError> {
        let slots = settings.timestamp_slots;
        if slots < 2 || slots % 2 != 0 || slots > MAX_SLOTS {
            return Err(GpuError::Invalid {
                detail: format!("timestamp_slots must be even and in 2..={MAX_SLOTS}, not {slots}"),
            }
            .into());
        }
        if settings.max_num_pending_frames == 0 {
            return Err(GpuError::Invalid {
                detail: "max_num_pending_frames must be at least 1".into(),
            }
            .into());
        }
        let features = device.features();
        let adapter = device.adapter_info();
        if !features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Err(GpuError::NoTimestamps {
                detail: format!(
                    "the wgpu device ({}, {:?}) was created without wgpu::Features::TIMESTAMP_QUERY: request it in \
                     DeviceDescriptor::required_features (with TIMESTAMP_QUERY_INSIDE_ENCODERS and \
                     TIMESTAMP_QUERY_INSIDE_PASSES where the adapter offers them, for scopes on encoders and \
                     inside passes)",
                    adapter.name, adapter.backend
                ),
            }
            .into());
        }
        let route = calibrate::vulkan_route(device);
        let valid_bits = route.as_ref().map_or(64, |r| r.valid_bits);
        let period = f64::from(queue.get_timestamp_period());
        let clock = ClockDomain::new(valid_bits, period).map_err(|e| GpuError::Invalid {
            detail: format!(
                "{}: timestamp period {period} ns / {valid_bits} valid bits: {e}",
                adapter.name
            ),
        })?;
        let (calibrator, path) = calibrate::choose(device, queue, route, clock.mask())?;
        let info = GpuDeviceInfo {
            name: adapter.name.clone(),
            api: api_name(adapter.backend),
            clock,
            timestamp_slots: slots,
        };
        let backend = WgpuQueries::new(device, info, settings.max_num_pending_frames, calibrator);
        let gpu = timeline.gpu(backend)?;
        let queue = gpu.queue(&settings.queue_name)?;
        Ok(WgpuProfiler {
            gpu,
            queue,
            settings,
            features,
            path,
            open_scopes: AtomicU32::new(0),
            untimed: AtomicU64::new(0),
        })
    }

    /// Opens a scope on an encoder or pass: writes a begin timestamp now and the end timestamp when the returned
    /// guard drops; record the scope's commands through the guard (it dereferences to `encoder_or_pass`). Nest with
    /// [`WgpuScope::scope`]. wgpu-profiler's `scope`, with the same signature.
    ///
    /// `label` names the slice. Each distinct `(label, call site)` becomes a call site once per process and is found
    /// again through a per-thread table; [`wgpu_scope!`](macro@crate::wgpu_scope) fixes it at compile time and takes
    /// fields. A process keeps at most 4096 distinct labels (each is kept for the process's life): beyond them a
    /// slice is named `wgpu scope (label table full)` with its label in a `label` field. Labels made per frame
    /// (`format!("frame {n}")`) reach that soon: name the scope `"frame"` and put the number in a field with
    /// [`wgpu_scope!`](macro@crate::wgpu_scope).
    ///
    /// ```no_run
    /// # #[allow(dead_code)]
    /// # fn demo(profiler: &tickline::gpu::wgpu::WgpuProfiler, device: &wgpu::Device) {
    /// let mut encoder = device.create_command_encoder(&Default::default());
    /// {
    ///     let mut frame = profiler.scope("frame", &mut encoder);
    ///     let _simulate = frame.scoped_compute_pass("simulate");
    ///     // ... _simulate.set_pipeline(..); _simulate.dispatch_workgroups(..) ...
    /// }
    /// profiler.resolve_queries(&mut encoder);
    /// # }
    /// ```
    #[must_use = "the GPU scope ends when this guard is dropped"]
    #[track_caller]
    #[inline]
    pub fn scope<'a, R: WgpuRecorder>(
        &'a self,
        label: impl AsRef<str>,
        encoder_or_pass: &'a mut R,
    ) -> WgpuScope<'a, R> {
        let label = label.as_ref();
        let opened = match scope::callsite(label, Location::caller()) {
            Some(callsite) => self.open(callsite, None, label, encoder_or_pass),
            None => self.open(
                &scope::OVERFLOW,
                Some(&|e: &mut GpuFieldEncoder<'_, '_>| e.field(0, label)),
                label,
                encoder_or_pass,
            ),
        };
        WgpuScope::new(self, encoder_or_pass, opened)
    }

    /// [`scope`](Self::scope) with a call site fixed at compile time and optional fields. Use
    /// [`wgpu_scope!`](macro@crate::wgpu_scope).
    #[doc(hidden)]
    #[inline]
    pub fn scope_at<'a, R: WgpuRecorder>(
        &'a self,
        callsite: &'static NativeCallsite,
        fields: Option<&dyn Fn(&mut GpuFieldEncoder<'_, '_>)>,
        encoder_or_pass: &'a mut R,
    ) -> WgpuScope<'a, R> {
        let opened = self.open(callsite, fields, callsite.name(), encoder_or_pass);
        WgpuScope::new(self, encoder_or_pass, opened)
    }

    /// [`scope`](Self::scope) on an encoder or pass the guard takes ownership of (wgpu-profiler's `owning_scope`).
    #[must_use = "the GPU scope ends when this guard is dropped"]
    #[track_caller]
    pub fn owning_scope<R: WgpuRecorder>(
        &self,
        label: impl AsRef<str>,
        mut encoder_or_pass: R,
    ) -> WgpuOwningScope<'_, R> {
        let label = label.as_ref();
        let opened = match scope::callsite(label, Location::caller()) {
            Some(callsite) => self.open(callsite, None, label, &mut encoder_or_pass),
            None => self.open(
                &scope::OVERFLOW,
                Some(&|e: &mut GpuFieldEncoder<'_, '_>| e.field(0, label)),
                label,
                &mut encoder_or_pass,
            ),
        };
        WgpuOwningScope::new(self, encoder_or_pass, opened)
    }

    /// Begins a compute pass on `encoder` timed by its own boundary timestamps (the pass descriptor's
    /// `timestamp_writes`), labelled `label`; the scope and the pass end when the guard drops. Needs only
    /// `Features::TIMESTAMP_QUERY`: the one kind of GPU timing on some backends (Metal on Apple GPUs). Inside, nest
    /// [`WgpuOwningScope::scope`]s where `TIMESTAMP_QUERY_INSIDE_PASSES` exists.
    ///
    /// ```no_run
    /// # #[allow(dead_code)]
    /// # fn demo(profiler: &tickline::gpu::wgpu::WgpuProfiler, device: &wgpu::Device, pipeline: &wgpu::ComputePipeline) {
    /// let mut encoder = device.create_command_encoder(&Default::default());
    /// {
    ///     let mut pass = profiler.scoped_compute_pass("blur", &mut encoder);
    ///     pass.set_pipeline(pipeline);
    ///     pass.dispatch_workgroups(64, 1, 1);
    /// }
    /// profiler.resolve_queries(&mut encoder);
    /// # }
    /// ```
    #[must_use = "the GPU scope (and the pass) end when this guard is dropped"]
    #[track_caller]
    pub fn scoped_compute_pass<'a>(
        &'a self,
        label: impl AsRef<str>,
        encoder: &'a mut wgpu::CommandEncoder,
    ) -> WgpuOwningScope<'a, wgpu::ComputePass<'a>> {
        let label = label.as_ref();
        let (opened, writes) = self.open_pass(label, Location::caller());
        let pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(label),
            timestamp_writes: writes.map(|(query_set, index)| wgpu::ComputePassTimestampWrites {
                query_set,
                beginning_of_pass_write_index: Some(index),
                end_of_pass_write_index: Some(index + 1),
            }),
        });
        WgpuOwningScope::new(self, pass, opened)
    }

    /// Begins a render pass on `encoder` from `descriptor`, timed by its own boundary timestamps: the
    /// descriptor's `timestamp_writes` are replaced with the profiler's, and its label, when `None`, becomes
    /// `label`. As [`scoped_compute_pass`](Self::scoped_compute_pass) otherwise.
    ///
    /// ```no_run
    /// # #[allow(dead_code)]
    /// # fn demo(profiler: &tickline::gpu::wgpu::WgpuProfiler, device: &wgpu::Device, view: &wgpu::TextureView) {
    /// let mut encoder = device.create_command_encoder(&Default::default());
    /// {
    ///     let attachment = wgpu::RenderPassColorAttachment {
    ///         view,
    ///         depth_slice: None,
    ///         resolve_target: None,
    ///         ops: wgpu::Operations { load: wgpu::LoadOp::Clear(wgpu::Color::BLACK), store: wgpu::StoreOp::Store },
    ///     };
    ///     let _pass = profiler.scoped_render_pass(
    ///         "draw",
    ///         &mut encoder,
    ///         wgpu::RenderPassDescriptor {
    ///             color_attachments: &[Some(attachment)],
    ///             ..Default::default()
    ///         },
    ///     );
    /// }
    /// profiler.resolve_queries(&mut encoder);
    /// # }
    /// ```
    #[must_use = "the GPU scope (and the pass) end when this guard is dropped"]
    #[track_caller]
    pub fn scoped_render_pass<'a>(
        &'a self,
        label: impl AsRef<str>,
        encoder: &'a mut wgpu::CommandEncoder,
        descriptor: wgpu::RenderPassDescriptor<'_>,
    ) -> WgpuOwningScope<'a, wgpu::RenderPass<'a>> {
        let label = label.as_ref();
        let (opened, writes) = self.open_pass(label, Location::caller());
        let pass = encoder.begin_render_pass(&wgpu::RenderPassDescriptor {
            label: descriptor.label.or(Some(label)),
            timestamp_writes: writes.map(|(query_set, index)| wgpu::RenderPassTimestampWrites {
                query_set,
                beginning_of_pass_write_index: Some(index),
                end_of_pass_write_index: Some(index + 1),
            }),
            ..descriptor
        });
        WgpuOwningScope::new(self, pass, opened)
    }

    /// Resolves the timestamps of every scope that ended since the last call into a read-back buffer that wgpu
    /// maps once `encoder` is submitted (`CommandEncoder::map_buffer_on_submit`); tickline's collector reads it
    /// without blocking. Call it once per frame on the frame's last encoder, submitted after (or in the same
    /// `submit`, later than) every encoder holding those scopes: wgpu-profiler's rule. A resolve that ran too
    /// early is recognised and repeated at the next frame, never read as a time.
    ///
    /// Takes `&self` (wgpu-profiler takes `&mut self`: calls written for it compile unchanged).
    pub fn resolve_queries(&self, encoder: &mut wgpu::CommandEncoder) {
        self.queue.backend().resolve(encoder);
    }

    /// The end of a frame, after its command buffers were submitted: wgpu-profiler's `end_frame`. tickline needs no
    /// per-frame work (the read-back is mapped on submit and read by the collector), so this only checks:
    /// [`EndFrameError::UnclosedQueries`] while scopes are open, [`EndFrameError::UnresolvedQueries`] when scopes
    /// ended after the last [`resolve_queries`](Self::resolve_queries). There is no `process_finished_frame`: the
    /// results are on the timeline, in its exporters.
    pub fn end_frame(&self) -> Result<(), EndFrameError> {
        let open = self.open_scopes.load(Ordering::Relaxed);
        if open != 0 {
            return Err(EndFrameError::UnclosedQueries(open));
        }
        match self.queue.backend().unresolved() {
            0 => Ok(()),
            n => Err(EndFrameError::UnresolvedQueries(n as u32)),
        }
    }

    /// The settings the profiler was made with.
    pub fn settings(&self) -> &WgpuProfilerSettings {
        &self.settings
    }

    /// How the device clock is calibrated: the Vulkan extension, or the submit probe and why.
    pub fn calibration_path(&self) -> &CalibrationPath {
        &self.path
    }

    /// The collector's newest calibration of the device clock, or `None` before the first fit.
    pub fn calibration(&self) -> Option<GpuCalibrationReport> {
        self.gpu.calibration()
    }

    /// What the device said about itself (name, wgpu backend, clock, timestamp slots).
    pub fn info(&self) -> &GpuDeviceInfo {
        self.gpu.info()
    }

    /// What was counted rather than recorded or read.
    pub fn stats(&self) -> WgpuProfilerStats {
        let counters = &self.queue.backend().counters;
        WgpuProfilerStats {
            starved_scopes: self.gpu.starved_scopes(),
            untimed_scopes: self.untimed.load(Ordering::Relaxed),
            deferred_resolves: counters.deferred_resolves.load(Ordering::Relaxed),
            retried_pairs: counters.retried_pairs.load(Ordering::Relaxed),
            unreadable_pairs: counters.unreadable_pairs.load(Ordering::Relaxed),
            failed_polls: counters.failed_polls.load(Ordering::Relaxed),
        }
    }

    /// Starts logging the raw ticks of every scope (pairs as taken, ticks as read back), for tests that check
    /// conversions against the truth.
    #[doc(hidden)]
    pub fn start_raw_log(&self) {
        self.queue.backend().logging.store(true, Ordering::Relaxed);
    }

    /// The raw-ticks log so far.
    #[doc(hidden)]
    pub fn raw_log(&self) -> RawTicksLog {
        self.queue.backend().raw_log()
    }

    /// Opens a scope on `recorder`: a pair, its begin timestamp and begin record, the debug group.
    #[inline]
    fn open<R: WgpuRecorder>(
        &self,
        callsite: &'static NativeCallsite,
        fields: Option<&dyn Fn(&mut GpuFieldEncoder<'_, '_>)>,
        label: &str,
        recorder: &mut R,
    ) -> Opened {
        self.open_scopes.fetch_add(1, Ordering::Relaxed);
        let mut opened = Opened {
            pair: NO_PAIR,
            write_end: true,
            debug_group: false,
        };
        if self.settings.enable_timer_queries {
            if self.features.contains(R::TIMESTAMP_FEATURE) {
                let backend = self.queue.backend();
                let pair = self.queue.begin_external(callsite, fields, |pair| {
                    let (set, index) = backend.slot(2 * pair);
                    recorder.write_timestamp(set, index);
                });
                if let Some(pair) = pair {
                    opened.pair = pair;
                    if backend.logging.load(Ordering::Relaxed) {
                        backend.log_open(pair);
                    }
                }
            } else {
                self.untimed.fetch_add(1, Ordering::Relaxed);
            }
        }
        if self.settings.enable_debug_groups {
            recorder.push_debug_group(label);
            opened.debug_group = true;
        }
        opened
    }

    /// Opens a pass scope: a pair whose timestamps the pass writes at its boundaries, `(query set, begin index)`.
    fn open_pass(&self, label: &str, location: &'static Location<'static>) -> (Opened, Option<(&wgpu::QuerySet, u32)>) {
        self.open_scopes.fetch_add(1, Ordering::Relaxed);
        let mut opened = Opened {
            pair: NO_PAIR,
            write_end: false,
            debug_group: false,
        };
        if !self.settings.enable_timer_queries {
            return (opened, None);
        }
        let field = |e: &mut GpuFieldEncoder<'_, '_>| e.field(0, label);
        let pair = match scope::callsite(label, location) {
            Some(callsite) => self.queue.begin_external(callsite, None, |_| {}),
            None => self.queue.begin_external(&scope::OVERFLOW, Some(&field), |_| {}),
        };
        let Some(pair) = pair else {
            return (opened, None);
        };
        let backend = self.queue.backend();
        if backend.logging.load(Ordering::Relaxed) {
            backend.log_open(pair);
        }
        opened.pair = pair;
        (opened, Some(backend.slot(2 * pair)))
    }

    /// Ends a scope: the end timestamp (unless a pass writes it), the pair queued for the next resolve, the
    /// debug group popped.
    #[inline]
    pub(super) fn close<R: WgpuRecorder>(&self, opened: &Opened, recorder: &mut R) {
        if opened.pair != NO_PAIR {
            let backend = self.queue.backend();
            if opened.write_end {
                let (set, index) = backend.slot(2 * opened.pair + 1);
                recorder.write_timestamp(set, index);
            }
            backend.close(opened.pair);
        }
        if opened.debug_group {
            recorder.pop_debug_group();
        }
        self.open_scopes.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The device track's API name for a wgpu backend.
fn api_name(backend: wgpu::Backend) -> &'static str {
    match backend {
        wgpu::Backend::Vulkan => "wgpu (Vulkan)",
        wgpu::Backend::Metal => "wgpu (Metal)",
        wgpu::Backend::Dx12 => "wgpu (DX12)",
        wgpu::Backend::Gl => "wgpu (GL)",
        wgpu::Backend::BrowserWebGpu => "wgpu (WebGPU)",
        _ => "wgpu",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiler_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<WgpuProfiler>();
    }

    #[test]
    fn settings_default_as_wgpu_profiler_does() {
        let s = WgpuProfilerSettings::default();
        assert!(s.enable_timer_queries && s.enable_debug_groups);
        assert_eq!(s.max_num_pending_frames, 3);
    }

    #[test]
    fn end_frame_errors_say_what_to_do() {
        assert!(EndFrameError::UnresolvedQueries(2)
            .to_string()
            .contains("resolve_queries"));
        assert!(EndFrameError::UnclosedQueries(1).to_string().contains("still open"));
    }
}
