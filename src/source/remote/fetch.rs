//! Fetching an object's chunks: one fetcher per version of the object,
//! the chunks in flight, and where each lands (the disk cache, or memory).

use super::*;

/// What GETs ranges: the store, the limit on GETs at once, the time limit,
/// and the counters. Cheap to clone into a task.
#[derive(Clone)]
pub(super) struct Fetcher {
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) gets: Arc<tokio::sync::Semaphore>,
    pub(super) timeout: Duration,
    /// GET requests made (for `stfs status` and the tests).
    pub(super) requests: Arc<AtomicU64>,
    /// Bytes of tensor data fetched.
    pub(super) fetched: Arc<AtomicU64>,
}

/// The version of an object seen at mount.
#[derive(Clone)]
pub(super) struct ObjectVersion {
    pub(super) size: u64,
    pub(super) etag: Option<String>,
    pub(super) modified: SystemTime,
}

impl ObjectVersion {
    /// Whether an answer is of this version: same size, same ETag (a server
    /// that ignores If-Match still names the version it sends), and, where
    /// there is no ETag, the same modification time.
    pub(super) fn sent(&self, meta: &object_store::ObjectMeta) -> bool {
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
pub(super) enum Landed {
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
    pub(super) async fn get(
        self,
        path: ObjectPath,
        version: Option<ObjectVersion>,
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
pub(super) enum Sink {
    // Boxed: the MAC's state makes a writer large.
    Cache(Box<CacheWriter>),
    Memory(bytes::BytesMut),
}

impl Sink {
    pub(super) fn take(&mut self, frame: &[u8]) -> Result<(), FetchError> {
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

    pub(super) fn finish(self) -> Result<Landed, FetchError> {
        match self {
            Sink::Memory(m) => Ok(Landed::Memory(m.freeze())),
            Sink::Cache(w) => w.finish(),
        }
    }
}

/// File offsets where chunks start (the last entry is the end of the data):
/// small tensors share a chunk, large ones are cut every CHUNK bytes.
pub(super) fn chunk_starts(header: &Header) -> Vec<u64> {
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
pub(super) type Fetched = Result<Chunk, FetchError>;

/// A chunk at hand: its cache file (mapped), or the bytes a fetch just gave.
#[derive(Clone)]
pub(super) enum Chunk {
    Mapped(Arc<Mmap>),
    Memory(Bytes),
}

impl Chunk {
    /// Bytes `range` of the chunk (relative to its start).
    pub(super) fn bytes(&self, range: std::ops::Range<usize>) -> std::io::Result<&[u8]> {
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
pub(super) struct Stream {
    /// Where the next read starts if the reader goes on sequentially.
    pub(super) next: u64,
    /// Chunks to fetch ahead of the one read (0: not sequential).
    pub(super) window: usize,
    /// Chunks below this were looked at (fetched, or found cached) already.
    pub(super) looked_at: usize,
}

/// Tensors whose read-ahead state is kept (readers at once, at most).
pub(super) const STREAMS: usize = 64;
