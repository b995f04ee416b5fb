"""The other files of a model folder are edited through the mount with any tool
(sed -i, a shell's >, Python, rm, mv, a new file), staged beside the tensors'
edits, listed by `stfs status`, kept by a killed daemon, and committed with the
shards as one change: a kill -9 at each step of the commit leaves the folder
as it was or as the commit leaves it, for the model files and the shards
alike, and the next mount completes it."""

import errno
import json
import os
import pathlib
import signal
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import load_file
from stfs_fixtures import wait_for, wait_for_exit

from test_model_folder import CONFIG, OTHER_FILES, model_folder
from test_remote import BUCKET, moto, s3  # noqa: F401 (fixtures)


def folder_state(folder):
    """Every file of the folder (not hidden, not a staging folder): name -> bytes;
    the shards as their tensors' names."""
    out = {}
    for p in sorted(pathlib.Path(folder).iterdir()):
        if p.name.startswith("."):
            continue
        if p.name.endswith(".safetensors"):
            out[p.name] = sorted(load_file(str(p)))
        else:
            out[p.name] = p.read_bytes()
    return out


def edit_everything(mnt, run):
    """The edits of a user with shell tools: sed -i (temp file + rename), a
    shell's > (truncate + write), rm, mv, a new file, and a tensor renamed in a
    shard, which the index must follow."""
    subprocess.run(["sed", "-i", "s/float32/bfloat16/", "config.json"], cwd=mnt, check=True)
    subprocess.run(["sh", "-c", "printf '{{ m }}' > chat_template.jinja"], cwd=mnt, check=True)
    os.remove(mnt / "README.md")
    os.rename(mnt / "generation_config.json", mnt / "generation.json")
    (mnt / "notes.txt").write_text("new\n")
    shard = sorted(p for p in os.listdir(mnt) if p.startswith("model-"))[0]
    tensor = sorted(n for n in os.listdir(mnt / shard) if not n.endswith(".json"))[0]
    os.rename(mnt / shard / tensor, mnt / shard / "renamed")
    return tensor


def expected_after(before, tensor):
    after = dict(before)
    after["config.json"] = CONFIG.replace("float32", "bfloat16").encode()
    after["chat_template.jinja"] = b"{{ m }}"
    del after["README.md"]
    after["generation.json"] = after.pop("generation_config.json")
    after["notes.txt"] = b"new\n"
    for name, tensors in after.items():
        if name.endswith(".safetensors") and tensor in tensors:
            after[name] = sorted([t for t in tensors if t != tensor] + ["renamed"])
    index = json.loads(after["model.safetensors.index.json"])
    index["weight_map"]["renamed"] = index["weight_map"].pop(tensor)
    return after, index


def test_model_files_are_edited_with_any_tool_and_committed_with_the_shards(tmp_path, mount, run):
    folder = tmp_path / "model"
    model_folder(folder)
    before = folder_state(folder)
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    tensor = edit_everything(mnt, run)
    after, index = expected_after(before, tensor)
    # The mount shows the edits; the folder has none of them yet.
    shown = sorted(p for p in os.listdir(mnt) if not p.startswith("model-"))
    assert shown == sorted(n for n in after if not n.startswith("model-")), shown
    for name in ("config.json", "chat_template.jinja", "notes.txt", "generation.json"):
        assert (mnt / name).read_bytes() == after[name], name
    assert folder_state(folder) == before
    # The views are model folders of the edited model.
    assert (mnt / "__views__/notes.txt").read_bytes() == b"new\n"
    assert not (mnt / "__views__/README.md").exists()
    assert (mnt / "__views__/config.json").read_bytes() == after["config.json"]
    assert b'"torch_dtype": "float16"' in (mnt / "__views__/f16/config.json").read_bytes()
    status = run("status", m.path)
    assert status.returncode == 0, status.stderr
    for kind, name in [("changed", "config.json"), ("changed", "chat_template.jinja"), ("removed", "README.md"),
                       ("removed", "generation_config.json"), ("added", "generation.json"), ("added", "notes.txt")]:
        assert f"{kind:<10} {name}" in status.stdout, (kind, name, status.stdout)
    assert "sed" not in status.stdout  # (sed's temp file was renamed over config.json)
    done = run("commit", m.path)
    assert done.returncode == 0, done.stderr
    got = folder_state(folder)
    assert json.loads(got.pop("model.safetensors.index.json"))["weight_map"] == index["weight_map"]
    after.pop("model.safetensors.index.json")
    assert got == after
    # A new file is owned as the folder's shards are, with the mode it was made with.
    shard = next(folder.glob("model-*.safetensors")).stat()
    notes = (folder / "notes.txt").stat()
    assert (notes.st_uid, notes.st_gid, notes.st_mode & 0o7777) == (shard.st_uid, shard.st_gid,
                                                                    0o666 & ~current_umask())
    # An edited file keeps its own mode; nothing is staged after the commit.
    assert (folder / "config.json").stat().st_mode & 0o7777 == 0o644
    assert (folder / "README.md").exists() is False
    assert "model file" not in run("status", m.path).stdout
    m.close()
    # A later mount shows the folder as committed, with nothing staged.
    m2 = mount(folder)
    assert (pathlib.Path(m2.path) / "config.json").read_bytes() == after["config.json"]
    assert "model file" not in run("status", m2.path).stdout


