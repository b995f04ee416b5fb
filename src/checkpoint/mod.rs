//! One live, editable checkpoint: the mapped source plus staged edits, and the
//! commit that re-serializes them. Plain Rust, no FUSE: the reference-model
//! tests drive it through `Fs`.
//!
//! The file model (docs/SEMANTICS.md, "Editing"): a checkpoint directory holds
//! *entries*, one per name. An entry may have a data file (an object with
//! bytes and an identity of its own: the kernel's inode) and a meta (the
//! name's dtype and shape, shown as `<name>.meta.json`). Replacing the bytes
//! under a name keeps the name's meta; moving a data file that has a meta
//! moves both.
//!
//! Entries and objects are numbered by ids that are never reused while
//! mounted; an untouched source tensor costs one small slot each (its name,
//! meta and bytes are read from the parsed header), so a header of a million
//! tensors is not copied.

pub mod commit;
mod edits;
#[cfg(test)]
mod explore;
pub mod in_place;
mod index_update;
pub mod journal;
mod journaling;
pub mod kv;
pub mod meta;
pub mod model_change;
mod object;
mod problems;
pub mod recover;
pub mod recovery_error;
pub mod shards;
pub mod staging;
pub mod transaction;
pub mod view;

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use hashbrown::{DefaultHashBuilder, HashTable};
use tracing::{info, warn};

pub use commit::{CommitError, CommitPlan, Problem};
use journal::{DataRef, Journal, Record};
pub use meta::{MAX_JSON, MAX_META, Meta, MetadataDoc};
pub use object::{Changed, DataObject, ObjectState};
use staging::Staging;

use crate::format::{Dtype, Metadata, printable};
use crate::source::staged::StagingError;
use crate::source::{Bytes, SourceFile, StagingDir};

/// The id of an entry or of an object, for the life of the mount.
pub type Id = u64;

/// The one name a tensor cannot have: the header's key for the metadata.
pub const RESERVED: &str = "__metadata__";

pub use crate::generation::next_gen;

