//! The filesystem view of mounted checkpoints: inodes, names, attributes,
//! directory listings, file handles, and the policies of a mount (what fsync
//! does, when a commit happens, who may commit). Plain Rust that tests call
//! without a mount; `fuse.rs` is the thin adapter that turns kernel requests
//! into these calls.
//!
//! Inodes: 1 is the root, then the checkpoint directories and special files,
//! then `first_ino + STRIDE * (id * C + c) + slot` for the file of kind `slot`
//! (`TensorFile`) of id `id` of checkpoint `c` (C checkpoints). A data file's
//! id is its object's, a `.meta.json`'s is its name's entry: renames and
//! commits keep both, so the kernel's inodes stay valid.
//!
//! Locks, always taken in this order: the transactions' (one commit or discard at
//! a time), then `state`, then `handles`. Reads take `state` only to find an
//! object, and never while reading its bytes; no lock is held across disk I/O
//! of tensor bytes (copies into staging, commits) or fsync.

mod error;
pub mod files;
pub mod fuse;
pub mod ioctl;
pub mod names;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, SystemTime};

pub use error::FsError;
pub use files::TensorFile;
use names::{METADATA_FILE, NAME_MAX, VIEWS_DIR};
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

/// A source to mount: one checkpoint file, or a folder of shards.
// Built once per mount: the size of a variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    File(SourceFile),
    Folder {
        folder: Arc<crate::source::local::Folder>,
        stat: FileStat,
        /// (directory name, checkpoint), sorted by name.
        checkpoints: Vec<(String, SourceFile)>,
        indexes: Vec<IndexFile>,
    },
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
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            read_only: false,
            // SAFETY: getuid cannot fail.
            owner: unsafe { libc::getuid() },
            cache: CacheMode::Direct,
            release_after_read: false,
        }
    }
}

/// A file or directory, as an inode number decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    FolderRoot,
    CheckpointDir(usize),
    Metadata(usize),
    Index(usize),
    File(usize, Id, TensorFile),
    /// `__views__` or anything below it (`views`): the inode, which names
    /// its path in the table of view inodes.
    Views(Ino),
    /// A view that is checkpoint `c`'s source file byte for byte, served
    /// by kernel passthrough: an inode of its own for each source file
    /// (`WHOLE_BIT` and the file's inode number), as the kernel wants one
    /// backing file per inode while it is open.
    WholeView(usize),
}

const WHOLE_BIT: Ino = 1 << 62;

/// Inodes per tensor id and checkpoint: one per kind of its files.
const SLOTS: u64 = TensorFile::STRIDE;

/// A view as made for one state of its checkpoints (their versions summed),
/// or why it cannot be made (what a commit would refuse).
type CachedView = (u64, Result<Arc<GeneratedFile>, String>);

use crate::checkpoint::view::GeneratedFile;
use views::{Draws, Found, VIEW_BIT};

mod views;

/// Hashed file name stem -> tensor name.
type HashedNames = HashMap<String, String>;

/// A name in a checkpoint directory, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Name {
    Metadata,
    Tensor(TensorFile, String),
}

struct Mounted {
    /// The shard's file name without `.safetensors`.
    dir_name: String,
    live: Live,
    dir_ino: Ino,
}

impl Mounted {
    /// The name of the shard's directory in a folder mount: its file's, but
    /// `__views__` is `%5F_views__` (as for a tensor) so that `__views__`
    /// stays the views, and a shard already named `%5F_views__` (or that
    /// with `%25`s before it) gets one `%25` more, so no two shards share one.
    fn shown_name(&self) -> String {
        let name = self.dir_name.as_str();
        if name == VIEWS_DIR {
            return "%5F_views__".into();
        }
        let mut rest = name;
        while let Some(r) = rest.strip_prefix("%25") {
            rest = r;
        }
        match rest {
            "%5F_views__" => format!("%25{name}"),
            _ => name.into(),
        }
    }
}

struct State {
    checkpoints: Vec<Mounted>,
    indexes: Vec<(IndexFile, Ino)>,
    /// Node of each inode below `first_ino` (index = ino - 1).
    fixed: Vec<Node>,
    first_ino: Ino,
    /// The folder of a folder mount.
    folder: Option<(Arc<crate::source::local::Folder>, FileStat)>,
    /// Per checkpoint: its hashed file names, and the `Live::names_gen`
    /// they were made at.
    hashed: Mutex<HashMap<usize, (u64, HashedNames)>>,
    /// The inode of the passthrough views of each source file (device,
    /// inode number) seen: `WHOLE_BIT` and a count.
    whole_inos: Mutex<HashMap<(u64, u64), Ino>>,
    /// The inodes of `__views__` and everything below it.
    view_inos: Mutex<views::ViewInodes>,
}

/// An open `.meta.json`, `__metadata__.json` or index file: its text, shared
/// by every descriptor open on the same inode, and theirs alone once the name
/// is removed or replaced (as an unlinked file is on any filesystem).
/// Generated text is taken when the first descriptor opens it; what is
/// written is applied to the checkpoint when a descriptor open for writing
/// is flushed (an empty text only at its release), if this is still the file
/// at its name; text that does not parse is reported to the closer unless
/// another writer still has the file open (it may be half-written).
struct JsonFile {
    ino: Ino,
    /// Owner, mode and time, as `stat` showed them at open.
    attr: Attr,
    /// Its largest size: `MAX_META` for a meta, `MAX_JSON` otherwise.
    limit: usize,
    budget: Arc<JsonBudget>,
    content: Mutex<JsonContent>,
}

/// What all open JSON files may hold together: each may be 16 MiB, and a
/// caller with many descriptors must not grow the daemon without bound.
const JSON_BUDGET: usize = 64 << 20;

/// The bytes held by open JSON files.
#[derive(Default)]
struct JsonBudget(AtomicU64);

impl JsonBudget {
    fn take(&self, n: usize) -> Result<(), FsError> {
        let n = n as u64;
        self.0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                (held + n <= JSON_BUDGET as u64).then_some(held + n)
            })
            .map(drop)
            .map_err(|_| {
                FsError::NoSpace("open .meta.json and __metadata__.json files hold 64 MiB already")
            })
    }

    fn give(&self, n: usize) {
        self.0.fetch_sub(n as u64, Ordering::Relaxed);
    }
}

impl Drop for JsonFile {
    fn drop(&mut self) {
        let len = lock(&self.content).text.len();
        self.budget.give(len);
    }
}

struct JsonContent {
    text: Vec<u8>,
    /// Written or cut since last applied.
    dirty: bool,
    /// Ever written or cut through a descriptor: the text is the writers'.
    written: bool,
}

impl JsonFile {
    /// Sets the text's length (zeros past the end), within the file's limit
    /// (EFBIG) and what all open JSON files may hold (ENOSPC).
    fn resize(&self, content: &mut JsonContent, len: usize) -> Result<(), FsError> {
        if len > self.limit {
            return Err(EditError::TooLarge(self.limit).into());
        }
        let old = content.text.len();
        if len > old {
            self.budget.take(len - old)?;
        } else {
            self.budget.give(old - len);
        }
        content.text.resize(len, 0);
        content.dirty = true;
        content.written = true;
        Ok(())
    }

    fn attr(&self, nlink: u32) -> Attr {
        Attr {
            size: lock(&self.content).text.len() as u64,
            nlink,
            ..self.attr.clone()
        }
    }
}

/// What an open file handle refers to.
enum Handle {
    /// A data file: the object itself, so that the handle keeps reading it
    /// after an unlink or a rename, and sees every write.
    Data {
        ino: Ino,
        object: Arc<DataObject>,
        wrote: bool,
        /// CUDA buffers prefetched through this handle: freed when it closes.
        device: Vec<crate::prefetch::cuda::DeviceBuffer>,
    },
    /// A JSON file; `write`: opened for writing.
    Json { file: Arc<JsonFile>, write: bool },
    /// A view, as it was made when opened.
    View {
        ino: Ino,
        file: Arc<GeneratedFile>,
        _pins: Pins,
        /// A view served by passthrough: the daemon's read-only open of
        /// the source file (no in-place commit while it is open).
        _reader: Option<Arc<std::fs::File>>,
    },
}

/// The staging files a view's descriptor reads, pinned while it is open: a
/// later write into one of those tensors copies it to a new staging file
/// instead of changing the bytes under the descriptor.
struct Pins(Vec<Arc<crate::source::StagedFile>>);

impl Pins {
    fn of(file: &GeneratedFile) -> Pins {
        let staged = file.bytes().filter_map(|b| match b {
            crate::source::Bytes::Staged(s) => {
                s.pin();
                Some(s.clone())
            }
            _ => None,
        });
        Pins(staged.collect())
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        self.0.iter().for_each(|s| s.unpin());
    }
}

