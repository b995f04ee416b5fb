//! `stfs inspect` and `stfs verify`: reading headers without mounting.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::format::{Header, ShapeDisplay, gguf, index};
use crate::source::remote::{Location, OpenError, Remote, RemoteOptions};
use object_store::path::Path as ObjectPath;
use std::sync::Arc;

/// Reads and validates the header of one file; the error names the file.
pub fn read_header(path: &Path) -> Result<Header, crate::errno::Failure> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let read_at = |b: &mut [u8], p| std::os::unix::fs::FileExt::read_at(&file, b, p);
    if crate::format::interrupted_in_place(len, read_at) {
        return Err(crate::source::SourceError::Interrupted {
            path: path.to_path_buf(),
        }
        .to_string()
        .into());
    }
    match Header::read(&file) {
        Ok(Ok(h)) => Ok(h),
        Ok(Err(e)) => Err(e.in_file(path).to_string().into()),
        Err(e) => Err(format!("{}: {e}", path.display()).into()),
    }
}

/// A GGUF file, mapped and validated; the error names the file.
fn read_gguf(path: &Path) -> Result<(memmap2::Mmap, gguf::GgufHeader), crate::errno::Failure> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // SAFETY: read-only, private; a file cut short behind it could fault a
    // read (as any mmap reader of a changing file), which a command that
    // reads once accepts.
    let map =
        unsafe { memmap2::Mmap::map(&file) }.map_err(|e| format!("{}: {e}", path.display()))?;
    let h = gguf::parse(&map).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((map, h))
}

/// Whether the file starts with the GGUF magic (else: safetensors).
/// A GGUF file by its magic, or by its name (`.gguf`: refused as GGUF).
fn is_gguf(path: &Path) -> bool {
    path.file_name().is_some_and(gguf::named_gguf) || gguf::is_gguf_file(path)
}

fn inspect_gguf(
    path: &Path,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<(), crate::errno::Failure> {
    let (_map, h) = read_gguf(path)?;
    let io = |e: std::io::Error| e.to_string();
    if as_json {
        let tensors: Vec<_> = h
            .tensors
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "ggml_type": t.ggml_type.name(),
                    "ne": t.ne,
                    "shape": t.shape(),
                    "nbytes": t.nbytes,
                    "offset": t.offset,
                    "file_offset": h.data_start + t.offset,
                })
            })
            .collect();
        let kvs: serde_json::Map<String, serde_json::Value> = h
            .kvs
            .iter()
            .map(|(k, v)| {
                let value = match v {
                    gguf::Value::Array(a) => json!({"item_type": a.item.name(), "len": a.len}),
                    gguf::Value::F32(x) => json!(x),
                    gguf::Value::F64(x) => json!(x),
                    gguf::Value::Bool(x) => json!(*x != 0),
                    gguf::Value::String(_) => json!(gguf::show_value(v)),
                    _ => serde_json::from_str(&gguf::show_value(v)).unwrap_or(json!(null)),
                };
                (
                    k.clone(),
                    json!({"type": v.value_type().name(), "value": value}),
                )
            })
            .collect();
        let doc = json!({
            "file": path.display().to_string(),
            "format": "gguf",
            "version": h.version,
            "alignment": h.alignment,
            "data_start": h.data_start,
            "tensor_count": h.tensors.len(),
            "total_bytes": h.data_len,
            "metadata": kvs,
            "tensors": tensors,
        });
        serde_json::to_writer_pretty(&mut *out, &doc).map_err(|e| e.to_string())?;
        return Ok(writeln!(out).map_err(io)?);
    }
    writeln!(out, "{}", path.display()).map_err(io)?;
    writeln!(
        out,
        "  GGUF v{}, {} tensors, {} bytes of tensor data from byte {} (alignment {}), {} keys",
        h.version,
        h.tensors.len(),
        h.data_len,
        h.data_start,
        h.alignment,
        h.kvs.len()
    )
    .map_err(io)?;
    writeln!(out, "  metadata:").map_err(io)?;
    for (k, v) in &h.kvs {
        let mut shown = gguf::show_value(v);
        if shown.chars().count() > 80 {
            shown = format!(
                "{}... ({} bytes)",
                shown.chars().take(77).collect::<String>(),
                shown.len()
            );
        }
        let k = crate::format::printable(k);
        // A string quoted and escaped (it may hold newlines or escapes);
        // numbers, bools and an array's summary as they are.
        if !matches!(v, gguf::Value::String(_)) {
            writeln!(out, "    {k} ({}): {shown}", v.value_type().name()).map_err(io)?;
            continue;
        }
        writeln!(out, "    {k} ({}): {shown:?}", v.value_type().name()).map_err(io)?;
    }
    let width = name_column(h.tensors.iter().map(|t| t.name.as_str()));
    writeln!(
        out,
        "  {:width$}  {:<8} {:<20} {:>14}  offset",
        "name", "type", "shape", "bytes"
    )
    .map_err(io)?;
    for t in &h.tensors {
        let shape = format!("{:?}", t.shape());
        writeln!(
            out,
            "  {:width$}  {:<8} {:<20} {:>14}  {}",
            crate::format::printable(&t.name),
            t.ggml_type.name(),
            shape,
            t.nbytes,
            t.offset
        )
        .map_err(io)?;
    }
    Ok(())
}

