//! Each operation applied to the mount and to the model, their results compared.

use super::*;

/// Runs one operation on both sides and compares their results.
pub(super) fn apply(m: &mut Mounted, model: &mut Model, op: &Op) {
    if m.read_only && writes(op) {
        return apply_read_only(m, model, op);
    }
    match op {
        op if edits_a_name(op) => apply_name_op(m, model, op),
        Op::Open { .. }
        | Op::HandleRead(..)
        | Op::HandleWrite(..)
        | Op::HandleSetText(..)
        | Op::Fstat(_)
        | Op::Close(_)
        | Op::Fsync(_) => apply_handle_op(m, model, op),
        Op::KvWrite { .. } | Op::KvUnlink(_) | Op::KvRename { .. } | Op::KvDocument(_) => {
            apply_key_op(m, model, op)
        }
        _ => apply_checkpoint_op(m, model, op),
    }
}

/// Operations by name: create, write, truncate, JSON files, unlink, rename.
fn apply_name_op(m: &mut Mounted, model: &mut Model, op: &Op) {
    let fs = m.fs();
    match op {
        Op::Create {
            dir,
            name,
            exclusive,
        } => {
            let (dir, n) = (*dir, NAMES[*name]);
            let got = fs.create(
                m.dir_ino(dir),
                &TensorFile::Data.file_name(n),
                (true, *exclusive),
                0o644,
            );
            let has = model.entry(dir, n).and_then(|e| e.data);
            let want = match has {
                Some(_) if *exclusive => libc::EEXIST,
                Some(o) => {
                    model.truncate(o, 0);
                    0
                }
                None => {
                    let o = model.new_object(vec![]);
                    let e = model.entry_mut(dir, n);
                    e.data = Some(o);
                    e.hidden = false;
                    0
                }
            };
            if want == 0 {
                model.dirs[dir].dirty = true;
            }
            assert_eq!(errno(got.as_ref().map(|_| ())), want, "{op:?}");
            if let Ok((_, o)) = got {
                fs.release(o.fh).unwrap();
            }
        }
        Op::Write {
            dir,
            name,
            offset,
            data,
        } => {
            if let Some((ino, o)) = data_file(m, model, *dir, *name, op) {
                let h = fs.open(ino, true, false).unwrap();
                let got = fs.write(ino, h.fh, *offset, data);
                fs.release(h.fh).unwrap();
                if model.copy_fails(o, u64::MAX) {
                    assert_eq!(errno(got), libc::EIO, "{op:?}");
                    return;
                }
                got.unwrap();
                model.write(o, *offset, data);
                model.dirs[*dir].dirty = true;
            }
        }
        Op::Truncate { dir, name, len } => {
            if let Some((ino, o)) = data_file(m, model, *dir, *name, op) {
                let got = fs.set_size(ino, None, *len);
                if model.copy_fails(o, *len) && model.objects[&o].bytes.len() as u64 != *len {
                    assert_eq!(errno(got), libc::EIO, "{op:?}");
                    return;
                }
                assert_eq!(got.unwrap().size, *len, "{op:?}");
                model.truncate(o, *len);
                model.dirs[*dir].dirty = true;
            }
        }
        Op::WriteJson { dir, name, text } => {
            let (dir, name) = (*dir, *name);
            apply(
                m,
                model,
                &Op::Create {
                    dir,
                    name,
                    exclusive: false,
                },
            );
            let data = text.bytes();
            apply(
                m,
                model,
                &Op::Write {
                    dir,
                    name,
                    offset: 0,
                    data,
                },
            );
        }
        Op::SetMeta { dir, name, text } => {
            let (dir, n) = (*dir, NAMES[*name]);
            let f = meta(dir, *name);
            if !model.exists(&f) {
                let made = model.entry_made(dir, n);
                let key = fresh(&mut model.next);
                let e = model.entry_mut(dir, n);
                if !made {
                    e.meta_key = key;
                }
                e.meta = MMeta::Invalid(vec![]);
                e.hidden = false;
                model.dirs[dir].dirty = true;
            }
            let (a, o) = fs
                .create(
                    m.dir_ino(dir),
                    &Mounted::file_name(&f),
                    (true, false),
                    0o644,
                )
                .unwrap();
            let file = model_open_json(model, &f, true);
            write_and_close(m, model, a.ino, o.fh, file, &text.bytes(), op);
        }
        Op::SetMetadata { dir, text } => {
            let dir = *dir;
            let f = FileRef {
                dir,
                name: 0,
                part: Part::Metadata,
            };
            let (ino, fh) = if model.dirs[dir].metadata == MMetadata::Removed {
                model.set_metadata(dir, b"{}", false);
                let (a, o) = fs
                    .create(m.dir_ino(dir), "__metadata__.json", (true, false), 0o644)
                    .unwrap();
                (a.ino, o.fh)
            } else {
                let ino = m.lookup(&f).unwrap();
                (ino, fs.open(ino, true, true).unwrap().fh)
            };
            let file = model_open_json(model, &f, true);
            write_and_close(m, model, ino, fh, file, &text.bytes(), op);
        }
        Op::Unlink(f) => {
            let got = errno(fs.unlink(m.dir_ino(f.dir), &Mounted::file_name(f)));
            let n = NAMES[f.name];
            let want = if !model.exists(f) {
                libc::ENOENT
            } else {
                model.remove_file(f.dir, n, f.part);
                model.dirs[f.dir].dirty = true;
                0
            };
            assert_eq!(got, want, "{op:?}");
        }
        Op::Rename {
            from,
            to,
            no_replace,
        } => rename(m, model, from, to, *no_replace),
        _ => unreachable!("{op:?} is not one of these"),
    }
}

