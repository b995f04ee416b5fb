//! The filesystem view of mounted checkpoints: inodes, names, attributes,
//! directory listings, file handles, and the policies of a mount (what fsync
//! does, when a commit happens, who may commit). Plain Rust that tests call
//! without a mount; `fuse/` is the thin adapter that turns kernel requests
//! into these calls.
//!
//! Inodes (`state.rs`): 1 is the root, then the checkpoint directories and
//! index files, then `first_ino + STRIDE * (id * C + c) + slot` for the file
//! of kind `slot` (`TensorFile`) of id `id` of checkpoint `c` (C
//! checkpoints). A data file's id is its object's, a `.meta.json`'s is its
//! name's entry: renames and commits keep both, so the kernel's inodes stay
//! valid. `__views__` and everything below it: `VIEW_BIT` and the path's
//! place in the table of view inodes (`views`); a view served by passthrough:
//! `WHOLE_BIT` and a count per source file.
//!
//! The requests live by concern: `lookup.rs` (lookups, attributes, listings),
//! `handles.rs` (open files: read, write, flush, fsync, release), `edits.rs`
//! (create, truncate, unlink, rename), `status.rs` (status, prefetch), and
//! here the mount's policies, commit and discard.
//!
//! Locks, always taken in this order: the transactions' (one commit or discard at
//! a time), then `state`, then `handles`. Reads take `state` only to find an
//! object, and never while reading its bytes; no lock is held across disk I/O
//! of tensor bytes (copies into staging, commits) or fsync.

mod edits;
mod error;
pub mod files;
pub mod fuse;
mod handles;
pub mod ioctl;
pub mod kernel_cache;
mod load;
mod lookup;
mod model_edits;
pub mod model_files;
pub mod names;
mod state;
mod status;
mod views;

use crate::sync::{LockAnyway, RwLockAnyway};
use handles::*;
use model_edits::ModelFiles;
use state::*;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, SystemTime};

pub use error::{FsError, UnmountError};
pub use files::TensorFile;
use names::{KV_DIR, METADATA_FILE, NAME_MAX, VIEWS_DIR};
use tracing::{info, warn};

use crate::checkpoint::commit::CommitOptions;
use crate::checkpoint::staging::Staging;
use crate::checkpoint::transaction::{Shards, Transactions};
use crate::checkpoint::{CommitError, DataObject, EditError, Id, Live, MAX_JSON, MAX_META};
use crate::format::Dtype;
use crate::source::{FileStat, SourceFile};

pub type Ino = u64;
pub const ROOT_INO: Ino = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Directory,
    File,
}

/// What `stat` shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    pub ino: Ino,
    pub kind: Kind,
    pub size: u64,
    pub mtime: SystemTime,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// Content generated from the state (metas): the kernel must not cache it.
    pub volatile: bool,
    /// The kernel may keep the name of this file (a tensor's files,
    /// `__metadata__.json`, a checkpoint's folder): edits take it back
    /// (`kernel_cache`). Views and index files are looked up each time.
    pub cached_name: bool,
}

impl Attr {
    /// Without write permission (views).
    fn read_only(self) -> Attr {
        Attr {
            perm: self.perm & !0o222,
            ..self
        }
    }
}

/// How the kernel caches tensor bytes read through the mount (measured by
/// scripts/bench_read.py; docs/SEMANTICS.md, "Reads").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// The mount's pages stay cached across opens (FOPEN_KEEP_CACHE): a
    /// third read of hot bytes is served by the kernel alone, but every byte
    /// read sits in the page cache twice (the source's pages and the mount's).
    Keep,
    /// No page cache of the mount's own (FOPEN_DIRECT_IO; mmap still works):
    /// one copy in memory, every read served from the source's pages. The default.
    Direct,
}

/// An open file: its handle and how the kernel should cache it.
#[derive(Debug, Clone)]
pub struct Opened {
    pub fh: u64,
    pub keep_cache: bool,
    pub direct_io: bool,
    /// Serve this open by kernel passthrough: reads and mmaps go to this
    /// file, whole, without the daemon (a view that is the source file).
    pub passthrough: Option<Arc<std::fs::File>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: Ino,
    pub kind: Kind,
    pub name: String,
    /// Offset to pass back to continue after this entry.
    pub next_offset: u64,
}

