use super::*;
use crate::calibration::sim::{SimClockConfig, SimClockPair};

fn pair(config: SimClockConfig) -> SimClockPair {
    SimClockPair::new(config).unwrap()
}

/// Runs `bursts` bursts of 16 samples every `period_ns` and returns the history.
fn run(pair: &mut SimClockPair, config: HistoryConfig, bursts: usize, period_ns: u64) -> CalibrationHistory {
    let mut history = CalibrationHistory::new(pair.domain(), config);
    for _ in 0..bursts {
        let burst: Vec<_> = (0..16)
            .map(|_| {
                let s = pair.sample();
                let next = pair.now_ns() + 3_000;
                pair.advance_to(next);
                s
            })
            .collect();
        let _ = history.add_burst(&burst);
        let next = pair.now_ns() + period_ns;
        pair.advance_to(next);
    }
    history
}

#[test]
fn empty_history_converts_nothing_and_rejects_empty_bursts() {
    let mut h = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
    assert_eq!(h.convert(5), None);
    assert!(matches!(h.add_burst(&[]), Err(CalibrationError::TooFewSamples { .. })));
    assert_eq!(h.stats().rejected, 1);
}

#[test]
fn noiseless_drifting_clock_is_exact_between_knots() {
    let mut p = pair(SimClockConfig {
        drift_ppm: 200.0,
        offset_ns: -7_000,
        ..Default::default()
    });
    let mut h = run(&mut p, HistoryConfig::default(), 40, 100_000_000);
    let start = p.now_ns() - 3_000_000_000;
    for i in 0..1_000u64 {
        let t = start + i * 1_234_567;
        let got = h.convert(p.true_ticks_at(t)).unwrap();
        assert!(got.ns.abs_diff(t) <= 2, "at {t}: {got:?}");
    }
    assert!((h.stats().drift_ppm - 200.0).abs() < 0.01, "{:?}", h.stats());
}

#[test]
fn two_sided_conversion_tracks_wander_within_its_uncertainty() {
    let mut p = pair(SimClockConfig {
        drift_ppm: 200.0,
        wander_ppm_per_sqrt_s: 0.05,
        jitter_ns: 1_000.0,
        outlier_fraction: 0.05,
        outlier_ns: 50_000.0,
        seed: 7,
        ..Default::default()
    });
    let mut h = run(&mut p, HistoryConfig::default(), 400, 250_000_000);
    let (mut inside, mut total, mut worst) = (0, 0, 0);
    let first = p.now_ns() - 90_000_000_000;
    let mut t = first;
    while t < p.now_ns() - 3_000_000_000 {
        let ticks = p.true_ticks_at(t);
        assert!(h.is_bracketed(ticks));
        let got = h.convert(ticks).unwrap();
        let err = got.ns.abs_diff(t);
        worst = worst.max(err);
        inside += usize::from(err <= got.uncertainty_ns);
        if total % 500 == 0 {
            eprintln!("err {err} unc {}", got.uncertainty_ns);
        }
        total += 1;
        t += 7_777_777;
    }
    eprintln!("worst {worst} inside {inside}/{total} stats {:?}", h.stats());
    assert!(worst < 200, "worst error {worst} ns");
    assert!(
        inside * 100 >= total * 95,
        "{inside}/{total} inside the stated uncertainty"
    );
}

#[test]
fn brackets_that_all_lean_one_way_widen_the_stated_uncertainty() {
    // Like lavapipe's submit probe: each read happens 1-4 µs into a 25-35 µs bracket, so every midpoint is
    // ~12 µs late. The fit cannot see it; the brackets' agreement can.
    let mut pair = pair(SimClockConfig::default());
    let mut history = CalibrationHistory::new(pair.domain(), HistoryConfig::default());
    let mut rng = crate::calibration::SplitMix64(3);
    for _ in 0..24 {
        let burst: Vec<CalibrationSample> = (0..16)
            .map(|_| {
                let t = pair.now_ns();
                let before = t - 1_000 - rng.next_u64() % 3_000;
                let after = t + 24_000 + rng.next_u64() % 10_000;
                pair.advance_by(40_000);
                CalibrationSample {
                    source_ticks: pair.true_ticks_at(t),
                    reference_ns: (before + after) / 2,
                    max_deviation_ns: (after - before).div_ceil(2),
                }
            })
            .collect();
        history.add_burst(&burst).unwrap();
        pair.advance_by(250_000_000);
    }
    for back_ms in [3_000u64, 1_000, 0] {
        let t = pair.now_ns() - back_ms * 1_000_000;
        let c = history.convert(pair.true_ticks_at(t)).unwrap();
        let error = c.ns.abs_diff(t);
        assert!(error > 5_000, "the bias is real: {error} ns");
        assert!(
            error <= c.uncertainty_ns,
            "{error} ns off, {} ns stated",
            c.uncertainty_ns
        );
    }
}