/// Operations on open descriptors.
fn apply_handle_op(m: &mut Mounted, model: &mut Model, op: &Op) {
    let fs = m.fs();
    match op {
        Op::Open {
            file,
            write,
            truncate,
        } => {
            let Some(k) = model.handles.iter().position(Option::is_none) else {
                return;
            };
            let ino = m.lookup(file);
            assert_eq!(ino.is_some(), model.exists(file), "{op:?}");
            let Some(ino) = ino else { return };
            let got = fs.open(ino, *write, *truncate).unwrap();
            model.handles[k] = Some(match file.part {
                Part::Data => {
                    let o = model
                        .entry(file.dir, NAMES[file.name])
                        .unwrap()
                        .data
                        .unwrap();
                    if *truncate {
                        model.truncate(o, 0);
                        model.dirs[file.dir].dirty = true;
                    }
                    MHandle::Data {
                        fh: got.fh,
                        obj: o,
                        ino,
                        key: model.objects[&o].ino_key,
                        write: *write,
                    }
                }
                _ => MHandle::Json {
                    fh: got.fh,
                    file: model_open_json(model, file, *truncate),
                    ino,
                    write: *write,
                    pending: *truncate,
                },
            });
        }
        Op::HandleRead(k, offset, size) => {
            let Some(h) = model.handles[*k].clone() else {
                return;
            };
            let (fh, ino, want) = match h {
                MHandle::Data { fh, obj, ino, .. } => {
                    if model.unreadable_at(obj, *offset, *size as u64) {
                        let got = fs.read(ino, fh, *offset, *size, |b| b.concat());
                        assert_eq!(errno(got), libc::EIO, "{op:?}: a source rewritten in place");
                        return;
                    }
                    (fh, ino, model.objects[&obj].bytes.clone())
                }
                MHandle::Json { fh, file, ino, .. } => (fh, ino, model.json[&file].text.clone()),
            };
            let got = fs.read(ino, fh, *offset, *size, |b| b.concat()).unwrap();
            let start = (*offset as usize).min(want.len());
            let end = (start + *size as usize).min(want.len());
            assert_eq!(got, want[start..end], "{op:?}: a descriptor reads its file");
        }
        Op::HandleWrite(k, offset, data) => match model.writable_handle(*k) {
            Some(MHandle::Data { fh, obj, ino, .. }) => {
                let got = fs.write(ino, fh, *offset, data);
                if model.copy_fails(obj, u64::MAX) {
                    assert_eq!(errno(got), libc::EIO, "{op:?}");
                    return;
                }
                got.unwrap();
                model.write(obj, *offset, data);
                model.edited(obj);
            }
            Some(MHandle::Json { fh, file, ino, .. }) => {
                fs.write(ino, fh, *offset, data).unwrap();
                let j = model.json.get_mut(&file).unwrap();
                j.write_at(*offset as usize, data);
                set_pending(model, *k);
            }
            _ => {}
        },
        Op::HandleSetText(k, text) => {
            // ftruncate(0) through the descriptor, then a write at 0.
            match model.writable_handle(*k) {
                Some(MHandle::Data { fh, obj, ino, .. }) => {
                    fs.set_size(ino, Some(fh), 0).unwrap();
                    model.truncate(obj, 0);
                    model.edited(obj);
                }
                Some(MHandle::Json { fh, file, ino, .. }) => {
                    fs.set_size(ino, Some(fh), 0).unwrap();
                    let j = model.json.get_mut(&file).unwrap();
                    j.text.clear();
                    j.dirty = true;
                    j.written = true;
                    set_pending(model, *k);
                }
                _ => return,
            }
            apply(m, model, &Op::HandleWrite(*k, 0, text.bytes()));
        }
        Op::Fstat(k) => {
            let Some(h) = model.handles[*k].clone() else {
                return;
            };
            // (fstat: the kernel passes the descriptor's handle.)
            let fh = match &h {
                MHandle::Data { fh, .. } | MHandle::Json { fh, .. } => *fh,
            };
            let (ino, size, nlink) = match h {
                MHandle::Data { obj, ino, key, .. } => {
                    let current = model.holder(obj).is_some() && model.objects[&obj].ino_key == key;
                    (ino, model.objects[&obj].bytes.len(), u32::from(current))
                }
                MHandle::Json { file, ino, .. } => {
                    let key = model.json[&file].key;
                    if model.json_current(key) {
                        let open = model.json_by_key.get(&key).map(|id| &model.json[id]);
                        let size = match open.filter(|j| j.written) {
                            Some(j) => j.text.len(),
                            None => current_json_len(model, key),
                        };
                        (ino, size, 1)
                    } else {
                        (ino, model.json[&file].text.len(), 0)
                    }
                }
            };
            let a = fs.getattr(ino, Some(fh)).unwrap();
            assert_eq!((a.size, a.nlink), (size as u64, nlink), "{op:?}: fstat");
            assert_eq!(
                (a.perm, a.uid, a.gid),
                (model.attr_perm(), model.uid, model.gid)
            );
        }
        Op::Close(k) => {
            let Some(fh) = model.handles[*k].as_ref().map(|h| match h {
                MHandle::Data { fh, .. } | MHandle::Json { fh, .. } => *fh,
            }) else {
                return;
            };
            let (flush, release) = model_close(model, *k);
            assert_eq!(errno(fs.flush(fh)), flush, "{op:?}: flush");
            assert_eq!(errno(fs.release(fh)), release, "{op:?}: release");
        }
        Op::Fsync(k) => {
            let fh = k.and_then(|k| model.handles[k].clone()).map(|h| match h {
                MHandle::Data { fh, .. } => fh,
                MHandle::Json { fh, .. } => fh,
            });
            if k.is_some() && fh.is_none() {
                return;
            }
            // fsync of a JSON descriptor applies what it wrote, as a flush does.
            let want = match k.and_then(|k| model.handles[k].clone().map(|h| (k, h))) {
                Some((
                    k,
                    MHandle::Json {
                        file,
                        write: true,
                        mut pending,
                        ..
                    },
                )) => {
                    let want = model_apply_json(model, file, false, &mut pending, Some(k));
                    if let Some(MHandle::Json { pending: p, .. }) = &mut model.handles[k] {
                        *p = pending;
                    }
                    want
                }
                _ => 0,
            };
            assert_eq!(errno(fs.fsync(fh)), want, "{op:?}");
            for d in &model.dirs {
                assert_eq!(
                    std::fs::read(&d.path).unwrap(),
                    d.disk,
                    "fsync must not commit"
                );
            }
        }
        _ => unreachable!("{op:?} is not one of these"),
    }
}

