//! After every operation: everything the mount shows matches the model.

use super::*;

/// Checks an inode against the model's identity for it.
pub(super) fn same_inode(model: &mut Model, key: u64, ino: Ino, what: &str) {
    if let Some(&seen) = model.ino_of.get(&key) {
        assert_eq!(seen, ino, "{what}: its inode changed");
    }
    if let Some(&other) = model.key_of.get(&ino) {
        assert_eq!(other, key, "{what}: inode {ino} was another file's");
    }
    model.ino_of.insert(key, ino);
    model.key_of.insert(ino, key);
}

/// A directory listed in pages of `page` entries, each resumed from the
/// last one's offset.
pub(super) fn list_paged(fs: &Fs, ino: Ino, page: usize) -> Vec<(String, Ino)> {
    let mut out: Vec<(String, Ino)> = Vec::new();
    let mut offset = 0;
    for _ in 0..100 {
        let mut got = Vec::new();
        fs.readdir(ino, offset, |e| {
            got.push(e);
            got.len() >= page
        })
        .unwrap();
        // The entry that did not fit is given again in the next page.
        let full = got.len() >= page;
        if full {
            got.pop();
        }
        if got.is_empty() && !full {
            return out;
        }
        if let Some(last) = got.last() {
            offset = last.next_offset;
        }
        out.extend(got.into_iter().map(|e| (e.name, e.ino)));
        if !full {
            return out;
        }
    }
    panic!("readdir of {ino} does not end: {out:?}");
}

