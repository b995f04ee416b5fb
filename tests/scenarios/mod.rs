//! An edit's whole life as a list of steps (mount, edits each made durable
//! by its `close`, commits, a discard, an unmount, the next mount), driven
//! through `Fs` in process: the crash explorer (`crash_explorer.rs`) and the
//! fault runner (`fault_runner.rs`) run the same scenarios, one crashing at
//! every point, the other failing every file operation.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use stfs::checkpoint::commit::CommitOptions;
use stfs::checkpoint::recover::Resume;
use stfs::fs::{Fs, Ino, ROOT_INO, Settings};

pub const INDEX: &str = "model.safetensors.index.json";

pub type Tensor<'a> = (&'a str, safetensors::Dtype, Vec<usize>, Vec<u8>);

pub fn floats(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A 1-D F32 tensor of these values.
pub fn f32_tensor(name: &'static str, values: &[f32]) -> Tensor<'static> {
    (
        name,
        safetensors::Dtype::F32,
        vec![values.len()],
        floats(values),
    )
}

pub fn write_checkpoint(
    path: &Path,
    tensors: &[Tensor],
    metadata: Option<HashMap<String, String>>,
) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, metadata).unwrap()).unwrap();
}

/// One file `s0.safetensors`: a [4], b [2], c [3] (F32), metadata format=pt.
pub fn make_one(dir: &Path) {
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    write_checkpoint(
        &dir.join("s0.safetensors"),
        &[
            f32_tensor("a", &[1., 2., 3., 4.]),
            f32_tensor("b", &[5., 6.]),
            f32_tensor("c", &[7., 8., 9.]),
        ],
        Some(meta),
    );
}

/// A folder: `s0` (a, b), `s1` (c, d, e) and their index.
pub fn make_folder(dir: &Path) {
    write_checkpoint(
        &dir.join("s0.safetensors"),
        &[
            f32_tensor("a", &[1., 2., 3., 4.]),
            f32_tensor("b", &[5., 6.]),
        ],
        None,
    );
    write_checkpoint(
        &dir.join("s1.safetensors"),
        &[
            f32_tensor("c", &[7., 8., 9.]),
            f32_tensor("d", &[10.]),
            f32_tensor("e", &[11., 12.]),
        ],
        None,
    );
    let index = json!({
        "metadata": {"total_size": 48},
        "weight_map": {"a": "s0.safetensors", "b": "s0.safetensors", "c": "s1.safetensors",
                       "d": "s1.safetensors", "e": "s1.safetensors"}
    });
    std::fs::write(dir.join(INDEX), serde_json::to_vec_pretty(&index).unwrap()).unwrap();
}

/// A model folder: `make_folder`'s shards and index, and the other files
/// of a model (`config.json`, `README.md`).
pub fn make_model_folder(dir: &Path) {
    make_folder(dir);
    std::fs::write(dir.join("config.json"), b"{\"torch_dtype\": \"float32\"}\n").unwrap();
    std::fs::write(dir.join("README.md"), b"# tiny\n").unwrap();
}

/// The model files the folder scenarios make, edit, add or remove.
pub const MODEL_FILES: [&str; 3] = ["config.json", "README.md", "notes.txt"];

/// What a target that is not there reads as (not an empty file).
pub const ABSENT: &[u8] = b"\0(absent)";