/// How `stfs status` says that the source changed behind the mount (the
/// rest of the line is the commit's own message).
const CHANGED: &str = "the source changed since it was mounted";

/// Commits, discards, a source replaced behind the mount, status, remount.
fn apply_checkpoint_op(m: &mut Mounted, model: &mut Model, op: &Op) {
    let fs = m.fs();
    match op {
        Op::Commit { force, other_user } => commit(m, model, *force, *other_user, false),
        Op::CompactCommit => commit(m, model, false, false, true),
        Op::Discard => discard(m, model),
        Op::ReplaceSource { dir, in_place } if model.gguf.is_some() => {
            let path = model.dirs[*dir].path.clone();
            let keys = [(
                "general.architecture".to_string(),
                MVal::Str(b"other".to_vec()),
            )];
            let mut disk = write_gguf(&keys, &[("other".into(), 5, vec![1], vec![7])]);
            if *in_place {
                // A size no committed file of the model has.
                disk.extend_from_slice(&[0; 3]);
                std::fs::write(&path, &disk).unwrap();
                model.dirs[*dir].rewritten |= !model.dirs[*dir].detached;
            } else {
                let tmp = path.with_extension("tmp");
                std::fs::write(&tmp, &disk).unwrap();
                std::fs::rename(&tmp, &path).unwrap();
                model.dirs[*dir].detached = true;
            }
            model.dirs[*dir].disk = disk;
            model.dirs[*dir].replaced = true;
        }
        Op::ReplaceSource { dir, in_place } => {
            let path = model.dirs[*dir].path.clone();
            if *in_place {
                let mut other =
                    write_file(&path.with_extension("tmp"), &[("other", 0, vec![7], &[1])]);
                // A size no committed file of the model has.
                other.extend_from_slice(&[0; 3]);
                std::fs::write(&path, &other).unwrap();
                model.dirs[*dir].disk = other;
                // The file the mount maps, unless a rename put another there.
                model.dirs[*dir].rewritten |= !model.dirs[*dir].detached;
            } else {
                let tmp = path.with_extension("tmp");
                let disk = write_file(&tmp, &[("other", 0, vec![7], &[1])]);
                std::fs::rename(&tmp, &path).unwrap();
                model.dirs[*dir].disk = disk;
                model.dirs[*dir].detached = true;
            }
            model.dirs[*dir].replaced = true;
        }
        Op::Status => {
            let (report, refused) = {
                let r = fs.status();
                (r.text(), r.refused)
            };
            // A source replaced behind the mount is a problem while edits are staged.
            let conflict = |dir: usize| {
                model.dirs[dir].replaced
                    && model
                        .status_lines(dir)
                        .iter()
                        .any(|l| !l.starts_with("problem"))
            };
            let conflicts = (0..model.dirs.len()).any(conflict);
            assert_eq!(refused, model.problems() || conflicts, "{report}");
            // One block per checkpoint: its head, then a line per change and problem.
            let blocks: Vec<&str> = report.split("\n").collect();
            for (dir, d) in model.dirs.iter().enumerate() {
                let head = blocks
                    .iter()
                    .position(|l| l.starts_with(&d.path.display().to_string()))
                    .unwrap_or_else(|| panic!("no status of shard {dir}: {report}"));
                let lines: Vec<&str> = blocks[head + 1..]
                    .iter()
                    .take_while(|l| l.starts_with("  "))
                    .copied()
                    .collect();
                // The words of a parse error are serde's: cut after the rule.
                let mut got: Vec<String> = lines
                    .iter()
                    .map(|l| {
                        let l = l.strip_prefix("  ").unwrap_or(l);
                        match l.find(" has an invalid .meta.json:") {
                            Some(k) => l[..k + " has an invalid .meta.json:".len()].to_string(),
                            None if l.starts_with("problem    __metadata__.json ") => {
                                "problem    __metadata__.json".to_string()
                            }
                            None if l.starts_with("problem    __kv__/") => {
                                l[..l.find(':').expect("a rule") + 1].to_string()
                            }
                            None if l.contains(CHANGED) => {
                                l[..l.find(CHANGED).expect("there") + CHANGED.len()].to_string()
                            }
                            None => l.to_string(),
                        }
                    })
                    .collect();
                // The commit's way (in place or a rewrite, and why) is the
                // integration tests' to check; here: said exactly when a
                // commit would go ahead.
                let ways = got.iter().filter(|l| l.starts_with("commit     ")).count();
                // (A GGUF commit's plan reads every key: not from a file
                // rewritten in place.)
                let would_commit = model.dirs[dir].dirty
                    && model.problem_count(dir) == 0
                    && !model.keys_unreadable(dir)
                    && !model.status_lines(dir).is_empty();
                assert_eq!(
                    ways, would_commit as usize,
                    "the commit line of shard {dir}: {report}"
                );
                got.retain(|l| !l.starts_with("commit     "));
                let mut want = model.status_lines(dir);
                if conflict(dir) {
                    want.push(format!("problem    {}: {CHANGED}", d.path.display()));
                }
                got.sort();
                want.sort();
                assert_eq!(got, want, "status of shard {dir}: {report}");
            }
        }
        Op::Remount => remount(m, model),
        _ => unreachable!("{op:?} is not one of these"),
    }
}

