//! A commit, in three steps so that reads and edits go on meanwhile:
//!
//! 1. `Live::plan` (state locked, briefly): validate every edit, check the
//!    source is the file that was mapped, lay out the new file, pin the
//!    staging files it reads, and mark the journal.
//!    The plan picks the way: in place (`in_place`) when the edits keep the
//!    data section's layout but at its end and nobody else has the file
//!    open, else a rewrite.
//! 2. `CommitPlan::write` (no lock): for a rewrite, a temp file beside the
//!    source, the header as the reference writes it (with room to grow, unless
//!    `--compact`), bytes copied with copy_file_range, the source's mode and
//!    owner, fsync. `land` then records every file's landing in the staging
//!    folder (so that the next mount finishes what a crash interrupted),
//!    writes the in-place files and renames the temp files over their
//!    sources, and fsyncs the folder.
//! 3. `Live::finish` (state locked): map the new file; what the plan wrote and
//!    nobody edited since reads from it now; later edits stay staged.
//!
//! Before `land` nothing of the source changed: a failure leaves it
//! byte-identical and the edits staged.

use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use tracing::{info, warn};

use super::in_place::{self, InPlaceLayout, InPlaceRecord, Lease};
use super::journal::Record;
use super::staging::{PendingRename, Renames, Staging};
use super::{next_gen, DataObject, EntryMeta, EntrySlot, Id, Live, MetadataDoc, ObjectSlot};
use crate::format::{layout_of, FormatError, Header, Layout};
use crate::source::local::Folder;
use crate::source::staged::StagingError;
use crate::source::{Bytes, FileStat, SourceFile, StagedFile};

/// Something a commit refuses, with the tensor it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub tensor: Option<String>,
    pub rule: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tensor {
            Some(t) => write!(f, "tensor {t:?} {}", self.rule),
            None => f.write_str(&self.rule),
        }
    }
}

/// Why a commit did not happen. In every case the source is untouched and
/// the staged edits are kept.
#[derive(Debug)]
pub enum CommitError {
    /// Edits that would not make a valid checkpoint (EINVAL).
    Refused {
        file: PathBuf,
        problems: Vec<Problem>,
    },
    /// The source changed behind the mount (ESTALE); `--force` overrides.
    Conflict { file: PathBuf },
    /// Another commit of the same files did not end in time (EBUSY).
    Busy { file: PathBuf },
    /// Another program opened the file just as an in-place commit was about
    /// to write it: nothing changed (EAGAIN).
    Opened { file: PathBuf },
    /// The mount does not commit any more (EIO): a request handler
    /// panicked, or a commit failed half-way; `why` says which.
    Tainted { why: String },
    /// Writing the new file failed (ENOSPC, EIO, ...).
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The staging folder (for the journal and the record of renames).
    Staging(StagingError),
    /// The source cannot be written (a remote object) (EROFS).
    ReadOnly { file: PathBuf },
    /// The commit failed after a file of it began to change: `landed` of
    /// its `total` files landed; `file` is refused by every reader until the
    /// next mount completes the commit from its record (the errno of `source`).
    NotLanded {
        file: PathBuf,
        landed: usize,
        total: usize,
        /// Whether `file` is left refused by every reader (an in-place
        /// commit that had begun); else it is unchanged.
        refused: bool,
        source: Box<CommitError>,
    },
    /// A discard on a mount whose commit did not land: its staging folder
    /// holds the record the next mount completes (EIO).
    DiscardRefused { why: String },
    /// A discard ran while this commit waited for it: nothing was committed
    /// (ECANCELED).
    Discarded,
    /// A commit ran while this discard waited for it: the edits it would
    /// have dropped are in the files now (ECANCELED).
    CommittedFirst,
}

impl fmt::Display for CommitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommitError::Refused { file, problems } => {
                if let [one] = &problems[..] {
                    return write!(f, "{}: {one}", file.display());
                }
                write!(
                    f,
                    "{}: commit refused, {} problems:",
                    file.display(),
                    problems.len()
                )?;
                for p in problems.iter().take(20) {
                    write!(f, "\n  {p}")?;
                }
                if problems.len() > 20 {
                    write!(f, "\n  ... and {} more (stfs status lists them all)", problems.len() - 20)?;
                }
                Ok(())
            }
            CommitError::Conflict { file } => write!(
                f,
                "{}: the source changed since it was mounted (another program wrote or replaced it); \
                 commit refused: commit with --force to overwrite it, or unmount with --discard",
                file.display()
            ),
            CommitError::Busy { file } => write!(
                f,
                "{}: another commit of this file (by another mount) has not ended in {} s; try again",
                file.display(),
                LOCK_WAIT.as_secs()
            ),
            CommitError::Opened { file } => write!(
                f,
                "{}: another program opened it as the commit was about to write it in place; \
                 nothing changed and the edits are staged: commit again",
                file.display()
            ),
            CommitError::Tainted { why } => write!(
                f,
                "{why}: commit refused, this mount commits no more. The staged edits are kept on \
                 disk: unmount, mount again (the edits are taken back from the journal, an \
                 interrupted commit is finished) and review them with stfs status"
            ),
            CommitError::DiscardRefused { why } => write!(
                f,
                "{why}: discard refused, this mount commits no more, and its staging folder holds \
                 the record that completes that commit: unmount it with a plain `umount` and mount \
                 the source again with stfs"
            ),
            CommitError::Io { what, source } => write!(f, "{what}: {source}"),
            CommitError::Staging(e) => write!(f, "{e}"),
            CommitError::ReadOnly { file } => write!(
                f,
                "{}: a remote source is read-only (stfs does not write to object stores yet)",
                file.display()
            ),
            CommitError::NotLanded {
                file,
                landed,
                total,
                refused,
                source,
            } => {
                write!(
                    f,
                    "{}: the commit did not land ({landed} of its {total} files landed): {source}. ",
                    file.display()
                )?;
                f.write_str(match refused {
                    true => "Every reader refuses this file until the commit is completed",
                    false => "This file is unchanged, the files that landed before it are written",
                })?;
                f.write_str(
                    "; the record and the staged edits are kept on disk, and this mount commits \
                     no more: unmount it with a plain `umount` and mount the source again with \
                     stfs (after making room, if the disk was full), which completes the commit",
                )
            }
            CommitError::Discarded => f.write_str(
                "nothing committed: the staged edits were discarded (stfs umount --discard) while \
                 this commit waited for that discard to end",
            ),
            CommitError::CommittedFirst => f.write_str(
                "nothing discarded: a commit that ran while this discard waited for it wrote the \
                 staged edits into the files",
            ),
        }
    }
}

