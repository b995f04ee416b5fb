//! Commits, discards and a killed daemon: each checked against the model and
//! the reference serialization.

use super::*;

pub(super) fn commit(m: &Mounted, model: &mut Model, force: bool, other_user: bool, compact: bool) {
    use std::os::unix::fs::MetadataExt;
    let before: Vec<Vec<u8>> = model
        .dirs
        .iter()
        .map(|d| std::fs::read(&d.path).unwrap())
        .collect();
    let inos: Vec<u64> = model
        .dirs
        .iter()
        .map(|d| std::fs::metadata(&d.path).unwrap().ino())
        .collect();
    // The way the planner must take: an edit of the header alone (names,
    // dtypes, shapes, metadata: every tensor's bytes the unedited ones of
    // this file) commits in place where the filesystem can grow the header
    // by inserting blocks (so whatever the header's new length).
    let inserts = model.dirs.first().is_some_and(|d| {
        stfs::source::local::inserts_blocks(&std::fs::File::open(&d.path).unwrap()).is_some()
    });
    // (A GGUF file's data moves with its alignment: a new one rewrites.)
    let same_alignment = model.gguf.as_ref().is_none_or(|g| !g.alignment_changed());
    let must_be_in_place: Vec<bool> = (0..model.dirs.len())
        .map(|dir| inserts && !compact && !m.read_only && same_alignment && model.header_only(dir))
        .collect();
    let caller = if other_user { OTHER_USER } else { 0 };
    let options = stfs::checkpoint::commit::CommitOptions { force, compact };
    let got = m.fs().commit(options, caller);
    // (`--compact` rewrites a clean shard too; edits that undid each other
    // leave nothing to commit.)
    let dirty: Vec<bool> = (0..model.dirs.len())
        .map(|k| (model.dirs[k].dirty && model.net_changed(k)) || compact)
        .collect();
    // Bytes a commit must read from a source rewritten in place.
    let unreadable = model.dirs.iter().enumerate().any(|(k, d)| {
        dirty[k]
            && (model.keys_unreadable(k)
                || d.entries.values().any(|e| {
                    matches!((&e.meta, e.data, e.hidden), (MMeta::Valid(..), Some(o), false) if model.unreadable(o))
                }))
    });
    let want = if other_user {
        libc::EACCES
    } else if m.read_only && compact {
        // (A plain commit finds nothing: no edit is possible there.)
        libc::EROFS
    } else if !dirty.iter().any(|&d| d) {
        0
    } else if model.problems() {
        libc::EINVAL
    } else if !force
        && model
            .dirs
            .iter()
            .zip(&dirty)
            .any(|(d, &dt)| dt && d.replaced)
    {
        libc::ESTALE
    } else if unreadable {
        libc::EIO
    } else {
        0
    };
    assert_eq!(
        errno(got.as_ref().map(|_| ())),
        want,
        "commit (force {force}): {:?}",
        got.as_ref().err().map(|e| e.to_string())
    );
    if want != 0 || !dirty.iter().any(|&d| d) {
        for (d, b) in model.dirs.iter().zip(before) {
            assert_eq!(
                std::fs::read(&d.path).unwrap(),
                b,
                "a commit that wrote nothing changed a source"
            );
        }
        return;
    }
    let lines = got.unwrap();
    for (dir, &dirty) in dirty.iter().enumerate() {
        if dirty {
            // The way it says it took is the way it took: in place keeps the inode.
            let path = model.dirs[dir].path.display().to_string();
            let line = lines
                .iter()
                .find(|l| l.starts_with(&format!("{path}: committed ")))
                .unwrap_or_else(|| panic!("no commit line for {path}: {lines:?}"));
            let ino = std::fs::metadata(&model.dirs[dir].path).unwrap().ino();
            let in_place = line.contains(": committed in place (");
            assert!(
                in_place || line.contains(": committed by a rewrite ("),
                "{line}"
            );
            assert_eq!(ino == inos[dir], in_place, "{line}");
            assert!(
                in_place || !must_be_in_place[dir],
                "an edit of the header alone, on a filesystem that inserts blocks, must commit in place: {line}"
            );
            WAYS.with(|w| {
                let mut w = w.borrow_mut();
                if in_place {
                    w.0 += 1
                } else {
                    w.1 += 1
                }
                if line.contains("header grown by") {
                    w.2 += 1
                }
                if must_be_in_place[dir] {
                    w.3 += 1
                }
            });
            let got = std::fs::read(&model.dirs[dir].path).unwrap();
            if model.gguf.is_some() {
                let what = format!("the file after {line}");
                let order = model.assert_same_gguf(&got, dir, compact, &what);
                if let Some(shown) = model.gguf.as_ref().and_then(|g| g.view_order.as_ref()) {
                    assert_eq!(&order, shown, "{what}: the tensors' order");
                }
            } else if compact {
                let expected = model.serialized(dir);
                assert_eq!(
                    got, expected,
                    "shard {dir}: committed file (--compact) differs from the reference serialization of the model"
                );
            } else {
                assert_same_checkpoint(&got, &model.serialized(dir), dir);
            }
            model.dirs[dir].mapped = got.clone();
            model.dirs[dir].disk = got;
            model.committed(dir);
        } else {
            assert_eq!(
                std::fs::read(&model.dirs[dir].path).unwrap(),
                model.dirs[dir].disk
            );
        }
    }
    if model.folder {
        let want = model.expected_index();
        let on_disk = std::fs::read(m.dir.path().join(INDEX)).unwrap();
        let parsed: serde_json::Value = serde_json::from_slice(&on_disk).unwrap();
        assert_eq!(parsed, want, "the index after a commit");
        model.index = want;
    }
}

