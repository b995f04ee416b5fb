//! The filesystem view of mounted checkpoints: inodes, names, attributes,
//! directory listings and reads. Plain Rust that tests call without a mount;
//! `fuse.rs` is the thin adapter that turns kernel requests into these calls.
//!
//! Inodes are never reused. Directories and special files come first (1 is the
//! root); tensor `id` (numbered across all checkpoints at mount) has its data
//! file at `first_tensor_ino + 2*id` and its `.meta.json` right after.

mod error;
pub mod fuse;
pub mod names;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use std::time::SystemTime;

pub use error::FsError;
use names::{tensor_file_name, tensor_name, METADATA_FILE, META_SUFFIX, NAME_MAX};

use crate::checkpoint::Checkpoint;
use crate::format::write_entry;

pub type Ino = u64;
pub const ROOT_INO: Ino = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Directory,
    File,
}

/// What `stat` shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    pub ino: Ino,
    pub kind: Kind,
    pub size: u64,
    pub mtime: SystemTime,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
}

/// How an opened file should be cached by the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenMode {
    /// Keep the kernel's page cache across opens: the bytes cannot change.
    pub keep_cache: bool,
    /// Bypass the page cache: generated content whose size may change.
    pub direct_io: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: Ino,
    pub kind: Kind,
    pub name: String,
    /// Offset to pass back to continue after this entry.
    pub next_offset: u64,
}

/// A source to mount: one checkpoint file, or a folder of shards.
pub enum Source {
    File(Checkpoint),
    Folder {
        /// (directory name, checkpoint), sorted by name.
        checkpoints: Vec<(String, Checkpoint)>,
        /// (file name, bytes) of each `*.index.json`, shown as they are.
        indexes: Vec<(String, Vec<u8>)>,
    },
}

/// Mount-wide settings.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub read_only: bool,
    pub uid: u32,
    pub gid: u32,
}

/// A file or directory, as an inode number decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    /// The root of a folder mount.
    FolderRoot,
    /// A checkpoint's directory (the root of a file mount).
    CheckpointDir(usize),
    /// A checkpoint's `__metadata__.json`.
    Metadata(usize),
    /// A shard index file of a folder mount.
    Index(usize),
    /// Tensor data: checkpoint, position in its header.
    Tensor(usize, usize),
    /// A tensor's `.meta.json`.
    Meta(usize, usize),
}

struct Mounted {
    dir_name: String,
    checkpoint: Checkpoint,
    dir_ino: Ino,
    metadata_ino: Ino,
    /// Global id of this checkpoint's first tensor.
    first_id: u64,
    /// File names of tensors too long for one path component (hashed form -> position).
    hashed_names: HashMap<String, usize>,
}

pub struct Fs {
    settings: Settings,
    checkpoints: Vec<Mounted>,
    indexes: Vec<(String, Vec<u8>, Ino)>,
    /// Node of each inode below `first_tensor_ino` (index = ino - 1).
    fixed: Vec<Node>,
    first_tensor_ino: Ino,
    /// (checkpoint, position) of each global tensor id.
    tensors: Vec<(u32, u32)>,
    folder_mtime: SystemTime,
}

impl Fs {
    pub fn new(source: Source, settings: Settings) -> Fs {
        let mut fixed = Vec::new();
        let (list, indexes, folder) = match source {
            Source::File(c) => (vec![(String::new(), c)], Vec::new(), false),
            Source::Folder {
                checkpoints,
                indexes,
            } => (checkpoints, indexes, true),
        };
        if folder {
            fixed.push(Node::FolderRoot);
        }
        let alloc = |fixed: &mut Vec<Node>, node| {
            fixed.push(node);
            fixed.len() as Ino
        };
        let mut checkpoints = Vec::with_capacity(list.len());
        let mut first_id = 0u64;
        for (i, (dir_name, checkpoint)) in list.into_iter().enumerate() {
            let dir_ino = alloc(&mut fixed, Node::CheckpointDir(i));
            let metadata_ino = alloc(&mut fixed, Node::Metadata(i));
            let hashed_names = checkpoint
                .header()
                .tensors
                .iter()
                .enumerate()
                .filter(|(_, t)| names::is_hashed(&t.name))
                .map(|(pos, t)| (tensor_file_name(&t.name), pos))
                .collect();
            let count = checkpoint.header().tensors.len() as u64;
            checkpoints.push(Mounted {
                dir_name,
                checkpoint,
                dir_ino,
                metadata_ino,
                first_id,
                hashed_names,
            });
            first_id += count;
        }
        let indexes = indexes
            .into_iter()
            .enumerate()
            .map(|(i, (name, bytes))| (name, bytes, alloc(&mut fixed, Node::Index(i))))
            .collect();
        let tensors = checkpoints
            .iter()
            .enumerate()
            .flat_map(|(c, m)| {
                (0..m.checkpoint.header().tensors.len()).map(move |p| (c as u32, p as u32))
            })
            .collect();
        let folder_mtime = checkpoints
            .iter()
            .map(|m| m.checkpoint.modified())
            .max()
            .unwrap_or(SystemTime::UNIX_EPOCH);
        Fs {
            settings,
            first_tensor_ino: fixed.len() as Ino + 1,
            checkpoints,
            indexes,
            fixed,
            tensors,
            folder_mtime,
        }
    }

