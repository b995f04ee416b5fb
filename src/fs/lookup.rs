//! Reading the namespace: lookups, attributes and listings, and the views
//! made for them.

use super::*;
use crate::fs::views::ViewError;
use crate::sync::LockAnyway;

impl Fs {
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
                } else if let Some(i) = st.model_files.find(name) {
                    Node::ModelFile(i)
                } else {
                    return Err(FsError::NotFound);
                }
            }
            Node::CheckpointDir(_) if name == VIEWS_DIR && st.folder.is_none() => {
                Node::Views(VIEW_BIT)
            }
            Node::CheckpointDir(c) if name == KV_DIR && st.is_gguf() => {
                st.kv_dir(c).ok_or(FsError::NotFound)?
            }
            Node::KvDir(c) => {
                let key = match st.kv_key_of(c, name) {
                    Err(FsError::NameTooLong) => return Err(FsError::NameTooLong),
                    Err(_) => return Err(FsError::NotFound),
                    Ok(key) => key,
                };
                let id = st.live(c).kv_find(&key).ok_or(FsError::NotFound)?;
                Node::KvFile(c, id)
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
    pub(super) fn whole_view(&self, st: &State, ino: Ino) -> Option<Node> {
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
        self.looked_up.lock_anyway().insert(ino, file.clone());
        Some(Node::WholeView(c))
    }

    /// A file removed or replaced while open still answers through its
    /// descriptors, with nlink 0 (`fstat` of an unlinked file; the kernel
    /// asks by inode, with or without `fh`). A JSON file being written
    /// shows its descriptors' text.
    pub fn getattr(&self, ino: Ino, fh: Option<u64>) -> Result<Attr, FsError> {
        let st = self.read_state();
        let node = st.node(ino);
        let handles = self.handles.lock_anyway();
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
            return match open.filter(|f| f.content.lock_anyway().written) {
                Some(f) => Ok(f.attr(1)),
                None => self.attr_of(&st, node),
            };
        }
        let given = fh.and_then(|fh| handles.open.get(&fh));
        // Without a handle (a stat by path of a file gone from the mount), the
        // JSON file a new open of it got last, so that every stat agrees.
        let latest_json = handles.json.get(&ino).and_then(std::sync::Weak::upgrade);
        if let (None, Some(file)) = (given.filter(|h| h.ino() == ino), &latest_json) {
            return Ok(file.attr(0));
        }
        let handle = given
            .filter(|h| h.ino() == ino)
            .or_else(|| handles.open.values().find(|h| h.ino() == ino));
        match handle {
            Some(Handle::Data { object, .. }) => {
                let c = st.home(object).unwrap_or(0);
                let owner = st.live(c).source().owner_now();
                let mut a = self.object_attr(&st, c, object.state(), ino, owner);
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
                    cached_name: false,
                })
            }
            None => Err(node.err().unwrap_or(FsError::NotFound)),
        }
    }

    /// A data file's attributes; `owner` is its source's now
    /// (`SourceFile::owner_now`).
    pub(super) fn object_attr(
        &self,
        st: &State,
        c: usize,
        o: crate::checkpoint::ObjectState,
        ino: Ino,
        owner: FileStat,
    ) -> Attr {
        let src = st.live(c).source();
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
            cached_name: false,
        }
    }

    pub(super) fn attr_of(&self, st: &State, node: Node) -> Result<Attr, FsError> {
        self.attr_with(st, node, &|c| st.live(c).source().owner_now())
    }

    /// `attr_of`, with the owner of checkpoint `c`'s source (now) from `owner`
    /// (a listing asks it once per source, not once per file).
    fn attr_with(
        &self,
        st: &State,
        node: Node,
        owner: &dyn Fn(usize) -> FileStat,
    ) -> Result<Attr, FsError> {
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
            cached_name: false,
        };
        let of_source =
            |c: usize, kind, size, mtime, volatile| of_stat(owner(c), kind, size, mtime, volatile);
        let mut attr = match node {
            Node::FolderRoot => {
                let (_, stat) = st.folder.as_ref().expect("a folder mount");
                let now = st.root_owner();
                Attr {
                    ino,
                    kind: Kind::Directory,
                    size: 0,
                    mtime: stat.modified(),
                    // (Writable where its model files may be made.)
                    // (And sticky where the folder is: in a shared folder,
                    // only a file's owner removes or replaces it.)
                    perm: dir_mode(&now, ro) | (now.mode & 0o1000) as u16,
                    nlink: 2 + st.checkpoints.len() as u32,
                    uid: now.uid,
                    gid: now.gid,
                    volatile: false,
                    cached_name: false,
                }
            }
            Node::CheckpointDir(c) | Node::KvDir(c) => {
                of_source(c, Kind::Directory, 0, st.live(c).source().modified(), false)
            }
            Node::KvFile(c, id) => {
                let live = st.live(c);
                let size = live.kv_len(id).ok_or(FsError::NotFound)?;
                let mtime = live
                    .kv_edited(id)
                    .unwrap_or_else(|| live.source().modified());
                of_source(c, Kind::File, size, mtime, true)
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
            Node::ModelFile(i) => {
                let f = st.model_files.get(i).ok_or(FsError::NotFound)?;
                let owner = st.folder_file_owner(&f.name, f.stat);
                let attr = of_stat(
                    owner,
                    Kind::File,
                    f.bytes.len() as u64,
                    f.stat.modified(),
                    true,
                );
                match st.model_files.editable(&f.name) {
                    Ok(()) if !ro => attr,
                    _ => attr.read_only(),
                }
            }
            Node::Metadata(c) => {
                let size = st.live(c).metadata_len().unwrap_or(0);
                of_source(c, Kind::File, size, st.live(c).source().modified(), true)
            }
            Node::File(c, id, TensorFile::Data) => {
                let o = st.live(c).object(id).ok_or(FsError::NotFound)?;
                self.object_attr(st, c, o, ino, owner(c))
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
                        let (owner, mtime) = drawn_owner(st, draws, owner);
                        of_stat(owner, Kind::File, size, mtime, true)
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
        };
        attr.cached_name = matches!(
            node,
            Node::CheckpointDir(_)
                | Node::Metadata(_)
                | Node::File(..)
                | Node::KvDir(_)
                | Node::KvFile(..)
        );
        Ok(attr)
    }

    /// Directory entries after `offset` (0 to start), in a stable order: `.`,
    /// `..`, `__metadata__.json`, then each name's files by entry id (data
    /// file, then `.meta.json`). Offsets derive from ids, so a listing resumes
    /// correctly across edits.
    pub fn readdir(
        &self,
        ino: Ino,
        offset: u64,
        add: impl FnMut(DirEntry) -> bool,
    ) -> Result<(), FsError> {
        self.list_dir(&self.read_state(), ino, offset, add)
    }

    /// `readdir` with each entry's attributes (READDIRPLUS: a listing and
    /// the lookups of `ls -l` in one).
    pub fn readdir_plus(
        &self,
        ino: Ino,
        offset: u64,
        mut add: impl FnMut(DirEntry, Attr) -> bool,
    ) -> Result<(), FsError> {
        let st = self.read_state();
        let owners = std::cell::RefCell::new(HashMap::new());
        let owner = |c: usize| {
            let mut owners = owners.borrow_mut();
            *owners
                .entry(c)
                .or_insert_with(|| st.live(c).source().owner_now())
        };
        self.list_dir(&st, ino, offset, |e| {
            // (Listed under the same lock: an entry has attributes, but for
            // a race with nothing; such an entry is left out, as if gone.)
            match st
                .node(e.ino)
                .and_then(|node| self.attr_with(&st, node, &owner))
            {
                Ok(attr) => add(e, attr),
                Err(_) => false,
            }
        })
    }

    fn list_dir(
        &self,
        st: &State,
        ino: Ino,
        offset: u64,
        mut add: impl FnMut(DirEntry) -> bool,
    ) -> Result<(), FsError> {
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
                let indexes = st.indexes.iter().map(|(ix, ino)| (*ino, ix.name.clone()));
                let model_files = st
                    .model_files
                    .shown()
                    .map(|(id, f)| (ModelFiles::ino(id), f.name.clone()));
                let files = indexes
                    .chain(model_files)
                    .map(|(ino, name)| (ino, Kind::File, name));
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
                    && m.live.has_metadata_file()
                    && emit(
                        st.ino_of(Node::Metadata(c)),
                        Kind::File,
                        METADATA_FILE.into(),
                        3,
                    )
                {
                    return Ok(());
                }
                if let Some(kv) = st.kv_dir(c).filter(|_| offset < 4) {
                    if emit(st.ino_of(kv), Kind::Directory, KV_DIR.into(), 4) {
                        return Ok(());
                    }
                }
                // `__views__` is reached by its name and not listed: a
                // recursive copy, backup or search of the mount would
                // otherwise compute four more checkpoints (docs/SEMANTICS.md, "Views").
                // File `slot` of id i lists at offset 5 + STRIDE*i + slot.
                let first = offset.saturating_sub(5) / TensorFile::STRIDE;
                for (id, e) in m.live.entries_from(first) {
                    for kind in TensorFile::ALL {
                        let next = 5 + TensorFile::STRIDE * id + kind.slot();
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
            // Keys by id (offset 3 + id): a stable order across edits.
            Node::KvDir(c) => {
                for (id, key) in st.live(c).kv_keys() {
                    let next = 3 + id;
                    if next > offset
                        && emit(
                            st.ino_of(Node::KvFile(c, id)),
                            Kind::File,
                            names::tensor_file_name(&key),
                            next,
                        )
                    {
                        break;
                    }
                }
                Ok(())
            }
            Node::Views(dir) => {
                let parent = st.view_path(dir)?;
                if !matches!(views::find(st, &parent), Some(Found::Folder(_))) {
                    return Err(FsError::NotADirectory);
                }
                if let Some(why) = views::refuses(st, &parent) {
                    return Err(FsError::Invalid(why));
                }
                for e in views::list(st, &parent, offset) {
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
    pub(super) fn view(&self, st: &State, path: &str) -> Result<Arc<GeneratedFile>, FsError> {
        let Some(Found::File(draws)) = views::find(st, path) else {
            return Err(FsError::NotFound);
        };
        let version = views::version(st, draws);
        let make = || {
            let made = views::make(st, path).map(Arc::new);
            if let Err(ViewError::Invalid(why)) = &made {
                warn!(view = path, "not a valid checkpoint now: {why}");
            }
            made
        };
        let made = match views::cached(st, path) {
            true => (*st.view_files.get(path, version, make)).clone(),
            false => make(),
        };
        made.map_err(FsError::from)
    }
}

/// Owner, mode and time of a view file drawing on `draws`: those who may
/// read what it draws on may read it; its time is their last change.
fn drawn_owner(
    st: &State,
    draws: Draws,
    owner: &dyn Fn(usize) -> FileStat,
) -> (FileStat, std::time::SystemTime) {
    match draws {
        Draws::Checkpoint(c) => (owner(c), st.views_changed(Some(c))),
        Draws::All => (st.all_owners(), st.views_changed(None)),
        // Its weight map names the tensors of every shard.
        Draws::Index(i) => {
            let owner = crate::source::access::narrowest(&[st.index_owner(i), st.all_owners()]);
            let mtime = st.indexes[i].0.stat.modified().max(st.views_changed(None));
            (owner.expect("two"), mtime)
        }
        Draws::ModelFile(i) => match st.model_files.get(i) {
            Some(f) => (st.folder_file_owner(&f.name, f.stat), f.stat.modified()),
            // (Removed meanwhile: whoever may read everything.)
            None => (st.all_owners(), st.views_changed(None)),
        },
    }
}