impl Handle {
    fn ino(&self) -> Ino {
        match self {
            Handle::Data { ino, .. } | Handle::View { ino, .. } => *ino,
            Handle::Json { file, .. } => file.ino,
        }
    }
}

#[derive(Default)]
struct Handles {
    open: HashMap<u64, Handle>,
    /// The JSON files open now, by inode: a second open of the same file
    /// shares the first one's.
    json: HashMap<Ino, std::sync::Weak<JsonFile>>,
}

pub struct Fs {
    settings: Settings,
    staging: Arc<Staging>,
    /// Commits and discards (taken before `state`).
    transactions: Transactions,
    state: RwLock<State>,
    handles: Mutex<Handles>,
    /// Views made, by (checkpoint or merged, cast): made again when a
    /// checkpoint's state moves (taken after `state`).
    views: Mutex<HashMap<String, CachedView>>,
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
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn file_mode(stat: &FileStat, read_only: bool) -> u16 {
    let mode = (stat.mode & 0o777) as u16;
    if read_only {
        mode & !0o222
    } else {
        mode
    }
}

/// A directory gets x where its file has r.
fn dir_mode(stat: &FileStat, read_only: bool) -> u16 {
    let mode = file_mode(stat, read_only);
    mode | ((mode & 0o444) >> 2)
}

impl State {
    /// Owner and mode for what draws on every checkpoint (a merged view, an
    /// index): only those who may read every source may read it.
    fn all_owners(&self) -> FileStat {
        let owners: Vec<FileStat> = self
            .checkpoints
            .iter()
            .map(|m| m.live.source().owner_now())
            .collect();
        crate::source::access::narrowest(&owners).expect("a mount has a checkpoint")
    }

    /// Owner and mode of index file `i` as they are now (narrowed by an ACL).
    fn index_owner(&self, i: usize) -> FileStat {
        let ix = &self.indexes[i].0;
        let now = self.folder.as_ref().and_then(|(folder, _)| {
            let flags = libc::O_RDONLY | libc::O_NONBLOCK;
            folder
                .open_file(std::ffi::OsStr::new(&ix.name), flags, 0)
                .ok()
        });
        let Some(file) = now else {
            return ix.stat;
        };
        let current = crate::source::access::owner_now(&file, &ix.stat);
        match FileStat::of(&file) {
            // Still the file whose bytes are shown.
            Ok(st) if (st.dev, st.ino) == (ix.stat.dev, ix.stat.ino) => current,
            // Replaced since: those bytes go to whoever may read both.
            _ => crate::source::access::narrowest(&[ix.stat, current]).expect("two"),
        }
    }

    /// Owner and mode of the mount's top folder as they are now.
    fn root_owner(&self) -> FileStat {
        match &self.folder {
            Some((folder, stat)) => folder.stat().map_or(*stat, |now| FileStat {
                mode: now.mode,
                uid: now.uid,
                gid: now.gid,
                ..*stat
            }),
            None => self.live(0).source().owner_now(),
        }
    }

    fn node(&self, ino: Ino) -> Result<Node, FsError> {
        if ino == 0 {
            return Err(FsError::NotFound);
        }
        if ino < self.first_ino {
            return Ok(self.fixed[(ino - 1) as usize]);
        }
        if ino & VIEW_BIT != 0 {
            let path = lock(&self.view_inos).path(ino).ok_or(FsError::NotFound)?;
            return match views::find(self, &path) {
                Some(_) => Ok(Node::Views(ino)),
                None => Err(FsError::NotFound),
            };
        }
        if ino & WHOLE_BIT != 0 {
            // (A source file replaced since: the kernel looks the name up again.)
            return self
                .checkpoints
                .iter()
                .position(|m| Some(ino) == self.whole_ino(m.live.source()))
                .map(Node::WholeView)
                .ok_or(FsError::Stale);
        }
        let rel = ino - self.first_ino;
        let k = rel / SLOTS;
        let count = self.checkpoints.len().max(1) as u64;
        let (c, id) = ((k % count) as usize, k / count);
        let live = &self.checkpoints.get(c).ok_or(FsError::NotFound)?.live;
        let kind = TensorFile::from_slot(rel % SLOTS).ok_or(FsError::NotFound)?;
        let exists = match kind {
            TensorFile::Data => live.object_len(id).is_some(),
            TensorFile::Meta if id == live.metadata_file() => {
                return match live.metadata_text() {
                    Some(_) => Ok(Node::Metadata(c)),
                    None => Err(FsError::NotFound),
                };
            }
            TensorFile::Meta => live.meta_file_owner(id).is_some(),
        };
        if !exists {
            return Err(FsError::NotFound);
        }
        Ok(Node::File(c, id, kind))
    }

    fn ino(&self, c: usize, id: Id, kind: TensorFile) -> Ino {
        let count = self.checkpoints.len().max(1) as u64;
        self.first_ino + SLOTS * (id * count + c as u64) + kind.slot()
    }

    fn ino_of(&self, node: Node) -> Ino {
        match node {
            Node::FolderRoot => ROOT_INO,
            Node::CheckpointDir(c) => self.checkpoints[c].dir_ino,
            Node::Metadata(c) => self.ino(c, self.live(c).metadata_file(), TensorFile::Meta),
            Node::Index(i) => self.indexes[i].1,
            Node::File(c, id, kind) => self.ino(c, id, kind),
            Node::Views(ino) => ino,
            Node::WholeView(c) => self
                .whole_ino(self.live(c).source())
                .expect("a local source"),
        }
    }

    /// Whether view inode `ino` is a folder now.
    fn is_view_folder(&self, ino: Ino) -> bool {
        self.view_path(ino)
            .is_ok_and(|p| matches!(views::find(self, &p), Some(Found::Folder(_))))
    }

    /// The path below `__views__` of view inode `ino`.
    fn view_path(&self, ino: Ino) -> Result<Arc<str>, FsError> {
        lock(&self.view_inos).path(ino).ok_or(FsError::NotFound)
    }

    /// The inode of `path` below `__views__`.
    fn view_ino(&self, path: &str) -> Ino {
        lock(&self.view_inos).ino(path)
    }

    /// The modification time of the views of checkpoint `target` (None: of
    /// all): the last change of their state or of their source files, so
    /// that `rsync`, `make` and `cp -u` see every edit.
    fn views_changed(&self, target: Option<usize>) -> SystemTime {
        let of = |m: &Mounted| {
            let source = m.live.source().modified();
            m.live.changed().map_or(source, |t| t.max(source))
        };
        match target {
            Some(c) => of(&self.checkpoints[c]),
            None => self
                .checkpoints
                .iter()
                .map(of)
                .max()
                .unwrap_or(SystemTime::UNIX_EPOCH),
        }
    }

    /// The inode of a view that is `source`'s file (None: a remote source).
    fn whole_ino(&self, source: &SourceFile) -> Option<Ino> {
        source.file()?;
        let key = (source.stat().dev, source.stat().ino);
        let mut inos = lock(&self.whole_inos);
        let next = WHOLE_BIT + inos.len() as Ino;
        Some(*inos.entry(key).or_insert(next))
    }

    /// Problems across the shards of a folder mount: two shards that are one
    /// file, and (with an index) tensors that are in two shards now.
    fn in_two_shards(&self) -> Vec<crate::checkpoint::Problem> {
        use crate::checkpoint::transaction::{in_two_shards, one_file_shards};
        let shards = || {
            self.checkpoints
                .iter()
                .map(|m| (format!("{}.safetensors", m.dir_name), &m.live))
        };
        let mut found = one_file_shards(shards());
        if !self.indexes.is_empty() {
            found.extend(in_two_shards(shards()));
        }
        found
    }

    fn live(&self, c: usize) -> &Live {
        &self.checkpoints[c].live
    }

    /// The checkpoint that lists `object` now (objects move between the
    /// checkpoints of a folder mount).
    fn home(&self, object: &DataObject) -> Option<usize> {
        let (serial, _) = object.home();
        self.checkpoints
            .iter()
            .position(|m| m.live.serial() == serial)
    }

    fn live_mut(&mut self, c: usize) -> &mut Live {
        &mut self.checkpoints[c].live
    }

    /// The entry whose `.meta.json` is file `id` (a `Node::File` of kind Meta).
    fn meta_entry(&self, c: usize, id: Id) -> Result<Id, FsError> {
        self.live(c).meta_file_owner(id).ok_or(FsError::NotFound)
    }

    /// The checkpoint a directory inode stands for.
    fn checkpoint_dir(&self, ino: Ino) -> Result<usize, FsError> {
        match self.node(ino)? {
            Node::CheckpointDir(c) => Ok(c),
            Node::FolderRoot => Err(FsError::NotPermitted(
                "the root of a folder mount holds one directory per shard: edit inside them",
            )),
            Node::Views(_) => Err(FsError::ReadOnly),
            _ => Err(FsError::NotADirectory),
        }
    }

