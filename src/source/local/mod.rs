//! A checkpoint file as mounted (`SourceFile`): its validated header over
//! the `Store` that holds its bytes. A local one (`LocalFile`) is opened
//! once through its folder's descriptor, validated and mapped read-only
//! (reads are served from the mapping; commits write beside it through the
//! same folder descriptor and rename over it, or write it in place); a
//! remote one is an object read through the local cache (`remote`).

mod committed;
mod extents;
mod open;
mod watch;
use crate::source::folder::*;
pub use extents::*;

use crate::sync::{LockAnyway, RwLockAnyway};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::time::SystemTime;

use memmap2::{Advice, Mmap, UncheckedAdvice};
use tracing::warn;

use super::remote::RemoteObject;
use super::store::Store;
use crate::format::{FormatError, Header};

/// Why a source could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a regular file", path.display())]
    NotRegular { path: PathBuf },
    #[error("{}: {error}{}", path.display(), if looks_foreign(error) { " (not a safetensors file?)" } else { "" })]
    Format {
        path: PathBuf,
        #[source]
        error: FormatError,
    },
    /// An in-place commit of stfs was interrupted: the record that
    /// completes it is in the staging folder of the mount that made it.
    #[error(
        "{}: a commit of stfs that writes this file in place was interrupted, so every reader \
         refuses it until it is completed; `stfs mount` of it completes it from the record in \
         its staging folder (give the --staging-dir of the interrupted mount, if it had one)",
        path.display()
    )]
    Interrupted { path: PathBuf },
}

impl crate::errno::ToErrno for SourceError {
    fn to_errno(&self) -> i32 {
        match self {
            SourceError::Io { source, .. } => source.to_errno(),
            SourceError::NotRegular { .. } | SourceError::Format { .. } => libc::EINVAL,
            SourceError::Interrupted { .. } => libc::EIO,
        }
    }
}

/// Errors that a file of another format typically gets at its first bytes.
fn looks_foreign(e: &FormatError) -> bool {
    matches!(
        e,
        FormatError::TooShort { .. }
            | FormatError::HeaderTooLarge { .. }
            | FormatError::HeaderTruncated { .. }
            | FormatError::HeaderNotUtf8 { .. }
            | FormatError::HeaderJson { tensor: None, .. }
    )
}

pub struct SourceFile {
    /// The path the user gave, made absolute (may be a symbolic link), or the
    /// URL of a remote object.
    path: PathBuf,
    /// Its name in its folder (the link's target for a linked source; the
    /// last part of a remote object's key).
    name: OsString,
    /// The file as validated (synthesized for a remote object: read-only,
    /// owned by the user who mounted it).
    stat: FileStat,
    header: Header,
    /// Where its bytes are.
    store: Box<dyn Store>,
    /// A GGUF file's keys and values as `__metadata__.json` shows them:
    /// made on first use (a tokenizer's arrays are read then), kept.
    gguf_shown: std::sync::OnceLock<Vec<u8>>,
}

/// A local file as a `Store`: mapped read-only, its version checked by
/// length and modification time before each read, written in place by
/// commits (clones, block insertion at its start).
pub struct LocalFile {
    /// The folder holding the file itself.
    folder: Arc<Folder>,
    /// Kept open: commits copy unchanged bytes from it with copy_file_range.
    file: Arc<File>,
    /// Bytes inserted at the file's start (by in-place commits that grew
    /// the header) before this `SourceFile` was made: its offsets are
    /// the file's now minus the inserts since (`OpenFile::view`).
    shift_base: u64,
    /// Its number among the `SourceFile`s of this open file (`OpenFile::retired`).
    made: u64,
    /// Drop the daemon's page-table references after each read.
    release_after_read: AtomicBool,
    /// `file` is open for writing too: commits may write it in place.
    writable: bool,
    /// The version of the file reads accept, shared with the
    /// `SourceFile`s that in-place commits make of the same open file.
    shared: Arc<OpenFile>,
    /// The file changed behind the mount: said once in the log.
    warned_stale: AtomicBool,
}

