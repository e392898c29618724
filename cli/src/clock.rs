//! `tickline clock`: how well this machine's CPU clock can be read and how accurately tickline converts it.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::json;
use tickline::{
    calibration::CalibrationSample,
    clock::{
        bracketed_sample, check_independent_reference, monotonic_ns, monotonic_raw_ns, IndependentCheck, Nanos,
        PassSummary, RawTicks, TickSource, TickSourceDecision, TscCalibrator, TscCalibratorConfig, TscDecider,
        TscDecision, TscReport,
    },
};

/// The report as JSON, for `tickline clock --json` and for logs. Non-finite numbers become `null`.
pub fn report_json(this: &TscReport) -> serde_json::Value {
    let (decision, reason) = match &this.decision {
        TscDecision::UseTsc => ("use_tsc", None),
        TscDecision::FallBack { reason } => ("fall_back", Some(reason.clone())),
    };
    let skipped: Vec<serde_json::Value> = this
        .skipped
        .iter()
        .map(|s| serde_json::json!({ "cpu": s.cpu, "reason": s.reason }))
        .collect();
    let shifts: Vec<serde_json::Value> = this
        .shifts
        .iter()
        .map(|s| {
            let measured = s.is_measured();
            serde_json::json!({
                "cpu": s.cpu,
                "lo_ticks": measured.then_some(s.lo_ticks),
                "hi_ticks": measured.then_some(s.hi_ticks),
                "rounds": s.rounds,
                "timed_out_rounds": s.timed_out_rounds,
                "interrupted_rounds": s.interrupted_rounds,
                "empty": s.is_empty(),
            })
        })
        .collect();
    let rates: Vec<serde_json::Value> = this
        .rates
        .iter()
        .map(|r| {
            serde_json::json!({
                "cpu": r.cpu,
                "hz": r.hz,
                "uncertainty_ppm": r.uncertainty_ppm,
                "ticks": r.ticks,
                "interval_ns": r.interval_ns,
                "advances": r.advances,
            })
        })
        .collect();
    let passes: Vec<serde_json::Value> = this.passes.iter().map(pass_json).collect();
    serde_json::json!({
        "source": this.source.map(|s| format!("{s:?}")),
        "invariant_tsc": this.invariant_tsc,
        "clocksource": this.clocksource,
        "tsc_clocksource_available": this.tsc_clocksource_available,
        "nominal_hz": this.nominal_hz,
        "cpus_allowed": this.cpus_allowed,
        "tested_cpus": this.tested_cpus,
        "cpus_tested": this.cpus_tested,
        "skipped": skipped,
        "notes": this.notes,
        "base_cpu": this.base_cpu,
        "shifts": shifts,
        "max_shift_ticks": this.max_shift_ticks,
        "max_shift_ns": this.max_shift_ns,
        "proven_shift_ticks": this.proven_shift_ticks,
        "proven_shift_ns": this.proven_shift_ns,
        "shift_consistent": this.shift_consistent,
        "monotonic": this.monotonic,
        "monotonic_reads": this.monotonic_reads,
        "monotonic_full_loops": this.monotonic_full_loops,
        "monotonic_cpu_switches": this.monotonic_cpu_switches,
        "backward_steps": this.backward_steps,
        "max_backward_ticks": this.max_backward_ticks,
        "rates": rates,
        "rate_hz": this.rate_hz,
        "rate_spread_ppm": this.rate_spread_ppm,
        "rate_uncertainty_ppm": this.rate_uncertainty_ppm,
        "elapsed_ms": this.elapsed.as_secs_f64() * 1e3,
        "passes": passes,
        "warnings": this.warnings,
        "decision": decision,
        "reason": reason,
        "reliable": this.is_reliable(),
    })
}

fn pass_json(p: &PassSummary) -> serde_json::Value {
    let verdicts: serde_json::Map<String, serde_json::Value> = p
        .verdicts
        .iter()
        .map(|v| {
            (
                v.check.name().to_string(),
                serde_json::json!({ "verdict": v.verdict.label(), "detail": v.verdict.detail() }),
            )
        })
        .collect();
    serde_json::json!({
        "attempt": p.attempt,
        "elapsed_ms": p.elapsed.as_secs_f64() * 1e3,
        "interrupted_rounds": p.interrupted_rounds,
        "timed_out_rounds": p.timed_out_rounds,
        "verdicts": verdicts,
    })
}

