//! A fault at every file operation (SQLite's I/O-error tests are the
//! model): each scenario of an edit's life (`scenarios::SCENARIOS`: every
//! kind of edit, every way of committing, a discard, an unmount, the
//! recovery of an interrupted commit) is run once counting the daemon's
//! own file operations (`stfs::testpoint::io`: its staging folder and
//! journal, a commit's writes, syncs and renames, recovery's reads), then
//! again failing the N-th of them, for every N, with EIO and with ENOSPC,
//! each run in a forked child. In every run:
//! - the step that met the failure reports it (an error, never success),
//!   unless the operation is one whose failure may be passed over (removing
//!   a spent file);
//! - a commit that fails leaves each file it writes as it was, byte for
//!   byte, or refused by every reader, and says so ("did not land"), or
//!   says which of a folder's files landed, or that all landed but could
//!   not be made durable;
//! - once the mount is killed, the next mount (no fault) succeeds and
//!   leaves no temp file; the step that failed is done again, as its user
//!   would, and a commit gives the checkpoint of all the steps so far: no
//!   acknowledged edit lost, none applied twice.
//!
//! Runs in `cargo test` (its own binary, one thread, a fork per run).
//! `STFS_FAULTS_VERBOSE=1` prints every run.

mod scenarios;

use std::path::Path;

use scenarios::*;
use serde_json::{Value, json};
use stfs::testpoint::{IoKind, arm_io_faults, disarm_io_faults, io_count};

/// Runs the steps of `sc` in `root` (in a new process, which ends as a
/// killed daemon does), failing file operation `fail_at` (None: counting
/// only) with `errno`. Returns what happened: the step that failed and
/// its error, the problems found, the operations counted and the one failed.
fn first_life(
    root: &Path,
    sc: &Scenario,
    fail_at: Option<u64>,
    errno: i32,
) -> Result<Value, String> {
    in_child(root, || {
        if let Some(setup) = sc.setup {
            setup(root);
        }
        let mut m = Mount::new(root, sc.folder);
        let mut problems = Vec::new();
        let mut failed = None;
        arm_io_faults(fail_at, errno);
        for (i, step) in sc.steps.iter().enumerate() {
            let before = m.targets_now();
            let fired_before = io_count().fired.is_some();
            let result = (step.run)(&mut m);
            let fired = io_count().fired;
            let fired_here = !fired_before && fired.is_some();
            if let (true, Ok(()), Some((_, op, IoKind::Reported))) = (fired_here, &result, fired) {
                problems.push(format!(
                    "step {i} ({}) returned success after its file operation {op} failed",
                    step.what
                ));
            }
            if let Err(e) = result {
                // (What failed was another program's, during the commit.)
                let theirs = e.starts_with("another program's");
                if matches!(step.kind, StepKind::Commit | StepKind::Unmount) && !theirs {
                    // Each file as it was or refused by every reader, and said;
                    // some files of a folder landed, and said (the next mount
                    // lands the rest); or all landed but not made durable.
                    let landed = e.contains("committed, but not made durable")
                        || (e.contains("did not land (") && !e.contains("(0 of its"));
                    for ((t, now), (_, was)) in m.targets_now().iter().zip(&before) {
                        if now != was && !landed && !(refused(now) && e.contains("did not land")) {
                            problems.push(format!(
                                "step {i} ({}) failed ({e}) but changed {t}{}",
                                step.what,
                                match refused(now) {
                                    true => " (refused by readers, and the error does not say it did not land)",
                                    false => ", which readers accept",
                                }
                            ));
                        }
                    }
                }
                if !fired_here {
                    problems.push(format!(
                        "step {i} ({}) failed without a fault: {e}",
                        step.what
                    ));
                }
                failed = Some((i, e));
                break;
            }
        }
        let seen = disarm_io_faults();
        // Killed: nothing of the mount is dropped (its staging files stay).
        std::mem::forget(m);
        json!({
            "failed": failed.map(|(i, e)| json!([i, e])),
            "problems": problems,
            "count": seen.count,
            "ops": seen.ops,
            "fired": seen.fired.map(|(n, op, kind)| json!([n, op, kind == IoKind::Reported])),
        })
    })
}

