//! The filesystem side: a mount in-process, each operation applied to it
//! and to the model, and the checks that they agree.

use super::*;
use stfs::errno::ToErrno;

pub(super) struct Mounted {
    pub(super) fs: Option<Fs>,
    pub(super) folder: bool,
    pub(super) read_only: bool,
    pub(super) dir: tempfile::TempDir,
}

impl Mounted {
    pub(super) fn fs(&self) -> &Fs {
        self.fs.as_ref().unwrap()
    }

    pub(super) fn dir_ino(&self, dir: usize) -> Ino {
        if self.folder {
            self.fs().lookup(ROOT_INO, &format!("s{dir}")).unwrap().ino
        } else {
            ROOT_INO
        }
    }

    pub(super) fn file_name(f: &FileRef) -> String {
        match f.part {
            Part::Data => TensorFile::Data.file_name(NAMES[f.name]),
            Part::Meta => TensorFile::Meta.file_name(NAMES[f.name]),
            Part::Metadata => "__metadata__.json".into(),
        }
    }

    pub(super) fn lookup(&self, f: &FileRef) -> Option<Ino> {
        self.fs()
            .lookup(self.dir_ino(f.dir), &Self::file_name(f))
            .ok()
            .map(|a| a.ino)
    }

    /// A file's bytes read through a new descriptor, 5 bytes at a time.
    pub(super) fn cat(&self, ino: Ino) -> Result<Vec<u8>, i32> {
        let o = self
            .fs()
            .open(ino, false, false)
            .map_err(|e| e.to_errno())?;
        let mut out = Vec::new();
        let result = loop {
            match self
                .fs()
                .read(ino, o.fh, out.len() as u64, 5, |b| b.concat())
            {
                Ok(chunk) if chunk.is_empty() => break Ok(out),
                Ok(chunk) => out.extend(chunk),
                Err(e) => break Err(e.to_errno()),
            }
        };
        self.fs().release(o.fh).unwrap();
        result
    }
}

/// name, dtype, bytes, shape
pub(super) type Tensor<'a> = (&'a str, usize, Vec<u8>, &'a [u64]);

/// Writes a checkpoint with the reference serializer.
pub(super) fn write_file(path: &Path, tensors: &[Tensor]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, b, s)| {
            let dtype: safetensors::Dtype =
                serde_json::from_str(&format!("\"{}\"", DTYPES[*d].0)).unwrap();
            let shape = s.iter().map(|&x| x as usize).collect();
            let view = safetensors::tensor::TensorView::new(dtype, shape, b).unwrap();
            (n.to_string(), view)
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(path, &bytes).unwrap();
    bytes
}

/// Opened as the daemon opens them (for writing too unless read-only), so
/// that commits take every way: in place and rewrite.
pub(super) fn open_sources(dir: &Path, count: usize, writable: bool) -> Vec<(String, SourceFile)> {
    (0..count)
        .map(|k| {
            let path = dir.join(format!("s{k}.safetensors"));
            (
                format!("s{k}"),
                SourceFile::open_with(&path, writable).unwrap(),
            )
        })
        .collect()
}

/// Mounts the sources in `dir`, taking back the edits a killed daemon left.
pub(super) fn mount(dir: &Path, folder: bool, read_only: bool) -> Fs {
    let base = Arc::new(Folder::open(dir).unwrap());
    recover::finish_renames(&base, "m");
    let staging = Arc::new(Staging::new(base.clone(), "m"));
    let mut sources = open_sources(dir, if folder { 2 } else { 1 }, !read_only);
    let source = if folder {
        let bytes = std::fs::read(dir.join(INDEX)).unwrap();
        let file = std::fs::File::open(dir.join(INDEX)).unwrap();
        Source::Folder {
            folder: base,
            stat: FileStat::of(&std::fs::File::open(dir).unwrap()).unwrap(),
            checkpoints: sources,
            indexes: vec![IndexFile {
                name: INDEX.into(),
                bytes,
                stat: FileStat::of(&file).unwrap(),
            }],
        }
    } else {
        Source::File(sources.pop().unwrap().1)
    };
    let settings = Settings {
        read_only,
        ..Settings::default()
    };
    let fs = Fs::new(source, settings, staging.clone());
    fs.with_lives(|lives| recover::resume(lives, &staging, &Resume::Auto))
        .unwrap();
    fs
}

