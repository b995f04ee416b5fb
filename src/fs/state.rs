//! The inode table of a mount: what each inode number is (`Node`), the
//! checkpoints and index files it shows (`State`), and the names of a
//! checkpoint directory.

use super::*;
use crate::sync::LockAnyway;
use model_edits::MODEL_BIT;

/// A file or directory, as an inode number decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Node {
    FolderRoot,
    CheckpointDir(usize),
    Metadata(usize),
    Index(usize),
    /// A file of a model folder that is not a shard or an index.
    ModelFile(usize),
    File(usize, Id, TensorFile),
    /// `__views__` or anything below it (`views`): the inode, which names
    /// its path in the table of view inodes.
    Views(Ino),
    /// A view that is checkpoint `c`'s source file byte for byte, served
    /// by kernel passthrough: an inode of its own for each source file
    /// (`WHOLE_BIT` and the file's inode number), as the kernel wants one
    /// backing file per inode while it is open.
    WholeView(usize),
    /// A GGUF checkpoint's `__kv__`, and the file of each key (by its id
    /// in `Live`'s key table): `KV_BIT`, the checkpoint, and 0 or id + 1.
    KvDir(usize),
    KvFile(usize, u64),
}

impl Node {
    /// The checkpoint of a JSON file's node (a meta, `__metadata__.json`, a key).
    pub(super) fn json_checkpoint(&self) -> Option<usize> {
        match *self {
            Node::Metadata(c) | Node::File(c, _, TensorFile::Meta) | Node::KvFile(c, _) => Some(c),
            _ => None,
        }
    }
}

pub(super) const WHOLE_BIT: Ino = 1 << 62;
pub(super) const KV_BIT: Ino = 1 << 60;

/// Inodes per tensor id and checkpoint: one per kind of its files.
pub(super) const SLOTS: u64 = TensorFile::STRIDE;

/// Hashed file name stem -> tensor name.
pub(super) type HashedNames = HashMap<String, String>;

/// A name in a checkpoint directory, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Name {
    Metadata,
    Tensor(TensorFile, String),
}

pub(super) struct Mounted {
    /// The shard's file name without `.safetensors`.
    pub(super) dir_name: String,
    pub(super) live: Live,
    pub(super) dir_ino: Ino,
}

