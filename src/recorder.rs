//! The hot path's side: each thread's ring for each live timeline, registered with the collector on the
//! thread's first record and closed when the thread exits.
//!
//! After the first record a push is: a few loads and stores of plain thread-local `Cell`s (the cached timeline
//! id and its ring, and the thread's record lock, which keeps a record made while another is being made
//! from aliasing the ring), one compare of the timeline id, one ring push. No allocation (the field scratch
//! space is sized for the largest payload on the thread's first record with fields; a ring that grows is the
//! one exception, see `LocalRing::grow`), no lock shared with another thread, no system call
//! (`tests/no_alloc.rs` counts allocations).
//!
//! # Whole slices only
//!
//! In drop mode (the default) a full ring drops records, and it never drops half a slice: every begin
//! (a span enter, a scope begin) that goes into the ring reserves the slot of its end, and a begin that
//! would not leave room for its own end and every end still owed is refused. A refused begin's end is then
//! dropped too, so the pair is lost whole. Every dropped record is counted (the ring's drop counter), and
//! the next record that goes in is preceded by a `Gap` record saying how many went missing there, so the
//! collector can show where the loss happened and mark every slice open around it. The room an owed end
//! keeps is two slots, its own and one for a `Gap` before it, so the gap always lands inside the slices the
//! loss happened in; a record that is not an end and has no room for the gap before it is dropped too,
//! rather than go in ahead of the gap.

use std::cell::{Cell, RefCell};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::thread::Thread;

use crossbeam_channel::Sender;

use crate::callsite::NativeCallsite;
use crate::clock::TickSource;
use crate::codec::{self, FieldEncoder, Kind, Parent, Record, DATA_BYTES, MAX_PAYLOAD_BYTES};
use crate::control::{callsite_key, Control};
use crate::live::{self, LiveSink};
use crate::ring::{channel, Producer};

/// What the hot path needs to know about a timeline. Shared by the layer, the native macros and the handle.
pub(crate) struct Shared {
    pub(crate) id: u64,
    pub(crate) control: Sender<Control>,
    pub(crate) lossless: bool,
    /// Records per ring at first (a power of two).
    pub(crate) ring_capacity: usize,
    /// Records a ring may grow to in drop mode before a full ring drops records.
    pub(crate) max_ring_capacity: usize,
    pub(crate) source: TickSource,
    /// Span creations are stamped (a timeline that shows async task lifetimes needs them).
    pub(crate) time_creations: bool,
    /// Every span is an async task (`AsyncTasks::Always`): closes are always stamped.
    pub(crate) every_span_a_task: bool,
    pub(crate) running: AtomicBool,
    /// Most field payload bytes one group may carry: the format's limit, or less in a small ring (a group
    /// may fill at most half the ring, so a lossless producer can always wait for room).
    pub(crate) max_payload_bytes: usize,
    /// Ring numbers, for span serials and the collector's bookkeeping.
    next_ring: AtomicU32,
    /// The collector's drain thread, woken early when a ring passes half full.
    pub(crate) drain_thread: OnceLock<Thread>,
    /// Test hook: while set, the drain stage drains only for a flush or shutdown.
    pub(crate) drain_paused: AtomicBool,
    /// The drain stage's chunk budget is full (the processing stage is that far behind): rings do not grow,
    /// so the memory the rings and the chunks take stays bounded.
    pub(crate) budget_full: AtomicBool,
    /// Test hook: while set, the processing stage takes no input (a collector that lags).
    pub(crate) processing_paused: AtomicBool,
    /// The timeline's live sink, told of each thread before that thread's first record (set once at start).
    pub(crate) live: OnceLock<&'static dyn LiveSink>,
    /// The process the timeline runs in: a child made by `fork` has a copy of this but no collector.
    pid: u32,
    /// Records no ring could take (`TimelineStats::unrecorded_records`).
    pub(crate) unrecorded: AtomicU64,
}

impl Shared {
    /// A timeline with rings of a fixed size (tests).
    #[cfg(test)]
    pub(crate) fn new(control: Sender<Control>, lossless: bool, ring_capacity: usize, source: TickSource) -> Self {
        let ring_capacity = ring_capacity.max(2).next_power_of_two();
        Self::with_growth(control, lossless, ring_capacity, ring_capacity, source)
    }

    /// A timeline whose rings start at `ring_capacity` records and grow up to `max_ring_capacity`.
    pub(crate) fn with_growth(
        control: Sender<Control>,
        lossless: bool,
        ring_capacity: usize,
        max_ring_capacity: usize,
        source: TickSource,
    ) -> Self {
        let ring_capacity = ring_capacity.max(2).next_power_of_two();
        let max_ring_capacity = max_ring_capacity.max(ring_capacity).next_power_of_two();
        // Head, up to two fixed records, then the payload; at most half the ring.
        let max_data = (ring_capacity / 2).saturating_sub(3).min(codec::MAX_DATA_RECORDS - 2);
        Shared {
            id: next_timeline_id(),
            control,
            lossless,
            ring_capacity,
            max_ring_capacity,
            source,
            time_creations: true,
            every_span_a_task: false,
            running: AtomicBool::new(true),
            max_payload_bytes: (max_data * DATA_BYTES).min(MAX_PAYLOAD_BYTES),
            next_ring: AtomicU32::new(1),
            drain_thread: OnceLock::new(),
            drain_paused: AtomicBool::new(false),
            budget_full: AtomicBool::new(false),
            processing_paused: AtomicBool::new(false),
            live: OnceLock::new(),
            pid: std::process::id(),
            unrecorded: AtomicU64::new(0),
        }
    }

