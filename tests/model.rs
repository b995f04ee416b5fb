//! Reference-model property test of the filesystem logic, without a mount
//! (after mountpoint-s3's `tests/reftests`): random sequences of operations
//! run both against `Fs` and against a plain model of the documented file
//! model (docs/SEMANTICS.md, "Editing"), in a file mount or a folder mount of
//! two shards. The model alone decides every expected result, errno
//! included; it is never asked of the filesystem whether an operation would
//! work. After every operation the listing (names and inodes), a lookup of
//! every name, every file's content and the open handles are compared with
//! the model, and inode numbers must stay stable for a file's life and never
//! be given to another file. After every commit each source file must equal
//! the reference `safetensors` serialization of the model.
//!
//! Shown to catch (each applied by hand to the code, then reverted):
//! - RENAME_NOREPLACE ignored (`Fs::rename`);
//! - a handle of a removed tensor not reading it (`Fs::read` taking the
//!   bytes from the state instead of the handle's object);
//! - a wrong shape in a generated `.meta.json` (`meta::render_meta`);
//! - wrong readdir names for created tensors (`Fs::readdir`);
//! - the ESTALE check disabled (`Live::plan`, source replaced behind the mount);
//! - a name's meta dropped when its bytes are replaced (`Live::put_data`);
//! - no zero-fill of a tensor created by its meta (`Live::set_meta`);
//! - discard giving unedited tensors new inodes (`Live::discard`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use stfs::checkpoint::staging::Staging;
use stfs::format::{byte_len, layout, Dtype, Metadata, TensorSpec};
use stfs::fs::{Fs, IndexFile, Ino, Settings, Source, TensorFile, ROOT_INO};
use stfs::source::local::Folder;
use stfs::source::{FileStat, SourceFile};

const NAMES: [&str; 5] = ["a", "b", "c/d", "x.meta.json", ""];
const DTYPES: [Dtype; 4] = [Dtype::U8, Dtype::I16, Dtype::F32, Dtype::BF16];
const MAX_HANDLES: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Data,
    Meta,
    Metadata,
}

/// A file of a checkpoint directory: (dir, name, part).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileRef {
    dir: usize,
    name: usize,
    part: Part,
}

/// What is written to a JSON file.
#[derive(Debug, Clone)]
enum Text {
    Meta(Dtype, Vec<u64>),
    BadDtype,
    NotJson,
    Metadata(Option<(String, String)>),
    BadMetadata,
}

impl Text {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Text::Meta(d, s) => serde_json::json!({"dtype": d.name(), "shape": s}).to_string(),
            Text::BadDtype => r#"{"dtype":"f32","shape":[1]}"#.to_string(),
            Text::NotJson => "not json".to_string(),
            Text::Metadata(kv) => {
                let m: Metadata = kv.iter().cloned().collect();
                serde_json::to_string(&m).unwrap()
            }
            Text::BadMetadata => r#"{"k":1}"#.to_string(),
        }
        .into_bytes()
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// open(O_CREAT|O_TRUNC) of a data file.
    Create {
        dir: usize,
        name: usize,
        exclusive: bool,
    },
    Write {
        dir: usize,
        name: usize,
        offset: u64,
        data: Vec<u8>,
    },
    Truncate {
        dir: usize,
        name: usize,
        len: u64,
    },
    /// A data file holding JSON (a tool's temp file).
    WriteJson {
        dir: usize,
        name: usize,
        text: Text,
    },
    SetMeta {
        dir: usize,
        name: usize,
        text: Text,
    },
    SetMetadata {
        dir: usize,
        text: Text,
    },
    Unlink(FileRef),
    Rename {
        from: FileRef,
        to: FileRef,
        no_replace: bool,
    },
    Open {
        dir: usize,
        name: usize,
    },
    HandleRead(usize),
    HandleWrite(usize, u64, Vec<u8>),
    Close(usize),
    Commit {
        force: bool,
    },
    Discard,
    /// Another program replaces the source file behind the mount.
    ReplaceSource(usize),
    Status,
    /// fsync of a handle, or of the directories: durable, never a commit.
    Fsync(Option<usize>),
}

fn meta_text() -> impl Strategy<Value = Text> {
    prop_oneof![
        4 => (0..DTYPES.len(), prop::collection::vec(0u64..4, 0..3))
            .prop_map(|(d, s)| Text::Meta(DTYPES[d], s)),
        1 => Just(Text::BadDtype),
        1 => Just(Text::NotJson),
    ]
}

fn metadata_text() -> impl Strategy<Value = Text> {
    prop_oneof![
        3 => prop::option::of(("[a-z]{1,3}", "[a-z]{0,3}")).prop_map(Text::Metadata),
        1 => Just(Text::BadMetadata),
    ]
}

fn file_ref(dirs: usize) -> impl Strategy<Value = FileRef> {
    (0..dirs, 0..NAMES.len(), 0..7u8).prop_map(|(dir, name, p)| FileRef {
        dir,
        name,
        part: match p {
            0..=3 => Part::Data,
            4..=5 => Part::Meta,
            _ => Part::Metadata,
        },
    })
}

