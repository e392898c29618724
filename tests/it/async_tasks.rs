//! Async tasks (see `tickline::AsyncTasks`): a tokio multi-thread runtime with 1,000 instrumented requests,
//! each with a nested child task; every task's lifetime, polls and flows checked against the truth.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tickline::{
    export::{FieldValue, MemoryExporter, MemoryTrace, RecordedSlice, TrackId, TrackKind},
    AsyncTasks, Timeline,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Instrument, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::exclusive;

const REQUESTS: u64 = 1000;

/// The truth: when each span with an `id` field was created and closed, read from tickline's reference clock
/// by a second layer right after tickline's own layer.
#[derive(Clone, Default)]
struct Truth(Arc<Mutex<Brackets>>);

/// `(span name, id)` to a pair of clock reads (ns).
type Brackets = HashMap<(String, u64), (u64, u64)>;

struct Created {
    name: &'static str,
    id: u64,
    at_ns: u64,
}

struct IdOf(Option<u64>);

impl Visit for IdOf {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "id" {
            self.0 = Some(value);
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Truth {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let at_ns = tickline::clock::monotonic_ns().0;
        let mut of = IdOf(None);
        attrs.record(&mut of);
        if let (Some(task), Some(span)) = (of.0, ctx.span(id)) {
            span.extensions_mut().insert(Created {
                name: attrs.metadata().name(),
                id: task,
                at_ns,
            });
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let at_ns = tickline::clock::monotonic_ns().0;
        if let Some(span) = ctx.span(&id) {
            if let Some(c) = span.extensions().get::<Created>() {
                self.0
                    .lock()
                    .unwrap()
                    .insert((c.name.to_owned(), c.id), (c.at_ns, at_ns));
            }
        }
    }
}

/// Clock reads the program makes itself: just before each span is created, and when its future's body is done
/// (its close comes after). With the truth layer's reads (just after tickline's layer saw the creation and the
/// close) they bracket the true creation and close, however the threads were preempted in between.
fn lower_bounds() -> &'static Mutex<Brackets> {
    static BOUNDS: std::sync::OnceLock<Mutex<Brackets>> = std::sync::OnceLock::new();
    BOUNDS.get_or_init(Default::default)
}

fn note_created(name: &str, id: u64) {
    let now = tickline::clock::monotonic_ns().0;
    lower_bounds().lock().unwrap().insert((name.to_owned(), id), (now, 0));
}

fn note_done(name: &str, id: u64) {
    let now = tickline::clock::monotonic_ns().0;
    if let Some(b) = lower_bounds().lock().unwrap().get_mut(&(name.to_owned(), id)) {
        b.1 = now;
    }
}

/// What `#[tracing::instrument] async fn request(id: u64)` makes: the span created at the call, entered for
/// every poll of the future (and for its drop).
fn request(id: u64) -> impl std::future::Future<Output = ()> {
    note_created("request", id);
    request_body(id).instrument(tracing::info_span!("request", id))
}

async fn request_body(id: u64) {
    tokio::task::yield_now().await;
    note_created("query", id);
    let child = tokio::spawn(query(id).instrument(tracing::info_span!("query", id)));
    tokio::time::sleep(Duration::from_micros(100 + id % 7 * 50)).await;
    child.await.unwrap();
    // A blocking section inside a poll.
    std::thread::sleep(Duration::from_micros(20));
    note_done("request", id);
}

async fn query(id: u64) {
    tokio::task::yield_now().await;
    if id % 3 == 0 {
        tokio::time::sleep(Duration::from_micros(50)).await;
    }
    note_done("query", id);
}

fn id_of(slice: &RecordedSlice) -> Option<u64> {
    match slice.field("id") {
        Some(FieldValue::U64(v)) => Some(*v),
        Some(FieldValue::I64(v)) => Some(*v as u64),
        _ => None,
    }
}

/// Runs the 1,000 requests on a 4-worker runtime; returns the trace, the truth and the stats.
fn run(timeline: Timeline, memory: &MemoryExporter, lagging: bool) -> (MemoryTrace, Truth, tickline::TimelineStats) {
    run_stalling(timeline, memory, lagging, false)
}

/// [`run`], with the drain stalled for 3 ms in every 6 while the requests run when `stall_drain` (the rings
/// fill, whatever the machine's speed, if they are small).
fn run_stalling(
    timeline: Timeline,
    memory: &MemoryExporter,
    lagging: bool,
    stall_drain: bool,
) -> (MemoryTrace, Truth, tickline::TimelineStats) {
    let truth = Truth::default();
    // A collector that lags: nothing is processed while the program runs.
    timeline.pause_processing(lagging);
    let subscriber = tracing_subscriber::registry()
        .with(timeline.layer())
        .with(truth.clone());
    let dispatch = tracing::Dispatch::new(subscriber);
    let runtime = {
        let dispatch = dispatch.clone();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_time()
            .on_thread_start(move || {
                // Each worker records into the same subscriber for its whole life.
                std::mem::forget(tracing::dispatcher::set_default(&dispatch));
            })
            .build()
            .unwrap()
    };
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        if stall_drain {
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    timeline.pause_drain(true);
                    std::thread::sleep(Duration::from_millis(3));
                    timeline.pause_drain(false);
                    std::thread::sleep(Duration::from_millis(3));
                }
            });
        }
        tracing::dispatcher::with_default(&dispatch, || {
            runtime.block_on(async {
                let handles: Vec<_> = (0..REQUESTS).map(|id| tokio::spawn(request(id))).collect();
                for h in handles {
                    h.await.unwrap();
                }
            });
        });
        done.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    drop(runtime);
    timeline.pause_processing(false);
    let stats = timeline.shutdown().unwrap();
    (memory.snapshot(), truth, stats)
}

