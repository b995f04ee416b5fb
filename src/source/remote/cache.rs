//! The disk cache of remote objects: chunks written once and sealed with a
//! MAC under a key of the cache's own, in a private folder of this user's,
//! checked again before every use.

use super::*;
use crate::source::FolderError;
use crate::sync::LockAnyway;

/// Bytes after a chunk's payload: HMAC-SHA256 (32) of its name and payload
/// under the cache's key, payload length (8), magic (4).
pub(super) const TRAILER: u64 = 44;

pub(super) const MAGIC: &[u8; 4] = b"stfm";

/// The cache's secret, made with the folder: only files made by a process
/// that can read it check out, so a file planted by another user (in a folder
/// that was once open to others) is never served.
pub(super) const KEY_FILE: &str = "key";

/// The cache's key: read from the folder, or made (and the folder's files,
/// made under another key or planted, removed).
pub(super) fn cache_key(folder: &Folder, dir: &Path) -> Result<hmac::Key, FolderError> {
    let key_path = dir.join(KEY_FILE);
    let err = |e: std::io::Error| FolderError::io(&key_path)(e);
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
                folder.unlink_spent(&name);
            }
        }
        let mut secret = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
            .map_err(|_| FolderError::refused(dir, "no random bytes for the cache's key"))?;
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
                folder.unlink_spent(OsStr::new(&tmp));
            }
            Err(e) => {
                folder.unlink_spent(OsStr::new(&tmp));
                return Err(err(e));
            }
        }
    }
    Err(FolderError::refused(dir, "the cache's key keeps changing"))
}

/// Something in a cache folder that is not this user's regular file or
/// cache folder (the `key` a regular file): said in words, or None.
pub(super) fn foreign_entry(folder: &Folder, euid: u32) -> Option<String> {
    for name in folder.entries() {
        let Ok(st) = folder.stat_at(&name) else {
            continue;
        };
        let kind = st.mode & libc::S_IFMT;
        let shown = name.to_string_lossy();
        let fresh_folder =
            (shown.starts_with(FRESH_PREFIX) || shown == EDITS_FOLDER) && kind == libc::S_IFDIR;
        if st.uid != euid {
            return Some(format!("{shown:?} of uid {}", st.uid));
        }
        if kind != libc::S_IFREG && (!fresh_folder || shown == KEY_FILE) {
            return Some(format!("{shown:?}, not a regular file"));
        }
    }
    None
}

/// The private folders a cache moves to inside its folder.
pub(super) const FRESH_PREFIX: &str = "private.";
/// The folder in the cache folder where the edits of writable remote
/// mounts are staged and their uploads recorded.
pub const EDITS_FOLDER: &str = "edits";

