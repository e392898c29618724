//! Traces that describe themselves, and clocks compared across processes and hosts.
//!
//! A trace that is to be merged with other processes' and other machines' traces must say where it came from
//! and how its clock relates to theirs. This module gathers what an exporter writes for that:
//!
//! - **Who**: [`HostInfo`] (a [`MachineId`] stable for one boot, the boot id, the host name), the process,
//!   and a fresh [`TraceUuid`] per trace.
//! - **Clocks**: [`read_host_clocks`] reads `CLOCK_BOOTTIME`, `CLOCK_MONOTONIC`, `CLOCK_MONOTONIC_RAW` and
//!   `CLOCK_REALTIME` inside one tight `CLOCK_MONOTONIC` bracket (the tightest of a few tries), and
//!   [`time_sync_state`] asks the kernel (`adjtimex`) how well NTP/PTP keeps `CLOCK_REALTIME`: synchronised or
//!   not, the estimated and the maximum error.
//! - **Clock exchange**: where two tickline processes can talk, a [`ClockExchange`] measures their clocks
//!   against each other over a TCP socket with NTP's four timestamps, much better than comparing two hosts'
//!   `CLOCK_REALTIME`s. Each [`ExchangeSample`] is a bracket: the peer's clock was read somewhere inside this
//!   side's round trip, so it becomes a [`CalibrationSample`] with half the round trip as its deviation.
//!
//! Processes on one machine share its clocks exactly; `tickline merge` (the `tickline-cli` crate) puts traces
//! of several machines on one axis with these, and states how far each machine's alignment can be off.
//!
//! # Testing other machines on one machine
//!
//! `TICKLINE_MACHINE_ID=name` makes this process claim another machine identity, and the hidden test hook
//! `TICKLINE_SIMULATE_CLOCK` (see [`SimulatedClock::parse`]) makes every clock this module reads (and that the
//! Perfetto exporter writes) run with an offset and a drift, so child processes can play hosts whose clocks
//! disagree with known truth.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::calibration::CalibrationSample;

/// The environment variable that overrides this process's [`MachineId`] (any text; it is hashed).
pub const MACHINE_ID_ENV: &str = "TICKLINE_MACHINE_ID";

/// The test hook's environment variable: see [`SimulatedClock::parse`].
#[doc(hidden)]
pub const SIMULATE_CLOCK_ENV: &str = "TICKLINE_SIMULATE_CLOCK";

/// A machine's identity for one boot: processes with the same id share their clocks exactly.
///
/// By default a hash of the kernel's boot id (`/proc/sys/kernel/random/boot_id`), so it changes at every boot
/// (the clocks restart too) and containers on one kernel share it (they share its clocks). [`MACHINE_ID_ENV`]
/// overrides it.
///
/// ```
/// let a = tickline::sync::MachineId::from_name("render-node-3");
/// assert_eq!(a, tickline::sync::MachineId::from_name("render-node-3"));
/// assert_ne!(a, tickline::sync::MachineId::from_name("render-node-4"));
/// assert_eq!(a.to_string().len(), 16);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MachineId(pub u64);

impl MachineId {
    /// The id a name hashes to (64-bit FNV-1a, then a SplitMix64 finaliser); never 0.
    pub fn from_name(name: &str) -> MachineId {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        MachineId(mix64(h).max(1))
    }

    /// This machine's id: [`HostInfo::current`]'s.
    pub fn current() -> MachineId {
        HostInfo::current().machine_id
    }
}

impl std::fmt::Display for MachineId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// SplitMix64's finaliser: a bijection on u64 that spreads every input bit.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Where a [`MachineId`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MachineIdSource {
    /// A hash of the kernel's boot id.
    BootId,
    /// [`MACHINE_ID_ENV`] (or a caller's explicit id).
    Override,
    /// A hash of the host name (no boot id could be read).
    HostName,
}

impl MachineIdSource {
    /// `"boot_id"`, `"override"` or `"host_name"`, as written into traces.
    pub fn as_str(self) -> &'static str {
        match self {
            MachineIdSource::BootId => "boot_id",
            MachineIdSource::Override => "override",
            MachineIdSource::HostName => "host_name",
        }
    }
}

/// What a trace says about the machine it was recorded on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostInfo {
    /// The machine (one boot of it).
    pub machine_id: MachineId,
    /// How `machine_id` was chosen.
    pub machine_id_source: MachineIdSource,
    /// The kernel's boot id (empty where none can be read).
    pub boot_id: String,
    /// The host name.
    pub host_name: String,
}

impl HostInfo {
    /// This machine, read once per process; [`MACHINE_ID_ENV`] is honoured.
    ///
    /// ```
    /// let host = tickline::sync::HostInfo::current();
    /// assert_ne!(host.machine_id.0, 0);
    /// ```
    pub fn current() -> &'static HostInfo {
        static HOST: OnceLock<HostInfo> = OnceLock::new();
        HOST.get_or_init(|| {
            let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map(|s| s.trim().to_owned())
                .unwrap_or_default();
            let host_name = host_name();
            let (machine_id, machine_id_source) = match std::env::var(MACHINE_ID_ENV) {
                Ok(name) if !name.is_empty() => (MachineId::from_name(&name), MachineIdSource::Override),
                _ if !boot_id.is_empty() => (MachineId::from_name(&boot_id), MachineIdSource::BootId),
                _ => (MachineId::from_name(&host_name), MachineIdSource::HostName),
            };
            HostInfo {
                machine_id,
                machine_id_source,
                boot_id,
                host_name,
            }
        })
    }
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass; gethostname writes at most that
    // many bytes and we stop at the first NUL (or the end) below.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".to_owned();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// This process's name, as the collector names its process track: the file name of `argv[0]`.
pub fn process_name() -> String {
    std::env::args()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| format!("process {}", std::process::id()))
}

