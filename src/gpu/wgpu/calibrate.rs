//! How a [`WgpuProfiler`](super::WgpuProfiler) samples the device clock against `CLOCK_MONOTONIC`.
//!
//! - **Vulkan with a calibrated-timestamps extension** (the device was opened through
//!   [`request_device`](super::request_device), or by hand with [`open_device`](super::open_device)):
//!   `vkGetCalibratedTimestamps*` of `[DEVICE, CLOCK_MONOTONIC]` on the device's raw handle (`as_hal`), with the
//!   driver's `maxDeviation`: a few ns. It never touches the queue.
//! - **Everywhere else** (Metal, DX12, GL, Vulkan without the extension): a probe submitted to the application's
//!   queue writes one timestamp, resolved and mapped with the same machinery as the scopes; the write happened
//!   after `CLOCK_MONOTONIC` was read just before `Queue::submit` and before wgpu's mapping callback ran (the
//!   collector polls the device without blocking to run it), so the sample's deviation is half that bracket:
//!   honest but wide (tens to hundreds of µs, more behind queued work; the calibration keeps the tightest).
//!
//! With the extension, one probe at setup checks that what wgpu resolves is the clock the extension samples:
//! with `InstanceFlags::AUTOMATIC_TIMESTAMP_NORMALIZATION` wgpu rescales resolved timestamps to ns, which on a
//! device whose period is not 1 ns no longer matches; the profiler then uses the probe.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ash::vk;
use wgpu_hal as hal;

use crate::calibration::CalibrationSample;
use crate::clock::monotonic_ns;
use crate::gpu::vulkan::{calibrated_timestamps_fn, missing_time_domain, CalibrationExtension, CalibrationPath};
use crate::gpu::GpuError;

/// Probe states, set by wgpu's mapping callback (Release) and read by the prober (Acquire).
const WAITING: u8 = 1;
const MAPPED: u8 = 2;
const FAILED: u8 = 3;

/// The calibration in use.
pub(super) enum Calibrator {
    Vulkan(VulkanClock),
    Probe(Mutex<Probe>),
}

impl Calibrator {
    pub(super) fn calibrate(
        &self,
        samples: usize,
        budget: Duration,
        out: &mut Vec<CalibrationSample>,
    ) -> Result<(), GpuError> {
        match self {
            Calibrator::Vulkan(clock) => clock.calibrate(samples, budget, out),
            Calibrator::Probe(probe) => {
                let mut probe = probe.lock().unwrap_or_else(|e| e.into_inner());
                let deadline = Instant::now() + budget;
                for _ in 0..samples {
                    if Instant::now() >= deadline {
                        break;
                    }
                    match probe.once(deadline)? {
                        ProbeOutcome::Sample(sample) => out.push(sample),
                        ProbeOutcome::Missed => {}
                        ProbeOutcome::Pending => break,
                    }
                }
                Ok(())
            }
        }
    }
}

/// `vkGetCalibratedTimestamps*` on the raw handle of the wgpu device's hal device.
pub(super) struct VulkanClock {
    /// The raw device. Alive as long as the profiler's backend: it holds a `wgpu::Device`, which keeps wgpu-core's
    /// device, and with it the hal device and its `VkDevice`, alive (`Device::destroy` only marks it lost).
    device: vk::Device,
    get_calibrated_timestamps: vk::PFN_vkGetCalibratedTimestampsKHR,
    mask: u64,
}

/// What the Vulkan route found: the clock, or why the profiler probes instead.
pub(super) struct VulkanRoute {
    pub(super) clock: Result<(VulkanClock, CalibrationExtension), String>,
    /// The queue family's `timestampValidBits`.
    pub(super) valid_bits: u32,
}

