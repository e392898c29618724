//! The CPU pipeline end to end: hot path -> ring -> collector -> exporter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::exclusive;

use tickline::{
    export::{Batch, EventKind, ExportError, Exporter, FieldValue, MemoryExporter, TrackId, TrackKind},
    AsyncTasks, Timeline,
};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer as _;

/// Counts slices per track and checks order without keeping the events (millions of them).
#[derive(Clone, Default)]
pub(crate) struct Counting(pub(crate) Arc<Mutex<CountingState>>);

#[derive(Default)]
pub(crate) struct CountingState {
    pub(crate) begins: HashMap<TrackId, u64>,
    pub(crate) ends: HashMap<TrackId, u64>,
    depth: HashMap<TrackId, i64>,
    last_ts: HashMap<TrackId, u64>,
    backwards: u64,
    negative_depth: u64,
    thread_tracks: u64,
}

impl Exporter for Counting {
    fn export(&mut self, batch: &Batch) -> Result<(), ExportError> {
        let mut guard = self.0.lock().unwrap();
        let s = &mut *guard;
        s.thread_tracks += batch
            .new_tracks
            .iter()
            .filter(|t| matches!(t.kind, TrackKind::Thread { .. }))
            .count() as u64;
        for e in &batch.events {
            let last = s.last_ts.entry(e.track).or_insert(0);
            if e.ts_ns < *last {
                s.backwards += 1;
            }
            *last = e.ts_ns;
            match e.kind {
                EventKind::SliceBegin => {
                    *s.begins.entry(e.track).or_insert(0) += 1;
                    *s.depth.entry(e.track).or_insert(0) += 1;
                }
                EventKind::SliceEnd => {
                    *s.ends.entry(e.track).or_insert(0) += 1;
                    let d = s.depth.entry(e.track).or_insert(0);
                    *d -= 1;
                    if *d < 0 {
                        s.negative_depth += 1;
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
    fn flush(&mut self) -> Result<(), ExportError> {
        Ok(())
    }
}

#[test]
fn lossless_two_threads_a_million_spans_each_arrive_exactly() {
    let _x = exclusive();
    const SPANS: u64 = 1_000_000;
    let counting = Counting::default();
    // One span re-entered a million times: with task tracks every enter would also be a poll on the task's
    // track; this test counts what the rings carried.
    let timeline = Timeline::builder()
        .lossless(true)
        .async_tasks(AsyncTasks::Never)
        .exporter(counting.clone())
        .start()
        .unwrap();
    let layer = timeline.layer();
    std::thread::scope(|s| {
        for t in 0..2 {
            let layer = layer.clone();
            s.spawn(move || {
                let subscriber = tracing_subscriber::registry().with(layer);
                tracing::subscriber::with_default(subscriber, || {
                    let span = tracing::info_span!("work", thread = t);
                    for _ in 0..SPANS {
                        let _e = span.enter();
                    }
                });
            });
        }
    });
    let stats = timeline.shutdown().unwrap();
    let s = counting.0.lock().unwrap();
    assert_eq!(stats.dropped_records, 0);
    assert_eq!(s.begins.values().sum::<u64>(), 2 * SPANS, "{stats:?}");
    assert_eq!(s.ends.values().sum::<u64>(), 2 * SPANS);
    assert_eq!(s.thread_tracks, 2);
    assert_eq!(s.backwards, 0, "timestamps went backwards on a track");
    assert_eq!(s.negative_depth, 0);
    assert!(s.depth.values().all(|&d| d == 0));
}

#[test]
fn drop_mode_accounts_for_every_record() {
    let _x = exclusive();
    const ITERATIONS: u64 = 200_000;
    let counting = Counting::default();
    // A tiny ring and a collector that drains only when flushed: most slices are dropped, whole, and every
    // dropped record is counted.
    let timeline = Timeline::builder()
        .ring_capacity(64)
        .async_tasks(AsyncTasks::Never)
        .exporter(counting.clone())
        .start()
        .unwrap();
    timeline.pause_drain(true);
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!("hot");
        timeline.flush().unwrap();
        for i in 0..ITERATIONS {
            let _e = span.enter();
            if i % 10_000 == 0 {
                drop(_e);
                timeline.flush().unwrap();
            }
        }
        timeline.flush().unwrap();
    });
    let stats = timeline.shutdown().unwrap();
    let s = counting.0.lock().unwrap();
    let begins: u64 = s.begins.values().sum();
    assert!(stats.dropped_records > 0, "the test must overflow the ring: {stats:?}");
    // A slice is exported or dropped whole (enter and exit), never half.
    assert_eq!(stats.dropped_records, 2 * stats.dropped_slices, "{stats:?}");
    assert_eq!(begins + stats.dropped_slices, ITERATIONS, "{stats:?}");
    // Every record the thread made was taken or dropped: the span's creation, its enters and exits, its close
    // (the markers the ring put where it dropped records are not the program's).
    assert_eq!(stats.records + stats.dropped_records, 2 * ITERATIONS + 2, "{stats:?}");
    assert_eq!(s.ends.values().sum::<u64>(), begins);
    assert_eq!(stats.truncated_slices, 0);
    assert_eq!(s.negative_depth, 0);
    assert_eq!(s.backwards, 0);
}

#[test]
fn a_thread_that_exits_mid_run_loses_nothing() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let layer = timeline.layer();
    std::thread::Builder::new()
        .name("short-lived".into())
        .spawn(move || {
            let subscriber = tracing_subscriber::registry().with(layer);
            tracing::subscriber::with_default(subscriber, || {
                for i in 0..100 {
                    let _s = tracing::info_span!("brief", i).entered();
                }
            });
        })
        .unwrap()
        .join()
        .unwrap();
    timeline.flush().unwrap();
    let trace = memory.snapshot();
    let track = trace
        .thread_track("short-lived")
        .expect("the exited thread has its track");
    assert_eq!(
        trace
            .events_on(track)
            .filter(|e| e.kind == EventKind::SliceBegin)
            .count(),
        100
    );
    assert_eq!(
        trace.events_on(track).filter(|e| e.kind == EventKind::SliceEnd).count(),
        100
    );
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.threads, 1);
}

/// A slice a thread leaves open when it exits (a guard forgotten, a span never exited) ends when the thread
/// did, marked truncated: not at the thread's last record, tens of ms earlier, and never after the exit.
#[test]
fn a_slice_left_open_by_an_exiting_thread_ends_when_the_thread_did() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let (last_record_ns, exiting_ns, joined_ns) = {
        let (last_record_ns, exiting_ns) = std::thread::Builder::new()
            .name("leaves-open".into())
            .spawn(|| {
                std::mem::forget(tickline::scope!("left open"));
                let last_record_ns = tickline::clock::monotonic_ns().0;
                std::thread::sleep(std::time::Duration::from_millis(30));
                (last_record_ns, tickline::clock::monotonic_ns().0)
            })
            .unwrap()
            .join()
            .unwrap();
        (last_record_ns, exiting_ns, tickline::clock::monotonic_ns().0)
    };
    timeline.flush().unwrap();
    let trace = memory.snapshot();
    let slices = trace.slices();
    let slice = slices.iter().find(|s| s.name == "left open").expect("the slice");
    assert_eq!(slice.field("tickline.truncated"), Some(&FieldValue::Bool(true)));
    assert!(slice.begin_ns <= last_record_ns, "{slice:?}");
    // The end lies between the last clock read in the thread and the join (the conversion's error is tens
    // of ns; allow 2 us).
    assert!(
        slice.end_ns + 2_000 >= exiting_ns && slice.end_ns <= joined_ns + 2_000,
        "ended at {} ns, the thread was exiting at {exiting_ns} and joined at {joined_ns} (its last record at \
         {last_record_ns})",
        slice.end_ns
    );
    timeline.shutdown().unwrap();
}