/// Everything the mount shows matches the model.
pub(super) fn check(m: &Mounted, model: &mut Model, after: &Op, step: usize) {
    let fs = m.fs();
    if m.folder {
        let root: Vec<String> = list_paged(fs, ROOT_INO, 2)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(root, [".", "..", "s0", "s1", INDEX]);
        let ino = fs.lookup(ROOT_INO, INDEX).unwrap().ino;
        let on_disk = std::fs::read(m.dir.path().join(INDEX)).unwrap();
        assert_eq!(
            m.cat(ino).unwrap(),
            on_disk,
            "the index file after {after:?}"
        );
    }
    let perm = model.attr_perm();
    for dir in 0..model.dirs.len() {
        let dino = m.dir_ino(dir);
        let a = fs.getattr(dino, None).unwrap();
        assert_eq!(a.perm, perm | ((perm & 0o444) >> 2), "directory mode");
        let listed = list_paged(fs, dino, 2 + step % 4);
        let mut want: Vec<String> = vec![".".into(), "..".into()];
        if model.dirs[dir].metadata != MMetadata::Removed {
            want.push("__metadata__.json".into());
        }
        if model.gguf.is_some() {
            want.push("__kv__".into());
        }
        for (name, e) in &model.dirs[dir].entries {
            if e.data.is_some() {
                want.push(TensorFile::Data.file_name(name));
            }
            if e.meta != MMeta::None && !e.hidden {
                want.push(TensorFile::Meta.file_name(name));
            }
        }
        let mut names: Vec<String> = listed.iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "shard {dir} listing after {after:?}");
        // The export view is, byte for byte, the reference serialization of
        // the model's state (when that state is a valid checkpoint).
        let readable = !model.dirs[dir].replaced
            && model.dirs[dir]
                .entries
                .values()
                .all(|e| e.data.is_none_or(|o| !model.unreadable(o)));
        if let Some(g) = model.gguf.as_mut() {
            g.view_order = None; // (read again below, if there is a view)
        }
        if model.problem_count(dir) == 0 && readable {
            let top = if model.folder { ROOT_INO } else { dino };
            let views = fs.lookup(top, "__views__").unwrap();
            let name = if model.folder {
                format!("s{dir}.safetensors")
            } else if model.gguf.is_some() {
                "model.gguf".into()
            } else {
                "model.safetensors".into()
            };
            let view = fs.lookup(views.ino, &name).unwrap();
            let want = match model.gguf {
                Some(_) => Vec::new(),
                None => model.serialized(dir),
            };
            if model.gguf.is_none() {
                assert_eq!(
                    view.size,
                    want.len() as u64,
                    "the export view's size after {after:?}"
                );
            }
            let opened = fs.open(view.ino, false, false).unwrap();
            let mut got = Vec::new();
            loop {
                let part = fs
                    .read(view.ino, opened.fh, got.len() as u64, 1000, |b| b.concat())
                    .unwrap();
                if part.is_empty() {
                    break;
                }
                got.extend(part);
            }
            fs.release(opened.fh).unwrap();
            if model.gguf.is_some() {
                // (The edited state as `--compact` writes it; unedited, the file.)
                assert_eq!(view.size, got.len() as u64, "the view's size");
                let what = format!("the export view after {after:?}");
                let order = model.assert_same_gguf(&got, dir, model.dirs[dir].dirty, &what);
                if let Some(g) = model.gguf.as_mut() {
                    g.view_order = Some(order);
                }
                if !model.dirs[dir].dirty {
                    let mapped = &model.dirs[dir].mapped;
                    let first = got.iter().zip(mapped).position(|(a, b)| a != b);
                    let disk = std::fs::read(&model.dirs[dir].path).unwrap();
                    assert!(
                        got == *mapped,
                        "{what}: not the file as it is (view {} bytes, mapped {}, on disk {} (== view {}, == mapped {}), first difference at {first:?})",
                        got.len(),
                        mapped.len(),
                        disk.len(),
                        disk == got,
                        disk == *mapped
                    );
                }
            } else {
                assert!(
                    got == want,
                    "the export view differs from the model's state after {after:?}"
                );
            }
            // Each tensor's .npy view: numpy's header, then its bytes.
            let mut npy = fs.lookup(views.ino, "npy").unwrap();
            if model.folder {
                npy = fs.lookup(npy.ino, &format!("s{dir}")).unwrap();
            }
            let mut files = Vec::new();
            fs.readdir(npy.ino, 0, |e| {
                files.push(e.name);
                false
            })
            .unwrap();
            let mut want_files = Vec::new();
            for (name, e) in &model.dirs[dir].entries {
                let (MMeta::Valid(dt, _), Some(o), false) = (&e.meta, e.data, e.hidden) else {
                    continue;
                };
                if DTYPES[*dt].1 > 1 {
                    continue; // (a block type has no array)
                }
                let file = TensorFile::Data.file_name(name) + ".npy";
                let a = fs.lookup(npy.ino, &file).unwrap();
                let opened = fs.open(a.ino, false, false).unwrap();
                let got = fs
                    .read(a.ino, opened.fh, 0, a.size as u32, |b| b.concat())
                    .unwrap();
                fs.release(opened.fh).unwrap();
                let bytes = &model.objects[&o].bytes;
                let header = got.len() - bytes.len();
                assert!(
                    got.starts_with(b"\x93NUMPY") && header % 64 == 0 && got[header..] == bytes[..],
                    "the .npy view of {name:?} after {after:?}"
                );
                want_files.push(file);
            }
            files.retain(|n| n != "." && n != "..");
            files.sort();
            want_files.sort();
            assert_eq!(files, want_files, "the .npy views after {after:?}");
            if model.gguf.is_none() {
                check_casts(m, model, dir, after);
            }
        }
        // Every listed name looks up to the inode readdir gave.
        for (name, ino) in listed.iter().skip(2) {
            assert_eq!(
                fs.lookup(dino, name).unwrap().ino,
                *ino,
                "lookup of {name:?} after {after:?}"
            );
        }
        for name in 0..NAMES.len() {
            for part in [Part::Data, Part::Meta] {
                check_file(m, model, &FileRef { dir, name, part }, after);
            }
        }
        check_file(
            m,
            model,
            &FileRef {
                dir,
                name: 0,
                part: Part::Metadata,
            },
            after,
        );
    }
    // The views of all the shards at once.
    let all_readable = (0..model.dirs.len()).all(|dir| {
        model.problem_count(dir) == 0
            && !model.dirs[dir].replaced
            && model.dirs[dir]
                .entries
                .values()
                .all(|e| e.data.is_none_or(|o| !model.unreadable(o)))
    });
    if m.folder && all_readable && !model.in_two_shards() {
        check_folder_views(m, model, after);
    }
    if model.gguf.is_some() {
        check_keys(m, model, after, step);
    }
}

