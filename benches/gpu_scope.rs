//! What one Vulkan `gpu_scope!` (begin + end) costs the recording thread, against the floor: a bare pair of
//! `vkCmdWriteTimestamp` recorded into the same kind of command buffer.
//!
//! Group `vulkan_gpu_scope`, per iteration:
//! - `bare_write_timestamp_pair`: `vkCmdWriteTimestamp` at TOP_OF_PIPE and at BOTTOM_OF_PIPE into a pool of
//!   the bench's own (recorded only: the command buffer is reset, never submitted).
//! - `gpu_scope_host_reset`: `tickline::gpu_scope!(queue, &commands, "bench")` dropped at once, on a backend
//!   with `hostQueryReset` (two `vkCmdWriteTimestamp`, a pair taken from the free list, a begin record pushed).
//! - `gpu_scope_command_reset`: the same without `hostQueryReset` (each write is preceded by a
//!   `vkCmdResetQueryPool` of its query).
//!
//! Scopes are timed in chunks of `CHUNK` (`iter_custom`): between chunks the timer stops, the command buffer is
//! ended, submitted and waited for, and the timeline is flushed so the collector reads the timestamps and
//! returns every pair; the command buffer is reset before the next chunk, so it never grows without bound and
//! no scope ever finds the pool empty (the bench asserts none starved). Runs on lavapipe (Mesa's software
//! driver), where recording a command costs what a real driver's user-mode recording does: a few stores into
//! a command stream. Without a Vulkan device it prints `SKIP` and exits.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use tickline::gpu::vulkan::ash::{self, vk};
use tickline::gpu::vulkan::{find_timestamp_queue, load_entry, CalibrationExtension, VulkanGpu, VulkanOptions};
use tickline::gpu::{GpuDevice, GpuQueue};
use tickline::Timeline;

/// Scopes per submission: the pool holds twice as many timestamps.
const CHUNK: u64 = 4096;

struct Vulkan {
    entry: ash::Entry,
    instance: ash::Instance,
    physical: vk::PhysicalDevice,
    family: u32,
    device: ash::Device,
    queue: vk::Queue,
    host_query_reset: bool,
    extension: Option<CalibrationExtension>,
}

impl Vulkan {
    fn new() -> Result<Vulkan, String> {
        let entry = load_entry().map_err(|e| e.to_string())?;
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_2);
        // SAFETY: the loader is open; the create info outlives the call.
        let instance =
            unsafe { entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None) }
                .map_err(|e| format!("vkCreateInstance: {e}"))?;
        // SAFETY: the instance is alive (and leaks if the bench gives up: it exits right after).
        let (physical, family) =
            unsafe { find_timestamp_queue(&instance, vk::QueueFlags::COMPUTE) }.map_err(|e| e.to_string())?;
        // SAFETY: `physical` belongs to the instance; the feature chain outlives the call.
        let (host_query_reset, extension) = unsafe {
            let properties = instance.get_physical_device_properties(physical);
            let mut host_reset = vk::PhysicalDeviceHostQueryResetFeatures::default();
            let mut features = vk::PhysicalDeviceFeatures2::default().push_next(&mut host_reset);
            instance.get_physical_device_features2(physical, &mut features);
            let offered = instance
                .enumerate_device_extension_properties(physical)
                .unwrap_or_default();
            let extension = [CalibrationExtension::Khr, CalibrationExtension::Ext]
                .into_iter()
                .find(|ext| offered.iter().any(|e| e.extension_name_as_c_str() == Ok(ext.name())));
            (
                host_reset.host_query_reset == vk::TRUE && properties.api_version >= vk::API_VERSION_1_2,
                extension,
            )
        };
        if !host_query_reset {
            return Err("the device has no hostQueryReset".into());
        }
        // Two backends share the one queue, each with its own lock: only with an extension does neither
        // collector submit a calibration probe.
        if extension.is_none() {
            return Err("the device has no calibrated-timestamps extension".into());
        }
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&priorities)];
        let names: Vec<_> = extension.map(|e| e.name().as_ptr()).into_iter().collect();
        let mut vulkan12 = vk::PhysicalDeviceVulkan12Features::default().host_query_reset(true);
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&names)
            .push_next(&mut vulkan12);
        // SAFETY: `physical` belongs to the instance; the create info and what it points to outlive the call.
        let device =
            unsafe { instance.create_device(physical, &info, None) }.map_err(|e| format!("vkCreateDevice: {e}"))?;
        // SAFETY: the device has one queue of `family`.
        let queue = unsafe { device.get_device_queue(family, 0) };
        Ok(Vulkan {
            entry,
            instance,
            physical,
            family,
            device,
            queue,
            host_query_reset,
            extension,
        })
    }

    fn backend(&self, host_query_reset: bool) -> VulkanGpu {
        let options = VulkanOptions {
            timestamp_slots: 2 * CHUNK as u32,
            host_query_reset: host_query_reset && self.host_query_reset,
            calibrated_timestamps: self.extension,
            ..VulkanOptions::default()
        };
        // SAFETY: the handles are related and outlive the backends (dropped before `self`); the queue is used
        // only by this thread (the backends calibrate with the extension, checked in `new`, so their collector
        // never submits); scopes go into the bench's command buffer outside render passes, each recording
        // submitted once and waited for.
        unsafe {
            VulkanGpu::new(
                &self.entry,
                &self.instance,
                self.physical,
                &self.device,
                self.family,
                self.queue,
                options,
            )
        }
        .expect("the backend sets up")
    }
}