/// A calibration setting out of its range is a clear error at start, never a timeline that cannot calibrate
/// (no samples) or one whose start takes minutes (a billion samples a burst).
#[test]
fn an_out_of_range_calibration_setting_is_an_error_at_start() {
    let _x = exclusive();
    for burst_samples in [0, 3, 1_000_000_000] {
        let config = tickline::clock::TscCalibratorConfig {
            burst_samples,
            ..Default::default()
        };
        let started = std::time::Instant::now();
        let result = Timeline::builder().calibration(config).start();
        let error = result
            .err()
            .unwrap_or_else(|| panic!("{burst_samples} samples a burst started"));
        assert!(
            matches!(
                error,
                tickline::TicklineError::Calibration(tickline::calibration::CalibrationError::InvalidConfig { .. })
            ),
            "{error:?}"
        );
        assert!(error.to_string().contains("burst_samples"), "{error}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }
    let fewest = tickline::clock::TscCalibratorConfig {
        burst_samples: tickline::clock::TscCalibratorConfig::MIN_BURST_SAMPLES,
        ..Default::default()
    };
    Timeline::builder()
        .calibration(fewest)
        .start()
        .unwrap()
        .shutdown()
        .unwrap();
}

#[test]
fn composes_with_fmt_and_env_filter_and_per_layer_filters() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let written = Arc::new(Mutex::new(Vec::<u8>::new()));
    let writer = {
        let written = written.clone();
        move || Capture(written.clone())
    };
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("debug"))
        .with(tracing_subscriber::fmt::layer().with_writer(writer).with_ansi(false))
        .with(
            timeline
                .layer()
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO),
        );
    tracing::subscriber::with_default(subscriber, || {
        let _outer = tracing::info_span!("outer", user = "ada").entered();
        tracing::debug!("only fmt sees this");
        tracing::info!(count = 3, "both see this");
        let _trace_level = tracing::trace_span!("filtered out by EnvFilter").entered();
    });
    timeline.flush().unwrap();
    let fmt_output = String::from_utf8(written.lock().unwrap().clone()).unwrap();
    assert!(fmt_output.contains("only fmt sees this"), "{fmt_output}");
    assert!(fmt_output.contains("both see this"), "{fmt_output}");
    let trace = memory.snapshot();
    assert_eq!(trace.slice_count("outer"), 1);
    assert_eq!(trace.slice_count("filtered out by EnvFilter"), 0);
    let instants: Vec<_> = trace.events.iter().filter(|e| e.kind == EventKind::Instant).collect();
    assert_eq!(instants.len(), 1, "{instants:?}");
    let fields = &instants[0].fields;
    assert!(fields.contains(&("count".into(), FieldValue::I64(3))), "{fields:?}");
    assert!(
        fields.contains(&("message".into(), FieldValue::Str("both see this".into()))),
        "{fields:?}"
    );
    let outer = trace.events.iter().find(|e| e.name == "outer").unwrap();
    assert_eq!(outer.fields, vec![("user".into(), FieldValue::Str("ada".into()))]);
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn reentered_and_cross_thread_spans_give_one_slice_per_enter_on_the_entering_thread() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let layer = timeline.layer();
    let subscriber = Arc::new(tracing_subscriber::registry().with(layer));
    let span = tracing::subscriber::with_default(subscriber.clone(), || {
        let span = tracing::info_span!("shared", stage = 1);
        span.record("stage", 2);
        {
            let _a = span.enter();
            let _b = span.enter(); // re-entered while entered
        }
        span
    });
    std::thread::Builder::new()
        .name("other".into())
        .spawn({
            let subscriber = subscriber.clone();
            move || {
                tracing::subscriber::with_default(subscriber, || {
                    let _e = span.enter();
                    drop(_e);
                    drop(span); // closed on this thread
                });
            }
        })
        .unwrap()
        .join()
        .unwrap();
    timeline.flush().unwrap();
    let trace = memory.snapshot();
    let other = trace.thread_track("other").unwrap();
    let other_slices: Vec<_> = trace
        .events_on(other)
        .filter(|e| e.kind == EventKind::SliceBegin)
        .collect();
    assert_eq!(other_slices.len(), 1);
    assert_eq!(other_slices[0].fields, vec![("stage".into(), FieldValue::I64(2))]);
    let on_threads = |name: &str| {
        trace
            .slices()
            .iter()
            .filter(|s| s.name == name && trace.is_thread_track(s.track))
            .count()
    };
    assert_eq!(on_threads("shared"), 3, "two on the creating thread, one on `other`");
    // Entered twice and on two threads: an async task, its life one slice, its three polls its children.
    let tasks = trace.async_task_tracks();
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    let on_task: Vec<_> = trace.slices().into_iter().filter(|s| s.track == tasks[0].id).collect();
    assert_eq!(on_task.iter().filter(|s| s.name == "shared").count(), 1);
    assert_eq!(
        on_task.iter().filter(|s| s.name == "poll").count(),
        2,
        "the nested enter is not a poll"
    );
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.unmatched_ends, 0);
    assert_eq!(stats.unknown_spans, 0);
}

