//! The CPU timeline under load: span identity when the registry reuses ids, field values whatever the drain
//! timing, whole-slice drops with no invented or stretched slice, payload limits, several timelines.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tickline::{
    export::{Batch, EventKind, ExportError, Exporter, FieldValue, MemoryExporter, NameId, TrackId},
    Timeline,
};
use tracing_subscriber::layer::SubscriberExt;

use crate::exclusive;

/// Checks the `a`/`b`/`c` hot loop as batches arrive, keeping counts only (millions of events): every scope
/// slice `in X` lies directly inside a span slice `X`, and every span slice `X` carries its iteration `i`, each
/// exactly once.
#[derive(Clone, Default)]
struct AbcChecker(Arc<Mutex<AbcState>>);

#[derive(Default)]
struct AbcState {
    names: HashMap<NameId, String>,
    stacks: HashMap<TrackId, Vec<String>>,
    /// Per span name, which iterations were seen.
    seen: HashMap<String, Vec<u8>>,
    span_slices: u64,
    scope_slices: u64,
    wrong_names: u64,
    wrong_fields: u64,
    unpaired_ends: u64,
}

const ABC_ITERATIONS: usize = 300_000;

impl Exporter for AbcChecker {
    fn export(&mut self, batch: &Batch) -> Result<(), ExportError> {
        let mut guard = self.0.lock().unwrap();
        let s = &mut *guard;
        for (id, name) in &batch.new_names {
            s.names.insert(*id, name.clone());
        }
        for e in &batch.events {
            let name = s.names.get(&e.name).cloned().unwrap_or_default();
            match e.kind {
                EventKind::SliceBegin => {
                    let stack = s.stacks.entry(e.track).or_default();
                    if let Some(span) = name.strip_prefix("in ") {
                        s.scope_slices += 1;
                        if stack.last().map(String::as_str) != Some(span) {
                            s.wrong_names += 1;
                        }
                    } else if ["a", "b", "c"].contains(&name.as_str()) {
                        s.span_slices += 1;
                        let i = batch.fields_of(e).iter().find_map(|f| match f.value {
                            FieldValue::U64(v) if s.names.get(&f.name).map(String::as_str) == Some("i") => Some(v),
                            FieldValue::I64(v) if s.names.get(&f.name).map(String::as_str) == Some("i") => {
                                Some(v as u64)
                            }
                            _ => None,
                        });
                        let seen = s.seen.entry(name.clone()).or_insert_with(|| vec![0; ABC_ITERATIONS]);
                        match i {
                            Some(i) if (i as usize) < ABC_ITERATIONS && seen[i as usize] == 0 => seen[i as usize] = 1,
                            _ => s.wrong_fields += 1,
                        }
                    }
                    s.stacks.entry(e.track).or_default().push(name);
                }
                EventKind::SliceEnd if s.stacks.entry(e.track).or_default().pop().is_none() => {
                    s.unpaired_ends += 1;
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

/// The loop of the issue that found the bug: three spans, each with a native scope inside, 300,000 times.
fn abc_loop(timeline: &Timeline) {
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..ABC_ITERATIONS as u64 {
            {
                let _a = tracing::info_span!("a", i).entered();
                let _s = tickline::scope!("in a");
            }
            {
                let _b = tracing::info_span!("b", i).entered();
                let _s = tickline::scope!("in b");
            }
            {
                let _c = tracing::info_span!("c", i).entered();
                let _s = tickline::scope!("in c");
            }
        }
    });
}

fn check_abc(checker: &AbcChecker) {
    let s = checker.0.lock().unwrap();
    assert_eq!(s.span_slices, 3 * ABC_ITERATIONS as u64);
    assert_eq!(s.scope_slices, 3 * ABC_ITERATIONS as u64);
    assert_eq!(s.wrong_names, 0, "scope slices inside another span's slice");
    assert_eq!(s.wrong_fields, 0, "span slices with a missing or repeated iteration");
    assert_eq!(s.unpaired_ends, 0);
    for name in ["a", "b", "c"] {
        assert!(
            s.seen[name].iter().all(|&v| v == 1),
            "{name}: not every iteration seen once"
        );
    }
    assert!(s.stacks.values().all(Vec::is_empty), "slices left open");
}

#[test]
fn reused_span_ids_never_give_a_slice_another_spans_name_or_fields() {
    let _x = exclusive();
    let checker = AbcChecker::default();
    let timeline = Timeline::builder()
        .lossless(true)
        .exporter(checker.clone())
        .start()
        .unwrap();
    abc_loop(&timeline);
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.dropped_records, 0);
    assert_eq!((stats.unknown_spans, stats.framing_errors), (0, 0), "{stats:?}");
    check_abc(&checker);
}

#[test]
fn reused_span_ids_stay_right_when_the_collector_lags_far_behind() {
    let _x = exclusive();
    let checker = AbcChecker::default();
    // Huge rings drained rarely, and a processing stage that sits idle while the whole run piles up: the
    // registry reuses each id thousands of times within what the collector then takes in one go.
    let timeline = Timeline::builder()
        .lossless(true)
        .ring_capacity(1 << 20)
        .poll_interval(Duration::from_millis(200))
        .exporter(checker.clone())
        .start()
        .unwrap();
    timeline.pause_processing(true);
    abc_loop(&timeline);
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.dropped_records, 0);
    assert_eq!((stats.unknown_spans, stats.framing_errors), (0, 0), "{stats:?}");
    check_abc(&checker);
}

/// `span.record` at the end of each 3 ms span: the slice shows the value, whatever the collector does.
fn record_at_end(timeline: &Timeline, memory: &MemoryExporter, flush_midway: bool) {
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for id in 0..50u64 {
            let span = tracing::info_span!("request", id, status = tracing::field::Empty);
            let _e = span.enter();
            std::thread::sleep(Duration::from_millis(3));
            if flush_midway && id % 7 == 0 {
                // Exported while open: the value recorded later still reaches the slice (on its end).
                timeline.flush().unwrap();
            }
            span.record("status", id * 2);
        }
    });
    timeline.flush().unwrap();
    let slices: Vec<_> = memory
        .snapshot()
        .slices()
        .into_iter()
        .filter(|s| s.name == "request")
        .collect();
    assert_eq!(slices.len(), 50);
    for s in &slices {
        let Some(FieldValue::U64(id)) = s.field("id") else {
            panic!("{s:?}")
        };
        assert_eq!(s.field("status"), Some(&FieldValue::U64(id * 2)), "{s:?}");
    }
}

