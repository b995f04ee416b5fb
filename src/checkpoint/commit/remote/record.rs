//! The record of a remote commit in the cache folder, and what the next
//! mount does with it: finishes a folder's commit that some objects
//! reached, or aborts an upload that none did.

use super::*;
use crate::checkpoint::recovery_error::RecoveryError;

/// At mount, before the objects are read: the commits that a crash (or a
/// failure) interrupted after one of their objects landed, finished from
/// their records (`Renames::remote`) in the staging folders of dead
/// daemons: the other shards' uploads completed, each only over the
/// version the commit replaced, then the indexes put, only once every
/// shard is new. A commit none of whose objects landed is left to
/// `abort_interrupted` (the object stays the old one). Returns notes and
/// the uploads now complete; an error if the store could not be asked (a
/// writable mount then waits: its edits would be taken back over objects
/// that the record may still change).
pub fn finish_interrupted(
    base: &Arc<Folder>,
    stem: &str,
    writer: &S3Writer,
    remote: &crate::source::remote::Remote,
) -> Result<(Vec<String>, Vec<String>), RecoveryError> {
    let (mut notes, mut done) = (Vec::new(), Vec::new());
    let (dirs, _) = crate::checkpoint::staging::kept(base, stem);
    for dir in dirs {
        let record = match Renames::read(&dir) {
            Ok(Some(r)) if !r.remote.is_empty() => r,
            Ok(_) => continue,
            Err(why) => {
                notes.push(format!(
                    "the record of an interrupted commit cannot be used, {why}: nothing was \
                     completed from it and it is kept"
                ));
                continue;
            }
        };
        match finish_record(&record.remote, &dir, writer, remote) {
            Ok((finished, uploads, all_landed)) => {
                notes.extend(finished);
                done.extend(uploads);
                Renames::clear(&dir);
                if all_landed {
                    drop_landed_journals(&dir, record.commit);
                }
            }
            Err(why) => {
                return Err(RecoveryError::Refused(format!(
                    "{why}; mount again to finish it (a read-only mount, -o ro, does not need it)"
                )));
            }
        }
    }
    Ok((notes, done))
}

/// The journals in `dir` that hold nothing but what commit `commit` put in
/// the store (no edit after its plan), removed: their edits are in the new
/// objects, which the journals' sources no longer are (a staging folder
/// left with no journal goes at the next mount).
fn drop_landed_journals(dir: &StagingDir, commit: u64) {
    use crate::checkpoint::journal::{self, Record};
    let Ok(folder) = dir.folder() else {
        return;
    };
    for name in dir.list().unwrap_or_default() {
        if !name.as_encoded_bytes().ends_with(b".journal") {
            continue;
        }
        let Ok(f) = folder.open_file(&name, libc::O_RDONLY | libc::O_NOFOLLOW, 0) else {
            continue;
        };
        let mut text = Vec::new();
        if std::io::Read::read_to_end(&mut &f, &mut text).is_err() {
            continue;
        }
        let Ok(replay) = journal::read(&text) else {
            continue;
        };
        let planned = replay
            .records
            .iter()
            .rposition(|r| matches!(r, Record::Plan { commit: c } if *c == commit));
        let later = |k: usize| {
            replay.records[k + 1..]
                .iter()
                .any(|r| !matches!(r, Record::Landing { .. }))
        };
        if planned.is_some_and(|k| !later(k)) {
            folder.unlink_spent(&name);
        }
    }
    let _ = folder.sync();
}

/// One commit's objects finished (see `finish_interrupted`): its notes,
/// the uploads that are complete now, and whether every object is new now;
/// or why the store could not be asked (the record stays for the next
/// mount).
fn finish_record(
    objects: &[RemoteLanding],
    dir: &StagingDir,
    writer: &S3Writer,
    remote: &crate::source::remote::Remote,
) -> Result<(Vec<String>, Vec<String>, bool), RecoveryError> {
    let key_of = |o: &RemoteLanding| {
        object_store::path::Path::parse(&o.key).map_err(|_| {
            RecoveryError::Refused(format!(
                "{}: a commit record names a bad key {:?}",
                o.url, o.key
            ))
        })
    };
    let mut now = Vec::new();
    for o in objects {
        let etag = remote.run(writer.etag_now(&key_of(o)?)).map_err(|e| {
            RecoveryError::Refused(format!(
                "{}: an interrupted commit could not be finished ({e})",
                o.url
            ))
        })?;
        now.push(etag);
    }
    // (A removal is no sign: its object may have been gone before the
    // commit; removals land last, after everything else landed.)
    if !objects
        .iter()
        .zip(&now)
        .any(|(o, n)| !o.remove && o.landed(n))
    {
        // Nothing changed: the uploads are aborted.
        return Ok((Vec::new(), Vec::new(), false));
    }
    let mut notes = Vec::new();
    let mut complete = Vec::new();
    let mut all_shards = true;
    let mut all_landed = true;
    for (o, n) in objects.iter().zip(&now) {
        if o.landed(n) {
            complete.extend(o.upload.clone());
            continue;
        }
        let key = key_of(o)?;
        let done = match (&o.upload, &o.text) {
            (_, _) if !o.over_old(n) => Err(format!(
                "{}: not finished: the object changed since the commit began (the commit's \
                 other objects are new)",
                o.url
            )),
            _ if !o.is_shard() && !all_shards => Err(format!(
                "{}: left as it was: a shard of the commit could not be finished, and the \
                 folder's other files and indexes go with its new tensors",
                o.url
            )),
            _ if o.remove => remote
                .run(writer.delete(&key, o.if_match.as_deref()))
                .map_err(|e| format!("{}: could not be removed ({e})", o.url)),
            _ if o.body.is_some() => put_body(o, &key, dir, writer, remote)
                .map_err(|e| format!("{}: could not be put ({e})", o.url)),
            (Some(upload), _) => {
                let parts: Vec<DonePart> = o
                    .parts
                    .iter()
                    .map(|(number, etag)| DonePart {
                        number: *number,
                        etag: etag.clone(),
                    })
                    .collect();
                remote
                    .run(writer.complete(&key, upload, &parts, o.if_match.as_deref()))
                    .map(|_| ())
                    .map_err(|e| format!("{}: its upload could not be completed ({e})", o.url))
            }
            (None, Some(text)) => remote
                .run(writer.put(
                    &key,
                    bytes::Bytes::from(text.clone()),
                    o.if_match.as_deref(),
                    &o.headers,
                ))
                .map(|_| ())
                .map_err(|e| format!("{}: could not be put ({e})", o.url)),
            (None, None) => Err(format!(
                "{}: its new version was put whole and is not in the record (it stays as it is)",
                o.url
            )),
        };
        match done {
            Ok(()) => {
                complete.extend(o.upload.clone());
                notes.push(format!(
                    "{}: finished a commit that was interrupted after another of its objects \
                     landed",
                    o.url
                ))
            }
            Err(why) => {
                all_shards &= !o.is_shard();
                all_landed = false;
                warn!("{why}");
                notes.push(why);
            }
        }
    }
    Ok((notes, complete, all_landed))
}

