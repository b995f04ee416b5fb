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
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_checkpoint(path, n):
    header = {}
    for i in range(n):
        header[f"model.layers.{i // 1000}.block.{i % 1000}.weight"] = {
            "dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(bytes(n))
    return len(text)


def status(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stfs", default=os.path.join(ROOT, "target", "release", "stfs"))
    p.add_argument("--tensors", type=int, default=1_000_000)
    p.add_argument("--commits", type=int, default=3)
    p.add_argument("--metadata", action="store_true",
                   help="each commit changes __metadata__.json only (not a tensor byte)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="stfs-bench-") as work:
        src = os.path.join(work, "big.safetensors")
        header = write_checkpoint(src, a.tensors)
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        pid_file = os.path.join(work, "pid")
        t = time.perf_counter()
        subprocess.run([a.stfs, "mount", "--pid-file", pid_file, "--log-file", os.path.join(work, "log"), src, mnt],
                       check=True)
        took = time.perf_counter() - t
        pid = int(open(pid_file).read())
        print(f"{a.tensors} tensors, header {header / 1e6:.1f} MB; daemon memory as a multiple of the header:")

        def report(step, took):
            rss, hwm, anon = status(pid, "VmRSS"), status(pid, "VmHWM"), status(pid, "RssAnon")
            print(f"  {step:28s} {took:6.2f} s   RSS {rss / 1e6:7.1f} MB = {rss / header:.2f}x"
                  f" (anonymous {anon / header:.2f}x)   peak so far {hwm / 1e6:7.1f} MB = {hwm / header:.2f}x")

        try:
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
                t = time.perf_counter()
                subprocess.run([a.stfs, "commit", mnt], check=True, capture_output=True)
                took = time.perf_counter() - t
                time.sleep(1)  # the replaced file is unmapped in the background
                report(f"commit {k + 1}", took)
        finally:
            subprocess.run([a.stfs, "umount", mnt], check=True)


if __name__ == "__main__":
    sys.exit(main())