/// The length of what JSON file `key` shows at its name now.
pub(super) fn current_json_len(model: &Model, key: u64) -> usize {
    for (dir, d) in model.dirs.iter().enumerate() {
        if d.metadata != MMetadata::Removed && d.metadata_key == key {
            return d.metadata.text().unwrap().len();
        }
        for (name, e) in &d.entries {
            if e.meta != MMeta::None && e.meta_key == key {
                return model.meta_text(dir, name).len();
            }
        }
    }
    unreachable!()
}

/// Writes `text` through an open JSON descriptor (truncated at open), then
/// flush and release, as a shell's `>` does.
pub(super) fn write_and_close(
    m: &Mounted,
    model: &mut Model,
    ino: Ino,
    fh: u64,
    file: u64,
    text: &[u8],
    op: &Op,
) {
    m.fs().write(ino, fh, 0, text).unwrap();
    model.json.get_mut(&file).unwrap().write_at(0, text);
    let mut pending = true;
    let flush = model_apply_json(model, file, false, &mut pending, None);
    assert_eq!(
        errno(m.fs().flush(fh)),
        flush,
        "{op:?}: close reports a JSON file kept but not valid"
    );
    let release = model_apply_json(model, file, true, &mut pending, None);
    assert_eq!(errno(m.fs().release(fh)), release, "{op:?}: release");
    forget_json(model, file);
}

