use crate::errno::ToErrno;
use std::path::Path;

use super::*;
use crate::checkpoint::staging::Staging;
use crate::format::{Dtype, Metadata, TensorSpec, layout};
use crate::source::SourceFile;

fn write_checkpoint(
    path: &Path,
    tensors: &[(&str, Dtype, &[u64])],
    meta: Option<Metadata>,
) -> Vec<Vec<u8>> {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, d, s)| TensorSpec {
            name: n.to_string(),
            dtype: *d,
            shape: s.to_vec(),
        })
        .collect();
    let l = layout(&specs, meta.as_ref()).unwrap();
    let mut bytes = l.header.clone();
    let mut contents = vec![Vec::new(); specs.len()];
    for (t, &src) in l.tensors.iter().zip(&l.source_index) {
        let data: Vec<u8> = (0..t.nbytes())
            .map(|i| (i as usize * 13 + src) as u8)
            .collect();
        bytes.extend_from_slice(&data);
        contents[src] = data;
    }
    std::fs::write(path, bytes).unwrap();
    contents
}

fn settings() -> Settings {
    Settings::default()
}

/// A mount of `path` with staging beside it.
fn mount(path: &Path, settings: Settings) -> Fs {
    let source = SourceFile::open(path).unwrap();
    let staging = staging_beside(path);
    Fs::new(Source::File(source), settings, staging)
}

fn staging_beside(path: &Path) -> Arc<Staging> {
    let dir = path.parent().unwrap();
    Arc::new(Staging::new(
        Arc::new(crate::source::Folder::open(dir).unwrap()),
        path.file_name().unwrap().to_string_lossy(),
    ))
}

fn errno<T: std::fmt::Debug>(r: Result<T, FsError>) -> i32 {
    r.expect_err("an error").to_errno()
}

fn read_all(fs: &Fs, ino: Ino) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let chunk = fs
            .read(ino, 0, out.len() as u64, 7, |b| b.concat())
            .unwrap();
        if chunk.is_empty() {
            return out;
        }
        out.extend(chunk);
    }
}

fn list(fs: &Fs, ino: Ino) -> Vec<String> {
    let mut names = Vec::new();
    fs.readdir(ino, 0, |e| {
        names.push(e.name);
        false
    })
    .unwrap();
    names
}

#[test]
fn file_mount_lists_reads_and_stats() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let long = "L".repeat(300);
    let names = ["w", "a/b", "x.meta.json", "", long.as_str()];
    let contents = write_checkpoint(
        &path,
        &[
            (names[0], Dtype::F32, &[2, 3]),
            (names[1], Dtype::U8, &[5]),
            (names[2], Dtype::I16, &[]),
            (names[3], Dtype::BF16, &[0]),
            (names[4], Dtype::U8, &[1]),
        ],
        Some([("k".to_string(), "v".to_string())].into()),
    );
    let fs = mount(&path, settings());

    let listing = list(&fs, ROOT_INO);
    // ., .., __metadata__.json, and two files per tensor (`__views__` is not listed).
    assert_eq!(listing.len(), 2 + 1 + 2 * names.len());
    assert!(fs.lookup(ROOT_INO, "__views__").is_ok());
    assert!(
        listing.contains(&"a%2Fb".to_string())
            && listing.contains(&"x%2Emeta.json.meta.json".to_string())
    );
    assert!(
        listing.contains(&"%".to_string()) && listing.contains(&"__metadata__.json".to_string())
    );

    for (name, want) in names.iter().zip(&contents) {
        let file = names::tensor_file_name(name);
        let a = fs.lookup(ROOT_INO, &file).unwrap();
        let src = std::fs::metadata(&path).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            (a.kind, a.size, a.perm as u32, a.uid, a.gid),
            (
                Kind::File,
                want.len() as u64,
                src.mode() & 0o777,
                src.uid(),
                src.gid()
            )
        );
        assert_eq!(&read_all(&fs, a.ino), want, "{name:?}");
        let m = fs
            .lookup(ROOT_INO, &TensorFile::Meta.file_name(name))
            .unwrap();
        let meta: serde_json::Value = serde_json::from_slice(&read_all(&fs, m.ino)).unwrap();
        assert_eq!(meta["name"], *name);
        assert_eq!(meta["nbytes"], want.len());
        assert_eq!(m.size as usize, read_all(&fs, m.ino).len());
        let o = fs.open(a.ino, false, false).unwrap();
        assert!(
            !o.keep_cache && o.direct_io,
            "direct I/O by default: one copy in memory"
        );
        fs.release(o.fh).unwrap();
    }
    let md = fs.lookup(ROOT_INO, "__metadata__.json").unwrap();
    assert_eq!(read_all(&fs, md.ino), b"{\"k\":\"v\"}\n");

    // Reads past the end and at odd offsets.
    let w = fs.lookup(ROOT_INO, "w").unwrap();
    assert_eq!(
        fs.read(w.ino, 0, 20, 100, |b| b.concat()).unwrap(),
        contents[0][20..]
    );
    assert!(fs.read(w.ino, 0, 1000, 100, |b| b.concat().len()).unwrap() == 0);

    for bad in ["nope", "w.meta", "%2f", "W", "a/b"] {
        assert_eq!(errno(fs.lookup(ROOT_INO, bad)), libc::ENOENT, "{bad}");
    }
    assert_eq!(errno(fs.lookup(w.ino, "x")), libc::ENOTDIR);
    assert_eq!(
        errno(fs.lookup(ROOT_INO, &"n".repeat(256))),
        libc::ENAMETOOLONG
    );
    assert_eq!(errno(fs.getattr(999_999, None)), libc::ENOENT);
    assert_eq!(errno(fs.open(ROOT_INO, false, false)), libc::EISDIR);
    // A directory gets x where its file has r.
    let file_mode = fs.getattr(w.ino, None).unwrap().perm;
    let dir_mode = fs.getattr(ROOT_INO, None).unwrap().perm;
    assert_eq!(dir_mode, file_mode | ((file_mode & 0o444) >> 2));
}

