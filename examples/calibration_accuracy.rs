//! How accurately do three calibration schemes place GPU-like timestamps on the reference clock?
//!
//! One simulated clock pair (200 ppm drift with random-walk wander, 1 µs read jitter, 5 % hidden outliers of
//! 50 µs, 1 ns ticks) runs for 10 simulated minutes. The same events are converted by:
//!
//! - `dotcompute`: ordinary least squares on 100 samples taken back to back (100 µs apart, DotCompute's ~10 ms
//!   calibration), recalibrated every 5 minutes, each event converted with the calibration before it.
//! - `anchor`: Tracy-style: one (CPU, GPU) anchor pair at start plus the nominal rate, never refreshed.
//! - `tickline`: the live [`CalibrationHistory`]: a burst of 16 bracketed reads every 250 ms, the tightest
//!   quarter kept, a Huber fit over the last 16 bursts, knots at the window's centroid; each event is held until
//!   a knot lies after it (two-sided conversion) or 5 s have passed. On a real backend a calibrated read costs
//!   1-5 µs, so this plan costs 16-80 µs every 250 ms: 0.006-0.032 % of one core.
//!
//! `cargo run --release --example calibration_accuracy [-- --json]`

use tickline::calibration::sim::{SimClockConfig, SimClockPair};
use tickline::calibration::{
    CalibrationHistory, CalibrationSample, ClockCalibration, FitOptions, FitStrategy, HistoryConfig,
};

const SECOND: u64 = 1_000_000_000;
const RUN_NS: u64 = 600 * SECOND;
const BURST_PERIOD_NS: u64 = 250_000_000;
const BURST_READS: usize = 16;
/// What one calibrated read costs on a real backend (a sim read advances time by this).
const READ_NS: u64 = 3_000;
const DOTCOMPUTE_PERIOD_NS: u64 = 300 * SECOND;
const DOTCOMPUTE_SAMPLES: usize = 100;
const DOTCOMPUTE_SPACING_NS: u64 = 100_000;
const LATENCY_BOUND_NS: u64 = 5 * SECOND;
const EVENTS: usize = 200_000;

#[derive(Default)]
struct Errors(Vec<u64>);

impl Errors {
    fn summary(&mut self) -> (u64, u64, u64) {
        self.0.sort_unstable();
        let at = |q: f64| self.0[((self.0.len() - 1) as f64 * q).round() as usize];
        (at(0.5), at(0.99), *self.0.last().unwrap())
    }
}

