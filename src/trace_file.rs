//! [`TraceFile`]: a trace file written in whole blocks that bypass the page cache.
//!
//! A trace is written once and not read back by the program that writes it, so copying it into the page
//! cache buys nothing: on this project's reference VM, `write(2)` of 64 MiB in 1 MiB pieces into ext4's page
//! cache cost 10-23 ms of CPU, and deleting the file afterwards 2.5 ms more; the same bytes written with
//! `O_DIRECT` cost 3.7 ms and 0.1 ms (the device copies them by DMA). A trace of a million spans is about that
//! size: for the cheapest recording (a raw capture) the file was a quarter of the collector's CPU.
//!
//! Whole blocks go to the file through a second descriptor opened with `O_DIRECT`, from a block-aligned
//! buffer; what is left over (less than a block) goes through the page cache when the file is flushed, so the
//! file always ends at its last byte written and never holds padding. A block written through the page cache
//! and later rewritten whole with `O_DIRECT` is consistent: the kernel writes back and drops the cached pages
//! of a range before a direct write to it.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

/// The alignment of direct writes: offsets, lengths and the buffer's address. 4096 is a multiple of every
/// logical block size in use (512 or 4096); a device that needs more refuses the write with `EINVAL`, and the
/// file then goes on through the page cache.
const BLOCK: usize = 4096;

/// The default buffer: 1 MiB, handed to the writer thread when full (one system call per MiB).
const DEFAULT_BUFFER: usize = 1 << 20;

/// Buffers written by the writer thread at once, besides the one being filled: a direct write takes the
/// device's time (about 0.5 ms per MiB on the reference VM), and the caller goes on filling another meanwhile.
const IN_FLIGHT: usize = 2;

/// A file for writing traces: buffered in memory, written in whole blocks that bypass the page cache
/// (`O_DIRECT`, on Linux, where the file system allows it) by a thread of its own, and otherwise an ordinary
/// file.
///
/// [`flush`](Write::flush) puts everything written so far into the file (the last partial block through the
/// page cache) and waits for the writes in flight, so a process killed after a flush loses nothing of it;
/// dropping a `TraceFile` flushes it (errors are then lost: call `flush` to see them). The first failure (a
/// full disk; a direct write's is reported by the next `write` or `flush`) makes the file failed: nothing more
/// is written, so the file holds what went before it with no hole, and every later call returns an error.
/// Writes are sequential from the start of the file, which is created or truncated; a pipe or a character
/// device is written in order.
///
/// ```
/// use std::io::Write;
/// let path = std::env::temp_dir().join("tickline-doc-trace-file.bin");
/// let mut file = tickline::export::TraceFile::create(&path).unwrap();
/// file.write_all(&[7; 10_000]).unwrap();
/// file.flush().unwrap();
/// assert_eq!(std::fs::metadata(&path).unwrap().len(), 10_000);
/// # std::fs::remove_file(&path).unwrap();
/// ```
pub struct TraceFile {
    /// The file through the page cache: partial blocks, and everything without a direct writer.
    file: File,
    /// The buffer being filled.
    buffer: Buffer,
    /// Bytes in it.
    len: usize,
    /// The file offset of its first byte: a multiple of [`BLOCK`] while there is a direct writer.
    base: u64,
    /// The buffer's first `flushed` bytes are in the file already (written through the page cache by a flush;
    /// rewritten whole with the block they belong to).
    flushed: usize,
    bytes_cached: u64,
    direct: Option<DirectWriter>,
    /// The first failure (its kind and words): from then on nothing more is written, and every call fails.
    failed: Option<(io::ErrorKind, String)>,
}

/// A block-aligned buffer of `capacity` bytes inside `storage`.
struct Buffer {
    storage: Box<[u8]>,
    window: usize,
    capacity: usize,
}

impl Buffer {
    fn new(capacity: usize) -> Buffer {
        // One block more than the buffer, so that a block-aligned window of `capacity` bytes fits wherever the
        // allocation starts.
        let storage = vec![0u8; capacity + BLOCK].into_boxed_slice();
        let window = storage.as_ptr().align_offset(BLOCK);
        debug_assert!(window < BLOCK);
        Buffer {
            storage,
            window,
            capacity,
        }
    }

    fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.storage[self.window + range.start..self.window + range.end]
    }

    fn bytes_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        &mut self.storage[self.window + range.start..self.window + range.end]
    }
}

/// A full buffer for the writer thread: its first `len` bytes (whole blocks) go at `offset`.
struct Job {
    buffer: Buffer,
    len: usize,
    offset: u64,
}

/// The writer thread's side: it writes each job's bytes with `O_DIRECT` (through the page cache once direct
/// writes fail with `EINVAL`) and sends the buffer back with the outcome.
struct DirectWriter {
    jobs: Option<Sender<Job>>,
    done: Receiver<(Buffer, io::Result<()>)>,
    spare: Vec<Buffer>,
    in_flight: usize,
    /// Direct writes still work (the writer thread clears it when it falls back to the page cache).
    direct: Arc<AtomicBool>,
    /// Bytes the writer thread wrote through the page cache after falling back.
    cached: Arc<AtomicU64>,
    /// The first failure the writer thread reported, until a call returns it.
    failed: Option<io::Error>,
    thread: Option<JoinHandle<()>>,
}

impl DirectWriter {
    fn start(direct_file: File, cached_file: File, buffer_bytes: usize) -> io::Result<DirectWriter> {
        let (jobs, job_rx) = crossbeam_channel::bounded::<Job>(IN_FLIGHT);
        let (done_tx, done) = crossbeam_channel::bounded(IN_FLIGHT + 1);
        let direct = Arc::new(AtomicBool::new(true));
        let cached = Arc::new(AtomicU64::new(0));
        let (thread_direct, thread_cached) = (direct.clone(), cached.clone());
        let thread = std::thread::Builder::new()
            .name("tickline-file".into())
            .spawn(move || {
                // After a failure nothing more is written: what follows a failed block would lie beyond a
                // hole (a full disk takes a smaller write after refusing a larger one).
                let mut failed = false;
                for job in job_rx {
                    let result = if failed {
                        Err(io::Error::other("not written: an earlier write to the file failed"))
                    } else {
                        write_job(&job, &direct_file, &cached_file, &thread_direct, &thread_cached)
                    };
                    failed |= result.is_err();
                    if done_tx.send((job.buffer, result)).is_err() {
                        return;
                    }
                }
            })?;
        Ok(DirectWriter {
            jobs: Some(jobs),
            done,
            spare: (0..IN_FLIGHT).map(|_| Buffer::new(buffer_bytes)).collect(),
            in_flight: 0,
            direct,
            cached,
            failed: None,
            thread: Some(thread),
        })
    }

    /// Takes back a written buffer, noting a failure.
    fn collect(&mut self, (buffer, result): (Buffer, io::Result<()>)) {
        self.in_flight -= 1;
        self.spare.push(buffer);
        if let (Err(e), None) = (result, &self.failed) {
            self.failed = Some(e);
        }
    }

    /// A free buffer, waiting for a write to finish if every one is in flight.
    fn free_buffer(&mut self) -> Buffer {
        while let Ok(done) = self.done.try_recv() {
            self.collect(done);
        }
        if self.spare.is_empty() {
            let done = self.done.recv().expect("the writer thread answers every job it takes");
            self.collect(done);
        }
        self.spare.pop().expect("a buffer came back")
    }

    /// Waits until every job is written; the first failure since the last call, if any.
    fn wait(&mut self) -> io::Result<()> {
        while self.in_flight > 0 {
            let done = self.done.recv().expect("the writer thread answers every job it takes");
            self.collect(done);
        }
        self.failed.take().map_or(Ok(()), Err)
    }
}

