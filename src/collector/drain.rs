//! The drain stage: the collector's live side, on its own thread (`tickline-drain`).
//!
//! It does only what must happen while the program runs, and nothing that scales with the work of turning
//! records into a timeline: it moves whole rings' worth of raw records into chunks (a copy, at memory
//! speed), reads the control channel, takes the CPU clock's calibration bursts, and polls the GPUs (reads
//! finished timestamp pairs and releases their slots at once, takes their calibration bursts, retires
//! pairs that are never written). Everything it learns goes, in order, into the input log the
//! processing stage consumes (see `input.rs`).
//!
//! Chunk memory in flight is bounded (`TimelineBuilder::chunk_budget`): when the processing stage falls that
//! far behind, the drain stage stops draining and the rings fill, so drop mode (or a lossless producer's
//! wait) starts only then, and every loss is counted where it happens.
//!
//! It polls every `poll_interval`, and sooner when a producer finds its ring half full (the producer unparks
//! this thread) or a control message arrives (its sender unparks it).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use crossbeam_queue::ArrayQueue;

use super::drain_gpu::GpuLive;
use super::input::{CallsiteDef, Chunk, Input};
use super::stats::SharedStats;
use crate::calibration::CalibrationSample;
use crate::clock::{bracketed_sample, monotonic_ns, TickSource};
use crate::codec::Record;
use crate::control::{Control, Reply};
use crate::gpu::{GpuCalibrationConfig, GpuControl};
use crate::recorder::Shared;
use crate::ring::Consumer;

/// Chunk memory in flight between the drain and processing stages.
#[derive(Debug, Default)]
pub(crate) struct Budget {
    used_bytes: AtomicU64,
}

impl Budget {
    pub(crate) fn add(&self, bytes: usize) {
        self.used_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn release(&self, bytes: usize) {
        self.used_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn used(&self) -> u64 {
        self.used_bytes.load(Ordering::Relaxed)
    }
}

/// Spare chunk buffers handed back by the processing stage: reusing them keeps the drain from allocating
/// (and faulting in) fresh memory on every pass.
pub(crate) type ChunkPool = ArrayQueue<Vec<Record>>;

/// How the drain stage runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DrainConfig {
    pub(crate) poll_interval: Duration,
    pub(crate) chunk_budget_bytes: u64,
    pub(crate) cpu_burst_samples: usize,
    pub(crate) cpu_burst_interval: Duration,
    pub(crate) gpu: GpuCalibrationConfig,
}

struct LiveRing {
    ring: u32,
    consumer: Consumer<Record>,
    /// Records and slices dropped by the rings this one took over from (a ring grows by handing over to a
    /// larger one), so the totals the processing stage sees per ring number keep counting.
    dropped_base: (u64, u64),
    /// The records-dropped total the last chunk of this ring number said (drops after a ring's last record
    /// are sent in an empty chunk, so the processing stage can show them: a ring that drops and then stays
    /// idle, or ends, writes no `Gap` record for them).
    reported_dropped: u64,
    /// The ring's loss-marker count (`Consumer::markers`) already added to `SharedStats::markers_drained`.
    reported_markers: u64,
}

/// The drain stage's state. Runs on its own thread; see the module docs.
pub(crate) struct Drain {
    config: DrainConfig,
    control: Receiver<Control>,
    gpu_registrations: Receiver<GpuControl>,
    out: Sender<Input>,
    rings: Vec<LiveRing>,
    source: TickSource,
    next_cpu_burst_ns: u64,
    budget: Arc<Budget>,
    pool: Arc<ChunkPool>,
    gpu: GpuLive,
    stats: Arc<SharedStats>,
    /// Drop totals (records, slices) of rings whose threads ended.
    dropped_of_ended: (u64, u64),
    shared: Arc<Shared>,
    /// The tick-source decision's revision last reported (the background check may revise it).
    decision_revision: u64,
    /// Inputs of the pass being assembled: registrations first, then chunks, then the rest.
    registrations: Vec<Input>,
    chunks: Vec<Input>,
    tail: Vec<Input>,
}

/// What a pass was asked to end with.
enum Request {
    Flush(Reply),
    Shutdown(Reply),
}

impl Drain {
    pub(crate) fn new(
        config: DrainConfig,
        shared: Arc<Shared>,
        (inbox, out): (super::Inbox, Sender<Input>),
        (budget, pool, stats): (Arc<Budget>, Arc<ChunkPool>, Arc<SharedStats>),
        decision: crate::clock::TickSourceDecision,
    ) -> Self {
        let mut tail = Vec::new();
        tail.push(Input::CpuClockNote {
            fallback: decision.is_fallback(),
            doubt: false,
            text: clock_note(&decision),
        });
        Drain {
            decision_revision: if decision.forced {
                u64::MAX
            } else {
                crate::clock::TscDecider::process().revision()
            },
            source: shared.source,
            shared,
            dropped_of_ended: (0, 0),
            gpu: GpuLive::new(config.gpu),
            config,
            control: inbox.control,
            gpu_registrations: inbox.gpu,
            out,
            rings: Vec::new(),
            next_cpu_burst_ns: 0,
            budget,
            pool,
            stats,
            registrations: Vec::new(),
            chunks: Vec::new(),
            tail,
        }
    }

