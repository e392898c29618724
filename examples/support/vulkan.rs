//! Vulkan set-up shared by the Vulkan examples, the Vulkan integration tests and `benches/gpu_scope.rs` (each
//! includes this file with `#[path]`; an example's subfolder without a `main.rs` is not itself an example):
//!
//! - [`Vulkan`]: an instance and a device with a queue that writes timestamps (compute, for every user so far), with
//!   `hostQueryReset` and a calibrated-timestamps extension as [`Wants`] says: where offered (the examples),
//!   required (the bench), or one exact configuration (the tests).
//! - [`Recorder`]: a resettable command buffer and a fence, submitted through the backend's queue lock.
//! - [`Work`]: a [`Recorder`] and two buffers to fill and copy, a little real work to time.

#![allow(dead_code)]

use std::error::Error;
use std::ffi::{c_char, CStr};
use std::ops::Deref;

use tickline::gpu::vulkan::ash::{self, vk};
use tickline::gpu::vulkan::{find_timestamp_queue, load_entry, CalibrationExtension, VulkanGpu, VulkanOptions};
use tickline::gpu::GpuError;

/// Bytes per buffer of the examples' [`Work`]: 4 MiB.
pub const SIZE: u64 = 4 << 20;

/// Whether [`Vulkan::new`] enables a capability of the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Never.
    Off,
    /// Where the device offers it.
    IfOffered,
    /// Always: a device that does not offer it is refused, saying so.
    Required,
}

impl Want {
    /// Whether to enable a capability the device offers (`offered`) or not; `Err(missing())` when it is required.
    fn enable(self, offered: bool, missing: impl FnOnce() -> String) -> Result<bool, String> {
        match self {
            Want::Off => Ok(false),
            Want::IfOffered => Ok(offered),
            Want::Required if offered => Ok(true),
            Want::Required => Err(missing()),
        }
    }
}

/// What [`Vulkan::new`] looks for and enables on the device.
#[derive(Clone, Copy, Debug)]
pub struct Wants {
    /// What the queue must do besides writing timestamps (the first such family of the first such device).
    pub queue: vk::QueueFlags,
    /// `hostQueryReset` (Vulkan 1.2).
    pub host_query_reset: Want,
    /// A calibrated-timestamps extension.
    pub calibrated_timestamps: Want,
    /// Which calibrated-timestamps extension counts: `None`, KHR where offered, else EXT; `Some`, only that one.
    pub calibration_extension: Option<CalibrationExtension>,
}

impl Wants {
    /// Both where the device offers them.
    pub const OFFERED: Wants = Wants {
        queue: vk::QueueFlags::COMPUTE,
        host_query_reset: Want::IfOffered,
        calibrated_timestamps: Want::IfOffered,
        calibration_extension: None,
    };

    /// Both, or the device is refused.
    pub const REQUIRED: Wants = Wants {
        queue: vk::QueueFlags::COMPUTE,
        host_query_reset: Want::Required,
        calibrated_timestamps: Want::Required,
        calibration_extension: None,
    };

    /// Exactly this configuration: a device that cannot have it is refused.
    pub fn exactly(host_query_reset: bool, extension: Option<CalibrationExtension>) -> Wants {
        let want = |on: bool| if on { Want::Required } else { Want::Off };
        Wants {
            queue: vk::QueueFlags::COMPUTE,
            host_query_reset: want(host_query_reset),
            calibrated_timestamps: want(extension.is_some()),
            calibration_extension: extension,
        }
    }
}

/// An instance and a device with one queue that writes timestamps, destroyed on drop.
pub struct Vulkan {
    pub entry: ash::Entry,
    pub instance: ash::Instance,
    pub physical: vk::PhysicalDevice,
    pub family: u32,
    pub device: ash::Device,
    pub queue: vk::Queue,
    /// What the device was created with: `hostQueryReset` and the calibrated-timestamps extension, for
    /// [`Vulkan::backend`].
    pub options: VulkanOptions,
    pub name: String,
    /// The device is lavapipe: its clock is `CLOCK_MONOTONIC`.
    pub lavapipe: bool,
}

