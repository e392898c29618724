//! Processes that end badly, as users' programs do: killed with SIGKILL, or ended with
//! `std::process::exit` while the timeline still runs. The test binary runs itself as the child; the trace
//! it leaves is read back with Perfetto's own schema (`tickline stats`'s reader), and a raw capture left by a
//! killed process is converted with `tickline convert`.
#![cfg(feature = "protos")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Which child to be, and where it writes.
const CHILD: &str = "TICKLINE_CRASH_CHILD";
const TRACE: &str = "TICKLINE_CRASH_TRACE";
const CAPTURE: &str = "TICKLINE_CRASH_CAPTURE";

/// The child's entry point: a no-op unless the environment says which child to be.
#[test]
fn child() {
    let Ok(kind) = std::env::var(CHILD) else { return };
    let trace = std::env::var(TRACE).expect("trace path");
    // The default configuration: a Perfetto file with its default flush interval (500 ms).
    let exporter = tickline_perfetto::PerfettoExporter::create(&trace).expect("trace file");
    let mut builder = tickline::Timeline::builder().exporter(exporter);
    if let Ok(capture) = std::env::var(CAPTURE) {
        builder = builder.raw_capture(capture);
    }
    let timeline = builder.start().expect("timeline");
    tracing_subscriber::registry().with(timeline.layer()).init();
    {
        // The parent of a "steady" child may wait for this line (stdout piped) to kill it at once.
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "timeline started").and_then(|()| stdout.flush());
    }
    match kind.as_str() {
        // ~90 spans a second until killed.
        "steady" => {
            for n in 0u64.. {
                {
                    let _tick = tracing::info_span!("tick", n).entered();
                    std::thread::sleep(Duration::from_micros(300));
                }
                std::thread::sleep(Duration::from_micros(10_800));
            }
        }
        // As many spans as it can until killed: the trace and the capture go out in whole blocks past the page
        // cache (tens of MB a second), and the kill lands anywhere in that.
        "busy" => {
            for n in 0u64.. {
                let _tick = tracing::info_span!("tick", n).entered();
            }
        }
        // 1,000 spans, then `exit` with the timeline still running (never shut down, never dropped).
        "exit" => {
            for n in 0..1000u64 {
                let _work = tracing::info_span!("work", n).entered();
            }
            std::process::exit(0);
        }
        other => panic!("unknown child {other}"),
    }
    // Unreachable ("steady" runs until killed, "exit" exits); keeps the timeline alive to the end.
    drop(timeline);
}

fn spawn_child(kind: &str, trace: &Path, capture: Option<&Path>) -> Child {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(CHILD, kind)
        .env(TRACE, trace)
        .stdout(std::process::Stdio::piped());
    if let Some(capture) = capture {
        command.env(CAPTURE, capture);
    }
    command.spawn().expect("child starts")
}

/// `tickline convert CAPTURE -o CONVERTED`.
fn convert(capture: &Path, converted: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tickline"))
        .args(["convert", capture.to_str().unwrap(), "-o", converted.to_str().unwrap()])
        .output()
        .expect("tickline convert runs")
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tickline-crash-{}-{name}", std::process::id()))
}

/// The first and last begin of the slices named `name`, and how many there are.
fn slices(stats: &tickline_cli::stats::TraceStats, name: &str) -> (u64, Duration) {
    let count = stats.slices_by_name.get(name).copied().unwrap_or(0);
    let covered = stats
        .slice_times_by_name
        .get(name)
        .map_or(Duration::ZERO, |(first, last)| Duration::from_nanos(last - first));
    (count, covered)
}

