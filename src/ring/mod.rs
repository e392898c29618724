//! The per-thread ring: a bounded single-producer single-consumer queue of `Copy` records.
//!
//! Each application thread owns one [`Producer`]; the collector thread owns the matching
//! [`Consumer`]s and drains them in batches. The ring's `unsafe` lives in this file only.
//!
//! # Protocol
//!
//! [`Shared`] holds two monotonically increasing indices, `head` (next slot to read, written only by
//! the Consumer) and `tail` (next slot to write, written only by the Producer). An index is masked
//! with `capacity - 1` to find its slot. At all times `0 <= tail - head <= capacity` (wrapping
//! arithmetic), and:
//!
//! - slots `head..tail` hold initialized records and belong to the Consumer, which only reads them;
//! - slots `tail..head + capacity` belong to the Producer, which only writes them.
//!
//! A slot changes hands only through a `Release` store of the index that ends its range, paired with
//! an `Acquire` load of that index on the other side:
//!
//! - Producer: write slot `tail` (or `n` slots from `tail` on), then `tail.store(tail + n, Release)`.
//!   The Consumer's `tail.load(Acquire)` (in [`Consumer::refresh_tail`]) makes the slot writes
//!   visible before it reads them.
//! - Consumer: read slots `head..head + n`, then `head.store(head + n, Release)`. The Producer's
//!   `head.load(Acquire)` (in [`Producer::has_room`]) orders those reads before its overwrite.
//!
//! Each side caches the other side's index (`head_cache`, `tail_cache`) and reloads it only when the
//! cached value says "full" or "not enough", so a push in the common case touches no cache line that
//! the consumer writes: its own local `tail`, one slot write, one `Release` store.
//!
//! Thread exit: dropping the Producer stores `producer_alive = false` with `Release`; a Consumer that
//! observes it with `Acquire` ([`Consumer::is_closed`]) sees the final `tail` and drop count, drains
//! the rest, and is then dropped; the ring memory is freed when both handles are gone (an `Arc`).
//!
//! # Checking
//!
//! - loom, the protocol (`loom_tests.rs`, capacity 2):
//!   `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib ring::loom_tests`
//! - Miri, the unsafe code (the unit tests below, loops scaled down under Miri):
//!   `MIRIFLAGS="-Zmiri-strict-provenance" cargo +nightly miri test --lib ring::`

mod sync;

#[cfg(all(test, loom))]
mod loom_tests;

use core::fmt;
use core::mem::MaybeUninit;
use core::ops::Deref;

use sync::{spin_loop, yield_now, Arc, AtomicBool, AtomicU64, AtomicUsize, Ordering, UnsafeCell};

/// Creates a ring of at least `capacity` records and returns its two ends.
///
/// The capacity is rounded up to a power of two, and to at least 2. The slots are allocated here, in
/// one allocation; pushing and draining never allocate. The memory is freed when both the
/// [`Producer`] and the [`Consumer`] have been dropped.
///
/// # Panics
///
/// If the rounded capacity overflows `usize`, or the allocation fails.
pub(crate) fn channel<T: Copy + Send>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    let capacity = capacity
        .max(2)
        .checked_next_power_of_two()
        .expect("ring capacity overflows usize");
    // One allocation: `collect` on an exact-size iterator allocates once, `into_boxed_slice` keeps it.
    let slots: Box<[UnsafeCell<MaybeUninit<T>>]> =
        (0..capacity).map(|_| UnsafeCell::new(MaybeUninit::uninit())).collect();
    let shared = Arc::new(Shared {
        head: CachePadded(AtomicUsize::new(0)),
        tail: CachePadded(AtomicUsize::new(0)),
        dropped: CachePadded(AtomicU64::new(0)),
        dropped_units: AtomicU64::new(0),
        markers: AtomicU64::new(0),
        producer_alive: AtomicBool::new(true),
        consumer_alive: AtomicBool::new(true),
        slots,
    });
    let mask = capacity - 1;
    let producer = Producer {
        shared: Arc::clone(&shared),
        tail: 0,
        head_cache: 0,
        mask,
        dropped: 0,
        dropped_units: 0,
        markers: 0,
    };
    let consumer = Consumer {
        shared,
        head: 0,
        tail_cache: 0,
        mask,
    };
    (producer, consumer)
}

/// Aligns (and pads) `T` to its own 128-byte block, so that two of them never share a cache line.
///
/// 128, not 64: adjacent-line prefetch. Since Sandy Bridge, Intel's L2 spatial prefetcher "strives to
/// complete every cache line fetched to the L2 cache with the pair line that completes it to a
/// 128-byte aligned chunk" (Intel 64 and IA-32 Architectures Optimization Reference Manual, "Data
/// Prefetching", section 2.3.5.4 in the Sandy Bridge chapter), so two hot fields 64 bytes apart still
/// ping-pong between cores. Apple M-series cores have 128-byte lines outright.
#[repr(align(128))]
struct CachePadded<T>(T);

impl<T> Deref for CachePadded<T> {
    type Target = T;

