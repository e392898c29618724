//! Shared by the wgpu examples, the wgpu integration tests and the wgpu benches (each includes this file with
//! `#[path]`):
//!
//! - [`HalDevice`] and [`HalWork`]: a wgpu-hal Vulkan device with a small copy workload (`examples/wgpu_compute.rs`,
//!   the wgpu-hal tests, `benches/wgpu_scope.rs`). Plain wgpu-hal; the only tickline calls are [`open_device`]
//!   (hal's `open`, plus the calibrated-timestamps extension and `hostQueryReset`) and [`WgpuGpu::submit`] (hal's
//!   submit under the backend's queue lock).
//! - [`WgpuSetup`] and [`FrameWork`]: a `wgpu::Device` and one frame of a compute pass and an offscreen render pass
//!   (`examples/wgpu_frame.rs`, the wgpu-level tests, `benches/wgpu_frame.rs`, `benches/wgpu_level_scope.rs`),
//!   recorded with or without a [`WgpuProfiler`]; the wgpu-profiler peer of `benches/wgpu_scope.rs` runs on a
//!   [`WgpuSetup`] too.

#![allow(dead_code)]

use std::error::Error;
use std::time::Duration;

use tickline::gpu::vulkan::VulkanOptions;
use tickline::gpu::wgpu::{hal, open_device, request_device, wgt, WgpuCommands, WgpuGpu, WgpuProfiler};

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
        let before = tickline::clock::monotonic_ns().0;
        // SAFETY: the command buffer was just recorded on this device's queue family and is submitted once; the
        // fence value grows by one per submit.
        unsafe { gpu.submit(&self.hal.queue, &[&buffer], fence, self.value)? };
        // SAFETY: the fence is the device's; waiting has no other requirement.
        let done = unsafe { self.hal.device.wait(fence, self.value, Some(Duration::from_secs(10)))? };
        let after = tickline::clock::monotonic_ns().0;
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

/// wgpu's first Vulkan adapter, or why there is none.
pub fn vulkan_adapter() -> Result<(wgpu::Instance, wgpu::Adapter), Box<dyn Error>> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN;
    let instance = wgpu::Instance::new(desc);
    let adapter = ready(instance.request_adapter(&wgpu::RequestAdapterOptions::default()))
        .map_err(|e| format!("no wgpu Vulkan adapter: {e} (no Vulkan loader or driver?)"))?;
    Ok((instance, adapter))
}

/// A `wgpu::Device` on the first Vulkan adapter with `TIMESTAMP_QUERY`, or why not.
pub struct WgpuSetup {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub adapter: wgpu::Adapter,
    pub instance: wgpu::Instance,
    pub name: String,
    /// The device is lavapipe: its clock is `CLOCK_MONOTONIC`.
    pub lavapipe: bool,
}

impl WgpuSetup {
    /// `features` (those the adapter offers) on a Vulkan adapter; `calibrated`: opened with
    /// [`request_device`] (calibrated timestamps where offered) rather than wgpu's own `request_device`.
    pub fn new(features: wgpu::Features, calibrated: bool) -> Result<WgpuSetup, Box<dyn Error>> {
        Self::open(features, false, calibrated)
    }

    /// As [`WgpuSetup::new`], but all of `features`, or why not.
    pub fn with_all(features: wgpu::Features, calibrated: bool) -> Result<WgpuSetup, Box<dyn Error>> {
        Self::open(features, true, calibrated)
    }

    fn open(features: wgpu::Features, all: bool, calibrated: bool) -> Result<WgpuSetup, Box<dyn Error>> {
        let (instance, adapter) = vulkan_adapter()?;
        let missing = (features | wgpu::Features::TIMESTAMP_QUERY) - adapter.features();
        if missing.contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Err("the wgpu adapter has no TIMESTAMP_QUERY".into());
        }
        if all && !missing.is_empty() {
            return Err(format!("the wgpu adapter lacks {missing:?}").into());
        }
        let descriptor = wgpu::DeviceDescriptor {
            label: Some("tickline"),
            required_features: features & adapter.features(),
            ..Default::default()
        };
        let (device, queue) = if calibrated {
            request_device(&adapter, &descriptor)?
        } else {
            ready(adapter.request_device(&descriptor))?
        };
        let name = adapter.get_info().name;
        Ok(WgpuSetup {
            lavapipe: name.starts_with("llvmpipe"),
            name,
            device,
            queue,
            adapter,
            instance,
        })
    }

    /// Waits for everything submitted so far.
    pub fn wait(&self) -> Result<(), Box<dyn Error>> {
        self.device.poll(wgpu::PollType::wait_indefinitely())?;
        Ok(())
    }
}

/// The shaders of [`FrameWork`]: a compute step over a storage buffer, and a full-screen triangle whose
/// fragments iterate a little.
const FRAME_SHADER: &str = r#"
@group(0) @binding(0) var<storage, read_write> data: array<f32>;

@compute @workgroup_size(64)
fn simulate(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.x;
    if (i >= arrayLength(&data)) {
        return;
    }
    var x = data[i] + f32(i) * 0.001;
    for (var k = 0u; k < 64u; k = k + 1u) {
        x = fract(x * 1.618034 + 0.5);
    }
    data[i] = x;
}

@vertex
fn vs(@builtin(vertex_index) v: u32) -> @builtin(position) vec4<f32> {
    let x = f32((v << 1u) & 2u) * 2.0 - 1.0;
    let y = f32(v & 2u) * 2.0 - 1.0;
    return vec4<f32>(x, y, 0.0, 1.0);
}