#[test]
fn output_is_monotonic_across_refits() {
    let mut p = pair(SimClockConfig {
        drift_ppm: -150.0,
        jitter_ns: 2_000.0,
        seed: 3,
        ..Default::default()
    });
    let mut h = CalibrationHistory::new(p.domain(), HistoryConfig::default());
    let mut last = 0;
    for _ in 0..200 {
        let burst: Vec<_> = (0..8).map(|_| p.sample()).collect();
        let _ = h.add_burst(&burst);
        for _ in 0..20 {
            let next = p.now_ns() + 1_000_000;
            p.advance_to(next);
            let now_ticks = p.true_ticks_at(p.now_ns());
            if let Some(c) = h.convert(now_ticks) {
                assert!(c.ns >= last, "went back from {last} to {}", c.ns);
                last = c.ns;
            }
        }
    }
}

#[test]
fn wrapping_36_bit_counter_converts_across_the_wrap() {
    // 2^36 ns is about 68.7 s: run long enough to wrap twice.
    let mut p = pair(SimClockConfig {
        valid_bits: 36,
        drift_ppm: 50.0,
        jitter_ns: 200.0,
        ..Default::default()
    });
    let mut h = run(&mut p, HistoryConfig::default(), 700, 200_000_000);
    // 36 bits of 1 ns wrap every 68.7 s: a tick is unambiguous within half of that from the newest sample.
    let mut t = p.now_ns() - 30_000_000_000;
    while t < p.now_ns() - 1_000_000_000 {
        let got = h.convert(p.true_ticks_at(t)).unwrap();
        assert!(got.ns.abs_diff(t) < 100, "at {t}: {got:?}");
        t += 333_333_333;
    }
}

#[test]
fn memory_stays_bounded_and_old_times_still_convert() {
    let config = HistoryConfig {
        max_knots: 64,
        ..HistoryConfig::default()
    };
    let mut p = pair(SimClockConfig {
        drift_ppm: 30.0,
        jitter_ns: 100.0,
        ..Default::default()
    });
    let start = p.now_ns();
    let mut h = run(&mut p, config, 1_000, 100_000_000);
    assert!(h.stats().knots <= 64);
    assert!(h.segments.iter().all(|s| s.window.len() <= config.window_bursts));
    let t = start + 10_000_000_000;
    let got = h.convert(p.true_ticks_at(t)).unwrap();
    assert!(got.ns.abs_diff(t) < 100, "{got:?} vs {t}");
}

#[test]
fn early_bursts_use_the_nominal_rate() {
    let mut p = pair(SimClockConfig {
        drift_ppm: 100.0,
        jitter_ns: 1_000.0,
        ..Default::default()
    });
    let mut h = run(&mut p, HistoryConfig::default(), 1, 0);
    let latest = h.latest().unwrap();
    assert!(latest.drift_ppm().abs() < 1e-6, "{}", latest.drift_ppm());
    // One burst: extrapolating 1 ms ahead is off by the 100 ppm the nominal rate misses, and says so.
    let t = p.now_ns() + 1_000_000;
    let got = h.convert(p.true_ticks_at(t)).unwrap();
    assert!(got.ns.abs_diff(t) <= got.uncertainty_ns, "{got:?} vs {t}");
}

/// A device clock of the tests' own: `rate` ticks per ns from `start`, plus jumps and rate steps.
struct Clock {
    start_ns: u64,
    start_ticks: f64,
    ppm: f64,
    /// `(reference ns, ns the clock jumps by)`.
    jumps: Vec<(u64, f64)>,
    /// `(reference ns, new ppm)`.
    steps: Vec<(u64, f64)>,
    /// The counter changes every this many ticks.
    resolution: f64,
}

impl Clock {
    fn new(ppm: f64) -> Self {
        Clock {
            start_ns: 1_000_000_000,
            start_ticks: 9e12,
            ppm,
            jumps: Vec::new(),
            steps: Vec::new(),
            resolution: 1.0,
        }
    }

    fn ticks(&self, t: u64) -> u64 {
        let mut ticks = self.start_ticks;
        let (mut from, mut ppm) = (self.start_ns, self.ppm);
        for &(at, next) in &self.steps {
            if at >= t {
                break;
            }
            ticks += (at - from) as f64 * (1.0 + ppm * 1e-6);
            (from, ppm) = (at, next);
        }
        ticks += (t - from) as f64 * (1.0 + ppm * 1e-6);
        ticks += self.jumps.iter().filter(|j| j.0 <= t).map(|j| j.1).sum::<f64>();
        ((ticks / self.resolution).floor() * self.resolution) as u64
    }

    /// A burst of 16 samples at `t`, brackets 200-1200 ns wide, the read anywhere inside.
    fn burst(&self, t: u64, rng: &mut crate::calibration::SplitMix64) -> Vec<CalibrationSample> {
        (0..16u64)
            .map(|i| {
                // Reads at random phases: a counter coarser than its ticks is seen at every phase.
                let read = t + i * 3_000 + rng.next_u64() % 1_000;
                let width = 200 + rng.next_u64() % 1_000;
                let before = read - rng.next_u64() % (width + 1);
                CalibrationSample::from_bracket(self.ticks(read), before, before + width)
            })
            .collect()
    }
}