/// Hands memory freed by a commit (its plan, the old header) back to the
/// system, so that a long-lived daemon stays at the size of its state.
pub fn trim_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Why a commit way cannot commit a state (shown by `stfs status` and the
/// commit's summary when a cheaper way was passed over): a reason for a
/// person, not an error to act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Declined(pub String);

impl From<&str> for Declined {
    fn from(why: &str) -> Declined {
        Declined(why.to_string())
    }
}

impl From<String> for Declined {
    fn from(why: String) -> Declined {
        Declined(why)
    }
}

/// Why an edit was refused.
#[derive(Debug, thiserror::Error)]
pub enum EditError {
    #[error("no such file")]
    NotFound,
    #[error("exists")]
    Exists,
    /// The content does not fit where it goes (a meta that does not parse...).
    #[error("{0}")]
    Invalid(String),
    /// A JSON file over its size limit (in bytes).
    #[error("a JSON file over {} KiB", .0 >> 10)]
    TooLarge(usize),
    #[error("{0}")]
    Staging(#[from] StagingError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl crate::errno::ToErrno for EditError {
    fn to_errno(&self) -> i32 {
        match self {
            EditError::NotFound => libc::ENOENT,
            EditError::Exists => libc::EEXIST,
            EditError::Invalid(_) => libc::EINVAL,
            EditError::TooLarge(_) => libc::EFBIG,
            EditError::Staging(e) => e.to_errno(),
            EditError::Io(e) => e.to_errno(),
        }
    }
}

/// A name's dtype and shape: the source tensor's, or its own.
#[derive(Clone)]
enum EntryMeta {
    Source,
    Own(Meta),
}

#[derive(Clone)]
struct Entry {
    /// The source tensor this entry stands for (or started as).
    origin: Option<u32>,
    /// None: the origin's name.
    name: Option<Box<str>>,
    meta: EntryMeta,
    data: Option<Id>,
    generation: u64,
    /// The id of its `.meta.json` (the inode's): a new one each time a meta
    /// is created or renamed over it, so that descriptors of the old file
    /// keep the old file (`Live::meta_file`).
    meta_file: Id,
    /// The meta stayed behind when the data file left with a copy of it: it
    /// still answers at `<name>.meta.json` but is not listed and is no part
    /// of the checkpoint, so that a tool renaming the meta after its data
    /// (mmv, a glob of renames) finds it. Data arriving under the name shows
    /// it again; a commit or discard drops it.
    meta_hidden: bool,
}

impl Entry {
    /// Source tensor `i`, made editable in slot `id`.
    fn of_source(i: u32, id: Id) -> Entry {
        Entry {
            origin: Some(i),
            name: None,
            meta: EntryMeta::Source,
            data: Some(id),
            generation: 0,
            meta_file: id,
            meta_hidden: false,
        }
    }

    /// A new name, with neither data nor meta yet, in slot `id`.
    fn named(name: &str, id: Id) -> Entry {
        Entry {
            origin: None,
            name: Some(name.into()),
            meta: EntryMeta::Own(Meta::None),
            data: None,
            generation: next_gen(),
            meta_file: id,
            meta_hidden: false,
        }
    }
}

enum EntrySlot {
    /// Untouched source tensor `i`: its name, its meta, and object (same id).
    Source(u32),
    Live(Box<Entry>),
    Gone,
}

enum ObjectSlot {
    /// Source tensor `i`'s bytes, held by the entry of the same id. Made a
    /// `Live` object as soon as it is opened, moved or edited.
    Source(u32),
    Live(Arc<DataObject>),
    Gone,
}

/// A name's meta, borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaView<'a> {
    None,
    Valid(Dtype, &'a [u64]),
    Invalid(&'a [u8], &'a str),
}

impl MetaView<'_> {
    pub fn exists(&self) -> bool {
        !matches!(self, MetaView::None)
    }

    pub fn to_owned(&self) -> Meta {
        match *self {
            MetaView::None => Meta::None,
            MetaView::Valid(dtype, shape) => Meta::Valid {
                dtype,
                shape: shape.to_vec(),
            },
            MetaView::Invalid(text, error) => Meta::Invalid {
                text: text.to_vec(),
                error: error.to_string(),
            },
        }
    }
}

/// An entry, borrowed. A hidden meta (see `Entry::meta_hidden`) shows as none.
pub struct EntryView<'a> {
    pub name: &'a str,
    pub meta: MetaView<'a>,
    pub data: Option<Id>,
}

/// The `.meta.json` a name shows: its file id (the inode's) and whether it is listed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaFile {
    pub id: Id,
    pub listed: bool,
}

/// A data file taken from its name by a rename.
pub struct Taken {
    /// Its id where it was taken from (kept if it stays in the same checkpoint).
    pub id: Id,
    pub object: Arc<DataObject>,
    /// The name's meta, when it moves with the bytes.
    pub meta: Option<Meta>,
}

/// Staged changes and the problems a commit would refuse, as `stfs status` shows them.
pub struct Status {
    pub file: PathBuf,
    pub changes: Vec<String>,
    pub problems: Vec<Problem>,
}

/// Tensor names hashed to entry ids; the names stay in the entries (or the header).
#[derive(Default)]
struct EntriesByName {
    table: HashTable<Id>,
    hasher: DefaultHashBuilder,
    /// Changes whenever a name comes or goes.
    generation: u64,
}

impl EntriesByName {
    fn find<'n>(&self, name: &str, name_of: impl Fn(Id) -> &'n str) -> Option<Id> {
        let hash = self.hasher.hash_one(name);
        self.table.find(hash, |&id| name_of(id) == name).copied()
    }

    fn insert<'n>(&mut self, id: Id, name: &str, name_of: impl Fn(Id) -> &'n str) {
        let hash = self.hasher.hash_one(name);
        let hasher = &self.hasher;
        self.table
            .insert_unique(hash, id, |&other| hasher.hash_one(name_of(other)));
        self.generation = next_gen();
    }

    fn remove(&mut self, id: Id, name: &str) {
        self.generation = next_gen();
        let hash = self.hasher.hash_one(name);
        if let Ok(e) = self.table.find_entry(hash, |&other| other == id) {
            e.remove();
        }
    }
}

