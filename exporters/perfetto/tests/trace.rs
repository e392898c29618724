//! The exporter's output, decoded: structure by a small framing reader here, semantics by Perfetto's own
//! Python bindings through `.ci/check_perfetto.py` (skipped with a message when they are not installed; CI
//! installs them).

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use tickline::{
    Batch, Event, EventKind, ExportError, Exporter, Field, FieldValue, NameId, TrackDescriptor, TrackId, TrackKind,
};
use tickline_perfetto::PerfettoExporter;

fn event(ts_ns: u64, track: u64, kind: EventKind, name: u32) -> Event {
    Event {
        ts_ns,
        track: TrackId(track),
        kind,
        name: NameId(name),
        fields: 0..0,
        flow_out: None,
        flow_in: None,
    }
}

/// A process with two threads and a counter: nested slices with every field type, an instant, a flow from
/// thread 1 to thread 2. `open_end` leaves one slice without its end (a broken trace).
fn sample_batch(open_end: bool) -> Batch {
    let mut b = Batch::default();
    let track = |id, parent, kind| TrackDescriptor {
        id: TrackId(id),
        parent,
        kind,
    };
    b.new_tracks.push(track(
        1,
        None,
        TrackKind::Process {
            pid: 42,
            name: "app".into(),
        },
    ));
    b.new_tracks.push(track(
        2,
        Some(TrackId(1)),
        TrackKind::Thread {
            pid: 42,
            tid: 43,
            name: "main".into(),
        },
    ));
    b.new_tracks.push(track(
        3,
        Some(TrackId(1)),
        TrackKind::Thread {
            pid: 42,
            tid: 44,
            name: "worker".into(),
        },
    ));
    b.new_tracks.push(track(
        4,
        Some(TrackId(1)),
        TrackKind::Counter {
            name: "depth".into(),
            unit: "items".into(),
        },
    ));
    for (id, name) in [
        "frame", "draw", "upload", "tick", "value", "count", "bytes", "ratio", "ok", "label",
    ]
    .iter()
    .enumerate()
    {
        b.new_names.push((NameId(id as u32 + 1), name.to_string()));
    }
    b.fields = vec![
        Field {
            name: NameId(6),
            value: FieldValue::I64(-3),
        },
        Field {
            name: NameId(7),
            value: FieldValue::U64(u64::MAX),
        },
        Field {
            name: NameId(8),
            value: FieldValue::F64(0.25),
        },
        Field {
            name: NameId(9),
            value: FieldValue::Bool(true),
        },
        Field {
            name: NameId(10),
            value: FieldValue::Str("héllo".into()),
        },
    ];
    let mut frame = event(1_000, 2, EventKind::SliceBegin, 1);
    frame.fields = 0..5;
    b.events.push(frame);
    let mut draw = event(1_100, 2, EventKind::SliceBegin, 2);
    draw.flow_out = Some(7);
    b.events.push(draw);
    b.events.push(event(1_150, 2, EventKind::Instant, 4));
    b.events.push(event(1_200, 2, EventKind::SliceEnd, 2));
    if !open_end {
        b.events.push(event(1_300, 2, EventKind::SliceEnd, 1));
    }
    let mut upload = event(1_250, 3, EventKind::SliceBegin, 3);
    upload.flow_in = Some(7);
    b.events.push(upload);
    b.events.push(event(1_400, 3, EventKind::SliceEnd, 3));
    b.events.push(event(1_000, 4, EventKind::Counter(1.0), 5));
    b.events.push(event(1_500, 4, EventKind::Counter(2.5), 5));
    b
}

fn encode(batch: &Batch) -> Vec<u8> {
    let mut exporter = PerfettoExporter::new(Vec::new());
    exporter.export(batch).unwrap();
    exporter.into_inner().unwrap()
}

/// Splits the outer `Trace` framing: (start, end) of each packet's body. Stops at a cut-short packet.
fn frames(data: &[u8]) -> Vec<(usize, usize)> {
    fn varint(data: &[u8], mut pos: usize) -> Option<(u64, usize)> {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let b = *data.get(pos)?;
            pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some((v, pos));
            }
            shift += 7;
        }
    }
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some((key, p)) = varint(data, pos) {
        assert_eq!(key, 1 << 3 | 2, "outer field must be Trace.packet");
        let Some((len, p)) = varint(data, p) else { break };
        if p + len as usize > data.len() {
            break;
        }
        out.push((p, p + len as usize));
        pos = p + len as usize;
    }
    out
}

