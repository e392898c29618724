//! What timing costs a frame: `examples/wgpu_frame.rs`'s frame (a compute pass and an offscreen render pass on
//! lavapipe, 5 GPU scopes) without timing, timed by tickline's `WgpuProfiler`, and timed by wgpu-profiler 0.28
//! with the same scopes, in the same run.
//!
//! Group `wgpu_frame`, per iteration: record the frame on a new encoder, resolve (when timed), submit, end the frame
//! and wait for the GPU (`Device::poll(wait_indefinitely)`): the frame time of the example.
//! - `untimed`: the same passes without scopes or timestamp writes.
//! - `tickline`: scopes "frame" > "simulate" > "dispatch", "draw" > "triangle" (`FrameWork::record`), a timeline
//!   running its collector (no exporter).
//! - `wgpu_profiler`: the same five scopes with wgpu-profiler, plus its `process_finished_frame` each frame.
//!
//! Group `wgpu_frame_record`: the application thread's CPU per frame, without the submit and the wait: encoder
//! creation, passes, scopes, resolve, `finish`, `end_frame`, and for wgpu-profiler `process_finished_frame` (its
//! results are read on the application's thread; tickline's on the collector's).
//!
//! Both profilers with debug groups off. Without a Vulkan adapter with timestamps inside encoders and passes it
//! prints `SKIP` and exits.

#[path = "../examples/support/skip.rs"]
mod skip;
#[path = "../examples/support/wgpu.rs"]
mod wgpu_support;

use std::time::{Duration, Instant};

use criterion::Criterion;
use tickline::gpu::wgpu::{WgpuProfiler, WgpuProfilerSettings};
use tickline::Timeline;
use wgpu_support::{FrameWork, WgpuSetup, ELEMENTS};

/// Records `work`'s frame with wgpu-profiler's scopes: the five of `FrameWork::record`.
fn record_peer(work: &FrameWork, encoder: &mut wgpu::CommandEncoder, peer: &mut wgpu_profiler::GpuProfiler) {
    {
        let mut scope = peer.scope("frame", encoder);
        {
            let mut pass = scope.scoped_compute_pass("simulate");
            pass.set_pipeline(&work.compute);
            pass.set_bind_group(0, &work.bind_group, &[]);
            let mut dispatch = pass.scope("dispatch");
            dispatch.dispatch_workgroups(ELEMENTS / 64, 1, 1);
        }
        let attachment = [Some(work.attachment())];
        let mut pass = scope.scoped_render_pass(
            "draw",
            wgpu::RenderPassDescriptor {
                color_attachments: &attachment,
                ..Default::default()
            },
        );
        pass.set_pipeline(&work.render);
        let mut triangle = pass.scope("triangle");
        triangle.draw(0..3, 0..1);
    }
    peer.resolve_queries(encoder);
}

fn main() {
    let features = WgpuProfiler::ALL_WGPU_TIMER_FEATURES;
    let Some(setup) = skip::or_skip("wgpu_frame bench", WgpuSetup::with_all(features, true)) else {
        return;
    };
    let (device, queue) = (&setup.device, &setup.queue);
    let mut c = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let work = FrameWork::new(device);
    let timeline = Timeline::builder().start().unwrap();
    let profiler = WgpuProfiler::new(
        &timeline,
        device,
        queue,
        WgpuProfilerSettings {
            enable_debug_groups: false,
            ..Default::default()
        },
    )
    .unwrap();
    let mut peer = wgpu_profiler::GpuProfiler::new(
        device,
        wgpu_profiler::GpuProfilerSettings {
            enable_debug_groups: false,
            ..Default::default()
        },
    )
    .unwrap();

    let tickline_frame = |frame: u64| {
        let mut encoder = device.create_command_encoder(&Default::default());
        work.record(&mut encoder, Some(&profiler), frame);
        queue.submit([encoder.finish()]);
        profiler.end_frame().unwrap();
        setup.wait().unwrap();
    };
    let peer_frame = |peer: &mut wgpu_profiler::GpuProfiler| {
        let mut encoder = device.create_command_encoder(&Default::default());
        record_peer(&work, &mut encoder, peer);
        queue.submit([encoder.finish()]);
        peer.end_frame().unwrap();
        setup.wait().unwrap();
        peer.process_finished_frame(queue.get_timestamp_period())
    };

    // Before measuring: frames come back whole from both.
    let before = timeline.stats().gpu_scopes;
    for frame in 0..4 {
        tickline_frame(frame);
    }
    timeline.flush().unwrap();
    let stats = timeline.stats();
    assert_eq!((stats.gpu_scopes - before, stats.gpu_lost_scopes), (20, 0), "{stats:?}");
    let results = peer_frame(&mut peer).expect("wgpu-profiler's frame finished");
    assert_eq!(results.len(), 1, "one top-level scope");
    assert_eq!(results[0].nested_queries.len(), 2, "simulate and draw");

    let mut group = c.benchmark_group("wgpu_frame");
    group.bench_function("untimed", |b| {
        b.iter(|| {
            let mut encoder = device.create_command_encoder(&Default::default());
            work.record(&mut encoder, None, 0);
            queue.submit([encoder.finish()]);
            setup.wait().unwrap();
        })
    });
    let mut frame = 0;
    group.bench_function("tickline", |b| {
        b.iter(|| {
            frame += 1;
            tickline_frame(frame)
        })
    });
    group.bench_function("wgpu_profiler", |b| b.iter(|| peer_frame(&mut peer)));
    group.finish();

    // The application thread's CPU per frame: recording up to `finish`, then `end_frame` after the (untimed)
    // submit, and for wgpu-profiler `process_finished_frame` after the (untimed) wait: the results a wgpu-profiler
    // user reads on their own thread, and tickline's collector reads on its thread.
    let mut group = c.benchmark_group("wgpu_frame_record");
    group.bench_function("untimed", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let mut encoder = device.create_command_encoder(&Default::default());
                work.record(&mut encoder, None, 0);
                let commands = encoder.finish();
                total += start.elapsed();
                queue.submit([commands]);
                setup.wait().unwrap();
            }
            total
        })
    });
    group.bench_function("tickline", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                frame += 1;
                let start = Instant::now();
                let mut encoder = device.create_command_encoder(&Default::default());
                work.record(&mut encoder, Some(&profiler), frame);
                let commands = encoder.finish();
                total += start.elapsed();
                queue.submit([commands]);
                let start = Instant::now();
                profiler.end_frame().unwrap();
                total += start.elapsed();
                setup.wait().unwrap();
            }
            total
        })
    });
    group.bench_function("wgpu_profiler", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let mut encoder = device.create_command_encoder(&Default::default());
                record_peer(&work, &mut encoder, &mut peer);
                let commands = encoder.finish();
                total += start.elapsed();
                queue.submit([commands]);
                let start = Instant::now();
                peer.end_frame().unwrap();
                total += start.elapsed();
                setup.wait().unwrap();
                let start = Instant::now();
                let results = peer.process_finished_frame(queue.get_timestamp_period());
                total += start.elapsed();
                assert!(results.is_some());
            }
            total
        })
    });
    group.finish();

    let stats = timeline.stats();
    eprintln!(
        "wgpu_frame bench: {} scopes, {} lost, {:?}, {} dropped records",
        stats.gpu_scopes,
        stats.gpu_lost_scopes,
        profiler.stats(),
        stats.dropped_records
    );
    assert_eq!(profiler.stats().starved_scopes, 0, "a scope found no free pair");
    drop(profiler);
    timeline.shutdown().unwrap();
    c.final_summary();
}
