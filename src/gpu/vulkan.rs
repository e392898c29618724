//! The Vulkan backend (feature `vulkan`): [`VulkanGpu`] puts scopes recorded into `ash` command buffers on the
//! timeline.
//!
//! The application keeps its own instance and device; tickline clones the `ash` function tables it needs and
//! owns a timestamp query pool, a small command pool, a fence and a one-query probe pool. The Vulkan loader
//! (`libvulkan.so.1`) is opened at run time ([`load_entry`]), so building needs no Vulkan SDK and a machine
//! without a driver gets a [`GpuError`], never a crash.
//!
//! ```no_run
//! use tickline::gpu::vulkan::{ash::vk, find_timestamp_queue, load_entry, VulkanGpu, VulkanOptions};
//!
//! # #[allow(dead_code)]
//! # fn demo(
//! #     instance: &ash::Instance,
//! #     device: &ash::Device,
//! #     commands: vk::CommandBuffer,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! let entry = load_entry()?; // GpuError::NoLoader when libvulkan.so.1 is missing
//! // ... create `instance` and `device` as usual (enable `hostQueryReset` and VK_EXT/KHR_calibrated_timestamps
//! // when the device offers them, and say so in the options) ...
//! // SAFETY: the instance is alive.
//! let (physical, family) = unsafe { find_timestamp_queue(instance, vk::QueueFlags::COMPUTE)? };
//! // SAFETY: the device was created on `physical` with a queue of `family`.
//! let queue = unsafe { device.get_device_queue(family, 0) };
//! let options = VulkanOptions { host_query_reset: true, ..VulkanOptions::default() };
//! // SAFETY: the handles are valid and outlive the backend; see `VulkanGpu::new` for the whole contract.
//! let backend = unsafe { VulkanGpu::new(&entry, instance, physical, device, family, queue, options)? };
//!
//! let timeline = tickline::Timeline::builder().start()?;
//! let gpu = timeline.gpu(backend)?;
//! let compute = gpu.queue("compute")?;
//! // ... vkBeginCommandBuffer(commands) ...
//! {
//!     let _frame = tickline::gpu_scope!(compute, &commands, "frame");
//!     // ... vkCmdDispatch, vkCmdCopyBuffer ...
//! }
//! // ... vkEndCommandBuffer(commands), then submit through the backend's queue lock:
//! let submit = vk::SubmitInfo::default().command_buffers(std::slice::from_ref(&commands));
//! // SAFETY: `commands` is a recorded command buffer of `family`.
//! unsafe { gpu.backend().submit(&[submit], vk::Fence::null())? };
//! # Ok(())
//! # }
//! ```
//!
//! # Timestamps: which pipeline stage
//!
//! A scope's begin (even slot) is written at `TOP_OF_PIPE` and its end (odd slot) at `BOTTOM_OF_PIPE`, the
//! defaults of [`VulkanOptions::begin_stage`] and [`VulkanOptions::end_stage`]. A `TOP_OF_PIPE` write happens
//! when the GPU reaches the command, before the scope's work can start; a `BOTTOM_OF_PIPE` write happens once
//! all earlier work has finished. So the slice *contains* the scope's work (it may start early by the time
//! earlier work still ran). Writes at one stage are ordered as the commands are, so a nested scope's slice
//! lies inside its parent's. Sibling scopes whose work the GPU overlaps show up overlapping, and tickline draws
//! them on sibling tracks; with `BOTTOM_OF_PIPE` for both, each slice would instead start when *earlier* work
//! finished, hiding the overlap and cutting the start of the scope's own work.
//!
//! # Recycling timestamp slots: two reset modes
//!
//! - **Host reset** ([`VulkanOptions::host_query_reset`], Vulkan 1.2's `hostQueryReset` feature enabled on the
//!   device): tickline resets a pair with `vkResetQueryPool` once it has read it. A scope records one
//!   `vkCmdWriteTimestamp` at each end, and scopes may be recorded inside render passes.
//! - **Command reset** (the feature is not enabled): each write is preceded by a `vkCmdResetQueryPool` of that
//!   one query in the command buffer. `vkCmdResetQueryPool` is not allowed inside a render pass, so **scopes
//!   must then be recorded outside render passes**. Until the GPU runs that reset the query still holds its
//!   previous value: the backend remembers the value each slot held when it was recycled and reports the slot
//!   unwritten while it still reads that value (device timestamps never repeat: they only grow).
//!
//! Either way a command buffer holding scopes is submitted once (its queries are written once per recycle).
//!
//! # lavapipe: query calls hold the queue lock
//!
//! Mesa's lavapipe (the CPU driver: seen with 22.3, and 23.2's source reads the same way) answers
//! `vkGetQueryPoolResults` and `vkResetQueryPool` on the queue's own gallium context, which is not thread-safe. A read first waits for the
//! device to go idle, then asks that context for each query's result; for a query whose work was not flushed
//! yet, the *reading* thread flushes the context. Vulkan lets an application submit while another thread reads
//! queries, and tickline reads a scope's pair as soon as the scope is recorded, so a submission that starts
//! during a read runs on that context while the reader flushes it: some of the submitted timestamps then never
//! become available, although the command buffer ran and its fence was signalled (the scope is lost). On
//! lavapipe the backend therefore makes every query read and reset hold [`VulkanGpu::lock_queue`], the lock every
//! submission takes: none starts during the call, and lavapipe's idle wait leaves nothing running. Its cost is
//! lavapipe's alone: a submit waits while the collector reads (a read that waits for the device to go idle
//! anyway). Vulkan asks no queue synchronisation of these calls, and other drivers need none: they take no lock.
//! A submission that bypasses the lock (wgpu-core's own, when scopes go through a `wgpu::Device`'s hal queue)
//! is not serialised with the reads, and on lavapipe a scope may then be lost.
//!
//! # Calibration
//!
//! With `VK_KHR_calibrated_timestamps` or `VK_EXT_calibrated_timestamps` enabled on the device (say which in
//! [`VulkanOptions::calibrated_timestamps`]; tickline checks that the device offers it, that its entry points
//! are there, and that the device and `CLOCK_MONOTONIC` domains are calibrateable), each sample is one
//! `vkGetCalibratedTimestamps*` of `[DEVICE, CLOCK_MONOTONIC]` with the driver's `maxDeviation`. Otherwise
//! (or when `CLOCK_MONOTONIC` is not calibrateable) a sample submits a tiny command buffer that writes one
//! timestamp, read back by polling: the write happened between `CLOCK_MONOTONIC` read just before
//! `vkQueueSubmit` and the read that saw it, and the sample's deviation is half that bracket. That is honest
//! but wide: about 20 µs on lavapipe (which makes a query available only when its command buffer ends), more
//! behind queued work, against 1 ns with the extension. [`VulkanGpu::calibration_path`] says which is in use.
//!
//! The fallback submits to the application's queue from tickline's collector thread, and Vulkan wants
//! `vkQueueSubmit` externally synchronised: submit through [`VulkanGpu::submit`] or hold
//! [`VulkanGpu::lock_queue`] (with an extension the backend never touches the queue after `new`, but the rule
//! is the same either way).
//!
//! # Lifetimes
//!
//! The backend stores raw handles and cloned function tables, not the `ash` objects: the caller promises
//! (by calling the `unsafe` [`VulkanGpu::new`]) that the device outlives it. Taking the device by value would
//! not help: `ash::Device` does not destroy the device when dropped, and the application needs it to record.
//! The backend lives as long as its [`GpuDevice`](crate::gpu::GpuDevice) handles and the timeline's collector:
//! destroy the device only after the timeline is shut down and every `GpuDevice`/`GpuQueue` is dropped.

