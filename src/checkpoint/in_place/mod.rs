//! In-place commits (docs/SEMANTICS.md, "Commit"; docs/ARCHITECTURE.md): when the
//! edits keep the data section as it is except at its end, the file is
//! changed where it is instead of rewritten. The header is rewritten in its
//! own space (padded with spaces), new tensors are appended, dropped tail
//! tensors truncated, and tensors of the same size overwritten.
//!
//! Only while no other program has the file open or mapped: a write lease on
//! the daemon's own descriptor (the one it maps through) is refused while any
//! other exists, and makes any later open wait until the commit is done.
//!
//! Crash safety, as a redo journal: a record of everything to write (the
//! new header, every range and where its bytes come from, the file's version
//! before and after) is made durable in the staging folder first. Then the
//! length prefix is overwritten with `IN_PLACE_MARKER`, which every reader
//! refuses; the data and header are written and synced; the real prefix goes
//! in last, one aligned 8-byte write. A kill at any moment leaves the old
//! file, the new one, or one every reader refuses until the next mount
//! completes it from the record (`InPlaceRecord::complete`). Every step can
//! be done again, so completing is doing it all again.

mod lease;
mod plan;
pub use lease::Lease;
pub use plan::layout;

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::checkpoint::recovery_error::RecoveryError;
use crate::format::{Header, IN_PLACE_MARKER, Layout, PREFIX_LEN};
use crate::source::Folder;
use crate::source::staged::{STAGING_ALIGN, staged_pad};
use crate::source::{FileStat, copy_range, copy_sharing};
use crate::testpoint::point;

/// Why a redo record cannot be trusted: checked before anything is written.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadRecord(pub(crate) String);

impl crate::errno::ToErrno for BadRecord {
    /// A redo record that does not hold is damaged data.
    fn to_errno(&self) -> i32 {
        libc::EIO
    }
}

/// A range of the new file and where its bytes come from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RangeWrite {
    /// Offset in the file.
    pub at: u64,
    pub len: u64,
    pub from: WriteFrom,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum WriteFrom {
    /// A staging file (by its name in the staging folder), from `offset`
    /// bytes into its tensor (a block of a partly staged tensor; else 0).
    Staged {
        file: String,
        #[serde(default, skip_serializing_if = "is_zero")]
        offset: u64,
    },
    /// Another range of the same file, which this commit does not change.
    Here { offset: u64 },
    /// Zeros: the padding after a tensor placed where other bytes were (a
    /// GGUF file's alignment), so that no old bytes stay in the file.
    Zeros,
}

/// How a checkpoint's new state fits in its file: the layout (header padded
/// to the old header's length, tensors in file order) and what to write.
pub struct InPlaceLayout {
    pub layout: Layout,
    /// Bytes inserted at the file's start to grow the header (whole blocks).
    pub inserted: u64,
    /// The part of the header written: from `header_from` (at least 8:
    /// the first 8 bytes go in last) to `header_write`.
    pub header_from: u64,
    pub header_write: u64,
    /// For each write, the input (index into the plan's inputs) it copies.
    pub writes: Vec<(RangeWrite, usize)>,
    pub file_len: u64,
    /// Bytes written, header included.
    pub bytes: u64,
    /// Of `bytes`, those a filesystem that clones ranges can share with the
    /// staging files (whole blocks at the same place within a block): set by
    /// the planner when the file's filesystem clones (`expect_sharing`).
    pub shareable: u64,
    /// What changes, in words ("header, 1 tensor appended").
    pub summary: String,
}

