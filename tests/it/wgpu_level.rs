//! wgpu-level scopes (`WgpuProfiler`) on a real driver (Mesa's lavapipe in CI): a compute pass and an offscreen
//! render pass per frame, converted by the collector, checked against their submission windows and the truth.
//!
//! Lavapipe's device clock *is* `CLOCK_MONOTONIC` (ns), so the truth of every GPU timestamp is its raw value, which
//! the profiler's raw-ticks log records as the collector reads it. Without a Vulkan loader or an adapter with
//! timestamps every test prints `SKIP: <reason>` to stderr and returns.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tickline::gpu::vulkan::CalibrationPath;
use tickline::gpu::wgpu::{EndFrameError, WgpuProfiler, WgpuProfilerSettings};
use tickline::gpu::{GpuCalibrationConfig, GpuError};
use tickline::{
    export::{MemoryExporter, MemoryTrace},
    TicklineError, Timeline,
};

use crate::skip::{or_skip, skip};
use crate::vulkan::percentile;
use crate::wgpu::support::{FrameWork, WgpuSetup, FRAME_SCOPES};

/// A slice on the wgpu device's tracks.
#[derive(Clone, Debug)]
struct Slice {
    name: String,
    begin: u64,
    end: u64,
    uncertainty: u64,
}

fn gpu_slices(trace: &MemoryTrace) -> Vec<Slice> {
    crate::slices::queue_slices(trace)
        .expect("every end after its begin")
        .into_iter()
        .map(|s| Slice {
            uncertainty: s.u64("uncertainty_ns").expect("an uncertainty annotation"),
            name: s.name,
            begin: s.begin,
            end: s.end,
        })
        .collect()
}

const FRAMES: u64 = 24;

