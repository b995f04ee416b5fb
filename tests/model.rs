//! Reference-model property test of the filesystem logic, without a mount
//! (after mountpoint-s3's `tests/reftests`): random sequences of operations
//! run both against `Fs` and against a plain model of the documented file
//! model (docs/SEMANTICS.md, "Editing"), in a file mount or a folder mount of
//! two shards with an index file, writable or `-o ro`.
//!
//! The model decides every expected result from its own knowledge, errno
//! included: its own dtype table, its own parser and renderer of `.meta.json`
//! and `__metadata__.json` (every byte of every generated file, offsets taken
//! from the reference crate's reading of the file the bytes are in), its own
//! index file, and every line of `stfs status` (a parse error's own words
//! aside). It is never asked of the
//! filesystem what a file holds or whether an operation would work.
//!
//! After every operation it compares: the listing (read in pages of varying
//! size, names and inodes), a lookup of every name, every file's bytes (read
//! in small pieces), attributes (size, nlink, mode, owner), and inode
//! identity (stable for a file's life, never given to another file). Open
//! descriptors of every kind of file are held across unlinks, renames,
//! replacements, O_TRUNC by another opener, commits, discards and a crash:
//! reads at random offsets, writes, and fstat (nlink 0 once removed). After
//! every commit each source file must equal the reference `safetensors`
//! serialization of the model, and the index file the model's.
//!
//! Separate properties: copies of the same files by two clients in any
//! interleaving converge to one checkpoint; renames of data and meta in any
//! order (a list renamer, a glob of `mv`) end as `mv` of the tensor alone.
//!
//! Bugs planted one at a time (by a script over this list, each a small
//! edit of the code named), all 25 caught by this file's tests:
//! 1. RENAME_NOREPLACE ignored (`Fs::rename`);
//! 2. a handle of a removed tensor not reading it (`Fs::read` from the state);
//! 3. a wrong shape in a generated `.meta.json` (`meta::render_meta`);
//! 4. wrong readdir names (`Fs::readdir`);
//! 5. the ESTALE check disabled (`Live::plan`);
//! 6. a name's meta dropped when its bytes are replaced (`Live::put_data`);
//! 7. discard giving unedited tensors new inodes (`Live::discard`);
//! 8. JSON descriptors read from the state, not their file (`Fs::read`: the
//!    `ruby -i` metadata loss);
//! 9. fstat of a removed file without the handle fallback (`Fs::getattr`);
//! 10. a lone meta making its data file appear (`Live::set_meta`: the
//!     `xargs -P cp` EEXIST);
//! 11. no hidden meta after a rename of the data (`Live::take_data`: `mmv`);
//! 12. a meta replaced by rename keeping its inode (`Live::set_meta`);
//! 13. descriptors of one JSON file not sharing it (`Fs::open_json`);
//! 14. `data_offsets` dropped from metas (`Live::meta_text`);
//! 15. the index omitting shards without edits (`index_updates`);
//! 16. `stfs status` listing no changes (`Fs::status`);
//! 17. a size mismatch not a problem (`Live::problems`);
//! 18. journal replay dropping metas (`Live::replay`);
//! 19. `-o ro` letting a rename through (`Fs::rename`);
//! 20. commit allowed to another user (`Fs::allowed`);
//! 21. a source rewritten in place not noticed (`SourceFile::check_unchanged`);
//! 22. discard giving a removed `__metadata__.json`'s inode to the restored
//!     one (`Live::discard`);
//! 23. a half-written JSON file reported to one of two writers
//!     (`Fs::apply_json`);
//! 24. a scalar shape `[]` refused (`meta::parse_meta`);
//! 25. a meta renamed onto a data name losing its last byte (`Fs::rename_parts`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use stfs::checkpoint::recover::{self, Resume};
use stfs::checkpoint::staging::Staging;
use stfs::fs::{Fs, IndexFile, Ino, Settings, Source, TensorFile, ROOT_INO};
use stfs::source::local::Folder;
use stfs::source::{FileStat, SourceFile};

const NAMES: [&str; 5] = ["a", "b", "c/d", "x.meta.json", ""];
/// The model's own dtype table: name, bits per element.
const DTYPES: [(&str, u64); 5] = [
    ("U8", 8),
    ("I16", 16),
    ("F32", 32),
    ("BF16", 16),
    ("F64", 64),
];
const MAX_HANDLES: usize = 3;
const OTHER_USER: u32 = 4242;
const INDEX: &str = "model.safetensors.index.json";

fn dtype_of(name: &str) -> Option<usize> {
    DTYPES.iter().position(|(n, _)| *n == name)
}

fn byte_len(dtype: usize, shape: &[u64]) -> u64 {
    shape.iter().product::<u64>() * DTYPES[dtype].1 / 8
}

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
    Meta(usize, Vec<u64>),
    BadDtype,
    NotJson,
    Metadata(Option<(String, String)>),
    BadMetadata,
}

impl Text {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Text::Meta(d, s) => format!(
                r#"{{"dtype":"{}","shape":{}}}"#,
                DTYPES[*d].0,
                serde_json::to_string(s).unwrap()
            ),
            Text::BadDtype => r#"{"dtype":"f32","shape":[1]}"#.to_string(),
            Text::NotJson => "not json".to_string(),
            Text::Metadata(None) => "{}".to_string(),
            Text::Metadata(Some((k, v))) => format!(r#"{{"{k}":"{v}"}}"#),
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
    /// open(O_CREAT|O_TRUNC) of `.meta.json`, write, close.
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
    /// Opens any file and keeps the descriptor.
    Open {
        file: FileRef,
        write: bool,
        truncate: bool,
    },
    HandleRead(usize, u64, u32),
    HandleWrite(usize, u64, Vec<u8>),
    /// ftruncate(0) and a write of `text` through a held descriptor.
    HandleSetText(usize, Text),
    Fstat(usize),
    Close(usize),
    Commit {
        force: bool,
        other_user: bool,
    },
    /// `stfs commit --compact`: the reference's layout, byte for byte.
    CompactCommit,
    Discard,
    /// Another program replaces the source file behind the mount: by a
    /// rename, or by rewriting it in place.
    ReplaceSource {
        dir: usize,
        in_place: bool,
    },
    Status,
    /// fsync of a handle, or of the directories: durable, never a commit.
    Fsync(Option<usize>),
    /// The daemon is killed and the source mounted again.
    Remount,
}

fn shape() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        4 => prop::collection::vec(0u64..4, 0..4),
        1 => prop::collection::vec(0u64..40, 1..2),
    ]
}

