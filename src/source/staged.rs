//! Staging: a private folder (0700, created by the daemon, used only through
//! its descriptor) holding edited tensor bytes in sparse files (0600), opened
//! on use through a small cache of descriptors so that 100,000 staged tensors
//! need no 100,000 open files.
//!
//! The folder sits in a place other users may write (beside the source, /tmp):
//! every name in it is opened with `openat` + O_NOFOLLOW, created with O_EXCL,
//! and a folder that is a link, or not owned by the daemon's user, or open to
//! others, is refused.

use crate::sync::LockAnyway;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lru::LruCache;

use super::Bytes;
use super::local::Folder;

/// Descriptors of staging files kept open at once.
const OPEN_FILES: usize = 256;

/// Why a staging folder could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    /// The location is not safe to use (a link, another owner, open to others).
    #[error("{}: refused as a staging folder: {why} (choose another with --staging-dir)", path.display())]
    Unsafe { path: PathBuf, why: String },
    /// Another live stfs daemon holds it.
    #[error("{}: in use by another stfs daemon", path.display())]
    Busy { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl crate::errno::ToErrno for StagingError {
    fn to_errno(&self) -> i32 {
        match self {
            StagingError::Io { source, .. } => source.to_errno(),
            StagingError::Unsafe { .. } => libc::EACCES,
            StagingError::Busy { .. } => libc::EBUSY,
        }
    }
}

pub struct StagingDir {
    /// For messages only: files are reached through `dir`.
    path: PathBuf,
    dir: OwnedFd,
    /// The folder holding this one, and our name in it (to remove ourselves).
    parent: Arc<Folder>,
    name: OsString,
    open_files: Mutex<LruCache<u64, Arc<File>>>,
    next_file: AtomicU64,
    /// Set when the edits must outlive the daemon: staged files stay on disk.
    keep: AtomicBool,
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

impl StagingDir {
    /// Creates a new private folder `.<stem>.stfs-XXXXXX` in `parent`.
    pub fn create(parent: Arc<Folder>, stem: &str) -> Result<StagingDir, StagingError> {
        let io = |source| StagingError::Io {
            path: parent.path.clone(),
            source,
        };
        for _ in 0..100 {
            let name = OsString::from(format!(".{stem}.stfs-{}", random_suffix()));
            // mkdirat fails if anything (a link included) already has the name.
            let mode = rustix::fs::Mode::from_raw_mode(0o700);
            match rustix::fs::mkdirat(&parent.fd, &name, mode) {
                Ok(()) => return StagingDir::adopt(parent, &name),
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => return Err(io(e.into())),
            }
        }
        Err(io(std::io::Error::from_raw_os_error(libc::EEXIST)))
    }

    /// Opens an existing staging folder of `parent` after checking that it is
    /// a real folder, owned by this user, closed to others and not in use.
    pub fn adopt(parent: Arc<Folder>, name: &OsStr) -> Result<StagingDir, StagingError> {
        let path = parent.path.join(name);
        if name.as_bytes().contains(&b'/') || name == ".." || name == "." {
            return Err(StagingError::Unsafe {
                path,
                why: "not a plain name".into(),
            });
        }
        let io = |source| StagingError::Io {
            path: path.clone(),
            source,
        };
        let flags = rustix::fs::OFlags::RDONLY
            | rustix::fs::OFlags::DIRECTORY
            | rustix::fs::OFlags::NOFOLLOW
            | rustix::fs::OFlags::CLOEXEC;
        let dir = match rustix::fs::openat(&parent.fd, name, flags, rustix::fs::Mode::empty()) {
            Ok(dir) => dir,
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
                return Err(StagingError::Unsafe {
                    path,
                    why: "a symbolic link or not a folder".into(),
                });
            }
            Err(e) => return Err(io(e.into())),
        };
        let st = rustix::fs::fstat(&dir).map_err(|e| io(e.into()))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(StagingError::Unsafe {
                path,
                why: "not a folder".into(),
            });
        }
        if st.st_uid != euid() {
            return Err(StagingError::Unsafe {
                path,
                why: format!("owned by uid {}, not by uid {}", st.st_uid, euid()),
            });
        }
        if st.st_mode & 0o077 != 0 {
            return Err(StagingError::Unsafe {
                path,
                why: format!(
                    "mode {:o} lets others in (0700 expected)",
                    st.st_mode & 0o7777
                ),
            });
        }
        // Held until the descriptor is closed.
        match rustix::fs::flock(&dir, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => return Err(StagingError::Busy { path }),
            Err(e) => return Err(io(e.into())),
        }
        let staging = StagingDir {
            path: path.clone(),
            dir,
            parent,
            name: name.to_os_string(),
            open_files: Mutex::new(LruCache::new(
                NonZeroUsize::new(OPEN_FILES).expect("non-zero"),
            )),
            next_file: AtomicU64::new(1),
            keep: AtomicBool::new(false),
        };
        // New files never take the name of one already there.
        let highest = staging
            .list()
            .map_err(io)?
            .iter()
            .filter_map(|n| staged_number(n))
            .max()
            .unwrap_or(0);
        staging.next_file.store(highest + 1, Ordering::Relaxed);
        Ok(staging)
    }

    /// Names of the staging folders of `stem` in `parent` (not yet checked).
    pub fn candidates(parent: &Folder, stem: &str) -> Vec<OsString> {
        let prefix = format!(".{stem}.stfs-");
        let mut out: Vec<OsString> = std::fs::read_dir(&parent.path)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| {
                n.as_bytes().starts_with(prefix.as_bytes())
                    && n.as_bytes()[prefix.len()..]
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric())
            })
            .collect();
        out.sort();
        out
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The folder, as a `Folder` for openat/renameat of files in it.
    pub fn folder(&self) -> std::io::Result<Folder> {
        Ok(Folder {
            path: self.path.clone(),
            fd: self.dir.try_clone()?,
        })
    }

    /// Keep staged files on disk when they are dropped (the daemon exits with
    /// edits that were not committed).
    pub fn keep_files(&self, keep: bool) {
        self.keep.store(keep, Ordering::Relaxed);
    }

    /// A new, empty staging file.
    pub fn new_file(self: &Arc<Self>) -> std::io::Result<Arc<StagedFile>> {
        loop {
            let number = self.next_file.fetch_add(1, Ordering::Relaxed);
            match self.open(number, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL) {
                Ok(file) => {
                    self.open_files.lock_anyway().put(number, Arc::new(file));
                    return Ok(Arc::new(StagedFile {
                        dir: self.clone(),
                        number,
                        len: AtomicU64::new(0),
                        pins: AtomicU32::new(0),
                    }));
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// A staging file with a copy of the first `keep` bytes of `bytes`.
    pub fn copy_of(self: &Arc<Self>, bytes: &Bytes, keep: u64) -> std::io::Result<Arc<StagedFile>> {
        let staged = self.new_file()?;
        let len = keep.min(bytes.len());
        let file = staged.file()?;
        bytes.copy_to(0, &file, 0, len)?;
        staged.set_len(len)?;
        Ok(staged)
    }

    /// A staging file holding `data`.
    pub fn file_with(self: &Arc<Self>, data: &[u8]) -> std::io::Result<Arc<StagedFile>> {
        let staged = self.new_file()?;
        staged.write_at(data, 0)?;
        Ok(staged)
    }

    /// An existing staging file, by the name the journal gave it.
    pub fn existing(self: &Arc<Self>, name: &str) -> std::io::Result<Arc<StagedFile>> {
        let number = staged_number(OsStr::new(name))
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        let file = self.open(number, libc::O_RDWR)?;
        let st = rustix::fs::fstat(&file)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != euid() {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
        let len = st.st_size as u64;
        self.open_files.lock_anyway().put(number, Arc::new(file));
        Ok(Arc::new(StagedFile {
            dir: self.clone(),
            number,
            len: AtomicU64::new(len),
            pins: AtomicU32::new(0),
        }))
    }

    fn open(&self, number: u64, flags: i32) -> std::io::Result<File> {
        let name = format!("s{number}");
        let flags = super::local::oflags(flags | libc::O_NOFOLLOW | libc::O_CLOEXEC);
        let mode = rustix::fs::Mode::from_raw_mode(0o600);
        Ok(File::from(rustix::fs::openat(
            &self.dir, name, flags, mode,
        )?))
    }

    fn file(&self, number: u64) -> std::io::Result<Arc<File>> {
        if let Some(f) = self.open_files.lock_anyway().get(&number) {
            return Ok(f.clone());
        }
        let file = Arc::new(self.open(number, libc::O_RDWR)?);
        self.open_files.lock_anyway().put(number, file.clone());
        Ok(file)
    }

    /// Writes a small file atomically (temp, fsync, rename, fsync the folder).
    pub fn write_atomic(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        let folder = self.folder()?;
        let tmp = format!("{name}.tmp");
        let _ = folder.unlink(OsStr::new(&tmp));
        let f = folder.open_file(
            OsStr::new(&tmp),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )?;
        f.write_all_at(data, 0)?;
        crate::testpoint::synced(&f, f.sync_all())?;
        folder.rename(OsStr::new(&tmp), OsStr::new(name))?;
        folder.sync()
    }

    /// Every name in the folder.
    pub fn list(&self) -> std::io::Result<Vec<OsString>> {
        // Read through our descriptor: /proc/self/fd names exactly this folder.
        let entries = std::fs::read_dir(format!("/proc/self/fd/{}", self.dir.as_raw_fd()))?;
        Ok(entries.flatten().map(|e| e.file_name()).collect())
    }

    /// Removes the folder and every file in it. Only for a folder this daemon
    /// created or adopted (checked at `adopt`).
    pub fn remove(&self) -> std::io::Result<()> {
        self.open_files.lock_anyway().clear();
        let folder = self.folder()?;
        for name in self.list()? {
            folder.unlink(&name)?;
        }
        let flags = rustix::fs::AtFlags::REMOVEDIR;
        Ok(rustix::fs::unlinkat(&self.parent.fd, &self.name, flags)?)
    }
}

fn staged_number(name: &OsStr) -> Option<u64> {
    let s = name.to_str()?.strip_prefix('s')?;
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn random_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    let n = h.finish();
    (0..8)
        .map(|i| {
            let d = ((n >> (i * 5)) & 31) as u8;
            (if d < 10 { b'0' + d } else { b'a' + d - 10 }) as char
        })
        .collect()
}

/// One staging file. It is removed when the last reference goes (unless the
/// folder keeps its files), so an open file handle keeps reading it after a
/// commit or an unlink.
pub struct StagedFile {
    dir: Arc<StagingDir>,
    number: u64,
    /// Its length: stfs is its only writer.
    len: AtomicU64,
    /// Commits copying from it right now: a write must not change it under them.
    pins: AtomicU32,
}

impl StagedFile {
    /// Its name in the staging folder.
    pub fn name(&self) -> String {
        format!("s{}", self.number)
    }

    pub fn dir(&self) -> &Arc<StagingDir> {
        &self.dir
    }

    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn file(&self) -> std::io::Result<Arc<File>> {
        self.dir.file(self.number)
    }

    /// Reads until `buf` is full or the file ends.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let file = self.file()?;
        let mut got = 0;
        while got < buf.len() {
            match file.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }

    pub fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EFBIG))?;
        self.file()?.write_all_at(data, offset)?;
        self.len.fetch_max(end, Ordering::Relaxed);
        Ok(())
    }

    pub fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.file()?.set_len(len)?;
        self.len.store(len, Ordering::Relaxed);
        Ok(())
    }

    pub fn sync(&self) -> std::io::Result<()> {
        let file = self.file()?;
        crate::testpoint::synced(&file, file.sync_data())
    }

    pub fn pin(&self) {
        self.pins.fetch_add(1, Ordering::AcqRel);
    }

    pub fn unpin(&self) {
        self.pins.fetch_sub(1, Ordering::AcqRel);
    }

    /// A commit is copying from it: writers must take a copy instead.
    pub fn pinned(&self) -> bool {
        self.pins.load(Ordering::Acquire) > 0
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        self.dir.open_files.lock_anyway().pop(&self.number);
        if !self.dir.keep.load(Ordering::Relaxed) {
            if let Ok(folder) = self.dir.folder() {
                let _ = folder.unlink(OsStr::new(&self.name()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent(dir: &Path) -> Arc<Folder> {
        Arc::new(Folder::open(dir).unwrap())
    }

    #[test]
    fn private_folder_files_and_removal() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Arc::new(StagingDir::create(parent(tmp.path()), "m.safetensors").unwrap());
        let meta = std::fs::metadata(dir.path()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o700);
        let f = dir.file_with(b"hello").unwrap();
        assert_eq!(f.len(), 5);
        let on_disk = dir.path().join(f.name());
        assert_eq!(
            std::fs::metadata(&on_disk).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let mut buf = [0u8; 10];
        assert_eq!(f.read_at(&mut buf, 1).unwrap(), 4);
        // Busy while held.
        let name = dir.path().file_name().unwrap().to_os_string();
        assert!(matches!(
            StagingDir::adopt(parent(tmp.path()), &name),
            Err(StagingError::Busy { .. })
        ));
        drop(f);
        assert!(!on_disk.exists(), "a dropped staging file is removed");
        dir.remove().unwrap();
        assert!(!dir.path().exists());
    }

    #[test]
    fn links_and_foreign_folders_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        std::os::unix::fs::symlink(&target, tmp.path().join(".m.stfs-link")).unwrap();
        let e = StagingDir::adopt(parent(tmp.path()), OsStr::new(".m.stfs-link"))
            .err()
            .unwrap();
        assert!(matches!(e, StagingError::Unsafe { .. }), "{e}");
        use std::os::unix::fs::PermissionsExt;
        let open = tmp.path().join(".m.stfs-open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = StagingDir::adopt(parent(tmp.path()), OsStr::new(".m.stfs-open"))
            .err()
            .unwrap();
        assert!(e.to_string().contains("lets others in"), "{e}");
        let e = StagingDir::adopt(parent(tmp.path()), OsStr::new("../x"))
            .err()
            .unwrap();
        assert!(matches!(e, StagingError::Unsafe { .. }));
    }

    #[test]
    fn existing_takes_only_staging_names() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Arc::new(StagingDir::create(parent(tmp.path()), "m").unwrap());
        for bad in ["/etc/passwd", "../s1", "s1/..", "x", "s", "s1x"] {
            assert!(dir.existing(bad).is_err(), "{bad}");
        }
        let f = dir.file_with(b"abc").unwrap();
        let name = f.name();
        dir.keep_files(true);
        drop(f);
        let again = dir.existing(&name).unwrap();
        assert_eq!(again.len(), 3);
    }
}