pub use crate::checkpoint::transaction::IndexFile;
pub use model_files::ModelFile;

/// A source to mount: one checkpoint file, or a folder of shards.
// Built once per mount: the size of a variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    File(SourceFile),
    Folder {
        folder: Arc<crate::source::Folder>,
        stat: FileStat,
        /// (directory name, checkpoint), sorted by name.
        checkpoints: Vec<(String, SourceFile)>,
        indexes: Vec<IndexFile>,
        /// The folder's other files (`config.json`, the tokenizer's...).
        model_files: Vec<ModelFile>,
        /// Names of a store's folder whose objects are not shown (over the
        /// size limits): not made at the root, as a commit would replace
        /// them. (A local folder is asked at each create instead.)
        not_shown: Vec<String>,
    },
}

impl Source {
    /// The checkpoint files it shows.
    pub fn files(&self) -> Vec<&SourceFile> {
        match self {
            Source::File(s) => vec![s],
            Source::Folder { checkpoints, .. } => checkpoints.iter().map(|(_, s)| s).collect(),
        }
    }
}

/// Where a prefetch puts a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchTarget {
    PageCache,
    Cuda(i32),
}

/// A prefetch asked for: `len` bytes at `offset` (0: to the end) into the
/// page cache, or the whole tensor into a CUDA buffer.
#[derive(Debug, Clone, Copy)]
pub struct PrefetchRequest {
    pub target: PrefetchTarget,
    pub offset: u64,
    pub len: u64,
    /// The uid of the caller.
    pub caller: u32,
}

/// What a prefetch did.
#[derive(Debug, Clone)]
pub struct Prefetched {
    /// Bytes of the range asked for now resident in the page cache, or
    /// copied to the device.
    pub bytes: u64,
    pub nbytes: u64,
    /// Where the next call should continue (the end when done).
    pub next: u64,
    pub dtype: Option<Dtype>,
    pub shape: Option<Vec<u64>>,
    /// The CUDA IPC handle and allocation size.
    pub ipc: Option<([u8; 64], u64)>,
}

/// Mount-wide settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub read_only: bool,
    /// The user who mounted: with root, the only one who may commit, discard and prefetch.
    pub owner: u32,
    pub cache: CacheMode,
    /// Drop the daemon's page-table references to the source after each read.
    pub release_after_read: bool,
    /// Loads into a device: lanes in each device's pool, and bytes per slab.
    pub load_slabs: usize,
    pub load_slab: usize,
    /// How long a device's pool stays made with no load (None: until unmount).
    pub load_idle: Option<std::time::Duration>,
}

/// A device's pool: 8 slabs of 16 MiB (128 MiB pinned), as many copies in
/// flight as a PCIe Gen5 link and an NVMe array keep busy.
pub const LOAD_SLABS: usize = 8;
pub const LOAD_SLAB: usize = 16 << 20;
/// Seconds a pool stays made with no load: a job's loads come in bursts
/// (start, restart, evaluation) and remaking a pool costs milliseconds, but
/// pinned memory held all day is memory the job cannot have.
pub const LOAD_IDLE_S: u64 = 300;

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            read_only: false,
            owner: rustix::process::getuid().as_raw(),
            cache: CacheMode::Direct,
            release_after_read: false,
            load_slabs: LOAD_SLABS,
            load_slab: LOAD_SLAB,
            load_idle: Some(std::time::Duration::from_secs(LOAD_IDLE_S)),
        }
    }
}

use crate::checkpoint::view::GeneratedFile;
use views::{Draws, Found, VIEW_BIT};

