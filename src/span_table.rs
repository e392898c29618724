//! [`SpanTable`]: which tickline span serial a `tracing` span id stands for, right now.
//!
//! `tracing`'s registry hands a span id out again once the span has closed (after about 8,191 spans on one
//! thread with `tracing-subscriber`'s registry). Records that carried the registry id would be resolved by the
//! collector to whichever span last had it, so records carry a serial of tickline's own instead, unique for
//! the life of the timeline, and this table maps the id to it on every enter, exit, `record` and close.
//!
//! A layer's table belongs to that layer's subscriber (ids of different registries collide), so each
//! [`TicklineLayer`](crate::TicklineLayer) clone has its own. The table is set-associative: an id's set has
//! four ways, each a small seqlock (sequence, id, serial) written only while its way is claimed. A span's
//! entry is written once at creation (a compare-and-swap claims a free way) and cleared at close (a plain
//! store: nobody else can touch a way its span still holds). Reads (the hot path: enter and exit) are plain
//! atomic loads, with no read-modify-write and no lock. A set whose four ways are held by live spans sends
//! further spans to an overflow map under a mutex; lookups go there only when an id is not in its set and the
//! overflow map is not empty.
//!
//! Each entry also says whether a `record` reached its span ([`get_recording`](SpanTable::get_recording)):
//! a span closed without one has the values it was created with for good, which its close record tells the
//! collector (its slices then need not wait for values recorded on other threads). The flag is a plain
//! store on the span's own way, which only that span holds while it lives; its close reads it, and every
//! `record` on the span happened before the close (a `record` needs a handle on the span, and the close
//! comes after the registry saw the last handle dropped, with the ordering its reference count gives).
//!
//! Why a span's entry cannot be mistaken for another's: an id is unique among live spans of one
//! registry; a way is cleared only by its span's close, which happens before the registry can hand the
//! id out again; and a reader that races a writer on the same way sees the sequence change and ignores
//! what it read.

use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Ways per set.
const WAYS: usize = 4;
/// Sets per table: 1,024 x 4 ways = 4,096 entries (96 KiB) before any span overflows; most programs have
/// far fewer live spans. More live spans still work, through the overflow map.
const SETS: usize = 1024;

/// One way: a seqlock over `(id, serial)`. `seq` is odd while a writer fills the way.
#[derive(Default)]
struct Way {
    seq: AtomicU32,
    /// A `record` reached the span held (see the module docs); cleared when a span claims the way.
    recorded: AtomicBool,
    /// How often the span held was entered (on any thread), counted up to [`MAY_BE_TASK`]: one entered again
    /// may be an async task, whose close must be timed. A plain load and store on enter, no
    /// read-modify-write (see [`SpanTable::get_entering`]); cleared when a span claims the way.
    enters: AtomicU8,
    /// A span named the span held as its explicit parent ([`SpanTable::get_parenting`]): it may hold async
    /// tasks, whose container's close must be timed too. Its own flag, so no enter's store can undo it;
    /// cleared when a span claims the way.
    named_parent: AtomicBool,
    /// The registry id held, 0 when free.
    id: AtomicU64,
    serial: AtomicU64,
}

#[derive(Default)]
#[repr(align(128))]
struct Set {
    ways: [Way; WAYS],
}

/// Enters counted before a span counts as entered again, so possibly an async task (and counting stops).
const MAY_BE_TASK: u8 = 2;

/// A span held by the overflow map.
struct OverflowEntry {
    serial: u64,
    /// A `record` reached it.
    recorded: bool,
    /// Enters, counted up to [`MAY_BE_TASK`].
    enters: u8,
    /// A span named it as its explicit parent.
    named_parent: bool,
}

/// What a span's close needs to know from its entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Closing {
    pub(crate) serial: u64,
    /// A `record` reached the span.
    pub(crate) recorded: bool,
    /// It was entered more than once (on any threads), or named as a span's explicit parent: it may be an
    /// async task, or hold some.
    pub(crate) may_be_task: bool,
}

/// Registry span id -> tickline serial, for the live spans of one subscriber.
pub(crate) struct SpanTable {
    sets: Box<[Set]>,
    /// Spans whose set's ways were all taken, by id.
    overflow: Mutex<HashMap<u64, OverflowEntry>>,
    /// Entries in `overflow`, read without the lock.
    overflow_len: AtomicUsize,
}