/// Explores `sc`; returns (runs, problems).
fn explore(sc: &Scenario) -> (usize, Vec<String>) {
    let verbose = std::env::var_os("STFS_FAULTS_VERBOSE").is_some();
    let want = expected(sc);
    let on_disk = on_disk_by_step(sc);
    let counted = {
        let root = fresh(sc);
        let v = first_life(root.path(), sc, None, 0)
            .unwrap_or_else(|e| panic!("{}: counting: {e}", sc.name));
        assert!(
            v["problems"].as_array().unwrap().is_empty(),
            "{}: {v}",
            sc.name
        );
        if verbose {
            println!("{}: {} operations: {}", sc.name, v["count"], v["ops"]);
        }
        v["count"].as_u64().unwrap()
    };
    let mut problems = Vec::new();
    let mut runs = 0;
    // `STFS_FAULTS_ONLY=N`: only the N-th operation, with EIO, and the log.
    let only: Option<u64> = std::env::var("STFS_FAULTS_ONLY")
        .ok()
        .and_then(|v| v.parse().ok());
    if only.is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("stfs=debug")
            .with_writer(std::io::stderr)
            .try_init();
    }
    for errno in [libc::EIO, libc::ENOSPC] {
        for n in 1..=counted {
            if only.is_some_and(|o| o != n) || (only.is_some() && errno != libc::EIO) {
                continue;
            }
            let root = fresh(sc);
            runs += 1;
            let first = first_life(root.path(), sc, Some(n), errno);
            let redo = first.as_ref().ok().and_then(|v| {
                v["failed"]
                    .as_array()
                    .map(|f| f[0].as_u64().unwrap() as usize)
            });
            let v = match first.and_then(|mut v| {
                let next = next_life(root.path(), sc, redo)?;
                v["problems"]
                    .as_array_mut()
                    .unwrap()
                    .extend(next["problems"].as_array().unwrap().iter().cloned());
                v["outcome"] = next["outcome"].clone();
                v["recovered"] = next["recovered"].clone();
                Ok(v)
            }) {
                Ok(v) => v,
                Err(e) => {
                    problems.push(format!("{}: fault {n} (errno {errno}): {e}", sc.name));
                    continue;
                }
            };
            let fired = &v["fired"];
            let at = |what: &str| {
                format!(
                    "{}: file operation {n} of {counted} ({}) failing with errno {errno}: {what}",
                    sc.name, fired[1]
                )
            };
            if verbose {
                println!("  {}", at(&v["failed"].to_string()));
            }
            for p in v["problems"].as_array().unwrap() {
                problems.push(at(p.as_str().unwrap()));
            }
            let outcome = bytes_of_json(&v["outcome"]);
            if outcome.is_empty() {
                continue; // the next mount failed: said above
            }
            // The steps acknowledged, and the one that failed, done again.
            let done = match v["failed"].as_array() {
                Some(f) => f[0].as_u64().unwrap() as usize + 1,
                None => sc.steps.len(),
            };
            // The next mount finished or undid the failed step as a whole
            // (never a commit half landed).
            let recovered = bytes_of_json(&v["recovered"]);
            let whole = |k: usize| same_targets(&recovered, &on_disk[k]);
            if let Err(why) = whole(done - 1).or_else(|_| whole(done)) {
                problems.push(at(&format!(
                    "after the next mount, before anything else, the files are neither as they \
                     were before step {} nor as it left them: {why}",
                    done - 1
                )));
            }
            if let Err(why) = same_targets(&outcome, &want[done]) {
                problems.push(at(&format!(
                    "after the next mount, the failed step done again and a commit, not the \
                     checkpoint of the first {done} steps: {why}"
                )));
            }
        }
    }
    (runs, problems)
}