#[test]
fn a_value_recorded_at_the_end_of_a_span_is_on_every_slice_whatever_the_drain_timing() {
    let _x = exclusive();
    for (poll_ms, flush_midway, pause) in [
        (1, false, false),
        (50, false, false),
        (1, true, false),
        (1, false, true),
    ] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder()
            .poll_interval(Duration::from_millis(poll_ms))
            .exporter(memory.clone())
            .start()
            .unwrap();
        timeline.pause_drain(pause);
        record_at_end(&timeline, &memory, flush_midway);
        timeline.shutdown().unwrap();
    }
}

/// The records the trace shows as dropped: the sum of its `tickline: records dropped` instants.
fn records_shown_dropped(trace: &tickline::export::MemoryTrace) -> u64 {
    trace
        .events
        .iter()
        .filter(|e| e.name == "tickline: records dropped")
        .map(|e| match e.fields.iter().find(|(n, _)| n == "records") {
            Some((_, FieldValue::U64(n))) => *n,
            _ => 0,
        })
        .sum()
}

/// A value recorded on another thread before a slice ends is on the slice, while another thread flushes as
/// fast as it can (a flush sends out what it has: it must not send a slice that ended meanwhile without the
/// value), and with the hold limit passed for every slice (its begin goes out first, the value on its end).
#[test]
fn a_value_recorded_on_another_thread_before_a_slice_ends_is_on_it_while_flushes_race() {
    let _x = exclusive();
    for slow in [false, true] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder()
            .lossless(true)
            .poll_interval(Duration::from_millis(1))
            .exporter(memory.clone())
            .start()
            .unwrap();
        let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
        let stop = std::sync::atomic::AtomicBool::new(false);
        let flushes = std::sync::atomic::AtomicU64::new(0);
        const SPANS: u64 = 3_000;
        std::thread::scope(|scope| {
            let flusher = scope.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    timeline.flush().unwrap();
                    flushes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            // The spans start once flushes come.
            while flushes.load(std::sync::atomic::Ordering::Relaxed) == 0 {
                std::thread::yield_now();
            }
            let before = flushes.load(std::sync::atomic::Ordering::Relaxed);
            let (to_recorder, spans) = std::sync::mpsc::channel::<(u64, tracing::Span)>();
            let (recorded, done) = std::sync::mpsc::channel::<()>();
            let recorder_dispatch = dispatch.clone();
            scope.spawn(move || {
                tracing::dispatcher::with_default(&recorder_dispatch, || {
                    for (id, span) in spans {
                        span.record("status", id * 2);
                        recorded.send(()).unwrap();
                    }
                });
            });
            tracing::dispatcher::with_default(&dispatch, || {
                for id in 0..SPANS {
                    let span = tracing::info_span!("request", id, status = tracing::field::Empty);
                    let entered = span.enter();
                    if slow && id % 500 == 0 {
                        // Open past the hold limit: its begin goes out while it is open.
                        std::thread::sleep(Duration::from_millis(250));
                    }
                    to_recorder.send((id, span.clone())).unwrap();
                    // Recorded on the other thread before this slice ends.
                    done.recv().unwrap();
                    drop(entered);
                }
            });
            drop(to_recorder);
            let during = flushes.load(std::sync::atomic::Ordering::Relaxed) - before;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            flusher.join().unwrap();
            assert!(during > 0, "flushes must race the spans");
        });
        drop(dispatch);
        timeline.shutdown().unwrap();
        let slices: Vec<_> = memory
            .snapshot()
            .slices()
            .into_iter()
            .filter(|s| s.name == "request")
            .collect();
        assert_eq!(slices.len() as u64, SPANS);
        let wrong: Vec<_> = slices
            .iter()
            .filter(|s| match s.field("id") {
                Some(FieldValue::U64(id)) => s.field("status") != Some(&FieldValue::U64(id * 2)),
                _ => true,
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "slow: {slow}: {} of {SPANS} slices without the value recorded before their end, e.g. {:?}",
            wrong.len(),
            wrong.first()
        );
    }
}

