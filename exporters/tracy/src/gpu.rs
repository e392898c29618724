//! The collector half for GPU tracks: one Tracy GPU context per GPU lane track, fed with tickline's
//! converted timestamps mapped onto Tracy's CPU axis, re-anchored before every upload.

use std::collections::HashMap;
use std::sync::Mutex;

use tickline::{
    clock::TickSource,
    export::{CpuClock, NameId, TrackId},
};
use tracy_client::{Client, GpuContext, GpuContextType};

use crate::TracyStats;

/// A GPU slice begin or end, waiting until its lane's outermost slice closes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Item {
    Begin { name: NameId, ns: u64 },
    End { ns: u64 },
}

/// One lane's slices since its stack was last empty: the outermost slice and everything inside it.
#[derive(Debug, Default)]
struct Subtree {
    items: Vec<Item>,
    /// Whether Tracy was capturing when the outermost slice began (on-demand mode drops it otherwise).
    capture: bool,
    /// Slices begun in it.
    zones: u64,
}

/// A GPU lane track (a queue's own track or one of its sibling lanes).
pub(crate) struct Lane {
    name: String,
    vulkan: bool,
    context: Option<GpuContext>,
    /// Open slices (depth of the stack).
    depth: usize,
    current: Subtree,
    next_query: u16,
}

impl Lane {
    pub(crate) fn new(name: String, vulkan: bool) -> Self {
        Lane {
            name,
            vulkan,
            context: None,
            depth: 0,
            current: Subtree::default(),
            next_query: 0,
        }
    }
}

/// How tickline's reference ns become Tracy GPU times (ns on Tracy's CPU axis, period 1.0).
#[derive(Clone, Copy, Debug)]
enum Axis {
    /// Tracy's CPU axis is the TSC tickline reads: `g = (ticks - origin) * ns_per_tick`, with the rate frozen
    /// when the axis is made, so that re-anchoring only ever corrects the (tiny, constant) difference between
    /// this rate and the one Tracy measured at its start.
    Tsc {
        clock: CpuClock,
        origin: u64,
        ns_per_tick: f64,
    },
    /// tickline records `CLOCK_MONOTONIC` (no usable TSC): reference ns as they are.
    Ns { origin: u64 },
}

impl Axis {
    fn new(clock: Option<CpuClock>) -> Self {
        // SAFETY: `___tracy_get_time` reads Tracy's timer (the TSC on x86_64); it has no preconditions.
        let now = unsafe { tracy_client::sys::___tracy_get_time() } as u64;
        match clock {
            Some(clock) if clock.source == TickSource::Tsc => Axis::Tsc {
                clock,
                origin: now,
                ns_per_tick: clock.calibration.ns_per_tick(),
            },
            _ => Axis::Ns {
                origin: tickline::clock::monotonic_ns().0,
            },
        }
    }

    /// Follows the newest CPU calibration (for the ns → ticks mapping; the rate stays frozen).
    fn update(&mut self, clock: Option<CpuClock>) {
        if let (Axis::Tsc { clock: c, .. }, Some(new)) = (self, clock) {
            if new.source == TickSource::Tsc {
                *c = new;
            }
        }
    }

    /// The Tracy GPU time of reference time `ns`.
    fn of_ns(&self, ns: u64) -> i64 {
        match *self {
            Axis::Tsc { clock, .. } => self.of_ticks(clock.to_ticks(ns).0),
            Axis::Ns { origin } => ns.wrapping_sub(origin) as i64,
        }
    }

    fn of_ticks(&self, ticks: u64) -> i64 {
        match *self {
            Axis::Tsc {
                origin, ns_per_tick, ..
            } => (ticks.wrapping_sub(origin) as i64 as f64 * ns_per_tick).round() as i64,
            Axis::Ns { .. } => 0,
        }
    }

    /// An anchor pair taken now: the Tracy GPU time of "now", read as close to Tracy's own read as possible.
    /// Returns the GPU time and Tracy's timer before the read (to measure the latency of the anchor call).
    fn now(&self) -> (i64, i64) {
        // SAFETY: as in `new`.
        let before = unsafe { tracy_client::sys::___tracy_get_time() };
        let g = match *self {
            Axis::Tsc { .. } => self.of_ticks(before as u64),
            Axis::Ns { origin } => tickline::clock::monotonic_ns().0.wrapping_sub(origin) as i64,
        };
        (g, before)
    }

    /// Tracy timer ticks to ns, for latency figures.
    fn ticks_to_ns(&self, ticks: i64) -> f64 {
        match *self {
            Axis::Tsc { ns_per_tick, .. } => ticks as f64 * ns_per_tick,
            Axis::Ns { .. } => ticks as f64,
        }
    }
}

/// Oldest a GPU slice may be, relative to the anchor taken just before it is uploaded: Tracy 0.14 reads a GPU
/// time more than 2^31 ns before the context's previous one as a counter wrap. Older slices are counted
/// ([`TracyStats::stale_gpu_zones`]) and not uploaded.
const MAX_AGE_NS: u64 = 1_500_000_000;

