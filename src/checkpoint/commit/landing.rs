//! Putting a commit's files in place: the new files written beside their
//! targets (`Written`), the in-place jobs, and `land`, which records them
//! and lands them all.

use super::*;
use crate::sync::LockAnyway;

/// A new file written beside its target, not yet renamed over it.
pub struct Written {
    pub(super) folder: Arc<Folder>,
    pub(super) tmp: OsString,
    pub(super) target: OsString,
    pub(super) file: File,
    pub(super) stat: FileStat,
    /// The file the target must still be when it is replaced (the source
    /// as mapped), unless the commit is forced or the target is an index.
    pub(super) replaces: Option<FileStat>,
    /// A new name: it lands only where nothing is (a model file made
    /// through the mount).
    pub(super) fresh_name: bool,
}

impl Written {
    /// Removes the temp file (a commit that will not land).
    pub fn remove(&self) {
        self.folder.unlink_spent(&self.tmp);
    }

    pub fn stat(&self) -> FileStat {
        self.stat
    }

    pub fn target(&self) -> PathBuf {
        self.folder.path.join(&self.target)
    }

    /// Puts the file in place. With `replaces`: only over that very file
    /// (exchanged with it, the file taken out checked, exchanged back if it
    /// is another: a program that replaced the source since the commit's
    /// check loses nothing), else ESTALE.
    pub(super) fn land(&self) -> Result<(), CommitError> {
        let err = |e| CommitError::Io {
            what: format!("renaming over {}", self.target().display()),
            source: e,
        };
        if self.fresh_name {
            return match self.folder.rename_noreplace(&self.tmp, &self.target) {
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Err(CommitError::Conflict {
                    file: self.target(),
                }),
                done => done.map_err(err),
            };
        }
        let Some(expected) = self.replaces else {
            return self.folder.rename(&self.tmp, &self.target).map_err(err);
        };
        match self.folder.exchange(&self.tmp, &self.target) {
            Ok(()) => {}
            // A filesystem without RENAME_EXCHANGE: the check under the lock was the last.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                return self.folder.rename(&self.tmp, &self.target).map_err(err);
            }
            Err(e) => return Err(err(e)),
        }
        let out = self.folder.stat_at(&self.tmp).map_err(err)?;
        if out.dev == expected.dev && out.ino == expected.ino {
            self.folder.unlink_spent(&self.tmp);
            return Ok(());
        }
        self.folder.exchange(&self.tmp, &self.target).map_err(err)?;
        Err(CommitError::Conflict {
            file: self.target(),
        })
    }

    /// Creates the temp file beside `target`, fills it with `fill`, gives it
    /// `like`'s mode (and owner, as root) and fsyncs it. With `like_file`
    /// (the source), its owner and mode as they are now, and its extended
    /// attributes (ACLs, user attributes, labels), are carried over. On
    /// failure nothing is left.
    pub fn create(
        folder: &Arc<Folder>,
        target: &std::ffi::OsStr,
        like: &FileStat,
        like_file: Option<&File>,
        fill: impl FnOnce(&File) -> Result<(), CommitError>,
    ) -> Result<Written, CommitError> {
        let like = match like_file.map(FileStat::of) {
            Some(Ok(now)) => FileStat {
                mode: now.mode,
                uid: now.uid,
                gid: now.gid,
                ..*like
            },
            _ => *like,
        };
        let (tmp, file) = create_temp(folder, target)?;
        let what = |e| CommitError::Io {
            what: format!("writing {}", folder.path.join(&tmp).display()),
            source: e,
        };
        let finish = || -> Result<FileStat, CommitError> {
            fill(&file)?;
            use std::os::unix::fs::PermissionsExt;
            // (No set-id bit yet: the file is the daemon user's until chown.)
            let mode = std::fs::Permissions::from_mode(like.mode & 0o777);
            crate::testpoint::io("chmod").map_err(what)?;
            file.set_permissions(mode).map_err(what)?;
            if rustix::process::geteuid().as_raw() == 0 {
                crate::testpoint::io("chown").map_err(what)?;
                std::os::unix::fs::fchown(&file, Some(like.uid), Some(like.gid)).map_err(what)?;
            }
            if let Some(from) = like_file {
                let missed = crate::source::access::copy_xattrs(from, &file);
                if !missed.is_empty() {
                    warn!(
                        file = %folder.path.join(target).display(),
                        "extended attributes not carried over to the new file: {}",
                        missed.join(", ")
                    );
                }
            }
            // chown clears set-id bits, and an ACL set the group bits: the mode
            // last. A set-id bit only for the source's own owner and group: a
            // rewrite by another user makes a file of that user's, which must
            // not become set-uid to them.
            let made = FileStat::of(&file).map_err(what)?;
            let mut bits = like.mode & 0o7777;
            if made.uid != like.uid {
                bits &= !libc::S_ISUID;
            }
            if made.gid != like.gid {
                bits &= !libc::S_ISGID;
            }
            if bits != like.mode & 0o7777 {
                warn!(
                    file = %folder.path.join(target).display(),
                    "the new file belongs to uid {} gid {}, not to the source's {} {}: its set-id bits are dropped",
                    made.uid, made.gid, like.uid, like.gid
                );
            }
            crate::testpoint::io("chmod").map_err(what)?;
            file.set_permissions(std::fs::Permissions::from_mode(bits))
                .map_err(what)?;
            crate::testpoint::synced(&file, file.sync_all()).map_err(what)?;
            crate::testpoint::point("rewrite:written").map_err(what)?;
            FileStat::of(&file).map_err(what)
        };
        match finish() {
            Ok(stat) => Ok(Written {
                folder: folder.clone(),
                tmp,
                target: target.to_os_string(),
                file,
                stat,
                replaces: None,
                fresh_name: false,
            }),
            Err(e) => {
                folder.unlink_spent(&tmp);
                Err(e)
            }
        }
    }
}