fn feed(history: &mut CalibrationHistory, clock: &Clock, from: u64, to: u64, period: u64, seed: u64) {
    let mut rng = crate::calibration::SplitMix64(seed);
    let mut t = from;
    while t < to {
        let _ = history.add_burst(&clock.burst(t, &mut rng));
        t += period;
    }
}

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

#[test]
fn a_jump_starts_a_segment_and_never_bends_the_map_before_it() {
    let mut clock = Clock::new(80.0);
    let jump_at = clock.start_ns + 10 * S + 100 * MS;
    clock.jumps.push((jump_at, 2e6));
    let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
    feed(&mut history, &clock, clock.start_ns, jump_at, 250 * MS, 1);
    let before: Vec<(u64, Converted)> = (0..20)
        .map(|i| clock.start_ns + 6 * S + i * 200 * MS)
        .map(|t| (t, history.peek(clock.ticks(t)).unwrap()))
        .collect();
    feed(&mut history, &clock, jump_at + 150 * MS, jump_at + 5 * S, 250 * MS, 2);
    let stats = history.stats();
    assert_eq!((stats.breaks, stats.segments), (1, 2), "{stats:?}");
    for (t, was) in before {
        let now = history.peek(clock.ticks(t)).unwrap();
        assert!(now.ns.abs_diff(t) <= now.uncertainty_ns, "{t}: {now:?}");
        assert!(
            now.ns.abs_diff(was.ns) <= 2,
            "the map before the jump moved: {was:?} -> {now:?}"
        );
    }
    // After it: the new segment, within its uncertainty.
    for i in 0..10 {
        let t = jump_at + 500 * MS + i * 300 * MS;
        let p = history.place(clock.ticks(t), None).unwrap();
        assert!(!p.ambiguous && p.segment == 1, "{p:?}");
        assert!(p.converted.ns.abs_diff(t) <= p.converted.uncertainty_ns, "{t}: {p:?}");
    }
    // Between the last burst before it and the first after: either side; the window decides.
    let t = jump_at + 20 * MS;
    let ticks = clock.ticks(t);
    let open = history.place(ticks, None).unwrap();
    assert!(open.ambiguous, "{open:?}");
    assert!(open.converted.ns.abs_diff(t) <= open.converted.uncertainty_ns);
    let windowed = history.place(ticks, Some((t - 500_000, t + 500_000))).unwrap();
    assert!(!windowed.ambiguous && windowed.segment == 1, "{windowed:?}");
    assert!(windowed.converted.ns.abs_diff(t) <= windowed.converted.uncertainty_ns);
    assert!(windowed.converted.uncertainty_ns < 1_000, "{windowed:?}");
}

#[test]
fn after_a_backwards_jump_one_tick_value_is_placed_by_its_window() {
    let mut clock = Clock::new(-40.0);
    let jump_at = clock.start_ns + 8 * S + 60 * MS;
    clock.jumps.push((jump_at, -2e6));
    let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
    feed(&mut history, &clock, clock.start_ns, jump_at + 4 * S, 250 * MS, 3);
    assert_eq!(history.stats().breaks, 1);
    // The same tick values (within the 80 ns the rate makes of 2 ms) 1 ms before the jump and 1 ms after.
    let early = jump_at - MS;
    let late = early + 2 * MS;
    assert!(clock.ticks(late).abs_diff(clock.ticks(early)) < 100);
    for t in [early, late] {
        let p = history.place(clock.ticks(t), Some((t - 300_000, t + 300_000))).unwrap();
        assert!(p.converted.ns.abs_diff(t) <= p.converted.uncertainty_ns, "{t}: {p:?}");
        assert!(p.converted.uncertainty_ns < 1_000, "{p:?}");
    }
}

#[test]
fn a_rate_step_is_detected_and_the_burst_before_it_moves_after_the_break() {
    let mut clock = Clock::new(80.0);
    let step_at = clock.start_ns + 9 * S + 240 * MS;
    clock.steps.push((step_at, 110.0));
    let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
    feed(&mut history, &clock, clock.start_ns, step_at + 5 * S, 250 * MS, 4);
    let stats = history.stats();
    assert_eq!(stats.breaks, 1, "{stats:?}");
    assert!((stats.drift_ppm - 110.0).abs() < 0.5, "{stats:?}");
    // Before the step the map is the old rate's, unbent; across it, honest.
    let mut t = step_at - 3 * S;
    while t < step_at + 3 * S {
        let c = history.peek(clock.ticks(t)).unwrap();
        assert!(
            c.ns.abs_diff(t) <= c.uncertainty_ns,
            "{} ms from the step: {c:?}",
            (t as i64 - step_at as i64) / 1_000_000
        );
        if t + 300 * MS < step_at {
            assert!(c.ns.abs_diff(t) < 100, "{t}: {c:?}");
        }
        t += 7 * MS;
    }
}

