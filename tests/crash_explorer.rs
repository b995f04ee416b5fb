//! The crash-state explorer of whole commits: every way (a rewrite renamed
//! into place, in place, a folder's shards and index together), with the
//! staging folder's records and journals, and the next mount's recovery.
//!
//! A commit is run once, recording (through `stfs::testpoint::set_fs_hook`)
//! every change to a folder's names and every sync. Then, for every point of
//! that recording, the commit is run again in a forked child that dies there
//! (`_exit`, a crash), and the files are turned into each state a crash
//! there may leave:
//! - in each folder, the changes to names up to its last fsync are on disk,
//!   and of those after it, the first k, for every k (a journaled filesystem
//!   keeps a folder's changes in order; folders are independent of each
//!   other);
//! - each file holds what it held when last fsynced (or before the commit,
//!   or nothing if made since) or what was written since: every combination
//!   (of up to three such files; all or none beyond).
//!
//! In each state, a reader must find every file the old one or the new one
//! (a file written in place may instead be refused by every reader), and
//! after the next mount's recovery (`stfs::daemon::open_local`): every file
//! old or new, no temp file left, and the checkpoint, once committed again,
//! the new one: no staged edit lost, none applied twice.
//!
//! The in-place file's own writes (torn writes, any order between syncs,
//! the time apart from the bytes) are explored by `checkpoint::explore`.
//! Runs in `cargo test` (a fork per state: its own binary, one thread).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use stfs::checkpoint::commit::CommitOptions;
use stfs::checkpoint::recover::Resume;
use stfs::fs::{Fs, Ino, ROOT_INO, Settings};
use stfs::testpoint::{FsEvent, set_fs_hook};

const INDEX: &str = "model.safetensors.index.json";

type Tensor<'a> = (&'a str, safetensors::Dtype, Vec<usize>, Vec<u8>);

