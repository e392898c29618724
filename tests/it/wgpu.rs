//! The wgpu-hal backend on a real driver (Mesa's lavapipe in CI): scopes recorded on a hal Vulkan command
//! encoder, converted by the collector, checked against the truth.
//!
//! As in `vulkan.rs`: lavapipe's device clock *is* `CLOCK_MONOTONIC` (ns), so the truth of every GPU timestamp is
//! its raw value, which [`Logged`] records as the collector reads it. Without a Vulkan loader or a hal adapter
//! with timestamps every test prints `SKIP: <reason>` to stderr and returns.

#[path = "../../examples/support/wgpu.rs"]
pub(crate) mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tickline::gpu::vulkan::{CalibrationPath, VulkanOptions};
use tickline::gpu::wgpu::{hal, WgpuCommands, WgpuGpu};
use tickline::gpu::{GpuBackend, GpuError};
use tickline::{export::MemoryExporter, Timeline};

use crate::skip::{or_skip, skip};
use crate::vulkan::{gpu_slices, percentile, GpuSlice, Log, Logged};
use support::{vulkan_adapter, HalDevice, HalWork};

const FRAMES: u64 = 30;

/// Records `FRAMES` hal command buffers (`frame` > `clear`, `copy`) through a timeline, then checks every GPU
/// slice against its `[submit, wait]` window and, on lavapipe, against the raw ticks.
fn run_frames(test: &str, host_query_reset: bool) {
    let Some(hal) = or_skip(test, HalDevice::new()) else {
        return;
    };
    if host_query_reset && !hal.options.host_query_reset {
        skip(test, "the device has no hostQueryReset");
        return;
    }
    let options = VulkanOptions {
        host_query_reset,
        ..hal.options.clone()
    };
    // SAFETY: the hal device and queue outlive the backend (dropped with `gpu` before `hal`); every submit goes
    // through `WgpuGpu::submit`; scopes record into the encoder while it encodes, outside render passes; each
    // command buffer is submitted once and waited for.
    let inner = unsafe { WgpuGpu::new(&hal.device, &hal.queue, options) }.expect("the backend sets up");
    assert_eq!(inner.info().api, "wgpu-hal (Vulkan)");
    assert_eq!(inner.vulkan().host_query_reset(), host_query_reset);
    let path = inner.vulkan().calibration_path().clone();
    let log = Arc::new(Mutex::new(Log::default()));
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let gpu = timeline
        .gpu(Logged {
            inner,
            log: log.clone(),
        })
        .unwrap();
    let period = gpu.info().clock.nominal_ns_per_tick();
    let queue = gpu.queue("hal").unwrap();
    let mut work = HalWork::new(&hal).unwrap();
    let mut windows = Vec::new();
    for frame in 0..FRAMES {
        let commands = work.begin().unwrap();
        {
            let _frame = tickline::gpu_scope!(queue, &commands, "frame", frame = frame);
            {
                let _clear = tickline::gpu_scope!(queue, &commands, "clear", frame = frame);
                work.fill();
            }
            let _copy = tickline::gpu_scope!(queue, &commands, "copy", frame = frame);
            work.copy(false);
        }
        windows.push(work.submit_and_wait(&gpu.backend().inner).unwrap());
        std::thread::sleep(Duration::from_millis(3));
    }
    drop(work);
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.gpu_scopes, 3 * FRAMES, "{stats:?}");
    assert_eq!(stats.gpu_lost_scopes, 0, "{stats:?}");
    assert_eq!(gpu.starved_scopes(), 0);

    let log = log.lock().unwrap();
    assert_eq!(log.writes.len() as u64, 6 * FRAMES, "two timestamps per scope");
    let slices = gpu_slices(&memory.snapshot());
    assert_eq!(slices.len() as u64, 3 * FRAMES);
    // Write order per frame: frame begin, clear begin, clear end, copy begin, copy end, frame end.
    let slots = |s: &GpuSlice| {
        let w = &log.writes[6 * s.frame as usize..6 * s.frame as usize + 6];
        match s.name.as_str() {
            "frame" => (w[0], w[5]),
            "clear" => (w[1], w[2]),
            "copy" => (w[3], w[4]),
            other => panic!("unexpected GPU slice {other}"),
        }
    };
    let extension = matches!(path, CalibrationPath::Extension(_));
    let truth = |ticks: u64| (ticks as f64 * period).round() as u64;
    let mut errors = Vec::new();
    for s in &slices {
        let (begin_slot, end_slot) = slots(s);
        let (before, after) = windows[s.frame as usize];
        let slack = s.uncertainty.max(1);
        assert!(
            before <= s.begin + slack && s.begin <= s.end && s.end <= after + slack,
            "{s:?} outside its submission window {before}..{after} (± {slack} ns)"
        );
        if extension {
            assert!(before <= s.begin && s.end <= after, "{s:?} outside {before}..{after}");
        }
        if hal.lavapipe {
            let (b, e) = (truth(log.reads[&begin_slot]), truth(log.reads[&end_slot]));
            assert!(
                before <= b && b <= e && e <= after,
                "{s:?}: truth {b}..{e} outside {before}..{after}"
            );
            errors.push(s.begin.abs_diff(b));
            errors.push(s.end.abs_diff(e));
        }
    }
    eprintln!(
        "{test}: {path:?}, host reset {host_query_reset}: {} slices, {} causality violations",
        slices.len(),
        stats.gpu_causality_violations
    );
    if !hal.lavapipe {
        skip(
            test,
            "the accuracy check needs lavapipe (its device clock is CLOCK_MONOTONIC)",
        );
        return;
    }
    errors.sort_unstable();
    let p99 = percentile(&errors, 0.99);
    eprintln!(
        "{test}: error against the truth: p50 {} ns, p99 {p99} ns, max {} ns",
        percentile(&errors, 0.5),
        errors[errors.len() - 1],
    );
    if extension {
        assert_eq!(stats.gpu_causality_violations, 0, "{stats:?}");
        assert!(p99 <= 1_000, "p99 error {p99} ns > 1 µs");
    } else {
        skip(test, "the 1 µs check needs a calibrated-timestamps extension");
    }
}