impl Drop for Vulkan {
    fn drop(&mut self) {
        // SAFETY: every object created from the device was destroyed (backends and `Commands` drop first).
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// A resettable command buffer and a fence.
struct Commands<'a> {
    device: &'a ash::Device,
    pool: vk::CommandPool,
    buffer: vk::CommandBuffer,
    fence: vk::Fence,
}

impl<'a> Commands<'a> {
    fn new(vulkan: &'a Vulkan) -> Self {
        let device = &vulkan.device;
        // SAFETY: the device is alive; the create infos outlive the calls.
        unsafe {
            let pool = device
                .create_command_pool(
                    &vk::CommandPoolCreateInfo::default()
                        .queue_family_index(vulkan.family)
                        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                    None,
                )
                .unwrap();
            let buffer = device
                .allocate_command_buffers(
                    &vk::CommandBufferAllocateInfo::default()
                        .command_pool(pool)
                        .command_buffer_count(1),
                )
                .unwrap()[0];
            let fence = device.create_fence(&vk::FenceCreateInfo::default(), None).unwrap();
            Commands {
                device,
                pool,
                buffer,
                fence,
            }
        }
    }

    /// Resets the command buffer (empty again) and begins recording.
    fn begin(&self) {
        // SAFETY: the buffer is ours, not pending (every submission is waited for), its pool allows resets.
        unsafe {
            self.device
                .reset_command_buffer(self.buffer, vk::CommandBufferResetFlags::RELEASE_RESOURCES)
                .unwrap();
            self.device
                .begin_command_buffer(
                    self.buffer,
                    &vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
                )
                .unwrap();
        }
    }

    /// Ends the command buffer, submits it through `gpu`'s queue lock and waits.
    fn submit_and_wait(&self, gpu: &VulkanGpu) {
        // SAFETY: the buffer is recording; the fence is ours and unsignalled (reset after each wait).
        unsafe {
            self.device.end_command_buffer(self.buffer).unwrap();
            let submit = vk::SubmitInfo::default().command_buffers(std::slice::from_ref(&self.buffer));
            gpu.submit(&[submit], self.fence).unwrap();
            self.device.wait_for_fences(&[self.fence], true, u64::MAX).unwrap();
            self.device.reset_fences(&[self.fence]).unwrap();
        }
    }

    /// Ends the command buffer without submitting it.
    fn end(&self) {
        // SAFETY: the buffer is recording.
        unsafe { self.device.end_command_buffer(self.buffer).unwrap() };
    }
}

impl Drop for Commands<'_> {
    fn drop(&mut self) {
        // SAFETY: nothing of ours is pending (every submission was waited for); the objects are ours.
        unsafe {
            self.device.destroy_fence(self.fence, None);
            self.device.destroy_command_pool(self.pool, None);
        }
    }
}

