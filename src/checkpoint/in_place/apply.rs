//! Applying a redo record to its file, step by step (the marker, blocks
//! for appends, the header's room, the data, the header, the prefix), each
//! step safe to do again after a crash; and the file operations it uses,
//! which the crash explorer records.

use super::*;

/// The operations an in-place commit makes on its file: the file itself, or
/// in tests a recorder from which the crash explorer (`explore.rs`) builds
/// every state a crash may leave.
pub trait FileOps {
    fn size(&self) -> std::io::Result<u64>;
    fn write_at(&self, buf: &[u8], at: u64) -> std::io::Result<()>;
    /// Copies `len` bytes of `from` at `from_off` to `at` (a staging file's),
    /// sharing whole blocks where the filesystem can; returns the bytes shared.
    fn copy_in(&self, from: &File, from_off: u64, at: u64, len: u64) -> std::io::Result<u64>;
    /// Copies `len` bytes of this file from `from` to `at`.
    fn copy_within(&self, from: u64, at: u64, len: u64) -> std::io::Result<()>;
    fn set_len(&self, len: u64) -> std::io::Result<()>;
    /// Allocates blocks for `len` bytes at `at`, the size unchanged.
    fn reserve(&self, at: u64, len: u64) -> std::io::Result<()>;
    fn sync_data(&self) -> std::io::Result<()>;
    fn sync_all(&self) -> std::io::Result<()>;
    fn mode(&self) -> std::io::Result<u32>;
    fn set_mode(&self, mode: u32) -> std::io::Result<()>;
    fn set_mtime(&self, mtime: (i64, i64)) -> std::io::Result<()>;
    /// The insertion was recorded durably in the staging folder.
    fn inserted_recorded(&self) {}
}

impl FileOps for File {
    fn size(&self) -> std::io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn write_at(&self, buf: &[u8], at: u64) -> std::io::Result<()> {
        crate::testpoint::io("write")?;
        self.write_all_at(buf, at)
    }
    fn copy_in(&self, from: &File, from_off: u64, at: u64, len: u64) -> std::io::Result<u64> {
        // (Where the filesystem cannot clone, or the offsets do not meet
        // within a block, this copies.)
        copy_sharing(from, from_off, self, at, len, STAGING_ALIGN)
    }
    fn copy_within(&self, from: u64, at: u64, len: u64) -> std::io::Result<()> {
        copy_range(self, from, self, at, len)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        crate::testpoint::io("truncate")?;
        File::set_len(self, len)
    }
    fn reserve(&self, at: u64, len: u64) -> std::io::Result<()> {
        crate::testpoint::io("reserve")?;
        reserve(self, at, len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        crate::testpoint::synced(self, File::sync_data(self))
    }
    fn sync_all(&self) -> std::io::Result<()> {
        crate::testpoint::synced(self, File::sync_all(self))
    }
    fn mode(&self) -> std::io::Result<u32> {
        use std::os::unix::fs::MetadataExt;
        Ok(self.metadata()?.mode())
    }
    fn set_mode(&self, mode: u32) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        crate::testpoint::io("chmod")?;
        self.set_permissions(std::fs::Permissions::from_mode(mode))
    }
    fn set_mtime(&self, mtime: (i64, i64)) -> std::io::Result<()> {
        crate::testpoint::io("utimes")?;
        set_mtime(self, mtime)
    }
}

/// What an in-place commit does besides writing its file, done one way by
/// the mount and another by the recovery of a later one.
pub struct Steps<'a> {
    /// Opens a staging file by name.
    pub open_staged: &'a dyn Fn(&str) -> std::io::Result<Arc<File>>,
    /// Inserts the bytes at the file's start (the mount: with no read of it
    /// in flight, `SourceFile::insert_at_start`).
    pub insert: &'a dyn Fn(u64) -> std::io::Result<()>,
    /// The staging folder, where the insertion is recorded durably.
    pub dir: &'a Folder,
    /// Takes back an insertion of that many bytes (FALLOC_FL_COLLAPSE_RANGE),
    /// when the blocks for the grown header cannot be had.
    pub collapse: &'a dyn Fn(u64) -> std::io::Result<()>,
    /// Told the ranges (the file's offsets then) about to be overwritten or
    /// cut, before they are (the mount fails reads of them that raced the commit).
    pub retire: &'a dyn Fn(Vec<std::ops::Range<u64>>),
    /// The file is the old one (no step of this commit began): a step that
    /// fails before any byte of it changed puts the old prefix back.
    pub fresh: bool,
}

