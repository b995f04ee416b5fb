//! Changing the namespace and the bytes: create, truncate, unlink, rename
//! (the edits a commit writes later).

use super::*;
use crate::sync::LockAnyway;

/// The room an edit of the namespace asks of its journal before it changes
/// anything (its line is a few records of names and metas: far less).
pub(super) const EDIT_ROOM: u64 = 64 << 10;

/// A GGUF file's `__metadata__.json` is its keys: not removed or moved away.
const GGUF_KEYS_STAY: FsError = FsError::NotPermitted(
    "a GGUF file's __metadata__.json is its keys: remove them one by one in __kv__, or write the file",
);

impl Fs {
    /// Creates (or opens, unless `exclusive`) a file in a checkpoint
    /// directory, or a model file at a folder's root (`mode`: its
    /// permissions, the caller's umask applied; a tensor's are the source's).
    pub fn create(
        &self,
        parent: Ino,
        name: &str,
        (truncate, exclusive): (bool, bool),
        mode: u32,
    ) -> Result<(Attr, Opened), FsError> {
        self.writable()?;
        let kv_parent = self.read_state().kv_parent(parent);
        if let Some(c) = kv_parent {
            return self.create_key(c, name, truncate, exclusive);
        }
        if self.read_state().node(parent)? == Node::FolderRoot {
            return self.create_model_file(name, (truncate, exclusive), mode);
        }
        let ino = {
            let mut st = self.write_state();
            let c = st.checkpoint_dir(parent)?;
            let decoded = st.decode(c, name)?;
            let existing = st.find(c, &decoded);
            if existing.is_some() && exclusive {
                return Err(FsError::Exists);
            }
            if existing.is_none() {
                st.live_mut(c).journal_ready(EDIT_ROOM)?;
            }
            let node = match (existing, &decoded) {
                (Some(node), _) => node,
                (None, Name::Metadata) => {
                    st.live_mut(c).create_metadata()?;
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
                    let id = live.create_meta(tensor)?;
                    let file = live.meta_file(id).ok_or(FsError::NotFound)?;
                    Node::File(c, file.id, TensorFile::Meta)
                }
            };
            // (Data created under a name with a meta: the meta's time is
            // the data's now.)
            let touched = st.files_of(c, &decoded);
            (st.ino_of(node), touched)
        };
        let (ino, touched) = ino;
        touched
            .into_iter()
            .for_each(|ino| self.kernel.attrs_changed(ino));
        let opened = self.open(ino, true, truncate)?;
        Ok((self.getattr(ino, Some(opened.fh))?, opened))
    }

    /// Creates (or opens, unless `exclusive`) `__kv__/NAME`: a new key is
    /// an empty string until written.
    fn create_key(
        &self,
        c: usize,
        name: &str,
        truncate: bool,
        exclusive: bool,
    ) -> Result<(Attr, Opened), FsError> {
        let (ino, metadata) = {
            let mut st = self.write_state();
            let key = st.kv_key_of(c, name)?;
            let id = match st.live(c).kv_find(&key) {
                Some(_) if exclusive => return Err(FsError::Exists),
                Some(id) => id,
                None => {
                    st.live_mut(c).journal_ready(EDIT_ROOM)?;
                    let id = st.live_mut(c).kv_create(&key)?;
                    info!(key = %key, "key created");
                    id
                }
            };
            (st.ino_of(Node::KvFile(c, id)), st.ino_of(Node::Metadata(c)))
        };
        self.kernel.names_changed();
        self.kernel.attrs_changed(metadata);
        let opened = self.open(ino, true, truncate)?;
        Ok((self.getattr(ino, Some(opened.fh))?, opened))
    }

    /// `rm __kv__/NAME`, and `mv` within `__kv__`.
    fn edit_keys(&self, c: usize, name: &str, to: Option<(&str, bool)>) -> Result<(), FsError> {
        let metadata = {
            let mut st = self.write_state();
            let key = st.kv_key_of(c, name).map_err(|_| FsError::NotFound)?;
            // (No such key is ENOENT before any rule about the target.)
            st.live(c).kv_find(&key).ok_or(FsError::NotFound)?;
            st.live_mut(c).journal_ready(EDIT_ROOM)?;
            match to {
                None => st.live_mut(c).kv_remove(&key)?,
                Some((new_name, no_replace)) => {
                    let target = st.kv_key_of(c, new_name)?;
                    if no_replace && st.live(c).kv_find(&target).is_some() && target != key {
                        return Err(FsError::Exists);
                    }
                    st.live_mut(c).kv_rename(&key, &target)?;
                }
            }
            st.ino_of(Node::Metadata(c))
        };
        self.kernel.names_changed();
        self.kernel.attrs_changed(metadata);
        self.sync_journal(c)?;
        match to {
            None => info!(key = name, "key removed"),
            Some((new_name, _)) => info!(from = name, to = new_name, "key renamed"),
        }
        Ok(())
    }

