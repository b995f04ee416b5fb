//! `stfs mount`: check the mount point, validate the source, take back the
//! edits an earlier mount kept, daemonize with a readiness pipe, serve the
//! FUSE session, and unmount cleanly on signals.

mod fusermount;
pub mod logging;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fuser::{Config, MountOption, SessionACL};
use tracing::{error, info, warn};

use crate::checkpoint::commit::remote::RemoteIndex;
use crate::checkpoint::recover::{self, Resume};
use crate::checkpoint::staging::Staging;
use crate::format::{Header, index};
use crate::fs::fuse::FuseAdapter;
use crate::fs::{CacheMode, Fs, IndexFile, Settings, Source};
use crate::inspect::list_dir;
use crate::source::Folder;
use crate::source::remote::{CHUNK, OpenError, Remote, RemoteOptions, is_url};
use crate::source::{FileStat, SourceError, SourceFile};

pub use fusermount::unmount as fusermount_unmount;

/// Everything `stfs mount` was asked for.
#[derive(Debug, Clone)]
pub struct MountRequest {
    pub source: PathBuf,
    pub mountpoint: PathBuf,
    pub foreground: bool,
    pub options: Vec<String>,
    pub threads: Option<usize>,
    pub log_file: Option<PathBuf>,
    pub pid_file: Option<PathBuf>,
    pub staging_dir: Option<PathBuf>,
    pub resume: Resume,
    /// How a remote source is reached and cached.
    pub remote: RemoteOptions,
}

/// Parsed `-o` options.
#[derive(Debug, Clone)]
struct MountOptions {
    read_only: bool,
    acl: SessionACL,
    nonempty: bool,
    cache: CacheMode,
    release_after_read: bool,
    kernel: Vec<MountOption>,
}

const KNOWN: &str = "ro, rw, allow_other, allow_root, nonempty, cache=keep|direct, \
                     mapping=keep|release, default_permissions (always on), nodev, nosuid, \
                     noexec, noatime";

/// Checks one `-o` argument (clap's value parser: a bad option is refused
/// with the command line's usage).
pub fn check_options(arg: &str) -> Result<String, String> {
    parse_options(&[arg.to_string()]).map(|_| arg.to_string())
}

fn parse_options(list: &[String]) -> Result<MountOptions, String> {
    let mut o = MountOptions {
        read_only: false,
        acl: SessionACL::Owner,
        nonempty: false,
        cache: CacheMode::Direct,
        release_after_read: false,
        kernel: Vec::new(),
    };
    for opt in list
        .iter()
        .flat_map(|s| s.split(','))
        .filter(|s| !s.is_empty())
    {
        match opt {
            "ro" => o.read_only = true,
            "rw" => o.read_only = false,
            "allow_other" => o.acl = SessionACL::All,
            "allow_root" => o.acl = SessionACL::RootAndOwner,
            "nonempty" => o.nonempty = true,
            "cache=keep" => o.cache = CacheMode::Keep,
            "cache=direct" => o.cache = CacheMode::Direct,
            "mapping=keep" => o.release_after_read = false,
            "mapping=release" => o.release_after_read = true,
            "default_permissions" => {}
            "nodev" | "nosuid" => {}
            "noexec" => o.kernel.push(MountOption::NoExec),
            "noatime" => o.kernel.push(MountOption::NoAtime),
            other => return Err(format!("unknown mount option {other:?} (known: {KNOWN})")),
        }
    }
    Ok(o)
}

