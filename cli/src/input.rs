//! Inputs that can be read more than once: `tickline` tells a raw capture from a Perfetto trace by its first
//! bytes, then reads the file again from the start, which a pipe cannot do.

use std::path::{Path, PathBuf};

/// An input path readable from the start as often as needed: a regular file as it is; anything else (a pipe,
/// a FIFO, `/dev/stdin`, a shell's `<(...)`) copied into a temporary file first, removed on drop.
#[derive(Debug)]
pub struct Input {
    original: PathBuf,
    /// The temporary copy, if one was made.
    copy: Option<PathBuf>,
}

impl Input {
    /// `path`, made re-readable (copied if it is not a regular file). The error names `path`.
    pub fn open(path: &Path) -> Result<Input, String> {
        let special = std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir());
        if !special {
            // A missing file or a directory fails later with the reader's own message (after the checks of
            // the options, which come first).
            return Ok(Input {
                original: path.to_owned(),
                copy: None,
            });
        }
        static COPIES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let copy = std::env::temp_dir().join(format!("tickline-input-{}-{n}", std::process::id()));
        let copied = std::fs::File::open(path)
            .and_then(|mut from| std::fs::File::create(&copy).and_then(|mut to| std::io::copy(&mut from, &mut to)));
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&copy);
            return Err(format!("{}: cannot read: {e}", path.display()));
        }
        Ok(Input {
            original: path.to_owned(),
            copy: Some(copy),
        })
    }

    /// The path it was given as.
    pub fn original(&self) -> &Path {
        &self.original
    }

    /// Where to read it.
    pub fn path(&self) -> &Path {
        self.copy.as_deref().unwrap_or(&self.original)
    }

    /// `text` (a message or report) with the temporary copy's path replaced by the input's own.
    pub fn named(&self, text: String) -> String {
        match &self.copy {
            Some(copy) => text.replace(&copy.display().to_string(), &self.original.display().to_string()),
            None => text,
        }
    }
}

impl Drop for Input {
    fn drop(&mut self) {
        if let Some(copy) = &self.copy {
            let _ = std::fs::remove_file(copy);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO written once is read twice through its copy; a regular file is used as it is.
    #[test]
    fn a_pipe_becomes_a_file_that_reads_twice() {
        let fifo = std::env::temp_dir().join(format!("tickline-input-test-{}", std::process::id()));
        if !std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success())
        {
            eprintln!("SKIP: no mkfifo here");
            return;
        }
        let writer_path = fifo.clone();
        let writer = std::thread::spawn(move || std::fs::write(writer_path, b"TICKLINE and more").unwrap());
        let input = Input::open(&fifo).unwrap();
        writer.join().unwrap();
        assert_ne!(input.path(), fifo.as_path());
        for _ in 0..2 {
            assert_eq!(std::fs::read(input.path()).unwrap(), b"TICKLINE and more");
        }
        let message = input.named(format!("{}: bad", input.path().display()));
        assert_eq!(message, format!("{}: bad", fifo.display()));
        let copy = input.path().to_owned();
        drop(input);
        assert!(!copy.exists());
        std::fs::remove_file(&fifo).unwrap();
        let regular = Input::open(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml").as_path()).unwrap();
        assert!(regular.path().ends_with("Cargo.toml"));
    }
}