/// Why an in-place write stopped: before the marker (the file is as it
/// was), or after (the record completes it).
pub struct ApplyError {
    pub marked: bool,
    pub error: std::io::Error,
}

impl InPlaceRecord {
    pub(super) fn inserted_flag(&self) -> String {
        format!("{}.inserted", self.header_file)
    }

    /// Notes durably in the staging folder that the insertion is done.
    fn record_inserted(&self, file: &dyn FileOps, dir: &Folder) -> std::io::Result<()> {
        dir.open_file(
            OsStr::new(&self.inserted_flag()),
            libc::O_WRONLY | libc::O_CREAT,
            0o600,
        )
        .and_then(|f| crate::testpoint::synced(&f, f.sync_all()))
        .and_then(|()| dir.sync())?;
        file.inserted_recorded();
        Ok(())
    }

    /// Whether the bytes were inserted at the start already: recorded so
    /// once the insertion was durable, or (a crash between the two) the
    /// file is longer by them, which nothing before the insertion makes it.
    fn inserted_already(&self, file: &dyn FileOps, dir: &Folder) -> std::io::Result<bool> {
        if dir.stat_at(OsStr::new(&self.inserted_flag())).is_ok() {
            return Ok(true);
        }
        Ok(file.size()? == self.before.len + self.inserted)
    }

    /// A step before the marker failed, or the insertion did: the file is
    /// put back as it was (its prefix, its modification time).
    fn put_back(&self, file: &dyn FileOps, marked: bool) -> std::io::Result<()> {
        if marked {
            let start = self.old_start.unwrap_or(self.old_prefix);
            file.write_at(&start.to_le_bytes(), 0)?;
            file.sync_data()?;
        }
        file.set_mtime(self.before.mtime)?;
        file.sync_all()
    }

    /// Does the whole commit to `file` (again, after a crash: every step may
    /// be repeated; the insertion is done once). Returns the bytes it shared
    /// with staging files instead of copying them. The steps: the insertion
    /// noted if a crash left it unnoted, the marker, blocks for what is
    /// appended, the header's room inserted, the data written, the file cut,
    /// the header, then the real prefix and the time.
    pub fn apply(
        &self,
        file: &dyn FileOps,
        header: &[u8],
        steps: &Steps,
    ) -> Result<u64, ApplyError> {
        let inserted = self.note_insertion(file, steps)?;
        self.mark(file, steps)?;
        self.reserve_appends(file, steps, inserted)?;
        point("in-place:marked").map_err(after)?;
        if self.inserted > 0 && !inserted {
            self.insert_room(file, steps)?;
        }
        let shared = self.write_data(file, steps)?;
        self.write_header(file, header)?;
        Ok(shared)
    }

    /// Whether the header's room was inserted already. Inserted, as the
    /// file's length says, but not yet noted (a crash in between): noted
    /// now, before anything changes the length again (an append), which
    /// would hide it and have the next recovery insert twice.
    fn note_insertion(&self, file: &dyn FileOps, steps: &Steps) -> Result<bool, ApplyError> {
        let inserted =
            self.inserted > 0 && self.inserted_already(file, steps.dir).map_err(before)?;
        if inserted
            && steps
                .dir
                .stat_at(OsStr::new(&self.inserted_flag()))
                .is_err()
        {
            self.record_inserted(file, steps.dir)
                .map_err(|e| ApplyError {
                    marked: !steps.fresh,
                    error: e,
                })?;
        }
        Ok(inserted)
    }

    /// The marker first: nothing changes the file before it (its
    /// modification time included), so a file without it is old or new.
    fn mark(&self, file: &dyn FileOps, steps: &Steps) -> Result<(), ApplyError> {
        let marked = point("in-place:mark")
            .and_then(|()| file.write_at(&IN_PLACE_MARKER, 0))
            .and_then(|()| file.sync_data());
        let Err(e) = marked else {
            return Ok(());
        };
        if !steps.fresh {
            return Err(after(e));
        }
        Err(match self.put_back(file, true) {
            Ok(()) => before(e),
            Err(_) => after(e),
        })
    }

