//! The filesystem view of mounted checkpoints: inodes, names, attributes,
//! directory listings, reads, staged writes and commits. Plain Rust that tests
//! call without a mount; `fuse.rs` is the thin adapter that turns kernel
//! requests into these calls.
//!
//! Inodes are never reused while mounted. Directories and special files come
//! first (1 is the root); tensor id `i` (ids count across all checkpoints of the
//! mount and are never reused) has its data file at `first_tensor_ino + 2*i`
//! and its `.meta.json` right after. A tensor keeps its id, and so its inode,
//! across renames and commits.
//!
//! Locks, always taken in this order: `commit_lock` (held by commits and every
//! edit, so a commit sees no edit half-done), then `state`, then `handles`.

mod error;
pub mod fuse;
pub mod ioctl;
pub mod names;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::SystemTime;

pub use error::FsError;
use names::{tensor_file_name, tensor_name, METADATA_FILE, META_SUFFIX, NAME_MAX};
use tracing::{info, warn};

use crate::checkpoint::{Checkpoint, CommitError, Live, Tensor, TensorBytes, TensorId};
use crate::format::{Dtype, Metadata};

pub type Ino = u64;
pub const ROOT_INO: Ino = 1;
/// Largest `.meta.json` or `__metadata__.json` accepted in one write session.
const MAX_JSON_EDIT: usize = 16 << 20;

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
}

/// An open file: its handle and how the kernel should cache it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    pub fh: u64,
    /// Keep the kernel's page cache across opens: the bytes only change through the mount.
    pub keep_cache: bool,
    /// Bypass the page cache: generated content whose size may change.
    pub direct_io: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: Ino,
    pub kind: Kind,
    pub name: String,
    /// Offset to pass back to continue after this entry.
    pub next_offset: u64,
}

/// A source to mount: one checkpoint file, or a folder of shards.
pub enum Source {
    File(Checkpoint),
    Folder {
        /// (directory name, checkpoint), sorted by name.
        checkpoints: Vec<(String, Checkpoint)>,
        /// (file name, bytes) of each `*.index.json`, shown as they are.
        indexes: Vec<(String, Vec<u8>)>,
    },
}

/// Where a prefetch puts a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchTarget {
    PageCache,
    Cuda(i32),
}

/// What a prefetch did.
#[derive(Debug, Clone)]
pub struct Prefetched {
    /// Bytes resident in the page cache, or copied to the device.
    pub bytes: u64,
    pub nbytes: u64,
    pub dtype: Option<Dtype>,
    pub shape: Option<Vec<u64>>,
    /// The CUDA IPC handle and allocation size.
    pub ipc: Option<([u8; 64], u64)>,
}

/// Mount-wide settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub read_only: bool,
    pub uid: u32,
    pub gid: u32,
    /// Where staging files go (default: a hidden folder beside each source).
    pub staging_dir: Option<PathBuf>,
    /// Kept edits to take back at mount (a file mount only): see `Live::resume`.
    pub resume: Option<PathBuf>,
}

/// A file or directory, as an inode number decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    FolderRoot,
    CheckpointDir(usize),
    Metadata(usize),
    Index(usize),
    Tensor(usize, TensorId),
    Meta(usize, TensorId),
}

struct Mounted {
    dir_name: String,
    live: Live,
    dir_ino: Ino,
    metadata_ino: Ino,
}

struct State {
    checkpoints: Vec<Mounted>,
    indexes: Vec<(String, Vec<u8>, Ino)>,
    /// Node of each inode below `first_tensor_ino` (index = ino - 1).
    fixed: Vec<Node>,
    first_tensor_ino: Ino,
    /// Checkpoint of each tensor id ever given out.
    owner: Vec<u32>,
    folder_mtime: SystemTime,
}

/// What an open file handle refers to.
enum Handle {
    /// A tensor. `opened` keeps the bytes it was opened on, read if the tensor
    /// is later removed (POSIX: an unlinked file stays readable).
    Tensor {
        opened: TensorBytes,
        /// CUDA buffers prefetched through this handle: freed when it closes.
        device: Vec<crate::prefetch::cuda::DeviceBuffer>,
    },
    /// A `.meta.json` or `__metadata__.json` opened for writing: the JSON is
    /// buffered and applied on flush (or close).
    Json {
        target: Node,
        data: Vec<u8>,
        dirty: bool,
    },
}