    /// Decodes a file name of a checkpoint directory.
    fn decode(&self, c: usize, file_name: &str) -> Result<Name, FsError> {
        if file_name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        if file_name == METADATA_FILE {
            return Ok(Name::Metadata);
        }
        if file_name == VIEWS_DIR {
            // (At the top of a file mount, the read-only folder of views.)
            return Err(FsError::ReadOnly);
        }
        let invalid = || {
            FsError::Invalid(format!(
                "{file_name:?} is not a valid tensor file name (see \"Names\" in docs/SEMANTICS.md)"
            ))
        };
        let (kind, name) = TensorFile::parse(file_name).ok_or_else(invalid)?;
        let stem = &file_name[..file_name.len() - kind.suffix().len()];
        if names::maybe_hashed(stem) {
            if let Some(long) = self.hashed_name(c, stem) {
                return Ok(Name::Tensor(kind, long));
            }
        }
        Ok(Name::Tensor(kind, name.map_err(|_| invalid())?))
    }

    /// Hashed long names cannot be decoded: find the tensor whose file name
    /// it is, in a table of the hashed names made again when names change.
    fn hashed_name(&self, c: usize, stem: &str) -> Option<String> {
        let live = self.live(c);
        let mut tables = lock(&self.hashed);
        let (gen, table) = tables.entry(c).or_insert((u64::MAX, HashMap::new()));
        if *gen != live.names_gen() {
            *table = live
                .entries_from(0)
                .filter(|(_, e)| names::is_hashed(e.name))
                .map(|(_, e)| (names::tensor_file_name(e.name), e.name.to_string()))
                .collect();
            *gen = live.names_gen();
        }
        table.get(stem).cloned()
    }

    /// The node a decoded name stands for now, if it exists.
    fn find(&self, c: usize, name: &Name) -> Option<Node> {
        let live = self.live(c);
        match name {
            Name::Metadata => live.metadata_text().map(|_| Node::Metadata(c)),
            Name::Tensor(kind, tensor) => {
                let id = live.find(tensor)?;
                let e = live.entry(id)?;
                match kind {
                    TensorFile::Data => e.data.map(|d| Node::File(c, d, *kind)),
                    TensorFile::Meta => live.meta_file(id).map(|f| Node::File(c, f.id, *kind)),
                }
            }
        }
    }
}

impl Fs {
    pub fn new(source: Source, settings: Settings, staging: Arc<Staging>) -> Fs {
        let mut fixed = Vec::new();
        let (list, indexes, folder) = match source {
            Source::File(c) => (vec![(String::new(), c)], Vec::new(), None),
            Source::Folder {
                folder,
                stat,
                checkpoints,
                indexes,
            } => (checkpoints, indexes, Some((folder, stat))),
        };
        if folder.is_some() {
            fixed.push(Node::FolderRoot);
        }
        let alloc = |fixed: &mut Vec<Node>, node| {
            fixed.push(node);
            fixed.len() as Ino
        };
        let mut checkpoints = Vec::with_capacity(list.len());
        for (c, (dir_name, source)) in list.into_iter().enumerate() {
            source.set_release_after_read(settings.release_after_read);
            let dir_ino = alloc(&mut fixed, Node::CheckpointDir(c));
            checkpoints.push(Mounted {
                dir_name,
                live: Live::new(source, staging.clone()),
                dir_ino,
            });
        }
        let indexes: Vec<(IndexFile, Ino)> = indexes
            .into_iter()
            .enumerate()
            .map(|(i, ix)| (ix, alloc(&mut fixed, Node::Index(i))))
            .collect();
        Fs {
            settings,
            transactions: Transactions::new(staging.clone()),
            staging,
            state: RwLock::new(State {
                first_ino: fixed.len() as Ino + 1,
                checkpoints,
                indexes,
                fixed,
                folder,
                hashed: Mutex::new(HashMap::new()),
                whole_inos: Mutex::new(HashMap::new()),
                view_inos: Mutex::new(views::ViewInodes::new()),
            }),
            handles: Mutex::new(Handles::default()),
            views: Mutex::new(HashMap::new()),
            json_budget: Arc::default(),
            passthrough: Default::default(),
            looked_up: Default::default(),
            next_fh: AtomicU64::new(1),
            reads: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
        }
    }

    fn read_state(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_state(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
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

    /// Commit, discard, prefetch and status are for the user who mounted, and root.
    pub fn allowed(&self, caller: u32, what: &'static str) -> Result<(), FsError> {
        if caller == 0 || caller == self.settings.owner {
            Ok(())
        } else {
            Err(FsError::Denied(what))
        }
    }

    fn new_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.handles).open.insert(fh, h);
        fh
    }

    pub fn lookup(&self, parent: Ino, name: &str) -> Result<Attr, FsError> {
        let st = self.read_state();
        let node = match st.node(parent)? {
            Node::FolderRoot => {
                if name == VIEWS_DIR {
                    Node::Views(VIEW_BIT)
                } else if let Some(c) = st.checkpoints.iter().position(|m| m.shown_name() == name) {
                    Node::CheckpointDir(c)
                } else if let Some(i) = st.indexes.iter().position(|(ix, _)| ix.name == name) {
                    Node::Index(i)
                } else {
                    return Err(FsError::NotFound);
                }
            }
            Node::CheckpointDir(_) if name == VIEWS_DIR && st.folder.is_none() => {
                Node::Views(VIEW_BIT)
            }
            Node::Views(_) if name.len() > NAME_MAX => return Err(FsError::NameTooLong),
            Node::Views(dir) => {
                let parent = st.view_path(dir)?;
                if !matches!(views::find(&st, &parent), Some(Found::Folder(_))) {
                    return Err(FsError::NotADirectory);
                }
                let path = views::join(&parent, name);
                views::find(&st, &path).ok_or(FsError::NotFound)?;
                Node::Views(st.view_ino(&path))
            }
            Node::CheckpointDir(c) => match st.decode(c, name) {
                Ok(decoded) => st.find(c, &decoded).ok_or(FsError::NotFound)?,
                Err(FsError::NameTooLong) => return Err(FsError::NameTooLong),
                Err(_) => return Err(FsError::NotFound),
            },
            _ => return Err(FsError::NotADirectory),
        };
        let node = match node {
            Node::Views(ino) => self.whole_view(&st, ino).unwrap_or(node),
            node => node,
        };
        self.attr_of(&st, node)
    }

    /// Views can be served by kernel passthrough (the FUSE adapter says so
    /// when the kernel and the daemon's privileges allow it).
    pub fn set_passthrough(&self, on: bool) {
        self.passthrough.store(on, Ordering::Relaxed);
    }

    /// The node that serves a view which is a source file byte for byte, by
    /// passthrough (None: the view is generated, or passthrough is off).
    fn whole_view(&self, st: &State, ino: Ino) -> Option<Node> {
        if !self.passthrough.load(Ordering::Relaxed) {
            return None;
        }
        let path = st.view_path(ino).ok()?;
        if !matches!(views::find(st, &path), Some(Found::File(_))) {
            return None;
        }
        let file = self.view(st, &path).ok()?;
        let source = file.whole_source()?;
        let c = st
            .checkpoints
            .iter()
            .position(|m| Arc::ptr_eq(m.live.source(), source))?;
        let ino = st.whole_ino(source)?;
        lock(&self.looked_up).insert(ino, file.clone());
        Some(Node::WholeView(c))
    }

