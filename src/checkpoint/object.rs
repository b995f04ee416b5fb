//! A data file of a checkpoint directory: bytes with an identity of their own
//! (the kernel's inode), whatever name they are listed under. Open file
//! handles hold it, so a handle keeps reading it after an unlink or a rename,
//! and every handle sees every write.

use crate::sync::{LockAnyway, RwLockAnyway};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use super::staging::Staging;
use super::{EditError, Id, next_gen};
use crate::source::{Bytes, Patched, SourceFile};

pub struct DataObject {
    state: RwLock<ObjectState>,
    /// One writer at a time: a first write copies the bytes into staging
    /// without blocking readers, who keep reading the old bytes meanwhile.
    writer: Mutex<()>,
    /// The checkpoint (by `Live::serial`) and entry that list it, kept by
    /// the checkpoint: a write through a handle finds there whose edit it is.
    home: Mutex<(u64, Id)>,
    /// Where a new tensor's bytes will likely go within a block (the end of
    /// the checkpoint's data): its staging file is padded to match.
    append_pad: std::sync::atomic::AtomicU64,
}

#[derive(Clone)]
pub struct ObjectState {
    pub bytes: Bytes,
    /// Time of the last edit; None while unchanged since the source was mapped.
    pub edited: Option<SystemTime>,
    /// Changes with every edit (0: never edited).
    pub generation: u64,
    /// The source tensor these bytes were when mapped (or committed), kept
    /// through edits: where the tensor lies in the file on disk, which a
    /// `.meta.json` shows whether or not the bytes were edited since, so that
    /// editing a tensor does not change its meta's text behind a tool's back.
    pub origin: Option<(Arc<SourceFile>, u32)>,
}

impl ObjectState {
    pub fn of(bytes: Bytes, edited: Option<SystemTime>, generation: u64) -> ObjectState {
        let origin = match &bytes {
            Bytes::Source(src, i) => Some((src.clone(), *i)),
            _ => None,
        };
        ObjectState {
            bytes,
            edited,
            generation,
            origin,
        }
    }
}

impl ObjectState {
    /// Written in part over `old`'s tensor `index`, whose bytes are now
    /// `fresh`'s tensor `to`: the staged blocks lie over that (still an
    /// edit). Returns whether they did.
    fn patch_over(
        &mut self,
        old: &Arc<SourceFile>,
        index: u32,
        fresh: &Arc<SourceFile>,
        to: u32,
    ) -> bool {
        let Bytes::Patched(p) = &self.bytes else {
            return false;
        };
        if !Arc::ptr_eq(p.base().0, old) || p.base().1 != index {
            return false;
        }
        self.bytes = Bytes::Patched(Arc::new(p.rebased(fresh.clone(), to)));
        self.origin = Some((fresh.clone(), to));
        true
    }
}

/// What a write or a truncation did to an object's bytes.
#[derive(Debug, Default, Clone)]
pub struct Changed {
    /// They moved to a new staging file: the journal must say so.
    pub moved: bool,
    /// Their length changed: every view of the checkpoint is laid out anew.
    pub resized: bool,
    /// Blocks of a partly staged source tensor staged by this write (its
    /// staging file, the ranges): the journal must say so.
    pub patched: Option<(String, Vec<(u64, u64)>)>,
}

