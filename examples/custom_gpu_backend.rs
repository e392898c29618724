//! A GPU backend of your own, in one file: everything tickline needs from a Metal, D3D12 or custom-clock
//! backend (the contract is in [`GpuBackend`]'s docs), on a software "device" you can run anywhere.
//!
//! The device's clock is a 48-bit counter of 1 ns ticks that changes only every microsecond (like
//! `%globaltimer` on older NVIDIA GPUs), runs 25 ppm fast and starts 3 s ahead of the host; a worker thread is
//! its queue. Half-way through, the device "restarts" its counter (a power-state change): the backend says so
//! through [`GpuBackend::resets`] and tickline starts a new calibration segment there.
//!
//! Where a real API differs, the comments say what to call: Metal's `MTLDevice.sampleTimestamps` (bracket it
//! with two `CLOCK_MONOTONIC` reads; its CPU value is `mach_absolute_time`, not the reference clock),
//! `MTLCounterSampleBuffer` slots for the timestamps; D3D12's `ID3D12GraphicsCommandList::EndQuery` into a
//! timestamp query heap, `ResolveQueryData` to read it, `ID3D12CommandQueue::GetClockCalibration` for samples.
//!
//! `cargo run --example custom_gpu_backend`

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tickline::gpu::{GpuBackend, GpuDeviceInfo, GpuError, GpuTicks, CALIBRATION_BREAK};
use tickline::{
    calibration::{CalibrationSample, ClockDomain},
    clock::monotonic_ns,
    export::{FieldValue, MemoryExporter},
    Timeline,
};

/// The counter's valid bits: it wraps at 2^48 ticks (about 3.3 days of ns).
const VALID_BITS: u32 = 48;
const MASK: u64 = (1 << VALID_BITS) - 1;
/// The counter changes every microsecond.
const RESOLUTION_NS: u64 = 1_000;
/// Timestamp slots: 64 scopes in flight at most.
const SLOTS: u32 = 128;
/// A slot holding this was not written (the counter never shows it: values are masked to 48 bits).
const UNWRITTEN: u64 = u64::MAX;

/// The device clock: reference time in, counter value out.
struct Clock {
    start_ns: u64,
    /// Counter value at `start_ns`, in ticks before quantization.
    offset_ticks: f64,
}

impl Clock {
    fn read(&self) -> u64 {
        let elapsed = monotonic_ns().0.saturating_sub(self.start_ns) as f64;
        let ticks = (self.offset_ticks + elapsed * (1.0 + 25e-6)) as u64;
        (ticks / RESOLUTION_NS * RESOLUTION_NS) & MASK
    }
}

struct Device {
    clock: Mutex<Clock>,
    slots: Box<[AtomicU64]>,
}

/// What a scope's timestamps are written into: a command list, recorded on one thread, then submitted.
#[derive(Default)]
pub struct CommandList {
    ops: RefCell<Vec<Op>>,
}

enum Op {
    Timestamp(u32),
    Work(Duration),
}

impl CommandList {
    /// Room for `ops` commands: [`GpuBackend::write_timestamp`] then never allocates.
    pub fn with_capacity(ops: usize) -> Self {
        CommandList {
            ops: RefCell::new(Vec::with_capacity(ops)),
        }
    }

    /// Keeps the queue busy for `duration`.
    pub fn work(&self, duration: Duration) {
        self.ops.borrow_mut().push(Op::Work(duration));
    }
}

/// The backend: owns the device, its slots, its queue and its reset count.
pub struct SoftGpu {
    device: Arc<Device>,
    queue: Sender<(Vec<Op>, Sender<()>)>,
    resets: AtomicU64,
}

impl SoftGpu {
    fn new() -> Self {
        let device = Arc::new(Device {
            clock: Mutex::new(Clock {
                start_ns: monotonic_ns().0,
                offset_ticks: 3e9,
            }),
            slots: (0..SLOTS).map(|_| AtomicU64::new(UNWRITTEN)).collect(),
        });
        let (queue, jobs) = channel();
        let worker = device.clone();
        std::thread::spawn(move || run_queue(&worker, &jobs));
        SoftGpu {
            device,
            queue,
            resets: AtomicU64::new(0),
        }
    }

    /// Runs a command list on the queue and waits for it.
    fn submit_and_wait(&self, commands: CommandList) {
        let (done, finished) = channel();
        let _ = self.queue.send((commands.ops.into_inner(), done));
        let _ = finished.recv();
    }

    /// The device restarts its counter (as a power-state change or a recovered device would): from now on it
    /// shows values 7 ms behind where it was. The backend knows, so it says so.
    fn restart_counter(&self) {
        let mut clock = self.device.clock.lock().unwrap();
        clock.offset_ticks -= 7e6;
        self.resets.fetch_add(1, Ordering::Relaxed);
    }
}

fn run_queue(device: &Device, jobs: &Receiver<(Vec<Op>, Sender<()>)>) {
    while let Ok((ops, done)) = jobs.recv() {
        for op in ops {
            match op {
                Op::Timestamp(slot) => {
                    let ticks = device.clock.lock().unwrap().read();
                    // Release: publishes the value; pairs with the Acquire in `read_timestamps`.
                    device.slots[slot as usize].store(ticks, Ordering::Release);
                }
                Op::Work(duration) => {
                    let until = Instant::now() + duration;
                    while Instant::now() < until {
                        std::hint::spin_loop();
                    }
                }
            }
        }
        let _ = done.send(());
    }
}

impl GpuBackend for SoftGpu {
    type Commands = CommandList;