def test_a_discard_puts_the_model_files_back(tmp_path, mount, run):
    folder = tmp_path / "model"
    model_folder(folder)
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    edit_everything(mnt, run)
    assert run("discard", m.path).returncode == 0
    assert sorted(os.listdir(mnt)) == sorted(["model-00001-of-00002", "model-00002-of-00002",
                                              "model.safetensors.index.json", *OTHER_FILES])
    for name, text in OTHER_FILES.items():
        assert (mnt / name).read_text() == text, name
    assert "model file" not in run("status", m.path).stdout
    m.close()
    assert [p.name for p in tmp_path.iterdir() if ".stfs-" in p.name] == []


def test_staged_model_files_outlive_a_killed_daemon(tmp_path, mount, run):
    folder = tmp_path / "model"
    model_folder(folder)
    before = folder_state(folder)
    m = mount(folder)
    tensor = edit_everything(pathlib.Path(m.path), run)
    os.kill(m.pid, signal.SIGKILL)  # kill -9 of the daemon: nothing committed
    wait_for_exit(m.pid, 20)
    m.close()
    assert folder_state(folder) == before
    m2 = mount(folder)
    assert "took back 6 staged model files" in m2.result.stderr + m2.result.stdout, m2.result
    assert (pathlib.Path(m2.path) / "notes.txt").read_text() == "new\n"
    assert run("commit", m2.path).returncode == 0
    after, index = expected_after(before, tensor)
    got = folder_state(folder)
    assert json.loads(got.pop("model.safetensors.index.json"))["weight_map"] == index["weight_map"]
    after.pop("model.safetensors.index.json")
    assert got == after


# Each step of a folder commit, and what a kill -9 there leaves before the next
# mount: the folder as it was (with the edits staged, or the record that makes
# the next mount finish the commit), part of it landed, or all of it.
KILL_STEPS = [("rewrite:written", "old"), ("land:recorded", "recorded"), ("land:renamed", "partly"),
              ("in-place:landed", "new")]


@pytest.mark.parametrize("step,left", KILL_STEPS)
def test_a_commit_killed_at_each_step_lands_model_files_and_shards_together(tmp_path, mount, run, step, left):
    """kill -9 (STFS_CRASH_AT, not a timed kill) at each step of a commit of a
    renamed tensor and edited model files: before the record, the folder is as it
    was; after it, the next mount finishes the commit, model files and shards
    alike (never one without the other)."""
    folder = tmp_path / "model"
    model_folder(folder)
    before = folder_state(folder)
    m = mount(folder, env={"STFS_CRASH_AT": step})
    tensor = edit_everything(pathlib.Path(m.path), run)
    after, index = expected_after(before, tensor)
    assert run("commit", m.path).returncode != 0, f"the daemon did not stop at {step}"
    m.close()
    got = folder_state(folder)
    if left in ("old", "recorded"):
        assert got == before, step
    elif left == "new":
        got.pop("model.safetensors.index.json")
        assert got == {k: v for k, v in after.items() if k != "model.safetensors.index.json"}, step
    m2 = mount(folder)
    if left == "old":
        # The edits are staged still, and the next commit makes them.
        assert "notes.txt" in run("status", m2.path).stdout
        assert run("commit", m2.path).returncode == 0
    got = folder_state(folder)
    assert json.loads(got.pop("model.safetensors.index.json"))["weight_map"] == index["weight_map"], step
    after.pop("model.safetensors.index.json")
    assert got == after, step
    assert "model file" not in run("status", m2.path).stdout
    m2.close()
    leftovers = [p.name for p in folder.iterdir() if ".stfs-" in p.name]
    assert leftovers == [], leftovers


