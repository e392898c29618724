//! CUPTI's C interface: the library, opened at run time; the entry points tickline calls; the callback and
//! activity record layouts it reads. Every field read here sits at the same offset in CUPTI 12.8's and 13.0's
//! headers (`CUpti_ActivityKernel9`/`10`, `CUpti_ActivityMemcpy5`/`6`, `CUpti_ActivityMemset4`,
//! `CUpti_CallbackData`; offsets printed by `offsetof` against both, and checked by the tests below).

use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};

use libloading::Library;

use crate::gpu::GpuError;

pub(crate) type CuptiResult = u32;
pub(crate) const SUCCESS: CuptiResult = 0;
/// `cuptiSubscribe`: another CUPTI client (Nsight Systems, another profiler) holds the one subscription.
pub(crate) const MULTIPLE_SUBSCRIBERS: CuptiResult = 39;

pub(crate) const KIND_MEMCPY: u32 = 1;
pub(crate) const KIND_MEMSET: u32 = 2;
pub(crate) const KIND_KERNEL: u32 = 3;
pub(crate) const KIND_CONCURRENT_KERNEL: u32 = 10;
pub(crate) const DOMAIN_DRIVER: u32 = 1;
pub(crate) const API_ENTER: u32 = 0;
/// `cuptiActivityFlushAll`: also hand out buffers whose records are not all complete.
pub(crate) const FLUSH_FORCED: u32 = 1;

pub(crate) type BufferRequested = unsafe extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
pub(crate) type BufferCompleted = unsafe extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);
pub(crate) type ApiCallback = unsafe extern "C" fn(*mut c_void, u32, u32, *const c_void);
pub(crate) type TimestampCallback = unsafe extern "C" fn() -> u64;

/// `CUpti_CallbackData`, as CUPTI passes it to an API callback.
#[repr(C)]
pub(crate) struct CallbackData {
    pub(crate) site: u32,
    pub(crate) function_name: *const c_char,
    pub(crate) function_params: *const c_void,
    pub(crate) return_value: *const c_void,
    pub(crate) symbol_name: *const c_char,
    pub(crate) context: *mut c_void,
    pub(crate) context_uid: u32,
    pub(crate) correlation_data: *mut u64,
    pub(crate) correlation_id: u32,
}

/// The library's entry points. The library is never unloaded (`_library` is leaked): CUPTI's threads and
/// thread-exit hooks point into it for the rest of the process, and unloading it crashed a thread at its exit
/// after a failed start. A test's stand-in has no library: its entry points are functions of the test.
pub(crate) struct Cupti {
    pub(crate) path: PathBuf,
    pub(crate) version: u32,
    pub(crate) get_result_string: unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult,
    pub(crate) register_callbacks: unsafe extern "C" fn(BufferRequested, BufferCompleted) -> CuptiResult,
    pub(crate) register_timestamp_callback: Option<unsafe extern "C" fn(TimestampCallback) -> CuptiResult>,
    pub(crate) enable: unsafe extern "C" fn(u32) -> CuptiResult,
    pub(crate) disable: unsafe extern "C" fn(u32) -> CuptiResult,
    pub(crate) next_record: unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> CuptiResult,
    pub(crate) dropped_records: unsafe extern "C" fn(*mut c_void, u32, *mut usize) -> CuptiResult,
    pub(crate) flush_all: unsafe extern "C" fn(u32) -> CuptiResult,
    pub(crate) flush_period: Option<unsafe extern "C" fn(u32) -> CuptiResult>,
    pub(crate) subscribe: unsafe extern "C" fn(*mut *mut c_void, ApiCallback, *mut c_void) -> CuptiResult,
    pub(crate) unsubscribe: unsafe extern "C" fn(*mut c_void) -> CuptiResult,
    pub(crate) enable_callback: unsafe extern "C" fn(u32, *mut c_void, u32, u32) -> CuptiResult,
    pub(crate) stream_id: unsafe extern "C" fn(*mut c_void, *mut c_void, u8, *mut u32) -> CuptiResult,
    pub(crate) _library: Option<&'static Library>,
}