/// `stfs inspect`: a file's header, or (`url`) a remote object's.
pub fn inspect(
    path: &Path,
    url: &UrlOptions,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<(), crate::errno::Failure> {
    let shown = path.display().to_string();
    if crate::source::remote::is_url(&shown) {
        let h = remote_header(&shown, url)?;
        return print_header(&shown, &h, as_json, out);
    }
    if path.is_dir() {
        return Err(format!(
            "{shown}: a folder: `stfs inspect` reads one file's header (stfs inspect \
             {shown}/NAME.safetensors); `stfs verify {shown}` checks a folder of shards and its index"
        )
        .into());
    }
    if is_gguf(path) {
        return inspect_gguf(path, as_json, out);
    }
    print_header(&shown, &read_header(path)?, as_json, out)
}

/// A header as `stfs inspect` prints it: a table, or JSON.
fn print_header(
    shown: &str,
    h: &Header,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<(), crate::errno::Failure> {
    let total: u64 = h.data_len();
    let io = |e: std::io::Error| e.to_string();
    if as_json {
        let tensors: Vec<_> = h
            .tensors
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "dtype": t.dtype.name(),
                    "shape": t.shape,
                    "nbytes": t.nbytes(),
                    "data_offsets": [t.data_offsets.0, t.data_offsets.1],
                    "file_offset": h.data_start() + t.data_offsets.0,
                })
            })
            .collect();
        let doc = json!({
            "file": shown,
            "header_len": h.header_len,
            "data_start": h.data_start(),
            "tensor_count": h.tensors.len(),
            "total_bytes": total,
            "metadata": h.metadata,
            "tensors": tensors,
        });
        serde_json::to_writer_pretty(&mut *out, &doc).map_err(|e| e.to_string())?;
        writeln!(out).map_err(io)?;
        return Ok(());
    }
    writeln!(out, "{shown}").map_err(io)?;
    writeln!(
        out,
        "  {} tensor{}, {} bytes of tensor data, header {} bytes",
        h.tensors.len(),
        if h.tensors.len() == 1 { "" } else { "s" },
        total,
        h.header_len
    )
    .map_err(io)?;
    if let Some(meta) = &h.metadata {
        writeln!(out, "  metadata:").map_err(io)?;
        for (k, v) in meta {
            writeln!(out, "    {k:?}: {v:?}").map_err(io)?;
        }
    }
    let width = name_column(h.tensors.iter().map(|t| t.name));
    writeln!(
        out,
        "  {:width$}  {:<11} {:<20} {:>14}  offsets",
        "name", "dtype", "shape", "bytes"
    )
    .map_err(io)?;
    for t in &h.tensors {
        let shape = ShapeDisplay(t.shape).to_string();
        writeln!(
            out,
            "  {:width$}  {:<11} {:<20} {:>14}  [{}, {}]",
            crate::format::printable(t.name),
            t.dtype.name(),
            shape,
            t.nbytes(),
            t.data_offsets.0,
            t.data_offsets.1
        )
        .map_err(io)?;
    }
    Ok(())
}

/// The width of a table's name column: the longest name, within 4..=60.
fn name_column<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    names.map(str::len).max().unwrap_or(4).clamp(4, 60)
}

/// Verifies files and folders; prints one line per file or problem.
/// Returns the number of problems found.
pub fn verify(paths: &[PathBuf], url: &UrlOptions, out: &mut dyn Write) -> usize {
    let mut problems = 0;
    let mut say = |line: String, bad: bool| {
        if bad {
            problems += 1;
        }
        let _ = writeln!(out, "{line}");
    };
    for path in paths {
        let shown = path.display().to_string();
        if crate::source::remote::is_url(&shown) {
            verify_url(&shown, url, &mut say);
            continue;
        }
        if path.is_dir() {
            verify_dir(path, &mut say);
            continue;
        }
        if is_gguf(path) {
            verify_gguf(path, &mut say);
            continue;
        }
        match read_header(path) {
            Ok(h) => say(verified(path, &h), false),
            Err(e) => say(e.to_string(), true),
        }
    }
    problems
}

