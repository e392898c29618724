//! What one span or one native scope costs the instrumented thread, against the floor and against peers.
//!
//! Groups, each comparing every subscriber in one run:
//! - `span_create_enter_exit_close`: `tracing::info_span!("bench").entered()` dropped at once (a span with no
//!   fields): new span, enter, exit, close.
//! - `span_enter_exit_precreated`: `span.enter()` dropped at once, on a span created before the loop.
//! - `tickline_async_never`: tickline with `AsyncTasks::Never` (span creations not timestamped), next to the
//!   default `tickline` (`Auto`): what the creation stamp that task lifetimes need costs a synchronous span.
//! - `native_scope`: `tickline::scope!` against `tracy_client::span!` and an empty loop.
//! - `*_threads`: the same bodies on 1 and on 2 worker threads started together at a barrier; a sample is the
//!   slower thread's time, so `2_threads / 1_thread` near 1.0 means the threads do not slow each other down.
//!   Each thread runs under its own `registry()` with the same layer (for tickline: layers of one
//!   `Timeline`). `empty_layer/2_threads_one_registry` runs both under one registry instead: it shows what
//!   sharing the registry alone costs (its per-thread span stacks of consecutive threads share a cache line).
//!
//! Subscribers: `registry()` plus an empty layer (the floor), plus `Timeline::layer()` (drop mode, the default
//! 64 Ki-record rings, the collector polling every 1 ms), plus `tracing_tracy::TracyLayer::default()`, plus
//! `tracing_chrome::ChromeLayer` writing to a byte-counting sink (no disk).
//! `tickline_tracy` is `Timeline::layer()` of a second timeline with the Tracy exporter installed
//! (`tickline_tracy::TracyExporter::install`): each enter/exit also emits a Tracy zone on the recording
//! thread through the live sink, in the same Tracy mode as `tracing-tracy`. `native_scope_tracy` compares
//! `tickline::scope!` with that exporter against `tracy_client::span!`. (The collector CPU figure is read
//! from the first thread named `tickline-collector`, whichever timeline's it is.)
//!
//! tickline is timed in chunks of half a ring: between chunks the timer stops and the bench flushes until the
//! collector has caught up. A loop that does nothing but open spans outruns the collector, and once the ring
//! is full the loop would time the drop path instead of the push; chunking keeps what is measured the cost of
//! recording while the collector keeps up (it still drains every 1 ms during a chunk, as in a program). Each
//! tickline benchmark prints how many of its records were dropped (to show it was none) and the collector's
//! CPU time per record.
//!
//! Tracy mode: `tracing-tracy` and `tracy-client` are built with `default-features = false,
//! features = ["enable"]`: no sampling, system or context-switch tracing, call stacks, code transfer,
//! broadcast or crash handler, and not `ondemand`. The profiler starts with the process and no profiler
//! connects, so Tracy queues every zone in memory for a connection that never comes: its time includes
//! the page faults of a queue that only grows, and the bench prints the resident size after each group.
//!
//! tracing-chrome sends every enter and exit over a channel to its writer thread, which turns it into JSON
//! on the other core (and is woken by the send when it is idle); a fresh layer is built for each benchmark
//! and dropped after it, which waits until the writer has caught up, so its backlog never carries over.

use std::hint::black_box;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use tickline::Timeline;
use tickline_tracy::TracyExporter;
use tracing::{Dispatch, Subscriber};
use tracing_subscriber::layer::{Layer, SubscriberExt};

/// The floor: a layer that does nothing, so the registry's own work is what is measured.
struct EmptyLayer;

impl<S: Subscriber> Layer<S> for EmptyLayer {}

/// The span bodies. One call site each, shared by every subscriber.
fn create_enter_exit_close() {
    drop(tracing::info_span!("bench").entered());
}

fn precreated_span() -> tracing::Span {
    tracing::info_span!("bench")
}

/// A `Write` that discards what tracing-chrome writes but counts the bytes, to check it wrote something.
struct CountingSink(Arc<AtomicU64>);

impl Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A fresh tracing-chrome subscriber with its writer thread.
struct Chrome {
    dispatch: Dispatch,
    guard: tracing_chrome::FlushGuard,
    bytes: Arc<AtomicU64>,
}

impl Chrome {
    fn new() -> Self {
        let bytes = Arc::new(AtomicU64::new(0));
        let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
            .writer(CountingSink(bytes.clone()))
            .build();
        Chrome {
            dispatch: Dispatch::new(tracing_subscriber::registry().with(layer)),
            guard,
            bytes,
        }
    }

