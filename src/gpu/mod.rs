//! GPU timelines: the [`GpuBackend`] trait every GPU API implements, the [`gpu_scope!`](macro@crate::gpu_scope)
//! guard, and the handles a program keeps ([`GpuDevice`], [`GpuQueue`]).
//!
//! A GPU scope writes two device timestamps into a command stream (a Vulkan command buffer, a CUDA stream, a
//! simulated command list): the begin when the scope opens, the end when its guard drops. The recording thread
//! also pushes one record group into its CPU ring: the CPU tick at which the scope was recorded, the call site,
//! the timestamp pair and optional fields. The collector thread polls the backend for finished timestamps
//! (never blocking the app), converts them with the device clock's live calibration history, holds each slice
//! until a calibration point after it exists (or a latency bound passes), and exports it on the queue's track
//! with its uncertainty and a flow from the CPU code that recorded it.
//!
//! Timestamp slots come in pairs (`2k` begin, `2k + 1` end). A backend owns `timestamp_slots` slots (a Vulkan
//! query pool, an array of device words); tickline hands pairs out, reads them back and recycles them.

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cupti")]
pub mod cupti;
pub(crate) mod lanes;
mod sanity;
pub mod sim;
pub(crate) mod tracker;
#[cfg(feature = "vulkan")]
pub mod vulkan;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use sanity::{SliceMarks, CALIBRATION_BREAK, GPU_SCOPE_LOST, QUEUE_CALIBRATION};
pub use tracker::GpuCalibrationConfig;
pub use tracker::GpuClockStats;
#[doc(hidden)]
pub use tracker::{GpuClockTracker, GpuScopeTicks, GpuSlicePlacement};

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use crate::calibration::{CalibrationSample, ClockCalibration, ClockDomain, HistoryStats};
use crate::callsite::NativeCallsite;
use crate::codec::FieldEncoder;
pub use crate::error::GpuError;
use crate::recorder::{self, Shared};
use crossbeam_channel::Sender;

/// Raw device-clock ticks, as a GPU timestamp query returns them (masked to the clock's valid bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuTicks(pub u64);

/// What a backend says about its device.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuDeviceInfo {
    /// The device's name, as its driver reports it.
    pub name: String,
    /// The API: "Vulkan", "CUDA", "simulated"...
    pub api: &'static str,
    /// The device clock: valid bits and nominal ns per tick (Vulkan's `timestampPeriod`).
    pub clock: ClockDomain,
    /// How many timestamp slots the backend holds: each scope uses two while in flight (an odd last slot
    /// stays unused), and a device may have at most 2 Mi (2^21; [`Timeline::gpu`](crate::Timeline::gpu)
    /// refuses more).
    pub timestamp_slots: u32,
}

