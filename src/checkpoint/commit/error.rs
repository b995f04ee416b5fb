//! Why a commit did not happen, or did not land.

use super::*;

/// Something a commit refuses, with the tensor it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", match tensor {
    Some(t) => format!("tensor {t:?} {rule}"),
    None => rule.clone(),
})]
pub struct Problem {
    pub tensor: Option<String>,
    pub rule: String,
}

/// Why a commit did not happen. In every case the source is untouched and
/// the staged edits are kept.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// Edits that would not make a valid checkpoint (EINVAL).
    #[error("{}", refused_text(file, problems))]
    Refused {
        file: PathBuf,
        problems: Vec<Problem>,
    },
    /// The source changed behind the mount (ESTALE); `--force` overrides.
    #[error(
        "{}: the source changed since it was mounted (another program wrote or replaced it); \
         commit refused: commit with --force to overwrite it, or unmount with --discard",
        file.display()
    )]
    Conflict { file: PathBuf },
    /// A remote object changed since it was mounted (ESTALE): `--force` can
    /// not help there, the bytes it would keep are of the version gone.
    #[error(
        "{}: the source changed since it was mounted (another writer replaced the object); \
         commit refused, the edits are staged: unmount with --discard and mount again to edit \
         the new version (--force cannot rebuild the version mounted, whose bytes the commit \
         would copy)",
        file.display()
    )]
    RemoteConflict { file: PathBuf },
    /// An index object of a folder in a store changed since it was mounted (ESTALE).
    #[error(
        "{}: the index changed since it was mounted (another writer replaced it); commit \
         refused, the edits are staged: unmount with --discard and mount again, or commit \
         --force to replace it with the index of this mount's shards",
        file.display()
    )]
    IndexConflict { file: PathBuf },
    /// A shard the commit does not write, but whose tensors the rewritten
    /// index lists as mounted, changed since it was mounted (ESTALE).
    #[error(
        "{}: this shard changed since it was mounted (another writer replaced it), and the \
         index the commit rewrites would list its tensors as they were; commit refused, the \
         edits are staged: unmount with --discard and mount again, or commit --force to write \
         the index anyway",
        file.display()
    )]
    ListedShardChanged { file: PathBuf },
    /// A model file's PUT or DELETE refused by its condition while the
    /// commit lands (ESTALE): another writer's version stands.
    #[error(
        "{}: another writer changed this object since it was mounted (the store refused the \
         commit's request on its condition); their version stands, the commit does not put \
         the mount's over it",
        file.display()
    )]
    ModelFileReplaced { file: PathBuf },
    /// Another commit of the same files did not end in time (EBUSY).
    #[error(
        "{}: another commit of this file (by another mount) has not ended in {} s; try again",
        file.display(),
        LOCK_WAIT.as_secs()
    )]
    Busy { file: PathBuf },
    /// Another program opened the file just as an in-place commit was about
    /// to write it: nothing changed (EAGAIN).
    #[error(
        "{}: another program opened it as the commit was about to write it in place; \
         nothing changed and the edits are staged: commit again",
        file.display()
    )]
    Opened { file: PathBuf },
    /// The mount does not commit any more (EIO): a request handler
    /// panicked, or a commit failed half-way; `why` says which.
    #[error(
        "{why}: commit refused, this mount commits no more. The staged edits are kept on \
         disk: unmount, mount again (the edits are taken back from the journal, an \
         interrupted commit is finished) and review them with stfs status"
    )]
    Tainted { why: String },
    /// Writing the new file failed (ENOSPC, EIO, ...).
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The staging folder (for the journal and the record of renames).
    #[error("{0}")]
    Staging(#[source] StagingError),
    /// The source cannot be written (a remote object of a store stfs does
    /// not commit to) (EROFS).
    #[error(
        "{}: read-only (stfs commits to S3 and S3-compatible stores; HTTP, GCS and Azure \
         sources are read-only)",
        file.display()
    )]
    ReadOnly { file: PathBuf },
    /// A commit asked of a read-only mount (`-o ro`) (EROFS).
    #[error("the mount is read-only (-o ro): it commits nothing")]
    MountReadOnly,
    /// A request of a remote commit failed; the object is as it was, the
    /// upload aborted, the edits staged (EIO; EACCES when refused access).
    #[error("{}: commit failed, the object is unchanged and the edits are staged: {source}", file.display())]
    Remote {
        file: PathBuf,
        source: crate::source::remote::s3::S3Error,
    },
    /// The commit failed after a file of it began to change: `landed` of
    /// its `total` files landed; `file` is refused by every reader until the
    /// next mount completes the commit from its record (the errno of `source`).
    #[error("{}", not_landed_text(file, *landed, *total, *refused, source))]
    NotLanded {
        file: PathBuf,
        landed: usize,
        total: usize,
        /// Whether `file` is left refused by every reader (an in-place
        /// commit that had begun); else it is unchanged.
        refused: bool,
        #[source]
        source: Box<CommitError>,
    },
    /// A discard on a mount whose commit did not land: its staging folder
    /// holds the record the next mount completes (EIO).
    #[error(
        "{why}: discard refused, this mount commits no more, and its staging folder holds \
         the record that completes that commit: unmount it with a plain `umount` and mount \
         the source again with stfs"
    )]
    DiscardRefused { why: String },
    /// A discard ran while this commit waited for it: nothing was committed
    /// (ECANCELED).
    #[error(
        "nothing committed: the staged edits were discarded (stfs umount --discard) while \
         this commit waited for that discard to end"
    )]
    Discarded,
    /// The file a commit wrote would be refused by the mount's own reader
    /// (so by the reference's too), or read as other tensors than planned:
    /// nothing landed, the source is unchanged, the edits staged (EIO).
    #[error(
        "{}: not committed: the new file would be refused by every reader ({error}); the \
         source is unchanged and the edits are staged (this is a bug of stfs's: please report it)",
        file.display()
    )]
    WouldBeRefused { file: PathBuf, error: FormatError },
    /// Every file landed (the mount serves them), but the sync that makes
    /// their names durable failed: a crash could take a rename back. The
    /// record is kept, so the next mount checks each file again (the
    /// errno of `source`).
    #[error(
        "{}: committed, but not made durable ({source}): the record of the commit is kept, and \
         the next mount checks it",
        folder.display()
    )]
    NotDurable {
        folder: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A commit ran while this discard waited for it: the edits it would
    /// have dropped are in the files now (ECANCELED).
    #[error(
        "nothing discarded: a commit that ran while this discard waited for it wrote the \
         staged edits into the files"
    )]
    CommittedFirst,
}

