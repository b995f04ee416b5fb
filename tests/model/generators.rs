//! The operations the model runs, and the strategies that draw them.

use super::*;

pub(super) fn dtype_of(name: &str) -> Option<usize> {
    DTYPES.iter().position(|(n, _)| *n == name)
}

pub(super) fn byte_len(dtype: usize, shape: &[u64]) -> u64 {
    shape.iter().product::<u64>() * DTYPES[dtype].1 / 8
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
}

pub(super) fn shape() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        4 => prop::collection::vec(0u64..4, 0..4),
        1 => prop::collection::vec(0u64..40, 1..2),
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

pub(super) fn op(dirs: usize) -> impl Strategy<Value = Op> {
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