impl Drop for DirectWriter {
    fn drop(&mut self) {
        let _ = self.wait();
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Writes a job's bytes at its offset: directly while that works, then through the page cache.
fn write_job(
    job: &Job,
    direct: &File,
    cached: &File,
    is_direct: &AtomicBool,
    cached_bytes: &AtomicU64,
) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut at = 0;
    // Relaxed: only this thread writes it; readers want a hint, not an ordering.
    while at < job.len && is_direct.load(Ordering::Relaxed) {
        match direct.write_at(job.buffer.bytes(at..job.len), job.offset + at as u64) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => {
                at += n;
                // A short direct write leaves an unaligned rest: that, and everything after, through the page
                // cache.
                if n % BLOCK != 0 {
                    is_direct.store(false, Ordering::Relaxed);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // The file system took the O_DIRECT open but not this write (alignment, a file system that
            // supports it only in part): the page cache from now on.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => is_direct.store(false, Ordering::Relaxed),
            Err(e) => return Err(e),
        }
    }
    if at < job.len {
        cached.write_all_at(job.buffer.bytes(at..job.len), job.offset + at as u64)?;
        cached_bytes.fetch_add((job.len - at) as u64, Ordering::Relaxed);
    }
    Ok(())
}

impl TraceFile {
    /// Creates (or truncates) the file at `path`, with a 1 MiB buffer.
    ///
    /// Whole blocks bypass the page cache where `path` is a regular file on a file system that supports
    /// `O_DIRECT` (Linux), written by a thread of its own (`tickline-file`); anywhere else (a pipe, a character
    /// device, a file system without `O_DIRECT` such as tmpfs before Linux 6.6) the file is written normally, in
    /// order, by the caller.
    pub fn create(path: impl AsRef<Path>) -> io::Result<TraceFile> {
        Self::with_buffer(path, DEFAULT_BUFFER)
    }

    /// [`create`](Self::create) with buffers of `bytes` (rounded up to a whole number of 4 KiB blocks, at least
    /// one).
    pub fn with_buffer(path: impl AsRef<Path>, bytes: usize) -> io::Result<TraceFile> {
        let path = path.as_ref();
        let file = File::create(path)?;
        let capacity = bytes.max(1).div_ceil(BLOCK) * BLOCK;
        let direct = match open_direct(path, &file) {
            Some(direct_file) => Some(DirectWriter::start(direct_file, file.try_clone()?, capacity)?),
            None => None,
        };
        Ok(TraceFile {
            file,
            buffer: Buffer::new(capacity),
            len: 0,
            base: 0,
            flushed: 0,
            bytes_cached: 0,
            direct,
            failed: None,
        })
    }

    /// Whether whole blocks currently bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.as_ref().is_some_and(|d| d.direct.load(Ordering::Relaxed))
    }

    /// Bytes written into the file so far (handed to its writer thread, or through the page cache), not counting
    /// what is still buffered.
    pub fn bytes_written(&self) -> u64 {
        self.base + self.flushed as u64
    }

    /// Bytes written through the page cache so far: the partial blocks of flushes (rewritten directly once their
    /// block is full), or everything where direct writes are not possible.
    pub fn bytes_cached(&self) -> u64 {
        self.bytes_cached + self.direct.as_ref().map_or(0, |d| d.cached.load(Ordering::Relaxed))
    }

    /// Another handle to the file (`File::try_clone`): it shares the file's position, which
    /// [`into_file`](Self::into_file) moves to the end (writes through `TraceFile` itself leave it alone).
    pub fn try_clone_file(&self) -> io::Result<File> {
        self.file.try_clone()
    }

    /// Flushes and returns the file, positioned at its end (a pipe or device as it is: written in order, it is
    /// there already, and it cannot seek).
    pub fn into_file(mut self) -> io::Result<File> {
        use std::io::Seek;
        self.flush()?;
        let mut file = self.file.try_clone()?;
        // Only positioned writes (the direct writer's file) leave the position behind.
        if self.direct.is_some() {
            file.seek(io::SeekFrom::End(0))?;
        }
        Ok(file)
    }

    /// Writes the buffer's whole blocks (all of it without a direct writer) and keeps the rest; a failure makes
    /// the file failed.
    fn write_blocks(&mut self) -> io::Result<()> {
        self.check()?;
        let result = self.write_blocks_now();
        result.map_err(|e| self.fail(e))
    }

    fn write_blocks_now(&mut self) -> io::Result<()> {
        let Some(direct) = &mut self.direct else {
            // Through the page cache (or a pipe, a device), in order: what a flush wrote is not written again.
            self.file.write_all(self.buffer.bytes(self.flushed..self.len))?;
            self.bytes_cached += (self.len - self.flushed) as u64;
            self.base += self.len as u64;
            self.len = 0;
            self.flushed = 0;
            return Ok(());
        };
        if let Some(e) = direct.failed.take() {
            return Err(e);
        }
        let whole = self.len / BLOCK * BLOCK;
        if whole == 0 {
            return Ok(());
        }
        // The rest (less than a block) starts the next buffer: the next job starts at a block boundary.
        let mut next = direct.free_buffer();
        next.bytes_mut(0..self.len - whole)
            .copy_from_slice(self.buffer.bytes(whole..self.len));
        let full = std::mem::replace(&mut self.buffer, next);
        direct.in_flight += 1;
        let job = Job {
            buffer: full,
            len: whole,
            offset: self.base,
        };
        direct
            .jobs
            .as_ref()
            .expect("taken only on drop")
            .send(job)
            .expect("the writer thread runs until the TraceFile is dropped");
        self.len -= whole;
        self.base += whole as u64;
        self.flushed = self.flushed.saturating_sub(whole);
        Ok(())
    }

    /// Everything written so far into the file (see [`flush`](Write::flush)).
    fn flush_now(&mut self) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.write_blocks_now()?;
        let Some(direct) = &mut self.direct else {
            return self.file.flush();
        };
        direct.wait()?;
        // After the writes in flight, so nothing lands beyond a block that failed.
        if self.flushed < self.len {
            self.file.write_all_at(
                self.buffer.bytes(self.flushed..self.len),
                self.base + self.flushed as u64,
            )?;
            self.bytes_cached += (self.len - self.flushed) as u64;
            self.flushed = self.len;
        }
        Ok(())
    }