/// The length and modification time a local source is expected to have: the
/// version validated, then the one each in-place commit of this mount left.
/// The `SourceFile` from before an in-place commit keeps serving the ranges
/// the commit did not touch, so both accept the new version.
struct OpenFile {
    accepted: Mutex<(u64, (i64, i64))>,
    /// An in-place commit is writing the file: reads of ranges it does not
    /// touch go on.
    writing: AtomicBool,
    /// The file could not be mapped again after bytes were inserted at its
    /// start: every read fails (EIO).
    broken: AtomicBool,
    /// Ranges (the file's offsets now) that in-place commits overwrote or
    /// cut, each with the count of `SourceFile`s made before it: a read of
    /// one of those through an older `SourceFile` is of bytes that are gone
    /// (a read that took its tensor just before an edit and a commit), and
    /// fails (EIO) instead of serving another tensor's bytes.
    retired: Mutex<Vec<(u64, Vec<Range<u64>>)>>,
    /// `SourceFile`s made of this open file so far.
    made: std::sync::atomic::AtomicU64,
    /// The mapping every `SourceFile` of this open file reads through.
    /// Reads hold it shared; an in-place commit holds it alone while it
    /// inserts blocks at the file's start, and maps the file again.
    mapping: RwLock<Mapping>,
    /// Writes by other programs, seen as they happen (a file rewritten in
    /// place keeps its size and time if they are put back).
    watch: Option<watch::Watch>,
}

struct Mapping {
    /// The whole file, mapped read-only and shared with the page cache.
    map: Mmap,
    /// Bytes inserted at the start since the file was opened.
    shift: u64,
}

impl OpenFile {
    fn new(map: Mmap, stat: &FileStat, watch: Option<watch::Watch>) -> Arc<OpenFile> {
        Arc::new(OpenFile {
            accepted: Mutex::new((stat.len, stat.mtime)),
            writing: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            retired: Mutex::new(Vec::new()),
            made: std::sync::atomic::AtomicU64::new(0),
            mapping: RwLock::new(Mapping { map, shift: 0 }),
            watch,
        })
    }

    fn mapping(&self) -> RwLockReadGuard<'_, Mapping> {
        self.mapping.read_anyway()
    }

    /// EIO if `range` (the file's offsets now) was overwritten or cut by an
    /// in-place commit after the `SourceFile` numbered `made` was made.
    fn alive(&self, made: u64, range: Range<u64>, path: &Path) -> std::io::Result<()> {
        let retired = self.retired.lock_anyway();
        let gone = retired
            .iter()
            .filter(|(before, _)| made < *before)
            .flat_map(|(_, ranges)| ranges)
            .any(|r| r.start < range.end && range.start < r.end);
        if gone {
            warn!(file = %path.display(), "a read of bytes that an in-place commit replaced as it started: EIO (read again)");
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }
}

impl SourceFile {
    /// The local file this source is, if it is one.
    fn local_file(&self) -> Option<&LocalFile> {
        self.store.as_any().downcast_ref()
    }

    /// A remote object, its header validated: shown as a file of the user
    /// who mounted it (0644: a read-only mount takes the write bits off),
    /// modified when the store says it was.
    pub fn remote(object: RemoteObject, header: Header) -> SourceFile {
        let id = object.cache_key();
        let stat = FileStat {
            ino: id
                .get(..16)
                .and_then(|h| u64::from_str_radix(h, 16).ok())
                .unwrap_or(0),
            len: object.size(),
            mtime: match object.modified().duration_since(SystemTime::UNIX_EPOCH) {
                Ok(d) => (d.as_secs() as i64, d.subsec_nanos() as i64),
                Err(_) => (0, 0),
            },
            ..FileStat::of_mounting_user(libc::S_IFREG | 0o644)
        };
        SourceFile {
            gguf_shown: Default::default(),
            path: PathBuf::from(object.url()),
            name: OsString::from(object.file_name()),
            stat,
            header,
            store: Box::new(object),
        }
    }

    /// The absolute path the user named, or the URL of a remote object.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The folder holding a local file (None for a remote object).
    pub fn folder(&self) -> Option<&Arc<Folder>> {
        self.local_file().map(|l| &l.folder)
    }

    /// The open local file (None for a remote object).
    pub fn file(&self) -> Option<&Arc<File>> {
        self.local_file().map(|l| &l.file)
    }

    /// The remote object this is (None for a local file).
    pub fn remote_object(&self) -> Option<&RemoteObject> {
        self.store.remote()
    }

    /// The file's own name in its folder (the link's target for a linked source).
    pub fn file_name(&self) -> &OsStr {
        &self.name
    }

    /// The file as validated and mapped.
    pub fn stat(&self) -> &FileStat {
        &self.stat
    }

