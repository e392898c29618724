//! The collector's side per event: restore the tick, convert it, intern, keep per-track order, assemble the
//! batch, then encode it as Perfetto packets (into memory). Goal: >= 20 M events/s on one core.
//! `collector_steady_spans`: the processing stage's cost per span lifecycle in its steady state (a warm
//! processor, chunk after chunk, a pass's end after each, Perfetto encoding included).
//! `collector_async_polls`: the collector's cost per poll of a span shown as an async task, against the same
//! records shown without task tracks.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use tickline::bench_support::ConvertBench;
use tickline::{export::Exporter, AsyncTasks};
use tickline_perfetto::PerfettoExporter;

const SPANS: usize = 50_000;

fn export(c: &mut Criterion) {
    let mut pipeline = ConvertBench::new(SPANS);
    // Assert before measuring: every record becomes one event, in order.
    pipeline.load();
    let batch = pipeline.convert();
    assert_eq!(batch.events.len(), 2 * SPANS);
    assert!(batch.events.windows(2).all(|w| w[0].ts_ns <= w[1].ts_ns));

    let mut group = c.benchmark_group("collector_export");
    group.throughput(Throughput::Elements(2 * SPANS as u64));
    group.bench_function("convert_only", |b| {
        b.iter_batched_ref(pipeline_loaded, |p| p.convert().events.len(), BatchSize::LargeInput);
    });
    group.bench_function("convert_and_encode_perfetto", |b| {
        let mut exporter = PerfettoExporter::new(std::io::sink());
        b.iter_batched_ref(
            pipeline_loaded,
            |p| {
                exporter.export(p.convert()).unwrap();
                exporter.flush().unwrap();
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();

    // The same for `tracing` spans: four records (create, enter, exit, close) and two events each.
    let mut spans = ConvertBench::tracing_spans(SPANS);
    spans.load();
    assert_eq!(spans.convert().events.len(), 2 * SPANS);
    let mut group = c.benchmark_group("collector_export_spans");
    group.throughput(Throughput::Elements(SPANS as u64));
    group.bench_function("convert_only", |b| {
        b.iter_batched_ref(spans_loaded, |p| p.convert().events.len(), BatchSize::LargeInput);
    });
    group.bench_function("convert_and_encode_perfetto", |b| {
        let mut exporter = PerfettoExporter::new(std::io::sink());
        b.iter_batched_ref(
            spans_loaded,
            |p| {
                exporter.export(p.convert()).unwrap();
                exporter.flush().unwrap();
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();

    // The steady state: one warm processor takes chunks of 1,000 spans (created, entered, exited, closed) and
    // ends a drain pass after each (release, Perfetto encoding into memory, sweep), as the live collector does
    // under load. Throughput is per span lifecycle.
    let mut group = c.benchmark_group("collector_steady_spans");
    group.throughput(Throughput::Elements(CHUNK_SPANS as u64));
    for (name, mode) in [("auto_tasks", AsyncTasks::Auto), ("never", AsyncTasks::Never)] {
        let exporter = || -> Vec<Box<dyn Exporter>> { vec![Box::new(PerfettoExporter::new(std::io::sink()))] };
        let mut check = tickline::bench_support::SteadySpans::new(exporter(), mode);
        check.chunk(CHUNK_SPANS);
        let events = check.chunk(CHUNK_SPANS);
        // Two events per span (the timeline's own counters aside), every span out by its pass's end.
        assert!(
            (2 * CHUNK_SPANS as u64..2 * CHUNK_SPANS as u64 + 16).contains(&events),
            "{name}: {events} events"
        );
        let mut steady = tickline::bench_support::SteadySpans::new(exporter(), mode);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| time_processing(iters, &mut steady, |s| s.prepare(CHUNK_SPANS), |s, c| s.process(c)))
        });
    }
    // Spans with a field (`info_span!("span", i)`): each slice waits a pass for its values.
    let exporter = || -> Vec<Box<dyn Exporter>> { vec![Box::new(PerfettoExporter::new(std::io::sink()))] };
    let mut check = tickline::bench_support::SteadySpans::with_field(exporter(), AsyncTasks::Auto);
    check.chunk(CHUNK_SPANS);
    let events = check.chunk(CHUNK_SPANS);
    assert!(
        (2 * CHUNK_SPANS as u64..2 * CHUNK_SPANS as u64 + 16).contains(&events),
        "with_field: {events} events"
    );
    let mut steady = tickline::bench_support::SteadySpans::with_field(exporter(), AsyncTasks::Auto);
    group.bench_function("with_field", |b| {
        b.iter_custom(|iters| time_processing(iters, &mut steady, |s| s.prepare(CHUNK_SPANS), |s, c| s.process(c)))
    });
    group.finish();

    // The same for events: chunks of 1,000 `info!(i, "event")` events (a message and a `u64`). Throughput is per
    // event.
    let mut group = c.benchmark_group("collector_steady_events");
    group.throughput(Throughput::Elements(CHUNK_SPANS as u64));
    let exporter = || -> Vec<Box<dyn Exporter>> { vec![Box::new(PerfettoExporter::new(std::io::sink()))] };
    let mut check = tickline::bench_support::SteadyEvents::new(exporter());
    check.chunk(CHUNK_SPANS);
    let events = check.chunk(CHUNK_SPANS);
    assert!(
        (CHUNK_SPANS as u64..CHUNK_SPANS as u64 + 16).contains(&events),
        "{events} events"
    );
    let mut steady = tickline::bench_support::SteadyEvents::new(exporter());
    group.bench_function("perfetto", |b| {
        b.iter_custom(|iters| time_processing(iters, &mut steady, |s| s.prepare(CHUNK_SPANS), |s, c| s.process(c)))
    });
    group.finish();

    // Async tasks: 10,000 spans each polled 4 times (enter/exit pairs, 8 tasks polled in turn) then closed, with task tracks (`Auto`:
    // each becomes a task with its lifetime slice, 4 poll slices and 4 flows) and without (`Never`: 4 slices
    // on the thread track). Throughput is per poll.
    let mut group = c.benchmark_group("collector_async_polls");
    group.throughput(Throughput::Elements((TASKS * POLLS) as u64));
    for (name, mode) in [("auto_tasks", AsyncTasks::Auto), ("never", AsyncTasks::Never)] {
        let mut check = ConvertBench::async_tasks(TASKS, POLLS, mode);
        check.load();
        let events = check.convert_and_write();
        let per_task = if mode == AsyncTasks::Never {
            2 * POLLS
        } else {
            4 * POLLS + 2
        };
        // Plus a few of the timeline's own counter values.
        let expected = (TASKS * per_task) as u64;
        assert!(
            (expected..expected + 16).contains(&events),
            "{name}: {events} events, {expected} expected"
        );
        group.bench_function(name, |b| {
            b.iter_batched_ref(
                || {
                    let mut p = ConvertBench::async_tasks(TASKS, POLLS, mode);
                    p.load();
                    p
                },
                |p| p.convert_and_write(),
                BatchSize::LargeInput,
            );
        });
    }
    group.finish();
}

/// Spans per chunk of `collector_steady_spans`.
const CHUNK_SPANS: usize = 1_000;

/// Times `iters` passes of a steady-state bench's processing stage alone: each chunk is made first (the
/// recording thread's and the drain's work, not what is measured), then handed over and timed.
fn time_processing<S, C>(
    iters: u64,
    bench: &mut S,
    mut prepare: impl FnMut(&mut S) -> C,
    mut process: impl FnMut(&mut S, C) -> u64,
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let chunk = prepare(bench);
        let start = std::time::Instant::now();
        std::hint::black_box(process(bench, chunk));
        total += start.elapsed();
    }
    total
}

/// Tasks and polls per task of `collector_async_polls`.
const TASKS: usize = 10_000;
const POLLS: usize = 4;

fn spans_loaded() -> ConvertBench {
    let mut p = ConvertBench::tracing_spans(SPANS);
    p.load();
    p
}

fn pipeline_loaded() -> ConvertBench {
    let mut p = ConvertBench::new(SPANS);
    p.load();
    p
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500)).sample_size(20);
    targets = export
}
criterion_main!(benches);
