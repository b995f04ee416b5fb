#!/usr/bin/env python3
"""Commit benchmark: a 2 GiB checkpoint with one 64 MiB tensor replaced through
the mount, `stfs commit` timed against `cp` of the source file to the same
folder, measured in the same run; and the daemon's peak RSS (VmHWM).

Usage: scripts/bench_commit.py [--stfs target/release/stfs] [--dir DIR] [--runs 3]
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stfs", default=os.path.join(ROOT, "target", "release", "stfs"))
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="stfs-bench-") as work:
        src = os.path.join(work, "two.safetensors")
        rng = np.random.default_rng(0)
        save_file({f"t{i:02d}": np.frombuffer(rng.bytes(64 << 20), np.uint8) for i in range(32)}, src)
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        cp_times, commit_times, rss = [], [], []
        replacement = np.frombuffer(rng.bytes(64 << 20), np.uint8).tobytes()
        for _ in range(a.runs):
            copy = os.path.join(work, "copy.safetensors")
            t = time.perf_counter()
            subprocess.run(["cp", src, copy], check=True)
            os.sync()
            cp_times.append(time.perf_counter() - t)
            os.unlink(copy)

            pid_file = os.path.join(work, "pid")
            subprocess.run([a.stfs, "mount", "--pid-file", pid_file, "--log-file", os.path.join(work, "log"), src, mnt], check=True)
            pid = int(open(pid_file).read())
            try:
                with open(os.path.join(mnt, "t07"), "r+b") as f:
                    f.write(replacement)
                os.sync()
                t = time.perf_counter()
                subprocess.run([a.stfs, "commit", mnt], check=True, stdout=subprocess.DEVNULL)
                commit_times.append(time.perf_counter() - t)
                rss.append(int([l for l in open(f"/proc/{pid}/status") if l.startswith("VmHWM:")][0].split()[1]))
            finally:
                subprocess.run([a.stfs, "umount", mnt], check=True)
        c, k = statistics.median(cp_times), statistics.median(commit_times)
        print(f"2 GiB checkpoint, one 64 MiB tensor replaced, median of {a.runs}:")
        print(f"  cp of the source file (+ sync)   {c:6.2f} s  1.00x")
        print(f"  stfs commit (fsync'd, renamed)   {k:6.2f} s  {k / c:.2f}x")
        print(f"  daemon peak RSS during it        {max(rss) / 1024:6.1f} MiB")
        print("  each run, cp / commit (s):", " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(cp_times, commit_times)))
        for line in open(os.path.join(work, "log")):
            if "commit written" in line:
                print("  daemon:", " ".join(f for f in line.split() if f.startswith(("bytes=", "elapsed="))))


if __name__ == "__main__":
    sys.exit(main())
