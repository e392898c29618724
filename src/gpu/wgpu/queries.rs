//! The [`GpuBackend`] under a [`WgpuProfiler`](super::WgpuProfiler): wgpu query sets, their resolution into
//! read-back buffers that wgpu maps when the resolving command buffer is submitted, and the slot table the
//! collector reads. Scopes write timestamps themselves (wgpu records through `&mut`), so this backend's
//! [`write_timestamp`](GpuBackend::write_timestamp) is never called.
//!
//! A timestamp pair's life:
//!
//! 1. A scope takes a pair from tickline's free list (`GpuQueue::begin_external`), writes the begin timestamp (or
//!    hands the pair to a pass descriptor's `timestamp_writes`), and pushes its begin record into the thread's
//!    ring. When the scope ends it writes the end timestamp and pushes the pair onto [`WgpuQueries::closed`].
//! 2. `resolve_queries` (the application's thread, once per frame) takes every closed pair, resolves their
//!    queries run by run into one resolve buffer and copies each run into a read-back buffer, then asks wgpu to
//!    map that buffer when the command buffer is submitted (`CommandEncoder::map_buffer_on_submit`): no
//!    `end_frame` is needed for the mapping, and nothing waits.
//! 3. The collector (`read_timestamps`) polls the device without blocking (`Device::poll(PollType::Poll)`), and
//!    copies the values of every mapped read-back buffer into the slot table, then unmaps it for reuse.
//! 4. The collector converts the pair and recycles it (`recycle`): the slot table forgets the values but keeps
//!    them as *stale*, so a later resolve that ran before the pair's next writes (the application submitted the
//!    resolving command buffer first) is recognised and the pair is resolved again at the next frame.
//!
//! Read-back buffers are pooled, at most `max_num_pending_frames` of them; when every one is in flight, a
//! resolve is *deferred* (counted) and its pairs wait in their query sets for the next `resolve_queries`. Nothing
//! is dropped: the pairs themselves bound what is pending (a scope that finds no free pair is counted as
//! starved, as on every backend).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use super::calibrate::Calibrator;
use crate::calibration::CalibrationSample;
use crate::clock::monotonic_ns;
use crate::gpu::{GpuBackend, GpuDeviceInfo, GpuError, GpuTicks};

/// Queries per query set: wgpu's limit (`QUERY_SET_MAX_QUERIES`).
pub(super) const SET_QUERIES: u32 = wgpu::QUERY_SET_MAX_QUERIES;
/// Pairs per query set.
const SET_PAIRS: u32 = SET_QUERIES / 2;
/// Bytes of one pair's two resolved timestamps.
const PAIR_BYTES: u64 = 2 * wgpu::QUERY_SIZE as u64;
/// The smallest read-back buffer, in pairs (4 KiB).
const MIN_READBACK_PAIRS: usize = 256;
/// A pair whose read-back was not usable this many times in a row is given up (counted): its scope's commands
/// were never submitted, or were submitted after every resolve.
const MAX_ATTEMPTS: u8 = 4;
/// The collector polls the device at most this often (it reads once per run of pairs per pass).
const POLL_GAP_NS: u64 = 200_000;

/// A read-back buffer's state, set by wgpu's mapping callback (Release) and read by `harvest` (Acquire).
const WAITING: u8 = 1;
const MAPPED: u8 = 2;
const FAILED: u8 = 3;
/// The callback was dropped without being called: the resolving encoder was never submitted.
const DROPPED: u8 = 4;

/// Counters of the read-back, for [`WgpuProfilerStats`](super::WgpuProfilerStats).
#[derive(Default)]
pub(super) struct Counters {
    pub(super) deferred_resolves: AtomicU64,
    pub(super) retried_pairs: AtomicU64,
    pub(super) unreadable_pairs: AtomicU64,
    pub(super) failed_polls: AtomicU64,
}

