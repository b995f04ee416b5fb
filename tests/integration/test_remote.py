"""Remote sources: s3:// (a local moto server) and https:// (a local range
server), each behind a fault-injecting proxy that counts requests. The same
checks as the local read tests, then the cache, the faults, and a replaced
object. Nothing here reaches beyond 127.0.0.1."""

import errno
import hashlib
import signal
import json
import os
import subprocess
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

import stfs_fixtures as fx
from conftest import assert_every_write_is_erofs
from remote_servers import FaultProxy, Moto, RangeServer
from stfs_fixtures import wait_for_exit
from test_mount import check_listing_bytes_and_metas

BUCKET = "stfs-test"


def sha(b):
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = Moto(log)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                            "AWS_ENDPOINT_URL", "AWS_EC2_METADATA_DISABLED")}
    # Credentials for stfs (object_store reads them from the environment);
    # moto accepts any.
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    os.environ.pop("AWS_ENDPOINT_URL", None)
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def s3(moto, tmp_path):
    """A proxy in front of moto, and a function that uploads a file and gives
    its s3:// URL and the mount options that reach it through the proxy."""
    proxy = FaultProxy(moto.port)
    client = moto.client()

    def upload(local, key):
        client.upload_file(str(local), BUCKET, key)
        return f"s3://{BUCKET}/{key}"

    proxy.upload = upload
    proxy.client = client
    proxy.options = ["--endpoint", proxy.url, "--cache-dir", str(tmp_path / "cache")]
    yield proxy
    proxy.stop()


@pytest.fixture
def web_servers(tmp_path):
    """web_servers(etags="strong") -> a range server over its own folder
    (`.root`), behind a proxy; all stopped at teardown."""
    made = []

    def start(etags="strong"):
        root = tmp_path / f"www{len(made)}"
        root.mkdir()
        server = RangeServer(root, etags=etags)
        proxy = FaultProxy(server.port)
        proxy.root = root
        proxy.options = ["--cache-dir", str(tmp_path / "cache")]
        made.append((proxy, server))
        return proxy

    yield start
    for proxy, server in made:
        proxy.stop()
        server.stop()


@pytest.fixture
def web(web_servers):
    return web_servers()