    /// Whether this is a copy in a child made by `fork`: the collector's threads were not copied, so nothing
    /// drains the rings or answers a request.
    pub(crate) fn in_forked_child(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Counts a record no ring could take.
    #[cold]
    fn count_unrecorded(&self) {
        self.unrecorded.fetch_add(1, Ordering::Relaxed);
    }
}

static NEXT_TIMELINE_ID: AtomicU64 = AtomicU64::new(1);

fn next_timeline_id() -> u64 {
    NEXT_TIMELINE_ID.fetch_add(1, Ordering::Relaxed)
}

/// Bits of a span serial that count spans on one ring; the ring's number sits above them.
const SERIAL_COUNTER_BITS: u32 = 40;

/// The serial of the `n`-th span created on ring `ring` (both sides number them alike: see `codec`).
#[inline(always)]
pub(crate) fn span_serial(ring: u64, n: u64) -> u64 {
    (ring << SERIAL_COUNTER_BITS) | (n & ((1 << SERIAL_COUNTER_BITS) - 1))
}
/// Most rings one timeline numbers (serials keep their top bit for [`NOT_ANNOUNCED`]).
const MAX_RINGS: u32 = 1 << (63 - SERIAL_COUNTER_BITS);
/// Set in `slack` while dropped records wait to be reported: more room than any ring has (a ring holds at
/// most 2^47 records: half the address space of 16-byte records).
const GAP_PENDING: usize = 1 << 48;

/// Slots a drop-mode push leaves free for `owed` ends still to come: two each, the end's own and one for
/// the `Gap` record that goes before it when records were dropped since the last one, so that a slice that
/// lost records inside it always ends after its gap (and is marked).
#[inline(always)]
const fn kept_for(owed: usize) -> usize {
    2 * owed
}

/// The serial of a span whose creation record was dropped: its slices are dropped whole too (the collector
/// could not name them). Never in a record.
pub(crate) const NOT_ANNOUNCED: u64 = 1 << 63;

// ---------------------------------------------------------------------------------------------------------
// The current timeline of native macros.

/// Running timelines in start order. Native macros (`scope!`, `instant!`, `counter!`) record into the one this
/// thread started, while it runs, and otherwise into the last: the most recently started timeline that is
/// still running (with its live sink, `Shared::live`).
static RUNNING: RwLock<Vec<Arc<Shared>>> = RwLock::new(Vec::new());
/// The most recently started running timeline's id (0: none), read on every native record of a thread that
/// started none to validate the thread's cached ring.
static CURRENT_ID: AtomicU64 = AtomicU64::new(0);
/// Counts timelines stopped: a thread's [`STARTED_HERE`] is still running while this has not moved since the
/// thread last looked.
static STOPS: AtomicU64 = AtomicU64::new(0);

/// A timeline this thread started (the latest), while it runs: native macros on this thread record into it
/// rather than into a timeline another thread started since (parallel tests, each with its own timeline).
#[derive(Clone, Copy)]
struct StartedHere {
    /// The timeline's id (0: none).
    id: u64,
    /// [`STOPS`] when it was last known to run.
    stops: u64,
    /// Its live sink.
    live: Option<&'static dyn LiveSink>,
}

thread_local! {
    static STARTED_HERE: Cell<StartedHere> = const { Cell::new(StartedHere { id: 0, stops: 0, live: None }) };
}

fn publish_current(running: &[Arc<Shared>]) {
    match running.last() {
        Some(shared) => {
            live::set_current(shared.live.get().copied());
            CURRENT_ID.store(shared.id, Ordering::Release);
        }
        None => {
            live::set_current(None);
            CURRENT_ID.store(0, Ordering::Release);
        }
    }
}

/// A timeline started (on this thread): it becomes the current one, and this thread's.
pub(crate) fn started(shared: &Arc<Shared>) {
    let mut running = RUNNING.write().unwrap_or_else(|e| e.into_inner());
    running.push(shared.clone());
    publish_current(&running);
    let _ = STARTED_HERE.try_with(|here| {
        here.set(StartedHere {
            id: shared.id,
            stops: STOPS.load(Ordering::Acquire),
            live: shared.live.get().copied(),
        })
    });
}

/// A timeline stopped: the most recently started one still running becomes current.
pub(crate) fn stopped(id: u64) {
    let mut running = RUNNING.write().unwrap_or_else(|e| e.into_inner());
    running.retain(|shared| shared.id != id);
    // Under the lock, so a thread that sees the count unchanged also sees `id` still in `RUNNING`.
    STOPS.fetch_add(1, Ordering::AcqRel);
    publish_current(&running);
}

/// The timeline this thread started, if it still runs (`id` 0 otherwise): one thread-local load and, for a
/// thread that started one, one atomic load.
#[inline(always)]
fn started_here() -> StartedHere {
    let here = STARTED_HERE.try_with(Cell::get).unwrap_or(StartedHere {
        id: 0,
        stops: 0,
        live: None,
    });
    if here.id == 0 || here.stops == STOPS.load(Ordering::Acquire) {
        return here;
    }
    recheck_started_here(here)
}

/// A timeline stopped since this thread last looked: is the one it started among those still running?
#[cold]
fn recheck_started_here(mut here: StartedHere) -> StartedHere {
    let running = RUNNING.read().unwrap_or_else(|e| e.into_inner());
    here.stops = STOPS.load(Ordering::Acquire);
    if !running.iter().any(|shared| shared.id == here.id) {
        here = StartedHere {
            id: 0,
            stops: 0,
            live: None,
        };
    }
    let _ = STARTED_HERE.try_with(|cell| cell.set(here));
    here
}

/// The id of the timeline native macros record into on this thread (0: none).
#[inline(always)]
pub(crate) fn current_id() -> u64 {
    let here = started_here();
    if here.id != 0 {
        return here.id;
    }
    CURRENT_ID.load(Ordering::Acquire)
}

/// The live sink of the timeline native macros record into on this thread.
#[inline(always)]
pub(crate) fn current_live() -> Option<&'static dyn LiveSink> {
    let here = started_here();
    if here.id != 0 {
        return here.live;
    }
    live::current()
}

/// Every running timeline (for the exit hook). Empty if the list is being changed right now (a timeline
/// starting or stopping on another thread as the process exits): the hook must not wait for a lock.
pub(crate) fn running_timelines() -> Vec<Arc<Shared>> {
    match RUNNING.try_read() {
        Ok(running) => running.clone(),
        Err(_) => Vec::new(),
    }
}

fn current_shared() -> Option<Arc<Shared>> {
    let id = current_id();
    let running = RUNNING.read().unwrap_or_else(|e| e.into_inner());
    running.iter().rev().find(|shared| shared.id == id).cloned()
}

// ---------------------------------------------------------------------------------------------------------
// This thread's rings.

struct LocalRing {
    timeline: u64,
    producer: Producer<Record>,
    lossless: bool,
    source: TickSource,
    /// Span creations are stamped (the timeline shows async task lifetimes).
    time_creations: bool,
    /// `Shared::every_span_a_task`, kept here so a close reads it without following the `Arc`.
    every_span_a_task: bool,
    /// This ring's number in its timeline: the top bits of the serials it hands out.
    ring_number: u64,
    /// Spans created on this ring so far: the low bits of the next serial.
    spans_created: u64,
    /// The tag of the latest native scope begun on this thread (1 to [`codec::AUX_MAX`], cycling).
    scope_tag: u16,
    /// Ends (span exits, scope ends) owed by begins in the ring whose ends have not come yet.
    owed_ends: usize,
    /// Room the fast path wants free beyond a push and its owed ends: half the ring, so a push that would
    /// leave the ring (as last seen) more than half full takes the slow path, which looks at the ring and
    /// wakes the collector; plus [`GAP_PENDING`] while dropped records wait to be reported, so every push
    /// takes the slow path, which writes the `Gap` record first. One add and one compare on the fast path.
    slack: usize,
    /// Serials of span enters refused in drop mode whose exits have not come yet: those exits are dropped.
    refused: Vec<u64>,
    /// Records dropped since the last `Gap` record.
    unreported_drops: u64,
    /// The last enter pushed: its span's serial and the ring's tail right after it (an exit one record later
    /// follows that enter directly: nothing, no child span in particular, was created inside).
    last_enter: (u64, usize),
    /// The last exit pushed: its span's serial and the ring's tail right after it (a close with the tail
    /// unchanged follows that exit directly).
    last_exit: (u64, usize),
    /// Half the ring's capacity.
    half: usize,
    /// The tail index when this thread last woke the collector (it wakes it at most every 1/16 ring).
    last_wake: usize,
    shared: Arc<Shared>,
}

