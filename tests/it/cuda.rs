//! The CUDA backend. Without a CUDA driver the no-driver test checks the typed error (no panic, no abort) and
//! every GPU test prints `SKIP: <reason>` to stderr and returns.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tickline::gpu::cuda::cudarc::driver::CudaContext;
use tickline::gpu::cuda::{driver_library, open, CudaGpu, CudaOptions, CudaTiming, CudaTimingInUse};
use tickline::gpu::{GpuBackend, GpuError, GpuTicks};
use tickline::{
    export::{EventKind, MemoryExporter, TrackId, TrackKind},
    Timeline,
};

use crate::skip::skip;

/// Device 0 and a backend on it, or why there is none (the caller prints `SKIP`).
fn device(options: CudaOptions) -> Result<(Arc<CudaContext>, CudaGpu), String> {
    let ctx = open(0).map_err(|e| e.to_string())?;
    let gpu = CudaGpu::new(&ctx, options).map_err(|e| e.to_string())?;
    Ok((ctx, gpu))
}

#[test]
fn no_driver_or_no_device_is_a_typed_error_not_a_panic() {
    match driver_library() {
        Err(e) => {
            assert!(matches!(e, GpuError::NoLoader { .. }), "{e}");
            assert!(e.to_string().contains("libcuda"), "{e}");
            // Every way in says the same, and none panics.
            let e = open(0).unwrap_err();
            assert!(matches!(e, GpuError::NoLoader { .. }), "{e}");
            let e = open(7).unwrap_err();
            assert!(matches!(e, GpuError::NoLoader { .. }), "{e}");
        }
        Ok(()) => {
            // A driver is installed: a device that cannot exist is NoDevice (or the driver has no device at all).
            let e = open(100_000).unwrap_err();
            assert!(matches!(e, GpuError::NoDevice { .. }), "{e}");
        }
    }
}

#[test]
fn options_are_checked_before_the_driver_is_touched() {
    // Without a device there is no context to pass, so this runs only with one; the unit tests cover the
    // checks themselves.
    let ctx = match open(0) {
        Ok(ctx) => ctx,
        Err(e) => return skip("options_are_checked_before_the_driver_is_touched", e),
    };
    let e = CudaGpu::new(
        &ctx,
        CudaOptions {
            timestamp_slots: 3,
            ..CudaOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, GpuError::Invalid { .. }), "{e}");
}

#[test]
fn resolution_batch_reads_and_calibration_on_the_device() {
    let (_ctx, gpu) = match device(CudaOptions::default()) {
        Ok(d) => d,
        Err(e) => return skip("resolution_batch_reads_and_calibration_on_the_device", e),
    };
    let clock = gpu.clock();
    eprintln!("CUDA device: {} {clock:?} {:?}", gpu.info().name, gpu.timing());
    if *gpu.timing() != CudaTimingInUse::GlobalTimer {
        return skip(
            "resolution_batch_reads_and_calibration_on_the_device",
            format!("{:?}", gpu.timing()),
        );
    }
    // 1 µs before Hopper, 32 ns on it; never coarser than 1 µs by much, never zero.
    assert!((1..=2_000).contains(&clock.resolution_ns), "{clock:?}");
    assert_eq!(gpu.info().clock.valid_bits(), 64);
    // The measured resolution is the clock domain's: the calibration widens brackets by half of it on both
    // sides and states half of it in every conversion.
    assert_eq!(gpu.info().clock.resolution_ns(), clock.resolution_ns as f64);

    let one = gpu.read_clock().unwrap();
    let batch = gpu.read_clock_batch(1000).unwrap();
    assert!(batch[0] >= one);
    assert_eq!(batch.len(), 1000);
    assert!(batch.windows(2).all(|w| w[0] <= w[1]), "monotonic");
    let span = batch[999].0 - batch[0].0;
    assert!(span < 10_000_000, "1000 reads from one launch span {span} ns");
    assert!(matches!(gpu.read_clock_batch(0), Err(GpuError::Invalid { .. })));

    let mut samples = Vec::new();
    gpu.calibrate(50, Duration::from_millis(50), &mut samples).unwrap();
    assert!(samples.len() >= 10, "{} samples in 50 ms", samples.len());
    let best = samples.iter().map(|s| s.max_deviation_ns).min().unwrap();
    eprintln!(
        "CUDA calibration: {} samples, tightest bracket ±{best} ns",
        samples.len()
    );
    assert!(best < 100_000, "±{best} ns");
    // The device clock advances with the host's, at about 1 ns per ns.
    let (a, b) = (samples[0], samples[samples.len() - 1]);
    let (dg, dh) = (b.source_ticks - a.source_ticks, b.reference_ns - a.reference_ns);
    let slack = a.max_deviation_ns + b.max_deviation_ns + clock.resolution_ns;
    assert!(dg.abs_diff(dh) <= slack + dh / 1000, "device {dg} ns, host {dh} ns");

    // Slots: unwritten reads as None; a zero budget takes no sample.
    let mut out = [Some(GpuTicks(1)); 4];
    gpu.read_timestamps(0, &mut out).unwrap();
    assert_eq!(out, [None; 4]);
    assert!(gpu.read_timestamps(4095, &mut out).is_err());
    let mut none = Vec::new();
    gpu.calibrate(10, Duration::ZERO, &mut none).unwrap();
    assert!(none.is_empty());
}

