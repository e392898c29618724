//! A wgpu-hal Vulkan device with a small copy workload, shared by `examples/wgpu_compute.rs`, the wgpu-hal
//! integration tests and `benches/wgpu_scope.rs` (each includes this file with `#[path]`).
//!
//! Everything here is plain wgpu-hal; the only tickline calls are [`open_device`] (hal's `open`, plus the
//! calibrated-timestamps extension and `hostQueryReset`) and [`WgpuGpu::submit`] (hal's submit under the
//! backend's queue lock).

#![allow(dead_code)]

use std::error::Error;
use std::time::Duration;

use tickline::gpu::vulkan::VulkanOptions;
use tickline::gpu::wgpu::{hal, open_device, wgt, WgpuCommands, WgpuGpu};

use hal::{CommandEncoder as _, Device as _, Instance as _};

/// Bytes per buffer: large enough that a copy takes tens of µs on lavapipe.
pub const SIZE: u64 = 4 << 20;

/// A hal instance, adapter, device and queue; dropped in reverse order of creation.
pub struct HalDevice {
    // Field order is drop order: the device (and queue) before the adapter before the instance.
    pub device: hal::vulkan::Device,
    pub queue: hal::vulkan::Queue,
    pub adapter: hal::vulkan::Adapter,
    pub instance: hal::vulkan::Instance,
    /// What [`open_device`] enabled: pass to [`WgpuGpu::new`].
    pub options: VulkanOptions,
    pub name: String,
    /// The device is lavapipe: its clock is `CLOCK_MONOTONIC`.
    pub lavapipe: bool,
}

impl HalDevice {
    /// The first Vulkan adapter whose queue writes timestamps, opened through [`open_device`]; or why not.
    pub fn new() -> Result<HalDevice, Box<dyn Error>> {
        let desc = hal::InstanceDescriptor {
            name: "tickline",
            flags: wgt::InstanceFlags::empty(),
            memory_budget_thresholds: wgt::MemoryBudgetThresholds::default(),
            backend_options: wgt::BackendOptions::default(),
            telemetry: None,
            display: None,
        };
        // SAFETY: a headless instance; hal opens the Vulkan loader and reports its absence as an error.
        let instance = unsafe { hal::vulkan::Instance::init(&desc) }
            .map_err(|e| format!("wgpu-hal Vulkan instance: {e} (no Vulkan loader or driver?)"))?;
        // SAFETY: the instance is alive; no surface.
        let adapters = unsafe { instance.enumerate_adapters(None) };
        let exposed = adapters
            .into_iter()
            .find(|a| a.features.contains(wgt::Features::TIMESTAMP_QUERY))
            .ok_or("no wgpu-hal Vulkan adapter offers TIMESTAMP_QUERY (timestampValidBits >= 36)")?;
        let name = exposed.info.name.clone();
        // SAFETY: no features, the adapter's own limits; the adapter and instance outlive the device (field
        // order above).
        let (open, options) = unsafe {
            open_device(
                &exposed.adapter,
                wgt::Features::empty(),
                &exposed.capabilities.limits,
                &wgt::MemoryHints::Performance,
            )?
        };
        Ok(HalDevice {
            lavapipe: name.starts_with("llvmpipe"),
            device: open.device,
            queue: open.queue,
            adapter: exposed.adapter,
            instance,
            options,
            name,
        })
    }
}

/// Two buffers, an encoder and a fence: records `fill`/`copy` into one command buffer per frame.
pub struct HalWork<'a> {
    hal: &'a HalDevice,
    pub encoder: hal::vulkan::CommandEncoder,
    a: Option<hal::vulkan::Buffer>,
    b: Option<hal::vulkan::Buffer>,
    fence: Option<hal::vulkan::Fence>,
    value: hal::FenceValue,
}

