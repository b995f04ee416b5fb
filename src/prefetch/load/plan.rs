//! A load's plan: where each tensor goes in the arena, and the chunks the
//! lanes read, in file order, adjacent tensors of a file read together.
//!
//! Steps: `order` puts the tensors in file order (files in the order first
//! met); `place` gives each an aligned offset in the arena; `spans` joins
//! tensors of one file that lie together; `chunk` cuts spans into slabs and
//! says which bytes of each chunk go where.

use crate::format::Dtype;
use crate::source::Backing;

use super::engine::Copy;

/// Every tensor starts at a multiple of this in the arena (CUDA's
/// allocation granularity for any dtype's loads; torch asks for 256).
pub const ALIGN: u64 = 256;

/// A gap between two tensors of a file that is read rather than split at
/// (GGUF pads tensors to 32 bytes).
const JOIN_GAP: u64 = 4096;

/// A tensor asked for.
pub struct Item {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub nbytes: u64,
    /// Where its bytes are (None: an empty tensor).
    pub backing: Option<Backing>,
}

impl Item {
    /// `len` bytes of `file` at `offset`, as bytes (U8): what a benchmark or
    /// a test loads without a mount.
    pub fn of_file(
        name: String,
        file: &std::sync::Arc<std::fs::File>,
        offset: u64,
        len: u64,
    ) -> Item {
        Item {
            name,
            dtype: Dtype::U8,
            shape: vec![len],
            nbytes: len,
            backing: (len > 0).then(|| Backing::File {
                file: file.clone(),
                offset,
                len,
                sparse: false,
                moves_with: None,
            }),
        }
    }
}

/// A tensor in the arena, in the order the tensors land.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Entry {
    pub name: String,
    pub offset: u64,
    pub nbytes: u64,
    pub dtype: String,
    pub shape: Vec<u64>,
}

/// What one lane reads and copies at a time.
#[derive(Debug)]
pub struct Chunk {
    /// The backing read (an index into `Plan::sources`), and where.
    pub source: usize,
    pub pos: u64,
    pub len: usize,
    /// Where its bytes go.
    pub copies: Vec<Copy>,
    /// Which tensor each copy fills (parallel to `copies`).
    pub entries: Vec<usize>,
}

pub struct Plan {
    pub entries: Vec<Entry>,
    pub sources: Vec<Backing>,
    pub chunks: Vec<Chunk>,
    pub arena_size: u64,
}

impl Plan {
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.nbytes).sum()
    }
}

/// The plan for `items`, read a slab of `slab` bytes at a time.
pub fn plan(items: Vec<Item>, slab: usize) -> Plan {
    let items = order(items);
    let (entries, arena_size) = place(&items);
    let mut sources = Vec::new();
    let mut chunks = Vec::new();
    for span in spans(&items) {
        let source = sources.len();
        sources.push(
            items[span.items[0]]
                .backing
                .clone()
                .expect("spans hold bytes"),
        );
        chunks.extend(chunk(&span, source, &items, &entries, slab));
    }
    Plan {
        entries,
        sources,
        chunks,
        arena_size,
    }
}

/// What backings can be read together: the same file (moved the same way)
/// or the same remote object. Staged patches are read alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    File(usize, u64),
    Remote(usize),
    Alone(usize),
}

fn key(backing: &Backing, i: usize) -> Key {
    match backing {
        Backing::File {
            file, moves_with, ..
        } => Key::File(
            std::sync::Arc::as_ptr(file) as usize,
            moves_with.as_ref().map_or(u64::MAX, |(_, seen)| *seen),
        ),
        Backing::Remote { source, .. } => Key::Remote(std::sync::Arc::as_ptr(source) as usize),
        Backing::Patched(_) => Key::Alone(i),
    }
}

/// The items in file order: the files in the order first met, each file's
/// tensors by offset; empty tensors first (they land at once).
fn order(items: Vec<Item>) -> Vec<Item> {
    let mut first_seen = std::collections::HashMap::new();
    let mut keyed: Vec<(usize, u64, usize, Item)> = items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let (file, at) = match &item.backing {
                None => (0, 0),
                Some(b) => {
                    let n = first_seen.len() + 1;
                    (*first_seen.entry(key(b, i)).or_insert(n), b.range().0)
                }
            };
            (file, at, i, item)
        })
        .collect();
    keyed.sort_by_key(|&(file, at, i, _)| (file, at, i));
    keyed.into_iter().map(|(.., item)| item).collect()
}

pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// Each tensor's offset in the arena, in order, aligned; and the arena's size.
fn place(items: &[Item]) -> (Vec<Entry>, u64) {
    let mut at = 0;
    let entries = items
        .iter()
        .map(|item| {
            let offset = align_up(at);
            at = offset + item.nbytes;
            Entry {
                name: item.name.clone(),
                offset,
                nbytes: item.nbytes,
                dtype: item.dtype.name().to_string(),
                shape: item.shape.clone(),
            }
        })
        .collect();
    (entries, at)
}

/// Tensors of one backing read as one range: `start..end` of the file.
#[derive(Debug, PartialEq, Eq)]
struct Span {
    start: u64,
    end: u64,
    /// Indexes into the ordered items.
    items: Vec<usize>,
}

/// Joins tensors of one file that lie together (at most `JOIN_GAP` apart).
fn spans(items: &[Item]) -> Vec<Span> {
    let mut spans: Vec<(Key, Span)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let Some(b) = item.backing.as_ref().filter(|_| item.nbytes > 0) else {
            continue;
        };
        let (start, len) = b.range();
        let k = key(b, i);
        match spans.last_mut() {
            Some((last, span))
                if *last == k && start <= span.end + JOIN_GAP && start >= span.start =>
            {
                span.end = span.end.max(start + len);
                span.items.push(i);
            }
            _ => spans.push((
                k,
                Span {
                    start,
                    end: start + len,
                    items: vec![i],
                },
            )),
        }
    }
    spans.into_iter().map(|(_, s)| s).collect()
}

/// Cuts a span into chunks of at most `slab` bytes, each with the copies of
/// the tensor bytes it holds.
fn chunk(span: &Span, source: usize, items: &[Item], entries: &[Entry], slab: usize) -> Vec<Chunk> {
    let slab = slab as u64;
    let mut chunks: Vec<Chunk> = (span.start..span.end)
        .step_by(slab as usize)
        .map(|pos| Chunk {
            source,
            pos,
            len: (span.end - pos).min(slab) as usize,
            copies: Vec::new(),
            entries: Vec::new(),
        })
        .collect();
    for &i in &span.items {
        let (start, len) = items[i].backing.as_ref().expect("in a span").range();
        let end = start + len;
        let first = ((start - span.start) / slab) as usize;
        for c in chunks[first..].iter_mut().take_while(|c| c.pos < end) {
            let from = start.max(c.pos);
            let to = end.min(c.pos + c.len as u64);
            c.copies.push(Copy {
                from: (from - c.pos) as usize,
                len: (to - from) as usize,
                to: entries[i].offset + (from - start),
            });
            c.entries.push(i);
        }
    }
    chunks.retain(|c| !c.copies.is_empty());
    chunks
}

#[cfg(test)]
mod tests;
