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
    }
}

#[test]
fn records_merge_by_correlation_id_into_one_span() {
    // A graph launch (id 7): three nodes, delivered out of order; a lone kernel (id 3); a copy CUPTI could not
    // time (id 9).
    let records = [
        record(7, 5_000, 5_640),
        record(3, 100, 900),
        record(7, 1_000, 4_000),
        record(9, 0, 0),
        record(7, 4_100, 4_800),
    ];
    assert_eq!(
        merge(&records),
        [
            Merged {
                correlation: 3,
                span: Some((100, 900)),
                records: 1,
                incomplete: 0
            },
            Merged {
                correlation: 7,
                span: Some((1_000, 5_640)),
                records: 3,
                incomplete: 0
            },
            Merged {
                correlation: 9,
                span: None,
                records: 1,
                incomplete: 1
            },
        ]
    );
    // An untimed node among timed ones is counted; the span comes from the others. An end before its start is
    // not a span.
    let mixed = merge(&[record(4, 10, 20), record(4, 0, 0), record(4, 50, 40)]);
    assert_eq!(mixed[0].span, Some((10, 20)));
    assert_eq!((mixed[0].records, mixed[0].incomplete), (3, 2));
}

#[test]
fn a_probe_record_narrows_its_bracket_by_half_the_kernel() {
    // The probe was launched at 1,000 and seen done at 29,000 (reference ns); CUPTI says it ran 27,000..27,900.
    let bracket = CalibrationSample::from_bracket(123, 1_000, 29_000);
    let s = cupti_sample(&bracket, 27_000, 27_900);
    assert_eq!(s.source_ticks, 27_450, "the kernel's middle");
    assert_eq!(s.reference_ns, 15_000);
    assert_eq!(s.max_deviation_ns, 14_000 - 450);
    // The truth (CUPTI's clock is the reference here) lies inside the stated bracket.
    assert!(s.reference_ns.abs_diff(27_450) <= s.max_deviation_ns);
    // A duration CUPTI states longer than the bracket cannot narrow it.
    let wide = cupti_sample(&bracket, 0, 40_000);
    assert_eq!(wide.max_deviation_ns, bracket.max_deviation_ns);
    // Never a zero deviation.
    let tight = cupti_sample(&CalibrationSample::from_bracket(1, 100, 102), 100, 102);
    assert_eq!(tight.max_deviation_ns, 1);
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

#[test]
fn launch_parameters_are_read_where_the_headers_put_them() {
    // cuLaunchKernel_params: f, gridDim x/y/z, blockDim x/y/z, sharedMemBytes, hStream at 40.
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
    let p = LaunchKernel {
        f: 1,
        grid: [256, 2, 1],
        block: [128, 1, 1],
        shared: 0,
        stream: 0xdead_0000,
        params: 0,
        extra: 0,
    };
    let api = lookup(307).unwrap();
    // SAFETY: `p` has cuLaunchKernel's parameter layout.
    let read = unsafe { launch_params(api, (&p as *const LaunchKernel).cast()) };
    assert_eq!(
        read,
        LaunchParams {
            stream: 0xdead_0000,
            grid: Some([256, 2, 1]),
            block: Some([128, 1, 1])
        }
    );
    let _ = (p.f, p.shared, p.params, p.extra);

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
    let ex = [&config as *const Config as usize, 0, 0, 0];
    let api = lookup(652).unwrap();
    assert_eq!(api.params, Params::DriverLaunchEx);
    // SAFETY: `ex` has cuLaunchKernelEx's parameter layout, pointing at a live configuration.
    let read = unsafe { launch_params(api, ex.as_ptr().cast()) };
    assert_eq!(
        read,
        LaunchParams {
            stream: 0xbeef_0000,
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