    pub(super) fn truncate_object(
        &self,
        object: &Arc<DataObject>,
        len: u64,
    ) -> Result<(), FsError> {
        {
            let mut st = self.write_state();
            if let Some(c) = st.home(object) {
                st.live_mut(c).journal_ready(EDIT_ROOM)?;
            }
        }
        let changed = object.truncate(&self.staging, len)?;
        self.note_write(object, changed)
    }

    /// After a data write: the checkpoint listing the object learns it has
    /// edits, and its journal where the bytes are if they moved; if their
    /// length changed, that its views are laid out anew.
    pub(super) fn note_write(
        &self,
        object: &Arc<DataObject>,
        changed: crate::checkpoint::Changed,
    ) -> Result<(), FsError> {
        self.meta_changed(object);
        let moved = changed.moved;
        // Bytes a move copied into a new staging file (a source tensor's
        // blocks, a tensor copied aside) are made durable before the journal
        // names that file: a journal line that outlives a crash must never
        // name a file whose copy did not (the tensor would come back short).
        // A failed sync still journals the move (memory and journal agree)
        // and fails the write.
        let copied = match moved {
            true => object.sync(),
            false => Ok(()),
        };
        if let Some((file, runs)) = changed.patched {
            let mut st = self.write_state();
            if let Some(c) = st.home(object) {
                st.live_mut(c).object_patched(file, runs)?;
            }
            return Ok(());
        }
        if !moved {
            let st = self.read_state();
            let home = st.home(object);
            if let Some(c) = home {
                match changed.resized {
                    true => st.live(c).resized(),
                    false => st.live(c).touch(),
                }
            }
            if home.is_none_or(|c| st.live(c).is_dirty()) {
                return Ok(());
            }
        }
        let mut st = self.write_state();
        if let Some(c) = st.home(object) {
            st.live_mut(c).object_written(object, moved)?;
        }
        Ok(copied?)
    }

    /// After a data write, its tensor's meta has other attributes: its
    /// time is the data's, its size drops the offsets when the bytes move and
    /// follows `nbytes`.
    fn meta_changed(&self, object: &DataObject) {
        if !self.kernel.names_cached() {
            return;
        }
        let ino = {
            let st = self.read_state();
            let Some(c) = st.home(object) else { return };
            let (_, id) = object.home();
            st.live(c)
                .meta_file(id)
                .map(|f| st.ino(c, f.id, TensorFile::Meta))
        };
        ino.into_iter()
            .for_each(|ino| self.kernel.attrs_changed(ino));
    }