/// Where CUPTI is looked for when no path is given: `TICKLINE_CUPTI_LIBRARY`, then the loader's search path,
/// then the CUDA toolkit's usual places.
fn candidates(explicit: Option<&Path>) -> Vec<PathBuf> {
    if let Some(path) = explicit {
        return vec![path.to_path_buf()];
    }
    let mut out = Vec::new();
    if let Some(path) = std::env::var_os("TICKLINE_CUPTI_LIBRARY").filter(|p| !p.is_empty()) {
        out.push(PathBuf::from(path));
    }
    for name in ["libcupti.so", "libcupti.so.13", "libcupti.so.12"] {
        out.push(PathBuf::from(name));
    }
    for dir in [
        "/usr/local/cuda/extras/CUPTI/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/cuda/lib64",
    ] {
        out.push(Path::new(dir).join("libcupti.so"));
    }
    out
}

impl Cupti {
    /// Opens CUPTI: the given library, or the first of [`candidates`] that loads. `NoLoader` names every place
    /// tried when none does, or the entry point a library lacks.
    pub(crate) fn open(explicit: Option<&Path>) -> Result<Cupti, GpuError> {
        let mut tried = Vec::new();
        for path in candidates(explicit) {
            // SAFETY: loading CUPTI runs its initialisers, which is how it is meant to be loaded; it is the
            // documented way to use CUPTI without linking it. No invariant of ours depends on them.
            match unsafe { Library::new(&path) } {
                Ok(library) => return Cupti::bind(library, path),
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            }
        }
        Err(GpuError::NoLoader {
            detail: format!(
                "CUPTI (libcupti.so) could not be opened; set TICKLINE_CUPTI_LIBRARY or CuptiOptions::library to \
                 its path (tried {})",
                tried.join("; ")
            ),
        })
    }

    fn bind(library: Library, path: PathBuf) -> Result<Cupti, GpuError> {
        // Never unloaded (see `Cupti`): one leaked handle per open, and opens are rare (one per capture).
        let library: &'static Library = Box::leak(Box::new(library));
        macro_rules! entry {
            ($name:literal) => {
                // SAFETY: the symbol is CUPTI's function of that name, whose C signature (cupti_*.h) is the
                // type of the field it is stored in; `library` is never unloaded (leaked above), so the pointer
                // stays valid for the process' life.
                match unsafe { library.get(concat!($name, "\0").as_bytes()) } {
                    Ok(symbol) => Some(*symbol),
                    Err(_) => None,
                }
            };
        }
        macro_rules! required {
            ($name:literal) => {
                entry!($name).ok_or_else(|| GpuError::NoLoader {
                    detail: format!(
                        "{} has no {} (a CUPTI older than CUDA 11?)",
                        path.display(),
                        $name
                    ),
                })?
            };
        }
        let get_version: unsafe extern "C" fn(*mut u32) -> CuptiResult = required!("cuptiGetVersion");
        let mut version = 0;
        // SAFETY: `cuptiGetVersion` writes one u32 through the pointer, a live local.
        unsafe { get_version(&mut version) };
        Ok(Cupti {
            version,
            get_result_string: required!("cuptiGetResultString"),
            register_callbacks: required!("cuptiActivityRegisterCallbacks"),
            register_timestamp_callback: entry!("cuptiActivityRegisterTimestampCallback"),
            enable: required!("cuptiActivityEnable"),
            disable: required!("cuptiActivityDisable"),
            next_record: required!("cuptiActivityGetNextRecord"),
            dropped_records: required!("cuptiActivityGetNumDroppedRecords"),
            flush_all: required!("cuptiActivityFlushAll"),
            flush_period: entry!("cuptiActivityFlushPeriod"),
            subscribe: required!("cuptiSubscribe"),
            unsubscribe: required!("cuptiUnsubscribe"),
            enable_callback: required!("cuptiEnableCallback"),
            stream_id: required!("cuptiGetStreamIdEx"),
            path,
            _library: Some(library),
        })
    }

