//! The Vulkan backend on a real driver (Mesa's lavapipe in CI): scopes recorded into `ash` command buffers,
//! converted by the collector, checked against the truth.
//!
//! lavapipe's device clock *is* `CLOCK_MONOTONIC` (ns, `timestampPeriod` 1), so the truth of every GPU timestamp
//! is its raw value: the tests wrap the backend in [`Logged`], which records the raw ticks the collector read for
//! every slot, and compare the collector's exported slice times with them. On another driver the placement
//! checks fall back to the stated uncertainty and the accuracy check is skipped with a printed reason.
//!
//! Without a Vulkan loader or device every test prints `SKIP: <reason>` to stderr and returns.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tickline::gpu::vulkan::ash::vk;
use tickline::gpu::vulkan::{find_timestamp_queue, CalibrationExtension, CalibrationPath, VulkanGpu, VulkanOptions};
use tickline::gpu::{GpuBackend, GpuDeviceInfo, GpuError, GpuTicks};
use tickline::{calibration::CalibrationSample, export::MemoryExporter, Timeline};

#[path = "../../examples/support/vulkan.rs"]
mod support;

use crate::skip::{or_skip, skip};
use support::{Vulkan, Wants, Work};

/// A device with exactly `host_query_reset` and `extension` enabled for `test`, or `None` after printing why not.
fn vulkan_or_skip(test: &str, host_query_reset: bool, extension: Option<CalibrationExtension>) -> Option<Vulkan> {
    or_skip(test, Vulkan::new(Wants::exactly(host_query_reset, extension)))
}

/// The backend on `vulkan`'s device.
fn backend(vulkan: &Vulkan, options: VulkanOptions) -> Result<VulkanGpu, GpuError> {
    // SAFETY: every test declares its backend after `vulkan`, so drops it first; the tests submit to the queue only
    // through the backend, record scopes outside render passes into command buffers of `family`, and wait for them
    // before dropping the backend. `options` claim what the test created the device with, but in
    // `claims_the_device_does_not_back_are_rejected_before_any_call`, which claims extensions the device lacks on
    // purpose: `VulkanGpu::new` refuses those before any use (their entry points do not resolve on a conformant
    // loader), and that test checks it did.
    unsafe { vulkan.backend(options) }
}

/// The backend with 8 timestamp slots (enough for the slot tests) and `host_query_reset` as asked.
fn eight_slots(vulkan: &Vulkan, host_query_reset: bool) -> VulkanGpu {
    let options = VulkanOptions {
        host_query_reset,
        timestamp_slots: 8,
        ..VulkanOptions::default()
    };
    backend(vulkan, options).expect("the backend sets up")
}

/// What [`Logged`] saw: slots in write order, the raw ticks read per slot, the calibration samples.
#[derive(Default)]
pub(crate) struct Log {
    pub(crate) writes: Vec<u32>,
    pub(crate) reads: HashMap<u32, u64>,
    pub(crate) samples: Vec<CalibrationSample>,
}

/// A backend (Vulkan here, wgpu-hal in `wgpu.rs`), logging what passes through it (the raw ticks the
/// collector converts).
pub(crate) struct Logged<B> {
    pub(crate) inner: B,
    pub(crate) log: Arc<Mutex<Log>>,
}

impl<B: GpuBackend> GpuBackend for Logged<B> {
    type Commands = B::Commands;

    fn info(&self) -> GpuDeviceInfo {
        self.inner.info()
    }

    fn write_timestamp(&self, commands: &B::Commands, slot: u32) {
        self.log.lock().unwrap().writes.push(slot);
        self.inner.write_timestamp(commands, slot);
    }

    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        self.inner.read_timestamps(first, out)?;
        let mut log = self.log.lock().unwrap();
        for (slot, value) in (first..).zip(out.iter()) {
            if let Some(ticks) = value {
                let seen = *log.reads.entry(slot).or_insert(ticks.0);
                assert_eq!(seen, ticks.0, "slot {slot} changed without being recycled");
            }
        }
        Ok(())
    }

    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        // The tests use fewer pairs than the pool holds, so no slot is written twice: forget nothing.
        self.inner.recycle(first, count)
    }

    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        let before = out.len();
        self.inner.calibrate(samples, budget, out)?;
        self.log.lock().unwrap().samples.extend_from_slice(&out[before..]);
        Ok(())
    }

    fn resets(&self) -> u64 {
        self.inner.resets()
    }
}

