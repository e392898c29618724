//! The collector's GPU side: per device, the scopes in flight, the clock tracker, the queues' lanes and the
//! device's counter tracks. Runs on the collector thread only.

use std::collections::HashMap;
use std::sync::Arc;

use super::lanes::{LaneEvent, Lanes, Slice};
use super::tracker::{GpuCalibrationConfig, GpuClockTracker, GpuScopeTicks};
use super::{split_key, DeviceLink, GpuCalibrationReport, GpuDeviceInfo, GpuTicks};
use crate::calibration::CalibrationSample;
use crate::collector::Processor;
use crate::export::{EventKind, Field, FieldValue, NameId, TrackId, TrackKind};

/// A scope whose begin record the collector has seen.
struct InFlight {
    queue: u16,
    pair: u32,
    name: NameId,
    fields: Vec<Field>,
    /// When the CPU recorded it (reference ns): GPU work cannot start before.
    cpu_ns: u64,
    flow: u64,
    seen_ns: u64,
    begin: Option<GpuTicks>,
    end: Option<GpuTicks>,
    /// When both timestamps were read (reference ns).
    finished_ns: Option<u64>,
}

/// What a laid-out slice carries to its begin event.
struct SlicePayload {
    name: NameId,
    fields: Vec<Field>,
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
    link: Arc<dyn DeviceLink>,
    info: GpuDeviceInfo,
    track: TrackId,
    queues: Vec<QueueState>,
    tracker: GpuClockTracker,
    in_flight: Vec<InFlight>,
    /// Pairs whose begin record was lost: recycled once the GPU wrote both timestamps.
    orphans: Vec<(u32, u64)>,
    drift_track: TrackId,
    error_track: TrackId,
    offset_track: TrackId,
    violations_track: TrackId,
    reported_fit_ns: u64,
    reported_violations: u64,
    violations: u64,
    /// The backend's reset count last seen (issue 13 hook: `GpuBackend::resets`).
    resets_seen: u64,
}

/// GPU counters for [`crate::TimelineStats`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GpuStats {
    pub(crate) scopes: u64,
    pub(crate) lost_scopes: u64,
    pub(crate) causality_violations: u64,
    pub(crate) failed_calibrations: u64,
}

/// Most pairs read back in one backend call.
const MAX_READ_RUN: usize = 256;

/// Every GPU device of one timeline.
#[derive(Default)]
pub(crate) struct GpuCollector {
    config: GpuCalibrationConfig,
    devices: HashMap<u16, DeviceState>,
    next_flow: u64,
    samples: Vec<CalibrationSample>,
    reads: Vec<Option<GpuTicks>>,
    pub(crate) stats: GpuStats,
    uncertainty_name: Option<NameId>,
    /// `tickline.calibration_break` and `tickline.queue_calibration` (issue 13 hook).
    mark_names: Option<(NameId, NameId)>,
}

impl GpuCollector {
    pub(crate) fn new(config: GpuCalibrationConfig) -> Self {
        GpuCollector {
            config,
            next_flow: 1,
            ..Default::default()
        }
    }

    /// Whether any device has scopes in flight or slices not exported yet.
    pub(crate) fn busy(&self) -> bool {
        self.devices
            .values()
            .any(|d| !d.in_flight.is_empty() || d.queues.iter().any(|q| q.lanes.waiting() > 0))
    }

    pub(crate) fn add_device(
        &mut self,
        p: &mut Processor,
        device: u16,
        info: GpuDeviceInfo,
        link: Arc<dyn DeviceLink>,
    ) {
        let track = p.new_track(
            Some(p.process_track()),
            TrackKind::Group {
                name: format!("GPU: {} ({})", info.name, info.api),
            },
        );
        let counter = |p: &mut Processor, what: &str, unit: &str| {
            p.new_track(
                Some(track),
                TrackKind::Counter {
                    name: format!("{} {what}", info.name),
                    unit: unit.into(),
                },
            )
        };
        let drift_track = counter(p, "clock drift", "ppm");
        let error_track = counter(p, "clock error bound", "ns");
        let offset_track = counter(p, "clock offset", "ns");
        let violations_track = counter(p, "causality violations", "slices");
        let tracker = GpuClockTracker::new(info.clock, self.config);
        self.devices.insert(
            device,
            DeviceState {
                link,
                info,
                track,
                queues: Vec::new(),
                tracker,
                in_flight: Vec::new(),
                orphans: Vec::new(),
                drift_track,
                error_track,
                offset_track,
                violations_track,
                reported_fit_ns: 0,
                reported_violations: 0,
                violations: 0,
                resets_seen: 0,
            },
        );
    }