    /// Blocks for what is appended (what the file grows by besides the
    /// insertion), before any byte is written: no ENOSPC half-way; if there
    /// is no room, the file is put back.
    fn reserve_appends(
        &self,
        file: &dyn FileOps,
        steps: &Steps,
        inserted: bool,
    ) -> Result<(), ApplyError> {
        let now = file.size().map_err(after)?;
        let to_insert = if inserted { 0 } else { self.inserted };
        let grows = self.after_len.saturating_sub(now + to_insert);
        if grows == 0 {
            return Ok(());
        }
        match point("in-place:reserve").and_then(|()| file.reserve(now, grows)) {
            Ok(()) => Ok(()),
            Err(e) if steps.fresh && self.put_back(file, true).is_ok() => Err(before(e)),
            Err(e) => Err(after(e)),
        }
    }

    /// The header's room inserted at the file's start: the marker moves to
    /// `inserted`; zeros at the start (a length of 0, refused) until it is
    /// written there again. Not inserted (an unsupported file, ENOSPC), or
    /// its blocks not had: as it was.
    fn insert_room(&self, file: &dyn FileOps, steps: &Steps) -> Result<(), ApplyError> {
        let done = point("in-place:insert")
            .and_then(|()| (steps.insert)(self.inserted))
            .and_then(|()| file.sync_all());
        if let Err(e) = done {
            if steps.fresh
                && file.size().ok() == Some(self.before.len)
                && self.put_back(file, true).is_ok()
            {
                return Err(before(e));
            }
            return Err(after(e));
        }
        // The inserted range is a hole: its blocks are had now, or the
        // insertion is taken back (the header's write cannot meet ENOSPC).
        let header_blocks =
            point("in-place:reserve-header").and_then(|()| file.reserve(0, self.inserted));
        if let Err(e) = header_blocks {
            let undone = steps.fresh
                && (steps.collapse)(self.inserted)
                    .and_then(|()| file.sync_all())
                    .is_ok();
            if undone && self.put_back(file, true).is_ok() {
                return Err(before(e));
            }
            return Err(after(e));
        }
        point("in-place:inserted").map_err(after)?;
        self.record_inserted(file, steps.dir).map_err(after)?;
        file.write_at(&IN_PLACE_MARKER, 0).map_err(after)?;
        file.sync_data().map_err(after)
    }

    /// Every range written, and the file cut to its new length. Returns the
    /// bytes shared with staging files.
    fn write_data(&self, file: &dyn FileOps, steps: &Steps) -> Result<u64, ApplyError> {
        let len = file.size().map_err(after)?;
        (steps.retire)(self.writes.iter().map(|w| w.at..w.at + w.len).collect());
        // Tensors moved from the end into holes are read from the range the
        // cut removes: they are durable before it, and once the file is cut
        // (a crash after it) they are there and not copied again.
        let from_cut = |w: &RangeWrite| matches!(w.from, WriteFrom::Here { offset } if offset + w.len > self.after_len);
        let cut_already = len <= self.after_len;
        let mut shared = 0;
        for (n, w) in self.writes.iter().enumerate() {
            point("in-place:write").map_err(after)?;
            match &w.from {
                WriteFrom::Staged { file: name, offset } => {
                    let staged = (steps.open_staged)(name).map_err(after)?;
                    let pad = staged_pad(name);
                    shared += file
                        .copy_in(&staged, pad + offset, w.at, w.len)
                        .map_err(after)?;
                }
                WriteFrom::Here { .. } if cut_already && from_cut(w) => {}
                WriteFrom::Here { offset } => {
                    file.copy_within(*offset, w.at, w.len).map_err(after)?
                }
                WriteFrom::Zeros => write_zeros(file, w.at, w.len).map_err(after)?,
            }
            if n == 0 {
                point("in-place:data").map_err(after)?;
            }
        }
        if !cut_already && self.writes.iter().any(from_cut) {
            point("in-place:moved").map_err(after)?;
            file.sync_data().map_err(after)?;
        }
        // (Retired only now: tensors moved up are read from their old place
        // until it is cut, and from their new one once the commit is done.)
        if len > self.after_len {
            (steps.retire)(std::iter::once(self.after_len..len).collect());
        }
        file.set_len(self.after_len).map_err(after)?;
        Ok(shared)
    }

