//! Where stfs keeps files, whatever the source: a folder opened by descriptor (`Folder`): the one way stfs creates,
//! renames and removes files in a user's folder, without following a link
//! in a path; and a file's identity and version (`FileStat`).

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::testpoint::FsEvent;

/// What `stat` said of a file: identity, size, times, owner and mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileStat {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    pub mtime: (i64, i64),
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl FileStat {
    pub fn of(file: &File) -> std::io::Result<FileStat> {
        Ok(FileStat::from(&rustix::fs::fstat(file)?))
    }

    /// What stands for something remote: `mode`, owned by the user who
    /// mounts, no identity, size or time until the caller gives them.
    pub fn of_mounting_user(mode: u32) -> FileStat {
        FileStat {
            dev: 0,
            ino: 0,
            len: 0,
            mtime: (0, 0),
            mode,
            uid: rustix::process::getuid().as_raw(),
            gid: rustix::process::getgid().as_raw(),
        }
    }

    /// The file type bits of `mode` are a regular file's.
    pub fn is_file(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }

    /// Same file, same length, same modification time: the bytes stfs validated.
    pub fn same_version(&self, other: &FileStat) -> bool {
        (self.dev, self.ino, self.len, self.mtime) == (other.dev, other.ino, other.len, other.mtime)
    }

    pub fn modified(&self) -> SystemTime {
        let (s, ns) = self.mtime;
        if s >= 0 {
            SystemTime::UNIX_EPOCH + std::time::Duration::new(s as u64, ns as u32)
        } else {
            SystemTime::UNIX_EPOCH
        }
    }
}

impl From<&rustix::fs::Stat> for FileStat {
    fn from(st: &rustix::fs::Stat) -> FileStat {
        FileStat {
            dev: st.st_dev,
            ino: st.st_ino,
            len: st.st_size as u64,
            mtime: (st.st_mtime, st.st_mtime_nsec as i64),
            mode: st.st_mode,
            uid: st.st_uid,
            gid: st.st_gid,
        }
    }
}

/// Why a folder could not be used (a private folder of this user's: the
/// cache, the commit locks).
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Not safe to use: a link, another user's, open to others...
    #[error("{}: {why}", path.display())]
    Refused { path: PathBuf, why: String },
}

crate::failure_from!(FolderError);

impl crate::errno::ToErrno for FolderError {
    /// The kernel's errno; a folder refused as unsafe is EACCES.
    fn to_errno(&self) -> i32 {
        match self {
            FolderError::Io { source, .. } => source.to_errno(),
            FolderError::Refused { .. } => libc::EACCES,
        }
    }
}

impl FolderError {
    pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FolderError + '_ {
        move |source| FolderError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub fn refused(path: &Path, why: impl Into<String>) -> FolderError {
        FolderError::Refused {
            path: path.to_path_buf(),
            why: why.into(),
        }
    }
}

/// A folder, opened: files in it are opened, created and renamed relative to
/// this descriptor, so a rename of a path component cannot redirect them.
pub struct Folder {
    pub path: PathBuf,
    pub fd: OwnedFd,
}

impl Folder {
    pub fn open(path: &Path) -> std::io::Result<Folder> {
        Folder::open_with(path, 0)
    }

    /// Opens a folder that must not be a symbolic link (a private folder of
    /// this user's, checked by the caller through `stat`).
    pub fn open_private(path: &Path) -> std::io::Result<Folder> {
        Folder::open_with(path, libc::O_NOFOLLOW)
    }

    pub(super) fn open_with(path: &Path, flags: i32) -> std::io::Result<Folder> {
        let flags = oflags(libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | flags);
        let fd = rustix::fs::open(path, flags, rustix::fs::Mode::empty())?;
        Ok(Folder {
            path: path.to_path_buf(),
            fd,
        })
    }

    /// Another descriptor of the same folder.
    pub fn try_clone(&self) -> std::io::Result<Folder> {
        Ok(Folder {
            path: self.path.clone(),
            fd: self.fd.try_clone()?,
        })
    }

    /// The folder's own owner and mode.
    pub fn stat(&self) -> std::io::Result<FileStat> {
        let file = File::from(self.fd.try_clone()?);
        FileStat::of(&file)
    }

    pub fn chmod(&self, mode: u32) -> std::io::Result<()> {
        Ok(rustix::fs::fchmod(
            &self.fd,
            rustix::fs::Mode::from_raw_mode(mode),
        )?)
    }

    /// The names in this folder (not "." and ".."), read through its descriptor.
    pub fn entries(&self) -> Vec<OsString> {
        let Ok(dir) = rustix::fs::Dir::read_from(&self.fd) else {
            return Vec::new();
        };
        dir.map_while(Result::ok)
            .map(|entry| OsStr::from_bytes(entry.file_name().to_bytes()).to_os_string())
            .filter(|name| name != "." && name != "..")
            .collect()
    }