/// Opens and validates what is to be mounted. Index problems are warnings:
/// the shards themselves are valid, and the index is shown as it is.
/// `writable`: files are opened for writing too where allowed (for in-place
/// commits).
pub fn open_source(path: &Path, writable: bool) -> Result<(Source, Vec<String>), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_dir() {
        let file = SourceFile::open_with(path, writable).map_err(|e| e.to_string())?;
        return Ok((Source::File(file), Vec::new()));
    }
    let mut listing = list_dir(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // A folder mount shows one format: its safetensors shards, or else the
    // parts of a split GGUF file (`-00001-of-00003.gguf`), read-only.
    let mut notes = Vec::new();
    if listing.checkpoints.is_empty() {
        listing.checkpoints = std::mem::take(&mut listing.ggufs);
        listing.indexes.clear();
    } else if !listing.ggufs.is_empty() {
        notes.push(format!(
            "{}: {} *.gguf files not shown (a folder mount shows its *.safetensors files, or \
             else its *.gguf files)",
            path.display(),
            listing.ggufs.len()
        ));
    }
    if listing.checkpoints.is_empty() {
        return Err(format!(
            "{}: no *.safetensors or *.gguf files in this folder",
            path.display()
        ));
    }
    let folder = Arc::new(Folder::open(path).map_err(|e| format!("{}: {e}", path.display()))?);
    let stat = FileStat::of(&File::open(path).map_err(|e| format!("{}: {e}", path.display()))?)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut shards = Vec::new();
    for (name, file) in &listing.checkpoints {
        shards.push((
            name.clone(),
            SourceFile::open_with(file, writable).map_err(|e| e.to_string())?,
        ));
    }
    let mut indexes = Vec::new();
    for ix in &listing.indexes {
        let f = File::open(ix).map_err(|e| format!("{}: {e}", ix.display()))?;
        let mut bytes = Vec::new();
        (&f).read_to_end(&mut bytes)
            .map_err(|e| format!("{}: {e}", ix.display()))?;
        let name = ix
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let stat = FileStat::of(&f).map_err(|e| format!("{}: {e}", ix.display()))?;
        let index = IndexFile {
            name,
            bytes,
            stat,
            remote: None,
        };
        indexes.push((ix.display().to_string(), index));
    }
    one_format(&shards)?;
    let (source, warnings) = shard_folder(folder, stat, shards, indexes);
    Ok((source, warnings.into_iter().chain(notes).collect()))
}

/// Refuses shards of two formats (a `.safetensors` file that holds GGUF, or
/// the reverse): a folder mount shows one format.
fn one_format(shards: &[(String, SourceFile)]) -> Result<(), String> {
    let Some((first, s)) = shards.first() else {
        return Ok(());
    };
    let gguf = s.header().is_gguf();
    match shards.iter().find(|(_, s)| s.header().is_gguf() != gguf) {
        Some((other, _)) => Err(format!(
            "{}: {} is {} but {} is {}: a folder mount shows one format",
            s.path().parent().unwrap_or(s.path()).display(),
            other,
            if gguf { "safetensors" } else { "GGUF" },
            first,
            if gguf { "GGUF" } else { "safetensors" },
        )),
        None => Ok(()),
    }
}

/// A folder mount of `shards` (file name, source) with its indexes (shown
/// name, file), each index checked against the shards.
fn shard_folder(
    folder: Arc<Folder>,
    stat: FileStat,
    shards: Vec<(String, SourceFile)>,
    indexes: Vec<(String, IndexFile)>,
) -> (Source, Vec<String>) {
    let headers: BTreeMap<String, &Header> = shards
        .iter()
        .map(|(name, c)| (name.clone(), c.header()))
        .collect();
    let mut warnings = Vec::new();
    for (shown, ix) in &indexes {
        let problems = match index::parse_index(&ix.bytes) {
            Ok(parsed) => index::check_index(&parsed, &headers),
            Err(e) => vec![e.to_string()],
        };
        warnings.extend(problems.into_iter().map(|p| format!("{shown}: {p}")));
    }
    let checkpoints = shards
        .into_iter()
        .map(|(name, c)| {
            let stem = name
                .strip_suffix(".safetensors")
                .or_else(|| name.strip_suffix(".gguf"))
                .unwrap_or(&name)
                .to_string();
            (stem, c)
        })
        .collect();
    (
        Source::Folder {
            folder,
            stat,
            checkpoints,
            indexes: indexes.into_iter().map(|(_, ix)| ix).collect(),
        },
        warnings,
    )
}

/// Why a remote source is mounted read-only (None: it can be committed to).
fn remote_read_only(url: &str) -> Option<&'static str> {
    if !(url.starts_with("s3://") || url.starts_with("s3a://")) {
        return Some(
            "stfs commits to S3 and S3-compatible stores only: HTTP, GCS and Azure have no ranged \
             server-side copy",
        );
    }
    None
}

/// The name under which a remote object's edits are staged: a digest of
/// its URL (the same at every mount of it).
fn remote_stem(url: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, url.as_bytes());
    let hex: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("remote-{hex}")
}

/// A remote source as opened: what it is, the notes for the user, the
/// cache folder, and the store.
struct OpenedRemote {
    source: Source,
    notes: Vec<String>,
    cache: Arc<Folder>,
    store: Arc<Remote>,
}

