//! Commits to an object in S3 or an S3-compatible store (docs/SEMANTICS.md,
//! "Remote commits"): a multipart upload builds the new object from the new
//! header, server-side copies of the runs of the old object that stay
//! (UploadPartCopy with a range) and uploaded bytes of what is new, and is
//! completed only over the version the mount read. An edit of a 100 GB
//! object sends what changed, plus what tops a part up to S3's minimum.
//!
//! The upload's id is recorded in the cache folder before any part is sent,
//! so that a crash leaves no parts to pay for: the next mount aborts it.
//! Until the completion nothing of the object changed; any failure aborts
//! the upload and keeps the edits staged.

use super::*;
use crate::checkpoint::Declined;
use crate::source::remote::RemoteObject;
use crate::source::remote::s3::{self, DonePart, S3Error, S3Writer};
use std::ffi::OsStr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Mutex;

/// S3's limits: a part is at least 5 MiB (but the last) and at most 5 GiB;
/// an upload has at most 10,000 parts.
pub const MIN_PART: u64 = 5 << 20;
const MAX_PART: u64 = 5 << 30;
/// Server-side copies are cut into parts of at most this (each must end
/// within the request's time limit).
const COPY_PART: u64 = 1 << 30;
const MAX_PARTS: usize = 10_000;
/// Uploaded parts are built in memory, each at most this large (more, only
/// where 10,000 parts would not hold the upload otherwise).
const UPLOAD_PART: u64 = 64 << 20;
/// Server-side copies in flight at once.
const COPIES_AT_ONCE: usize = 8;
/// Uploaded parts in flight at once (each up to 64 MiB in memory).
const UPLOADS_AT_ONCE: usize = 4;

/// The smallest part the store takes: 5 MiB, or `STFS_S3_MIN_PART` (a
/// store or a test server configured with a lower minimum).
pub fn min_part() -> u64 {
    std::env::var("STFS_S3_MIN_PART")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(MIN_PART)
}

/// Where bytes of an uploaded part come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Of the new header.
    Header(Range<u64>),
    /// Of the old object (`from` 0), or of another object of the same
    /// bucket (`from` k: the job's `others[k - 1]`, a shard a tensor moved
    /// from): a run too short to be a part of its own, or the bytes that
    /// top a part up to the minimum.
    Old { from: u32, range: Range<u64> },
    /// Of input `k` (a staged or new tensor).
    Input { k: usize, range: Range<u64> },
}

impl Piece {
    fn range(&self) -> &Range<u64> {
        match self {
            Piece::Header(r) | Piece::Old { range: r, .. } | Piece::Input { range: r, .. } => r,
        }
    }

    fn len(&self) -> u64 {
        self.range().end - self.range().start
    }

    /// The first `n` bytes, and the rest.
    fn split(self, n: u64) -> (Piece, Piece) {
        let r = self.range().clone();
        let cut = r.start + n.min(r.end - r.start);
        match self {
            Piece::Header(_) => (Piece::Header(r.start..cut), Piece::Header(cut..r.end)),
            Piece::Old { from, .. } => (
                Piece::Old {
                    from,
                    range: r.start..cut,
                },
                Piece::Old {
                    from,
                    range: cut..r.end,
                },
            ),
            Piece::Input { k, .. } => (
                Piece::Input {
                    k,
                    range: r.start..cut,
                },
                Piece::Input {
                    k,
                    range: cut..r.end,
                },
            ),
        }
    }

    /// `next` continues this piece: one piece.
    fn join(&mut self, next: &Piece) -> bool {
        match (self, next) {
            (Piece::Header(a), Piece::Header(b)) if a.end == b.start => {
                a.end = b.end;
                true
            }
            (Piece::Old { from: x, range: a }, Piece::Old { from: y, range: b })
                if x == y && a.end == b.start =>
            {
                a.end = b.end;
                true
            }
            (Piece::Input { k: a, range: ra }, Piece::Input { k: b, range: rb })
                if a == b && ra.end == rb.start =>
            {
                ra.end = rb.end;
                true
            }
            _ => false,
        }
    }
}

/// A part of the new object, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Bytes of the old object (or of another, `Piece::Old`'s `from`),
    /// copied by the server.
    Copy { from: u32, range: Range<u64> },
    /// Bytes sent.
    Upload(Vec<Piece>),
}

impl Part {
    fn len(&self) -> u64 {
        match self {
            Part::Copy { range: r, .. } => r.end - r.start,
            Part::Upload(pieces) => pieces.iter().map(Piece::len).sum(),
        }
    }
}

/// The parts of a new object.
#[derive(Debug, Clone, Default)]
pub struct PartPlan {
    pub parts: Vec<Part>,
    /// Bytes sent, and bytes the server copies.
    pub uploaded: u64,
    pub copied: u64,
}

impl PartPlan {
    /// One part: the object goes up by one PutObject.
    pub fn single_put(&self) -> bool {
        self.parts.len() <= 1
    }
}

/// Cuts the new object, given as pieces in order (runs of the old object
/// as `Old`), into parts: each old run of at least `min` bytes is copied by
/// the server (in parts of at most 1 GiB), everything else is uploaded in
/// parts of at most `max_upload` bytes, and an uploaded part shorter than
/// `min` is topped up with the bytes that follow it, whatever they are.
pub fn plan_parts(pieces: Vec<Piece>, min: u64, max_upload: u64) -> PartPlan {
    // (Room for a short run after a full part: no part passes 5 GiB.)
    let max_upload = max_upload.max(min).min(MAX_PART - min);
    let mut plan = PartPlan::default();
    let mut open: Vec<Piece> = Vec::new();
    let mut open_len = 0;
    fn add(open: &mut Vec<Piece>, open_len: &mut u64, piece: Piece) {
        if piece.len() == 0 {
            return;
        }
        *open_len += piece.len();
        if let Some(last) = open.last_mut() {
            if last.join(&piece) {
                return;
            }
        }
        open.push(piece);
    }
    let flush = |plan: &mut PartPlan, open: &mut Vec<Piece>, open_len: &mut u64| {
        if *open_len > 0 {
            plan.uploaded += *open_len;
            plan.parts.push(Part::Upload(std::mem::take(open)));
            *open_len = 0;
        }
    };
    for piece in pieces {
        match piece {
            Piece::Old {
                from,
                range: mut run,
            } => {
                if open_len > 0 && open_len < min {
                    let take = (min - open_len).min(run.end - run.start);
                    let range = run.start..run.start + take;
                    add(&mut open, &mut open_len, Piece::Old { from, range });
                    run.start += take;
                }
                let len = run.end - run.start;
                if len == 0 {
                    continue;
                }
                if len >= min {
                    flush(&mut plan, &mut open, &mut open_len);
                    // Equal parts of at most 1 GiB (so none is under the minimum).
                    let n = len.div_ceil(COPY_PART);
                    let each = len.div_ceil(n);
                    let mut at = run.start;
                    while at < run.end {
                        let end = (at + each).min(run.end);
                        plan.parts.push(Part::Copy {
                            from,
                            range: at..end,
                        });
                        plan.copied += end - at;
                        at = end;
                    }
                } else {
                    add(&mut open, &mut open_len, Piece::Old { from, range: run });
                    if open_len >= max_upload {
                        flush(&mut plan, &mut open, &mut open_len);
                    }
                }
            }
            mut piece => {
                while piece.len() > 0 {
                    let (head, rest) = piece.split(max_upload - open_len);
                    add(&mut open, &mut open_len, head);
                    if open_len >= max_upload {
                        flush(&mut plan, &mut open, &mut open_len);
                    }
                    piece = rest;
                }
            }
        }
    }
    flush(&mut plan, &mut open, &mut open_len);
    plan
}