/// Raw ticks as they pass through, for tests that check conversions against the truth. Off unless asked for.
#[derive(Clone, Debug, Default)]
pub struct RawTicksLog {
    /// Pairs in the order scopes took them.
    pub opens: Vec<u32>,
    /// `(pair, begin ticks, end ticks)` in the order read back.
    pub reads: Vec<(u32, u64, u64)>,
}

pub(super) struct WgpuQueries {
    device: wgpu::Device,
    info: GpuDeviceInfo,
    mask: u64,
    sets: Vec<wgpu::QuerySet>,
    /// `QUERY_RESOLVE | COPY_SRC`: every run is resolved at offset 0 (wgpu orders the reuse with barriers), so no
    /// offset ever needs `QUERY_RESOLVE_BUFFER_ALIGNMENT`.
    resolve: wgpu::Buffer,
    /// Pairs whose scopes ended since the last resolve. Holds every pair at most once, so it never overflows.
    pub(super) closed: ArrayQueue<u32>,
    readback: Mutex<Readback>,
    max_pending: usize,
    pub(super) calibrator: Calibrator,
    last_poll_ns: AtomicU64,
    pub(super) counters: Counters,
    pub(super) logging: AtomicBool,
    log: Mutex<RawTicksLog>,
}

/// The read-back side, shared by `resolve_queries` (the application's thread, once per frame) and the collector.
struct Readback {
    free: Vec<Staging>,
    in_flight: Vec<Staging>,
    /// Pairs to resolve at the next `resolve_queries`: deferred (no read-back buffer free) or retried (their
    /// read-back was not usable).
    retry: Vec<u32>,
    /// Per slot: the value read back, 0 while none.
    values: Vec<u64>,
    /// Per slot: the value it held when it was last recycled (a resolve that still sees it ran too early).
    stale: Vec<u64>,
    /// Per pair: unusable read-backs in a row.
    attempts: Vec<u8>,
}

/// A `MAP_READ | COPY_DST` buffer and the pairs resolved into it (pair `pairs[i]` at byte `16 i`).
struct Staging {
    buffer: wgpu::Buffer,
    capacity: usize,
    pairs: Vec<u32>,
    state: Arc<AtomicU8>,
}

/// Moved into wgpu's mapping callback: records how the mapping ended, or, dropped uncalled, that it never ran.
struct MapNotice {
    state: Arc<AtomicU8>,
    fired: bool,
}

impl MapNotice {
    fn fire(mut self, mapped: bool) {
        // Release: publishes the mapping's outcome; pairs with the Acquire load in `Readback::harvest`.
        self.state
            .store(if mapped { MAPPED } else { FAILED }, Ordering::Release);
        self.fired = true;
    }
}

