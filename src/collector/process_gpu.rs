//! The processing stage's GPU side: per device, the scopes whose begin record was seen, the timestamps the
//! drain stage read back for them, the clock tracker fed with the calibration bursts, the queues' lanes and
//! the device's counter tracks. A function of the input log (see `input.rs`): the same code runs
//! live and when a raw capture is converted later.

use std::collections::HashMap;
use std::sync::Arc;

use super::input::{GpuInput, PairRead};
use super::output::Output;
use crate::export::{EventKind, FieldValue, NameId, TraceField, TrackId, TrackKind};
use crate::gpu::lanes::{LaneEvent, Lanes, Slice};
use crate::gpu::tracker::{GpuCalibrationConfig, GpuClockTracker, GpuScopeTicks};
use crate::gpu::{split_key, DeviceLink, GpuCalibrationReport, GpuDeviceInfo, GpuTicks};

/// A scope whose begin record the processing stage has seen.
struct Scope {
    queue: u16,
    name: NameId,
    fields: Vec<TraceField>,
    /// When the CPU recorded it (reference ns): GPU work cannot start before.
    cpu_ns: u64,
    flow: u64,
}

/// A scope whose ticks were read back, waiting to be converted.
struct Finished {
    scope: Scope,
    begin: GpuTicks,
    end: GpuTicks,
    /// When the drain stage read the ticks (reference ns): GPU work cannot end after.
    read_ns: u64,
    /// What the history said of its conversion, and after how many bursts (it changes only with one).
    readiness: Option<(u64, crate::gpu::tracker::Readiness)>,
}

/// What a laid-out slice carries to its begin event.
struct SlicePayload {
    name: NameId,
    fields: Vec<TraceField>,
    flow: u64,
}

struct QueueState {
    name: String,
    /// Lane tracks: `[0]` is the queue's own track, the rest siblings made for overlapping slices.
    tracks: Vec<TrackId>,
    lanes: Lanes<SlicePayload>,
    /// Per lane, the names of its open slices (innermost last), for the ends.
    open_names: Vec<Vec<NameId>>,
}

struct DeviceState {
    info: GpuDeviceInfo,
    /// The live device, to ask for calibration bursts and publish the fit (absent when converting a capture).
    link: Option<Arc<dyn DeviceLink>>,
    track: TrackId,
    queues: Vec<QueueState>,
    tracker: GpuClockTracker,
    /// Scopes seen, by `(pair, generation)`, waiting for their ticks.
    in_flight: HashMap<(u32, u32), Scope>,
    finished: Vec<Finished>,
    /// Reads that matched no scope yet (its begin record may still be on its way), by `(pair, generation)`,
    /// with their read time and the pass they came in. A map: a burst of many thousand scopes whose reads come
    /// before their begin records made each begin search a list of all of them (quadratic: 24,000 scopes a
    /// second at most, and a large burst still unmatched at shutdown was counted lost).
    unmatched_reads: HashMap<(u32, u32), (PairRead, u64, u64)>,
    /// Pairs retired before their scope's begin record came (a pair allocated and timed out while the begin
    /// was on its way), by `(pair, generation)`, with the pass they came in: the begin is lost on arrival
    /// instead of waiting in flight until shutdown.
    unmatched_lost: HashMap<(u32, u32), u64>,
    drift_track: TrackId,
    error_track: TrackId,
    offset_track: TrackId,
    violations_track: TrackId,
    reported_fit_ns: u64,
    reported_violations: u64,
    violations: u64,
}

/// GPU counters for [`crate::TimelineStats`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GpuStats {
    pub(crate) scopes: u64,
    pub(crate) lost_scopes: u64,
    pub(crate) causality_violations: u64,
    pub(crate) failed_calibrations: u64,
    pub(crate) read_failures: u64,
}

/// Passes that drained every ring a read waits for its scope's begin record before it is dropped (the record
/// was lost to a full ring, which counted it). The begin was recorded before the GPU wrote the ticks, so the
/// second such pass after the read has brought it if it was kept; passes that left the rings alone (a full
/// chunk budget, a paused drain) do not count.
const UNMATCHED_READ_PASSES: u64 = 3;

