//! Why a commit did not happen, or did not land.

use super::*;

/// Something a commit refuses, with the tensor it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub tensor: Option<String>,
    pub rule: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tensor {
            Some(t) => write!(f, "tensor {t:?} {}", self.rule),
            None => f.write_str(&self.rule),
        }
    }
}

/// Why a commit did not happen. In every case the source is untouched and
/// the staged edits are kept.
#[derive(Debug)]
pub enum CommitError {
    /// Edits that would not make a valid checkpoint (EINVAL).
    Refused {
        file: PathBuf,
        problems: Vec<Problem>,
    },
    /// The source changed behind the mount (ESTALE); `--force` overrides.
    Conflict { file: PathBuf },
    /// Another commit of the same files did not end in time (EBUSY).
    Busy { file: PathBuf },
    /// Another program opened the file just as an in-place commit was about
    /// to write it: nothing changed (EAGAIN).
    Opened { file: PathBuf },
    /// The mount does not commit any more (EIO): a request handler
    /// panicked, or a commit failed half-way; `why` says which.
    Tainted { why: String },
    /// Writing the new file failed (ENOSPC, EIO, ...).
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The staging folder (for the journal and the record of renames).
    Staging(StagingError),
    /// The source cannot be written (a remote object) (EROFS).
    ReadOnly { file: PathBuf },
    /// The commit failed after a file of it began to change: `landed` of
    /// its `total` files landed; `file` is refused by every reader until the
    /// next mount completes the commit from its record (the errno of `source`).
    NotLanded {
        file: PathBuf,
        landed: usize,
        total: usize,
        /// Whether `file` is left refused by every reader (an in-place
        /// commit that had begun); else it is unchanged.
        refused: bool,
        source: Box<CommitError>,
    },
    /// A discard on a mount whose commit did not land: its staging folder
    /// holds the record the next mount completes (EIO).
    DiscardRefused { why: String },
    /// A discard ran while this commit waited for it: nothing was committed
    /// (ECANCELED).
    Discarded,
    /// A commit ran while this discard waited for it: the edits it would
    /// have dropped are in the files now (ECANCELED).
    CommittedFirst,
}

impl fmt::Display for CommitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommitError::Refused { file, problems } => {
                if let [one] = &problems[..] {
                    return write!(f, "{}: {one}", file.display());
                }
                write!(
                    f,
                    "{}: commit refused, {} problems:",
                    file.display(),
                    problems.len()
                )?;
                for p in problems.iter().take(20) {
                    write!(f, "\n  {p}")?;
                }
                if problems.len() > 20 {
                    write!(f, "\n  ... and {} more (stfs status lists them all)", problems.len() - 20)?;
                }
                Ok(())
            }
            CommitError::Conflict { file } => write!(
                f,
                "{}: the source changed since it was mounted (another program wrote or replaced it); \
                 commit refused: commit with --force to overwrite it, or unmount with --discard",
                file.display()
            ),
            CommitError::Busy { file } => write!(
                f,
                "{}: another commit of this file (by another mount) has not ended in {} s; try again",
                file.display(),
                LOCK_WAIT.as_secs()
            ),
            CommitError::Opened { file } => write!(
                f,
                "{}: another program opened it as the commit was about to write it in place; \
                 nothing changed and the edits are staged: commit again",
                file.display()
            ),
            CommitError::Tainted { why } => write!(
                f,
                "{why}: commit refused, this mount commits no more. The staged edits are kept on \
                 disk: unmount, mount again (the edits are taken back from the journal, an \
                 interrupted commit is finished) and review them with stfs status"
            ),
            CommitError::DiscardRefused { why } => write!(
                f,
                "{why}: discard refused, this mount commits no more, and its staging folder holds \
                 the record that completes that commit: unmount it with a plain `umount` and mount \
                 the source again with stfs"
            ),
            CommitError::Io { what, source } => write!(f, "{what}: {source}"),
            CommitError::Staging(e) => write!(f, "{e}"),
            CommitError::ReadOnly { file } => write!(
                f,
                "{}: a remote source is read-only (stfs does not write to object stores yet)",
                file.display()
            ),
            CommitError::NotLanded {
                file,
                landed,
                total,
                refused,
                source,
            } => {
                write!(
                    f,
                    "{}: the commit did not land ({landed} of its {total} files landed): {source}. ",
                    file.display()
                )?;
                f.write_str(match refused {
                    true => "Every reader refuses this file until the commit is completed",
                    false => "This file is unchanged, the files that landed before it are written",
                })?;
                f.write_str(
                    "; the record and the staged edits are kept on disk, and this mount commits \
                     no more: unmount it with a plain `umount` and mount the source again with \
                     stfs (after making room, if the disk was full), which completes the commit",
                )
            }
            CommitError::Discarded => f.write_str(
                "nothing committed: the staged edits were discarded (stfs umount --discard) while \
                 this commit waited for that discard to end",
            ),
            CommitError::CommittedFirst => f.write_str(
                "nothing discarded: a commit that ran while this discard waited for it wrote the \
                 staged edits into the files",
            ),
        }
    }
}

impl std::error::Error for CommitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CommitError::Io { source, .. } => Some(source),
            CommitError::Staging(e) => Some(e),
            CommitError::NotLanded { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<crate::checkpoint::EditError> for CommitError {
    fn from(e: crate::checkpoint::EditError) -> Self {
        match e {
            crate::checkpoint::EditError::Staging(e) => CommitError::Staging(e),
            crate::checkpoint::EditError::Io(source) => CommitError::Io {
                what: "the journal".into(),
                source,
            },
            other => CommitError::Io {
                what: "the journal".into(),
                source: std::io::Error::other(other.to_string()),
            },
        }
    }
}

pub(super) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CommitError {
    let what = what.into();
    move |source| CommitError::Io { what, source }
}