impl<'a> HalWork<'a> {
    pub fn new(hal: &'a HalDevice) -> Result<HalWork<'a>, Box<dyn Error>> {
        let buffer = |label| hal::BufferDescriptor {
            label: Some(label),
            size: SIZE,
            usage: wgt::BufferUses::COPY_SRC | wgt::BufferUses::COPY_DST,
            memory_flags: hal::MemoryFlags::empty(),
        };
        // SAFETY: the descriptors are valid; everything is destroyed in `Drop` after the last wait.
        unsafe {
            Ok(HalWork {
                encoder: hal.device.create_command_encoder(&hal::CommandEncoderDescriptor {
                    label: Some("tickline work"),
                    queue: &hal.queue,
                })?,
                a: Some(hal.device.create_buffer(&buffer("a"))?),
                b: Some(hal.device.create_buffer(&buffer("b"))?),
                fence: Some(hal.device.create_fence()?),
                value: 0,
                hal,
            })
        }
    }

    /// Starts a command buffer; returns what scopes record into.
    pub fn begin(&mut self) -> Result<WgpuCommands, Box<dyn Error>> {
        // SAFETY: the encoder is closed: the previous recording was submitted and waited for, and reset.
        unsafe { self.encoder.begin_encoding(Some("frame"))? };
        Ok(WgpuCommands::of(&self.encoder).expect("the encoder is encoding"))
    }

    /// Zeroes buffer `a`.
    pub fn fill(&mut self) {
        let a = self.a.as_ref().expect("alive");
        // SAFETY: the encoder is encoding; `a` is a COPY_DST buffer of the device; the barrier orders this
        // write after the previous frame's reads.
        unsafe {
            self.encoder.transition_buffers(std::iter::once(hal::BufferBarrier {
                buffer: a,
                usage: hal::StateTransition {
                    from: wgt::BufferUses::COPY_SRC,
                    to: wgt::BufferUses::COPY_DST,
                },
            }));
            self.encoder.clear_buffer(a, 0..SIZE);
        }
    }

    /// Copies `a` into `b` (`back`: `b` into `a`).
    pub fn copy(&mut self, back: bool) {
        let (a, b) = (self.a.as_ref().expect("alive"), self.b.as_ref().expect("alive"));
        let (src, dst) = if back { (b, a) } else { (a, b) };
        let region = hal::BufferCopy {
            src_offset: 0,
            dst_offset: 0,
            size: wgt::BufferSize::new(SIZE).expect("non-zero"),
        };
        // SAFETY: the encoder is encoding; both buffers are the device's, with COPY_SRC | COPY_DST; the
        // barriers order the copy after the writes before it.
        unsafe {
            self.encoder.transition_buffers(
                [
                    hal::BufferBarrier {
                        buffer: src,
                        usage: hal::StateTransition {
                            from: wgt::BufferUses::COPY_DST,
                            to: wgt::BufferUses::COPY_SRC,
                        },
                    },
                    hal::BufferBarrier {
                        buffer: dst,
                        usage: hal::StateTransition {
                            from: wgt::BufferUses::COPY_SRC,
                            to: wgt::BufferUses::COPY_DST,
                        },
                    },
                ]
                .into_iter(),
            );
            self.encoder.copy_buffer_to_buffer(src, dst, std::iter::once(region));
        }
    }

    /// Ends the command buffer, submits it through the backend's queue lock and waits: the `CLOCK_MONOTONIC`
    /// ns just before the submit and just after the wait returned.
    pub fn submit_and_wait(&mut self, gpu: &WgpuGpu) -> Result<(u64, u64), Box<dyn Error>> {
        // SAFETY: the encoder is encoding (`begin` was called).
        let buffer = unsafe { self.encoder.end_encoding()? };
        self.value += 1;
        let fence = self.fence.as_ref().expect("alive");
        let before = tickline::monotonic_ns().0;
        // SAFETY: the command buffer was just recorded on this device's queue family and is submitted once; the
        // fence value grows by one per submit.
        unsafe { gpu.submit(&self.hal.queue, &[&buffer], fence, self.value)? };
        // SAFETY: the fence is the device's; waiting has no other requirement.
        let done = unsafe { self.hal.device.wait(fence, self.value, Some(Duration::from_secs(10)))? };
        let after = tickline::monotonic_ns().0;
        if !done {
            return Err("the GPU did not finish a frame within 10 s".into());
        }
        // SAFETY: the command buffer completed (waited above); the encoder is closed.
        unsafe { self.encoder.reset_all(std::iter::once(buffer)) };
        Ok((before, after))
    }
}

impl Drop for HalWork<'_> {
    fn drop(&mut self) {
        // SAFETY: every submission was waited for (`submit_and_wait`), so nothing of ours is pending; each
        // resource is destroyed once (taken out of its `Option`).
        unsafe {
            if let Some(a) = self.a.take() {
                self.hal.device.destroy_buffer(a);
            }
            if let Some(b) = self.b.take() {
                self.hal.device.destroy_buffer(b);
            }
            if let Some(fence) = self.fence.take() {
                self.hal.device.destroy_fence(fence);
            }
        }
    }
}

/// wgpu's futures (tests and bench) resolve at once on native backends: poll once with a no-op waker.
pub fn ready<T>(future: impl std::future::Future<Output = T>) -> T {
    let mut future = std::pin::pin!(future);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        std::task::Poll::Ready(value) => value,
        std::task::Poll::Pending => panic!("a native wgpu future was pending"),
    }
}