fn op(dirs: usize) -> impl Strategy<Value = Op> {
    let d = 0..dirs;
    let n = 0..NAMES.len();
    let bytes = prop::collection::vec(any::<u8>(), 1..12);
    prop_oneof![
        3 => (d.clone(), n.clone(), any::<bool>())
            .prop_map(|(dir, name, exclusive)| Op::Create { dir, name, exclusive }),
        3 => (d.clone(), n.clone(), 0u64..16, bytes.clone())
            .prop_map(|(dir, name, offset, data)| Op::Write { dir, name, offset, data }),
        2 => (d.clone(), n.clone(), 0u64..16).prop_map(|(dir, name, len)| Op::Truncate { dir, name, len }),
        2 => (d.clone(), n.clone(), prop_oneof![meta_text(), metadata_text()])
            .prop_map(|(dir, name, text)| Op::WriteJson { dir, name, text }),
        4 => (d.clone(), n.clone(), meta_text()).prop_map(|(dir, name, text)| Op::SetMeta { dir, name, text }),
        1 => (d.clone(), metadata_text()).prop_map(|(dir, text)| Op::SetMetadata { dir, text }),
        3 => file_ref(dirs).prop_map(Op::Unlink),
        5 => (file_ref(dirs), file_ref(dirs), any::<bool>())
            .prop_map(|(from, to, no_replace)| Op::Rename { from, to, no_replace }),
        2 => (d.clone(), n.clone()).prop_map(|(dir, name)| Op::Open { dir, name }),
        2 => (0..MAX_HANDLES).prop_map(Op::HandleRead),
        2 => (0..MAX_HANDLES, 0u64..8, bytes).prop_map(|(h, o, b)| Op::HandleWrite(h, o, b)),
        1 => (0..MAX_HANDLES).prop_map(Op::Close),
        3 => any::<bool>().prop_map(|force| Op::Commit { force }),
        1 => Just(Op::Discard),
        1 => d.prop_map(Op::ReplaceSource),
        1 => Just(Op::Status),
        1 => prop::option::of(0..MAX_HANDLES).prop_map(Op::Fsync),
    ]
}

// ---- the model ----

type ObjId = u64;

#[derive(Debug, Clone, PartialEq)]
enum MMeta {
    None,
    Valid(Dtype, Vec<u64>),
    Invalid(Vec<u8>),
}

impl MMeta {
    fn parse(text: &[u8]) -> MMeta {
        match stfs::checkpoint::Meta::parse(text) {
            stfs::checkpoint::Meta::Valid { dtype, shape } => MMeta::Valid(dtype, shape),
            _ => MMeta::Invalid(text.to_vec()),
        }
    }

    /// Written and not an empty pending file.
    fn counts(&self) -> bool {
        !matches!(self, MMeta::None) && *self != MMeta::Invalid(vec![])
    }
}

#[derive(Debug, Clone, PartialEq)]
enum MMetadata {
    Valid(Option<Metadata>),
    Invalid(Vec<u8>),
    Removed,
}

impl MMetadata {
    fn parse(text: &[u8]) -> MMetadata {
        match stfs::checkpoint::meta::parse_metadata(text) {
            Ok(m) => MMetadata::Valid(m),
            Err(_) => MMetadata::Invalid(text.to_vec()),
        }
    }

    fn text(&self) -> Option<Vec<u8>> {
        match self {
            MMetadata::Valid(m) => Some(stfs::checkpoint::meta::render_metadata(m.as_ref())),
            MMetadata::Invalid(t) => Some(t.clone()),
            MMetadata::Removed => None,
        }
    }
}

#[derive(Debug, Clone)]
struct MObject {
    bytes: Vec<u8>,
    /// Written or cut since the last commit or discard.
    edited: bool,
    /// Identity of its inode: changes when it moves to another directory.
    ino_key: u64,
    /// Moved to another directory since the last commit or discard.
    moved_away: bool,
}

#[derive(Debug, Clone)]
struct MEntry {
    data: Option<ObjId>,
    meta: MMeta,
    /// Identity of its `.meta.json` inode.
    eid: u64,
}

/// A committed tensor: dtype, shape, object, entry identity, bytes.
type CommittedTensor = (Dtype, Vec<u64>, ObjId, u64, Vec<u8>);

#[derive(Debug, Clone)]
struct Committed {
    tensors: BTreeMap<String, CommittedTensor>,
    metadata: Option<Metadata>,
}

struct MDir {
    path: PathBuf,
    entries: BTreeMap<String, MEntry>,
    metadata: MMetadata,
    committed: Committed,
    /// Edits since the last commit or discard (a commit rewrites the file).
    dirty: bool,
    /// The source was replaced behind the mount.
    replaced: bool,
    /// What the file on disk must be.
    disk: Vec<u8>,
}

struct Model {
    dirs: Vec<MDir>,
    objects: HashMap<ObjId, MObject>,
    next: u64,
    /// Open handles: (fh, object).
    handles: [Option<(u64, ObjId, Ino)>; MAX_HANDLES],
    /// Inode identities seen: key -> ino, and ino -> key (never reused).
    ino_of: HashMap<u64, Ino>,
    key_of: HashMap<Ino, u64>,
}