    /// A file removed or replaced while open still answers through its
    /// descriptors, with nlink 0 (`fstat` of an unlinked file; the kernel
    /// asks by inode, with or without `fh`). A JSON file being written
    /// shows its descriptors' text.
    pub fn getattr(&self, ino: Ino, fh: Option<u64>) -> Result<Attr, FsError> {
        let st = self.read_state();
        let node = st.node(ino);
        let handles = lock(&self.handles);
        // A view's descriptor reads the view as it opened it: its size too
        // (a reader that maps what fstat says must not fault past the end).
        if let (Ok(n), Some(Handle::View { ino: i, file, .. })) =
            (node.as_ref(), fh.and_then(|fh| handles.open.get(&fh)))
        {
            if *i == ino {
                let mut a = self.attr_of(&st, *n)?;
                a.size = file.len();
                return Ok(a);
            }
        }
        if let Ok(node) = node {
            let open = handles.json.get(&ino).and_then(std::sync::Weak::upgrade);
            return match open.filter(|f| lock(&f.content).written) {
                Some(f) => Ok(f.attr(1)),
                None => self.attr_of(&st, node),
            };
        }
        let given = fh.and_then(|fh| handles.open.get(&fh));
        let handle = given
            .filter(|h| h.ino() == ino)
            .or_else(|| handles.open.values().find(|h| h.ino() == ino));
        match handle {
            Some(Handle::Data { object, .. }) => {
                let c = st.home(object).unwrap_or(0);
                let mut a = self.object_attr(&st, c, object.state(), ino);
                a.nlink = 0;
                Ok(a)
            }
            Some(Handle::Json { file, .. }) => Ok(file.attr(0)),
            // A view served by passthrough whose source file was replaced
            // since: that file's attributes, gone from the mount.
            Some(Handle::View { file, .. }) => {
                let stat = match file.whole_source() {
                    Some(s) => *s.stat(),
                    None => *st.live(0).source().stat(),
                };
                Ok(Attr {
                    ino,
                    kind: Kind::File,
                    size: file.len(),
                    mtime: stat.modified(),
                    perm: file_mode(&stat, true),
                    nlink: 0,
                    uid: stat.uid,
                    gid: stat.gid,
                    volatile: true,
                })
            }
            None => Err(node.err().unwrap_or(FsError::NotFound)),
        }
    }

    fn object_attr(
        &self,
        st: &State,
        c: usize,
        o: crate::checkpoint::ObjectState,
        ino: Ino,
    ) -> Attr {
        let src = st.live(c).source();
        let owner = src.owner_now();
        Attr {
            ino,
            kind: Kind::File,
            size: o.bytes.len(),
            mtime: o.edited.unwrap_or_else(|| src.modified()),
            perm: file_mode(&owner, self.settings.read_only),
            nlink: 1,
            uid: owner.uid,
            gid: owner.gid,
            volatile: false,
        }
    }

    fn attr_of(&self, st: &State, node: Node) -> Result<Attr, FsError> {
        let ro = self.settings.read_only;
        let ino = st.ino_of(node);
        // Owner and mode as the sources have them now (`SourceFile::owner_now`).
        let of_stat = |owner: FileStat, kind, size, mtime, volatile| Attr {
            ino,
            kind,
            size,
            mtime,
            perm: if kind == Kind::Directory {
                dir_mode(&owner, ro)
            } else {
                file_mode(&owner, ro)
            },
            nlink: if kind == Kind::Directory { 2 } else { 1 },
            uid: owner.uid,
            gid: owner.gid,
            volatile,
        };
        let of_source = |c: usize, kind, size, mtime, volatile| {
            of_stat(st.live(c).source().owner_now(), kind, size, mtime, volatile)
        };
        Ok(match node {
            Node::FolderRoot => {
                let (_, stat) = st.folder.as_ref().expect("a folder mount");
                let now = st.root_owner();
                Attr {
                    ino,
                    kind: Kind::Directory,
                    size: 0,
                    mtime: stat.modified(),
                    perm: dir_mode(&now, ro) & !0o222,
                    nlink: 2 + st.checkpoints.len() as u32,
                    uid: now.uid,
                    gid: now.gid,
                    volatile: false,
                }
            }
            Node::CheckpointDir(c) => {
                of_source(c, Kind::Directory, 0, st.live(c).source().modified(), false)
            }
            Node::Index(i) => {
                let ix = &st.indexes[i].0;
                let size = ix.bytes.len() as u64;
                of_stat(
                    st.index_owner(i),
                    Kind::File,
                    size,
                    ix.stat.modified(),
                    true,
                )
                .read_only()
            }
            Node::Metadata(c) => {
                let size = st.live(c).metadata_text().map_or(0, |t| t.len() as u64);
                of_source(c, Kind::File, size, st.live(c).source().modified(), true)
            }
            Node::File(c, id, TensorFile::Data) => {
                let o = st.live(c).object(id).ok_or(FsError::NotFound)?;
                self.object_attr(st, c, o, ino)
            }
            // (The source file itself, whatever the views show now.)
            Node::WholeView(c) => {
                let src = st.live(c).source();
                of_source(c, Kind::File, src.stat().len, src.modified(), true).read_only()
            }
            Node::Views(ino) => {
                let path = st.view_path(ino)?;
                match views::find(st, &path).ok_or(FsError::NotFound)? {
                    // A shard's own folder (`npy/SHARD`) has its file's mode.
                    Found::Folder(Draws::Checkpoint(c)) => {
                        of_source(c, Kind::Directory, 0, st.live(c).source().modified(), false)
                    }
                    Found::Folder(_) => {
                        let mtime = st.live(0).source().modified();
                        of_stat(st.root_owner(), Kind::Directory, 0, mtime, false)
                    }
                    Found::File(draws) => {
                        let size = self.view(st, &path).map_or(0, |v| v.len());
                        match draws {
                            Draws::Checkpoint(c) => {
                                of_source(c, Kind::File, size, st.views_changed(Some(c)), true)
                            }
                            Draws::All => of_stat(
                                st.all_owners(),
                                Kind::File,
                                size,
                                st.views_changed(None),
                                true,
                            ),
                            // Its weight map names the tensors of every shard.
                            Draws::Index(i) => {
                                let owner = crate::source::access::narrowest(&[
                                    st.index_owner(i),
                                    st.all_owners(),
                                ])
                                .expect("two");
                                let mtime =
                                    st.indexes[i].0.stat.modified().max(st.views_changed(None));
                                of_stat(owner, Kind::File, size, mtime, true)
                            }
                        }
                    }
                }
                .read_only()
            }
            Node::File(c, file, TensorFile::Meta) => {
                let live = st.live(c);
                let id = st.meta_entry(c, file)?;
                let size = live.meta_text(id).map_or(0, |t| t.len() as u64);
                let mtime = live
                    .entry(id)
                    .and_then(|e| e.data)
                    .and_then(|d| live.object(d))
                    .and_then(|o| o.edited)
                    .unwrap_or_else(|| live.source().modified());
                of_source(c, Kind::File, size, mtime, true)
            }
        })
    }

    /// Directory entries after `offset` (0 to start), in a stable order: `.`,
    /// `..`, `__metadata__.json`, then each name's files by entry id (data
    /// file, then `.meta.json`). Offsets derive from ids, so a listing resumes
    /// correctly across edits.
    pub fn readdir(
        &self,
        ino: Ino,
        offset: u64,
        mut add: impl FnMut(DirEntry) -> bool,
    ) -> Result<(), FsError> {
        let st = self.read_state();
        let node = st.node(ino)?;
        let mut emit = |ino, kind, name: String, next_offset| {
            add(DirEntry {
                ino,
                kind,
                name,
                next_offset,
            })
        };
        if offset < 1 && emit(ino, Kind::Directory, ".".into(), 1) {
            return Ok(());
        }
        if offset < 2 && emit(ROOT_INO, Kind::Directory, "..".into(), 2) {
            return Ok(());
        }
        match node {
            Node::FolderRoot => {
                let dirs = st
                    .checkpoints
                    .iter()
                    .map(|m| (m.dir_ino, Kind::Directory, m.shown_name()));
                let files = st
                    .indexes
                    .iter()
                    .map(|(ix, ino)| (*ino, Kind::File, ix.name.clone()));
                // (`__views__` is reached by name, not listed: see CheckpointDir below.)
                for (k, (ino, kind, name)) in dirs.chain(files).enumerate() {
                    let next = 3 + k as u64;
                    if next > offset && emit(ino, kind, name, next) {
                        break;
                    }
                }
                Ok(())
            }
            Node::CheckpointDir(c) => {
                let m = &st.checkpoints[c];
                if offset < 3
                    && m.live.metadata_text().is_some()
                    && emit(
                        st.ino_of(Node::Metadata(c)),
                        Kind::File,
                        METADATA_FILE.into(),
                        3,
                    )
                {
                    return Ok(());
                }
                // `__views__` is reached by its name and not listed: a
                // recursive copy, backup or search of the mount would
                // otherwise compute four more checkpoints (docs/SEMANTICS.md, "Views").
                // File `slot` of id i lists at offset 4 + STRIDE*i + slot.
                let first = offset.saturating_sub(4) / TensorFile::STRIDE;
                for (id, e) in m.live.entries_from(first) {
                    for kind in TensorFile::ALL {
                        let next = 4 + TensorFile::STRIDE * id + kind.slot();
                        let file_id = match kind {
                            TensorFile::Data => e.data,
                            TensorFile::Meta => {
                                m.live.meta_file(id).filter(|f| f.listed).map(|f| f.id)
                            }
                        };
                        let Some(file_id) = file_id else { continue };
                        if next > offset
                            && emit(
                                st.ino(c, file_id, kind),
                                Kind::File,
                                kind.file_name(e.name),
                                next,
                            )
                        {
                            return Ok(());
                        }
                    }
                }
                Ok(())
            }
            Node::Views(dir) => {
                let parent = st.view_path(dir)?;
                if !matches!(views::find(&st, &parent), Some(Found::Folder(_))) {
                    return Err(FsError::NotADirectory);
                }
                for e in views::list(&st, &parent, offset) {
                    let kind = if e.folder {
                        Kind::Directory
                    } else {
                        Kind::File
                    };
                    let ino = st.view_ino(&views::join(&parent, &e.name));
                    if e.offset > offset && emit(ino, kind, e.name, e.offset) {
                        break;
                    }
                }
                Ok(())
            }
            _ => Err(FsError::NotADirectory),
        }
    }

