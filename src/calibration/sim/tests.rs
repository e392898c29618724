use super::exact::{decompose, mul_pow2_div_floor};
use super::*;
use crate::calibration::CalibrationSample;

fn pair(config: SimClockConfig) -> SimClockPair {
    SimClockPair::new(config).unwrap()
}

#[test]
fn same_seed_same_samples_other_seed_differs() {
    let config = SimClockConfig::realistic(42).with_outliers(0.1, 10_000.0);
    let run = |config: SimClockConfig| {
        let mut p = pair(config);
        let mut out = p.sample_burst(500, 7_000_000);
        out.push(CalibrationSample {
            source_ticks: p.true_ticks_at(p.now_ns() + 1_234_567),
            reference_ns: p.true_reference_ns(12345),
            max_deviation_ns: p.true_drift_ppm_at(p.now_ns()).to_bits(),
        });
        out
    };
    let a = run(config);
    assert_eq!(a, run(config));
    let b = run(config.with_seed(43));
    assert_ne!(a, b);
    assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 10);
}

#[test]
fn walk_does_not_depend_on_when_knots_are_made() {
    let config = SimClockConfig::realistic(3).with_jitter_ns(0.0).with_outliers(0.0, 0.0);
    let mut early = pair(config);
    let _ = early.true_ticks_at(config.start_ns + 5_000_000_000); // generate the future first
    let mut late = pair(config);
    for i in 0..50u64 {
        let t = config.start_ns + i * 97_000_000;
        early.advance_to(t);
        late.advance_to(t);
        assert_eq!(early.sample(), late.sample());
        assert_eq!(early.true_drift_ppm_at(t), late.true_drift_ppm_at(t));
    }
}

#[test]
fn no_noise_samples_lie_on_the_linear_truth() {
    let config = SimClockConfig::default().with_drift_ppm(200.0);
    let mut p = pair(config);
    let start = p.now_ns();
    let s = p.sample();
    assert_eq!(
        s,
        CalibrationSample {
            source_ticks: start,
            reference_ns: start,
            max_deviation_ns: 0
        }
    );
    for i in 1..=10u64 {
        p.advance_to(start + i * 100_000_000);
        let s = p.sample();
        assert_eq!(s.reference_ns, p.now_ns());
        assert_eq!(s.max_deviation_ns, 0);
        let elapsed = p.now_ns() - start;
        let expected = start + elapsed + elapsed / 5_000; // 200 ppm
        assert!(
            s.source_ticks.abs_diff(expected) <= 1,
            "{} vs {expected}",
            s.source_ticks
        );
    }
    assert_eq!(p.now_ns(), start + 1_000_000_000);
    let advanced = p.true_ticks_at(p.now_ns()) - start;
    assert!(advanced.abs_diff(1_000_200_000) <= 1, "{advanced}");
    assert_eq!(p.true_drift_ppm_at(p.now_ns()), 200.0);
}

#[test]
fn offset_and_period_set_the_start() {
    let mut p = pair(SimClockConfig::default().with_offset_ns(-5_000));
    assert_eq!(p.true_ticks_at(p.now_ns()), 1_000_000_000 - 5_000);
    // 52.08 ns ticks (19.2 MHz), 2 µs ahead.
    let mut p = pair(SimClockConfig::default().with_offset_ns(2_000).with_ticks(52.08, 36));
    let expected = (1_000_002_000.0f64 / 52.08).floor() as u64;
    assert_eq!(p.true_ticks_at(p.now_ns()), expected);
    let later = p.true_ticks_at(p.now_ns() + 1_000_000_000);
    let expected = (2_000_002_000.0f64 / 52.08).floor() as u64;
    assert!(later.abs_diff(expected) <= 1);
    // A negative source time wraps around like a counter would.
    let mut p = pair(SimClockConfig::default().with_offset_ns(-1_000_000_010));
    assert_eq!(p.true_ticks_at(p.now_ns()), u64::MAX - 9);
    assert_eq!(p.true_ticks_at(p.now_ns() + 20), 10);
    let mut p = pair(
        SimClockConfig::default()
            .with_offset_ns(-1_000_000_010)
            .with_ticks(1.0, 36),
    );
    assert_eq!(p.true_ticks_at(p.now_ns()), (1u64 << 36) - 10);
}