/// A commit's file (in place, or rewritten with room in its header) holds
/// exactly the checkpoint of the reference serialization `expected`: the
/// same tensors (names, dtypes, shapes, bytes) and metadata, read by the
/// reference crate, and only spaces after the header's JSON.
pub(super) fn assert_same_checkpoint(got: &[u8], expected: &[u8], dir: usize) {
    use safetensors::SafeTensors;
    let a = SafeTensors::deserialize(got)
        .unwrap_or_else(|e| panic!("shard {dir}: the reference refuses the committed file: {e:?}"));
    let b = SafeTensors::deserialize(expected).unwrap();
    let mut names: Vec<_> = a.names();
    let mut want: Vec<_> = b.names();
    names.sort();
    want.sort();
    assert_eq!(names, want, "shard {dir}: tensor names");
    for n in &want {
        let (x, y) = (a.tensor(n).unwrap(), b.tensor(n).unwrap());
        assert_eq!(
            (x.dtype(), x.shape(), x.data()),
            (y.dtype(), y.shape(), y.data()),
            "shard {dir}: tensor {n}"
        );
    }
    let meta = |f: &[u8]| SafeTensors::read_metadata(f).unwrap().1.metadata().clone();
    assert_eq!(meta(got), meta(expected), "shard {dir}: metadata");
    let n = u64::from_le_bytes(got[..8].try_into().unwrap()) as usize;
    let json = &got[8..8 + n];
    let end = json.iter().rposition(|&c| c == b'}').unwrap() + 1;
    assert!(
        json[end..].iter().all(|&c| c == b' '),
        "shard {dir}: only spaces after the header's JSON"
    );
}

