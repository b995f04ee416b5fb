//! The load pipeline without FUSE: a file's tensors through the engine, into
//! one arena, against one memcpy of the same bytes (both from the page cache,
//! measured in the same run). Host engine here; on a GPU machine
//! `STFS_BENCH_CUDA=N` adds the CUDA engine of device N (its baseline is then
//! the same load's host run: the GPU run's own limit is measured by
//! scripts/gpu-check.sh with torch).
//!
//! cargo bench --bench load [-- FILE.safetensors]   (default: 1 GiB generated;
//! LANES=N and SLAB_MIB=M change the pool, 8 x 16 MiB)

use std::sync::Arc;
use std::time::{Duration, Instant};

use stfs::prefetch::load::engine::{Engine, HostEngine};
use stfs::prefetch::load::plan::Item;
use stfs::prefetch::load::pool::Pool;
use stfs::prefetch::load::run::Way;
use stfs::prefetch::load::{Load, LoadError};

const RUNS: usize = 5;

/// A safetensors-like file of `n` tensors of `each` bytes back to back
/// (only the data: the bench reads tensors, not headers).
fn generated(n: usize, each: usize) -> (tempfile::NamedTempFile, Vec<(u64, u64)>) {
    use std::io::Write;
    let mut f = tempfile::NamedTempFile::new().unwrap();
    let block: Vec<u8> = (0..each).map(|i| (i * 31 % 251) as u8).collect();
    for _ in 0..n {
        f.write_all(&block).unwrap();
    }
    f.flush().unwrap();
    let spans = (0..n as u64)
        .map(|i| (i * each as u64, each as u64))
        .collect();
    (f, spans)
}

/// The tensors of a safetensors file: (absolute offset, length) each.
fn tensors_of(path: &std::path::Path) -> Vec<(u64, u64)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(_, v)| {
            let o = &v["data_offsets"];
            let (b, e) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
            (8 + n as u64 + b, e - b)
        })
        .collect()
}

fn items(file: &Arc<std::fs::File>, spans: &[(u64, u64)]) -> Vec<Item> {
    let each = |(i, &(offset, len)): (usize, &(u64, u64))| {
        Item::of_file(format!("t{i}"), file, offset, len)
    };
    spans.iter().enumerate().map(each).collect()
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn load_time(
    pool: &Arc<Pool>,
    file: &Arc<std::fs::File>,
    spans: &[(u64, u64)],
    way: Way,
) -> Result<Duration, LoadError> {
    let mut times = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        let load = Load::start(items(file, spans), pool.clone(), way)?;
        load.wait(&|| true)?;
        times.push(t.elapsed());
    }
    Ok(median(times))
}

/// One memcpy of the file's bytes (from its mapping, the page cache) into
/// fresh memory in huge pages, as a load fills a fresh arena.
fn memcpy_time(file: &std::fs::File, total: usize) -> Duration {
    // SAFETY: a read-only map of a file nobody changes during the bench.
    let map = unsafe { memmap2::Mmap::map(file) }.unwrap();
    std::hint::black_box(map.iter().step_by(4096).map(|&b| b as u64).sum::<u64>());
    median(
        (0..RUNS)
            .map(|_| {
                let t = Instant::now();
                let mut out = memmap2::MmapOptions::new()
                    .len(total.max(1))
                    .map_anon()
                    .unwrap();
                let _ = out.advise(memmap2::Advice::HugePage);
                out[..total].copy_from_slice(&map[..total]);
                std::hint::black_box(&out);
                t.elapsed()
            })
            .collect(),
    )
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn main() {
    let arg = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let (_keep, path, spans) = match arg {
        Some(p) => {
            let path = std::path::PathBuf::from(p);
            let spans = tensors_of(&path);
            (None, path, spans)
        }
        None => {
            let (f, spans) = generated(64, 16 << 20);
            let path = f.path().to_path_buf();
            (Some(f), path, spans)
        }
    };
    let file = Arc::new(std::fs::File::open(&path).unwrap());
    let total: u64 = spans.iter().map(|s| s.1).sum();
    let _ = std::fs::read(&path); // the page cache warm
    let end = spans.iter().map(|s| s.0 + s.1).max().unwrap_or(0);
    let base = memcpy_time(&file, end as usize);
    let lanes: usize = std::env::var("LANES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let slab: usize = std::env::var("SLAB_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
        << 20;
    let host = Arc::new(Pool::new(Box::new(HostEngine), lanes, slab));
    let t = load_time(&host, &file, &spans, Way::Direct).unwrap();
    let slabbed = load_time(&host, &file, &spans, Way::ThroughSlabs).unwrap();
    println!(
        "load: {} tensors, {:.2} GiB, page cache warm, median of {RUNS}",
        spans.len(),
        total as f64 / (1u64 << 30) as f64
    );
    println!(
        "  one memcpy (baseline)   {:6.2} GB/s  (into fresh memory in huge pages)",
        gbps(end, base)
    );
    println!(
        "  host engine             {:6.2} GB/s  ({:.2}x the memcpy; read straight into the arena)",
        gbps(total, t),
        gbps(total, t) / gbps(end, base),
    );
    println!(
        "  host engine, slabs      {:6.2} GB/s  ({:.2}x the memcpy; through {} slabs of {} MiB)",
        gbps(total, slabbed),
        gbps(total, slabbed) / gbps(end, base),
        host.made(),
        host.slab() >> 20
    );
    if let Ok(n) = std::env::var("STFS_BENCH_CUDA") {
        let engine: Box<dyn Engine> =
            match stfs::prefetch::cuda::CudaEngine::new(n.parse().unwrap_or(0)) {
                Ok(e) => Box::new(e),
                Err(e) => return println!("  cuda:{n}                  {e}"),
            };
        let cuda = Arc::new(Pool::new(engine, 8, 16 << 20));
        match load_time(&cuda, &file, &spans, Way::Direct) {
            Ok(t) => println!("  cuda:{n} engine           {:6.2} GB/s", gbps(total, t)),
            Err(e) => println!("  cuda:{n} engine           failed: {e}"),
        }
    }
}