impl std::error::Error for CommitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CommitError::Io { source, .. } => Some(source),
            CommitError::Staging(e) => Some(e),
            CommitError::NotLanded { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<super::EditError> for CommitError {
    fn from(e: super::EditError) -> Self {
        match e {
            super::EditError::Staging(e) => CommitError::Staging(e),
            super::EditError::Io(source) => CommitError::Io {
                what: "the journal".into(),
                source,
            },
            other => CommitError::Io {
                what: "the journal".into(),
                source: std::io::Error::other(other.to_string()),
            },
        }
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CommitError {
    let what = what.into();
    move |source| CommitError::Io { what, source }
}

/// What a plan wrote, for each tensor: the entry and object it took, and
/// their generations then.
struct Member {
    entry: Id,
    entry_gen: u64,
    object: Id,
    object_gen: u64,
}

/// What a commit may do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitOptions {
    /// Replace the source even if it changed behind the mount.
    pub force: bool,
    /// Rewrite, exactly as the reference's `save_file` lays a file out (no
    /// room left in the header, never in place).
    pub compact: bool,
}

/// How a plan writes its file: one of the ways (docs/SEMANTICS.md, "The ways").
// One per plan: the size of a variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Way {
    /// The source's own file, changed where it is, under a write lease.
    InPlace {
        layout: InPlaceLayout,
        lease: Lease,
        file: Arc<File>,
        /// The modification time the file gets when done.
        mtime: (i64, i64),
    },
    /// A new file renamed over the source, its tensors in the source's
    /// order and at the same places within their blocks, so that their
    /// blocks are shared with the source's (XFS, btrfs); `shared`: the bytes
    /// it expects to share.
    SharedExtents {
        why: String,
        block: u64,
        shared: u64,
    },
    /// A new file renamed over the source; `why`: why not in place.
    Rewrite { why: String },
}

impl Way {
    /// What `stfs status` and `stfs commit` say of it.
    pub fn describe(&self, file_len: u64) -> String {
        match self {
            Way::InPlace { layout, .. } => format!(
                "in place ({}; {} written)",
                layout.summary,
                human_bytes(layout.bytes)
            ),
            Way::SharedExtents { why, shared, .. } => format!(
                "by a rewrite that shares extents (not in place: {why}; {} written, {} shared with the old file)",
                human_bytes(file_len - shared),
                human_bytes(*shared)
            ),
            Way::Rewrite { why } => format!(
                "by a rewrite (not in place: {why}; {} written)",
                human_bytes(file_len)
            ),
        }
    }
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{n} bytes"),
        _ => format!("{v:.1} {}", UNITS[u]),
    }
}

/// Pads a rewrite's header so that the data section starts on a 4 KiB
/// boundary with room to spare (a quarter of the JSON, at least 4 KiB): the
/// next header edits are in place. Readers accept trailing spaces.
fn leave_room(layout: &mut Layout) {
    const BLOCK: u64 = 4096;
    let json = layout.header.len() as u64 - crate::format::PREFIX_LEN;
    let want = crate::format::PREFIX_LEN + json + (json / 4).max(BLOCK);
    let total = want.div_ceil(BLOCK) * BLOCK;
    let room = (total - crate::format::PREFIX_LEN).min(crate::format::MAX_HEADER_LEN);
    if room <= json {
        return;
    }
    layout
        .header
        .resize((crate::format::PREFIX_LEN + room) as usize, b' ');
    layout.header[..8].copy_from_slice(&room.to_le_bytes());
}

/// A modification time after `old` (and now, if the clock allows): the one an
/// in-place commit gives the file, known before it writes.
fn new_mtime(old: (i64, i64)) -> (i64, i64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let now = (now.as_secs() as i64, now.subsec_nanos() as i64);
    if now > old {
        now
    } else if old.1 < 999_999_999 {
        (old.0, old.1 + 1)
    } else {
        (old.0 + 1, 0)
    }
}

/// A checkpoint's new state, as the ways of committing see it.
pub struct NewState<'a> {
    pub source: &'a Arc<SourceFile>,
    /// Name, dtype and shape of each tensor; `inputs[k]` holds tensor k's bytes.
    pub specs: &'a [(&'a str, crate::format::Dtype, &'a [u64])],
    pub inputs: &'a [Bytes],
    pub metadata: Option<&'a crate::format::Metadata>,
    /// Bytes that open descriptors and the other shards read.
    pub held: &'a [Bytes],
    /// The file at the source's name is still the one mapped.
    pub unchanged: bool,
    pub options: CommitOptions,
    /// The reference serializer's layout of the new state.
    pub reference: Layout,
}

/// A way of committing a checkpoint (docs/ARCHITECTURE.md, "The seams"): its plan for a new state
/// (the new file's layout, and what landing it takes), or why it cannot.
pub trait CommitWay: Sync {
    fn plan(&self, new: &NewState) -> Result<(Layout, Way), String>;
}

/// The ways, cheapest first: the planner takes the first that can.
const WAYS: [&dyn CommitWay; 3] = [&InPlaceWay, &SharedExtentsWay, &RewriteWay];

/// The plan of the first way that can commit `new`; a rewrite says why the
/// cheaper ways could not.
fn choose(new: &NewState) -> (Layout, Way) {
    let mut why_not = Vec::new();
    for way in WAYS {
        match way.plan(new) {
            Ok((layout, Way::Rewrite { .. })) => {
                let why = why_not.join("; ");
                return (layout, Way::Rewrite { why });
            }
            Ok((layout, Way::SharedExtents { block, shared, .. })) => {
                let why = why_not.join("; ");
                return (layout, Way::SharedExtents { why, block, shared });
            }
            Ok(plan) => return plan,
            Err(why) if why_not.contains(&why) => {}
            Err(why) => why_not.push(why),
        }
    }
    unreachable!("a rewrite can always commit")
}

/// The source's own file, changed where it is (`in_place`).
struct InPlaceWay;

impl CommitWay for InPlaceWay {
    fn plan(&self, new: &NewState) -> Result<(Layout, Way), String> {
        if new.options.compact {
            return Err("--compact".into());
        }
        if !new.unchanged {
            return Err("--force over a file that changed".into());
        }
        let source = new.source;
        let file = source
            .writable_file()
            .ok_or("the daemon has it open read-only")?
            .clone();
        use std::os::unix::fs::MetadataExt;
        let links = file.metadata().map_err(|e| e.to_string())?.nlink();
        if links != 1 {
            return Err(format!("it has {links} links"));
        }
        let mut held = vec![false; source.header().tensors.len()];
        for b in new.held {
            if let Bytes::Source(src, i) = b {
                if Arc::ptr_eq(src, source) {
                    held[*i as usize] = true;
                }
            }
        }
        let specs = new.specs;
        let layout = in_place::layout(
            source,
            specs.len(),
            |i| specs[i],
            new.inputs,
            new.metadata,
            &held,
            crate::source::local::inserts_blocks(&file),
        )?;
        let lease = Lease::take(&file)?;
        let mtime = new_mtime(source.stat().mtime);
        Ok((
            layout.layout.clone(),
            Way::InPlace {
                layout,
                lease,
                file,
                mtime,
            },
        ))
    }
}

/// A new file whose tensors keep the source's order and their places within
/// their blocks, so that the filesystem shares their blocks (FICLONERANGE):
/// a tensor dropped from the middle costs what the blocks around it cost.
struct SharedExtentsWay;