/// An anchoring call that took longer than this (between the TSC read and Tracy's own, a preemption or a
/// wait for Tracy's serial-queue lock) is retried: the newest anchor is the one Tracy uses.
const ANCHOR_TARGET_NS: f64 = 250.0;
/// Most anchoring calls per context per export.
const ANCHOR_TRIES: u32 = 8;

/// Re-anchors `context`: the Tracy GPU time of a TSC read taken just before the call that Tracy stamps with its
/// own TSC read. Retried while the call takes longer than [`ANCHOR_TARGET_NS`], so the offset it leaves is at
/// most the (recorded) duration of the accepted call.
fn anchor(context: &GpuContext, axis: &Axis, stats: &mut TracyStats) {
    for attempt in 1..=ANCHOR_TRIES {
        let (g, before) = axis.now();
        context.sync_gpu_time(g);
        // SAFETY: as in `Axis::new`.
        let after = unsafe { tracy_client::sys::___tracy_get_time() };
        let latency = axis.ticks_to_ns(after - before);
        if latency <= ANCHOR_TARGET_NS || attempt == ANCHOR_TRIES {
            stats.anchors += 1;
            stats.anchor_retries += u64::from(attempt - 1);
            stats.anchor_latency_max_ns = stats.anchor_latency_max_ns.max(latency);
            stats.anchor_latency_sum_ns += latency;
            return;
        }
    }
}

/// GPU contexts of exporters that ended, with their lane's name and whether it is a Vulkan one. Tracy allows 255
/// contexts per process and cannot delete one, so a later exporter's lane of the same name and kind takes its
/// context over (a context is named once, when made). Only contexts with no zone left open are kept: a lane
/// uploads a subtree of zones whole.
static SPARE_CONTEXTS: Mutex<Vec<(String, bool, GpuContext)>> = Mutex::new(Vec::new());

fn spare_context(name: &str, vulkan: bool) -> Option<GpuContext> {
    let mut spare = SPARE_CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    let at = spare.iter().position(|(n, v, _)| n == name && *v == vulkan)?;
    Some(spare.swap_remove(at).2)
}

/// Every GPU lane of the timeline.
#[derive(Default)]
pub(crate) struct GpuZones {
    lanes: HashMap<TrackId, Lane>,
    axis: Option<Axis>,
    /// Subtrees completed in this batch, with their lane and first timestamp.
    ready: Vec<(u64, TrackId, Vec<Item>)>,
}

impl Drop for GpuZones {
    /// The lanes' contexts go to [`SPARE_CONTEXTS`] for a later exporter's lanes of the same names.
    fn drop(&mut self) {
        let mut spare = SPARE_CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        for lane in self.lanes.values_mut() {
            if let Some(context) = lane.context.take() {
                spare.push((std::mem::take(&mut lane.name), lane.vulkan, context));
            }
        }
    }
}

impl GpuZones {
    pub(crate) fn add_lane(&mut self, track: TrackId, lane: Lane) {
        self.lanes.insert(track, lane);
    }

    pub(crate) fn is_lane(&self, track: TrackId) -> bool {
        self.lanes.contains_key(&track)
    }

    /// A slice begins on lane `track`.
    pub(crate) fn begin(&mut self, track: TrackId, name: NameId, ns: u64, capturing: bool) {
        let Some(lane) = self.lanes.get_mut(&track) else { return };
        if lane.depth == 0 {
            lane.current.items.clear();
            lane.current.capture = capturing;
            lane.current.zones = 0;
        }
        lane.depth += 1;
        lane.current.zones += 1;
        if lane.current.capture {
            lane.current.items.push(Item::Begin { name, ns });
        }
    }

    /// The innermost open slice of lane `track` ends.
    pub(crate) fn end(&mut self, track: TrackId, ns: u64, stats: &mut TracyStats) {
        let Some(lane) = self.lanes.get_mut(&track) else { return };
        if lane.depth == 0 {
            return;
        }
        lane.depth -= 1;
        if lane.current.capture {
            lane.current.items.push(Item::End { ns });
        }
        if lane.depth == 0 {
            if lane.current.capture {
                let first = match lane.current.items.first() {
                    Some(Item::Begin { ns, .. }) => *ns,
                    _ => ns,
                };
                self.ready.push((first, track, std::mem::take(&mut lane.current.items)));
            } else {
                stats.gpu_zones_not_captured += lane.current.zones;
                lane.current.items.clear();
            }
        }
    }

    /// Drops the subtrees completed in this batch: no profiler is connected (on-demand mode).
    pub(crate) fn drop_ready(&mut self, stats: &mut TracyStats) {
        for (_, _, items) in self.ready.drain(..) {
            stats.gpu_zones_not_captured += items.len() as u64 / 2;
        }
    }