#[test]
fn native_scopes_instants_and_counters() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let before = tickline::clock::monotonic_ns().0;
    for i in 0..10 {
        let _outer = tickline::scope!("outer");
        let _inner = tickline::scope!("inner");
        tickline::instant!("tick");
        tickline::counter!("depth", i);
    }
    // The same name at other call sites, on another thread too: the same track (it was one per call site).
    tickline::counter!("depth", 10);
    std::thread::spawn(|| tickline::counter!("depth", 11)).join().unwrap();
    let after = tickline::clock::monotonic_ns().0;
    timeline.flush().unwrap();
    let trace = memory.snapshot();
    assert_eq!(trace.slice_count("outer"), 10);
    assert_eq!(trace.slice_count("inner"), 10);
    assert_eq!(trace.events.iter().filter(|e| e.name == "tick").count(), 10);
    let depth_tracks: Vec<_> = trace
        .tracks
        .iter()
        .filter(|t| matches!(&t.kind, TrackKind::Counter { name, .. } if name == "depth"))
        .collect();
    assert_eq!(depth_tracks.len(), 1, "one track per counter name: {depth_tracks:?}");
    let counter_track = depth_tracks[0];
    let values: Vec<f64> = trace
        .events_on(counter_track.id)
        .map(|e| match e.kind {
            EventKind::Counter(v) => v,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(values, (0..12).map(f64::from).collect::<Vec<_>>());
    // Converted timestamps land inside the window the scopes ran in.
    for e in trace.events.iter().filter(|e| e.name == "outer" || e.name == "inner") {
        assert!(
            e.ts_ns + 50_000 >= before && e.ts_ns <= after + 50_000,
            "{} not in [{before}, {after}]",
            e.ts_ns
        );
    }
    // Nesting holds on the thread track: begin outer, begin inner, end inner, end outer.
    let track = trace.events.iter().find(|e| e.name == "outer").unwrap().track;
    let kinds: Vec<_> = trace
        .events_on(track)
        .take(5)
        .map(|e| (e.kind, e.name.clone()))
        .collect();
    assert_eq!(kinds[0], (EventKind::SliceBegin, "outer".into()));
    assert_eq!(kinds[1], (EventKind::SliceBegin, "inner".into()));
    assert_eq!(kinds[2], (EventKind::Instant, "tick".into()));
    assert_eq!(kinds[3].0, EventKind::SliceEnd);
    assert_eq!(kinds[4].0, EventKind::SliceEnd);
    // tickline's own counters are there from the start.
    for own in [
        "tickline dropped records",
        "tickline TSC drift",
        "tickline TSC error bound",
        "tickline CPU timestamp uncertainty",
    ] {
        assert!(
            trace
                .tracks
                .iter()
                .any(|t| matches!(&t.kind, TrackKind::Counter { name, .. } if name == own)),
            "missing {own}"
        );
    }
}

/// Two threads, each with a timeline of its own started on it (as parallel tests have): each thread's native
/// scopes, instants and counters go to its own timeline, whichever started last. A thread that started none
/// records into the most recently started one still running, and a thread whose timeline stopped does too.
#[test]
fn native_macros_record_into_the_timeline_their_thread_started() {
    let _x = exclusive();
    let (a_started, a_go) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    let memory_b = MemoryExporter::new();
    let memory_a = std::thread::scope(|s| {
        let a = s.spawn(|| {
            let memory = MemoryExporter::new();
            let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
            a_started.wait();
            // B has started its timeline since: the latest, but not this thread's.
            a_go.wait();
            drop(tickline::scope!("from a"));
            tickline::instant!("instant a");
            tickline::counter!("counter a", 1);
            timeline.shutdown().unwrap();
            // This thread's timeline stopped: B's, the one still running, takes its records.
            drop(tickline::scope!("from a after its timeline"));
            memory
        });
        a_started.wait();
        let timeline_b = Timeline::builder().exporter(memory_b.clone()).start().unwrap();
        a_go.wait();
        drop(tickline::scope!("from b"));
        let memory_a = a.join().unwrap();
        // A thread that started no timeline: the most recently started one still running (B's).
        std::thread::spawn(|| drop(tickline::scope!("from a worker")))
            .join()
            .unwrap();
        timeline_b.shutdown().unwrap();
        memory_a
    });
    let (a, b) = (memory_a.snapshot(), memory_b.snapshot());
    assert_eq!(a.slice_count("from a"), 1);
    assert_eq!(a.events.iter().filter(|e| e.name == "instant a").count(), 1);
    assert!(a
        .tracks
        .iter()
        .any(|t| matches!(&t.kind, TrackKind::Counter { name, .. } if name == "counter a")));
    assert_eq!(b.slice_count("from a"), 0);
    assert!(!b
        .tracks
        .iter()
        .any(|t| matches!(&t.kind, TrackKind::Counter { name, .. } if name == "counter a")));
    assert_eq!(b.slice_count("from b"), 1);
    assert_eq!(a.slice_count("from b"), 0);
    assert_eq!(b.slice_count("from a after its timeline"), 1);
    assert_eq!(b.slice_count("from a worker"), 1);
}

/// `records + dropped_records` is what the program made: the same workload in lossless mode (nothing
/// dropped) and into a full ring, where a span's creation is dropped and so are the `record`s that follow it.
#[test]
fn records_and_dropped_records_add_up_to_what_the_program_made() {
    let _x = exclusive();
    let workload = || {
        for i in 0..100u64 {
            tracing::info!(i, "filler");
        }
        let long = "x".repeat(300);
        let span = tracing::info_span!("s", k = 1u64, text = %long, v = tracing::field::Empty);
        {
            let _e = span.enter();
            span.record("v", tracing::field::display(&long));
        }
        drop(span);
    };
    let run = |lossless: bool| {
        let timeline = Timeline::builder()
            .ring_capacity(64)
            .lossless(lossless)
            .start()
            .unwrap();
        if !lossless {
            timeline.pause_drain(true);
        }
        let subscriber = tracing_subscriber::registry().with(timeline.layer());
        tracing::subscriber::with_default(subscriber, workload);
        timeline.pause_drain(false);
        timeline.shutdown().unwrap()
    };
    let (all, full) = (run(true), run(false));
    assert_eq!(all.dropped_records, 0, "{all:?}");
    assert!(full.dropped_records > 0, "{full:?}");
    assert_eq!(full.records + full.dropped_records, all.records, "{full:?}");
}

#[test]
fn an_exporter_failure_is_reported_and_the_others_keep_going() {
    let _x = exclusive();
    struct Failing;
    impl Exporter for Failing {
        fn export(&mut self, _: &Batch) -> Result<(), ExportError> {
            Err(ExportError::Io(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "disk full",
            )))
        }
        fn flush(&mut self) -> Result<(), ExportError> {
            Ok(())
        }
    }
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder()
        .exporter(Failing)
        .exporter(memory.clone())
        .start()
        .unwrap();
    {
        let _s = tickline::scope!("still recorded");
    }
    let err = timeline.flush().unwrap_err();
    // The exporter's error as it was: an I/O error of its kind, its message once.
    match &err {
        tickline::TicklineError::Export(ExportError::Io(io)) => {
            assert_eq!(io.kind(), std::io::ErrorKind::StorageFull);
            assert_eq!(io.to_string(), "disk full");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(err.to_string().matches("export I/O error").count(), 1, "{err}");
    assert_eq!(memory.snapshot().slice_count("still recorded"), 1);
    assert_eq!(timeline.stats().export_failures, 1);
}

#[test]
fn an_exporters_own_failure_comes_back_as_its_own_error() {
    let _x = exclusive();
    struct Refusing;
    impl Exporter for Refusing {
        fn export(&mut self, _: &Batch) -> Result<(), ExportError> {
            Err(ExportError::Other("the viewer went away".into()))
        }
        fn flush(&mut self) -> Result<(), ExportError> {
            Ok(())
        }
    }
    let timeline = Timeline::builder().exporter(Refusing).start().unwrap();
    {
        let _s = tickline::scope!("work");
    }
    let err = timeline.flush().unwrap_err();
    assert!(
        matches!(&err, tickline::TicklineError::Export(ExportError::Other(m)) if m == "the viewer went away"),
        "{err:?}"
    );
    let err = timeline.shutdown().unwrap_err();
    assert!(
        matches!(&err, tickline::TicklineError::Export(ExportError::Other(_))),
        "{err:?}"
    );
}

/// An exporter that panics at a chosen call: `origin` (0), the `n`th batch (n), a flush or the finish.
struct Panicking {
    at: &'static str,
    batches: u32,
}

impl Exporter for Panicking {
    fn origin(&mut self, _: &tickline::export::RecordingOrigin) {
        if self.at == "origin" {
            panic!("origin refused");
        }
    }
    fn export(&mut self, _: &Batch) -> Result<(), ExportError> {
        self.batches += 1;
        if self.at == "batch" && self.batches == 2 {
            panic!("batch {} refused", self.batches);
        }
        Ok(())
    }
    fn flush(&mut self) -> Result<(), ExportError> {
        if self.at == "flush" {
            panic!("flush refused");
        }
        Ok(())
    }
    fn finish(&mut self) -> Result<(), ExportError> {
        if self.at == "finish" {
            panic!("finish refused");
        }
        Ok(())
    }
}

#[test]
fn an_exporter_that_panics_is_a_failed_exporter_and_the_others_get_everything() {
    let _x = exclusive();
    for at in ["origin", "batch", "flush", "finish"] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder()
            .exporter(Panicking { at, batches: 0 })
            .exporter(memory.clone())
            .lossless(true)
            .ring_capacity(1024)
            .chunk_budget(0)
            .start()
            .expect("a panic in origin does not reach start's caller");
        let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
        let mut flushes = Vec::new();
        for round in 0..4u64 {
            tracing::dispatcher::with_default(&dispatch, || {
                for i in 0..10u64 {
                    tracing::info_span!("round", round, i).in_scope(|| {});
                }
            });
            flushes.push(timeline.flush());
        }
        // More than the chunk budget holds, in lossless mode: the collector must still be there to take it.
        tracing::dispatcher::with_default(&dispatch, || {
            for i in 0..50_000u64 {
                tracing::info_span!("hard", i).in_scope(|| {});
            }
        });
        drop(dispatch);
        let end = timeline.shutdown();
        let failure = if at == "finish" {
            assert!(flushes.iter().all(Result::is_ok), "{at}: {flushes:?}");
            end.unwrap_err()
        } else {
            assert!(flushes.iter().any(Result::is_err), "{at}: {flushes:?}");
            end.unwrap_err()
        };
        assert!(
            matches!(&failure, tickline::TicklineError::Export(ExportError::Panicked(m)) if m.ends_with("refused")),
            "{at}: {failure:?}"
        );
        let trace = memory.snapshot();
        assert_eq!(trace.slice_count("round"), 40, "{at}");
        assert_eq!(trace.slice_count("hard"), 50_000, "{at}");
    }
}

#[test]
fn an_exit_out_of_stack_order_splits_the_inner_slice_and_marks_the_cut() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        let outer = tracing::info_span!("outer span").entered();
        let inner = tracing::info_span!("inner span", k = 1).entered();
        drop(outer);
        drop(inner);
    });
    {
        let outer = tickline::scope!("outer scope");
        let inner = tickline::scope!("inner scope");
        drop(outer);
        drop(inner);
    }
    timeline.shutdown().unwrap();
    let slices = memory.snapshot().slices();
    for (outer, inner) in [("outer span", "inner span"), ("outer scope", "inner scope")] {
        let outer: Vec<_> = slices.iter().filter(|s| s.name == outer).collect();
        let mut parts: Vec<_> = slices.iter().filter(|s| s.name == inner).collect();
        parts.sort_by_key(|s| s.begin_ns);
        assert_eq!((outer.len(), parts.len()), (1, 2), "{slices:?}");
        let (outer, cut, rest) = (outer[0], parts[0], parts[1]);
        let split = |s: &tickline::export::RecordedSlice| s.field("tickline.split").cloned();
        // Cut where the outer slice ends, inside it, and marked; going on at once, at the top, unmarked.
        assert_eq!(
            (cut.depth, cut.end_ns, split(cut)),
            (1, outer.end_ns, Some(FieldValue::Bool(true)))
        );
        assert_eq!((rest.depth, rest.begin_ns, split(rest)), (0, outer.end_ns, None));
        assert!(rest.end_ns >= rest.begin_ns);
        if inner == "inner span" {
            assert_eq!(cut.field("k"), Some(&FieldValue::I64(1)));
            assert_eq!(rest.field("k"), Some(&FieldValue::I64(1)));
        }
    }
}