pub struct Live {
    /// Unique among the checkpoints of the process: objects name their home by it.
    serial: u64,
    source: Arc<SourceFile>,
    /// The file name of the source: the journal's and the folder mount's key.
    key: String,
    entries: Vec<EntrySlot>,
    objects: Vec<ObjectSlot>,
    index: EntriesByName,
    /// For each source tensor, the ids of the entry and of the object that
    /// hold it (what a discard restores).
    source_ids: Vec<Id>,
    source_objects: Vec<Id>,
    metadata: MetadataDoc,
    metadata_gen: u64,
    /// A GGUF file's keys as edited (`kv/`); None for safetensors.
    kv: Option<kv::KvTable>,
    staging: Arc<Staging>,
    journal: Journal,
    /// The commit in flight, if any.
    committing: Option<Committing>,
    /// Some edit since the last commit, discard or mount.
    dirty: bool,
    /// Journal records of an operation of several steps, written as one line.
    batch: Option<Vec<Record>>,
    /// The entry of each `.meta.json` file id that is not its entry's own id.
    meta_files: HashMap<Id, Id>,
    /// The file id of `__metadata__.json`: a new one when it is made again
    /// or renamed over, like a meta's.
    metadata_file: Id,
    /// Counts changes of the state (edits, discards, commits): views are
    /// made again when it moves.
    version: u64,
    /// When the state last changed, bytes written included (nanoseconds
    /// since the epoch; 0: never): the views' modification time.
    changed: std::sync::atomic::AtomicU64,
    /// Writes that changed a tensor's length in place (its staging file
    /// grew or shrank): views lay the file out again (`views_version`).
    resized: std::sync::atomic::AtomicU64,
}

/// A commit in flight, as the journal names tensors while it runs: where
/// each source tensor it keeps goes in the new file, and where the tensor
/// written in part that each object held goes (the object's staged blocks,
/// if written again during the commit, lie over that tensor then).
struct Committing {
    /// Source index -> index in the new file (u32::MAX: not kept as it is).
    moved: Arc<Vec<u32>>,
    /// Object id -> index in the new file of the tensor written in part it held.
    patched: HashMap<Id, u32>,
}

fn source_name(source: &SourceFile, i: u32) -> &str {
    source.header().tensors.name(i as usize)
}

impl Live {
    /// Wraps a mapped source; its tensors get ids `0..n`.
    pub fn new(source: SourceFile, staging: Arc<Staging>) -> Live {
        let source = Arc::new(source);
        let n = source.header().tensors.len();
        let key = source.file_name().to_string_lossy().into_owned();
        let mut live = Live {
            serial: next_gen(),
            journal: Journal::new(format!("{key}.journal")),
            key,
            entries: (0..n as u32).map(EntrySlot::Source).collect(),
            objects: (0..n as u32).map(ObjectSlot::Source).collect(),
            index: EntriesByName::default(),
            source_ids: (0..n as Id).collect(),
            source_objects: (0..n as Id).collect(),
            metadata: MetadataDoc::Unchanged,
            metadata_gen: 0,
            kv: source.header().is_gguf().then(|| kv::KvTable::of(&source)),
            staging,
            committing: None,
            dirty: false,
            batch: None,
            meta_files: HashMap::new(),
            metadata_file: 0,
            version: 0,
            changed: Default::default(),
            resized: Default::default(),
            source,
        };
        live.metadata_file = live.new_id();
        live.rebuild_index();
        live
    }

    fn rebuild_index(&mut self) {
        let mut index = EntriesByName {
            table: HashTable::with_capacity(self.entries.len()),
            hasher: DefaultHashBuilder::default(),
            generation: next_gen(),
        };
        let (entries, source) = (&self.entries, &self.source);
        let name_of = |id: Id| slot_name(entries, source, id).unwrap_or("");
        for id in 0..entries.len() as Id {
            if let Some(name) = slot_name(entries, source, id) {
                index.insert(id, name, name_of);
            }
        }
        self.index = index;
    }

    pub fn source(&self) -> &Arc<SourceFile> {
        &self.source
    }

    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// The source's file name (unique in a folder mount).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Journals under `name` (a shard shown under a name of its own).
    pub fn name_journal(&mut self, name: &str) {
        self.journal = Journal::new(format!("{name}.shard.journal"));
    }

    pub fn staging(&self) -> &Arc<Staging> {
        &self.staging
    }

    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// One past the highest id given out.
    pub fn id_limit(&self) -> Id {
        self.entries.len() as Id
    }

