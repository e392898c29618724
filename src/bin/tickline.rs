//! The `tickline` command: `tickline clock [--seconds N] [--json]` reports how well this machine's CPU clock
//! can be read and how accurately tickline converts it.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::json;
use tickline::{
    bracketed_sample, check_tsc_reliability, monotonic_ns, monotonic_raw_ns, CalibrationSample, Nanos, RawTicks,
    ReliabilityOptions, TickSource, TscCalibrator, TscCalibratorConfig, TscDecision,
};

const USAGE: &str = "usage: tickline clock [--seconds N] [--json]

  clock        check the TSC's reliability, calibrate it live for N seconds (default 10) and report
               the rate and tickline's conversion error against CLOCK_MONOTONIC and CLOCK_MONOTONIC_RAW
  --seconds N  how long to run (the error is measured over this span)
  --json       print one JSON object instead of text";

struct ClockArgs {
    seconds: f64,
    json: bool,
}

fn parse_args(args: &[String]) -> Result<ClockArgs, String> {
    let mut it = args.iter();
    match it.next().map(String::as_str) {
        Some("clock") => {}
        Some("-h" | "--help") | None => return Err(String::new()),
        Some(other) => return Err(format!("unknown command `{other}`")),
    }
    let mut parsed = ClockArgs {
        seconds: 10.0,
        json: false,
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--json" => parsed.json = true,
            "--seconds" => {
                let value = it.next().ok_or("--seconds needs a value")?;
                parsed.seconds = value
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s >= 0.5 && *s <= 86_400.0)
                    .ok_or_else(|| format!("--seconds must be a number from 0.5 to 86400, got `{value}`"))?;
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option `{other}`")),
        }
    }
    Ok(parsed)
}

/// The tightest of `n` bracketed reads against `reference`: an independent check point, never given to the
/// calibration.
fn check_point(source: TickSource, reference: fn() -> Nanos, n: usize) -> CalibrationSample {
    (0..n)
        .map(|_| bracketed_sample(source, reference))
        .min_by_key(|s| s.max_deviation_ns)
        .expect("n > 0")
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&args) {
        Ok(a) => a,
        Err(message) => {
            if message.is_empty() {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            eprintln!("tickline: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let report = check_tsc_reliability(&ReliabilityOptions::default());
    let source = match (&report.decision, TickSource::hardware()) {
        (TscDecision::UseTsc, Some(hw)) => hw,
        _ => TickSource::Monotonic,
    };
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
    run_until(&mut calibrator, Duration::from_secs_f64(args.seconds));
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

    if args.json {
        let out = json!({
            "source": format!("{source:?}"),
            "seconds": span_s,
            "tsc_reliable": report.is_reliable(),
            "max_shift_ns": report.max_shift_ns,
            "monotonic": report.monotonic,
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
            "reliability": report.to_json(),
        });
        println!("{out}");
    } else {
        println!("{report}");
        println!();
        println!("counter:            {source:?}");
        println!(
            "rate:               {:.3} Hz ± {:.4} ppm (1σ, live fit over the last {} bursts)",
            latest.ticks_per_second(),
            latest.rate_sigma_ppm(),
            calibrator.history().config().window_bursts
        );
        println!("measured over {span_s:.2} s at two independent check points (never fed to the calibration):");
        println!("  vs CLOCK_MONOTONIC:     rate error {rate_error:+.4} ppm, error at start {error_start_ns:+} ns, at end {error_end_ns:+} ns (check points ±{} / ±{} ns)", start_mono.max_deviation_ns, end_mono.max_deviation_ns);
        println!("  vs CLOCK_MONOTONIC_RAW: rate error {rate_error_raw:+.4} ppm (the difference is NTP's frequency correction)");
        println!(
            "calibration:        {} bursts, {} knots, fit error bound ±{:.1} ns, max sample deviation {} ns",
            stats.bursts,
            stats.knots,
            latest.error_bound_ns(),
            latest.max_deviation_ns()
        );
    }
    ExitCode::SUCCESS
}
