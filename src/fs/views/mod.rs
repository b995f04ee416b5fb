//! `__views__/`: read-only files computed from the checkpoints' staged state
//! (docs/SEMANTICS.md, "Views"). Every view folder is one module that
//! implements `ViewFolder`: the names it shows in `__views__`, what a path
//! below them is now, a folder's entries, and a file made for the state now.
//! The filesystem knows them through `FOLDERS` alone; every entry's inode
//! comes from one table (`ViewInodes`), filled as names are looked up.

mod casts;
pub(super) mod export;
pub(super) use model::index_view;
mod gguf_file;
mod model;
mod npy;
mod reshard;

use crate::sync::LockAnyway;
use std::any::Any;
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

use super::{Ino, State};
use crate::checkpoint::view::GeneratedFile;

/// The view folders, in listing order. A new view is one module and one line here.
const FOLDERS: [&dyn ViewFolder; 5] = [
    &casts::Casts,
    &npy::Npy,
    &reshard::Reshard,
    &export::Export,
    &gguf_file::GgufFile,
];

/// Whether `name` is a folder's at the top of `__views__` (a model file of
/// that name is not shown there: the folder is). The export, whose files
/// are the top's others, is not asked.
fn is_folder_name(st: &State, name: &str) -> bool {
    let named: [&dyn ViewFolder; 4] = [
        &casts::Casts,
        &npy::Npy,
        &reshard::Reshard,
        &gguf_file::GgufFile,
    ];
    named.iter().any(|f| f.top(st).iter().any(|n| n == name))
}

/// Which mounts a view folder shows in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Formats {
    Safetensors,
    Gguf,
    Both,
}

/// The view folders of this mount's format. (A GGUF file has no
/// safetensors exports, casts or reshards yet.)
fn folders(st: &State) -> impl Iterator<Item = &'static dyn ViewFolder> {
    let gguf = st.is_gguf();
    FOLDERS.into_iter().filter(move |f| match f.formats() {
        Formats::Both => true,
        Formats::Gguf => gguf,
        Formats::Safetensors => !gguf,
    })
}

/// What a view entry draws on, which gives its owner, mode and time: those
/// who may read those sources may read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Draws {
    /// One checkpoint's staged state.
    Checkpoint(usize),
    /// Every checkpoint of the mount.
    All,
    /// Every checkpoint and index file `i` of a folder mount.
    Index(usize),
    /// Other file `i` of a model folder (`config.json`...).
    ModelFile(usize),
}

/// A path below `__views__`, as it is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Folder(Draws),
    File(Draws),
}

/// An entry of a view folder's listing, at listing offset `offset` (the
/// offset to pass back to continue after it).
pub struct Entry {
    pub name: String,
    pub folder: bool,
    pub offset: u64,
}

/// Why a view's file cannot be made.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ViewError {
    /// The path names no file of the view (ENOENT).
    #[error("not a view")]
    NotAView,
    /// The state the view shows is not a valid checkpoint now: what a
    /// commit would refuse (EINVAL).
    #[error("{0}")]
    Invalid(String),
}

impl crate::errno::ToErrno for ViewError {
    fn to_errno(&self) -> i32 {
        match self {
            ViewError::NotAView => libc::ENOENT,
            ViewError::Invalid(_) => libc::EINVAL,
        }
    }
}

impl From<String> for ViewError {
    fn from(why: String) -> ViewError {
        ViewError::Invalid(why)
    }
}

impl From<ViewError> for crate::fs::FsError {
    fn from(e: ViewError) -> crate::fs::FsError {
        match e {
            ViewError::NotAView => crate::fs::FsError::NotFound,
            ViewError::Invalid(why) => crate::fs::FsError::Invalid(why),
        }
    }
}

/// One folder of `__views__` (or, for `export`, the files at its top).
pub trait ViewFolder: Sync {
    /// The mounts it shows in.
    fn formats(&self) -> Formats {
        Formats::Safetensors
    }
    /// The names it shows in `__views__` (the first part of its paths).
    fn top(&self, st: &State) -> Vec<String>;
    /// What `path` (whose first part is one of `top`) is now, if anything.
    fn find(&self, st: &State, path: &[&str]) -> Option<Found>;
    /// The entries of folder `path`, in a stable order (those past listing
    /// offset `from` at least: a long folder may start there).
    fn list(&self, st: &State, path: &[&str], from: u64) -> Vec<Entry>;
    /// File `path`, made for the state now; why not (what a commit would
    /// refuse) if the state is not a valid checkpoint.
    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError>;
    /// Why folder `path` cannot be listed now (the state is one a commit
    /// would refuse, and what it holds depends on it): its listing is
    /// EINVAL, as its files' reads are, so `cp -r` fails instead of copying
    /// nothing.
    fn refuses(&self, _st: &State, _path: &[&str]) -> Option<String> {
        None
    }
    /// Whether a made file is kept until the state changes (small files
    /// that many names show, as `.npy` files, are made on each use).
    fn cached(&self) -> bool {
        true
    }
}

fn split(path: &str) -> Vec<&str> {
    path.split('/').filter(|p| !p.is_empty()).collect()
}

fn folder_of(st: &State, first: &str) -> Option<&'static dyn ViewFolder> {
    folders(st).find(|f| f.top(st).iter().any(|n| n == first))
}

/// What `path` ("" for `__views__` itself) is now.
pub fn find(st: &State, path: &str) -> Option<Found> {
    let parts = split(path);
    let Some(first) = parts.first() else {
        return Some(Found::Folder(Draws::All));
    };
    folder_of(st, first)?.find(st, &parts)
}

