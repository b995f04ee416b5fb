//! The in-place planner (docs/ARCHITECTURE.md, "The planner"): where each
//! tensor of a checkpoint's new state goes in the source's own file, as a
//! sequence of named steps, each of which a test can run alone:
//!
//! 1. `keep_source_tensors`: tensors whose bytes are the file's own stay
//!    where they are (and partly staged ones, written block by block);
//! 2. `place_overwrites`: new bytes of a freed range's size go there;
//! 3. `fill_holes_from_tail`: holes left by dropped tensors are filled,
//!    exactly, with tensors moved from the end of the data;
//! 4. `place_appends`: the rest goes at the end, aligned;
//! 5. `fit_header`: the header in the old one's room, or grown at the
//!    file's start by whole blocks; `changed_span`: the part of it written;
//! 6. `writes`: every range whose bytes are not already there, and where
//!    they come from (zeros for the padding around appended tensors).

use std::collections::HashMap;
use std::sync::Arc;

use super::{InPlaceLayout, RangeWrite, WriteFrom};
use crate::checkpoint::Declined;
use crate::format::{Dtype, FormatWriter, Header, Layout, NoFit, PREFIX_LEN, Tensors, byte_len};
use crate::source::{Bytes, SourceFile};

/// The least room an insertion at the file's start leaves in the header.
const HEADER_SPARE: u64 = 64 << 10;

/// An input's name, dtype and shape.
type Spec<'s, 'a> = &'s dyn Fn(usize) -> (&'a str, Dtype, &'a [u64]);

/// Lays out the new state in the source's own file, or says why it cannot
/// be: `spec(k)` is input `k`'s name, dtype and shape, `inputs[k]` its bytes;
/// `held[i]`: source tensor `i`'s bytes are read by a descriptor or another
/// shard, so they must stay where they are; `held_apart[i]`: by a reader
/// other than an input written in part over it (whose reads do not change
/// when its blocks are written over the tensor where it is), so they must
/// stay as they are too. `block`: the filesystem can
/// insert blocks of this size at the file's start, to grow the header.
/// `format` writes the header (and says how tensors are aligned).
#[allow(clippy::too_many_arguments)]
pub fn layout<'a>(
    source: &Arc<SourceFile>,
    count: usize,
    spec: impl Fn(usize) -> (&'a str, Dtype, &'a [u64]),
    inputs: &[Bytes],
    format: &dyn FormatWriter,
    held: &[bool],
    held_apart: &[bool],
    block: Option<u64>,
) -> Result<InPlaceLayout, Declined> {
    let old = source.header();
    same_alignment(old, format)?;
    let mut p = Placement::new(source, count, &spec, inputs, held);
    p.keep_source_tensors(held_apart)?;
    p.place_overwrites()?;
    let dropped = p.dropped();
    let moved = p.fill_holes_from_tail(format.fills_holes())?;
    let by_name = old.gguf.is_none();
    let (end, appended) = p.place_appends(format.alignment(), by_name)?;
    let (tensors, order) = p.in_file_order(by_name)?;
    let fit = fit_header(format, &tensors, old.data_start(), block)?;
    // Offsets in the file as it is now (earlier in-place commits may have
    // inserted bytes at its start since `source` was made).
    let data_start = old.data_start() + source.shift() + fit.inserted;
    let align = format.alignment();
    let end_pad = end.next_multiple_of(align) - end;
    let file_len = data_start + end + end_pad;
    let (header_from, header_write) = header_span(source, &fit);
    // What a reader will see must be what the reference accepts.
    Header::parse_any_prefix(&fit.header, file_len).map_err(|e| format!("internal: {e}"))?;
    let w = p.writes(data_start)?;
    let summary = Summary {
        inserted: fit.inserted,
        overwritten: p.overwrote.len(),
        patched: w.patched,
        appended,
        dropped,
        moved,
    };
    Ok(InPlaceLayout {
        layout: Layout {
            header: fit.header,
            tensors,
            source_index: order,
            end_pad,
        },
        inserted: fit.inserted,
        header_from,
        header_write,
        writes: w.writes,
        shareable: 0,
        file_len,
        bytes: header_write - header_from + w.bytes,
        summary: summary.to_string(),
    })
}