/// Connects to a remote source and validates it as `open_source` does a
/// local one: an object, or a folder (a URL ending in `/`) of shards with
/// their indexes. `stem` (a writable mount): the name its edits are staged
/// under; the commits a crash interrupted are finished or aborted first.
fn open_remote(
    url: &str,
    opts: &RemoteOptions,
    stem: Option<&str>,
) -> Result<OpenedRemote, String> {
    let at = Remote::connect(url, opts).map_err(|e| e.to_string())?;
    let mut notes = Vec::new();
    if let (Some(stem), Some(writer)) = (stem, at.remote.writer()) {
        use crate::checkpoint::commit::remote::{abort_interrupted, finish_interrupted};
        let base = Arc::new(at.remote.edits_folder().map_err(|e| e.to_string())?);
        let (finished, done) = finish_interrupted(&base, stem, writer, &at.remote)?;
        notes.extend(finished);
        notes.extend(abort_interrupted(&base, stem, writer, &at.remote, &done));
    }
    // Read-ahead of all GET slots at once must fit, with the chunks being read.
    let room = 2 * opts.concurrency as u64 * CHUNK;
    if opts.cache_size < room {
        notes.push(format!(
            "--cache-size {} is below {} MiB (2 x --concurrency x 8 MiB chunks): chunks fetched ahead \
             may be evicted before they are read, and fetched twice",
            opts.cache_size,
            room >> 20
        ));
    }
    let cache = Arc::new(
        at.remote
            .cache_folder()
            .try_clone()
            .map_err(|e| format!("{}: {e}", opts.cache_dir.display()))?,
    );
    let open = |path: &object_store::path::Path| {
        let url = at.remote.url(path);
        match at.remote.open(path) {
            Ok((object, header)) => Ok(SourceFile::remote(object, header)),
            Err(OpenError::Format(error)) => Err(SourceError::Format {
                path: PathBuf::from(url),
                error,
            }
            .to_string()),
            Err(OpenError::Fetch(e)) if !at.folder && e.ends_with(": not found") => {
                Err(format!("{e} (for a folder of shards, end the URL with /)"))
            }
            Err(OpenError::Fetch(e)) => Err(e),
        }
    };
    if !at.folder {
        return Ok(OpenedRemote {
            source: Source::File(open(&at.path)?),
            notes,
            cache,
            store: at.remote,
        });
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        return Err(format!(
            "{url}: an HTTP server cannot be asked what a folder holds: mount a shard by its URL \
             (folders of shards work with s3://, gs:// and az://)"
        ));
    }
    let listed = at.remote.list(&at.path).map_err(|e| e.to_string())?;
    // One format per folder mount: its safetensors shards, or else the parts
    // of a split GGUF file.
    let suffix = match listed
        .iter()
        .any(|(name, _)| name.ends_with(".safetensors"))
    {
        true => ".safetensors",
        false => ".gguf",
    };
    let mut shards = Vec::new();
    let mut indexes = Vec::new();
    for (name, path) in listed {
        if name.ends_with(suffix) {
            shards.push((name, open(&path)?));
        } else if name.ends_with(".index.json") && suffix == ".safetensors" {
            let (bytes, etag) = at.remote.get_all(&path).map_err(|e| e.to_string())?;
            let stat = FileStat {
                len: bytes.len() as u64,
                ..FileStat::of_mounting_user(0o100444)
            };
            let remote = Some(RemoteIndex {
                remote: at.remote.clone(),
                path: path.clone(),
                etag: Arc::new(std::sync::Mutex::new(etag)),
            });
            let index = IndexFile {
                name,
                bytes,
                stat,
                remote,
            };
            indexes.push((at.remote.url(&path), index));
        }
    }
    if shards.is_empty() {
        return Err(format!(
            "{url}: no *.safetensors or *.gguf objects under this prefix"
        ));
    }
    let newest = shards
        .iter()
        .map(|(_, s)| s.stat().mtime)
        .max()
        .unwrap_or((0, 0));
    let stat = FileStat {
        mtime: newest,
        ..FileStat::of_mounting_user(if stem.is_some() { 0o040755 } else { 0o040555 })
    };
    for (_, ix) in &mut indexes {
        ix.stat.mtime = newest;
    }
    one_format(&shards)?;
    // The cache folder stands in for the folder: nothing is written there
    // through it (a commit puts shards and indexes in the store), and
    // statfs shows the disk the cache is on.
    let (source, warnings) = shard_folder(cache.clone(), stat, shards, indexes);
    Ok(OpenedRemote {
        source,
        notes: warnings.into_iter().chain(notes).collect(),
        cache,
        store: at.remote,
    })
}