impl InPlaceLayout {
    /// The file's filesystem clones ranges: the bytes of staging files that
    /// sit at the same place within a block as their target are expected
    /// to be shared, not copied.
    pub fn expect_sharing(&mut self) {
        self.shareable = self
            .writes
            .iter()
            .filter_map(|(w, _)| match &w.from {
                WriteFrom::Staged { file, offset } => {
                    Some(shareable_blocks(staged_pad(file) + offset, w.at, w.len))
                }
                WriteFrom::Here { .. } | WriteFrom::Zeros => None,
            })
            .sum();
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The whole blocks of `len` bytes at `from` copied to `to` that a clone can
/// share (none unless both lie at the same place within a block).
pub fn shareable_blocks(from: u64, to: u64, len: u64) -> u64 {
    if from % STAGING_ALIGN != to % STAGING_ALIGN {
        return 0;
    }
    let head = ((STAGING_ALIGN - to % STAGING_ALIGN) % STAGING_ALIGN).min(len);
    (len - head) / STAGING_ALIGN * STAGING_ALIGN
}

/// The redo record of one file's in-place commit, in the staging folder.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InPlaceRecord {
    pub folder: PathBuf,
    pub name: String,
    /// The file as it was (identity, length, time).
    pub before: FileStat,
    /// Its length prefix then (a GGUF file: its header's length less 8):
    /// the old header is its first `8 + old_prefix` bytes.
    #[serde(default)]
    pub old_prefix: u64,
    /// Its first 8 bytes as a little-endian number, when they are not that
    /// length (a GGUF file's magic and version): what a step that fails
    /// after the marker, before anything else changed, puts back (else
    /// `old_prefix`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_start: Option<u64>,
    pub after_len: u64,
    /// The modification time the commit gives the file when done, so that
    /// the journal's `Landing` knows the new version in advance.
    pub after_mtime: (i64, i64),
    /// The file (in the staging folder) holding the new prefix and header.
    pub header_file: String,
    /// Bytes inserted at the start (FALLOC_FL_INSERT_RANGE) before the
    /// writes, whose offsets count them. Once the insertion is durable,
    /// `<header_file>.inserted` says so in the staging folder.
    #[serde(default)]
    pub inserted: u64,
    /// The header's bytes to write, from the start (0: all): the rest is spaces already.
    #[serde(default)]
    pub header_write: u64,
    /// Where those bytes start (0 or 8: after the first 8 bytes, which go
    /// in last): the bytes before it are the same in the old header.
    #[serde(default)]
    pub header_from: u64,
    /// The new header's length when its file holds only what is written
    /// (its first 8 bytes, then `header_from..header_write`): the rest is
    /// the file's own bytes, which the commit does not change (0: the file
    /// holds the whole header). A template edit of a file with a large
    /// vocabulary records kilobytes, not the vocabulary.
    #[serde(default)]
    pub header_len: u64,
    pub writes: Vec<RangeWrite>,
    /// SHA-256 (hex) of the file's first `8 + old_prefix` bytes before the
    /// commit (its old header): a file whose time changed but whose old
    /// header is intact and unmarked is one the commit had not yet changed
    /// (its first write's new time reached the disk, its bytes did not).
    #[serde(default)]
    pub old_header_sum: String,
    /// SHA-256 (hex) of the record (with this field empty) and of its header
    /// file: a record changed or cut short since it was made is not applied.
    #[serde(default)]
    pub sum: String,
}

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
    fn digest(&self, header: &[u8]) -> String {
        let unsealed = InPlaceRecord {
            sum: String::new(),
            ..self.clone()
        };
        sha256_hex(&[&serde_json::to_vec(&unsealed).unwrap_or_default(), header])
    }

    /// Whether `file` still begins with the old header the record names.
    fn old_header_intact(&self, file: &File) -> bool {
        if self.old_header_sum.is_empty() {
            return false;
        }
        let mut old = vec![0u8; (PREFIX_LEN + self.old_prefix) as usize];
        file.read_exact_at(&mut old, 0).is_ok() && sha256_hex(&[&old]) == self.old_header_sum
    }

    /// Seals the record with its header (`sum`: of the record and of what
    /// its header file holds, so that it is checked before anything else
    /// is read).
    pub fn seal(&mut self, header: &[u8]) {
        self.sum = self.digest(&self.stored_header(header));
    }

