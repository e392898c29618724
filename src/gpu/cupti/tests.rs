use super::apis::{launch_params, lookup, LaunchParams, Params, APIS};
use super::ffi::RecordKind;
use super::*;

fn record(correlation: u32, start: u64, end: u64) -> Record {
    Record {
        kind: RecordKind::Kernel,
        correlation,
        start,
        end,
        stream: 13,
        graph_node: 0,
        detail: 0,
    }
}

#[test]
fn records_of_one_launch_merge_into_one_span() {
    // A graph launch (id 7): three nodes, delivered out of order.
    let graph = [
        record(7, 5_000, 5_640),
        record(7, 1_000, 4_000),
        record(7, 4_100, 4_800),
    ];
    assert_eq!(
        merge(&graph),
        Merged {
            correlation: 7,
            span: Some((1_000, 5_640)),
            records: 3,
            incomplete: 0
        }
    );
    // A copy CUPTI could not time.
    assert_eq!(
        merge(&[record(9, 0, 0)]),
        Merged {
            correlation: 9,
            span: None,
            records: 1,
            incomplete: 1
        }
    );
    // An untimed node among timed ones is counted; the span comes from the others. An end before its start is
    // not a span.
    let mixed = merge(&[record(4, 10, 20), record(4, 0, 0), record(4, 50, 40)]);
    assert_eq!(mixed.span, Some((10, 20)));
    assert_eq!((mixed.records, mixed.incomplete), (3, 2));
}

#[test]
fn a_probe_records_start_is_placed_in_its_bracket() {
    // The probe was launched at 1,000 and its store seen at 29,000 (reference ns); CUPTI says it ran
    // 27,000..27,900.
    let bracket = CalibrationSample::from_bracket(123, 1_000, 29_000);
    let s = cupti_sample(&bracket, 27_000, 27_900).unwrap();
    assert_eq!(
        (s.source_ticks, s.reference_ns, s.max_deviation_ns),
        (27_000, 15_000, 14_000)
    );
    // The truth (CUPTI's clock is the reference here) lies inside the stated bracket, also when CUPTI's end
    // comes after the bracket closed (the stream retired after the host saw the store).
    assert!(s.reference_ns.abs_diff(27_000) <= s.max_deviation_ns);
    let late_end = cupti_sample(&bracket, 28_500, 29_400).unwrap();
    assert!(late_end.reference_ns.abs_diff(28_500) <= late_end.max_deviation_ns);
    // A duration longer than the bracket: CUPTI and the reference disagree, no sample.
    assert!(cupti_sample(&bracket, 0, 40_000).is_none());
}

#[test]
fn the_api_table_is_sorted_and_knows_the_launches_seen_on_a_device() {
    assert!(APIS.windows(2).all(|w| w[0].cbid < w[1].cbid), "sorted, no duplicates");
    // Callback ids an H200 with CUDA 13.0 reported for these calls (tools/cupti_probe.cu).
    for (cbid, name, kind) in [
        (307, "cuLaunchKernel", ApiKind::Kernel),
        (277, "cuMemcpyHtoDAsync_v2", ApiKind::Memcpy),
        (278, "cuMemcpyDtoH_v2", ApiKind::Memcpy),
        (216, "cuMemsetD8Async", ApiKind::Memset),
        (514, "cuGraphLaunch", ApiKind::Graph),
    ] {
        let api = lookup(cbid).unwrap_or_else(|| panic!("{name}"));
        assert_eq!((api.name, api.kind), (name, kind));
    }
    assert!(lookup(1).is_none(), "cuInit is not work");
    assert!(
        APIS.iter().all(|a| !a.name.contains("HostFunc")),
        "host functions bring no record"
    );
}

/// The GPU side of a capture against the stand-in CUPTI: named `name`, a 32 ns timer, probes from `probe`, no
/// stream capture, the null context the stand-in passes.
fn fake_gpu(name: &str, probe: Prober) -> Gpu {
    Gpu {
        name: name.into(),
        resolution_ns: 32.0,
        probe,
        capturing: |_| false,
        context: 0,
    }
}

/// `cuLaunchKernel_params`: f, gridDim x/y/z, blockDim x/y/z, sharedMemBytes, hStream at 40.
#[repr(C)]
struct LaunchKernel {
    f: usize,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: usize,
    params: usize,
    extra: usize,
}

impl LaunchKernel {
    fn new(grid: [u32; 3], block: [u32; 3], stream: usize) -> Self {
        LaunchKernel {
            f: 1,
            grid,
            block,
            shared: 0,
            stream,
            params: 0,
            extra: 0,
        }
    }
}