/// Times `iters` scopes in chunks; between chunks (untimed) submits, waits, and flushes so every pair returns.
fn time_scopes(
    iters: u64,
    timeline: &Timeline,
    gpu: &GpuDevice<VulkanGpu>,
    queue: &GpuQueue<VulkanGpu>,
    commands: &Commands<'_>,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        commands.begin();
        let start = Instant::now();
        for _ in 0..n {
            drop(black_box(tickline::gpu_scope!(queue, &commands.buffer, "bench")));
        }
        total += start.elapsed();
        commands.submit_and_wait(gpu.backend());
        timeline.flush().unwrap();
        left -= n;
    }
    total
}

fn main() {
    let vulkan = match Vulkan::new() {
        Ok(vulkan) => vulkan,
        Err(reason) => {
            eprintln!("SKIP: gpu_scope bench: {reason}");
            return;
        }
    };
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let commands = Commands::new(&vulkan);
    let timeline = Timeline::builder().start().unwrap();
    let host = timeline.gpu(vulkan.backend(true)).unwrap();
    let host_queue = host.queue("bench").unwrap();
    let cmd = timeline.gpu(vulkan.backend(false)).unwrap();
    let cmd_queue = cmd.queue("bench").unwrap();
    eprintln!(
        "gpu_scope bench: calibration {:?}; host reset {}",
        host.backend().calibration_path(),
        host.backend().host_query_reset()
    );

    // Before measuring: a chunk of scopes comes back as slices, and their pairs return.
    for (gpu, queue) in [(&host, &host_queue), (&cmd, &cmd_queue)] {
        let before = timeline.stats().gpu_scopes;
        time_scopes(2 * CHUNK, &timeline, gpu, queue, &commands);
        let stats = timeline.stats();
        assert_eq!(stats.gpu_scopes - before, 2 * CHUNK, "{stats:?}");
        assert_eq!((stats.gpu_lost_scopes, gpu.starved_scopes()), (0, 0), "{stats:?}");
    }

    // The floor's own pool: recorded, never submitted.
    // SAFETY: the device is alive; the create info outlives the call.
    let floor_pool = unsafe {
        vulkan.device.create_query_pool(
            &vk::QueryPoolCreateInfo::default()
                .query_type(vk::QueryType::TIMESTAMP)
                .query_count(2),
            None,
        )
    }
    .unwrap();

    let mut group = c.benchmark_group("vulkan_gpu_scope");
    group.bench_function("bare_write_timestamp_pair", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(CHUNK);
                commands.begin();
                let start = Instant::now();
                for _ in 0..n {
                    // SAFETY: our command buffer is recording; the pool is ours and has queries 0 and 1. The
                    // buffer is never submitted, so the writes' execution-time rules do not apply.
                    unsafe {
                        vulkan.device.cmd_write_timestamp(
                            commands.buffer,
                            vk::PipelineStageFlags::TOP_OF_PIPE,
                            black_box(floor_pool),
                            0,
                        );
                        vulkan.device.cmd_write_timestamp(
                            commands.buffer,
                            vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                            black_box(floor_pool),
                            1,
                        );
                    }
                }
                total += start.elapsed();
                commands.end();
                left -= n;
            }
            total
        })
    });
    group.bench_function("gpu_scope_host_reset", |b| {
        b.iter_custom(|iters| time_scopes(iters, &timeline, &host, &host_queue, &commands))
    });
    group.bench_function("gpu_scope_command_reset", |b| {
        b.iter_custom(|iters| time_scopes(iters, &timeline, &cmd, &cmd_queue, &commands))
    });
    group.finish();

    let stats = timeline.stats();
    eprintln!(
        "gpu_scope bench: {} scopes, {} lost, {} starved, {} dropped records",
        stats.gpu_scopes,
        stats.gpu_lost_scopes,
        host.starved_scopes() + cmd.starved_scopes(),
        stats.dropped_records
    );
    assert_eq!(
        host.starved_scopes() + cmd.starved_scopes(),
        0,
        "a scope found no free pair"
    );
    assert_eq!(stats.dropped_records, 0);
    drop((host_queue, host, cmd_queue, cmd));
    timeline.shutdown().unwrap();
    drop(commands);
    // SAFETY: the pool is ours; the command buffer that recorded into it was never submitted.
    unsafe { vulkan.device.destroy_query_pool(floor_pool, None) };
    c.final_summary();
}