/// Records dropped with nothing recorded after them on their thread (it exits, or idles until shutdown) are
/// shown too: the loss instants add up to `dropped_records`, and the span open around them says so.
#[test]
fn losses_at_the_end_of_a_threads_recording_are_shown() {
    let _x = exclusive();
    for thread_exits in [true, false] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder()
            .ring_capacity(64)
            .max_ring_capacity(64)
            .exporter(memory.clone())
            .start()
            .unwrap();
        timeline.pause_drain(true);
        let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
        let (done, idle) = std::sync::mpsc::channel::<()>();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::spawn(move || {
            tracing::dispatcher::with_default(&dispatch, || {
                // Never exited: open when its thread exits or the timeline ends.
                std::mem::forget(tracing::info_span!("work", n = 500u64).entered());
                for _ in 0..500 {
                    drop(tickline::scope!("step"));
                }
                done.send(()).unwrap();
                if !thread_exits {
                    // Idle, span open, until the timeline has shut down.
                    let _ = wait.recv();
                }
            });
        });
        idle.recv().unwrap();
        let mut worker = Some(worker);
        if thread_exits {
            worker.take().unwrap().join().unwrap();
        }
        timeline.pause_drain(false);
        let stats = timeline.shutdown().unwrap();
        drop(release);
        if let Some(worker) = worker {
            worker.join().unwrap();
        }
        let trace = memory.snapshot();
        let shown = records_shown_dropped(&trace);
        assert!(stats.dropped_records > 0);
        assert_eq!(shown, stats.dropped_records, "thread exits: {thread_exits}");
        let work: Vec<_> = trace.slices().into_iter().filter(|s| s.name == "work").collect();
        assert_eq!(work.len(), 1);
        assert_eq!(work[0].field("tickline.truncated"), Some(&FieldValue::Bool(true)));
        assert_eq!(
            work[0].field("tickline.dropped_inside"),
            Some(&FieldValue::U64(stats.dropped_records)),
            "thread exits: {thread_exits}: {:?}",
            work[0]
        );
    }
}