def big_checkpoint(path, seed=0):
    """Tensors of 20 MiB and 9 MiB (several chunks each) between small ones."""
    rng = np.random.default_rng(seed)
    tensors = {f"small.{i}": rng.standard_normal((i + 1, 100)).astype(np.float32) for i in range(30)}
    tensors["big.a"] = rng.integers(0, 255, size=20 << 20, dtype=np.uint8)
    tensors["big.b"] = rng.standard_normal((9 << 20) // 8).astype(np.float64)
    save_file(tensors, str(path), metadata={"kind": "big"})
    return tensors


def big_on_s3(tmp_path, s3, key):
    """big_checkpoint() uploaded as `key` (written first as tmp_path/its name): (tensors, its URL)."""
    src = tmp_path / os.path.basename(key)
    tensors = big_checkpoint(src)
    return tensors, s3.upload(src, key)


def check_big(m, tensors):
    a = tensors["big.a"].tobytes()
    path = os.path.join(m.path, "big.a")
    out = subprocess.run(["dd", f"if={path}", "bs=4096", "skip=2500", "count=600", "status=none"],
                         capture_output=True, check=True).stdout
    assert out == a[2500 * 4096:3100 * 4096]
    out = subprocess.run(["dd", f"if={path}", "bs=1M", "status=none"], capture_output=True, check=True).stdout
    assert sha(out) == sha(a)
    mm = np.memmap(os.path.join(m.path, "big.b"), dtype=np.float64, mode="r")
    assert np.array_equal(mm, tensors["big.b"])
    del mm
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, size in [(0, 1), (8 << 20, 3), ((8 << 20) - 2, 5), (len(a) - 3, 100), (len(a), 10)]:
            assert os.pread(fd, size, off) == a[off:off + size]
    finally:
        os.close(fd)


def read(path):
    """A file's bytes, closed at once (a failing assert must not keep the
    mount busy)."""
    with open(path, "rb") as f:
        return f.read()


def log_of(m):
    return open(m.log).read()


def test_s3_object_reads_like_a_local_file(tmp_path, s3, mount, run):
    mixed = tmp_path / "mixed.safetensors"
    expected = fx.mixed_checkpoint(str(mixed))
    big = tmp_path / "big.safetensors"
    tensors = big_checkpoint(big)
    m1 = mount(s3.upload(mixed, "models/mixed.safetensors"), *s3.options)
    check_listing_bytes_and_metas(m1.path, mixed, expected)
    m2 = mount(s3.upload(big, "models/big.safetensors"), *s3.options)
    check_listing_bytes_and_metas(m2.path, big, {k: v.tobytes() for k, v in tensors.items()})
    check_big(m2, tensors)
    # Owned by the user who mounted it, writable by them (an S3 object is
    # committed to), read-only on a read-only mount.
    st = os.stat(os.path.join(m2.path, "big.a"))
    assert (st.st_mode & 0o777, st.st_uid) == (0o644, os.getuid())
    m3 = mount(f"s3://{BUCKET}/models/big.safetensors", *s3.options, "-o", "ro")
    assert os.stat(os.path.join(m3.path, "big.a")).st_mode & 0o777 == 0o444
    status = run("status", m2.path, check=True).stdout
    assert f"s3://{BUCKET}/models/big.safetensors: no changes" in status and "remote:" in status


def test_https_object_reads_like_a_local_file(tmp_path, web, mount):
    expected = fx.mixed_checkpoint(str(web.root / "mixed.safetensors"))
    tensors = big_checkpoint(web.root / "big.safetensors")
    m1 = mount(f"{web.url}/mixed.safetensors", *web.options)
    check_listing_bytes_and_metas(m1.path, web.root / "mixed.safetensors", expected)
    m2 = mount(f"{web.url}/big.safetensors", *web.options)
    check_big(m2, tensors)
    assert web.count("GET", ranged=False) == 0, "every GET is ranged"


def test_s3_sharded_prefix_with_index(tmp_path, s3, mount):
    folder = tmp_path / "model"
    a, b, index = fx.two_shards(folder)
    (folder / "README.md").write_text("not a shard")
    for f in folder.iterdir():
        s3.upload(f, f"sharded/{f.name}")
    s3.upload(folder / "README.md", "sharded/deeper/x.safetensors")  # below the prefix: not a shard of it
    m = mount(f"s3://{BUCKET}/sharded/", *s3.options)
    # (README.md, the folder's other file, is shown too; the object deeper down is not.)
    assert sorted(os.listdir(m.path)) == ["README.md", "model-00001-of-00002", "model-00002-of-00002",
                                          "model.safetensors.index.json"]
    assert read(os.path.join(m.path, "README.md")) == b"not a shard"
    assert read(os.path.join(m.path, "model-00002-of-00002", "b")) == b.tobytes()
    assert read(os.path.join(m.path, "model-00001-of-00002", "a")) == a.tobytes()
    assert json.load(open(os.path.join(m.path, "model.safetensors.index.json"))) == index
    assert "weight_map" not in m.result.stderr

    # A wrong index still mounts, reported with its URL.
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    s3.upload(folder / "model.safetensors.index.json", "sharded/model.safetensors.index.json")
    m2 = mount(f"s3://{BUCKET}/sharded/", *s3.options)
    assert f"s3://{BUCKET}/sharded/model.safetensors.index.json" in m2.result.stderr
    assert "weight_map says" in m2.result.stderr


def test_bad_remote_sources_are_refused_at_mount_naming_the_url(tmp_path, s3, mount):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"PK\x03\x04 this is a zip file, not a checkpoint" * 10)
    url = s3.upload(garbage, "bad/garbage.safetensors")
    m = mount(url, *s3.options, expect_ok=False)
    assert not m.ok and url in m.result.stderr and "not a safetensors file?" in m.result.stderr

    # A header that names bytes past the end: the same rule as a local file breaks.
    good = tmp_path / "good.safetensors"
    save_file({"w": np.ones(100, np.float32)}, str(good))
    data = good.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-8])
    url = s3.upload(cut, "bad/cut.safetensors")
    m = mount(url, *s3.options, expect_ok=False)
    local = subprocess.run([m.stfs, "verify", str(cut)], capture_output=True, text=True)
    rule = local.stdout.strip().splitlines()[-1].split(": ", 1)[-1]
    assert url in m.result.stderr and rule in m.result.stderr, (m.result.stderr, local.stdout)

    m = mount(f"s3://{BUCKET}/no/such.safetensors", *s3.options, expect_ok=False)
    assert "not found" in m.result.stderr and f"s3://{BUCKET}/no/such.safetensors" in m.result.stderr
    # A store's XML error is said by its code and message, not dumped.
    m = mount("s3://no-such-bucket-here/dir/", *s3.options, expect_ok=False)
    said = m.result.stderr
    assert "NoSuchBucket: The specified bucket does not exist" in said and "<?xml" not in said, said

    s3.rule = lambda r: 403
    m = mount(s3.upload(good, "ok/good.safetensors"), *s3.options, expect_ok=False)
    assert "denied" in m.result.stderr or "403" in m.result.stderr, m.result.stderr
    s3.rule = None

    s3.rule = lambda r: "hang"
    t0 = time.monotonic()
    m = mount(f"s3://{BUCKET}/ok/good.safetensors", *s3.options, "--timeout", "2", expect_ok=False)
    said = m.result.stderr
    assert ("timed out" in said or "did not answer in time" in said) and time.monotonic() - t0 < 30, said
    s3.reset()

    m = mount(f"s3://{BUCKET}/ok/good.safetensors", "--endpoint", "http://127.0.0.1:1", "--timeout", "3",
              "--cache-dir", str(tmp_path / "cache"), expect_ok=False)
    assert f"s3://{BUCKET}/ok/good.safetensors" in m.result.stderr
    m = mount(f"s3://{BUCKET}/ok/good.safetensors?versionId=1", *s3.options, expect_ok=False)
    assert "query string" in m.result.stderr
    m = mount("ftp://example.com/x.safetensors", expect_ok=False)
    assert "unknown scheme" in m.result.stderr
    m = mount("http://127.0.0.1:1/models/", expect_ok=False)
    assert "cannot be asked what a folder holds" in m.result.stderr
    assert not any(x.is_mounted() for x in [m])