    /// Runs `f` under this subscriber and checks that the writer thread got JSON out of it.
    fn assert_writes(&self, f: impl FnOnce()) {
        let before = self.bytes.load(Ordering::Relaxed);
        tracing::dispatcher::with_default(&self.dispatch, f);
        self.guard.flush();
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.bytes.load(Ordering::Relaxed) < before + 64 {
            assert!(Instant::now() < deadline, "tracing-chrome wrote nothing");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Flushes until a flush takes no new record. One `Timeline::flush` is not enough: it runs at most 4
/// collector passes of at most 64 Ki records per ring, so it can leave most of a full ring behind.
fn drain(timeline: &Timeline) {
    loop {
        let before = timeline.stats().records;
        timeline.flush().unwrap();
        if timeline.stats().records == before {
            return;
        }
    }
}

/// Checks that `f` makes `timeline` take at least `records` records, from `threads` more thread rings.
fn assert_records<T>(timeline: &Timeline, records: u64, threads: u64, f: impl FnOnce() -> T) -> T {
    drain(timeline);
    let before = timeline.stats();
    let result = f();
    drain(timeline);
    let after = timeline.stats();
    assert!(
        after.records >= before.records + records.max(1),
        "tickline recorded too little"
    );
    assert!(
        after.threads >= before.threads + threads,
        "tickline: not every thread recorded"
    );
    result
}

fn assert_span_enabled(dispatch: &Dispatch) {
    tracing::dispatcher::with_default(dispatch, || {
        assert!(
            !tracing::info_span!("check").is_disabled(),
            "the subscriber disabled the span"
        );
    });
}

/// Makes a subscriber; each worker thread makes its own, as each thread of a program that set a global
/// subscriber uses it without touching a shared reference count (a scoped `Dispatch` shared by threads
/// would bump one `Arc` count on every span created, a cost global subscribers do not have).
type MakeDispatch = Arc<dyn Fn() -> Dispatch + Send + Sync>;

/// Worker threads that each run a body `iters` times on command, under their own subscriber, starting
/// together at a barrier. The threads live as long as the benchmark, so their thread-local state (ring,
/// span stack) is as warm as the main thread's.
struct Workers {
    commands: Vec<mpsc::Sender<u64>>,
    done: mpsc::Receiver<Duration>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    fn start<M, B>(n: usize, make_dispatch: &MakeDispatch, make_body: M) -> Self
    where
        M: Fn() -> B + Send + Sync + 'static,
        B: FnMut(),
    {
        let barrier = Arc::new(Barrier::new(n));
        let make_body = Arc::new(make_body);
        let (done_tx, done) = mpsc::channel();
        let (ready_tx, ready) = mpsc::channel();
        let mut workers = Workers {
            commands: Vec::new(),
            done,
            threads: Vec::new(),
        };
        for i in 0..n {
            let (command_tx, command_rx) = mpsc::channel::<u64>();
            let (barrier, make_body, done_tx, ready_tx, make_dispatch) = (
                barrier.clone(),
                make_body.clone(),
                done_tx.clone(),
                ready_tx.clone(),
                make_dispatch.clone(),
            );
            let thread = std::thread::Builder::new()
                .name(format!("bench-{i}"))
                .spawn(move || {
                    tracing::dispatcher::with_default(&make_dispatch(), || {
                        let mut body = make_body();
                        ready_tx.send(()).unwrap();
                        for iters in command_rx {
                            barrier.wait();
                            let start = Instant::now();
                            for _ in 0..iters {
                                body();
                            }
                            if done_tx.send(start.elapsed()).is_err() {
                                return;
                            }
                        }
                    })
                })
                .unwrap();
            // One at a time, so that threads take consecutive ids as they would in a program.
            ready.recv().unwrap();
            workers.commands.push(command_tx);
            workers.threads.push(thread);
        }
        workers
    }

    /// Runs `iters` iterations on every thread at once; the slowest thread's time.
    fn run(&self, iters: u64) -> Duration {
        for command in &self.commands {
            command.send(iters).unwrap();
        }
        (0..self.commands.len())
            .map(|_| self.done.recv().unwrap())
            .max()
            .unwrap()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.commands.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Records per thread ring: the default, 64 Ki (1 MiB). Pacing (below) keeps it from filling; a larger ring
/// only spreads each thread's writes over more memory than its cache holds.
const RING_CAPACITY: usize = 1 << 16;

/// How a benchmark's loop is timed.
#[derive(Clone, Copy)]
enum Pace<'a> {
    /// In one go.
    Free,
    /// In chunks that fill half of tickline's ring at the given records per iteration, flushing between.
    Tickline(&'a Timeline, u64),
}

impl<'a> Pace<'a> {
    fn new(timeline: Option<&'a Timeline>, records_per_iter: u64) -> Self {
        timeline.map_or(Pace::Free, |t| Pace::Tickline(t, records_per_iter))
    }

    /// The time of `iters` iterations, given `run(n)`, the time of `n` iterations.
    fn time(self, iters: u64, mut run: impl FnMut(u64) -> Duration) -> Duration {
        let Pace::Tickline(timeline, records_per_iter) = self else {
            return run(iters);
        };
        let chunk = (RING_CAPACITY as u64 / 2 / records_per_iter).max(1);
        let mut total = Duration::ZERO;
        let mut left = iters;
        while left > 0 {
            let n = left.min(chunk);
            drain(timeline);
            total += run(n);
            left -= n;
        }
        total
    }

    /// Runs `bench` and, for tickline, prints how many of the records it made were dropped (ring full) and
    /// how much CPU time the collector spent per record.
    fn count_drops(self, id: &str, bench: impl FnOnce()) {
        let Pace::Tickline(timeline, _) = self else {
            return bench();
        };
        drain(timeline);
        let before = (timeline.stats(), collector_cpu());
        bench();
        drain(timeline);
        let after = (timeline.stats(), collector_cpu());
        let taken = after.0.records - before.0.records;
        let dropped = after.0.dropped_records - before.0.dropped_records;
        let cpu = match (before.1, after.1) {
            (Some(before), Some(after)) if taken >= 1_000_000 => {
                let ns = (after - before).as_nanos() as f64 / taken.max(1) as f64;
                format!("; collector CPU {ns:.0} ns per record")
            }
            _ => String::new(),
        };
        eprintln!("overhead: {id}: tickline took {taken} records, dropped {dropped}{cpu}");
    }
}

/// CPU time (user + system) the collector thread has used so far; Linux only, 10 ms resolution.
fn collector_cpu() -> Option<Duration> {
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        // The kernel keeps 15 bytes of a thread's name.
        if comm.trim_end() != "tickline-collec" {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
        // Fields after the parenthesised name, from `state` (field 3): utime is field 14, stime 15.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        // USER_HZ is 100 on Linux.
        return Some(Duration::from_millis(ticks * 10));
    }
    None
}

fn time_loop(iters: u64, mut body: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        body();
    }
    start.elapsed()
}

/// A benchmark group that knows its name, for the drop counts.
struct Group<'c> {
    group: BenchmarkGroup<'c, WallTime>,
    name: &'static str,
}

impl<'c> Group<'c> {
    fn new(c: &'c mut Criterion, name: &'static str) -> Self {
        Group {
            group: c.benchmark_group(name),
            name,
        }
    }

    /// `body` in a loop on this thread.
    fn bench_here(&mut self, id: &str, pace: Pace<'_>, mut body: impl FnMut()) {
        let group = &mut self.group;
        pace.count_drops(&format!("{}/{id}", self.name), || {
            group.bench_function(id, |b| {
                b.iter_custom(|iters| pace.time(iters, |n| time_loop(n, &mut body)))
            });
        });
    }

    /// `make_body()` in a loop on 1 and on 2 worker threads, as `id/1_thread` and `id/2_threads`; with
    /// `one_registry`, also `id/2_threads_one_registry`: both threads under one subscriber.
    fn bench_threads<M, B>(
        &mut self,
        id: &str,
        make_dispatch: &MakeDispatch,
        pace: Pace<'_>,
        one_registry: bool,
        make_body: M,
    ) where
        M: Fn() -> B + Clone + Send + Sync + 'static,
        B: FnMut(),
    {
        let shared = make_dispatch();
        let one: MakeDispatch = Arc::new(move || shared.clone());
        let variants = [
            (1, make_dispatch, "1_thread"),
            (2, make_dispatch, "2_threads"),
            (2, &one, "2_threads_one_registry"),
        ];
        for (n, make_dispatch, label) in variants {
            if label == "2_threads_one_registry" && !one_registry {
                continue;
            }
            let start = || {
                let workers = Workers::start(n, make_dispatch, make_body.clone());
                workers.run(16);
                workers
            };
            let workers = match pace {
                Pace::Tickline(timeline, records) => assert_records(timeline, 16 * records * n as u64, n as u64, start),
                Pace::Free => start(),
            };
            let group = &mut self.group;
            pace.count_drops(&format!("{}/{id}/{label}", self.name), || {
                group.bench_function(BenchmarkId::new(id, label), |b| {
                    b.iter_custom(|iters| pace.time(iters, |n| workers.run(n)))
                });
            });
        }
    }

    fn finish(self) {
        self.group.finish();
        report_memory(self.name);
    }
}

/// Prints the resident memory, to watch Tracy's in-memory backlog grow (Linux only).
fn report_memory(after: &str) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map_or("?", |v| v.trim())
            .to_owned()
    };
    eprintln!(
        "overhead: after {after}: VmRSS {}, VmHWM {}",
        field("VmRSS:"),
        field("VmHWM:")
    );
}

/// Records per iteration: span new (one record: no field values), enter, exit, close.
const CREATE_CLOSE_RECORDS: u64 = 4;
/// Records per iteration: enter and exit, or scope begin and end.
const ENTER_EXIT_RECORDS: u64 = 2;

fn overhead(c: &mut Criterion) {
    // tickline with the Tracy exporter installed (its live sink emits a Tracy zone per enter/exit on the
    // recording thread). Started first, so that the plain timeline below is the one native macros record
    // into.
    let tracy_timeline = TracyExporter::new()
        .install(Timeline::builder().ring_capacity(RING_CAPACITY))
        .start()
        .unwrap();
    // The same without async task tracks (`AsyncTasks::Never`): span creations are not timestamped, so the
    // pair shows what the creation stamp costs a synchronous span.
    let never_timeline = Timeline::builder()
        .ring_capacity(RING_CAPACITY)
        .async_tasks(tickline::AsyncTasks::Never)
        .start()
        .unwrap();
    let never_layer = never_timeline.layer();
    let tickline_never = Dispatch::new(tracing_subscriber::registry().with(never_layer.clone()));
    let make_tickline_never: MakeDispatch =
        Arc::new(move || Dispatch::new(tracing_subscriber::registry().with(never_layer.clone())));
    // Drop mode, the default.
    let timeline = Timeline::builder().ring_capacity(RING_CAPACITY).start().unwrap();
    let make_floor: MakeDispatch = Arc::new(|| Dispatch::new(tracing_subscriber::registry().with(EmptyLayer)));
    let layer = timeline.layer();
    let make_tickline: MakeDispatch =
        Arc::new(move || Dispatch::new(tracing_subscriber::registry().with(layer.clone())));
    let tracy_layer = tracy_timeline.layer();
    let make_tickline_tracy: MakeDispatch =
        Arc::new(move || Dispatch::new(tracing_subscriber::registry().with(tracy_layer.clone())));
    let make_tracy: MakeDispatch =
        Arc::new(|| Dispatch::new(tracing_subscriber::registry().with(tracing_tracy::TracyLayer::default())));
    let _tracy_client = tracy_client::Client::start();
    assert!(tracy_client::Client::is_running(), "Tracy is not running");
    let (floor, tickline, tracy) = (make_floor(), make_tickline(), make_tracy());
    let tickline_tracy = make_tickline_tracy();
    for dispatch in [&floor, &tickline, &tracy, &tickline_tracy] {
        assert_span_enabled(dispatch);
    }
    assert_records(&timeline, CREATE_CLOSE_RECORDS + ENTER_EXIT_RECORDS, 0, || {
        tracing::dispatcher::with_default(&tickline, || {
            create_enter_exit_close();
            drop(precreated_span().enter());
        })
    });
    assert_records(&timeline, ENTER_EXIT_RECORDS, 0, || drop(tickline::scope!("check")));
    let subscribers = [
        ("empty_layer", &floor, &make_floor, None),
        ("tickline", &tickline, &make_tickline, Some(&timeline)),
        ("tracing_tracy", &tracy, &make_tracy, None),
        (
            "tickline_tracy",
            &tickline_tracy,
            &make_tickline_tracy,
            Some(&tracy_timeline),
        ),
        (
            "tickline_async_never",
            &tickline_never,
            &make_tickline_never,
            Some(&never_timeline),
        ),
    ];

    let mut group = Group::new(c, "span_create_enter_exit_close");
    for (id, dispatch, _, timeline) in subscribers {
        tracing::dispatcher::with_default(dispatch, || {
            let pace = Pace::new(timeline, CREATE_CLOSE_RECORDS);
            group.bench_here(id, pace, create_enter_exit_close);
        });
    }
    let chrome = Chrome::new();
    chrome.assert_writes(create_enter_exit_close);
    tracing::dispatcher::with_default(&chrome.dispatch, || {
        group.bench_here("tracing_chrome", Pace::Free, create_enter_exit_close);
    });
    drop(chrome);
    group.finish();

    let mut group = Group::new(c, "span_enter_exit_precreated");
    for (id, dispatch, _, timeline) in subscribers {
        tracing::dispatcher::with_default(dispatch, || {
            let span = precreated_span();
            let pace = Pace::new(timeline, ENTER_EXIT_RECORDS);
            group.bench_here(id, pace, || drop(span.enter()));
        });
    }
    let chrome = Chrome::new();
    chrome.assert_writes(|| drop(precreated_span().enter()));
    tracing::dispatcher::with_default(&chrome.dispatch, || {
        let span = precreated_span();
        group.bench_here("tracing_chrome", Pace::Free, || drop(span.enter()));
    });
    drop(chrome);
    group.finish();

    let mut group = Group::new(c, "native_scope");
    group.bench_here("none", Pace::Free, || black_box(()));
    group.bench_here("tickline", Pace::new(Some(&timeline), ENTER_EXIT_RECORDS), || {
        let _scope = tickline::scope!("bench");
    });
    group.bench_here("tracy_client", Pace::Free, || {
        let _span = tracy_client::span!("bench");
    });
    group.finish();

    let mut group = Group::new(c, "span_create_enter_exit_close_threads");
    for (id, _, make_dispatch, timeline) in &subscribers[..3] {
        let (id, timeline) = (*id, *timeline);
        let pace = Pace::new(timeline, CREATE_CLOSE_RECORDS);
        group.bench_threads(id, make_dispatch, pace, false, || {
            assert!(
                !tracing::info_span!("check").is_disabled(),
                "the subscriber disabled the span"
            );
            create_enter_exit_close
        });
    }
    group.finish();

    let mut group = Group::new(c, "span_enter_exit_precreated_threads");
    for (id, _, make_dispatch, timeline) in &subscribers[..2] {
        let pace = Pace::new(*timeline, ENTER_EXIT_RECORDS);
        group.bench_threads(id, make_dispatch, pace, *id == "empty_layer", || {
            let span = precreated_span();
            assert!(!span.is_disabled(), "the subscriber disabled the span");
            move || drop(span.enter())
        });
    }
    group.finish();

    let mut group = Group::new(c, "native_scope_threads");
    let pace = Pace::new(Some(&timeline), ENTER_EXIT_RECORDS);
    let no_subscriber: MakeDispatch = Arc::new(Dispatch::none);
    group.bench_threads("tickline", &no_subscriber, pace, false, || {
        || {
            let _scope = tickline::scope!("bench");
        }
    });
    group.finish();

    let stats = timeline.shutdown().unwrap();
    tracy_timeline.shutdown().unwrap();
    never_timeline.shutdown().unwrap();

    // Native scopes with the Tracy exporter: its timeline must be the current one.
    let tracy_timeline = TracyExporter::new()
        .install(Timeline::builder().ring_capacity(RING_CAPACITY))
        .start()
        .unwrap();
    assert_records(&tracy_timeline, ENTER_EXIT_RECORDS, 0, || {
        drop(tickline::scope!("check"))
    });
    let mut group = Group::new(c, "native_scope_tracy");
    group.bench_here("tracy_client", Pace::Free, || {
        let _span = tracy_client::span!("bench");
    });
    group.bench_here(
        "tickline_tracy",
        Pace::new(Some(&tracy_timeline), ENTER_EXIT_RECORDS),
        || {
            let _scope = tickline::scope!("bench");
        },
    );
    group.finish();
    tracy_timeline.shutdown().unwrap();
    println!(
        "tickline: {} records taken, {} dropped (ring full), {} thread rings",
        stats.records, stats.dropped_records, stats.threads
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(30);
    targets = overhead
}
criterion_main!(benches);
