#!/usr/bin/env python3
"""Page-cache prefetch from a cold cache: `stfs prefetch` of a 1 GiB tensor
against `cat FILE > /dev/null` of the same file, each after dropping the
file's pages (posix_fadvise DONTNEED), measured in the same run.

Usage: scripts/bench_prefetch.py [--stfs target/release/stfs] [--dir /var/tmp] [--runs 5]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drop(path):
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stfs", default=os.path.join(ROOT, "target", "release", "stfs"))
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="stfs-bench-") as work:
        src = os.path.join(work, "one.safetensors")
        save_file({"t": np.frombuffer(np.random.default_rng(0).bytes(1 << 30), np.uint8)}, src)
        os.sync()
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        subprocess.run([a.stfs, "mount", "--log-file", os.path.join(work, "log"), src, mnt], check=True)
        cat, pre = [], []
        try:
            for _ in range(a.runs):
                drop(src)
                t = time.perf_counter()
                subprocess.run(f"cat {src} > /dev/null", shell=True, check=True)
                cat.append(time.perf_counter() - t)
                drop(src)
                t = time.perf_counter()
                subprocess.run([a.stfs, "prefetch", os.path.join(mnt, "t")], check=True, stdout=subprocess.DEVNULL)
                pre.append(time.perf_counter() - t)
        finally:
            subprocess.run([a.stfs, "umount", mnt], check=True)
        c, q = statistics.median(cat), statistics.median(pre)
        gb = (1 << 30) / 1e9
        print(f"1 GiB, page cache cold, median of {a.runs}:")
        print(f"  cat FILE > /dev/null          {gb / c:6.2f} GB/s  1.00x")
        print(f"  stfs prefetch (page cache)    {gb / q:6.2f} GB/s  {c / q:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