/// The new object's layout and parts: its tensors in the old object's
/// order, a same-size overwrite in its place (`source_order`: runs of it
/// stay whole, so the server copies them), the header padded to the old
/// one's length where it fits (every kept tensor stays at its offset, and
/// so do its cached chunks), else with room to grow.
pub(super) struct RemoteWay;

impl CommitWay for RemoteWay {
    fn plan(
        &self,
        new: &NewState,
        _why_not: &str,
    ) -> Result<(Layout, Box<dyn PlannedWay>), Declined> {
        plan(new)
    }
}

fn plan(new: &NewState) -> Result<(Layout, Box<dyn PlannedWay>), Declined> {
    let source = new.source;
    let object = source.remote_object().ok_or("a local file")?;
    if source.header().is_gguf() {
        return Err("GGUF objects are read-only (commits to S3 write safetensors)".into());
    }
    let (layout, pieces, others) = if new.options.compact {
        let layout = new.reference.clone();
        let (pieces, others) = pieces_of(new, &layout);
        (layout, pieces, others)
    } else {
        // (A same-size overwrite keeps its place: nothing after it moves.)
        let (_, order) = source_order(new, true);
        let tensors = tensors_in_order(new, &order)?;
        let header =
            crate::format::header_bytes(&tensors, new.metadata).map_err(|e| e.to_string())?;
        let mut layout = Layout {
            header,
            tensors,
            source_index: order,
            end_pad: 0,
        };
        let old_len = source.header().data_start();
        let new_len = layout.header.len() as u64;
        if new_len <= old_len {
            layout.header.resize(old_len as usize, b' ');
            let room = old_len - crate::format::PREFIX_LEN;
            layout.header[..8].copy_from_slice(&room.to_le_bytes());
        } else {
            crate::format::writer::leave_room(&mut layout);
        }
        let (pieces, others) = pieces_of(new, &layout);
        (layout, pieces, others)
    };
    let min = min_part();
    let mut max_upload = UPLOAD_PART;
    let mut parts = plan_parts(pieces.clone(), min, max_upload);
    while parts.parts.len() > MAX_PARTS && max_upload < MAX_PART {
        max_upload = (max_upload * 2).min(MAX_PART);
        parts = plan_parts(pieces.clone(), min, max_upload);
    }
    if parts.parts.len() > MAX_PARTS {
        return Err(format!(
            "the new object would take {} parts (S3 allows {MAX_PARTS})",
            parts.parts.len()
        )
        .into());
    }
    let if_match = match new.options.force {
        true => None,
        false => object.etag().map(str::to_string),
    };
    Ok((
        layout,
        Box::new(RemotePlan {
            parts,
            others,
            if_match,
            record: new.upload_record.clone(),
        }),
    ))
}

/// A new object at a remote source's key, made of uploaded parts and
/// server-side copies of the old one, conditional on the ETag mounted
/// (None: `--force`); `record`: where the upload's id is recorded.
struct RemotePlan {
    parts: PartPlan,
    /// The other objects parts copy from (`Piece::Old`).
    others: Vec<Arc<SourceFile>>,
    if_match: Option<String>,
    record: Option<(Arc<Folder>, String)>,
}

impl PlannedWay for RemotePlan {
    fn describe(&self, _file_len: u64) -> String {
        describe(&self.parts)
    }

