//! A source tensor with some of its blocks written: the written blocks are
//! in a staging file, the rest is still the source's. A write costs what it
//! writes (a 4-byte patch of a 2 GiB tensor stages one block, not 2 GiB),
//! and a commit in place writes back only the blocks staged.
//!
//! The staging file holds the tensor at the same offset within a block as
//! any staging file (`pad`), and only whole blocks of `STAGING_ALIGN` of it
//! are ever staged: a write first fills the part of its first and last
//! block it does not cover from the source, in the same `pwrite`. So every
//! staged block is the tensor's bytes there, whole, and `runs` (tensor
//! offsets, whole blocks but at the tensor's two ends) says which they are.
//! The journal records each run as it is staged (`Record::Patch`).

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::{Arc, Mutex};

use super::staged::{STAGING_ALIGN, StagingDir};
use super::{Bytes, SourceFile, StagedFile, copy_range, copy_sharing};
use crate::sync::LockAnyway;

pub struct Patched {
    base: Arc<SourceFile>,
    index: u32,
    staged: Arc<StagedFile>,
    runs: Mutex<Runs>,
}

/// Ranges of a tensor staged: start -> end, apart and not touching (a
/// range added next to one merges with it), found in log time.
#[derive(Clone, Default)]
struct Runs(BTreeMap<u64, u64>);

impl Runs {
    /// The runs that overlap `a..b`, in order.
    fn overlapping(&self, a: u64, b: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let first = self.0.range(..=a).next_back().map_or(a, |(&x, _)| x);
        self.0
            .range(first..b)
            .map(|(&x, &y)| (x, y))
            .filter(move |&(_, y)| y > a)
    }

    fn contains(&self, at: u64) -> bool {
        self.overlapping(at, at + 1).next().is_some()
    }

    /// Adds `a..b`; returns its parts that were not in.
    fn add(&mut self, a: u64, b: u64) -> Vec<(u64, u64)> {
        let mut fresh = Vec::new();
        let mut at = a;
        // (Touching runs merge too.)
        let joined: Vec<(u64, u64)> = self.overlapping(a.saturating_sub(1), b + 1).collect();
        for &(x, y) in &joined {
            if x > at && at < b {
                fresh.push((at, x.min(b)));
            }
            at = at.max(y);
        }
        if at < b {
            fresh.push((at, b));
        }
        let (mut lo, mut hi) = (a, b);
        for (x, y) in joined {
            self.0.remove(&x);
            (lo, hi) = (lo.min(x), hi.max(y));
        }
        self.0.insert(lo, hi);
        fresh
    }
}

impl Patched {
    /// Nothing staged yet: a sparse staging file of the tensor's length.
    pub fn new(
        dir: &Arc<StagingDir>,
        base: Arc<SourceFile>,
        index: u32,
    ) -> std::io::Result<Patched> {
        let source = Bytes::Source(base.clone(), index);
        let staged = dir.new_file(source.pad_in_block())?;
        staged.set_len(source.len())?;
        Ok(Patched {
            base,
            index,
            staged,
            runs: Mutex::default(),
        })
    }

    /// A staging file an earlier mount left, with the runs its journal
    /// recorded; None if they do not fit the tensor.
    pub fn existing(
        base: Arc<SourceFile>,
        index: u32,
        staged: Arc<StagedFile>,
        runs: &[(u64, u64)],
    ) -> Option<Patched> {
        let len = Bytes::Source(base.clone(), index).len();
        if staged.len() != len || runs.iter().any(|&(a, b)| a >= b || b > len) {
            return None;
        }
        let mut all = Runs::default();
        for &(a, b) in runs {
            all.add(a, b);
        }
        Some(Patched {
            base,
            index,
            staged,
            runs: Mutex::new(all),
        })
    }

    /// The source tensor under the staged blocks.
    pub fn base(&self) -> (&Arc<SourceFile>, u32) {
        (&self.base, self.index)
    }

    /// The same staged blocks over the same bytes of another file (a
    /// commit put the tensor there).
    pub fn rebased(&self, base: Arc<SourceFile>, index: u32) -> Patched {
        Patched {
            base,
            index,
            staged: self.staged.clone(),
            runs: Mutex::new(self.runs.lock_anyway().clone()),
        }
    }

    pub fn staged(&self) -> &Arc<StagedFile> {
        &self.staged
    }