use std::ffi::CStr;
use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use ash;
use ash::vk;

use super::{GpuBackend, GpuDeviceInfo, GpuError, GpuTicks};
use crate::calibration::{CalibrationSample, ClockDomain};
use crate::clock::monotonic_ns;

/// Which calibrated-timestamps extension the application enabled on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CalibrationExtension {
    /// `VK_KHR_calibrated_timestamps`.
    Khr,
    /// `VK_EXT_calibrated_timestamps`.
    Ext,
}

impl CalibrationExtension {
    /// The extension's name, as passed to `VkDeviceCreateInfo::ppEnabledExtensionNames`.
    ///
    /// ```
    /// use tickline::gpu::vulkan::CalibrationExtension;
    /// assert_eq!(CalibrationExtension::Ext.name().to_str().unwrap(), "VK_EXT_calibrated_timestamps");
    /// ```
    pub fn name(self) -> &'static CStr {
        match self {
            CalibrationExtension::Khr => ash::khr::calibrated_timestamps::NAME,
            CalibrationExtension::Ext => ash::ext::calibrated_timestamps::NAME,
        }
    }

    fn device_fn(self) -> &'static CStr {
        match self {
            CalibrationExtension::Khr => c"vkGetCalibratedTimestampsKHR",
            CalibrationExtension::Ext => c"vkGetCalibratedTimestampsEXT",
        }
    }

    fn domains_fn(self) -> &'static CStr {
        match self {
            CalibrationExtension::Khr => c"vkGetPhysicalDeviceCalibrateableTimeDomainsKHR",
            CalibrationExtension::Ext => c"vkGetPhysicalDeviceCalibrateableTimeDomainsEXT",
        }
    }
}

/// The calibrated-timestamps extension `physical_device` offers, KHR preferred: the one to enable at
/// `vkCreateDevice` (and to name in [`VulkanOptions::calibrated_timestamps`]), or `None`.
///
/// # Safety
///
/// `instance` is alive and `physical_device` belongs to it.
///
/// ```no_run
/// # #[allow(dead_code)]
/// # fn demo(instance: &ash::Instance, physical: ash::vk::PhysicalDevice) -> Result<(), tickline::gpu::GpuError> {
/// use tickline::gpu::vulkan::offered_calibration_extension;
/// // SAFETY: the instance is alive and `physical` was enumerated from it.
/// if let Some(extension) = unsafe { offered_calibration_extension(instance, physical)? } {
///     println!("enable {:?}", extension.name());
/// }
/// # Ok(())
/// # }
/// ```
pub unsafe fn offered_calibration_extension(
    instance: &ash::Instance,
    physical_device: vk::PhysicalDevice,
) -> Result<Option<CalibrationExtension>, GpuError> {
    // SAFETY: the caller's contract: `physical_device` belongs to the live instance.
    let offered = unsafe { instance.enumerate_device_extension_properties(physical_device) }
        .map_err(api("vkEnumerateDeviceExtensionProperties"))?;
    Ok([CalibrationExtension::Khr, CalibrationExtension::Ext]
        .into_iter()
        .find(|extension| {
            offered
                .iter()
                .any(|p| p.extension_name_as_c_str().is_ok_and(|n| n == extension.name()))
        }))
}

/// How [`VulkanGpu`] samples the device clock against `CLOCK_MONOTONIC`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CalibrationPath {
    /// `vkGetCalibratedTimestamps*` of the extension: the driver's own bracket, typically a few ns.
    Extension(CalibrationExtension),
    /// A submitted timestamp write bracketed by host clock reads: honest but wide (half the bracket).
    Submit {
        /// Why the extension is not used.
        reason: String,
    },
}

/// What the application tells [`VulkanGpu::new`] about its device, and how the backend should record.
///
/// ```
/// use tickline::gpu::vulkan::{CalibrationExtension, VulkanOptions};
/// let options = VulkanOptions {
///     host_query_reset: true,
///     calibrated_timestamps: Some(CalibrationExtension::Ext),
///     ..VulkanOptions::default()
/// };
/// assert_eq!(options.timestamp_slots, 4096);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VulkanOptions {
    /// Timestamp queries in the pool (even, 2..=1 Mi): each scope in flight holds two.
    pub timestamp_slots: u32,
    /// The device was created with `VkPhysicalDeviceVulkan12Features::hostQueryReset` (or
    /// `VkPhysicalDeviceHostQueryResetFeatures`) enabled: slots are recycled with `vkResetQueryPool` and
    /// scopes may sit inside render passes. Otherwise every write is preceded by a `vkCmdResetQueryPool` and
    /// scopes must be recorded outside render passes.
    pub host_query_reset: bool,
    /// Which calibrated-timestamps extension the device was created with, if any. Claiming one that is not
    /// enabled is rejected by [`VulkanGpu::new`] (calling a missing entry point would abort the process).
    pub calibrated_timestamps: Option<CalibrationExtension>,
    /// The stage a scope's begin timestamp is written at (one bit; see the [module docs](self)).
    pub begin_stage: vk::PipelineStageFlags,
    /// The stage a scope's end timestamp is written at (one bit).
    pub end_stage: vk::PipelineStageFlags,
}

impl Default for VulkanOptions {
    /// 4096 slots, command reset, no calibration extension, `TOP_OF_PIPE` begins and `BOTTOM_OF_PIPE` ends.
    fn default() -> Self {
        VulkanOptions {
            timestamp_slots: 4096,
            host_query_reset: false,
            calibrated_timestamps: None,
            begin_stage: vk::PipelineStageFlags::TOP_OF_PIPE,
            end_stage: vk::PipelineStageFlags::BOTTOM_OF_PIPE,
        }
    }
}

/// Most timestamp slots one backend takes (a pool of 1 Mi queries is 8 MiB of results).
const MAX_SLOTS: u32 = 1 << 20;
/// Queries read per `vkGetQueryPoolResults` call (a stack buffer of 512 bytes).
const READ_CHUNK: usize = 32;
/// How long past its budget a fallback burst waits for its last probe to complete (else the probe stays pending
/// and the next burst starts by checking it).
const PROBE_GRACE: Duration = Duration::from_micros(500);
/// `WITH_AVAILABILITY | TYPE_64` and no `WAIT`: a read never blocks; unavailable queries report 0.
const READ_FLAGS: vk::QueryResultFlags = vk::QueryResultFlags::from_raw(
    vk::QueryResultFlags::TYPE_64.as_raw() | vk::QueryResultFlags::WITH_AVAILABILITY.as_raw(),
);

fn api(call: &'static str) -> impl Fn(vk::Result) -> GpuError {
    move |result| GpuError::Api {
        call,
        detail: format!("{result}"),
    }
}

fn invalid(detail: String) -> GpuError {
    GpuError::Invalid { detail }
}

