//! Header parse time of stfs against the reference `safetensors` crate, on
//! generated headers of 10, 10,000 and 1,000,000 tensors. Reports medians and
//! the ratio stfs / reference measured in the same run.
//!
//! cargo bench --bench parse

use std::time::{Duration, Instant};

use stfs::format::{Dtype, Header, TensorSpec, layout};

fn checkpoint(n: usize) -> Vec<u8> {
    let specs: Vec<TensorSpec> = (0..n)
        .map(|i| TensorSpec {
            name: format!("layers.{}.experts.{}.w", i / 64, i % 64),
            dtype: [Dtype::BF16, Dtype::F32, Dtype::F8_E4M3][i % 3],
            shape: vec![(i % 7 + 1) as u64, 2],
        })
        .collect();
    let l = layout(&specs, None).unwrap();
    let mut bytes = l.header.clone();
    bytes.resize(l.file_len() as usize, 0);
    bytes
}

fn median_time(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2]
}

fn main() {
    println!(
        "{:>10} {:>12} {:>14} {:>14} {:>8}",
        "tensors", "header", "stfs", "reference", "ratio"
    );
    for (n, runs) in [(10usize, 2001usize), (10_000, 51), (1_000_000, 7)] {
        let bytes = checkpoint(n);
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        // Interleave the two so machine noise hits both alike.
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for _ in 0..3 {
            ours.push(median_time(runs, || {
                std::hint::black_box(Header::parse(std::hint::black_box(&bytes)).unwrap());
            }));
            theirs.push(median_time(runs, || {
                std::hint::black_box(
                    safetensors::SafeTensors::read_metadata(std::hint::black_box(&bytes)).unwrap(),
                );
            }));
        }
        ours.sort();
        theirs.sort();
        let (a, b) = (ours[1], theirs[1]);
        println!(
            "{:>10} {:>10}kB {:>14?} {:>14?} {:>7.2}x",
            n,
            header_len / 1000,
            a,
            b,
            a.as_secs_f64() / b.as_secs_f64()
        );
    }
}
