//! `stfs create`: a new, empty, valid checkpoint.

use std::io::Write;
use std::path::Path;

use crate::format::{Metadata, layout};

/// Writes an empty checkpoint atomically (temp file + rename); refuses to
/// replace an existing file unless `force`.
pub fn create(path: &Path, metadata: Option<Metadata>, force: bool) -> Result<(), String> {
    let what = |e: std::io::Error| format!("{}: {e}", path.display());
    if !force && path.exists() {
        return Err(format!(
            "{}: already exists (use --force to replace it)",
            path.display()
        ));
    }
    let l = layout(&[], metadata.as_ref()).map_err(|e| e.in_file(path).to_string())?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".stfs-create-")
        .tempfile_in(dir)
        .map_err(what)?;
    tmp.write_all(&l.header).map_err(what)?;
    tmp.as_file().sync_all().map_err(what)?;
    tmp.persist(path).map_err(|e| what(e.error))?;
    Ok(())
}
