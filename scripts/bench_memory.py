#!/usr/bin/env python3
"""The daemon's memory on a very large header, reported as ratios to the
header's size (never as pass/fail thresholds): a checkpoint of 1,000,000
one-byte tensors (a header of about 93 MB), mounted, listed, then committed
three times with one byte edited each time. For each step: the daemon's
resident memory (VmRSS) and its peak (VmHWM), and the time taken.

Usage: scripts/bench_memory.py [--stfs target/release/stfs] [--tensors 1000000]
                               [--commits 3] [--metadata]
Needs root (or fusermount3).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "pylib"))
from stfs_fixtures import Mount, add_stfs_option, status_kib, timed, write_by_hand  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stfs_option(p)
    p.add_argument("--tensors", type=int, default=1_000_000)
    p.add_argument("--commits", type=int, default=3)
    p.add_argument("--metadata", action="store_true",
                   help="each commit changes __metadata__.json only (not a tensor byte)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="stfs-bench-") as work:
        src = os.path.join(work, "big.safetensors")
        names = (f"model.layers.{i // 1000}.block.{i % 1000}.weight" for i in range(a.tensors))
        header = write_by_hand(src, [(n, "U8", [1], 1) for n in names], fill=bytes)
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        t = time.perf_counter()
        m = Mount(a.stfs, src, mnt, log=os.path.join(work, "log"), check=True)
        took = time.perf_counter() - t
        print(f"{a.tensors} tensors, header {header / 1e6:.1f} MB; daemon memory as a multiple of the header:")

        def report(step, took):
            rss, hwm, anon = (status_kib(m.pid, field) * 1024 for field in ("VmRSS", "VmHWM", "RssAnon"))
            print(f"  {step:28s} {took:6.2f} s   RSS {rss / 1e6:7.1f} MB = {rss / header:.2f}x"
                  f" (anonymous {anon / header:.2f}x)   peak so far {hwm / 1e6:7.1f} MB = {hwm / header:.2f}x")

        with m:
            report("mount", took)
            t = time.perf_counter()
            out = subprocess.run(f"ls {mnt} | wc -l", shell=True, capture_output=True, text=True, check=True).stdout
            assert int(out) == 2 * a.tensors + 1, out
            report("ls | wc -l", time.perf_counter() - t)
            victim = os.path.join(mnt, "model.layers.5.block.5.weight")
            for k in range(a.commits):
                if a.metadata:
                    with open(os.path.join(mnt, "__metadata__.json"), "w") as f:
                        f.write(json.dumps({"commit": str(k + 1)}))
                else:
                    with open(victim, "r+b") as f:
                        f.write(bytes([k + 1]))
                took = timed(lambda: subprocess.run([a.stfs, "commit", mnt], check=True, capture_output=True))
                time.sleep(1)  # the replaced file is unmapped in the background
                report(f"commit {k + 1}", took)


if __name__ == "__main__":
    sys.exit(main())