/// A [`Vulkan`] but for the loader and the instance.
struct Opened {
    physical: vk::PhysicalDevice,
    family: u32,
    device: ash::Device,
    queue: vk::Queue,
    options: VulkanOptions,
    name: String,
}

impl Vulkan {
    /// The first device with a queue of `wants.queue` that writes timestamps, with what `wants` enables; or why not
    /// (no loader, no driver, no such queue, a required capability the device lacks).
    pub fn new(wants: Wants) -> Result<Vulkan, Box<dyn Error>> {
        let entry = load_entry()?;
        let app = vk::ApplicationInfo::default()
            .application_name(c"tickline")
            .api_version(vk::API_VERSION_1_2);
        // SAFETY: the loader is open; the create info and what it points to outlive the call.
        let instance =
            unsafe { entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None) }
                .map_err(|e| format!("vkCreateInstance failed ({e}): is a Vulkan driver installed?"))?;
        // From here on, `instance` is destroyed by `Vulkan::drop`, or below on failure.
        match Self::open(&instance, wants) {
            Ok(Opened {
                physical,
                family,
                device,
                queue,
                options,
                name,
            }) => Ok(Vulkan {
                entry,
                instance,
                physical,
                family,
                device,
                queue,
                options,
                lavapipe: name.starts_with("llvmpipe"),
                name,
            }),
            Err(e) => {
                // SAFETY: `open` destroyed whatever it created from the instance before failing.
                unsafe { instance.destroy_instance(None) };
                Err(e)
            }
        }
    }

    /// Picks the device and creates it; `entry` and `instance` are filled in by the caller.
    fn open(instance: &ash::Instance, wants: Wants) -> Result<Opened, Box<dyn Error>> {
        // SAFETY: the instance is alive.
        let (physical, family) = unsafe { find_timestamp_queue(instance, wants.queue)? };
        // SAFETY: `physical` was enumerated from the live instance; the feature chain outlives the call.
        let (properties, offered, host_reset_offered) = unsafe {
            let properties = instance.get_physical_device_properties(physical);
            let offered = instance
                .enumerate_device_extension_properties(physical)
                .unwrap_or_default();
            let mut host_reset = vk::PhysicalDeviceHostQueryResetFeatures::default();
            let mut features = vk::PhysicalDeviceFeatures2::default().push_next(&mut host_reset);
            instance.get_physical_device_features2(physical, &mut features);
            let supported = host_reset.host_query_reset == vk::TRUE && properties.api_version >= vk::API_VERSION_1_2;
            (properties, offered, supported)
        };
        let host_query_reset = wants
            .host_query_reset
            .enable(host_reset_offered, || "the device has no hostQueryReset".to_owned())?;
        let candidates = match wants.calibration_extension {
            Some(extension) => vec![extension],
            None => vec![CalibrationExtension::Khr, CalibrationExtension::Ext],
        };
        let offers = |name: &CStr| offered.iter().any(|e| e.extension_name_as_c_str() == Ok(name));
        let found = candidates.iter().copied().find(|ext| offers(ext.name()));
        let calibrate = wants.calibrated_timestamps.enable(found.is_some(), || {
            let names: Vec<_> = candidates.iter().map(|e| e.name().to_string_lossy()).collect();
            format!("the device does not offer {}", names.join(" or "))
        })?;
        let calibrated_timestamps = found.filter(|_| calibrate);
        let extensions: Vec<*const c_char> = calibrated_timestamps.map(|e| e.name().as_ptr()).into_iter().collect();
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&priorities)];
        let mut vulkan12 = vk::PhysicalDeviceVulkan12Features::default().host_query_reset(host_query_reset);
        let mut info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&extensions);
        if host_query_reset {
            info = info.push_next(&mut vulkan12);
        }
        // SAFETY: `physical` belongs to the instance; the create info and what it points to outlive the call.
        let device = unsafe { instance.create_device(physical, &info, None) }
            .map_err(|e| format!("vkCreateDevice failed: {e}"))?;
        // SAFETY: the device was created with one queue of `family`.
        let queue = unsafe { device.get_device_queue(family, 0) };
        let name = properties
            .device_name_as_c_str()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Opened {
            physical,
            family,
            device,
            queue,
            options: VulkanOptions {
                host_query_reset,
                calibrated_timestamps,
                ..VulkanOptions::default()
            },
            name,
        })
    }

    /// [`VulkanGpu::new`] on this device's handles, which are related (created together by [`Vulkan::new`]).
    ///
    /// # Safety
    ///
    /// The rest of [`VulkanGpu::new`]'s contract: the backend is dropped before `self`, and only when none of
    /// its command buffers is pending; every submission to the queue goes through it; scopes are recorded
    /// into command buffers of `family` (outside render passes without `hostQueryReset`), each submitted at most
    /// once; `options` claims no more than [`Vulkan::options`].
    pub unsafe fn backend(&self, options: VulkanOptions) -> Result<VulkanGpu, GpuError> {
        // SAFETY: the handles are related (above); the rest is the caller's contract.
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
    }
}

