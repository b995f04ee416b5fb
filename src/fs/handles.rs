//! Open files: the handle of each descriptor (a data file's object, a JSON
//! file's shared text, a view as it was made), and the requests on them:
//! open, read, write, flush, fsync, release.

use super::*;
use crate::sync::LockAnyway;

/// An open `.meta.json`, `__metadata__.json` or index file: its text, shared
/// by every descriptor open on the same inode, and theirs alone once the name
/// is removed or replaced (as an unlinked file is on any filesystem).
/// Generated text is taken when the first descriptor opens it; what is
/// written is applied to the checkpoint when a descriptor open for writing
/// is flushed (an empty text only at its release), if this is still the file
/// at its name; text that does not parse is reported to the closer unless
/// another descriptor wrote since its last flush (it may be half-written).
pub(super) struct JsonFile {
    pub(super) ino: Ino,
    /// Owner, mode and time, as `stat` showed them at open.
    pub(super) attr: Attr,
    /// Its largest size: `MAX_META` for a meta, `MAX_JSON` otherwise.
    pub(super) limit: usize,
    pub(super) budget: Arc<JsonBudget>,
    pub(super) content: Mutex<JsonContent>,
}

/// What all open JSON files may hold together: each may be 16 MiB, and a
/// caller with many descriptors must not grow the daemon without bound.
pub(super) const JSON_BUDGET: usize = model_files::MAX_TOTAL as usize;

/// The bytes held by open JSON files.
#[derive(Default)]
pub(super) struct JsonBudget(AtomicU64);

impl JsonBudget {
    pub(super) fn take(&self, n: usize) -> Result<(), FsError> {
        let n = n as u64;
        self.0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                (held + n <= JSON_BUDGET as u64).then_some(held + n)
            })
            .map(drop)
            .map_err(|_| FsError::NoSpace("files open for writing hold 256 MiB already"))
    }

    pub(super) fn give(&self, n: usize) {
        self.0.fetch_sub(n as u64, Ordering::Relaxed);
    }
}

impl Drop for JsonFile {
    fn drop(&mut self) {
        let len = self.content.lock_anyway().text.len();
        self.budget.give(len);
    }
}

pub(super) struct JsonContent {
    pub(super) text: Vec<u8>,
    /// Written or cut since last applied.
    pub(super) dirty: bool,
    /// Ever written or cut through a descriptor: the text is the writers'.
    pub(super) written: bool,
}

