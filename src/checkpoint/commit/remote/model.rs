//! The other files of a model folder in a store (`config.json`, the
//! tokenizer's...) in a commit: each changed file put whole, each removed
//! file deleted, after the shards and with the indexes, under the same
//! record (the next mount finishes them once every shard is new). Each is
//! conditional on the version mounted: `If-Match` its ETag, or, for a new
//! name, `If-None-Match: *`.

use super::*;
use crate::checkpoint::model_change::ModelChange;
use crate::checkpoint::staging::BODY_PREFIX;

/// Where the model files of a folder of objects go: the store and the
/// prefix of `shard`, one of its objects.
pub fn model_landings(
    shard: &SourceFile,
    changes: &[ModelChange],
    force: bool,
) -> Result<Vec<Box<dyn Landing>>, CommitError> {
    let objects = model_objects(shard, changes, force)?;
    Ok(objects
        .into_iter()
        .map(|o| Box::new(o) as Box<dyn Landing>)
        .collect())
}

/// Why the commit of each change would be refused now: its object changed
/// in the store since it was mounted (a HEAD each; for `stfs status`).
pub fn model_conflicts(shard: &SourceFile, changes: &[ModelChange]) -> Vec<String> {
    let objects = match model_objects(shard, changes, false) {
        Ok(objects) => objects,
        Err(e) => return vec![e.to_string()],
    };
    objects
        .iter()
        .filter_map(|o| o.check().err())
        .map(|e| e.to_string())
        .collect()
}

fn model_objects(
    shard: &SourceFile,
    changes: &[ModelChange],
    force: bool,
) -> Result<Vec<ModelObject>, CommitError> {
    let object = shard.remote_object().ok_or_else(|| CommitError::ReadOnly {
        file: shard.path().to_path_buf(),
    })?;
    let mut parts: Vec<_> = object.path().parts().collect();
    parts.pop();
    let prefix = object_store::path::Path::from_iter(parts);
    let mut out = Vec::new();
    for change in changes {
        let key = key_of(&prefix, &change.name)?;
        let url = object.remote().url(&key);
        let version = match (&change.base, force) {
            (_, true) => Version::Any,
            (None, false) => Version::Nothing,
            (Some(_), false) => Version::Etag(change.etag.clone().unwrap_or_default()),
        };
        out.push(ModelObject {
            remote: object.remote().clone(),
            key,
            url,
            bytes: change.bytes.clone(),
            version,
            like: change.like,
            headers: change.headers.clone(),
            etag: Mutex::new(None),
        });
    }
    Ok(out)
}

/// The key of model file `name` beside the shards: the name as listed (a
/// name is not encoded again: `config.json~` is that key, not `%7E`).
fn key_of(
    prefix: &object_store::path::Path,
    name: &str,
) -> Result<object_store::path::Path, CommitError> {
    let key = match prefix.as_ref() {
        "" => name.to_string(),
        p => format!("{p}/{name}"),
    };
    object_store::path::Path::parse(&key).map_err(|e| CommitError::Io {
        what: format!("the key of {name}"),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
    })
}

/// What a model object must still be for the commit to replace it.
#[derive(Clone, PartialEq)]
enum Version {
    /// The one mounted (or last committed), by its ETag.
    Etag(String),
    /// No object: a new name.
    Nothing,
    /// Whatever it is (`--force`).
    Any,
}

/// A model file of a folder in a store that a commit puts (`bytes`) or
/// deletes (None).
struct ModelObject {
    remote: Arc<crate::source::remote::Remote>,
    key: object_store::path::Path,
    url: String,
    /// (Shared with the mount's table: copied only into a request body.)
    bytes: Option<Arc<Vec<u8>>>,
    version: Version,
    like: FileStat,
    /// The headers of the object it replaces, which it keeps.
    headers: s3::ObjectHeaders,
    /// Its ETag once put.
    etag: Mutex<Option<String>>,
}

impl ModelObject {
    fn file(&self) -> PathBuf {
        PathBuf::from(&self.url)
    }

    fn writer(&self) -> Result<&Arc<S3Writer>, CommitError> {
        self.remote
            .writer()
            .ok_or_else(|| CommitError::ReadOnly { file: self.file() })
    }

    /// The key is still as the commit found it (unless forced).
    fn check(&self) -> Result<(), CommitError> {
        let now = match &self.version {
            Version::Any => return Ok(()),
            _ => self.remote.run(self.writer()?.etag_now(&self.key)),
        };
        let now = now.map_err(remote_err(&self.file()))?;
        let same = match &self.version {
            Version::Etag(e) => now.as_deref() == Some(e.as_str()),
            _ => now.is_none(),
        };
        match same {
            true => Ok(()),
            false => Err(CommitError::Conflict { file: self.file() }),
        }
    }