def test_writes_to_an_http_source_are_erofs(tmp_path, web, mount):
    fx.base(web.root / "w.safetensors")
    m = mount(f"{web.url}/w.safetensors", *web.options)
    assert "mounted read-only (stfs commits to S3 and S3-compatible stores only" in m.result.stderr
    assert_every_write_is_erofs(m.path, "new", "a.meta.json")
    assert read(os.path.join(m.path, "a")) == np.arange(8, dtype=np.float32).tobytes()


def test_second_read_and_remount_come_from_the_cache(tmp_path, s3, mount):
    tensors, url = big_on_s3(tmp_path, s3, "cache/c.safetensors")
    m = mount(url, *s3.options)
    assert s3.count("GET") == 1, "the header takes one ranged GET"
    for name, t in tensors.items():
        assert read(os.path.join(m.path, name)) == t.tobytes()
    first = s3.count("GET")
    assert first > 1
    for name, t in tensors.items():
        assert read(os.path.join(m.path, name)) == t.tobytes()
    assert s3.count("GET") == first, "a second read makes no request"
    # A chunk that served a read may still be on its way to the cache (an
    # unmount abandons writers): wait for the writers, not for a time.
    writers = lambda: [f for f in (tmp_path / "cache").rglob("*") if ".chunk.tmp." in f.name]
    deadline = time.monotonic() + 60
    while writers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not writers(), writers()
    m.close()
    # Another mount of the same object version (two at once, sharing the cache).
    s3.reset()
    m2 = mount(url, *s3.options)
    m3 = mount(url, *s3.options)
    for mm in (m2, m3):
        for name, t in tensors.items():
            assert read(os.path.join(mm.path, name)) == t.tobytes()
    assert s3.count("GET") == 2, "two headers, no data"


def cache_bytes(folder):
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.endswith(".chunk"))


def test_eviction_under_a_small_cache_size(tmp_path, s3, mount):
    tensors, url = big_on_s3(tmp_path, s3, "evict/e.safetensors")  # ~30 MiB of data
    cache = tmp_path / "cache"
    m = mount(url, *s3.options, "--cache-size", "12M")
    for _ in range(2):
        for name, t in tensors.items():
            assert sha(read(os.path.join(m.path, name))) == sha(t.tobytes()), name
    before = s3.count("GET", ranged=True)
    assert read(os.path.join(m.path, "big.a")) == tensors["big.a"].tobytes()
    assert s3.count("GET", ranged=True) > before, "an evicted tensor is fetched again"
    m.close()
    # Once nothing is being fetched: at most the limit, or one chunk (8 MiB
    # and its trailer) past it when that chunk is the newest.
    assert cache_bytes(cache) <= (12 << 20) + (8 << 20) + 16


def test_two_mounts_share_a_small_cache_under_concurrent_readers(tmp_path, s3, mount):
    src = tmp_path / "shared.safetensors"
    tensors = big_checkpoint(src)
    url = s3.upload(src, "shared/s.safetensors")
    # Smaller than what the readers want at once: the mounts evict each
    # other's chunks while reading them.
    mounts = [mount(url, *s3.options, "--cache-size", "20M") for _ in range(2)]
    errors = []

    def reader(m, k):
        try:
            names = sorted(tensors)
            for name in names[k:] + names[:k]:
                assert read(os.path.join(m.path, name)) == tensors[name].tobytes(), name
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(m, k)) for m in mounts for k in range(0, 32, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]


def test_damaged_cache_files_are_fetched_again(tmp_path, s3, mount):
    tensors, url = big_on_s3(tmp_path, s3, "damaged/d.safetensors")
    m = mount(url, *s3.options)
    for name, t in tensors.items():
        assert read(os.path.join(m.path, name)) == t.tobytes()
    m.close()
    chunks = sorted((tmp_path / "cache").glob("*.chunk"), key=lambda f: f.stat().st_size)
    flipped, truncated = chunks[-1], chunks[-2]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size // 2)
    s3.reset()
    m2 = mount(url, *s3.options)
    for name, t in tensors.items():
        assert read(os.path.join(m2.path, name)) == t.tobytes(), name
    assert s3.count("GET", ranged=True) == 1 + 2, "the header, and the two damaged chunks again"
    assert "does not check out" in log_of(m2)