fn fresh(next: &mut u64) -> u64 {
    *next += 1;
    *next
}

impl Model {
    fn new_object(&mut self, bytes: Vec<u8>) -> ObjId {
        let id = fresh(&mut self.next);
        let ino_key = fresh(&mut self.next);
        self.objects.insert(
            id,
            MObject {
                bytes,
                edited: true,
                ino_key,
                moved_away: false,
            },
        );
        id
    }

    fn entry(&self, dir: usize, name: &str) -> Option<&MEntry> {
        self.dirs[dir].entries.get(name)
    }

    /// The entry of `name`, made if there is none.
    fn entry_mut(&mut self, dir: usize, name: &str) -> &mut MEntry {
        if !self.dirs[dir].entries.contains_key(name) {
            let eid = fresh(&mut self.next);
            self.dirs[dir].entries.insert(
                name.to_string(),
                MEntry {
                    data: None,
                    meta: MMeta::None,
                    eid,
                },
            );
        }
        self.dirs[dir].entries.get_mut(name).unwrap()
    }

    fn prune(&mut self, dir: usize, name: &str) {
        if let Some(e) = self.dirs[dir].entries.get(name) {
            if e.data.is_none() && e.meta == MMeta::None {
                self.dirs[dir].entries.remove(name);
            }
        }
    }

    fn exists(&self, f: &FileRef) -> bool {
        let name = NAMES[f.name];
        match f.part {
            Part::Data => self.entry(f.dir, name).is_some_and(|e| e.data.is_some()),
            Part::Meta => self
                .entry(f.dir, name)
                .is_some_and(|e| e.meta != MMeta::None),
            Part::Metadata => self.dirs[f.dir].metadata != MMetadata::Removed,
        }
    }

    /// Applies a meta's text to `name` (docs: a meta of a name without data
    /// creates it zero-filled; so does one that gives an empty, meta-less file its size).
    fn set_meta(&mut self, dir: usize, name: &str, text: &[u8]) {
        let meta = MMeta::parse(text);
        let e = self.entry_mut(dir, name);
        let had = e.meta.counts();
        e.meta = meta.clone();
        let data = e.data;
        if let MMeta::Valid(d, s) = &meta {
            let n = byte_len(*d, s).unwrap() as usize;
            match data {
                None => {
                    let o = self.new_object(vec![0; n]);
                    self.entry_mut(dir, name).data = Some(o);
                }
                Some(o) if !had && self.objects[&o].bytes.is_empty() => {
                    let obj = self.objects.get_mut(&o).unwrap();
                    obj.bytes = vec![0; n];
                    obj.edited = true;
                }
                Some(_) => {}
            }
        }
        self.dirs[dir].dirty = true;
    }

    fn truncate(&mut self, o: ObjId, len: u64) {
        let obj = self.objects.get_mut(&o).unwrap();
        if len == 0 || len as usize != obj.bytes.len() {
            obj.bytes.resize(len as usize, 0);
            obj.edited = true;
        }
    }

    fn write(&mut self, o: ObjId, offset: u64, data: &[u8]) {
        let obj = self.objects.get_mut(&o).unwrap();
        let end = offset as usize + data.len();
        if obj.bytes.len() < end {
            obj.bytes.resize(end, 0);
        }
        obj.bytes[offset as usize..end].copy_from_slice(data);
        obj.edited = true;
    }

    /// The directory whose entry holds object `o`.
    fn holder(&self, o: ObjId) -> Option<usize> {
        self.dirs
            .iter()
            .position(|d| d.entries.values().any(|e| e.data == Some(o)))
    }

    fn problems(&self) -> bool {
        self.dirs.iter().any(|d| {
            matches!(d.metadata, MMetadata::Invalid(_))
                || d.entries.values().any(|e| match (&e.meta, e.data) {
                    (MMeta::Invalid(_), _) => true,
                    (MMeta::None, Some(_)) => true,
                    (MMeta::Valid(dt, s), Some(o)) => {
                        byte_len(*dt, s).unwrap() != self.objects[&o].bytes.len() as u64
                    }
                    (_, None) => false,
                })
        })
    }

    /// The reference crate's serialization of a directory.
    fn serialized(&self, dir: usize) -> Vec<u8> {
        let d = &self.dirs[dir];
        let mut views = Vec::new();
        for (name, e) in &d.entries {
            if let (MMeta::Valid(dt, s), Some(o)) = (&e.meta, e.data) {
                let dtype: safetensors::Dtype = serde_json::from_str(&format!("\"{dt}\"")).unwrap();
                let shape: Vec<usize> = s.iter().map(|&x| x as usize).collect();
                views.push((
                    name.clone(),
                    safetensors::tensor::TensorView::new(dtype, shape, &self.objects[&o].bytes)
                        .unwrap(),
                ));
            }
        }
        let metadata = match &d.metadata {
            MMetadata::Valid(m) => m.clone(),
            _ => None,
        };
        let meta: Option<HashMap<String, String>> = metadata.map(|m| m.into_iter().collect());
        safetensors::serialize(views, meta).unwrap()
    }

