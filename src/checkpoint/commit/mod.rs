//! A commit, in three steps so that reads and edits go on meanwhile:
//!
//! 1. `Live::plan` (state locked, briefly): validate every edit, check the
//!    source is the file that was mapped, lay out the new file, pin the
//!    staging files it reads, and mark the journal.
//!    The plan picks the way: in place (`in_place`) when the edits keep the
//!    data section's layout but at its end and nobody else has the file
//!    open, else a rewrite.
//! 2. `CommitPlan::write` (no lock): for a rewrite, a temp file beside the
//!    source, the header as the reference writes it (with room to grow, unless
//!    `--compact`), bytes copied with copy_file_range, the source's mode and
//!    owner, fsync. `land` then records every file's landing in the staging
//!    folder (so that the next mount finishes what a crash interrupted),
//!    writes the in-place files and renames the temp files over their
//!    sources, and fsyncs the folder.
//! 3. `Live::finish` (state locked): map the new file; what the plan wrote and
//!    nobody edited since reads from it now; later edits stay staged.
//!
//! Before `land` nothing of the source changed: a failure leaves it
//! byte-identical and the edits staged.

mod error;
mod landing;
mod lock;
mod model;
pub mod remote;
mod ways;

pub use error::*;
pub use landing::*;
pub use lock::*;
pub use model::{ModelHome, write_model_changes};
pub use ways::*;

use crate::sync::LockAnyway;
use std::ffi::OsString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use tracing::{info, warn};

use super::in_place::{self, InPlaceLayout, InPlaceRecord, Lease};
use super::journal::Record;
use super::staging::{PendingRename, RemoteLanding, Renames, Staging};
use super::{DataObject, EntryMeta, EntrySlot, Id, Live, MetadataDoc, ObjectSlot, next_gen};
use crate::checkpoint::Declined;
use crate::format::{FormatError, FormatWriter, Header, Layout, NoFit};
use crate::source::Folder;
use crate::source::StagingDir;
use crate::source::staged::StagingError;
use crate::source::{Bytes, FileStat, SourceFile, StagedFile};

/// What a plan wrote, for each tensor: the entry and object it took, and
/// their generations then.
struct Member {
    entry: Id,
    entry_gen: u64,
    object: Id,
    object_gen: u64,
}

/// What a commit may do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitOptions {
    /// Replace the source even if it changed behind the mount.
    pub force: bool,
    /// Rewrite, exactly as the reference's `save_file` lays a file out (no
    /// room left in the header, never in place).
    pub compact: bool,
}

/// Everything step 2 needs, taken from the state: it holds the bytes by
/// reference counts, so the state is free again.
pub struct CommitPlan {
    pub commit: u64,
    pub source: Arc<SourceFile>,
    /// The new file's layout (the in-place one for an in-place commit).
    pub layout: Layout,
    /// Taken by `write`.
    way: Option<Box<dyn PlannedWay>>,
    /// What the commit does, in words (`PlannedWay::describe`).
    pub described: String,
    pub(super) metadata: Option<crate::format::Metadata>,
    metadata_gen: u64,
    /// The generation of a GGUF file's keys that the plan wrote, and the
    /// ids of the keys it wrote, in the new file's order.
    kv_gen: u64,
    kv_ids: Vec<u64>,
    inputs: Vec<Bytes>,
    members: Vec<Member>,
    /// Edits with a generation below this were made before the plan.
    mark: u64,
    /// Source tensor index -> its index in the new file (u32::MAX: not in it).
    pub moved: Arc<Vec<u32>>,
    /// Replace whatever file has the source's name (`--force`).
    force: bool,
    _pins: PlanPins,
}

/// What a commit refuses of a layout, naming the tensor once.
fn problem_of(e: FormatError) -> Problem {
    match e {
        FormatError::Gguf(g) => Problem {
            tensor: g.tensor,
            rule: g.rule,
        },
        e => Problem {
            tensor: e.tensor().map(str::to_string),
            rule: e.to_string(),
        },
    }
}

/// What commits are still letting go of on threads of their own (spent
/// staging files, replaced files): while any is, a staging folder may still
/// be held (its lock too) by a checkpoint that is gone.
static LETTING_GO: (std::sync::Mutex<usize>, std::sync::Condvar) =
    (std::sync::Mutex::new(0), std::sync::Condvar::new());