def test_transient_faults_are_retried(tmp_path, s3, mount):
    tensors, url = big_on_s3(tmp_path, s3, "faults/t.safetensors")
    for i, (name, action) in enumerate([("big.a", 500), ("big.b", "drop"), ("small.3", 503),
                                        ("small.4", ("delay", 1.5))]):
        # A cache of its own: nothing read ahead for an earlier case.
        m = mount(url, "--endpoint", s3.url, "--cache-dir", str(tmp_path / f"cache{i}"))
        s3.reset()
        s3.fail_next(2, action)
        t0 = time.monotonic()
        assert read(os.path.join(m.path, name)) == tensors[name].tobytes(), action
        if isinstance(action, tuple):
            # Slow answers (1.5 s each, under --timeout) are waited for.
            assert time.monotonic() - t0 >= action[1], action
        else:
            # Two faults, then a success.
            assert s3.count("GET") >= 3, action
        m.close()


def test_a_failing_server_gives_eio_and_the_mount_recovers(tmp_path, s3, mount):
    tensors, url = big_on_s3(tmp_path, s3, "failing/f.safetensors")
    m = mount(url, *s3.options, "--timeout", "5")
    assert read(os.path.join(m.path, "small.0")) == tensors["small.0"].tobytes()
    s3.rule = lambda r: 500
    with pytest.raises(OSError) as e:
        read(os.path.join(m.path, "big.a"))
    assert e.value.errno == errno.EIO
    log = log_of(m)
    assert url in log and "big.a" in log
    # Everything else keeps answering: listings, metas, cached bytes.
    assert "big.a.meta.json" in os.listdir(m.path)
    assert read(os.path.join(m.path, "small.0")) == tensors["small.0"].tobytes()
    # The network comes back: so do the reads.
    s3.rule = None
    assert read(os.path.join(m.path, "big.a")) == tensors["big.a"].tobytes()


def test_a_server_that_stops_answering_fails_within_the_timeout(tmp_path, s3, mount):
    tensors, url = big_on_s3(tmp_path, s3, "hang/h.safetensors")
    m = mount(url, *s3.options, "--timeout", "3")
    assert read(os.path.join(m.path, "small.0")) == tensors["small.0"].tobytes()
    s3.rule = lambda r: "hang"
    outcome = {}

    def stuck_read():
        t0 = time.monotonic()
        try:
            read(os.path.join(m.path, "big.a"))
            outcome["error"] = None
        except OSError as e:
            outcome["error"] = e.errno
        outcome["seconds"] = time.monotonic() - t0

    reader = threading.Thread(target=stuck_read)
    reader.start()
    time.sleep(0.5)
    # No lock is held across the network: the rest of the mount answers now.
    t0 = time.monotonic()
    assert "big.b" in os.listdir(m.path)
    assert read(os.path.join(m.path, "small.0")) == tensors["small.0"].tobytes()
    assert json.load(open(os.path.join(m.path, "big.b.meta.json")))["dtype"] == "F64"
    quick = time.monotonic() - t0
    reader.join(60)
    assert not reader.is_alive(), "a read hung past its timeout"
    assert outcome["error"] == errno.EIO
    # Generous bounds: the point is "bounded", not a benchmark.
    assert outcome["seconds"] < 30 and quick < outcome["seconds"], outcome
    s3.reset()
    assert read(os.path.join(m.path, "big.a")) == tensors["big.a"].tobytes()

    # A server that answers, sends half the body, then goes silent.
    s3.rule = lambda r: "stall_body" if r["range"] else None
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        read(os.path.join(m.path, "big.b"))
    assert e.value.errno == errno.EIO and time.monotonic() - t0 < 30
    s3.reset()
    assert read(os.path.join(m.path, "big.b")) == tensors["big.b"].tobytes()


def test_an_object_replaced_behind_the_mount_is_eio_never_mixed(tmp_path, s3, mount):
    src = tmp_path / "r.safetensors"
    tensors = big_checkpoint(src, seed=1)
    url = s3.upload(src, "replaced/r.safetensors")
    m = mount(url, *s3.options)
    a = tensors["big.a"].tobytes()
    meta = json.load(open(os.path.join(m.path, "big.a.meta.json")))
    # Fetches past big.a's first chunk wait at the proxy until the object is replaced.
    first_chunk_end = meta["file_offset"] + (8 << 20)
    s3.rule = lambda r: "hold" if r["range"] and int(r["range"][6:].split("-")[0]) >= first_chunk_end else None
    f = open(os.path.join(m.path, "big.a"), "rb")
    head = f.read(1 << 20)
    assert head == a[:1 << 20]
    # Same layout, other bytes: only the ETag tells them apart.
    other = tmp_path / "other.safetensors"
    big_checkpoint(other, seed=2)
    s3.upload(other, "replaced/r.safetensors")
    s3.let_go()
    rest = b""
    with pytest.raises(OSError) as e:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            rest += chunk
    assert e.value.errno == errno.EIO
    assert a.startswith(head + rest), "bytes of the old object only"
    f.close()
    with pytest.raises(OSError) as e:
        read(os.path.join(m.path, "big.b"))
    assert e.value.errno == errno.EIO
    assert "replaced" in log_of(m)
    # A fresh mount sees the new version.
    m2 = mount(url, *s3.options)
    assert read(os.path.join(m2.path, "big.a")) != a