/// A GGUF file whose alignment changes is laid out again, not in place.
fn same_alignment(old: &Header, format: &dyn FormatWriter) -> Result<(), Declined> {
    let old_align = old.gguf.as_ref().map_or(1, |g| g.alignment);
    if format.alignment() != old_align {
        return Err(format!(
            "the alignment changes from {old_align} to {}: the data is laid out again",
            format.alignment()
        )
        .into());
    }
    Ok(())
}

/// The planner's state: where each input goes (a data-relative range) and,
/// for an input that copies bytes of this file, where from.
struct Placement<'p, 'a> {
    source: &'p Arc<SourceFile>,
    old: &'p Header,
    spec: Spec<'p, 'a>,
    inputs: &'p [Bytes],
    held: &'p [bool],
    /// Source tensors whose range an input takes.
    claimed: Vec<bool>,
    place: Vec<Option<(u64, u64)>>,
    /// Data-relative until `writes` makes it a file offset.
    from: Vec<Option<WriteFrom>>,
    /// Inputs whose new bytes went over a freed range of their size.
    overwrote: Vec<usize>,
    /// The padding around appended tensors, each beside an input.
    pads: Vec<(u64, u64, usize)>,
}

impl<'p, 'a> Placement<'p, 'a> {
    fn new(
        source: &'p Arc<SourceFile>,
        count: usize,
        spec: Spec<'p, 'a>,
        inputs: &'p [Bytes],
        held: &'p [bool],
    ) -> Self {
        let old = source.header();
        Placement {
            source,
            old,
            spec,
            inputs: &inputs[..count],
            held,
            claimed: vec![false; old.tensors.len()],
            place: vec![None; count],
            from: vec![None; count],
            overwrote: Vec::new(),
            pads: Vec::new(),
        }
    }

    fn count(&self) -> usize {
        self.place.len()
    }

