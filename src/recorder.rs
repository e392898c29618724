//! The hot path's side: each thread's ring for each live timeline, registered with the collector on the
//! thread's first record and closed when the thread exits.
//!
//! After the first record a push is: a few loads and stores of plain thread-local `Cell`s (the cached timeline
//! id and its ring, and the thread's record lock, which keeps a record made while another is being made
//! from aliasing the ring), one compare of the timeline id, one ring push. No allocation, no lock shared
//! with another thread, no system call.

use std::cell::{Cell, RefCell};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crossbeam_channel::Sender;

use crate::clock::TickSource;
use crate::record::{payload_records, Kind, Record};
use crate::ring::{channel, Producer};

/// What the collector is told over its control channel.
pub(crate) enum Control {
    /// A thread recorded its first record into this timeline.
    NewRing {
        consumer: crate::ring::Consumer<Record>,
        tid: u32,
        name: String,
    },
    /// A GPU device or queue joined the timeline.
    Gpu(crate::gpu::GpuControl),
    /// Drain everything recorded before this message, export, flush, then answer.
    Flush(Sender<Result<(), String>>),
    /// Drain everything, finish the exporters, answer and exit.
    Shutdown(Sender<Result<(), String>>),
}

/// What the hot path needs to know about a timeline. Shared by the layer, the native macros and the handle.
pub(crate) struct Shared {
    pub(crate) id: u64,
    pub(crate) control: Sender<Control>,
    pub(crate) lossless: bool,
    pub(crate) ring_capacity: usize,
    pub(crate) source: TickSource,
    pub(crate) running: AtomicBool,
}

static NEXT_TIMELINE_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_timeline_id() -> u64 {
    NEXT_TIMELINE_ID.fetch_add(1, Ordering::Relaxed)
}

/// The timeline native macros (`scope!`, `instant!`, `counter!`) record into: the last one started that is
/// still running.
static CURRENT: RwLock<Option<Arc<Shared>>> = RwLock::new(None);
/// `CURRENT`'s id (0: none), read on every native record to validate the thread's cached ring.
static CURRENT_ID: AtomicU64 = AtomicU64::new(0);

pub(crate) fn set_current(shared: &Arc<Shared>) {
    let mut current = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    *current = Some(shared.clone());
    CURRENT_ID.store(shared.id, Ordering::Release);
}

pub(crate) fn clear_current(id: u64) {
    let mut current = CURRENT.write().unwrap_or_else(|e| e.into_inner());
    if current.as_ref().is_some_and(|s| s.id == id) {
        *current = None;
        CURRENT_ID.store(0, Ordering::Release);
    }
}

struct LocalRing {
    timeline: u64,
    producer: Producer<Record>,
    lossless: bool,
    source: TickSource,
}

impl LocalRing {
    /// Pushes `record`; if the ring is full, waits (lossless) or counts it as dropped. The mode is looked at
    /// only then, so the common case is the bare push.
    #[inline(always)]
    fn push(&mut self, record: Record) {
        if let Err(record) = self.producer.try_push(record) {
            self.push_full(record);
        }
    }

    #[cold]
    #[inline(never)]
    fn push_full(&mut self, record: Record) {
        if self.lossless {
            // Err only when the collector is gone: then there is nobody left to lose the record to.
            let _ = self.producer.push_waiting(record);
        } else {
            self.producer.count_drops(1);
        }
    }

    /// Pushes all of `group` or none; if it does not fit, waits (lossless) or counts it as dropped. True when
    /// the group is in the ring.
    #[inline]
    fn push_group(&mut self, group: &[Record]) -> bool {
        self.producer.try_push_all(group) || self.push_group_full(group)
    }

    #[cold]
    #[inline(never)]
    fn push_group_full(&mut self, group: &[Record]) -> bool {
        if self.lossless {
            while !self.producer.try_push_all(group) {
                if !self.producer.is_consumer_alive() {
                    return false;
                }
                std::thread::yield_now();
            }
            true
        } else {
            self.producer.count_drops(group.len() as u64);
            false
        }
    }
}

/// One of this thread's rings, on the heap so that `HOT_RING` can point at it while [`Rings`] grows and
/// reorders. Held as the raw pointer of a leaked `Box`: a `Box` would assert unique access to the ring
/// each time it moves, which would invalidate `HOT_RING`'s pointer (Stacked Borrows).
struct OwnedRing {
    timeline: u64,
    ring: NonNull<LocalRing>,
}