#[test]
fn a_reported_reset_starts_a_segment_whatever_the_samples_say() {
    let clock = Clock::new(10.0);
    let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
    feed(
        &mut history,
        &clock,
        clock.start_ns,
        clock.start_ns + 2 * S,
        250 * MS,
        5,
    );
    let before = history.current_segment();
    history.report_reset();
    feed(
        &mut history,
        &clock,
        clock.start_ns + 2 * S,
        clock.start_ns + 3 * S,
        250 * MS,
        6,
    );
    assert_ne!(history.current_segment(), before);
    let stats = history.stats();
    assert_eq!((stats.resets, stats.breaks, stats.segments), (1, 0, 2));
}

#[test]
fn a_coarse_counter_is_unbiased_and_its_resolution_is_stated() {
    // 1 ns ticks that change every microsecond (%globaltimer on some GPUs).
    let mut clock = Clock::new(30.0);
    clock.resolution = 1_000.0;
    let domain = ClockDomain::new(64, 1.0).unwrap().with_resolution_ns(1_000.0).unwrap();
    let mut history = CalibrationHistory::new(domain, HistoryConfig::default());
    feed(
        &mut history,
        &clock,
        clock.start_ns,
        clock.start_ns + 20 * S,
        250 * MS,
        7,
    );
    assert!(
        history.stats().max_deviation_ns >= 500,
        "brackets widened by half the resolution"
    );
    let (mut sum, mut n, mut inside) = (0i64, 0i64, 0);
    let mut t = clock.start_ns + 5 * S + 17;
    while t < clock.start_ns + 19 * S {
        let c = history.peek(clock.ticks(t)).unwrap();
        sum += c.ns as i64 - t as i64;
        n += 1;
        inside += usize::from(c.ns.abs_diff(t) <= c.uncertainty_ns);
        assert!(c.uncertainty_ns >= 500, "{c:?}");
        t += 1_234_567;
    }
    let mean = sum / n;
    assert!(mean.abs() < 60, "placed {mean} ns off on average");
    assert_eq!(inside as i64, n);
}

#[test]
fn the_wander_is_measured_not_assumed() {
    for (wander, lo, hi) in [(0.0, 0.0, 0.2), (0.05, 0.0, 0.2), (1.0, 0.5, 3.0)] {
        let mut p = SimClockPair::new(SimClockConfig {
            drift_ppm: 200.0,
            wander_ppm_per_sqrt_s: wander,
            jitter_ns: 1_000.0,
            seed: 7,
            ..Default::default()
        })
        .unwrap();
        let h = run(&mut p, HistoryConfig::default(), 200, 250_000_000);
        let stats = h.stats();
        assert!(
            (lo..=hi).contains(&stats.wander_ppm_per_sqrt_s),
            "true {wander}: {stats:?}"
        );
        assert_eq!(stats.breaks, 0, "wander is no break: {stats:?}");
        if wander > 0.5 {
            assert!(
                stats.window_bursts < 8,
                "a shorter window for a wandering clock: {stats:?}"
            );
        }
    }
}

/// Honest brackets that lean one way with a spread of widths (the read 0-200 ns after the bracket opens, the
/// bracket closing 0-20 µs after it): every burst point and every fit through them is late by a random share
/// of the tightest widths, which the fit's residuals do not show. Converted one burst after the event (the
/// GPU path's wait), the truth must lie inside the stated uncertainty in every second, not only on average.
#[test]
fn one_sided_brackets_of_varied_width_are_covered_in_every_second() {
    let clock = Clock::new(150.0);
    for seed in 1..=4u64 {
        let mut rng = crate::calibration::SplitMix64(seed);
        let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
        let mut per_second: std::collections::BTreeMap<u64, (u32, u32)> = Default::default();
        let mut previous = None;
        let mut t = clock.start_ns;
        while t < clock.start_ns + 60 * S {
            let burst: Vec<CalibrationSample> = (0..16u64)
                .map(|i| {
                    let read = t + i * 3_000;
                    let before = read - rng.next_u64() % 200;
                    let after = read + rng.next_u64() % 20_000;
                    CalibrationSample::from_bracket(clock.ticks(read), before, after)
                })
                .collect();
            let _ = history.add_burst(&burst);
            if let Some(from) = previous {
                let mut event = from + 100_000;
                while event < t {
                    let placed = history.place(clock.ticks(event), None).unwrap().converted;
                    let second = per_second.entry((event - clock.start_ns) / S).or_default();
                    second.0 += 1;
                    second.1 += u32::from(placed.ns.abs_diff(event) <= placed.uncertainty_ns);
                    event += 5 * MS;
                }
            }
            previous = Some(t);
            t += 250 * MS;
        }
        for (second, (events, inside)) in per_second {
            assert!(
                f64::from(inside) >= 0.95 * f64::from(events),
                "seed {seed}, second {second}: {inside} of {events} inside"
            );
        }
    }
}