/// Opens the Vulkan loader (`libvulkan.so.1`, `vulkan-1.dll`, ...) with `ash::Entry::load`.
///
/// ```
/// match tickline::gpu::vulkan::load_entry() {
///     Ok(_entry) => println!("a Vulkan loader is installed"),
///     Err(e) => println!("{e}"), // GpuError::NoLoader
/// }
/// ```
pub fn load_entry() -> Result<ash::Entry, GpuError> {
    // SAFETY: opening the system's Vulkan loader runs its library initialisers, which is how the loader is meant
    // to be used; ash marks `load` unsafe only because any library named that way would be run. No invariant of
    // ours is involved.
    let loaded = unsafe { ash::Entry::load() };
    loaded.map_err(|e| GpuError::NoLoader {
        detail: format!("the Vulkan loader could not be opened ({e}); on Debian/Ubuntu: apt-get install libvulkan1 mesa-vulkan-drivers"),
    })
}

/// The first physical device with a queue family that supports `flags` and writes timestamps
/// (`timestampValidBits > 0`): `(device, queue family index)`.
///
/// Fails with [`GpuError::NoDevice`] when no device has such a family, [`GpuError::NoTimestamps`] when some
/// have the family but none writes timestamps there.
///
/// # Safety
///
/// `instance` is a live instance.
///
/// ```no_run
/// # #[allow(dead_code)]
/// # fn demo(instance: &ash::Instance) -> Result<(), tickline::gpu::GpuError> {
/// use tickline::gpu::vulkan::{ash::vk, find_timestamp_queue};
/// // SAFETY: the instance is alive.
/// let (physical_device, family) = unsafe { find_timestamp_queue(instance, vk::QueueFlags::COMPUTE)? };
/// # let _ = (physical_device, family);
/// # Ok(())
/// # }
/// ```
pub unsafe fn find_timestamp_queue(
    instance: &ash::Instance,
    flags: vk::QueueFlags,
) -> Result<(vk::PhysicalDevice, u32), GpuError> {
    debug_assert_ne!(instance.handle(), vk::Instance::null());
    // SAFETY: the caller promises the instance is alive (this function's contract).
    let devices = unsafe { instance.enumerate_physical_devices() }.map_err(api("vkEnumeratePhysicalDevices"))?;
    if devices.is_empty() {
        return Err(GpuError::NoDevice {
            detail: "the Vulkan loader found no physical device (no driver installed? mesa-vulkan-drivers has \
                     a software one)"
                .into(),
        });
    }
    let mut without_timestamps = Vec::new();
    for &physical in &devices {
        // SAFETY: `physical` was just enumerated from the live instance.
        let families = unsafe { instance.get_physical_device_queue_family_properties(physical) };
        for (index, family) in families.iter().enumerate() {
            if family.queue_flags.contains(flags) && family.queue_count > 0 {
                if family.timestamp_valid_bits > 0 {
                    return Ok((physical, index as u32));
                }
                without_timestamps.push(index);
            }
        }
    }
    if without_timestamps.is_empty() {
        Err(GpuError::NoDevice {
            detail: format!(
                "none of {} Vulkan device(s) has a queue family with {flags:?}",
                devices.len()
            ),
        })
    } else {
        Err(GpuError::NoTimestamps {
            detail: format!("queue families {without_timestamps:?} support {flags:?} but have timestampValidBits 0"),
        })
    }
}

/// The queue family's `timestampValidBits`, or why it cannot be used.
fn family_valid_bits(families: &[vk::QueueFamilyProperties], index: u32) -> Result<u32, GpuError> {
    let family = families.get(index as usize).ok_or_else(|| {
        invalid(format!(
            "queue family {index} does not exist (the device has {})",
            families.len()
        ))
    })?;
    match family.timestamp_valid_bits {
        0 => Err(GpuError::NoTimestamps {
            detail: format!("queue family {index} has timestampValidBits 0"),
        }),
        bits @ 1..=64 => Ok(bits),
        bits => Err(invalid(format!(
            "queue family {index} reports timestampValidBits {bits}"
        ))),
    }
}

fn check_options(options: &VulkanOptions) -> Result<(), GpuError> {
    let slots = options.timestamp_slots;
    if slots < 2 || slots % 2 != 0 || slots > MAX_SLOTS {
        return Err(invalid(format!(
            "timestamp_slots must be even and in 2..={MAX_SLOTS}, not {slots}"
        )));
    }
    for (what, stage) in [("begin_stage", options.begin_stage), ("end_stage", options.end_stage)] {
        if stage.as_raw().count_ones() != 1 {
            return Err(invalid(format!(
                "{what} must be exactly one pipeline stage (vkCmdWriteTimestamp), not {stage:?}"
            )));
        }
    }
    Ok(())
}

/// The handles the backend created; destroyed on drop (also when `new` fails half-way).
struct Owned {
    device: ash::Device,
    query_pool: vk::QueryPool,
    probe_pool: vk::QueryPool,
    command_pool: vk::CommandPool,
    fence: vk::Fence,
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: every handle here was created from `self.device`, which the caller of `VulkanGpu::new` keeps
        // alive for the backend's lifetime; nothing of ours is pending: `VulkanGpu::drop` (or the failing
        // `new`) waited for our only submissions, and the caller promises the command buffers with scopes
        // have completed. Null handles are skipped (destroying VK_NULL_HANDLE is allowed anyway).
        unsafe {
            if self.fence != vk::Fence::null() {
                self.device.destroy_fence(self.fence, None);
            }
            if self.command_pool != vk::CommandPool::null() {
                self.device.destroy_command_pool(self.command_pool, None);
            }
            if self.probe_pool != vk::QueryPool::null() {
                self.device.destroy_query_pool(self.probe_pool, None);
            }
            if self.query_pool != vk::QueryPool::null() {
                self.device.destroy_query_pool(self.query_pool, None);
            }
        }
    }
}

/// The fallback calibration's state: a recorded command buffer writing one timestamp into `probe_pool`.
struct Probe {
    command_buffer: vk::CommandBuffer,
    /// A probe submission whose fence has not been seen signalled (its command buffer may still be pending).
    pending: bool,
}

/// What one fallback probe gave.
enum ProbeOutcome {
    Sample(CalibrationSample),
    /// No sample within the budget; the probe completed.
    Missed,
    /// The probe is still pending (the queue is busy): the burst stops, the next one checks it first.
    Pending,
}

enum Calibrator {
    Extension {
        get_calibrated_timestamps: vk::PFN_vkGetCalibratedTimestampsKHR,
    },
    Submit,
}

/// The Vulkan [`GpuBackend`]: timestamps written into the application's `ash` command buffers, read back without
/// blocking, the device clock calibrated against `CLOCK_MONOTONIC`. See the [module docs](self).
pub struct VulkanGpu {
    /// Our handles (and the device's function table): destroyed after `Drop::drop` waited for our submissions.
    owned: Owned,
    slots: u32,
    host_reset: bool,
    begin_stage: vk::PipelineStageFlags,
    end_stage: vk::PipelineStageFlags,
    mask: u64,
    info: GpuDeviceInfo,
    path: CalibrationPath,
    calibrator: Calibrator,
    /// Command reset mode: per slot, the value it held when it was last recycled (reported as unwritten).
    stale: Option<Mutex<Vec<Option<u64>>>>,
    /// The application's queue: every `vkQueueSubmit` to it goes through this lock.
    queue: Mutex<vk::Queue>,
    /// The driver answers query calls on the queue's context (lavapipe): they hold `queue` (see the
    /// [module docs](self#lavapipe-query-calls-hold-the-queue-lock)).
    queries_lock_queue: bool,
    probe: Mutex<Probe>,
}