pub(super) fn apply_read_only(m: &Mounted, model: &mut Model, op: &Op) {
    let fs = m.fs();
    let got = match op {
        Op::Create { dir, name, .. } => errno(fs.create(
            m.dir_ino(*dir),
            &Mounted::file_name(&data(*dir, *name)),
            (true, false),
            0o644,
        )),
        Op::Write { dir, name, .. }
        | Op::Truncate { dir, name, .. }
        | Op::WriteJson { dir, name, .. } => match m.lookup(&data(*dir, *name)) {
            Some(ino) => errno(fs.open(ino, true, false)),
            None => return,
        },
        Op::SetMeta { dir, name, .. } => errno(fs.create(
            m.dir_ino(*dir),
            &Mounted::file_name(&meta(*dir, *name)),
            (true, false),
            0o644,
        )),
        Op::SetMetadata { dir, .. } => {
            errno(fs.create(m.dir_ino(*dir), "__metadata__.json", (true, false), 0o644))
        }
        Op::Unlink(f) => errno(fs.unlink(m.dir_ino(f.dir), &Mounted::file_name(f))),
        Op::KvWrite { key, .. } => errno(fs.create(m.kv_dir(), KEYS[*key], (true, false), 0o644)),
        Op::KvUnlink(key) => errno(fs.unlink(m.kv_dir(), KEYS[*key])),
        Op::KvRename { from, to, .. } => {
            errno(fs.rename(m.kv_dir(), KEYS[*from], m.kv_dir(), KEYS[*to], false))
        }
        Op::KvDocument(_) => {
            let ino = m.lookup(&metadata(0)).unwrap();
            errno(fs.open(ino, true, true))
        }
        Op::Rename { from, to, .. } => errno(fs.rename(
            m.dir_ino(from.dir),
            &Mounted::file_name(from),
            m.dir_ino(to.dir),
            &Mounted::file_name(to),
            false,
        )),
        Op::Open { file, truncate, .. } => match m.lookup(file) {
            Some(ino) => errno(fs.open(ino, true, *truncate)),
            None => return,
        },
        // Read-only mounts hold no writable descriptors.
        _ => return,
    };
    assert_eq!(got, libc::EROFS, "{op:?} on a read-only mount");
    let _ = model;
}