    /// View file `path`, made once per state of the checkpoints it draws
    /// on; EINVAL (with what a commit would refuse) when that state is not
    /// a valid checkpoint.
    fn view(&self, st: &State, path: &str) -> Result<Arc<GeneratedFile>, FsError> {
        let Some(Found::File(draws)) = views::find(st, path) else {
            return Err(FsError::NotFound);
        };
        let version = views::version(st, draws);
        if let Some((v, made)) = lock(&self.views).get(path) {
            if *v == version {
                return made.clone().map_err(FsError::Invalid);
            }
        }
        let (made, keep) = views::make(st, path).ok_or(FsError::NotFound)?;
        let made = made.map(Arc::new);
        if let Err(why) = &made {
            warn!(view = path, "not a valid checkpoint now: {why}");
        }
        if keep {
            lock(&self.views).insert(path.to_string(), (version, made.clone()));
        }
        made.map_err(FsError::Invalid)
    }

    fn opened(&self, fh: u64, generated: bool) -> Opened {
        let direct = generated || self.settings.cache == CacheMode::Direct;
        Opened {
            fh,
            keep_cache: !direct,
            direct_io: direct,
            passthrough: None,
        }
    }

    /// A descriptor of a view, which reads it as it was when it opened; by
    /// passthrough to `reader` (the source file) if given.
    fn open_view(
        &self,
        ino: Ino,
        file: Arc<GeneratedFile>,
        reader: Option<Arc<std::fs::File>>,
    ) -> Opened {
        let fh = self.new_handle(Handle::View {
            ino,
            _pins: Pins::of(&file),
            file,
            _reader: reader.clone(),
        });
        Opened {
            passthrough: reader,
            ..self.opened(fh, true)
        }
    }

    /// The object of a data file, made shareable for a handle.
    fn object(&self, c: usize, id: Id) -> Result<Arc<DataObject>, FsError> {
        self.write_state()
            .live_mut(c)
            .object_arc(id)
            .ok_or(FsError::NotFound)
    }

    /// Opens a file. `write` is any write access; `truncate` is O_TRUNC.
    pub fn open(&self, ino: Ino, write: bool, truncate: bool) -> Result<Opened, FsError> {
        if write || truncate {
            self.writable()?;
        }
        let node = self.read_state().node(ino)?;
        match node {
            Node::FolderRoot | Node::CheckpointDir(_) => Err(FsError::IsADirectory),
            Node::Views(ino) if self.read_state().is_view_folder(ino) => Err(FsError::IsADirectory),
            Node::Views(_) | Node::WholeView(_) if write || truncate => Err(FsError::ReadOnly),
            Node::WholeView(c) => {
                // The daemon's own read-only open of the file comes first:
                // from then on no in-place commit can start (its write lease
                // wants no other reader), and one under way is waited for.
                // (No lock is held while it may wait.)
                let source = self.read_state().live(c).source().clone();
                let reader = Arc::new(source.reopen_read_only()?);
                let st = self.read_state();
                let source = st.live(c).source();
                let is_source =
                    |f: &GeneratedFile| f.whole_source().is_some_and(|s| Arc::ptr_eq(s, source));
                let file = match self.view(&st, &views::export_path(&st, c)) {
                    Ok(now) if is_source(&now) => now,
                    // An edit came between the lookup and this open: it gets
                    // the file the lookup saw, if the file is still exactly
                    // that; else the kernel looks the name up again (ESTALE).
                    _ => lock(&self.looked_up)
                        .get(&ino)
                        .filter(|f| is_source(f))
                        .cloned()
                        .ok_or(FsError::Stale)?,
                };
                drop(st);
                Ok(self.open_view(ino, file, Some(reader)))
            }
            Node::Views(_) => {
                let st = self.read_state();
                let file = self.view(&st, &st.view_path(ino)?)?;
                drop(st);
                Ok(self.open_view(ino, file, None))
            }
            Node::Index(_) if write || truncate => Err(FsError::NotPermitted(
                "index files are rewritten by commits, not edited",
            )),
            Node::File(c, id, TensorFile::Data) => {
                let object = self.object(c, id)?;
                if truncate {
                    self.truncate_object(&object, 0)?;
                }
                let fh = self.new_handle(Handle::Data {
                    ino,
                    object,
                    wrote: truncate,
                    device: Vec::new(),
                });
                Ok(self.opened(fh, false))
            }
            Node::Index(_) | Node::Metadata(_) | Node::File(_, _, TensorFile::Meta) => {
                self.open_json(ino, node, write || truncate, truncate)
            }
        }
    }