/// The line `verify` says of a valid file.
fn verified(path: &Path, h: &Header) -> String {
    let (n, bytes) = (h.tensors.len(), h.data_len());
    format!("{}: ok ({n} tensors, {bytes} bytes)", path.display())
}

/// How `inspect` and `verify` reach a URL.
#[derive(Debug, Clone, Default)]
pub struct UrlOptions {
    /// An S3-compatible endpoint (else AWS_ENDPOINT_URL, else AWS).
    pub endpoint: Option<String>,
    pub timeout: std::time::Duration,
}

fn connect(url: &str, o: &UrlOptions) -> Result<Location, crate::errno::Failure> {
    let opts = RemoteOptions {
        endpoint: o.endpoint.clone(),
        cache_dir: crate::source::remote::default_cache_dir(),
        cache_size: 1 << 30,
        concurrency: 4,
        timeout: o.timeout,
    };
    Ok(Remote::connect(url, &opts).map_err(|e| e.to_string())?)
}

/// A remote object's header, read and validated as a mount does.
fn remote_header(url: &str, o: &UrlOptions) -> Result<Header, crate::errno::Failure> {
    let at = connect(url, o)?;
    if at.folder {
        return Err(format!(
            "{url}: a folder of shards: `stfs verify` checks one; `stfs inspect` takes an object"
        )
        .into());
    }
    object_header(&at.remote, &at.path)
}

fn object_header(remote: &Arc<Remote>, path: &ObjectPath) -> Result<Header, crate::errno::Failure> {
    match remote.open(path) {
        Ok((_, header)) => Ok(header),
        Err(OpenError::Fetch(why)) => Err(why.into()),
        Err(OpenError::Format(error)) => Err(crate::source::SourceError::Format {
            path: PathBuf::from(remote.url(path)),
            error,
        }
        .to_string()
        .into()),
    }
}

/// `verify` of a URL: an object, or a prefix (a folder of shards: each
/// shard, then each index against them).
fn verify_url(url: &str, o: &UrlOptions, say: &mut dyn FnMut(String, bool)) {
    let at = match connect(url, o) {
        Ok(at) => at,
        Err(e) => return say(e.to_string(), true),
    };
    if !at.folder {
        return match object_header(&at.remote, &at.path) {
            Ok(h) => say(verified(Path::new(url), &h), false),
            Err(e) => say(e.to_string(), true),
        };
    }
    let listed = match at.remote.list(&at.path) {
        Ok(l) => l,
        Err(e) => return say(e.to_string(), true),
    };
    let mut headers = BTreeMap::new();
    let shards: Vec<_> = listed
        .iter()
        .filter(|(n, ..)| n.ends_with(".safetensors"))
        .collect();
    for (name, path, _) in &shards {
        match object_header(&at.remote, path) {
            Ok(h) => {
                say(verified(Path::new(&at.remote.url(path)), &h), false);
                headers.insert(name.clone(), h);
            }
            Err(e) => say(e.to_string(), true),
        }
    }
    if shards.is_empty() {
        say(
            format!("{url}: no *.safetensors objects under this prefix"),
            true,
        );
    }
    let refs: BTreeMap<String, &Header> = headers.iter().map(|(k, v)| (k.clone(), v)).collect();
    for (_, path, _) in listed.iter().filter(|(n, ..)| n.ends_with(".index.json")) {
        let shown = at.remote.url(path);
        let problems = match at.remote.get_all(path) {
            Err(e) => vec![e.to_string()],
            Ok((bytes, _)) => index_problems(&bytes, &refs, headers.len() == shards.len()),
        };
        if problems.is_empty() {
            say(format!("{shown}: ok (index agrees with the shards)"), false);
        }
        for p in problems {
            say(format!("{shown}: {p}"), true);
        }
    }
}

/// What is wrong with an index's text against the shards (`all_read`:
/// every shard parsed, so that it can be checked).
fn index_problems(bytes: &[u8], shards: &BTreeMap<String, &Header>, all_read: bool) -> Vec<String> {
    match index::parse_index(bytes) {
        Err(e) => vec![e.to_string()],
        Ok(ix) if all_read => index::check_index(&ix, shards),
        Ok(_) => vec!["not checked: a shard above is invalid".into()],
    }
}