fn floats(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_checkpoint(path: &Path, tensors: &[Tensor], metadata: Option<HashMap<String, String>>) {
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

struct Scenario {
    name: &'static str,
    folder: bool,
    make: fn(&Path),
    edit: fn(&Fs),
    /// Each target's way, as the commit says it: "in place" or "by a rewrite".
    ways: &'static [(&'static str, &'static str)],
}

fn lookup(fs: &Fs, parent: Ino, name: &str) -> Ino {
    fs.lookup(parent, name)
        .unwrap_or_else(|e| panic!("{name}: {e:?}"))
        .ino
}

fn overwrite(fs: &Fs, parent: Ino, name: &str, data: &[u8]) {
    let ino = lookup(fs, parent, name);
    let o = fs.open(ino, true, false).unwrap();
    assert_eq!(fs.write(ino, o.fh, 0, data).unwrap() as usize, data.len());
    fs.release(o.fh).unwrap();
}

fn make_one(dir: &Path) {
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    write_checkpoint(
        &dir.join("s0.safetensors"),
        &[
            (
                "a",
                safetensors::Dtype::F32,
                vec![4],
                floats(&[1., 2., 3., 4.]),
            ),
            ("b", safetensors::Dtype::F32, vec![2], floats(&[5., 6.])),
            ("c", safetensors::Dtype::F32, vec![3], floats(&[7., 8., 9.])),
        ],
        Some(meta),
    );
}

fn make_folder(dir: &Path) {
    write_checkpoint(
        &dir.join("s0.safetensors"),
        &[
            (
                "a",
                safetensors::Dtype::F32,
                vec![4],
                floats(&[1., 2., 3., 4.]),
            ),
            ("b", safetensors::Dtype::F32, vec![2], floats(&[5., 6.])),
        ],
        None,
    );
    write_checkpoint(
        &dir.join("s1.safetensors"),
        &[
            ("c", safetensors::Dtype::F32, vec![3], floats(&[7., 8., 9.])),
            ("d", safetensors::Dtype::F32, vec![1], floats(&[10.])),
            ("e", safetensors::Dtype::F32, vec![2], floats(&[11., 12.])),
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

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "rewrite (a tensor dropped from the middle, another written)",
        folder: false,
        make: make_one,
        edit: |fs| {
            fs.unlink(ROOT_INO, "b").unwrap();
            overwrite(fs, ROOT_INO, "a", &floats(&[-1., -2., -3., -4.]));
        },
        ways: &[("s0.safetensors", "by a rewrite")],
    },
    Scenario {
        name: "in place (a rename, a same-size overwrite)",
        folder: false,
        make: make_one,
        edit: |fs| {
            fs.rename(ROOT_INO, "c", ROOT_INO, "z", false).unwrap();
            overwrite(fs, ROOT_INO, "a", &floats(&[-1., -2., -3., -4.]));
        },
        ways: &[("s0.safetensors", "in place")],
    },
    Scenario {
        name: "in place, the header grown by blocks inserted at the start (a long metadata value)",
        folder: false,
        make: make_one,
        edit: |fs| {
            let ino = lookup(fs, ROOT_INO, "__metadata__.json");
            let o = fs.open(ino, true, true).unwrap();
            let text =
                serde_json::to_vec(&json!({"format": "pt", "note": "x".repeat(9000)})).unwrap();
            fs.write(ino, o.fh, 0, &text).unwrap();
            fs.release(o.fh).unwrap();
        },
        ways: &[("s0.safetensors", "in place (header grown")],
    },
    Scenario {
        name: "folder (one shard in place, one rewritten, the index)",
        folder: true,
        make: make_folder,
        edit: |fs| {
            let (s0, s1) = (lookup(fs, ROOT_INO, "s0"), lookup(fs, ROOT_INO, "s1"));
            fs.rename(s0, "a", s0, "z", false).unwrap();
            // (A hole the end cannot fill: e would straddle the new end.)
            fs.unlink(s1, "d").unwrap();
            overwrite(fs, s1, "c", &floats(&[-7., -8., -9.]));
        },
        ways: &[
            ("s0.safetensors", "in place"),
            ("s1.safetensors", "by a rewrite"),
        ],
    },
];

// ---- the child: mount, edit, commit, recording (and dying at a point) ----

struct Recorder {
    src: PathBuf,
    log: Mutex<File>,
    dir: PathBuf,
    count: AtomicUsize,
    crash_at: Option<usize>,
}

fn uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

fn exists(p: &Path) -> bool {
    p.symlink_metadata().is_ok()
}

impl Recorder {
    /// Keeps a file a change will remove (so that a state without the
    /// change can have it back, the same inode): `grave/N`.
    fn keep(&self, path: &Path) -> String {
        let name = format!("k{}", self.count.load(Ordering::SeqCst));
        std::fs::hard_link(path, self.dir.join("grave").join(&name)).unwrap();
        name
    }

    fn event(&self, ev: &FsEvent) {
        // Only the checkpoint's folder and the folders in it (the staging
        // folders): not the commit locks, which hold no state.
        let watched = match ev {
            FsEvent::Created { folder, .. }
            | FsEvent::Renaming { folder, .. }
            | FsEvent::Exchanging { folder, .. }
            | FsEvent::Unlinking { folder, .. }
            | FsEvent::SyncedFolder { folder } => folder.to_path_buf(),
            FsEvent::SyncedFile { file } => {
                use std::os::fd::AsRawFd;
                std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap()
            }
        };
        if !watched.starts_with(&self.src) {
            return;
        }
        let s = |p: &OsStr| p.to_string_lossy().into_owned();
        let (line, before) = match ev {
            FsEvent::Created { folder, name } => (
                json!({"op": "create", "folder": folder, "name": s(name)}),
                false,
            ),
            FsEvent::Renaming { folder, from, to } => {
                if !exists(&folder.join(from)) {
                    return; // fails: no change
                }
                let replaced = exists(&folder.join(to)).then(|| self.keep(&folder.join(to)));
                (
                    json!({"op": "rename", "folder": folder, "from": s(from), "to": s(to), "replaced": replaced}),
                    true,
                )
            }
            FsEvent::Exchanging { folder, a, b } => (
                json!({"op": "exchange", "folder": folder, "a": s(a), "b": s(b)}),
                true,
            ),
            FsEvent::Unlinking { folder, name } => {
                if !exists(&folder.join(name)) {
                    return;
                }
                let kept = self.keep(&folder.join(name));
                (
                    json!({"op": "unlink", "folder": folder, "name": s(name), "kept": kept}),
                    true,
                )
            }
            FsEvent::SyncedFolder { folder } => {
                (json!({"op": "sync-folder", "folder": folder}), false)
            }
            FsEvent::SyncedFile { file } => {
                let st = file.metadata().unwrap();
                // Through the descriptor where it reads (opening the file
                // again would break the commit's own lease), else through /proc.
                use std::os::fd::AsRawFd;
                // SAFETY: F_GETFL of a valid descriptor.
                let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
                let data = if flags & libc::O_ACCMODE == libc::O_WRONLY {
                    std::fs::read(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap()
                } else {
                    let mut data = vec![0u8; st.len() as usize];
                    file.read_exact_at(&mut data, 0).unwrap();
                    data
                };
                let name = format!("c{}", self.count.load(Ordering::SeqCst));
                std::fs::write(self.dir.join(&name), &data).unwrap();
                (
                    json!({"op": "sync-file", "ino": st.ino(), "mtime": [st.mtime(), st.mtime_nsec()], "content": name}),
                    false,
                )
            }
        };
        let n = self.count.fetch_add(1, Ordering::SeqCst) + 1;
        if before && self.crash_at == Some(n) {
            // SAFETY: ends the process at once, as a crash would.
            unsafe { libc::_exit(0) };
        }
        let mut log = self.log.lock().unwrap();
        log.write_all(format!("{line}\n").as_bytes()).unwrap();
        if self.crash_at == Some(n) {
            // SAFETY: as above.
            unsafe { libc::_exit(0) };
        }
    }
}

fn source_of(root: &Path, folder: bool) -> PathBuf {
    let src = root.join("src");
    if folder {
        src
    } else {
        src.join("s0.safetensors")
    }
}

/// A file as it is: inode, bytes, modification time.
type FileNow = (u64, Vec<u8>, (i64, i64));

/// A file to put back as it was: path, bytes, modification time (none for
/// a file made since the commit began).
type PutBack = (PathBuf, Vec<u8>, Option<(i64, i64)>);

/// Every regular file of the source folder and the folders in it (the
/// staging folders): path -> (inode, bytes, mtime).
fn snapshot(src: &Path) -> BTreeMap<PathBuf, FileNow> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let m = e.path().symlink_metadata().unwrap();
            if m.is_dir() {
                dirs.push(e.path());
            } else if m.is_file() {
                let bytes = std::fs::read(e.path()).unwrap();
                out.insert(e.path(), (m.ino(), bytes, (m.mtime(), m.mtime_nsec())));
            }
        }
    }
    out
}

/// Mounts, edits, commits (recording into `root/log`), in a forked child
/// that dies at event `crash_at`. Returns the child's exit status.
fn run_child(root: &Path, sc: &Scenario, crash_at: Option<usize>) -> i32 {
    let log = root.join("log");
    std::fs::create_dir_all(log.join("grave")).unwrap();
    // SAFETY: this test binary has one thread (harness = false).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let (fs, _) = stfs::daemon::open_local(
                &source_of(root, sc.folder),
                None,
                Settings::default(),
                &Resume::Auto,
            )
            .unwrap();
            (sc.edit)(&fs);
            fs.fsync(None).unwrap();
            // SAFETY: sync has no preconditions.
            unsafe { libc::sync() };
            // What was on disk before the commit: durable.
            let pre: Vec<Value> = snapshot(&root.join("src"))
                .into_iter()
                .enumerate()
                .map(|(k, (_, (ino, bytes, mtime)))| {
                    let name = format!("p{k}");
                    std::fs::write(log.join(&name), bytes).unwrap();
                    json!({"ino": ino, "mtime": [mtime.0, mtime.1], "content": name})
                })
                .collect();
            std::fs::write(log.join("pre.json"), serde_json::to_vec(&pre).unwrap()).unwrap();
            let recorder = Recorder {
                src: root.join("src"),
                log: Mutex::new(File::create(log.join("events")).unwrap()),
                dir: log.clone(),
                count: AtomicUsize::new(0),
                crash_at,
            };
            set_fs_hook(Some(Box::new(move |ev| recorder.event(ev))));
            let lines = fs.commit(CommitOptions::default(), uid());
            set_fs_hook(None);
            std::fs::write(log.join("lines"), lines.unwrap().join("\n")).unwrap();
        })) {
            Ok(()) => 0,
            Err(_) => 101,
        };
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status), "child killed by a signal");
    libc::WEXITSTATUS(status)
}

