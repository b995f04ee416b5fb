//! A folder's `*.index.json` object: its version, and the PUT that
//! rewrites it once every shard is new.

use super::*;

/// The lost-update refusal of an index says so (`--force` does help there).
fn as_index_conflict(e: CommitError) -> CommitError {
    match e {
        CommitError::RemoteConflict { file } => CommitError::IndexConflict { file },
        e => e,
    }
}

/// A `*.index.json` object of a folder of shards in a store: where it is,
/// and the ETag of the version shown (a commit's PUT of it is conditional
/// on that ETag, and sets it to the new one).
#[derive(Clone)]
pub struct RemoteIndex {
    pub remote: Arc<crate::source::remote::Remote>,
    pub path: object_store::path::Path,
    pub etag: Arc<Mutex<Option<String>>>,
    /// Its own headers, kept by the PUT that rewrites it.
    pub headers: s3::ObjectHeaders,
}

impl RemoteIndex {
    /// Whether the key holds another version than the one shown now (a
    /// HEAD; a failed one says no: the commit asks again).
    pub fn changed(&self) -> bool {
        let Some(writer) = self.remote.writer() else {
            return false;
        };
        let shown = self.etag.lock_anyway().clone();
        match self.remote.run(writer.etag_now(&self.path)) {
            Ok(now) => now != shown,
            Err(_) => false,
        }
    }
}

/// An index object of a commit of a folder of shards, put whole after every
/// shard landed, only over the version shown (unless forced).
pub struct IndexPut {
    index: RemoteIndex,
    bytes: bytes::Bytes,
    if_match: Option<String>,
    stat: FileStat,
    /// The shards it lists that the commit does not write: each must still
    /// be the version mounted (unless forced), or the index would list
    /// tensors another writer's object does not hold.
    unwritten: Vec<Arc<SourceFile>>,
    force: bool,
}

impl IndexPut {
    pub fn new(
        index: RemoteIndex,
        bytes: Vec<u8>,
        stat: FileStat,
        unwritten: Vec<Arc<SourceFile>>,
    ) -> IndexPut {
        let if_match = index.etag.lock_anyway().clone();
        IndexPut {
            index,
            bytes: bytes::Bytes::from(bytes),
            if_match,
            stat,
            unwritten,
            force: false,
        }
    }

    /// `--force`: put over whatever is there.
    pub fn forced(mut self, force: bool) -> IndexPut {
        if force {
            self.if_match = None;
            self.force = true;
        }
        self
    }

    fn url(&self) -> String {
        self.index.remote.url(&self.index.path)
    }

    /// The index, and every shard it lists that the commit does not write,
    /// are still the versions mounted (unless forced).
    fn check(&self) -> Result<(), CommitError> {
        let file = PathBuf::from(self.url());
        let remote = &self.index.remote;
        still_mounted(remote, &self.index.path, self.if_match.as_deref(), &file)
            .map_err(as_index_conflict)?;
        for shard in self.unwritten.iter().filter(|_| !self.force) {
            if let Some(o) = shard.remote_object() {
                still_mounted(o.remote(), o.path(), o.etag(), shard.path()).map_err(
                    |e| match e {
                        CommitError::RemoteConflict { file } => {
                            CommitError::ListedShardChanged { file }
                        }
                        e => e,
                    },
                )?;
            }
        }
        Ok(())
    }

    fn put(&self) -> Result<(), CommitError> {
        let remote = &self.index.remote;
        let file = PathBuf::from(self.url());
        let err = remote_err(&file);
        let writer = remote
            .writer()
            .ok_or_else(|| CommitError::ReadOnly { file: file.clone() })?;
        let key = &self.index.path;
        crate::testpoint::point("remote:index").map_err(io_err("putting the index"))?;
        still_mounted(remote, key, self.if_match.as_deref(), &file).map_err(as_index_conflict)?;
        let expected = s3::put_etag(&self.bytes);
        let (body, headers) = (self.bytes.clone(), &self.index.headers);
        let put = remote.run(writer.put(key, body, self.if_match.as_deref(), headers));
        let etag = match put {
            Ok(etag) => etag,
            Err(e) => {
                landed_anyway(remote, key, Some(&expected), &e, &file).ok_or_else(|| err(e))?
            }
        };
        *self.index.etag.lock_anyway() = Some(etag);
        info!(file = %file.display(), "index put to the store");
        Ok(())
    }
}

impl Landing for IndexPut {
    fn reads_as(&self) -> Option<Result<Header, CommitError>> {
        None
    }

    fn stat(&self) -> FileStat {
        FileStat {
            len: self.bytes.len() as u64,
            ..self.stat
        }
    }

    fn target(&self) -> PathBuf {
        PathBuf::from(self.url())
    }

    fn record(&self, renames: &mut Renames, _dir: &StagingDir) -> Result<(), CommitError> {
        self.check()?;
        renames.remote.push(RemoteLanding {
            url: self.url(),
            key: self.index.path.to_string(),
            if_match: self.if_match.clone(),
            expected: Some(s3::put_etag(&self.bytes)),
            upload: None,
            parts: Vec::new(),
            // (An index is JSON text that stfs wrote.)
            text: Some(String::from_utf8_lossy(&self.bytes).into_owned()),
            headers: self.index.headers.clone(),
            ..Default::default()
        });
        Ok(())
    }

    fn land(&self, _dir: &StagingDir) -> Result<(), Unlanded> {
        self.put().map_err(Unlanded::unchanged)
    }

    /// (Nothing was sent before `land`.)
    fn remove(&self) {}

    fn fresh(&self, _old: &SourceFile, _header: Header) -> Result<SourceFile, CommitError> {
        Err(CommitError::Io {
            what: self.url(),
            source: std::io::Error::other("an index is not a checkpoint"),
        })
    }
}