pub(crate) fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// A slice on a GPU track of the exported trace.
#[derive(Debug)]
pub(crate) struct GpuSlice {
    pub(crate) name: String,
    pub(crate) frame: u64,
    pub(crate) begin: u64,
    pub(crate) end: u64,
    pub(crate) uncertainty: u64,
}

pub(crate) fn gpu_slices(trace: &tickline::export::MemoryTrace) -> Vec<GpuSlice> {
    crate::slices::queue_slices(trace)
        .expect("every end after its begin")
        .into_iter()
        .map(|s| GpuSlice {
            frame: s.u64("frame").expect("every scope carries its frame"),
            uncertainty: s.u64("uncertainty_ns").expect("an uncertainty annotation"),
            name: s.name,
            begin: s.begin,
            end: s.end,
        })
        .collect()
}

const FRAMES: u64 = 30;

/// Records `FRAMES` command buffers (`frame` > `fill`, `copy`) through a timeline, then checks every exported
/// GPU slice against its submission window and against the raw ticks.
fn run_frames(test: &str, host_query_reset: bool, extension: Option<CalibrationExtension>) {
    let Some(vulkan) = vulkan_or_skip(test, host_query_reset, extension) else {
        return;
    };
    let options = VulkanOptions {
        host_query_reset,
        calibrated_timestamps: extension,
        ..VulkanOptions::default()
    };
    let inner = backend(&vulkan, options).expect("the backend sets up");
    let path = inner.calibration_path().clone();
    match extension {
        Some(ext) => assert_eq!(path, CalibrationPath::Extension(ext)),
        None => assert!(matches!(path, CalibrationPath::Submit { .. }), "{path:?}"),
    }
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
    let queue = gpu.queue("compute").unwrap();
    let work = Work::new(&vulkan, 1 << 20).unwrap();
    let mut windows = Vec::new();
    for frame in 0..FRAMES {
        work.begin().unwrap();
        {
            let _frame = tickline::gpu_scope!(queue, &work.commands, "frame", frame = frame);
            {
                let _fill = tickline::gpu_scope!(queue, &work.commands, "fill", frame = frame);
                work.fill(frame as u32);
            }
            let _copy = tickline::gpu_scope!(queue, &work.commands, "copy", frame = frame);
            work.copy(0);
        }
        windows.push(work.submit_and_wait(&gpu.backend().inner).unwrap());
        std::thread::sleep(Duration::from_millis(3));
    }
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.gpu_scopes, 3 * FRAMES, "{stats:?}");
    assert_eq!(stats.gpu_lost_scopes, 0, "{stats:?}");
    assert_eq!(gpu.starved_scopes(), 0);

    let log = log.lock().unwrap();
    assert_eq!(log.writes.len() as u64, 6 * FRAMES, "two timestamps per scope");
    let slices = gpu_slices(&memory.snapshot());
    assert_eq!(slices.len() as u64, 3 * FRAMES);
    // Write order per frame: frame begin, fill begin, fill end, copy begin, copy end, frame end.
    let slots = |s: &GpuSlice| {
        let w = &log.writes[6 * s.frame as usize..6 * s.frame as usize + 6];
        match s.name.as_str() {
            "frame" => (w[0], w[5]),
            "fill" => (w[1], w[2]),
            "copy" => (w[3], w[4]),
            other => panic!("unexpected GPU slice {other}"),
        }
    };
    let truth = |ticks: u64| (ticks as f64 * period).round() as u64;
    let deviations: Vec<u64> = {
        let mut d: Vec<u64> = log.samples.iter().map(|s| s.max_deviation_ns).collect();
        d.sort_unstable();
        d
    };
    assert!(!deviations.is_empty(), "the collector calibrated");
    let typical_deviation = percentile(&deviations, 0.5);
    let widest_deviation = deviations[deviations.len() - 1];
    let extension = matches!(path, CalibrationPath::Extension(_));
    // How far a slice may sit from the truth: its stated uncertainty. A fallback sample only knows that the write
    // happened inside its bracket, and on lavapipe every bracket is lopsided the same way (the write comes a few
    // µs after vkQueueSubmit, its availability some 30 µs later), which averaging many samples does not remove;
    // on a loaded machine a burst may also hold only a few wide samples. So the fallback's slices are held to the
    // widest bracket half-width the backend reported, when that is larger.
    let slack = |s: &GpuSlice| {
        if extension {
            s.uncertainty.max(1)
        } else {
            s.uncertainty.max(widest_deviation)
        }
    };
    let mut errors = Vec::new();
    let mut beyond_uncertainty = 0;
    for s in &slices {
        let (begin_slot, end_slot) = slots(s);
        assert!(
            begin_slot % 2 == 0 && end_slot == begin_slot + 1,
            "{s:?}: slots {begin_slot}, {end_slot}"
        );
        let (before, after) = windows[s.frame as usize];
        // The GPU cannot have run the work before it was submitted or after the fence was seen.
        let slack = slack(s);
        assert!(
            before <= s.begin + slack && s.begin <= s.end && s.end <= after + slack,
            "{s:?} outside its submission window {before}..{after} (± {slack} ns)"
        );
        if extension {
            assert!(before <= s.begin && s.end <= after, "{s:?} outside {before}..{after}");
        }
        if vulkan.lavapipe {
            // The truth (lavapipe: device ticks are CLOCK_MONOTONIC ns) lies in the submission's window.
            let (b, e) = (truth(log.reads[&begin_slot]), truth(log.reads[&end_slot]));
            assert!(
                before <= b && b <= e && e <= after,
                "{s:?}: truth {b}..{e} outside {before}..{after}"
            );
            let error = s.begin.abs_diff(b).max(s.end.abs_diff(e));
            assert!(
                error <= slack,
                "{s:?}: off the truth {b}..{e} by {error} ns > {slack} ns"
            );
            beyond_uncertainty += usize::from(error > s.uncertainty.max(1));
            errors.push(s.begin.abs_diff(b));
            errors.push(s.end.abs_diff(e));
        }
    }
    let mut uncertainties: Vec<u64> = slices.iter().map(|s| s.uncertainty).collect();
    uncertainties.sort_unstable();
    eprintln!(
        "{test}: {path:?}, host reset {}: {} slices, {} causality violations; {} calibration samples (max deviation \
         median {typical_deviation} ns, max {widest_deviation} ns); stated uncertainty median {} ns",
        host_query_reset,
        slices.len(),
        stats.gpu_causality_violations,
        deviations.len(),
        percentile(&uncertainties, 0.5),
    );
    if extension {
        assert_eq!(stats.gpu_causality_violations, 0, "{stats:?}");
    }
    if !vulkan.lavapipe {
        // No truth on a real GPU: how far each slice lies outside its submission window is what can be measured.
        let mut outside: Vec<u64> = slices
            .iter()
            .map(|s| {
                let (before, after) = windows[s.frame as usize];
                before.saturating_sub(s.begin).max(s.end.saturating_sub(after))
            })
            .collect();
        outside.sort_unstable();
        eprintln!(
            "{test}: placement against submission windows: {} of {} slices inside; outside by p50 {} ns, p99 {} ns, \
             max {} ns; stated uncertainty p50 {} ns, p99 {} ns",
            outside.iter().filter(|&&o| o == 0).count(),
            slices.len(),
            percentile(&outside, 0.5),
            percentile(&outside, 0.99),
            outside[outside.len() - 1],
            percentile(&uncertainties, 0.5),
            percentile(&uncertainties, 0.99),
        );
        skip(
            test,
            "the accuracy check needs lavapipe (its device clock is CLOCK_MONOTONIC)",
        );
        return;
    }
    errors.sort_unstable();
    let p99 = percentile(&errors, 0.99);
    eprintln!(
        "{test}: error against the truth: p50 {} ns, p99 {p99} ns, max {} ns; {beyond_uncertainty} of {} slices \
         off by more than their stated uncertainty",
        percentile(&errors, 0.5),
        errors[errors.len() - 1],
        slices.len()
    );
    if extension {
        assert!(p99 <= 1_000, "p99 error {p99} ns > 1 µs");
        assert_eq!(beyond_uncertainty, 0, "the stated uncertainty covers the error");
    }
}

