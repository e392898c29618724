//! A client and a server process exchanging requests over TCP, each writing its own Perfetto trace, then
//! merged onto one timeline by `tickline merge`:
//!
//! ```text
//! cargo run --release --example two_processes -- traces/
//! cargo run --release -p tickline-cli -- merge traces/client.pftrace traces/server.pftrace -o traces/both.pftrace
//! ```
//!
//! Run without a role, the example starts the server and the client as two child processes of itself. To
//! give the merge something to align on one machine, the server pretends to be another host: its own machine
//! id (`TICKLINE_MACHINE_ID`) and clocks 2.5 s behind and 50 ppm fast (the test hook `TICKLINE_SIMULATE_CLOCK`;
//! leave both out between real hosts). The two processes run a `tickline::sync::ClockExchange` beside their
//! requests, stored in both traces, which `tickline merge` uses to map the server's clock onto the
//! client's, and it states how far off that can be.
//!
//! Each request is linked across the processes: the client's `send request` span carries
//! `tickline.flow_out = "req-N"`, the server's `handle request` span `tickline.flow_in = "req-N"` (and the reply
//! back the same way), which `tickline merge` turns into Perfetto flows.
//!
//! Roles, for running the two by hand (on two hosts, say):
//! `two_processes server DIR` prints `READY <app port> <exchange port>` and serves one client;
//! `two_processes client DIR HOST:APP_PORT HOST:EXCHANGE_PORT` sends requests for 2 s.

use std::error::Error;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tickline::{sync::ClockExchange, Timeline};
use tickline_perfetto::PerfettoExporter;
use tracing::info_span;
use tracing_subscriber::layer::SubscriberExt;

fn start(trace: &Path, exchange: ClockExchange) -> Result<Timeline, Box<dyn Error>> {
    let exporter = PerfettoExporter::create(trace)?.clock_exchange(exchange);
    let timeline = Timeline::builder().exporter(exporter).start()?;
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(timeline.layer()))?;
    Ok(timeline)
}

fn busy(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

fn server(dir: &Path) -> Result<(), Box<dyn Error>> {
    let app = TcpListener::bind("127.0.0.1:0")?;
    let exchange = ClockExchange::listen("127.0.0.1:0")?;
    let timeline = start(&dir.join("server.pftrace"), exchange.clone())?;
    println!(
        "READY {} {}",
        app.local_addr()?.port(),
        exchange.local_addr().map_or(0, |a| a.port())
    );
    std::io::stdout().flush()?;
    let (stream, _) = app.accept()?;
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = (BufReader::new(stream.try_clone()?), stream);
    let mut line = String::new();
    while reader.read_line(&mut line)? > 0 && line.trim() != "BYE" {
        let id = line.trim().trim_start_matches("REQ ").to_owned();
        let _handle = info_span!("handle request", "tickline.flow_in" = format!("req-{id}").as_str()).entered();
        {
            let _work = info_span!("look up").entered();
            busy(Duration::from_micros(400));
        }
        let _reply = info_span!("send reply", "tickline.flow_out" = format!("resp-{id}").as_str()).entered();
        writer.write_all(format!("RESP {id}\n").as_bytes())?;
        line.clear();
    }
    timeline.shutdown()?;
    exchange.shutdown();
    Ok(())
}

fn client(dir: &Path, app: &str, exchange_addr: &str) -> Result<(), Box<dyn Error>> {
    let exchange = ClockExchange::connect(exchange_addr)?;
    let timeline = start(&dir.join("client.pftrace"), exchange.clone())?;
    let stream = TcpStream::connect(app).map_err(|e| format!("cannot connect to the server at {app}: {e}"))?;
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = (BufReader::new(stream.try_clone()?), stream);
    let (begin, mut n, mut line) = (Instant::now(), 0u64, String::new());
    while begin.elapsed() < Duration::from_secs(2) {
        let _request = info_span!("request", n).entered();
        {
            let _send = info_span!("send request", "tickline.flow_out" = format!("req-{n}").as_str()).entered();
            writer.write_all(format!("REQ {n}\n").as_bytes())?;
        }
        line.clear();
        reader.read_line(&mut line)?;
        {
            let _got = info_span!("got reply", "tickline.flow_in" = format!("resp-{n}").as_str()).entered();
            busy(Duration::from_micros(100));
        }
        n += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    writer.write_all(b"BYE\n")?;
    timeline.shutdown()?;
    exchange.shutdown();
    println!("client: {n} requests");
    Ok(())
}

/// Starts the server (as a pretend other host) and the client as children of this process.
fn both(dir: &Path) -> Result<(), Box<dyn Error>> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create the directory {}: {e}", dir.display()))?;
    let me = std::env::current_exe()?;
    let mut server = Command::new(&me)
        .arg("server")
        .arg(dir)
        .env(tickline::sync::MACHINE_ID_ENV, "two-processes-server")
        .env(tickline::sync::SIMULATE_CLOCK_ENV, "offset_ns=-2500000000,drift_ppm=50")
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(server.stdout.take().ok_or("no server stdout")?);
    let mut ready = String::new();
    while !ready.starts_with("READY ") {
        ready.clear();
        if out.read_line(&mut ready)? == 0 {
            return Err("the server exited before it was ready".into());
        }
    }
    let ports: Vec<&str> = ready.split_whitespace().skip(1).collect();
    let status = Command::new(&me)
        .arg("client")
        .arg(dir)
        .arg(format!("127.0.0.1:{}", ports[0]))
        .arg(format!("127.0.0.1:{}", ports[1]))
        .status()?;
    let server_status = server.wait()?;
    if !status.success() || !server_status.success() {
        return Err(format!("client {status}, server {server_status}").into());
    }
    println!(
        "wrote {0}/client.pftrace and {0}/server.pftrace; merge them with\n  \
         cargo run --release -p tickline-cli -- merge {0}/client.pftrace {0}/server.pftrace -o {0}/both.pftrace",
        dir.display()
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    // Errors in words (returned from `main`, they would print as `Debug`).
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("two_processes: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["server", dir] => server(Path::new(dir)),
        ["client", dir, app, exchange] => client(Path::new(dir), app, exchange),
        [dir] => both(Path::new(dir)),
        [] => both(&PathBuf::from("two_processes_traces")),
        _ => Err("usage: two_processes [DIR] | server DIR | client DIR HOST:APP_PORT HOST:EXCHANGE_PORT".into()),
    }
}
