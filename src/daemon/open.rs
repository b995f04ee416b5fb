//! Opening what is mounted: a file, a folder of shards with its index, or
//! a remote object or prefix, each validated as the mount will show it.

use super::*;

/// Opens and validates what is to be mounted. Index problems are warnings:
/// the shards themselves are valid, and the index is shown as it is.
/// `writable`: files are opened for writing too where allowed (for in-place
/// commits).
pub fn open_source(
    path: &Path,
    writable: bool,
) -> Result<(Source, Vec<String>), crate::errno::Failure> {
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
        )
        .into());
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
    let model_files = read_model_files(&listing.others, &mut notes);
    if !listing.left_out.is_empty() {
        let said: Vec<String> = listing
            .left_out
            .iter()
            .map(|(name, why)| format!("{name} ({why})"))
            .collect();
        notes.push(format!(
            "{}: not shown in the mount: {} (a mount shows the safetensors model and the files \
             directly beside it)",
            path.display(),
            said.join(", ")
        ));
    }
    let (source, warnings) = shard_folder(folder, stat, shards, indexes, (model_files, vec![]));
    Ok((source, warnings.into_iter().chain(notes).collect()))
}

/// The other files of a model folder, read whole (each at most
/// `MAX_FILE`, `MAX_TOTAL` in all: what is over is not shown, and said).
fn read_model_files(others: &[(String, PathBuf)], notes: &mut Vec<String>) -> Vec<ModelFile> {
    let mut files = Vec::new();
    let mut total = 0;
    for (name, path) in others {
        match read_model_file(name, path, total) {
            Ok(f) => {
                total += f.bytes.len() as u64;
                files.push(f);
            }
            Err(why) => notes.push(format!("{}: not shown in the mount: {why}", path.display())),
        }
    }
    files
}

fn read_model_file(
    name: &str,
    path: &Path,
    total: u64,
) -> Result<ModelFile, crate::errno::Failure> {
    // (Not blocking on a FIFO put there since the folder was listed.)
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let stat = FileStat::of(&file)?;
    if stat.mode & libc::S_IFMT != libc::S_IFREG {
        return Err("not a regular file".into());
    }
    too_big(stat.len, total)?;
    let mut bytes = Vec::new();
    (&file)
        .take(model_files::MAX_FILE + 1)
        .read_to_end(&mut bytes)?;
    too_big(bytes.len() as u64, total)?;
    Ok(ModelFile {
        name: name.to_string(),
        bytes: Arc::new(bytes),
        stat,
        etag: None,
        headers: Vec::new(),
    })
}

/// Why a model file of `len` bytes is not shown after `total` bytes of others.
fn too_big(len: u64, total: u64) -> Result<(), crate::errno::Failure> {
    if len > model_files::MAX_FILE {
        return Err(format!(
            "{} MiB, over the {} MiB a model folder's other files may each hold",
            len >> 20,
            model_files::MAX_FILE >> 20
        )
        .into());
    }
    if total + len > model_files::MAX_TOTAL {
        return Err(format!(
            "the other files would pass {} MiB in all",
            model_files::MAX_TOTAL >> 20
        )
        .into());
    }
    Ok(())
}

/// Refuses shards of two formats (a `.safetensors` file that holds GGUF, or
/// the reverse): a folder mount shows one format.
pub(super) fn one_format(shards: &[(String, SourceFile)]) -> Result<(), crate::errno::Failure> {
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
        )
        .into()),
        None => Ok(()),
    }
}

/// A folder mount of `shards` (file name, source) with its indexes (shown
/// name, file), each index checked against the shards.
pub(super) fn shard_folder(
    folder: Arc<Folder>,
    stat: FileStat,
    shards: Vec<(String, SourceFile)>,
    indexes: Vec<(String, IndexFile)>,
    (model_files, not_shown): (Vec<ModelFile>, Vec<String>),
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
    let checkpoints: Vec<(String, SourceFile)> = shards
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
            model_files: model_files
                .into_iter()
                .filter(|f| {
                    // (A shard's folder has the shard's name without its suffix.)
                    let taken = checkpoints.iter().any(|(stem, _)| *stem == f.name);
                    if taken {
                        warnings.push(format!(
                            "{}: not shown in the mount: a shard's folder has that name",
                            f.name
                        ));
                    }
                    !taken
                })
                .collect(),
            checkpoints,
            indexes: indexes.into_iter().map(|(_, ix)| ix).collect(),
            not_shown,
        },
        warnings,
    )
}

/// Why a remote source is mounted read-only (None: it can be committed to).
pub(super) fn remote_read_only(url: &str) -> Option<&'static str> {
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
pub(super) fn remote_stem(url: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, url.as_bytes());
    let hex: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("remote-{hex}")
}

/// A remote source as opened: what it is, the notes for the user, the
/// cache folder, and the store.
pub(super) struct OpenedRemote {
    pub(super) source: Source,
    pub(super) notes: Vec<String>,
    pub(super) cache: Arc<Folder>,
    pub(super) store: Arc<Remote>,
}

