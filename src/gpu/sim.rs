//! A simulated GPU: a [`GpuBackend`] whose device clock is a [`SimClockPair`] (offset, drift, wander, read
//! jitter, outliers) running against the real `CLOCK_MONOTONIC`, and whose "work" runs on a thread per hardware
//! queue. The quickstart and the tests get GPU tracks with it on a machine with no GPU, and since the clock's
//! truth is known, so is every placement error.
//!
//! ```
//! use std::time::Duration;
//! use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
//!
//! let timeline = tickline::Timeline::builder().start().unwrap();
//! let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
//! let queue = gpu.queue("graphics").unwrap();
//! let commands = SimCommands::new();
//! {
//!     let _draw = tickline::gpu_scope!(queue, &commands, "draw");
//!     commands.work(Duration::from_micros(100));
//! }
//! gpu.backend().submit(commands).wait();
//! timeline.shutdown().unwrap();
//! ```

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::{GpuBackend, GpuDeviceInfo, GpuError, GpuTicks};
use crate::calibration::sim::{SimClockConfig, SimClockPair};
use crate::calibration::CalibrationSample;
use crate::clock::monotonic_ns;

/// What the simulated device looks like.
#[derive(Clone, Debug, PartialEq)]
pub struct SimGpuConfig {
    /// The device clock against `CLOCK_MONOTONIC`. Its `start_ns` is replaced by the time of creation.
    pub clock: SimClockConfig,
    /// Hardware queues: one worker thread each; work on different queues runs concurrently.
    pub hardware_queues: usize,
    /// Timestamp slots (even).
    pub timestamp_slots: u32,
    /// What one calibrated read costs (time spent per sample in [`GpuBackend::calibrate`]), like a real
    /// driver's `vkGetCalibratedTimestampsEXT`.
    pub read_cost: Duration,
    /// The device's name.
    pub name: String,
}

impl Default for SimGpuConfig {
    /// A GPU clock 40 ms ahead of the host, 120 ppm fast with wander, read with 1 µs jitter and 2 % outliers:
    /// harder than most real devices.
    fn default() -> Self {
        SimGpuConfig {
            clock: SimClockConfig {
                offset_ns: 40_000_000,
                drift_ppm: 120.0,
                wander_ppm_per_sqrt_s: 0.05,
                jitter_ns: 1_000.0,
                outlier_fraction: 0.02,
                outlier_ns: 30_000.0,
                ns_per_tick: 1.0,
                valid_bits: 64,
                start_ns: 0,
                seed: 0x05ee_d6a0,
            },
            hardware_queues: 1,
            timestamp_slots: 8192,
            read_cost: Duration::from_micros(2),
            name: "tickline simulated GPU".into(),
        }
    }
}

/// Not written yet.
const EMPTY: u64 = u64::MAX;

struct Device {
    clock: Mutex<SimClockPair>,
    slots: Box<[AtomicU64]>,
}

impl Device {
    /// The device clock's ticks now (real `CLOCK_MONOTONIC` time).
    fn ticks_now(&self) -> u64 {
        let now = monotonic_ns().0;
        let mut clock = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        clock.advance_to(now);
        clock.true_ticks_at(now)
    }
}

enum Command {
    Timestamp(u32),
    Work(Duration),
}

/// A list of commands for the simulated GPU: timestamps (written by [`gpu_scope!`](macro@crate::gpu_scope))
/// and busy work. Recorded on one thread, then handed to [`SimGpu::submit`].
#[derive(Default)]
pub struct SimCommands {
    commands: RefCell<Vec<Command>>,
}

impl std::fmt::Debug for SimCommands {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCommands")
            .field("commands", &self.commands.borrow().len())
            .finish()
    }
}

impl SimCommands {
    /// An empty command list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds work that keeps the queue busy for `duration`.
    pub fn work(&self, duration: Duration) {
        self.commands.borrow_mut().push(Command::Work(duration));
    }

    /// Commands recorded so far.
    pub fn len(&self) -> usize {
        self.commands.borrow().len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.commands.borrow().is_empty()
    }
}

struct Job {
    commands: Vec<Command>,
    done: Arc<Done>,
}

#[derive(Default)]
struct Done {
    finished: Mutex<Option<(u64, u64)>>,
    signal: Condvar,
}

/// A submission: [`wait`](Self::wait) blocks until the GPU ran it.
#[must_use = "a submission's window is known only after `wait`"]
#[derive(Clone)]
pub struct SimSubmission {
    done: Arc<Done>,
}