pub(super) fn setup(folder: bool, read_only: bool) -> (Mounted, Model) {
    let dir = tempfile::tempdir().unwrap();
    let initial: Vec<Vec<Tensor>> = vec![
        vec![
            ("a", 0, vec![1, 2, 3], &[3]),
            ("b", 1, vec![9, 8, 7, 6], &[2]),
        ],
        vec![
            ("x.meta.json", 2, vec![5, 5, 5, 5], &[1]),
            ("c/d", 0, vec![4, 2], &[2]),
        ],
    ];
    let count = if folder { 2 } else { 1 };
    let mut model = Model {
        dirs: Vec::new(),
        objects: HashMap::new(),
        next: 0,
        handles: Default::default(),
        json: HashMap::new(),
        json_by_key: HashMap::new(),
        ino_of: HashMap::new(),
        key_of: HashMap::new(),
        read_only,
        folder,
        perm: 0,
        uid: 0,
        gid: 0,
        index: serde_json::json!({"metadata": {"format": "pt", "total_size": 0}, "weight_map": {}}),
    };
    for (k, tensors) in initial.into_iter().take(count).enumerate() {
        let path = dir.path().join(format!("s{k}.safetensors"));
        let disk = write_file(&path, &tensors);
        let mut entries = BTreeMap::new();
        for (name, dtype, bytes, shape) in tensors {
            let o = model.new_object(bytes);
            let obj = model.objects.get_mut(&o).unwrap();
            obj.edited = false;
            obj.source = Some((k, name.to_string()));
            obj.origin = obj.source.clone();
            let eid = fresh(&mut model.next);
            entries.insert(
                name.to_string(),
                MEntry {
                    data: Some(o),
                    meta: MMeta::Valid(dtype, shape.to_vec()),
                    hidden: false,
                    eid,
                    meta_key: eid,
                },
            );
        }
        let metadata_key = fresh(&mut model.next);
        model.dirs.push(MDir {
            path: path.clone(),
            entries,
            metadata: MMetadata::Valid(None),
            metadata_key,
            metadata_touched: false,
            committed: Committed {
                tensors: BTreeMap::new(),
                metadata: None,
            },
            dirty: false,
            replaced: false,
            rewritten: false,
            detached: false,
            mapped: disk.clone(),
            disk,
        });
        model.committed(k);
    }
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(&model.dirs[0].path).unwrap();
    (model.perm, model.uid, model.gid) = ((m.mode() & 0o777) as u16, m.uid(), m.gid());
    if folder {
        model.index = model.expected_index();
        let mut text = serde_json::to_vec_pretty(&model.index).unwrap();
        text.push(b'\n');
        std::fs::write(dir.path().join(INDEX), text).unwrap();
    }
    let fs = mount(dir.path(), folder, read_only);
    (
        Mounted {
            fs: Some(fs),
            folder,
            read_only,
            dir,
        },
        model,
    )
}

pub(super) fn errno<T, E: std::borrow::Borrow<stfs::fs::FsError>>(r: Result<T, E>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.borrow().to_errno(),
    }
}

/// Opens JSON file `f` (it exists) in the model: the file open on its inode
/// already, unless that one's generated text is out of date.
pub(super) fn model_open_json(model: &mut Model, f: &FileRef, truncate: bool) -> u64 {
    let key = model.key_of_file(f);
    let text = model.state_content(f);
    let shared = model.json_by_key.get(&key).copied().filter(|id| {
        model
            .json
            .get(id)
            .is_some_and(|j| j.written || j.text == text)
    });
    let id = shared.unwrap_or_else(|| {
        let id = fresh(&mut model.next);
        model.json.insert(
            id,
            MJson {
                key,
                text,
                dirty: false,
                written: false,
            },
        );
        model.json_by_key.insert(key, id);
        id
    });
    if truncate {
        let j = model.json.get_mut(&id).unwrap();
        j.text.clear();
        j.dirty = true;
        j.written = true;
    }
    id
}

