//! The `*.index.json` files a commit of a folder mount rewrites to match
//! its shards (`weight_map`, `metadata.total_size`), and their writing
//! beside the shards' files (or their PUT, for a folder in a store).

use std::sync::Arc;

use tracing::warn;

use super::commit::remote::{IndexPut, RemoteIndex};
use super::commit::{CommitOptions, Landing, Written};
use super::shards::Shards;
use super::{CommitError, CommitPlan};
use crate::source::Folder;
use crate::source::{FileStat, SourceFile};

/// Writes each index a commit rewrites beside the shards' files (a temp
/// file, its mode and ACLs those of the index as it is), or queues its PUT
/// for a store.
pub(super) fn write_indexes(
    index_updates: &[IndexUpdate],
    options: CommitOptions,
    written: &mut Vec<Box<dyn Landing>>,
) -> Result<(), CommitError> {
    for update in index_updates {
        let IndexUpdate {
            folder,
            name,
            stat,
            bytes,
            remote,
        } = update;
        if let Some((index, unwritten)) = remote {
            let put = IndexPut::new(index.clone(), bytes.clone(), *stat, unwritten.clone())
                .forced(options.force);
            written.push(Box::new(put));
            continue;
        }
        let fill = |f: &std::fs::File| {
            use std::os::unix::fs::FileExt;
            crate::testpoint::io("write")
                .and_then(|()| f.write_all_at(bytes, 0))
                .map_err(|source| CommitError::Io {
                    what: format!("writing {}", folder.path.join(name).display()),
                    source,
                })
        };
        // The index as it is now: its mode, ACLs and attributes are carried over.
        let now = match folder.open_file(
            std::ffi::OsStr::new(name),
            libc::O_RDONLY | libc::O_NONBLOCK,
            0,
        ) {
            Ok(f) => Some(f),
            // (Gone, or a link: the commit puts a file of its own there.)
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => None,
            Err(source) => {
                return Err(CommitError::Io {
                    what: format!("reading {}", folder.path.join(name).display()),
                    source,
                });
            }
        };
        let w = Written::create(folder, std::ffi::OsStr::new(name), stat, now.as_ref(), fill)?;
        written.push(Box::new(w));
    }
    Ok(())
}

/// An index a commit rewrites.
pub(super) struct IndexUpdate {
    pub(super) folder: Arc<Folder>,
    pub(super) name: String,
    /// As read.
    pub(super) stat: FileStat,
    pub(super) bytes: Vec<u8>,
    /// Its object in a store, and the shards it lists that this commit
    /// does not write (each must still be the version mounted: the index
    /// lists their tensors as mounted).
    pub(super) remote: Option<(RemoteIndex, Vec<Arc<SourceFile>>)>,
}

/// The `*.index.json` files of a folder mount, rewritten to match the shards
/// as the plans will leave them (`weight_map`, `metadata.total_size`). Shards
/// this commit does not write are read as they are on disk now (another
/// mount may have committed them), and named as the folder shows them (a
/// link's name, not its target's).
pub(super) fn index_updates<S: Shards>(
    st: &S,
    plans: &[(usize, CommitPlan)],
) -> Result<Vec<IndexUpdate>, CommitError> {
    let Some(folder) = st.folder() else {
        return Ok(Vec::new());
    };
    let mut weight_map = serde_json::Map::new();
    let mut total: u64 = 0;
    for c in 0..st.count() {
        let live = st.live(c);
        let shard = format!("{}.safetensors", st.shard_name(c));
        let names: Vec<(String, u64)> = match plans.iter().find(|(pc, _)| *pc == c) {
            Some((_, plan)) => plan
                .layout
                .tensors
                .iter()
                .map(|t| (t.name.to_string(), t.nbytes()))
                .collect(),
            None => match shard_tensors_now(live.source())? {
                Some(names) => names,
                None => return Ok(Vec::new()),
            },
        };
        for (name, n) in names {
            total += n;
            weight_map.insert(name, serde_json::Value::String(shard.clone()));
        }
    }
    let unwritten = || {
        (0..st.count())
            .filter(|c| !plans.iter().any(|(pc, _)| pc == c))
            .map(|c| st.live(c).source().clone())
            .collect::<Vec<_>>()
    };
    let mut out = Vec::new();
    for ix in st.indexes() {
        // An index lists every shard's tensor names: never into a file of
        // someone who cannot read a shard.
        let hidden = st.lives().find(|live| {
            live.source()
                .file()
                .and_then(|f| FileStat::of(f).ok())
                .is_some_and(|shard| readable_by_more(&ix.stat, &shard))
        });
        if let Some(live) = hidden {
            warn!(
                file = ix.name,
                shard = %live.source().path().display(),
                "left as it is: its owner cannot read this shard, whose tensors it would list"
            );
            continue;
        }
        match rewrite_index(&ix.bytes, &weight_map, total) {
            Ok(Some(bytes)) => out.push(IndexUpdate {
                folder: folder.clone(),
                name: ix.name.clone(),
                stat: ix.stat,
                bytes,
                remote: ix.remote.clone().map(|index| (index, unwritten())),
            }),
            Ok(None) => {}
            Err(why) => warn!(file = ix.name, "{why}: left as it is"),
        }
    }
    Ok(out)
}

