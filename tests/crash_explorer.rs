//! The crash-state explorer of an edit's whole life: every scenario of
//! `scenarios::SCENARIOS` (the mount and its recovery, every kind of edit,
//! each acknowledged by its `close`, every way of committing, a folder's
//! shards and index together, a discard, an unmount), with the staging
//! folder's creation, its staging files, journals and records, and the
//! next mount's recovery.
//!
//! The life is run once, recording (through `stfs::testpoint::set_fs_hook`)
//! every change to a folder's names and every sync, from the mount on.
//! Then, for every point of that recording, it is run again in a forked
//! child that dies there (`_exit`, a crash), and the files are turned into
//! each state a crash there may leave:
//! - in each folder, the changes to names up to its last fsync are on disk,
//!   and of those after it, the first k, for every k (a journaled filesystem
//!   keeps a folder's changes in order; folders are independent of each
//!   other, but a folder whose own name is taken back takes its files with it);
//! - each file holds what it held when last fsynced (or before the life
//!   began, or nothing if made since) or what was written since: every
//!   combination (of up to three such files; all or none beyond);
//! - a crash comes just before each sync as well as after it.
//!
//! In each state, a reader must find every file as it was before the step
//! that was running or as that step left it (a file written in place may
//! instead be refused by every reader). Then the next mount (another
//! process, the daemon's own code) must succeed and leave no temp file; the
//! step that was running is done again, as its user would, and a commit
//! must give the checkpoint of every step so far: every step that returned
//! (each edit's close) is there, none twice.
//!
//! The in-place file's own writes (torn writes, any order between syncs,
//! the time apart from the bytes) are explored by `checkpoint::explore`.
//! Runs in `cargo test` (a fork per state: its own binary, one thread).
//! `STFS_EXPLORE_VERBOSE=1` prints the recordings; `STFS_EXPLORE_SCENARIO=TEXT`
//! explores only the scenarios whose name holds it.

mod scenarios;

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs::File;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use scenarios::*;
use serde_json::{Value, json};
use stfs::testpoint::{FsEvent, set_fs_hook};

// ---- the child: the life, recording (and dying at a point) ----

struct Recorder {
    src: PathBuf,
    log: Mutex<File>,
    dir: PathBuf,
    count: AtomicUsize,
    crash_at: Option<usize>,
    /// The life's own thread: what a commit lets go of on another (its
    /// spent files, removed in the background) is not recorded.
    thread: std::thread::ThreadId,
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

    /// An event that changes nothing on disk: logged, and a crash point.
    fn point(&self, line: Value) {
        let n = self.count.fetch_add(1, Ordering::SeqCst) + 1;
        let mut log = self.log.lock().unwrap();
        log.write_all(format!("{line}\n").as_bytes()).unwrap();
        if self.crash_at == Some(n) {
            // SAFETY: ends the process at once, as a crash would.
            unsafe { libc::_exit(0) };
        }
    }

