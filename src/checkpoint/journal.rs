//! The journal of a checkpoint's staged edits, in its staging folder: one
//! line of JSON per edit (a list of records), appended as edits happen and
//! fsynced on fsync and close. After a crash, replaying it over the source it
//! began on gives back every edit that reached it. It is rewritten whole (a
//! snapshot) after a commit, and when it grows past twice the live edits.
//!
//! A commit marks its plan (`Plan`) and, just before its rename, the file it
//! is about to put in place (`Landing`). Replay after a crash in between
//! finds out which file is there: the old one (replay everything) or the new
//! one (the planned edits are in it: replay only what came after `Plan`,
//! reading source tensors at their place in the new file).

use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::meta::{Meta, MetadataDoc};
use crate::format::gguf::write::KvType;
use crate::source::FileStat;

pub const VERSION: u32 = 1;

/// A key in the journal: the source's value under the same name, or text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    pub key: String,
    #[serde(rename = "type")]
    pub ty: KvType,
    /// None: the value the source has under this key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<Text>,
}

/// Bytes in the journal: a string when they are UTF-8 (a template is
/// readable there), else their numbers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Text {
    Utf8(String),
    Bytes(Vec<u8>),
}

impl Text {
    pub(super) fn of(bytes: &[u8]) -> Text {
        match std::str::from_utf8(bytes) {
            Ok(s) => Text::Utf8(s.to_string()),
            Err(_) => Text::Bytes(bytes.to_vec()),
        }
    }

    pub(super) fn into_bytes(self) -> Vec<u8> {
        match self {
            Text::Utf8(s) => s.into_bytes(),
            Text::Bytes(b) => b,
        }
    }
}

