"""
The files the commands write besides checkpoints (reports, JSON, plots): checked before any work, so that a bad path
is a one-line error and not a traceback after an hour of evaluation, and written whole (a temporary file renamed
over the target), so that a killed command never leaves half a file for the next run to choke on.
"""

import os
from pathlib import Path

PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # matplotlib's savefig picks the format from the suffix


class OutputError(ValueError):
    pass


def check_output(path: str | Path, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """path is a file this process can create or replace: its folder exists and takes files, it is not a folder,
    and (where suffixes are given) it ends in one of them. flag names the option in the error, e.g. '--out_json'.
    Raises OutputError naming the problem and the fix."""
    path = Path(path)
    if path.is_dir():
        example = path / f"report.{suffixes[0] if suffixes else 'json'}"
        raise OutputError(f"{flag}={str(path)!r} is a folder; give a file name, e.g. {flag}={example}")
    if suffixes and path.suffix.lstrip(".").lower() not in suffixes:
        raise OutputError(
            f"{flag}={str(path)!r}: the file name must end in {', '.join('.' + s for s in suffixes)} "
            f"(it picks the format), e.g. {flag}={path.with_suffix('.' + suffixes[0])}"
        )
    folder = path.resolve().parent
    if not folder.is_dir():
        raise OutputError(f"{flag}={str(path)!r}: the folder {folder} does not exist; create it, or write elsewhere")
    if problem := cannot_write(folder):
        raise OutputError(f"{flag}={str(path)!r}: cannot write in {folder} ({problem}); write elsewhere")
    return path


def cannot_write(folder: Path, links: bool = False, create: bool = False) -> str | None:
    """Why this process cannot create files in folder (with links, symbolic links too; with create, after making the
    folder and its parents), or None. The one sure test is to try: permissions, read-only mounts, /proc, a
    filesystem without links."""
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


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write data to a temporary file beside path, then rename it over path: a reader (or the next run) finds the old
    file or the new one, never a truncated one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