    fn write(
        self: Box<Self>,
        plan: &CommitPlan,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Box<dyn Landing>, CommitError> {
        let started = std::time::Instant::now();
        let RemotePlan {
            parts,
            others,
            if_match,
            record,
        } = *self;
        let record = record.ok_or_else(|| CommitError::ReadOnly {
            file: plan.source.path().to_path_buf(),
        })?;
        let job = RemoteJob::new(
            plan.source.clone(),
            plan.layout.header.clone(),
            plan.inputs.clone(),
            (parts, others),
            if_match,
            record,
        );
        job.send_parts(progress)?;
        info!(
            file = %plan.source.path().display(),
            elapsed = ?started.elapsed(),
            "commit: parts sent"
        );
        Ok(Box::new(job))
    }
}

/// The new object as pieces: the header, then each tensor's bytes (runs
/// of the old object, or of another object of the same bucket that a
/// tensor moved from, as `Old`, joined where they follow each other); and
/// those other objects (`Old`'s `from` k is the k-th).
fn pieces_of(new: &NewState, layout: &Layout) -> (Vec<Piece>, Vec<Arc<SourceFile>>) {
    let source = new.source;
    let mut others: Vec<Arc<SourceFile>> = Vec::new();
    let mut from_of = |src: &Arc<SourceFile>| -> Option<u32> {
        if Arc::ptr_eq(src, source) {
            return Some(0);
        }
        // Another shard of the folder: the server copies from it, only
        // from the version mounted.
        let (mine, theirs) = (source.remote_object()?, src.remote_object()?);
        if !Arc::ptr_eq(mine.remote(), theirs.remote()) || theirs.etag().is_none() {
            return None;
        }
        let k = match others.iter().position(|o| Arc::ptr_eq(o, src)) {
            Some(k) => k,
            None => {
                others.push(src.clone());
                others.len() - 1
            }
        };
        Some(k as u32 + 1)
    };
    let mut pieces = vec![Piece::Header(0..layout.header.len() as u64)];
    for (placed, &k) in layout.tensors.iter().zip(&layout.source_index) {
        let len = placed.nbytes();
        // A source tensor is the server's to copy; so is a partly staged
        // one, but for its staged blocks.
        let runs = match &new.inputs[k] {
            Bytes::Patched(p) => p.runs(),
            _ => Vec::new(),
        };
        let old = new.inputs[k]
            .source_tensor()
            .and_then(|(src, i)| Some((from_of(src)?, src.tensor_range(i as usize).start)));
        let mut these = Vec::new();
        match old {
            Some((from, at)) => {
                let mut done = 0;
                for (a, b) in runs.into_iter().chain(std::iter::once((len, len))) {
                    if a > done {
                        these.push(Piece::Old {
                            from,
                            range: at + done..at + a,
                        });
                    }
                    if b > a {
                        these.push(Piece::Input { k, range: a..b });
                    }
                    done = b;
                }
            }
            None => these.push(Piece::Input { k, range: 0..len }),
        }
        for piece in these {
            let last = pieces.last_mut().expect("the header");
            if !last.join(&piece) {
                pieces.push(piece);
            }
        }
    }
    (pieces, others)
}

pub fn describe(parts: &PartPlan) -> String {
    match parts.single_put() {
        true => format!(
            "remote PutObject ({} uploaded, conditional on the version mounted)",
            human_bytes(parts.uploaded)
        ),
        false => format!(
            "remote multipart ({} uploaded, {} copied by the server, {} parts)",
            human_bytes(parts.uploaded),
            human_bytes(parts.copied),
            parts.parts.len()
        ),
    }
}

/// A remote commit under way: its parts sent by `send_parts`, completed
/// by `land`, aborted by `remove`.
pub struct RemoteJob {
    pub source: Arc<SourceFile>,
    header: Vec<u8>,
    inputs: Vec<Bytes>,
    parts: PartPlan,
    /// The other objects of the bucket that parts copy from (`Piece::Old`).
    others: Vec<Arc<SourceFile>>,
    /// The ETag the completion is conditional on (None: `--force`).
    if_match: Option<String>,
    /// Where the upload's id is recorded (the folder, the file's name).
    record: (Arc<Folder>, String),
    upload: Mutex<Option<String>>,
    done: Mutex<Vec<DonePart>>,
    /// The whole body of a new object put whole (built once: its ETag is
    /// recorded before it is sent).
    single: std::sync::OnceLock<bytes::Bytes>,
    /// The new object, once completed and opened.
    pub landed: Mutex<Option<RemoteObject>>,
}

fn remote_err(file: &std::path::Path) -> impl Fn(S3Error) -> CommitError + '_ {
    move |e| match e {
        S3Error::Precondition { .. } => CommitError::RemoteConflict {
            file: file.to_path_buf(),
        },
        e => CommitError::Remote {
            file: file.to_path_buf(),
            source: e,
        },
    }
}

impl RemoteJob {
    pub(super) fn new(
        source: Arc<SourceFile>,
        header: Vec<u8>,
        inputs: Vec<Bytes>,
        (parts, others): (PartPlan, Vec<Arc<SourceFile>>),
        if_match: Option<String>,
        record: (Arc<Folder>, String),
    ) -> RemoteJob {
        RemoteJob {
            source,
            header,
            inputs,
            parts,
            others,
            if_match,
            record,
            upload: Mutex::new(None),
            done: Mutex::new(Vec::new()),
            single: std::sync::OnceLock::new(),
            landed: Mutex::new(None),
        }
    }

    fn object(&self) -> &RemoteObject {
        self.source.remote_object().expect("a remote source")
    }

    /// The object `Piece::Old`'s `from` names.
    fn object_from(&self, from: u32) -> &RemoteObject {
        match from {
            0 => self.object(),
            k => self.others[k as usize - 1]
                .remote_object()
                .expect("a remote object"),
        }
    }

    fn writer(&self) -> Result<&Arc<S3Writer>, CommitError> {
        self.object()
            .remote()
            .writer()
            .ok_or_else(|| CommitError::ReadOnly {
                file: self.source.path().to_path_buf(),
            })
    }

    fn file(&self) -> &std::path::Path {
        self.source.path()
    }

    /// What the commit sent, in words (after it).
    pub fn describe(&self) -> String {
        describe(&self.parts)
    }

    /// A read of the bytes a part keeps failed: if because the version
    /// mounted is gone (replaced: only `--force` gets here), its bytes
    /// cannot be had any more, and the error says so.
    fn read_err(&self, e: std::io::Error) -> CommitError {
        let what = match self.object().replaced() {
            true => format!(
                "{}: the version this mount read is no longer in the store, so the bytes the \
                 commit keeps cannot be read from it (--force cannot rebuild it); unmount with \
                 --discard, or copy the tensors you need out of the mount first",
                self.file().display()
            ),
            false => format!("{}: reading the bytes of a part", self.file().display()),
        };
        CommitError::Io { what, source: e }
    }

    /// The bytes of an uploaded part.
    fn body(&self, pieces: &[Piece]) -> Result<bytes::Bytes, CommitError> {
        let len: u64 = pieces.iter().map(Piece::len).sum();
        let mut out = Vec::with_capacity(len as usize);
        for piece in pieces {
            match piece {
                Piece::Header(r) => {
                    out.extend_from_slice(&self.header[r.start as usize..r.end as usize])
                }
                Piece::Old { from, range: r } => {
                    let got = self
                        .object_from(*from)
                        .read(r.clone())
                        .map_err(|e| self.read_err(e))?;
                    out.extend_from_slice(&got);
                }
                Piece::Input { k, range } => {
                    let at = out.len();
                    out.resize(at + (range.end - range.start) as usize, 0);
                    self.inputs[*k]
                        .read_exact_at(range.start, &mut out[at..])
                        .map_err(|e| self.read_err(e))?;
                }
            }
        }
        Ok(bytes::Bytes::from(out))
    }