/// A GPU API as tickline drives it. Implemented by [`sim::SimGpu`] and the `vulkan`, `cuda` and `wgpu`
/// backends; implement it for another API (Metal, D3D12, a custom clock) to put its work on the timeline.
/// `examples/custom_gpu_backend.rs` is a complete one to start from.
///
/// # The contract
///
/// **Slots and pairs.** A backend owns `info().timestamp_slots` timestamp slots (a query pool, an array of
/// device words, a counter-sample buffer). tickline hands them out in pairs: a scope writes slot `2k` when it
/// opens and `2k + 1` when it closes, and only one scope holds a pair at a time. A slot is written once between
/// two [`recycle`](Self::recycle)s of it. tickline returns a pair to its free list as soon as both values have
/// been read (not when the slice is exported), and retires (never reuses) a pair whose timestamps were never
/// written within `lost_after` (its commands were never submitted: a late write would corrupt a newer scope).
/// So at most `timestamp_slots / 2` scopes are in flight; a scope that finds no free pair is not recorded and is
/// counted ([`GpuDevice::starved_scopes`]).
///
/// **Reading.** [`read_timestamps`](Self::read_timestamps) must never wait for the GPU: a slot the GPU has not
/// written yet reads `None` (Vulkan: `VK_NOT_READY` without `WAIT`; an availability bit; a sentinel value). A
/// written slot reads its raw ticks **masked to `info().clock.valid_bits()`** (Vulkan's `timestampValidBits`:
/// the bits above are undefined); tickline unwraps a counter that wraps. An `Err` means the read failed as a
/// whole and nothing in `out` is used: the collector counts it ([`GpuClockStats::read_errors`]) and reads the
/// same slots again on its next pass; a scope whose read keeps failing is counted lost after `lost_after`.
/// Errors are never ignored, and never a reason to report `None` for a slot that was written.
///
/// **Recycling.** After [`recycle`](Self::recycle)`(first, count)` returns `Ok`, reading those slots must give
/// `None` until the GPU writes them again (a host query reset, zeroing a word): a stale value read as a new one
/// would place a scope at the time of an old one. tickline recycles only slots whose values it has read, or
/// that it will never read again. An `Err` is counted ([`GpuClockStats::read_errors`]) and the recycle tried
/// again every pass; the pair takes no scope until one succeeds.
///
/// **The clock.** [`calibrate`](Self::calibrate) brackets each read of the device clock between two reads of
/// `CLOCK_MONOTONIC` ([`CalibrationSample::from_bracket`]`(ticks, before, after)`): a wide bracket is fine, an
/// dishonest one (a midpoint the read may lie outside of by more than half the width) is not. Report the plain
/// bracket of the read. A counter that changes less often than it ticks (CUDA's `%globaltimer`: 1 ns ticks,
/// updated every 32 ns to 1 µs) declares that in `info().clock` with
/// [`ClockDomain::with_resolution_ns`], measured where the backend can (as the CUDA backend does), the
/// documented figure otherwise; tickline then widens every bracket by half the resolution on both sides and
/// adds half of it to every conversion. Do not widen brackets yourself: widening only one side biases every
/// event by half the resolution. A burst must return within about its `budget`, with whatever samples it took;
/// an `Err` is counted as a failed calibration and the burst is retried next period.
///
/// **Resets.** When the backend knows the device clock was reset (a device lost and recreated, a counter
/// restarted by power management, a new epoch), it increments the count [`resets`](Self::resets) returns: the
/// next calibration burst starts a new calibration segment, and no sample from before the reset is used after
/// it. Jumps and rate steps the backend does not know of are detected from the samples (a burst that disagrees
/// with the prediction beyond its brackets), and a queue whose timestamps disagree with the device calibration
/// (another epoch) is caught by the both-sided check of every slice (begun after the CPU recorded it, ended
/// before the collector read it back) and gets a calibration of its own.
///
/// **Threads.** [`write_timestamp`](Self::write_timestamp) runs on the application's threads, several at once
/// for different command streams: it must not block, allocate on the hot path, or fail loudly; a write that
/// cannot be recorded leaves its slot unwritten (the scope is then counted lost), never a panic. Everything
/// else runs on tickline's background thread, one call at a time per device; the backend is `Send + Sync`
/// because that thread is not the one that created it.
pub trait GpuBackend: Send + Sync + 'static {
    /// What a scope's timestamps are written into: a command buffer, a stream, a command list.
    type Commands: ?Sized;

    /// The device and its clock (valid bits, nominal tick period, update resolution). Called once, when the
    /// device joins a timeline.
    fn info(&self) -> GpuDeviceInfo;

    /// Records a command that writes the device clock into timestamp `slot` when the GPU reaches it.
    /// `slot < info().timestamp_slots`, and the slot was recycled since it was last written. The hot path: no
    /// blocking, no allocation, no failure (see the [contract](GpuBackend#the-contract)).
    fn write_timestamp(&self, commands: &Self::Commands, slot: u32);

    /// Reads finished timestamps of slots `first..first + out.len()` without waiting: `Some(raw ticks)`, masked
    /// to the valid bits, where the GPU has written the slot, `None` where it has not yet. An `Err` is counted
    /// and the read retried (see the [contract](GpuBackend#the-contract)).
    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError>;

    /// Makes slots `first..first + count` writable again (a host query reset, or nothing); afterwards they read
    /// `None` until written again.
    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError>;

    /// Takes up to `samples` calibration samples of the device clock against `CLOCK_MONOTONIC`
    /// (`(device ticks, reference ns, max deviation ns)`, each the plain bracket of one read), appending them to
    /// `out`. Must return within about `budget` even if fewer samples were taken: the collector never waits
    /// unbounded for a tight sample.
    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError>;

    /// How many times the device clock is known to have been reset since the backend was created (0 when it
    /// cannot know: the default). Each increase starts a new calibration segment at the next burst.
    fn resets(&self) -> u64 {
        0
    }

    /// Whether a timestamp written after its scope was given up as lost can never land in a later scope's
    /// slots: the backend writes slots itself and checks who holds the pair first, under the lock its
    /// [`recycle`](Self::recycle) takes. Then a lost scope's pair is recycled and used again; otherwise
    /// (the default: a GPU may still write a command submitted long ago) it is retired for good.
    fn guards_late_writes(&self) -> bool {
        false
    }
}