    /// The first failure again, if there was one.
    fn check(&self) -> io::Result<()> {
        match &self.failed {
            Some((kind, words)) => Err(io::Error::new(*kind, format!("an earlier write failed: {words}"))),
            None => Ok(()),
        }
    }

    /// Makes the file failed with `e` (the first failure is kept) and returns `e`.
    fn fail(&mut self, e: io::Error) -> io::Error {
        if self.failed.is_none() {
            self.failed = Some((e.kind(), e.to_string()));
        }
        e
    }
}

impl Write for TraceFile {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.check()?;
        if self.len == self.buffer.capacity {
            self.write_blocks()?;
        }
        let n = bytes.len().min(self.buffer.capacity - self.len);
        self.buffer
            .bytes_mut(self.len..self.len + n)
            .copy_from_slice(&bytes[..n]);
        self.len += n;
        Ok(n)
    }

    fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            let n = self.write(bytes)?;
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Puts everything written so far into the file: whole blocks directly (waiting for them), the last partial
    /// block through the page cache (rewritten whole once its block is full). After a failure, nothing more is
    /// written and every call returns an error: the file holds what was written before it, with no hole.
    fn flush(&mut self) -> io::Result<()> {
        self.check()?;
        let result = self.flush_now();
        result.map_err(|e| self.fail(e))
    }
}

impl Drop for TraceFile {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

impl std::fmt::Debug for TraceFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceFile")
            .field("direct", &self.is_direct())
            .field("buffered", &self.len)
            .field("bytes_written", &self.bytes_written())
            .finish()
    }
}

