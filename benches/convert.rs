//! Conversion and clock-read costs.
//!
//! * `ticks_to_ns`: one raw TSC tick to ns: tickline's [`FastConverter`] (u64 mult/shift/modulus), the exact
//!   Q64.64 path [`ClockCalibration::to_reference_ns`] (i128), quanta's `Clock::scaled` and
//!   `Clock::delta_as_nanos` (u128 mult/shift), and minstant's `Instant::as_unix_nanos` (f64). Every entry
//!   converts the same 4096 realistic ticks (from 1 s before the calibration's anchor to 60 s after it) and
//!   reports time per conversion.
//! * `clock_read`: reading a clock once.
//!
//! Run with `cargo bench --bench convert` (about 40 s).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tickline::{
    calibration::{ClockCalibration, ClockDomain},
    clock::FastConverter,
};

const N: usize = 4096;

/// A two-point TSC calibration over ~20 ms, anchored at its second point.
fn calibrate() -> ClockCalibration {
    let (t0, n0) = (tickline::clock::read_ticks().0, tickline::clock::monotonic_ns().0);
    std::thread::sleep(Duration::from_millis(20));
    let (t1, n1) = (tickline::clock::read_ticks().0, tickline::clock::monotonic_ns().0);
    let ns_per_tick = (n1 - n0) as f64 / (t1 - t0) as f64;
    ClockCalibration::from_anchor(ClockDomain::new(64, ns_per_tick).unwrap(), t1, n1, ns_per_tick).unwrap()
}

/// Ticks spread from 1 s before the anchor to 60 s after it (xorshift, fixed seed).
fn realistic_ticks(cal: &ClockCalibration) -> Vec<u64> {
    let ticks_per_s = (1e9 / cal.ns_per_tick()) as u64;
    let start = cal.anchor_ticks() - ticks_per_s;
    let span = 61 * ticks_per_s;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..N)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            start + x % span
        })
        .collect()
}

fn ticks_to_ns(c: &mut Criterion) {
    let cal = calibrate();
    let fast = FastConverter::new(&cal);
    let ticks = realistic_ticks(&cal);

    // Check before measuring: the fast path agrees with the exact one within its stated bound, and the
    // calibration tracks the reference clock.
    assert!(fast.worst_case_error_ns() <= 1, "{fast:?}");
    let mut off_by_one = 0;
    for &t in &ticks {
        let (f, e) = (fast.to_ns(t), cal.to_reference_ns(t));
        let bound = fast.max_error_ns(cal.ticks_from_anchor(t).unsigned_abs());
        assert!(f.abs_diff(e) <= bound, "ticks {t}: fast {f} exact {e} bound {bound}");
        off_by_one += f.abs_diff(e);
    }
    let mut out = vec![0u64; N];
    fast.convert_slice(&ticks, &mut out);
    assert!(out.iter().zip(&ticks).all(|(&ns, &t)| ns == fast.to_ns(t)));
    let drift = fast
        .to_ns(tickline::clock::read_ticks().0)
        .abs_diff(tickline::clock::monotonic_ns().0);
    assert!(drift < 50_000_000, "calibration {drift} ns off the reference clock");
    eprintln!(
        "ticks_to_ns: {:.4} ns/tick, fast vs exact: {off_by_one} of {N} differ by 1 ns, worst-case bound {} ns",
        cal.ns_per_tick(),
        fast.worst_case_error_ns()
    );

    let quanta = quanta::Clock::new();
    let raw_now = quanta.raw();
    assert!(quanta.scaled(raw_now) <= quanta.now());
    assert!(quanta.delta_as_nanos(0, ticks[0]) > 0);

    // minstant's Instant cannot be built from a raw count: make the same spread from a now() + durations.
    let anchor = minstant::Anchor::new();
    let base = minstant::Instant::now();
    let first = *ticks.iter().min().unwrap();
    let instants: Vec<minstant::Instant> = ticks.iter().map(|&t| base + Duration::from_nanos(t - first)).collect();
    assert!(instants[0].as_unix_nanos(&anchor) > 1_600_000_000_000_000_000);

    let mut group = c.benchmark_group("ticks_to_ns");
    group.throughput(Throughput::Elements(N as u64));
    group.bench_function("tickline_fast_to_ns", |b| {
        b.iter(|| {
            for &t in black_box(&ticks).iter() {
                black_box(fast.to_ns(t));
            }
        })
    });
    group.bench_function("tickline_fast_convert_slice", |b| {
        b.iter(|| fast.convert_slice(black_box(&ticks), black_box(&mut out)))
    });
    group.bench_function("tickline_exact_to_reference_ns", |b| {
        b.iter(|| {
            for &t in black_box(&ticks).iter() {
                black_box(cal.to_reference_ns(t));
            }
        })
    });
    group.bench_function("quanta_scaled", |b| {
        b.iter(|| {
            for &t in black_box(&ticks).iter() {
                black_box(quanta.scaled(t));
            }
        })
    });
    group.bench_function("quanta_delta_as_nanos", |b| {
        b.iter(|| {
            for &t in black_box(&ticks).iter() {
                black_box(quanta.delta_as_nanos(0, t));
            }
        })
    });
    group.bench_function("minstant_as_unix_nanos", |b| {
        b.iter(|| {
            for i in black_box(&instants).iter() {
                black_box(i.as_unix_nanos(&anchor));
            }
        })
    });
    group.finish();
}

fn clock_read(c: &mut Criterion) {
    let quanta = quanta::Clock::new();
    let t = tickline::clock::read_ticks();
    assert!(tickline::clock::read_ticks() >= t);
    assert!(tickline::clock::monotonic_ns().0 > 0);
    assert!(quanta.raw() > 0);
    let m = minstant::Instant::now();
    assert!(minstant::Instant::now() >= m);

    let mut group = c.benchmark_group("clock_read");
    group.throughput(Throughput::Elements(1));
    group.bench_function("tickline_read_ticks", |b| b.iter(tickline::clock::read_ticks));
    group.bench_function("tickline_monotonic_ns", |b| b.iter(tickline::clock::monotonic_ns));
    group.bench_function("std_instant_now", |b| b.iter(Instant::now));
    group.bench_function("quanta_raw", |b| b.iter(|| quanta.raw()));
    group.bench_function("quanta_now", |b| b.iter(|| quanta.now()));
    group.bench_function("minstant_now", |b| b.iter(minstant::Instant::now));
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    targets = ticks_to_ns, clock_read
}
criterion_main!(benches);
