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
use crate::source::Folder;

/// Descriptors of staging files kept open at once.
const OPEN_FILES: usize = 256;

/// A staging file holds its tensor at the same offset within a block of
/// this size as the tensor's place in the checkpoint (`StagedFile::pad`
/// bytes come first), so that a commit on a filesystem that clones ranges
/// (XFS, btrfs) shares the whole blocks instead of copying them. (Inserting
/// blocks at a file's start moves its tensors by whole blocks: it keeps this.)
pub const STAGING_ALIGN: u64 = 4096;

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
    /// The folder could not be made where staging folders go.
    #[error(
        "{}: making the staging folder of the edits in it: {source} (mount with --staging-dir DIR \
         to keep them in a folder of yours)",
        path.display()
    )]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl crate::errno::ToErrno for StagingError {
    fn to_errno(&self) -> i32 {
        match self {
            StagingError::Io { source, .. } | StagingError::Create { source, .. } => {
                source.to_errno()
            }
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
    /// Files were made since the folder was last fsynced.
    names_changed: AtomicBool,
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

impl StagingDir {
    /// Creates a new private folder `.<stem>.stfs-XXXXXX` in `parent`.
    pub fn create(parent: Arc<Folder>, stem: &str) -> Result<StagingDir, StagingError> {
        let io = |source| StagingError::Create {
            path: parent.path.clone(),
            source,
        };
        for _ in 0..100 {
            let name = OsString::from(format!(".{stem}.stfs-{}", random_suffix()));
            // mkdirat fails if anything (a link included) already has the name.
            let mode = rustix::fs::Mode::from_raw_mode(0o700);
            crate::testpoint::io("mkdir").map_err(io)?;
            match rustix::fs::mkdirat(&parent.fd, &name, mode) {
                Ok(()) => {
                    crate::testpoint::fs_event(crate::testpoint::FsEvent::Created {
                        folder: &parent.path,
                        name: &name,
                    });
                    let rmdir = rustix::fs::AtFlags::REMOVEDIR;
                    // (Its name durable before anything journaled in it is.)
                    if let Err(e) = parent.sync() {
                        let _ = rustix::fs::unlinkat(&parent.fd, &name, rmdir);
                        return Err(io(e));
                    }
                    // One that cannot be used (another filesystem's idea of
                    // its mode) is not left behind.
                    let adopted = StagingDir::adopt(parent.clone(), &name);
                    if adopted.is_err() {
                        let _ = rustix::fs::unlinkat(&parent.fd, &name, rmdir);
                    }
                    return adopted;
                }
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => return Err(io(e.into())),
            }
        }
        Err(io(std::io::Error::from_raw_os_error(libc::EEXIST)))
    }

    /// Why a private staging folder cannot be made in `parent`, if it
    /// cannot: the folder is not writable, or its filesystem shows a folder
    /// made 0700 as open to others or as another user's (another FUSE
    /// filesystem that shows every folder 0755, a network filesystem that
    /// maps owners). Local filesystems are taken as they are; others are
    /// tried with a folder made and removed at once.
    pub fn cannot_be_made_in(parent: &Folder, stem: &str) -> Option<String> {
        if !parent.writable() {
            return Some("that folder is not writable by you".into());
        }
        // ext4, XFS, btrfs, tmpfs, overlayfs, ZFS, f2fs: modes as made.
        const LOCAL: [u64; 7] = [
            0xEF53,
            0x5846_5342,
            0x9123_683E,
            0x0102_1994,
            0x794C_7630,
            0x2FC1_2FC1,
            0xF2F5_2010,
        ];
        if rustix::fs::fstatfs(&parent.fd).is_ok_and(|s| LOCAL.contains(&(s.f_type as u64))) {
            return None;
        }
        let name = OsString::from(format!(".{stem}.stfs-probe-{}", random_suffix()));
        let mode = rustix::fs::Mode::from_raw_mode(0o700);
        if let Err(e) = rustix::fs::mkdirat(&parent.fd, &name, mode) {
            return Some(format!("a folder cannot be made there ({e})"));
        }
        let flags = rustix::fs::OFlags::RDONLY
            | rustix::fs::OFlags::DIRECTORY
            | rustix::fs::OFlags::NOFOLLOW
            | rustix::fs::OFlags::CLOEXEC;
        let seen = rustix::fs::openat(&parent.fd, &name, flags, rustix::fs::Mode::empty())
            .and_then(|d| rustix::fs::fstat(&d));
        let _ = rustix::fs::unlinkat(&parent.fd, &name, rustix::fs::AtFlags::REMOVEDIR);
        match seen {
            Ok(st) if st.st_uid == euid() && st.st_mode & 0o077 == 0 => None,
            Ok(st) => Some(format!(
                "its filesystem shows a folder made 0700 by uid {} as {:o}, owned by uid {}",
                euid(),
                st.st_mode & 0o7777,
                st.st_uid
            )),
            Err(e) => Some(format!("a folder made there cannot be opened ({e})")),
        }
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
            names_changed: AtomicBool::new(false),
        };
        // New files never take the name of one already there.
        let highest = staging
            .list()
            .map_err(io)?
            .iter()
            .filter_map(|n| parse_staged_name(n).map(|(number, _)| number))
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

    /// A new, empty staging file whose byte 0 sits `pad` bytes into it
    /// (see `STAGING_ALIGN`).
    pub fn new_file(self: &Arc<Self>, pad: u64) -> std::io::Result<Arc<StagedFile>> {
        let pad = pad % STAGING_ALIGN;
        loop {
            let number = self.next_file.fetch_add(1, Ordering::Relaxed);
            let name = staged_name(number, pad);
            match self.open(&name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL) {
                Ok(file) => {
                    self.open_files.lock_anyway().put(number, Arc::new(file));
                    return Ok(Arc::new(StagedFile {
                        dir: self.clone(),
                        number,
                        pad,
                        len: AtomicU64::new(0),
                        pins: AtomicU32::new(0),
                    }));
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// A staging file with a copy of the first `keep` bytes of `bytes`, `pad`
    /// bytes into it.
    pub fn copy_of(
        self: &Arc<Self>,
        bytes: &Bytes,
        keep: u64,
        pad: u64,
    ) -> std::io::Result<Arc<StagedFile>> {
        let staged = self.new_file(pad)?;
        let len = keep.min(bytes.len());
        let file = staged.file()?;
        match len == bytes.len() {
            // Whole: where the filesystem clones ranges (XFS, btrfs), the
            // blocks are shared, not copied (a 4-byte patch of a 2 GiB
            // tensor then costs a block).
            true => bytes
                .copy_sharing_to(&file, staged.pad, STAGING_ALIGN)
                .map(|_| ())?,
            false => bytes.copy_to(0, &file, staged.pad, len)?,
        }
        staged.set_len(len)?;
        Ok(staged)
    }

    /// A staging file holding `data`.
    pub fn file_with(self: &Arc<Self>, data: &[u8]) -> std::io::Result<Arc<StagedFile>> {
        let staged = self.new_file(0)?;
        staged.write_at(data, 0)?;
        Ok(staged)
    }

    /// An existing staging file, by the name the journal gave it.
    pub fn existing(self: &Arc<Self>, name: &str) -> std::io::Result<Arc<StagedFile>> {
        let (number, pad) = parse_staged_name(OsStr::new(name))
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        let file = self.open(name, libc::O_RDWR)?;
        let st = rustix::fs::fstat(&file)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != euid() {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
        let len = (st.st_size as u64).saturating_sub(pad);
        self.open_files.lock_anyway().put(number, Arc::new(file));
        Ok(Arc::new(StagedFile {
            dir: self.clone(),
            number,
            pad,
            len: AtomicU64::new(len),
            pins: AtomicU32::new(0),
        }))
    }

    fn open(&self, name: &str, flags: i32) -> std::io::Result<File> {
        let creates = flags & libc::O_CREAT != 0;
        crate::testpoint::io(if creates { "create" } else { "open" })?;
        let oflags = super::folder::oflags(flags | libc::O_NOFOLLOW | libc::O_CLOEXEC);
        let mode = rustix::fs::Mode::from_raw_mode(0o600);
        let file = File::from(rustix::fs::openat(&self.dir, name, oflags, mode)?);
        if creates && flags & libc::O_EXCL != 0 {
            self.names_changed.store(true, Ordering::SeqCst);
            crate::testpoint::fs_event(crate::testpoint::FsEvent::Created {
                folder: &self.path,
                name: OsStr::new(name),
            });
        }
        Ok(file)
    }

    fn file(&self, number: u64, pad: u64) -> std::io::Result<Arc<File>> {
        if let Some(f) = self.open_files.lock_anyway().get(&number) {
            return Ok(f.clone());
        }
        let file = Arc::new(self.open(&staged_name(number, pad), libc::O_RDWR)?);
        self.open_files.lock_anyway().put(number, file.clone());
        Ok(file)
    }

    /// A file was made in the folder (the journal, by its own descriptor).
    pub fn made_a_file(&self) {
        self.names_changed.store(true, Ordering::SeqCst);
    }

    /// Makes the names of the files made since durable (an fsync of the
    /// folder, if any was): before a journal that names them is.
    pub fn sync_names(&self) -> std::io::Result<()> {
        if !self.names_changed.swap(false, Ordering::SeqCst) {
            return Ok(());
        }
        let synced = self.folder().and_then(|f| f.sync());
        if synced.is_err() {
            self.names_changed.store(true, Ordering::SeqCst);
        }
        synced
    }

    /// Writes a small file atomically (temp, fsync, rename, fsync the folder).
    pub fn write_atomic(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        let folder = self.folder()?;
        let tmp = format!("{name}.tmp");
        folder.unlink_spent(OsStr::new(&tmp));
        let f = folder.open_file(
            OsStr::new(&tmp),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )?;
        crate::testpoint::io("write")?;
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
        let names = self.list()?;
        // (A test pauses here, to let a spent staging file go first.)
        let _ = crate::testpoint::point("staging:remove");
        // (A name gone meanwhile is no error: a commit lets its spent
        // staging files go on a thread of their own. One left behind makes
        // the folder's removal fail, and says so.)
        for name in names {
            folder.unlink_spent(&name);
        }
        crate::testpoint::io_best_effort("rmdir")?;
        let flags = rustix::fs::AtFlags::REMOVEDIR;
        Ok(rustix::fs::unlinkat(&self.parent.fd, &self.name, flags)?)
    }
}

/// A staging file's name: `s<number>`, or `s<number>+<pad>` when its bytes
/// start `pad` bytes into it.
fn staged_name(number: u64, pad: u64) -> String {
    match pad {
        0 => format!("s{number}"),
        _ => format!("s{number}+{pad}"),
    }
}

/// The number and pad of a staging file's name (`staged_name`).
fn parse_staged_name(name: &OsStr) -> Option<(u64, u64)> {
    let s = name.to_str()?.strip_prefix('s')?;
    let (number, pad) = s.split_once('+').unwrap_or((s, "0"));
    let digits = |t: &str| !t.is_empty() && t.len() <= 19 && t.bytes().all(|b| b.is_ascii_digit());
    if !digits(number) || !digits(pad) {
        return None;
    }
    let (number, pad): (u64, u64) = (number.parse().ok()?, pad.parse().ok()?);
    // Only the name stfs gives (no "s01", no "s1+0"): one file per number.
    (pad < STAGING_ALIGN && staged_name(number, pad) == name.to_str()?).then_some((number, pad))
}

/// Where the bytes of the staging file so named start in it.
pub fn staged_pad(name: &str) -> u64 {
    parse_staged_name(OsStr::new(name)).map_or(0, |(_, pad)| pad)
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
    /// Bytes before the tensor's byte 0 in the file (see `STAGING_ALIGN`).
    pad: u64,
    /// Its length: stfs is its only writer.
    len: AtomicU64,
    /// Commits copying from it right now: a write must not change it under them.
    pins: AtomicU32,
}

impl StagedFile {
    /// Its name in the staging folder.
    pub fn name(&self) -> String {
        staged_name(self.number, self.pad)
    }

    /// Where the tensor's bytes start in `file()`.
    pub fn pad(&self) -> u64 {
        self.pad
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

    /// The file, whose bytes start at `pad()`.
    pub fn file(&self) -> std::io::Result<Arc<File>> {
        self.dir.file(self.number, self.pad)
    }

    /// Reads until `buf` is full or the file ends.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let file = self.file()?;
        let mut got = 0;
        while got < buf.len() {
            match file.read_at(&mut buf[got..], self.pad + offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }

    pub fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.write_parts_at(&[data], offset)
    }

    /// Writes `parts` one after the other from `offset`, in one `pwritev`
    /// where it can: a write that needs bytes around it is not copied
    /// into one buffer with them first.
    pub fn write_parts_at(&self, parts: &[&[u8]], offset: u64) -> std::io::Result<()> {
        let len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let end = offset
            .checked_add(len)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EFBIG))?;
        let file = self.file()?;
        crate::testpoint::io("write")?;
        let mut slices: Vec<std::io::IoSlice> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| std::io::IoSlice::new(p))
            .collect();
        let mut left = &mut slices[..];
        let mut at = self.pad + offset;
        while !left.is_empty() {
            let n = rustix::io::pwritev(&*file, left, at)?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            at += n as u64;
            std::io::IoSlice::advance_slices(&mut left, n);
        }
        self.len.fetch_max(end, Ordering::Relaxed);
        Ok(())
    }

    pub fn set_len(&self, len: u64) -> std::io::Result<()> {
        let file = self.file()?;
        crate::testpoint::io("truncate")?;
        file.set_len(self.pad + len)?;
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
                folder.unlink_spent(OsStr::new(&self.name()));
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

    /// Every mode of a staging folder but the private one is refused (0750,
    /// 0701, 0777, ... each of the 63 others), and no file in it is read.
    #[test]
    fn a_staging_folder_is_adopted_only_with_the_private_mode() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        for others in 0..0o100u32 {
            let mode = 0o700 | others;
            let name = format!(".m.stfs-mode{mode:o}");
            let path = tmp.path().join(&name);
            std::fs::create_dir(&path).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let adopted = StagingDir::adopt(parent(tmp.path()), OsStr::new(&name));
            match mode {
                0o700 => assert!(adopted.is_ok(), "mode 0700 refused"),
                _ => assert!(
                    matches!(adopted, Err(StagingError::Unsafe { .. })),
                    "mode {mode:o} adopted"
                ),
            }
        }
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
        for bad in [
            "/etc/passwd",
            "../s1",
            "s1/..",
            "x",
            "s",
            "s1x",
            "s1+",
            "s1+4096",
            "s1+-1",
        ] {
            assert!(dir.existing(bad).is_err(), "{bad}");
        }
        let f = dir.file_with(b"abc").unwrap();
        let name = f.name();
        dir.keep_files(true);
        drop(f);
        let again = dir.existing(&name).unwrap();
        assert_eq!(again.len(), 3);
    }

    #[test]
    fn a_padded_file_keeps_its_bytes_after_the_pad_and_says_so_in_its_name() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Arc::new(StagingDir::create(parent(tmp.path()), "m").unwrap());
        let f = dir.new_file(4096 + 1000).unwrap();
        assert_eq!((f.pad(), f.name()), (1000, format!("s{}+1000", f.number)));
        f.write_at(b"hello", 2).unwrap();
        assert_eq!(f.len(), 7);
        let mut buf = [0u8; 7];
        assert_eq!(f.read_at(&mut buf, 0).unwrap(), 7);
        assert_eq!(&buf, b"\0\0hello");
        assert_eq!(f.file().unwrap().metadata().unwrap().len(), 1007);
        assert_eq!(staged_pad(&f.name()), 1000);
        f.set_len(3).unwrap();
        assert_eq!(f.file().unwrap().metadata().unwrap().len(), 1003);
        dir.keep_files(true);
        let name = f.name();
        drop(f);
        let again = dir.existing(&name).unwrap();
        assert_eq!((again.len(), again.pad()), (3, 1000));
        // A copy keeps the bytes, at the pad asked for.
        let copy = dir.copy_of(&Bytes::Staged(again), u64::MAX, 7).unwrap();
        let mut buf = [0u8; 3];
        copy.read_at(&mut buf, 0).unwrap();
        assert_eq!((&buf, copy.pad()), (b"\0\0h", 7));
    }

    #[test]
    fn parts_are_written_one_after_the_other_after_the_pad() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Arc::new(StagingDir::create(parent(tmp.path()), "m").unwrap());
        let f = dir.new_file(100).unwrap();
        let big = vec![7u8; 3 << 20];
        f.write_parts_at(&[b"ab", b"", &big, b"z"], 5).unwrap();
        assert_eq!(f.len(), 5 + 3 + (3 << 20));
        let mut buf = vec![0u8; 8];
        f.read_at(&mut buf, 3).unwrap();
        assert_eq!(&buf, b"\0\0ab\x07\x07\x07\x07");
        let mut last = [0u8; 2];
        f.read_at(&mut last, 5 + 2 + (3 << 20) - 1).unwrap();
        assert_eq!(&last, b"\x07z");
        assert_eq!(f.file().unwrap().metadata().unwrap().len(), 100 + f.len());
        f.write_parts_at(&[], 0).unwrap();
        assert_eq!(f.len(), 5 + 3 + (3 << 20));
    }
}