/// A second descriptor of the file just created at `path`, opened with `O_DIRECT`, if the file is a regular
/// file whose file system takes it.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path, file: &File) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    if !file.metadata().ok()?.file_type().is_file() {
        return None;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &Path, _file: &File) -> Option<File> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("tickline-trace-file-{}-{name}", std::process::id()))
    }

    /// Deterministic bytes that differ at every offset (a misplaced block shows).
    fn pattern(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Writes of every size, flushes between some of them: the file holds exactly the bytes written, in order,
    /// after every flush and at the end, whether blocks went directly or not.
    #[test]
    fn the_file_holds_exactly_what_was_written_after_every_flush() {
        let path = temp("exact");
        let data = pattern(3 * DEFAULT_BUFFER + 12_345, 7);
        let mut file = TraceFile::with_buffer(&path, 64 * 1024).unwrap();
        let mut written = 0;
        let mut sizes = [1usize, 7, 4096, 5000, 65_536, 100_000, 3, 4095, 4097].iter().cycle();
        let mut k = 0;
        while written < data.len() {
            let n = (*sizes.next().unwrap()).min(data.len() - written);
            file.write_all(&data[written..written + n]).unwrap();
            written += n;
            k += 1;
            if k % 5 == 0 {
                file.flush().unwrap();
                let on_disk = std::fs::read(&path).unwrap();
                assert_eq!(on_disk.len(), written, "after flush {k}");
                assert!(on_disk == data[..written], "after flush {k}: contents differ");
            }
        }
        file.flush().unwrap();
        assert_eq!(file.bytes_written(), data.len() as u64);
        drop(file);
        assert!(std::fs::read(&path).unwrap() == data);
        std::fs::remove_file(&path).unwrap();
    }

    /// A regular file on a file system with direct I/O (the usual temp dir) takes whole blocks directly; only
    /// the partial blocks of flushes go through the page cache.
    #[test]
    fn whole_blocks_bypass_the_page_cache_where_the_file_system_allows_it() {
        let path = temp("direct");
        let mut file = TraceFile::create(&path).unwrap();
        if !file.is_direct() {
            eprintln!("SKIP: the temp dir's file system does not take O_DIRECT; only the fallback is tested");
            return;
        }
        file.write_all(&pattern(4 * DEFAULT_BUFFER, 3)).unwrap();
        assert!(file.is_direct(), "direct writes failed here: {file:?}");
        assert_eq!(file.bytes_cached(), 0);
        file.write_all(&[1; 100]).unwrap();
        file.flush().unwrap();
        assert_eq!(file.bytes_cached(), 100);
        drop(file);
        std::fs::remove_file(&path).unwrap();
    }

    /// A direct write the file system refuses (`EINVAL`: here a buffer off its alignment, as a device needing more
    /// than 4 KiB would refuse an aligned one) goes through the page cache instead, whole, and so does every
    /// later one.
    #[test]
    fn a_refused_direct_write_falls_back_to_the_page_cache() {
        let path = temp("einval");
        let file = File::create(&path).unwrap();
        let Some(direct) = open_direct(&path, &file) else {
            eprintln!("SKIP: the temp dir's file system does not take O_DIRECT");
            return;
        };
        let data = pattern(2 * BLOCK, 5);
        let mut buffer = Buffer::new(2 * BLOCK);
        // One byte off the block boundary: O_DIRECT refuses the address.
        buffer.window += 1;
        buffer.bytes_mut(0..2 * BLOCK).copy_from_slice(&data);
        let job = Job {
            buffer,
            len: 2 * BLOCK,
            offset: 0,
        };
        let is_direct = AtomicBool::new(true);
        let cached = AtomicU64::new(0);
        write_job(&job, &direct, &file, &is_direct, &cached).unwrap();
        assert!(
            !is_direct.load(Ordering::Relaxed),
            "the refusal turns direct writes off"
        );
        assert_eq!(cached.load(Ordering::Relaxed), 2 * BLOCK as u64);
        assert!(std::fs::read(&path).unwrap() == data);
        std::fs::remove_file(&path).unwrap();
    }

    /// A pipe (here a FIFO, read by another thread) takes everything in order: no positioned writes.
    #[test]
    fn a_pipe_gets_every_byte_in_order() {
        let path = temp("fifo");
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("SKIP: no mkfifo here");
            return;
        }
        let reader_path = path.clone();
        let reader = std::thread::spawn(move || std::fs::read(reader_path).unwrap());
        let data = pattern(3 * DEFAULT_BUFFER + 777, 13);
        let mut file = TraceFile::create(&path).unwrap();
        assert!(!file.is_direct());
        file.write_all(&data[..1000]).unwrap();
        file.flush().unwrap();
        file.write_all(&data[1000..]).unwrap();
        // Handed back as a plain file (as `PerfettoExporter::into_inner` does): a pipe cannot seek, nor need to.
        let mut plain = file.into_file().unwrap();
        plain.write_all(b"end").unwrap();
        drop(plain);
        let mut expected = data.clone();
        expected.extend_from_slice(b"end");
        assert!(reader.join().unwrap() == expected);
        std::fs::remove_file(&path).unwrap();
    }

    /// The first failure makes the file failed: nothing written after it (no hole with later data beyond),
    /// and every later call says so. Here a direct write far past the largest file size fails (`EFBIG`), as a
    /// full disk refuses a block.
    #[test]
    fn after_a_failure_nothing_more_is_written_and_every_call_fails() {
        let path = temp("failed");
        let mut file = TraceFile::create(&path).unwrap();
        if !file.is_direct() {
            eprintln!("SKIP: the temp dir's file system does not take O_DIRECT");
            return;
        }
        file.write_all(&pattern(2 * DEFAULT_BUFFER, 17)).unwrap();
        file.flush().unwrap();
        // The next block goes far past any file size the file system allows.
        file.base = 1 << 60;
        file.write_all(&[1; DEFAULT_BUFFER]).unwrap();
        let first = file.flush().unwrap_err();
        assert_ne!(first.kind(), io::ErrorKind::Other, "the device's own error: {first}");
        // Smaller writes would fit: none is made.
        let later = file.write_all(&[2; 10]).and_then(|()| file.flush()).unwrap_err();
        assert!(later.to_string().contains("an earlier write failed"), "{later}");
        assert_eq!(later.kind(), first.kind());
        drop(file);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 * DEFAULT_BUFFER as u64);
        std::fs::remove_file(&path).unwrap();
    }

    /// Without direct writes (a device): the first failure sticks too.
    #[test]
    fn a_failing_device_stays_failed() {
        let Ok(mut full) = TraceFile::create("/dev/full") else {
            eprintln!("SKIP: no /dev/full");
            return;
        };
        full.write_all(&[0; 100]).unwrap();
        assert_eq!(full.flush().unwrap_err().raw_os_error(), Some(libc::ENOSPC));
        let again = full.write_all(&[0; 100]).unwrap_err();
        assert!(again.to_string().contains("an earlier write failed"), "{again}");
    }

    /// Dropped without a flush: everything written is in the file.
    #[test]
    fn a_dropped_file_keeps_everything() {
        let path = temp("drop");
        let data = pattern(DEFAULT_BUFFER + 777, 11);
        let mut file = TraceFile::create(&path).unwrap();
        file.write_all(&data).unwrap();
        drop(file);
        assert!(std::fs::read(&path).unwrap() == data);
        std::fs::remove_file(&path).unwrap();
    }

    /// Not a regular file: written normally, and a failing device reports its error.
    #[test]
    fn devices_are_written_normally_and_their_errors_reported() {
        let mut null = TraceFile::create("/dev/null").unwrap();
        assert!(!null.is_direct());
        null.write_all(&[0; 3 * DEFAULT_BUFFER]).unwrap();
        null.flush().unwrap();
        if let Ok(mut full) = TraceFile::create("/dev/full") {
            full.write_all(&[0; 100]).unwrap();
            let e = full.flush().unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
        }
    }

    /// `into_file` hands back the file at its end: more bytes go after the trace.
    #[test]
    fn into_file_is_positioned_at_the_end() {
        let path = temp("into");
        let mut file = TraceFile::create(&path).unwrap();
        file.write_all(&[5; 9000]).unwrap();
        let mut plain = file.into_file().unwrap();
        plain.write_all(&[6; 10]).unwrap();
        drop(plain);
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(on_disk.len(), 9010);
        assert!(on_disk[..9000].iter().all(|&b| b == 5) && on_disk[9000..].iter().all(|&b| b == 6));
        std::fs::remove_file(&path).unwrap();
    }
}
