//! The planner's steps alone, at their boundaries (the whole planner, case
//! by case, is in `in_place/tests.rs`).

use super::*;
use crate::format::writer::{Safetensors, Spec as WriterSpec};
use crate::format::{FormatError, MAX_HEADER_LEN};

fn tensors(n: usize) -> Tensors {
    let mut t = Tensors::with_capacity(n);
    for i in 0..n as u64 {
        t.push(&format!("t{i}"), Dtype::U8, &[4], (4 * i, 4 * i + 4))
            .unwrap();
    }
    t
}

/// The length of the header of `t` (prefix included) without padding.
fn content_len(t: &Tensors) -> u64 {
    let (_, end) = Safetensors { metadata: None }
        .header_at(t, MAX_HEADER_LEN)
        .unwrap();
    end
}

#[test]
fn a_header_that_exactly_fits_inserts_nothing() {
    let t = tensors(3);
    let len = content_len(&t);
    let fit = fit_header(&Safetensors { metadata: None }, &t, len, None).unwrap();
    assert_eq!((fit.inserted, fit.content_end), (0, len));
    assert_eq!(fit.header.len() as u64, len);
    // With room to spare: padded to it, content where it was.
    let fit = fit_header(&Safetensors { metadata: None }, &t, len + 100, None).unwrap();
    assert_eq!((fit.inserted, fit.content_end), (0, len));
    assert_eq!(fit.header.len() as u64, len + 100);
    assert!(fit.header[len as usize..].iter().all(|&b| b == b' '));
}

#[test]
fn a_header_one_byte_over_grows_by_whole_blocks_with_room_to_spare() {
    let t = tensors(3);
    let len = content_len(&t);
    let st = Safetensors { metadata: None };
    let e = fit_header(&st, &t, len - 1, None).unwrap_err();
    assert!(e.0.contains("cannot insert blocks"), "{e}");
    let fit = fit_header(&st, &t, len - 1, Some(4096)).unwrap();
    // One byte short, and 64 KiB of room: 64 KiB + 1 byte, in 4 KiB blocks.
    assert_eq!(fit.inserted, (64 << 10) + 4096);
    assert_eq!(fit.header.len() as u64, len - 1 + fit.inserted);
    assert_eq!(fit.content_end, len);
    // A large header keeps a quarter of itself spare instead.
    let big = tensors(8000);
    let len = content_len(&big);
    assert!(len / 4 > HEADER_SPARE);
    let fit = fit_header(&st, &big, 4096, Some(4096)).unwrap();
    assert_eq!(fit.inserted % 4096, 0);
    assert!(4096 + fit.inserted >= len + len / 4, "{}", fit.inserted);
    assert!(
        4096 + fit.inserted < len + len / 4 + 4096,
        "{}",
        fit.inserted
    );
}

/// Safetensors with another alignment: the unit a header grows by.
struct Aligned(u64);

impl FormatWriter for Aligned {
    fn alignment(&self) -> u64 {
        self.0
    }
    fn layout<'a>(
        &self,
        count: usize,
        spec: &dyn Fn(usize) -> WriterSpec<'a>,
        compact: bool,
    ) -> Result<Layout, FormatError> {
        Safetensors { metadata: None }.layout(count, spec, compact)
    }
    fn header_at(&self, tensors: &Tensors, data_start: u64) -> Result<(Vec<u8>, u64), NoFit> {
        Safetensors { metadata: None }.header_at(tensors, data_start)
    }
}

#[test]
fn a_grown_header_keeps_the_data_aligned_or_is_refused() {
    let t = tensors(3);
    let len = content_len(&t);
    // 64 KiB alignment, 4 KiB blocks: grown by whole 64 KiB units.
    let fit = fit_header(&Aligned(64 << 10), &t, len - 1, Some(4096)).unwrap();
    assert_eq!(fit.inserted, 128 << 10);
    // 3,000: no block size keeps it.
    let e = fit_header(&Aligned(3000), &t, len - 1, Some(4096)).unwrap_err();
    assert!(e.0.contains("cannot keep the data aligned to 3000"), "{e}");
}

#[test]
fn a_header_that_would_grow_past_the_limit_is_refused() {
    let t = tensors(2);
    let len = content_len(&t);
    // Grown by a unit of 2^27 bytes: past 100,000,000.
    let fake = Aligned(MAX_HEADER_LEN.next_power_of_two());
    let e = fit_header(&fake, &t, len - 1, Some(4096)).unwrap_err();
    assert!(e.0.contains("100,000,000"), "{e}");
}