/// A new temp file beside `target`: `.<target>.stfs-tmp-<pid>-<random>`,
/// made with O_EXCL. The random part keeps another user from making the name
/// first (in a sticky folder such as /tmp, a file made there in advance
/// could not be removed); a name taken anyway is tried again with another.
pub(super) fn create_temp(
    folder: &Folder,
    target: &std::ffi::OsStr,
) -> Result<(OsString, File), CommitError> {
    let rng = ring::rand::SystemRandom::new();
    let mut last = None;
    for _ in 0..16 {
        let mut r = [0u8; 8];
        ring::rand::SecureRandom::fill(&rng, &mut r).map_err(|_| {
            io_err("making a temp file's name")(std::io::Error::other("no random bytes"))
        })?;
        let tmp = OsString::from(format!(
            ".{}.stfs-tmp-{}-{:016x}",
            target.to_string_lossy(),
            std::process::id(),
            u64::from_le_bytes(r)
        ));
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW;
        match folder.open_file(&tmp, flags, 0o600) {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                warn!(folder = %folder.path.display(), "temp name {} taken by someone else: another", tmp.to_string_lossy());
                last = Some((tmp, e));
            }
            Err(e) => {
                return Err(io_err(format!(
                    "writing {}",
                    folder.path.join(&tmp).display()
                ))(e));
            }
        }
    }
    let (tmp, e) = last.expect("tried");
    Err(io_err(format!(
        "writing {}",
        folder.path.join(&tmp).display()
    ))(e))
}

