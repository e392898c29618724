//! A process killed with SIGKILL keeps all but about its last `flush_interval` in its trace, and the file
//! loads (whole packets only). The test binary runs itself as the child that gets killed.

use std::process::Command;
use std::time::{Duration, Instant};

const CHILD: &str = "TICKLINE_DURABILITY_CHILD";
/// Set: the child calls `std::process::exit` after this many ms instead of waiting to be killed.
const EXIT_AFTER_MS: &str = "TICKLINE_DURABILITY_EXIT_AFTER_MS";

/// Set: the child records as fast as it can (a slice every few µs: tens of MB of trace a second, written in
/// whole blocks past the page cache) instead of ~100 slices a second.
const BUSY: &str = "TICKLINE_DURABILITY_BUSY";

/// Set: the child prints a line once its timeline started (the parent kills it right after).
const SAY_STARTED: &str = "TICKLINE_DURABILITY_SAY_STARTED";

/// Set to a count: the child records that many slices, hands its timeline to a thread that shuts it down, and
/// calls `std::process::exit` at once, while the shutdown is under way.
const EXIT_DURING_SHUTDOWN: &str = "TICKLINE_DURABILITY_EXIT_DURING_SHUTDOWN";

/// The child: ~100 slices per second (or, with [`BUSY`], as many as it can) until it is killed.
#[test]
fn child() {
    let Ok(path) = std::env::var(CHILD) else { return };
    let exporter = tickline_perfetto::PerfettoExporter::create(&path)
        .unwrap()
        .flush_interval(Duration::from_millis(200));
    let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
    if std::env::var_os(SAY_STARTED).is_some() {
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "timeline started").and_then(|()| stdout.flush());
    }
    if let Ok(count) = std::env::var(EXIT_DURING_SHUTDOWN) {
        for _ in 0..count.parse::<usize>().unwrap() {
            let _tick = tickline::scope!("tick");
        }
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            started_tx.send(()).unwrap();
            let _ = timeline.shutdown();
        });
        started_rx.recv().unwrap();
        std::process::exit(0);
    }
    let _timeline = timeline;
    let exit_after = std::env::var(EXIT_AFTER_MS)
        .ok()
        .map(|ms| Duration::from_millis(ms.parse().unwrap()));
    let busy = std::env::var_os(BUSY).is_some();
    let started = Instant::now();
    loop {
        if exit_after.is_some_and(|after| started.elapsed() >= after) {
            std::process::exit(0);
        }
        if busy {
            let _tick = tickline::scope!("tick");
            let spin = Instant::now();
            while spin.elapsed() < Duration::from_micros(2) {}
            continue;
        }
        {
            let _tick = tickline::scope!("tick");
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// This test binary run as the [`child`], writing its trace to `path`.
fn child_writing(path: &std::path::Path) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(CHILD, path);
    command
}

/// Slices named "tick" begun in `bytes` (a cut tail ignored), and their first and last timestamps.
fn ticks(bytes: &[u8]) -> (usize, u64, u64) {
    let (n, first, last, _, _) = walk(bytes);
    (n, first, last)
}

/// [`ticks`], and the timestamp of the last clock snapshot (TracePacket.timestamp, then clock_snapshot: 0x32).
fn ticks_and_last_snapshot(bytes: &[u8]) -> (usize, u64, u64, u64) {
    let (n, first, last, last_snapshot, _) = walk(bytes);
    (n, first, last, last_snapshot)
}

/// [`ticks_and_last_snapshot`], and how many bytes of `bytes` are whole packets (the walk's end).
fn walk(bytes: &[u8]) -> (usize, u64, u64, u64, usize) {
    let mut last_snapshot = 0;
    // The name "tick" is interned once; the begins carry its iid. Count begins by walking the framing and
    // looking for TrackEvent.type = SLICE_BEGIN (0x48 0x01) with TracePacket.timestamp first.
    let (mut n, mut first, mut last, mut pos) = (0, u64::MAX, 0, 0);
    let varint = |data: &[u8], pos: &mut usize| -> Option<u64> {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let b = *data.get(*pos)?;
            *pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
            shift += 7;
        }
    };
    while pos < bytes.len() {
        let mut p = pos;
        let (Some(_key), Some(len)) = (varint(bytes, &mut p), varint(bytes, &mut p)) else {
            break;
        };
        let end = p + len as usize;
        if end > bytes.len() {
            break;
        }
        let body = &bytes[p..end];
        if body.first() == Some(&0x40) {
            let mut q = 1;
            let ts = varint(body, &mut q).unwrap_or(0);
            if body.get(q) == Some(&0x5a) && body.get(q + 2..q + 4) == Some(&[0x48, 0x01]) {
                n += 1;
                first = first.min(ts);
                last = last.max(ts);
            }
            if body.get(q) == Some(&0x32) {
                last_snapshot = last_snapshot.max(ts);
            }
        }
        pos = end;
    }
    (n, first, last, last_snapshot, pos)
}

/// A process that calls `std::process::exit` keeps every slice (the exit hook flushes the timeline), and its
/// trace's end is bracketed by a clock snapshot like a shut-down timeline's (`tickline merge` follows the
/// clocks between snapshots).
#[test]
fn an_exiting_process_keeps_every_slice_and_a_closing_clock_snapshot() {
    let path = std::env::temp_dir().join(format!("tickline-durability-exit-{}.pftrace", std::process::id()));
    let status = child_writing(&path).env(EXIT_AFTER_MS, "700").status().unwrap();
    assert!(status.success());
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let (n, _, last_tick, last_snapshot) = ticks_and_last_snapshot(&bytes);
    assert!(n >= 20, "only {n} slices");
    assert!(
        last_snapshot >= last_tick,
        "the last clock snapshot ({last_snapshot}) is before the last slice ({last_tick})"
    );
}

