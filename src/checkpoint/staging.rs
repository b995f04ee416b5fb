//! The staging folder of a mount, made on the first edit; finding the folders
//! that earlier mounts of the same source left with edits in them; and the
//! record of a commit's renames (`commit.json`) that lets the next mount
//! finish a commit of several shards that a crash interrupted.

use super::in_place::BadRecord;
use super::recovery_error::RecoveryError;
use crate::sync::LockAnyway;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::source::Folder;
use crate::source::staged::StagingError;
use crate::source::{FileStat, StagingDir};

/// Where a mount's staging folder goes, and the folder once made.
pub struct Staging {
    base: Arc<Folder>,
    stem: String,
    dir: Mutex<Option<Arc<StagingDir>>>,
}

impl Staging {
    /// Staging folders will be `.<stem>.stfs-XXXXXX` in `base`.
    pub fn new(base: Arc<Folder>, stem: impl Into<String>) -> Staging {
        Staging {
            base,
            stem: stem.into(),
            dir: Mutex::new(None),
        }
    }

    /// Takes over a folder an earlier mount left (see `kept`).
    pub fn adopt(&self, dir: Arc<StagingDir>) {
        *self.dir.lock_anyway() = Some(dir);
    }

    /// The folder, made now if this is the first edit.
    pub fn dir(&self) -> Result<Arc<StagingDir>, StagingError> {
        let mut dir = self.dir.lock_anyway();
        if let Some(d) = &*dir {
            return Ok(d.clone());
        }
        let made = Arc::new(StagingDir::create(self.base.clone(), &self.stem)?);
        info!(dir = %made.path().display(), "staging folder made");
        *dir = Some(made.clone());
        Ok(made)
    }

    /// The folder, if it was made.
    pub fn current(&self) -> Option<Arc<StagingDir>> {
        self.dir.lock_anyway().clone()
    }

    pub fn base(&self) -> &Arc<Folder> {
        &self.base
    }

    pub fn stem(&self) -> &str {
        &self.stem
    }

    /// Removes the folder (after a commit or a discard left nothing in it).
    pub fn remove(&self) {
        if let Some(d) = self.dir.lock_anyway().take() {
            match d.remove() {
                Ok(()) => info!(dir = %d.path().display(), "staging folder removed"),
                Err(e) => warn!(dir = %d.path().display(), "removing the staging folder: {e}"),
            }
        }
    }
}

/// The staging folders of `stem` in `base` that no live daemon holds, each
/// checked (a real folder, ours, closed to others). Others are reported.
pub fn kept(base: &Arc<Folder>, stem: &str) -> (Vec<Arc<StagingDir>>, Vec<String>) {
    let mut found = Vec::new();
    let mut notes = Vec::new();
    for name in StagingDir::candidates(base, stem) {
        match StagingDir::adopt(base.clone(), &name) {
            Ok(d) => found.push(Arc::new(d)),
            Err(StagingError::Busy { .. }) => {}
            Err(e) => notes.push(format!("ignored: {e}")),
        }
    }
    (found, notes)
}

/// The renames of a commit of several files, written before the first of
/// them: a crash between two renames is finished by the next mount.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Renames {
    pub commit: u64,
    pub files: Vec<PendingRename>,
    /// Files written in place: their redo records (done before the renames).
    #[serde(default)]
    pub in_place: Vec<super::in_place::InPlaceRecord>,
    /// Objects of a remote store (shards, then indexes): the next mount
    /// completes them if one had landed, so that a folder is never left
    /// half committed (`commit::remote::finish_interrupted`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remote: Vec<RemoteLanding>,
    /// Files of a model folder the commit removes (after the renames).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removes: Vec<PendingRemove>,
}

/// A file of a model folder that a commit removes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PendingRemove {
    pub folder: PathBuf,
    pub target: String,
    /// The file it must still be to be removed (None: `--force`).
    pub expected: Option<FileStat>,
}