/// One commit's letting go, counted while it runs (however it ends).
struct LettingGo;

impl LettingGo {
    fn start() -> LettingGo {
        *LETTING_GO.0.lock_anyway() += 1;
        LettingGo
    }
}

impl Drop for LettingGo {
    fn drop(&mut self) {
        *LETTING_GO.0.lock_anyway() -= 1;
        LETTING_GO.1.notify_all();
    }
}

/// Waits until every commit has let go of what it left: for a mount made
/// again in the same process (the model test), which must find the staging
/// folder free.
pub fn wait_let_go() {
    let mut n = LETTING_GO.0.lock_anyway();
    while *n > 0 {
        n = LETTING_GO.1.wait(n).unwrap_or_else(|e| e.into_inner());
    }
}

/// Staging files a plan copies from, pinned (see `DataObject::take_for_commit`).
struct PlanPins(Vec<Arc<StagedFile>>);

impl Drop for PlanPins {
    fn drop(&mut self) {
        self.0.iter().for_each(|s| s.unpin());
    }
}

impl Live {
    /// Step 1. None when there is nothing to commit. `held`: the bytes that
    /// open descriptors and the other checkpoints of the mount read (an
    /// in-place commit leaves their ranges alone).
    pub fn plan(
        &mut self,
        commit: u64,
        options: CommitOptions,
        held: &[Bytes],
    ) -> Result<Option<CommitPlan>, CommitError> {
        // (`--compact` rewrites a file with nothing staged too: its layout
        // is the edit. Edits that undid each other, `mv a b; mv b a`, leave
        // nothing to commit, as `stfs status` says.)
        if self.dirty && self.status().changes.is_empty() {
            self.dirty = false;
        }
        if !self.dirty && !options.compact {
            return Ok(None);
        }
        let file = self.source.path().to_path_buf();
        let refused = |problems| CommitError::Refused {
            file: file.clone(),
            problems,
        };
        let problems = self.problems();
        if !problems.is_empty() {
            return Err(refused(problems));
        }
        let (inputs, members) = self.commit_inputs(true);
        // Staging files came back pinned: they are unpinned when the plan
        // goes, or now if it is not made.
        let pins = PlanPins(
            inputs
                .iter()
                .filter_map(|b| b.staging_file().cloned())
                .collect(),
        );
        let metadata = self
            .metadata()
            .expect("problems() refuses invalid metadata")
            .cloned();
        // The file now at the source's name (gone: changed too). A remote
        // object is asked right before its commit completes, not here (no
        // network under the state's lock): here, only what reads found.
        let mapped = self.source.stat();
        let same = match (self.source.folder(), self.source.remote_object()) {
            (Some(folder), _) => match folder.stat_at(self.source.file_name()) {
                // (Written by another program with its size and time put
                // back: changed too; a chmod or chown alone is not.)
                Ok(now) => now.same_version(mapped) && !self.source.written_behind(),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => false,
                Err(e) => return Err(io_err(file.display().to_string())(e)),
            },
            (None, Some(object)) if object.remote().writer().is_some() => !object.replaced(),
            _ => return Err(CommitError::ReadOnly { file: file.clone() }),
        };
        if !same && !options.force {
            return Err(match self.source.remote_object() {
                Some(_) => CommitError::RemoteConflict { file },
                None => CommitError::Conflict { file },
            });
        }
        let upload_record = Some((
            self.staging.base().clone(),
            remote::record_name(self.staging.stem(), commit, self.source.file_name()),
        ));
        let (layout, way) = {
            let writer = self
                .format_writer(metadata.as_ref())
                .map_err(io_err(format!("{}: reading its keys", file.display())))?;
            let format = &*writer;
            let specs = self.commit_specs(&members);
            let reference = format
                .layout(specs.len(), &|i| specs[i], options.compact)
                .map_err(|e: FormatError| refused(vec![problem_of(e)]))?;
            choose(&NewState {
                source: &self.source,
                specs: &specs,
                inputs: &inputs,
                format,
                metadata: metadata.as_ref(),
                held,
                unchanged: same,
                options,
                reference,
                preview: false,
                upload_record,
            })
            .map_err(|Declined(why)| {
                refused(vec![Problem {
                    tensor: None,
                    rule: why,
                }])
            })?
        };
        let mut moved = vec![u32::MAX; self.source.header().tensors.len()];
        for (j, &k) in layout.source_index.iter().enumerate() {
            if let Bytes::Source(src, i) = &inputs[k] {
                if Arc::ptr_eq(src, &self.source) && moved[*i as usize] == u32::MAX {
                    moved[*i as usize] = j as u32
                }
            }
        }
        let moved = Arc::new(moved);
        let patched = layout
            .source_index
            .iter()
            .enumerate()
            .filter(|&(_, &k)| {
                matches!(&inputs[k], Bytes::Patched(p) if Arc::ptr_eq(p.base().0, &self.source))
            })
            .map(|(j, &k)| (members[k].object, j as u32))
            .collect();
        self.committing = Some(super::Committing {
            moved: moved.clone(),
            patched,
        });
        if let Err(e) = self.log(vec![Record::Plan { commit }]) {
            self.committing = None;
            return Err(e.into());
        }
        let described = way.describe(layout.file_len());
        Ok(Some(CommitPlan {
            commit,
            source: self.source.clone(),
            layout,
            way: Some(way),
            described,
            metadata,
            metadata_gen: self.metadata_gen,
            kv_gen: self.kv_generation(),
            kv_ids: self.kv_ids(),
            inputs,
            members,
            mark: next_gen(),
            moved,
            force: options.force,
            _pins: pins,
        }))
    }

