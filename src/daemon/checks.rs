//! The checks before a mount: the mount point, a dead daemon's mount, and
//! where the staging folder can be.

use super::*;

/// What is at the mount point, as far as mounting there goes.
pub(super) fn check_mountpoint(
    mountpoint: &Path,
    nonempty: bool,
) -> Result<(), crate::errno::Failure> {
    let shown = mountpoint.display();
    if let Some(m) = crate::mountinfo::mount_at(mountpoint) {
        return Err(if m.fstype == "fuse.stfs" && dead(mountpoint) {
            format!(
                "{shown} is a stfs mount whose daemon is gone: run `stfs umount {shown}` first \
                 (its staged edits, if any, are kept and taken back by the next mount)"
            )
            .into()
        } else {
            format!(
                "{shown} is already a mount point ({} of {}): unmount it first; stfs does not stack mounts",
                m.fstype, m.source
            ).into()
        });
    }
    match std::fs::read_dir(mountpoint) {
        Ok(mut entries) => {
            if entries.next().is_some() && !nonempty {
                return Err(format!(
                    "{shown} is not empty: mounting there would hide what it holds \
                     (use an empty folder, or -o nonempty to mount anyway)"
                )
                .into());
            }
            Ok(())
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Err(format!(
            "{shown}: no such folder to mount on (create it first: mkdir -p {shown})"
        )
        .into()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            Err(format!("{shown}: not a folder: a mount point must be one").into())
        }
        Err(e) => Err(format!("{shown}: {e}").into()),
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
pub(super) fn private_staging_if_needed(
    source: &Path,
    base: Arc<Folder>,
    stem: &str,
) -> Result<(Arc<Folder>, Option<String>), crate::errno::Failure> {
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

pub(super) fn staging_for(
    source: &Path,
    dir: Option<&Path>,
) -> Result<(Arc<Folder>, String), crate::errno::Failure> {
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
