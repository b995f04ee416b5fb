//! The model files of a folder mount as the mount shows them: each file by
//! its id (its inode is `MODEL_BIT | id`), as edited through the mount, and
//! the folder's files as they are on disk (as mounted, or as last
//! committed). The difference is what a commit writes; each changed name is
//! kept in the staging folder as it changes (`checkpoint::model_change`).

use super::*;
use crate::checkpoint::model_change::{self, Landed, ModelChange};

/// The inodes of model files: `MODEL_BIT | id`.
pub(super) const MODEL_BIT: Ino = 1 << 59;

pub(super) struct ModelFiles {
    /// By id; None: removed (an id is never given again).
    files: Vec<Option<ModelFile>>,
    /// The folder's files as on disk, by name.
    base: std::collections::BTreeMap<String, ModelFile>,
    staging: Arc<Staging>,
    /// Owner and mode of a file made through the mount (the first shard's).
    like: FileStat,
    /// Changes made: the version of the views drawing on them.
    version: u64,
    /// The names of the commit under way, as it took them: each keeps an
    /// entry of its own until the commit landed (never none: an entry gone
    /// would read, after a crash, as "nothing staged" over the new file).
    committing: std::collections::BTreeSet<String>,
    /// A store's names not shown (`Source::Folder::not_shown`).
    not_shown: std::collections::BTreeSet<String>,
}

/// A hidden file made at the root (an editor's swap file) lives in memory:
/// never staged, never committed (the folder's own are not shown).
fn scratch(name: &str) -> bool {
    name.starts_with('.')
}

/// What a name has staged: its bytes, its removal, or nothing.
fn staged_of(shown: Option<&ModelFile>, base: Option<&ModelFile>) -> Option<Option<Arc<Vec<u8>>>> {
    if shown.or(base).is_some_and(|f| scratch(&f.name)) {
        return None;
    }
    match (shown, base) {
        (Some(s), Some(b)) if s.bytes == b.bytes => None,
        (Some(s), _) => Some(Some(s.bytes.clone())),
        (None, Some(_)) => Some(None),
        (None, None) => None,
    }
}

impl ModelFiles {
    pub(super) fn new(files: Vec<ModelFile>, staging: Arc<Staging>, like: FileStat) -> ModelFiles {
        ModelFiles {
            base: files.iter().map(|f| (f.name.clone(), f.clone())).collect(),
            files: files.into_iter().map(Some).collect(),
            staging,
            like,
            version: 0,
            committing: Default::default(),
            not_shown: Default::default(),
        }
    }

    /// The same, knowing the store's names it does not show.
    pub(super) fn not_showing(self, names: Vec<String>) -> ModelFiles {
        ModelFiles {
            not_shown: names.into_iter().collect(),
            ..self
        }
    }

    pub(super) fn version(&self) -> u64 {
        self.version
    }

    pub(super) fn ino(id: usize) -> Ino {
        MODEL_BIT | id as Ino
    }

    /// The id of model file inode `ino`, if it is one shown now.
    pub(super) fn id_of(&self, ino: Ino) -> Option<usize> {
        let id = usize::try_from(ino & !MODEL_BIT).ok()?;
        self.files.get(id)?.as_ref().map(|_| id)
    }

    pub(super) fn get(&self, id: usize) -> Option<&ModelFile> {
        self.files.get(id)?.as_ref()
    }

    /// Every file shown: its id and file, by id.
    pub(super) fn shown(&self) -> impl Iterator<Item = (usize, &ModelFile)> {
        self.files
            .iter()
            .enumerate()
            .filter_map(|(id, f)| Some((id, f.as_ref()?)))
    }

    /// Whether the folder had a file of this name when last read (mounted,
    /// or committed).
    pub(super) fn had(&self, name: &str) -> bool {
        self.base.contains_key(name)
    }