fn checker() -> Option<PathBuf> {
    let ok = Command::new("python3")
        .args(["-c", "import perfetto.protos.perfetto.trace.perfetto_trace_pb2"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: Perfetto's Python bindings are missing (pip install perfetto protobuf)");
        return None;
    }
    Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.ci/check_perfetto.py"))
}

fn run_checker(bytes: &[u8], name: &str, args: &[&str]) -> Option<std::process::Output> {
    let script = checker()?;
    let path = std::env::temp_dir().join(format!("tickline-perfetto-{}-{name}.pftrace", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let out = Command::new("python3")
        .arg(script)
        .arg(&path)
        .args(args)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    Some(out)
}

#[test]
fn perfettos_bindings_accept_the_trace_with_the_expected_contents() {
    let bytes = encode(&sample_batch(false));
    let Some(out) = run_checker(
        &bytes,
        "good",
        &[
            "--expect-slices",
            "frame=1",
            "--expect-slices",
            "draw=1",
            "--expect-slices",
            "upload=1",
            "--expect-total-slices",
            "3",
            "--expect-thread-tracks",
            "2",
            "--require-annotation",
            "label",
        ],
    ) else {
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("1 flows"), "{stdout}");
}

#[test]
fn the_checker_rejects_an_unended_slice() {
    let bytes = encode(&sample_batch(true));
    let Some(out) = run_checker(&bytes, "broken", &[]) else {
        return;
    };
    assert!(!out.status.success(), "the checker passed a trace with an open slice");
    assert!(String::from_utf8_lossy(&out.stderr).contains("never ended"));
}

#[test]
fn the_checker_rejects_wrong_counts() {
    let bytes = encode(&sample_batch(false));
    let Some(out) = run_checker(&bytes, "counts", &["--expect-slices", "frame=2"]) else {
        return;
    };
    assert!(!out.status.success());
}

#[test]
fn flow_ids_are_written_unpacked() {
    let bytes = encode(&sample_batch(false));
    // TrackEvent.flow_ids is field 47, fixed64: unpacked means key (47 << 3 | 1) = 0x179 as a varint.
    let unpacked_key = [0xf9, 0x02];
    let packed_key = [0xfa, 0x02]; // (47 << 3 | 2)
    assert!(bytes.windows(2).any(|w| w == unpacked_key));
    assert!(!bytes.windows(2).any(|w| w == packed_key));
}

#[test]
fn every_prefix_of_the_file_holds_whole_packets() {
    let mut batch = sample_batch(false);
    // More events so the file has many packets.
    for i in 0..200 {
        batch.events.push(event(2_000 + i * 10, 3, EventKind::SliceBegin, 3));
        batch.events.push(event(2_005 + i * 10, 3, EventKind::SliceEnd, 3));
    }
    let bytes = encode(&batch);
    let all = frames(&bytes);
    assert!(all.len() > 400);
    for cut in 0..=bytes.len() {
        let prefix = frames(&bytes[..cut]);
        let complete = all.iter().filter(|(_, end)| *end <= cut).count();
        assert_eq!(prefix.len(), complete, "cut at {cut}");
    }
}

/// A writer that fails after accepting `budget` bytes, like a disk filling up.
struct FillsUp {
    written: Vec<u8>,
    budget: usize,
}

impl Write for FillsUp {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.written.len() + buf.len() > self.budget {
            return Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left"));
        }
        self.written.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_full_disk_is_an_error_and_stays_one() {
    let mut exporter = PerfettoExporter::new(FillsUp {
        written: Vec::new(),
        budget: 10,
    });
    exporter.export(&sample_batch(false)).unwrap();
    let err = exporter.flush().unwrap_err();
    assert!(
        matches!(&err, ExportError::Io(e) if e.kind() == std::io::ErrorKind::StorageFull),
        "{err}"
    );
    assert!(err.to_string().contains("no space left"), "{err}");
    assert!(
        exporter.export(&sample_batch(false)).is_err(),
        "a failed exporter keeps failing"
    );
}

#[test]
fn dev_full_reports_an_io_error_naming_the_file() {
    if !std::path::Path::new("/dev/full").exists() {
        eprintln!("skipped: no /dev/full on this system");
        return;
    }
    let mut exporter = PerfettoExporter::create("/dev/full").unwrap();
    exporter.export(&sample_batch(false)).unwrap();
    let err = exporter.finish().unwrap_err();
    assert!(err.to_string().contains("/dev/full"), "{err}");
}

#[test]
fn an_unwritable_path_is_a_clear_error() {
    let err = PerfettoExporter::create("/nonexistent-dir/trace.pftrace").unwrap_err();
    assert!(err.to_string().contains("/nonexistent-dir/trace.pftrace"), "{err}");
}

/// Native scopes record into the newest running timeline: tests that start timelines run one at a time.
fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_whole_timeline_round_trips_through_the_checker() {
    let _one_at_a_time = exclusive();
    let path = std::env::temp_dir().join(format!("tickline-perfetto-{}-timeline.pftrace", std::process::id()));
    let timeline = tickline::Timeline::builder()
        .lossless(true)
        .exporter(PerfettoExporter::create(&path).unwrap())
        .start()
        .unwrap();
    std::thread::scope(|s| {
        for t in 0..2 {
            s.spawn(move || {
                for _ in 0..10_000 {
                    let _outer = tickline::scope!("outer");
                    let _inner = tickline::scope!("inner");
                    tickline::counter!("iterations", t);
                }
            });
        }
    });
    timeline.shutdown().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let Some(out) = run_checker(
        &bytes,
        "timeline",
        &[
            "--expect-slices",
            "outer=20000",
            "--expect-slices",
            "inner=20000",
            "--expect-thread-tracks",
            "2",
        ],
    ) else {
        return;
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `sample_batch` plus a GPU device track with a queue track under it and one GPU slice on it, ending a flow
/// from the main thread; `uncertainty` says whether the slice carries its `uncertainty_ns` annotation.
fn gpu_batch(uncertainty: bool) -> Batch {
    let mut b = sample_batch(false);
    b.new_tracks.push(TrackDescriptor {
        id: TrackId(5),
        parent: Some(TrackId(1)),
        kind: TrackKind::Group {
            name: "GPU: test device (simulated)".into(),
        },
    });
    b.new_tracks.push(TrackDescriptor {
        id: TrackId(6),
        parent: Some(TrackId(5)),
        kind: TrackKind::Group { name: "compute".into() },
    });
    b.new_names.push((NameId(11), "uncertainty_ns".into()));
    b.new_names.push((NameId(12), "kernel".into()));
    let mut instant = event(1_350, 2, EventKind::Instant, 12);
    instant.flow_out = Some(9);
    b.events.push(instant);
    let mut kernel = event(1_600, 6, EventKind::SliceBegin, 12);
    kernel.flow_in = Some(9);
    if uncertainty {
        b.fields.push(Field {
            name: NameId(11),
            value: FieldValue::U64(40),
        });
        kernel.fields = 5..6;
    }
    b.events.push(kernel);
    b.events.push(event(1_700, 6, EventKind::SliceEnd, 12));
    b
}

#[test]
fn the_checker_accepts_gpu_tracks_and_rejects_a_gpu_slice_without_its_uncertainty() {
    let Some(out) = run_checker(
        &encode(&gpu_batch(true)),
        "gpu",
        &["--expect-gpu-devices", "1", "--expect-gpu-slices", "1"],
    ) else {
        return;
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let Some(out) = run_checker(&encode(&gpu_batch(false)), "gpu-bare", &[]) else {
        return;
    };
    assert!(
        !out.status.success(),
        "the checker passed a GPU slice with no uncertainty"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("uncertainty_ns"));
}

#[test]
fn a_simulated_gpu_timeline_round_trips_through_the_checker() {
    use std::time::Duration;
    use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};

    let _one_at_a_time = exclusive();
    let path = std::env::temp_dir().join(format!("tickline-perfetto-{}-gpu.pftrace", std::process::id()));
    let timeline = tickline::Timeline::builder()
        .exporter(PerfettoExporter::create(&path).unwrap())
        .start()
        .unwrap();
    let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
    let queue = gpu.queue("compute").unwrap();
    for i in 0..10u32 {
        let commands = SimCommands::new();
        {
            let _outer = tickline::gpu_scope!(queue, &commands, "dispatch", index = i);
            let _inner = tickline::gpu_scope!(queue, &commands, "kernel");
            commands.work(Duration::from_micros(50));
        }
        let _ = gpu.backend().submit(commands).wait();
    }
    let stats = timeline.shutdown().unwrap();
    assert_eq!((stats.gpu_scopes, stats.gpu_lost_scopes), (20, 0));
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let Some(out) = run_checker(
        &bytes,
        "gpu-timeline",
        &[
            "--expect-slices",
            "dispatch=10",
            "--expect-slices",
            "kernel=10",
            "--expect-gpu-devices",
            "1",
            "--expect-gpu-slices",
            "20",
        ],
    ) else {
        return;
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