/// What a commit puts in place, from written to landed: a new file renamed
/// over its target (`Written`), a source written in place (`InPlaceJob`), a
/// remote object (`remote::RemoteJob`). Each owns its whole life, so `land`
/// and the transaction call them without knowing which they are.
pub trait Landing: Send + Sync {
    /// The file as it will be once landed (the journal's `Landing` note).
    fn stat(&self) -> FileStat;
    /// What it lands on.
    fn target(&self) -> PathBuf;
    /// Its part of the commit's record (written before anything changes,
    /// so that the next mount finishes what a crash interrupted).
    fn record(&self, renames: &mut Renames, dir: &StagingDir) -> Result<(), CommitError>;
    /// The folder whose new names must be durable before the record is,
    /// and synced again once everything landed.
    fn folder(&self) -> Option<&Arc<Folder>> {
        None
    }
    /// Puts it in place.
    fn land(&self, dir: &StagingDir) -> Result<(), Unlanded>;
    /// Forgets a landing that will not happen (its temp file, its upload).
    fn remove(&self);
    /// What it did, in words, once landed (None: what the plan said).
    fn landed_words(&self) -> Option<String> {
        None
    }
    /// The ETag of the object it put, once landed (a remote model file).
    fn etag(&self) -> Option<String> {
        None
    }
    /// The source once landed (`old`: the one it replaces), with `header`.
    fn fresh(&self, old: &SourceFile, header: Header) -> Result<SourceFile, CommitError>;
    /// What the mount's own reader makes of the checkpoint it will leave
    /// (None: not a checkpoint, an index), checked before anything lands.
    fn reads_as(&self) -> Option<Result<Header, CommitError>>;
}

/// Why a landing did not land: whether its target changed all the same
/// (and is left refused by every reader).
pub struct Unlanded {
    pub changed: bool,
    pub refused: bool,
    pub error: CommitError,
}

impl Unlanded {
    pub(super) fn unchanged(error: CommitError) -> Unlanded {
        Unlanded {
            changed: false,
            refused: false,
            error,
        }
    }
}

impl Landing for Written {
    fn stat(&self) -> FileStat {
        self.stat
    }

    fn target(&self) -> PathBuf {
        Written::target(self)
    }

    fn record(&self, renames: &mut Renames, _dir: &StagingDir) -> Result<(), CommitError> {
        renames.files.push(PendingRename {
            folder: self.folder.path.clone(),
            tmp: self.tmp.to_string_lossy().into_owned(),
            target: self.target.to_string_lossy().into_owned(),
            stat: self.stat,
            replaces: self.replaces,
        });
        Ok(())
    }

    fn folder(&self) -> Option<&Arc<Folder>> {
        Some(&self.folder)
    }

    fn land(&self, _dir: &StagingDir) -> Result<(), Unlanded> {
        Written::land(self).map_err(Unlanded::unchanged)?;
        let _ = crate::testpoint::point("land:renamed");
        Ok(())
    }

    fn remove(&self) {
        Written::remove(self)
    }

    fn reads_as(&self) -> Option<Result<Header, CommitError>> {
        if self.target.as_encoded_bytes().ends_with(b".json") {
            return None;
        }
        // As a mount reads a file: the whole of it, mapped.
        // SAFETY: the temp file is this commit's own, written and synced;
        // nothing else writes it (O_EXCL, a name of its own).
        Some(match unsafe { memmap2::Mmap::map(&self.file) } {
            Ok(map) => crate::format::read_checkpoint(&map, &self.target).map_err(|error| {
                CommitError::WouldBeRefused {
                    file: self.target(),
                    error,
                }
            }),
            Err(source) => Err(CommitError::Io {
                what: format!(
                    "reading back {}",
                    self.folder.path.join(&self.tmp).display()
                ),
                source,
            }),
        })
    }

    fn fresh(&self, old: &SourceFile, header: Header) -> Result<SourceFile, CommitError> {
        let target = self.target().display().to_string();
        let what = |e| io_err(target.clone())(e);
        // The very file written (not whatever has the name now): open for
        // writing too if the source was, read-only if not.
        let writable = old.writable_file().is_some();
        let file = match writable {
            true => self.file.try_clone(),
            false => File::open(format!("/proc/self/fd/{}", self.file.as_raw_fd())),
        }
        .map_err(&what)?;
        SourceFile::committed(old, file, writable, header, self.stat).map_err(what)
    }
}

