"""Who may read and write each file of a mount, against the kernel's own
answers for the source files themselves: over generated owners, groups,
modes and POSIX ACLs (named users and groups, masks, others readable or
not), a folder mount of two shards and an index under `-o allow_other`, and
three users made by the test (two in its group), `access()` is asked of every
file of the mount (tensors, metas, `__metadata__.json`, the index, config.json, the views of
one shard and of all of them) and of every source file it draws on. Nobody
may get more through the mount than every file it draws on gives them; where
no ACL narrows a source and a view draws on files of one owner and group,
they get exactly that (a shard's folder is searched only by those who may
read the shard: the mount's directories have x where they have r). See "Who
may do what" in docs/SEMANTICS.md."""

import json
import os
import pwd
import random
import shutil
import subprocess
import uuid

import numpy as np
import pytest
from safetensors.numpy import save_file

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it makes users and a group")

PROBE = ("import json, os, sys\n"
         "print(json.dumps([[os.access(p, os.R_OK), os.access(p, os.W_OK)] for p in json.load(sys.stdin)]))")


@pytest.fixture
def people():
    """A group and three users (a and c in the group, b not); removed after."""
    tag = uuid.uuid4().hex[:6]
    group = f"stfsg{tag}"
    subprocess.run(["groupadd", group], check=True)
    users = {}
    try:
        for who, groups in (("a", [group]), ("b", []), ("c", [group])):
            name = f"stfs{who}{tag}"
            args = ["useradd", "--no-create-home", "--shell", "/bin/false"]
            if groups:
                args += ["-G", ",".join(groups)]
            subprocess.run(args + [name], check=True)
            users[who] = name
        yield group, users
    finally:
        for name in users.values():
            subprocess.run(["pkill", "-KILL", "-u", name], check=False)
            subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", group], check=False)