/// Where a name's bytes are, as the journal records them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataRef {
    Empty,
    /// Tensor `index` of a source file (`shard`: another checkpoint of a folder
    /// mount, by file name); `committed`: its index in the file of the commit
    /// in flight, if it is in it.
    Source {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<String>,
        /// The version of that other shard the index is of.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<FileStat>,
        index: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        committed: Option<u32>,
    },
    /// A file of the staging folder.
    Staged {
        file: String,
    },
    /// A source tensor (`base`, a `Source`) with the blocks `runs` (ranges
    /// of the tensor) written in staging file `file`; `Record::Patch`
    /// records add to the runs.
    Patched {
        file: String,
        base: Box<DataRef>,
        runs: Vec<(u64, u64)>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Record {
    /// First record: the source these edits apply to.
    Begin {
        version: u32,
        source: PathBuf,
        stat: FileStat,
    },
    /// The whole state of a name (replaces what came before for it).
    Entry {
        name: String,
        meta: Meta,
        data: Option<DataRef>,
    },
    /// The name is gone (nothing to list under it).
    Gone {
        name: String,
    },
    Metadata {
        doc: MetadataDoc,
    },
    /// A GGUF file's keys, the whole table (replaces what came before).
    Keys {
        keys: Vec<KeyRecord>,
    },
    /// More blocks of a partly staged tensor were written (in its staging
    /// file, by name): add these runs to the ones recorded for the file.
    Patch {
        file: String,
        runs: Vec<(u64, u64)>,
    },
    /// A commit took its plan: edits before this are in it.
    Plan {
        commit: u64,
    },
    /// That commit is about to rename this file over the source.
    Landing {
        commit: u64,
        stat: FileStat,
    },
}

/// A journal file, opened for appending once the first edit needs it.
pub struct Journal {
    name: String,
    file: Option<std::sync::Arc<File>>,
    /// Records since the last snapshot.
    pub appended: usize,
    /// Bytes appended since the last snapshot, and the snapshot's size.
    pub appended_bytes: u64,
    pub snapshot_bytes: u64,
    /// An append failed: durability is lost until a snapshot succeeds.
    pub broken: bool,
    /// The journal's length, and how far its blocks are allocated (an
    /// append within them cannot meet a full disk).
    len: u64,
    room: u64,
}

/// Room kept ahead of the journal's end: a full staging filesystem refuses
/// an edit before it changes anything, not its journal line after.
pub const ROOM: u64 = 1 << 20;

impl Journal {
    pub fn new(name: String) -> Journal {
        Journal {
            name,
            file: None,
            appended: 0,
            appended_bytes: 0,
            snapshot_bytes: 0,
            broken: false,
            len: 0,
            room: 0,
        }
    }

    /// Makes the journal (with its first record, `begin`) if there is none,
    /// and room for `need` more bytes of lines ahead of its end (blocks
    /// allocated, the length unchanged), or fails: before an edit changes
    /// anything, so that an edit the disk has no room to journal is refused.
    pub fn make_room(
        &mut self,
        folder: &crate::source::Folder,
        begin: impl FnOnce() -> Record,
        need: u64,
    ) -> std::io::Result<()> {
        if self.file.is_none() {
            self.open_new(folder, begin)?;
        }
        if self.len.saturating_add(need) <= self.room {
            return Ok(());
        }
        let f = self.file.as_ref().expect("opened above");
        let grow = need.max(ROOM);
        crate::testpoint::io("reserve")?;
        match rustix::fs::fallocate(&**f, rustix::fs::FallocateFlags::KEEP_SIZE, self.len, grow) {
            Ok(()) => self.room = self.len + grow,
            // (A filesystem that cannot: appends may meet a full disk.)
            Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS) => self.room = u64::MAX,
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// Creates the journal with its first record.
    fn open_new(
        &mut self,
        folder: &crate::source::Folder,
        begin: impl FnOnce() -> Record,
    ) -> std::io::Result<()> {
        // Never truncate one that is there: it may hold edits still to
        // rewrite. One without a whole line holds none (a crash cut its first
        // append short; the mount that adopted its folder found nothing in it).
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_APPEND;
        let name = OsStr::new(&self.name);
        let f = match folder.open_file(name, flags, 0o600) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) && holds_nothing(folder, name) => {
                folder.unlink(name)?;
                folder.open_file(name, flags, 0o600)?
            }
            other => other?,
        };
        let mut line = serde_json::to_vec(&[begin()]).expect("records serialize");
        line.push(b'\n');
        crate::testpoint::io("journal:append")?;
        (&f).write_all(&line)?;
        self.file = Some(std::sync::Arc::new(f));
        (self.len, self.room) = (line.len() as u64, 0);
        Ok(())
    }

    /// Grown well past what a snapshot of the live edits takes (in records,
    /// or in bytes: a large `__metadata__.json` written again and again).
    pub fn wants_snapshot(&self, live_entries: usize) -> bool {
        self.appended > 4096 + 2 * live_entries
            || self.appended_bytes > (64 << 20) + 2 * self.snapshot_bytes
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn exists(&self) -> bool {
        self.file.is_some()
    }

    /// Appends one line; `begin` is written first when the file is new. A
    /// journal that is `broken` (an append or a rewrite failed) takes no more
    /// lines: a torn one in the middle would make all of it unreadable. Only
    /// a rewrite (`Live::snapshot`) mends it.
    pub fn append(
        &mut self,
        folder: &crate::source::Folder,
        begin: impl FnOnce() -> Record,
        records: &[Record],
    ) -> std::io::Result<()> {
        if self.broken {
            return Err(std::io::Error::other("the journal must be rewritten first"));
        }
        if self.file.is_none() {
            self.open_new(folder, begin)?;
        }
        let mut line = serde_json::to_vec(records).expect("records serialize");
        line.push(b'\n');
        let f = self.file.as_ref().expect("opened above");
        // One write per line: a crash tears at most the last line, which replay skips.
        crate::testpoint::io("journal:append")?;
        (&**f).write_all(&line)?;
        self.len += line.len() as u64;
        self.appended += records.len();
        self.appended_bytes += line.len() as u64;
        Ok(())
    }

    pub fn sync(&self) -> std::io::Result<()> {
        match &self.file {
            Some(f) => crate::testpoint::synced(f, f.sync_data()),
            None => Ok(()),
        }
    }

    /// The open journal, to fsync without holding the state (None when
    /// nothing was journaled). Not to be used while `broken`.
    pub fn handle(&self) -> Option<std::sync::Arc<File>> {
        self.file.clone()
    }

    /// Replaces the journal with `records` (a Begin first), atomically.
    pub fn rewrite(
        &mut self,
        staging: &crate::source::StagingDir,
        records: &[Record],
    ) -> std::io::Result<()> {
        let mut text = Vec::new();
        for r in records {
            serde_json::to_writer(&mut text, &[r]).expect("records serialize");
            text.push(b'\n');
        }
        // The old journal stays in place (and open) until the new one is.
        let reopened = staging.write_atomic(&self.name, &text).and_then(|()| {
            staging
                .folder()?
                .open_file(OsStr::new(&self.name), libc::O_WRONLY | libc::O_APPEND, 0)
        });
        match reopened {
            Ok(f) => {
                self.file = Some(std::sync::Arc::new(f));
                self.appended = 0;
                self.appended_bytes = 0;
                self.snapshot_bytes = text.len() as u64;
                (self.len, self.room) = (text.len() as u64, 0);
                self.broken = false;
                Ok(())
            }
            Err(e) => {
                self.broken = true;
                Err(e)
            }
        }
    }

    /// Removes the journal. If that fails it stays, and is `broken`: the
    /// next edit or fsync rewrites it whole from the state.
    pub fn remove(&mut self, staging: &crate::source::StagingDir) -> std::io::Result<()> {
        self.file = None;
        self.appended = 0;
        let removed = staging
            .folder()
            .and_then(|folder| folder.unlink(OsStr::new(&self.name)));
        self.broken = match &removed {
            Err(e) => e.raw_os_error() != Some(libc::ENOENT),
            Ok(()) => false,
        };
        removed.or_else(|e| match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(()),
            _ => Err(e),
        })
    }
}

