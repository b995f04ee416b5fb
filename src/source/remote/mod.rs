//! Remote checkpoints: an object in S3 (or an S3-compatible store), GCS, Azure
//! or behind HTTP, read through `object_store`, by ranges that follow tensor
//! boundaries, into a local disk cache that serves every later read.
//!
//! - The header is read with one ranged GET (a second if it is longer than the
//!   first guess) and validated exactly as a local one.
//! - The data section is cut into chunks of up to 8 MiB: small tensors share a
//!   chunk, large ones are cut at 8 MiB from their start. A chunk is fetched
//!   once (a read waiting for a chunk another read is fetching waits for that
//!   fetch), with `If-Match` on the ETag seen at mount: an object replaced
//!   behind the mount gives EIO, never mixed bytes. A read at a tensor's
//!   start, and sequential reads after it, fetch its next chunks ahead, in
//!   parallel (docs/SEMANTICS.md, "Remote sources").
//! - Chunks are kept in files of the cache folder (`<object>.<offset>.chunk`:
//!   the bytes, then an HMAC of name and bytes under the cache's own key, and
//!   their length), written to a temp file and
//!   renamed, so that two mounts can share the folder; a file that does not
//!   check out is fetched again. The least recently used go when the cache
//!   passes its size.
//! - No lock is held across network I/O, and every fetch is bounded in time.

mod cache;
mod connect;
mod fetch;
mod object;
pub mod s3;
use crate::errno::{ToErrno, with_causes};
use crate::sync::LockAnyway;
pub use cache::*;
use fetch::*;
pub use object::*;

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::StreamExt;
use lru::LruCache;
use memmap2::{Advice, Mmap};
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, RetryConfig};
use ring::hmac;
use tracing::{info, warn};

use crate::format::{FormatError, Header, MAX_HEADER_LEN, PREFIX_LEN};
use crate::source::{FileStat, Folder};

/// Bytes fetched at once, at most.
pub const CHUNK: u64 = 8 << 20;
/// The first GET of an object: the header of most checkpoints fits.
const FIRST_GET: u64 = 1 << 20;
/// The largest GGUF header read from a remote object (a 256,000-token
/// vocabulary takes a few MiB): a claimed longer string is not fetched.
const MAX_GGUF_HEADER: u64 = 256 << 20;
/// Chunks fetched ahead of a sequential reader, at first and at most.
const FIRST_WINDOW: usize = 4;
const MAX_WINDOW: usize = 16;
/// Cache files kept mapped (2 GiB of address space at most).
const MAPPED: usize = 256;

/// How a remote source is reached and cached.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// An S3-compatible endpoint (else AWS_ENDPOINT_URL, else AWS).
    pub endpoint: Option<String>,
    pub cache_dir: PathBuf,
    pub cache_size: u64,
    /// GETs in flight at once.
    pub concurrency: usize,
    /// A read whose server does not answer fails after this long.
    pub timeout: Duration,
}

/// Why a remote fetch failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    /// The object is not the version seen at mount.
    #[error(
        "the object was replaced since it was mounted (its ETag changed): its bytes are not served"
    )]
    Replaced,
    #[error("the server did not answer in time")]
    TimedOut,
    #[error("{0}")]
    Store(String),
    #[error("the local cache: {0}")]
    Cache(String),
}

impl crate::errno::ToErrno for FetchError {
    /// A reader (cat, dd) says "Input/output error"; the log says why.
    fn to_errno(&self) -> i32 {
        libc::EIO
    }
}

/// Why a remote source could not be reached, listed or read at mount.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The URL, or the store's settings, with what is wrong.
    #[error("{url}: {why}")]
    Url { url: String, why: String },
    /// A request to the store failed: the URL and the causes.
    #[error("{0}")]
    Request(String),
    #[error("starting the network runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The local disk cache.
    #[error(transparent)]
    Cache(#[from] crate::source::FolderError),
}

crate::failure_from!(RemoteError);

impl ToErrno for RemoteError {
    fn to_errno(&self) -> i32 {
        match self {
            RemoteError::Url { .. } => libc::EINVAL,
            RemoteError::Request(_) => libc::EIO,
            RemoteError::Runtime(e) => e.to_errno(),
            RemoteError::Cache(e) => e.to_errno(),
        }
    }
}