#[test]
fn launch_parameters_are_read_where_the_headers_put_them() {
    let p = LaunchKernel::new([256, 2, 1], [128, 1, 1], 0xdead_0000);
    let api = lookup(307).unwrap();
    // SAFETY: `p` has cuLaunchKernel's parameter layout.
    let read = unsafe { launch_params(api, (&p as *const LaunchKernel).cast()) };
    assert_eq!(
        read,
        LaunchParams {
            stream: 0xdead_0000,
            graph: 0,
            grid: Some([256, 2, 1]),
            block: Some([128, 1, 1])
        }
    );
    let _ = (p.f, p.shared, p.params, p.extra, p.grid, p.block, p.stream);

    // cuLaunchKernelEx_params: a CUlaunchConfig pointer (grid, block, sharedMemBytes, hStream at 32).
    #[repr(C)]
    struct Config {
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        stream: usize,
        attrs: usize,
        count: u32,
    }
    let config = Config {
        grid: [4, 4, 4],
        block: [32, 8, 1],
        shared: 0,
        stream: 0xbeef_0000,
        attrs: 0,
        count: 0,
    };
    let ex: [*const Config; 4] = [&config, std::ptr::null(), std::ptr::null(), std::ptr::null()];
    let api = lookup(652).unwrap();
    assert_eq!(api.params, Params::DriverLaunchEx);
    // SAFETY: `ex` has cuLaunchKernelEx's parameter layout, pointing at a live configuration.
    let read = unsafe { launch_params(api, ex.as_ptr().cast()) };
    assert_eq!(
        read,
        LaunchParams {
            stream: 0xbeef_0000,
            graph: 0,
            grid: Some([4, 4, 4]),
            block: Some([32, 8, 1])
        }
    );
    let _ = (config.shared, config.attrs, config.count);

    // cuMemcpyHtoDAsync_v2_params: dstDevice, srcHost, ByteCount, hStream at 24.
    let copy = [0usize, 0, 4096, 0xcafe_0000];
    let api = lookup(277).unwrap();
    assert_eq!(api.params, Params::Stream(24));
    // SAFETY: `copy` has cuMemcpyHtoDAsync_v2's parameter layout.
    assert_eq!(unsafe { launch_params(api, copy.as_ptr().cast()) }.stream, 0xcafe_0000);
    // A synchronous copy has no stream: the default one.
    let api = lookup(278).unwrap();
    // SAFETY: never read (no stream parameter).
    let sync = unsafe { launch_params(api, copy.as_ptr().cast()) };
    assert_eq!(sync, LaunchParams::default());
    // cuGraphLaunch_params: hGraphExec, hStream.
    let graph = [0x6a00usize, 0xA00];
    // SAFETY: `graph` has cuGraphLaunch's parameter layout.
    let read = unsafe { launch_params(lookup(514).unwrap(), graph.as_ptr().cast()) };
    assert_eq!((read.graph, read.stream), (0x6a00, 0xA00));
    // SAFETY: null is allowed.
    let null = unsafe { launch_params(lookup(307).unwrap(), std::ptr::null()) };
    assert_eq!(null, LaunchParams::default());
}

#[test]
fn work_is_named_after_the_kernel_or_the_copy() {
    let api = |cbid| lookup(cbid).unwrap();
    assert_eq!(work_name(api(307), Some("_Z5scalePfjf")), "_Z5scalePfjf");
    assert_eq!(work_name(api(307), None), "kernel");
    assert_eq!(work_name(api(277), None), "memcpy HtoD");
    assert_eq!(work_name(api(278), None), "memcpy DtoH");
    assert_eq!(work_name(api(216), None), "memset");
    assert_eq!(work_name(api(514), None), "graph launch");
    let mut buffer = [0u8; 40];
    assert_eq!(
        dims_text(&mut buffer, Some([4294967295, 65535, 65535])),
        Some("4294967295x65535x65535")
    );
    assert_eq!(dims_text(&mut buffer, None), None);
}

#[test]
fn options_are_checked_before_cupti_is_touched() {
    CuptiOptions::default().validate().unwrap();
    for bad in [
        CuptiOptions {
            timestamp_slots: 3,
            ..CuptiOptions::default()
        },
        CuptiOptions {
            timestamp_slots: 0,
            ..CuptiOptions::default()
        },
        CuptiOptions {
            buffer_bytes: 4,
            ..CuptiOptions::default()
        },
        CuptiOptions {
            flush_period: Duration::ZERO,
            ..CuptiOptions::default()
        },
    ] {
        let e = bad.validate().unwrap_err();
        assert!(
            matches!(e, GpuError::Invalid { .. }) && e.to_string().contains("CuptiOptions"),
            "{e}"
        );
    }
}

mod end_to_end {
    //! The whole capture without a GPU: [`super::super::fake`] stands in for CUPTI and the device, with a
    //! CUPTI clock that is not tickline's (1 ms ahead, running 30 ppm fast: what CUPTI's own interpolation
    //! could do), and every kernel's true times known.

    use std::collections::HashMap;
    use std::ffi::CStr;
    use std::time::{Duration, Instant};

    use super::super::fake;
    use super::super::*;
    use crate::clock::monotonic_ns;
    use crate::export::{EventKind, FieldValue, MemoryExporter, RecordedEvent, TrackKind};
    use crate::Timeline;
    use tracing::info_span;
    use tracing_subscriber::layer::SubscriberExt;

    /// CUPTI's clock against the truth (`CLOCK_MONOTONIC`): ahead by `offset_ns`, running `ppm` fast from
    /// `origin`, and stepping by `step_ns` once the truth passes `origin + step_after_ns` (CUPTI re-anchoring
    /// its map of the GPU timer, say).
    #[derive(Clone, Copy, Debug)]
    struct Clock {
        origin: u64,
        offset_ns: u64,
        ppm: f64,
        step_after_ns: u64,
        step_ns: u64,
    }

    impl Clock {
        fn new(offset_ns: u64, ppm: f64) -> Clock {
            Clock {
                origin: monotonic_ns().0,
                offset_ns,
                ppm,
                step_after_ns: u64::MAX,
                step_ns: 0,
            }
        }
    }