/// What is at the mount point, as far as mounting there goes.
fn check_mountpoint(mountpoint: &Path, nonempty: bool) -> Result<(), String> {
    let shown = mountpoint.display();
    if let Some(m) = crate::mountinfo::mount_at(mountpoint) {
        return Err(if m.fstype == "fuse.stfs" && dead(mountpoint) {
            format!(
                "{shown} is a stfs mount whose daemon is gone: run `stfs umount {shown}` first \
                 (its staged edits, if any, are kept and taken back by the next mount)"
            )
        } else {
            format!(
                "{shown} is already a mount point ({} of {}): unmount it first; stfs does not stack mounts",
                m.fstype, m.source
            )
        });
    }
    match std::fs::read_dir(mountpoint) {
        Ok(mut entries) => {
            if entries.next().is_some() && !nonempty {
                return Err(format!(
                    "{shown} is not empty: mounting there would hide what it holds \
                     (use an empty folder, or -o nonempty to mount anyway)"
                ));
            }
            Ok(())
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Err(format!(
            "{shown}: no such folder to mount on (create it first: mkdir -p {shown})"
        )),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            Err(format!("{shown}: not a folder: a mount point must be one"))
        }
        Err(e) => Err(format!("{shown}: {e}")),
    }
}

/// A FUSE mount whose daemon is gone answers ENOTCONN (statfs: never
/// answered from the kernel's caches), or ECONNABORTED when the request was
/// sent while the daemon's last thread was still exiting.
pub fn dead(mountpoint: &Path) -> bool {
    use rustix::io::Errno;
    matches!(
        rustix::fs::statfs(mountpoint),
        Err(Errno::NOTCONN | Errno::CONNABORTED)
    )
}

/// Where staging folders go, and their stem: beside the source (inside a
/// folder mount's folder), or in --staging-dir.
/// Where the staging folder goes when the source's folder cannot hold a
/// private one (not writable, or another filesystem that shows every
/// folder as open to others): the user's own state folder,
/// `~/.local/state/stfs/staging/<a hash of the source's path>` (the same
/// for every mount of that source, so that kept edits are found again),
/// and the note that says so. Nothing is left beside the source.
fn private_staging_if_needed(
    source: &Path,
    base: Arc<Folder>,
    stem: &str,
) -> Result<(Arc<Folder>, Option<String>), String> {
    let Some(why) = crate::source::StagingDir::cannot_be_made_in(&base, stem) else {
        return Ok((base, None));
    };
    let real = std::fs::canonicalize(source).map_err(|e| format!("{}: {e}", source.display()))?;
    let hash = crate::checkpoint::in_place::sha256_hex(&[real.as_os_str().as_encoded_bytes()]);
    let folder = crate::checkpoint::commit::private_state_folder(&["staging", &hash[..16]])
        .map_err(|e| {
            format!(
                "{}: edits cannot be staged beside the source ({why}), nor in your state folder \
                 ({e}): mount with --staging-dir DIR (or -o ro)",
                source.display()
            )
        })?;
    let note = format!(
        "{}: edits are staged in {} ({}: {why})",
        source.display(),
        folder.path.display(),
        base.path.display()
    );
    Ok((Arc::new(folder), Some(note)))
}

fn staging_for(source: &Path, dir: Option<&Path>) -> Result<(Arc<Folder>, String), String> {
    let real = std::fs::canonicalize(source).map_err(|e| format!("{}: {e}", source.display()))?;
    let is_dir = real.is_dir();
    let sources = if is_dir {
        real.clone()
    } else {
        real.parent().unwrap_or(Path::new("/")).to_path_buf()
    };
    let stem = real
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let base = match dir {
        Some(d) => {
            let d = std::path::absolute(d).map_err(|e| format!("{}: {e}", d.display()))?;
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&d)
                .map_err(|e| format!("{}: {e}", d.display()))?;
            d
        }
        None => sources.clone(),
    };
    let base = Folder::open(&base)
        .map(Arc::new)
        .map_err(|e| format!("{}: {e}", base.display()))?;
    Ok((base, stem))
}

