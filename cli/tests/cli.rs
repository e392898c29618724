//! The `tickline` binary, run as a user runs it.

use std::process::Command;

fn tickline(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tickline"))
        .args(args)
        .output()
        .expect("tickline runs")
}

#[test]
fn clock_json_has_the_documented_keys_and_a_small_rate_error() {
    let out = tickline(&["clock", "--seconds", "1", "--json"]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for key in [
        "tsc_reliable",
        "max_shift_ns",
        "monotonic",
        "rate_hz",
        "rate_error_ppm",
        "rate_error_ppm_raw",
    ] {
        assert!(v.get(key).is_some(), "missing key {key} in {v}");
    }
    assert!(v["rate_hz"].as_f64().unwrap() > 1e6, "{v}");
    // Loose on purpose: this runs beside other tests on a shared 2-core machine. The ±0.05 ppm figure is
    // measured by `tickline clock --seconds 10` on a quiet machine (see README).
    let err = v["rate_error_ppm"].as_f64().unwrap();
    assert!(err.abs() < 2.0, "rate error {err} ppm in {v}");
}

#[test]
fn clock_text_report_names_its_findings() {
    let out = tickline(&["clock", "--seconds", "0.5"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("vs CLOCK_MONOTONIC"), "{text}");
    assert!(text.contains("rate:"), "{text}");
}

#[test]
fn bad_arguments_are_a_clear_error() {
    for args in [
        &["clock", "--seconds", "abc"][..],
        &["clock", "--bogus"],
        &["frobnicate"],
        &["clock", "--seconds"],
    ] {
        let out = tickline(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains("--help"), "{args:?}: {err}");
    }
    // Every subcommand has its --help.
    for command in [
        &["--help"][..],
        &["clock", "--help"],
        &["stats", "--help"],
        &["convert", "--help"],
        &["merge", "--help"],
    ] {
        let help = tickline(command);
        assert!(help.status.success(), "{command:?}");
        assert!(
            String::from_utf8_lossy(&help.stdout).contains("Usage: tickline"),
            "{command:?}"
        );
    }
}

#[test]
fn stats_of_an_empty_file_is_a_clear_error() {
    let path = std::env::temp_dir().join(format!("tickline-cli-empty-{}.tickline", std::process::id()));
    std::fs::write(&path, b"").unwrap();
    let out = tickline(&["stats", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the file is empty"), "{err}");
}

/// A raw capture recorded here: spans with fields, native scopes and an event, on two threads.
/// One timeline at a time: native macros on a thread that started no timeline record into the most recently
/// started one, so two tests' timelines side by side would take each other's threads' scopes.
fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn record_capture(path: &std::path::Path) {
    use tracing_subscriber::layer::SubscriberExt;
    let _one_at_a_time = exclusive();
    let timeline = tickline::Timeline::builder().raw_capture(path).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..50u64 {
            let _job = tracing::info_span!("job", i).entered();
            let _step = tickline::scope!("step");
            tracing::info!(i, "done");
        }
    });
    std::thread::spawn(|| {
        for _ in 0..25 {
            let _s = tickline::scope!("background");
        }
    })
    .join()
    .unwrap();
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.dropped_records, 0);
}

#[test]
fn a_raw_capture_is_summarised_and_converted_with_its_recording_process_identity() {
    let dir = std::env::temp_dir().join(format!("tickline-cli-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (capture, converted) = (dir.join("run.tickline"), dir.join("run.pftrace"));
    record_capture(&capture);

    let out = tickline(&["stats", capture.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("raw capture of pid {}", std::process::id())),
        "{text}"
    );
    assert!(text.contains("complete"), "{text}");
    assert!(text.contains("threads:       2"), "{text}");
    assert!(text.contains("CPU clock:") && text.contains("CPU decision:"), "{text}");

    let out = tickline(&["stats", "--json", capture.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["slices"], 125, "{v}");
    assert_eq!(v["dropped_records"], 0, "{v}");
    assert_eq!(v["dropped_slices"], 0, "{v}");
    assert_eq!(v["complete"], true, "{v}");
    assert!(v["cpu_clock"]["decision"].is_string(), "{v}");

    let out = tickline(&["convert", capture.to_str().unwrap(), "-o", converted.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats = tickline_cli::stats::read(&converted).expect("the converted trace loads");
    assert_eq!(stats.slices_by_name.get("job"), Some(&50));
    assert_eq!(stats.slices_by_name.get("step"), Some(&50));
    assert_eq!(stats.slices_by_name.get("background"), Some(&25));
    assert_eq!(stats.thread_tracks, 2);
    // Recorded by this process, not by the `tickline` process that converted it.
    assert_eq!(stats.identity.len(), 1);
    assert!(
        stats.identity[0].contains(&format!("pid {} ", std::process::id())),
        "{:?}",
        stats.identity
    );
    assert_eq!(
        stats.cpu_clock.len(),
        1,
        "the CPU clock decision is in the trace: {stats}"
    );
    // Its clock snapshots are the recording's: the trace's time range is the recording's, not now.
    let (first, last) = stats.time_range.unwrap();
    assert!(last - first < 60_000_000_000, "{first}..{last}");

    // The `stats` text of a .pftrace names the CPU clock decision too.
    let out = tickline(&["stats", converted.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("CPU clock:"));

    // `convert --json` names the file it wrote, as the text does.
    let again = dir.join("again.pftrace");
    let out = tickline(&[
        "convert",
        "--json",
        capture.to_str().unwrap(),
        "-o",
        again.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["output"], again.to_str().unwrap(), "{v}");
    assert_eq!(v["slices"], 125, "{v}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn convert_and_stats_say_clearly_what_is_wrong() {
    let dir = std::env::temp_dir().join(format!("tickline-cli-capture-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let capture = dir.join("run.tickline");
    record_capture(&capture);
    let not_capture = dir.join("notes.txt");
    std::fs::write(&not_capture, b"hello").unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["convert", "/nonexistent/run.tickline", "-o", "/tmp/x.pftrace"],
            "cannot read",
        ),
        (
            &["convert", not_capture.to_str().unwrap(), "-o", "/tmp/x.pftrace"],
            "not a tickline raw capture",
        ),
        (
            &[
                "convert",
                capture.to_str().unwrap(),
                "-o",
                "/nonexistent/dir/out.pftrace",
            ],
            "cannot create trace file",
        ),
        (&["stats", "/nonexistent/run.tickline"], "cannot read"),
    ];
    for (args, expected) in cases {
        let out = tickline(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
    // A capture cut short converts up to its last whole frame, and says so.
    let bytes = std::fs::read(&capture).unwrap();
    let cut = dir.join("cut.tickline");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let out = tickline(&["stats", cut.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cut short"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `tickline` run in `dir`, so that paths can be given relative to it.
fn tickline_in(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tickline"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("tickline runs")
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tickline-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The temporary files an atomic write left behind in `dir` (none, whether it succeeded or not).
fn leftovers(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect()
}

/// The output checked by file identity, not by spelling: each of these named the capture itself, which
/// creating the output truncated before it was read (the capture lost, and the command failed).
#[test]
fn convert_refuses_an_output_that_is_its_capture_under_any_spelling() {
    let dir = scratch("same-file");
    let capture = dir.join("run.tickline");
    record_capture(&capture);
    let bytes = std::fs::read(&capture).unwrap();
    std::os::unix::fs::symlink("run.tickline", dir.join("link.tickline")).unwrap();
    std::fs::hard_link(&capture, dir.join("hard.tickline")).unwrap();
    let absolute = capture.to_str().unwrap();
    let cases: [&[&str]; 5] = [
        &["convert", "run.tickline", "-o", "./run.tickline"],
        &["convert", "run.tickline", "-o", absolute],
        &["convert", absolute, "-o", "link.tickline"],
        &["convert", "link.tickline", "-o", "hard.tickline"],
        &["convert", "run.tickline", "-o", "run.tickline"],
    ];
    for args in cases {
        let out = tickline_in(&dir, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            std::fs::read(&capture).unwrap() == bytes,
            "{args:?}: the capture changed: {err}"
        );
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("the same file") && err.contains(args[1]),
            "{args:?}: {err}"
        );
        assert!(std::fs::symlink_metadata(dir.join("link.tickline"))
            .unwrap()
            .is_symlink());
    }
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    std::fs::remove_dir_all(&dir).ok();
}

/// A failed conversion leaves an existing output as it was (it was truncated before the capture was read),
/// and a successful one replaces it whole, atomically: a reader that had the old output open still reads
/// all of it (it read a truncated, then growing file).
#[test]
fn convert_replaces_an_existing_output_only_when_it_succeeds() {
    let dir = scratch("replace");
    let capture = dir.join("run.tickline");
    record_capture(&capture);
    let output = dir.join("keep.pftrace");
    let old = b"an earlier trace, not to be lost".repeat(1000);
    std::fs::write(&output, &old).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&output, std::fs::Permissions::from_mode(0o640)).unwrap();

    // A capture whose header is right but whose version is not: it fails after the output was created.
    let bad = dir.join("bad.tickline");
    std::fs::write(&bad, b"TICKLINE\0\0\0\0\x03\0\0\0junk").unwrap();
    let short = dir.join("short.tickline");
    std::fs::write(&short, b"TICKLINE").unwrap();
    for input in [&bad, &short] {
        let out = tickline(&["convert", input.to_str().unwrap(), "-o", output.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{input:?}: {err}");
        assert!(err.contains(input.to_str().unwrap()), "{err}");
        assert!(std::fs::read(&output).unwrap() == old, "{input:?}: the output changed");
        assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    }

    // Through a symlink, which stays one: its target is replaced.
    let link = dir.join("link.pftrace");
    std::os::unix::fs::symlink("keep.pftrace", &link).unwrap();
    let mut reader = std::fs::File::open(&output).unwrap();
    let out = tickline(&["convert", capture.to_str().unwrap(), "-o", link.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut before = Vec::new();
    std::io::Read::read_to_end(&mut reader, &mut before).unwrap();
    assert!(
        before == old,
        "the old output was overwritten in place ({} bytes)",
        before.len()
    );
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    let stats = tickline_cli::stats::read(&output).expect("the new trace loads");
    assert_eq!(stats.slices_by_name.get("job"), Some(&50));
    let mode = std::fs::metadata(&output).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640, "the output keeps its mode");
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));

    // Outputs that cannot be replaced by a rename keep their meaningful errors.
    let out = tickline(&["convert", capture.to_str().unwrap(), "-o", "/dev/full"]);
    assert_eq!(out.status.code(), Some(1));
    // Said once, naming the file the user named.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("writing Perfetto trace to /dev/full: "), "{err}");
    assert_eq!(err.matches("export").count(), 1, "{err}");
    let out = tickline(&["convert", capture.to_str().unwrap(), "-o", "/dev/null"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).ok();
}

/// A recording keeps one identity through its traces: a capture converted twice gives the same trace, byte for
/// byte, and `merge` refuses two traces of one recording (the live one and its converted capture, or two
/// conversions), whose slices it would otherwise show twice.
#[test]
fn one_recording_converts_to_the_same_trace_and_merges_once() {
    use tracing_subscriber::layer::SubscriberExt;
    let dir = scratch("one-recording");
    let (capture, live) = (dir.join("run.tickline"), dir.join("live.pftrace"));
    let one_at_a_time = exclusive();
    let timeline = tickline::Timeline::builder()
        .raw_capture(&capture)
        .exporter(tickline_perfetto::PerfettoExporter::create(&live).unwrap())
        .start()
        .unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..20u64 {
            let _job = tracing::info_span!("job", i, "tickline.flow_out" = i).entered();
            let _receive = tracing::info_span!("receive", "tickline.flow_in" = i).entered();
        }
    });
    timeline.shutdown().unwrap();
    drop(one_at_a_time);
    let mut converted = Vec::new();
    for name in ["a.pftrace", "b.pftrace"] {
        let out = tickline_in(&dir, &["convert", "run.tickline", "-o", name]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        converted.push(std::fs::read(dir.join(name)).unwrap());
    }
    assert!(converted[0] == converted[1], "two conversions of one capture differ");
    // Two conversions are one trace (one UUID); the live trace is another trace of the same recording.
    for (a, b, why) in [
        ("a.pftrace", "b.pftrace", "same trace"),
        ("live.pftrace", "a.pftrace", "same recording"),
    ] {
        let out = tickline_in(&dir, &["merge", a, b, "-o", "all.pftrace"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{a} + {b} merged");
        assert!(stderr.contains(why), "{a} + {b}: {stderr}");
    }
    assert!(!dir.join("all.pftrace").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// A report that cannot be written is a clear failure (a full disk), a reader that closed the pipe early is
/// none; neither is a panic (`tickline clock` printed with `println!`, which panics on both).
#[test]
fn a_report_that_cannot_be_written_is_a_clear_error_and_never_a_panic() {
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full");
    if let Ok(full) = full {
        let out = Command::new(env!("CARGO_BIN_EXE_tickline"))
            .args(["clock", "--seconds", "0.5", "--json"])
            .stdout(full)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("cannot write the report"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_tickline"))
        .args(["clock", "--seconds", "0.5"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// One recording of one span, written live to `trace` and raw to `capture`.
fn record_trace_and_capture(trace: &std::path::Path, capture: &std::path::Path) {
    use tracing_subscriber::layer::SubscriberExt;
    let _one_at_a_time = exclusive();
    let timeline = tickline::Timeline::builder()
        .exporter(tickline_perfetto::PerfettoExporter::create(trace).unwrap())
        .raw_capture(capture)
        .start()
        .unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || drop(tracing::info_span!("work").entered()));
    timeline.shutdown().unwrap();
}

/// A trace whose timeline was stopped ends with its end marker, and so does its capture converted; `stats`
/// says so (a killed process's trace has none: see `tests/crash.rs`).
#[test]
#[cfg(feature = "protos")]
fn a_finished_trace_and_its_converted_capture_say_they_ended() {
    let dir = scratch("ended");
    let (trace, capture, converted) = (dir.join("t.pftrace"), dir.join("t.tickline"), dir.join("c.pftrace"));
    record_trace_and_capture(&trace, &capture);
    let out = tickline(&["convert", capture.to_str().unwrap(), "-o", converted.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for file in [&trace, &converted] {
        let out = tickline(&["stats", file.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("ended:         with its timeline stopped"), "{text}");
        let out = tickline(&["stats", file.to_str().unwrap(), "--json"]);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["recordings_ended"], serde_json::json!(1));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `merge --reference` names an input by file identity, as the output check does, and a raw capture given to
/// `merge` says to convert it first.
#[test]
fn merge_names_its_reference_by_identity_and_sends_raw_captures_to_convert() {
    let dir = scratch("merge-reference");
    for name in ["a", "b"] {
        record_trace_and_capture(
            &dir.join(format!("{name}.pftrace")),
            &dir.join(format!("{name}.tickline")),
        );
    }
    let absolute = dir.join("b.pftrace");
    for reference in ["./b.pftrace", absolute.to_str().unwrap()] {
        let out = tickline_in(
            &dir,
            &[
                "merge",
                "a.pftrace",
                "b.pftrace",
                "-o",
                "all.pftrace",
                "--reference",
                reference,
            ],
        );
        assert!(
            out.status.success(),
            "{reference}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = tickline_in(
        &dir,
        &[
            "merge",
            "a.pftrace",
            "c.pftrace",
            "-o",
            "x.pftrace",
            "--reference",
            "b.pftrace",
        ],
    );
    assert!(!out.status.success());
    let out = tickline_in(&dir, &["merge", "a.pftrace", "b.tickline", "-o", "raw.pftrace"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("convert it first"), "{stderr}");
    assert!(!dir.join("raw.pftrace").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// A converted capture carries the recording host's time-sync state with each clock snapshot, as the live trace
/// does: `tickline merge` trusts a host's REALTIME by it (a converted trace had none: "time-sync state unknown").
#[test]
fn a_converted_capture_keeps_the_hosts_time_sync_state() {
    if tickline::sync::time_sync_state().is_none() {
        eprintln!("skipped: this machine has no adjtimex state");
        return;
    }
    let dir = scratch("sync-state");
    record_trace_and_capture(&dir.join("live.pftrace"), &dir.join("run.tickline"));
    let out = tickline_in(&dir, &["convert", "run.tickline", "-o", "converted.pftrace"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let count = |name: &str| {
        let data = std::fs::read(dir.join(name)).unwrap();
        data.windows(b"sync_max_error_ns".len())
            .filter(|w| *w == b"sync_max_error_ns")
            .count()
    };
    let (live, converted) = (count("live.pftrace"), count("converted.pftrace"));
    assert!(live > 0, "the live trace states the sync state");
    assert!(
        converted >= 2,
        "the converted trace states it with each snapshot: {converted} (live {live})"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Options and files that cannot give a right answer are refused: one annotation for both flow ends (every
/// flow was then "without exactly one sender and a receiver"), an empty one, a "trace" with no whole packet
/// (`stats` reported a one-byte file as a cut trace of 0 packets and exited 0).
#[test]
fn merge_flow_options_and_packetless_files_are_clear_errors() {
    let dir = scratch("refusals");
    for (out_field, in_field) in [("i", "i"), ("", "x"), ("x", "")] {
        let out = tickline_in(
            &dir,
            &[
                "merge",
                "a.pftrace",
                "b.pftrace",
                "-o",
                "m.pftrace",
                "--flow-out",
                out_field,
                "--flow-in",
                in_field,
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{out_field:?} {in_field:?}: {stderr}");
        assert!(stderr.contains("--flow-out"), "{stderr}");
    }
    std::fs::write(dir.join("newline.pftrace"), b"\n").unwrap();
    let out = tickline_in(&dir, &["stats", "newline.pftrace"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no whole packet"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Writes `bytes` into a new FIFO at `path` from another thread (the reader opens it); None where no FIFO can
/// be made.
fn fifo_with(path: &std::path::Path, bytes: Vec<u8>) -> Option<std::thread::JoinHandle<()>> {
    let made = Command::new("mkfifo").arg(path).status();
    if !made.is_ok_and(|s| s.success()) {
        return None;
    }
    let path = path.to_owned();
    Some(std::thread::spawn(move || std::fs::write(path, bytes).unwrap()))
}

/// A trace or capture through a pipe (here a FIFO: `<(cat FILE)` and `/dev/stdin` are the same to tickline):
/// read like the file itself. The kind was told from the first bytes, and the file opened again from the
/// start, where a pipe had already given them away.
#[test]
#[cfg(feature = "protos")]
fn stats_convert_and_merge_read_pipes() {
    let dir = scratch("pipes");
    let (trace, capture) = (dir.join("t.pftrace"), dir.join("t.tickline"));
    record_trace_and_capture(&trace, &capture);
    let expected = tickline(&["stats", trace.to_str().unwrap(), "--json"]);
    assert!(expected.status.success());
    let fifo = dir.join("pipe");
    let cases: [(&std::path::Path, Vec<&str>); 3] = [
        (&trace, vec!["stats", "PIPE", "--json"]),
        (&capture, vec!["convert", "PIPE", "-o", "OUT"]),
        (&trace, vec!["merge", "PIPE", "-o", "OUT"]),
    ];
    for (source, args) in cases {
        let Some(writer) = fifo_with(&fifo, std::fs::read(source).unwrap()) else {
            eprintln!("SKIP: no mkfifo here");
            return;
        };
        let out_path = dir.join("out.pftrace");
        let args: Vec<String> = args
            .iter()
            .map(|a| match *a {
                "PIPE" => fifo.display().to_string(),
                "OUT" => out_path.display().to_string(),
                other => other.to_owned(),
            })
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = tickline(&args);
        writer.join().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if args[0] == "stats" {
            let json = |o: &std::process::Output| -> serde_json::Value { serde_json::from_slice(&o.stdout).unwrap() };
            assert_eq!(json(&out)["slices_by_name"], json(&expected)["slices_by_name"]);
        } else {
            let merged = tickline(&["stats", out_path.to_str().unwrap()]);
            assert!(merged.status.success(), "{}", String::from_utf8_lossy(&merged.stderr));
            // Reports name the pipe, not a temporary copy.
            assert!(String::from_utf8_lossy(&out.stdout).contains(fifo.to_str().unwrap()) || args[0] == "convert");
        }
        std::fs::remove_file(&fifo).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `convert` and `merge` writing their trace to stdout (`-o /dev/stdout`, `-o -`) put the trace alone there and
/// their report on stderr: the report followed the trace on stdout, and the piped trace failed to load.
#[test]
#[cfg(feature = "protos")]
fn a_trace_written_to_stdout_is_the_trace_alone() {
    let dir = scratch("stdout");
    let (trace, capture) = (dir.join("t.pftrace"), dir.join("t.tickline"));
    record_trace_and_capture(&trace, &capture);
    let file = dir.join("converted.pftrace");
    let out = tickline(&["convert", capture.to_str().unwrap(), "-o", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("wrote"),
        "the report on stdout, as before"
    );
    let converted = std::fs::read(&file).unwrap();
    for target in ["/dev/stdout", "-"] {
        for command in ["convert", "merge"] {
            let input = if command == "convert" { &capture } else { &trace };
            let out = tickline_in(&dir, &[command, input.to_str().unwrap(), "-o", target]);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{command} -o {target}: {stderr}");
            assert!(
                stderr.contains("wrote") || stderr.contains("merged"),
                "{command} -o {target}: the report on stderr: {stderr}"
            );
            if command == "convert" {
                assert_eq!(out.stdout.len(), converted.len(), "-o {target}: the trace's bytes only");
            }
            let piped = dir.join(format!("piped-{command}.pftrace"));
            std::fs::write(&piped, &out.stdout).unwrap();
            let stats = tickline(&["stats", piped.to_str().unwrap()]);
            assert!(
                stats.status.success(),
                "{command} -o {target}: {}",
                String::from_utf8_lossy(&stats.stderr)
            );
            assert!(!dir.join("-").exists(), "no file named -");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A capture cut inside its magic (1 to 7 bytes) is named a cut capture by `stats` and `convert`, not "not a
/// Perfetto trace".
#[test]
fn a_capture_cut_inside_its_magic_is_called_a_cut_capture() {
    let dir = scratch("cut-magic");
    for len in 1..8 {
        let path = dir.join(format!("cut{len}.tickline"));
        std::fs::write(&path, &b"TICKLINE"[..len]).unwrap();
        for args in [
            vec!["stats", path.to_str().unwrap()],
            vec!["convert", path.to_str().unwrap(), "-o", "x.pftrace"],
        ] {
            let out = tickline_in(&dir, &args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
            assert!(stderr.contains("shorter than the 16-byte header"), "{args:?}: {stderr}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A trace whose whole packets are followed by zero bytes (a file system that extended the file without its
/// data after a crash) reads up to the zeros, as a cut trace does; `merge` takes it too. A packet Perfetto's
/// schema cannot decode is refused by `merge` as by `stats`: copied as it was, it made a merged trace that
/// `stats` rejected.
#[test]
#[cfg(feature = "protos")]
fn a_zero_tail_is_a_cut_and_a_malformed_packet_is_refused_by_merge() {
    let dir = scratch("tails");
    let (trace, capture) = (dir.join("t.pftrace"), dir.join("t.tickline"));
    record_trace_and_capture(&trace, &capture);
    let whole = std::fs::read(&trace).unwrap();
    let mut zero_tail = whole.clone();
    zero_tail.extend_from_slice(&[0; 4096]);
    let tail_path = dir.join("zeros.pftrace");
    std::fs::write(&tail_path, &zero_tail).unwrap();
    let out = tickline(&["stats", tail_path.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["cut_at"], serde_json::json!(whole.len()));
    let merged = dir.join("merged.pftrace");
    let out = tickline(&["merge", tail_path.to_str().unwrap(), "-o", merged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // The first field key of the last packet's body made field number 0: the framing still holds.
    let mut bad = whole.clone();
    let (mut pos, mut last_body) = (0, 0);
    while pos < bad.len() {
        let len_at = pos + 1;
        let (mut len, mut shift, mut k) = (0usize, 0, len_at);
        loop {
            let b = bad[k];
            len |= usize::from(b & 0x7f) << shift;
            k += 1;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
        }
        last_body = k;
        pos = k + len;
    }
    bad[last_body] = 0;
    let bad_path = dir.join("bad.pftrace");
    std::fs::write(&bad_path, &bad).unwrap();
    let stats = tickline(&["stats", bad_path.to_str().unwrap()]);
    assert!(!stats.status.success());
    let out = tickline(&["merge", bad_path.to_str().unwrap(), "-o", merged.to_str().unwrap()]);
    assert!(!out.status.success(), "merge took a packet stats refuses");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a well-formed trace"));
    std::fs::remove_dir_all(&dir).unwrap();
}