#[test]
fn wgpu_hal_scopes_with_host_reset_sit_in_their_windows_within_a_microsecond() {
    let _one_at_a_time = crate::exclusive();
    run_frames(
        "wgpu_hal_scopes_with_host_reset_sit_in_their_windows_within_a_microsecond",
        true,
    );
}

#[test]
fn wgpu_hal_scopes_with_command_reset_sit_in_their_windows_within_a_microsecond() {
    let _one_at_a_time = crate::exclusive();
    run_frames(
        "wgpu_hal_scopes_with_command_reset_sit_in_their_windows_within_a_microsecond",
        false,
    );
}

#[test]
fn commands_exist_only_while_the_encoder_encodes() {
    let test = "commands_exist_only_while_the_encoder_encodes";
    let Some(hal) = or_skip(test, HalDevice::new()) else {
        return;
    };
    let mut encoder = {
        use hal::Device as _;
        // SAFETY: a valid descriptor for the device's queue; the encoder is dropped before `hal`.
        unsafe {
            hal.device.create_command_encoder(&hal::CommandEncoderDescriptor {
                label: None,
                queue: &hal.queue,
            })
        }
        .unwrap()
    };
    use hal::CommandEncoder as _;
    assert_eq!(WgpuCommands::of(&encoder), None, "not encoding yet");
    // SAFETY: the encoder is closed (fresh).
    unsafe { encoder.begin_encoding(None) }.unwrap();
    assert!(WgpuCommands::of(&encoder).is_some());
    // SAFETY: the encoder is encoding; the discarded buffer was never submitted.
    unsafe { encoder.discard_encoding() };
    assert_eq!(WgpuCommands::of(&encoder), None, "discarded");
}

#[test]
fn a_queue_of_another_device_is_refused() {
    let test = "a_queue_of_another_device_is_refused";
    let (Some(one), Some(two)) = (or_skip(test, HalDevice::new()), or_skip(test, HalDevice::new())) else {
        return;
    };
    // SAFETY: refused before any handle is used beyond reading it.
    let refused = unsafe { WgpuGpu::new(&one.device, &two.queue, one.options.clone()) };
    assert!(matches!(refused, Err(GpuError::Invalid { .. })), "{refused:?}");
}