/// Connects to a remote source and validates it as `open_source` does a
/// local one: an object, or a folder (a URL ending in `/`) of shards with
/// their indexes. `stem` (a writable mount): the name its edits are staged
/// under; the commits a crash interrupted are finished or aborted first.
pub(super) fn open_remote(
    url: &str,
    opts: &RemoteOptions,
    stem: Option<&str>,
) -> Result<OpenedRemote, crate::errno::Failure> {
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
        )
        .into());
    }
    let listed = at.remote.list(&at.path).map_err(|e| e.to_string())?;
    // One format per folder mount: its safetensors shards, or else the parts
    // of a split GGUF file.
    let suffix = match listed
        .iter()
        .any(|(name, ..)| name.ends_with(".safetensors"))
    {
        true => ".safetensors",
        false => ".gguf",
    };
    let mut shards = Vec::new();
    let mut indexes = Vec::new();
    let mut others = Vec::new();
    for (name, path, size) in listed {
        if model_files::is_model_file(&name) {
            others.push((name, path, size));
        } else if name.ends_with(suffix) {
            shards.push((name, open(&path)?));
        } else if name.ends_with(".index.json") && suffix == ".safetensors" {
            let (bytes, etag, headers) = at.remote.get_whole(&path).map_err(|e| e.to_string())?;
            let stat = FileStat {
                len: bytes.len() as u64,
                ..FileStat::of_mounting_user(0o100444)
            };
            let remote = Some(RemoteIndex {
                remote: at.remote.clone(),
                path: path.clone(),
                etag: Arc::new(std::sync::Mutex::new(etag)),
                headers,
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
        return Err(format!("{url}: no *.safetensors or *.gguf objects under this prefix").into());
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
    let mode = if stem.is_some() { 0o100644 } else { 0o100444 };
    let model_files = fetch_model_files(&at.remote, others, (newest, mode), &mut notes)?;
    // The cache folder stands in for the folder: nothing is written there
    // through it (a commit puts shards and indexes in the store), and
    // statfs shows the disk the cache is on.
    let (source, warnings) = shard_folder(cache.clone(), stat, shards, indexes, model_files);
    Ok(OpenedRemote {
        source,
        notes: warnings.into_iter().chain(notes).collect(),
        cache,
        store: at.remote,
    })
}

/// The other objects of a remote model folder, fetched whole, within the
/// limits a local folder's have (what is over is not shown, and said):
/// the files, and the names not shown.
fn fetch_model_files(
    remote: &Remote,
    others: Vec<(String, object_store::path::Path, u64)>,
    (mtime, mode): ((i64, i64), u32),
    notes: &mut Vec<String>,
) -> Result<(Vec<ModelFile>, Vec<String>), crate::errno::Failure> {
    let (mut files, mut not_shown) = (Vec::new(), Vec::new());
    let mut total = 0;
    for (name, path, size) in others {
        if let Err(why) = too_big(size, total) {
            notes.push(format!(
                "{}: not shown in the mount: {why}",
                remote.url(&path)
            ));
            not_shown.push(name);
            continue;
        }
        let (bytes, etag, headers) = remote.get_whole(&path).map_err(|e| e.to_string())?;
        total += bytes.len() as u64;
        let stat = FileStat {
            len: bytes.len() as u64,
            mtime,
            ..FileStat::of_mounting_user(mode)
        };
        files.push(ModelFile {
            name,
            bytes: Arc::new(bytes),
            stat,
            etag,
            headers,
        });
    }
    Ok((files, not_shown))
}

/// What a mount of a remote GGUF object says: it is served read-only
/// (`Fs::new` makes it so), as commits to S3 write safetensors.
pub(super) fn gguf_read_only(source: &dyn std::fmt::Display) -> String {
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
) -> Result<(Fs, Vec<String>), crate::errno::Failure> {
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
        if notes.is_empty() || !e.why.contains("was interrupted") {
            return e;
        }
        format!(
            "{}\n{}: every reader refuses it until that commit is completed, which stfs did not \
             do, for the reason above",
            notes.join("\n"),
            path.display()
        )
        .into()
    })?;
    // Each shard's temp files are beside its own file (a link's target).
    for s in source.files() {
        if let Some(folder) = s.folder() {
            notes.extend(recover::remove_dead_temps(folder, &[s.file_name()]));
        }
    }
    // And those of every other file of a folder mount (its indexes, its
    // model files, new ones among them: the crash explorer found them
    // left behind).
    if let Source::Folder { folder, .. } = &source {
        let targets = recover::temp_targets(folder);
        let names: Vec<&std::ffi::OsStr> = targets.iter().map(|n| n.as_os_str()).collect();
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
    notes.extend(take_back(&fs, &staging, resume)?);
    Ok((fs, warnings.into_iter().chain(notes).collect()))
}

/// What an earlier mount of the source staged, taken back (from the
/// staging folder this mount adopted): the tensors' edits, then the model
/// files'. The same for every kind of source.
pub(super) fn take_back(
    fs: &Fs,
    staging: &Arc<Staging>,
    resume: &Resume,
) -> Result<Vec<String>, crate::errno::Failure> {
    let mut notes = fs
        .with_lives(|lives| recover::resume(lives, staging, resume))
        .map_err(|e| e.to_string())?;
    notes.extend(
        fs.take_back_model_files()
            .map_err(|e| format!("taking back the staged model files of an earlier mount: {e}"))?,
    );
    Ok(notes)
}