/// A trace's UUID (random, version 4): what tells two trace files apart, whatever their content.
///
/// ```
/// let (a, b) = (tickline::sync::TraceUuid::new_random(), tickline::sync::TraceUuid::new_random());
/// assert_ne!(a, b);
/// assert_eq!(a.to_string().len(), 36);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TraceUuid(pub u128);

impl TraceUuid {
    /// A fresh random UUID (from `/dev/urandom`; where that cannot be read, from the time, the pid and a
    /// counter).
    pub fn new_random() -> TraceUuid {
        let mut bytes = [0u8; 16];
        let random = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
        if random.is_err() {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let a = mix64(now ^ (u64::from(std::process::id()) << 32));
            let b = mix64(a ^ COUNTER.fetch_add(1, Ordering::Relaxed) ^ monotonic_raw());
            bytes[..8].copy_from_slice(&a.to_le_bytes());
            bytes[8..].copy_from_slice(&b.to_le_bytes());
        }
        Self::version_4(u128::from_be_bytes(bytes))
    }

    /// A UUID derived from `words`: the same words always give the same UUID, different ones (almost surely)
    /// different UUIDs. For what must come out the same each time it is made, such as a capture converted
    /// twice.
    ///
    /// ```
    /// use tickline::sync::TraceUuid;
    /// assert_eq!(TraceUuid::derived_from(&[1, 2]), TraceUuid::derived_from(&[1, 2]));
    /// assert_ne!(TraceUuid::derived_from(&[1, 2]), TraceUuid::derived_from(&[2, 1]));
    /// ```
    pub fn derived_from(words: &[u64]) -> TraceUuid {
        let (mut a, mut b) = (0x6a09_e667_f3bc_c908u64, 0xbb67_ae85_84ca_a73bu64);
        for &w in words {
            a = mix64(a ^ w);
            b = mix64(b.rotate_left(17) ^ a);
        }
        Self::version_4((u128::from(a) << 64) | u128::from(b))
    }

    /// `v` in the version-4 (random) form, variant 10.
    fn version_4(mut v: u128) -> TraceUuid {
        v = (v & !(0xf << 76)) | (0x4 << 76);
        v = (v & !(0x3 << 62)) | (0x2 << 62);
        TraceUuid(v)
    }

    /// The high 64 bits, as Perfetto's `TraceUuid.msb` holds them.
    pub fn msb(self) -> i64 {
        (self.0 >> 64) as u64 as i64
    }

    /// The low 64 bits, as Perfetto's `TraceUuid.lsb` holds them.
    pub fn lsb(self) -> i64 {
        self.0 as u64 as i64
    }

    /// A 32-bit salt for ids that must be unique across traces (track uuids, flow ids).
    pub fn salt32(self) -> u32 {
        let folded = mix64((self.0 >> 64) as u64 ^ mix64(self.0 as u64));
        ((folded >> 32) as u32).max(1)
    }
}

impl std::fmt::Display for TraceUuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.0;
        write!(
            f,
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            (v >> 96) as u32,
            (v >> 80) as u16,
            (v >> 64) as u16,
            (v >> 48) as u16,
            (v & 0xffff_ffff_ffff) as u64
        )
    }
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock ids used here exist on every Linux kernel tickline
    // supports, and on failure `ts` stays zero.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    // `time_t` and `c_long` are i64 on 64-bit Linux but i32 on 32-bit targets: keep the casts.
    #[allow(clippy::unnecessary_cast)]
    let ns = (ts.tv_sec as i64 as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64);
    ns
}

fn monotonic_raw() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC_RAW)
}

/// The host's four clocks read together, in nanoseconds, as of one moment.
///
/// Each of the other three clocks is read between two reads of `CLOCK_MONOTONIC` and carried to the moment
/// `monotonic_ns` (the middle between the first and the last of those reads) by the time between its own
/// bracket's middle and that moment; `bracket_ns` is the widest of the three brackets: each value stands for that moment to
/// within half of it, so any two clocks agree to within `bracket_ns`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClockReadings {
    /// `CLOCK_BOOTTIME`: Perfetto's default trace clock (MONOTONIC plus time suspended).
    pub boottime_ns: u64,
    /// `CLOCK_MONOTONIC`: tickline's reference clock.
    pub monotonic_ns: u64,
    /// `CLOCK_MONOTONIC_RAW`: the oscillator without NTP's frequency correction.
    pub monotonic_raw_ns: u64,
    /// `CLOCK_REALTIME`: wall-clock time since the Unix epoch, what NTP/PTP keep in agreement across hosts.
    pub realtime_ns: u64,
    /// The widest `CLOCK_MONOTONIC` bracket around one of the other clocks' reads.
    pub bracket_ns: u64,
}

/// Reads the host's clocks in one tight bracket: the tightest of 5 tries. With the test hook active, the
/// readings are the simulated machine's (see [`SimulatedClock`]).
///
/// ```
/// let r = tickline::sync::read_host_clocks();
/// assert!(r.boottime_ns >= r.monotonic_ns.saturating_sub(r.bracket_ns));
/// assert!(r.realtime_ns > 1_500_000_000 * 1_000_000_000); // after 2017
/// ```
pub fn read_host_clocks() -> ClockReadings {
    let real = read_real_clocks();
    match simulation() {
        Some(sim) => sim.apply(real),
        None => real,
    }
}