impl Landing for InPlaceJob {
    fn reads_as(&self) -> Option<Result<Header, CommitError>> {
        Some(
            Header::parse_any_prefix(&self.header, self.record.after_len).map_err(|error| {
                CommitError::WouldBeRefused {
                    file: self.source.path().to_path_buf(),
                    error,
                }
            }),
        )
    }

    fn stat(&self) -> FileStat {
        FileStat {
            len: self.record.after_len,
            mtime: self.record.after_mtime,
            ..self.record.before
        }
    }

    fn target(&self) -> PathBuf {
        self.source.path().to_path_buf()
    }

    fn record(&self, renames: &mut Renames, dir: &StagingDir) -> Result<(), CommitError> {
        let name = &self.record.header_file;
        dir.write_atomic(name, &self.record.stored_header(&self.header))
            .map_err(io_err(format!("{}/{name}", dir.path().display())))?;
        renames.in_place.push(self.record.clone());
        Ok(())
    }

    fn land(&self, dir: &StagingDir) -> Result<(), Unlanded> {
        let ran = dir
            .folder()
            .map_err(|e| in_place::ApplyError {
                marked: false,
                error: e,
            })
            .and_then(|d| self.run(&d));
        match ran {
            Ok(()) => {
                info!(file = %self.source.path().display(), "committed in place");
                Ok(())
            }
            Err(e) => Err(Unlanded {
                changed: e.marked,
                refused: e.marked,
                error: self.error(e),
            }),
        }
    }

    /// (Its lease goes with it.)
    fn remove(&self) {}

    fn landed_words(&self) -> Option<String> {
        Some(self.describe())
    }

    fn fresh(&self, old: &SourceFile, header: Header) -> Result<SourceFile, CommitError> {
        let what = || self.source.path().display().to_string();
        let landed = self.landed.lock_anyway().take();
        let landed = landed.ok_or_else(|| CommitError::Io {
            what: what(),
            source: std::io::Error::other("the in-place commit left no version"),
        })?;
        old.rewritten_in_place(header, landed)
            .map_err(io_err(what()))
    }
}

/// An in-place commit of one file, ready to run (its lease held).
pub struct InPlaceJob {
    pub(super) source: Arc<SourceFile>,
    /// The file as the commit left it, taken while the lease still kept
    /// every other writer out: the version later commits check the file
    /// against (a program that writes as soon as its open returns has
    /// changed it since, and the next commit is refused).
    pub(super) landed: std::sync::Mutex<Option<FileStat>>,
    pub(super) file: Arc<File>,
    pub(super) lease: std::sync::Mutex<Option<Lease>>,
    pub(super) record: InPlaceRecord,
    pub(super) header: Vec<u8>,
    /// The staging files the writes copy from, by name.
    pub(super) staged: std::collections::HashMap<String, Arc<StagedFile>>,
    /// What it changes in words, and the bytes it writes (`InPlaceLayout`).
    pub(super) summary: String,
    pub(super) bytes: u64,
    /// The bytes it shared with staging files, once done.
    pub(super) shared: std::sync::atomic::AtomicU64,
}

