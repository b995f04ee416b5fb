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

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
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

use super::local::{FileStat, Folder};
use crate::format::{FormatError, Header, MAX_HEADER_LEN, PREFIX_LEN};

/// Bytes fetched at once, at most.
pub const CHUNK: u64 = 8 << 20;
/// The first GET of an object: the header of most checkpoints fits.
const FIRST_GET: u64 = 1 << 20;
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
#[derive(Debug, Clone)]
pub enum FetchError {
    /// The object is not the version seen at mount.
    Replaced,
    TimedOut,
    Store(String),
    Cache(String),
}

impl fmt::Display for FetchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FetchError::Replaced => f.write_str(
                "the object was replaced since it was mounted (its ETag changed): its bytes are not served",
            ),
            FetchError::TimedOut => f.write_str("the server did not answer in time"),
            FetchError::Store(e) => f.write_str(e),
            FetchError::Cache(e) => write!(f, "the local cache: {e}"),
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
            let said = with_causes(&e);
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

/// An error and the causes under it ("error sending request" says little;
/// "operation timed out" or "connection refused" under it says what happened).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let said = c.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cause = c.source();
    }
    text
}

impl Remote {
    /// Connects to the store a URL names: `s3://bucket/key`, `s3://bucket/prefix/`,
    /// `gs://`, `az://`, `https://host/path`. Credentials and settings come from
    /// the standard environment (AWS_*, GOOGLE_*, AZURE_*).
    pub fn connect(url: &str, opts: &RemoteOptions) -> Result<Location, String> {
        let parsed = url::Url::parse(url).map_err(|e| format!("{url}: not a URL: {e}"))?;
        // A stalled connection fails after `timeout` without data (and is
        // retried within the retry budget); a slow one that keeps sending is
        // waited for, up to ten times as long in all.
        let client = ClientOptions::new()
            .with_timeout(opts.timeout.saturating_mul(10))
            .with_read_timeout(opts.timeout)
            .with_connect_timeout(opts.timeout.min(Duration::from_secs(10)));
        let retry = RetryConfig {
            max_retries: 3,
            retry_timeout: opts.timeout,
            ..Default::default()
        };
        if parsed.query().is_some() {
            return Err(format!(
                "{url}: a URL with a query string (a presigned URL, a version id) is not supported yet"
            ));
        }
        // `s3://bucket` is the bucket's top folder.
        let folder = parsed.path().ends_with('/') || parsed.path().is_empty();
        let (store, path, origin): (Arc<dyn ObjectStore>, String, String) = match parsed.scheme() {
            "s3" | "s3a" => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry);
                // The shared files fill in what the environment does not say.
                let profile = super::aws_profile::load();
                let unset = |var: &str| std::env::var_os(var).is_none();
                if unset("AWS_ACCESS_KEY_ID") {
                    if let (Some(id), Some(secret)) = (profile.access_key_id, profile.secret_access_key) {
                        b = b.with_access_key_id(id).with_secret_access_key(secret);
                        if let Some(token) = profile.session_token {
                            b = b.with_token(token);
                        }
                    }
                }
                if unset("AWS_REGION") && unset("AWS_DEFAULT_REGION") {
                    if let Some(region) = profile.region {
                        b = b.with_region(region);
                    }
                }
                let endpoint = opts
                    .endpoint
                    .clone()
                    .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok())
                    .or(profile.endpoint_url);
                if let Some(ep) = endpoint {
                    b = b
                        .with_allow_http(ep.starts_with("http://"))
                        .with_endpoint(ep)
                        .with_virtual_hosted_style_request(false);
                }
                let store = b.build().map_err(|e| format!("{url}: {e}"))?;
                let bucket = parsed.host_str().unwrap_or_default();
                (
                    Arc::new(store),
                    parsed.path().to_string(),
                    format!("{}://{bucket}", parsed.scheme()),
                )
            }
            "gs" => {
                let store = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| format!("{url}: {e}"))?;
                let bucket = parsed.host_str().unwrap_or_default();
                (Arc::new(store), parsed.path().to_string(), format!("gs://{bucket}"))
            }
            "az" | "azure" | "abfs" | "abfss" => {
                let store = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| format!("{url}: {e}"))?;
                let container = parsed.host_str().unwrap_or_default();
                (
                    Arc::new(store),
                    parsed.path().to_string(),
                    format!("{}://{container}", parsed.scheme()),
                )
            }
            "http" | "https" => {
                let origin = parsed[..url::Position::BeforePath].to_string();
                let store = object_store::http::HttpBuilder::new()
                    .with_url(&origin)
                    .with_client_options(client.with_allow_http(parsed.scheme() == "http"))
                    .with_retry(retry)
                    .build()
                    .map_err(|e| format!("{url}: {e}"))?;
                (Arc::new(store), parsed.path().to_string(), origin)
            }
            other => {
                return Err(format!(
                    "{url}: unknown scheme {other:?} (s3://, gs://, az://, http:// and https:// are known)"
                ))
            }
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("stfs-remote")
            .enable_all()
            .build()
            .map_err(|e| format!("starting the network runtime: {e}"))?;
        let cache = DiskCache::open(&opts.cache_dir, opts.cache_size)?;
        let path =
            ObjectPath::from_url_path(path.trim_matches('/')).map_err(|e| format!("{url}: {e}"))?;
        let concurrency = opts.concurrency.max(1);
        Ok(Location {
            remote: Arc::new(Remote {
                runtime: Some(runtime),
                cache: Arc::new(cache),
                fetcher: Fetcher {
                    store,
                    gets: Arc::new(tokio::sync::Semaphore::new(concurrency)),
                    timeout: opts.timeout,
                    requests: Arc::new(AtomicU64::new(0)),
                    fetched: Arc::new(AtomicU64::new(0)),
                },
                ahead: Arc::new(AtomicUsize::new(0)),
                // At least one GET slot is left to readers (none ahead with one slot).
                max_ahead: concurrency - (concurrency / 4).max(1),
                origin,
            }),
            path,
            folder,
        })
    }

    /// The URL of an object of this store.
    pub fn url(&self, path: &ObjectPath) -> String {
        format!("{}/{path}", self.origin)
    }

    /// The cache folder.
    pub fn cache_folder(&self) -> &Folder {
        self.cache.folder()
    }

    /// What `stfs status` says of the network and the cache.
    pub fn summary(&self) -> String {
        let (used, limit, dir) = self.cache.usage();
        format!(
            "remote: {} requests, {} bytes of tensor data fetched; cache {} of {} bytes used in {}",
            self.fetcher.requests.load(Ordering::Relaxed),
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
    pub fn list(&self, prefix: &ObjectPath) -> Result<Vec<(String, ObjectPath)>, String> {
        let url = self.url(prefix);
        let f = &self.fetcher;
        self.block_on(async {
            f.requests.fetch_add(1, Ordering::Relaxed);
            let listed = tokio::time::timeout(f.timeout, f.store.list_with_delimiter(Some(prefix)))
                .await
                .map_err(|_| format!("{url}: {}", FetchError::TimedOut))?
                .map_err(|e| store_error(&url, e))?;
            Ok(listed
                .objects
                .into_iter()
                // The listed path is the object's own: joining its name to the
                // prefix again would encode it twice.
                .filter_map(|o| Some((o.location.filename()?.to_string(), o.location)))
                .collect())
        })
    }

    /// A whole (small) object: an index file.
    pub fn get_all(&self, path: &ObjectPath) -> Result<Vec<u8>, String> {
        let url = self.url(path);
        let f = &self.fetcher;
        self.block_on(async {
            f.requests.fetch_add(1, Ordering::Relaxed);
            let got =
                tokio::time::timeout(f.timeout, async { f.store.get(path).await?.bytes().await })
                    .await
                    .map_err(|_| format!("{url}: {}", FetchError::TimedOut))?
                    .map_err(|e| store_error(&url, e))?;
            Ok(got.to_vec())
        })
    }

    /// Opens an object: reads and validates its header (one ranged GET, or
    /// two if the header is longer than the first guess).
    pub fn open(self: &Arc<Self>, path: &ObjectPath) -> Result<(RemoteObject, Header), OpenError> {
        let url = self.url(path);
        let f = &self.fetcher;
        let (first, size, etag, modified) = self
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
                    Ok::<_, object_store::Error>((got.bytes().await?, meta))
                })
                .await
            })
            .map_err(|_| OpenError::Fetch(format!("{url}: {}", FetchError::TimedOut)))?
            .map(|(bytes, meta)| (bytes, meta.size, meta.e_tag, meta.last_modified))
            .map_err(|e| OpenError::Fetch(store_error(&url, e)))?;
        let mut prefix = first.to_vec();
        if prefix.len() as u64 >= PREFIX_LEN {
            let n = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
            let want = PREFIX_LEN.saturating_add(n);
            // Only a header that can be valid is worth a second request.
            if n <= MAX_HEADER_LEN && want <= size && want > prefix.len() as u64 {
                let rest = self
                    .fetch_range(
                        path,
                        Version {
                            size,
                            etag: etag.clone(),
                            modified: modified.into(),
                        },
                        prefix.len() as u64..want,
                    )
                    .map_err(|e| OpenError::Fetch(format!("{url}: {e}")))?;
                prefix.extend_from_slice(&rest);
            }
        }
        if size < PREFIX_LEN {
            return Err(OpenError::Format(FormatError::TooShort { file_len: size }));
        }
        let header = Header::parse_prefix(&prefix, size).map_err(OpenError::Format)?;
        if etag.is_none() {
            warn!(
                url,
                "the server gives no ETag: an object replaced behind the mount cannot be noticed"
            );
        }
        let object = RemoteObject {
            remote: self.clone(),
            url,
            path: path.clone(),
            version: Version {
                size,
                etag,
                modified: modified.into(),
            },
            cache_key: String::new(),
            chunks: chunk_starts(&header),
            data_end: header.data_start() + header.data_len(),
            stale: AtomicBool::new(false),
            streams: Mutex::new(LruCache::new(STREAMS.try_into().expect("not zero"))),
        };
        let object = RemoteObject {
            cache_key: object.identity(),
            ..object
        };
        Ok((object, header))
    }

    /// One ranged GET of `version` (the rest of a header), bounded in time:
    /// each wait by `--timeout`, all of it by 4 times that (a server that
    /// sends a byte now and then is not waited for forever).
    fn fetch_range(
        &self,
        path: &ObjectPath,
        version: Version,
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

/// Why a remote object could not be opened.
#[derive(Debug)]
pub enum OpenError {
    Fetch(String),
    Format(FormatError),
}

/// What GETs ranges: the store, the limit on GETs at once, the time limit,
/// and the counters. Cheap to clone into a task.
#[derive(Clone)]
struct Fetcher {
    store: Arc<dyn ObjectStore>,
    gets: Arc<tokio::sync::Semaphore>,
    timeout: Duration,
    /// GET requests made (for `stfs status` and the tests).
    requests: Arc<AtomicU64>,
    /// Bytes of tensor data fetched.
    fetched: Arc<AtomicU64>,
}

/// The version of an object seen at mount.
#[derive(Clone)]
struct Version {
    size: u64,
    etag: Option<String>,
    modified: SystemTime,
}

impl Version {
    /// Whether an answer is of this version: same size, same ETag (a server
    /// that ignores If-Match still names the version it sends), and, where
    /// there is no ETag, the same modification time.
    fn sent(&self, meta: &object_store::ObjectMeta) -> bool {
        let modified: SystemTime = meta.last_modified.into();
        meta.size == self.size
            && match (&self.etag, &meta.e_tag) {
                (Some(want), Some(sent)) => want == sent,
                // Nothing to compare: If-Match (where sent) stands guard.
                (Some(_), None) => true,
                (None, _) => modified == self.modified,
            }
    }
}

/// Where fetched bytes went.
enum Landed {
    /// Into the cache file the fetch was given (mapped).
    Cache(Arc<Mmap>),
    /// Into memory (no cache file, or writing it failed).
    Memory(Bytes),
}

impl Fetcher {
    /// One ranged GET, conditional on the ETag. The body goes into `file`
    /// (a cache file being written) as it arrives, or into memory. Bounded
    /// in time once it has a GET slot: the server's answer takes at most
    /// `timeout`, and so does each wait for more of the body (a slow server
    /// that keeps sending is waited for; one that stops is not).
    async fn get(
        self,
        path: ObjectPath,
        version: Option<Version>,
        range: std::ops::Range<u64>,
        file: Option<CacheWriter>,
    ) -> Result<Landed, FetchError> {
        let want = range.end - range.start;
        let timeout = self.timeout;
        let etag = version.as_ref().and_then(|v| v.etag.clone());
        // Waiting for a GET slot is not the server's silence: the time limit
        // starts with the request.
        let _permit = self
            .gets
            .acquire()
            .await
            .map_err(|e| FetchError::Store(e.to_string()))?;
        let start = async {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let opts = GetOptions {
                // A weak ETag cannot be matched (RFC 9110 compares strongly):
                // the ETag of the answer is compared below instead.
                if_match: etag.filter(|e| !e.starts_with("W/")),
                range: Some(GetRange::Bounded(range)),
                ..Default::default()
            };
            let got = self
                .store
                .get_opts(&path, opts)
                .await
                .map_err(|e| match e {
                    object_store::Error::Precondition { .. } => FetchError::Replaced,
                    e => FetchError::Store(with_causes(&e)),
                })?;
            Ok::<_, FetchError>(got)
        };
        let got = tokio::time::timeout(timeout, start)
            .await
            .map_err(|_| FetchError::TimedOut)??;
        if version.is_some_and(|v| !v.sent(&got.meta)) {
            return Err(FetchError::Replaced);
        }
        let mut stream = got.into_stream();
        let mut sink = match file {
            Some(w) => Sink::Cache(Box::new(w)),
            None => Sink::Memory(bytes::BytesMut::with_capacity(want as usize)),
        };
        let mut got_len = 0u64;
        loop {
            let frame = match tokio::time::timeout(timeout, stream.next()).await {
                Err(_) => return Err(FetchError::TimedOut),
                Ok(None) => break,
                Ok(Some(frame)) => frame.map_err(|e| FetchError::Store(with_causes(&e)))?,
            };
            got_len += frame.len() as u64;
            if got_len > want {
                break;
            }
            sink.take(&frame)?;
        }
        if got_len != want {
            return Err(FetchError::Store(format!(
                "the server sent {got_len} bytes for a range of {want}"
            )));
        }
        self.fetched.fetch_add(want, Ordering::Relaxed);
        sink.finish()
    }
}

/// Where a fetch puts the body as it arrives.
enum Sink {
    // Boxed: the MAC's state makes a writer large.
    Cache(Box<CacheWriter>),
    Memory(bytes::BytesMut),
}

impl Sink {
    fn take(&mut self, frame: &[u8]) -> Result<(), FetchError> {
        match self {
            Sink::Memory(m) => m.extend_from_slice(frame),
            Sink::Cache(w) => {
                if let Err(e) = w.write(frame) {
                    // A full disk costs the cache, not the read: go on in memory.
                    let mut memory = bytes::BytesMut::from(&w.abandon(&e)?[..]);
                    memory.extend_from_slice(frame);
                    *self = Sink::Memory(memory);
                }
            }
        }
        Ok(())
    }

    fn finish(self) -> Result<Landed, FetchError> {
        match self {
            Sink::Memory(m) => Ok(Landed::Memory(m.freeze())),
            Sink::Cache(w) => w.finish(),
        }
    }
}

/// File offsets where chunks start (the last entry is the end of the data):
/// small tensors share a chunk, large ones are cut every CHUNK bytes.
fn chunk_starts(header: &Header) -> Vec<u64> {
    let base = header.data_start();
    let mut starts = vec![base];
    let mut chunk_start = base;
    for t in header.tensors.iter() {
        let (b, e) = (base + t.data_offsets.0, base + t.data_offsets.1);
        if e - b >= CHUNK {
            if b > chunk_start {
                starts.push(b);
            }
            let mut at = b + CHUNK;
            while at < e {
                starts.push(at);
                at += CHUNK;
            }
            starts.push(e);
            chunk_start = e;
        } else if e - chunk_start > CHUNK {
            starts.push(b);
            chunk_start = b;
        }
    }
    let end = base + header.data_len();
    if *starts.last().expect("one") != end {
        starts.push(end);
    }
    starts.dedup();
    starts
}

/// What a fetch of a chunk gives.
type Fetched = Result<Chunk, FetchError>;

/// A chunk at hand: its cache file (mapped), or the bytes a fetch just gave.
#[derive(Clone)]
enum Chunk {
    Mapped(Arc<Mmap>),
    Memory(Bytes),
}

impl Chunk {
    /// Bytes `range` of the chunk (relative to its start).
    fn bytes(&self, range: std::ops::Range<usize>) -> std::io::Result<&[u8]> {
        let (all, mapped): (&[u8], _) = match self {
            Chunk::Mapped(m) => (m, Some(m)),
            Chunk::Memory(b) => (b, None),
        };
        let bytes = all
            .get(range.clone())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EIO))?;
        if let Some(map) = mapped {
            // One fault for the range instead of one a page (and EFAULT, not
            // SIGBUS, if the file was cut short); old kernels refuse: fine.
            if let Err(e) = map.advise_range(Advice::PopulateRead, range.start, range.len()) {
                if e.raw_os_error() != Some(libc::EINVAL) {
                    return Err(std::io::Error::from_raw_os_error(libc::EIO));
                }
            }
        }
        Ok(bytes)
    }
}

