//! The crash-state explorer of in-place commits, in the spirit of ALICE and
//! CrashMonkey: crash safety shown by trying every state a crash may leave,
//! not by killing the daemon at a few moments.
//!
//! An in-place commit (`InPlaceRecord::apply`) is run against a recorder of
//! its file operations (`FileOps`). From the recorded operations the explorer
//! builds every state a POSIX filesystem may leave after a crash at any
//! point: everything up to the last sync (an fsync, an fdatasync, or the
//! insertion's durable record in the staging folder) is on disk; of what was
//! issued after it, any subset (so any order of them), and writes torn at
//! block boundaries. Each state is then checked twice:
//! - as a reader sees it: a file the reference parser accepts must be the
//!   old file or the new one, byte for byte (never a mix);
//! - after recovery (`InPlaceRecord::complete`, what the next mount does),
//!   run twice: the file is the new one, or recovery says why not and the
//!   file is one every reader refuses (the record kept), or the old one.
//!
//! The scenarios cover every kind of in-place edit: the header alone,
//! same-size overwrites, appends, tail drops, copies within the file, a hole
//! filled with the tensor moved from the end, and a header grown by blocks
//! inserted at the start. `STFS_EXPLORE_LONG=1` also
//! tears every write at every block (a longer run, for benchmarks).

use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::in_place::{FileOps, InPlaceRecord, RangeWrite, Steps, WriteFrom};
use crate::format::{Header, PREFIX_LEN};
use crate::source::FileStat;
use crate::source::Folder;

const BLOCK: u64 = 4096;
/// The time a write gives the file (the kernel's "now").
const TOUCHED: (i64, i64) = (1500, 7);
const BEFORE: (i64, i64) = (1000, 0);
const AFTER: (i64, i64) = (2000, 0);

#[derive(Clone, Debug)]
enum Op {
    Write {
        at: u64,
        data: Vec<u8>,
    },
    SetLen(u64),
    Insert(u64),
    Collapse(u64),
    Mtime((i64, i64)),
    /// fdatasync: the bytes issued before are on disk (the time need not be).
    Sync,
    /// fsync: the bytes and the time.
    SyncAll,
    /// The insertion's record made durable in the staging folder.
    Flag,
}