pub fn mount(mut req: MountRequest) -> Result<(), String> {
    let mut options = parse_options(&req.options)?;
    req.mountpoint = std::path::absolute(&req.mountpoint).map_err(|e| e.to_string())?;
    if let Some(url) = req
        .source
        .to_str()
        .filter(|s| is_url(s))
        .map(str::to_string)
    {
        check_mountpoint(&req.mountpoint, options.nonempty)?;
        let mut notes = Vec::new();
        if !options.read_only {
            if let Some(why) = remote_read_only(&url) {
                notes.push(format!("{url}: mounted read-only ({why})"));
                options.read_only = true;
            }
        }
        let remote = req.remote.clone();
        let settings = settings(&options);
        let resume = req.resume.clone();
        // A read may wait on the network for up to --timeout: enough request
        // threads that waiting reads do not hold up listings and cached reads.
        req.threads = req.threads.or(Some(16));
        // The network runtime's threads would not survive the fork: the
        // daemon connects, and says through the readiness pipe what it found.
        return launch(&req, options, move || {
            let read_only = settings.read_only;
            // Edits are staged (and journaled, and taken back by the next
            // mount) in the cache's private `edits` folder, under a name
            // of the URL's.
            let stem = remote_stem(&url);
            let OpenedRemote {
                source,
                notes: warnings,
                cache,
                store,
            } = open_remote(&url, &remote, (!read_only).then_some(stem.as_str()))?;
            let mut notes: Vec<String> = warnings.into_iter().chain(notes).collect();
            // (Known only now for an object not named .gguf, or a prefix of parts.)
            let gguf = source.files().iter().any(|s| s.header().is_gguf());
            if gguf && !read_only {
                notes.push(gguf_read_only(&url));
            }
            let notes = notes.into_iter();
            if read_only || gguf {
                // Never made: a read-only mount stages nothing.
                let staging = Arc::new(Staging::new(cache, "remote".to_string()));
                let fs = Fs::new(source, settings, staging);
                return Ok((fs, notes.collect()));
            }
            let base = Arc::new(store.edits_folder().map_err(|e| e.to_string())?);
            let staging = Arc::new(Staging::new(base, stem));
            let fs = Fs::new(source, settings, staging.clone());
            let resumed = fs
                .with_lives(|lives| recover::resume(lives, &staging, &resume))
                .map_err(|e| e.to_string())?;
            Ok((fs, notes.chain(resumed).collect()))
        });
    }
    req.source = std::path::absolute(&req.source).map_err(|e| e.to_string())?;
    check_mountpoint(&req.mountpoint, options.nonempty)?;
    // (Cleared before the fork: its ticking thread is joined.)
    let spinner = crate::progress::spinner(&format!(
        "opening {} (and what earlier mounts left of it)",
        req.source.display()
    ));
    let opened = open_local(
        &req.source,
        req.staging_dir.as_deref(),
        settings(&options),
        &req.resume,
    );
    crate::progress::clear(spinner);
    let (fs, report) = opened?;
    launch(&req, options, move || Ok((fs, report)))
}

/// What a mount of a remote GGUF object says: it is served read-only
/// (`Fs::new` makes it so), as commits to S3 write safetensors.
fn gguf_read_only(source: &dyn std::fmt::Display) -> String {
    format!("{source}: mounted read-only (GGUF objects cannot be committed to S3 yet)")
}