/// Whether journal `name` in `folder` holds not one whole line.
fn holds_nothing(folder: &crate::source::Folder, name: &OsStr) -> bool {
    let Ok(f) = folder.open_file(name, libc::O_RDONLY | libc::O_NONBLOCK, 0) else {
        return false;
    };
    let mut text = Vec::new();
    std::io::Read::read_to_end(&mut &f, &mut text).is_ok() && !text.contains(&b'\n')
}

/// A journal read back: its first record and the lines after it.
pub struct Replay {
    pub source: PathBuf,
    pub stat: FileStat,
    pub records: Vec<Record>,
    /// A torn last line was skipped.
    pub torn: bool,
}

/// Why a journal cannot be replayed.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("empty journal")]
    Empty,
    #[error("line {line}: {source}")]
    Line {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("journal version {found}, this stfs reads {VERSION}")]
    Version { found: u32 },
    #[error("does not start with a Begin record")]
    NoBegin,
}

impl crate::errno::ToErrno for JournalError {
    /// A journal that cannot be read back is damaged data: EIO.
    fn to_errno(&self) -> i32 {
        libc::EIO
    }
}

pub fn read(text: &[u8]) -> Result<Replay, JournalError> {
    let mut lines = text.split(|&b| b == b'\n').filter(|l| !l.is_empty());
    let first = lines.next().ok_or(JournalError::Empty)?;
    let begin: Vec<Record> =
        serde_json::from_slice(first).map_err(|source| JournalError::Line { line: 1, source })?;
    let (source, stat) = match begin.first() {
        Some(Record::Begin {
            version: VERSION,
            source,
            stat,
        }) => (source.clone(), *stat),
        Some(Record::Begin { version, .. }) => {
            return Err(JournalError::Version { found: *version });
        }
        _ => return Err(JournalError::NoBegin),
    };
    let mut records = Vec::new();
    let mut torn = false;
    let rest: Vec<&[u8]> = lines.collect();
    for (k, line) in rest.iter().enumerate() {
        match serde_json::from_slice::<Vec<Record>>(line) {
            Ok(batch) => records.extend(batch),
            // Only the last line may be torn by a crash.
            Err(_) if k + 1 == rest.len() => torn = true,
            Err(source) => {
                return Err(JournalError::Line {
                    line: k + 2,
                    source,
                });
            }
        }
    }
    Ok(Replay {
        source,
        stat,
        records,
        torn,
    })
}