#[test]
fn scopes_on_two_streams_land_on_their_tracks() {
    let _one_at_a_time = crate::exclusive();
    let (ctx, backend) = match device(CudaOptions::default()) {
        Ok(d) => d,
        Err(e) => return skip("scopes_on_two_streams_land_on_their_tracks", e),
    };
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let gpu = timeline.gpu(backend).unwrap();
    let streams = [ctx.new_stream().unwrap(), ctx.new_stream().unwrap()];
    let lanes = [gpu.queue("stream 0").unwrap(), gpu.queue("stream 1").unwrap()];
    let host = vec![1u8; 1 << 20];
    for _ in 0..20 {
        for (stream, lane) in streams.iter().zip(&lanes) {
            let _outer = tickline::gpu_scope!(lane, stream, "outer");
            let device = {
                let _upload = tickline::gpu_scope!(lane, stream, "upload");
                stream.clone_htod(&host).unwrap()
            };
            let _back = tickline::gpu_scope!(lane, stream, "download");
            let _ = stream.clone_dtoh(&device).unwrap();
        }
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(gpu.backend().failed_writes(), 0);
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.gpu_scopes, 120, "{stats:?}");
    assert_eq!(stats.gpu_lost_scopes, 0, "{stats:?}");
    let report = gpu.calibration().expect("calibrated");
    eprintln!("CUDA calibration report: {report:?}");

    let trace = memory.snapshot();
    let device = trace
        .tracks
        .iter()
        .find(|t| matches!(t.kind, TrackKind::GpuDevice { .. }))
        .expect("a GPU device track")
        .id;
    let queues: Vec<TrackId> = trace
        .tracks
        .iter()
        .filter(|t| t.parent == Some(device) && matches!(t.kind, TrackKind::GpuQueue { .. }))
        .map(|t| t.id)
        .collect();
    assert_eq!(queues.len(), 2, "one track per stream");
    // Slices of a stream sit on its track or on a sibling lane under it (overlapping scopes).
    let under =
        |track: TrackId, queue: TrackId| track == queue || trace.track(track).is_some_and(|t| t.parent == Some(queue));
    let mut per_queue: HashMap<TrackId, usize> = HashMap::new();
    for e in trace.events.iter().filter(|e| matches!(e.kind, EventKind::SliceBegin)) {
        if let Some(&queue) = queues.iter().find(|&&q| under(e.track, q)) {
            *per_queue.entry(queue).or_default() += 1;
        }
    }
    assert_eq!(
        per_queue.values().copied().collect::<Vec<_>>(),
        [60, 60],
        "{per_queue:?}"
    );
    for name in ["outer", "upload", "download"] {
        assert_eq!(trace.slice_count(name), 40, "{name}");
    }
}

#[test]
fn event_timing_calibrates_and_reads_slots() {
    let (ctx, gpu) = match device(CudaOptions {
        timing: CudaTiming::Events,
        ..CudaOptions::default()
    }) {
        Ok(d) => d,
        Err(e) => return skip("event_timing_calibrates_and_reads_slots", e),
    };
    assert!(
        matches!(gpu.timing(), CudaTimingInUse::Events { .. }),
        "{:?}",
        gpu.timing()
    );
    assert_eq!(gpu.clock().resolution_ns, 500);
    assert_eq!(
        gpu.info().clock.resolution_ns(),
        500.0,
        "the events' resolution is the domain's"
    );
    assert!(matches!(gpu.read_clock_batch(4), Err(GpuError::NoTimestamps { .. })));
    let mut samples = Vec::new();
    gpu.calibrate(20, Duration::from_millis(50), &mut samples).unwrap();
    assert!(samples.len() >= 5, "{} samples", samples.len());
    assert!(samples.windows(2).all(|w| w[0].source_ticks <= w[1].source_ticks));

    let stream = ctx.new_stream().unwrap();
    let mut out = [None; 2];
    gpu.read_timestamps(0, &mut out).unwrap();
    assert_eq!(out, [None, None], "never recorded");
    gpu.write_timestamp(&stream, 0);
    let _ = stream.clone_htod(&vec![0u8; 1 << 20]).unwrap();
    gpu.write_timestamp(&stream, 1);
    stream.synchronize().unwrap();
    // A calibration burst moves the anchor in between: the slots still read in one tick domain.
    gpu.calibrate(5, Duration::from_millis(10), &mut samples).unwrap();
    gpu.read_timestamps(0, &mut out).unwrap();
    let (begin, end) = (out[0].expect("written"), out[1].expect("written"));
    assert!(begin < end && end.0 - begin.0 < 1_000_000_000, "{begin:?} {end:?}");
    gpu.recycle(0, 2).unwrap();
    gpu.read_timestamps(0, &mut out).unwrap();
    assert_eq!(out, [None, None], "recycled");
    assert_eq!(gpu.failed_writes(), 0);
}
