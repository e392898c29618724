//! What a program does to its own threads and process: an exporter that logs through the global subscriber,
//! `fork`, thread-local destructors that record after tickline's per-thread state is gone, a field's `Debug`
//! that creates spans. Each scenario that sets a global subscriber, forks or may hang runs in a child process
//! (this test binary, run again with [`SCENARIO`] set) under a deadline.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tickline::export::{Batch, EventKind, ExportError, Exporter, MemoryExporter};
use tracing_subscriber::layer::SubscriberExt;

/// Set in a child: the scenario it runs (the `child` test runs it and prints its result on stdout).
const SCENARIO: &str = "TICKLINE_PROCESS_SCENARIO";

/// Runs `scenario` in a child process, killed after `deadline`; its stdout, or a panic saying what went wrong.
fn run_child(scenario: &str, deadline: Duration) -> String {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "process::child", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, scenario)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let output = child.wait_with_output().unwrap();
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            assert!(
                status.success(),
                "{scenario}: {status}\n{stdout}\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
            return stdout;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{scenario}: no answer after {deadline:?} (hung)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value printed as `key=value` on a line of `out`.
fn value(out: &str, key: &str) -> u64 {
    out.split_whitespace()
        .find_map(|word| word.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {out}"))
        .parse()
        .unwrap()
}

/// The child's side: runs the scenario named in [`SCENARIO`] (none: this test is a no-op).
#[test]
fn child() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    match scenario.as_str() {
        "exporter_logs" => exporter_logs(),
        "fork" => fork(),
        "late_thread_locals" => late_thread_locals(),
        "debug_makes_spans" => debug_makes_spans(),
        other => panic!("unknown scenario {other}"),
    }
}

/// An exporter that logs through `tracing` on every call, as one whose own code (or a library it calls, via
/// `tracing-log`) is instrumented.
struct LoggingExporter;

impl Exporter for LoggingExporter {
    fn export(&mut self, batch: &Batch) -> Result<(), ExportError> {
        tracing::info!(events = batch.events.len(), "exported a batch");
        let _span = tracing::info_span!("exporter work").entered();
        Ok(())
    }
    fn flush(&mut self) -> Result<(), ExportError> {
        tracing::info!("flushed");
        Ok(())
    }
    fn finish(&mut self) -> Result<(), ExportError> {
        tracing::info!("finished");
        Ok(())
    }
}

/// Lossless mode, the smallest ring and chunk budget, an exporter that logs, the tickline layer in the global
/// subscriber: the collector thread's own events must not wait for room in a ring only it empties.
fn exporter_logs() {
    let memory = MemoryExporter::default();
    let timeline = tickline::Timeline::builder()
        .exporter(LoggingExporter)
        .exporter(memory.clone())
        .lossless(true)
        .ring_capacity(64)
        .chunk_budget(64 * 1024)
        .start()
        .unwrap();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(timeline.layer())).unwrap();
    const THREADS: usize = 2;
    const SPANS: usize = 20_000;
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                for i in 0..SPANS {
                    let _span = tracing::info_span!("app work", i).entered();
                }
            });
        }
    });
    let stats = timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    println!(
        "app={} exporter={} unrecorded={} dropped={}",
        trace.slice_count("app work"),
        trace.slice_count("exporter work"),
        stats.unrecorded_records,
        stats.dropped_records
    );
}

#[test]
fn an_exporter_that_logs_through_the_global_subscriber_neither_deadlocks_nor_feeds_back() {
    let out = run_child("exporter_logs", Duration::from_secs(60));
    assert_eq!(value(&out, "app"), 40_000, "{out}");
    assert_eq!(value(&out, "dropped"), 0, "{out}");
    // The exporter's own spans and events are not recorded (they would be its own input), but counted.
    assert_eq!(value(&out, "exporter"), 0, "{out}");
    assert!(value(&out, "unrecorded") > 0, "{out}");
}

/// A timeline records in the parent, which forks; the child records (lossless: with nothing to drain its
/// ring it would wait forever), flushes and exits. The child must not hang or wait out the exit hook, and the
/// parent's trace goes on unharmed.
fn fork() {
    let memory = MemoryExporter::default();
    let timeline = tickline::Timeline::builder()
        .exporter(memory.clone())
        .lossless(true)
        .ring_capacity(256)
        .start()
        .unwrap();
    let layer = tracing_subscriber::registry().with(timeline.layer());
    let dispatch = tracing::Dispatch::new(layer);
    tracing::dispatcher::with_default(&dispatch, || {
        for _ in 0..100 {
            let _span = tracing::info_span!("before fork").entered();
        }
        let started = Instant::now();
        // SAFETY: the child only records, asks the timeline (which fails at once), and exits; the parent
        // waits for it. Test code: the collector's threads are not in the child, which is the point.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            for _ in 0..10_000 {
                let _span = tracing::info_span!("in the child").entered();
            }
            let flushed = timeline.flush();
            let code = if matches!(flushed, Err(tickline::TicklineError::CollectorGone)) {
                0
            } else {
                3
            };
            std::process::exit(code);
        }
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is a valid out-pointer.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        let child_ms = started.elapsed().as_millis();
        for _ in 0..100 {
            let _span = tracing::info_span!("after fork").entered();
        }
        println!(
            "child_exit={} child_ms={child_ms}",
            if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                99
            }
        );
    });
    let stats = timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    println!(
        "before={} after={} child={} unmatched={} framing={}",
        trace.slice_count("before fork"),
        trace.slice_count("after fork"),
        trace.slice_count("in the child"),
        stats.unmatched_ends,
        stats.framing_errors
    );
}