#[test]
fn a_thousand_tokio_tasks_each_get_one_lifetime_slice_its_polls_and_a_flow_per_poll() {
    check_a_thousand_tasks(false);
}

/// The same with a collector that processes nothing until the program is done, tiny rings in lossless mode
/// and a slow drain: the trace is the same, exactly.
#[test]
fn a_thousand_tokio_tasks_come_out_exactly_behind_a_lagging_collector() {
    check_a_thousand_tasks(true);
}

fn check_a_thousand_tasks(lagging: bool) {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let dir = std::env::temp_dir().join(format!("tickline-async-{}-{lagging}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let perfetto_path = dir.join("async.pftrace");
    let mut builder = Timeline::builder()
        .exporter(memory.clone())
        .exporter(tickline_perfetto::PerfettoExporter::create(&perfetto_path).unwrap());
    if lagging {
        builder = builder
            .lossless(true)
            .ring_capacity(1024)
            .max_ring_capacity(1024)
            .poll_interval(Duration::from_millis(20));
    }
    let timeline = builder.start().unwrap();
    let (trace, truth, stats) = run(timeline, &memory, lagging);
    assert_eq!(stats.dropped_records, 0, "{stats:?}");
    assert_eq!(stats.truncated_slices, 0, "{stats:?}");
    assert_eq!(stats.unknown_spans, 0, "{stats:?}");

    let slices = trace.slices();
    let tracks: HashMap<TrackId, &tickline::export::TrackDescriptor> = trace.tracks.iter().map(|t| (t.id, t)).collect();
    // Every task track and its lifetime slice, by (span name, id).
    let mut lifetimes: HashMap<(String, u64), Vec<&RecordedSlice>> = HashMap::new();
    let mut task_of_track: HashMap<TrackId, (String, u64)> = HashMap::new();
    for s in &slices {
        if matches!(tracks[&s.track].kind, TrackKind::AsyncTask { .. }) && s.depth == 0 && s.name != "poll" {
            let key = (
                s.name.clone(),
                id_of(s).expect("a task's lifetime slice carries its fields"),
            );
            task_of_track.insert(s.track, key.clone());
            lifetimes.entry(key).or_default().push(s);
        }
    }
    let requests = lifetimes.keys().filter(|(n, _)| n == "request").count() as u64;
    let queries = lifetimes.keys().filter(|(n, _)| n == "query").count() as u64;
    assert_eq!(
        (requests, queries),
        (REQUESTS, REQUESTS),
        "one task track per request and per query"
    );
    assert!(
        lifetimes.values().all(|l| l.len() == 1),
        "exactly one lifetime slice per task"
    );
    assert_eq!(stats.async_tasks, 2 * REQUESTS, "{stats:?}");

    // Nested: each query's track is a child of its request's track, and named after the span and its id.
    for ((name, id), l) in &lifetimes {
        let track = tracks[&l[0].track];
        let TrackKind::AsyncTask { name: track_name } = &track.kind else {
            unreachable!()
        };
        assert_eq!(track_name, &format!("{name} id={id}"));
        if name == "query" {
            let parent = track.parent.expect("a child task's track has a parent");
            assert_eq!(task_of_track.get(&parent), Some(&("request".to_owned(), *id)));
        }
    }

    // Lifetimes: from the span's creation to its close, each inside its bracket (a program read before it and
    // the truth layer's read after it), up to the CPU calibration's error.
    const SLACK_NS: u64 = 20_000;
    let truth = truth.0.lock().unwrap();
    let lower = lower_bounds().lock().unwrap();
    let mut widest = 0u64;
    for (key, l) in &lifetimes {
        let (created_hi, closed_hi) = truth[key];
        let (created_lo, closed_lo) = lower[key];
        let (begin, end) = (l[0].begin_ns, l[0].end_ns);
        assert!(
            begin + SLACK_NS >= created_lo && begin <= created_hi + SLACK_NS,
            "{key:?}: lifetime begins at {begin}, created in [{created_lo}, {created_hi}]"
        );
        assert!(
            end + SLACK_NS >= closed_lo && end <= closed_hi + SLACK_NS,
            "{key:?}: lifetime ends at {end}, closed in [{closed_lo}, {closed_hi}]"
        );
        widest = widest.max(created_hi - created_lo).max(closed_hi - closed_lo);
    }
    eprintln!("async tasks: every lifetime inside its truth bracket (widest bracket {widest} ns)");

    // Polls: every slice of a task span on a worker thread starts a flow that ends at a `poll` child of its
    // lifetime slice on the task's track; counts match exactly.
    let mut thread_polls: HashMap<(String, u64), HashSet<u64>> = HashMap::new();
    for s in slices.iter().filter(|s| trace.is_thread_track(s.track)) {
        if s.name == "request" || s.name == "query" {
            let key = (s.name.clone(), id_of(s).unwrap());
            let flow = s
                .flow_out
                .unwrap_or_else(|| panic!("{key:?}: a poll on a thread without a flow"));
            assert!(thread_polls.entry(key).or_default().insert(flow));
        }
    }
    let mut task_polls: HashMap<(String, u64), HashSet<u64>> = HashMap::new();
    for s in slices.iter().filter(|s| s.name == "poll") {
        let key = task_of_track[&s.track].clone();
        assert_eq!(s.depth, 1, "a poll is a child of the lifetime slice");
        let l = lifetimes[&key][0];
        assert!(
            s.begin_ns >= l.begin_ns && s.end_ns <= l.end_ns,
            "{key:?}: a poll outside the lifetime"
        );
        assert!(task_polls
            .entry(key)
            .or_default()
            .insert(s.flow_in.expect("a poll ends a flow")));
    }
    assert_eq!(
        thread_polls, task_polls,
        "the same polls, by flow, on the threads and on the task tracks"
    );
    let polls: usize = task_polls.values().map(HashSet::len).sum();
    assert!(polls as u64 >= 4 * REQUESTS, "at least two polls per task: {polls}");
    assert_eq!(stats.async_polls, polls as u64);
    // Nothing else has a flow: no one-ended flows.
    let outs = trace.events.iter().filter(|e| e.flow_out.is_some()).count();
    let ins = trace.events.iter().filter(|e| e.flow_in.is_some()).count();
    assert_eq!((outs, ins), (polls, polls));

    // The Perfetto trace of the same run, checked by Perfetto's own bindings.
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".ci/check_perfetto.py");
    let bindings = std::process::Command::new("python3")
        .args(["-c", "import perfetto.protos.perfetto.trace.perfetto_trace_pb2"])
        .output()
        .is_ok_and(|o| o.status.success());
    if bindings {
        let out = std::process::Command::new("python3")
            .arg(script)
            .arg(&perfetto_path)
            .args(["--expect-async-tasks", &format!("request={REQUESTS}")])
            .args(["--expect-async-tasks", &format!("query={REQUESTS}")])
            .args(["--expect-polls", &polls.to_string()])
            .args(["--expect-thread-tracks", "5"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{}", String::from_utf8_lossy(&out.stdout).trim());
    } else {
        eprintln!("SKIP: the Perfetto check: Perfetto's Python bindings are missing (pip install perfetto protobuf)");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Synchronous spans, each entered once, as `Auto` sees them: exactly what `Never` shows, no task track and
/// no flow, even when a drain pass ends between a span's exit and its close.
#[test]
fn auto_leaves_synchronous_spans_as_they_were() {
    let _x = exclusive();
    let mut views = Vec::new();
    for mode in [AsyncTasks::Auto, AsyncTasks::Never] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder()
            .async_tasks(mode)
            .poll_interval(Duration::from_micros(50))
            .exporter(memory.clone())
            .start()
            .unwrap();
        let subscriber = tracing_subscriber::registry().with(timeline.layer());
        tracing::subscriber::with_default(subscriber, || {
            for i in 0..2000u64 {
                let span = tracing::info_span!("step", i);
                span.in_scope(|| {
                    let _inner = tracing::info_span!("inner").entered();
                });
                // Something between the exit and the close, sometimes a drain pass too.
                tracing::info!(i, "between");
                if i % 100 == 0 {
                    std::thread::sleep(Duration::from_micros(200));
                }
                drop(span);
            }
        });
        let stats = timeline.shutdown().unwrap();
        let trace = memory.snapshot();
        assert!(trace.async_task_tracks().is_empty(), "{mode:?}");
        assert!(
            trace.events.iter().all(|e| e.flow_out.is_none() && e.flow_in.is_none()),
            "{mode:?}"
        );
        assert_eq!(stats.async_tasks, 0);
        let view: Vec<_> = trace
            .slices()
            .into_iter()
            .map(|s| (s.name, s.fields, s.end_ns - s.begin_ns))
            .collect();
        assert_eq!(view.len(), 4000);
        views.push(view.into_iter().map(|(n, f, _)| (n, f)).collect::<Vec<_>>());
    }
    assert_eq!(views[0], views[1]);
}

/// Spans left open when their thread ends or the timeline stops: entered once, none is a task, so none has a
/// flow (a flow with one end is not a flow). Tasks still open get their flows, both ends.
#[test]
fn spans_open_at_the_end_have_no_flow_with_one_end() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
    // A thread that ends with a span entered.
    std::thread::spawn({
        let dispatch = dispatch.clone();
        move || {
            tracing::dispatcher::with_default(&dispatch, || {
                std::mem::forget(tracing::info_span!("entered when its thread ended").entered());
            })
        }
    })
    .join()
    .unwrap();
    let (entered, polled_once, task) = tracing::dispatcher::with_default(&dispatch, || {
        let polled_once = tracing::info_span!("polled once, open at the end");
        drop(polled_once.enter());
        let task = tracing::info_span!("polled twice, open at the end");
        drop(task.enter());
        drop(tickline::scope!("between the polls"));
        drop(task.enter());
        (tracing::info_span!("entered at the end").entered(), polled_once, task)
    });
    // (No flush before: a flush sends an undecided first poll out with its flow, in case it is a task.)
    timeline.shutdown().unwrap();
    drop((entered, polled_once, task));
    let trace = memory.snapshot();
    let outs: Vec<u64> = trace.events.iter().filter_map(|e| e.flow_out).collect();
    let ins: Vec<u64> = trace.events.iter().filter_map(|e| e.flow_in).collect();
    for flow in &outs {
        assert!(ins.contains(flow), "flow {flow} has no end: {:?}", trace.events);
    }
    for flow in &ins {
        assert!(outs.contains(flow), "flow {flow} has no start");
    }
    // The task's two polls, each with its flow.
    assert_eq!(outs.len(), 2, "{outs:?}");
}

/// `Always`: every span is a task, from its creation, even one entered once; `Never`: none, even one
/// re-entered on two threads.
#[test]
fn always_and_never_do_what_they_say() {
    let _x = exclusive();
    for (mode, tasks) in [(AsyncTasks::Always, 2), (AsyncTasks::Never, 0)] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder()
            .async_tasks(mode)
            .exporter(memory.clone())
            .start()
            .unwrap();
        let subscriber = Arc::new(tracing_subscriber::registry().with(timeline.layer()));
        let shared = tracing::subscriber::with_default(subscriber.clone(), || {
            tracing::info_span!("once").in_scope(|| {});
            let shared = tracing::info_span!("shared");
            drop(shared.enter());
            shared
        });
        std::thread::spawn(move || {
            tracing::subscriber::with_default(subscriber, || drop(shared.enter()));
        })
        .join()
        .unwrap();
        let stats = timeline.shutdown().unwrap();
        let trace = memory.snapshot();
        assert_eq!(trace.async_task_tracks().len(), tasks, "{mode:?}");
        assert_eq!(stats.async_tasks, tasks as u64);
        let polls = trace.slices().iter().filter(|s| s.name == "poll").count();
        assert_eq!(polls, if tasks > 0 { 3 } else { 0 }, "{mode:?}");
    }
}

/// Drop mode with rings too small for the bursts: where a thread's records went missing, every task alive
/// throughout that stretch (its polls run on any thread, so they may have been among them) carries
/// `tickline.dropped_inside`, at least the count the thread's marker shows.
#[test]
fn task_lifetimes_around_a_loss_on_any_thread_are_marked() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder()
        .exporter(memory.clone())
        .ring_capacity(128)
        .max_ring_capacity(128)
        .start()
        .unwrap();
    let (trace, _, stats) = run_stalling(timeline, &memory, false, true);
    assert!(stats.dropped_records > 0, "the rings were meant to overflow: {stats:?}");
    let slices = trace.slices();
    let lifetimes: Vec<&RecordedSlice> = slices
        .iter()
        .filter(|s| s.depth == 0 && !trace.is_thread_track(s.track) && s.name != "poll")
        .collect();
    assert!(!lifetimes.is_empty());
    let mut checked = 0;
    for gap in trace.events.iter().filter(|e| e.name == "tickline: records dropped") {
        let Some(FieldValue::U64(records)) = gap.fields.iter().find(|(n, _)| n == "records").map(|(_, v)| v) else {
            panic!("a loss marker without its count: {gap:?}");
        };
        // The records went missing after the thread's previous event and before the marker.
        let since = trace
            .events_on(gap.track)
            .map(|e| e.ts_ns)
            .filter(|&ts| ts < gap.ts_ns)
            .max()
            .unwrap_or(0);
        for lifetime in lifetimes
            .iter()
            .filter(|l| l.begin_ns <= since && gap.ts_ns <= l.end_ns)
        {
            checked += 1;
            match lifetime.field("tickline.dropped_inside") {
                Some(FieldValue::U64(n)) if n >= records => {}
                other => panic!(
                    "task {} ({}..{} ns) lived through a loss of {records} records at {since}..{} ns on another thread, marked {other:?}",
                    lifetime.name, lifetime.begin_ns, lifetime.end_ns, gap.ts_ns
                ),
            }
        }
    }
    assert!(checked > 0, "no task lived through a loss: {stats:?}");
}

/// `lifetime` ends within 2 µs of the clock reads `before_close` and `after_close` around its span's close.
fn assert_ends_at_close(lifetime: &RecordedSlice, before_close: u64, after_close: u64, case: &str) {
    assert!(
        lifetime.end_ns + 2_000 >= before_close && lifetime.end_ns <= after_close + 2_000,
        "{case}: the lifetime ends at {} ns, the span closed between {before_close} and {after_close}",
        lifetime.end_ns
    );
}

/// A task's lifetime runs to its span's close, even when the thread recorded nothing between the span's last
/// exit and its close (a close there takes that exit's time, one clock read less, only for spans that cannot
/// be tasks).
#[test]
fn a_task_lifetime_ends_at_its_close_not_its_last_exit() {
    let _x = exclusive();
    for (mode, enters) in [(AsyncTasks::Auto, 2), (AsyncTasks::Always, 2), (AsyncTasks::Always, 1)] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder()
            .async_tasks(mode)
            .exporter(memory.clone())
            .start()
            .unwrap();
        let subscriber = tracing_subscriber::registry().with(timeline.layer());
        let (before_close, after_close) = tracing::subscriber::with_default(subscriber, || {
            let held = tracing::info_span!("held");
            for _ in 0..enters {
                held.in_scope(|| {});
            }
            std::thread::sleep(Duration::from_millis(5));
            let before_close = tickline::clock::monotonic_ns().0;
            drop(held);
            (before_close, tickline::clock::monotonic_ns().0)
        });
        timeline.shutdown().unwrap();
        let trace = memory.snapshot();
        let slices = trace.slices();
        let lifetime = slices
            .iter()
            .find(|s| s.name == "held" && !trace.is_thread_track(s.track))
            .unwrap_or_else(|| panic!("{mode:?}, {enters} enters: no task lifetime in {slices:?}"));
        assert_ends_at_close(
            lifetime,
            before_close,
            after_close,
            &format!("{mode:?}, {enters} enters"),
        );
    }
}

