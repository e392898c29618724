//! What one CUDA `gpu_scope!` (begin + end) costs the recording thread, against the floor: the backend's two
//! timestamp launches alone.
//!
//! Group `cuda_gpu_scope`, per iteration:
//! - `bare_write_timestamp_pair`: `CudaGpu::write_timestamp` twice (two `cuLaunchKernel` of the one-thread
//!   `%globaltimer` kernel) on a stream of the bench's own, no timeline involved.
//! - `gpu_scope`: `tickline::gpu_scope!(lane, &stream, "bench")` dropped at once (the two launches, a pair taken
//!   from the free list, a begin record pushed).
//!
//! Scopes are timed in chunks of `CHUNK` (`iter_custom`): between chunks the timer stops, the stream is
//! synchronised and the timeline flushed so the collector reads the timestamps and returns every pair (the
//! bench asserts none starved). `CHUNK` is small because a launch blocks once the device's queue of pending
//! launches is full (about 1024 on current drivers), which would time the GPU, not the recording thread.
//! Without a CUDA device it prints `SKIP` and exits.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use tickline::gpu::cuda::{open, CudaGpu, CudaOptions};
use tickline::gpu::GpuBackend;
use tickline::Timeline;

/// Scopes per chunk: 512 launches, below the pending-launch queue's depth.
const CHUNK: u64 = 256;

fn main() {
    let ctx = match open(0) {
        Ok(ctx) => ctx,
        Err(reason) => {
            eprintln!("SKIP: cuda_scope bench: {reason}");
            return;
        }
    };
    let options = CudaOptions {
        timestamp_slots: 2 * CHUNK as u32,
        ..CudaOptions::default()
    };
    let stream = ctx.new_stream().expect("a stream");
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .configure_from_args();
    let mut group = c.benchmark_group("cuda_gpu_scope");

    let bare = CudaGpu::new(&ctx, options.clone()).expect("the backend sets up");
    group.bench_function("bare_write_timestamp_pair", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(CHUNK);
                let start = Instant::now();
                for _ in 0..n {
                    bare.write_timestamp(black_box(&stream), 0);
                    bare.write_timestamp(black_box(&stream), 1);
                }
                total += start.elapsed();
                stream.synchronize().unwrap();
                left -= n;
            }
            total
        })
    });
    assert_eq!(bare.failed_writes(), 0);
    drop(bare);

    let timeline = Timeline::builder().start().unwrap();
    let gpu = timeline
        .gpu(CudaGpu::new(&ctx, options).expect("the backend sets up"))
        .unwrap();
    let lane = gpu.queue("bench").unwrap();
    group.bench_function("gpu_scope", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(CHUNK);
                let start = Instant::now();
                for _ in 0..n {
                    drop(black_box(tickline::gpu_scope!(lane, &stream, "bench")));
                }
                total += start.elapsed();
                stream.synchronize().unwrap();
                timeline.flush().unwrap();
                left -= n;
            }
            total
        })
    });
    group.finish();
    assert_eq!(gpu.starved_scopes(), 0, "a chunk found the slots in flight");
    assert_eq!(gpu.backend().failed_writes(), 0);
    drop(lane);
    timeline.shutdown().unwrap();
    drop(gpu);
    c.final_summary();
}