/// [`read_host_clocks`] without the test hook: the machine's own clocks.
#[doc(hidden)]
pub fn read_real_clocks() -> ClockReadings {
    let mut best = ClockReadings {
        bracket_ns: u64::MAX,
        ..ClockReadings::default()
    };
    for _ in 0..5 {
        // MONOTONIC around each read: read in one bracket, BOOTTIME would sit 15-25 ns off the middle here.
        let m0 = clock_ns(libc::CLOCK_MONOTONIC);
        let boot = clock_ns(libc::CLOCK_BOOTTIME);
        let m1 = clock_ns(libc::CLOCK_MONOTONIC);
        let raw = monotonic_raw();
        let m2 = clock_ns(libc::CLOCK_MONOTONIC);
        let real = clock_ns(libc::CLOCK_REALTIME);
        let m3 = clock_ns(libc::CLOCK_MONOTONIC);
        let width = m1
            .saturating_sub(m0)
            .max(m2.saturating_sub(m1))
            .max(m3.saturating_sub(m2));
        if width < best.bracket_ns {
            let at = m0 + m3.saturating_sub(m0) / 2;
            // A value read at its bracket's middle, moved to `at` (these clocks tick at MONOTONIC's rate to
            // within NTP's slew, 500 ppm at most: well under 1 ns over these few tens of ns).
            let moved = |value: u64, before: u64, after: u64| {
                let middle = before + after.saturating_sub(before) / 2;
                value.wrapping_add(at.wrapping_sub(middle))
            };
            best = ClockReadings {
                boottime_ns: moved(boot, m0, m1),
                monotonic_ns: at,
                monotonic_raw_ns: moved(raw, m1, m2),
                realtime_ns: moved(real, m2, m3),
                bracket_ns: width,
            };
        }
    }
    best
}

/// `CLOCK_BOOTTIME` now, as the trace shows it (with the test hook applied): what the clock exchange
/// timestamps.
pub fn host_boottime_ns() -> u64 {
    match simulation() {
        Some(sim) => {
            let mono = clock_ns(libc::CLOCK_MONOTONIC);
            let boot = clock_ns(libc::CLOCK_BOOTTIME);
            boot.wrapping_add_signed(sim.shift_ns(mono))
        }
        None => clock_ns(libc::CLOCK_BOOTTIME),
    }
}

/// How well the host keeps `CLOCK_REALTIME` (the kernel's NTP state, from `adjtimex`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimeSyncState {
    /// The kernel says the clock is synchronised (no `STA_UNSYNC`, state not `TIME_ERROR`).
    pub synchronized: bool,
    /// The estimated error of `CLOCK_REALTIME` against true time, as the sync daemon last set it.
    pub est_error_ns: u64,
    /// The maximum error: a bound the kernel grows by 500 ppm of the time since the daemon last set it (16 s
    /// when unsynchronised).
    pub max_error_ns: u64,
    /// The kernel's `STA_*` status bits.
    pub status: i32,
    /// `adjtimex`'s return value: `TIME_OK` (0) ... `TIME_ERROR` (5).
    pub clock_state: i32,
}

/// The kernel's time-sync state now, or `None` where `adjtimex` cannot be called. With the test hook's
/// `max_error_us` set, the simulated machine's.
///
/// ```
/// if let Some(s) = tickline::sync::time_sync_state() {
///     assert!(s.max_error_ns >= s.est_error_ns || !s.synchronized);
/// }
/// ```
pub fn time_sync_state() -> Option<TimeSyncState> {
    if let Some(sync) = simulation().and_then(|s| s.time_sync) {
        return Some(sync);
    }
    real_time_sync_state()
}

fn real_time_sync_state() -> Option<TimeSyncState> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // SAFETY: an all-zero `timex` is a valid value of this plain C struct (modes = 0: read only).
        let mut tx: libc::timex = unsafe { std::mem::zeroed() };
        // SAFETY: `tx` is a valid, writable timex; with `modes == 0` adjtimex only reads the kernel's state.
        let state = unsafe { libc::adjtimex(&mut tx) };
        if state < 0 {
            return None;
        }
        // The kernel's fields are in microseconds.
        #[allow(clippy::unnecessary_cast)]
        let (est, max) = ((tx.esterror as i64).max(0) as u64, (tx.maxerror as i64).max(0) as u64);
        let status = tx.status;
        Some(TimeSyncState {
            synchronized: status & libc::STA_UNSYNC == 0 && state != libc::TIME_ERROR,
            est_error_ns: est * 1_000,
            max_error_ns: max * 1_000,
            status,
            clock_state: state,
        })
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        None
    }
}

/// The test hook: a simulated machine whose clocks run off this one's by a known offset and drift.
///
/// `BOOTTIME`, `MONOTONIC` and `MONOTONIC_RAW` read `real + offset_ns + drift_ppm · (real MONOTONIC since the
/// hook was first used)`; `REALTIME` reads `real + realtime_error_ns` (NTP keeps the simulated host's wall
/// clock near true time, off by that much); and the time-sync state can be set. Set it for a whole process
/// with [`SIMULATE_CLOCK_ENV`] (read once), or per exporter / exchange with their hidden setters.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimulatedClock {
    /// The simulated clocks' offset when the hook was first used, in ns.
    pub offset_ns: i64,
    /// How fast the simulated BOOTTIME/MONOTONIC clocks run against the real ones, in ppm.
    pub drift_ppm: f64,
    /// The simulated host's REALTIME error against the real one, in ns.
    pub realtime_error_ns: i64,
    /// The simulated host's time-sync state, if set.
    pub time_sync: Option<TimeSyncState>,
    /// Real `CLOCK_MONOTONIC` at which the offset is `offset_ns`.
    pub anchor_monotonic_ns: u64,
}