/// Killed 100 ms after its timeline started, well inside the first flush interval (500 ms): the trace loads
/// and the capture converts (both were empty files that no tool read).
#[test]
fn sigkill_at_once_leaves_a_trace_that_loads_and_a_capture_that_converts() {
    use std::io::BufRead as _;
    let (trace, capture) = (temp("early.pftrace"), temp("early.tickline"));
    let mut child = spawn_child("steady", &trace, Some(&capture));
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("piped")).lines();
    assert!(lines.any(|line| line.is_ok_and(|l| l.contains("timeline started"))));
    std::thread::sleep(Duration::from_millis(100));
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    let stats = tickline_cli::stats::read(&trace).expect("the trace loads");
    assert!(stats.packets > 0 && stats.cut_at.is_none(), "{stats:?}");
    let converted = temp("early-converted.pftrace");
    let out = convert(&capture, &converted);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("not finished by its writer"));
    for path in [&trace, &capture, &converted] {
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn sigkill_after_3_s_keeps_at_least_the_first_2_s_and_the_trace_loads() {
    let (trace, capture) = (temp("killed.pftrace"), temp("killed.tickline"));
    let mut child = spawn_child("steady", &trace, Some(&capture));
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    child.kill().expect("SIGKILL");
    let ran = started.elapsed();
    child.wait().expect("reaped");

    // The Perfetto file: whole packets up to about the last flush interval (500 ms) before the kill.
    let stats = tickline_cli::stats::read(&trace).expect("the trace loads");
    let (count, covered) = slices(&stats, "tick");
    println!(
        "killed after {ran:?}: trace {} bytes, {} packets, {count} spans covering {covered:?}{}",
        stats.bytes,
        stats.packets,
        stats
            .cut_at
            .map_or(String::new(), |at| format!(", cut inside a packet at {at}"))
    );
    assert!(
        covered >= Duration::from_secs(2),
        "only {covered:?} of the 3 s survived"
    );
    assert!(count >= 170, "only {count} spans survived (~90/s for 2 s and more)");
    assert_eq!(stats.recordings_ended, 0, "a killed process's trace has no end marker");
    assert!(stats.to_string().contains("without its end marker"), "{stats}");

    // The raw capture left by the same process: cut anywhere, it converts up to its last whole frame.
    let converted = temp("killed-converted.pftrace");
    let out = convert(&capture, &converted);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(
        text.contains("not finished by its writer") || text.contains("cut short"),
        "a killed capture is reported as such: {text}"
    );
    let from_capture = tickline_cli::stats::read(&converted).expect("the converted trace loads");
    assert_eq!(
        from_capture.recordings_ended, 0,
        "converted from a killed capture: no end marker"
    );
    let (captured, captured_covered) = slices(&from_capture, "tick");
    assert!(
        captured_covered >= Duration::from_secs(2),
        "the capture kept only {captured_covered:?}"
    );
    assert!(captured >= 170, "the capture kept only {captured} spans");
    for path in [&trace, &capture, &converted] {
        let _ = std::fs::remove_file(path);
    }
}

/// Killed while it writes tens of MB a second: the raw capture is whole frames up to a cut at its very end
/// (never a frame failing its check: no hole, no padding, no block written out of place), and converts.
#[test]
fn sigkill_mid_burst_leaves_a_capture_cut_only_at_its_end() {
    for round in 0..3u64 {
        let (trace, capture) = (
            temp(&format!("busy-{round}.pftrace")),
            temp(&format!("busy-{round}.tickline")),
        );
        let mut child = spawn_child("busy", &trace, Some(&capture));
        std::thread::sleep(Duration::from_millis(1500 + 137 * round));
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        let size = std::fs::metadata(&capture).map_or(0, |m| m.len());
        let summary = tickline::capture::convert(&capture, tickline::export::MemoryExporter::new())
            .expect("the capture converts");
        println!(
            "round {round}: capture {size} bytes, {} records, {} slices, stopped: {:?}",
            summary.records, summary.slices, summary.stopped_early
        );
        assert!(
            size > 4 << 20,
            "round {round}: only {size} bytes: no whole blocks written"
        );
        if let Some(why) = &summary.stopped_early {
            assert!(why.contains("the file ends inside"), "round {round}: {why}");
        }
        assert!(summary.slices > 10_000, "round {round}: only {} slices", summary.slices);
        let stats = tickline_cli::stats::read(&trace).expect("the trace loads");
        assert!(stats.packets > 10_000, "round {round}: only {} packets", stats.packets);
        for path in [&trace, &capture] {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[test]
fn exit_with_the_timeline_running_keeps_all_1000_spans() {
    let trace = temp("exit.pftrace");
    let status = spawn_child("exit", &trace, None).wait().expect("child ends");
    assert!(status.success(), "{status:?}");
    let stats = tickline_cli::stats::read(&trace).expect("the trace loads");
    let _ = std::fs::remove_file(&trace);
    assert_eq!(stats.cut_at, None, "the exit flush writes whole packets");
    assert_eq!(stats.slices_by_name.get("work"), Some(&1000), "{stats}");
    assert_eq!(stats.open_slices, 0, "{stats}");
}
