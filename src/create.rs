//! `stfs create`: a new, empty, valid checkpoint (GGUF when the name ends
//! in `.gguf`, as such a name is always read).

use std::io::Write;
use std::path::Path;

use crate::format::{Metadata, layout};

/// Writes an empty checkpoint atomically (temp file + rename); refuses to
/// replace an existing file unless `force`.
pub fn create(
    path: &Path,
    metadata: Option<Metadata>,
    force: bool,
) -> Result<(), crate::errno::Failure> {
    let what = |e: std::io::Error| format!("{}: {e}", path.display());
    if !force && path.exists() {
        return Err(format!(
            "{}: already exists (use --force to replace it)",
            path.display()
        )
        .into());
    }
    let header = match crate::format::gguf::named_gguf(path.as_os_str()) {
        true => gguf_header(metadata.as_ref()),
        false => layout(&[], metadata.as_ref()).map(|l| l.header),
    }
    .map_err(|e| e.in_file(path).to_string())?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new()
        .prefix(".stfs-create-")
        .tempfile_in(dir)
        .map_err(what)?;
    tmp.write_all(&header).map_err(what)?;
    tmp.as_file().sync_all().map_err(what)?;
    tmp.persist(path).map_err(|e| what(e.error))?;
    Ok(())
}

/// An empty GGUF file (version 3) whose keys are the metadata's, as strings.
fn gguf_header(metadata: Option<&Metadata>) -> Result<Vec<u8>, crate::format::FormatError> {
    use crate::format::gguf::write::{KvType, parse_text};
    use crate::format::writer::{FormatWriter, Gguf};
    let kvs = metadata
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            let value = parse_text(KvType::STRING, v.as_bytes()).expect("any text is a string");
            (k.clone(), value)
        })
        .collect();
    let format = Gguf {
        version: crate::format::gguf::write::WRITER_VERSION,
        kvs,
        alignment: 32,
    };
    let none = |_: usize| unreachable!("no tensors");
    Ok(format.layout(0, &none, true)?.header)
}