impl LocalRing {
    #[inline(always)]
    fn now(&self) -> u64 {
        self.source.read().0
    }

    /// Pushes one record leaving room for `owed_after` ends behind it (the ends owed once it is in). In drop
    /// mode a push that does not fit is dropped and counted; in lossless mode it waits.
    #[inline(always)]
    fn push_one(&mut self, record: Record, owed_after: usize) -> bool {
        if self
            .producer
            .try_push_keeping(record, kept_for(owed_after) + self.slack)
        {
            self.owed_ends = owed_after;
            return true;
        }
        self.push_slow(&[record], owed_after)
    }

    /// Pushes `records` (all or none), as [`push_one`](Self::push_one).
    #[inline(always)]
    fn push_group(&mut self, records: &[Record], owed_after: usize) -> bool {
        if self
            .producer
            .try_push_all_keeping(records, kept_for(owed_after) + self.slack)
        {
            self.owed_ends = owed_after;
            return true;
        }
        self.push_slow(records, owed_after)
    }

    /// A push the fast path did not take: the ring is (as last seen) half full, or a gap waits to be
    /// reported, or the ring is full (wait, or drop and count).
    #[cold]
    #[inline(never)]
    fn push_slow(&mut self, records: &[Record], owed_after: usize) -> bool {
        // The fast path wants half the ring free beyond the push: it comes here while the ring is more than
        // half full (as last seen). Wake the collector, again every 1/16 ring of records while it stays so.
        let tail = self.producer.tail_index();
        if self.producer.len_now() >= self.half && tail.wrapping_sub(self.last_wake) >= (self.half / 8).max(1) {
            self.last_wake = tail;
            if let Some(thread) = self.shared.drain_thread.get() {
                thread.unpark();
            }
        }
        if self.unreported_drops != 0 {
            return self.push_after_gap(records, owed_after);
        }
        self.push_full(records, owed_after)
    }

    /// Pushes `records` if they fit with the owed ends' room kept (a lossless producer keeps none and
    /// waits); else drops and counts them.
    fn push_full(&mut self, records: &[Record], owed_after: usize) -> bool {
        let keep = if self.lossless { 0 } else { kept_for(owed_after) };
        if self.producer.try_push_all_keeping(records, keep) {
            self.owed_ends = owed_after;
            return true;
        }
        if self.lossless && !NEVER_WAIT.get() {
            let drain = self.shared.drain_thread.get();
            let shared = &self.shared;
            // Wait while there is a collector to make room: not in a child made by `fork` (checked only
            // between the wait's sleeps: a system call).
            let wake = || {
                if let Some(thread) = drain {
                    thread.unpark();
                }
                !shared.in_forked_child()
            };
            if self.producer.push_all_waiting(records, wake) {
                self.owed_ends = owed_after;
                return true;
            }
        } else if self.grow() && self.producer.try_push_all_keeping(records, keep) {
            self.owed_ends = owed_after;
            return true;
        }
        self.drop_records(records.len());
        false
    }

    /// Drop mode, ring full: moves on to a ring four times as large (up to the timeline's maximum) rather
    /// than drop, so a burst the collector cannot follow at once costs memory, not records. The old ring is
    /// closed here and drained to its end before the new one (the collector keeps their order). False when
    /// the ring is as large as it may get, or the chunk budget is full (the collector is not just behind a
    /// burst but that far behind: more ring would be memory beyond the budget).
    #[cold]
    fn grow(&mut self) -> bool {
        let capacity = self.producer.capacity();
        if capacity >= self.shared.max_ring_capacity
            || self.shared.budget_full.load(Ordering::Relaxed)
            || self.shared.in_forked_child()
        {
            return false;
        }
        let (producer, consumer) = channel((capacity * 4).min(self.shared.max_ring_capacity));
        let sent = self.shared.control.send(Control::NewRing {
            consumer,
            ring: self.ring_number as u32,
            tid: 0,
            name: String::new(),
            continues: true,
        });
        if sent.is_err() {
            return false;
        }
        if let Some(thread) = self.shared.drain_thread.get() {
            thread.unpark();
        }
        // Dropping the old producer closes the old ring: everything in it was pushed before anything in the
        // new one.
        self.producer = producer;
        self.half = self.producer.capacity() / 2;
        self.slack = self.half | (self.slack & GAP_PENDING);
        true
    }

    /// Records went missing before this push: a `Gap` record first, then `records`. In drop mode an end always
    /// has room for both (its begin kept two slots, [`kept_for`]); anything else that has not is dropped too
    /// (after trying to grow the ring), so that no record lands between a loss and its gap: a slice that
    /// begins there would be marked as having lost records it never held, and one that ends there would not
    /// be marked at all. A lossless ring drops only when its collector is gone; it waits for room as usual.
    fn push_after_gap(&mut self, records: &[Record], owed_after: usize) -> bool {
        if self.lossless {
            if self.push_with_gap(records, 0) {
                self.owed_ends = owed_after;
                return true;
            }
            return self.push_full(records, owed_after);
        }
        let keep = kept_for(owed_after);
        if self.push_with_gap(records, keep) || (self.grow() && self.push_with_gap(records, keep)) {
            self.owed_ends = owed_after;
            return true;
        }
        if owed_after < self.owed_ends {
            // An end always finds its two slots (see above); should that ever fail, it still goes in, since
            // a slice must never lose its end while its begin is in the ring.
            debug_assert!(false, "an end found no room for the gap before it");
            return self.push_full(records, owed_after);
        }
        self.drop_records(records.len());
        false
    }

    /// Pushes a `Gap` record for the drops not yet reported and then `records`, if both fit leaving `keep`
    /// slots free; else pushes nothing.
    fn push_with_gap(&mut self, records: &[Record], keep: usize) -> bool {
        if self.producer.free_slots() < 1 + records.len() + keep {
            return false;
        }
        // Stamped like the record it precedes (ticks must not go backwards along the ring).
        let ticks = match records[0].low48() {
            0 => self.now(),
            ticks => ticks,
        };
        let gap = Record::timed(Kind::Gap, ticks, self.unreported_drops);
        let pushed = self.producer.try_push_keeping(gap, records.len() + keep)
            && self.producer.try_push_all_keeping(records, keep);
        debug_assert!(pushed, "room was checked above and only this thread pushes");
        if pushed {
            self.producer.count_marker();
        }
        self.unreported_drops = 0;
        self.slack &= !GAP_PENDING;
        pushed
    }