impl Drop for Vulkan {
    fn drop(&mut self) {
        // SAFETY: everything created from the device (buffers, pools, the tickline backend) is gone by now: its
        // owners borrow `self`, and the callers drop their backends first; the device is idle after the wait.
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// A resettable command buffer of the device's queue family and a fence, destroyed on drop.
pub struct Recorder<'a> {
    pub vulkan: &'a Vulkan,
    pool: vk::CommandPool,
    /// What scopes record into.
    pub commands: vk::CommandBuffer,
    fence: vk::Fence,
}

impl<'a> Recorder<'a> {
    pub fn new(vulkan: &'a Vulkan) -> Result<Recorder<'a>, vk::Result> {
        let device = &vulkan.device;
        let mut recorder = Recorder {
            vulkan,
            pool: vk::CommandPool::null(),
            commands: vk::CommandBuffer::null(),
            fence: vk::Fence::null(),
        };
        // SAFETY: the device is alive; the create infos are valid and outlive the calls; every handle is stored in
        // `recorder` at once, so its drop destroys it on a later failure.
        unsafe {
            recorder.pool = device.create_command_pool(
                &vk::CommandPoolCreateInfo::default()
                    .queue_family_index(vulkan.family)
                    .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                None,
            )?;
            recorder.commands = device.allocate_command_buffers(
                &vk::CommandBufferAllocateInfo::default()
                    .command_pool(recorder.pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1),
            )?[0];
            recorder.fence = device.create_fence(&vk::FenceCreateInfo::default(), None)?;
        }
        Ok(recorder)
    }

    /// Resets the command buffer (empty again, its memory released: the gpu_scope bench records thousands of
    /// scopes per recording) and begins recording.
    pub fn begin(&self) -> Result<(), vk::Result> {
        let device = &self.vulkan.device;
        // SAFETY: the command buffer is ours and not pending (every submission was waited for); its pool allows
        // resetting it.
        unsafe {
            device.reset_command_buffer(self.commands, vk::CommandBufferResetFlags::RELEASE_RESOURCES)?;
            device.begin_command_buffer(
                self.commands,
                &vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
            )
        }
    }

    /// Ends the command buffer without submitting it.
    pub fn end(&self) -> Result<(), vk::Result> {
        // SAFETY: our command buffer is recording (`begin` was called).
        unsafe { self.vulkan.device.end_command_buffer(self.commands) }
    }

    /// Ends the command buffer, submits it through `gpu`'s queue lock and waits; returns the host window
    /// `[before vkQueueSubmit, after the fence wait returned]` in `CLOCK_MONOTONIC` ns.
    pub fn submit_and_wait(&self, gpu: &VulkanGpu) -> Result<(u64, u64), Box<dyn Error>> {
        let device = &self.vulkan.device;
        self.end()?;
        let submit = vk::SubmitInfo::default().command_buffers(std::slice::from_ref(&self.commands));
        let before = tickline::clock::monotonic_ns().0;
        // SAFETY: our command buffer was just recorded and is submitted once; the fence is ours and unsignalled
        // (reset after each wait); the submission goes through the backend's queue lock.
        unsafe {
            gpu.submit(&[submit], self.fence)?;
            device.wait_for_fences(&[self.fence], true, u64::MAX)?;
            let after = tickline::clock::monotonic_ns().0;
            device.reset_fences(&[self.fence])?;
            Ok((before, after))
        }
    }
}

impl Drop for Recorder<'_> {
    fn drop(&mut self) {
        let device = &self.vulkan.device;
        // SAFETY: every submission was waited for before `submit_and_wait` returned (if that wait failed, the
        // device is lost and its work counts as complete); the objects are ours; destroying null handles is
        // allowed. (No vkDeviceWaitIdle here: the collector may be submitting a calibration probe.)
        unsafe {
            device.destroy_fence(self.fence, None);
            device.destroy_command_pool(self.pool, None);
        }
    }
}

/// A [`Recorder`] (which it derefs to) and two buffers of `size` bytes to fill and copy; destroyed on drop.
pub struct Work<'a> {
    recorder: Recorder<'a>,
    buffers: Vec<(vk::Buffer, vk::DeviceMemory)>,
    size: u64,
}