impl InPlaceJob {
    pub(super) fn run(&self, dir: &Folder) -> Result<(), in_place::ApplyError> {
        let lease = self.lease.lock_anyway().take();
        if !lease.as_ref().is_some_and(Lease::holds) {
            return Err(in_place::ApplyError {
                marked: false,
                error: std::io::Error::from_raw_os_error(libc::EAGAIN),
            });
        }
        // (Checked as recovery checks it: a plan that breaks a rule of the
        // record, a copy reading a range another write changes, writes nothing.)
        let unmarked = |error| in_place::ApplyError {
            marked: false,
            error,
        };
        let len = self.file.metadata().map_err(unmarked)?.len();
        let staged_len = |name: &str| {
            self.staged
                .get(name)
                .map(|s| s.len())
                .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))
        };
        self.record
            .check(&self.header, len, &staged_len)
            .map_err(|why| unmarked(std::io::Error::other(format!("internal: {why}"))))?;
        let open_staged = |name: &str| {
            self.staged
                .get(name)
                .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))?
                .file()
        };
        self.source.begin_in_place();
        // What the page cache held of the file before blocks are inserted
        // at its start (which empties it), brought back once the commit is done.
        let recache = std::sync::Mutex::new(None);
        let insert = |len| {
            let cached = self
                .file
                .metadata()
                .ok()
                .and_then(|m| crate::prefetch::resident_ranges(&self.file, 0, m.len()).ok());
            self.source.insert_at_start(len)?;
            *recache.lock_anyway() = cached.map(|ranges| (len, ranges));
            Ok(())
        };
        let collapse = |len| self.source.collapse_at_start(len);
        let retire = |ranges| self.source.retire(ranges);
        let steps = in_place::Steps {
            open_staged: &open_staged,
            insert: &insert,
            collapse: &collapse,
            dir,
            retire: &retire,
            fresh: true,
        };
        let result = self.record.apply(&*self.file, &self.header, &steps);
        if let Ok(shared) = &result {
            self.shared
                .store(*shared, std::sync::atomic::Ordering::Relaxed);
        }
        if let (Ok(_), Some((by, ranges))) = (&result, recache.lock_anyway().take()) {
            let moved = ranges
                .into_iter()
                .map(|r| r.start + by..r.end + by)
                .collect();
            // (Until another insertion moves the bytes again.)
            let (source, shift) = (self.source.clone(), self.source.shift());
            let still = move || source.shift() == shift;
            let path = self.source.path().to_path_buf();
            crate::prefetch::bring_back(self.file.clone(), moved, still, path);
        }
        let now = result
            .as_ref()
            .ok()
            .and_then(|_| FileStat::of(&self.file).ok());
        self.source.end_in_place(now.as_ref());
        // A commit longer than the lease-break time let a waiting open in
        // before it ended: that program may have written, so the version
        // later commits check against is one no file has (they refuse, ESTALE,
        // unless forced).
        let landed = match now {
            Some(st) if !lease.as_ref().is_some_and(Lease::holds) => {
                warn!(
                    file = %self.source.path().display(),
                    "another program's open got past the commit's lease before it ended: the next \
                     commit is refused unless forced"
                );
                Some(FileStat {
                    mtime: (-1, -1),
                    ..st
                })
            }
            other => other,
        };
        *self.landed.lock_anyway() = landed;
        drop(lease); // opens that waited go on, and see the new file
        // (A test pauses here to write as another program would.)
        let _ = crate::testpoint::point("in-place:unleased");
        result.map(|_| ())
    }

    /// What it did, as `stfs commit` says it: the bytes it shared counted
    /// as they were, not as planned.
    pub fn describe(&self) -> String {
        let shared = self.shared.load(std::sync::atomic::Ordering::Relaxed);
        super::ways::in_place_words(&self.summary, self.bytes, shared)
    }

    pub(super) fn error(&self, e: in_place::ApplyError) -> CommitError {
        let file = self.source.path().to_path_buf();
        match e.error.raw_os_error() {
            Some(libc::EAGAIN) if !e.marked => CommitError::Opened { file },
            _ => CommitError::Io {
                what: format!("{}: writing in place", file.display()),
                source: e.error,
            },
        }
    }
}

/// Forgets the record of a commit that will not land; whether it is gone
/// for good (its removal synced: one that a crash could bring back would
/// replay removals of files the commit never replaced).
fn record_gone(dir: &StagingDir) -> bool {
    Renames::clear(dir);
    let name = std::ffi::OsStr::new(crate::checkpoint::staging::RENAMES);
    dir.folder().is_ok_and(|f| {
        matches!(f.stat_at(name), Err(e) if e.raw_os_error() == Some(libc::ENOENT))
            && f.sync().is_ok()
    })
}