impl fmt::Debug for VulkanGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VulkanGpu")
            .field("name", &self.info.name)
            .field("timestamp_slots", &self.slots)
            .field("host_query_reset", &self.host_reset)
            .field("calibration", &self.path)
            .finish_non_exhaustive()
    }
}

/// Whether `name` resolves on the device: a device-level command of the core version or of an enabled
/// extension (the loader and Mesa return null otherwise).
///
/// # Safety
///
/// `instance` and `device` are alive and `device` was created from `instance`.
unsafe fn has_device_fn(instance: &ash::Instance, device: &ash::Device, name: &CStr) -> bool {
    // SAFETY: the caller's contract; `name` is NUL-terminated (a CStr).
    unsafe { instance.get_device_proc_addr(device.handle(), name.as_ptr()) }.is_some()
}

/// Whether `physical_device` supports the `hostQueryReset` feature (Vulkan 1.2, or
/// `VK_EXT_host_query_reset`): `None` when the instance cannot say (no `vkGetPhysicalDeviceFeatures2`).
///
/// # Safety
///
/// `instance` is alive and was created from `entry`; `physical_device` belongs to it.
pub(crate) unsafe fn supports_host_query_reset(
    entry: &ash::Entry,
    instance: &ash::Instance,
    physical_device: vk::PhysicalDevice,
) -> Option<bool> {
    // SAFETY: the caller's contract; the name is a CStr.
    if !unsafe { has_instance_fn(entry, instance, c"vkGetPhysicalDeviceFeatures2") } {
        return None;
    }
    let mut host_reset = vk::PhysicalDeviceHostQueryResetFeatures::default();
    let mut features = vk::PhysicalDeviceFeatures2::default().push_next(&mut host_reset);
    // SAFETY: the entry point resolved (checked above); `features` is a valid chain of one struct that outlives
    // the call; the physical device belongs to the instance (contract).
    unsafe { instance.get_physical_device_features2(physical_device, &mut features) };
    Some(host_reset.host_query_reset == vk::TRUE)
}

/// Whether `name` resolves at the instance level.
///
/// # Safety
///
/// `instance` is alive and was created from `entry`.
unsafe fn has_instance_fn(entry: &ash::Entry, instance: &ash::Instance, name: &CStr) -> bool {
    // SAFETY: the caller's contract; `name` is NUL-terminated (a CStr).
    unsafe { entry.get_instance_proc_addr(instance.handle(), name.as_ptr()) }.is_some()
}

