//! Prefetching a tensor's bytes: into the page cache (everywhere), or into a
//! CUDA device buffer exported by IPC handle (where a driver is present).

pub mod cuda;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// Chunk read by each worker at a time.
const CHUNK: u64 = 8 << 20;

/// Brings `len` bytes at `offset` of `file` into the page cache: one
/// WILLNEED advice, then reads by several threads so that many requests are in
/// flight on a cold disk. Returns the bytes of the range now resident.
pub fn to_page_cache(file: &File, offset: u64, len: u64) -> std::io::Result<u64> {
    if len == 0 {
        return Ok(0);
    }
    // SAFETY: plain advice on a valid descriptor.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as i64,
            len as i64,
            libc::POSIX_FADV_WILLNEED,
        )
    };
    let chunks = len.div_ceil(CHUNK);
    let workers = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
        .min(chunks as usize);
    let next = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| -> std::io::Result<()> {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    let mut buf = vec![0u8; CHUNK as usize];
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= chunks {
                            return Ok(());
                        }
                        let start = offset + i * CHUNK;
                        let n = CHUNK.min(offset + len - start) as usize;
                        let mut done = 0;
                        while done < n {
                            match file.read_at(&mut buf[done..n], start + done as u64)? {
                                0 => break,
                                k => done += k,
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("prefetch worker panicked")?;
        }
        Ok(())
    })?;
    resident_bytes(file, offset, len)
}

/// Bytes of a file range that are in the page cache (mincore on a temporary map).
pub fn resident_bytes(file: &File, offset: u64, len: u64) -> std::io::Result<u64> {
    if len == 0 {
        return Ok(0);
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
    let mut resident = 0u64;
    for (i, v) in vec.iter().enumerate() {
        if v & 1 != 0 {
            let page_start = (start + i as u64 * PAGE).max(offset);
            let page_end = (start + (i as u64 + 1) * PAGE).min(offset + len);
            resident += page_end - page_start;
        }
    }
    Ok(resident)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_reports_the_range_resident() {
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, &vec![7u8; 20 << 20]).unwrap();
        f.sync_all().unwrap();
        let got = to_page_cache(&f, 12345, 10 << 20).unwrap();
        assert_eq!(got, 10 << 20);
        assert_eq!(to_page_cache(&f, 0, 0).unwrap(), 0);
    }
}