fn events(root: &Path) -> Vec<Value> {
    std::fs::read_to_string(root.join("log/events"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn is_name_change(e: &Value) -> bool {
    matches!(
        e["op"].as_str(),
        Some("create" | "rename" | "exchange" | "unlink")
    )
}

/// Which name changes of `events` are on disk in each state a crash after
/// them may leave: per folder, all up to its last sync, then each prefix of
/// the rest.
fn name_states(events: &[Value]) -> Vec<Vec<bool>> {
    let mut folders: Vec<&str> = events.iter().filter_map(|e| e["folder"].as_str()).collect();
    folders.sort();
    folders.dedup();
    let mut states = vec![vec![true; events.len()]];
    for f in folders {
        let synced = events
            .iter()
            .rposition(|e| e["op"] == "sync-folder" && e["folder"] == f);
        let open: Vec<usize> = (0..events.len())
            .filter(|&i| {
                is_name_change(&events[i])
                    && events[i]["folder"] == f
                    && synced.is_none_or(|s| i > s)
            })
            .collect();
        let mut next = Vec::new();
        for st in &states {
            for k in 0..=open.len() {
                let mut st = st.clone();
                open[k..].iter().for_each(|&i| st[i] = false);
                next.push(st);
            }
        }
        states = next;
    }
    states
}

fn cstr(p: &Path) -> std::ffi::CString {
    std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// Takes back the name change `e` (the later ones are taken back already).
fn undo(root: &Path, e: &Value) {
    let folder = Path::new(e["folder"].as_str().unwrap());
    let at = |k: &str| folder.join(e[k].as_str().unwrap());
    let grave = |k: &str| root.join("log/grave").join(e[k].as_str().unwrap());
    match e["op"].as_str().unwrap() {
        "create" => std::fs::remove_file(at("name")).unwrap(),
        "rename" => {
            std::fs::rename(at("to"), at("from")).unwrap();
            if e["replaced"].is_string() {
                std::fs::hard_link(grave("replaced"), at("to")).unwrap();
            }
        }
        "exchange" => {
            let (a, b) = (cstr(&at("a")), cstr(&at("b")));
            // SAFETY: NUL-terminated paths.
            let r = unsafe {
                libc::renameat2(
                    libc::AT_FDCWD,
                    a.as_ptr(),
                    libc::AT_FDCWD,
                    b.as_ptr(),
                    libc::RENAME_EXCHANGE,
                )
            };
            assert_eq!(r, 0, "exchange back");
        }
        "unlink" => std::fs::hard_link(grave("kept"), at("name")).unwrap(),
        other => panic!("{other}"),
    }
}

fn set_mtime(path: &Path, (s, ns): (i64, i64)) {
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: s,
            tv_nsec: ns,
        },
    ];
    let p = cstr(path);
    // SAFETY: NUL-terminated path, two timespecs.
    unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0) };
}