/// The path the module docs show a `wgpu` user: open the hal device through `open_device`, hand it to wgpu,
/// take the hal device and queue back out with `as_hal`, record scopes on the hal encoder of a
/// `wgpu::CommandEncoder`, submit through wgpu.
#[test]
fn a_wgpu_device_reaches_the_backend_through_as_hal() {
    use tickline::gpu::wgpu::open_device;
    use wgpu::hal::api::Vulkan;

    let _one_at_a_time = crate::exclusive();
    let test = "a_wgpu_device_reaches_the_backend_through_as_hal";
    let Some((_instance, adapter)) = or_skip(test, vulkan_adapter()) else {
        return;
    };
    let desc = wgpu::DeviceDescriptor::default();
    // SAFETY: the hal adapter is the wgpu adapter's, alive while `adapter` is; no features, default limits.
    let opened = unsafe {
        let hal_adapter = adapter.as_hal::<Vulkan>().expect("a Vulkan adapter");
        open_device(
            &hal_adapter,
            desc.required_features,
            &desc.required_limits,
            &desc.memory_hints,
        )
    };
    let (open, options) = opened.expect("the hal device opens");
    // SAFETY: `open` was opened on this adapter's hal adapter with the descriptor's features and limits.
    let (device, queue) = unsafe { adapter.create_device_from_hal(open, &desc) }.expect("wgpu takes the device");
    // SAFETY: the hal device and queue live as long as `device` and `queue`, dropped after the backend (the
    // timeline is shut down and `gpu` dropped first); wgpu submits without tickline's queue lock, so only the
    // extension path is used (checked below: otherwise the test skips before any scope); scopes record into the
    // hal encoder while wgpu holds it open, each command buffer submitted once and waited for.
    let backend = unsafe {
        let hal_device = device.as_hal::<Vulkan>().expect("a Vulkan device");
        let hal_queue = queue.as_hal::<Vulkan>().expect("a Vulkan queue");
        WgpuGpu::new(&hal_device, &hal_queue, options)
    }
    .expect("the backend sets up");
    if !matches!(backend.vulkan().calibration_path(), CalibrationPath::Extension(_)) {
        return skip(
            test,
            "no calibrated-timestamps extension: wgpu's submits would race the probe",
        );
    }
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start().unwrap();
    let gpu = timeline.gpu(backend).unwrap();
    let gpu_queue = gpu.queue("wgpu").unwrap();
    let buffer = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: support::SIZE,
        usage: wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut windows = Vec::new();
    for frame in 0..10u64 {
        // wgpu-level work in its own encoder: wgpu 30 panics when one encoder mixes its encoding API with
        // `as_hal_mut` ("Mixing the wgpu encoding API with the raw encoding API is not permitted").
        let mut work = device.create_command_encoder(&Default::default());
        work.clear_buffer(&buffer, 0, None);
        let mut raw = device.create_command_encoder(&Default::default());
        // SAFETY: the scope's timestamps go into wgpu's open hal encoder and nothing is destroyed through it.
        unsafe {
            raw.as_hal_mut::<Vulkan, _, _>(|hal_encoder| {
                let hal_encoder = hal_encoder.expect("a Vulkan encoder");
                let commands = WgpuCommands::of(hal_encoder).expect("wgpu opens its hal encoder");
                let _scope = tickline::gpu_scope!(gpu_queue, &commands, "frame", frame = frame);
            })
        };
        let before = tickline::clock::monotonic_ns().0;
        queue.submit([work.finish(), raw.finish()]);
        device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
        windows.push((before, tickline::clock::monotonic_ns().0));
    }
    let stats = timeline.shutdown().unwrap();
    assert_eq!((stats.gpu_scopes, stats.gpu_lost_scopes), (10, 0), "{stats:?}");
    let slices = gpu_slices(&memory.snapshot());
    assert_eq!(slices.len(), 10);
    for s in &slices {
        let (before, after) = windows[s.frame as usize];
        assert!(
            before <= s.begin && s.begin <= s.end && s.end <= after,
            "{s:?} outside its submission window {before}..{after}"
        );
    }
    drop((gpu_queue, gpu));
}
