use proptest::prelude::*;

use super::*;
use crate::calibration::ClockCalibration;
use crate::codec::{self, Kind, LeafSpan, Record};
use crate::collector::input::CallsiteKind;
use crate::export::{MemoryExporter, MemoryTrace, TrackKind};

const KNOWN: u64 = 0x1000;

fn processor(memory: &MemoryExporter) -> Processor {
    let out = Output::new(
        &crate::export::RecordingOrigin::this_process(),
        vec![Box::new(memory.clone())],
    );
    let mut p = Processor::new(
        out,
        GpuCalibrationConfig::default(),
        None,
        Arc::new(SharedStats::default()),
    );
    let domain = ClockDomain::new(64, 1.0).unwrap();
    let cal = ClockCalibration::from_anchor(domain, 0, 0, 1.0).unwrap();
    p.set_cpu_clock(CpuTime::Live {
        source: TickSource::Monotonic,
        history: CalibrationHistory::new(domain, HistoryConfig::default()),
        fast: Some(Box::new(FastConverter::new(&cal))),
    });
    p.input(Input::Callsite(CallsiteDef {
        key: KNOWN,
        kind: CallsiteKind::Native,
        name: "known".into(),
        target: String::new(),
        level: 0,
        file: String::new(),
        line: 0,
        fields: vec!["x".into()],
    }));
    p.input(Input::Thread {
        ring: 1,
        tid: 1,
        name: "t".into(),
    });
    p
}

fn arbitrary_record() -> impl Strategy<Value = Record> {
    let key = prop_oneof![Just(KNOWN), any::<u64>()];
    prop_oneof![
        any::<(u64, u64)>().prop_map(|(word0, word1)| Record { word0, word1 }),
        (0u64..16, 0u64..4, 0u64..1_000_000, key).prop_map(|(kind, aux, t, w1)| {
            let kind = Kind::from_bits(kind).unwrap_or(Kind::Data);
            Record::head(kind, aux, t, w1)
        }),
    ]
}

const SPAN: u64 = 0x2000;

fn register_span_callsite(p: &mut Processor) {
    p.input(Input::Callsite(CallsiteDef {
        key: SPAN,
        kind: CallsiteKind::Span,
        name: "job".into(),
        target: String::new(),
        level: 3,
        file: String::new(),
        line: 0,
        fields: vec!["x".into()],
    }));
}

fn ring(p: &mut Processor, ring: u32) {
    p.input(Input::Thread {
        ring,
        tid: ring,
        name: format!("t{ring}"),
    });
}

fn chunk(p: &mut Processor, ring: u32, records: Vec<Record>) {
    chunk_after_drops(p, ring, records, 0);
}

/// A chunk of `ring` drained at 1 ms, when the ring had dropped `dropped_total` records so far.
fn chunk_after_drops(p: &mut Processor, ring: u32, records: Vec<Record>, dropped_total: u64) {
    chunk_drained_at(p, ring, records, dropped_total, 1_000_000);
}

/// A chunk of `ring` drained at `now_ticks`, when the ring had dropped `dropped_total` records so far.
fn chunk_drained_at(p: &mut Processor, ring: u32, records: Vec<Record>, dropped_total: u64, now_ticks: u64) {
    p.input(Input::Chunk(Chunk {
        ring,
        now_ticks,
        dropped_total,
        dropped_slices_total: 0,
        records,
    }));
}

fn pass(p: &mut Processor) {
    p.input(Input::PassEnd {
        drain_ns: 1_000_000,
        drain_ticks: 1_000_000,
        buffered_bytes: 0,
        rings_drained: true,
    });
}

fn u64_field(v: u64) -> Vec<u8> {
    let mut payload = vec![0, codec::TAG_U64];
    payload.extend_from_slice(&v.to_le_bytes());
    payload
}

fn group(f: impl FnOnce(&mut Vec<Record>)) -> Vec<Record> {
    let mut out = Vec::new();
    f(&mut out);
    out
}

#[test]
fn a_span_slice_waits_a_pass_after_its_end_and_shows_its_values_then() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let serial = crate::recorder::span_serial(1, 1);
    let mut records = group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(1)));
    records.push(Record::timed(Kind::SpanEnter, 100, serial));
    records.extend(group(|g| codec::encode_span_record(g, 150, serial, &u64_field(2))));
    records.push(Record::timed(Kind::SpanExit, 200, serial));
    records.extend(group(|g| codec::encode_span_record(g, 250, serial, &u64_field(3))));
    records.push(Record::timed(Kind::SpanClose, 260, serial));
    chunk(&mut p, 1, records);
    pass(&mut p);
    assert_eq!(
        memory.snapshot().slice_count("job"),
        0,
        "held: values from other threads may still come"
    );
    pass(&mut p);
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 1);
    assert_eq!((slices[0].begin_ns, slices[0].end_ns), (100, 200));
    assert_eq!(
        slices[0].field("x"),
        Some(&FieldValue::U64(2)),
        "the value at the slice's end"
    );
}

/// A span whose close says no `record` reached it ([`codec::VALUES_FINAL`]) has its creation values for good:
/// its slices go out in the pass that ends them, a leaf span's at once (no held queue), a span with an event
/// inside at its close (the event with it, in order), and anything held before them first. Without the flag
/// each waits a pass (values from other threads may still come: the test above).
#[test]
fn slices_of_a_span_whose_values_are_final_go_out_without_waiting_a_pass() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let serial = |n| crate::recorder::span_serial(1, n);
    let new = |v| group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(v)));
    let close_at_exit = |n, flags| Record::head(Kind::SpanClose, codec::AT_LAST_EXIT | flags, 0, serial(n));
    // 1: a leaf span with a value, final; 2: the same, not final (held); 3: final again, behind 2's held begin;
    // 4: an event inside, a timed close, final.
    let mut records = new(1);
    records.extend([
        Record::timed(Kind::SpanEnter, 100, serial(1)),
        Record::timed(Kind::SpanExit, 110, serial(1)),
        close_at_exit(1, codec::VALUES_FINAL),
    ]);
    records.extend(new(2));
    records.extend([
        Record::timed(Kind::SpanEnter, 200, serial(2)),
        Record::timed(Kind::SpanExit, 210, serial(2)),
        close_at_exit(2, 0),
    ]);
    records.extend(new(3));
    records.extend([
        Record::timed(Kind::SpanEnter, 300, serial(3)),
        Record::timed(Kind::SpanExit, 310, serial(3)),
        close_at_exit(3, codec::VALUES_FINAL),
    ]);
    chunk(&mut p, 1, records);
    pass(&mut p);
    let x = |slice: &crate::export::RecordedSlice| slice.field("x").cloned();
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 1, "{slices:?}");
    assert_eq!(
        (slices[0].begin_ns, slices[0].end_ns, x(&slices[0])),
        (100, 110, Some(FieldValue::U64(1)))
    );
    let mut records = new(4);
    records.push(Record::timed(Kind::SpanEnter, 400, serial(4)));
    records.extend(group(|g| {
        codec::encode_event(g, 405, KNOWN, codec::Parent::Contextual, &u64_field(9))
    }));
    records.push(Record::timed(Kind::SpanExit, 410, serial(4)));
    records.push(Record::head(Kind::SpanClose, codec::VALUES_FINAL, 420, serial(4)));
    chunk(&mut p, 1, records);
    pass(&mut p);
    let trace = memory.snapshot();
    let slices: Vec<_> = trace.slices().iter().map(|s| (s.begin_ns, s.end_ns, x(s))).collect();
    assert_eq!(
        slices,
        [
            (100, 110, Some(FieldValue::U64(1))),
            (200, 210, Some(FieldValue::U64(2))),
            (300, 310, Some(FieldValue::U64(3))),
            (400, 410, Some(FieldValue::U64(4))),
        ],
        "2 a pass after its end, 3 behind it, 4 at its close"
    );
    let instants: Vec<u64> = trace
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Instant)
        .map(|e| e.ts_ns)
        .collect();
    assert_eq!(instants, [405]);
    // The thread's events in time order (the event inside 4 between its begin and end).
    let thread = trace.thread_track("t").unwrap();
    let times: Vec<u64> = trace.events_on(thread).map(|e| e.ts_ns).collect();
    assert_eq!(times, [100, 110, 200, 210, 300, 310, 400, 405, 410]);
}

