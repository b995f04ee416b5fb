//! `stfs mount`: check the mount point, validate the source, take back the
//! edits an earlier mount kept, daemonize with a readiness pipe, serve the
//! FUSE session, and unmount cleanly on signals.

mod checks;
mod daemonize;
mod fusermount;
pub mod logging;
mod open;
mod options;
mod serve;

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
use crate::fs::{CacheMode, Fs, IndexFile, ModelFile, Settings, Source, model_files};
use crate::inspect::list_dir;
use crate::source::Folder;
use crate::source::remote::{CHUNK, OpenError, Remote, RemoteOptions, is_url};
use crate::source::{FileStat, SourceError, SourceFile};
use std::os::unix::fs::OpenOptionsExt;

pub use checks::*;
use daemonize::*;
pub use fusermount::unmount as fusermount_unmount;
pub use open::*;
pub use options::*;
use serve::*;

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

pub fn mount(mut req: MountRequest) -> Result<(), crate::errno::Failure> {
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
            let resumed = open::take_back(&fs, &staging, &resume)?;
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

/// What the daemon serves, and what to tell the user (warnings, notes).
type Prepared = Result<(Fs, Vec<String>), crate::errno::Failure>;

/// Serves in the foreground, or daemonizes.
fn launch(
    req: &MountRequest,
    options: MountOptions,
    prepare: impl FnOnce() -> Prepared,
) -> Result<(), crate::errno::Failure> {
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
