//! The plan's steps at their boundaries.

use super::*;
use std::sync::Arc;

fn file() -> Arc<std::fs::File> {
    Arc::new(tempfile::tempfile().unwrap())
}

fn item(name: &str, file: &Arc<std::fs::File>, offset: u64, len: u64) -> Item {
    Item::of_file(name.into(), file, offset, len)
}

/// Each chunk: (file position, length, its copies as (from, len, to)).
type Chunks = Vec<(u64, usize, Vec<(usize, usize, u64)>)>;

fn copies(p: &Plan) -> Chunks {
    p.chunks
        .iter()
        .map(|c| {
            (
                c.pos,
                c.len,
                c.copies.iter().map(|k| (k.from, k.len, k.to)).collect(),
            )
        })
        .collect()
}

#[test]
fn each_tensor_starts_aligned_and_the_arena_ends_at_the_last_byte() {
    let f = file();
    let p = plan(
        vec![
            item("a", &f, 8, 100),
            item("b", &f, 108, 256),
            item("c", &f, 364, 1),
        ],
        1 << 20,
    );
    let offsets: Vec<u64> = p.entries.iter().map(|e| e.offset).collect();
    assert_eq!(offsets, [0, 256, 512]);
    assert_eq!(p.arena_size, 513);
    assert_eq!(p.bytes(), 357);
}

#[test]
fn adjacent_tensors_are_one_read_and_a_chunk_boundary_splits_a_tensor() {
    let f = file();
    let p = plan(vec![item("b", &f, 100, 200), item("a", &f, 0, 100)], 128);
    // File order: a (0..100) then b (100..300); b straddles two boundaries.
    assert_eq!(p.entries[0].name, "a");
    assert_eq!(
        copies(&p),
        [
            (0, 128, vec![(0, 100, 0), (100, 28, 256)]),
            (128, 128, vec![(0, 128, 284)]),
            (256, 44, vec![(0, 44, 412)]),
        ]
    );
}

#[test]
fn a_tensor_of_exactly_one_slab_is_one_chunk_and_one_byte_more_is_two() {
    let f = file();
    let p = plan(vec![item("a", &f, 0, 64)], 64);
    assert_eq!(copies(&p), [(0, 64, vec![(0, 64, 0)])]);
    let p = plan(vec![item("a", &f, 0, 65)], 64);
    assert_eq!(
        copies(&p),
        [(0, 64, vec![(0, 64, 0)]), (64, 1, vec![(0, 1, 64)])]
    );
}

#[test]
fn a_small_gap_is_read_through_and_a_large_one_splits() {
    let f = file();
    let p = plan(
        vec![item("a", &f, 0, 10), item("b", &f, 10 + JOIN_GAP, 10)],
        1 << 20,
    );
    assert_eq!(p.chunks.len(), 1, "{:?}", copies(&p));
    assert_eq!(p.chunks[0].len as u64, 20 + JOIN_GAP);
    let p = plan(
        vec![item("a", &f, 0, 10), item("b", &f, 11 + JOIN_GAP, 10)],
        1 << 20,
    );
    assert_eq!(p.chunks.len(), 2);
    assert_eq!(p.chunks[1].pos, 11 + JOIN_GAP);
}

#[test]
fn files_are_not_joined_and_keep_the_order_first_met() {
    let (f, g) = (file(), file());
    let p = plan(
        vec![
            item("g1", &g, 50, 10),
            item("f0", &f, 0, 10),
            item("g0", &g, 40, 10),
        ],
        1 << 20,
    );
    let names: Vec<&str> = p.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["g0", "g1", "f0"]);
    assert_eq!(p.sources.len(), 2);
    assert_eq!(copies(&p)[0], (40, 20, vec![(0, 10, 0), (10, 10, 256)]));
}

#[test]
fn empty_tensors_come_first_and_read_nothing() {
    let f = file();
    let p = plan(vec![item("a", &f, 0, 10), item("z", &f, 0, 0)], 1 << 20);
    assert_eq!((p.entries[0].name.as_str(), p.entries[0].offset), ("z", 0));
    assert_eq!(p.entries[1].offset, 0);
    assert_eq!(copies(&p), [(0, 10, vec![(0, 10, 0)])]);
    let p = plan(vec![item("z", &f, 0, 0)], 1 << 20);
    assert!(p.chunks.is_empty());
    assert_eq!(p.arena_size, 0);
}