/// One GGUF file `s0.gguf` (version 3, alignment 32): keys
/// general.architecture and general.name (strings), x.count (UINT32 7);
/// tensors a [4], b [2], c [3] (F32), written here after ggml's layout.
pub fn make_gguf(dir: &Path) {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    let tensors = [
        ("a", floats(&[1., 2., 3., 4.])),
        ("b", floats(&[5., 6.])),
        ("c", floats(&[7., 8., 9.])),
    ];
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend(3u64.to_le_bytes());
    for (key, value) in [("general.architecture", "llama"), ("general.name", "s0")] {
        string(&mut out, key);
        out.extend(8u32.to_le_bytes()); // STRING
        string(&mut out, value);
    }
    string(&mut out, "x.count");
    out.extend(4u32.to_le_bytes()); // UINT32
    out.extend(7u32.to_le_bytes());
    let mut offset = 0u64;
    for (name, data) in &tensors {
        string(&mut out, name);
        out.extend(1u32.to_le_bytes()); // one dimension
        out.extend((data.len() as u64 / 4).to_le_bytes());
        out.extend(0u32.to_le_bytes()); // F32
        out.extend(offset.to_le_bytes());
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    for (_, data) in &tensors {
        out.resize(out.len().div_ceil(32) * 32, 0);
        out.extend(data);
    }
    std::fs::write(dir.join("s0.gguf"), out).unwrap();
}

pub fn uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// A mount in process: its folder (`root/src`), and the filesystem once mounted.
pub struct Mount {
    pub root: PathBuf,
    pub folder: bool,
    pub fs: Option<Fs>,
    /// What the commits said, a line per file.
    pub said: std::cell::RefCell<Vec<String>>,
}

fn failed(what: &str) -> impl Fn(stfs::fs::FsError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

impl Mount {
    pub fn new(root: &Path, folder: bool) -> Mount {
        Mount {
            root: root.to_path_buf(),
            folder,
            fs: None,
            said: Default::default(),
        }
    }

    /// What is mounted: the folder, or its one file.
    pub fn source(&self) -> PathBuf {
        let src = self.root.join("src");
        match targets_in(&src, self.folder) {
            _ if self.folder => src,
            one => src.join(one[0]),
        }
    }

    /// Mounts as the daemon does (recovery first); the notes it gives.
    pub fn mount(&mut self) -> Result<Vec<String>, String> {
        let (fs, notes) =
            stfs::daemon::open_local(&self.source(), None, Settings::default(), &Resume::Auto)
                .map_err(|e| format!("mount: {e}"))?;
        self.fs = Some(fs);
        Ok(notes)
    }

    pub fn fs(&self) -> Result<&Fs, String> {
        self.fs.as_ref().ok_or_else(|| "not mounted".to_string())
    }

    /// As `kill -9` leaves it: no commit, the staging folder kept.
    pub fn kill(&mut self) {
        if let Some(fs) = self.fs.take() {
            if let Some(dir) = fs.staging().current() {
                dir.keep_files(true);
            }
            drop(fs);
        }
        // (As a daemon's exit does: what its commits let go of is gone.)
        stfs::checkpoint::commit::wait_let_go();
    }

    /// The inode of `path` ("a", or "s1/c" in a folder mount).
    pub fn ino(&self, path: &str) -> Result<Ino, String> {
        let fs = self.fs()?;
        let mut ino = ROOT_INO;
        for part in path.split('/') {
            ino = fs.lookup(ino, part).map_err(failed(path))?.ino;
        }
        Ok(ino)
    }

    /// The folder and name of `path`.
    fn parent_of<'p>(&self, path: &'p str) -> Result<(Ino, &'p str), String> {
        match path.rsplit_once('/') {
            Some((dir, name)) => Ok((self.ino(dir)?, name)),
            None => Ok((ROOT_INO, path)),
        }
    }

    /// Writes `data` at `offset` of an existing file (truncated first if
    /// `truncate`), then closes it: the edit is acknowledged.
    pub fn write(
        &self,
        path: &str,
        offset: u64,
        data: &[u8],
        truncate: bool,
    ) -> Result<(), String> {
        let fs = self.fs()?;
        let ino = self.ino(path)?;
        let o = fs.open(ino, true, truncate).map_err(failed(path))?;
        let wrote = fs.write(ino, o.fh, offset, data).map_err(failed(path));
        let closed = fs.release(o.fh).map_err(failed(path));
        match wrote? as usize == data.len() {
            true => closed,
            false => Err(format!("{path}: a short write")),
        }
    }

    /// Writes `data` at `offset` and leaves the descriptor open (not
    /// closed, not synced: a writer still at work).
    pub fn write_open(&self, path: &str, offset: u64, data: &[u8]) -> Result<(), String> {
        let fs = self.fs()?;
        let ino = self.ino(path)?;
        let o = fs.open(ino, true, false).map_err(failed(path))?;
        fs.write(ino, o.fh, offset, data).map_err(failed(path))?;
        Ok(())
    }

    /// Makes a new file and writes `data` into it, then closes it; on
    /// failure removes it, as a careful tool does.
    pub fn create(&self, path: &str, data: &[u8]) -> Result<(), String> {
        let fs = self.fs()?;
        let (parent, name) = self.parent_of(path)?;
        let (attr, o) = fs
            .create(parent, name, (true, false), 0o644)
            .map_err(failed(path))?;
        let wrote = fs.write(attr.ino, o.fh, 0, data).map_err(failed(path));
        let closed = fs.release(o.fh).map_err(failed(path));
        let done = wrote.and(closed);
        if done.is_err() {
            let _ = fs.unlink(parent, name);
        }
        done
    }

    /// A new tensor: its meta, then its bytes (as `cp x.meta.json` then `cp x` do).
    pub fn add_tensor(
        &self,
        path: &str,
        dtype: &str,
        shape: &[u64],
        data: &[u8],
    ) -> Result<(), String> {
        let meta = json!({"dtype": dtype, "shape": shape}).to_string();
        self.create(&format!("{path}.meta.json"), meta.as_bytes())?;
        self.create(path, data)
    }

    /// `mv`, then an fsync of the folder (a rename is durable from then
    /// on, as on any filesystem).
    pub fn rename(&self, from: &str, to: &str) -> Result<(), String> {
        let fs = self.fs()?;
        let (p, a) = self.parent_of(from)?;
        let (q, b) = self.parent_of(to)?;
        fs.rename(p, a, q, b, false).map_err(failed(from))?;
        fs.fsync(None).map_err(failed("fsync of the folder"))
    }

    /// `rm`, then an fsync of the folder.
    pub fn unlink(&self, path: &str) -> Result<(), String> {
        let fs = self.fs()?;
        let (p, name) = self.parent_of(path)?;
        fs.unlink(p, name).map_err(failed(path))?;
        fs.fsync(None).map_err(failed("fsync of the folder"))
    }

    /// As `sed -i` writes a file: a temp file beside it, renamed over it.
    pub fn replace(&self, path: &str, text: &[u8]) -> Result<(), String> {
        let tmp = match path.rsplit_once('/') {
            Some((dir, _)) => format!("{dir}/sedXYZ"),
            None => "sedXYZ".to_string(),
        };
        self.create(&tmp, text)?;
        self.rename(&tmp, path).inspect_err(|_| {
            let _ = self.unlink(&tmp);
        })
    }

    pub fn commit(&self) -> Result<Vec<String>, String> {
        let lines = self
            .fs()?
            .commit(CommitOptions::default(), uid())
            .map_err(|e| format!("commit: {e}"))?;
        self.said.borrow_mut().extend(lines.iter().cloned());
        Ok(lines)
    }

    pub fn discard(&self) -> Result<(), String> {
        self.fs()?
            .discard(uid())
            .map(|_| ())
            .map_err(|e| format!("discard: {e}"))
    }

    /// `stfs umount`: commits, and unmounts only if that worked.
    pub fn unmount(&mut self) -> Result<(), String> {
        let done = self.fs()?.unmount().map_err(|e| format!("unmount: {e}"));
        if done.is_ok() {
            drop(self.fs.take());
            stfs::checkpoint::commit::wait_let_go();
        }
        done
    }

    /// The bytes of every file a commit writes.
    pub fn targets_now(&self) -> Vec<(String, Vec<u8>)> {
        let src = self.root.join("src");
        targets_in(&src, self.folder)
            .into_iter()
            .map(|t| {
                let bytes = match std::fs::read(src.join(t)) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => ABSENT.to_vec(),
                    read => read.unwrap_or_default(),
                };
                (t.to_string(), bytes)
            })
            .collect()
    }

    /// Temp files of commits left in the source's folder.
    pub fn temps_left(&self) -> Vec<String> {
        std::fs::read_dir(self.root.join("src"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".stfs-tmp-") || n.contains(".stfs-kept-"))
            .collect()
    }
}

