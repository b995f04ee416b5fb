//! The other files of a model folder (`config.json`, the tokenizer's...) as
//! edited through the mount: what a commit writes of them (`ModelChange`),
//! and how each staged file is kept in the staging folder until then.
//!
//! Each changed name is one file of the staging folder, `m.<name in hex>`,
//! written whole and atomically (temp, fsync, rename, fsync the folder):
//! `+` and the file's bytes, or `-` for a file removed. No journal is needed:
//! the folder is the record, and an entry whose file is already in the folder
//! as staged (a commit that landed before its entries went) is dropped when
//! the next mount takes the folder back.

use std::ffi::OsStr;
use std::sync::Arc;

use crate::source::{FileStat, StagingDir};

/// A file of the folder that a commit writes or removes.
#[derive(Clone, Debug)]
pub struct ModelChange {
    pub name: String,
    /// Its bytes as staged (None: removed).
    pub bytes: Option<Arc<Vec<u8>>>,
    /// Owner and mode it gets if new.
    pub like: FileStat,
    /// The file in the folder as mounted (or last committed), which must
    /// still be there to be replaced (None: a new file, whose name must be
    /// free).
    pub base: Option<FileStat>,
    /// That file's ETag, in a store.
    pub etag: Option<String>,
    /// That object's own headers, in a store (kept by the new one).
    pub headers: Vec<(String, String)>,
}

/// A model file as a commit left it (None: removed).
#[derive(Clone, Debug)]
pub struct Landed {
    pub stat: FileStat,
    /// Its ETag, in a store.
    pub etag: Option<String>,
}

/// The longest name whose edits can be staged (its entry's name is twice as
/// long, and a folder's names stop at 255 bytes).
pub const MAX_NAME: usize = 120;

const PREFIX: &str = "m.";

fn entry_name(name: &str) -> String {
    let hex: String = name.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{PREFIX}{hex}")
}

fn name_of_entry(entry: &OsStr) -> Option<String> {
    let hex = entry.to_str()?.strip_prefix(PREFIX)?;
    if hex.len() % 2 != 0 || hex.is_empty() {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    // Only a plain name of the folder (the staging folder is private, but
    // what it names is opened in the model's folder).
    let name = String::from_utf8(bytes?).ok()?;
    let plain = name.len() <= MAX_NAME && name != "." && name != ".." && !name.contains('/');
    plain.then_some(name)
}

/// Keeps `name`'s staged state in `dir`: its bytes, its removal, or (None)
/// nothing staged.
pub fn stage(dir: &StagingDir, name: &str, staged: Option<Option<&[u8]>>) -> std::io::Result<()> {
    let entry = entry_name(name);
    match staged {
        Some(Some(bytes)) => dir.write_atomic(&entry, &[b"+", bytes].concat()),
        Some(None) => dir.write_atomic(&entry, b"-"),
        None => {
            let folder = dir.folder()?;
            match folder.unlink(OsStr::new(&entry)) {
                Ok(()) => folder.sync(),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
                Err(e) => Err(e),
            }
        }
    }
}

/// Whether `dir` holds staged model files.
pub fn any_staged(dir: &StagingDir) -> bool {
    dir.list()
        .unwrap_or_default()
        .iter()
        .any(|n| name_of_entry(n).is_some())
}

/// Every file staged in `dir`: its name and bytes (None: removed). An entry
/// that cannot be read is an error; one not whole (no `+` or `-`) is left
/// out, as never written (`write_atomic` renames only what it synced).
pub fn staged(dir: &StagingDir) -> std::io::Result<Vec<(String, Option<Vec<u8>>)>> {
    let folder = dir.folder()?;
    let mut out = Vec::new();
    for entry in dir.list()? {
        let Some(name) = name_of_entry(&entry) else {
            continue;
        };
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let f = folder.open_file(&entry, flags, 0)?;
        let mut text = Vec::new();
        crate::testpoint::io("read")?;
        std::io::Read::read_to_end(&mut &f, &mut text)?;
        match text.split_first() {
            Some((b'+', bytes)) => out.push((name, Some(bytes.to_vec()))),
            Some((b'-', [])) => out.push((name, None)),
            _ => tracing::warn!(
                entry = %entry.to_string_lossy(),
                "a staged model file that is neither bytes nor a removal: left out"
            ),
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names_give_back_their_file_name() {
        for name in ["config.json", "a", "é.txt", &"x".repeat(MAX_NAME)] {
            let entry = entry_name(name);
            assert!(entry.len() <= 255);
            assert_eq!(name_of_entry(OsStr::new(&entry)).as_deref(), Some(name));
        }
        // (Not UTF-8, a path, a folder's own names.)
        for not in [
            "m.",
            "m.6",
            "m.zz",
            "s1",
            "journal",
            "m.ff",
            "m.2f6574632f706173737764",
            "m.2e2e",
            "m.2e",
        ] {
            assert_eq!(name_of_entry(OsStr::new(not)), None, "{not}");
        }
    }

    #[test]
    fn staged_files_read_back_as_written() {
        let base = tempfile::tempdir().unwrap();
        let folder = Arc::new(crate::source::Folder::open(base.path()).unwrap());
        let dir = StagingDir::create(folder, "t").unwrap();
        assert!(!any_staged(&dir));
        stage(&dir, "config.json", Some(Some(b"{}"))).unwrap();
        stage(&dir, "old.txt", Some(None)).unwrap();
        stage(&dir, "empty", Some(Some(b""))).unwrap();
        stage(&dir, "gone", Some(Some(b"x"))).unwrap();
        stage(&dir, "gone", None).unwrap();
        stage(&dir, "never", None).unwrap();
        assert!(any_staged(&dir));
        let got = staged(&dir).unwrap();
        assert_eq!(
            got,
            vec![
                ("config.json".to_string(), Some(b"{}".to_vec())),
                ("empty".to_string(), Some(Vec::new())),
                ("old.txt".to_string(), None),
            ]
        );
        dir.remove().unwrap();
    }
}