/// An event's two ways out: behind a held span begin (its fields in a vector of their own, kept in the held
/// queue) and straight into the batch's field arena (nothing held). Both keep their own fields, no other
/// event's, and their place in the track's order.
#[test]
fn events_keep_their_fields_whether_held_behind_a_slice_or_not() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let serial = crate::recorder::span_serial(1, 1);
    let event = |ticks, v| group(|g| codec::encode_event(g, ticks, KNOWN, codec::Parent::Contextual, &u64_field(v)));
    // Two in one batch: each decodes into the same arena.
    let mut records = event(50, 5);
    records.extend(event(60, 6));
    records.extend(group(|g| {
        codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(1))
    }));
    records.push(Record::timed(Kind::SpanEnter, 100, serial));
    // Held behind the span's begin until the slice ends: the span's values come from its end.
    records.extend(event(150, 7));
    records.push(Record::timed(Kind::SpanExit, 200, serial));
    records.push(Record::timed(Kind::SpanClose, 210, serial));
    chunk(&mut p, 1, records);
    pass(&mut p);
    // After the held begin went out: straight into the arena again.
    chunk(&mut p, 1, event(300, 9));
    pass(&mut p);
    pass(&mut p);
    let trace = memory.snapshot();
    let instants: Vec<(u64, Option<FieldValue>)> = trace
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Instant && e.name == "known")
        .map(|e| (e.ts_ns, e.fields.iter().find(|(n, _)| n == "x").map(|(_, v)| v.clone())))
        .collect();
    assert_eq!(
        instants,
        [
            (50, Some(FieldValue::U64(5))),
            (60, Some(FieldValue::U64(6))),
            (150, Some(FieldValue::U64(7))),
            (300, Some(FieldValue::U64(9)))
        ]
    );
    assert!(trace.events.iter().all(|e| e.fields.len() <= 1), "{:?}", trace.events);
    let slices = trace.slices();
    assert_eq!(slices.len(), 1);
    assert_eq!((slices[0].begin_ns, slices[0].end_ns), (100, 200));
}

/// Events held behind a span begin decode into the field vectors released events left behind (a malloc and a
/// free per held event, a tenth of the collector's time for `info!` inside `#[instrument]` spans), and keep
/// their own values.
#[test]
fn held_events_reuse_the_field_vectors_of_released_ones() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let event = |ticks, v| group(|g| codec::encode_event(g, ticks, KNOWN, codec::Parent::Contextual, &u64_field(v)));
    let span = |n: u64, at: u64, values: &[u64]| {
        let serial = crate::recorder::span_serial(1, n);
        let mut records = group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(n)));
        records.push(Record::timed(Kind::SpanEnter, at, serial));
        for (i, &v) in values.iter().enumerate() {
            records.extend(event(at + 10 + i as u64, v));
        }
        records.push(Record::timed(Kind::SpanExit, at + 50, serial));
        records.push(Record::timed(Kind::SpanClose, at + 60, serial));
        records
    };
    chunk(&mut p, 1, span(1, 100, &[1, 2]));
    pass(&mut p);
    pass(&mut p);
    assert_eq!(p.spare_field_vecs.len(), 2, "both released events' vectors kept");
    chunk(&mut p, 1, span(2, 1_000, &[3]));
    pass(&mut p);
    assert_eq!(p.spare_field_vecs.len(), 1, "the held event took one");
    pass(&mut p);
    assert_eq!(p.spare_field_vecs.len(), 2);
    let trace = memory.snapshot();
    let instants: Vec<(u64, Vec<(String, FieldValue)>)> = trace
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Instant)
        .map(|e| (e.ts_ns, e.fields.clone()))
        .collect();
    let x = |v| vec![("x".to_string(), FieldValue::U64(v))];
    assert_eq!(instants, [(110, x(1)), (111, x(2)), (1_010, x(3))]);
}

fn str_field(text: &str) -> Vec<u8> {
    let mut payload = vec![0, codec::TAG_STR];
    payload.extend_from_slice(&(text.len() as u16).to_le_bytes());
    payload.extend_from_slice(text.as_bytes());
    payload
}

#[test]
fn string_values_are_whole_when_their_allocations_are_reused_from_earlier_batches() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let event = |ticks, text: &str| {
        group(|g| codec::encode_event(g, ticks, KNOWN, codec::Parent::Contextual, &str_field(text)))
    };
    // Batch by batch: a long value, then shorter ones in the strings its batch left (one batch per pass).
    let texts = [
        "a long message of forty characters, or so",
        "short",
        "",
        "mid-sized text",
        "x",
    ];
    for (k, text) in texts.iter().enumerate() {
        chunk(&mut p, 1, event(100 + k as u64 * 10, text));
        pass(&mut p);
    }
    pass(&mut p);
    let values: Vec<Option<FieldValue>> = memory
        .snapshot()
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Instant && e.name == "known")
        .map(|e| e.fields.iter().find(|(n, _)| n == "x").map(|(_, v)| v.clone()))
        .collect();
    let expected: Vec<Option<FieldValue>> = texts.iter().map(|t| Some(FieldValue::Str(t.to_string()))).collect();
    assert_eq!(values, expected);
}

#[test]
fn a_span_entered_on_another_thread_waits_for_its_creation_there() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    ring(&mut p, 2);
    let serial = crate::recorder::span_serial(1, 1);
    // Ring 2 (processed first) enters a span whose creation, on ring 1, comes only next pass.
    chunk(
        &mut p,
        2,
        vec![
            Record::timed(Kind::SpanEnter, 100, serial),
            Record::timed(Kind::SpanExit, 200, serial),
            Record::timed(Kind::SpanClose, 201, serial),
        ],
    );
    pass(&mut p);
    chunk(
        &mut p,
        1,
        group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Root, &u64_field(9))),
    );
    pass(&mut p);
    pass(&mut p);
    let trace = memory.snapshot();
    let slices = trace.slices();
    assert_eq!(slices.len(), 1, "{:?}", trace.events);
    assert_eq!(slices[0].name, "job");
    assert_eq!(slices[0].field("x"), Some(&FieldValue::U64(9)));
    assert_eq!(
        trace.track(slices[0].track).map(|t| &t.kind),
        Some(&TrackKind::Thread {
            pid: std::process::id(),
            tid: 2,
            name: "t2".into()
        })
    );
}

#[test]
fn open_slices_of_an_exited_thread_end_at_its_last_record_marked_truncated() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let serial = crate::recorder::span_serial(1, 1);
    chunk(
        &mut p,
        1,
        vec![
            codec::span_new_bare(0, SPAN),
            Record::timed(Kind::SpanEnter, 100, serial),
            Record::timed(Kind::ScopeBegin, 150, KNOWN),
            Record::timed(Kind::Instant, 300, KNOWN),
        ],
    );
    p.input(Input::ThreadEnd { ring: 1 });
    pass(&mut p);
    // The span slice waits a pass for values recorded elsewhere before the thread ended, as on a live track.
    assert_eq!(memory.snapshot().slice_count("job"), 0);
    pass(&mut p);
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 2);
    for s in &slices {
        assert_eq!(s.end_ns, 300, "ended at the thread's last record, never later");
        assert_eq!(s.field("tickline.truncated"), Some(&FieldValue::Bool(true)), "{s:?}");
    }
    assert_eq!(p.stats.truncated_slices.load(Ordering::Relaxed), 2);
}

#[test]
fn a_gap_shows_where_records_went_missing_and_marks_the_slices_around_it() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    chunk(
        &mut p,
        1,
        vec![
            Record::timed(Kind::ScopeBegin, 100, KNOWN),
            Record::timed(Kind::Gap, 150, 6),
            Record::timed(Kind::ScopeEnd, 200, KNOWN),
        ],
    );
    pass(&mut p);
    let trace = memory.snapshot();
    let gap = trace
        .events
        .iter()
        .find(|e| e.name == "tickline: records dropped")
        .unwrap();
    assert_eq!(gap.fields, [("records".to_owned(), FieldValue::U64(6))]);
    let slice = &trace.slices()[0];
    assert_eq!(slice.field("tickline.dropped_inside"), Some(&FieldValue::U64(6)));
}

