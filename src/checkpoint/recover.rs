//! What a mount does with what earlier mounts of the same source left: the
//! renames of a commit that a crash interrupted are finished (before the
//! sources are opened), then the edits of a staging folder that no daemon
//! holds are taken back from its journals, and the temp files of commits
//! whose daemon died are removed.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use tracing::{info, warn};

use super::Live;
use super::journal;
pub use super::recovery_error::RecoveryError;
use super::staging::{Renames, Staging, kept};
use crate::source::Folder;
use crate::source::{SourceFile, StagingDir};

/// Which kept edits a mount takes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// The newest staging folder whose journals apply to the sources.
    Auto,
    /// This folder (a name in the staging location), or fail.
    Only(OsString),
    /// None: they stay on disk.
    Never,
}

/// Before the sources are opened: finishes a commit that a crash
/// interrupted: its in-place files are completed from their redo records,
/// then its renames done (all of its new files were written and fsynced).
/// An I/O error on the way stops it: the record is kept, and the mount
/// fails with the error (a mount that came up anyway would serve a folder
/// half committed).
pub fn finish_renames(base: &Arc<Folder>, stem: &str) -> Result<Vec<String>, RecoveryError> {
    let mut notes = Vec::new();
    let (dirs, _) = kept(base, stem);
    for dir in dirs {
        let in_dir = |e: RecoveryError| RecoveryError::In {
            dir: dir.path().to_path_buf(),
            source: Box::new(e),
        };
        let record = match Renames::read(&dir) {
            Ok(r) => r,
            Err(why @ RecoveryError::Io { .. }) => return Err(in_dir(why)),
            Err(why) => {
                // Left as it is: the files it names stay as they are, refused
                // by readers if a commit of them in place was interrupted.
                let note = format!(
                    "the record of an interrupted commit cannot be used, {why}: nothing was \
                     completed from it and it is kept; a file it names that readers refuse stays so"
                );
                warn!("{note}");
                notes.push(note);
                None
            }
        };
        if let Some(r) = record {
            let (completed, keep) = r.complete_in_place(&dir).map_err(in_dir)?;
            notes.extend(completed);
            if keep {
                continue; // the source stays refused: the next mount tries again
            }
            let done = r.finish().map_err(in_dir)?;
            {
                // (A record left behind is finished again, changing nothing.)
                let _passed_over = crate::testpoint::best_effort();
                Renames::clear(&dir);
            }
            for (path, removed) in done {
                let what = match removed {
                    true => "removed the file",
                    false => "renamed its new file into place",
                };
                notes.push(format!(
                    "{}: finished a commit that was interrupted ({what})",
                    path.display()
                ));
            }
        }
    }
    Ok(notes)
}

/// Removes the temp files that commits of dead daemons left beside `names`
/// in `folder`: `.<name>.stfs-tmp-<pid>-*`, owned by this user.
pub fn remove_dead_temps(folder: &Folder, names: &[&OsStr]) -> Vec<String> {
    // (One left costs room: the next mount tries again.)
    let _passed_over = crate::testpoint::best_effort();
    let euid = rustix::process::geteuid().as_raw();
    let mut notes = Vec::new();
    let entries: Vec<OsString> = std::fs::read_dir(&folder.path)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    for entry in entries {
        for name in names {
            let prefix = [b".", name.as_bytes(), b".stfs-tmp-"].concat();
            let Some(rest) = entry.as_bytes().strip_prefix(&prefix[..]) else {
                continue;
            };
            let pid = rest.split(|&b| b == b'-').next().unwrap_or_default();
            let dead = std::str::from_utf8(pid)
                .ok()
                .and_then(|p| p.parse::<u32>().ok())
                .is_some_and(process_gone);
            let ours = folder
                .stat_at(&entry)
                .is_ok_and(|st| st.uid == euid && st.is_file());
            if dead && ours && folder.unlink(&entry).is_ok() {
                notes.push(format!(
                    "{}: removed the temp file of an interrupted commit",
                    folder.path.join(&entry).display()
                ));
            }
        }
    }
    notes
}

