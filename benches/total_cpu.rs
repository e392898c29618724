//! Total CPU per recorded operation, all threads included: the recording thread, tickline's drain and
//! processing threads, the exporter's encoding, and the final drain at shutdown. The question the hot-path
//! benches (`overhead.rs`) cannot answer: what a span or an event costs the machine, not just the thread that
//! records it.
//!
//! Each configuration runs `OPS` operations on one thread, then shuts its timeline down (everything is
//! processed and encoded); the process's CPU time (`CLOCK_PROCESS_CPUTIME_ID`) over that, divided by `OPS`,
//! is one sample. Configurations, measured in the same run:
//!
//! - `floor`: `registry()` + an empty layer (what `tracing` itself costs);
//! - `tickline_perfetto`: tickline with the Perfetto exporter writing to a file;
//! - `tickline_raw`: tickline writing a raw capture (`.tickline`) and no exporter;
//! - `tracing_tracy`: `tracing-tracy`'s layer (Tracy queues everything in memory: no profiler connects),
//!   measured last, once the Tracy client runs, against a floor measured beside it.
//!
//! Once-per-process costs are paid before measuring: the process's TSC decision (whose full check runs on
//! background threads for a few seconds after the first timeline starts) and the Tracy client's start (when the
//! process loads, not at `Client::start()`: `settle` waits until its threads are idle).
//!
//! Operations: `span` (`info_span!("span").entered()` dropped: create, enter, exit, close) and `event`
//! (`info!(i, "event")`); with `--once`, also `scope` (`tickline::scope!`, no `tracing`: the recording path
//! alone) and `span_field` (`info_span!("span", i).entered()` dropped: a span with a field, `#[instrument]`'s
//! case, whose slice waits for its values) and `span_field_event` (the same with an `info!` inside, held
//! behind the span's begin).
//!
//! `TICKLINE_BENCH_ASYNC_TASKS=never` runs tickline's configurations with `AsyncTasks::Never` (default: `Auto`),
//! to see what deciding which spans are async tasks costs the collector. `TICKLINE_BENCH_RING=N` starts their
//! rings at `N` records (default: the builder's 64 Ki), to see how the drain's wake-ups trade against the size
//! of each pass.
//!
//! `cargo bench -p tickline-benches --bench total_cpu` prints the medians of 9 samples. `-- --once CONFIG OP`
//! prints one sample (the slow-mode check runs that as 20 separate processes: `benches/slow_mode.sh`);
//! `-- --once CONFIG OP --repeat N` takes N samples in that one process and prints each; `--median N` takes N and
//! prints their medians as the one sample.
//! `cargo test --benches` runs each configuration once with few operations, to keep it compiling and working.

use std::hint::black_box;
use std::time::Duration;

use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::{Dispatch, Subscriber};
use tracing_subscriber::layer::{Layer, SubscriberExt};

/// The floor: a layer that does nothing.
struct EmptyLayer;

impl<S: Subscriber> Layer<S> for EmptyLayer {}