    fn name(&self, k: usize) -> &'a str {
        (self.spec)(k).0
    }

    fn len_of(&self, k: usize) -> Result<u64, Declined> {
        let (name, dtype, shape) = (self.spec)(k);
        byte_len(dtype, shape).map_err(|_| format!("tensor {name:?} has no valid size").into())
    }

    /// Inputs reading each source tensor (one written in part changes its
    /// bytes only where it is the only one).
    fn readers(&self) -> Vec<usize> {
        let n_old = self.old.tensors.len();
        let mut readers = vec![0usize; n_old];
        for (_, i) in self
            .inputs
            .iter()
            .filter_map(Bytes::source_tensor)
            .filter(|(src, i)| Arc::ptr_eq(src, self.source) && (*i as usize) < n_old)
        {
            readers[i as usize] += 1;
        }
        readers
    }

    /// Step 1. Tensors whose bytes are the source's own stay where they are
    /// (the first name that has them; a second is a copy), and so do source
    /// tensors with some blocks staged (after those: a copy reads the
    /// source's bytes where they are, which their blocks would change; and
    /// only where nothing else reads them), written block by block.
    fn keep_source_tensors(&mut self, held_apart: &[bool]) -> Result<(), Declined> {
        let readers = self.readers();
        let count = self.count();
        for (k, patched) in (0..count)
            .map(|k| (k, false))
            .chain((0..count).map(|k| (k, true)))
        {
            let input = &self.inputs[k];
            let Some((src, i)) = input
                .source_tensor()
                .filter(|_| patched == matches!(input, Bytes::Patched(_)))
            else {
                continue;
            };
            if !Arc::ptr_eq(src, self.source) {
                return Err(format!(
                    "tensor {:?} comes from another file ({})",
                    self.name(k),
                    src.path().display()
                )
                .into());
            }
            let i = i as usize;
            let t = self.old.tensors.get(i);
            if self.len_of(k)? != t.nbytes() {
                return Err(format!("tensor {:?} changes size", self.name(k)).into());
            }
            if t.nbytes() == 0 {
                continue; // no bytes to keep: placed at the end
            }
            if patched && !self.claimed[i] && (held_apart[i] || readers[i] > 1) {
                // (Its blocks would change bytes another reader reads where they are.)
                return Err(format!(
                    "tensor {:?} is written in part over source bytes that are still read (an \
                     open view, or another tensor written over the same source tensor)",
                    self.name(k)
                )
                .into());
            }
            if self.claimed[i] {
                self.from[k] = Some(WriteFrom::Here {
                    offset: t.data_offsets.0,
                });
            } else {
                self.claimed[i] = true;
                self.place[k] = Some(t.data_offsets);
            }
        }
        Ok(())
    }

    /// Step 2. New bytes of a tensor's own size overwrite its old range (a
    /// range that no descriptor still reads), or another freed range of that
    /// size: first by name, then by size.
    fn place_overwrites(&mut self) -> Result<(), Declined> {
        let old = self.old;
        let mut free_by_name = HashMap::new();
        let mut free_by_size: HashMap<u64, Vec<usize>> = HashMap::new();
        for i in (0..old.tensors.len()).rev() {
            if !self.claimed[i] && !self.held[i] && old.tensors.nbytes(i) > 0 {
                free_by_name.insert(old.tensors.name(i), i);
                free_by_size
                    .entry(old.tensors.nbytes(i))
                    .or_default()
                    .push(i);
            }
        }
        for by_name in [true, false] {
            for k in 0..self.count() {
                if self.place[k].is_some() {
                    continue;
                }
                let want = self.len_of(k)?;
                if want == 0 {
                    continue;
                }
                let found = if by_name {
                    free_by_name
                        .get(self.name(k))
                        .copied()
                        .filter(|&i| !self.claimed[i] && old.tensors.nbytes(i) == want)
                } else {
                    let claimed = &self.claimed;
                    free_by_size
                        .get_mut(&want)
                        .and_then(|v| std::iter::from_fn(|| v.pop()).find(|&i| !claimed[i]))
                };
                if let Some(i) = found {
                    self.claimed[i] = true;
                    self.place[k] = Some(old.tensors.get(i).data_offsets);
                    self.overwrote.push(k);
                }
            }
        }
        Ok(())
    }

    /// Source tensors with bytes that no input keeps.
    fn dropped(&self) -> usize {
        (0..self.old.tensors.len())
            .filter(|&i| !self.claimed[i] && self.old.tensors.nbytes(i) > 0)
            .count()
    }

    /// The end of the data as placed so far.
    fn placed_end(&self) -> u64 {
        self.place.iter().flatten().map(|p| p.1).max().unwrap_or(0)
    }

    /// Step 3. What stays must leave no hole: the data section is one run
    /// of tensors. Holes that dropped tensors leave are filled, where they
    /// can be exactly, with the tensors at the end of the data (layers
    /// repeat their shapes), moved there; the end is then cut. Returns how
    /// many tensors moved.
    fn fill_holes_from_tail(&mut self, fills_holes: bool) -> Result<usize, Declined> {
        let holes = self.holes()?;
        let Some(&first) = holes.first() else {
            return Ok(0);
        };
        let old = self.old;
        let hole_err = |why: &str| -> Declined {
            format!(
                "tensor {:?} leaves a hole in the middle of the data (removed, or replaced by one \
                 of another size), and {why}",
                old.tensors.name(first)
            )
            .into()
        };
        if !fills_holes {
            return Err(hole_err("this format's holes are not filled in place"));
        }
        // (A tensor moved keeps its element alignment: readers that map it need it.)
        let spec = self.spec;
        let align = |k: usize| (spec(k).1.bits() / 8).clamp(1, 8);
        let movers = fill_holes(
            &holes,
            old,
            &self.place,
            &self.from,
            self.inputs,
            self.source,
            self.held,
            align,
        )
        .map_err(hole_err)?;
        let moved = movers.len();
        for (k, at) in movers {
            let (start, stop) = self.place[k].expect("placed");
            self.place[k] = Some((at, at + stop - start));
            // (New bytes are written at their new place from their staging
            // file: they overwrite nothing now.)
            match &self.inputs[k] {
                Bytes::Source(..) | Bytes::Patched(..) => {
                    self.from[k] = Some(WriteFrom::Here { offset: start })
                }
                _ => self.overwrote.retain(|&j| j != k),
            }
        }
        // (New tensors would go where the moved ones are read from.)
        for k in 0..self.count() {
            if self.place[k].is_none() && self.len_of(k).is_ok_and(|n| n > 0) {
                return Err(hole_err(
                    "new bytes (a tensor added, or one of another size) go at the end too, \
                     where the ones that would fill it are read from",
                ));
            }
        }
        Ok(moved)
    }

    /// The dropped source tensors before the end of what is kept, in file
    /// order; a dropped tensor whose bytes are still read refuses the plan
    /// (writing in place would change them, or cut them off).
    fn holes(&self) -> Result<Vec<usize>, Declined> {
        let old = self.old;
        let kept_end = self.placed_end();
        let mut holes = Vec::new();
        for i in 0..old.tensors.len() {
            let t = old.tensors.get(i);
            if self.claimed[i] || t.nbytes() == 0 {
                continue;
            }
            if self.held[i] {
                return Err(format!(
                    "tensor {:?}'s old bytes are still read (an open descriptor, or another \
                     shard), and writing in place would change them",
                    t.name
                )
                .into());
            }
            if t.data_offsets.1 <= kept_end {
                holes.push(i);
            }
        }
        Ok(holes)
    }

    /// Step 4. Everything else goes at the end (each at an offset the
    /// format aligns): in name order, as the reference serializer orders; a
    /// GGUF file's in the order given (its order: new tensors as they were
    /// made), as a rewrite and the `model.gguf` view lay them out. Returns
    /// the data's end and how many tensors with bytes were appended; the
    /// padding around them is zeroed (`pads`: it may hold a dropped
    /// tensor's bytes).
    fn place_appends(&mut self, align: u64, by_name: bool) -> Result<(u64, usize), Declined> {
        let mut rest: Vec<usize> = (0..self.count())
            .filter(|&k| self.place[k].is_none())
            .collect();
        if by_name {
            rest.sort_by(|&a, &b| self.name(a).cmp(self.name(b)));
        }
        let mut end = self.placed_end();
        let mut appended = 0;
        for &k in &rest {
            let n = self.len_of(k)?;
            let start = end.next_multiple_of(align);
            self.pad(end, start, k);
            self.place[k] = Some((start, start + n));
            end = start + n;
            if n > 0 {
                appended += 1;
            }
        }
        if let Some(&last) = rest.last() {
            self.pad(end, end.next_multiple_of(align), last);
        }
        Ok((end, appended))
    }

    /// Zeros from `a` to `b` (data-relative), beside input `k`.
    fn pad(&mut self, a: u64, b: u64, k: usize) {
        if b > a {
            self.pads.push((a, b, k));
        }
    }

    /// The header's tensors in file order (by place; ties by name, or as
    /// given for GGUF), and for each the input it is.
    fn in_file_order(&self, by_name: bool) -> Result<(Tensors, Vec<usize>), Declined> {
        let mut order: Vec<usize> = (0..self.count()).collect();
        order.sort_by(|&a, &b| {
            let names = || match by_name {
                true => self.name(a).cmp(self.name(b)),
                false => a.cmp(&b),
            };
            self.place[a].cmp(&self.place[b]).then_with(names)
        });
        let mut tensors = Tensors::with_capacity(self.count());
        for &k in &order {
            let (name, dtype, shape) = (self.spec)(k);
            tensors
                .push(name, dtype, shape, self.place[k].expect("placed"))
                .map_err(|_| "the header is too large".to_string())?;
        }
        Ok((tensors, order))
    }

    /// Step 6. The writes: every placed input whose bytes are not already
    /// there, at its offset in the file (`data_start` on).
    fn writes(&self, data_start: u64) -> Result<Writes, Declined> {
        let mut out = Writes::default();
        for k in 0..self.count() {
            let (start, stop) = self.place[k].expect("placed");
            if stop == start || self.kept_where_it_is(k) {
                continue;
            }
            if let Some(from) = self.whole_from(k, data_start)? {
                out.push(data_start + start, stop - start, from, k);
            }
            // A partly staged tensor's blocks go over its source bytes (after
            // them, where those are copied).
            if let Bytes::Patched(p) = &self.inputs[k] {
                out.patched += 1;
                for (a, b) in p.runs() {
                    let from = WriteFrom::Staged {
                        file: p.staged().name(),
                        offset: a,
                    };
                    out.push(data_start + start + a, b - a, from, k);
                }
            }
        }
        for &(a, b, k) in &self.pads {
            out.push(data_start + a, b - a, WriteFrom::Zeros, k);
        }
        Ok(out)
    }

    /// A source tensor left where it was, with nothing to copy.
    fn kept_where_it_is(&self, k: usize) -> bool {
        let at = |i: u32| self.old.tensors.get(i as usize).data_offsets;
        matches!(&self.inputs[k], Bytes::Source(_, i) if Some(at(*i)) == self.place[k])
            && self.from[k].is_none()
    }

    /// Where input `k`'s bytes are copied from as a whole, if they are: a
    /// range of this file, or its staging file; `None` for a partly staged
    /// tensor where it is (only its blocks are written).
    fn whole_from(&self, k: usize, data_start: u64) -> Result<Option<WriteFrom>, Declined> {
        let (start, stop) = self.place[k].expect("placed");
        Ok(match (&self.from[k], &self.inputs[k]) {
            (Some(WriteFrom::Here { offset }), _) => Some(WriteFrom::Here {
                offset: data_start + offset,
            }),
            (None, Bytes::Staged(s)) if s.len() == stop - start => Some(WriteFrom::Staged {
                file: s.name(),
                offset: 0,
            }),
            (None, Bytes::Patched(p))
                if self.old.tensors.get(p.base().1 as usize).data_offsets == (start, stop) =>
            {
                None
            }
            _ => {
                return Err(format!(
                    "tensor {:?}'s bytes are not in a staging file of the mount",
                    self.name(k)
                )
                .into());
            }
        })
    }
}