    /// A later finding of the process's background clock check, for this timeline's trace.
    fn clock_revision(&mut self) {
        if self.decision_revision == u64::MAX {
            return;
        }
        let decider = crate::clock::TscDecider::process();
        let revision = decider.revision();
        if revision == self.decision_revision {
            return;
        }
        self.decision_revision = revision;
        if let Some(decision) = decider.current() {
            let note = decision.note_for_timeline(self.source);
            let mut text = clock_note(&decision);
            if let Some(note) = &note {
                text = format!("{note}; {text}");
            }
            self.tail.push(Input::CpuClockNote {
                fallback: self.source == crate::clock::TickSource::Monotonic && decision.hardware.is_some(),
                doubt: note.is_some(),
                text,
            });
        }
    }

    /// The thread's loop: a pass every poll interval or when woken, until shutdown.
    pub(crate) fn run(mut self) {
        crate::recorder::mark_collector_thread(self.shared.id);
        self.stats
            .drain_priority
            .store(raise_priority() as u64, Ordering::Relaxed);
        loop {
            // Requests read by the passes a request makes are taken in turn after it (one thread's flush
            // may arrive while another's is served): none is left unanswered.
            let mut requests = VecDeque::from(self.pass(false));
            while let Some(request) = requests.pop_front() {
                match request {
                    Request::Flush(reply) => {
                        // Everything recorded before the flush was pushed before its message was sent, and
                        // the message was read after this pass's drain: drain once more to take it all.
                        requests.extend(self.pass(true));
                        // And once again: a slice that ended before the flush was called is in that pass or
                        // earlier, so values recorded on other threads before its end are all in this one
                        // (they may have been pushed after their ring was read in the first). A slice that
                        // ends only in this pass ended after the call: the processing stage sends out its
                        // begin with the flush and keeps its end for the next pass.
                        requests.extend(self.pass(true));
                        self.send(Input::Flush(reply));
                    }
                    Request::Shutdown(reply) => {
                        requests.extend(self.finish());
                        // Flushes asked for before the end are served by it: everything is drained.
                        for request in requests {
                            if let Request::Flush(flush) = request {
                                self.send(Input::Flush(flush));
                            }
                        }
                        self.send(Input::Shutdown(reply));
                        return;
                    }
                }
            }
            std::thread::park_timeout(self.config.poll_interval);
        }
    }

    fn send(&self, input: Input) {
        self.budget.add(input.buffered_bytes());
        // The processing stage outlives this thread (it stops after the Shutdown input); if it panicked,
        // there is nobody to give the input to.
        let _ = self.out.send(input);
    }