/// The Vulkan route for `device`, or `None` when wgpu does not run it on Vulkan.
pub(super) fn vulkan_route(device: &wgpu::Device) -> Option<VulkanRoute> {
    // SAFETY: the hal device is only read here (handles, properties, entry points), never destroyed or recorded
    // into; the guard keeps it alive meanwhile.
    let hal_device = unsafe { device.as_hal::<hal::api::Vulkan>() }?;
    let shared = hal_device.shared_instance();
    let (entry, instance, physical) = (shared.entry(), shared.raw_instance(), hal_device.raw_physical_device());
    // SAFETY: the instance is alive (the hal device holds it) and `physical` is the device's own.
    let families = unsafe { instance.get_physical_device_queue_family_properties(physical) };
    let valid_bits = families
        .get(hal_device.queue_family_index() as usize)
        .map_or(64, |f| f.timestamp_valid_bits)
        .clamp(1, 64);
    let mask = if valid_bits == 64 {
        u64::MAX
    } else {
        (1 << valid_bits) - 1
    };
    let enabled = hal_device.enabled_device_extensions();
    let extension = [CalibrationExtension::Khr, CalibrationExtension::Ext]
        .into_iter()
        .find(|e| enabled.contains(&e.name()));
    let clock = match extension {
        None => Err(
            "the wgpu device was opened without VK_KHR/EXT_calibrated_timestamps (open it with \
             tickline::gpu::wgpu::request_device to have them where offered)"
                .to_owned(),
        ),
        Some(extension) => {
            // SAFETY: the handles come from one live hal device (held by the guard, and afterwards by the
            // profiler's `wgpu::Device`, which the backend owning the clock holds), with the extension enabled.
            unsafe { VulkanClock::new(entry, instance, physical, hal_device.raw_device(), extension, mask) }
                .map(|clock| (clock, extension))
        }
    };
    Some(VulkanRoute { clock, valid_bits })
}

impl VulkanClock {
    /// Resolves the extension's entry points and checks that it calibrates `DEVICE` with `CLOCK_MONOTONIC`.
    ///
    /// # Safety
    ///
    /// The handles belong to one live device (instance from `entry`, `physical` the device's) with `extension`
    /// enabled, and the device outlives the clock.
    unsafe fn new(
        entry: &ash::Entry,
        instance: &ash::Instance,
        physical: vk::PhysicalDevice,
        device: &ash::Device,
        extension: CalibrationExtension,
        mask: u64,
    ) -> Result<VulkanClock, String> {
        let name = extension.name().to_string_lossy();
        let (domains_fn, device_fn) = match extension {
            CalibrationExtension::Khr => (
                c"vkGetPhysicalDeviceCalibrateableTimeDomainsKHR",
                c"vkGetCalibratedTimestampsKHR",
            ),
            CalibrationExtension::Ext => (
                c"vkGetPhysicalDeviceCalibrateableTimeDomainsEXT",
                c"vkGetCalibratedTimestampsEXT",
            ),
        };
        // SAFETY: the caller's contract: the instance is alive and was created from `entry`; the names are CStrs.
        if unsafe { entry.get_instance_proc_addr(instance.handle(), domains_fn.as_ptr()) }.is_none() {
            return Err(format!(
                "{name} is enabled but the instance does not resolve {domains_fn:?}"
            ));
        }
        // SAFETY: as above; the device was created from the instance.
        if unsafe { instance.get_device_proc_addr(device.handle(), device_fn.as_ptr()) }.is_none() {
            return Err(format!(
                "{name} is enabled but the device does not resolve {device_fn:?}"
            ));
        }
        // SAFETY: the domains entry point resolved (checked above); `physical` belongs to the instance (contract).
        let missing = unsafe { missing_time_domain(entry, instance, physical, extension) }
            .map_err(|e| format!("vkGetPhysicalDeviceCalibrateableTimeDomains failed: {e}"))?;
        if let Some(reason) = missing {
            return Err(reason);
        }
        // SAFETY: the device entry point resolved (checked above).
        let get_calibrated_timestamps = unsafe { calibrated_timestamps_fn(instance, device, extension) };
        Ok(VulkanClock {
            device: device.handle(),
            get_calibrated_timestamps,
            mask,
        })
    }

    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        // SAFETY: the entry point was resolved for this device in `new`, which also checked that both domains are
        // calibrateable; the device is alive (the backend holds its `wgpu::Device`).
        unsafe {
            crate::gpu::vulkan::sample_calibrated_timestamps(
                self.get_calibrated_timestamps,
                self.device,
                self.mask,
                (samples, budget),
                out,
            )
        }
    }
}

