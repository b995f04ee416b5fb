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
mod fetch;
pub mod s3;
use crate::errno::{ToErrno, with_causes};
use crate::sync::LockAnyway;
pub use cache::*;
use fetch::*;

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
    /// Connects to the store a URL names: `s3://bucket/key`, `s3://bucket/prefix/`,
    /// `gs://`, `az://`, `https://host/path`. Credentials and settings come from
    /// the standard environment (AWS_*, GOOGLE_*, AZURE_*).
    pub fn connect(url: &str, opts: &RemoteOptions) -> Result<Location, RemoteError> {
        let parsed =
            url::Url::parse(url).map_err(|e| RemoteError::url(url, format!("not a URL: {e}")))?;
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
            let why =
                "a URL with a query string (a presigned URL, a version id) is not supported yet";
            return Err(RemoteError::url(url, why));
        }
        // `s3://bucket` is the bucket's top folder.
        let folder = parsed.path().ends_with('/') || parsed.path().is_empty();
        let mut writer = None;
        let (store, path, origin): (Arc<dyn ObjectStore>, String, String) = match parsed.scheme() {
            "s3" | "s3a" => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_url(url)
                    .with_client_options(client.clone())
                    .with_retry(retry);
                // The shared files fill in what the environment does not say.
                let profile = super::aws_profile::load();
                let unset = |var: &str| std::env::var_os(var).is_none();
                if unset("AWS_ACCESS_KEY_ID") {
                    if let (Some(id), Some(secret)) =
                        (profile.access_key_id, profile.secret_access_key)
                    {
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
                if let Some(ep) = &endpoint {
                    b = b
                        .with_allow_http(ep.starts_with("http://"))
                        .with_endpoint(ep)
                        .with_virtual_hosted_style_request(false);
                }
                let region = b
                    .get_config_value(&object_store::aws::AmazonS3ConfigKey::Region)
                    .unwrap_or_else(|| "us-east-1".to_string());
                let store = b
                    .build()
                    .map_err(|e| RemoteError::url(url, e.to_string()))?;
                let bucket = parsed.host_str().unwrap_or_default();
                writer = Some(Arc::new(
                    s3::S3Writer::new(
                        store.credentials().clone(),
                        &client.clone().with_allow_http(
                            endpoint.as_ref().is_some_and(|e| e.starts_with("http://")),
                        ),
                        region,
                        bucket.to_string(),
                        endpoint,
                        opts.timeout,
                    )
                    .map_err(|e| RemoteError::url(url, e))?,
                ));
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
                    .map_err(|e| RemoteError::url(url, e.to_string()))?;
                let bucket = parsed.host_str().unwrap_or_default();
                (
                    Arc::new(store),
                    parsed.path().to_string(),
                    format!("gs://{bucket}"),
                )
            }
            "az" | "azure" | "abfs" | "abfss" => {
                let store = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry)
                    .build()
                    .map_err(|e| RemoteError::url(url, e.to_string()))?;
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
                    .map_err(|e| RemoteError::url(url, e.to_string()))?;
                (Arc::new(store), parsed.path().to_string(), origin)
            }
            other => {
                return Err(RemoteError::url(
                    url,
                    format!(
                        "unknown scheme {other:?} (s3://, gs://, az://, http:// and https:// are \
                         known)"
                    ),
                ));
            }
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("stfs-remote")
            .enable_all()
            .build()
            .map_err(RemoteError::Runtime)?;
        let cache = DiskCache::open(&opts.cache_dir, opts.cache_size)?;
        let path = ObjectPath::from_url_path(path.trim_matches('/'))
            .map_err(|e| RemoteError::url(url, e.to_string()))?;
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
                writer,
            }),
            path,
            folder,
        })
    }

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
    pub fn list(&self, prefix: &ObjectPath) -> Result<Vec<(String, ObjectPath)>, RemoteError> {
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
                .filter_map(|o| Some((o.location.filename()?.to_string(), o.location)))
                .collect())
        })
    }

    /// A whole (small) object, an index file: its bytes and ETag.
    pub fn get_all(&self, path: &ObjectPath) -> Result<(Vec<u8>, Option<String>), RemoteError> {
        let url = self.url(path);
        let f = &self.fetcher;
        self.block_on(async {
            f.requests.fetch_add(1, Ordering::Relaxed);
            let got = tokio::time::timeout(f.timeout, async {
                let got = f.store.get(path).await?;
                let etag = got.meta.e_tag.clone();
                Ok::<_, object_store::Error>((got.bytes().await?, etag))
            })
            .await
            .map_err(|_| RemoteError::Request(format!("{url}: {}", FetchError::TimedOut)))?
            .map_err(|e| RemoteError::Request(store_error(&url, e)))?;
            Ok((got.0.to_vec(), got.1))
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
        Ok(self.object(path, url, version, header))
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

/// Why a remote object could not be opened.
#[derive(Debug)]
pub enum OpenError {
    Fetch(String),
    Format(FormatError),
}

/// A remote checkpoint file, as validated at mount.
pub struct RemoteObject {
    remote: Arc<Remote>,
    url: String,
    path: ObjectPath,
    version: ObjectVersion,
    /// Names this version of this object in the cache.
    cache_key: String,
    chunks: Vec<u64>,
    data_end: u64,
    /// The bytes before the data, kept where something reads them after
    /// the mount (a GGUF file's key arrays: `__kv__`, `__metadata__.json`).
    head: Option<Vec<u8>>,
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

    /// The bytes before the data, where they were kept.
    pub fn head(&self) -> Option<&[u8]> {
        self.head.as_deref()
    }

    pub fn modified(&self) -> SystemTime {
        self.version.modified
    }

    pub fn remote(&self) -> &Arc<Remote> {
        &self.remote
    }

    /// The object's path in its store.
    pub fn path(&self) -> &ObjectPath {
        &self.path
    }

    /// The ETag of the version this mount reads (None: the server gives none).
    pub fn etag(&self) -> Option<&str> {
        self.version.etag.as_deref()
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

    /// After a commit that made this object from `old`: the cached chunks of
    /// `old` whose bytes are at the same offsets here (`same`: ranges of this
    /// object that hold `old`'s bytes at their old place) are kept as chunks
    /// of this version, so that reads after the commit need no request.
    /// Returns how many.
    pub fn adopt_chunks(&self, old: &RemoteObject, same: &[std::ops::Range<u64>]) -> usize {
        let cache = &self.remote.cache;
        let mut adopted = 0;
        for k in 0..self.chunks.len().saturating_sub(1) {
            let range = self.chunk_range(k);
            if !same
                .iter()
                .any(|s| s.start <= range.start && range.end <= s.end)
            {
                continue;
            }
            let Ok(j) = old.chunks.binary_search(&range.start) else {
                continue;
            };
            if old.chunks.get(j + 1) != Some(&range.end) {
                continue;
            }
            let from = old.chunk_name(j);
            if !cache.has(&from, range.clone()) {
                continue;
            }
            let Some(map) = cache.get(&from, range.clone()) else {
                continue;
            };
            let len = (range.end - range.start) as usize;
            if cache.put(&self.chunk_name(k), &map[..len]).is_ok() {
                adopted += 1;
            }
        }
        adopted
    }

    /// Whether a read found the object replaced behind the mount.
    pub fn replaced(&self) -> bool {
        self.stale.load(Ordering::Relaxed)
    }

    /// Asks the store (one HEAD, bounded by --timeout) whether the object
    /// is still the version mounted; a replaced one is then refused as a
    /// read that found it would refuse it. A store that does not answer
    /// tells nothing (false). Never called under a lock of the state.
    pub fn look_again(&self) -> bool {
        if self.replaced() {
            return true;
        }
        let f = &self.remote.fetcher;
        let head = self.remote.block_on(async {
            f.requests.fetch_add(1, Ordering::Relaxed);
            tokio::time::timeout(f.timeout, f.store.head(&self.path)).await
        });
        let replaced = match head {
            Ok(Ok(meta)) => !self.version.sent(&meta),
            Ok(Err(object_store::Error::NotFound { .. })) => true,
            _ => false,
        };
        if replaced && !self.stale.swap(true, Ordering::Relaxed) {
            warn!(url = self.url, "{}", FetchError::Replaced);
        }
        replaced
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
        std::io::Error::from_raw_os_error(e.to_errno())
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
            let mut streams = self.streams.lock_anyway();
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
            let mut streams = self.streams.lock_anyway();
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

#[cfg(test)]
mod tests;