/// What each inode held when last made durable (before the commit, or at
/// its last fsync): inode -> (bytes, mtime).
fn durable(root: &Path, events: &[Value]) -> HashMap<u64, (Vec<u8>, (i64, i64))> {
    let log = root.join("log");
    let pre: Vec<Value> =
        serde_json::from_slice(&std::fs::read(log.join("pre.json")).unwrap()).unwrap();
    let mut out = HashMap::new();
    for e in pre
        .iter()
        .chain(events.iter().filter(|e| e["op"] == "sync-file"))
    {
        let bytes = std::fs::read(log.join(e["content"].as_str().unwrap())).unwrap();
        let mtime = (
            e["mtime"][0].as_i64().unwrap(),
            e["mtime"][1].as_i64().unwrap(),
        );
        out.insert(e["ino"].as_u64().unwrap(), (bytes, mtime));
    }
    out
}

/// The same checkpoint: tensors (names, dtypes, shapes, bytes) and metadata.
fn same_checkpoint(a: &[u8], b: &[u8]) -> Result<(), String> {
    use safetensors::SafeTensors;
    let x = SafeTensors::deserialize(a).map_err(|e| format!("refused: {e:?}"))?;
    let y = SafeTensors::deserialize(b).unwrap();
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

fn targets(folder: bool) -> Vec<&'static str> {
    if folder {
        vec!["s0.safetensors", "s1.safetensors", INDEX]
    } else {
        vec!["s0.safetensors"]
    }
}