    /// The hidden files made at the root (in memory only).
    pub(super) fn scratch_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .shown()
            .filter(|(_, f)| scratch(&f.name))
            .map(|(_, f)| f.name.clone())
            .collect();
        names.sort();
        names
    }

    pub(super) fn find(&self, name: &str) -> Option<usize> {
        self.shown().find(|(_, f)| f.name == name).map(|(id, _)| id)
    }

    /// Why an edit is refused here, if it is.
    pub(super) fn editable(&self, name: &str) -> Result<(), FsError> {
        if name.len() > model_change::MAX_NAME {
            return Err(FsError::NameTooLong);
        }
        Ok(())
    }

    /// Whether a file of this name can be made at the root: not a shard,
    /// an index, a GGUF file, the views, or weights of another format.
    pub(super) fn may_create(name: &str) -> bool {
        let weights = model_files::left_out(name) == Some("weights of another format");
        !weights && (model_files::is_model_file(name) || name.starts_with('.'))
    }

    /// Changes the files with `change`, then stages `names`; if they cannot
    /// be staged, the files are put back as they were (an edit that failed
    /// changed nothing), and the error is the caller's.
    fn edit<R>(
        &mut self,
        change: impl FnOnce(&mut Self) -> Result<(R, Vec<String>), FsError>,
    ) -> Result<R, FsError> {
        let before = self.files.clone();
        let (out, names) = change(self)?;
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        if let Err(e) = self.restage(&names) {
            self.files = before;
            // (Each entry as the files are again: what was staged of them.)
            let _ = self.restage(&names);
            return Err(e);
        }
        self.version += 1;
        Ok(out)
    }

    /// Gives file `id` these bytes (modified now), and stages them.
    pub(super) fn write(&mut self, id: usize, bytes: Vec<u8>) -> Result<(), FsError> {
        self.edit(|t| {
            let f = t.files[id].as_mut().ok_or(FsError::NotFound)?;
            f.bytes = Arc::new(bytes);
            f.stat.len = f.bytes.len() as u64;
            f.stat.mtime = now();
            Ok(((), vec![f.name.clone()]))
        })
    }

    /// A new, empty file with these permissions (never set-id: it is made
    /// as the shards' owner); its id.
    pub(super) fn create(&mut self, name: &str, mode: u32) -> Result<usize, FsError> {
        self.editable(name)?;
        self.edit(|t| {
            let id = t.push_empty(name);
            let f = t.files[id].as_mut().expect("made");
            f.stat.mode = (f.stat.mode & libc::S_IFMT) | (mode & 0o777);
            Ok((id, vec![name.to_string()]))
        })
    }

    pub(super) fn remove(&mut self, id: usize) -> Result<(), FsError> {
        self.edit(|t| {
            let f = t.files[id].take().ok_or(FsError::NotFound)?;
            Ok(((), vec![f.name]))
        })
    }

    /// Renames file `id` (a file at the new name goes).
    pub(super) fn rename(&mut self, id: usize, to: &str) -> Result<(), FsError> {
        self.editable(to)?;
        self.edit(|t| {
            if let Some(other) = t.find(to).filter(|&o| o != id) {
                t.files[other] = None;
            }
            let f = t.files[id].as_mut().ok_or(FsError::NotFound)?;
            let from = std::mem::replace(&mut f.name, to.to_string());
            // The new name first: a crash between keeps a copy, never loses one.
            Ok(((), vec![to.to_string(), from]))
        })
    }

    /// What a commit writes, taken for it: each of those names keeps an
    /// entry until the commit landed.
    pub(super) fn commit_begins(&mut self) -> Vec<ModelChange> {
        let changes = self.changes();
        self.committing = changes.iter().map(|c| c.name.clone()).collect();
        changes
    }

    /// What a commit writes: each name whose file differs from the folder's.
    pub(super) fn changes(&self) -> Vec<ModelChange> {
        let mut names: Vec<&str> = self.base.keys().map(String::as_str).collect();
        names.extend(self.shown().map(|(_, f)| f.name.as_str()));
        names.sort_unstable();
        names.dedup();
        names
            .into_iter()
            .filter_map(|name| {
                let shown = self.find(name).and_then(|id| self.get(id));
                let base = self.base.get(name);
                let bytes = staged_of(shown, base)?;
                Some(ModelChange {
                    name: name.to_string(),
                    bytes,
                    like: shown.map_or(self.like, |f| f.stat),
                    base: base.map(|b| b.stat),
                    etag: base.and_then(|b| b.etag.clone()),
                    headers: base.map(|b| b.headers.clone()).unwrap_or_default(),
                })
            })
            .collect()
    }

    /// Changes that landed (with the new file's stat): the folder now has them.
    pub(super) fn landed(&mut self, landed: &[(ModelChange, Option<Landed>)]) {
        for (change, now) in landed {
            match (&change.bytes, now) {
                (Some(bytes), Some(now)) => {
                    let file = ModelFile {
                        name: change.name.clone(),
                        bytes: bytes.clone(),
                        stat: now.stat,
                        etag: now.etag.clone(),
                        headers: change.headers.clone(),
                    };
                    self.base.insert(change.name.clone(), file);
                }
                _ => {
                    self.base.remove(&change.name);
                }
            }
        }
        self.commit_ends();
        self.version += 1;
    }

    /// The names the commit took keep an entry only while they differ from
    /// the folder's again.
    pub(super) fn commit_ends(&mut self) {
        let committing = std::mem::take(&mut self.committing);
        let names: Vec<&str> = committing.iter().map(String::as_str).collect();
        // (An entry left is dropped by the next mount: the folder has it.)
        if let Err(e) = self.restage(&names) {
            warn!("forgetting committed model files in the staging folder: {e}");
        }
    }

    /// Every file back as the folder has it; the names that had changes.
    pub(super) fn discard(&mut self) -> Result<Vec<String>, FsError> {
        let changed: Vec<String> = self.changes().into_iter().map(|c| c.name).collect();
        for slot in &mut self.files {
            let base = slot.as_ref().and_then(|f| self.base.get(&f.name));
            *slot = base.cloned();
        }
        for (name, file) in &self.base {
            if !self.files.iter().flatten().any(|f| &f.name == name) {
                self.files.push(Some(file.clone()));
            }
        }
        let names: Vec<&str> = changed.iter().map(String::as_str).collect();
        self.restage(&names)?;
        self.version += 1;
        Ok(changed)
    }

    /// Takes back what an earlier mount staged (from the staging folder
    /// this mount adopted). Returns how many names it changed.
    pub(super) fn take_back(&mut self) -> Result<usize, FsError> {
        let Some(dir) = self.staging.current() else {
            return Ok(0);
        };
        let staged = model_change::staged(&dir).map_err(FsError::Io)?;
        let mut names = Vec::new();
        for (name, bytes) in staged {
            match (self.find(&name), bytes) {
                (Some(id), None) => self.files[id] = None,
                (None, None) => {}
                (id, Some(bytes)) => {
                    let id = id.unwrap_or_else(|| self.push_empty(&name));
                    let f = self.files[id].as_mut().expect("shown");
                    f.stat.len = bytes.len() as u64;
                    f.bytes = Arc::new(bytes);
                }
            }
            names.push(name);
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        // (Entries the folder has already are dropped.)
        self.restage(&refs)?;
        Ok(self.changes().len())
    }

    /// A new, empty file, owned as the shards are; its id.
    fn push_empty(&mut self, name: &str) -> usize {
        self.files.push(Some(ModelFile {
            name: name.to_string(),
            bytes: Arc::new(Vec::new()),
            stat: FileStat {
                len: 0,
                mtime: now(),
                ..self.like
            },
            etag: None,
            headers: Vec::new(),
        }));
        self.files.len() - 1
    }

    /// Keeps each name's staged state in the staging folder, in order (a
    /// name of the commit under way: its state whatever it is).
    fn restage(&self, names: &[&str]) -> Result<(), FsError> {
        for name in names {
            let shown = self.find(name).and_then(|id| self.get(id));
            let staged = match staged_of(shown, self.base.get(*name)) {
                None if self.committing.contains(*name) => Some(shown.map(|f| f.bytes.clone())),
                staged => staged,
            };
            let dir = match (&staged, self.staging.current()) {
                (None, None) => continue,
                (_, Some(dir)) => dir,
                (Some(_), None) => self.staging.dir().map_err(EditError::from)?,
            };
            let staged = staged.as_ref().map(|b| b.as_ref().map(|b| b.as_slice()));
            model_change::stage(&dir, name, staged).map_err(FsError::Io)?;
        }
        Ok(())
    }
}

