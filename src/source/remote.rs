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
//!   behind the mount gives EIO, never mixed bytes. Sequential reads grow a
//!   read-ahead window of chunks fetched in parallel (up to `concurrency`).
//! - Chunks are kept in files of the cache folder (`<object>.<offset>.chunk`:
//!   the bytes, then their CRC-32 and length), written to a temp file and
//!   renamed, so that two mounts can share the folder; a file that does not
//!   check out is fetched again. The least recently used go when the cache
//!   passes its size.
//! - No lock is held across network I/O, and every fetch is bounded in time.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use lru::LruCache;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, RetryConfig};
use tracing::warn;

use super::local::Folder;
use crate::format::{FormatError, Header, MAX_HEADER_LEN, PREFIX_LEN};

/// Bytes fetched at once, at most.
pub const CHUNK: u64 = 8 << 20;
/// The first GET of an object: the header of most checkpoints fits.
const FIRST_GET: u64 = 1 << 20;
/// Chunks fetched ahead of a sequential reader, at most.
const MAX_WINDOW: u64 = 16;

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
    store: Arc<dyn ObjectStore>,
    runtime: tokio::runtime::Runtime,
    cache: Arc<DiskCache>,
    gets: Arc<tokio::sync::Semaphore>,
    timeout: Duration,
    /// GET requests made (for `stfs status` and the tests).
    requests: Arc<AtomicU64>,
    /// Bytes of tensor data fetched.
    fetched: Arc<AtomicU64>,
    /// A cache write failed (said once in the log).
    cache_failed: AtomicBool,
    /// `scheme://bucket` (or the HTTP origin), to show object paths as URLs.
    origin: String,
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
        e => format!("{url}: {e}"),
    }
}

