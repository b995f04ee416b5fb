#!/usr/bin/env python3
"""Views benchmark (docs/SEMANTICS.md, "Views"), in one run on one F32 checkpoint (default 2 GiB):

- `cp` of __views__/model.safetensors against `cp` of the source file (goal <= 1.2x);
- `cp` of __views__/bf16/model.safetensors against the Python way (load_file, cast with
  ml_dtypes, save_file; goal: the view >= 2x faster), and the memory each needs: the
  Python process's peak RSS against the daemon's private (anonymous) memory.

The source is read once before, so both sides read it from the page cache.

Usage: scripts/bench_views.py [--gib 2] [--dir /var/tmp] [--stfs target/release/stfs]
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "pylib"))
from stfs_fixtures import MIB, Mount, bench_args, timed  # noqa: E402

PYTHON_WAY = """
import resource, sys, time
import ml_dtypes, numpy as np
from safetensors.numpy import load_file, save_file
t = time.perf_counter()
tensors = load_file(sys.argv[1])
tensors = {k: v.astype(ml_dtypes.bfloat16).view(np.uint16) for k, v in tensors.items()}
save_file(tensors, sys.argv[2])  # (BF16 bits written as U16: same bytes)
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def timed_copy(src, out):
    """`cp src out` into a new file, after the last copy's writeback (overwriting a 2 GiB
    file that is still being written back costs more than the copy itself, and varies)."""
    if os.path.exists(out):
        os.unlink(out)
    os.sync()
    return timed(lambda: subprocess.run(["cp", src, out], check=True))


def main():
    a = bench_args(__doc__, gib=2)
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="stfs-bench-views-") as work:
        src = os.path.join(work, "model.safetensors")
        rng = np.random.default_rng(0)
        from safetensors.numpy import save_file
        count = a.gib * 8
        save_file({f"layers.{i:02d}.weight": rng.standard_normal(32 * MIB, dtype=np.float32) for i in range(count)}, src)
        subprocess.run(["cat", src], stdout=subprocess.DEVNULL, check=True)  # warm
        out = os.path.join(work, "out.safetensors")
        mnt = os.path.join(work, "mnt")
        os.mkdir(mnt)
        m = Mount(a.stfs, src, mnt, log=os.path.join(work, "log"), check=True)
        try:
            view = os.path.join(mnt, "__views__", "model.safetensors")
            cp_src, cp_view = [], []
            for _ in range(3):  # interleaved, so that drift falls on both alike
                cp_src.append(timed_copy(src, out))
                cp_view.append(timed_copy(view, out))
            cp_src, cp_view = min(cp_src), min(cp_view)
            assert open(out, "rb").read(4096) == open(src, "rb").read(4096)
            cp_bf16 = timed_copy(os.path.join(mnt, "__views__", "bf16", "model.safetensors"), out)
            # Edited, the view is no longer the source file: generated, read through the daemon.
            with open(os.path.join(mnt, "__metadata__.json"), "w") as f:
                f.write('{"format": "edited"}')
            cp_edited = min(timed_copy(view, out) for _ in range(2))
            daemon = m.status_kib("RssAnon") * 1024  # its private memory
        finally:
            m.close(discard=True, check=True)
        r = subprocess.run([sys.executable, "-c", PYTHON_WAY, src, out], capture_output=True, text=True, check=True)
        py_time, py_peak = r.stdout.split()
        py_time, py_peak = float(py_time), int(py_peak)
        size = os.path.getsize(src)
        print(f"{size / (1 << 30):.1f} GiB F32 checkpoint ({count} tensors), page cache warm, {a.dir}")
        print(f"  cp of the source file                     {cp_src:7.2f} s  1.00x")
        print(f"  cp of __views__/model.safetensors         {cp_view:7.2f} s  {cp_view / cp_src:.2f}x  (goal <= 1.2x;"
              " unedited: the source file, by kernel passthrough)")
        print(f"  the same after a metadata edit            {cp_edited:7.2f} s  {cp_edited / cp_src:.2f}x  "
              "(generated, read through the daemon)")
        print(f"  Python load_file + ml_dtypes cast + save   {py_time:7.2f} s  1.00x, peak RSS {py_peak / MIB:.0f} MiB")
        print(f"  cp of __views__/bf16/model.safetensors    {cp_bf16:7.2f} s  {py_time / cp_bf16:.2f}x faster  "
              f"(goal >= 2x), daemon private memory {daemon / MIB:.0f} MiB (goal <= 64 MiB)")


if __name__ == "__main__":
    main()
