//! Reference-model property test of the filesystem logic, without a mount
//! (after mountpoint-s3's `tests/reftests`): random sequences of operations
//! run both against `Fs` and against a plain model of the documented file
//! model (docs/SEMANTICS.md, "Editing"), in a file mount or a folder mount of
//! two shards with an index file, writable or `-o ro`, and in a file mount of
//! a GGUF file with its keys (`gguf.rs`; docs/SEMANTICS.md, "GGUF").
//!
//! The model decides every expected result from its own knowledge, errno
//! included: its own dtype table, its own parser and renderer of `.meta.json`
//! and `__metadata__.json` (every byte of every generated file, offsets taken
//! from the reference crate's reading of the file the bytes are in), its own
//! index file, and every line of `stfs status` (a parse error's own words
//! aside). It is never asked of the
//! filesystem what a file holds or whether an operation would work.
//!
//! After every operation it compares: the listing (read in pages of varying
//! size, names and inodes), a lookup of every name, every file's bytes (read
//! in small pieces), attributes (size, nlink, mode, owner), and inode
//! identity (stable for a file's life, never given to another file). Open
//! descriptors of every kind of file are held across unlinks, renames,
//! replacements, O_TRUNC by another opener, commits, discards and a crash:
//! reads at random offsets, writes, and fstat (nlink 0 once removed). After
//! every commit each source file must equal the reference `safetensors`
//! serialization of the model, and the index file the model's.
//!
//! Separate properties: copies of the same files by two clients in any
//! interleaving converge to one checkpoint; renames of data and meta in any
//! order (a list renamer, a glob of `mv`) end as `mv` of the tensor alone.
//!
//! Bugs planted one at a time (by a script over this list, each a small
//! edit of the code named), all 28 caught by this file's tests:
//! 1. RENAME_NOREPLACE ignored (`Fs::rename`);
//! 2. a handle of a removed tensor not reading it (`Fs::read` from the state);
//! 3. a wrong shape in a generated `.meta.json` (`meta::render_meta`);
//! 4. wrong readdir names (`Fs::readdir`);
//! 5. the ESTALE check disabled (`Live::plan`);
//! 6. a name's meta dropped when its bytes are replaced (`Live::put_data`);
//! 7. discard giving unedited tensors new inodes (`Live::discard`);
//! 8. JSON descriptors read from the state, not their file (`Fs::read`: the
//!    `ruby -i` metadata loss);
//! 9. fstat of a removed file without the handle fallback (`Fs::getattr`);
//! 10. a lone meta making its data file appear (`Live::set_meta`: the
//!     `xargs -P cp` EEXIST);
//! 11. no hidden meta after a rename of the data (`Live::take_data`: `mmv`);
//! 12. a meta replaced by rename keeping its inode (`Live::set_meta`);
//! 13. descriptors of one JSON file not sharing it (`Fs::open_json`);
//! 14. `data_offsets` dropped from metas (`Live::meta_text`);
//! 15. the index omitting shards without edits (`index_updates`);
//! 16. `stfs status` listing no changes (`Fs::status`);
//! 17. a size mismatch not a problem (`Live::problems`);
//! 18. journal replay dropping metas (`Live::replay`);
//! 19. `-o ro` letting a rename through (`Fs::rename`);
//! 20. commit allowed to another user (`Fs::allowed`);
//! 21. a source rewritten in place not noticed (`SourceFile::check_unchanged`);
//! 22. discard giving a removed `__metadata__.json`'s inode to the restored
//!     one (`Live::discard`);
//! 23. a half-written JSON file reported to one of two writers
//!     (`Fs::apply_json`);
//! 24. a scalar shape `[]` refused (`meta::parse_meta`);
//! 25. a meta renamed onto a data name losing its last byte (`Fs::rename_parts`);
//! 26. a written key's value not settling back to the file's (`Live::kv_settle`);
//! 27. a removed key's name forgetting its type (`Live::kv_remove`);
//! 28. ggml's block rule checked on the outermost dimension (`tensor_rule`);
//! 29. the blocks a write stages past the first not journaled (`Record::Patch`);
//! 30. a write's first block not filled from the source (`Patched::write_at`);
//! 31. an in-place commit putting a tensor's staged blocks at the data's start.
//!
//! Source tensor "b" spans three blocks and writes go to its block edges, so
//! that a write into a source tensor stages some of its blocks (`Patched`)
//! and leaves the rest to the source: the model predicts which blocks are
//! staged, and that reads of the others fail once the source is rewritten
//! in place behind the mount.
//!
//! Found by the GGUF runs when they were added: the journal refusing a GGUF
//! tensor's block type (a write into a Q8_0 tensor lost at a crash, and with
//! it every later edit: `Meta`'s dtype is kept by name now); `mv` of a key
//! that is not there answering EEXIST before ENOENT; keys of a file rewritten
//! in place shown as empty values and `{}` (EIO now); a pure reorder of the
//! keys never committed; and a rewrite whose last tensor is empty ending the
//! file before it (ggml refused the file).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;

mod apply;
mod cases;
mod checks;
mod generators;
mod gguf;
mod harness;
mod lifecycle;
mod reference;
mod views;

use apply::*;
use checks::*;
use generators::*;
use gguf::*;
use harness::*;
use lifecycle::*;
use reference::*;
use stfs::checkpoint::recover::{self, Resume};
use stfs::checkpoint::staging::Staging;
use stfs::fs::{Fs, IndexFile, Ino, ROOT_INO, Settings, Source, TensorFile};
use stfs::source::Folder;
use stfs::source::{FileStat, SourceFile};
use views::*;

const NAMES: [&str; 5] = ["a", "b", "c/d", "x.meta.json", ""];
/// Bytes of source tensor "b" (I16): over three blocks, so that a write
/// into it stages some of its blocks and leaves the others to the source.
const BIG: u64 = 12400;

fn big_bytes() -> Vec<u8> {
    (0..BIG).map(|i| (i * 7 % 251) as u8).collect()
}
/// The model's own dtype table: name, elements per block, bytes per block,
/// ggml's type id (None: GGUF cannot hold it). Q8_0 is a ggml block type,
/// which a safetensors file cannot hold.
const DTYPES: [(&str, u64, u64, Option<u32>); 9] = [
    ("U8", 1, 1, None),
    ("I16", 1, 2, Some(25)),
    ("F32", 1, 4, Some(0)),
    ("BF16", 1, 2, Some(30)),
    ("F64", 1, 8, Some(28)),
    ("I8", 1, 1, Some(24)),
    ("Q8_0", 32, 34, Some(8)),
    ("F16", 1, 2, Some(1)),
    ("Q4_K", 256, 144, Some(12)),
];
const MAX_HANDLES: usize = 3;
const OTHER_USER: u32 = 4242;
const INDEX: &str = "model.safetensors.index.json";

// ---- the model's own JSON files ----

// ---- the model ----

// ---- the filesystem side ----

thread_local! {
    /// Commits of this thread's runs: (in place, rewrites, in place with
    /// blocks inserted at the start, in place as the model predicted).
    static WAYS: std::cell::RefCell<(usize, usize, usize, usize)> = const { std::cell::RefCell::new((0, 0, 0, 0)) };
}