/// The entries of folder `path` (those past listing offset `from` at least).
pub fn list(st: &State, path: &str, from: u64) -> Vec<Entry> {
    let parts = split(path);
    if parts.is_empty() {
        let mut out = Vec::new();
        for f in folders(st) {
            for name in f.top(st) {
                let folder = matches!(f.find(st, &[&name]), Some(Found::Folder(_)));
                let offset = 3 + out.len() as u64;
                out.push(Entry {
                    name,
                    folder,
                    offset,
                });
            }
        }
        return out;
    }
    folder_of(st, parts[0]).map_or_else(Vec::new, |f| f.list(st, &parts, from))
}

/// Why folder `path` cannot be listed now, if it cannot.
pub fn refuses(st: &State, path: &str) -> Option<String> {
    let parts = split(path);
    folder_of(st, parts.first()?)?.refuses(st, &parts)
}

/// File `path`, made now.
pub fn make(st: &State, path: &str) -> Result<GeneratedFile, ViewError> {
    let parts = split(path);
    let f = parts.first().and_then(|first| folder_of(st, first));
    f.ok_or(ViewError::NotAView)?.make(st, &parts)
}

/// Whether file `path` may be kept until the state it draws on changes.
pub fn cached(st: &State, path: &str) -> bool {
    let parts = split(path);
    parts
        .first()
        .and_then(|first| folder_of(st, first))
        .is_some_and(|f| f.cached())
}

/// The version of the state an entry drawing on `draws` was made from.
pub fn version(st: &State, draws: Draws) -> u64 {
    match draws {
        Draws::Checkpoint(c) => st.live(c).views_version(),
        Draws::All | Draws::Index(_) => st.checkpoints.iter().map(|m| m.live.views_version()).sum(),
        // (Every edit of a model file counts: a view made before is stale.)
        Draws::ModelFile(_) => st.model_files.version(),
    }
}

/// The checkpoint a view folder of one folder per shard (`npy`, or
/// `npy/SHARD`; `kv`) stands for at `path`: a file mount's only one at its
/// top; None for the folder of shard folders (a folder mount's top).
fn checkpoint_of(st: &State, path: &[&str]) -> Option<Option<usize>> {
    match (path, &st.folder) {
        ([_], None) => Some(Some(0)),
        ([_], Some(_)) => Some(None),
        ([_, shard], Some(_)) => st
            .checkpoints
            .iter()
            .position(|m| m.shown_name() == *shard)
            .map(Some),
        _ => None,
    }
}

/// Listing offsets for entries in order: 3, 4, ...
fn numbered(entries: impl IntoIterator<Item = (String, bool)>) -> Vec<Entry> {
    entries
        .into_iter()
        .enumerate()
        .map(|(k, (name, folder))| Entry {
            name,
            folder,
            offset: 3 + k as u64,
        })
        .collect()
}

/// The inode of every view path looked up: `VIEW_BIT` and its place in the
/// table ("", `__views__` itself, is the first). Paths are never dropped (the
/// kernel may ask by inode at any time): each costs its name, about 100
/// bytes, so a million lookups of new names cost about 100 MB.
pub struct ViewInodes {
    paths: Vec<Arc<str>>,
    inos: HashMap<Arc<str>, Ino>,
}

pub const VIEW_BIT: Ino = 1 << 61;

impl ViewInodes {
    pub fn new() -> ViewInodes {
        let mut t = ViewInodes {
            paths: Vec::new(),
            inos: HashMap::new(),
        };
        t.ino("");
        t
    }

    /// The inode of `path`, given now if it had none.
    pub fn ino(&mut self, path: &str) -> Ino {
        if let Some(&ino) = self.inos.get(path) {
            return ino;
        }
        let ino = VIEW_BIT | self.paths.len() as Ino;
        let path: Arc<str> = path.into();
        self.paths.push(path.clone());
        self.inos.insert(path, ino);
        ino
    }

    pub fn path(&self, ino: Ino) -> Option<Arc<str>> {
        self.paths.get((ino & !VIEW_BIT) as usize).cloned()
    }
}

/// What is computed once per state and used for many requests (a view file
/// made, a split of 50,000 tensors): the last few results, each with the
/// version of the state it was made from.
pub struct Memo(Mutex<lru::LruCache<String, Kept>>);

/// A result and the version of the state it was made from.
type Kept = (u64, Arc<dyn Any + Send + Sync>);

impl Memo {
    /// Keeping at most `kept` results (at least one).
    pub fn new(kept: usize) -> Memo {
        let kept = NonZeroUsize::new(kept).unwrap_or(NonZeroUsize::MIN);
        Memo(Mutex::new(lru::LruCache::new(kept)))
    }

    /// The result kept for `key` if it was made at `version`, else `make`'s.
    pub fn get<T: Any + Send + Sync>(
        &self,
        key: &str,
        version: u64,
        make: impl FnOnce() -> T,
    ) -> Arc<T> {
        let lock = || self.0.lock_anyway();
        if let Some((v, kept)) = lock().get(key) {
            if *v == version {
                if let Ok(t) = kept.clone().downcast::<T>() {
                    return t;
                }
            }
        }
        let made = Arc::new(make());
        lock().put(key.to_string(), (version, made.clone()));
        made
    }
}

/// `parent/name`.
pub fn join(parent: &str, name: &str) -> String {
    match parent {
        "" => name.to_string(),
        _ => format!("{parent}/{name}"),
    }
}

/// The path of checkpoint `c`'s export view (its source file byte for byte
/// when unedited, which passthrough may serve).
pub fn export_path(st: &State, c: usize) -> String {
    export::name_of(st, Some(c))
}
