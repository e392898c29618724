//! Writing a command's output file without risking its inputs or the file it replaces.
//!
//! - [`check_not_input`]: an output that is one of the inputs (under any spelling) is refused before anything
//!   is opened for writing: creating it would truncate the input before it is read.
//! - [`OutputFile`]: the output is written to a temporary file beside it and renamed over it only once
//!   complete, so a command that fails leaves an existing output as it was.

use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

/// The output is one of the inputs: writing it would destroy that input.
#[derive(Debug)]
pub struct OutputIsInput {
    /// The output, as given.
    pub output: PathBuf,
    /// The input it is, as given.
    pub input: PathBuf,
}

impl std::fmt::Display for OutputIsInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the output {} is the input {} (the same file): writing it would destroy the input; choose another \
             output",
            self.output.display(),
            self.input.display()
        )
    }
}

impl std::error::Error for OutputIsInput {}

/// Refuses an output that is one of `inputs` by file identity, not by spelling: `./x`, an absolute path, a
/// symlink and a hard link all name the same file. An output that does not exist yet is no input; an input
/// that cannot be examined is left to the read that reports it.
pub fn check_not_input<'a>(output: &Path, inputs: impl IntoIterator<Item = &'a Path>) -> Result<(), OutputIsInput> {
    let Ok(out) = std::fs::metadata(output) else {
        return Ok(());
    };
    for input in inputs {
        if let Ok(inp) = std::fs::metadata(input) {
            if same_file((output, &out), (input, &inp)) {
                return Err(OutputIsInput {
                    output: output.to_owned(),
                    input: input.to_owned(),
                });
            }
        }
    }
    Ok(())
}

/// Whether two paths name the same existing file (by identity, as [`check_not_input`] compares them); false
/// when either cannot be examined.
pub fn is_same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(ma), Ok(mb)) => same_file((a, &ma), (b, &mb)),
        _ => false,
    }
}

/// The output path a command was given, `-` read as stdout (`/dev/stdout`).
pub fn output_path(output: PathBuf) -> PathBuf {
    if output.as_os_str() == "-" {
        PathBuf::from("/dev/stdout")
    } else {
        output
    }
}

/// Whether `output` (as [`output_path`] gives it) is this process's stdout (`/dev/stdout`, `/dev/fd/1`,
/// `/proc/self/fd/1`, or the pipe or file stdout is): the trace goes there, so the report must not.
pub fn is_stdout(output: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let (Ok(out), Ok(stdout)) = (std::fs::metadata(output), std::fs::metadata("/dev/stdout")) {
            return out.dev() == stdout.dev() && out.ino() == stdout.ino();
        }
    }
    false
}

/// Writes a command's report, to stdout unless the command's output (a trace) goes there: then to stderr, so the
/// trace piped on is the trace alone.
pub fn print_report_beside(command: &str, report: &str, output: &Path) -> std::process::ExitCode {
    if is_stdout(output) {
        use std::io::Write;
        // The command's output was written: a report stderr cannot take does not fail it.
        let _ = io::stderr().lock().write_all(report.as_bytes());
        return std::process::ExitCode::SUCCESS;
    }
    print_report(command, report)
}

/// Writes a command's report to stdout and says how the command ends: a reader that closed the pipe early
/// (`| head`) is no failure, but a report that could not be written (a full disk, `> /dev/full`) is one, said
/// on stderr: the user would otherwise take an empty output for the command's answer.
pub fn print_report(command: &str, report: &str) -> std::process::ExitCode {
    use std::io::Write;
    let mut stdout = io::stdout().lock();
    match stdout.write_all(report.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tickline {command}: cannot write the report to stdout: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(unix)]
fn same_file(a: (&Path, &Metadata), b: (&Path, &Metadata)) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.1.dev() == b.1.dev() && a.1.ino() == b.1.ino()
}

/// Without inode numbers: the canonical paths (symlinks resolved; hard links are not caught).
#[cfg(not(unix))]
fn same_file(a: (&Path, &Metadata), b: (&Path, &Metadata)) -> bool {
    match (std::fs::canonicalize(a.0), std::fs::canonicalize(b.0)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// An output file written in a temporary file beside its final path, which [`commit`](Self::commit) renames
/// over that path. Dropped without `commit` (an error, a panic), the temporary is removed and an existing
/// output is left untouched.
///
/// An existing output that is not a regular file (`/dev/null`, `/dev/full`, a FIFO, a terminal) is written
/// in place, as before: it holds nothing to lose, and a rename would replace the device node or the FIFO
/// instead of writing to it. An output that is a symlink has its target replaced, so the link stays (as
/// writing through it did); one with other hard links gets a new inode, the other names keep the old content.
#[derive(Debug)]
pub struct OutputFile {
    file: File,
    /// The temporary file and the path it replaces; `None` when written in place.
    rename: Option<(PathBuf, PathBuf)>,
}

impl OutputFile {
    /// Opens the temporary file for the output at `path` (or `path` itself, see above). The errors are the
    /// ones creating `path` would give (a missing or unwritable directory, a read-only output).
    pub fn create(path: &Path) -> io::Result<OutputFile> {
        let existing = std::fs::metadata(path).ok();
        let in_place = || {
            Ok(OutputFile {
                file: File::create(path)?,
                rename: None,
            })
        };
        let target = match &existing {
            None => path.to_owned(),
            Some(m) if !m.is_file() => return in_place(),
            Some(_) => {
                // Replacing a file the user may not write is refused as truncating it would have been: open
                // it for writing (without truncating) to ask.
                drop(OpenOptions::new().write(true).open(path)?);
                std::fs::canonicalize(path)?
            }
        };
        let (Some(dir), Some(name)) = (target.parent(), target.file_name()) else {
            return in_place();
        };
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let mut attempt = 0u32;
        loop {
            let mut tmp_name = std::ffi::OsString::from(".");
            tmp_name.push(name);
            tmp_name.push(format!(".tmp-{}", std::process::id()));
            if attempt > 0 {
                tmp_name.push(format!("-{attempt}"));
            }
            let tmp = dir.join(tmp_name);
            // `create_new`: never reuse (or follow a symlink planted at) a name already there.
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(file) => {
                    let output = OutputFile {
                        file,
                        rename: Some((tmp, target)),
                    };
                    if let (Some(m), Some((tmp, _))) = (&existing, &output.rename) {
                        // The replacement keeps the mode the user gave the output.
                        std::fs::set_permissions(tmp, m.permissions())?;
                    }
                    return Ok(output);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// The file to write the output to.
    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    /// Puts the complete output in place: synced to disk first, so a crash cannot leave the rename done
    /// but the content lost, then renamed over the output.
    pub fn commit(mut self) -> io::Result<()> {
        let Some((tmp, target)) = self.rename.take() else {
            return Ok(());
        };
        let result = self.file.sync_all().and_then(|()| std::fs::rename(&tmp, &target));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        if let Some((tmp, _)) = self.rename.take() {
            let _ = std::fs::remove_file(tmp);
        }
    }
}