def test_prefetch_fills_the_cache(tmp_path, s3, mount, run):
    src = tmp_path / "p.safetensors"
    tensors = big_checkpoint(src)
    m = mount(s3.upload(src, "prefetch/p.safetensors"), *s3.options)
    out = run("prefetch", os.path.join(m.path, "big.a"), os.path.join(m.path, "big.b"), check=True).stdout
    assert "big.a" in out
    spans = []
    for name in ("big.a", "big.b"):
        meta = json.load(open(os.path.join(m.path, name + ".meta.json")))
        spans.append((meta["file_offset"], meta["file_offset"] + meta["nbytes"]))

    def fetches_of_the_tensors():
        return sum(1 for r in list(s3.requests) if r["range"] and any(
            lo <= int(r["range"][6:].split("-")[0]) < hi for lo, hi in spans))

    fetched = fetches_of_the_tensors()
    assert fetched >= 5, "the tensors' chunks were fetched (3 + 2 at least)"
    for name in ("big.a", "big.b"):
        assert read(os.path.join(m.path, name)) == tensors[name].tobytes()
    assert fetches_of_the_tensors() == fetched, "prefetched tensors are read from the cache"
    if not os.path.exists("/dev/nvidiactl"):
        # Without a GPU the CUDA target says so (the GPU path is checked on a device machine).
        p = run("prefetch", "--device", "cuda:0", os.path.join(m.path, "small.1"))
        assert p.returncode != 0 and "CUDA" in p.stderr, p.stderr


@pytest.mark.parametrize("tensors,requests", [(10_000, 1), (12_000, 2)])
def test_many_tensors_mount_and_ls_in_one_or_two_requests(tmp_path, s3, mount, tensors, requests):
    src = tmp_path / "many.safetensors"
    # Long names push the second header past the first GET (1 MiB).
    width = 20 if requests == 1 else 90
    arrays = {f"model.layers.{i}." + "x" * width: np.full(2, i, np.float32) for i in range(tensors)}
    save_file(arrays, str(src))
    n, _ = fx.read_header(src)
    assert (n + 8 > (1 << 20)) == (requests == 2)
    url = s3.upload(src, f"many/{tensors}.safetensors")
    s3.reset()
    m = mount(url, *s3.options)
    assert len(os.listdir(m.path)) == 2 * tensors + 1
    assert s3.count("GET") == requests
    name = f"model.layers.{tensors - 1}." + "x" * width
    assert read(os.path.join(m.path, name)) == arrays[name].tobytes()


def test_credentials_from_the_aws_shared_files(tmp_path, s3, mount, monkeypatch):
    src = tmp_path / "k.safetensors"
    fx.base(src)
    url = s3.upload(src, "creds/k.safetensors")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # No credentials anywhere: refused (object_store would ask the instance
    # metadata service, which is not there).
    m = mount(url, *s3.options, "--timeout", "2", expect_ok=False)
    assert not m.ok and url in m.result.stderr and "no credentials found" in m.result.stderr, m.result.stderr
    aws = tmp_path / "home" / ".aws"
    aws.mkdir(parents=True)
    (aws / "credentials").write_text("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n"
                                     "[bench]\naws_access_key_id = benchkey\naws_secret_access_key = s\n")
    (aws / "config").write_text(f"[profile bench]\nregion = us-east-1\nendpoint_url = {s3.url}\n")
    # moto takes any key: the proxy refuses requests not signed with the profile's.
    s3.rule = lambda r: None if "Credential=benchkey/" in r["authorization"] else 403
    m = mount(url, "--cache-dir", str(tmp_path / "cache"), "--endpoint", s3.url, expect_ok=False)
    assert not m.ok and "denied" in m.result.stderr, "the default profile's key was refused"
    monkeypatch.setenv("AWS_PROFILE", "bench")
    # The endpoint comes from the profile too.
    m = mount(url, "--cache-dir", str(tmp_path / "cache"))
    assert read(os.path.join(m.path, "a")) == np.arange(8, dtype=np.float32).tobytes()
    assert any(r["range"] for r in s3.requests), "the requests went through the profile's endpoint"