/// The first `<dir>/private.N` that is (or is made) a folder of this user's
/// closed to others.
pub(super) fn fresh_private(dir: &Path, euid: u32) -> Result<(Folder, PathBuf), FolderError> {
    use std::os::unix::fs::DirBuilderExt;
    for n in 0..64 {
        let path = dir.join(format!("{FRESH_PREFIX}{n}"));
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(FolderError::io(&path)(e)),
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
                return Ok((folder, path));
            }
            _ => continue,
        }
    }
    Err(FolderError::refused(
        dir,
        "refused as a cache folder: it holds things of other users that cannot be removed \
         (choose another with --cache-dir)",
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

pub(super) struct CacheState {
    /// Cache files by name, least recently used first, with their sizes.
    pub(super) lru: LruCache<String, u64>,
    pub(super) used: u64,
    /// Files checked (size and MAC) by this process.
    pub(super) verified: HashSet<String>,
    /// The mappings of recently read chunks (address space only: their pages
    /// are the page cache's).
    pub(super) maps: LruCache<String, Arc<Mmap>>,
}

impl DiskCache {
    /// The folder where edits of remote sources are staged (`edits` in the
    /// cache folder, made 0700, refused if another user's or a link).
    pub fn edits_folder(&self) -> Result<Folder, FolderError> {
        use std::os::unix::fs::DirBuilderExt;
        let path = self.folder.path.join(EDITS_FOLDER);
        match std::fs::DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(FolderError::io(&path)(e)),
        }
        let folder = Folder::open_private(&path).map_err(FolderError::io(&path))?;
        let st = folder.stat().map_err(FolderError::io(&path))?;
        if st.uid != rustix::process::geteuid().as_raw() || st.mode & 0o077 != 0 {
            return Err(FolderError::refused(
                &path,
                "not a private folder of this user's (0700): refused for staging edits",
            ));
        }
        Ok(folder)
    }

    /// Opens (making it 0700 if needed) a cache folder of this user's.
    pub fn open(dir: &Path, limit: u64) -> Result<DiskCache, FolderError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(FolderError::io(dir))?;
        // Opened once, not through a link; checked and used by that descriptor.
        let folder = Folder::open_private(dir).map_err(|e| {
            let why = format!("refused as a cache folder: not a folder, or a symbolic link ({e})");
            FolderError::refused(dir, why)
        })?;
        let st = folder.stat().map_err(FolderError::io(dir))?;
        let euid = rustix::process::geteuid().as_raw();
        if st.uid != euid {
            let why = format!(
                "refused as a cache folder: it belongs to uid {}, not to uid {euid} (choose \
                 another with --cache-dir)",
                st.uid
            );
            return Err(FolderError::refused(dir, why));
        }
        if st.mode & 0o077 != 0 {
            folder
                .chmod(0o700)
                .map_err(|e| FolderError::refused(dir, format!("making it private (0700): {e}")))?;
            // Anything in it, the key too, may have been planted by another user.
            for name in folder.entries() {
                folder.unlink_spent(&name);
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
                if st.mode & libc::S_IFMT != libc::S_IFREG {
                    return None;
                }
                if name.ends_with(".chunk") {
                    Some((st.mtime, name, st.len))
                } else {
                    if writer_gone(&name) {
                        folder.unlink_spent(OsStr::new(&name));
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
    pub(super) fn usage(&self) -> (u64, u64, &Path) {
        (self.lock().used, self.limit, &self.folder.path)
    }

    /// The cache folder, opened.
    pub fn folder(&self) -> &Folder {
        &self.folder
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.state.lock_anyway()
    }

    /// Whether chunk `name` is in the cache (as far as this process knows).
    pub(super) fn has(&self, name: &str, range: std::ops::Range<u64>) -> bool {
        self.lock().lru.peek(name) == Some(&(range.end - range.start + TRAILER))
    }

    /// A chunk's cache file, mapped, if it is there and checks out (its MAC
    /// is checked the first time this process maps it). The mappings of
    /// recent chunks are kept: a read of a cached chunk makes no system call.
    pub(super) fn get(&self, name: &str, range: std::ops::Range<u64>) -> Option<Arc<Mmap>> {
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
        let now = rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_NOW,
        };
        let _ = rustix::fs::futimens(
            &file,
            &rustix::fs::Timestamps {
                last_access: now,
                last_modification: now,
            },
        );
        let mut st = self.lock();
        st.verified.insert(name.to_string());
        if st.lru.get(name).is_none() {
            st.lru.put(name.to_string(), len + TRAILER);
            st.used += len + TRAILER;
        }
        st.maps.put(name.to_string(), map.clone());
        Some(map)
    }

    pub(super) fn forget(&self, name: &str) {
        self.folder.unlink_spent(OsStr::new(name));
        let mut st = self.lock();
        if let Some(len) = st.lru.pop(name) {
            st.used -= len;
        }
        st.verified.remove(name);
        st.maps.pop(name);
    }

    /// Starts writing chunk `name`: a temp file, renamed into place when
    /// complete (so that another mount never sees half a chunk).
    pub(super) fn begin(self: &Arc<Self>, name: &str) -> std::io::Result<CacheWriter> {
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
    pub(super) fn put(self: &Arc<Self>, name: &str, data: &[u8]) -> std::io::Result<()> {
        let mut w = self.begin(name)?;
        w.write(data)?;
        match w.finish() {
            Ok(Landed::Cache(_)) => Ok(()),
            _ => Err(std::io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    /// A chunk file just renamed into place, and its mapping.
    pub(super) fn added(&self, name: &str, len: u64, map: Arc<Mmap>) {
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
    pub(super) fn failed(&self, e: &std::io::Error) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            warn!(
                cache = %self.folder.path.display(),
                "writing the cache: {e}; reads are served from memory and fetched again next time"
            );
        }
    }

    /// Removes the least recently used files past the size limit (never `keep`).
    pub(super) fn evict(&self, keep: Option<&str>) {
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
            self.folder.unlink_spent(OsStr::new(&victim));
        }
    }

    /// Whether a fetch of chunk `name` is under way.
    pub(super) fn busy(&self, name: &str) -> bool {
        self.inflight.lock_anyway().contains_key(name)
    }

    pub(super) fn inflight(&self, name: &str) -> Arc<tokio::sync::OnceCell<Fetched>> {
        self.inflight
            .lock_anyway()
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    pub(super) fn done(&self, name: &str, cell: &Arc<tokio::sync::OnceCell<Fetched>>) {
        let mut m = self.inflight.lock_anyway();
        if m.get(name).is_some_and(|c| Arc::ptr_eq(c, cell)) {
            m.remove(name);
        }
    }
}

/// A chunk being written into the cache as it arrives.
pub(super) struct CacheWriter {
    pub(super) cache: Arc<DiskCache>,
    pub(super) name: String,
    pub(super) tmp: String,
    /// None once finished or abandoned.
    pub(super) file: Option<File>,
    pub(super) written: u64,
    pub(super) mac: hmac::Context,
}

impl CacheWriter {
    pub(super) fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
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
    pub(super) fn abandon(&mut self, e: &std::io::Error) -> Result<Vec<u8>, FetchError> {
        self.cache.failed(e);
        let file = self
            .file
            .take()
            .ok_or_else(|| FetchError::Cache(e.to_string()))?;
        let mut bytes = vec![0u8; self.written as usize];
        let read_back = file.read_exact_at(&mut bytes, 0);
        self.cache.folder.unlink_spent(OsStr::new(&self.tmp));
        read_back.map_err(|r| FetchError::Cache(format!("{e}, then reading back: {r}")))?;
        Ok(bytes)
    }

    /// Adds the trailer and renames the file into place; if that fails, the
    /// bytes come back in memory.
    pub(super) fn finish(mut self) -> Result<Landed, FetchError> {
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
            self.cache.folder.unlink_spent(OsStr::new(&self.tmp));
        }
    }
}

/// Whether `name` is the temp file of a cache writer that died
/// (`<chunk>.tmp.<pid>.<n>`, and no process `pid`): a live mount sharing the
/// folder may be writing the others.
pub(super) fn writer_gone(name: &str) -> bool {
    let Some((_, rest)) = name.split_once(".chunk.tmp.") else {
        return false;
    };
    let Some(pid) = rest
        .split('.')
        .next()
        .and_then(|p| p.parse::<i32>().ok())
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    pid != rustix::process::getpid()
        && rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
}

/// The MAC of a chunk file: its name, then its payload.
pub(super) fn chunk_mac(key: &hmac::Key, name: &str) -> hmac::Context {
    let mut mac = hmac::Context::with_key(key);
    mac.update(name.as_bytes());
    mac
}

/// Checks a cache file's trailer against its name and payload.
pub(super) fn verify(file: &File, len: u64, name: &str, key: &hmac::Key) -> bool {
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