/// A 64-bit counter with an epoch near the top of its range (a device counter's arbitrary start) wraps to 0
/// while the history runs: conversions stay right and monotonic across the wrap, and the newest fit given
/// out (`latest`) converts the source's own ticks. Counted past 2^64, every tick after the wrap came out as 0.
#[test]
fn a_64_bit_counter_wrapping_past_2_to_the_64_converts_across_the_wrap() {
    let start_ticks = u64::MAX - 30 * S; // wraps 30 s in
    let ticks_at = |t: u64| start_ticks.wrapping_add(t - S);
    let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
    let mut rng = crate::calibration::SplitMix64(5);
    let mut last_ns = 0;
    let mut t = S;
    while t < 61 * S {
        let burst: Vec<CalibrationSample> = (0..16u64)
            .map(|i| {
                let read = t + i * 3_000;
                let before = read - 100 - rng.next_u64() % 400;
                CalibrationSample::from_bracket(ticks_at(read), before, read + 100 + rng.next_u64() % 400)
            })
            .collect();
        history.add_burst(&burst).unwrap();
        let event = t + 100 * MS;
        let converted = history.convert(ticks_at(event)).unwrap();
        assert!(
            converted.ns.abs_diff(event) <= converted.uncertainty_ns,
            "at {:.2} s: {converted:?}",
            (event - S) as f64 / S as f64
        );
        assert!(converted.ns >= last_ns, "went back at {event}");
        last_ns = converted.ns;
        let latest = history.latest().unwrap();
        assert!(
            latest.to_reference_ns(ticks_at(event)).abs_diff(event) < 1_000,
            "{latest:?}"
        );
        t += 250 * MS;
    }
    assert_eq!(history.stats().breaks, 0);
    // Before the wrap, two-sided now.
    let before_wrap = S + 20 * S;
    assert!(history.peek(ticks_at(before_wrap)).unwrap().ns.abs_diff(before_wrap) < 500);
    assert!(
        history.newest_knot_ticks().unwrap() < 40 * S,
        "in the source's ticks, after the wrap"
    );
}

/// Bursts seconds apart at irregular gaps (a backend calibrating only now and then) still measure the wander:
/// the second differences take the points as far apart as the bursts are, with the exact variance of an
/// unequal triple. Only triples about 2 s apart and within 0.5 s of equal counted, so such a history kept the
/// prior (0.05 ppm/√s) for a clock wandering 20-100 times more.
#[test]
fn the_wander_is_measured_from_sparse_irregular_bursts() {
    for (wander, lo, hi) in [(0.05, 0.0, 0.3), (1.0, 0.5, 3.0), (5.0, 2.5, 15.0)] {
        let mut p = SimClockPair::new(SimClockConfig {
            drift_ppm: 100.0,
            wander_ppm_per_sqrt_s: wander,
            jitter_ns: 200.0,
            seed: 11,
            ..Default::default()
        })
        .unwrap();
        let mut h = CalibrationHistory::new(p.domain(), HistoryConfig::default());
        let mut rng = crate::calibration::SplitMix64(3);
        for _ in 0..120 {
            let burst: Vec<_> = (0..16)
                .map(|_| {
                    let s = p.sample();
                    let next = p.now_ns() + 3_000;
                    p.advance_to(next);
                    s
                })
                .collect();
            let _ = h.add_burst(&burst);
            let next = p.now_ns() + 2 * S + rng.next_u64() % (8 * S);
            p.advance_to(next);
        }
        let measured = h.stats().wander_ppm_per_sqrt_s;
        assert!((lo..=hi).contains(&measured), "true {wander}: measured {measured}");
    }
}

/// Live conversions (the newest fit extrapolated, as a CPU timestamp is converted while the program runs) of a
/// clock wandering 20 times the prior: once the wander has been measured (from 5 s on), at least 95 % of the
/// truths lie inside the stated uncertainty in every second of every run. Before, 3 of 40 runs had a second
/// with 83-94 % inside: the first estimates stand on two or three independent triples of burst points and were
/// stated at 1.4 x the estimate, and the fitted rate's miss of the newest rate went unstated.
#[test]
fn live_conversions_of_a_clock_wandering_20x_the_prior_hold_in_every_second() {
    let mut failing = Vec::new();
    for seed in 1..=40u64 {
        let mut p = pair(SimClockConfig {
            drift_ppm: 200.0,
            wander_ppm_per_sqrt_s: 1.0,
            jitter_ns: 1_000.0,
            seed,
            ..Default::default()
        });
        let mut h = CalibrationHistory::new(p.domain(), HistoryConfig::default());
        let start = p.now_ns();
        let mut per_second: std::collections::BTreeMap<u64, (u32, u32)> = Default::default();
        let mut rng = crate::calibration::SplitMix64(seed);
        while p.now_ns() < start + 20 * S {
            let _ = h.add_burst(&p.sample_burst(16, 3_000));
            let (from, to) = (p.now_ns(), p.now_ns() + 250 * MS);
            let mut events: Vec<u64> = (0..50).map(|_| from + rng.next_u64() % (to - from)).collect();
            events.sort_unstable();
            for t in events {
                let placed = h.convert_within(p.true_ticks_at(t), None).unwrap().converted;
                let second = per_second.entry((t - start) / S).or_default();
                second.0 += 1;
                second.1 += u32::from(placed.ns.abs_diff(t) <= placed.uncertainty_ns);
            }
            p.advance_to(to);
        }
        for (second, (events, inside)) in per_second.range(5..) {
            if f64::from(*inside) < 0.95 * f64::from(*events) {
                failing.push(format!("seed {seed}, second {second}: {inside} of {events} inside"));
            }
        }
    }
    assert!(failing.is_empty(), "{failing:#?}");
}

