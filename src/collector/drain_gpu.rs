//! The GPU's live side, run by the collector's drain stage: calibration bursts on schedule (or when the
//! processing stage asks for one), non-blocking reads of every timestamp pair a scope holds, release of a
//! pair's slots as soon as both of its ticks are read, and retirement of pairs never written. What it reads
//! goes into the input log; conversion happens later, in the processing stage (`process_gpu.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::input::{GpuInput, Input, LiveLink, PairRead};
use crate::calibration::CalibrationSample;
use crate::clock::monotonic_ns;
use crate::gpu::{pair_state, DeviceLink, GpuCalibrationConfig, GpuControl, GpuTicks};

/// Most pairs read back in one backend call.
const MAX_READ_RUN: usize = 256;

struct LiveDevice {
    device: u16,
    link: Arc<dyn DeviceLink>,
    last_burst_ns: Option<u64>,
    /// How soon the next burst is due after one that brought no sample (failed, or a submit probe still in
    /// flight behind busy queues): from `min_burst_gap`, doubled per empty burst up to `burst_period`, so a
    /// device whose clock cannot be sampled right now is tried again soon rather than a period later.
    retry_gap_ns: Option<u64>,
    /// Some burst brought a sample: the processing stage has a calibration to place scopes by.
    sampled: bool,
    /// Pairs seen allocated and not finished yet: `pair -> (generation, first seen ns)`.
    pending: HashMap<u32, (u32, u64)>,
    /// The backend's reset count last seen ([`GpuBackend::resets`](crate::gpu::GpuBackend::resets)).
    resets_seen: u64,
    /// Pairs read and released whose recycling failed: tried again every pass, free once it succeeds (a pair
    /// whose slots were not reset must not take a new scope, nor be lost for good over one failure).
    unrecycled: Vec<u32>,
}

/// Every GPU device of one timeline, as the drain stage polls them.
pub(crate) struct GpuLive {
    config: GpuCalibrationConfig,
    devices: Vec<LiveDevice>,
    samples: Vec<CalibrationSample>,
    reads: Vec<Option<GpuTicks>>,
}

impl GpuLive {
    pub(crate) fn new(config: GpuCalibrationConfig) -> Self {
        GpuLive {
            config,
            devices: Vec::new(),
            samples: Vec::new(),
            reads: Vec::new(),
        }
    }

    /// A device or queue registration: kept for polling, and passed on to the processing stage.
    pub(crate) fn register(&mut self, message: GpuControl) -> Option<GpuInput> {
        match message {
            GpuControl::Device { device, info, link } => {
                self.devices.push(LiveDevice {
                    device,
                    link: link.clone(),
                    last_burst_ns: None,
                    retry_gap_ns: None,
                    sampled: false,
                    pending: HashMap::new(),
                    resets_seen: link.resets(),
                    unrecycled: Vec::new(),
                });
                Some(GpuInput::Device {
                    device,
                    info,
                    link: LiveLink(Some(link)),
                })
            }
            GpuControl::Queue { device, queue, name } => Some(GpuInput::Queue { device, queue, name }),
        }
    }

    /// Whether any pair is still held by a scope.
    pub(crate) fn busy(&self) -> bool {
        self.devices.iter().any(|d| {
            d.link
                .pair_states()
                .iter()
                .any(|s| pair_state::is_allocated(s.load(std::sync::atomic::Ordering::Acquire)))
        })
    }

    /// One pass: calibrate where due (`force`: a flush or shutdown, unless a burst was just taken), read
    /// pairs, release what is finished, retire what is lost.
    pub(crate) fn poll(&mut self, now_ns: u64, force: bool, out: &mut Vec<Input>) {
        let config = self.config;
        for d in &mut self.devices {
            // A reset the backend knows of (a new clock epoch): the next burst starts a calibration segment.
            let resets = d.link.resets();
            if resets != d.resets_seen {
                d.resets_seen = resets;
                out.push(Input::Gpu(GpuInput::Reset { device: d.device }));
            }
            let since = d.last_burst_ns.map(|t| now_ns.saturating_sub(t));
            let gap = crate::clock::saturating_ns(config.min_burst_gap);
            let due = match since {
                None => true,
                Some(since) => {
                    since >= crate::clock::saturating_ns(config.burst_period)
                        || d.retry_gap_ns.is_some_and(|retry| since >= retry)
                        || (since >= gap && (force || d.link.take_burst_request()))
                }
            };
            if due {
                burst(d, config, &mut self.samples, out);
            }
            // The time of the read, not of the pass: a burst may have waited (the fallback probe, queued behind
            // the program's GPU work, for hundreds of ms), and a pair first seen unwritten then was timed from the
            // pass's start: a scope allocated during the wait was counted lost (and its pair retired) at the next
            // pass, before its GPU work could run.
            read_pairs(d, &mut self.reads, monotonic_ns().0.max(now_ns), config, out);
        }
    }

    /// Shutdown, after the last reads: a device never calibrated yet (no burst brought a sample) is sampled
    /// again on its retry schedule until one does or `deadline_ns` passes, so the scopes read so far have a
    /// calibration to be placed by rather than being lost for want of one. (A device with any sample is
    /// placed by its newest fit at shutdown: nothing to wait for.)
    pub(crate) fn settle_calibration(&mut self, deadline_ns: u64, out: &mut Vec<Input>) {
        for d in self.devices.iter_mut().filter(|d| !d.sampled) {
            // On the retry schedule (backing off), not faster: a driver that cannot calibrate now is not
            // hammered, and shutdown waits no longer than the deadline.
            while let (Some(gap), Some(last)) = (d.retry_gap_ns, d.last_burst_ns) {
                let due_ns = last.saturating_add(gap);
                if due_ns >= deadline_ns {
                    break;
                }
                std::thread::sleep(Duration::from_nanos(due_ns.saturating_sub(monotonic_ns().0)));
                burst(d, self.config, &mut self.samples, out);
            }
        }
    }