def answers(user, paths):
    """(R_OK, W_OK) of each path, as `user` (with its own groups) asks the kernel."""
    pw = pwd.getpwnam(user)
    p = subprocess.run(["python3", "-c", PROBE], input=json.dumps([str(x) for x in paths]),
                       user=pw.pw_uid, group=pw.pw_gid, extra_groups=os.getgrouplist(user, pw.pw_gid),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return [tuple(x) for x in json.loads(p.stdout)]


def a_setup(rng, group, users):
    """Owners, groups, modes and ACLs for shard 0, shard 1, the index and config.json."""
    def one():
        return {"owner": rng.choice(["root", users["a"]]),
                "group": rng.choice([group, "root"]),
                "mode": rng.choice([0o600, 0o640, 0o644, 0o660, 0o664, 0o604, 0o666, 0o620, 0o606]),
                "acl": rng.choice([None, None,
                                   f"u:{users['b']}:r--,g::---,o::---,m::r--",
                                   f"u:{users['c']}:---,o::r--",
                                   f"g:{group}:---,o::r--,m::rw-",
                                   f"u:{users['b']}:rw-,m::r--"])}
    return {"s0": one(), "s1": one(), "index": {**one(), "acl": None}, "config": one()}


def apply(path, how):
    shutil.chown(path, how["owner"], how["group"])
    os.chmod(path, how["mode"])
    if how["acl"]:
        subprocess.run(["setfacl", "-m", how["acl"], str(path)], check=True)


GIVEN = []


@pytest.mark.parametrize("seed", range(30))
def test_the_mount_gives_nobody_more_than_the_sources_give_them(people, stfs, seed):
    if shutil.which("setfacl") is None:
        pytest.fail("setfacl is missing: scripts/setup installs acl")
    group, users = people
    rng = random.Random(seed)
    setup = a_setup(rng, group, users)
    # A folder others can reach, like /tmp (a test's tmp_path is root's alone).
    top = f"/tmp/stfs-perm-{uuid.uuid4().hex[:8]}"
    os.mkdir(top)
    os.chmod(top, 0o755)
    src, mnt = os.path.join(top, "src"), os.path.join(top, "mnt")
    os.mkdir(src)
    os.chmod(src, 0o755)
    os.mkdir(mnt)
    try:
        files = {}
        for k in (0, 1):
            path = os.path.join(src, f"s{k}.safetensors")
            save_file({f"w{k}": np.arange(4, dtype=np.float32) + k}, path, metadata={"k": str(k)})
            files[f"s{k}"] = path
        files["index"] = os.path.join(src, "model.safetensors.index.json")
        with open(files["index"], "w") as f:
            json.dump({"metadata": {"total_size": 32},
                       "weight_map": {"w0": "s0.safetensors", "w1": "s1.safetensors"}}, f)
        files["config"] = os.path.join(src, "config.json")
        with open(files["config"], "w") as f:
            f.write('{"torch_dtype": "float32"}\n')
        for name, path in files.items():
            apply(path, setup[name])
        p = subprocess.run([stfs, "mount", "-o", "allow_other", src, mnt], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        try:
            GIVEN.append(check(users, setup, files, mnt))
        finally:
            subprocess.run([stfs, "umount", mnt], capture_output=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def check(users, setup, files, mnt):
    """Asserts the rule for every user and file; returns how many (user,
    file) pairs the mount let read and write (the test is not vacuous)."""
    # Each file of the mount, what it draws on, and whether it may be written.
    shown = []
    for k in (0, 1):
        shard = [files[f"s{k}"]]
        inside = os.path.join(mnt, f"s{k}")
        for name in (f"w{k}", f"w{k}.meta.json", "__metadata__.json"):
            shown.append((os.path.join(inside, name), shard, True, k))
        views = os.path.join(mnt, "__views__")
        for view in (f"s{k}.safetensors", f"bf16/s{k}.safetensors", f"npy/s{k}/w{k}.npy"):
            shown.append((os.path.join(views, view), shard, False, None))
    both = [files["s0"], files["s1"]]
    shown += [(os.path.join(mnt, "__views__", v), both, False, None)
              for v in ("merged.safetensors", "reshard/5GB/model.safetensors")]
    shown.append((os.path.join(mnt, "__views__", "f16", "model.safetensors.index.json"),
                  both + [files["index"]], False, None))
    shown.append((os.path.join(mnt, "__views__", "model.safetensors.index.json"),
                  both + [files["index"]], False, None))
    shown.append((os.path.join(mnt, "model.safetensors.index.json"), [files["index"]], False, None))
    # A model file is written through the mount as its source may be; its
    # views are read-only.
    shown.append((os.path.join(mnt, "config.json"), [files["config"]], True, None))
    shown.append((os.path.join(mnt, "__views__", "bf16", "config.json"), [files["config"]], False, None))
    narrowed = {files[n] for n in ("s0", "s1", "config") if setup[n]["acl"]}
    sources = sorted({d for _, draws, _, _ in shown for d in draws})
    given = [0, 0]
    for who, user in users.items():
        of_source = dict(zip(sources, answers(user, sources)))
        through = answers(user, [p for p, *_ in shown])
        for (path, draws, writable, shard), (m_r, m_w) in zip(shown, through):
            s_r = all(of_source[d][0] for d in draws)
            s_w = all(of_source[d][1] for d in draws)
            what = f"{who} ({user}), {path} drawing on {[os.path.basename(d) for d in draws]}, {setup}"
            given[0] += m_r
            given[1] += m_w
            assert not m_r or s_r, f"read through the mount, not of the source: {what}"
            assert not m_w or (writable and s_w), f"written through the mount, not the source: {what}"
            if narrowed & set(draws):
                continue  # (an ACL: the mount may give less, never more)
            # A view of files of different owners or groups shows the bits
            # each class gets in all of them: one who reads each by another
            # class (others here, the group there) may be refused.
            if len({(os.stat(d).st_uid, os.stat(d).st_gid) for d in draws}) > 1:
                continue
            # A shard's folder is searched by those who may read the shard.
            reach = shard is None or of_source[files[f"s{shard}"]][0]
            want = (s_r and reach, s_w and writable and reach)
            assert (m_r, m_w) == want, f"{what}: (read, write) {(m_r, m_w)} where the source gives {want}"
    return given


def test_the_generated_setups_let_some_users_in():
    """(After the ones above: some read and some write went through, so the
    comparisons were of something.)"""
    if len(GIVEN) < 30:
        pytest.skip("the generated setups did not all run")
    assert sum(r for r, _ in GIVEN) > 20 and sum(w for _, w in GIVEN) > 5, GIVEN


def as_user(user, cmd):
    pw = pwd.getpwnam(user)
    return subprocess.run(cmd, user=pw.pw_uid, group=pw.pw_gid, extra_groups=os.getgrouplist(user, pw.pw_gid),
                          capture_output=True, text=True, timeout=60)


def test_the_root_keeps_the_folders_sticky_bit(people, stfs):
    """In a folder everyone may write with the sticky bit (as /tmp), only a
    file's owner removes or replaces it: through the mount as in the folder
    itself, which answers first (a twin of it, as the oracle)."""
    group, users = people
    top = f"/tmp/stfs-sticky-{uuid.uuid4().hex[:8]}"
    os.mkdir(top)
    os.chmod(top, 0o755)
    src, twin, mnt = (os.path.join(top, n) for n in ("src", "twin", "mnt"))
    try:
        for folder in (src, twin):
            os.mkdir(folder)
            os.chmod(folder, 0o1777)
            save_file({"w": np.arange(4, dtype=np.float32)}, os.path.join(folder, "s0.safetensors"))
            for name, owner in (("config.json", "a"), ("notes.txt", "b")):
                path = os.path.join(folder, name)
                with open(path, "w") as f:
                    f.write(f"{name}\n")
                shutil.chown(path, users[owner], group)
                os.chmod(path, 0o666)
        os.mkdir(mnt)
        p = subprocess.run([stfs, "mount", "-o", "allow_other", src, mnt], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        try:
            assert os.stat(mnt).st_mode & 0o1777 == 0o1777, oct(os.stat(mnt).st_mode)
            # (who, what, whether the folder itself lets them: the test's own check)
            steps = [("b", ["rm", "-f", "{}/config.json"], False),               # another's file
                     ("b", ["mv", "-f", "{}/notes.txt", "{}/config.json"], False),  # replacing it
                     ("a", ["mv", "-f", "{}/config.json", "{}/c.json"], True),      # its owner's
                     ("b", ["rm", "-f", "{}/notes.txt"], True)]                     # its owner's
            for who, cmd, allowed in steps:
                want = as_user(users[who], [c.format(twin) for c in cmd])
                assert (want.returncode == 0) == allowed, (who, cmd, want.stderr)
                got = as_user(users[who], [c.format(mnt) for c in cmd])
                assert (got.returncode == 0) == allowed, (who, cmd, got.stderr)
                assert sorted(n for n in os.listdir(mnt) if not n.startswith(("s0", "__"))) == \
                    sorted(n for n in os.listdir(twin) if n != "s0.safetensors"), (who, cmd)
        finally:
            subprocess.run([stfs, "umount", "--discard", mnt], capture_output=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)