#[test]
fn readdir_resumes_at_every_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let names: Vec<String> = (0..50).map(|i| format!("t{i}")).collect();
    let tensors: Vec<(&str, Dtype, &[u64])> = names
        .iter()
        .map(|n| (n.as_str(), Dtype::U8, &[1u64][..]))
        .collect();
    write_checkpoint(&path, &tensors, None);
    let fs = mount(&path, settings());
    let full = list(&fs, ROOT_INO);
    // Page through in small batches, as the kernel does.
    let mut paged = Vec::new();
    let mut offset = 0;
    loop {
        let mut batch = Vec::new();
        fs.readdir(ROOT_INO, offset, |e| {
            batch.push(e);
            batch.len() == 3
        })
        .unwrap();
        if batch.is_empty() {
            break;
        }
        offset = batch.last().unwrap().next_offset;
        paged.extend(batch.into_iter().map(|e| e.name));
    }
    assert_eq!(paged, full);
    // Every listed name looks up to the inode readdir gave.
    let mut inos = std::collections::HashSet::new();
    fs.readdir(ROOT_INO, 2, |e| {
        assert_eq!(fs.lookup(ROOT_INO, &e.name).unwrap().ino, e.ino);
        assert!(inos.insert(e.ino));
        false
    })
    .unwrap();
}

#[test]
fn folder_mount_has_a_directory_per_shard_and_the_index() {
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(
        &dir.path().join("s1.safetensors"),
        &[("a", Dtype::U8, &[2])],
        None,
    );
    write_checkpoint(
        &dir.path().join("s2.safetensors"),
        &[("a", Dtype::U8, &[3])],
        None,
    );
    let open = |n: &str| SourceFile::open(&dir.path().join(n)).unwrap();
    let stat = |p: &Path| crate::source::FileStat::of(&std::fs::File::open(p).unwrap()).unwrap();
    let source = Source::Folder {
        folder: Arc::new(crate::source::Folder::open(dir.path()).unwrap()),
        stat: stat(dir.path()),
        checkpoints: vec![
            ("s1".into(), open("s1.safetensors")),
            ("s2".into(), open("s2.safetensors")),
        ],
        indexes: vec![IndexFile {
            name: "m.index.json".into(),
            bytes: b"{}".to_vec(),
            stat: stat(&dir.path().join("s1.safetensors")),
            remote: None,
        }],
        model_files: Vec::new(),
        not_shown: Vec::new(),
    };
    let fs = Fs::new(
        source,
        Settings {
            read_only: true,
            ..Settings::default()
        },
        staging_beside(&dir.path().join("x")),
    );
    assert_eq!(list(&fs, ROOT_INO), [".", "..", "s1", "s2", "m.index.json"]);
    assert!(fs.lookup(ROOT_INO, "__views__").is_ok());
    let s2 = fs.lookup(ROOT_INO, "s2").unwrap();
    assert_eq!(s2.kind, Kind::Directory);
    let a = fs.lookup(s2.ino, "a").unwrap();
    assert_eq!((a.size, a.perm & 0o222), (3, 0));
    assert_eq!(errno(fs.open(a.ino, true, false)), libc::EROFS);
    assert_ne!(
        a.ino,
        fs.lookup(fs.lookup(ROOT_INO, "s1").unwrap().ino, "a")
            .unwrap()
            .ino
    );
    let ix = fs.lookup(ROOT_INO, "m.index.json").unwrap();
    assert_eq!(read_all(&fs, ix.ino), b"{}");
    assert_eq!(errno(fs.readdir(a.ino, 0, |_| false)), libc::ENOTDIR);
}

