use super::*;

const MIB: u64 = 1 << 20;

fn old(r: Range<u64>) -> Piece {
    Piece::Old { from: 0, range: r }
}

fn input(k: usize, range: Range<u64>) -> Piece {
    Piece::Input { k, range }
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
            input(3, 0..MIB),
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
        vec![Piece::Header(0..MIB), old(MIB..7 * MIB), input(0, 0..MIB)],
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
            input(0, 0..5 * gib - MIB),
            old(10 * gib..10 * gib + 4 * MIB),
            input(1, 0..1),
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
        vec![Piece::Header(0..MIB), input(0, 0..200 * MIB)],
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
            input(1, 0..MIB),
            old(31 * MIB..33 * MIB),
            input(2, 0..MIB),
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
