//! Process-wide generation numbers, below every other module: edits,
//! commits and remote fetches number their work with them.

use std::sync::atomic::{AtomicU64, Ordering};

static GEN: AtomicU64 = AtomicU64::new(1);

/// A fresh generation number: every edit gets one, so a commit can tell
/// whether something changed after it took its plan.
pub fn next_gen() -> u64 {
    GEN.fetch_add(1, Ordering::Relaxed)
}