/// Guards of one call site dropped out of order, as a guard replaced in a loop is (`current =
/// Some(scope!(..))` begins the next scope before the old guard drops) or a queue of guards dropped oldest
/// first: each end closes its own scope's slice (split where an earlier one ends, as any end out of stack
/// order). Matched by call site alone, the first step's slice took the last end (one 15 ms slice and five of
/// under 2 µs).
#[test]
fn scope_guards_of_one_call_site_dropped_out_of_order_each_end_their_own_slice() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let mut brackets = Vec::new();
    let mut current = None;
    for step in 0..6u64 {
        let before = std::time::Instant::now();
        current = Some(tickline::scope!("step"));
        brackets.push((before, std::time::Instant::now()));
        if step < 5 {
            std::thread::sleep(Duration::from_millis(step + 1));
        }
    }
    let before = std::time::Instant::now();
    drop(current);
    brackets.push((before, std::time::Instant::now()));
    // A queue of guards dropped oldest first, a pause between the drops: each scope's slice goes from its own
    // begin to its own end (inner ones cut where the outer end, and going on).
    let now = || tickline::clock::monotonic_ns().0;
    let mut queue = std::collections::VecDeque::new();
    let mut pushed = Vec::new();
    for _ in 0..3 {
        let before = now();
        queue.push_back(tickline::scope!("queued"));
        pushed.push((before, now()));
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut popped = Vec::new();
    for _ in 0..3 {
        let before = now();
        queue.pop_front();
        popped.push((before, now()));
        std::thread::sleep(Duration::from_millis(2));
    }
    timeline.shutdown().unwrap();
    let slices = memory.snapshot().slices();
    // A step's slice goes from its begin to its end, cut (marked) where the step before it ends, just after
    // it began: its longer part is the step's duration, which the brackets bound.
    let check = |name: &str, truth: Vec<(Duration, Duration)>| {
        let mut parts: Vec<u64> = slices
            .iter()
            .filter(|s| s.name == name && s.field("tickline.split").is_none())
            .map(|s| s.end_ns - s.begin_ns)
            .collect();
        parts.sort_unstable();
        let mut truth: Vec<(u64, u64)> = truth
            .into_iter()
            .map(|(lo, hi)| (lo.as_nanos() as u64, hi.as_nanos() as u64))
            .collect();
        truth.sort_unstable();
        assert_eq!(parts.len(), truth.len(), "{name}: {parts:?} against {truth:?}");
        for (part, (lo, hi)) in parts.iter().zip(&truth) {
            // 20 µs for the conversion's error at both ends (stated in tens of ns once calibrated).
            assert!(
                *part + 20_000 >= *lo && *part <= hi + 20_000,
                "{name}: {parts:?} against {truth:?}"
            );
        }
    };
    let steps = (0..6)
        .map(|k| (brackets[k + 1].0 - brackets[k].1, brackets[k + 1].1 - brackets[k].0))
        .collect();
    check("step", steps);
    // 20 µs for the conversion's error (stated in tens of ns once calibrated).
    let within = |ns: u64, (lo, hi): (u64, u64)| ns + 20_000 >= lo && ns <= hi + 20_000;
    let queued: Vec<_> = slices.iter().filter(|s| s.name == "queued").collect();
    let split = |s: &tickline::export::RecordedSlice| s.field("tickline.split").is_some();
    // The first scope: one whole slice, from the first push to the first pop (matched by call site alone it
    // ended at the last pop).
    let first: Vec<_> = queued.iter().filter(|s| within(s.begin_ns, pushed[0])).collect();
    assert_eq!(first.len(), 1, "{queued:#?}");
    assert!(within(first[0].end_ns, popped[0]) && !split(first[0]), "{queued:#?}");
    // The later scopes begin inside the first, so their first parts are cut where it ends, marked.
    for push in &pushed[1..] {
        let begun: Vec<_> = queued.iter().filter(|s| within(s.begin_ns, *push)).collect();
        assert_eq!(begun.len(), 1, "{queued:#?}");
        assert!(split(begun[0]) && within(begun[0].end_ns, popped[0]), "{queued:#?}");
    }
    // The last scope's last part: from the second pop to the third, at the top.
    let last: Vec<_> = queued.iter().filter(|s| within(s.end_ns, popped[2])).collect();
    assert_eq!(last.len(), 1, "{queued:#?}");
    assert!(
        within(last[0].begin_ns, popped[1]) && last[0].depth == 0 && !split(last[0]),
        "{queued:#?}"
    );
}