    #[inline(always)]
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Evicts the cache lines of `bytes` bytes from `start` from every cache (`CLFLUSH`), after the consumer has
/// read them. Memory is unchanged (a dirty line is written back first); only where its copies live changes.
///
/// Why: the consumer's read leaves a shared copy of each ring line in its core's caches, and when the
/// producer wraps around to that line it must invalidate the copy at the moment it writes, a cross-core
/// round trip per 64-byte line that its stores wait for. When the two cores are far apart (on this
/// project's VMs, for minutes at a time) that made the recording thread 2-3 times slower. A producer model
/// (`rdtsc` and a 16-byte record per slot, the consumer on the other core, a 1 MiB ring) took 24-33 ns per
/// record instead of 10; with the consumer evicting what it read, 10-11 ns, and the consumer's own cost
/// per record went down (2.0-3.2 ns instead of 2.7-3.9). With both on one core, eviction costs the consumer
/// about 0.6 ns per record and the producer nothing measurable. A `PREFETCHW` 16 lines ahead of the producer
/// (this ring's remedy before) did not help in that model, and with eviction it made tickline's span
/// lifecycle slower in total (`total_cpu`, 6 processes each: 275.9 ns median with it, 261.7 without).
/// `CLFLUSHOPT` (unordered) was no better than `CLFLUSH` on this AMD EPYC (the drain thread's CPU per million
/// spans: 16-30 ms against 11-22), so the baseline instruction is used everywhere.
#[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
#[inline]
fn evict_lines(start: *const u8, bytes: usize) {
    const LINE: usize = 64;
    let end = start as usize + bytes;
    // From `start`'s own line on: every address flushed lies in `start..end`, a line's first byte or
    // `start` itself.
    let mut at = start;
    while (at as usize) < end {
        // SAFETY: `clflush` takes a memory operand that must be a mapped, canonical address, which `at` is: it
        // lies in `start..start + bytes`, slots the caller has just read. It changes no memory (a modified
        // line is written back before it is dropped), no register and no flag, so a producer writing
        // another slot of the same line concurrently loses nothing (the caches stay coherent), and torn or
        // corrupt record contents do not matter. `clflush` is in every x86_64 CPU (SSE2).
        unsafe { core::arch::x86_64::_mm_clflush(at) };
        at = at.wrapping_add(LINE - (at as usize & (LINE - 1)));
    }
}

/// The state both ends share. See the module docs for the protocol.
struct Shared<T> {
    /// Index of the next record to read. Written only by the [`Consumer`].
    head: CachePadded<AtomicUsize>,
    /// Index of the next slot to write. Written only by the [`Producer`].
    tail: CachePadded<AtomicUsize>,
    /// Records the producer dropped because the ring was full. Written only by the [`Producer`], which
    /// counts locally and stores the running total (no read-modify-write needed with one writer).
    dropped: CachePadded<AtomicU64>,
    /// Units of the caller's own (for the recorder: whole slices) whose records were dropped. Written only
    /// by the [`Producer`], like `dropped`.
    dropped_units: AtomicU64,
    /// Records of the caller's own bookkeeping (for the recorder: loss markers) it pushed. Written only by the
    /// [`Producer`], like `dropped`.
    markers: AtomicU64,
    /// Cleared when the [`Producer`] is dropped (its thread exited).
    producer_alive: AtomicBool,
    /// Cleared when the [`Consumer`] is dropped (the collector is gone).
    consumer_alive: AtomicBool,
    /// `capacity` slots, `capacity` a power of two. Slot `i & mask` holds the record with index `i`.
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
}

/// The writing end of a ring, owned by one application thread.
///
/// `Send` (it may move to the thread that will use it) but not `Sync`, and every write takes
/// `&mut self`: at most one thread pushes, which the protocol relies on.
pub(crate) struct Producer<T> {
    shared: Arc<Shared<T>>,
    /// Equal to `shared.tail`: only this Producer stores it, so it never needs loading.
    tail: usize,
    /// A value `shared.head` had; `head_cache <= shared.head` always, since head only grows.
    head_cache: usize,
    /// `capacity - 1`, kept here so a push reads no shared memory to find its slot.
    mask: usize,
    /// Records dropped (`push_or_count_drop`, `count_drops`); mirrored into `shared.dropped`.
    dropped: u64,
    /// Mirrored into `shared.dropped_units`.
    dropped_units: u64,
    /// Mirrored into `shared.markers`.
    markers: u64,
}

// SAFETY: a Producer is the producer *role* of the protocol (sole writer of `tail`, `dropped` and of
// the free slots `tail..head + capacity`); that role is not tied to a thread, it only must not be
// played by two threads at once, which `&mut self` on every write and `!Sync` (from `Arc<Shared<T>>`,
// below) guarantee. What crosses threads through the slots are `T` values, hence `T: Send`.
// `Arc<Shared<T>>` is `!Send` only because `Shared` holds `UnsafeCell`s, whose cross-thread use is
// what the head/tail protocol (module docs) makes sound.
unsafe impl<T: Send> Send for Producer<T> {}

impl<T: Copy + Send> Producer<T> {
    /// Appends `value`, or hands it back if the ring is full. Never blocks, allocates or counts.
    #[cfg(test)]
    ///
    /// Wait-free: at most one atomic load (only when the cached head says full), one slot write and
    /// one `Release` store.
    #[inline]
    pub(crate) fn try_push(&mut self, value: T) -> Result<(), T> {
        if !self.has_room(1) {
            return Err(value);
        }
        // SAFETY: `has_room(1)` just returned true, which is `write_slot`'s precondition for
        // index `tail`.
        unsafe { self.write_slot(self.tail, value) };
        self.publish(1);
        Ok(())
    }

    /// Appends all of `values`, in order, or none of them; returns whether they were stored. Never
    /// blocks, allocates or counts. A group longer than [`Producer::capacity`] never fits.
    ///
    /// The consumer sees the whole group at once (one `Release` store of tail), never a part of it.
    #[cfg(test)]
    pub(crate) fn try_push_all(&mut self, values: &[T]) -> bool {
        self.try_push_all_keeping(values, 0)
    }