#[test]
fn a_span_closed_long_before_its_held_slice_goes_out_keeps_its_values() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let (outer, inner) = (crate::recorder::span_serial(1, 1), crate::recorder::span_serial(1, 2));
    let mut records = vec![
        codec::span_new_bare(0, SPAN),
        Record::timed(Kind::SpanEnter, 100, outer),
    ];
    records.extend(group(|g| {
        codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(5))
    }));
    records.push(Record::timed(Kind::SpanEnter, 110, inner));
    records.push(Record::timed(Kind::SpanExit, 120, inner));
    records.push(Record::timed(Kind::SpanClose, 121, inner));
    chunk(&mut p, 1, records);
    // Many passes while the outer slice (and the inner one behind it) is held.
    for _ in 0..10 {
        pass(&mut p);
    }
    chunk(
        &mut p,
        1,
        vec![
            Record::timed(Kind::SpanExit, 200, outer),
            Record::timed(Kind::SpanClose, 201, outer),
        ],
    );
    pass(&mut p);
    pass(&mut p);
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 2);
    assert_eq!(slices[0].field("x"), Some(&FieldValue::U64(5)), "{slices:?}");
}

fn shutdown(p: &mut Processor) {
    let (reply, answer) = crossbeam_channel::bounded(1);
    p.input(Input::Shutdown(reply));
    answer.recv().unwrap().unwrap();
}

fn flush(p: &mut Processor) {
    let (reply, answer) = crossbeam_channel::bounded(1);
    p.input(Input::Flush(reply));
    answer.recv().unwrap().unwrap();
}

/// A flush drains twice (`drain.rs`): a slice that ended before the flush was called is in the first of those
/// passes or earlier, with every value recorded elsewhere before its end in the second. One that ends in the
/// second ended after the call, maybe after another thread's ring was read with a value recorded before its
/// end: its begin and what it holds go out with the flush, and its end waits a pass for the values that came
/// late.
#[test]
fn a_flush_sends_out_what_came_before_it_and_no_slice_without_a_value_recorded_elsewhere() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    ring(&mut p, 2);
    let (early, late) = (crate::recorder::span_serial(1, 1), crate::recorder::span_serial(1, 2));
    let mut records = group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(1)));
    records.push(Record::timed(Kind::SpanEnter, 100, early));
    records.push(Record::timed(Kind::SpanExit, 150, early));
    records.push(Record::timed(Kind::SpanClose, 151, early));
    records.extend(group(|g| {
        codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(10))
    }));
    records.push(Record::timed(Kind::SpanEnter, 160, late));
    records.push(Record::timed(Kind::Instant, 170, KNOWN));
    chunk(&mut p, 1, records);
    pass(&mut p);
    // The flush's first drain pass: nothing new.
    pass(&mut p);
    // Its second: the late span ends, after ring 2 was read; ring 2 had its value 20 (recorded at 180) by then.
    chunk(
        &mut p,
        1,
        vec![
            Record::timed(Kind::SpanExit, 200, late),
            Record::timed(Kind::SpanClose, 201, late),
        ],
    );
    pass(&mut p);
    flush(&mut p);
    let trace = memory.snapshot();
    let slices = trace.slices();
    assert_eq!(slices.len(), 1, "only the early slice is whole: {slices:?}");
    assert_eq!(slices[0].field("x"), Some(&FieldValue::U64(1)));
    let begins: Vec<_> = trace
        .events
        .iter()
        .filter(|e| e.kind == EventKind::SliceBegin || e.kind == EventKind::Instant)
        .map(|e| (e.ts_ns, e.kind))
        .collect();
    assert_eq!(
        begins,
        [
            (100, EventKind::SliceBegin),
            (160, EventKind::SliceBegin),
            (170, EventKind::Instant)
        ],
        "what was recorded before the flush went out with it"
    );
    chunk(
        &mut p,
        2,
        group(|g| codec::encode_span_record(g, 180, late, &u64_field(20))),
    );
    pass(&mut p);
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 2, "{slices:?}");
    assert_eq!((slices[1].begin_ns, slices[1].end_ns), (160, 200));
    assert_eq!(
        slices[1].field("x"),
        Some(&FieldValue::U64(20)),
        "the value recorded before the slice's end: {slices:?}"
    );
}

/// A slice that ended in this pass waits for it whatever else would send it out: a hold limit long past (a
/// slice open longer than it) or its thread's end. Values recorded on other threads before its end come next.
#[test]
fn a_slice_ended_in_this_pass_waits_for_values_from_other_threads_however_long_it_was_open_and_if_its_thread_ended() {
    for thread_ends in [false, true] {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        // Every held begin is past the hold limit.
        p.hold_limit_ns = 0;
        register_span_callsite(&mut p);
        ring(&mut p, 2);
        let serial = crate::recorder::span_serial(1, 1);
        let mut records = group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(1)));
        records.push(Record::timed(Kind::SpanEnter, 100, serial));
        chunk(&mut p, 1, records);
        pass(&mut p);
        chunk(
            &mut p,
            1,
            vec![
                Record::timed(Kind::SpanExit, 200, serial),
                Record::timed(Kind::SpanClose, 201, serial),
            ],
        );
        if thread_ends {
            p.input(Input::ThreadEnd { ring: 1 });
        }
        pass(&mut p);
        chunk(
            &mut p,
            2,
            group(|g| codec::encode_span_record(g, 180, serial, &u64_field(2))),
        );
        pass(&mut p);
        let slices = memory.snapshot().slices();
        assert_eq!(slices.len(), 1, "thread ends: {thread_ends}: {slices:?}");
        assert_eq!(
            slices[0].field("x"),
            Some(&FieldValue::U64(2)),
            "thread ends: {thread_ends}: {slices:?}"
        );
    }
}

/// A pass that did not drain the live rings (the chunk budget was full, or the drain is paused) brings none
/// of the values recorded elsewhere before a slice's end: a slice waits for a pass that did, and a closed
/// span stays known until such passes have come.
#[test]
fn only_passes_that_drained_the_rings_count_for_what_waits_on_other_threads() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let serial = crate::recorder::span_serial(1, 1);
    let mut records = group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(1)));
    records.push(Record::timed(Kind::SpanEnter, 100, serial));
    records.push(Record::timed(Kind::SpanExit, 200, serial));
    records.push(Record::timed(Kind::SpanClose, 201, serial));
    chunk(&mut p, 1, records);
    // Ring 2 registered in this pass (after its rings were read): its value, recorded at 180, comes later.
    ring(&mut p, 2);
    pass(&mut p);
    let undrained = |p: &mut Processor| {
        p.input(Input::PassEnd {
            drain_ns: 1_000_000,
            drain_ticks: 1_000_000,
            buffered_bytes: 0,
            rings_drained: false,
        })
    };
    for _ in 0..10 {
        undrained(&mut p);
    }
    assert_eq!(
        memory.snapshot().slice_count("job"),
        0,
        "no pass has brought ring 2's records yet"
    );
    chunk(
        &mut p,
        2,
        group(|g| codec::encode_span_record(g, 180, serial, &u64_field(2))),
    );
    pass(&mut p);
    pass(&mut p);
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 1, "{slices:?}");
    assert_eq!(slices[0].field("x"), Some(&FieldValue::U64(2)), "{slices:?}");
    assert_eq!(p.stats.snapshot().unknown_spans, 0);
}

/// A close with final values releases what its track holds while the pass is being processed, before the
/// other rings' records of the pass are in: a slice that ended in the pass before must still wait for them.
#[test]
fn a_release_while_a_pass_is_processed_waits_for_the_other_rings_records_of_that_pass() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let (outer, next) = (crate::recorder::span_serial(1, 1), crate::recorder::span_serial(1, 2));
    let mut records = group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(1)));
    records.push(Record::timed(Kind::SpanEnter, 100, outer));
    records.push(Record::timed(Kind::SpanExit, 200, outer));
    records.push(Record::timed(Kind::SpanClose, 201, outer));
    chunk(&mut p, 1, records);
    // Registered after this pass read the rings: its records come in the next pass.
    ring(&mut p, 2);
    pass(&mut p);
    // The next pass: ring 1 (processed first) closes a span with final values, which releases what its track
    // holds; ring 2 brings the value recorded on the outer span at 180, before its end.
    let mut records = group(|g| codec::encode_span_new(g, 0, SPAN, codec::Parent::Contextual, &u64_field(7)));
    records.push(Record::timed(Kind::SpanEnter, 300, next));
    records.push(Record::timed(Kind::SpanExit, 310, next));
    records.push(Record::head(Kind::SpanClose, codec::VALUES_FINAL, 311, next));
    chunk(&mut p, 1, records);
    chunk(
        &mut p,
        2,
        group(|g| codec::encode_span_record(g, 180, outer, &u64_field(2))),
    );
    pass(&mut p);
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 2, "{slices:?}");
    assert_eq!(slices[0].begin_ns, 100);
    assert_eq!(
        slices[0].field("x"),
        Some(&FieldValue::U64(2)),
        "the value recorded before the slice's end: {slices:?}"
    );
    assert_eq!(slices[1].field("x"), Some(&FieldValue::U64(7)));
}