impl Remote {
    /// Connects to the store a URL names: `s3://bucket/key`, `s3://bucket/prefix/`,
    /// `gs://`, `az://`, `https://host/path`. Credentials and settings come from
    /// the standard environment (AWS_*, GOOGLE_*, AZURE_*).
    pub fn connect(url: &str, opts: &RemoteOptions) -> Result<Location, String> {
        let parsed = url::Url::parse(url).map_err(|e| format!("{url}: not a URL: {e}"))?;
        let client = ClientOptions::new()
            .with_timeout(opts.timeout)
            .with_connect_timeout(opts.timeout.min(Duration::from_secs(10)));
        let retry = RetryConfig {
            max_retries: 3,
            retry_timeout: opts.timeout,
            ..Default::default()
        };
        let folder = parsed.path().ends_with('/');
        let (store, path, origin): (Arc<dyn ObjectStore>, String, String) = match parsed.scheme() {
            "s3" | "s3a" => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry);
                let endpoint = opts
                    .endpoint
                    .clone()
                    .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok());
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
        Ok(Location {
            remote: Arc::new(Remote {
                store,
                runtime,
                cache: Arc::new(cache),
                gets: Arc::new(tokio::sync::Semaphore::new(opts.concurrency.max(1))),
                timeout: opts.timeout,
                requests: Arc::new(AtomicU64::new(0)),
                fetched: Arc::new(AtomicU64::new(0)),
                cache_failed: AtomicBool::new(false),
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
            self.requests.load(Ordering::Relaxed),
            self.fetched.load(Ordering::Relaxed),
            used,
            limit,
            dir.display()
        )
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.runtime.block_on(f)
    }

    /// The objects in a folder (not below it), by name.
    pub fn list(&self, prefix: &ObjectPath) -> Result<Vec<(String, u64)>, String> {
        let url = self.url(prefix);
        self.block_on(async {
            let listed = self
                .store
                .list_with_delimiter(Some(prefix))
                .await
                .map_err(|e| store_error(&url, e))?;
            self.requests.fetch_add(1, Ordering::Relaxed);
            Ok(listed
                .objects
                .into_iter()
                .filter_map(|o| Some((o.location.filename()?.to_string(), o.size)))
                .collect())
        })
    }

    /// A whole (small) object: an index file.
    pub fn get_all(&self, path: &ObjectPath) -> Result<Vec<u8>, String> {
        let url = self.url(path);
        self.block_on(async {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let got = tokio::time::timeout(self.timeout, async {
                self.store.get(path).await?.bytes().await
            })
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
        let (first, size, etag, modified) = self
            .block_on(async {
                self.requests.fetch_add(1, Ordering::Relaxed);
                tokio::time::timeout(self.timeout, async {
                    let got = self
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
                    .fetch_range(path, etag.as_deref(), prefix.len() as u64..want)
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
            size,
            etag,
            modified: modified.into(),
            cache_key: String::new(),
            chunks: chunk_starts(&header),
            data_end: header.data_start() + header.data_len(),
            stale: AtomicBool::new(false),
            sequential: Mutex::new((u64::MAX, 1)),
        };
        let object = RemoteObject {
            cache_key: object.identity(),
            ..object
        };
        Ok((object, header))
    }

    /// One ranged GET, conditional on the ETag, bounded in time.
    fn fetch_range(
        &self,
        path: &ObjectPath,
        etag: Option<&str>,
        range: std::ops::Range<u64>,
    ) -> Result<Vec<u8>, FetchError> {
        self.block_on(fetch(
            self.store.clone(),
            self.gets.clone(),
            self.requests.clone(),
            self.timeout,
            path.clone(),
            etag.map(str::to_string),
            range,
        ))
    }
}

/// Why a remote object could not be opened.
#[derive(Debug)]
pub enum OpenError {
    Fetch(String),
    Format(FormatError),
}

async fn fetch(
    store: Arc<dyn ObjectStore>,
    gets: Arc<tokio::sync::Semaphore>,
    requests: Arc<AtomicU64>,
    timeout: Duration,
    path: ObjectPath,
    etag: Option<String>,
    range: std::ops::Range<u64>,
) -> Result<Vec<u8>, FetchError> {
    let want = range.end - range.start;
    let work = async {
        let _permit = gets
            .acquire()
            .await
            .map_err(|e| FetchError::Store(e.to_string()))?;
        requests.fetch_add(1, Ordering::Relaxed);
        let opts = GetOptions {
            if_match: etag,
            range: Some(GetRange::Bounded(range)),
            ..Default::default()
        };
        let got = store.get_opts(&path, opts).await.map_err(|e| match e {
            object_store::Error::Precondition { .. } => FetchError::Replaced,
            e => FetchError::Store(e.to_string()),
        })?;
        let bytes = got
            .bytes()
            .await
            .map_err(|e| FetchError::Store(e.to_string()))?;
        if bytes.len() as u64 != want {
            return Err(FetchError::Store(format!(
                "the server sent {} bytes for a range of {want}",
                bytes.len()
            )));
        }
        Ok(bytes.to_vec())
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| FetchError::TimedOut)?
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

/// What a fetch of a chunk gives: its bytes, or None when the cache has them.
type Fetched = Result<Option<Arc<Vec<u8>>>, FetchError>;

/// A chunk at hand: its cache file, or the bytes a fetch just gave.
enum Chunk {
    File(File),
    Memory(Arc<Vec<u8>>),
}

impl Chunk {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        match self {
            Chunk::File(f) => f.read_exact_at(buf, offset),
            Chunk::Memory(bytes) => {
                let src = usize::try_from(offset)
                    .ok()
                    .and_then(|o| bytes.get(o..o.checked_add(buf.len())?))
                    .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EIO))?;
                buf.copy_from_slice(src);
                Ok(())
            }
        }
    }
}

/// A remote checkpoint file, as validated at mount.
pub struct RemoteObject {
    remote: Arc<Remote>,
    url: String,
    path: ObjectPath,
    size: u64,
    etag: Option<String>,
    modified: SystemTime,
    /// Names this version of this object in the cache.
    cache_key: String,
    chunks: Vec<u64>,
    data_end: u64,
    /// Replaced behind the mount: said once, then every read fails.
    stale: AtomicBool,
    /// (last chunk read, read-ahead window in chunks).
    sequential: Mutex<(u64, u64)>,
}

impl RemoteObject {
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn modified(&self) -> SystemTime {
        self.modified
    }

    pub fn remote(&self) -> &Arc<Remote> {
        &self.remote
    }

    /// The object's file name (the last part of its path).
    pub fn file_name(&self) -> &str {
        self.path.filename().unwrap_or("object")
    }

    /// What names this version of the object: its URL, size, ETag and
    /// modification time (the last two are what the store says changes).
    pub fn identity(&self) -> String {
        let modified = self
            .modified
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let text = format!(
            "{}\n{}\n{}\n{modified}",
            self.url,
            self.size,
            self.etag.as_deref().unwrap_or("")
        );
        let h = text.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        format!("{h:016x}")
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

    /// Bytes `range` of the file (within the data section), through the cache.
    pub fn read(&self, range: std::ops::Range<u64>, what: &str) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity((range.end - range.start) as usize);
        if range.start >= range.end {
            return Ok(out);
        }
        let first = self.chunk_of(range.start);
        let last = self.chunk_of(range.end - 1);
        self.read_ahead(first, last);
        for k in first..=last {
            let chunk = self.chunk_range(k);
            let chunk_bytes = self.ensure(k).map_err(|e| self.failed(what, e))?;
            let from = range.start.max(chunk.start);
            let to = range.end.min(chunk.end);
            let at = out.len();
            out.resize(at + (to - from) as usize, 0);
            chunk_bytes.read_exact_at(&mut out[at..], from - chunk.start)?;
        }
        Ok(out)
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

    /// Grows the read-ahead window on sequential reads and starts fetching
    /// the chunks after `last` in the background.
    fn read_ahead(&self, first: usize, last: usize) {
        let window = {
            let mut seq = self.sequential.lock().unwrap_or_else(|p| p.into_inner());
            let (prev, window) = *seq;
            let first = first as u64;
            let sequential = prev != u64::MAX && (first == prev || first == prev + 1);
            let next = if sequential {
                (window * 2).min(MAX_WINDOW)
            } else {
                1
            };
            *seq = (last as u64, next);
            if sequential {
                next
            } else {
                0
            }
        };
        let end = (last + 1 + window as usize).min(self.chunks.len() - 1);
        for k in last + 1..end {
            let name = self.chunk_name(k);
            if self.remote.cache.busy(&name) || self.remote.cache.has(&name, self.chunk_range(k)) {
                continue;
            }
            let job = self.fetch_job(k);
            self.remote.runtime.spawn(async move {
                let _ = job.await;
            });
        }
    }

    /// Chunk `k`: its cache file, or the bytes just fetched.
    fn ensure(&self, k: usize) -> Result<Chunk, FetchError> {
        self.check()?;
        let name = self.chunk_name(k);
        let range = self.chunk_range(k);
        // A cache file may vanish between the fetch and the read (another
        // mount evicted it): one more try.
        for _ in 0..2 {
            if let Some(f) = self.remote.cache.get(&name, range.clone()) {
                return Ok(Chunk::File(f));
            }
            if let Some(bytes) = self.remote.block_on(self.fetch_job(k))? {
                return Ok(Chunk::Memory(bytes));
            }
        }
        Err(FetchError::Cache(format!(
            "{name} keeps vanishing from the cache"
        )))
    }

    /// Fetches chunk `k` into the cache; concurrent callers share one fetch.
    /// Gives the bytes fetched (None if the cache had them already).
    fn fetch_job(&self, k: usize) -> impl std::future::Future<Output = Fetched> + Send + 'static {
        let remote = self.remote.clone();
        let name = self.chunk_name(k);
        let range = self.chunk_range(k);
        let (path, etag) = (self.path.clone(), self.etag.clone());
        async move {
            let cell = remote.cache.inflight(&name);
            let result = cell
                .get_or_init(|| async {
                    if remote.cache.has(&name, range.clone()) {
                        return Ok(None);
                    }
                    let bytes = fetch(
                        remote.store.clone(),
                        remote.gets.clone(),
                        remote.requests.clone(),
                        remote.timeout,
                        path,
                        etag,
                        range.clone(),
                    )
                    .await?;
                    remote.fetched.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    // A full disk costs the cache, not the read.
                    if let Err(e) = remote.cache.put(&name, &bytes) {
                        if !remote.cache_failed.swap(true, Ordering::Relaxed) {
                            warn!(
                                cache = %remote.cache.folder.path.display(),
                                "writing the cache: {e}; reads are served from memory and fetched again next time"
                            );
                        }
                    }
                    Ok(Some(Arc::new(bytes)))
                })
                .await
                .clone();
            remote.cache.done(&name, &cell);
            result
        }
    }

    /// Brings `range` of the file into the cache, fetching its chunks in
    /// parallel; stops early when `keep_going` says so. Returns the bytes of
    /// the range in the cache now.
    pub fn warm(
        &self,
        range: std::ops::Range<u64>,
        keep_going: &(dyn Fn() -> bool + Sync),
    ) -> std::io::Result<u64> {
        if range.start >= range.end {
            return Ok(0);
        }
        self.check().map_err(|e| self.failed("prefetch", e))?;
        let (first, last) = (self.chunk_of(range.start), self.chunk_of(range.end - 1));
        let jobs: Vec<_> = (first..=last).map(|k| self.fetch_job(k)).collect();
        let remote = self.remote.clone();
        let handles: Vec<_> = jobs.into_iter().map(|j| remote.runtime.spawn(j)).collect();
        let mut failure = None;
        for h in handles {
            if !keep_going() {
                break;
            }
            match self.remote.block_on(h) {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => failure = Some(e),
                Err(e) => failure = Some(FetchError::Store(e.to_string())),
            }
        }
        if let Some(e) = failure {
            return Err(self.failed("prefetch", e));
        }
        Ok((first..=last)
            .filter(|&k| {
                self.remote
                    .cache
                    .has(&self.chunk_name(k), self.chunk_range(k))
            })
            .map(|k| {
                let c = self.chunk_range(k);
                c.end.min(range.end) - c.start.max(range.start)
            })
            .sum())
    }

    /// The end of the data section.
    pub fn data_end(&self) -> u64 {
        self.data_end
    }
}

/// Bytes after a chunk's payload: CRC-32 (4), payload length (8), magic (4).
const TRAILER: u64 = 16;
const MAGIC: &[u8; 4] = b"stfc";

/// The local disk cache of chunks, shared by the mounts of a user.
pub struct DiskCache {
    folder: Folder,
    limit: u64,
    state: Mutex<CacheState>,
    inflight: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<Fetched>>>>,
}

struct CacheState {
    lru: LruCache<String, u64>,
    used: u64,
    /// Files checked (size and CRC) by this process.
    verified: HashSet<String>,
}

impl DiskCache {
    /// Opens (making it 0700 if needed) a cache folder of this user's.
    pub fn open(dir: &Path, limit: u64) -> Result<DiskCache, String> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        // SAFETY: geteuid cannot fail.
        let euid = unsafe { libc::geteuid() };
        if !meta.is_dir() || meta.uid() != euid || meta.mode() & 0o022 != 0 {
            return Err(format!(
                "{}: refused as a cache folder: not a folder of uid {euid} closed to others (choose another with --cache-dir)",
                dir.display()
            ));
        }
        let folder = Folder::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        // What earlier mounts left, oldest first.
        let mut found: Vec<(SystemTime, String, u64)> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_str()?.to_string();
                let m = e.metadata().ok()?;
                if name.ends_with(".chunk") {
                    Some((m.modified().ok()?, name, m.len()))
                } else {
                    if name.contains(".chunk.tmp.") {
                        let _ = folder.unlink(OsStr::new(&name)); // a writer died
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
            state: Mutex::new(CacheState {
                lru,
                used,
                verified: HashSet::new(),
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

    /// The cache file of a chunk, if it is there and checks out (its CRC is
    /// checked the first time this process reads it).
    fn get(&self, name: &str, range: std::ops::Range<u64>) -> Option<File> {
        let len = range.end - range.start;
        let file = self
            .folder
            .open_file(OsStr::new(name), libc::O_RDONLY, 0)
            .ok()?;
        let good = file
            .metadata()
            .ok()
            .is_some_and(|m| m.len() == len + TRAILER)
            && (self.lock().verified.contains(name) || verify(&file, len));
        let mut st = self.lock();
        if !good {
            drop(st);
            warn!(
                file = name,
                "a cache file that does not check out: fetched again"
            );
            self.forget(name);
            return None;
        }
        st.verified.insert(name.to_string());
        if st.lru.get(name).is_none() {
            st.lru.put(name.to_string(), len + TRAILER);
            st.used += len + TRAILER;
        }
        Some(file)
    }

    fn forget(&self, name: &str) {
        let _ = self.folder.unlink(OsStr::new(name));
        let mut st = self.lock();
        if let Some(len) = st.lru.pop(name) {
            st.used -= len;
        }
        st.verified.remove(name);
    }

    /// Stores a chunk: a temp file renamed into place.
    fn put(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        let tmp = format!(
            "{name}.tmp.{}.{:x}",
            std::process::id(),
            crate::checkpoint::next_gen()
        );
        let f = self.folder.open_file(
            OsStr::new(&tmp),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )?;
        let mut trailer = Vec::with_capacity(TRAILER as usize);
        trailer.extend_from_slice(&crc32fast::hash(data).to_le_bytes());
        trailer.extend_from_slice(&(data.len() as u64).to_le_bytes());
        trailer.extend_from_slice(MAGIC);
        let written = f
            .write_all_at(data, 0)
            .and_then(|()| f.write_all_at(&trailer, data.len() as u64))
            .and_then(|()| self.folder.rename(OsStr::new(&tmp), OsStr::new(name)));
        if let Err(e) = written {
            let _ = self.folder.unlink(OsStr::new(&tmp));
            return Err(e);
        }
        let len = data.len() as u64 + TRAILER;
        {
            let mut st = self.lock();
            if let Some(old) = st.lru.put(name.to_string(), len) {
                st.used -= old;
            }
            st.used += len;
            st.verified.insert(name.to_string());
        }
        self.evict(Some(name));
        Ok(())
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

/// Checks a cache file's trailer against its payload.
fn verify(file: &File, len: u64) -> bool {
    let mut trailer = [0u8; TRAILER as usize];
    if file.read_exact_at(&mut trailer, len).is_err() || &trailer[12..] != MAGIC {
        return false;
    }
    let crc = u32::from_le_bytes(trailer[..4].try_into().expect("4 bytes"));
    let stored_len = u64::from_le_bytes(trailer[4..12].try_into().expect("8 bytes"));
    if stored_len != len {
        return false;
    }
    let mut hasher = crc32fast::Hasher::new();
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
    hasher.finalize() == crc
}

/// The default cache folder: `$XDG_CACHE_HOME/stfs`, else `~/.cache/stfs`.
pub fn default_cache_dir() -> PathBuf {
    match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d).join("stfs"),
        None => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".cache/stfs"))
            .unwrap_or_else(|| PathBuf::from("/var/tmp/stfs-cache")),
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
    fn the_cache_checks_what_it_serves_and_evicts() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::open(&dir.path().join("c"), 100).unwrap();
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