/// What a step does to the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Mount,
    /// An edit: acknowledged once it returns (each closes what it wrote).
    Edit,
    /// An edit left unsynced (written, its descriptor still open): durable
    /// only once a commit that holds it landed.
    Unsynced,
    Commit,
    Discard,
    /// `stfs umount`: a commit, then the mount goes.
    Unmount,
}

pub struct Step {
    pub what: &'static str,
    pub kind: StepKind,
    pub run: fn(&mut Mount) -> Result<(), String>,
}

pub const MOUNT: Step = Step {
    what: "mount",
    kind: StepKind::Mount,
    run: |m| m.mount().map(|_| ()),
};

/// An edit several scenarios make.
const OVERWRITE_A: Step = edit("overwrite a", |m| {
    m.write("a", 0, &floats(&[-1., -2., -3., -4.]), false)
});

/// An edit several scenarios make.
const ADD_D: Step = edit("add d", |m| {
    m.add_tensor("d", "F32", &[2], &floats(&[13., 14.]))
});

/// An edit several scenarios make.
const RM_S1_D: Step = edit("rm s1/d", |m| m.unlink("s1/d"));

/// An edit several scenarios make.
const MV_B_Y: Step = edit("mv b y", |m| m.rename("b", "y"));

pub const COMMIT: Step = Step {
    what: "commit",
    kind: StepKind::Commit,
    run: |m| m.commit().map(|_| ()),
};