    /// The file as mapped, with its owner, group and mode as they are now
    /// (narrowed by an ACL, `access::owner_now`): what the mount shows and
    /// the kernel enforces, so that a chmod behind the mount applies at once.
    pub fn owner_now(&self) -> FileStat {
        self.store.owner_now(&self.stat)
    }

    pub fn modified(&self) -> SystemTime {
        self.stat.modified()
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Whether reads drop the daemon's page-table references after each reply.
    pub fn set_release_after_read(&self, release: bool) {
        if let Some(LocalFile {
            release_after_read, ..
        }) = self.local_file()
        {
            release_after_read.store(release, Ordering::Relaxed);
        }
    }

    /// Copies bytes `from..from+len` of tensor `index` into `to` at `to_off`,
    /// with no in-place commit moving them meanwhile.
    pub fn copy_tensor(
        &self,
        index: usize,
        from: u64,
        to: &File,
        to_off: u64,
        len: u64,
    ) -> std::io::Result<()> {
        let start = self.tensor_range(index).start + from;
        match self.local_file() {
            Some(local) => local.in_file(start, 0, len, &self.path, |file, at| {
                super::copy_range(file, at, to, to_off, len)
            }),
            None => super::copy_through(|b, p| self.read_at(b, p), start, to, to_off, len),
        }
    }

    /// All of tensor `index` into `to` at `to_off`, its blocks shared where
    /// they can be (`copy_sharing`). Returns the bytes shared.
    pub fn share_tensor(
        &self,
        index: usize,
        to: &File,
        to_off: u64,
        block: u64,
    ) -> std::io::Result<u64> {
        let range = self.tensor_range(index);
        let len = range.end - range.start;
        let local = self
            .local_file()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EROFS))?;
        local.in_file(range.start, 0, len, &self.path, |file, start| {
            super::copy_sharing(file, start, to, to_off, len, block)
        })
    }

    /// Where the header's JSON ends in the file (its last byte that is not
    /// a space, plus one): what follows up to the data is padding.
    pub fn header_json_end(&self) -> u64 {
        let end = self.header.data_start();
        let Some(LocalFile {
            shared, shift_base, ..
        }) = self.local_file()
        else {
            return end;
        };
        let mapping = shared.mapping();
        // (The header of the file now: at the start, whatever was inserted since.)
        if mapping.shift != *shift_base {
            return end + mapping.shift - shift_base;
        }
        let map = &mapping.map[..(end as usize).min(mapping.map.len())];
        map.iter()
            .rposition(|&b| b != b' ')
            .map_or(end, |i| i as u64 + 1)
    }

    /// A read-only open of the same file (not of its path, which another
    /// program may have replaced): another reader of it, as the kernel
    /// counts readers for leases. Waits while an in-place commit holds its
    /// write lease.
    pub fn reopen_read_only(&self) -> std::io::Result<File> {
        use std::os::fd::AsRawFd;
        let file = self
            .file()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EROFS))?;
        File::open(format!("/proc/self/fd/{}", file.as_raw_fd()))
    }

    /// Whether the local file starts with `bytes` (as this `SourceFile` knows it).
    pub fn starts_with(&self, bytes: &[u8]) -> bool {
        let Some(LocalFile {
            shared, shift_base, ..
        }) = self.local_file()
        else {
            return false;
        };
        let at = shared.mapping().shift - shift_base;
        if self.check_unchanged().is_err() {
            return false;
        }
        // Read, not compared in the mapping: a file cut short behind the
        // mount must give an error here, never SIGBUS.
        let mut head = vec![0u8; bytes.len()];
        use std::os::unix::fs::FileExt;
        match self.file() {
            Some(file) => file.read_exact_at(&mut head, at).is_ok() && head == bytes,
            None => false,
        }
    }

    /// Whether the local file is now exactly as this `SourceFile` knows it,
    /// `len` bytes with `header` at its start: nothing inserted since, not
    /// changed behind the mount, not being written by a commit.
    pub fn is_now(&self, header: &[u8], len: u64) -> bool {
        let Some(LocalFile { shared, made, .. }) = self.local_file() else {
            return false;
        };
        let accepted = *shared.accepted.lock_anyway();
        // (The newest `SourceFile` of the file: no in-place commit since.)
        *made + 1 == shared.made.load(Ordering::SeqCst)
            && accepted.0 == len
            && self.shift() == 0
            && !shared.writing.load(Ordering::SeqCst)
            && self.check_unchanged().is_ok()
            && self.header.data_start() == header.len() as u64
    }

    /// Bytes inserted at the file's start since this `SourceFile` was made:
    /// its offsets plus this are the file's now.
    pub fn shift(&self) -> u64 {
        self.store.shift()
    }

    /// Byte range of tensor `index` in the file (as this `SourceFile` knows it: see `shift`).
    pub fn tensor_range(&self, index: usize) -> Range<u64> {
        let t = self.header.tensors.get(index);
        let start = self.header.data_start();
        start + t.data_offsets.0..start + t.data_offsets.1
    }

    /// Whether another program wrote the local file since it was mapped
    /// (or since this mount's last commit of it), whatever its size and
    /// time say now.
    pub fn written_behind(&self) -> bool {
        match self.local_file() {
            Some(LocalFile { shared, .. }) => shared.watch.as_ref().is_some_and(|w| w.changed()),
            None => false,
        }
    }

    /// EIO (with the reason logged once) if another program truncated or
    /// rewrote the file since it was validated (for a remote object: if a
    /// read found it replaced).
    pub fn check_unchanged(&self) -> std::io::Result<()> {
        self.store.check_unchanged(&self.path)
    }

    /// Serves bytes `offset..offset+size` of tensor `index` (clamped to its
    /// end), as its store hands them out (`Store::serve`).
    pub fn serve<R>(
        &self,
        index: usize,
        offset: u64,
        size: u32,
        serve: impl FnOnce(&[u8]) -> R,
    ) -> std::io::Result<R> {
        let range = self.tensor_range(index);
        let start = range.start.saturating_add(offset).min(range.end);
        let end = start.saturating_add(size as u64).min(range.end);
        if end == start {
            return Ok(serve(&[]));
        }
        let tensor = (index as u32, self.header.tensors.name(index), range);
        let (mut serve, mut out) = (Some(serve), None);
        self.store
            .serve(start..end, tensor, &self.path, &mut |bytes| {
                out = serve.take().map(|f| f(bytes));
            })?;
        out.ok_or_else(|| std::io::Error::other("the store served nothing"))
    }

    /// Fills `out` with the bytes of tensor `index` from `offset` on, read
    /// from the file (pread) rather than copied out of the mapping, so that
    /// a file cut short behind the mount is EIO, never SIGBUS.
    pub fn read_tensor_exact(
        &self,
        index: usize,
        offset: u64,
        out: &mut [u8],
    ) -> std::io::Result<()> {
        let range = self.tensor_range(index);
        let short = || std::io::Error::from_raw_os_error(libc::EIO);
        if offset
            .checked_add(out.len() as u64)
            .is_none_or(|end| end > range.end - range.start)
        {
            return Err(short());
        }
        self.check_unchanged()?;
        // (A test cuts the file here, after the check, as a race would.)
        crate::testpoint::point("view:read-source")?;
        let mut done = 0;
        while done < out.len() {
            let n = self.read_at(&mut out[done..], range.start + offset + done as u64)?;
            if n == 0 {
                warn!(file = %self.path.display(), "the source is shorter than its header says: cut behind the mount?");
                return Err(short());
            }
            done += n;
        }
        Ok(())
    }

    /// `len` bytes of the file at `pos`; EIO if it ends sooner.
    pub fn read_range(&self, pos: u64, len: u64) -> std::io::Result<Vec<u8>> {
        let mut out = vec![0u8; len as usize];
        let mut done = 0;
        while done < out.len() {
            match self.read_at(&mut out[done..], pos + done as u64)? {
                0 => return Err(std::io::Error::from_raw_os_error(libc::EIO)),
                n => done += n,
            }
        }
        Ok(out)
    }

    /// A GGUF file's keys and values as `__metadata__.json` shows them
    /// (None for safetensors).
    pub fn gguf_metadata_json(&self) -> Option<std::io::Result<&[u8]>> {
        let g = self.header.gguf.as_ref()?;
        // (Arrays are the file's bytes: EIO once it changed, as its tensors.)
        let arrays = g
            .kvs
            .iter()
            .any(|(_, v)| matches!(v, crate::format::gguf::Value::Array(_)));
        if let Err(e) = arrays.then(|| self.check_unchanged()).transpose() {
            return Some(Err(e));
        }
        if let Some(shown) = self.gguf_shown.get() {
            return Some(Ok(shown));
        }
        let read = |at, len| self.read_range(at, len);
        Some(
            crate::format::gguf::metadata_json(g, &read)
                .map(|made| self.gguf_shown.get_or_init(|| made).as_slice()),
        )
    }

    /// Reads bytes of the file at `pos` (absolute) into `buf`; fewer at its end.
    pub fn read_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
        self.read_shifted(buf, pos, 0)
    }

    /// `read_at` of a position taken when `seen` bytes had been inserted at
    /// the start since this `SourceFile` was made (a `Backing` made earlier).
    pub fn read_shifted(&self, buf: &mut [u8], pos: u64, seen: u64) -> std::io::Result<usize> {
        self.store.read_at(buf, pos, seen, &self.path)
    }
}