    /// `truncate` / `ftruncate`.
    pub fn set_size(&self, ino: Ino, fh: Option<u64>, size: u64) -> Result<Attr, FsError> {
        self.writable()?;
        if let Some(fh) = fh {
            let mut handles = self.handles.lock_anyway();
            match handles.open.get_mut(&fh) {
                Some(Handle::Json { file, pending, .. }) => {
                    let len = usize::try_from(size).unwrap_or(usize::MAX);
                    file.resize(&mut file.content.lock_anyway(), len)?;
                    *pending = true;
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
            Node::FolderRoot | Node::CheckpointDir(_) | Node::KvDir(_) => {
                return Err(FsError::IsADirectory);
            }
            Node::Views(v) if self.read_state().is_view_folder(v) => {
                return Err(FsError::IsADirectory);
            }
            Node::Views(_) | Node::WholeView(_) => return Err(FsError::ReadOnly),
            Node::Index(_) => return Err(crate::fs::error::INDEX_READ_ONLY),
            // A JSON or model file cut by path: as if opened, cut and closed.
            Node::File(_, _, TensorFile::Meta)
            | Node::Metadata(_)
            | Node::KvFile(..)
            | Node::ModelFile(_) => {
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
        let kv_parent = self.read_state().kv_parent(parent);
        if let Some(c) = kv_parent {
            return self.edit_keys(c, name, None);
        }
        let mut st = self.write_state();
        let c = match st.node(parent)? {
            Node::CheckpointDir(c) => c,
            Node::FolderRoot => {
                drop(st);
                return self.unlink_model_file(name);
            }
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
        if decoded == Name::Metadata && st.is_gguf() {
            return Err(GGUF_KEYS_STAY);
        }
        let touched = st.files_of(c, &decoded);
        let live = st.live_mut(c);
        live.journal_ready(EDIT_ROOM)?;
        match &decoded {
            Name::Metadata => live.remove_metadata()?,
            Name::Tensor(TensorFile::Data, tensor) => live.unlink_data(tensor)?,
            Name::Tensor(TensorFile::Meta, tensor) => live.unlink_meta(tensor)?,
        }
        drop(st);
        // (A data file removed: its meta, left behind, loses its offsets.)
        self.kernel.names_changed();
        touched
            .into_iter()
            .for_each(|ino| self.kernel.attrs_changed(ino));
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
        let (from_kv, to_kv) = {
            let st = self.read_state();
            (st.kv_parent(parent), st.kv_parent(new_parent))
        };
        match (from_kv, to_kv) {
            (Some(c), Some(nc)) if c == nc => {
                return self.edit_keys(c, name, Some((new_name, no_replace)));
            }
            (None, None) => {}
            // (Not EXDEV: `mv` would copy, making a tensor of a key's text
            // or a key of a tensor's bytes.)
            _ => {
                return Err(FsError::NotPermitted(
                    "a key moves only within its own __kv__, and a tensor only among tensors",
                ));
            }
        }
        let at_root = |st: &State, ino| st.node(ino).is_ok_and(|n| n == Node::FolderRoot);
        let root = {
            let st = self.read_state();
            at_root(&st, parent) || at_root(&st, new_parent)
        };
        if root {
            return self.rename_model_file((parent, name), (new_parent, new_name), no_replace);
        }
        let mut st = self.write_state();
        let c = st.checkpoint_dir(parent)?;
        let nc = st.checkpoint_dir(new_parent)?;
        let from = st.decode(c, name)?;
        let to = st.decode(nc, new_name)?;
        if from == Name::Metadata && to != Name::Metadata && st.is_gguf() {
            return Err(GGUF_KEYS_STAY);
        }
        let from_node = st.find(c, &from).ok_or(FsError::NotFound)?;
        let to_node = st.find(nc, &to);
        if to_node == Some(from_node) && c == nc {
            return Ok(());
        }
        if no_replace && to_node.is_some() {
            return Err(FsError::Exists);
        }
        // The files of both names, before and after: their attributes
        // change (a replaced file's nlink, a moved meta's text).
        let mut touched = st.files_of(c, &from);
        touched.extend(st.files_of(nc, &to));
        // Journaled whole: one line per checkpoint, the target's first (a
        // crash between two checkpoints' lines leaves a copy, never a loss).
        st.live_mut(nc).journal_ready(EDIT_ROOM)?;
        st.live_mut(c).journal_ready(EDIT_ROOM)?;
        st.live_mut(c).begin_batch();
        let mut result =
            self.rename_parts(&mut st, (c, name, &from, from_node), (nc, new_name, &to));
        // Between two checkpoints, the target's journal line is durable
        // before the source's is written: a crash between leaves a copy
        // (two journals, synced in any order), never a loss.
        if result.is_ok() && c != nc {
            result = st.live_mut(nc).sync_journal().map_err(FsError::from);
        }
        // (A rename that failed half-way journals no half of it: the
        // journal then says the name is where it was, and is rewritten
        // from the state at the next edit or fsync.)
        let journaled = match &result {
            Ok(()) => st.live_mut(c).end_batch(),
            Err(_) => {
                st.live_mut(c).abandon_batch();
                Ok(())
            }
        };
        touched.extend(st.files_of(c, &from));
        touched.extend(st.files_of(nc, &to));
        let shards = (c != nc).then(|| {
            let dir = |c: usize| st.checkpoints[c].dir_name.clone();
            (dir(c), dir(nc))
        });
        drop(st);
        touched
            .into_iter()
            .for_each(|ino| self.kernel.attrs_changed(ino));
        // (A data file brings its meta; the target's may go.)
        self.kernel.names_changed();
        result?;
        journaled?;
        match shards {
            Some((from_shard, to_shard)) => {
                info!(
                    from = name,
                    to = new_name,
                    from_shard,
                    to_shard,
                    "moved to another shard"
                )
            }
            None => info!(from = name, to = new_name, "renamed"),
        }
        Ok(())
    }

    /// The parts of `rename` that change the state (see `rename`).
    pub(super) fn rename_parts(
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
                        live.remove_metadata()?;
                        object
                    }
                };
                st.live_mut(nc).put_data(target, taken, c == nc)?;
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
                    Name::Metadata => crate::checkpoint::meta::parse_metadata(&text)
                        .err()
                        .map(|e| e.to_string()),
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
                        Name::Metadata => live.remove_metadata()?,
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
}
