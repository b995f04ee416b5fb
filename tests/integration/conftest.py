import os
import signal
import time
import uuid
import pwd
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def stfs_binary():
    path = os.environ.get("STFS") or str(ROOT / "target" / "release" / "stfs")
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


class Mount:
    """A live stfs mount made by a test; `close()` always leaves nothing behind."""

    def __init__(self, stfs, source, mountpoint, options, log):
        self.stfs, self.source, self.path, self.log = stfs, str(source), str(mountpoint), log
        self.pid_file = str(log) + ".pid"
        self.pid = None
        cmd = [stfs, "mount", "--pid-file", self.pid_file, "--log-file", str(log), *options, self.source, self.path]
        self.result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if self.result.returncode == 0:
            with open(self.pid_file) as f:
                self.pid = int(f.read())

    @property
    def ok(self):
        return self.result.returncode == 0

    def is_mounted(self):
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == self.path for line in f)

    def close(self):
        if self.is_mounted():
            p = subprocess.run([self.stfs, "umount", self.path], capture_output=True, text=True, timeout=60)
            if p.returncode != 0 and self.is_mounted():
                subprocess.run(["umount", "-l", self.path], timeout=60)  # last resort
        if self.pid is not None:
            wait_for_exit(self.pid, 20)
        assert not self.is_mounted(), f"{self.path} is still mounted"


def wait_for_exit(pid, seconds):
    """Waits for a daemon this test started to exit; kills it by pid if it hangs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"stfs daemon {pid} did not exit after unmount; killed")


@pytest.fixture
def mount(stfs, tmp_path):
    """mount(source, *options) -> Mount. Every mount is unmounted at teardown,
    whether the test passed or not."""
    made = []

    def _mount(source, *options, expect_ok=True, at=None, binary=None):
        """at: the folder to make the mount point in (default: the test's tmp_path);
        binary: what to run as `stfs mount` (a wrapper), if not stfs itself."""
        mnt = pathlib.Path(at or tmp_path) / f"mnt{len(made)}"
        mnt.mkdir()
        os.chmod(mnt, 0o755)
        m = Mount(str(binary or stfs), source, mnt, options, tmp_path / f"stfs{len(made)}.log")
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
