#!/usr/bin/env python3
"""GGUF benchmarks of stfs, reported as ratios against baselines measured in the same
run (never as pass/fail thresholds):

1. mount + `ls` of a GGUF file of 1,000 tensors and a 150,000-token vocabulary, against
   gguf-py's `GGUFReader` opening the same file (the issue's goal: at most 0.5x), and
   the first read of its `__metadata__.json` (every key, the vocabulary with it) against
   the same `GGUFReader` open;
2. a read of a 256 MiB Q4_K tensor through the mount, source page cache warm, against
   `dd` of the same byte range straight from the file.

The template-edit commit benchmark of the issue needs GGUF commits, which are not done.

Usage: scripts/bench_gguf.py [--stfs target/release/stfs] [--dir DIR] [--runs 5]
Needs root (or fusermount3), numpy and gguf (gguf-py).
"""

import argparse
import os
import statistics
import sys
import tempfile

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "pylib"))
from stfs_fixtures import Mount, add_stfs_option, dd_read, timed  # noqa: E402

MIB = 1 << 20


def write_gguf(path, tensors, vocab, big_tensor_mib=0):
    """`tensors` small F32 tensors, a `vocab`-token list and, if asked, one Q4_K tensor of
    `big_tensor_mib` MiB (random bytes, stored as quantized blocks)."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("bench")
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}" * 100)
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    for i in range(tensors):
        w.add_tensor(f"blk.{i // 10}.t{i % 10}.weight", np.full(64, i, np.float32))
    if big_tensor_mib:
        rows = big_tensor_mib * MIB // 144
        blocks = np.random.default_rng(0).integers(0, 255, (rows, 144), dtype=np.uint8)
        w.add_tensor("big.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def median_of(runs, fn):
    return statistics.median(timed(fn) for _ in range(runs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stfs_option(ap)
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temp folder)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        many = os.path.join(d, "many.gguf")
        write_gguf(many, 1000, 150_000)
        mnt = os.path.join(d, "mnt")
        os.mkdir(mnt)

        def mount_and_ls():
            with Mount(args.stfs, many, mnt, check=True):
                assert len(os.listdir(mnt)) == 2 * 1000 + 2

        def mount_and_metadata():
            with Mount(args.stfs, many, mnt, check=True):
                with open(os.path.join(mnt, "__metadata__.json"), "rb") as f:
                    f.read()

        reader = median_of(args.runs, lambda: gguf.GGUFReader(many))
        ls = median_of(args.runs, mount_and_ls)
        meta = median_of(args.runs, mount_and_metadata)
        print(f"1,000 tensors, 150,000 tokens ({os.path.getsize(many) / MIB:.1f} MiB):")
        print(f"  GGUFReader(path)                 {reader:.3f} s")
        print(f"  stfs mount + ls + umount         {ls:.3f} s = {ls / reader:.2f}x (goal <= 0.5x)")
        print(f"  ... + read __metadata__.json     {meta:.3f} s = {meta / reader:.2f}x")

        big = os.path.join(d, "big.gguf")
        write_gguf(big, 4, 10, big_tensor_mib=256)
        t = [x for x in gguf.GGUFReader(big).tensors if x.name == "big.weight"][0]
        off, n = int(t.data_offset), int(t.n_bytes)
        dd_read(big, off, n)  # warm the page cache
        direct = median_of(args.runs, lambda: dd_read(big, off, n))
        with Mount(args.stfs, big, mnt, check=True):
            through = median_of(args.runs, lambda: dd_read(os.path.join(mnt, "big.weight")))
        print(f"a {n / MIB:.0f} MiB Q4_K tensor, page cache warm:")
        print(f"  dd of its range from the file    {direct:.3f} s ({n / MIB / direct:.0f} MiB/s)")
        print(f"  dd through the mount             {through:.3f} s = {through / direct:.2f}x")


if __name__ == "__main__":
    main()