/// The checks of one crash state (the files as the crash left them).
fn check_state(
    root: &Path,
    sc: &Scenario,
    old: &HashMap<&str, Vec<u8>>,
    new: &HashMap<&str, Vec<u8>>,
) -> Result<(), String> {
    let src = root.join("src");
    let in_place = |t: &str| {
        sc.ways
            .iter()
            .any(|(n, w)| *n == t && w.starts_with("in place"))
    };
    for t in targets(sc.folder) {
        let got = std::fs::read(src.join(t)).map_err(|e| format!("{t}: {e}"))?;
        let refused = safetensors::SafeTensors::deserialize(&got).is_err();
        if got != old[t] && got != new[t] && !(in_place(t) && refused) {
            return Err(format!(
                "{t}: a reader finds neither the old file nor the new one"
            ));
        }
    }
    let (fs, notes) = stfs::daemon::open_local(
        &source_of(root, sc.folder),
        None,
        Settings::default(),
        &Resume::Auto,
    )
    .map_err(|e| format!("the next mount fails: {e}"))?;
    for t in targets(sc.folder) {
        let got = std::fs::read(src.join(t)).unwrap();
        if got != old[t] && got != new[t] {
            return Err(format!(
                "{t}: after recovery, neither old nor new ({notes:?})"
            ));
        }
    }
    let left: Vec<String> = std::fs::read_dir(&src)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".stfs-tmp-") || n.contains(".stfs-kept-"))
        .collect();
    if !left.is_empty() {
        return Err(format!("left after recovery: {left:?}"));
    }
    if fs.is_dirty() {
        fs.commit(CommitOptions::default(), uid())
            .map_err(|e| format!("the commit after recovery fails: {e:?}"))?;
    }
    for t in targets(sc.folder) {
        let got = std::fs::read(src.join(t)).unwrap();
        if t == INDEX {
            let (a, b): (Value, Value) = (
                serde_json::from_slice(&got).map_err(|e| format!("{t}: {e}"))?,
                serde_json::from_slice(&new[t]).unwrap(),
            );
            if a != b {
                return Err(format!("{t}: {a} after recovery and a commit, not {b}"));
            }
        } else {
            same_checkpoint(&got, &new[t]).map_err(|e| {
                format!("{t}: after recovery and a commit, not the new checkpoint: {e}")
            })?;
        }
    }
    drop(fs);
    Ok(())
}

fn fresh(sc: &Scenario) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("src")).unwrap();
    (sc.make)(&root.path().join("src"));
    root
}

