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
#[cfg(test)]
mod explore;
pub mod in_place;
pub mod journal;
pub mod meta;
mod object;
pub mod recover;
pub mod staging;
pub mod transaction;
pub mod view;

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use hashbrown::{DefaultHashBuilder, HashTable};
use tracing::{info, warn};

pub use commit::{CommitError, CommitPlan, Problem};
use journal::{DataRef, Journal, Record};
pub use meta::{Meta, MetadataDoc, MAX_JSON, MAX_META};
pub use object::{DataObject, ObjectState};
use staging::Staging;

use crate::format::{printable, Dtype, Metadata};
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

/// Why an edit was refused.
#[derive(Debug)]
pub enum EditError {
    NotFound,
    Exists,
    /// The content does not fit where it goes (a meta that does not parse...).
    Invalid(String),
    /// A JSON file over its size limit (in bytes).
    TooLarge(usize),
    Staging(StagingError),
    Io(std::io::Error),
}

impl fmt::Display for EditError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EditError::NotFound => f.write_str("no such file"),
            EditError::Exists => f.write_str("exists"),
            EditError::Invalid(why) => f.write_str(why),
            EditError::TooLarge(limit) => write!(f, "a JSON file over {} KiB", limit >> 10),
            EditError::Staging(e) => write!(f, "{e}"),
            EditError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for EditError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            EditError::Staging(e) => Some(e),
            EditError::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<std::io::Error> for EditError {
    fn from(e: std::io::Error) -> Self {
        EditError::Io(e)
    }
}

impl From<StagingError> for EditError {
    fn from(e: StagingError) -> Self {
        EditError::Staging(e)
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
    gen: u64,
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
            gen: 0,
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
            gen: next_gen(),
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
struct NameIndex {
    table: HashTable<Id>,
    hasher: DefaultHashBuilder,
    /// Changes whenever a name comes or goes.
    gen: u64,
}

impl NameIndex {
    fn find<'n>(&self, name: &str, name_of: impl Fn(Id) -> &'n str) -> Option<Id> {
        let hash = self.hasher.hash_one(name);
        self.table.find(hash, |&id| name_of(id) == name).copied()
    }

    fn insert<'n>(&mut self, id: Id, name: &str, name_of: impl Fn(Id) -> &'n str) {
        let hash = self.hasher.hash_one(name);
        let hasher = &self.hasher;
        self.table
            .insert_unique(hash, id, |&other| hasher.hash_one(name_of(other)));
        self.gen = next_gen();
    }