/// The final state of every name the records touch, in order of first touch:
/// `None` for a name that is gone. With `after_plan`, only records after the
/// `Plan` of that commit count, and source references are taken at their
/// place in that commit's file.
/// A name's final state in a journal: its meta and data, or gone.
pub type NameState = Option<(Meta, Option<DataRef>)>;

pub struct Folded {
    pub names: Vec<(String, NameState)>,
    pub metadata: Option<MetadataDoc>,
    /// A GGUF file's keys, if edited.
    pub keys: Option<Vec<KeyRecord>>,
    /// References to tensors that the landed commit did not keep.
    pub dropped: Vec<String>,
    /// Runs that `Record::Patch` records add to the partly staged tensor
    /// in each staging file.
    pub patches: std::collections::HashMap<String, Vec<(u64, u64)>>,
}

impl Folded {
    /// No edit to take back.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
            && self.metadata.is_none()
            && self.keys.is_none()
            && self.patches.is_empty()
    }
}

/// A source reference as it is in the file a commit landed (its index
/// there), or None if the commit did not keep it.
fn at_commit(data: &DataRef) -> Option<DataRef> {
    match data {
        DataRef::Source {
            shard,
            version,
            committed,
            ..
        } => committed.map(|j| DataRef::Source {
            shard: shard.clone(),
            version: *version,
            index: j,
            committed: None,
        }),
        DataRef::Patched { file, base, runs } => Some(DataRef::Patched {
            file: file.clone(),
            base: Box::new(at_commit(base)?),
            runs: runs.clone(),
        }),
        other => Some(other.clone()),
    }
}

pub fn fold(records: &[Record], after_plan: Option<u64>) -> Folded {
    let start = match after_plan {
        Some(commit) => records
            .iter()
            .rposition(|r| matches!(r, Record::Plan { commit: c } if *c == commit))
            .map_or(records.len(), |p| p + 1),
        None => 0,
    };
    let mut order: Vec<String> = Vec::new();
    let mut state: std::collections::HashMap<String, NameState> = std::collections::HashMap::new();
    let mut metadata = None;
    let mut keys = None;
    let mut dropped = Vec::new();
    let mut patches = std::collections::HashMap::new();
    for r in &records[start..] {
        let (name, value) = match r {
            Record::Entry { name, meta, data } => {
                let data = match (data, after_plan) {
                    (Some(d), Some(_)) => match at_commit(d) {
                        Some(d) => Some(d),
                        None => {
                            dropped.push(name.clone());
                            continue;
                        }
                    },
                    (d, _) => d.clone(),
                };
                (name, Some((meta.clone(), data)))
            }
            Record::Gone { name } => (name, None),
            Record::Metadata { doc } => {
                metadata = Some(doc.clone());
                continue;
            }
            Record::Keys { keys: k } => {
                keys = Some(k.clone());
                continue;
            }
            Record::Patch { file, runs } => {
                patches
                    .entry(file.clone())
                    .or_insert_with(Vec::new)
                    .extend_from_slice(runs);
                continue;
            }
            _ => continue,
        };
        if !state.contains_key(name) {
            order.push(name.clone());
        }
        state.insert(name.clone(), value);
    }
    Folded {
        names: order
            .into_iter()
            .map(|n| {
                let v = state.remove(&n).expect("recorded");
                (n, v)
            })
            .collect(),
        metadata,
        keys,
        dropped,
        patches,
    }
}