/// Why `land` stopped: after `done` files landed; `changed`: whether
/// anything changed on disk (if not, the commit is simply abandoned).
pub struct LandError {
    pub done: usize,
    pub changed: bool,
    /// The file that failed is left refused by every reader.
    pub refused: bool,
    pub error: CommitError,
}

/// Puts the files in place (each journal already says which file is
/// landing): the landings are recorded in the staging folder (the redo
/// record of the in-place ones, the renames), done in order, then forgotten.
/// Once a file changed there is no going back: a crash is finished by the
/// next mount (`staging::Renames`).
/// `Ok(Some(error))`: every file landed, but the folders' sync after it
/// failed (`CommitError::NotDurable`; the record stays).
pub fn land(
    commit: u64,
    landings: &[Box<dyn Landing>],
    staging: &Staging,
) -> Result<Option<CommitError>, LandError> {
    // Failing before anything changed: what was written goes (the caller
    // takes it that `land` removed it: temp files, uploads).
    let before = |error| {
        landings.iter().for_each(|l| l.remove());
        LandError {
            done: 0,
            changed: false,
            refused: false,
            error,
        }
    };
    let dir = staging.dir().map_err(|e| before(CommitError::Staging(e)))?;
    let mut renames = Renames {
        commit,
        files: Vec::new(),
        in_place: Vec::new(),
        remote: Vec::new(),
        removes: Vec::new(),
    };
    for l in landings {
        l.record(&mut renames, &dir).map_err(before)?;
    }
    // The new files' names must be on disk before the record that names
    // them: a record whose temp file is missing reads as renamed already
    // (the crash explorer found an index update lost so).
    let mut synced: Vec<&std::path::Path> = Vec::new();
    for folder in landings.iter().filter_map(|l| l.folder()) {
        if !synced.contains(&folder.path.as_path()) {
            folder
                .sync()
                .map_err(io_err(folder.path.display().to_string()))
                .map_err(before)?;
            synced.push(&folder.path);
        }
    }
    let record_err = io_err(format!(
        "{}/{}",
        dir.path().display(),
        crate::checkpoint::staging::RENAMES
    ));
    if let Err(e) = renames.write(&dir) {
        // The record may be in place all the same (renamed, the sync of its
        // folder failing): the next mount would finish it, so what it names
        // goes only once it is gone (the fault runner found a folder's
        // commit half landed so: an in-place shard completed, the other
        // shard's temp file removed).
        if record_gone(&dir) {
            return Err(before(record_err(e)));
        }
        return Err(LandError {
            done: 0,
            changed: true,
            refused: false,
            error: record_err(e),
        });
    }
    if let Err(e) = crate::testpoint::point("land:recorded") {
        Renames::clear(&dir);
        return Err(before(io_err("recording the commit")(e)));
    }
    if !renames.in_place.is_empty() {
        if let Err(e) = crate::testpoint::point("in-place:recorded") {
            Renames::clear(&dir);
            return Err(before(io_err("recording the commit")(e)));
        }
    }
    for (k, l) in landings.iter().enumerate() {
        let Err(Unlanded {
            changed,
            refused,
            error,
        }) = l.land(&dir)
        else {
            continue;
        };
        let changed = k > 0 || changed;
        if !changed {
            Renames::clear(&dir);
            landings.iter().for_each(|l| l.remove());
        }
        return Err(LandError {
            done: k,
            changed,
            refused,
            error,
        });
    }
    for folder in landings.iter().filter_map(|l| l.folder()) {
        if let Err(source) = folder.sync() {
            warn!(
                "fsync of {} after the commit: {source}",
                folder.path.display()
            );
            return Ok(Some(CommitError::NotDurable {
                folder: folder.path.clone(),
                source,
            }));
        }
    }
    let _ = crate::testpoint::point("in-place:landed");
    Renames::clear(&dir);
    Ok(None)
}
