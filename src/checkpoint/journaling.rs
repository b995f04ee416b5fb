//! A live checkpoint's journal: the record of each edit, snapshots that
//! rewrite it whole, and the replay that takes the edits back after a
//! crash (`journal.rs` holds the format).

use super::recovery_error::RecoveryError;
use super::*;

impl Live {
    pub(super) fn data_ref(&self, id: Id) -> DataRef {
        let bytes = match self.objects.get(id as usize) {
            Some(ObjectSlot::Source(i)) => Bytes::Source(self.source.clone(), *i),
            Some(ObjectSlot::Live(o)) => o.bytes(),
            _ => Bytes::Empty,
        };
        match bytes {
            Bytes::Empty => DataRef::Empty,
            Bytes::Staged(s) => DataRef::Staged { file: s.name() },
            Bytes::Source(src, index) => self.source_ref(&src, index, None),
            Bytes::Patched(p) => {
                // (A commit in flight took these blocks: they lie over its
                // tensor in the new file, not over the source tensor's place.)
                let took = self
                    .committing
                    .as_ref()
                    .and_then(|c| c.patched.get(&id).copied());
                DataRef::Patched {
                    file: p.staged().name(),
                    base: Box::new(self.source_ref(p.base().0, p.base().1, took)),
                    runs: p.runs(),
                }
            }
        }
    }

    /// A reference to tensor `index` of `src`; `committed`: its index in
    /// the file of the commit in flight, if not the source tensor's own.
    fn source_ref(&self, src: &Arc<SourceFile>, index: u32, committed: Option<u32>) -> DataRef {
        let own = Arc::ptr_eq(src, &self.source);
        DataRef::Source {
            shard: (!own).then(|| src.file_name().to_string_lossy().into_owned()),
            version: (!own).then(|| *src.stat()),
            index,
            committed: committed.filter(|_| own).or_else(|| {
                self.committing
                    .as_ref()
                    .filter(|_| own)
                    .and_then(|c| c.moved.get(index as usize).copied())
                    .filter(|&j| j != u32::MAX)
            }),
        }
    }

    /// The source tensor a journal's `DataRef::Source` names, or why it
    /// cannot be had (for the user's notes).
    fn source_of(
        &self,
        name: &str,
        data: &DataRef,
        shard: &dyn Fn(&str) -> Option<Arc<SourceFile>>,
    ) -> Result<Bytes, RecoveryError> {
        match data {
            DataRef::Source {
                shard: None, index, ..
            } if (*index as usize) < self.source_ids.len() => {
                Ok(Bytes::Source(self.source.clone(), *index))
            }
            DataRef::Source {
                shard: Some(s),
                version,
                index,
                ..
            } => match shard(s) {
                // The index is of a version of that shard: not of another.
                Some(src)
                    if (*index as usize) < src.header().tensors.len()
                        && version.is_none_or(|v| v.same_version(src.stat())) =>
                {
                    Ok(Bytes::Source(src, *index))
                }
                _ => Err(RecoveryError::Refused(format!(
                    "tensor {name:?}: its bytes were in {s}, which is gone or changed since; not restored"
                ))),
            },
            DataRef::Source { index, .. } => Err(RecoveryError::Refused(format!(
                "tensor {name:?}: source tensor {index} does not exist; not restored"
            ))),
            _ => Err(RecoveryError::Refused(format!(
                "tensor {name:?}: not a source tensor; not restored"
            ))),
        }
    }

    /// The journal record of a name's current state.
    pub(super) fn record_of(&self, name: &str) -> Record {
        match self.find(name).and_then(|id| self.entry(id)) {
            None => Record::Gone { name: name.into() },
            Some(e) => Record::Entry {
                name: name.into(),
                meta: e.meta.to_owned(),
                data: e.data.map(|d| self.data_ref(d)),
            },
        }
    }

    pub(super) fn begin_record(&self) -> Record {
        Record::Begin {
            version: journal::VERSION,
            source: self.source.path().to_path_buf(),
            stat: *self.source.stat(),
        }
    }

    pub(super) fn log(&mut self, records: Vec<Record>) -> Result<(), EditError> {
        self.version += 1;
        self.touch();
        self.journal_records(records)
    }

    /// Appends `records` to the journal (or the batch being made), without
    /// a new version of the state: bytes written, nothing laid out anew.
    /// An edit whose line cannot be written fails with the error (the
    /// edit stays in memory: the next edit, fsync or close rewrites the
    /// journal whole, or fails too).
    pub(super) fn journal_records(&mut self, mut records: Vec<Record>) -> Result<(), EditError> {
        if let Some(batch) = &mut self.batch {
            batch.append(&mut records);
            return Ok(());
        }
        if records.is_empty() {
            return Ok(());
        }
        if self.journal.broken {
            // (The snapshot holds this edit too: the state is made already.)
            return Ok(self.snapshot()?);
        }
        let dir = self.staging.dir()?;
        let folder = dir.folder()?;
        let begin = self.begin_record();
        let made = !self.journal.exists();
        let appended = self.journal.append(&folder, || begin, &records);
        if made && self.journal.exists() {
            dir.made_a_file();
        }
        if let Err(e) = appended {
            warn!(file = %self.source.path().display(), "journal of staged edits: {e}; \
                  the edit failed, and the journal is written whole at the next edit, fsync or close");
            self.journal.broken = true;
            return Err(e.into());
        }
        // Keep the journal within a few times the live edits (a failure
        // costs room, not an edit: the journal as it is holds them all).
        if self.committing.is_none() && self.journal.wants_snapshot(self.entries.len()) {
            let _passed_over = crate::testpoint::best_effort();
            if let Err(e) = self.snapshot() {
                warn!("rewriting the journal: {e}");
            }
        }
        Ok(())
    }