/// Records a ring dropped after its last record have no `Gap` record after them: when the ring ends (its
/// thread exited, or the timeline shut down) they are shown at its last time, on the slices still open.
#[test]
fn drops_after_a_rings_last_record_are_shown_when_it_ends() {
    for thread_exits in [true, false] {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        chunk_after_drops(
            &mut p,
            1,
            vec![
                Record::timed(Kind::ScopeBegin, 100, KNOWN),
                Record::timed(Kind::Instant, 110, KNOWN),
                Record::timed(Kind::Gap, 120, 3),
                Record::timed(Kind::Instant, 120, KNOWN),
            ],
            // 3 reported by the Gap, 5 more after the last record.
            8,
        );
        pass(&mut p);
        // The last drops come on their own (an empty chunk) when nothing followed them.
        chunk_after_drops(&mut p, 1, Vec::new(), 10);
        if thread_exits {
            p.input(Input::ThreadEnd { ring: 1 });
            pass(&mut p);
            pass(&mut p);
        }
        shutdown(&mut p);
        let trace = memory.snapshot();
        let losses: Vec<(u64, Option<FieldValue>)> = trace
            .events
            .iter()
            .filter(|e| e.name == "tickline: records dropped")
            .map(|e| {
                (
                    e.ts_ns,
                    e.fields.iter().find(|(n, _)| n == "records").map(|(_, v)| v.clone()),
                )
            })
            .collect();
        assert_eq!(
            losses,
            [(120, Some(FieldValue::U64(3))), (120, Some(FieldValue::U64(7)))],
            "thread exits: {thread_exits}"
        );
        let slices = trace.slices();
        assert_eq!(slices.len(), 1);
        assert_eq!(slices[0].field("tickline.dropped_inside"), Some(&FieldValue::U64(10)));
        assert_eq!(slices[0].field("tickline.truncated"), Some(&FieldValue::Bool(true)));
    }
}

/// A poll cut short by the timeline's end is cut short on its task's track too: marked and counted there as
/// on its thread.
#[test]
fn a_poll_cut_short_is_marked_truncated_on_its_task_track_too() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    p.set_async_tasks(AsyncTasks::Always);
    register_span_callsite(&mut p);
    let serial = crate::recorder::span_serial(1, 1);
    chunk(
        &mut p,
        1,
        vec![
            codec::span_new_bare(50, SPAN),
            Record::timed(Kind::SpanEnter, 100, serial),
            Record::timed(Kind::SpanExit, 150, serial),
            Record::timed(Kind::SpanEnter, 200, serial),
            Record::timed(Kind::Instant, 300, KNOWN),
        ],
    );
    pass(&mut p);
    shutdown(&mut p);
    let trace = memory.snapshot();
    let polls: Vec<_> = trace.slices().into_iter().filter(|s| s.name == "poll").collect();
    assert_eq!(polls.len(), 2, "{polls:?}");
    assert_eq!(polls[0].field("tickline.truncated"), None);
    assert_eq!(
        polls[1].field("tickline.truncated"),
        Some(&FieldValue::Bool(true)),
        "{polls:?}"
    );
    let marked = trace
        .slices()
        .iter()
        .filter(|s| s.field("tickline.truncated").is_some())
        .count() as u64;
    // The thread slice, its poll, the task's lifetime.
    assert_eq!(marked, 3);
    assert_eq!(p.stats.truncated_slices.load(Ordering::Relaxed), marked);
}

/// A span's first poll ends while it stays open; the next record (in a later pass) decides: its close
/// (a synchronous span: no flow at all), or a second enter (a task: the first poll's flow reaches it).
#[test]
fn a_first_poll_waits_for_its_span_to_close_or_be_entered_again() {
    for second_enter in [false, true] {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        register_span_callsite(&mut p);
        let serial = crate::recorder::span_serial(1, 1);
        chunk(
            &mut p,
            1,
            vec![
                codec::span_new_bare(90, SPAN),
                Record::timed(Kind::SpanEnter, 100, serial),
                Record::timed(Kind::SpanExit, 110, serial),
            ],
        );
        for _ in 0..3 {
            pass(&mut p);
        }
        assert_eq!(
            memory.snapshot().slices().len(),
            0,
            "the poll's end waits for the decision"
        );
        let mut next = Vec::new();
        if second_enter {
            next.push(Record::timed(Kind::SpanEnter, 300, serial));
            next.push(Record::timed(Kind::SpanExit, 310, serial));
        }
        next.push(Record::timed(Kind::SpanClose, 400, serial));
        chunk(&mut p, 1, next);
        for _ in 0..6 {
            pass(&mut p);
        }
        let trace = memory.snapshot();
        let slices = trace.slices();
        let outs: Vec<u64> = trace.events.iter().filter_map(|e| e.flow_out).collect();
        let ins: Vec<u64> = trace.events.iter().filter_map(|e| e.flow_in).collect();
        if second_enter {
            let lifetime = slices
                .iter()
                .find(|s| s.depth == 0 && !trace.is_thread_track(s.track))
                .unwrap();
            assert_eq!((lifetime.begin_ns, lifetime.end_ns), (90, 400));
            let polls: Vec<_> = slices
                .iter()
                .filter(|s| s.name == "poll")
                .map(|s| (s.begin_ns, s.end_ns))
                .collect();
            assert_eq!(polls, [(100, 110), (300, 310)]);
            assert_eq!(outs.len(), 2);
            assert_eq!(outs, ins, "each poll's flow, both ends");
        } else {
            assert_eq!(slices.len(), 1);
            assert!(outs.is_empty() && ins.is_empty(), "a synchronous span has no flow");
            assert!(trace.async_task_tracks().is_empty());
        }
    }
}

/// A task still open at the end ends then, truncated; but if the rings dropped records after its last poll,
/// its close may have been among them: it then ends at its last poll (never past its real end). Counted as
/// truncated either way.
#[test]
fn an_open_task_whose_close_may_have_been_dropped_ends_at_its_last_poll() {
    for dropped_after in [false, true] {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        register_span_callsite(&mut p);
        let serial = crate::recorder::span_serial(1, 1);
        chunk(
            &mut p,
            1,
            vec![
                codec::span_new_bare(90, SPAN),
                Record::timed(Kind::SpanEnter, 100, serial),
                Record::timed(Kind::SpanExit, 110, serial),
                Record::timed(Kind::SpanEnter, 300, serial),
                Record::timed(Kind::SpanExit, 310, serial),
            ],
        );
        pass(&mut p);
        // Later records on the ring, some of them dropped (say, the task's close).
        chunk_after_drops(
            &mut p,
            1,
            vec![Record::timed(Kind::Instant, 500, KNOWN)],
            if dropped_after { 3 } else { 0 },
        );
        pass(&mut p);
        shutdown(&mut p);
        let trace = memory.snapshot();
        let slices = trace.slices();
        let lifetime = slices
            .iter()
            .find(|s| s.depth == 0 && !trace.is_thread_track(s.track))
            .expect("the task's lifetime");
        assert_eq!(lifetime.field("tickline.truncated"), Some(&FieldValue::Bool(true)));
        let expected_end = if dropped_after { 310 } else { 1_000_000 };
        assert_eq!(
            (lifetime.begin_ns, lifetime.end_ns),
            (90, expected_end),
            "dropped after: {dropped_after}"
        );
        assert_eq!(p.stats.snapshot().truncated_slices, 1, "dropped after: {dropped_after}");
    }
}