/// GPU registrations, sent to the collector over the timeline's GPU channel (the collector's `Inbox`).
pub(crate) enum GpuControl {
    /// A device joined the timeline.
    Device {
        device: u16,
        info: GpuDeviceInfo,
        link: Arc<dyn DeviceLink>,
    },
    /// A queue of a device was named.
    Queue { device: u16, queue: u16, name: String },
}

/// The collector's view of a device: everything but writing timestamps, object-safe.
pub(crate) trait DeviceLink: Send + Sync {
    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError>;
    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError>;
    /// Recycles pair `pair` (both its ticks were read) and makes it available to scopes again. On an `Err`
    /// the pair is out of scopes' reach (no longer held) but not free: [`recycle_pair`](Self::recycle_pair)
    /// tries again.
    fn release_pair(&self, pair: u32) -> Result<(), GpuError>;
    /// Recycles a released pair whose recycling failed, and frees it once that succeeds.
    fn recycle_pair(&self, pair: u32) -> Result<(), GpuError>;
    /// Takes pair `pair` out of use for good (it was never written; a late write must not hit a new scope), or
    /// recycles it where the backend guards late writes ([`GpuBackend::guards_late_writes`]).
    fn retire_pair(&self, pair: u32);
    /// Every pair's state (see [`pair_state`]).
    fn pair_states(&self) -> &[AtomicU32];
    /// Asks for a calibration burst soon (the processing stage found the fit too uncertain, or a slice
    /// outside what the CPU knows).
    fn request_burst(&self);
    /// Whether a burst was asked for since the last call.
    fn take_burst_request(&self) -> bool;
    /// The collector's newest calibration of the device clock, for [`GpuDevice::calibration`].
    fn publish(&self, calibration: GpuCalibrationReport);
    /// [`GpuBackend::resets`].
    fn resets(&self) -> u64;
}

/// A timestamp pair's state word: whether a scope holds it, and how many times it has been handed out
/// (so a read is matched to the scope that wrote it, never to an earlier or later user of the pair).
pub(crate) mod pair_state {
    /// A scope holds the pair (handed out, not read back yet).
    pub(crate) const ALLOCATED: u32 = 1 << 31;
    /// The pair was never written within the loss bound and is out of use for good.
    pub(crate) const RETIRED: u32 = 1 << 30;
    /// Bits of the use count kept (it travels in a scope key).
    pub(crate) const GENERATION_MASK: u32 = (1 << super::GENERATION_BITS) - 1;

    pub(crate) fn is_allocated(state: u32) -> bool {
        state & ALLOCATED != 0
    }

    pub(crate) fn generation(state: u32) -> u32 {
        state & GENERATION_MASK
    }
}

/// How well the collector knows a device's clock: its newest fit, the history's counters (breaks, resets,
/// measured wander) and the placements' (marked slices, window violations, queues on their own calibration,
/// failed reads), as of the newest burst.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuCalibrationReport {
    /// The newest fit (drift, offset, error bound, sample count, when).
    pub latest: ClockCalibration,
    /// Bursts, samples, rejections, segments, breaks, resets, and the figures of the newest fit.
    pub stats: HistoryStats,
    /// Slices placed and marked, window violations, bursts they asked for, own calibrations, read errors.
    pub placements: GpuClockStats,
}

/// State shared by a device's handles and the collector.
struct DeviceShared<B: GpuBackend> {
    backend: B,
    timeline: Arc<Shared>,
    device: u16,
    info: GpuDeviceInfo,
    free_pairs: ArrayQueue<u32>,
    /// Per pair: [`pair_state`].
    pairs: Box<[AtomicU32]>,
    burst_requested: AtomicBool,
    /// Scopes that found no free pair.
    starved: AtomicU64,
    queue_names: Mutex<Vec<String>>,
    calibration: Mutex<Option<GpuCalibrationReport>>,
    /// The timeline's GPU channel, for queue registrations.
    registrations: Sender<GpuControl>,
}

#[cfg(feature = "cupti")]
impl<B: GpuBackend> DeviceShared<B> {
    /// Pair `pair`'s state word (0 for a pair the device does not have).
    fn pair_state(&self, pair: u32) -> u32 {
        self.pairs.get(pair as usize).map_or(0, |s| s.load(Ordering::Acquire))
    }
}

