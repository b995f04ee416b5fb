"""Mount, edit and commit safetensors checkpoints from Python.

    import stfs

    with stfs.mount("model.safetensors") as m:          # a temporary mount point
        (m.path / "lm_head.weight").rename(m.path / "output.weight")
        (m.path / "__metadata__.json").write_text('{"format": "pt"}')
        print(m.status().files[0].commit)                # the way the commit will take
    # committed on a clean exit, discarded if the block raised

The `stfs` binary that came with this package does the work; this module runs
it and turns its answers into Python values and its failures into `StfsError`
carrying stfs's message. `stfs.cuda` loads tensors of a mount into GPU memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, Sequence

__all__ = [
    "Change",
    "FileStatus",
    "Mount",
    "Status",
    "StfsError",
    "binary",
    "mount",
    "run",
]

OnExit = Literal["commit", "discard"]


class StfsError(Exception):
    """A stfs command failed; `message` is what stfs said (without its
    "stfs: " prefix), `returncode` its exit status, `args` the command."""

    def __init__(self, message: str, returncode: int, command: Sequence[str]):
        super().__init__(message)
        self.message = message
        self.returncode = returncode
        self.command = list(command)


def binary() -> str:
    """The stfs executable: $STFS_BIN if set, else the one this package was
    installed with (the environment's scripts folder), else `stfs` on PATH."""
    explicit = os.environ.get("STFS_BIN")
    if explicit:
        return explicit
    beside = Path(sysconfig.get_path("scripts")) / "stfs"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    # A user-site or venv install whose scripts folder is elsewhere.
    beside = Path(sys.executable).parent / "stfs"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("stfs")
    if found is None:
        raise StfsError(
            "the stfs executable was not found: install the stfs wheel into this environment "
            "(pip install stfs-*.whl, or pip install . from a clone) or set STFS_BIN",
            127,
            ["stfs"],
        )
    return found


def run(*args: str | os.PathLike[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs `stfs ARGS...` and returns the finished process (text output).
    With `check`, a non-zero exit raises StfsError with stfs's message."""
    command = [binary(), *(os.fspath(a) for a in args)]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise StfsError(_message(done), done.returncode, command)
    return done


def _message(done: subprocess.CompletedProcess[str]) -> str:
    lines = [l.removeprefix("stfs: ") for l in done.stderr.splitlines() if l.strip()]
    return "\n".join(lines) or done.stdout.strip() or f"stfs exited with status {done.returncode}"


@dataclass(frozen=True)
class Change:
    """A staged change: `kind` is renamed, added, removed, reshaped,
    rewritten, metadata, ...; `what` says what changed."""

    kind: str
    what: str


@dataclass(frozen=True)
class FileStatus:
    """One checkpoint file of a mount: its staged changes, the problems a
    commit would refuse, and the way the next commit takes (None when
    nothing is staged)."""

    file: Path
    changes: list[Change]
    problems: list[str]
    commit: str | None
    replaced: bool = False


@dataclass(frozen=True)
class Status:
    """`stfs status` of a mount. `refused` is True when a commit would be
    refused (the problems say why)."""

    refused: bool
    files: list[FileStatus]
    problems_across_shards: list[str] = field(default_factory=list)
    tainted: str | None = None
    reads: int = 0
    read_bytes: int = 0
    remote: str | None = None

    @property
    def changes(self) -> list[Change]:
        """Every staged change, of all files."""
        return [c for f in self.files for c in f.changes]

    @property
    def problems(self) -> list[str]:
        """Every problem a commit would refuse."""
        return [p for f in self.files for p in f.problems] + self.problems_across_shards

    @classmethod
    def from_json(cls, text: str) -> Status:
        d = json.loads(text)
        return cls(
            refused=d["refused"],
            files=[
                FileStatus(
                    file=Path(f["file"]),
                    changes=[Change(c["kind"], c["what"]) for c in f["changes"]],
                    problems=list(f["problems"]),
                    commit=f["commit"],
                    replaced=f["replaced"],
                )
                for f in d["files"]
            ],
            problems_across_shards=list(d["across_shards"]),
            tainted=d["tainted"],
            reads=d["reads"],
            read_bytes=d["read_bytes"],
            remote=d["remote"],
        )


class Mount:
    """A mounted checkpoint. Use it as a context manager (see `mount`), or
    call `unmount` yourself.

    Attributes:
        path: the mount point (a pathlib.Path): the checkpoint's directory.
        source: the checkpoint mounted (a path, or a URL).
        mounted: False once unmounted; then its methods raise StfsError.
        on_exit: what leaving the `with` block does: "commit" or "discard".
    """

    def __init__(self, source: str | os.PathLike[str], path: Path, owns_path: bool, on_exit: OnExit):
        self.source = os.fspath(source)
        self.path = path
        self.on_exit = on_exit
        self._owns_path = owns_path
        self.mounted = True

    def __repr__(self) -> str:
        state = "mounted" if self.mounted else "unmounted"
        return f"<stfs.Mount {self.source} at {self.path} ({state})>"

    @property
    def views(self) -> Path:
        """`__views__` of the mount: `views / "model.safetensors"` is the
        checkpoint as a commit would write it now, `views / "bf16" /
        "model.safetensors"` the same cast to bf16, `views / "npy" / (name +
        ".npy")` a tensor as .npy, `views / "reshard" / "5GB"` shards."""
        return self.path / "__views__"

    def tensors(self) -> list[str]:
        """The tensor files of the mount (file names; see docs/SEMANTICS.md
        for how tensor names map to file names)."""
        self._check_mounted()
        return sorted(
            p.name
            for p in self.path.iterdir()
            if p.is_file() and not p.name.endswith(".meta.json") and p.name != "__metadata__.json"
        )

    def status(self) -> Status:
        """What is staged, what a commit would refuse, and the way it would take."""
        self._check_mounted()
        done = run("status", "--json", self.path, check=False)
        if done.returncode not in (0, 1) or not done.stdout.strip():
            raise StfsError(_message(done), done.returncode, ["stfs", "status", "--json", str(self.path)])
        return Status.from_json(done.stdout)

    def commit(self, compact: bool = False, force: bool = False) -> str:
        """Commits the staged edits into the source; returns stfs's message
        ("...: committed in place (...)"). `compact` writes exactly what the
        reference save_file writes; `force` overwrites a source changed behind
        the mount. Raises StfsError (the edits stay staged) if refused."""
        self._check_mounted()
        args = ["commit", *(["--compact"] if compact else []), *(["--force"] if force else [])]
        return run(*args, self.path).stdout.strip()

    def discard(self) -> str:
        """Drops every staged edit; the mount stays and shows the source again."""
        self._check_mounted()
        return run("discard", self.path).stdout.strip()

    def unmount(self, discard: bool = False, lazy: bool = False) -> str:
        """Commits (or with `discard`, drops) the staged edits and unmounts.
        A refused commit raises StfsError and leaves the mount and its edits
        in place (fix them, or unmount with discard=True). While files of the
        mount are open (an np.memmap still referenced), unmounting fails
        (busy) after the commit; `lazy` detaches the mount at once instead,
        and they keep reading until closed."""
        self._check_mounted()
        args = ["umount", *(["--discard"] if discard else []), *(["--lazy"] if lazy else [])]
        done = run(*args, self.path)
        self.mounted = False
        if self._owns_path:
            self.path.rmdir()
        return done.stdout.strip()

    def _check_mounted(self) -> None:
        if not self.mounted:
            raise StfsError(f"{self.path}: not mounted any more (this Mount was unmounted)", 1, [])

    def __enter__(self) -> Mount:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.mounted:
            return
        # As a transaction: a block that raised commits nothing.
        discard = self.on_exit == "discard" or kind is not None
        try:
            self.unmount(discard=discard)
        except StfsError as e:
            if "busy (files are open in it" not in e.message:
                if kind is None:
                    raise
                # The block's own exception is the one to see; this one is told.
                warnings.warn(f"{self.path}: unmounting after the error failed: {e.message}", stacklevel=2)
                return
            # Committed (or dropped) already; what still holds a file of it
            # (an np.memmap) keeps reading it until it lets go.
            warnings.warn(
                f"{self.path}: files of the mount are still open: detached lazily",
                stacklevel=2,
            )
            self.unmount(discard=discard, lazy=True)


def mount(
    source: str | os.PathLike[str],
    mountpoint: str | os.PathLike[str] | None = None,
    *,
    on_exit: OnExit = "commit",
    read_only: bool = False,
    options: Sequence[str] = (),
) -> Mount:
    """Mounts a checkpoint (a .safetensors file, a folder of shards, or an
    s3:// or https:// URL) and returns the Mount; as a context manager it
    unmounts on exit, committing the staged edits (`on_exit="commit"`, when
    the block did not raise) or dropping them (`on_exit="discard"`, or the
    block raised). Without `mountpoint`, a private temporary folder is made
    and removed after. `options` are more `stfs mount` arguments (for example
    `["--staging-dir", "/fast/disk"]` or `["-o", "cache=keep"]`).

    Raises StfsError (with stfs's message) when the mount fails, and on
    leaving the block when the commit is refused: the mount and its edits
    then stay (fix them, or `m.unmount(discard=True)`)."""
    if on_exit not in ("commit", "discard"):
        raise ValueError(f"on_exit must be 'commit' or 'discard', not {on_exit!r}")
    source_arg = os.fspath(source)
    if "://" not in source_arg:
        source_arg = os.path.abspath(source_arg)
    owns = mountpoint is None
    path = Path(tempfile.mkdtemp(prefix="stfs-")) if mountpoint is None else Path(mountpoint).absolute()
    args = list(options) + (["-o", "ro"] if read_only else [])
    try:
        run("mount", *args, source_arg, path)
    except BaseException:
        if owns:
            # (Not in the way of the error being raised: a folder still
            # mounted, after an interrupt, cannot be removed.)
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    return Mount(source_arg, path, owns, on_exit)