impl CommitWay for SharedExtentsWay {
    fn plan(&self, new: &NewState) -> Result<(Layout, Way), String> {
        if new.options.compact {
            return Err("--compact".into());
        }
        let source = new.source;
        let file = source.file().ok_or("a remote source")?;
        let block = crate::source::local::shares_extents(file)
            .ok_or("this filesystem cannot share blocks between files (XFS and btrfs can)")?;
        let old = source.header();
        let data_start_now = old.data_start() + source.shift();
        // The source's own tensors in their order, then the others by name.
        let mut claimed = vec![false; old.tensors.len()];
        let mut kept = Vec::new();
        let mut rest = Vec::new();
        for (k, input) in new.inputs.iter().enumerate() {
            match input {
                Bytes::Source(src, i) if Arc::ptr_eq(src, source) && !claimed[*i as usize] => {
                    claimed[*i as usize] = true;
                    kept.push((old.tensors.get(*i as usize).data_offsets.0, k));
                }
                _ => rest.push(k),
            }
        }
        kept.sort_unstable();
        rest.sort_by(|&a, &b| new.specs[a].0.cmp(new.specs[b].0));
        let order: Vec<usize> = kept.iter().map(|&(_, k)| k).chain(rest).collect();
        let mut tensors = crate::format::Tensors::with_capacity(order.len());
        let mut offset = 0;
        for &k in &order {
            let (name, dtype, shape) = new.specs[k];
            let n = new.inputs[k].len();
            tensors
                .push(name, dtype, shape, (offset, offset + n))
                .map_err(|_| "the header is too large".to_string())?;
            offset += n;
        }
        let mut header =
            crate::format::header_bytes(&tensors, new.metadata).map_err(|e| e.to_string())?;
        // Room, and the data section at the old one's place within a block.
        let json = header.len() as u64 - crate::format::PREFIX_LEN;
        let base = json + (json / 4).max(4096);
        let misfit =
            (data_start_now % block + block - (crate::format::PREFIX_LEN + base) % block) % block;
        let room = base + misfit;
        if room > crate::format::MAX_HEADER_LEN {
            return Err("the header would pass 100,000,000 bytes".into());
        }
        header.resize((crate::format::PREFIX_LEN + room) as usize, b' ');
        header[..8].copy_from_slice(&room.to_le_bytes());
        let data_start = crate::format::PREFIX_LEN + room;
        let mut shared = 0;
        for (j, &(old_start, _)) in kept.iter().enumerate() {
            let (from, to) = (
                data_start_now + old_start,
                data_start + tensors.get(j).data_offsets.0,
            );
            let len = tensors.get(j).nbytes();
            if from % block == to % block {
                let head = ((block - from % block) % block).min(len);
                shared += (len - head) / block * block;
            }
        }
        if shared == 0 {
            return Err("no tensor would keep its place within its blocks".into());
        }
        Ok((
            Layout {
                header,
                tensors,
                source_index: order,
            },
            Way::SharedExtents {
                why: String::new(),
                block,
                shared,
            },
        ))
    }
}

/// A new file renamed over the source: the reference's layout, with room
/// left in the header unless `--compact`.
struct RewriteWay;

impl CommitWay for RewriteWay {
    fn plan(&self, new: &NewState) -> Result<(Layout, Way), String> {
        let mut layout = new.reference.clone();
        if !new.options.compact {
            leave_room(&mut layout);
        }
        Ok((layout, Way::Rewrite { why: String::new() }))
    }
}

/// Everything step 2 needs, taken from the state: it holds the bytes by
/// reference counts, so the state is free again.
pub struct CommitPlan {
    pub commit: u64,
    pub source: Arc<SourceFile>,
    /// The new file's layout (the in-place one for `Way::InPlace`).
    pub layout: Layout,
    /// Taken by `write`.
    way: Way,
    /// What the commit does, in words (`Way::describe`).
    pub described: String,
    metadata: Option<crate::format::Metadata>,
    metadata_gen: u64,
    inputs: Vec<Bytes>,
    members: Vec<Member>,
    /// Edits with a generation below this were made before the plan.
    mark: u64,
    /// Source tensor index -> its index in the new file (u32::MAX: not in it).
    pub moved: Arc<Vec<u32>>,
    /// Replace whatever file has the source's name (`--force`).
    force: bool,
    _pins: Pins,
}

/// Staging files a plan copies from, pinned (see `DataObject::take_for_commit`).
struct Pins(Vec<Arc<StagedFile>>);

impl Drop for Pins {
    fn drop(&mut self) {
        self.0.iter().for_each(|s| s.unpin());
    }
}

/// How long a commit waits for another commit of the same files.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The files a commit will replace or rewrite, locked from before its plan
/// until they landed: a second mount's commit of the same source waits, then
/// finds the file changed and refuses (ESTALE) instead of writing over the
/// first commit. The lock is not on the file itself, which any reader may
/// lock to hold commits up, but on a file named for it (device and inode) in
/// a private folder of the user's (`$XDG_RUNTIME_DIR/stfs/locks`, else
/// `$XDG_STATE_HOME/stfs/locks`): mounts of one user take turns; mounts of
/// different users are kept apart by the checks at landing (the swap only
/// over the file that was mapped, the write lease of an in-place commit).
pub struct CommitLock(Vec<File>);

/// A file a commit locks: its folder, its name, and its open descriptor if
/// the mount holds one.
pub type LockTarget = (Arc<Folder>, OsString, Option<Arc<File>>);

impl Drop for CommitLock {
    fn drop(&mut self) {
        for f in &self.0 {
            // SAFETY: flock of a valid descriptor.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

/// The home folder of user `uid` in the password database.
fn home_of(uid: u32) -> Option<PathBuf> {
    let mut buf = vec![0 as libc::c_char; 16384];
    loop {
        // SAFETY: zeroed passwd is a valid out-parameter.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: getpwuid_r with an out-parameter, a buffer of its length,
        // and a result pointer; the strings it sets point into `buf`.
        let r = unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut found) };
        if r == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if r != 0 || found.is_null() || pw.pw_dir.is_null() {
            return None;
        }
        // SAFETY: pw_dir is a NUL-terminated string in `buf`, alive here.
        let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
        use std::os::unix::ffi::OsStrExt;
        let dir = PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes()));
        return dir.is_absolute().then_some(dir);
    }
}

/// The private folder of commit locks, made 0700 if missing; refused if it
/// is a link, another user's or open to others. Chosen by the user, not the
/// environment, so that every session of a user (a shell, cron, `sudo -u`)
/// finds the same: `/run/user/UID/stfs/locks` where that folder exists,
/// else `~/.local/state/stfs/locks` of the user's home in the password database.
fn lock_folder() -> Result<Folder, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let euid = rustix::process::geteuid().as_raw();
    let run = PathBuf::from(format!("/run/user/{euid}"));
    let base = match std::fs::symlink_metadata(&run) {
        Ok(m) if m.is_dir() && m.uid() == euid && m.mode() & 0o077 == 0 => run,
        _ => home_of(euid)
            .ok_or(format!("no home folder for uid {euid}"))?
            .join(".local/state"),
    };
    let dir = base.join("stfs").join("locks");
    let what = |e: &dyn std::fmt::Display| format!("{}: {e}", dir.display());
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(|e| what(&e))?;
    let folder = Folder::open_private(&dir).map_err(|e| what(&e))?;
    let st = folder.stat().map_err(|e| what(&e))?;
    if st.uid != euid || st.mode & 0o077 != 0 {
        return Err(what(&"not a private folder of this user's"));
    }
    Ok(folder)
}

