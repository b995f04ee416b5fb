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

mod index;
mod job;
mod model;
mod parts;
mod record;
#[cfg(test)]
mod tests;

pub use index::*;
pub use job::*;
pub use model::*;
pub use parts::*;
pub use record::*;

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