#[test]
fn a_value_recorded_two_enters_later_is_not_on_the_first_slice() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder()
        .poll_interval(Duration::from_millis(100))
        .exporter(memory.clone())
        .start()
        .unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!("job", step = 0u64);
        for step in 1..=3u64 {
            drop(span.enter());
            span.record("step", step);
        }
    });
    timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let steps: Vec<_> = trace
        .slices()
        .into_iter()
        .filter(|s| s.name == "job" && trace.is_thread_track(s.track))
        .map(|s| s.field("step").cloned())
        .collect();
    assert_eq!(
        steps,
        [0u64, 1, 2].map(|v| Some(FieldValue::U64(v))),
        "each slice has the value its span had when it ended"
    );
}

/// One slice the drop test made: its name `s{k}` and what the test's own clock saw around it.
struct Truth {
    begin_ns: u64,
    end_ns: u64,
    parent: Option<u64>,
}

#[test]
fn drop_mode_never_invents_or_stretches_a_slice_and_accounts_for_every_one() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder()
        .ring_capacity(64)
        .exporter(memory.clone())
        .start()
        .unwrap();
    timeline.pause_drain(true);
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    let mut truth = HashMap::new();
    let mut next = 0u64;
    tracing::subscriber::with_default(subscriber, || {
        // Nested spans two deep, with a flush now and then: the ring fills, drops, and drains again.
        for round in 0..2_000u64 {
            let outer = next;
            next += 1;
            let begin = tickline::clock::monotonic_ns().0;
            {
                let _o = tracing::info_span!("outer", k = outer).entered();
                for _ in 0..3 {
                    let inner = next;
                    next += 1;
                    let b = tickline::clock::monotonic_ns().0;
                    drop(tracing::info_span!("inner", k = inner).entered());
                    truth.insert(
                        inner,
                        Truth {
                            begin_ns: b,
                            end_ns: tickline::clock::monotonic_ns().0,
                            parent: Some(outer),
                        },
                    );
                }
            }
            truth.insert(
                outer,
                Truth {
                    begin_ns: begin,
                    end_ns: tickline::clock::monotonic_ns().0,
                    parent: None,
                },
            );
            if round % 97 == 0 {
                timeline.flush().unwrap();
            }
        }
    });
    let stats = timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let slices = trace.slices();
    let mut exported = 0u64;
    for s in &slices {
        let Some(FieldValue::U64(k)) = s.field("k") else {
            continue;
        };
        exported += 1;
        let t = &truth[k];
        assert!(
            s.begin_ns >= t.begin_ns && s.end_ns <= t.end_ns,
            "slice {k} [{}, {}] outside its truth [{}, {}]",
            s.begin_ns,
            s.end_ns,
            t.begin_ns,
            t.end_ns
        );
        assert!(s.depth <= 1, "nesting deeper than the program made: {s:?}");
    }
    // Parents: an inner slice at depth 1 sits inside its own outer slice.
    let by_k: HashMap<u64, &tickline::export::RecordedSlice> = slices
        .iter()
        .filter_map(|s| match s.field("k") {
            Some(FieldValue::U64(k)) => Some((*k, s)),
            _ => None,
        })
        .collect();
    for (k, s) in &by_k {
        if s.depth == 1 {
            let parent = truth[k].parent.expect("only inner slices nest");
            let p = by_k
                .get(&parent)
                .expect("an inner slice nests only in its exported outer slice");
            assert!(p.begin_ns <= s.begin_ns && s.end_ns <= p.end_ns);
        }
    }
    // An outer slice that lost one of its inner slices to the full ring says so.
    let mut marked = 0;
    for (k, s) in &by_k {
        if truth[k].parent.is_some() {
            continue;
        }
        let lost_inner = (1..=3).filter(|i| !by_k.contains_key(&(k + i))).count();
        if lost_inner > 0 {
            assert!(
                matches!(s.field("tickline.dropped_inside"), Some(FieldValue::U64(n)) if *n >= 2 * lost_inner as u64),
                "outer slice {k} lost {lost_inner} inner slices and does not say so: {s:?}"
            );
            marked += 1;
        }
    }
    assert!(marked > 0, "some outer slice must have lost an inner one");
    assert!(stats.dropped_records > 0, "the ring must overflow: {stats:?}");
    // Every slice produced is exported whole, dropped whole (enter + exit), or truncated: exactly.
    let produced = truth.len() as u64;
    assert_eq!(stats.truncated_slices, 0);
    assert_eq!(
        exported + stats.dropped_slices + stats.truncated_slices,
        produced,
        "{stats:?}"
    );
    assert!(stats.dropped_slices > 0);
    // Each dropped slice lost at least its enter and exit records.
    assert!(stats.dropped_records >= 2 * stats.dropped_slices, "{stats:?}");
    let gaps = records_shown_dropped(&trace);
    assert!(
        gaps > 0 && gaps <= stats.dropped_records,
        "gap markers show where: {gaps}"
    );
}