@pytest.mark.parametrize("etags", ["strong", "weak"])
def test_an_http_object_replaced_behind_the_mount_is_eio(tmp_path, web_servers, mount, etags):
    web = web_servers(etags)
    tensors = big_checkpoint(web.root / "r.safetensors", seed=1)
    m = mount(f"{web.url}/r.safetensors", *web.options)
    assert read(os.path.join(m.path, "small.0")) == tensors["small.0"].tobytes()
    big_checkpoint(web.root / "new.safetensors", seed=2)
    os.replace(web.root / "new.safetensors", web.root / "r.safetensors")
    with pytest.raises(OSError) as e:
        read(os.path.join(m.path, "big.a"))
    assert e.value.errno == errno.EIO and "replaced" in log_of(m)


def test_a_server_without_etags_is_served_but_not_cached_across_mounts(tmp_path, web_servers, mount):
    web = web_servers("none")
    tensors = big_checkpoint(web.root / "n.safetensors")
    url = f"{web.url}/n.safetensors"
    m = mount(url, *web.options)
    assert read(os.path.join(m.path, "big.a")) == tensors["big.a"].tobytes()
    assert "no ETag" in log_of(m)
    m.close()
    web.reset()
    m2 = mount(url, *web.options)
    assert read(os.path.join(m2.path, "big.a")) == tensors["big.a"].tobytes()
    # Nothing tells two versions apart: a new mount does not trust the cache.
    assert web.count("GET", ranged=True) > 1


def test_without_etags_last_modified_still_tells_versions_apart(tmp_path, web_servers, mount, run):
    web = web_servers("lastmod")
    tensors = big_checkpoint(web.root / "l.safetensors", seed=1)
    m = mount(f"{web.url}/l.safetensors", *web.options)
    assert read(os.path.join(m.path, "small.0")) == tensors["small.0"].tobytes()
    big_checkpoint(web.root / "new.safetensors", seed=2)
    os.utime(web.root / "new.safetensors", (2e9, 2e9))  # another second than the first
    os.replace(web.root / "new.safetensors", web.root / "l.safetensors")
    with pytest.raises(OSError) as e:
        read(os.path.join(m.path, "big.a"))
    assert e.value.errno == errno.EIO
    status = run("status", m.path).stdout
    assert "changed behind the mount" in status, status


def test_the_cache_folder_is_private(tmp_path, s3, mount):
    src = tmp_path / "p.safetensors"
    fx.base(src)
    url = s3.upload(src, "private/p.safetensors")
    opened = tmp_path / "opened"
    opened.mkdir(mode=0o755)
    os.chmod(opened, 0o755)
    m = mount(url, "--endpoint", s3.url, "--cache-dir", str(opened))
    assert os.stat(opened).st_mode & 0o777 == 0o700, "made private"
    m.close()
    if os.geteuid() != 0:
        return  # the rest needs a folder of another user's
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    m = mount(url, "--endpoint", s3.url, "--cache-dir", str(theirs), expect_ok=False)
    assert "belongs to uid 65534" in m.result.stderr
    link = tmp_path / "link"
    link.symlink_to(opened)
    m = mount(url, "--endpoint", s3.url, "--cache-dir", str(link), expect_ok=False)
    assert not m.ok and str(link) in m.result.stderr


def test_a_signal_unmounts_a_remote_mount_cleanly(tmp_path, s3, mount):
    src = tmp_path / "sig.safetensors"
    fx.base(src)
    url = s3.upload(src, "signal/sig.safetensors")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        m = mount(url, *s3.options)
        assert read(os.path.join(m.path, "a")) == np.arange(8, dtype=np.float32).tobytes()
        os.kill(m.pid, sig)
        deadline = time.monotonic() + 20
        while m.is_mounted() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not m.is_mounted(), f"still mounted after {sig!r}"
        wait_for_exit(m.pid, 20)
        assert "on signal" in log_of(m) and "unmounted" in log_of(m)


def test_odd_key_names_in_a_folder_and_the_bucket_top(tmp_path, moto, mount):
    proxy = FaultProxy(moto.port)
    try:
        client = moto.client()
        client.create_bucket(Bucket="stfs-odd")
        arrays = {}
        for i, name in enumerate(["ünï code", "x%20y", "a+b"]):
            path = tmp_path / f"{i}.safetensors"
            arrays[name] = np.full(3, i, np.int32)
            save_file({"t": arrays[name]}, str(path))
            client.upload_file(str(path), "stfs-odd", f"{name}.safetensors")
        m = mount("s3://stfs-odd", "--endpoint", proxy.url, "--cache-dir", str(tmp_path / "cache"))
        assert sorted(os.listdir(m.path)) == sorted(arrays)
        for name, a in arrays.items():
            assert read(os.path.join(m.path, name, "t")) == a.tobytes(), name
    finally:
        proxy.stop()