    /// One pass: drain the rings, read the control channel, calibrate, poll GPUs, send it all in order.
    /// `force`: a flush or shutdown pass, which drains whatever the budget says and calibrates GPUs now.
    fn pass(&mut self, force: bool) -> Vec<Request> {
        // The pass's time is read before any ring: a slice still open in a ring was still open then, so ending
        // it there (a truncated slice, at shutdown or a killed capture's conversion) never stretches it. Read
        // after the rings, the calibration burst and the GPU polls, it was up to a pass's length later.
        let started = (self.source.read().0, monotonic_ns().0);
        let over_budget = !force && self.budget.used() >= self.config.chunk_budget_bytes;
        if over_budget {
            self.stats.budget_full_passes.fetch_add(1, Ordering::Relaxed);
        }
        let paused = !force && self.shared.drain_paused.load(Ordering::Relaxed);
        let mut closed_rings = Vec::new();
        let mut taken = 0;
        for index in 0..self.rings.len() {
            let number = self.rings[index].ring;
            // A ring that took over from one still here waits until that one is drained to its end (in this
            // pass or before): its records came after all of those.
            if (0..index).any(|k| self.rings[k].ring == number && !closed_rings.contains(&k)) {
                continue;
            }
            let ring = &mut self.rings[index];
            // Read before draining: a ring closed now is drained to its end below.
            let closed = ring.consumer.is_closed();
            if !(over_budget || paused) || closed {
                taken += drain_ring(ring, &self.pool, self.source, &mut self.chunks);
                // The loss markers among the records taken, which the program did not make: `records` leaves
                // them out even when no processing stage decodes the records (a raw capture alone).
                let markers = ring.consumer.markers();
                self.stats
                    .markers_drained
                    .fetch_add(markers.saturating_sub(ring.reported_markers), Ordering::Relaxed);
                ring.reported_markers = ring.reported_markers.max(markers);
            }
            if closed {
                closed_rings.push(index);
            }
        }
        self.stats.records.fetch_add(taken as u64, Ordering::Relaxed);
        let mut requests = Vec::new();
        while let Ok(message) = self.control.try_recv() {
            match message {
                Control::NewRing {
                    consumer,
                    ring,
                    tid,
                    name,
                    continues,
                } => {
                    if !continues {
                        self.registrations.push(Input::Thread { ring, tid, name });
                        self.stats.threads.fetch_add(1, Ordering::Relaxed);
                    }
                    self.rings.push(LiveRing {
                        ring,
                        consumer,
                        dropped_base: (0, 0),
                        reported_dropped: 0,
                        reported_markers: 0,
                    });
                }
                Control::TracingCallsite(meta) => {
                    self.registrations.push(Input::Callsite(CallsiteDef::tracing(meta)));
                }
                Control::NativeCallsite(callsite) => {
                    self.registrations.push(Input::Callsite(CallsiteDef::native(callsite)));
                }
                Control::Flush(reply) => requests.push(Request::Flush(reply)),
                Control::Shutdown(reply) => requests.push(Request::Shutdown(reply)),
            }
        }
        // GPU registrations after the control messages: one sent before a flush request is seen by its pass.
        while let Ok(message) = self.gpu_registrations.try_recv() {
            let input = self.gpu.register(message);
            self.registrations.extend(input.map(Input::Gpu));
        }
        // Closed rings are settled after the control channel was read: a thread whose ring grew sent the
        // larger ring before it closed the old one, so that message has been read by now.
        for &index in closed_rings.iter().rev() {
            let ring = self.rings.remove(index);
            let dropped = (
                ring.dropped_base.0 + ring.consumer.dropped_records(),
                ring.dropped_base.1 + ring.consumer.dropped_units(),
            );
            match self.rings.iter_mut().find(|r| r.ring == ring.ring) {
                // The thread goes on in a larger ring.
                Some(successor) => {
                    successor.dropped_base = dropped;
                    successor.reported_dropped = ring.reported_dropped;
                }
                None => {
                    self.dropped_of_ended.0 += dropped.0;
                    self.dropped_of_ended.1 += dropped.1;
                    self.tail.push(Input::ThreadEnd { ring: ring.ring });
                }
            }
            // Dropping the consumer frees the ring (the producer is gone).
        }
        let dropped = self.dropped_of_ended.0
            + self
                .rings
                .iter()
                .map(|r| r.dropped_base.0 + r.consumer.dropped_records())
                .sum::<u64>();
        let slices = self.dropped_of_ended.1
            + self
                .rings
                .iter()
                .map(|r| r.dropped_base.1 + r.consumer.dropped_units())
                .sum::<u64>();
        self.stats.dropped_records.store(dropped, Ordering::Relaxed);
        self.stats.dropped_slices.store(slices, Ordering::Relaxed);
        self.clock_revision();
        let now_ns = monotonic_ns().0;
        if force || now_ns >= self.next_cpu_burst_ns {
            self.next_cpu_burst_ns = now_ns.saturating_add(crate::clock::saturating_ns(self.config.cpu_burst_interval));
            let samples = cpu_burst(self.source, self.config.cpu_burst_samples);
            self.tail.push(Input::CpuCalibration(samples));
        }
        self.gpu.poll(now_ns, force, &mut self.tail);
        self.end_pass(!(over_budget || paused), started);
        requests
    }

