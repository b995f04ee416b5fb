//! A mount's commits as one transaction over all of its checkpoints: every
//! shard's plan is made (and every edit validated) before anything is
//! written, every new file is written before anything lands, and the files
//! land under one record (`commit::land`). The filesystem holds the shards
//! (with its inodes) behind its own lock and makes one call; this type owns
//! the rest: one commit or discard at a time, commit numbers, and the taint
//! that stops commits after one failed half-way.

use crate::sync::{LockAnyway, RwLockAnyway};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tracing::{error, info, warn};

use super::commit::{CommitLock, CommitOptions, LandError, Landing, land};
pub use super::index_update::rewrite_index;
use super::index_update::{IndexUpdate, index_updates, write_indexes};
use super::model_change::{Landed, ModelChange};
pub use super::shards::{IndexFile, Shards};
use super::staging::Staging;
use super::{CommitError, CommitPlan, EditError, Live, Problem};
use crate::source::Bytes;
use crate::source::Folder;

/// The bytes a commit has written of the new file it is writing.
#[derive(Clone, Debug)]
pub struct CommitProgress {
    pub file: std::path::PathBuf,
    pub done: u64,
    pub total: u64,
}

/// Clears the progress of the commit being written when dropped.
struct ClearProgress<'a>(&'a Mutex<Option<CommitProgress>>);

impl Drop for ClearProgress<'_> {
    fn drop(&mut self) {
        *self.0.lock_anyway() = None;
    }
}

pub struct Transactions {
    staging: Arc<Staging>,
    /// One commit or discard at a time (taken before the shards' lock).
    one_at_a_time: Mutex<()>,
    next_commit: AtomicU64,
    /// Discards that dropped edits, and commits that landed, so far: a
    /// commit that waited for a discard (or the other way round) and finds
    /// nothing left to do says why instead of reporting success.
    discards: AtomicU64,
    landings: AtomicU64,
    /// A commit did not land: the staging folder holds its record.
    unlanded: std::sync::atomic::AtomicBool,
    /// Why this mount does not commit any more (a request handler panicked,
    /// a commit failed half-way), if it does not.
    tainted: Mutex<Option<String>>,
    /// How far the commit being written has gone, for `stfs commit`'s progress bar.
    progress: Mutex<Option<CommitProgress>>,
}

fn read<S>(state: &RwLock<S>) -> RwLockReadGuard<'_, S> {
    state.read_anyway()
}

fn write<S>(state: &RwLock<S>) -> RwLockWriteGuard<'_, S> {
    state.write_anyway()
}

/// Makes the journal of checkpoint `c` durable, fsyncing outside the lock.
pub fn sync_journal<S: Shards>(state: &RwLock<S>, c: usize) -> Result<(), EditError> {
    let (handle, broken, dir) = {
        let st = read(state);
        let live = st.live(c);
        (
            live.journal_handle(),
            live.journal_broken(),
            live.staging_dir(),
        )
    };
    if broken {
        write(state).live_mut(c).sync_journal()?;
    } else if let Some(f) = handle {
        // (The names of the files it names first: the staging files.)
        if let Some(dir) = dir {
            dir.sync_names()?;
        }
        crate::testpoint::synced(&f, f.sync_data())?;
    }
    Ok(())
}

impl Transactions {
    pub fn new(staging: Arc<Staging>) -> Transactions {
        Transactions {
            staging,
            one_at_a_time: Mutex::new(()),
            next_commit: AtomicU64::new(1),
            discards: AtomicU64::new(0),
            landings: AtomicU64::new(0),
            unlanded: std::sync::atomic::AtomicBool::new(false),
            tainted: Mutex::new(None),
            progress: Mutex::new(None),
        }
    }

    /// The file a commit is writing now and how far it has got, if one is.
    pub fn progress(&self) -> Option<CommitProgress> {
        self.progress.lock_anyway().clone()
    }

    /// No more commits from this mount: its edits stay on disk for the next one.
    pub fn taint(&self, why: String) {
        let mut tainted = self.tainted.lock_anyway();
        if tainted.is_none() {
            error!(
                "{why}: this mount will not commit; its edits stay in the staging folder and the next mount takes them back"
            );
            *tainted = Some(why);
        }
    }

    /// A commit did not land: the staging folder holds its record.
    pub fn unlanded(&self) -> bool {
        self.unlanded.load(Ordering::SeqCst)
    }

    pub fn tainted(&self) -> Option<String> {
        self.tainted.lock_anyway().clone()
    }