/// When the probe's mapping callback ran, and how.
#[derive(Default)]
struct ProbeState {
    outcome: AtomicU8,
    at_ns: AtomicU64,
}

/// A timestamp written by a tiny submission of tickline's own on the application's queue, resolved and mapped.
pub(super) struct Probe {
    device: wgpu::Device,
    queue: wgpu::Queue,
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    staging: wgpu::Buffer,
    /// `TIMESTAMP_QUERY_INSIDE_ENCODERS`: a bare `write_timestamp`; otherwise an empty compute pass's beginning.
    inside_encoders: bool,
    mask: u64,
    state: Arc<ProbeState>,
    /// A submitted probe whose mapping has not resolved yet (a burst ran out of budget): waited for first.
    pending: bool,
}

/// What one probe gave.
pub(super) enum ProbeOutcome {
    Sample(CalibrationSample),
    /// The probe completed without a usable value.
    Missed,
    /// Still in flight at the deadline (the queue is busy): the next burst checks it first.
    Pending,
}

impl Probe {
    pub(super) fn new(device: &wgpu::Device, queue: &wgpu::Queue, mask: u64) -> Probe {
        let buffer = |label, usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: u64::from(wgpu::QUERY_SIZE),
                usage,
                mapped_at_creation: false,
            })
        };
        Probe {
            device: device.clone(),
            queue: queue.clone(),
            set: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("tickline calibration probe"),
                ty: wgpu::QueryType::Timestamp,
                count: 1,
            }),
            resolve: buffer(
                "tickline probe resolve",
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            ),
            staging: buffer(
                "tickline probe read-back",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            inside_encoders: device
                .features()
                .contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS),
            mask,
            state: Arc::new(ProbeState::default()),
            pending: false,
        }
    }

    /// Polls (without blocking) until the submitted probe's mapping resolves or `deadline` passes: the value and
    /// when the callback ran, `Some(None)` when it resolved unusable, `None` while still pending.
    fn settle(&mut self, deadline: Instant) -> Option<Option<(u64, u64)>> {
        if !self.pending {
            return Some(None);
        }
        loop {
            // Acquire: pairs with the Release stores in the mapping callback.
            match self.state.outcome.load(Ordering::Acquire) {
                MAPPED => {
                    let value = self
                        .staging
                        .slice(..)
                        .get_mapped_range()
                        .ok()
                        .map(|bytes| u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) & self.mask);
                    self.staging.unmap();
                    self.pending = false;
                    let at_ns = self.state.at_ns.load(Ordering::Acquire);
                    return Some(value.filter(|&v| v != 0).map(|v| (v, at_ns)));
                }
                FAILED => {
                    self.pending = false;
                    return Some(None);
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return None;
            }
            let _ = self.device.poll(wgpu::PollType::Poll);
            std::thread::yield_now();
        }
    }

    /// One bracketed sample, or why not, within `deadline`.
    pub(super) fn once(&mut self, deadline: Instant) -> Result<ProbeOutcome, GpuError> {
        // A probe left pending by an earlier burst: its read-back buffer cannot be used again until it resolves.
        if self.pending {
            if self.settle(deadline).is_none() {
                return Ok(ProbeOutcome::Pending);
            }
            if Instant::now() >= deadline {
                return Ok(ProbeOutcome::Missed);
            }
        }
        let mut encoder = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("tickline calibration probe"),
        });
        if self.inside_encoders {
            encoder.write_timestamp(&self.set, 0);
        } else {
            drop(encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("tickline calibration probe"),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &self.set,
                    beginning_of_pass_write_index: Some(0),
                    end_of_pass_write_index: None,
                }),
            }));
        }
        encoder.resolve_query_set(&self.set, 0..1, &self.resolve, 0);
        encoder.copy_buffer_to_buffer(&self.resolve, 0, &self.staging, 0, u64::from(wgpu::QUERY_SIZE));
        // Relaxed: nothing reads the state until the callback below is registered.
        self.state.outcome.store(WAITING, Ordering::Relaxed);
        let state = self.state.clone();
        encoder.map_buffer_on_submit(&self.staging, wgpu::MapMode::Read, .., move |result| {
            // Release (both): publish the time and outcome; pair with the Acquire loads in `settle`.
            state.at_ns.store(monotonic_ns().0, Ordering::Release);
            state
                .outcome
                .store(if result.is_ok() { MAPPED } else { FAILED }, Ordering::Release);
        });
        let commands = encoder.finish();
        let before_ns = monotonic_ns().0;
        self.queue.submit([commands]);
        self.pending = true;
        Ok(match self.settle(deadline) {
            None => ProbeOutcome::Pending,
            Some(None) => ProbeOutcome::Missed,
            Some(Some((ticks, after_ns))) => {
                ProbeOutcome::Sample(CalibrationSample::from_bracket(ticks, before_ns, after_ns))
            }
        })
    }
}