impl VulkanGpu {
    /// Sets the backend up on the application's device: checks the queue family writes timestamps and that
    /// what `options` claims holds, creates the query pools, resets them, and takes a trial calibration (which
    /// also takes the fallback probe's slow first runs out of the collector's first burst).
    ///
    /// Errors: [`GpuError::NoTimestamps`] (the family's `timestampValidBits` is 0), [`GpuError::Invalid`] (a
    /// family that does not exist, bad options, a claimed extension or feature the device does not have),
    /// [`GpuError::Api`] (a Vulkan call failed). Never a panic.
    ///
    /// # Safety
    ///
    /// - `instance` was created from `entry`, `physical_device` belongs to it, and `device` was created on
    ///   `physical_device` with a queue of family `queue_family_index`; `queue` is such a queue of `device`.
    /// - The device, the instance and the loader stay alive until this backend is dropped (it drops with the
    ///   last [`GpuDevice`](crate::gpu::GpuDevice)/[`GpuQueue`](crate::gpu::GpuQueue) handle and the
    ///   timeline's collector: shut the timeline down first).
    /// - From this call on, every use of `queue` that Vulkan wants externally synchronised (`vkQueueSubmit`,
    ///   `vkQueueWaitIdle`, `vkQueuePresentKHR`, `vkQueueBindSparse`) happens while holding
    ///   [`lock_queue`](Self::lock_queue) (or through [`submit`](Self::submit)): the fallback calibration
    ///   submits to it from tickline's collector thread.
    /// - Every command buffer given to [`gpu_scope!`](macro@crate::gpu_scope) with this backend's queues is a
    ///   command buffer of `device`, allocated for family `queue_family_index`, in the recording state, not
    ///   being recorded on another thread at the same time, and submitted at most once. Without
    ///   `host_query_reset`, scopes are opened and closed outside render pass instances.
    /// - The backend is dropped only when no command buffer holding its scopes is pending execution (wait for
    ///   the fences, or `vkDeviceWaitIdle`, before dropping the last handle).
    /// - `options.host_query_reset` is true only if `hostQueryReset` was enabled when `device` was created, and
    ///   `options.calibrated_timestamps` names an extension only if it was enabled then. Both are checked as far
    ///   as Vulkan allows (the device must support the feature; the extension's entry point must resolve, which
    ///   conformant loaders and drivers refuse for extensions not enabled), but a feature's enablement cannot be
    ///   queried.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        entry: &ash::Entry,
        instance: &ash::Instance,
        physical_device: vk::PhysicalDevice,
        device: &ash::Device,
        queue_family_index: u32,
        queue: vk::Queue,
        options: VulkanOptions,
    ) -> Result<VulkanGpu, GpuError> {
        check_options(&options)?;
        debug_assert_ne!(device.handle(), vk::Device::null());
        if queue == vk::Queue::null() {
            return Err(invalid("the queue handle is null".into()));
        }
        // SAFETY: the caller promises `physical_device` belongs to the live `instance` (this function's contract).
        let families = unsafe { instance.get_physical_device_queue_family_properties(physical_device) };
        let valid_bits = family_valid_bits(&families, queue_family_index)?;
        // SAFETY: as above.
        let properties = unsafe { instance.get_physical_device_properties(physical_device) };
        let name = properties
            .device_name_as_c_str()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "Vulkan device".into());
        let period = f64::from(properties.limits.timestamp_period);
        // lavapipe is Mesa's only CPU driver (Mesa's vendor id is 0x10005, positive as an i32).
        let lavapipe = i64::from(properties.vendor_id) == i64::from(vk::VendorId::MESA.as_raw())
            && properties.device_type == vk::PhysicalDeviceType::CPU;
        let clock = ClockDomain::new(valid_bits, period).map_err(|e| {
            invalid(format!(
                "{name}: timestampPeriod {period} / {valid_bits} valid bits: {e}"
            ))
        })?;

        if options.host_query_reset {
            // SAFETY: the caller promises instance and device are alive and related (this function's contract).
            let reset = unsafe { has_device_fn(instance, device, c"vkResetQueryPool") };
            if properties.api_version < vk::API_VERSION_1_2 || !reset {
                return Err(invalid(format!(
                    "host_query_reset claimed, but {name} has no Vulkan 1.2 vkResetQueryPool (device API {}.{})",
                    vk::api_version_major(properties.api_version),
                    vk::api_version_minor(properties.api_version)
                )));
            }
            // SAFETY: the caller promises the handles are alive and related (this function's contract).
            if unsafe { supports_host_query_reset(entry, instance, physical_device) } == Some(false) {
                return Err(invalid(format!(
                    "host_query_reset claimed, but {name} does not support hostQueryReset"
                )));
            }
        }

        let (calibrator, path) = match options.calibrated_timestamps {
            None => (
                Calibrator::Submit,
                CalibrationPath::Submit {
                    reason: "no calibrated-timestamps extension enabled".into(),
                },
            ),
            // SAFETY: this function's contract covers every handle the check uses.
            Some(extension) => unsafe { check_extension(entry, instance, physical_device, device, extension, &name)? },
        };

        let mut owned = Owned {
            device: device.clone(),
            query_pool: vk::QueryPool::null(),
            probe_pool: vk::QueryPool::null(),
            command_pool: vk::CommandPool::null(),
            fence: vk::Fence::null(),
        };
        let pool_info = vk::QueryPoolCreateInfo::default()
            .query_type(vk::QueryType::TIMESTAMP)
            .query_count(options.timestamp_slots);
        // SAFETY: the device is alive (contract); the create infos are valid and outlive the calls. Each handle
        // is stored in `owned` at once, so a later failure destroys it.
        unsafe {
            owned.query_pool = device
                .create_query_pool(&pool_info, None)
                .map_err(api("vkCreateQueryPool"))?;
            owned.probe_pool = device
                .create_query_pool(&pool_info.query_count(1), None)
                .map_err(api("vkCreateQueryPool"))?;
            owned.command_pool = device
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default().queue_family_index(queue_family_index),
                    None,
                )
                .map_err(api("vkCreateCommandPool"))?;
            owned.fence = device
                .create_fence(&vk::FenceCreateInfo::default(), None)
                .map_err(api("vkCreateFence"))?;
        }
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(owned.command_pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(2);
        // SAFETY: the command pool was just created on this device; buffers are freed with the pool.
        let buffers = unsafe { device.allocate_command_buffers(&alloc) }.map_err(api("vkAllocateCommandBuffers"))?;
        debug_assert_eq!(buffers.len(), 2);
        let (init, probe) = (buffers[0], buffers[1]);

        // The probe: reset the probe query, write the device clock as soon as the GPU reaches it.
        // SAFETY: `probe` is a fresh primary command buffer of our pool, recorded only here, on this thread; the
        // probe pool is ours. Query commands on one query run in submission order, so the reset precedes the write.
        unsafe {
            device
                .begin_command_buffer(probe, &vk::CommandBufferBeginInfo::default())
                .map_err(api("vkBeginCommandBuffer"))?;
            device.cmd_reset_query_pool(probe, owned.probe_pool, 0, 1);
            device.cmd_write_timestamp(probe, vk::PipelineStageFlags::TOP_OF_PIPE, owned.probe_pool, 0);
            device.end_command_buffer(probe).map_err(api("vkEndCommandBuffer"))?;
        }

        // New queries are in an undefined state: reset every one before first use (and before any read).
        if options.host_query_reset {
            // SAFETY: hostQueryReset is enabled (the caller's word, checked against the device's support above);
            // the pools are ours and unused.
            unsafe {
                device.reset_query_pool(owned.query_pool, 0, options.timestamp_slots);
                device.reset_query_pool(owned.probe_pool, 0, 1);
            }
        } else {
            // SAFETY: `init` is a fresh command buffer of our pool; the pools are ours and unused. The queue is
            // the caller's, who promises not to use it concurrently from now on (contract). We wait for the
            // fence without a time limit, so `init` and the fence are not pending when this returns or fails.
            unsafe {
                device
                    .begin_command_buffer(
                        init,
                        &vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
                    )
                    .map_err(api("vkBeginCommandBuffer"))?;
                device.cmd_reset_query_pool(init, owned.query_pool, 0, options.timestamp_slots);
                device.cmd_reset_query_pool(init, owned.probe_pool, 0, 1);
                device.end_command_buffer(init).map_err(api("vkEndCommandBuffer"))?;
                let submit = vk::SubmitInfo::default().command_buffers(std::slice::from_ref(&init));
                device
                    .queue_submit(queue, &[submit], owned.fence)
                    .map_err(api("vkQueueSubmit"))?;
                device
                    .wait_for_fences(&[owned.fence], true, u64::MAX)
                    .map_err(api("vkWaitForFences"))?;
                device.reset_fences(&[owned.fence]).map_err(api("vkResetFences"))?;
                device.free_command_buffers(owned.command_pool, &[init]);
            }
        }

        let info = GpuDeviceInfo {
            name,
            api: "Vulkan",
            clock,
            timestamp_slots: options.timestamp_slots,
        };
        let gpu = VulkanGpu {
            slots: options.timestamp_slots,
            host_reset: options.host_query_reset,
            begin_stage: options.begin_stage,
            end_stage: options.end_stage,
            mask: clock.mask(),
            info,
            path,
            calibrator,
            stale: (!options.host_query_reset).then(|| Mutex::new(vec![None; options.timestamp_slots as usize])),
            queue: Mutex::new(queue),
            queries_lock_queue: lavapipe,
            probe: Mutex::new(Probe {
                command_buffer: probe,
                pending: false,
            }),
            owned,
        };
        // A trial: a driver that lists the extension but fails the call is an error now, not a stream of failed
        // bursts later. The submit probe's first runs are slow (lavapipe compiles, queues wake up): take them
        // here rather than in the collector's first burst.
        let mut trial = Vec::new();
        match gpu.calibrator {
            Calibrator::Extension { .. } => gpu.calibrate(1, Duration::from_secs(1), &mut trial)?,
            Calibrator::Submit => gpu.calibrate(4, Duration::from_millis(20), &mut trial)?,
        }
        Ok(gpu)
    }

    /// How the device clock is calibrated: the extension, or the submit fallback and why.
    pub fn calibration_path(&self) -> &CalibrationPath {
        &self.path
    }

    /// Whether slots are recycled with `vkResetQueryPool` (else with a `vkCmdResetQueryPool` before each write).
    pub fn host_query_reset(&self) -> bool {
        self.host_reset
    }

    /// Locks the application's queue. Hold the guard across every `vkQueueSubmit` (and `vkQueueWaitIdle`,
    /// `vkQueuePresentKHR`, `vkQueueBindSparse`) to it: the fallback calibration submits from the collector.
    ///
    /// ```no_run
    /// # #[allow(dead_code)]
    /// # fn demo(gpu: &tickline::gpu::vulkan::VulkanGpu, device: &ash::Device,
    /// #         submit: ash::vk::SubmitInfo<'_>, fence: ash::vk::Fence) -> ash::prelude::VkResult<()> {
    /// let queue = gpu.lock_queue();
    /// // SAFETY: the queue is externally synchronised by the guard; `submit` is valid.
    /// unsafe { device.queue_submit(*queue, &[submit], fence) }
    /// # }
    /// ```
    pub fn lock_queue(&self) -> MutexGuard<'_, vk::Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The queue lock where the driver answers query calls on the queue's context (lavapipe): held across a
    /// `vkGetQueryPoolResults` or `vkResetQueryPool`, no submission starts during it. `None` elsewhere. See the
    /// [module docs](self#lavapipe-query-calls-hold-the-queue-lock).
    fn lock_queue_for_queries(&self) -> Option<MutexGuard<'_, vk::Queue>> {
        self.queries_lock_queue.then(|| self.lock_queue())
    }

    /// `vkQueueSubmit` to the application's queue under [`lock_queue`](Self::lock_queue).
    ///
    /// # Safety
    ///
    /// `submits` and `fence` are valid for `vkQueueSubmit` on the backend's queue.
    pub unsafe fn submit(&self, submits: &[vk::SubmitInfo<'_>], fence: vk::Fence) -> Result<(), GpuError> {
        let queue = self.lock_queue();
        // SAFETY: the queue is externally synchronised by `queue` (the lock every submitter takes, by
        // `new`'s contract); the submit infos are valid (this function's contract).
        unsafe { self.owned.device.queue_submit(*queue, submits, fence) }.map_err(api("vkQueueSubmit"))
    }

    /// Reads `out.len()` queries from `first` without waiting: `Some(masked ticks)` where available. The caller
    /// holds [`lock_queue_for_queries`](Self::lock_queue_for_queries)'s guard.
    fn read_raw(&self, first: u32, out: &mut [Option<u64>]) -> Result<(), GpuError> {
        debug_assert!(u64::from(first) + out.len() as u64 <= u64::from(self.slots));
        let mut data = [[0u64; 2]; READ_CHUNK];
        for (index, chunk) in out.chunks_mut(READ_CHUNK).enumerate() {
            let start = first + (index * READ_CHUNK) as u32;
            let data = &mut data[..chunk.len()];
            data.fill([0, 0]);
            // SAFETY: queries start..start + chunk.len() lie in our pool (range checked by the callers, asserted
            // above); `data` holds a (value, availability) pair of u64 per query, as TYPE_64 | WITH_AVAILABILITY
            // writes with a stride of 16 bytes. No WAIT flag: the call never blocks.
            let result = unsafe {
                self.owned
                    .device
                    .get_query_pool_results(self.owned.query_pool, start, data, READ_FLAGS)
            };
            match result {
                Ok(()) | Err(vk::Result::NOT_READY) => {}
                Err(e) => return Err(api("vkGetQueryPoolResults")(e)),
            }
            for (value, [ticks, available]) in chunk.iter_mut().zip(data.iter()) {
                *value = (*available != 0).then_some(ticks & self.mask);
            }
        }
        Ok(())
    }

    fn check_range(&self, first: u32, count: usize) -> Result<(), GpuError> {
        let end = u64::from(first) + count as u64;
        if end > u64::from(self.slots) {
            return Err(invalid(format!("slots {first}..{end} past {}", self.slots)));
        }
        Ok(())
    }

    fn calibrate_extension(
        &self,
        get_calibrated_timestamps: vk::PFN_vkGetCalibratedTimestampsKHR,
        samples: usize,
        budget: Duration,
        out: &mut Vec<CalibrationSample>,
    ) -> Result<(), GpuError> {
        // SAFETY: the entry point was resolved for this device in `check_extension`, which also checked that
        // the extension is offered and both domains are calibrateable; the device is ours and alive.
        unsafe {
            sample_calibrated_timestamps(
                get_calibrated_timestamps,
                self.owned.device.handle(),
                self.mask,
                (samples, budget),
                out,
            )
        }
    }

    /// Reads the probe query without waiting.
    fn read_probe(&self) -> Result<Option<u64>, GpuError> {
        let _queue = self.lock_queue_for_queries();
        let mut data = [[0u64; 2]; 1];
        // SAFETY: query 0 of our one-query probe pool; `data` holds its (value, availability) pair of u64s.
        let result = unsafe {
            self.owned
                .device
                .get_query_pool_results(self.owned.probe_pool, 0, &mut data, READ_FLAGS)
        };
        match result {
            Ok(()) | Err(vk::Result::NOT_READY) => Ok((data[0][1] != 0).then_some(data[0][0] & self.mask)),
            Err(e) => Err(api("vkGetQueryPoolResults")(e)),
        }
    }

    /// Whether our last probe submission has completed; waits up to `timeout`.
    fn settle_probe(&self, probe: &mut Probe, timeout: Duration) -> Result<bool, GpuError> {
        if !probe.pending {
            return Ok(true);
        }
        let timeout_ns = crate::clock::saturating_ns(timeout);
        // SAFETY: the fence is ours and was submitted with the probe (`pending`); only the holder of the probe
        // lock waits on or resets it.
        match unsafe { self.owned.device.wait_for_fences(&[self.owned.fence], true, timeout_ns) } {
            Ok(()) => {
                // SAFETY: as above; the fence is signalled, so no submission uses it.
                unsafe { self.owned.device.reset_fences(&[self.owned.fence]) }.map_err(api("vkResetFences"))?;
                probe.pending = false;
                Ok(true)
            }
            Err(vk::Result::TIMEOUT) => Ok(false),
            Err(e) => Err(api("vkWaitForFences")(e)),
        }
    }

    fn calibrate_submit(
        &self,
        samples: usize,
        budget: Duration,
        out: &mut Vec<CalibrationSample>,
    ) -> Result<(), GpuError> {
        let started = Instant::now();
        let mut probe = self.probe.lock().unwrap_or_else(|e| e.into_inner());
        // A probe left pending by an earlier burst (the queue was busy): its command buffer cannot be submitted
        // again until it completes.
        if !self.settle_probe(&mut probe, Duration::ZERO)? {
            return Ok(());
        }
        for _ in 0..samples {
            if started.elapsed() >= budget {
                break;
            }
            let outcome = self.probe_once(&mut probe, started, budget)?;
            match outcome {
                ProbeOutcome::Sample(sample) => out.push(sample),
                ProbeOutcome::Missed => {}
                ProbeOutcome::Pending => break,
            }
        }
        Ok(())
    }

    /// Submits the probe (not pending: settled by the caller) with the fence.
    fn submit_probe(&self, probe: &mut Probe) -> Result<(), GpuError> {
        let queue = self.lock_queue();
        let submit = vk::SubmitInfo::default().command_buffers(std::slice::from_ref(&probe.command_buffer));
        debug_assert!(!probe.pending);
        // SAFETY: the queue is externally synchronised by `queue` (every submitter holds it, by `new`'s
        // contract); the probe command buffer is recorded and not pending (`settle_probe` saw its last
        // submission complete), and the fence is unsignalled (reset when it was last seen signalled).
        unsafe { self.owned.device.queue_submit(*queue, &[submit], self.owned.fence) }.map_err(api("vkQueueSubmit"))?;
        probe.pending = true;
        Ok(())
    }

    /// One sample: the write happened after `before_ns` (read just before `vkQueueSubmit`) and before the query
    /// read that first saw it available. The bracket includes the submission's latency and the query's
    /// availability latency (lavapipe makes a query available only at the end of its command buffer, some
    /// 30 µs after the write).
    fn probe_once(&self, probe: &mut Probe, started: Instant, budget: Duration) -> Result<ProbeOutcome, GpuError> {
        // Until the GPU runs the probe's reset, the query still shows the previous probe's value.
        let previous = self.read_probe()?;
        let before_ns = monotonic_ns().0;
        self.submit_probe(probe)?;
        let mut seen = None;
        while started.elapsed() < budget {
            let value = self.read_probe()?;
            let now = monotonic_ns().0;
            if value.is_some() && value != previous {
                seen = value.map(|ticks| (ticks, now));
                break;
            }
            std::hint::spin_loop();
        }
        let left = budget.saturating_sub(started.elapsed()).max(PROBE_GRACE);
        if !self.settle_probe(probe, left)? {
            return Ok(ProbeOutcome::Pending);
        }
        Ok(match seen {
            Some((ticks, after_ns)) => {
                ProbeOutcome::Sample(CalibrationSample::from_bracket(ticks, before_ns, after_ns))
            }
            None => ProbeOutcome::Missed,
        })
    }
}

