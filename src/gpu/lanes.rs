//! Lays a queue's converted GPU slices out on tracks that viewers pair correctly.
//!
//! Perfetto (and Tracy) pair begins and ends per track as a stack, and expect timestamps in order per track.
//! GPU slices arrive late and out of order (the GPU finishes them, then they wait for calibration), and slices
//! on one queue can overlap without nesting (async compute, two command buffers in flight). So a queue owns
//! *lanes*: lane 0 is the queue's track, further lanes are sibling tracks. A slice goes to the first lane where
//! it starts after everything emitted there and either nests inside the lane's open slice or starts after it
//! ended. Ends are emitted once no later slice can need to nest around them (the watermark passed them).
//! Instants (a scope whose ticks were lost, shown where its CPU recorded it) take the same order, on the first
//! lane whose time has not passed them.

/// A converted slice waiting to be laid out. `T` is the payload the caller gets back (name, fields, flow).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Slice<T> {
    pub(crate) begin_ns: u64,
    pub(crate) end_ns: u64,
    pub(crate) payload: T,
    /// An instant at `begin_ns` (`end_ns == begin_ns`), not a slice.
    pub(crate) instant: bool,
}

/// What the lanes emit, in order per lane.
#[derive(Debug, PartialEq)]
pub(crate) enum LaneEvent<T> {
    /// Slice opens on `lane`.
    Begin { lane: usize, ts_ns: u64, payload: T },
    /// The innermost open slice of `lane` closes.
    End { lane: usize, ts_ns: u64 },
    /// An instant on `lane` (inside whatever is open there).
    Instant { lane: usize, ts_ns: u64, payload: T },
}

#[derive(Debug, Default)]
struct Lane {
    /// Ends of the open slices, outermost first.
    open: Vec<u64>,
    last_ns: u64,
}

/// One queue's lanes and the slices not laid out yet.
#[derive(Debug)]
pub(crate) struct Lanes<T> {
    lanes: Vec<Lane>,
    waiting: Vec<Slice<T>>,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Lanes {
            lanes: Vec::new(),
            waiting: Vec::new(),
        }
    }
}

impl<T> Lanes<T> {
    /// Adds a converted slice (`end_ns >= begin_ns`).
    pub(crate) fn push(&mut self, slice: Slice<T>) {
        debug_assert!(slice.end_ns >= slice.begin_ns);
        self.waiting.push(slice);
    }

    /// Adds an instant at `ts_ns`.
    pub(crate) fn push_instant(&mut self, ts_ns: u64, payload: T) {
        self.waiting.push(Slice {
            begin_ns: ts_ns,
            end_ns: ts_ns,
            payload,
            instant: true,
        });
    }

    /// How many lanes exist (lane indices are `0..count`).
    #[cfg(test)]
    pub(crate) fn lane_count(&self) -> usize {
        self.lanes.len()
    }

    /// Slices not laid out yet.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Lays out every waiting slice that begins at or before `watermark_ns` (no slice still to come begins
    /// before it), and closes open slices that end at or before it. `force` lays out and closes everything.
    pub(crate) fn emit(&mut self, watermark_ns: u64, force: bool, out: &mut impl FnMut(LaneEvent<T>)) {
        // Begin ascending; for equal begins the longer (outer) slice first so the shorter nests in it.
        self.waiting
            .sort_by(|a, b| a.begin_ns.cmp(&b.begin_ns).then(b.end_ns.cmp(&a.end_ns)));
        let take = if force {
            self.waiting.len()
        } else {
            self.waiting.partition_point(|s| s.begin_ns <= watermark_ns)
        };
        for slice in self.waiting.drain(..take) {
            for (index, lane) in self.lanes.iter_mut().enumerate() {
                close_until(lane, index, slice.begin_ns, out);
            }
            if slice.instant {
                // Zero width: it nests in anything open, so only the lane's time matters.
                let index = first_lane_where(&mut self.lanes, |lane| lane.last_ns <= slice.begin_ns);
                self.lanes[index].last_ns = slice.begin_ns;
                out(LaneEvent::Instant {
                    lane: index,
                    ts_ns: slice.begin_ns,
                    payload: slice.payload,
                });
                continue;
            }
            let fits =
                |lane: &Lane| lane.last_ns <= slice.begin_ns && lane.open.last().is_none_or(|&end| slice.end_ns <= end);
            let index = first_lane_where(&mut self.lanes, fits);
            let lane = &mut self.lanes[index];
            lane.open.push(slice.end_ns);
            lane.last_ns = slice.begin_ns;
            out(LaneEvent::Begin {
                lane: index,
                ts_ns: slice.begin_ns,
                payload: slice.payload,
            });
        }
        let until = if force { u64::MAX } else { watermark_ns };
        for (index, lane) in self.lanes.iter_mut().enumerate() {
            close_until(lane, index, until, out);
        }
    }
}