    fn node(&self, ino: Ino) -> Result<Node, FsError> {
        if ino == 0 {
            return Err(FsError::NotFound);
        }
        if ino < self.first_tensor_ino {
            return Ok(self.fixed[(ino - 1) as usize]);
        }
        let rel = ino - self.first_tensor_ino;
        let &(c, p) = self
            .tensors
            .get((rel / 2) as usize)
            .ok_or(FsError::NotFound)?;
        Ok(if rel % 2 == 0 {
            Node::Tensor(c as usize, p as usize)
        } else {
            Node::Meta(c as usize, p as usize)
        })
    }

    fn tensor_ino(&self, c: usize, pos: usize) -> Ino {
        self.first_tensor_ino + 2 * (self.checkpoints[c].first_id + pos as u64)
    }

    fn ino_of(&self, node: Node) -> Ino {
        match node {
            Node::FolderRoot => ROOT_INO,
            Node::CheckpointDir(c) => self.checkpoints[c].dir_ino,
            Node::Metadata(c) => self.checkpoints[c].metadata_ino,
            Node::Index(i) => self.indexes[i].2,
            Node::Tensor(c, p) => self.tensor_ino(c, p),
            Node::Meta(c, p) => self.tensor_ino(c, p) + 1,
        }
    }

    pub fn lookup(&self, parent: Ino, name: &str) -> Result<Attr, FsError> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let node = match self.node(parent)? {
            Node::FolderRoot => {
                if let Some(c) = self.checkpoints.iter().position(|m| m.dir_name == name) {
                    Node::CheckpointDir(c)
                } else if let Some(i) = self.indexes.iter().position(|(n, _, _)| n == name) {
                    Node::Index(i)
                } else {
                    return Err(FsError::NotFound);
                }
            }
            Node::CheckpointDir(c) => self.lookup_in_checkpoint(c, name)?,
            _ => return Err(FsError::NotADirectory),
        };
        self.getattr(self.ino_of(node))
    }

    fn lookup_in_checkpoint(&self, c: usize, name: &str) -> Result<Node, FsError> {
        if name == METADATA_FILE {
            return Ok(Node::Metadata(c));
        }
        let (file, meta) = match name.strip_suffix(META_SUFFIX) {
            Some(stem) => (stem, true),
            None => (name, false),
        };
        let m = &self.checkpoints[c];
        let pos = match m.hashed_names.get(file) {
            Some(&pos) => pos,
            None => {
                let tensor = tensor_name(file).ok_or(FsError::NotFound)?;
                m.checkpoint
                    .header()
                    .index_of(&tensor)
                    .ok_or(FsError::NotFound)?
            }
        };
        Ok(if meta {
            Node::Meta(c, pos)
        } else {
            Node::Tensor(c, pos)
        })
    }

    pub fn getattr(&self, ino: Ino) -> Result<Attr, FsError> {
        let node = self.node(ino)?;
        let (kind, size, mtime) = match node {
            Node::FolderRoot => (Kind::Directory, 0, self.folder_mtime),
            Node::CheckpointDir(c) => (
                Kind::Directory,
                0,
                self.checkpoints[c].checkpoint.modified(),
            ),
            Node::Index(i) => (
                Kind::File,
                self.indexes[i].1.len() as u64,
                self.folder_mtime,
            ),
            Node::Tensor(c, p) => {
                let cp = &self.checkpoints[c].checkpoint;
                (Kind::File, cp.header().tensors[p].nbytes(), cp.modified())
            }
            Node::Meta(..) | Node::Metadata(_) => {
                let c = match node {
                    Node::Meta(c, _) | Node::Metadata(c) => c,
                    _ => unreachable!(),
                };
                let size = self.generated(node).map_or(0, |b| b.len() as u64);
                (Kind::File, size, self.checkpoints[c].checkpoint.modified())
            }
        };
        let (perm, nlink) = match kind {
            Kind::Directory => (0o755, 2),
            Kind::File if self.settings.read_only || matches!(node, Node::Index(_)) => (0o444, 1),
            Kind::File => (0o644, 1),
        };
        Ok(Attr {
            ino,
            kind,
            size,
            mtime,
            perm,
            nlink,
            uid: self.settings.uid,
            gid: self.settings.gid,
        })
    }

    /// Content of the files stfs generates (meta, metadata, index).
    fn generated(&self, node: Node) -> Option<Vec<u8>> {
        match node {
            Node::Meta(c, p) => {
                let h = self.checkpoints[c].checkpoint.header();
                let t = &h.tensors[p];
                let mut out = Vec::with_capacity(128);
                write_entry(&mut out, t);
                out.pop(); // reopen the object to add the derived fields
                out.extend_from_slice(
                    format!(
                        ",\"nbytes\":{},\"file_offset\":{},\"name\":{}}}\n",
                        t.nbytes(),
                        h.data_start() + t.data_offsets.0,
                        serde_json::to_string(&t.name).expect("a string serializes")
                    )
                    .as_bytes(),
                );
                Some(out)
            }
            Node::Metadata(c) => {
                let meta = &self.checkpoints[c].checkpoint.header().metadata;
                let mut out = match meta {
                    Some(m) => serde_json::to_vec(m).expect("a string map serializes"),
                    None => b"{}".to_vec(),
                };
                out.push(b'\n');
                Some(out)
            }
            Node::Index(i) => Some(self.indexes[i].1.clone()),
            _ => None,
        }
    }

    /// Checks an open request; `write` is any write access or truncation.
    pub fn open(&self, ino: Ino, write: bool) -> Result<OpenMode, FsError> {
        let node = self.node(ino)?;
        if matches!(node, Node::FolderRoot | Node::CheckpointDir(_)) {
            return Err(FsError::IsADirectory);
        }
        if write {
            // The write path is not built yet: every mount is read-only.
            return Err(FsError::ReadOnly);
        }
        Ok(match node {
            Node::Tensor(..) | Node::Index(_) => OpenMode {
                keep_cache: true,
                direct_io: false,
            },
            _ => OpenMode {
                keep_cache: false,
                direct_io: true,
            },
        })
    }

    /// Serves `size` bytes at `offset` to `reply`: tensor bytes straight from the
    /// mapping, generated files from a small buffer.
    pub fn read<R>(
        &self,
        ino: Ino,
        offset: u64,
        size: u32,
        reply: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, FsError> {
        match self.node(ino)? {
            Node::FolderRoot | Node::CheckpointDir(_) => Err(FsError::IsADirectory),
            Node::Tensor(c, p) => Ok(self.checkpoints[c]
                .checkpoint
                .serve_tensor(p, offset, size, reply)),
            node => {
                let bytes: Cow<[u8]> = match node {
                    Node::Index(i) => Cow::Borrowed(&self.indexes[i].1),
                    _ => Cow::Owned(self.generated(node).unwrap_or_default()),
                };
                let start = (offset.min(bytes.len() as u64)) as usize;
                let end = (start as u64 + size as u64).min(bytes.len() as u64) as usize;
                Ok(reply(&bytes[start..end]))
            }
        }
    }

    /// Directory entries after `offset` (0 to start), in a stable order:
    /// `.`, `..`, then the entries; each carries the offset that follows it.
    pub fn readdir(
        &self,
        ino: Ino,
        offset: u64,
        mut add: impl FnMut(DirEntry) -> bool,
    ) -> Result<(), FsError> {
        let node = self.node(ino)?;
        let parent = ROOT_INO;
        let count = match node {
            Node::FolderRoot => self.checkpoints.len() + self.indexes.len(),
            Node::CheckpointDir(c) => 1 + 2 * self.checkpoints[c].checkpoint.header().tensors.len(),
            _ => return Err(FsError::NotADirectory),
        };
        let total = 2 + count as u64;
        for k in offset..total {
            let (ino, kind, name) = match k {
                0 => (ino, Kind::Directory, ".".to_string()),
                1 => (parent, Kind::Directory, "..".to_string()),
                _ => self.entry_at(node, (k - 2) as usize),
            };
            let full = add(DirEntry {
                ino,
                kind,
                name,
                next_offset: k + 1,
            });
            if full {
                break;
            }
        }
        Ok(())
    }

    fn entry_at(&self, dir: Node, k: usize) -> (Ino, Kind, String) {
        match dir {
            Node::FolderRoot if k < self.checkpoints.len() => {
                let m = &self.checkpoints[k];
                (m.dir_ino, Kind::Directory, m.dir_name.clone())
            }
            Node::FolderRoot => {
                let (name, _, ino) = &self.indexes[k - self.checkpoints.len()];
                (*ino, Kind::File, name.clone())
            }
            Node::CheckpointDir(c) if k == 0 => (
                self.checkpoints[c].metadata_ino,
                Kind::File,
                METADATA_FILE.into(),
            ),
            Node::CheckpointDir(c) => {
                let p = (k - 1) / 2;
                let file =
                    tensor_file_name(&self.checkpoints[c].checkpoint.header().tensors[p].name);
                if (k - 1) % 2 == 0 {
                    (self.tensor_ino(c, p), Kind::File, file)
                } else {
                    (self.tensor_ino(c, p) + 1, Kind::File, file + META_SUFFIX)
                }
            }
            _ => unreachable!("entry_at on a file"),
        }
    }

    /// The folder holding the source, for statfs.
    pub fn backing_dir(&self) -> &Path {
        self.checkpoints
            .first()
            .and_then(|m| m.checkpoint.path().parent())
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
    }

    pub fn settings(&self) -> Settings {
        self.settings
    }
}

#[cfg(test)]
mod tests;
