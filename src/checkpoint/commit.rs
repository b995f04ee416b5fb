//! A commit, in three steps so that reads and edits go on meanwhile:
//!
//! 1. `Live::plan` (state locked, briefly): validate every edit, check the
//!    source is the file that was mapped, lay out the new file, pin the
//!    staging files it reads, and mark the journal.
//! 2. `CommitPlan::write` (no lock): a temp file beside the source, the header
//!    as the reference writes it, bytes copied with copy_file_range, the
//!    source's mode and owner, fsync. `land` then renames the temp files of
//!    every shard over their sources (recorded first, so that the next mount
//!    finishes a rename that a crash interrupted) and fsyncs the folder.
//! 3. `Live::finish` (state locked): map the new file; what the plan wrote and
//!    nobody edited since reads from it now; later edits stay staged.
//!
//! Before a rename nothing of the source changed: a failure leaves it
//! byte-identical and the edits staged.

use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use tracing::{info, warn};

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
            CommitError::Tainted { why } => write!(
                f,
                "{why}: commit refused. The staged edits are kept on disk: unmount, mount again (the \
                 edits are taken back from the journal, an interrupted commit is finished) and review \
                 them with stfs status"
            ),
            CommitError::Io { what, source } => write!(f, "{what}: {source}"),
            CommitError::Staging(e) => write!(f, "{e}"),
            CommitError::ReadOnly { file } => write!(
                f,
                "{}: a remote source is read-only (stfs does not write to object stores yet)",
                file.display()
            ),
        }
    }
}

impl std::error::Error for CommitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CommitError::Io { source, .. } => Some(source),
            CommitError::Staging(e) => Some(e),
            _ => None,
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