fn now() -> (i64, i64) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (t.as_secs() as i64, t.subsec_nanos() as i64)
}

/// A shard, an index or the views cannot be made or replaced at the root.
const NOT_A_MODEL_FILE: FsError = FsError::NotPermitted(
    "the root of a folder mount holds the shards' directories, the indexes and the folder's \
     other files: a shard, an index, a GGUF file or weights of another format cannot be made there",
);

/// A name of the folder the mount does not show (a file over 64 MiB, not
/// a regular file...) is not made at the root: a commit would replace it.
const NOT_SHOWN: FsError = FsError::NotPermitted(
    "a file of that name is in the folder but not shown in the mount (the mount said why): \
     change it in the folder",
);

/// What else a name at the root may be.
enum RootName {
    Model(usize),
    Folder,
    Index,
    /// In the folder, not shown.
    NotShown,
    Free,
}

fn root_name(st: &State, name: &str) -> RootName {
    if let Some(id) = st.model_files.find(name) {
        RootName::Model(id)
    } else if name == VIEWS_DIR || st.checkpoints.iter().any(|m| m.shown_name() == name) {
        RootName::Folder
    } else if st.indexes.iter().any(|(ix, _)| ix.name == name) {
        RootName::Index
    } else if not_shown(st, name) {
        RootName::NotShown
    } else {
        RootName::Free
    }
}