    /// Drops every staged edit. Returns a line per file, as `commit` does.
    /// Refused on a mount whose commit did not land: its staging folder
    /// holds the record that the next mount completes.
    pub fn discard<S: Shards>(&self, state: &RwLock<S>) -> Result<Vec<String>, CommitError> {
        let landings = self.landings.load(Ordering::SeqCst);
        let _ = crate::testpoint::point("discard:waiting");
        let _one = self.one_at_a_time.lock_anyway();
        let _ = crate::testpoint::point("discard:locked");
        if self.unlanded.load(Ordering::SeqCst) {
            let why = self.tainted().unwrap_or_default();
            return Err(CommitError::DiscardRefused { why });
        }
        let mut st = write(state);
        let dirty = st.lives().any(Live::is_dirty) || !st.model_changes().is_empty();
        if self.landings.load(Ordering::SeqCst) != landings && !dirty {
            return Err(CommitError::CommittedFirst);
        }
        let mut lines = Vec::new();
        for c in 0..st.count() {
            let live = st.live_mut(c);
            let path = live.source().path().display().to_string();
            lines.push(match live.is_dirty() {
                true => format!("{path}: staged edits discarded"),
                false => format!("{path}: nothing to discard"),
            });
            if let Err(e) = live.discard() {
                let e = CommitError::Io {
                    what: format!(
                        "{path}: discarding (its staged edits are kept{})",
                        match c {
                            0 => String::new(),
                            _ => format!("; those of the {c} files before it were discarded"),
                        }
                    ),
                    source: std::io::Error::from_raw_os_error(crate::errno::ToErrno::to_errno(&e)),
                };
                warn!("{e}");
                return Err(e);
            }
        }
        match st.discard_model_files() {
            Ok(names) => lines.extend(names.iter().map(|n| {
                let folder = st.folder_shown().unwrap_or_default();
                format!("{}: staged edits discarded", folder.join(n).display())
            })),
            Err(source) => {
                let e = CommitError::Io {
                    what: "discarding the staged model files (the shards' edits were discarded)"
                        .into(),
                    source,
                };
                warn!("{e}");
                return Err(e);
            }
        }
        info!("staged edits discarded");
        // Counted once done (a commit that waited for this one finds it so).
        if dirty {
            self.discards.fetch_add(1, Ordering::SeqCst);
        }
        Ok(lines)
    }

    /// Commits every checkpoint of the mount, all or none: every plan is made
    /// (and every edit validated) before anything is written, and every new
    /// file is written before the first rename. Returns a line per file.
    /// A program that opened a source just as an in-place commit was about
    /// to write it changed nothing: the commit is planned again (a few
    /// times), and rewrites if that program still has the file open.
    pub fn commit<S: Shards>(
        &self,
        state: &RwLock<S>,
        held: &dyn Fn(&S) -> Vec<Bytes>,
        options: CommitOptions,
    ) -> Result<Vec<String>, CommitError> {
        let discards = self.discards.load(Ordering::SeqCst);
        let _ = crate::testpoint::point("commit:waiting");
        let mut tries = 0;
        loop {
            match self.commit_once(state, held, options, discards) {
                Err(CommitError::Opened { file }) if tries < 4 => {
                    tries += 1;
                    info!(file = %file.display(), "opened by another program as it was about to be written in place: planned again");
                }
                result => return result,
            }
        }
    }