/// Checks that `extension` is offered, enabled (its entry points resolve) and can sample the device clock
/// with `CLOCK_MONOTONIC`; returns the calibrator, or the submit fallback when `CLOCK_MONOTONIC` is not a
/// calibrateable domain.
///
/// # Safety
///
/// As [`VulkanGpu::new`]: the handles are alive and related.
unsafe fn check_extension(
    entry: &ash::Entry,
    instance: &ash::Instance,
    physical_device: vk::PhysicalDevice,
    device: &ash::Device,
    extension: CalibrationExtension,
    name: &str,
) -> Result<(Calibrator, CalibrationPath), GpuError> {
    let ext_name = extension.name().to_string_lossy();
    // SAFETY: the caller's contract: `physical_device` belongs to the live instance.
    let offered = unsafe { instance.enumerate_device_extension_properties(physical_device) }
        .map_err(api("vkEnumerateDeviceExtensionProperties"))?;
    if !offered
        .iter()
        .any(|p| p.extension_name_as_c_str().is_ok_and(|n| n == extension.name()))
    {
        return Err(invalid(format!("{ext_name} claimed, but {name} does not offer it")));
    }
    // SAFETY: the caller's contract: instance and device are alive and related.
    if !unsafe { has_device_fn(instance, device, extension.device_fn()) } {
        return Err(invalid(format!(
            "{ext_name} claimed, but {} does not resolve on the device: the extension was not enabled at \
             vkCreateDevice",
            extension.device_fn().to_string_lossy()
        )));
    }
    // SAFETY: the caller's contract: the instance is alive and was created from `entry`.
    if !unsafe { has_instance_fn(entry, instance, extension.domains_fn()) } {
        return Err(invalid(format!(
            "{ext_name} claimed, but the instance does not resolve {}",
            extension.domains_fn().to_string_lossy()
        )));
    }
    // SAFETY: the domains entry point resolved (checked just above); the physical device belongs to the instance
    // (contract).
    let missing = unsafe { missing_time_domain(entry, instance, physical_device, extension) }
        .map_err(api("vkGetPhysicalDeviceCalibrateableTimeDomains"))?;
    if let Some(reason) = missing {
        return Ok((Calibrator::Submit, CalibrationPath::Submit { reason }));
    }
    // SAFETY: the device entry point resolved (checked above).
    let get_calibrated_timestamps = unsafe { calibrated_timestamps_fn(instance, device, extension) };
    Ok((
        Calibrator::Extension {
            get_calibrated_timestamps,
        },
        CalibrationPath::Extension(extension),
    ))
}