/// A commit during which (its files written, not yet landed) another
/// program renames `b` to `y` and fsyncs the folder: staged for the next
/// commit, on top of this one's file.
pub const COMMIT_WITH_A_RENAME: Step = Step {
    what: "commit, with mv b y while it writes",
    kind: StepKind::Commit,
    run: |m| {
        // Done again after a crash that came once the rename was acknowledged
        // (its fsync had returned): it must have survived, not be made again.
        let acked = m.root.join("log/rename-acked");
        if acked.exists() {
            if m.ino("y").is_err() || m.ino("b").is_ok() {
                return Err(
                    "another program's mv b y, fsynced while a commit wrote, was lost".into(),
                );
            }
            return m.commit().map(|_| ());
        }
        struct Shared(*const Fs);
        // SAFETY: the hook runs on the commit's own thread, while `m`'s
        // filesystem lives (it is taken away before the commit returns).
        unsafe impl Send for Shared {}
        // SAFETY: as above.
        unsafe impl Sync for Shared {}
        impl Shared {
            fn fs(&self) -> &Fs {
                // SAFETY: see above.
                unsafe { &*self.0 }
            }
        }
        let fs = Shared(m.fs()?);
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let fired = done.clone();
        let theirs = std::sync::Arc::new(std::sync::Mutex::new(Ok(())));
        let said = theirs.clone();
        stfs::testpoint::set_point_hook(Some(Box::new(move |step| {
            if step == "commit:written" && !done.swap(true, std::sync::atomic::Ordering::SeqCst) {
                // (Another program's: a failure of its own is its, not the
                // commit's; the step fails too, and is done again.)
                let _theirs = stfs::testpoint::best_effort();
                let fs = fs.fs();
                let renamed = fs
                    .rename(ROOT_INO, "b", ROOT_INO, "y", false)
                    .and_then(|()| fs.fsync(None));
                if renamed.is_ok() {
                    let _ = std::fs::write(&acked, b"");
                }
                *said.lock().unwrap() =
                    renamed.map_err(|e| format!("another program's mv b y: {e}"));
            }
        })));
        let committed = m.commit().map(|_| ());
        stfs::testpoint::set_point_hook(None);
        // (Done again with nothing left to commit: the rename alone.)
        if committed.is_ok() && !fired.load(std::sync::atomic::Ordering::SeqCst) {
            return m.rename("b", "y");
        }
        committed.and(theirs.lock().unwrap().clone())
    },
};

pub const DISCARD: Step = Step {
    what: "discard",
    kind: StepKind::Discard,
    run: |m| m.discard(),
};

pub const UNMOUNT: Step = Step {
    what: "umount",
    kind: StepKind::Unmount,
    run: |m| m.unmount(),
};

pub struct Scenario {
    pub name: &'static str,
    pub folder: bool,
    pub make: fn(&Path),
    /// Done to the source before the steps (a commit a crash interrupted).
    pub setup: Option<fn(&Path)>,
    pub steps: &'static [Step],
    /// Each target's way, as the last commit says it ("in place", "by a rewrite").
    pub ways: &'static [(&'static str, &'static str)],
}

/// The files a commit of the scenario made in `src` writes (its one file
/// is `s0.gguf` where `make_gguf` made it).
pub fn targets_in(src: &Path, folder: bool) -> Vec<&'static str> {
    if folder {
        let mut all = vec!["s0.safetensors", "s1.safetensors", INDEX];
        all.extend(MODEL_FILES);
        all
    } else if src.join("s0.gguf").exists() {
        vec!["s0.gguf"]
    } else {
        vec!["s0.safetensors"]
    }
}

/// A fresh copy of the scenario's source in a new temporary folder.
pub fn fresh(sc: &Scenario) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("src")).unwrap();
    (sc.make)(&root.path().join("src"));
    root
}

/// Whether every reader (the reference's parser; for a file that starts
/// with GGUF's magic, ggml's rules as stfs reads them) refuses `bytes`.
pub fn refused(bytes: &[u8]) -> bool {
    match stfs::format::gguf::is_gguf(bytes) {
        true => stfs::format::gguf::parse(bytes).is_err(),
        false => safetensors::SafeTensors::deserialize(bytes).is_err(),
    }
}

