//! What one wgpu-hal `gpu_scope!` (begin + end) costs the recording thread, against the floor: a bare pair of
//! hal `CommandEncoder::write_timestamp` calls on a hal query set (where wgpu's own `write_timestamp`, and so
//! wgpu-profiler's scopes, end up after wgpu-core's bookkeeping).
//!
//! Group `wgpu_hal_gpu_scope`, per iteration:
//! - `bare_hal_write_timestamp_pair`: two hal `write_timestamp`s into the bench's own two-query set (recorded
//!   only: the command buffer is ended and reset, never submitted).
//! - `gpu_scope_host_reset`: `tickline::gpu_scope!(queue, &commands, "bench")` dropped at once on a
//!   [`WgpuGpu`] with `hostQueryReset` (two `vkCmdWriteTimestamp`, a pair from the free list, a begin record).
//!
//! - `wgpu_profiler_scope`: the peer, `wgpu_profiler::GpuProfiler::scope(.., &mut encoder)` dropped at once, on
//!   a `wgpu::Device` of the same adapter (wgpu 30, over the same wgpu-hal): wgpu's `write_timestamp` twice
//!   (through wgpu-core), the scope's label `String`, its query bookkeeping.
//!
//! Scopes are timed in chunks of `CHUNK` (`iter_custom`); between chunks the timer stops, the command buffer is
//! submitted and waited for, and the timeline flushed (wgpu-profiler: queries resolved, frame ended, results
//! read) so every pair returns. Runs on lavapipe; without a Vulkan device (or without calibrated timestamps and
//! hostQueryReset) it prints `SKIP` and exits.

#[path = "../examples/support/skip.rs"]
mod skip;
#[path = "../examples/support/wgpu.rs"]
mod wgpu_support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use tickline::gpu::vulkan::VulkanOptions;
use tickline::gpu::wgpu::{hal, wgt, WgpuGpu};
use tickline::gpu::{GpuDevice, GpuQueue};
use tickline::Timeline;
use wgpu_support::{HalDevice, HalWork, WgpuSetup};

use hal::{CommandEncoder as _, Device as _};

/// Scopes per submission: the pool holds twice as many timestamps.
const CHUNK: u64 = 4096;

/// Times `iters` scopes in chunks; between chunks (untimed) submits, waits, and flushes so every pair returns.
fn time_scopes(
    iters: u64,
    timeline: &Timeline,
    gpu: &GpuDevice<WgpuGpu>,
    queue: &GpuQueue<WgpuGpu>,
    work: &mut HalWork<'_>,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        let commands = work.begin().unwrap();
        let start = Instant::now();
        for _ in 0..n {
            drop(black_box(tickline::gpu_scope!(queue, &commands, "bench")));
        }
        total += start.elapsed();
        work.submit_and_wait(gpu.backend()).unwrap();
        timeline.flush().unwrap();
        left -= n;
    }
    total
}

/// wgpu-profiler on a `wgpu::Device` (wgpu's own `request_device`) of the first Vulkan adapter with timestamps
/// inside encoders, or why not.
struct Peer {
    profiler: wgpu_profiler::GpuProfiler,
    setup: WgpuSetup,
}

impl Peer {
    fn new() -> Result<Peer, Box<dyn std::error::Error>> {
        let features = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
        let setup = WgpuSetup::with_all(features, false)?;
        let profiler = wgpu_profiler::GpuProfiler::new(
            &setup.device,
            wgpu_profiler::GpuProfilerSettings {
                enable_debug_groups: false,
                ..Default::default()
            },
        )?;
        Ok(Peer { profiler, setup })
    }

    /// Times `iters` scopes in chunks; between chunks (untimed) resolves, submits, waits and reads the results.
    fn time_scopes(&mut self, iters: u64) -> Duration {
        let mut total = Duration::ZERO;
        let mut left = iters;
        while left > 0 {
            let n = left.min(CHUNK);
            let mut encoder = self.setup.device.create_command_encoder(&Default::default());
            let start = Instant::now();
            for _ in 0..n {
                drop(black_box(self.profiler.scope("bench", &mut encoder)));
            }
            total += start.elapsed();
            self.profiler.resolve_queries(&mut encoder);
            self.setup.queue.submit([encoder.finish()]);
            self.profiler.end_frame().unwrap();
            self.setup.wait().unwrap();
            let results = self
                .profiler
                .process_finished_frame(self.setup.queue.get_timestamp_period())
                .expect("the frame finished");
            assert_eq!(results.len() as u64, n);
            left -= n;
        }
        total
    }
}