/// How one tensor is being read, for read-ahead.
struct Stream {
    /// Where the next read starts if the reader goes on sequentially.
    next: u64,
    /// Chunks to fetch ahead of the one read (0: not sequential).
    window: usize,
    /// Chunks below this were looked at (fetched, or found cached) already.
    looked_at: usize,
}

/// Tensors whose read-ahead state is kept (readers at once, at most).
const STREAMS: usize = 64;

/// A remote checkpoint file, as validated at mount.
pub struct RemoteObject {
    remote: Arc<Remote>,
    url: String,
    path: ObjectPath,
    version: Version,
    /// Names this version of this object in the cache.
    cache_key: String,
    chunks: Vec<u64>,
    data_end: u64,
    /// Replaced behind the mount: said once, then every read fails.
    stale: AtomicBool,
    /// How recently read tensors are being read, by tensor index.
    streams: Mutex<LruCache<u32, Stream>>,
}

impl RemoteObject {
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn size(&self) -> u64 {
        self.version.size
    }

    pub fn modified(&self) -> SystemTime {
        self.version.modified
    }

    pub fn remote(&self) -> &Arc<Remote> {
        &self.remote
    }

    /// The object's file name (the last part of its path).
    pub fn file_name(&self) -> &str {
        self.path.filename().unwrap_or("object")
    }

