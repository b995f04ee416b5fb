//! The daemon's log: per user and private by default, opened without
//! following links, never a file another user owns. The daemon often runs as
//! root; a log in a folder others can write (/tmp) is theirs to redirect.

use std::ffi::OsStr;
use std::fs::File;
use std::io::IsTerminal;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tracing::error;

use crate::source::Folder;

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Where the log goes without --log-file: `$XDG_STATE_HOME/stfs/stfs.log`,
/// else `~/.local/state/stfs/stfs.log`.
pub fn default_log_file() -> Result<PathBuf, crate::errno::Failure> {
    let state = match std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
            Some(home) => PathBuf::from(home).join(".local/state"),
            None => {
                return Err("no HOME or XDG_STATE_HOME for the log: give --log-file FILE".into());
            }
        },
    };
    Ok(state.join("stfs").join("stfs.log"))
}

/// Opens a file to append to, creating it 0600: never through a link, never
/// one owned by another user, never anything but a regular file (a FIFO
/// planted there is refused at once: the open does not wait for a reader),
/// and never changed before it passed (`truncate` empties it only then).
/// With `private_folder`, its folder is created 0700 if missing and must not
/// be open to others.
pub fn open_private(
    path: &Path,
    private_folder: bool,
    truncate: bool,
) -> Result<File, crate::errno::Failure> {
    let what = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let (dir, name) = match (path.parent(), path.file_name()) {
        (Some(d), Some(n)) => (
            if d.as_os_str().is_empty() {
                Path::new(".")
            } else {
                d
            },
            n,
        ),
        _ => return Err(what(&"not a file path").into()),
    };
    if private_folder {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| what(&e))?;
        let meta = std::fs::symlink_metadata(dir).map_err(|e| what(&e))?;
        if !meta.is_dir() || meta.uid() != euid() || meta.mode() & 0o022 != 0 {
            return Err(format!(
                "{}: refused for the log: not a folder of uid {} closed to others",
                dir.display(),
                euid()
            )
            .into());
        }
    }
    let folder = Folder::open(dir).map_err(|e| what(&e))?;
    let flags = libc::O_WRONLY
        | libc::O_CREAT
        | libc::O_NONBLOCK
        | if truncate { 0 } else { libc::O_APPEND };
    let file = folder
        .open_file(OsStr::new(name), flags, 0o600)
        .map_err(|e| match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => what(&"a symbolic link: refused"),
            Ok(m) if !m.is_file() => what(&"not a regular file: refused"),
            Ok(m) if m.uid() != euid() => what(&format_args!(
                "owned by uid {}, not by uid {}: refused",
                m.uid(),
                euid()
            )),
            _ => what(&e),
        })?;
    let meta = file.metadata().map_err(|e| what(&e))?;
    if !meta.is_file() || meta.uid() != euid() {
        return Err(what(&format_args!(
            "refused: owned by uid {}, not by uid {}, or not a regular file",
            meta.uid(),
            euid()
        ))
        .into());
    }
    // A hard link planted to another of this user's files would be written through.
    if meta.nlink() != 1 {
        return Err(what(&"refused: it has other hard links").into());
    }
    if truncate {
        file.set_len(0).map_err(|e| what(&e))?;
    }
    // (Writes to a regular file never wait: O_NONBLOCK changes nothing there.)
    Ok(file)
}

/// Where the log goes when the default place cannot be written (no home
/// folder, a read-only one): `$XDG_RUNTIME_DIR/stfs/stfs.log`, then
/// `/var/tmp/stfs-<uid>/stfs.log` (a folder of the user's, closed to others).
fn fallback_log_files() -> Vec<PathBuf> {
    let mut places = Vec::new();
    if let Some(run) = std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        places.push(PathBuf::from(run).join("stfs").join("stfs.log"));
    }
    places.push(PathBuf::from(format!("/var/tmp/stfs-{}", euid())).join("stfs.log"));
    places
}

/// Sets up tracing: to `log_file` if given, else to stderr in the foreground
/// (colour only on a terminal), else to the private default log, else to the
/// first fallback that can be written, else nowhere: logging is never the
/// reason a mount fails. Returns a note for the user when the log is not
/// where it is documented to be.
pub fn init(
    log_file: Option<&Path>,
    foreground: bool,
) -> Result<Option<String>, crate::errno::Failure> {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,fuser=error"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_thread_names(true);
    let (file, note) = match (log_file, foreground) {
        (Some(p), _) => (Some(open_private(p, false, false)?), None),
        (None, true) => {
            let _ = builder
                .with_ansi(std::io::stderr().is_terminal())
                .with_writer(std::io::stderr)
                .try_init();
            return Ok(None);
        }
        (None, false) => {
            let mut failed = Vec::new();
            let mut opened = None;
            let default = default_log_file();
            let places = default.iter().cloned().chain(fallback_log_files());
            for place in places {
                match open_private(&place, true, false) {
                    Ok(f) => {
                        opened = Some((f, place));
                        break;
                    }
                    Err(e) => failed.push(e.why),
                }
            }
            if let Err(e) = default {
                failed.insert(0, e.why);
            }
            match opened {
                Some((f, _)) if failed.is_empty() => (Some(f), None),
                Some((f, place)) => {
                    let why = failed.join("; ");
                    let note = format!("logging to {} ({why})", place.display());
                    (Some(f), Some(note))
                }
                None => {
                    let why = failed.join("; ");
                    let note =
                        format!("no log: nowhere to write one ({why}); give --log-file FILE");
                    (None, Some(note))
                }
            }
        }
    };
    let Some(file) = file else {
        let _ = builder.with_writer(std::io::sink).try_init();
        return Ok(note);
    };
    // A daemon's stderr is /dev/null: panics must reach the log too.
    std::panic::set_hook(Box::new(|info| {
        error!(
            "panic: {info}\n{}",
            std::backtrace::Backtrace::force_capture()
        );
    }));
    let _ = builder
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(file))
        .try_init();
    Ok(note)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("victim");
        std::fs::write(&target, b"precious").unwrap();
        let link = dir.path().join("stfs.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = open_private(&link, false, false).unwrap_err();
        assert!(e.why.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
        let ok = dir.path().join("private/stfs/stfs.log");
        open_private(&ok, true, false).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&ok).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