fn cpu_clock(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock ids used exist on Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn process_cpu() -> Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn thread_cpu() -> Duration {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// One sample, in ns of CPU per operation: all threads, and the recording thread alone.
#[derive(Clone, Copy)]
struct Sample {
    total: f64,
    recording: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Config {
    Floor,
    TicklinePerfetto,
    TicklineRaw,
    TracingTracy,
}

const CONFIGS: [(&str, Config); 4] = [
    ("floor", Config::Floor),
    ("tickline_perfetto", Config::TicklinePerfetto),
    ("tickline_raw", Config::TicklineRaw),
    ("tracing_tracy", Config::TracingTracy),
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Span,
    Event,
    /// `tickline::scope!` (no `tracing`): `--once` only, to tell the ring's cost from the registry's.
    Scope,
    /// `info_span!("span", i).entered()` dropped: a span with a field (`#[instrument]`'s case), whose slice
    /// waits for its values (`--once` only).
    SpanField,
    /// The same span with an `info!(i, "event")` inside: an event held behind its span's begin until the span
    /// ends (`--once` only).
    SpanFieldEvent,
}

fn run_ops(op: Op, ops: u64) {
    match op {
        Op::Span => {
            for _ in 0..ops {
                drop(black_box(tracing::info_span!("span").entered()));
            }
        }
        Op::SpanField => {
            for i in 0..ops {
                drop(black_box(tracing::info_span!("span", i).entered()));
            }
        }
        Op::SpanFieldEvent => {
            for i in 0..ops {
                let _span = tracing::info_span!("span", i).entered();
                tracing::info!(i, "event");
            }
        }
        Op::Event => {
            for i in 0..ops {
                tracing::info!(i, "event");
            }
        }
        Op::Scope => {
            for _ in 0..ops {
                drop(black_box(tickline::scope!("scope")));
            }
        }
    }
}

/// One sample: ns of CPU per operation.
fn sample(config: Config, op: Op, ops: u64) -> Sample {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("tickline-total-cpu-{}", std::process::id()));
    let start = process_cpu();
    let mut recording = Duration::ZERO;
    let mut run_ops = |op, ops| {
        let t0 = thread_cpu();
        run_ops(op, ops);
        recording += thread_cpu() - t0;
    };
    match config {
        Config::Floor => {
            let dispatch = Dispatch::new(tracing_subscriber::registry().with(EmptyLayer));
            tracing::dispatcher::with_default(&dispatch, || run_ops(op, ops));
        }
        Config::TicklinePerfetto | Config::TicklineRaw => {
            let builder = match std::env::var("TICKLINE_BENCH_ASYNC_TASKS").as_deref() {
                Ok("never") => Timeline::builder().async_tasks(tickline::AsyncTasks::Never),
                _ => Timeline::builder(),
            };
            let builder = match std::env::var("TICKLINE_BENCH_RING").ok().and_then(|v| v.parse().ok()) {
                Some(records) => builder.ring_capacity(records).max_ring_capacity(1 << 20),
                None => builder,
            };
            let builder = if config == Config::TicklinePerfetto {
                builder.exporter(PerfettoExporter::create(path.with_extension("pftrace")).expect("trace file"))
            } else {
                builder.raw_capture(path.with_extension("tickline"))
            };
            let timeline = builder.start().expect("timeline");
            *SOURCE.lock().unwrap() = Some(timeline.tick_source());
            let dispatch = Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
            tracing::dispatcher::with_default(&dispatch, || run_ops(op, ops));
            drop(dispatch);
            // The collector's threads end with the timeline: their counters now, for `--repeat`.
            *SCHED_BEFORE_SHUTDOWN.lock().unwrap() = thread_sched();
            let before_shutdown = process_cpu();
            let stats = timeline.shutdown().expect("shutdown");
            assert_eq!(
                stats.dropped_records, 0,
                "{config:?} dropped records (the sample would flatter it): {stats:?}"
            );
            *SHUTDOWN_CPU.lock().unwrap() = process_cpu() - before_shutdown;
        }
        Config::TracingTracy => {
            let dispatch = Dispatch::new(tracing_subscriber::registry().with(tracing_tracy::TracyLayer::default()));
            tracing::dispatcher::with_default(&dispatch, || run_ops(op, ops));
        }
    }
    let elapsed = process_cpu() - start;
    for ext in ["pftrace", "tickline"] {
        let _ = std::fs::remove_file(path.with_extension(ext));
    }
    Sample {
        total: elapsed.as_nanos() as f64 / ops as f64,
        recording: recording.as_nanos() as f64 / ops as f64,
    }
}

/// The tick source the last sample's timeline recorded with.
static SOURCE: std::sync::Mutex<Option<tickline::clock::TickSource>> = std::sync::Mutex::new(None);

/// The process's CPU time spent in the last sample's `Timeline::shutdown` (the backlog the collector had left).
static SHUTDOWN_CPU: std::sync::Mutex<Duration> = std::sync::Mutex::new(Duration::ZERO);

/// [`thread_sched`] read just before the last sample's timeline shut down.
static SCHED_BEFORE_SHUTDOWN: std::sync::Mutex<Vec<(String, i64)>> = std::sync::Mutex::new(Vec::new());

/// CPU time (ms) and context switches of the calling (recording) thread and of the collector's threads
/// (empty where `/proc/*/sched` is not there).
fn thread_sched() -> Vec<(String, i64)> {
    let mut out = Vec::new();
    let mut read = |label: &str, path: &std::path::Path| {
        if let Some(cpu) = path.parent().and_then(schedstat_cpu_ns) {
            out.push((format!("{label}.cpu_ms"), cpu / 1_000_000));
        }
        let text = std::fs::read_to_string(path).unwrap_or_default();
        for name in ["nr_voluntary_switches", "nr_involuntary_switches"] {
            let value = text
                .lines()
                .find(|l| l.split_whitespace().next() == Some(name))
                .and_then(|l| l.split_whitespace().last()?.parse().ok());
            if let Some(value) = value {
                out.push((format!("{label}.{}", &name[3..]), value));
            }
        }
    };
    read("recording", std::path::Path::new("/proc/thread-self/sched"));
    // The collector's threads (named `tickline-*`): one of each at a time.
    for (comm, task) in threads_named("tickline-") {
        read(&comm, &task.join("sched"));
    }
    out
}

/// This process's threads whose names start with `prefix`: (name, `/proc/self/task/<tid>`), in tid order.
fn threads_named(prefix: &str) -> Vec<(String, std::path::PathBuf)> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut tasks: Vec<_> = tasks.flatten().map(|t| t.path()).collect();
    tasks.sort();
    tasks
        .into_iter()
        .filter_map(|task| {
            let comm = std::fs::read_to_string(task.join("comm")).ok()?;
            comm.starts_with(prefix).then(|| (comm.trim().to_owned(), task))
        })
        .collect()
}

/// A thread's CPU time in ns (`task` a `/proc` task directory): the first field of its `schedstat`.
fn schedstat_cpu_ns(task: &std::path::Path) -> Option<i64> {
    let stat = std::fs::read_to_string(task.join("schedstat")).ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

/// CPU time (ns) of this process's threads named `Tracy*`.
fn tracy_threads_cpu() -> i64 {
    threads_named("Tracy")
        .iter()
        .filter_map(|(_, task)| schedstat_cpu_ns(task))
        .sum()
}

/// Waits (at most 10 s) until the Tracy client's threads stop working. The peers' `tracy-client` starts its
/// client when the process loads (no `manual-lifetime`: that feature would reach tickline-tracy's own tests
/// through the workspace's feature unification), and its start-up reads the kernel's symbols on a thread of its
/// own for a few hundred ms of CPU: without this wait, that runs beside the first samples and is counted in
/// their process CPU time. Afterwards its threads sleep (a few µs of CPU per second).
fn wait_for_tracy_start_up() {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut before = tracy_threads_cpu();
    while std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        let now = tracy_threads_cpu();
        // Less than 1 ms of CPU in 100 ms: idle.
        if now - before < 1_000_000 {
            return;
        }
        before = now;
    }
}

/// The sample with the median total.
fn median(mut v: Vec<Sample>) -> Sample {
    v.sort_by(|a, b| a.total.total_cmp(&b.total));
    v[v.len() / 2]
}

fn parse_config(name: &str) -> Config {
    CONFIGS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, c)| *c)
        .unwrap_or_else(|| panic!("unknown config {name}"))
}