    /// Opens a JSON file: the one open already on this inode, unless its
    /// generated text is out of date, else a new one with the text now.
    fn open_json(
        &self,
        ino: Ino,
        node: Node,
        write: bool,
        truncate: bool,
    ) -> Result<Opened, FsError> {
        let (attr, text) = {
            let st = self.read_state();
            (self.attr_of(&st, node)?, state_text(&st, node)?)
        };
        let limit = match node {
            Node::File(..) => MAX_META,
            _ => MAX_JSON,
        };
        let mut handles = lock(&self.handles);
        let open = handles.json.get(&ino).and_then(std::sync::Weak::upgrade);
        let file = match open.filter(|f| {
            let content = lock(&f.content);
            content.written || content.text == text
        }) {
            Some(file) => file,
            None => {
                self.json_budget.take(text.len())?;
                let file = Arc::new(JsonFile {
                    ino,
                    attr,
                    limit,
                    budget: self.json_budget.clone(),
                    content: Mutex::new(JsonContent {
                        text,
                        dirty: false,
                        written: false,
                    }),
                });
                handles.json.insert(ino, Arc::downgrade(&file));
                file
            }
        };
        if truncate {
            file.resize(&mut lock(&file.content), 0)?;
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        handles.open.insert(fh, Handle::Json { file, write });
        Ok(self.opened(fh, true))
    }

    fn truncate_object(&self, object: &Arc<DataObject>, len: u64) -> Result<(), FsError> {
        let moved = object.truncate(&self.staging, len)?;
        self.note_write(object, moved);
        Ok(())
    }

    /// After a data write: the checkpoint listing the object learns it has
    /// edits, and its journal where the bytes are if they moved.
    fn note_write(&self, object: &Arc<DataObject>, moved: bool) {
        if !moved {
            let st = self.read_state();
            let home = st.home(object);
            if let Some(c) = home {
                st.live(c).touch();
            }
            if home.is_none_or(|c| st.live(c).is_dirty()) {
                return;
            }
        }
        let mut st = self.write_state();
        if let Some(c) = st.home(object) {
            st.live_mut(c).object_written(object, moved);
        }
    }

    /// Creates (or opens, unless `exclusive`) a file in a checkpoint directory.
    pub fn create(
        &self,
        parent: Ino,
        name: &str,
        truncate: bool,
        exclusive: bool,
    ) -> Result<(Attr, Opened), FsError> {
        self.writable()?;
        let ino = {
            let mut st = self.write_state();
            let c = st.checkpoint_dir(parent)?;
            let decoded = st.decode(c, name)?;
            let existing = st.find(c, &decoded);
            if existing.is_some() && exclusive {
                return Err(FsError::Exists);
            }
            let node = match (existing, &decoded) {
                (Some(node), _) => node,
                (None, Name::Metadata) => {
                    st.live_mut(c).create_metadata();
                    Node::Metadata(c)
                }
                (None, Name::Tensor(TensorFile::Data, tensor)) => {
                    if tensor == crate::checkpoint::RESERVED {
                        return Err(FsError::Invalid(format!(
                            "{name:?}: a tensor cannot be named __metadata__"
                        )));
                    }
                    if names::is_hashed(tensor) {
                        return Err(FsError::Invalid(format!(
                            "{name:?}: a tensor name this long cannot be created through the mount"
                        )));
                    }
                    let (id, _) = st.live_mut(c).create_data(tensor)?;
                    info!(tensor = %tensor, "created");
                    Node::File(c, id, TensorFile::Data)
                }
                (None, Name::Tensor(TensorFile::Meta, tensor)) => {
                    let live = st.live_mut(c);
                    let id = live.create_meta(tensor);
                    let file = live.meta_file(id).ok_or(FsError::NotFound)?;
                    Node::File(c, file.id, TensorFile::Meta)
                }
            };
            st.ino_of(node)
        };
        let opened = self.open(ino, true, truncate)?;
        Ok((self.getattr(ino, Some(opened.fh))?, opened))
    }

    /// Applies JSON written through a handle: on flush (if anything was
    /// written: a shell's `>` closes a duplicate descriptor first) and on the
    /// last close. What does not parse is kept as written, and reported.
    fn apply_json(&self, fh: u64, last_close: bool) -> Result<(), FsError> {
        let (ino, text, others) = {
            let handles = lock(&self.handles);
            let Some(Handle::Json { file, write: true }) = handles.open.get(&fh) else {
                return Ok(());
            };
            // Another writer has it open: its text may not be final yet.
            let others = handles.open.iter().any(|(other, h)| {
                *other != fh
                    && matches!(h, Handle::Json { file: f, write: true } if Arc::ptr_eq(f, file))
            });
            let mut content = lock(&file.content);
            if !content.dirty || (!last_close && content.text.is_empty()) {
                return Ok(());
            }
            content.dirty = false;
            (file.ino, content.text.clone(), others)
        };
        let (c, file_name, kept_invalid) = {
            let mut st = self.write_state();
            match st.node(ino) {
                Ok(Node::File(c, file, TensorFile::Meta)) => {
                    let id = st.meta_entry(c, file)?;
                    let live = st.live_mut(c);
                    let name = live.entry_name(id).ok_or(FsError::NotFound)?;
                    let kept_invalid = live.set_meta(&name, &text, false)?;
                    (c, TensorFile::Meta.file_name(&name), kept_invalid)
                }
                Ok(Node::Metadata(c)) => {
                    let kept_invalid = st.live_mut(c).set_metadata(&text, false)?;
                    (c, METADATA_FILE.to_string(), kept_invalid)
                }
                _ => {
                    // Removed or replaced since it was opened: what was
                    // written stays with the descriptors, as on any filesystem.
                    info!(
                        ino,
                        "a JSON file written after its name was removed or replaced: not applied"
                    );
                    return Ok(());
                }
            }
        };
        self.sync_journal(c)?;
        match kept_invalid {
            None => Ok(()),
            // Not this closer's to report: the other writer's close says.
            Some(_) if others => Ok(()),
            Some(why) => {
                warn!(
                    file = file_name,
                    "kept as written, but a commit will refuse it: {why}"
                );
                Err(FsError::Invalid(format!("{file_name}: {why}")))
            }
        }
    }

    /// Makes the journal of checkpoint `c` durable, fsyncing outside the lock.
    fn sync_journal(&self, c: usize) -> Result<(), FsError> {
        Ok(crate::checkpoint::transaction::sync_journal(
            &self.state,
            c,
        )?)
    }

    /// Makes what went through a handle durable: its staging file and the journal.
    fn make_durable(&self, fh: u64) -> Result<(), FsError> {
        let object = match lock(&self.handles).open.get(&fh) {
            Some(Handle::Data {
                object,
                wrote: true,
                ..
            }) => object.clone(),
            _ => return Ok(()),
        };
        object.sync()?;
        let home = self.read_state().home(&object);
        match home {
            Some(c) => self.sync_journal(c),
            None => Ok(()), // removed meanwhile: nothing to journal
        }
    }

    /// `close` (every close of a descriptor): applies JSON, makes edits durable.
    pub fn flush(&self, fh: u64) -> Result<(), FsError> {
        self.apply_json(fh, false)?;
        self.make_durable(fh)
    }

    pub fn release(&self, fh: u64) -> Result<(), FsError> {
        let result = self
            .apply_json(fh, true)
            .and_then(|()| self.make_durable(fh));
        let mut handles = lock(&self.handles);
        if let Some(Handle::Json { file, .. }) = handles.open.remove(&fh) {
            let ino = file.ino;
            drop(file);
            if handles
                .json
                .get(&ino)
                .is_some_and(|w| w.strong_count() == 0)
            {
                handles.json.remove(&ino);
            }
        }
        drop(handles);
        if let Err(e) = &result {
            warn!("closing a file: {e}");
        }
        result
    }

    /// fsync makes the edits durable (staging file and journal). It does not
    /// commit: `stfs commit`, `stfs umount` and unmounting do.
    pub fn fsync(&self, fh: Option<u64>) -> Result<(), FsError> {
        match fh {
            Some(fh) => {
                self.apply_json(fh, false)?;
                self.make_durable(fh)
            }
            None => {
                let count = self.read_state().checkpoints.len();
                (0..count).try_for_each(|c| self.sync_journal(c))
            }
        }
    }

    /// Serves `size` bytes at `offset`: tensor bytes through the open
    /// handle's object (no lock held while reading), generated files from the
    /// state. `reply` gets the bytes as one or more slices.
    pub fn read<R>(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        size: u32,
        reply: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, FsError> {
        let object = match lock(&self.handles).open.get(&fh) {
            Some(Handle::Data { object, .. }) => Some(object.bytes()),
            Some(Handle::Json { file, .. }) => {
                let content = lock(&file.content);
                return Ok(reply(&[slice_at(&content.text, offset, size)]));
            }
            Some(Handle::View { file, .. }) => {
                let file = file.clone();
                return read_view(&file, offset, size, reply);
            }
            None => None,
        };
        let bytes = match object {
            Some(b) => b,
            None => {
                let st = self.read_state();
                let text = match st.node(ino)? {
                    Node::FolderRoot | Node::CheckpointDir(_) => return Err(FsError::IsADirectory),
                    Node::Views(v) if st.is_view_folder(v) => return Err(FsError::IsADirectory),
                    Node::Views(v) => {
                        let file = self.view(&st, &st.view_path(v)?)?;
                        drop(st);
                        return read_view(&file, offset, size, reply);
                    }
                    Node::Index(i) => {
                        return Ok(reply(&[slice_at(&st.indexes[i].0.bytes, offset, size)]))
                    }
                    Node::WholeView(c) => {
                        let file = self.view(&st, &views::export_path(&st, c))?;
                        drop(st);
                        return read_view(&file, offset, size, reply);
                    }
                    Node::Metadata(c) => st.live(c).metadata_text(),
                    Node::File(c, file, TensorFile::Meta) => {
                        st.live(c).meta_text(st.meta_entry(c, file)?)
                    }
                    Node::File(c, id, TensorFile::Data) => {
                        let bytes = st.live(c).object(id).ok_or(FsError::NotFound)?.bytes;
                        drop(st);
                        return Ok(bytes.read(offset, size, |b| reply(&[b]))?);
                    }
                };
                let text = text.unwrap_or_default();
                return Ok(reply(&[slice_at(&text, offset, size)]));
            }
        };
        Ok(bytes.read(offset, size, |b| {
            self.reads.fetch_add(1, Ordering::Relaxed);
            self.read_bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
            reply(&[b])
        })?)
    }

    pub fn write(&self, ino: Ino, fh: u64, offset: u64, data: &[u8]) -> Result<u32, FsError> {
        self.writable()?;
        let target = {
            let mut handles = lock(&self.handles);
            match handles.open.get_mut(&fh) {
                Some(Handle::Json { file, .. }) => {
                    let end = offset
                        .checked_add(data.len() as u64)
                        .filter(|&e| e <= file.limit as u64)
                        .ok_or(EditError::TooLarge(file.limit))?
                        as usize;
                    let mut content = lock(&file.content);
                    if content.text.len() < end {
                        file.resize(&mut content, end)?;
                    }
                    content.text[offset as usize..end].copy_from_slice(data);
                    content.dirty = true;
                    content.written = true;
                    return Ok(data.len() as u32);
                }
                Some(Handle::Data { object, wrote, .. }) => {
                    *wrote = true;
                    object.clone()
                }
                Some(Handle::View { .. }) => return Err(FsError::ReadOnly),
                None => {
                    let _ = ino;
                    return Err(FsError::Invalid(
                        "write without an open write handle".into(),
                    ));
                }
            }
        };
        let object = target;
        let moved = object.write(&self.staging, offset, data)?;
        self.note_write(&object, moved);
        Ok(data.len() as u32)
    }

    /// `truncate` / `ftruncate`.
    pub fn set_size(&self, ino: Ino, fh: Option<u64>, size: u64) -> Result<Attr, FsError> {
        self.writable()?;
        if let Some(fh) = fh {
            let mut handles = lock(&self.handles);
            match handles.open.get_mut(&fh) {
                Some(Handle::Json { file, .. }) => {
                    let len = usize::try_from(size).unwrap_or(usize::MAX);
                    file.resize(&mut lock(&file.content), len)?;
                    drop(handles);
                    return self.getattr(ino, Some(fh));
                }
                Some(Handle::Data { object, .. }) => {
                    let object = object.clone();
                    drop(handles);
                    self.truncate_object(&object, size)?;
                    return self.getattr(ino, Some(fh));
                }
                Some(Handle::View { .. }) => return Err(FsError::ReadOnly),
                None => {}
            }
        }
        let node = self.read_state().node(ino)?;
        match node {
            Node::File(c, id, TensorFile::Data) => {
                let object = self.object(c, id)?;
                self.truncate_object(&object, size)?;
            }
            Node::FolderRoot | Node::CheckpointDir(_) => return Err(FsError::IsADirectory),
            Node::Views(v) if self.read_state().is_view_folder(v) => {
                return Err(FsError::IsADirectory)
            }
            Node::Views(_) | Node::WholeView(_) => return Err(FsError::ReadOnly),
            Node::Index(_) => {
                return Err(FsError::NotPermitted(
                    "index files are rewritten by commits, not edited",
                ))
            }
            // A JSON file cut by path: as if opened, cut and closed.
            Node::File(_, _, TensorFile::Meta) | Node::Metadata(_) => {
                let opened = self.open(ino, true, false)?;
                let cut = self.set_size(ino, Some(opened.fh), size);
                self.release(opened.fh)?;
                return cut;
            }
        }
        self.getattr(ino, fh)
    }

    pub fn unlink(&self, parent: Ino, name: &str) -> Result<(), FsError> {
        self.writable()?;
        let mut st = self.write_state();
        let c =
            match st.node(parent)? {
                Node::CheckpointDir(c) => c,
                Node::FolderRoot => return Err(FsError::NotPermitted(
                    "the root of a folder mount holds one directory per shard: edit inside them",
                )),
                Node::Views(_) => return Err(FsError::ReadOnly),
                _ => return Err(FsError::NotADirectory),
            };
        let decoded = match st.decode(c, name) {
            Err(FsError::ReadOnly) => return Err(FsError::ReadOnly),
            d => d.map_err(|_| FsError::NotFound)?,
        };
        if st.find(c, &decoded).is_none() {
            return Err(FsError::NotFound);
        }
        let live = st.live_mut(c);
        match &decoded {
            Name::Metadata => live.remove_metadata(),
            Name::Tensor(TensorFile::Data, tensor) => live.unlink_data(tensor)?,
            Name::Tensor(TensorFile::Meta, tensor) => live.unlink_meta(tensor)?,
        }
        info!(file = name, "removed");
        Ok(())
    }

    /// `rename`: the file model of docs/SEMANTICS.md. A data file moved onto a
    /// data name brings its name's meta if it has one (else the target keeps
    /// its own); any file moved onto a `.meta.json` or `__metadata__.json`
    /// gives it its content as JSON (EINVAL, and nothing changes, if it does
    /// not parse); a JSON file moved onto a data name becomes a plain file.
    pub fn rename(
        &self,
        parent: Ino,
        name: &str,
        new_parent: Ino,
        new_name: &str,
        no_replace: bool,
    ) -> Result<(), FsError> {
        self.writable()?;
        let mut st = self.write_state();
        let c = st.checkpoint_dir(parent)?;
        let nc = st.checkpoint_dir(new_parent)?;
        let from = st.decode(c, name)?;
        let to = st.decode(nc, new_name)?;
        let from_node = st.find(c, &from).ok_or(FsError::NotFound)?;
        let to_node = st.find(nc, &to);
        if to_node == Some(from_node) && c == nc {
            return Ok(());
        }
        if no_replace && to_node.is_some() {
            return Err(FsError::Exists);
        }
        // Journaled whole: one line per checkpoint, the target's first (a
        // crash between two checkpoints' lines leaves a copy, never a loss).
        st.live_mut(c).begin_batch();
        let result = self.rename_parts(&mut st, (c, name, &from, from_node), (nc, new_name, &to));
        st.live_mut(c).end_batch();
        result?;
        info!(from = name, to = new_name, "renamed");
        Ok(())
    }

    /// The parts of `rename` that change the state (see `rename`).
    fn rename_parts(
        &self,
        st: &mut State,
        (c, name, from, from_node): (usize, &str, &Name, Node),
        (nc, new_name, to): (usize, &str, &Name),
    ) -> Result<(), FsError> {
        let to_node = st.find(nc, to);
        match to {
            Name::Tensor(TensorFile::Data, target) => {
                if target == crate::checkpoint::RESERVED {
                    return Err(FsError::Invalid(format!(
                        "{new_name:?}: a tensor cannot be named __metadata__"
                    )));
                }
                if names::is_hashed(target) && to_node.is_none() {
                    return Err(FsError::Invalid(format!(
                        "{new_name:?}: a tensor name this long cannot be created through the mount"
                    )));
                }
                let taken = match from {
                    Name::Tensor(TensorFile::Data, source) => {
                        st.live_mut(c).take_data(source, true)?
                    }
                    Name::Tensor(TensorFile::Meta, source) => {
                        let text = self.json_text(st, from_node)?;
                        let live = st.live_mut(c);
                        let object = live.staged_object(&text)?;
                        live.unlink_meta(source)?;
                        object
                    }
                    Name::Metadata => {
                        let text = self.json_text(st, from_node)?;
                        let live = st.live_mut(c);
                        let object = live.staged_object(&text)?;
                        live.remove_metadata();
                        object
                    }
                };
                st.live_mut(nc).put_data(target, taken, c == nc);
            }
            Name::Tensor(TensorFile::Meta, _) | Name::Metadata => {
                let text = match from {
                    Name::Tensor(TensorFile::Data, _) => {
                        let Node::File(_, id, _) = from_node else {
                            unreachable!()
                        };
                        let bytes = st.live(c).object(id).ok_or(FsError::NotFound)?.bytes;
                        let limit = match to {
                            Name::Metadata => MAX_JSON,
                            _ => MAX_META,
                        };
                        if bytes.len() > limit as u64 {
                            return Err(EditError::TooLarge(limit).into());
                        }
                        bytes.to_vec()?
                    }
                    _ => self.json_text(st, from_node)?,
                };
                let bad = match to {
                    Name::Metadata => crate::checkpoint::meta::parse_metadata(&text).err(),
                    _ => match crate::checkpoint::Meta::parse(&text) {
                        crate::checkpoint::Meta::Invalid { error, .. } => Some(error),
                        _ => None,
                    },
                };
                if let Some(why) = bad {
                    return Err(FsError::Invalid(format!(
                        "{name:?} cannot become {new_name:?}: {why}"
                    )));
                }
                {
                    let live = st.live_mut(c);
                    match from {
                        Name::Tensor(TensorFile::Data, source) => live.unlink_data(source)?,
                        Name::Tensor(TensorFile::Meta, source) => live.unlink_meta(source)?,
                        Name::Metadata => live.remove_metadata(),
                    }
                }
                let live = st.live_mut(nc);
                match to {
                    Name::Tensor(_, target) => {
                        live.set_meta(target, &text, true)?;
                    }
                    Name::Metadata => {
                        live.set_metadata(&text, true)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// What a reader of JSON file `node` gets now: the text of the file open
    /// on it if a descriptor wrote it, else the state's.
    fn json_text(&self, st: &State, node: Node) -> Result<Vec<u8>, FsError> {
        let ino = st.ino_of(node);
        let open = lock(&self.handles)
            .json
            .get(&ino)
            .and_then(std::sync::Weak::upgrade);
        if let Some(file) = open {
            let content = lock(&file.content);
            if content.written {
                return Ok(content.text.clone());
            }
        }
        state_text(st, node)
    }

    /// Commits every checkpoint of the mount, all or none
    /// (`checkpoint::transaction`). Returns a line per file.
    pub fn commit(&self, options: CommitOptions, caller: u32) -> Result<Vec<String>, FsError> {
        self.allowed(caller, "commit")?;
        let held = |st: &State| self.held_bytes(st);
        let done = self.transactions.commit(&self.state, &held, options);
        // Views looked up before are of source files a commit may have
        // replaced: do not keep those open and mapped.
        let st = self.read_state();
        lock(&self.looked_up).retain(|_, f| {
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
        let mut held: Vec<crate::source::Bytes> = lock(&self.handles)
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

    /// Whether any checkpoint has staged edits.
    pub fn is_dirty(&self) -> bool {
        self.read_state()
            .checkpoints
            .iter()
            .any(|m| m.live.is_dirty())
    }

    /// Drops every staged edit. Tensors whose bytes were not edited keep their inodes.
    /// Returns a line per file, as `commit` does.
    pub fn discard(&self, caller: u32) -> Result<Vec<String>, FsError> {
        self.allowed(caller, "discard")?;
        Ok(self.transactions.discard(&self.state)?)
    }

    /// `stfs status`: staged changes and problems, one line each; true when a
    /// commit would be refused.
    pub fn status(&self) -> (String, bool) {
        let st = self.read_state();
        let held = self.held_bytes(&st);
        let mut out = String::new();
        let mut refused = false;
        if let Some(why) = self.tainted() {
            refused = true;
            out.push_str(&format!("{}\n", CommitError::Tainted { why }));
        }
        for m in &st.checkpoints {
            let s = m.live.status();
            refused |= !s.problems.is_empty();
            let head = match (s.changes.len(), s.problems.len()) {
                (0, 0) => "no changes".to_string(),
                (n, 0) => format!("{n} change{} staged", plural(n)),
                (n, p) => format!(
                    "{n} change{} staged, {p} problem{} (a commit would refuse)",
                    plural(n),
                    plural(p)
                ),
            };
            out.push_str(&format!("{}: {head}\n", s.file.display()));
            if m.live
                .source()
                .remote_object()
                .is_some_and(|r| r.replaced())
            {
                out.push_str(
                    "  replaced   the object changed behind the mount: its reads fail (EIO); mount it again\n",
                );
            }
            for line in &s.changes {
                out.push_str(&format!("  {line}\n"));
            }
            for p in &s.problems {
                out.push_str(&format!("  problem    {p}\n"));
            }
            if let Some(way) = m
                .live
                .commit_preview(&held)
                .filter(|_| !s.changes.is_empty())
            {
                out.push_str(&format!("  commit     {way}\n"));
            }
        }
        let across = st.in_two_shards();
        if let (Some((folder, _)), false) = (&st.folder, across.is_empty()) {
            refused = true;
            let n = across.len();
            out.push_str(&format!(
                "{}: {n} problem{} across shards (a commit would refuse)\n",
                folder.path.display(),
                plural(n)
            ));
            for p in across {
                out.push_str(&format!("  problem    {p}\n"));
            }
        }
        out.push_str(&format!(
            "served {} read{} of tensor bytes ({} bytes) since mounted\n",
            self.reads.load(Ordering::Relaxed),
            plural(self.reads.load(Ordering::Relaxed) as usize),
            self.read_bytes.load(Ordering::Relaxed)
        ));
        // The shards of a remote folder share one connection and cache.
        if let Some(remote) = st
            .checkpoints
            .first()
            .and_then(|m| m.live.source().remote_object())
        {
            out.push_str(&format!("{}\n", remote.remote().summary()));
        }
        (out, refused)
    }

    /// Prefetches the tensor of an open data file; a CUDA buffer lives until
    /// the handle closes. Stops early (returning where) when `keep_going` says so.
    pub fn prefetch(
        &self,
        ino: Ino,
        fh: u64,
        req: PrefetchRequest,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<Prefetched, FsError> {
        let PrefetchRequest {
            target,
            offset,
            len,
            caller,
        } = req;
        self.allowed(caller, "prefetch")?;
        let object = match lock(&self.handles).open.get(&fh) {
            Some(Handle::Data { object, .. }) => Some(object.clone()),
            _ => None,
        };
        // (The handles' lock is released here: the state comes first in the lock order.)
        let Some(object) = object else {
            return match self.read_state().node(ino)? {
                Node::File(_, _, TensorFile::Data) => Err(FsError::Invalid(
                    "prefetch needs an open tensor file".into(),
                )),
                _ => Err(FsError::NotATensor),
            };
        };
        let (dtype, shape) = {
            let st = self.read_state();
            let meta = st.home(&object).and_then(|c| {
                st.live(c)
                    .entry(object.home().1)
                    .filter(|e| e.data.is_some())
                    .map(|e| e.meta.to_owned())
            });
            match meta {
                Some(crate::checkpoint::Meta::Valid { dtype, shape }) => (Some(dtype), Some(shape)),
                _ => (None, None),
            }
        };
        let bytes = object.bytes();
        let nbytes = bytes.len();
        let mut done = Prefetched {
            bytes: 0,
            nbytes,
            next: nbytes,
            dtype,
            shape,
            ipc: None,
        };
        let Some(backing) = bytes.backing()? else {
            return Ok(done);
        };
        match target {
            PrefetchTarget::PageCache => {
                let start = offset.min(nbytes);
                let end = match len {
                    0 => nbytes,
                    n => start.saturating_add(n).min(nbytes),
                };
                let (reached, resident) =
                    crate::prefetch::to_page_cache(&backing, start, end, keep_going)?;
                done.next = reached;
                done.bytes = resident;
            }
            PrefetchTarget::Cuda(device) => {
                let buffer = crate::prefetch::cuda::to_device(device, &backing, keep_going)?;
                done.bytes = nbytes;
                done.ipc = Some((buffer.ipc_handle, buffer.len() as u64));
                if let Some(Handle::Data { device, .. }) = lock(&self.handles).open.get_mut(&fh) {
                    device.push(buffer);
                }
            }
        }
        Ok(done)
    }

    /// Commit nothing of this mount from now on (its edits stay on disk for
    /// the next mount), saying why.
    pub fn taint(&self, why: String) {
        self.transactions.taint(why)
    }

    pub fn tainted(&self) -> Option<String> {
        self.transactions.tainted()
    }

    /// The unmount's policy: commit what is staged; if that cannot be done,
    /// keep the edits on disk (staging files and journal) for the next mount.
    /// Returns what happened, for the log.
    pub fn unmount(&self) -> Result<(), String> {
        let result = if !self.is_dirty() {
            Ok(())
        } else if let Some(why) = self.tainted() {
            Err(CommitError::Tainted { why }.to_string())
        } else {
            self.commit(CommitOptions::default(), self.settings.owner)
                .map(|lines| lines.iter().for_each(|l| info!("at unmount: {l}")))
                .map_err(|e| e.to_string())
        };
        match &result {
            Ok(()) if !self.is_dirty() => self.staging.remove(),
            _ => self.keep_edits(),
        }
        result.map_err(|e| {
            format!(
                "commit at unmount failed: {e}. The source is unchanged; the staged edits are kept in {} \
                 and the next `stfs mount` of this source takes them back (`stfs status` then lists them)",
                self.staging
                    .current()
                    .map_or("(no staging folder)".into(), |d| d.path().display().to_string())
            )
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

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

impl Shards for State {
    fn count(&self) -> usize {
        self.checkpoints.len()
    }

    fn live(&self, c: usize) -> &Live {
        &self.checkpoints[c].live
    }

    fn live_mut(&mut self, c: usize) -> &mut Live {
        &mut self.checkpoints[c].live
    }

    fn shard_name(&self, c: usize) -> &str {
        &self.checkpoints[c].dir_name
    }

    fn folder(&self) -> Option<&Arc<crate::source::local::Folder>> {
        self.folder.as_ref().map(|(f, _)| f)
    }

    fn indexes(&self) -> Box<dyn Iterator<Item = &IndexFile> + '_> {
        Box::new(self.indexes.iter().map(|(ix, _)| ix))
    }

    fn index_mut(&mut self, name: &str) -> Option<&mut IndexFile> {
        self.indexes
            .iter_mut()
            .map(|(ix, _)| ix)
            .find(|ix| ix.name == name)
    }
}

/// Serves `size` bytes of a view at `offset` (computed now).
fn read_view<R>(
    file: &GeneratedFile,
    offset: u64,
    size: u32,
    reply: impl FnOnce(&[&[u8]]) -> R,
) -> Result<R, FsError> {
    Ok(file.read(offset, size, reply)?)
}

/// The text of a JSON file as the state has it.
fn state_text(st: &State, node: Node) -> Result<Vec<u8>, FsError> {
    Ok(match node {
        Node::Index(i) => st.indexes[i].0.bytes.clone(),
        Node::Metadata(c) => st.live(c).metadata_text().unwrap_or_default(),
        Node::File(c, file, TensorFile::Meta) => {
            let id = st.meta_entry(c, file)?;
            st.live(c).meta_text(id).unwrap_or_default()
        }
        _ => return Err(FsError::IsADirectory),
    })
}

fn slice_at(data: &[u8], offset: u64, size: u32) -> &[u8] {
    let start = offset.min(data.len() as u64) as usize;
    let end = (start as u64 + size as u64).min(data.len() as u64) as usize;
    &data[start..end]
}

/// How long a prefetch request may run before it returns (the client asks
/// again for the rest): a FUSE request cannot be interrupted once the daemon
/// has it, so its caller is unkillable until it is answered.
pub const PREFETCH_SLICE: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests;