/// Explores `sc`; returns (states checked, problems found).
fn explore(sc: &Scenario) -> (usize, Vec<String>) {
    // The recording: the whole commit, and the new files.
    let rec = fresh(sc);
    let old: HashMap<&str, Vec<u8>> = targets(sc.folder)
        .into_iter()
        .map(|t| (t, std::fs::read(rec.path().join("src").join(t)).unwrap()))
        .collect();
    assert_eq!(
        run_child(rec.path(), sc, None),
        0,
        "{}: the commit fails",
        sc.name
    );
    let lines = std::fs::read_to_string(rec.path().join("log/lines")).unwrap();
    for (t, way) in sc.ways {
        assert!(
            lines
                .lines()
                .any(|l| l.contains(t) && l.contains(&format!("committed {way}"))),
            "{}: {t} not committed {way}: {lines}",
            sc.name
        );
    }
    let new: HashMap<&str, Vec<u8>> = targets(sc.folder)
        .into_iter()
        .map(|t| (t, std::fs::read(rec.path().join("src").join(t)).unwrap()))
        .collect();
    let recorded = events(rec.path());
    if std::env::var_os("STFS_EXPLORE_VERBOSE").is_some() {
        recorded.iter().for_each(|e| println!("  {e}"));
    }
    let mut problems = Vec::new();
    let mut checked = 0;
    for n in 1..=recorded.len() {
        // The events done when the crash comes at the n-th.
        let before = matches!(
            recorded[n - 1]["op"].as_str(),
            Some("rename" | "exchange" | "unlink")
        );
        let done = &recorded[..n - before as usize];
        for names in name_states(done) {
            // (How many variants there are is known once the first run
            // shows which files were written since their last fsync.)
            let (mut variant, mut variants) = (0, 1);
            while variant < variants {
                let root = fresh(sc);
                assert_eq!(
                    run_child(root.path(), sc, Some(n)),
                    0,
                    "{}: crash at {n}",
                    sc.name
                );
                let evs = events(root.path());
                assert_eq!(
                    evs.iter().map(|e| e["op"].clone()).collect::<Vec<_>>(),
                    done.iter().map(|e| e["op"].clone()).collect::<Vec<_>>(),
                    "{}: the commit does the same each time",
                    sc.name
                );
                for i in (0..evs.len()).rev() {
                    if is_name_change(&evs[i]) && !names[i] {
                        undo(root.path(), &evs[i]);
                    }
                }
                for g in std::fs::read_dir(root.path().join("log/grave"))
                    .unwrap()
                    .flatten()
                {
                    std::fs::remove_file(g.path()).unwrap();
                }
                // Files written since they were last durable: each set of
                // them (up to three; beyond, all or none) back as it was.
                let durable = durable(root.path(), &evs);
                let changed: Vec<PutBack> = snapshot(&root.path().join("src"))
                    .into_iter()
                    .filter_map(|(path, (ino, bytes, _))| {
                        let (was, mtime) = durable
                            .get(&ino)
                            .map(|(b, m)| (b.clone(), Some(*m)))
                            .unwrap_or((Vec::new(), None));
                        (bytes != was).then_some((path, was, mtime))
                    })
                    .collect();
                let subsets: Vec<u32> = if changed.len() <= 3 {
                    (0..1u32 << changed.len()).collect()
                } else {
                    vec![0, u32::MAX]
                };
                variants = subsets.len();
                let mask = subsets[variant];
                variant += 1;
                for (k, (path, was, mtime)) in changed.iter().enumerate() {
                    if mask & (1 << k.min(31)) != 0 {
                        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
                        f.set_len(0).unwrap();
                        f.write_all_at(was, 0).unwrap();
                        drop(f);
                        if let Some(m) = mtime {
                            set_mtime(path, *m);
                        }
                    }
                }
                checked += 1;
                if let Err(why) = check_state(root.path(), sc, &old, &new) {
                    let kept: Vec<String> = (0..evs.len())
                        .filter(|&i| is_name_change(&evs[i]))
                        .map(|i| format!("{}{}", if names[i] { "" } else { "NOT " }, evs[i]))
                        .collect();
                    problems.push(format!(
                        "{}: crash at event {n} of {} ({}), names {kept:?}, files written since \
                         their last fsync taken back: {:?}: {why}",
                        sc.name,
                        recorded.len(),
                        recorded[n - 1],
                        changed
                            .iter()
                            .enumerate()
                            .filter(|(k, _)| mask & (1 << (*k).min(31)) != 0)
                            .map(|(_, c)| c.0.file_name().unwrap().to_string_lossy().into_owned())
                            .collect::<Vec<_>>()
                    ));
                }
            }
        }
    }
    (checked, problems)
}

fn main() {
    // (`cargo test -- FILTER` and the harness's other flags: run when the
    // filter is empty or names this file.)
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if args.iter().any(|a| !"crash_explorer".contains(a.as_str())) {
        return;
    }
    let started = std::time::Instant::now();
    let mut all = Vec::new();
    for sc in SCENARIOS {
        let (checked, problems) = explore(sc);
        println!(
            "{}: {checked} crash states, {} problems",
            sc.name,
            problems.len()
        );
        all.extend(problems);
    }
    println!("crash explorer: {:.1} s", started.elapsed().as_secs_f64());
    for p in &all {
        println!("PROBLEM {p}");
    }
    assert!(
        all.is_empty(),
        "{} crash states are neither old nor new",
        all.len()
    );
}