/// A span entered once that holds child tasks (created inside it, polled on other threads, awaited before the
/// span is dropped) is a task container: its lifetime runs to its close, past its children's, even though its
/// thread recorded nothing between its only exit and its close. Explicit children (`parent: &span`, created
/// outside it) count too.
#[test]
fn a_span_holding_child_tasks_lives_until_its_close_after_theirs() {
    let _x = exclusive();
    for explicit in [false, true] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
        let subscriber = tracing_subscriber::registry().with(timeline.layer());
        let (before_close, after_close) = tracing::subscriber::with_default(subscriber, || {
            let dispatch = tracing::dispatcher::get_default(|d| d.clone());
            let holder = tracing::info_span!("holder");
            // Entered once either way: the children created inside that one enter, or on their own threads
            // naming it (so its thread records nothing between its exit and its close).
            let children: Vec<Option<tracing::Span>> = if explicit {
                holder.in_scope(|| {});
                vec![None, None]
            } else {
                holder.in_scope(|| (0..2u64).map(|k| Some(tracing::info_span!("child", k))).collect())
            };
            let holder_id = holder.id();
            let workers: Vec<_> = children
                .into_iter()
                .enumerate()
                .map(|(k, child)| {
                    let dispatch = dispatch.clone();
                    let holder_id = holder_id.clone();
                    std::thread::spawn(move || {
                        tracing::dispatcher::with_default(&dispatch, || {
                            let child = child.unwrap_or_else(|| tracing::info_span!(parent: holder_id, "child", k));
                            for _ in 0..2 {
                                child.in_scope(|| std::thread::sleep(Duration::from_millis(2)));
                                std::thread::sleep(Duration::from_millis(3));
                            }
                            drop(child);
                        })
                    })
                })
                .collect();
            for worker in workers {
                worker.join().unwrap();
            }
            std::thread::sleep(Duration::from_millis(5));
            let before_close = tickline::clock::monotonic_ns().0;
            drop(holder);
            (before_close, tickline::clock::monotonic_ns().0)
        });
        timeline.shutdown().unwrap();
        let trace = memory.snapshot();
        let slices = trace.slices();
        let off_thread = |name: &str| -> Vec<&RecordedSlice> {
            slices
                .iter()
                .filter(|s| s.name == name && !trace.is_thread_track(s.track) && s.name != "poll")
                .collect()
        };
        let holder = off_thread("holder");
        let children = off_thread("child");
        assert_eq!(
            (holder.len(), children.len()),
            (1, 2),
            "explicit {explicit}: {slices:?}"
        );
        let holder = holder[0];
        for child in &children {
            assert!(
                child.end_ns <= holder.end_ns,
                "explicit {explicit}: a child task's lifetime ends at {} ns, after its holder's at {} ns",
                child.end_ns,
                holder.end_ns
            );
        }
        assert_ends_at_close(holder, before_close, after_close, &format!("explicit {explicit}"));
    }
}