/// The same when the drops are on another thread whose ring is processed before the task's: what counts is
/// when a record may have been dropped, not the order the rings are read in.
#[test]
fn an_open_task_ends_at_its_last_poll_when_another_ring_dropped_records_that_may_be_later() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    ring(&mut p, 2);
    let serial = crate::recorder::span_serial(2, 1);
    // Ring 1 (processed first in the pass) dropped records before it was drained at 1 ms: maybe the task's
    // second exit's close, made on that thread after the task's last poll.
    chunk_after_drops(&mut p, 1, vec![Record::timed(Kind::Instant, 50, KNOWN)], 4);
    chunk(
        &mut p,
        2,
        vec![
            codec::span_new_bare(90, SPAN),
            Record::timed(Kind::SpanEnter, 100, serial),
            Record::timed(Kind::SpanExit, 110, serial),
            Record::timed(Kind::SpanEnter, 300, serial),
            Record::timed(Kind::SpanExit, 310, serial),
        ],
    );
    pass(&mut p);
    pass(&mut p);
    shutdown(&mut p);
    let trace = memory.snapshot();
    let slices = trace.slices();
    let lifetime = slices
        .iter()
        .find(|s| s.depth == 0 && !trace.is_thread_track(s.track))
        .expect("the task's lifetime");
    assert_eq!((lifetime.begin_ns, lifetime.end_ns), (90, 310));
    assert_eq!(lifetime.field("tickline.truncated"), Some(&FieldValue::Bool(true)));
}

#[test]
fn an_end_out_of_stack_order_keeps_every_track_nested() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let (a, b) = (crate::recorder::span_serial(1, 1), crate::recorder::span_serial(1, 2));
    chunk(
        &mut p,
        1,
        vec![
            codec::span_new_bare(0, SPAN),
            codec::span_new_bare(0, SPAN),
            Record::timed(Kind::SpanEnter, 100, a),
            Record::timed(Kind::SpanEnter, 110, b),
            Record::timed(Kind::SpanExit, 120, a),
            Record::timed(Kind::SpanExit, 130, b),
            Record::timed(Kind::SpanExit, 140, b),
            Record::timed(Kind::SpanClose, 150, a),
            Record::timed(Kind::SpanClose, 151, b),
        ],
    );
    pass(&mut p);
    pass(&mut p);
    let slices = memory.snapshot().slices();
    // a [100, 120] holding b's first part; b again [120, 130]; the stray exit is counted.
    let spans: Vec<(u64, u64, usize)> = slices.iter().map(|s| (s.begin_ns, s.end_ns, s.depth)).collect();
    assert_eq!(spans, [(110, 120, 1), (100, 120, 0), (120, 130, 0)]);
    assert_eq!(p.stats.unmatched_ends.load(Ordering::Relaxed), 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 8 } else { 512 }))]

    /// Corrupt and torn input never panics, and nothing is named after a callsite nobody registered. A corrupt
    /// capture may also name any ring, registered or not, and register one twice.
    #[test]
    fn corrupt_records_never_panic_nor_name_an_unregistered_callsite(
        records in prop::collection::vec(arbitrary_record(), 0..96),
        valid in prop::collection::vec(0u64..1_000, 0..8),
        rings in prop::collection::vec((prop_oneof![Just(1u32), Just(u32::MAX), any::<u32>()], 0u8..3), 0..6),
    ) {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        let mut all = records;
        // Some well-formed groups in between, naming the known callsite.
        let mut group = Vec::new();
        for v in valid {
            codec::encode_event(&mut group, v, KNOWN, codec::Parent::Contextual, &[0, codec::TAG_U64, 1, 0, 0, 0, 0, 0, 0, 0]);
            all.extend_from_slice(&group);
        }
        for &(ring_number, what) in &rings {
            match what {
                0 => ring(&mut p, ring_number),
                1 => p.input(Input::ThreadEnd { ring: ring_number }),
                _ => chunk(&mut p, ring_number, all.clone()),
            }
        }
        p.input(Input::Chunk(Chunk { ring: 1, now_ticks: 2_000_000, dropped_total: 0, dropped_slices_total: 0, records: all }));
        p.input(Input::PassEnd { drain_ns: 2_000_000, drain_ticks: 2_000_000, buffered_bytes: 0, rings_drained: true });
        let (tx, rx) = crossbeam_channel::bounded(1);
        p.input(Input::Shutdown(tx));
        prop_assert!(rx.recv().unwrap().is_ok());
        let allowed = ["known", "unknown span", "unknown callsite", "tickline: records dropped", "value"];
        for e in memory.snapshot().events {
            prop_assert!(allowed.contains(&e.name.as_str()), "{:?}", e.name);
        }
    }
}

/// A fieldless span callsite: the kind whose leaf spans take the fast path.
const LEAF: u64 = 0x3000;

fn register_leaf_callsite(p: &mut Processor) {
    p.input(Input::Callsite(CallsiteDef {
        key: LEAF,
        kind: CallsiteKind::Span,
        name: "leaf".into(),
        target: String::new(),
        level: 3,
        file: String::new(),
        line: 0,
        fields: Vec::new(),
    }));
}

/// One thing a thread records, for [`leaf_spans_make_the_same_trace_as_their_records_one_by_one`]. Span
/// references pick among the spans a ring has created so far (or its first, not yet created).
#[derive(Clone, Debug)]
enum RingOp {
    /// Creation, enter, exit and close right after: a leaf span, on callsite `callsite % 3` (fieldless, with a
    /// field, unknown).
    Leaf {
        callsite: u8,
        timed: bool,
        values_final: bool,
    },
    /// A leaf span with a value for its field (`info_span!("span", x = v)` entered and dropped): a creation
    /// group, enter, exit and close right after, on callsite `callsite % 3` (fieldless, with a field, unknown).
    LeafWithValue {
        callsite: u8,
        value: u64,
        timed: bool,
        values_final: bool,
    },
    /// A bare creation only.
    New {
        callsite: u8,
        timed: bool,
    },
    /// A creation with a value for the span's field.
    NewWithValue(u64),
    Enter {
        ring: u8,
        span: u16,
    },
    Exit {
        ring: u8,
        span: u16,
    },
    Close {
        ring: u8,
        span: u16,
        at_last_exit: bool,
        values_final: bool,
        may_be_task: bool,
    },
    /// `span.record("x", value)`.
    Record {
        ring: u8,
        span: u16,
        value: u64,
    },
    Event(u64),
    ScopeBegin,
    ScopeEnd,
    /// Time going backwards (a clamp).
    Backwards,
}