impl CommitLock {
    /// `files`: folder, name and, for a source, its open file (whose identity
    /// names the lock when the name is still that file).
    pub fn take(files: &[LockTarget]) -> Result<CommitLock, CommitError> {
        let mut keys = Vec::new();
        for (folder, name, own) in files {
            let path = folder.path.join(name);
            let mine = own.as_ref().and_then(|f| FileStat::of(f).ok());
            let key = match folder.stat_at(name) {
                Ok(st) => (st.st_dev, st.st_ino),
                // Gone (the plan says what that means): the file it was.
                Err(_) => match mine {
                    Some(m) => (m.dev, m.ino),
                    None => continue,
                },
            };
            keys.push((key, path));
        }
        keys.sort();
        keys.dedup_by_key(|(key, _)| *key);
        if keys.is_empty() {
            return Ok(CommitLock(Vec::new()));
        }
        let dir = match lock_folder() {
            Ok(dir) => dir,
            Err(e) => {
                warn!("commits are not locked against other mounts of this user's: {e}");
                return Ok(CommitLock(Vec::new()));
            }
        };
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        let mut locked = Vec::new();
        for ((dev, ino), path) in keys {
            let name = OsString::from(format!("{dev}-{ino}.lock"));
            let flags = libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_NONBLOCK;
            let file = match dir.open_file(&name, flags, 0o600) {
                Ok(f) => f,
                Err(e) => {
                    warn!(file = %path.display(), "no commit lock for it: {e}");
                    continue;
                }
            };
            // SAFETY: a valid descriptor.
            while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    warn!(file = %path.display(), "cannot lock it for the commit: {e}");
                    break;
                }
                if std::time::Instant::now() > deadline {
                    return Err(CommitError::Busy { file: path });
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            locked.push(file);
        }
        Ok(CommitLock(locked))
    }
}

/// A new file written beside its target, not yet renamed over it.
pub struct Written {
    folder: Arc<Folder>,
    tmp: OsString,
    target: OsString,
    file: File,
    stat: FileStat,
    /// The file the target must still be when it is replaced (the source
    /// as mapped), unless the commit is forced or the target is an index.
    replaces: Option<FileStat>,
}

impl Written {
    /// Removes the temp file (a commit that will not land).
    pub fn remove(&self) {
        let _ = self.folder.unlink(&self.tmp);
    }

    pub fn stat(&self) -> FileStat {
        self.stat
    }

    pub fn target(&self) -> PathBuf {
        self.folder.path.join(&self.target)
    }

    /// Puts the file in place. With `replaces`: only over that very file
    /// (exchanged with it, the file taken out checked, exchanged back if it
    /// is another: a program that replaced the source since the commit's
    /// check loses nothing), else ESTALE.
    fn land(&self) -> Result<(), CommitError> {
        let err = |e| CommitError::Io {
            what: format!("renaming over {}", self.target().display()),
            source: e,
        };
        let Some(expected) = self.replaces else {
            return self.folder.rename(&self.tmp, &self.target).map_err(err);
        };
        match self.folder.exchange(&self.tmp, &self.target) {
            Ok(()) => {}
            // A filesystem without RENAME_EXCHANGE: the check under the lock was the last.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                return self.folder.rename(&self.tmp, &self.target).map_err(err);
            }
            Err(e) => return Err(err(e)),
        }
        let out = self.folder.stat_at(&self.tmp).map_err(err)?;
        if out.st_dev == expected.dev && out.st_ino == expected.ino {
            let _ = self.folder.unlink(&self.tmp);
            return Ok(());
        }
        self.folder.exchange(&self.tmp, &self.target).map_err(err)?;
        Err(CommitError::Conflict {
            file: self.target(),
        })
    }

    /// Creates the temp file beside `target`, fills it with `fill`, gives it
    /// `like`'s mode (and owner, as root) and fsyncs it. With `like_file`
    /// (the source), its owner and mode as they are now, and its extended
    /// attributes (ACLs, user attributes, labels), are carried over. On
    /// failure nothing is left.
    pub fn create(
        folder: &Arc<Folder>,
        target: &std::ffi::OsStr,
        like: &FileStat,
        like_file: Option<&File>,
        fill: impl FnOnce(&File) -> Result<(), CommitError>,
    ) -> Result<Written, CommitError> {
        let like = match like_file.map(FileStat::of) {
            Some(Ok(now)) => FileStat {
                mode: now.mode,
                uid: now.uid,
                gid: now.gid,
                ..*like
            },
            _ => *like,
        };
        let (tmp, file) = create_temp(folder, target)?;
        let what = |e| CommitError::Io {
            what: format!("writing {}", folder.path.join(&tmp).display()),
            source: e,
        };
        let finish = || -> Result<FileStat, CommitError> {
            fill(&file)?;
            use std::os::unix::fs::PermissionsExt;
            // (No set-id bit yet: the file is the daemon user's until chown.)
            let mode = std::fs::Permissions::from_mode(like.mode & 0o777);
            file.set_permissions(mode).map_err(what)?;
            if rustix::process::geteuid().as_raw() == 0 {
                std::os::unix::fs::fchown(&file, Some(like.uid), Some(like.gid)).map_err(what)?;
            }
            if let Some(from) = like_file {
                let missed = crate::source::access::copy_xattrs(from, &file);
                if !missed.is_empty() {
                    warn!(
                        file = %folder.path.join(target).display(),
                        "extended attributes not carried over to the new file: {}",
                        missed.join(", ")
                    );
                }
            }
            // chown clears set-id bits, and an ACL set the group bits: the mode
            // last. A set-id bit only for the source's own owner and group: a
            // rewrite by another user makes a file of that user's, which must
            // not become set-uid to them.
            let made = FileStat::of(&file).map_err(what)?;
            let mut bits = like.mode & 0o7777;
            if made.uid != like.uid {
                bits &= !libc::S_ISUID;
            }
            if made.gid != like.gid {
                bits &= !libc::S_ISGID;
            }
            if bits != like.mode & 0o7777 {
                warn!(
                    file = %folder.path.join(target).display(),
                    "the new file belongs to uid {} gid {}, not to the source's {} {}: its set-id bits are dropped",
                    made.uid, made.gid, like.uid, like.gid
                );
            }
            file.set_permissions(std::fs::Permissions::from_mode(bits))
                .map_err(what)?;
            crate::testpoint::synced(&file, file.sync_all()).map_err(what)?;
            crate::testpoint::point("rewrite:written").map_err(what)?;
            FileStat::of(&file).map_err(what)
        };
        match finish() {
            Ok(stat) => Ok(Written {
                folder: folder.clone(),
                tmp,
                target: target.to_os_string(),
                file,
                stat,
                replaces: None,
            }),
            Err(e) => {
                let _ = folder.unlink(&tmp);
                Err(e)
            }
        }
    }
}