/// `std::process::exit` while another thread shuts the timeline down: the exit waits for the shutdown, and the
/// trace holds every slice (it was empty, or cut at 1 MiB: the exit hook flushed running timelines only).
#[test]
fn an_exit_during_a_shutdown_keeps_every_slice() {
    for round in 0..3 {
        let path = std::env::temp_dir().join(format!(
            "tickline-durability-exit-shutdown-{}-{round}.pftrace",
            std::process::id()
        ));
        let status = child_writing(&path)
            .env(EXIT_DURING_SHUTDOWN, "20000")
            .status()
            .unwrap();
        assert!(status.success());
        let bytes = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let (n, _, _) = ticks(&bytes);
        assert_eq!(n, 20_000, "round {round}: {} bytes", bytes.len());
    }
}

/// A process killed 100 ms after its timeline started, well inside its first flush interval (200 ms): the
/// trace holds its opening packets and loads (it was an empty file no tool read).
#[test]
fn a_process_killed_at_once_leaves_a_trace_that_loads() {
    use std::io::BufRead as _;
    let path = std::env::temp_dir().join(format!("tickline-durability-early-{}.pftrace", std::process::id()));
    let mut child = child_writing(&path)
        .env(SAY_STARTED, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|line| line.is_ok_and(|l| l.contains("timeline started"))));
    std::thread::sleep(Duration::from_millis(100));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let (_, _, _, _, whole) = walk(&bytes);
    assert!(whole > 0, "{} bytes, no whole packet", bytes.len());
    assert_eq!(whole, bytes.len(), "whole packets only");
}

#[test]
fn a_killed_process_keeps_all_but_its_last_moments() {
    let path = std::env::temp_dir().join(format!("tickline-durability-{}.pftrace", std::process::id()));
    let mut child = child_writing(&path).spawn().unwrap();
    let started = Instant::now();
    std::thread::sleep(Duration::from_millis(2000));
    child.kill().unwrap(); // SIGKILL
    let ran = started.elapsed();
    child.wait().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let (n, first, last) = ticks(&bytes);
    let covered = Duration::from_nanos(last.saturating_sub(first));
    println!(
        "killed after {ran:?}: {} bytes, {n} slices covering {covered:?}",
        bytes.len()
    );
    // The child needs a moment to start its timeline; of the ~1.8 s it recorded, all but about the last
    // flush interval (200 ms) must be in the file. Loose for a loaded 2-core machine.
    assert!(
        covered >= Duration::from_millis(1000),
        "only {covered:?} of trace survived"
    );
    assert!(n >= 60, "only {n} slices survived");
    // And Perfetto's bindings load it, cut tail and all.
    let ok = Command::new("python3")
        .args(["-c", "import perfetto.protos.perfetto.trace.perfetto_trace_pb2"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        std::fs::write(&path, &bytes).unwrap();
        let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.ci/check_perfetto.py");
        let out = Command::new("python3")
            .arg(script)
            .arg(&path)
            .arg("--allow-cut-tail")
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    } else {
        eprintln!("SKIP: the Perfetto check: Perfetto's Python bindings are missing");
    }
}

/// A process killed while it writes tens of MB of trace a second (whole blocks going past the page cache by a
/// writer thread, the partial block through it at each flush): the file is whole packets up to its last few
/// bytes (no hole, no padding, nothing written twice out of place), covers all but the last moments, and
/// loads.
#[test]
fn a_process_killed_mid_burst_leaves_whole_packets_up_to_its_end() {
    for round in 0..3 {
        let path = std::env::temp_dir().join(format!(
            "tickline-durability-busy-{}-{round}.pftrace",
            std::process::id()
        ));
        let mut child = child_writing(&path).env(BUSY, "1").spawn().unwrap();
        // Killed at a different moment each round: mid-write, between writes, around a flush.
        std::thread::sleep(Duration::from_millis(1500 + 137 * round));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let (n, first, last, _, whole) = walk(&bytes);
        let covered = Duration::from_nanos(last.saturating_sub(first));
        println!(
            "round {round}: {} bytes, whole packets up to {whole}, {n} slices covering {covered:?}",
            bytes.len()
        );
        // Past 4 MiB the trace went out in whole direct blocks, not only through the page cache.
        assert!(bytes.len() > 4 << 20, "round {round}: only {} bytes", bytes.len());
        // Only the last packet may be cut (a flush's partial block, then more of it written).
        assert!(
            bytes.len() - whole < 4096,
            "round {round}: packets end at {whole} of {} bytes: a hole or garbage before the end",
            bytes.len()
        );
        assert!(
            covered >= Duration::from_millis(700),
            "round {round}: only {covered:?} survived"
        );
        let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.ci/check_perfetto.py");
        let out = Command::new("python3")
            .arg(script)
            .arg(&path)
            .arg("--allow-cut-tail")
            .output();
        let _ = std::fs::remove_file(&path);
        match out {
            Ok(out) if out.status.success() => {}
            Ok(out) if String::from_utf8_lossy(&out.stderr).contains("No module named") => {
                eprintln!("SKIP: the Perfetto check: Perfetto's Python bindings are missing")
            }
            Ok(out) => panic!("round {round}: {}", String::from_utf8_lossy(&out.stderr)),
            Err(e) => eprintln!("SKIP: the Perfetto check: no python3 ({e})"),
        }
    }
}