    /// The ring's last record, as its thread exits: a `Gap` for the drops not yet reported (0 if none), stamped
    /// now, so that slices the thread left open end when it did, not at its last record. Uses the room kept
    /// for the ends still owed (they will never come); not made if even that is gone.
    #[cold]
    fn push_thread_end(&mut self) {
        let gap = Record::timed(Kind::Gap, self.now(), self.unreported_drops);
        if self.producer.try_push_keeping(gap, 0) {
            self.unreported_drops = 0;
            self.producer.count_marker();
        }
    }

    #[cold]
    fn drop_records(&mut self, n: usize) {
        self.producer.count_drops(n as u64);
        self.unreported_drops += n as u64;
        self.slack |= GAP_PENDING;
    }

    /// The serial of the span whose creation record was just pushed (`pushed`), or [`NOT_ANNOUNCED`]. Serials
    /// count the creation records that went in, so the collector numbers them the same way as it meets them.
    #[inline(always)]
    fn announced(&mut self, pushed: bool) -> u64 {
        if !pushed {
            return NOT_ANNOUNCED;
        }
        self.spans_created += 1;
        span_serial(self.ring_number, self.spans_created)
    }

    /// A begin: needs room for itself, its end and every end owed.
    #[inline(always)]
    fn push_begin(&mut self, record: Record) -> bool {
        let owed = self.owed_ends + 1;
        self.push_one(record, owed)
    }

    /// An end: its room was reserved by its begin.
    #[inline(always)]
    fn push_end(&mut self, record: Record) -> bool {
        let owed = self.owed_ends.saturating_sub(1);
        self.push_one(record, owed)
    }

    /// Anything else, one record: needs room for itself and every end owed.
    #[inline(always)]
    fn push_other_one(&mut self, record: Record) -> bool {
        let owed = self.owed_ends;
        self.push_one(record, owed)
    }