    pub fn len(&self) -> u64 {
        self.staged.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ranges of the tensor that are staged.
    pub fn runs(&self) -> Vec<(u64, u64)> {
        self.runs_in(0, self.len())
    }

    /// The staged ranges that overlap `a..b`, cut to it.
    fn runs_in(&self, a: u64, b: u64) -> Vec<(u64, u64)> {
        let runs = self.runs.lock_anyway();
        runs.overlapping(a, b)
            .map(|(x, y)| (x.max(a), y.min(b)))
            .collect()
    }

    /// Every byte is staged: the staging file alone is the tensor.
    pub fn whole(&self) -> bool {
        let len = self.len();
        let runs = self.runs.lock_anyway();
        len == 0 || (runs.0.len() == 1 && runs.0.get(&0) == Some(&len))
    }

    /// The whole blocks around `start..end` (tensor offsets), cut to the tensor.
    fn blocks(&self, start: u64, end: u64) -> (u64, u64) {
        let pad = self.staged.pad();
        let lo = ((start + pad) / STAGING_ALIGN * STAGING_ALIGN).saturating_sub(pad);
        let hi = ((end + pad).next_multiple_of(STAGING_ALIGN) - pad).min(self.len());
        (lo, hi)
    }

    fn staged_at(&self, at: u64) -> bool {
        self.runs.lock_anyway().contains(at)
    }

    /// Writes `data` at `offset` (within the tensor: the caller makes a
    /// whole copy for a write past its end). Returns the ranges staged by
    /// this write that were not before (for the journal).
    pub fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<Vec<(u64, u64)>> {
        let end = offset + data.len() as u64;
        if end > self.len() {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        if data.is_empty() {
            return Ok(Vec::new());
        }
        // (A source changed behind the mount: EIO, whether or not this
        // write reads it, as for any copy of its bytes.)
        self.check_source()?;
        let (lo, hi) = self.blocks(offset, end);
        // The parts of the first and last block the write leaves are the
        // source's, unless those blocks are staged already.
        let head = match self.staged_at(lo) {
            true => offset,
            false => lo,
        };
        let tail = match self.staged_at(hi - 1) {
            true => end,
            false => hi,
        };
        let source = Bytes::Source(self.base.clone(), self.index);
        let mut before = vec![0u8; (offset - head) as usize];
        source.read_exact_at(head, &mut before)?;
        let mut after = vec![0u8; (tail - end) as usize];
        source.read_exact_at(end, &mut after)?;
        crate::testpoint::point("patch:write")?;
        // (One vectored write: the data is not copied to join the edges;
        // copying it halved the daemon's CPU for a 1 GiB `dd`, seen in perf.)
        self.staged.write_parts_at(&[&before, data, &after], head)?;
        Ok(self.add_run((lo, hi)))
    }

    /// EIO if the source was truncated or rewritten behind the mount (its
    /// bytes under the unstaged blocks are gone).
    pub fn check_source(&self) -> std::io::Result<()> {
        self.base.check_unchanged()
    }

    /// Marks `run` staged; returns its parts that were not.
    fn add_run(&self, (a, b): (u64, u64)) -> Vec<(u64, u64)> {
        self.runs.lock_anyway().add(a, b)
    }

    /// Fills `out` with the bytes at `offset`: staged ones from the staging
    /// file, the others from the source (EIO past the end).
    pub fn read_exact_at(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let end = offset
            .checked_add(out.len() as u64)
            .filter(|&e| e <= self.len() || out.is_empty())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EIO))?;
        if out.is_empty() {
            return Ok(());
        }
        let source = Bytes::Source(self.base.clone(), self.index);
        let mut at = offset;
        for (a, b) in self.runs_in(offset, end) {
            if a > at {
                source
                    .read_exact_at(at, &mut out[(at - offset) as usize..(a - offset) as usize])?;
            }
            let part = &mut out[(a - offset) as usize..(b - offset) as usize];
            if self.staged.read_at(part, a)? != part.len() {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            at = b;
        }
        if at < end {
            source.read_exact_at(at, &mut out[(at - offset) as usize..])?;
        }
        Ok(())
    }

    /// Copies the first `len` bytes to `to` at `to_off`: the source's
    /// bytes (sharing blocks where `share`, see `copy_sharing`: the whole
    /// tensor only), then the staged runs over them. Returns the bytes shared.
    pub fn copy_to(
        &self,
        to: &File,
        to_off: u64,
        len: u64,
        share: Option<u64>,
    ) -> std::io::Result<u64> {
        let source = Bytes::Source(self.base.clone(), self.index);
        let share = share.filter(|_| len == self.len());
        let mut shared = match share {
            Some(block) => source.copy_sharing_to(to, to_off, block)?,
            None => {
                source.copy_to(0, to, to_off, len)?;
                0
            }
        };
        let file = self.staged.file()?;
        let pad = self.staged.pad();
        for (a, b) in self.runs_in(0, len) {
            shared += match share {
                Some(block) => copy_sharing(&file, pad + a, to, to_off + a, b - a, block)?,
                None => {
                    copy_range(&file, pad + a, to, to_off + a, b - a)?;
                    0
                }
            };
        }
        Ok(shared)
    }

    /// A copy into a new staging file (this one is pinned by a commit or a
    /// view): the staged runs are copied, the source's bytes are not.
    pub fn copy(&self, dir: &Arc<StagingDir>) -> std::io::Result<Patched> {
        let staged = dir.new_file(self.staged.pad())?;
        staged.set_len(self.len())?;
        let (from, to) = (self.staged.file()?, staged.file()?);
        let pad = self.staged.pad();
        let runs = self.runs.lock_anyway().clone();
        for (a, b) in runs.overlapping(0, self.len()) {
            copy_range(&from, pad + a, &to, pad + a, b - a)?;
        }
        Ok(Patched {
            base: self.base.clone(),
            index: self.index,
            staged,
            runs: Mutex::new(runs),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Folder;

    /// A one-tensor file of `len` bytes whose data starts `skew` bytes into a block.
    fn source(dir: &std::path::Path, len: usize, skew: usize) -> (Arc<SourceFile>, Vec<u8>) {
        let mut json =
            format!(r#"{{"t":{{"dtype":"U8","shape":[{len}],"data_offsets":[0,{len}]}}}}"#);
        while (8 + json.len()) % 4096 != skew {
            json.push(' ');
        }
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.extend_from_slice(&data);
        let path = dir.join("m.safetensors");
        std::fs::write(&path, &file).unwrap();
        (Arc::new(SourceFile::open(&path).unwrap()), data)
    }

    /// Writes anywhere (edges, one byte, across blocks, the whole) read back
    /// as a plain buffer would, stage whole blocks only, and survive a copy
    /// and a reopening from the runs.
    #[test]
    fn writes_read_back_and_stage_whole_blocks() {
        for skew in [0, 8, 100, 4095] {
            let tmp = tempfile::tempdir().unwrap();
            let (src, mut model) = source(tmp.path(), 5 * 4096 + 123, skew);
            let dir = Arc::new(
                StagingDir::create(Arc::new(Folder::open(tmp.path()).unwrap()), "m").unwrap(),
            );
            let p = Patched::new(&dir, src.clone(), 0).unwrap();
            let len = model.len() as u64;
            assert_eq!((p.len(), p.staged().pad()), (len, skew as u64));
            assert!(!p.whole());
            let mut seed = 7u64;
            let mut next = |n: u64| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (seed >> 33) % n
            };
            let mut staged_total = 0;
            for step in 0..40 {
                let (at, n) = match step {
                    0 => (0, 1),
                    1 => (len - 1, 1),
                    2 => (4000, 200),
                    _ => {
                        let at = next(len);
                        (at, 1 + next((len - at).min(9000)))
                    }
                };
                let data: Vec<u8> = (0..n).map(|i| (i as u8) ^ 0x5a ^ step as u8).collect();
                let fresh = p.write_at(&data, at).unwrap();
                model[at as usize..(at + n) as usize].copy_from_slice(&data);
                staged_total += fresh.iter().map(|(a, b)| b - a).sum::<u64>();
                let mut back = vec![0u8; model.len()];
                p.read_exact_at(0, &mut back).unwrap();
                assert_eq!(back, model, "skew {skew}, step {step}");
                // Every run is whole blocks of the staging file (but at the ends).
                for (a, b) in p.runs() {
                    assert!(a == 0 || (a + skew as u64) % 4096 == 0, "{a}");
                    assert!(b == len || (b + skew as u64) % 4096 == 0, "{b}");
                }
            }
            assert_eq!(
                staged_total,
                p.runs().iter().map(|(a, b)| b - a).sum::<u64>()
            );
            // Read in pieces, across run edges.
            let mut piece = vec![0u8; 333];
            p.read_exact_at(4000, &mut piece).unwrap();
            assert_eq!(piece, model[4000..4333]);
            assert!(p.read_exact_at(len - 10, &mut piece).is_err());
            // A copy, and the same file taken back from its runs.
            let copy = p.copy(&dir).unwrap();
            let again =
                Patched::existing(src.clone(), 0, copy.staged().clone(), &copy.runs()).unwrap();
            let mut back = vec![0u8; model.len()];
            again.read_exact_at(0, &mut back).unwrap();
            assert_eq!(back, model);
            assert!(
                Patched::existing(src.clone(), 0, copy.staged().clone(), &[(0, len + 1)]).is_none()
            );
            // Copied whole into a file.
            let out = tempfile::tempfile().unwrap();
            p.copy_to(&out, 3, len, None).unwrap();
            let mut back = vec![0u8; model.len()];
            use std::os::unix::fs::FileExt;
            out.read_exact_at(&mut back, 3).unwrap();
            assert_eq!(back, model);
            // The whole written: whole.
            p.write_at(&model.clone(), 0).unwrap();
            assert!(p.whole());
        }
    }

    #[test]
    fn a_small_patch_stages_a_block() {
        let tmp = tempfile::tempdir().unwrap();
        let (src, _) = source(tmp.path(), 64 << 20, 8);
        let dir =
            Arc::new(StagingDir::create(Arc::new(Folder::open(tmp.path()).unwrap()), "m").unwrap());
        let p = Patched::new(&dir, src, 0).unwrap();
        let fresh = p.write_at(b"abcd", 10 << 20).unwrap();
        assert_eq!(fresh.iter().map(|(a, b)| b - a).sum::<u64>(), 4096);
        use std::os::unix::fs::MetadataExt;
        let blocks = p.staged().file().unwrap().metadata().unwrap().blocks();
        assert!(blocks * 512 <= 64 << 10, "{blocks} blocks allocated");
        assert!(p.write_at(b"abcd", (10 << 20) + 1).unwrap().is_empty());
    }
}