impl Drop for MapNotice {
    fn drop(&mut self) {
        if !self.fired {
            // Release: as in `fire`.
            self.state.store(DROPPED, Ordering::Release);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The query set and index of timestamp slot `slot`.
#[inline]
fn locate(slot: u32) -> (usize, u32) {
    ((slot / SET_QUERIES) as usize, slot % SET_QUERIES)
}

impl WgpuQueries {
    /// Creates the query sets and the resolve buffer. `slots` is even and at least 2 (checked by the caller);
    /// the device has `TIMESTAMP_QUERY`.
    pub(super) fn new(
        device: &wgpu::Device,
        info: GpuDeviceInfo,
        max_pending: usize,
        calibrator: Calibrator,
    ) -> WgpuQueries {
        let slots = info.timestamp_slots;
        let sets = (0..slots.div_ceil(SET_QUERIES))
            .map(|index| {
                device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("tickline timestamps"),
                    ty: wgpu::QueryType::Timestamp,
                    count: (slots - index * SET_QUERIES).min(SET_QUERIES),
                })
            })
            .collect();
        let resolve = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("tickline timestamp resolve"),
            size: u64::from(slots.min(SET_QUERIES)) * u64::from(wgpu::QUERY_SIZE),
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let pairs = (slots / 2) as usize;
        WgpuQueries {
            device: device.clone(),
            mask: info.clock.mask(),
            info,
            sets,
            resolve,
            closed: ArrayQueue::new(pairs),
            readback: Mutex::new(Readback {
                free: Vec::new(),
                in_flight: Vec::new(),
                retry: Vec::new(),
                values: vec![0; slots as usize],
                stale: vec![0; slots as usize],
                attempts: vec![0; pairs],
            }),
            max_pending,
            calibrator,
            last_poll_ns: AtomicU64::new(0),
            counters: Counters::default(),
            logging: AtomicBool::new(false),
            log: Mutex::new(RawTicksLog::default()),
        }
    }

    /// The query set and index of a slot.
    #[inline]
    pub(super) fn slot(&self, slot: u32) -> (&wgpu::QuerySet, u32) {
        let (set, index) = locate(slot);
        (&self.sets[set], index)
    }

    /// Marks `pair` as ended: the next `resolve_queries` reads it back.
    #[inline]
    pub(super) fn close(&self, pair: u32) {
        // Cannot fail: the queue holds every pair, and each pair is in at most one place at a time.
        let _ = self.closed.push(pair);
    }

    /// Records which pair a scope took (only while a raw-ticks log is on).
    #[cold]
    pub(super) fn log_open(&self, pair: u32) {
        lock(&self.log).opens.push(pair);
    }

    pub(super) fn raw_log(&self) -> RawTicksLog {
        lock(&self.log).clone()
    }

    /// Pairs waiting for a `resolve_queries` (ended but not resolved yet, deferred or retried ones excluded).
    pub(super) fn unresolved(&self) -> usize {
        self.closed.len()
    }

    /// Resolves every ended (and every deferred or retried) pair into a read-back buffer that wgpu maps once
    /// `encoder` is submitted. Returns how many pairs went into it.
    pub(super) fn resolve(&self, encoder: &mut wgpu::CommandEncoder) -> usize {
        let mut readback = lock(&self.readback);
        let mut pairs = std::mem::take(&mut readback.retry);
        while let Some(pair) = self.closed.pop() {
            pairs.push(pair);
        }
        if pairs.is_empty() {
            return 0;
        }
        pairs.sort_unstable();
        pairs.dedup();
        let staging = match readback.take_staging(pairs.len(), &self.device, self.max_pending) {
            Some(staging) => Some(staging),
            None => {
                // Every read-back buffer is in flight: collect the mapped ones here, then try again.
                self.harvest(&mut readback);
                readback.take_staging(pairs.len(), &self.device, self.max_pending)
            }
        };
        let Some(mut staging) = staging else {
            self.counters.deferred_resolves.fetch_add(1, Ordering::Relaxed);
            readback.retry = pairs;
            return 0;
        };
        let mut i = 0;
        while i < pairs.len() {
            let first = pairs[i];
            let mut run = 1;
            while i + run < pairs.len()
                && pairs[i + run] == first + run as u32
                && (first + run as u32) / SET_PAIRS == first / SET_PAIRS
            {
                run += 1;
            }
            let (set, index) = locate(2 * first);
            encoder.resolve_query_set(&self.sets[set], index..index + 2 * run as u32, &self.resolve, 0);
            encoder.copy_buffer_to_buffer(
                &self.resolve,
                0,
                &staging.buffer,
                i as u64 * PAIR_BYTES,
                run as u64 * PAIR_BYTES,
            );
            i += run;
        }
        let count = pairs.len();
        staging.pairs = pairs;
        // Relaxed: nothing else reads the state until the callback below is registered.
        staging.state.store(WAITING, Ordering::Relaxed);
        let notice = MapNotice {
            state: staging.state.clone(),
            fired: false,
        };
        encoder.map_buffer_on_submit(
            &staging.buffer,
            wgpu::MapMode::Read,
            0..count as u64 * PAIR_BYTES,
            move |result| notice.fire(result.is_ok()),
        );
        readback.in_flight.push(staging);
        count
    }

    /// Takes in what was mapped; while a read-back is still waiting for its mapping, polls the device without
    /// blocking (at most every `POLL_GAP_NS`: wgpu-core's `maintain` takes locks the application's recording
    /// and submits take too) and takes in again.
    fn pump(&self) {
        let waiting = {
            let mut readback = lock(&self.readback);
            self.harvest(&mut readback);
            // Acquire: as in `harvest`.
            readback
                .in_flight
                .iter()
                .any(|s| s.state.load(Ordering::Acquire) == WAITING)
        };
        let now = monotonic_ns().0;
        if !waiting || now.saturating_sub(self.last_poll_ns.load(Ordering::Relaxed)) < POLL_GAP_NS {
            return;
        }
        self.last_poll_ns.store(now, Ordering::Relaxed);
        // Outside the read-back lock: `resolve_queries` never waits for a poll. The mapping callbacks only store
        // an atomic.
        if self.device.poll(wgpu::PollType::Poll).is_err() {
            self.counters.failed_polls.fetch_add(1, Ordering::Relaxed);
        }
        let mut readback = lock(&self.readback);
        self.harvest(&mut readback);
    }

    /// Copies the values of every mapped read-back buffer into the slot table and returns the buffers to the
    /// pool; pairs whose read-back was not usable are resolved again at the next frame.
    fn harvest(&self, readback: &mut Readback) {
        let logging = self.logging.load(Ordering::Relaxed);
        let mut i = 0;
        while i < readback.in_flight.len() {
            // Acquire: pairs with the Release store in `MapNotice`.
            let state = readback.in_flight[i].state.load(Ordering::Acquire);
            if state == WAITING {
                i += 1;
                continue;
            }
            let mut staging = readback.in_flight.swap_remove(i);
            let pairs = std::mem::take(&mut staging.pairs);
            let bytes = pairs.len() as u64 * PAIR_BYTES;
            let view = (state == MAPPED)
                .then(|| staging.buffer.slice(0..bytes).get_mapped_range().ok())
                .flatten();
            match view {
                Some(view) => {
                    for (chunk, &pair) in view.chunks_exact(PAIR_BYTES as usize).zip(&pairs) {
                        let word = |k: usize| u64::from_le_bytes(chunk[8 * k..8 * k + 8].try_into().expect("8 bytes"));
                        let (begin, end) = (word(0) & self.mask, word(1) & self.mask);
                        let slot = 2 * pair as usize;
                        // 0: never written (wgpu clears what it resolves of unwritten queries); stale: written by
                        // the scope before, not yet by this one (resolved before the writes were submitted).
                        let written =
                            begin != 0 && end != 0 && begin != readback.stale[slot] && end != readback.stale[slot + 1];
                        if written {
                            readback.values[slot] = begin;
                            readback.values[slot + 1] = end;
                            readback.attempts[pair as usize] = 0;
                            if logging {
                                lock(&self.log).reads.push((pair, begin, end));
                            }
                        } else {
                            readback.retry_pair(pair, &self.counters);
                        }
                    }
                    drop(view);
                    staging.buffer.unmap();
                }
                None => {
                    // Failed (a lost device), or the resolving encoder was dropped unsubmitted: try again.
                    if state == MAPPED {
                        staging.buffer.unmap();
                    }
                    for &pair in &pairs {
                        readback.retry_pair(pair, &self.counters);
                    }
                }
            }
            staging.pairs = pairs;
            staging.pairs.clear();
            readback.free.push(staging);
        }
    }
}

impl Readback {
    /// A free read-back buffer for `pairs` pairs (the smallest that fits), a new one while fewer than `max`
    /// exist, or `None` when all `max` are in flight.
    fn take_staging(&mut self, pairs: usize, device: &wgpu::Device, max: usize) -> Option<Staging> {
        let fit = (0..self.free.len())
            .filter(|&i| self.free[i].capacity >= pairs)
            .min_by_key(|&i| self.free[i].capacity);
        if let Some(i) = fit {
            return Some(self.free.swap_remove(i));
        }
        if self.free.len() + self.in_flight.len() >= max {
            // Only buffers too small are free: replace the smallest with a bigger one.
            let smallest = (0..self.free.len()).min_by_key(|&i| self.free[i].capacity)?;
            self.free.swap_remove(smallest);
        }
        let capacity = pairs
            .next_power_of_two()
            .max(MIN_READBACK_PAIRS)
            .min(self.attempts.len())
            .max(pairs);
        Some(Staging {
            buffer: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("tickline timestamp read-back"),
                size: capacity as u64 * PAIR_BYTES,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            capacity,
            pairs: Vec::with_capacity(capacity),
            state: Arc::new(AtomicU8::new(WAITING)),
        })
    }