/// A burst of 8 exact reads 2 µs apart from `at`, each bracketed ±20 ns, of a clock whose count at reference
/// time `t` is `ticks_at(t)`.
fn exact_burst(ticks_at: &impl Fn(u64) -> u64, at: u64) -> Vec<CalibrationSample> {
    (0..8u64)
        .map(|i| CalibrationSample {
            source_ticks: ticks_at(at + i * 2_000),
            reference_ns: at + i * 2_000,
            max_deviation_ns: 20,
        })
        .collect()
}

/// A noise-free clock of its own (not the simulator): 1 GHz nominal, `drift_ppm` off it, and `jump_ns` added to
/// its count from reference time `jump_at_ns` on. Bursts of 8 samples bracketed ±20 ns every 250 ms for 60 s;
/// returns the history, the breaks it found, and how many of the ticks 100 ms after each burst, converted then
/// (before the next burst), lay inside their stated uncertainty.
fn drifting_clock_with_a_jump(
    drift_ppm: f64,
    jump_at_ns: u64,
    jump_ns: u64,
) -> (CalibrationHistory, u64, usize, usize) {
    let start = 1_000_000_000u64;
    let ticks_at = |t: u64| -> u64 {
        let ticks = ((t - start) as f64 * (1.0 + drift_ppm * 1e-6)).round() as u64 + 5_000_000;
        ticks + if t >= jump_at_ns { jump_ns } else { 0 }
    };
    let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
    let (mut inside, mut converted) = (0, 0);
    for k in 0..240u64 {
        let at = start + k * 250_000_000;
        history.add_burst(&exact_burst(&ticks_at, at)).unwrap();
        let probe = at + 100_000_000;
        if let Some(got) = history.peek(ticks_at(probe)) {
            converted += 1;
            inside += usize::from(got.ns.abs_diff(probe) <= got.uncertainty_ns);
        }
    }
    let breaks = history.stats().breaks;
    (history, breaks, inside, converted)
}

/// A break found before the open segment fitted a rate of its own (a jump 200 ms after the first burst) must
/// not make every later burst a break: the new segment used to carry the nominal rate on with the break's
/// tight 50 ppm, so a clock 400 ppm off nominal missed each next prediction (239 breaks in 240 bursts, 1 of 239
/// conversions inside). And a nominal rate thousands of ppm off costs one break, not one per burst.
#[test]
fn a_break_before_any_rate_was_fitted_does_not_make_every_later_burst_a_break() {
    for (drift_ppm, jump_ns) in [(400.0, 2_000_000), (-400.0, 2_000_000), (3_000.0, 0), (-10_000.0, 0)] {
        let jump_at = if jump_ns > 0 { 1_200_000_000 } else { u64::MAX };
        let (mut history, breaks, inside, converted) = drifting_clock_with_a_jump(drift_ppm, jump_at, jump_ns);
        // Each break before a rate was fitted loosens the prior fourfold: 10,000 ppm off takes two.
        let allowed = if drift_ppm.abs() > 5_000.0 { 2 } else { 1 };
        assert!(breaks <= allowed, "{drift_ppm} ppm, jump {jump_ns}: {breaks} breaks");
        assert!(
            (history.stats().drift_ppm - drift_ppm).abs() < 1.0,
            "{:?}",
            history.stats()
        );
        assert!(
            inside + 3 >= converted,
            "{drift_ppm} ppm: {inside} of {converted} inside"
        );
        // Long after: exact, and known to be.
        let t = 1_000_000_000u64 + 50_100_000_000;
        let ticks = ((t - 1_000_000_000) as f64 * (1.0 + drift_ppm * 1e-6)).round() as u64 + 5_000_000 + jump_ns;
        let got = history.convert(ticks).unwrap();
        assert!(
            got.ns.abs_diff(t) <= got.uncertainty_ns && got.uncertainty_ns < 1_000,
            "{got:?}"
        );
    }
}

/// Bursts at the extremes of the reference and tick ranges (and deviations of `u64::MAX`) never panic, also in
/// debug builds, where an overflowing add would: the reference near `u64::MAX` used to.
#[test]
fn samples_at_the_extremes_never_panic() {
    let sample = |source_ticks, reference_ns, max_deviation_ns| CalibrationSample {
        source_ticks,
        reference_ns,
        max_deviation_ns,
    };
    let bursts: [Vec<CalibrationSample>; 4] = [
        (0..16).map(|i| sample(1_000 + i, u64::MAX - i, 1)).collect(),
        (0..16).map(|i| sample(1_000 + i, 1_000_000 + i, u64::MAX)).collect(),
        (0..16).map(|i| sample(u64::MAX - i, 1_000_000 + i, 1)).collect(),
        (0..16).map(|i| sample(u64::MAX - i, u64::MAX - i, u64::MAX)).collect(),
    ];
    for burst in &bursts {
        let mut h = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
        for _ in 0..3 {
            let _ = h.add_burst(burst);
        }
        for ticks in [0, 1_000, burst[0].source_ticks, u64::MAX] {
            let _ = h.convert(ticks);
            let _ = h.place(ticks, None);
        }
    }
}