/// The writes of a plan, for each the input it copies, and their bytes.
#[derive(Default)]
struct Writes {
    writes: Vec<(RangeWrite, usize)>,
    bytes: u64,
    /// Inputs written in part (block by block).
    patched: usize,
}

impl Writes {
    fn push(&mut self, at: u64, len: u64, from: WriteFrom, k: usize) {
        self.bytes += len;
        self.writes.push((RangeWrite { at, len, from }, k));
    }
}

/// Where the tensors at the end of the data go to fill the holes that the
/// dropped tensors `holes` (old indices) leave: (input, its new start,
/// data-relative) for each tensor moved, or why they cannot fill them. The
/// data then ends `need` bytes (the holes' length) sooner: the tensors
/// placed past that end move into the holes before it (each a source tensor
/// kept as it is and read by nobody, `held`, or new bytes), each run of
/// holes filled largest first (at an offset as aligned, to its element size
/// `align(k)`, as its old one); none may straddle the new end.
#[allow(clippy::too_many_arguments)]
fn fill_holes(
    holes: &[usize],
    old: &Header,
    place: &[Option<(u64, u64)>],
    from: &[Option<WriteFrom>],
    inputs: &[Bytes],
    source: &Arc<SourceFile>,
    held: &[bool],
    align: impl Fn(usize) -> u64,
) -> Result<Vec<(usize, u64)>, &'static str> {
    const INEXACT: &str = "the tensors at the end cannot fill it exactly";
    let need: u64 = holes.iter().map(|&i| old.tensors.nbytes(i)).sum();
    let placed: Vec<usize> = (0..place.len())
        .filter(|&k| place[k].is_some_and(|(a, b)| b > a))
        .collect();
    let kept_end = placed.iter().filter_map(|&k| place[k]).map(|p| p.1).max();
    let new_end = kept_end.and_then(|e| e.checked_sub(need)).ok_or(INEXACT)?;
    let gaps = gaps_before(
        holes.iter().map(|&i| old.tensors.get(i).data_offsets),
        new_end,
    );
    let mut movers = Vec::new();
    for k in placed {
        let Some((start, stop)) = place[k] else {
            continue;
        };
        if stop <= new_end {
            continue;
        }
        let movable = match (inputs[k].source_tensor(), &inputs[k]) {
            (Some((src, i)), _) => {
                Arc::ptr_eq(src, source)
                    && from[k].is_none()
                    && old.tensors.get(i as usize).data_offsets == (start, stop)
                    && !held[i as usize]
            }
            (None, Bytes::Staged(_)) => true,
            (None, _) => false,
        };
        if !movable {
            return Err("a tensor at the end that would fill it is still read, or a copy");
        }
        if start < new_end {
            return Err(INEXACT); // (it would straddle the new end)
        }
        movers.push(Mover {
            k,
            len: stop - start,
            rem: start % align(k),
            align: align(k),
        });
    }
    pack(&gaps, movers).ok_or(INEXACT)
}

