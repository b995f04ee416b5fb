"""Commits to S3 (a local moto server, behind the counting, fault-injecting
proxy): every edit kind committed as a multipart upload of the new header and
server-side copies of the old object, judged by downloading the object and
reading it with the official `safetensors`; the lost-update refusal; faults
at every step; a daemon killed mid-upload. Nothing reaches beyond 127.0.0.1.

moto takes parts under 5 MiB when S3_UPLOAD_PART_MIN_SIZE says so, and
stfs when STFS_S3_MIN_PART does: most tests use 64 KiB parts to stay small;
one uses S3's real 5 MiB rule on a larger object."""

import errno
import json
import os
import signal
import subprocess

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load, save_file

import stfs_fixtures as fx
from remote_servers import FaultProxy, Moto
from stfs_fixtures import wait_for_exit
from test_threats import background, finished, pauses  # noqa: F401 (a fixture)

BUCKET = "stfs-commit"
MIN = 64 << 10
MIB = 1 << 20


def start_moto(tmp_path_factory, env):
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = Moto(log, env=env)
    server.client().create_bucket(Bucket=BUCKET)
    return server


@pytest.fixture(scope="module")
def aws_env():
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                            "AWS_ENDPOINT_URL", "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    os.environ.pop("AWS_ENDPOINT_URL", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def moto_small(aws_env, tmp_path_factory):
    server = start_moto(tmp_path_factory, {"S3_UPLOAD_PART_MIN_SIZE": str(MIN)})
    yield server
    server.stop()


@pytest.fixture
def s3(moto_small, tmp_path, monkeypatch):
    """The proxy in front of moto, with `put(local, key) -> url`, `get(key) ->
    bytes`, `uploads()` (the multipart uploads open), `options` for a mount."""
    monkeypatch.setenv("STFS_S3_MIN_PART", str(MIN))
    proxy = FaultProxy(moto_small.port)
    client = moto_small.client()
    proxy.client = client
    proxy.put = lambda local, key: (client.upload_file(str(local), BUCKET, key), f"s3://{BUCKET}/{key}")[1]
    proxy.get = lambda key: client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    proxy.etag = lambda key: client.head_object(Bucket=BUCKET, Key=key)["ETag"]
    proxy.uploads = lambda: client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    proxy.options = ["--endpoint", proxy.url, "--cache-dir", str(tmp_path / "cache")]
    yield proxy
    proxy.stop()
    for u in proxy.uploads():
        client.abort_multipart_upload(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])