#[test]
fn exact_at_1e18_ticks() {
    let mut p = pair(SimClockConfig::default().with_start_ns(1_000_000_000_000_000_000));
    let start = p.now_ns();
    assert_eq!(p.true_ticks_at(start + 123_456_789_012), start + 123_456_789_012);
    // Quarter-ns ticks: 4e18 ticks, exact.
    let mut p = pair(
        SimClockConfig::default()
            .with_start_ns(1_000_000_000_000_000_000)
            .with_ticks(0.25, 64),
    );
    assert_eq!(p.true_ticks_at(start + 777), 4 * (start + 777));
    // 200 ppm at 1e18: floor(1e9 * 1.0002 as f64 factor) exactly.
    let mut p = pair(
        SimClockConfig::default()
            .with_start_ns(1_000_000_000_000_000_000)
            .with_drift_ppm(200.0),
    );
    let factor = 1.0 + 200.0 * 1e-6;
    let (m, e) = decompose(factor);
    // 1e9 * m * 2^e, with e < 0: floor(1e9 * m / 2^-e).
    let expected = (1_000_000_000u128 * m as u128) >> (-e) as u32;
    assert_eq!(p.true_ticks_at(start + 1_000_000_000) - start, expected as u64);
    assert_eq!(expected, 1_000_199_999);
}

#[test]
fn wraps_at_36_bits_and_inverts() {
    for period in [1.0, 52.08, 0.3] {
        let wrap_ns = ((1u64 << 36) as f64 * period) as i64;
        // Start 1 ms of ticks before the wrap.
        let offset = wrap_ns - 1_000_000 - 1_000_000_000;
        let config = SimClockConfig::default()
            .with_ticks(period, 36)
            .with_offset_ns(offset)
            .with_drift_ppm(-37.0)
            .with_wander_ppm_per_sqrt_s(0.5)
            .with_seed(9);
        let mut p = pair(config);
        let start = p.now_ns();
        let mask = p.domain().mask();
        let first = p.true_ticks_at(start);
        assert!(first > mask - 4_000_000, "{first}");
        let mut wrapped = false;
        let mut previous = first;
        for i in 1..=3_000u64 {
            let t = start + i * 1_001;
            p.advance_to(t);
            let ticks = p.true_ticks_at(t);
            assert!(ticks <= mask);
            if ticks < previous {
                wrapped = true;
            }
            previous = ticks;
            let back = p.true_reference_ns(ticks);
            assert!(
                back <= t && (t - back) as f64 <= period + 1.0,
                "{period}: {t} -> {ticks} -> {back}"
            );
            assert_eq!(p.true_ticks_at(back) & mask, ticks, "period {period}");
        }
        assert!(wrapped, "period {period}");
        // Ticks from before the wrap still resolve to before the wrap (counting back from now).
        let back = p.true_reference_ns(first);
        assert_eq!(back, start);
        let mid = start + 1_500 * 1_001;
        let mid_ticks = p.true_ticks_at(mid);
        let back = p.true_reference_ns(mid_ticks);
        assert!(back <= mid && (mid - back) as f64 <= period + 1.0);
        // A tick not shown since the start saturates to the start.
        assert_eq!(p.true_reference_ns(first.wrapping_sub(10) & mask), start);
    }
}

#[test]
fn inverse_across_many_segments() {
    let config = SimClockConfig::realistic(11).with_wander_ppm_per_sqrt_s(3.0);
    let mut p = pair(config);
    p.advance_to(config.start_ns + 20_000_000_000);
    for i in 0..2_000u64 {
        let t = config.start_ns + i * 9_999_991 + 3;
        let ticks = p.true_ticks_at(t);
        let back = p.true_reference_ns(ticks);
        assert!(back <= t && t - back <= 1, "{t} {back}");
        assert_eq!(p.true_ticks_at(back), ticks);
    }
    // Before a given time.
    let t = config.start_ns + 5_000_000_123;
    let ticks = p.true_ticks_at(t);
    assert_eq!(p.true_reference_ns_before(ticks, t + 7), t);
}