/// Opens a local source as a mount does, after what earlier mounts left:
/// the commits a crash interrupted are finished, the temp files of dead
/// daemons removed, the kept edits taken back (`resume`). Returns the
/// filesystem and the notes for the user.
pub fn open_local(
    source: &Path,
    staging_dir: Option<&Path>,
    settings: Settings,
    resume: &Resume,
) -> Result<(Fs, Vec<String>), String> {
    // Commits that a crash interrupted between two renames are finished
    // before the sources are read.
    let (base, stem) = staging_for(source, staging_dir)?;
    let (base, moved) = match staging_dir.is_none() && !settings.read_only {
        true => private_staging_if_needed(source, base, &stem)?,
        false => (base, None),
    };
    let mut notes = recover::finish_renames(&base, &stem).map_err(|e| {
        format!(
            "{}: an interrupted commit could not be finished: {e}; its record is kept, and the \
             next mount tries again",
            source.display()
        )
    })?;
    notes.extend(moved);
    // Two mounts of one source are allowed; their commits are taken one at
    // a time, and the second is refused if the first changed the file.
    for m in crate::mountinfo::mounts() {
        if !settings.read_only && m.fstype == "fuse.stfs" && Path::new(&m.source) == source {
            notes.push(format!(
                "{} is also mounted at {}: commits of both are taken one at a time, and the \
                 later one is refused (ESTALE) if the other changed the file meanwhile",
                source.display(),
                m.point.display()
            ));
        }
    }
    // (A source still refused after recovery: the notes say why it was not completed.)
    let path = source;
    let (source, warnings) = open_source(path, !settings.read_only).map_err(|e| {
        if notes.is_empty() || !e.contains("was interrupted") {
            return e;
        }
        format!(
            "{}\n{}: every reader refuses it until that commit is completed, which stfs did not \
             do, for the reason above",
            notes.join("\n"),
            path.display()
        )
    })?;
    // Each shard's temp files are beside its own file (a link's target).
    for s in source.files() {
        if let Some(folder) = s.folder() {
            notes.extend(recover::remove_dead_temps(folder, &[s.file_name()]));
        }
    }
    // And the index files' (the crash explorer found them left behind).
    if let Source::Folder {
        folder, indexes, ..
    } = &source
    {
        let names: Vec<&std::ffi::OsStr> = indexes.iter().map(|i| i.name.as_ref()).collect();
        notes.extend(recover::remove_dead_temps(folder, &names));
    }
    // Said now rather than at the first edit, which could not be journaled.
    if !settings.read_only && !base.writable() {
        notes.push(format!(
            "{}: not writable by you: edits cannot be journaled there, nor committed; mount \
             with --staging-dir DIR (or -o ro)",
            base.path.display()
        ));
    }
    let staging = Arc::new(Staging::new(base, stem));
    let fs = Fs::new(source, settings, staging.clone());
    notes.extend(
        fs.with_lives(|lives| recover::resume(lives, &staging, resume))
            .map_err(|e| e.to_string())?,
    );
    Ok((fs, warnings.into_iter().chain(notes).collect()))
}

fn settings(options: &MountOptions) -> Settings {
    Settings {
        read_only: options.read_only,
        owner: rustix::process::getuid().as_raw(),
        cache: options.cache,
        release_after_read: options.release_after_read,
    }
}

/// What the daemon serves, and what to tell the user (warnings, notes).
type Prepared = Result<(Fs, Vec<String>), String>;

/// Serves in the foreground, or daemonizes.
fn launch(
    req: &MountRequest,
    options: MountOptions,
    prepare: impl FnOnce() -> Prepared,
) -> Result<(), String> {
    if req.foreground {
        // Before any thread starts (the network runtime's, the log's): only
        // the signal thread of `serve` may take SIGINT, SIGTERM and SIGHUP.
        blocked_signals();
        logging::init(req.log_file.as_deref(), true)?;
        let (fs, report) = prepare()?;
        for w in &report {
            eprintln!("stfs: {w}");
        }
        return serve(fs, req, options, &report, None);
    }
    daemonize(req, options, prepare)
}

/// Forks; the child prepares what it serves (`prepare`), then serves the
/// mount and reports through a pipe once the mount answers (or why it
/// failed); the parent returns only then, and prints the child's notes. Must
/// be called before any thread is started.
fn daemonize(
    req: &MountRequest,
    options: MountOptions,
    prepare: impl FnOnce() -> Prepared,
) -> Result<(), String> {
    let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: stfs has started no threads yet, so the child may run Rust code freely.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            drop(read_end);
            let _ = rustix::process::setsid();
            detach_stdio();
            let mut ready = Some(write_end);
            // As in `launch`: before any thread starts.
            blocked_signals();
            let prepared = logging::init(req.log_file.as_deref(), false).and_then(|note| {
                let (fs, mut report) = prepare()?;
                report.extend(note);
                Ok((fs, report))
            });
            let code = match prepared {
                Err(e) => {
                    error!("{e}");
                    say(&mut ready, &e);
                    1
                }
                Ok((fs, report)) => match serve(fs, req, options, &report, ready) {
                    Ok(()) => 0,
                    Err(e) => {
                        error!("{e}");
                        1
                    }
                },
            };
            std::process::exit(code);
        }
        _child => {
            drop(write_end);
            // The parent only waits and exits: skip freeing a large state.
            std::mem::forget(prepare);
            let spinner = crate::progress::spinner(&format!(
                "mounting {} (waiting for the mount to answer)",
                req.source.display()
            ));
            let mut answer = String::new();
            let read = File::from(read_end).read_to_string(&mut answer);
            crate::progress::clear(spinner);
            read.map_err(|e| format!("waiting for the daemon: {e}"))?;
            match answer.strip_prefix("ok\n") {
                Some(notes) => {
                    for line in notes.lines() {
                        eprintln!("stfs: {line}");
                    }
                    Ok(())
                }
                None if answer.is_empty() => {
                    Err("the daemon exited before the mount was ready (see its log)".into())
                }
                None => Err(answer.trim_end().to_string()),
            }
        }
    }
}

