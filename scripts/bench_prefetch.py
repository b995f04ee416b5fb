#!/usr/bin/env python3
"""Page-cache prefetch from a cold cache: `stfs prefetch` of a 1 GiB tensor
against `cat FILE > /dev/null` of the same file, each after dropping the
file's pages (posix_fadvise DONTNEED), measured in the same run.

Usage: scripts/bench_prefetch.py [--stfs target/release/stfs] [--dir /var/tmp] [--runs 5]
"""

import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "pylib"))
from stfs_fixtures import Mount, bench_args, drop_from_cache, timed  # noqa: E402


def main():
    a = bench_args(__doc__, runs=5)
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="stfs-bench-") as work:
        src = os.path.join(work, "one.safetensors")
        save_file({"t": np.frombuffer(np.random.default_rng(0).bytes(1 << 30), np.uint8)}, src)
        os.sync()
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        cat, pre = [], []
        with Mount(a.stfs, src, mnt, log=os.path.join(work, "log"), check=True):
            for _ in range(a.runs):
                drop_from_cache(src)
                cat.append(timed(lambda: subprocess.run(f"cat {src} > /dev/null", shell=True, check=True)))
                drop_from_cache(src)
                pre.append(timed(lambda: subprocess.run([a.stfs, "prefetch", os.path.join(mnt, "t")], check=True,
                                                        stdout=subprocess.DEVNULL)))
        c, q = statistics.median(cat), statistics.median(pre)
        gb = (1 << 30) / 1e9
        print(f"1 GiB, page cache cold, median of {a.runs}:")
        print(f"  cat FILE > /dev/null          {gb / c:6.2f} GB/s  1.00x")
        print(f"  stfs prefetch (page cache)    {gb / q:6.2f} GB/s  {c / q:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