    /// Appends all of `values`, in order, or none of them, and only if `keep` slots stay free after them
    /// (room the caller has promised to later records: the ends of slices already begun). Returns whether
    /// they were stored. Never blocks, allocates or counts.
    #[inline]
    pub(crate) fn try_push_all_keeping(&mut self, values: &[T], keep: usize) -> bool {
        if !self.has_room(values.len().saturating_add(keep)) {
            return false;
        }
        for (k, &value) in values.iter().enumerate() {
            // SAFETY: `has_room(values.len() + keep)` returned true, so indices `tail..tail + values.len()`
            // meet `write_slot`'s precondition; k < values.len().
            unsafe { self.write_slot(self.tail.wrapping_add(k), value) };
        }
        self.publish(values.len());
        true
    }

    /// Appends one `value` if `keep` slots stay free after it (see
    /// [`try_push_all_keeping`](Self::try_push_all_keeping)); the one-record case without a loop.
    #[inline(always)]
    pub(crate) fn try_push_keeping(&mut self, value: T, keep: usize) -> bool {
        if !self.has_room(keep.saturating_add(1)) {
            return false;
        }
        // SAFETY: `has_room(keep + 1)` returned true, so index `tail` meets `write_slot`'s precondition.
        unsafe { self.write_slot(self.tail, value) };
        self.publish(1);
        true
    }

    /// Slots free now (reloads the consumer's head).
    pub(crate) fn free_slots(&mut self) -> usize {
        // Acquire: pairs with the Release store of head in `Consumer::drain`, as in `has_room`.
        self.head_cache = self.shared.head.load(Ordering::Acquire);
        self.capacity() - self.tail.wrapping_sub(self.head_cache)
    }

    /// Records in the ring now, as far as this producer can tell (reloads the consumer's head).
    pub(crate) fn len_now(&mut self) -> usize {
        self.capacity() - self.free_slots()
    }

    /// The index of the next slot to write: counts every record ever pushed (wrapping).
    #[inline(always)]
    pub(crate) fn tail_index(&self) -> usize {
        self.tail
    }

    /// Appends `value`, or, if the ring is full, drops it and counts it (the default "drop" mode).
    ///
    /// Returns whether the record was stored. Never blocks, allocates or makes a system call. The
    /// consumer reads the count with [`Consumer::dropped_records`].
    #[cfg(test)]
    pub(crate) fn push_or_count_drop(&mut self, value: T) -> bool {
        match self.try_push(value) {
            Ok(()) => true,
            Err(_) => {
                self.count_drops(1);
                false
            }
        }
    }

    /// Adds `n` to the drop count, for records the caller dropped itself (say, a group that
    /// [`Producer::try_push_all`] could not store).
    #[cold]
    pub(crate) fn count_drops(&mut self, n: u64) {
        self.dropped += n;
        // Relaxed: a statistic, and this Producer is its only writer, so a plain store of the running
        // total suffices (no read-modify-write). A consumer that has seen `is_closed()` (Acquire,
        // paired with the Release in `Producer::drop`) reads the final value; before that it may read
        // a slightly older one.
        self.shared.dropped.store(self.dropped, Ordering::Relaxed);
    }

    /// Adds one to the count of the caller's units (whole slices) lost to drops.
    #[cold]
    pub(crate) fn count_dropped_unit(&mut self) {
        self.dropped_units += 1;
        // Relaxed: as in `count_drops`.
        self.shared.dropped_units.store(self.dropped_units, Ordering::Relaxed);
    }

    /// Adds one to the count of bookkeeping records (loss markers) the caller pushed.
    #[cold]
    pub(crate) fn count_marker(&mut self) {
        self.markers += 1;
        // Relaxed: as in `count_drops`.
        self.shared.markers.store(self.markers, Ordering::Relaxed);
    }

    /// Whether `n` slots from `tail` on are free. Reloads the consumer's head only when the cached
    /// value says there is not enough room.
    #[inline(always)]
    fn has_room(&mut self, n: usize) -> bool {
        if self.capacity() - self.tail.wrapping_sub(self.head_cache) >= n {
            return true;
        }
        // Acquire: pairs with the Release store of head in `Consumer::drain`, so the consumer's
        // reads of the slots it released happen-before our overwrites of them in `write_slot`.
        self.head_cache = self.shared.head.load(Ordering::Acquire);
        debug_assert!(self.tail.wrapping_sub(self.head_cache) <= self.capacity());
        self.capacity() - self.tail.wrapping_sub(self.head_cache) >= n
    }

    /// Writes `value` into the slot of record index `index`, without publishing it.
    ///
    /// # Safety
    ///
    /// `index` is free and ours: `tail <= index < head_cache + capacity` (wrapping), which a `true`
    /// from `has_room(n)` establishes for `tail..tail + n` until the next `publish`.
    #[inline(always)]
    unsafe fn write_slot(&mut self, index: usize, value: T) {
        let idx = index & self.mask;
        debug_assert!(idx < self.shared.slots.len());
        debug_assert!(index.wrapping_sub(self.tail) < self.capacity() - self.tail.wrapping_sub(self.head_cache));
        // SAFETY: (1) in bounds: idx = index & mask < capacity = slots.len(), since `channel` makes
        // the capacity a power of two and mask = capacity - 1. (2) the slot is ours: by the caller's
        // contract `tail <= index < head_cache + capacity`, and head_cache <= head, so `index` is in
        // the producer's range `tail..head + capacity`: the consumer's last reads of this slot
        // happen-before this write (through the Acquire load of head in `has_room` that produced
        // head_cache), and it reads the slot again only after our Release store of tail in `publish`.
        // Only this Producer writes slots (`&mut self`, `!Sync`).
        unsafe {
            self.shared
                .slots
                .get_unchecked(idx)
                .with_mut(|slot| slot.write(MaybeUninit::new(value)));
        }
    }

