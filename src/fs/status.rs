//! What `stfs status` shows, and prefetching a tensor.

use super::*;
use crate::sync::LockAnyway;

pub(super) fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// What `stfs status` reports: shown as text, or as JSON (`stfs status --json`).
#[derive(serde::Serialize)]
pub struct StatusReport {
    /// A commit would be refused.
    pub refused: bool,
    /// Why this mount commits no more, if it does not.
    pub tainted: Option<String>,
    pub files: Vec<FileStatus>,
    /// A folder mount's problems between shards (a tensor in two shards).
    pub across_shards: Vec<String>,
    /// The index files a commit would rewrite (they disagree with the
    /// shards as staged: a commit with nothing staged rewrites them too).
    pub indexes: Vec<String>,
    /// The folder's other files a commit writes or removes.
    pub model_files: Vec<Change>,
    /// Hidden files made at the root: in memory only, never committed.
    pub scratch: Vec<String>,
    /// (Paths as text, lossy: JSON has no other way for a name that is not UTF-8.)
    pub folder: Option<String>,
    /// Reads of tensor bytes served since mounted, and their bytes.
    pub reads: u64,
    pub read_bytes: u64,
    /// A remote source's connection and cache figures.
    pub remote: Option<String>,
}

/// One checkpoint file of the mount.
#[derive(serde::Serialize)]
pub struct FileStatus {
    pub file: String,
    /// The remote object changed behind the mount.
    pub replaced: bool,
    pub changes: Vec<Change>,
    pub problems: Vec<String>,
    /// The way the next commit takes, and what it writes.
    pub commit: Option<String>,
}

/// A staged change: its kind (renamed, added, removed, ...) and what it is.
#[derive(serde::Serialize)]
pub struct Change {
    pub kind: String,
    pub what: String,
}

impl StatusReport {
    /// The text `stfs status` prints, a line per change or problem.
    pub fn text(&self) -> String {
        let mut out = String::new();
        if let Some(why) = &self.tainted {
            out.push_str(&format!("{}\n", CommitError::Tainted { why: why.clone() }));
        }
        for f in &self.files {
            let head = match (f.changes.len(), f.problems.len()) {
                (0, 0) => "no changes".to_string(),
                (n, 0) => format!("{n} change{} staged", plural(n)),
                (n, p) => format!(
                    "{n} change{} staged, {p} problem{} (a commit would refuse)",
                    plural(n),
                    plural(p)
                ),
            };
            out.push_str(&format!("{}: {head}\n", f.file));
            if f.replaced {
                out.push_str(
                    "  replaced   the object changed behind the mount: its reads fail (EIO); mount it again\n",
                );
            }
            for c in &f.changes {
                out.push_str(&format!("  {:<10} {}\n", c.kind, c.what));
            }
            for p in &f.problems {
                out.push_str(&format!("  problem    {p}\n"));
            }
            if let Some(way) = &f.commit {
                out.push_str(&format!("  commit     {way}\n"));
            }
        }
        if let (Some(folder), false) = (&self.folder, self.model_files.is_empty()) {
            let n = self.model_files.len();
            out.push_str(&format!(
                "{folder}: {n} model file change{} staged\n",
                plural(n)
            ));
            for c in &self.model_files {
                out.push_str(&format!("  {:<10} {}\n", c.kind, c.what));
            }
        }
        if let (Some(folder), false) = (&self.folder, self.scratch.is_empty()) {
            let n = self.scratch.len();
            out.push_str(&format!(
                "{folder}: {n} hidden file{} made at the root, in memory only (never staged or \
                 committed; gone at unmount): {}\n",
                plural(n),
                self.scratch.join(", ")
            ));
        }
        for name in &self.indexes {
            out.push_str(&format!(
                "{name}: a commit rewrites it to match the shards (weight_map, total_size)\n"
            ));
        }
        if let (Some(folder), false) = (&self.folder, self.across_shards.is_empty()) {
            let n = self.across_shards.len();
            out.push_str(&format!(
                "{}: {n} problem{} across shards (a commit would refuse)\n",
                folder,
                plural(n)
            ));
            for p in &self.across_shards {
                out.push_str(&format!("  problem    {p}\n"));
            }
        }
        out.push_str(&format!(
            "served {} read{} of tensor bytes ({} bytes) since mounted\n",
            self.reads,
            plural(self.reads as usize),
            self.read_bytes
        ));
        if let Some(remote) = &self.remote {
            out.push_str(&format!("{remote}\n"));
        }
        out
    }
}

/// The model files a commit would refuse to write: changed in the folder
/// since mounted (or, for a new one, made there meanwhile).
/// (A folder in a store: `Fs::store_model_conflicts`.)
fn model_conflicts(
    st: &State,
    changes: &[crate::checkpoint::model_change::ModelChange],
) -> Vec<String> {
    let Some(folder) = st.local_folder() else {
        return Vec::new();
    };
    changes
        .iter()
        .filter(|c| {
            let now = folder.stat_through(std::ffi::OsStr::new(&c.name)).ok();
            match (c.base, now) {
                (Some(base), Some(now)) => !now.same_version(&base),
                (None, None) => false,
                _ => true,
            }
        })
        .map(|c| {
            let file = folder.path.join(&c.name);
            CommitError::Conflict { file }.to_string()
        })
        .collect()
}

