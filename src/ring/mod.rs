//! TEMPORARY stand-in (mutex-based) until the lock-free ring lands; same API.
#![allow(dead_code, missing_docs)]
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

struct Shared<T> {
    q: Mutex<VecDeque<T>>,
    cap: usize,
    dropped: AtomicU64,
    producer_alive: AtomicBool,
    consumer_alive: AtomicBool,
}
pub(crate) struct Producer<T> {
    s: Arc<Shared<T>>,
}
pub(crate) struct Consumer<T> {
    s: Arc<Shared<T>>,
    buf: Vec<T>,
}
pub(crate) fn channel<T: Copy + Send>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    let s = Arc::new(Shared {
        q: Mutex::new(VecDeque::new()),
        cap: capacity.next_power_of_two().max(2),
        dropped: AtomicU64::new(0),
        producer_alive: AtomicBool::new(true),
        consumer_alive: AtomicBool::new(true),
    });
    (Producer { s: s.clone() }, Consumer { s, buf: Vec::new() })
}
impl<T: Copy + Send> Producer<T> {
    pub(crate) fn try_push(&mut self, v: T) -> Result<(), T> {
        let mut q = self.s.q.lock().unwrap();
        if q.len() >= self.s.cap {
            return Err(v);
        }
        q.push_back(v);
        Ok(())
    }
    pub(crate) fn push_or_count_drop(&mut self, v: T) -> bool {
        if self.try_push(v).is_err() {
            self.s.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }
    pub(crate) fn count_drops(&mut self, n: u64) {
        self.s.dropped.fetch_add(n, Ordering::Relaxed);
    }
    pub(crate) fn try_push_all(&mut self, vs: &[T]) -> bool {
        let mut q = self.s.q.lock().unwrap();
        if q.len() + vs.len() > self.s.cap {
            return false;
        }
        q.extend(vs.iter().copied());
        true
    }
    pub(crate) fn push_waiting(&mut self, mut v: T) -> Result<(), T> {
        loop {
            match self.try_push(v) {
                Ok(()) => return Ok(()),
                Err(back) => {
                    if !self.s.consumer_alive.load(Ordering::Acquire) {
                        return Err(back);
                    }
                    v = back;
                    std::thread::yield_now();
                }
            }
        }
    }
    pub(crate) fn is_consumer_alive(&self) -> bool {
        self.s.consumer_alive.load(Ordering::Acquire)
    }
}
impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        self.s.producer_alive.store(false, Ordering::Release);
    }
}
impl<T> Drop for Consumer<T> {
    fn drop(&mut self) {
        self.s.consumer_alive.store(false, Ordering::Release);
    }
}
impl<T: Copy + Send> Consumer<T> {
    pub(crate) fn drain(&mut self, max: usize, mut f: impl FnMut(&[T])) -> usize {
        let mut q = self.s.q.lock().unwrap();
        let n = q.len().min(max);
        self.buf.clear();
        self.buf.extend(q.drain(..n));
        drop(q);
        f(&self.buf);
        n
    }
    pub(crate) fn len(&self) -> usize {
        self.s.q.lock().unwrap().len()
    }
    pub(crate) fn dropped_records(&self) -> u64 {
        self.s.dropped.load(Ordering::Relaxed)
    }
    pub(crate) fn is_producer_alive(&self) -> bool {
        self.s.producer_alive.load(Ordering::Acquire)
    }
}