    /// Hands the `n` slots written from `tail` on to the consumer.
    #[inline(always)]
    fn publish(&mut self, n: usize) {
        self.tail = self.tail.wrapping_add(n);
        // Release: publishes the slot writes before it; pairs with the Acquire load of tail in
        // `Consumer::refresh_tail`.
        self.shared.tail.store(self.tail, Ordering::Release);
    }

    /// Appends all of `values` (or none), waiting while the ring has no room for them (the lossless mode);
    /// `wake` is called each time it starts to wait (to wake the consumer early), and the wait ends when it
    /// returns false (there is no consumer to wait for, as the producer knows).
    ///
    /// Waits by spinning (`spin_loop` hints, backing off), then yielding the thread. The fast case (room
    /// in the ring) makes no system call. Returns false only if the [`Consumer`] has been dropped, `wake` said
    /// so, or the group can never fit (longer than the ring), so a thread never waits forever.
    pub(crate) fn push_all_waiting(&mut self, values: &[T], mut wake: impl FnMut() -> bool) -> bool {
        if values.len() > self.capacity() {
            return false;
        }
        let mut backoff = Backoff::new();
        loop {
            if self.try_push_all_keeping(values, 0) {
                return true;
            }
            if !self.is_consumer_alive() {
                return false;
            }
            if backoff.wakes() && !wake() {
                return false;
            }
            backoff.snooze();
        }
    }

    /// How many records this producer has dropped because the ring was full.
    #[allow(dead_code, reason = "API for statistics on the producer side; used by the tests")]
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// How many records the ring holds when full (a power of two, at least 2).
    #[inline]
    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Whether the [`Consumer`] still exists. Once false, stays false.
    pub(crate) fn is_consumer_alive(&self) -> bool {
        // Relaxed: the flag publishes no data; it only ends `push_all_waiting`'s wait.
        self.shared.consumer_alive.load(Ordering::Relaxed)
    }
}

impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        // Release: publishes our last tail and dropped-count stores (sequenced before this); pairs with
        // the Acquire load in `Consumer::is_closed`, after which the consumer sees every record.
        self.shared.producer_alive.store(false, Ordering::Release);
    }
}

impl<T> fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("capacity", &(self.mask + 1))
            .field("tail", &self.tail)
            .field("dropped", &self.dropped)
            .finish_non_exhaustive()
    }
}

/// The reading end of a ring, owned by the collector thread.
///
/// Drain with [`Consumer::drain`]. When the producing thread has exited, [`Consumer::is_closed`]
/// turns true; the ring still holds what was pushed before that, which `drain` returns. Once
/// [`Consumer::is_finished`] is true, drop the Consumer to free the ring.
pub(crate) struct Consumer<T> {
    shared: Arc<Shared<T>>,
    /// Equal to `shared.head`: only this Consumer stores it.
    head: usize,
    /// A value `shared.tail` had; `head <= tail_cache <= shared.tail`.
    tail_cache: usize,
    /// `capacity - 1`.
    mask: usize,
}

// SAFETY: a Consumer is the consumer *role* of the protocol (sole writer of `head`, sole reader of
// the filled slots `head..tail`); it may be played from any thread, but only by one at a time, which
// `&mut self` on `drain` and `!Sync` (from `Arc<Shared<T>>`) guarantee. It receives `T` values written
// on the producer's thread, hence `T: Send`. The `UnsafeCell`s that make `Arc<Shared<T>>` `!Send` are
// accessed only under the head/tail protocol (module docs).
unsafe impl<T: Send> Send for Consumer<T> {}

impl<T: Copy + Send> Consumer<T> {
    /// Reads up to `max` records, oldest first, and passes them to `f` as at most two contiguous
    /// slices (two when the run wraps around the end of the slots). Returns how many were read.
    ///
    /// The slots are handed back to the producer once, after `f` has returned (batch draining). If
    /// `f` panics, nothing is consumed.
    pub(crate) fn drain(&mut self, max: usize, mut f: impl FnMut(&[T])) -> usize {
        if self.tail_cache.wrapping_sub(self.head) < max {
            self.refresh_tail();
        }
        let n = self.tail_cache.wrapping_sub(self.head).min(max);
        if n == 0 {
            return 0;
        }
        debug_assert!(n <= self.capacity());
        let start = self.head & self.mask;
        let first = n.min(self.capacity() - start);
        self.read_run(start, first, &mut f);
        if first < n {
            self.read_run(0, n - first, &mut f);
        }
        self.head = self.head.wrapping_add(n);
        // Release: our reads of the drained slots (in `f`, above) happen-before this store; pairs with
        // the Acquire load of head in `Producer::has_room`, which precedes any overwrite of them.
        self.shared.head.store(self.head, Ordering::Release);
        n
    }

    /// Reloads the producer's tail.
    fn refresh_tail(&mut self) {
        // Acquire: pairs with the Release store of tail in `Producer::publish`, making the slot
        // writes below the new tail visible before `drain` reads them.
        self.tail_cache = self.shared.tail.load(Ordering::Acquire);
        debug_assert!(self.tail_cache.wrapping_sub(self.head) <= self.capacity());
    }

