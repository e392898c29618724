//! Loom models of the ring protocol: capacity 2, one producer thread, one consumer (the model's main
//! thread). Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib ring::loom_tests`.

use super::channel;
use loom::thread;

/// A record whose halves must agree, so a torn or stale slot read shows.
fn rec(i: u64) -> [u64; 2] {
    [i, !i]
}

/// Drains everything available, checking each record's halves, into `out`.
fn drain_into(c: &mut super::Consumer<[u64; 2]>, max: usize, out: &mut Vec<u64>) -> usize {
    c.drain(max, |s| {
        for r in s {
            assert_eq!(r[1], !r[0], "torn record");
            out.push(r[0]);
        }
    })
}

/// Drop mode: 3 pushes into 2 slots while the consumer drains; what is received is exactly what was
/// stored, in order, and received + dropped == pushed.
#[test]
fn drop_mode_counts_what_does_not_fit() {
    loom::model(|| {
        let (mut p, mut c) = channel::<[u64; 2]>(2);
        let producer = thread::spawn(move || {
            let stored: Vec<u64> = (0..3).filter(|&i| p.push_or_count_drop(rec(i))).collect();
            (stored, p.dropped())
        });
        let mut received = Vec::new();
        drain_into(&mut c, 1, &mut received);
        drain_into(&mut c, usize::MAX, &mut received);
        let (stored, dropped) = producer.join().unwrap();
        // The join orders the producer's last stores before these loads.
        drain_into(&mut c, usize::MAX, &mut received);
        assert!(c.is_closed());
        assert!(c.is_finished());
        assert_eq!(received, stored);
        assert_eq!(c.dropped_records(), dropped);
        assert_eq!(received.len() as u64 + dropped, 3);
    });
}

/// The producer's thread exits (drops the Producer) while the consumer drains: without a join, the
/// consumer must see every stored record, observe the ring closed and finished, and read the final
/// drop count (3 pushes into 2 slots in drop mode).
#[test]
fn producer_exit_while_draining_loses_nothing() {
    loom::model(|| {
        let (mut p, mut c) = channel::<[u64; 2]>(2);
        let producer = thread::spawn(move || {
            let stored: Vec<u64> = (0..3).filter(|&i| p.push_or_count_drop(rec(i))).collect();
            stored
            // `p` dropped here: thread exit.
        });
        let mut received = Vec::new();
        while !c.is_finished() {
            if drain_into(&mut c, usize::MAX, &mut received) == 0 {
                thread::yield_now();
            }
        }
        // Checked before the join, which would order everything by itself.
        assert_eq!(c.drain(usize::MAX, |_| panic!("finished ring not empty")), 0);
        assert_eq!(received.len() as u64 + c.dropped_records(), 3);
        let before_join = received.clone();
        let stored = producer.join().unwrap();
        assert_eq!(before_join, stored);
    });
}

/// Lossless mode: 3 `push_all_waiting`s into 2 slots; the producer waits for the consumer, and the
/// consumer receives exactly 0, 1, 2.
#[test]
fn lossless_push_waiting_delivers_everything() {
    loom::model(|| {
        let (mut p, mut c) = channel::<[u64; 2]>(2);
        let producer = thread::spawn(move || {
            for i in 0..3 {
                assert!(p.push_all_waiting(&[rec(i)], || true));
            }
        });
        let mut received = Vec::new();
        while !c.is_finished() {
            if drain_into(&mut c, usize::MAX, &mut received) == 0 {
                thread::yield_now();
            }
        }
        assert_eq!(received, [0, 1, 2]);
        assert_eq!(c.dropped_records(), 0);
        producer.join().unwrap();
    });
}

/// Lossless mode with a consumer that goes away: the waiting producer returns instead of hanging.
#[test]
fn push_waiting_returns_when_the_consumer_drops() {
    loom::model(|| {
        let (mut p, mut c) = channel::<[u64; 2]>(2);
        let producer = thread::spawn(move || {
            (0..3)
                .map(|i| p.push_all_waiting(&[rec(i)], || true))
                .collect::<Vec<_>>()
        });
        let mut received = Vec::new();
        drain_into(&mut c, 1, &mut received);
        drop(c);
        let ok = producer.join().unwrap();
        assert_eq!(&ok[..2], [true, true], "the first two fit without waiting");
        assert!(received.len() <= 1);
    });
}

/// A group pushed with `try_push_all` (2 records, 2 slots) reaches the consumer whole or not at all.
#[test]
fn group_push_is_seen_whole() {
    loom::model(|| {
        let (mut p, mut c) = channel::<[u64; 2]>(2);
        let producer = thread::spawn(move || {
            assert!(p.try_push_all(&[rec(0), rec(1)]), "empty ring has room for 2");
        });
        let mut received = Vec::new();
        let n = drain_into(&mut c, usize::MAX, &mut received);
        assert!(n == 0 || n == 2, "saw {n} records of a group of 2");
        producer.join().unwrap();
        drain_into(&mut c, usize::MAX, &mut received);
        assert_eq!(received, [0, 1]);
    });
}

/// The drain stage's loop (`collector/drain.rs`): note `closed` before draining, drain everything up to
/// the tail, and free the ring once a drain followed a `closed` reading. Nothing may be lost.
#[test]
fn drain_loop_frees_only_a_drained_closed_ring() {
    loom::model(|| {
        let (mut p, mut c) = channel::<[u64; 2]>(2);
        let producer = thread::spawn(move || {
            let stored: Vec<u64> = (0..3).filter(|&i| p.push_or_count_drop(rec(i))).collect();
            stored
        });
        let mut received = Vec::new();
        loop {
            let closed = c.is_closed();
            drain_into(&mut c, usize::MAX, &mut received);
            if closed {
                assert_eq!(c.len(), 0, "a drain after the close takes everything");
                break;
            }
            thread::yield_now();
        }
        assert_eq!(received.len() as u64 + c.dropped_records(), 3);
        let before_join = received.clone();
        assert_eq!(before_join, producer.join().unwrap());
    });
}

/// Whole slices: a begin goes in only with room for its end kept free (`keep = 1`), so the end, pushed with
/// nothing kept, always fits, whatever the consumer does meanwhile.
#[test]
fn an_end_always_fits_once_its_begin_went_in() {
    loom::model(|| {
        let (mut p, mut c) = channel::<[u64; 2]>(2);
        let producer = thread::spawn(move || {
            let mut pairs = 0;
            for i in 0..2 {
                if p.try_push_all_keeping(&[rec(2 * i)], 1) {
                    assert!(p.try_push_all_keeping(&[rec(2 * i + 1)], 0), "the end's slot was kept");
                    pairs += 1;
                }
            }
            pairs
        });
        let mut received = Vec::new();
        drain_into(&mut c, usize::MAX, &mut received);
        let pairs = producer.join().unwrap();
        drain_into(&mut c, usize::MAX, &mut received);
        assert_eq!(received.len(), 2 * pairs, "begins and ends in pairs: {received:?}");
        assert!(received.chunks(2).all(|pair| pair[1] == pair[0] + 1));
        assert!(pairs >= 1, "the empty ring takes the first pair");
    });
}