    /// CUPTI's name for a result.
    pub(crate) fn describe(&self, result: CuptiResult) -> String {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: writes a pointer to a static string through a live local.
        let found = unsafe { (self.get_result_string)(result, &mut text) } == SUCCESS && !text.is_null();
        if found {
            // SAFETY: CUPTI returned a NUL-terminated static string.
            let name = unsafe { CStr::from_ptr(text) }.to_string_lossy();
            format!("{name} ({result})")
        } else {
            format!("CUPTI result {result}")
        }
    }

    /// `Ok` for `SUCCESS`, else the call and CUPTI's name for the result.
    pub(crate) fn check(&self, call: &'static str, result: CuptiResult) -> Result<(), GpuError> {
        if result == SUCCESS {
            Ok(())
        } else {
            Err(GpuError::Api {
                call,
                detail: self.describe(result),
            })
        }
    }
}

/// What a record is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RecordKind {
    Kernel,
    Memcpy,
    Memset,
}

/// The fields tickline reads from one activity record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) kind: RecordKind,
    pub(crate) correlation: u32,
    /// CUPTI's timestamps, ns; both 0 when CUPTI could not collect them.
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) stream: u32,
    /// 0 when not run as a graph node.
    pub(crate) graph_node: u64,
    /// Kernels: the address of CUPTI's name for the kernel (a NUL-terminated string CUPTI owns, valid while
    /// the buffer is read); copies: their direction (`CUpti_ActivityMemcpyKind`); 0 otherwise.
    pub(crate) detail: usize,
}