#[test]
fn jittered_brackets_are_honest() {
    let jitter = 1_000.0;
    let mut p = pair(
        SimClockConfig::default()
            .with_jitter_ns(jitter)
            .with_drift_ppm(10.0)
            .with_seed(5),
    );
    let mut total = 0u64;
    let n = 10_000u64;
    for _ in 0..n {
        p.advance_by(1_000_000);
        let s = p.sample_with_truth();
        assert_eq!(s.true_ns, p.now_ns());
        assert!(!s.is_outlier());
        assert_eq!(s.sample.source_ticks, p.true_ticks_at(s.true_ns));
        let error = s.sample.reference_ns as i64 - s.true_ns as i64;
        assert_eq!(error, s.read_error_ns);
        assert!(error.unsigned_abs() <= s.sample.max_deviation_ns);
        assert!(s.sample.max_deviation_ns <= jitter as u64);
        total += s.sample.max_deviation_ns;
    }
    let mean = total as f64 / n as f64;
    assert!((mean - jitter / 2.0).abs() < 20.0, "{mean}");
}

#[test]
fn outliers_have_the_configured_fraction_and_size() {
    let config = SimClockConfig::default()
        .with_jitter_ns(300.0)
        .with_outliers(0.1, 50_000.0)
        .with_seed(77);
    let mut p = pair(config);
    let (mut outliers, mut positive) = (0u32, 0u32);
    let n = 10_000;
    for _ in 0..n {
        p.advance_by(10_000_000);
        let s = p.sample_with_truth();
        let error = s.sample.reference_ns as i64 - s.true_ns as i64;
        assert_eq!(error, s.read_error_ns + s.outlier_error_ns);
        assert!(s.read_error_ns.unsigned_abs() <= s.sample.max_deviation_ns);
        if s.is_outlier() {
            outliers += 1;
            assert_eq!(s.outlier_error_ns.abs(), 50_000);
            positive += (s.outlier_error_ns > 0) as u32;
            // Hidden: the bracket does not cover it.
            assert!(error.unsigned_abs() > s.sample.max_deviation_ns);
        }
    }
    let fraction = outliers as f64 / n as f64;
    assert!((fraction - 0.1).abs() < 0.015, "{fraction}");
    assert!(
        positive > outliers / 3 && positive < 2 * outliers / 3,
        "{positive}/{outliers}"
    );
    // Fractions 0 and 1.
    let mut all = pair(config.with_outliers(1.0, 7.0));
    assert!((0..100).all(|_| all.sample_with_truth().outlier_error_ns.abs() == 7));
    let mut none = pair(config.with_outliers(0.0, 7.0));
    assert!((0..100).all(|_| !none.sample_with_truth().is_outlier()));
}

#[test]
fn wander_walk_has_sqrt_time_spread() {
    let sigma = 0.1;
    let seeds = 40;
    let mut sum_sq = 0.0;
    for seed in 0..seeds {
        let config = SimClockConfig::default()
            .with_drift_ppm(20.0)
            .with_wander_ppm_per_sqrt_s(sigma)
            .with_seed(seed);
        let mut p = pair(config);
        let d = p.true_drift_ppm_at(config.start_ns + 100_000_000_000) - 20.0;
        sum_sq += d * d;
    }
    let std = (sum_sq / seeds as f64).sqrt();
    let expected = sigma * 100f64.sqrt();
    assert!(std > 0.6 * expected && std < 1.5 * expected, "{std} vs {expected}");
}