    /// Anything else: needs room for itself and every end owed.
    #[inline(always)]
    fn push_other(&mut self, records: &[Record]) -> bool {
        let owed = self.owed_ends;
        self.push_group(records, owed)
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
        // SAFETY: `ring` came from `Box::leak` in `new` and is taken back only here, once (the box pushes one
        // last record and frees it). Nothing else uses it after:
        // `HOT_RING` is read only while `HOT_ID` holds a timeline id, and `HOT_ID` does not now (asserted
        // above): either `Rings::drop` set it to 0, or `register` holds the record lock, which
        // `with_ring_slow` releases with `HOT_ID` 0 or after pointing `HOT_RING` at a ring still owned.
        // No `&mut` to it is alive: one exists only while `f` runs under the lock, and `f` does not free rings.
        let mut ring = unsafe { Box::from_raw(self.ring.as_ptr()) };
        // Dropped with its thread (or with a timeline that is gone, where nothing reads it any more).
        ring.push_thread_end();
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
    /// Set while this thread runs code called back from inside a GPU driver's call ([`never_waiting`]): a
    /// lossless ring that is full drops and counts instead of waiting there.
    static NEVER_WAIT: Cell<bool> = const { Cell::new(false) };
    static RINGS: RefCell<Rings> = const { RefCell::new(Rings(Vec::new())) };
    /// Scratch space for encoding fields and assembling record groups, reused so the hot path never allocates
    /// after warm-up.
    static SCRATCH: RefCell<(Vec<u8>, Vec<Record>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// The timeline whose collector runs on this thread (0: none). It records nothing into that timeline:
    /// what an exporter or a GPU backend does there would feed the timeline its own output, and in lossless
    /// mode the collector would wait for room in a ring only it empties.
    static OWN_TIMELINE: Cell<u64> = const { Cell::new(0) };
}

/// Marks this thread as timeline `id`'s collector (see `OWN_TIMELINE`).
pub(crate) fn mark_collector_thread(id: u64) {
    OWN_TIMELINE.set(id);
}

/// Whether this thread is making a record (or encoding one's fields) now: a record attempted meanwhile (from
/// a field's `Debug`, an allocator or a signal handler) is dropped and counted.
fn making_a_record() -> bool {
    HOT_ID.get() == LOCKED || SCRATCH.try_with(|s| s.try_borrow_mut().is_err()).unwrap_or(false)
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

/// The timeline a native scope began in, for its end: a timeline started since then is `Current` but never
/// saw the begin. Never registers a ring (the begin's is there, or the timeline has stopped).
pub(crate) struct Began(pub(crate) u64);

impl Target for Began {
    #[inline(always)]
    fn id(&self) -> u64 {
        self.0
    }
    fn shared(&self) -> Option<Arc<Shared>> {
        None
    }
}

impl Target for Current {
    #[inline(always)]
    fn id(&self) -> u64 {
        current_id()
    }
    fn shared(&self) -> Option<Arc<Shared>> {
        current_shared()
    }
}

/// Runs `f` with this thread's ring for `target`, creating and registering it on first use; `None` when
/// there is no ring (no timeline, timeline stopped, thread exiting, or a record already being made).
///
/// The thread's record lock: `f` gets a `&mut LocalRing` only while `HOT_ID` is [`LOCKED`]. A record
/// attempted meanwhile on this thread (`f` cannot call user code, but it may allocate, and a global allocator
/// or a signal handler may record) finds the lock taken and is counted as dropped instead of aliasing the
/// ring. Fast path: one TLS load and compare, one TLS load of the ring, the lock and unlock stores, and one
/// TLS load to check for such records.
#[inline(always)]
fn with_ring<R>(target: &impl Target, f: impl FnOnce(&mut LocalRing) -> R) -> Option<R> {
    let id = target.id();
    if id == 0 {
        return None;
    }
    if HOT_ID.get() != id {
        return with_ring_slow(target, id, f);
    }
    let ring = HOT_RING.get();
    HOT_ID.set(LOCKED);
    // SAFETY: `HOT_ID` held a timeline id, so `HOT_RING` points at a live ring that no `&mut` refers to
    // (the invariants `with_ring_locked` states), and we have just taken the lock.
    Some(unsafe { with_ring_locked(id, ring, f) })
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
unsafe fn with_ring_locked<R>(id: u64, ring: *mut LocalRing, f: impl FnOnce(&mut LocalRing) -> R) -> R {
    debug_assert_eq!(HOT_ID.get(), LOCKED);
    debug_assert!(!ring.is_null());
    let release = Release { id, ring };
    // SAFETY: live and unaliased by the caller's contract; the lock keeps any other `&mut` from being made
    // until `release` drops, after this one's last use.
    f(unsafe { &mut *release.ring })
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
    ring.drop_records(reentered as usize);
}

/// [`with_ring`] when the cached ring is not `target`'s: find or register the ring and cache it. Or when the
/// thread is making a record already (`HOT_ID == LOCKED`): count this one as dropped.
#[cold]
#[inline(never)]
fn with_ring_slow<R>(target: &impl Target, id: u64, f: impl FnOnce(&mut LocalRing) -> R) -> Option<R> {
    if HOT_ID.get() == LOCKED {
        REENTERED.set(REENTERED.get() + 1);
        return None;
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
    let ring = match found {
        Ok(Some(ring)) => ring,
        Ok(None) => return None,
        Err(_) => {
            // The thread is exiting and its rings are gone (a thread-local destructor that runs after
            // tickline's): nothing can take the record, but it is counted.
            if let Some(shared) = target.shared().filter(|s| s.id == id) {
                shared.count_unrecorded();
            }
            return None;
        }
    };
    std::mem::forget(none_found);
    HOT_RING.set(ring.as_ptr());
    // SAFETY: we hold the lock; `ring` is owned by `RINGS` (found or registered just now, not freed since)
    // and has no reference to it alive, since `&mut`s to rings are made only under the lock.
    Some(unsafe { with_ring_locked(id, ring.as_ptr(), f) })
}

#[cold]
fn register(shared: &Arc<Shared>, rings: &mut Vec<OwnedRing>) -> Option<NonNull<LocalRing>> {
    if !shared.running.load(Ordering::Acquire) {
        return None;
    }
    if OWN_TIMELINE.get() == shared.id || shared.in_forked_child() {
        shared.count_unrecorded();
        return None;
    }
    let ring_number = shared.next_ring.fetch_add(1, Ordering::Relaxed);
    if ring_number >= MAX_RINGS {
        shared.count_unrecorded();
        return None;
    }
    // Rings of timelines that have shut down are of no use any more.
    rings.retain(OwnedRing::is_consumer_alive);
    let (producer, consumer) = channel(shared.ring_capacity);
    let thread = std::thread::current();
    let tid = current_tid();
    let name = thread.name().map_or_else(|| format!("thread-{tid}"), str::to_owned);
    shared
        .control
        .send(Control::NewRing {
            consumer,
            ring: ring_number,
            tid,
            name,
            continues: false,
        })
        .ok()?;
    if let Some(drain) = shared.drain_thread.get() {
        drain.unpark();
    }
    let half = producer.capacity() / 2;
    rings.insert(
        0,
        OwnedRing::new(LocalRing {
            timeline: shared.id,
            producer,
            lossless: shared.lossless,
            source: shared.source,
            time_creations: shared.time_creations,
            every_span_a_task: shared.every_span_a_task,
            ring_number: u64::from(ring_number),
            spans_created: 0,
            scope_tag: 0,
            owed_ends: 0,
            slack: half,
            // Begins refused while nested (drop mode, a full ring): room for a deep stack up front, so that
            // refusing one does not allocate on the hot path.
            refused: Vec::with_capacity(64),
            unreported_drops: 0,
            last_enter: (0, 0),
            last_exit: (0, 0),
            half,
            last_wake: 0,
            shared: shared.clone(),
        }),
    );
    // Before the first record's time is read: a sink's per-thread set-up (Tracy names the thread) is not
    // inside this thread's first slice.
    if let Some(live) = shared.live.get() {
        live.thread_started();
    }
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

// ---------------------------------------------------------------------------------------------------------
// What the layer, the native macros and GPU scopes record.

/// Encodes fields into this thread's scratch payload (outside the record lock: `encode` may run user
/// `Debug` code, which may record), then calls `push` with the payload. `None` if the scratch space is in
/// use (a field's `Debug` impl recorded while this thread was encoding): that inner record is counted as
/// dropped rather than lost silently.
///
/// Inlined into its callers: called, its closures' captures (built by the caller with narrow stores, loaded
/// here as wide ones) cost a failed store-to-load forward per record, half of this function's time.
#[inline(always)]
fn with_payload<R>(
    target: &impl Target,
    max_bytes: usize,
    encode: impl FnOnce(&mut FieldEncoder<'_>),
    push: impl FnOnce(&[u8], &mut Vec<Record>) -> Option<R>,
) -> Option<R> {
    SCRATCH
        .try_with(|scratch| {
            let Ok(mut scratch) = scratch.try_borrow_mut() else {
                with_ring(target, |ring| ring.drop_records(1));
                return None;
            };
            let (bytes, group) = &mut *scratch;
            if group.capacity() < SCRATCH_RECORDS {
                size_scratch(bytes, group);
            }
            let mut encoder = FieldEncoder::new(bytes, max_bytes);
            encode(&mut encoder);
            encoder.finish();
            push(bytes, group)
        })
        .ok()
        .flatten()
}

/// Records in the largest record group: a head and every data record `aux` can count.
const SCRATCH_RECORDS: usize = codec::MAX_DATA_RECORDS + 1;

/// Sizes this thread's scratch space for the largest payload and record group, once (its first record with
/// fields): grown on demand instead, a record with longer fields than any before would allocate on the hot
/// path. 48 KiB + 64 KiB of address space per recording thread, touched only as far as payloads reach.
#[cold]
#[inline(never)]
fn size_scratch(bytes: &mut Vec<u8>, group: &mut Vec<Record>) {
    bytes.reserve_exact(MAX_PAYLOAD_BYTES.saturating_sub(bytes.len()));
    group.reserve_exact(SCRATCH_RECORDS.saturating_sub(group.len()));
}

/// Records the creation of a span without field values and with the contextual parent (most spans), and
/// returns its serial ([`NOT_ANNOUNCED`] if the record was dropped), or `None` when there is no ring.
#[inline(always)]
pub(crate) fn span_new_bare(target: &impl Target, callsite: u64) -> Option<u64> {
    with_ring(target, |ring| {
        let ticks = if ring.time_creations { ring.now() } else { 0 };
        let pushed = ring.push_other_one(codec::span_new_bare(ticks, callsite));
        ring.announced(pushed)
    })
}

/// Records a span's creation and returns its serial ([`NOT_ANNOUNCED`] if the record was dropped), or
/// `None` when there is no ring to record into. `max_bytes`: the payload limit.
pub(crate) fn span_new(
    target: &impl Target,
    max_bytes: usize,
    callsite: u64,
    parent: Parent,
    encode: Option<impl FnOnce(&mut FieldEncoder<'_>)>,
) -> Option<u64> {
    let serial = match encode {
        None if parent == Parent::Contextual => span_new_bare(target, callsite),
        encode => with_payload(
            target,
            max_bytes,
            |encoder| {
                if let Some(encode) = encode {
                    encode(encoder)
                }
            },
            |payload, group| {
                with_ring(target, |ring| {
                    let ticks = if ring.time_creations { ring.now() } else { 0 };
                    codec::encode_span_new(group, ticks, callsite, parent, payload);
                    let pushed = ring.push_other(group);
                    ring.announced(pushed)
                })
            },
        ),
    };
    // A creation made while this thread was making another record (a field's `Debug` that creates a span) was
    // dropped and counted: the span's slices go the same way, counted, as after a full ring.
    serial.or_else(|| making_a_record().then_some(NOT_ANNOUNCED))
}

/// Records new values of span `serial`'s fields.
pub(crate) fn span_record(
    target: &impl Target,
    max_bytes: usize,
    serial: u64,
    encode: impl FnOnce(&mut FieldEncoder<'_>),
) {
    if serial & NOT_ANNOUNCED != 0 {
        // The span's creation was dropped, so this goes too: counted as the records it would have been (its
        // group), so that `records + dropped_records` stays what the program made. Rare (the ring was full).
        with_payload(target, max_bytes, encode, |payload, group| {
            with_ring(target, |ring| {
                codec::encode_span_record(group, 0, serial, payload);
                ring.drop_records(group.len());
            })
        });
        return;
    }
    with_payload(target, max_bytes, encode, |payload, group| {
        with_ring(target, |ring| {
            codec::encode_span_record(group, ring.now(), serial, payload);
            ring.push_other(group);
        })
    });
}

/// Records an enter of span `serial`: a begin (see the module docs).
#[inline(always)]
pub(crate) fn span_enter(target: &impl Target, serial: u64) {
    with_ring(target, |ring| {
        if serial & NOT_ANNOUNCED != 0 {
            ring.drop_records(1);
            ring.refused.push(serial);
            ring.producer.count_dropped_unit();
            return;
        }
        let record = Record::timed(Kind::SpanEnter, ring.now(), serial);
        if ring.push_begin(record) {
            ring.last_enter = (serial, ring.producer.tail_index());
        } else if !ring.lossless {
            ring.refused.push(serial);
            ring.producer.count_dropped_unit();
        }
    });
}

/// Records an exit of span `serial`: an end. The exit of a refused enter is dropped with it.
#[inline(always)]
pub(crate) fn span_exit(target: &impl Target, serial: u64) {
    with_ring(target, |ring| {
        if !ring.refused.is_empty() && drop_refused_exit(ring, serial) {
            return;
        }
        let record = Record::timed(Kind::SpanExit, ring.now(), serial);
        if ring.push_end(record) {
            ring.last_exit = (serial, ring.producer.tail_index());
        }
    });
}

#[cold]
fn drop_refused_exit(ring: &mut LocalRing, serial: u64) -> bool {
    let Some(pos) = ring.refused.iter().rposition(|&s| s == serial) else {
        return false;
    };
    ring.refused.swap_remove(pos);
    ring.drop_records(1);
    true
}

/// Records span `serial`'s close: untimed when it follows its own exit (it takes that exit's tick), unless its
/// lifetime may be shown: the span may be an async task (`may_be_task`: entered again or named as a parent;
/// or every span is one), or hold some (it created spans while entered: then its exit did not follow its
/// enter directly), and task lifetimes end at their close.
/// `values_final`: no `record` reached the span, so the values it was created with are final
/// ([`codec::VALUES_FINAL`]); `may_be_task` goes on the record too ([`codec::MAY_BE_TASK`]).
#[inline]
pub(crate) fn span_close(target: &impl Target, serial: u64, values_final: bool, may_be_task: bool) {
    with_ring(target, |ring| {
        if serial & NOT_ANNOUNCED != 0 {
            ring.drop_records(1);
            return;
        }
        let flags =
            if values_final { codec::VALUES_FINAL } else { 0 } | if may_be_task { codec::MAY_BE_TASK } else { 0 };
        let tail = ring.producer.tail_index();
        // Without task lifetimes no close time is shown; with them, only a leaf's (its enter, exit and close
        // one after another) that cannot be a task may be its exit's.
        let untimed = ring.last_exit == (serial, tail)
            && !ring.every_span_a_task
            && (!ring.time_creations || (!may_be_task && ring.last_enter == (serial, tail.wrapping_sub(1))));
        let record = if untimed {
            Record::head(Kind::SpanClose, codec::AT_LAST_EXIT | flags, 0, serial)
        } else {
            Record::head(Kind::SpanClose, flags, ring.now(), serial)
        };
        ring.push_other(&[record]);
    });
}

/// Runs `f` (code called back from inside a GPU driver's call: CUPTI's launch callbacks) with this thread's
/// records never waiting for ring room: in lossless mode a full ring drops and counts them instead. Waiting there
/// would hold the application's driver call, and whatever locks the driver holds during its callbacks, until the
/// drain stage makes room, while the drain stage may itself be calling into the driver (a CUPTI flush).
#[cfg_attr(not(feature = "cupti"), allow(dead_code))]
pub(crate) fn never_waiting<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            NEVER_WAIT.set(self.0);
        }
    }
    let _restore = Restore(NEVER_WAIT.replace(true));
    f()
}

/// Records an event at `callsite` with its fields.
pub(crate) fn event(
    target: &impl Target,
    max_bytes: usize,
    callsite: u64,
    parent: Parent,
    encode: impl FnOnce(&mut FieldEncoder<'_>),
) {
    with_payload(target, max_bytes, encode, |payload, group| {
        with_ring(target, |ring| {
            codec::encode_event(group, ring.now(), callsite, parent, payload);
            ring.push_other(group);
        })
    });
}

/// Registers a native call site with the ring's timeline on its first use there (before any record names
/// it, so the collector always knows it first).
#[inline(always)]
fn registered(ring: &LocalRing, callsite: &'static NativeCallsite) -> u64 {
    if !callsite.is_registered_with(ring.timeline) {
        register_native(ring, callsite);
    }
    callsite_key(callsite)
}

#[cold]
#[inline(never)]
fn register_native(ring: &LocalRing, callsite: &'static NativeCallsite) {
    if ring.shared.control.send(Control::NativeCallsite(callsite)).is_ok() {
        callsite.mark_registered(ring.timeline);
    }
}

/// Records a native scope's begin; true when it is in the ring (its end must then be recorded).
#[inline(always)]
/// Records a native scope's begin; returns whether it went in, the timeline whose ring took it (0: none),
/// where its end must go ([`Began`]), and its tag, which its end carries too.
pub(crate) fn scope_begin(target: &impl Target, callsite: &'static NativeCallsite) -> (bool, u64, u16) {
    with_ring(target, |ring| {
        let key = registered(ring, callsite);
        // Tags tell apart the open scopes of one callsite whose guards are dropped out of order (a guard
        // replaced in a loop begins the next scope before the old one ends).
        ring.scope_tag = ring.scope_tag % codec::AUX_MAX as u16 + 1;
        let record = Record::scope(Kind::ScopeBegin, ring.now(), key, ring.scope_tag);
        let pushed = ring.push_begin(record);
        if !pushed {
            ring.producer.count_dropped_unit();
        }
        (pushed, ring.timeline, ring.scope_tag)
    })
    .unwrap_or((false, 0, 0))
}

/// Records a native scope's end (`recorded`: whether its begin went in; if not, the end is dropped too).
#[inline(always)]
pub(crate) fn scope_end(target: &impl Target, callsite: &'static NativeCallsite, recorded: bool, tag: u16) {
    with_ring(target, |ring| {
        if !recorded {
            ring.drop_records(1);
            return;
        }
        let record = Record::scope(Kind::ScopeEnd, ring.now(), callsite_key(callsite), tag);
        ring.push_end(record);
    });
}

/// Records an instant at `callsite`.
#[inline(always)]
pub(crate) fn instant(target: &impl Target, callsite: &'static NativeCallsite) {
    with_ring(target, |ring| {
        let key = registered(ring, callsite);
        let record = Record::timed(Kind::Instant, ring.now(), key);
        ring.push_other(&[record]);
    });
}

/// Records a counter value at `callsite`.
#[inline]
pub(crate) fn counter(target: &impl Target, callsite: &'static NativeCallsite, value: f64) {
    with_ring(target, |ring| {
        let key = registered(ring, callsite);
        let group = codec::counter(ring.now(), key, value);
        ring.push_other(&group);
    });
}

/// Counts records that could not be made as dropped on this thread's ring (a GPU scope that found no free
/// timestamp pair).
pub(crate) fn count_drop(target: &impl Target, n: usize) {
    with_ring(target, |ring| ring.drop_records(n));
}

/// Records a GPU scope's begin: the CPU tick (`ticks`, read before the begin timestamp was written), the call
/// site, the scope key and the fields, all or nothing.
/// True when the group is in the ring.
pub(crate) fn gpu_begin(
    shared: &Arc<Shared>,
    ticks: u64,
    callsite: &'static NativeCallsite,
    key: u64,
    encode: Option<impl FnOnce(&mut FieldEncoder<'_>)>,
) -> bool {
    with_payload(
        shared,
        shared.max_payload_bytes,
        |encoder| {
            if let Some(encode) = encode {
                encode(encoder)
            }
        },
        |payload, group| {
            with_ring(shared, |ring| {
                let callsite = registered(ring, callsite);
                codec::encode_gpu_begin(group, ticks, callsite, key, payload);
                let pushed = ring.push_other(group);
                if !pushed {
                    // The scope's slice is lost whole (its end is a GPU timestamp, which then matches nothing).
                    ring.producer.count_dropped_unit();
                }
                pushed
            })
        },
    )
    .unwrap_or(false)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use crossbeam_channel::{unbounded, Receiver};

    use super::*;
    use crate::codec::{Decoder, Item};
    use crate::ring::Consumer;

    // A `const` to repeat in the array below; each element is its own static call site.
    #[allow(clippy::declare_interior_mutable_const)]
    const SITE: NativeCallsite = NativeCallsite::new("test", file!(), line!());
    static SITES: [NativeCallsite; 128] = [SITE; 128];

    fn site(i: u64) -> &'static NativeCallsite {
        &SITES[i as usize]
    }

    fn index_of(key: u64) -> u64 {
        (key - callsite_key(&SITES[0])) / std::mem::size_of::<NativeCallsite>() as u64
    }

    /// A running timeline whose control channel the test reads instead of a collector.
    fn timeline(capacity: usize) -> (Arc<Shared>, Receiver<Control>) {
        let (control, rx) = unbounded();
        let shared = Arc::new(Shared::new(control, false, capacity, TickSource::Monotonic));
        (shared, rx)
    }

    /// The ring the next `NewRing` message hands over.
    fn new_ring(rx: &Receiver<Control>) -> Consumer<Record> {
        loop {
            match rx.try_recv() {
                Ok(Control::NewRing { consumer, .. }) => return consumer,
                Ok(_) => continue,
                Err(_) => panic!("no ring was registered"),
            }
        }
    }

    fn records(consumer: &mut Consumer<Record>) -> Vec<Record> {
        let mut out = Vec::new();
        while consumer.drain(usize::MAX, |run| out.extend_from_slice(run)) > 0 {}
        out
    }

    /// The payloads (word 1) of the one-record items the ring holds now.
    fn payloads(consumer: &mut Consumer<Record>) -> Vec<u64> {
        let records = records(consumer);
        Decoder::new(&records)
            .filter_map(|item| match item.ok()? {
                Item::Instant { callsite, .. } => Some(index_of(callsite)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn records_for_several_timelines_on_one_thread_go_to_their_own_rings() {
        let (a, a_rx) = timeline(64);
        let (b, b_rx) = timeline(64);
        let (c, c_rx) = timeline(64);
        let order: [(&Arc<Shared>, u64); 8] = [(&a, 1), (&b, 2), (&a, 3), (&a, 4), (&c, 5), (&b, 6), (&c, 7), (&a, 8)];
        for (target, payload) in order {
            instant(target, site(payload));
        }
        let (mut a_ring, mut b_ring, mut c_ring) = (new_ring(&a_rx), new_ring(&b_rx), new_ring(&c_rx));
        assert_eq!(payloads(&mut a_ring), [1, 3, 4, 8]);
        assert_eq!(payloads(&mut b_ring), [2, 6]);
        assert_eq!(payloads(&mut c_ring), [5, 7]);
        let more_rings = |rx: &Receiver<Control>| rx.try_iter().any(|m| matches!(m, Control::NewRing { .. }));
        assert!(
            !more_rings(&a_rx) && !more_rings(&b_rx),
            "one ring per thread and timeline"
        );
    }

    #[test]
    fn a_record_made_while_making_one_is_counted_as_dropped() {
        let (a, a_rx) = timeline(64);
        let (b, b_rx) = timeline(64);
        instant(&b, site(1));
        with_ring(&a, |ring| {
            ring.push_other(&[Record::timed(Kind::Instant, 0, callsite_key(site(2)))]);
            // As from an allocator or a signal handler that records: the ring in use must not be aliased,
            // and neither may the thread's ring list, whatever the timeline.
            instant(&a, site(3));
            instant(&b, site(4));
            counter(&a, site(5), 1.0);
        });
        instant(&a, site(6));
        instant(&b, site(7));
        let (mut a_ring, mut b_ring) = (new_ring(&a_rx), new_ring(&b_rx));
        assert_eq!(payloads(&mut a_ring), [2, 6]);
        assert_eq!(payloads(&mut b_ring), [1, 7]);
        // Counted on the ring that was in use.
        assert_eq!(a_ring.dropped_records() + b_ring.dropped_records(), 3);
    }

    #[test]
    fn a_panic_while_making_a_record_releases_the_lock() {
        let (a, a_rx) = timeline(64);
        let result = catch_unwind(AssertUnwindSafe(|| {
            with_ring(&a, |_| panic!("in the middle of a record"))
        }));
        assert!(result.is_err());
        instant(&a, site(1));
        assert_eq!(payloads(&mut new_ring(&a_rx)), [1]);
    }

    #[test]
    fn a_stopped_timeline_takes_nothing_and_others_go_on() {
        let (a, a_rx) = timeline(64);
        let (b, b_rx) = timeline(64);
        instant(&b, site(1));
        instant(&a, site(2));
        // a's ring is the cached one when a shuts down: its collector drops the consumer.
        a.running.store(false, Ordering::Release);
        drop(new_ring(&a_rx));
        // Registering c frees a's ring.
        let (c, c_rx) = timeline(64);
        instant(&c, site(3));
        instant(&a, site(4));
        instant(&b, site(5));
        instant(&a, site(6));
        instant(&c, site(7));
        assert!(
            !a_rx.try_iter().any(|m| matches!(m, Control::NewRing { .. })),
            "a stopped timeline registers no ring"
        );
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
                instant(&self.0, site(99));
            }
        }
        thread_local! {
            static EARLY: RefCell<Option<RecordsOnDrop>> = const { RefCell::new(None) };
            static LATE: RefCell<Option<RecordsOnDrop>> = const { RefCell::new(None) };
        }
        let (a, a_rx) = timeline(64);
        let (b, b_rx) = timeline(64);
        let (a2, b2) = (a.clone(), b.clone());
        // Not a scoped thread: `join` must wait for the thread-local destructors, which run after the closure.
        std::thread::spawn(move || {
            // Destructors registered before and after `RINGS`'s, so that one of them likely runs after it.
            EARLY.with(|early| *early.borrow_mut() = Some(RecordsOnDrop(a2.clone())));
            instant(&a2, site(1));
            instant(&b2, site(2));
            instant(&a2, site(3));
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

    #[test]
    fn a_full_ring_loses_whole_slices_and_marks_the_gap_inside_the_slices_it_hit() {
        let (a, a_rx) = timeline(16);
        // Nest until begins are refused: every begin that went in keeps the room of its end and of a gap.
        let mut recorded = Vec::new();
        for depth in 0..20u64 {
            let (went_in, _, tag) = scope_begin(&a, site(depth));
            recorded.push((went_in, tag));
        }
        for depth in (0..20u64).rev() {
            let (went_in, tag) = recorded[depth as usize];
            scope_end(&a, site(depth), went_in, tag);
        }
        let mut consumer = new_ring(&a_rx);
        let taken = records(&mut consumer);
        let items: Vec<Item<'_>> = Decoder::new(&taken).map(|i| i.unwrap()).collect();
        let begins = items.iter().filter(|i| matches!(i, Item::ScopeBegin { .. })).count();
        let ends = items.iter().filter(|i| matches!(i, Item::ScopeEnd { .. })).count();
        assert_eq!(begins, ends, "{items:?}");
        assert_eq!(begins, recorded.iter().filter(|r| r.0).count());
        assert!(begins > 0 && begins < 20);
        // Every record is accounted: what is in the ring and what was counted as dropped.
        assert_eq!(begins + ends + consumer.dropped_records() as usize, 40);
        // The gap comes before the first end, so every slice still in the ring is open around it.
        assert!(
            matches!(items[begins], Item::Gap { dropped, .. } if dropped == consumer.dropped_records()),
            "{items:?}"
        );
        assert!(items[..begins].iter().all(|i| matches!(i, Item::ScopeBegin { .. })));
        assert!(items[begins + 1..].iter().all(|i| matches!(i, Item::ScopeEnd { .. })));
        // Nothing is left to report.
        instant(&a, site(7));
        let more = records(&mut consumer);
        let items: Vec<Item<'_>> = Decoder::new(&more).map(|i| i.unwrap()).collect();
        assert!(matches!(items[..], [Item::Instant { callsite, .. }] if index_of(callsite) == 7));
    }

    #[test]
    fn records_dropped_inside_a_slice_are_reported_before_its_end_whatever_filled_the_ring() {
        // A slice open while a full ring dropped events: the ring holds the slice's begin and as many events as
        // fit; the gap must still come before the end, also when the ring was filled to the last free slot and
        // the drops came in separate bursts with ends in between.
        for capacity in [8usize, 16, 32] {
            for fill in 0..capacity {
                let (a, a_rx) = timeline(capacity);
                let (outer, _, outer_tag) = scope_begin(&a, site(1));
                let (inner, _, inner_tag) = scope_begin(&a, site(2));
                for k in 0..fill as u64 {
                    instant(&a, site(10 + k % 8));
                }
                // The first burst of drops (if the ring is full by now), an end, then another burst.
                for k in 0..capacity as u64 {
                    instant(&a, site(20 + k % 8));
                }
                scope_end(&a, site(2), inner, inner_tag);
                for k in 0..capacity as u64 {
                    instant(&a, site(30 + k % 8));
                }
                scope_end(&a, site(1), outer, outer_tag);
                let mut consumer = new_ring(&a_rx);
                let taken = records(&mut consumer);
                let items: Vec<Item<'_>> = Decoder::new(&taken).map(|i| i.unwrap()).collect();
                let dropped = consumer.dropped_records();
                let reported: u64 = items
                    .iter()
                    .map(|i| match i {
                        Item::Gap { dropped, .. } => *dropped,
                        _ => 0,
                    })
                    .sum();
                assert_eq!(reported, dropped, "capacity {capacity}, fill {fill}: {items:?}");
                // Whatever was dropped was dropped while both scopes were open; no record lands between a
                // loss and its gap, so the only things after the last gap are ends.
                let last_gap = items.iter().rposition(|i| matches!(i, Item::Gap { .. }));
                if let Some(last_gap) = last_gap {
                    assert!(
                        items[last_gap + 1..].iter().all(|i| matches!(i, Item::ScopeEnd { .. })),
                        "capacity {capacity}, fill {fill}: {items:?}"
                    );
                }
                let ends = items.iter().filter(|i| matches!(i, Item::ScopeEnd { .. })).count();
                assert_eq!(ends, [outer, inner].iter().filter(|b| **b).count());
            }
        }
    }
}
