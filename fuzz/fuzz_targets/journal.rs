#![no_main]
//! Any bytes as a journal of staged edits (a file a crash may have torn or
//! a disk corrupted): reading answers Ok or Err, never panics, and what it
//! reads folds (as replay does, and after any commit's plan) without a panic;
//! a torn last line is only ever the last.

use libfuzzer_sys::fuzz_target;
use stfs::checkpoint::journal::{fold, read, Record};

fuzz_target!(|data: &[u8]| {
    let Ok(replay) = read(data) else { return };
    let folded = fold(&replay.records, None);
    for (name, _) in &folded.names {
        assert!(replay.records.iter().any(|r| match r {
            Record::Entry { name: n, .. } | Record::Gone { name: n } => n == name,
            _ => false,
        }));
    }
    for r in &replay.records {
        if let Record::Plan { commit } = r {
            let _ = fold(&replay.records, Some(*commit));
        }
    }
});