    /// Shutdown: every pair still held is retired, its scope lost.
    pub(crate) fn retire_in_flight(&mut self, out: &mut Vec<Input>) {
        for d in &mut self.devices {
            for (pair, state) in d.link.pair_states().iter().enumerate() {
                let state = state.load(std::sync::atomic::Ordering::Acquire);
                if pair_state::is_allocated(state) {
                    d.link.retire_pair(pair as u32);
                    out.push(Input::Gpu(GpuInput::Lost {
                        device: d.device,
                        pair: pair as u32,
                        generation: pair_state::generation(state),
                    }));
                }
            }
            d.pending.clear();
        }
    }
}

/// One calibration burst of `d`, sent to the processing stage (with what it got even when it failed: the
/// history counts it); an empty one makes the next due sooner (`retry_gap_ns`).
fn burst(d: &mut LiveDevice, config: GpuCalibrationConfig, samples: &mut Vec<CalibrationSample>, out: &mut Vec<Input>) {
    samples.clear();
    let result =
        super::drain::at_normal_priority(|| d.link.calibrate(config.burst_samples, config.burst_budget, samples));
    let at_ns = monotonic_ns().0;
    d.last_burst_ns = Some(at_ns);
    let empty = result.is_err() || samples.is_empty();
    d.sampled |= !empty;
    d.retry_gap_ns = empty.then(|| {
        let min = crate::clock::saturating_ns(config.min_burst_gap);
        let max = crate::clock::saturating_ns(config.burst_period).max(min);
        d.retry_gap_ns.map_or(min, |gap| gap.saturating_mul(2)).clamp(min, max)
    });
    out.push(Input::Gpu(GpuInput::Calibration {
        device: d.device,
        at_ns,
        samples: samples.clone(),
        failed: result.is_err(),
    }));
}

/// Reads every allocated pair of `d` (runs of consecutive pairs in one call), releases the finished ones
/// and retires the ones past the loss bound.
fn read_pairs(
    d: &mut LiveDevice,
    reads: &mut Vec<Option<GpuTicks>>,
    now_ns: u64,
    config: GpuCalibrationConfig,
    out: &mut Vec<Input>,
) {
    let link = d.link.clone();
    let states = link.pair_states();
    let lost_after = crate::clock::saturating_ns(config.lost_after);
    let mut finished = Vec::new();
    // Each failed call is counted (`GpuClockStats::read_errors`), recycles included.
    let mut failures = 0usize;
    d.unrecycled.retain(|&pair| {
        let failed = link.recycle_pair(pair).is_err();
        failures += usize::from(failed);
        failed
    });
    // A pair not read (yet): unwritten, or its read failed. Lost once it stays so for `lost_after`.
    let unread = |d: &mut LiveDevice, pair: u32, generation: u32, out: &mut Vec<Input>| {
        let seen = d.pending.entry(pair).or_insert((generation, now_ns));
        if seen.0 != generation {
            *seen = (generation, now_ns);
        }
        if now_ns.saturating_sub(seen.1) >= lost_after {
            // Never written (its commands were not submitted), or never readable: retired, not reused (a
            // late write would land in another scope).
            d.pending.remove(&pair);
            d.link.retire_pair(pair);
            out.push(Input::Gpu(GpuInput::Lost {
                device: d.device,
                pair,
                generation,
            }));
        }
    };
    let mut pair = 0usize;
    while pair < states.len() {
        let state = states[pair].load(std::sync::atomic::Ordering::Acquire);
        if !pair_state::is_allocated(state) {
            pair += 1;
            continue;
        }
        let first = pair;
        let mut generations = vec![pair_state::generation(state)];
        pair += 1;
        while pair < states.len() && pair - first < MAX_READ_RUN {
            let state = states[pair].load(std::sync::atomic::Ordering::Acquire);
            if !pair_state::is_allocated(state) {
                break;
            }
            generations.push(pair_state::generation(state));
            pair += 1;
        }
        reads.clear();
        reads.resize(2 * generations.len(), None);
        if d.link.read_timestamps(2 * first as u32, reads).is_err() {
            failures += 1;
            for (k, &generation) in generations.iter().enumerate() {
                unread(d, (first + k) as u32, generation, out);
            }
            continue;
        }
        for (k, (&generation, ticks)) in generations.iter().zip(reads.chunks_exact(2)).enumerate() {
            let pair = (first + k) as u32;
            match (ticks[0], ticks[1]) {
                (Some(begin), Some(end)) => {
                    d.pending.remove(&pair);
                    finished.push(PairRead {
                        pair,
                        generation,
                        begin,
                        end,
                    });
                }
                _ => unread(d, pair, generation, out),
            }
        }
    }
    let read_ns = monotonic_ns().0;
    for r in &finished {
        // The ticks are read: the slots can take the next scope at once.
        if d.link.release_pair(r.pair).is_err() {
            failures += 1;
            d.unrecycled.push(r.pair);
        }
    }
    for _ in 0..failures {
        out.push(Input::Gpu(GpuInput::ReadFailed { device: d.device }));
    }
    if finished.is_empty() {
        return;
    }
    out.push(Input::Gpu(GpuInput::Reads {
        device: d.device,
        read_ns,
        reads: finished,
    }));
}