    /// The name of this version of the object in the cache.
    pub fn cache_key(&self) -> &str {
        &self.cache_key
    }

    /// What names this version of the object in the cache: a SHA-256 of
    /// its URL, size, ETag and modification time (no server can make its
    /// chunks pass for another object's). Without an ETag nothing tells two
    /// versions of the same size apart, so the name is this mount's own.
    pub fn identity(&self) -> String {
        let modified = self
            .version
            .modified
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut text = format!(
            "{}\n{}\n{}\n{modified}",
            self.url,
            self.version.size,
            self.version.etag.as_deref().unwrap_or("")
        );
        if self.version.etag.is_none() {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            text.push_str(&format!(
                "\nmount {} {now} {}",
                std::process::id(),
                crate::generation::next_gen()
            ));
        }
        let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
        digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn chunk_of(&self, offset: u64) -> usize {
        self.chunks
            .partition_point(|&s| s <= offset)
            .saturating_sub(1)
    }

    fn chunk_range(&self, k: usize) -> std::ops::Range<u64> {
        self.chunks[k]..self.chunks[k + 1]
    }

    fn chunk_name(&self, k: usize) -> String {
        format!("{}.{}.chunk", self.cache_key, self.chunks[k])
    }

    /// Whether a read found the object replaced behind the mount.
    pub fn replaced(&self) -> bool {
        self.stale.load(Ordering::Relaxed)
    }

    /// EIO once a read found the object replaced behind the mount.
    pub fn check_unchanged(&self) -> std::io::Result<()> {
        self.check().map_err(|e| self.failed("read", e))
    }

    fn check(&self) -> Result<(), FetchError> {
        if self.stale.load(Ordering::Relaxed) {
            return Err(FetchError::Replaced);
        }
        Ok(())
    }

    /// Serves bytes `range` of the file (within the data section) to
    /// `reply`, through the cache: straight from a chunk's mapping when the
    /// range lies in one chunk (as reads of tensor files do), else copied
    /// together. `tensor` (its index, name and byte range) is what a reader
    /// reads: its name goes into the log if the read fails, and sequential
    /// reads of it fetch ahead.
    pub fn serve<R>(
        &self,
        range: std::ops::Range<u64>,
        tensor: Option<(u32, &str, std::ops::Range<u64>)>,
        reply: impl FnOnce(&[u8]) -> R,
    ) -> std::io::Result<R> {
        if range.start >= range.end {
            return Ok(reply(&[]));
        }
        self.check().map_err(|e| self.failed("read", e))?;
        if range.start < self.chunks[0] || range.end > self.data_end {
            // Only tensor bytes are served from here (callers clamp to a tensor).
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        let first = self.chunk_of(range.start);
        let last = self.chunk_of(range.end - 1);
        let what = match &tensor {
            Some((index, name, span)) => {
                self.read_ahead(*index, span.clone(), range.clone(), last);
                *name
            }
            None => "a copy",
        };
        let part = |k: usize| -> std::io::Result<(Chunk, std::ops::Range<usize>)> {
            let chunk = self.chunk_range(k);
            let bytes = self.ensure(k).map_err(|e| self.failed(what, e))?;
            let from = range.start.max(chunk.start) - chunk.start;
            let to = range.end.min(chunk.end) - chunk.start;
            Ok((bytes, from as usize..to as usize))
        };
        if first == last {
            let (chunk, within) = part(first)?;
            return Ok(reply(chunk.bytes(within)?));
        }
        let mut out = Vec::with_capacity((range.end - range.start) as usize);
        for k in first..=last {
            let (chunk, within) = part(k)?;
            out.extend_from_slice(chunk.bytes(within)?);
        }
        Ok(reply(&out))
    }

    /// Bytes `range` of the file, copied.
    pub fn read(&self, range: std::ops::Range<u64>) -> std::io::Result<Vec<u8>> {
        self.serve(range, None, <[u8]>::to_vec)
    }

    fn failed(&self, what: &str, e: FetchError) -> std::io::Error {
        if matches!(e, FetchError::Replaced) {
            if !self.stale.swap(true, Ordering::Relaxed) {
                warn!(url = self.url, "{e}");
            }
        } else {
            warn!(url = self.url, "{what}: {e}");
        }
        std::io::Error::from_raw_os_error(libc::EIO)
    }

    /// Read-ahead, by tensor: a read of a tensor's first bytes fetches its
    /// first chunks in parallel (a reader that starts there nearly always
    /// reads it all), and each sequential read after it doubles the window, up
    /// to MAX_WINDOW chunks and one chunk past the tensor's end. Reads at
    /// other places fetch nothing ahead. Each chunk is looked at once per
    /// sequential run, so that reads of cached chunks stay cheap.
    fn read_ahead(
        &self,
        tensor: u32,
        span: std::ops::Range<u64>,
        range: std::ops::Range<u64>,
        last: usize,
    ) {
        let todo = {
            let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
            let s = streams.get_or_insert_mut(tensor, || Stream {
                next: u64::MAX,
                window: 0,
                looked_at: 0,
            });
            if range.start == span.start {
                s.window = FIRST_WINDOW;
                s.looked_at = last + 1;
            } else if range.start == s.next && s.window > 0 {
                s.window = (s.window * 2).min(MAX_WINDOW);
            } else {
                s.window = 0;
            }
            s.next = range.end;
            if s.window == 0 {
                return;
            }
            let past_tensor = self.chunk_of(span.end.saturating_sub(1).max(span.start)) + 2;
            let end = (last + 1 + s.window)
                .min(past_tensor)
                .min(self.chunks.len() - 1);
            s.looked_at.max(last + 1)..end
        };
        let remote = &self.remote;
        let (todo_start, mut looked_at) = (todo.start, todo.start);
        for k in todo {
            let name = self.chunk_name(k);
            if !remote.cache.busy(&name) && !remote.cache.has(&name, self.chunk_range(k)) {
                // The rest waits for a later read: a reader's own fetch must
                // find a free GET slot.
                if remote.ahead.fetch_add(1, Ordering::Relaxed) >= remote.max_ahead {
                    remote.ahead.fetch_sub(1, Ordering::Relaxed);
                    break;
                }
                let (job, ahead) = (self.fetch_job(k), remote.ahead.clone());
                remote.runtime().spawn(async move {
                    let _ = job.await;
                    ahead.fetch_sub(1, Ordering::Relaxed);
                });
            }
            looked_at = k + 1;
        }
        if looked_at > todo_start {
            let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(s) = streams.peek_mut(&tensor) {
                s.looked_at = s.looked_at.max(looked_at);
            }
        }
    }

    /// Chunk `k`: its cache file, or fetched now.
    fn ensure(&self, k: usize) -> Result<Chunk, FetchError> {
        self.check()?;
        if let Some(map) = self
            .remote
            .cache
            .get(&self.chunk_name(k), self.chunk_range(k))
        {
            return Ok(Chunk::Mapped(map));
        }
        self.remote.block_on(self.fetch_job(k))
    }

    /// Fetches chunk `k` into the cache; concurrent callers share one fetch.
    /// (The job holds the cache and the fetcher, never the `Remote`: the
    /// runtime that runs it must not be dropped from inside it.)
    fn fetch_job(&self, k: usize) -> impl std::future::Future<Output = Fetched> + Send + 'static {
        let (cache, fetcher) = (self.remote.cache.clone(), self.remote.fetcher.clone());
        let name = self.chunk_name(k);
        let range = self.chunk_range(k);
        let (path, version) = (self.path.clone(), self.version.clone());
        async move {
            let cell = cache.inflight(&name);
            let _done = Done(&cache, &name, &cell);
            cell.get_or_init(|| async {
                // Another fetch may have brought it since the caller looked.
                if let Some(map) = cache.get(&name, range.clone()) {
                    return Ok(Chunk::Mapped(map));
                }
                let writer = match cache.begin(&name) {
                    Ok(w) => Some(w),
                    Err(e) => {
                        cache.failed(&e);
                        None
                    }
                };
                Ok(
                    match fetcher
                        .get(path, Some(version), range.clone(), writer)
                        .await?
                    {
                        Landed::Cache(map) => Chunk::Mapped(map),
                        Landed::Memory(bytes) => Chunk::Memory(bytes),
                    },
                )
            })
            .await
            .clone()
        }
    }

    /// Brings `range` of the file into the cache, fetching its chunks in
    /// parallel (as many at once as read-ahead may: readers keep a GET slot);
    /// stops early when `keep_going` says so. Returns where the range is
    /// cached up to without a gap, and the bytes of the range cached.
    pub fn warm(
        &self,
        range: std::ops::Range<u64>,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> std::io::Result<(u64, u64)> {
        if range.start >= range.end {
            return Ok((range.end, 0));
        }
        self.check().map_err(|e| self.failed("prefetch", e))?;
        let (first, last) = (self.chunk_of(range.start), self.chunk_of(range.end - 1));
        let cached = |k: usize| {
            self.remote
                .cache
                .has(&self.chunk_name(k), self.chunk_range(k))
        };
        let jobs: Vec<_> = (first..=last)
            .filter(|&k| !cached(k))
            .map(|k| self.fetch_job(k))
            .collect();
        let failure = self.remote.block_on(async {
            let mut running =
                futures::stream::iter(jobs).buffer_unordered(self.remote.max_ahead.max(1));
            while let Some(done) = running.next().await {
                if let Err(e) = done {
                    return Some(e);
                }
                if !keep_going() {
                    break; // the fetches not finished are dropped
                }
            }
            None
        });
        if let Some(e) = failure {
            return Err(self.failed("prefetch", e));
        }
        let mut reached = range.start;
        let mut bytes = 0;
        for k in first..=last {
            if cached(k) {
                let c = self.chunk_range(k);
                let (from, to) = (c.start.max(range.start), c.end.min(range.end));
                bytes += to - from;
                if reached == from {
                    reached = to;
                }
            }
        }
        Ok((reached, bytes))
    }

    /// The end of the data section.
    pub fn data_end(&self) -> u64 {
        self.data_end
    }
}

/// Takes a fetch off the list of those under way when it ends, however it
/// ends (a cancelled prefetch too).
struct Done<'a>(
    &'a DiskCache,
    &'a str,
    &'a Arc<tokio::sync::OnceCell<Fetched>>,
);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.done(self.1, self.2);
    }
}

