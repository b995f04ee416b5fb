//! The lock a commit takes on each file it changes, so that two mounts of
//! one source commit one at a time.

use super::*;
use crate::source::FolderError;

/// How long a commit waits for another commit of the same files.
pub(super) const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The files a commit will replace or rewrite, locked from before its plan
/// until they landed: a second mount's commit of the same source waits, then
/// finds the file changed and refuses (ESTALE) instead of writing over the
/// first commit. The lock is not on the file itself, which any reader may
/// lock to hold commits up, but on a file named for it (device and inode) in
/// a private folder of the user's (`$XDG_RUNTIME_DIR/stfs/locks`, else
/// `$XDG_STATE_HOME/stfs/locks`): mounts of one user take turns; mounts of
/// different users are kept apart by the checks at landing (the swap only
/// over the file that was mapped, the write lease of an in-place commit).
pub struct CommitLock(Vec<File>);

/// A file a commit locks: its folder, its name, and its open descriptor if
/// the mount holds one.
pub type LockTarget = (Arc<Folder>, OsString, Option<Arc<File>>);

impl Drop for CommitLock {
    fn drop(&mut self) {
        for f in &self.0 {
            let _ = rustix::fs::flock(f, rustix::fs::FlockOperation::Unlock);
        }
    }
}

/// The home folder of user `uid` in the password database.
pub(super) fn home_of(uid: u32) -> Option<PathBuf> {
    let mut buf = vec![0 as libc::c_char; 16384];
    loop {
        // No safe wrapper reads the password database through NSS.
        // SAFETY: getpwuid_r fills a zeroed (valid) passwd whose strings
        // point into `buf`, of the length given; pw_dir is read only when the
        // call succeeded and set it, while `buf` is alive.
        let (r, dir) = unsafe {
            let mut pw: libc::passwd = std::mem::zeroed();
            let mut found: *mut libc::passwd = std::ptr::null_mut();
            let r = libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut found);
            let ok = r == 0 && !found.is_null() && !pw.pw_dir.is_null();
            (
                r,
                ok.then(|| std::ffi::CStr::from_ptr(pw.pw_dir).to_bytes().to_vec()),
            )
        };
        if r == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        use std::os::unix::ffi::OsStringExt;
        let dir = PathBuf::from(std::ffi::OsString::from_vec(dir?));
        return dir.is_absolute().then_some(dir);
    }
}

/// A private folder of this user's that outlives a reboot,
/// `~/.local/state/stfs/<parts...>` of the home in the password database,
/// made 0700 (with the folders above it that are missing); refused if it is
/// a link, another user's or open to others.
pub fn private_state_folder(parts: &[&str]) -> Result<Folder, FolderError> {
    let euid = rustix::process::geteuid().as_raw();
    let mut dir = home_of(euid)
        .ok_or_else(|| {
            FolderError::refused(
                std::path::Path::new("~"),
                format!("no home folder for uid {euid}"),
            )
        })?
        .join(".local/state/stfs");
    parts.iter().for_each(|p| dir.push(p));
    private_folder(&dir, euid)
}

/// The private folder of commit locks, made 0700 if missing; refused if it
/// is a link, another user's or open to others. Chosen by the user, not the
/// environment, so that every session of a user (a shell, cron, `sudo -u`)
/// finds the same: `/run/user/UID/stfs/locks` where that folder exists,
/// else `~/.local/state/stfs/locks` of the user's home in the password database.
pub(super) fn lock_folder() -> Result<Folder, FolderError> {
    use std::os::unix::fs::MetadataExt;
    let euid = rustix::process::geteuid().as_raw();
    let run = PathBuf::from(format!("/run/user/{euid}"));
    let base = match std::fs::symlink_metadata(&run) {
        Ok(m) if m.is_dir() && m.uid() == euid && m.mode() & 0o077 == 0 => run,
        _ => home_of(euid)
            .ok_or_else(|| FolderError::refused(&run, format!("no home folder for uid {euid}")))?
            .join(".local/state"),
    };
    let dir = base.join("stfs").join("locks");
    private_folder(&dir, euid)
}

/// `dir`, made 0700 if missing, opened, and refused unless it is a folder
/// of user `euid`'s that no one else may use.
fn private_folder(dir: &std::path::Path, euid: u32) -> Result<Folder, FolderError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(FolderError::io(dir))?;
    let folder = Folder::open_private(dir).map_err(FolderError::io(dir))?;
    let st = folder.stat().map_err(FolderError::io(dir))?;
    if st.uid != euid || st.mode & 0o077 != 0 {
        return Err(FolderError::refused(
            dir,
            "not a private folder of this user's",
        ));
    }
    Ok(folder)
}

impl CommitLock {
    /// `files`: folder, name and, for a source, its open file (whose identity
    /// names the lock when the name is still that file).
    pub fn take(files: &[LockTarget]) -> Result<CommitLock, CommitError> {
        let mut keys = Vec::new();
        for (folder, name, own) in files {
            let path = folder.path.join(name);
            let mine = own.as_ref().and_then(|f| FileStat::of(f).ok());
            let key = match folder.stat_at(name) {
                Ok(st) => (st.dev, st.ino),
                // Gone (the plan says what that means): the file it was.
                Err(_) => match mine {
                    Some(m) => (m.dev, m.ino),
                    None => continue,
                },
            };
            keys.push((key, path));
        }
        keys.sort();
        keys.dedup_by_key(|(key, _)| *key);
        if keys.is_empty() {
            return Ok(CommitLock(Vec::new()));
        }
        let dir = match lock_folder() {
            Ok(dir) => dir,
            Err(e) => {
                warn!("commits are not locked against other mounts of this user's: {e}");
                return Ok(CommitLock(Vec::new()));
            }
        };
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        let mut locked = Vec::new();
        for ((dev, ino), path) in keys {
            let name = OsString::from(format!("{dev}-{ino}.lock"));
            let flags = libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_NONBLOCK;
            let locking = |source| CommitError::Io {
                what: format!(
                    "{}: locking it for the commit, in {}",
                    path.display(),
                    dir.path.display()
                ),
                source,
            };
            let file = dir.open_file(&name, flags, 0o600).map_err(locking)?;
            let exclusive = rustix::fs::FlockOperation::NonBlockingLockExclusive;
            while let Err(e) = rustix::fs::flock(&file, exclusive) {
                if e != rustix::io::Errno::WOULDBLOCK {
                    return Err(locking(e.into()));
                }
                if std::time::Instant::now() > deadline {
                    return Err(CommitError::Busy { file: path });
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            locked.push(file);
        }
        Ok(CommitLock(locked))
    }
}