    /// CUPTI's time of a true time.
    fn cupti_clock(clock: Clock, true_ns: u64) -> u64 {
        let since = true_ns - clock.origin;
        let step = if since >= clock.step_after_ns { clock.step_ns } else { 0 };
        true_ns + clock.offset_ns + (since as f64 * clock.ppm * 1e-6) as u64 + step
    }

    fn spin_until(ns: u64) {
        while monotonic_ns().0 < ns {
            std::hint::spin_loop();
        }
    }

    /// A probe launch as the CUDA backend makes one: bracketed by two reads, calling CUPTI back, the kernel
    /// starting 2-27 µs after the launch (lopsided, as on an H200) and seen 0.4 µs after it ends.
    fn prober(origin: Clock) -> Prober {
        Prober::Fake(Box::new(move |samples, budget, out| {
            let started = Instant::now();
            for _ in 0..samples {
                if started.elapsed() >= budget {
                    break;
                }
                let t0 = monotonic_ns().0;
                let id = fake::call(307, Some(c"tickline_stamp"), std::ptr::null());
                let lag = 2_000 + u64::from(id).wrapping_mul(7_919) % 25_000;
                let (begin, end) = (t0 + lag, t0 + lag + 900);
                spin_until(end + 400);
                let t1 = monotonic_ns().0;
                fake::record(
                    ffi::KIND_CONCURRENT_KERNEL,
                    id,
                    cupti_clock(origin, begin),
                    cupti_clock(origin, end),
                    99,
                );
                out.push(CalibrationSample::from_bracket(0, t0, t1));
            }
            Ok(())
        }))
    }

    use super::{fake_gpu, LaunchKernel};

    #[derive(Debug)]
    struct Slice {
        name: String,
        queue: String,
        begin: u64,
        end: u64,
        fields: HashMap<String, FieldValue>,
        flow_in: Option<u64>,
    }

    #[test]
    fn launches_become_slices_on_their_streams_placed_within_their_stated_uncertainty() {
        let _serial = fake::serial();
        let beyond = capture_and_check("1 ms ahead, +30 ppm", Clock::new(1_000_000, 30.0));
        assert_eq!(beyond, 0, "every slice within its stated uncertainty of the truth");
    }