    /// One try of a commit, as named steps: lock the files, plan every
    /// file, write every file, say in each journal which file lands, check
    /// what was written, land, finish. Until a file lands, every way out
    /// removes what was written and abandons the plans (`Pending`).
    fn commit_once<S: Shards>(
        &self,
        state: &RwLock<S>,
        held: &dyn Fn(&S) -> Vec<Bytes>,
        options: CommitOptions,
        discards: u64,
    ) -> Result<Vec<String>, CommitError> {
        if let Some(why) = self.tainted() {
            return Err(CommitError::Tainted { why });
        }
        let _one = self.one_at_a_time.lock_anyway();
        let _ = crate::testpoint::point("commit:locked");
        // The files this commit may replace, locked against other mounts'
        // commits from before the plan's check until they landed.
        let targets = commit_targets(&*read(state), options);
        let _locked = CommitLock::take(&targets)?;
        let commit = self.next_commit.fetch_add(1, Ordering::Relaxed);
        let (mut plans, index_updates) = plan_every_file(state, held, options, commit)
            .inspect_err(|e| warn!("commit refused: {e}"))?;
        let (mut model, model_home) = {
            let mut st = write(state);
            (st.model_commit_begins(), super::commit::ModelHome::of(&*st))
        };
        // Removals land last: one seen done says nothing of the rest.
        model.sort_by_key(|c| c.bytes.is_none());
        // (An index that disagrees with the shards is rewritten by a
        // commit with nothing staged too.)
        if plans.is_empty() && index_updates.is_empty() && model.is_empty() {
            return self.nothing_to_commit(state, discards);
        }
        let mut pending = Pending {
            state,
            planned: plans.iter().map(|(c, _)| *c).collect(),
            written: Vec::new(),
            armed: true,
        };
        self.write_every_file(&mut plans, &mut pending)
            .and_then(|()| write_indexes(&index_updates, options, &mut pending.written))
            .and_then(|()| {
                let written = model_home.write(&model, options.force)?;
                pending.written.extend(written);
                Ok(())
            })
            .inspect_err(|e| warn!("commit failed: {e}"))?;
        // (A test edits here: an edit after the plan, staged until the
        // next commit, which the next mount must take back on the new file.)
        let _ = crate::testpoint::point("commit:written");
        record_landing(state, commit, &plans, &pending)
            .inspect_err(|e| warn!("commit failed: {e}"))?;
        check_written(&plans, &pending).inspect_err(|e| error!("commit refused: {e}"))?;
        let (landed, failed) = self.land_every_file(commit, &mut pending)?;
        // Something landed: what follows finishes each file (or keeps its
        // record for the next mount), whatever happens. (Its file
        // operations, the journal's rewrite among them, cost a retry when
        // they fail, never an edit: the journal as it is knows the commit.)
        let written = pending.disarm();
        let _passed_over = crate::testpoint::best_effort();
        let lines = self.finish_every_file(state, plans, (index_updates, model), written, landed);
        super::trim_memory();
        // Counted once done (a discard that waited for this commit finds it so).
        if landed > 0 {
            self.landings.fetch_add(1, Ordering::SeqCst);
        }
        match failed {
            Some(e) => {
                lines.iter().for_each(|l| info!("{l}"));
                Err(e)
            }
            None => Ok(lines),
        }
    }

    /// A commit with nothing to write: a line per file, or `Discarded` when
    /// a discard came between the call and now.
    fn nothing_to_commit<S: Shards>(
        &self,
        state: &RwLock<S>,
        discards: u64,
    ) -> Result<Vec<String>, CommitError> {
        if self.discards.load(Ordering::SeqCst) != discards {
            return Err(CommitError::Discarded);
        }
        let st = read(state);
        Ok(st
            .lives()
            .map(|live| format!("{}: nothing to commit", live.source().path().display()))
            .collect())
    }

    /// Writes every plan's file (a temp file, or the redo record and what
    /// an in-place commit needs), reporting its progress as it goes.
    fn write_every_file<S: Shards>(
        &self,
        plans: &mut [(usize, CommitPlan)],
        pending: &mut Pending<'_, S>,
    ) -> Result<(), CommitError> {
        for (_, plan) in plans {
            let path = plan.source.path().to_path_buf();
            let mut last_report = std::time::Instant::now();
            let mut progress = |done: u64, total: u64| {
                *self.progress.lock_anyway() = Some(CommitProgress {
                    file: path.clone(),
                    done,
                    total,
                });
                if last_report.elapsed().as_secs() >= 2 {
                    info!(file = %path.display(), "commit: {done} of {total} bytes");
                    last_report = std::time::Instant::now();
                }
            };
            // (Cleared however the write ends, a panic included.)
            let _clear = ClearProgress(&self.progress);
            pending.written.push(plan.write(&mut progress)?);
        }
        Ok(())
    }