/// A span entered on two fresh threads at once is a task, and each of its polls has its flow (thread slice to
/// task poll), whichever thread's ring the collector reads first and wherever the span closes: on the thread
/// that made it, after both (the collector may see that close before the first thread's exit), or right after
/// the later exit on the thread that held the last handle.
#[test]
fn a_span_polled_on_two_threads_at_once_gives_every_poll_its_flow() {
    let _x = exclusive();
    for last_handle_on_worker in [false, true] {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
        let subscriber = tracing_subscriber::registry().with(timeline.layer());
        const SPANS: u64 = 40;
        tracing::subscriber::with_default(subscriber, || {
            let dispatch = tracing::dispatcher::get_default(|d| d.clone());
            for id in 0..SPANS {
                let span = tracing::info_span!("duo", id);
                let both_in = Arc::new(std::sync::Barrier::new(2));
                let workers: Vec<_> = (0..2u64)
                    .map(|t| {
                        let (span, both_in, dispatch) = (span.clone(), both_in.clone(), dispatch.clone());
                        std::thread::spawn(move || {
                            tracing::dispatcher::with_default(&dispatch, || {
                                std::thread::sleep(Duration::from_micros(t * 100));
                                {
                                    let _poll = span.enter();
                                    both_in.wait();
                                    std::thread::sleep(Duration::from_micros(300 - t * 100));
                                }
                                // The second thread out drops the last handle right after its exit.
                                drop(span);
                            })
                        })
                    })
                    .collect();
                if last_handle_on_worker {
                    drop(span);
                    for worker in workers {
                        worker.join().unwrap();
                    }
                } else {
                    for worker in workers {
                        worker.join().unwrap();
                    }
                    drop(span);
                }
            }
        });
        timeline.shutdown().unwrap();
        let trace = memory.snapshot();
        let slices = trace.slices();
        let case = format!("last handle on a worker: {last_handle_on_worker}");
        let lifetimes = slices
            .iter()
            .filter(|s| s.name == "duo" && !trace.is_thread_track(s.track))
            .count() as u64;
        assert_eq!(lifetimes, SPANS, "{case}: one task each");
        let thread_polls: Vec<&RecordedSlice> = slices
            .iter()
            .filter(|s| s.name == "duo" && trace.is_thread_track(s.track))
            .collect();
        let task_polls: Vec<&RecordedSlice> = slices.iter().filter(|s| s.name == "poll").collect();
        assert_eq!(
            (thread_polls.len() as u64, task_polls.len() as u64),
            (2 * SPANS, 2 * SPANS),
            "{case}"
        );
        let outs: HashSet<u64> = thread_polls.iter().filter_map(|s| s.flow_out).collect();
        let ins: HashSet<u64> = task_polls.iter().filter_map(|s| s.flow_in).collect();
        let without: Vec<_> = thread_polls
            .iter()
            .filter(|s| s.flow_out.is_none())
            .map(|s| (id_of(s), s.begin_ns, s.end_ns))
            .collect();
        assert!(without.is_empty(), "{case}: thread polls without a flow: {without:?}");
        assert_eq!(outs, ins, "{case}: every flow has both ends");
        assert_eq!(outs.len() as u64, 2 * SPANS, "{case}");
    }
}