/// The same GGUF file: keys (names, types, values, in order) and tensors
/// (names, types, dims, bytes, in order).
pub fn same_gguf(a: &[u8], b: &[u8]) -> Result<(), String> {
    use stfs::format::gguf::parse;
    let x = parse(a).map_err(|e| format!("refused: {e}"))?;
    let y = parse(b).map_err(|e| format!("the expected file is refused: {e}"))?;
    if x.kvs != y.kvs {
        return Err(format!("keys {:?}, not {:?}", x.kvs, y.kvs));
    }
    let tensors =
        |h: &stfs::format::gguf::GgufHeader, f: &[u8]| -> Vec<(String, Vec<u64>, u32, Vec<u8>)> {
            h.tensors
                .iter()
                .map(|t| {
                    let at = (h.data_start + t.offset) as usize;
                    let bytes = f[at..at + t.nbytes as usize].to_vec();
                    (t.name.clone(), t.ne.clone(), t.ggml_type.id, bytes)
                })
                .collect()
        };
    let (p, q) = (tensors(&x, a), tensors(&y, b));
    if p != q {
        return Err(format!("tensors {p:?}, not {q:?}"));
    }
    Ok(())
}

/// The same checkpoint: tensors (names, dtypes, shapes, bytes) and metadata.
pub fn same_checkpoint(a: &[u8], b: &[u8]) -> Result<(), String> {
    use safetensors::SafeTensors;
    let x = SafeTensors::deserialize(a).map_err(|e| format!("refused: {e:?}"))?;
    let y =
        SafeTensors::deserialize(b).map_err(|e| format!("the expected file is refused: {e:?}"))?;
    let mut names = x.names();
    let mut want = y.names();
    names.sort();
    want.sort();
    if names != want {
        return Err(format!("tensors {names:?}, not {want:?}"));
    }
    for n in want {
        let (p, q) = (x.tensor(n).unwrap(), y.tensor(n).unwrap());
        if (p.dtype(), p.shape(), p.data()) != (q.dtype(), q.shape(), q.data()) {
            return Err(format!("tensor {n} differs"));
        }
    }
    let meta = |f: &[u8]| SafeTensors::read_metadata(f).unwrap().1.metadata().clone();
    if meta(a) != meta(b) {
        return Err("metadata differs".into());
    }
    Ok(())
}

/// The same content for target `t`: an index as JSON, a checkpoint as
/// tensors and metadata.
pub fn same_target(t: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    if t.ends_with(".gguf") {
        return same_gguf(got, want).map_err(|e| format!("{t}: {e}"));
    }
    if MODEL_FILES.contains(&t) {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        return match got == want {
            true => Ok(()),
            false => Err(format!("{t}: {:?}, not {:?}", text(got), text(want))),
        };
    }
    if t == INDEX {
        let a: Value = serde_json::from_slice(got).map_err(|e| format!("{t}: {e}"))?;
        let b: Value = serde_json::from_slice(want).unwrap();
        return match a == b {
            true => Ok(()),
            false => Err(format!("{t}: {a}, not {b}")),
        };
    }
    same_checkpoint(got, want).map_err(|e| format!("{t}: {e}"))
}

/// Every target the same as in `want`.
pub fn same_targets(got: &[(String, Vec<u8>)], want: &[(String, Vec<u8>)]) -> Result<(), String> {
    for ((t, g), (_, w)) in got.iter().zip(want) {
        same_target(t, g, w)?;
    }
    Ok(())
}

/// Runs `f` in a forked child (the caller must have one thread) and
/// returns what it gave, as JSON through a file in `dir`; a child that
/// panicked or died gives an error.
pub fn in_child(dir: &Path, f: impl FnOnce() -> Value) -> Result<Value, String> {
    let out = dir.join("child-result.json");
    let _ = std::fs::remove_file(&out);
    // SAFETY: the caller runs one thread (harness = false).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(v) => {
                std::fs::write(&out, serde_json::to_vec(&v).unwrap()).unwrap();
                0
            }
            Err(_) => 101,
        };
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if !libc::WIFEXITED(status) {
        return Err(format!(
            "the child died of signal {}",
            libc::WTERMSIG(status)
        ));
    }
    match libc::WEXITSTATUS(status) {
        0 => Ok(
            serde_json::from_slice(&std::fs::read(&out).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?,
        ),
        code => Err(format!("the child panicked (exit {code})")),
    }
}

