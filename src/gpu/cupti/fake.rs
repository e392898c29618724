//! A stand-in for CUPTI and the GPU, for tests: the entry points `Cupti` calls are functions here, the API
//! callback is called as CUPTI calls it (synchronously, on the "launching" thread), and activity records are
//! queued and handed out at a flush in buffers laid out as CUPTI 13.0 lays them out. CUPTI is process-wide, so
//! a test holds [`serial`] while it uses this.

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, MutexGuard};

use super::ffi::{self, ApiCallback, BufferCompleted, BufferRequested, Cupti, CuptiResult, TimestampCallback};
use super::lock;

/// Bytes per record in a fake buffer (a `CUpti_ActivityKernel10`'s size; every record kind fits).
const SLOT: usize = 216;

#[derive(Default)]
struct Fake {
    requested: Option<BufferRequested>,
    completed: Option<BufferCompleted>,
    api: Option<(ApiCallback, usize)>,
    timestamp: Option<TimestampCallback>,
    pending: Vec<[u8; SLOT]>,
    dropped: usize,
    next_correlation: u32,
    enabled: Vec<u32>,
}

static FAKE: Mutex<Option<Fake>> = Mutex::new(None);
static SERIAL: Mutex<()> = Mutex::new(());

/// Held by a test for as long as it uses the fake (and so the process' one capture); resets the fake.
pub(super) fn serial() -> MutexGuard<'static, ()> {
    let guard = lock(&SERIAL);
    *lock(&FAKE) = Some(Fake {
        next_correlation: 1,
        ..Fake::default()
    });
    guard
}

fn with<T>(f: impl FnOnce(&mut Fake) -> T) -> T {
    f(lock(&FAKE).get_or_insert_with(Fake::default))
}

unsafe extern "C" fn get_result_string(result: CuptiResult, text: *mut *const c_char) -> CuptiResult {
    let name: &'static CStr = match result {
        ffi::MULTIPLE_SUBSCRIBERS => c"CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED",
        _ => c"CUPTI_ERROR_UNKNOWN",
    };
    // SAFETY: the caller passes a writable out-parameter.
    unsafe { *text = name.as_ptr() };
    ffi::SUCCESS
}
unsafe extern "C" fn register_callbacks(requested: BufferRequested, completed: BufferCompleted) -> CuptiResult {
    with(|f| (f.requested, f.completed) = (Some(requested), Some(completed)));
    ffi::SUCCESS
}
unsafe extern "C" fn register_timestamp_callback(callback: TimestampCallback) -> CuptiResult {
    with(|f| f.timestamp = Some(callback));
    ffi::SUCCESS
}
unsafe extern "C" fn enable(kind: u32) -> CuptiResult {
    with(|f| f.enabled.push(kind));
    ffi::SUCCESS
}
unsafe extern "C" fn disable(kind: u32) -> CuptiResult {
    with(|f| f.enabled.retain(|&k| k != kind));
    ffi::SUCCESS
}
/// Walks a fake buffer: records every [`SLOT`] bytes.
unsafe extern "C" fn next_record(buffer: *mut u8, valid: usize, record: *mut *mut u8) -> CuptiResult {
    // SAFETY: the caller passes a writable out-parameter holding null or the previous record.
    let previous = unsafe { *record };
    let next = if previous.is_null() {
        0
    } else {
        previous as usize - buffer as usize + SLOT
    };
    if next + SLOT > valid {
        return 12; // CUPTI_ERROR_MAX_LIMIT_REACHED
    }
    // SAFETY: as above; `next` lies inside the buffer.
    unsafe { *record = buffer.add(next) };
    ffi::SUCCESS
}
unsafe extern "C" fn dropped_records(_context: *mut c_void, _stream: u32, dropped: *mut usize) -> CuptiResult {
    let n = with(|f| std::mem::take(&mut f.dropped));
    // SAFETY: the caller passes a writable out-parameter.
    unsafe { *dropped = n };
    ffi::SUCCESS
}
/// Hands every queued record out in one buffer, as CUPTI does at a flush (its callbacks run outside the
/// fake's lock: they call back into it).
unsafe extern "C" fn flush_all(_flag: u32) -> CuptiResult {
    let (records, requested, completed) = with(|f| (std::mem::take(&mut f.pending), f.requested, f.completed));
    let (Some(requested), Some(completed)) = (requested, completed) else {
        return ffi::SUCCESS;
    };
    let (mut buffer, mut size, mut max) = (std::ptr::null_mut(), 0usize, 0usize);
    // SAFETY: three writable out-parameters, as CUPTI passes them.
    unsafe { requested(&mut buffer, &mut size, &mut max) };
    let fit = (size / SLOT).min(records.len());
    if buffer.is_null() || fit < records.len() {
        with(|f| f.dropped += records.len() - fit);
    }
    if buffer.is_null() {
        return ffi::SUCCESS;
    }
    for (i, record) in records.iter().take(fit).enumerate() {
        // SAFETY: slot `i` lies inside the `size` bytes handed to us (`fit` records fit).
        unsafe { std::ptr::copy_nonoverlapping(record.as_ptr(), buffer.add(i * SLOT), SLOT) };
    }
    // SAFETY: the buffer `requested` gave, `fit` records of it valid.
    unsafe { completed(std::ptr::null_mut(), 0, buffer, size, fit * SLOT) };
    ffi::SUCCESS
}
unsafe extern "C" fn subscribe(subscriber: *mut *mut c_void, callback: ApiCallback, user: *mut c_void) -> CuptiResult {
    let taken = with(|f| {
        let taken = f.api.is_some();
        if !taken {
            f.api = Some((callback, user as usize));
        }
        taken
    });
    if taken {
        return ffi::MULTIPLE_SUBSCRIBERS;
    }
    // SAFETY: the caller passes a writable out-parameter; any non-null handle will do.
    unsafe { *subscriber = std::ptr::dangling_mut::<c_void>() };
    ffi::SUCCESS
}
unsafe extern "C" fn unsubscribe(_subscriber: *mut c_void) -> CuptiResult {
    with(|f| f.api = None);
    ffi::SUCCESS
}
unsafe extern "C" fn enable_callback(_on: u32, _subscriber: *mut c_void, _domain: u32, _cbid: u32) -> CuptiResult {
    ffi::SUCCESS
}
/// A stream's id: its handle's value; the legacy default stream (null) is 7, as CUDA 13 numbers it; a thread's
/// per-thread default stream has an id of its own (from 100), as in CUDA.
unsafe extern "C" fn stream_id(
    _context: *mut c_void,
    stream: *mut c_void,
    per_thread: u8,
    id: *mut u32,
) -> CuptiResult {
    thread_local!(static PER_THREAD: u32 = {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(100);
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    });
    let value = match (stream.is_null(), per_thread != 0) {
        (true, true) => PER_THREAD.with(|p| *p),
        (true, false) => 7,
        (false, _) => stream as usize as u32,
    };
    // SAFETY: the caller passes a writable out-parameter.
    unsafe { *id = value };
    ffi::SUCCESS
}