impl Op {
    fn is_barrier(&self) -> bool {
        matches!(self, Op::Sync | Op::SyncAll | Op::Flag)
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Model {
    bytes: Vec<u8>,
    mtime: (i64, i64),
    flag: bool,
}

impl Model {
    fn apply(&mut self, op: &Op) {
        match op {
            Op::Write { at, data } => {
                let end = *at as usize + data.len();
                if self.bytes.len() < end {
                    self.bytes.resize(end, 0);
                }
                self.bytes[*at as usize..end].copy_from_slice(data);
                self.mtime = TOUCHED;
            }
            Op::SetLen(n) => {
                self.bytes.resize(*n as usize, 0);
                self.mtime = TOUCHED;
            }
            Op::Insert(n) => {
                self.bytes
                    .splice(0..0, std::iter::repeat_n(0u8, *n as usize));
            }
            Op::Collapse(n) => {
                self.bytes.drain(..*n as usize);
            }
            Op::Mtime(t) => self.mtime = *t,
            Op::Sync | Op::SyncAll => {}
            Op::Flag => self.flag = true,
        }
    }
}

/// A file that records what is done to it (and does it to a model).
struct Recorder {
    model: RefCell<Model>,
    mode: RefCell<u32>,
    log: RefCell<Vec<Op>>,
}

impl Recorder {
    fn push(&self, op: Op) {
        self.model.borrow_mut().apply(&op);
        self.log.borrow_mut().push(op);
    }
}

impl FileOps for Recorder {
    fn size(&self) -> std::io::Result<u64> {
        Ok(self.model.borrow().bytes.len() as u64)
    }
    fn write_at(&self, buf: &[u8], at: u64) -> std::io::Result<()> {
        self.push(Op::Write {
            at,
            data: buf.to_vec(),
        });
        Ok(())
    }
    fn copy_in(&self, from: &File, from_off: u64, at: u64, len: u64) -> std::io::Result<u64> {
        let mut data = vec![0u8; len as usize];
        from.read_exact_at(&mut data, from_off)?;
        self.push(Op::Write { at, data });
        Ok(0)
    }
    fn copy_within(&self, from: u64, at: u64, len: u64) -> std::io::Result<()> {
        let data = self.model.borrow().bytes[from as usize..(from + len) as usize].to_vec();
        self.push(Op::Write { at, data });
        Ok(())
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.push(Op::SetLen(len));
        Ok(())
    }
    fn reserve(&self, _at: u64, _len: u64) -> std::io::Result<()> {
        Ok(()) // no bytes change
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.push(Op::Sync);
        Ok(())
    }
    fn sync_all(&self) -> std::io::Result<()> {
        self.push(Op::SyncAll);
        Ok(())
    }
    fn mode(&self) -> std::io::Result<u32> {
        Ok(*self.mode.borrow())
    }
    fn set_mode(&self, mode: u32) -> std::io::Result<()> {
        *self.mode.borrow_mut() = mode;
        Ok(())
    }
    fn set_mtime(&self, mtime: (i64, i64)) -> std::io::Result<()> {
        self.push(Op::Mtime(mtime));
        Ok(())
    }
    fn inserted_recorded(&self) {
        self.push(Op::Flag);
    }
}

/// A checkpoint file: (header with its prefix, whole file) of U8 tensors
/// in this order, with `room` bytes of header (JSON padded with spaces).
pub(super) fn checkpoint(
    tensors: &[(&str, &[u8])],
    metadata: &str,
    room: u64,
) -> (Vec<u8>, Vec<u8>) {
    let mut json = format!(r#"{{"__metadata__":{{"k":"{metadata}"}}"#);
    let mut at = 0;
    for (name, data) in tensors {
        let end = at + data.len();
        json.push_str(&format!(
            r#","{name}":{{"dtype":"U8","shape":[{}],"data_offsets":[{at},{end}]}}"#,
            data.len()
        ));
        at = end;
    }
    json.push('}');
    assert!(json.len() as u64 <= room, "room for the header");
    let mut header = room.to_le_bytes().to_vec();
    header.extend_from_slice(json.as_bytes());
    header.resize((PREFIX_LEN + room) as usize, b' ');
    let mut file = header.clone();
    for (_, data) in tensors {
        file.extend_from_slice(data);
    }
    (header, file)
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

struct Scenario {
    name: &'static str,
    old: Vec<u8>,
    new: Vec<u8>,
    header: Vec<u8>,
    staged: Vec<(&'static str, Vec<u8>)>,
    record: InPlaceRecord,
}

fn record(old: &[u8], new: &[u8], inserted: u64, writes: Vec<RangeWrite>) -> InPlaceRecord {
    let old_prefix = u64::from_le_bytes(old[..8].try_into().expect("8 bytes"));
    InPlaceRecord {
        folder: Default::default(),
        name: "m.safetensors".into(),
        before: FileStat {
            dev: 0,
            ino: 0,
            len: old.len() as u64,
            mtime: BEFORE,
            mode: 0o100644,
            uid: 0,
            gid: 0,
        },
        old_prefix,
        after_len: new.len() as u64,
        after_mtime: AFTER,
        header_file: "in-place-1-0-0.header".into(),
        inserted,
        header_write: 0,
        header_from: 0,
        header_len: 0,
        old_start: None,
        writes,
        old_header_sum: super::in_place::sha256_hex(&[&old[..(PREFIX_LEN + old_prefix) as usize]]),
        sum: String::new(),
    }
}

fn scenarios() -> Vec<Scenario> {
    let mut out = plain_scenarios();
    out.extend(hole_scenarios());
    out.extend(growing_scenarios());
    out
}

/// The tensors every scenario starts from: a, b and c, and the file of them
/// with a header that has room (as a first commit leaves it).
fn base() -> (Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>, u64) {
    let (a, b, c) = (bytes(5000, 1), bytes(300, 2), bytes(100, 3));
    let (_, roomy) = checkpoint(&[("a", &a), ("b", &b), ("c", &c)], "v0", 400);
    (a, b, c, roomy, PREFIX_LEN + 400)
}

/// Edits within the file as it is: the header, an overwrite, an append,
/// the tail dropped, a copy within the file.
fn plain_scenarios() -> Vec<Scenario> {
    let (a, b, c, roomy, data_start) = base();
    let old_tensors: [(&str, &[u8]); 3] = [("a", &a), ("b", &b), ("c", &c)];
    let mut out = Vec::new();

    let (header, new) = checkpoint(&old_tensors, "v1-longer", 400);
    out.push(Scenario {
        name: "header",
        record: record(&roomy, &new, 0, Vec::new()),
        old: roomy.clone(),
        new,
        header,
        staged: Vec::new(),
    });

    let b2 = bytes(300, 9);
    let (header, new) = checkpoint(&[("a", &a), ("b", &b2), ("c", &c)], "v0", 400);
    let w = RangeWrite {
        at: data_start + 5000,
        len: 300,
        from: WriteFrom::Staged {
            file: "s1".into(),
            offset: 0,
        },
    };
    out.push(Scenario {
        name: "overwrite",
        record: record(&roomy, &new, 0, vec![w]),
        old: roomy.clone(),
        new,
        header,
        staged: vec![("s1", b2)],
    });

    let d = bytes(4500, 4);
    let (header, new) = checkpoint(&[("a", &a), ("b", &b), ("c", &c), ("d", &d)], "v2", 400);
    let w = RangeWrite {
        at: roomy.len() as u64,
        len: 4500,
        from: WriteFrom::Staged {
            file: "s2".into(),
            offset: 0,
        },
    };
    out.push(Scenario {
        name: "append",
        record: record(&roomy, &new, 0, vec![w]),
        old: roomy.clone(),
        new,
        header,
        staged: vec![("s2", d.clone())],
    });

    let (header, new) = checkpoint(&[("a", &a), ("b", &b)], "v0", 400);
    out.push(Scenario {
        name: "drop the tail",
        record: record(&roomy, &new, 0, Vec::new()),
        old: roomy.clone(),
        new,
        header,
        staged: Vec::new(),
    });

    let (header, new) = checkpoint(&[("a", &a), ("b", &b), ("c", &c), ("a2", &a)], "v0", 400);
    let w = RangeWrite {
        at: roomy.len() as u64,
        len: 5000,
        from: WriteFrom::Here { offset: data_start },
    };
    out.push(Scenario {
        name: "copy within the file",
        record: record(&roomy, &new, 0, vec![w]),
        old: roomy.clone(),
        new,
        header,
        staged: Vec::new(),
    });

    // Zeros written over old bytes (the padding around a GGUF tensor
    // appended where a dropped one was).
    let zeros = vec![0u8; 100];
    let (header, new) = checkpoint(&[("a", &a), ("b", &b), ("c", &zeros)], "v0", 400);
    let w = RangeWrite {
        at: data_start + 5300,
        len: 100,
        from: WriteFrom::Zeros,
    };
    out.push(Scenario {
        name: "zeros over old bytes",
        record: record(&roomy, &new, 0, vec![w]),
        old: roomy.clone(),
        new,
        header,
        staged: Vec::new(),
    });
    out
}

/// Holes in the middle filled from the end, and blocks of a tensor written
/// in part.
fn hole_scenarios() -> Vec<Scenario> {
    let (a, b, c, roomy, data_start) = base();
    let mut out = Vec::new();
    // A tensor dropped from the middle, its hole filled by the last one
    // (of its size), moved from the end, which is then cut.
    let e = bytes(300, 5);
    let (_, four) = checkpoint(&[("a", &a), ("b", &b), ("c", &c), ("e", &e)], "v0", 400);
    let (header, new) = checkpoint(&[("a", &a), ("e", &e), ("c", &c)], "v0", 400);
    let w = RangeWrite {
        at: data_start + 5000,
        len: 300,
        from: WriteFrom::Here {
            offset: data_start + 5400,
        },
    };
    out.push(Scenario {
        name: "a hole filled from the end",
        record: record(&four, &new, 0, vec![w]),
        old: four,
        new,
        header,
        staged: Vec::new(),
    });

    // A tensor written in part: only its staged blocks go over it.
    let mut a2 = a.clone();
    a2[..100].fill(0xa5);
    a2[4096..].fill(0x5a);
    let (header, new) = checkpoint(&[("a", &a2), ("b", &b), ("c", &c)], "v0", 400);
    let blocks = [(0, 100), (4096, 5000 - 4096)].map(|(offset, len)| RangeWrite {
        at: data_start + offset,
        len,
        from: WriteFrom::Staged {
            file: "s3".into(),
            offset,
        },
    });
    out.push(Scenario {
        name: "blocks of a tensor written in part",
        record: record(&roomy, &new, 0, blocks.to_vec()),
        old: roomy.clone(),
        new,
        header,
        staged: vec![("s3", a2)],
    });

    // A hole filled by a tensor written in part: moved, then its blocks.
    let mut e2 = e.clone();
    e2[10..50].fill(0xee);
    let (_, four) = checkpoint(&[("a", &a), ("b", &b), ("c", &c), ("e", &e)], "v0", 400);
    let (header, new) = checkpoint(&[("a", &a), ("e", &e2), ("c", &c)], "v0", 400);
    let moved = RangeWrite {
        at: data_start + 5000,
        len: 300,
        from: WriteFrom::Here {
            offset: data_start + 5400,
        },
    };
    let block = RangeWrite {
        at: data_start + 5010,
        len: 40,
        from: WriteFrom::Staged {
            file: "s4".into(),
            offset: 10,
        },
    };
    out.push(Scenario {
        name: "a hole filled from the end by a tensor written in part",
        record: record(&four, &new, 0, vec![moved, block]),
        old: four,
        new,
        header,
        staged: vec![("s4", e2)],
    });

    out
}

/// A header with no room (save_file's layout) that grows by a block
/// inserted at the start.
fn growing_scenarios() -> Vec<Scenario> {
    let (a, b, c, _, _) = base();
    let old_tensors: [(&str, &[u8]); 3] = [("a", &a), ("b", &b), ("c", &c)];
    let d = bytes(4500, 4);
    let e = bytes(300, 5);
    let mut out = Vec::new();
    // The same with no room: the header grows by a block inserted at the
    // start too (the copy's offsets count the insertion).
    let tight = 320;
    let (_, old) = checkpoint(&[("a", &a), ("b", &b), ("c", &c), ("e", &e)], "v0", tight);
    let (header, new) = checkpoint(
        &[("a", &a), ("e", &e), ("c", &c)],
        &"x".repeat(300),
        tight + BLOCK,
    );
    let start = PREFIX_LEN + tight + BLOCK;
    let w = RangeWrite {
        at: start + 5000,
        len: 300,
        from: WriteFrom::Here {
            offset: start + 5400,
        },
    };
    out.push(Scenario {
        name: "a hole filled from the end, and the header grown by an insertion",
        record: record(&old, &new, BLOCK, vec![w]),
        old,
        new,
        header,
        staged: Vec::new(),
    });

    // save_file's layout: no room; the header grows by a block inserted at the
    // start, and a tensor is appended (its offsets count the insertion).
    let tight = 232;
    let (_, old) = checkpoint(&old_tensors, "v0", tight);
    let (header, new) = checkpoint(
        &[("a", &a), ("b", &b), ("c", &c), ("d", &d)],
        &"x".repeat(300),
        tight + BLOCK,
    );
    let w = RangeWrite {
        at: old.len() as u64 + BLOCK,
        len: 4500,
        from: WriteFrom::Staged {
            file: "s2".into(),
            offset: 0,
        },
    };
    out.push(Scenario {
        name: "header grown by an insertion, and an append",
        record: record(&old, &new, BLOCK, vec![w]),
        old,
        new,
        header,
        staged: vec![("s2", d)],
    });
    out
}

/// Every state a crash may leave, from the operations `ops` done to `old`.
fn crash_states(old: &Model, ops: &[Op], long: bool) -> Vec<(String, Model)> {
    let mut states = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for k in 0..=ops.len() {
        let barrier = ops[..k].iter().rposition(Op::is_barrier);
        let durable = barrier.map_or(0, |b| b + 1);
        let window: Vec<usize> = (durable..k).filter(|&i| !ops[i].is_barrier()).collect();
        assert!(
            window.len() <= 16,
            "a window of {} operations",
            window.len()
        );
        let mut base = old.clone();
        ops[..durable].iter().for_each(|op| base.apply(op));
        // The time on disk for sure: as of the last fsync (fdatasync may
        // leave a write's new time behind, and a later one may be there).
        let mut timed = old.clone();
        let synced = ops[..k].iter().rposition(|op| matches!(op, Op::SyncAll));
        ops[..synced.map_or(0, |s| s + 1)]
            .iter()
            .for_each(|op| timed.apply(op));
        let mut latest = old.clone();
        ops[..k].iter().for_each(|op| latest.apply(op));
        for mask in 0u32..(1 << window.len()) {
            let chosen: Vec<usize> = (0..window.len())
                .filter(|j| mask & (1 << j) != 0)
                .map(|j| window[j])
                .collect();
            // Whole, and each write among them torn (only some of its blocks).
            let mut variants: Vec<(String, Vec<Op>)> = vec![(
                String::new(),
                chosen.iter().map(|&i| ops[i].clone()).collect(),
            )];
            for &t in &chosen {
                let Op::Write { at, data } = &ops[t] else {
                    continue;
                };
                for blocks in torn(*at, data.len() as u64, long) {
                    let mut v = Vec::new();
                    for &i in &chosen {
                        if i != t {
                            v.push(ops[i].clone());
                            continue;
                        }
                        for (lo, hi) in &blocks {
                            v.push(Op::Write {
                                at: at + lo,
                                data: data[*lo as usize..*hi as usize].to_vec(),
                            });
                        }
                    }
                    variants.push((format!(", op {t} torn to {blocks:?}"), v));
                }
            }
            for (what, v) in variants {
                let mut state = base.clone();
                v.iter().for_each(|op| state.apply(op));
                let mut untimed = state.clone();
                untimed.mtime = timed.mtime;
                let mut ahead = state.clone();
                ahead.mtime = latest.mtime;
                for (state, when) in [
                    (state, ""),
                    (untimed, ", the time of the last fsync"),
                    (ahead, ", the time of the last write"),
                ] {
                    if seen.insert(state.clone()) {
                        let desc = format!(
                            "crash after op {k} ({durable} durable, then ops {chosen:?}{what}{when})"
                        );
                        states.push((desc, state));
                    }
                }
            }
        }
    }
    states
}

/// Ways a write of `len` bytes at `at` can be torn at block boundaries: the
/// ranges (within the write) that reached the disk.
fn torn(at: u64, len: u64, long: bool) -> Vec<Vec<(u64, u64)>> {
    let mut cuts = vec![0];
    let mut b = (at / BLOCK + 1) * BLOCK;
    while b < at + len {
        cuts.push(b - at);
        b += BLOCK;
    }
    cuts.push(len);
    let pieces: Vec<(u64, u64)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
    if pieces.len() < 2 {
        return Vec::new();
    }
    if !long {
        // The first piece alone, and all but the first.
        return vec![vec![pieces[0]], pieces[1..].to_vec()];
    }
    let n = pieces.len().min(8);
    (1..(1u32 << n) - 1)
        .map(|m| {
            (0..n)
                .filter(|j| m & (1 << j) != 0)
                .map(|j| pieces[j])
                .collect()
        })
        .collect()
}

fn readers_accept(bytes: &[u8]) -> bool {
    Header::parse(bytes).is_ok()
}

/// Runs one scenario: returns (states tried, what went wrong).
fn explore(s: &Scenario, long: bool) -> (usize, Vec<String>) {
    let dir = tempfile::tempdir().expect("a temp folder");
    let staging = dir.path().join("staging");
    std::fs::create_dir(&staging).expect("staging");
    std::fs::write(staging.join(&s.record.header_file), &s.header).expect("header");
    for (name, data) in &s.staged {
        std::fs::write(staging.join(name), data).expect("staged");
    }
    // The commit as the mount runs it, recorded.
    let start = Model {
        bytes: s.old.clone(),
        mtime: BEFORE,
        flag: false,
    };
    let Ok((done, ops)) = record_apply(s, &start, &staging, true) else {
        return (0, vec![format!("{}: the recorded commit failed", s.name)]);
    };

    let mut problems = Vec::new();
    if done.bytes != s.new || done.mtime != AFTER {
        problems.push(format!(
            "{}: the commit does not end with the new file",
            s.name
        ));
    }
    let old = Model {
        bytes: s.old.clone(),
        mtime: BEFORE,
        flag: false,
    };
    let mut states = crash_states(&old, &ops, long);
    // Crashes during recovery: from each state whose recovery redoes the
    // commit (the marker on disk), recovery's own operations are recorded
    // and every state a crash in them may leave is checked the same way.
    let mut nested = Vec::new();
    for (desc, state) in &states {
        if !crate::format::interrupted_in_place(state.bytes.len() as u64, |b, p| {
            let p = p as usize;
            let n = b.len().min(state.bytes.len().saturating_sub(p));
            b[..n].copy_from_slice(&state.bytes[p..p + n]);
            Ok(n)
        }) {
            continue;
        }
        match recovery_ops(s, state, &staging) {
            Ok(ops) => {
                for (d, st) in crash_states(state, &ops, long) {
                    nested.push((format!("{desc}, then in recovery: {d}"), st));
                }
            }
            Err(why) => problems.push(format!("{}: {desc}: recording recovery: {why}", s.name)),
        }
    }
    states.extend(nested);
    for (n, (desc, state)) in states.iter().enumerate() {
        let what = |why: String| format!("{}: {desc}: {why}", s.name);
        // What a reader sees before any recovery.
        if readers_accept(&state.bytes) && state.bytes != s.old && state.bytes != s.new {
            problems.push(what(
                "readers accept a file that is neither old nor new".into(),
            ));
        }
        // What the next mount makes of it.
        match recover(s, state, &dir.path().join(format!("c{n}"))) {
            Ok(()) => {}
            Err(why) => problems.push(what(why)),
        }
    }
    (states.len(), problems)
}

/// Runs the commit from `start` against a recorder (`fresh`: as the mount
/// does; else as recovery redoes it): the model it ends with, and its
/// operations. `staging` holds the record's files; the insertion's note is
/// there if `start` has it, and is taken away after.
fn record_apply(
    s: &Scenario,
    start: &Model,
    staging: &std::path::Path,
    fresh: bool,
) -> Result<(Model, Vec<Op>), String> {
    let flag = staging.join(format!("{}.inserted", s.record.header_file));
    match start.flag {
        true => std::fs::write(&flag, b"").map_err(|e| e.to_string())?,
        false => {
            let _ = std::fs::remove_file(&flag);
        }
    }
    let rec = Recorder {
        model: RefCell::new(start.clone()),
        mode: RefCell::new(0o100644),
        log: RefCell::new(Vec::new()),
    };
    let folder = Folder::open(staging).map_err(|e| e.to_string())?;
    let open_staged = |name: &str| -> std::io::Result<Arc<File>> {
        Ok(Arc::new(File::open(staging.join(name))?))
    };
    let insert = |n| {
        rec.push(Op::Insert(n));
        Ok(())
    };
    let collapse = |n| {
        rec.push(Op::Collapse(n));
        Ok(())
    };
    let steps = Steps {
        open_staged: &open_staged,
        insert: &insert,
        collapse: &collapse,
        dir: &folder,
        retire: &|_| {},
        fresh,
    };
    let result = s.record.apply(&rec, &s.header, &steps);
    let _ = std::fs::remove_file(&flag);
    result.map_err(|e| e.error.to_string())?;
    let done = rec.model.borrow().clone();
    let ops = rec.log.borrow().clone();
    Ok((done, ops))
}

/// The operations recovery does from a marked `state` (it redoes the
/// commit), recorded; it must end with the new file.
fn recovery_ops(s: &Scenario, state: &Model, staging: &std::path::Path) -> Result<Vec<Op>, String> {
    let (done, ops) = record_apply(s, state, staging, false)?;
    if done.bytes != s.new {
        return Err("recovery does not end with the new file".into());
    }
    Ok(ops)
}
/// Lays `state` out on disk with the record, runs recovery twice, and checks the outcome.
fn recover(s: &Scenario, state: &Model, at: &std::path::Path) -> Result<(), String> {
    std::fs::create_dir(at).map_err(|e| e.to_string())?;
    let staging = at.join("staging");
    std::fs::create_dir(&staging).map_err(|e| e.to_string())?;
    std::fs::write(staging.join(&s.record.header_file), &s.header).map_err(|e| e.to_string())?;
    for (name, data) in &s.staged {
        std::fs::write(staging.join(name), data).map_err(|e| e.to_string())?;
    }
    if state.flag {
        std::fs::write(
            staging.join(format!("{}.inserted", s.record.header_file)),
            b"",
        )
        .map_err(|e| e.to_string())?;
    }
    let path = at.join(&s.record.name);
    std::fs::write(&path, &state.bytes).map_err(|e| e.to_string())?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| e.to_string())?;
    file.set_mtime(state.mtime).map_err(|e| e.to_string())?;
    let st = FileStat::of(&file).map_err(|e| e.to_string())?;
    drop(file);
    let mut record = s.record.clone();
    record.folder = std::fs::canonicalize(at).map_err(|e| e.to_string())?;
    record.before.dev = st.dev;
    record.before.ino = st.ino;
    record.before.uid = st.uid;
    record.before.gid = st.gid;
    record.seal(&s.header);
    let folder = Folder::open(&staging).map_err(|e| e.to_string())?;
    let first = record.complete(&folder);
    let after = std::fs::read(&path).map_err(|e| e.to_string())?;
    match &first {
        Ok(_) if after != s.new => {
            return Err("recovery said done, and the file is not the new one".into());
        }
        Err((why, true)) if readers_accept(&after) => {
            return Err(format!(
                "recovery failed ({why}) and left a file readers accept"
            ));
        }
        Err((why, false)) if after != s.old && after != s.new => {
            return Err(format!(
                "recovery gave up ({why}) on a file that is neither old nor new"
            ));
        }
        Err((why, _)) => return Err(format!("recovery failed: {why}")),
        Ok(_) => {}
    }
    // Again, as after a crash during the recovery: the same file.
    if let Err((why, _)) = record.complete(&folder) {
        return Err(format!("a second recovery failed: {why}"));
    }
    if std::fs::read(&path).map_err(|e| e.to_string())? != s.new {
        return Err("a second recovery changed the file".into());
    }
    let _ = std::fs::remove_dir_all(at);
    Ok(())
}

#[test]
fn every_crash_state_of_every_in_place_commit_ends_old_or_new() {
    let dir = tempfile::tempdir().expect("temp");
    let inserts =
        crate::source::local::inserts_blocks(&File::open(dir.path()).expect("open")) == Some(BLOCK);
    let long = std::env::var_os("STFS_EXPLORE_LONG").is_some();
    let mut report = Vec::new();
    let mut problems = Vec::new();
    for s in scenarios() {
        if s.record.inserted > 0 && !inserts {
            // (tmpfs, btrfs: the grown-header scenario needs ext4 or XFS.)
            report.push(format!(
                "{}: skipped, the temp folder cannot insert blocks",
                s.name
            ));
            continue;
        }
        let (tried, found) = explore(&s, long);
        report.push(format!("{}: {tried} crash states", s.name));
        problems.extend(found);
    }
    eprintln!("crash explorer: {}", report.join("; "));
    assert!(
        problems.is_empty(),
        "{} vulnerabilities:\n{}",
        problems.len(),
        problems
            .iter()
            .take(30)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
