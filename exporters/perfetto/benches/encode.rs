//! How fast slice events are encoded into Perfetto packets (into memory, no I/O).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tickline::export::{Batch, EventKind, Exporter, NameId, TraceEvent, TrackDescriptor, TrackId, TrackKind};
use tickline_perfetto::PerfettoExporter;

const EVENTS: usize = 100_000;

fn batch() -> Batch {
    let mut b = Batch::default();
    b.new_tracks.push(TrackDescriptor {
        id: TrackId(1),
        parent: None,
        kind: TrackKind::Thread {
            pid: 1,
            tid: 1,
            name: "bench".into(),
        },
    });
    b.new_names.push((NameId(1), "slice".into()));
    for i in 0..EVENTS as u64 {
        let kind = if i % 2 == 0 {
            EventKind::SliceBegin
        } else {
            EventKind::SliceEnd
        };
        b.events.push(TraceEvent {
            ts_ns: 1_000_000_000 + i * 40,
            track: TrackId(1),
            kind,
            name: NameId(1),
            fields: 0..0,
            flow_out: None,
            flow_in: None,
        });
    }
    b
}

fn encode(c: &mut Criterion) {
    let batch = batch();
    // Assert before measuring: the batch encodes to one packet per event plus the preamble (clock snapshot,
    // trace UUID, system info, the track, the names, the clock track with its two instants).
    let mut check = PerfettoExporter::new(Vec::new());
    check.export(&batch).unwrap();
    assert_eq!(check.stats().packets, EVENTS as u64 + 8);

    let mut group = c.benchmark_group("perfetto_encode");
    group.throughput(Throughput::Elements(EVENTS as u64));
    group.bench_function("slice_events_into_memory", |b| {
        // The packets are encoded into the exporter's buffer and handed to a sink: no disk in the number.
        let mut exporter = PerfettoExporter::new(std::io::sink());
        b.iter(|| {
            exporter.export(&batch).unwrap();
            exporter.flush().unwrap();
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500)).sample_size(20);
    targets = encode
}
criterion_main!(benches);