    fn retry_pair(&mut self, pair: u32, counters: &Counters) {
        let attempts = &mut self.attempts[pair as usize];
        *attempts += 1;
        if *attempts >= MAX_ATTEMPTS {
            // Its commands never ran before a resolve: the collector counts the scope as lost in time.
            *attempts = 0;
            counters.unreadable_pairs.fetch_add(1, Ordering::Relaxed);
        } else {
            counters.retried_pairs.fetch_add(1, Ordering::Relaxed);
            self.retry.push(pair);
        }
    }
}

impl GpuBackend for WgpuQueries {
    /// Scopes write their timestamps through wgpu's `&mut` recorders themselves (see `WgpuProfiler`), so nothing
    /// can be passed to `gpu_scope!` here.
    type Commands = std::convert::Infallible;

    fn info(&self) -> GpuDeviceInfo {
        self.info.clone()
    }

    fn write_timestamp(&self, commands: &std::convert::Infallible, _slot: u32) {
        match *commands {}
    }

    fn read_timestamps(&self, first: u32, out: &mut [Option<GpuTicks>]) -> Result<(), GpuError> {
        let end = u64::from(first) + out.len() as u64;
        if end > u64::from(self.info.timestamp_slots) {
            return Err(GpuError::Invalid {
                detail: format!("slots {first}..{end} past {}", self.info.timestamp_slots),
            });
        }
        self.pump();
        let readback = lock(&self.readback);
        for (value, &ticks) in out.iter_mut().zip(&readback.values[first as usize..end as usize]) {
            *value = (ticks != 0).then_some(GpuTicks(ticks));
        }
        Ok(())
    }

