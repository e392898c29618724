//! The collector's side per event: restore the tick, convert it, intern, keep per-track order, assemble the
//! batch, then encode it as Perfetto packets (into memory). Goal: >= 20 M events/s on one core.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use tickline::bench_support::ConvertBench;
use tickline::Exporter;
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
}

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