#[test]
fn piecewise_truth_is_the_sum_over_knots() {
    let config = SimClockConfig::default()
        .with_drift_ppm(-80.0)
        .with_wander_ppm_per_sqrt_s(5.0)
        .with_ticks(52.08, 64)
        .with_seed(21);
    let mut p = pair(config);
    let start = config.start_ns;
    let (t1, t2) = (start + 1_234_567_891, start + 61_987_654_321);
    p.advance_to(t2);
    let c1 = p.count_q64_at(t1);
    let c2 = p.count_q64_at(t2);
    // Exact: integrate the fixed-point rates segment by segment.
    let mut exact: u128 = 0;
    let mut approx = 0.0f64;
    let mut t = t1;
    while t < t2 {
        let j = p.segment_of(t);
        let end = (p.knot_time(j) + WANDER_STEP_NS).min(t2);
        exact += (end - t) as u128 * p.knots[j].rate_q64;
        approx += (end - t) as f64 * (1.0 + p.knots[j].drift_ppm * 1e-6) / 52.08;
        t = end;
    }
    assert_eq!(c2.wrapping_sub(c1), exact);
    let ticks = (p.true_ticks_at(t2) - p.true_ticks_at(t1)) as f64;
    assert!((ticks - approx).abs() <= 1.0 + 1e-6, "{ticks} vs {approx}");
    assert!((exact as f64 / 2f64.powi(64) - approx).abs() < 1e-4);
    // The walk moved the drift.
    assert_ne!(p.true_drift_ppm_at(t2), -80.0);
    assert_eq!(p.true_drift_ppm_at(start + 9_999_999), -80.0);
}

#[test]
fn invalid_configs_are_typed_errors() {
    let ok = SimClockConfig::default();
    let err = |c: SimClockConfig| SimClockPair::new(c).unwrap_err();
    assert_eq!(
        err(ok.with_ticks(1.0, 0)),
        CalibrationError::InvalidValidBits { bits: 0 }
    );
    assert_eq!(
        err(ok.with_ticks(1.0, 65)),
        CalibrationError::InvalidValidBits { bits: 65 }
    );
    for period in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-9, 1e12] {
        assert_eq!(
            err(ok.with_ticks(period, 64)),
            CalibrationError::InvalidPeriod,
            "{period}"
        );
    }
    let what = |c: SimClockConfig| match err(c) {
        CalibrationError::NonFinite { what } => what,
        other => panic!("{other:?}"),
    };
    for drift in [f64::NAN, f64::INFINITY, -1e6, 2e6] {
        assert_eq!(what(ok.with_drift_ppm(drift)), "drift_ppm");
    }
    assert_eq!(what(ok.with_wander_ppm_per_sqrt_s(-0.1)), "wander_ppm_per_sqrt_s");
    assert_eq!(what(ok.with_wander_ppm_per_sqrt_s(f64::NAN)), "wander_ppm_per_sqrt_s");
    assert_eq!(what(ok.with_jitter_ns(-1.0)), "jitter_ns");
    assert_eq!(what(ok.with_jitter_ns(f64::INFINITY)), "jitter_ns");
    for fraction in [-0.1, 1.1, f64::NAN] {
        assert_eq!(what(ok.with_outliers(fraction, 1.0)), "outlier_fraction");
    }
    assert_eq!(what(ok.with_outliers(0.5, -1.0)), "outlier_ns");
    assert_eq!(what(ok.with_outliers(0.5, f64::NAN)), "outlier_ns");
    // Edges that are fine.
    assert!(SimClockPair::new(ok.with_ticks(1e-3, 1).with_drift_ppm(1e6)).is_ok());
    assert!(SimClockPair::new(ok.with_ticks(1e9, 64).with_drift_ppm(-999_999.9)).is_ok());
    assert!(SimClockPair::new(ok.with_outliers(1.0, 0.0).with_offset_ns(i64::MIN).with_start_ns(0)).is_ok());
}

#[test]
fn extreme_but_valid_configs_do_not_panic() {
    let configs = [
        SimClockConfig::default()
            .with_start_ns(u64::MAX - 5)
            .with_offset_ns(i64::MAX),
        SimClockConfig::default()
            .with_start_ns(0)
            .with_offset_ns(i64::MIN)
            .with_ticks(1e-3, 64),
        SimClockConfig::default()
            .with_jitter_ns(1e300)
            .with_outliers(0.5, 1e300)
            .with_start_ns(0),
        SimClockConfig::default()
            .with_drift_ppm(-999_999.0)
            .with_wander_ppm_per_sqrt_s(1e6)
            .with_ticks(1e9, 1),
        SimClockConfig::default()
            .with_start_ns(u64::MAX - 25_000_000)
            .with_wander_ppm_per_sqrt_s(1.0),
    ];
    for config in configs {
        let mut p = pair(config);
        for step in [0, 1, 1_000, 15_000_000, 100_000_000] {
            p.advance_by(step);
            let s = p.sample_with_truth();
            let _ = p.true_reference_ns(s.sample.source_ticks);
            let _ = p.true_reference_ns(0);
            let _ = p.true_ticks_at(p.now_ns().saturating_add(1_000_000_000));
            let _ = p.true_drift_ppm_at(p.now_ns());
        }
    }
    // Far future without wander is O(1) and exact.
    let mut p = pair(SimClockConfig::default().with_start_ns(0));
    p.advance_to(u64::MAX);
    assert_eq!(p.true_ticks_at(u64::MAX), u64::MAX);
    assert_eq!(p.true_reference_ns(5), 5);
}