    /// Lands every written file under one record. Returns how many landed
    /// and, where they did not all land or did not become durable, the
    /// error to report once those that did are finished; an error when
    /// none changed.
    fn land_every_file<S: Shards>(
        &self,
        commit: u64,
        pending: &mut Pending<'_, S>,
    ) -> Result<(usize, Option<CommitError>), CommitError> {
        match land(commit, &pending.written, &self.staging) {
            // (Landed but not made durable: finished as landed, and said.)
            Ok(not_durable) => Ok((pending.written.len(), not_durable)),
            Err(LandError {
                changed: false,
                error,
                ..
            }) => {
                warn!("commit failed: {error}");
                // (`land` removed its files already: their names are not
                // removed twice, another program may have taken one since.)
                pending.written.clear();
                Err(error)
            }
            Err(LandError {
                done,
                refused,
                error,
                ..
            }) => {
                // Some files changed and others not: the record stays, and
                // the next mount finishes the commit.
                let total = pending.written.len();
                error!("commit failed after {done} of its {total} files landed: {error}");
                self.taint(format!(
                    "a commit did not land ({done} of its {total} files landed: {error})"
                ));
                self.unlanded.store(true, Ordering::SeqCst);
                let failed = CommitError::NotLanded {
                    file: pending.written[done].target(),
                    landed: done,
                    total,
                    refused,
                    source: Box::new(error),
                };
                Ok((done, Some(failed)))
            }
        }
    }

    /// Settles each shard on what landed (its new file mapped, its edits
    /// those made since the plan), and abandons those that did not (their
    /// staging files kept for the next mount); the indexes likewise.
    /// Returns a line per file.
    fn finish_every_file<S: Shards>(
        &self,
        state: &RwLock<S>,
        plans: Vec<(usize, CommitPlan)>,
        (index_updates, model): (Vec<IndexUpdate>, Vec<ModelChange>),
        written: Vec<Box<dyn Landing>>,
        landed: usize,
    ) -> Vec<String> {
        let n_plans = plans.len();
        let mut st = write(state);
        let mut lines = Vec::new();
        let mut rebases = Vec::new();
        let mut written = written.into_iter();
        for (k, (c, plan)) in plans.into_iter().enumerate() {
            let w = written.next().expect("one written file per plan");
            let path = st.live(c).source().path().display().to_string();
            if k >= landed {
                st.live_mut(c).abandon();
                // The record names its staging files: they stay as they are
                // (pinned, on disk) for the next mount to complete it.
                plan.keep_pinned();
                continue;
            }
            let (old, moved) = (plan.source.clone(), plan.moved.clone());
            // (What it did, where that differs from the plan: in place, the
            // bytes shared as they were.)
            let described = w.landed_words().unwrap_or_else(|| plan.described.clone());
            match st.live_mut(c).finish(plan, &*w) {
                Ok(()) => {
                    info!(file = %path, "committed: {described}");
                    lines.push(format!("{path}: committed {described}"));
                    rebases.push((c, old, moved));
                }
                Err(e) => {
                    // Landed, but not mapped: this mount keeps serving the old file.
                    error!(file = %path, "mapping the committed file: {e}");
                    lines.push(format!(
                        "{path}: committed {described}, but this mount could not map the new \
                         file ({e}): it serves the old one and commits no more; unmount and \
                         mount again (the staged edits of the old version are left as they are)"
                    ));
                    self.taint(format!(
                        "{path} was committed but could not be mapped ({e})"
                    ));
                }
            }
        }
        // Tensors moved here from a committed shard now read from its new file.
        for (c, old, moved) in rebases {
            let fresh = st.live(c).source().clone();
            for other in 0..st.count() {
                if other != c {
                    st.live_mut(other).rebase_foreign(&old, &fresh, &moved);
                }
            }
        }
        let n_indexes = index_updates.len();
        for (k, (IndexUpdate { name, bytes, .. }, w)) in
            index_updates.into_iter().zip(written.by_ref()).enumerate()
        {
            if n_plans + k >= landed {
                continue; // not renamed: the next mount does it
            }
            if let Some(ix) = st.index_mut(&name) {
                ix.bytes = bytes;
                ix.stat = w.stat();
            }
            lines.push(format!("{}: rewritten", w.target().display()));
        }
        let mut model_landed = Vec::new();
        for (k, (change, w)) in model.into_iter().zip(written).enumerate() {
            if n_plans + n_indexes + k >= landed {
                continue; // staged still: the next mount finishes it, or commits it
            }
            let (now, done) = match change.bytes {
                Some(_) => {
                    let (stat, etag) = (w.stat(), w.etag());
                    (Some(Landed { stat, etag }), "written")
                }
                None => (None, "removed"),
            };
            lines.push(format!("{}: {done}", w.target().display()));
            model_landed.push((change, now));
        }
        st.model_landed(&model_landed);
        lines
    }
}