/// Records `FRAMES` frames of [`FrameWork`] (5 scopes each), each submitted and waited for, then checks every GPU
/// slice against its `[submit, wait]` window and, on lavapipe, against the raw ticks. Returns the errors against
/// the truth (ns, sorted) and the calibration path, or `None` when skipped.
fn run_frames(test: &str, calibrated: bool) -> Option<(Vec<u64>, CalibrationPath)> {
    let setup = or_skip(
        test,
        WgpuSetup::with_all(WgpuProfiler::ALL_WGPU_TIMER_FEATURES, calibrated),
    )?;
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let profiler = WgpuProfiler::new(&timeline, &setup.device, &setup.queue, Default::default()).unwrap();
    let path = profiler.calibration_path().clone();
    assert_eq!(profiler.info().api, "wgpu (Vulkan)");
    profiler.start_raw_log();
    let work = FrameWork::new(&setup.device);
    let mut windows = Vec::new();
    for frame in 0..FRAMES {
        let mut encoder = setup.device.create_command_encoder(&Default::default());
        work.record(&mut encoder, Some(&profiler), frame);
        let before = tickline::clock::monotonic_ns().0;
        setup.queue.submit([encoder.finish()]);
        profiler.end_frame().unwrap();
        setup.wait().unwrap();
        windows.push((before, tickline::clock::monotonic_ns().0));
        std::thread::sleep(Duration::from_millis(3));
    }
    let stats = timeline.shutdown().unwrap();
    let scopes = FRAME_SCOPES.len() as u64 * FRAMES;
    assert_eq!((stats.gpu_scopes, stats.gpu_lost_scopes), (scopes, 0), "{stats:?}");
    assert_eq!(profiler.stats(), Default::default());

    // The truth, per scope in the order scopes opened: a pair's k-th use is its k-th read.
    let log = profiler.raw_log();
    assert_eq!(log.opens.len() as u64, scopes);
    let mut reads: HashMap<u32, VecDeque<(u64, u64)>> = HashMap::new();
    for &(pair, begin, end) in &log.reads {
        reads.entry(pair).or_default().push_back((begin, end));
    }
    let period = profiler.info().clock.nominal_ns_per_tick();
    let truth = |ticks: u64| (ticks as f64 * period).round() as u64;
    let mut by_name: HashMap<String, Vec<Slice>> = HashMap::new();
    for s in gpu_slices(&memory.snapshot()) {
        by_name.entry(s.name.clone()).or_default().push(s);
    }
    for name in FRAME_SCOPES {
        assert_eq!(by_name[name].len() as u64, FRAMES, "{name}");
    }
    let extension = matches!(path, CalibrationPath::Extension(_));
    let mut errors = Vec::new();
    let mut widest = 0;
    for (k, pair) in log.opens.iter().enumerate() {
        let (frame, name) = (k / FRAME_SCOPES.len(), FRAME_SCOPES[k % FRAME_SCOPES.len()]);
        let (raw_begin, raw_end) = reads.get_mut(pair).and_then(VecDeque::pop_front).expect("read back");
        let (before, after) = windows[frame];
        let (b, e) = (truth(raw_begin), truth(raw_end));
        // The exported slice of this scope: the one of this name whose begin is nearest the truth (frames are
        // milliseconds apart, conversions far closer than that).
        let s = by_name[name]
            .iter()
            .min_by_key(|s| s.begin.abs_diff(b))
            .expect("a slice")
            .clone();
        let slack = s.uncertainty.max(1);
        widest = widest.max(s.uncertainty);
        assert!(
            before <= s.begin + slack && s.begin <= s.end && s.end <= after + slack,
            "{name} of frame {frame}: {s:?} outside its submission window {before}..{after} (± {slack} ns)"
        );
        if extension {
            assert!(before <= s.begin && s.end <= after, "{s:?} outside {before}..{after}");
        }
        if setup.lavapipe {
            assert!(
                before <= b && b <= e && e <= after,
                "{name} of frame {frame}: truth {b}..{e} outside {before}..{after}"
            );
            errors.push(s.begin.abs_diff(b));
            errors.push(s.end.abs_diff(e));
            let error = s.begin.abs_diff(b).max(s.end.abs_diff(e));
            assert!(
                error <= slack,
                "{name} of frame {frame}: error {error} ns beyond its uncertainty {slack} ns"
            );
        }
    }
    eprintln!(
        "{test}: {path:?}: {scopes} slices, {} causality violations, widest uncertainty {widest} ns",
        stats.gpu_causality_violations
    );
    if !setup.lavapipe {
        skip(
            test,
            "the accuracy check needs lavapipe (its device clock is CLOCK_MONOTONIC)",
        );
        return None;
    }
    errors.sort_unstable();
    eprintln!(
        "{test}: error against the truth: p50 {} ns, p99 {} ns, max {} ns",
        percentile(&errors, 0.5),
        percentile(&errors, 0.99),
        errors[errors.len() - 1],
    );
    if extension {
        assert_eq!(stats.gpu_causality_violations, 0, "{stats:?}");
    }
    Some((errors, path))
}

#[test]
fn wgpu_level_scopes_with_calibrated_timestamps_sit_in_their_windows_within_a_microsecond() {
    let _one_at_a_time = crate::exclusive();
    let test = "wgpu_level_scopes_with_calibrated_timestamps_sit_in_their_windows_within_a_microsecond";
    let Some((errors, path)) = run_frames(test, true) else {
        return;
    };
    if !matches!(path, CalibrationPath::Extension(_)) {
        return skip(
            test,
            format!("the 1 µs check needs a calibrated-timestamps extension: {path:?}"),
        );
    }
    let p99 = percentile(&errors, 0.99);
    assert!(p99 <= 1_000, "p99 error {p99} ns > 1 µs");
}

#[test]
fn wgpu_level_scopes_with_the_submit_probe_sit_in_their_windows_within_their_uncertainty() {
    let _one_at_a_time = crate::exclusive();
    let test = "wgpu_level_scopes_with_the_submit_probe_sit_in_their_windows_within_their_uncertainty";
    // wgpu's own request_device: no calibrated-timestamps extension, so the profiler probes the queue.
    if let Some((_, path)) = run_frames(test, false) {
        assert!(matches!(path, CalibrationPath::Submit { .. }), "{path:?}");
    }
}