impl Fs {
    /// The model files of a folder in a store changed there since they were
    /// mounted (asked without the state's lock: a HEAD each).
    fn store_model_conflicts(&self) -> Vec<String> {
        let (shard, changes) = {
            let st = self.read_state();
            let Some(m) = st.checkpoints.first() else {
                return Vec::new();
            };
            (m.live.source().clone(), st.model_files.changes())
        };
        match shard.remote_object().is_some() && !changes.is_empty() {
            true => crate::checkpoint::commit::remote::model_conflicts(&shard, &changes),
            false => Vec::new(),
        }
    }

    /// Why a commit of `live` cannot be done here whatever its edits (the
    /// folders it needs cannot be written), given the way it would take.
    fn cannot_commit(&self, live: &crate::checkpoint::Live, rewrite: bool) -> Vec<String> {
        let Some(folder) = live.source().folder() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        // (Made on the first edit: missing then, it could not be made.)
        if self.staging.current().is_none() {
            out.push(format!(
                "the edits are not journaled: no staging folder could be made in {} (the log \
                 says why); a commit needs one: unmount with --discard, and mount with \
                 --staging-dir DIR",
                self.staging.base().path.display()
            ));
        }
        if rewrite && !folder.writable() {
            out.push(format!(
                "a rewrite puts a new file in {}, which this mount's user cannot write",
                folder.path.display()
            ));
        }
        out
    }

    /// `stfs status`: staged changes and problems, and whether a commit
    /// would be refused.
    pub fn status(&self) -> StatusReport {
        // Edited remote objects are asked whether they are still the
        // version mounted (a commit would be refused), outside the state's
        // lock: one HEAD each.
        // So are the index objects of a folder that the commit would
        // rewrite, and the shards they list that it would not write.
        let (remote, rewritten, indexes) = {
            let st = self.read_state();
            // (As `__views__/<index>.json` shows it: what a commit writes.)
            let rewritten: Vec<String> = (0..st.indexes.len())
                .filter(|&i| {
                    let ix = &st.indexes[i].0;
                    super::views::index_view(&st, i, None).is_ok_and(|b| b != ix.bytes)
                })
                .map(|i| st.indexes[i].0.name.clone())
                .collect();
            let indexes: Vec<_> = st
                .indexes
                .iter()
                .filter(|(ix, _)| rewritten.contains(&ix.name))
                .filter_map(|(ix, _)| ix.remote.clone())
                .collect();
            let remote: Vec<_> = st
                .checkpoints
                .iter()
                .filter(|m| m.live.is_dirty() || !indexes.is_empty())
                .filter(|m| m.live.source().remote_object().is_some())
                .map(|m| m.live.source().clone())
                .collect();
            (remote, rewritten, indexes)
        };
        for source in &remote {
            if let Some(object) = source.remote_object() {
                object.look_again();
            }
        }
        let mut across_stores: Vec<String> = self.store_model_conflicts();
        for index in &indexes {
            let file = std::path::PathBuf::from(index.remote.url(&index.path));
            if index.changed() {
                across_stores.push(CommitError::IndexConflict { file }.to_string());
            }
        }
        let st = self.read_state();
        if !indexes.is_empty() {
            for m in st.checkpoints.iter().filter(|m| !m.live.is_dirty()) {
                let source = m.live.source();
                if source.remote_object().is_some_and(|o| o.replaced()) {
                    let file = source.path().to_path_buf();
                    across_stores.push(CommitError::ListedShardChanged { file }.to_string());
                }
            }
        }
        let held = self.held_bytes(&st);
        let tainted = self.tainted();
        let mut refused = tainted.is_some();
        let mut files = Vec::new();
        for m in &st.checkpoints {
            let s = m.live.status();
            let preview = m
                .live
                .commit_preview(&held)
                .filter(|_| !s.changes.is_empty());
            let rewrite = preview.as_ref().is_some_and(|(_, rewrite)| *rewrite);
            let commit = preview.map(|(way, _)| way);
            let mut problems: Vec<String> = s.problems.iter().map(|p| p.to_string()).collect();
            // What a commit would stop at, said before it is tried.
            if !s.changes.is_empty() {
                problems.extend(self.cannot_commit(&m.live, rewrite));
            }
            // What the commit would refuse first, said as it would say it.
            if !s.changes.is_empty() && m.live.source_changed() {
                let file = s.file.clone();
                problems.push(
                    match m.live.source().remote_object() {
                        Some(_) => CommitError::RemoteConflict { file },
                        None => CommitError::Conflict { file },
                    }
                    .to_string(),
                );
            }
            refused |= !problems.is_empty();
            files.push(FileStatus {
                file: s.file.display().to_string(),
                replaced: m
                    .live
                    .source()
                    .remote_object()
                    .is_some_and(|r| r.replaced()),
                changes: s
                    .changes
                    .iter()
                    .map(|line| {
                        // "kind" padded to 10 columns, a space, then what (which
                        // may itself start with a space: a tensor named "").
                        let kind = line.split(' ').next().unwrap_or_default();
                        let what = line.get(11..).filter(|_| kind.len() <= 10);
                        Change {
                            kind: kind.to_string(),
                            what: what.unwrap_or(&line[kind.len()..]).to_string(),
                        }
                    })
                    .collect(),
                problems,
                commit,
            });
        }
        let mut across: Vec<String> = match &st.folder {
            Some(_) => st.in_two_shards().iter().map(|p| p.to_string()).collect(),
            None => Vec::new(),
        };
        across.extend(across_stores);
        let model_changes = st.model_files.changes();
        across.extend(model_conflicts(&st, &model_changes));
        refused |= !across.is_empty();
        // The shards of a remote folder share one connection and cache.
        let remote = st
            .checkpoints
            .first()
            .and_then(|m| m.live.source().remote_object())
            .map(|r| r.remote().summary().to_string());
        StatusReport {
            refused,
            tainted,
            files,
            across_shards: across,
            indexes: rewritten,
            scratch: st.model_files.scratch_names(),
            model_files: model_changes
                .iter()
                .map(|c| Change {
                    kind: match (&c.bytes, c.base) {
                        (None, _) => "removed",
                        (Some(_), None) => "added",
                        (Some(_), Some(_)) => "changed",
                    }
                    .to_string(),
                    what: c.name.clone(),
                })
                .collect(),
            folder: crate::checkpoint::transaction::Shards::folder_shown(&*st)
                .map(|f| f.display().to_string()),
            reads: self.reads.load(Ordering::Relaxed),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            remote,
        }
    }