/// The holes' ranges before `new_end` (cut there), runs of them joined.
fn gaps_before(holes: impl Iterator<Item = (u64, u64)>, new_end: u64) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = holes
        .filter(|&(start, _)| start < new_end)
        .map(|(start, stop)| (start, stop.min(new_end)))
        .collect();
    ranges.sort();
    let mut gaps: Vec<(u64, u64)> = Vec::new();
    for (start, stop) in ranges {
        match gaps.last_mut() {
            Some(last) if last.1 == start => last.1 = stop,
            _ => gaps.push((start, stop)),
        }
    }
    gaps
}

/// A tensor to move into a hole: `len` bytes, at an offset that is `rem`
/// modulo `align`, as where it is now.
#[derive(Debug, Clone, Copy)]
struct Mover {
    k: usize,
    len: u64,
    rem: u64,
    align: u64,
}

/// The movers packed into the gaps, largest first, each gap filled exactly:
/// (input, new start) for each, or `None` if they do not fill them exactly.
fn pack(gaps: &[(u64, u64)], mut movers: Vec<Mover>) -> Option<Vec<(usize, u64)>> {
    let fill: u64 = gaps.iter().map(|(a, b)| b - a).sum();
    if movers.iter().map(|m| m.len).sum::<u64>() != fill {
        return None;
    }
    movers.sort_by_key(|m| std::cmp::Reverse(m.len));
    let mut used = vec![false; movers.len()];
    let mut out = Vec::new();
    for &(mut at, stop) in gaps {
        while at < stop {
            let fits = |m: &Mover| m.len <= stop - at && at % m.align == m.rem;
            let j = (0..movers.len()).find(|&j| !used[j] && fits(&movers[j]))?;
            used[j] = true;
            out.push((movers[j].k, at));
            at += movers[j].len;
        }
    }
    Some(out)
}