def test_what_the_root_refuses(tmp_path, mount, run):
    """Shards, indexes and weights of other formats are not made at the root; an
    index is not edited; a file changed in the folder since the mount refuses the
    commit (ESTALE) and stays staged, as a shard's edits do."""
    folder = tmp_path / "model"
    model_folder(folder)
    with open(folder / "vocab.txt", "wb") as f:  # over 64 MiB: not shown
        f.truncate(65 << 20)
    (folder / "onnx").mkdir()
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    assert "vocab.txt: not shown in the mount" in m.result.stderr, m.result.stderr
    # A name the folder has but the mount does not show is not made there
    # (a commit would replace the folder's file), nor moved to.
    for name in ("vocab.txt", "onnx"):
        with pytest.raises(OSError) as e:
            open(mnt / name, "w").close()
        assert e.value.errno == errno.EPERM, name
        with pytest.raises(OSError) as e:
            os.rename(mnt / "README.md", mnt / name)
        assert e.value.errno == errno.EPERM, name
    assert (folder / "vocab.txt").stat().st_size == 65 << 20
    # (An index is shown without write bits: a user other than root meets
    # the kernel's EACCES first, root stfs's EROFS.)
    index_refused = errno.EROFS if os.geteuid() == 0 else errno.EACCES
    for name, want in [("new.safetensors", errno.EPERM), ("x.index.json", errno.EPERM),
                       ("w.bin", errno.EPERM), ("model.safetensors.index.json", index_refused)]:
        with pytest.raises(OSError) as e:
            open(mnt / name, "w").close()
        assert e.value.errno == want, name
    with pytest.raises(OSError) as e:
        os.rename(mnt / "config.json", mnt / "model-00001-of-00002" / "config")
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError) as e:
        os.rename(mnt / "config.json", mnt / "model-00001-of-00002")
    assert e.value.errno in (errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY)
    assert not any(".stfs-" in p.name for p in tmp_path.iterdir())  # nothing staged by a refusal
    (mnt / "config.json").write_text("{}\n")
    (folder / "config.json").write_text('{"theirs": 1}\n')  # another program, in the folder
    status = run("status", m.path)
    assert "the source changed since it was mounted" in status.stdout, status.stdout
    p = run("commit", m.path)
    assert p.returncode != 0 and "config.json" in p.stderr, p.stderr
    assert (folder / "config.json").read_text() == '{"theirs": 1}\n'
    assert (mnt / "config.json").read_text() == "{}\n"  # staged still
    assert run("commit", "--force", m.path).returncode == 0
    assert (folder / "config.json").read_text() == "{}\n"