    /// Calls `f` on the `len` records in slots `start..start + len`, which must lie in the filled
    /// range `head..tail_cache` (masked).
    #[cfg(not(loom))]
    fn read_run(&self, start: usize, len: usize, f: &mut impl FnMut(&[T])) {
        debug_assert!(start + len <= self.shared.slots.len());
        debug_assert!(start == self.head & self.mask || start == 0);
        debug_assert!(len <= self.tail_cache.wrapping_sub(self.head));
        debug_assert_eq!(size_of::<UnsafeCell<MaybeUninit<T>>>(), size_of::<T>());
        debug_assert_eq!(align_of::<UnsafeCell<MaybeUninit<T>>>(), align_of::<T>());
        // `as_ptr` on the whole slice: the pointer may access every slot (strict provenance).
        let base = self.shared.slots.as_ptr().cast::<T>();
        // SAFETY: (1) layout: `sync::UnsafeCell` and `core::cell::UnsafeCell` are `repr(transparent)`
        // and `MaybeUninit<T>` has T's layout, so the slots are a `[T]` and `base` points at slot 0;
        // start + len <= slots.len() (asserted; `drain` splits the run at the end of the slots).
        // (2) initialized: these slots are in `head..tail_cache`, written by the producer before its
        // Release store of tail, which our Acquire load in `refresh_tail` saw. (3) not mutated while
        // the slice lives: the producer writes them only after our Release store of head, which
        // `drain` makes after `f` returns, and `f` cannot keep the borrow.
        let run = unsafe { core::slice::from_raw_parts(base.add(start), len) };
        f(run);
        // The lines just read leave this core's caches, so that the producer's next write to them costs no
        // cross-core invalidation ([`evict_lines`]).
        #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
        evict_lines(run.as_ptr().cast(), core::mem::size_of_val(run));
    }

    /// Loom build of `read_run`: loom's cells are not laid out as a `[T]`, so each slot is read
    /// through a tracked `ConstPtr` into a copy, and the guards are held until `f` returns so loom
    /// checks that no write to these slots overlaps the read in the real (slice) version.
    #[cfg(loom)]
    fn read_run(&self, start: usize, len: usize, f: &mut impl FnMut(&[T])) {
        debug_assert!(start + len <= self.shared.slots.len());
        debug_assert!(len <= self.tail_cache.wrapping_sub(self.head));
        let guards: Vec<_> = self.shared.slots[start..start + len]
            .iter()
            .map(|cell| cell.get())
            .collect();
        // SAFETY: as in the non-loom `read_run`: the slots are initialized (written before the tail
        // Release that `refresh_tail` acquired) and loom checks the absence of concurrent writes.
        let copies: Vec<T> = guards
            .iter()
            .map(|slot| unsafe { slot.deref().assume_init_read() })
            .collect();
        f(&copies);
        drop(guards);
    }

    /// How many records are ready to drain (a snapshot; the producer may be adding more).
    pub(crate) fn len(&self) -> usize {
        // Relaxed: only a count is returned, no slot is read on the strength of it (`drain` loads
        // tail again with Acquire).
        self.shared.tail.load(Ordering::Relaxed).wrapping_sub(self.head)
    }

    /// How many records the ring holds when full (a power of two, at least 2).
    #[inline]
    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// How many records the producer dropped because the ring was full.
    ///
    /// Exact once [`Consumer::is_closed`] has returned true; before that, possibly a little behind.
    pub(crate) fn dropped_records(&self) -> u64 {
        // Relaxed: see `Producer::count_drops`; exactness after close comes from `is_closed`'s Acquire.
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// How many units (whole slices) the producer counted as lost to drops; exact like
    /// [`dropped_records`](Self::dropped_records).
    pub(crate) fn dropped_units(&self) -> u64 {
        // Relaxed: see `Producer::count_dropped_unit`.
        self.shared.dropped_units.load(Ordering::Relaxed)
    }

    /// How many bookkeeping records (loss markers) the producer counted as pushed; exact like
    /// [`dropped_records`](Self::dropped_records) once the ring is closed, and otherwise at most a few behind or
    /// ahead of the records drained.
    pub(crate) fn markers(&self) -> u64 {
        // Relaxed: see `Producer::count_marker`.
        self.shared.markers.load(Ordering::Relaxed)
    }

    /// Whether the [`Producer`] has been dropped (its thread exited). Once true, stays true.
    ///
    /// After this returns true, `drain` returns every record the producer pushed, and
    /// [`Consumer::dropped_records`] is final.
    pub(crate) fn is_closed(&self) -> bool {
        // Acquire: pairs with the Release store in `Producer::drop`, so the producer's final tail and
        // dropped-count stores are visible to our loads that follow.
        !self.shared.producer_alive.load(Ordering::Acquire)
    }

    /// Whether the [`Producer`] still exists: `!self.is_closed()`.
    #[cfg(test)]
    pub(crate) fn is_producer_alive(&self) -> bool {
        !self.is_closed()
    }

    /// Whether the producer is gone and every record it pushed has been drained. The collector then
    /// drops this Consumer, which frees the ring.
    #[cfg(test)]
    pub(crate) fn is_finished(&mut self) -> bool {
        if !self.is_closed() {
            return false;
        }
        // After the Acquire in `is_closed`, this load returns the final tail.
        self.refresh_tail();
        self.tail_cache == self.head
    }
}

impl<T> Drop for Consumer<T> {
    fn drop(&mut self) {
        // Relaxed: publishes no data; it only tells a producer in `push_all_waiting` to stop waiting.
        self.shared.consumer_alive.store(false, Ordering::Relaxed);
    }
}

impl<T> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("capacity", &(self.mask + 1))
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

/// Exponential backoff for [`Producer::push_all_waiting`]: spin hints first, then yield the thread.
struct Backoff {
    step: u32,
}

impl Backoff {
    /// After this many doublings (1 + 2 + ... + 64 = 127 `spin_loop` hints, a few µs with x86 `pause`
    /// at ~140 cycles on Skylake and later), yield to the OS instead. Same limit as crossbeam-utils'
    /// `Backoff::SPIN_LIMIT`.
    const SPIN_LIMIT: u32 = 6;
    /// After this many steps (spins, then yields: tens of µs, longer than a drain pass takes to free room),
    /// the consumer is not just a pass away but behind (its chunk budget full, a slow exporter): sleep,
    /// doubling from 20 µs to 1 ms (the collector's default poll interval), instead of yielding in a loop that
    /// keeps a core busy (1.3-1.8 cores for 4 waiting threads, measured).
    const YIELD_LIMIT: u32 = Self::SPIN_LIMIT + 64;