impl JsonFile {
    /// Sets the text's length (zeros past the end), within the file's limit
    /// (EFBIG) and what all open JSON files may hold (ENOSPC).
    pub(super) fn resize(&self, content: &mut JsonContent, len: usize) -> Result<(), FsError> {
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

    pub(super) fn attr(&self, nlink: u32) -> Attr {
        Attr {
            size: self.content.lock_anyway().text.len() as u64,
            nlink,
            ..self.attr.clone()
        }
    }
}

/// What an open file handle refers to.
pub(super) enum Handle {
    /// A data file: the object itself, so that the handle keeps reading it
    /// after an unlink or a rename, and sees every write.
    Data {
        ino: Ino,
        object: Arc<DataObject>,
        wrote: bool,
        /// Device arenas prefetched through this handle: freed when it closes.
        device: Vec<Arc<dyn crate::prefetch::load::engine::Arena>>,
    },
    /// A JSON file; `write`: opened for writing; `pending`: written or cut
    /// through this descriptor since it was last flushed (a descriptor
    /// closed but not yet released, FUSE's release coming later, is no
    /// longer a writer whose text may be half-written).
    Json {
        file: Arc<JsonFile>,
        write: bool,
        pending: bool,
    },
    /// A view, as it was made when opened.
    View {
        ino: Ino,
        file: Arc<GeneratedFile>,
        _pins: ViewPins,
        /// A view served by passthrough: the daemon's read-only open of
        /// the source file (no in-place commit while it is open).
        _reader: Option<Arc<std::fs::File>>,
    },
}

/// The staging files a view's descriptor reads, pinned while it is open: a
/// later write into one of those tensors copies it to a new staging file
/// instead of changing the bytes under the descriptor.
pub(super) struct ViewPins(Vec<Arc<crate::source::StagedFile>>);

impl ViewPins {
    pub(super) fn of(file: &GeneratedFile) -> ViewPins {
        let staged = file.bytes().filter_map(|b| {
            let s = b.staging_file()?;
            s.pin();
            Some(s.clone())
        });
        ViewPins(staged.collect())
    }
}

impl Drop for ViewPins {
    fn drop(&mut self) {
        self.0.iter().for_each(|s| s.unpin());
    }
}

impl Handle {
    pub(super) fn ino(&self) -> Ino {
        match self {
            Handle::Data { ino, .. } | Handle::View { ino, .. } => *ino,
            Handle::Json { file, .. } => file.ino,
        }
    }
}

#[derive(Default)]
pub(super) struct Handles {
    pub(super) open: HashMap<u64, Handle>,
    /// The JSON files open now, by inode: a second open of the same file
    /// shares the first one's.
    pub(super) json: HashMap<Ino, std::sync::Weak<JsonFile>>,
}

/// Serves `size` bytes of a view at `offset` (computed now).
pub(super) fn read_view<R>(
    file: &GeneratedFile,
    offset: u64,
    size: u32,
    reply: impl FnOnce(&[&[u8]]) -> R,
) -> Result<R, FsError> {
    Ok(file.read(offset, size, reply)?)
}

/// The text of a JSON file as the state has it.
pub(super) fn state_text(st: &State, node: Node) -> Result<Vec<u8>, FsError> {
    Ok(match node {
        Node::Index(i) => st.indexes[i].0.bytes.clone(),
        Node::Metadata(c) => st.live(c).metadata_text()?.unwrap_or_default(),
        Node::File(c, file, TensorFile::Meta) => {
            let id = st.meta_entry(c, file)?;
            st.live(c).meta_text(id).unwrap_or_default()
        }
        Node::KvFile(c, id) => st.live(c).kv_text(id).ok_or(FsError::NotFound)??,
        Node::ModelFile(i) => st
            .model_files
            .get(i)
            .ok_or(FsError::NotFound)?
            .bytes
            .to_vec(),
        _ => return Err(FsError::IsADirectory),
    })
}

pub(super) fn slice_at(data: &[u8], offset: u64, size: u32) -> &[u8] {
    let start = offset.min(data.len() as u64) as usize;
    let end = (start as u64 + size as u64).min(data.len() as u64) as usize;
    &data[start..end]
}

impl Fs {
    pub(super) fn new_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock_anyway().open.insert(fh, h);
        fh
    }

    pub(super) fn opened(&self, fh: u64, generated: bool) -> Opened {
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
    pub(super) fn open_view(
        &self,
        ino: Ino,
        file: Arc<GeneratedFile>,
        reader: Option<Arc<std::fs::File>>,
    ) -> Opened {
        let fh = self.new_handle(Handle::View {
            ino,
            _pins: ViewPins::of(&file),
            file,
            _reader: reader.clone(),
        });
        Opened {
            passthrough: reader,
            ..self.opened(fh, true)
        }
    }

    /// The object of a data file, made shareable for a handle.
    pub(super) fn object(&self, c: usize, id: Id) -> Result<Arc<DataObject>, FsError> {
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
            Node::FolderRoot | Node::CheckpointDir(_) | Node::KvDir(_) => {
                Err(FsError::IsADirectory)
            }
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
                    _ => self
                        .looked_up
                        .lock_anyway()
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
            Node::Index(_) if write || truncate => Err(crate::fs::error::INDEX_READ_ONLY),
            Node::ModelFile(i) if write || truncate => {
                {
                    let st = self.read_state();
                    let f = st.model_files.get(i).ok_or(FsError::NotFound)?;
                    st.model_files.editable(&f.name)?;
                }
                self.open_json(ino, node, true, truncate)
            }
            Node::ModelFile(_) if self.handles.lock_anyway().json.contains_key(&ino) => {
                // (Open for writing: a reader shares the writer's text.)
                self.open_json(ino, node, false, false)
            }
            Node::ModelFile(i) => {
                let st = self.read_state();
                let bytes = st
                    .model_files
                    .get(i)
                    .ok_or(FsError::NotFound)?
                    .bytes
                    .to_vec();
                drop(st);
                Ok(self.open_view(ino, Arc::new(GeneratedFile::text(bytes)), None))
            }
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
            Node::Index(_)
            | Node::Metadata(_)
            | Node::File(_, _, TensorFile::Meta)
            | Node::KvFile(..) => self.open_json(ino, node, write || truncate, truncate),
        }
    }