fn main() {
    let Some(hal) = skip::or_skip("wgpu_scope bench", HalDevice::new()) else {
        return;
    };
    if !hal.options.host_query_reset || hal.options.calibrated_timestamps.is_none() {
        skip::skip(
            "wgpu_scope bench",
            "the device lacks hostQueryReset or calibrated timestamps",
        );
        return;
    }
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let options = VulkanOptions {
        timestamp_slots: 2 * CHUNK as u32,
        ..hal.options.clone()
    };
    // SAFETY: the hal device and queue outlive the backend (dropped before `hal`); every submit goes through
    // `WgpuGpu::submit`; scopes go into the encoder while it encodes, each recording submitted once and waited
    // for.
    let backend = unsafe { WgpuGpu::new(&hal.device, &hal.queue, options) }.expect("the backend sets up");
    let mut work = HalWork::new(&hal).unwrap();
    let timeline = Timeline::builder().start().unwrap();
    let gpu = timeline.gpu(backend).unwrap();
    let queue = gpu.queue("bench").unwrap();

    // Before measuring: a chunk of scopes comes back as slices, and their pairs return.
    let before = timeline.stats().gpu_scopes;
    time_scopes(2 * CHUNK, &timeline, &gpu, &queue, &mut work);
    let stats = timeline.stats();
    assert_eq!(stats.gpu_scopes - before, 2 * CHUNK, "{stats:?}");
    assert_eq!((stats.gpu_lost_scopes, gpu.starved_scopes()), (0, 0), "{stats:?}");

    // The floor's own query set: recorded into, never submitted.
    // SAFETY: a valid descriptor; destroyed below after the last recording was reset.
    let floor = unsafe {
        hal.device.create_query_set(&wgt::QuerySetDescriptor {
            label: Some("floor"),
            ty: wgt::QueryType::Timestamp,
            count: 2,
        })
    }
    .unwrap();

    let mut peer = skip::or_skip("wgpu_scope bench: wgpu_profiler_scope", Peer::new());
    if let Some(peer) = peer.as_mut() {
        peer.time_scopes(2 * CHUNK);
    }

    let mut group = c.benchmark_group("wgpu_hal_gpu_scope");
    group.bench_function("bare_hal_write_timestamp_pair", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(CHUNK);
                work.begin().unwrap();
                let start = Instant::now();
                for _ in 0..n {
                    // SAFETY: the encoder is encoding; the set is the device's and has queries 0 and 1. The
                    // buffer is never submitted, so the writes' execution-time rules do not apply.
                    unsafe {
                        work.encoder.write_timestamp(black_box(&floor), 0);
                        work.encoder.write_timestamp(black_box(&floor), 1);
                    }
                }
                total += start.elapsed();
                // SAFETY: the encoder is encoding; the ended buffer was never submitted, so it can be reset.
                unsafe {
                    let buffer = work.encoder.end_encoding().unwrap();
                    work.encoder.reset_all(std::iter::once(buffer));
                }
                left -= n;
            }
            total
        })
    });
    group.bench_function("gpu_scope_host_reset", |b| {
        b.iter_custom(|iters| time_scopes(iters, &timeline, &gpu, &queue, &mut work))
    });
    if let Some(peer) = peer.as_mut() {
        group.bench_function("wgpu_profiler_scope", |b| {
            b.iter_custom(|iters| peer.time_scopes(iters))
        });
    }
    group.finish();

    let stats = timeline.stats();
    eprintln!(
        "wgpu_scope bench: {} scopes, {} lost, {} starved, {} dropped records",
        stats.gpu_scopes,
        stats.gpu_lost_scopes,
        gpu.starved_scopes(),
        stats.dropped_records
    );
    assert_eq!(gpu.starved_scopes(), 0, "a scope found no free pair");
    assert_eq!(stats.dropped_records, 0);
    drop((queue, gpu));
    timeline.shutdown().unwrap();
    drop(work);
    // SAFETY: the set is the device's; the command buffers that recorded into it were reset, never submitted.
    unsafe { hal.device.destroy_query_set(floor) };
    c.final_summary();
}