/// The files a commit may replace (those of the shards it writes, and the
/// indexes of a local folder): locked against other mounts' commits.
fn commit_targets<S: Shards>(
    st: &S,
    options: CommitOptions,
) -> Vec<(Arc<Folder>, std::ffi::OsString, Option<Arc<std::fs::File>>)> {
    let mut targets: Vec<_> = st
        .lives()
        .filter(|live| live.is_dirty() || options.compact)
        .filter_map(|live| {
            let src = live.source();
            Some((
                src.folder()?.clone(),
                src.file_name().to_os_string(),
                src.file().cloned(),
            ))
        })
        .collect();
    if let Some(folder) = st.folder() {
        targets.extend(
            st.indexes()
                .filter(|ix| ix.remote.is_none())
                .map(|ix| (folder.clone(), ix.name.clone().into(), None)),
        );
    }
    targets
}

/// Each shard's plan (by its number), and the indexes to rewrite.
type Planned = (Vec<(usize, CommitPlan)>, Vec<IndexUpdate>);

/// Every shard's plan, and the indexes to rewrite, or why the commit is
/// refused (then no plan is left standing). Every shard is validated
/// before any is checked against its source.
fn plan_every_file<S: Shards>(
    state: &RwLock<S>,
    held: &dyn Fn(&S) -> Vec<Bytes>,
    options: CommitOptions,
    commit: u64,
) -> Result<Planned, CommitError> {
    let mut st = write(state);
    validate_every_shard(&*st)?;
    let writes = options.compact || st.lives().any(Live::is_dirty);
    check_folder(&*st, writes)?;
    // (Nothing staged: an index that disagrees with the shards is
    // rewritten alone, unless a tensor is in two of them.)
    let alone = !writes && in_two_shards(shard_names(&*st)).is_empty();
    // The parts of a split GGUF file each say how many tensors all
    // of them hold (llama.cpp refuses a model whose count is off).
    if writes && st.count() > 1 {
        let total: u64 = st.lives().map(Live::tensor_count).sum();
        (0..st.count()).for_each(|c| st.live_mut(c).kv_set_split_count(total));
    }
    let held = held(&st);
    let mut plans: Vec<(usize, CommitPlan)> = Vec::new();
    let abandon = |st: &mut S, plans: &[(usize, CommitPlan)]| {
        plans.iter().for_each(|(c, _)| st.live_mut(*c).abandon())
    };
    for c in 0..st.count() {
        match st.live_mut(c).plan(commit, options, &held) {
            Ok(Some(plan)) => plans.push((c, plan)),
            Ok(None) => {}
            Err(e) => {
                abandon(&mut st, &plans);
                return Err(e);
            }
        }
    }
    match index_updates(&*st, &plans) {
        Ok(updates) if writes || alone => Ok((plans, updates)),
        Ok(_) => Ok((plans, Vec::new())),
        Err(e) => {
            abandon(&mut st, &plans);
            Err(e)
        }
    }
}

/// Every edited shard's edits are valid, or the commit is refused with the
/// first shard's problems.
fn validate_every_shard<S: Shards>(st: &S) -> Result<(), CommitError> {
    for live in st.lives().filter(|live| live.is_dirty()) {
        let problems = live.problems();
        if !problems.is_empty() {
            return Err(CommitError::Refused {
                file: live.source().path().to_path_buf(),
                problems,
            });
        }
    }
    Ok(())
}

/// The shards of a mount, each with its file name.
fn shard_names<S: Shards>(st: &S) -> impl Iterator<Item = (String, &Live)> {
    (0..st.count()).map(|c| (format!("{}.safetensors", st.shard_name(c)), st.live(c)))
}

/// Two shard names of one file: a commit of either writes the other. With
/// an index, a tensor in two shards too (without one, the files of a
/// folder are independent).
fn check_folder<S: Shards>(st: &S, writes: bool) -> Result<(), CommitError> {
    let Some(folder) = st.folder_shown().filter(|_| writes) else {
        return Ok(());
    };
    let mut problems = one_file_shards(shard_names(st));
    if st.indexes().next().is_some() {
        problems.extend(in_two_shards(shard_names(st)));
    }
    match problems.is_empty() {
        true => Ok(()),
        false => Err(CommitError::Refused {
            file: folder,
            problems,
        }),
    }
}

/// Each journal says which file is landing (appended under a short lock,
/// fsynced outside it); then the renames, under no lock.
fn record_landing<S: Shards>(
    state: &RwLock<S>,
    commit: u64,
    plans: &[(usize, CommitPlan)],
    pending: &Pending<'_, S>,
) -> Result<(), CommitError> {
    {
        let mut st = write(state);
        for ((c, _), w) in plans.iter().zip(&pending.written) {
            st.live_mut(*c).landing(commit, w.stat())?;
        }
    }
    for (c, _) in plans {
        sync_journal(state, *c)?;
    }
    Ok(())
}

