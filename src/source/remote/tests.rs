use super::*;
use crate::format::{Dtype, TensorSpec, layout};

#[test]
fn chunks_follow_tensor_boundaries() {
    let specs: Vec<TensorSpec> = [(1u64 << 10), 3 << 20, 20 << 20, 10, 6 << 20, 5 << 20]
        .iter()
        .enumerate()
        .map(|(i, &n)| TensorSpec {
            name: format!("t{i}"),
            dtype: Dtype::U8,
            shape: vec![n],
        })
        .collect();
    let l = layout(&specs, None).unwrap();
    let mut bytes = l.header.clone();
    bytes.resize(l.file_len() as usize, 0);
    let h = Header::parse(&bytes).unwrap();
    let starts = chunk_starts(&h);
    let base = h.data_start();
    // Every tensor starts on a chunk boundary, or inside a chunk of small ones.
    for w in starts.windows(2) {
        assert!(w[1] - w[0] <= CHUNK, "{starts:?}");
    }
    let big = h.get("t2").unwrap();
    assert!(starts.contains(&(base + big.data_offsets.0)));
    assert!(starts.contains(&(base + big.data_offsets.1)));
    assert_eq!(*starts.last().unwrap(), base + h.data_len());
}

#[test]
fn a_cache_folder_with_what_stfs_did_not_make_moves_to_a_private_one() {
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("c");
    std::fs::create_dir(&c).unwrap();
    // A folder under the key's name (planted while the folder was open
    // to others, it survives the emptying): the mount still works.
    std::fs::create_dir(c.join(KEY_FILE)).unwrap();
    std::fs::write(c.join(KEY_FILE).join("x"), b"planted").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&c, std::fs::Permissions::from_mode(0o700)).unwrap();
    let cache = Arc::new(DiskCache::open(&c, 1000).unwrap());
    cache.put("a.0.chunk", &[1u8; 40]).unwrap();
    assert!(c.join("private.0").join("a.0.chunk").exists());
    assert!(
        c.join(KEY_FILE).join("x").exists(),
        "what it did not make is left alone"
    );
    // The next mount finds the same private folder and what is cached there.
    let again = DiskCache::open(&c, 1000).unwrap();
    assert!(again.get("a.0.chunk", 0..40).is_some());
    // A clean folder stays where it is.
    let clean = dir.path().join("d");
    Arc::new(DiskCache::open(&clean, 1000).unwrap())
        .put("b.0.chunk", &[2u8; 8])
        .unwrap();
    assert!(clean.join("b.0.chunk").exists());
}

#[test]
fn the_cache_checks_what_it_serves_and_evicts() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Arc::new(DiskCache::open(&dir.path().join("c"), 100).unwrap());
    cache.put("a.0.chunk", &[1u8; 40]).unwrap();
    assert!(cache.get("a.0.chunk", 0..40).is_some());
    cache.put("b.0.chunk", &[2u8; 40]).unwrap();
    cache.put("c.0.chunk", &[3u8; 40]).unwrap(); // 3 x 56 > 100: a goes
    assert!(!dir.path().join("c/a.0.chunk").exists());
    assert!(cache.get("c.0.chunk", 0..40).is_some());
    // A damaged file is refused (and removed) by a process that has not checked it yet.
    let other = DiskCache::open(&dir.path().join("c"), 1000).unwrap();
    let path = dir.path().join("c/c.0.chunk");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[3] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    assert!(other.get("c.0.chunk", 0..40).is_none());
    assert!(!path.exists());
    std::fs::write(dir.path().join("c/b.0.chunk"), [2u8; 10]).unwrap(); // truncated
    assert!(other.get("b.0.chunk", 0..40).is_none());
    // A write that does not finish leaves nothing behind; an abandoned
    // one gives back what it wrote.
    let other = Arc::new(other);
    let mut w = other.begin("d.0.chunk").unwrap();
    w.write(b"half").unwrap();
    drop(w);
    let mut w = other.begin("e.0.chunk").unwrap();
    w.write(b"some bytes").unwrap();
    let e = std::io::Error::from_raw_os_error(libc::ENOSPC);
    assert_eq!(w.abandon(&e).unwrap(), b"some bytes");
    assert!(!writer_gone("x.0.chunk"));
    assert!(!writer_gone(&format!(
        "x.0.chunk.tmp.{}.1",
        std::process::id()
    )));
    assert!(writer_gone("x.0.chunk.tmp.999999999.1"));
    let left: Vec<_> = std::fs::read_dir(dir.path().join("c"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains(".tmp."))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn urls_of_every_store_parse() {
    let dir = tempfile::tempdir().unwrap();
    let opts = RemoteOptions {
        endpoint: None,
        cache_dir: dir.path().join("cache"),
        cache_size: 1 << 20,
        concurrency: 2,
        timeout: Duration::from_secs(1),
    };
    for (url, path, folder) in [
        (
            "s3://bucket/a/model.safetensors",
            "a/model.safetensors",
            false,
        ),
        ("s3://bucket/prefix/", "prefix", true),
        ("gs://bucket/m.safetensors", "m.safetensors", false),
        ("az://container/m.safetensors", "m.safetensors", false),
        (
            "https://example.com/x/m.safetensors",
            "x/m.safetensors",
            false,
        ),
    ] {
        match Remote::connect(url, &opts) {
            Ok(l) => {
                assert_eq!((l.path.as_ref(), l.folder), (path, folder), "{url}");
            }
            // Azure and GCS builders want an account or credentials.
            Err(e) => assert!(
                url.starts_with("az://") || url.starts_with("gs://"),
                "{url}: {e}"
            ),
        }
    }
    assert!(Remote::connect("ftp://x/y", &opts).is_err());
}
