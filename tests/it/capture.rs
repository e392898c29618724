//! Raw capture (`.tickline`) end to end: recorded beside a live export, converted later, compared.

#[path = "../../examples/support/workload.rs"]
#[allow(dead_code)]
mod workload;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
use tickline::gpu::{GpuBackend, GpuDeviceInfo, GpuError, GpuTicks};
use tickline::{
    calibration::CalibrationSample,
    export::{FieldValue, MemoryExporter, MemoryTrace, TrackKind},
    Timeline,
};
use tracing_subscriber::layer::SubscriberExt;

use crate::exclusive;

/// The simulated GPU, noting the true `CLOCK_MONOTONIC` time of every timestamp it returns.
struct TruthGpu {
    sim: SimGpu,
    truths: Arc<Mutex<Vec<u64>>>,
}

impl GpuBackend for TruthGpu {
    type Commands = SimCommands;
    fn info(&self) -> GpuDeviceInfo {
        self.sim.info()
    }
    fn write_timestamp(&self, commands: &SimCommands, slot: u32) {
        self.sim.write_timestamp(commands, slot);
    }
    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        self.sim.read_timestamps(first, out)?;
        let mut truths = self.truths.lock().unwrap();
        truths.extend(out.iter().flatten().map(|&ticks| self.sim.true_reference_ns(ticks)));
        Ok(())
    }
    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        self.sim.recycle(first, count)
    }
    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        self.sim.calibrate(samples, budget, out)
    }
}

/// A thread's name for each track, to compare traces whose track ids differ.
fn thread_names(trace: &MemoryTrace) -> HashMap<tickline::export::TrackId, String> {
    trace
        .tracks
        .iter()
        .map(|t| {
            let name = match &t.kind {
                TrackKind::Thread { name, .. } => name.clone(),
                TrackKind::Group { name } => name.clone(),
                TrackKind::GpuDevice { name, api } => format!("{name} ({api})"),
                TrackKind::GpuQueue { name, lane } => format!("{name} {lane}"),
                TrackKind::Counter { name, .. } => name.clone(),
                TrackKind::Process { name, .. } => name.clone(),
                _ => String::new(),
            };
            (t.id, name)
        })
        .collect()
}

/// What identifies a slice across two traces: track name, slice name, depth, fields.
type SliceKey = (String, String, usize, String);

/// Every slice by its key, with its begin and end, sorted.
fn slice_set(trace: &MemoryTrace) -> Vec<(SliceKey, (u64, u64))> {
    let names = thread_names(trace);
    let mut slices: Vec<_> = trace
        .slices()
        .into_iter()
        .map(|s| {
            let mut fields: Vec<String> = s
                .fields
                .iter()
                .filter(|(n, _)| n != "uncertainty_ns")
                .map(|(n, v)| format!("{n}={v:?}"))
                .collect();
            fields.sort();
            (
                (names[&s.track].clone(), s.name.clone(), s.depth, fields.join(",")),
                (s.begin_ns, s.end_ns),
            )
        })
        .collect();
    slices.sort();
    slices
}

/// GPU slice placements against the truth: the error of each begin and end to its nearest true timestamp.
fn gpu_errors(trace: &MemoryTrace, truths: &[u64]) -> Vec<u64> {
    let mut truths = truths.to_vec();
    truths.sort_unstable();
    let nearest = |ns: u64| {
        let i = truths.partition_point(|&t| t < ns);
        [i.checked_sub(1), Some(i)]
            .into_iter()
            .flatten()
            .filter_map(|k| truths.get(k))
            .map(|&t| t.abs_diff(ns))
            .min()
            .unwrap_or(u64::MAX)
    };
    let mut errors: Vec<u64> = trace
        .slices()
        .into_iter()
        .filter(|s| s.field("uncertainty_ns").is_some())
        .flat_map(|s| [nearest(s.begin_ns), nearest(s.end_ns)])
        .collect();
    errors.sort_unstable();
    errors
}

