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

#[path = "../examples/support/skip.rs"]
mod skip;
#[path = "../examples/support/vulkan.rs"]
mod vulkan_support;

use criterion::Criterion;
use tickline::gpu::vulkan::ash::vk;
use tickline::gpu::vulkan::{VulkanGpu, VulkanOptions};
use tickline::gpu::{GpuDevice, GpuQueue};
use tickline::Timeline;
use vulkan_support::{Recorder, Vulkan, Wants};

/// Scopes per submission: the pool holds twice as many timestamps.
const CHUNK: u64 = 4096;

/// The bench's backends on `vulkan`'s device: `2 * CHUNK` slots, `hostQueryReset` as asked.
fn backend(vulkan: &Vulkan, host_query_reset: bool) -> VulkanGpu {
    let options = VulkanOptions {
        timestamp_slots: 2 * CHUNK as u32,
        host_query_reset: host_query_reset && vulkan.options.host_query_reset,
        ..vulkan.options.clone()
    };
    // SAFETY: the backends are dropped before `vulkan`, after the last fence wait; the queue is used only by this
    // thread (the backends calibrate with the extension, required in `main`, so their collector never submits);
    // scopes go into the bench's command buffer outside render passes, each recording submitted once and waited
    // for; `options` claim no more than the device was created with (`vulkan.options`).
    unsafe { vulkan.backend(options) }.expect("the backend sets up")
}

/// Times `iters` scopes in chunks; between chunks (untimed) submits, waits, and flushes so every pair returns.
fn time_scopes(
    iters: u64,
    timeline: &Timeline,
    gpu: &GpuDevice<VulkanGpu>,
    queue: &GpuQueue<VulkanGpu>,
    recorder: &Recorder<'_>,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        recorder.begin().unwrap();
        let start = Instant::now();
        for _ in 0..n {
            drop(black_box(tickline::gpu_scope!(queue, &recorder.commands, "bench")));
        }
        total += start.elapsed();
        recorder.submit_and_wait(gpu.backend()).unwrap();
        timeline.flush().unwrap();
        left -= n;
    }
    total
}

fn main() {
    // Both required: hostQueryReset for the host-reset backend, and an extension because the two backends share
    // the one queue, each with its own lock: only with an extension does neither collector submit a calibration
    // probe.
    let Some(vulkan) = skip::or_skip("gpu_scope bench", Vulkan::new(Wants::REQUIRED)) else {
        return;
    };
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let recorder = Recorder::new(&vulkan).unwrap();
    let timeline = Timeline::builder().start().unwrap();
    let host = timeline.gpu(backend(&vulkan, true)).unwrap();
    let host_queue = host.queue("bench").unwrap();
    let cmd = timeline.gpu(backend(&vulkan, false)).unwrap();
    let cmd_queue = cmd.queue("bench").unwrap();
    eprintln!(
        "gpu_scope bench: calibration {:?}; host reset {}",
        host.backend().calibration_path(),
        host.backend().host_query_reset()
    );

    // Before measuring: a chunk of scopes comes back as slices, and their pairs return.
    for (gpu, queue) in [(&host, &host_queue), (&cmd, &cmd_queue)] {
        let before = timeline.stats().gpu_scopes;
        time_scopes(2 * CHUNK, &timeline, gpu, queue, &recorder);
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
                recorder.begin().unwrap();
                let start = Instant::now();
                for _ in 0..n {
                    // SAFETY: our command buffer is recording; the pool is ours and has queries 0 and 1. The
                    // buffer is never submitted, so the writes' execution-time rules do not apply.
                    unsafe {
                        vulkan.device.cmd_write_timestamp(
                            recorder.commands,
                            vk::PipelineStageFlags::TOP_OF_PIPE,
                            black_box(floor_pool),
                            0,
                        );
                        vulkan.device.cmd_write_timestamp(
                            recorder.commands,
                            vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                            black_box(floor_pool),
                            1,
                        );
                    }
                }
                total += start.elapsed();
                recorder.end().unwrap();
                left -= n;
            }
            total
        })
    });
    group.bench_function("gpu_scope_host_reset", |b| {
        b.iter_custom(|iters| time_scopes(iters, &timeline, &host, &host_queue, &recorder))
    });
    group.bench_function("gpu_scope_command_reset", |b| {
        b.iter_custom(|iters| time_scopes(iters, &timeline, &cmd, &cmd_queue, &recorder))
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
    drop(recorder);
    // SAFETY: the pool is ours; the command buffer that recorded into it was never submitted.
    unsafe { vulkan.device.destroy_query_pool(floor_pool, None) };
    c.final_summary();
}