impl<B: GpuBackend> DeviceLink for DeviceShared<B> {
    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        self.backend.read_timestamps(first, out)
    }
    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        self.backend.calibrate(samples, budget, out)
    }
    fn release_pair(&self, pair: u32) -> Result<(), GpuError> {
        let state = &self.pairs[pair as usize];
        // Release: the scope's use of the pair is over before the free list hands it out again.
        state.store(pair_state::generation(state.load(Ordering::Relaxed)), Ordering::Release);
        self.recycle_pair(pair)
    }
    fn recycle_pair(&self, pair: u32) -> Result<(), GpuError> {
        self.backend.recycle(2 * pair, 2)?;
        // Cannot fail: the queue holds every pair, and each pair is in at most one place at a time.
        let _ = self.free_pairs.push(pair);
        Ok(())
    }
    fn retire_pair(&self, pair: u32) {
        if self.backend.guards_late_writes() {
            // A late write is refused by the backend: the pair can serve again. If recycling fails, the pair is
            // out of use (neither held nor free), as a retired one is.
            let _ = self.release_pair(pair);
            return;
        }
        let state = &self.pairs[pair as usize];
        state.store(
            pair_state::RETIRED | pair_state::generation(state.load(Ordering::Relaxed)),
            Ordering::Release,
        );
    }
    fn pair_states(&self) -> &[AtomicU32] {
        &self.pairs
    }
    fn request_burst(&self) {
        self.burst_requested.store(true, Ordering::Relaxed);
    }
    fn take_burst_request(&self) -> bool {
        self.burst_requested.swap(false, Ordering::Relaxed)
    }
    fn publish(&self, calibration: GpuCalibrationReport) {
        *self.calibration.lock().unwrap_or_else(|e| e.into_inner()) = Some(calibration);
    }
    fn resets(&self) -> u64 {
        self.backend.resets()
    }
}

/// Most devices one process can register (device ids are 16 bits in a scope's record).
const MAX_DEVICES: u64 = u16::MAX as u64;
/// Most queues per device (queue ids are 16 bits in a scope's record).
const MAX_QUEUES: usize = u16::MAX as usize;

static NEXT_DEVICE: AtomicU64 = AtomicU64::new(0);

/// Where GPU devices join a timeline: implemented by [`Timeline`](crate::Timeline) alone (sealed). GPU code
/// that starts on its own (the CUPTI capture of feature `cupti`) takes one, so the GPU layer needs nothing of
/// the timeline's.
pub trait GpuTimeline: sealed::Sealed {
    /// [`Timeline::gpu`](crate::Timeline::gpu).
    fn add_gpu<B: GpuBackend>(&self, backend: B) -> Result<GpuDevice<B>, crate::TicklineError>;
}

pub(crate) mod sealed {
    /// Only the crate implements [`super::GpuTimeline`].
    pub trait Sealed {}
}

/// A GPU device on a [`crate::Timeline`]: made by [`crate::Timeline::gpu`]. Cheap to clone.
pub struct GpuDevice<B: GpuBackend> {
    shared: Arc<DeviceShared<B>>,
}

impl<B: GpuBackend> Clone for GpuDevice<B> {
    fn clone(&self) -> Self {
        GpuDevice {
            shared: self.shared.clone(),
        }
    }
}

impl<B: GpuBackend> fmt::Debug for GpuDevice<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuDevice")
            .field("name", &self.shared.info.name)
            .field("api", &self.shared.info.api)
            .finish()
    }
}

impl<B: GpuBackend> GpuDevice<B> {
    pub(crate) fn register(
        timeline: &Arc<Shared>,
        registrations: &Sender<GpuControl>,
        backend: B,
    ) -> Result<Self, crate::TicklineError> {
        let info = backend.info();
        let pairs = info.timestamp_slots / 2;
        if pairs == 0 {
            return Err(GpuError::Invalid {
                detail: format!(
                    "{} reports {} timestamp slots; a scope needs 2",
                    info.name, info.timestamp_slots
                ),
            }
            .into());
        }
        let device = NEXT_DEVICE.fetch_add(1, Ordering::Relaxed);
        if device >= MAX_DEVICES {
            return Err(GpuError::Invalid {
                detail: format!("more than {MAX_DEVICES} GPU devices registered in this process"),
            }
            .into());
        }
        if pairs > MAX_PAIRS {
            return Err(GpuError::Invalid {
                detail: format!(
                    "{} reports {} timestamp slots; tickline uses at most {}",
                    info.name,
                    info.timestamp_slots,
                    2 * MAX_PAIRS
                ),
            }
            .into());
        }
        let free_pairs = ArrayQueue::new(pairs as usize);
        for pair in 0..pairs {
            let _ = free_pairs.push(pair);
        }
        let shared = Arc::new(DeviceShared {
            backend,
            timeline: timeline.clone(),
            device: device as u16,
            info: info.clone(),
            free_pairs,
            pairs: (0..pairs).map(|_| AtomicU32::new(0)).collect(),
            burst_requested: AtomicBool::new(false),
            starved: AtomicU64::new(0),
            queue_names: Mutex::new(Vec::new()),
            calibration: Mutex::new(None),
            registrations: registrations.clone(),
        });
        let link: Arc<dyn DeviceLink> = shared.clone();
        registrations
            .send(GpuControl::Device {
                device: device as u16,
                info,
                link,
            })
            .map_err(|_| crate::TicklineError::CollectorGone)?;
        if let Some(drain) = timeline.drain_thread.get() {
            drain.unpark();
        }
        Ok(GpuDevice { shared })
    }