    /// Sends the pass's inputs in order and its end (`rings_drained`: see [`Input::PassEnd`]), stamped with
    /// `(drain_ticks, drain_ns)`, read when the pass started.
    fn end_pass(&mut self, rings_drained: bool, (drain_ticks, drain_ns): (u64, u64)) {
        let registrations = std::mem::take(&mut self.registrations);
        let chunks = std::mem::take(&mut self.chunks);
        let tail = std::mem::take(&mut self.tail);
        for input in registrations.into_iter().chain(chunks).chain(tail) {
            self.send(input);
        }
        let buffered_bytes = self.budget.used();
        // Read by the recording threads: a full ring does not grow while the budget is full.
        self.shared
            .budget_full
            .store(buffered_bytes >= self.config.chunk_budget_bytes, Ordering::Relaxed);
        self.send(Input::PassEnd {
            drain_ns,
            drain_ticks,
            buffered_bytes,
            rings_drained,
        });
    }

    /// Shutdown: a last pass over every ring, GPU scopes in flight waited for (bounded), a last pass.
    /// The last passes; returns the requests they read.
    fn finish(&mut self) -> Vec<Request> {
        let mut requests = self.pass(true);
        let deadline = monotonic_ns()
            .0
            .saturating_add(crate::clock::saturating_ns(GPU_SHUTDOWN_WAIT));
        while self.gpu.busy() && monotonic_ns().0 < deadline {
            std::thread::sleep(Duration::from_millis(1));
            self.gpu.poll(monotonic_ns().0, false, &mut self.tail);
            let tail = std::mem::take(&mut self.tail);
            for input in tail {
                self.send(input);
            }
        }
        self.gpu.settle_calibration(deadline, &mut self.tail);
        self.gpu.retire_in_flight(&mut self.tail);
        requests.extend(self.pass(true));
        requests
    }
}

/// What [`raise_priority`] got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum DrainPriority {
    /// The scheduler's default: the drain stage competes with the program's threads.
    Normal = 0,
    /// `SCHED_FIFO` priority 1: the drain stage runs as soon as it is woken.
    RealTime = 1,
}

/// Gives the drain thread a real-time priority where the process may (`CAP_SYS_NICE`, root), so that a
/// program that keeps every core busy (the programs tickline is for) cannot starve the stage that empties
/// its rings. The stage cannot monopolise a core: each pass is bounded (copies of at most a ring each, a
/// calibration burst of a few microseconds, GPU reads), then it sleeps until the next poll; and Linux keeps
/// 5 % of each second for normal threads whatever real-time threads do (`sched_rt_runtime_us`).
fn raise_priority() -> DrainPriority {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 1 };
        // SAFETY: `pthread_self()` is this live thread and `param` a valid, initialised sched_param that the
        // call only reads; failure (no permission) leaves the thread's policy as it was.
        let rc = unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) };
        if rc == 0 {
            return DrainPriority::RealTime;
        }
    }
    DrainPriority::Normal
}