/// Bytes after a chunk's payload: HMAC-SHA256 (32) of its name and payload
/// under the cache's key, payload length (8), magic (4).
const TRAILER: u64 = 44;
const MAGIC: &[u8; 4] = b"stfm";
/// The cache's secret, made with the folder: only files made by a process
/// that can read it check out, so a file planted by another user (in a folder
/// that was once open to others) is never served.
const KEY_FILE: &str = "key";

/// The cache's key: read from the folder, or made (and the folder's files,
/// made under another key or planted, removed).
fn cache_key(folder: &Folder, dir: &Path) -> Result<hmac::Key, String> {
    let err = |e: std::io::Error| format!("{}/{KEY_FILE}: {e}", dir.display());
    let euid = rustix::process::geteuid().as_raw();
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    for _ in 0..3 {
        match folder.open_file(OsStr::new(KEY_FILE), flags, 0) {
            Ok(file) => {
                let st = FileStat::of(&file).map_err(err)?;
                let mut secret = [0u8; 32];
                let ours = st.mode & libc::S_IFMT == libc::S_IFREG
                    && st.uid == euid
                    && st.mode & 0o077 == 0
                    && st.len == 32
                    && file.read_exact_at(&mut secret, 0).is_ok();
                if ours {
                    return Ok(hmac::Key::new(hmac::HMAC_SHA256, &secret));
                }
                warn!(dir = %dir.display(), "the cache's key file is not one stfs made: made again");
                folder.unlink(OsStr::new(KEY_FILE)).map_err(err)?;
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(err(e)),
        }
        // Files keyed by a key that is gone (or none) can never check out.
        for name in folder.entries() {
            if name.to_string_lossy().contains(".chunk") {
                let _ = folder.unlink(&name);
            }
        }
        let mut secret = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
            .map_err(|_| format!("{}: no random bytes for the cache's key", dir.display()))?;
        let tmp = format!("{KEY_FILE}.tmp.{}", std::process::id());
        let file = folder
            .open_file(
                OsStr::new(&tmp),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
                0o600,
            )
            .map_err(err)?;
        let made = file
            .write_all_at(&secret, 0)
            .and_then(|()| file.sync_all())
            .and_then(|()| folder.rename_noreplace(OsStr::new(&tmp), OsStr::new(KEY_FILE)));
        match made {
            Ok(()) => return Ok(hmac::Key::new(hmac::HMAC_SHA256, &secret)),
            // Another mount made one first: use that.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let _ = folder.unlink(OsStr::new(&tmp));
            }
            Err(e) => {
                let _ = folder.unlink(OsStr::new(&tmp));
                return Err(err(e));
            }
        }
    }
    Err(format!("{}: the cache's key keeps changing", dir.display()))
}