    fn new() -> Self {
        Self { step: 0 }
    }

    /// Whether to wake the consumer before this step: at the first, every 16th while spinning and yielding
    /// (each wake may cost it a pass), and before every sleep.
    fn wakes(&self) -> bool {
        self.step % 16 == 0 || self.step > Self::YIELD_LIMIT
    }

    fn snooze(&mut self) {
        // Under loom every spin hint is a scheduler yield; one per wait keeps the model small.
        if cfg!(loom) {
            yield_now();
            return;
        }
        if self.step <= Self::SPIN_LIMIT {
            for _ in 0..1u32 << self.step {
                spin_loop();
            }
        } else if self.step <= Self::YIELD_LIMIT {
            yield_now();
        } else {
            let doublings = (self.step - Self::YIELD_LIMIT - 1).min(6);
            std::thread::sleep(std::time::Duration::from_micros(20 << doublings).min(SLEEP_LIMIT));
        }
        self.step = self.step.saturating_add(1);
    }
}

/// The longest a waiting producer sleeps before it looks again.
const SLEEP_LIMIT: std::time::Duration = std::time::Duration::from_millis(1);

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;
    use std::thread;
    use std::time::Duration;

    /// Loop scale: Miri runs ~1000x slower than native code.
    const N: usize = if cfg!(miri) { 200 } else { 100_000 };

    /// A 16-byte record whose halves must agree, so a torn or stale slot read shows.
    fn rec(i: u64) -> [u64; 2] {
        [i, !i]
    }

    fn drain_all<T: Copy + Send>(c: &mut Consumer<T>) -> Vec<T> {
        let mut out = Vec::new();
        c.drain(usize::MAX, |s| out.extend_from_slice(s));
        out
    }

    #[test]
    fn ends_are_send() {
        fn assert_send<T: Send>() {}
        assert_send::<Producer<[u64; 2]>>();
        assert_send::<Consumer<[u64; 2]>>();
        assert_send::<Producer<u64>>();
        assert_send::<Consumer<u64>>();
    }

    #[test]
    fn capacity_is_a_power_of_two_at_least_2() {
        for (asked, got) in [(0, 2), (1, 2), (2, 2), (3, 4), (5, 8), (1024, 1024), (1025, 2048)] {
            let (p, c) = channel::<u64>(asked);
            assert_eq!((p.capacity(), c.capacity()), (got, got), "asked for {asked}");
        }
    }

    #[test]
    fn drain_returns_records_in_push_order() {
        let (mut p, mut c) = channel::<[u64; 2]>(8);
        assert_eq!(c.len(), 0);
        for i in 0..5 {
            p.try_push(rec(i)).unwrap();
        }
        assert_eq!(c.len(), 5);
        assert_eq!(drain_all(&mut c), (0..5).map(rec).collect::<Vec<_>>());
        assert_eq!(c.len(), 0);
        assert_eq!(c.drain(10, |_| panic!("called on an empty ring")), 0);
        p.try_push(rec(5)).unwrap();
        assert_eq!(drain_all(&mut c), [rec(5)]);
    }

    #[test]
    fn wraps_around_many_times() {
        // Fill, drain 3: with capacity 4 the run starts at every slot offset in turn.
        let (mut p, mut c) = channel::<[u64; 2]>(4);
        let (mut pushed, mut expected) = (0, 0);
        while expected < N as u64 {
            while p.try_push(rec(pushed)).is_ok() {
                pushed += 1;
            }
            assert_eq!(pushed - expected, 4, "full means capacity records");
            let n = c.drain(3, |s| {
                for &r in s {
                    assert_eq!(r, rec(expected));
                    expected += 1;
                }
            });
            assert_eq!(n, 3);
        }
        assert_eq!(p.dropped(), 0);
    }

    #[test]
    fn full_ring_rejects_and_counts_drops_exactly() {
        let (mut p, mut c) = channel::<u64>(4);
        for i in 0..4 {
            assert!(p.push_or_count_drop(i));
        }
        assert_eq!(p.try_push(99), Err(99));
        assert_eq!(p.dropped(), 0, "try_push does not count");
        for i in 0..7 {
            assert!(!p.push_or_count_drop(100 + i));
        }
        assert_eq!(p.dropped(), 7);
        assert_eq!(c.dropped_records(), 7);
        assert_eq!(drain_all(&mut c), [0, 1, 2, 3]);
        assert!(p.push_or_count_drop(4));
        assert_eq!(drain_all(&mut c), [4]);
        assert_eq!(c.dropped_records(), 7);
    }