/// A small checkpoint mounted read-write: tensors `a` (F32 [2]) and `b` (U8 [3]).
fn small() -> (tempfile::TempDir, std::path::PathBuf, Fs) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    write_checkpoint(
        &path,
        &[("a", Dtype::F32, &[2]), ("b", Dtype::U8, &[3])],
        None,
    );
    let fs = mount(&path, settings());
    (dir, path, fs)
}

fn write_file(fs: &Fs, name: &str, data: &[u8]) -> u64 {
    let (a, o) = fs.create(ROOT_INO, name, (true, false), 0o644).unwrap();
    fs.write(a.ino, o.fh, 0, data).unwrap();
    fs.flush(o.fh).unwrap();
    fs.release(o.fh).unwrap();
    a.ino
}

fn cat(fs: &Fs, name: &str) -> Vec<u8> {
    let a = fs.lookup(ROOT_INO, name).unwrap();
    let o = fs.open(a.ino, false, false).unwrap();
    let data = fs.read(a.ino, o.fh, 0, 1 << 20, |b| b.concat()).unwrap();
    fs.release(o.fh).unwrap();
    data
}

#[test]
fn replacing_the_bytes_keeps_the_names_meta() {
    let (_dir, _path, fs) = small();
    // unlink then create (install, tar): the meta stays with the name.
    fs.unlink(ROOT_INO, "b").unwrap();
    assert!(
        fs.lookup(ROOT_INO, "b.meta.json").is_ok(),
        "the meta outlives the data file"
    );
    write_file(&fs, "b", b"xyz");
    assert!(
        String::from_utf8(cat(&fs, "b.meta.json"))
            .unwrap()
            .contains("\"U8\"")
    );
    // temp + rename onto the name (os.replace): the meta stays too.
    write_file(&fs, ".a.tmp", &[1, 2, 3, 4, 5, 6, 7, 8]);
    fs.rename(ROOT_INO, ".a.tmp", ROOT_INO, "a", false).unwrap();
    assert_eq!(cat(&fs, "a"), [1, 2, 3, 4, 5, 6, 7, 8]);
    assert!(
        String::from_utf8(cat(&fs, "a.meta.json"))
            .unwrap()
            .contains("\"F32\"")
    );
    let (status, refused) = {
        let r = fs.status();
        (r.text(), r.refused)
    };
    assert!(!refused, "{status}");
    fs.commit(Default::default(), 0).unwrap();
    assert_eq!(cat(&fs, "a"), [1, 2, 3, 4, 5, 6, 7, 8]);
}