    fn remove(&mut self, id: Id, name: &str) {
        self.gen = next_gen();
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
    index: NameIndex,
    /// For each source tensor, the ids of the entry and of the object that
    /// hold it (what a discard restores).
    source_ids: Vec<Id>,
    source_objects: Vec<Id>,
    metadata: MetadataDoc,
    metadata_gen: u64,
    staging: Arc<Staging>,
    journal: Journal,
    /// The commit in flight, if any: source index -> index in its new file.
    committing: Option<(u64, Arc<Vec<u32>>)>,
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
            index: NameIndex::default(),
            source_ids: (0..n as Id).collect(),
            source_objects: (0..n as Id).collect(),
            metadata: MetadataDoc::Unchanged,
            metadata_gen: 0,
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
        let mut index = NameIndex {
            table: HashTable::with_capacity(self.entries.len()),
            hasher: DefaultHashBuilder::default(),
            gen: next_gen(),
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
        self.index.gen
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
    pub fn view_tensors(&self) -> Result<(Vec<view::ViewTensor>, Option<Metadata>), String> {
        if let Some(p) = self.problems().first() {
            return Err(p.to_string());
        }
        let mut tensors = Vec::new();
        for (id, e) in self.entries_from(0) {
            if let (Some(_), MetaView::Valid(..)) = (e.data, e.meta) {
                tensors.push(self.view_tensor(id).ok_or("a tensor's bytes are gone")?);
            }
        }
        let metadata = self.metadata().ok_or("invalid metadata")?.cloned();
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
                Some(meta::render_meta(dtype, shape, offsets, nbytes, e.name))
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

    /// What `__metadata__.json` shows; None while it is removed.
    pub fn metadata_text(&self) -> Option<Vec<u8>> {
        match &self.metadata {
            MetadataDoc::Removed => None,
            MetadataDoc::Invalid { text, .. } => Some(text.clone()),
            _ => Some(meta::render_metadata(self.metadata().flatten())),
        }
    }

    // ---- edits ----

    fn new_id(&mut self) -> Id {
        self.entries.push(EntrySlot::Gone);
        self.objects.push(ObjectSlot::Gone);
        (self.entries.len() - 1) as Id
    }

    /// The entry as an owned `Entry` (an untouched source slot becomes one).
    fn entry_mut(&mut self, id: Id) -> Option<&mut Entry> {
        let slot = self.entries.get_mut(id as usize)?;
        if let EntrySlot::Source(i) = *slot {
            *slot = EntrySlot::Live(Box::new(Entry::of_source(i, id)));
        }
        match slot {
            EntrySlot::Live(e) => {
                e.gen = next_gen();
                Some(e)
            }
            _ => None,
        }
    }

    /// The entry of `name`, made (empty) if there is none; true if made.
    fn entry_for(&mut self, name: &str) -> (Id, bool) {
        if let Some(id) = self.find(name) {
            return (id, false);
        }
        let id = self.new_id();
        self.entries[id as usize] = EntrySlot::Live(Box::new(Entry::named(name, id)));
        let (entries, source) = (&self.entries, &self.source);
        self.index
            .insert(id, name, |id| slot_name(entries, source, id).unwrap_or(""));
        (id, true)
    }

    /// Drops an entry left with neither data nor meta (not even a hidden one).
    fn prune(&mut self, id: Id) {
        let empty = self
            .entry(id)
            .is_some_and(|e| e.data.is_none() && self.meta_file(id).is_none());
        if empty {
            let name = self
                .entry(id)
                .map(|e| e.name.to_string())
                .unwrap_or_default();
            self.index.remove(id, &name);
            self.entries[id as usize] = EntrySlot::Gone;
        }
    }

    /// Puts `object` in slot `id` and makes it the data of entry `entry`
    /// (whose meta shows again if it was hidden).
    fn attach(&mut self, entry: Id, id: Id, object: Option<Arc<DataObject>>) {
        if let Some(o) = object {
            o.set_home(self.serial, entry);
            self.objects[id as usize] = ObjectSlot::Live(o);
        } else if entry != id {
            // An untouched source object moving to another entry becomes a
            // `Live` object: `Source` slots belong to the entry of their id.
            if let Some(o) = self.object_arc(id) {
                o.set_home(self.serial, entry);
            }
        }
        let old = self.entry_mut(entry).and_then(|e| {
            e.meta_hidden = false;
            e.data.replace(id)
        });
        if let Some(old) = old.filter(|&o| o != id) {
            self.drop_object(old);
        }
    }

    /// An object no name lists any more: handles may still hold it, but
    /// what they write is no edit of this checkpoint.
    fn drop_object(&mut self, id: Id) {
        if let ObjectSlot::Live(o) =
            std::mem::replace(&mut self.objects[id as usize], ObjectSlot::Gone)
        {
            o.set_home(u64::MAX, Id::MAX);
        }
    }

    /// Makes `object` the data of `entry` for source tensor `j`, untouched,
    /// its meta shown as file `meta_file`: the compact form when all three
    /// have the same id.
    fn settle(&mut self, entry: Id, object: Id, j: u32, meta_file: Id) {
        if meta_file != entry {
            self.meta_files.insert(meta_file, entry);
        }
        let compact = entry == object
            && meta_file == entry
            && !matches!(self.objects[object as usize], ObjectSlot::Live(_));
        if compact {
            self.objects[object as usize] = ObjectSlot::Source(j);
            self.entries[entry as usize] = EntrySlot::Source(j);
            return;
        }
        match &self.objects[object as usize] {
            ObjectSlot::Live(o) => o.set_home(self.serial, entry),
            _ => {
                let o = DataObject::new(Bytes::Source(self.source.clone(), j), None);
                o.set_home(self.serial, entry);
                self.objects[object as usize] = ObjectSlot::Live(o);
            }
        }
        self.entries[entry as usize] = EntrySlot::Live(Box::new(Entry {
            data: Some(object),
            meta_file,
            ..Entry::of_source(j, entry)
        }));
    }

    fn mark(&mut self, names: &[&str]) {
        self.dirty = true;
        let records: Vec<Record> = names.iter().map(|n| self.record_of(n)).collect();
        self.log(records);
    }

    /// A new, empty data file under `name` (which keeps its meta). Exists if
    /// the name has a data file already.
    pub fn create_data(&mut self, name: &str) -> Result<(Id, Arc<DataObject>), EditError> {
        let (entry, made) = self.entry_for(name);
        if self.entry(entry).is_some_and(|e| e.data.is_some()) {
            return Err(EditError::Exists);
        }
        // A new name's data file takes the id of its entry (inodes 2i, 2i+1);
        // an id whose object was ever used is never given to another one.
        let id = if made { entry } else { self.new_id() };
        let object = DataObject::new(Bytes::Empty, Some(SystemTime::now()));
        self.attach(entry, id, Some(object.clone()));
        self.mark(&[name]);
        Ok((id, object))
    }

    /// Makes `name.meta.json` exist (empty, so not yet valid) if it does
    /// not: a new file. Returns the entry.
    pub fn create_meta(&mut self, name: &str) -> Id {
        let (id, made) = self.entry_for(name);
        if self.meta_file(id).is_none() {
            if !made {
                self.renew_meta_file(id);
            }
            if let Some(e) = self.entry_mut(id) {
                e.meta = EntryMeta::Own(Meta::parse(b""));
            }
            self.mark(&[name]);
        }
        id
    }

    /// Applies what was written to `name.meta.json`: in place (`replace`
    /// false: a descriptor's write; the file stays the same file) or as a
    /// file renamed over it (a new file). Text that does not parse is kept
    /// as it is (shown by `cat`, refused by a commit): the reason is
    /// returned. A meta never makes the data file appear (a copy of the meta
    /// before the data must not make the data's O_EXCL create fail); one
    /// that gives an empty, meta-less data file its size fills it with zeros.
    pub fn set_meta(
        &mut self,
        name: &str,
        text: &[u8],
        replace: bool,
    ) -> Result<Option<String>, EditError> {
        if text.len() > MAX_META {
            return Err(EditError::TooLarge(MAX_META));
        }
        let meta = Meta::parse(text);
        let (id, made) = self.entry_for(name);
        // A meta made by opening `x.meta.json` and not yet written does not count.
        let (had_meta, data) = match self.entry(id) {
            Some(e) => (
                !matches!(e.meta, MetaView::None | MetaView::Invalid(b"", _)),
                e.data,
            ),
            None => (false, None),
        };
        if !made && (replace || self.meta_file(id).is_none()) {
            self.renew_meta_file(id);
        }
        let error = match &meta {
            Meta::Invalid { error, .. } => Some(error.clone()),
            _ => None,
        };
        let fill = meta.nbytes();
        if let Some(e) = self.entry_mut(id) {
            e.meta = EntryMeta::Own(meta);
            e.meta_hidden = false;
        }
        if let (Some(len), Some(o)) = (fill, data) {
            if !had_meta && self.object_len(o) == Some(0) {
                if let Some(object) = self.object_arc(o) {
                    object.truncate(&self.staging, len)?;
                }
            }
        }
        self.mark(&[name]);
        Ok(error)
    }

    /// Applies what was written to `__metadata__.json`, in place or (`replace`)
    /// as a file renamed over it (kept as written if it does not parse; the
    /// reason is returned).
    pub fn set_metadata(
        &mut self,
        text: &[u8],
        replace: bool,
    ) -> Result<Option<String>, EditError> {
        if text.len() > MAX_JSON {
            return Err(EditError::TooLarge(MAX_JSON));
        }
        if replace || self.metadata == MetadataDoc::Removed {
            self.metadata_file = self.new_id();
        }
        self.metadata = MetadataDoc::parse(text);
        self.metadata_gen = next_gen();
        self.dirty = true;
        let doc = self.metadata.clone();
        self.log(vec![Record::Metadata { doc: doc.clone() }]);
        Ok(match doc {
            MetadataDoc::Invalid { error, .. } => Some(error),
            _ => None,
        })
    }

    /// `__metadata__.json` made again after a removal: `{}` until written.
    pub fn create_metadata(&mut self) {
        if self.metadata == MetadataDoc::Removed {
            let _ = self.set_metadata(b"{}", false);
        }
    }

    /// Removes `__metadata__.json`: no metadata.
    pub fn remove_metadata(&mut self) {
        self.metadata = MetadataDoc::Removed;
        self.metadata_gen = next_gen();
        self.dirty = true;
        self.log(vec![Record::Metadata {
            doc: MetadataDoc::Removed,
        }]);
    }

    /// Removes the data file of `name`; its meta stays until removed too (or
    /// until a commit, which drops a meta without data).
    pub fn unlink_data(&mut self, name: &str) -> Result<(), EditError> {
        let id = self.find(name).ok_or(EditError::NotFound)?;
        let data = self
            .entry(id)
            .and_then(|e| e.data)
            .ok_or(EditError::NotFound)?;
        self.drop_object(data);
        if let Some(e) = self.entry_mut(id) {
            e.data = None;
        }
        self.prune(id);
        self.mark(&[name]);
        Ok(())
    }

    /// Removes `name.meta.json` (listed or hidden): the data file stays,
    /// without dtype and shape.
    pub fn unlink_meta(&mut self, name: &str) -> Result<(), EditError> {
        let id = self.find(name).ok_or(EditError::NotFound)?;
        if self.meta_file(id).is_none() {
            return Err(EditError::NotFound);
        }
        if let Some(e) = self.entry_mut(id) {
            e.meta = EntryMeta::Own(Meta::None);
            e.meta_hidden = false;
        }
        self.prune(id);
        self.mark(&[name]);
        Ok(())
    }

    /// Takes the data file of `name` away (for a rename), with a copy of the
    /// name's meta if `with_meta` and it has one; the name keeps that meta,
    /// hidden (see `Entry::meta_hidden`).
    pub fn take_data(&mut self, name: &str, with_meta: bool) -> Result<Taken, EditError> {
        let entry = self.find(name).ok_or(EditError::NotFound)?;
        let view = self.entry(entry).ok_or(EditError::NotFound)?;
        let id = view.data.ok_or(EditError::NotFound)?;
        let meta = (with_meta && view.meta.exists()).then(|| view.meta.to_owned());
        let object = self.object_arc(id).ok_or(EditError::NotFound)?;
        self.objects[id as usize] = ObjectSlot::Gone;
        if let Some(e) = self.entry_mut(entry) {
            e.data = None;
            e.meta_hidden = meta.is_some();
        }
        self.prune(entry);
        self.mark(&[name]);
        Ok(Taken { id, object, meta })
    }

    /// Puts a data file under `name`, replacing its data file; the name keeps
    /// its meta unless the file brings one. `same_checkpoint`: `taken.id` is
    /// an id of this checkpoint and is kept (so is the kernel's inode).
    pub fn put_data(&mut self, name: &str, taken: Taken, same_checkpoint: bool) {
        let (entry, _) = self.entry_for(name);
        let id = if same_checkpoint
            && self
                .objects
                .get(taken.id as usize)
                .is_some_and(ObjectSlot::is_gone)
        {
            taken.id
        } else {
            self.new_id()
        };
        self.attach(entry, id, Some(taken.object));
        if let Some(meta) = taken.meta {
            self.renew_meta_file(entry);
            if let Some(e) = self.entry_mut(entry) {
                e.meta = EntryMeta::Own(meta);
            }
        }
        self.mark(&[name]);
    }

    /// A new data file holding `data` (a JSON file renamed onto a data name).
    pub fn staged_object(&self, data: &[u8]) -> Result<Taken, EditError> {
        let file = self.staging.dir()?.file_with(data)?;
        Ok(Taken {
            id: Id::MAX,
            object: DataObject::new(Bytes::Staged(file), Some(SystemTime::now())),
            meta: None,
        })
    }

    /// A data write or truncation of `object`, listed here (see
    /// `DataObject::home`): the checkpoint has edits, and if the bytes moved
    /// to a new staging file (`moved`), the journal must say where they are.
    pub fn object_written(&mut self, object: &Arc<DataObject>, moved: bool) {
        self.dirty = true;
        if !moved {
            return;
        }
        let (_, entry) = object.home();
        let listed = self.entry(entry).and_then(|e| e.data).is_some_and(|d| {
            matches!(self.objects.get(d as usize), Some(ObjectSlot::Live(o)) if Arc::ptr_eq(o, object))
        });
        if listed {
            let name = self
                .entry(entry)
                .map(|e| e.name.to_string())
                .unwrap_or_default();
            self.mark(&[&name]);
        }
    }

    // ---- journal ----

    /// The journal records of the edits until `end_batch` go in one line:
    /// an operation of several steps (a rename) is journaled whole or not at all.
    pub fn begin_batch(&mut self) {
        self.batch.get_or_insert_with(Vec::new);
    }

    pub fn end_batch(&mut self) {
        if let Some(records) = self.batch.take() {
            self.log(records);
        }
    }

    fn data_ref(&self, id: Id) -> DataRef {
        let bytes = match self.objects.get(id as usize) {
            Some(ObjectSlot::Source(i)) => Bytes::Source(self.source.clone(), *i),
            Some(ObjectSlot::Live(o)) => o.bytes(),
            _ => Bytes::Empty,
        };
        match bytes {
            Bytes::Empty => DataRef::Empty,
            Bytes::Staged(s) => DataRef::Staged { file: s.name() },
            Bytes::Source(src, index) => {
                let own = Arc::ptr_eq(&src, &self.source);
                DataRef::Source {
                    shard: (!own).then(|| src.file_name().to_string_lossy().into_owned()),
                    version: (!own).then(|| *src.stat()),
                    index,
                    committed: self
                        .committing
                        .as_ref()
                        .filter(|_| own)
                        .and_then(|(_, moved)| moved.get(index as usize).copied())
                        .filter(|&j| j != u32::MAX),
                }
            }
        }
    }

    /// The journal record of a name's current state.
    fn record_of(&self, name: &str) -> Record {
        match self.find(name).and_then(|id| self.entry(id)) {
            None => Record::Gone { name: name.into() },
            Some(e) => Record::Entry {
                name: name.into(),
                meta: e.meta.to_owned(),
                data: e.data.map(|d| self.data_ref(d)),
            },
        }
    }

    fn begin_record(&self) -> Record {
        Record::Begin {
            version: journal::VERSION,
            source: self.source.path().to_path_buf(),
            stat: *self.source.stat(),
        }
    }

    fn log(&mut self, mut records: Vec<Record>) {
        self.version += 1;
        self.touch();
        if let Some(batch) = &mut self.batch {
            batch.append(&mut records);
            return;
        }
        if records.is_empty() {
            return;
        }
        let result = self
            .staging
            .dir()
            .map_err(|e| e.to_string())
            .and_then(|d| d.folder().map_err(|e| e.to_string()))
            .and_then(|folder| {
                let begin = self.begin_record();
                self.journal
                    .append(&folder, || begin, &records)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = result {
            if !self.journal.broken {
                warn!(file = %self.source.path().display(), "journal of staged edits: {e}; \
                      edits stay in memory, and are written to the journal again at the next fsync");
            }
            self.journal.broken = true;
            return;
        }
        // Keep the journal within a few times the live edits.
        if self.committing.is_none() && self.journal.wants_snapshot(self.entries.len()) {
            if let Err(e) = self.snapshot() {
                warn!("rewriting the journal: {e}");
            }
        }
    }

    /// Every edit, as journal records: the source names gone, then every
    /// changed or new entry, then the metadata.
    fn overlay(&self) -> Vec<Record> {
        let mut gone = Vec::new();
        for (i, &id) in self.source_ids.iter().enumerate() {
            if !self.untouched(id, i as u32) {
                gone.push(Record::Gone {
                    name: source_name(&self.source, i as u32).to_string(),
                });
            }
        }
        let mut records = gone;
        for (id, e) in self.entries_from(0) {
            let untouched = match self.entries[id as usize] {
                EntrySlot::Source(i) => self.untouched(id, i),
                EntrySlot::Live(ref l) => l.origin.is_some_and(|i| self.untouched(id, i)),
                EntrySlot::Gone => true,
            };
            if !untouched {
                records.push(Record::Entry {
                    name: e.name.to_string(),
                    meta: e.meta.to_owned(),
                    data: e.data.map(|d| self.data_ref(d)),
                });
            }
        }
        if self.metadata != MetadataDoc::Unchanged {
            records.push(Record::Metadata {
                doc: self.metadata.clone(),
            });
        }
        records
    }

    /// Whether entry `id` is source tensor `i` exactly: its name, meta and bytes.
    fn untouched(&self, id: Id, i: u32) -> bool {
        let entry_ok = match self.entries.get(id as usize) {
            Some(EntrySlot::Source(j)) => *j == i,
            Some(EntrySlot::Live(e)) => {
                e.origin == Some(i)
                    && e.name
                        .as_deref()
                        .is_none_or(|n| n == source_name(&self.source, i))
                    && match &e.meta {
                        EntryMeta::Source => true,
                        EntryMeta::Own(m) => {
                            let t = self.source.header().tensors.get(i as usize);
                            *m == Meta::Valid {
                                dtype: t.dtype,
                                shape: t.shape.to_vec(),
                            }
                        }
                    }
                    && e.data.is_some_and(|d| self.object_is_source(d, i))
            }
            _ => false,
        };
        entry_ok
            && match self.entries.get(id as usize) {
                Some(EntrySlot::Source(_)) => self.object_is_source(id, i),
                _ => true,
            }
    }

    fn object_is_source(&self, id: Id, i: u32) -> bool {
        match self.objects.get(id as usize) {
            Some(ObjectSlot::Source(j)) => *j == i,
            Some(ObjectSlot::Live(o)) => o.bytes().same(&Bytes::Source(self.source.clone(), i)),
            _ => false,
        }
    }

    /// Rewrites the journal as one snapshot of the edits.
    fn snapshot(&mut self) -> std::io::Result<()> {
        let Some(dir) = self.staging.current() else {
            return Ok(());
        };
        let mut records = vec![self.begin_record()];
        records.extend(self.overlay());
        self.journal.rewrite(&dir, &records)
    }

    /// Makes every journaled edit durable (fsync, close): the journal is
    /// fsynced (rewritten first if an append had failed).
    pub fn sync_journal(&mut self) -> Result<(), EditError> {
        if self.journal.broken {
            self.snapshot()?;
        }
        Ok(self.journal.sync()?)
    }

    // ---- status ----

    /// Staged changes, and every problem a commit would refuse.
    pub fn status(&self) -> Status {
        let mut changes = Vec::new();
        let header = self.source.header();
        let mut renamed_from = std::collections::HashSet::new();
        for (id, e) in self.entries_from(0) {
            if e.data.is_none() && !e.meta.exists() {
                continue; // only a hidden meta: no part of the checkpoint
            }
            let origin = match &self.entries[id as usize] {
                EntrySlot::Source(i) => Some(*i),
                EntrySlot::Live(l) => l.origin,
                EntrySlot::Gone => None,
            };
            // Where its bytes came from, if a source tensor.
            let bytes_from = e.data.and_then(|d| match self.object(d)?.bytes {
                Bytes::Source(src, i) if Arc::ptr_eq(&src, &self.source) => Some(i),
                _ => None,
            });
            let shape_of = |m: &MetaView| match *m {
                MetaView::Valid(d, s) => format!("{d} {}", crate::format::ShapeDisplay(s)),
                _ => "no dtype".into(),
            };
            match (origin, bytes_from) {
                (_, Some(i)) if source_name(&self.source, i) != e.name => {
                    renamed_from.insert(i);
                    changes.push(format!(
                        "renamed    {} -> {}",
                        printable(source_name(&self.source, i)),
                        printable(e.name)
                    ));
                }
                (None, _) if e.data.is_some() => {
                    changes.push(format!(
                        "added      {} ({})",
                        printable(e.name),
                        shape_of(&e.meta)
                    ));
                    continue;
                }
                (None, _) => {
                    changes.push(format!(
                        "meta       {}.meta.json without a data file",
                        printable(e.name)
                    ));
                    continue;
                }
                _ => {}
            }
            let Some(i) = origin.or(bytes_from) else {
                continue;
            };
            let t = header.tensors.get(i as usize);
            let source_meta = MetaView::Valid(t.dtype, t.shape);
            if e.meta != source_meta {
                changes.push(format!(
                    "reshaped   {}: {} -> {}",
                    printable(e.name),
                    shape_of(&source_meta),
                    shape_of(&e.meta)
                ));
            }
            match e.data {
                None => changes.push(format!(
                    "removed    {} (its .meta.json stays until the commit)",
                    printable(e.name)
                )),
                Some(_) if bytes_from.is_none() => {
                    changes.push(format!("rewritten  {}", printable(e.name)))
                }
                Some(_) => {}
            }
        }
        for (i, &id) in self.source_ids.iter().enumerate() {
            let i = i as u32;
            let still_there = self.entry(id).is_some_and(|e| {
                e.name == source_name(&self.source, i) && (e.data.is_some() || e.meta.exists())
            });
            if !still_there && !renamed_from.contains(&i) {
                changes.push(format!(
                    "removed    {}",
                    printable(source_name(&self.source, i))
                ));
            }
        }
        match &self.metadata {
            MetadataDoc::Unchanged => {}
            MetadataDoc::Removed => changes.push("metadata   removed".into()),
            MetadataDoc::Set(m) => {
                let pairs: Vec<String> = m
                    .iter()
                    .flatten()
                    .map(|(k, v)| format!("{k:?}: {v:?}"))
                    .collect();
                changes.push(format!("metadata   {{{}}}", pairs.join(", ")))
            }
            MetadataDoc::Invalid { .. } => {}
        }
        Status {
            file: self.source.path().to_path_buf(),
            changes,
            problems: self.problems(),
        }
    }

    /// Everything a commit would refuse.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        for (_, e) in self.entries_from(0) {
            if e.name == RESERVED && e.data.is_some() {
                problems.push(Problem {
                    tensor: Some(e.name.to_string()),
                    rule: "cannot be a tensor's name: the header keeps it for the metadata (rename it)"
                        .into(),
                });
                continue;
            }
            let rule = match (e.data, e.meta) {
                (Some(_), MetaView::None) => {
                    Some("has no dtype and shape: write its .meta.json, or remove the file".into())
                }
                (_, MetaView::Invalid(_, why)) => Some(format!("has an invalid .meta.json: {why}")),
                (Some(d), MetaView::Valid(dtype, shape)) => {
                    let len = self.object_len(d).unwrap_or(0);
                    match crate::format::byte_len(dtype, shape) {
                        Ok(need) if need == len => None,
                        Ok(need) => Some(format!(
                            "holds {len} bytes but {dtype} {} needs {need}",
                            crate::format::ShapeDisplay(shape)
                        )),
                        Err(err) => Some(meta::size_message("", dtype, shape, err)),
                    }
                }
                (None, _) => None,
            };
            if let Some(rule) = rule {
                problems.push(Problem {
                    tensor: Some(e.name.to_string()),
                    rule,
                });
            }
        }
        if let MetadataDoc::Invalid { error, .. } = &self.metadata {
            problems.push(Problem {
                tensor: None,
                rule: format!("__metadata__.json {error}"),
            });
        }
        problems
    }

    // ---- discard and resume ----

    /// Drops every staged edit: the checkpoint is the source again. Names
    /// keep their ids; bytes that were not edited keep theirs too (their
    /// inodes), edited ones come back under a fresh id, so that no page the
    /// kernel cached of the edited file is served as the source's.
    pub fn discard(&mut self) {
        self.version += 1;
        self.touch();
        let len = self.entries.len();
        let old_objects = std::mem::replace(
            &mut self.objects,
            (0..len).map(|_| ObjectSlot::Gone).collect(),
        );
        // A meta shown now keeps its file (its inode); one removed, hidden
        // or replaced comes back as a new file, so that no descriptor of a
        // removed file is given the restored one.
        let shown: Vec<Option<Id>> = self
            .source_ids
            .iter()
            .map(|&e| self.meta_file(e).filter(|f| f.listed).map(|f| f.id))
            .collect();
        self.entries = (0..len).map(|_| EntrySlot::Gone).collect();
        self.meta_files.clear();
        let mut kept = vec![false; len];
        for (j, shown) in shown.into_iter().enumerate() {
            let (e, o) = (self.source_ids[j], self.source_objects[j]);
            let unedited = match &old_objects[o as usize] {
                ObjectSlot::Source(i) => *i as usize == j,
                ObjectSlot::Live(x) => x
                    .bytes()
                    .same(&Bytes::Source(self.source.clone(), j as u32)),
                ObjectSlot::Gone => false,
            };
            let o = if unedited {
                kept[o as usize] = true;
                self.objects[o as usize] = match &old_objects[o as usize] {
                    ObjectSlot::Live(x) => ObjectSlot::Live(x.clone()),
                    _ => ObjectSlot::Source(j as u32),
                };
                o
            } else {
                self.new_id()
            };
            self.source_objects[j] = o;
            let meta_file = match shown {
                Some(f) => f,
                None => self.new_id(),
            };
            self.settle(e, o, j as u32, meta_file);
        }
        for (id, slot) in old_objects.into_iter().enumerate() {
            if let ObjectSlot::Live(o) = slot {
                if !kept[id] {
                    o.set_home(u64::MAX, Id::MAX);
                }
            }
        }
        self.rebuild_index();
        if self.metadata == MetadataDoc::Removed {
            self.metadata_file = self.new_id();
        }
        self.metadata = MetadataDoc::Unchanged;
        self.metadata_gen = next_gen();
        self.dirty = false;
        if let Some(dir) = self.staging.current() {
            self.journal.remove(&dir);
        }
    }

    /// Takes back the edits a journal holds (see `journal::fold`). Source
    /// tensors of other checkpoints of a folder mount come from `shard`.
    /// Returns the names restored and notes for the user.
    pub fn replay(
        &mut self,
        folded: journal::Folded,
        dir: &Arc<StagingDir>,
        shard: &dyn Fn(&str) -> Option<Arc<SourceFile>>,
    ) -> (usize, Vec<String>) {
        self.version += 1;
        self.touch();
        let mut notes: Vec<String> = folded
            .dropped
            .iter()
            .map(|n| {
                format!("tensor {n:?}: its bytes were not in the committed file; not restored")
            })
            .collect();
        let mut restored = 0;
        for (name, state) in folded.names {
            let existing = self.find(&name);
            let Some((meta, data)) = state else {
                if let Some(id) = existing {
                    if let Some(d) = self.entry(id).and_then(|e| e.data) {
                        self.objects[d as usize] = ObjectSlot::Gone;
                    }
                    if let Some(e) = self.entry_mut(id) {
                        e.data = None;
                        e.meta = EntryMeta::Own(Meta::None);
                    }
                    self.prune(id);
                }
                restored += 1;
                continue;
            };
            let object = match data {
                None => None,
                Some(DataRef::Empty) => Some(Bytes::Empty),
                Some(DataRef::Staged { file }) => match dir.existing(&file) {
                    Ok(f) => Some(Bytes::Staged(f)),
                    Err(e) => {
                        notes.push(format!(
                            "tensor {name:?}: staged file {file}: {e}; not restored"
                        ));
                        continue;
                    }
                },
                Some(DataRef::Source {
                    shard: None, index, ..
                }) if (index as usize) < self.source_ids.len() => {
                    Some(Bytes::Source(self.source.clone(), index))
                }
                Some(DataRef::Source {
                    shard: Some(s),
                    version,
                    index,
                    ..
                }) => match shard(&s) {
                    // The index is of a version of that shard: not of another.
                    Some(src)
                        if (index as usize) < src.header().tensors.len()
                            && version.is_none_or(|v| v.same_version(src.stat())) =>
                    {
                        Some(Bytes::Source(src, index))
                    }
                    _ => {
                        notes.push(format!(
                            "tensor {name:?}: its bytes were in {s}, which is gone or changed since; not restored"
                        ));
                        continue;
                    }
                },
                Some(DataRef::Source { index, .. }) => {
                    notes.push(format!(
                        "tensor {name:?}: source tensor {index} does not exist; not restored"
                    ));
                    continue;
                }
            };
            let (entry, _) = self.entry_for(&name);
            if let Some(bytes) = object {
                let id = self.new_id();
                // The object holding a source tensor is what a discard keeps.
                if let Bytes::Source(src, i) = &bytes {
                    if Arc::ptr_eq(src, &self.source) {
                        self.source_objects[*i as usize] = id;
                    }
                }
                let edited = (!matches!(bytes, Bytes::Source(..))).then(SystemTime::now);
                self.attach(entry, id, Some(DataObject::new(bytes, edited)));
            } else if let Some(d) = self.entry(entry).and_then(|e| e.data) {
                self.objects[d as usize] = ObjectSlot::Gone;
                if let Some(e) = self.entry_mut(entry) {
                    e.data = None;
                }
            }
            if let Some(e) = self.entry_mut(entry) {
                e.meta = EntryMeta::Own(meta);
            }
            self.prune(entry);
            restored += 1;
        }
        if let Some(doc) = folded.metadata {
            self.metadata = doc;
            self.metadata_gen = next_gen();
        }
        self.dirty = true;
        if let Err(e) = self.snapshot() {
            notes.push(format!("rewriting the journal: {e}"));
        }
        self.dirty = !self.overlay().is_empty();
        info!(file = %self.source.path().display(), restored, "edits taken back from the journal");
        (restored, notes)
    }

    pub fn journal_name(&self) -> &str {
        self.journal.name()
    }

    /// The journal, to fsync outside the state's lock; None when there is
    /// none, or when a snapshot must be written first (`sync_journal`).
    pub fn journal_handle(&self) -> Option<Arc<std::fs::File>> {
        (!self.journal.broken)
            .then(|| self.journal.handle())
            .flatten()
    }

    /// An append failed: `sync_journal` must rewrite the journal.
    pub fn journal_broken(&self) -> bool {
        self.journal.broken
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