fn ring_op() -> impl Strategy<Value = RingOp> {
    prop_oneof![
        6 => (0u8..3, any::<bool>(), any::<bool>())
            .prop_map(|(callsite, timed, values_final)| RingOp::Leaf { callsite, timed, values_final }),
        4 => (0u8..3, any::<u64>(), any::<bool>(), any::<bool>()).prop_map(|(callsite, value, timed, values_final)| {
            RingOp::LeafWithValue { callsite, value, timed, values_final }
        }),
        2 => (0u8..3, any::<bool>()).prop_map(|(callsite, timed)| RingOp::New { callsite, timed }),
        1 => any::<u64>().prop_map(RingOp::NewWithValue),
        2 => (1u8..3, any::<u16>()).prop_map(|(ring, span)| RingOp::Enter { ring, span }),
        2 => (1u8..3, any::<u16>()).prop_map(|(ring, span)| RingOp::Exit { ring, span }),
        2 => (1u8..3, any::<u16>(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(ring, span, at_last_exit, values_final, may_be_task)| RingOp::Close {
                ring,
                span,
                at_last_exit,
                values_final,
                may_be_task
            }
        ),
        1 => (1u8..3, any::<u16>(), any::<u64>()).prop_map(|(ring, span, value)| RingOp::Record { ring, span, value }),
        1 => any::<u64>().prop_map(RingOp::Event),
        1 => Just(RingOp::ScopeBegin),
        1 => Just(RingOp::ScopeEnd),
        1 => Just(RingOp::Backwards),
    ]
}

fn final_bit(values_final: bool) -> u64 {
    if values_final {
        codec::VALUES_FINAL
    } else {
        0
    }
}

/// Builds the records of `ops` on ring `ring`; `created[r]` counts the spans ring `r` has created so far.
fn ring_records(ring: u32, ops: &[RingOp], created: &mut [u64; 3], ticks: &mut u64) -> Vec<Record> {
    let mut out = Vec::new();
    // A group's records: the `encode_*` functions write a group over what their vector held.
    let mut scratch = Vec::new();
    let callsite = |c: u8| [LEAF, SPAN, 0x9999][c as usize % 3];
    let serial = |created: &[u64; 3], r: u8, k: u16| {
        crate::recorder::span_serial(u64::from(r), 1 + u64::from(k) % created[r as usize].max(1))
    };
    for op in ops {
        *ticks += 10;
        let t = *ticks;
        match *op {
            RingOp::Leaf {
                callsite: c,
                timed,
                values_final,
            } => {
                created[ring as usize] += 1;
                let s = crate::recorder::span_serial(u64::from(ring), created[ring as usize]);
                out.push(codec::span_new_bare(if timed { t } else { 0 }, callsite(c)));
                out.push(Record::timed(Kind::SpanEnter, t + 1, s));
                out.push(Record::timed(Kind::SpanExit, t + 5, s));
                out.push(Record::head(
                    Kind::SpanClose,
                    codec::AT_LAST_EXIT | final_bit(values_final),
                    0,
                    s,
                ));
                *ticks += 5;
            }
            RingOp::LeafWithValue {
                callsite: c,
                value,
                timed,
                values_final,
            } => {
                created[ring as usize] += 1;
                let s = crate::recorder::span_serial(u64::from(ring), created[ring as usize]);
                let created_ticks = if timed { t } else { 0 };
                codec::encode_span_new(
                    &mut scratch,
                    created_ticks,
                    callsite(c),
                    codec::Parent::Contextual,
                    &u64_field(value),
                );
                out.extend_from_slice(&scratch);
                out.push(Record::timed(Kind::SpanEnter, t + 1, s));
                out.push(Record::timed(Kind::SpanExit, t + 5, s));
                out.push(Record::head(
                    Kind::SpanClose,
                    codec::AT_LAST_EXIT | final_bit(values_final),
                    0,
                    s,
                ));
                *ticks += 5;
            }
            RingOp::New { callsite: c, timed } => {
                created[ring as usize] += 1;
                out.push(codec::span_new_bare(if timed { t } else { 0 }, callsite(c)));
            }
            RingOp::NewWithValue(v) => {
                created[ring as usize] += 1;
                codec::encode_span_new(&mut scratch, t, SPAN, codec::Parent::Contextual, &u64_field(v));
                out.extend_from_slice(&scratch);
            }
            RingOp::Enter { ring: r, span } => out.push(Record::timed(Kind::SpanEnter, t, serial(created, r, span))),
            RingOp::Exit { ring: r, span } => out.push(Record::timed(Kind::SpanExit, t, serial(created, r, span))),
            RingOp::Close {
                ring: r,
                span,
                at_last_exit,
                values_final,
                may_be_task,
            } => {
                let flags = final_bit(values_final) | if may_be_task { codec::MAY_BE_TASK } else { 0 };
                out.push(if at_last_exit {
                    Record::head(
                        Kind::SpanClose,
                        codec::AT_LAST_EXIT | flags,
                        0,
                        serial(created, r, span),
                    )
                } else {
                    Record::head(Kind::SpanClose, flags, t, serial(created, r, span))
                })
            }
            RingOp::Record { ring: r, span, value } => {
                codec::encode_span_record(&mut scratch, t, serial(created, r, span), &u64_field(value));
                out.extend_from_slice(&scratch);
            }
            RingOp::Event(v) => {
                codec::encode_event(&mut scratch, t, KNOWN, codec::Parent::Contextual, &u64_field(v));
                out.extend_from_slice(&scratch);
            }
            RingOp::ScopeBegin => out.push(Record::timed(Kind::ScopeBegin, t, KNOWN)),
            RingOp::ScopeEnd => out.push(Record::timed(Kind::ScopeEnd, t, KNOWN)),
            RingOp::Backwards => out.push(Record::timed(Kind::ScopeBegin, t.saturating_sub(500), KNOWN)),
        }
    }
    out
}

/// The trace, counts and task figures a processor makes of `steps` (each: a ring, its ops, a pass after?).
fn process_steps(
    steps: &[(u8, Vec<RingOp>, bool)],
    mode: AsyncTasks,
    leaf_spans: bool,
    batch_events: usize,
) -> (MemoryTrace, Counts, u64, u64) {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    p.set_async_tasks(mode);
    p.leaf_spans = leaf_spans;
    p.export_mid_pass_events = batch_events;
    register_span_callsite(&mut p);
    register_leaf_callsite(&mut p);
    ring(&mut p, 2);
    let mut created = [0u64; 3];
    let mut ticks = [0u64, 1_000, 1_000];
    for (r, ops, pass_after) in steps {
        let r = u32::from(*r);
        let records = ring_records(r, ops, &mut created, &mut ticks[r as usize]);
        p.input(Input::Chunk(Chunk {
            ring: r,
            now_ticks: 1 << 40,
            dropped_total: 0,
            dropped_slices_total: 0,
            records,
        }));
        if *pass_after {
            pass(&mut p);
        }
    }
    shutdown(&mut p);
    (memory.snapshot(), p.counts, p.tasks_written, p.polls_written)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 768 }))]

    /// The leaf-span fast path changes nothing but speed: two rings whose spans refer to each other, leaf spans
    /// among every other kind of record, chunks cut anywhere (a leaf span's records split over two chunks),
    /// passes anywhere, every async-task mode: the same events, fields, flows, tracks, counts and tasks with the
    /// fast path as without it.
    #[test]
    fn leaf_spans_make_the_same_trace_as_their_records_one_by_one(
        steps in prop::collection::vec(
            (1u8..3, prop::collection::vec(ring_op(), 0..12), any::<bool>()),
            1..12,
        ),
        mode in prop_oneof![Just(AsyncTasks::Auto), Just(AsyncTasks::Never), Just(AsyncTasks::Always)],
    ) {
        let fast = process_steps(&steps, mode, true, usize::MAX);
        let general = process_steps(&steps, mode, false, usize::MAX);
        prop_assert_eq!(fast, general);
    }

    /// A pass handed to the exporters in pieces (live, every [`EXPORT_MID_PASS_EVENTS`] events) makes the same
    /// trace as one handed over whole: here a piece after every event where one may go, among async tasks
    /// whose polls' ends are taken back from the batch, slices held for their values, both rings.
    #[test]
    fn a_pass_exported_in_pieces_makes_the_same_trace_as_in_one_batch(
        steps in prop::collection::vec(
            (1u8..3, prop::collection::vec(ring_op(), 0..12), any::<bool>()),
            1..12,
        ),
        mode in prop_oneof![Just(AsyncTasks::Auto), Just(AsyncTasks::Never), Just(AsyncTasks::Always)],
        leaf_spans in any::<bool>(),
    ) {
        let mut pieces = process_steps(&steps, mode, leaf_spans, 1);
        let whole = process_steps(&steps, mode, leaf_spans, usize::MAX);
        prop_assert!(pieces.0.batches >= whole.0.batches);
        pieces.0.batches = whole.0.batches;
        prop_assert_eq!(pieces, whole);
    }
}

#[test]
fn leaf_spans_take_the_fast_path_and_come_out_whole() {
    // Guards the property above against a fast path that never runs: every span of a ring of leaf spans, timed
    // and untimed, goes through `leaf_span`.
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_leaf_callsite(&mut p);
    let ops: Vec<RingOp> = (0..100)
        .map(|k| RingOp::Leaf {
            callsite: 0,
            timed: k % 2 == 0,
            values_final: k % 3 == 0,
        })
        .collect();
    let records = ring_records(1, &ops, &mut [0; 3], &mut 0);
    let leaves = records
        .chunks(LeafSpan::RECORDS)
        .filter(|r| LeafSpan::at(r).is_some())
        .count();
    assert_eq!(leaves, 100);
    chunk(&mut p, 1, records);
    pass(&mut p);
    pass(&mut p);
    assert_eq!(p.leaf_spans_taken, 100);
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 100);
    assert_leaf_slices_at_their_times(&slices);
}

#[test]
fn a_poll_end_whose_flow_is_still_undecided_is_not_handed_over_before_it_is_decided() {
    // A span exited with another record after it (not its close): the end of its poll carries a flow in case it
    // is a task, taken back by position in the batch when the next record decides. A batch handed over between
    // the two would take the flow out with it (and the next event's place would be the wrong one).
    let close = |values_final| RingOp::Close {
        ring: 1,
        span: 0,
        at_last_exit: false,
        values_final,
        may_be_task: false,
    };
    let leaf = RingOp::Leaf {
        callsite: 0,
        timed: true,
        values_final: true,
    };
    for values_final in [false, true] {
        let ops = vec![
            RingOp::New {
                callsite: 0,
                timed: true,
            },
            RingOp::Enter { ring: 1, span: 0 },
            RingOp::Exit { ring: 1, span: 0 },
            leaf.clone(),
            RingOp::Event(7),
            close(values_final),
            leaf.clone(),
        ];
        let steps = [(1, ops, true)];
        let mut pieces = process_steps(&steps, AsyncTasks::Auto, true, 1);
        let whole = process_steps(&steps, AsyncTasks::Auto, true, usize::MAX);
        assert!(pieces.0.batches > whole.0.batches);
        pieces.0.batches = whole.0.batches;
        assert_eq!(pieces, whole);
    }
}