#[test]
fn a_lossless_burst_into_a_huge_ring_exports_every_event_with_its_message() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder()
        .lossless(true)
        .ring_capacity(1 << 20)
        .exporter(memory.clone())
        .start()
        .unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    const EVENTS: usize = 200_000;
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..EVENTS {
            // About 100 bytes of message: record groups that do not divide a drain's size.
            tracing::info!(
                i,
                "event number {i:>8} with a message long enough to need several data records ...."
            );
        }
    });
    let stats = timeline.shutdown().unwrap();
    assert_eq!((stats.dropped_records, stats.framing_errors), (0, 0));
    let trace = memory.snapshot();
    let mut seen = vec![false; EVENTS];
    for e in trace.events.iter().filter(|e| e.kind == EventKind::Instant) {
        let Some((_, FieldValue::U64(i))) = e.fields.iter().find(|(n, _)| n == "i") else {
            continue;
        };
        let Some((_, FieldValue::Str(message))) = e.fields.iter().find(|(n, _)| n == "message") else {
            panic!("event {i} without its message")
        };
        assert!(message.starts_with(&format!("event number {i:>8} ")), "{message}");
        seen[*i as usize] = true;
    }
    assert!(seen.iter().all(|&s| s), "every event arrives");
}

#[test]
fn fields_cut_at_the_payload_limit_are_marked_and_counted() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    let big = "x".repeat(2048);
    tracing::subscriber::with_default(subscriber, || {
        let _s = tracing::info_span!(
            "wide",
            f00 = %big, f01 = %big, f02 = %big, f03 = %big, f04 = %big, f05 = %big, f06 = %big, f07 = %big,
            f08 = %big, f09 = %big, f10 = %big, f11 = %big, f12 = %big, f13 = %big, f14 = %big, f15 = %big,
            f16 = %big, f17 = %big, f18 = %big, f19 = %big, f20 = %big, f21 = %big, f22 = %big, f23 = %big,
            f24 = %big, f25 = %big, f26 = %big, f27 = %big, f28 = %big, f29 = %big, f30 = %big
        )
        .entered();
        tracing::info!(value = ?"y".repeat(100_000), "a huge debug value");
    });
    let stats = timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let wide = trace.slices().into_iter().find(|s| s.name == "wide").unwrap();
    let kept = wide.fields.iter().filter(|(n, _)| n.starts_with('f')).count();
    let Some(FieldValue::U64(cut)) = wide.field("tickline.fields_truncated") else {
        panic!(
            "no marker: {:?}",
            wide.fields.iter().map(|(n, _)| n).collect::<Vec<_>>()
        )
    };
    assert!(kept < 31 && kept as u64 + *cut >= 31, "{kept} kept, {cut} cut");
    let event = trace
        .events
        .iter()
        .find(|e| e.kind == EventKind::Instant && e.fields.iter().any(|(n, _)| n == "value"))
        .unwrap();
    assert!(event
        .fields
        .iter()
        .any(|(n, v)| n == "tickline.fields_truncated" && *v == FieldValue::U64(1)));
    let value = event.fields.iter().find(|(n, _)| n == "value").unwrap();
    let FieldValue::Str(value) = &value.1 else { panic!() };
    assert!(value.len() <= tickline::MAX_FIELD_BYTES + 3 && value.ends_with('…'));
    assert_eq!(stats.fields_truncated, 2, "{stats:?}");
}

/// A slice shows every value its span had cut, at creation and in `record`s: its marker counts them all.
#[test]
fn a_slices_cut_marker_counts_the_cuts_of_its_creation_and_its_records() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    let long = "a".repeat(tickline::MAX_FIELD_BYTES + 10);
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!(
            "long",
            v = long.as_str(),
            w = long.as_str(),
            later = tracing::field::Empty
        );
        span.record("later", long.as_str());
        drop(span.entered());
    });
    timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let slice = trace.slices().into_iter().find(|s| s.name == "long").unwrap();
    let cut = ["v", "w", "later"]
        .iter()
        .filter(|&&n| matches!(slice.field(n), Some(FieldValue::Str(s)) if s.ends_with('…')))
        .count();
    assert_eq!(cut, 3, "{slice:?}");
    assert_eq!(slice.field("tickline.fields_truncated"), Some(&FieldValue::U64(3)));
}