    /// After a commit: what was written is what the directory now is.
    fn committed(&mut self, dir: usize) {
        let objects = &self.objects;
        let d = &mut self.dirs[dir];
        // A meta without data is not a tensor: the commit drops it.
        d.entries.retain(|_, e| e.data.is_some());
        if d.metadata == MMetadata::Removed {
            d.metadata = MMetadata::Valid(None);
        }
        let mut tensors = BTreeMap::new();
        for (name, e) in &d.entries {
            if let (MMeta::Valid(dt, s), Some(o)) = (&e.meta, e.data) {
                let bytes = objects[&o].bytes.clone();
                tensors.insert(name.clone(), (*dt, s.clone(), o, e.eid, bytes));
            }
        }
        let metadata = match &d.metadata {
            MMetadata::Valid(m) => m.clone(),
            _ => None,
        };
        d.committed = Committed { tensors, metadata };
        d.dirty = false;
        d.replaced = false;
    }
}

// ---- the filesystem side ----

struct Mounted {
    fs: Fs,
    folder: bool,
    _dir: tempfile::TempDir,
}

impl Mounted {
    fn dir_ino(&self, dir: usize) -> Ino {
        if self.folder {
            self.fs.lookup(ROOT_INO, &format!("s{dir}")).unwrap().ino
        } else {
            ROOT_INO
        }
    }

    fn file_name(f: &FileRef) -> String {
        match f.part {
            Part::Data => TensorFile::Data.file_name(NAMES[f.name]),
            Part::Meta => TensorFile::Meta.file_name(NAMES[f.name]),
            Part::Metadata => "__metadata__.json".into(),
        }
    }

    fn lookup(&self, f: &FileRef) -> Option<Ino> {
        self.fs
            .lookup(self.dir_ino(f.dir), &Self::file_name(f))
            .ok()
            .map(|a| a.ino)
    }

    fn cat(&self, ino: Ino) -> Vec<u8> {
        let o = self.fs.open(ino, false, false).unwrap();
        let data = self.fs.read(ino, o.fh, 0, 1 << 20, |b| b.concat()).unwrap();
        self.fs.release(o.fh).unwrap();
        data
    }
}

/// name, dtype, bytes, shape
type Tensor<'a> = (&'a str, Dtype, Vec<u8>, &'a [u64]);

fn write_file(path: &Path, tensors: &[Tensor]) -> Vec<u8> {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, d, _, s)| TensorSpec {
            name: n.to_string(),
            dtype: *d,
            shape: s.to_vec(),
        })
        .collect();
    let l = layout(&specs, None).unwrap();
    let mut bytes = l.header.clone();
    for &i in &l.source_index {
        bytes.extend_from_slice(&tensors[i].2);
    }
    std::fs::write(path, &bytes).unwrap();
    bytes
}

fn setup(folder: bool) -> (Mounted, Model) {
    let dir = tempfile::tempdir().unwrap();
    let initial: Vec<Vec<Tensor>> = vec![
        vec![
            ("a", Dtype::U8, vec![1, 2, 3], &[3]),
            ("b", Dtype::I16, vec![9, 8, 7, 6], &[2]),
        ],
        vec![
            ("b", Dtype::F32, vec![5, 5, 5, 5], &[1]),
            ("c/d", Dtype::U8, vec![4, 2], &[2]),
        ],
    ];
    let count = if folder { 2 } else { 1 };
    let mut model = Model {
        dirs: Vec::new(),
        objects: HashMap::new(),
        next: 0,
        handles: [None; MAX_HANDLES],
        ino_of: HashMap::new(),
        key_of: HashMap::new(),
    };
    let mut sources = Vec::new();
    for (k, tensors) in initial.into_iter().take(count).enumerate() {
        let path = dir.path().join(format!("s{k}.safetensors"));
        let disk = write_file(&path, &tensors);
        let mut entries = BTreeMap::new();
        for (name, dtype, bytes, shape) in tensors {
            let o = model.new_object(bytes);
            model.objects.get_mut(&o).unwrap().edited = false;
            entries.insert(
                name.to_string(),
                MEntry {
                    data: Some(o),
                    meta: MMeta::Valid(dtype, shape.to_vec()),
                    eid: fresh(&mut model.next),
                },
            );
        }
        model.dirs.push(MDir {
            path: path.clone(),
            entries,
            metadata: MMetadata::Valid(None),
            committed: Committed {
                tensors: BTreeMap::new(),
                metadata: None,
            },
            dirty: false,
            replaced: false,
            disk,
        });
        model.committed(k);
        sources.push((format!("s{k}"), SourceFile::open(&path).unwrap()));
    }
    let base = Arc::new(Folder::open(dir.path()).unwrap());
    let staging = Arc::new(Staging::new(base.clone(), "m"));
    let source = if folder {
        Source::Folder {
            folder: base,
            stat: FileStat::of(&std::fs::File::open(dir.path()).unwrap()).unwrap(),
            checkpoints: sources,
            indexes: Vec::<IndexFile>::new(),
        }
    } else {
        Source::File(sources.pop().unwrap().1)
    };
    let fs = Fs::new(source, Settings::default(), staging);
    (
        Mounted {
            fs,
            folder,
            _dir: dir,
        },
        model,
    )
}