#[test]
fn a_device_without_timestamp_query_is_refused_naming_the_feature() {
    let test = "a_device_without_timestamp_query_is_refused_naming_the_feature";
    let Some(setup) = or_skip(test, WgpuSetup::new(wgpu::Features::empty(), true)) else {
        return;
    };
    let timeline = Timeline::builder().start().unwrap();
    let refused = WgpuProfiler::new(&timeline, &setup.device, &setup.queue, Default::default());
    match refused {
        Err(TicklineError::Gpu(GpuError::NoTimestamps { detail })) => {
            assert!(detail.contains("TIMESTAMP_QUERY"), "{detail}");
        }
        other => panic!("expected NoTimestamps, got {other:?}"),
    }
    let bad = WgpuProfiler::new(
        &timeline,
        &setup.device,
        &setup.queue,
        WgpuProfilerSettings {
            max_num_pending_frames: 0,
            ..Default::default()
        },
    );
    assert!(
        matches!(bad, Err(TicklineError::Gpu(GpuError::Invalid { .. }))),
        "{bad:?}"
    );
    timeline.shutdown().unwrap();
}

/// Opens `count` encoder scopes named `name` on a fresh encoder.
fn scopes(profiler: &WgpuProfiler, device: &wgpu::Device, name: &str, count: usize) -> wgpu::CommandEncoder {
    let mut encoder = device.create_command_encoder(&Default::default());
    for _ in 0..count {
        drop(profiler.scope(name, &mut encoder));
    }
    encoder
}

#[test]
fn resolves_beyond_the_pending_bound_are_deferred_never_dropped() {
    let _one_at_a_time = crate::exclusive();
    let test = "resolves_beyond_the_pending_bound_are_deferred_never_dropped";
    let features = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
    let Some(setup) = or_skip(test, WgpuSetup::new(features, true)) else {
        return;
    };
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let settings = WgpuProfilerSettings {
        max_num_pending_frames: 1,
        ..Default::default()
    };
    let profiler = WgpuProfiler::new(&timeline, &setup.device, &setup.queue, settings).unwrap();
    // Frame 1 resolves into the only read-back buffer, which stays in flight until its encoder is submitted; frame
    // 2's resolve finds none free and is deferred; frame 3's takes both frames' pairs once the first is read.
    let mut first = scopes(&profiler, &setup.device, "first", 3);
    profiler.resolve_queries(&mut first);
    let mut second = scopes(&profiler, &setup.device, "second", 2);
    profiler.resolve_queries(&mut second);
    assert_eq!(profiler.stats().deferred_resolves, 1);
    setup.queue.submit([first.finish(), second.finish()]);
    setup.wait().unwrap();
    timeline.flush().unwrap();
    let mut third = scopes(&profiler, &setup.device, "third", 1);
    profiler.resolve_queries(&mut third);
    setup.queue.submit([third.finish()]);
    profiler.end_frame().unwrap();
    setup.wait().unwrap();
    let stats = timeline.shutdown().unwrap();
    assert_eq!((stats.gpu_scopes, stats.gpu_lost_scopes), (6, 0), "{stats:?}");
    let trace = memory.snapshot();
    for (name, count) in [("first", 3), ("second", 2), ("third", 1)] {
        assert_eq!(
            gpu_slices(&trace).iter().filter(|s| s.name == name).count(),
            count,
            "{name}"
        );
    }
}

#[test]
fn a_resolve_submitted_before_its_scopes_is_retried_not_read_as_a_time() {
    let _one_at_a_time = crate::exclusive();
    let test = "a_resolve_submitted_before_its_scopes_is_retried_not_read_as_a_time";
    let features = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
    let Some(setup) = or_skip(test, WgpuSetup::new(features, true)) else {
        return;
    };
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let profiler = WgpuProfiler::new(&timeline, &setup.device, &setup.queue, Default::default()).unwrap();
    profiler.start_raw_log();
    for round in 0..2 {
        // The scopes' encoder is submitted after the encoder that resolves them: the read-back sees nothing
        // written (first use: 0; later: the pair's previous values), and the pairs go into the next resolve.
        let work = scopes(&profiler, &setup.device, "late", 2);
        let mut resolve = setup.device.create_command_encoder(&Default::default());
        profiler.resolve_queries(&mut resolve);
        setup.queue.submit([resolve.finish()]);
        setup.queue.submit([work.finish()]);
        setup.wait().unwrap();
        timeline.flush().unwrap();
        let mut next = setup.device.create_command_encoder(&Default::default());
        profiler.resolve_queries(&mut next);
        setup.queue.submit([next.finish()]);
        setup.wait().unwrap();
        timeline.flush().unwrap();
        assert!(
            profiler.stats().retried_pairs >= 2 * (round + 1),
            "{:?}",
            profiler.stats()
        );
    }
    let stats = timeline.shutdown().unwrap();
    assert_eq!((stats.gpu_scopes, stats.gpu_lost_scopes), (4, 0), "{stats:?}");
    let slices = gpu_slices(&memory.snapshot());
    assert_eq!(slices.len(), 4);
    // Every value read is one the scopes wrote: none is 0, none repeats.
    let log = profiler.raw_log();
    let mut values: Vec<u64> = log.reads.iter().flat_map(|&(_, b, e)| [b, e]).collect();
    assert_eq!(values.len(), 8);
    assert!(values.iter().all(|&v| v != 0));
    values.sort_unstable();
    values.dedup();
    assert_eq!(values.len(), 8, "a stale value was read as a time");
}