/// Everything step 2 needs, taken from the state: it holds the bytes by
/// reference counts, so the state is free again.
pub struct CommitPlan {
    pub commit: u64,
    pub source: Arc<SourceFile>,
    pub layout: Layout,
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

/// The files a commit will replace or rewrite, locked (`flock`, exclusive)
/// from before its plan until it landed: a second mount's commit of the same
/// source waits, then finds the file changed and refuses (ESTALE) instead of
/// writing over the first commit. Locks are taken in (device, inode) order.
pub struct CommitLock(#[allow(dead_code)] Vec<File>);

impl CommitLock {
    pub fn take(files: &[(Arc<Folder>, OsString)]) -> Result<CommitLock, CommitError> {
        let mut opened = Vec::new();
        for (folder, name) in files {
            let what = |e| CommitError::Io {
                what: format!(
                    "locking {} for the commit",
                    folder.path.join(name).display()
                ),
                source: e,
            };
            let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
            let file = match folder.open_file(name, flags, 0) {
                Ok(f) => f,
                // Gone (the plan says what that means), or a link (an index
                // of a Hugging Face snapshot): nothing to lock.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => continue,
                Err(e) => return Err(what(e)),
            };
            let st = FileStat::of(&file).map_err(what)?;
            opened.push(((st.dev, st.ino), folder.path.join(name), file));
        }
        opened.sort_by_key(|(key, ..)| *key);
        opened.dedup_by_key(|(key, ..)| *key);
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        for (_, path, file) in &opened {
            // SAFETY: a valid descriptor.
            while unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                    // A filesystem without locks (some network ones): the
                    // check before the swap is all there is.
                    warn!(file = %path.display(), "cannot lock it for the commit: {e}");
                    break;
                }
                if std::time::Instant::now() > deadline {
                    return Err(CommitError::Busy { file: path.clone() });
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        Ok(CommitLock(opened.into_iter().map(|(_, _, f)| f).collect()))
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
    /// `like`'s mode (and owner, as root) and fsyncs it. On failure nothing is left.
    pub fn create(
        folder: &Arc<Folder>,
        target: &std::ffi::OsStr,
        like: &FileStat,
        fill: impl FnOnce(&File) -> Result<(), CommitError>,
    ) -> Result<Written, CommitError> {
        let tmp = OsString::from(format!(
            ".{}.stfs-tmp-{}-{:x}",
            target.to_string_lossy(),
            std::process::id(),
            next_gen()
        ));
        let what = |e| CommitError::Io {
            what: format!("writing {}", folder.path.join(&tmp).display()),
            source: e,
        };
        let file = folder
            .open_file(&tmp, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600)
            .map_err(what)?;
        let finish = || -> Result<FileStat, CommitError> {
            fill(&file)?;
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::Permissions::from_mode(like.mode & 0o7777);
            file.set_permissions(mode.clone()).map_err(what)?;
            // SAFETY: geteuid cannot fail.
            if unsafe { libc::geteuid() } == 0 {
                std::os::unix::fs::fchown(&file, Some(like.uid), Some(like.gid)).map_err(what)?;
                // chown clears set-id bits: put the mode back.
                file.set_permissions(mode).map_err(what)?;
            }
            file.sync_all().map_err(what)?;
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

impl Live {
    /// Step 1. None when there is nothing to commit.
    pub fn plan(&mut self, commit: u64, force: bool) -> Result<Option<CommitPlan>, CommitError> {
        if !self.dirty {
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
        // Names and shapes are borrowed from the state for the layout, not copied.
        let mut specs = Vec::new();
        let mut inputs = Vec::new();
        let mut members = Vec::new();
        for (id, e) in self.entries_from(0) {
            let (Some(object), super::MetaView::Valid(dtype, shape)) = (e.data, e.meta) else {
                continue; // a meta without data: not a tensor
            };
            let state = self
                .object_for_commit(object)
                .expect("an entry's data exists");
            specs.push((e.name, dtype, shape));
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
        let layout =
            layout_of(specs.len(), |i| specs[i], metadata.as_ref()).map_err(|e: FormatError| {
                refused(vec![Problem {
                    tensor: e.tensor().map(str::to_string),
                    rule: e.to_string(),
                }])
            })?;
        drop(specs);
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
        if !same && !force {
            return Err(CommitError::Conflict { file });
        }
        let mut moved = vec![u32::MAX; self.source.header().tensors.len()];
        for (j, &k) in layout.source_index.iter().enumerate() {
            if let Bytes::Source(src, i) = &inputs[k] {
                if Arc::ptr_eq(src, &self.source) {
                    moved[*i as usize] = j as u32
                }
            }
        }
        let moved = Arc::new(moved);
        self.committing = Some((commit, moved.clone()));
        self.log(vec![Record::Plan { commit }]);
        Ok(Some(CommitPlan {
            commit,
            source: self.source.clone(),
            layout,
            metadata,
            metadata_gen: self.metadata_gen,
            inputs,
            members,
            mark: next_gen(),
            moved,
            force,
            _pins: pins,
        }))
    }

    /// The plan of this checkpoint did not go through.
    pub fn abandon(&mut self) {
        self.committing = None;
    }

    /// Step 3: the new file is in place; `written` is it.
    pub fn finish(&mut self, mut plan: CommitPlan, written: Written) -> Result<(), CommitError> {
        let what = || written.target().display().to_string();
        self.committing = None;
        // Read-only descriptor of the very file written (not of whatever has the name now).
        let file = File::open(format!("/proc/self/fd/{}", written.file.as_raw_fd()))
            .map_err(io_err(what()))?;
        let header_len = plan.layout.header.len() as u64 - crate::format::PREFIX_LEN;
        plan.layout.header = Vec::new();
        let tensors = std::mem::take(&mut plan.layout.tensors);
        let header = Header::from_parts(header_len, tensors, plan.metadata.clone());
        let fresh =
            Arc::new(SourceFile::committed(&self.source, file, header).map_err(io_err(what()))?);
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

impl CommitPlan {
    /// Step 2, touching no state: writes the new file beside the source.
    pub fn write(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<Written, CommitError> {
        let started = std::time::Instant::now();
        let folder = self.source.folder().ok_or_else(|| CommitError::ReadOnly {
            file: self.source.path().to_path_buf(),
        })?;
        let mut written = Written::create(
            folder,
            self.source.file_name(),
            self.source.stat(),
            |file| self.fill(file, progress),
        )?;
        written.replaces = (!self.force).then(|| *self.source.stat());
        info!(
            file = %self.source.path().display(),
            tensors = self.layout.tensors.len(),
            bytes = self.layout.file_len(),
            elapsed = ?started.elapsed(),
            "commit written"
        );
        Ok(written)
    }

    fn fill(&self, file: &File, progress: &mut dyn FnMut(u64, u64)) -> Result<(), CommitError> {
        file.write_all_at(&self.layout.header, 0)
            .map_err(io_err(format!(
                "writing the commit of {}",
                self.source.path().display()
            )))?;
        let total = self.layout.data_len();
        let mut out = self.layout.header.len() as u64;
        let mut done = 0;
        for (placed, &k) in self.layout.tensors.iter().zip(&self.layout.source_index) {
            let len = placed.nbytes();
            self.inputs[k]
                .copy_to(0, file, out, len)
                .map_err(io_err(format!(
                    "{}: tensor {:?}: copying its bytes",
                    self.source.path().display(),
                    placed.name
                )))?;
            out += len;
            done += len;
            progress(done, total);
        }
        Ok(())
    }
}

/// Puts the written files in place (each journal already says which file
/// is landing): the renames are recorded in the staging folder, done, then
/// forgotten. After the first rename there is no going back: a crash is
/// finished by the next mount (`staging::Renames`). On failure, says how many
/// files were renamed (the record then stays for the next mount).
pub fn land(
    commit: u64,
    written: &[Written],
    staging: &Staging,
) -> Result<(), (usize, CommitError)> {
    let dir = staging.dir().map_err(|e| (0, CommitError::Staging(e)))?;
    let renames = Renames {
        commit,
        files: written
            .iter()
            .map(|w| PendingRename {
                folder: w.folder.path.clone(),
                tmp: w.tmp.to_string_lossy().into_owned(),
                target: w.target.to_string_lossy().into_owned(),
                stat: w.stat,
            })
            .collect(),
    };
    renames
        .write(&dir)
        .map_err(io_err(format!(
            "{}/{}",
            dir.path().display(),
            super::staging::RENAMES
        )))
        .map_err(|e| (0, e))?;
    for (k, w) in written.iter().enumerate() {
        if let Err(e) = w.land() {
            if k == 0 {
                // Nothing changed yet: forget the commit.
                Renames::clear(&dir);
                written.iter().for_each(Written::remove);
            }
            return Err((k, e));
        }
    }
    for w in written {
        if let Err(e) = w.folder.sync() {
            warn!("fsync of {} after the commit: {e}", w.folder.path.display());
        }
    }
    Renames::clear(&dir);
    Ok(())
}