/// A chain of nested tasks deeper than a viewer can nest tracks (Perfetto's importer drops a track with more than
/// 100 ancestors, and everything on it) keeps every task: tracks nest to a fixed depth, and deeper tasks go
/// beside their parent task there. Every task still has its lifetime and polls.
#[test]
fn a_chain_of_tasks_deeper_than_a_viewer_nests_keeps_every_task_within_its_depth() {
    let _x = exclusive();
    const CHAIN: usize = 130;
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        // Each link created inside the one before and entered twice (a task).
        fn link(depth: usize) {
            if depth == CHAIN {
                return;
            }
            let span = tracing::info_span!("link", depth);
            span.in_scope(|| {});
            span.in_scope(|| link(depth + 1));
        }
        link(0);
    });
    timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    let depth_of = |mut track: TrackId| {
        let mut depth = 0;
        while let Some(parent) = trace.track(track).and_then(|t| t.parent) {
            depth += 1;
            track = parent;
        }
        depth
    };
    let tasks: Vec<_> = trace
        .async_task_tracks()
        .into_iter()
        .filter(|t| matches!(&t.kind, TrackKind::AsyncTask { name } if name.starts_with("link")))
        .collect();
    assert_eq!(tasks.len(), CHAIN, "one track per task");
    let deepest = tasks.iter().map(|t| depth_of(t.id)).max().unwrap();
    assert!(
        (60..=70).contains(&deepest),
        "tracks nest to a fixed depth well under 100: {deepest}"
    );
    let slices = trace.slices();
    for task in &tasks {
        let on_it: Vec<_> = slices.iter().filter(|s| s.track == task.id).collect();
        assert_eq!(
            on_it.iter().filter(|s| s.name == "link").count(),
            1,
            "{:?}: one lifetime",
            task.kind
        );
        assert_eq!(
            on_it.iter().filter(|s| s.name == "poll").count(),
            2,
            "{:?}: its polls",
            task.kind
        );
    }
}

/// Spans exited out of stack order (`let a = s1.entered(); let b = s2.entered(); drop(a)`) are entered once:
/// synchronous, so `Auto` gives them no task and no flow, split or not.
#[test]
fn spans_exited_out_of_order_are_synchronous() {
    let _x = exclusive();
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..100u64 {
            let _frame = tracing::info_span!("frame", i).entered();
            let a = tracing::info_span!("A", i).entered();
            let b = tracing::info_span!("B", i).entered();
            drop(a);
            drop(b);
        }
    });
    timeline.shutdown().unwrap();
    let trace = memory.snapshot();
    assert!(trace.async_task_tracks().is_empty());
    let with_flows: Vec<_> = trace
        .slices()
        .into_iter()
        .filter(|s| s.flow_out.is_some() || s.flow_in.is_some())
        .map(|s| s.name)
        .collect();
    assert!(
        with_flows.is_empty(),
        "{} slices with a flow: {:?}",
        with_flows.len(),
        &with_flows[..5.min(with_flows.len())]
    );
}
