use std::path::Path;

use super::*;
use crate::format::{layout, Dtype, Metadata, TensorSpec};

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
    Settings {
        read_only: false,
        uid: 1000,
        gid: 100,
        staging_dir: None,
        resume: None,
    }
}

fn read_all(fs: &Fs, ino: Ino) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let chunk = fs
            .read(ino, 0, out.len() as u64, 7, |b| b.to_vec())
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
    let fs = Fs::new(Source::File(Checkpoint::open(&path).unwrap()), settings());

    let listing = list(&fs, ROOT_INO);
    assert_eq!(listing.len(), 2 + 1 + 2 * names.len());
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
        assert_eq!(
            (a.kind, a.size, a.perm, a.uid, a.gid),
            (Kind::File, want.len() as u64, 0o644, 1000, 100)
        );
        assert_eq!(&read_all(&fs, a.ino), want, "{name:?}");
        let m = fs
            .lookup(ROOT_INO, &format!("{file}{META_SUFFIX}"))
            .unwrap();
        let meta: serde_json::Value = serde_json::from_slice(&read_all(&fs, m.ino)).unwrap();
        assert_eq!(meta["name"], *name);
        assert_eq!(meta["nbytes"], want.len());
        assert_eq!(m.size as usize, read_all(&fs, m.ino).len());
        let o = fs.open(a.ino, false, false).unwrap();
        assert!(o.keep_cache && !o.direct_io);
    }
    let md = fs.lookup(ROOT_INO, "__metadata__.json").unwrap();
    assert_eq!(read_all(&fs, md.ino), b"{\"k\":\"v\"}\n");

    // Reads past the end and at odd offsets.
    let w = fs.lookup(ROOT_INO, "w").unwrap();
    assert_eq!(
        fs.read(w.ino, 0, 20, 100, |b| b.to_vec()).unwrap(),
        contents[0][20..]
    );
    assert!(fs.read(w.ino, 0, 1000, 100, |b| b.len()).unwrap() == 0);

    for bad in ["nope", "w.meta", "%2f", "W", "a/b"] {
        assert_eq!(fs.lookup(ROOT_INO, bad), Err(FsError::NotFound), "{bad}");
    }
    assert_eq!(fs.lookup(w.ino, "x"), Err(FsError::NotADirectory));
    assert_eq!(
        fs.lookup(ROOT_INO, &"n".repeat(256)),
        Err(FsError::NameTooLong)
    );
    assert_eq!(fs.getattr(999_999), Err(FsError::NotFound));
    assert_eq!(fs.open(ROOT_INO, false, false), Err(FsError::IsADirectory));
    assert_eq!(fs.getattr(ROOT_INO).unwrap().perm, 0o755);
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
    let fs = Fs::new(Source::File(Checkpoint::open(&path).unwrap()), settings());
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
    let source = Source::Folder {
        checkpoints: vec![
            (
                "s1".into(),
                Checkpoint::open(&dir.path().join("s1.safetensors")).unwrap(),
            ),
            (
                "s2".into(),
                Checkpoint::open(&dir.path().join("s2.safetensors")).unwrap(),
            ),
        ],
        indexes: vec![("m.index.json".into(), b"{}".to_vec())],
    };
    let fs = Fs::new(
        source,
        Settings {
            read_only: true,
            uid: 0,
            gid: 0,
            staging_dir: None,
            resume: None,
        },
    );
    assert_eq!(list(&fs, ROOT_INO), [".", "..", "s1", "s2", "m.index.json"]);
    let s2 = fs.lookup(ROOT_INO, "s2").unwrap();
    assert_eq!(s2.kind, Kind::Directory);
    let a = fs.lookup(s2.ino, "a").unwrap();
    assert_eq!((a.size, a.perm), (3, 0o444));
    assert_eq!(fs.open(a.ino, true, false), Err(FsError::ReadOnly));
    assert_ne!(
        a.ino,
        fs.lookup(fs.lookup(ROOT_INO, "s1").unwrap().ino, "a")
            .unwrap()
            .ino
    );
    let ix = fs.lookup(ROOT_INO, "m.index.json").unwrap();
    assert_eq!(read_all(&fs, ix.ino), b"{}");
    assert_eq!(fs.readdir(a.ino, 0, |_| false), Err(FsError::NotADirectory));
}