/// A header laid out for the data to start where it does, or where whole
/// blocks inserted at the file's start move it.
#[derive(Debug)]
struct HeaderFit {
    /// The header, padded to the data's start.
    header: Vec<u8>,
    /// Where its content ends (what follows is padding).
    content_end: u64,
    /// Bytes inserted at the file's start.
    inserted: u64,
}

/// Step 5. The header of `tensors` in the old header's room (`old_len`
/// bytes, prefix included), or, past it and where the filesystem inserts
/// `block`s at a file's start, in that room grown by whole blocks (of the
/// format's alignment too) with room to spare for the next edits (a chat
/// template, every tensor renamed, a metadata key or two), so that they
/// insert nothing: a quarter of the header again, at least 64 KiB. (Not
/// more: each later header edit writes its room into the redo record once.)
fn fit_header(
    format: &dyn FormatWriter,
    tensors: &Tensors,
    old_len: u64,
    block: Option<u64>,
) -> Result<HeaderFit, Declined> {
    let needed = match format.header_at(tensors, old_len) {
        Ok((header, content_end)) => {
            return Ok(HeaderFit {
                header,
                content_end,
                inserted: 0,
            });
        }
        Err(NoFit::Refused(e)) => return Err(e.to_string().into()),
        Err(NoFit::Needs(needed)) => needed,
    };
    let Some(block) = block else {
        return Err(format!(
            "the header grows past its space ({needed} bytes, {old_len} there) and this \
             filesystem cannot insert blocks at a file's start (ext4 and XFS can)"
        )
        .into());
    };
    let align = format.alignment();
    let unit = block.max(align);
    if unit % block != 0 || unit % align != 0 {
        return Err(format!(
            "the header grows past its space, and blocks of {block} bytes cannot keep the data \
             aligned to {align}"
        )
        .into());
    }
    let want = needed + (needed / 4).max(HEADER_SPARE) - old_len;
    let inserted = want.div_ceil(unit) * unit;
    if old_len + inserted > crate::format::MAX_HEADER_LEN {
        return Err("the header would pass 100,000,000 bytes".into());
    }
    match format.header_at(tensors, old_len + inserted) {
        Ok((header, content_end)) => Ok(HeaderFit {
            header,
            content_end,
            inserted,
        }),
        Err(NoFit::Refused(e)) => Err(e.to_string().into()),
        Err(NoFit::Needs(_)) => Err("internal: the grown header does not fit".into()),
    }
}