/// Runs `f` at the scheduler's default priority, then restores the drain thread's: for calls into GPU
/// backends that may wait for the GPU (a calibration probe submits work and waits for it), which a real-time
/// thread must not do (it would starve the driver's own threads on its core).
pub(crate) fn at_normal_priority<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_os = "linux")]
    {
        let mut policy = 0;
        let mut param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `pthread_self()` is this live thread; `policy` and `param` are valid, writable and
        // initialised; the call only writes them.
        let got = unsafe { libc::pthread_getschedparam(libc::pthread_self(), &mut policy, &mut param) } == 0;
        if got && policy == libc::SCHED_FIFO {
            let normal = libc::sched_param { sched_priority: 0 };
            // SAFETY: as above; lowering one's own priority needs no permission.
            unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_OTHER, &normal) };
            let result = f();
            // SAFETY: as above; restores the policy this thread had (it had the permission then).
            unsafe { libc::pthread_setschedparam(libc::pthread_self(), policy, &param) };
            return result;
        }
    }
    f()
}

/// Longest a shutdown waits for GPU scopes still in flight (the program should wait for its GPU work
/// before it shuts the timeline down).
const GPU_SHUTDOWN_WAIT: Duration = Duration::from_secs(1);

/// Moves everything in `ring` into a chunk; returns how many records. Whole groups only: producers publish a
/// group with one store of the ring's tail, and a drain takes everything up to the tail it reads.
fn drain_ring(ring: &mut LiveRing, pool: &ChunkPool, source: TickSource, out: &mut Vec<Input>) -> usize {
    let dropped_total = |ring: &LiveRing| ring.dropped_base.0 + ring.consumer.dropped_records();
    if ring.consumer.len() == 0 && dropped_total(ring) == ring.reported_dropped {
        return 0;
    }
    let mut records = pool.pop().unwrap_or_default();
    records.clear();
    // One allocation for what is there now (nothing, for a spare chunk that size): grown by doubling, a fresh
    // chunk was reallocated a dozen times, each a copy, and each past glibc's mmap threshold an `mremap` whose
    // TLB shootdown interrupted the recording threads' CPUs too.
    records.reserve(ring.consumer.len());
    ring.consumer.drain(usize::MAX, |run| records.extend_from_slice(run));
    // Read after the records: it counts every drop a `Gap` among them reports (a drop is counted before the
    // record after it is pushed), and drops after the last of them.
    let dropped_total = dropped_total(ring);
    if records.is_empty() && dropped_total == ring.reported_dropped {
        let _ = pool.push(records);
        return 0;
    }
    ring.reported_dropped = dropped_total;
    let taken = records.len();
    // Read after the copy: every record drained is older (up to cross-CPU skew, which
    // `restore_ticks` allows for).
    let now_ticks = source.read().0;
    out.push(Input::Chunk(Chunk {
        ring: ring.ring,
        now_ticks,
        dropped_total,
        dropped_slices_total: ring.dropped_base.1 + ring.consumer.dropped_units(),
        records,
    }));
    taken
}

/// The decision in words for the trace: its summary, its figures, its warnings.
fn clock_note(decision: &crate::clock::TickSourceDecision) -> String {
    let mut text = decision.summary();
    if let Some(figures) = decision.figures_line() {
        text.push_str("; ");
        text.push_str(&figures);
    }
    for warning in &decision.warnings {
        text.push_str("; warning: ");
        text.push_str(warning);
    }
    text
}

/// A burst of bracketed CPU clock samples against CLOCK_MONOTONIC.
pub(crate) fn cpu_burst(source: TickSource, samples: usize) -> Vec<CalibrationSample> {
    (0..samples.max(1))
        .map(|_| bracketed_sample(source, monotonic_ns))
        .collect()
}