/// A commit whose new file the mount's own reader would refuse (here made
/// so behind its back: its temp file's length prefix spoiled just before
/// it lands) is refused, says why, leaves the source as it was and the
/// edits staged, and removes its temp file.
fn a_file_readers_refuse_never_lands() -> Vec<String> {
    let sc = &SCENARIOS[1]; // a rewrite
    let root = fresh(sc);
    let v = in_child(root.path(), || {
        let mut m = Mount::new(root.path(), false);
        m.mount().unwrap();
        m.unlink("b").unwrap();
        let before = m.targets_now();
        let src = root.path().join("src");
        stfs::testpoint::set_point_hook(Some(Box::new(move |step| {
            if step != "commit:written" {
                return;
            }
            for e in std::fs::read_dir(&src).unwrap().flatten() {
                if e.file_name().to_string_lossy().contains(".stfs-tmp-") {
                    use std::os::unix::fs::FileExt;
                    let f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(e.path())
                        .unwrap();
                    f.write_all_at(&u64::MAX.to_le_bytes(), 0).unwrap();
                }
            }
        })));
        let result = m.commit();
        stfs::testpoint::set_point_hook(None);
        let mut problems = Vec::new();
        match &result {
            Err(e) if e.contains("would be refused by every reader") => {}
            other => problems.push(format!("the commit of a spoiled file gave {other:?}")),
        }
        if m.targets_now() != before {
            problems.push("the source changed".into());
        }
        if !m.temps_left().is_empty() {
            problems.push(format!("temp files left: {:?}", m.temps_left()));
        }
        if !m.fs().unwrap().is_dirty() {
            problems.push("the edits are not staged any more".into());
        }
        if let Err(e) = m.commit() {
            problems.push(format!("the next commit fails: {e}"));
        }
        std::mem::forget(m);
        json!(problems)
    })
    .unwrap_or_else(|e| vec![e].into());
    serde_json::from_value(v).unwrap()
}

/// Every leaf of `v` (a number, a string, a bool) changed in turn: the
/// records a mutation may give, each still well formed.
fn each_field_changed(v: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    match v {
        Value::Number(n) => {
            let x = n.as_u64().unwrap_or(0);
            out.extend([json!(x + 8), json!(x.saturating_sub(1)), json!(x ^ 1)]);
        }
        Value::String(t) => out.extend([json!(format!("{t}x")), json!("")]),
        Value::Bool(b) => out.push(json!(!b)),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                for changed in each_field_changed(item) {
                    let mut a = items.clone();
                    a[i] = changed;
                    out.push(Value::Array(a));
                }
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                for changed in each_field_changed(item) {
                    let mut o = map.clone();
                    o.insert(k.clone(), changed);
                    out.push(Value::Object(o));
                }
            }
        }
        Value::Null => {}
    }
    out.retain(|x| x != v);
    out
}