/// The once-per-process costs that are not per operation, paid before measuring: the process's TSC decision
/// (its full check runs on background threads for a few seconds after the first timeline starts) and, for
/// `tracing_tracy`, the Tracy client (its worker and symbol threads).
fn settle(tracy: bool) -> Option<tracy_client::Client> {
    let decision = tickline::clock::TscDecider::process().wait_final(Duration::from_secs(60));
    assert!(decision.is_final(), "the TSC decision did not finish: {decision:?}");
    wait_for_tracy_start_up();
    tracy.then(|| {
        let client = tracy_client::Client::start();
        // Let its start-up work (delay calibration, symbol loading) finish.
        std::thread::sleep(Duration::from_secs(2));
        client
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--once") {
        let config = parse_config(&args[at + 1]);
        let op = match args.get(at + 2).map(String::as_str) {
            Some("event") => Op::Event,
            Some("scope") => Op::Scope,
            Some("span_field") => Op::SpanField,
            Some("span_field_event") => Op::SpanFieldEvent,
            _ => Op::Span,
        };
        // Warm up (first timeline start, page faults), settle, then one sample.
        sample(Config::Floor, op, 100_000);
        let _tracy = settle(config == Config::TracingTracy);
        sample(config, op, 100_000);
        // `--repeat N`: N samples in this one process, each printed (does a process slow down as it goes?).
        let repeat = args
            .iter()
            .position(|a| a == "--repeat")
            .and_then(|at| args.get(at + 1)?.parse().ok())
            .unwrap_or(1usize);
        // `--median N`: N samples in this one process, their medians printed as one sample: what the process
        // runs at, not one moment of it (the slow-mode check compares processes, not interruptions).
        let median_of = args
            .iter()
            .position(|a| a == "--median")
            .and_then(|at| args.get(at + 1)?.parse().ok())
            .unwrap_or(1usize);
        if median_of > 1 {
            let mut samples: Vec<Sample> = (0..median_of).map(|_| sample(config, op, 1_000_000)).collect();
            samples.sort_by(|a, b| a.total.total_cmp(&b.total));
            let total = samples[median_of / 2].total;
            samples.sort_by(|a, b| a.recording.total_cmp(&b.recording));
            println!("{total:.1}");
            eprintln!("recording thread {:.1}", samples[median_of / 2].recording);
            return;
        }
        for k in 0..repeat {
            let before = thread_sched();
            let s = sample(config, op, 1_000_000);
            if repeat > 1 {
                // With what the scheduler did to the threads meanwhile (Linux: /proc/*/sched).
                let after = std::mem::take(&mut *SCHED_BEFORE_SHUTDOWN.lock().unwrap());
                // Threads started during the sample (the timeline's own) count from 0.
                let delta: Vec<String> = after
                    .iter()
                    .map(|(name, a)| {
                        let b = before.iter().find(|(n, _)| n == name).map_or(0, |(_, b)| *b);
                        format!("{name} {}", a - b)
                    })
                    .collect();
                let shutdown = std::mem::take(&mut *SHUTDOWN_CPU.lock().unwrap());
                eprintln!(
                    "sample {k}: {:.1} (recording thread {:.1}, shutdown {:.1}) ticks {:?}, {}",
                    s.total,
                    s.recording,
                    shutdown.as_nanos() as f64 / 1_000_000.0,
                    SOURCE.lock().unwrap().take(),
                    delta.join(", ")
                );
            }
            if k + 1 == repeat {
                println!("{:.1}", s.total);
                eprintln!("recording thread {:.1}", s.recording);
            }
        }
        return;
    }
    let full = args.iter().any(|a| a == "--bench");
    let (ops, samples) = if full { (1_000_000, 9) } else { (10_000, 1) };
    // tickline's configurations first, before any Tracy layer records (the Tracy client's threads, started when
    // the process loaded, are idle by then: see `wait_for_tracy_start_up`); then `tracing_tracy`, compared with a
    // floor measured beside it.
    let _ = Timeline::builder().start().map(Timeline::shutdown);
    // Kept to the end: the Tracy client stops with the process.
    let mut _tracy = None;
    for phase_tracy in [false, true] {
        if phase_tracy {
            _tracy = settle(true);
        } else {
            settle(false);
        }
        for op in [Op::Span, Op::Event] {
            let mut floor = 0.0;
            for (name, config) in CONFIGS {
                if (config == Config::TracingTracy) != phase_tracy && config != Config::Floor {
                    continue;
                }
                sample(config, op, ops / 10);
                let m = median((0..samples).map(|_| sample(config, op, ops)).collect());
                let ns = m.total;
                if config == Config::Floor {
                    floor = ns;
                    let beside = if phase_tracy { " (Tracy client running)" } else { "" };
                    println!("total_cpu/{op:?}/{name}{beside}: {ns:.1} ns per op");
                } else {
                    println!(
                        "total_cpu/{op:?}/{name}: {ns:.1} ns per op (floor + {:.1}; the recording thread {:.1}, \
                         the other threads {:.1})",
                        ns - floor,
                        m.recording,
                        ns - m.recording
                    );
                }
            }
        }
    }
}