#[test]
fn a_scope_ends_in_the_timeline_it_began_in_when_a_newer_one_starts_meanwhile() {
    let _x = exclusive();
    let (first, second) = (MemoryExporter::default(), MemoryExporter::default());
    let a = Timeline::builder().exporter(first.clone()).start().unwrap();
    let guard = tickline::scope!("spans both starts");
    let b = Timeline::builder().exporter(second.clone()).start().unwrap();
    drop(guard);
    {
        let _s = tickline::scope!("in the newer one");
    }
    let (b_stats, a_stats) = (b.shutdown().unwrap(), a.shutdown().unwrap());
    let slices = first.snapshot().slices();
    let whole: Vec<_> = slices.iter().filter(|s| s.name == "spans both starts").collect();
    assert_eq!(whole.len(), 1, "{slices:?}");
    assert_eq!(
        whole[0].field("tickline.truncated"),
        None,
        "it ended, in its own timeline"
    );
    assert_eq!(
        (a_stats.truncated_slices, a_stats.unmatched_ends),
        (0, 0),
        "{a_stats:?}"
    );
    assert_eq!(b_stats.unmatched_ends, 0, "{b_stats:?}");
    assert_eq!(second.snapshot().slice_count("in the newer one"), 1);
    assert_eq!(second.snapshot().slice_count("spans both starts"), 0);
}