fn detach_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let _ = rustix::stdio::dup2_stdin(&null);
        let _ = rustix::stdio::dup2_stdout(&null);
        let _ = rustix::stdio::dup2_stderr(&null);
    }
}

fn say(ready: &mut Option<OwnedFd>, message: &str) {
    if let Some(fd) = ready.take() {
        let _ = File::from(fd).write_all(message.as_bytes());
    }
}

/// Raises the soft limit of open files to the hard one: staging files are
/// opened on use, but a busy mount still holds many.
fn raise_open_files() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    if let (Some(old), Some(max)) = (current, maximum) {
        let raised = Rlimit {
            current: maximum,
            maximum,
        };
        if old < max && setrlimit(Resource::Nofile, raised).is_ok() {
            info!("open file limit raised from {old} to {max}");
        }
    }
}

/// Mounts and serves until unmounted (by `umount`, `stfs umount`, or a signal).
fn serve(
    fs: Fs,
    req: &MountRequest,
    options: MountOptions,
    report: &[String],
    mut ready: Option<OwnedFd>,
) -> Result<(), String> {
    // The filesystem may be read-only where the options did not say so (a
    // GGUF source found to be one only once opened): the kernel mount too.
    let mut options = options;
    options.read_only |= fs.settings().read_only;
    for w in report {
        warn!("{w}");
    }
    // The pid file before the mount: refused (the mount with it) if it is
    // not a regular file of this user's; written once the mount answers.
    let pid_file = match &req.pid_file {
        Some(path) => match logging::open_private(path, false, true) {
            Ok(f) => Some((path.clone(), f)),
            Err(e) => {
                let msg = format!("--pid-file {e}");
                say(&mut ready, &msg);
                return Err(msg);
            }
        },
        None => None,
    };
    raise_open_files();
    let threads = req
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)));
    let mut mount_options = vec![
        MountOption::FSName(req.source.display().to_string()),
        MountOption::Subtype("stfs".into()),
        // The kernel enforces the modes and owners shown (the source's).
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
    ];
    if options.read_only {
        mount_options.push(MountOption::RO);
    }
    mount_options.extend(options.kernel.iter().cloned());
    let mut config = Config::default();
    config.mount_options = mount_options;
    config.acl = options.acl;
    config.n_threads = Some(threads.max(1));

    // Signals are taken by one thread (below); every other thread has them
    // blocked (they were blocked before any was started).
    let signals = blocked_signals();
    let mut fs = fs;
    let as_root = rustix::process::geteuid().as_raw() == 0;
    let fd = if as_root {
        mount_direct(&req.mountpoint, &req.source, &options)
    } else {
        fusermount::mount(&req.mountpoint, &fusermount_options(&req.source, &options))
    };
    // A second descriptor of the connection, for the notifications that
    // take back what the kernel caches.
    if let Some(channel) = fd.as_ref().ok().and_then(|fd| fd.try_clone().ok()) {
        fs.set_kernel_cache(crate::fs::kernel_cache::KernelCache::new(channel));
    }
    let fs = Arc::new(fs);
    let adapter = FuseAdapter::new(fs.clone());
    let session =
        fd.and_then(|fd| fuser::Session::from_fd(adapter, fd, options.acl, config.clone()));
    let session = match session {
        Ok(s) => s,
        Err(e) => {
            let msg = format!(
                "cannot mount {} on {}: {e}",
                req.source.display(),
                req.mountpoint.display()
            );
            say(&mut ready, &msg);
            return Err(msg);
        }
    };
    raise_read_ahead(&req.mountpoint);
    // The pid, and what the pid file is, so that only that file is removed at exit.
    let pid_file = pid_file.and_then(|(path, mut f)| {
        if let Err(e) = writeln!(f, "{}", std::process::id()) {
            warn!("pid file {}: {e}", path.display());
        }
        FileStat::of(&f).ok().map(|st| (path, st))
    });
    info!(
        source = %req.source.display(),
        mountpoint = %req.mountpoint.display(),
        threads,
        read_only = options.read_only,
        cache = ?options.cache,
        "mounted"
    );
    let mut answer = String::from("ok\n");
    for line in report {
        answer.push_str(&format!("{}\n", line.replace('\n', " ")));
    }
    say(&mut ready, &answer);

    let mountpoint = req.mountpoint.clone();
    std::thread::Builder::new()
        .name("stfs-signals".into())
        .spawn(move || {
            let mut sig = 0;
            // SAFETY: signals is a valid, initialized set; sig an out-parameter.
            if unsafe { libc::sigwait(&signals, &mut sig) } == 0 {
                info!(
                    signal = sig,
                    "unmounting {} on signal",
                    mountpoint.display()
                );
                let result = if as_root {
                    detach(&mountpoint)
                } else {
                    fusermount::unmount(&mountpoint, true)
                };
                if let Err(e) = result {
                    error!("unmount of {} failed: {e}", mountpoint.display());
                }
            }
        })
        .map_err(|e| e.to_string())?;

    let result = session.run();
    if let Some((path, written)) = pid_file {
        remove_if_same(&path, &written);
    }
    info!(mountpoint = %req.mountpoint.display(), "unmounted");
    result.map_err(|e| {
        format!(
            "FUSE session on {} ended with an error: {e}",
            req.mountpoint.display()
        )
    })
}