#[test]
fn a_leaf_span_recorded_before_its_tracks_last_time_is_clamped_and_counted_on_either_path() {
    // The fast path converts a leaf span's times together: each must still be kept at or after the track's last
    // time, and each clamp counted, as the general path does one record at a time.
    let run = |leaf_spans: bool| {
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        p.leaf_spans = leaf_spans;
        register_leaf_callsite(&mut p);
        let leaf = RingOp::Leaf {
            callsite: 0,
            timed: true,
            values_final: true,
        };
        let mut created = [0; 3];
        let mut records = ring_records(1, std::slice::from_ref(&leaf), &mut created, &mut 1_000);
        // The clock stepped back: the next two spans' times lie before the first's end.
        records.extend(ring_records(1, &[leaf.clone(), leaf], &mut created, &mut 990));
        chunk(&mut p, 1, records);
        pass(&mut p);
        pass(&mut p);
        (memory.snapshot().slices(), p.counts, p.leaf_spans_taken)
    };
    let (fast, fast_counts, taken) = run(true);
    let (general, general_counts, _) = run(false);
    assert_eq!(taken, 3, "every span took the fast path");
    assert_eq!(fast, general);
    assert_eq!(fast_counts, general_counts);
    assert!(fast_counts.monotonic_clamps >= 3, "{fast_counts:?}");
    assert!(fast.windows(2).all(|w| w[0].end_ns <= w[1].begin_ns), "{fast:?}");
}

#[test]
fn a_busy_pass_goes_to_the_exporters_in_pieces() {
    // The property above means something only if pieces are made: 100 leaf spans, 200 events, in one chunk and
    // one pass, handed over every 10 events.
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    p.export_mid_pass_events = 10;
    register_leaf_callsite(&mut p);
    let ops: Vec<RingOp> = (0..100)
        .map(|_| RingOp::Leaf {
            callsite: 0,
            timed: true,
            values_final: true,
        })
        .collect();
    let batches_before = memory.snapshot().batches;
    chunk(&mut p, 1, ring_records(1, &ops, &mut [0; 3], &mut 0));
    pass(&mut p);
    assert!(
        memory.snapshot().batches - batches_before >= 20,
        "handed over in pieces of 10 events and the pass's end"
    );
    let slices = memory.snapshot().slices();
    assert_eq!(slices.len(), 100);
    assert_leaf_slices_at_their_times(&slices);
}

/// Slice `k` of a ring of `RingOp::Leaf` spans (15 ticks each, entered at +1, exited at +5) is named "leaf" and
/// lies where its records put it.
fn assert_leaf_slices_at_their_times(slices: &[crate::export::RecordedSlice]) {
    for (k, slice) in slices.iter().enumerate() {
        assert_eq!(slice.name, "leaf");
        assert_eq!(
            (slice.begin_ns, slice.end_ns),
            (15 * k as u64 + 11, 15 * k as u64 + 15),
            "{slice:?}"
        );
    }
}

#[test]
fn a_chunk_that_ends_on_an_exit_does_not_keep_the_next_chunks_leaf_spans_off_their_fast_path() {
    // Live, a drain pass cuts a ring's records anywhere: a quarter of the chunks end right after an exit, whose
    // span's close comes first in the next chunk. That poll's end waits, undecided, in the track's held queue;
    // once the close decides it, it must go out at once, or everything after it on the track waits behind it
    // until the pass's end (the whole next chunk through the general path, each event through the queue).
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_leaf_callsite(&mut p);
    let ops: Vec<RingOp> = (0..101)
        .map(|_| RingOp::Leaf {
            callsite: 0,
            timed: true,
            values_final: true,
        })
        .collect();
    let mut records = ring_records(1, &ops, &mut [0; 3], &mut 0);
    let rest = records.split_off(3);
    assert_eq!(rest[0].kind(), Some(Kind::SpanClose));
    chunk(&mut p, 1, records);
    pass(&mut p);
    chunk(&mut p, 1, rest);
    pass(&mut p);
    pass(&mut p);
    assert_eq!(p.leaf_spans_taken, 100, "the 100 spans after the cut one");
    let trace = memory.snapshot();
    let slices = trace.slices();
    assert_eq!(slices.len(), 101);
    assert_leaf_slices_at_their_times(&slices);
    for slice in &slices {
        // Closed right after its only poll: synchronous, no flow (the cut one's speculative flow taken back).
        assert_eq!(slice.flow_out, None, "{slice:?}");
    }
}

#[test]
fn leaf_spans_with_fields_take_their_fast_path_and_keep_their_values() {
    // Guards the differential property above against a fast path for spans with fields that never runs: a
    // ring of such spans, timed and untimed, each with its value, some final; every one taken, every slice
    // with its value (its begin out at once when final and nothing is held before it, else held) and no flow.
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    let ops: Vec<RingOp> = (0..100)
        .map(|k| RingOp::LeafWithValue {
            callsite: 1,
            value: 1000 + k,
            timed: k % 2 == 0,
            values_final: k % 4 != 1,
        })
        .collect();
    let records = ring_records(1, &ops, &mut [0; 3], &mut 0);
    chunk(&mut p, 1, records);
    pass(&mut p);
    pass(&mut p);
    assert_eq!(p.leaf_spans_with_fields_taken, 100);
    let trace = memory.snapshot();
    let slices = trace.slices();
    assert_eq!(slices.len(), 100);
    for (k, slice) in slices.iter().enumerate() {
        assert_eq!(
            (slice.begin_ns, slice.end_ns),
            (15 * k as u64 + 11, 15 * k as u64 + 15),
            "{slice:?}"
        );
        assert_eq!(slice.flow_out, None, "{slice:?}");
    }
    let values: Vec<Option<FieldValue>> = trace
        .events
        .iter()
        .filter(|e| e.kind == EventKind::SliceBegin)
        .map(|e| e.fields.iter().find(|(n, _)| n == "x").map(|(_, v)| v.clone()))
        .collect();
    let expected: Vec<Option<FieldValue>> = (0..100).map(|k| Some(FieldValue::U64(1000 + k))).collect();
    assert_eq!(values, expected);
}

/// A task's polls run on any thread, so records dropped on any thread while it lived may have been its own:
/// its lifetime carries `tickline.dropped_inside` with their count; a task that ended before the loss does not.
#[test]
fn a_task_lifetime_is_marked_with_the_records_dropped_on_any_thread_while_it_lived() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    register_span_callsite(&mut p);
    ring(&mut p, 2);
    let (early, late) = (crate::recorder::span_serial(2, 1), crate::recorder::span_serial(2, 2));
    chunk(&mut p, 1, vec![Record::timed(Kind::Instant, 600, KNOWN)]);
    chunk(
        &mut p,
        2,
        vec![
            codec::span_new_bare(90, SPAN),
            Record::timed(Kind::SpanEnter, 100, early),
            Record::timed(Kind::SpanExit, 110, early),
            Record::timed(Kind::SpanEnter, 300, early),
            Record::timed(Kind::SpanExit, 310, early),
            Record::timed(Kind::SpanClose, 320, early),
            codec::span_new_bare(1_000, SPAN),
            Record::timed(Kind::SpanEnter, 1_100, late),
            Record::timed(Kind::SpanExit, 1_110, late),
            Record::timed(Kind::SpanEnter, 1_300, late),
            Record::timed(Kind::SpanExit, 1_310, late),
            Record::timed(Kind::SpanClose, 1_400, late),
        ],
    );
    pass(&mut p);
    // Ring 1 dropped 5 records after its record at 600 and before it was drained at 2,100.
    chunk_drained_at(&mut p, 1, vec![Record::timed(Kind::Instant, 2_000, KNOWN)], 5, 2_100);
    for _ in 0..4 {
        pass(&mut p);
    }
    shutdown(&mut p);
    let trace = memory.snapshot();
    let lifetimes: Vec<_> = trace
        .slices()
        .into_iter()
        .filter(|s| s.depth == 0 && !trace.is_thread_track(s.track))
        .collect();
    assert_eq!(lifetimes.len(), 2, "{lifetimes:?}");
    let mark = |begin: u64| {
        let lifetime = lifetimes
            .iter()
            .find(|s| s.begin_ns == begin)
            .expect("the task's lifetime");
        assert_eq!(lifetime.field("tickline.truncated"), None, "it closed");
        lifetime.field("tickline.dropped_inside").cloned()
    };
    assert_eq!(mark(90), None, "it ended before the loss");
    assert_eq!(mark(1_000), Some(FieldValue::U64(5)));
}