/// Every GPU device of one timeline.
#[derive(Default)]
pub(crate) struct GpuCollector {
    config: GpuCalibrationConfig,
    devices: HashMap<u16, DeviceState>,
    next_flow: u64,
    /// Passes that drained every ring (see [`UNMATCHED_READ_PASSES`]).
    drained_passes: u64,
    pub(crate) stats: GpuStats,
    uncertainty_name: Option<NameId>,
    /// `tickline.calibration_break` and `tickline.queue_calibration`.
    mark_names: Option<(NameId, NameId)>,
    /// `tickline.gpu_scope_lost`.
    lost_name: Option<NameId>,
}

impl GpuCollector {
    pub(crate) fn new(config: GpuCalibrationConfig) -> Self {
        GpuCollector {
            config,
            next_flow: 1,
            ..Default::default()
        }
    }

    /// Counts `scope` lost, and shows it on its queue's track where its CPU recorded it (ending its flow):
    /// `why` is the [`GPU_SCOPE_LOST`](crate::gpu::GPU_SCOPE_LOST) annotation.
    fn lose(stats: &mut GpuStats, lost_name: NameId, d: &mut DeviceState, scope: Scope, why: &'static str) {
        stats.lost_scopes += 1;
        let Some(q) = d.queues.get_mut(scope.queue as usize) else {
            return;
        };
        let mut fields = scope.fields;
        fields.push(TraceField {
            name: lost_name,
            value: FieldValue::Str(why.into()),
        });
        q.lanes.push_instant(
            scope.cpu_ns,
            SlicePayload {
                name: scope.name,
                fields,
                flow: scope.flow,
            },
        );
    }

    fn lost_name(&mut self, out: &mut Output) -> NameId {
        *self
            .lost_name
            .get_or_insert_with(|| out.intern(crate::gpu::GPU_SCOPE_LOST))
    }

    /// A new flow id (unique per timeline).
    pub(crate) fn next_flow(&mut self) -> u64 {
        let flow = self.next_flow;
        self.next_flow += 1;
        flow
    }

    /// An input from the drain stage.
    pub(crate) fn input(&mut self, out: &mut Output, input: GpuInput) {
        match input {
            GpuInput::Device { device, info, link } => self.add_device(out, device, info, link.0),
            GpuInput::Queue { device, queue, name } => self.add_queue(out, device, queue, name),
            GpuInput::Calibration {
                device,
                at_ns,
                samples,
                failed,
            } => {
                let Some(d) = self.devices.get_mut(&device) else { return };
                // Added even when the read failed (with what it got, maybe nothing): the history counts it.
                let added = d.tracker.add_burst(at_ns, &samples);
                if failed || added.is_err() {
                    self.stats.failed_calibrations += 1;
                }
            }
            GpuInput::Reads { device, read_ns, reads } => {
                let Some(d) = self.devices.get_mut(&device) else { return };
                for read in reads {
                    match d.in_flight.remove(&(read.pair, read.generation)) {
                        Some(scope) => d.finished.push(Finished {
                            scope,
                            begin: read.begin,
                            end: read.end,
                            read_ns,
                            readiness: None,
                        }),
                        None => {
                            d.unmatched_reads
                                .insert((read.pair, read.generation), (read, read_ns, self.drained_passes));
                        }
                    }
                }
            }
            GpuInput::Lost {
                device,
                pair,
                generation,
            } => {
                let lost_name = self.lost_name(out);
                if let Some(d) = self.devices.get_mut(&device) {
                    match d.in_flight.remove(&(pair, generation)) {
                        Some(scope) => Self::lose(&mut self.stats, lost_name, d, scope, "never read back"),
                        None => {
                            d.unmatched_lost.insert((pair, generation), self.drained_passes);
                        }
                    }
                }
            }
            GpuInput::ReadFailed { device } => {
                self.stats.read_failures += 1;
                // Counted by the tracker too (its stats travel with the calibration report); the slots are
                // read again next pass.
                if let Some(d) = self.devices.get_mut(&device) {
                    d.tracker.count_read_error();
                }
            }
            GpuInput::Reset { device } => {
                if let Some(d) = self.devices.get_mut(&device) {
                    d.tracker.report_reset();
                }
            }
        }
    }

