//! Why what an earlier mount left cannot be used: below recovery, the
//! in-place way's records and the staging folder, which all report it.

use super::journal;

/// Why kept edits cannot be taken back, or the record of an interrupted
/// commit used; what is kept stays on disk.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    /// Reading or completing a kept file failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Journal {
        what: String,
        #[source]
        source: journal::JournalError,
    },
    /// What is kept does not apply here, and why.
    #[error("{0}")]
    Refused(String),
    /// An error within staging folder `dir`.
    #[error("{}: {source}", dir.display())]
    In {
        dir: std::path::PathBuf,
        #[source]
        source: Box<RecoveryError>,
    },
}

crate::failure_from!(RecoveryError);

impl crate::errno::ToErrno for RecoveryError {
    fn to_errno(&self) -> i32 {
        match self {
            RecoveryError::Io { source, .. } => source.to_errno(),
            RecoveryError::Journal { source, .. } => source.to_errno(),
            RecoveryError::Refused(_) => libc::EIO,
            RecoveryError::In { source, .. } => source.to_errno(),
        }
    }
}

impl RecoveryError {
    pub fn io(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> RecoveryError {
        let what = what.to_string();
        move |source| RecoveryError::Io { what, source }
    }
}