    /// The backend (to submit work, create command lists...).
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// What the backend said about the device.
    pub fn info(&self) -> &GpuDeviceInfo {
        &self.shared.info
    }

    /// A queue (or stream) of this device, shown as its own track under the device's track. Scopes recorded
    /// through it land on that track. Calling it twice with one name gives the same queue.
    pub fn queue(&self, name: &str) -> Result<GpuQueue<B>, crate::TicklineError> {
        let mut names = self.shared.queue_names.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(index) = names.iter().position(|n| n == name) {
            return Ok(GpuQueue {
                shared: self.shared.clone(),
                queue: index as u16,
            });
        }
        if names.len() >= MAX_QUEUES {
            return Err(GpuError::Invalid {
                detail: format!("more than {MAX_QUEUES} queues on one device"),
            }
            .into());
        }
        let queue = names.len() as u16;
        self.shared
            .registrations
            .send(GpuControl::Queue {
                device: self.shared.device,
                queue,
                name: name.to_owned(),
            })
            .map_err(|_| crate::TicklineError::CollectorGone)?;
        names.push(name.to_owned());
        Ok(GpuQueue {
            shared: self.shared.clone(),
            queue,
        })
    }

    /// The collector's newest calibration of this device's clock (drift, error bound, max deviation of the
    /// samples used...), or `None` before the first fit.
    pub fn calibration(&self) -> Option<GpuCalibrationReport> {
        self.shared
            .calibration
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Scopes not recorded because every timestamp pair was in flight (also counted in the timeline's
    /// dropped records).
    pub fn starved_scopes(&self) -> u64 {
        self.shared.starved.load(Ordering::Relaxed)
    }

    /// Pair `pair`'s state word (held or not, and its use count): a backend that writes a pair's slots later
    /// checks that the pair still belongs to the scope it was handed out for.
    #[cfg(feature = "cupti")]
    pub(crate) fn pair_state(&self, pair: u32) -> u32 {
        self.shared.pair_state(pair)
    }

    /// Counts `n` records lost outside tickline (a backend's own buffers) in the timeline's dropped records.
    #[cfg(feature = "cupti")]
    pub(crate) fn count_dropped(&self, n: usize) {
        recorder::count_drop(&self.shared.timeline, n);
    }
}

/// A queue or stream of a [`GpuDevice`]: what [`gpu_scope!`](macro@crate::gpu_scope) records into.
pub struct GpuQueue<B: GpuBackend> {
    shared: Arc<DeviceShared<B>>,
    queue: u16,
}

impl<B: GpuBackend> Clone for GpuQueue<B> {
    fn clone(&self) -> Self {
        GpuQueue {
            shared: self.shared.clone(),
            queue: self.queue,
        }
    }
}

impl<B: GpuBackend> fmt::Debug for GpuQueue<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuQueue")
            .field("device", &self.shared.info.name)
            .field("queue", &self.queue)
            .finish()
    }
}

impl<B: GpuBackend> GpuQueue<B> {
    /// The backend (to submit work).
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// The queue's index within its device (in order of [`GpuDevice::queue`] calls).
    pub fn index(&self) -> u16 {
        self.queue
    }

    /// [`GpuDevice::pair_state`] of this queue's device: the word a pair [`begin_external`](Self::begin_external)
    /// just handed out holds, for the caller's later check.
    #[cfg(feature = "cupti")]
    pub(crate) fn pair_state(&self, pair: u32) -> u32 {
        self.shared.pair_state(pair)
    }

    /// Opens a scope whose timestamps the caller writes, for APIs that cannot go through
    /// [`GpuBackend::write_timestamp`]: wgpu's encoders and passes record through `&mut`, and a pass's
    /// boundary timestamps are written by the pass itself. Takes a free pair, calls `write_begin(pair)`, and
    /// pushes the scope's begin record, as [`GpuScope::begin`] does; `None` (counted as starved and dropped)
    /// when no pair is free. The caller writes slots `2 * pair` (begin) and `2 * pair + 1` (end).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cupti")), allow(dead_code))]
    #[inline]
    pub(crate) fn begin_external(
        &self,
        callsite: &'static NativeCallsite,
        fields: Option<&dyn Fn(&mut GpuFieldEncoder<'_, '_>)>,
        write_begin: impl FnOnce(u32),
    ) -> Option<u32> {
        self.open_pair(callsite, fields, write_begin)
    }