/// The decision as JSON, for `tickline clock --json` and logs; the full report under `"report"`.
pub fn decision_json(this: &TickSourceDecision) -> serde_json::Value {
    let f = &this.figures;
    let finite = |x: f64| x.is_finite().then_some(x);
    serde_json::json!({
        "source": format!("{:?}", this.source),
        "hardware": this.hardware.map(|s| format!("{s:?}")),
        "stage": this.stage.name(),
        "forced": this.forced,
        "fallback": this.is_fallback(),
        "reason": this.fallback_reason,
        "warnings": this.warnings,
        "revision": this.revision,
        "summary": this.summary(),
        "figures": {
            "passes": f.passes,
            "check_time_ms": f.check_time.as_secs_f64() * 1e3,
            "cpus_tested": f.cpus_tested,
            "max_shift_ns": finite(f.max_shift_ns),
            "proven_shift_ns": finite(f.proven_shift_ns),
            "shift_limit_ns": f.shift_limit_ns,
            "rate_hz": finite(f.rate_hz),
            "rate_spread_ppm": finite(f.rate_spread_ppm),
            "monotonic_reads": f.monotonic_reads,
            "monotonic_full_loops": f.monotonic_full_loops,
            "backward_steps": f.backward_steps,
            "interrupted_rounds": f.interrupted_rounds,
        },
        "report": this.report().map(report_json),
    })
}

/// The check as JSON, for `tickline clock --json`.
pub fn independent_json(this: &IndependentCheck) -> serde_json::Value {
    let clocks: Vec<serde_json::Value> = this
        .clocks
        .iter()
        .map(|c| {
            serde_json::json!({
                "name": c.name,
                "independent_of_tsc": c.independent_of_tsc,
                "about": c.about,
                "unreadable": c.unreadable,
            })
        })
        .collect();
    let measurement = this.measurement.as_ref().map(|m| {
        serde_json::json!({
            "reference": m.reference,
            "interval_ns": m.interval_ns,
            "hz_vs_reference": m.hz_vs_reference,
            "hz_vs_monotonic": m.hz_vs_monotonic,
            "monotonic_error_ppm": m.monotonic_error_ppm,
            "uncertainty_ppm": m.uncertainty_ppm,
        })
    });
    serde_json::json!({
        "current_clocksource": this.current_clocksource,
        "clocks": clocks,
        "measurement": measurement,
        "skipped": this.skipped,
    })
}

/// The tightest of `n` bracketed reads against `reference`: an independent check point, never given to the
/// calibration.
fn check_point(source: TickSource, reference: fn() -> Nanos, n: usize) -> CalibrationSample {
    (0..n)
        .map(|_| bracketed_sample(source, reference))
        .min_by_key(|s| s.max_deviation_ns)
        .expect("n > 0")
}