/// The drain stage's speed alone, for `benches/`: moves `records` out of a full ring into a chunk.
#[doc(hidden)]
pub fn drain_bench(capacity: usize, rounds: usize) -> (u64, std::time::Duration) {
    let (mut producer, consumer) = crate::ring::channel::<Record>(capacity);
    let mut ring = LiveRing {
        ring: 1,
        consumer,
        dropped_base: (0, 0),
        reported_dropped: 0,
        reported_markers: 0,
    };
    let pool = ChunkPool::new(4);
    let mut out = Vec::new();
    let record = Record::timed(crate::codec::Kind::Instant, 1, 2);
    let mut moved = 0u64;
    let mut elapsed = Duration::ZERO;
    for _ in 0..rounds {
        while producer.try_push_all_keeping(&[record], 0) {}
        let start = std::time::Instant::now();
        drain_ring(&mut ring, &pool, TickSource::Monotonic, &mut out);
        elapsed += start.elapsed();
        for input in out.drain(..) {
            if let Input::Chunk(chunk) = input {
                moved += chunk.records.len() as u64;
                let _ = pool.push(chunk.records);
            }
        }
    }
    (moved, elapsed)
}

#[cfg(test)]
mod tests {
    use crossbeam_channel::unbounded;

    use super::*;
    use crate::codec::{self, Kind};
    use crate::ring::channel;

    /// A 64-record ring 1 the drain takes from its next pass on; its producer.
    fn live_ring(drain: &mut Drain) -> crate::ring::Producer<Record> {
        let (producer, consumer) = channel::<Record>(64);
        drain.rings.push(LiveRing {
            ring: 1,
            consumer,
            dropped_base: (0, 0),
            reported_dropped: 0,
            reported_markers: 0,
        });
        producer
    }

    fn drain_with(shared: &Arc<Shared>, control: Receiver<Control>, budget_bytes: u64) -> (Drain, Receiver<Input>) {
        let (tx, rx) = unbounded();
        let config = DrainConfig {
            poll_interval: Duration::from_millis(1),
            chunk_budget_bytes: budget_bytes,
            cpu_burst_samples: 4,
            cpu_burst_interval: Duration::from_secs(1),
            gpu: GpuCalibrationConfig::default(),
        };
        let drain = Drain::new(
            config,
            shared.clone(),
            (
                crate::collector::Inbox {
                    control,
                    gpu: unbounded().1,
                },
                tx,
            ),
            (
                Arc::new(Budget::default()),
                Arc::new(ChunkPool::new(4)),
                Arc::new(SharedStats::default()),
            ),
            crate::clock::TickSourceDecision::forced(TickSource::Monotonic),
        );
        (drain, rx)
    }

    fn shared() -> (Arc<Shared>, Receiver<Control>) {
        let (control, rx) = unbounded();
        (Arc::new(Shared::new(control, false, 64, TickSource::Monotonic)), rx)
    }

    #[test]
    fn a_pass_sends_registrations_then_chunks_then_the_pass_end() {
        let (shared, control) = shared();
        let (drain, inputs) = drain_with(&shared, control, u64::MAX);
        let mut drain = drain;
        let (mut producer, consumer) = channel::<Record>(64);
        shared
            .control
            .send(Control::NewRing {
                consumer,
                ring: 1,
                tid: 7,
                name: "t".into(),
                continues: false,
            })
            .unwrap();
        drain.pass(false);
        // A group pushed whole: the drain takes it whole.
        let mut group = Vec::new();
        codec::encode_event(
            &mut group,
            5,
            0x10,
            codec::Parent::Contextual,
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        );
        assert!(producer.try_push_all_keeping(&group, 0));
        assert!(producer.try_push_keeping(Record::timed(Kind::Instant, 6, 0x20), 0));
        drain.pass(false);
        let kinds: Vec<String> = inputs
            .try_iter()
            .map(|i| format!("{i:?}").split(['(', ' ', '{']).next().unwrap().to_owned())
            .collect();
        assert_eq!(
            kinds,
            [
                "Thread",
                "CpuClockNote",
                "CpuCalibration",
                "PassEnd",
                "Chunk",
                "PassEnd"
            ],
            "registrations first; a ring is drained from the pass after it registered"
        );
        assert_eq!(drain.stats.records.load(Ordering::Relaxed), group.len() as u64 + 1);
    }