/// An index file's text with `weight_map` and `metadata.total_size` set,
/// its other fields kept, as a commit writes it (None: nothing to change).
pub fn rewrite_index(
    text: &[u8],
    weight_map: &serde_json::Map<String, serde_json::Value>,
    total: u64,
) -> Result<Option<Vec<u8>>, &'static str> {
    let mut doc: serde_json::Value = serde_json::from_slice(text).map_err(|_| "not JSON")?;
    let obj = doc.as_object_mut().ok_or("not a JSON object")?;
    let before = serde_json::Value::Object(obj.clone());
    obj.insert(
        "weight_map".into(),
        serde_json::Value::Object(weight_map.clone()),
    );
    let meta = obj
        .entry("metadata")
        .or_insert_with(|| serde_json::Value::Object(Default::default()));
    if let Some(meta) = meta.as_object_mut() {
        meta.insert("total_size".into(), total.into());
    }
    if doc == before {
        return Ok(None);
    }
    let mut bytes = serde_json::to_vec_pretty(&doc).expect("JSON serializes");
    bytes.push(b'\n');
    Ok(Some(bytes))
}

/// Whether the owner of `to` (who may read it, and give it to anyone) is
/// someone who may not read `from`: a file of another user's that a commit
/// would copy `from`'s tensor names into (an index beside a link to a private
/// checkpoint). Judged by modes and owners; root may read anything.
fn readable_by_more(to: &FileStat, from: &FileStat) -> bool {
    let can = |who: u32| from.mode & (0o4 << who) != 0;
    let (other, group, owner) = (0, 3, 6);
    let may_read = to.uid == 0
        || can(other)
        || (to.uid == from.uid && can(owner))
        || (to.gid == from.gid && can(group));
    !may_read
}

/// A shard's tensors (name, bytes) as its file on disk has them now; None
/// (and a warning) if that file is not a valid checkpoint now: the index is
/// then left as it is.
fn shard_tensors_now(src: &SourceFile) -> Result<Option<Vec<(String, u64)>>, CommitError> {
    let of = |h: &crate::format::Header| {
        h.tensors
            .iter()
            .map(|t| (t.name.to_string(), t.nbytes()))
            .collect()
    };
    let Some(folder) = src.folder() else {
        return Ok(Some(of(src.header())));
    };
    let io = |e| CommitError::Io {
        what: format!("reading {} for the index", src.path().display()),
        source: e,
    };
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let file = folder.open_file(src.file_name(), flags, 0).map_err(io)?;
    if FileStat::of(&file).map_err(io)?.same_version(src.stat()) {
        return Ok(Some(of(src.header())));
    }
    match crate::format::Header::read(&file).map_err(io)? {
        Ok(h) => Ok(Some(of(&h))),
        Err(e) => {
            warn!(
                file = %src.path().display(),
                "changed since mounted and not valid now ({e}): the index files are left as they are"
            );
            Ok(None)
        }
    }
}