/// Something in a cache folder that is not this user's regular file or
/// cache folder (the `key` a regular file): said in words, or None.
fn foreign_entry(folder: &Folder, euid: u32) -> Option<String> {
    for name in folder.entries() {
        let Ok(st) = folder.stat_at(&name) else {
            continue;
        };
        let kind = st.st_mode & libc::S_IFMT;
        let shown = name.to_string_lossy();
        let fresh_folder = shown.starts_with(FRESH_PREFIX) && kind == libc::S_IFDIR;
        if st.st_uid != euid {
            return Some(format!("{shown:?} of uid {}", st.st_uid));
        }
        if kind != libc::S_IFREG && (!fresh_folder || shown == KEY_FILE) {
            return Some(format!("{shown:?}, not a regular file"));
        }
    }
    None
}

/// The private folders a cache moves to inside its folder.
const FRESH_PREFIX: &str = "private.";

/// The first `<dir>/private.N` that is (or is made) a folder of this user's
/// closed to others.
fn fresh_private(dir: &Path, euid: u32) -> Result<(Folder, PathBuf), String> {
    use std::os::unix::fs::DirBuilderExt;
    for n in 0..64 {
        let path = dir.join(format!("{FRESH_PREFIX}{n}"));
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
        let Ok(folder) = Folder::open_private(&path) else {
            continue;
        };
        match folder.stat() {
            Ok(st)
                if st.uid == euid
                    && st.mode & 0o077 == 0
                    && foreign_entry(&folder, euid).is_none() =>
            {
                return Ok((folder, path))
            }
            _ => continue,
        }
    }
    Err(format!(
        "{}: refused as a cache folder: it holds things of other users that cannot be removed \
         (choose another with --cache-dir)",
        dir.display()
    ))
}