/// Why `extension` cannot calibrate the device clock against `CLOCK_MONOTONIC` (a domain it does not offer),
/// or `None` when it can.
///
/// # Safety
///
/// `instance` is alive, was created from `entry` and resolves `extension`'s physical-device domains entry
/// point; `physical` belongs to it.
pub(crate) unsafe fn missing_time_domain(
    entry: &ash::Entry,
    instance: &ash::Instance,
    physical: vk::PhysicalDevice,
    extension: CalibrationExtension,
) -> Result<Option<String>, vk::Result> {
    // SAFETY: the caller's contract: the entry point resolves, so ash's loader finds it too.
    let domains = unsafe {
        match extension {
            CalibrationExtension::Khr => ash::khr::calibrated_timestamps::Instance::new(entry, instance)
                .get_physical_device_calibrateable_time_domains(physical),
            CalibrationExtension::Ext => ash::ext::calibrated_timestamps::Instance::new(entry, instance)
                .get_physical_device_calibrateable_time_domains(physical),
        }
    }?;
    let ext_name = extension.name().to_string_lossy();
    Ok([
        (vk::TimeDomainKHR::DEVICE, "DEVICE"),
        (vk::TimeDomainKHR::CLOCK_MONOTONIC, "CLOCK_MONOTONIC"),
    ]
    .into_iter()
    .find(|(domain, _)| !domains.contains(domain))
    .map(|(_, domain_name)| format!("{ext_name} cannot calibrate the {domain_name} domain (offers {domains:?})")))
}

/// `extension`'s `vkGetCalibratedTimestamps*` for `device`.
///
/// # Safety
///
/// The entry point resolves on `device` (the extension was enabled at `vkCreateDevice`), so ash's loader
/// stores it rather than its panicking stub.
pub(crate) unsafe fn calibrated_timestamps_fn(
    instance: &ash::Instance,
    device: &ash::Device,
    extension: CalibrationExtension,
) -> vk::PFN_vkGetCalibratedTimestampsKHR {
    match extension {
        CalibrationExtension::Khr => {
            ash::khr::calibrated_timestamps::Device::new(instance, device)
                .fp()
                .get_calibrated_timestamps_khr
        }
        CalibrationExtension::Ext => {
            ash::ext::calibrated_timestamps::Device::new(instance, device)
                .fp()
                .get_calibrated_timestamps_ext
        }
    }
}

impl Drop for VulkanGpu {
    fn drop(&mut self) {
        // Our probe may still be pending (a burst ran out of budget): destroying its fence or command pool now
        // would be invalid. Wait without a time limit; a lost device returns at once with an error.
        let probe = self.probe.get_mut().unwrap_or_else(|e| e.into_inner());
        if probe.pending {
            // SAFETY: the fence is ours and was submitted with the pending probe; the device is alive (`new`'s
            // contract).
            let _ = unsafe { self.owned.device.wait_for_fences(&[self.owned.fence], true, u64::MAX) };
            probe.pending = false;
        }
        // `owned` drops next and destroys the pools, the command pool and the fence.
    }
}

impl GpuBackend for VulkanGpu {
    type Commands = vk::CommandBuffer;

    fn info(&self) -> GpuDeviceInfo {
        self.info.clone()
    }