    /// Changes whenever a name comes or goes (tables of names made from
    /// the entries are out of date).
    pub fn names_gen(&self) -> u64 {
        self.index.generation
    }

    pub fn find(&self, name: &str) -> Option<Id> {
        let (entries, source) = (&self.entries, &self.source);
        self.index
            .find(name, |id| slot_name(entries, source, id).unwrap_or(""))
    }

    /// The entry as the checkpoint has it (a hidden meta shows as none).
    pub fn entry(&self, id: Id) -> Option<EntryView<'_>> {
        let (mut view, hidden) = self.entry_with_hidden(id)?;
        if hidden {
            view.meta = MetaView::None;
        }
        Some(view)
    }

    /// The entry with its meta even when hidden, and whether it is.
    fn entry_with_hidden(&self, id: Id) -> Option<(EntryView<'_>, bool)> {
        let header = self.source.header();
        match self.entries.get(id as usize)? {
            EntrySlot::Gone => None,
            EntrySlot::Source(i) => {
                let t = header.tensors.get(*i as usize);
                let view = EntryView {
                    name: t.name,
                    meta: MetaView::Valid(t.dtype, t.shape),
                    data: Some(id),
                };
                Some((view, false))
            }
            EntrySlot::Live(e) => {
                let view = EntryView {
                    name: match (&e.name, e.origin) {
                        (Some(n), _) => n,
                        (None, Some(i)) => header.tensors.name(i as usize),
                        (None, None) => "",
                    },
                    meta: match (&e.meta, e.origin) {
                        (EntryMeta::Source, Some(i)) => {
                            let t = header.tensors.get(i as usize);
                            MetaView::Valid(t.dtype, t.shape)
                        }
                        (EntryMeta::Source, None) => MetaView::None,
                        (EntryMeta::Own(m), _) => view(m),
                    },
                    data: e.data,
                };
                Some((view, e.meta_hidden))
            }
        }
    }

    pub fn entry_name(&self, id: Id) -> Option<String> {
        Some(self.entry_with_hidden(id)?.0.name.to_string())
    }

    /// The `.meta.json` entry `id` shows at its name, listed or hidden.
    pub fn meta_file(&self, id: Id) -> Option<MetaFile> {
        let (view, hidden) = self.entry_with_hidden(id)?;
        if !view.meta.exists() {
            return None;
        }
        Some(MetaFile {
            id: self.meta_file_id(id),
            listed: !hidden,
        })
    }

    /// The file id of entry `id`'s meta, whether it has one now or not.
    fn meta_file_id(&self, id: Id) -> Id {
        match self.entries.get(id as usize) {
            Some(EntrySlot::Live(e)) => e.meta_file,
            _ => id,
        }
    }

    /// The entry whose `.meta.json` is file `file` now.
    pub fn meta_file_owner(&self, file: Id) -> Option<Id> {
        let entry = self.meta_files.get(&file).copied().unwrap_or(file);
        (self.meta_file(entry)?.id == file).then_some(entry)
    }

    /// The id of `__metadata__.json` (see `metadata_file`).
    pub fn metadata_file(&self) -> Id {
        self.metadata_file
    }

    /// A new `.meta.json` file for entry `id`: what descriptors hold of the
    /// old one stays theirs.
    fn renew_meta_file(&mut self, id: Id) {
        let file = self.new_id();
        if let Some(e) = self.entry_mut(id) {
            e.meta_file = file;
            e.meta_hidden = false;
        }
        self.meta_files.insert(file, id);
    }

    /// Entries from id `from` on, in id order (readdir's stable order).
    pub fn entries_from(&self, from: Id) -> impl Iterator<Item = (Id, EntryView<'_>)> {
        (from..self.id_limit()).filter_map(move |id| self.entry(id).map(|e| (id, e)))
    }

    /// An object's bytes and edit time, without materializing it.
    pub fn object(&self, id: Id) -> Option<ObjectState> {
        match self.objects.get(id as usize)? {
            ObjectSlot::Gone => None,
            ObjectSlot::Source(i) => Some(ObjectState::of(
                Bytes::Source(self.source.clone(), *i),
                None,
                0,
            )),
            ObjectSlot::Live(o) => Some(o.state()),
        }
    }

    pub fn object_len(&self, id: Id) -> Option<u64> {
        match self.objects.get(id as usize)? {
            ObjectSlot::Gone => None,
            ObjectSlot::Source(i) => Some(self.source.header().tensors.nbytes(*i as usize)),
            ObjectSlot::Live(o) => Some(o.bytes().len()),
        }
    }

    /// An object's bytes for a commit (see `DataObject::take_for_commit`: a
    /// staging file comes back pinned).
    fn object_for_commit(&self, id: Id) -> Option<ObjectState> {
        match self.objects.get(id as usize)? {
            ObjectSlot::Live(o) => Some(o.take_for_commit()),
            _ => self.object(id),
        }
    }

    /// Moves with every change of the state (for views).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The state changed now (bytes written through a descriptor, which
    /// change no version: views read them where they are).
    pub fn touch(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        self.changed
            .fetch_max(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// A write changed a tensor's length where its bytes are (no version
    /// moves for it, but every view of the checkpoint is laid out anew).
    pub fn resized(&self) {
        self.resized
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.touch();
    }

    /// Moves with every change of what a view of the checkpoint holds: the
    /// state's version, and lengths changed by writes.
    pub fn views_version(&self) -> u64 {
        self.version + self.resized.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// When the state last changed (None: not since the mount).
    pub fn changed(&self) -> Option<std::time::SystemTime> {
        match self.changed.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            n => Some(std::time::UNIX_EPOCH + std::time::Duration::from_nanos(n)),
        }
    }

    /// Entry `id` as a view's tensor, if it has bytes and a valid meta.
    pub fn view_tensor(&self, id: Id) -> Option<view::ViewTensor> {
        let e = self.entry(id)?;
        let (Some(object), MetaView::Valid(dtype, shape)) = (e.data, e.meta) else {
            return None;
        };
        Some(view::ViewTensor {
            name: e.name.to_string(),
            dtype,
            shape: shape.to_vec(),
            bytes: self.object(object)?.bytes,
        })
    }

    /// The tensors and metadata of the state as a commit would write them,
    /// for a view; what a commit would refuse, if anything.
    pub fn view_tensors(&self) -> Result<(Vec<view::ViewTensor>, Option<Metadata>), Problem> {
        if let Some(p) = self.problems().first() {
            return Err(p.clone());
        }
        let lost = |rule: &str| Problem {
            tensor: None,
            rule: rule.to_string(),
        };
        let mut tensors = Vec::new();
        for (id, e) in self.entries_from(0) {
            if let (Some(_), MetaView::Valid(..)) = (e.data, e.meta) {
                let tensor = self.view_tensor(id);
                tensors.push(tensor.ok_or_else(|| lost("a tensor's bytes are gone"))?);
            }
        }
        let metadata = self
            .metadata()
            .ok_or_else(|| lost("invalid metadata"))?
            .cloned();
        Ok((tensors, metadata))
    }

    /// The bytes of every object that is not an untouched source tensor.
    pub fn edited_bytes(&self) -> impl Iterator<Item = Bytes> + '_ {
        self.objects.iter().filter_map(|o| match o {
            ObjectSlot::Live(o) => Some(o.bytes()),
            _ => None,
        })
    }

    /// The object itself (for an open file handle).
    pub fn object_arc(&mut self, id: Id) -> Option<Arc<DataObject>> {
        let slot = self.objects.get_mut(id as usize)?;
        if let ObjectSlot::Source(i) = *slot {
            let o = DataObject::new(Bytes::Source(self.source.clone(), i), None);
            o.set_home(self.serial, id);
            *slot = ObjectSlot::Live(o);
        }
        match slot {
            ObjectSlot::Live(o) => Some(o.clone()),
            _ => None,
        }
    }

    /// What `<name>.meta.json` shows: the generated JSON, or what was written.
    pub fn meta_text(&self, id: Id) -> Option<Vec<u8>> {
        let (e, _) = self.entry_with_hidden(id)?;
        match e.meta {
            MetaView::None => None,
            MetaView::Invalid(text, _) => Some(text.to_vec()),
            // Only the meta and where the tensor lies on disk: editing the
            // bytes does not change the text (rsync --inplace sizes a file by
            // what it read before).
            MetaView::Valid(dtype, shape) => {
                let nbytes = crate::format::byte_len(dtype, shape).unwrap_or(0);
                let origin = e.data.and_then(|o| self.object(o)).and_then(|o| o.origin);
                let offsets = origin.map(|(src, i)| {
                    let h = src.header();
                    let t = h.tensors.get(i as usize);
                    (t.data_offsets, h.data_start() + t.data_offsets.0)
                });
                let gguf = self.source.header().is_gguf();
                Some(meta::render_meta(
                    dtype, shape, offsets, nbytes, e.name, gguf,
                ))
            }
        }
    }

    pub fn metadata_doc(&self) -> &MetadataDoc {
        &self.metadata
    }

    /// The metadata the checkpoint would be written with (None if invalid).
    pub fn metadata(&self) -> Option<Option<&Metadata>> {
        match &self.metadata {
            MetadataDoc::Unchanged => Some(self.source.header().metadata.as_ref()),
            MetadataDoc::Set(m) => Some(m.as_ref()),
            MetadataDoc::Removed => Some(None),
            MetadataDoc::Invalid { .. } => None,
        }
    }

    /// Whether `__metadata__.json` is there (always, for a GGUF file).
    pub fn has_metadata_file(&self) -> bool {
        self.source.header().is_gguf() || self.metadata != MetadataDoc::Removed
    }

    /// The size of `__metadata__.json`, without a copy of a GGUF file's
    /// (which holds its vocabulary).
    /// (0 when a GGUF file's keys cannot be read now: reads fail.)
    pub fn metadata_len(&self) -> Option<u64> {
        // (An unedited GGUF file's text is kept: no copy of it.)
        let kept_as_written = matches!(self.metadata, MetadataDoc::Invalid { .. });
        if let (true, false, Some(shown)) = (
            self.kv_unchanged(),
            kept_as_written,
            self.source.gguf_metadata_json(),
        ) {
            return Some(shown.map_or(0, <[u8]>::len) as u64);
        }
        self.metadata_text()
            .map_or(Some(0), |t| t.map(|t| t.len() as u64))
    }

    /// What `__metadata__.json` shows; None while it is removed. A GGUF
    /// file's: its typed keys and values, or the error reading its arrays
    /// from the file (rewritten in place since the mount, say): a reader
    /// gets EIO, never a file that looks like one without keys.
    pub fn metadata_text(&self) -> std::io::Result<Option<Vec<u8>>> {
        let unreadable = |e: std::io::Error| {
            tracing::warn!(file = %self.source.path().display(), "its keys cannot be read: {e}");
            e
        };
        if let MetadataDoc::Invalid { text, .. } = &self.metadata {
            return Ok(Some(text.clone()));
        }
        if !self.kv_unchanged() {
            return self.kv_metadata_json().map(Some).map_err(unreadable);
        }
        if let Some(shown) = self.source.gguf_metadata_json() {
            return match shown {
                Ok(text) => Ok(Some(text.to_vec())),
                Err(e) => Err(unreadable(e)),
            };
        }
        Ok(match &self.metadata {
            MetadataDoc::Removed => None,
            MetadataDoc::Invalid { text, .. } => Some(text.clone()),
            _ => Some(meta::render_metadata(self.metadata().flatten())),
        })
    }
}

fn view(m: &Meta) -> MetaView<'_> {
    match m {
        Meta::None => MetaView::None,
        Meta::Valid { dtype, shape } => MetaView::Valid(*dtype, shape),
        Meta::Invalid { text, error } => MetaView::Invalid(text, error),
    }
}

fn slot_name<'a>(entries: &'a [EntrySlot], source: &'a SourceFile, id: Id) -> Option<&'a str> {
    match entries.get(id as usize)? {
        EntrySlot::Source(i) => Some(source_name(source, *i)),
        EntrySlot::Live(e) => match (&e.name, e.origin) {
            (Some(n), _) => Some(n),
            (None, Some(i)) => Some(source_name(source, i)),
            (None, None) => None,
        },
        EntrySlot::Gone => None,
    }
}

impl ObjectSlot {
    fn is_gone(&self) -> bool {
        matches!(self, ObjectSlot::Gone)
    }
}