/// The local disk cache of chunks, shared by the mounts of a user.
pub struct DiskCache {
    folder: Folder,
    limit: u64,
    /// A write failed (said once in the log).
    warned: AtomicBool,
    key: hmac::Key,
    state: Mutex<CacheState>,
    inflight: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<Fetched>>>>,
}

struct CacheState {
    /// Cache files by name, least recently used first, with their sizes.
    lru: LruCache<String, u64>,
    used: u64,
    /// Files checked (size and MAC) by this process.
    verified: HashSet<String>,
    /// The mappings of recently read chunks (address space only: their pages
    /// are the page cache's).
    maps: LruCache<String, Arc<Mmap>>,
}

impl DiskCache {
    /// Opens (making it 0700 if needed) a cache folder of this user's.
    pub fn open(dir: &Path, limit: u64) -> Result<DiskCache, String> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        // Opened once, not through a link; checked and used by that descriptor.
        let folder = Folder::open_private(dir).map_err(|e| {
            format!(
                "{}: refused as a cache folder: not a folder, or a symbolic link ({e})",
                dir.display()
            )
        })?;
        let st = folder
            .stat()
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        let euid = rustix::process::geteuid().as_raw();
        if st.uid != euid {
            return Err(format!(
                "{}: refused as a cache folder: it belongs to uid {}, not to uid {euid} (choose another with --cache-dir)",
                dir.display(),
                st.uid
            ));
        }
        if st.mode & 0o077 != 0 {
            folder
                .chmod(0o700)
                .map_err(|e| format!("{}: making it private (0700): {e}", dir.display()))?;
            // Anything in it, the key too, may have been planted by another user.
            for name in folder.entries() {
                let _ = folder.unlink(&name);
            }
            info!(dir = %dir.display(), "cache folder made private (0700), and emptied");
        }
        // What another user left that cannot be removed (a folder planted
        // while this one was open to others): the cache moves to a fresh
        // private folder inside it, and says so.
        let (folder, dir) = match foreign_entry(&folder, euid) {
            None => (folder, dir.to_path_buf()),
            Some(what) => {
                let (fresh, path) = fresh_private(dir, euid)?;
                warn!(
                    dir = %dir.display(),
                    "the cache folder holds {what}, which stfs did not make: the cache is in {} from now on",
                    path.display()
                );
                (fresh, path)
            }
        };
        let dir = dir.as_path();
        let key = cache_key(&folder, dir)?;
        // What earlier mounts left, oldest first.
        let mut found: Vec<((i64, i64), String, u64)> = folder
            .entries()
            .into_iter()
            .filter_map(|name| {
                let name = name.to_str()?.to_string();
                let st = folder.stat_at(OsStr::new(&name)).ok()?;
                if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                    return None;
                }
                if name.ends_with(".chunk") {
                    Some(((st.st_mtime, st.st_mtime_nsec), name, st.st_size as u64))
                } else {
                    if writer_gone(&name) {
                        let _ = folder.unlink(OsStr::new(&name));
                    }
                    None
                }
            })
            .collect();
        found.sort();
        let mut lru = LruCache::unbounded();
        let mut used = 0;
        for (_, name, len) in found {
            used += len;
            lru.put(name, len);
        }
        let cache = DiskCache {
            folder,
            limit,
            warned: AtomicBool::new(false),
            key,
            state: Mutex::new(CacheState {
                lru,
                used,
                verified: HashSet::new(),
                maps: LruCache::new(MAPPED.try_into().expect("not zero")),
            }),
            inflight: Mutex::new(HashMap::new()),
        };
        cache.evict(None);
        Ok(cache)
    }

    /// (bytes used as far as this process knows, the limit, the folder).
    fn usage(&self) -> (u64, u64, &Path) {
        (self.lock().used, self.limit, &self.folder.path)
    }

    /// The cache folder, opened.
    pub fn folder(&self) -> &Folder {
        &self.folder
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether chunk `name` is in the cache (as far as this process knows).
    fn has(&self, name: &str, range: std::ops::Range<u64>) -> bool {
        self.lock().lru.peek(name) == Some(&(range.end - range.start + TRAILER))
    }

    /// A chunk's cache file, mapped, if it is there and checks out (its MAC
    /// is checked the first time this process maps it). The mappings of
    /// recent chunks are kept: a read of a cached chunk makes no system call.
    fn get(&self, name: &str, range: std::ops::Range<u64>) -> Option<Arc<Mmap>> {
        {
            let mut st = self.lock();
            if let Some(map) = st.maps.get(name).cloned() {
                st.lru.promote(name);
                return Some(map);
            }
        }
        let len = range.end - range.start;
        // Never through a link, never blocking on a FIFO: a regular file of ours.
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let Ok(file) = self.folder.open_file(OsStr::new(name), flags, 0) else {
            // Gone (another mount evicted it): no longer counted here.
            self.forget(name);
            return None;
        };
        let euid = rustix::process::geteuid().as_raw();
        let good = FileStat::of(&file).ok().is_some_and(|st| {
            st.mode & libc::S_IFMT == libc::S_IFREG && st.uid == euid && st.len == len + TRAILER
        }) && (self.lock().verified.contains(name)
            || verify(&file, len, name, &self.key));
        // SAFETY: a private file of this user's cache, mapped read-only; stfs
        // replaces cache files by rename and removes them by unlink, never in
        // place, so the mapped bytes stay those checked.
        let map = good.then(|| unsafe { Mmap::map(&file) }.ok()).flatten();
        let Some(map) = map else {
            warn!(
                file = name,
                "a cache file that does not check out: fetched again"
            );
            self.forget(name);
            return None;
        };
        let map = Arc::new(map);
        // A file's modification time is its last use: the next mount evicts
        // the least recently used first.
        // SAFETY: a valid descriptor; null times mean now.
        unsafe { libc::futimens(file.as_raw_fd(), std::ptr::null()) };
        let mut st = self.lock();
        st.verified.insert(name.to_string());
        if st.lru.get(name).is_none() {
            st.lru.put(name.to_string(), len + TRAILER);
            st.used += len + TRAILER;
        }
        st.maps.put(name.to_string(), map.clone());
        Some(map)
    }

    fn forget(&self, name: &str) {
        let _ = self.folder.unlink(OsStr::new(name));
        let mut st = self.lock();
        if let Some(len) = st.lru.pop(name) {
            st.used -= len;
        }
        st.verified.remove(name);
        st.maps.pop(name);
    }

    /// Starts writing chunk `name`: a temp file, renamed into place when
    /// complete (so that another mount never sees half a chunk).
    fn begin(self: &Arc<Self>, name: &str) -> std::io::Result<CacheWriter> {
        let tmp = format!(
            "{name}.tmp.{}.{:x}",
            std::process::id(),
            crate::generation::next_gen()
        );
        let file = self.folder.open_file(
            OsStr::new(&tmp),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )?;
        Ok(CacheWriter {
            cache: self.clone(),
            name: name.to_string(),
            tmp,
            file: Some(file),
            written: 0,
            mac: chunk_mac(&self.key, name),
        })
    }

    /// Stores a whole chunk.
    #[cfg(test)]
    fn put(self: &Arc<Self>, name: &str, data: &[u8]) -> std::io::Result<()> {
        let mut w = self.begin(name)?;
        w.write(data)?;
        match w.finish() {
            Ok(Landed::Cache(_)) => Ok(()),
            _ => Err(std::io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    /// A chunk file just renamed into place, and its mapping.
    fn added(&self, name: &str, len: u64, map: Arc<Mmap>) {
        {
            let mut st = self.lock();
            if let Some(old) = st.lru.put(name.to_string(), len) {
                st.used -= old;
            }
            st.used += len;
            st.verified.insert(name.to_string());
            st.maps.put(name.to_string(), map);
        }
        self.evict(Some(name));
    }

    /// Says once in the log that the cache cannot be written.
    fn failed(&self, e: &std::io::Error) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            warn!(
                cache = %self.folder.path.display(),
                "writing the cache: {e}; reads are served from memory and fetched again next time"
            );
        }
    }

    /// Removes the least recently used files past the size limit (never `keep`).
    fn evict(&self, keep: Option<&str>) {
        loop {
            let victim = {
                let mut st = self.lock();
                if st.used <= self.limit {
                    return;
                }
                match st.lru.pop_lru() {
                    Some((name, len)) if Some(name.as_str()) == keep => {
                        // Only the newest is left: it stays, over the limit.
                        st.lru.put(name, len);
                        return;
                    }
                    Some((name, len)) => {
                        st.used -= len;
                        st.verified.remove(&name);
                        st.maps.pop(&name);
                        name
                    }
                    None => return,
                }
            };
            let _ = self.folder.unlink(OsStr::new(&victim));
        }
    }

    /// Whether a fetch of chunk `name` is under way.
    fn busy(&self, name: &str) -> bool {
        self.inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(name)
    }

    fn inflight(&self, name: &str) -> Arc<tokio::sync::OnceCell<Fetched>> {
        self.inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    fn done(&self, name: &str, cell: &Arc<tokio::sync::OnceCell<Fetched>>) {
        let mut m = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        if m.get(name).is_some_and(|c| Arc::ptr_eq(c, cell)) {
            m.remove(name);
        }
    }
}

/// A chunk being written into the cache as it arrives.
struct CacheWriter {
    cache: Arc<DiskCache>,
    name: String,
    tmp: String,
    /// None once finished or abandoned.
    file: Option<File>,
    written: u64,
    mac: hmac::Context,
}

impl CacheWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        let file = self
            .file
            .as_ref()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EBADF))?;
        file.write_all_at(data, self.written)?;
        self.mac.update(data);
        self.written += data.len() as u64;
        Ok(())
    }

    /// Gives up on the file after `e`; returns what was written to it.
    fn abandon(&mut self, e: &std::io::Error) -> Result<Vec<u8>, FetchError> {
        self.cache.failed(e);
        let file = self
            .file
            .take()
            .ok_or_else(|| FetchError::Cache(e.to_string()))?;
        let mut bytes = vec![0u8; self.written as usize];
        let read_back = file.read_exact_at(&mut bytes, 0);
        let _ = self.cache.folder.unlink(OsStr::new(&self.tmp));
        read_back.map_err(|r| FetchError::Cache(format!("{e}, then reading back: {r}")))?;
        Ok(bytes)
    }

    /// Adds the trailer and renames the file into place; if that fails, the
    /// bytes come back in memory.
    fn finish(mut self) -> Result<Landed, FetchError> {
        let Some(file) = self.file.as_ref() else {
            return Err(FetchError::Cache("a cache file written twice".into()));
        };
        let mut trailer = Vec::with_capacity(TRAILER as usize);
        trailer.extend_from_slice(self.mac.clone().sign().as_ref());
        trailer.extend_from_slice(&self.written.to_le_bytes());
        trailer.extend_from_slice(MAGIC);
        let done = file.write_all_at(&trailer, self.written).and_then(|()| {
            self.cache
                .folder
                .rename(OsStr::new(&self.tmp), OsStr::new(&self.name))
        });
        if let Err(e) = done {
            return Ok(Landed::Memory(Bytes::from(self.abandon(&e)?)));
        }
        let Some(file) = self.file.take() else {
            return Err(FetchError::Cache("a cache file written twice".into()));
        };
        let len = self.written + TRAILER;
        // SAFETY: as in `DiskCache::get`: cache files are never changed in place.
        let map = match unsafe { Mmap::map(&file) } {
            Ok(map) => Arc::new(map),
            // Renamed into place, but not mappable here: it stays for later reads.
            Err(e) => {
                self.cache.failed(&e);
                let mut bytes = vec![0u8; self.written as usize];
                file.read_exact_at(&mut bytes, 0)
                    .map_err(|r| FetchError::Cache(format!("{e}, then reading back: {r}")))?;
                return Ok(Landed::Memory(Bytes::from(bytes)));
            }
        };
        self.cache.added(&self.name, len, map.clone());
        Ok(Landed::Cache(map))
    }
}

