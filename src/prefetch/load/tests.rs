//! Loads through the host engine: the pipeline a CUDA load runs.

use super::engine::{HostEngine, host_bytes};
use super::plan::Item;
use super::run::Way;
use super::*;
use crate::format::Dtype;
use proptest::prelude::*;
use std::os::unix::fs::FileExt;

fn host_pool(lanes: usize, slab: usize) -> Arc<Pool> {
    Arc::new(Pool::new(Box::new(HostEngine), lanes, slab))
}

fn file_of(bytes: &[u8]) -> Arc<std::fs::File> {
    let f = tempfile::tempfile().unwrap();
    f.write_all_at(bytes, 0).unwrap();
    Arc::new(f)
}

fn item(name: String, file: &Arc<std::fs::File>, offset: u64, len: u64) -> Item {
    Item::of_file(name, file, offset, len)
}

fn finished(load: &Load) -> run::Seen {
    load.wait(&|| true).ok();
    load.seen(Duration::ZERO)
}

/// Tensors laid out in a file from (gap before, length) pairs, given in a
/// shuffled order: what the arena must hold for each.
fn layout(parts: &[(u64, u64)], seed: u64) -> (Vec<u8>, Vec<(String, u64, u64)>) {
    let (mut at, mut tensors) = (0, Vec::new());
    for (i, &(gap, len)) in parts.iter().enumerate() {
        at += gap;
        tensors.push((format!("t{i}"), at, len));
        at += len;
    }
    let bytes: Vec<u8> = (0..at).map(|i| (i * 7 + seed + i / 251) as u8).collect();
    let n = tensors.len().max(1);
    tensors.rotate_left(seed as usize % n);
    (bytes, tensors)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_byte_lands_where_the_table_says(
        parts in prop::collection::vec((0u64..6000, 0u64..700), 0..12),
        lanes in 1usize..5,
        slab in 1usize..300,
        seed in 0u64..1000,
        direct in any::<bool>(),
    ) {
        let way = if direct { Way::Direct } else { Way::ThroughSlabs };
        let (bytes, tensors) = layout(&parts, seed);
        let f = file_of(&bytes);
        let items = tensors.iter().map(|(n, o, l)| item(n.clone(), &f, *o, *l)).collect();
        let load = Load::start(items, host_pool(lanes, slab), way).unwrap();
        let seen = finished(&load);
        prop_assert_eq!(seen.failed, None);
        prop_assert!(seen.done);
        prop_assert_eq!(seen.landed_tensors, tensors.len());
        let total: u64 = tensors.iter().map(|t| t.2).sum();
        prop_assert_eq!(seen.landed_bytes, total);
        let arena = host_bytes(&*load.arena).unwrap();
        for e in &load.plan.entries {
            prop_assert_eq!(e.offset % plan::ALIGN, 0);
            let (_, at, len) = tensors.iter().find(|t| t.0 == e.name).unwrap();
            let got = &arena[e.offset as usize..(e.offset + e.nbytes) as usize];
            prop_assert!(got == &bytes[*at as usize..(*at + *len) as usize], "tensor {}", e.name);
        }
    }
}

#[test]
fn the_pool_is_made_at_the_first_load_and_only_then() {
    let (bytes, tensors) = layout(&[(0, 5000), (3, 17), (0, 0)], 1);
    let f = file_of(&bytes);
    let pool = host_pool(3, 1000);
    for round in 0..3 {
        let items = tensors
            .iter()
            .map(|(n, o, l)| item(n.clone(), &f, *o, *l))
            .collect();
        let load = Load::start(items, pool.clone(), Way::ThroughSlabs).unwrap();
        assert_eq!(finished(&load).failed, None, "round {round}");
        assert_eq!(pool.made(), 3, "round {round}");
    }
}

#[test]
fn two_loads_at_once_share_the_lanes_and_both_land() {
    let (bytes, tensors) = layout(&[(0, 30_000), (100, 20_000)], 2);
    let f = file_of(&bytes);
    let pool = host_pool(2, 512);
    let loads: Vec<_> = (0..2)
        .map(|_| {
            let items = tensors
                .iter()
                .map(|(n, o, l)| item(n.clone(), &f, *o, *l))
                .collect();
            Load::start(items, pool.clone(), Way::ThroughSlabs).unwrap()
        })
        .collect();
    for load in &loads {
        let seen = finished(load);
        assert_eq!((seen.failed, seen.landed_tensors), (None, 2));
        let arena = host_bytes(&*load.arena).unwrap();
        let e = &load.plan.entries[1];
        assert_eq!(
            &arena[e.offset as usize..][..20_000],
            &bytes[30_100..50_100]
        );
    }
    assert_eq!(pool.made(), 2);
}