#[test]
fn scopes_of_an_encoder_never_submitted_are_counted_lost() {
    let _one_at_a_time = crate::exclusive();
    let test = "scopes_of_an_encoder_never_submitted_are_counted_lost";
    let features = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
    let Some(setup) = or_skip(test, WgpuSetup::new(features, true)) else {
        return;
    };
    let timeline = Timeline::builder()
        .gpu_calibration(GpuCalibrationConfig {
            lost_after: Duration::from_millis(300),
            ..Default::default()
        })
        .start()
        .unwrap();
    let profiler = WgpuProfiler::new(&timeline, &setup.device, &setup.queue, Default::default()).unwrap();
    // Scopes and their resolve in one encoder that is dropped: wgpu drops the mapping callback uncalled.
    let mut dropped = scopes(&profiler, &setup.device, "dropped", 2);
    profiler.resolve_queries(&mut dropped);
    drop(dropped);
    profiler.end_frame().unwrap();
    // Later frames go on; the dropped pairs are retried a few times, then given up.
    for _ in 0..6 {
        let mut encoder = scopes(&profiler, &setup.device, "kept", 1);
        profiler.resolve_queries(&mut encoder);
        setup.queue.submit([encoder.finish()]);
        setup.wait().unwrap();
        timeline.flush().unwrap();
    }
    std::thread::sleep(Duration::from_millis(400));
    timeline.flush().unwrap();
    let stats = timeline.shutdown().unwrap();
    assert_eq!((stats.gpu_scopes, stats.gpu_lost_scopes), (8, 2), "{stats:?}");
    let counted = profiler.stats();
    assert_eq!(counted.unreadable_pairs, 2, "{counted:?}");
}

#[test]
fn scopes_need_their_feature_and_end_frame_checks_the_frame() {
    let _one_at_a_time = crate::exclusive();
    let test = "scopes_need_their_feature_and_end_frame_checks_the_frame";
    // Only TIMESTAMP_QUERY: pass scopes are timed, scopes on the encoder or inside passes are not.
    let Some(setup) = or_skip(test, WgpuSetup::new(wgpu::Features::TIMESTAMP_QUERY, true)) else {
        return;
    };
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let profiler = WgpuProfiler::new(&timeline, &setup.device, &setup.queue, Default::default()).unwrap();
    let mut encoder = setup.device.create_command_encoder(&Default::default());
    {
        let mut outer = profiler.scope("untimed encoder scope", &mut encoder);
        assert_eq!(profiler.end_frame(), Err(EndFrameError::UnclosedQueries(1)));
        let mut pass = outer.scoped_compute_pass(format!("pass {}", 7));
        drop(pass.scope("untimed pass scope"));
    }
    assert_eq!(profiler.end_frame(), Err(EndFrameError::UnresolvedQueries(1)));
    profiler.resolve_queries(&mut encoder);
    setup.queue.submit([encoder.finish()]);
    profiler.end_frame().unwrap();
    setup.wait().unwrap();
    let stats = timeline.shutdown().unwrap();
    assert_eq!(profiler.stats().untimed_scopes, 2);
    assert_eq!((stats.gpu_scopes, stats.gpu_lost_scopes), (1, 0), "{stats:?}");
    let slices = gpu_slices(&memory.snapshot());
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].name, "pass 7", "a run-time label names the slice");
}
