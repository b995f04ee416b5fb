//! The errno a shell user expects for each error. Every error type says its
//! own, beside its definition (`impl ToErrno`); the FUSE adapter asks once per
//! failed request and logs the error with its cause chain.

pub trait ToErrno {
    fn to_errno(&self) -> i32;
}

impl ToErrno for std::io::Error {
    /// The kernel's errno where there is one; EIO for errors made in process
    /// (a short read, a checksum that does not match).
    fn to_errno(&self) -> i32 {
        self.raw_os_error().unwrap_or(libc::EIO)
    }
}

/// A failure told to a person at the process's edge (a command, or the
/// mount before it serves): what went wrong, where, and what to do. The
/// layers below have their own typed errors; this is what they become once
/// nothing but a person acts on them (EINVAL: a request that cannot be
/// done as asked, or the errno of the I/O error it came from).
#[derive(Debug, thiserror::Error)]
#[error("{why}")]
pub struct Failure {
    pub why: String,
    pub errno: i32,
}

impl From<String> for Failure {
    fn from(why: String) -> Failure {
        Failure {
            why,
            errno: libc::EINVAL,
        }
    }
}

impl From<&str> for Failure {
    fn from(why: &str) -> Failure {
        Failure::from(why.to_string())
    }
}

impl Failure {
    /// The failure of a typed error, said with its causes.
    pub fn of(e: &(impl std::error::Error + ToErrno)) -> Failure {
        Failure {
            why: with_causes(e),
            errno: e.to_errno(),
        }
    }
}

impl ToErrno for Failure {
    fn to_errno(&self) -> i32 {
        self.errno
    }
}

/// `impl From<$t> for Failure` (through `Failure::of`), written beside each
/// error type that becomes one, so that this module names none of them.
#[macro_export]
macro_rules! failure_from {
    ($($t:ty),*) => {$(
        impl From<$t> for $crate::errno::Failure {
            fn from(e: $t) -> $crate::errno::Failure {
                $crate::errno::Failure::of(&e)
            }
        }
    )*};
}

failure_from!(std::io::Error);

/// An error and the causes under it ("error sending request" says little;
/// "operation timed out" or "connection refused" under it says what happened).
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let said = c.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::ToErrno;
    use crate::checkpoint::in_place::BadRecord;
    use crate::checkpoint::journal::JournalError;
    use crate::checkpoint::meta::MetaError;
    use crate::checkpoint::recovery_error::RecoveryError;
    use crate::client::ClientError;
    use crate::format::{FormatError, InFile};
    use crate::prefetch::load::LoadError;
    use crate::source::FolderError;
    use crate::source::remote::RemoteError;

    /// Each error type says the errno a shell user expects, nested ones
    /// their cause's.
    #[test]
    fn every_error_type_says_its_errno() {
        let io = |n| std::io::Error::from_raw_os_error(n);
        let bad_format = || FormatError::TooShort { file_len: 3 };
        let cases: Vec<(Box<dyn ToErrno>, i32)> = vec![
            (Box::new(bad_format()), libc::EINVAL),
            (
                Box::new(InFile {
                    path: "f".into(),
                    error: bad_format(),
                }),
                libc::EINVAL,
            ),
            (Box::new(MetaError::NoDtype), libc::EINVAL),
            (Box::new(JournalError::Empty), libc::EIO),
            (Box::new(BadRecord("x".into())), libc::EIO),
            (
                Box::new(FolderError::Io {
                    path: "d".into(),
                    source: io(libc::ENOTDIR),
                }),
                libc::ENOTDIR,
            ),
            (
                Box::new(FolderError::Refused {
                    path: "d".into(),
                    why: "a link".into(),
                }),
                libc::EACCES,
            ),
            (
                Box::new(RecoveryError::In {
                    dir: "d".into(),
                    source: Box::new(RecoveryError::io("r")(io(libc::ENOSPC))),
                }),
                libc::ENOSPC,
            ),
            (Box::new(RemoteError::Request("x".into())), libc::EIO),
            (
                Box::new(ClientError::Refused {
                    errno: libc::ESTALE,
                    message: "x".into(),
                }),
                libc::ESTALE,
            ),
            (Box::new(ClientError::Dead("m".into())), libc::ENOTCONN),
            (Box::new(LoadError::NoDevice("x".into())), libc::ENODEV),
            (Box::new(LoadError::OutOfMemory("x".into())), libc::ENOMEM),
            (Box::new(LoadError::Cancelled), libc::ECANCELED),
            (Box::new(LoadError::NoSuchTensor("x".into())), libc::ENOENT),
            (
                Box::new(LoadError::Read {
                    tensor: "t".into(),
                    at: 0,
                    source: io(libc::EIO),
                }),
                libc::EIO,
            ),
            (
                Box::new(LoadError::Failed(libc::ENOSPC, "x".into())),
                libc::ENOSPC,
            ),
        ];
        for (k, (e, want)) in cases.into_iter().enumerate() {
            assert_eq!(e.to_errno(), want, "case {k}");
        }
    }
}