    /// The bytes of each tensor of the new state, and what the plan took them
    /// from. `pin`: staging files come back pinned (for a commit).
    fn commit_inputs(&self, pin: bool) -> (Vec<Bytes>, Vec<Member>) {
        let mut inputs = Vec::new();
        let mut members = Vec::new();
        // (Where each one's bytes were when mapped: a GGUF file's order.)
        let mut origins = Vec::new();
        for (id, e) in self.entries_from(0) {
            let (Some(object), super::MetaView::Valid(..)) = (e.data, e.meta) else {
                continue; // a meta without data: not a tensor
            };
            let state = match pin {
                true => self.object_for_commit(object),
                false => self.object(object),
            }
            .expect("an entry's data exists");
            origins.push(
                state
                    .origin
                    .as_ref()
                    .filter(|(src, _)| Arc::ptr_eq(src, &self.source))
                    .map(|(_, i)| *i),
            );
            inputs.push(state.bytes);
            members.push(Member {
                entry: id,
                entry_gen: match &self.entries[id as usize] {
                    EntrySlot::Live(l) => l.generation,
                    _ => 0,
                },
                object,
                object_gen: state.generation,
            });
        }
        if self.source.header().is_gguf() {
            // A GGUF file keeps its order: a tensor where its bytes (or its
            // name) were, new ones last. (Bytes written since, in part or
            // whole, are still that tensor's: it keeps its place.)
            let header = self.source.header();
            let place = |k: usize| match origins[k].or_else(|| {
                inputs[k]
                    .source_tensor()
                    .filter(|(src, _)| Arc::ptr_eq(src, &self.source))
                    .map(|(_, i)| i)
            }) {
                Some(i) => (i as u64, 0),
                None => {
                    let name = self.entry(members[k].entry).map_or("", |e| e.name);
                    match header.index_of(name) {
                        Some(i) => (i as u64, 1),
                        None => (u64::MAX, members[k].entry),
                    }
                }
            };
            let mut order: Vec<usize> = (0..inputs.len()).collect();
            order.sort_by_key(|&k| place(k));
            let mut slots: Vec<Option<(Bytes, Member)>> =
                inputs.into_iter().zip(members).map(Some).collect();
            (inputs, members) = order
                .iter()
                .map(|&k| slots[k].take().expect("each once"))
                .unzip();
        }
        (inputs, members)
    }

    /// Name, dtype and shape of each member, borrowed from the state.
    fn commit_specs(&self, members: &[Member]) -> Vec<(&str, crate::format::Dtype, &[u64])> {
        members
            .iter()
            .map(|m| {
                let e = self.entry(m.entry).expect("a member's entry exists");
                match e.meta {
                    super::MetaView::Valid(dtype, shape) => (e.name, dtype, shape),
                    _ => unreachable!("members have valid metas"),
                }
            })
            .collect()
    }