impl SimulatedClock {
    /// Parses `offset_ns=N,drift_ppm=X,realtime_error_ns=N,max_error_us=N,est_error_us=N` (every key
    /// optional; the error keys give a synchronised time-sync state). The anchor is now.
    pub fn parse(spec: &str) -> Result<SimulatedClock, String> {
        let mut sim = SimulatedClock {
            offset_ns: 0,
            drift_ppm: 0.0,
            realtime_error_ns: 0,
            time_sync: None,
            anchor_monotonic_ns: clock_ns(libc::CLOCK_MONOTONIC),
        };
        let (mut max_us, mut est_us) = (None, None);
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}` is not key=value"))?;
            let bad = |_| format!("bad value in `{item}`");
            match key.trim() {
                "offset_ns" => sim.offset_ns = value.trim().parse().map_err(bad)?,
                "drift_ppm" => {
                    sim.drift_ppm = value
                        .trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|d| d.is_finite() && d.abs() < 1e5)
                        .ok_or_else(|| format!("bad value in `{item}`"))?
                }
                "realtime_error_ns" => sim.realtime_error_ns = value.trim().parse().map_err(bad)?,
                "max_error_us" => max_us = Some(value.trim().parse::<u64>().map_err(bad)?),
                "est_error_us" => est_us = Some(value.trim().parse::<u64>().map_err(bad)?),
                other => return Err(format!("unknown key `{other}`")),
            }
        }
        if max_us.is_some() || est_us.is_some() {
            let max = max_us.or(est_us).unwrap_or(0);
            sim.time_sync = Some(TimeSyncState {
                synchronized: true,
                est_error_ns: est_us.unwrap_or(max) * 1_000,
                max_error_ns: max * 1_000,
                status: 0x2001, // STA_PLL | STA_NANO
                clock_state: 0,
            });
        }
        Ok(sim)
    }

    /// How far the simulated BOOTTIME/MONOTONIC is from the real one at real MONOTONIC `real_monotonic_ns`.
    #[inline]
    pub fn shift_ns(&self, real_monotonic_ns: u64) -> i64 {
        let since = real_monotonic_ns as i128 - self.anchor_monotonic_ns as i128;
        self.offset_ns + (since as f64 * self.drift_ppm * 1e-6).round() as i64
    }

    /// Real readings to the simulated machine's.
    pub fn apply(&self, r: ClockReadings) -> ClockReadings {
        let shift = self.shift_ns(r.monotonic_ns);
        ClockReadings {
            boottime_ns: r.boottime_ns.wrapping_add_signed(shift),
            monotonic_ns: r.monotonic_ns.wrapping_add_signed(shift),
            monotonic_raw_ns: r.monotonic_raw_ns.wrapping_add_signed(shift),
            realtime_ns: r.realtime_ns.wrapping_add_signed(self.realtime_error_ns),
            bracket_ns: r.bracket_ns,
        }
    }
}

/// The process-wide simulation from [`SIMULATE_CLOCK_ENV`], read once. A malformed value panics: it is a
/// test hook, and a test that silently ran unsimulated would prove nothing.
#[doc(hidden)]
pub fn simulation() -> Option<&'static SimulatedClock> {
    static SIM: OnceLock<Option<SimulatedClock>> = OnceLock::new();
    SIM.get_or_init(|| {
        let spec = std::env::var(SIMULATE_CLOCK_ENV).ok()?;
        match SimulatedClock::parse(&spec) {
            Ok(sim) => Some(sim),
            Err(e) => panic!("{SIMULATE_CLOCK_ENV}={spec:?}: {e}"),
        }
    })
    .as_ref()
}

/// One round of a [`ClockExchange`]: NTP's four timestamps, each side's `CLOCK_BOOTTIME` (as its trace
/// shows it).
///
/// The server's clock was read (twice, `t2` and `t3`) while the client waited between `t1` and `t4`, so the
/// server's offset from the client lies in `[t3 - t4, t2 - t1]`: a bracket of width [`round_trip_ns`]
/// (the round trip less the server's own time), centred on [`offset_ns`].
///
/// [`round_trip_ns`]: ExchangeSample::round_trip_ns
/// [`offset_ns`]: ExchangeSample::offset_ns
///
/// ```
/// let s = tickline::sync::ExchangeSample {
///     client: tickline::sync::MachineId(1),
///     server: tickline::sync::MachineId(2),
///     burst: 0,
///     t1_client_send_ns: 1_000,
///     t2_server_receive_ns: 5_000_020,
///     t3_server_send_ns: 5_000_030,
///     t4_client_receive_ns: 1_050,
/// };
/// assert_eq!(s.round_trip_ns(), 40);
/// assert_eq!(s.offset_ns(), 4_999_000);
/// let c = s.as_calibration_sample();
/// assert_eq!((c.source_ticks, c.reference_ns, c.max_deviation_ns), (5_000_025, 1_025, 20));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExchangeSample {
    /// The machine that started the round.
    pub client: MachineId,
    /// The machine that answered.
    pub server: MachineId,
    /// Which burst of rounds this one belongs to (rounds of one burst are taken close together; the one with
    /// the shortest round trip is the best).
    pub burst: u64,
    /// Client clock when the request left.
    pub t1_client_send_ns: u64,
    /// Server clock when the request arrived.
    pub t2_server_receive_ns: u64,
    /// Server clock when the answer left.
    pub t3_server_send_ns: u64,
    /// Client clock when the answer arrived.
    pub t4_client_receive_ns: u64,
}

impl ExchangeSample {
    /// The round trip less the server's time: the width of the offset's bracket.
    pub fn round_trip_ns(&self) -> u64 {
        let total = self.t4_client_receive_ns.saturating_sub(self.t1_client_send_ns);
        total.saturating_sub(self.t3_server_send_ns.saturating_sub(self.t2_server_receive_ns))
    }

    /// The server's clock minus the client's, at the bracket's centre.
    pub fn offset_ns(&self) -> i64 {
        let a = self.t2_server_receive_ns as i128 - self.t1_client_send_ns as i128;
        let b = self.t3_server_send_ns as i128 - self.t4_client_receive_ns as i128;
        ((a + b) / 2) as i64
    }

