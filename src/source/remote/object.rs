//! A remote object as a source's store: its version (the ETag seen at
//! mount), its bytes in chunks fetched on demand into the disk cache, read
//! ahead while a reader streams, and checked against the store.

use super::*;

/// Why a remote object could not be opened.
#[derive(Debug)]
pub enum OpenError {
    Fetch(String),
    Format(FormatError),
}

/// A remote checkpoint file, as validated at mount.
pub struct RemoteObject {
    pub(super) remote: Arc<Remote>,
    pub(super) url: String,
    pub(super) path: ObjectPath,
    pub(super) version: ObjectVersion,
    /// Names this version of this object in the cache.
    pub(super) cache_key: String,
    pub(super) chunks: Vec<u64>,
    pub(super) data_end: u64,
    /// The bytes before the data, kept where something reads them after
    /// the mount (a GGUF file's key arrays: `__kv__`, `__metadata__.json`).
    pub(super) head: Option<Vec<u8>>,
    /// Its own headers (type, cache policy, user metadata), which a commit
    /// gives the object that replaces it.
    pub(super) headers: super::s3::ObjectHeaders,
    /// Replaced behind the mount: said once, then every read fails.
    pub(super) stale: AtomicBool,
    /// How recently read tensors are being read, by tensor index.
    pub(super) streams: Mutex<LruCache<u32, Stream>>,
}

impl RemoteObject {
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn size(&self) -> u64 {
        self.version.size
    }

    /// Its own headers, which a commit keeps.
    pub fn headers(&self) -> &super::s3::ObjectHeaders {
        &self.headers
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