/// A new temp file beside `target`: `.<target>.stfs-tmp-<pid>-<random>`,
/// made with O_EXCL. The random part keeps another user from making the name
/// first (in a sticky folder such as /tmp, a file made there in advance
/// could not be removed); a name taken anyway is tried again with another.
fn create_temp(folder: &Folder, target: &std::ffi::OsStr) -> Result<(OsString, File), CommitError> {
    let rng = ring::rand::SystemRandom::new();
    let mut last = None;
    for _ in 0..16 {
        let mut r = [0u8; 8];
        ring::rand::SecureRandom::fill(&rng, &mut r).map_err(|_| {
            io_err("making a temp file's name")(std::io::Error::other("no random bytes"))
        })?;
        let tmp = OsString::from(format!(
            ".{}.stfs-tmp-{}-{:016x}",
            target.to_string_lossy(),
            std::process::id(),
            u64::from_le_bytes(r)
        ));
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        match folder.open_file(&tmp, flags, 0o600) {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                warn!(folder = %folder.path.display(), "temp name {} taken by someone else: another", tmp.to_string_lossy());
                last = Some((tmp, e));
            }
            Err(e) => {
                return Err(io_err(format!(
                    "writing {}",
                    folder.path.join(&tmp).display()
                ))(e))
            }
        }
    }
    let (tmp, e) = last.expect("tried");
    Err(io_err(format!(
        "writing {}",
        folder.path.join(&tmp).display()
    ))(e))
}