pub(super) fn rename(
    m: &Mounted,
    model: &mut Model,
    from: &FileRef,
    to: &FileRef,
    no_replace: bool,
) {
    let fs = m.fs();
    let got = errno(fs.rename(
        m.dir_ino(from.dir),
        &Mounted::file_name(from),
        m.dir_ino(to.dir),
        &Mounted::file_name(to),
        no_replace,
    ));
    let what = format!("rename {from:?} -> {to:?} (no_replace {no_replace})");
    let (fname, tname) = (NAMES[from.name], NAMES[to.name]);
    let same = from.dir == to.dir
        && from.part == to.part
        && (from.name == to.name || from.part == Part::Metadata);
    let unreadable = from.part == Part::Data
        && model.exists(from)
        && model.unreadable(model.entry(from.dir, fname).unwrap().data.unwrap());
    let want = if !model.exists(from) {
        libc::ENOENT
    } else if same {
        0
    } else if no_replace && model.exists(to) {
        libc::EEXIST
    } else if unreadable && to.part != Part::Data {
        libc::EIO // its bytes would become JSON: they cannot be read
    } else {
        // The content of the file moved, as bytes.
        let bytes = model.content(from);
        match to.part {
            Part::Data => {
                let moved_meta;
                let o = match from.part {
                    Part::Data => {
                        let e = model.entry_mut(from.dir, fname);
                        let o = e.data.take().unwrap();
                        // The meta goes along; the name keeps it, hidden.
                        moved_meta = (e.meta != MMeta::None).then(|| e.meta.clone());
                        e.hidden = moved_meta.is_some();
                        o
                    }
                    Part::Meta => {
                        moved_meta = None;
                        let e = model.entry_mut(from.dir, fname);
                        e.meta = MMeta::None;
                        e.hidden = false;
                        model.new_object(bytes)
                    }
                    Part::Metadata => {
                        moved_meta = None;
                        model.dirs[from.dir].metadata = MMetadata::Removed;
                        model.dirs[from.dir].metadata_touched = true;
                        model.new_object(bytes)
                    }
                };
                model.prune(from.dir, fname);
                if from.dir != to.dir {
                    let key = fresh(&mut model.next);
                    let obj = model.objects.get_mut(&o).unwrap();
                    obj.ino_key = key;
                    obj.moved_away = true;
                }
                let key = fresh(&mut model.next);
                let e = model.entry_mut(to.dir, tname);
                e.data = Some(o);
                e.hidden = false;
                if let Some(meta) = moved_meta {
                    e.meta = meta;
                    e.meta_key = key;
                }
                model.dirs[from.dir].dirty = true;
                model.dirs[to.dir].dirty = true;
                0
            }
            Part::Meta | Part::Metadata => {
                let valid = match to.part {
                    Part::Metadata => matches!(MMetadata::parse(&bytes), MMetadata::Valid(_)),
                    _ => matches!(MMeta::parse(&bytes), MMeta::Valid(..)),
                };
                if !valid {
                    libc::EINVAL
                } else {
                    model.remove_file(from.dir, fname, from.part);
                    match to.part {
                        Part::Metadata => model.set_metadata(to.dir, &bytes, true),
                        _ => model.set_meta(to.dir, tname, &bytes, true),
                    }
                    model.dirs[from.dir].dirty = true;
                    0
                }
            }
        }
    };
    assert_eq!(got, want, "{what}");
}