#[test]
fn a_forked_child_neither_hangs_nor_waits_for_a_collector_it_does_not_have() {
    let out = run_child("fork", Duration::from_secs(60));
    assert_eq!(
        value(&out, "child_exit"),
        0,
        "the child's flush is CollectorGone at once: {out}"
    );
    assert!(
        value(&out, "child_ms") < 2_000,
        "the child waited for a collector: {out}"
    );
    assert_eq!(value(&out, "before"), 100, "{out}");
    assert_eq!(value(&out, "after"), 100, "{out}");
    assert_eq!(value(&out, "child"), 0, "{out}");
    assert_eq!(value(&out, "unmatched"), 0, "{out}");
    assert_eq!(value(&out, "framing"), 0, "{out}");
}

/// A thread-local whose destructor records, first used before the thread's first record: its destructor runs
/// after tickline's per-thread state is gone. What it records cannot be taken, but it is counted.
struct RecordsWhenDropped;

impl Drop for RecordsWhenDropped {
    fn drop(&mut self) {
        tickline::instant!("late instant");
        tracing::info!("late event");
    }
}

thread_local! {
    static LATE: RecordsWhenDropped = const { RecordsWhenDropped };
}

fn late_thread_locals() {
    let memory = MemoryExporter::default();
    let timeline = tickline::Timeline::builder().exporter(memory.clone()).start().unwrap();
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
    std::thread::spawn(move || {
        LATE.with(|_| {});
        let _guard = tracing::dispatcher::set_default(&dispatch);
        tickline::instant!("early instant");
        tracing::info!("early event");
        // Leak the guard: the thread's dispatcher outlives the thread's other thread-locals.
        std::mem::forget(_guard);
    })
    .join()
    .unwrap();
    let stats = timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    // An instant is named; a `tracing` event carries its text as the `message` field.
    let count = |text: &str| {
        trace
            .events
            .iter()
            .filter(|e| e.kind == EventKind::Instant)
            .filter(|e| e.name == text || e.fields.iter().any(|(_, v)| format!("{v:?}").contains(text)))
            .count()
    };
    println!(
        "early={} late={} unrecorded={} dropped={}",
        count("early instant") + count("early event"),
        count("late instant") + count("late event"),
        stats.unrecorded_records,
        stats.dropped_records
    );
}

#[test]
fn records_from_thread_local_destructors_after_tickline_s_are_counted() {
    let out = run_child("late_thread_locals", Duration::from_secs(60));
    assert_eq!(value(&out, "early"), 2, "{out}");
    // Recorded (if the dispatcher and tickline's state still stood) or counted: never lost unseen.
    assert!(
        value(&out, "late") + value(&out, "unrecorded") >= 1,
        "the late records were neither recorded nor counted: {out}"
    );
    assert_eq!(value(&out, "dropped"), 0, "{out}");
}

/// A field's `Debug` that creates and enters a span while an event's or a `record`'s fields are encoded: that
/// span's creation is dropped (the thread is making a record), and so are its slices, counted like any dropped
/// slice.
/// (Global subscriber: a scoped one's dispatch suppresses such nested calls itself.)
fn debug_makes_spans() {
    struct MakesASpan;
    impl std::fmt::Debug for MakesASpan {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            tracing::info_span!("inner", x = 2).in_scope(|| ());
            f.write_str("value")
        }
    }
    let memory = MemoryExporter::default();
    let timeline = tickline::Timeline::builder().exporter(memory.clone()).start().unwrap();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(timeline.layer())).unwrap();
    for _ in 0..10 {
        tracing::info!(value = ?MakesASpan, "outer event");
        let outer = tracing::info_span!("outer", value = tracing::field::Empty).entered();
        outer.record("value", tracing::field::debug(&MakesASpan));
    }
    let stats = timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let events = trace
        .events
        .iter()
        .filter(|e| e.fields.iter().any(|(_, v)| format!("{v:?}").contains("outer event")))
        .count();
    println!(
        "events={events} outer={} inner={} dropped_slices={} dropped_records={}",
        trace.slice_count("outer"),
        trace.slice_count("inner"),
        stats.dropped_slices,
        stats.dropped_records
    );
}

#[test]
fn a_span_created_inside_a_field_s_debug_is_counted_as_a_dropped_slice() {
    let out = run_child("debug_makes_spans", Duration::from_secs(60));
    assert_eq!(value(&out, "events"), 10, "{out}");
    assert_eq!(value(&out, "outer"), 10, "{out}");
    // Every inner span is recorded, or dropped and counted as a dropped slice: none lost unseen.
    assert_eq!(value(&out, "inner") + value(&out, "dropped_slices"), 20, "{out}");
    assert!(value(&out, "dropped_slices") > 0, "{out}");
}