    #[test]
    fn try_push_all_stores_all_or_nothing() {
        let (mut p, mut c) = channel::<u64>(4);
        assert!(p.try_push_all(&[]));
        assert!(p.try_push_all(&[0, 1, 2]));
        assert!(!p.try_push_all(&[3, 4]), "only one slot free");
        assert_eq!(c.len(), 3, "a rejected group leaves nothing behind");
        assert!(!p.try_push_all(&[0; 5]), "longer than the ring");
        assert_eq!(c.drain(2, |s| assert_eq!(s, [0, 1])), 2);
        // Holds 2; the group of 3 wraps: slots 3, 0, 1.
        assert!(p.try_push_all(&[3, 4, 5]));
        assert_eq!(p.dropped(), 0, "try_push_all does not count");
        p.count_drops(5);
        assert_eq!(c.dropped_records(), 5);
        let mut runs = Vec::new();
        c.drain(usize::MAX, |s| runs.push(s.to_vec()));
        assert_eq!(runs, [vec![2, 3], vec![4, 5]]);
    }

    #[test]
    fn drain_respects_max_and_splits_at_the_wrap() {
        let (mut p, mut c) = channel::<u64>(8);
        let mut runs = Vec::new();
        for i in 0..6 {
            p.try_push(i).unwrap();
        }
        assert_eq!(c.drain(4, |s| runs.push(s.to_vec())), 4);
        assert_eq!(runs, [vec![0, 1, 2, 3]]);
        // Holds 4..12: slots 4..8, then 0..4.
        for i in 6..12 {
            p.try_push(i).unwrap();
        }
        assert_eq!(p.try_push(12), Err(12));
        runs.clear();
        assert_eq!(c.drain(0, |s| runs.push(s.to_vec())), 0);
        assert_eq!(c.drain(7, |s| runs.push(s.to_vec())), 7);
        assert_eq!(runs, [vec![4, 5, 6, 7], vec![8, 9, 10]]);
        runs.clear();
        assert_eq!(c.drain(100, |s| runs.push(s.to_vec())), 1);
        assert_eq!(runs, [vec![11]]);
    }

