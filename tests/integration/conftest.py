import errno
import os
import uuid
import pwd
import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "pylib"))
from stfs_fixtures import Mount, stfs_path  # noqa: E402


def stfs_binary():
    path = stfs_path()
    if not os.access(path, os.X_OK):
        pytest.exit(f"stfs binary not found at {path}: build it (cargo build --release) or set STFS", 2)
    return path


@pytest.fixture(scope="session")
def stfs():
    return stfs_binary()


@pytest.fixture
def run(stfs):
    """Runs `stfs ARGS...`, returns the CompletedProcess (text mode)."""

    def _run(*args, check=False, timeout=60):
        p = subprocess.run([stfs, *map(str, args)], capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"stfs {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
        return p

    return _run


def assert_every_write_is_erofs(folder, new, json_file):
    """In mount folder `folder`: "a" opened for writing, `new` created, "a" removed,
    renamed and truncated, and the JSON file `json_file` opened for writing, each EROFS."""
    def at(name):
        return os.path.join(folder, name)

    for write in [lambda: open(at("a"), "r+b"),
                  lambda: open(at(new), "wb"),
                  lambda: os.unlink(at("a")),
                  lambda: os.rename(at("a"), at("z")),
                  lambda: os.truncate(at("a"), 0),
                  lambda: open(at(json_file), "w")]:
        with pytest.raises(OSError) as e:
            write()
        assert e.value.errno == errno.EROFS


@pytest.fixture
def mount(stfs, tmp_path):
    """mount(source, *options) -> Mount. Every mount is unmounted at teardown,
    whether the test passed or not."""
    made = []

    def _mount(source, *options, expect_ok=True, at=None, binary=None, env=None):
        """at: the folder to make the mount point in (default: the test's tmp_path);
        binary: what to run as `stfs mount` (a wrapper), if not stfs itself; env:
        variables set for the mount's daemon alone (a crash, pause or fault point)."""
        mnt = pathlib.Path(at or tmp_path) / f"mnt{len(made)}"
        mnt.mkdir()
        os.chmod(mnt, 0o755)
        m = Mount(binary or stfs, source, mnt, options, tmp_path / f"stfs{len(made)}.log", timeout=60, env=env)
        made.append(m)
        if expect_ok:
            assert m.ok, f"mount failed: {m.result.stderr}"
        return m

    yield _mount
    errors = []
    for m in made:
        try:
            m.close()
        except Exception as e:  # keep unmounting the others
            errors.append(e)
    if errors:
        raise errors[0]


# A second user and a folder like /tmp, for the tests of who may do what.
@pytest.fixture
def user():
    """An unprivileged user made for this test: (name, uid, gid); removed after."""
    name = "stfst" + uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/false", name], check=True)
    pw = pwd.getpwnam(name)
    try:
        yield name, pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], check=False)
        subprocess.run(["userdel", name], check=False)


def as_user(user, *cmd, **kw):
    """Runs a command as the test's user."""
    _, uid, gid = user
    return subprocess.run(list(map(str, cmd)), user=uid, group=gid, extra_groups=[],
                          capture_output=True, text=True, errors="replace", timeout=60, **kw)


@pytest.fixture
def shared():
    """A folder like /tmp: world-writable and sticky; removed after."""
    d = f"/tmp/stfs-shared-{uuid.uuid4().hex[:8]}"
    os.mkdir(d)
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