/// Nothing lands that the mount itself would refuse, or read as other
/// tensors than the plan's (the state then would not be the file's).
fn check_written<S: Shards>(
    plans: &[(usize, CommitPlan)],
    pending: &Pending<'_, S>,
) -> Result<(), CommitError> {
    for ((_, plan), w) in plans.iter().zip(&pending.written) {
        same_as_planned(plan, &**w)?;
    }
    Ok(())
}

/// Whether the file `w` leaves reads, with the mount's own reader, as the
/// tensors (and metadata) `plan` laid out.
fn same_as_planned(plan: &CommitPlan, w: &dyn Landing) -> Result<(), CommitError> {
    let Some(seen) = w.reads_as() else {
        return Ok(());
    };
    let seen = seen?;
    let metadata_differs = !seen.is_gguf() && seen.metadata != plan.metadata;
    if seen.tensors != plan.layout.tensors || metadata_differs {
        return Err(CommitError::WouldBeRefused {
            file: w.target(),
            error: crate::format::FormatError::HeaderJson {
                tensor: None,
                message: format!(
                    "it reads as {} tensors{}, not as the {} planned",
                    seen.tensors.len(),
                    if metadata_differs {
                        " with other metadata"
                    } else {
                        ""
                    },
                    plan.layout.tensors.len()
                ),
            },
        });
    }
    Ok(())
}

/// A commit's files written but not landed: while armed, dropping it (an
/// error, a panic) removes them and abandons the shards' plans (their
/// staged files unpinned, their journals' landing notes void).
struct Pending<'a, S: Shards> {
    state: &'a RwLock<S>,
    planned: Vec<usize>,
    written: Vec<Box<dyn Landing>>,
    armed: bool,
}

impl<S: Shards> Pending<'_, S> {
    /// Once a file has landed: nothing is undone any more.
    fn disarm(mut self) -> Vec<Box<dyn Landing>> {
        self.armed = false;
        std::mem::take(&mut self.written)
    }
}

impl<S: Shards> Drop for Pending<'_, S> {
    fn drop(&mut self) {
        if self.armed {
            self.written.iter().for_each(|l| l.remove());
            let mut st = write(self.state);
            self.planned.iter().for_each(|c| st.live_mut(*c).abandon());
            st.model_commit_abandoned();
        }
    }
}

/// Shards of a folder mount that are one file (two names linked to one
/// blob, as a snapshot folder may have): a commit of one would change the
/// other under the mount, and a rename of one would drop the other's edits,
/// so commits refuse them, and `stfs status` says so.
pub fn one_file_shards<'a>(shards: impl Iterator<Item = (String, &'a Live)>) -> Vec<Problem> {
    let mut first: std::collections::HashMap<(u64, u64), String> = Default::default();
    let mut found = Vec::new();
    for (shard, live) in shards {
        let src = live.source();
        if src.file().is_none() {
            continue; // remote: objects are not linked
        }
        let key = (src.stat().dev, src.stat().ino);
        match first.get(&key) {
            Some(a) => found.push(Problem {
                tensor: None,
                rule: format!(
                    "{a} and {shard} are one file (two links to it): a commit would write it \
                     twice; mount a folder whose shards are separate files, or copy one of them"
                ),
            }),
            None => {
                first.insert(key, shard);
            }
        }
    }
    found
}

/// Tensors of a folder mount that are in two shards (given as their file
/// names and states): an index maps each name to one file, so a commit
/// refuses them, and `stfs status` and the merged and index views say so.
pub fn in_two_shards<'a>(shards: impl Iterator<Item = (String, &'a Live)>) -> Vec<Problem> {
    let mut first: std::collections::HashMap<&'a str, String> = Default::default();
    let mut found = Vec::new();
    for (shard, live) in shards {
        for (_, e) in live.entries_from(0).filter(|(_, e)| e.data.is_some()) {
            match first.get(e.name) {
                Some(a) => found.push(Problem {
                    tensor: Some(e.name.to_string()),
                    rule: format!(
                        "is in two shards, {a} and {shard}: an index names one file per tensor (remove or rename one)"
                    ),
                }),
                None => {
                    first.insert(e.name, shard.clone());
                }
            }
        }
    }
    found
}