#[test]
fn the_span_written_is_from_the_first_byte_that_changes_to_the_last() {
    let now = b"PPPPPPPP{\"a\":1}    ".to_vec();
    let end = now.len() as u64;
    // Nothing changes: nothing written.
    assert_eq!(changed_span(&now, &now, end), (8, 8));
    // The prefix alone is never in it (it goes in last).
    let mut new = now.clone();
    new[0] = b'X';
    assert_eq!(changed_span(&new, &now, end), (8, 8));
    // The first byte after the prefix, and the last before the end.
    let mut new = now.clone();
    new[8] = b'X';
    assert_eq!(changed_span(&new, &now, end), (8, 9));
    new[end as usize - 1] = b'X';
    assert_eq!(changed_span(&new, &now, end), (8, end));
    // Past the end is padding: not looked at.
    let mut new = now.clone();
    new[12] = b'2';
    new[end as usize - 1] = b'X';
    assert_eq!(changed_span(&new, &now, end - 1), (12, 13));
    // A new header longer than the old: its extra bytes differ.
    let mut new = now.clone();
    new.extend_from_slice(b"  ");
    assert_eq!(changed_span(&new, &now, end + 2), (end, end + 2));
}

#[test]
fn holes_are_joined_and_cut_at_the_new_end() {
    let holes = [(30, 40), (0, 10), (10, 20), (50, 60), (100, 120)];
    assert_eq!(
        gaps_before(holes.into_iter(), 55),
        vec![(0, 20), (30, 40), (50, 55)]
    );
    assert_eq!(gaps_before(holes.into_iter(), 0), vec![]);
    assert_eq!(gaps_before([(0, 10)].into_iter(), 10), vec![(0, 10)]);
}

fn mover(k: usize, len: u64) -> Mover {
    Mover {
        k,
        len,
        rem: 0,
        align: 1,
    }
}

#[test]
fn movers_fill_the_holes_exactly_largest_first_or_not_at_all() {
    // Exactly: the largest first into each gap.
    assert_eq!(
        pack(&[(0, 24)], vec![mover(1, 8), mover(2, 16)]),
        Some(vec![(2, 0), (1, 16)])
    );
    assert_eq!(
        pack(&[(0, 8), (16, 32)], vec![mover(1, 8), mover(2, 16)]),
        Some(vec![(1, 0), (2, 16)])
    );
    // One byte short, or one over: not at all.
    assert_eq!(pack(&[(0, 24)], vec![mover(1, 8), mover(2, 15)]), None);
    assert_eq!(pack(&[(0, 24)], vec![mover(1, 8), mover(2, 17)]), None);
    // The same total, but not in these gaps.
    assert_eq!(
        pack(&[(0, 12), (20, 32)], vec![mover(1, 8), mover(2, 16)]),
        None
    );
    // Nothing to fill.
    assert_eq!(pack(&[], vec![]), Some(vec![]));
}

#[test]
fn a_mover_keeps_its_place_within_its_element() {
    // An 8-byte element at 4 mod 8 now: it may go at 4, not at 0.
    let m = Mover {
        k: 7,
        len: 8,
        rem: 4,
        align: 8,
    };
    assert_eq!(pack(&[(0, 8)], vec![m]), None);
    assert_eq!(pack(&[(4, 12)], vec![m]), Some(vec![(7, 4)]));
    // And a smaller one goes first where the large one cannot.
    let small = Mover {
        k: 1,
        len: 4,
        rem: 0,
        align: 4,
    };
    assert_eq!(pack(&[(0, 12)], vec![m, small]), Some(vec![(1, 0), (7, 4)]));
}

#[test]
fn the_summary_says_what_changes() {
    let s = |inserted, overwritten, patched, appended, dropped, moved| {
        Summary {
            inserted,
            overwritten,
            patched,
            appended,
            dropped,
            moved,
        }
        .to_string()
    };
    assert_eq!(s(0, 0, 0, 0, 0, 0), "header");
    assert_eq!(
        s(4096 * 17, 0, 0, 0, 0, 0),
        "header grown by 68 KiB at the start"
    );
    assert_eq!(
        s(0, 1, 2, 1, 1, 0),
        "header, 1 tensor overwritten, 2 tensors written in part, 1 tensor appended, 1 tensor \
         dropped at the end"
    );
    assert_eq!(
        s(0, 0, 0, 0, 2, 2),
        "header, 2 tensors dropped, 2 tensors moved up from the end"
    );
}