    /// Step 2: the upload's parts, sent (nothing for a PutObject, which is
    /// sent whole by `land`). On failure the upload is aborted.
    pub(super) fn send_parts(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<(), CommitError> {
        if self.parts.single_put() {
            return Ok(());
        }
        let done = self.send_parts_or_fail(progress);
        if done.is_err() {
            self.abort();
        }
        done
    }

    fn send_parts_or_fail(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<(), CommitError> {
        let writer = self.writer()?;
        let object = self.object();
        let key = object.path();
        let err = remote_err(self.file());
        let remote = object.remote();
        // A key that holds another version already: refused before
        // anything is sent.
        still_mounted(remote, key, self.if_match.as_deref(), self.file())?;
        self.write_record(None)?;
        let upload = remote.run(writer.create_upload(key)).map_err(&err)?;
        *self.upload.lock_anyway() = Some(upload.clone());
        self.write_record(Some(&upload))?;
        let total = self.parts.uploaded + self.parts.copied;
        let mut sent = 0;
        // Uploaded parts built here one by one (in memory) and sent a few
        // at once; then the copies, more at once (a copy of gigabytes takes
        // the server a while).
        let mut copies = Vec::new();
        let mut sending = std::collections::VecDeque::new();
        let wait = |handle: tokio::task::JoinHandle<Result<DonePart, S3Error>>| {
            remote.run(handle).unwrap_or_else(|e| {
                Err(S3Error::Transport {
                    op: "UploadPart",
                    why: e.to_string(),
                })
            })
        };
        let mut failed = None;
        for (n, part) in self.parts.parts.iter().enumerate() {
            let number = n as u32 + 1;
            let pieces = match part {
                Part::Copy { from, range } => {
                    copies.push((number, *from, range.clone()));
                    continue;
                }
                Part::Upload(pieces) => pieces,
            };
            let body = crate::testpoint::point("remote:part")
                .map_err(io_err("sending a part"))
                .and_then(|()| self.body(pieces));
            let body = match body {
                Ok(body) => body,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            let (w, k, u) = (writer.clone(), key.clone(), upload.clone());
            sending.push_back((
                part.len(),
                remote.spawn(async move { w.upload_part(&k, &u, number, body).await }),
            ));
            while sending.len() >= UPLOADS_AT_ONCE {
                let (len, handle) = sending.pop_front().expect("one in flight");
                match wait(handle) {
                    Ok(done) => {
                        self.done.lock_anyway().push(done);
                        sent += len;
                        progress(sent, total);
                    }
                    Err(e) => {
                        failed = Some(err(e));
                        break;
                    }
                }
            }
            if failed.is_some() {
                break;
            }
        }
        // Every part sent is answered before anything else (an abort must
        // not race a part still going up).
        for (len, handle) in sending {
            match wait(handle) {
                Ok(done) if failed.is_none() => {
                    self.done.lock_anyway().push(done);
                    sent += len;
                    progress(sent, total);
                }
                Ok(_) => {}
                Err(e) => {
                    failed.get_or_insert(err(e));
                }
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if !copies.is_empty() {
            crate::testpoint::point("remote:copy").map_err(io_err("copying parts"))?;
        }
        let copied = remote.run(async {
            use futures::StreamExt;
            futures::stream::iter(copies.into_iter().map(|(number, from, range)| {
                let from = self.object_from(from);
                writer.copy_part(key, &upload, number, from.path(), from.etag(), range)
            }))
            .buffer_unordered(COPIES_AT_ONCE)
            .collect::<Vec<_>>()
            .await
        });
        for done in copied {
            self.done.lock_anyway().push(done.map_err(&err)?);
        }
        progress(total, total);
        Ok(())
    }

    /// Step 3: the new object, made the one at the key, only if the key
    /// still holds the version mounted (unless forced): a HEAD right before
    /// completing, and `If-Match` on the completion (or the PutObject) for
    /// the stores that honour it. Then the new object is opened.
    fn complete(&self) -> Result<(), CommitError> {
        let writer = self.writer()?;
        let object = self.object();
        let key = object.path();
        let remote = object.remote();
        let err = remote_err(self.file());
        crate::testpoint::point("remote:complete").map_err(io_err("completing the upload"))?;
        still_mounted(remote, key, self.if_match.as_deref(), self.file())?;
        let if_match = self.if_match.as_deref();
        // The ETag the new object will have (S3's: an MD5 of the body, or of
        // the parts' MD5s), to recognise it if the answer is lost.
        let expected = self.expected_etag()?;
        let done = match self.upload.lock_anyway().clone() {
            None => remote.run(writer.put(key, self.single_body()?.clone(), if_match)),
            Some(upload) => {
                let parts = self.parts_done();
                remote.run(writer.complete(key, &upload, &parts, if_match))
            }
        };
        let etag = match done {
            Ok(etag) => etag,
            Err(e) => landed_anyway(remote, key, expected.as_deref(), &e, self.file())
                .ok_or_else(|| err(e))?,
        };
        *self.upload.lock_anyway() = None;
        self.remove_record();
        info!(file = %self.file().display(), etag, "committed to the store");
        // (A test stops here: one shard of a folder landed, the next not yet.)
        let _ = crate::testpoint::point("remote:completed");
        // The object changed: whatever fails from here, the commit landed
        // (left without an object, `finish` says it was committed but not
        // mapped, and the mount commits no more).
        let fresh = match remote.open(key) {
            Ok((fresh, _)) if etag.is_empty() || fresh.etag() == Some(etag.as_str()) => fresh,
            Ok(_) => {
                warn!(file = %self.file().display(), "another writer replaced the object right after the commit");
                return Ok(());
            }
            Err(e) => {
                let why = match e {
                    crate::source::remote::OpenError::Fetch(e) => e,
                    crate::source::remote::OpenError::Format(e) => e.to_string(),
                };
                warn!(file = %self.file().display(), "opening the committed object: {why}");
                return Ok(());
            }
        };
        let adopted = fresh.adopt_chunks(object, &self.kept_in_place());
        if adopted > 0 {
            info!(file = %self.file().display(), adopted, "cached chunks kept for the new object");
        }
        *self.landed.lock_anyway() = Some(fresh);
        Ok(())
    }

    /// The body of a new object put whole.
    fn single_body(&self) -> Result<&bytes::Bytes, CommitError> {
        if let Some(body) = self.single.get() {
            return Ok(body);
        }
        let body = self.body(match self.parts.parts.first() {
            Some(Part::Upload(pieces)) => pieces,
            _ => &[],
        })?;
        Ok(self.single.get_or_init(|| body))
    }

    /// The parts sent, in order.
    fn parts_done(&self) -> Vec<DonePart> {
        let mut parts = self.done.lock_anyway().clone();
        parts.sort_by_key(|p| p.number);
        parts
    }

    /// The ETag the new object will have (S3's: an MD5 of the body, or of
    /// the parts' MD5s), to recognise it once landed.
    fn expected_etag(&self) -> Result<Option<String>, CommitError> {
        Ok(match self.upload.lock_anyway().is_some() {
            false => Some(s3::put_etag(self.single_body()?)),
            true => s3::multipart_etag(&self.parts_done()),
        })
    }

    /// The ranges of the new object that hold the old object's bytes at
    /// their old offsets (their cached chunks stay good).
    fn kept_in_place(&self) -> Vec<Range<u64>> {
        let mut kept: Vec<Range<u64>> = Vec::new();
        let mut at = 0;
        let mut keep = |from: &Range<u64>, at: u64| {
            if from.start == at {
                match kept.last_mut() {
                    Some(last) if last.end == from.start => last.end = from.end,
                    _ => kept.push(from.clone()),
                }
            }
        };
        for part in &self.parts.parts {
            match part {
                Part::Copy { from: 0, range } => keep(range, at),
                Part::Copy { .. } => {}
                Part::Upload(pieces) => {
                    let mut within = at;
                    for piece in pieces {
                        if let Piece::Old { from: 0, range } = piece {
                            keep(range, within);
                        }
                        within += piece.len();
                    }
                }
            }
            at += part.len();
        }
        kept
    }

    /// Forgets a commit that will not land: its upload aborted (the parts
    /// sent are freed), its record removed.
    fn abort(&self) {
        if let Some(upload) = self.upload.lock_anyway().take() {
            let object = self.object();
            match self
                .writer()
                .map(|w| object.remote().run(w.abort(object.path(), &upload)))
            {
                Ok(Ok(())) => info!(file = %self.file().display(), "upload aborted"),
                Ok(Err(e)) => {
                    // The record stays: the next mount aborts it.
                    warn!(file = %self.file().display(), "aborting the upload: {e}");
                    return;
                }
                Err(_) => return,
            }
        }
        self.remove_record();
    }

    /// Records the upload (its id once known) in the cache folder, durably.
    fn write_record(&self, upload: Option<&str>) -> Result<(), CommitError> {
        let (folder, name) = &self.record;
        let object = self.object();
        let text = format!(
            "{}\n{}\n{}\n",
            object.url(),
            object.path(),
            upload.unwrap_or("")
        );
        let tmp = format!("{name}.tmp");
        let path = folder.path.join(name);
        let what = |e| io_err(format!("{}: recording the upload", path.display()))(e);
        folder.unlink_spent(OsStr::new(&tmp));
        let f = folder
            .open_file(
                OsStr::new(&tmp),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
                0o600,
            )
            .map_err(&what)?;
        f.write_all_at(text.as_bytes(), 0).map_err(&what)?;
        f.sync_all().map_err(&what)?;
        folder
            .rename(OsStr::new(&tmp), OsStr::new(name))
            .map_err(&what)?;
        folder.sync().map_err(&what)
    }

    fn remove_record(&self) {
        let (folder, name) = &self.record;
        folder.unlink_spent(OsStr::new(name));
        let _ = folder.sync();
    }
}

impl Landing for RemoteJob {
    fn reads_as(&self) -> Option<Result<Header, CommitError>> {
        let len = self.parts.parts.iter().map(|p| p.len()).sum();
        Some(
            Header::parse_any_prefix(&self.header, len).map_err(|error| {
                CommitError::WouldBeRefused {
                    file: self.source.path().to_path_buf(),
                    error,
                }
            }),
        )
    }

    /// The store names the new version only once it is made: no version
    /// seen later is taken for it (ino 0).
    fn stat(&self) -> FileStat {
        FileStat {
            ino: 0,
            ..*self.source.stat()
        }
    }

    fn target(&self) -> PathBuf {
        self.source.path().to_path_buf()
    }

    /// (Its upload was recorded in the cache folder when it began: a crash
    /// before any object of the commit landed aborts it.) Once one lands,
    /// the next mount completes the others from this record.
    fn record(&self, renames: &mut Renames, _dir: &StagingDir) -> Result<(), CommitError> {
        let object = self.object();
        // Every object of the commit is asked before the first lands: a
        // shard or index replaced behind the mount stops it all.
        still_mounted(
            object.remote(),
            object.path(),
            self.if_match.as_deref(),
            self.file(),
        )?;
        renames.remote.push(RemoteLanding {
            url: object.url().to_string(),
            key: object.path().to_string(),
            if_match: self.if_match.clone(),
            expected: self.expected_etag()?,
            upload: self.upload.lock_anyway().clone(),
            parts: self
                .parts_done()
                .into_iter()
                .map(|p| (p.number, p.etag))
                .collect(),
            text: None,
        });
        Ok(())
    }

    fn land(&self, _dir: &StagingDir) -> Result<(), Unlanded> {
        self.complete().map_err(Unlanded::unchanged)
    }

    fn remove(&self) {
        self.abort()
    }

    fn landed_words(&self) -> Option<String> {
        Some(self.describe())
    }

    fn fresh(&self, _old: &SourceFile, header: Header) -> Result<SourceFile, CommitError> {
        let object = self.landed.lock_anyway().take();
        let object = object.ok_or_else(|| CommitError::Io {
            what: self.source.path().display().to_string(),
            source: std::io::Error::other("the remote commit left no object"),
        })?;
        Ok(SourceFile::remote(object, header))
    }
}

/// The key still holds the version mounted (`want`; None: forced), as a
/// HEAD says: else the lost-update refusal.
fn still_mounted(
    remote: &crate::source::remote::Remote,
    key: &object_store::path::Path,
    want: Option<&str>,
    file: &std::path::Path,
) -> Result<(), CommitError> {
    let (Some(want), Some(writer)) = (want, remote.writer()) else {
        return Ok(());
    };
    let now = remote.run(writer.etag_now(key)).map_err(remote_err(file))?;
    match now.as_deref() == Some(want) {
        true => Ok(()),
        false => Err(CommitError::RemoteConflict {
            file: file.to_path_buf(),
        }),
    }
}

/// A request that makes the object at `key` the one whose ETag is
/// `expected` failed (`e`): the store may have taken it and its answer been
/// lost (a time-out, a dropped connection; sent again, it finds no upload,
/// or a changed ETag). The key says which: its ETag if it holds that object.
fn landed_anyway(
    remote: &crate::source::remote::Remote,
    key: &object_store::path::Path,
    expected: Option<&str>,
    e: &S3Error,
    file: &std::path::Path,
) -> Option<String> {
    let now = remote.run(remote.writer()?.etag_now(key)).ok()??;
    (Some(now.as_str()) == expected).then(|| {
        warn!(file = %file.display(), "{e}; but the key holds the new object: committed");
        now
    })
}

/// The lost-update refusal of an index says so (`--force` does help there).
fn as_index_conflict(e: CommitError) -> CommitError {
    match e {
        CommitError::RemoteConflict { file } => CommitError::IndexConflict { file },
        e => e,
    }
}

/// A `*.index.json` object of a folder of shards in a store: where it is,
/// and the ETag of the version shown (a commit's PUT of it is conditional
/// on that ETag, and sets it to the new one).
#[derive(Clone)]
pub struct RemoteIndex {
    pub remote: Arc<crate::source::remote::Remote>,
    pub path: object_store::path::Path,
    pub etag: Arc<Mutex<Option<String>>>,
}

impl RemoteIndex {
    /// Whether the key holds another version than the one shown now (a
    /// HEAD; a failed one says no: the commit asks again).
    pub fn changed(&self) -> bool {
        let Some(writer) = self.remote.writer() else {
            return false;
        };
        let shown = self.etag.lock_anyway().clone();
        match self.remote.run(writer.etag_now(&self.path)) {
            Ok(now) => now != shown,
            Err(_) => false,
        }
    }
}

/// An index object of a commit of a folder of shards, put whole after every
/// shard landed, only over the version shown (unless forced).
pub struct IndexPut {
    index: RemoteIndex,
    bytes: bytes::Bytes,
    if_match: Option<String>,
    stat: FileStat,
    /// The shards it lists that the commit does not write: each must still
    /// be the version mounted (unless forced), or the index would list
    /// tensors another writer's object does not hold.
    unwritten: Vec<Arc<SourceFile>>,
    force: bool,
}

impl IndexPut {
    pub fn new(
        index: RemoteIndex,
        bytes: Vec<u8>,
        stat: FileStat,
        unwritten: Vec<Arc<SourceFile>>,
    ) -> IndexPut {
        let if_match = index.etag.lock_anyway().clone();
        IndexPut {
            index,
            bytes: bytes::Bytes::from(bytes),
            if_match,
            stat,
            unwritten,
            force: false,
        }
    }

    /// `--force`: put over whatever is there.
    pub fn forced(mut self, force: bool) -> IndexPut {
        if force {
            self.if_match = None;
            self.force = true;
        }
        self
    }

    fn url(&self) -> String {
        self.index.remote.url(&self.index.path)
    }

    /// The index, and every shard it lists that the commit does not write,
    /// are still the versions mounted (unless forced).
    fn check(&self) -> Result<(), CommitError> {
        let file = PathBuf::from(self.url());
        let remote = &self.index.remote;
        still_mounted(remote, &self.index.path, self.if_match.as_deref(), &file)
            .map_err(as_index_conflict)?;
        for shard in self.unwritten.iter().filter(|_| !self.force) {
            if let Some(o) = shard.remote_object() {
                still_mounted(o.remote(), o.path(), o.etag(), shard.path()).map_err(
                    |e| match e {
                        CommitError::RemoteConflict { file } => {
                            CommitError::ListedShardChanged { file }
                        }
                        e => e,
                    },
                )?;
            }
        }
        Ok(())
    }

    fn put(&self) -> Result<(), CommitError> {
        let remote = &self.index.remote;
        let file = PathBuf::from(self.url());
        let err = remote_err(&file);
        let writer = remote
            .writer()
            .ok_or_else(|| CommitError::ReadOnly { file: file.clone() })?;
        let key = &self.index.path;
        crate::testpoint::point("remote:index").map_err(io_err("putting the index"))?;
        still_mounted(remote, key, self.if_match.as_deref(), &file).map_err(as_index_conflict)?;
        let expected = s3::put_etag(&self.bytes);
        let put = remote.run(writer.put(key, self.bytes.clone(), self.if_match.as_deref()));
        let etag = match put {
            Ok(etag) => etag,
            Err(e) => {
                landed_anyway(remote, key, Some(&expected), &e, &file).ok_or_else(|| err(e))?
            }
        };
        *self.index.etag.lock_anyway() = Some(etag);
        info!(file = %file.display(), "index put to the store");
        Ok(())
    }
}

impl Landing for IndexPut {
    fn reads_as(&self) -> Option<Result<Header, CommitError>> {
        None
    }

    fn stat(&self) -> FileStat {
        FileStat {
            len: self.bytes.len() as u64,
            ..self.stat
        }
    }

    fn target(&self) -> PathBuf {
        PathBuf::from(self.url())
    }

    fn record(&self, renames: &mut Renames, _dir: &StagingDir) -> Result<(), CommitError> {
        self.check()?;
        renames.remote.push(RemoteLanding {
            url: self.url(),
            key: self.index.path.to_string(),
            if_match: self.if_match.clone(),
            expected: Some(s3::put_etag(&self.bytes)),
            upload: None,
            parts: Vec::new(),
            // (An index is JSON text that stfs wrote.)
            text: Some(String::from_utf8_lossy(&self.bytes).into_owned()),
        });
        Ok(())
    }

    fn land(&self, _dir: &StagingDir) -> Result<(), Unlanded> {
        self.put().map_err(Unlanded::unchanged)
    }

    /// (Nothing was sent before `land`.)
    fn remove(&self) {}

    fn fresh(&self, _old: &SourceFile, _header: Header) -> Result<SourceFile, CommitError> {
        Err(CommitError::Io {
            what: self.url(),
            source: std::io::Error::other("an index is not a checkpoint"),
        })
    }
}

/// At mount, before the objects are read: the commits that a crash (or a
/// failure) interrupted after one of their objects landed, finished from
/// their records (`Renames::remote`) in the staging folders of dead
/// daemons: the other shards' uploads completed, each only over the
/// version the commit replaced, then the indexes put, only once every
/// shard is new. A commit none of whose objects landed is left to
/// `abort_interrupted` (the object stays the old one). Returns notes and
/// the uploads now complete; an error if the store could not be asked (a
/// writable mount then waits: its edits would be taken back over objects
/// that the record may still change).
pub fn finish_interrupted(
    base: &Arc<Folder>,
    stem: &str,
    writer: &S3Writer,
    remote: &crate::source::remote::Remote,
) -> Result<(Vec<String>, Vec<String>), String> {
    let (mut notes, mut done) = (Vec::new(), Vec::new());
    let (dirs, _) = crate::checkpoint::staging::kept(base, stem);
    for dir in dirs {
        let record = match Renames::read(&dir) {
            Ok(Some(r)) if !r.remote.is_empty() => r,
            Ok(_) => continue,
            Err(why) => {
                notes.push(format!(
                    "the record of an interrupted commit cannot be used, {why}: nothing was \
                     completed from it and it is kept"
                ));
                continue;
            }
        };
        match finish_record(&record.remote, writer, remote) {
            Ok((finished, uploads, all_landed)) => {
                notes.extend(finished);
                done.extend(uploads);
                Renames::clear(&dir);
                if all_landed {
                    drop_landed_journals(&dir, record.commit);
                }
            }
            Err(why) => {
                return Err(format!(
                    "{why}; mount again to finish it (a read-only mount, -o ro, does not need it)"
                ));
            }
        }
    }
    Ok((notes, done))
}

/// The journals in `dir` that hold nothing but what commit `commit` put in
/// the store (no edit after its plan), removed: their edits are in the new
/// objects, which the journals' sources no longer are (a staging folder
/// left with no journal goes at the next mount).
fn drop_landed_journals(dir: &StagingDir, commit: u64) {
    use crate::checkpoint::journal::{self, Record};
    let Ok(folder) = dir.folder() else {
        return;
    };
    for name in dir.list().unwrap_or_default() {
        if !name.as_encoded_bytes().ends_with(b".journal") {
            continue;
        }
        let Ok(f) = folder.open_file(&name, libc::O_RDONLY | libc::O_NOFOLLOW, 0) else {
            continue;
        };
        let mut text = Vec::new();
        if std::io::Read::read_to_end(&mut &f, &mut text).is_err() {
            continue;
        }
        let Ok(replay) = journal::read(&text) else {
            continue;
        };
        let planned = replay
            .records
            .iter()
            .rposition(|r| matches!(r, Record::Plan { commit: c } if *c == commit));
        let later = |k: usize| {
            replay.records[k + 1..]
                .iter()
                .any(|r| !matches!(r, Record::Landing { .. }))
        };
        if planned.is_some_and(|k| !later(k)) {
            folder.unlink_spent(&name);
        }
    }
    let _ = folder.sync();
}

/// One commit's objects finished (see `finish_interrupted`): its notes,
/// the uploads that are complete now, and whether every object is new now;
/// or why the store could not be asked (the record stays for the next
/// mount).
fn finish_record(
    objects: &[RemoteLanding],
    writer: &S3Writer,
    remote: &crate::source::remote::Remote,
) -> Result<(Vec<String>, Vec<String>, bool), String> {
    let key_of = |o: &RemoteLanding| {
        object_store::path::Path::parse(&o.key)
            .map_err(|_| format!("{}: a commit record names a bad key {:?}", o.url, o.key))
    };
    let mut now = Vec::new();
    for o in objects {
        let etag = remote.run(writer.etag_now(&key_of(o)?)).map_err(|e| {
            format!(
                "{}: an interrupted commit could not be finished ({e})",
                o.url
            )
        })?;
        now.push(etag);
    }
    let landed =
        |o: &RemoteLanding, now: &Option<String>| o.expected.is_some() && *now == o.expected;
    if !objects.iter().zip(&now).any(|(o, n)| landed(o, n)) {
        // Nothing changed: the uploads are aborted.
        return Ok((Vec::new(), Vec::new(), false));
    }
    let mut notes = Vec::new();
    let mut complete = Vec::new();
    let mut all_shards = true;
    let mut all_landed = true;
    for (o, n) in objects.iter().zip(&now) {
        if landed(o, n) {
            complete.extend(o.upload.clone());
            continue;
        }
        let key = key_of(o)?;
        let over_old = o.if_match.is_none() || *n == o.if_match;
        let done = match (&o.upload, &o.text) {
            (_, _) if !over_old => Err(format!(
                "{}: not finished: the object changed since the commit began (the commit's \
                 other objects are new)",
                o.url
            )),
            (Some(upload), _) => {
                let parts: Vec<DonePart> = o
                    .parts
                    .iter()
                    .map(|(number, etag)| DonePart {
                        number: *number,
                        etag: etag.clone(),
                    })
                    .collect();
                remote
                    .run(writer.complete(&key, upload, &parts, o.if_match.as_deref()))
                    .map(|_| ())
                    .map_err(|e| format!("{}: its upload could not be completed ({e})", o.url))
            }
            (None, Some(text)) if all_shards => remote
                .run(writer.put(
                    &key,
                    bytes::Bytes::from(text.clone()),
                    o.if_match.as_deref(),
                ))
                .map(|_| ())
                .map_err(|e| format!("{}: could not be put ({e})", o.url)),
            (None, Some(_)) => Err(format!(
                "{}: left as it was: a shard of the commit could not be finished, and this \
                 index would name its new tensors",
                o.url
            )),
            (None, None) => Err(format!(
                "{}: its new version was put whole and is not in the record (it stays as it is)",
                o.url
            )),
        };
        match done {
            Ok(()) => {
                complete.extend(o.upload.clone());
                notes.push(format!(
                    "{}: finished a commit that was interrupted after another of its objects \
                     landed",
                    o.url
                ))
            }
            Err(why) => {
                all_shards &= o.text.is_some();
                all_landed = false;
                warn!("{why}");
                notes.push(why);
            }
        }
    }
    Ok((notes, complete, all_landed))
}

/// The name of an upload record of this mount (`stem`: the staging stem
/// of the mount; `object`: the object's name, several shards of a folder
/// being committed at once).
pub fn record_name(stem: &str, commit: u64, object: &OsStr) -> String {
    let tag = crate::checkpoint::in_place::sha256_hex(&[object.as_encoded_bytes()]);
    format!(
        "{stem}.upload-{}-{commit}-{}",
        std::process::id(),
        &tag[..8]
    )
}

/// At mount: the uploads of commits a crash interrupted (recorded in
/// `folder` under `stem`), aborted, so that no parts stay to be paid for.
/// Records of a daemon still running are left alone.
pub fn abort_interrupted(
    folder: &Folder,
    stem: &str,
    writer: &S3Writer,
    remote: &crate::source::remote::Remote,
    complete: &[String],
) -> Vec<String> {
    let mut notes = Vec::new();
    let prefix = format!("{stem}.upload-");
    for name in folder.entries() {
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let name = name.to_string_lossy().into_owned();
        if rest.ends_with(".tmp") {
            folder.unlink_spent(OsStr::new(&name));
            continue;
        }
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        let alive = pid.is_some_and(|p| !crate::checkpoint::recover::process_gone(p));
        if alive && pid != Some(std::process::id()) {
            continue;
        }
        let text = folder
            .open_file(OsStr::new(&name), libc::O_RDONLY, 0)
            .and_then(|f| {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut &f, &mut s).map(|_| s)
            })
            .unwrap_or_default();
        let mut lines = text.lines();
        let (url, key, upload) = (
            lines.next().unwrap_or(""),
            lines.next().unwrap_or(""),
            lines.next().unwrap_or(""),
        );
        if upload.is_empty() || complete.iter().any(|c| c == upload) {
            // Interrupted before the store named the upload (it holds no
            // parts), or completed since (`finish_interrupted`).
            folder.unlink_spent(OsStr::new(&name));
            continue;
        }
        // (The key as recorded: parsed, not encoded again.)
        let Ok(key) = object_store::path::Path::parse(key) else {
            notes.push(format!(
                "{url}: an upload record names a bad key {key:?}; left as it is"
            ));
            continue;
        };
        match remote.run(writer.abort(&key, upload)) {
            Ok(()) => {
                folder.unlink_spent(OsStr::new(&name));
                notes.push(format!(
                    "{url}: the upload of a commit that was interrupted was aborted (the parts it \
                     held are freed)"
                ));
            }
            Err(e) => notes.push(format!(
                "{url}: the upload {upload} of an interrupted commit could not be aborted ({e}); \
                 the next mount tries again"
            )),
        }
    }
    let _ = folder.sync();
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn old(r: Range<u64>) -> Piece {
        Piece::Old { from: 0, range: r }
    }

    #[test]
    fn a_header_edit_uploads_the_header_topped_up_and_copies_the_rest() {
        let plan = plan_parts(
            vec![Piece::Header(0..4096), old(4096..100 * MIB)],
            5 * MIB,
            64 * MIB,
        );
        assert_eq!(
            plan.parts,
            vec![
                Part::Upload(vec![Piece::Header(0..4096), old(4096..5 * MIB)]),
                Part::Copy {
                    from: 0,
                    range: 5 * MIB..100 * MIB
                }
            ]
        );
        assert_eq!((plan.uploaded, plan.copied), (5 * MIB, 95 * MIB));
    }

    #[test]
    fn a_tensor_moved_from_another_shard_is_copied_from_that_object() {
        // Old bytes at the same offsets in two objects are two runs, never one.
        let other = |r: Range<u64>| Piece::Old { from: 1, range: r };
        let plan = plan_parts(
            vec![
                Piece::Header(0..5 * MIB),
                old(5 * MIB..20 * MIB),
                other(20 * MIB..30 * MIB),
            ],
            5 * MIB,
            64 * MIB,
        );
        assert_eq!(
            &plan.parts[1..],
            &[
                Part::Copy {
                    from: 0,
                    range: 5 * MIB..20 * MIB
                },
                Part::Copy {
                    from: 1,
                    range: 20 * MIB..30 * MIB
                }
            ]
        );
    }

    #[test]
    fn short_runs_are_uploaded_long_ones_copied_in_parts_of_1_gib_at_most() {
        let plan = plan_parts(
            vec![
                Piece::Header(0..10 * MIB),
                old(10 * MIB..11 * MIB),
                Piece::Input {
                    k: 3,
                    range: 0..MIB,
                },
                old(20 * MIB..(20 << 10) * MIB),
            ],
            5 * MIB,
            64 * MIB,
        );
        let len = |p: &Part| p.len();
        assert!(matches!(&plan.parts[0], Part::Upload(p) if p.len() == 3));
        assert_eq!(len(&plan.parts[0]), 12 * MIB);
        let copies: Vec<_> = plan.parts[1..].iter().map(len).collect();
        assert!(
            copies.iter().all(|&n| (5 * MIB..=1 << 30).contains(&n)),
            "{copies:?}"
        );
        assert_eq!(copies.len(), 20);
        assert_eq!(
            plan.uploaded + plan.copied,
            12 * MIB + (20 << 10) * MIB - 20 * MIB
        );
    }

    #[test]
    fn a_run_that_tops_up_a_part_and_is_left_short_is_uploaded() {
        let plan = plan_parts(
            vec![
                Piece::Header(0..MIB),
                old(MIB..7 * MIB),
                Piece::Input {
                    k: 0,
                    range: 0..MIB,
                },
            ],
            5 * MIB,
            64 * MIB,
        );
        assert_eq!(plan.parts.len(), 1);
        assert!(plan.single_put());
        assert_eq!(plan.copied, 0);
    }

    #[test]
    fn no_uploaded_part_passes_5_gib() {
        let gib = 1u64 << 30;
        let plan = plan_parts(
            vec![
                Piece::Input {
                    k: 0,
                    range: 0..5 * gib - MIB,
                },
                old(10 * gib..10 * gib + 4 * MIB),
                Piece::Input { k: 1, range: 0..1 },
            ],
            5 * MIB,
            5 * gib,
        );
        let lens: Vec<_> = plan.parts.iter().map(Part::len).collect();
        assert!(lens.iter().all(|&n| n <= 5 * gib), "{lens:?}");
        assert_eq!(lens.iter().sum::<u64>(), 5 * gib + 3 * MIB + 1);
    }

    #[test]
    fn large_new_tensors_go_up_in_parts_of_the_upload_size() {
        let plan = plan_parts(
            vec![
                Piece::Header(0..MIB),
                Piece::Input {
                    k: 0,
                    range: 0..200 * MIB,
                },
            ],
            5 * MIB,
            64 * MIB,
        );
        let lens: Vec<_> = plan.parts.iter().map(Part::len).collect();
        assert_eq!(lens, [64 * MIB, 64 * MIB, 64 * MIB, 9 * MIB]);
        // Every part but the last is at least the minimum.
        let plan = plan_parts(
            vec![
                Piece::Header(0..MIB),
                old(MIB..30 * MIB),
                Piece::Input {
                    k: 1,
                    range: 0..MIB,
                },
                old(31 * MIB..33 * MIB),
                Piece::Input {
                    k: 2,
                    range: 0..MIB,
                },
            ],
            5 * MIB,
            64 * MIB,
        );
        let lens: Vec<_> = plan.parts.iter().map(Part::len).collect();
        assert!(
            lens[..lens.len() - 1].iter().all(|&n| n >= 5 * MIB),
            "{lens:?}"
        );
        assert_eq!(
            lens.iter().sum::<u64>(),
            MIB + 29 * MIB + MIB + 2 * MIB + MIB
        );
    }
}