    /// The round as a calibration sample of the server's clock (source, in ns) against the client's
    /// (reference): the server's read in the middle of its two, the client's midpoint, half the round trip as
    /// the deviation.
    pub fn as_calibration_sample(&self) -> CalibrationSample {
        let server_mid = self.t2_server_receive_ns / 2
            + self.t3_server_send_ns / 2
            + (self.t2_server_receive_ns % 2 + self.t3_server_send_ns % 2) / 2;
        let client_mid = self.t1_client_send_ns / 2
            + self.t4_client_receive_ns / 2
            + (self.t1_client_send_ns % 2 + self.t4_client_receive_ns % 2) / 2;
        CalibrationSample {
            source_ticks: server_mid,
            reference_ns: client_mid,
            max_deviation_ns: self.round_trip_ns().div_ceil(2).max(1),
        }
    }

    /// The same round seen the other way: the client's clock (source) against the server's (reference).
    pub fn as_reverse_calibration_sample(&self) -> CalibrationSample {
        let s = self.as_calibration_sample();
        CalibrationSample {
            source_ticks: s.reference_ns,
            reference_ns: s.source_ticks,
            max_deviation_ns: s.max_deviation_ns,
        }
    }
}

const EXCHANGE_MAGIC: [u8; 4] = *b"TKLX";
const EXCHANGE_VERSION: u32 = 1;
const MSG_ROUND: u8 = 1;
const MSG_REPORT: u8 = 2;

/// How a [`ClockExchange`] measures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClockExchangeConfig {
    /// Time between bursts (the client starts them).
    pub interval: Duration,
    /// Rounds per burst; the merge keeps the tightest (minimum round trip).
    pub rounds_per_burst: u32,
    /// This side's machine id (default: [`MachineId::current`]).
    pub machine_id: MachineId,
    /// A simulated clock for this exchange only (the test hook; default: the process-wide one).
    #[doc(hidden)]
    pub simulate: Option<SimulatedClock>,
}

impl Default for ClockExchangeConfig {
    fn default() -> Self {
        ClockExchangeConfig {
            interval: Duration::from_millis(500),
            rounds_per_burst: 8,
            machine_id: MachineId::current(),
            simulate: simulation().copied(),
        }
    }
}

impl ClockExchangeConfig {
    fn now_ns(&self) -> u64 {
        match &self.simulate {
            Some(sim) => {
                let mono = clock_ns(libc::CLOCK_MONOTONIC);
                clock_ns(libc::CLOCK_BOOTTIME).wrapping_add_signed(sim.shift_ns(mono))
            }
            None => clock_ns(libc::CLOCK_BOOTTIME),
        }
    }
}

struct ExchangeShared {
    config: ClockExchangeConfig,
    samples: Mutex<Vec<ExchangeSample>>,
    peers: Mutex<Vec<(MachineId, String)>>,
    stop: AtomicBool,
    local_addr: Option<SocketAddr>,
    /// Client side: the connection, for [`ClockExchange::sync_now`] and the background bursts.
    client: Mutex<Option<ClientConn>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    errors: Mutex<Option<String>>,
}

struct ClientConn {
    stream: TcpStream,
    peer: MachineId,
    next_burst: u64,
}

/// A clock exchange between two tickline processes over TCP: NTP's four timestamps, in bursts.
///
/// One process [`listen`](ClockExchange::listen)s (it answers any number of peers), the other
/// [`connect`](ClockExchange::connect)s and starts a burst of rounds every
/// [`interval`](ClockExchangeConfig::interval); after each burst it sends the finished rounds back, so both
/// sides hold every [`ExchangeSample`]. Give the handle to the Perfetto exporter
/// (`PerfettoExporter::clock_exchange`) and each trace stores the samples; `tickline merge` then aligns the two
/// machines with them instead of their `CLOCK_REALTIME`s, with the round trip as the uncertainty. Its threads
/// run until [`shutdown`](ClockExchange::shutdown) (or the process ends).
///
/// ```
/// let server = tickline::sync::ClockExchange::listen("127.0.0.1:0").unwrap();
/// let client = tickline::sync::ClockExchange::connect(server.local_addr().unwrap()).unwrap();
/// client.sync_now().unwrap();
/// let best = client.samples().iter().map(|s| s.round_trip_ns()).min().unwrap();
/// assert!(best < 50_000_000, "loopback round trip {best} ns");
/// # client.shutdown(); server.shutdown();
/// ```
#[derive(Clone)]
pub struct ClockExchange {
    shared: Arc<ExchangeShared>,
}

impl std::fmt::Debug for ClockExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClockExchange")
            .field("machine_id", &self.shared.config.machine_id)
            .field("local_addr", &self.shared.local_addr)
            .field("samples", &self.samples_len())
            .finish()
    }
}

fn write_hello(stream: &mut TcpStream, id: MachineId) -> io::Result<()> {
    let host = &HostInfo::current().host_name;
    let name = host.as_bytes();
    let mut msg = Vec::with_capacity(18 + name.len());
    msg.extend_from_slice(&EXCHANGE_MAGIC);
    msg.extend_from_slice(&EXCHANGE_VERSION.to_le_bytes());
    msg.extend_from_slice(&id.0.to_le_bytes());
    msg.extend_from_slice(&(name.len().min(255) as u16).to_le_bytes());
    msg.extend_from_slice(&name[..name.len().min(255)]);
    stream.write_all(&msg)
}