/// After a reset to a lower count (a counter restarting at 0 at 30 s), the old segment's ticks keep their
/// conversion: the new count reaches their values only by extrapolating forward far past its newest burst,
/// which no tick converted now can be. They used to become the hull of both answers (±30 s for a 1 GHz count
/// at 30 s, days for a TSC-like one), ambiguous and never final. A tick whose value the new count passes now is
/// genuinely either, and stays ambiguous. Noise-free clock of the test's own: 1 GHz, +100 ppm.
#[test]
fn after_a_reset_to_a_lower_count_old_ticks_keep_their_conversion() {
    let (start, reset_at) = (1_000_000_000u64, 31_000_000_000u64);
    let ticks_at = |t: u64| -> u64 {
        let from = if t >= reset_at { reset_at } else { start };
        ((t - from) as f64 * 1.0001).round() as u64
    };
    let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), HistoryConfig::default());
    let mut at = start;
    let mut add = |history: &mut CalibrationHistory, until: u64| {
        while at < until {
            history.add_burst(&exact_burst(&ticks_at, at)).unwrap();
            at += 250_000_000;
        }
    };
    // Old ticks whose counts the new count reaches only seconds or more ahead of its newest burst.
    for (after, old) in [
        (31_500_000_000u64, [15_000_000_000u64, 29_500_000_000]),
        (45_000_000_000, [25_000_000_000, 29_500_000_000]),
    ] {
        add(&mut history, after);
        assert_eq!(history.stats().segments, 2, "{:?}", history.stats());
        for t in old {
            let placed = history.place(ticks_at(t), None).unwrap();
            assert!(!placed.ambiguous, "t={t} after {after}: {placed:?}");
            assert!(
                placed.converted.ns.abs_diff(t) <= placed.converted.uncertainty_ns,
                "{placed:?}"
            );
            assert!(placed.converted.uncertainty_ns < 1_000, "{placed:?}");
            assert!(history.is_bracketed(ticks_at(t)));
        }
    }
    // At 45 s the new count is 14 s in: an old tick of 15 s (count 14 s) has the value of a tick of now.
    let placed = history.place(ticks_at(15_000_000_000), None).unwrap();
    assert!(placed.ambiguous, "{placed:?}");
}

/// Setting the wander prior near what the clock does, as its docs advise, converts about as well as leaving
/// the default prior for the estimate to outgrow. It kept the full 16-burst window instead (the window only
/// shortened for wander beyond twice the prior) and converted about ten times worse (p50 273 against 34 ns at 1
/// ppm/√s in the audit). The clock is the test's own: a rate random-walking 1 ppm/√s in 1 ms steps, bursts of
/// 8 reads every 250 ms, each read somewhere in a ±20 ns bracket.
#[test]
fn a_wander_prior_set_to_the_clock_s_wander_converts_as_well_as_the_default() {
    // The truth: ticks (1 GHz nominal) at each ms of reference time.
    let (step_ns, steps) = (1_000_000u64, 60_000usize);
    let mut rate_ppm = 30.0f64;
    let mut ticks = Vec::with_capacity(steps + 1);
    let mut count = 1_000_000f64;
    let mut rng = crate::calibration::SplitMix64(7);
    let mut uniform = move || rng.uniform();
    for _ in 0..=steps {
        ticks.push(count);
        // A normal step from twelve uniforms: 1 ppm/√s over 1 ms.
        let normal: f64 = (0..12).map(|_| uniform()).sum::<f64>() - 6.0;
        rate_ppm += normal * 1.0 * (1e-3f64).sqrt();
        count += step_ns as f64 * (1.0 + rate_ppm * 1e-6);
    }
    let start = 1_000_000_000u64;
    let ticks_at = |t: u64| -> u64 {
        let i = ((t - start) / step_ns) as usize;
        let frac = ((t - start) % step_ns) as f64 / step_ns as f64;
        (ticks[i] + (ticks[i + 1] - ticks[i]) * frac).round() as u64
    };
    let mut bursts = Vec::new();
    let mut at = start;
    while at + 300_000_000 < start + steps as u64 * step_ns {
        let burst: Vec<_> = (0..8u64)
            .map(|k| {
                let read = at + k * 3_000;
                // The read lies anywhere within ±20 ns of the bracket's middle.
                let middle = (read as f64 + (uniform() - 0.5) * 40.0) as u64;
                CalibrationSample {
                    source_ticks: ticks_at(read),
                    reference_ns: middle,
                    max_deviation_ns: 20,
                }
            })
            .collect();
        bursts.push(burst);
        at += 250_000_000;
    }
    let errors = |prior: f64| {
        let config = HistoryConfig {
            wander_ppm_per_sqrt_s: prior,
            ..HistoryConfig::default()
        };
        let mut history = CalibrationHistory::new(ClockDomain::new(64, 1.0).unwrap(), config);
        for burst in &bursts {
            history.add_burst(burst).unwrap();
        }
        let (mut errors, mut inside) = (Vec::new(), 0);
        let mut t = start + 10_000_000_000;
        while t < start + 55_000_000_000 {
            let got = history.peek(ticks_at(t)).unwrap();
            errors.push(got.ns.abs_diff(t));
            inside += usize::from(got.ns.abs_diff(t) <= got.uncertainty_ns);
            t += 10_000_000;
        }
        errors.sort_unstable();
        (errors[errors.len() / 2], inside as f64 / errors.len() as f64)
    };
    let (default_p50, default_inside) = errors(HistoryConfig::default().wander_ppm_per_sqrt_s);
    let (told_p50, told_inside) = errors(1.0);
    eprintln!(
        "p50: default prior {default_p50} ns, prior 1 ppm/√s {told_p50} ns; inside {default_inside} / {told_inside}"
    );
    assert!(
        told_p50 <= default_p50 * 3 / 2 + 10,
        "prior 1: p50 {told_p50} ns, default {default_p50} ns"
    );
    assert!(
        default_inside >= 0.95 && told_inside >= 0.95,
        "{default_inside} {told_inside}"
    );
}