impl std::fmt::Debug for SimSubmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimSubmission").finish_non_exhaustive()
    }
}

impl SimSubmission {
    /// Waits until the queue has run every command; returns the `CLOCK_MONOTONIC` ns at which the queue
    /// started and finished it.
    pub fn wait(&self) -> (u64, u64) {
        let mut finished = self.done.finished.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(window) = *finished {
                return window;
            }
            finished = self.done.signal.wait(finished).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The simulated GPU. See the [module docs](self).
pub struct SimGpu {
    device: Arc<Device>,
    queues: Vec<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    config: SimGpuConfig,
}

impl std::fmt::Debug for SimGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimGpu").field("config", &self.config).finish()
    }
}

impl SimGpu {
    /// Starts the device: its clock begins now, one worker thread per hardware queue.
    pub fn new(config: SimGpuConfig) -> Result<SimGpu, GpuError> {
        let invalid = |detail: String| GpuError::Invalid { detail };
        if config.hardware_queues == 0 {
            return Err(invalid("a simulated GPU needs at least one hardware queue".into()));
        }
        // At most what a timeline takes (2 Mi): beyond it the slot array alone was a process-ending
        // allocation (34 GB for u32::MAX - 1) before `Timeline::gpu` could refuse it.
        if config.timestamp_slots < 2 || config.timestamp_slots % 2 != 0 || config.timestamp_slots > 1 << 21 {
            return Err(invalid(format!(
                "timestamp_slots must be even and in 2..=2097152, not {}",
                config.timestamp_slots
            )));
        }
        let clock_config = config.clock.with_start_ns(monotonic_ns().0);
        let mut clock = SimClockPair::new(clock_config).map_err(|e| invalid(format!("simulated clock: {e}")))?;
        // The worker asks for "now" only; keep a minute of wander history so memory stays bounded.
        clock.set_knot_retention_ns(Some(60_000_000_000));
        let device = Arc::new(Device {
            clock: Mutex::new(clock),
            slots: (0..config.timestamp_slots).map(|_| AtomicU64::new(EMPTY)).collect(),
        });
        let mut queues = Vec::new();
        let mut workers = Vec::new();
        for index in 0..config.hardware_queues {
            let (tx, rx) = crossbeam_channel::unbounded();
            let device = device.clone();
            let worker = std::thread::Builder::new()
                .name(format!("sim-gpu-queue-{index}"))
                .spawn(move || run_queue(&device, &rx))
                .map_err(|e| GpuError::Api {
                    call: "std::thread::spawn",
                    detail: e.to_string(),
                })?;
            queues.push(tx);
            workers.push(worker);
        }
        Ok(SimGpu {
            device,
            queues,
            workers,
            config,
        })
    }

    /// Submits `commands` to hardware queue 0.
    pub fn submit(&self, commands: SimCommands) -> SimSubmission {
        self.submit_to(0, commands)
    }

    /// Submits `commands` to hardware queue `queue` (modulo the number of queues).
    pub fn submit_to(&self, queue: usize, commands: SimCommands) -> SimSubmission {
        let done = Arc::new(Done::default());
        let job = Job {
            commands: commands.commands.into_inner(),
            done: done.clone(),
        };
        // The worker lives as long as `self`.
        let _ = self.queues[queue % self.queues.len()].send(job);
        SimSubmission { done }
    }

    /// The device clock's true ticks at `CLOCK_MONOTONIC` time `reference_ns` (at most a minute back).
    pub fn true_ticks_at(&self, reference_ns: u64) -> GpuTicks {
        let mut clock = self.device.clock.lock().unwrap_or_else(|e| e.into_inner());
        GpuTicks(clock.true_ticks_at(reference_ns))
    }

    /// The `CLOCK_MONOTONIC` time at which the device clock showed `ticks` (at most a minute back).
    pub fn true_reference_ns(&self, ticks: GpuTicks) -> u64 {
        let now = monotonic_ns().0;
        let mut clock = self.device.clock.lock().unwrap_or_else(|e| e.into_inner());
        clock.advance_to(now);
        clock.true_reference_ns(ticks.0)
    }

    /// The configuration it runs.
    pub fn config(&self) -> &SimGpuConfig {
        &self.config
    }
}