pub fn bytes_json(targets: &[(String, Vec<u8>)]) -> Value {
    Value::Array(
        targets
            .iter()
            .map(|(t, b)| json!([t, b.iter().map(|x| format!("{x:02x}")).collect::<String>()]))
            .collect(),
    )
}

pub fn bytes_of_json(v: &Value) -> Vec<(String, Vec<u8>)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let hex = p[1].as_str().unwrap();
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            (p[0].as_str().unwrap().to_string(), bytes)
        })
        .collect()
}

/// Runs `steps` in a forked child that is killed at testpoint `crash_at`
/// (`STFS_CRASH_AT`), as `kill -9` there would: what it leaves is the
/// start of a scenario of recovery.
pub fn crash_during(root: &Path, folder: bool, steps: &[Step], crash_at: &str) {
    // SAFETY: the caller runs one thread.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        // (Read once, by the first point this process reaches.)
        // SAFETY: one thread.
        unsafe { std::env::set_var("STFS_CRASH_AT", crash_at) };
        let mut m = Mount::new(root, folder);
        for step in steps {
            let _ = (step.run)(&mut m);
        }
        // SAFETY: not killed at the point: the caller sees exit 3.
        unsafe { libc::_exit(3) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
        "the commit was not killed at {crash_at}"
    );
}

const EDIT: StepKind = StepKind::Edit;

/// An edit through the mount, named as a person would say it.
const fn edit(what: &'static str, run: fn(&mut Mount) -> Result<(), String>) -> Step {
    Step {
        what,
        kind: EDIT,
        run,
    }
}

/// A scenario on one file (`make_one`), nothing done to it before.
const ONE_FILE: Scenario = Scenario {
    name: "",
    folder: false,
    make: make_one,
    setup: None,
    steps: &[],
    ways: &[],
};

/// A scenario on one GGUF file (`make_gguf`), nothing done to it before.
const ONE_GGUF: Scenario = Scenario {
    make: make_gguf,
    ..ONE_FILE
};