/// A counter narrower than the fit's window (30 bits of 1 ns ticks wrap every 1.07 s; a window of 16 bursts
/// spans 4 s): each burst lies more than half a wrap past the fit's anchor, which the short way round took for a
/// jump (a break every 0.8 s in the GPU audit, a quarter of the slices marked). Steady +40 ppm clock of the
/// test's own; every burst is predicted right, and ticks read since the newest burst convert right.
#[test]
fn a_counter_that_wraps_within_the_window_is_no_break() {
    for bits in [29u32, 30, 31, 32] {
        let mask = (1u64 << bits) - 1;
        let start = 1_000_000_000u64;
        let ticks_at = |t: u64| -> u64 { (((t - start) as f64 * 1.00004).round() as u64 + 123_456) & mask };
        let mut history = CalibrationHistory::new(ClockDomain::new(bits, 1.0).unwrap(), HistoryConfig::default());
        let (mut inside, mut total) = (0, 0);
        for k in 0..120u64 {
            let at = start + k * 250_000_000;
            history.add_burst(&exact_burst(&ticks_at, at)).unwrap();
            for probe in [at + 50_000_000, at + 200_000_000] {
                let got = history.peek(ticks_at(probe)).unwrap();
                total += 1;
                inside += usize::from(got.ns.abs_diff(probe) <= got.uncertainty_ns && got.uncertainty_ns < 10_000);
            }
        }
        assert_eq!(history.stats().breaks, 0, "{bits} bits: {:?}", history.stats());
        assert!(inside + 2 >= total, "{bits} bits: {inside} of {total} inside and tight");
    }
}

#[test]
fn absurd_domains_and_samples_never_panic() {
    // Any finite positive period is a valid domain, and a burst may hold any values (a corrupt capture's): the
    // history answers with an error or a saturated time, never an arithmetic overflow. A period of 1e20 ns per
    // tick with samples near the end of the u64 range overflowed the bracket and refit origins (debug builds).
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for case in 0..1_000 {
        let bits = [1u32, 2, 36, 48, 63, 64][(next() % 6) as usize];
        let period = [1e20, 1e30, 1e300, 1e-300, 1.0, 0.4][(next() % 6) as usize];
        let domain = ClockDomain::new(bits, period).unwrap();
        let mut h = CalibrationHistory::new(domain, HistoryConfig::default());
        let base_ticks = [0, u64::MAX - 1_000_000, next(), 1 << 62][(next() % 4) as usize];
        let base_ns = [0, u64::MAX - 1_000_000, next() >> 1, 1_000_000_000][(next() % 4) as usize];
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for b in 0..20u64 {
                let burst: Vec<_> = (0..next() % 20)
                    .map(|i| {
                        let mode = next() % 10;
                        let step = [1, 1_000, 1 << 40][(next() % 3) as usize];
                        CalibrationSample {
                            source_ticks: if mode == 0 {
                                next()
                            } else {
                                base_ticks.wrapping_add((b * 1_000 + i) * step)
                            },
                            reference_ns: if mode == 1 {
                                next()
                            } else {
                                base_ns.wrapping_add(b * 1_000 + i)
                            },
                            max_deviation_ns: [0, 1, 1_000, u64::MAX][(next() % 4) as usize],
                        }
                    })
                    .collect();
                let _ = h.add_burst(&burst);
                let ticks = if next() % 2 == 0 {
                    next()
                } else {
                    base_ticks.wrapping_add(b * 1_000)
                };
                let _ = h.convert(ticks);
                let _ = h.place(ticks, Some((next(), next())));
                let _ = h.stats();
                if let Some(c) = h.latest() {
                    let _ = (
                        c.to_reference_ns(next()),
                        c.from_reference_ns(next()),
                        c.uncertainty_ns(next()),
                    );
                    let _ = crate::clock::FastConverter::new(c).to_ns(next());
                }
                if next() % 7 == 0 {
                    h.report_reset();
                }
            }
        }));
        assert!(outcome.is_ok(), "case {case}: {bits} bits, {period} ns per tick");
    }
}