fn errno<T, E: std::borrow::Borrow<stfs::fs::FsError>>(r: Result<T, E>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.borrow().errno(),
    }
}

/// Runs one operation on both sides and compares their results.
fn apply(m: &Mounted, model: &mut Model, op: &Op) {
    let fs = &m.fs;
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
                    model.entry_mut(dir, n).data = Some(o);
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
                fs.write(ino, h.fh, *offset, data).unwrap();
                fs.release(h.fh).unwrap();
                model.write(o, *offset, data);
                model.dirs[*dir].dirty = true;
            }
        }
        Op::Truncate { dir, name, len } => {
            if let Some((ino, o)) = data_file(m, model, *dir, *name, op) {
                fs.set_size(ino, None, *len).unwrap();
                model.truncate(o, *len);
                model.dirs[*dir].dirty = true;
            }
        }
        Op::WriteJson { dir, name, text } => {
            apply(
                m,
                model,
                &Op::Create {
                    dir: *dir,
                    name: *name,
                    exclusive: false,
                },
            );
            apply(
                m,
                model,
                &Op::Write {
                    dir: *dir,
                    name: *name,
                    offset: 0,
                    data: text.bytes(),
                },
            );
        }
        Op::SetMeta { dir, name, text } => {
            let (dir, n) = (*dir, NAMES[*name]);
            let bytes = text.bytes();
            let (a, o) = fs
                .create(m.dir_ino(dir), &TensorFile::Meta.file_name(n), true, false)
                .unwrap();
            if !model.entry(dir, n).is_some_and(|e| e.meta != MMeta::None) {
                model.entry_mut(dir, n).meta = MMeta::Invalid(vec![]);
            }
            fs.write(a.ino, o.fh, 0, &bytes).unwrap();
            let got = errno(fs.flush(o.fh));
            model.set_meta(dir, n, &bytes);
            let want = match model.entry(dir, n).unwrap().meta {
                MMeta::Invalid(_) => libc::EINVAL,
                _ => 0,
            };
            assert_eq!(got, want, "{op:?}: close reports a meta kept but not valid");
            fs.release(o.fh).unwrap();
        }
        Op::SetMetadata { dir, text } => {
            let dir = *dir;
            let bytes = text.bytes();
            let (ino, fh) = if model.dirs[dir].metadata == MMetadata::Removed {
                let (a, o) = fs
                    .create(m.dir_ino(dir), "__metadata__.json", true, false)
                    .unwrap();
                (a.ino, o.fh)
            } else {
                let ino = fs.lookup(m.dir_ino(dir), "__metadata__.json").unwrap().ino;
                (ino, fs.open(ino, true, true).unwrap().fh)
            };
            fs.write(ino, fh, 0, &bytes).unwrap();
            let got = errno(fs.flush(fh));
            fs.release(fh).unwrap();
            model.dirs[dir].metadata = MMetadata::parse(&bytes);
            model.dirs[dir].dirty = true;
            let want = match model.dirs[dir].metadata {
                MMetadata::Invalid(_) => libc::EINVAL,
                _ => 0,
            };
            assert_eq!(got, want, "{op:?}");
        }
        Op::Unlink(f) => {
            let got = errno(fs.unlink(m.dir_ino(f.dir), &Mounted::file_name(f)));
            let n = NAMES[f.name];
            let want = if !model.exists(f) {
                libc::ENOENT
            } else {
                match f.part {
                    Part::Data => model.entry_mut(f.dir, n).data = None,
                    Part::Meta => model.entry_mut(f.dir, n).meta = MMeta::None,
                    Part::Metadata => model.dirs[f.dir].metadata = MMetadata::Removed,
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
        Op::Open { dir, name } => {
            let Some(slot) = model.handles.iter().position(Option::is_none) else {
                return;
            };
            if let Some((ino, o)) = data_file(m, model, *dir, *name, op) {
                let h = fs.open(ino, true, false).unwrap();
                model.handles[slot] = Some((h.fh, o, ino));
            }
        }
        Op::HandleRead(k) => {
            if let Some((fh, o, ino)) = model.handles[*k] {
                let got = fs.read(ino, fh, 0, 1 << 20, |b| b.concat()).unwrap();
                assert_eq!(
                    got, model.objects[&o].bytes,
                    "{op:?}: a handle reads its file"
                );
            }
        }
        Op::HandleWrite(k, offset, data) => {
            if let Some((fh, o, ino)) = model.handles[*k] {
                fs.write(ino, fh, *offset, data).unwrap();
                model.write(o, *offset, data);
                if let Some(dir) = model.holder(o) {
                    model.dirs[dir].dirty = true;
                }
            }
        }
        Op::Close(k) => {
            if let Some((fh, _, _)) = model.handles[*k].take() {
                fs.release(fh).unwrap();
            }
        }
        Op::Commit { force } => commit(m, model, *force),
        Op::Discard => {
            fs.discard(0).unwrap();
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
                    committed.tensors.get_mut(&name).unwrap().2 = o;
                    let meta = MMeta::Valid(dt, s);
                    entries.insert(
                        name,
                        MEntry {
                            data: Some(o),
                            meta,
                            eid,
                        },
                    );
                }
                let d = &mut model.dirs[dir];
                d.entries = entries;
                d.metadata = MMetadata::Valid(committed.metadata.clone());
                d.committed = committed;
                d.dirty = false;
            }
        }
        Op::ReplaceSource(dir) => {
            let path = model.dirs[*dir].path.clone();
            let tmp = path.with_extension("tmp");
            let disk = write_file(&tmp, &[("other", Dtype::U8, vec![7], &[1])]);
            std::fs::rename(&tmp, &path).unwrap();
            model.dirs[*dir].disk = disk;
            model.dirs[*dir].replaced = true;
        }
        Op::Status => {
            let (report, refused) = fs.status();
            assert_eq!(refused, model.problems(), "{report}");
        }
        Op::Fsync(k) => {
            let fh = k.and_then(|k| model.handles[k]).map(|(fh, _, _)| fh);
            if k.is_some() && fh.is_none() {
                return;
            }
            fs.fsync(fh).unwrap();
            for d in &model.dirs {
                assert_eq!(
                    std::fs::read(&d.path).unwrap(),
                    d.disk,
                    "fsync must not commit"
                );
            }
        }
    }
}