pub struct Fs {
    settings: Settings,
    commit_lock: Mutex<()>,
    state: RwLock<State>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl State {
    fn node(&self, ino: Ino) -> Result<Node, FsError> {
        if ino == 0 {
            return Err(FsError::NotFound);
        }
        if ino < self.first_tensor_ino {
            return Ok(self.fixed[(ino - 1) as usize]);
        }
        let rel = ino - self.first_tensor_ino;
        let id = rel / 2;
        let &c = self.owner.get(id as usize).ok_or(FsError::NotFound)?;
        let c = c as usize;
        self.checkpoints[c].live.get(id).ok_or(FsError::NotFound)?;
        Ok(if rel % 2 == 0 {
            Node::Tensor(c, id)
        } else {
            Node::Meta(c, id)
        })
    }

    fn tensor_ino(&self, id: TensorId) -> Ino {
        self.first_tensor_ino + 2 * id
    }

    fn ino_of(&self, node: Node) -> Ino {
        match node {
            Node::FolderRoot => ROOT_INO,
            Node::CheckpointDir(c) => self.checkpoints[c].dir_ino,
            Node::Metadata(c) => self.checkpoints[c].metadata_ino,
            Node::Index(i) => self.indexes[i].2,
            Node::Tensor(_, id) => self.tensor_ino(id),
            Node::Meta(_, id) => self.tensor_ino(id) + 1,
        }
    }

    fn new_id(&mut self, c: usize) -> TensorId {
        self.owner.push(c as u32);
        (self.owner.len() - 1) as TensorId
    }

    fn live(&self, c: usize) -> &Live {
        &self.checkpoints[c].live
    }

    fn tensor(&self, c: usize, id: TensorId) -> Result<&Tensor, FsError> {
        self.live(c).get(id).ok_or(FsError::NotFound)
    }

    /// The checkpoint a directory inode stands for.
    fn checkpoint_dir(&self, ino: Ino) -> Result<usize, FsError> {
        match self.node(ino)? {
            Node::CheckpointDir(c) => Ok(c),
            Node::FolderRoot => Err(FsError::NotSupported(
                "creating files at the root of a folder mount",
            )),
            _ => Err(FsError::NotADirectory),
        }
    }

    /// Decodes a name inside a checkpoint directory. `Ok(None)` for a valid
    /// name of a tensor that does not exist (yet).
    fn resolve(&self, c: usize, name: &str) -> Result<Option<Node>, FsError> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        if name == METADATA_FILE {
            return Ok(Some(Node::Metadata(c)));
        }
        let (file, meta) = match name.strip_suffix(META_SUFFIX) {
            Some(stem) => (stem, true),
            None => (name, false),
        };
        let live = self.live(c);
        let id = match hashed_lookup(live, file) {
            Some(id) => Some(id),
            None => {
                let tensor = tensor_name(file).ok_or_else(|| {
                    FsError::Invalid(format!("{name:?} is not a valid tensor file name"))
                })?;
                live.id_of(&tensor)
            }
        };
        Ok(id.map(|id| {
            if meta {
                Node::Meta(c, id)
            } else {
                Node::Tensor(c, id)
            }
        }))
    }
}

/// Hashed long names cannot be decoded: find the tensor whose file name it is.
/// Only names of the hashed form reach the scan.
fn hashed_lookup(live: &Live, file: &str) -> Option<TensorId> {
    if !file.contains('~') || file.len() < 17 {
        return None;
    }
    live.tensors()
        .iter()
        .find(|(_, t)| names::is_hashed(&t.name) && tensor_file_name(&t.name) == file)
        .map(|(&id, _)| id)
}

impl Fs {
    /// Like `new`, then takes back the edits kept in `settings.resume`.
    pub fn with_resume(source: Source, settings: Settings) -> Result<Fs, String> {
        let fs = Fs::new(source, settings);
        if let Some(dir) = fs.settings.resume.clone() {
            let mut st = fs.write_state();
            if st.checkpoints.len() != 1 {
                return Err("--resume works on a mount of one checkpoint file".into());
            }
            let st = &mut *st;
            let owner = &mut st.owner;
            let mut new_id = || {
                owner.push(0);
                (owner.len() - 1) as TensorId
            };
            st.checkpoints[0].live.resume(&dir, &mut new_id)?;
        }
        Ok(fs)
    }