#[test]
fn open_slices_are_closed_at_shutdown_and_the_memory_exporter_is_finished() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let guard = tickline::scope!("still open");
    timeline.shutdown().unwrap();
    drop(guard); // after shutdown: nothing to record into, and no panic
    let trace = memory.snapshot();
    assert!(trace.finished);
    assert_eq!(trace.slice_count("still open"), 1);
    assert_eq!(trace.events.iter().filter(|e| e.kind == EventKind::SliceEnd).count(), 1);
}

#[test]
fn an_event_logged_while_a_field_is_formatted_leaves_the_outer_event_intact() {
    let _x = exclusive();
    struct LogsWhileFormatted;
    impl std::fmt::Debug for LogsWhileFormatted {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            tracing::info!("inner");
            f.write_str("outer value")
        }
    }
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        tracing::info!(value = ?LogsWhileFormatted, "outer");
    });
    let stats = timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let outer = trace
        .events
        .iter()
        .find(|e| e.kind == EventKind::Instant)
        .expect("the outer event");
    assert!(
        outer
            .fields
            .contains(&("value".into(), FieldValue::Str("outer value".into()))),
        "{outer:?}"
    );
    // tracing itself does not dispatch an event raised inside another's dispatch, so the inner one never
    // reaches any layer; nothing of the outer one is lost.
    assert_eq!(trace.events.iter().filter(|e| e.kind == EventKind::Instant).count(), 1);
    assert_eq!(stats.dropped_records, 0, "{stats:?}");
}