    /// The header's changed span, then (data and header durable) the real
    /// prefix that makes them the file, then the time. A failure after the
    /// prefix (its sync, the time) leaves a file complete but maybe not
    /// durable: it is marked again, refused by every reader until the
    /// record completes it, as the commit says.
    fn write_header(&self, file: &dyn FileOps, header: &[u8]) -> Result<(), ApplyError> {
        let end = match self.header_write {
            0 => header.len(),
            n => (n as usize).clamp(PREFIX_LEN as usize, header.len()),
        };
        let from = (self.header_from as usize).clamp(PREFIX_LEN as usize, end);
        point("in-place:header").map_err(after)?;
        file.write_at(&header[from..end], from as u64)
            .map_err(after)?;
        point("in-place:sync").map_err(after)?;
        file.sync_data().map_err(after)?;
        point("in-place:written").map_err(after)?;
        file.write_at(&header[..PREFIX_LEN as usize], 0)
            .map_err(after)?;
        let remarked = |error| {
            let _ = file.write_at(&IN_PLACE_MARKER, 0);
            after(error)
        };
        file.sync_data().map_err(remarked)?;
        point("in-place:prefix").map_err(remarked)?;
        self.finish_time(file).map_err(remarked)
    }

    /// The modification time the journal expects, made durable.
    /// Set-user-ID and set-group-ID bits that the kernel cleared when a
    /// writer other than root wrote the file are put back too.
    pub(super) fn finish_time(&self, file: &dyn FileOps) -> std::io::Result<()> {
        let set_id = self.before.mode & (libc::S_ISUID | libc::S_ISGID);
        if set_id != 0 {
            let now = file.mode()?;
            if now & set_id != set_id {
                let back = file
                    .set_mode((now | set_id) & 0o7777)
                    .and_then(|()| file.mode());
                // (A set-gid bit the owner may not set, not being in the
                // file's group, is dropped by the kernel without an error.)
                match back {
                    Ok(m) if m & set_id == set_id => {}
                    Ok(_) => warn!(
                        file = self.name,
                        "its set-id bits could not be put back after an in-place commit \
                         (the owner is not in the file's group?)"
                    ),
                    Err(e) => warn!(
                        file = self.name,
                        "putting back its set-id bits after an in-place commit: {e}"
                    ),
                }
            }
        }
        match file.set_mtime(self.after_mtime) {
            // Not the owner (a file the daemon may only write): the journal
            // then does not know this version, nothing else changes.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES)) => warn!(
                file = self.name,
                "setting the modification time after an in-place commit: {e}"
            ),
            other => other?,
        }
        file.sync_all()
    }
}

/// An error before the file was marked: it is as it was.
fn before(error: std::io::Error) -> ApplyError {
    ApplyError {
        marked: false,
        error,
    }
}

/// An error once the file is marked: every reader refuses it until the
/// record completes it.
fn after(error: std::io::Error) -> ApplyError {
    ApplyError {
        marked: true,
        error,
    }
}

/// Zeros over `len` bytes at `at`, a bounded buffer at a time.
fn write_zeros(file: &dyn FileOps, at: u64, len: u64) -> std::io::Result<()> {
    const CHUNK: u64 = 64 << 10;
    let zeros = vec![0u8; len.min(CHUNK) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK);
        file.write_at(&zeros[..n as usize], at + done)?;
        done += n;
    }
    Ok(())
}

/// Allocates the blocks of `len` bytes at `at` without changing the size
/// (a filesystem that cannot: nothing to do, its writes allocate).
fn reserve(file: &File, at: u64, len: u64) -> std::io::Result<()> {
    use rustix::io::Errno;
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::KEEP_SIZE, at, len) {
        Ok(()) | Err(Errno::OPNOTSUPP | Errno::NOSYS) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn set_mtime(file: &File, (s, ns): (i64, i64)) -> std::io::Result<()> {
    use rustix::fs::{Timespec, Timestamps, UTIME_OMIT};
    let times = Timestamps {
        last_access: Timespec {
            tv_sec: 0,
            tv_nsec: UTIME_OMIT,
        },
        last_modification: Timespec {
            tv_sec: s,
            tv_nsec: ns as _,
        },
    };
    Ok(rustix::fs::futimens(file, &times)?)
}