#[test]
fn files_renamed_onto_a_meta_become_its_json() {
    let (_dir, _path, fs) = small();
    write_file(&fs, "sedTmp", br#"{"dtype":"U8","shape":[8]}"#);
    fs.rename(ROOT_INO, "sedTmp", ROOT_INO, "a.meta.json", false)
        .unwrap();
    assert_eq!(errno(fs.lookup(ROOT_INO, "sedTmp")), libc::ENOENT);
    assert!(
        String::from_utf8(cat(&fs, "a.meta.json"))
            .unwrap()
            .starts_with(r#"{"dtype":"U8","shape":[8]"#)
    );
    // Not JSON: EINVAL, and nothing changes.
    write_file(&fs, "junk", b"not json");
    assert_eq!(
        errno(fs.rename(ROOT_INO, "junk", ROOT_INO, "a.meta.json", false)),
        libc::EINVAL
    );
    assert_eq!(cat(&fs, "junk"), b"not json");
    // A meta renamed onto a data name is a plain file (vim's backup).
    fs.rename(ROOT_INO, "a.meta.json", ROOT_INO, "a.meta.json~", false)
        .unwrap();
    assert_eq!(errno(fs.lookup(ROOT_INO, "a.meta.json")), libc::ENOENT);
    assert!(cat(&fs, "a.meta.json~").starts_with(b"{\"dtype\":\"U8\""));
    // __metadata__.json by rename.
    write_file(&fs, "m", br#"{"k":"v"}"#);
    fs.rename(ROOT_INO, "m", ROOT_INO, "__metadata__.json", false)
        .unwrap();
    assert_eq!(cat(&fs, "__metadata__.json"), b"{\"k\":\"v\"}\n");
}

#[test]
fn invalid_meta_is_kept_and_refused_at_commit() {
    let (_dir, path, fs) = small();
    let before = std::fs::read(&path).unwrap();
    let (_, o) = fs
        .create(ROOT_INO, "a.meta.json", (true, false), 0o644)
        .unwrap();
    let ino = fs.lookup(ROOT_INO, "a.meta.json").unwrap().ino;
    fs.write(ino, o.fh, 0, br#"{"dtype":"f32","shape":[2]}"#)
        .unwrap();
    assert_eq!(errno(fs.flush(o.fh)), libc::EINVAL, "close reports it");
    let _ = fs.release(o.fh);
    assert_eq!(cat(&fs, "a.meta.json"), br#"{"dtype":"f32","shape":[2]}"#);
    let (status, refused) = {
        let r = fs.status();
        (r.text(), r.refused)
    };
    assert!(
        refused && status.contains("unknown dtype \"f32\""),
        "{status}"
    );
    let e = fs.commit(Default::default(), 0).unwrap_err();
    assert_eq!(e.to_errno(), libc::EINVAL);
    assert!(e.to_string().contains("tensor \"a\""), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn discard_keeps_the_inodes_of_unedited_tensors() {
    let (_dir, _path, fs) = small();
    let a = fs.lookup(ROOT_INO, "a").unwrap().ino;
    let b = fs.lookup(ROOT_INO, "b").unwrap().ino;
    fs.rename(ROOT_INO, "a", ROOT_INO, "c", false).unwrap();
    write_file(&fs, "b", b"new");
    fs.discard(0).unwrap();
    assert_eq!(
        fs.lookup(ROOT_INO, "a").unwrap().ino,
        a,
        "unedited bytes keep their inode"
    );
    assert_ne!(
        fs.lookup(ROOT_INO, "b").unwrap().ino,
        b,
        "edited bytes get a fresh one"
    );
    assert_eq!(errno(fs.lookup(ROOT_INO, "c")), libc::ENOENT);
    assert_eq!(cat(&fs, "b").len(), 3);
    assert!(!fs.is_dirty());
}

#[test]
fn only_the_owner_and_root_commit() {
    let (_dir, _path, fs) = small();
    write_file(&fs, "b", b"xyz");
    let stranger = fs.settings().owner + 4242;
    assert_eq!(errno(fs.commit(Default::default(), stranger)), libc::EACCES);
    assert_eq!(errno(fs.discard(stranger)), libc::EACCES);
    fs.commit(Default::default(), 0).unwrap();
}

#[test]
fn a_tainted_mount_does_not_commit() {
    let (_dir, path, fs) = small();
    write_file(&fs, "b", b"xyz");
    fs.taint("a test".into());
    assert_eq!(errno(fs.commit(Default::default(), 0)), libc::EIO);
    let before = std::fs::read(&path).unwrap();
    assert!(fs.unmount().is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn a_meta_descriptor_does_not_write_another_names_meta() {
    let (_dir, _path, fs) = small();
    let ino = fs.lookup(ROOT_INO, "a.meta.json").unwrap().ino;
    let o = fs.open(ino, true, true).unwrap();
    // The meta goes with the data; the descriptor's file stays at the old name.
    fs.rename(ROOT_INO, "a", ROOT_INO, "z", false).unwrap();
    fs.write(ino, o.fh, 0, br#"{"dtype":"U8","shape":[1]}"#)
        .unwrap();
    fs.flush(o.fh).unwrap();
    let _ = fs.release(o.fh);
    assert_eq!(
        errno(fs.lookup(ROOT_INO, "a")),
        libc::ENOENT,
        "no tensor appears under the old name"
    );
    assert!(
        String::from_utf8(cat(&fs, "z.meta.json"))
            .unwrap()
            .contains("\"F32\"")
    );
    assert!(
        String::from_utf8(cat(&fs, "a.meta.json"))
            .unwrap()
            .contains("\"U8\"")
    );
    // Unlinked, the descriptor's writes stay with it.
    let o = fs.open(ino, true, false).unwrap();
    fs.unlink(ROOT_INO, "a.meta.json").unwrap();
    fs.write(ino, o.fh, 0, b"[]").unwrap();
    fs.flush(o.fh).unwrap();
    assert_eq!(fs.getattr(ino, None).unwrap().nlink, 0);
    let _ = fs.release(o.fh);
    assert_eq!(errno(fs.lookup(ROOT_INO, "a.meta.json")), libc::ENOENT);
    // ftruncate through such a descriptor answers from the descriptor.
    let ino = fs.lookup(ROOT_INO, "z.meta.json").unwrap().ino;
    let o = fs.open(ino, true, false).unwrap();
    fs.unlink(ROOT_INO, "z.meta.json").unwrap();
    assert_eq!(fs.set_size(ino, Some(o.fh), 0).unwrap().size, 0);
    let _ = fs.release(o.fh);
}

#[test]
fn no_tensor_is_named_metadata() {
    let (_dir, _path, fs) = small();
    assert_eq!(
        errno(fs.create(ROOT_INO, "__metadata__", (true, false), 0o644)),
        libc::EINVAL
    );
    assert_eq!(
        errno(fs.rename(ROOT_INO, "a", ROOT_INO, "__metadata__", false)),
        libc::EINVAL
    );
    // A meta alone makes no data file: a commit drops it.
    write_file(
        &fs,
        "__metadata__.meta.json",
        br#"{"dtype":"U8","shape":[1]}"#,
    );
    assert_eq!(errno(fs.lookup(ROOT_INO, "__metadata__")), libc::ENOENT);
    fs.commit(Default::default(), 0).unwrap();
    assert_eq!(
        errno(fs.lookup(ROOT_INO, "__metadata__.meta.json")),
        libc::ENOENT
    );
}

#[test]
fn hashed_long_names_are_found_and_forgotten_as_names_change() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let long = "w".repeat(300);
    let other = format!("{}x", "v".repeat(299));
    write_checkpoint(
        &path,
        &[(&long, Dtype::U8, &[2]), (&other, Dtype::U8, &[1])],
        None,
    );
    let fs = mount(&path, settings());
    let stem = names::tensor_file_name(&long);
    assert!(names::is_hashed(&long) && stem.len() <= NAME_MAX);
    let ino = fs.lookup(ROOT_INO, &stem).unwrap().ino;
    assert!(fs.lookup(ROOT_INO, &format!("{stem}.meta.json")).is_ok());
    assert_eq!(
        errno(fs.lookup(ROOT_INO, "w~0000000000000000")),
        libc::ENOENT
    );
    // Renamed to a short name: the hashed one is gone at once, the short one is there.
    fs.rename(ROOT_INO, &stem, ROOT_INO, "short", false)
        .unwrap();
    assert_eq!(errno(fs.lookup(ROOT_INO, &stem)), libc::ENOENT);
    assert_eq!(fs.lookup(ROOT_INO, "short").unwrap().ino, ino);
    // The other long name is still found through the table made again.
    let other_stem = names::tensor_file_name(&other);
    assert!(fs.lookup(ROOT_INO, &other_stem).is_ok());
    fs.unlink(ROOT_INO, &other_stem).unwrap();
    assert_eq!(errno(fs.lookup(ROOT_INO, &other_stem)), libc::ENOENT);
}

#[test]
fn a_view_that_is_the_source_file_has_an_inode_of_its_own_until_an_edit() {
    let (_dir, path, fs) = small();
    let source = std::fs::read(&path).unwrap();
    let views = fs.lookup(ROOT_INO, VIEWS_DIR).unwrap();
    let generated = fs.lookup(views.ino, "model.safetensors").unwrap().ino;
    // Passthrough off (a daemon without CAP_SYS_ADMIN): the generated view.
    assert!(
        fs.open(generated, false, false)
            .unwrap()
            .passthrough
            .is_none()
    );
    fs.set_passthrough(true);
    let whole = fs.lookup(views.ino, "model.safetensors").unwrap();
    assert_ne!(whole.ino, generated);
    assert_eq!(whole.size, source.len() as u64);
    let opened = fs.open(whole.ino, false, false).unwrap();
    assert!(opened.passthrough.is_some());
    assert_eq!(errno(fs.open(whole.ino, true, false)), libc::EROFS);
    // An edit: the name is the generated view again; the old inode is stale
    // for new opens (the kernel looks the name up again), while its open
    // descriptor keeps its size and bytes.
    write_file(&fs, METADATA_FILE, br#"{"k": "v"}"#);
    assert_eq!(
        fs.lookup(views.ino, "model.safetensors").unwrap().ino,
        generated
    );
    // (An open that raced the edit gets the file its lookup saw.)
    let raced = fs.open(whole.ino, false, false).unwrap();
    assert!(raced.passthrough.is_some());
    fs.release(raced.fh).unwrap();
    assert_eq!(
        fs.getattr(whole.ino, Some(opened.fh)).unwrap().size,
        source.len() as u64
    );
    let got = fs
        .read(whole.ino, opened.fh, 0, 1 << 20, |b| b.concat())
        .unwrap();
    assert_eq!(got, source);
    fs.release(opened.fh).unwrap();
    // Once committed, the file is another: the old inode opens no more.
    fs.commit(Default::default(), 0).unwrap();
    assert_eq!(errno(fs.open(whole.ino, false, false)), libc::ESTALE);
}

/// Two in-place commits in one mount, the first growing the header by
/// blocks inserted at the file's start: the second finds the tensors where
/// they are now (the mapping's shift), not where the mount first saw them.
#[test]
fn a_second_in_place_commit_after_an_insertion_writes_where_the_bytes_are() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let contents = write_checkpoint(
        &path,
        &[("a", Dtype::F32, &[2]), ("b", Dtype::U8, &[3])],
        None,
    );
    let probe = std::fs::File::open(&path).unwrap();
    if crate::source::local::inserts_blocks(&probe).is_none() {
        eprintln!("skipped: this filesystem cannot insert blocks (ext4 and XFS can)");
        return;
    }
    drop(probe);
    let source = SourceFile::open_with(&path, true).unwrap();
    let fs = Fs::new(Source::File(source), settings(), staging_beside(&path));
    let put = |name: &str, data: &[u8], truncate: bool| {
        let a = fs.lookup(ROOT_INO, name).unwrap();
        let o = fs.open(a.ino, true, truncate).unwrap();
        fs.write(a.ino, o.fh, 0, data).unwrap();
        fs.flush(o.fh).unwrap();
        fs.release(o.fh).unwrap();
    };
    let long = format!(r#"{{"note":"{}"}}"#, "x".repeat(9000));
    put("__metadata__.json", long.as_bytes(), true);
    let lines = fs.commit(Default::default(), 0).unwrap();
    assert!(lines[0].contains("header grown by"), "{lines:?}");
    put("a", &[9; 8], false);
    let lines = fs.commit(Default::default(), 0).unwrap();
    assert!(lines[0].contains("committed in place"), "{lines:?}");
    let bytes = std::fs::read(&path).unwrap();
    let h = crate::format::Header::parse(&bytes).unwrap();
    let at = |name: &str| {
        let t = h.get(name).unwrap();
        let d = h.data_start() as usize;
        bytes[d + t.data_offsets.0 as usize..d + t.data_offsets.1 as usize].to_vec()
    };
    assert_eq!(at("a"), [9; 8]);
    assert_eq!(at("b"), contents[1]);
    assert_eq!(
        h.metadata
            .as_ref()
            .and_then(|m| m.get("note"))
            .map(String::len),
        Some(9000)
    );
}

#[test]
fn two_descriptors_of_a_gone_meta_each_stat_their_own_file_and_a_stat_by_inode_is_stable() {
    let (_dir, _path, fs) = small();
    let ino = fs.lookup(ROOT_INO, "a.meta.json").unwrap().ino;
    let first = fs.open(ino, true, false).unwrap();
    let len = fs.getattr(ino, Some(first.fh)).unwrap().size;
    assert!(len > 0);
    // The data file goes: the meta's text changes (no offsets), so a second
    // open gets a file of its own, which it truncates.
    fs.unlink(ROOT_INO, "a").unwrap();
    let second = fs.open(ino, true, true).unwrap();
    fs.commit(Default::default(), 0).unwrap();
    assert_eq!(errno(fs.lookup(ROOT_INO, "a.meta.json")), libc::ENOENT);
    // fstat: each descriptor its own file.
    assert_eq!(fs.getattr(ino, Some(first.fh)).unwrap().size, len);
    assert_eq!(fs.getattr(ino, Some(second.fh)).unwrap().size, 0);
    // Without a descriptor, always the file a new open got last.
    for _ in 0..20 {
        assert_eq!(fs.getattr(ino, None).unwrap().size, 0);
    }
    let _ = fs.release(first.fh);
    let _ = fs.release(second.fh);
}
