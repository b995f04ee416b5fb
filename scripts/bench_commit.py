#!/usr/bin/env python3
"""Commit benchmark (a commit costs what the edit costs: docs/SEMANTICS.md, "The ways").

One checkpoint (default 8 GiB: 64 tensors of 128 MiB, random bytes, laid out
as the official save_file lays it out), and one row per kind of edit made
through the mount, each committed by `stfs commit`: its time, the way stfs
took (in place or a rewrite) and the bytes the daemon wrote during the commit
(write_bytes of /proc/PID/io). Baselines measured in the same run, on the
same file: `cp` of the file plus fsync, the Python way (load_file + edit +
save_file, the same cost for every edit), and dd + fsync of the edit's own
bytes where it has some: from /dev/zero ("x own bytes"), and copied from a
file in the page cache as a commit copies them from staging ("x cached"). The
data edits (the append, the overwrite) are the median of 3 runs.

The rows run in order on the same file, as a user's session would: the first
header edit of a save_file file has no room in its header, so it is a
rewrite (which leaves room); the next ones are in place.

With --xfs, the same on an XFS filesystem with reflink (a loop image the
script makes in --dir and removes): there a header that outgrows its space
grows in place, and a tensor dropped from the middle shares the old file's
blocks.

Usage: scripts/bench_commit.py [--gib 8] [--dir /var/tmp] [--xfs] [--stfs target/release/stfs] [--no-python]
Needs root (reads the daemon's /proc/PID/io; --xfs mounts a loop image).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "pylib"))
from stfs_fixtures import (MIB, Mount, add_stfs_option, dd_read, dd_write, fsync_path, resident, timed, wait_for,  # noqa: E402
                           write_at, write_by_hand, written_by)


def said_bytes(out):
    """(copied, shared) bytes from what `stfs commit` said: "X written",
    "X copied, Y shared with the staging files", "X written, Y shared with the old file"."""
    units = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    def value(m):
        return int(float(m.group(1)) * units[m.group(2)]) if m else 0
    number = r"([0-9.]+) (bytes|KiB|MiB|GiB|TiB)"
    copied = value(re.search(number + r" (?:written|copied)", out))
    shared = value(re.search(number + r" shared", out))
    return copied, shared


def staged_bytes(work):
    """Bytes allocated on disk in the mount's staging folder (what the edits staged)."""
    total = 0
    for d in os.listdir(work):
        if d.startswith(".model.safetensors.stfs-"):
            for f in os.scandir(os.path.join(work, d)):
                total += f.stat(follow_symlinks=False).st_blocks * 512
    return total


def dd_time(work, nbytes, cached=False):
    """Time to write `nbytes` to a new file in the same folder and fsync it (the edit's own
    bytes): from /dev/zero, or (`cached`) copied from a file of as many bytes in the page
    cache, as a commit copies them from its staging file."""
    path = os.path.join(work, "dd.bin")
    source = "/dev/zero"
    if cached:
        source = os.path.join(work, "dd-source.bin")
        dd_write(source, nbytes, "/dev/urandom", fsync=True)
    t = timed(lambda: dd_write(path, nbytes, source))
    os.unlink(path)
    if cached:
        os.unlink(source)
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stfs_option(p)
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--gib", type=int, default=8)
    p.add_argument("--no-python", action="store_true", help="skip the Python baseline (it holds the model in memory)")
    p.add_argument("--xfs", action="store_true", help="run on an XFS loop image with reflink made in --dir")
    a = p.parse_args()
    if a.xfs:
        with tempfile.TemporaryDirectory(dir=a.dir, prefix="stfs-bench-xfs-") as outer:
            img, mnt = os.path.join(outer, "xfs.img"), os.path.join(outer, "xfs")
            os.mkdir(mnt)
            with open(img, "wb") as f:
                f.truncate((3 * a.gib + 4) << 30)
            subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", img], check=True)
            subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
            try:
                a.dir = mnt
                run(a, "XFS (reflink) on a loop image")
            finally:
                subprocess.run(["umount", mnt], check=True)
        return
    fs_type = subprocess.run(["stat", "-f", "-c", "%T", a.dir], capture_output=True, text=True).stdout.strip()
    fs_type = {"ext2/ext3": "ext4 (or ext2/3)"}.get(fs_type, fs_type)
    run(a, fs_type)