    fn event(&self, ev: &FsEvent) {
        if std::thread::current().id() != self.thread {
            return;
        }
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
        if matches!(
            ev,
            FsEvent::SyncedFolder { .. } | FsEvent::SyncedFile { .. }
        ) {
            // A crash just before a sync: what it would make durable is
            // not (an edit acknowledged without a sync of its own, then a
            // commit whose first act is that sync, is lost only here).
            self.point(json!({"op": "to-sync"}));
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
                let path = folder.join(name);
                if !path.symlink_metadata().is_ok_and(|m| m.is_file()) {
                    return; // fails (or a folder's, which holds nothing then)
                }
                let kept = self.keep(&path);
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

/// A file as it is: inode, bytes, modification time.
type FileNow = (u64, Vec<u8>, (i64, i64));

/// A file to put back as it was: path, bytes, modification time (none for
/// a file made since the life began).
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

/// Runs the life of `sc` in `root` (recording into `root/log`), in a forked
/// child that dies at event `crash_at`. The child writes, after each step
/// that returned, how many have (`log/acks`), and in the recording the
/// files a commit writes as each step left them (`log/targets`).
fn run_child(root: &Path, sc: &Scenario, crash_at: Option<usize>) -> i32 {
    let log = root.join("log");
    std::fs::create_dir_all(log.join("grave")).unwrap();
    // SAFETY: this test binary has one thread (harness = false).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if let Some(setup) = sc.setup {
                setup(root);
            }
            // SAFETY: sync has no preconditions.
            unsafe { libc::sync() };
            // What was on disk before the life: durable.
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
            let mut m = Mount::new(root, sc.folder);
            let mut targets = vec![bytes_json(&m.targets_now())];
            let recorder = Recorder {
                src: root.join("src"),
                log: Mutex::new(File::create(log.join("events")).unwrap()),
                dir: log.clone(),
                count: AtomicUsize::new(0),
                crash_at,
                thread: std::thread::current().id(),
            };
            set_fs_hook(Some(Box::new(move |ev| recorder.event(ev))));
            for (i, step) in sc.steps.iter().enumerate() {
                (step.run)(&mut m).unwrap_or_else(|e| panic!("{}: {e}", step.what));
                std::fs::write(log.join("acks"), format!("{}", i + 1)).unwrap();
                if crash_at.is_none() {
                    targets.push(bytes_json(&m.targets_now()));
                }
            }
            set_fs_hook(None);
            std::fs::write(log.join("lines"), m.said.borrow().join("\n")).unwrap();
            std::fs::write(log.join("targets"), Value::Array(targets).to_string()).unwrap();
            std::mem::forget(m);
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

fn acks(root: &Path) -> usize {
    std::fs::read_to_string(root.join("log/acks"))
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|_| panic!("acks {s:?} in {}", root.display()))
        })
        .unwrap_or(0)
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
/// A change inside a folder whose own creation was taken back is gone with it.
fn undo(root: &Path, e: &Value) {
    let folder = Path::new(e["folder"].as_str().unwrap());
    if !folder.exists() {
        return;
    }
    let at = |k: &str| folder.join(e[k].as_str().unwrap());
    let grave = |k: &str| root.join("log/grave").join(e[k].as_str().unwrap());
    match e["op"].as_str().unwrap() {
        "create" if at("name").is_dir() => std::fs::remove_dir_all(at("name")).unwrap(),
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

/// What each inode held when last made durable (before the life, or at
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

/// The checks of one crash state (the files as the crash left them), the
/// crash having come during step `k` (`k` steps had returned).
fn check_state(
    root: &Path,
    sc: &Scenario,
    k: usize,
    by_step: &[Vec<(String, Vec<u8>)>],
    want: &[Vec<(String, Vec<u8>)>],
    want_unsynced_gone: &[Vec<(String, Vec<u8>)>],
) -> Result<(), String> {
    let running = sc.steps.get(k);
    // (Files written in place, and those a recovery scenario starts refused.)
    let may_refuse = running.is_some_and(|s| {
        matches!(
            s.kind,
            StepKind::Commit | StepKind::Unmount | StepKind::Mount
        )
    });
    let now = Mount::new(root, sc.folder).targets_now();
    for (i, (t, got)) in now.iter().enumerate() {
        let was = &by_step[k][i].1;
        let after = &by_step[(k + 1).min(sc.steps.len())][i].1;
        if got != was && got != after && !(may_refuse && refused(got)) {
            return Err(format!(
                "{t}: a reader finds neither the file as it was before step {k} nor as it left it"
            ));
        }
    }
    let next = next_life(root, sc, running.map(|_| k))?;
    let problems: Vec<&str> = next["problems"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    let done = (k + 1).min(sc.steps.len());
    // The next mount finished or undid the step as a whole: every file as
    // before it, or every file as it left them (never a commit half landed,
    // which a user who then discards would keep).
    let recovered = bytes_of_json(&next["recovered"]);
    if same_targets(&recovered, &by_step[k]).is_err() {
        same_targets(&recovered, &by_step[done]).map_err(|e| {
            format!(
                "after the next mount, before anything else, the files are neither as they were \
                 before step {k} nor as it left them: {e}"
            )
        })?;
    }
    let outcome = bytes_of_json(&next["outcome"]);
    // An unsynced edit may be gone, unless a commit that held it began to
    // change the files (then its record must bring it back whole).
    let touched = now.iter().zip(&by_step[k]).any(|((_, n), (_, b))| n != b);
    if !touched && same_targets(&outcome, &want_unsynced_gone[done]).is_ok() {
        return Ok(());
    }
    same_targets(&outcome, &want[done]).map_err(|e| {
        format!(
            "after the next mount, step {k} done again and a commit, not the checkpoint of \
             the first {done} steps: {e}"
        )
    })
}

/// With `STFS_EXPLORE_KEEP=DIR`: a copy of the crash state's source folder
/// (its staging folder and journal with it), before the next mount, under
/// DIR (only the failing ones are said; remove DIR after).
fn keep_state(root: &Path) -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("STFS_EXPLORE_KEEP")?);
    static N: AtomicUsize = AtomicUsize::new(0);
    let to = dir.join(format!("state-{}", N.fetch_add(1, Ordering::SeqCst)));
    std::fs::create_dir_all(&dir).unwrap();
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(root.join("src"))
        .arg(&to)
        .status();
    copied.is_ok_and(|s| s.success()).then_some(to)
}

/// Explores `sc`; returns (states checked, problems found).
fn explore(sc: &Scenario) -> (usize, Vec<String>) {
    let want = expected(sc);
    let want_unsynced_gone = expected_without(sc, |s| s.kind == StepKind::Unsynced);
    // The recording: the whole life, and the files after each step.
    let rec = fresh(sc);
    assert_eq!(
        run_child(rec.path(), sc, None),
        0,
        "{}: the life fails",
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
    let by_step: Vec<Vec<(String, Vec<u8>)>> = serde_json::from_slice::<Vec<Value>>(
        &std::fs::read(rec.path().join("log/targets")).unwrap(),
    )
    .unwrap()
    .iter()
    .map(bytes_of_json)
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
                    "{}: the life does the same each time",
                    sc.name
                );
                let k = acks(root.path());
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
                for (i, (path, was, mtime)) in changed.iter().enumerate() {
                    if mask & (1 << i.min(31)) != 0 {
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
                let kept = keep_state(root.path());
                if let Err(why) =
                    check_state(root.path(), sc, k, &by_step, &want, &want_unsynced_gone)
                {
                    if let Some(kept) = kept {
                        eprintln!("state kept in {}", kept.display());
                    }
                    let kept: Vec<String> = (0..evs.len())
                        .filter(|&i| is_name_change(&evs[i]))
                        .map(|i| format!("{}{}", if names[i] { "" } else { "NOT " }, evs[i]))
                        .collect();
                    let step = sc.steps.get(k).map_or("after the last step", |s| s.what);
                    problems.push(format!(
                        "{}: crash at event {n} of {} ({}), in step {k} ({step}), names \
                         {kept:?}, files written since their last fsync taken back: {:?}: {why}",
                        sc.name,
                        recorded.len(),
                        recorded[n - 1],
                        changed
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| mask & (1 << (*i).min(31)) != 0)
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
    let pick = std::env::var("STFS_EXPLORE_SCENARIO").unwrap_or_default();
    let started = std::time::Instant::now();
    let mut all = Vec::new();
    for sc in SCENARIOS.iter().filter(|sc| sc.name.contains(&pick)) {
        let t = std::time::Instant::now();
        let (checked, problems) = explore(sc);
        println!(
            "{}: {checked} crash states, {} problems ({:.1} s)",
            sc.name,
            problems.len(),
            t.elapsed().as_secs_f64()
        );
        all.extend(problems);
    }
    println!("crash explorer: {:.1} s", started.elapsed().as_secs_f64());
    for p in &all {
        println!("PROBLEM {p}");
    }
    assert!(
        all.is_empty(),
        "{} crash states lose or mix up what was acknowledged",
        all.len()
    );
}