/// The commit whose `Landing` names `stat`, if any.
pub fn landed(records: &[Record], stat: &FileStat) -> Option<u64> {
    records.iter().rev().find_map(|r| match r {
        Record::Landing { commit, stat: s } if s.same_version(stat) => Some(*commit),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Dtype;

    fn stat(ino: u64) -> FileStat {
        FileStat {
            dev: 1,
            ino,
            len: 10,
            mtime: (1, 2),
            mode: 0o100644,
            uid: 0,
            gid: 0,
        }
    }

    fn valid() -> Meta {
        Meta::Valid {
            dtype: Dtype::U8,
            shape: vec![2],
        }
    }

    fn text(records: &[Vec<Record>]) -> Vec<u8> {
        let mut out = Vec::new();
        for line in records {
            serde_json::to_writer(&mut out, line).unwrap();
            out.push(b'\n');
        }
        out
    }

    #[test]
    fn replays_in_order_and_skips_a_torn_last_line() {
        let begin = Record::Begin {
            version: VERSION,
            source: "/m.safetensors".into(),
            stat: stat(1),
        };
        let mut t = text(&[
            vec![begin],
            vec![Record::Entry {
                name: "b".into(),
                meta: valid(),
                data: Some(DataRef::Source {
                    shard: None,
                    version: None,
                    index: 0,
                    committed: None,
                }),
            }],
            vec![Record::Gone { name: "a".into() }],
            vec![Record::Entry {
                name: "b".into(),
                meta: Meta::None,
                data: Some(DataRef::Staged { file: "s1".into() }),
            }],
        ]);
        t.extend_from_slice(b"[{\"op\":\"gone\",\"na");
        let r = read(&t).unwrap();
        assert!(r.torn);
        assert_eq!(r.stat, stat(1));
        let f = fold(&r.records, None);
        assert_eq!(f.names.len(), 2);
        assert_eq!(f.names[0].0, "b");
        assert_eq!(
            f.names[0].1,
            Some((Meta::None, Some(DataRef::Staged { file: "s1".into() })))
        );
        assert_eq!(f.names[1], ("a".to_string(), None));
        // A torn line in the middle is corruption, not a crash.
        let mut bad = t.clone();
        bad.extend_from_slice(b"\n[]\n");
        assert!(read(&bad).is_err());
    }

    /// A GGUF tensor's block type comes back from the journal (a line that
    /// did not parse was taken for a torn one: the edit was lost).
    #[test]
    fn every_dtype_comes_back() {
        let begin = Record::Begin {
            version: VERSION,
            source: "/m.gguf".into(),
            stat: stat(1),
        };
        let entries: Vec<Record> = Dtype::ALL
            .into_iter()
            .chain(Dtype::GGML_BLOCKS)
            .map(|dtype| Record::Entry {
                name: dtype.name().into(),
                meta: Meta::Valid {
                    dtype,
                    shape: vec![256],
                },
                data: Some(DataRef::Staged { file: "s1".into() }),
            })
            .collect();
        let r = read(&text(&[vec![begin], entries.clone()])).unwrap();
        assert!(!r.torn);
        assert_eq!(r.records, entries);
    }

    #[test]
    fn after_a_landed_commit_only_later_edits_count() {
        let records = vec![
            Record::Entry {
                name: "x".into(),
                meta: valid(),
                data: Some(DataRef::Staged { file: "s1".into() }),
            },
            Record::Plan { commit: 3 },
            Record::Entry {
                name: "y".into(),
                meta: valid(),
                data: Some(DataRef::Source {
                    shard: None,
                    version: None,
                    index: 5,
                    committed: Some(1),
                }),
            },
            Record::Entry {
                name: "z".into(),
                meta: valid(),
                data: Some(DataRef::Source {
                    shard: None,
                    version: None,
                    index: 6,
                    committed: None,
                }),
            },
            Record::Landing {
                commit: 3,
                stat: stat(9),
            },
        ];
        assert_eq!(landed(&records, &stat(9)), Some(3));
        assert_eq!(landed(&records, &stat(1)), None);
        let f = fold(&records, Some(3));
        assert_eq!(f.names.len(), 1);
        assert_eq!(
            f.names[0].1.as_ref().unwrap().1,
            Some(DataRef::Source {
                shard: None,
                version: None,
                index: 1,
                committed: None
            })
        );
        assert_eq!(f.dropped, vec!["z".to_string()]);
    }
}