#[test]
fn flush_drains_full_rings_not_just_one_batch() {
    let _x = exclusive();
    const SPANS: u64 = 200_000;
    let counting = Counting::default();
    // A big ring and a collector that would not poll on its own during the test: the flush alone must
    // take all 400,000 records, several times the collector's per-pass batch.
    let timeline = Timeline::builder()
        .lossless(true)
        .ring_capacity(1 << 20)
        .poll_interval(std::time::Duration::from_secs(60))
        .async_tasks(AsyncTasks::Never)
        .exporter(counting.clone())
        .start()
        .unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!("queued");
        for _ in 0..SPANS {
            let _e = span.enter();
        }
    });
    timeline.flush().unwrap();
    let s = counting.0.lock().unwrap();
    assert_eq!(s.begins.values().sum::<u64>(), SPANS);
    assert_eq!(s.ends.values().sum::<u64>(), SPANS);
}

#[test]
fn spans_without_field_values_are_named_and_take_later_values() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        // Announced in one record each: no field values at creation.
        for _ in 0..100 {
            drop(tracing::info_span!("bare").entered());
        }
        // A declared but empty field, recorded after the announcement.
        let span = tracing::info_span!("later", answer = tracing::field::Empty);
        span.record("answer", 42);
        drop(span.enter());
    });
    let stats = timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    assert_eq!(trace.slice_count("bare"), 100);
    let later: Vec<_> = trace
        .events
        .iter()
        .filter(|e| e.kind == EventKind::SliceBegin && e.name == "later")
        .collect();
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].fields, vec![("answer".into(), FieldValue::I64(42))]);
    assert_eq!(stats.unknown_spans, 0, "{stats:?}");
    assert_eq!(stats.dropped_records, 0, "{stats:?}");
}

