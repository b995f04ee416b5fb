//! A remote commit under way (`RemoteJob`): its upload recorded, its
//! parts sent, completed over the version mounted, or aborted.

use super::*;

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

pub(super) fn remote_err(file: &std::path::Path) -> impl Fn(S3Error) -> CommitError + '_ {
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
        let upload = remote
            .run(writer.create_upload(key, object.headers()))
            .map_err(&err)?;
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
            None => {
                let body = self.single_body()?.clone();
                remote.run(writer.put(key, body, if_match, object.headers()))
            }
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
    fn record(&self, renames: &mut Renames, dir: &StagingDir) -> Result<(), CommitError> {
        let object = self.object();
        // Every object of the commit is asked before the first lands: a
        // shard or index replaced behind the mount stops it all.
        still_mounted(
            object.remote(),
            object.path(),
            self.if_match.as_deref(),
            self.file(),
        )?;
        // A shard put whole is put again by the next mount from its bytes
        // kept here (a commit cut short after another shard landed).
        let upload = self.upload.lock_anyway().clone();
        let body = match upload {
            Some(_) => None,
            None => {
                let name = body_name(object.path());
                dir.write_atomic(&name, self.single_body()?)
                    .map_err(io_err(format!("keeping {} for the record", object.url())))?;
                Some(name)
            }
        };
        renames.remote.push(RemoteLanding {
            url: object.url().to_string(),
            key: object.path().to_string(),
            if_match: self.if_match.clone(),
            expected: self.expected_etag()?,
            upload,
            body,
            shard: true,
            headers: object.headers().clone(),
            parts: self
                .parts_done()
                .into_iter()
                .map(|p| (p.number, p.etag))
                .collect(),
            ..Default::default()
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
pub(super) fn still_mounted(
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
pub(super) fn landed_anyway(
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