    fn recycle(&self, first: u32, count: u32) -> Result<(), GpuError> {
        let end = u64::from(first) + u64::from(count);
        if end > u64::from(self.info.timestamp_slots) {
            return Err(GpuError::Invalid {
                detail: format!("slots {first}..{end} past {}", self.info.timestamp_slots),
            });
        }
        let mut readback = lock(&self.readback);
        let Readback { values, stale, .. } = &mut *readback;
        for slot in first as usize..end as usize {
            if values[slot] != 0 {
                stale[slot] = std::mem::take(&mut values[slot]);
            }
        }
        Ok(())
    }

    fn calibrate(&self, samples: usize, budget: Duration, out: &mut Vec<CalibrationSample>) -> Result<(), GpuError> {
        self.calibrator.calibrate(samples, budget, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_located_in_their_query_set() {
        assert_eq!(locate(0), (0, 0));
        assert_eq!(locate(SET_QUERIES - 1), (0, SET_QUERIES - 1));
        assert_eq!(locate(SET_QUERIES), (1, 0));
        assert_eq!(locate(2 * SET_QUERIES + 6), (2, 6));
    }

    #[test]
    fn a_dropped_mapping_callback_says_it_never_ran() {
        let state = Arc::new(AtomicU8::new(WAITING));
        drop(MapNotice {
            state: state.clone(),
            fired: false,
        });
        assert_eq!(state.load(Ordering::Acquire), DROPPED);
        let notice = MapNotice {
            state: state.clone(),
            fired: false,
        };
        notice.fire(true);
        assert_eq!(state.load(Ordering::Acquire), MAPPED);
    }

    #[test]
    fn backend_is_send_and_sync() {
        fn assert_backend<B: GpuBackend>() {}
        assert_backend::<WgpuQueries>();
    }
}