impl Drop for CacheWriter {
    fn drop(&mut self) {
        // A fetch that failed half-way leaves no temp file behind.
        if self.file.take().is_some() {
            let _ = self.cache.folder.unlink(OsStr::new(&self.tmp));
        }
    }
}

/// Whether `name` is the temp file of a cache writer that died
/// (`<chunk>.tmp.<pid>.<n>`, and no process `pid`): a live mount sharing the
/// folder may be writing the others.
fn writer_gone(name: &str) -> bool {
    let Some((_, rest)) = name.split_once(".chunk.tmp.") else {
        return false;
    };
    let Some(pid) = rest
        .split('.')
        .next()
        .and_then(|p| p.parse::<libc::pid_t>().ok())
    else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    pid != std::process::id() as libc::pid_t
        && unsafe { libc::kill(pid, 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// The MAC of a chunk file: its name, then its payload.
fn chunk_mac(key: &hmac::Key, name: &str) -> hmac::Context {
    let mut mac = hmac::Context::with_key(key);
    mac.update(name.as_bytes());
    mac
}

/// Checks a cache file's trailer against its name and payload.
fn verify(file: &File, len: u64, name: &str, key: &hmac::Key) -> bool {
    let mut trailer = [0u8; TRAILER as usize];
    if file.read_exact_at(&mut trailer, len).is_err() || &trailer[40..] != MAGIC {
        return false;
    }
    let stored_len = u64::from_le_bytes(trailer[32..40].try_into().expect("8 bytes"));
    if stored_len != len {
        return false;
    }
    let mut hasher = chunk_mac(key, name);
    let mut buf = vec![0u8; (1 << 20).min(len as usize).max(1)];
    let mut at = 0;
    while at < len {
        let n = buf.len().min((len - at) as usize);
        if file.read_exact_at(&mut buf[..n], at).is_err() {
            return false;
        }
        hasher.update(&buf[..n]);
        at += n as u64;
    }
    // Compared without an early exit.
    let tag = hasher.sign();
    let diff = tag
        .as_ref()
        .iter()
        .zip(&trailer[..32])
        .fold(0, |d, (a, b)| d | (a ^ b));
    diff == 0
}

/// The default cache folder: `$XDG_CACHE_HOME/stfs`, else `~/.cache/stfs`.
pub fn default_cache_dir() -> PathBuf {
    match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d).join("stfs"),
        None => std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .map(|h| PathBuf::from(h).join(".cache/stfs"))
            .unwrap_or_else(|| {
                let euid = rustix::process::geteuid().as_raw();
                PathBuf::from(format!("/var/tmp/stfs-cache-{euid}"))
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{layout, Dtype, TensorSpec};

    #[test]
    fn chunks_follow_tensor_boundaries() {
        let specs: Vec<TensorSpec> = [(1u64 << 10), 3 << 20, 20 << 20, 10, 6 << 20, 5 << 20]
            .iter()
            .enumerate()
            .map(|(i, &n)| TensorSpec {
                name: format!("t{i}"),
                dtype: Dtype::U8,
                shape: vec![n],
            })
            .collect();
        let l = layout(&specs, None).unwrap();
        let mut bytes = l.header.clone();
        bytes.resize(l.file_len() as usize, 0);
        let h = Header::parse(&bytes).unwrap();
        let starts = chunk_starts(&h);
        let base = h.data_start();
        // Every tensor starts on a chunk boundary, or inside a chunk of small ones.
        for w in starts.windows(2) {
            assert!(w[1] - w[0] <= CHUNK, "{starts:?}");
        }
        let big = h.get("t2").unwrap();
        assert!(starts.contains(&(base + big.data_offsets.0)));
        assert!(starts.contains(&(base + big.data_offsets.1)));
        assert_eq!(*starts.last().unwrap(), base + h.data_len());
    }

    #[test]
    fn a_cache_folder_with_what_stfs_did_not_make_moves_to_a_private_one() {
        let dir = tempfile::tempdir().unwrap();
        let c = dir.path().join("c");
        std::fs::create_dir(&c).unwrap();
        // A folder under the key's name (planted while the folder was open
        // to others, it survives the emptying): the mount still works.
        std::fs::create_dir(c.join(KEY_FILE)).unwrap();
        std::fs::write(c.join(KEY_FILE).join("x"), b"planted").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&c, std::fs::Permissions::from_mode(0o700)).unwrap();
        let cache = Arc::new(DiskCache::open(&c, 1000).unwrap());
        cache.put("a.0.chunk", &[1u8; 40]).unwrap();
        assert!(c.join("private.0").join("a.0.chunk").exists());
        assert!(
            c.join(KEY_FILE).join("x").exists(),
            "what it did not make is left alone"
        );
        // The next mount finds the same private folder and what is cached there.
        let again = DiskCache::open(&c, 1000).unwrap();
        assert!(again.get("a.0.chunk", 0..40).is_some());
        // A clean folder stays where it is.
        let clean = dir.path().join("d");
        Arc::new(DiskCache::open(&clean, 1000).unwrap())
            .put("b.0.chunk", &[2u8; 8])
            .unwrap();
        assert!(clean.join("b.0.chunk").exists());
    }

    #[test]
    fn the_cache_checks_what_it_serves_and_evicts() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Arc::new(DiskCache::open(&dir.path().join("c"), 100).unwrap());
        cache.put("a.0.chunk", &[1u8; 40]).unwrap();
        assert!(cache.get("a.0.chunk", 0..40).is_some());
        cache.put("b.0.chunk", &[2u8; 40]).unwrap();
        cache.put("c.0.chunk", &[3u8; 40]).unwrap(); // 3 x 56 > 100: a goes
        assert!(!dir.path().join("c/a.0.chunk").exists());
        assert!(cache.get("c.0.chunk", 0..40).is_some());
        // A damaged file is refused (and removed) by a process that has not checked it yet.
        let other = DiskCache::open(&dir.path().join("c"), 1000).unwrap();
        let path = dir.path().join("c/c.0.chunk");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[3] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(other.get("c.0.chunk", 0..40).is_none());
        assert!(!path.exists());
        std::fs::write(dir.path().join("c/b.0.chunk"), [2u8; 10]).unwrap(); // truncated
        assert!(other.get("b.0.chunk", 0..40).is_none());
        // A write that does not finish leaves nothing behind; an abandoned
        // one gives back what it wrote.
        let other = Arc::new(other);
        let mut w = other.begin("d.0.chunk").unwrap();
        w.write(b"half").unwrap();
        drop(w);
        let mut w = other.begin("e.0.chunk").unwrap();
        w.write(b"some bytes").unwrap();
        let e = std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(w.abandon(&e).unwrap(), b"some bytes");
        assert!(!writer_gone("x.0.chunk"));
        assert!(!writer_gone(&format!(
            "x.0.chunk.tmp.{}.1",
            std::process::id()
        )));
        assert!(writer_gone("x.0.chunk.tmp.999999999.1"));
        let left: Vec<_> = std::fs::read_dir(dir.path().join("c"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.contains(".tmp."))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn urls_of_every_store_parse() {
        let dir = tempfile::tempdir().unwrap();
        let opts = RemoteOptions {
            endpoint: None,
            cache_dir: dir.path().join("cache"),
            cache_size: 1 << 20,
            concurrency: 2,
            timeout: Duration::from_secs(1),
        };
        for (url, path, folder) in [
            (
                "s3://bucket/a/model.safetensors",
                "a/model.safetensors",
                false,
            ),
            ("s3://bucket/prefix/", "prefix", true),
            ("gs://bucket/m.safetensors", "m.safetensors", false),
            ("az://container/m.safetensors", "m.safetensors", false),
            (
                "https://example.com/x/m.safetensors",
                "x/m.safetensors",
                false,
            ),
        ] {
            match Remote::connect(url, &opts) {
                Ok(l) => {
                    assert_eq!((l.path.as_ref(), l.folder), (path, folder), "{url}");
                }
                // Azure and GCS builders want an account or credentials.
                Err(e) => assert!(
                    url.starts_with("az://") || url.starts_with("gs://"),
                    "{url}: {e}"
                ),
            }
        }
        assert!(Remote::connect("ftp://x/y", &opts).is_err());
    }
}