    /// A pass is stamped with its start: before any ring is read, so a slice still open in a chunk was open
    /// then, and ending it there (truncated) never stretches it.
    #[test]
    fn a_pass_is_stamped_before_it_reads_any_ring() {
        let (shared, control) = shared();
        let (mut drain, inputs) = drain_with(&shared, control, 1);
        let mut producer = live_ring(&mut drain);
        assert!(producer.try_push_keeping(Record::timed(Kind::Instant, 1, 0x20), 0));
        drain.pass(true);
        let mut chunk_ticks = None;
        let mut checked = false;
        for input in inputs.try_iter() {
            match input {
                Input::Chunk(chunk) => chunk_ticks = Some(chunk.now_ticks),
                Input::PassEnd { drain_ticks, .. } => {
                    let read = chunk_ticks.expect("the ring was drained in this pass");
                    assert!(
                        drain_ticks <= read,
                        "pass stamped at {drain_ticks}, ring read at {read}"
                    );
                    checked = true;
                }
                _ => {}
            }
        }
        assert!(checked);
    }

    #[test]
    fn a_full_budget_or_a_pause_leaves_the_rings_alone_but_a_closed_ring_is_emptied() {
        let (shared, control) = shared();
        let (mut drain, inputs) = drain_with(&shared, control, 1);
        let mut producer = live_ring(&mut drain);
        drain.budget.add(1);
        assert!(producer.try_push_keeping(Record::timed(Kind::Instant, 1, 0x20), 0));
        drain.pass(false);
        assert!(
            !inputs.try_iter().any(|i| matches!(i, Input::Chunk(_))),
            "over budget: nothing drained"
        );
        assert_eq!(drain.stats.budget_full_passes.load(Ordering::Relaxed), 1);
        drain.budget.release(1);
        shared.drain_paused.store(true, Ordering::Relaxed);
        drain.pass(false);
        assert!(
            !inputs.try_iter().any(|i| matches!(i, Input::Chunk(_))),
            "paused: nothing drained"
        );
        drain.pass(true);
        assert!(
            inputs.try_iter().any(|i| matches!(i, Input::Chunk(_))),
            "a flush drains anyway"
        );
        assert!(producer.try_push_keeping(Record::timed(Kind::Instant, 2, 0x20), 0));
        drop(producer);
        drain.pass(false);
        let tail: Vec<Input> = inputs.try_iter().collect();
        let chunk = tail
            .iter()
            .position(|i| matches!(i, Input::Chunk(_)))
            .expect("the closed ring is emptied");
        let end = tail
            .iter()
            .position(|i| matches!(i, Input::ThreadEnd { ring: 1 }))
            .expect("and ended");
        assert!(chunk < end);
        assert!(drain.rings.is_empty());
    }

    #[test]
    fn drops_after_a_rings_last_record_come_in_an_empty_chunk() {
        let (shared, control) = shared();
        let (mut drain, inputs) = drain_with(&shared, control, u64::MAX);
        let mut producer = live_ring(&mut drain);
        assert!(producer.try_push_keeping(Record::timed(Kind::Instant, 1, 0x20), 0));
        producer.count_drops(4);
        let totals = |inputs: &Receiver<Input>| -> Vec<(usize, u64)> {
            inputs
                .try_iter()
                .filter_map(|i| match i {
                    Input::Chunk(c) => Some((c.records.len(), c.dropped_total)),
                    _ => None,
                })
                .collect()
        };
        drain.pass(false);
        assert_eq!(totals(&inputs), [(1, 4)]);
        // Nothing new: no chunk.
        drain.pass(false);
        assert_eq!(totals(&inputs), []);
        // Drops and no record after them (a thread that goes idle, or ends).
        producer.count_drops(3);
        drain.pass(false);
        assert_eq!(totals(&inputs), [(0, 7)]);
        producer.count_drops(1);
        drop(producer);
        drain.pass(false);
        assert_eq!(totals(&inputs), [(0, 8)]);
    }

    #[test]
    fn the_drain_stage_alone_moves_records_at_memory_speed() {
        let (moved, elapsed) = drain_bench(1 << 12, if cfg!(miri) { 2 } else { 64 });
        assert_eq!(moved, (1 << 12) * if cfg!(miri) { 2 } else { 64 });
        assert!(elapsed < Duration::from_secs(5));
    }
}