    fn add_device(&mut self, out: &mut Output, device: u16, info: GpuDeviceInfo, link: Option<Arc<dyn DeviceLink>>) {
        let track = out.new_track(
            Some(out.process_track()),
            TrackKind::GpuDevice {
                name: info.name.clone(),
                api: info.api.to_owned(),
            },
        );
        let counter = |out: &mut Output, what: &str, unit: &str| {
            out.new_track(
                Some(track),
                TrackKind::Counter {
                    name: format!("{} {what}", info.name),
                    unit: unit.into(),
                },
            )
        };
        let drift_track = counter(out, "clock drift", "ppm");
        let error_track = counter(out, "clock error bound", "ns");
        let offset_track = counter(out, "clock offset", "ns");
        let violations_track = counter(out, "causality violations", "slices");
        let tracker = GpuClockTracker::new(info.clock, self.config);
        self.devices.insert(
            device,
            DeviceState {
                info,
                link,
                track,
                queues: Vec::new(),
                tracker,
                in_flight: HashMap::new(),
                finished: Vec::new(),
                unmatched_reads: HashMap::new(),
                unmatched_lost: HashMap::new(),
                drift_track,
                error_track,
                offset_track,
                violations_track,
                reported_fit_ns: 0,
                reported_violations: 0,
                violations: 0,
            },
        );
    }

    fn add_queue(&mut self, out: &mut Output, device: u16, queue: u16, name: String) {
        let Some(d) = self.devices.get_mut(&device) else {
            return;
        };
        while d.queues.len() <= queue as usize {
            let index = d.queues.len();
            let name = if index == queue as usize {
                name.clone()
            } else {
                format!("queue {index}")
            };
            let track = out.new_track(
                Some(d.track),
                TrackKind::GpuQueue {
                    name: name.clone(),
                    lane: 0,
                },
            );
            d.queues.push(QueueState {
                name,
                tracks: vec![track],
                lanes: Lanes::default(),
                open_names: Vec::new(),
            });
        }
    }

    /// A scope's begin record, recorded by the CPU at `cpu_ns`. Returns the flow from the CPU to the scope (its
    /// GPU slice, or the instant standing for it if lost), or `None` when it has no queue to go to (counted lost).
    pub(crate) fn begin(
        &mut self,
        out: &mut Output,
        key: u64,
        name: NameId,
        fields: Vec<TraceField>,
        cpu_ns: u64,
    ) -> Option<u64> {
        let lost_name = self.lost_name(out);
        let (device, queue, pair, generation) = split_key(key);
        self.stats.scopes += 1;
        let Some(d) = self
            .devices
            .get_mut(&device)
            .filter(|d| (queue as usize) < d.queues.len())
        else {
            // No queue to show it on: no flow to start.
            self.stats.lost_scopes += 1;
            return None;
        };
        let flow = self.next_flow;
        self.next_flow += 1;
        let scope = Scope {
            queue,
            name,
            fields,
            cpu_ns,
            flow,
        };
        if d.unmatched_lost.remove(&(pair, generation)).is_some() {
            // Its pair timed out before this record came.
            Self::lose(&mut self.stats, lost_name, d, scope, "never read back");
            return Some(flow);
        }
        // Its ticks may have been read already (the drain stage polls GPUs after it drains the rings).
        match d.unmatched_reads.remove(&(pair, generation)) {
            Some((read, read_ns, _)) => {
                d.finished.push(Finished {
                    scope,
                    begin: read.begin,
                    end: read.end,
                    read_ns,
                    readiness: None,
                });
            }
            None => {
                d.in_flight.insert((pair, generation), scope);
            }
        }
        Some(flow)
    }