#[test]
fn time_only_moves_forward_and_the_past_saturates() {
    let config = SimClockConfig::default()
        .with_drift_ppm(100.0)
        .with_wander_ppm_per_sqrt_s(1.0);
    let mut p = pair(config);
    let start = config.start_ns;
    p.advance_to(start + 1_000_000);
    p.advance_to(start + 10);
    assert_eq!(p.now_ns(), start + 1_000_000);
    assert_eq!(p.true_ticks_at(0), p.true_ticks_at(start));
    assert_eq!(p.true_drift_ppm_at(0), 100.0);
    assert_eq!(p.true_reference_ns_before(0, 0), start);
}

#[test]
fn retention_drops_old_knots() {
    let config = SimClockConfig::default().with_wander_ppm_per_sqrt_s(1.0).with_seed(4);
    let mut kept = pair(config);
    let mut all = pair(config);
    kept.set_knot_retention_ns(Some(1_000_000_000));
    let start = config.start_ns;
    for i in 1..=600u64 {
        let t = start + i * 100_000_000;
        kept.advance_to(t);
        all.advance_to(t);
        assert_eq!(kept.sample(), all.sample());
    }
    assert_eq!(all.knot_count(), 6_001);
    assert!(kept.knot_count() <= 102, "{}", kept.knot_count());
    let now = kept.now_ns();
    let recent = now - 999_999_999;
    assert_eq!(kept.true_ticks_at(recent), all.true_ticks_at(recent));
    let ticks = all.true_ticks_at(recent);
    assert_eq!(kept.true_reference_ns(ticks), all.true_reference_ns(ticks));
    // Older than the window: saturates to the oldest kept knot.
    let oldest = kept.knot_time(0);
    assert!(oldest <= now - 1_000_000_000);
    assert_eq!(kept.true_ticks_at(start), all.true_ticks_at(oldest));
}

#[test]
fn ten_simulated_minutes_are_fast() {
    let started = std::time::Instant::now();
    let mut p = pair(SimClockConfig::realistic(1));
    let samples = p.sample_burst(6_001, 100_000_000);
    let elapsed = started.elapsed();
    assert_eq!(samples.len(), 6_001);
    assert_eq!(p.now_ns(), 1_000_000_000 + 600_000_000_000);
    assert_eq!(p.knot_count(), 60_001);
    assert!(elapsed.as_secs_f64() < 1.0, "{elapsed:?}");
}

#[test]
fn long_division_is_exact() {
    assert_eq!(mul_pow2_div_floor(10, 0, 3), (3, true));
    assert_eq!(mul_pow2_div_floor(9, 0, 3), (3, false));
    assert_eq!(mul_pow2_div_floor(1, 64, 1), (1u128 << 64, false));
    assert_eq!(mul_pow2_div_floor(1, 64, 3), ((1u128 << 64) / 3, true));
    assert_eq!(mul_pow2_div_floor(5, -1, 1), (2, true));
    assert_eq!(mul_pow2_div_floor(5, -200, 1), (0, true));
    // floor(2^130 / 3) = (2^130 - 1) / 3, whose low 128 bits are (2^128 - 1) / 3.
    assert_eq!(mul_pow2_div_floor(1, 130, 3), (u128::MAX / 3, true));
    assert_eq!(decompose(1.0), (1u64 << 52, -52));
    assert_eq!(decompose(0.25), (1u64 << 52, -54));
}