fn meta_text() -> impl Strategy<Value = Text> {
    prop_oneof![
        4 => (0..DTYPES.len(), shape()).prop_map(|(d, s)| Text::Meta(d, s)),
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

fn any_text() -> impl Strategy<Value = Text> {
    prop_oneof![meta_text(), metadata_text()]
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
    let h = 0..MAX_HANDLES;
    prop_oneof![
        3 => (d.clone(), n.clone(), any::<bool>())
            .prop_map(|(dir, name, exclusive)| Op::Create { dir, name, exclusive }),
        3 => (d.clone(), n.clone(), 0u64..16, bytes.clone())
            .prop_map(|(dir, name, offset, data)| Op::Write { dir, name, offset, data }),
        2 => (d.clone(), n.clone(), 0u64..16).prop_map(|(dir, name, len)| Op::Truncate { dir, name, len }),
        2 => (d.clone(), n.clone(), any_text())
            .prop_map(|(dir, name, text)| Op::WriteJson { dir, name, text }),
        4 => (d.clone(), n.clone(), meta_text()).prop_map(|(dir, name, text)| Op::SetMeta { dir, name, text }),
        1 => (d.clone(), metadata_text()).prop_map(|(dir, text)| Op::SetMetadata { dir, text }),
        3 => file_ref(dirs).prop_map(Op::Unlink),
        5 => (file_ref(dirs), file_ref(dirs), any::<bool>())
            .prop_map(|(from, to, no_replace)| Op::Rename { from, to, no_replace }),
        3 => (file_ref(dirs), any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(file, write, truncate)| Op::Open { file, write: write || truncate, truncate }),
        2 => (h.clone(), 0u64..40, 1u32..40).prop_map(|(k, o, s)| Op::HandleRead(k, o, s)),
        2 => (h.clone(), 0u64..8, bytes).prop_map(|(k, o, b)| Op::HandleWrite(k, o, b)),
        1 => (h.clone(), any_text()).prop_map(|(k, t)| Op::HandleSetText(k, t)),
        2 => h.clone().prop_map(Op::Fstat),
        1 => h.clone().prop_map(Op::Close),
        3 => (any::<bool>(), prop::bool::weighted(0.1))
            .prop_map(|(force, other_user)| Op::Commit { force, other_user }),
        1 => Just(Op::CompactCommit),
        1 => Just(Op::Discard),
        1 => (d, any::<bool>()).prop_map(|(dir, in_place)| Op::ReplaceSource { dir, in_place }),
        1 => Just(Op::Status),
        1 => prop::option::of(h).prop_map(Op::Fsync),
        1 => Just(Op::Remount),
    ]
}

// ---- the model's own JSON files ----

#[derive(Debug, Clone, PartialEq)]
enum MMeta {
    None,
    Valid(usize, Vec<u64>),
    Invalid(Vec<u8>),
}

impl MMeta {
    /// `dtype` (one of the table's) and `shape` (non-negative integers)
    /// count; every other field is ignored.
    fn parse(text: &[u8]) -> MMeta {
        let valid = (|| {
            let v: serde_json::Value = serde_json::from_slice(without_nuls(text)).ok()?;
            let d = dtype_of(v.get("dtype")?.as_str()?)?;
            let shape = v
                .get("shape")?
                .as_array()?
                .iter()
                .map(|x| x.as_u64())
                .collect::<Option<Vec<u64>>>()?;
            Some(MMeta::Valid(d, shape))
        })();
        valid.unwrap_or_else(|| MMeta::Invalid(text.to_vec()))
    }

    /// Written and not an empty pending file.
    fn counts(&self) -> bool {
        !matches!(self, MMeta::None) && *self != MMeta::Invalid(vec![])
    }
}

type Map = BTreeMap<String, String>;

/// A JSON file's text without the NULs a tool extended it with.
fn without_nuls(text: &[u8]) -> &[u8] {
    let end = text.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    &text[..end]
}

#[derive(Debug, Clone, PartialEq)]
enum MMetadata {
    Valid(Option<Map>),
    Invalid(Vec<u8>),
    Removed,
}

impl MMetadata {
    /// An object of string values; `{}` is none.
    fn parse(text: &[u8]) -> MMetadata {
        let parsed = (|| {
            let v: serde_json::Value = serde_json::from_slice(without_nuls(text)).ok()?;
            let mut map = Map::new();
            for (k, x) in v.as_object()? {
                map.insert(k.clone(), x.as_str()?.to_string());
            }
            Some(MMetadata::Valid((!map.is_empty()).then_some(map)))
        })();
        parsed.unwrap_or_else(|| MMetadata::Invalid(text.to_vec()))
    }

    fn text(&self) -> Option<Vec<u8>> {
        match self {
            MMetadata::Valid(None) => Some(b"{}\n".to_vec()),
            MMetadata::Valid(Some(m)) => {
                let mut t = serde_json::to_vec(m).unwrap();
                t.push(b'\n');
                Some(t)
            }
            MMetadata::Invalid(t) => Some(t.clone()),
            MMetadata::Removed => None,
        }
    }
}

/// `{"dtype":..,"shape":..[,"data_offsets":[b,e],"file_offset":f],"nbytes":..,"name":..}` and a newline.
fn render_meta(
    dtype: usize,
    shape: &[u64],
    offsets: Option<(u64, u64, u64)>,
    nbytes: u64,
    name: &str,
) -> Vec<u8> {
    let mut out = format!(
        r#"{{"dtype":"{}","shape":{}"#,
        DTYPES[dtype].0,
        serde_json::to_string(shape).unwrap()
    );
    if let Some((b, e, f)) = offsets {
        out += &format!(r#","data_offsets":[{b},{e}],"file_offset":{f}"#);
    }
    out += &format!(
        r#","nbytes":{nbytes},"name":{}}}"#,
        serde_json::to_string(name).unwrap()
    );
    out.push('\n');
    out.into_bytes()
}

/// Where tensor `name` lies in a safetensors file, as the reference reads it:
/// (begin, end, absolute offset).
fn offsets_in(file: &[u8], name: &str) -> (u64, u64, u64) {
    let (n, meta) = safetensors::SafeTensors::read_metadata(file).unwrap();
    let (b, e) = meta.info(name).unwrap().data_offsets;
    (b as u64, e as u64, 8 + n as u64 + b as u64)
}

// ---- the model ----

type ObjId = u64;

#[derive(Debug, Clone)]
struct MObject {
    bytes: Vec<u8>,
    /// Written or cut since the last commit or discard.
    edited: bool,
    /// Identity of its inode: changes when it moves to another directory.
    ino_key: u64,
    /// Moved to another directory since the last commit or discard.
    moved_away: bool,
    /// The mapped file its bytes are in, unedited: (dir, tensor name there).
    source: Option<(usize, String)>,
    /// The same, kept through edits: where the tensor lies on disk, as its
    /// meta shows.
    origin: Option<(usize, String)>,
}

#[derive(Debug, Clone)]
struct MEntry {
    data: Option<ObjId>,
    meta: MMeta,
    /// The meta stayed behind when the data left with a copy of it.
    hidden: bool,
    /// Identity of the entry (a source tensor's slot).
    eid: u64,
    /// Identity of its `.meta.json` file.
    meta_key: u64,
}

/// A committed tensor: dtype, shape, object, entry identity, bytes.
type CommittedTensor = (usize, Vec<u64>, ObjId, u64, Vec<u8>);

#[derive(Debug, Clone)]
struct Committed {
    tensors: BTreeMap<String, CommittedTensor>,
    metadata: Option<Map>,
}

struct MDir {
    path: PathBuf,
    entries: BTreeMap<String, MEntry>,
    metadata: MMetadata,
    metadata_key: u64,
    /// `__metadata__.json` written, removed or replaced since the last commit.
    metadata_touched: bool,
    committed: Committed,
    /// Edits since the last commit or discard (a commit rewrites the file).
    dirty: bool,
    /// The source was replaced behind the mount (by rename or in place).
    replaced: bool,
    /// ...in place: reads of its bytes fail.
    rewritten: bool,
    /// ...by a rename: the mount keeps the file it mapped.
    detached: bool,
    /// What the file on disk must be, and what the mount maps.
    disk: Vec<u8>,
    mapped: Vec<u8>,
}

/// An open JSON file: shared by the descriptors of one inode.
#[derive(Debug, Clone)]
struct MJson {
    key: u64,
    text: Vec<u8>,
    dirty: bool,
    written: bool,
}

impl MJson {
    /// A write through a descriptor (zeros fill a gap).
    fn write_at(&mut self, offset: usize, data: &[u8]) {
        let end = offset + data.len();
        if self.text.len() < end {
            self.text.resize(end, 0);
        }
        self.text[offset..end].copy_from_slice(data);
        self.dirty = true;
        self.written = true;
    }
}

#[derive(Debug, Clone)]
enum MHandle {
    Data {
        fh: u64,
        obj: ObjId,
        ino: Ino,
        key: u64,
        write: bool,
    },
    Json {
        fh: u64,
        file: u64,
        ino: Ino,
        write: bool,
    },
}

struct Model {
    dirs: Vec<MDir>,
    objects: HashMap<ObjId, MObject>,
    next: u64,
    handles: [Option<MHandle>; MAX_HANDLES],
    /// Open JSON files by id, and the one each file key shares.
    json: HashMap<u64, MJson>,
    json_by_key: HashMap<u64, u64>,
    /// Inode identities seen: key -> ino, and ino -> key (never reused).
    ino_of: HashMap<u64, Ino>,
    key_of: HashMap<Ino, u64>,
    read_only: bool,
    folder: bool,
    /// The source files' mode and owner.
    perm: u16,
    uid: u32,
    gid: u32,
    index: serde_json::Value,
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
                source: None,
                origin: None,
            },
        );
        id
    }

    fn entry(&self, dir: usize, name: &str) -> Option<&MEntry> {
        self.dirs[dir].entries.get(name)
    }

    /// The entry of `name`, made if there is none; true if made.
    fn entry_made(&mut self, dir: usize, name: &str) -> bool {
        if self.dirs[dir].entries.contains_key(name) {
            return false;
        }
        let eid = fresh(&mut self.next);
        self.dirs[dir].entries.insert(
            name.to_string(),
            MEntry {
                data: None,
                meta: MMeta::None,
                hidden: false,
                eid,
                meta_key: eid,
            },
        );
        true
    }

    fn entry_mut(&mut self, dir: usize, name: &str) -> &mut MEntry {
        self.entry_made(dir, name);
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

    /// The identity of the file `f` names now (it must exist).
    fn key_of_file(&self, f: &FileRef) -> u64 {
        let e = self.entry(f.dir, NAMES[f.name]);
        match f.part {
            Part::Data => self.objects[&e.unwrap().data.unwrap()].ino_key,
            Part::Meta => e.unwrap().meta_key,
            Part::Metadata => self.dirs[f.dir].metadata_key,
        }
    }

    /// Whether a JSON file key is the file at some name now.
    fn json_current(&self, key: u64) -> bool {
        self.dirs.iter().any(|d| {
            (d.metadata != MMetadata::Removed && d.metadata_key == key)
                || d.entries
                    .values()
                    .any(|e| e.meta != MMeta::None && e.meta_key == key)
        })
    }

    /// Applies a meta's text to `name`: in place, or as a file renamed over
    /// it (`replace`: a new file). A meta never makes data appear; one that
    /// gives an empty, meta-less data file its size fills it with zeros.
    fn set_meta(&mut self, dir: usize, name: &str, text: &[u8], replace: bool) {
        let meta = MMeta::parse(text);
        let made = self.entry_made(dir, name);
        let renew = !made && (replace || self.entry(dir, name).unwrap().meta == MMeta::None);
        let key = fresh(&mut self.next);
        let e = self.entry_mut(dir, name);
        let had = e.meta.counts() && !e.hidden;
        if renew {
            e.meta_key = key;
        }
        e.meta = meta.clone();
        e.hidden = false;
        let data = e.data;
        if let (MMeta::Valid(d, s), Some(o)) = (&meta, data) {
            if !had && self.objects[&o].bytes.is_empty() {
                self.truncate(o, byte_len(*d, s));
            }
        }
        self.dirs[dir].dirty = true;
    }

    fn set_metadata(&mut self, dir: usize, text: &[u8], replace: bool) {
        let d = &mut self.dirs[dir];
        if replace || d.metadata == MMetadata::Removed {
            d.metadata_key = fresh(&mut self.next);
        }
        d.metadata = MMetadata::parse(text);
        d.metadata_touched = true;
        d.dirty = true;
    }

    fn truncate(&mut self, o: ObjId, len: u64) {
        let obj = self.objects.get_mut(&o).unwrap();
        if len == 0 || len as usize != obj.bytes.len() {
            obj.bytes.resize(len as usize, 0);
            obj.edited = true;
            obj.source = None;
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
        obj.source = None;
    }

    /// The directory whose entry holds object `o`.
    fn holder(&self, o: ObjId) -> Option<usize> {
        self.dirs
            .iter()
            .position(|d| d.entries.values().any(|e| e.data == Some(o)))
    }

    fn edited(&mut self, o: ObjId) {
        if let Some(dir) = self.holder(o) {
            self.dirs[dir].dirty = true;
        }
    }

    /// The copy into staging that a write or a cut to `keep` bytes makes
    /// first must read bytes of a source rewritten in place.
    fn copy_fails(&self, o: ObjId, keep: u64) -> bool {
        self.unreadable(o) && keep.min(self.objects[&o].bytes.len() as u64) > 0
    }

    /// Reading the bytes of `o` fails: they are in a source rewritten in place.
    fn unreadable(&self, o: ObjId) -> bool {
        !self.objects[&o].bytes.is_empty()
            && self.objects[&o]
                .source
                .as_ref()
                .is_some_and(|(d, _)| self.dirs[*d].rewritten)
    }

    /// What `<name>.meta.json` shows.
    fn meta_text(&self, dir: usize, name: &str) -> Vec<u8> {
        let e = self.entry(dir, name).unwrap();
        match &e.meta {
            MMeta::Invalid(t) => t.clone(),
            MMeta::Valid(d, s) => {
                let offsets = e
                    .data
                    .and_then(|o| self.objects[&o].origin.as_ref())
                    .map(|(sd, sn)| offsets_in(&self.dirs[*sd].mapped, sn));
                render_meta(*d, s, offsets, byte_len(*d, s), name)
            }
            MMeta::None => unreachable!(),
        }
    }

    /// What file `f` holds now, as a new descriptor would read it: a JSON
    /// file being written is its writers' text.
    fn content(&self, f: &FileRef) -> Vec<u8> {
        if f.part != Part::Data {
            let key = self.key_of_file(f);
            if let Some(j) = self.json_by_key.get(&key).map(|id| &self.json[id]) {
                if j.written {
                    return j.text.clone();
                }
            }
        }
        self.state_content(f)
    }

    /// What file `f` holds in the checkpoint's state.
    fn state_content(&self, f: &FileRef) -> Vec<u8> {
        match f.part {
            Part::Data => {
                let o = self.entry(f.dir, NAMES[f.name]).unwrap().data.unwrap();
                self.objects[&o].bytes.clone()
            }
            Part::Meta => self.meta_text(f.dir, NAMES[f.name]),
            Part::Metadata => self.dirs[f.dir].metadata.text().unwrap(),
        }
    }

    /// Per directory: the problems a commit would refuse.
    fn problem_count(&self, dir: usize) -> usize {
        let d = &self.dirs[dir];
        let tensors = d
            .entries
            .values()
            .filter(|e| {
                let meta = if e.hidden { &MMeta::None } else { &e.meta };
                match (meta, e.data) {
                    (MMeta::Invalid(_), _) => true,
                    (MMeta::None, Some(_)) => true,
                    (MMeta::Valid(dt, s), Some(o)) => {
                        byte_len(*dt, s) != self.objects[&o].bytes.len() as u64
                    }
                    (_, None) => false,
                }
            })
            .count();
        tensors + usize::from(matches!(d.metadata, MMetadata::Invalid(_)))
    }

    fn problems(&self) -> bool {
        (0..self.dirs.len()).any(|d| self.problem_count(d) > 0) || self.in_two_shards()
    }

    /// Whether a tensor name has bytes in two shards (an index cannot say
    /// which: a commit refuses).
    fn in_two_shards(&self) -> bool {
        if !self.folder {
            return false;
        }
        let mut seen = std::collections::HashSet::new();
        self.dirs.iter().any(|d| {
            d.entries
                .iter()
                .filter(|(_, e)| e.data.is_some())
                .any(|(n, _)| !seen.insert(n.clone()))
        })
    }

    /// Whether entry `e` of `name` is the committed tensor of that name, untouched.
    fn untouched(&self, dir: usize, name: &str, e: &MEntry) -> bool {
        let Some((dt, s, _, eid, _)) = self.dirs[dir].committed.tensors.get(name) else {
            return false;
        };
        e.eid == *eid
            && !e.hidden
            && e.meta == MMeta::Valid(*dt, s.clone())
            && e.data
                .is_some_and(|o| self.objects[&o].source == Some((dir, name.to_string())))
    }

    /// Whether the directory differs from its committed file (what a journal
    /// replay leaves as staged edits).
    fn net_changed(&self, dir: usize) -> bool {
        let d = &self.dirs[dir];
        d.metadata_touched
            || d.entries.iter().any(|(n, e)| !self.untouched(dir, n, e))
            || d.committed
                .tensors
                .keys()
                .any(|n| !d.entries.contains_key(n))
    }

    /// The lines `stfs status` lists for a shard: its staged changes, then
    /// its problems (a parse error's own words cut off after the rule).
    fn status_lines(&self, dir: usize) -> Vec<String> {
        let d = &self.dirs[dir];
        // A name as printed for a person: escaped, without quotes.
        let p = |n: &str| {
            let quoted = format!("{n:?}");
            quoted[1..quoted.len() - 1].to_string()
        };
        let shape = |s: &[u64]| {
            let dims: Vec<String> = s.iter().map(u64::to_string).collect();
            format!("[{}]", dims.join(", "))
        };
        let shape_of = |m: &MMeta| match m {
            MMeta::Valid(dt, s) => format!("{} {}", DTYPES[*dt].0, shape(s)),
            _ => "no dtype".to_string(),
        };
        let mut lines = Vec::new();
        let mut problems = Vec::new();
        let mut renamed_from = HashSet::new();
        for (name, e) in &d.entries {
            let meta = if e.hidden { &MMeta::None } else { &e.meta };
            if e.data.is_none() && *meta == MMeta::None {
                continue;
            }
            let len = e.data.map(|o| self.objects[&o].bytes.len() as u64);
            match (meta, len) {
                (MMeta::None, Some(_)) => problems.push(format!(
                    "problem    tensor {name:?} has no dtype and shape: write its .meta.json, or remove the file"
                )),
                (MMeta::Invalid(_), _) => {
                    problems.push(format!("problem    tensor {name:?} has an invalid .meta.json:"))
                }
                (MMeta::Valid(dt, s), Some(len)) if byte_len(*dt, s) != len => problems.push(format!(
                    "problem    tensor {name:?} holds {len} bytes but {} needs {}",
                    shape_of(meta),
                    byte_len(*dt, s)
                )),
                _ => {}
            }
            let origin = d
                .committed
                .tensors
                .get(name)
                .filter(|t| t.3 == e.eid)
                .map(|_| name.clone());
            let bytes_from = e.data.and_then(|o| match &self.objects[&o].source {
                Some((sd, sn)) if *sd == dir => Some(sn.clone()),
                _ => None,
            });
            match (&origin, &bytes_from) {
                (_, Some(src)) if src != name => {
                    renamed_from.insert(src.clone());
                    lines.push(format!("renamed    {} -> {}", p(src), p(name)));
                }
                (None, _) if e.data.is_some() => {
                    lines.push(format!("added      {} ({})", p(name), shape_of(meta)));
                    continue;
                }
                (None, _) => {
                    lines.push(format!(
                        "meta       {}.meta.json without a data file",
                        p(name)
                    ));
                    continue;
                }
                _ => {}
            }
            let Some(i) = origin.or(bytes_from.clone()) else {
                continue;
            };
            let (dt, s, ..) = &d.committed.tensors[&i];
            let committed = MMeta::Valid(*dt, s.clone());
            if *meta != committed {
                lines.push(format!(
                    "reshaped   {}: {} -> {}",
                    p(name),
                    shape_of(&committed),
                    shape_of(meta)
                ));
            }
            match e.data {
                None => lines.push(format!(
                    "removed    {} (its .meta.json stays until the commit)",
                    p(name)
                )),
                Some(_) if bytes_from.is_none() => lines.push(format!("rewritten  {}", p(name))),
                Some(_) => {}
            }
        }
        for (name, t) in &d.committed.tensors {
            let still_there = d.entries.get(name).is_some_and(|e| {
                e.eid == t.3 && (e.data.is_some() || (e.meta != MMeta::None && !e.hidden))
            });
            if !still_there && !renamed_from.contains(name) {
                lines.push(format!("removed    {}", p(name)));
            }
        }
        if d.metadata_touched {
            match &d.metadata {
                MMetadata::Removed => lines.push("metadata   removed".to_string()),
                MMetadata::Valid(m) => {
                    let pairs: Vec<String> = m
                        .iter()
                        .flatten()
                        .map(|(k, v)| format!("{k:?}: {v:?}"))
                        .collect();
                    lines.push(format!("metadata   {{{}}}", pairs.join(", ")));
                }
                MMetadata::Invalid(_) => {}
            }
        }
        if matches!(d.metadata, MMetadata::Invalid(_)) {
            problems.push("problem    __metadata__.json".to_string());
        }
        lines.extend(problems);
        lines
    }

    /// The reference crate's serialization of a directory.
    fn serialized(&self, dir: usize) -> Vec<u8> {
        let d = &self.dirs[dir];
        let mut views = Vec::new();
        for (name, e) in &d.entries {
            if let (MMeta::Valid(dt, s), Some(o), false) = (&e.meta, e.data, e.hidden) {
                let dtype: safetensors::Dtype =
                    serde_json::from_str(&format!("\"{}\"", DTYPES[*dt].0)).unwrap();
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

    /// Whether the edits of `dir` since its last commit change its header
    /// alone: its tensors hold exactly the unedited bytes of the committed
    /// ones, each once, and the source was not replaced.
    fn header_only(&self, dir: usize) -> bool {
        let d = &self.dirs[dir];
        if d.replaced {
            return false;
        }
        let mut now: Vec<ObjId> = d
            .entries
            .values()
            .filter_map(|e| match (&e.meta, e.data, e.hidden) {
                (MMeta::Valid(..), Some(o), false) => Some(o),
                _ => None,
            })
            .collect();
        let mut then: Vec<ObjId> = d.committed.tensors.values().map(|t| t.2).collect();
        now.sort_unstable();
        then.sort_unstable();
        now == then
            && now.iter().all(|o| {
                let obj = &self.objects[o];
                !obj.edited && !obj.moved_away && obj.source.as_ref().is_some_and(|s| s.0 == dir)
            })
    }

    /// After a commit: what was written is what the directory now is.
    fn committed(&mut self, dir: usize) {
        let d = &mut self.dirs[dir];
        // A meta without data is not a tensor: the commit drops it (and
        // a hidden one).
        d.entries.retain(|_, e| e.data.is_some());
        if d.metadata == MMetadata::Removed {
            d.metadata = MMetadata::Valid(None);
            d.metadata_key = fresh(&mut self.next);
        }
        let mut tensors = BTreeMap::new();
        for (name, e) in &d.entries {
            if let (MMeta::Valid(dt, s), Some(o)) = (&e.meta, e.data) {
                let obj = self.objects.get_mut(&o).unwrap();
                obj.edited = false;
                obj.moved_away = false;
                obj.source = Some((dir, name.clone()));
                obj.origin = obj.source.clone();
                tensors.insert(name.clone(), (*dt, s.clone(), o, e.eid, obj.bytes.clone()));
            }
        }
        let metadata = match &d.metadata {
            MMetadata::Valid(m) => m.clone(),
            _ => None,
        };
        d.committed = Committed { tensors, metadata };
        d.dirty = false;
        d.replaced = false;
        d.rewritten = false;
        d.detached = false;
        d.metadata_touched = false;
    }

    /// The index file as a commit of the folder leaves it: shards it did
    /// not write as they are on disk now, and none rewritten if one of them
    /// is not a valid checkpoint now.
    fn expected_index(&self) -> serde_json::Value {
        let mut index = self.index.clone();
        let mut map = serde_json::Map::new();
        let mut total = 0;
        for (k, d) in self.dirs.iter().enumerate() {
            let tensors: Vec<(String, u64)> = if d.disk == d.mapped {
                let t = &d.committed.tensors;
                t.iter()
                    .map(|(n, t)| (n.clone(), t.4.len() as u64))
                    .collect()
            } else {
                match safetensors::SafeTensors::deserialize(&d.disk) {
                    Ok(st) => {
                        let t = st.tensors().into_iter();
                        t.map(|(n, v)| (n, v.data().len() as u64)).collect()
                    }
                    Err(_) => return self.index.clone(),
                }
            };
            for (name, len) in tensors {
                map.insert(name, format!("s{k}.safetensors").into());
                total += len;
            }
        }
        index["weight_map"] = map.into();
        index["metadata"]["total_size"] = total.into();
        index
    }

    fn attr_perm(&self) -> u16 {
        if self.read_only {
            self.perm & !0o222
        } else {
            self.perm
        }
    }
}

// ---- the filesystem side ----

struct Mounted {
    fs: Option<Fs>,
    folder: bool,
    read_only: bool,
    dir: tempfile::TempDir,
}

impl Mounted {
    fn fs(&self) -> &Fs {
        self.fs.as_ref().unwrap()
    }

    fn dir_ino(&self, dir: usize) -> Ino {
        if self.folder {
            self.fs().lookup(ROOT_INO, &format!("s{dir}")).unwrap().ino
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
        self.fs()
            .lookup(self.dir_ino(f.dir), &Self::file_name(f))
            .ok()
            .map(|a| a.ino)
    }

    /// A file's bytes read through a new descriptor, 5 bytes at a time.
    fn cat(&self, ino: Ino) -> Result<Vec<u8>, i32> {
        let o = self.fs().open(ino, false, false).map_err(|e| e.errno())?;
        let mut out = Vec::new();
        let result = loop {
            match self
                .fs()
                .read(ino, o.fh, out.len() as u64, 5, |b| b.concat())
            {
                Ok(chunk) if chunk.is_empty() => break Ok(out),
                Ok(chunk) => out.extend(chunk),
                Err(e) => break Err(e.errno()),
            }
        };
        self.fs().release(o.fh).unwrap();
        result
    }
}

/// name, dtype, bytes, shape
type Tensor<'a> = (&'a str, usize, Vec<u8>, &'a [u64]);

/// Writes a checkpoint with the reference serializer.
fn write_file(path: &Path, tensors: &[Tensor]) -> Vec<u8> {
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
fn open_sources(dir: &Path, count: usize, writable: bool) -> Vec<(String, SourceFile)> {
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
fn mount(dir: &Path, folder: bool, read_only: bool) -> Fs {
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

fn setup(folder: bool, read_only: bool) -> (Mounted, Model) {
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

fn errno<T, E: std::borrow::Borrow<stfs::fs::FsError>>(r: Result<T, E>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.borrow().errno(),
    }
}

/// Opens JSON file `f` (it exists) in the model: the file open on its inode
/// already, unless that one's generated text is out of date.
fn model_open_json(model: &mut Model, f: &FileRef, truncate: bool) -> u64 {
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
fn model_apply_json(model: &mut Model, file: u64, last: bool, except: Option<usize>) -> i32 {
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
fn model_close(model: &mut Model, k: usize) -> (i32, i32) {
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
fn forget_json(model: &mut Model, file: u64) {
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

fn writes(op: &Op) -> bool {
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
fn apply(m: &mut Mounted, model: &mut Model, op: &Op) {
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
fn current_json_len(model: &Model, key: u64) -> usize {
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
fn write_and_close(
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

fn apply_read_only(m: &Mounted, model: &mut Model, op: &Op) {
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

fn rename(m: &Mounted, model: &mut Model, from: &FileRef, to: &FileRef, no_replace: bool) {
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

fn commit(m: &Mounted, model: &mut Model, force: bool, other_user: bool, compact: bool) {
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
fn assert_same_checkpoint(got: &[u8], expected: &[u8], dir: usize) {
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

fn discard(m: &Mounted, model: &mut Model) {
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
fn remount(m: &mut Mounted, model: &mut Model) {
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

/// A directory listed in pages of `page` entries, each resumed from the
/// last one's offset.
fn list_paged(fs: &Fs, ino: Ino, page: usize) -> Vec<(String, Ino)> {
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
fn check(m: &Mounted, model: &mut Model, after: &Op, step: usize) {
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
fn check_file(m: &Mounted, model: &mut Model, f: &FileRef, after: &Op) {
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

fn run_with(folder: bool, read_only: bool, ops: &[Op]) {
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

fn run(folder: bool, ops: &[Op]) {
    run_with(folder, false, ops)
}

thread_local! {
    /// Commits of this thread's runs: (in place, rewrites, in place with
    /// blocks inserted at the start, in place as the model predicted).
    static WAYS: std::cell::RefCell<(usize, usize, usize, usize)> = const { std::cell::RefCell::new((0, 0, 0, 0)) };
}

/// The model's random runs take both ways of committing, many times each,
/// and each one's bytes are checked (`commit`).
#[test]
fn random_runs_commit_both_in_place_and_by_rewrite() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for folder in [false, true] {
        let strategy = prop::collection::vec(op(1 + folder as usize), 1..30);
        for _ in 0..300 {
            let ops = strategy.new_tree(&mut runner).unwrap().current();
            run(folder, &ops);
        }
    }
    let (in_place, rewrites, grown, predicted) = WAYS.with(|w| *w.borrow());
    println!(
        "{in_place} commits in place ({grown} growing the header, {predicted} predicted by the model), {rewrites} rewrites"
    );
    assert!(
        in_place >= 10 && rewrites >= 10 && grown >= 3,
        "{in_place} in place ({grown} grown), {rewrites} rewrites"
    );
    let here = tempfile::tempfile().unwrap();
    if stfs::source::local::inserts_blocks(&here).is_some() {
        assert!(predicted >= 3, "{predicted} commits predicted in place");
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

    #[test]
    fn read_only_mount_matches_the_model(ops in prop::collection::vec(op(2), 1..12)) {
        run_with(true, true, &ops);
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

fn metadata(dir: usize) -> FileRef {
    FileRef {
        dir,
        name: 0,
        part: Part::Metadata,
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
                text: Text::Meta(0, vec![2]),
            },
            Op::Create {
                dir: 0,
                name: 2,
                exclusive: true,
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
            Op::Commit {
                force: false,
                other_user: false,
            },
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
                text: Text::Meta(0, vec![4]),
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
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

#[test]
fn a_moved_tensor_takes_its_meta_across_shards() {
    run(
        true,
        &[
            Op::Open {
                file: data(0, 0),
                write: true,
                truncate: false,
            },
            Op::Rename {
                from: data(0, 0),
                to: data(1, 4),
                no_replace: true,
            },
            Op::HandleWrite(0, 0, vec![9]),
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::HandleRead(0, 0, 10),
            Op::Fstat(0),
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
            Op::ReplaceSource {
                dir: 0,
                in_place: false,
            },
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::Commit {
                force: true,
                other_user: false,
            },
        ],
    );
}

#[test]
fn a_source_rewritten_in_place_fails_reads_not_listings() {
    run(
        true,
        &[
            Op::Rename {
                from: data(0, 0),
                to: data(1, 0),
                no_replace: false,
            },
            Op::ReplaceSource {
                dir: 0,
                in_place: true,
            },
            Op::Status,
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::Commit {
                force: true,
                other_user: false,
            },
            Op::Unlink(data(1, 0)),
            Op::Commit {
                force: true,
                other_user: false,
            },
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
                text: Text::Meta(0, vec![3]),
            },
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

/// `ruby -i.bak -pe ... __metadata__.json`: open, rename to the backup,
/// create the file again, read the old descriptor, write the new one.
#[test]
fn ruby_in_place_keeps_the_old_metadata_readable() {
    run(
        false,
        &[
            Op::SetMetadata {
                dir: 0,
                text: Text::Metadata(Some(("format".into(), "pt".into()))),
            },
            Op::Open {
                file: metadata(0),
                write: false,
                truncate: false,
            },
            Op::Rename {
                from: metadata(0),
                to: data(0, 4),
                no_replace: false,
            },
            Op::SetMetadata {
                dir: 0,
                text: Text::Metadata(Some(("format".into(), "np".into()))),
            },
            Op::HandleRead(0, 0, 100),
            Op::Fstat(0),
            Op::Unlink(data(0, 4)),
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::HandleRead(0, 0, 100),
        ],
    );
}

/// `ruby -i -pe ... x.meta.json`: open, unlink, create, read the old descriptor.
#[test]
fn ruby_in_place_keeps_the_old_meta_readable() {
    run(
        false,
        &[
            Op::Open {
                file: meta(0, 0),
                write: false,
                truncate: false,
            },
            Op::Unlink(meta(0, 0)),
            Op::SetMeta {
                dir: 0,
                name: 0,
                text: Text::Meta(0, vec![3]),
            },
            Op::HandleRead(0, 0, 200),
            Op::Fstat(0),
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::HandleRead(0, 0, 200),
        ],
    );
}

/// A descriptor held across `os.replace` and `rm` of its tensor: reads and
/// fstat answer for the old file, before and after the commit.
#[test]
fn a_descriptor_outlives_its_name() {
    run(
        false,
        &[
            Op::Open {
                file: data(0, 1),
                write: false,
                truncate: false,
            },
            Op::Open {
                file: meta(0, 1),
                write: true,
                truncate: false,
            },
            Op::WriteJson {
                dir: 0,
                name: 2,
                text: Text::Meta(1, vec![1]),
            },
            Op::Rename {
                from: data(0, 2),
                to: data(0, 1),
                no_replace: false,
            },
            Op::Fstat(0),
            Op::HandleRead(0, 1, 3),
            Op::Rename {
                from: meta(0, 0),
                to: meta(0, 1),
                no_replace: false,
            },
            Op::HandleSetText(1, Text::Meta(0, vec![9])),
            Op::Fstat(1),
            Op::Close(1),
            Op::Unlink(data(0, 1)),
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::Fstat(0),
            Op::HandleRead(0, 0, 8),
        ],
    );
}

/// `mmv 'a' 'b'` plans both renames, then does the data's (which takes the
/// meta) and the meta's: the meta still answers at its old name.
#[test]
fn a_meta_renamed_after_its_data_follows_it() {
    run(
        true,
        &[
            Op::Rename {
                from: data(0, 0),
                to: data(0, 2),
                no_replace: false,
            },
            Op::Rename {
                from: meta(0, 0),
                to: meta(0, 2),
                no_replace: false,
            },
            Op::Rename {
                from: data(0, 1),
                to: data(1, 3),
                no_replace: false,
            },
            Op::Rename {
                from: meta(0, 1),
                to: meta(1, 3),
                no_replace: false,
            },
            Op::Status,
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

/// Commit and discard are the mounting user's; a crash gives back every edit.
#[test]
fn another_user_cannot_commit_and_a_crash_loses_nothing() {
    run(
        true,
        &[
            Op::SetMeta {
                dir: 0,
                name: 0,
                text: Text::Meta(0, vec![1, 3]),
            },
            Op::Rename {
                from: data(1, 2),
                to: data(0, 3),
                no_replace: false,
            },
            Op::SetMetadata {
                dir: 1,
                text: Text::Metadata(None),
            },
            Op::Commit {
                force: false,
                other_user: true,
            },
            Op::Remount,
            Op::Status,
            Op::Discard,
            Op::Write {
                dir: 0,
                name: 1,
                offset: 0,
                data: vec![1],
            },
            Op::Remount,
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

// ---- convergence: the same files in any order ----

/// The checkpoint a set of tensors makes, as the reference reads it.
fn tensors_of(bytes: &[u8]) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
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

/// One copy of a file: stat, create (or open O_TRUNC if it exists, and
/// after an EEXIST), write in pieces, close.
#[derive(Debug, Clone)]
struct Copy {
    file: String,
    bytes: Vec<u8>,
    step: usize,
    fh: Option<(Ino, u64)>,
    exists: bool,
}

const PIECE: usize = 3;

impl Copy {
    fn done(&self) -> bool {
        self.step == usize::MAX
    }

    /// One step of `cp`; returns nothing, panics on an unexpected error.
    fn advance(&mut self, fs: &Fs) {
        match (self.step, self.fh) {
            (0, _) => {
                self.exists = fs.lookup(ROOT_INO, &self.file).is_ok();
                self.step = 1;
            }
            (1, None) => {
                let opened = if self.exists {
                    let ino = fs.lookup(ROOT_INO, &self.file).unwrap().ino;
                    fs.open(ino, true, true).map(|o| (ino, o.fh))
                } else {
                    match fs.create(ROOT_INO, &self.file, true, true) {
                        Ok((a, o)) => Ok((a.ino, o.fh)),
                        Err(e) => panic!("{}: create O_EXCL: {e}", self.file),
                    }
                };
                self.fh = Some(opened.unwrap());
                self.step = 2;
            }
            (k, Some((ino, fh))) => {
                let at = (k - 2) * PIECE;
                if at < self.bytes.len() {
                    let end = (at + PIECE).min(self.bytes.len());
                    fs.write(ino, fh, at as u64, &self.bytes[at..end]).unwrap();
                    self.step += 1;
                } else {
                    let flush = fs.flush(fh);
                    fs.release(fh).unwrap();
                    flush.unwrap();
                    self.step = usize::MAX;
                }
            }
            _ => unreachable!(),
        }
    }
}

/// The files a copy of a checkpoint makes: each tensor's data and meta.
fn copy_set(tensors: &[Tensor]) -> Vec<(String, Vec<u8>)> {
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

fn empty_mount() -> (tempfile::TempDir, Fs) {
    let dir = tempfile::tempdir().unwrap();
    write_file(&dir.path().join("s0.safetensors"), &[]);
    let fs = mount(dir.path(), false, false);
    (dir, fs)
}

fn copied() -> Vec<Tensor<'static>> {
    vec![
        ("a", 0, vec![1, 2, 3, 4, 5, 6, 7], &[7]),
        ("b", 1, vec![9, 8], &[]),
        ("c/d", 3, vec![4, 2, 4, 2], &[2]),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// `xargs -P cp`, `cp -r` twice at once, `tar x`: each file copied by
    /// one or two workers, in any order and interleaving, ends as one checkpoint.
    #[test]
    fn copies_in_any_order_converge(
        twice in any::<bool>(),
        schedule in prop::collection::vec(0usize..12, 200),
    ) {
        let tensors = copied();
        let (dir, fs) = empty_mount();
        let mut copies: Vec<Copy> = copy_set(&tensors)
            .into_iter()
            .flat_map(|(file, bytes)| {
                let c = Copy { file, bytes, step: 0, fh: None, exists: false };
                if twice { vec![c.clone(), c] } else { vec![c] }
            })
            .collect();
        let mut turns = schedule.into_iter().chain(std::iter::repeat(0));
        while copies.iter().any(|c| !c.done()) {
            let live: Vec<usize> = (0..copies.len()).filter(|&k| !copies[k].done()).collect();
            let k = live[turns.next().unwrap() % live.len()];
            // A second copier whose O_EXCL lost the race opens the file instead.
            if copies[k].step == 1 && !copies[k].exists
                && fs.lookup(ROOT_INO, &copies[k].file).is_ok()
            {
                if !twice {
                    panic!("{}: appeared before it was copied", copies[k].file);
                }
                copies[k].exists = true;
            }
            copies[k].advance(&fs);
        }
        fs.commit(Default::default(), 0).unwrap();
        let want = tensors_of(&write_file(&dir.path().join("want"), &tensors));
        let got = tensors_of(&std::fs::read(dir.path().join("s0.safetensors")).unwrap());
        prop_assert_eq!(got, want);
    }

    /// `mmv`, a glob of `mv`s, a renamer that plans first: each tensor's data
    /// and meta renamed in either order (or the data alone), interleaved,
    /// ends as `mv` of each tensor.
    #[test]
    fn renames_in_any_order_converge(
        orders in prop::collection::vec(0u8..3, 3),
        schedule in prop::collection::vec(0usize..6, 12),
    ) {
        let tensors = copied();
        let (dir, fs) = empty_mount();
        for (file, bytes) in copy_set(&tensors) {
            let mut c = Copy { file, bytes, step: 0, fh: None, exists: false };
            while !c.done() {
                c.advance(&fs);
            }
        }
        fs.commit(Default::default(), 0).unwrap();
        // Per tensor: 0 data then meta, 1 meta then data, 2 data alone.
        let mut plans: Vec<Vec<(String, String)>> = tensors
            .iter()
            .zip(&orders)
            .map(|((name, ..), &order)| {
                let new = format!("n{name}");
                let data = (TensorFile::Data.file_name(name), TensorFile::Data.file_name(&new));
                let meta = (TensorFile::Meta.file_name(name), TensorFile::Meta.file_name(&new));
                match order {
                    0 => vec![data, meta],
                    1 => vec![meta, data],
                    _ => vec![data],
                }
            })
            .collect();
        // Every source exists when the renamer plans.
        for (from, _) in plans.iter().flatten() {
            prop_assert!(fs.lookup(ROOT_INO, from).is_ok(), "{} before the renames", from);
        }
        let mut turns = schedule.into_iter().chain(std::iter::repeat(0));
        while plans.iter().any(|p| !p.is_empty()) {
            let live: Vec<usize> = (0..plans.len()).filter(|&k| !plans[k].is_empty()).collect();
            let k = live[turns.next().unwrap() % live.len()];
            let (from, to) = plans[k].remove(0);
            fs.rename(ROOT_INO, &from, ROOT_INO, &to, false)
                .unwrap_or_else(|e| panic!("rename {from} -> {to}: {e}"));
        }
        fs.commit(Default::default(), 0).unwrap();
        let renamed: Vec<(String, usize, Vec<u8>, &[u64])> = tensors
            .iter()
            .map(|(n, d, b, s)| (format!("n{n}"), *d, b.clone(), *s))
            .collect();
        let renamed: Vec<Tensor> = renamed.iter().map(|(n, d, b, s)| (n.as_str(), *d, b.clone(), *s)).collect();
        let want = tensors_of(&write_file(&dir.path().join("want"), &renamed));
        let got = tensors_of(&std::fs::read(dir.path().join("s0.safetensors")).unwrap());
        prop_assert_eq!(got, want);
        // Nothing of the old names is left.
        for (name, ..) in &tensors {
            prop_assert!(fs.lookup(ROOT_INO, &TensorFile::Meta.file_name(name)).is_err());
        }
    }
}