/// Flush (`last`: release) of a JSON descriptor open for writing (not held
/// handle `except`): what was written goes to the name if the file is still
/// there. Returns the errno expected.
pub(super) fn model_apply_json(
    model: &mut Model,
    file: u64,
    last: bool,
    except: Option<usize>,
) -> i32 {
    let others = model.handles.iter().enumerate().any(|(k, h)| {
        Some(k) != except
            && matches!(h, Some(MHandle::Json { file: f, write: true, .. }) if *f == file)
    });
    // Text that does not parse is the closer's to hear of only when no
    // other writer may still be writing it.
    let invalid = if others { 0 } else { libc::EINVAL };
    let j = model.json.get_mut(&file).unwrap();
    if !j.dirty || (!last && j.text.is_empty()) {
        return 0;
    }
    j.dirty = false;
    let (key, text) = (j.key, j.text.clone());
    if !model.json_current(key) {
        return 0;
    }
    for dir in 0..model.dirs.len() {
        if model.dirs[dir].metadata != MMetadata::Removed && model.dirs[dir].metadata_key == key {
            model.set_metadata(dir, &text, false);
            return match model.dirs[dir].metadata {
                MMetadata::Invalid(_) => invalid,
                _ => 0,
            };
        }
        let owner = model.dirs[dir]
            .entries
            .iter()
            .find(|(_, e)| e.meta != MMeta::None && e.meta_key == key)
            .map(|(n, _)| n.clone());
        if let Some(name) = owner {
            model.set_meta(dir, &name, &text, false);
            return match model.entry(dir, &name).unwrap().meta {
                MMeta::Invalid(_) => invalid,
                _ => 0,
            };
        }
    }
    unreachable!()
}

/// Closes a model handle: flush, then release. Returns the flush's errno.
pub(super) fn model_close(model: &mut Model, k: usize) -> (i32, i32) {
    match model.handles[k].take() {
        Some(MHandle::Json {
            file, write: true, ..
        }) => {
            let flush = model_apply_json(model, file, false, None);
            let release = model_apply_json(model, file, true, None);
            forget_json(model, file);
            (flush, release)
        }
        Some(MHandle::Json { file, .. }) => {
            forget_json(model, file);
            (0, 0)
        }
        _ => (0, 0),
    }
}

/// Drops an open JSON file no descriptor holds any more.
pub(super) fn forget_json(model: &mut Model, file: u64) {
    let held = model
        .handles
        .iter()
        .any(|h| matches!(h, Some(MHandle::Json { file: f, .. }) if *f == file));
    if !held {
        let key = model.json.remove(&file).unwrap().key;
        if model.json_by_key.get(&key) == Some(&file) {
            model.json_by_key.remove(&key);
        }
    }
}

pub(super) fn writes(op: &Op) -> bool {
    matches!(
        op,
        Op::Create { .. }
            | Op::Write { .. }
            | Op::Truncate { .. }
            | Op::WriteJson { .. }
            | Op::SetMeta { .. }
            | Op::SetMetadata { .. }
            | Op::Unlink(_)
            | Op::Rename { .. }
            | Op::Open { write: true, .. }
            | Op::HandleWrite(..)
            | Op::HandleSetText(..)
    )
}

