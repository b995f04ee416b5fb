//! An upload's parts: where each piece of the new object comes from
//! (the header, staged bytes, a run of an old object), cut and joined
//! into parts S3 takes (5 MiB to 5 GiB, at most 10,000).

use super::*;

/// S3's limits: a part is at least 5 MiB (but the last) and at most 5 GiB;
/// an upload has at most 10,000 parts.
pub const MIN_PART: u64 = 5 << 20;
pub(super) const MAX_PART: u64 = 5 << 30;
/// Server-side copies are cut into parts of at most this (each must end
/// within the request's time limit).
const COPY_PART: u64 = 1 << 30;
pub(super) const MAX_PARTS: usize = 10_000;
/// Uploaded parts are built in memory, each at most this large (more, only
/// where 10,000 parts would not hold the upload otherwise).
pub(super) const UPLOAD_PART: u64 = 64 << 20;
/// Server-side copies in flight at once.
pub(super) const COPIES_AT_ONCE: usize = 8;
/// Uploaded parts in flight at once (each up to 64 MiB in memory).
pub(super) const UPLOADS_AT_ONCE: usize = 4;

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

    pub(super) fn len(&self) -> u64 {
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
    pub(super) fn join(&mut self, next: &Piece) -> bool {
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
    pub(super) fn len(&self) -> u64 {
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