    /// Takes a free timestamp pair, marks it held, has `write_begin` write its begin slot (`2 * pair`) and
    /// records the scope's begin group. `None` when every pair is in flight (counted as starved and dropped).
    #[inline]
    fn open_pair(
        &self,
        callsite: &'static NativeCallsite,
        fields: Option<&dyn Fn(&mut GpuFieldEncoder<'_, '_>)>,
        write_begin: impl FnOnce(u32),
    ) -> Option<u32> {
        let shared = &*self.shared;
        let Some(pair) = shared.free_pairs.pop() else {
            shared.starved.fetch_add(1, Ordering::Relaxed);
            recorder::count_drop(&shared.timeline, 1);
            return None;
        };
        let state = &shared.pairs[pair as usize];
        let generation = pair_state::generation(state.load(Ordering::Relaxed).wrapping_add(1));
        // Release: marks the pair held before its timestamps can be written; the drain stage's Acquire load
        // reads it, and reads the pair only while it is held.
        state.store(pair_state::ALLOCATED | generation, Ordering::Release);
        // The CPU's time of the scope, read before the begin timestamp is written: a backend whose write
        // runs at once (CUDA launches its stamp immediately) must not stamp the GPU begin before it.
        let ticks = shared.timeline.source.read().0;
        write_begin(pair);
        let key = scope_key(shared.device, self.queue, pair, generation);
        let encode = fields.map(|f| move |encoder: &mut FieldEncoder<'_>| f(&mut GpuFieldEncoder { inner: encoder }));
        // If the record is dropped (full ring) the pair is still read back and released by the drain stage:
        // its read then matches no scope.
        recorder::gpu_begin(&shared.timeline, ticks, callsite, key, encode);
        Some(pair)
    }
}

/// Bits of a pair's use count kept in a scope key.
const GENERATION_BITS: u32 = 12;
/// Bits of a pair index in a scope key: at most 2^20 pairs (2 Mi timestamp slots) per device.
const PAIR_BITS: u32 = 20;
const MAX_PAIRS: u32 = 1 << PAIR_BITS;

/// The key a scope's record carries: device, queue, timestamp pair and the pair's use count.
#[inline]
pub(crate) fn scope_key(device: u16, queue: u16, pair: u32, generation: u32) -> u64 {
    (u64::from(device) << 48)
        | (u64::from(queue) << 32)
        | (u64::from(generation & pair_state::GENERATION_MASK) << PAIR_BITS)
        | u64::from(pair & (MAX_PAIRS - 1))
}

/// Splits a [`scope_key`]: `(device, queue, pair, generation)`.
#[inline]
pub(crate) fn split_key(key: u64) -> (u16, u16, u32, u32) {
    (
        (key >> 48) as u16,
        (key >> 32) as u16,
        key as u32 & (MAX_PAIRS - 1),
        (key as u32 >> PAIR_BITS) & pair_state::GENERATION_MASK,
    )
}

/// An open GPU scope: the end timestamp is written into the same command stream when this guard drops.
///
/// Not `Send`: the end must be written by the thread that records the command stream, as the begin was.
///
/// ```compile_fail
/// # use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
/// # let timeline = tickline::Timeline::builder().start().unwrap();
/// # let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
/// # let queue = gpu.queue("compute").unwrap();
/// # let commands = SimCommands::new();
/// fn needs_send<T: Send>(_: T) {}
/// needs_send(tickline::gpu_scope!(queue, &commands, "x"));
/// ```
#[must_use = "the GPU scope ends when this guard is dropped"]
pub struct GpuScope<'a, B: GpuBackend> {
    queue: &'a GpuQueue<B>,
    commands: &'a B::Commands,
    /// The timestamp pair, or `u32::MAX` when the scope is not recorded (no free pair, or no timeline).
    pair: u32,
    _not_send: PhantomData<*const ()>,
}

impl<B: GpuBackend> fmt::Debug for GpuScope<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuScope").field("pair", &self.pair).finish()
    }
}

const NO_PAIR: u32 = u32::MAX;