/// Removes `name` from `folder` if it is still `expected` (by identity,
/// size and time; None: whatever it is). Ok(false): another file is there
/// now, left as it is. A name already gone is done.
pub fn remove_if(
    folder: &Folder,
    name: &OsStr,
    expected: Option<FileStat>,
) -> std::io::Result<bool> {
    let now = match folder.stat_at(name) {
        Ok(now) => now,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(true),
        Err(e) => return Err(e),
    };
    let same =
        |e: &FileStat| (now.dev, now.ino, now.len, now.mtime) == (e.dev, e.ino, e.len, e.mtime);
    if !expected.as_ref().is_none_or(same) {
        return Ok(false);
    }
    folder.unlink(name)?;
    Ok(true)
}

/// An object of a remote commit, as recorded before the first completes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RemoteLanding {
    pub url: String,
    pub key: String,
    /// The ETag the key must still have to be replaced (None: `--force`).
    pub if_match: Option<String>,
    /// The ETag the key has once this object landed.
    pub expected: Option<String>,
    /// A multipart upload to complete: its id, and its parts (number, ETag).
    #[serde(default)]
    pub upload: Option<String>,
    #[serde(default)]
    pub parts: Vec<(u32, String)>,
    /// An object put whole that the next mount can put again (an index): its text.
    #[serde(default)]
    pub text: Option<String>,
    /// A model file put whole: the file of the staging folder that holds
    /// its bytes until the record goes (`BODY_PREFIX`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// A new key: put only where nothing is (`if_match` is None).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fresh: bool,
    /// A model file the commit removes (`if_match`: the version removed).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub remove: bool,
    /// An object put whole: the headers of the one it replaces, which it keeps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<(String, String)>,
    /// A shard's object (its body, if put whole, kept as a model file's is).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shard: bool,
}

/// The files of a staging folder that hold the bytes of an object put whole
/// (a model file, a shard under the upload size) for the record (removed
/// with it).
pub const BODY_PREFIX: &str = "body-";

impl RemoteLanding {
    /// A shard's object (an upload, or a shard put whole: its body kept,
    /// or in a record of an older stfs, not), not an index or a model file
    /// that waits for the shards.
    pub fn is_shard(&self) -> bool {
        self.shard || (self.text.is_none() && self.body.is_none() && !self.remove)
    }

    /// Whether the key is as this object leaves it (`now`: its ETag now).
    pub fn landed(&self, now: &Option<String>) -> bool {
        match self.remove {
            true => now.is_none(),
            false => self.expected.is_some() && *now == self.expected,
        }
    }