impl Drop for SimGpu {
    fn drop(&mut self) {
        self.queues.clear();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn run_queue(device: &Device, jobs: &Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        let started = monotonic_ns().0;
        for command in job.commands {
            match command {
                Command::Timestamp(slot) => {
                    let ticks = device.ticks_now();
                    device.slots[slot as usize].store(ticks, Ordering::Release);
                }
                Command::Work(duration) => busy(duration),
            }
        }
        let finished = monotonic_ns().0;
        *job.done.finished.lock().unwrap_or_else(|e| e.into_inner()) = Some((started, finished));
        job.done.signal.notify_all();
    }
}

/// Keeps the queue busy for `duration`: sleeps through most of a long wait, spins the rest.
fn busy(duration: Duration) {
    let until = Instant::now() + duration;
    if duration > Duration::from_millis(2) {
        std::thread::sleep(duration - Duration::from_millis(1));
    }
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

impl SimGpu {
    /// Slots `first..first + count`, or an error naming the range.
    fn slots(&self, first: u32, count: usize) -> Result<&[AtomicU64], GpuError> {
        let end = first as usize + count;
        self.device
            .slots
            .get(first as usize..end)
            .ok_or_else(|| GpuError::Invalid {
                detail: format!("slots {first}..{end} past {}", self.device.slots.len()),
            })
    }
}

impl GpuBackend for SimGpu {
    type Commands = SimCommands;

    fn info(&self) -> GpuDeviceInfo {
        let clock = self.device.clock.lock().unwrap_or_else(|e| e.into_inner());
        GpuDeviceInfo {
            name: self.config.name.clone(),
            api: "simulated",
            clock: clock.domain(),
            timestamp_slots: self.config.timestamp_slots,
        }
    }

    #[inline]
    fn write_timestamp(&self, commands: &SimCommands, slot: u32) {
        commands.commands.borrow_mut().push(Command::Timestamp(slot));
    }

    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        let slots = self.slots(first, out.len())?;
        for (value, slot) in out.iter_mut().zip(slots) {
            let ticks = slot.load(Ordering::Acquire);
            *value = (ticks != EMPTY).then_some(GpuTicks(ticks));
        }
        Ok(())
    }

    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        for slot in self.slots(first, count as usize)? {
            slot.store(EMPTY, Ordering::Release);
        }
        Ok(())
    }

    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        let started = Instant::now();
        for _ in 0..samples {
            if started.elapsed() >= budget {
                break;
            }
            let sample = {
                let now = monotonic_ns().0;
                let mut clock = self.device.clock.lock().unwrap_or_else(|e| e.into_inner());
                clock.advance_to(now);
                clock.sample()
            };
            out.push(sample);
            busy(self.config.read_cost);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_follow_the_simulated_clock() {
        let gpu = SimGpu::new(SimGpuConfig::default()).unwrap();
        let commands = SimCommands::new();
        gpu.write_timestamp(&commands, 0);
        commands.work(Duration::from_micros(300));
        gpu.write_timestamp(&commands, 1);
        let mut out = [None; 2];
        gpu.read_timestamps(0, &mut out).unwrap();
        assert_eq!(out, [None, None], "nothing runs before submit");
        let (started, finished) = gpu.submit(commands).wait();
        gpu.read_timestamps(0, &mut out).unwrap();
        let (begin, end) = (out[0].unwrap(), out[1].unwrap());
        let (b, e) = (gpu.true_reference_ns(begin), gpu.true_reference_ns(end));
        assert!(started <= b && b <= e && e <= finished, "{started} {b} {e} {finished}");
        assert!(e - b >= 300_000, "the work took {} ns", e - b);
        gpu.recycle(0, 2).unwrap();
        gpu.read_timestamps(0, &mut out).unwrap();
        assert_eq!(out, [None, None]);
    }

    #[test]
    fn calibration_stays_within_its_budget() {
        let gpu = SimGpu::new(SimGpuConfig {
            read_cost: Duration::from_millis(1),
            ..Default::default()
        })
        .unwrap();
        let mut out = Vec::new();
        let started = Instant::now();
        gpu.calibrate(1_000, Duration::from_millis(5), &mut out).unwrap();
        assert!(started.elapsed() < Duration::from_millis(50));
        assert!(!out.is_empty() && out.len() < 20, "{} samples", out.len());
    }

    #[test]
    fn bad_configs_are_errors() {
        for config in [
            SimGpuConfig {
                hardware_queues: 0,
                ..Default::default()
            },
            SimGpuConfig {
                timestamp_slots: 3,
                ..Default::default()
            },
        ] {
            assert!(matches!(SimGpu::new(config), Err(GpuError::Invalid { .. })));
        }
    }
}