impl DataObject {
    pub fn new(bytes: Bytes, edited: Option<SystemTime>) -> Arc<DataObject> {
        let generation = if edited.is_some() { next_gen() } else { 0 };
        Arc::new(DataObject {
            state: RwLock::new(ObjectState::of(bytes, edited, generation)),
            writer: Mutex::new(()),
            home: Mutex::new((u64::MAX, Id::MAX)),
            append_pad: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// A new tensor is likely to be appended at this offset within a block
    /// (`STAGING_ALIGN`): its staging file starts with as many bytes.
    pub fn set_append_pad(&self, pad: u64) {
        self.append_pad
            .store(pad, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn state(&self) -> ObjectState {
        self.state.read_anyway().clone()
    }

    pub fn bytes(&self) -> Bytes {
        self.state.read_anyway().bytes.clone()
    }

    pub fn generation(&self) -> u64 {
        self.state.read_anyway().generation
    }

    /// The checkpoint serial and entry that list it.
    pub fn home(&self) -> (u64, Id) {
        *self.home.lock_anyway()
    }

    pub fn set_home(&self, serial: u64, entry: Id) {
        *self.home.lock_anyway() = (serial, entry);
    }

    /// An edit: new bytes, the same origin.
    fn set(&self, bytes: Bytes, edited: Option<SystemTime>, generation: u64) {
        let mut state = self.state.write_anyway();
        state.bytes = bytes;
        state.edited = edited;
        state.generation = generation;
    }

    /// After a commit that took these bytes at `generation` and put them at
    /// `fresh`'s tensor `to` (under the writer's lock: a write in flight
    /// finishes first, and is not undone). Unchanged since: they are that
    /// tensor now, not an edit (true). Written since, over the source
    /// tensor the commit took them from (`took`), in part: the staged
    /// blocks lie over the new file's tensor now (they include every block
    /// the commit wrote, being a copy of what it took), still an edit.
    pub fn settle_after_commit(
        &self,
        generation: u64,
        took: Option<(&Arc<SourceFile>, u32)>,
        fresh: &Arc<SourceFile>,
        to: u32,
    ) -> bool {
        let _writer = self.writer.lock_anyway();
        let mut state = self.state.write_anyway();
        if state.generation == generation {
            *state = ObjectState::of(Bytes::Source(fresh.clone(), to), None, 0);
            return true;
        }
        if let Some((old, index)) = took {
            state.patch_over(old, index, fresh, to);
        }
        false
    }

    /// Another checkpoint's commit put `old`'s tensor `index` at `fresh`'s
    /// tensor `to`, the same bytes: these bytes, if they are (or lie over)
    /// that tensor, are read from there now. Returns whether they were.
    pub fn rebase_from(
        &self,
        old: &Arc<SourceFile>,
        index: u32,
        fresh: &Arc<SourceFile>,
        to: u32,
    ) -> bool {
        let _writer = self.writer.lock_anyway();
        let mut state = self.state.write_anyway();
        match &state.bytes {
            Bytes::Source(src, i) if Arc::ptr_eq(src, old) && *i == index => {
                *state = ObjectState::of(Bytes::Source(fresh.clone(), to), None, 0);
                true
            }
            _ => state.patch_over(old, index, fresh, to),
        }
    }

    /// Writes at `offset`. Within a source tensor, only the blocks written
    /// are staged (`Patched`); otherwise the bytes are first copied into a
    /// private staging file if they are not in one (or a commit or a view
    /// is reading it).
    pub fn write(&self, staging: &Staging, offset: u64, data: &[u8]) -> Result<Changed, EditError> {
        let _writer = self.writer.lock_anyway();
        let state = self.state();
        let before = state.bytes.len();
        let end = offset.saturating_add(data.len() as u64);
        if !data.is_empty() && end <= before {
            let patched = match &state.bytes {
                Bytes::Source(src, i) => Some((
                    Arc::new(Patched::new(&staging.dir()?, src.clone(), *i)?),
                    true,
                )),
                Bytes::Patched(p) if p.staged().pinned() => {
                    Some((Arc::new(p.copy(&staging.dir()?)?), true))
                }
                Bytes::Patched(p) => Some((p.clone(), false)),
                _ => None,
            };
            if let Some((p, moved)) = patched {
                let fresh = p.write_at(data, offset)?;
                // Every block staged: the staging file alone is the tensor.
                let (bytes, moved) = match p.whole() {
                    true => (Bytes::Staged(p.staged().clone()), true),
                    false => (Bytes::Patched(p.clone()), moved),
                };
                self.set(bytes, Some(SystemTime::now()), next_gen());
                return Ok(Changed {
                    moved,
                    resized: false,
                    patched: (!moved && !fresh.is_empty()).then(|| (p.staged().name(), fresh)),
                });
            }
        }
        let (staged, moved) = self.private_copy(staging, u64::MAX)?;
        staged.write_at(data, offset)?;
        self.set(Bytes::Staged(staged), Some(SystemTime::now()), next_gen());
        Ok(Changed {
            moved,
            resized: end > before,
            patched: None,
        })
    }

    /// Cuts or extends (with a hole) to `len`. To 0, nothing is copied.
    pub fn truncate(&self, staging: &Staging, len: u64) -> Result<Changed, EditError> {
        let _writer = self.writer.lock_anyway();
        let before = self.bytes();
        if len == 0 {
            let was_empty = matches!(before, Bytes::Empty);
            self.set(Bytes::Empty, Some(SystemTime::now()), next_gen());
            return Ok(Changed {
                moved: !was_empty,
                resized: !before.is_empty(),
                patched: None,
            });
        }
        if len == before.len() {
            return Ok(Changed::default());
        }
        let (staged, moved) = self.private_copy(staging, len)?;
        staged.set_len(len)?;
        self.set(Bytes::Staged(staged), Some(SystemTime::now()), next_gen());
        Ok(Changed {
            moved,
            resized: true,
            patched: None,
        })
    }

    fn private_copy(
        &self,
        staging: &Staging,
        keep: u64,
    ) -> Result<(Arc<crate::source::StagedFile>, bool), EditError> {
        let state = self.state();
        // The staged bytes lie where a commit will likely put them within a
        // block: where they are (or were, before a truncation), or at the end.
        let pad = match (&state.bytes, &state.origin) {
            (Bytes::Staged(s), _) if !s.pinned() => return Ok((s.clone(), false)),
            (Bytes::Empty, Some((src, i))) => Bytes::Source(src.clone(), *i).pad_in_block(),
            (Bytes::Empty, None) => self.append_pad.load(std::sync::atomic::Ordering::Relaxed),
            (other, _) => other.pad_in_block(),
        };
        Ok((staging.dir()?.copy_of(&state.bytes, keep, pad)?, true))
    }

    /// The bytes as a commit takes them: read under the writer's lock and, if
    /// they are a staging file, pinned before it is released, so that a later
    /// write copies the file instead of changing it under the commit.
    pub fn take_for_commit(&self) -> ObjectState {
        let _writer = self.writer.lock_anyway();
        let state = self.state();
        if let Some(s) = state.bytes.staging_file() {
            s.pin();
        }
        state
    }

    /// Makes written bytes durable.
    pub fn sync(&self) -> std::io::Result<()> {
        match self.bytes().staging_file() {
            Some(s) => s.sync(),
            None => Ok(()),
        }
    }
}