    /// Runs 120 frames of launches through a capture with CUPTI's clock `origin`, checks what comes out, and
    /// returns how many slices lie further from the truth than their stated uncertainty.
    fn capture_and_check(label: &str, origin: Clock) -> usize {
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
        let gpu = fake_gpu("Fake H200 (CUPTI)", prober(origin));
        let capture = CuptiCapture::start_with(&timeline, fake::cupti(), gpu, CuptiOptions::default()).unwrap();
        assert!(fake::timestamp().is_some_and(|t| t.abs_diff(monotonic_ns().0) < 1_000_000_000));
        assert_eq!(fake::enabled().len(), 3, "kernels, copies, memsets");
        // The one subscription is taken.
        let gpu = fake_gpu("again", prober(origin));
        let again = CuptiCapture::start_with(&timeline, fake::cupti(), gpu, CuptiOptions::default());
        assert!(matches!(again, Err(GpuError::Invalid { .. })), "{again:?}");

        // Truth: correlation id -> true begin and end.
        // Truth: (correlation id, graph node or 0) -> true begin and end.
        let mut truth: HashMap<(u32, u64), (u64, u64)> = HashMap::new();
        let kernel: &CStr = c"_Z5scalePfjf";
        const FRAMES: u32 = 120;
        let subscriber = tracing_subscriber::registry().with(timeline.layer());
        let mut lost_memset = 0;
        tracing::subscriber::with_default(subscriber, || {
            for frame in 0..FRAMES {
                let _frame = info_span!("frame", frame).entered();
                let params = LaunchKernel::new([256, 1, 1], [128, 1, 1], 0xA00);
                let id = fake::call(307, Some(kernel), (&params as *const LaunchKernel).cast());
                let t = monotonic_ns().0;
                truth.insert((id, 0), (t + 5_000, t + 25_000));
                let copy = [0usize, 0, 4096, 0xB00];
                let copy_id = fake::call(277, None, copy.as_ptr().cast());
                truth.insert((copy_id, 0), (t + 30_000, t + 41_000));
                spin_until(t + 42_000);
                let (b, e) = truth[&(id, 0)];
                fake::record(
                    ffi::KIND_CONCURRENT_KERNEL,
                    id,
                    cupti_clock(origin, b),
                    cupti_clock(origin, e),
                    13,
                );
                let (b, e) = truth[&(copy_id, 0)];
                fake::record(
                    ffi::KIND_MEMCPY,
                    copy_id,
                    cupti_clock(origin, b),
                    cupti_clock(origin, e),
                    14,
                );
                if frame == 60 || frame == 90 {
                    // A graph of three nodes. Its first launch: one slice spanning them (its nodes are not known
                    // yet); its second: a slice per node, named by its kernel.
                    let graph = [0x6a00usize, 0xA00];
                    let id = fake::call(514, None, graph.as_ptr().cast());
                    let t = monotonic_ns().0;
                    let nodes: [(u64, &'static CStr, u64, u64); 3] = [
                        (7, c"_Z4spiny", t + 1_000, t + 4_000),
                        (8, c"_Z5emptyv", t + 4_100, t + 4_700),
                        (9, c"_Z4spiny", t + 5_000, t + 9_000),
                    ];
                    for (node, name, b, e) in nodes {
                        let times = (cupti_clock(origin, b), cupti_clock(origin, e));
                        fake::node(ffi::KIND_CONCURRENT_KERNEL, id, times, 13, node, Some(name));
                        truth.insert((id, node), (b, e));
                        if frame == 90 && node == 7 {
                            // The second launch's nodes come in two buffers.
                            spin_until(e);
                            fake::flush();
                        }
                    }
                    truth.insert((id, 0), (t + 1_000, t + 9_000));
                    spin_until(t + 10_000);
                }
                if frame == 60 {
                    // A memset CUPTI could not time: lost. A record of work launched before the capture:
                    // unattributed. Five records dropped.
                    let t = monotonic_ns().0;
                    let memset = [0usize, 0, 0, 0xA00];
                    lost_memset = fake::call(216, None, memset.as_ptr().cast());
                    fake::record(ffi::KIND_MEMSET, lost_memset, 0, 0, 13);
                    fake::record(ffi::KIND_MEMSET, 999_999, 5, 6, 13);
                    fake::drop_records(5);
                    spin_until(t + 10_000);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let stats = capture.stop();
        let timeline_stats = timeline.shutdown().unwrap();
        assert_eq!(
            stats,
            CuptiStats {
                launches: 2 * u64::from(FRAMES) + 3,
                records: stats.records,
                unattributed_records: 1,
                incomplete_records: 1,
                dropped_records: 5,
                starved_launches: 0,
                other_context_launches: 0,
            }
        );
        assert!(stats.records >= 2 * u64::from(FRAMES) + 5, "{stats:?}");
        assert_eq!(
            timeline_stats.gpu_lost_scopes, 1,
            "the untimed memset: {timeline_stats:?}"
        );
        assert!(
            timeline_stats.dropped_records >= 5,
            "CUPTI's drops are the timeline's: {timeline_stats:?}"
        );
        assert!(fake::enabled().is_empty(), "stop disables recording");

        let trace = memory.snapshot();
        let device = trace
            .tracks
            .iter()
            .find(|t| matches!(&t.kind, TrackKind::GpuDevice { name, .. } if name == "Fake H200 (CUPTI)"))
            .expect("the CUPTI device's track")
            .id;
        // Slices on the device's queues (and their lanes), with the queue's name.
        let queue_name = |track| {
            let t = trace.track(track)?;
            match &t.kind {
                TrackKind::GpuQueue { name, .. } if t.parent == Some(device) => Some(name.clone()),
                _ => None,
            }
        };
        let mut open: HashMap<_, Vec<Slice>> = HashMap::new();
        let mut slices = Vec::new();
        let mut lost = Vec::new();
        for e in &trace.events {
            let Some(queue) = queue_name(e.track) else { continue };
            match e.kind {
                EventKind::SliceBegin => open.entry(e.track).or_default().push(Slice {
                    name: e.name.clone(),
                    queue,
                    begin: e.ts_ns,
                    end: 0,
                    fields: e.fields.iter().cloned().collect(),
                    flow_in: e.flow_in,
                }),
                EventKind::SliceEnd => {
                    let mut s = open.get_mut(&e.track).and_then(Vec::pop).unwrap();
                    s.end = e.ts_ns;
                    slices.push(s);
                }
                EventKind::Instant => lost.push(e.clone()),
                _ => {}
            }
        }
        let count = |name: &str| slices.iter().filter(|s| s.name == name).count();
        assert_eq!(count("_Z5scalePfjf"), FRAMES as usize);
        assert_eq!(count("memcpy HtoD"), FRAMES as usize);
        assert_eq!(
            count("graph launch"),
            1,
            "the graph's first launch, its nodes not known yet"
        );
        assert_eq!(
            (count("_Z4spiny"), count("_Z5emptyv")),
            (2, 1),
            "its second launch, a slice per node"
        );
        assert_eq!(slices.len(), 2 * FRAMES as usize + 4, "no probe kernel is shown");
        assert!(
            lost.iter()
                .any(|e| e.name == "memset" && e.fields.iter().any(|(k, _)| k == crate::gpu::GPU_SCOPE_LOST)),
            "the untimed memset is shown lost: {lost:?}"
        );
        let flow_starts: HashMap<u64, &RecordedEvent> =
            trace.events.iter().filter_map(|e| e.flow_out.map(|f| (f, e))).collect();
        let (mut errors, mut uncertainties, mut beyond) = (Vec::new(), Vec::new(), 0);
        for s in &slices {
            let want_queue = if s.name == "memcpy HtoD" {
                "stream 2816"
            } else {
                "stream 2560"
            };
            assert!(s.queue.starts_with(want_queue), "{s:?}");
            let Some(&FieldValue::U64(id)) = s.fields.get("correlation_id") else {
                panic!("{s:?} has no correlation id")
            };
            let want_api = match s.name.as_str() {
                "memcpy HtoD" => "cuMemcpyHtoDAsync_v2",
                "graph launch" | "_Z4spiny" | "_Z5emptyv" => "cuGraphLaunch",
                _ => "cuLaunchKernel",
            };
            assert_eq!(s.fields.get("api"), Some(&FieldValue::Str(want_api.into())), "{s:?}");
            if s.name == "_Z5scalePfjf" {
                assert_eq!(s.fields.get("grid"), Some(&FieldValue::Str("256x1x1".into())), "{s:?}");
                assert_eq!(s.fields.get("block"), Some(&FieldValue::Str("128x1x1".into())), "{s:?}");
            }
            let flow = s.flow_in.expect("a flow ends at the slice");
            let from = flow_starts.get(&flow).expect("the flow starts on the launching thread");
            assert!(trace.is_thread_track(from.track), "{from:?}");
            let Some(&FieldValue::U64(uncertainty)) = s.fields.get("uncertainty_ns") else {
                panic!("{s:?} states no uncertainty")
            };
            let node = match s.fields.get("graph_node") {
                Some(&FieldValue::U64(node)) => node,
                _ => 0,
            };
            let (b, e) = truth[&(id as u32, node)];
            let error = s.begin.abs_diff(b).max(s.end.abs_diff(e));
            beyond += usize::from(error > uncertainty);
            errors.push(error);
            uncertainties.push(uncertainty);
        }
        errors.sort_unstable();
        uncertainties.sort_unstable();
        let p = |v: &[u64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        eprintln!(
            "fake CUPTI ({label}): {} slices, error p50/p99/max {}/{}/{} ns, stated uncertainty p50/p99 {}/{} ns, \
             {beyond} beyond it; {stats:?}",
            slices.len(),
            p(&errors, 0.5),
            p(&errors, 0.99),
            errors[errors.len() - 1],
            p(&uncertainties, 0.5),
            p(&uncertainties, 0.99),
        );
        assert!(p(&errors, 0.5) < 20_000, "the 1 ms offset was calibrated out");
        beyond
    }

    #[test]
    fn a_step_of_cuptis_clock_is_seen_and_no_slice_is_placed_beyond_its_uncertainty() {
        let _serial = fake::serial();
        let clock = Clock {
            step_after_ns: 150_000_000,
            step_ns: 40_000,
            ..Clock::new(1_000_000, 30.0)
        };
        let beyond = capture_and_check("1 ms ahead, +30 ppm, +40 µs step at 150 ms", clock);
        // The project's standard for a misbehaving device clock (README, issue 13): at least 95 % of truths
        // inside the stated uncertainty. Here a slice converted before the burst that reveals the step comes
        // can miss by the step (seen: 1 of 244 in some runs).
        assert!(
            beyond * 100 <= 244,
            "{beyond} of 244 slices beyond their stated uncertainty"
        );
    }

    /// A timeline exporting to `memory` whose GPU scopes are lost 100 ms after they were due.
    fn timeline_losing_scopes_after_100_ms(memory: &MemoryExporter) -> Timeline {
        Timeline::builder()
            .exporter(memory.clone())
            .gpu_calibration(crate::gpu::GpuCalibrationConfig {
                lost_after: Duration::from_millis(100),
                ..Default::default()
            })
            .start()
            .unwrap()
    }

    #[test]
    fn a_graph_changed_by_an_update_is_learned_again_and_no_removed_node_is_opened() {
        // A graph launched once (one slice, its nodes 7, 8, 9 not known yet), then updated before that launch's
        // records come (node 8 removed): the late records teach nothing (they are of the old graph), the next
        // launch is one slice again and teaches nodes 7 and 9, and the one after is a slice per node, with no
        // scope opened, and lost, for node 8.
        let _serial = fake::serial();
        let origin = Clock::new(1_000_000, 30.0);
        let memory = MemoryExporter::default();
        let timeline = timeline_losing_scopes_after_100_ms(&memory);
        let gpu = fake_gpu("graphs (CUPTI)", prober(origin));
        let capture = CuptiCapture::start_with(&timeline, fake::cupti(), gpu, CuptiOptions::default()).unwrap();
        let graph = [0x6b00usize, 0xA00];
        let launch = |nodes: &[(u64, &'static CStr)]| {
            let id = fake::call(514, None, graph.as_ptr().cast());
            let t = monotonic_ns().0;
            spin_until(t + 10_000);
            let records: Vec<_> = nodes
                .iter()
                .enumerate()
                .map(|(k, &(node, name))| {
                    let b = t + 1_000 + 2_000 * k as u64;
                    (node, name, cupti_clock(origin, b), cupti_clock(origin, b + 1_500))
                })
                .collect();
            (id, records)
        };
        let deliver = |(id, records): (u32, Vec<(u64, &'static CStr, u64, u64)>)| {
            for (node, name, b, e) in records {
                fake::node(ffi::KIND_CONCURRENT_KERNEL, id, (b, e), 13, node, Some(name));
            }
            fake::flush();
        };
        let before = launch(&[(7, c"_Z4spiny"), (8, c"_Z5emptyv"), (9, c"_Z4spiny")]);
        // cuGraphExecUpdate_v2 (hGraphExec first): node 8 is gone.
        let update = [graph[0], 0, 0];
        fake::call(696, None, update.as_ptr().cast());
        deliver(before);
        std::thread::sleep(Duration::from_millis(50));
        deliver(launch(&[(7, c"_Z4spiny"), (9, c"_Z4spiny")]));
        std::thread::sleep(Duration::from_millis(50));
        deliver(launch(&[(7, c"_Z4spiny"), (9, c"_Z4spiny")]));
        // Past `lost_after`: a scope opened for node 8 would be lost by now.
        std::thread::sleep(Duration::from_millis(400));
        let stats = capture.stop();
        let timeline_stats = timeline.shutdown().unwrap();
        assert_eq!(timeline_stats.gpu_lost_scopes, 0, "{timeline_stats:?}");
        assert_eq!(stats.launches, 3, "{stats:?}");
        let trace = memory.snapshot();
        let begins = |name: &str| {
            trace
                .events
                .iter()
                .filter(|e| e.name == name && matches!(e.kind, EventKind::SliceBegin))
                .count()
        };
        assert_eq!(
            (begins("graph launch"), begins("_Z4spiny"), begins("_Z5emptyv")),
            (2, 2, 0),
            "the launches before and after the update one slice each, the last a slice per node"
        );
    }

    #[test]
    fn a_launch_callback_never_waits_for_a_full_lossless_ring() {
        // The callback runs inside the application's driver call: waiting there for the drain stage (which may
        // itself be calling into CUPTI) could hold the driver, or deadlock. A lossless ring that is full drops
        // the launch's begin and counts it instead.
        let _serial = fake::serial();
        let origin = Clock::new(1_000_000, 30.0);
        let timeline = Timeline::builder()
            .lossless(true)
            .ring_capacity(64)
            .exporter(MemoryExporter::default())
            .start()
            .unwrap();
        let gpu = fake_gpu("lossless (CUPTI)", prober(origin));
        let options = CuptiOptions {
            timestamp_slots: 1024,
            ..CuptiOptions::default()
        };
        let capture = CuptiCapture::start_with(&timeline, fake::cupti(), gpu, options).unwrap();
        timeline.pause_drain(true);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let launcher = std::thread::spawn(move || {
            let copy = [0usize, 0, 64, 0xC00];
            for _ in 0..100 {
                fake::call(277, None, copy.as_ptr().cast());
            }
            let _ = done_tx.send(());
        });
        let returned = done_rx.recv_timeout(Duration::from_secs(10));
        // Let a waiting thread go before failing, so the test ends either way.
        timeline.pause_drain(false);
        launcher.join().unwrap();
        assert!(returned.is_ok(), "a launch waited in its callback for the drain stage");
        let stats = capture.stop();
        let timeline_stats = timeline.shutdown().unwrap();
        assert_eq!(stats.launches, 100, "{stats:?}");
        assert!(
            timeline_stats.dropped_records > 0,
            "the begins that did not fit are counted: {timeline_stats:?}"
        );
    }

    #[test]
    fn a_lost_launchs_pair_serves_again() {
        // A launch whose record never comes (a failed call, a dropped record) is lost after `lost_after`; its
        // pair is recycled (the capture refuses late writes), so a capture with 2 pairs keeps working.
        let _serial = fake::serial();
        let origin = Clock::new(1_000_000, 30.0);
        let memory = MemoryExporter::default();
        let timeline = timeline_losing_scopes_after_100_ms(&memory);
        let gpu = fake_gpu("small (CUPTI)", prober(origin));
        let options = CuptiOptions {
            timestamp_slots: 4,
            ..CuptiOptions::default()
        };
        let capture = CuptiCapture::start_with(&timeline, fake::cupti(), gpu, options).unwrap();
        let subscriber = tracing_subscriber::registry().with(timeline.layer());
        let copy = [0usize, 0, 64, 0xC00];
        let mut late = Vec::new();
        tracing::subscriber::with_default(subscriber, || {
            // Two launches that never bring a record: both pairs held.
            for _ in 0..2 {
                late.push(fake::call(277, None, copy.as_ptr().cast()));
            }
            std::thread::sleep(Duration::from_millis(600));
            // Lost and recycled by now: five more launches, one at a time, each with its record.
            for _ in 0..5 {
                let id = fake::call(277, None, copy.as_ptr().cast());
                let t = monotonic_ns().0;
                spin_until(t + 3_000);
                fake::record(
                    ffi::KIND_MEMCPY,
                    id,
                    cupti_clock(origin, t + 1_000),
                    cupti_clock(origin, t + 2_000),
                    5,
                );
                fake::flush();
                std::thread::sleep(Duration::from_millis(150)); // the collector reads and frees the pair
            }
            // The lost launches' records come after all: refused, counted.
            for &id in &late {
                fake::record(ffi::KIND_MEMCPY, id, 10, 20, 5);
            }
            fake::flush();
        });
        let stats = capture.stop();
        let timeline_stats = timeline.shutdown().unwrap();
        assert_eq!((stats.launches, stats.starved_launches), (7, 0), "{stats:?}");
        assert_eq!(stats.unattributed_records, 2, "the late records: {stats:?}");
        assert_eq!(timeline_stats.gpu_lost_scopes, 2, "{timeline_stats:?}");
        let copies = memory
            .snapshot()
            .events
            .iter()
            .filter(|e| e.name == "memcpy HtoD" && matches!(e.kind, EventKind::SliceBegin))
            .count();
        assert_eq!(copies, 5, "every launch after the lost ones is shown");
    }

    #[test]
    fn launches_past_the_pairs_in_flight_are_counted_starved_and_a_capture_starts_again_after_stop() {
        let _serial = fake::serial();
        let origin = Clock::new(1_000_000, 30.0);
        let memory = MemoryExporter::default();
        let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
        let options = CuptiOptions {
            timestamp_slots: 4,
            ..CuptiOptions::default()
        };
        let gpu = |name: &str| fake_gpu(name, prober(origin));
        let capture =
            CuptiCapture::start_with(&timeline, fake::cupti(), gpu("small (CUPTI)"), options.clone()).unwrap();
        let subscriber = tracing_subscriber::registry().with(timeline.layer());
        let mut launched = Vec::new();
        tracing::subscriber::with_default(subscriber, || {
            let _span = info_span!("burst").entered();
            let copy = [0usize, 0, 64, 0xC00];
            // Ten copies before any record comes back: two pairs, so eight are starved.
            for _ in 0..10 {
                let id = fake::call(277, None, copy.as_ptr().cast());
                launched.push((id, monotonic_ns().0));
            }
            spin_until(monotonic_ns().0 + 20_000);
            for &(id, t) in &launched {
                fake::record(
                    ffi::KIND_MEMCPY,
                    id,
                    cupti_clock(origin, t + 1_000),
                    cupti_clock(origin, t + 2_000),
                    5,
                );
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let stats = capture.stop();
        assert_eq!((stats.launches, stats.starved_launches), (2, 8), "{stats:?}");
        assert_eq!(
            stats.unattributed_records, 8,
            "the starved launches' records match nothing: {stats:?}"
        );
        // CUPTI's one subscription is free again.
        let again = CuptiCapture::start_with(&timeline, fake::cupti(), gpu("again (CUPTI)"), options).unwrap();
        drop(again);
        let timeline_stats = timeline.shutdown().unwrap();
        assert!(
            timeline_stats.dropped_records >= 8,
            "starved launches are dropped records: {timeline_stats:?}"
        );
        assert_eq!(timeline_stats.gpu_lost_scopes, 0, "{timeline_stats:?}");
        let copies = memory
            .snapshot()
            .events
            .iter()
            .filter(|e| e.name == "memcpy HtoD" && matches!(e.kind, EventKind::SliceBegin))
            .count();
        assert_eq!(copies, 2);
    }
}

/// The buffers handed to CUPTI round-trip: sized from their own header, whatever size is passed back, and
/// walked record by record without reading past the valid part. (Run under Miri by `.ci/run`.)
#[test]
fn buffers_handed_to_cupti_are_freed_by_their_own_size() {
    BUFFER_BYTES.store(4 * 216, Ordering::Relaxed);
    let (mut buffer, mut size, mut max) = (std::ptr::null_mut(), 0usize, 7usize);
    // SAFETY: three writable out-parameters, as CUPTI passes them.
    unsafe { buffer_requested(&mut buffer, &mut size, &mut max) };
    assert!(!buffer.is_null() && buffer as usize % 8 == 0);
    assert_eq!((size, max), (4 * 216, 0));
    // SAFETY: `size` bytes at `buffer` are ours until handed back.
    let bytes = unsafe { std::slice::from_raw_parts_mut(buffer, size) };
    bytes.fill(0);
    bytes[..4].copy_from_slice(&ffi::KIND_CONCURRENT_KERNEL.to_le_bytes());
    bytes[92..96].copy_from_slice(&5u32.to_le_bytes());
    assert_eq!(ffi::parse(&bytes[..216]).map(|r| r.correlation), Some(5));
    // A size CUPTI reports wrong, and no capture running: the buffer is still freed whole (Miri checks it).
    // SAFETY: the buffer `buffer_requested` handed out, handed back once.
    unsafe { buffer_completed(std::ptr::null_mut(), 0, buffer, 1, 216) };
    // SAFETY: a null buffer is ignored.
    unsafe { buffer_completed(std::ptr::null_mut(), 0, std::ptr::null_mut(), 0, 0) };
}

/// Found by a review of the capture, each fixed since: these stay as regressions.
mod regressions {
    use std::time::Duration;

    use super::super::fake;
    use super::super::*;
    use super::{fake_gpu, LaunchKernel};
    use crate::Timeline;

    fn gpu() -> Gpu {
        fake_gpu("review (CUPTI)", Prober::Fake(Box::new(|_, _, _| Ok(()))))
    }

    fn graph_nodes(id: u32, base: u64) {
        for (node, name) in [(7u64, c"_Z1a"), (8, c"_Z1b"), (9, c"_Z1c")] {
            let times = (base + node * 10, base + node * 10 + 5);
            fake::node(ffi::KIND_CONCURRENT_KERNEL, id, times, 13, node, Some(name));
        }
    }

    /// Learns a three-node graph from its first launch; a capture of 3 pairs.
    fn capture_knowing_a_graph(timeline: &Timeline) -> CuptiCapture {
        let options = CuptiOptions {
            timestamp_slots: 6,
            ..CuptiOptions::default()
        };
        let capture = CuptiCapture::start_with(timeline, fake::cupti(), gpu(), options).unwrap();
        let graph = [0x6a00usize, 0xA00];
        let first = fake::call(514, None, graph.as_ptr().cast());
        graph_nodes(first, 1_000_000);
        fake::flush();
        std::thread::sleep(Duration::from_millis(300)); // the collector reads the launch's pair and frees it
        assert_eq!(lock(&capture.shared.state).graphs.get(&0x6a00).map(Vec::len), Some(3));
        capture
    }

    #[test]
    fn a_starved_node_scope_leaves_the_graph_known() {
        let _serial = fake::serial();
        let timeline = Timeline::builder().start().unwrap();
        let capture = capture_knowing_a_graph(&timeline);
        // A kernel whose record has not come holds one pair: 2 free for 3 nodes.
        let params = LaunchKernel::new([1, 1, 1], [1, 1, 1], 0xA00);
        let _pending = fake::call(307, Some(c"_Z4slow"), (&params as *const LaunchKernel).cast());
        let graph = [0x6a00usize, 0xA00];
        let second = fake::call(514, None, graph.as_ptr().cast());
        graph_nodes(second, 2_000_000);
        fake::flush();
        let stats = capture.stats();
        assert_eq!(stats.starved_launches, 1, "{stats:?}");
        assert_eq!(
            lock(&capture.shared.state).graphs.get(&0x6a00).map(Vec::len),
            Some(3),
            "the graph did not change: still known"
        );
        drop(capture);
        timeline.shutdown().unwrap();
    }

    #[test]
    fn a_graph_launch_with_every_node_starved_is_not_counted_launched() {
        let _serial = fake::serial();
        let timeline = Timeline::builder().start().unwrap();
        let capture = capture_knowing_a_graph(&timeline);
        let params = LaunchKernel::new([1, 1, 1], [1, 1, 1], 0xA00);
        for _ in 0..3 {
            fake::call(307, Some(c"_Z4slow"), (&params as *const LaunchKernel).cast());
        }
        let before = capture.stats();
        let graph = [0x6a00usize, 0xA00];
        fake::call(514, None, graph.as_ptr().cast());
        let after = capture.stats();
        assert_eq!(after.starved_launches - before.starved_launches, 3, "its 3 node scopes");
        assert_eq!(after.launches, before.launches, "no scope of it was opened");
        drop(capture);
        timeline.shutdown().unwrap();
    }

    #[test]
    fn a_probe_record_that_misses_its_bursts_flush_serves_the_next_burst() {
        let _serial = fake::serial();
        let timeline = Timeline::builder().start().unwrap();
        let gpu = fake_gpu(
            "review (CUPTI)",
            Prober::Fake(Box::new(|samples, _budget, out| {
                for k in 0..samples.min(4) {
                    let t0 = crate::clock::monotonic_ns().0;
                    let id = fake::call(307, Some(c"tickline_stamp"), std::ptr::null());
                    let t1 = crate::clock::monotonic_ns().0 + 2_000;
                    if k == 3 {
                        // The last probe's record completes just after the burst's flush.
                        std::thread::spawn(move || {
                            std::thread::sleep(Duration::from_millis(2));
                            fake::record(ffi::KIND_CONCURRENT_KERNEL, id, t0 + 500, t0 + 1_500, 99);
                        });
                    } else {
                        fake::record(ffi::KIND_CONCURRENT_KERNEL, id, t0 + 500, t0 + 1_500, 99);
                    }
                    out.push(CalibrationSample::from_bracket(0, t0, t1));
                }
                Ok(())
            })),
        );
        let capture = CuptiCapture::start_with(&timeline, fake::cupti(), gpu, CuptiOptions::default()).unwrap();
        std::thread::sleep(Duration::from_millis(1_200));
        let calibration = capture.device().calibration().expect("calibrated");
        let stats = capture.stop();
        assert_eq!(
            stats.unattributed_records, 0,
            "late probe records are the next burst's: {stats:?}"
        );
        assert!(
            calibration.stats.samples_offered >= 4 * calibration.stats.bursts - 4,
            "{calibration:?}"
        );
        timeline.shutdown().unwrap();
    }

    #[test]
    fn each_threads_default_stream_is_a_queue_of_its_own() {
        let _serial = fake::serial();
        let timeline = Timeline::builder().start().unwrap();
        let capture = CuptiCapture::start_with(&timeline, fake::cupti(), gpu(), CuptiOptions::default()).unwrap();
        for _ in 0..2 {
            std::thread::spawn(|| {
                let params = LaunchKernel::new([1, 1, 1], [1, 1, 1], 0); // stream 0 of a _ptsz launch
                fake::call(442, Some(c"_Z1k"), (&params as *const LaunchKernel).cast());
            })
            .join()
            .unwrap();
        }
        let mut tracks: Vec<u16> = lock(&capture.shared.state).queues.values().map(|q| q.index()).collect();
        tracks.sort_unstable();
        tracks.dedup();
        assert_eq!(tracks.len(), 2, "a track per thread's default stream");
        drop(capture);
        timeline.shutdown().unwrap();
    }
}

/// With `TICKLINE_CUPTI_LIBRARY` naming NVIDIA's libcupti (CI fetches it; no GPU needed): a start that fails on
/// this GPU-less machine, on a thread of its own, leaves the library loaded and the thread ends cleanly. (The
/// library used to be unloaded with the capture; CUPTI's thread-exit hook then crashed the thread.)
#[test]
fn a_failed_start_with_the_real_cupti_keeps_the_library_loaded() {
    let Some(path) = std::env::var_os("TICKLINE_CUPTI_LIBRARY").filter(|p| !p.is_empty()) else {
        eprintln!(
            "SKIP: a_failed_start_with_the_real_cupti_keeps_the_library_loaded: TICKLINE_CUPTI_LIBRARY is not set"
        );
        return;
    };
    let _serial = fake::serial();
    let timeline = crate::Timeline::builder().start().unwrap();
    std::thread::scope(|scope| {
        let started = scope.spawn(|| {
            let cupti = ffi::Cupti::open(Some(std::path::Path::new(&path))).unwrap();
            let gpu = fake_gpu("no GPU (CUPTI)", Prober::Fake(Box::new(|_, _, _| Ok(()))));
            match CuptiCapture::start_with(&timeline, cupti, gpu, CuptiOptions::default()) {
                Ok(capture) => format!("started, then stopped: {:?}", capture.stop()),
                Err(e) => format!("refused: {e}"),
            }
        });
        let outcome = started.join().expect("the thread ends cleanly");
        eprintln!("real CUPTI without a GPU: {outcome}");
    });
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    assert!(maps.contains("libcupti"), "libcupti stays loaded");
    timeline.shutdown().unwrap();
}
