//! CUPTI capture (feature `cupti`) on a real GPU. Without a CUDA device, or without libcupti, every test prints
//! `SKIP: <reason>` to stderr and returns. Not run on a GPU yet (see `tickline::gpu::cupti`'s limits).

use std::collections::HashMap;
use std::sync::Arc;

use tickline::export::{FieldValue, MemoryExporter, MemoryTrace};
use tickline::gpu::cuda::cudarc::driver::{sys, CudaContext};
use tickline::gpu::cuda::open;
use tickline::gpu::cupti::{CuptiCapture, CuptiOptions};
use tickline::gpu::GpuError;
use tickline::Timeline;
use tracing::info_span;
use tracing_subscriber::layer::SubscriberExt;

use crate::skip::skip;
use crate::slices::{queue_slices, QueueSlice};

/// The slices on the CUPTI device's stream tracks.
fn captured(trace: &MemoryTrace) -> Vec<QueueSlice> {
    queue_slices(trace)
        .unwrap()
        .into_iter()
        .filter(|s| s.device.ends_with("(CUPTI)"))
        .collect()
}

/// Device 0 and a capture on `timeline`, or why not (the caller prints SKIP). Any other CUPTI error fails.
fn capture(test: &str, timeline: &Timeline) -> Option<(Arc<CudaContext>, CuptiCapture)> {
    let ctx = match open(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            skip(test, e.to_string());
            return None;
        }
    };
    match CuptiCapture::start(timeline, &ctx, CuptiOptions::default()) {
        Ok(capture) => Some((ctx, capture)),
        Err(e @ GpuError::NoLoader { .. }) => {
            skip(test, e.to_string());
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

#[test]
fn every_copy_memset_and_graph_launch_is_captured_on_its_stream_with_a_flow_from_its_span() {
    let _one_at_a_time = crate::exclusive();
    let test = "cupti capture";
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let Some((ctx, capture)) = capture(test, &timeline) else {
        return;
    };
    // One capture per process.
    let second = CuptiCapture::start(&timeline, &ctx, CuptiOptions::default()).unwrap_err();
    assert!(matches!(second, GpuError::Invalid { .. }), "{second}");

    // SAFETY: every buffer below is used on the one stream it was made on, and the streams are synchronised
    // before the host reads back: cudarc's cross-stream events are not needed (and recording them into a stream
    // being captured into a graph invalidates the capture: seen on an H200).
    unsafe { ctx.disable_event_tracking() };
    let streams = [ctx.new_stream().unwrap(), ctx.new_stream().unwrap()];
    let host = vec![7u8; 1 << 20];
    const FRAMES: usize = 20;
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for frame in 0..FRAMES {
            for stream in &streams {
                let _frame = info_span!("frame", frame).entered();
                let mut device = stream.clone_htod(&host).unwrap(); // memcpy HtoD
                stream.memset_zeros(&mut device).unwrap(); // memset
                let _ = stream.clone_dtoh(&device).unwrap(); // memcpy DtoH
            }
        }
        // A graph of two memsets, launched three times.
        let stream = &streams[0];
        let mut a = stream.alloc_zeros::<u8>(1 << 16).unwrap();
        let mut b = stream.alloc_zeros::<u8>(1 << 16).unwrap();
        stream.synchronize().unwrap();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        stream.memset_zeros(&mut a).unwrap();
        stream.memset_zeros(&mut b).unwrap();
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a graph");
        let _launch = info_span!("graph").entered();
        for _ in 0..3 {
            graph.launch().unwrap();
            // Let the launch's records come back (CUPTI hands buffers out every 10 ms): the graph's nodes are
            // learned from its first launch, so the later ones show a slice per node.
            stream.synchronize().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    });
    ctx.synchronize().unwrap();
    let stats = capture.stop();
    let timeline_stats = timeline.shutdown().unwrap();
    eprintln!("{test}: {stats:?}; timeline: {timeline_stats:?}");

    // clone_htod/alloc_zeros allocate too (not captured) and alloc_zeros memsets (2 before the graph).
    let launches = (3 * FRAMES * 2 + 2 + 3) as u64;
    assert_eq!(stats.launches, launches, "{stats:?}");
    assert_eq!(stats.dropped_records, 0, "{stats:?}");
    assert_eq!(stats.starved_launches, 0, "{stats:?}");
    assert_eq!(timeline_stats.gpu_lost_scopes, 0, "{timeline_stats:?}");

    let trace = memory.snapshot();
    let slices = captured(&trace);
    let count = |name: &str| slices.iter().filter(|s| s.name == name).count();
    assert_eq!(count("memcpy HtoD"), FRAMES * 2);
    assert_eq!(count("memcpy DtoH"), FRAMES * 2);
    // The graph's first launch is one slice (its nodes not known yet); each later launch is a slice per node.
    assert_eq!(count("graph launch"), 1);
    assert_eq!(count("memset"), FRAMES * 2 + 2 + 2 * 2);
    // Two application streams: two CUPTI stream tracks carry the frames' work.
    let mut tracks: Vec<_> = slices
        .iter()
        .filter(|s| s.name == "memcpy HtoD")
        .map(|s| s.track)
        .collect();
    tracks.sort_unstable_by_key(|t| format!("{t:?}"));
    tracks.dedup();
    assert_eq!(tracks.len(), 2, "one track per stream");
    // Each slice: its correlation id and driver call, a flow from the CPU, and a duration.
    let flow_starts: HashMap<u64, &tickline::export::RecordedEvent> =
        trace.events.iter().filter_map(|e| e.flow_out.map(|f| (f, e))).collect();
    for s in &slices {
        assert!(
            matches!(s.fields.get("correlation_id"), Some(FieldValue::U64(_))),
            "{s:?}"
        );
        assert!(
            matches!(s.fields.get("api"), Some(FieldValue::Str(a)) if a.starts_with("cu")),
            "{s:?}"
        );
        assert!(s.fields.contains_key("uncertainty_ns"), "{s:?}");
        assert!(s.begin <= s.end, "{s:?}");
        let flow = s.flow_in.expect("a flow ends at every captured slice");
        let start = flow_starts.get(&flow).expect("the flow starts on the CPU");
        assert!(start.ts_ns <= s.begin + 1_000_000, "{s:?} before its launch {start:?}");
    }
}