/// Records as a property: the record of an in-place commit killed after
/// its marker, changed in every way (each of many bytes flipped, cut short
/// at many lengths, and every field of its redo record changed, the whole
/// sealed again as stfs seals it), is never applied: the next mount fails
/// and says why, the file stays as the crash left it, the record is kept.
fn records_changed_are_refused() -> Vec<String> {
    let sc = SCENARIOS
        .iter()
        .find(|s| s.name.starts_with("recovery of an in-place commit"))
        .unwrap();
    let root = fresh(sc);
    in_child(root.path(), || {
        (sc.setup.unwrap())(root.path());
        json!(null)
    })
    .unwrap();
    let src = root.path().join("src");
    let staging = std::fs::read_dir(&src)
        .unwrap()
        .flatten()
        .find(|e| e.path().is_dir())
        .unwrap()
        .path();
    let record = staging.join("commit.json");
    let text = std::fs::read(&record).unwrap();
    let file = src.join("s0.safetensors");
    let crashed = std::fs::read(&file).unwrap();
    let seal = text.windows(8).rposition(|w| w == b"\nsha256:").unwrap();
    let body: Value = serde_json::from_slice(&text[..seal]).unwrap();
    let resealed = |v: &Value| {
        let body = serde_json::to_vec_pretty(v).unwrap();
        let sum = ring::digest::digest(&ring::digest::SHA256, &body);
        let hex: String = sum.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        [&body[..], b"\nsha256:", hex.as_bytes(), b"\n"].concat()
    };
    let mut mutations: Vec<(String, Vec<u8>)> = Vec::new();
    let step = (text.len() / 150).max(1);
    for at in (0..text.len()).step_by(step).chain(seal..text.len()) {
        let mut t = text.clone();
        t[at] ^= 1;
        mutations.push((format!("byte {at} flipped"), t));
    }
    for len in (0..text.len()).step_by((text.len() / 20).max(1)) {
        mutations.push((format!("cut at {len}"), text[..len].to_vec()));
    }
    for changed in each_field_changed(&body["in_place"]) {
        let mut v = body.clone();
        v["in_place"] = changed;
        mutations.push((format!("resealed with {}", v["in_place"]), resealed(&v)));
    }
    let mut problems = Vec::new();
    for (what, t) in &mutations {
        std::fs::write(&record, t).unwrap();
        let v = next_life(root.path(), sc, None).unwrap_or_else(|e| json!({"problems": [e]}));
        let said = v["problems"].to_string();
        if !said.contains("the next mount fails") {
            problems.push(format!("{what}: the next mount did not fail: {said}"));
        } else if ![
            "seal",
            "not a record",
            "does not hold",
            "checksum",
            "No such file",
            "not a plain name",
        ]
        .iter()
        .any(|w| said.contains(w))
        {
            problems.push(format!("{what}: the mount does not say why: {said}"));
        }
        if std::fs::read(&file).unwrap() != crashed {
            problems.push(format!("{what}: the file was changed"));
            break;
        }
        if std::fs::read(&record).ok().as_ref() != Some(t) {
            problems.push(format!("{what}: the record was not kept as it was"));
            break;
        }
    }
    // And the record as written completes the commit.
    std::fs::write(&record, &text).unwrap();
    let v = next_life(root.path(), sc, None).unwrap();
    if !v["problems"].as_array().unwrap().is_empty() {
        problems.push(format!("the record as written does not complete it: {v}"));
    }
    println!("records: {} changed records refused", mutations.len());
    problems
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if args.iter().any(|a| !"fault_runner".contains(a.as_str())) {
        return;
    }
    let started = std::time::Instant::now();
    let mut all = Vec::new();
    // `STFS_FAULTS_SCENARIO=TEXT`: only the scenarios whose name holds it.
    let pick = std::env::var("STFS_FAULTS_SCENARIO").unwrap_or_default();
    for sc in SCENARIOS.iter().filter(|sc| sc.name.contains(&pick)) {
        let t = std::time::Instant::now();
        let (runs, problems) = explore(sc);
        println!(
            "{}: {runs} runs, {} problems ({:.1} s)",
            sc.name,
            problems.len(),
            t.elapsed().as_secs_f64()
        );
        all.extend(problems);
    }
    all.extend(
        a_file_readers_refuse_never_lands()
            .into_iter()
            .map(|p| format!("a commit of a file readers refuse: {p}")),
    );
    all.extend(
        records_changed_are_refused()
            .into_iter()
            .map(|p| format!("a changed record: {p}")),
    );
    println!("fault runner: {:.1} s", started.elapsed().as_secs_f64());
    for p in &all {
        println!("PROBLEM {p}");
    }
    assert!(all.is_empty(), "{} runs went wrong", all.len());
}
