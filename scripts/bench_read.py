#!/usr/bin/env python3
"""Read-path benchmarks of stfs, reported as ratios against baselines measured
in the same run (never as pass/fail thresholds):

1. a 1 GiB tensor, source page cache warm: first read through a fresh mount and
   second read, against `dd` of the same byte range straight from the source
   file, and against the Python reference's get_tensor;
2. mount + `ls | wc -l` of a 100,000-tensor checkpoint against the reference's
   `safe_open(f, "np").keys()`;
3. the daemon's peak RSS (VmHWM) after reading every tensor of a 2 GiB checkpoint.

Usage: scripts/bench_read.py [--stfs target/release/stfs] [--dir DIR] [--runs 5]
Needs root (or fusermount3), numpy and safetensors.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def dd(path, skip=0, count=None):
    args = ["dd", f"if={path}", "of=/dev/null", "bs=1M", "status=none", "iflag=skip_bytes,count_bytes", f"skip={skip}"]
    if count is not None:
        args.append(f"count={count}")
    subprocess.run(args, check=True)


class Mounted:
    def __init__(self, stfs, src, mnt, log):
        self.stfs, self.mnt = stfs, mnt
        self.pid_file = log + ".pid"
        subprocess.run([stfs, "mount", "--pid-file", self.pid_file, "--log-file", log, src, mnt], check=True)
        self.pid = int(open(self.pid_file).read())

    def peak_rss_kib(self):
        for line in open(f"/proc/{self.pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    def close(self):
        subprocess.run([self.stfs, "umount", self.mnt], check=True)
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
            time.sleep(0.02)


def header_offset(path, name):
    n = int.from_bytes(open(path, "rb").read(8), "little")
    with open(path, "rb") as f:
        f.seek(8)
        h = json.loads(f.read(n))
    b, e = h[name]["data_offsets"]
    return 8 + n + b, e - b


def bench_throughput(stfs, work, runs):
    src = os.path.join(work, "one.safetensors")
    size = 1 << 30
    save_file({"t": np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)}, src)
    off, length = header_offset(src, "t")
    dd(src)  # warm the source's page cache
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    direct, first, second, python = [], [], [], []
    for i in range(runs):
        direct.append(timed(lambda: dd(src, off, length)))
        m = Mounted(stfs, src, mnt, os.path.join(work, "bench.log"))
        try:
            first.append(timed(lambda: dd(os.path.join(mnt, "t"))))
            second.append(timed(lambda: dd(os.path.join(mnt, "t"))))
        finally:
            m.close()

        def ref():
            with safe_open(src, framework="np") as f:
                f.get_tensor("t")

        python.append(timed(ref))
    gbps = lambda ts: size / statistics.median(ts) / 1e9
    d = gbps(direct)
    print(f"1 GiB tensor, source page cache warm, median of {runs}:")
    print(f"  dd of the range from the source   {d:6.2f} GB/s  1.00x")
    print(f"  first read through a fresh mount  {gbps(first):6.2f} GB/s  {gbps(first) / d:.2f}x")
    print(f"  second read (kernel cache kept)   {gbps(second):6.2f} GB/s  {gbps(second) / d:.2f}x")
    print(f"  Python safe_open().get_tensor     {gbps(python):6.2f} GB/s  {gbps(python) / d:.2f}x")
    print(f"  first read vs Python get_tensor   {gbps(first) / gbps(python):.2f}x faster")
    os.unlink(src)


def bench_listing(stfs, work, runs):
    src = os.path.join(work, "many.safetensors")
    save_file({f"model.layers.{i // 100}.w{i % 100}": np.zeros(1, np.float16) for i in range(100_000)}, src)
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    ours, theirs = [], []
    for _ in range(runs):
        def mount_and_ls():
            m = Mounted(stfs, src, mnt, os.path.join(work, "bench.log"))
            try:
                out = subprocess.run(f"ls {mnt} | wc -l", shell=True, capture_output=True, text=True, check=True).stdout
                assert int(out) == 200_001, out
            finally:
                ours_after.append(time.perf_counter())
                m.close()

        ours_after = []
        t0 = time.perf_counter()
        mount_and_ls()
        ours.append(ours_after[0] - t0)  # the unmount is not part of the measure

        def keys():
            with safe_open(src, framework="np") as f:
                assert len(f.keys()) == 100_000

        theirs.append(timed(keys))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"100,000 tensors, median of {runs}:")
    print(f"  Python safe_open().keys()   {b:6.3f} s  1.00x")
    print(f"  stfs mount + ls | wc -l     {a:6.3f} s  {a / b:.2f}x")
    os.unlink(src)


def bench_rss(stfs, work):
    src = os.path.join(work, "two.safetensors")
    rng = np.random.default_rng(1)
    save_file({f"t{i}": np.frombuffer(rng.bytes(128 << 20), np.uint8) for i in range(16)}, src)
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    m = Mounted(stfs, src, mnt, os.path.join(work, "bench.log"))
    try:
        for i in range(16):
            dd(os.path.join(mnt, f"t{i}"))
        rss = m.peak_rss_kib()
    finally:
        m.close()
    print(f"2 GiB checkpoint, every tensor read: daemon peak RSS {rss / 1024:.1f} MiB")
    os.unlink(src)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stfs", default=os.path.join(ROOT, "target", "release", "stfs"))
    p.add_argument("--dir", default=None, help="work folder (default: a temp folder under /var/tmp)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--only", choices=["throughput", "listing", "rss"])
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir or "/var/tmp", prefix="stfs-bench-") as work:
        if a.only in (None, "throughput"):
            bench_throughput(a.stfs, work, a.runs)
        if a.only in (None, "listing"):
            bench_listing(a.stfs, work, a.runs)
        if a.only in (None, "rss"):
            bench_rss(a.stfs, work)


if __name__ == "__main__":
    sys.exit(main())