    /// Every edit, as journal records: the source names gone, then every
    /// changed or new entry, then the metadata.
    pub(super) fn overlay(&self) -> Vec<Record> {
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
        if !self.kv_unchanged() {
            records.push(Record::Keys {
                keys: self.kv_records(),
            });
        }
        records
    }

    /// Whether entry `id` is source tensor `i` exactly: its name, meta and bytes.
    pub(super) fn untouched(&self, id: Id, i: u32) -> bool {
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

    pub(super) fn object_is_source(&self, id: Id, i: u32) -> bool {
        match self.objects.get(id as usize) {
            Some(ObjectSlot::Source(j)) => *j == i,
            Some(ObjectSlot::Live(o)) => o.bytes().same(&Bytes::Source(self.source.clone(), i)),
            _ => false,
        }
    }

    /// Rewrites the journal as one snapshot of the edits.
    pub(super) fn snapshot(&mut self) -> std::io::Result<()> {
        let Some(dir) = self.staging.current() else {
            return Ok(());
        };
        let mut records = vec![self.begin_record()];
        records.extend(self.overlay());
        self.journal.rewrite(&dir, &records)
    }

    /// Before an edit: the staging folder and the journal are there, with
    /// room for the edit's line (`need` bytes, a bound); if the disk has
    /// none, the edit is refused with ENOSPC before it changes anything.
    /// A journal an earlier failure left to rewrite is rewritten first.
    pub fn journal_ready(&mut self, need: u64) -> Result<(), EditError> {
        if self.batch.is_some() {
            return Ok(()); // (made ready when the batch's operation began)
        }
        if self.journal.broken {
            self.snapshot()?;
        }
        let dir = self.staging.dir()?;
        let folder = dir.folder()?;
        let made = !self.journal.exists();
        let begin = self.begin_record();
        let ready = self.journal.make_room(&folder, || begin, need);
        if made && self.journal.exists() {
            dir.made_a_file();
        }
        Ok(ready?)
    }

    /// Makes every journaled edit durable (fsync, close): the journal is
    /// fsynced (rewritten first if an append had failed).
    pub fn sync_journal(&mut self) -> Result<(), EditError> {
        if self.journal.broken {
            self.snapshot()?;
        }
        if let Some(dir) = self.staging.current() {
            dir.sync_names()?;
        }
        Ok(self.journal.sync()?)
    }

    /// The staging folder, if it was made.
    pub fn staging_dir(&self) -> Option<Arc<StagingDir>> {
        self.staging.current()
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
                Some(source @ DataRef::Source { .. }) => {
                    match self.source_of(&name, &source, shard) {
                        Ok(bytes) => Some(bytes),
                        Err(note) => {
                            notes.push(note.to_string());
                            continue;
                        }
                    }
                }
                Some(DataRef::Patched { file, base, runs }) => {
                    let mut runs = runs;
                    runs.extend(folded.patches.get(&file).into_iter().flatten());
                    let patched = self.source_of(&name, &base, shard).and_then(|base| {
                        let staged = dir.existing(&file).map_err(|e| {
                            RecoveryError::Refused(format!(
                                "tensor {name:?}: staged file {file}: {e}; not restored"
                            ))
                        })?;
                        let Bytes::Source(src, index) = base else {
                            unreachable!("source_of gives source tensors")
                        };
                        crate::source::Patched::existing(src, index, staged, &runs).ok_or_else(|| {
                            RecoveryError::Refused(format!(
                                "tensor {name:?}: staged file {file} does not fit the tensor it \
                                 patches; not restored"
                            ))
                        })
                    });
                    match patched {
                        Ok(p) => Some(Bytes::Patched(Arc::new(p))),
                        Err(note) => {
                            notes.push(note.to_string());
                            continue;
                        }
                    }
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
            // (The metadata document is a change too: "no staged change
            // was left" would hide it.)
            restored += usize::from(doc != MetadataDoc::Unchanged);
            self.metadata = doc;
            self.metadata_gen = next_gen();
        }
        if let Some(keys) = folded.keys {
            notes.extend(self.kv_replay(keys));
            restored += usize::from(!self.kv_unchanged());
        }
        self.dirty = true;
        // (The journal read holds the edits: a failure costs a rewrite later.)
        let passed_over = crate::testpoint::best_effort();
        if let Err(e) = self.snapshot() {
            notes.push(format!("rewriting the journal: {e}"));
        }
        drop(passed_over);
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