/// Runs one operation on both sides and compares their results.
pub(super) fn apply(m: &mut Mounted, model: &mut Model, op: &Op) {
    if m.read_only && writes(op) {
        return apply_read_only(m, model, op);
    }
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
                true,
                *exclusive,
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
                .create(m.dir_ino(dir), &Mounted::file_name(&f), true, false)
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
                    .create(m.dir_ino(dir), "__metadata__.json", true, false)
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
                match f.part {
                    Part::Data => model.entry_mut(f.dir, n).data = None,
                    Part::Meta => {
                        let e = model.entry_mut(f.dir, n);
                        e.meta = MMeta::None;
                        e.hidden = false;
                    }
                    Part::Metadata => {
                        model.dirs[f.dir].metadata = MMetadata::Removed;
                        model.dirs[f.dir].metadata_touched = true;
                    }
                }
                model.prune(f.dir, n);
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
                },
            });
        }
        Op::HandleRead(k, offset, size) => {
            let Some(h) = model.handles[*k].clone() else {
                return;
            };
            let (fh, ino, want) = match h {
                MHandle::Data { fh, obj, ino, .. } => {
                    if model.unreadable(obj) && *offset < model.objects[&obj].bytes.len() as u64 {
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
        Op::HandleWrite(k, offset, data) => match model.handles[*k].clone() {
            Some(MHandle::Data {
                fh,
                obj,
                ino,
                write: true,
                ..
            }) => {
                let got = fs.write(ino, fh, *offset, data);
                if model.copy_fails(obj, u64::MAX) {
                    assert_eq!(errno(got), libc::EIO, "{op:?}");
                    return;
                }
                got.unwrap();
                model.write(obj, *offset, data);
                model.edited(obj);
            }
            Some(MHandle::Json {
                fh,
                file,
                ino,
                write: true,
                ..
            }) => {
                fs.write(ino, fh, *offset, data).unwrap();
                let j = model.json.get_mut(&file).unwrap();
                j.write_at(*offset as usize, data);
            }
            _ => {}
        },
        Op::HandleSetText(k, text) => {
            // ftruncate(0) through the descriptor, then a write at 0.
            match model.handles[*k].clone() {
                Some(MHandle::Data {
                    fh,
                    obj,
                    ino,
                    write: true,
                    ..
                }) => {
                    fs.set_size(ino, Some(fh), 0).unwrap();
                    model.truncate(obj, 0);
                    model.edited(obj);
                }
                Some(MHandle::Json {
                    fh,
                    file,
                    ino,
                    write: true,
                    ..
                }) => {
                    fs.set_size(ino, Some(fh), 0).unwrap();
                    let j = model.json.get_mut(&file).unwrap();
                    j.text.clear();
                    j.dirty = true;
                    j.written = true;
                }
                _ => return,
            }
            apply(m, model, &Op::HandleWrite(*k, 0, text.bytes()));
        }
        Op::Fstat(k) => {
            let Some(h) = model.handles[*k].clone() else {
                return;
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
            let a = fs.getattr(ino, None).unwrap();
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
        Op::Commit { force, other_user } => commit(m, model, *force, *other_user, false),
        Op::CompactCommit => commit(m, model, false, false, true),
        Op::Discard => discard(m, model),
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
            let (report, refused) = fs.status();
            assert_eq!(refused, model.problems(), "{report}");
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
                            None => l.to_string(),
                        }
                    })
                    .collect();
                // The commit's way (in place or a rewrite, and why) is the
                // integration tests' to check; here: said exactly when a
                // commit would go ahead.
                let ways = got.iter().filter(|l| l.starts_with("commit     ")).count();
                let would_commit = model.dirs[dir].dirty
                    && model.problem_count(dir) == 0
                    && !model.status_lines(dir).is_empty();
                assert_eq!(
                    ways, would_commit as usize,
                    "the commit line of shard {dir}: {report}"
                );
                got.retain(|l| !l.starts_with("commit     "));
                let mut want = model.status_lines(dir);
                got.sort();
                want.sort();
                assert_eq!(got, want, "status of shard {dir}: {report}");
            }
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
            let want = match k.and_then(|k| model.handles[k].clone()) {
                Some(MHandle::Json {
                    file, write: true, ..
                }) => model_apply_json(model, file, false, *k),
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
        Op::Remount => remount(m, model),
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
    let flush = model_apply_json(model, file, false, None);
    assert_eq!(
        errno(m.fs().flush(fh)),
        flush,
        "{op:?}: close reports a JSON file kept but not valid"
    );
    let release = model_apply_json(model, file, true, None);
    assert_eq!(errno(m.fs().release(fh)), release, "{op:?}: release");
    forget_json(model, file);
}

pub(super) fn apply_read_only(m: &Mounted, model: &mut Model, op: &Op) {
    let fs = m.fs();
    let got = match op {
        Op::Create { dir, name, .. } => errno(fs.create(
            m.dir_ino(*dir),
            &Mounted::file_name(&data(*dir, *name)),
            true,
            false,
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
            true,
            false,
        )),
        Op::SetMetadata { dir, .. } => {
            errno(fs.create(m.dir_ino(*dir), "__metadata__.json", true, false))
        }
        Op::Unlink(f) => errno(fs.unlink(m.dir_ino(f.dir), &Mounted::file_name(f))),
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
                    match from.part {
                        Part::Data => model.entry_mut(from.dir, fname).data = None,
                        Part::Meta => {
                            let e = model.entry_mut(from.dir, fname);
                            e.meta = MMeta::None;
                            e.hidden = false;
                        }
                        Part::Metadata => {
                            model.dirs[from.dir].metadata = MMetadata::Removed;
                            model.dirs[from.dir].metadata_touched = true;
                        }
                    }
                    model.prune(from.dir, fname);
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
    let must_be_in_place: Vec<bool> = (0..model.dirs.len())
        .map(|dir| inserts && !compact && !m.read_only && model.header_only(dir))
        .collect();
    let caller = if other_user { OTHER_USER } else { 0 };
    let options = stfs::checkpoint::commit::CommitOptions { force, compact };
    let got = m.fs().commit(options, caller);
    // (`--compact` rewrites a clean shard too.)
    let dirty: Vec<bool> = model.dirs.iter().map(|d| d.dirty || compact).collect();
    // Bytes a commit must read from a source rewritten in place.
    let unreadable = model.dirs.iter().enumerate().any(|(k, d)| {
        dirty[k] && d.entries.values().any(|e| {
            matches!((&e.meta, e.data, e.hidden), (MMeta::Valid(..), Some(o), false) if model.unreadable(o))
        })
    });
    let want = if other_user {
        libc::EACCES
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
            let expected = model.serialized(dir);
            let got = std::fs::read(&model.dirs[dir].path).unwrap();
            if compact {
                assert_eq!(
                    got, expected,
                    "shard {dir}: committed file (--compact) differs from the reference serialization of the model"
                );
            } else {
                assert_same_checkpoint(&got, &expected, dir);
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
    m.fs = Some(mount(m.dir.path(), m.folder, m.read_only));
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
        if model.problem_count(dir) == 0 && readable {
            let top = if model.folder { ROOT_INO } else { dino };
            let views = fs.lookup(top, "__views__").unwrap();
            let name = if model.folder {
                format!("s{dir}.safetensors")
            } else {
                "model.safetensors".into()
            };
            let view = fs.lookup(views.ino, &name).unwrap();
            let want = model.serialized(dir);
            assert_eq!(
                view.size,
                want.len() as u64,
                "the export view's size after {after:?}"
            );
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
            assert!(
                got == want,
                "the export view differs from the model's state after {after:?}"
            );
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
                let (MMeta::Valid(..), Some(o), false) = (&e.meta, e.data, e.hidden) else {
                    continue;
                };
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
    let want = model.content(f);
    if f.part != Part::Data {
        // `cat` opens the file as any reader does.
        let file = model_open_json(model, f, false);
        forget_json(model, file);
    }
    match m.cat(ino) {
        Err(e) => assert!(
            unreadable && e == libc::EIO,
            "{what}: read failed with errno {e}"
        ),
        Ok(got) => {
            assert!(!unreadable, "{what}: read a source rewritten in place");
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

pub(super) fn run_with(folder: bool, read_only: bool, ops: &[Op]) {
    let (mut m, mut model) = setup(folder, read_only);
    check(&m, &mut model, &Op::Status, 0);
    for (step, op) in ops.iter().enumerate() {
        apply(&mut m, &mut model, op);
        check(&m, &mut model, op, step);
    }
    for k in 0..MAX_HANDLES {
        apply(&mut m, &mut model, &Op::Close(k));
    }
    // The unmount's policy: commit what is valid; keep edits it cannot commit.
    let dirty = model.dirs.iter().any(|d| d.dirty);
    let unreadable = model.dirs.iter().any(|d| {
        d.dirty
            && d.entries.values().any(
                |e| matches!((&e.meta, e.data, e.hidden), (MMeta::Valid(..), Some(o), false) if model.unreadable(o)),
            )
    });
    let refused = dirty
        && (model.problems() || model.dirs.iter().any(|d| d.dirty && d.replaced) || unreadable);
    let result = m.fs().unmount();
    assert_eq!(result.is_err(), refused, "unmount: {result:?}");
    for dir in 0..model.dirs.len() {
        let got = std::fs::read(&model.dirs[dir].path).unwrap();
        if model.dirs[dir].dirty && !refused {
            assert_same_checkpoint(&got, &model.serialized(dir), dir);
        } else {
            assert_eq!(got, model.dirs[dir].disk, "shard {dir} after unmount");
        }
    }
}

pub(super) fn run(folder: bool, ops: &[Op]) {
    run_with(folder, false, ops)
}

/// The inode of a data file and the model's object behind it, if the
/// model says the file exists (and the filesystem must agree).
pub(super) fn data_file(
    m: &Mounted,
    model: &Model,
    dir: usize,
    name: usize,
    op: &Op,
) -> Option<(Ino, ObjId)> {
    let o = model.entry(dir, NAMES[name]).and_then(|e| e.data);
    let ino = m.lookup(&data(dir, name));
    assert_eq!(ino.is_some(), o.is_some(), "{op:?}");
    Some((ino?, o?))
}

pub(super) fn data(dir: usize, name: usize) -> FileRef {
    FileRef {
        dir,
        name,
        part: Part::Data,
    }
}

pub(super) fn meta(dir: usize, name: usize) -> FileRef {
    FileRef {
        dir,
        name,
        part: Part::Meta,
    }
}

pub(super) fn metadata(dir: usize) -> FileRef {
    FileRef {
        dir,
        name: 0,
        part: Part::Metadata,
    }
}

/// The checkpoint a set of tensors makes, as the reference reads it.
pub(super) fn tensors_of(bytes: &[u8]) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                (
                    format!("{:?}", v.dtype()),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                ),
            )
        })
        .collect()
}

/// The files a copy of a checkpoint makes: each tensor's data and meta.
pub(super) fn copy_set(tensors: &[Tensor]) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    for (name, d, bytes, shape) in tensors {
        files.push((TensorFile::Data.file_name(name), bytes.clone()));
        files.push((
            TensorFile::Meta.file_name(name),
            Text::Meta(*d, shape.to_vec()).bytes(),
        ));
    }
    files
}

pub(super) fn empty_mount() -> (tempfile::TempDir, Fs) {
    let dir = tempfile::tempdir().unwrap();
    write_file(&dir.path().join("s0.safetensors"), &[]);
    let fs = mount(dir.path(), false, false);
    (dir, fs)
}

pub(super) fn copied() -> Vec<Tensor<'static>> {
    vec![
        ("a", 0, vec![1, 2, 3, 4, 5, 6, 7], &[7]),
        ("b", 1, vec![9, 8], &[]),
        ("c/d", 3, vec![4, 2, 4, 2], &[2]),
    ]
}
