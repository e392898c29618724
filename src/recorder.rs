//! The hot path's side: each thread's ring for each live timeline, registered with the collector on the
//! thread's first record and closed when the thread exits.
//!
//! After the first record a push is: one thread-local access, one compare of the timeline id, one ring push.
//! No allocation, no lock, no system call.

use std::cell::RefCell;
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
    #[inline(always)]
    fn push(&mut self, record: Record) {
        if self.lossless {
            // Err only when the collector is gone: then there is nobody left to lose the record to.
            let _ = self.producer.push_waiting(record);
        } else {
            self.producer.push_or_count_drop(record);
        }
    }

    #[inline]
    fn push_group(&mut self, group: &[Record]) {
        if self.lossless {
            while !self.producer.try_push_all(group) {
                if !self.producer.is_consumer_alive() {
                    return;
                }
                std::thread::yield_now();
            }
        } else if !self.producer.try_push_all(group) {
            self.producer.count_drops(group.len() as u64);
        }
    }
}

thread_local! {
    static RINGS: RefCell<Vec<LocalRing>> = const { RefCell::new(Vec::new()) };
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
#[inline(always)]
fn with_ring(target: &impl Target, f: impl FnOnce(&mut LocalRing)) {
    let id = target.id();
    if id == 0 {
        return;
    }
    let _ = RINGS.try_with(|rings| {
        let Ok(mut rings) = rings.try_borrow_mut() else { return };
        if let Some(ring) = rings.first_mut().filter(|r| r.timeline == id) {
            return f(ring);
        }
        if let Some(pos) = rings.iter().position(|r| r.timeline == id) {
            // Most recently used first, so the next record takes the fast path.
            rings.swap(0, pos);
            return f(&mut rings[0]);
        }
        if let Some(shared) = target.shared().filter(|s| s.id == id) {
            if let Some(ring) = register(&shared, &mut rings) {
                f(ring)
            }
        }
    });
}

#[cold]
fn register<'a>(shared: &Shared, rings: &'a mut Vec<LocalRing>) -> Option<&'a mut LocalRing> {
    if !shared.running.load(Ordering::Acquire) {
        return None;
    }
    // Rings of timelines that have shut down are of no use any more.
    rings.retain(|r| r.producer.is_consumer_alive());
    let (producer, consumer) = channel(shared.ring_capacity);
    let thread = std::thread::current();
    let tid = current_tid();
    let name = thread.name().map_or_else(|| format!("thread-{tid}"), str::to_owned);
    shared.control.send(Control::NewRing { consumer, tid, name }).ok()?;
    rings.insert(
        0,
        LocalRing {
            timeline: shared.id,
            producer,
            lossless: shared.lossless,
            source: shared.source,
        },
    );
    rings.first_mut()
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
) {
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
            ring.push_group(group);
        });
    });
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