/// Every scenario, for both explorers.
pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "in place: a rename, a same-size overwrite, the metadata by sed -i",
        steps: &[
            MOUNT,
            edit("mv c z", |m| m.rename("c", "z")),
            OVERWRITE_A,
            edit("sed -i __metadata__.json", |m| {
                m.replace("__metadata__.json", br#"{"format":"pt","v":"2"}"#)
            }),
            COMMIT,
        ],
        ways: &[("s0.safetensors", "in place")],
        ..ONE_FILE
    },
    Scenario {
        name: "rewrite: a tensor dropped from the middle, a reshape",
        steps: &[
            MOUNT,
            edit("rm b", |m| m.unlink("b")),
            edit("reshape a", |m| {
                m.write("a.meta.json", 0, br#"{"dtype":"F32","shape":[2,2]}"#, true)
            }),
            COMMIT,
        ],
        ways: &[("s0.safetensors", "by a rewrite")],
        ..ONE_FILE
    },
    Scenario {
        name: "in place: a tensor appended, another written in part, one truncated and refilled",
        steps: &[
            MOUNT,
            ADD_D,
            edit("patch a", |m| m.write("a", 4, &floats(&[-2.]), false)),
            edit("rewrite c whole", |m| {
                m.write("c", 0, &floats(&[-7., -8., -9.]), true)
            }),
            COMMIT,
        ],
        ways: &[("s0.safetensors", "in place")],
        ..ONE_FILE
    },
    Scenario {
        name: "in place, the header grown by blocks inserted at the start",
        steps: &[
            MOUNT,
            edit("a long metadata value", |m| {
                let text = json!({"format": "pt", "note": "x".repeat(9000)}).to_string();
                m.write("__metadata__.json", 0, text.as_bytes(), true)
            }),
            COMMIT,
        ],
        ways: &[("s0.safetensors", "in place (header grown")],
        ..ONE_FILE
    },
    Scenario {
        name: "folder: one shard in place, one rewritten, the index",
        folder: true,
        make: make_folder,
        setup: None,
        steps: &[
            MOUNT,
            edit("mv s0/a s0/z", |m| m.rename("s0/a", "s0/z")),
            // (A hole the end cannot fill: e would straddle the new end.)
            RM_S1_D,
            edit("overwrite s1/c", |m| {
                m.write("s1/c", 0, &floats(&[-7., -8., -9.]), false)
            }),
            COMMIT,
        ],
        ways: &[
            ("s0.safetensors", "in place"),
            ("s1.safetensors", "by a rewrite"),
        ],
    },
    Scenario {
        name: "folder: a tensor moved to the other shard, then unmounted",
        folder: true,
        make: make_folder,
        setup: None,
        steps: &[
            MOUNT,
            edit("mv s0/b s1/b", |m| m.rename("s0/b", "s1/b")),
            UNMOUNT,
        ],
        ways: &[],
    },
    Scenario {
        name: "model folder: config.json by sed -i, a file removed, one made, a tensor renamed",
        folder: true,
        make: make_model_folder,
        setup: None,
        steps: &[
            MOUNT,
            edit("sed -i config.json", |m| {
                m.replace("config.json", b"{\"torch_dtype\": \"bfloat16\"}\n")
            }),
            edit("rm README.md", |m| m.unlink("README.md")),
            edit("echo new > notes.txt", |m| m.create("notes.txt", b"new\n")),
            edit("mv s0/a s0/z", |m| m.rename("s0/a", "s0/z")),
            COMMIT,
        ],
        ways: &[("s0.safetensors", "in place")],
    },
    Scenario {
        name: "model folder: a file moved over another, one written whole, then unmounted",
        folder: true,
        make: make_model_folder,
        setup: None,
        steps: &[
            MOUNT,
            edit("mv README.md notes.txt", |m| {
                m.rename("README.md", "notes.txt")
            }),
            edit("echo {} > config.json", |m| {
                m.write("config.json", 0, b"{}\n", true)
            }),
            UNMOUNT,
        ],
        ways: &[],
    },
    Scenario {
        name: "a rename made while a commit writes, taken back on the new file",
        steps: &[MOUNT, OVERWRITE_A, COMMIT_WITH_A_RENAME],
        ways: &[("s0.safetensors", "in place")],
        ..ONE_FILE
    },
    Scenario {
        name: "in place: a write not yet closed, committed",
        steps: &[
            MOUNT,
            Step {
                what: "write c, left open",
                kind: StepKind::Unsynced,
                run: |m| m.write_open("c", 0, &floats(&[-7., -8., -9.])),
            },
            COMMIT,
        ],
        ways: &[("s0.safetensors", "in place")],
        ..ONE_FILE
    },
    Scenario {
        name: "a discard, then an edit and an unmount",
        steps: &[
            MOUNT,
            edit("rm a", |m| m.unlink("a")),
            edit("patch c", |m| m.write("c", 0, &floats(&[0.5]), false)),
            DISCARD,
            MV_B_Y,
            UNMOUNT,
        ],
        ways: &[],
        ..ONE_FILE
    },
    Scenario {
        name: "GGUF in place: an overwrite, a rename, a key's value",
        steps: &[
            MOUNT,
            OVERWRITE_A,
            edit("mv c z", |m| m.rename("c", "z")),
            edit("echo s1 > __kv__/general.name", |m| {
                m.write("__kv__/general.name", 0, b"s1\n", true)
            }),
            COMMIT,
        ],
        ways: &[("s0.gguf", "in place")],
        ..ONE_GGUF
    },
    Scenario {
        name: "GGUF: a tensor dropped, one appended in its place, a key removed, then unmounted",
        steps: &[
            MOUNT,
            edit("rm b", |m| m.unlink("b")),
            ADD_D,
            edit("rm __kv__/x.count", |m| m.unlink("__kv__/x.count")),
            UNMOUNT,
        ],
        ways: &[],
        ..ONE_GGUF
    },
    Scenario {
        name: "GGUF rewritten: a tensor reshaped and a new key",
        steps: &[
            MOUNT,
            edit("reshape a", |m| {
                m.write("a.meta.json", 0, br#"{"dtype":"F32","shape":[2,2]}"#, true)
            }),
            edit("echo 1 > __kv__/x.new", |m| {
                m.create("__kv__/x.new", b"1\n")
            }),
            COMMIT,
        ],
        ways: &[],
        ..ONE_GGUF
    },
    Scenario {
        name: "recovery of an in-place commit killed after its marker",
        folder: false,
        make: make_one,
        setup: Some(|root| {
            crash_during(
                root,
                false,
                &[MOUNT, ADD_D, OVERWRITE_A, COMMIT],
                "in-place:data",
            )
        }),
        steps: &[MOUNT, MV_B_Y, COMMIT],
        ways: &[],
    },
    Scenario {
        name: "recovery of a folder's commit killed between its renames",
        folder: true,
        make: make_folder,
        setup: Some(|root| {
            crash_during(
                root,
                true,
                &[
                    MOUNT,
                    edit("rm s0/a", |m| m.unlink("s0/a")),
                    RM_S1_D,
                    COMMIT,
                ],
                "land:renamed",
            )
        }),
        steps: &[MOUNT, COMMIT],
        ways: &[],
    },
];

/// After the steps, in a new process (the first one ended as a killed
/// daemon does): mount again without faults, read the files as that mount
/// left them (`recovered`: a commit it finished is whole), do again the
/// step that failed (as its user would; its error, if it had taken effect
/// after all, does not count), commit, and read the files. Returns them and
/// the problems found.
pub fn next_life(root: &Path, sc: &Scenario, redo: Option<usize>) -> Result<Value, String> {
    in_child(root, || {
        let mut problems = Vec::new();
        let mut m = Mount::new(root, sc.folder);
        if let Err(e) = m.mount() {
            problems.push(format!("the next mount fails: {e}"));
            return json!({"problems": problems, "outcome": [], "recovered": []});
        }
        let recovered = m.targets_now();
        // (A temp file of the first life's own process: the next mount
        // leaves it, as that process still lives here; a daemon's is dead.)
        let ours = format!("-{}-", std::process::id());
        let left: Vec<String> = m
            .temps_left()
            .into_iter()
            .filter(|t| !t.contains(&ours))
            .collect();
        if !left.is_empty() {
            problems.push(format!("left after the next mount: {left:?}"));
        }
        if let Some(step) = redo
            .map(|i| &sc.steps[i])
            .filter(|s| s.kind != StepKind::Mount)
        {
            let _ = (step.run)(&mut m);
            if m.fs.is_none() {
                let _ = m.mount(); // an unmount done again
            }
        }
        if let Err(e) = m.commit() {
            problems.push(format!("the commit after the next mount fails: {e}"));
        }
        let out = m.targets_now();
        m.kill();
        json!({"problems": problems, "outcome": bytes_json(&out), "recovered": bytes_json(&recovered)})
    })
}

/// The files on disk before each step and after the last, the steps run
/// without a fault (a kill after the last: nothing more committed).
pub fn on_disk_by_step(sc: &Scenario) -> Vec<Vec<(String, Vec<u8>)>> {
    let root = fresh(sc);
    let v = in_child(root.path(), || {
        if let Some(setup) = sc.setup {
            setup(root.path());
        }
        let mut m = Mount::new(root.path(), sc.folder);
        let mut seen = Vec::new();
        for step in sc.steps {
            seen.push(bytes_json(&m.targets_now()));
            (step.run)(&mut m).unwrap_or_else(|e| panic!("{}: {}: {e}", sc.name, step.what));
        }
        seen.push(bytes_json(&m.targets_now()));
        std::mem::forget(m);
        Value::Array(seen)
    })
    .unwrap_or_else(|e| panic!("{}: the steps without faults: {e}", sc.name));
    v.as_array().unwrap().iter().map(bytes_of_json).collect()
}

/// The outcome of running the first `k` steps without a fault, then the
/// next life (for every k).
pub fn expected(sc: &Scenario) -> Vec<Vec<(String, Vec<u8>)>> {
    expected_without(sc, |_| false)
}

/// As `expected`, leaving out the steps `skip` picks (the edits not made
/// durable: a crash may take them back).
pub fn expected_without(
    sc: &Scenario,
    skip: impl Fn(&Step) -> bool,
) -> Vec<Vec<(String, Vec<u8>)>> {
    (0..=sc.steps.len())
        .map(|k| {
            let root = fresh(sc);
            in_child(root.path(), || {
                if let Some(setup) = sc.setup {
                    setup(root.path());
                }
                let mut m = Mount::new(root.path(), sc.folder);
                for step in sc.steps[..k].iter().filter(|s| !skip(s)) {
                    (step.run)(&mut m)
                        .unwrap_or_else(|e| panic!("{}: {}: {e}", sc.name, step.what));
                }
                std::mem::forget(m);
                json!(null)
            })
            .unwrap_or_else(|e| panic!("{}: the first {k} steps without faults: {e}", sc.name));
            let v = next_life(root.path(), sc, None)
                .unwrap_or_else(|e| panic!("{}: after {k} steps without faults: {e}", sc.name));
            assert!(
                v["problems"].as_array().unwrap().is_empty(),
                "{}: {k} steps: {v}",
                sc.name
            );
            bytes_of_json(&v["outcome"])
        })
        .collect()
}