    /// Whether the key is still as the commit found it (`now`: its ETag now).
    pub fn over_old(&self, now: &Option<String>) -> bool {
        match self.fresh {
            true => now.is_none(),
            false => self.if_match.is_none() || *now == self.if_match,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PendingRename {
    /// The folder of both (a shard that is a link is committed in its
    /// target's folder, which need not be the mounted one).
    pub folder: PathBuf,
    /// The temp file's name, beside the target.
    pub tmp: String,
    pub target: String,
    /// The temp file as written.
    pub stat: FileStat,
    /// The file the target must still be to be replaced (the source as
    /// mapped; None: an index, or `--force`): a program that replaced it
    /// since keeps its file.
    #[serde(default)]
    pub replaces: Option<FileStat>,
}

pub const RENAMES: &str = "commit.json";

/// The last line of a record: a SHA-256 of everything before it.
const SEAL: &[u8] = b"\nsha256:";

impl Renames {
    /// The record as written: its JSON, then its seal.
    pub fn sealed(&self) -> Vec<u8> {
        let mut text = serde_json::to_vec_pretty(self).expect("serializes");
        let sum = super::in_place::sha256_hex(&[&text]);
        text.extend_from_slice(SEAL);
        text.extend_from_slice(sum.as_bytes());
        text.push(b'\n');
        text
    }

    /// A record from what `sealed` wrote: any byte changed since, or the
    /// file cut short, is refused.
    pub fn unsealed(text: &[u8]) -> Result<Renames, BadRecord> {
        let bad = |why: &str| BadRecord(why.to_string());
        let at = text
            .windows(SEAL.len())
            .rposition(|w| w == SEAL)
            .ok_or_else(|| bad("it has no seal"))?;
        let (body, seal) = (&text[..at], &text[at + SEAL.len()..]);
        let sum = super::in_place::sha256_hex(&[body]);
        if seal != [sum.as_bytes(), b"\n"].concat() {
            return Err(bad(
                "its seal does not match: changed or cut short since it was written",
            ));
        }
        serde_json::from_slice(body).map_err(|e| bad(&e.to_string()))
    }

    pub fn write(&self, dir: &StagingDir) -> std::io::Result<()> {
        dir.write_atomic(RENAMES, &self.sealed())
    }

    /// The record in `dir`: None if there is none, an error saying why if
    /// it cannot be read (cut short, not JSON, not this record).
    pub fn read(dir: &StagingDir) -> Result<Option<Renames>, RecoveryError> {
        let path = dir.path().join(RENAMES);
        let folder = dir
            .folder()
            .map_err(RecoveryError::io(dir.path().display()))?;
        let f = match folder.open_file(OsStr::new(RENAMES), libc::O_RDONLY | libc::O_NOFOLLOW, 0) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            Err(e) => return Err(RecoveryError::io(path.display())(e)),
        };
        let mut text = Vec::new();
        crate::testpoint::io("read")
            .and_then(|()| std::io::Read::read_to_end(&mut &f, &mut text))
            .map_err(RecoveryError::io(path.display()))?;
        Renames::unsealed(&text).map(Some).map_err(|why| {
            RecoveryError::Refused(format!(
                "{}: not a record stfs wrote ({why})",
                path.display()
            ))
        })
    }

    /// Forgets the record (and the headers of its in-place files).
    /// (A record left behind names files landed or never begun: the next
    /// mount finishes it again, changing nothing.)
    pub fn clear(dir: &StagingDir) {
        let _passed_over = crate::testpoint::best_effort();
        if let Ok(folder) = dir.folder() {
            // (Its headers only once it is gone: a record left must find them.)
            match folder.unlink(OsStr::new(RENAMES)) {
                Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
                    warn!(dir = %dir.path().display(), "removing the record of a commit: {e}");
                    return;
                }
                _ => {}
            }
            for name in dir.list().unwrap_or_default() {
                let bytes = name.as_bytes();
                if bytes.starts_with(b"in-place-") || bytes.starts_with(BODY_PREFIX.as_bytes()) {
                    folder.unlink_spent(&name);
                }
            }
            let _ = folder.sync();
        }
    }

    /// Completes the in-place commits of the record (`dir` holds it). Returns
    /// notes, and whether the record must stay (a file still refused by
    /// every reader that could not be completed now).
    /// An I/O error stops it (the record is kept, the mount fails).
    pub fn complete_in_place(
        &self,
        dir: &StagingDir,
    ) -> Result<(Vec<String>, bool), RecoveryError> {
        let mut notes = Vec::new();
        let mut keep = false;
        let folder = dir
            .folder()
            .map_err(RecoveryError::io(dir.path().display()))?;
        for r in &self.in_place {
            match r.complete(&folder) {
                Ok(Some(note)) => notes.push(note),
                Ok(None) => {}
                Err((why @ RecoveryError::Io { .. }, _)) => return Err(why),
                Err((why, marked)) => {
                    warn!("{why}");
                    notes.push(why.to_string());
                    keep |= marked;
                }
            }
        }
        Ok((notes, keep))
    }

    /// Finishes the renames still to do: a temp file is renamed only if it
    /// is still the file the commit wrote; then the removals. Returns the
    /// targets renamed or (true) removed; an I/O error stops it (the record
    /// stays for the next mount).
    pub fn finish(&self) -> Result<Vec<(PathBuf, bool)>, RecoveryError> {
        let mut done = Vec::new();
        for r in &self.files {
            if !plain(&r.tmp) || !plain(&r.target) || !r.folder.is_absolute() {
                warn!(
                    file = r.tmp,
                    "not a plain name in a record of renames: left alone"
                );
                continue;
            }
            let io = finishing(&r.folder, &r.target);
            let folder = Folder::open(&r.folder).map_err(&io)?;
            let Ok(st) = folder.stat_at(OsStr::new(&r.tmp)) else {
                continue; // renamed already
            };
            let is = |t: &FileStat, f: &FileStat, mtime: bool| {
                (t.dev, t.ino, t.len) == (f.dev, f.ino, f.len) && (!mtime || t.mtime == f.mtime)
            };
            // (Length and time too: an inode number is given again once freed.)
            let target_is_mapped = |folder: &Folder| {
                r.replaces.is_none_or(|expected| {
                    folder
                        .stat_at(OsStr::new(&r.target))
                        .is_ok_and(|t| is(&t, &expected, true))
                })
            };
            if !is(&st, &r.stat, false) {
                // The swap was done: the target is the new file, and the temp
                // name holds what the target was. If that is not the file the
                // commit mapped (another program's, which the swap back would
                // have given back), it is given back now.
                let landed = folder
                    .stat_at(OsStr::new(&r.target))
                    .is_ok_and(|t| is(&t, &r.stat, false));
                let theirs = r.replaces.is_some_and(|expected| !is(&st, &expected, true));
                if landed && theirs {
                    folder
                        .exchange(OsStr::new(&r.tmp), OsStr::new(&r.target))
                        .and_then(|()| folder.sync())
                        .map_err(&io)?;
                    keep_aside(&folder, r).map_err(&io)?;
                } else {
                    warn!(
                        file = r.tmp,
                        "not the file the interrupted commit wrote: left alone"
                    );
                }
                continue;
            }
            if !target_is_mapped(&folder) {
                keep_aside(&folder, r).map_err(&io)?;
                continue;
            }
            folder
                .rename(OsStr::new(&r.tmp), OsStr::new(&r.target))
                .and_then(|()| folder.sync())
                .map_err(&io)?;
            done.push((folder.path.join(&r.target), false))
        }
        self.finish_removes(&mut done)?;
        Ok(done)
    }

    /// Finishes the removals of the record (after its renames): a file goes
    /// only if it is still the one the commit saw there.
    fn finish_removes(&self, done: &mut Vec<(PathBuf, bool)>) -> Result<(), RecoveryError> {
        for r in &self.removes {
            if !plain(&r.target) || !r.folder.is_absolute() {
                warn!(
                    file = r.target,
                    "not a plain name in a record of removals: left alone"
                );
                continue;
            }
            let io = finishing(&r.folder, &r.target);
            let folder = Folder::open(&r.folder).map_err(&io)?;
            let name = OsStr::new(&r.target);
            let there = folder.stat_at(name).is_ok();
            match remove_if(&folder, name, r.expected).map_err(&io)? {
                true if there => {
                    folder.sync().map_err(&io)?;
                    done.push((folder.path.join(&r.target), true));
                }
                true => {}
                false => warn!(
                    file = r.target,
                    "changed by another program since the interrupted commit: left as it is"
                ),
            }
        }
        Ok(())
    }
}

/// A file name of a record: one name in its folder.
fn plain(n: &str) -> bool {
    !n.is_empty() && n != "." && n != ".." && !n.contains('/')
}

/// The error of finishing an interrupted commit's `target` in `folder`.
fn finishing<'a>(
    folder: &'a std::path::Path,
    target: &'a str,
) -> impl Fn(std::io::Error) -> RecoveryError + 'a {
    move |source| RecoveryError::Io {
        what: format!(
            "{}: finishing an interrupted commit",
            folder.join(target).display()
        ),
        source,
    }
}

/// The new file of an interrupted commit whose target another program
/// replaced since: renamed `.<target>.stfs-kept-<commit>-<n>` (which the
/// cleanup of temp files leaves alone), and said.
fn keep_aside(folder: &Folder, r: &PendingRename) -> std::io::Result<()> {
    for n in 0..16 {
        let kept = format!(".{}.stfs-kept-{}", r.target, n);
        match folder.rename_noreplace(OsStr::new(&r.tmp), OsStr::new(&kept)) {
            Ok(()) => {
                folder.sync()?;
                warn!(
                    file = r.target,
                    "changed by another program since the interrupted commit: left as it is; the \
                     commit's new file is kept beside it, as {kept}"
                );
                return Ok(());
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::from_raw_os_error(libc::EEXIST))
}