/// Picks the calibration for `device`: the Vulkan extension where wgpu runs on Vulkan and the device has it
/// enabled (checked against one probe), else the probe. Takes a trial sample either way, so a pipeline that
/// cannot read timestamps back fails here, with a clear error, rather than in the collector.
pub(super) fn choose(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    route: Option<VulkanRoute>,
    mask: u64,
) -> Result<(Calibrator, CalibrationPath), GpuError> {
    let mut probe = Probe::new(device, queue, mask);
    let trial = |probe: &mut Probe| -> Result<CalibrationSample, GpuError> {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match probe.once(deadline)? {
                ProbeOutcome::Sample(sample) => return Ok(sample),
                _ if Instant::now() < deadline => continue,
                _ => {
                    return Err(GpuError::Api {
                        call: "wgpu timestamp probe (submit, resolve_query_set, map)",
                        detail: "no timestamp read back within 2 s".into(),
                    })
                }
            }
        }
    };
    let reason = match route.map(|r| r.clock) {
        None => format!(
            "wgpu runs this device on {:?}, which has no calibrated-timestamps API",
            device.adapter_info().backend
        ),
        Some(Err(reason)) => reason,
        Some(Ok((clock, extension))) => {
            let mut bracket = Vec::with_capacity(2);
            let first = clock.calibrate(1, Duration::from_secs(1), &mut bracket);
            let probed = trial(&mut probe)?;
            let second = clock.calibrate(1, Duration::from_secs(1), &mut bracket);
            match (first.and(second), &bracket[..]) {
                (Ok(()), [before, after]) => {
                    let (before, after) = (before.source_ticks, after.source_ticks);
                    if (before..=after).contains(&probed.source_ticks) {
                        return Ok((Calibrator::Vulkan(clock), CalibrationPath::Extension(extension)));
                    }
                    format!(
                        "wgpu resolved a timestamp ({}) outside the extension's device clock reads around it \
                         ({before}..{after}): resolved timestamps are rescaled \
                         (InstanceFlags::AUTOMATIC_TIMESTAMP_NORMALIZATION?)",
                        probed.source_ticks
                    )
                }
                (Err(e), _) => format!("{} is enabled but failed: {e}", extension.name().to_string_lossy()),
                (Ok(()), _) => format!("{} gave no sample", extension.name().to_string_lossy()),
            }
        }
    };
    trial(&mut probe)?;
    Ok((Calibrator::Probe(Mutex::new(probe)), CalibrationPath::Submit { reason }))
}