/// Runs the check for `seconds` and prints the report (text, or one JSON object).
pub fn run(seconds: f64, json_out: bool) -> ExitCode {
    let args = (seconds, json_out);
    // The same decision a timeline of this process makes (the same check, the same cache), waited for to
    // its final stage.
    let decision = TscDecider::process().wait_final(Duration::from_secs(10));
    let independent = check_independent_reference(Duration::from_secs(1));
    let source = decision.source;
    let mut calibrator = match TscCalibrator::new(source, TscCalibratorConfig::default()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tickline: cannot calibrate the {source:?} counter: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Let the history build a rate baseline before the first check point.
    let warmup = Duration::from_millis(500);
    let run_until = |calibrator: &mut TscCalibrator, span: Duration| {
        let end = Instant::now() + span;
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
            if let Err(e) = calibrator.poll(monotonic_ns()) {
                eprintln!("tickline: a calibration burst was rejected: {e}");
            }
        }
    };
    run_until(&mut calibrator, warmup);
    let start_mono = check_point(source, monotonic_ns, 64);
    let start_raw = check_point(source, monotonic_raw_ns, 64);
    run_until(&mut calibrator, Duration::from_secs_f64(args.0));
    let end_mono = check_point(source, monotonic_ns, 64);
    let end_raw = check_point(source, monotonic_raw_ns, 64);
    // One more burst so the end point converts between two knots' worth of data, not by extrapolation only.
    run_until(&mut calibrator, Duration::from_millis(300));

    let convert = |calibrator: &mut TscCalibrator, s: &CalibrationSample| {
        calibrator.convert(RawTicks(s.source_ticks)).expect("calibrated").ns
    };
    let (c_start_mono, c_end_mono) = (
        convert(&mut calibrator, &start_mono),
        convert(&mut calibrator, &end_mono),
    );
    let (c_start_raw, c_end_raw) = (convert(&mut calibrator, &start_raw), convert(&mut calibrator, &end_raw));
    let rate_error_ppm = |c0: u64, c1: u64, r0: &CalibrationSample, r1: &CalibrationSample| {
        let truth = r1.reference_ns as f64 - r0.reference_ns as f64;
        ((c1 as f64 - c0 as f64) - truth) / truth * 1e6
    };
    let rate_error = rate_error_ppm(c_start_mono, c_end_mono, &start_mono, &end_mono);
    let rate_error_raw = rate_error_ppm(c_start_raw, c_end_raw, &start_raw, &end_raw);
    let error_start_ns = c_start_mono as i64 - start_mono.reference_ns as i64;
    let error_end_ns = c_end_mono as i64 - end_mono.reference_ns as i64;
    let latest = *calibrator.history().latest().expect("calibrated");
    let stats = calibrator.history().stats();
    let span_s = (end_mono.reference_ns - start_mono.reference_ns) as f64 / 1e9;

    // Written whole at the end: a closed pipe or a full disk is a clear outcome, never a panic.
    let mut text = String::new();
    if args.1 {
        let out = json!({
            "source": format!("{source:?}"),
            "seconds": span_s,
            "tsc_reliable": !decision.is_fallback(),
            "max_shift_ns": decision.figures.max_shift_ns,
            "monotonic": decision.report().is_none_or(|r| r.monotonic),
            "rate_hz": latest.ticks_per_second(),
            "rate_sigma_ppm": latest.rate_sigma_ppm(),
            "rate_error_ppm": rate_error,
            "rate_error_ppm_raw": rate_error_raw,
            "error_start_ns": error_start_ns,
            "error_end_ns": error_end_ns,
            "check_deviation_ns": [start_mono.max_deviation_ns, end_mono.max_deviation_ns],
            "knots": stats.knots,
            "bursts": stats.bursts,
            "error_bound_ns": latest.error_bound_ns(),
            "max_deviation_ns": latest.max_deviation_ns(),
            "reliability": decision.report().map(report_json),
            "decision": decision_json(&decision),
            "independent_reference": independent_json(&independent),
        });
        let _ = writeln!(text, "{out}");
    } else {
        let _ = writeln!(text, "{decision}");
        if let Some(report) = decision.report() {
            let _ = writeln!(text, "{report}");
        }
        let _ = writeln!(text, "{independent}");
        text.push('\n');
        let _ = writeln!(text, "counter:            {source:?}");
        let _ = writeln!(
            text,
            "rate:               {:.3} Hz ± {:.4} ppm (1σ, live fit over the last {} bursts)",
            latest.ticks_per_second(),
            latest.rate_sigma_ppm(),
            calibrator.history().config().window_bursts
        );
        let _ = writeln!(
            text,
            "measured over {span_s:.2} s at two independent check points (never fed to the calibration):"
        );
        let _ = writeln!(text, "  vs CLOCK_MONOTONIC:     rate error {rate_error:+.4} ppm, error at start {error_start_ns:+} ns, at end {error_end_ns:+} ns (check points ±{} / ±{} ns)", start_mono.max_deviation_ns, end_mono.max_deviation_ns);
        let _ = writeln!(text, "  vs CLOCK_MONOTONIC_RAW: rate error {rate_error_raw:+.4} ppm (the difference is NTP's frequency correction)");
        let _ = writeln!(
            text,
            "calibration:        {} bursts, {} knots, fit error bound ±{:.1} ns, max sample deviation {} ns",
            stats.bursts,
            stats.knots,
            latest.error_bound_ns(),
            latest.max_deviation_ns()
        );
    }
    crate::output::print_report("clock", &text)
}
