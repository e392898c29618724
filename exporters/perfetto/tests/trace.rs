//! The exporter's output, decoded: structure by a small framing reader here, semantics by Perfetto's own
//! Python bindings through `.ci/check_perfetto.py` (skipped with a message when they are not installed; CI
//! installs them).

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use tickline::export::{
    Batch, EventKind, ExportError, Exporter, FieldValue, NameId, TraceEvent, TraceField, TrackDescriptor, TrackId,
    TrackKind,
};
use tickline_perfetto::PerfettoExporter;

fn event(ts_ns: u64, track: u64, kind: EventKind, name: u32) -> TraceEvent {
    TraceEvent {
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
        TraceField {
            name: NameId(6),
            value: FieldValue::I64(-3),
        },
        TraceField {
            name: NameId(7),
            value: FieldValue::U64(u64::MAX),
        },
        TraceField {
            name: NameId(8),
            value: FieldValue::F64(0.25),
        },
        TraceField {
            name: NameId(9),
            value: FieldValue::Bool(true),
        },
        TraceField {
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
    // The first export writes out at once (a process killed in its first moments leaves a trace).
    let err = exporter
        .export(&sample_batch(false))
        .and_then(|()| exporter.flush())
        .unwrap_err();
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
    let err = exporter
        .export(&sample_batch(false))
        .and_then(|()| exporter.finish())
        .unwrap_err();
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
        kind: TrackKind::GpuDevice {
            name: "test device".into(),
            api: "simulated".into(),
        },
    });
    b.new_tracks.push(TrackDescriptor {
        id: TrackId(6),
        parent: Some(TrackId(5)),
        kind: TrackKind::GpuQueue {
            name: "compute".into(),
            lane: 0,
        },
    });
    b.new_names.push((NameId(11), "uncertainty_ns".into()));
    b.new_names.push((NameId(12), "kernel".into()));
    let mut instant = event(1_350, 2, EventKind::Instant, 12);
    instant.flow_out = Some(9);
    b.events.push(instant);
    let mut kernel = event(1_600, 6, EventKind::SliceBegin, 12);
    kernel.flow_in = Some(9);
    if uncertainty {
        b.fields.push(TraceField {
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

/// A writer whose bytes the test can read while the exporter owns it.
#[derive(Clone, Default)]
struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Shared {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn bytes(&self) -> Vec<u8> {
        self.0.lock().unwrap().clone()
    }
}

#[test]
fn whole_packets_reach_the_writer_every_flush_interval() {
    let out = Shared::default();
    let mut exporter = PerfettoExporter::new(out.clone()).flush_interval(std::time::Duration::from_millis(100));
    // The first export writes out at once (a process killed in its first moments leaves a trace that loads)...
    exporter.export(&sample_batch(false)).unwrap();
    let opening = out.len();
    assert!(opening > 0);
    assert_eq!(frames(&out.bytes()).last().map(|f| f.1), Some(opening));
    // ... later ones inside the interval wait in the buffer (big writes)...
    exporter.export(&sample_batch(false)).unwrap();
    assert_eq!(out.len(), opening);
    std::thread::sleep(std::time::Duration::from_millis(120));
    // ... and the next export after it, even an empty one (the collector sends those when idle), writes them.
    exporter.export(&Batch::default()).unwrap();
    let bytes = out.bytes();
    assert!(!bytes.is_empty());
    assert_eq!(
        frames(&bytes).last().map(|f| f.1),
        Some(bytes.len()),
        "only whole packets are written"
    );
    // Zero writes on every export.
    let out = Shared::default();
    let mut exporter = PerfettoExporter::new(out.clone()).flush_interval(std::time::Duration::ZERO);
    exporter.export(&sample_batch(false)).unwrap();
    assert!(out.len() > 0);
}

/// The fields of one message, as (field number, varint or length-delimited bytes).
fn fields_of(msg: &[u8]) -> Vec<(u32, u64, Vec<u8>)> {
    fn varint(data: &[u8], pos: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let b = data[*pos];
            *pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }
    let (mut out, mut pos) = (Vec::new(), 0);
    while pos < msg.len() {
        let key = varint(msg, &mut pos);
        match key & 7 {
            0 => out.push(((key >> 3) as u32, varint(msg, &mut pos), Vec::new())),
            1 => {
                out.push((
                    (key >> 3) as u32,
                    u64::from_le_bytes(msg[pos..pos + 8].try_into().unwrap()),
                    Vec::new(),
                ));
                pos += 8;
            }
            2 => {
                let len = varint(msg, &mut pos) as usize;
                out.push(((key >> 3) as u32, 0, msg[pos..pos + len].to_vec()));
                pos += len;
            }
            t => panic!("wire type {t}"),
        }
    }
    out
}

#[test]
fn the_trace_describes_itself() {
    let exporter = PerfettoExporter::new(Vec::new());
    let uuid = exporter.trace_uuid();
    let mut exporter = exporter;
    exporter.export(&sample_batch(false)).unwrap();
    exporter.finish().unwrap();
    assert_eq!(exporter.stats().clock_snapshots, 2, "one at the start, one at the end");
    let bytes = exporter.into_inner().unwrap();
    let packets: Vec<Vec<(u32, u64, Vec<u8>)>> = frames(&bytes).iter().map(|&(s, e)| fields_of(&bytes[s..e])).collect();
    let has = |p: &Vec<(u32, u64, Vec<u8>)>, n: u32| p.iter().any(|f| f.0 == n);
    // First: a snapshot of BOOTTIME (6), MONOTONIC (3), MONOTONIC_RAW (5), REALTIME (1).
    let snapshot = packets[0].iter().find(|f| f.0 == 6).expect("clock snapshot first");
    let clocks: Vec<u64> = fields_of(&snapshot.2)
        .iter()
        .filter(|f| f.0 == 1)
        .map(|f| fields_of(&f.2)[0].1)
        .collect();
    assert_eq!(clocks, vec![6, 3, 5, 1]);
    // TraceUuid (89) with our UUID, SystemInfo (45).
    let trace_uuid = packets
        .iter()
        .find_map(|p| p.iter().find(|f| f.0 == 89))
        .expect("TraceUuid");
    let parts = fields_of(&trace_uuid.2);
    assert_eq!(parts[0].1, uuid.msb() as u64);
    assert_eq!(parts[1].1, uuid.lsb() as u64);
    assert!(packets.iter().any(|p| has(p, 45)), "SystemInfo");
    // The process track carries host= and machine= labels (ProcessDescriptor.process_labels, 8).
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("host="), "process labels");
    assert!(text.contains(&format!("machine={}", tickline::sync::MachineId::current())));
    // tickline's instants, with plain names.
    for name in [
        tickline_perfetto::TRACE_INFO_EVENT,
        tickline_perfetto::CLOCK_SNAPSHOT_EVENT,
        tickline_perfetto::CLOCK_TRACK_NAME,
    ] {
        assert!(text.contains(name), "{name}");
    }
    assert!(text.contains(&uuid.to_string()));
    // Perfetto's bindings still accept it.
    if let Some(out) = run_checker(&bytes, "identity", &["--expect-total-slices", "3"]) {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn track_uuids_and_flow_ids_differ_between_traces() {
    let a = encode(&sample_batch(false));
    let b = encode(&sample_batch(false));
    let uuids = |bytes: &[u8]| -> std::collections::HashSet<u64> {
        frames(bytes)
            .iter()
            .flat_map(|&(s, e)| fields_of(&bytes[s..e]))
            .filter(|f| f.0 == 60)
            .map(|f| fields_of(&f.2)[0].1)
            .collect()
    };
    let (ua, ub) = (uuids(&a), uuids(&b));
    assert!(ua.len() >= 4);
    assert!(ua.is_disjoint(&ub), "two traces share track uuids");
}

/// A real trace (a timeline with threads, a simulated GPU and flows) cut at many byte positions: every prefix
/// holds exactly the whole packets before the cut, and Perfetto's bindings read the cut files up to there.
#[test]
fn a_real_trace_cut_at_any_byte_loads_up_to_its_last_whole_packet() {
    use std::time::Duration;
    use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};

    let _one_at_a_time = exclusive();
    let path = std::env::temp_dir().join(format!("tickline-perfetto-{}-cut.pftrace", std::process::id()));
    let timeline = tickline::Timeline::builder()
        .exporter(PerfettoExporter::create(&path).unwrap())
        .start()
        .unwrap();
    let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
    let queue = gpu.queue("compute").unwrap();
    for i in 0..20u32 {
        let _frame = tickline::scope!("frame");
        let commands = SimCommands::new();
        {
            let _k = tickline::gpu_scope!(queue, &commands, "kernel", index = i);
            commands.work(Duration::from_micros(20));
        }
        let _ = gpu.backend().submit(commands).wait();
    }
    timeline.shutdown().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let all = frames(&bytes);
    assert!(all.len() > 100, "{} packets", all.len());
    for cut in 0..=bytes.len() {
        let complete = all.iter().filter(|(_, end)| *end <= cut).count();
        assert_eq!(frames(&bytes[..cut]).len(), complete, "cut at {cut}");
    }
    // Perfetto's own decoder on a spread of cuts, some inside packets, some on their edges.
    let step = bytes.len() / 12;
    for cut in (1..12).map(|k| k * step).chain([all[all.len() / 2].1, bytes.len() - 1]) {
        let Some(out) = run_checker(&bytes[..cut], &format!("cut{cut}"), &["--allow-cut-tail"]) else {
            return;
        };
        assert!(
            out.status.success(),
            "cut at {cut}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Without the option, a cut inside a packet is reported.
    let inside = all[all.len() / 2].1 + 3;
    if let Some(out) = run_checker(&bytes[..inside], "cut-strict", &[]) {
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("cut short"));
    }
}

/// The track events of a trace with their interned names resolved: (name, flow ids, terminating flow ids).
fn named_flows(bytes: &[u8]) -> Vec<(String, Vec<u64>, Vec<u64>)> {
    let mut names = std::collections::HashMap::new();
    let mut events = Vec::new();
    for &(s, e) in &frames(bytes) {
        for (number, _, body) in fields_of(&bytes[s..e]) {
            match number {
                // TracePacket.interned_data: event_names (2), each EventName { iid 1, name 2 }.
                12 => {
                    for (n, _, entry) in fields_of(&body) {
                        if n == 2 {
                            let entry = fields_of(&entry);
                            let iid = entry.iter().find(|f| f.0 == 1).map(|f| f.1).unwrap_or(0);
                            let name = entry.iter().find(|f| f.0 == 2).map(|f| f.2.clone()).unwrap_or_default();
                            names.insert(iid, String::from_utf8(name).unwrap());
                        }
                    }
                }
                // TracePacket.track_event: name_iid 10, flow_ids 47, terminating_flow_ids 48.
                11 => {
                    let event = fields_of(&body);
                    let Some(iid) = event.iter().find(|f| f.0 == 10).map(|f| f.1) else {
                        continue;
                    };
                    let ids = |n: u32| event.iter().filter(|f| f.0 == n).map(|f| f.1).collect::<Vec<_>>();
                    events.push((names.get(&iid).cloned().unwrap_or_default(), ids(47), ids(48)));
                }
                _ => {}
            }
        }
    }
    events
}

#[test]
fn flow_fields_link_a_sender_to_its_receiver_within_the_trace() {
    use tracing_subscriber::layer::SubscriberExt;
    let _one_at_a_time = exclusive();
    let path = std::env::temp_dir().join(format!("tickline-perfetto-{}-field-flows.pftrace", std::process::id()));
    let exporter = PerfettoExporter::create(&path).unwrap();
    let uuid = exporter.trace_uuid();
    let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    let dispatch = tracing::Dispatch::new(subscriber);
    tracing::dispatcher::with_default(&dispatch, || {
        {
            let _s = tracing::info_span!("send request", "tickline.flow_out" = 7u64).entered();
            tracing::info!("tickline.flow_out" = "job-9", "queued");
        }
        // A sender whose receiver is in another process: its flow starts here and ends nowhere in this trace.
        let _s = tracing::info_span!("send elsewhere", "tickline.flow_out" = 100u64).entered();
    });
    // The receivers on another thread (another track: within a batch, written before or after the senders).
    std::thread::spawn({
        let dispatch = dispatch.clone();
        move || {
            tracing::dispatcher::with_default(&dispatch, || {
                let _h = tracing::info_span!("handle request", "tickline.flow_in" = 7u64).entered();
                drop(tracing::info_span!("handle again", "tickline.flow_in" = 7u64).entered());
                drop(tracing::info_span!("run job", "tickline.flow_in" = "job-9").entered());
                drop(tracing::info_span!("no sender here", "tickline.flow_in" = 99u64).entered());
            })
        }
    })
    .join()
    .unwrap();
    timeline.shutdown().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let events = named_flows(&bytes);
    let of = |name: &str| {
        events
            .iter()
            .find(|e| e.0 == name || (name == "queued" && e.0.starts_with("event ")))
            .unwrap_or_else(|| panic!("{name} not in {events:?}"))
            .clone()
    };
    // Both ends carry the flow's id in `flow_ids`, none in `terminating_flow_ids` (Perfetto's importer ignores
    // a terminating id it reads, in time order, before the flow's start).
    assert!(events.iter().all(|e| e.2.is_empty()), "{events:?}");
    let (_, request_out, _) = of("send request");
    let (_, request_in, _) = of("handle request");
    assert_eq!(request_out.len(), 1, "{events:?}");
    assert_eq!(request_in, request_out, "the receiver ends the sender's flow");
    assert!(tickline_perfetto::is_field_flow_id(uuid, request_out[0]));
    // The `info!` event (named after its call site; its message is a field).
    let (_, job_out, _) = of("queued");
    let (_, job_in, _) = of("run job");
    assert_eq!(
        (job_out.len(), job_in.clone()),
        (1, job_out.clone()),
        "an event sends, by string"
    );
    assert_ne!(job_out, request_out);
    // One receiver per flow. A first receiver without a sender in the trace carries its flow's id anyway (its
    // sender might have been written after it), which links nothing.
    assert_eq!(of("handle again").1, Vec::<u64>::new());
    let (_, nowhere_in, _) = of("no sender here");
    assert_eq!(nowhere_in.len(), 1);
    assert_eq!(events.iter().filter(|e| e.1.contains(&nowhere_in[0])).count(), 1);
    assert_eq!(of("send elsewhere").1.len(), 1);
    // Perfetto's bindings read it; the dangling field flows are not an error.
    if let Some(out) = run_checker(&bytes, "field-flows", &[]) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("2 flows drawn"), "{stdout}");
    }
    let _ = std::fs::remove_file(&path);
}

/// The usual request/response shape: the sender span stays open until the answer comes, so its begin (held
/// for its values, or sent out when the hold limit passes) is written after its receiver, in a later batch.
/// The flow still links them.
#[test]
fn a_flow_links_a_sender_written_batches_after_its_receiver() {
    use tracing_subscriber::layer::SubscriberExt;
    let _one_at_a_time = exclusive();
    let path = std::env::temp_dir().join(format!("tickline-perfetto-{}-late-sender.pftrace", std::process::id()));
    let timeline = tickline::Timeline::builder()
        .exporter(PerfettoExporter::create(&path).unwrap())
        .start()
        .unwrap();
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
    tracing::dispatcher::with_default(&dispatch, || {
        let _request = tracing::info_span!("request", "tickline.flow_out" = 7u64).entered();
        std::thread::spawn({
            let dispatch = dispatch.clone();
            move || {
                tracing::dispatcher::with_default(&dispatch, || {
                    drop(tracing::info_span!("handle", "tickline.flow_in" = 7u64).entered());
                })
            }
        })
        .join()
        .unwrap();
        // The receiver is exported meanwhile; the request is still open.
        timeline.flush().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
    });
    timeline.shutdown().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let events = named_flows(&bytes);
    let position = |name: &str| events.iter().position(|e| e.0 == name).unwrap();
    assert!(
        position("handle") < position("request"),
        "the receiver is written first: {events:?}"
    );
    let (_, out, _) = &events[position("request")];
    let (_, into, _) = &events[position("handle")];
    assert_eq!(out.len(), 1, "{events:?}");
    assert_eq!(into, out, "{events:?}");
    if let Some(out) = run_checker(&bytes, "late-sender", &[]) {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    }
    let _ = std::fs::remove_file(&path);
}

/// A sender span that becomes an async task (entered twice; or every span a task) is written twice, its poll on
/// the thread and its lifetime on the task's track, both with its fields; so is a receiver under `Always`. The
/// flow is still one arrow: its id on one sender and one receiver (it was on 3 events, and 4: Perfetto chained
/// them). The task's track is named without tickline's own fields.
#[test]
fn a_flow_field_on_an_async_task_links_once() {
    use tracing_subscriber::layer::SubscriberExt;
    let _one_at_a_time = exclusive();
    for (label, mode) in [
        ("auto", tickline::AsyncTasks::Auto),
        ("always", tickline::AsyncTasks::Always),
    ] {
        let path = std::env::temp_dir().join(format!(
            "tickline-perfetto-{}-task-flow-{label}.pftrace",
            std::process::id()
        ));
        let exporter = PerfettoExporter::create(&path).unwrap();
        let uuid = exporter.trace_uuid();
        let timeline = tickline::Timeline::builder()
            .exporter(exporter)
            .async_tasks(mode)
            .start()
            .unwrap();
        let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
        tracing::dispatcher::with_default(&dispatch, || {
            let send = tracing::info_span!("send", "tickline.flow_out" = 42u64);
            drop(send.enter());
            if mode == tickline::AsyncTasks::Auto {
                // A second poll: a task.
                drop(send.enter());
            }
            drop(send);
            drop(tracing::info_span!("receive", "tickline.flow_in" = 42u64).entered());
        });
        timeline.shutdown().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let events = named_flows(&bytes);
        // The field's flow (the polls' flows, from thread to task, are tickline's own).
        let field_flow = |id: &u64| tickline_perfetto::is_field_flow_id(uuid, *id);
        let ids: Vec<u64> = events
            .iter()
            .flat_map(|e| e.1.iter().copied())
            .filter(field_flow)
            .collect();
        let of_flow: Vec<&String> = events
            .iter()
            .filter(|e| e.1.iter().any(field_flow))
            .map(|e| &e.0)
            .collect();
        assert_eq!(
            ids.len(),
            2,
            "{label}: the flow's id on a sender and a receiver only: {events:?}"
        );
        assert_eq!(ids[0], ids[1], "{label}: {events:?}");
        assert!(
            of_flow.contains(&&"send".to_string()) && of_flow.contains(&&"receive".to_string()),
            "{label}: {of_flow:?}"
        );
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains("send tickline.flow_out"),
            "{label}: the task track's name"
        );
        if let Some(out) = run_checker(&bytes, &format!("task-flow-{label}"), &[]) {
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{label}: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let _ = std::fs::remove_file(&path);
    }
}

/// Perfetto nests at most 512 slices on one track: its importer drops a deeper begin, and the end after it
/// then closes the wrong slice, cutting every slice around it short. Slices nested deeper (recursion 1,200 deep
/// here) go on child tracks of their thread's, 512 levels each, so the checker (which replays that rule) finds
/// every slice, none deeper than 512 on its track, and an instant at the bottom on the right one.
#[test]
fn slices_nested_deeper_than_perfetto_shows_on_one_track_go_on_child_tracks() {
    use tracing_subscriber::layer::SubscriberExt;
    let _one_at_a_time = exclusive();
    let path = std::env::temp_dir().join(format!("tickline-perfetto-{}-deep.pftrace", std::process::id()));
    let timeline = tickline::Timeline::builder()
        .exporter(PerfettoExporter::create(&path).unwrap())
        .start()
        .unwrap();
    const DEPTH: usize = 1200;
    // Deep recursion needs a big stack: its own thread.
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(move || {
            tracing::dispatcher::with_default(&dispatch, || {
                fn recurse(depth: usize) {
                    let _level = tracing::info_span!("deep").entered();
                    if depth + 1 < DEPTH {
                        recurse(depth + 1);
                    } else {
                        tracing::info!("bottom");
                    }
                }
                recurse(0);
            })
        })
        .unwrap()
        .join()
        .unwrap();
    timeline.shutdown().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let events = named_flows(&bytes);
    assert_eq!(events.iter().filter(|e| e.0 == "deep").count(), DEPTH, "every begin");
    if let Some(out) = run_checker(&bytes, "deep", &["--expect-slices", "deep=1200"]) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    }
    let _ = std::fs::remove_file(&path);
}

/// Perfetto's importer makes a thread described on a packet sequence whose incremental state is valid that
/// sequence's default thread, and names it (`legacy_event.passthrough_utid`) on every event of the sequence on a
/// track of no thread: a GPU slice would read as done by whichever thread was described last.
#[test]
fn no_thread_is_the_default_of_the_sequence_gpu_slices_are_on() {
    const TRACK_EVENT: u32 = 11;
    const TRACK_DESCRIPTOR: u32 = 60;
    const SEQUENCE_ID: u32 = 10;
    const SEQUENCE_FLAGS: u32 = 13;
    const SEQ_INCREMENTAL_STATE_CLEARED: u64 = 1;
    let bytes = encode(&gpu_batch(true));
    // Per sequence: whether its incremental state was cleared, and whether a thread was described on it since.
    let mut cleared = std::collections::HashSet::new();
    let mut default_thread = std::collections::HashSet::new();
    let (mut threads, mut events_off_threads) = (0, 0);
    let mut thread_uuids = std::collections::HashSet::new();
    for (start, end) in frames(&bytes) {
        let packet = fields_of(&bytes[start..end]);
        let field = |n: u32| packet.iter().find(|f| f.0 == n);
        let sequence = field(SEQUENCE_ID).map_or(0, |f| f.1);
        if field(SEQUENCE_FLAGS).is_some_and(|f| f.1 & SEQ_INCREMENTAL_STATE_CLEARED != 0) {
            cleared.insert(sequence);
        }
        if let Some((_, _, descriptor)) = field(TRACK_DESCRIPTOR) {
            let descriptor = fields_of(descriptor);
            // TrackDescriptor.thread (4).
            if descriptor.iter().any(|f| f.0 == 4) {
                threads += 1;
                thread_uuids.insert(descriptor.iter().find(|f| f.0 == 1).unwrap().1);
                if cleared.contains(&sequence) {
                    default_thread.insert(sequence);
                }
            }
        }
        if let Some((_, _, event)) = field(TRACK_EVENT) {
            let track = fields_of(event).iter().find(|f| f.0 == 11).map(|f| f.1);
            if track.is_some_and(|t| !thread_uuids.contains(&t)) {
                events_off_threads += 1;
                assert!(
                    !default_thread.contains(&sequence),
                    "an event on track {track:?} is on sequence {sequence}, whose default thread Perfetto would name on it"
                );
            }
        }
    }
    assert_eq!(threads, 2, "both threads described");
    assert!(events_off_threads >= 2, "the GPU slice's begin and end were checked");
}

/// A track whose id lies beyond the ones kept in the exporter's vector of open-slice counts (a program that
/// made 16 million tracks: async tasks) still has its slices deeper than 512 moved to child tracks.
#[test]
fn a_track_made_after_sixteen_million_others_still_splits_deep_nesting() {
    const FAR: u64 = (1 << 24) + 5;
    let mut b = sample_batch(false);
    b.new_tracks.push(TrackDescriptor {
        id: TrackId(FAR),
        parent: Some(TrackId(1)),
        kind: TrackKind::Thread {
            pid: 42,
            tid: 99,
            name: "late".into(),
        },
    });
    const DEPTH: u64 = 600;
    for k in 0..DEPTH {
        b.events.push(event(10_000 + k, FAR, EventKind::SliceBegin, 1));
    }
    for k in 0..DEPTH {
        b.events.push(event(20_000 + k, FAR, EventKind::SliceEnd, 1));
    }
    let bytes = encode(&b);
    let text = String::from_utf8_lossy(&bytes);
    assert!(
        text.contains("nested deeper than 512"),
        "no child track for the deep slices"
    );
    if let Some(out) = run_checker(&bytes, "far", &[]) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    }
}

/// An exporter driven by hand and dropped without `flush`, `finish` or `into_inner` writes the packets it
/// holds, as a `BufWriter` does, into its file or its writer: the trace loads with every slice (nothing at all
/// was written before).
#[test]
fn an_exporter_dropped_unfinished_writes_what_it_holds() {
    // The first export writes out at once; the second (the same slices again, later, on the tracks described,
    // without flows) stays in the buffer until the drop.
    let again = || {
        let mut batch = sample_batch(false);
        batch.new_tracks.clear();
        batch.new_names.clear();
        for event in &mut batch.events {
            event.ts_ns += 1_000_000;
            (event.flow_out, event.flow_in) = (None, None);
        }
        batch
    };
    let written = Shared::default();
    let mut exporter = PerfettoExporter::new(written.clone());
    exporter.export(&sample_batch(false)).unwrap();
    let opening = written.len();
    exporter.export(&again()).unwrap();
    assert_eq!(written.len(), opening, "the second export is buffered");
    drop(exporter);
    let from_writer = written.bytes();

    let path = std::env::temp_dir().join(format!("tickline-dropped-{}.pftrace", std::process::id()));
    let mut exporter = PerfettoExporter::create(&path).unwrap();
    exporter.export(&sample_batch(false)).unwrap();
    let file_opening = std::fs::metadata(&path).unwrap().len() as usize;
    exporter.export(&again()).unwrap();
    drop(exporter);
    let from_file = std::fs::read(&path).unwrap();
    assert!(
        from_writer.len() > opening + 100,
        "{} bytes after {opening}",
        from_writer.len()
    );
    assert!(
        from_file.len() > file_opening + 100,
        "{} bytes after {file_opening}",
        from_file.len()
    );
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.ci/check_perfetto.py");
    let checked = Command::new("python3")
        .arg(script)
        .arg(&path)
        .args(["--expect-slices", "frame=2", "--expect-slices", "upload=2"])
        .output();
    std::fs::remove_file(&path).unwrap();
    match checked {
        Ok(out) if out.status.success() => {}
        Ok(out) if String::from_utf8_lossy(&out.stderr).contains("No module named") => {
            eprintln!("SKIP: the Perfetto check: Perfetto's Python bindings are missing")
        }
        Ok(out) => panic!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => eprintln!("SKIP: the Perfetto check: no python3 ({e})"),
    }
}