@fragment
fn fs(@builtin(position) p: vec4<f32>) -> @location(0) vec4<f32> {
    var c = p.xy / 256.0;
    for (var k = 0; k < 16; k = k + 1) {
        c = fract(c * 1.7 + vec2<f32>(0.3, 0.1));
    }
    return vec4<f32>(c, 0.5, 1.0);
}
"#;

/// Elements of the compute step's buffer (256 workgroups of 64).
pub const ELEMENTS: u32 = 16 * 1024;
/// The offscreen target's side, in pixels.
pub const TARGET: u32 = 256;

/// One frame of GPU work: a compute pass over a storage buffer, then a render pass drawing a full-screen triangle
/// into an offscreen texture.
pub struct FrameWork {
    pub compute: wgpu::ComputePipeline,
    pub bind_group: wgpu::BindGroup,
    pub render: wgpu::RenderPipeline,
    pub target: wgpu::TextureView,
}

/// GPU scopes per profiled frame: "frame" > "simulate" > "dispatch", "draw" > "triangle" (the inner two where the
/// device has `TIMESTAMP_QUERY_INSIDE_PASSES`, "frame" where it has `TIMESTAMP_QUERY_INSIDE_ENCODERS`).
pub const FRAME_SCOPES: [&str; 5] = ["frame", "simulate", "dispatch", "draw", "triangle"];

impl FrameWork {
    pub fn new(device: &wgpu::Device) -> FrameWork {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("frame"),
            source: wgpu::ShaderSource::Wgsl(FRAME_SHADER.into()),
        });
        let compute = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("simulate"),
            layout: None,
            module: &module,
            entry_point: Some("simulate"),
            compilation_options: Default::default(),
            cache: None,
        });
        let data = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("simulation state"),
            size: u64::from(ELEMENTS) * 4,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("simulation state"),
            layout: &compute.get_bind_group_layout(0),
            entries: &[wgpu::BindGroupEntry {
                binding: 0,
                resource: data.as_entire_binding(),
            }],
        });
        let format = wgpu::TextureFormat::Rgba8Unorm;
        let render = device.create_render_pipeline(&wgpu::RenderPipelineDescriptor {
            label: Some("draw"),
            layout: None,
            vertex: wgpu::VertexState {
                module: &module,
                entry_point: Some("vs"),
                compilation_options: Default::default(),
                buffers: &[],
            },
            primitive: wgpu::PrimitiveState::default(),
            depth_stencil: None,
            multisample: wgpu::MultisampleState::default(),
            fragment: Some(wgpu::FragmentState {
                module: &module,
                entry_point: Some("fs"),
                compilation_options: Default::default(),
                targets: &[Some(format.into())],
            }),
            multiview_mask: None,
            cache: None,
        });
        let target = device
            .create_texture(&wgpu::TextureDescriptor {
                label: Some("offscreen target"),
                size: wgpu::Extent3d {
                    width: TARGET,
                    height: TARGET,
                    depth_or_array_layers: 1,
                },
                mip_level_count: 1,
                sample_count: 1,
                dimension: wgpu::TextureDimension::D2,
                format,
                usage: wgpu::TextureUsages::RENDER_ATTACHMENT,
                view_formats: &[],
            })
            .create_view(&Default::default());
        FrameWork {
            compute,
            bind_group,
            render,
            target,
        }
    }

    /// The render pass's color attachment: the offscreen target, cleared.
    pub fn attachment(&self) -> wgpu::RenderPassColorAttachment<'_> {
        wgpu::RenderPassColorAttachment {
            view: &self.target,
            depth_slice: None,
            resolve_target: None,
            ops: wgpu::Operations {
                load: wgpu::LoadOp::Clear(wgpu::Color::BLACK),
                store: wgpu::StoreOp::Store,
            },
        }
    }

    /// Records the frame, timed by `profiler` ([`FRAME_SCOPES`], the frame's number as a field of "frame") and
    /// resolved for it, or untimed.
    pub fn record(&self, encoder: &mut wgpu::CommandEncoder, profiler: Option<&WgpuProfiler>, frame: u64) {
        let Some(profiler) = profiler else {
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("simulate"),
                    timestamp_writes: None,
                });
                pass.set_pipeline(&self.compute);
                pass.set_bind_group(0, &self.bind_group, &[]);
                pass.dispatch_workgroups(ELEMENTS / 64, 1, 1);
            }
            let attachment = [Some(self.attachment())];
            let mut pass = encoder.begin_render_pass(&wgpu::RenderPassDescriptor {
                label: Some("draw"),
                color_attachments: &attachment,
                ..Default::default()
            });
            pass.set_pipeline(&self.render);
            pass.draw(0..3, 0..1);
            return;
        };
        {
            let mut scope = tickline::wgpu_scope!(profiler, &mut *encoder, "frame", frame = frame);
            {
                let mut pass = scope.scoped_compute_pass("simulate");
                pass.set_pipeline(&self.compute);
                pass.set_bind_group(0, &self.bind_group, &[]);
                let mut dispatch = pass.scope("dispatch");
                dispatch.dispatch_workgroups(ELEMENTS / 64, 1, 1);
            }
            let attachment = [Some(self.attachment())];
            let mut pass = scope.scoped_render_pass(
                "draw",
                wgpu::RenderPassDescriptor {
                    color_attachments: &attachment,
                    ..Default::default()
                },
            );
            pass.set_pipeline(&self.render);
            let mut triangle = pass.scope("triangle");
            triangle.draw(0..3, 0..1);
        }
        profiler.resolve_queries(encoder);
    }
}