#[test]
fn extension_calibration_with_host_reset_places_slices_within_a_microsecond() {
    let _one_at_a_time = crate::exclusive();
    run_frames("vulkan extension + host reset", true, Some(CalibrationExtension::Ext));
}

#[test]
fn extension_calibration_with_command_reset_places_slices_within_a_microsecond() {
    let _one_at_a_time = crate::exclusive();
    run_frames(
        "vulkan extension + command reset",
        false,
        Some(CalibrationExtension::Ext),
    );
}

#[test]
fn submit_calibration_with_host_reset_places_slices_within_its_bracket() {
    let _one_at_a_time = crate::exclusive();
    run_frames("vulkan submit fallback + host reset", true, None);
}

#[test]
fn submit_calibration_with_command_reset_places_slices_within_its_bracket() {
    let _one_at_a_time = crate::exclusive();
    run_frames("vulkan submit fallback + command reset", false, None);
}

/// Writes a pair into `work`'s command buffer, checks reads before and after the GPU ran it, recycles.
fn round_trip(gpu: &VulkanGpu, work: &Work<'_>, slot: u32) -> (u64, u64) {
    work.begin().unwrap();
    gpu.write_timestamp(&work.commands, slot);
    work.fill(7);
    gpu.write_timestamp(&work.commands, slot + 1);
    let mut out = [None; 2];
    gpu.read_timestamps(slot, &mut out).unwrap();
    assert_eq!(
        out,
        [None, None],
        "recorded, not run: unwritten (NOT_READY is no error)"
    );
    let (before, after) = work.submit_and_wait(gpu).unwrap();
    gpu.read_timestamps(slot, &mut out).unwrap();
    let (begin, end) = (out[0].expect("written").0, out[1].expect("written").0);
    assert!(begin <= end);
    if work.vulkan.lavapipe {
        assert!(before <= begin && end <= after, "{before} {begin} {end} {after}");
    }
    gpu.recycle(slot, 2).unwrap();
    gpu.read_timestamps(slot, &mut out).unwrap();
    assert_eq!(out, [None, None], "recycled: unwritten until written again");
    (begin, end)
}