#[test]
fn native_macros_follow_the_most_recently_started_running_timeline_in_every_order() {
    let _x = exclusive();
    let start = || {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
        (timeline, memory)
    };
    let count = |memory: &MemoryExporter| memory.snapshot().slice_count("where");
    let record = || drop(tickline::scope!("where"));

    // Stop the later one first: the earlier one takes over again.
    let (a, a_mem) = start();
    let (b, b_mem) = start();
    record();
    b.shutdown().unwrap();
    record();
    a.shutdown().unwrap();
    record();
    assert_eq!((count(&a_mem), count(&b_mem)), (1, 1));

    // Stop the earlier one first: the later one stays current.
    let (a, a_mem) = start();
    let (b, b_mem) = start();
    record();
    a.shutdown().unwrap();
    record();
    b.shutdown().unwrap();
    record();
    assert_eq!((count(&a_mem), count(&b_mem)), (0, 2));

    // Three, the middle one stops: the newest stays; then the newest stops: the oldest.
    let (a, a_mem) = start();
    let (b, b_mem) = start();
    let (c, c_mem) = start();
    b.shutdown().unwrap();
    record();
    c.shutdown().unwrap();
    record();
    a.shutdown().unwrap();
    assert_eq!((count(&a_mem), count(&b_mem), count(&c_mem)), (1, 0, 1));
}

#[test]
fn a_four_thread_rayon_burst_loses_nothing_in_the_default_configuration() {
    use rayon::prelude::*;
    let _x = exclusive();
    let counting = crate::pipeline::Counting::default();
    let timeline = Timeline::builder().exporter(counting.clone()).start().unwrap();
    let layer = timeline.layer();
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(layer));
    // Every worker runs under the subscriber, as under a global default.
    let worker_dispatch = dispatch.clone();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .start_handler(move |_| std::mem::forget(tracing::dispatcher::set_default(&worker_dispatch)))
        .build()
        .unwrap();
    const ITEMS: u64 = 100_000;
    pool.install(|| {
        (0..ITEMS).into_par_iter().for_each(|i| {
            let _span = tracing::info_span!("item", i).entered();
            let _scope = tickline::scope!("work");
            std::hint::black_box(i);
        });
    });
    drop(pool);
    let stats = timeline.shutdown().unwrap();
    assert_eq!((stats.dropped_records, stats.dropped_slices), (0, 0), "{stats:?}");
    let s = counting.0.lock().unwrap();
    assert_eq!(s.begins.values().sum::<u64>(), 2 * ITEMS);
    assert_eq!(s.ends.values().sum::<u64>(), 2 * ITEMS);
}

#[test]
fn a_full_ring_grows_instead_of_dropping_and_keeps_every_record_in_order() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    // Rings of 256 records growing up to 64 Ki, and a collector that drains only at the end: the thread's
    // records move through four rings, and none may be lost or reordered on the way.
    let timeline = Timeline::builder()
        .ring_capacity(256)
        .max_ring_capacity(1 << 16)
        .exporter(memory.clone())
        .start()
        .unwrap();
    timeline.pause_drain(true);
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    const N: u64 = 10_000;
    tracing::subscriber::with_default(subscriber, || {
        let _outer = tracing::info_span!("outer").entered();
        for i in 0..N {
            let _s = tracing::info_span!("step", i).entered();
        }
    });
    let stats = timeline.shutdown().unwrap();
    assert_eq!((stats.dropped_records, stats.threads), (0, 1), "{stats:?}");
    let slices = memory.snapshot().slices();
    let steps: Vec<u64> = slices
        .iter()
        .filter(|s| s.name == "step")
        .map(|s| match s.field("i") {
            Some(FieldValue::U64(i)) => *i,
            other => panic!("{other:?} in {s:?}, {stats:?}"),
        })
        .collect();
    assert_eq!(steps, (0..N).collect::<Vec<_>>());
    assert!(slices.iter().filter(|s| s.name == "step").all(|s| s.depth == 1));
    assert!(slices
        .windows(2)
        .all(|w| w[0].name != "step" || w[1].name != "step" || w[0].end_ns <= w[1].begin_ns));

    // At its largest a full ring drops, whole slices, counted.
    let counting = crate::pipeline::Counting::default();
    let timeline = Timeline::builder()
        .ring_capacity(64)
        .max_ring_capacity(256)
        .exporter(counting.clone())
        .start()
        .unwrap();
    timeline.pause_drain(true);
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for _ in 0..N {
            drop(tickline::scope!("step"));
        }
    });
    let stats = timeline.shutdown().unwrap();
    let begins: u64 = counting.0.lock().unwrap().begins.values().sum();
    assert!(stats.dropped_slices > 0);
    assert_eq!(begins + stats.dropped_slices, N, "{stats:?}");
}

