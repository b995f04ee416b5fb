//! Edits of a live checkpoint: data and meta files made, written, renamed
//! and removed, each journaled.

use super::*;

impl Live {
    // ---- edits ----

    pub(super) fn new_id(&mut self) -> Id {
        self.entries.push(EntrySlot::Gone);
        self.objects.push(ObjectSlot::Gone);
        (self.entries.len() - 1) as Id
    }

    /// The entry as an owned `Entry` (an untouched source slot becomes one).
    pub(super) fn entry_mut(&mut self, id: Id) -> Option<&mut Entry> {
        let slot = self.entries.get_mut(id as usize)?;
        if let EntrySlot::Source(i) = *slot {
            *slot = EntrySlot::Live(Box::new(Entry::of_source(i, id)));
        }
        match slot {
            EntrySlot::Live(e) => {
                e.generation = next_gen();
                Some(e)
            }
            _ => None,
        }
    }

    /// The entry of `name`, made (empty) if there is none; true if made.
    pub(super) fn entry_for(&mut self, name: &str) -> (Id, bool) {
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
    pub(super) fn prune(&mut self, id: Id) {
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
    pub(super) fn attach(&mut self, entry: Id, id: Id, object: Option<Arc<DataObject>>) {
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
    pub(super) fn drop_object(&mut self, id: Id) {
        if let ObjectSlot::Live(o) =
            std::mem::replace(&mut self.objects[id as usize], ObjectSlot::Gone)
        {
            o.set_home(u64::MAX, Id::MAX);
        }
    }

    /// Makes `object` the data of `entry` for source tensor `j`, untouched,
    /// its meta shown as file `meta_file`: the compact form when all three
    /// have the same id.
    pub(super) fn settle(&mut self, entry: Id, object: Id, j: u32, meta_file: Id) {
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

    pub(super) fn mark(&mut self, names: &[&str]) -> Result<(), EditError> {
        self.dirty = true;
        let records: Vec<Record> = names.iter().map(|n| self.record_of(n)).collect();
        self.log(records)
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
        // Appended at the end of the data, most likely (where a commit in
        // place puts new tensors).
        if self.source.file().is_some() {
            let h = self.source.header();
            let end = h.data_start() + h.data_len() + self.source.shift();
            object.set_append_pad(end % crate::source::staged::STAGING_ALIGN);
        }
        self.attach(entry, id, Some(object.clone()));
        self.mark(&[name])?;
        Ok((id, object))
    }

    /// Makes `name.meta.json` exist (empty, so not yet valid) if it does
    /// not: a new file. Returns the entry.
    pub fn create_meta(&mut self, name: &str) -> Result<Id, EditError> {
        let (id, made) = self.entry_for(name);
        if self.meta_file(id).is_none() {
            if !made {
                self.renew_meta_file(id);
            }
            if let Some(e) = self.entry_mut(id) {
                e.meta = EntryMeta::Own(Meta::parse(b""));
            }
            self.mark(&[name])?;
        }
        Ok(id)
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
        self.mark(&[name])?;
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
        if self.kv.is_some() {
            // (A GGUF file's keys: one state with `__kv__`. A document that
            // is not one of keys is kept as written, as any JSON file: shown,
            // listed by `stfs status`, refused by a commit, until a document
            // of keys or an edit of a key replaces it.)
            return match self.kv_set_document(text) {
                Ok(()) => {
                    if matches!(self.metadata, MetadataDoc::Invalid { .. }) {
                        self.metadata = MetadataDoc::Unchanged;
                        self.metadata_gen = next_gen();
                        self.log(vec![Record::Metadata {
                            doc: MetadataDoc::Unchanged,
                        }])?;
                    }
                    Ok(None)
                }
                Err(EditError::Invalid(error)) => {
                    self.metadata = MetadataDoc::Invalid {
                        text: text.to_vec(),
                        error: error.clone(),
                    };
                    self.metadata_gen = next_gen();
                    self.dirty = true;
                    let doc = self.metadata.clone();
                    self.log(vec![Record::Metadata { doc }])?;
                    Ok(Some(error))
                }
                Err(e) => Err(e),
            };
        }
        if replace || self.metadata == MetadataDoc::Removed {
            self.metadata_file = self.new_id();
        }
        self.metadata = MetadataDoc::parse(text);
        self.metadata_gen = next_gen();
        self.dirty = true;
        let doc = self.metadata.clone();
        self.log(vec![Record::Metadata { doc: doc.clone() }])?;
        Ok(match doc {
            MetadataDoc::Invalid { error, .. } => Some(error),
            _ => None,
        })
    }

    /// `__metadata__.json` made again after a removal: `{}` until written.
    pub fn create_metadata(&mut self) -> Result<(), EditError> {
        if self.metadata == MetadataDoc::Removed {
            self.set_metadata(b"{}", false)?;
        }
        Ok(())
    }

    /// Removes `__metadata__.json`: no metadata.
    pub fn remove_metadata(&mut self) -> Result<(), EditError> {
        self.metadata = MetadataDoc::Removed;
        self.metadata_gen = next_gen();
        self.dirty = true;
        self.log(vec![Record::Metadata {
            doc: MetadataDoc::Removed,
        }])
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
        self.mark(&[name])
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
        self.mark(&[name])
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
        self.mark(&[name])?;
        Ok(Taken { id, object, meta })
    }

    /// Puts a data file under `name`, replacing its data file; the name keeps
    /// its meta unless the file brings one. `same_checkpoint`: `taken.id` is
    /// an id of this checkpoint and is kept (so is the kernel's inode).
    pub fn put_data(
        &mut self,
        name: &str,
        taken: Taken,
        same_checkpoint: bool,
    ) -> Result<(), EditError> {
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
        self.mark(&[name])
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
    pub fn object_written(
        &mut self,
        object: &Arc<DataObject>,
        moved: bool,
    ) -> Result<(), EditError> {
        self.dirty = true;
        if !moved {
            return Ok(());
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
            self.mark(&[&name])?;
        }
        Ok(())
    }

    /// Blocks of a partly staged tensor written (`Changed::patched`): the
    /// journal adds them to that staging file's runs.
    pub fn object_patched(&mut self, file: String, runs: Vec<(u64, u64)>) -> Result<(), EditError> {
        self.dirty = true;
        self.touch();
        self.journal_records(vec![Record::Patch { file, runs }])
    }

    // ---- journal ----

    /// The journal records of the edits until `end_batch` go in one line:
    /// an operation of several steps (a rename) is journaled whole or not at all.
    pub fn begin_batch(&mut self) {
        self.batch.get_or_insert_with(Vec::new);
    }

    /// Forgets the batch (its operation failed half-way): the journal is
    /// rewritten from the state at the next edit or fsync.
    pub fn abandon_batch(&mut self) {
        if self.batch.take().is_some_and(|b| !b.is_empty()) {
            self.journal.broken = true;
        }
    }

    pub fn end_batch(&mut self) -> Result<(), EditError> {
        match self.batch.take() {
            Some(records) => self.log(records),
            None => Ok(()),
        }
    }

    // ---- discard and resume ----

    /// Drops every staged edit: the checkpoint is the source again. Names
    /// keep their ids; bytes that were not edited keep theirs too (their
    /// inodes), edited ones come back under a fresh id, so that no page the
    /// kernel cached of the edited file is served as the source's.
    /// The journal goes first: if it cannot, nothing is discarded (a
    /// journal left would bring the edits back at the next mount).
    pub fn discard(&mut self) -> Result<(), EditError> {
        if let Some(dir) = self.staging.current() {
            // (Durable before anything journaled after it: a journal back
            // after a crash would bring the edits back.)
            self.journal.remove(&dir)?;
            dir.folder().and_then(|f| f.sync())?;
        }
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
        if self.kv.is_some() {
            self.kv = Some(kv::KvTable::of(&self.source));
        }
        self.dirty = false;
        Ok(())
    }
}
