//! The reference model: what the mount must show after each operation,
//! built from the reference crate's decisions alone.

use super::*;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum MMeta {
    None,
    Valid(usize, Vec<u64>),
    Invalid(Vec<u8>),
}

impl MMeta {
    /// `dtype` (one of the table's) and `shape` (non-negative integers)
    /// count; every other field is ignored.
    pub(super) fn parse(text: &[u8]) -> MMeta {
        let valid = (|| {
            let v: serde_json::Value = serde_json::from_slice(without_nuls(text)).ok()?;
            let d = dtype_of(v.get("dtype")?.as_str()?)?;
            let shape = v
                .get("shape")?
                .as_array()?
                .iter()
                .map(|x| x.as_u64())
                .collect::<Option<Vec<u64>>>()?;
            sized(d, &shape).then_some(MMeta::Valid(d, shape))
        })();
        valid.unwrap_or_else(|| MMeta::Invalid(text.to_vec()))
    }

    /// Written and not an empty pending file.
    pub(super) fn counts(&self) -> bool {
        !matches!(self, MMeta::None) && *self != MMeta::Invalid(vec![])
    }
}

pub(super) type Map = BTreeMap<String, String>;

/// A JSON file's text without the NULs a tool extended it with.
pub(super) fn without_nuls(text: &[u8]) -> &[u8] {
    let end = text.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    &text[..end]
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum MMetadata {
    Valid(Option<Map>),
    Invalid(Vec<u8>),
    Removed,
}

impl MMetadata {
    /// An object of string values; `{}` is none.
    pub(super) fn parse(text: &[u8]) -> MMetadata {
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

    pub(super) fn text(&self) -> Option<Vec<u8>> {
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
pub(super) fn render_meta(
    dtype: usize,
    shape: &[u64],
    offsets: Option<(u64, u64, u64)>,
    nbytes: u64,
    name: &str,
    gguf: bool,
) -> Vec<u8> {
    let mut out = format!(
        r#"{{"dtype":"{}","shape":{}"#,
        DTYPES[dtype].0,
        serde_json::to_string(shape).unwrap()
    );
    if gguf {
        // (ggml's dims: innermost first.)
        let ne: Vec<u64> = shape.iter().rev().copied().collect();
        out += &format!(r#","ne":{}"#, serde_json::to_string(&ne).unwrap());
    }
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
pub(super) fn offsets_in(file: &[u8], name: &str) -> (u64, u64, u64) {
    let (n, meta) = safetensors::SafeTensors::read_metadata(file).unwrap();
    let (b, e) = meta.info(name).unwrap().data_offsets;
    (b as u64, e as u64, 8 + n as u64 + b as u64)
}

pub(super) type ObjId = u64;

#[derive(Debug, Clone)]
pub(super) struct MObject {
    pub(super) bytes: Vec<u8>,
    /// Written or cut since the last commit or discard.
    pub(super) edited: bool,
    /// Identity of its inode: changes when it moves to another directory.
    pub(super) ino_key: u64,
    /// Moved to another directory since the last commit or discard.
    pub(super) moved_away: bool,
    /// The mapped file its bytes are in, unedited: (dir, tensor name there).
    pub(super) source: Option<(usize, String)>,
    /// The same, kept through edits: where the tensor lies on disk, as its
    /// meta shows.
    pub(super) origin: Option<(usize, String)>,
    /// Written in part: the source tensor under it (as `source`), and the
    /// 4 KiB blocks staged (numbered from the block the tensor starts in:
    /// its byte x is in block (x + pad) / 4096, `pad` its offset in the
    /// file within a block). The other bytes are read from the source.
    pub(super) patched: Option<MPatch>,
}

#[derive(Debug, Clone)]
pub(super) struct MPatch {
    pub(super) base: (usize, String),
    pub(super) pad: u64,
    pub(super) blocks: std::collections::BTreeSet<u64>,
}

impl MPatch {
    /// Whether bytes `a..b` are all staged.
    pub(super) fn staged(&self, a: u64, b: u64) -> bool {
        a >= b
            || ((a + self.pad) / 4096..=(b - 1 + self.pad) / 4096).all(|k| self.blocks.contains(&k))
    }
}

#[derive(Debug, Clone)]
pub(super) struct MEntry {
    pub(super) data: Option<ObjId>,
    pub(super) meta: MMeta,
    /// The meta stayed behind when the data left with a copy of it.
    pub(super) hidden: bool,
    /// Identity of the entry (a source tensor's slot).
    pub(super) eid: u64,
    /// Identity of its `.meta.json` file.
    pub(super) meta_key: u64,
}

/// A committed tensor: dtype, shape, object, entry identity, bytes.
pub(super) type CommittedTensor = (usize, Vec<u64>, ObjId, u64, Vec<u8>);

#[derive(Debug, Clone)]
pub(super) struct Committed {
    pub(super) tensors: BTreeMap<String, CommittedTensor>,
    pub(super) metadata: Option<Map>,
}

pub(super) struct MDir {
    pub(super) path: PathBuf,
    pub(super) entries: BTreeMap<String, MEntry>,
    pub(super) metadata: MMetadata,
    pub(super) metadata_key: u64,
    /// `__metadata__.json` written, removed or replaced since the last commit.
    pub(super) metadata_touched: bool,
    pub(super) committed: Committed,
    /// Edits since the last commit or discard (a commit rewrites the file).
    pub(super) dirty: bool,
    /// The source was replaced behind the mount (by rename or in place).
    pub(super) replaced: bool,
    /// ...in place: reads of its bytes fail.
    pub(super) rewritten: bool,
    /// ...by a rename: the mount keeps the file it mapped.
    pub(super) detached: bool,
    /// What the file on disk must be, and what the mount maps.
    pub(super) disk: Vec<u8>,
    pub(super) mapped: Vec<u8>,
}

/// An open JSON file: shared by the descriptors of one inode.
#[derive(Debug, Clone)]
pub(super) struct MJson {
    pub(super) key: u64,
    pub(super) text: Vec<u8>,
    pub(super) dirty: bool,
    pub(super) written: bool,
}

impl MJson {
    /// A write through a descriptor (zeros fill a gap).
    pub(super) fn write_at(&mut self, offset: usize, data: &[u8]) {
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
pub(super) enum MHandle {
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
        /// Written or cut through this descriptor since its last flush.
        pending: bool,
    },
}

pub(super) struct Model {
    pub(super) dirs: Vec<MDir>,
    pub(super) objects: HashMap<ObjId, MObject>,
    pub(super) next: u64,
    pub(super) handles: [Option<MHandle>; MAX_HANDLES],
    /// Open JSON files by id, and the one each file key shares.
    pub(super) json: HashMap<u64, MJson>,
    pub(super) json_by_key: HashMap<u64, u64>,
    /// Inode identities seen: key -> ino, and ino -> key (never reused).
    pub(super) ino_of: HashMap<u64, Ino>,
    pub(super) key_of: HashMap<Ino, u64>,
    pub(super) read_only: bool,
    pub(super) folder: bool,
    /// The source files' mode and owner.
    pub(super) perm: u16,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) index: serde_json::Value,
    /// A GGUF source's keys (file mounts of a GGUF file).
    pub(super) gguf: Option<GState>,
}

pub(super) fn fresh(next: &mut u64) -> u64 {
    *next += 1;
    *next
}

impl Model {
    pub(super) fn new_object(&mut self, bytes: Vec<u8>) -> ObjId {
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
                patched: None,
            },
        );
        id
    }

    pub(super) fn entry(&self, dir: usize, name: &str) -> Option<&MEntry> {
        self.dirs[dir].entries.get(name)
    }

    /// The entry of `name`, made if there is none; true if made.
    pub(super) fn entry_made(&mut self, dir: usize, name: &str) -> bool {
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

    pub(super) fn entry_mut(&mut self, dir: usize, name: &str) -> &mut MEntry {
        self.entry_made(dir, name);
        self.dirs[dir].entries.get_mut(name).unwrap()
    }

    /// The file `part` of `name` removed (an unlink, or the source of a
    /// rename that gives its content to a JSON file), then the entry if
    /// nothing is left of it.
    pub(super) fn remove_file(&mut self, dir: usize, name: &str, part: Part) {
        match part {
            Part::Data => self.entry_mut(dir, name).data = None,
            Part::Meta => {
                let e = self.entry_mut(dir, name);
                e.meta = MMeta::None;
                e.hidden = false;
            }
            Part::Metadata => {
                self.dirs[dir].metadata = MMetadata::Removed;
                self.dirs[dir].metadata_touched = true;
            }
        }
        self.prune(dir, name);
    }

    pub(super) fn prune(&mut self, dir: usize, name: &str) {
        if let Some(e) = self.dirs[dir].entries.get(name) {
            if e.data.is_none() && e.meta == MMeta::None {
                self.dirs[dir].entries.remove(name);
            }
        }
    }

    pub(super) fn exists(&self, f: &FileRef) -> bool {
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
    pub(super) fn key_of_file(&self, f: &FileRef) -> u64 {
        let e = self.entry(f.dir, NAMES[f.name]);
        match f.part {
            Part::Data => self.objects[&e.unwrap().data.unwrap()].ino_key,
            Part::Meta => e.unwrap().meta_key,
            Part::Metadata => self.dirs[f.dir].metadata_key,
        }
    }

    /// Whether a JSON file key is the file at some name now.
    pub(super) fn json_current(&self, key: u64) -> bool {
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
    pub(super) fn set_meta(&mut self, dir: usize, name: &str, text: &[u8], replace: bool) {
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

    pub(super) fn set_metadata(&mut self, dir: usize, text: &[u8], replace: bool) {
        let d = &mut self.dirs[dir];
        if replace || d.metadata == MMetadata::Removed {
            d.metadata_key = fresh(&mut self.next);
        }
        d.metadata = MMetadata::parse(text);
        d.metadata_touched = true;
        d.dirty = true;
    }

    pub(super) fn truncate(&mut self, o: ObjId, len: u64) {
        let obj = self.objects.get_mut(&o).unwrap();
        if len == 0 || len as usize != obj.bytes.len() {
            obj.bytes.resize(len as usize, 0);
            obj.edited = true;
            obj.source = None;
            obj.patched = None;
        }
    }

    /// A write: into a source tensor (or one written in part), within its
    /// length, only the blocks it touches are staged; else the bytes are
    /// copied whole first.
    pub(super) fn write(&mut self, o: ObjId, offset: u64, data: &[u8]) {
        let gguf = self.gguf.is_some();
        let pad_of = |(d, n): &(usize, String), model: &Model| {
            let mapped = &model.dirs[*d].mapped;
            let at = match gguf {
                true => gguf_offsets_in(mapped, n).2,
                false => offsets_in(mapped, n).2,
            };
            at % 4096
        };
        let len = self.objects[&o].bytes.len() as u64;
        let end = offset + data.len() as u64;
        let base = self.objects[&o].source.clone();
        let pad = base.as_ref().map(|b| pad_of(b, self));
        let obj = self.objects.get_mut(&o).unwrap();
        if data.is_empty() || end > len {
            obj.patched = None;
        } else if let (Some(base), Some(pad)) = (base, pad) {
            obj.patched = Some(MPatch {
                base,
                pad,
                blocks: Default::default(),
            });
        }
        if let Some(p) = &mut obj.patched {
            p.blocks
                .extend((offset + p.pad) / 4096..=(end - 1 + p.pad) / 4096);
            if p.staged(0, len) {
                obj.patched = None;
            }
        }
        let end = end as usize;
        if obj.bytes.len() < end {
            obj.bytes.resize(end, 0);
        }
        obj.bytes[offset as usize..end].copy_from_slice(data);
        obj.edited = true;
        obj.source = None;
    }

    /// The directory whose entry holds object `o`.
    pub(super) fn holder(&self, o: ObjId) -> Option<usize> {
        self.dirs
            .iter()
            .position(|d| d.entries.values().any(|e| e.data == Some(o)))
    }

    pub(super) fn edited(&mut self, o: ObjId) {
        if let Some(dir) = self.holder(o) {
            self.dirs[dir].dirty = true;
        }
    }

    /// The copy into staging that a write or a cut to `keep` bytes makes
    /// first must read bytes of a source rewritten in place.
    pub(super) fn copy_fails(&self, o: ObjId, keep: u64) -> bool {
        self.unreadable(o) && keep.min(self.objects[&o].bytes.len() as u64) > 0
    }

    /// A commit must read a GGUF file's arrays from a source rewritten in place.
    pub(super) fn keys_unreadable(&self, dir: usize) -> bool {
        self.dirs[dir].rewritten && self.gguf.as_ref().is_some_and(GState::reads_file_arrays)
    }

    /// Reading the bytes of `o` fails: they are (some of them, written in
    /// part) in a source rewritten in place.
    pub(super) fn unreadable(&self, o: ObjId) -> bool {
        let obj = &self.objects[&o];
        let base = obj
            .source
            .as_ref()
            .or(obj.patched.as_ref().map(|p| &p.base));
        !obj.bytes.is_empty() && base.is_some_and(|(d, _)| self.dirs[*d].rewritten)
    }

    /// Reading `n` bytes of `o` at `offset` fails: some of them are read
    /// from a source rewritten in place.
    pub(super) fn unreadable_at(&self, o: ObjId, offset: u64, n: u64) -> bool {
        let obj = &self.objects[&o];
        let end = (offset + n).min(obj.bytes.len() as u64);
        self.unreadable(o)
            && offset < end
            && obj.patched.as_ref().is_none_or(|p| !p.staged(offset, end))
    }

    /// What `<name>.meta.json` shows.
    pub(super) fn meta_text(&self, dir: usize, name: &str) -> Vec<u8> {
        let e = self.entry(dir, name).unwrap();
        match &e.meta {
            MMeta::Invalid(t) => t.clone(),
            MMeta::Valid(d, s) => {
                let offsets = e.data.and_then(|o| self.objects[&o].origin.as_ref()).map(
                    |(sd, sn)| match self.gguf {
                        Some(_) => gguf_offsets_in(&self.dirs[*sd].mapped, sn),
                        None => offsets_in(&self.dirs[*sd].mapped, sn),
                    },
                );
                render_meta(*d, s, offsets, byte_len(*d, s), name, self.gguf.is_some())
            }
            MMeta::None => unreachable!(),
        }
    }

    /// What file `f` holds now, as a new descriptor would read it: a JSON
    /// file being written is its writers' text.
    pub(super) fn content(&self, f: &FileRef) -> Vec<u8> {
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
    pub(super) fn state_content(&self, f: &FileRef) -> Vec<u8> {
        match f.part {
            Part::Data => {
                let o = self.entry(f.dir, NAMES[f.name]).unwrap().data.unwrap();
                self.objects[&o].bytes.clone()
            }
            Part::Meta => self.meta_text(f.dir, NAMES[f.name]),
            Part::Metadata => match &self.gguf {
                Some(g) => g.metadata_text(),
                None => self.dirs[f.dir].metadata.text().unwrap(),
            },
        }
    }

    /// Why a tensor of this dtype and shape with `len` bytes cannot be
    /// committed, if it cannot: (its bytes, the format).
    pub(super) fn tensor_problems(&self, dtype: usize, shape: &[u64], len: u64) -> Vec<String> {
        let mut out = Vec::new();
        let block_type = DTYPES[dtype].1 > 1;
        if block_type && self.gguf.is_none() {
            // (The safetensors rule, before any size.)
            return vec![format!(
                "{} is a ggml block type: a safetensors file cannot hold it",
                DTYPES[dtype].0
            )];
        }
        if byte_len(dtype, shape) != len {
            out.push(format!(
                "holds {len} bytes but {} [{}] needs {}",
                DTYPES[dtype].0,
                shape
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                byte_len(dtype, shape)
            ));
        }
        if self.gguf.is_some() {
            if ggml_id(dtype).is_none() {
                out.push(format!(
                    "{} is not a ggml type (GGUF cannot hold it)",
                    DTYPES[dtype].0
                ));
            } else if shape.len() > 4 {
                out.push(format!(
                    "has {} dimensions (ggml holds at most 4)",
                    shape.len()
                ));
            } else if shape.last().copied().unwrap_or(1) % DTYPES[dtype].1 != 0 {
                out.push(format!(
                    "its innermost dimension {} is not a multiple of {}'s block of {} elements",
                    shape.last().unwrap(),
                    DTYPES[dtype].0,
                    DTYPES[dtype].1
                ));
            }
        }
        out
    }

    /// Per directory: the problems a commit would refuse.
    pub(super) fn problem_count(&self, dir: usize) -> usize {
        let d = &self.dirs[dir];
        let tensors = d
            .entries
            .values()
            .filter(|e| {
                let meta = if e.hidden { &MMeta::None } else { &e.meta };
                match (meta, e.data) {
                    (MMeta::Invalid(_), _) => true,
                    (MMeta::None, Some(_)) => true,
                    (MMeta::Valid(dt, s), Some(o)) => !self
                        .tensor_problems(*dt, s, self.objects[&o].bytes.len() as u64)
                        .is_empty(),
                    (_, None) => false,
                }
            })
            .count();
        let keys = self.gguf.as_ref().map_or(0, |g| g.status_lines().1.len());
        tensors + usize::from(matches!(d.metadata, MMetadata::Invalid(_))) + keys
    }

    pub(super) fn problems(&self) -> bool {
        (0..self.dirs.len()).any(|d| self.problem_count(d) > 0) || self.in_two_shards()
    }

    /// Whether a tensor name has bytes in two shards (an index cannot say
    /// which: a commit refuses).
    pub(super) fn in_two_shards(&self) -> bool {
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
    pub(super) fn untouched(&self, dir: usize, name: &str, e: &MEntry) -> bool {
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
    pub(super) fn net_changed(&self, dir: usize) -> bool {
        let d = &self.dirs[dir];
        d.metadata_touched
            || self
                .gguf
                .as_ref()
                .is_some_and(|g| !g.unchanged() || g.invalid_document.is_some())
            || d.entries.iter().any(|(n, e)| {
                // (A name that keeps only a hidden meta, its data moved
                // away, is no tensor: nothing a commit writes.)
                let nothing = e.data.is_none()
                    && (e.hidden || e.meta == MMeta::None)
                    && !d.committed.tensors.contains_key(n);
                !nothing && !self.untouched(dir, n, e)
            })
            || d.committed
                .tensors
                .keys()
                .any(|n| !d.entries.contains_key(n))
    }

    /// The lines `stfs status` lists for a shard: its staged changes, then
    /// its problems (a parse error's own words cut off after the rule).
    pub(super) fn status_lines(&self, dir: usize) -> Vec<String> {
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
                (MMeta::Valid(dt, s), Some(len)) => {
                    for rule in self.tensor_problems(*dt, s, len) {
                        problems.push(format!("problem    tensor {name:?} {rule}"));
                    }
                }
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
                        .map(|(k, v)| match v.chars().count() > 60 {
                            false => format!("{k:?}: {v:?}"),
                            true => {
                                let head: String = v.chars().take(60).collect();
                                format!("{k:?}: {head:?}... ({} bytes)", v.len())
                            }
                        })
                        .collect();
                    lines.push(format!("metadata   {{{}}}", pairs.join(", ")));
                }
                MMetadata::Invalid(_) => {}
            }
        }
        if matches!(d.metadata, MMetadata::Invalid(_)) {
            problems.push("problem    __metadata__.json".to_string());
        }
        if let Some(g) = &self.gguf {
            let (changes, key_problems) = g.status_lines();
            lines.extend(changes);
            problems.extend(key_problems);
        }
        lines.extend(problems);
        lines
    }

    /// The reference crate's serialization of a directory.
    pub(super) fn serialized(&self, dir: usize) -> Vec<u8> {
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
    pub(super) fn header_only(&self, dir: usize) -> bool {
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
    pub(super) fn committed(&mut self, dir: usize) {
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
                obj.patched = None;
                tensors.insert(name.clone(), (*dt, s.clone(), o, e.eid, obj.bytes.clone()));
            }
        }
        let metadata = match &d.metadata {
            MMetadata::Valid(m) => m.clone(),
            _ => None,
        };
        d.committed = Committed { tensors, metadata };
        if let Some(g) = self.gguf.as_mut() {
            // The file's keys now: each value shown as the file has it.
            for k in &mut g.keys {
                k.from_file = true;
                k.shown = k
                    .value
                    .as_ref()
                    .expect("committed keys are valid")
                    .file_text();
            }
            g.committed = g.keys.clone();
            g.gone.clear();
            g.renew(&mut self.next);
        }
        d.dirty = false;
        d.replaced = false;
        d.rewritten = false;
        d.detached = false;
        d.metadata_touched = false;
    }

    /// The index file as a commit of the folder leaves it: shards it did
    /// not write as they are on disk now, and none rewritten if one of them
    /// is not a valid checkpoint now.
    pub(super) fn expected_index(&self) -> serde_json::Value {
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

    pub(super) fn attr_perm(&self) -> u16 {
        if self.read_only {
            self.perm & !0o222
        } else {
            self.perm
        }
    }
}