    /// Opens `name` in this folder without following a symbolic link there.
    pub fn open_file(&self, name: &OsStr, flags: i32, mode: u32) -> std::io::Result<File> {
        let creates = flags & libc::O_CREAT != 0
            && crate::testpoint::fs_hooked()
            && self.stat_at(name).is_err();
        crate::testpoint::io(if flags & libc::O_CREAT != 0 {
            "create"
        } else {
            "open"
        })?;
        let flags = oflags(flags | libc::O_NOFOLLOW | libc::O_CLOEXEC);
        let mode = rustix::fs::Mode::from_raw_mode(mode);
        let fd = rustix::fs::openat(&self.fd, name, flags, mode)?;
        if creates {
            crate::testpoint::fs_event(FsEvent::Created {
                folder: &self.path,
                name,
            });
        }
        Ok(File::from(fd))
    }

    pub fn rename(&self, from: &OsStr, to: &OsStr) -> std::io::Result<()> {
        crate::testpoint::io("rename")?;
        crate::testpoint::fs_event(FsEvent::Renaming {
            folder: &self.path,
            from,
            to,
        });
        Ok(rustix::fs::renameat(&self.fd, from, &self.fd, to)?)
    }

    /// Renames, failing with EEXIST if `to` exists (renameat2 RENAME_NOREPLACE).
    pub fn rename_noreplace(&self, from: &OsStr, to: &OsStr) -> std::io::Result<()> {
        crate::testpoint::io("rename")?;
        if crate::testpoint::fs_hooked() && self.stat_at(to).is_err() {
            crate::testpoint::fs_event(FsEvent::Renaming {
                folder: &self.path,
                from,
                to,
            });
        }
        let flags = rustix::fs::RenameFlags::NOREPLACE;
        Ok(rustix::fs::renameat_with(
            &self.fd, from, &self.fd, to, flags,
        )?)
    }

    /// Swaps two names atomically (renameat2 RENAME_EXCHANGE).
    pub fn exchange(&self, a: &OsStr, b: &OsStr) -> std::io::Result<()> {
        crate::testpoint::io("exchange")?;
        crate::testpoint::fs_event(FsEvent::Exchanging {
            folder: &self.path,
            a,
            b,
        });
        let flags = rustix::fs::RenameFlags::EXCHANGE;
        Ok(rustix::fs::renameat_with(&self.fd, a, &self.fd, b, flags)?)
    }

    /// Removes a file (never a folder, never through a link: unlinkat removes the name only).
    pub fn unlink(&self, name: &OsStr) -> std::io::Result<()> {
        crate::testpoint::io("unlink")?;
        crate::testpoint::fs_event(FsEvent::Unlinking {
            folder: &self.path,
            name,
        });
        let flags = rustix::fs::AtFlags::empty();
        Ok(rustix::fs::unlinkat(&self.fd, name, flags)?)
    }

    /// Removes a file no longer needed (a temp file, a spent staging file):
    /// a failure leaves it there, which costs room, never data; logged.
    pub fn unlink_spent(&self, name: &OsStr) {
        let removed = crate::testpoint::io_best_effort("unlink").and_then(|()| {
            crate::testpoint::fs_event(FsEvent::Unlinking {
                folder: &self.path,
                name,
            });
            Ok(rustix::fs::unlinkat(
                &self.fd,
                name,
                rustix::fs::AtFlags::empty(),
            )?)
        });
        if let Err(e) = removed {
            if e.raw_os_error() != Some(libc::ENOENT) {
                tracing::debug!(file = %self.path.join(name).display(), "not removed: {e}");
            }
        }
    }

    /// Whether this process may create files in the folder (its effective
    /// ids, as the kernel will judge a create).
    pub fn writable(&self) -> bool {
        rustix::fs::accessat(
            &self.fd,
            ".",
            rustix::fs::Access::WRITE_OK,
            rustix::fs::AtFlags::EACCESS,
        )
        .is_ok()
    }

    /// lstat of a name in this folder.
    pub fn stat_at(&self, name: &OsStr) -> std::io::Result<FileStat> {
        let flags = rustix::fs::AtFlags::SYMLINK_NOFOLLOW;
        Ok(FileStat::from(&rustix::fs::statat(&self.fd, name, flags)?))
    }

    /// stat of a name in this folder, through a link (a snapshot's file).
    pub fn stat_through(&self, name: &OsStr) -> std::io::Result<FileStat> {
        let flags = rustix::fs::AtFlags::empty();
        Ok(FileStat::from(&rustix::fs::statat(&self.fd, name, flags)?))
    }

    pub fn sync(&self) -> std::io::Result<()> {
        crate::testpoint::io("sync-folder")?;
        rustix::fs::fsync(&self.fd)?;
        crate::testpoint::fs_event(FsEvent::SyncedFolder { folder: &self.path });
        Ok(())
    }
}

/// open(2) flags as rustix takes them (the bits are the kernel's).
pub fn oflags(flags: i32) -> rustix::fs::OFlags {
    rustix::fs::OFlags::from_bits_retain(flags as u32)
}

pub fn cstr(s: &OsStr) -> std::io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}