    pub fn new(source: Source, settings: Settings) -> Fs {
        let mut fixed = Vec::new();
        let (list, indexes, folder) = match source {
            Source::File(c) => (vec![(String::new(), c)], Vec::new(), false),
            Source::Folder {
                checkpoints,
                indexes,
            } => (checkpoints, indexes, true),
        };
        if folder {
            fixed.push(Node::FolderRoot);
        }
        let alloc = |fixed: &mut Vec<Node>, node| {
            fixed.push(node);
            fixed.len() as Ino
        };
        let mut checkpoints = Vec::with_capacity(list.len());
        let mut owner = Vec::new();
        for (c, (dir_name, checkpoint)) in list.into_iter().enumerate() {
            let dir_ino = alloc(&mut fixed, Node::CheckpointDir(c));
            let metadata_ino = alloc(&mut fixed, Node::Metadata(c));
            let first_id = owner.len() as TensorId;
            owner.extend(std::iter::repeat_n(
                c as u32,
                checkpoint.header().tensors.len(),
            ));
            let live = Live::new(checkpoint, first_id, settings.staging_dir.as_deref());
            checkpoints.push(Mounted {
                dir_name,
                live,
                dir_ino,
                metadata_ino,
            });
        }
        let indexes = indexes
            .into_iter()
            .enumerate()
            .map(|(i, (name, bytes))| (name, bytes, alloc(&mut fixed, Node::Index(i))))
            .collect();
        let folder_mtime = checkpoints
            .iter()
            .map(|m| m.live.source().modified())
            .max()
            .unwrap_or(SystemTime::UNIX_EPOCH);
        Fs {
            settings,
            commit_lock: Mutex::new(()),
            state: RwLock::new(State {
                first_tensor_ino: fixed.len() as Ino + 1,
                checkpoints,
                indexes,
                fixed,
                owner,
                folder_mtime,
            }),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
        }
    }