    fn info(&self) -> GpuDeviceInfo {
        GpuDeviceInfo {
            name: "soft GPU".into(),
            api: "custom",
            // Valid bits, the nominal tick and how often the counter really changes: measure it where you can
            // (read the clock in a loop, take the smallest step, as the CUDA backend does), else declare the
            // documented figure. tickline widens every calibration bracket by half of it on both sides and adds
            // half of it to every conversion.
            clock: ClockDomain::new(VALID_BITS, 1.0)
                .and_then(|d| d.with_resolution_ns(RESOLUTION_NS as f64))
                .expect("a valid domain"),
            timestamp_slots: SLOTS,
        }
    }

    // The hot path, on application threads: record the write, never block, allocate or fail loudly.
    // (Metal: sampleCountersInBuffer / a counter-sample attachment; D3D12: EndQuery on a timestamp heap.)
    fn write_timestamp(&self, commands: &CommandList, slot: u32) {
        debug_assert!(slot < SLOTS);
        if let Ok(mut ops) = commands.ops.try_borrow_mut() {
            ops.push(Op::Timestamp(slot));
        }
        // A list borrowed elsewhere cannot take the write: the slot stays unwritten, the scope is counted lost.
    }

    // Never wait: `None` for a slot not written yet, the raw value masked to the valid bits otherwise. An `Err`
    // (the device is gone) is counted by tickline and the read retried.
    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        let slots = self
            .device
            .slots
            .get(first as usize..first as usize + out.len())
            .ok_or_else(|| GpuError::Invalid {
                detail: format!("slots {first}..{} past {SLOTS}", first as usize + out.len()),
            })?;
        for (value, slot) in out.iter_mut().zip(slots) {
            // Acquire: pairs with the Release in `run_queue`.
            let ticks = slot.load(Ordering::Acquire);
            *value = (ticks != UNWRITTEN).then_some(GpuTicks(ticks & MASK));
        }
        Ok(())
    }

    // After this, the slots read `None` until written again: a stale value must never pass for a new one.
    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        for slot in &self.device.slots[first as usize..(first + count) as usize] {
            slot.store(UNWRITTEN, Ordering::Release);
        }
        Ok(())
    }

    // Each sample: the plain bracket of one read of the device clock between two reads of CLOCK_MONOTONIC
    // (not widened by the resolution: the domain says it). Stop at the budget with what you have.
    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        let started = Instant::now();
        for _ in 0..samples {
            if started.elapsed() >= budget {
                break;
            }
            let before = monotonic_ns().0;
            let ticks = self.device.clock.lock().unwrap().read();
            let after = monotonic_ns().0;
            out.push(CalibrationSample::from_bracket(ticks, before, after));
        }
        Ok(())
    }

    // Counted up each time the device clock is known to have been reset.
    fn resets(&self) -> u64 {
        self.resets.load(Ordering::Relaxed)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder().exporter(memory.clone()).start()?;
    let gpu = timeline.gpu(SoftGpu::new())?;
    let queue = gpu.queue("compute")?;
    const FRAMES: u32 = 40;
    let mut windows = Vec::new();
    for frame in 0..FRAMES {
        if frame == FRAMES / 2 {
            gpu.backend().restart_counter();
        }
        let commands = CommandList::with_capacity(16);
        let submitted = monotonic_ns().0;
        {
            let _frame = tickline::gpu_scope!(queue, &commands, "frame", index = frame);
            let _blur = tickline::gpu_scope!(queue, &commands, "blur");
            commands.work(Duration::from_micros(300));
        }
        gpu.backend().submit_and_wait(commands);
        windows.push((submitted, monotonic_ns().0));
        std::thread::sleep(Duration::from_millis(20));
    }
    let report = gpu.calibration().ok_or("the soft GPU was never calibrated")?;
    let stats = timeline.shutdown()?;

    let trace = memory.snapshot();
    let frames: Vec<_> = trace
        .events
        .iter()
        .filter(|e| e.name == "frame" && e.kind == tickline::export::EventKind::SliceBegin)
        .collect();
    println!(
        "{} GPU scopes, {} lost; clock drift {:.1} ppm (truth 25), {} calibration segment(s) ({} reset reported)",
        stats.gpu_scopes,
        stats.gpu_lost_scopes,
        report.latest.drift_ppm(),
        report.stats.segments,
        report.stats.resets
    );
    for e in frames.iter().step_by(8) {
        let field = |name: &str| e.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
        let number = |name: &str| match field(name) {
            Some(FieldValue::U64(v)) => *v,
            _ => 0,
        };
        println!(
            "  frame {:>2} at {} ns ± {} ns{}",
            number("index"),
            e.ts_ns,
            number("uncertainty_ns"),
            match field(CALIBRATION_BREAK) {
                Some(FieldValue::Str(why)) => format!(" ({CALIBRATION_BREAK}: {why})"),
                _ => String::new(),
            }
        );
    }
    // The example checks itself, so CI can run it.
    assert_eq!(stats.gpu_scopes, 2 * u64::from(FRAMES), "{stats:?}");
    assert_eq!(stats.gpu_lost_scopes, 0, "{stats:?}");
    assert_eq!(frames.len(), FRAMES as usize);
    assert_eq!(report.stats.resets, 1, "{report:?}");
    assert!((report.latest.drift_ppm() - 25.0).abs() < 5.0, "{report:?}");
    for (e, &(submitted, waited)) in frames.iter().zip(&windows) {
        assert!(
            e.ts_ns >= submitted && e.ts_ns <= waited,
            "frame placed outside its submission"
        );
    }
    Ok(())
}