/// A recorded model file put again from its bytes in the staging folder,
/// over the version the commit replaced (or where nothing is, for a new name).
fn put_body(
    o: &RemoteLanding,
    key: &object_store::path::Path,
    dir: &StagingDir,
    writer: &S3Writer,
    remote: &crate::source::remote::Remote,
) -> std::io::Result<()> {
    let name = o.body.as_deref().unwrap_or_default();
    let bytes = read_body(dir, name).map_err(|e| {
        let at = dir.path().join(name);
        std::io::Error::new(e.kind(), format!("its bytes in {}: {e}", at.display()))
    })?;
    let put = match o.fresh {
        true => remote.run(writer.put_new(key, bytes, &o.headers)),
        false => remote.run(writer.put(key, bytes, o.if_match.as_deref(), &o.headers)),
    };
    put.map(|_| ()).map_err(std::io::Error::other)
}

fn read_body(dir: &StagingDir, name: &str) -> std::io::Result<bytes::Bytes> {
    if !name.starts_with(crate::checkpoint::staging::BODY_PREFIX) || name.contains('/') {
        return Err(std::io::Error::other("not a file the record may name"));
    }
    let f = dir
        .folder()?
        .open_file(OsStr::new(name), libc::O_RDONLY | libc::O_NOFOLLOW, 0)?;
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut &f, &mut bytes)?;
    Ok(bytes.into())
}

/// The name of an upload record of this mount (`stem`: the staging stem
/// of the mount; `object`: the object's name, several shards of a folder
/// being committed at once).
pub fn record_name(stem: &str, commit: u64, object: &OsStr) -> String {
    let tag = crate::checkpoint::in_place::sha256_hex(&[object.as_encoded_bytes()]);
    format!(
        "{stem}.upload-{}-{commit}-{}",
        std::process::id(),
        &tag[..8]
    )
}

/// At mount: the uploads of commits a crash interrupted (recorded in
/// `folder` under `stem`), aborted, so that no parts stay to be paid for.
/// Records of a daemon still running are left alone.
pub fn abort_interrupted(
    folder: &Folder,
    stem: &str,
    writer: &S3Writer,
    remote: &crate::source::remote::Remote,
    complete: &[String],
) -> Vec<String> {
    let mut notes = Vec::new();
    let prefix = format!("{stem}.upload-");
    for name in folder.entries() {
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let name = name.to_string_lossy().into_owned();
        if rest.ends_with(".tmp") {
            folder.unlink_spent(OsStr::new(&name));
            continue;
        }
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        let alive = pid.is_some_and(|p| !crate::checkpoint::recover::process_gone(p));
        if alive && pid != Some(std::process::id()) {
            continue;
        }
        let text = folder
            .open_file(OsStr::new(&name), libc::O_RDONLY, 0)
            .and_then(|f| {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut &f, &mut s).map(|_| s)
            })
            .unwrap_or_default();
        let mut lines = text.lines();
        let (url, key, upload) = (
            lines.next().unwrap_or(""),
            lines.next().unwrap_or(""),
            lines.next().unwrap_or(""),
        );
        if upload.is_empty() || complete.iter().any(|c| c == upload) {
            // Interrupted before the store named the upload (it holds no
            // parts), or completed since (`finish_interrupted`).
            folder.unlink_spent(OsStr::new(&name));
            continue;
        }
        // (The key as recorded: parsed, not encoded again.)
        let Ok(key) = object_store::path::Path::parse(key) else {
            notes.push(format!(
                "{url}: an upload record names a bad key {key:?}; left as it is"
            ));
            continue;
        };
        match remote.run(writer.abort(&key, upload)) {
            Ok(()) => {
                folder.unlink_spent(OsStr::new(&name));
                notes.push(format!(
                    "{url}: the upload of a commit that was interrupted was aborted (the parts it \
                     held are freed)"
                ));
            }
            Err(e) => notes.push(format!(
                "{url}: the upload {upload} of an interrupted commit could not be aborted ({e}); \
                 the next mount tries again"
            )),
        }
    }
    let _ = folder.sync();
    notes
}