    fn read_state(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_state(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    fn writable(&self) -> Result<(), FsError> {
        if self.settings.read_only {
            Err(FsError::ReadOnly)
        } else {
            Ok(())
        }
    }

    fn new_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        lock(&self.handles).insert(fh, h);
        fh
    }

    pub fn lookup(&self, parent: Ino, name: &str) -> Result<Attr, FsError> {
        let st = self.read_state();
        let node = match st.node(parent)? {
            Node::FolderRoot => {
                if let Some(c) = st.checkpoints.iter().position(|m| m.dir_name == name) {
                    Node::CheckpointDir(c)
                } else if let Some(i) = st.indexes.iter().position(|(n, _, _)| n == name) {
                    Node::Index(i)
                } else {
                    return Err(FsError::NotFound);
                }
            }
            Node::CheckpointDir(c) => match st.resolve(c, name) {
                Ok(Some(node)) => node,
                Ok(None) | Err(FsError::Invalid(_)) => return Err(FsError::NotFound),
                Err(e) => return Err(e),
            },
            _ => return Err(FsError::NotADirectory),
        };
        self.attr_of(&st, node)
    }

    pub fn getattr(&self, ino: Ino) -> Result<Attr, FsError> {
        let st = self.read_state();
        let node = st.node(ino)?;
        self.attr_of(&st, node)
    }

    fn attr_of(&self, st: &State, node: Node) -> Result<Attr, FsError> {
        let (kind, size, mtime) = match node {
            Node::FolderRoot => (Kind::Directory, 0, st.folder_mtime),
            Node::CheckpointDir(c) => (Kind::Directory, 0, st.live(c).source().modified()),
            Node::Index(i) => (Kind::File, st.indexes[i].1.len() as u64, st.folder_mtime),
            Node::Tensor(c, id) => {
                let t = st.tensor(c, id)?;
                (
                    Kind::File,
                    t.len(),
                    t.edited.unwrap_or(st.live(c).source().modified()),
                )
            }
            Node::Meta(c, id) => {
                let t = st.tensor(c, id)?;
                let size = generated(st, node).map_or(0, |b| b.len() as u64);
                (
                    Kind::File,
                    size,
                    t.edited.unwrap_or(st.live(c).source().modified()),
                )
            }
            Node::Metadata(c) => {
                let size = generated(st, node).map_or(0, |b| b.len() as u64);
                (Kind::File, size, st.live(c).source().modified())
            }
        };
        let (perm, nlink) = match kind {
            Kind::Directory => (0o755, 2),
            Kind::File if self.settings.read_only || matches!(node, Node::Index(_)) => (0o444, 1),
            Kind::File => (0o644, 1),
        };
        Ok(Attr {
            ino: st.ino_of(node),
            kind,
            size,
            mtime,
            perm,
            nlink,
            uid: self.settings.uid,
            gid: self.settings.gid,
        })
    }

    /// Opens a file. `write` is any write access; `truncate` is O_TRUNC.
    pub fn open(&self, ino: Ino, write: bool, truncate: bool) -> Result<Opened, FsError> {
        if write || truncate {
            self.writable()?;
        }
        let _edit = (write || truncate).then(|| lock(&self.commit_lock));
        if write && truncate {
            let mut st = self.write_state();
            if let Node::Tensor(c, id) = st.node(ino)? {
                st.checkpoints[c].live.truncate(id, 0)?;
            }
        }
        let st = self.read_state();
        let node = st.node(ino)?;
        match node {
            Node::FolderRoot | Node::CheckpointDir(_) => Err(FsError::IsADirectory),
            Node::Index(_) if write || truncate => Err(FsError::ReadOnly),
            Node::Index(_) => Ok(Opened {
                fh: 0,
                keep_cache: true,
                direct_io: false,
            }),
            Node::Tensor(c, id) => {
                let opened = st.tensor(c, id)?.bytes.clone();
                drop(st);
                let fh = self.new_handle(Handle::Tensor {
                    opened,
                    device: Vec::new(),
                });
                Ok(Opened {
                    fh,
                    keep_cache: true,
                    direct_io: false,
                })
            }
            Node::Meta(..) | Node::Metadata(_) if write => {
                let data = if truncate {
                    Vec::new()
                } else {
                    generated(&st, node).unwrap_or_default()
                };
                drop(st);
                let fh = self.new_handle(Handle::Json {
                    target: node,
                    data,
                    dirty: truncate,
                });
                Ok(Opened {
                    fh,
                    keep_cache: false,
                    direct_io: true,
                })
            }
            Node::Meta(..) | Node::Metadata(_) => Ok(Opened {
                fh: 0,
                keep_cache: false,
                direct_io: true,
            }),
        }
    }

    /// Creates (or opens, if it exists) a file in a checkpoint directory.
    pub fn create(
        &self,
        parent: Ino,
        name: &str,
        truncate: bool,
    ) -> Result<(Attr, Opened), FsError> {
        self.writable()?;
        let ino = {
            let _edit = lock(&self.commit_lock);
            let mut st = self.write_state();
            let c = st.checkpoint_dir(parent)?;
            let node = match st.resolve(c, name)? {
                Some(node) => node,
                None => {
                    let (stem, is_meta) = match name.strip_suffix(META_SUFFIX) {
                        Some(stem) => (stem, true),
                        None => (name, false),
                    };
                    let tensor = tensor_name(stem).ok_or_else(|| {
                        FsError::Invalid(format!("{name:?} is not a valid tensor file name"))
                    })?;
                    let id = st.new_id(c);
                    st.checkpoints[c].live.create(id, &tensor)?;
                    info!(tensor = %tensor, "created");
                    if is_meta {
                        Node::Meta(c, id)
                    } else {
                        Node::Tensor(c, id)
                    }
                }
            };
            st.ino_of(node)
        };
        let opened = self.open(ino, true, truncate)?;
        Ok((self.getattr(ino)?, opened))
    }

    pub fn release(&self, fh: u64) -> Result<(), FsError> {
        let result = self.apply_json(fh, true);
        lock(&self.handles).remove(&fh);
        result
    }

    /// Applies a buffered `.meta.json` / `__metadata__.json` write. A shell's
    /// `>` closes a duplicate descriptor before anything is written: an empty
    /// buffer waits for the last close.
    pub fn flush(&self, fh: u64) -> Result<(), FsError> {
        self.apply_json(fh, false)
    }

    fn apply_json(&self, fh: u64, last_close: bool) -> Result<(), FsError> {
        let (target, data) = {
            let mut handles = lock(&self.handles);
            match handles.get_mut(&fh) {
                Some(Handle::Json {
                    target,
                    data,
                    dirty,
                }) if *dirty && (last_close || !data.is_empty()) => {
                    *dirty = false;
                    (*target, data.clone())
                }
                _ => return Ok(()),
            }
        };
        let _edit = lock(&self.commit_lock);
        let mut st = self.write_state();
        let result = match target {
            Node::Meta(c, id) => {
                let (dtype, shape) = parse_meta(&data)?;
                st.checkpoints[c]
                    .live
                    .set_meta(id, dtype, shape)
                    .map_err(FsError::Invalid)
            }
            Node::Metadata(c) => {
                let meta = parse_metadata(&data)?;
                st.checkpoints[c].live.set_metadata(meta);
                Ok(())
            }
            _ => Ok(()),
        };
        if let Err(e) = &result {
            warn!("edit refused: {e}");
        }
        result
    }

    pub fn write(&self, ino: Ino, fh: u64, offset: u64, data: &[u8]) -> Result<u32, FsError> {
        self.writable()?;
        {
            let mut handles = lock(&self.handles);
            if let Some(Handle::Json {
                data: buf, dirty, ..
            }) = handles.get_mut(&fh)
            {
                let end = offset
                    .checked_add(data.len() as u64)
                    .filter(|&e| e <= MAX_JSON_EDIT as u64)
                    .ok_or(FsError::TooLarge)?;
                if buf.len() < end as usize {
                    buf.resize(end as usize, 0);
                }
                buf[offset as usize..end as usize].copy_from_slice(data);
                *dirty = true;
                return Ok(data.len() as u32);
            }
        }
        // Edits exclude commits (and each other) for the whole write; readers
        // wait only for the short state changes, not for the copy or the write.
        let _edit = lock(&self.commit_lock);
        self.copy_to_staging(ino, u64::MAX)?;
        let mut st = self.write_state();
        match st.node(ino)? {
            Node::Tensor(c, id) => {
                let staged = st.checkpoints[c].live.writable(id)?;
                drop(st);
                staged.write_at(data, offset)?;
                Ok(data.len() as u32)
            }
            Node::FolderRoot | Node::CheckpointDir(_) => Err(FsError::IsADirectory),
            _ => Err(FsError::Invalid(
                "write without an open write handle".into(),
            )),
        }
    }

    /// Copies a source-backed tensor's first `keep` bytes into a staging file
    /// without holding the state lock during the copy. Needs `commit_lock`.
    fn copy_to_staging(&self, ino: Ino, keep: u64) -> Result<(), FsError> {
        let job = {
            let mut st = self.write_state();
            match st.node(ino)? {
                Node::Tensor(c, id) => st.checkpoints[c].live.begin_copy(id)?.map(|job| (c, job)),
                _ => None,
            }
        };
        if let Some((c, job)) = job {
            job.copy(keep)?;
            self.write_state().checkpoints[c].live.finish_copy(job);
        }
        Ok(())
    }

    /// `truncate` / `ftruncate`: tensors change length; a JSON file opened for
    /// writing has its buffer cut.
    pub fn set_size(&self, ino: Ino, fh: Option<u64>, size: u64) -> Result<Attr, FsError> {
        self.writable()?;
        if let Some(fh) = fh {
            if let Some(Handle::Json { data, dirty, .. }) = lock(&self.handles).get_mut(&fh) {
                data.resize((size as usize).min(MAX_JSON_EDIT), 0);
                *dirty = true;
            }
        }
        {
            let _edit = lock(&self.commit_lock);
            self.copy_to_staging(ino, size)?;
            let mut st = self.write_state();
            match st.node(ino)? {
                Node::Tensor(c, id) => st.checkpoints[c].live.truncate(id, size)?,
                Node::FolderRoot | Node::CheckpointDir(_) => return Err(FsError::IsADirectory),
                Node::Index(_) => return Err(FsError::ReadOnly),
                Node::Meta(..) | Node::Metadata(_) if fh.is_some() => {}
                Node::Meta(..) | Node::Metadata(_) => {
                    return Err(FsError::Invalid(
                        "a .meta.json is rewritten whole: open it for writing".into(),
                    ))
                }
            }
        }
        self.getattr(ino)
    }

    pub fn unlink(&self, parent: Ino, name: &str) -> Result<(), FsError> {
        self.writable()?;
        let _edit = lock(&self.commit_lock);
        let mut st = self.write_state();
        let c = match st.node(parent)? {
            Node::CheckpointDir(c) => c,
            Node::FolderRoot => return Err(FsError::ReadOnly),
            _ => return Err(FsError::NotADirectory),
        };
        match st
            .resolve(c, name)
            .map_err(|_| FsError::NotFound)?
            .ok_or(FsError::NotFound)?
        {
            Node::Tensor(c, id) => {
                let t = st.checkpoints[c].live.remove(id);
                info!(tensor = ?t.map(|t| t.name), "removed");
                Ok(())
            }
            Node::Meta(..) => Err(FsError::NotPermitted(
                "a .meta.json goes with its tensor: remove the tensor file",
            )),
            _ => Err(FsError::NotPermitted(
                "__metadata__.json cannot be removed: write {} to it",
            )),
        }
    }

    pub fn rename(
        &self,
        parent: Ino,
        name: &str,
        new_parent: Ino,
        new_name: &str,
        no_replace: bool,
    ) -> Result<(), FsError> {
        self.writable()?;
        let _edit = lock(&self.commit_lock);
        let mut st = self.write_state();
        let c = st.checkpoint_dir(parent)?;
        let nc = st.checkpoint_dir(new_parent)?;
        if c != nc {
            // mv falls back to copy and unlink, which carries the bytes across.
            return Err(FsError::CrossDevice);
        }
        let from = st.resolve(c, name)?.ok_or(FsError::NotFound)?;
        let (id, to_stem) = match (from, new_name.strip_suffix(META_SUFFIX)) {
            (Node::Tensor(_, id), None) => (id, new_name),
            (Node::Meta(_, id), Some(stem)) => (id, stem),
            (Node::Metadata(_), _) => {
                return Err(FsError::NotPermitted("__metadata__.json cannot be renamed"))
            }
            _ => {
                return Err(FsError::Invalid(
                    "a tensor file and a .meta.json cannot be renamed into each other".into(),
                ))
            }
        };
        if new_name == METADATA_FILE {
            return Err(FsError::NotPermitted(
                "__metadata__.json cannot be replaced",
            ));
        }
        let to = tensor_name(to_stem).ok_or_else(|| {
            FsError::Invalid(format!("{new_name:?} is not a valid tensor file name"))
        })?;
        if no_replace && st.live(c).id_of(&to).is_some_and(|other| other != id) {
            return Err(FsError::Exists);
        }
        st.checkpoints[c].live.rename(id, &to);
        info!(from = name, to = %to, "renamed");
        Ok(())
    }

    /// Serves `size` bytes at `offset` to `reply`: source bytes straight from
    /// the mapping, staged bytes from their file, generated files from a buffer.
    pub fn read<R>(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        size: u32,
        reply: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, FsError> {
        let bytes = {
            let st = self.read_state();
            match st.node(ino) {
                Ok(Node::FolderRoot | Node::CheckpointDir(_)) => return Err(FsError::IsADirectory),
                Ok(Node::Tensor(c, id)) => st.tensor(c, id)?.bytes.clone(),
                Ok(Node::Index(i)) => return Ok(reply(slice_at(&st.indexes[i].1, offset, size))),
                Ok(node) => {
                    let buffered = match lock(&self.handles).get(&fh) {
                        Some(Handle::Json { data, .. }) => Some(data.clone()),
                        _ => None,
                    };
                    let data = buffered
                        .or_else(|| generated(&st, node))
                        .unwrap_or_default();
                    return Ok(reply(slice_at(&data, offset, size)));
                }
                // A tensor removed since it was opened: read what the handle opened.
                Err(e) => match lock(&self.handles).get(&fh) {
                    Some(Handle::Tensor { opened, .. }) => opened.clone(),
                    _ => return Err(e),
                },
            }
        };
        match bytes {
            TensorBytes::Source(checkpoint, index) => {
                Ok(checkpoint.serve_tensor(index, offset, size, reply))
            }
            TensorBytes::Staged(file) => {
                let len = file.len();
                let want = (size as u64).min(len.saturating_sub(offset)) as usize;
                let mut buf = vec![0u8; want];
                let mut got = 0;
                while got < want {
                    match file.read_at(&mut buf[got..], offset + got as u64)? {
                        0 => break,
                        n => got += n,
                    }
                }
                buf.truncate(got);
                Ok(reply(&buf))
            }
        }
    }

    /// Directory entries after `offset` (0 to start), in a stable order: `.`,
    /// `..`, `__metadata__.json`, then each tensor and its `.meta.json` by id.
    /// Offsets derive from ids, so a listing resumes correctly across edits.
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
                    .map(|m| (m.dir_ino, Kind::Directory, m.dir_name.clone()));
                let files = st
                    .indexes
                    .iter()
                    .map(|(n, _, ino)| (*ino, Kind::File, n.clone()));
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
                if offset < 3 && emit(m.metadata_ino, Kind::File, METADATA_FILE.into(), 3) {
                    return Ok(());
                }
                // Tensor id i lists at offsets 4 + 2i (data) and 5 + 2i (meta).
                let first_id = offset.saturating_sub(4) / 2;
                for (&id, t) in m.live.tensors().range(first_id..) {
                    let file = tensor_file_name(&t.name);
                    let ino = st.tensor_ino(id);
                    if 4 + 2 * id > offset && emit(ino, Kind::File, file.clone(), 4 + 2 * id) {
                        break;
                    }
                    if 5 + 2 * id > offset
                        && emit(ino + 1, Kind::File, file + META_SUFFIX, 5 + 2 * id)
                    {
                        break;
                    }
                }
                Ok(())
            }
            _ => Err(FsError::NotADirectory),
        }
    }

    /// Prefetches the tensor behind `ino` (opened as `fh`). Errors carry an errno
    /// and a message for the caller.
    pub fn prefetch(
        &self,
        ino: Ino,
        fh: u64,
        target: PrefetchTarget,
    ) -> Result<Prefetched, (i32, String)> {
        let (bytes, dtype, shape) = {
            let st = self.read_state();
            match st.node(ino) {
                Ok(Node::Tensor(c, id)) => {
                    let t = st.tensor(c, id).map_err(|e| (e.errno(), e.to_string()))?;
                    (t.bytes.clone(), t.dtype, t.shape.clone())
                }
                Ok(_) => {
                    return Err((
                        libc::ENOTTY,
                        "not a tensor file: prefetch works on a tensor's data file".into(),
                    ))
                }
                Err(e) => return Err((e.errno(), e.to_string())),
            }
        };
        let (file, offset, len) = match &bytes {
            TensorBytes::Source(c, i) => {
                let r = c.tensor_range(*i);
                (c.file(), r.start, r.end - r.start)
            }
            TensorBytes::Staged(s) => (s.file(), 0, s.len()),
        };
        let io = |e: std::io::Error| (e.raw_os_error().unwrap_or(libc::EIO), e.to_string());
        match target {
            PrefetchTarget::PageCache => {
                let resident = crate::prefetch::to_page_cache(file, offset, len).map_err(io)?;
                Ok(Prefetched {
                    bytes: resident,
                    nbytes: len,
                    dtype,
                    shape,
                    ipc: None,
                })
            }
            PrefetchTarget::Cuda(device) => {
                let buffer =
                    crate::prefetch::cuda::to_device(device, file, offset, len).map_err(|e| {
                        warn!("prefetch to cuda:{device}: {}", e.message);
                        (e.errno, e.message)
                    })?;
                let ipc = Some((buffer.ipc_handle, buffer.len() as u64));
                match lock(&self.handles).get_mut(&fh) {
                    Some(Handle::Tensor {
                        device: buffers, ..
                    }) => buffers.push(buffer),
                    _ => {
                        return Err((
                            libc::EBADF,
                            "prefetch to a device needs an open tensor file".into(),
                        ))
                    }
                }
                Ok(Prefetched {
                    bytes: len,
                    nbytes: len,
                    dtype,
                    shape,
                    ipc,
                })
            }
        }
    }

    /// Commits the checkpoint that `ino` belongs to (every checkpoint, for the
    /// root of a folder mount). Returns a line per checkpoint committed.
    pub fn commit(&self, ino: Ino, force: bool) -> Result<Vec<String>, CommitError> {
        let targets = {
            let st = self.read_state();
            match st.node(ino) {
                Ok(Node::FolderRoot) | Err(_) => (0..st.checkpoints.len()).collect(),
                Ok(
                    Node::CheckpointDir(c)
                    | Node::Metadata(c)
                    | Node::Tensor(c, _)
                    | Node::Meta(c, _),
                ) => vec![c],
                Ok(Node::Index(_)) => (0..st.checkpoints.len()).collect(),
            }
        };
        // Edits wait on commit_lock for the whole commit; readers are held up
        // only while the plan is taken and while the new file is swapped in.
        let _edit = lock(&self.commit_lock);
        let mut done = Vec::new();
        for c in targets {
            let (plan, path) = {
                let st = self.read_state();
                let live = st.live(c);
                (
                    live.prepare_commit(force),
                    live.source().path().display().to_string(),
                )
            };
            let plan = match plan {
                Ok(Some(plan)) => plan,
                Ok(None) => {
                    done.push(format!("{path}: nothing to commit"));
                    continue;
                }
                Err(e) => {
                    warn!("commit refused: {e}");
                    return Err(e);
                }
            };
            let mut last_report = std::time::Instant::now();
            let mut progress = |done: u64, total: u64| {
                if last_report.elapsed().as_secs() >= 2 {
                    info!(file = %path, "commit: {done} of {total} bytes");
                    last_report = std::time::Instant::now();
                }
            };
            let written = plan
                .write(&mut progress)
                .inspect_err(|e| warn!("commit failed: {e}"))?;
            self.write_state().checkpoints[c]
                .live
                .finish_commit(written)?;
            done.push(format!("{path}: committed"));
        }
        Ok(done)
    }

    /// Whether any checkpoint has staged edits.
    pub fn is_dirty(&self) -> bool {
        self.read_state()
            .checkpoints
            .iter()
            .any(|m| m.live.is_dirty())
    }

    /// Drops every staged edit. Tensors get new ids (and inodes).
    pub fn discard(&self) {
        let _edit = lock(&self.commit_lock);
        let mut st = self.write_state();
        for c in 0..st.checkpoints.len() {
            let count = st.live(c).source().header().tensors.len();
            let first_id = st.owner.len() as TensorId;
            st.owner.extend(std::iter::repeat_n(c as u32, count));
            st.checkpoints[c].live.discard(first_id);
        }
        info!("staged edits discarded");
    }

    /// Keeps every uncommitted edit on disk with a manifest (a commit at
    /// unmount failed); returns the folders.
    pub fn keep_edits(&self) -> Vec<String> {
        let mut st = self.write_state();
        st.checkpoints
            .iter_mut()
            .filter(|m| m.live.is_dirty())
            .map(|m| match m.live.keep_edits() {
                Ok(dir) => dir.display().to_string(),
                Err(e) => format!(
                    "(could not keep the edits of {}: {e})",
                    m.live.source().path().display()
                ),
            })
            .collect()
    }

    /// The folder holding the source, for statfs.
    pub fn backing_dir(&self) -> PathBuf {
        let st = self.read_state();
        st.checkpoints
            .first()
            .and_then(|m| m.live.source().path().parent().map(Path::to_path_buf))
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or_else(|| PathBuf::from("."))
    }
}