#[test]
fn a_raw_capture_converted_later_matches_the_live_export() {
    let _x = exclusive();
    let dir = std::env::temp_dir().join(format!("tickline-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("quickstart.tickline");
    let live = MemoryExporter::default();
    let timeline = Timeline::builder()
        .exporter(live.clone())
        .raw_capture(&path)
        .start()
        .unwrap();
    let truths = Arc::new(Mutex::new(Vec::new()));
    let gpu = timeline
        .gpu(TruthGpu {
            sim: SimGpu::new(SimGpuConfig {
                hardware_queues: 2,
                ..Default::default()
            })
            .unwrap(),
            truths: truths.clone(),
        })
        .unwrap();
    let (graphics, transfer) = (gpu.queue("graphics").unwrap(), gpu.queue("transfer").unwrap());
    let layer = timeline.layer();
    std::thread::scope(|s| {
        for worker in 0..3 {
            let layer = layer.clone();
            s.spawn(move || {
                tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
                    for job in 0..20 {
                        workload::job(worker, job);
                    }
                })
            });
        }
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer.clone()), || {
            for frame in 0..20 {
                let _f = tracing::info_span!("render frame", frame).entered();
                let (draw, upload) = (SimCommands::new(), SimCommands::new());
                {
                    let _u = tickline::gpu_scope!(transfer, &upload, "upload", frame = frame);
                    upload.work(Duration::from_micros(150));
                }
                {
                    let _d = tickline::gpu_scope!(graphics, &draw, "draw", frame = frame);
                    draw.work(Duration::from_micros(300));
                }
                let a = gpu.backend().sim.submit_to(1, upload);
                let b = gpu.backend().sim.submit_to(0, draw);
                let _ = (a.wait(), b.wait());
            }
        });
    });
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.dropped_records, 0);

    let converted = MemoryExporter::default();
    let summary = tickline::capture::convert(&path, converted.clone()).unwrap();
    assert!(summary.complete, "{summary:?}");
    assert_eq!(summary.records, stats.records);
    assert_eq!(summary.threads, stats.threads);
    let (live, converted) = (live.snapshot(), converted.snapshot());

    // The same slices, names, fields and nesting on the same tracks; times within a microsecond (the capture
    // is converted with the CPU clock's whole history, the live path with its newest fit).
    let (a, b) = (slice_set(&live), slice_set(&converted));
    assert_eq!(a.len(), b.len());
    assert_eq!(a.len(), 3 * 20 * 6 + 20 + 40, "jobs, frames and GPU slices");
    for ((key_a, (begin_a, end_a)), (key_b, (begin_b, end_b))) in a.iter().zip(&b) {
        assert_eq!(key_a, key_b);
        assert!(
            begin_a.abs_diff(*begin_b) < 1_000 && end_a.abs_diff(*end_b) < 1_000,
            "{key_a:?}"
        );
    }
    // The same flows, each with both ends.
    let flows = |t: &MemoryTrace| {
        let outs = t.events.iter().filter(|e| e.flow_out.is_some()).count();
        let ins = t.events.iter().filter(|e| e.flow_in.is_some()).count();
        (outs, ins)
    };
    assert_eq!(flows(&live), flows(&converted));
    assert_eq!(flows(&live), (40, 40));

    // GPU slices: placed no worse than live (the converter sees every calibration point).
    let truths = truths.lock().unwrap();
    let (live_errors, converted_errors) = (gpu_errors(&live, &truths), gpu_errors(&converted, &truths));
    assert_eq!(live_errors.len(), 80);
    let p99 = |e: &[u64]| e[(e.len() - 1) * 99 / 100];
    eprintln!(
        "raw capture: GPU error p99 live {} ns, converted {} ns",
        p99(&live_errors),
        p99(&converted_errors)
    );
    assert!(
        p99(&converted_errors) <= p99(&live_errors) + 10,
        "{converted_errors:?} vs {live_errors:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_capture_cut_at_any_byte_converts_up_to_its_last_whole_frame() {
    let _x = exclusive();
    let dir = std::env::temp_dir().join(format!("tickline-capture-cut-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("run.tickline");
    let timeline = Timeline::builder().raw_capture(&path).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..300u64 {
            let _s = tracing::info_span!("step", i).entered();
            tracing::info!(i, "tick");
            if i % 50 == 0 {
                timeline.flush().unwrap();
            }
        }
    });
    timeline.shutdown().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let full = tickline::capture::summarize(&path).unwrap();
    assert!(full.complete && full.stopped_early.is_none());
    assert_eq!(full.slices, 300);
    let cut_path = dir.join("cut.tickline");
    let mut last_slices = 0;
    // The process frame: the 16-byte file header, then type, length, payload, check.
    let header_frame_end = 16 + 5 + u32::from_le_bytes(bytes[17..21].try_into().unwrap()) as usize + 8;
    // Every byte of the first frames, then a stride through the rest.
    let cuts: Vec<usize> = (0..200)
        .chain((200..bytes.len()).step_by(97))
        .chain([bytes.len()])
        .collect();
    for cut in cuts {
        std::fs::write(&cut_path, &bytes[..cut]).unwrap();
        match tickline::capture::summarize(&cut_path) {
            Ok(summary) => {
                assert!(summary.slices <= 300);
                assert!(summary.slices >= last_slices, "a longer prefix never converts to less");
                last_slices = summary.slices;
                if cut < bytes.len() {
                    assert!(!summary.complete || cut == bytes.len());
                }
            }
            Err(tickline::capture::CaptureError::Format { .. }) => assert!(cut < header_frame_end, "cut at {cut}"),
            Err(e) => panic!("cut at {cut}: {e}"),
        }
    }
    assert_eq!(last_slices, 300);
    // Corrupt a byte in the middle: reading stops there, cleanly.
    let mut corrupt = bytes.clone();
    let middle = corrupt.len() / 2;
    corrupt[middle] ^= 0x5a;
    std::fs::write(&cut_path, &corrupt).unwrap();
    let summary = tickline::capture::summarize(&cut_path).unwrap();
    assert!(summary.stopped_early.is_some() && summary.slices < 300);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_capture_only_timeline_converts_nothing_while_running_and_everything_later() {
    let _x = exclusive();
    let dir = std::env::temp_dir().join(format!("tickline-capture-only-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("only.tickline");
    let timeline = Timeline::builder().raw_capture(&path).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..1_000u64 {
            let _s = tracing::info_span!("work", i, status = tracing::field::Empty).entered();
            tracing::Span::current().record("status", i % 7);
        }
    });
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.events, 0, "nothing converted while running");
    let memory = MemoryExporter::default();
    let summary = tickline::capture::convert(&path, memory.clone()).unwrap();
    assert_eq!(summary.slices, 1_000);
    let slices = memory.snapshot().slices();
    for s in slices.iter().filter(|s| s.name == "work") {
        let Some(FieldValue::U64(i)) = s.field("i") else {
            panic!()
        };
        assert_eq!(s.field("status"), Some(&FieldValue::U64(i % 7)));
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_converted_capture_accounts_for_every_record_and_slice_the_rings_dropped() {
    let _x = exclusive();
    const SPANS: u64 = 50_000;
    let dir = std::env::temp_dir().join(format!("tickline-capture-drops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("drops.tickline");
    let live = MemoryExporter::default();
    // A tiny ring and a drain that runs only when flushed: most slices are dropped whole.
    let timeline = Timeline::builder()
        .ring_capacity(64)
        .raw_capture(&path)
        .exporter(live.clone())
        .start()
        .unwrap();
    timeline.pause_drain(true);
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..SPANS {
            let _s = tracing::info_span!("work").entered();
            if i % 5_000 == 0 {
                timeline.flush().unwrap();
            }
        }
    });
    let stats = timeline.shutdown().unwrap();
    assert!(stats.dropped_slices > 0, "the ring must overflow: {stats:?}");
    let live_slices = live.snapshot().slices().iter().filter(|s| s.name == "work").count() as u64;
    // The trace's own dropped-records counter ends at the same total.
    let trace = live.snapshot();
    let counter = trace
        .tracks
        .iter()
        .find(|t| matches!(&t.kind, TrackKind::Counter { name, .. } if name == "tickline dropped records"))
        .map(|t| t.id)
        .expect("the dropped-records counter track");
    let last = trace.events_on(counter).filter_map(|e| match e.kind {
        tickline::export::EventKind::Counter(v) => Some(v),
        _ => None,
    });
    assert_eq!(last.last(), Some(stats.dropped_records as f64), "{stats:?}");
    assert_eq!(live_slices + stats.dropped_slices, SPANS, "{stats:?}");

    let converted = MemoryExporter::default();
    let summary = tickline::capture::convert(&path, converted.clone()).unwrap();
    let slices = converted
        .snapshot()
        .slices()
        .iter()
        .filter(|s| s.name == "work")
        .count() as u64;
    assert_eq!(slices, live_slices);
    assert_eq!(
        (summary.dropped_slices, summary.stats.dropped_slices),
        (stats.dropped_slices, stats.dropped_slices),
        "{summary:?}"
    );
    assert_eq!(
        (summary.stats.records, summary.stats.dropped_records),
        (stats.records, stats.dropped_records),
        "{summary:?}"
    );
    // The summary's own counts (what `tickline stats` prints) add up the same way: the markers a ring put
    // where it dropped records are no records of the program's.
    assert_eq!(
        (summary.records, summary.dropped_records),
        (stats.records, stats.dropped_records),
        "{summary:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// With a raw capture alone (no processing stage decodes the records), `TimelineStats::records` still leaves
/// out the loss markers the rings wrote (one as each thread exits, one before the records after a drop): it
/// said one more per exited thread than the capture holds.
#[test]
fn a_capture_alone_counts_the_records_the_program_made() {
    let _x = exclusive();
    for ring in [None, Some(64)] {
        let path = std::env::temp_dir().join(format!("tickline-alone-{}-{ring:?}.tickline", std::process::id()));
        let builder = Timeline::builder().raw_capture(&path);
        let builder = match ring {
            Some(n) => builder.ring_capacity(n).max_ring_capacity(n),
            None => builder,
        };
        let timeline = builder.start().unwrap();
        // The tiny ring case drops for sure: nothing is drained while the threads record.
        timeline.pause_drain(ring.is_some());
        let layer = timeline.layer();
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let layer = layer.clone();
                std::thread::spawn(move || {
                    tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
                        for i in 0..200u64 {
                            let _s = tracing::info_span!("work", i).entered();
                            drop(tickline::scope!("step"));
                        }
                    })
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        timeline.pause_drain(false);
        let stats = timeline.shutdown().unwrap();
        let summary = tickline::capture::summarize(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(
            ring.is_none() || stats.dropped_records > 0,
            "the tiny ring dropped nothing: {stats:?}"
        );
        assert_eq!(
            (summary.records, summary.dropped_records),
            (stats.records, stats.dropped_records),
            "ring {ring:?}: {summary:?}"
        );
    }
}