#[test]
fn slots_read_unwritten_until_the_gpu_writes_them_in_both_reset_modes() {
    let _one_at_a_time = crate::exclusive();
    for host_query_reset in [true, false] {
        let test = format!("vulkan slot recycling (host reset {host_query_reset})");
        let Some(vulkan) = vulkan_or_skip(&test, host_query_reset, None) else {
            continue;
        };
        let gpu = eight_slots(&vulkan, host_query_reset);
        assert_eq!(gpu.host_query_reset(), host_query_reset);
        let info = gpu.info();
        assert_eq!((info.api, info.timestamp_slots), ("Vulkan", 8));
        let work = Work::new(&vulkan, 4096).unwrap();
        let (_, first_end) = round_trip(&gpu, &work, 6);
        // The same slots again: the new values are later (with command reset, the stale values are hidden until
        // the command buffer's reset runs).
        let (second_begin, _) = round_trip(&gpu, &work, 6);
        assert!(second_begin > first_end);
        let mut out = [None; 3];
        assert!(matches!(
            gpu.read_timestamps(6, &mut out),
            Err(GpuError::Invalid { .. })
        ));
        assert!(matches!(gpu.recycle(8, 2), Err(GpuError::Invalid { .. })));
        drop(work);
        drop(gpu);
    }
}

