//! One live, editable checkpoint: the mapped source plus staged edits, and the
//! commit that re-serializes them atomically. Plain Rust, no FUSE: the
//! reference-model tests drive it through `Fs`.
//!
//! Nothing touches the source until a commit, in three steps:
//! `prepare_commit` validates every tensor and checks the source (state read
//! only), `CommitPlan::write` writes a temp file beside the source (unchanged
//! bytes copied with copy_file_range), fsyncs it, renames it over the source
//! keeping its mode and fsyncs the folder (no state held), and `finish_commit`
//! remaps. Any failure before the rename leaves the source byte-identical and
//! the staged edits in place.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use tracing::{info, warn};

use super::{Checkpoint, FileIdentity};
use crate::format::{byte_len, layout, Dtype, FormatError, Metadata, SizeError, TensorSpec};

/// A tensor's identity for the life of the mount; never reused.
pub type TensorId = u64;

/// Where a tensor's bytes are now.
#[derive(Clone)]
pub enum TensorBytes {
    /// Unchanged: tensor `index` of the mapped source.
    Source(Arc<Checkpoint>, usize),
    /// Copied or written into a (sparse) staging file.
    Staged(Arc<StagedFile>),
}

/// A staging file. It is unlinked when the last reference goes, so file
/// handles opened before a commit keep reading what they opened.
pub struct StagedFile {
    file: File,
    path: PathBuf,
    /// Set when a failed commit at unmount leaves the edits on disk.
    keep: std::sync::atomic::AtomicBool,
}