fn read_hello(stream: &mut TcpStream) -> io::Result<(MachineId, String)> {
    let mut head = [0u8; 18];
    stream.read_exact(&mut head)?;
    if head[..4] != EXCHANGE_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer is not a tickline clock exchange",
        ));
    }
    let version = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
    if version != EXCHANGE_VERSION {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("clock exchange version {version}, expected {EXCHANGE_VERSION}"),
        ));
    }
    let id = MachineId(u64::from_le_bytes(head[8..16].try_into().expect("8 bytes")));
    let len = u16::from_le_bytes(head[16..18].try_into().expect("2 bytes")) as usize;
    let mut name = vec![0u8; len];
    stream.read_exact(&mut name)?;
    Ok((id, String::from_utf8_lossy(&name).into_owned()))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl ClockExchange {
    /// Listens on `addr` (e.g. `"0.0.0.0:7077"`, or port 0 for any) and answers every peer that connects, on
    /// a background thread per peer.
    pub fn listen(addr: impl ToSocketAddrs) -> io::Result<ClockExchange> {
        Self::listen_with(addr, ClockExchangeConfig::default())
    }

    /// [`listen`](Self::listen) with a configuration.
    pub fn listen_with(addr: impl ToSocketAddrs, config: ClockExchangeConfig) -> io::Result<ClockExchange> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(ExchangeShared::new(config, Some(listener.local_addr()?)));
        let accept_shared = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("tickline-clock-exchange".into())
            .spawn(move || accept_loop(listener, accept_shared))?;
        shared.threads.lock().unwrap_or_else(|e| e.into_inner()).push(handle);
        Ok(ClockExchange { shared })
    }

    /// Connects to a listening peer and starts a burst every [`ClockExchangeConfig::interval`] (the first one
    /// now) on a background thread.
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<ClockExchange> {
        Self::connect_with(addr, ClockExchangeConfig::default())
    }

    /// [`connect`](Self::connect) with a configuration.
    pub fn connect_with(addr: impl ToSocketAddrs, config: ClockExchangeConfig) -> io::Result<ClockExchange> {
        let mut stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        write_hello(&mut stream, config.machine_id)?;
        let (peer, host) = read_hello(&mut stream).map_err(|e| match e.kind() {
            // The read timeout: a listener that accepted but never answered (not a clock exchange).
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no answer within 5 s from {}: not a tickline clock exchange (ClockExchange::listen)?",
                    stream
                        .peer_addr()
                        .map_or_else(|_| "the peer".to_owned(), |a| a.to_string())
                ),
            ),
            _ => e,
        })?;
        let shared = Arc::new(ExchangeShared::new(config, stream.local_addr().ok()));
        shared
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((peer, host));
        *shared.client.lock().unwrap_or_else(|e| e.into_inner()) = Some(ClientConn {
            stream,
            peer,
            next_burst: 0,
        });
        let exchange = ClockExchange { shared };
        exchange.sync_now()?;
        let bg = exchange.clone();
        let handle = std::thread::Builder::new()
            .name("tickline-clock-exchange".into())
            .spawn(move || {
                let mut last = Instant::now();
                while !bg.shared.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(10));
                    if last.elapsed() >= bg.shared.config.interval {
                        last = Instant::now();
                        if let Err(e) = bg.sync_now() {
                            // After a shutdown the burst fails by design: no error to report.
                            if !bg.shared.stop.load(Ordering::Relaxed) {
                                bg.shared.note_error(format!("clock exchange burst failed: {e}"));
                            }
                            break;
                        }
                    }
                }
            })?;
        exchange
            .shared
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle);
        Ok(exchange)
    }

    /// Runs one burst now (client side; a listening side returns at once). Call it before a trace ends so
    /// its last moments are bracketed by samples on both sides. After [`shutdown`](Self::shutdown): an error
    /// (`NotConnected`).
    pub fn sync_now(&self) -> io::Result<()> {
        if self.shared.stop.load(Ordering::Relaxed) {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the clock exchange was shut down",
            ));
        }
        let mut guard = self.shared.client.lock().unwrap_or_else(|e| e.into_inner());
        let Some(conn) = guard.as_mut() else {
            return Ok(());
        };
        let config = &self.shared.config;
        let burst = conn.next_burst;
        conn.next_burst += 1;
        let mut rounds = Vec::with_capacity(config.rounds_per_burst as usize);
        for seq in 0..config.rounds_per_burst.max(1) {
            let mut msg = [0u8; 21];
            msg[0] = MSG_ROUND;
            msg[1..9].copy_from_slice(&burst.to_le_bytes());
            msg[9..13].copy_from_slice(&seq.to_le_bytes());
            let t1 = config.now_ns();
            msg[13..21].copy_from_slice(&t1.to_le_bytes());
            conn.stream.write_all(&msg)?;
            let mut answer = [0u8; 16];
            conn.stream.read_exact(&mut answer)?;
            let t4 = config.now_ns();
            rounds.push(ExchangeSample {
                client: config.machine_id,
                server: conn.peer,
                burst,
                t1_client_send_ns: t1,
                t2_server_receive_ns: u64_at(&answer, 0),
                t3_server_send_ns: u64_at(&answer, 8),
                t4_client_receive_ns: t4,
            });
        }
        // The finished rounds go back to the server so its trace holds them too (after the burst, so the
        // report never delays a round).
        let mut report = Vec::with_capacity(5 + rounds.len() * 32);
        report.push(MSG_REPORT);
        report.extend_from_slice(&(rounds.len() as u32).to_le_bytes());
        for r in &rounds {
            for t in [
                r.t1_client_send_ns,
                r.t2_server_receive_ns,
                r.t3_server_send_ns,
                r.t4_client_receive_ns,
            ] {
                report.extend_from_slice(&t.to_le_bytes());
            }
        }
        report.extend_from_slice(&burst.to_le_bytes());
        conn.stream.write_all(&report)?;
        self.shared
            .samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(rounds);
        Ok(())
    }

    /// Where it listens (server) or its local end (client).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.shared.local_addr
    }

    /// This side's machine id.
    pub fn machine_id(&self) -> MachineId {
        self.shared.config.machine_id
    }

    /// The peers seen so far: machine id and host name.
    pub fn peers(&self) -> Vec<(MachineId, String)> {
        self.shared.peers.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Every sample so far, in the order they were taken (per peer).
    pub fn samples(&self) -> Vec<ExchangeSample> {
        self.shared.samples.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The samples from index `from` on, and the index to ask from next time (what an exporter drains).
    pub fn samples_since(&self, from: usize) -> (Vec<ExchangeSample>, usize) {
        let samples = self.shared.samples.lock().unwrap_or_else(|e| e.into_inner());
        let from = from.min(samples.len());
        (samples[from..].to_vec(), samples.len())
    }

    fn samples_len(&self) -> usize {
        self.shared.samples.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The first error the background threads met (a peer that vanished mid-round, a bad hello), if any.
    pub fn error(&self) -> Option<String> {
        self.shared.errors.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stops the background threads and closes the connections; the samples stay readable.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(conn) = self.shared.client.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = conn.stream.shutdown(std::net::Shutdown::Both);
        }
        let threads: Vec<_> = self
            .shared
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

impl ExchangeShared {
    fn new(config: ClockExchangeConfig, local_addr: Option<SocketAddr>) -> Self {
        ExchangeShared {
            config,
            samples: Mutex::new(Vec::new()),
            peers: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            local_addr,
            client: Mutex::new(None),
            threads: Mutex::new(Vec::new()),
            errors: Mutex::new(None),
        }
    }

    fn note_error(&self, message: String) {
        let mut e = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            *e = Some(message);
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<ExchangeShared>) {
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let peer_shared = Arc::clone(&shared);
                let spawned = std::thread::Builder::new()
                    .name("tickline-clock-exchange-peer".into())
                    .spawn(move || {
                        if let Err(e) = serve_peer(stream, &peer_shared) {
                            if !peer_shared.stop.load(Ordering::Relaxed) && e.kind() != io::ErrorKind::UnexpectedEof {
                                peer_shared.note_error(format!("clock exchange peer: {e}"));
                            }
                        }
                    });
                match spawned {
                    Ok(h) => shared.threads.lock().unwrap_or_else(|e| e.into_inner()).push(h),
                    Err(e) => shared.note_error(format!("cannot start a clock exchange thread: {e}")),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                shared.note_error(format!("clock exchange accept: {e}"));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn serve_peer(mut stream: TcpStream, shared: &ExchangeShared) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    // Wake now and then to notice a shutdown.
    stream.set_read_timeout(Some(Duration::from_millis(200)))?;
    let (peer, host) = loop {
        match read_hello(&mut stream) {
            Ok(h) => break h,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                if shared.stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
            }
            Err(e) => return Err(e),
        }
    };
    write_hello(&mut stream, shared.config.machine_id)?;
    shared
        .peers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((peer, host));
    let config = &shared.config;
    loop {
        // Between messages too: a peer that keeps sending (bursts closer than the read timeout) never lets a
        // read time out.
        if shared.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut kind = [0u8; 1];
        match stream.read_exact(&mut kind) {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                if shared.stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        // The rest of a message follows at once; a longer timeout for it.
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        match kind[0] {
            MSG_ROUND => {
                let mut rest = [0u8; 20];
                stream.read_exact(&mut rest)?;
                let t2 = config.now_ns();
                let mut answer = [0u8; 16];
                answer[..8].copy_from_slice(&t2.to_le_bytes());
                let t3 = config.now_ns();
                answer[8..].copy_from_slice(&t3.to_le_bytes());
                stream.write_all(&answer)?;
            }
            MSG_REPORT => {
                let mut n = [0u8; 4];
                stream.read_exact(&mut n)?;
                let n = u32::from_le_bytes(n) as usize;
                if n > 4096 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "clock exchange report too long",
                    ));
                }
                let mut body = vec![0u8; n * 32 + 8];
                stream.read_exact(&mut body)?;
                let burst = u64_at(&body, n * 32);
                let mut samples = shared.samples.lock().unwrap_or_else(|e| e.into_inner());
                for i in 0..n {
                    let at = i * 32;
                    samples.push(ExchangeSample {
                        client: peer,
                        server: config.machine_id,
                        burst,
                        t1_client_send_ns: u64_at(&body, at),
                        t2_server_receive_ns: u64_at(&body, at + 8),
                        t3_server_send_ns: u64_at(&body, at + 16),
                        t4_client_receive_ns: u64_at(&body, at + 24),
                    });
                }
            }
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unknown clock exchange message {other}"),
                ))
            }
        }
        stream.set_read_timeout(Some(Duration::from_millis(200)))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_are_bracketed_and_consistent() {
        let r = read_real_clocks();
        assert!(r.bracket_ns < 1_000_000, "{r:?}");
        assert!(r.boottime_ns + r.bracket_ns >= r.monotonic_ns, "{r:?}");
        let later = read_real_clocks();
        assert!(later.monotonic_ns >= r.monotonic_ns);
    }

    /// BOOTTIME runs at MONOTONIC's rate (their difference is the time suspended), so the readings' difference
    /// must be the clocks' own, as a tight bracket around one BOOTTIME read measures it: read in one bracket
    /// with the others, BOOTTIME sat 15-25 ns before the bracket's middle.
    #[test]
    fn readings_stand_for_one_moment() {
        let median = |mut v: Vec<i64>| {
            v.sort_unstable();
            v[v.len() / 2]
        };
        let mut tight: Vec<(u64, i64)> = (0..2_000)
            .map(|_| {
                let a = clock_ns(libc::CLOCK_MONOTONIC);
                let boot = clock_ns(libc::CLOCK_BOOTTIME);
                let b = clock_ns(libc::CLOCK_MONOTONIC);
                (b - a, boot as i64 - (a + (b - a) / 2) as i64)
            })
            .collect();
        tight.sort_unstable();
        let truth = median(tight[..200].iter().map(|&(_, offset)| offset).collect());
        let readings = median(
            (0..500)
                .map(|_| {
                    let r = read_real_clocks();
                    r.boottime_ns as i64 - r.monotonic_ns as i64
                })
                .collect(),
        );
        assert!(
            (readings - truth).abs() <= 5,
            "BOOTTIME - MONOTONIC: {readings} ns in the readings, {truth} ns"
        );
    }

    #[test]
    fn the_simulation_shifts_and_drifts() {
        let mut sim =
            SimulatedClock::parse("offset_ns=-5000,drift_ppm=100,realtime_error_ns=7,max_error_us=3").unwrap();
        sim.anchor_monotonic_ns = 1_000_000_000;
        assert_eq!(sim.shift_ns(1_000_000_000), -5_000);
        assert_eq!(sim.shift_ns(2_000_000_000), -5_000 + 100_000);
        let r = ClockReadings {
            boottime_ns: 3_000_000_000,
            monotonic_ns: 2_000_000_000,
            monotonic_raw_ns: 2_000_000_100,
            realtime_ns: 10,
            bracket_ns: 40,
        };
        let s = sim.apply(r);
        assert_eq!(s.boottime_ns, 3_000_095_000);
        assert_eq!(s.monotonic_raw_ns, 2_000_095_100);
        assert_eq!(s.realtime_ns, 17);
        assert_eq!(sim.time_sync.unwrap().max_error_ns, 3_000);
        assert!(SimulatedClock::parse("offset=1").is_err());
        assert!(SimulatedClock::parse("drift_ppm=nan").is_err());
    }

    #[test]
    fn uuids_and_machine_ids_are_well_formed() {
        let u = TraceUuid::new_random();
        let s = u.to_string();
        assert_eq!(&s[14..15], "4", "{s}");
        assert_ne!(u.salt32(), 0);
        assert_eq!(MachineId::from_name("a"), MachineId::from_name("a"));
        assert_ne!(HostInfo::current().host_name, "");
    }

    #[test]
    fn a_listener_that_never_answers_and_a_burst_after_shutdown_are_clear_errors() {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        let holder = std::thread::spawn(move || {
            let accepted = silent.accept();
            std::thread::sleep(Duration::from_secs(6));
            drop(accepted);
        });
        let Err(err) = ClockExchange::connect(addr) else {
            panic!("nothing answered, yet it connected")
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("not a tickline clock exchange"), "{err}");
        holder.join().unwrap();

        let server = ClockExchange::listen("127.0.0.1:0").unwrap();
        let client = ClockExchange::connect(server.local_addr().unwrap()).unwrap();
        client.sync_now().unwrap();
        client.shutdown();
        let err = client.sync_now().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotConnected, "{err}");
        server.shutdown();
        assert_eq!(server.sync_now().unwrap_err().kind(), io::ErrorKind::NotConnected);
    }

    /// A server whose client sends bursts every 10 ms (never 200 ms without a message) stops promptly.
    #[test]
    fn a_server_stops_while_its_client_keeps_sending() {
        let server = ClockExchange::listen("127.0.0.1:0").unwrap();
        let client = ClockExchange::connect_with(
            server.local_addr().unwrap(),
            ClockExchangeConfig {
                interval: Duration::from_millis(10),
                ..ClockExchangeConfig::default()
            },
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let (done, stopped) = std::sync::mpsc::channel();
        let stopping = std::thread::spawn(move || {
            server.shutdown();
            let _ = done.send(());
        });
        let result = stopped.recv_timeout(Duration::from_secs(2));
        // Unblocks a server still waiting (the client's end closes the connection).
        client.shutdown();
        stopping.join().unwrap();
        assert!(
            result.is_ok(),
            "the server did not stop within 2 s while its client kept sending"
        );
    }

    /// Loopback, with the server's clock 2.5 ms ahead and running 300 ppm fast through the hook: every
    /// round's bracket holds the true offset (which the test knows), and the bursts follow its drift.
    #[test]
    fn loopback_exchange_recovers_a_simulated_offset_and_drift() {
        let mut sim = SimulatedClock::parse("offset_ns=2500000,drift_ppm=300").unwrap();
        sim.anchor_monotonic_ns = clock_ns(libc::CLOCK_MONOTONIC);
        let server = ClockExchange::listen_with(
            "127.0.0.1:0",
            ClockExchangeConfig {
                machine_id: MachineId::from_name("server"),
                simulate: Some(sim),
                ..ClockExchangeConfig::default()
            },
        )
        .unwrap();
        let client = ClockExchange::connect_with(
            server.local_addr().unwrap(),
            ClockExchangeConfig {
                machine_id: MachineId::from_name("client"),
                simulate: None,
                interval: Duration::from_millis(100),
                ..ClockExchangeConfig::default()
            },
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(450));
        client.sync_now().unwrap();
        let samples = client.samples();
        assert!(samples.len() >= 8 * 3, "{}", samples.len());
        for s in &samples {
            assert_eq!(
                (s.client, s.server),
                (MachineId::from_name("client"), MachineId::from_name("server"))
            );
            // The truth at the client's midpoint: the server's shift there (client = real clock).
            let mid_mono = {
                // Both sides read BOOTTIME; the shift is a function of real MONOTONIC, which moves with it.
                let boot_minus_mono = clock_ns(libc::CLOCK_BOOTTIME) as i128 - clock_ns(libc::CLOCK_MONOTONIC) as i128;
                ((s.t1_client_send_ns as i128 + s.t4_client_receive_ns as i128) / 2 - boot_minus_mono) as u64
            };
            let truth = sim.shift_ns(mid_mono);
            let c = s.as_calibration_sample();
            let error = (s.offset_ns() - truth).unsigned_abs();
            assert!(
                error <= c.max_deviation_ns + 1_000,
                "offset {} vs truth {truth}, ±{}",
                s.offset_ns(),
                c.max_deviation_ns
            );
        }
        // The server holds the same samples, reported back after each burst.
        let deadline = Instant::now() + Duration::from_secs(2);
        while server.samples().len() < samples.len() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let on_server = server.samples();
        assert_eq!(on_server.len(), samples.len());
        assert_eq!(on_server[0].t2_server_receive_ns, samples[0].t2_server_receive_ns);
        assert_eq!(server.peers()[0].0, MachineId::from_name("client"));
        client.shutdown();
        server.shutdown();
        assert!(client.error().is_none(), "{:?}", client.error());
    }
}