#[test]
fn calibration_respects_its_budget_on_both_paths() {
    let _one_at_a_time = crate::exclusive();
    for extension in [Some(CalibrationExtension::Ext), None] {
        let test = format!("vulkan calibration budget ({extension:?})");
        let Some(vulkan) = vulkan_or_skip(&test, false, extension) else {
            continue;
        };
        let gpu = backend(
            &vulkan,
            VulkanOptions {
                calibrated_timestamps: extension,
                ..VulkanOptions::default()
            },
        )
        .unwrap();
        let mut out = Vec::new();
        gpu.calibrate(16, Duration::ZERO, &mut out).unwrap();
        assert!(out.is_empty(), "a zero budget takes nothing");
        let started = Instant::now();
        gpu.calibrate(1_000_000, Duration::from_millis(3), &mut out).unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_millis(20), "{took:?}");
        assert!(!out.is_empty());
        let mask = gpu.info().clock.mask();
        for pair in out.windows(2) {
            assert!(pair[0].reference_ns < pair[1].reference_ns);
            assert!(pair[0].source_ticks <= pair[1].source_ticks);
        }
        for s in &out {
            assert!(s.max_deviation_ns >= 1 && s.source_ticks & !mask == 0, "{s:?}");
            if vulkan.lavapipe {
                // The truth: device ticks are CLOCK_MONOTONIC ns, within the sample's stated deviation.
                assert!(s.source_ticks.abs_diff(s.reference_ns) <= s.max_deviation_ns, "{s:?}");
            }
        }
        let mut deviations: Vec<u64> = out.iter().map(|s| s.max_deviation_ns).collect();
        deviations.sort_unstable();
        eprintln!(
            "{test}: {} samples in {took:?}; max deviation median {} ns, max {} ns",
            out.len(),
            percentile(&deviations, 0.5),
            deviations[deviations.len() - 1]
        );
    }
}