pub struct Fs {
    settings: Settings,
    staging: Arc<Staging>,
    /// Commits and discards (taken before `state`).
    transactions: Transactions,
    state: RwLock<State>,
    handles: Mutex<Handles>,
    json_budget: Arc<JsonBudget>,
    /// Views that are a source file are served by kernel passthrough.
    passthrough: std::sync::atomic::AtomicBool,
    /// The view each passthrough inode was when last looked up: an open
    /// that races an edit gets the file its lookup saw, while it is still
    /// that file (taken after `state`).
    looked_up: Mutex<HashMap<Ino, Arc<GeneratedFile>>>,
    next_fh: AtomicU64,
    /// Reads of tensor bytes served, and their bytes (`stfs status` shows them).
    reads: AtomicU64,
    read_bytes: AtomicU64,
    /// What the kernel may cache of names and attributes, and the
    /// notifications that take it back.
    kernel: kernel_cache::KernelCache,
    /// Each device's pool of lanes, and the loads each descriptor started.
    devices: crate::prefetch::load::Devices,
    loads: crate::prefetch::load::Loads,
}

impl Fs {
    pub fn new(source: Source, mut settings: Settings, staging: Arc<Staging>) -> Fs {
        // Remote GGUF objects are served read-only: commits to S3 write
        // safetensors (the mount says so).
        if source
            .files()
            .iter()
            .any(|s| s.header().is_gguf() && s.remote_object().is_some())
        {
            settings.read_only = true;
        }
        let mut fixed = Vec::new();
        let (list, indexes, (model_files, not_shown), folder) = match source {
            Source::File(c) => (
                vec![(String::new(), c)],
                Vec::new(),
                Default::default(),
                None,
            ),
            Source::Folder {
                folder,
                stat,
                checkpoints,
                indexes,
                model_files,
                not_shown,
            } => (
                checkpoints,
                indexes,
                (model_files, not_shown),
                Some((folder, stat)),
            ),
        };
        if folder.is_some() {
            fixed.push(Node::FolderRoot);
        }
        let alloc = |fixed: &mut Vec<Node>, node| {
            fixed.push(node);
            fixed.len() as Ino
        };
        let mut checkpoints: Vec<Mounted> = Vec::with_capacity(list.len());
        for (c, (dir_name, source)) in list.into_iter().enumerate() {
            source.set_release_after_read(settings.release_after_read);
            let dir_ino = alloc(&mut fixed, Node::CheckpointDir(c));
            let mut live = Live::new(source, staging.clone());
            // Two shard names of one file (links to one blob): each its own
            // journal, by the name shown (a commit refuses them, `stfs status`
            // says why, but their edits are journaled apart until then).
            if checkpoints.iter().any(|m| m.live.key() == live.key()) {
                live.name_journal(&dir_name);
            }
            checkpoints.push(Mounted {
                dir_name,
                live,
                dir_ino,
            });
        }
        let indexes: Vec<(IndexFile, Ino)> = indexes
            .into_iter()
            .enumerate()
            .map(|(i, ix)| (ix, alloc(&mut fixed, Node::Index(i))))
            .collect();
        let model_files = {
            let first = checkpoints.first().map(|m| m.live.source());
            let like = first.map_or(FileStat::of_mounting_user(0o644), |s| *s.stat());
            ModelFiles::new(model_files, staging.clone(), like).not_showing(not_shown)
        };
        let devices = crate::prefetch::load::Devices::new(
            settings.load_slabs,
            settings.load_slab,
            settings.load_idle,
        );
        Fs {
            settings,
            transactions: Transactions::new(staging.clone()),
            staging,
            state: RwLock::new(State {
                first_ino: fixed.len() as Ino + 1,
                checkpoints,
                indexes,
                model_files,
                fixed,
                folder,
                hashed: Mutex::new(HashMap::new()),
                whole_inos: Mutex::new(HashMap::new()),
                view_inos: Mutex::new(views::ViewInodes::new()),
                view_files: views::Memo::new(VIEWS_KEPT),
                view_memo: views::Memo::new(8),
            }),
            handles: Mutex::new(Handles::default()),
            json_budget: Arc::default(),
            passthrough: Default::default(),
            looked_up: Default::default(),
            next_fh: AtomicU64::new(1),
            reads: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            kernel: Default::default(),
            devices,
            loads: Default::default(),
        }
    }