def test_editors_and_in_place_tools_edit_a_model_file(tmp_path, mount, run):
    """vim (its swap file, its backup, its write), perl -i, ed, and an mmap'd
    write each leave the file as the tool wrote it, and nothing else staged."""
    folder = tmp_path / "model"
    model_folder(folder)
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    subprocess.run(["vim", "-u", "NONE", "-i", "NONE", "-N", "-es", "-c", "%s/float32/bfloat16/", "-c", "wq",
                    "config.json"], cwd=mnt, check=True, timeout=60)
    subprocess.run(["perl", "-pi", "-e", "s/BPE/WordPiece/", "tokenizer.json"], cwd=mnt, check=True)
    subprocess.run(["ed", "-s", "README.md"], input="1s/tiny/small/\nw\nq\n", text=True, cwd=mnt, check=True)
    import mmap
    with open(mnt / "chat_template.jinja", "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[:2] = b"{#"
        mm.flush()
    status = run("status", m.path).stdout
    changed = sorted(line.split()[1] for line in status.splitlines() if line.startswith("  changed "))
    assert changed == ["README.md", "chat_template.jinja", "config.json", "tokenizer.json"], status
    assert "added" not in status and "removed" not in status, status
    assert run("commit", m.path).returncode == 0
    assert (folder / "config.json").read_text() == CONFIG.replace("float32", "bfloat16")
    assert "WordPiece" in (folder / "tokenizer.json").read_text()
    assert (folder / "README.md").read_text().startswith("# small")
    assert (folder / "chat_template.jinja").read_text().startswith("{#")
    # (Nothing of the tools' own files: swap, backup, temp. The staging
    # folder stays until the unmount.)
    assert sorted(p.name for p in folder.iterdir() if ".stfs-" not in p.name) == sorted(["model-00001-of-00002.safetensors",
                                                              "model-00002-of-00002.safetensors",
                                                              "model.safetensors.index.json", ".gitattributes",
                                                              *OTHER_FILES])


def test_a_hub_snapshot_link_is_replaced_by_a_file(tmp_path, mount, run):
    """A snapshot's config.json is a link into blobs: the commit puts a file in
    its place and leaves the blob as it is (other snapshots share it)."""
    folder = tmp_path / "snap"
    model_folder(folder)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    os.rename(folder / "config.json", blobs / "abc")
    os.symlink("../blobs/abc", folder / "config.json")
    m = mount(folder)
    (pathlib.Path(m.path) / "config.json").write_text("{}\n")
    assert run("commit", m.path).returncode == 0
    assert not (folder / "config.json").is_symlink()
    assert (folder / "config.json").read_text() == "{}\n"
    assert (blobs / "abc").read_text() == CONFIG


def test_an_edit_made_while_a_commit_writes_survives_its_crash(tmp_path, mount, run):
    """A commit takes notes.txt; while it writes (paused there), rm notes.txt is made
    and acknowledged; the daemon is killed after the commit's first file landed.
    The next mount finishes the commit (notes.txt lands) and keeps the rm staged:
    a commit after it removes the file (the rm is never lost)."""
    folder = tmp_path / "model"
    model_folder(folder)
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    m = mount(folder, env={"STFS_PAUSE_AT": "commit:written", "STFS_PAUSE_DIR": str(pauses),
                           "STFS_CRASH_AT": "land:renamed"})
    mnt = pathlib.Path(m.path)
    (mnt / "notes.txt").write_text("A\n")
    (mnt / "config.json").write_text("{}\n")
    commit = subprocess.Popen([m.stfs, "commit", m.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (pauses / "commit:written").exists(), "the commit paused once written")
        os.remove(mnt / "notes.txt")  # acknowledged while the commit holds the file
        (pauses / "commit:written").unlink()
        assert commit.wait(60) != 0  # the daemon died at land:renamed
    finally:
        (pauses / "go-all").touch()
        commit.kill()
    m.close()
    m2 = mount(folder)
    assert (folder / "config.json").read_text() == "{}\n"  # the commit finished whole
    assert not (pathlib.Path(m2.path) / "notes.txt").exists()
    assert "removed    notes.txt" in run("status", m2.path).stdout
    assert run("commit", m2.path).returncode == 0
    assert not (folder / "notes.txt").exists()


def test_hidden_files_made_at_the_root_are_scratch(tmp_path, mount, run):
    """An editor's swap file (.config.json.swp) lives in the mount's memory: never
    staged or committed (`stfs status` says so); renamed to a model name it
    becomes that file."""
    folder = tmp_path / "model"
    model_folder(folder)
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    (mnt / ".config.json.swp").write_bytes(b"swap")
    assert (mnt / ".config.json.swp").read_bytes() == b"swap"
    status = run("status", m.path).stdout
    assert "1 hidden file made at the root, in memory only (never staged or committed; gone at " \
           "unmount): .config.json.swp" in status, status
    assert "model file change" not in status, status
    (mnt / ".new.tmp").write_text("{}\n")
    os.rename(mnt / ".new.tmp", mnt / "config.json")
    assert run("commit", m.path).returncode == 0
    assert (folder / "config.json").read_text() == "{}\n"
    assert not (folder / ".config.json.swp").exists()
    m.close()
    assert not any(".stfs-" in p.name for p in folder.iterdir())


def test_a_view_of_a_model_file_follows_its_edits(tmp_path, mount):
    folder = tmp_path / "model"
    model_folder(folder)
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    for view in ("__views__/config.json", "__views__/bf16/config.json", "__views__/reshard/5GB/config.json"):
        assert b"float32" in (mnt / view).read_bytes() or b"bfloat16" in (mnt / view).read_bytes()
    subprocess.run(["sed", "-i", "s/64/128/", "config.json"], cwd=mnt, check=True)
    for view in ("__views__/config.json", "__views__/bf16/config.json", "__views__/reshard/5GB/config.json"):
        assert b'"hidden_size": 128' in (mnt / view).read_bytes(), view
    os.remove(mnt / "README.md")
    assert not (mnt / "__views__/bf16/README.md").exists()


def test_a_read_only_mount_and_no_resume(tmp_path, mount, run):
    """-o ro: every edit at the root is EROFS. --no-resume leaves an earlier mount's
    staged model files on disk (never removes them), and the next mount takes them."""
    folder = tmp_path / "model"
    model_folder(folder)
    ro = mount(folder, "-o", "ro")
    for how in (lambda p: open(p / "config.json", "a"), lambda p: open(p / "new.txt", "w"),
                lambda p: os.remove(p / "README.md"), lambda p: os.rename(p / "README.md", p / "x.md")):
        with pytest.raises(OSError) as e:
            how(pathlib.Path(ro.path))
        assert e.value.errno in (errno.EROFS, errno.EACCES), e.value
    ro.close()
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    shard = sorted(p for p in os.listdir(mnt) if p.startswith("model-"))[0]
    tensor = sorted(n for n in os.listdir(mnt / shard) if not n.endswith(".json"))[0]
    os.rename(mnt / shard / tensor, mnt / shard / "renamed")
    assert run("commit", m.path).returncode == 0  # (its journal stays, spent)
    (mnt / "config.json").write_text("{}\n")
    os.kill(m.pid, signal.SIGKILL)
    wait_for_exit(m.pid, 20)
    m.close()
    kept = mount(folder, "--no-resume")
    assert "left as they are" in kept.result.stderr + kept.result.stdout, kept.result
    assert (pathlib.Path(kept.path) / "config.json").read_text() == CONFIG
    kept.close(discard=True)
    m2 = mount(folder)
    assert (pathlib.Path(m2.path) / "config.json").read_text() == "{}\n"


# A model folder in a store: the same edits, put and deleted under the same
# record as the shards and the index.

def store_state(s3, prefix):
    """Every object under `prefix` (not hidden): name -> bytes; the shards as
    their tensors' names."""
    out = {}
    listed = s3.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/").get("Contents", [])
    for o in listed:
        name = o["Key"][len(prefix) + 1:]
        if name.startswith("."):
            continue
        body = s3.client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
        out[name] = sorted(safetensors_load(body)) if name.endswith(".safetensors") else body
    return out


def folder_in_store(s3, tmp_path, prefix):
    folder = tmp_path / prefix
    model_folder(folder)
    for f in folder.iterdir():
        s3.upload(f, f"{prefix}/{f.name}")
    return folder_state(folder), f"s3://{BUCKET}/{prefix}/"


def assert_committed(got, after, index):
    got = dict(got)
    assert json.loads(got.pop("model.safetensors.index.json"))["weight_map"] == index["weight_map"]
    assert got == {k: v for k, v in after.items() if k != "model.safetensors.index.json"}


KEPT = {"ContentType": "application/json", "CacheControl": "max-age=60", "Metadata": {"owner": "team-a"}}


def kept_headers(s3, key):
    head = s3.client.head_object(Bucket=BUCKET, Key=key)
    return {k: head.get(k) for k in KEPT}


def test_model_files_of_a_folder_in_a_store_are_edited_and_committed_with_the_shards(tmp_path, s3, mount, run):
    before, url = folder_in_store(s3, tmp_path, "edited")
    # The objects' own headers (type, cache policy, user metadata): every
    # object a commit rewrites keeps them.
    shards = sorted(n for n in before if n.endswith(".safetensors"))
    rewritten = ["config.json", "model.safetensors.index.json", shards[0]]
    for name in rewritten:
        key = f"edited/{name}"
        s3.client.copy_object(Bucket=BUCKET, Key=key, CopySource={"Bucket": BUCKET, "Key": key},
                              MetadataDirective="REPLACE", **KEPT)
    m = mount(url, *s3.options)
    mnt = pathlib.Path(m.path)
    assert oct(os.stat(mnt / "config.json").st_mode & 0o777) == oct(0o644)
    tensor = edit_everything(mnt, run)
    after, index = expected_after(before, tensor)
    assert store_state(s3, "edited") == before
    status = run("status", m.path)
    assert status.returncode == 0, status.stderr
    for kind, name in [("changed", "config.json"), ("removed", "README.md"), ("added", "notes.txt")]:
        assert f"{kind:<10} {name}" in status.stdout, (kind, name, status.stdout)
    s3.reset()
    done = run("commit", m.path)
    assert done.returncode == 0, done.stderr
    assert f"{url}notes.txt: written" in done.stdout and f"{url}README.md: removed" in done.stdout, done.stdout
    assert_committed(store_state(s3, "edited"), after, index)
    for name in rewritten:
        assert kept_headers(s3, f"edited/{name}") == KEPT, name
    # Each is conditional: a changed file over the version mounted, a new one
    # only where nothing is, a removal of the version mounted.
    writes = {r["path"].rsplit("/", 1)[-1]: r for r in s3.requests if r["method"] in ("PUT", "DELETE")}
    assert writes["config.json"]["headers"].get("if-match"), writes["config.json"]
    assert writes["notes.txt"]["headers"].get("if-none-match") == "*", writes["notes.txt"]
    assert writes["README.md"]["method"] == "DELETE" and writes["README.md"]["headers"].get("if-match")
    assert "model file" not in run("status", m.path).stdout
    # Edited again over what the commit left (its ETags are the new ones).
    (mnt / "notes.txt").write_text("newer\n")
    # A name with characters a URL path encodes is that key, not an encoding of it.
    (mnt / "config.json~").write_text("backup\n")
    assert run("commit", m.path).returncode == 0
    assert s3.client.get_object(Bucket=BUCKET, Key="edited/notes.txt")["Body"].read() == b"newer\n"
    assert s3.client.get_object(Bucket=BUCKET, Key="edited/config.json~")["Body"].read() == b"backup\n"
    (mnt / "config.json~").write_text("backup 2\n")
    assert run("commit", m.path).returncode == 0, "an object of such a name is found again"
    assert s3.client.get_object(Bucket=BUCKET, Key="edited/config.json~")["Body"].read() == b"backup 2\n"
    m.close()
    m2 = mount(url, *s3.options)
    assert (pathlib.Path(m2.path) / "config.json").read_bytes() == after["config.json"]
    assert "model file" not in run("status", m2.path).stdout


def test_a_model_file_changed_in_the_store_refuses_the_commit_and_loses_nothing(tmp_path, s3, mount, run):
    before, url = folder_in_store(s3, tmp_path, "raced")
    m = mount(url, *s3.options)
    mnt = pathlib.Path(m.path)
    (mnt / "config.json").write_text("{}\n")
    (mnt / "tokenizer.json").write_text("{}\n")
    (mnt / "notes.txt").write_text("mine\n")
    s3.client.put_object(Bucket=BUCKET, Key="raced/tokenizer.json", Body=b"theirs")
    s3.client.put_object(Bucket=BUCKET, Key="raced/notes.txt", Body=b"a new name taken")
    status = run("status", m.path)
    for name in ("tokenizer.json", "notes.txt"):
        assert f"{url}{name}: the source changed since it was mounted" in status.stdout, status.stdout
    p = run("commit", m.path)
    assert p.returncode != 0 and "changed since it was mounted" in p.stderr, p.stderr
    now = store_state(s3, "raced")
    assert now == {**before, "tokenizer.json": b"theirs", "notes.txt": b"a new name taken"}
    assert (mnt / "config.json").read_text() == "{}\n"
    # --force puts the mount's files over whatever is there.
    assert run("commit", "--force", m.path).returncode == 0
    now = store_state(s3, "raced")
    assert now["tokenizer.json"] == b"{}\n" and now["config.json"] == b"{}\n" and now["notes.txt"] == b"mine\n"


@pytest.mark.parametrize("fault,landed", [("remote:model:EIO", 0), ("remote:model:EIO:3", 2)])
def test_a_folder_commit_whose_model_file_fails_is_finished_by_the_next_mount(tmp_path, s3, mount, run, fault,
                                                                                landed):
    """The shards and the index landed, then a model file's PUT or DELETE failed:
    the commit says so, and the next mount finishes it from its record (the
    bytes kept in the staging folder), so the store is never left with new
    tensors and an old config."""
    prefix = f"failed{landed}"
    before, url = folder_in_store(s3, tmp_path, prefix)
    m = mount(url, *s3.options, env={"STFS_FAULT_AT": fault})
    tensor = edit_everything(pathlib.Path(m.path), run)
    after, index = expected_after(before, tensor)
    p = run("commit", m.path)
    assert p.returncode != 0, p.stdout
    now = store_state(s3, prefix)
    changed = [n for n in ("chat_template.jinja", "config.json", "generation.json", "generation_config.json",
                           "notes.txt", "README.md") if now.get(n) != before.get(n)]
    assert len(changed) == landed, (changed, p.stderr)
    m.close()
    m2 = mount(url, *s3.options)
    assert "finished a commit that was interrupted" in m2.result.stderr, m2.result.stderr
    assert_committed(store_state(s3, prefix), after, index)
    assert "model file" not in run("status", m2.path).stdout
    cache = tmp_path / "cache"
    assert not [p for p in cache.rglob("body-*")], list(cache.rglob("*"))


def test_a_daemon_killed_before_a_model_file_lands_leaves_the_rest_to_the_next_mount(tmp_path, s3, mount, run):
    before, url = folder_in_store(s3, tmp_path, "killed")
    m = mount(url, *s3.options, env={"STFS_CRASH_AT": "remote:model"})
    tensor = edit_everything(pathlib.Path(m.path), run)
    after, index = expected_after(before, tensor)
    assert run("commit", m.path).returncode != 0
    wait_for_exit(m.pid, 20)
    now = store_state(s3, "killed")
    assert now["config.json"] == before["config.json"] and "notes.txt" not in now
    assert now["model.safetensors.index.json"] != before["model.safetensors.index.json"]
    m.close()
    m2 = mount(url, *s3.options)
    assert "finished a commit that was interrupted" in m2.result.stderr, m2.result.stderr
    assert_committed(store_state(s3, "killed"), after, index)
    assert "model file" not in run("status", m2.path).stdout


def test_a_forced_commit_of_a_removal_whose_file_is_gone_is_done(tmp_path, mount, run):
    """rm through the mount of a file that another program also removed from the
    folder: the commit says the folder changed (nothing lost), and --force
    commits the rest, the removal being done already."""
    folder = tmp_path / "model"
    model_folder(folder)
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    os.remove(mnt / "README.md")
    (mnt / "notes.txt").write_text("new\n")
    os.remove(folder / "README.md")
    p = run("commit", m.path)
    assert p.returncode != 0 and "README.md" in p.stderr, p.stderr
    assert not (folder / "notes.txt").exists()
    p = run("commit", "--force", m.path)
    assert p.returncode == 0, p.stderr
    assert (folder / "notes.txt").read_text() == "new\n" and not (folder / "README.md").exists()
    assert "model file" not in run("status", m.path).stdout


def test_staged_model_files_of_a_folder_in_a_store_outlive_a_killed_daemon(tmp_path, s3, mount, run):
    before, url = folder_in_store(s3, tmp_path, "outlive")
    m = mount(url, *s3.options)
    tensor = edit_everything(pathlib.Path(m.path), run)
    os.kill(m.pid, signal.SIGKILL)  # kill -9 of the daemon: nothing committed
    wait_for_exit(m.pid, 20)
    m.close()
    assert store_state(s3, "outlive") == before
    m2 = mount(url, *s3.options)
    assert "took back 6 staged model files" in m2.result.stderr + m2.result.stdout, m2.result
    assert (pathlib.Path(m2.path) / "notes.txt").read_text() == "new\n"
    assert run("commit", m2.path).returncode == 0
    after, index = expected_after(before, tensor)
    assert_committed(store_state(s3, "outlive"), after, index)


def test_a_new_file_keeps_the_mode_it_was_made_with(tmp_path, mount, run):
    """A file made at the root gets the mode its maker asked for (umask
    applied, never a set-id bit), shown at once and kept by the commit: a
    private file never lands readable by others."""
    folder = tmp_path / "model"
    model_folder(folder)
    for shard in folder.glob("model-*.safetensors"):
        os.chmod(shard, 0o644)
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    subprocess.run(["sh", "-c", f"umask 077 && echo secret > {mnt}/private.txt"], check=True)
    fd = os.open(mnt / "tool.sh", os.O_CREAT | os.O_WRONLY, 0o4755)
    os.close(fd)
    assert os.stat(mnt / "private.txt").st_mode & 0o7777 == 0o600
    assert os.stat(mnt / "tool.sh").st_mode & 0o7777 == 0o755 & ~current_umask()
    assert run("commit", m.path).returncode == 0
    assert (folder / "private.txt").stat().st_mode & 0o7777 == 0o600
    assert (folder / "tool.sh").stat().st_mode & 0o7777 == 0o755 & ~current_umask()


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_name_in_the_store_the_mount_does_not_show_is_not_made_there(tmp_path, s3, mount):
    """An object over the size limit is left out of the mount, and its name
    is refused at the root as a local folder's is: a commit would replace it."""
    _, url = folder_in_store(s3, tmp_path, "hidden")
    big = b"\0" * (65 << 20)
    s3.client.put_object(Bucket=BUCKET, Key="hidden/vocab.txt", Body=big)
    m = mount(url, *s3.options)
    mnt = pathlib.Path(m.path)
    assert f"{url}vocab.txt: not shown in the mount" in m.result.stderr, m.result.stderr
    with pytest.raises(OSError) as e:
        open(mnt / "vocab.txt", "w").close()
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError) as e:
        os.rename(mnt / "README.md", mnt / "vocab.txt")
    assert e.value.errno == errno.EPERM
    (mnt / "vocab2.txt").write_text("a name the store does not have\n")
    assert s3.client.head_object(Bucket=BUCKET, Key="hidden/vocab.txt")["ContentLength"] == len(big)


def test_a_model_file_put_refused_by_its_condition_says_whose_version_stands(tmp_path, s3, mount, run):
    """A 412 on a model file's PUT (the store's answer to If-Match) says what it
    means for that file: another writer's version stands (not a shard's "--force
    cannot rebuild": a model file is put whole). Here the 412 was the proxy's,
    so the next mount finds the version mounted and finishes the commit."""
    before, url = folder_in_store(s3, tmp_path, "refused")
    m = mount(url, *s3.options)
    tensor = edit_everything(pathlib.Path(m.path), run)
    after, index = expected_after(before, tensor)
    s3.rule = lambda r: 412 if r["method"] == "PUT" and r["path"].endswith("/config.json") else None
    p = run("commit", m.path)
    s3.rule = None
    assert p.returncode != 0, p.stdout
    assert "config.json: another writer changed this object" in p.stderr, p.stderr
    assert "--force cannot" not in p.stderr, p.stderr
    m.close()
    m2 = mount(url, *s3.options)
    assert "finished a commit that was interrupted" in m2.result.stderr, m2.result.stderr
    assert_committed(store_state(s3, "refused"), after, index)