#[test]
fn claims_the_device_does_not_back_are_rejected_before_any_call() {
    let _one_at_a_time = crate::exclusive();
    let test = "vulkan rejected claims";
    // A device created without any calibrated-timestamps extension.
    let Some(vulkan) = vulkan_or_skip(test, false, None) else {
        return;
    };
    for extension in [CalibrationExtension::Ext, CalibrationExtension::Khr] {
        let result = backend(
            &vulkan,
            VulkanOptions {
                calibrated_timestamps: Some(extension),
                ..VulkanOptions::default()
            },
        );
        match result {
            Err(GpuError::Invalid { detail }) => {
                assert!(detail.contains(&*extension.name().to_string_lossy()), "{detail}");
                eprintln!("{test}: {detail}");
            }
            other => panic!("claiming {extension:?} without enabling it: {other:?}"),
        }
    }
    // A queue family that does not exist.
    let result = {
        // SAFETY: as `Vulkan::backend`, but with a family index the device does not have (rejected before use).
        unsafe {
            VulkanGpu::new(
                &vulkan.entry,
                &vulkan.instance,
                vulkan.physical,
                &vulkan.device,
                99,
                vulkan.queue,
                VulkanOptions::default(),
            )
        }
    };
    assert!(matches!(result, Err(GpuError::Invalid { .. })), "{result:?}");
    // Bad options.
    let result = backend(
        &vulkan,
        VulkanOptions {
            timestamp_slots: 3,
            ..VulkanOptions::default()
        },
    );
    assert!(matches!(result, Err(GpuError::Invalid { .. })), "{result:?}");
    // A queue family for video decoding with timestamps: lavapipe has none (a typed error); NVIDIA's driver has
    // one (seen on an H200), and it must be what was asked for.
    // SAFETY: the instance is alive.
    let found = unsafe { find_timestamp_queue(&vulkan.instance, vk::QueueFlags::VIDEO_DECODE_KHR) };
    match found {
        Err(GpuError::NoDevice { .. } | GpuError::NoTimestamps { .. }) => {}
        Ok((physical, family)) => {
            // SAFETY: the instance is alive and `physical` is one of its devices.
            let families = unsafe { vulkan.instance.get_physical_device_queue_family_properties(physical) };
            let props = families[family as usize];
            assert!(
                props.queue_flags.contains(vk::QueueFlags::VIDEO_DECODE_KHR) && props.timestamp_valid_bits > 0,
                "{props:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// Runs `call` on another thread while this one holds the backend's queue lock, as an application does while it
/// submits; returns whether `call` finished before the lock was released (it always finishes after).
fn finishes_while_the_queue_is_locked(gpu: &VulkanGpu, call: impl FnOnce() + Send) -> bool {
    std::thread::scope(|s| {
        let queue = gpu.lock_queue();
        let (done, finished) = std::sync::mpsc::channel();
        s.spawn(move || {
            call();
            done.send(()).unwrap();
        });
        // Ample for a query call that does not wait for the lock (a few µs).
        std::thread::sleep(Duration::from_millis(50));
        let early = finished.try_recv().is_ok();
        drop(queue);
        if !early {
            finished
                .recv_timeout(Duration::from_secs(10))
                .expect("the call finishes once the queue is unlocked");
        }
        early
    })
}

/// lavapipe answers query calls on its queue's context, and a submission that starts during a read leaves some of its
/// timestamps unavailable for good: on lavapipe a query read or reset waits for the queue lock every submission
/// holds. Deterministic: without the lock the calls finish while the test holds it.
#[test]
fn lavapipe_query_calls_wait_while_a_submission_holds_the_queue() {
    let _one_at_a_time = crate::exclusive();
    for host_query_reset in [true, false] {
        let test = format!("vulkan query calls and the queue lock (host reset {host_query_reset})");
        let Some(vulkan) = vulkan_or_skip(&test, host_query_reset, None) else {
            continue;
        };
        if !vulkan.lavapipe {
            skip(&test, "only lavapipe needs its query calls kept apart from submissions");
            continue;
        }
        let gpu = eight_slots(&vulkan, host_query_reset);
        let read = finishes_while_the_queue_is_locked(&gpu, || {
            let mut out = [None; 2];
            gpu.read_timestamps(0, &mut out).unwrap();
            assert_eq!(out, [None, None]);
        });
        assert!(!read, "{test}: a query read ran while a submitter held the queue");
        let recycle = finishes_while_the_queue_is_locked(&gpu, || gpu.recycle(0, 2).unwrap());
        assert!(!recycle, "{test}: a query reset ran while a submitter held the queue");
        // The fallback calibration reads its probe query too.
        let calibrate = finishes_while_the_queue_is_locked(&gpu, || {
            let mut samples = Vec::new();
            gpu.calibrate(1, Duration::from_millis(5), &mut samples).unwrap();
        });
        assert!(
            !calibrate,
            "{test}: a calibration probe ran while a submitter held the queue"
        );
    }
}

/// The failure itself, as the collector meets it: one thread reads a command buffer's timestamp slots over and over
/// while the command buffer is submitted and runs; once its fence is signalled, every timestamp reads back. (On
/// lavapipe without the queue lock around reads, a few rounds in a hundred lost timestamps for good.)
#[test]
fn timestamps_read_back_after_their_fence_while_another_thread_reads_them() {
    let _one_at_a_time = crate::exclusive();
    const ROUNDS: u32 = 200;
    for host_query_reset in [true, false] {
        let test = format!("vulkan reads during submissions (host reset {host_query_reset})");
        let Some(vulkan) = vulkan_or_skip(&test, host_query_reset, None) else {
            continue;
        };
        let gpu = eight_slots(&vulkan, host_query_reset);
        let work = Work::new(&vulkan, 1 << 20).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let mut lost = Vec::new();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut out = [None; 8];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    gpu.read_timestamps(0, &mut out).unwrap();
                    std::thread::yield_now();
                }
            });
            for round in 0..ROUNDS {
                // As `run_frames` writes them: two nested pairs around a fill, a third around a copy.
                work.begin().unwrap();
                gpu.write_timestamp(&work.commands, 0);
                gpu.write_timestamp(&work.commands, 2);
                work.fill(round);
                gpu.write_timestamp(&work.commands, 3);
                gpu.write_timestamp(&work.commands, 4);
                work.copy(0);
                gpu.write_timestamp(&work.commands, 5);
                gpu.write_timestamp(&work.commands, 1);
                work.submit_and_wait(&gpu).unwrap();
                let mut out = [None; 6];
                // The fence was signalled: the values are there (a short grace for a driver that makes queries
                // available a little after the fence).
                let deadline = Instant::now() + Duration::from_millis(100);
                loop {
                    gpu.read_timestamps(0, &mut out).unwrap();
                    if out.iter().all(Option::is_some) || Instant::now() > deadline {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                if !out.iter().all(Option::is_some) {
                    lost.push((round, out));
                }
                gpu.recycle(0, 6).unwrap();
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        assert!(
            lost.is_empty(),
            "{test}: {} of {ROUNDS} rounds lost timestamps after their fence: {lost:?}",
            lost.len()
        );
        drop(work);
        drop(gpu);
    }
}