fn slice_at(data: &[u8], offset: u64, size: u32) -> &[u8] {
    let start = offset.min(data.len() as u64) as usize;
    let end = (start as u64 + size as u64).min(data.len() as u64) as usize;
    &data[start..end]
}

/// Content of the files stfs generates: a tensor's `.meta.json`, `__metadata__.json`.
fn generated(st: &State, node: Node) -> Option<Vec<u8>> {
    match node {
        Node::Meta(c, id) => {
            let t = st.tensor(c, id).ok()?;
            // Written by hand to keep the documented field order.
            let mut out = String::from("{");
            if let (Some(dtype), Some(shape)) = (t.dtype, &t.shape) {
                out.push_str(&format!(
                    "\"dtype\":\"{dtype}\",\"shape\":{}",
                    serde_json::to_string(shape).ok()?
                ));
            }
            if let TensorBytes::Source(checkpoint, index) = &t.bytes {
                let h = checkpoint.header();
                let info = &h.tensors[*index];
                out.push_str(&format!(
                    ",\"data_offsets\":[{},{}],\"file_offset\":{}",
                    info.data_offsets.0,
                    info.data_offsets.1,
                    h.data_start() + info.data_offsets.0
                ));
            }
            if out.len() > 1 {
                out.push(',');
            }
            out.push_str(&format!(
                "\"nbytes\":{},\"name\":{}}}\n",
                t.len(),
                serde_json::to_string(&t.name).ok()?
            ));
            Some(out.into_bytes())
        }
        Node::Metadata(c) => {
            let mut out = match st.live(c).metadata() {
                Some(m) => serde_json::to_vec(m).expect("a string map serializes"),
                None => b"{}".to_vec(),
            };
            out.push(b'\n');
            Some(out)
        }
        _ => None,
    }
}

/// Reads `dtype` and `shape` of a written `.meta.json`; other fields are ignored.
fn parse_meta(data: &[u8]) -> Result<(Dtype, Vec<u64>), FsError> {
    let bad = |why: String| FsError::Invalid(format!(".meta.json: {why}"));
    let v: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| bad(format!("not JSON: {e}")))?;
    let dtype = v
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad("needs \"dtype\", a string".into()))?;
    let dtype = Dtype::from_name(dtype).ok_or_else(|| bad(format!("unknown dtype {dtype:?}")))?;
    let shape = v
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad("needs \"shape\", an array".into()))?
        .iter()
        .map(|d| d.as_u64())
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| bad("shape must hold non-negative integers".into()))?;
    Ok((dtype, shape))
}

/// Reads a written `__metadata__.json`: an object of string values; `{}` means none.
fn parse_metadata(data: &[u8]) -> Result<Option<Metadata>, FsError> {
    let meta: Metadata = serde_json::from_slice(data).map_err(|e| {
        FsError::Invalid(format!(
            "__metadata__.json must be a JSON object of string values: {e}"
        ))
    })?;
    Ok((!meta.is_empty()).then_some(meta))
}

#[cfg(test)]
mod tests;