def test_a_planted_cache_file_is_never_served(tmp_path, s3, mount):
    """A cache folder that was open to others is emptied when made private,
    and a file not written by stfs (no key) never checks out, even under the
    name of a real chunk."""
    tensors, url = big_on_s3(tmp_path, s3, "planted/k.safetensors")
    cache = tmp_path / "cache"
    m = mount(url, *s3.options)
    assert read(os.path.join(m.path, "big.a")) == tensors["big.a"].tobytes()
    m.close()
    key = cache / "key"
    assert key.exists() and key.stat().st_mode & 0o777 == 0o600
    chunks = sorted(cache.glob("*.chunk"), key=lambda f: f.stat().st_size)
    # A forged file in place of a real chunk, same length, magic and all.
    victim = chunks[-1]
    forged = bytearray(victim.read_bytes())
    forged[:-44] = bytes(len(forged) - 44)
    victim.write_bytes(bytes(forged))
    # A FIFO under another chunk's name must not block a read.
    fifo = chunks[-2]
    fifo.unlink()
    os.mkfifo(fifo)
    s3.reset()
    m = mount(url, *s3.options)
    for name in ("big.a", "big.b"):
        assert read(os.path.join(m.path, name)) == tensors[name].tobytes(), name
    m.close()
    # Open to others once: everything in it is dropped, the key too.
    os.chmod(cache, 0o777)
    old_key = key.read_bytes()
    s3.reset()
    m = mount(url, *s3.options)
    assert os.stat(cache).st_mode & 0o777 == 0o700
    assert key.read_bytes() != old_key
    assert read(os.path.join(m.path, "big.a")) == tensors["big.a"].tobytes()
    assert s3.count("GET", ranged=True) > 1, "fetched again, not served from planted files"


def test_a_header_sent_a_byte_at_a_time_fails_the_mount_in_bounded_time(tmp_path, s3, mount):
    src = tmp_path / "slow.safetensors"
    # A header over 1 MiB: the mount asks for the rest in a second GET.
    save_file({f"t{i:06d}." + "x" * 40: np.zeros(1, np.uint8) for i in range(20000)}, str(src))
    url = s3.upload(src, "slow/slow.safetensors")
    ranged = []

    def rule(r):
        if r["range"]:
            ranged.append(r)
            return "trickle_body" if len(ranged) > 1 else None
        return None

    s3.rule = rule
    t0 = time.monotonic()
    m = mount(url, *s3.options, "--timeout", "3", expect_ok=False)
    took = time.monotonic() - t0
    s3.let_go()
    assert not m.ok and "in time" in m.result.stderr, m.result.stderr
    # The point is "bounded" (4 x --timeout for the header: 12 s), not a
    # benchmark; each request alone may take 10 x --timeout.
    assert took < 25, took


