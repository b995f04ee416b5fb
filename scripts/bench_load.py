#!/usr/bin/env python3
"""A load through a real mount with the host engine (`stfs.cuda.Load(mnt,
"host")`: the pipeline a CUDA load runs, into the daemon's memory) against
one memcpy of the same bytes, page cache warm, measured in the same run:
into fresh memory in huge pages (as a load fills a fresh arena: the
baseline) and into a buffer whose pages are already there. Both ways of a
load: straight into the arena, and through the slabs (the path a GPU takes).
Also says whether any slab was made after the first load.

Usage: scripts/bench_load.py [--stfs target/release/stfs] [--dir /var/tmp] [--gib 1] [--runs 5]
"""

import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests", "pylib"))
sys.path.insert(0, os.path.join(here, "..", "python"))
from stfs import cuda as stfs_cuda  # noqa: E402
from stfs_fixtures import Mount, bench_args  # noqa: E402


def main():
    a = bench_args(__doc__, gib=1.0, runs=5)
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="stfs-bench-") as work:
        src = os.path.join(work, "ckpt.safetensors")
        n = max(1, int(a.gib * 16))
        rng = np.random.default_rng(0)
        save_file({f"t{i:03d}": np.frombuffer(rng.bytes(64 << 20), np.uint8) for i in range(n)}, src)
        total = n * (64 << 20)
        with open(src, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        data = np.frombuffer(m, np.uint8)[-total:]
        warm = np.empty(total, np.uint8)
        fresh_t, warm_t, daemon_t, wall_t, slab_t = [], [], [], [], []
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        with Mount(a.stfs, src, mnt, log=os.path.join(work, "log"), check=True):
            for run in range(a.runs + 1):
                np.copyto(warm, data)  # (the page cache warm, and this buffer's pages made)
                t = time.perf_counter()
                np.copyto(warm, data)
                warm_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                fresh = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as an arena is
                fresh.madvise(mmap.MADV_HUGEPAGE)
                np.copyto(np.frombuffer(fresh, np.uint8), data)
                fresh_t.append(time.perf_counter() - t)
                fresh.close()
                t = time.perf_counter()
                load = stfs_cuda.Load(mnt, "host")
                load.wait()
                wall_t.append(time.perf_counter() - t)
                daemon_t.append(load.state["elapsed_ns"] / 1e9)
                slabs = load.state["slabs_made"]
                load.close()
                load = stfs_cuda.Load(mnt, "host", through_slabs=True)
                load.wait()
                slab_t.append(load.state["elapsed_ns"] / 1e9)
                load.close()
                if run == 0:
                    first_slabs = slabs
                    fresh_t, warm_t, daemon_t, wall_t, slab_t = [], [], [], [], []  # the first run warms up
        del data
        m.close()
    gb = lambda ts: total / statistics.median(ts) / 1e9  # noqa: E731
    print(f"ratios: to the baseline / to the buffer already made")
    print(f"load of {n} tensors, {total / (1 << 30):.2f} GiB, page cache warm, median of {a.runs}:")
    print(f"  memcpy into fresh memory            {gb(fresh_t):6.2f} GB/s  (baseline)")
    print(f"  memcpy into a buffer already made   {gb(warm_t):6.2f} GB/s")
    print(f"  stfs host load, the daemon's time   {gb(daemon_t):6.2f} GB/s  "
          f"{gb(daemon_t) / gb(fresh_t):.2f}x / {gb(daemon_t) / gb(warm_t):.2f}x")
    print(f"  stfs host load, with the requests   {gb(wall_t):6.2f} GB/s  "
          f"{gb(wall_t) / gb(fresh_t):.2f}x / {gb(wall_t) / gb(warm_t):.2f}x")
    print(f"  stfs host load through the slabs    {gb(slab_t):6.2f} GB/s  "
          f"{gb(slab_t) / gb(fresh_t):.2f}x / {gb(slab_t) / gb(warm_t):.2f}x (the daemon's time)")
    print(f"  slabs made: {first_slabs} at the first load, {slabs} after {a.runs + 1} loads")


if __name__ == "__main__":
    main()
