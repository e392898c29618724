//! The hot path allocates nothing after a thread's warm-up (its first records): checked with a counting
//! global allocator, which is why this is a test binary of its own (an allocator is per binary). Only
//! allocations on the recording thread while it records are counted.
//!
//! What warm-up is: a thread's first record registers its ring, and its first record with fields sizes its
//! scratch space for the largest payload. After that, records whose fields are longer than any before must
//! not allocate either (the case an audit found: the scratch space used to grow on demand).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use tickline::Timeline;
use tracing_subscriber::layer::SubscriberExt;

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

fn note() {
    // `try_with`: no panic while the thread's locals are being torn down.
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator with the caller's layout and pointer unchanged; the
// counting touches only an atomic and a const-initialised thread-local (no allocation, no re-entry).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded with the caller's layout, which meets `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout (every allocation goes through `alloc` above).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: as for `dealloc`; `new_size` is the caller's, meeting `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One test at a time: native macros record into the most recently started timeline, so a second test's
/// timeline starting meanwhile would move this thread's records to a new ring (an allocation), and each test
/// reads the one global count.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Allocations on this thread while `f` runs.
fn allocations_in(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

#[test]
fn recording_allocates_nothing_after_warm_up_even_as_fields_grow() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // A fixed ring (a growing one allocates its successor when it fills: documented), large enough here.
    let timeline = Timeline::builder().ring_capacity(1 << 20).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    let text = "x".repeat(8192);
    tracing::subscriber::with_default(subscriber, || {
        let record = |i: usize| {
            let _scope = tickline::scope!("scope");
            let _bare = tracing::info_span!("bare").entered();
            let span = tracing::info_span!("request", id = %i, done = tracing::field::Empty).entered();
            // A message and a field longer than any before, as `i` grows.
            tracing::info!(len = i, "{}", &text[..i % 6000]);
            span.record("done", true);
            tickline::instant!("instant");
            tickline::counter!("counter", i as f64);
        };
        // Warm-up: the thread's first records (its ring, its scratch space, the call sites).
        record(1);
        let allocations = allocations_in(|| {
            for i in 2..20_000 {
                record(i);
            }
        });
        assert_eq!(allocations, 0, "allocations on the recording thread after warm-up");
    });
    let stats = timeline.shutdown().unwrap();
    assert!(stats.records > 20_000 * 8, "{stats:?}");
}

#[test]
fn a_full_ring_refuses_and_drops_without_allocating() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Drop mode, a small fixed ring; then a collector that drains only when flushed: most begins are refused.
    let timeline = Timeline::builder().ring_capacity(256).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        let spans: Vec<_> = (0..24).map(|_| tracing::info_span!("nested")).collect();
        let nest = || {
            let entered: [_; 24] = std::array::from_fn(|k| spans[k].enter());
            let _scope = tickline::scope!("innermost");
            drop(entered);
        };
        // Warm-up, with room in the ring: tickline's ring, and the registry's own span stack 24 deep.
        nest();
        timeline.flush().unwrap();
        timeline.pause_drain(true);
        let allocations = allocations_in(|| {
            for _ in 0..1_000 {
                nest();
            }
        });
        assert_eq!(allocations, 0, "allocations while the ring was full");
    });
    timeline.pause_drain(false);
    let stats = timeline.shutdown().unwrap();
    assert!(stats.dropped_slices > 1_000, "the ring must have been full: {stats:?}");
}
