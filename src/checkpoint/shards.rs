//! What a commit needs of a mount's checkpoints (`Shards`, which the
//! filesystem's state implements), and the index files of a folder mount.

use std::sync::Arc;

use super::Live;
use super::commit::remote::RemoteIndex;
use super::model_change::{Landed, ModelChange};
use crate::source::{FileStat, Folder};

/// A `*.index.json` of a folder mount, as read at mount time (and rewritten by commits).
#[derive(Clone)]
pub struct IndexFile {
    pub name: String,
    pub bytes: Vec<u8>,
    pub stat: FileStat,
    /// An object of a folder of shards in a store (None: a file in the
    /// mount's folder).
    pub remote: Option<RemoteIndex>,
}

/// What a commit needs of the checkpoints of a mount.
pub trait Shards {
    fn count(&self) -> usize;
    fn live(&self, c: usize) -> &Live;
    fn live_mut(&mut self, c: usize) -> &mut Live;
    /// The shard's name in its folder, without `.safetensors` (for the index).
    fn shard_name(&self, c: usize) -> &str;
    /// The folder of a folder mount.
    fn folder(&self) -> Option<&Arc<Folder>>;
    /// That folder as the user named it: its path, or a remote prefix's URL.
    fn folder_shown(&self) -> Option<std::path::PathBuf> {
        let folder = self.folder()?;
        let first = (self.count() > 0).then(|| self.live(0).source());
        Some(match first.and_then(|s| s.remote_object()) {
            Some(o) => o
                .url()
                .strip_suffix(o.file_name())
                .unwrap_or(o.url())
                .into(),
            None => folder.path.clone(),
        })
    }
    fn indexes(&self) -> Box<dyn Iterator<Item = &IndexFile> + '_>;
    fn index_mut(&mut self, name: &str) -> Option<&mut IndexFile>;

    fn lives(&self) -> Box<dyn Iterator<Item = &Live> + '_> {
        Box::new((0..self.count()).map(|c| self.live(c)))
    }

    /// The folder's other files that a commit writes or removes.
    fn model_changes(&self) -> Vec<ModelChange> {
        Vec::new()
    }
    /// Those changes, taken by a commit (kept staged until it landed).
    fn model_commit_begins(&mut self) -> Vec<ModelChange> {
        self.model_changes()
    }
    /// Those that landed, each with its new file (None: removed).
    fn model_landed(&mut self, _landed: &[(ModelChange, Option<Landed>)]) {}
    /// The commit that took them gave up before anything landed.
    fn model_commit_abandoned(&mut self) {}
    /// Drops the staged model files; the names that had changes.
    fn discard_model_files(&mut self) -> std::io::Result<Vec<String>> {
        Ok(Vec::new())
    }
}