impl OwnedRing {
    fn new(ring: LocalRing) -> Self {
        OwnedRing {
            timeline: ring.timeline,
            ring: NonNull::from(Box::leak(Box::new(ring))),
        }
    }

    /// Whether the collector still takes this ring's records.
    fn is_consumer_alive(&self) -> bool {
        debug_assert_eq!(HOT_ID.get(), LOCKED);
        // SAFETY: `ring` came from `Box::leak` in `new` and is freed only by our `drop`, so it is live. The
        // caller holds this thread's record lock (`HOT_ID == LOCKED`, asserted above; only `register`
        // calls this, from `with_ring_slow`, which took the lock), so no `&mut LocalRing` exists: one is
        // made only by `with_ring_locked` and `Release::drop`, under the lock, and dies before it is released.
        unsafe { self.ring.as_ref() }.producer.is_consumer_alive()
    }
}

impl Drop for OwnedRing {
    fn drop(&mut self) {
        debug_assert!(HOT_ID.get() == 0 || HOT_ID.get() == LOCKED);
        // SAFETY: `ring` came from `Box::leak` in `new` and is freed only here, once. Nothing uses it after:
        // `HOT_RING` is read only while `HOT_ID` holds a timeline id, and `HOT_ID` does not now (asserted
        // above): either `Rings::drop` set it to 0, or `register` holds the record lock, which
        // `with_ring_slow` releases with `HOT_ID` 0 or after pointing `HOT_RING` at a ring still owned.
        // No `&mut` to it is alive: one exists only while `f` runs under the lock, and `f` does not free rings.
        drop(unsafe { Box::from_raw(self.ring.as_ptr()) });
    }
}

/// This thread's rings, one per timeline it recorded into. Dropped when the thread exits, which drops the
/// producers: the collector sees them closed, drains the rest and frees the rings.
struct Rings(Vec<OwnedRing>);

impl Drop for Rings {
    fn drop(&mut self) {
        // Thread exit. A record made from a thread-local destructor that runs after this one must not use
        // the freed ring: with no ring cached it takes the slow path, which finds `RINGS` gone.
        debug_assert_ne!(HOT_ID.get(), LOCKED, "a thread cannot exit while making a record");
        HOT_ID.set(0);
        HOT_RING.set(ptr::null_mut());
        self.0.clear();
    }
}

/// `HOT_ID` while this thread is making a record: the thread's record lock. No timeline has this id
/// (`next_timeline_id` counts up from 1).
const LOCKED: u64 = u64::MAX;