    /// What the header file holds of `header` (see `header_len`).
    pub fn stored_header(&self, header: &[u8]) -> Vec<u8> {
        match self.header_len {
            0 => header.to_vec(),
            _ => {
                let (from, end) = (self.header_from as usize, self.header_write as usize);
                [&header[..PREFIX_LEN as usize], &header[from..end]].concat()
            }
        }
    }

    /// The whole header from what its file holds and the file's own bytes
    /// (checked by the record's sum before anything uses it).
    fn whole_header(&self, stored: Vec<u8>, file: &File) -> std::io::Result<Vec<u8>> {
        if self.header_len == 0 {
            return Ok(stored);
        }
        let bad = || {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a header file of another length",
            )
        };
        let (from, end) = (self.header_from as usize, self.header_write as usize);
        let len = self.header_len as usize;
        if from < PREFIX_LEN as usize
            || from > end
            || end > len
            || stored.len() != PREFIX_LEN as usize + end - from
        {
            return Err(bad());
        }
        let mut header = vec![0u8; len];
        file.read_exact_at(&mut header, 0)?;
        header[..PREFIX_LEN as usize].copy_from_slice(&stored[..PREFIX_LEN as usize]);
        header[from..end].copy_from_slice(&stored[PREFIX_LEN as usize..]);
        Ok(header)
    }

    /// Why the record cannot be applied to a file of `len` bytes now, if it
    /// cannot: its sum, the new header against the new length, every range
    /// within the file and its staging file. Checked before anything is
    /// written, so a record that does not hold leaves the file as it is
    /// (by recovery, and by a commit before it applies its own).
    pub(crate) fn check(
        &self,
        header: &[u8],
        len: u64,
        staged_len: &dyn Fn(&str) -> std::io::Result<u64>,
    ) -> Result<(), BadRecord> {
        if self.sum != self.digest(&self.stored_header(header)) {
            let why = "its checksum does not match: changed or cut short since it was made";
            return Err(BadRecord(why.into()));
        }
        let parsed = Header::parse_any_prefix(header, self.after_len).map_err(|e| {
            BadRecord(format!(
                "its new header is not valid for the new length: {e}"
            ))
        })?;
        let header_end = header.len() as u64;
        if parsed.data_start() != header_end
            || self.header_write > header_end
            || self.header_from > self.header_write.max(PREFIX_LEN)
        {
            return Err(BadRecord(
                "its new header's length disagrees with its data".into(),
            ));
        }
        // The old bytes end here once the insertion is done; appends, then
        // the cut, take the file to its new length.
        let old_end = self.before.len + self.inserted;
        let (low, high) = (
            self.before.len.min(self.after_len),
            old_end.max(self.after_len),
        );
        if len < low || len > high {
            return Err(BadRecord(format!(
                "the file is {len} bytes, which no step of this commit leaves (from {} to {})",
                self.before.len, self.after_len
            )));
        }
        // Copies within the file read old data that no write of the commit
        // changes, so that doing them again reads the same (a copy from the
        // range the cut removes is durable before the cut, and not done
        // again after it).
        let old_data = self.inserted + PREFIX_LEN + self.old_prefix;
        let written: Vec<(u64, u64)> = self
            .writes
            .iter()
            .map(|w| (w.at, w.at.saturating_add(w.len)))
            .collect();
        for w in &self.writes {
            let end =
                w.at.checked_add(w.len)
                    .ok_or_else(|| BadRecord("a range past any file".into()))?;
            if w.at < header_end || end > self.after_len {
                return Err(BadRecord(format!(
                    "a write of {} bytes at {} falls outside the new data section ({header_end}..{})",
                    w.len, w.at, self.after_len
                )));
            }
            match &w.from {
                WriteFrom::Here { offset } => {
                    let from_end = offset
                        .checked_add(w.len)
                        .ok_or_else(|| BadRecord("a range past any file".into()))?;
                    let outside = *offset < old_data.max(header_end) || from_end > old_end;
                    if outside || written.iter().any(|&(a, b)| *offset < b && a < from_end) {
                        return Err(BadRecord(format!(
                            "a copy of {} bytes from {offset} reads outside the old data the commit keeps",
                            w.len
                        )));
                    }
                }
                WriteFrom::Zeros => {}
                WriteFrom::Staged { file, offset } => {
                    if file.contains('/') || file.is_empty() || file == "." || file == ".." {
                        return Err(BadRecord(format!(
                            "{file:?} is not a plain name of a staging file"
                        )));
                    }
                    let have = staged_len(file)
                        .map_err(|e| BadRecord(format!("its staging file {file}: {e}")))?;
                    if offset.checked_add(w.len).is_none_or(|end| have < end) {
                        return Err(BadRecord(format!(
                            "its staging file {file} holds {have} bytes, not the {} it writes from {offset}",
                            w.len
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    fn inserted_flag(&self) -> String {
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
    fn finish_time(&self, file: &dyn FileOps) -> std::io::Result<()> {
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

    /// After a crash: completes the commit if the file is still the one it
    /// was writing (old, marked, or written but for its time), and says what
    /// it did. `dir` is the staging folder holding the record. An error says
    /// whether the record must stay (the file is still refused by readers).
    /// A record whose seal does not hold tells nothing to trust, not even
    /// which file it names: it is kept, and nothing is done.
    pub fn complete(&self, dir: &Folder) -> Result<Option<String>, (RecoveryError, bool)> {
        let stored = self.sealed_header(dir).map_err(|why| (why, true))?;
        self.try_complete(dir, stored).map_err(|why| {
            let refused = Folder::open(&self.folder)
                .and_then(|f| f.open_file(OsStr::new(&self.name), libc::O_RDONLY, 0))
                .map(|f| {
                    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                    crate::format::interrupted_in_place(len, |b, p| f.read_at(b, p))
                })
                .unwrap_or(false);
            (why, refused)
        })
    }

    /// What the header file holds, if the record's seal holds over it.
    fn sealed_header(&self, dir: &Folder) -> Result<Vec<u8>, RecoveryError> {
        let path = self.folder.join(&self.name);
        let io = |source: std::io::Error| RecoveryError::Io {
            what: format!(
                "{}: reading the record of an interrupted commit",
                path.display()
            ),
            source,
        };
        if self.header_file.contains('/') || self.header_file.is_empty() {
            return Err(RecoveryError::Refused(format!(
                "{}: not a plain name in a redo record",
                path.display()
            )));
        }
        let mut stored = Vec::new();
        let h = dir
            .open_file(OsStr::new(&self.header_file), libc::O_RDONLY, 0)
            .map_err(io)?;
        crate::testpoint::io("read")
            .and_then(|()| std::io::Read::read_to_end(&mut &h, &mut stored))
            .map_err(io)?;
        if self.sum != self.digest(&stored) {
            return Err(RecoveryError::Refused(format!(
                "{}: the record of its interrupted commit does not hold: its checksum does not \
                 match (changed or cut short since it was made); nothing was done, and the record \
                 is kept",
                path.display()
            )));
        }
        Ok(stored)
    }

    fn try_complete(&self, dir: &Folder, stored: Vec<u8>) -> Result<Option<String>, RecoveryError> {
        let path = self.folder.join(&self.name);
        let plain = !self.name.is_empty()
            && !self.name.contains('/')
            && self.name != "."
            && self.name != ".."
            && self.folder.is_absolute()
            && !self.header_file.contains('/');
        if !plain {
            return Err(RecoveryError::Refused(format!(
                "{}: not a plain name in a redo record",
                path.display()
            )));
        }
        let io = |source: std::io::Error| RecoveryError::Io {
            what: format!("{}: completing an interrupted commit", path.display()),
            source,
        };
        let folder = Folder::open(&self.folder).map_err(io)?;
        let file = folder
            .open_file(OsStr::new(&self.name), libc::O_RDWR, 0)
            .map_err(io)?;
        let st = FileStat::of(&file).map_err(io)?;
        if (st.dev, st.ino) != (self.before.dev, self.before.ino) {
            return Err(RecoveryError::Refused(format!(
                "{}: replaced since an in-place commit of it was interrupted: its record is dropped",
                path.display()
            )));
        }
        let marked = crate::format::interrupted_in_place(st.len, |b, p| file.read_at(b, p));
        if !marked && st.len == self.after_len && st.mtime == self.after_mtime {
            return Ok(None); // done before the crash
        }
        let header = stored;
        if header.len() < PREFIX_LEN as usize {
            return Err(RecoveryError::Refused(format!(
                "{}: a redo record without a header",
                path.display()
            )));
        }
        let header = self.whole_header(header, &file).map_err(io)?;
        if header.len() < PREFIX_LEN as usize {
            return Err(RecoveryError::Refused(format!(
                "{}: a redo record without a header",
                path.display()
            )));
        }
        // The whole record is checked before any of it is used.
        let open_staged = |name: &str| -> std::io::Result<Arc<File>> {
            if name.contains('/') {
                return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            }
            Ok(Arc::new(dir.open_file(
                OsStr::new(name),
                libc::O_RDONLY,
                0,
            )?))
        };
        let mut on_disk = vec![0u8; header.len()];
        let got = file.read_at(&mut on_disk, 0).map_err(io)?;
        let started = marked || (st.len, st.mtime) != (self.before.len, self.before.mtime);
        // The old header, intact and unmarked: the marker's write may have
        // reached the disk as a new time without its bytes.
        let old_header = !marked && self.old_header_intact(&file);
        // All written, the prefix too: only the time is missing (its
        // staging files are not needed any more). Not when the new header is
        // the old one (a same-size overwrite): then the data may not be
        // written, and the commit is done again.
        let only_time = !marked
            && started
            && got == header.len()
            && on_disk == header
            && st.len == self.after_len
            && !old_header;
        // Nothing changes the file before its marker: without it and as it
        // was, the commit had not started.
        let unchanged =
            !marked && st.len == self.before.len && (st.mtime == self.before.mtime || old_header);
        let staged_len = |name: &str| -> std::io::Result<u64> {
            match only_time {
                true => Ok(u64::MAX),
                false => Ok(open_staged(name)?
                    .metadata()?
                    .len()
                    .saturating_sub(staged_pad(name))),
            }
        };
        self.check(&header, st.len, &staged_len).map_err(|why| {
            let state = if marked {
                "the file is left as it is (every reader refuses it) and the record is kept"
            } else if unchanged {
                "the file is left as it is (no step of the commit had begun on it)"
            } else {
                "the file is left as it is"
            };
            RecoveryError::Refused(format!(
                "{}: the record of an interrupted in-place commit does not hold ({why}): not \
                 applied; {state} (the record: {})",
                path.display(),
                dir.path.display()
            ))
        })?;
        if only_time {
            self.finish_time(&file).map_err(io)?;
            return Ok(Some(format!(
                "{}: completed a commit that was interrupted (written in place)",
                path.display()
            )));
        }
        if !(marked || unchanged) {
            return Err(RecoveryError::Refused(format!(
                "{}: changed by another program since an in-place commit of it was interrupted: \
                 left as it is, its record is dropped",
                path.display()
            )));
        }
        let insert = |len| crate::source::local::insert_range(&file, len);
        let collapse = |len| crate::source::local::collapse_range(&file, len);
        let steps = Steps {
            open_staged: &open_staged,
            insert: &insert,
            collapse: &collapse,
            dir,
            retire: &|_| {},
            // (A record of a version that did not keep the old prefix cannot put it back.)
            fresh: unchanged && self.old_prefix != 0,
        };
        self.apply(&file, &header, &steps)
            .map_err(|e| io(e.error))?;
        info!(file = %path.display(), "completed an interrupted in-place commit");
        Ok(Some(format!(
            "{}: completed a commit that was interrupted (written in place)",
            path.display()
        )))
    }
}

/// SHA-256 of the parts, in hex.
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

pub fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    parts.iter().for_each(|p| ctx.update(p));
    ctx.finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
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

#[cfg(test)]
mod tests;