/// The names whose temp files (`.<name>.stfs-tmp-*`) are in `folder`.
pub fn temp_targets(folder: &Folder) -> Vec<OsString> {
    let mut names: Vec<OsString> = folder
        .entries()
        .iter()
        .filter_map(|e| {
            let rest = e.as_bytes().strip_prefix(b".")?;
            let at = rest.windows(10).position(|w| w == b".stfs-tmp-")?;
            (at > 0).then(|| OsStr::from_bytes(&rest[..at]).to_os_string())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// A kept staging folder that holds nothing to take back is removed; a
/// failure leaves it (room, not edits), and is logged.
fn remove_kept(dir: &StagingDir) {
    let _passed_over = crate::testpoint::best_effort();
    if let Err(e) = dir.remove() {
        warn!(dir = %dir.path().display(), "removing a spent staging folder: {e}");
    }
}

/// Gone, or a zombie waiting to be reaped.
/// Whether a process is gone (or a zombie: dead, not yet reaped).
pub(crate) fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// Takes back the edits kept by an earlier mount. Returns notes for the user.
pub fn resume(
    lives: &mut [&mut Live],
    staging: &Staging,
    how: &Resume,
) -> Result<Vec<String>, RecoveryError> {
    let (mut found, mut notes) = kept(staging.base(), staging.stem());
    // Folders without a journal or a staged model file hold nothing to
    // take back (a mount that died before its first edit was journaled):
    // they go.
    found.retain(|d| {
        let has_journal = d
            .list()
            .unwrap_or_default()
            .iter()
            .any(|n| n.as_bytes().ends_with(b".journal"));
        let holds_edits = has_journal || super::model_change::any_staged(d);
        if !holds_edits {
            remove_kept(d);
        }
        holds_edits
    });
    if let Resume::Only(name) = how {
        found.retain(|d| d.path().file_name() == Some(name.as_os_str()));
        if found.is_empty() {
            return Err(RecoveryError::Refused(format!(
                "{}: not a staging folder of this source that stfs can take over \
                 (it must be a folder .{}.stfs-* beside the source or in --staging-dir, \
                 made by stfs, and not in use)",
                staging.base().path.join(name).display(),
                staging.stem()
            )));
        }
    }
    if found.is_empty() {
        return Ok(notes);
    }
    if *how == Resume::Never {
        for d in &found {
            if spent(d, lives) {
                remove_kept(d);
                notes.push(format!(
                    "{}: the staging folder of an earlier mount, all of whose edits are in the \
                     source now (a commit this mount completed): removed",
                    d.path().display()
                ));
                continue;
            }
            notes.push(format!(
                "{}: edits of an earlier mount, left as they are (--no-resume)",
                d.path().display()
            ));
        }
        return Ok(notes);
    }
    // The newest first.
    found.sort_by_key(|d| std::cmp::Reverse(newest_journal(d)));
    let sources: HashMap<String, Arc<SourceFile>> = lives
        .iter()
        .map(|l| (l.key().to_string(), l.source().clone()))
        .collect();
    let shard = |key: &str| sources.get(key).cloned();
    for dir in found {
        if staging.current().is_some() {
            notes.push(format!(
                "{}: older edits of an earlier mount, left as they are (stfs mount --resume {} takes them instead)",
                dir.path().display(),
                dir.path().display()
            ));
            continue;
        }
        let mut folds = Vec::new();
        let mut refused = None;
        for live in lives.iter() {
            match read_journal(&dir, live) {
                Ok(Some(f)) => folds.push(Some(f)),
                Ok(None) => folds.push(None),
                Err(why @ RecoveryError::Io { .. }) => {
                    return Err(RecoveryError::In {
                        dir: dir.path().to_path_buf(),
                        source: Box::new(why),
                    });
                }
                Err(why) => {
                    refused = Some(why);
                    break;
                }
            }
        }
        if let Some(why) = refused {
            if matches!(how, Resume::Only(_)) {
                return Err(RecoveryError::In {
                    dir: dir.path().to_path_buf(),
                    source: Box::new(why),
                });
            }
            notes.push(format!("{}: {why}; left as it is", dir.path().display()));
            continue;
        }
        if folds.iter().all(Option::is_none) && !super::model_change::any_staged(&dir) {
            continue; // another source's (a --staging-dir shared by sources of one name)
        }
        staging.adopt(dir.clone());
        let mut restored = 0;
        for (live, fold) in lives.iter_mut().zip(folds) {
            if let Some(fold) = fold {
                let (n, more) = live.replay(fold, &dir, &shard);
                restored += n;
                notes.extend(more);
            }
        }
        info!(dir = %dir.path().display(), restored, "took back the edits of an earlier mount");
        // Counted as `stfs status` lists them (a move between shards is one).
        let listed: usize = match restored {
            0 => 0,
            _ => lives.iter().map(|l| l.status().changes.len()).sum(),
        };
        if listed == 0 && super::model_change::any_staged(&dir) {
            continue; // (its model files are said as they are taken back)
        }
        notes.push(match listed {
            // (A commit that a crash interrupted and this mount completed.)
            0 => format!(
                "{}: took back the staging folder of an earlier mount; no staged change was left in it",
                dir.path().display()
            ),
            n => format!(
                "{}: took back {n} staged change{} of an earlier mount (stfs status lists them)",
                dir.path().display(),
                if n == 1 { "" } else { "s" }
            ),
        });
    }
    Ok(notes)
}

fn newest_journal(dir: &StagingDir) -> std::time::SystemTime {
    dir.list()
        .unwrap_or_default()
        .iter()
        .filter_map(|n| std::fs::metadata(dir.path().join(n)).ok()?.modified().ok())
        .max()
        .unwrap_or(std::time::UNIX_EPOCH)
}

/// Whether a kept staging folder holds nothing the sources lack: no record
/// of a commit to complete, and a journal of these sources (not another
/// source's, in a shared --staging-dir) with no edit after what landed.
fn spent(dir: &StagingDir, lives: &[&mut Live]) -> bool {
    let names = dir.list().unwrap_or_default();
    if names.is_empty() || names.iter().any(|n| n == super::staging::RENAMES) {
        return false;
    }
    // (Staged model files are edits too: a review found them removed so.)
    if super::model_change::any_staged(dir) {
        return false;
    }
    let mut ours = false;
    for live in lives {
        match read_journal(dir, live) {
            Ok(None) => {}
            Ok(Some(fold)) if fold.is_empty() => ours = true,
            _ => return false,
        }
    }
    ours
}

/// A checkpoint's journal in `dir`, folded for the source as it is now.
fn read_journal(dir: &StagingDir, live: &Live) -> Result<Option<journal::Folded>, RecoveryError> {
    let folder = dir
        .folder()
        .map_err(RecoveryError::io(dir.path().display()))?;
    let name = live.journal_name();
    let f = match folder.open_file(OsStr::new(name), libc::O_RDONLY, 0) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(RecoveryError::io(name)(e)),
    };
    let mut text = Vec::new();
    crate::testpoint::io("read")
        .and_then(|()| std::io::Read::read_to_end(&mut &f, &mut text))
        .map_err(RecoveryError::io(name))?;
    // Not one whole line: the first append was cut short (a crash, a full
    // disk), so nothing was journaled in it.
    if !text.contains(&b'\n') {
        return Ok(None);
    }
    let replay = journal::read(&text).map_err(|source| RecoveryError::Journal {
        what: name.to_string(),
        source,
    })?;
    if std::fs::canonicalize(&replay.source).ok()
        != std::fs::canonicalize(live.source().path()).ok()
    {
        return Ok(None);
    }
    let now = live.source().stat();
    if replay.stat.same_version(now) {
        return Ok(Some(journal::fold(&replay.records, None)));
    }
    if let Some(commit) = journal::landed(&replay.records, now) {
        // The commit in flight landed: what it planned is in the source now.
        return Ok(Some(journal::fold(&replay.records, Some(commit))));
    }
    Err(RecoveryError::Refused(format!(
        "its edits were made on another version of {} (changed since), so they are not taken back",
        live.source().path().display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::staging::PendingRename;

    #[test]
    fn an_interrupted_rename_is_finished_by_the_next_mount() {
        let dir = tempfile::tempdir().unwrap();
        let folder = Arc::new(Folder::open(dir.path()).unwrap());
        std::fs::write(dir.path().join("a.safetensors"), b"old a").unwrap();
        std::fs::write(dir.path().join("b.safetensors"), b"new b").unwrap(); // renamed already
        let tmp = dir.path().join(".a.safetensors.stfs-tmp-1-1");
        std::fs::write(&tmp, b"new a").unwrap();
        let stat = file_stat(&tmp);
        let dir_path = std::fs::canonicalize(dir.path()).unwrap();
        {
            let staging = StagingDir::create(folder.clone(), "f").unwrap();
            Renames {
                commit: 7,
                in_place: Vec::new(),
                remote: Vec::new(),
                removes: Vec::new(),
                files: vec![
                    PendingRename {
                        folder: dir_path.clone(),
                        tmp: ".a.safetensors.stfs-tmp-1-1".into(),
                        target: "a.safetensors".into(),
                        stat,
                        replaces: None,
                    },
                    PendingRename {
                        folder: dir_path.clone(),
                        tmp: ".b.safetensors.stfs-tmp-1-2".into(),
                        target: "b.safetensors".into(),
                        stat,
                        replaces: None,
                    },
                ],
            }
            .write(&staging)
            .unwrap();
        } // the daemon is gone: its folder is unlocked
        let notes = finish_renames(&folder, "f").unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("a.safetensors")).unwrap(),
            b"new a"
        );
        assert_eq!(
            std::fs::read(dir.path().join("b.safetensors")).unwrap(),
            b"new b"
        );
        assert!(!tmp.exists());
        assert_eq!(notes.len(), 1, "{notes:?}");
        // Done once: the record is gone.
        assert!(finish_renames(&folder, "f").unwrap().is_empty());
    }

    /// A folder holding the mounted source `a.safetensors`: (the folder, its
    /// handle, the source's path, its stat as mounted).
    fn a_mapped_source() -> (
        tempfile::TempDir,
        Arc<Folder>,
        std::path::PathBuf,
        crate::source::FileStat,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let folder = Arc::new(Folder::open(dir.path()).unwrap());
        let target = dir.path().join("a.safetensors");
        std::fs::write(&target, b"mapped a").unwrap();
        let mapped = file_stat(&target);
        (dir, folder, target, mapped)
    }

    #[test]
    fn an_interrupted_rename_over_a_file_replaced_since_is_not_finished() {
        let (dir, folder, target, mapped) = a_mapped_source();
        // Another program replaced the source after the commit swapped back.
        std::fs::remove_file(&target).unwrap();
        std::fs::write(dir.path().join("other"), b"theirs").unwrap();
        std::fs::rename(dir.path().join("other"), &target).unwrap();
        let tmp = dir.path().join(".a.safetensors.stfs-tmp-1-1");
        std::fs::write(&tmp, b"new a").unwrap();
        record_swap(&folder, dir.path(), file_stat(&tmp), mapped);
        finish_renames(&folder, "f").unwrap();
        assert_eq!(
            std::fs::read(&target).unwrap(),
            b"theirs",
            "their file was replaced"
        );
        let kept = dir.path().join(".a.safetensors.stfs-kept-0");
        assert_eq!(
            std::fs::read(&kept).unwrap(),
            b"new a",
            "the commit's file is kept aside"
        );
        // Kept from the cleanup of dead daemons' temp files too.
        remove_dead_temps(&folder, &[OsStr::new("a.safetensors")]);
        assert!(kept.exists() && !tmp.exists());
    }

    #[test]
    fn temp_targets_are_the_names_before_the_temp_suffix() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            ".notes.txt.stfs-tmp-7-ab",
            ".a.b.stfs-tmp-1-2",
            ".a.b.stfs-tmp-3-4",
            "x.stfs-tmp-1-1",
            "..stfs-tmp-1-1",
            ".c.stfs-kept-0",
        ] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        let folder = Folder::open(dir.path()).unwrap();
        assert_eq!(
            temp_targets(&folder),
            vec![OsString::from("a.b"), OsString::from("notes.txt")]
        );
    }

    #[test]
    fn a_swap_interrupted_before_its_check_gives_another_programs_file_back() {
        let (dir, folder, target, mapped) = a_mapped_source();
        let keep_mapped = dir.path().join("mapped-elsewhere"); // (its inode stays taken)
        std::fs::hard_link(&target, &keep_mapped).unwrap();
        std::fs::remove_file(&target).unwrap();
        std::fs::write(&target, b"theirs").unwrap();
        let tmp = dir.path().join(".a.safetensors.stfs-tmp-1-1");
        std::fs::write(&tmp, b"new a").unwrap();
        let new = file_stat(&tmp);
        // Crashed just after the swap: theirs under the temp name, ours at the target.
        folder
            .exchange(
                OsStr::new(".a.safetensors.stfs-tmp-1-1"),
                OsStr::new("a.safetensors"),
            )
            .unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new a");
        record_swap(&folder, dir.path(), new, mapped);
        finish_renames(&folder, "f").unwrap();
        remove_dead_temps(&folder, &[OsStr::new("a.safetensors")]);
        assert_eq!(
            std::fs::read(&target).unwrap(),
            b"theirs",
            "their file was not given back"
        );
        let kept = dir.path().join(".a.safetensors.stfs-kept-0");
        assert_eq!(std::fs::read(kept).unwrap(), b"new a");
    }

    /// A dead daemon's record of a commit that swaps `.a.safetensors.stfs-tmp-1-1`
    /// (of version `stat`) with `a.safetensors`, over the file it mapped.
    fn record_swap(
        folder: &Arc<Folder>,
        dir: &std::path::Path,
        stat: crate::source::FileStat,
        mapped: crate::source::FileStat,
    ) {
        let staging = StagingDir::create(folder.clone(), "f").unwrap();
        Renames {
            commit: 7,
            in_place: Vec::new(),
            remote: Vec::new(),
            removes: Vec::new(),
            files: vec![PendingRename {
                folder: std::fs::canonicalize(dir).unwrap(),
                tmp: ".a.safetensors.stfs-tmp-1-1".into(),
                target: "a.safetensors".into(),
                stat,
                replaces: Some(mapped),
            }],
        }
        .write(&staging)
        .unwrap();
    } // (the daemon is gone: its folder is unlocked)

    fn file_stat(path: &std::path::Path) -> crate::source::FileStat {
        crate::source::FileStat::of(&std::fs::File::open(path).unwrap()).unwrap()
    }
}