impl Mounted {
    /// The name of the shard's directory in a folder mount: its file's, but
    /// `__views__` is `%5F_views__` (as for a tensor) so that `__views__`
    /// stays the views, and a shard already named `%5F_views__` (or that
    /// with `%25`s before it) gets one `%25` more, so no two shards share one.
    pub(super) fn shown_name(&self) -> String {
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

pub(super) struct State {
    pub(super) checkpoints: Vec<Mounted>,
    pub(super) indexes: Vec<(IndexFile, Ino)>,
    pub(super) model_files: ModelFiles,
    /// Node of each inode below `first_ino` (index = ino - 1).
    pub(super) fixed: Vec<Node>,
    pub(super) first_ino: Ino,
    /// The folder of a folder mount.
    pub(super) folder: Option<(Arc<crate::source::Folder>, FileStat)>,
    /// Per checkpoint: its hashed file names, and the `Live::names_gen`
    /// they were made at.
    pub(super) hashed: Mutex<HashMap<usize, (u64, HashedNames)>>,
    /// The inode of the passthrough views of each source file (device,
    /// inode number) seen: `WHOLE_BIT` and a count.
    pub(super) whole_inos: Mutex<HashMap<(u64, u64), Ino>>,
    /// The inodes of `__views__` and everything below it.
    pub(super) view_inos: Mutex<views::ViewInodes>,
    /// View files made, by path, until the state they draw on moves: the
    /// last `VIEWS_KEPT` used.
    pub(super) view_files: views::Memo,
    /// What view folders keep between requests (a reshard's splits).
    pub(super) view_memo: views::Memo,
}

pub(super) fn file_mode(stat: &FileStat, read_only: bool) -> u16 {
    let mode = (stat.mode & 0o777) as u16;
    if read_only { mode & !0o222 } else { mode }
}

/// A directory gets x where its file has r.
pub(super) fn dir_mode(stat: &FileStat, read_only: bool) -> u16 {
    let mode = file_mode(stat, read_only);
    mode | ((mode & 0o444) >> 2)
}

impl State {
    /// Owner and mode for what draws on every checkpoint (a merged view, an
    /// index): only those who may read every source may read it.
    pub(super) fn all_owners(&self) -> FileStat {
        let owners: Vec<FileStat> = self
            .checkpoints
            .iter()
            .map(|m| m.live.source().owner_now())
            .collect();
        crate::source::access::narrowest(&owners).expect("a mount has a checkpoint")
    }

    /// Owner and mode of index file `i` as they are now (narrowed by an ACL).
    pub(super) fn index_owner(&self, i: usize) -> FileStat {
        let ix = &self.indexes[i].0;
        if ix.remote.is_some() {
            return ix.stat; // (an object: no owner but the mounting user)
        }
        self.folder_file_owner(&ix.name, ix.stat)
    }

    /// Owner and mode of file `name` of the folder, whose bytes were read
    /// at mount when it was `stat`: as the file is now, if it is still that
    /// file; else those who may read both. (A remote folder's files have
    /// no owner but the mounting user: their `stat` says so.)
    /// The folder of a folder mount of local files (None: a file mount,
    /// or a folder in a store, whose folder is the cache's).
    pub(super) fn local_folder(&self) -> Option<&Arc<crate::source::Folder>> {
        let in_store = self
            .checkpoints
            .first()
            .is_some_and(|m| m.live.source().remote_object().is_some());
        self.folder
            .as_ref()
            .filter(|_| !in_store)
            .map(|(folder, _)| folder)
    }

    pub(super) fn folder_file_owner(&self, name: &str, stat: FileStat) -> FileStat {
        let remote = self
            .checkpoints
            .first()
            .is_some_and(|m| m.live.source().remote_object().is_some());
        if remote {
            return stat;
        }
        let now = self.folder.as_ref().and_then(|(folder, _)| {
            // (Not opened: the owner and mode as read at mount, or as made.)
            let _passed_over = crate::testpoint::best_effort();
            let flags = libc::O_RDONLY | libc::O_NONBLOCK;
            folder.open_file(std::ffi::OsStr::new(name), flags, 0).ok()
        });
        let Some(file) = now else {
            return stat;
        };
        let current = crate::source::access::owner_now(&file, &stat);
        match FileStat::of(&file) {
            // Still the file whose bytes are shown.
            Ok(st) if (st.dev, st.ino) == (stat.dev, stat.ino) => current,
            // Replaced since: those bytes go to whoever may read both.
            _ => crate::source::access::narrowest(&[stat, current]).expect("two"),
        }
    }

    /// Owner and mode of the mount's top folder as they are now.
    pub(super) fn root_owner(&self) -> FileStat {
        // (A remote folder's `folder` is the cache folder standing in for it.)
        let remote = self.live(0).source().remote_object().is_some();
        match &self.folder {
            Some((_, stat)) if remote => *stat,
            Some((folder, stat)) => folder.stat().map_or(*stat, |now| FileStat {
                mode: now.mode,
                uid: now.uid,
                gid: now.gid,
                ..*stat
            }),
            None => self.live(0).source().owner_now(),
        }
    }

    pub(super) fn node(&self, ino: Ino) -> Result<Node, FsError> {
        if ino == 0 {
            return Err(FsError::NotFound);
        }
        if ino < self.first_ino {
            return Ok(self.fixed[(ino - 1) as usize]);
        }
        if ino & VIEW_BIT != 0 {
            let path = self
                .view_inos
                .lock_anyway()
                .path(ino)
                .ok_or(FsError::NotFound)?;
            return match views::find(self, &path) {
                Some(_) => Ok(Node::Views(ino)),
                None => Err(FsError::NotFound),
            };
        }
        if ino & KV_BIT != 0 && ino & (WHOLE_BIT | VIEW_BIT) == 0 {
            let c = ((ino & !KV_BIT) >> 32) as usize;
            let live = &self.checkpoints.get(c).ok_or(FsError::NotFound)?.live;
            return match ino & 0xFFFF_FFFF {
                0 if self.is_gguf() => Ok(Node::KvDir(c)),
                0 => Err(FsError::NotFound),
                n => match live.kv_key(n - 1) {
                    Some(_) => Ok(Node::KvFile(c, n - 1)),
                    None => Err(FsError::NotFound),
                },
            };
        }
        if ino & MODEL_BIT != 0 && ino & (WHOLE_BIT | VIEW_BIT | KV_BIT) == 0 {
            return self
                .model_files
                .id_of(ino)
                .map(Node::ModelFile)
                .ok_or(FsError::NotFound);
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
                return match live.has_metadata_file() {
                    true => Ok(Node::Metadata(c)),
                    false => Err(FsError::NotFound),
                };
            }
            TensorFile::Meta => live.meta_file_owner(id).is_some(),
        };
        if !exists {
            return Err(FsError::NotFound);
        }
        Ok(Node::File(c, id, kind))
    }

    pub(super) fn ino(&self, c: usize, id: Id, kind: TensorFile) -> Ino {
        let count = self.checkpoints.len().max(1) as u64;
        self.first_ino + SLOTS * (id * count + c as u64) + kind.slot()
    }

    pub(super) fn ino_of(&self, node: Node) -> Ino {
        match node {
            Node::FolderRoot => ROOT_INO,
            Node::CheckpointDir(c) => self.checkpoints[c].dir_ino,
            Node::Metadata(c) => self.ino(c, self.live(c).metadata_file(), TensorFile::Meta),
            Node::Index(i) => self.indexes[i].1,
            Node::ModelFile(i) => ModelFiles::ino(i),
            Node::File(c, id, kind) => self.ino(c, id, kind),
            Node::Views(ino) => ino,
            Node::WholeView(c) => self
                .whole_ino(self.live(c).source())
                .expect("a local source"),
            Node::KvDir(c) => KV_BIT | (c as Ino) << 32,
            Node::KvFile(c, id) => KV_BIT | (c as Ino) << 32 | (id + 1),
        }
    }

    /// Whether view inode `ino` is a folder now.
    pub(super) fn is_view_folder(&self, ino: Ino) -> bool {
        self.view_path(ino)
            .is_ok_and(|p| matches!(views::find(self, &p), Some(Found::Folder(_))))
    }

    /// The path below `__views__` of view inode `ino`.
    pub(super) fn view_path(&self, ino: Ino) -> Result<Arc<str>, FsError> {
        self.view_inos
            .lock_anyway()
            .path(ino)
            .ok_or(FsError::NotFound)
    }

    /// The inode of `path` below `__views__`.
    pub(super) fn view_ino(&self, path: &str) -> Ino {
        self.view_inos.lock_anyway().ino(path)
    }

    /// The modification time of the views of checkpoint `target` (None: of
    /// all): the last change of their state or of their source files, so
    /// that `rsync`, `make` and `cp -u` see every edit.
    pub(super) fn views_changed(&self, target: Option<usize>) -> SystemTime {
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
    pub(super) fn whole_ino(&self, source: &SourceFile) -> Option<Ino> {
        source.file()?;
        let key = (source.stat().dev, source.stat().ino);
        let mut inos = self.whole_inos.lock_anyway();
        let next = WHOLE_BIT + inos.len() as Ino;
        Some(*inos.entry(key).or_insert(next))
    }

    /// Problems across the shards of a folder mount: two shards that are one
    /// file, and (with an index) tensors that are in two shards now.
    pub(super) fn in_two_shards(&self) -> Vec<crate::checkpoint::Problem> {
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

    /// Whether this mounts a GGUF file or the parts of a split one (whose
    /// views are their own, and whose folders show `__kv__`). A folder
    /// mount shows one format.
    pub(super) fn is_gguf(&self) -> bool {
        self.live(0).source().header().is_gguf()
    }

    /// The node of checkpoint `c`'s `__kv__` when this mounts GGUF.
    pub(super) fn kv_dir(&self, c: usize) -> Option<Node> {
        self.is_gguf().then_some(Node::KvDir(c))
    }

    /// The checkpoint whose `__kv__` a directory inode is.
    pub(super) fn kv_parent(&self, ino: Ino) -> Option<usize> {
        match self.node(ino) {
            Ok(Node::KvDir(c)) => Some(c),
            _ => None,
        }
    }

    /// The key a file name in `__kv__` stands for (names escape keys as
    /// they escape tensor names).
    pub(super) fn kv_key_of(&self, c: usize, file_name: &str) -> Result<String, FsError> {
        if file_name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let live = self.live(c);
        // (A hashed long name is found among the keys there.)
        if let Some((_, key)) = live
            .kv_keys()
            .into_iter()
            .find(|(_, k)| names::tensor_file_name(k) == file_name)
        {
            return Ok(key);
        }
        names::tensor_name(file_name).ok_or_else(|| {
            FsError::Invalid(format!(
                "{file_name:?} is not a valid key file name (see \"Names\" in docs/SEMANTICS.md)"
            ))
        })
    }

    pub(super) fn live(&self, c: usize) -> &Live {
        &self.checkpoints[c].live
    }

    /// The checkpoint that lists `object` now (objects move between the
    /// checkpoints of a folder mount).
    pub(super) fn home(&self, object: &DataObject) -> Option<usize> {
        let (serial, _) = object.home();
        self.checkpoints
            .iter()
            .position(|m| m.live.serial() == serial)
    }

    pub(super) fn live_mut(&mut self, c: usize) -> &mut Live {
        &mut self.checkpoints[c].live
    }

    /// The entry whose `.meta.json` is file `id` (a `Node::File` of kind Meta).
    pub(super) fn meta_entry(&self, c: usize, id: Id) -> Result<Id, FsError> {
        self.live(c).meta_file_owner(id).ok_or(FsError::NotFound)
    }

    /// The checkpoint a directory inode stands for.
    pub(super) fn checkpoint_dir(&self, ino: Ino) -> Result<usize, FsError> {
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
    pub(super) fn decode(&self, c: usize, file_name: &str) -> Result<Name, FsError> {
        if file_name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        if file_name == METADATA_FILE {
            return Ok(Name::Metadata);
        }
        if file_name == VIEWS_DIR || file_name == KV_DIR {
            // (At the top of a file mount, the read-only folder of views;
            // of a GGUF file's, the folder of its keys.)
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
    pub(super) fn hashed_name(&self, c: usize, stem: &str) -> Option<String> {
        let live = self.live(c);
        let mut tables = self.hashed.lock_anyway();
        let (generation, table) = tables.entry(c).or_insert((u64::MAX, HashMap::new()));
        if *generation != live.names_gen() {
            *table = live
                .entries_from(0)
                .filter(|(_, e)| names::is_hashed(e.name))
                .map(|(_, e)| (names::tensor_file_name(e.name), e.name.to_string()))
                .collect();
            *generation = live.names_gen();
        }
        table.get(stem).cloned()
    }

    /// The inodes of the files of the tensor `name` is one of (its data
    /// file and its meta), or of `__metadata__.json`: what an edit of that
    /// name may change the attributes of.
    pub(super) fn files_of(&self, c: usize, name: &Name) -> Vec<Ino> {
        let names = match name {
            Name::Metadata => vec![Name::Metadata],
            Name::Tensor(_, tensor) => vec![
                Name::Tensor(TensorFile::Data, tensor.clone()),
                Name::Tensor(TensorFile::Meta, tensor.clone()),
            ],
        };
        names
            .iter()
            .filter_map(|n| self.find(c, n))
            .map(|node| self.ino_of(node))
            .collect()
    }

    /// The node a decoded name stands for now, if it exists.
    pub(super) fn find(&self, c: usize, name: &Name) -> Option<Node> {
        let live = self.live(c);
        match name {
            Name::Metadata => live.has_metadata_file().then_some(Node::Metadata(c)),
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

    fn folder(&self) -> Option<&Arc<crate::source::Folder>> {
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

    fn model_changes(&self) -> Vec<crate::checkpoint::model_change::ModelChange> {
        self.model_files.changes()
    }

    fn model_commit_begins(&mut self) -> Vec<crate::checkpoint::model_change::ModelChange> {
        self.model_files.commit_begins()
    }

    fn model_landed(
        &mut self,
        landed: &[(
            crate::checkpoint::model_change::ModelChange,
            Option<crate::checkpoint::model_change::Landed>,
        )],
    ) {
        self.model_files.landed(landed)
    }

    fn model_commit_abandoned(&mut self) {
        self.model_files.commit_ends();
    }

    fn discard_model_files(&mut self) -> std::io::Result<Vec<String>> {
        use crate::errno::ToErrno;
        self.model_files
            .discard()
            .map_err(|e| std::io::Error::from_raw_os_error(e.to_errno()))
    }
}