/// Mounts as root: the filesystem type is `fuse.stfs`, so that the mount
/// table says what it is, and `default_permissions` is always on.
fn mount_direct(
    mountpoint: &Path,
    source: &Path,
    options: &MountOptions,
) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;

    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?;
    let (uid, gid) = (
        rustix::process::getuid().as_raw(),
        rustix::process::getgid().as_raw(),
    );
    let mut data = format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},default_permissions",
        dev.as_raw_fd()
    );
    if options.acl != SessionACL::Owner {
        data.push_str(",allow_other");
    }
    use rustix::mount::MountFlags;
    let mut flags = MountFlags::NOSUID | MountFlags::NODEV;
    if options.read_only {
        flags |= MountFlags::RDONLY;
    }
    for k in &options.kernel {
        match k {
            MountOption::NoExec => flags |= MountFlags::NOEXEC,
            MountOption::NoAtime => flags |= MountFlags::NOATIME,
            _ => {}
        }
    }
    let data = std::ffi::CString::new(data)
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    rustix::mount::mount(source, mountpoint, "fuse.stfs", flags, data.as_c_str())?;
    Ok(OwnedFd::from(dev))
}

/// Detaches a mount now; the session ends once its files are closed.
fn detach(mountpoint: &Path) -> std::io::Result<()> {
    Ok(rustix::mount::unmount(
        mountpoint,
        rustix::mount::UnmountFlags::DETACH,
    )?)
}

/// Removes `path` if it is still the file `written` describes.
fn remove_if_same(path: &Path, written: &FileStat) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    if let Ok(folder) = Folder::open(dir) {
        if folder
            .stat_at(name)
            .is_ok_and(|st| st.dev == written.dev && st.ino == written.ino)
        {
            folder.unlink_spent(name);
        }
    }
}

/// `-o` for fusermount3: it adds nosuid and nodev itself.
fn fusermount_options(source: &Path, options: &MountOptions) -> String {
    let mut o = vec![
        format!("fsname={}", source.display().to_string().replace(',', "_")),
        "subtype=stfs".into(),
        "default_permissions".into(),
    ];
    o.push(if options.read_only { "ro" } else { "rw" }.into());
    match options.acl {
        SessionACL::All | SessionACL::RootAndOwner => o.push("allow_other".into()),
        SessionACL::Owner => {}
    }
    o.join(",")
}

fn blocked_signals() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a zeroed, then emptied set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// The kernel caps a FUSE mount's read-ahead at 128 KiB; root can raise it
/// through the mount's backing device info, which makes buffered reads
/// arrive as 1 MiB requests (../shared/PERF-NOTES.md). The log says what changed.
fn raise_read_ahead(mountpoint: &Path) {
    // The mount's device number comes from mountinfo: a stat of the mount point
    // would be a FUSE request, and nothing serves requests yet.
    let Some(dev) = crate::mountinfo::mount_at(mountpoint).map(|m| m.device) else {
        info!(
            "read-ahead left at the kernel default: {} not found in mountinfo",
            mountpoint.display()
        );
        return;
    };
    let knob = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    let before = std::fs::read_to_string(&knob).unwrap_or_default();
    match std::fs::write(&knob, "1024") {
        Ok(()) => info!(
            "read-ahead of this mount raised from {} to 1024 KiB ({knob})",
            before.trim()
        ),
        Err(e) => info!("read-ahead left at the kernel default: {knob}: {e}"),
    }
}