thread_local! {
    /// The timeline whose ring `HOT_RING` caches, so that a record for it takes no lookup: 0 when none,
    /// [`LOCKED`] while this thread is making a record. Plain `Cell`s with `const` initialisers and no
    /// destructor, so reading one is a single load from the thread's TLS block with no state check, and
    /// they stay usable while other thread-locals are destroyed.
    static HOT_ID: Cell<u64> = const { Cell::new(0) };
    /// This thread's ring for `HOT_ID` while that holds a timeline id: a ring owned by `RINGS`.
    static HOT_RING: Cell<*mut LocalRing> = const { Cell::new(ptr::null_mut()) };
    /// Records this thread tried to make while it was making another (from an allocator or a signal
    /// handler that records): counted as dropped on the ring in use when the lock is released.
    static REENTERED: Cell<u64> = const { Cell::new(0) };
    static RINGS: RefCell<Rings> = const { RefCell::new(Rings(Vec::new())) };
    /// Scratch space for encoding fields and assembling record groups, reused so the hot path never allocates
    /// after warm-up.
    static SCRATCH: RefCell<(Vec<u8>, Vec<Record>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Where a record goes: a layer's own timeline, or the current one for native macros.
pub(crate) trait Target {
    /// The timeline's id; 0 for none (the record is not taken).
    fn id(&self) -> u64;
    /// The timeline itself, to register a new ring (slow path, once per thread).
    fn shared(&self) -> Option<Arc<Shared>>;
}

impl Target for Arc<Shared> {
    #[inline(always)]
    fn id(&self) -> u64 {
        self.as_ref().id
    }
    fn shared(&self) -> Option<Arc<Shared>> {
        Some(self.clone())
    }
}

/// The timeline native macros (`scope!`, `instant!`, `counter!`) record into.
pub(crate) struct Current;

impl Target for Current {
    #[inline(always)]
    fn id(&self) -> u64 {
        CURRENT_ID.load(Ordering::Acquire)
    }
    fn shared(&self) -> Option<Arc<Shared>> {
        CURRENT.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Runs `f` with this thread's ring for `target`, creating and registering it on first use.
///
/// The thread's record lock: `f` gets a `&mut LocalRing` only while `HOT_ID` is [`LOCKED`]. A record
/// attempted meanwhile on this thread (`f` cannot call user code, but it may allocate, and a global allocator
/// or a signal handler may record) finds the lock taken and is counted as dropped instead of aliasing the
/// ring. Fast path: one TLS load and compare, one TLS load of the ring, the lock and unlock stores, and one
/// TLS load to check for such records.
#[inline(always)]
fn with_ring(target: &impl Target, f: impl FnOnce(&mut LocalRing)) {
    let id = target.id();
    if id == 0 {
        return;
    }
    if HOT_ID.get() != id {
        return with_ring_slow(target, id, f);
    }
    let ring = HOT_RING.get();
    HOT_ID.set(LOCKED);
    // SAFETY: `HOT_ID` held a timeline id, so `HOT_RING` points at a live ring that no `&mut` refers to
    // (the invariants `with_ring_locked` states), and we have just taken the lock.
    unsafe { with_ring_locked(id, ring, f) }
}

/// Runs `f` on `ring`, then releases the thread's record lock with `ring` cached as `id`'s.
///
/// # Safety
///
/// The caller has taken the record lock (`HOT_ID == LOCKED`) and `ring` is this thread's live ring for
/// timeline `id`, owned by `RINGS`, with no reference to it alive. These hold for `HOT_RING` whenever `HOT_ID`
/// holds a timeline id: rings are freed only by `register` (under the lock, which `with_ring_slow` then
/// releases with `HOT_ID` 0, or with `HOT_ID` = `id` after pointing `HOT_RING` at a ring found or registered
/// after the freeing) and by `Rings::drop` (which sets `HOT_ID` to 0 first); a `&mut` to a ring is made only
/// here and in `Release::drop`, under the lock, and dies before the lock is released.
#[inline(always)]
unsafe fn with_ring_locked(id: u64, ring: *mut LocalRing, f: impl FnOnce(&mut LocalRing)) {
    debug_assert_eq!(HOT_ID.get(), LOCKED);
    debug_assert!(!ring.is_null());
    let release = Release { id, ring };
    // SAFETY: live and unaliased by the caller's contract; the lock keeps any other `&mut` from being made
    // until `release` drops, after this one's last use.
    f(unsafe { &mut *release.ring });
}

/// Releases the thread's record lock when dropped (also when `f` unwinds, so a panic does not leave it
/// taken), with `HOT_ID` set to `id` (0: no ring cached); `ring` is `HOT_RING` (for `id`), or null.
struct Release {
    id: u64,
    ring: *mut LocalRing,
}

impl Drop for Release {
    #[inline(always)]
    fn drop(&mut self) {
        debug_assert_eq!(HOT_ID.get(), LOCKED);
        let reentered = REENTERED.get();
        if reentered != 0 && !self.ring.is_null() {
            // SAFETY: we still hold the lock; `ring` is live (the contract of `with_ring_locked`, which made
            // this `Release`), and the `&mut` it gave `f` is dead (`f` returned or unwound).
            count_reentered(unsafe { &mut *self.ring }, reentered);
        }
        HOT_ID.set(self.id);
    }
}

#[cold]
fn count_reentered(ring: &mut LocalRing, reentered: u64) {
    REENTERED.set(0);
    ring.producer.count_drops(reentered);
}

/// [`with_ring`] when the cached ring is not `target`'s: find or register the ring and cache it. Or when the
/// thread is making a record already (`HOT_ID == LOCKED`): count this one as dropped.
#[cold]
#[inline(never)]
fn with_ring_slow(target: &impl Target, id: u64, f: impl FnOnce(&mut LocalRing)) {
    if HOT_ID.get() == LOCKED {
        REENTERED.set(REENTERED.get() + 1);
        return;
    }
    // Held while the rings are looked up and registered too: `register` allocates and may free rings.
    HOT_ID.set(LOCKED);
    // If no ring is found (timeline stopped, thread exiting) or the lookup unwinds: release with none
    // cached, since `register` may have freed the cached one. A re-entered record then waits for the next
    // release that has a ring to count it on.
    let none_found = Release {
        id: 0,
        ring: ptr::null_mut(),
    };
    let found = RINGS.try_with(|rings| {
        let mut rings = rings.try_borrow_mut().ok()?;
        let rings = &mut rings.0;
        if let Some(pos) = rings.iter().position(|r| r.timeline == id) {
            // Most recently used first, so a thread that switches between timelines finds them early.
            rings.swap(0, pos);
            return Some(rings[0].ring);
        }
        let shared = target.shared().filter(|s| s.id == id)?;
        register(&shared, rings)
    });
    let Ok(Some(ring)) = found else { return };
    std::mem::forget(none_found);
    HOT_RING.set(ring.as_ptr());
    // SAFETY: we hold the lock; `ring` is owned by `RINGS` (found or registered just now, not freed since)
    // and has no reference to it alive, since `&mut`s to rings are made only under the lock.
    unsafe { with_ring_locked(id, ring.as_ptr(), f) }
}

#[cold]
fn register(shared: &Shared, rings: &mut Vec<OwnedRing>) -> Option<NonNull<LocalRing>> {
    if !shared.running.load(Ordering::Acquire) {
        return None;
    }
    // Rings of timelines that have shut down are of no use any more.
    rings.retain(OwnedRing::is_consumer_alive);
    let (producer, consumer) = channel(shared.ring_capacity);
    let thread = std::thread::current();
    let tid = current_tid();
    let name = thread.name().map_or_else(|| format!("thread-{tid}"), str::to_owned);
    shared.control.send(Control::NewRing { consumer, tid, name }).ok()?;
    rings.insert(
        0,
        OwnedRing::new(LocalRing {
            timeline: shared.id,
            producer,
            lossless: shared.lossless,
            source: shared.source,
        }),
    );
    Some(rings[0].ring)
}

fn current_tid() -> u32 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid has no preconditions and cannot fail.
        (unsafe { libc::gettid() }) as u32
    }
    #[cfg(not(target_os = "linux"))]
    {
        std::process::id()
    }
}

/// Records one record stamped now.
#[inline(always)]
pub(crate) fn record_now(shared: &impl Target, kind: Kind, payload: u64) {
    with_ring(shared, |ring| {
        let ticks = ring.source.read().0;
        ring.push(Record::new(kind, ticks, payload));
    });
}

/// Records one record without a timestamp (bookkeeping records whose time does not matter).
#[inline(always)]
pub(crate) fn record_untimed(shared: &impl Target, kind: Kind, payload: u64) {
    with_ring(shared, |ring| ring.push(Record::new(kind, 0, payload)));
}

/// Most data records one group may carry (16 KiB of fields); a payload beyond it is cut at a field boundary by
/// the encoder's caller.
pub(crate) const MAX_PAYLOAD_BYTES: usize = 16 * 1024;

/// Records a group: `kind` with `payload_word`, then a header `[len, meta]` and the encoded fields that
/// `encode` writes. All or nothing.
pub(crate) fn record_group(
    shared: &impl Target,
    kind: Kind,
    timed: bool,
    payload_word: u64,
    meta: u64,
    encode: impl FnOnce(&mut Vec<u8>),
) -> bool {
    let mut pushed = false;
    let _ = SCRATCH.try_with(|scratch| {
        let Ok(mut scratch) = scratch.try_borrow_mut() else {
            // Re-entered: a field's `Debug` impl recorded while this thread was encoding. Count the inner
            // record as dropped rather than lose it silently.
            with_ring(shared, |ring| ring.producer.count_drops(1));
            return;
        };
        let (bytes, group) = &mut *scratch;
        bytes.clear();
        encode(bytes);
        bytes.truncate(MAX_PAYLOAD_BYTES);
        with_ring(shared, |ring| {
            // A group must fit the ring with room to spare, or a lossless producer would wait forever: cut
            // the payload (the collector stops decoding at the cut field).
            let max_data_records = (ring.producer.capacity() / 2).saturating_sub(2);
            bytes.truncate(max_data_records * 16);
            group.clear();
            let ticks = if timed { ring.source.read().0 } else { 0 };
            group.push(Record::new(kind, ticks, payload_word));
            group.push(Record::new(Kind::Data, bytes.len() as u64, meta));
            group.extend(payload_records(bytes));
            pushed = ring.push_group(group);
        });
    });
    pushed
}

/// Announces span `id`, created without field values, with the metadata at address `meta`: one
/// [`Kind::SpanNewBare`] record, or where the address does not fit one, a [`Kind::SpanNew`] group with an
/// empty payload. No encoding, no scratch space.
#[inline]
pub(crate) fn record_span_new_bare(shared: &impl Target, id: u64, meta: u64) {
    match Record::span_new_bare(meta, id) {
        Some(record) => with_ring(shared, |ring| ring.push(record)),
        None => with_ring(shared, |ring| {
            let group = [Record::new(Kind::SpanNew, 0, id), Record::new(Kind::Data, 0, meta)];
            ring.push_group(&group);
        }),
    }
}

/// Records a counter value: the record and one data record with the value's bits.
pub(crate) fn record_counter(shared: &impl Target, callsite: u64, value: f64) {
    with_ring(shared, |ring| {
        let ticks = ring.source.read().0;
        let group = [
            Record::new(Kind::Counter, ticks, callsite),
            Record {
                word0: value.to_bits(),
                word1: 0,
            },
        ];
        ring.push_group(&group);
    });
}

/// Counts one record as dropped on this thread's ring (a record that could not be made, e.g. a GPU scope that
/// found no free timestamp pair).
pub(crate) fn count_drop(shared: &Arc<Shared>) {
    with_ring(shared, |ring| ring.producer.count_drops(1));
}

/// Records a GPU scope's begin: `GpuBegin` stamped now with the call site, then a header `[len, key]` and the
/// encoded fields, all or nothing. True when the group is in the ring.
pub(crate) fn record_gpu_begin(
    shared: &Arc<Shared>,
    callsite: u64,
    key: u64,
    encode: Option<impl FnOnce(&mut Vec<u8>)>,
) -> bool {
    match encode {
        // The same group as any field payload: header `[len, key]`, then the encoded fields.
        Some(encode) => record_group(shared, Kind::GpuBegin, true, callsite, key, encode),
        None => {
            let mut pushed = false;
            with_ring(shared, |ring| {
                let ticks = ring.source.read().0;
                let group = [
                    Record::new(Kind::GpuBegin, ticks, callsite),
                    Record::new(Kind::Data, 0, key),
                ];
                pushed = ring.push_group(&group);
            });
            pushed
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use crossbeam_channel::{unbounded, Receiver};

    use super::*;
    use crate::ring::Consumer;

    /// A running timeline whose control channel the test reads instead of a collector.
    fn timeline() -> (Arc<Shared>, Receiver<Control>) {
        let (control, rx) = unbounded();
        let shared = Arc::new(Shared {
            id: next_timeline_id(),
            control,
            lossless: false,
            ring_capacity: 64,
            source: TickSource::Monotonic,
            running: AtomicBool::new(true),
        });
        (shared, rx)
    }

    /// The ring the next `NewRing` message hands over.
    fn new_ring(rx: &Receiver<Control>) -> Consumer<Record> {
        match rx.try_recv() {
            Ok(Control::NewRing { consumer, .. }) => consumer,
            _ => panic!("no ring was registered"),
        }
    }

    /// The payloads of the records the ring holds now.
    fn payloads(consumer: &mut Consumer<Record>) -> Vec<u64> {
        let mut out = Vec::new();
        while consumer.drain(usize::MAX, |run| out.extend(run.iter().map(|r| r.word1))) > 0 {}
        out
    }

    #[test]
    fn records_for_several_timelines_on_one_thread_go_to_their_own_rings() {
        let (a, a_rx) = timeline();
        let (b, b_rx) = timeline();
        let (c, c_rx) = timeline();
        let order: [(&Arc<Shared>, u64); 8] = [(&a, 1), (&b, 2), (&a, 3), (&a, 4), (&c, 5), (&b, 6), (&c, 7), (&a, 8)];
        for (target, payload) in order {
            record_now(target, Kind::Instant, payload);
        }
        let (mut a_ring, mut b_ring, mut c_ring) = (new_ring(&a_rx), new_ring(&b_rx), new_ring(&c_rx));
        assert_eq!(payloads(&mut a_ring), [1, 3, 4, 8]);
        assert_eq!(payloads(&mut b_ring), [2, 6]);
        assert_eq!(payloads(&mut c_ring), [5, 7]);
        assert!(
            a_rx.try_recv().is_err() && b_rx.try_recv().is_err(),
            "one ring per thread and timeline"
        );
    }

    #[test]
    fn a_record_made_while_making_one_is_counted_as_dropped() {
        let (a, a_rx) = timeline();
        let (b, b_rx) = timeline();
        record_now(&b, Kind::Instant, 1);
        with_ring(&a, |ring| {
            ring.push(Record::new(Kind::Instant, 0, 2));
            // As from an allocator or a signal handler that records: the ring in use must not be aliased,
            // and neither may the thread's ring list, whatever the timeline.
            record_now(&a, Kind::Instant, 3);
            record_untimed(&b, Kind::Instant, 4);
            record_counter(&a, 5, 1.0);
        });
        record_now(&a, Kind::Instant, 6);
        record_now(&b, Kind::Instant, 7);
        let (mut a_ring, mut b_ring) = (new_ring(&a_rx), new_ring(&b_rx));
        assert_eq!(payloads(&mut a_ring), [2, 6]);
        assert_eq!(payloads(&mut b_ring), [1, 7]);
        // Counted on the ring that was in use.
        assert_eq!(a_ring.dropped_records() + b_ring.dropped_records(), 3);
    }

    #[test]
    fn a_panic_while_making_a_record_releases_the_lock() {
        let (a, a_rx) = timeline();
        let result = catch_unwind(AssertUnwindSafe(|| {
            with_ring(&a, |_| panic!("in the middle of a record"))
        }));
        assert!(result.is_err());
        record_now(&a, Kind::Instant, 1);
        assert_eq!(payloads(&mut new_ring(&a_rx)), [1]);
    }

    #[test]
    fn a_stopped_timeline_takes_nothing_and_others_go_on() {
        let (a, a_rx) = timeline();
        let (b, b_rx) = timeline();
        record_now(&b, Kind::Instant, 1);
        record_now(&a, Kind::Instant, 2);
        // a's ring is the cached one when a shuts down: its collector drops the consumer.
        a.running.store(false, Ordering::Release);
        drop(new_ring(&a_rx));
        // Registering c frees a's ring.
        let (c, c_rx) = timeline();
        record_now(&c, Kind::Instant, 3);
        record_now(&a, Kind::Instant, 4);
        record_now(&b, Kind::Instant, 5);
        record_now(&a, Kind::Instant, 6);
        record_now(&c, Kind::Instant, 7);
        assert!(a_rx.try_recv().is_err(), "a stopped timeline registers no ring");
        assert_eq!(payloads(&mut new_ring(&b_rx)), [1, 5]);
        assert_eq!(payloads(&mut new_ring(&c_rx)), [3, 7]);
    }

    #[test]
    fn thread_exit_closes_the_rings_and_keeps_their_records() {
        struct RecordsOnDrop(Arc<Shared>);
        impl Drop for RecordsOnDrop {
            fn drop(&mut self) {
                // Runs during thread exit, before or after `RINGS` is destroyed: either the record lands in
                // the ring, or it is lost; it must never touch a freed ring.
                record_now(&self.0, Kind::Instant, 99);
            }
        }
        thread_local! {
            static EARLY: RefCell<Option<RecordsOnDrop>> = const { RefCell::new(None) };
            static LATE: RefCell<Option<RecordsOnDrop>> = const { RefCell::new(None) };
        }
        let (a, a_rx) = timeline();
        let (b, b_rx) = timeline();
        let (a2, b2) = (a.clone(), b.clone());
        // Not a scoped thread: `join` must wait for the thread-local destructors, which run after the closure.
        std::thread::spawn(move || {
            // Destructors registered before and after `RINGS`'s, so that one of them likely runs after it.
            EARLY.with(|early| *early.borrow_mut() = Some(RecordsOnDrop(a2.clone())));
            record_now(&a2, Kind::Instant, 1);
            record_now(&b2, Kind::Instant, 2);
            record_now(&a2, Kind::Instant, 3);
            LATE.with(|late| *late.borrow_mut() = Some(RecordsOnDrop(a2.clone())));
        })
        .join()
        .unwrap();
        let (mut a_ring, mut b_ring) = (new_ring(&a_rx), new_ring(&b_rx));
        assert!(a_ring.is_closed() && b_ring.is_closed());
        let a_records = payloads(&mut a_ring);
        assert!(
            [&[1, 3][..], &[1, 3, 99], &[1, 3, 99, 99]].contains(&&a_records[..]),
            "{a_records:?}"
        );
        assert_eq!(payloads(&mut b_ring), [2]);
    }
}
