"""The measuring half of scripts/gpu-check.sh: CKPT MOUNT OUT.json.

Every row is timed in this one process on this one machine; ratios are to
torch's pinned host-to-device copy measured here first. Rows whose package
is missing say so instead of failing the run; a mismatch of any tensor's
bytes fails it (exit 1)."""

import errno
import json
import os
import subprocess
import sys
import time

ckpt, mnt, out = sys.argv[1:4]
rows, facts, failures = [], {}, []
size = os.path.getsize(ckpt)


def row(name, seconds, nbytes, note=""):
    rows.append({"name": name, "seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9 if seconds else None,
                 "note": note})
    print(f"{name:44s} {nbytes / seconds / 1e9 if seconds else 0:7.2f} GB/s  {note}", flush=True)


def skipped(name, why):
    rows.append({"name": name, "seconds": None, "bytes": None, "gbps": None, "note": why})
    print(f"{name:44s}    --       {why}", flush=True)


def drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm():
    with open(ckpt, "rb") as f:
        while f.read(64 << 20):
            pass


try:
    import torch
    cuda = torch.cuda.is_available()
except ImportError:
    torch, cuda = None, False
facts["torch"] = getattr(torch, "__version__", None)
facts["cuda"] = cuda
if cuda:
    facts["device"] = torch.cuda.get_device_name(0)

from stfs import cuda as stfs_cuda  # noqa: E402

# ---- the limit: torch's own pinned and pageable copies of 1 GiB ----
limit = None
if cuda:
    n = 1 << 30
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    for label, src in (("pinned", torch.empty(n, dtype=torch.uint8).pin_memory()),
                       ("pageable", torch.empty(n, dtype=torch.uint8))):
        src.fill_(1)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        best = min(times)
        row(f"torch {label} host-to-device copy, 1 GiB", best, n)
        if label == "pinned":
            limit = n / best / 1e9
    del dst
else:
    skipped("torch pinned host-to-device copy", "no torch with CUDA here")


def peer(name, fn, nbytes=size):
    try:
        warm()
        t0 = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize()
        row(name, time.perf_counter() - t0, nbytes)
        return result
    except ImportError as e:
        skipped(name, f"not installed: {e.name}")
    except Exception as e:  # a peer's failure is its row, not the run's
        skipped(name, f"failed: {type(e).__name__}: {e}")


reference = None
if cuda:
    from safetensors.torch import load_file
    reference = peer("safetensors.torch.load_file(device=cuda:0)", lambda: load_file(ckpt, device="cuda:0"))

    def fastsafe():
        from fastsafetensors import fastsafe_open
        with fastsafe_open(filenames=[ckpt], nogds=True, device="cuda:0") as f:
            return {k: f.get_tensor(k).clone() for k in f.keys()}
    peer("fastsafetensors (nogds)", fastsafe)

    def instant():
        from instanttensor import safe_open
        with safe_open(ckpt, framework="pt", device=0) as f:
            return {name: t.clone() for name, t in f.tensors()}
    peer("instanttensor", instant)
else:
    skipped("peers", "no torch with CUDA here")

# ---- stfs ----
device = 0 if cuda else "host"
ipc_opens = []
if cuda:
    real_open = stfs_cuda._open_ipc
    stfs_cuda._open_ipc = lambda p: (ipc_opens.append(1), real_open(p))[1]


def stfs_load(label):
    warm()
    t0 = time.perf_counter()
    load = stfs_cuda.Load(mnt, device)
    load.wait()
    wall = time.perf_counter() - t0
    row(f"stfs load ({label}), the daemon's own time", load.state["elapsed_ns"] / 1e9, load.state["bytes"])
    load.close()
    t0 = time.perf_counter()
    tensors = stfs_cuda.load_all(mnt, device)
    if cuda:
        torch.cuda.synchronize()
    row(f"stfs load_all ({label})", time.perf_counter() - t0, sum(_nbytes(t) for t in tensors.values()),
        f"first load {wall:.2f} s with the pool made")
    return tensors


def _nbytes(t):
    return t.numel() * t.element_size() if hasattr(t, "element_size") else t.nbytes


loaded = stfs_load("warm")
facts["ipc_opens_of_load_all"] = len(ipc_opens) if cuda else None


def compare(got, want_path, label):
    """Every tensor's bytes against the file's (on the GPU where there is one)."""
    from safetensors import safe_open
    bad = []
    with safe_open(want_path, framework="pt" if cuda else "np") as f:
        for name in f.keys():
            want = f.get_tensor(name)
            g = got.get(name)
            if g is None:
                bad.append(f"{name}: missing")
            elif cuda:
                if not torch.equal(g, want.to("cuda:0")):
                    bad.append(name)
            elif g.tobytes() != want.tobytes():
                bad.append(name)
    print(f"{label}: {len(got)} tensors compared, {len(bad)} differ {bad[:5]}", flush=True)
    failures.extend(f"{label}: {b}" for b in bad)


compare(loaded, ckpt, "stfs load_all vs the file")
del loaded
if drop_caches():
    cold = stfs_load("cold")
    del cold
else:
    skipped("stfs load_all (cold)", "caches cannot be dropped here")

# ---- an edited tensor and a new one, loaded with their own bytes ----
import numpy as np  # noqa: E402
first = sorted(n for n in os.listdir(mnt) if n.startswith("layer.") and not n.endswith(".meta.json"))[0]
with open(os.path.join(mnt, first), "r+b") as f:
    f.seek(4096)
    f.write(b"\x11" * 100000)
with open(os.path.join(mnt, "new.tensor"), "wb") as f:
    f.write(np.arange(1000, dtype=np.float32).tobytes())
with open(os.path.join(mnt, "new.tensor.meta.json"), "w") as f:
    f.write('{"dtype":"F32","shape":[1000]}')
edited = stfs_cuda.load_all(mnt, device, names=[first, "new.tensor"])
want_first = open(os.path.join(mnt, first), "rb").read()
got = {k: (v.cpu().numpy() if hasattr(v, "cpu") else v) for k, v in edited.items()}
ok_edit = got[first].tobytes() == want_first and got["new.tensor"].tobytes() == np.arange(1000, dtype=np.float32).tobytes()
print(f"edited and new tensor: {'equal' if ok_edit else 'DIFFER'}", flush=True)
if not ok_edit:
    failures.append("an edited or new tensor")
subprocess.run([os.environ["STFS"], "discard", mnt], capture_output=True)

# ---- errors ----
for bad_device in ([7] if not cuda else [torch.cuda.device_count()]):
    try:
        stfs_cuda.Load(mnt, bad_device)
        failures.append(f"device {bad_device} was not refused")
    except OSError as e:
        print(f"device {bad_device}: errno {errno.errorcode.get(e.errno)}: {e}", flush=True)
        facts[f"device_{bad_device}"] = errno.errorcode.get(e.errno)
        if e.errno != errno.ENODEV:
            failures.append(f"device {bad_device}: {e}")
facts["daemon_counts"] = stfs_cuda.daemon_counts(mnt)

if limit:
    print("\nratios to torch's pinned copy:")
    for r in rows:
        if r["gbps"]:
            print(f"  {r['name']:44s} {r['gbps'] / limit:5.2f}x")
json.dump({"facts": facts, "rows": rows, "limit_gbps": limit, "failures": failures}, open(out, "w"), indent=1)
print(f"\n{out}: {len(failures)} failures", flush=True)
sys.exit(1 if failures else 0)
