"""STFS_IOC_PREFETCH through a real mount: the page-cache target everywhere,
errors, and cuda:N answering ENODEV (without a panic) where there is no driver."""

import errno
import os
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from stfs import cuda as stfs_cuda  # noqa: E402
from stfs_fixtures import cuda_driver_present, drop_from_cache, resident  # noqa: E402


def test_page_cache_prefetch_brings_the_tensor_in(tmp_path, mount, run):
    src = tmp_path / "p.safetensors"
    a = np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8)
    save_file({"a": a, "b": np.ones((3, 4), np.float32)}, str(src))
    drop_from_cache(src)
    assert resident(src) < (8 << 20), "could not drop the source from the page cache"
    m = mount(src)
    p = run("prefetch", os.path.join(m.path, "a"))
    assert p.returncode == 0, p.stderr
    assert f"{a.nbytes} of {a.nbytes} bytes resident in the page cache" in p.stdout
    assert "GB/s" in p.stdout
    assert resident(src) >= a.nbytes  # checked independently of the daemon
    info = stfs_cuda.prefetch(os.path.join(m.path, "b"), "cpu")
    assert (info.dtype, info.shape, info.nbytes, info.bytes) == ("F32", [3, 4], 48, 48)
    # A whole directory: every tensor file, no meta files.
    p = run("prefetch", m.path)
    assert p.returncode == 0 and p.stdout.count("resident") == 2


def test_prefetch_errors(tmp_path, mount, run):
    src = tmp_path / "p.safetensors"
    save_file({"a": np.ones(4, np.float32)}, str(src))
    m = mount(src)
    a = os.path.join(m.path, "a")
    with pytest.raises(OSError) as e:
        stfs_cuda.prefetch(a + ".meta.json", "cpu")
    assert e.value.errno == errno.ENOTTY and "not a tensor file" in str(e.value)
    with pytest.raises(OSError) as e:
        stfs_cuda.prefetch(m.path, "cpu")
    assert e.value.errno == errno.ENOTTY
    with pytest.raises(OSError) as e:
        stfs_cuda.prefetch(a, "cpu", size=100)  # a caller built against another struct
    assert e.value.errno == errno.EINVAL
    p = run("prefetch", a + ".meta.json")
    assert p.returncode != 0 and "not a tensor file" in p.stderr


@pytest.mark.skipif(cuda_driver_present(), reason="a CUDA driver is present: scripts/gpu-check.sh covers it")
def test_cuda_without_a_driver_is_enodev_and_the_daemon_keeps_serving(tmp_path, mount, run):
    src = tmp_path / "p.safetensors"
    save_file({"a": np.arange(4, dtype=np.float32)}, str(src))
    m = mount(src)
    a = os.path.join(m.path, "a")
    p = run("prefetch", "--device", "cuda:0", a)
    assert p.returncode != 0 and "no CUDA driver" in p.stderr, p.stderr
    with pytest.raises(OSError) as e:
        stfs_cuda.prefetch(a, "cuda", 0)
    assert e.value.errno == errno.ENODEV
    assert open(a, "rb").read() == np.arange(4, dtype=np.float32).tobytes()
    assert "panic" not in open(m.log).read()
