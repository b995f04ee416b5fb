//! The other files of a model folder in a commit: each changed file written
//! beside its target and renamed over it, each removed file unlinked, under
//! the same record as the shards and the indexes (all land or none).

use super::*;
use crate::checkpoint::model_change::ModelChange;
use crate::checkpoint::shards::Shards;
use crate::checkpoint::staging::PendingRemove;
use std::ffi::OsStr;

/// Writes every changed model file of `folder` beside its target, and
/// readies every removal. A file changed in the folder since it was mounted
/// (or a new name taken there meanwhile) refuses the commit, unless forced.
pub fn write_model_changes(
    folder: &Arc<Folder>,
    changes: &[ModelChange],
    force: bool,
) -> Result<Vec<Box<dyn Landing>>, CommitError> {
    let mut out: Vec<Box<dyn Landing>> = Vec::new();
    // (What was written is removed if a later file fails.)
    let give_up = |out: &[Box<dyn Landing>]| out.iter().for_each(|l| l.remove());
    for change in changes {
        match write_one(folder, change, force) {
            Ok(l) => out.push(l),
            Err(e) => {
                give_up(&out);
                return Err(e);
            }
        }
    }
    Ok(out)
}

fn write_one(
    folder: &Arc<Folder>,
    change: &ModelChange,
    force: bool,
) -> Result<Box<dyn Landing>, CommitError> {
    let name = OsStr::new(&change.name);
    let now = current_file(folder, name)?;
    let now_stat = stat_through(folder, name)?;
    let unchanged = match (change.base, now_stat) {
        (Some(base), Some(now)) => now.same_version(&base),
        (None, None) => true,
        _ => false,
    };
    if !unchanged && !force {
        return Err(CommitError::Conflict {
            file: folder.path.join(name),
        });
    }
    // (A link, as a snapshot's files are, is checked through: it is
    // replaced, or removed, whatever its target.)
    let expected = change.base.filter(|_| !force && now.is_some());
    let Some(bytes) = &change.bytes else {
        // What is there now, checked above (forced: whatever it is now,
        // never whatever a later program puts there; nothing: nothing to do).
        let there = match folder.stat_at(name) {
            Ok(there) => Some(there),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
            Err(e) => {
                return Err(io_err(format!(
                    "reading {}",
                    folder.path.join(name).display()
                ))(e));
            }
        };
        return Ok(Box::new(Removal {
            folder: folder.clone(),
            target: name.to_os_string(),
            expected: there,
        }));
    };
    let fill = |f: &File| {
        crate::testpoint::io("write")
            .and_then(|()| f.write_all_at(bytes, 0))
            .map_err(io_err(format!(
                "writing {}",
                folder.path.join(name).display()
            )))
    };
    let mut w = Written::create(folder, name, &change.like, now.as_ref(), fill)?;
    // Only over the very file mounted (a program that replaced it since
    // keeps its file); a new file over nothing.
    w.replaces = expected;
    // A new name: never over a file another program made there since.
    w.fresh_name = now_stat.is_none();
    Ok(Box::new(w))
}

/// The file at `name` (through a link) as it is now; None: nothing there.
pub(crate) fn stat_through(folder: &Folder, name: &OsStr) -> Result<Option<FileStat>, CommitError> {
    match folder.stat_through(name) {
        Ok(st) => Ok(Some(st)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(io_err(format!(
            "reading {}",
            folder.path.join(name).display()
        ))(e)),
    }
}

/// The file at `name` in `folder` now (None: no such file, or a link,
/// which the commit replaces with a file of its own).
fn current_file(folder: &Folder, name: &OsStr) -> Result<Option<File>, CommitError> {
    match folder.open_file(name, libc::O_RDONLY | libc::O_NONBLOCK, 0) {
        Ok(f) => Ok(Some(f)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => Ok(None),
        Err(e) => Err(io_err(format!(
            "reading {}",
            folder.path.join(name).display()
        ))(e)),
    }
}

/// A file of the folder that the commit removes.
pub struct Removal {
    folder: Arc<Folder>,
    target: OsString,
    /// The file it must still be (None: already gone, under `--force`).
    expected: Option<FileStat>,
}

impl Landing for Removal {
    fn stat(&self) -> FileStat {
        self.expected.unwrap_or(FileStat::of_mounting_user(0))
    }

    fn target(&self) -> PathBuf {
        self.folder.path.join(&self.target)
    }

    fn record(&self, renames: &mut Renames, _dir: &StagingDir) -> Result<(), CommitError> {
        if self.expected.is_none() {
            return Ok(()); // (nothing to remove, nor to finish)
        }
        renames.removes.push(PendingRemove {
            folder: self.folder.path.clone(),
            target: self.target.to_string_lossy().into_owned(),
            expected: self.expected,
        });
        Ok(())
    }

    fn folder(&self) -> Option<&Arc<Folder>> {
        Some(&self.folder)
    }

    fn land(&self, _dir: &StagingDir) -> Result<(), Unlanded> {
        if self.expected.is_none() {
            return Ok(());
        }
        let unlanded =
            |e| Unlanded::unchanged(io_err(format!("removing {}", self.target().display()))(e));
        match crate::checkpoint::staging::remove_if(&self.folder, &self.target, self.expected) {
            Ok(true) => Ok(()),
            Ok(false) => Err(Unlanded::unchanged(CommitError::Conflict {
                file: self.target(),
            })),
            Err(e) => Err(unlanded(e)),
        }
    }

    fn remove(&self) {}

    fn fresh(&self, _old: &SourceFile, _header: Header) -> Result<SourceFile, CommitError> {
        unreachable!("a removal is no shard's landing")
    }

    fn reads_as(&self) -> Option<Result<Header, CommitError>> {
        None
    }
}

/// Where a folder mount's model files land: its folder, or the prefix of
/// its shards in a store.
pub enum ModelHome {
    Folder(Arc<Folder>),
    Store(Arc<SourceFile>),
    None,
}

impl ModelHome {
    pub fn of<S: Shards>(st: &S) -> ModelHome {
        let first = (st.count() > 0).then(|| st.live(0).source());
        match (first.filter(|s| s.remote_object().is_some()), st.folder()) {
            (Some(shard), _) => ModelHome::Store(shard.clone()),
            (None, Some(folder)) => ModelHome::Folder(folder.clone()),
            (None, None) => ModelHome::None,
        }
    }

    /// Each change written (or readied) to land.
    pub fn write(
        &self,
        changes: &[ModelChange],
        force: bool,
    ) -> Result<Vec<Box<dyn Landing>>, CommitError> {
        match self {
            _ if changes.is_empty() => Ok(Vec::new()),
            ModelHome::Folder(folder) => write_model_changes(folder, changes, force),
            ModelHome::Store(shard) => super::remote::model_landings(shard, changes, force),
            ModelHome::None => Ok(Vec::new()),
        }
    }
}