/// Operations on a GGUF file's keys: through `__kv__` and `__metadata__.json`.
fn apply_key_op(m: &mut Mounted, model: &mut Model, op: &Op) {
    let fs = m.fs();
    let kv = m.kv_dir();
    let next = &mut model.next;
    let rewritten = model.dirs[0].rewritten;
    let g = model.gguf.as_mut().expect("a GGUF run");
    match op {
        Op::KvWrite { key, text } => {
            // (Any write of a key: the document shows the keys again.)
            g.invalid_document = None;
            let name = KEYS[*key];
            let made = g.position(name).is_none();
            let (a, o) = fs.create(kv, name, (true, false), 0o644).unwrap();
            if made {
                // A new key takes its name's type, else is a string; empty.
                let ty = g.name_type(name).unwrap_or(KTy::Str);
                g.keys.push(MKey {
                    name: name.into(),
                    ty,
                    value: parse_text(ty, b""),
                    shown: Vec::new(),
                    kid: fresh(next),
                    from_file: false,
                });
            }
            model.dirs[0].dirty = true;
            let bytes = text.bytes();
            if !bytes.is_empty() {
                fs.write(a.ino, o.fh, 0, &bytes).unwrap();
            }
            // The text is the key's value at close: refused (EINVAL, kept as
            // written) if it is not one of the key's type.
            let p = g.position(name).unwrap();
            let k = &mut g.keys[p];
            k.value = parse_text(k.ty, &bytes);
            // (A value of the key's type reads back as the file will after
            // a commit; text that is not one, as written.)
            k.shown = match &k.value {
                Some(v) => v.file_text(),
                None => bytes.clone(),
            };
            k.from_file = false;
            let invalid = if k.value.is_none() { libc::EINVAL } else { 0 };
            g.settle(rewritten);
            // (A shell's `>` closes a duplicate first: nothing written yet is
            // the last close's to apply.)
            let (flush, release) = match bytes.is_empty() {
                false => (invalid, 0),
                true => (0, invalid),
            };
            assert_eq!(errno(fs.flush(o.fh)), flush, "{op:?}: flush");
            assert_eq!(errno(fs.release(o.fh)), release, "{op:?}: release");
        }
        Op::KvUnlink(key) => {
            let name = KEYS[*key];
            let want = match g.position(name) {
                None => libc::ENOENT,
                Some(p) => {
                    let k = g.keys.remove(p);
                    g.gone.insert(k.name, k.ty);
                    g.invalid_document = None;
                    model.dirs[0].dirty = true;
                    0
                }
            };
            assert_eq!(errno(fs.unlink(kv, name)), want, "{op:?}");
        }
        Op::KvRename {
            from,
            to,
            no_replace,
        } => {
            let (from, to) = (KEYS[*from], KEYS[*to]);
            let got = errno(fs.rename(kv, from, kv, to, *no_replace));
            let want = match (g.position(from), g.position(to)) {
                (None, _) => libc::ENOENT,
                (Some(_), Some(_)) if *no_replace && from != to => libc::EEXIST,
                _ if from == to => 0,
                // A move reads the value: not an array of a file rewritten
                // in place (nothing moves).
                (Some(p), _) if rewritten && g.keys[p].array_from_file() => libc::EIO,
                (Some(p), target) => {
                    // The name's type: the key there, or the one the name had.
                    let ty = target
                        .map(|q| g.keys[q].ty)
                        .or_else(|| g.name_type(to))
                        .unwrap_or(g.keys[p].ty);
                    let mut moved = g.keys[p].clone();
                    let fits = ty == moved.ty || parse_text(ty, &moved.shown).is_some();
                    if !fits {
                        libc::EINVAL
                    } else {
                        // (Text from now on, unless it is the value the
                        // file has under the new name: `settle`.)
                        if ty != moved.ty {
                            moved.value = parse_text(ty, &moved.shown);
                            moved.ty = ty;
                            // (Shown as a value of its new type.)
                            if let Some(v) = &moved.value {
                                moved.shown = v.file_text();
                            }
                        }
                        moved.from_file = false;
                        g.gone.insert(from.into(), g.keys[p].ty);
                        moved.name = to.into();
                        match target {
                            Some(q) => {
                                g.keys[q] = moved;
                                g.keys.remove(p);
                            }
                            None => g.keys[p] = moved,
                        }
                        g.settle(rewritten);
                        g.invalid_document = None;
                        model.dirs[0].dirty = true;
                        0
                    }
                }
            };
            assert_eq!(got, want, "{op:?}");
        }
        Op::KvDocument(edit) => {
            let doc = g.document(edit);
            let text = document_text(&doc);
            let applied = g.set_document(&doc, next, rewritten);
            // Not a document of keys: kept as written, and a problem.
            g.invalid_document = (!applied).then(|| text.clone());
            model.dirs[0].dirty = true;
            let ino = m.lookup(&metadata(0)).unwrap();
            let o = fs.open(ino, true, true).unwrap();
            fs.write(ino, o.fh, 0, &text).unwrap();
            let want = if applied { 0 } else { libc::EINVAL };
            assert_eq!(
                errno(fs.flush(o.fh)),
                want,
                "{op:?}: {}",
                String::from_utf8_lossy(&text)
            );
            assert_eq!(errno(fs.release(o.fh)), 0, "{op:?}: release");
        }
        _ => unreachable!("{op:?} is not one of these"),
    }
}

/// Handle `k` (a JSON descriptor) wrote or cut since its last flush.
fn set_pending(model: &mut Model, k: usize) {
    if let Some(MHandle::Json { pending, .. }) = &mut model.handles[k] {
        *pending = true;
    }
}

impl Model {
    /// Handle `k`, if it is open for writing.
    fn writable_handle(&self, k: usize) -> Option<MHandle> {
        self.handles[k].clone().filter(|h| match h {
            MHandle::Data { write, .. } | MHandle::Json { write, .. } => *write,
        })
    }
}