#[test]
fn a_read_error_names_the_tensor_and_hands_out_none() {
    // The file ends inside the second tensor.
    let f = file_of(&[1; 1000]);
    for way in [Way::Direct, Way::ThroughSlabs] {
        let items = vec![
            item("whole".into(), &f, 0, 500),
            item("cut".into(), &f, 500, 900),
        ];
        let load = Load::start(items, host_pool(2, 256), way).unwrap();
        let seen = finished(&load);
        let (errno, why) = seen.failed.expect("a short file fails the load");
        assert_eq!(errno, libc::EIO, "{why}");
        assert!(why.contains("\"cut\""), "{way:?}: {why}");
        assert_eq!(seen.landed_tensors, 0, "a failed load hands out no tensor");
        assert!(seen.done);
    }
}

#[test]
fn a_cancelled_load_stops_and_says_so() {
    let (bytes, tensors) = layout(&[(0, 4000)], 3);
    let f = file_of(&bytes);
    let items = tensors
        .iter()
        .map(|(n, o, l)| item(n.clone(), &f, *o, *l))
        .collect();
    let plan = plan::plan(items, 100);
    let pool = host_pool(2, 100);
    let arena = pool.engine().new_arena(plan.arena_size).unwrap();
    let progress = Progress::new(&plan);
    progress.cancel();
    run::run(&plan, &*arena, &pool, &progress, Way::ThroughSlabs);
    let seen = progress.seen(Duration::ZERO);
    assert_eq!(seen.failed.map(|f| f.0), Some(libc::ECANCELED));
    assert_eq!(seen.landed_bytes, 0);
}

#[test]
fn names_are_chosen_exactly_and_a_missing_one_is_named() {
    use crate::checkpoint::view::ViewTensor;
    use crate::source::Bytes;
    let all = || {
        ["a.w", "a.b", "c"]
            .map(|n| ViewTensor {
                name: n.into(),
                dtype: Dtype::F32,
                shape: vec![0],
                bytes: Bytes::Empty,
            })
            .to_vec()
    };
    let names = |items: Vec<Item>| items.into_iter().map(|i| i.name).collect::<Vec<_>>();
    assert_eq!(names(choose(all(), &Want::All).unwrap()).len(), 3);
    let glob = Want::Glob(glob::Pattern::new("a.*").unwrap());
    assert_eq!(names(choose(all(), &glob).unwrap()), ["a.w", "a.b"]);
    let two = Want::Names(vec!["c".into(), "a.b".into(), "c".into()]);
    assert_eq!(names(choose(all(), &two).unwrap()), ["c", "a.b"]);
    let missing = choose(all(), &Want::Names(vec!["nope".into()]))
        .err()
        .unwrap();
    assert_eq!(crate::errno::ToErrno::to_errno(&missing), libc::ENOENT);
    assert!(missing.to_string().contains("\"nope\""));
}

#[test]
fn a_pool_is_freed_only_when_every_lane_has_been_back_for_its_idle_time() {
    let idle = Duration::from_secs(300);
    let pool = host_pool(2, 64);
    let later = |by: Duration| Instant::now() + by;
    assert!(
        !pool.release_if_idle(idle, later(idle * 2)),
        "nothing made, nothing freed"
    );
    let lane = pool.take().unwrap();
    assert_eq!(pool.made(), 2);
    assert!(
        !pool.release_if_idle(idle, later(idle * 2)),
        "a lane in use keeps the pool however long ago it was taken"
    );
    drop(lane);
    assert!(
        !pool.release_if_idle(idle, later(idle / 2)),
        "back, but not for long enough"
    );
    assert!(pool.holds_lanes());
    assert!(pool.release_if_idle(idle, later(idle + Duration::from_secs(1))));
    assert!(!pool.holds_lanes());
    assert!(!pool.release_if_idle(idle, later(idle * 2)), "freed once");
    drop(pool.take().unwrap());
    assert_eq!(pool.made(), 4, "the next load makes the lanes again");
}

#[test]
fn a_freed_pool_loads_the_same_bytes_again() {
    let (bytes, tensors) = layout(&[(3, 500), (0, 90), (17, 1000)], 5);
    let f = file_of(&bytes);
    let items = || {
        tensors
            .iter()
            .map(|(n, o, l)| item(n.clone(), &f, *o, *l))
            .collect()
    };
    let pool = host_pool(2, 128);
    for _ in 0..2 {
        let load = Load::start(items(), pool.clone(), Way::ThroughSlabs).unwrap();
        assert!(finished(&load).failed.is_none());
        let arena = host_bytes(&*load.arena).unwrap();
        for e in &load.plan.entries {
            let (_, at, len) = tensors.iter().find(|t| t.0 == e.name).unwrap();
            let got = &arena[e.offset as usize..(e.offset + e.nbytes) as usize];
            assert_eq!(got, &bytes[*at as usize..(at + len) as usize], "{}", e.name);
        }
        drop(load);
        assert!(pool.release_if_idle(Duration::ZERO, Instant::now() + Duration::from_secs(1)));
    }
    assert_eq!(pool.made(), 4);
}