impl<'a, B: GpuBackend> GpuScope<'a, B> {
    /// Opens a scope. Use [`gpu_scope!`](macro@crate::gpu_scope).
    #[doc(hidden)]
    #[inline]
    pub fn begin(
        queue: &'a GpuQueue<B>,
        commands: &'a B::Commands,
        callsite: &'static NativeCallsite,
        fields: Option<&dyn Fn(&mut GpuFieldEncoder<'_, '_>)>,
    ) -> Self {
        let pair = queue
            .open_pair(callsite, fields, |pair| {
                queue.shared.backend.write_timestamp(commands, 2 * pair)
            })
            .unwrap_or(NO_PAIR);
        GpuScope {
            queue,
            commands,
            pair,
            _not_send: PhantomData,
        }
    }
}

impl<B: GpuBackend> Drop for GpuScope<'_, B> {
    #[inline]
    fn drop(&mut self) {
        if self.pair != NO_PAIR {
            self.queue
                .shared
                .backend
                .write_timestamp(self.commands, 2 * self.pair + 1);
        }
    }
}

/// Encodes a GPU scope's fields. Used by [`gpu_scope!`](macro@crate::gpu_scope).
#[doc(hidden)]
pub struct GpuFieldEncoder<'a, 'b> {
    inner: &'a mut FieldEncoder<'b>,
}

/// A value a [`gpu_scope!`](macro@crate::gpu_scope) field can take: integers, floats, `bool`, strings.
pub trait GpuFieldValue {
    /// Writes the value as field `index`.
    #[doc(hidden)]
    fn encode(&self, index: u8, encoder: &mut GpuFieldEncoder<'_, '_>);
}

macro_rules! field_value {
    ($method:ident as $target:ty: $($t:ty),*) => {$(
        impl GpuFieldValue for $t {
            #[inline]
            fn encode(&self, index: u8, encoder: &mut GpuFieldEncoder<'_, '_>) {
                encoder.inner.$method(index, *self as $target);
            }
        }
    )*};
}
field_value!(i64 as i64: i8, i16, i32, i64, isize);
field_value!(u64 as u64: u8, u16, u32, u64, usize);
field_value!(f64 as f64: f32, f64);

impl GpuFieldValue for bool {
    fn encode(&self, index: u8, encoder: &mut GpuFieldEncoder<'_, '_>) {
        encoder.inner.bool(index, *self);
    }
}
impl GpuFieldValue for str {
    fn encode(&self, index: u8, encoder: &mut GpuFieldEncoder<'_, '_>) {
        encoder.inner.str(index, self);
    }
}
impl GpuFieldValue for String {
    fn encode(&self, index: u8, encoder: &mut GpuFieldEncoder<'_, '_>) {
        encoder.inner.str(index, self);
    }
}
impl<T: GpuFieldValue + ?Sized> GpuFieldValue for &T {
    fn encode(&self, index: u8, encoder: &mut GpuFieldEncoder<'_, '_>) {
        (**self).encode(index, encoder);
    }
}

impl GpuFieldEncoder<'_, '_> {
    /// Writes field `index`.
    #[doc(hidden)]
    #[inline]
    pub fn field(&mut self, index: u8, value: &(impl GpuFieldValue + ?Sized)) {
        value.encode(index, self);
    }
}

/// Opens a GPU scope on a queue: writes a begin timestamp into `commands` now and the end timestamp when the
/// returned [`GpuScope`] guard drops. Scopes nest. The name is a constant `&'static str` (a literal or a
/// `const`), as for [`scope!`](macro@crate::scope): it lives in the call site's `static`; a name known only at
/// run time is a field. Optional fields follow the name as `name = value` (at most
/// [`MAX_GPU_FIELDS`], as many as `tracing` allows a span; the values any [`GpuFieldValue`]: integers, floats,
/// `bool`, strings), without `tracing`'s `?`/`%` sigils, shorthand or dotted names. A name given twice keeps the
/// last value.
///
/// The slice appears on the queue's track once the GPU has run the commands, placed on the CPU's time axis by
/// the device clock's live calibration, with its uncertainty as the `uncertainty_ns` annotation (a field of the
/// scope's own by that name is kept beside it: name yours otherwise) and a flow from the point on this thread
/// where the scope was recorded. A device whose clock never calibrates (every `calibrate` fails) has no way to
/// place its slices: its scopes are counted in [`TimelineStats::gpu_lost_scopes`](crate::TimelineStats) and the
/// failures in `gpu_failed_calibrations`. A shutdown waits about a second for GPU work still in flight (wait
/// for your GPU work first); what has not finished then is counted lost. A backend may wait longer for its own
/// work queued behind yours (the Vulkan backend's fallback calibration probe: its fence must signal before the
/// backend frees it), and scopes read meanwhile are exported. A lost scope is shown as an instant on
/// its queue's track where the CPU recorded it, annotated [`GPU_SCOPE_LOST`], so its flow still has both ends.
///
/// ```
/// use std::time::Duration;
/// use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
///
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
/// let queue = gpu.queue("compute").unwrap();
/// let commands = SimCommands::new();
/// {
///     let _frame = tickline::gpu_scope!(queue, &commands, "frame", index = 7);
///     let _blur = tickline::gpu_scope!(queue, &commands, "blur");
///     commands.work(Duration::from_micros(50));
/// }
/// gpu.backend().submit(commands).wait();
/// timeline.shutdown().unwrap();
/// ```
#[macro_export]
macro_rules! gpu_scope {
    ($queue:expr, $commands:expr, $name:expr $(,)?) => {{
        static CALLSITE: $crate::export::NativeCallsite = $crate::export::NativeCallsite::new($name, file!(), line!());
        $crate::gpu::GpuScope::begin(&$queue, $commands, &CALLSITE, None)
    }};
    ($queue:expr, $commands:expr, $name:expr, $($field:ident = $value:expr),+ $(,)?) => {{
        static CALLSITE: $crate::export::NativeCallsite =
            $crate::export::NativeCallsite::with_fields($name, &[$(stringify!($field)),+], file!(), line!());
        $crate::gpu::GpuScope::begin(
            &$queue,
            $commands,
            &CALLSITE,
            $crate::__gpu_field_encoder!($($value),+),
        )
    }};
}