#[test]
fn a_timeline_that_falls_back_to_clock_monotonic_says_so_in_its_trace() {
    use tickline::clock::{DeciderOptions, ProbeFaults, ReliabilityOptions, TscDecider};
    let _x = exclusive();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 || tickline::clock::TickSource::hardware().is_none() {
        eprintln!("SKIP: a shifted TSC needs two CPUs and a hardware counter");
        return;
    }
    // A truly unusable TSC, simulated: CPU 1 reads far ahead of CPU 0.
    let faults = ProbeFaults {
        preempt: None,
        shifted_cpu: Some((1, 520_000)),
    };
    let decider = TscDecider::new(DeciderOptions {
        up_front: ReliabilityOptions {
            faults: faults.clone(),
            ..ReliabilityOptions::up_front()
        },
        full: ReliabilityOptions {
            faults,
            attempts: 3,
            ..ReliabilityOptions::quick()
        },
        background: false,
    });
    let decision = decider.wait_final(std::time::Duration::from_secs(20));
    if decision.source != tickline::clock::TickSource::Monotonic {
        eprintln!("SKIP: the pinned probes could not run on two CPUs here: {decision}");
        return;
    }
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder()
        .tick_source_decision(decision.clone())
        .exporter(memory.clone())
        .start()
        .unwrap();
    assert_eq!(timeline.tick_source(), tickline::clock::TickSource::Monotonic);
    let reason = timeline.tsc_fallback_reason().expect("a reason").to_owned();
    drop(tickline::scope!("work"));
    timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let note = trace
        .metadata
        .iter()
        .find(|m| m.name == "tickline: CPU clock")
        .expect("the decision on the process track");
    assert!(matches!(
        trace.track(note.track).map(|t| &t.kind),
        Some(TrackKind::Process { .. })
    ));
    assert_eq!(note.field("fallback"), Some(&FieldValue::Bool(true)));
    let Some(FieldValue::Str(text)) = note.field("decision") else {
        panic!("{note:?}")
    };
    assert!(text.contains(&reason), "{text} / {reason}");
    let counter = trace
        .tracks
        .iter()
        .find(|t| matches!(&t.kind, TrackKind::Counter { name, .. } if name == "tickline CPU clock fallback"))
        .unwrap()
        .id;
    assert!(trace.events_on(counter).any(|e| e.kind == EventKind::Counter(1.0)));
}

/// The CPU timestamp uncertainty counter is a bound that holds from the start, while other threads keep the
/// cores busy: each instant, read between two `CLOCK_MONOTONIC` reads, lies within them widened by the larger
/// of the counter's values just before and just after it. (The fit's error bound did not: 2-6 % of the first
/// second's instants lay outside it on this VM, up to 41 ns against 7 ns stated, while the first fits'
/// rates settled.)
#[test]
fn cpu_timestamps_lie_within_their_stated_uncertainty_from_the_start_under_load() {
    let _x = exclusive();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let brackets = std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| {
                let mut x = 1u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
                }
            });
        }
        let recorder = std::thread::Builder::new()
            .name("bracketed".into())
            .spawn_scoped(scope, || {
                let end = std::time::Instant::now() + std::time::Duration::from_millis(1_500);
                let mut brackets = Vec::new();
                while std::time::Instant::now() < end {
                    let before = tickline::clock::monotonic_ns().0;
                    tickline::instant!("bracketed");
                    brackets.push((before, tickline::clock::monotonic_ns().0));
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
                brackets
            })
            .unwrap();
        let brackets = recorder.join().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        brackets
    });
    timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let track = trace
        .tracks
        .iter()
        .find(|t| matches!(&t.kind, TrackKind::Counter { name, .. } if name == "tickline CPU timestamp uncertainty"))
        .expect("the counter track")
        .id;
    let stated: Vec<(u64, f64)> = trace
        .events_on(track)
        .filter_map(|e| match e.kind {
            EventKind::Counter(v) => Some((e.ts_ns, v)),
            _ => None,
        })
        .collect();
    assert!(!stated.is_empty());
    let thread = trace.thread_track("bracketed").unwrap();
    let times: Vec<u64> = trace
        .events_on(thread)
        .filter(|e| e.name == "bracketed")
        .map(|e| e.ts_ns)
        .collect();
    assert_eq!(times.len(), brackets.len());
    let mut outside = Vec::new();
    for (&t, &(before, after)) in times.iter().zip(&brackets) {
        let k = stated.partition_point(|&(at, _)| at <= t);
        let bound = [k.checked_sub(1), Some(k)]
            .into_iter()
            .flatten()
            .filter_map(|i| stated.get(i))
            .map(|&(_, v)| v)
            .fold(0.0, f64::max);
        let miss = before.saturating_sub(t).max(t.saturating_sub(after)) as f64;
        if miss > bound {
            outside.push((t, miss, bound));
        }
    }
    // About 95 % is the promise; here, with brackets of a few hundred ns around each instant, all should hold.
    assert!(
        outside.len() * 100 <= times.len(),
        "{} of {} instants outside: {:?}",
        outside.len(),
        times.len(),
        &outside[..outside.len().min(5)]
    );
}