def test_a_remote_checkpoint_converts_to_bf16_by_cp_of_its_view(tmp_path, s3, mount):
    """Views of a read-only remote source: `cp` of the BF16 view converts a checkpoint in S3."""
    import ml_dtypes
    from safetensors import safe_open

    src = tmp_path / "r.safetensors"
    w = np.random.default_rng(4).standard_normal((300, 70)).astype(np.float32)
    ids = np.arange(9, dtype=np.int32)
    save_file({"w": w, "ids": ids}, str(src), metadata={"format": "pt"})
    url = s3.upload(src, "views/r.safetensors")
    m = mount(url, *s3.options)
    export = os.path.join(m.path, "__views__", "model.safetensors")
    assert open(export, "rb").read() == src.read_bytes()
    out = tmp_path / "r-bf16.safetensors"
    subprocess.run(["cp", os.path.join(m.path, "__views__", "bf16", "model.safetensors"), str(out)], check=True)
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert header["w"]["dtype"] == "BF16" and header["ids"]["dtype"] == "I32"
    start, end = header["w"]["data_offsets"]
    assert raw[8 + n + start:8 + n + end] == w.astype(ml_dtypes.bfloat16).tobytes()
    with safe_open(str(out), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("ids").tobytes() == ids.tobytes()


@pytest.mark.parametrize("tokens,requests", [(100, 1), (150_000, 3)])
def test_a_remote_gguf_mounts_read_only_its_header_read_in_doubling_ranges(tmp_path, s3, web, mount, tokens,
                                                                          requests):
    """A GGUF object's header has no length prefix: the first GET (1 MiB) is parsed, and
    while the keys run past it, twice as much is asked for (150,000 tokens: about 2.8 MiB
    of keys, so 1 + 1 + 2 MiB in three GETs)."""
    gguf = pytest.importorskip("gguf")
    src = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_name("remote")
    w.add_token_list([f"token-{i}" for i in range(tokens)])
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.add_tensor("output_norm.weight", np.ones(8, np.float16))  # 16 bytes, padded to 32
    w.add_tensor("blk.0.ffn_up.weight", np.arange(2 * 144, dtype=np.uint8).reshape(2, 144) % 251,
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(src))
    url = s3.upload(src, "gguf/tiny.gguf")
    s3.reset()
    m = mount(url, *s3.options)
    assert "mounted read-only (GGUF objects cannot be committed to S3 yet)" in m.result.stderr
    assert s3.count("GET") == requests
    for t in reader.tensors:
        assert read(os.path.join(m.path, t.name)) == t.data.tobytes(), t.name
    assert read(os.path.join(m.path, "__kv__", "general.name")) == b"remote\n"
    # The file itself, made from the kept header and the tensors (with their padding).
    assert read(os.path.join(m.path, "__views__", "model.gguf")) == src.read_bytes()
    assert json.loads(read(os.path.join(m.path, "__kv__", "tokenizer.ggml.tokens")))[-1] == f"token-{tokens - 1}"
    with pytest.raises(OSError) as e:
        with open(os.path.join(m.path, "__kv__", "general.name"), "w") as f:
            f.write("x")
    assert e.value.errno == errno.EROFS
    # Over HTTP too, and an object named otherwise is still read as GGUF (by its magic)
    # and still read-only.
    (web.root / "model.bin").write_bytes(src.read_bytes())
    h = mount(f"{web.url}/model.bin", *web.options)
    assert read(os.path.join(h.path, "token_embd.weight")) == reader.tensors[0].data.tobytes()
    s3_other = mount(s3.upload(src, "gguf/model.bin"), *s3.options)
    with pytest.raises(OSError) as e:
        os.unlink(os.path.join(s3_other.path, "token_embd.weight"))
    assert e.value.errno == errno.EROFS
    # Found to be GGUF once opened: said, and read-only at the kernel too.
    assert "mounted read-only (GGUF objects cannot be committed" in s3_other.result.stderr
    assert os.statvfs(s3_other.path).f_flag & os.ST_RDONLY


def test_an_s3_prefix_of_split_gguf_parts_mounts_as_shards_read_only(tmp_path, s3, mount):
    pytest.importorskip("gguf")
    from test_gguf import write_split
    folder = tmp_path / "split"
    folder.mkdir()
    arrays = write_split(folder)
    for part in sorted(folder.iterdir()):
        s3.upload(part, f"split/{part.name}")
    m = mount(f"s3://{BUCKET}/split/", *s3.options)
    shards = sorted(os.listdir(m.path))
    assert shards == [f"model-0000{k}-of-00003" for k in (1, 2, 3)]
    assert read(os.path.join(m.path, shards[1], "__kv__", "split.no")) == b"1\n"
    assert read(os.path.join(m.path, shards[2], "blk.4.w")) == arrays["blk.4.w"].tobytes()
    with pytest.raises(OSError) as e:
        os.unlink(os.path.join(m.path, shards[0], "blk.0.w"))
    assert e.value.errno == errno.EROFS


def test_inspect_and_verify_take_urls(tmp_path, s3, web, run):
    """The same answers as for the files themselves: inspect's table and
    JSON, verify's lines, a bad object's rule, a prefix's index check."""
    folder = tmp_path / "model"
    a, b, index = fx.two_shards(folder)
    for f in folder.iterdir():
        s3.upload(f, f"urls/{f.name}")
    endpoint = ["--endpoint", s3.url]
    url = f"s3://{BUCKET}/urls/model-00001-of-00002.safetensors"
    local = run("inspect", "--json", folder / "model-00001-of-00002.safetensors", check=True).stdout
    remote = run("inspect", "--json", *endpoint, url, check=True).stdout
    assert {**json.loads(remote), "file": None} == {**json.loads(local), "file": None}
    assert json.loads(remote)["file"] == url
    table = run("inspect", *endpoint, url, check=True).stdout
    assert table.startswith(url) and "F16" in table
    p = run("verify", *endpoint, f"s3://{BUCKET}/urls/", check=True)
    assert p.stdout.count(": ok") == 3 and "index agrees with the shards" in p.stdout, p.stdout
    # A wrong index and a bad object: exit 1, each problem said with its URL.
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    s3.upload(folder / "model.safetensors.index.json", "urls/model.safetensors.index.json")
    (tmp_path / "zip.safetensors").write_bytes(b"PK\x03\x04 not a checkpoint" * 10)
    bad = s3.upload(tmp_path / "zip.safetensors", "bad/zip.safetensors")
    p = run("verify", *endpoint, f"s3://{BUCKET}/urls/", bad)
    assert p.returncode == 1, p.stdout
    assert f"s3://{BUCKET}/urls/model.safetensors.index.json" in p.stdout and bad in p.stdout, p.stdout
    p = run("inspect", *endpoint, f"s3://{BUCKET}/no/such.safetensors")
    assert p.returncode == 1 and "not found" in p.stderr, p.stderr
    # https:// as well.
    save_file({"w": np.ones(7, np.float32)}, str(web.root / "w.safetensors"))
    table = run("inspect", f"{web.url}/w.safetensors", check=True).stdout
    assert "F32" in table and "[7]" in table, table