/// Whether the folder (local, or in a store as listed at mount) has
/// `name`, which the mount neither shows nor had (a model file removed
/// through the mount is there until the commit).
fn not_shown(st: &State, name: &str) -> bool {
    let in_folder = || match st.local_folder() {
        Some(folder) => folder.stat_at(std::ffi::OsStr::new(name)).is_ok(),
        None => st.model_files.not_shown.contains(name),
    };
    !scratch(name) && !st.model_files.had(name) && in_folder()
}

impl Fs {
    /// `create` at the root of a folder mount: a model file.
    pub(super) fn create_model_file(
        &self,
        name: &str,
        (truncate, exclusive): (bool, bool),
        mode: u32,
    ) -> Result<(Attr, Opened), FsError> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let ino = {
            let mut st = self.write_state();
            let id = match root_name(&st, name) {
                RootName::Folder | RootName::Index | RootName::Model(_) if exclusive => {
                    return Err(FsError::Exists);
                }
                RootName::Folder => return Err(FsError::IsADirectory),
                RootName::Index => return Err(crate::fs::error::INDEX_READ_ONLY),
                RootName::NotShown => return Err(NOT_SHOWN),
                RootName::Model(id) => id,
                RootName::Free if !ModelFiles::may_create(name) => return Err(NOT_A_MODEL_FILE),
                RootName::Free => {
                    let id = st.model_files.create(name, mode)?;
                    info!(file = name, "model file created");
                    id
                }
            };
            ModelFiles::ino(id)
        };
        self.kernel.names_changed();
        let opened = self.open(ino, true, truncate)?;
        Ok((self.getattr(ino, Some(opened.fh))?, opened))
    }

    /// `unlink` at the root of a folder mount: a model file.
    pub(super) fn unlink_model_file(&self, name: &str) -> Result<(), FsError> {
        let mut st = self.write_state();
        match root_name(&st, name) {
            RootName::Model(id) => {
                st.model_files.editable(name)?;
                st.model_files.remove(id)?;
            }
            RootName::Folder => return Err(FsError::IsADirectory),
            RootName::Index => return Err(crate::fs::error::INDEX_READ_ONLY),
            RootName::Free | RootName::NotShown => return Err(FsError::NotFound),
        }
        drop(st);
        self.kernel.names_changed();
        info!(file = name, "model file removed");
        Ok(())
    }

    /// `rename` from or to the root of a folder mount: among model files only.
    pub(super) fn rename_model_file(
        &self,
        (parent, name): (Ino, &str),
        (new_parent, new_name): (Ino, &str),
        no_replace: bool,
    ) -> Result<(), FsError> {
        let mut st = self.write_state();
        let at_root = |ino| st.node(ino).is_ok_and(|n| n == Node::FolderRoot);
        if !at_root(parent) || !at_root(new_parent) {
            return Err(FsError::NotPermitted(
                "a file at the root of a folder mount moves only within the root, and a tensor only among tensors",
            ));
        }
        if new_name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let id = match root_name(&st, name) {
            RootName::Model(id) => id,
            RootName::Folder => return Err(NOT_A_MODEL_FILE),
            RootName::Index => return Err(crate::fs::error::INDEX_READ_ONLY),
            RootName::Free | RootName::NotShown => return Err(FsError::NotFound),
        };
        match root_name(&st, new_name) {
            RootName::Model(other) if other == id => return Ok(()),
            RootName::Model(_) if no_replace => return Err(FsError::Exists),
            RootName::Folder | RootName::Index if no_replace => return Err(FsError::Exists),
            RootName::Folder => return Err(FsError::IsADirectory),
            RootName::Index => return Err(crate::fs::error::INDEX_READ_ONLY),
            RootName::NotShown => return Err(NOT_SHOWN),
            RootName::Free if !ModelFiles::may_create(new_name) => return Err(NOT_A_MODEL_FILE),
            _ => {}
        }
        st.model_files.editable(name)?;
        st.model_files.rename(id, new_name)?;
        drop(st);
        self.kernel.names_changed();
        info!(from = name, to = new_name, "model file renamed");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> ModelFile {
        ModelFile {
            name: name.into(),
            bytes: Arc::new(text.as_bytes().to_vec()),
            stat: FileStat::of_mounting_user(0o644),
            etag: None,
            headers: Vec::new(),
        }
    }

    fn table(dir: &std::path::Path) -> ModelFiles {
        let base = Arc::new(crate::source::Folder::open(dir).unwrap());
        let staging = Arc::new(Staging::new(base, "t"));
        let files = vec![file("config.json", "{}"), file("README.md", "# r")];
        ModelFiles::new(files, staging, FileStat::of_mounting_user(0o600))
    }

    /// (name, kind) of each change, and the names staged on disk.
    fn seen(t: &ModelFiles) -> (Vec<(String, &'static str)>, Vec<String>) {
        let changes = t
            .changes()
            .into_iter()
            .map(|c| {
                let kind = match (&c.bytes, c.base) {
                    (None, _) => "removed",
                    (Some(_), None) => "added",
                    (Some(_), Some(_)) => "changed",
                };
                (c.name, kind)
            })
            .collect();
        let staged = t.staging.current().map_or(Vec::new(), |d| {
            model_change::staged(&d)
                .unwrap()
                .into_iter()
                .map(|(n, _)| n)
                .collect()
        });
        (changes, staged)
    }

    fn pairs(v: &[(&str, &'static str)]) -> Vec<(String, &'static str)> {
        v.iter().map(|(n, k)| (n.to_string(), *k)).collect()
    }

    #[test]
    fn what_is_staged_is_what_differs_from_the_folder() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = table(dir.path());
        let config = t.find("config.json").unwrap();
        // Written back as it was: nothing to commit, nothing staged.
        t.write(config, b"{}".to_vec()).unwrap();
        assert_eq!(seen(&t), (vec![], vec![]));
        // A temp file renamed over the config (sed -i): the config changed,
        // the temp name is nothing.
        let tmp = t.create("sedXYZ", 0o644).unwrap();
        t.write(tmp, b"{\"a\": 1}".to_vec()).unwrap();
        t.rename(tmp, "config.json").unwrap();
        assert_eq!(t.find("config.json"), Some(tmp));
        assert_eq!(t.get(config).map(|f| f.name.as_str()), None);
        let changed = pairs(&[("config.json", "changed")]);
        assert_eq!(seen(&t), (changed, vec!["config.json".into()]));
        // A file moved to a new name: removed there, added here.
        let readme = t.find("README.md").unwrap();
        t.rename(readme, "CARD.md").unwrap();
        let moved = pairs(&[
            ("CARD.md", "added"),
            ("README.md", "removed"),
            ("config.json", "changed"),
        ]);
        let staged = vec!["CARD.md".into(), "README.md".into(), "config.json".into()];
        assert_eq!(seen(&t), (moved, staged));
        // And back: nothing of it left.
        t.rename(readme, "README.md").unwrap();
        assert_eq!(seen(&t).1, vec!["config.json".to_string()]);
        // Made and removed: nothing.
        let n = t.create("notes.txt", 0o644).unwrap();
        t.remove(n).unwrap();
        assert_eq!(seen(&t).0, pairs(&[("config.json", "changed")]));
        // A discard: the folder's files, nothing staged.
        assert_eq!(t.discard().unwrap(), vec!["config.json".to_string()]);
        assert_eq!(seen(&t), (vec![], vec![]));
        let mut shown: Vec<&str> = t.shown().map(|(_, f)| f.name.as_str()).collect();
        shown.sort();
        assert_eq!(shown, ["README.md", "config.json"]);
        assert_eq!(
            &**t.get(t.find("config.json").unwrap()).unwrap().bytes,
            b"{}"
        );
    }

    #[test]
    fn a_name_a_commit_took_keeps_its_entry_until_the_commit_ends() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = table(dir.path());
        let config = t.find("config.json").unwrap();
        t.write(config, b"{\"a\": 1}".to_vec()).unwrap();
        assert_eq!(t.commit_begins().len(), 1);
        // Written back as the folder has it while the commit runs: its entry
        // stays (a crash after the landing must not read "nothing staged").
        t.write(config, b"{}".to_vec()).unwrap();
        assert_eq!(seen(&t), (vec![], vec!["config.json".to_string()]));
        // The commit gave up: nothing differs, so nothing is staged.
        t.commit_ends();
        assert_eq!(seen(&t), (vec![], vec![]));
    }

    #[test]
    fn a_later_mount_takes_back_what_differs_and_drops_what_landed() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = table(dir.path());
        let readme = t.find("README.md").unwrap();
        t.remove(readme).unwrap();
        let n = t.create("notes.txt", 0o644).unwrap();
        t.write(n, b"new".to_vec()).unwrap();
        let staging = t.staging.current().unwrap();
        // A commit that landed config.json before its entry went: the
        // folder has it (here: as the base of the next mount).
        model_change::stage(&staging, "config.json", Some(Some(b"{}"))).unwrap();
        let mut later = table(dir.path());
        later.staging.adopt(staging);
        assert_eq!(later.take_back().unwrap(), 2);
        let (changes, staged) = seen(&later);
        assert_eq!(
            changes,
            pairs(&[("README.md", "removed"), ("notes.txt", "added")])
        );
        assert_eq!(staged, ["README.md", "notes.txt"]);
        assert_eq!(
            &**later.get(later.find("notes.txt").unwrap()).unwrap().bytes,
            b"new"
        );
    }

    #[test]
    fn names_that_may_be_made_and_staged() {
        let dir = tempfile::tempdir().unwrap();
        let base = Arc::new(crate::source::Folder::open(dir.path()).unwrap());
        let staging = Arc::new(Staging::new(base, "t"));
        let like = FileStat::of_mounting_user(0o600);
        let t = ModelFiles::new(vec![], staging, like);
        assert!(matches!(
            t.editable(&"x".repeat(121)),
            Err(FsError::NameTooLong)
        ));
        assert!(
            ModelFiles::may_create("config.json") && ModelFiles::may_create(".config.json.swp")
        );
        for not in [
            "a.safetensors",
            "b.index.json",
            "c.gguf",
            "w.bin",
            "__views__",
        ] {
            assert!(!ModelFiles::may_create(not), "{not}");
        }
    }
}