fn rename(m: &Mounted, model: &mut Model, from: &FileRef, to: &FileRef, no_replace: bool) {
    let fs = &m.fs;
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
    let want = if !model.exists(from) {
        libc::ENOENT
    } else if same {
        0
    } else if no_replace && model.exists(to) {
        libc::EEXIST
    } else {
        // The content of the file moved, as bytes.
        let text = |model: &Model| -> Vec<u8> {
            match from.part {
                Part::Data => {
                    let o = model.entry(from.dir, fname).unwrap().data.unwrap();
                    model.objects[&o].bytes.clone()
                }
                Part::Meta => match &model.entry(from.dir, fname).unwrap().meta {
                    MMeta::Invalid(t) => t.clone(),
                    // A generated meta: its text is what the mount shows (checked elsewhere).
                    _ => Vec::new(),
                },
                Part::Metadata => model.dirs[from.dir].metadata.text().unwrap(),
            }
        };
        match to.part {
            Part::Data => {
                let moved_meta;
                let o = match from.part {
                    Part::Data => {
                        let e = model.entry_mut(from.dir, fname);
                        let o = e.data.take().unwrap();
                        moved_meta = (e.meta != MMeta::None)
                            .then(|| std::mem::replace(&mut e.meta, MMeta::None));
                        o
                    }
                    Part::Meta => {
                        moved_meta = None;
                        assert_eq!(got, 0, "{what}");
                        // The data file gets the meta's text, as the mount showed it.
                        let bytes = m.cat(m.lookup(to).expect("renamed"));
                        model.entry_mut(from.dir, fname).meta = MMeta::None;
                        model.new_object(bytes)
                    }
                    Part::Metadata => {
                        moved_meta = None;
                        let bytes = text(model);
                        model.dirs[from.dir].metadata = MMetadata::Removed;
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
                let e = model.entry_mut(to.dir, tname);
                e.data = Some(o);
                if let Some(meta) = moved_meta {
                    e.meta = meta;
                }
                model.dirs[from.dir].dirty = true;
                model.dirs[to.dir].dirty = true;
                0
            }
            Part::Meta | Part::Metadata => {
                let mut bytes = text(model);
                if from.part == Part::Meta && bytes.is_empty() {
                    // A generated meta moved onto a JSON file: always valid.
                    bytes = match &model.entry(from.dir, fname).unwrap().meta {
                        MMeta::Valid(d, s) => serde_json::json!({"dtype": d.name(), "shape": s})
                            .to_string()
                            .into_bytes(),
                        _ => unreachable!(),
                    };
                }
                let valid = match to.part {
                    Part::Metadata => matches!(MMetadata::parse(&bytes), MMetadata::Valid(_)),
                    _ => matches!(MMeta::parse(&bytes), MMeta::Valid(..)),
                };
                if !valid {
                    libc::EINVAL
                } else {
                    match from.part {
                        Part::Data => model.entry_mut(from.dir, fname).data = None,
                        Part::Meta => model.entry_mut(from.dir, fname).meta = MMeta::None,
                        Part::Metadata => model.dirs[from.dir].metadata = MMetadata::Removed,
                    }
                    model.prune(from.dir, fname);
                    match to.part {
                        Part::Metadata => model.dirs[to.dir].metadata = MMetadata::parse(&bytes),
                        _ => model.set_meta(to.dir, tname, &bytes),
                    }
                    model.dirs[from.dir].dirty = true;
                    model.dirs[to.dir].dirty = true;
                    0
                }
            }
        }
    };
    assert_eq!(got, want, "{what}");
}

fn commit(m: &Mounted, model: &mut Model, force: bool) {
    let before: Vec<Vec<u8>> = model
        .dirs
        .iter()
        .map(|d| std::fs::read(&d.path).unwrap())
        .collect();
    let got = m.fs.commit(force, 0);
    let dirty: Vec<bool> = model.dirs.iter().map(|d| d.dirty).collect();
    let want = if !dirty.iter().any(|&d| d) {
        0
    } else if model.problems() {
        libc::EINVAL
    } else if !force && model.dirs.iter().any(|d| d.dirty && d.replaced) {
        libc::ESTALE
    } else {
        0
    };
    assert_eq!(
        errno(got.as_ref().map(|_| ())),
        want,
        "commit (force {force}): {:?}",
        got.as_ref().err().map(|e| e.to_string())
    );
    if want != 0 {
        for (d, b) in model.dirs.iter().zip(before) {
            assert_eq!(
                std::fs::read(&d.path).unwrap(),
                b,
                "a refused commit changed a source"
            );
        }
        return;
    }
    for (dir, &dirty) in dirty.iter().enumerate() {
        if dirty {
            let expected = model.serialized(dir);
            assert_eq!(
                std::fs::read(&model.dirs[dir].path).unwrap(),
                expected,
                "shard {dir}: committed file differs from the reference serialization of the model"
            );
            model.dirs[dir].disk = expected;
            model.committed(dir);
            for e in model.dirs[dir].entries.values() {
                if let Some(o) = e.data {
                    let obj = model.objects.get_mut(&o).unwrap();
                    obj.edited = false;
                    obj.moved_away = false;
                }
            }
        } else {
            assert_eq!(
                std::fs::read(&model.dirs[dir].path).unwrap(),
                model.dirs[dir].disk
            );
        }
    }
}

/// Checks an inode against the model's identity for it.
fn same_inode(model: &mut Model, key: u64, ino: Ino, what: &str) {
    if let Some(&seen) = model.ino_of.get(&key) {
        assert_eq!(seen, ino, "{what}: its inode changed");
    }
    if let Some(&other) = model.key_of.get(&ino) {
        assert_eq!(other, key, "{what}: inode {ino} was another file's");
    }
    model.ino_of.insert(key, ino);
    model.key_of.insert(ino, key);
}

/// Everything the mount shows matches the model.
fn check(m: &Mounted, model: &mut Model, after: &Op) {
    let fs = &m.fs;
    if m.folder {
        let mut root = Vec::new();
        fs.readdir(ROOT_INO, 0, |e| {
            root.push(e.name);
            false
        })
        .unwrap();
        assert_eq!(root, [".", "..", "s0", "s1"]);
    }
    for dir in 0..model.dirs.len() {
        let dino = m.dir_ino(dir);
        let mut listed = Vec::new();
        fs.readdir(dino, 0, |e| {
            listed.push((e.name, e.ino));
            false
        })
        .unwrap();
        let mut want: Vec<String> = vec![".".into(), "..".into()];
        if model.dirs[dir].metadata != MMetadata::Removed {
            want.push("__metadata__.json".into());
        }
        for (name, e) in &model.dirs[dir].entries {
            if e.data.is_some() {
                want.push(TensorFile::Data.file_name(name));
            }
            if e.meta != MMeta::None {
                want.push(TensorFile::Meta.file_name(name));
            }
        }
        let mut names: Vec<String> = listed.iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "shard {dir} listing after {after:?}");
        // Every listed name looks up to the inode readdir gave.
        for (name, ino) in listed.iter().skip(2) {
            assert_eq!(
                fs.lookup(dino, name).unwrap().ino,
                *ino,
                "lookup of {name:?} after {after:?}"
            );
        }
        let entries: Vec<(String, MEntry)> = model.dirs[dir]
            .entries
            .iter()
            .map(|(n, e)| (n.clone(), e.clone()))
            .collect();
        for (name, e) in entries {
            if let Some(o) = e.data {
                let ino = fs
                    .lookup(dino, &TensorFile::Data.file_name(&name))
                    .unwrap()
                    .ino;
                let key = model.objects[&o].ino_key;
                same_inode(model, key, ino, &format!("{name:?} after {after:?}"));
                assert_eq!(
                    m.cat(ino),
                    model.objects[&o].bytes,
                    "bytes of {name:?} after {after:?}"
                );
            }
            if e.meta != MMeta::None {
                let ino = fs
                    .lookup(dino, &TensorFile::Meta.file_name(&name))
                    .unwrap()
                    .ino;
                same_inode(
                    model,
                    e.eid,
                    ino,
                    &format!("{name:?}.meta.json after {after:?}"),
                );
                let text = m.cat(ino);
                match &e.meta {
                    MMeta::Invalid(t) => assert_eq!(&text, t, "kept text of {name:?}.meta.json"),
                    MMeta::Valid(d, s) => {
                        let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
                        assert_eq!(v["dtype"], d.name(), "{name:?} after {after:?}");
                        assert_eq!(v["shape"], serde_json::json!(s), "{name:?} after {after:?}");
                        assert_eq!(v["name"], name.as_str());
                        let nbytes = match e.data {
                            Some(o) => model.objects[&o].bytes.len() as u64,
                            None => byte_len(*d, s).unwrap(),
                        };
                        assert_eq!(v["nbytes"], nbytes, "{name:?} after {after:?}");
                    }
                    MMeta::None => unreachable!(),
                }
            }
        }
        if let Some(text) = model.dirs[dir].metadata.text() {
            let ino = fs.lookup(dino, "__metadata__.json").unwrap().ino;
            assert_eq!(m.cat(ino), text, "__metadata__.json after {after:?}");
        }
    }
}

fn run(folder: bool, ops: &[Op]) {
    let (m, mut model) = setup(folder);
    check(&m, &mut model, &Op::Status);
    for op in ops {
        apply(&m, &mut model, op);
        check(&m, &mut model, op);
    }
    for k in 0..MAX_HANDLES {
        apply(&m, &mut model, &Op::Close(k));
    }
    // The unmount's policy: commit what is valid; keep edits it cannot commit.
    let dirty = model.dirs.iter().any(|d| d.dirty);
    let refused = dirty && (model.problems() || model.dirs.iter().any(|d| d.dirty && d.replaced));
    let result = m.fs.unmount();
    assert_eq!(result.is_err(), refused, "unmount: {result:?}");
    for dir in 0..model.dirs.len() {
        let want = if model.dirs[dir].dirty && !refused {
            model.serialized(dir)
        } else {
            model.dirs[dir].disk.clone()
        };
        assert_eq!(
            std::fs::read(&model.dirs[dir].path).unwrap(),
            want,
            "shard {dir} after unmount"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(250))]

    #[test]
    fn file_mount_matches_the_model(ops in prop::collection::vec(op(1), 1..30)) {
        run(false, &ops);
    }

    #[test]
    fn folder_mount_matches_the_model(ops in prop::collection::vec(op(2), 1..30)) {
        run(true, &ops);
    }
}

/// The inode of a data file and the model's object behind it, if the
/// model says the file exists (and the filesystem must agree).
fn data_file(m: &Mounted, model: &Model, dir: usize, name: usize, op: &Op) -> Option<(Ino, ObjId)> {
    let o = model.entry(dir, NAMES[name]).and_then(|e| e.data);
    let ino = m.lookup(&data(dir, name));
    assert_eq!(ino.is_some(), o.is_some(), "{op:?}");
    Some((ino?, o?))
}

fn data(dir: usize, name: usize) -> FileRef {
    FileRef {
        dir,
        name,
        part: Part::Data,
    }
}

fn meta(dir: usize, name: usize) -> FileRef {
    FileRef {
        dir,
        name,
        part: Part::Meta,
    }
}

/// Tool patterns from docs/SEMANTICS.md, always run.
#[test]
fn install_unlinks_then_creates_and_the_meta_stays() {
    run(
        false,
        &[
            Op::SetMeta {
                dir: 0,
                name: 2,
                text: Text::Meta(Dtype::U8, vec![2]),
            },
            Op::Unlink(data(0, 2)),
            Op::Create {
                dir: 0,
                name: 2,
                exclusive: true,
            },
            Op::Write {
                dir: 0,
                name: 2,
                offset: 0,
                data: vec![1, 2],
            },
            Op::Commit { force: false },
        ],
    );
}

#[test]
fn sed_renames_a_temp_file_over_the_meta() {
    run(
        false,
        &[
            Op::WriteJson {
                dir: 0,
                name: 2,
                text: Text::Meta(Dtype::U8, vec![4]),
            },
            Op::Rename {
                from: data(0, 2),
                to: meta(0, 1),
                no_replace: false,
            },
            Op::Truncate {
                dir: 0,
                name: 1,
                len: 4,
            },
            Op::Commit { force: false },
        ],
    );
}

#[test]
fn a_moved_tensor_takes_its_meta_across_shards() {
    run(
        true,
        &[
            Op::Open { dir: 0, name: 0 },
            Op::Rename {
                from: data(0, 0),
                to: data(1, 4),
                no_replace: true,
            },
            Op::HandleWrite(0, 0, vec![9]),
            Op::Commit { force: false },
            Op::HandleRead(0),
            Op::Discard,
        ],
    );
}

#[test]
fn a_replaced_source_refuses_until_forced() {
    run(
        false,
        &[
            Op::Truncate {
                dir: 0,
                name: 0,
                len: 3,
            },
            Op::Write {
                dir: 0,
                name: 0,
                offset: 0,
                data: vec![7],
            },
            Op::ReplaceSource(0),
            Op::Commit { force: false },
            Op::Commit { force: true },
        ],
    );
}

#[test]
fn discard_then_edit_then_commit() {
    run(
        false,
        &[
            Op::Rename {
                from: data(0, 0),
                to: data(0, 2),
                no_replace: false,
            },
            Op::Write {
                dir: 0,
                name: 1,
                offset: 0,
                data: vec![1],
            },
            Op::Discard,
            Op::Unlink(meta(0, 0)),
            Op::Status,
            Op::SetMeta {
                dir: 0,
                name: 0,
                text: Text::Meta(Dtype::U8, vec![3]),
            },
            Op::Commit { force: false },
        ],
    );
}