def run(a, fs_name):
    size = 128 * MIB
    count = a.gib * 1024 // 128
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="stfs-bench-") as work:
        src = os.path.join(work, "model.safetensors")
        # count U8 tensors of `size` random bytes, in save_file's layout (streamed: no copy in memory).
        names = [f"model.layers.{i:02d}.weight" for i in range(count)]
        write_by_hand(src, [(n, "U8", [size], size) for n in names], metadata={"format": "pt"},
                      fill=np.random.default_rng(0).bytes, fsync=True)
        total = os.path.getsize(src)
        copy = os.path.join(work, "copy.safetensors")

        def cp():
            # A real copy (cp shares blocks on XFS and btrfs unless told not to).
            subprocess.run(["cp", "--reflink=never", src, copy], check=True)
            fsync_path(copy)

        cp_time = min(timed(cp), timed(cp))
        os.unlink(copy)
        python_time = None
        if not a.no_python:
            def python_way():
                from safetensors import safe_open
                from safetensors.numpy import load_file, save_file
                with safe_open(src, framework="np") as f:
                    meta = dict(f.metadata() or {})
                tensors = load_file(src)
                meta["chat_template"] = "{{ messages }}"
                save_file(tensors, copy, metadata=meta)
                fsync_path(copy)
            python_time = timed(python_way)
            os.unlink(copy)

        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        rows = []
        with Mount(a.stfs, src, mnt, log=os.path.join(work, "log"), check=True) as m:
            def commit():
                return subprocess.run([a.stfs, "commit", mnt], check=True, capture_output=True, text=True).stdout

            def row(label, edit, own_bytes=0, repeat=1, undo=None):
                """Times `edit` and its commit (the median of `repeat` runs, `undo` and a
                commit between them: a single run of a data edit varies 2x on this disk)."""
                runs = []
                for k in range(repeat):
                    if k and undo:
                        undo()
                        commit()
                    t = time.perf_counter()
                    edit()
                    edit_seconds = time.perf_counter() - t
                    staged = staged_bytes(work)
                    os.sync()  # staged bytes reach the disk before the commit is timed
                    before = written_by(m.pid)
                    t = time.perf_counter()
                    out = commit()
                    seconds = time.perf_counter() - t
                    wrote = written_by(m.pid) - before
                    base = (statistics.median(dd_time(work, own_bytes) for _ in range(repeat)),
                            dd_time(work, own_bytes, cached=True)) if own_bytes else None
                    runs.append((seconds, wrote, base, edit_seconds, staged, out.strip()))
                seconds, wrote, base, edit_seconds, staged, out = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
                way = ("in place" if "committed in place" in out
                       else "shared" if "shares extents" in out else "rewrite")
                rows.append((label, seconds, wrote, way, base, edit_seconds, staged, out))

            def meta_edit(value):
                def go():
                    with open(os.path.join(mnt, "__metadata__.json"), "w") as f:
                        json.dump({"format": "pt", "chat_template": value}, f)
                return go

            def renames(k):
                def go():
                    for n in names[:k]:
                        os.rename(os.path.join(mnt, n), os.path.join(mnt, n.replace("model.", "base_model.model.")))
                    names[:k] = [n.replace("model.", "base_model.model.") for n in names[:k]]
                return go

            def header_mix():
                meta_edit("{{ messages | tojson }}")()
                renames(min(16, count // 2))()
                with open(os.path.join(mnt, names[-3] + ".meta.json"), "w") as f:
                    json.dump({"dtype": "U8", "shape": [size // 1024, 1024]}, f)

            def add():
                with open(os.path.join(mnt, "lora.A"), "wb") as f:
                    f.write(np.random.default_rng(1).bytes(64 * MIB))
                with open(os.path.join(mnt, "lora.A.meta.json"), "w") as f:
                    json.dump({"dtype": "U8", "shape": [64 * MIB]}, f)

            def drop_tail():
                os.unlink(os.path.join(mnt, "lora.A"))

            def rewrite_one():
                dd_write(os.path.join(mnt, names[count // 2]), 128 * MIB, "/dev/urandom", fsync=False, notrunc=True)

            def patch_one():
                write_at(os.path.join(mnt, names[count // 4]), b"\x01\x02\x03\x04", 100 * MIB + 3)

            def drop_middle():
                os.unlink(os.path.join(mnt, names[count // 3]))

            # The source in the page cache, as after a load: the first header
            # growth (blocks inserted at the start) empties it, and the daemon
            # reads back what was resident, in the background.
            dd_read(src)
            cached_before = resident(src)
            row("metadata, first edit of a save_file file (no room yet)", meta_edit("{{ m }}"))
            grown = "header grown by" in rows[-1][-1]
            if grown:
                wait_for(lambda: "page cache brought back" in open(os.path.join(work, "log")).read(),
                         "the page cache brought back", seconds=600)
            cached_after = resident(src)
            row("metadata (__metadata__.json)", meta_edit("{{ messages }}"))
            row("mv of one tensor", renames(1))
            row("metadata + 16 renames + an equal-size reshape", header_mix)
            row("one 64 MiB tensor added", add, 64 * MIB, repeat=3, undo=drop_tail)
            row("last tensor removed", drop_tail)
            row("one 128 MiB tensor rewritten (dd conv=notrunc)", rewrite_one, 128 * MIB, repeat=3)
            row("4 bytes patched into a 128 MiB tensor (pwrite)", patch_one)
            row("a tensor removed from the middle", drop_middle)
        print(f"{total / (1 << 30):.1f} GiB checkpoint ({count} tensors of 128 MiB), {fs_name} in {a.dir}")
        print(f"baselines: cp + fsync {cp_time:.2f} s", end="")
        print(f"; Python load_file + edit + save_file {python_time:.2f} s" if python_time else "")
        # The same edits into a plain file (a copy of one tensor's bytes), for the edit's own time.
        plain = os.path.join(work, "plain.bin")
        dd_write(plain, 128 * MIB, fsync=True)
        plain_dd = timed(lambda: dd_write(plain, 128 * MIB, "/dev/urandom", fsync=False, notrunc=True))
        # (A close through the mount makes the staged bytes durable: the fair plain file syncs too.)
        plain_dd_sync = timed(lambda: dd_write(plain, 128 * MIB, "/dev/urandom", fsync=True, notrunc=True))
        plain_patch = timed(lambda: write_at(plain, b"\x01\x02\x03\x04", 100 * MIB + 3))
        os.unlink(plain)
        print(f"{'edit':52} {'way':9} {'seconds':>8} {'x cp':>7} {'x py':>7} {'written':>10} {'x own bytes':>11}"
              f" {'x cached':>8}"
              f" {'said copied':>12} {'said shared':>12} io {'edit s':>8} {'staged':>10}")
        mismatches = 0
        for label, seconds, wrote, way, base, edit_seconds, staged, out in rows:
            py = f"{seconds / python_time:7.4f}" if python_time else "      -"
            own = f"{seconds / base[0]:11.2f} {seconds / base[1]:8.2f}" if base else "          -        -"
            copied, shared = said_bytes(out)
            # What stfs says it copied against what the daemon wrote (/proc/PID/io):
            # within 4 MiB and 10% (the journal, the redo record, metadata; and the
            # kernel counts a whole page-cache folio per write into a file, up to
            # 2 MiB each on ext4 with large folios: a 4 KiB pwrite into an existing
            # file counted 2.0 MiB here, which was the unexplained write_bytes of
            # earlier runs).
            io_ok = abs(wrote - copied) <= 4 * MIB + copied / 10
            mismatches += not io_ok
            print(f"{label:52} {way:9} {seconds:8.3f} {seconds / cp_time:7.4f} {py} {wrote / MIB:7.1f} MiB {own}"
                  f" {copied / MIB:8.1f} MiB {shared / MIB:8.1f} MiB {'ok' if io_ok else 'MISMATCH'}"
                  f" {edit_seconds:8.3f} {staged / MIB:6.2f} MiB")
        print(f"bytes stfs said it copied vs the daemon's write_bytes: {mismatches} mismatch(es)")
        if grown:
            print(f"page cache of the source around the first header growth (fincore): "
                  f"{cached_before / MIB:.0f} MiB before, {cached_after / MIB:.0f} MiB after "
                  f"({100 * cached_after / max(cached_before, 1):.1f}%)")
        print(f"the edits' own time through the mount vs into a plain file: dd over 128 MiB "
              f"{rows[-3][5]:.3f} s vs {plain_dd:.3f} s ({rows[-3][5] / plain_dd:.2f}x), {plain_dd_sync:.3f} s with "
              f"fsync ({rows[-3][5] / plain_dd_sync:.2f}x); "
              f"a 4-byte pwrite {rows[-2][5] * 1e3:.2f} ms vs {plain_patch * 1e3:.3f} ms, "
              f"staging {rows[-2][6] / 1024:.0f} KiB")
        print("\nwhat stfs said:")
        for *_, out in rows:
            print("  " + out)


if __name__ == "__main__":
    main()