    pub(crate) fn add_queue(&mut self, p: &mut Processor, device: u16, queue: u16, name: String) {
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
            let track = p.new_track(Some(d.track), TrackKind::Group { name: name.clone() });
            d.queues.push(QueueState {
                name,
                tracks: vec![track],
                lanes: Lanes::default(),
                open_names: Vec::new(),
            });
        }
    }

    /// Drops every scope still in flight (shutdown); returns how many. Their pairs are retired.
    pub(crate) fn abandon_in_flight(&mut self) -> u64 {
        let mut lost = 0;
        for d in self.devices.values_mut() {
            lost += d.in_flight.len() as u64;
            d.in_flight.clear();
        }
        self.stats.lost_scopes += lost;
        lost
    }

    /// A new flow id (unique per timeline).
    pub(crate) fn next_flow(&mut self) -> u64 {
        let flow = self.next_flow;
        self.next_flow += 1;
        flow
    }

    /// A scope's begin record, recorded by the CPU at `cpu_ns` with flow `flow`. Returns false when its device
    /// is unknown (the scope is counted as lost).
    pub(crate) fn begin(&mut self, key: u64, name: NameId, fields: Vec<Field>, cpu_ns: u64, flow: u64, now_ns: u64) {
        let (device, queue, pair) = split_key(key);
        self.stats.scopes += 1;
        let Some(d) = self.devices.get_mut(&device) else {
            self.stats.lost_scopes += 1;
            return;
        };
        d.in_flight.push(InFlight {
            queue,
            pair,
            name,
            fields,
            cpu_ns,
            flow,
            seen_ns: now_ns,
            begin: None,
            end: None,
            finished_ns: None,
        });
    }

    /// One collector pass: calibrate when due, read finished timestamps, convert what is ready, lay slices
    /// out and export them, export calibration counters. `drain_ns` is when this pass drained the rings: every
    /// scope recorded before it has been seen. `force` (flush, shutdown) takes a fresh burst and converts and
    /// exports every finished slice now.
    pub(crate) fn poll(&mut self, p: &mut Processor, now_ns: u64, drain_ns: u64, force: bool) {
        let uncertainty_name = *self.uncertainty_name.get_or_insert_with(|| p.intern("uncertainty_ns"));
        let (break_name, queue_calibration_name) = *self
            .mark_names
            .get_or_insert_with(|| (p.intern(super::CALIBRATION_BREAK), p.intern(super::QUEUE_CALIBRATION)));
        let config = self.config;
        for d in self.devices.values_mut() {
            // Issue 13 hook: a reset the backend knows of starts a new calibration segment at the next burst.
            let resets = d.link.resets();
            if resets != d.resets_seen {
                d.resets_seen = resets;
                d.tracker.report_reset();
            }
            // Calibration: on schedule; on a flush too, unless a burst was just taken.
            let gap = config.min_burst_gap.as_nanos() as u64;
            let recent = d
                .tracker
                .last_burst_ns()
                .is_some_and(|t| now_ns.saturating_sub(t) < gap);
            if d.tracker.burst_due(now_ns) || (force && !recent) {
                self.samples.clear();
                let read = d
                    .link
                    .calibrate(config.burst_samples, config.burst_budget, &mut self.samples);
                // Added even when the read failed (with what it got, maybe nothing): the schedule moves on, so
                // a failing device is retried next period, not on every pass.
                let added = d.tracker.add_burst(crate::clock::monotonic_ns().0, &self.samples);
                if read.is_err() || added.is_err() {
                    self.stats.failed_calibrations += 1;
                }
            }
            if let Some(fit) = d.tracker.history().latest() {
                if fit.calibrated_at_ns() != d.reported_fit_ns {
                    d.reported_fit_ns = fit.calibrated_at_ns();
                    let value = p.value_name();
                    p.push_counter(d.drift_track, now_ns, value, fit.drift_ppm());
                    p.push_counter(d.error_track, now_ns, value, fit.error_bound_ns());
                    // The device clock's offset from the reference now: device time (nominal ns) minus host ns.
                    let device_ns = fit.from_reference_ns(now_ns) as f64 * d.info.clock.nominal_ns_per_tick();
                    let offset = device_ns - now_ns as f64;
                    p.push_counter(d.offset_track, now_ns, value, offset);
                    d.link.publish(GpuCalibrationReport {
                        latest: *fit,
                        stats: d.tracker.history().stats(),
                        // Issue 13 hook: the placements' counters travel with the calibration report.
                        placements: d.tracker.stats(),
                    });
                }
            }

            // Read finished timestamps: runs of consecutive pairs in one call (pairs are handed out in order,
            // so scopes in flight mostly sit side by side), one call per run instead of one per scope.
            d.in_flight.sort_unstable_by_key(|s| s.pair);
            let mut i = 0;
            while i < d.in_flight.len() {
                if d.in_flight[i].finished_ns.is_some() {
                    i += 1;
                    continue;
                }
                let first = d.in_flight[i].pair;
                let mut run = 1;
                while run < MAX_READ_RUN
                    && i + run < d.in_flight.len()
                    && d.in_flight[i + run].pair == first + run as u32
                    && d.in_flight[i + run].finished_ns.is_none()
                {
                    run += 1;
                }
                self.reads.clear();
                self.reads.resize(2 * run, None);
                if d.link.read_timestamps(2 * first, &mut self.reads).is_ok() {
                    // Issue 13 hook: the read-back time bounds the GPU's end from above, so it is taken after
                    // the read returned, not at the start of the pass (a calibration burst may lie between).
                    let read_ns = crate::clock::monotonic_ns().0;
                    for (scope, read) in d.in_flight[i..i + run].iter_mut().zip(self.reads.chunks_exact(2)) {
                        scope.begin = scope.begin.or(read[0]);
                        scope.end = scope.end.or(read[1]);
                        if scope.begin.is_some() && scope.end.is_some() {
                            scope.finished_ns = Some(read_ns.max(now_ns));
                            // Issue 13 hook: the ticks are read, so the pair goes back at once (not when the
                            // slice is converted, up to the latency bound later).
                            let _ = d.link.release_pair(scope.pair);
                        }
                    }
                } else {
                    // Issue 13 hook: a failed read is counted, never ignored; the slots are read again next pass.
                    d.tracker.count_read_error();
                }
                i += run;
            }
            while let Some(pair) = d.link.take_orphan() {
                d.orphans.push((pair, now_ns));
            }
            let lost_after = config.lost_after.as_nanos() as u64;
            d.orphans.retain(|&(pair, since)| {
                self.reads.clear();
                self.reads.resize(2, None);
                let done =
                    d.link.read_timestamps(2 * pair, &mut self.reads).is_ok() && self.reads.iter().all(Option::is_some);
                if done {
                    let _ = d.link.release_pair(pair);
                }
                // An orphan never written is retired (never reused: a late write would corrupt a new scope).
                !done && now_ns.saturating_sub(since) < lost_after
            });

            // Convert what is ready, in begin-tick order so the history's monotonic guard holds.
            let mut ready: Vec<InFlight> = Vec::new();
            let mut i = 0;
            while i < d.in_flight.len() {
                let s = &d.in_flight[i];
                let convert = match (s.end, s.finished_ns) {
                    (Some(end), Some(finished)) => {
                        d.tracker.history().latest().is_some() && (force || d.tracker.ready(end.0, finished, now_ns))
                    }
                    _ => false,
                };
                if convert {
                    ready.push(d.in_flight.swap_remove(i));
                } else if s.finished_ns.is_none() && now_ns.saturating_sub(s.seen_ns) >= lost_after {
                    // Never written: its commands were not submitted. Counted; the pair is retired.
                    d.in_flight.swap_remove(i);
                    self.stats.lost_scopes += 1;
                } else {
                    i += 1;
                }
            }
            // Wrap-aware order: ticks relative to one of them (all lie within half a wrap of each other).
            let reference = ready.first().and_then(|s| s.begin).map_or(0, |t| t.0);
            ready.sort_by_key(|s| s.begin.map_or(0, |t| d.info.clock.delta_ticks(reference, t.0)));
            for s in ready {
                let (Some(begin), Some(end)) = (s.begin, s.end) else {
                    continue;
                };
                // Issue 13 hook: both timestamps placed at once, across breaks by the CPU's window, checked on
                // both sides per queue ([recorded, read back]), end never before begin.
                let Some(placed) = d.tracker.place(GpuScopeTicks {
                    queue: s.queue,
                    begin: begin.0,
                    end: end.0,
                    recorded_ns: s.cpu_ns,
                    read_ns: s.finished_ns.unwrap_or(now_ns),
                }) else {
                    continue;
                };
                if placed.marks.outside_window {
                    // The calibration disagreed with what the CPU knows (begun before it was recorded, or ended
                    // after it was read back): counted, placed inside that window.
                    d.violations += 1;
                    self.stats.causality_violations += 1;
                }
                let (begin_ns, end_ns) = (placed.begin.ns, placed.end.ns);
                let mut fields = s.fields;
                fields.push(Field {
                    name: uncertainty_name,
                    value: FieldValue::U64(placed.begin.uncertainty_ns.max(placed.end.uncertainty_ns)),
                });
                if let Some(why) = placed.marks.annotation() {
                    fields.push(Field {
                        name: break_name,
                        value: FieldValue::Str(why.into()),
                    });
                }
                if placed.marks.queue_calibration {
                    fields.push(Field {
                        name: queue_calibration_name,
                        value: FieldValue::Bool(true),
                    });
                }
                if let Some(q) = d.queues.get_mut(s.queue as usize) {
                    q.lanes.push(Slice {
                        begin_ns,
                        end_ns,
                        payload: SlicePayload {
                            name: s.name,
                            fields,
                            flow: s.flow,
                        },
                    });
                } else {
                    self.stats.lost_scopes += 1;
                }
            }

            // Lay out and export, per queue, up to what no scope still to come can precede.
            for (index, q) in d.queues.iter_mut().enumerate() {
                let watermark = d
                    .in_flight
                    .iter()
                    .filter(|s| s.queue as usize == index)
                    .map(|s| s.cpu_ns)
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
                lanes.emit(watermark, force, &mut |event| match event {
                    LaneEvent::Begin { lane, ts_ns, payload } => {
                        while tracks.len() <= lane {
                            let name = format!("{queue_name} ({})", tracks.len() + 1);
                            tracks.push(p.new_track(Some(device_track), TrackKind::Group { name }));
                        }
                        if open_names.len() <= lane {
                            open_names.resize_with(lane + 1, Vec::new);
                        }
                        open_names[lane].push(payload.name);
                        p.push_gpu_event(
                            ts_ns,
                            tracks[lane],
                            EventKind::SliceBegin,
                            payload.name,
                            &payload.fields,
                            Some(payload.flow),
                        );
                    }
                    LaneEvent::End { lane, ts_ns } => {
                        let name = open_names.get_mut(lane).and_then(Vec::pop).unwrap_or(NameId(0));
                        p.push_gpu_event(ts_ns, tracks[lane], EventKind::SliceEnd, name, &[], None);
                    }
                });
            }
            if d.violations != d.reported_violations {
                d.reported_violations = d.violations;
                let value = p.value_name();
                p.push_counter(d.violations_track, now_ns, value, d.violations as f64);
            }
        }
    }
}