/// A collector that has fallen a whole chunk budget behind (its processing stalls) stops the rings growing:
/// the memory held stays near the budget plus a thread's ring, instead of each thread growing its ring to the
/// maximum (and holding the rings it grew out of) on top.
#[test]
fn rings_stop_growing_while_the_chunk_budget_is_full() {
    let _x = exclusive();
    let counting = crate::pipeline::Counting::default();
    const BUDGET: u64 = 1 << 20;
    // Default growing rings: 64 Ki records, growing to 1 Mi.
    let timeline = Timeline::builder()
        .chunk_budget(BUDGET)
        .exporter(counting.clone())
        .start()
        .unwrap();
    timeline.pause_processing(true);
    // First past the budget (drained records wait, unprocessed), then time for the drain stage to see it full.
    const FIRST: u64 = 50_000;
    for _ in 0..FIRST {
        drop(tickline::scope!("step"));
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    const N: u64 = 2_000_000;
    for _ in FIRST..N {
        drop(tickline::scope!("step"));
    }
    let held = timeline.stats();
    timeline.pause_processing(false);
    let stats = timeline.shutdown().unwrap();
    assert!(held.budget_full_passes > 0, "the budget was meant to fill: {held:?}");
    // Kept: what the passes drained (the budget, and the rings of the pass that filled it: up to the first
    // ring and the one it grew into) and what was left in the ring. With growth not stopped, the thread's ring
    // grew to 1 Mi records once the burst came and all of it was kept besides.
    let bound = BUDGET / 16 + (1 << 16) + 2 * (1 << 18);
    assert!(
        stats.records <= bound,
        "{} records kept (bound {bound}): {stats:?}",
        stats.records
    );
    assert!(stats.dropped_slices > 0, "{stats:?}");
    let begins: u64 = counting.0.lock().unwrap().begins.values().sum();
    assert_eq!(begins + stats.dropped_slices, N, "{stats:?}");
}

/// Flushes from several threads at once while threads record: each is answered, none with a spurious
/// "collector gone" (a flush read while another was being served was once dropped unanswered).
#[test]
fn concurrent_flushes_are_each_answered_while_threads_record() {
    struct Nothing;
    impl Exporter for Nothing {
        fn export(&mut self, _: &Batch) -> Result<(), ExportError> {
            Ok(())
        }
        fn flush(&mut self) -> Result<(), ExportError> {
            Ok(())
        }
    }
    let _x = exclusive();
    let timeline = Timeline::builder().exporter(Nothing).start().unwrap();
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let failed = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..2 {
            let dispatch = dispatch.clone();
            let stop = &stop;
            scope.spawn(move || {
                tracing::dispatcher::with_default(&dispatch, || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for _ in 0..20 {
                            tracing::info_span!("rec").in_scope(|| {});
                        }
                        std::thread::sleep(Duration::from_micros(50));
                    }
                });
            });
        }
        let flushers: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    for _ in 0..150 {
                        if let Err(e) = timeline.flush() {
                            failed.lock().unwrap().push(e.to_string());
                        }
                    }
                })
            })
            .collect();
        for f in flushers {
            f.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let failed = failed.into_inner().unwrap();
    assert!(
        failed.is_empty(),
        "{} of 1200 flushes failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(3)]
    );
    drop(dispatch);
    let stats = timeline.shutdown().unwrap();
    assert!(stats.records > 0);
}