impl StagedFile {
    pub fn len(&self) -> u64 {
        self.file.metadata().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        self.file.read_at(buf, offset)
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        if !self.keep.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    /// None until a `.meta.json` gives it (a tensor created by writing its bytes).
    pub dtype: Option<Dtype>,
    pub shape: Option<Vec<u64>>,
    pub bytes: TensorBytes,
    /// Time of the last edit; None while unchanged since the source was mapped.
    pub edited: Option<SystemTime>,
}

impl Tensor {
    pub fn len(&self) -> u64 {
        match &self.bytes {
            TensorBytes::Source(c, i) => c.header().tensors[*i].nbytes(),
            TensorBytes::Staged(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Everything a commit needs to write the new file, taken from the state under
/// a read lock; holds the bytes by reference counts, so the state is free again.
pub struct CommitPlan {
    path: PathBuf,
    mode: u32,
    layout: crate::format::Layout,
    /// Bytes of each tensor, indexed as `layout.source_index` counts.
    inputs: Vec<TensorBytes>,
}

/// A written and renamed commit.
pub struct Written {
    path: PathBuf,
    identity: FileIdentity,
}

impl CommitPlan {
    /// Step 2, touching no state: writes the temp file beside the source,
    /// fsyncs it, renames it over the source and fsyncs the folder. Before the
    /// rename the source is untouched; a failure removes the temp file.
    pub fn write(self, progress: &mut dyn FnMut(u64, u64)) -> Result<Written, CommitError> {
        let path = self.path;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let stem = path.file_name().unwrap_or_default().to_string_lossy();
        let started = std::time::Instant::now();
        // Not named *.safetensors: a folder mount must never pick up a leftover temp file.
        let mut tmp = tempfile::Builder::new()
            .prefix(&format!(".{stem}.stfs-tmp-{}-", std::process::id()))
            .tempfile_in(dir)
            .map_err(io_err(format!("creating a temp file in {}", dir.display())))?;
        let what = format!("writing {}", tmp.path().display());
        tmp.write_all(&self.layout.header)
            .map_err(io_err(what.clone()))?;
        let total = self.layout.data_len();
        let mut done = 0u64;
        let mut out_offset = self.layout.header.len() as u64;
        for (placed, &src) in self.layout.tensors.iter().zip(&self.layout.source_index) {
            let len = placed.nbytes();
            match &self.inputs[src] {
                TensorBytes::Source(c, i) => copy_range(
                    c.file(),
                    c.tensor_range(*i).start,
                    tmp.as_file(),
                    out_offset,
                    len,
                ),
                TensorBytes::Staged(s) => copy_range(&s.file, 0, tmp.as_file(), out_offset, len),
            }
            .map_err(io_err(what.clone()))?;
            out_offset += len;
            done += len;
            progress(done, total);
        }
        let copied = started.elapsed();
        let file = tmp.as_file();
        file.set_permissions(std::fs::Permissions::from_mode(self.mode))
            .map_err(io_err(what.clone()))?;
        file.sync_all().map_err(io_err(what.clone()))?;
        let synced = started.elapsed();
        // The point of no return: before it the source is untouched.
        tmp.into_temp_path()
            .persist(&path)
            .map_err(|e| CommitError::Io(format!("renaming over {}", path.display()), e.error))?;
        if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
            warn!("fsync of {} after commit: {e}", dir.display());
        }
        let meta = std::fs::metadata(&path).map_err(io_err(format!("{}", path.display())))?;
        info!(
            file = %path.display(),
            tensors = self.layout.tensors.len(),
            bytes = self.layout.file_len(),
            ?copied,
            ?synced,
            renamed = ?started.elapsed(),
            "committed"
        );
        Ok(Written {
            identity: FileIdentity::of(&meta),
            path,
        })
    }
}

/// A tensor's bytes being copied from the source into a staging file.
pub struct StagingCopy {
    id: TensorId,
    checkpoint: Arc<Checkpoint>,
    index: usize,
    staged: StagedFile,
}

impl StagingCopy {
    /// Copies the first `keep` bytes of the tensor (all of them for u64::MAX).
    pub fn copy(&self, keep: u64) -> std::io::Result<()> {
        let range = self.checkpoint.tensor_range(self.index);
        let len = keep.min(range.end - range.start);
        copy_range(
            self.checkpoint.file(),
            range.start,
            &self.staged.file,
            0,
            len,
        )
    }
}

/// Why a commit was refused or failed. The source is untouched in every case.
#[derive(Debug)]
pub enum CommitError {
    /// An edit is invalid (EINVAL): names the tensor and the rule.
    Invalid(String),
    /// The source changed behind the mount (ESTALE); `--force` overrides.
    Conflict(String),
    /// Writing the new file failed (ENOSPC, EIO, ...).
    Io(String, std::io::Error),
}

impl CommitError {
    pub fn errno(&self) -> i32 {
        match self {
            CommitError::Invalid(_) => libc::EINVAL,
            CommitError::Conflict(_) => libc::ESTALE,
            CommitError::Io(_, e) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

impl fmt::Display for CommitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommitError::Invalid(m) | CommitError::Conflict(m) => f.write_str(m),
            CommitError::Io(what, e) => write!(f, "{what}: {e}"),
        }
    }
}

pub struct Live {
    source: Arc<Checkpoint>,
    /// What the source was when mapped (or last committed), to detect conflicts.
    identity: FileIdentity,
    tensors: BTreeMap<TensorId, Tensor>,
    by_name: HashMap<String, TensorId>,
    metadata: Option<Metadata>,
    /// Some edit since the last commit.
    dirty: bool,
    staging_root: PathBuf,
    staging_dir: Option<PathBuf>,
    staged_count: u64,
    /// A folder of kept edits this mount resumed; its manifest goes after a commit.
    resumed_from: Option<PathBuf>,
}

/// `x` for a tensor id, shown in errors.
fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CommitError {
    let what = what.into();
    move |e| CommitError::Io(what, e)
}

impl Live {
    /// Wraps a mapped source; its tensors get ids `first_id..`.
    /// Staging files go in `staging_root` (default: beside the source).
    pub fn new(source: Checkpoint, first_id: TensorId, staging_root: Option<&Path>) -> Live {
        let source = Arc::new(source);
        // One folder per source, also under a shared --staging-dir (the shards
        // of a folder mount must not share staging file names).
        let name = source
            .path()
            .file_name()
            .unwrap_or_default()
            .to_string_lossy();
        let beside = source
            .path()
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let staging_root = staging_root
            .unwrap_or(beside)
            .join(format!(".{name}.stfs-staging"));
        let mut live = Live {
            identity: source.identity(),
            metadata: source.header().metadata.clone(),
            source,
            tensors: BTreeMap::new(),
            by_name: HashMap::new(),
            dirty: false,
            staging_root,
            staging_dir: None,
            staged_count: 0,
            resumed_from: None,
        };
        live.load_source(first_id);
        live.remove_leftovers();
        live
    }

    /// Removes what daemons killed mid-commit left behind: their temp files
    /// beside the source and their staging folders (those without a
    /// manifest.json: a manifest marks edits kept on purpose, see `keep_edits`).
    /// Both carry the daemon's pid; only dead daemons' leftovers go.
    fn remove_leftovers(&self) {
        // Gone, or a zombie waiting to be reaped.
        let dead = |pid: &str| {
            pid.parse::<u32>().is_ok_and(|p| {
                match std::fs::read_to_string(format!("/proc/{p}/stat")) {
                    Ok(stat) => stat
                        .rsplit_once(')')
                        .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
                    Err(_) => true,
                }
            })
        };
        let path = self.source.path();
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let prefix = format!(
            ".{}.stfs-tmp-",
            path.file_name().unwrap_or_default().to_string_lossy()
        );
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            if rest.split_once('-').is_some_and(|(pid, _)| dead(pid))
                && std::fs::remove_file(entry.path()).is_ok()
            {
                info!(file = %entry.path().display(), "removed the temp file of an interrupted commit");
            }
        }
        for entry in std::fs::read_dir(&self.staging_root)
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if dead(&name)
                && !entry.path().join("manifest.json").exists()
                && std::fs::remove_dir_all(entry.path()).is_ok()
            {
                info!(dir = %entry.path().display(), "removed the staging folder of a daemon that is gone");
            }
        }
        let _ = std::fs::remove_dir(&self.staging_root);
    }

    fn load_source(&mut self, first_id: TensorId) {
        let source = self.source.clone();
        self.by_name.reserve(source.header().tensors.len());
        for (i, t) in source.header().tensors.iter().enumerate() {
            let id = first_id + i as u64;
            self.by_name.insert(t.name.clone(), id);
            self.tensors.insert(
                id,
                Tensor {
                    name: t.name.clone(),
                    dtype: Some(t.dtype),
                    shape: Some(t.shape.clone()),
                    bytes: TensorBytes::Source(source.clone(), i),
                    edited: None,
                },
            );
        }
    }

    pub fn source(&self) -> &Arc<Checkpoint> {
        &self.source
    }

    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    pub fn metadata(&self) -> Option<&Metadata> {
        self.metadata.as_ref()
    }

    pub fn tensors(&self) -> &BTreeMap<TensorId, Tensor> {
        &self.tensors
    }

    pub fn get(&self, id: TensorId) -> Option<&Tensor> {
        self.tensors.get(&id)
    }

    pub fn id_of(&self, name: &str) -> Option<TensorId> {
        self.by_name.get(name).copied()
    }

    fn new_staged_file(&mut self) -> std::io::Result<StagedFile> {
        if self.staging_dir.is_none() {
            std::fs::create_dir_all(&self.staging_root)?;
            let dir = self.staging_root.join(format!("{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            self.staging_dir = Some(dir);
        }
        self.staged_count += 1;
        let path = self
            .staging_dir
            .as_ref()
            .expect("set above")
            .join(format!("t{}", self.staged_count));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)?;
        Ok(StagedFile {
            file,
            path,
            keep: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn touch(&mut self, id: TensorId) {
        self.dirty = true;
        if let Some(t) = self.tensors.get_mut(&id) {
            t.edited = Some(SystemTime::now());
        }
    }

    /// Makes a tensor's bytes writable: copies them into a staging file unless
    /// `keep` is 0 bytes (a truncation to 0 copies nothing).
    fn staged(&mut self, id: TensorId, keep: u64) -> std::io::Result<Arc<StagedFile>> {
        if let Some(job) = self.begin_copy(id)? {
            job.copy(keep)?;
            self.finish_copy(job);
        }
        match &self.tensors.get(&id).ok_or_else(not_found)?.bytes {
            TensorBytes::Staged(s) => Ok(s.clone()),
            TensorBytes::Source(..) => unreachable!("finish_copy staged it"),
        }
    }

    /// The first step of making a tensor writable, cheap: a new staging file
    /// for a tensor still read from the source (None if it is staged already).
    /// The copy itself (`StagingCopy::copy`) needs no access to the state, so a
    /// caller can run it without holding its lock; no other edit of the tensor
    /// may happen before `finish_copy`.
    pub fn begin_copy(&mut self, id: TensorId) -> std::io::Result<Option<StagingCopy>> {
        let (checkpoint, index) = match &self.tensors.get(&id).ok_or_else(not_found)?.bytes {
            TensorBytes::Staged(_) => return Ok(None),
            TensorBytes::Source(c, i) => (c.clone(), *i),
        };
        Ok(Some(StagingCopy {
            id,
            checkpoint,
            index,
            staged: self.new_staged_file()?,
        }))
    }

    /// Installs a copied staging file as the tensor's bytes.
    pub fn finish_copy(&mut self, job: StagingCopy) {
        if let Some(t) = self.tensors.get_mut(&job.id) {
            t.bytes = TensorBytes::Staged(Arc::new(job.staged));
        }
    }

    /// Makes a tensor writable (copying its bytes into a staging file on the
    /// first write) and marks it edited; the caller writes into the file it
    /// returns, without holding the state. Callers exclude commits meanwhile.
    pub fn writable(&mut self, id: TensorId) -> std::io::Result<Arc<StagedFile>> {
        let staged = self.staged(id, u64::MAX)?;
        self.touch(id);
        Ok(staged)
    }

    pub fn truncate(&mut self, id: TensorId, len: u64) -> std::io::Result<()> {
        let staged = self.staged(id, len)?;
        staged.file.set_len(len)?;
        self.touch(id);
        Ok(())
    }

    /// A new, empty tensor with no dtype or shape yet.
    pub fn create(&mut self, id: TensorId, name: &str) -> std::io::Result<()> {
        let staged = Arc::new(self.new_staged_file()?);
        self.remove_name(name);
        self.by_name.insert(name.to_string(), id);
        self.tensors.insert(
            id,
            Tensor {
                name: name.to_string(),
                dtype: None,
                shape: None,
                bytes: TensorBytes::Staged(staged),
                edited: Some(SystemTime::now()),
            },
        );
        self.dirty = true;
        Ok(())
    }

    /// Sets dtype and shape (a `.meta.json` write). A tensor created by its
    /// meta alone and still empty becomes zero-filled to the new size.
    pub fn set_meta(&mut self, id: TensorId, dtype: Dtype, shape: Vec<u64>) -> Result<(), String> {
        let t = self.tensors.get(&id).ok_or("no such tensor")?;
        let name = t.name.clone();
        let needed = byte_len(dtype, &shape).map_err(|e| size_message(&name, dtype, &shape, e))?;
        let fill = t.dtype.is_none() && t.is_empty();
        let t = self.tensors.get_mut(&id).expect("checked above");
        t.dtype = Some(dtype);
        t.shape = Some(shape);
        if fill {
            self.truncate(id, needed).map_err(|e| e.to_string())?;
        }
        self.touch(id);
        Ok(())
    }

    pub fn set_metadata(&mut self, metadata: Option<Metadata>) {
        self.metadata = metadata;
        self.dirty = true;
    }

    pub fn remove(&mut self, id: TensorId) -> Option<Tensor> {
        let t = self.tensors.remove(&id)?;
        self.by_name.remove(&t.name);
        self.dirty = true;
        Some(t)
    }

    fn remove_name(&mut self, name: &str) -> Option<Tensor> {
        let id = self.by_name.get(name).copied()?;
        self.remove(id)
    }

    /// Renames a tensor, replacing any tensor of the new name; returns the id
    /// of the replaced tensor.
    pub fn rename(&mut self, id: TensorId, new_name: &str) -> Option<TensorId> {
        let old_name = self.tensors.get(&id)?.name.clone();
        if old_name == new_name {
            return None;
        }
        let replaced = self.by_name.get(new_name).copied();
        self.remove_name(new_name);
        self.by_name.remove(&old_name);
        self.by_name.insert(new_name.to_string(), id);
        self.tensors.get_mut(&id).expect("checked above").name = new_name.to_string();
        self.touch(id);
        replaced
    }

    /// Every check a commit makes before writing anything.
    pub fn validate(&self) -> Result<Vec<TensorSpec>, CommitError> {
        let file = self.source.path().display();
        let mut specs = Vec::with_capacity(self.tensors.len());
        for t in self.tensors.values() {
            let (Some(dtype), Some(shape)) = (t.dtype, t.shape.clone()) else {
                return Err(CommitError::Invalid(format!(
                    "{file}: tensor {:?} has no dtype and shape: write its .meta.json",
                    t.name
                )));
            };
            let needed = byte_len(dtype, &shape).map_err(|e| {
                CommitError::Invalid(format!(
                    "{file}: {}",
                    size_message(&t.name, dtype, &shape, e)
                ))
            })?;
            let len = t.len();
            if len != needed {
                return Err(CommitError::Invalid(format!(
                    "{file}: tensor {:?} holds {len} bytes but {dtype} {} needs {needed}",
                    t.name,
                    crate::format::ShapeDisplay(&shape)
                )));
            }
            specs.push(TensorSpec {
                name: t.name.clone(),
                dtype,
                shape,
            });
        }
        Ok(specs)
    }

    /// Step 1, reading the state only: validates every edit and checks the
    /// source. None when there is nothing to commit.
    pub fn prepare_commit(&self, force: bool) -> Result<Option<CommitPlan>, CommitError> {
        if !self.dirty {
            return Ok(None);
        }
        let specs = self.validate()?;
        let path = self.source.path().to_path_buf();
        let layout = layout(&specs, self.metadata.as_ref())
            .map_err(|e: FormatError| CommitError::Invalid(e.in_file(&path).to_string()))?;
        let current = std::fs::metadata(&path).map_err(io_err(format!("{}", path.display())))?;
        if FileIdentity::of(&current) != self.identity && !force {
            return Err(CommitError::Conflict(format!(
                "{}: the source changed since it was mounted (another program wrote or replaced it); \
                 commit refused: commit with --force to overwrite it, or unmount with --discard",
                path.display()
            )));
        }
        // Bytes of each tensor in input order (the order `validate` listed them).
        let inputs: Vec<TensorBytes> = self.tensors.values().map(|t| t.bytes.clone()).collect();
        Ok(Some(CommitPlan {
            path,
            mode: self.source.mode(),
            layout,
            inputs,
        }))
    }

    /// Step 3: the new file is in place: map it, and forget the staged edits.
    pub fn finish_commit(&mut self, written: Written) -> Result<(), CommitError> {
        // From here the committed file is ours: a later commit must not see a conflict.
        self.identity = written.identity;
        self.remap(&written.path, written.identity)?;
        if let Some(dir) = self.resumed_from.take() {
            // The resumed edits are in the source now: their folder goes.
            let _ = std::fs::remove_file(dir.join("manifest.json"));
            let _ = std::fs::remove_dir(&dir);
        }
        Ok(())
    }

    /// Maps the newly committed file; every tensor now reads from it.
    fn remap(&mut self, path: &Path, written: FileIdentity) -> Result<(), CommitError> {
        let eio = |m: String| CommitError::Io(m, std::io::Error::from_raw_os_error(libc::EIO));
        let fresh = Arc::new(Checkpoint::open(path).map_err(eio)?);
        // Another program could replace the file between the rename and here.
        let replaced = || {
            eio(format!(
                "{}: replaced by another program right after the commit",
                path.display()
            ))
        };
        if fresh.identity() != written {
            return Err(replaced());
        }
        let indices = self
            .tensors
            .values()
            .map(|t| fresh.header().index_of(&t.name))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(replaced)?;
        for (t, index) in self.tensors.values_mut().zip(indices) {
            t.bytes = TensorBytes::Source(fresh.clone(), index);
            t.edited = None;
        }
        self.metadata = fresh.header().metadata.clone();
        let old = std::mem::replace(&mut self.source, fresh);
        self.dirty = false;
        // Unmapping the replaced file frees its blocks and page cache, which takes
        // a while for a large file: let the commit return first.
        let _ = std::thread::Builder::new()
            .name("stfs-unmap".into())
            .spawn(move || drop(old));
        Ok(())
    }

    /// Keeps the staged edits on disk (a commit at unmount failed): marks the
    /// staging files to stay, and writes `manifest.json` beside them saying which
    /// tensor each file holds. Returns the staging folder.
    pub fn keep_edits(&mut self) -> std::io::Result<PathBuf> {
        if self.staging_dir.is_none() {
            self.new_staged_file().map(drop)?;
        }
        let dir = self.staging_dir.clone().expect("created above");
        let tensors: Vec<serde_json::Value> = self
            .tensors
            .values()
            .map(|t| {
                let bytes = match &t.bytes {
                    TensorBytes::Source(c, i) => {
                        let r = c.tensor_range(*i);
                        serde_json::json!({"source_file_offset": r.start, "len": r.end - r.start})
                    }
                    TensorBytes::Staged(s) => {
                        s.keep.store(true, std::sync::atomic::Ordering::Relaxed);
                        serde_json::json!({"staged_file": s.path.file_name().map(|n| n.to_string_lossy().into_owned()), "len": s.len()})
                    }
                };
                serde_json::json!({"name": t.name, "dtype": t.dtype.map(|d| d.name()), "shape": t.shape, "bytes": bytes})
            })
            .collect();
        let manifest = serde_json::json!({
            "source": self.source.path(),
            "source_identity": self.identity,
            "metadata": self.metadata,
            "tensors": tensors,
            "note": "staged edits of an stfs mount whose commit failed; the source is unchanged",
        });
        std::fs::write(
            dir.join("manifest.json"),
            serde_json::to_vec_pretty(&manifest).expect("JSON values serialize"),
        )?;
        Ok(dir)
    }

    /// Takes back the edits a failed commit at unmount kept in `dir` (see
    /// `keep_edits`): they replace the tensors as mapped. The source must be the
    /// file the edits were made on. `new_id` gives each tensor its id.
    pub fn resume(
        &mut self,
        dir: &Path,
        new_id: &mut dyn FnMut() -> TensorId,
    ) -> Result<usize, String> {
        let where_ = |e: &dyn fmt::Display| format!("{}: {e}", dir.join("manifest.json").display());
        let text = std::fs::read(dir.join("manifest.json")).map_err(|e| where_(&e))?;
        let m: serde_json::Value = serde_json::from_slice(&text).map_err(|e| where_(&e))?;
        let identity: FileIdentity =
            serde_json::from_value(m["source_identity"].clone()).map_err(|e| where_(&e))?;
        if identity != self.identity {
            return Err(format!(
                "{}: the edits kept in {} were made on another version of this file; not resumed",
                self.source.path().display(),
                dir.display()
            ));
        }
        let metadata: Option<Metadata> =
            serde_json::from_value(m["metadata"].clone()).map_err(|e| where_(&e))?;
        let entries = m["tensors"]
            .as_array()
            .ok_or_else(|| where_(&"no tensors list"))?;
        let mut tensors = BTreeMap::new();
        let mut by_name = HashMap::new();
        for e in entries {
            let name = e["name"]
                .as_str()
                .ok_or_else(|| where_(&"a tensor without a name"))?
                .to_string();
            let dtype = e["dtype"].as_str().and_then(Dtype::from_name);
            let shape: Option<Vec<u64>> =
                serde_json::from_value(e["shape"].clone()).map_err(|x| where_(&x))?;
            let b = &e["bytes"];
            let bytes = if let Some(file) = b["staged_file"].as_str() {
                let path = dir.join(file);
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|x| where_(&x))?;
                TensorBytes::Staged(Arc::new(StagedFile {
                    file: f,
                    path,
                    keep: std::sync::atomic::AtomicBool::new(false),
                }))
            } else {
                let (offset, len) = (b["source_file_offset"].as_u64(), b["len"].as_u64());
                let index = (0..self.source.header().tensors.len())
                    .find(|&i| {
                        let r = self.source.tensor_range(i);
                        Some(r.start) == offset && Some(r.end - r.start) == len
                    })
                    .ok_or_else(|| {
                        where_(&format!(
                            "tensor {name:?}: its bytes are not a tensor of the source"
                        ))
                    })?;
                TensorBytes::Source(self.source.clone(), index)
            };
            let id = new_id();
            by_name.insert(name.clone(), id);
            tensors.insert(
                id,
                Tensor {
                    name,
                    dtype,
                    shape,
                    bytes,
                    edited: Some(SystemTime::now()),
                },
            );
        }
        let count = tensors.len();
        self.tensors = tensors;
        self.by_name = by_name;
        self.metadata = metadata;
        self.dirty = true;
        self.resumed_from = Some(dir.to_path_buf());
        info!(from = %dir.display(), tensors = count, "resumed kept edits");
        Ok(count)
    }

    /// Drops every staged edit and returns to the source as mapped.
    pub fn discard(&mut self, first_id: TensorId) {
        self.tensors.clear();
        self.by_name.clear();
        self.metadata = self.source.header().metadata.clone();
        self.dirty = false;
        self.load_source(first_id);
    }
}

fn not_found() -> std::io::Error {
    std::io::Error::from_raw_os_error(libc::ENOENT)
}

/// The format core's message for a dtype and shape that have no byte size.
fn size_message(name: &str, dtype: Dtype, shape: &[u64], e: SizeError) -> String {
    let (tensor, shape) = (name.to_string(), shape.to_vec());
    match e {
        SizeError::Overflow => FormatError::Overflow { tensor, shape },
        SizeError::NotByteAligned => FormatError::NotByteAligned {
            tensor,
            dtype,
            shape,
        },
    }
    .to_string()
}

/// Copies `len` bytes between files at offsets: copy_file_range (which can
/// share extents), falling back to pread/pwrite across filesystems. Holes in a
/// sparse source read as zeros either way.
pub fn copy_range(
    from: &File,
    mut from_off: u64,
    to: &File,
    mut to_off: u64,
    len: u64,
) -> std::io::Result<()> {
    let mut left = len;
    while left > 0 {
        let mut off_in = from_off as libc::loff_t;
        let mut off_out = to_off as libc::loff_t;
        let chunk = left.min(1 << 30) as usize;
        // SAFETY: valid fds and offset pointers; the kernel bounds the copy.
        let n = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                &mut off_out,
                chunk,
                0,
            )
        };
        if n > 0 {
            let n = n as u64;
            left -= n;
            from_off += n;
            to_off += n;
            continue;
        }
        if n == 0 {
            // The source ended early: the rest is zeros (a short staged file).
            to.set_len(to.metadata()?.len().max(to_off + left))?;
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EXDEV | libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL) => {
                return copy_by_buffer(from, from_off, to, to_off, left);
            }
            Some(libc::EINTR) => continue,
            _ => return Err(err),
        }
    }
    Ok(())
}

fn copy_by_buffer(
    from: &File,
    mut from_off: u64,
    to: &File,
    mut to_off: u64,
    mut left: u64,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 8 << 20];
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let n = from.read_at(&mut buf[..want], from_off)?;
        if n == 0 {
            to.set_len(to.metadata()?.len().max(to_off + left))?;
            return Ok(());
        }
        to.write_all_at(&buf[..n], to_off)?;
        left -= n as u64;
        from_off += n as u64;
        to_off += n as u64;
    }
    Ok(())
}

impl Drop for Live {
    fn drop(&mut self) {
        // Staged files unlink themselves; remove the folders if nothing is left.
        self.tensors.clear();
        if let Some(dir) = &self.staging_dir {
            let _ = std::fs::remove_dir(dir);
        }
        let _ = std::fs::remove_dir(&self.staging_root);
    }
}