    /// End of a drain pass at `drain_ns` (reference ns): every scope recorded before it has been seen. Converts
    /// what is ready, lays slices out and exports them, exports calibration counters. `force` (flush,
    /// shutdown) converts and exports every finished slice now. `rings_drained`: the pass drained every ring.
    pub(crate) fn pass_end(&mut self, out: &mut Output, drain_ns: u64, force: bool, rings_drained: bool) {
        self.drained_passes += u64::from(rings_drained);
        let pass = self.drained_passes;
        let uncertainty_name = *self
            .uncertainty_name
            .get_or_insert_with(|| out.intern("uncertainty_ns"));
        let lost_name = self.lost_name(out);
        let (break_name, queue_calibration_name) = *self.mark_names.get_or_insert_with(|| {
            (
                out.intern(crate::gpu::CALIBRATION_BREAK),
                out.intern(crate::gpu::QUEUE_CALIBRATION),
            )
        });
        for d in self.devices.values_mut() {
            d.unmatched_reads
                .retain(|_, &mut (_, _, seen)| pass.saturating_sub(seen) < UNMATCHED_READ_PASSES);
            d.unmatched_lost
                .retain(|_, &mut seen| pass.saturating_sub(seen) < UNMATCHED_READ_PASSES);
            if let Some(fit) = d.tracker.history().latest() {
                if fit.calibrated_at_ns() != d.reported_fit_ns {
                    d.reported_fit_ns = fit.calibrated_at_ns();
                    let value = out.value_name();
                    out.push_counter(d.drift_track, drain_ns, value, fit.drift_ppm());
                    out.push_counter(d.error_track, drain_ns, value, fit.error_bound_ns());
                    // The device clock's offset from the reference now: device time (nominal ns) minus host ns.
                    let device_ns = fit.from_reference_ns(drain_ns) as f64 * d.info.clock.nominal_ns_per_tick();
                    out.push_counter(d.offset_track, drain_ns, value, device_ns - drain_ns as f64);
                    if let Some(link) = &d.link {
                        link.publish(GpuCalibrationReport {
                            latest: *fit,
                            stats: d.tracker.history().stats(),
                            placements: d.tracker.stats(),
                        });
                    }
                }
            }
            if let Some(link) = &d.link {
                if d.tracker.burst_due(drain_ns) {
                    link.request_burst();
                }
            }

            // Convert what is ready, in begin-tick order so the history's monotonic guard holds.
            let mut ready = Vec::new();
            let mut i = 0;
            let calibrated = d.tracker.history().latest().is_some();
            let bursts = d.tracker.history().stats().bursts;
            while i < d.finished.len() {
                let f = &mut d.finished[i];
                let convert = calibrated
                    && (force || {
                        let readiness = match f.readiness {
                            Some((at, r)) if at == bursts => r,
                            _ => {
                                let r = d.tracker.readiness(f.end.0, f.read_ns);
                                f.readiness = Some((bursts, r));
                                r
                            }
                        };
                        d.tracker.ready_by(readiness, f.read_ns, drain_ns)
                    });
                if convert {
                    ready.push(d.finished.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            // Wrap-aware order: ticks relative to one of them (all lie within half a wrap of each other).
            let reference = ready.first().map_or(0, |f| f.begin.0);
            ready.sort_by_key(|f| d.info.clock.delta_ticks(reference, f.begin.0));
            for f in ready {
                let scope = f.scope;
                // Both timestamps placed at once, across clock breaks by what the CPU knows, checked on both
                // sides per queue: begun after it was recorded, ended before it was read back.
                let Some(placed) = d.tracker.place(GpuScopeTicks {
                    queue: scope.queue,
                    begin: f.begin.0,
                    end: f.end.0,
                    recorded_ns: scope.cpu_ns,
                    read_ns: f.read_ns,
                }) else {
                    Self::lose(&mut self.stats, lost_name, d, scope, "not placeable");
                    continue;
                };
                if placed.marks.outside_window {
                    // The calibration disagreed with what the CPU knows: counted, placed inside that window
                    // (with the window as its uncertainty), and a burst asked for.
                    d.violations += 1;
                    self.stats.causality_violations += 1;
                    if let Some(link) = &d.link {
                        link.request_burst();
                    }
                }
                let (begin_ns, end_ns) = (placed.begin.ns, placed.end.ns.max(placed.begin.ns));
                let mut fields = scope.fields;
                fields.push(TraceField {
                    name: uncertainty_name,
                    value: FieldValue::U64(placed.begin.uncertainty_ns.max(placed.end.uncertainty_ns)),
                });
                if let Some(why) = placed.marks.annotation() {
                    fields.push(TraceField {
                        name: break_name,
                        value: FieldValue::Str(why.into()),
                    });
                }
                if placed.marks.queue_calibration {
                    fields.push(TraceField {
                        name: queue_calibration_name,
                        value: FieldValue::Bool(true),
                    });
                }
                match d.queues.get_mut(scope.queue as usize) {
                    Some(q) => q.lanes.push(Slice {
                        begin_ns,
                        end_ns,
                        payload: SlicePayload {
                            name: scope.name,
                            fields,
                            flow: scope.flow,
                        },
                        instant: false,
                    }),
                    None => self.stats.lost_scopes += 1,
                }
            }

            Self::emit_lanes(d, out, drain_ns, force);
            if d.violations != d.reported_violations {
                d.reported_violations = d.violations;
                let value = out.value_name();
                out.push_counter(d.violations_track, drain_ns, value, d.violations as f64);
            }
        }
    }

    /// Lays out and exports `d`'s slices, per queue, up to what no scope still to come can precede (`force`:
    /// all of them).
    fn emit_lanes(d: &mut DeviceState, out: &mut Output, drain_ns: u64, force: bool) {
        for (index, q) in d.queues.iter_mut().enumerate() {
            let watermark = d
                .in_flight
                .values()
                .map(|s| (s.queue, s.cpu_ns))
                .chain(d.finished.iter().map(|f| (f.scope.queue, f.scope.cpu_ns)))
                .filter(|&(queue, _)| queue as usize == index)
                .map(|(_, cpu_ns)| cpu_ns)
                .min()
                .unwrap_or(u64::MAX)
                .min(drain_ns);
            let device_track = d.track;
            let QueueState {
                name: queue_name,
                tracks,
                lanes,
                open_names,
            } = q;
            let mut lane_track = |out: &mut Output, lane: usize| {
                while tracks.len() <= lane {
                    let kind = TrackKind::GpuQueue {
                        name: queue_name.clone(),
                        lane: tracks.len() as u32,
                    };
                    tracks.push(out.new_track(Some(device_track), kind));
                }
                tracks[lane]
            };
            lanes.emit(watermark, force, &mut |event| match event {
                LaneEvent::Begin { lane, ts_ns, payload } => {
                    let track = lane_track(out, lane);
                    if open_names.len() <= lane {
                        open_names.resize_with(lane + 1, Vec::new);
                    }
                    open_names[lane].push(payload.name);
                    out.push_gpu_event(
                        ts_ns,
                        track,
                        EventKind::SliceBegin,
                        payload.name,
                        &payload.fields,
                        Some(payload.flow),
                    );
                }
                LaneEvent::End { lane, ts_ns } => {
                    let name = open_names.get_mut(lane).and_then(Vec::pop).unwrap_or(NameId(0));
                    let track = lane_track(out, lane);
                    out.push_gpu_event(ts_ns, track, EventKind::SliceEnd, name, &[], None);
                }
                LaneEvent::Instant { lane, ts_ns, payload } => {
                    let track = lane_track(out, lane);
                    out.push_gpu_event(
                        ts_ns,
                        track,
                        EventKind::Instant,
                        payload.name,
                        &payload.fields,
                        Some(payload.flow),
                    );
                }
            });
        }
    }

    /// Shutdown: scopes still waiting for their ticks, or read but never convertible (no calibration of
    /// their device), are lost.
    /// Each is shown where its CPU recorded it ([`GPU_SCOPE_LOST`](crate::gpu::GPU_SCOPE_LOST)).
    pub(crate) fn abandon(&mut self, out: &mut Output, end_ns: u64) {
        let lost_name = self.lost_name(out);
        for d in self.devices.values_mut() {
            let mut lost: Vec<_> = d
                .in_flight
                .drain()
                .map(|(_, scope)| (scope, "timeline ended"))
                .collect();
            let uncalibrated = d.tracker.history().latest().is_none();
            let why = if uncalibrated {
                "device never calibrated"
            } else {
                "timeline ended"
            };
            lost.extend(d.finished.drain(..).map(|f| (f.scope, why)));
            if lost.is_empty() {
                continue;
            }
            lost.sort_by_key(|(scope, _)| scope.cpu_ns);
            for (scope, why) in lost {
                Self::lose(&mut self.stats, lost_name, d, scope, why);
            }
            Self::emit_lanes(d, out, end_ns, true);
        }
    }
}
