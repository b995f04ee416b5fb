#!/usr/bin/env python3
"""Read-path benchmarks of stfs, reported as ratios against baselines measured
in the same run (never as pass/fail thresholds):

1. a 1 GiB tensor, source page cache warm: first, second and third read through
   a fresh mount, against `dd` of the same byte range straight from the source
   file, against a minimal FUSE server that serves the same range from an mmap
   with direct I/O (examples/minimal_server.rs: the kernel's FUSE path with
   nothing added), and against the Python reference's get_tensor;
2. mount + `ls | wc -l` of a 100,000-tensor checkpoint against the reference's
   `safe_open(f, "np").keys()`; `ls -l` of 10,000, 50,000 and 100,000 tensors,
   cold and warm, against `ls -l` of a plain folder of as many empty files;
3. the daemon's private memory (RssAnon) after reading every tensor of a 2 GiB
   checkpoint.

The throughput part runs every cache mode (-o cache=keep|direct) with the
daemon's mapping kept populated or released after each read (-o
mapping=keep|release), and reports for each the first, second and third read,
the page cache the reads added (1.0x: the bytes are cached twice), and the READ
requests the daemon saw during the second read.

Usage: scripts/bench_read.py [--stfs target/release/stfs] [--dir DIR] [--runs 5]
Needs root (or fusermount3), numpy and safetensors.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "pylib"))
from stfs_fixtures import ROOT, Mount, add_stfs_option, dd_read, meminfo_kib, tensor_range, timed  # noqa: E402


def served_reads(stfs, mnt):
    """READ requests the daemon has served (from `stfs status`)."""
    out = subprocess.run([stfs, "status", mnt], capture_output=True, text=True).stdout
    line = [l for l in out.splitlines() if l.startswith("served ")][0]
    return int(line.split()[1])


class MinimalServer:
    """The baseline FUSE server (examples/minimal_server.rs): one file served
    from a populated mmap with direct I/O, nothing else."""

    def __init__(self, binary, src, off, length, mnt):
        self.mnt = mnt
        self.proc = subprocess.Popen([binary, src, str(off), str(length), mnt])
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the minimal server did not mount {mnt}")
            time.sleep(0.02)

    def close(self):
        subprocess.run(["umount", self.mnt], check=False)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench_throughput(stfs, minimal, work, runs):
    src = os.path.join(work, "one.safetensors")
    size = 1 << 30
    save_file({"t": np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)}, src)
    off, length = tensor_range(src, "t")
    dd_read(src)  # warm the source's page cache
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    print(f"1 GiB tensor, source page cache warm, median of {runs}; ratios to dd of the range from the source")
    print("and (in brackets) to the minimal FUSE server of examples/minimal_server.rs, measured in the same runs:")
    print(f"  {'server':38s} {'1st':>13s} {'2nd':>13s} {'3rd':>13s}  {'cache held':>10s}  {'READs (2nd)':>11s}")
    direct, floor = [], [[], [], []]

    def three_reads(path, reads):
        for r in reads:
            r.append(timed(lambda: dd_read(path)))

    modes = [(cache, mapping) for cache in ("direct", "keep") for mapping in ("keep", "release")]
    rows = [(f"stfs -o cache={c},mapping={mp}", [[], [], []], [], []) for c, mp in modes]
    # Interleaved, so that the machine's drift falls on every server alike.
    for _ in range(runs):
        direct.append(timed(lambda: dd_read(src, off, length)))
        s = MinimalServer(minimal, src, off, length, mnt)
        try:
            three_reads(os.path.join(mnt, "t"), floor)
        finally:
            s.close()
        for (cache, mapping), (_, reads, held, served) in zip(modes, rows):
            with Mount(stfs, src, mnt, ["-o", f"cache={cache},mapping={mapping}"], os.path.join(work, "bench.log"),
                       check=True):
                before = meminfo_kib("Cached")
                reads[0].append(timed(lambda: dd_read(os.path.join(mnt, "t"))))
                held.append((meminfo_kib("Cached") - before) / (size / 1024))
                n = served_reads(stfs, mnt)
                reads[1].append(timed(lambda: dd_read(os.path.join(mnt, "t"))))
                served.append(served_reads(stfs, mnt) - n)
                reads[2].append(timed(lambda: dd_read(os.path.join(mnt, "t"))))
    base = statistics.median(direct)
    fl = [statistics.median(x) for x in floor]
    print(f"  {'minimal server (direct I/O)':38s}" + "".join(f" {base / f:6.2f}       " for f in fl))
    for name, reads, held, served in rows:
        cells = "".join(f" {base / statistics.median(x):6.2f} [{f / statistics.median(x):4.2f}]"
                        for x, f in zip(reads, fl))
        print(f"  {name:38s}{cells}  {statistics.median(held):9.2f}x  {statistics.median(served):11.0f}")
    python = []
    for _ in range(runs):
        def ref():
            with safe_open(src, framework="np") as f:
                f.get_tensor("t")
        python.append(timed(ref))
    d = size / base / 1e9
    py = size / statistics.median(python) / 1e9
    print(f"  dd of the range from the source: {d:.2f} GB/s; minimal server: {size / fl[0] / 1e9:.2f} GB/s;"
          f" Python safe_open().get_tensor: {py:.2f} GB/s ({py / d:.2f}x)")
    print("  (cache held: growth of the machine's page cache per byte read the first time; the source's")
    print("   pages were cached already, so 0 means one copy in memory, 1 means two)")
    bench_staged(stfs, src, mnt, work, runs, base, fl)
    bench_passthrough(stfs, src, mnt, work, runs)
    os.unlink(src)


def bench_staged(stfs, src, mnt, work, runs, base, floor):
    """The same tensor once staged (one byte written: its bytes copied into a staging
    file), read through the daemon from that file."""
    reads = [[], [], []]
    for _ in range(runs):
        m = Mount(stfs, src, mnt, log=os.path.join(work, "bench.log"), check=True)
        try:
            with open(os.path.join(mnt, "t"), "r+b") as f:
                f.write(b"x")
            os.sync()
            for r in reads:
                r.append(timed(lambda: dd_read(os.path.join(mnt, "t"))))
        finally:
            m.close(discard=True, check=True)
    cells = "".join(f" {base / statistics.median(x):6.2f} [{f / statistics.median(x):4.2f}]"
                    for x, f in zip(reads, floor))
    print(f"  {'stfs, the tensor staged (pread of it)':38s}{cells}")


def bench_passthrough(stfs, src, mnt, work, runs):
    """The export view of an unedited checkpoint is the source file: served by kernel passthrough."""
    whole, reads = [], [[], []]
    for _ in range(runs):
        whole.append(timed(lambda: dd_read(src)))
        with Mount(stfs, src, mnt, log=os.path.join(work, "bench.log"), check=True):
            view = os.path.join(mnt, "__views__", "model.safetensors")
            for r in reads:
                r.append(timed(lambda: dd_read(view)))
    base = statistics.median(whole)
    r = [base / statistics.median(x) for x in reads]
    print(f"  __views__/model.safetensors of it (the source file: kernel passthrough), whole file,"
          f" ratio to dd of the source: 1st {r[0]:.2f}, 2nd {r[1]:.2f}"
          f" ({os.path.getsize(src) / base / 1e9:.2f} GB/s direct)")


def bench_listing(stfs, work, runs):
    src = os.path.join(work, "many.safetensors")
    save_file({f"model.layers.{i // 100}.w{i % 100}": np.zeros(1, np.float16) for i in range(100_000)}, src)
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    ours, theirs = [], []
    for _ in range(runs):
        def mount_and_ls():
            m = Mount(stfs, src, mnt, log=os.path.join(work, "bench.log"), check=True)
            try:
                out = subprocess.run(f"ls {mnt} | wc -l", shell=True, capture_output=True, text=True, check=True).stdout
                assert int(out) == 200_001, out
            finally:
                ours_after.append(time.perf_counter())
                m.close(check=True)

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


def bench_long_listing(stfs, work, runs):
    """`ls -l` of a mount of N tensors (2N files: data and meta) against `ls -l`
    of a plain folder of 2N empty files, cold (first after mounting) and warm."""
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    print(f"ls -l, median of {runs} (ratio to ls -l of a plain folder of as many empty files):")
    for n in (10_000, 50_000, 100_000):
        src = os.path.join(work, f"ls{n}.safetensors")
        save_file({f"model.layers.{i // 100}.w{i % 100}": np.zeros(1, np.float16) for i in range(n)}, src)
        plain = os.path.join(work, f"plain{n}")
        os.makedirs(plain)
        for i in range(2 * n):
            open(os.path.join(plain, f"f{i}"), "w").close()

        def ls_l(path):
            return timed(lambda: subprocess.run(["ls", "-l", path], check=True, stdout=subprocess.DEVNULL))

        cold, warm, base = [], [], []
        for _ in range(runs):
            with Mount(stfs, src, mnt, log=os.path.join(work, "bench.log"), check=True):
                cold.append(ls_l(mnt))
                warm.append(ls_l(mnt))
            base.append(ls_l(plain))
        c, w, b = (statistics.median(x) for x in (cold, warm, base))
        print(f"  {n:7,} tensors: cold {c:6.3f} s ({c / b:4.2f}x), warm {w:6.3f} s ({w / b:4.2f}x);"
              f" plain folder of {2 * n:,} files {b:6.3f} s")
        shutil.rmtree(plain)
        os.unlink(src)


def bench_rss(stfs, work):
    src = os.path.join(work, "two.safetensors")
    rng = np.random.default_rng(1)
    save_file({f"t{i}": np.frombuffer(rng.bytes(128 << 20), np.uint8) for i in range(16)}, src)
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    with Mount(stfs, src, mnt, log=os.path.join(work, "bench.log"), check=True) as m:
        for i in range(16):
            dd_read(os.path.join(mnt, f"t{i}"))
        anon, files = m.status_kib("RssAnon"), m.status_kib("RssFile")
    print(f"2 GiB checkpoint, every tensor read: daemon private memory (RssAnon) {anon / 1024:.1f} MiB;"
          f" source pages it keeps mapped (RssFile, page cache shared with readers) {files / 1024:.0f} MiB")
    os.unlink(src)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stfs_option(p)
    p.add_argument("--minimal", default=str(ROOT / "target" / "release" / "examples" / "minimal_server"),
                   help="the baseline server (cargo build --release --example minimal_server)")
    p.add_argument("--dir", default=None, help="work folder (default: a temp folder under /var/tmp)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--only", choices=["throughput", "listing", "rss"])
    a = p.parse_args()
    if not os.path.exists(a.minimal) and a.only in (None, "throughput"):
        subprocess.run(["cargo", "build", "--release", "--example", "minimal_server"], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory(dir=a.dir or "/var/tmp", prefix="stfs-bench-") as work:
        if a.only in (None, "throughput"):
            bench_throughput(a.stfs, a.minimal, work, a.runs)
        if a.only in (None, "listing"):
            bench_listing(a.stfs, work, a.runs)
            bench_long_listing(a.stfs, work, a.runs)
        if a.only in (None, "rss"):
            bench_rss(a.stfs, work)


if __name__ == "__main__":
    sys.exit(main())
