//! One stretch of the map between breaks: its window of bursts, its knots, its newest fit, and the thinning
//! that keeps its knots bounded, and the burst it holds as a suspect of a break.

use std::collections::VecDeque;

use crate::calibration::{CalibrationSample, ClockCalibration};

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Knot {
    /// Unwrapped ticks.
    pub(super) ticks: u64,
    pub(super) ns: u64,
    /// Standard error of `ns`.
    pub(super) sigma_ns: f64,
}

/// One stretch of the map between breaks.
#[derive(Clone, Debug)]
pub(super) struct Segment {
    pub(super) id: u64,
    /// Kept samples of the recent bursts (unwrapped ticks), one entry per burst.
    pub(super) window: VecDeque<Vec<CalibrationSample>>,
    pub(super) knots: VecDeque<Knot>,
    pub(super) latest: Option<ClockCalibration>,
    /// `latest` in the source's own ticks (see `CalibrationHistory::origin`), as `latest()` gives it out.
    pub(super) latest_public: Option<ClockCalibration>,
    /// Whether `latest` fitted a rate (false: offset only, with the prior or nominal rate).
    pub(super) has_rate: bool,
    /// `(unwrapped ticks, reference ns)` of the tightest sample of the first and of the newest burst.
    pub(super) first_burst: (u64, u64),
    pub(super) last_burst: (u64, u64),
    /// Where the segment before this one stops answering: this segment's first burst, or, when that burst was
    /// moved here from before the break (a suspect), the burst that found the break. The break lies somewhere
    /// before that one, so between the two both segments answer and a tick there is placed by their hull.
    pub(super) sure_from: (u64, u64),
    /// The rate carried over a break: ns per tick and its standard error in ppm.
    pub(super) rate_prior: Option<(f64, f64)>,
    /// The largest input converted so far and its output, for monotonic output within the segment.
    pub(super) high_water: Option<(u64, u64)>,
    /// Recent burst points: `(unwrapped ticks, reference ns, variance ns²)` of each burst's offset.
    pub(super) points: VecDeque<(u64, u64, f64)>,
    /// Per point, how far it says the map may be off there (see `point_floor`), as of the newest refit.
    pub(super) floors: Vec<f64>,
    /// The most bursts the fit may span now (see `add_burst`).
    pub(super) window_limit: usize,
    /// The newest burst, when its prediction missed it by more than three standard errors.
    pub(super) suspect: Option<Suspect>,
}

impl Segment {
    pub(super) fn new(id: u64, rate_prior: Option<(f64, f64)>, window_limit: usize) -> Self {
        Segment {
            id,
            window: VecDeque::new(),
            knots: VecDeque::new(),
            latest: None,
            latest_public: None,
            has_rate: false,
            first_burst: (0, 0),
            last_burst: (0, 0),
            sure_from: (0, 0),
            rate_prior,
            high_water: None,
            points: VecDeque::new(),
            floors: Vec::new(),
            window_limit,
            suspect: None,
        }
    }
}

pub(super) fn push_knot(knots: &mut VecDeque<Knot>, knot: Knot, max_knots: usize) {
    if knots.len() >= max_knots {
        // Thin the older half to every second knot: old regions keep coarser coverage, memory stays flat.
        let half = knots.len() / 2;
        let mut thinned: VecDeque<Knot> = VecDeque::with_capacity(max_knots);
        for (i, k) in knots.iter().enumerate() {
            if i >= half || i % 2 == 0 {
                thinned.push_back(*k);
            }
        }
        *knots = thinned;
    }
    knots.push_back(knot);
}

/// The newest burst of a segment when the fit before it predicted it worse than two standard errors: maybe
/// noise, maybe the first sign of a break that the next burst will show. Until then, conversions after the
/// burst before it state the difference between the fits with and without it, and if the next burst breaks
/// on the same side, this burst moves to the new segment, so that it never bends the map before the break.
#[derive(Clone, Debug)]
pub(super) struct Suspect {
    /// The segment's fit before the burst joined, and whether that fit had a rate.
    pub(super) pre_fit: Option<ClockCalibration>,
    pub(super) pre_has_rate: bool,
    /// The segment's newest burst before it.
    pub(super) pre_last_burst: (u64, u64),
    /// Whether its refit placed a knot, and the window burst and point its joining pushed out.
    pub(super) knot_placed: bool,
    pub(super) popped_burst: Option<Vec<CalibrationSample>>,
    pub(super) popped_point: Option<(u64, u64, f64)>,
    /// The burst (kept samples), its point and its representative sample.
    pub(super) burst: Vec<CalibrationSample>,
    pub(super) point: (u64, u64, f64),
    /// Whether it lay after (later than) the prediction.
    pub(super) late: bool,
}