/// Ring numbers come from the input, which a corrupt capture may fill with any value: the largest is a ring
/// like any other, and sizes nothing (a thread frame naming ring 2^32 - 1 made the processor reserve
/// hundreds of GB and abort).
#[test]
fn any_ring_number_is_a_ring_like_any_other() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    for ring_number in [u32::MAX, 0x0800_0006] {
        ring(&mut p, ring_number);
        chunk(
            &mut p,
            ring_number,
            vec![
                Record::timed(Kind::ScopeBegin, 100, KNOWN),
                Record::timed(Kind::ScopeEnd, 200, KNOWN),
            ],
        );
        p.input(Input::ThreadEnd { ring: ring_number });
    }
    pass(&mut p);
    pass(&mut p);
    shutdown(&mut p);
    let trace = memory.snapshot();
    assert_eq!(trace.slices().len(), 2, "{:?}", trace.events);
    assert_eq!(p.stats.snapshot().framing_errors, 0);
}

/// A span entered on two threads at once is a task, whatever order its rings are processed in: its close
/// (after both polls, on a third thread or right after one poll's exit on its own) may be processed before
/// the other thread's enter. A close saying the span was entered more than once (`MAY_BE_TASK`) leaves the
/// first poll undecided until no ring can still hold an enter from before it; each poll keeps its flow. A
/// close saying it was entered once decides at once: no task, no flow.
#[test]
fn a_span_entered_on_two_threads_at_once_is_a_task_whichever_ring_is_processed_first() {
    // (close on the main ring or right after the first thread's exit, second thread's polls a pass later,
    // the close's flag)
    for (close_on_main, later_pass, may_be_task) in [
        (true, false, true),
        (true, true, true),
        (false, false, true),
        (false, true, true),
        (true, false, false),
    ] {
        let case = format!("close on main {close_on_main}, later pass {later_pass}, flag {may_be_task}");
        let memory = MemoryExporter::default();
        let mut p = processor(&memory);
        register_span_callsite(&mut p);
        for r in 1..=3 {
            ring(&mut p, r);
        }
        let serial = crate::recorder::span_serial(1, 1);
        // Values final: no slice waits a pass for values, so only the decision holds the first poll.
        let flag = if may_be_task { codec::MAY_BE_TASK } else { 0 } | codec::VALUES_FINAL;
        let close = Record::head(Kind::SpanClose, flag, 600, serial);
        let mut main = vec![codec::span_new_bare(90, SPAN)];
        let mut first = vec![
            Record::timed(Kind::SpanEnter, 100, serial),
            Record::timed(Kind::SpanExit, 500, serial),
        ];
        if close_on_main {
            main.push(close);
        } else {
            first.push(close);
        }
        chunk(&mut p, 1, main);
        chunk(&mut p, 2, first);
        let second = if may_be_task {
            vec![
                Record::timed(Kind::SpanEnter, 200, serial),
                Record::timed(Kind::SpanExit, 300, serial),
            ]
        } else {
            Vec::new()
        };
        if later_pass {
            pass(&mut p);
        }
        chunk(&mut p, 3, second);
        for _ in 0..8 {
            pass(&mut p);
        }
        shutdown(&mut p);
        let trace = memory.snapshot();
        let slices = trace.slices();
        let outs: Vec<u64> = trace.events.iter().filter_map(|e| e.flow_out).collect();
        let mut ins: Vec<u64> = trace.events.iter().filter_map(|e| e.flow_in).collect();
        if may_be_task {
            let polls: Vec<_> = slices
                .iter()
                .filter(|s| s.name == "poll")
                .map(|s| (s.begin_ns, s.end_ns, s.flow_in.is_some()))
                .collect();
            assert_eq!(polls, [(100, 500, true), (200, 300, true)], "{case}");
            let mut sorted_outs = outs.clone();
            sorted_outs.sort_unstable();
            ins.sort_unstable();
            assert_eq!(
                (sorted_outs.len(), &sorted_outs),
                (2, &ins),
                "{case}: each poll's flow, both ends"
            );
        } else {
            assert_eq!(slices.len(), 1, "{case}");
            assert!(
                outs.is_empty() && ins.is_empty(),
                "{case}: a synchronous span has no flow"
            );
            assert!(trace.async_task_tracks().is_empty(), "{case}");
        }
    }
}

/// An idle program's trace does not grow by a counter value per pass: the buffered-records counter is written
/// when its value changes (a counter holds its value until the next), not on each of a thousand passes a
/// second.
#[test]
fn idle_passes_add_nothing_to_the_trace() {
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    let pass_with = |p: &mut Processor, ns: u64, bytes: u64| {
        p.input(Input::PassEnd {
            drain_ns: ns,
            drain_ticks: ns,
            buffered_bytes: bytes,
            rings_drained: true,
        })
    };
    pass_with(&mut p, 1_000, 0);
    let counters = |m: &MemoryExporter| {
        m.snapshot()
            .events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Counter(_)))
            .count()
    };
    let before = counters(&memory);
    for k in 0..1_000 {
        pass_with(&mut p, 2_000 + k * 1_000_000, 0);
    }
    assert_eq!(counters(&memory), before, "1,000 idle passes wrote counter values");
    pass_with(&mut p, 2_000_000_000, 4096);
    pass_with(&mut p, 2_001_000_000, 4096);
    pass_with(&mut p, 2_002_000_000, 0);
    // (What a pass writes goes out with the passes after it.)
    pass_with(&mut p, 3_000_000_000, 0);
    pass_with(&mut p, 4_000_000_000, 0);
    assert_eq!(counters(&memory), before + 2, "a change is written, once");
}

#[test]
fn a_finished_rings_slot_is_reused_and_its_number_forgotten() {
    // A program that starts and ends threads for hours must not keep a slot per thread it ever had.
    let memory = MemoryExporter::default();
    let mut p = processor(&memory);
    p.input(Input::ThreadEnd { ring: 1 });
    pass(&mut p);
    pass(&mut p);
    for n in 2..1_002u32 {
        ring(&mut p, n);
        chunk(
            &mut p,
            n,
            vec![
                Record::timed(Kind::ScopeBegin, 100 + u64::from(n), KNOWN),
                Record::timed(Kind::ScopeEnd, 200 + u64::from(n), KNOWN),
            ],
        );
        p.input(Input::ThreadEnd { ring: n });
        pass(&mut p);
        pass(&mut p);
        assert!(p.rings.len() <= 2, "{} slots after {n} threads", p.rings.len());
        assert!(
            p.ring_slots.len() <= 2,
            "{} ring numbers kept after {n} threads",
            p.ring_slots.len()
        );
    }
    let trace = memory.snapshot();
    assert_eq!(trace.slice_count("known"), 1_000);
    assert_eq!(p.stats.snapshot().framing_errors, 0);

    // A chunk of a ring that ended (corrupt input) never lands on the thread that took its slot.
    ring(&mut p, 5_000);
    chunk(&mut p, 1_001, vec![Record::timed(Kind::ScopeBegin, 9_000, KNOWN)]);
    chunk(
        &mut p,
        5_000,
        vec![
            Record::timed(Kind::ScopeBegin, 10_000, KNOWN),
            Record::timed(Kind::ScopeEnd, 10_100, KNOWN),
        ],
    );
    pass(&mut p);
    pass(&mut p);
    shutdown(&mut p);
    let trace = memory.snapshot();
    assert_eq!(trace.slice_count("known"), 1_001);
    assert!(
        trace.slices().iter().all(|s| s.begin_ns != 9_000),
        "a finished ring's chunk was processed"
    );
    assert_eq!(p.stats.snapshot().framing_errors, 1);
}