/// Most fields one [`gpu_scope!`](macro@crate::gpu_scope) (or `wgpu_scope!`) takes: more do not compile
/// (the field index is a byte, and beyond it a field would have overwritten another).
///
/// ```
/// # use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
/// # let timeline = tickline::Timeline::builder().start().unwrap();
/// # let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
/// # let queue = gpu.queue("q").unwrap();
/// # let commands = SimCommands::new();
/// let _s = tickline::gpu_scope!(
///     queue, &commands, "32 fields",
///     f0 = 0, f1 = 1, f2 = 2, f3 = 3, f4 = 4, f5 = 5, f6 = 6, f7 = 7,
///     f8 = 8, f9 = 9, f10 = 10, f11 = 11, f12 = 12, f13 = 13, f14 = 14, f15 = 15,
///     f16 = 16, f17 = 17, f18 = 18, f19 = 19, f20 = 20, f21 = 21, f22 = 22, f23 = 23,
///     f24 = 24, f25 = 25, f26 = 26, f27 = 27, f28 = 28, f29 = 29, f30 = 30, f31 = 31,
/// );
/// ```
///
/// ```compile_fail
/// # use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
/// # let timeline = tickline::Timeline::builder().start().unwrap();
/// # let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
/// # let queue = gpu.queue("q").unwrap();
/// # let commands = SimCommands::new();
/// let _s = tickline::gpu_scope!(
///     queue, &commands, "33 fields",
///     f0 = 0, f1 = 1, f2 = 2, f3 = 3, f4 = 4, f5 = 5, f6 = 6, f7 = 7,
///     f8 = 8, f9 = 9, f10 = 10, f11 = 11, f12 = 12, f13 = 13, f14 = 14, f15 = 15,
///     f16 = 16, f17 = 17, f18 = 18, f19 = 19, f20 = 20, f21 = 21, f22 = 22, f23 = 23,
///     f24 = 24, f25 = 25, f26 = 26, f27 = 27, f28 = 28, f29 = 29, f30 = 30, f31 = 31,
///     f32 = 32,
/// );
/// ```
pub const MAX_GPU_FIELDS: usize = 32;

/// The field encoder `gpu_scope!` and `wgpu_scope!` hand their scope: field `k` is the `k`-th value, in the
/// order of the call site's field names.
#[doc(hidden)]
#[macro_export]
macro_rules! __gpu_field_encoder {
    ($($value:expr),+) => {
        Some(&|encoder: &mut $crate::gpu::GpuFieldEncoder<'_, '_>| {
            const _: () = assert!(
                [$(stringify!($value)),+].len() <= $crate::gpu::MAX_GPU_FIELDS,
                "a GPU scope takes at most tickline::gpu::MAX_GPU_FIELDS (32) fields"
            );
            let mut index = 0u8;
            $(
                encoder.field(index, &$value);
                index += 1;
            )+
            let _ = index;
        })
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_keys_round_trip() {
        for (d, q, p, g) in [(0, 0, 0, 0), (1, 2, 3, 4), (u16::MAX, u16::MAX, MAX_PAIRS - 1, 4095)] {
            assert_eq!(split_key(scope_key(d, q, p, g)), (d, q, p, g));
        }
    }
}
