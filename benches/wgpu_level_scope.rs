//! What one wgpu-level scope (begin + end) costs the recording thread, tickline's `WgpuProfiler` against
//! wgpu-profiler 0.28's `GpuProfiler::scope`, on the same `wgpu::CommandEncoder` type of the same device, in the
//! same run; with the floor, two bare `CommandEncoder::write_timestamp`s (what both write).
//!
//! Group `wgpu_level_scope`, per iteration:
//! - `bare_write_timestamp_pair`: two `write_timestamp`s into the bench's own two-query set.
//! - `tickline_scope`: `profiler.scope("bench", &mut encoder)` dropped at once (wgpu-profiler's signature: a
//!   run-time label, its call site looked up in a per-thread table).
//! - `tickline_wgpu_scope_macro`: `tickline::wgpu_scope!(profiler, &mut encoder, "bench")` dropped at once (the
//!   call site fixed at compile time).
//! - `wgpu_profiler_scope`: `wgpu_profiler::GpuProfiler::scope("bench", &mut encoder)` dropped at once.
//!
//! Both profilers with debug groups off. Scopes are timed in chunks of `CHUNK` (`iter_custom`); between chunks the
//! timer stops, the queries are resolved, the encoder submitted and waited for, and the results read (tickline:
//! the timeline flushed, so every pair returns; wgpu-profiler: `end_frame` and `process_finished_frame`). Runs on
//! lavapipe; without a Vulkan adapter with timestamps inside encoders it prints `SKIP` and exits.

#[path = "../examples/support/skip.rs"]
mod skip;
#[path = "../examples/support/wgpu.rs"]
mod wgpu_support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use tickline::gpu::wgpu::{WgpuProfiler, WgpuProfilerSettings};
use tickline::Timeline;
use wgpu_support::WgpuSetup;

/// Scopes per encoder: tickline's pool holds twice as many timestamps.
const CHUNK: u64 = 2048;

/// Times `iters` scopes opened by `open` in chunks; `finish` (untimed) resolves, submits and reads back each chunk.
fn chunked(
    iters: u64,
    device: &wgpu::Device,
    mut open: impl FnMut(&mut wgpu::CommandEncoder),
    mut finish: impl FnMut(wgpu::CommandEncoder, u64),
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        let mut encoder = device.create_command_encoder(&Default::default());
        let start = Instant::now();
        for _ in 0..n {
            open(&mut encoder);
        }
        total += start.elapsed();
        finish(encoder, n);
        left -= n;
    }
    total
}

fn main() {
    let features = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
    let Some(setup) = skip::or_skip("wgpu_level_scope bench", WgpuSetup::with_all(features, true)) else {
        return;
    };
    let (device, queue) = (&setup.device, &setup.queue);
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();

    let timeline = Timeline::builder().start().unwrap();
    let profiler = WgpuProfiler::new(
        &timeline,
        device,
        queue,
        WgpuProfilerSettings {
            enable_debug_groups: false,
            timestamp_slots: 2 * CHUNK as u32,
            ..Default::default()
        },
    )
    .unwrap();
    eprintln!(
        "wgpu_level_scope bench: {}, calibration {:?}",
        setup.name,
        profiler.calibration_path()
    );
    let tickline_finish = |mut encoder: wgpu::CommandEncoder, _n: u64| {
        profiler.resolve_queries(&mut encoder);
        queue.submit([encoder.finish()]);
        profiler.end_frame().unwrap();
        setup.wait().unwrap();
        timeline.flush().unwrap();
    };

    let mut peer = wgpu_profiler::GpuProfiler::new(
        device,
        wgpu_profiler::GpuProfilerSettings {
            enable_debug_groups: false,
            ..Default::default()
        },
    )
    .unwrap();

    // Before measuring: a chunk of each comes back whole.
    let before = timeline.stats().gpu_scopes;
    chunked(2 * CHUNK, device, |e| drop(profiler.scope("bench", e)), tickline_finish);
    let stats = timeline.stats();
    assert_eq!(stats.gpu_scopes - before, 2 * CHUNK, "{stats:?}");
    assert_eq!(stats.gpu_lost_scopes, 0, "{stats:?}");
    assert_eq!(profiler.stats(), Default::default());
    let peer_finish = |peer: &mut wgpu_profiler::GpuProfiler, mut encoder: wgpu::CommandEncoder, n: u64| {
        peer.resolve_queries(&mut encoder);
        queue.submit([encoder.finish()]);
        peer.end_frame().unwrap();
        setup.wait().unwrap();
        let results = peer
            .process_finished_frame(queue.get_timestamp_period())
            .expect("the frame finished");
        assert_eq!(results.len() as u64, n);
    };
    {
        let mut encoder = device.create_command_encoder(&Default::default());
        for _ in 0..CHUNK {
            drop(peer.scope("bench", &mut encoder));
        }
        peer_finish(&mut peer, encoder, CHUNK);
    }

    // The floor's own query set: recorded into, never resolved.
    let floor = device.create_query_set(&wgpu::QuerySetDescriptor {
        label: Some("floor"),
        ty: wgpu::QueryType::Timestamp,
        count: 2,
    });

    let mut group = c.benchmark_group("wgpu_level_scope");
    group.bench_function("bare_write_timestamp_pair", |b| {
        b.iter_custom(|iters| {
            chunked(
                iters,
                device,
                |e| {
                    e.write_timestamp(black_box(&floor), 0);
                    e.write_timestamp(black_box(&floor), 1);
                },
                |encoder, _| drop(encoder),
            )
        })
    });
    group.bench_function("tickline_scope", |b| {
        b.iter_custom(|iters| {
            chunked(
                iters,
                device,
                |e| drop(black_box(profiler.scope("bench", e))),
                tickline_finish,
            )
        })
    });
    group.bench_function("tickline_wgpu_scope_macro", |b| {
        b.iter_custom(|iters| {
            chunked(
                iters,
                device,
                |e| drop(black_box(tickline::wgpu_scope!(profiler, e, "bench"))),
                tickline_finish,
            )
        })
    });
    group.bench_function("wgpu_profiler_scope", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(CHUNK);
                let mut encoder = device.create_command_encoder(&Default::default());
                let start = Instant::now();
                for _ in 0..n {
                    drop(black_box(peer.scope("bench", &mut encoder)));
                }
                total += start.elapsed();
                peer_finish(&mut peer, encoder, n);
                left -= n;
            }
            total
        })
    });
    group.finish();

    let stats = timeline.stats();
    eprintln!(
        "wgpu_level_scope bench: {} scopes, {} lost, {:?}, {} dropped records",
        stats.gpu_scopes,
        stats.gpu_lost_scopes,
        profiler.stats(),
        stats.dropped_records
    );
    assert_eq!(profiler.stats().starved_scopes, 0, "a scope found no free pair");
    assert_eq!(stats.dropped_records, 0);
    drop(profiler);
    timeline.shutdown().unwrap();
    c.final_summary();
}
