//! Lock files under `/run` that tell a live harness's host state from what
//! a dead one left: the pod network's /24s, kubelet nodes, and the work
//! directories of real clusters. A process holds the lock (`flock`) of
//! what it owns while it lives; the kernel releases it when the process
//! dies, however it dies, so a lock file whose lock anyone can take names
//! something to remove.
//!
//! When a holder is done it removes the file while still holding the lock
//! ([`Lock::remove`]), and the file's directory once that is empty: nothing
//! stays behind under `/run`. A process that opened the file just before
//! it was removed takes a lock on a file no path names any more;
//! [`Lock::try_take`] sees that (the path's inode is not the file's) and
//! tries again with the file at the path.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

/// How often [`Lock::try_take`] tries again when the file or its directory
/// was removed by another process meanwhile.
const ATTEMPTS: usize = 8;

/// A held lock file. Dropping it releases the lock and keeps the file;
/// [`Lock::remove`] removes it.
#[derive(Debug)]
pub struct Lock {
    file: File,
    path: PathBuf,
}

impl Lock {
    /// Takes the lock at `path` (creating the file and its directory), or
    /// `None` when a live process holds it.
    ///
    /// # Errors
    /// The I/O error of creating, opening or locking the file.
    pub fn try_take(path: &Path) -> io::Result<Option<Self>> {
        for _ in 0..ATTEMPTS {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let file = match std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(path)
            {
                Ok(f) => f,
                // Its directory went between the two calls.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
                Err(std::fs::TryLockError::Error(e)) => return Err(e),
            }
            let held = file.metadata()?;
            let named = std::fs::metadata(path).ok();
            if named.is_some_and(|m| m.ino() == held.ino() && m.dev() == held.dev()) {
                return Ok(Some(Self {
                    file,
                    path: path.to_path_buf(),
                }));
            }
            // The previous holder removed the file after it was opened here.
        }
        Err(io::Error::other(format!(
            "{} was removed and created again {ATTEMPTS} times while it was being locked",
            path.display()
        )))
    }

    /// The lock file's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the file's content with `text` (what the lock stands for).
    ///
    /// # Errors
    /// The I/O error of writing.
    pub fn write(&mut self, text: &str) -> io::Result<()> {
        use std::io::Write as _;
        self.file.set_len(0)?;
        let mut f = &self.file;
        std::io::Seek::seek(&mut f, io::SeekFrom::Start(0))?;
        f.write_all(text.as_bytes())
    }

    /// What the file holds (empty when unreadable).
    #[must_use]
    pub fn read(&self) -> String {
        std::fs::read_to_string(&self.path).unwrap_or_default()
    }

    /// Removes the file, then its directory if that is empty, then releases
    /// the lock.
    pub fn remove(self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            // Fails (and keeps it) while another lock file is in it.
            let _ = std::fs::remove_dir(dir);
        }
        drop(self.file);
    }
}

/// The lock files (`*.lock`) in `dir`, by the name before `.lock`.
#[must_use]
pub fn list(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.strip_suffix(".lock")?.to_owned();
            Some((name, e.path()))
        })
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        std::env::temp_dir().join(format!("skipper-lockfile-{:016x}", rand::random::<u64>()))
    }

    #[test]
    fn a_held_lock_is_refused_and_a_removed_one_leaves_nothing() {
        let dir = dir();
        let path = dir.join("a.lock");
        let mut first = Lock::try_take(&path).unwrap().unwrap();
        first.write("one\n").unwrap();
        first.write("two").unwrap();
        assert_eq!(first.read(), "two");
        assert!(Lock::try_take(&path).unwrap().is_none(), "held");
        assert_eq!(list(&dir), vec![("a".to_owned(), path.clone())]);
        first.remove();
        assert!(!dir.exists(), "the file and its empty directory are gone");
        // Released without removing: the next taker gets it.
        let second = Lock::try_take(&path).unwrap().unwrap();
        drop(second);
        let third = Lock::try_take(&path).unwrap().unwrap();
        third.remove();
        assert!(!dir.exists());
    }
}