    /// The mount's kernel connection, for the notifications that take back
    /// what the kernel caches (before the mount serves).
    pub fn set_kernel_cache(&mut self, kernel: kernel_cache::KernelCache) {
        self.kernel = kernel;
    }

    pub fn kernel_cache(&self) -> &kernel_cache::KernelCache {
        &self.kernel
    }

    /// After a commit or a discard: every name may be another file, and every
    /// file's attributes other ones. The epoch makes every path be looked up
    /// again (with fresh attributes); what is reached without a path is the
    /// open files, and the folders.
    fn everything_changed(&self) {
        if !self.kernel.names_cached() {
            return;
        }
        self.kernel.names_changed();
        let mut inos: Vec<Ino> = self
            .handles
            .lock_anyway()
            .open
            .values()
            .map(Handle::ino)
            .collect();
        {
            let st = self.read_state();
            for (c, m) in st.checkpoints.iter().enumerate() {
                inos.push(m.dir_ino);
                inos.push(st.ino_of(Node::Metadata(c)));
            }
        }
        inos.sort_unstable();
        inos.dedup();
        inos.into_iter()
            .for_each(|ino| self.kernel.attrs_changed(ino));
    }

    fn read_state(&self) -> RwLockReadGuard<'_, State> {
        self.state.read_anyway()
    }

    fn write_state(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write_anyway()
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn staging(&self) -> &Arc<Staging> {
        &self.staging
    }

    /// Runs `f` on every checkpoint's live state (mount-time recovery).
    pub fn with_lives<R>(&self, f: impl FnOnce(&mut [&mut Live]) -> R) -> R {
        let mut st = self.write_state();
        let mut lives: Vec<&mut Live> = st.checkpoints.iter_mut().map(|m| &mut m.live).collect();
        f(&mut lives)
    }

    fn writable(&self) -> Result<(), FsError> {
        if self.settings.read_only {
            Err(FsError::ReadOnly)
        } else {
            Ok(())
        }
    }

    /// Why a folder, device node or link cannot be made in `parent`: the
    /// views are read-only (EROFS); elsewhere stfs makes only files (ENOTSUP).
    pub fn refuse_node(&self, parent: Ino, what: &'static str) -> FsError {
        match self.read_state().node(parent) {
            Ok(Node::Views(_)) => FsError::ReadOnly,
            _ => FsError::NotSupported(what),
        }
    }

    /// Commit, discard, prefetch and status are for the user who mounted, and root.
    pub fn allowed(&self, caller: u32, what: &'static str) -> Result<(), FsError> {
        if caller == 0 || caller == self.settings.owner {
            Ok(())
        } else {
            Err(FsError::Denied(what))
        }
    }

    /// Commits every checkpoint of the mount, all or none
    /// (`checkpoint::transaction`). Returns a line per file.
    pub fn commit(&self, options: CommitOptions, caller: u32) -> Result<Vec<String>, FsError> {
        self.allowed(caller, "commit")?;
        // (`--compact` would rewrite even with nothing staged; a plain
        // commit, as `stfs umount` asks, finds nothing to commit.)
        if self.settings.read_only && options.compact {
            return Err(FsError::Commit(CommitError::MountReadOnly));
        }
        let held = |st: &State| self.held_bytes(st);
        let done = self.transactions.commit(&self.state, &held, options);
        self.everything_changed();
        // Views looked up before are of source files a commit may have
        // replaced: do not keep those open and mapped.
        let st = self.read_state();
        self.looked_up.lock_anyway().retain(|_, f| {
            f.whole_source().is_some_and(|s| {
                st.checkpoints
                    .iter()
                    .any(|m| Arc::ptr_eq(m.live.source(), s))
            })
        });
        Ok(done?)
    }

    /// The bytes that open descriptors and the checkpoints' edited objects
    /// read: an in-place commit leaves their ranges of a source alone.
    fn held_bytes(&self, st: &State) -> Vec<crate::source::Bytes> {
        let mut held: Vec<crate::source::Bytes> = self
            .handles
            .lock_anyway()
            .open
            .values()
            .flat_map(|h| match h {
                Handle::Data { object, .. } => vec![object.bytes()],
                Handle::View { file, .. } => file.bytes().cloned().collect(),
                Handle::Json { .. } => Vec::new(),
            })
            .collect();
        for m in &st.checkpoints {
            held.extend(m.live.edited_bytes());
        }
        held
    }

    /// Whether any checkpoint, or model file, has staged edits.
    pub fn is_dirty(&self) -> bool {
        let st = self.read_state();
        st.checkpoints.iter().any(|m| m.live.is_dirty()) || !st.model_files.changes().is_empty()
    }

    /// Takes back the model files an earlier mount staged (in the staging
    /// folder this mount adopted): notes for the user.
    pub fn take_back_model_files(&self) -> Result<Vec<String>, FsError> {
        let mut st = self.write_state();
        let n = st.model_files.take_back()?;
        Ok(match n {
            0 => Vec::new(),
            n => vec![format!(
                "took back {n} staged model file{} of an earlier mount (stfs status lists them)",
                if n == 1 { "" } else { "s" }
            )],
        })
    }

    /// Drops every staged edit. Tensors whose bytes were not edited keep their inodes.
    /// Returns a line per file, as `commit` does.
    pub fn discard(&self, caller: u32) -> Result<Vec<String>, FsError> {
        self.allowed(caller, "discard")?;
        let done = self.transactions.discard(&self.state);
        self.everything_changed();
        Ok(done?)
    }

    /// Commit nothing of this mount from now on (its edits stay on disk for
    /// the next mount), saying why.
    pub fn taint(&self, why: String) {
        self.transactions.taint(why)
    }

    pub fn tainted(&self) -> Option<String> {
        self.transactions.tainted()
    }

    /// How far the commit being written has got, if one is (no lock of the
    /// state taken: it is asked while the commit holds them).
    pub fn commit_progress(&self) -> Option<crate::checkpoint::transaction::CommitProgress> {
        self.transactions.progress()
    }

    /// The unmount's policy: commit what is staged; if that cannot be done,
    /// keep the edits on disk (staging files and journal) for the next mount.
    /// Returns what happened, for the log.
    pub fn unmount(&self) -> Result<(), UnmountError> {
        let result = if !self.is_dirty() {
            Ok(())
        } else if let Some(why) = self.tainted() {
            Err(FsError::Commit(CommitError::Tainted { why }))
        } else {
            self.commit(CommitOptions::default(), self.settings.owner)
                .map(|lines| lines.iter().for_each(|l| info!("at unmount: {l}")))
        };
        match &result {
            // (A commit that did not land leaves its record there, even
            // with nothing staged: the next mount finishes it.)
            Ok(()) if !self.is_dirty() && !self.transactions.unlanded() => self.staging.remove(),
            _ => self.keep_edits(),
        }
        result.map_err(|source| UnmountError {
            source: Box::new(source),
            kept: self
                .staging
                .current()
                .map_or("(no staging folder)".into(), |d| {
                    d.path().display().to_string()
                }),
        })
    }

    /// Leaves the staging folder and a complete journal on disk.
    fn keep_edits(&self) {
        if let Some(dir) = self.staging.current() {
            dir.keep_files(true);
        }
        let mut st = self.write_state();
        for m in &mut st.checkpoints {
            if let Err(e) = m.live.sync_journal() {
                warn!("keeping the edits: {e}");
            }
        }
    }

    /// The folder holding the sources, for statfs.
    pub fn backing_dir(&self) -> PathBuf {
        let st = self.read_state();
        match &st.folder {
            Some((f, _)) => f.path.clone(),
            None => st
                .checkpoints
                .first()
                .and_then(|m| Some(m.live.source().folder()?.path.clone()))
                .unwrap_or_else(|| Path::new("/").to_path_buf()),
        }
    }
}

/// How many made view files are kept (each holds its header and a list of
/// its tensors: a few MB for 50,000 tensors); others are made again.
const VIEWS_KEPT: usize = 16;

/// How long a prefetch request may run before it returns (the client asks
/// again for the rest): a FUSE request cannot be interrupted once the daemon
/// has it, so its caller is unkillable until it is answered.
pub const PREFETCH_SLICE: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests;
