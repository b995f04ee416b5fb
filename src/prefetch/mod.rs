//! Prefetching a tensor's bytes: into the page cache (everywhere), or into a
//! CUDA device buffer exported by IPC handle (where a driver is present).

pub mod cuda;
pub mod load;

use crate::sync::LockAnyway;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::source::{Backing, Bytes};

/// Chunk read by each worker at a time.
const CHUNK: u64 = 8 << 20;

/// Brings bytes `start..end` of a tensor into the page cache: WILLNEED advice,
/// then reads by several threads so that many requests are in flight on a
/// cold disk. Holes of a sparse staging file are skipped, not read. Stops
/// when `keep_going` says so (the caller is gone, or time is up). Returns
/// where it stopped and the bytes of `start..` that far now resident.
pub fn to_page_cache(
    backing: &Backing,
    start: u64,
    end: u64,
    keep_going: &(dyn Fn() -> bool + Sync),
) -> std::io::Result<(u64, u64)> {
    if end <= start {
        return Ok((end, 0));
    }
    let (file, base, sparse) = match backing {
        Backing::File {
            file,
            offset,
            sparse,
            moves_with,
            ..
        } => {
            // Where the bytes are now, if an in-place commit moved them since.
            let moved = moves_with
                .as_ref()
                .map_or(0, |(source, seen)| source.shift() - seen);
            (&**file, *offset + moved, *sparse)
        }
        // A source tensor with blocks staged: the source's, then the staged ones.
        Backing::Patched(p) => {
            let (base, index) = p.base();
            let both = [
                Bytes::Source(base.clone(), index).backing()?,
                Bytes::Staged(p.staged().clone()).backing()?,
            ];
            let mut got = (end, 0);
            for backing in both.iter().flatten() {
                let (reached, resident) = to_page_cache(backing, start, end, keep_going)?;
                got = (got.0.min(reached), got.1.max(resident));
            }
            return Ok(got);
        }
        // A remote tensor goes into the local disk cache, by parallel GETs.
        Backing::Remote { source, offset, .. } => {
            let object = source.remote_object().expect("a remote source");
            let (reached, cached) = object.warm(offset + start..offset + end, keep_going)?;
            return Ok((reached - offset, cached));
        }
    };
    let len = std::num::NonZeroU64::new(end - start);
    let _ = rustix::fs::fadvise(file, base + start, len, rustix::fs::Advice::WillNeed);
    let chunks = (end - start).div_ceil(CHUNK);
    let workers = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
        .min(chunks as usize);
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    // Chunks below this all finished.
    let finished = std::sync::Mutex::new(vec![false; chunks as usize]);
    std::thread::scope(|s| -> std::io::Result<()> {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    let mut buf = vec![0u8; CHUNK as usize];
                    loop {
                        if stop.load(Ordering::Relaxed) || !keep_going() {
                            stop.store(true, Ordering::Relaxed);
                            return Ok(());
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= chunks {
                            return Ok(());
                        }
                        let from = start + i * CHUNK;
                        let to = (from + CHUNK).min(end);
                        read_range(file, base, from, to, sparse, &mut buf)?;
                        finished.lock_anyway()[i as usize] = true;
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("prefetch worker panicked")?;
        }
        Ok(())
    })?;
    let done_chunks = finished
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .take_while(|&&d| d)
        .count() as u64;
    let reached = (start + done_chunks * CHUNK).min(end);
    let resident = if sparse {
        // Only the data segments can hold pages.
        let (mut pos, stop, mut sum) = (base + start, base + reached, 0);
        while let Some(data) = seek(file, rustix::fs::SeekFrom::Data(pos)).filter(|&d| d < stop) {
            let hole = seek(file, rustix::fs::SeekFrom::Hole(data))
                .unwrap_or(stop)
                .min(stop);
            sum += resident_bytes(file, data, hole - data)?;
            pos = hole;
        }
        sum
    } else {
        resident_bytes(file, base + start, reached - start)?
    };
    Ok((reached, resident))
}

/// Reads `base+from..base+to`, skipping holes when the file may have them.
fn read_range(
    file: &File,
    base: u64,
    from: u64,
    to: u64,
    sparse: bool,
    buf: &mut [u8],
) -> std::io::Result<()> {
    let (mut pos, stop) = (base + from, base + to);
    while pos < stop {
        if sparse {
            match seek(file, rustix::fs::SeekFrom::Data(pos)) {
                Some(data) if data < stop => pos = data,
                _ => return Ok(()), // only a hole (or the end) is left
            }
        }
        let hole = if sparse {
            seek(file, rustix::fs::SeekFrom::Hole(pos))
                .unwrap_or(stop)
                .min(stop)
        } else {
            stop
        };
        while pos < hole {
            let n = ((hole - pos) as usize).min(buf.len());
            match file.read_at(&mut buf[..n], pos) {
                Ok(0) => return Ok(()),
                Ok(k) => pos += k as u64,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// lseek with SEEK_DATA or SEEK_HOLE; the position is not shared with
/// anything that depends on it (reads use pread).
fn seek(file: &File, to: rustix::fs::SeekFrom) -> Option<u64> {
    rustix::fs::seek(file, to).ok()
}

/// Bytes of a file range that are in the page cache.
pub fn resident_bytes(file: &File, offset: u64, len: u64) -> std::io::Result<u64> {
    let ranges = resident_ranges(file, offset, len)?;
    Ok(ranges.iter().map(|r| r.end - r.start).sum())
}

/// The runs of a file range that are in the page cache (mincore on a
/// temporary map, a window at a time), adjacent pages joined.
pub fn resident_ranges(
    file: &File,
    offset: u64,
    len: u64,
) -> std::io::Result<Vec<std::ops::Range<u64>>> {
    const WINDOW: u64 = 1 << 30;
    let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
    let mut at = offset;
    while at < offset + len {
        let n = WINDOW.min(offset + len - at);
        for r in resident_window(file, at, n)? {
            match ranges.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => ranges.push(r),
            }
        }
        at += n;
    }
    Ok(ranges)
}

fn resident_window(
    file: &File,
    offset: u64,
    len: u64,
) -> std::io::Result<Vec<std::ops::Range<u64>>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    const PAGE: u64 = 4096;
    let start = offset / PAGE * PAGE;
    let map_len = (offset + len - start) as usize;
    // SAFETY: a read-only map used only for mincore; its bytes are never read.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(start)
            .len(map_len)
            .map(file)?
    };
    let pages = map_len.div_ceil(PAGE as usize);
    let mut vec = vec![0u8; pages];
    // SAFETY: map is a live mapping of map_len bytes; vec holds one byte per page.
    if unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map_len, vec.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
    for (i, v) in vec.iter().enumerate() {
        if v & 1 == 0 {
            continue;
        }
        let page_start = (start + i as u64 * PAGE).max(offset);
        let page_end = (start + (i as u64 + 1) * PAGE).min(offset + len);
        match ranges.last_mut() {
            Some(last) if last.end == page_start => last.end = page_end,
            _ => ranges.push(page_start..page_end),
        }
    }
    Ok(ranges)
}

/// Brings `ranges` of `file` into the page cache again, in the background
/// (after an insertion at the file's start dropped them: FALLOC_FL_INSERT_RANGE
/// empties the file's page cache past the insertion), while `still` holds
/// (the bytes have not moved again). Says how much when done.
pub fn bring_back(
    file: Arc<File>,
    ranges: Vec<std::ops::Range<u64>>,
    still: impl Fn() -> bool + Send + 'static,
    path: std::path::PathBuf,
) {
    if ranges.is_empty() {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("stfs-recache".into())
        .spawn(move || {
            let started = std::time::Instant::now();
            let mut buf = vec![0u8; CHUNK as usize];
            let mut read = 0;
            for r in &ranges {
                if !still() {
                    break;
                }
                // Read, not advised: WILLNEED gives up past the read-ahead
                // limit, and a read is what a reader would have done.
                if read_range(&file, 0, r.start, r.end, true, &mut buf).is_err() {
                    break;
                }
                read += r.end - r.start;
            }
            let _ = crate::testpoint::point("recache:done");
            tracing::info!(
                file = %path.display(),
                mib = read >> 20,
                seconds = started.elapsed().as_secs_f64(),
                "page cache brought back after the header grew at the file's start"
            );
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn backing(file: File, offset: u64, len: u64, sparse: bool) -> Backing {
        Backing::File {
            file: Arc::new(file),
            offset,
            len,
            sparse,
            moves_with: None,
        }
    }

    #[test]
    fn prefetch_reports_the_range_resident() {
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, &vec![7u8; 20 << 20]).unwrap();
        f.sync_all().unwrap();
        let b = backing(f, 12345, 10 << 20, false);
        assert_eq!(
            to_page_cache(&b, 0, 10 << 20, &|| true).unwrap(),
            (10 << 20, 10 << 20)
        );
        assert_eq!(to_page_cache(&b, 5, 5, &|| true).unwrap(), (5, 0));
    }

    #[test]
    fn holes_are_skipped_and_a_stop_is_reported() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 40).unwrap(); // 1 TiB of hole
        f.write_all_at(b"data", 5 << 30).unwrap();
        let b = backing(f, 0, 1 << 40, true);
        let started = std::time::Instant::now();
        let (reached, _) = to_page_cache(&b, 0, 1 << 40, &|| true).unwrap();
        assert_eq!(reached, 1 << 40);
        assert!(started.elapsed().as_secs() < 60, "holes must not be read");
        let (reached, resident) = to_page_cache(&b, 0, 1 << 40, &|| false).unwrap();
        assert_eq!((reached, resident), (0, 0));
    }
}
