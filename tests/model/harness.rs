//! The filesystem side: a mount in-process, each operation applied to it
//! and to the model, and the checks that they agree.

use super::*;
use stfs::errno::ToErrno;

pub(super) struct Mounted {
    pub(super) fs: Option<Fs>,
    pub(super) folder: bool,
    pub(super) read_only: bool,
    pub(super) gguf: bool,
    pub(super) dir: tempfile::TempDir,
}

impl Mounted {
    pub(super) fn fs(&self) -> &Fs {
        self.fs.as_ref().unwrap()
    }

    /// A GGUF file mount's `__kv__`.
    pub(super) fn kv_dir(&self) -> Ino {
        self.fs().lookup(ROOT_INO, "__kv__").unwrap().ino
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
                // (Odd sizes: reads start and end anywhere in a block.)
                .read(
                    ino,
                    o.fh,
                    out.len() as u64,
                    if out.len() < 64 { 5 } else { 1031 },
                    |b| b.concat(),
                ) {
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
pub(super) fn open_sources(
    dir: &Path,
    count: usize,
    writable: bool,
    ext: &str,
) -> Vec<(String, SourceFile)> {
    (0..count)
        .map(|k| {
            let path = dir.join(format!("s{k}.{ext}"));
            (
                format!("s{k}"),
                SourceFile::open_with(&path, writable).unwrap(),
            )
        })
        .collect()
}

/// Mounts the sources in `dir` (`s0.gguf` when `gguf`), taking back the
/// edits a killed daemon left.
pub(super) fn mount(dir: &Path, folder: bool, read_only: bool) -> Fs {
    mount_of(dir, folder, read_only, false)
}

pub(super) fn mount_of(dir: &Path, folder: bool, read_only: bool, gguf: bool) -> Fs {
    let base = Arc::new(Folder::open(dir).unwrap());
    recover::finish_renames(&base, "m").unwrap();
    let staging = Arc::new(Staging::new(base.clone(), "m"));
    let ext = if gguf { "gguf" } else { "safetensors" };
    let mut sources = open_sources(dir, if folder { 2 } else { 1 }, !read_only, ext);
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
                remote: None,
            }],
            model_files: Vec::new(),
            not_shown: Vec::new(),
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

/// A mount of one or two safetensors files, or (`gguf`) of one GGUF file.
pub(super) fn setup_of(folder: bool, read_only: bool, gguf: bool) -> (Mounted, Model) {
    assert!(!(gguf && folder), "GGUF runs mount one file");
    let dir = tempfile::tempdir().unwrap();
    let mut initial: Vec<Vec<Tensor>> = vec![
        vec![
            ("a", 0, vec![1, 2, 3], &[3]),
            ("b", 1, big_bytes(), &[BIG / 2]),
        ],
        vec![
            ("x.meta.json", 2, vec![5, 5, 5, 5], &[1]),
            ("c/d", 0, vec![4, 2], &[2]),
        ],
    ];
    if gguf {
        initial[0] = source_tensors();
    }
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
        gguf: None,
    };
    if gguf {
        model.gguf = Some(GState::new(&mut model.next));
    }
    for (k, tensors) in initial.into_iter().take(count).enumerate() {
        let (path, disk) = if gguf {
            let path = dir.path().join(format!("s{k}.gguf"));
            let disk = Model::write_gguf_source(&path, &tensors);
            (path, disk)
        } else {
            let path = dir.path().join(format!("s{k}.safetensors"));
            let disk = write_file(&path, &tensors);
            (path, disk)
        };
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
    let fs = mount_of(dir.path(), folder, read_only, gguf);
    (
        Mounted {
            fs: Some(fs),
            folder,
            read_only,
            gguf,
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
/// handle `except`; `pending`: it wrote since its last flush): what was
/// written goes to the name if the file is still there. Returns the errno
/// expected.
pub(super) fn model_apply_json(
    model: &mut Model,
    file: u64,
    last: bool,
    pending: &mut bool,
    except: Option<usize>,
) -> i32 {
    let writer = |k: usize, h: &Option<MHandle>, pending_only: bool| {
        Some(k) != except
            && matches!(h, Some(MHandle::Json { file: f, write: true, pending: p, .. })
                if *f == file && (*p || !pending_only))
    };
    let writing = model
        .handles
        .iter()
        .enumerate()
        .any(|(k, h)| writer(k, h, true));
    let open_writers = model
        .handles
        .iter()
        .enumerate()
        .any(|(k, h)| writer(k, h, false));
    // A descriptor that wrote nothing since its flush applies only as the
    // last writer; text that does not parse is the closer's to hear of only
    // when no other writer may be half-way through writing it.
    if !*pending && (!last || open_writers) {
        return 0;
    }
    let invalid = if writing { 0 } else { libc::EINVAL };
    *pending = false;
    let j = model.json.get_mut(&file).unwrap();
    if j.dirty && !last && j.text.is_empty() {
        return 0;
    }
    if !j.dirty {
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
            file,
            write: true,
            mut pending,
            ..
        }) => {
            let flush = model_apply_json(model, file, false, &mut pending, None);
            let release = model_apply_json(model, file, true, &mut pending, None);
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

/// An edit made by a name (a tensor's or meta's file), not a descriptor.
pub(super) fn edits_a_name(op: &Op) -> bool {
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
    )
}

pub(super) fn writes(op: &Op) -> bool {
    edits_a_name(op)
        || matches!(
            op,
            Op::Open { write: true, .. }
                | Op::HandleWrite(..)
                | Op::HandleSetText(..)
                | Op::KvWrite { .. }
                | Op::KvUnlink(_)
                | Op::KvRename { .. }
                | Op::KvDocument(_)
        )
}

pub(super) fn run_with(folder: bool, read_only: bool, ops: &[Op]) {
    run_of(folder, read_only, false, ops)
}

/// A run on a GGUF source (a file mount).
pub(super) fn run_gguf(read_only: bool, ops: &[Op]) {
    run_of(false, read_only, true, ops)
}

pub(super) fn run_of(folder: bool, read_only: bool, gguf: bool, ops: &[Op]) {
    let (mut m, mut model) = setup_of(folder, read_only, gguf);
    check(&m, &mut model, &Op::Status, 0);
    for (step, op) in ops.iter().enumerate() {
        apply(&mut m, &mut model, op);
        check(&m, &mut model, op, step);
    }
    for k in 0..MAX_HANDLES {
        apply(&mut m, &mut model, &Op::Close(k));
    }
    // The unmount's policy: commit what is valid; keep edits it cannot
    // commit. (Edits that undid each other leave nothing to commit.)
    let changed: Vec<bool> = (0..model.dirs.len())
        .map(|k| model.dirs[k].dirty && model.net_changed(k))
        .collect();
    let dirty = changed.iter().any(|&c| c);
    let unreadable = model.dirs.iter().zip(&changed).enumerate().any(|(k, (d, &c))| {
        c && (model.keys_unreadable(k)
            || d.entries.values().any(
                |e| matches!((&e.meta, e.data, e.hidden), (MMeta::Valid(..), Some(o), false) if model.unreadable(o)),
            ))
    });
    let refused = dirty
        && (model.problems()
            || model
                .dirs
                .iter()
                .zip(&changed)
                .any(|(d, &c)| c && d.replaced)
            || unreadable);
    let result = m.fs().unmount();
    assert_eq!(result.is_err(), refused, "unmount: {result:?}");
    for (dir, &changed) in changed.iter().enumerate() {
        let got = std::fs::read(&model.dirs[dir].path).unwrap();
        if changed && !refused && gguf {
            model.assert_same_gguf(&got, dir, false, "the file after unmount");
        } else if changed && !refused {
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