    #[inline]
    fn write_timestamp(&self, commands: &vk::CommandBuffer, slot: u32) {
        debug_assert!(slot < self.slots, "slot {slot} of {}", self.slots);
        debug_assert_ne!(*commands, vk::CommandBuffer::null());
        let stage = if slot % 2 == 0 {
            self.begin_stage
        } else {
            self.end_stage
        };
        // SAFETY: `commands` is a command buffer of our device in the recording state, recorded only by this
        // thread, outside a render pass when host reset is off (`VulkanGpu::new`'s contract); `slot` is a
        // query of our pool (asserted above; tickline hands out slots below `timestamp_slots`), recycled since
        // its last write (the trait's contract): reset on the host, or by the `vkCmdResetQueryPool` recorded
        // right before the write, which Vulkan orders before it (query commands on one query run in
        // submission order).
        unsafe {
            if !self.host_reset {
                self.owned
                    .device
                    .cmd_reset_query_pool(*commands, self.owned.query_pool, slot, 1);
            }
            self.owned
                .device
                .cmd_write_timestamp(*commands, stage, self.owned.query_pool, slot);
        }
    }

    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        self.check_range(first, out.len())?;
        let mut raw = [None; READ_CHUNK];
        // Before `stale`: the order every path takes (queue, then stale).
        let _queue = self.lock_queue_for_queries();
        let stale = self.stale.as_ref().map(|s| s.lock().unwrap_or_else(|e| e.into_inner()));
        for (index, chunk) in out.chunks_mut(READ_CHUNK).enumerate() {
            let start = first + (index * READ_CHUNK) as u32;
            let raw = &mut raw[..chunk.len()];
            self.read_raw(start, raw)?;
            for (offset, (value, ticks)) in chunk.iter_mut().zip(raw.iter()).enumerate() {
                let previous = stale.as_ref().and_then(|s| s[start as usize + offset]);
                // Lavapipe can report a timestamp query available with the value 0 before its queue has written
                // it (seen under load, tests/it/wgpu.rs). No device clock reads 0 after boot except once per wrap
                // of its valid bits, so 0 counts as not written yet: at worst such a scope waits to be lost.
                *value = ticks.filter(|&t| t != 0 && Some(t) != previous).map(GpuTicks);
            }
        }
        Ok(())
    }

    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        self.check_range(first, count as usize)?;
        let _queue = self.lock_queue_for_queries();
        match &self.stale {
            None => {
                // SAFETY: host reset is enabled (`new`'s contract, checked against the device's support); the
                // queries lie in our pool (range checked above) and their writes have completed: tickline
                // recycles a pair only after reading both timestamps, or one never written.
                unsafe { self.owned.device.reset_query_pool(self.owned.query_pool, first, count) };
            }
            Some(stale) => {
                // The command buffer's reset will make them unavailable; until it runs they read as now.
                let mut stale = stale.lock().unwrap_or_else(|e| e.into_inner());
                let mut raw = [None; READ_CHUNK];
                let mut start = first;
                while start < first + count {
                    let n = (first + count - start).min(READ_CHUNK as u32);
                    let raw = &mut raw[..n as usize];
                    self.read_raw(start, raw)?;
                    stale[start as usize..(start + n) as usize].copy_from_slice(raw);
                    start += n;
                }
            }
        }
        Ok(())
    }

    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        match self.calibrator {
            Calibrator::Extension {
                get_calibrated_timestamps,
            } => self.calibrate_extension(get_calibrated_timestamps, samples, budget, out),
            Calibrator::Submit => self.calibrate_submit(samples, budget, out),
        }
    }
}

/// Up to `samples` samples of `[DEVICE, CLOCK_MONOTONIC]` through `vkGetCalibratedTimestamps*` within `budget`,
/// device ticks masked to the queue's valid bits; shared by [`VulkanGpu`] and the wgpu profiler's Vulkan route.
///
/// # Safety
///
/// `get_calibrated_timestamps` was resolved for `device` with a calibrated-timestamps extension enabled whose
/// time domains include `DEVICE` and `CLOCK_MONOTONIC`, and `device` stays alive during the call.
pub(crate) unsafe fn sample_calibrated_timestamps(
    get_calibrated_timestamps: vk::PFN_vkGetCalibratedTimestampsKHR,
    device: vk::Device,
    mask: u64,
    (samples, budget): (usize, Duration),
    out: &mut Vec<CalibrationSample>,
) -> Result<(), GpuError> {
    let infos = [
        vk::CalibratedTimestampInfoKHR::default().time_domain(vk::TimeDomainKHR::DEVICE),
        vk::CalibratedTimestampInfoKHR::default().time_domain(vk::TimeDomainKHR::CLOCK_MONOTONIC),
    ];
    let started = Instant::now();
    for _ in 0..samples {
        if started.elapsed() >= budget {
            break;
        }
        let mut timestamps = [0u64; 2];
        let mut max_deviation = 0u64;
        // SAFETY: the caller's contract (entry point resolved for this live device, both domains calibrateable);
        // `infos` and `timestamps` hold 2 elements each, as the count says, and outlive the call.
        let result = unsafe {
            (get_calibrated_timestamps)(
                device,
                infos.len() as u32,
                infos.as_ptr(),
                timestamps.as_mut_ptr(),
                &mut max_deviation,
            )
        };
        if result != vk::Result::SUCCESS {
            return Err(api("vkGetCalibratedTimestamps")(result));
        }
        out.push(CalibrationSample {
            source_ticks: timestamps[0] & mask,
            reference_ns: timestamps[1],
            // Never zero (the proposal: at least the longest tick of the domains sampled).
            max_deviation_ns: max_deviation.max(1),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn family(bits: u32) -> vk::QueueFamilyProperties {
        vk::QueueFamilyProperties {
            queue_flags: vk::QueueFlags::COMPUTE,
            queue_count: 1,
            timestamp_valid_bits: bits,
            ..Default::default()
        }
    }

    #[test]
    fn queue_families_without_timestamps_are_refused() {
        let families = [family(64), family(0), family(36)];
        assert_eq!(family_valid_bits(&families, 0).unwrap(), 64);
        assert_eq!(family_valid_bits(&families, 2).unwrap(), 36);
        assert!(matches!(
            family_valid_bits(&families, 1),
            Err(GpuError::NoTimestamps { .. })
        ));
        assert!(matches!(family_valid_bits(&families, 3), Err(GpuError::Invalid { .. })));
        assert!(matches!(
            family_valid_bits(&[family(65)], 0),
            Err(GpuError::Invalid { .. })
        ));
    }

    #[test]
    fn options_are_checked() {
        assert!(check_options(&VulkanOptions::default()).is_ok());
        for bad in [
            VulkanOptions {
                timestamp_slots: 0,
                ..Default::default()
            },
            VulkanOptions {
                timestamp_slots: 7,
                ..Default::default()
            },
            VulkanOptions {
                timestamp_slots: MAX_SLOTS + 2,
                ..Default::default()
            },
            VulkanOptions {
                begin_stage: vk::PipelineStageFlags::TOP_OF_PIPE | vk::PipelineStageFlags::TRANSFER,
                ..Default::default()
            },
            VulkanOptions {
                end_stage: vk::PipelineStageFlags::empty(),
                ..Default::default()
            },
        ] {
            assert!(matches!(check_options(&bad), Err(GpuError::Invalid { .. })), "{bad:?}");
        }
    }

    #[test]
    fn read_flags_never_wait() {
        assert!(READ_FLAGS.contains(vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WITH_AVAILABILITY));
        assert!(!READ_FLAGS.contains(vk::QueryResultFlags::WAIT));
        assert!(!READ_FLAGS.contains(vk::QueryResultFlags::PARTIAL));
    }
}