impl Live {
    /// Step 1. None when there is nothing to commit. `held`: the bytes that
    /// open descriptors and the other checkpoints of the mount read (an
    /// in-place commit leaves their ranges alone).
    pub fn plan(
        &mut self,
        commit: u64,
        options: CommitOptions,
        held: &[Bytes],
    ) -> Result<Option<CommitPlan>, CommitError> {
        // (`--compact` rewrites a file with nothing staged too: its layout is the edit.)
        if !self.dirty && !options.compact {
            return Ok(None);
        }
        let file = self.source.path().to_path_buf();
        let refused = |problems| CommitError::Refused {
            file: file.clone(),
            problems,
        };
        let problems = self.problems();
        if !problems.is_empty() {
            return Err(refused(problems));
        }
        let (inputs, members) = self.commit_inputs(true);
        // Staging files came back pinned: they are unpinned when the plan
        // goes, or now if it is not made.
        let pins = Pins(
            inputs
                .iter()
                .filter_map(|b| match b {
                    Bytes::Staged(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        );
        let metadata = self
            .metadata()
            .expect("problems() refuses invalid metadata")
            .cloned();
        // The file now at the source's name (gone: changed too).
        let mapped = self.source.stat();
        let folder = self
            .source
            .folder()
            .ok_or_else(|| CommitError::ReadOnly { file: file.clone() })?;
        let same = match folder.stat_at(self.source.file_name()) {
            Ok(now) => {
                now.st_dev == mapped.dev
                    && now.st_ino == mapped.ino
                    && now.st_size as u64 == mapped.len
                    && (now.st_mtime, now.st_mtime_nsec) == mapped.mtime
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => false,
            Err(e) => return Err(io_err(file.display().to_string())(e)),
        };
        if !same && !options.force {
            return Err(CommitError::Conflict { file });
        }
        let (layout, way) = {
            let specs = self.commit_specs(&members);
            let reference = layout_of(specs.len(), |i| specs[i], metadata.as_ref()).map_err(
                |e: FormatError| {
                    refused(vec![Problem {
                        tensor: e.tensor().map(str::to_string),
                        rule: e.to_string(),
                    }])
                },
            )?;
            choose(&NewState {
                source: &self.source,
                specs: &specs,
                inputs: &inputs,
                metadata: metadata.as_ref(),
                held,
                unchanged: same,
                options,
                reference,
            })
        };
        let mut moved = vec![u32::MAX; self.source.header().tensors.len()];
        for (j, &k) in layout.source_index.iter().enumerate() {
            if let Bytes::Source(src, i) = &inputs[k] {
                if Arc::ptr_eq(src, &self.source) && moved[*i as usize] == u32::MAX {
                    moved[*i as usize] = j as u32
                }
            }
        }
        let moved = Arc::new(moved);
        self.committing = Some((commit, moved.clone()));
        self.log(vec![Record::Plan { commit }]);
        let described = way.describe(layout.file_len());
        Ok(Some(CommitPlan {
            commit,
            source: self.source.clone(),
            layout,
            way,
            described,
            metadata,
            metadata_gen: self.metadata_gen,
            inputs,
            members,
            mark: next_gen(),
            moved,
            force: options.force,
            _pins: pins,
        }))
    }

    /// The bytes of each tensor of the new state, and what the plan took them
    /// from. `pin`: staging files come back pinned (for a commit).
    fn commit_inputs(&self, pin: bool) -> (Vec<Bytes>, Vec<Member>) {
        let mut inputs = Vec::new();
        let mut members = Vec::new();
        for (id, e) in self.entries_from(0) {
            let (Some(object), super::MetaView::Valid(..)) = (e.data, e.meta) else {
                continue; // a meta without data: not a tensor
            };
            let state = match pin {
                true => self.object_for_commit(object),
                false => self.object(object),
            }
            .expect("an entry's data exists");
            inputs.push(state.bytes);
            members.push(Member {
                entry: id,
                entry_gen: match &self.entries[id as usize] {
                    EntrySlot::Live(l) => l.gen,
                    _ => 0,
                },
                object,
                object_gen: state.gen,
            });
        }
        (inputs, members)
    }

    /// Name, dtype and shape of each member, borrowed from the state.
    fn commit_specs(&self, members: &[Member]) -> Vec<(&str, crate::format::Dtype, &[u64])> {
        members
            .iter()
            .map(|m| {
                let e = self.entry(m.entry).expect("a member's entry exists");
                match e.meta {
                    super::MetaView::Valid(dtype, shape) => (e.name, dtype, shape),
                    _ => unreachable!("members have valid metas"),
                }
            })
            .collect()
    }

    /// What a commit would do now (for `stfs status`): its way, in words.
    pub fn commit_preview(&self, held: &[Bytes]) -> Option<String> {
        if !self.dirty || !self.problems().is_empty() {
            return None;
        }
        if self.committing.is_some() {
            // (Its lease is the commit's: taking and letting go of one here would end it.)
            return Some("a commit of it is running".into());
        }
        let (inputs, members) = self.commit_inputs(false);
        let metadata = self.metadata()?.cloned();
        let specs = self.commit_specs(&members);
        let reference = layout_of(specs.len(), |i| specs[i], metadata.as_ref()).ok()?;
        let unchanged = self.source.folder().is_some_and(|f| {
            f.stat_at(self.source.file_name()).is_ok_and(|now| {
                let mapped = self.source.stat();
                (now.st_dev, now.st_ino, now.st_size as u64) == (mapped.dev, mapped.ino, mapped.len)
                    && (now.st_mtime, now.st_mtime_nsec) == mapped.mtime
            })
        });
        // A lease is taken and let go at once: the answer is for now.
        let (layout, way) = choose(&NewState {
            source: &self.source,
            specs: &specs,
            inputs: &inputs,
            metadata: metadata.as_ref(),
            held,
            unchanged,
            options: CommitOptions::default(),
            reference,
        });
        Some(way.describe(layout.file_len()))
    }

    /// The plan of this checkpoint did not go through.
    pub fn abandon(&mut self) {
        self.committing = None;
    }

    /// Step 3: the new file is in place; `landed` is it.
    pub fn finish(&mut self, mut plan: CommitPlan, landed: &Landing) -> Result<(), CommitError> {
        let what = || landed.target().display().to_string();
        self.committing = None;
        self.version += 1;
        let header_len = plan.layout.header.len() as u64 - crate::format::PREFIX_LEN;
        plan.layout.header = Vec::new();
        let tensors = std::mem::take(&mut plan.layout.tensors);
        let header = Header::from_parts(header_len, tensors, plan.metadata.clone());
        let fresh = match landed {
            Landing::Renamed(written) => {
                // The very file written (not whatever has the name now):
                // open for writing too if the source was, read-only if not.
                let file = match self.source.writable_file() {
                    Some(_) => written.file.try_clone(),
                    None => File::open(format!("/proc/self/fd/{}", written.file.as_raw_fd())),
                }
                .map_err(io_err(what()))?;
                let writable = self.source.writable_file().is_some();
                SourceFile::committed(&self.source, file, writable, header, written.stat)
            }
            Landing::InPlace(job) => {
                let landed = job.landed.lock().unwrap_or_else(|p| p.into_inner()).take();
                let landed = landed.ok_or_else(|| CommitError::Io {
                    what: what(),
                    source: std::io::Error::other("the in-place commit left no version"),
                })?;
                self.source.rewritten_in_place(header, landed)
            }
        };
        let fresh = Arc::new(fresh.map_err(io_err(what()))?);
        let old = std::mem::replace(&mut self.source, fresh.clone());
        // New index of each member: layout.source_index maps file order -> input order.
        let mut new_index = vec![0u32; plan.members.len()];
        for (j, &k) in plan.layout.source_index.iter().enumerate() {
            new_index[k] = j as u32;
        }
        let len = self.entries.len();
        let (mut entry_done, mut object_done) = (vec![false; len], vec![false; len]);
        let mut source_ids = vec![0; plan.members.len()];
        let mut source_objects = vec![0; plan.members.len()];
        for (m, &j) in plan.members.iter().zip(&new_index) {
            source_ids[j as usize] = m.entry;
            source_objects[j as usize] = m.object;
            let object_same = match &self.objects[m.object as usize] {
                ObjectSlot::Source(_) => m.object_gen == 0,
                ObjectSlot::Live(o) => o.gen() == m.object_gen,
                ObjectSlot::Gone => false,
            };
            let entry_same = match &self.entries[m.entry as usize] {
                EntrySlot::Source(_) => m.entry_gen == 0,
                EntrySlot::Live(l) => l.gen == m.entry_gen,
                EntrySlot::Gone => false,
            };
            if object_same {
                object_done[m.object as usize] = true;
                match &self.objects[m.object as usize] {
                    ObjectSlot::Live(o) => o.rebase(Bytes::Source(fresh.clone(), j)),
                    _ => self.objects[m.object as usize] = ObjectSlot::Source(j),
                }
            }
            if entry_same && object_same {
                entry_done[m.entry as usize] = true;
                let meta_file = self.meta_file_id(m.entry);
                self.settle(m.entry, m.object, j, meta_file);
            }
        }
        // Everything else that named the old file by index now holds what it
        // named itself: its name, its dtype and shape, its bytes.
        let header = old.header();
        for id in 0..len {
            if !entry_done[id] {
                let slot = std::mem::replace(&mut self.entries[id], EntrySlot::Gone);
                self.entries[id] = match slot {
                    EntrySlot::Source(i) => EntrySlot::Live(Box::new(super::Entry {
                        gen: next_gen(),
                        ..super::Entry::of_source(i, id as Id)
                    })),
                    other => other,
                };
                if let EntrySlot::Live(e) = &mut self.entries[id] {
                    if let Some(i) = e.origin.take() {
                        let t = header.tensors.get(i as usize);
                        e.name.get_or_insert_with(|| t.name.into());
                        if matches!(e.meta, EntryMeta::Source) {
                            e.meta = EntryMeta::Own(super::Meta::Valid {
                                dtype: t.dtype,
                                shape: t.shape.to_vec(),
                            });
                        }
                    }
                }
            }
            if !object_done[id] {
                if let ObjectSlot::Source(i) = self.objects[id] {
                    let o = DataObject::new(Bytes::Source(old.clone(), i), None);
                    o.set_home(self.serial, id as Id);
                    self.objects[id] = ObjectSlot::Live(o);
                }
            }
        }
        self.source_ids = source_ids;
        self.source_objects = source_objects;
        // A meta without data that was there at the plan described nothing
        // the commit wrote: it goes, and so does a hidden one.
        for id in 0..len {
            let orphan = match &self.entries[id] {
                EntrySlot::Live(e) => {
                    e.data.is_none()
                        && e.gen < plan.mark
                        && (e.meta_hidden
                            || matches!(&e.meta, EntryMeta::Own(super::Meta::Valid { .. })))
                }
                _ => false,
            };
            if orphan {
                let name = self
                    .entry(id as Id)
                    .map(|e| e.name.to_string())
                    .unwrap_or_default();
                self.index.remove(id as Id, &name);
                self.entries[id] = EntrySlot::Gone;
            }
        }
        if self.metadata_gen == plan.metadata_gen {
            if self.metadata == MetadataDoc::Removed {
                // Shown again (as the new file has it): a new file.
                self.metadata_file = self.new_id();
            }
            self.metadata = MetadataDoc::Unchanged;
        }
        self.dirty = !self.overlay().is_empty();
        if self.dirty {
            if let Err(e) = self.snapshot() {
                warn!("rewriting the journal after the commit: {e}");
            }
        } else if let Some(dir) = self.staging.current() {
            self.journal.remove(&dir);
        }
        drop(plan);
        // Unmapping the replaced file frees its blocks and page cache, which
        // takes a while for a large file: let the commit return first.
        let _ = std::thread::Builder::new()
            .name("stfs-unmap".into())
            .spawn(move || {
                drop(old);
                super::trim_memory();
            });
        Ok(())
    }

    /// Before the rename: the journal says which file is about to land (the
    /// caller fsyncs it, outside the state's lock).
    pub fn landing(&mut self, commit: u64, stat: FileStat) {
        self.log(vec![Record::Landing { commit, stat }]);
    }

    /// After another checkpoint's commit (`old` became `fresh`; `moved` maps
    /// its tensor indices): objects here that hold that checkpoint's tensors
    /// (moved here between the shards of a folder mount) read them from the
    /// new file, and the journal says so.
    pub fn rebase_foreign(
        &mut self,
        old: &Arc<SourceFile>,
        fresh: &Arc<SourceFile>,
        moved: &[u32],
    ) {
        let mut rebased = false;
        for slot in &self.objects {
            let ObjectSlot::Live(o) = slot else { continue };
            if let Bytes::Source(src, i) = o.bytes() {
                let j = moved.get(i as usize).copied().unwrap_or(u32::MAX);
                if Arc::ptr_eq(&src, old) && j != u32::MAX {
                    o.rebase(Bytes::Source(fresh.clone(), j));
                    rebased = true;
                }
            }
        }
        if rebased {
            self.dirty = true;
            if let Err(e) = self.snapshot() {
                warn!("rewriting the journal: {e}");
            }
        }
    }
}

/// A file a commit changes: a new file renamed over its target, or a
/// source written in place.
pub enum Landing {
    Renamed(Written),
    InPlace(Box<InPlaceJob>),
}

impl Landing {
    /// The file as it will be once landed.
    pub fn stat(&self) -> FileStat {
        match self {
            Landing::Renamed(w) => w.stat,
            Landing::InPlace(j) => FileStat {
                len: j.record.after_len,
                mtime: j.record.after_mtime,
                ..j.record.before
            },
        }
    }

    pub fn target(&self) -> PathBuf {
        match self {
            Landing::Renamed(w) => w.target(),
            Landing::InPlace(j) => j.source.path().to_path_buf(),
        }
    }

    /// Forgets a landing that will not happen (its temp file, its lease).
    pub fn remove(&self) {
        if let Landing::Renamed(w) = self {
            w.remove()
        }
    }
}

/// An in-place commit of one file, ready to run (its lease held).
pub struct InPlaceJob {
    source: Arc<SourceFile>,
    /// The file as the commit left it, taken while the lease still kept
    /// every other writer out: the version later commits check the file
    /// against (a program that writes as soon as its open returns has
    /// changed it since, and the next commit is refused).
    landed: std::sync::Mutex<Option<FileStat>>,
    file: Arc<File>,
    lease: std::sync::Mutex<Option<Lease>>,
    record: InPlaceRecord,
    header: Vec<u8>,
    /// The staging files the writes copy from, by name.
    staged: std::collections::HashMap<String, Arc<StagedFile>>,
}

impl InPlaceJob {
    fn run(&self, dir: &Folder) -> Result<(), in_place::ApplyError> {
        let lease = self.lease.lock().unwrap_or_else(|p| p.into_inner()).take();
        if !lease.as_ref().is_some_and(Lease::holds) {
            return Err(in_place::ApplyError {
                marked: false,
                error: std::io::Error::from_raw_os_error(libc::EAGAIN),
            });
        }
        let open_staged = |name: &str| {
            self.staged
                .get(name)
                .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))?
                .file()
        };
        self.source.begin_in_place();
        let insert = |len| self.source.insert_at_start(len);
        let collapse = |len| self.source.collapse_at_start(len);
        let retire = |ranges| self.source.retire(ranges);
        let steps = in_place::Steps {
            open_staged: &open_staged,
            insert: &insert,
            collapse: &collapse,
            dir,
            retire: &retire,
            fresh: true,
        };
        let result = self.record.apply(&*self.file, &self.header, &steps);
        let now = result
            .as_ref()
            .ok()
            .and_then(|_| FileStat::of(&self.file).ok());
        self.source.end_in_place(now.as_ref());
        // A commit longer than the lease-break time let a waiting open in
        // before it ended: that program may have written, so the version
        // later commits check against is one no file has (they refuse, ESTALE,
        // unless forced).
        let landed = match now {
            Some(st) if !lease.as_ref().is_some_and(Lease::holds) => {
                warn!(
                    file = %self.source.path().display(),
                    "another program's open got past the commit's lease before it ended: the next \
                     commit is refused unless forced"
                );
                Some(FileStat {
                    mtime: (-1, -1),
                    ..st
                })
            }
            other => other,
        };
        *self.landed.lock().unwrap_or_else(|p| p.into_inner()) = landed;
        drop(lease); // opens that waited go on, and see the new file
                     // (A test pauses here to write as another program would.)
        let _ = crate::testpoint::point("in-place:unleased");
        result
    }

    fn error(&self, e: in_place::ApplyError) -> CommitError {
        let file = self.source.path().to_path_buf();
        match e.error.raw_os_error() {
            Some(libc::EAGAIN) if !e.marked => CommitError::Opened { file },
            _ => CommitError::Io {
                what: format!("{}: writing in place", file.display()),
                source: e.error,
            },
        }
    }
}

impl CommitPlan {
    /// A plan whose landing failed half-way: its staging files stay pinned
    /// (writes copy them aside) and on disk, for the next mount.
    pub fn keep_pinned(mut self) {
        let pins = std::mem::replace(&mut self._pins, Pins(Vec::new()));
        std::mem::forget(pins);
    }

    /// Step 2, touching no state: writes the new file beside the source, or
    /// gets an in-place commit ready (its staging files durable).
    pub fn write(&mut self, progress: &mut dyn FnMut(u64, u64)) -> Result<Landing, CommitError> {
        let started = std::time::Instant::now();
        let folder = self.source.folder().ok_or_else(|| CommitError::ReadOnly {
            file: self.source.path().to_path_buf(),
        })?;
        let way = std::mem::replace(&mut self.way, Way::Rewrite { why: String::new() });
        let share = match way {
            Way::SharedExtents { block, .. } => Some(block),
            _ => None,
        };
        if let Way::InPlace {
            layout,
            lease,
            file,
            mtime,
        } = way
        {
            // The staging files the redo record names must be durable first:
            // one by one, or (many small ones) the whole filesystem at once.
            let mut staged = std::collections::HashMap::new();
            for (_, k) in &layout.writes {
                if let Bytes::Staged(s) = &self.inputs[*k] {
                    staged.insert(s.name(), s.clone());
                }
            }
            let what = |source| CommitError::Io {
                what: format!(
                    "{}: syncing the staging files",
                    self.source.path().display()
                ),
                source,
            };
            if staged.len() > 64 {
                let any = staged
                    .values()
                    .next()
                    .expect("many")
                    .file()
                    .map_err(&what)?;
                // SAFETY: syncfs of a valid descriptor.
                if unsafe { libc::syncfs(any.as_raw_fd()) } != 0 {
                    return Err(what(std::io::Error::last_os_error()));
                }
            } else {
                for s in staged.values() {
                    s.sync().map_err(&what)?;
                }
            }
            let old_prefix = self.source.header().header_len;
            // The file as mapped, with its owner and mode as they are now
            // (set-id bits a write clears are put back from them).
            let now =
                FileStat::of(&file).map_err(io_err(self.source.path().display().to_string()))?;
            let stat = FileStat {
                mode: now.mode,
                uid: now.uid,
                gid: now.gid,
                ..*self.source.stat()
            };
            let mut old_header = vec![0u8; (crate::format::PREFIX_LEN + old_prefix) as usize];
            file.read_exact_at(&mut old_header, 0)
                .map_err(io_err(self.source.path().display().to_string()))?;
            let mut record = InPlaceRecord {
                folder: folder.path.clone(),
                name: self.source.file_name().to_string_lossy().into_owned(),
                before: stat,
                old_prefix,
                after_len: layout.file_len,
                after_mtime: mtime,
                header_file: format!("in-place-{}-{}-{}.header", self.commit, stat.dev, stat.ino),
                inserted: layout.inserted,
                header_write: layout.header_write,
                writes: layout.writes.iter().map(|(w, _)| w.clone()).collect(),
                old_header_sum: in_place::sha256_hex(&[&old_header]),
                sum: String::new(),
            };
            record.seal(&self.layout.header);
            return Ok(Landing::InPlace(Box::new(InPlaceJob {
                source: self.source.clone(),
                landed: std::sync::Mutex::new(None),
                file,
                lease: std::sync::Mutex::new(Some(lease)),
                header: self.layout.header.clone(),
                record,
                staged,
            })));
        }
        let mut written = Written::create(
            folder,
            self.source.file_name(),
            self.source.stat(),
            self.source.file().map(|f| &**f),
            |file| self.fill(file, share, progress),
        )?;
        written.replaces = (!self.force).then(|| *self.source.stat());
        info!(
            file = %self.source.path().display(),
            tensors = self.layout.tensors.len(),
            bytes = self.layout.file_len(),
            elapsed = ?started.elapsed(),
            "commit written"
        );
        Ok(Landing::Renamed(written))
    }

    /// The new file: header, then every tensor's bytes (with `share`, the
    /// blocks of the source's tensors shared where they can be).
    fn fill(
        &self,
        file: &File,
        share: Option<u64>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), CommitError> {
        file.write_all_at(&self.layout.header, 0)
            .map_err(io_err(format!(
                "writing the commit of {}",
                self.source.path().display()
            )))?;
        let total = self.layout.data_len();
        let mut out = self.layout.header.len() as u64;
        let (mut done, mut shared) = (0, 0);
        for (placed, &k) in self.layout.tensors.iter().zip(&self.layout.source_index) {
            let len = placed.nbytes();
            let what = io_err(format!(
                "{}: tensor {:?}: copying its bytes",
                self.source.path().display(),
                placed.name
            ));
            match share {
                Some(block) => {
                    shared += self.inputs[k]
                        .copy_sharing_to(file, out, block)
                        .map_err(what)?
                }
                None => self.inputs[k].copy_to(0, file, out, len).map_err(what)?,
            }
            out += len;
            done += len;
            progress(done, total);
            // (A test kills or pauses the daemon here, the new file half written.)
            crate::testpoint::point("rewrite:copying").map_err(io_err(format!(
                "{}: writing the new file",
                self.source.path().display()
            )))?;
        }
        if share.is_some() {
            info!(
                file = %self.source.path().display(),
                shared,
                copied = total - shared,
                "commit: blocks shared with the old file"
            );
        }
        Ok(())
    }
}

/// Why `land` stopped: after `done` files landed; `changed`: whether
/// anything changed on disk (if not, the commit is simply abandoned).
pub struct LandError {
    pub done: usize,
    pub changed: bool,
    /// The file that failed is left refused by every reader.
    pub refused: bool,
    pub error: CommitError,
}

/// Puts the files in place (each journal already says which file is
/// landing): the landings are recorded in the staging folder (the redo
/// record of the in-place ones, the renames), done in order, then forgotten.
/// Once a file changed there is no going back: a crash is finished by the
/// next mount (`staging::Renames`).
pub fn land(commit: u64, landings: &[Landing], staging: &Staging) -> Result<(), LandError> {
    let before = |error| LandError {
        done: 0,
        changed: false,
        refused: false,
        error,
    };
    let dir = staging.dir().map_err(|e| before(CommitError::Staging(e)))?;
    let record_err = |name: &str| io_err(format!("{}/{name}", dir.path().display()));
    let mut renames = Renames {
        commit,
        files: Vec::new(),
        in_place: Vec::new(),
    };
    for l in landings {
        match l {
            Landing::Renamed(w) => renames.files.push(PendingRename {
                folder: w.folder.path.clone(),
                tmp: w.tmp.to_string_lossy().into_owned(),
                target: w.target.to_string_lossy().into_owned(),
                stat: w.stat,
                replaces: w.replaces,
            }),
            Landing::InPlace(j) => {
                dir.write_atomic(&j.record.header_file, &j.header)
                    .map_err(record_err(&j.record.header_file))
                    .map_err(before)?;
                renames.in_place.push(j.record.clone());
            }
        }
    }
    // The new files' names must be on disk before the record that names
    // them: a record whose temp file is missing reads as renamed already
    // (the crash explorer found an index update lost so).
    let mut synced: Vec<&std::path::Path> = Vec::new();
    for l in landings {
        if let Landing::Renamed(w) = l {
            if !synced.contains(&w.folder.path.as_path()) {
                w.folder
                    .sync()
                    .map_err(io_err(w.folder.path.display().to_string()))
                    .map_err(before)?;
                synced.push(&w.folder.path);
            }
        }
    }
    renames
        .write(&dir)
        .map_err(record_err(super::staging::RENAMES))
        .map_err(before)?;
    if let Err(e) = crate::testpoint::point("land:recorded") {
        Renames::clear(&dir);
        return Err(before(io_err("recording the commit")(e)));
    }
    if !renames.in_place.is_empty() {
        if let Err(e) = crate::testpoint::point("in-place:recorded") {
            Renames::clear(&dir);
            return Err(before(io_err("recording the commit")(e)));
        }
    }
    let forget = || {
        Renames::clear(&dir);
        landings.iter().for_each(Landing::remove);
    };
    for (k, l) in landings.iter().enumerate() {
        let (changed, refused, error) = match l {
            Landing::Renamed(w) => match w.land() {
                Ok(()) => {
                    let _ = crate::testpoint::point("land:renamed");
                    continue;
                }
                Err(e) => (k > 0, false, e),
            },
            Landing::InPlace(j) => match dir
                .folder()
                .map_err(|e| in_place::ApplyError {
                    marked: false,
                    error: e,
                })
                .and_then(|d| j.run(&d))
            {
                Ok(()) => {
                    info!(file = %j.source.path().display(), "committed in place");
                    continue;
                }
                Err(e) => (k > 0 || e.marked, e.marked, j.error(e)),
            },
        };
        if !changed {
            forget();
        }
        return Err(LandError {
            done: k,
            changed,
            refused,
            error,
        });
    }
    for l in landings {
        if let Landing::Renamed(w) = l {
            if let Err(e) = w.folder.sync() {
                warn!("fsync of {} after the commit: {e}", w.folder.path.display());
            }
        }
    }
    let _ = crate::testpoint::point("in-place:landed");
    Renames::clear(&dir);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::new_mtime;

    #[test]
    fn an_in_place_commit_gives_a_time_after_the_old_one() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        // An old time: now.
        let t = new_mtime((1000, 5));
        assert!(t.0 >= now && (0..1_000_000_000).contains(&t.1), "{t:?}");
        // A time in the future (a clock set back): one nanosecond after it.
        assert_eq!(new_mtime((now + 100, 7)), (now + 100, 8));
        assert_eq!(new_mtime((now + 100, 999_999_999)), (now + 101, 0));
    }
}