    /// Opens a JSON file: the one open already on this inode, unless its
    /// generated text is out of date, else a new one with the text now.
    pub(super) fn open_json(
        &self,
        ino: Ino,
        node: Node,
        write: bool,
        truncate: bool,
    ) -> Result<Opened, FsError> {
        let (attr, text) = {
            let st = self.read_state();
            // (What cannot be read now, O_TRUNC does not need.)
            let text = match state_text(&st, node) {
                Err(FsError::Io(_)) if truncate => Ok(Vec::new()),
                text => text,
            };
            (self.attr_of(&st, node)?, text?)
        };
        let limit = match node {
            Node::File(..) => MAX_META,
            Node::ModelFile(_) => model_files::MAX_FILE as usize,
            _ => MAX_JSON,
        };
        let mut handles = self.handles.lock_anyway();
        let open = handles.json.get(&ino).and_then(std::sync::Weak::upgrade);
        let file = match open.filter(|f| {
            let content = f.content.lock_anyway();
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
            file.resize(&mut file.content.lock_anyway(), 0)?;
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        handles.open.insert(
            fh,
            Handle::Json {
                file,
                write,
                pending: truncate,
            },
        );
        Ok(self.opened(fh, true))
    }

    /// Applies JSON written through a handle: on flush (if anything was
    /// written: a shell's `>` closes a duplicate descriptor first) and on the
    /// last close. What does not parse is kept as written, and reported.
    pub(super) fn apply_json(&self, fh: u64, last_close: bool) -> Result<(), FsError> {
        let (ino, text, others) = {
            let mut handles = self.handles.lock_anyway();
            let Some(Handle::Json {
                file,
                write: true,
                pending,
            }) = handles.open.get(&fh)
            else {
                return Ok(());
            };
            let (file, pending) = (file.clone(), *pending);
            // Another writer has it open and wrote since its last flush:
            // its text may not be final yet.
            let writing = |other: &u64, h: &Handle| {
                *other != fh
                    && matches!(h, Handle::Json { file: f, write: true, pending: true } if Arc::ptr_eq(f, &file))
            };
            let others = handles.open.iter().any(|(o, h)| writing(o, h));
            // A descriptor that wrote nothing since its flush applies only
            // as the last writer (a cut made without a descriptor); else a
            // late release would take the report from the writer's close.
            let open_writers = handles.open.iter().any(|(o, h)| {
                *o != fh && matches!(h, Handle::Json { file: f, write: true, .. } if Arc::ptr_eq(f, &file))
            });
            if !pending && (!last_close || open_writers) {
                return Ok(());
            }
            // Flushed: nothing of this descriptor's is half-written now.
            if let Some(Handle::Json { pending, .. }) = handles.open.get_mut(&fh) {
                *pending = false;
            }
            let mut content = file.content.lock_anyway();
            // (A shell's `: >` cut is applied at release, or with what follows.)
            if content.dirty && !last_close && content.text.is_empty() {
                return Ok(());
            }
            let text = content.dirty.then(|| content.text.clone());
            content.dirty = false;
            drop(content);
            match text {
                Some(text) => (file.ino, text, others),
                None => return Ok(()), // applied already, by another writer
            }
        };
        let mut touched = Vec::new();
        let (checkpoint, file_name, kept_invalid) = {
            let mut st = self.write_state();
            if let Some(c) = st.node(ino).ok().and_then(|n| n.json_checkpoint()) {
                let need = super::edits::EDIT_ROOM + 2 * text.len() as u64;
                st.live_mut(c).journal_ready(need)?;
            }
            match st.node(ino) {
                Ok(Node::File(c, file, TensorFile::Meta)) => {
                    let id = st.meta_entry(c, file)?;
                    let name = st.live(c).entry_name(id).ok_or(FsError::NotFound)?;
                    let kept_invalid = st.live_mut(c).set_meta(&name, &text, false)?;
                    // (A meta may size its data file: zeros to its nbytes.)
                    let data = Name::Tensor(TensorFile::Data, name.clone());
                    touched = st.files_of(c, &data);
                    (Some(c), TensorFile::Meta.file_name(&name), kept_invalid)
                }
                Ok(Node::Metadata(c)) => {
                    let kept_invalid = st.live_mut(c).set_metadata(&text, false)?;
                    // (A GGUF file's: every key's file may show another value.)
                    touched = st
                        .live(c)
                        .kv_keys()
                        .into_iter()
                        .map(|(id, _)| st.ino_of(Node::KvFile(c, id)))
                        .collect();
                    (Some(c), METADATA_FILE.to_string(), kept_invalid)
                }
                Ok(Node::KvFile(c, id)) => {
                    let live = st.live_mut(c);
                    let key = live.kv_key(id).ok_or(FsError::NotFound)?.to_string();
                    let kept_invalid = live.kv_set(id, &text)?;
                    // (`__metadata__.json` shows every key.)
                    touched.push(st.ino_of(Node::Metadata(c)));
                    (
                        Some(c),
                        format!("{KV_DIR}/{}", names::tensor_file_name(&key)),
                        kept_invalid,
                    )
                }
                Ok(Node::ModelFile(i)) => {
                    st.model_files.write(i, text)?;
                    (None, String::new(), None)
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
        // What the name shows is the JSON as parsed and written again, and a
        // meta may show or hide its tensor's name.
        self.kernel.attrs_changed(ino);
        touched
            .into_iter()
            .for_each(|ino| self.kernel.attrs_changed(ino));
        self.kernel.names_changed();
        if let Some(c) = checkpoint {
            self.sync_journal(c)?;
        }
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
    pub(super) fn sync_journal(&self, c: usize) -> Result<(), FsError> {
        Ok(crate::checkpoint::transaction::sync_journal(
            &self.state,
            c,
        )?)
    }

    /// Makes what went through a handle durable: its staging file and the journal.
    pub(super) fn make_durable(&self, fh: u64) -> Result<(), FsError> {
        let object = match self.handles.lock_anyway().open.get(&fh) {
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
        self.loads.release(fh);
        let result = self
            .apply_json(fh, true)
            .and_then(|()| self.make_durable(fh));
        let mut handles = self.handles.lock_anyway();
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

    /// A directory opened: a handle of its own, which loads may belong to.
    pub fn open_dir(&self) -> u64 {
        self.next_fh.fetch_add(1, Ordering::Relaxed)
    }

    /// A directory closed: the loads it started stop and go.
    pub fn release_dir(&self, fh: u64) {
        self.loads.release(fh);
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
        let object = match self.handles.lock_anyway().open.get(&fh) {
            Some(Handle::Data { object, .. }) => Some(object.bytes()),
            Some(Handle::Json { file, .. }) => {
                let content = file.content.lock_anyway();
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
                    Node::FolderRoot | Node::CheckpointDir(_) | Node::KvDir(_) => {
                        return Err(FsError::IsADirectory);
                    }
                    Node::KvFile(c, id) => st.live(c).kv_text(id).transpose()?,
                    Node::Views(v) if st.is_view_folder(v) => return Err(FsError::IsADirectory),
                    Node::Views(v) => {
                        let file = self.view(&st, &st.view_path(v)?)?;
                        drop(st);
                        return read_view(&file, offset, size, reply);
                    }
                    Node::Index(i) => {
                        return Ok(reply(&[slice_at(&st.indexes[i].0.bytes, offset, size)]));
                    }
                    Node::ModelFile(i) => {
                        let bytes = &st.model_files.get(i).ok_or(FsError::NotFound)?.bytes;
                        return Ok(reply(&[slice_at(bytes, offset, size)]));
                    }
                    Node::WholeView(c) => {
                        let file = self.view(&st, &views::export_path(&st, c))?;
                        drop(st);
                        return read_view(&file, offset, size, reply);
                    }
                    Node::Metadata(c) => st.live(c).metadata_text()?,
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
            let mut handles = self.handles.lock_anyway();
            match handles.open.get_mut(&fh) {
                Some(Handle::Json { file, pending, .. }) => {
                    let end = offset
                        .checked_add(data.len() as u64)
                        .filter(|&e| e <= file.limit as u64)
                        .ok_or(EditError::TooLarge(file.limit))?
                        as usize;
                    let mut content = file.content.lock_anyway();
                    if content.text.len() < end {
                        file.resize(&mut content, end)?;
                    }
                    *pending = true;
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
        let changed = object.write(&self.staging, offset, data)?;
        self.note_write(&object, changed)?;
        Ok(data.len() as u32)
    }

    /// What a reader of JSON file `node` gets now: the text of the file open
    /// on it if a descriptor wrote it, else the state's.
    pub(super) fn json_text(&self, st: &State, node: Node) -> Result<Vec<u8>, FsError> {
        let ino = st.ino_of(node);
        let open = self
            .handles
            .lock_anyway()
            .json
            .get(&ino)
            .and_then(std::sync::Weak::upgrade);
        if let Some(file) = open {
            let content = file.content.lock_anyway();
            if content.written {
                return Ok(content.text.clone());
            }
        }
        state_text(st, node)
    }
}