fn take_samples(pair: &mut SimClockPair, n: usize, spacing_ns: u64) -> Vec<CalibrationSample> {
    (0..n)
        .map(|_| {
            let s = pair.sample();
            let next = pair.now_ns() + spacing_ns;
            pair.advance_to(next);
            s
        })
        .collect()
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let config = SimClockConfig {
        drift_ppm: 200.0,
        // A crystal's frequency wanders with temperature: 0.05 ppm per √s is a warm GPU under changing load.
        wander_ppm_per_sqrt_s: 0.05,
        jitter_ns: 1_000.0,
        outlier_fraction: 0.05,
        outlier_ns: 50_000.0,
        ns_per_tick: 1.0,
        valid_bits: 64,
        seed: 0x7ac1_1e5e_ed00,
        ..SimClockConfig::default()
    };
    let mut pair = SimClockPair::new(config).expect("valid simulation");
    let domain = pair.domain();
    let start = pair.now_ns();
    let end = start + RUN_NS;

    // Event times: uniform over the run, deterministic.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut events: Vec<u64> = (0..EVENTS)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            start + SECOND + rng % (RUN_NS - 2 * SECOND)
        })
        .collect();
    events.sort_unstable();

    let ols = FitOptions {
        strategy: FitStrategy::LeastSquares,
        keep_tightest: 1.0,
        min_samples: 10,
    };
    let mut dotcompute: Option<ClockCalibration> = None;
    let mut next_dotcompute = start;
    let anchor_sample = pair.sample();
    let anchor = ClockCalibration::from_anchor(
        domain,
        anchor_sample.source_ticks,
        anchor_sample.reference_ns,
        domain.nominal_ns_per_tick(),
    )
    .expect("valid anchor");
    let mut history = CalibrationHistory::new(domain, HistoryConfig::default());

    let (mut err_dotcompute, mut err_anchor, mut err_tickline, mut err_immediate) = (
        Errors::default(),
        Errors::default(),
        Errors::default(),
        Errors::default(),
    );
    let mut pending: std::collections::VecDeque<(u64, u64)> = Default::default();
    let mut next_event = 0;
    let mut rejected_bursts = 0;

    while pair.now_ns() < end + LATENCY_BOUND_NS {
        if pair.now_ns() >= next_dotcompute && pair.now_ns() < end {
            let samples = take_samples(&mut pair, DOTCOMPUTE_SAMPLES, DOTCOMPUTE_SPACING_NS);
            dotcompute = Some(ClockCalibration::fit(&samples, &ols, domain, pair.now_ns()).expect("OLS fit"));
            next_dotcompute += DOTCOMPUTE_PERIOD_NS;
        }
        let burst = take_samples(&mut pair, BURST_READS, READ_NS);
        if history.add_burst(&burst).is_err() {
            rejected_bursts += 1;
        }
        let now = pair.now_ns();
        // Events that happened by now: the one-sided schemes convert them at once.
        while next_event < events.len() && events[next_event] <= now {
            let t = events[next_event];
            let ticks = pair.true_ticks_at(t);
            let dc = dotcompute.as_ref().expect("calibrated at start");
            err_dotcompute.0.push(dc.to_reference_ns(ticks).abs_diff(t));
            err_anchor.0.push(anchor.to_reference_ns(ticks).abs_diff(t));
            if let Some(c) = history.peek(ticks) {
                err_immediate.0.push(c.ns.abs_diff(t));
            }
            pending.push_back((t, ticks));
            next_event += 1;
        }
        // tickline holds each event until it converts two-sided, or the latency bound passes.
        while let Some(&(t, ticks)) = pending.front() {
            if !(history.is_bracketed(ticks) || now - t >= LATENCY_BOUND_NS) {
                break;
            }
            let c = history.convert(ticks).expect("calibrated");
            err_tickline.0.push(c.ns.abs_diff(t));
            pending.pop_front();
        }
        let next = pair.now_ns() + BURST_PERIOD_NS - BURST_READS as u64 * READ_NS;
        pair.advance_to(next);
    }
    assert!(
        pending.is_empty() && err_tickline.0.len() == EVENTS,
        "every event converted"
    );

    let rows = [
        ("dotcompute", err_dotcompute.summary()),
        ("anchor", err_anchor.summary()),
        ("tickline", err_tickline.summary()),
        ("tickline_immediate", err_immediate.summary()),
    ];
    if json {
        let mut out = serde_json::Map::new();
        for (name, (p50, p99, max)) in rows {
            out.insert(
                name.into(),
                serde_json::json!({ "p50_ns": p50, "p99_ns": p99, "max_ns": max }),
            );
        }
        out.insert("events".into(), EVENTS.into());
        out.insert("rejected_bursts".into(), rejected_bursts.into());
        println!("{}", serde_json::Value::Object(out));
    } else {
        println!(
            "10 simulated minutes, 200 ppm drift + 0.05 ppm/√s wander, 1 µs jitter, 5 % outliers of 50 µs, {EVENTS} events"
        );
        println!("{:<20} {:>12} {:>12} {:>12}", "scheme", "p50 ns", "p99 ns", "max ns");
        for (name, (p50, p99, max)) in rows {
            println!("{name:<20} {p50:>12} {p99:>12} {max:>12}");
        }
        println!("(tickline_immediate: the same history converting each event at once, by extrapolation)");
    }
}