def checkpoint(path, seed=0):
    """Twelve tensors of 96-400 KiB (each more than a part) and a few small ones."""
    rng = np.random.default_rng(seed)
    t = {f"layer.{i:02}": rng.standard_normal(((i % 4 + 1) * 24 << 10) // 4).astype(np.float32)
         for i in range(12)}
    t.update({f"norm.{i}": rng.standard_normal(64).astype(np.float32) for i in range(3)})
    meta = {"format": "pt"}
    save_file(t, str(path), metadata=meta)
    return t, meta


def file_order(path):
    """Tensor names in the order of their bytes in the file."""
    h, _, _ = fx.header_of(path)
    return sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def judged(data, t, meta, tmp_path):
    """The downloaded object, read by the official package, is `t` and `meta`."""
    got_path = tmp_path / "downloaded.safetensors"
    got_path.write_bytes(data)
    got = load(data)
    assert sorted(got) == sorted(t)
    for k, v in t.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k
    with safe_open(str(got_path), framework="np") as f:
        assert (f.metadata() or {}) == meta


def sent_by_stfs(s3):
    """(bytes of request bodies sent, the copy requests) since the last reset."""
    reqs = list(s3.requests)
    body = sum(r["length"] for r in reqs if r["method"] in ("PUT", "POST"))
    copies = [r for r in reqs if "x-amz-copy-source" in r["headers"]]
    return body, copies


def edit(kind, path, t, meta, order, tmp_path):
    t, meta = dict(t), dict(meta)
    if kind == "metadata":
        meta["chat_template"] = "{{ messages }}"
        with open(os.path.join(path, "__metadata__.json"), "w") as f:
            json.dump(meta, f)
    elif kind == "rename":
        fx.sh(f"mv {path}/layer.03 {path}/model.layers.3.weight")
        t["model.layers.3.weight"] = t.pop("layer.03")
    elif kind == "overwrite":
        name = order[5]
        new = np.full(t[name].shape, 0.25, t[name].dtype)
        (tmp_path / "new.bin").write_bytes(new.tobytes())
        fx.sh(f"dd if={tmp_path}/new.bin of={path}/{name} bs=64K conv=notrunc status=none")
        t[name] = new
    elif kind == "patch":
        # 4 bytes into a tensor: its block goes up, the rest is the server's.
        name = max(order, key=lambda k: t[k].nbytes)
        raw = bytearray(t[name].tobytes())
        at = len(raw) // 2 + 1
        raw[at:at + 4] = b"\x00\x00\x80\x3f"
        fd = os.open(os.path.join(path, name), os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x00\x00\x80\x3f", at)
        finally:
            os.close(fd)
        t[name] = np.frombuffer(bytes(raw), t[name].dtype).copy()
    elif kind == "drop_middle":
        name = order[len(order) // 2]
        os.unlink(os.path.join(path, name))
        del t[name]
    elif kind == "drop_tail":
        name = order[-1]
        os.unlink(os.path.join(path, name))
        del t[name]
    elif kind in ("new_tensor", "append"):
        name = "lora.A" if kind == "new_tensor" else "zz.appended"
        new = np.arange(300 << 10, dtype=np.uint8)
        (tmp_path / "extra.bin").write_bytes(new.tobytes())
        fx.sh(f"cp {tmp_path}/extra.bin {path}/{name} && "
              f"echo '{{\"dtype\":\"U8\",\"shape\":[{new.size}]}}' > {path}/{name}.meta.json")
        t[name] = new
    return t, meta


@pytest.mark.parametrize("kind", ["metadata", "rename", "overwrite", "patch", "drop_middle", "drop_tail",
                                  "new_tensor", "append"])
def test_every_edit_kind_commits_to_s3_moving_only_the_edit(tmp_path, s3, mount, run, kind):
    src = tmp_path / "m.safetensors"
    t, meta = checkpoint(src)
    url = s3.put(src, f"{kind}/m.safetensors")
    m = mount(url, *s3.options)
    assert "read-only" not in m.result.stderr
    t2, meta2 = edit(kind, m.path, t, meta, file_order(src), tmp_path)
    status = run("status", m.path).stdout
    assert "commit     remote multipart (" in status and "copied by the server" in status, status
    s3.reset()
    p = run("commit", m.path)
    assert p.returncode == 0, p.stderr
    assert f"{url}: committed remote multipart (" in p.stdout, p.stdout
    judged(s3.get(f"{kind}/m.safetensors"), t2, meta2, tmp_path)
    assert s3.uploads() == []
    # Only the edit moved: the new header topped up to a part, what the
    # edit wrote, and the small runs between; the rest copied by the server.
    body, copies = sent_by_stfs(s3)
    new_bytes = sum(v.nbytes for k, v in t2.items() if k not in t or t[k].tobytes() != v.tobytes())
    assert copies, "no server-side copy"
    assert all(c["headers"]["x-amz-copy-source-range"].startswith("bytes=") for c in copies)
    assert all(c["headers"].get("x-amz-copy-source-if-match") for c in copies)
    assert body <= new_bytes + 4 * MIN + 8192, (body, new_bytes)
    if kind == "patch":
        # (The header part and the block topped up to parts: not the tensor.)
        assert body <= 4 * MIN + 8192 + 4096, body
    assert body - new_bytes < os.path.getsize(src) / 2
    # The completion was conditional on the version mounted.
    completes = [r for r in s3.requests if r["method"] == "POST" and "uploadId=" in r["path"]]
    assert len(completes) == 1 and completes[0]["headers"].get("if-match"), completes
    # The mount serves the new object at once, and commits again over it.
    assert sorted(f for f in os.listdir(m.path) if not f.endswith(".meta.json") and not f.startswith("__")) \
        == sorted(t2)
    name = sorted(t2)[0]
    assert fx.sh(f"cat {m.path}/{name} | sha256sum").stdout.split()[0] == \
        __import__("hashlib").sha256(t2[name].tobytes()).hexdigest()
    meta2["second"] = "commit"
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump(meta2, f)
    fx.committed(run, m)
    judged(s3.get(f"{kind}/m.safetensors"), t2, meta2, tmp_path)
    m.close(check=True)
    # A fresh mount reads the committed object; nothing is left staged.
    m = mount(url, *s3.options)
    assert "nothing" in run("status", m.path).stdout or "no changes" in run("status", m.path).stdout


def test_after_a_commit_the_cached_chunks_that_did_not_move_serve_without_a_request(tmp_path, s3, mount, run):
    src = tmp_path / "m.safetensors"
    t, meta = checkpoint(src)
    url = s3.put(src, "cached/m.safetensors")
    m = mount(url, *s3.options)
    # A first commit gives the header room (save_file leaves none): the data moves.
    meta["edited"] = "yes"
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump(meta, f)
    fx.committed(run, m)
    for name in t:
        fx.sh(f"cat {m.path}/{name} > /dev/null")
    # The next header edits fit the room: no byte of data moves.
    meta["edited"] = "twice"
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump(meta, f)
    fx.committed(run, m)
    s3.reset()
    for name, v in t.items():
        with open(os.path.join(m.path, name), "rb") as f:
            assert f.read() == v.tobytes(), name
    assert s3.count("GET") == 0, [r["range"] for r in s3.requests]
    # A rename moves no bytes either; a tensor dropped from the middle moves
    # those after it: those are fetched again, from the new object.
    order = file_order(src)
    os.unlink(os.path.join(m.path, order[3]))
    del t[order[3]]
    fx.committed(run, m)
    s3.reset()
    for name, v in t.items():
        with open(os.path.join(m.path, name), "rb") as f:
            assert f.read() == v.tobytes(), name
    assert s3.count("GET") > 0


def test_a_small_object_goes_up_by_one_conditional_put(tmp_path, s3, mount, run):
    src = tmp_path / "s.safetensors"
    t = {"a": np.arange(8, dtype=np.float32), "b": np.ones((4, 4), np.float16)}
    save_file(t, str(src))
    url = s3.put(src, "small/s.safetensors")
    m = mount(url, *s3.options)
    fx.sh(f"mv {m.path}/a {m.path}/alpha")
    assert "commit     remote PutObject (" in run("status", m.path).stdout
    s3.reset()
    fx.committed(run, m)
    puts = [r for r in s3.requests if r["method"] == "PUT"]
    assert len(puts) == 1 and puts[0]["headers"].get("if-match"), puts
    judged(s3.get("small/s.safetensors"), {"alpha": t["a"], "b": t["b"]}, {}, tmp_path)


def test_an_object_replaced_behind_the_mount_is_refused_and_nothing_is_lost(tmp_path, s3, mount, run):
    src = tmp_path / "m.safetensors"
    t, meta = checkpoint(src)
    url = s3.put(src, "replaced/m.safetensors")
    m = mount(url, *s3.options)
    fx.sh(f"mv {m.path}/layer.00 {m.path}/renamed")
    other = tmp_path / "other.safetensors"
    t_other, _ = checkpoint(other, seed=7)
    s3.put(other, "replaced/m.safetensors")
    # stfs status asks the store (no read has found it yet) and says so.
    st = run("status", m.path)
    assert st.returncode != 0 and "the source changed since it was mounted" in st.stdout, st.stdout
    p = run("commit", m.path)
    assert p.returncode != 0
    assert "the source changed since it was mounted" in p.stderr, p.stderr
    # The advice is one that works for an object (not --force).
    assert "unmount with --discard and mount again" in p.stderr, p.stderr
    # The other writer's object stands, no upload is open, the edit is staged.
    assert s3.get("replaced/m.safetensors") == other.read_bytes()
    assert s3.uploads() == []
    assert "renamed    layer.00 -> renamed" in run("status", m.path).stdout
    # --force cannot rebuild what the other writer's object no longer holds.
    p = run("commit", "--force", m.path)
    assert p.returncode != 0
    assert "no longer in the store" in p.stderr or "changed since it was mounted" in p.stderr, p.stderr
    assert s3.get("replaced/m.safetensors") == other.read_bytes()
    assert s3.uploads() == []


def test_a_replacement_between_the_check_and_the_put_is_refused_by_if_match(tmp_path, s3, mount, run):
    src = tmp_path / "s.safetensors"
    save_file({"a": np.arange(8, dtype=np.float32)}, str(src))
    url = s3.put(src, "race/s.safetensors")
    m = mount(url, *s3.options)
    fx.sh(f"mv {m.path}/a {m.path}/b")
    other = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(other))

    def replace_before_put(r):
        # The object changes after stfs's HEAD, just before its PutObject lands.
        if r["method"] == "PUT" and r["headers"].get("if-match"):
            s3.client.upload_file(str(other), BUCKET, "race/s.safetensors")
        return None

    s3.rule = replace_before_put
    p = run("commit", m.path)
    assert p.returncode != 0
    assert "the source changed since it was mounted" in p.stderr, p.stderr
    assert s3.get("race/s.safetensors") == other.read_bytes()
    assert "renamed    a -> b" in run("status", m.path).stdout


def test_a_replacement_while_the_parts_go_up_is_refused_before_completing(tmp_path, s3, mount, run, pauses,
                                                                          stfs):
    """moto ignores If-Match on CompleteMultipartUpload (AWS honours it): the
    HEAD right before completing is what refuses here."""
    src = tmp_path / "m.safetensors"
    t, meta = checkpoint(src)
    url = s3.put(src, "late/m.safetensors")
    p = pauses("remote:complete")
    m = mount(url, *s3.options)
    fx.sh(f"mv {m.path}/layer.01 {m.path}/one")
    commit = background(stfs, "commit", m.path)
    p.wait("remote:complete", commit)
    other = tmp_path / "other.safetensors"
    checkpoint(other, seed=9)
    s3.put(other, "late/m.safetensors")
    p.go("remote:complete")
    code, out, err = finished(commit)
    assert code != 0 and "the source changed since it was mounted" in err, (out, err)
    assert s3.get("late/m.safetensors") == other.read_bytes()
    assert s3.uploads() == []
    assert "renamed    layer.01 -> one" in run("status", m.path).stdout


@pytest.mark.parametrize("size", ["multipart", "put"])
def test_a_completion_whose_answer_is_lost_is_recognised_as_landed(tmp_path, s3, mount, run, size):
    """The store completes the upload (or the PutObject) but no answer ever
    arrives: stfs recognises the new object at the key by its ETag, which it
    computes (S3's MD5 of the parts' MD5s, or of the body), instead of
    reporting a commit that landed as failed."""
    src = tmp_path / "m.safetensors"
    if size == "put":
        t, meta = {"a": np.arange(8, dtype=np.float32)}, {}
        save_file(t, str(src))
    else:
        t, meta = checkpoint(src)
    url = s3.put(src, f"lost-{size}/m.safetensors")
    m = mount(url, *s3.options)
    t2, meta2 = edit("metadata", m.path, t, meta, [], tmp_path)
    lost = [0]

    def rule(r):
        last = (r["method"] == "POST" and "uploadId=" in r["path"]) or \
            (r["method"] == "PUT" and r["headers"].get("if-match"))
        if last:
            # Every time: the request sent again may land too (a second
            # completion of an upload is accepted), its answer is lost all the same.
            lost[0] += 1
            return "lose_answer"
        return None

    s3.rule = rule
    p = run("commit", m.path, timeout=120)
    assert lost[0] > 1
    assert p.returncode == 0, p.stderr
    judged(s3.get(f"lost-{size}/m.safetensors"), t2, meta2, tmp_path)
    assert s3.uploads() == []
    assert "but the key holds the new object: committed" in open(m.log).read()
    assert "chat_template" in fx.sh(f"cat {m.path}/__metadata__.json").stdout


def step_of(r):
    """Which request of a commit this is."""
    path, method, h = r["path"], r["method"], r["headers"]
    if method == "POST" and path.endswith("uploads="):
        return "create"
    if method == "PUT" and "x-amz-copy-source" in h:
        return "copy"
    if method == "PUT" and "partNumber=" in path:
        return "part"
    if method == "POST" and "uploadId=" in path:
        return "complete"
    if method == "HEAD":
        return "head"
    return None


@pytest.mark.parametrize("step", ["create", "part", "copy", "head", "complete"])
@pytest.mark.parametrize("action", [500, "drop", "error_200"])
def test_a_fault_at_every_step_leaves_the_old_object_or_the_new_never_a_mix(tmp_path, s3, mount, run,
                                                                             step, action):
    if action == "error_200" and step not in ("copy", "complete"):
        pytest.skip("S3 answers 200 with an error body only to copies and completions")
    src = tmp_path / "m.safetensors"
    t, meta = checkpoint(src)
    key = f"faults/{step}-{action}/m.safetensors"
    url = s3.put(src, key)
    old = s3.get(key)
    m = mount(url, *s3.options, "--timeout", "5")
    t2, meta2 = edit("rename", m.path, t, meta, file_order(src), tmp_path)
    # Every request of that step fails: the commit fails; once: it is retried.
    for times in ("always", "once"):
        seen = [0]

        def rule(r):
            if step_of(r) == step and (times == "always" or seen[0] == 0):
                seen[0] += 1
                return action
            return None

        s3.reset()
        s3.rule = rule
        p = run("commit", m.path, timeout=120)
        s3.rule = None
        assert seen[0] > 0, f"no {step} request"
        assert s3.uploads() == [], (step, action, times)
        data = s3.get(key)
        if p.returncode != 0:
            assert data == old, (step, action, times)
            assert "the object is unchanged and the edits are staged" in p.stderr, p.stderr
            assert "model.layers.3.weight" in run("status", m.path).stdout
        else:
            assert times == "once", f"{step} failing {action} every time, and the commit succeeded"
            judged(data, t2, meta2, tmp_path)


def overwrite_every_other(path, t, order, tmp_path):
    """Overwrites every other tensor, in file order: each is an uploaded
    part of its own between copied runs."""
    t = dict(t)
    for name in order[::2]:
        new = np.full(t[name].shape, 0.5, t[name].dtype)
        (tmp_path / "new.bin").write_bytes(new.tobytes())
        fx.sh(f"dd if={tmp_path}/new.bin of={path}/{name} bs=64K conv=notrunc status=none")
        t[name] = new
    return t


def test_uploaded_parts_go_up_several_at_once_and_a_failed_one_aborts_them_all(tmp_path, s3, mount, run):
    src = tmp_path / "m.safetensors"
    rng = np.random.default_rng(5)
    t = {f"w.{i:02}": rng.standard_normal(32 << 10).astype(np.float32) for i in range(16)}  # 128 KiB each
    meta = {"format": "pt"}
    save_file(t, str(src), metadata=meta)
    url = s3.put(src, "parallel/m.safetensors")
    old = s3.get("parallel/m.safetensors")
    m = mount(url, *s3.options)
    t2 = overwrite_every_other(m.path, t, file_order(src), tmp_path)
    # The fifth part fails every time: the commit fails, every part sent is
    # answered, the upload aborted, nothing left open.
    parts = []

    def rule(r):
        if step_of(r) == "part":
            parts.append(r)
            if len(parts) >= 5:
                return 500
        return None

    s3.rule = rule
    p = run("commit", m.path, timeout=120)
    s3.rule = None
    assert p.returncode != 0 and "the object is unchanged" in p.stderr, p.stderr
    assert s3.get("parallel/m.safetensors") == old
    assert s3.uploads() == []
    # Then all of them go up and land.
    s3.reset()
    p = fx.committed(run, m)
    uploaded = [r for r in s3.requests if step_of(r) == "part"]
    assert len(uploaded) >= 8, p.stdout
    judged(s3.get("parallel/m.safetensors"), t2, meta, tmp_path)
    assert s3.uploads() == []


def test_a_daemon_killed_mid_upload_leaves_no_parts_and_the_edits_come_back(tmp_path, s3, mount, run):
    src = tmp_path / "m.safetensors"
    t, meta = checkpoint(src)
    url = s3.put(src, "killed/m.safetensors")
    old = s3.get("killed/m.safetensors")
    m = mount(url, *s3.options, env={"STFS_CRASH_AT": "remote:copy"})
    t2, meta2 = edit("metadata", m.path, t, meta, [], tmp_path)
    p = run("commit", m.path)
    assert p.returncode != 0
    wait_for_exit(m.pid, 20)
    # The upload was begun and the daemon died with it open.
    assert len(s3.uploads()) == 1
    assert s3.get("killed/m.safetensors") == old
    subprocess.run(["umount", "-l", m.path], check=False)
    m2 = mount(url, *s3.options)
    assert "upload of a commit that was interrupted was aborted" in m2.result.stderr, m2.result.stderr
    assert s3.uploads() == []
    assert "took back 1 staged change of an earlier mount" in m2.result.stderr, m2.result.stderr
    assert "chat_template" in run("status", m2.path).stdout
    fx.committed(run, m2)
    judged(s3.get("killed/m.safetensors"), t, meta2, tmp_path)


def test_a_read_only_mount_refuses_edits_and_commits(tmp_path, s3, mount, run):
    src = tmp_path / "a.safetensors"
    fx.base(src)
    url = s3.put(src, "ro/a.safetensors")
    m = mount(url, *s3.options, "-o", "ro")
    with pytest.raises(OSError) as e:
        os.unlink(os.path.join(m.path, "a"))
    assert e.value.errno == errno.EROFS
    # Nor does it commit (--compact would rewrite with nothing staged).
    etag = s3.etag("ro/a.safetensors")
    p = run("commit", "--compact", m.path)
    assert p.returncode != 0 and "the mount is read-only (-o ro): it commits nothing" in p.stderr, p.stderr
    assert s3.etag("ro/a.safetensors") == etag
    # A plain commit has nothing to do, so `stfs umount` goes through (a
    # local read-only mount too).
    assert "nothing to commit" in fx.committed(run, m).stdout
    m.close(check=True)
    m = mount(src, "-o", "ro")
    m.close(check=True)


SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
INDEX = "model.safetensors.index.json"


def shard_folder(s3, tmp_path, prefix):
    """Three shards of `checkpoint`'s tensors (four layers each, the norms in
    the last) and their index as transformers writes it, put under `prefix`.
    Returns {shard: tensors}."""
    t, _ = checkpoint(tmp_path / "whole.safetensors")
    names = sorted(t)
    split = {SHARDS[0]: names[0:4], SHARDS[1]: names[4:8], SHARDS[2]: names[8:]}
    shards = {}
    for shard, keys in split.items():
        shards[shard] = {k: t[k] for k in keys}
        save_file(shards[shard], str(tmp_path / shard), metadata={"format": "pt"})
        s3.put(tmp_path / shard, f"{prefix}/{shard}")
    write_index(tmp_path / INDEX, shards)
    s3.put(tmp_path / INDEX, f"{prefix}/{INDEX}")
    return shards


def write_index(path, shards):
    weight_map = {k: shard for shard, ts in shards.items() for k in ts}
    total = sum(v.nbytes for ts in shards.values() for v in ts.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def edit_folder(path, shards):
    """A rename within the first shard and a move of a tensor from it to the
    second: both shards and the index change, the third shard does not."""
    s1, s2 = (os.path.join(path, s.removesuffix(".safetensors")) for s in SHARDS[:2])
    want = {k: dict(v) for k, v in shards.items()}
    fx.sh(f"mv {s1}/layer.01 {s1}/model.layers.1.weight && mv {s1}/layer.02 {s2}/")
    want[SHARDS[0]]["model.layers.1.weight"] = want[SHARDS[0]].pop("layer.01")
    want[SHARDS[1]]["layer.02"] = want[SHARDS[0]].pop("layer.02")
    return want


def folder_judged(s3, prefix, want, tmp_path):
    """Every shard in the store is `want`'s, and the index names exactly their tensors."""
    for shard, t in want.items():
        judged(s3.get(f"{prefix}/{shard}"), t, {"format": "pt"}, tmp_path)
    index = json.loads(s3.get(f"{prefix}/{INDEX}"))
    assert index["weight_map"] == {k: shard for shard, ts in want.items() for k in ts}
    assert index["metadata"]["total_size"] == sum(v.nbytes for ts in want.values() for v in ts.values())


def test_a_folder_of_shards_commits_its_changed_shards_then_the_index(tmp_path, s3, mount, run):
    shards = shard_folder(s3, tmp_path, "folder")
    untouched = s3.etag(f"folder/{SHARDS[2]}")
    url = f"s3://{BUCKET}/folder/"
    m = mount(url, *s3.options)
    assert "read-only" not in m.result.stderr, m.result.stderr
    assert oct(os.stat(m.path).st_mode & 0o777) == oct(0o755)  # (its model files are made there)
    want = edit_folder(m.path, shards)
    status = run("status", m.path).stdout
    assert status.count("commit     remote multipart (") == 2, status
    s3.reset()
    p = fx.committed(run, m)
    for shard in SHARDS[:2]:
        assert f"{url}{shard}: committed remote multipart (" in p.stdout, p.stdout
    assert f"{url}{INDEX}: rewritten" in p.stdout, p.stdout
    folder_judged(s3, "folder", want, tmp_path)
    assert s3.etag(f"folder/{SHARDS[2]}") == untouched
    assert s3.uploads() == []
    # The shards landed first, each conditional on the version mounted; the
    # index last, conditional too; the third shard was not written.
    writes = [(i, r) for i, r in enumerate(s3.requests)
              if (r["method"] == "POST" and "uploadId=" in r["path"]) or
              (r["method"] == "PUT" and r["path"].endswith(INDEX))]
    assert [r["method"] for _, r in writes] == ["POST", "POST", "PUT"], writes
    assert all(r["headers"].get("if-match") for _, r in writes), writes
    assert not [r for r in s3.requests if r["method"] in ("PUT", "POST") and SHARDS[2] in r["path"]]
    # The tensor moved between shards was copied by the server from the
    # shard it left (the version mounted), not sent again.
    _, copies = sent_by_stfs(s3)
    moved = [c for c in copies if SHARDS[1] in c["path"]
             and c["headers"]["x-amz-copy-source"].endswith(f"folder/{SHARDS[0]}")]
    assert moved and all(c["headers"].get("x-amz-copy-source-if-match") for c in moved), copies
    # The mount shows the committed folder, and commits again over it.
    index_view = json.loads(open(os.path.join(m.path, INDEX)).read())
    assert index_view["weight_map"]["layer.02"] == SHARDS[1]
    s2 = os.path.join(m.path, SHARDS[1].removesuffix(".safetensors"))
    fx.sh(f"mv {s2}/layer.02 {s2}/layer.02.moved")
    want[SHARDS[1]]["layer.02.moved"] = want[SHARDS[1]].pop("layer.02")
    fx.committed(run, m)
    folder_judged(s3, "folder", want, tmp_path)
    m.close(check=True)
    m = mount(url, *s3.options)
    assert "weight_map" not in m.result.stderr, m.result.stderr
    assert "no changes" in run("status", m.path).stdout


@pytest.mark.parametrize("replaced", ["index", "unwritten shard"])
def test_a_changed_index_or_listed_shard_stops_the_whole_folder_commit(tmp_path, s3, mount, run, replaced):
    """The index a commit rewrites lists every shard's tensors as mounted: the
    index, or a shard the commit does not write, replaced behind the mount
    stops everything before any shard lands, and `stfs status` says so first."""
    shards = shard_folder(s3, tmp_path, "raced")
    etags = {s: s3.etag(f"raced/{s}") for s in SHARDS}
    url = f"s3://{BUCKET}/raced/"
    m = mount(url, *s3.options)
    edit_folder(m.path, shards)
    if replaced == "index":
        key, words = INDEX, "the index changed since it was mounted"
        s3.client.put_object(Bucket=BUCKET, Key=f"raced/{INDEX}", Body=b'{"weight_map": {}}\n')
    else:
        key, words = SHARDS[2], "this shard changed since it was mounted"
        other = {"other": np.zeros(4, np.float32)}
        save_file(other, str(tmp_path / "other.safetensors"))
        s3.put(tmp_path / "other.safetensors", f"raced/{SHARDS[2]}")
    etags[key] = s3.etag(f"raced/{key}")
    status = run("status", m.path)
    assert f"{url}: 1 problem across shards (a commit would refuse)" in status.stdout, status.stdout
    assert f"{url}{key}: {words}" in status.stdout, status.stdout
    p = run("commit", m.path)
    assert p.returncode != 0
    assert f"{url}{key}: {words}" in p.stderr, p.stderr
    assert {s: s3.etag(f"raced/{s}") for s in SHARDS} == {s: etags[s] for s in SHARDS}
    assert s3.uploads() == []
    assert "model.layers.1.weight" in run("status", m.path).stdout


@pytest.mark.parametrize("fault, landed", [("remote:complete:EIO", 0), ("remote:complete:EIO:2", 1),
                                           ("remote:index:EIO", 2)])
def test_a_folder_commit_that_fails_is_nothing_or_finished_by_the_next_mount(tmp_path, s3, mount, run, fault, landed):
    prefix = f"fault{landed}"
    shards = shard_folder(s3, tmp_path, prefix)
    etags = {s: s3.etag(f"{prefix}/{s}") for s in [*SHARDS, INDEX]}
    url = f"s3://{BUCKET}/{prefix}/"
    m = mount(url, *s3.options, env={"STFS_FAULT_AT": fault})
    want = edit_folder(m.path, shards)
    p = run("commit", m.path)
    assert p.returncode != 0
    changed = [s for s in SHARDS[:2] if s3.etag(f"{prefix}/{s}") != etags[s]]
    assert len(changed) == landed, (changed, p.stderr)
    assert s3.etag(f"{prefix}/{INDEX}") == etags[INDEX]
    if landed == 0:
        # Nothing changed: the uploads are aborted, the edits stay, a commit goes on.
        assert s3.uploads() == []
        fx.committed(run, m)
        folder_judged(s3, prefix, want, tmp_path)
        return
    assert f"{landed} of its 3 files landed" in p.stderr, p.stderr
    m.close()
    m2 = mount(url, *s3.options)
    assert "finished a commit that was interrupted" in m2.result.stderr, m2.result.stderr
    folder_judged(s3, prefix, want, tmp_path)
    assert s3.uploads() == []


def test_a_daemon_killed_between_two_shards_leaves_a_folder_the_next_mount_finishes(tmp_path, s3, mount, run):
    shards = shard_folder(s3, tmp_path, "killed2")
    etags = {s: s3.etag(f"killed2/{s}") for s in [*SHARDS, INDEX]}
    url = f"s3://{BUCKET}/killed2/"
    m = mount(url, *s3.options, env={"STFS_CRASH_AT": "remote:completed"})
    want = edit_folder(m.path, shards)
    p = run("commit", m.path)
    assert p.returncode != 0
    wait_for_exit(m.pid, 20)
    # One shard is new, the other's upload open, the index old.
    changed = [s for s in SHARDS if s3.etag(f"killed2/{s}") != etags[s]]
    assert len(changed) == 1, changed
    assert len(s3.uploads()) == 1
    assert s3.etag(f"killed2/{INDEX}") == etags[INDEX]
    subprocess.run(["umount", "-l", m.path], check=False)
    m2 = mount(url, *s3.options)
    assert "finished a commit that was interrupted" in m2.result.stderr, m2.result.stderr
    folder_judged(s3, "killed2", want, tmp_path)
    assert s3.uploads() == []
    assert "weight_map" not in m2.result.stderr, m2.result.stderr
    names = os.listdir(os.path.join(m2.path, SHARDS[0].removesuffix(".safetensors")))
    assert "model.layers.1.weight" in names and "layer.02" not in names
    # The journals held nothing but what landed: nothing is left aside.
    assert "another version" not in m2.result.stderr, m2.result.stderr
    assert "no changes" in run("status", m2.path).stdout


def test_a_daemon_killed_right_after_its_completion_leaves_the_new_object_and_nothing_staged(tmp_path, s3, mount, run):
    src = tmp_path / "m.safetensors"
    t, meta = checkpoint(src)
    url = s3.put(src, "landed/m.safetensors")
    m = mount(url, *s3.options, env={"STFS_CRASH_AT": "remote:completed"})
    t2, meta2 = edit("rename", m.path, t, meta, [], tmp_path)
    assert run("commit", m.path).returncode != 0
    wait_for_exit(m.pid, 20)
    subprocess.run(["umount", "-l", m.path], check=False)
    judged(s3.get("landed/m.safetensors"), t2, meta2, tmp_path)
    m2 = mount(url, *s3.options)
    assert "another version" not in m2.result.stderr, m2.result.stderr
    assert "no changes" in run("status", m2.path).stdout
    assert s3.uploads() == []


def test_edits_that_undo_each_other_send_nothing(tmp_path, s3, mount, run):
    src = tmp_path / "m.safetensors"
    checkpoint(src)
    url = s3.put(src, "undone/m.safetensors")
    etag = s3.etag("undone/m.safetensors")
    m = mount(url, *s3.options)
    fx.sh(f"mv {m.path}/layer.00 {m.path}/tmp && mv {m.path}/tmp {m.path}/layer.00 && "
          f"touch {m.path}/zz && rm {m.path}/zz")
    assert "no changes" in run("status", m.path).stdout
    s3.reset()
    p = fx.committed(run, m)
    assert "nothing to commit" in p.stdout, p.stdout
    assert [r for r in s3.requests if r["method"] in ("PUT", "POST")] == []
    assert s3.etag("undone/m.safetensors") == etag


@pytest.fixture(scope="module")
def moto_strict(aws_env, tmp_path_factory):
    server = start_moto(tmp_path_factory, {})
    yield server
    server.stop()


def test_the_real_5_mib_part_rule_on_a_larger_object(tmp_path, moto_strict, mount, run, monkeypatch):
    """S3's own minimum (moto's default): a header edit of a 40 MiB object
    sends one 5 MiB part (the header topped up) and copies the rest."""
    monkeypatch.delenv("STFS_S3_MIN_PART", raising=False)
    proxy = FaultProxy(moto_strict.port)
    try:
        rng = np.random.default_rng(3)
        t = {f"w.{i}": rng.integers(0, 255, size=8 * MIB, dtype=np.uint8) for i in range(5)}
        t["tiny"] = np.arange(10, dtype=np.float32)
        src = tmp_path / "big.safetensors"
        save_file(t, str(src))
        client = moto_strict.client()
        client.upload_file(str(src), BUCKET, "big.safetensors")
        m = mount(f"s3://{BUCKET}/big.safetensors", "--endpoint", proxy.url, "--cache-dir",
                  str(tmp_path / "cache"))
        with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
            json.dump({"edited": "yes"}, f)
        fx.sh(f"mv {m.path}/w.2 {m.path}/renamed")
        proxy.reset()
        p = fx.committed(run, m)
        assert "5.0 MiB uploaded" in p.stdout, p.stdout
        body = sum(r["length"] for r in proxy.requests if r["method"] in ("PUT", "POST"))
        assert body <= 5 * MIB + 4096, body
        data = client.get_object(Bucket=BUCKET, Key="big.safetensors")["Body"].read()
        t["renamed"] = t.pop("w.2")
        judged(data, t, {"edited": "yes"}, tmp_path)
        assert client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
        m.close(check=True)
    finally:
        proxy.stop()
