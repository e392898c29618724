//! Vulkan set-up shared by the examples: an instance and a device with a compute queue that writes
//! timestamps (enabling `hostQueryReset` and a calibrated-timestamps extension when offered), and a little
//! real work (two 4 MiB buffers filled and copied) with one command buffer and a fence.
//!
//! Included with `#[path = "support/vulkan.rs"] mod vulkan_support;` (an example's subfolder without a
//! `main.rs` is not itself an example).

use std::error::Error;
use std::ffi::{c_char, CStr};

use tickline::gpu::vulkan::ash::{self, vk};
use tickline::gpu::vulkan::{find_timestamp_queue, load_entry, CalibrationExtension, VulkanGpu, VulkanOptions};

/// Bytes per buffer: 4 MiB.
pub const SIZE: u64 = 4 << 20;

/// The instance and device this example creates, destroyed on drop.
pub struct Device {
    pub entry: ash::Entry,
    pub instance: ash::Instance,
    pub physical: vk::PhysicalDevice,
    pub family: u32,
    pub device: ash::Device,
    pub queue: vk::Queue,
    pub options: VulkanOptions,
    pub name: String,
}

/// A [`Device`] but for the loader and the instance.
struct Opened {
    physical: vk::PhysicalDevice,
    family: u32,
    device: ash::Device,
    queue: vk::Queue,
    options: VulkanOptions,
    name: String,
}

impl Device {
    pub fn new() -> Result<Device, Box<dyn Error>> {
        let entry = load_entry()?;
        let app = vk::ApplicationInfo::default()
            .application_name(c"tickline example")
            .api_version(vk::API_VERSION_1_2);
        // SAFETY: the loader is open; the create info and what it points to outlive the call.
        let instance =
            unsafe { entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None) }
                .map_err(|e| format!("vkCreateInstance failed ({e}): is a Vulkan driver installed?"))?;
        // From here on, `instance` is destroyed by `Device::drop`, or below on failure.
        match Self::open(&instance) {
            Ok(Opened {
                physical,
                family,
                device,
                queue,
                options,
                name,
            }) => Ok(Device {
                entry,
                instance,
                physical,
                family,
                device,
                queue,
                options,
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
    fn open(instance: &ash::Instance) -> Result<Opened, Box<dyn Error>> {
        // SAFETY: the instance is alive.
        let (physical, family) = unsafe { find_timestamp_queue(instance, vk::QueueFlags::COMPUTE)? };
        // SAFETY: `physical` was enumerated from the live instance; the feature chain outlives the call.
        let (properties, offered, host_query_reset) = unsafe {
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
        let offers = |name: &CStr| offered.iter().any(|e| e.extension_name_as_c_str() == Ok(name));
        let calibrated_timestamps = [CalibrationExtension::Khr, CalibrationExtension::Ext]
            .into_iter()
            .find(|ext| offers(ext.name()));
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
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: everything created from the device (buffers, pools, the tickline backend) is gone by now:
        // `run` drops them first; the device is idle after the wait.
        unsafe {
            let _ = self.device.device_wait_idle();
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// Two 4 MiB buffers, a command buffer and a fence.
pub struct Work<'a> {
    device: &'a ash::Device,
    pool: vk::CommandPool,
    pub commands: vk::CommandBuffer,
    fence: vk::Fence,
    buffers: Vec<(vk::Buffer, vk::DeviceMemory)>,
}

impl<'a> Work<'a> {
    pub fn new(d: &'a Device) -> Result<Work<'a>, vk::Result> {
        let device = &d.device;
        let mut work = Work {
            device,
            pool: vk::CommandPool::null(),
            commands: vk::CommandBuffer::null(),
            fence: vk::Fence::null(),
            buffers: Vec::new(),
        };
        // SAFETY: the device is alive; the create infos are valid and outlive the calls; every handle is stored
        // in `work` at once, so its drop destroys it on a later failure. The memory type is one the buffer allows.
        unsafe {
            work.pool = device.create_command_pool(
                &vk::CommandPoolCreateInfo::default()
                    .queue_family_index(d.family)
                    .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                None,
            )?;
            work.commands = device.allocate_command_buffers(
                &vk::CommandBufferAllocateInfo::default()
                    .command_pool(work.pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1),
            )?[0];
            work.fence = device.create_fence(&vk::FenceCreateInfo::default(), None)?;
            for _ in 0..2 {
                let buffer = device.create_buffer(
                    &vk::BufferCreateInfo::default()
                        .size(SIZE)
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

    pub fn begin(&self) -> Result<(), vk::Result> {
        // SAFETY: the command buffer is ours and not pending (every submission was waited for); its pool allows
        // resetting it.
        unsafe {
            self.device
                .reset_command_buffer(self.commands, vk::CommandBufferResetFlags::empty())?;
            self.device.begin_command_buffer(
                self.commands,
                &vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
            )
        }
    }

    pub fn fill(&self, value: u32) {
        // SAFETY: recording into our command buffer; the buffer is ours and allows transfer writes.
        unsafe {
            self.device
                .cmd_fill_buffer(self.commands, self.buffers[0].0, 0, SIZE, value)
        };
    }

    /// Copies buffer `from` into the other one, after the earlier transfers.
    pub fn copy(&self, from: usize) {
        let barrier = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::TRANSFER_READ | vk::AccessFlags::TRANSFER_WRITE);
        // SAFETY: recording into our command buffer; the buffers are ours and allow transfers.
        unsafe {
            self.device.cmd_pipeline_barrier(
                self.commands,
                vk::PipelineStageFlags::TRANSFER,
                vk::PipelineStageFlags::TRANSFER,
                vk::DependencyFlags::empty(),
                &[barrier],
                &[],
                &[],
            );
            self.device.cmd_copy_buffer(
                self.commands,
                self.buffers[from].0,
                self.buffers[1 - from].0,
                &[vk::BufferCopy::default().size(SIZE)],
            );
        }
    }

    pub fn submit_and_wait(&self, gpu: &VulkanGpu) -> Result<(), Box<dyn Error>> {
        // SAFETY: our command buffer is recording; the fence is ours and unsignalled (reset after each wait);
        // the submission goes through the backend's queue lock.
        unsafe {
            self.device.end_command_buffer(self.commands)?;
            let submit = vk::SubmitInfo::default().command_buffers(std::slice::from_ref(&self.commands));
            gpu.submit(&[submit], self.fence)?;
            self.device.wait_for_fences(&[self.fence], true, u64::MAX)?;
            self.device.reset_fences(&[self.fence])?;
        }
        Ok(())
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        // SAFETY: every submission was waited for before `submit_and_wait` returned (if that wait failed, the
        // device is lost and its work counts as complete); the objects are ours; destroying null handles is
        // allowed. (No vkDeviceWaitIdle here: the collector may be submitting a calibration probe.)
        unsafe {
            for &(buffer, memory) in &self.buffers {
                self.device.destroy_buffer(buffer, None);
                self.device.free_memory(memory, None);
            }
            self.device.destroy_fence(self.fence, None);
            self.device.destroy_command_pool(self.pool, None);
        }
    }
}