/// The files beside an index that it does not name and whose every tensor
/// it maps to another file that holds it: a copy of the model beside its
/// shards (a merged export), not a shard the index forgot.
fn copies_beside(index_text: &[u8], files: &BTreeMap<String, &Header>) -> Vec<String> {
    let Ok(ix) = index::parse_index(index_text) else {
        return Vec::new();
    };
    let named: std::collections::BTreeSet<&String> = ix.weight_map.values().collect();
    let elsewhere = |file: &str, tensor: &str| {
        ix.weight_map.get(tensor).is_some_and(|other| {
            other != file && files.get(other).is_some_and(|h| h.get(tensor).is_some())
        })
    };
    files
        .iter()
        .filter(|(name, h)| {
            !named.contains(name)
                && !h.tensors.is_empty()
                && h.tensors.iter().all(|t| elsewhere(name, t.name))
        })
        .map(|(name, _)| name.clone())
        .collect()
}

fn verify_gguf(path: &Path, say: &mut dyn FnMut(String, bool)) {
    match read_gguf(path) {
        Ok((_, h)) => say(
            format!(
                "{}: ok (GGUF v{}, {} tensors, {} bytes)",
                path.display(),
                h.version,
                h.tensors.len(),
                h.data_len
            ),
            false,
        ),
        Err(e) => say(e.to_string(), true),
    }
}

fn verify_dir(dir: &Path, say: &mut dyn FnMut(String, bool)) {
    let shards = match list_dir(dir) {
        Ok(s) => s,
        Err(e) => return say(format!("{}: {e}", dir.display()), true),
    };
    let mut headers = BTreeMap::new();
    for (name, path) in &shards.checkpoints {
        match read_header(path) {
            Ok(h) => {
                say(verified(path, &h), false);
                headers.insert(name.clone(), h);
            }
            Err(e) => say(e.to_string(), true),
        }
    }
    for (_, path) in &shards.ggufs {
        verify_gguf(path, say);
    }
    if shards.checkpoints.is_empty() && shards.ggufs.is_empty() {
        say(
            format!("{}: no *.safetensors or *.gguf files", dir.display()),
            true,
        );
    }
    let refs: BTreeMap<String, &Header> = headers.iter().map(|(k, v)| (k.clone(), v)).collect();
    for path in &shards.indexes {
        let problems = match std::fs::read(path) {
            Err(e) => vec![e.to_string()],
            // An index can only be checked against shards that parsed.
            Ok(bytes) => {
                let mut refs = refs.clone();
                for name in copies_beside(&bytes, &refs) {
                    refs.remove(&name);
                    say(
                        format!(
                            "{}: not a shard of {}: each of its tensors is mapped to another \
                             file (an export beside the shards, as a mount's __views__ holds)",
                            dir.join(&name).display(),
                            path.file_name().unwrap_or_default().to_string_lossy()
                        ),
                        false,
                    );
                }
                index_problems(&bytes, &refs, headers.len() == shards.checkpoints.len())
            }
        };
        if problems.is_empty() {
            say(
                format!("{}: ok (index agrees with the shards)", path.display()),
                false,
            );
        }
        for p in problems {
            say(format!("{}: {p}", path.display()), true);
        }
    }
}

/// The checkpoint files and shard indexes directly in a folder, sorted by name.
pub struct DirListing {
    /// (file name, path) of every `*.safetensors`.
    pub checkpoints: Vec<(String, PathBuf)>,
    /// Every `*.index.json`.
    pub indexes: Vec<PathBuf>,
    /// (file name, path) of every `*.gguf` (the parts of a split GGUF file).
    pub ggufs: Vec<(String, PathBuf)>,
    /// (file name, path) of every other file a model folder shows
    /// (`crate::fs::model_files::is_model_file`).
    pub others: Vec<(String, PathBuf)>,
    /// What a model folder leaves out and the mount says (hidden files are
    /// not said): (name, why), a subfolder's name ending in `/`.
    pub left_out: Vec<(String, &'static str)>,
}

pub fn list_dir(dir: &Path) -> std::io::Result<DirListing> {
    let mut checkpoints = Vec::new();
    let mut indexes = Vec::new();
    let mut ggufs = Vec::new();
    let mut others = Vec::new();
    let mut left_out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if path.is_dir() && !name.starts_with('.') {
            left_out.push((format!("{name}/"), "a subfolder"));
        }
        if !path.is_file() {
            continue;
        }
        if let Some(why @ "weights of another format") = crate::fs::model_files::left_out(&name) {
            left_out.push((name.clone(), why));
        }
        if name.ends_with(".safetensors") {
            checkpoints.push((name, path));
        } else if name.ends_with(".index.json") {
            indexes.push(path);
        } else if name.ends_with(".gguf") {
            ggufs.push((name, path));
        } else if crate::fs::model_files::is_model_file(&name) {
            others.push((name, path));
        }
    }
    checkpoints.sort();
    indexes.sort();
    ggufs.sort();
    others.sort();
    left_out.sort();
    Ok(DirListing {
        checkpoints,
        indexes,
        ggufs,
        others,
        left_out,
    })
}