pub(super) fn discard(m: &Mounted, model: &mut Model) {
    m.fs().discard(0).unwrap();
    for dir in 0..model.dirs.len() {
        let mut committed = model.dirs[dir].committed.clone();
        let mut entries = BTreeMap::new();
        for (name, (dt, s, o, eid, bytes)) in committed.tensors.clone() {
            // Unedited bytes that never left this directory keep their
            // inode; others come back as a fresh file.
            let obj = &model.objects[&o];
            let kept = !obj.edited
                && !obj.moved_away
                && model.dirs[dir].entries.values().any(|e| e.data == Some(o));
            let o = if kept {
                o
            } else {
                let fresh = model.new_object(bytes);
                model.objects.get_mut(&fresh).unwrap().edited = false;
                fresh
            };
            let obj = model.objects.get_mut(&o).unwrap();
            obj.source = Some((dir, name.clone()));
            obj.origin = obj.source.clone();
            obj.patched = None;
            committed.tensors.get_mut(&name).unwrap().2 = o;
            // A meta shown now keeps its file; one not shown is a new file.
            let shown = model.dirs[dir]
                .entries
                .get(&name)
                .filter(|e| e.eid == eid && e.meta != MMeta::None && !e.hidden)
                .map(|e| e.meta_key);
            let meta_key = shown.unwrap_or_else(|| fresh(&mut model.next));
            entries.insert(
                name,
                MEntry {
                    data: Some(o),
                    meta: MMeta::Valid(dt, s),
                    hidden: false,
                    eid,
                    meta_key,
                },
            );
        }
        let d = &mut model.dirs[dir];
        d.entries = entries;
        if d.metadata == MMetadata::Removed {
            d.metadata_key = fresh(&mut model.next);
        }
        d.metadata = MMetadata::Valid(committed.metadata.clone());
        d.metadata_touched = false;
        d.committed = committed;
        d.dirty = false;
    }
    if let Some(g) = model.gguf.as_mut() {
        g.keys = g.committed.clone();
        g.gone.clear();
        g.invalid_document = None;
        g.renew(&mut model.next);
    }
}

/// The daemon is killed (no unmount, no commit) and the source mounted
/// again: every edit comes back; open descriptors, what they wrote and did
/// not close, and hidden metas do not.
pub(super) fn remount(m: &mut Mounted, model: &mut Model) {
    if model.dirs.iter().any(|d| d.replaced) {
        return; // edits of another version of a source are not taken back
    }
    if let Some(dir) = m.fs().staging().current() {
        dir.keep_files(true);
    }
    drop(m.fs.take());
    // (As a daemon's exit does: what its commits let go of is gone.)
    stfs::checkpoint::commit::wait_let_go();
    m.fs = Some(mount_of(m.dir.path(), m.folder, m.read_only, m.gguf));
    if let Some(g) = model.gguf.as_mut() {
        // The keys come back from the journal, each as it was.
        g.gone.clear();
        g.renew(&mut model.next);
    }
    model.handles = Default::default();
    model.json.clear();
    model.json_by_key.clear();
    model.ino_of.clear();
    model.key_of.clear();
    for dir in 0..model.dirs.len() {
        let names: Vec<String> = model.dirs[dir].entries.keys().cloned().collect();
        for name in names {
            // A name of the source is its slot again; its meta is the slot's file.
            let committed = model.dirs[dir].committed.tensors.get(&name).map(|t| t.3);
            let e = model.entry_mut(dir, &name);
            if e.hidden {
                e.meta = MMeta::None;
                e.hidden = false;
            }
            e.eid = committed.unwrap_or(e.eid);
            e.meta_key = e.eid;
            model.prune(dir, &name);
        }
        model.dirs[dir].dirty = model.net_changed(dir);
        // Replay knows bytes by where they are: a source tensor's own bytes
        // back in its shard are that shard's tensor, however they travelled.
        let held: Vec<ObjId> = model.dirs[dir]
            .entries
            .values()
            .filter_map(|e| e.data)
            .collect();
        for o in held {
            let obj = model.objects.get_mut(&o).unwrap();
            if obj.source.as_ref().is_some_and(|(d, _)| *d == dir) {
                obj.moved_away = false;
            }
            // Staged bytes come back from their file alone.
            obj.origin = obj.source.clone();
        }
    }
}