    /// Prefetches the tensor of an open data file; a CUDA buffer lives until
    /// the handle closes. Stops early (returning where) when `keep_going` says so.
    pub fn prefetch(
        &self,
        ino: Ino,
        fh: u64,
        req: PrefetchRequest,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<Prefetched, FsError> {
        let PrefetchRequest {
            target,
            offset,
            len,
            caller,
        } = req;
        self.allowed(caller, "prefetch")?;
        let object = match self.handles.lock_anyway().open.get(&fh) {
            Some(Handle::Data { object, .. }) => Some(object.clone()),
            _ => None,
        };
        // (The handles' lock is released here: the state comes first in the lock order.)
        let Some(object) = object else {
            return match self.read_state().node(ino)? {
                Node::File(_, _, TensorFile::Data) => Err(FsError::Invalid(
                    "prefetch needs an open tensor file".into(),
                )),
                _ => Err(FsError::NotATensor),
            };
        };
        let (dtype, shape) = {
            let st = self.read_state();
            let meta = st.home(&object).and_then(|c| {
                st.live(c)
                    .entry(object.home().1)
                    .filter(|e| e.data.is_some())
                    .map(|e| e.meta.to_owned())
            });
            match meta {
                Some(crate::checkpoint::Meta::Valid { dtype, shape }) => (Some(dtype), Some(shape)),
                _ => (None, None),
            }
        };
        let bytes = object.bytes();
        let nbytes = bytes.len();
        let mut done = Prefetched {
            bytes: 0,
            nbytes,
            next: nbytes,
            dtype,
            shape,
            ipc: None,
        };
        let Some(backing) = bytes.backing()? else {
            return Ok(done);
        };
        match target {
            PrefetchTarget::PageCache => {
                let start = offset.min(nbytes);
                let end = match len {
                    0 => nbytes,
                    n => start.saturating_add(n).min(nbytes),
                };
                let (reached, resident) =
                    crate::prefetch::to_page_cache(&backing, start, end, keep_going)?;
                done.next = reached;
                done.bytes = resident;
            }
            PrefetchTarget::Cuda(device) => {
                let arena = self.load_one(device, &backing, nbytes, keep_going)?;
                done.bytes = nbytes;
                done.ipc = Some((arena.handle(), arena.size()));
                if let Some(Handle::Data { device, .. }) =
                    self.handles.lock_anyway().open.get_mut(&fh)
                {
                    device.push(arena);
                }
            }
        }
        Ok(done)
    }

    /// One tensor into a new arena on CUDA device `device`, through the
    /// device's pool, as a load of many would.
    fn load_one(
        &self,
        device: i32,
        backing: &crate::source::Backing,
        nbytes: u64,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> Result<Arc<dyn crate::prefetch::load::engine::Arena>, FsError> {
        use crate::prefetch::load::{Load, Target, plan::Item};
        let pool = self.devices.pool(Target::Cuda(device))?;
        let item = Item {
            name: String::new(),
            dtype: crate::format::Dtype::U8,
            shape: vec![nbytes],
            nbytes,
            backing: Some(backing.clone()),
        };
        let load = Load::start(vec![item], pool, crate::prefetch::load::run::Way::Direct)?;
        load.wait(keep_going)?;
        Ok(load.arena.clone())
    }
}