    /// What writes the headers of this checkpoint's format: safetensors'
    /// with `metadata`, or GGUF's with the keys as edited (read from the
    /// file where unchanged).
    fn format_writer<'m>(
        &self,
        metadata: Option<&'m crate::format::Metadata>,
    ) -> std::io::Result<Box<dyn FormatWriter + 'm>> {
        Ok(match self.gguf_writer()? {
            Some(g) => Box::new(g),
            None => Box::new(crate::format::writer::Safetensors { metadata }),
        })
    }

    /// A GGUF checkpoint's edited state as a file (`__views__/model.gguf`),
    /// laid out as `--compact` writes it; what a commit would refuse, if
    /// anything.
    pub fn gguf_file(&self) -> Result<super::view::GeneratedFile, Problem> {
        let lost = |rule: String| Problem { tensor: None, rule };
        if let Some(p) = self.problems().first() {
            return Err(p.clone());
        }
        let format = self
            .gguf_writer()
            .map_err(|e| lost(format!("reading its keys: {e}")))?
            .ok_or_else(|| lost("not a GGUF file".into()))?;
        let (inputs, members) = self.commit_inputs(false);
        let specs = self.commit_specs(&members);
        let layout = format
            .layout(specs.len(), &|k| specs[k], true)
            .map_err(problem_of)?;
        let data_start = layout.header.len() as u64;
        let len = layout.file_len();
        let tensors = layout
            .tensors
            .iter()
            .zip(&layout.source_index)
            .map(|(t, &k)| {
                let tensor = super::view::ViewTensor {
                    name: t.name.to_string(),
                    dtype: t.dtype,
                    shape: t.shape.to_vec(),
                    bytes: inputs[k].clone(),
                };
                (data_start + t.data_offsets.0, tensor)
            })
            .collect();
        Ok(super::view::GeneratedFile::placed(
            layout.header,
            tensors,
            len,
        ))
    }

    /// What a commit would do now (for `stfs status`): its way, in words,
    /// and whether it writes a new file beside the source (a rewrite).
    pub fn commit_preview(&self, held: &[Bytes]) -> Option<(String, bool)> {
        if !self.dirty || !self.problems().is_empty() {
            return None;
        }
        if self.committing.is_some() {
            return Some(("a commit of it is running".into(), false));
        }
        let (inputs, members) = self.commit_inputs(false);
        let metadata = self.metadata()?.cloned();
        let format = self.format_writer(metadata.as_ref()).ok()?;
        let format = &*format;
        let specs = self.commit_specs(&members);
        let reference = format.layout(specs.len(), &|i| specs[i], false).ok()?;
        let unchanged = !self.source_changed();
        let (layout, way) = choose(&NewState {
            source: &self.source,
            specs: &specs,
            inputs: &inputs,
            format,
            metadata: metadata.as_ref(),
            held,
            unchanged,
            options: CommitOptions::default(),
            reference,
            preview: true,
            upload_record: None,
        })
        .ok()?;
        let rewrite = way.rewrites();
        Some((way.describe(layout.file_len()), rewrite))
    }

    /// The file at the source's name is not the version this mount mapped
    /// (another program or mount wrote, replaced or removed it): a commit
    /// refuses it unless forced.
    pub fn source_changed(&self) -> bool {
        // (A remote object: as far as reads found.)
        self.source.remote_object().is_some_and(|o| o.replaced())
            || self.source.folder().is_some_and(|f| {
                !f.stat_at(self.source.file_name())
                    .is_ok_and(|now| now.same_version(self.source.stat()))
            })
    }

    /// The plan of this checkpoint did not go through.
    pub fn abandon(&mut self) {
        self.committing = None;
    }

    /// Step 3: the new file is in place; `landed` is it. The source becomes
    /// the new file, each entry and object the plan took settles on its
    /// tensor there, the others keep what they named, and what the plan
    /// read is let go once the commit has returned.
    pub fn finish(
        &mut self,
        mut plan: CommitPlan,
        landed: &dyn Landing,
    ) -> Result<(), CommitError> {
        self.committing = None;
        self.version += 1;
        let header = landed_header(&mut plan);
        let fresh = Arc::new(landed.fresh(&self.source, header)?);
        let old = std::mem::replace(&mut self.source, fresh.clone());
        let (entry_done, object_done) = self.settle_members(&plan, &old, &fresh);
        self.keep_what_the_rest_named(&old, &entry_done, &object_done);
        self.drop_orphans(plan.mark);
        self.kv_after_commit(plan.kv_gen, &plan.kv_ids);
        if self.metadata_gen == plan.metadata_gen {
            if self.metadata == MetadataDoc::Removed {
                // Shown again (as the new file has it): a new file.
                self.metadata_file = self.new_id();
            }
            self.metadata = MetadataDoc::Unchanged;
        }
        self.dirty = !self.overlay().is_empty();
        self.journal_after_commit();
        let_go(plan, old);
        Ok(())
    }

    /// Each member of the plan (entry and object as the plan took them)
    /// settled on its tensor in the new file, where it is still what the
    /// plan took. Returns which entries and objects settled.
    fn settle_members(
        &mut self,
        plan: &CommitPlan,
        old: &Arc<SourceFile>,
        fresh: &Arc<SourceFile>,
    ) -> (Vec<bool>, Vec<bool>) {
        // New index of each member: layout.source_index maps file order -> input order.
        let mut new_index = vec![0u32; plan.members.len()];
        for (j, &k) in plan.layout.source_index.iter().enumerate() {
            new_index[k] = j as u32;
        }
        let len = self.entries.len();
        let (mut entry_done, mut object_done) = (vec![false; len], vec![false; len]);
        let mut source_ids = vec![0; plan.members.len()];
        let mut source_objects = vec![0; plan.members.len()];
        for (k, (m, &j)) in plan.members.iter().zip(&new_index).enumerate() {
            source_ids[j as usize] = m.entry;
            source_objects[j as usize] = m.object;
            let object_same = match &self.objects[m.object as usize] {
                ObjectSlot::Source(_) => m.object_gen == 0,
                ObjectSlot::Live(o) => {
                    // (Written since, in part: what it took lies in the new file now.)
                    let took = plan.inputs[k]
                        .source_tensor()
                        .filter(|(src, _)| Arc::ptr_eq(src, old));
                    o.settle_after_commit(m.object_gen, took, fresh, j)
                }
                ObjectSlot::Gone => false,
            };
            let entry_same = match &self.entries[m.entry as usize] {
                EntrySlot::Source(_) => m.entry_gen == 0,
                EntrySlot::Live(l) => l.generation == m.entry_gen,
                EntrySlot::Gone => false,
            };
            if object_same {
                object_done[m.object as usize] = true;
                if let ObjectSlot::Source(_) = self.objects[m.object as usize] {
                    self.objects[m.object as usize] = ObjectSlot::Source(j);
                }
            }
            // (An entry as the plan took it whose bytes were written since is
            // still the new file's tensor j, written since: `stfs status`
            // says rewritten, and `rm` of it a removal, not a new tensor.)
            let written_since = matches!(self.objects[m.object as usize], ObjectSlot::Live(_));
            if entry_same && (object_same || written_since) {
                entry_done[m.entry as usize] = true;
                let meta_file = self.meta_file_id(m.entry);
                self.settle(m.entry, m.object, j, meta_file);
            }
        }
        self.source_ids = source_ids;
        self.source_objects = source_objects;
        (entry_done, object_done)
    }

    /// Everything else that named the old file by index now holds what it
    /// named itself: its name, its dtype and shape, its bytes.
    fn keep_what_the_rest_named(
        &mut self,
        old: &Arc<SourceFile>,
        entry_done: &[bool],
        object_done: &[bool],
    ) {
        let header = old.header();
        for id in 0..self.entries.len() {
            if !entry_done[id] {
                let slot = std::mem::replace(&mut self.entries[id], EntrySlot::Gone);
                self.entries[id] = match slot {
                    EntrySlot::Source(i) => EntrySlot::Live(Box::new(super::Entry {
                        generation: next_gen(),
                        ..super::Entry::of_source(i, id as Id)
                    })),
                    other => other,
                };
                if let EntrySlot::Live(e) = &mut self.entries[id] {
                    if let Some(i) = e.origin.take() {
                        let t = header.tensors.get(i as usize);
                        e.name.get_or_insert_with(|| t.name.into());
                        if matches!(e.meta, EntryMeta::Source) {
                            e.meta = EntryMeta::Own(super::Meta::Valid {
                                dtype: t.dtype,
                                shape: t.shape.to_vec(),
                            });
                        }
                    }
                }
            }
            if !object_done[id] {
                if let ObjectSlot::Source(i) = self.objects[id] {
                    let o = DataObject::new(Bytes::Source(old.clone(), i), None);
                    o.set_home(self.serial, id as Id);
                    self.objects[id] = ObjectSlot::Live(o);
                }
            }
        }
    }

    /// A meta without data that was there at the plan (before `mark`)
    /// described nothing the commit wrote: it goes, and so does a hidden one.
    fn drop_orphans(&mut self, mark: u64) {
        for id in 0..self.entries.len() {
            let orphan = match &self.entries[id] {
                EntrySlot::Live(e) => {
                    e.data.is_none()
                        && e.generation < mark
                        && (e.meta_hidden
                            || matches!(&e.meta, EntryMeta::Own(super::Meta::Valid { .. })))
                }
                _ => false,
            };
            if orphan {
                let name = self
                    .entry(id as Id)
                    .map(|e| e.name.to_string())
                    .unwrap_or_default();
                self.index.remove(id as Id, &name);
                self.entries[id] = EntrySlot::Gone;
            }
        }
    }

    /// The journal after a commit: a snapshot of the edits made since, or
    /// none at all.
    fn journal_after_commit(&mut self) {
        if self.dirty {
            if let Err(e) = self.snapshot() {
                warn!("rewriting the journal after the commit: {e}");
            }
        } else if let Some(dir) = self.staging.current() {
            // (One left holds the commit's Plan and Landing: replay knows
            // its edits are in the file.)
            if let Err(e) = self.journal.remove(&dir) {
                warn!("removing the journal after the commit: {e}");
            }
        }
    }

    /// Before the rename: the journal says which file is about to land (the
    /// caller fsyncs it, outside the state's lock).
    pub fn landing(&mut self, commit: u64, stat: FileStat) -> Result<(), super::EditError> {
        self.log(vec![Record::Landing { commit, stat }])
    }

    /// After another checkpoint's commit (`old` became `fresh`; `moved` maps
    /// its tensor indices): objects here that hold that checkpoint's tensors
    /// (moved here between the shards of a folder mount) read them from the
    /// new file, and the journal says so.
    pub fn rebase_foreign(
        &mut self,
        old: &Arc<SourceFile>,
        fresh: &Arc<SourceFile>,
        moved: &[u32],
    ) {
        let mut rebased = false;
        for slot in &self.objects {
            let ObjectSlot::Live(o) = slot else { continue };
            let bytes = o.bytes();
            let Some((_, i)) = bytes
                .source_tensor()
                .filter(|(src, _)| Arc::ptr_eq(src, old))
            else {
                continue;
            };
            let j = moved.get(i as usize).copied().unwrap_or(u32::MAX);
            // (Checked again under the object's writer: a write in between.)
            if j != u32::MAX && o.rebase_from(old, i, fresh, j) {
                rebased = true;
            }
        }
        if rebased {
            self.dirty = true;
            if let Err(e) = self.snapshot() {
                warn!("rewriting the journal: {e}");
            }
        }
    }
}