impl RemoteError {
    fn url(url: &str, why: impl Into<String>) -> RemoteError {
        RemoteError::Url {
            url: url.to_string(),
            why: why.into(),
        }
    }
}

/// Whether a source names a remote object.
pub fn is_url(source: &str) -> bool {
    source.contains("://")
}

/// A connection to a store, with its runtime and the local cache.
pub struct Remote {
    /// Always Some but in `drop`.
    runtime: Option<tokio::runtime::Runtime>,
    cache: Arc<DiskCache>,
    fetcher: Fetcher,
    /// Read-ahead fetches under way, and how many may be (fewer than the
    /// GETs allowed at once, so that a reader's own fetch never waits behind
    /// read-ahead).
    ahead: Arc<AtomicUsize>,
    max_ahead: usize,
    /// `scheme://bucket` (or the HTTP origin), to show object paths as URLs.
    origin: String,
    /// What commits to an S3 store (None: the store is read-only to stfs).
    writer: Option<Arc<s3::S3Writer>>,
}

impl Drop for Remote {
    fn drop(&mut self) {
        // At unmount: fetches still under way (read-ahead) are abandoned, not
        // waited for; their temp files are removed as their writers drop.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// What a URL names: one object, or a folder (a prefix ending in `/`).
pub struct Location {
    pub remote: Arc<Remote>,
    pub path: ObjectPath,
    pub folder: bool,
}

fn store_error(url: &str, e: object_store::Error) -> String {
    match e {
        object_store::Error::NotFound { .. } => format!("{url}: not found"),
        object_store::Error::Precondition { .. } => format!("{url}: {}", FetchError::Replaced),
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => {
            format!("{url}: access denied: {e}")
        }
        e => {
            let mut said = with_causes(&e);
            // A store's XML error answer, said by its code and message rather
            // than dumped ("NoSuchBucket: The specified bucket does not exist").
            if let (Some(at), Some(code), Some(message)) = (
                said.find("<?xml").or_else(|| said.find("<Error>")),
                s3::xml_tag(&said, "Code"),
                s3::xml_tag(&said, "Message"),
            ) {
                said = format!("{}{code}: {message}", &said[..at]);
            }
            // object_store's last resort for credentials is the instance metadata service.
            let hint = if said.contains("169.254.169.254") {
                " (no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or \
                 AWS_PROFILE with ~/.aws/credentials)"
            } else {
                ""
            };
            format!("{url}: {said}{hint}")
        }
    }
}

impl Remote {
    /// The URL of an object of this store.
    pub fn url(&self, path: &ObjectPath) -> String {
        format!("{}/{path}", self.origin)
    }

    /// What commits to this store: None where stfs cannot write to it
    /// (HTTP, GCS and Azure: no ranged server-side copy).
    pub fn writer(&self) -> Option<&Arc<s3::S3Writer>> {
        self.writer.as_ref()
    }

    /// Starts a request of the writer's on this store's runtime, to be
    /// waited for later (`run` the handle).
    pub fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime().spawn(f)
    }

    /// Runs a request of the writer's on this store's runtime.
    pub fn run<F: std::future::Future>(&self, f: F) -> F::Output {
        self.block_on(f)
    }

    /// The folder where edits of this store's objects are staged.
    pub fn edits_folder(&self) -> Result<Folder, crate::source::FolderError> {
        self.cache.edits_folder()
    }

    /// The cache folder.
    pub fn cache_folder(&self) -> &Folder {
        self.cache.folder()
    }

    /// What `stfs status` says of the network and the cache.
    pub fn summary(&self) -> String {
        let (used, limit, dir) = self.cache.usage();
        let n = self.fetcher.requests.load(Ordering::Relaxed);
        let commits = match &self.writer {
            Some(w) if w.sent.requests.load(Ordering::Relaxed) > 0 => format!(
                "; commits: {} requests, {} bytes uploaded, {} bytes copied by the server",
                w.sent.requests.load(Ordering::Relaxed),
                w.sent.uploaded.load(Ordering::Relaxed),
                w.sent.copied.load(Ordering::Relaxed)
            ),
            _ => String::new(),
        };
        format!(
            "remote: {n} request{}, {} bytes of tensor data fetched; cache {} of {} bytes used in {}{commits}",
            if n == 1 { "" } else { "s" },
            self.fetcher.fetched.load(Ordering::Relaxed),
            used,
            limit,
            dir.display()
        )
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("a runtime until dropped")
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.runtime().block_on(f)
    }

    /// The objects in a folder (not below it): (file name, path).
    /// The objects directly under `prefix`: (name, path, size).
    pub fn list(&self, prefix: &ObjectPath) -> Result<Vec<(String, ObjectPath, u64)>, RemoteError> {
        let url = self.url(prefix);
        let f = &self.fetcher;
        self.block_on(async {
            f.requests.fetch_add(1, Ordering::Relaxed);
            let listed = tokio::time::timeout(f.timeout, f.store.list_with_delimiter(Some(prefix)))
                .await
                .map_err(|_| RemoteError::Request(format!("{url}: {}", FetchError::TimedOut)))?
                .map_err(|e| RemoteError::Request(store_error(&url, e)))?;
            Ok(listed
                .objects
                .into_iter()
                // The listed path is the object's own: joining its name to the
                // prefix again would encode it twice.
                .filter_map(|o| Some((o.location.filename()?.to_string(), o.location, o.size)))
                .collect())
        })
    }

    /// A whole (small) object, an index file: its bytes and ETag.
    pub fn get_all(&self, path: &ObjectPath) -> Result<(Vec<u8>, Option<String>), RemoteError> {
        self.get_whole(path).map(|(bytes, etag, _)| (bytes, etag))
    }

    /// A whole (small) object, a model file: its bytes, ETag and own headers.
    pub fn get_whole(
        &self,
        path: &ObjectPath,
    ) -> Result<(Vec<u8>, Option<String>, s3::ObjectHeaders), RemoteError> {
        let url = self.url(path);
        let f = &self.fetcher;
        self.block_on(async {
            f.requests.fetch_add(1, Ordering::Relaxed);
            let got = tokio::time::timeout(f.timeout, async {
                let got = f.store.get(path).await?;
                let etag = got.meta.e_tag.clone();
                let headers = s3::object_headers(&got.attributes);
                Ok::<_, object_store::Error>((got.bytes().await?, etag, headers))
            })
            .await
            .map_err(|_| RemoteError::Request(format!("{url}: {}", FetchError::TimedOut)))?
            .map_err(|e| RemoteError::Request(store_error(&url, e)))?;
            Ok((got.0.to_vec(), got.1, got.2))
        })
    }

    /// Opens an object: reads and validates its header (one ranged GET, or
    /// two if the header is longer than the first guess).
    pub fn open(self: &Arc<Self>, path: &ObjectPath) -> Result<(RemoteObject, Header), OpenError> {
        let url = self.url(path);
        let f = &self.fetcher;
        let (first, size, etag, modified, headers) = self
            .block_on(async {
                f.requests.fetch_add(1, Ordering::Relaxed);
                tokio::time::timeout(f.timeout, async {
                    let got = f
                        .store
                        .get_opts(
                            path,
                            GetOptions::new().with_range(Some(GetRange::Bounded(0..FIRST_GET))),
                        )
                        .await?;
                    let meta = got.meta.clone();
                    let headers = s3::object_headers(&got.attributes);
                    Ok::<_, object_store::Error>((got.bytes().await?, meta, headers))
                })
                .await
            })
            .map_err(|_| OpenError::Fetch(format!("{url}: {}", FetchError::TimedOut)))?
            .map(|(bytes, meta, headers)| {
                let m = meta;
                (bytes, m.size, m.e_tag, m.last_modified, headers)
            })
            .map_err(|e| OpenError::Fetch(store_error(&url, e)))?;
        let mut prefix = first.to_vec();
        let version = ObjectVersion {
            size,
            etag: etag.clone(),
            modified: modified.into(),
        };
        if crate::format::gguf::is_gguf(&prefix) {
            let (header, mut head) = self.gguf_header(path, &url, prefix, &version)?;
            // The head is kept to the data start: the padding after the
            // tensor infos too, which the parse did not need.
            let data_start = header.data_start().min(size);
            if (head.len() as u64) < data_start {
                let rest = self
                    .fetch_range(path, version.clone(), head.len() as u64..data_start)
                    .map_err(|e| OpenError::Fetch(format!("{url}: {e}")))?;
                head.extend_from_slice(&rest);
            }
            head.truncate(data_start as usize);
            head.shrink_to_fit();
            let (mut object, header) = self.object(path, url, version, header);
            object.head = Some(head);
            object.headers = headers;
            return Ok((object, header));
        }
        if prefix.len() as u64 >= PREFIX_LEN {
            let n = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
            let want = PREFIX_LEN.saturating_add(n);
            // Only a header that can be valid is worth a second request.
            if n <= MAX_HEADER_LEN && want <= size && want > prefix.len() as u64 {
                let rest = self
                    .fetch_range(path, version.clone(), prefix.len() as u64..want)
                    .map_err(|e| OpenError::Fetch(format!("{url}: {e}")))?;
                prefix.extend_from_slice(&rest);
            }
        }
        if size < PREFIX_LEN {
            return Err(OpenError::Format(FormatError::TooShort { file_len: size }));
        }
        let header = Header::parse_prefix(&prefix, size).map_err(OpenError::Format)?;
        let (mut object, header) = self.object(path, url, version, header);
        object.headers = headers;
        Ok((object, header))
    }

    /// A GGUF object's header: its length is known only once its keys and
    /// tensor infos are read, so the bytes read so far are parsed, and twice
    /// as many fetched while the header runs past them. Returns the header
    /// and the bytes read.
    fn gguf_header(
        self: &Arc<Self>,
        path: &ObjectPath,
        url: &str,
        mut prefix: Vec<u8>,
        version: &ObjectVersion,
    ) -> Result<(Header, Vec<u8>), OpenError> {
        use crate::format::gguf::{PrefixError, parse_prefix};
        loop {
            match parse_prefix(&prefix, version.size) {
                Ok(g) => {
                    let header = Header::from_gguf(g).map_err(OpenError::Format)?;
                    return Ok((header, prefix));
                }
                Err(PrefixError::Refused(e)) => return Err(OpenError::Format(e.into())),
                Err(PrefixError::NeedsMore) => {
                    let have = prefix.len() as u64;
                    let want = have.saturating_mul(2).max(FIRST_GET).min(version.size);
                    if want > MAX_GGUF_HEADER {
                        return Err(OpenError::Fetch(format!(
                            "{url}: its GGUF keys and tensor infos run past {} MiB: not read \
                             (stfs reads remote GGUF headers of up to that)",
                            MAX_GGUF_HEADER >> 20
                        )));
                    }
                    if want <= have {
                        return Err(OpenError::Fetch(format!(
                            "{url}: the object ended while its GGUF header was read"
                        )));
                    }
                    let rest = self
                        .fetch_range(path, version.clone(), have..want)
                        .map_err(|e| OpenError::Fetch(format!("{url}: {e}")))?;
                    prefix.extend_from_slice(&rest);
                }
            }
        }
    }

    /// The object of a validated header.
    fn object(
        self: &Arc<Self>,
        path: &ObjectPath,
        url: String,
        version: ObjectVersion,
        header: Header,
    ) -> (RemoteObject, Header) {
        if version.etag.is_none() {
            warn!(
                url,
                "the server gives no ETag: an object replaced behind the mount cannot be noticed"
            );
        }
        let object = RemoteObject {
            remote: self.clone(),
            url,
            path: path.clone(),
            version,
            cache_key: String::new(),
            chunks: chunk_starts(&header),
            data_end: header.data_start() + header.data_len(),
            head: None,
            headers: Vec::new(),
            stale: AtomicBool::new(false),
            streams: Mutex::new(LruCache::new(STREAMS.try_into().expect("not zero"))),
        };
        let object = RemoteObject {
            cache_key: object.identity(),
            ..object
        };
        (object, header)
    }

    /// One ranged GET of `version` (the rest of a header), bounded in time:
    /// each wait by `--timeout`, all of it by 4 times that (a server that
    /// sends a byte now and then is not waited for forever).
    fn fetch_range(
        &self,
        path: &ObjectPath,
        version: ObjectVersion,
        range: std::ops::Range<u64>,
    ) -> Result<Bytes, FetchError> {
        let job = self
            .fetcher
            .clone()
            .get(path.clone(), Some(version), range, None);
        let all = self.fetcher.timeout.saturating_mul(4);
        let done = self
            .block_on(async { tokio::time::timeout(all, job).await })
            .map_err(|_| FetchError::TimedOut)?;
        match done? {
            Landed::Memory(bytes) => Ok(bytes),
            Landed::Cache(_) => Err(FetchError::Cache("a header went to the cache".into())),
        }
    }
}

#[cfg(test)]
mod tests;