impl<'a> Work<'a> {
    pub fn new(vulkan: &'a Vulkan, size: u64) -> Result<Work<'a>, vk::Result> {
        let mut work = Work {
            recorder: Recorder::new(vulkan)?,
            buffers: Vec::new(),
            size,
        };
        let device = &vulkan.device;
        // SAFETY: the device is alive; the create infos are valid and outlive the calls; every handle is stored
        // in `work` at once, so its drop destroys it on a later failure. The memory type is one the buffer allows.
        unsafe {
            for _ in 0..2 {
                let buffer = device.create_buffer(
                    &vk::BufferCreateInfo::default()
                        .size(size)
                        .usage(vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST),
                    None,
                )?;
                work.buffers.push((buffer, vk::DeviceMemory::null()));
                let needs = device.get_buffer_memory_requirements(buffer);
                let memory = device.allocate_memory(
                    &vk::MemoryAllocateInfo::default()
                        .allocation_size(needs.size)
                        .memory_type_index(needs.memory_type_bits.trailing_zeros()),
                    None,
                )?;
                work.buffers.last_mut().expect("just pushed").1 = memory;
                device.bind_buffer_memory(buffer, memory, 0)?;
            }
        }
        Ok(work)
    }

    /// Fills buffer 0 with `value`.
    pub fn fill(&self, value: u32) {
        // SAFETY: recording into our command buffer; the buffer is ours and allows transfer writes.
        unsafe {
            self.vulkan
                .device
                .cmd_fill_buffer(self.commands, self.buffers[0].0, 0, self.size, value)
        };
    }

    /// Copies buffer `from` into the other one, after the earlier transfers.
    pub fn copy(&self, from: usize) {
        let device = &self.vulkan.device;
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::TRANSFER_READ | vk::AccessFlags::TRANSFER_WRITE);
        // SAFETY: recording into our command buffer; the buffers are ours and allow transfers.
        unsafe {
            device.cmd_pipeline_barrier(
                self.commands,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[barrier],
                &[],
                &[],
            );
            device.cmd_copy_buffer(
                self.commands,
                self.buffers[from].0,
                self.buffers[1 - from].0,
                &[vk::BufferCopy::default().size(self.size)],
            );
        }
    }
}

impl<'a> Deref for Work<'a> {
    type Target = Recorder<'a>;

    fn deref(&self) -> &Recorder<'a> {
        &self.recorder
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        let device = &self.vulkan.device;
        // SAFETY: as `Recorder::drop` (whose command buffer is the only one that used the buffers; it is destroyed
        // after this, with the `recorder` field).
        unsafe {
            for &(buffer, memory) in &self.buffers {
                device.destroy_buffer(buffer, None);
                device.free_memory(memory, None);
            }
        }
    }
}