/// `__kv__`: a file per key, each showing its value, each its own inode
/// for its life (until a commit, discard or crash).
fn check_keys(m: &Mounted, model: &mut Model, after: &Op, step: usize) {
    let fs = m.fs();
    let kv = m.kv_dir();
    let listed = list_paged(fs, kv, 2 + step % 3);
    let rewritten = model.dirs[0].rewritten;
    let g = model.gguf.as_mut().unwrap();
    let mut names: Vec<&str> = listed.iter().skip(2).map(|(n, _)| n.as_str()).collect();
    let mut want: Vec<&str> = g.keys.iter().map(|k| k.name.as_str()).collect();
    names.sort();
    want.sort();
    assert_eq!(names, want, "__kv__ after {after:?}");
    for (name, ino) in listed.iter().skip(2) {
        let what = format!("__kv__/{name} after {after:?}");
        assert_eq!(fs.lookup(kv, name).unwrap().ino, *ino, "{what}: lookup");
        let k = g.keys.iter().find(|k| k.name == *name).unwrap();
        if let Some(&seen) = g.ino_of.get(&k.kid) {
            assert_eq!(seen, *ino, "{what}: its inode changed");
        }
        if let Some(&other) = g.key_of.get(ino) {
            assert_eq!(other, k.kid, "{what}: inode {ino} was another key's");
        }
        g.ino_of.insert(k.kid, *ino);
        g.key_of.insert(*ino, k.kid);
        // An array the file holds, in a file rewritten in place: EIO (as
        // its tensors), shown before or not.
        let got = match m.cat(*ino) {
            Err(e) => {
                assert!(rewritten && k.array_from_file(), "{what}: errno {e}");
                assert_eq!(e, libc::EIO, "{what}");
                continue;
            }
            Ok(got) => {
                assert!(
                    !(rewritten && k.array_from_file()),
                    "{what}: read from a file rewritten in place"
                );
                got
            }
        };
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&k.shown),
            "{what}: its text"
        );
        assert_eq!(
            fs.getattr(*ino, None).unwrap().size,
            got.len() as u64,
            "{what}: size"
        );
    }
}

/// One file: absent, or present with its identity, bytes and attributes.
pub(super) fn check_file(m: &Mounted, model: &mut Model, f: &FileRef, after: &Op) {
    let what = format!(
        "{} of shard {} after {after:?}",
        Mounted::file_name(f),
        f.dir
    );
    let ino = m.lookup(f);
    assert_eq!(ino.is_some(), model.exists(f), "{what}: exists");
    let Some(ino) = ino else { return };
    let key = model.key_of_file(f);
    same_inode(model, key, ino, &what);
    let unreadable = f.part == Part::Data
        && model.unreadable(model.entry(f.dir, NAMES[f.name]).unwrap().data.unwrap());
    // (A GGUF file's keys, arrays of a file rewritten in place among them: EIO.)
    let keys_unreadable = f.part == Part::Metadata
        && model.keys_unreadable(f.dir)
        && model
            .gguf
            .as_ref()
            .is_none_or(|g| g.invalid_document.is_none());
    let want = model.content(f);
    if f.part != Part::Data {
        // `cat` opens the file as any reader does.
        let file = model_open_json(model, f, false);
        forget_json(model, file);
    }
    let read = m.cat(ino);
    let read_len = read.as_ref().map_or(0, Vec::len);
    match read {
        Err(e) => assert!(
            (unreadable || keys_unreadable) && e == libc::EIO,
            "{what}: read failed with errno {e}"
        ),
        Ok(got) => {
            assert!(
                !unreadable && !keys_unreadable,
                "{what}: read a source rewritten in place"
            );
            // (A GGUF file's keys: a reason's words are the mount's own.)
            let got = match (&model.gguf, f.part) {
                // (Not a document kept as written: that is shown as it is.)
                (Some(g), Part::Metadata) if g.invalid_document.is_none() => metadata_cut(&got),
                _ => got,
            };
            assert_eq!(
                got,
                want,
                "{what}: bytes ({:?})",
                String::from_utf8_lossy(&got)
            );
        }
    }
    let a = m.fs().getattr(ino, None).unwrap();
    let size = match f.part {
        Part::Data => want.len(),
        Part::Metadata if model.gguf.is_some() => read_len,
        // A JSON file being written shows its writers' text.
        _ => match model.json_by_key.get(&key).map(|id| &model.json[id]) {
            Some(j) if j.written => j.text.len(),
            _ => want.len(),
        },
    };
    assert_eq!(a.size, size as u64, "{what}: size");
    assert_eq!(
        (a.nlink, a.perm, a.uid, a.gid),
        (1, model.attr_perm(), model.uid, model.gid),
        "{what}: attributes"
    );
}