impl crate::errno::ToErrno for CommitError {
    fn to_errno(&self) -> i32 {
        match self {
            CommitError::Refused { .. } => libc::EINVAL,
            CommitError::Conflict { .. }
            | CommitError::RemoteConflict { .. }
            | CommitError::IndexConflict { .. }
            | CommitError::ListedShardChanged { .. }
            | CommitError::ModelFileReplaced { .. } => libc::ESTALE,
            CommitError::Busy { .. } => libc::EBUSY,
            CommitError::Opened { .. } => libc::EAGAIN,
            CommitError::Tainted { .. } | CommitError::DiscardRefused { .. } => libc::EIO,
            CommitError::Io { source, .. } => source.to_errno(),
            CommitError::Staging(e) => e.to_errno(),
            CommitError::ReadOnly { .. } | CommitError::MountReadOnly => libc::EROFS,
            CommitError::Remote { source, .. } => match source {
                crate::source::remote::s3::S3Error::Status { status: 403, .. } => libc::EACCES,
                crate::source::remote::s3::S3Error::Precondition { .. } => libc::ESTALE,
                _ => libc::EIO,
            },
            CommitError::NotLanded { source, .. } => source.to_errno(),
            CommitError::NotDurable { source, .. } => source.to_errno(),
            CommitError::WouldBeRefused { .. } => libc::EIO,
            CommitError::Discarded | CommitError::CommittedFirst => libc::ECANCELED,
        }
    }
}

fn refused_text(file: &std::path::Path, problems: &[Problem]) -> String {
    if let [one] = problems {
        return format!("{}: {one}", file.display());
    }
    let mut text = format!(
        "{}: commit refused, {} problems:",
        file.display(),
        problems.len()
    );
    for p in problems.iter().take(20) {
        text.push_str(&format!("\n  {p}"));
    }
    if problems.len() > 20 {
        let more = problems.len() - 20;
        text.push_str(&format!(
            "\n  ... and {more} more (stfs status lists them all)"
        ));
    }
    text
}

fn not_landed_text(
    file: &std::path::Path,
    landed: usize,
    total: usize,
    refused: bool,
    source: &CommitError,
) -> String {
    let state = match refused {
        true => "Every reader refuses this file until the commit is completed",
        false => "This file is unchanged, the files that landed before it are written",
    };
    format!(
        "{}: the commit did not land ({landed} of its {total} files landed): {source}. {state}\
         ; the record and the staged edits are kept on disk, and this mount commits no more: \
         unmount it with a plain `umount` and mount the source again with stfs (after making \
         room, if the disk was full), which completes the commit",
        file.display()
    )
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