    #[test]
    fn panic_in_drain_callback_consumes_nothing() {
        let (mut p, mut c) = channel::<u64>(4);
        p.try_push(1).unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.drain(4, |_| panic!("boom"))));
        assert!(caught.is_err());
        assert_eq!(drain_all(&mut c), [1]);
    }

    #[test]
    fn closed_ring_keeps_its_records_until_drained() {
        let (mut p, mut c) = channel::<u64>(8);
        for i in 0..5 {
            p.try_push(i).unwrap();
        }
        p.push_or_count_drop(5);
        assert!(!c.is_closed());
        assert!(c.is_producer_alive());
        assert!(!c.is_finished());
        drop(p);
        assert!(c.is_closed());
        assert!(!c.is_producer_alive());
        assert!(!c.is_finished(), "records remain");
        assert_eq!(c.drain(2, |s| assert_eq!(s, [0, 1])), 2);
        assert_eq!(drain_all(&mut c), [2, 3, 4, 5]);
        assert!(c.is_finished());
        assert_eq!(c.dropped_records(), 0);
    }

    #[test]
    fn either_end_may_be_dropped_first() {
        // Miri's leak check covers "freed when both are dropped".
        let (mut p, c) = channel::<[u64; 2]>(4);
        p.try_push(rec(1)).unwrap();
        drop(c);
        assert!(!p.is_consumer_alive());
        drop(p);
        let (mut p, c) = channel::<[u64; 2]>(4);
        p.try_push(rec(1)).unwrap();
        drop(p);
        drop(c);
    }

    #[test]
    fn push_waiting_returns_err_once_the_consumer_is_gone() {
        let (mut p, c) = channel::<u64>(2);
        assert!(p.push_all_waiting(&[0], || true));
        assert!(p.push_all_waiting(&[1], || true));
        assert!(p.is_consumer_alive());
        drop(c);
        assert!(!p.is_consumer_alive());
        assert!(!p.push_all_waiting(&[2], || true));
        assert!(
            !p.push_all_waiting(&[1, 2, 3], || true),
            "longer than the ring: never fits"
        );
    }

    /// The producer may know that nobody will make room (a child made by `fork` has no collector): its
    /// `wake` says so and the wait ends, with the consumer still alive and the ring full.
    #[test]
    fn push_waiting_ends_when_wake_says_there_is_nothing_to_wait_for() {
        let (mut p, _c) = channel::<u64>(2);
        assert!(p.push_all_waiting(&[0, 1], || true));
        let mut wakes = 0;
        assert!(!p.push_all_waiting(&[2], || {
            wakes += 1;
            wakes < 3
        }));
        assert_eq!(wakes, 3);
        assert!(p.is_consumer_alive());
    }

    /// A producer that waits long (a collector far behind) sleeps rather than spin or yield in a loop: on
    /// a machine whose cores the program keeps busy, its waiting must not take a core from the collector.
    #[test]
    #[cfg_attr(miri, ignore = "measures CPU time")]
    fn a_long_wait_takes_little_cpu_and_ends_when_room_comes() {
        fn thread_cpu() -> Duration {
            let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID exists on every Unix.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
            Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
        }
        let (mut p, mut c) = channel::<u64>(2);
        p.try_push(0).unwrap();
        p.try_push(1).unwrap();
        let waiter = thread::spawn(move || {
            let (cpu, wall) = (thread_cpu(), std::time::Instant::now());
            let pushed = p.push_all_waiting(&[7], || true);
            (pushed, thread_cpu() - cpu, wall.elapsed())
        });
        thread::sleep(Duration::from_millis(300));
        let mut taken = Vec::new();
        c.drain(usize::MAX, |s| taken.extend_from_slice(s));
        let (pushed, cpu, wall) = waiter.join().unwrap();
        assert!(pushed);
        assert_eq!(taken, [0, 1]);
        assert!(wall >= Duration::from_millis(300), "{wall:?}");
        // Spinning and yielding take the whole 300 ms.
        assert!(cpu < Duration::from_millis(60), "{cpu:?} of CPU in {wall:?} of waiting");
        let mut rest = Vec::new();
        c.drain(usize::MAX, |s| rest.extend_from_slice(s));
        assert_eq!(rest, [7]);
    }

    #[test]
    fn push_waiting_stops_waiting_when_the_consumer_drops() {
        let (mut p, c) = channel::<u64>(2);
        p.try_push(0).unwrap();
        p.try_push(1).unwrap();
        let waiter = thread::spawn(move || p.push_all_waiting(&[7], || true));
        thread::sleep(Duration::from_millis(10));
        drop(c);
        assert!(!waiter.join().unwrap());
    }

    #[test]
    fn two_threads_lossless_delivers_everything_in_order() {
        let (mut p, mut c) = channel::<[u64; 2]>(64);
        let producer = thread::spawn(move || {
            for i in 0..N as u64 {
                assert!(p.push_all_waiting(&[rec(i)], || true));
            }
            p.dropped()
            // `p` is dropped here: the thread's exit closes the ring.
        });
        let mut expected = 0;
        while !c.is_finished() {
            let n = c.drain(usize::MAX, |s| {
                assert!(!s.is_empty());
                for &r in s {
                    assert_eq!(r, rec(expected));
                    expected += 1;
                }
            });
            if n == 0 {
                thread::yield_now();
            }
        }
        assert_eq!(expected, N as u64);
        assert_eq!(producer.join().unwrap(), 0);
        assert_eq!(c.dropped_records(), 0);
    }

    #[test]
    fn two_threads_drop_mode_accounts_for_every_record() {
        let (mut p, mut c) = channel::<[u64; 2]>(16);
        let producer = thread::spawn(move || {
            let mut stored = 0u64;
            for i in 0..N as u64 {
                stored += u64::from(p.push_or_count_drop(rec(i)));
            }
            (stored, p.dropped())
        });
        let (mut received, mut last) = (0u64, None);
        while !c.is_finished() {
            let n = c.drain(usize::MAX, |s| {
                for &r in s {
                    assert_eq!(r[1], !r[0], "torn record");
                    assert!(last < Some(r[0]), "{:?} then {}", last, r[0]);
                    last = Some(r[0]);
                    received += 1;
                }
            });
            if n == 0 {
                thread::yield_now();
            }
        }
        let (stored, dropped) = producer.join().unwrap();
        assert_eq!(received + c.dropped_records(), N as u64);
        assert_eq!((received, c.dropped_records()), (stored, dropped));
    }

    #[derive(Debug, Clone)]
    enum Op {
        TryPush(u64),
        TryPushAll(Vec<u64>),
        PushOrCountDrop(u64),
        Drain(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u64>().prop_map(Op::TryPush),
            proptest::collection::vec(any::<u64>(), 0..6).prop_map(Op::TryPushAll),
            any::<u64>().prop_map(Op::PushOrCountDrop),
            (0usize..12).prop_map(Op::Drain),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: if cfg!(miri) { 4 } else { 256 },
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn behaves_like_a_bounded_vecdeque(asked in 0usize..10, ops in proptest::collection::vec(op(), 0..200)) {
            let (mut p, mut c) = channel::<u64>(asked);
            let cap = p.capacity();
            let mut model = VecDeque::new();
            let mut dropped = 0u64;
            for op in ops {
                match op {
                    Op::TryPush(v) => {
                        let r = p.try_push(v);
                        if model.len() < cap {
                            prop_assert_eq!(r, Ok(()));
                            model.push_back(v);
                        } else {
                            prop_assert_eq!(r, Err(v));
                        }
                    }
                    Op::TryPushAll(vs) => {
                        let fits = model.len() + vs.len() <= cap;
                        prop_assert_eq!(p.try_push_all(&vs), fits);
                        if fits {
                            model.extend(vs);
                        }
                    }
                    Op::PushOrCountDrop(v) => {
                        let stored = p.push_or_count_drop(v);
                        prop_assert_eq!(stored, model.len() < cap);
                        if stored {
                            model.push_back(v);
                        } else {
                            dropped += 1;
                        }
                    }
                    Op::Drain(max) => {
                        let (mut got, mut runs) = (Vec::new(), 0);
                        let n = c.drain(max, |s| {
                            runs += 1;
                            got.extend_from_slice(s);
                        });
                        let want: Vec<u64> = model.drain(..max.min(model.len())).collect();
                        prop_assert_eq!(n, want.len());
                        prop_assert_eq!(got, want);
                        prop_assert!(runs <= 2 && (runs == 0) == (n == 0));
                    }
                }
                prop_assert_eq!(c.len(), model.len());
                prop_assert_eq!(c.dropped_records(), dropped);
                prop_assert_eq!(p.dropped(), dropped);
            }
        }
    }
}