/// Where a kind's fields are: `(start, end, stream, correlation, graph node, bytes the record needs)`.
const KERNEL_FIELDS: (usize, usize, usize, usize, usize, usize) = (16, 24, 48, 92, 144, 152);
const COPY_FIELDS: (usize, usize, usize, usize, usize, usize) = (16, 24, 40, 44, 64, 72);
/// A kernel record's name pointer; a memcpy record's `copyKind` byte.
const KERNEL_NAME: usize = 104;
const COPY_KIND: usize = 4;

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// Reads a record: `bytes` runs from the record's first byte to the end of the buffer's valid part. `None` for
/// kinds tickline does not read, and for a record cut short (never read past `bytes`).
pub(crate) fn parse(bytes: &[u8]) -> Option<Record> {
    let (kind, fields) = match u32_at(bytes, 0)? {
        KIND_KERNEL | KIND_CONCURRENT_KERNEL => (RecordKind::Kernel, KERNEL_FIELDS),
        KIND_MEMCPY => (RecordKind::Memcpy, COPY_FIELDS),
        KIND_MEMSET => (RecordKind::Memset, COPY_FIELDS),
        _ => return None,
    };
    let (start, end, stream, correlation, graph_node, needs) = fields;
    if bytes.len() < needs {
        return None;
    }
    let detail = match kind {
        RecordKind::Kernel => u64_at(bytes, KERNEL_NAME)? as usize,
        RecordKind::Memcpy => usize::from(*bytes.get(COPY_KIND)?),
        RecordKind::Memset => 0,
    };
    Some(Record {
        kind,
        correlation: u32_at(bytes, correlation)?,
        start: u64_at(bytes, start)?,
        end: u64_at(bytes, end)?,
        stream: u32_at(bytes, stream)?,
        graph_node: u64_at(bytes, graph_node)?,
        detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn callback_data_is_laid_out_as_cupti_passes_it() {
        // offsetof(CUpti_CallbackData, ...) in CUPTI 12.8 and 13.0, x86_64.
        assert_eq!(offset_of!(CallbackData, function_name), 8);
        assert_eq!(offset_of!(CallbackData, function_params), 16);
        assert_eq!(offset_of!(CallbackData, symbol_name), 32);
        assert_eq!(offset_of!(CallbackData, context), 40);
        assert_eq!(offset_of!(CallbackData, correlation_id), 64);
        assert_eq!(std::mem::size_of::<CallbackData>(), 72);
    }

    fn put(bytes: &mut [u8], at: usize, value: &[u8]) {
        bytes[at..at + value.len()].copy_from_slice(value);
    }

    /// A record laid out as CUPTI 13.0 writes it (offsets from `offsetof` on its headers).
    fn record(kind: u32, size: usize, fields: (usize, usize, usize, usize, usize, usize)) -> Vec<u8> {
        let mut bytes = vec![0xA5; size];
        let (start, end, stream, correlation, graph_node, _) = fields;
        put(&mut bytes, 0, &kind.to_le_bytes());
        put(&mut bytes, start, &1_000u64.to_le_bytes());
        put(&mut bytes, end, &2_500u64.to_le_bytes());
        put(&mut bytes, stream, &13u32.to_le_bytes());
        put(&mut bytes, correlation, &60_150u32.to_le_bytes());
        put(&mut bytes, graph_node, &8_589_934_593u64.to_le_bytes());
        bytes
    }

    #[test]
    fn records_of_each_kind_read_their_fields() {
        let want = |kind, detail| Record {
            kind,
            correlation: 60_150,
            start: 1_000,
            end: 2_500,
            stream: 13,
            graph_node: 8_589_934_593,
            detail,
        };
        // The filler byte 0xA5 stands where the name pointer and the copy kind are.
        // CUpti_ActivityKernel10 is 216 bytes, Memcpy6 96, Memset4 88.
        assert_eq!(
            parse(&record(KIND_CONCURRENT_KERNEL, 216, KERNEL_FIELDS)),
            Some(want(RecordKind::Kernel, 0xA5A5_A5A5_A5A5_A5A5))
        );
        assert_eq!(
            parse(&record(KIND_KERNEL, 208, KERNEL_FIELDS)),
            Some(want(RecordKind::Kernel, 0xA5A5_A5A5_A5A5_A5A5))
        );
        assert_eq!(
            parse(&record(KIND_MEMCPY, 96, COPY_FIELDS)),
            Some(want(RecordKind::Memcpy, 0xA5))
        );
        assert_eq!(
            parse(&record(KIND_MEMSET, 88, COPY_FIELDS)),
            Some(want(RecordKind::Memset, 0))
        );
    }

    #[test]
    fn other_kinds_and_cut_records_read_as_nothing() {
        assert_eq!(parse(&record(39, 24, (0, 0, 0, 0, 0, 0))), None, "external correlation");
        assert_eq!(parse(&[]), None);
        assert_eq!(parse(&[10, 0]), None);
        let kernel = record(KIND_CONCURRENT_KERNEL, 216, KERNEL_FIELDS);
        for cut in 0..KERNEL_FIELDS.5 {
            assert_eq!(parse(&kernel[..cut]), None, "cut at {cut}");
        }
        assert!(parse(&kernel[..KERNEL_FIELDS.5]).is_some());
    }

    #[test]
    #[cfg_attr(miri, ignore)] // dlopen
    fn a_missing_library_names_where_it_was_looked_for() {
        let Err(e) = Cupti::open(Some(Path::new("/nonexistent/libcupti.so"))) else {
            panic!("opened a library that does not exist");
        };
        let text = e.to_string();
        assert!(matches!(e, GpuError::NoLoader { .. }), "{text}");
        assert!(
            text.contains("/nonexistent/libcupti.so") && text.contains("TICKLINE_CUPTI_LIBRARY"),
            "{text}"
        );
    }
}

#[cfg(test)]
mod library_tests {
    use super::*;

    /// With `TICKLINE_CUPTI_LIBRARY` naming a real libcupti (no GPU needed), every entry point binds and the
    /// result names read back. Without one it says SKIP.
    #[test]
    fn a_real_cupti_binds_every_entry_point() {
        let Some(path) = std::env::var_os("TICKLINE_CUPTI_LIBRARY").filter(|p| !p.is_empty()) else {
            eprintln!("SKIP: a_real_cupti_binds_every_entry_point: TICKLINE_CUPTI_LIBRARY is not set");
            return;
        };
        let cupti = Cupti::open(Some(Path::new(&path))).unwrap();
        assert!(cupti.version >= 18, "cuptiGetVersion {}", cupti.version);
        assert!(cupti.register_timestamp_callback.is_some() && cupti.flush_period.is_some());
        let text = cupti.describe(MULTIPLE_SUBSCRIBERS);
        assert!(text.contains("MULTIPLE_SUBSCRIBERS"), "{text}");
        eprintln!("{}: CUPTI API version {}", cupti.path.display(), cupti.version);
    }
}