/// The part of the new header written, `(from, to)`: the part that holds
/// content, old or new (the rest is padding already); and where nothing was
/// inserted, of that, from the first byte that changes to the last (a GGUF
/// file's template grown: the keys before it, the tensor infos after its
/// room, stay). The first 8 bytes are never in it: they go in last.
fn header_span(source: &SourceFile, fit: &HeaderFit) -> (u64, u64) {
    let content = fit
        .content_end
        .max(fit.inserted + source.header_json_end())
        .min(fit.header.len() as u64);
    if fit.inserted != 0 || source.shift() != 0 {
        return (PREFIX_LEN, content);
    }
    match source.read_range(0, source.header().data_start()) {
        Ok(now) => changed_span(&fit.header, &now, content),
        Err(_) => (PREFIX_LEN, content),
    }
}

/// From the first byte after the prefix where `new` and `now` differ to the
/// last before `end`, as `(from, to)`; `(8, 8)` where none does.
fn changed_span(new: &[u8], now: &[u8], end: u64) -> (u64, u64) {
    let differs = |i: &usize| new.get(*i) != now.get(*i);
    let end = end as usize;
    match (PREFIX_LEN as usize..end).find(differs) {
        None => (PREFIX_LEN, PREFIX_LEN),
        Some(first) => {
            let last = (first..end).rev().find(differs).expect("one differs");
            (first as u64, last as u64 + 1)
        }
    }
}

/// What a plan changes, in words ("header, 1 tensor appended").
struct Summary {
    inserted: u64,
    overwritten: usize,
    patched: usize,
    appended: usize,
    dropped: usize,
    moved: usize,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.inserted {
            0 => write!(f, "header")?,
            n => write!(f, "header grown by {} KiB at the start", n >> 10)?,
        }
        let dropped = match self.moved {
            0 => "dropped at the end",
            _ => "dropped",
        };
        for (n, what) in [
            (self.overwritten, "overwritten"),
            (self.patched, "written in part"),
            (self.appended, "appended"),
            (self.dropped, dropped),
            (self.moved, "moved up from the end"),
        ] {
            if n > 0 {
                let s = if n == 1 { "" } else { "s" };
                write!(f, ", {n} tensor{s} {what}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