/// The fake's entry points as a `Cupti`. `flush_period: None`, so the capture flushes itself.
pub(super) fn cupti() -> Cupti {
    Cupti {
        path: "fake libcupti".into(),
        version: 130_001,
        get_result_string,
        register_callbacks,
        register_timestamp_callback: Some(register_timestamp_callback),
        enable,
        disable,
        next_record,
        dropped_records,
        flush_all,
        flush_period: None,
        subscribe,
        unsubscribe,
        enable_callback,
        stream_id,
        _library: None,
    }
}

/// Makes a driver call `cbid` on this thread: CUPTI's callback at its entry, then at its exit. Returns the
/// call's correlation id.
pub(super) fn call(cbid: u32, symbol: Option<&CStr>, params: *const c_void) -> u32 {
    let (api, correlation) = with(|f| {
        let id = f.next_correlation;
        f.next_correlation += 1;
        (f.api, id)
    });
    if let Some((callback, user)) = api {
        for site in [ffi::API_ENTER, 1] {
            let data = ffi::CallbackData {
                site,
                function_name: c"cuFake".as_ptr(),
                function_params: params,
                return_value: std::ptr::null(),
                symbol_name: symbol.map_or(std::ptr::null(), CStr::as_ptr),
                context: std::ptr::null_mut(),
                context_uid: 1,
                correlation_data: std::ptr::null_mut(),
                correlation_id: correlation,
            };
            // SAFETY: the callback and user pointer the capture subscribed with; `data` is a live
            // `CUpti_CallbackData` for the driver domain, as CUPTI passes it.
            unsafe {
                callback(
                    user as *mut c_void,
                    ffi::DOMAIN_DRIVER,
                    cbid,
                    (&data as *const ffi::CallbackData).cast(),
                )
            };
        }
    }
    correlation
}

/// Queues an activity record of `kind` (a CUPTI activity kind), handed out at the next flush.
pub(super) fn record(kind: u32, correlation: u32, start: u64, end: u64, stream: u32) {
    node(kind, correlation, (start, end), stream, 0, None);
}

/// Queues a record of graph node `node` (0: not a node), a kernel named `name` where given.
pub(super) fn node(
    kind: u32,
    correlation: u32,
    (start, end): (u64, u64),
    stream: u32,
    node: u64,
    name: Option<&'static CStr>,
) {
    let mut bytes = [0u8; SLOT];
    let kernel = kind == ffi::KIND_CONCURRENT_KERNEL || kind == ffi::KIND_KERNEL;
    let (s, e, st, c, n) = if kernel {
        (16, 24, 48, 92, 144)
    } else {
        (16, 24, 40, 44, 64)
    };
    bytes[..4].copy_from_slice(&kind.to_le_bytes());
    bytes[s..s + 8].copy_from_slice(&start.to_le_bytes());
    bytes[e..e + 8].copy_from_slice(&end.to_le_bytes());
    bytes[st..st + 4].copy_from_slice(&stream.to_le_bytes());
    bytes[c..c + 4].copy_from_slice(&correlation.to_le_bytes());
    bytes[n..n + 8].copy_from_slice(&node.to_le_bytes());
    if let (true, Some(name)) = (kernel, name) {
        // The name's address, as CUPTI stores its own (exposed: the capture reads it back as a pointer).
        bytes[104..112].copy_from_slice(&(name.as_ptr().expose_provenance() as u64).to_le_bytes());
    }
    with(|f| f.pending.push(bytes));
}

/// Hands out what is queued now, as CUPTI's own flush thread does at any moment.
pub(super) fn flush() {
    // SAFETY: no argument to uphold; the capture's buffer callbacks catch every panic.
    unsafe { flush_all(0) };
}

/// Records CUPTI dropped (reported at the next buffer).
pub(super) fn drop_records(n: usize) {
    with(|f| f.dropped += n);
}

/// Whether the capture registered a timestamp callback, and its current value.
pub(super) fn timestamp() -> Option<u64> {
    // SAFETY: the capture's `extern "C" fn() -> u64`.
    with(|f| f.timestamp).map(|t| unsafe { t() })
}

/// Activity kinds enabled now.
pub(super) fn enabled() -> Vec<u32> {
    with(|f| f.enabled.clone())
}