/// The first of `lanes` where `fits`, or a new one.
fn first_lane_where(lanes: &mut Vec<Lane>, fits: impl Fn(&Lane) -> bool) -> usize {
    match lanes.iter().position(fits) {
        Some(index) => index,
        None => {
            lanes.push(Lane::default());
            lanes.len() - 1
        }
    }
}

/// Emits the ends of `lane`'s open slices that end at or before `until`, innermost first.
fn close_until<T>(lane: &mut Lane, index: usize, until: u64, out: &mut impl FnMut(LaneEvent<T>)) {
    while let Some(&end) = lane.open.last() {
        if end > until {
            break;
        }
        lane.open.pop();
        lane.last_ns = lane.last_ns.max(end);
        out(LaneEvent::End {
            lane: index,
            ts_ns: lane.last_ns,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(begin_ns: u64, end_ns: u64, id: u32) -> Slice<u32> {
        Slice {
            begin_ns,
            end_ns,
            payload: id,
            instant: false,
        }
    }

    fn run(lanes: &mut Lanes<u32>, watermark: u64, force: bool) -> Vec<LaneEvent<u32>> {
        let mut events = Vec::new();
        lanes.emit(watermark, force, &mut |e| events.push(e));
        events
    }

    /// Every lane's events are in time order and pair as a stack into the slices that went in.
    fn check(events: &[LaneEvent<u32>], slices: &[Slice<u32>]) {
        let mut stacks: Vec<Vec<(u32, u64)>> = Vec::new();
        let mut last: Vec<u64> = Vec::new();
        let mut seen = Vec::new();
        for e in events {
            let (lane, ts) = match e {
                LaneEvent::Begin { lane, ts_ns, .. }
                | LaneEvent::End { lane, ts_ns }
                | LaneEvent::Instant { lane, ts_ns, .. } => (*lane, *ts_ns),
            };
            if stacks.len() <= lane {
                stacks.resize(lane + 1, Vec::new());
                last.resize(lane + 1, 0);
            }
            assert!(ts >= last[lane], "lane {lane} goes back: {ts} < {}", last[lane]);
            last[lane] = ts;
            match e {
                LaneEvent::Begin { payload, .. } => stacks[lane].push((*payload, ts)),
                LaneEvent::End { .. } => {
                    let (id, begin) = stacks[lane].pop().expect("end without begin");
                    seen.push(slice(begin, ts, id));
                }
                LaneEvent::Instant { payload, .. } => seen.push(Slice {
                    begin_ns: ts,
                    end_ns: ts,
                    payload: *payload,
                    instant: true,
                }),
            }
        }
        assert!(stacks.iter().all(Vec::is_empty), "unclosed slices");
        let mut want = slices.to_vec();
        want.sort_by_key(|s| s.payload);
        seen.sort_by_key(|s| s.payload);
        assert_eq!(seen, want);
    }

    #[test]
    fn nested_slices_share_a_lane() {
        let mut lanes = Lanes::default();
        let slices = [slice(10, 100, 1), slice(20, 30, 2), slice(40, 90, 3), slice(50, 60, 4)];
        for s in slices.iter().rev() {
            lanes.push(s.clone());
        }
        let events = run(&mut lanes, 1_000, false);
        check(&events, &slices);
        assert_eq!(lanes.lane_count(), 1);
    }

    #[test]
    fn partial_overlaps_go_to_sibling_lanes() {
        let mut lanes = Lanes::default();
        let slices = [slice(10, 50, 1), slice(30, 80, 2), slice(60, 70, 3), slice(75, 90, 4)];
        for s in &slices {
            lanes.push(s.clone());
        }
        let events = run(&mut lanes, 1_000, false);
        check(&events, &slices);
        assert_eq!(lanes.lane_count(), 2);
    }

    #[test]
    fn the_watermark_holds_back_slices_and_ends() {
        let mut lanes = Lanes::default();
        lanes.push(slice(10, 100, 1));
        let events = run(&mut lanes, 50, false);
        assert_eq!(events.len(), 1, "begin only: a later slice may still nest");
        lanes.push(slice(60, 70, 2));
        lanes.push(slice(200, 210, 3));
        let mut all = events;
        all.extend(run(&mut lanes, 150, false));
        assert_eq!(lanes.waiting(), 1, "the slice past the watermark waits");
        all.extend(run(&mut lanes, 150, true));
        check(&all, &[slice(10, 100, 1), slice(60, 70, 2), slice(200, 210, 3)]);
        assert_eq!(lanes.lane_count(), 1);
    }

    #[test]
    fn a_late_slice_before_emitted_time_takes_another_lane() {
        let mut lanes = Lanes::default();
        lanes.push(slice(100, 200, 1));
        let mut all = run(&mut lanes, 300, false);
        lanes.push(slice(50, 120, 2));
        all.extend(run(&mut lanes, 300, true));
        check(&all, &[slice(100, 200, 1), slice(50, 120, 2)]);
        assert_eq!(lanes.lane_count(), 2);
    }

    /// A lost scope's instant nests in the slice open around it, in time order with the slices' events; one
    /// before time already emitted everywhere (after a forced flush) takes a lane of its own.
    #[test]
    fn instants_take_their_place_in_time() {
        let mut lanes = Lanes::default();
        lanes.push(slice(10, 100, 1));
        lanes.push_instant(50, 2);
        lanes.push(slice(60, 70, 3));
        let mut all = run(&mut lanes, 1_000, false);
        let at: Vec<_> = all
            .iter()
            .map(|e| match e {
                LaneEvent::Begin { lane, ts_ns, .. } | LaneEvent::End { lane, ts_ns } => (*lane, *ts_ns, false),
                LaneEvent::Instant { lane, ts_ns, .. } => (*lane, *ts_ns, true),
            })
            .collect();
        assert_eq!(
            at,
            [
                (0, 10, false),
                (0, 50, true),
                (0, 60, false),
                (0, 70, false),
                (0, 100, false)
            ]
        );
        lanes.push_instant(20, 4);
        all.extend(run(&mut lanes, 1_000, true));
        assert!(matches!(
            all.last(),
            Some(LaneEvent::Instant {
                lane: 1,
                ts_ns: 20,
                payload: 4
            })
        ));
        let instant = |begin_ns, payload| Slice {
            begin_ns,
            end_ns: begin_ns,
            payload,
            instant: true,
        };
        check(
            &all,
            &[slice(10, 100, 1), instant(50, 2), slice(60, 70, 3), instant(20, 4)],
        );
    }

    #[test]
    fn random_slices_always_pair() {
        let mut rng = crate::calibration::SplitMix64(7);
        for round in 0..200 {
            let mut lanes = Lanes::default();
            let mut slices = Vec::new();
            let mut events = Vec::new();
            let mut watermark = 0;
            for id in 0..(round % 40 + 1) {
                let begin = watermark + rng.next_u64() % 1_000;
                if rng.next_u64() % 5 == 0 {
                    slices.push(Slice {
                        begin_ns: begin,
                        end_ns: begin,
                        payload: id,
                        instant: true,
                    });
                    lanes.push_instant(begin, id);
                } else {
                    let s = slice(begin, begin + rng.next_u64() % 500, id);
                    slices.push(s.clone());
                    lanes.push(s);
                }
                if rng.next_u64() % 4 == 0 {
                    watermark += rng.next_u64() % 300;
                    lanes.emit(watermark, false, &mut |e| events.push(e));
                }
            }
            lanes.emit(u64::MAX, true, &mut |e| events.push(e));
            check(&events, &slices);
        }
    }
}