    /// `check` while the commit lands: a file changed since is another
    /// writer's version that stands (`--force` no longer applies here).
    fn check_landing(&self) -> Result<(), CommitError> {
        self.check().map_err(|e| match e {
            CommitError::Conflict { file } => CommitError::ModelFileReplaced { file },
            e => e,
        })
    }

    fn if_match(&self) -> Option<&str> {
        match &self.version {
            Version::Etag(e) => Some(e),
            _ => None,
        }
    }

    fn put(&self, bytes: &[u8]) -> Result<(), CommitError> {
        let writer = self.writer()?;
        let file = self.file();
        crate::testpoint::point("remote:model").map_err(io_err("putting a model file"))?;
        // Asked again right before (the shards' landing may have taken
        // minutes; a store that ignores the condition has this check).
        self.check_landing()?;
        let body = bytes::Bytes::copy_from_slice(bytes);
        let put = match self.version {
            Version::Nothing => {
                let put = writer.put_new(&self.key, body, &self.headers);
                self.remote.run(put)
            }
            _ => {
                let put = writer.put(&self.key, body, self.if_match(), &self.headers);
                self.remote.run(put)
            }
        };
        let expected = s3::put_etag(bytes);
        let etag = match put {
            Ok(etag) => etag,
            Err(e) => landed_anyway(&self.remote, &self.key, Some(&expected), &e, &file)
                .ok_or_else(|| refused_or_failed(&file, e))?,
        };
        *self.etag.lock_anyway() = Some(etag);
        Ok(())
    }

    fn delete(&self) -> Result<(), CommitError> {
        let writer = self.writer()?;
        let file = self.file();
        crate::testpoint::point("remote:model").map_err(io_err("removing a model file"))?;
        self.check_landing()?;
        match self.remote.run(writer.delete(&self.key, self.if_match())) {
            Ok(()) => Ok(()),
            // (Sent again after a lost answer, it finds the key gone.)
            Err(e) => match self.remote.run(writer.etag_now(&self.key)) {
                Ok(None) => Ok(()),
                _ => Err(refused_or_failed(&file, e)),
            },
        }
    }
}

/// The staging folder's file that keeps the bytes of the object at `key`
/// put whole, for the record.
pub(super) fn body_name(key: &object_store::path::Path) -> String {
    let tag = crate::checkpoint::in_place::sha256_hex(&[key.as_ref().as_bytes()]);
    format!("{BODY_PREFIX}{}", &tag[..16])
}

/// A model file's request refused by its condition (412): another
/// writer's version, not the shards' "--force cannot rebuild" (a model file
/// is put whole), nor the plain conflict's "commit --force" (the commit is
/// landing: the landing's error says what comes next).
fn refused_or_failed(file: &std::path::Path, e: S3Error) -> CommitError {
    match e {
        S3Error::Precondition { .. } => CommitError::ModelFileReplaced {
            file: file.to_path_buf(),
        },
        e => remote_err(file)(e),
    }
}

impl Landing for ModelObject {
    fn stat(&self) -> FileStat {
        FileStat {
            len: self.bytes.as_ref().map_or(0, |b| b.len() as u64),
            ..self.like
        }
    }

    fn target(&self) -> PathBuf {
        self.file()
    }

    fn record(&self, renames: &mut Renames, dir: &StagingDir) -> Result<(), CommitError> {
        self.check()?;
        let body = match &self.bytes {
            Some(bytes) => {
                let name = body_name(&self.key);
                dir.write_atomic(&name, bytes)
                    .map_err(io_err(format!("keeping {} for the record", self.url)))?;
                Some(name)
            }
            None => None,
        };
        renames.remote.push(RemoteLanding {
            url: self.url.clone(),
            key: self.key.to_string(),
            if_match: self.if_match().map(str::to_string),
            expected: self.bytes.as_ref().map(|b| s3::put_etag(b)),
            body,
            fresh: self.version == Version::Nothing,
            remove: self.bytes.is_none(),
            headers: self.headers.clone(),
            ..Default::default()
        });
        Ok(())
    }

    fn land(&self, _dir: &StagingDir) -> Result<(), Unlanded> {
        match &self.bytes {
            Some(bytes) => self.put(bytes),
            None => self.delete(),
        }
        .map_err(Unlanded::unchanged)
    }

    /// (Nothing was sent before `land`.)
    fn remove(&self) {}

    fn etag(&self) -> Option<String> {
        self.etag.lock_anyway().clone()
    }

    fn fresh(&self, _old: &SourceFile, _header: Header) -> Result<SourceFile, CommitError> {
        Err(CommitError::Io {
            what: self.url.clone(),
            source: std::io::Error::other("a model file is not a checkpoint"),
        })
    }

    fn reads_as(&self) -> Option<Result<Header, CommitError>> {
        None
    }
}