impl CommitPlan {
    /// A plan whose landing failed half-way: its staging files stay pinned
    /// (writes copy them aside) and on disk, for the next mount.
    pub fn keep_pinned(mut self) {
        let pins = std::mem::replace(&mut self._pins, PlanPins(Vec::new()));
        std::mem::forget(pins);
    }

    /// Step 2, touching no state: what the plan's way writes (a new file
    /// beside the source, an in-place commit made ready, a remote upload's
    /// parts), ready to land.
    pub fn write(
        &mut self,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Box<dyn Landing>, CommitError> {
        let way = self.way.take().expect("a plan is written once");
        way.write(self, progress)
    }

    /// A new file beside the source (`share`: its blocks shared with the
    /// source's where they can be), to be renamed over it.
    fn rewrite(
        &self,
        share: Option<u64>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Box<dyn Landing>, CommitError> {
        let started = std::time::Instant::now();
        let folder = self.source.folder().ok_or_else(|| CommitError::ReadOnly {
            file: self.source.path().to_path_buf(),
        })?;
        let mut written = Written::create(
            folder,
            self.source.file_name(),
            self.source.stat(),
            self.source.file().map(|f| &**f),
            |file| self.fill(file, share, progress),
        )?;
        written.replaces = (!self.force).then(|| *self.source.stat());
        info!(
            file = %self.source.path().display(),
            tensors = self.layout.tensors.len(),
            bytes = self.layout.file_len(),
            elapsed = ?started.elapsed(),
            "commit written"
        );
        Ok(Box::new(written))
    }

    /// The new file: header, then every tensor's bytes (with `share`, the
    /// blocks of the source's tensors shared where they can be).
    fn fill(
        &self,
        file: &File,
        share: Option<u64>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), CommitError> {
        crate::testpoint::io("write")
            .and_then(|()| file.write_all_at(&self.layout.header, 0))
            .map_err(io_err(format!(
                "writing the commit of {}",
                self.source.path().display()
            )))?;
        let total: u64 = self.layout.tensors.iter().map(|t| t.nbytes()).sum();
        let data_start = self.layout.header.len() as u64;
        let (mut done, mut shared) = (0, 0);
        for (placed, &k) in self.layout.tensors.iter().zip(&self.layout.source_index) {
            let len = placed.nbytes();
            // (Back to back, or at offsets the format aligns: a gap reads zeros.)
            let out = data_start + placed.data_offsets.0;
            let what = io_err(format!(
                "{}: tensor {:?}: copying its bytes",
                self.source.path().display(),
                placed.name
            ));
            match share {
                Some(block) => {
                    shared += self.inputs[k]
                        .copy_sharing_to(file, out, block)
                        .map_err(what)?
                }
                None => self.inputs[k].copy_to(0, file, out, len).map_err(what)?,
            }
            done += len;
            progress(done, total);
            // (A test kills or pauses the daemon here, the new file half written.)
            crate::testpoint::point("rewrite:copying").map_err(io_err(format!(
                "{}: writing the new file",
                self.source.path().display()
            )))?;
        }
        // (Padding after the last tensor, as the format's writer leaves it;
        // a GGUF file's empty last tensor lies past the previous one's.)
        crate::testpoint::io("truncate")
            .and_then(|()| file.set_len(self.layout.file_len()))
            .map_err(io_err(format!(
                "writing the commit of {}",
                self.source.path().display()
            )))?;
        if share.is_some() {
            info!(
                file = %self.source.path().display(),
                shared,
                copied = total - shared,
                "commit: blocks shared with the old file"
            );
        }
        Ok(())
    }
}

/// The header of the file a commit landed, taken out of its plan: a GGUF
/// header parsed again (its keys are what the file holds now), a
/// safetensors one made from the plan's tensors and metadata.
fn landed_header(plan: &mut CommitPlan) -> Header {
    let header_len = plan.layout.header.len() as u64 - crate::format::PREFIX_LEN;
    let gguf = crate::format::gguf::is_gguf(&plan.layout.header).then(|| {
        Header::parse_any_prefix(&plan.layout.header, plan.layout.file_len())
            .expect("a commit's GGUF header was checked when planned")
    });
    plan.layout.header = Vec::new();
    let tensors = std::mem::take(&mut plan.layout.tensors);
    match gguf {
        Some(h) => h,
        None => Header::from_parts(header_len, tensors, plan.metadata.clone()),
    }
}

/// The staging files the plan read are spent. Removing them frees their
/// blocks and page cache (27 ms for 64 MiB on ext4, a third of that
/// append's commit), as unmapping the replaced file does: both wait until
/// the commit has returned, and hold no lock. (The pins go now: a write
/// into a tensor the plan read copies nothing aside.)
fn let_go(mut plan: CommitPlan, old: Arc<SourceFile>) {
    let spent = std::mem::take(&mut plan.inputs);
    drop(plan);
    let going = LettingGo::start();
    let _ = std::thread::Builder::new()
        .name("stfs-unmap".into())
        .spawn(move || {
            // (A test pauses here: the commit has returned.)
            let _ = crate::testpoint::point("commit:spent");
            drop(spent);
            drop(old);
            super::trim_memory();
            drop(going);
        });
}

#[cfg(test)]
mod tests {
    use super::new_mtime;

    #[test]
    fn an_in_place_commit_gives_a_time_after_the_old_one() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        // An old time: now.
        let t = new_mtime((1000, 5));
        assert!(t.0 >= now && (0..1_000_000_000).contains(&t.1), "{t:?}");
        // A time in the future (a clock set back): one nanosecond after it.
        assert_eq!(new_mtime((now + 100, 7)), (now + 100, 8));
        assert_eq!(new_mtime((now + 100, 999_999_999)), (now + 101, 0));
    }
}
