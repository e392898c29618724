//! The `tickline` command.

use std::path::PathBuf;
use std::process::ExitCode;
use tickline_cli::input::Input;
use tickline_cli::output::print_report;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tickline",
    version,
    about = "tickline's command line: clock report, raw capture conversion, trace stats, trace merge"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check the TSC's reliability, calibrate it live and report its rate and tickline's conversion error
    /// against CLOCK_MONOTONIC and CLOCK_MONOTONIC_RAW.
    Clock {
        /// How long to run (the error is measured over this span), 0.5 to 86400.
        #[arg(long, default_value_t = 10.0, value_parser = parse_seconds)]
        seconds: f64,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Convert a raw capture (.tickline, written with `TimelineBuilder::raw_capture`) into a Perfetto trace,
    /// with the whole calibration history (every timestamp placed between calibration points on both sides).
    /// A capture cut short (a killed process) converts up to its last whole frame.
    Convert {
        /// The raw capture.
        input: PathBuf,
        /// The Perfetto trace to write (`-` for stdout: the report then goes to stderr).
        #[arg(short, long)]
        output: PathBuf,
        /// Print the summary as one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Summarise a trace: a Perfetto trace (.pftrace) written by tickline (tracks, slices, events, flows,
    /// losses, the CPU clock decision, clock snapshots and calibration counters, decoded with Perfetto's own
    /// schema), or a raw capture (.tickline: threads, records kept and dropped, clock domains and their
    /// calibration error). The kind is told by the file's content.
    Stats {
        /// The trace or capture file.
        file: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Merge traces of several processes and machines into one trace on one time axis, with each machine's
    /// alignment uncertainty stated (in the report, and as a counter track per process). Every input is read
    /// whole into memory and the output is built there: at peak about 2.5 times the inputs' total size.
    Merge {
        /// The traces (tickline .pftrace files).
        #[arg(required = true, num_args = 1..)]
        inputs: Vec<PathBuf>,
        /// The merged trace (`-` for stdout: the report then goes to stderr).
        #[arg(short, long)]
        output: PathBuf,
        /// The trace whose machine's clock is the time axis (default: the first input).
        #[arg(long)]
        reference: Option<PathBuf>,
        /// The annotation that marks a flow's sending end (its value is the flow's id).
        #[arg(long, default_value = tickline_cli::merge::FLOW_OUT_FIELD)]
        flow_out: String,
        /// The annotation that marks a flow's receiving end.
        #[arg(long, default_value = tickline_cli::merge::FLOW_IN_FIELD)]
        flow_in: String,
    },
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.5 && *v <= 86_400.0)
        .ok_or_else(|| format!("must be a number from 0.5 to 86400, got `{s}`"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Clock { seconds, json } => tickline_cli::clock::run(seconds, json),
        Command::Convert { input, output, json } => {
            let output = tickline_cli::output::output_path(output);
            convert(&input, &output, json)
        }
        Command::Stats { file, json } => {
            let input = match Input::open(&file) {
                Ok(input) => input,
                Err(e) => {
                    eprintln!("tickline stats: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match tickline_cli::capture::is_capture_file(input.path()) {
                Ok(true) => capture_stats(&input, json),
                Ok(false) => stats(&input, json),
                Err(e) => {
                    eprintln!("tickline stats: {}: cannot read: {e}", file.display());
                    ExitCode::FAILURE
                }
            }
        }
        Command::Merge {
            inputs,
            output,
            reference,
            flow_out,
            flow_in,
        } => {
            let mut opened = Vec::with_capacity(inputs.len());
            for path in &inputs {
                match Input::open(path) {
                    Ok(input) => opened.push(input),
                    Err(e) => {
                        eprintln!("tickline merge: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            // The reference names one of the inputs: its readable path.
            let reference = reference.map(|r| {
                opened
                    .iter()
                    .find(|input| input.original() == r.as_path())
                    .map_or(r.clone(), |input| input.path().to_owned())
            });
            let output = tickline_cli::output::output_path(output);
            let options = tickline_cli::merge::MergeOptions {
                inputs: opened.iter().map(|input| input.path().to_owned()).collect(),
                output: output.clone(),
                reference,
                flow_out,
                flow_in,
            };
            let named = |text: String| opened.iter().fold(text, |text, input| input.named(text));
            match tickline_cli::merge::merge(&options) {
                Ok(report) => tickline_cli::output::print_report_beside("merge", &named(report.to_string()), &output),
                Err(e) => {
                    eprintln!("tickline merge: {}", named(e.to_string()));
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn convert(input: &std::path::Path, output: &std::path::Path, json: bool) -> ExitCode {
    match Input::open(input)
        .and_then(|input| tickline_cli::capture::convert(input.path(), output).map_err(|e| input.named(e)))
    {
        Ok(summary) => {
            let report = if json {
                let mut summary = tickline_cli::capture::summary_json(&summary);
                summary["output"] = serde_json::json!(output.display().to_string());
                format!("{summary}\n")
            } else {
                format!(
                    "wrote {}\n{}",
                    output.display(),
                    tickline_cli::capture::summary_text(&summary)
                )
            };
            tickline_cli::output::print_report_beside("convert", &report, output)
        }
        Err(e) => {
            eprintln!("tickline convert: {e}");
            ExitCode::FAILURE
        }
    }
}

fn capture_stats(input: &Input, json: bool) -> ExitCode {
    match tickline_cli::capture::stats(input.path()).map_err(|e| input.named(e)) {
        Ok(summary) => {
            let report = if json {
                format!("{}\n", tickline_cli::capture::summary_json(&summary))
            } else {
                tickline_cli::capture::summary_text(&summary)
            };
            print_report("stats", &report)
        }
        Err(e) => {
            eprintln!("tickline stats: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(feature = "protos")]
fn stats(input: &Input, json: bool) -> ExitCode {
    match tickline_cli::stats::read(input.path()).map_err(|e| input.named(e)) {
        Ok(stats) => {
            let report = if json {
                format!("{}\n", stats.to_json())
            } else {
                stats.to_string()
            };
            print_report("stats", &report)
        }
        Err(e) => {
            eprintln!("tickline stats: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "protos"))]
fn stats(_input: &Input, _json: bool) -> ExitCode {
    eprintln!("tickline stats: this build has no Perfetto schema (rebuild tickline-cli with its `protos` feature)");
    ExitCode::FAILURE
}
