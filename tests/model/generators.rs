//! The operations the model runs, and the strategies that draw them.

use super::*;

pub(super) fn dtype_of(name: &str) -> Option<usize> {
    DTYPES.iter().position(|d| d.0 == name)
}

/// Bytes of `dtype` x `shape` (a whole number of blocks: `sized`).
pub(super) fn byte_len(dtype: usize, shape: &[u64]) -> u64 {
    shape.iter().product::<u64>() / DTYPES[dtype].1 * DTYPES[dtype].2
}

/// Whether `shape` is a whole number of `dtype`'s blocks (a meta that is
/// not is invalid: it has no size).
pub(super) fn sized(dtype: usize, shape: &[u64]) -> bool {
    shape.iter().product::<u64>() % DTYPES[dtype].1 == 0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    Data,
    Meta,
    Metadata,
}

/// A file of a checkpoint directory: (dir, name, part).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileRef {
    pub(super) dir: usize,
    pub(super) name: usize,
    pub(super) part: Part,
}

/// What is written to a JSON file.
#[derive(Debug, Clone)]
pub(super) enum Text {
    Meta(usize, Vec<u64>),
    BadDtype,
    NotJson,
    Metadata(Option<(String, String)>),
    BadMetadata,
}

impl Text {
    pub(super) fn bytes(&self) -> Vec<u8> {
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
pub(super) enum Op {
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
    /// `echo TEXT > __kv__/KEY` (a key of `KEYS`): a new key if absent.
    KvWrite {
        key: usize,
        text: KvText,
    },
    KvUnlink(usize),
    /// `mv __kv__/FROM __kv__/TO`.
    KvRename {
        from: usize,
        to: usize,
        no_replace: bool,
    },
    /// `__metadata__.json` of a GGUF file written: the keys as shown, edited.
    KvDocument(DocEdit),
}

pub(super) fn shape() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        4 => prop::collection::vec(0u64..4, 0..6),
        1 => prop::collection::vec(0u64..40, 1..2),
        // (Q8_0's block: 32 elements, innermost or not.)
        1 => (0u64..3, any::<bool>()).prop_map(|(k, inner)| if inner { vec![k, 32] } else { vec![32, k] }),
    ]
}

pub(super) fn meta_text() -> impl Strategy<Value = Text> {
    prop_oneof![
        4 => (0..DTYPES.len(), shape()).prop_map(|(d, s)| Text::Meta(d, s)),
        1 => Just(Text::BadDtype),
        1 => Just(Text::NotJson),
    ]
}

pub(super) fn metadata_text() -> impl Strategy<Value = Text> {
    prop_oneof![
        3 => prop::option::of(("[a-z]{1,3}", "[a-z]{0,3}")).prop_map(Text::Metadata),
        1 => Just(Text::BadMetadata),
    ]
}

pub(super) fn any_text() -> impl Strategy<Value = Text> {
    prop_oneof![meta_text(), metadata_text()]
}

/// A data or meta file (a GGUF file's `__metadata__.json` is its keys:
/// `Op::KvDocument` writes it).
pub(super) fn tensor_file_ref() -> impl Strategy<Value = FileRef> {
    (0..NAMES.len(), any::<bool>()).prop_map(|(name, data)| FileRef {
        dir: 0,
        name,
        part: if data { Part::Data } else { Part::Meta },
    })
}

pub(super) fn file_ref(dirs: usize) -> impl Strategy<Value = FileRef> {
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

/// Where a write goes: mostly near the start, sometimes at the block edges
/// of the large source tensor "b" (a write into it stages only the blocks
/// it touches: `BIG` bytes, over three blocks).
pub(super) fn write_offset(near: u64) -> impl Strategy<Value = u64> + Clone {
    prop_oneof![
        6 => 0..near,
        1 => 4085u64..4100,
        1 => 8185u64..8200,
        1 => (BIG - 20)..BIG + 4,
    ]
}

/// What a write writes: mostly a few bytes, sometimes more than a block.
pub(super) fn write_bytes() -> impl Strategy<Value = Vec<u8>> + Clone {
    prop_oneof![
        9 => prop::collection::vec(any::<u8>(), 1..12),
        1 => prop::collection::vec(any::<u8>(), 4000..4200),
    ]
}

pub(super) fn op(dirs: usize) -> impl Strategy<Value = Op> {
    let d = 0..dirs;
    let n = 0..NAMES.len();
    let bytes = write_bytes();
    let h = 0..MAX_HANDLES;
    prop_oneof![
        3 => (d.clone(), n.clone(), any::<bool>())
            .prop_map(|(dir, name, exclusive)| Op::Create { dir, name, exclusive }),
        3 => (d.clone(), n.clone(), write_offset(16), bytes.clone())
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
        2 => (h.clone(), write_offset(40), 1u32..40).prop_map(|(k, o, s)| Op::HandleRead(k, o, s)),
        2 => (h.clone(), write_offset(8), bytes).prop_map(|(k, o, b)| Op::HandleWrite(k, o, b)),
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

/// The operations on a GGUF file mount: those on tensors, and on keys.
pub(super) fn op_gguf() -> impl Strategy<Value = Op> {
    let n = 0..NAMES.len();
    let bytes = write_bytes();
    let h = 0..MAX_HANDLES;
    let k = 0..KEYS.len();
    prop_oneof![
        2 => (n.clone(), any::<bool>())
            .prop_map(|(name, exclusive)| Op::Create { dir: 0, name, exclusive }),
        3 => (n.clone(), write_offset(40), bytes.clone())
            .prop_map(|(name, offset, data)| Op::Write { dir: 0, name, offset, data }),
        2 => (n.clone(), 0u64..40).prop_map(|(name, len)| Op::Truncate { dir: 0, name, len }),
        1 => (n.clone(), meta_text()).prop_map(|(name, text)| Op::WriteJson { dir: 0, name, text }),
        4 => (n, meta_text()).prop_map(|(name, text)| Op::SetMeta { dir: 0, name, text }),
        2 => tensor_file_ref().prop_map(Op::Unlink),
        3 => (tensor_file_ref(), tensor_file_ref(), any::<bool>())
            .prop_map(|(from, to, no_replace)| Op::Rename { from, to, no_replace }),
        2 => (tensor_file_ref(), any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(file, write, truncate)| Op::Open { file, write: write || truncate, truncate }),
        1 => (h.clone(), write_offset(40), 1u32..40).prop_map(|(k, o, s)| Op::HandleRead(k, o, s)),
        1 => (h.clone(), write_offset(8), bytes).prop_map(|(k, o, b)| Op::HandleWrite(k, o, b)),
        1 => h.clone().prop_map(Op::Fstat),
        1 => h.prop_map(Op::Close),
        6 => (k.clone(), kv_text()).prop_map(|(key, text)| Op::KvWrite { key, text }),
        2 => k.clone().prop_map(Op::KvUnlink),
        2 => (k.clone(), k, any::<bool>())
            .prop_map(|(from, to, no_replace)| Op::KvRename { from, to, no_replace }),
        2 => doc_edit().prop_map(Op::KvDocument),
        3 => (any::<bool>(), prop::bool::weighted(0.1))
            .prop_map(|(force, other_user)| Op::Commit { force, other_user }),
        1 => Just(Op::CompactCommit),
        1 => Just(Op::Discard),
        1 => any::<bool>().prop_map(|in_place| Op::ReplaceSource { dir: 0, in_place }),
        2 => Just(Op::Status),
        1 => Just(Op::Remount),
    ]
}