impl std::fmt::Debug for SpanTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpanTable")
            .field("overflow", &self.overflow_len.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Default for SpanTable {
    fn default() -> Self {
        SpanTable {
            sets: (0..SETS).map(|_| Set::default()).collect(),
            overflow: Mutex::new(HashMap::new()),
            overflow_len: AtomicUsize::new(0),
        }
    }
}

#[inline(always)]
fn set_of(id: u64) -> usize {
    // Fibonacci hashing: registry ids differ mostly in their low bits.
    (id.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - SETS.trailing_zeros())) as usize
}

impl SpanTable {
    /// Remembers that span `id` (non-zero, live) is `serial`. `id` must not be in the table already.
    #[inline]
    pub(crate) fn insert(&self, id: u64, serial: u64) {
        debug_assert_ne!(id, 0);
        for way in &self.sets[set_of(id)].ways {
            let seq = way.seq.load(Ordering::Acquire);
            if seq & 1 != 0 || way.id.load(Ordering::Relaxed) != 0 {
                continue;
            }
            // Claim the way: its sequence goes odd. A writer that claimed it first, or filled and released
            // it since we looked, changed the sequence, and we try the next way.
            // A way filled since we looked has a new sequence (a fill moves it by 2), so the claim fails and
            // we never take a way that is not free.
            if way
                .seq
                .compare_exchange(seq, seq.wrapping_add(1), Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // Release fence: the odd sequence is visible before the new contents (pairs with the reader's
            // Acquire fence before its second sequence load).
            fence(Ordering::Release);
            way.recorded.store(false, Ordering::Relaxed);
            way.enters.store(0, Ordering::Relaxed);
            way.named_parent.store(false, Ordering::Relaxed);
            way.serial.store(serial, Ordering::Relaxed);
            way.id.store(id, Ordering::Relaxed);
            // Release: publishes the contents; pairs with the Acquire load of `seq` in `lookup`.
            way.seq.store(seq.wrapping_add(2), Ordering::Release);
            return;
        }
        self.insert_overflow(id, serial);
    }

    #[cold]
    #[inline(never)]
    fn insert_overflow(&self, id: u64, serial: u64) {
        let mut overflow = self.overflow.lock().unwrap_or_else(|e| e.into_inner());
        overflow.insert(
            id,
            OverflowEntry {
                serial,
                recorded: false,
                enters: 0,
                named_parent: false,
            },
        );
        self.overflow_len.store(overflow.len(), Ordering::Release);
    }

    /// The way holding `id`, if its set has it. Id 0 (no span: `tracing` ids are non-zero) marks a free way.
    #[inline(always)]
    fn find(&self, id: u64) -> Option<(&Way, u64)> {
        if id == 0 {
            return None;
        }
        for way in &self.sets[set_of(id)].ways {
            // Acquire: pairs with the Release store of `seq` in `insert`, so the contents it published are
            // visible.
            let seq = way.seq.load(Ordering::Acquire);
            if seq & 1 != 0 {
                // Being filled: with a span other than `id`, since `id`'s own entry, once written, is only
                // ever cleared by its close.
                continue;
            }
            if way.id.load(Ordering::Relaxed) != id {
                continue;
            }
            let serial = way.serial.load(Ordering::Relaxed);
            // Acquire fence: the loads above complete before the sequence is read again.
            fence(Ordering::Acquire);
            if way.seq.load(Ordering::Relaxed) == seq {
                return Some((way, serial));
            }
        }
        None
    }

    /// The serial of live span `id`, if the table has it.
    #[inline(always)]
    pub(crate) fn get(&self, id: u64) -> Option<u64> {
        match self.find(id) {
            Some((_, serial)) => Some(serial),
            None => self.get_overflow(id),
        }
    }

    /// `f` on the overflow map, locked; `None` without taking the lock when the map is empty (the common
    /// case: every lookup that misses its set comes here).
    fn with_overflow<R>(&self, f: impl FnOnce(&mut HashMap<u64, OverflowEntry>) -> Option<R>) -> Option<R> {
        if self.overflow_len.load(Ordering::Acquire) == 0 {
            return None;
        }
        f(&mut self.overflow.lock().unwrap_or_else(|e| e.into_inner()))
    }

    #[cold]
    fn get_overflow(&self, id: u64) -> Option<u64> {
        self.with_overflow(|overflow| overflow.get(&id).map(|entry| entry.serial))
    }

    /// The serial of live span `id`, if the table has it, noting that the span was entered (once, or again).
    ///
    /// Two threads entering a span for the first time at the same moment may both note a first enter: the
    /// span is then seen as entered once until its next enter. Its close is then untimed if the span was a
    /// leaf on its thread (the cost of the race: an async task lifetime that ends at its last exit), which
    /// keeps this a plain load (and two stores in a span's life) instead of a read-modify-write on every enter.
    #[inline(always)]
    pub(crate) fn get_entering(&self, id: u64) -> Option<u64> {
        match self.find(id) {
            Some((way, serial)) => {
                // Relaxed: read by the span's close, which the registry orders after every enter (module docs).
                let enters = way.enters.load(Ordering::Relaxed);
                if enters < MAY_BE_TASK {
                    way.enters.store(enters + 1, Ordering::Relaxed);
                }
                Some(serial)
            }
            None => self.get_entering_overflow(id),
        }
    }

    #[cold]
    fn get_entering_overflow(&self, id: u64) -> Option<u64> {
        self.with_overflow(|overflow| {
            let entry = overflow.get_mut(&id)?;
            entry.enters = (entry.enters + 1).min(MAY_BE_TASK);
            Some(entry.serial)
        })
    }

    /// The serial of live span `id`, if the table has it, noting that a span named it as its explicit parent:
    /// a span with children may hold async tasks, so its close is timed like a task's. Contextual children
    /// need no note: they are created while their parent is entered, which the recorder sees on the thread.
    #[inline]
    pub(crate) fn get_parenting(&self, id: u64) -> Option<u64> {
        // Relaxed: read by the span's close, which the registry orders after its children's creation (a child
        // holds a reference on its parent).
        self.get_flagging(id, |way| &way.named_parent, |entry| &mut entry.named_parent)
    }

    /// The serial of live span `id`, if the table has it, noting that a `record` reached the span.
    #[inline]
    pub(crate) fn get_recording(&self, id: u64) -> Option<u64> {
        // Relaxed: read by the span's close, which the registry orders after this call (module docs).
        self.get_flagging(id, |way| &way.recorded, |entry| &mut entry.recorded)
    }

    /// The serial of live span `id`, if the table has it, setting one of its flags (a relaxed store on its own
    /// way, or under the overflow map's lock).
    #[inline(always)]
    fn get_flagging(
        &self,
        id: u64,
        on_way: impl FnOnce(&Way) -> &AtomicBool,
        in_overflow: impl FnOnce(&mut OverflowEntry) -> &mut bool,
    ) -> Option<u64> {
        match self.find(id) {
            Some((way, serial)) => {
                on_way(way).store(true, Ordering::Relaxed);
                Some(serial)
            }
            None => self.with_overflow(|overflow| {
                let entry = overflow.get_mut(&id)?;
                *in_overflow(entry) = true;
                Some(entry.serial)
            }),
        }
    }

    /// Forgets span `id` (it closed) and returns what its close needs to know.
    #[inline]
    pub(crate) fn remove(&self, id: u64) -> Option<Closing> {
        match self.find(id) {
            Some((way, serial)) => {
                let closing = Closing {
                    serial,
                    recorded: way.recorded.load(Ordering::Relaxed),
                    may_be_task: way.enters.load(Ordering::Relaxed) >= MAY_BE_TASK
                        || way.named_parent.load(Ordering::Relaxed),
                };
                // A plain store: no writer claims a way whose id is non-zero, and no reader wants this id
                // any more (the span is closing; its id may be handed out only after this returns).
                way.id.store(0, Ordering::Release);
                Some(closing)
            }
            None => self.remove_overflow(id),
        }
    }

    #[cold]
    fn remove_overflow(&self, id: u64) -> Option<Closing> {
        self.with_overflow(|overflow| {
            let entry = overflow.remove(&id);
            self.overflow_len.store(overflow.len(), Ordering::Release);
            entry.map(|entry| Closing {
                serial: entry.serial,
                recorded: entry.recorded,
                may_be_task: entry.enters >= MAY_BE_TASK || entry.named_parent,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn removed(table: &SpanTable, id: u64) -> Option<(u64, bool)> {
        table.remove(id).map(|c| (c.serial, c.recorded))
    }

    /// A span's close knows whether it may be an async task or hold some (entered more than once, or named as
    /// a span's explicit parent), in its set's ways and in the overflow map alike.
    #[test]
    fn a_close_knows_whether_its_span_may_be_a_task() {
        let table = SpanTable::default();
        // More spans than one set's ways: some go to the overflow map.
        let ids: Vec<u64> = (1..).filter(|&id| set_of(id) == set_of(1)).take(12).collect();
        for (k, &id) in ids.iter().enumerate() {
            table.insert(id, k as u64 + 1);
            for _ in 0..k % 3 {
                assert_eq!(table.get_entering(id), Some(k as u64 + 1));
            }
            if k % 4 == 1 {
                assert_eq!(table.get_parenting(id), Some(k as u64 + 1));
                // An enter after the note leaves it.
                assert_eq!(table.get_entering(id), Some(k as u64 + 1));
            }
        }
        assert!(
            table.overflow_len.load(Ordering::Relaxed) > 0,
            "the test needs the overflow map"
        );
        for (k, &id) in ids.iter().enumerate() {
            let closing = table.remove(id).expect("live");
            assert_eq!(
                (closing.serial, closing.may_be_task),
                (k as u64 + 1, k % 3 == 2 || k % 4 == 1),
                "span {k}"
            );
        }
        // A way taken over by a new span starts over.
        table.insert(ids[0], 99);
        assert!(table.get_parenting(ids[0]).is_some());
        assert!(table.remove(ids[0]).unwrap().may_be_task);
        table.insert(ids[0], 100);
        assert!(!table.remove(ids[0]).unwrap().may_be_task);
    }

    #[test]
    fn ids_map_to_their_serials_until_removed() {
        let table = SpanTable::default();
        for id in 1..=10_000u64 {
            table.insert(id, id * 3);
        }
        assert!(
            table.overflow_len.load(Ordering::Relaxed) > 0,
            "10,000 live spans overflow 4,096 ways"
        );
        for id in 1..=10_000u64 {
            assert_eq!(table.get(id), Some(id * 3));
        }
        for id in (1..=10_000u64).step_by(2) {
            assert_eq!(removed(&table, id), Some((id * 3, false)));
        }
        for id in 1..=10_000u64 {
            assert_eq!(table.get(id), (id % 2 == 0).then_some(id * 3), "id {id}");
        }
        assert_eq!(table.get(0), None);
        assert_eq!(removed(&table, 1), None);
    }

    /// A `record` marks its span, in a way and in the overflow map alike; the span that takes the id (and
    /// the way) next starts unmarked.
    #[test]
    fn a_record_marks_its_span_until_its_close_and_no_later_span() {
        let table = SpanTable::default();
        // 5,000 live spans: some in ways, the rest in the overflow map.
        for id in 1..=5_000u64 {
            table.insert(id, id + 7);
        }
        for id in (1..=5_000u64).filter(|id| id % 3 == 0) {
            assert_eq!(table.get_recording(id), Some(id + 7));
        }
        assert_eq!(table.get_recording(9_999), None);
        for id in 1..=5_000u64 {
            assert_eq!(removed(&table, id), Some((id + 7, id % 3 == 0)), "id {id}");
        }
        for id in 1..=5_000u64 {
            table.insert(id, id);
            assert_eq!(removed(&table, id), Some((id, false)), "id {id} again");
        }
    }

    #[test]
    fn a_reused_id_resolves_to_its_new_serial() {
        let table = SpanTable::default();
        for serial in 1..=100_000u64 {
            // The registry's pattern under load: the same id again and again, one live span at a time.
            table.insert(42, serial);
            assert_eq!(table.get(42), Some(serial));
            assert_eq!(removed(&table, 42), Some((serial, false)));
        }
        assert_eq!(table.overflow_len.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn concurrent_writers_and_readers_never_see_another_spans_serial() {
        const N: u64 = if cfg!(miri) { 200 } else { 200_000 };
        let table = Arc::new(SpanTable::default());
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let table = table.clone();
                s.spawn(move || {
                    // Ids that share sets across threads (same low bits), as registry ids do.
                    let held = 1_000 + t;
                    table.insert(held, held << 32);
                    for i in 0..N {
                        let id = (t + 1) | ((i % 64) << 8);
                        let serial = (t << 48) | i;
                        table.insert(id, serial);
                        assert_eq!(table.get(id), Some(serial));
                        assert_eq!(table.get(held), Some(held << 32));
                        // Every other span is recorded: a way's flag never outlives its span.
                        let recorded = i % 2 == 0;
                        if recorded {
                            assert_eq!(table.get_recording(id), Some(serial));
                        }
                        assert_eq!(removed(&table, id), Some((serial, recorded)));
                    }
                });
            }
        });
    }
}