    /// Uploads every subtree completed in this batch: per context, one anchor, then the subtree's zones in
    /// time order.
    pub(crate) fn upload(
        &mut self,
        client: &Client,
        clock: Option<CpuClock>,
        names: &HashMap<NameId, String>,
        stats: &mut TracyStats,
    ) {
        if self.ready.is_empty() {
            return;
        }
        let axis = self.axis.get_or_insert_with(|| Axis::new(clock));
        axis.update(clock);
        let axis = *axis;
        // Oldest first across lanes, so Tracy's GPU times (delta-coded across contexts) move forwards.
        self.ready.sort_by_key(|(first, _, _)| *first);
        let now_ns = tickline::clock::monotonic_ns().0;
        let mut anchored: Vec<TrackId> = Vec::new();
        for (first, track, items) in self.ready.drain(..) {
            let zones = items.len() as u64 / 2;
            if now_ns.saturating_sub(first) > MAX_AGE_NS {
                stats.stale_gpu_zones += zones;
                continue;
            }
            let Some(lane) = self.lanes.get_mut(&track) else {
                continue;
            };
            if lane.context.is_none() {
                let ty = if lane.vulkan {
                    GpuContextType::Vulkan
                } else {
                    GpuContextType::Invalid
                };
                // An ended exporter's context of this name first (re-anchored below, as every upload is).
                let context = spare_context(&lane.name, lane.vulkan)
                    .map(Ok)
                    .unwrap_or_else(|| client.clone().new_gpu_context(Some(&lane.name), ty, axis.now().0, 1.0));
                match context {
                    Ok(context) => {
                        lane.context = Some(context);
                        stats.gpu_contexts += 1;
                    }
                    Err(_) => {
                        // Tracy holds at most 255 GPU contexts per process.
                        stats.gpu_zones_without_context += zones;
                        continue;
                    }
                }
            }
            let context = lane.context.as_ref().expect("made above");
            if !anchored.contains(&track) {
                anchored.push(track);
                anchor(context, &axis, stats);
            }
            for item in items {
                let query = lane.next_query;
                lane.next_query = lane.next_query.wrapping_add(1);
                match item {
                    Item::Begin { name, ns } => {
                        let name = names.get(&name).map_or("<unnamed>", String::as_str);
                        context.begin_span_alloc(name, "", "", 0, query);
                        context.upload_gpu_timestamp(query, axis.of_ns(ns));
                        stats.gpu_zones += 1;
                    }
                    Item::End { ns } => {
                        context.end_span(query);
                        context.upload_gpu_timestamp(query, axis.of_ns(ns));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes() -> GpuZones {
        let mut gpu = GpuZones::default();
        gpu.add_lane(TrackId(1), Lane::new("gpu / graphics".into(), false));
        gpu
    }

    #[test]
    fn a_lane_hands_over_a_subtree_when_its_outermost_slice_ends() {
        let mut gpu = lanes();
        let mut stats = TracyStats::default();
        gpu.begin(TrackId(1), NameId(1), 100, true);
        gpu.begin(TrackId(1), NameId(2), 110, true);
        gpu.end(TrackId(1), 120, &mut stats);
        assert!(gpu.ready.is_empty(), "the outer slice is still open");
        gpu.end(TrackId(1), 130, &mut stats);
        assert_eq!(gpu.ready.len(), 1);
        let (first, track, items) = &gpu.ready[0];
        assert_eq!((*first, *track, items.len()), (100, TrackId(1), 4));
        assert!(!gpu.is_lane(TrackId(2)));
    }

    #[test]
    fn a_subtree_begun_while_not_capturing_is_dropped_whole_and_counted() {
        let mut gpu = lanes();
        let mut stats = TracyStats::default();
        // The profiler connects between the outer begin and the inner one: the subtree stays uncaptured, so
        // Tracy never sees an end without its begin.
        gpu.begin(TrackId(1), NameId(1), 100, false);
        gpu.begin(TrackId(1), NameId(2), 110, true);
        gpu.end(TrackId(1), 120, &mut stats);
        gpu.end(TrackId(1), 130, &mut stats);
        assert!(gpu.ready.is_empty());
        assert_eq!(stats.gpu_zones_not_captured, 2);
        // The next subtree is captured.
        gpu.begin(TrackId(1), NameId(1), 200, true);
        gpu.end(TrackId(1), 210, &mut stats);
        assert_eq!(gpu.ready.len(), 1);
        gpu.drop_ready(&mut stats);
        assert_eq!(stats.gpu_zones_not_captured, 3);
    }

    #[test]
    fn an_end_without_an_open_slice_is_ignored() {
        let mut gpu = lanes();
        let mut stats = TracyStats::default();
        gpu.end(TrackId(1), 10, &mut stats);
        gpu.end(TrackId(9), 10, &mut stats);
        assert!(gpu.ready.is_empty());
    }
}
