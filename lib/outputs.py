"""
The files the commands write besides checkpoints (reports, JSON, plots): checked before any work, so
that a bad path is a one-line error and not a traceback after an hour of evaluation, and written
whole (a temporary file renamed over the target), so that a killed command never leaves half a file
for the next run to choke on.
"""

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

# matplotlib's savefig picks the format from the suffix
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


class OutputError(ValueError):
    pass


def check_output(path: str | Path, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """path is a file this process can create or replace: its folder exists and takes files, it is
    not a folder, and (where suffixes are given) it ends in one of them. flag names the option in
    the error, e.g. '--out_json'. Raises OutputError naming the problem and the fix."""
    path = Path(path)
    if path.is_dir():
        example = path / f"report.{suffixes[0] if suffixes else 'json'}"
        raise OutputError(
            f"{flag}={str(path)!r} is a folder; give a file name, e.g. {flag}={example}"
        )
    if suffixes and path.suffix.lstrip(".").lower() not in suffixes:
        raise OutputError(
            f"{flag}={str(path)!r}: the file name must end in "
            f"{', '.join('.' + s for s in suffixes)} "
            f"(it picks the format), e.g. {flag}={path.with_suffix('.' + suffixes[0])}"
        )
    folder = path.resolve().parent
    if not folder.is_dir():
        raise OutputError(
            f"{flag}={str(path)!r}: the folder {folder} does not exist; create it, "
            "or write elsewhere"
        )
    if problem := cannot_write(folder):
        raise OutputError(
            f"{flag}={str(path)!r}: cannot write in {folder} ({problem}); write elsewhere"
        )
    return path


def cannot_write(folder: Path, links: bool = False, create: bool = False) -> str | None:
    """Why this process cannot create files in folder (with links, symbolic links too; with create,
    after making the folder and its parents), or None. The one sure test is to try: permissions,
    read-only mounts, /proc, a filesystem without links."""
    probe = Path(folder) / f".write_test.{os.getpid()}.tmp"
    try:
        if create:
            probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
        if links:
            probe.symlink_to(".")
            probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return None


def write_atomic(path: str | Path, data: str | bytes | Callable[[BinaryIO], None]) -> None:
    """Write data (or what data(file) writes) to a temporary file beside path, flush it to disk,
    then rename it over path, and make the rename durable: a reader (or the next run) finds the old
    file or the new one, never a truncated one, whenever the process or the machine stops."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def save_figure(fig, path: str | Path, **savefig: object) -> None:
    """A matplotlib figure written whole to path (in the format its suffix names; savefig's options,
    e.g. dpi), then closed: drawn into memory first, then write_atomic, so a killed run leaves the
    old plot or the new, never half."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix[1:].lower(), **savefig)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def fsync_dir(path: Path) -> None:
    """Make the names in a folder durable (a rename, a new entry), as fsync does a file's bytes."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class FolderLock:
    """One process at a time in a folder: an exclusive lock on folder/.lock, which holds the
    holder's process id. The kernel drops the lock when the process ends, killed or not, so a folder
    is never left stuck; release() also removes the file. Not on Windows (no flock), nor on a
    filesystem without locks: there the folder is not guarded. name and user say, in errors, what
    the folder is and what holds it (out_dir=..., a training run); busy, the fix."""

    def __init__(self, folder: Path, name: str, user: str, busy: str):
        self.path = Path(folder) / ".lock"
        self.name = name
        self.user = user
        self.busy = busy
        self.file = None  # the open file whose lock holds the folder

    def acquire(self) -> None:
        """Take the lock, or raise OutputError naming the process that holds it (or a .lock that is
        not a file)."""
        try:
            import fcntl
        except ImportError:
            return
        self.release()
        while True:
            f = self.open()
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                f.close()
                raise OutputError(
                    f"{self.name} is in use by another {self.user} (process {holder}); {self.busy}"
                ) from None
            # a filesystem without locks (some network mounts): the work goes on unguarded
            except OSError:
                f.close()
                return
            # the holder removes the file as it ends: a lock on a removed file holds nothing, so
            # take the new one
            try:
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            f.close()
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.file = f

    def release(self) -> None:
        """Let another process use the folder: remove the lock file (while locked: the folder is
        left as found)."""
        if self.file is not None:
            self.path.unlink(missing_ok=True)
            self.file.close()  # closing the file drops its lock
            self.file = None

    def open(self):
        """.lock opened to read and append, created if missing, never through a link: a link would
        put the lock (and the process id written in it) outside the folder. A folder or a link there
        is an error naming it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError:
            path = self.path
            if not (path.is_symlink() or path.is_dir()):
                raise
            if path.is_symlink():
                what = (
                    f"a link (to {os.readlink(path)}), and a lock file is never put through a link"
                )
                rm = "rm"
            else:
                what = f"a folder, where a {self.user} keeps its lock file"
                rm = "rm -r"
            raise OutputError(
                f"{path} is {what}: move it aside or remove it ({rm} {path}), then run again"
            ) from None
        return os.fdopen(fd, "a+")