impl LocalFile {
    /// Runs `f` on the file and the place there of `len` bytes at `pos`
    /// (an offset as this `SourceFile` sees it, less `seen` bytes inserted
    /// since), once they are checked to be the bytes validated; no in-place
    /// commit moves them until `f` returns.
    fn in_file<R>(
        &self,
        pos: u64,
        seen: u64,
        len: u64,
        path: &Path,
        f: impl FnOnce(&File, u64) -> std::io::Result<R>,
    ) -> std::io::Result<R> {
        let mapping = self.shared.mapping();
        let at = pos + (mapping.shift - self.shift_base) - seen;
        self.shared.alive(self.made, at..at + len, path)?;
        let done = f(&self.file, at);
        drop(mapping);
        done
    }
}

impl Store for LocalFile {
    /// Straight from the mapping, faulted in with one MADV_POPULATE_READ
    /// first (faster than a fault per page, and it fails with EFAULT, not
    /// SIGBUS, if the file was cut short).
    fn serve(
        &self,
        range: Range<u64>,
        _tensor: (u32, &str, Range<u64>),
        path: &Path,
        serve: &mut dyn FnMut(&[u8]),
    ) -> std::io::Result<()> {
        let mapping = self.shared.mapping();
        // Where the bytes are now: further on by what was inserted since.
        let delta = mapping.shift - self.shift_base;
        let (start, end) = ((range.start + delta) as usize, (range.end + delta) as usize);
        let map = &mapping.map;
        self.check_unchanged(path)?;
        self.shared
            .alive(self.made, start as u64..end as u64, path)?;
        if let Err(e) = map.advise_range(Advice::PopulateRead, start, end - start) {
            // Kernels before 5.14 refuse the advice (EINVAL): reads still work.
            if e.raw_os_error() != Some(libc::EINVAL) {
                warn!(file = %path.display(), "reading the source: {e}");
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
        }
        serve(&map[start..end]);
        if self.release_after_read.load(Ordering::Relaxed) {
            // SAFETY: shared, read-only, file-backed mapping: dropping its pages
            // only makes a later access fault them in again, same contents.
            let _ = unsafe {
                map.unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start)
            };
        }
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], pos: u64, seen: u64, path: &Path) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let len = buf.len() as u64;
        self.in_file(pos, seen, len, path, |file, at| file.read_at(buf, at))
    }

    fn check_unchanged(&self, path: &Path) -> std::io::Result<()> {
        let shared = &self.shared;
        if shared.broken.load(Ordering::SeqCst) {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        if shared.writing.load(Ordering::SeqCst) {
            return Ok(());
        }
        let now = FileStat::of(&self.file)?;
        let accepted = *shared.accepted.lock_anyway();
        let written = shared.watch.as_ref().is_some_and(|w| w.changed());
        if (now.len, now.mtime) == accepted && !written {
            return Ok(());
        }
        if !self.warned_stale.swap(true, Ordering::Relaxed) {
            warn!(
                file = %path.display(),
                "the source was {} behind the mount: its reads now fail with EIO (staged edits are kept; \
                 unmount with --discard or commit --force)",
                match (now.len < accepted.0, (now.len, now.mtime) == accepted) {
                    (true, _) => "truncated",
                    (false, true) => "written by another program (its size and time put back)",
                    (false, false) => "rewritten",
                }
            );
        }
        Err(std::io::Error::from_raw_os_error(libc::EIO))
    }

    fn owner_now(&self, stat: &FileStat) -> FileStat {
        super::access::owner_now(&self.file, stat)
    }

    fn shift(&self) -> u64 {
        self.shared.mapping().shift - self.shift_base
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
