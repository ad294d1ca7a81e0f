"""The files of run folders and generation folders, and the faults they meet: a process killed mid-write,
a full disk, a second process on the same folder, a file damaged by a broken copy.

Writes are atomic (:func:`atomic_path`, :func:`append_line`), a full disk is a :class:`DiskFullError`, one
process writes a folder at a time (:func:`lock_folder`), reads drop an unfinished last row and name a broken one
(:func:`read_jsonl`), and images and videos load as tensors (:func:`load_image_files`, :func:`load_video`). The
rules: docs/experiments.md, "3. Run the ablation", "Kills, full disks, broken files", and "8. Video pipelines".
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import re
import shutil
import socket
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DamagedFileError, DiskFullError, FolderInUseError, is_disk_full

if TYPE_CHECKING:
    from torch import Tensor

LOCK_FILE = "tomerge.lock"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk: length 0, type, CRC; the last 12 bytes of a PNG
_TEMP_NAME = re.compile(r"^\..+\.tmp\d+$")  # .NAME.tmpPID (atomic_path)


# ------------------------------------------------------------------------------------- writing
@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turns "no space left" (and "quota exceeded") inside into a :class:`DiskFullError` naming ``path``."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        if not is_disk_full(err):
            raise
        what = "no space left on device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        raise DiskFullError(err.errno, f"{what} writing {path}; what was finished before is kept: free some "
                                       "space and rerun the same command to resume") from err


def temp_path(path: str | os.PathLike) -> Path:
    """Where :func:`atomic_path` writes ``path`` before renaming it: ``.NAME.tmpPID`` next to it."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write ``path`` to (a file, or a folder the caller creates); on success it is
    renamed to ``path`` (replacing a file there), on any error or interrupt it is removed.

    Example:
        >>> import tempfile; folder = Path(tempfile.mkdtemp())
        >>> with atomic_path(folder / "a.txt") as tmp:
        ...     _ = tmp.write_text("whole")
        >>> sorted(p.name for p in folder.iterdir()), (folder / "a.txt").read_text()
        (['a.txt'], 'whole')
    """
    path = Path(path)
    tmp = temp_path(path)
    _remove(tmp)  # left by a killed process that had this pid
    try:
        with writing(path):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_with(path: str | os.PathLike, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` writes the file, which then replaces ``path`` (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        write(tmp)


def append_line(path: str | os.PathLike, line: str, sync: bool = True) -> None:
    """Appends ``line`` and a newline in one unbuffered write (fsynced with ``sync``); when that fails (a
    full disk) the file is cut back to its former end, so no partial row stays behind."""
    path = Path(path)
    data = (line + "\n").encode()
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if sync:
                    os.fsync(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------- checking
def png_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a PNG file that ends with its ``IEND`` chunk (a truncated write or copy does
    not); reads 8 + 12 bytes, decodes nothing."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != PNG_SIGNATURE:
                return False
            f.seek(0, os.SEEK_END)
            if f.tell() < len(PNG_SIGNATURE) + len(PNG_END):
                return False
            f.seek(-len(PNG_END), os.SEEK_END)
            return f.read() == PNG_END
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False


def output_complete(path: str | os.PathLike) -> bool:
    """An item's output is whole: a PNG that :func:`png_complete` accepts (another file: that it exists),
    or a video folder holding at least one ``frame_*.png``, every one of them whole."""
    path = Path(path)
    if path.is_dir():
        frames = list(path.glob("frame_*.png"))
        return bool(frames) and all(png_complete(f) for f in frames)
    if path.suffix.lower() == ".png":
        return png_complete(path)
    return path.is_file()


def remove_temp_files(folder: str | os.PathLike, depth: int = 2) -> list[Path]:
    """Removes the temporary files and folders (``.NAME.tmpPID``) that interrupted writes left in
    ``folder`` and its subfolders down to ``depth``; returns them. Call it only while holding the
    folder's lock (no other writer)."""
    removed: list[Path] = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for entry in list(folder.iterdir()):
        if _TEMP_NAME.match(entry.name):
            _remove(entry)
            removed.append(entry)
        elif depth > 0 and entry.is_dir() and not entry.is_symlink():
            removed += remove_temp_files(entry, depth - 1)
    return removed


# ------------------------------------------------------------------------------------- reading
def read_jsonl(path: str | os.PathLike, fix: str, required: tuple[str, ...] = (),
               appended: bool = True) -> tuple[list[dict[str, Any]], int | None]:
    """The rows of a JSON-lines file, and the number of an unfinished last line that was dropped (or
    ``None``).

    In a file ``appended`` to row by row, an unparseable last line is what a process killed (or a disk
    filled) mid-append leaves: it is dropped, with a warning. An unparseable line elsewhere (or anywhere in
    a file written whole, ``appended=False``), a line that is not a JSON object, or a row lacking a
    ``required`` key is a :class:`DamagedFileError` naming the line; ``fix`` (what to do) ends its message.
    """
    path = Path(path)
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    rows: list[dict[str, Any]] = []
    dropped = None
    for k, (n, line) in enumerate(numbered):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if appended and k == len(numbered) - 1:
                dropped = n
                warnings.warn(f"{path} line {n} is an unfinished row (cut off by an interrupted write); it is "
                              "left out", stacklevel=2)
                break
            raise DamagedFileError(f"{path} line {n} is not a JSON row (column {err.colno}: {err.msg}); {fix}") \
                from err
        if not isinstance(row, dict):
            raise DamagedFileError(f"{path} line {n} is not a JSON object but a {type(row).__name__} (written by "
                                   f"another tomerge version?); {fix}")
        missing = [key for key in required if key not in row]
        if missing:
            raise DamagedFileError(f"{path} line {n} has no {', '.join(map(repr, missing))} (written by another "
                                   f"tomerge version?); {fix}")
        rows.append(row)
    return rows, dropped


def repair_jsonl_tail(path: str | os.PathLike) -> str | None:
    """Makes a JSON-lines file end with a whole line before it is appended to: an unparseable last line
    (an interrupted append) is cut off and returned, a parseable one missing its newline gets it. Call it
    only while holding the folder's lock."""
    path = Path(path)
    if not path.is_file():
        return None
    data = path.read_bytes()
    body = data.rstrip(b"\n")
    start = body.rfind(b"\n") + 1
    last = body[start:]
    if not last.strip():
        return None
    try:
        json.loads(last)
    except ValueError:
        with writing(path):
            os.truncate(path, start)
        return last.decode(errors="replace")
    if not data.endswith(b"\n"):
        append_line(path, "", sync=False)  # the row is whole; only its newline is missing
    return None


# ------------------------------------------------------------------------------------- images and videos
def load_image_files(paths: Sequence[str | os.PathLike]) -> Tensor:
    """PNG/JPEG files -> ``[n, C, H, W]`` float in ``[-1, 1]`` (C = 1 for greyscale files, else 3).

    Example:
        >>> load_image_files(sorted(Path("runs/gen/base").glob("*.png"))[:4]).shape   # doctest: +SKIP
        torch.Size([4, 3, 1024, 1024])
    """
    import numpy as np
    import torch
    from PIL import Image

    arrays = []
    for path in paths:
        with Image.open(path) as img:
            array = np.asarray(img.convert("L") if img.mode in ("L", "1", "I;16") else img.convert("RGB"))
        arrays.append(torch.from_numpy(array.copy()).reshape(*array.shape[:2], -1).permute(2, 0, 1))  # [C, H, W]
    if not arrays:
        raise ValueError("no image files to load")
    return torch.stack(arrays).float().div(127.5).sub(1.0)  # [n, C, H, W]


def frame_files(video: str | os.PathLike) -> list[Path]:
    """The frames of a video folder (``frame_000.png``, ...), in frame order."""
    folder = Path(video)
    frames = sorted(folder.glob("frame_*.png"))
    if not frames:
        raise ValueError(f"video folder {folder} holds no frame_*.png files")
    return frames


def expand_videos(files: Sequence[str | os.PathLike]) -> tuple[list[Path], int | None]:
    """Image files as they are, or video folders as their frames, in order: ``(frame files, frames per
    video)`` (``None`` for images). Every video must have the same number of frames.

    Example:
        >>> expand_videos(["runs/x/images/baseline/00000_seed0"])   # doctest: +SKIP
        ([PosixPath('.../00000_seed0/frame_000.png'), ...], 9)
    """
    paths = [Path(f) for f in files]
    videos = [p.is_dir() for p in paths]
    if not any(videos):
        return paths, None
    if not all(videos):
        raise ValueError("a set mixes image files and video folders")
    per_video = [frame_files(p) for p in paths]
    counts = sorted({len(f) for f in per_video})
    if len(counts) != 1:
        raise ValueError(f"videos of one set must have equal frame counts, got {counts}")
    return [f for frames in per_video for f in frames], counts[0]


def load_video(folder: str | os.PathLike) -> Tensor:
    """A video folder -> ``[T, C, H, W]`` float in ``[-1, 1]``."""
    return load_image_files(frame_files(folder))


def image_files(folder: str | os.PathLike, limit: int | None = None) -> list[Path]:
    """Image files (PNG/JPEG) of a folder, sorted by name, at most ``limit``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} not found")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not files:
        raise ValueError(f"{folder} holds no .png/.jpg images")
    return files[:limit]


# ------------------------------------------------------------------------------------- locking
class FolderLock:
    """The lock of one folder, held by this process (see :func:`lock_folder`); :meth:`release` it, or use
    it as a context manager."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Empties the lock file (so it names no holder) and unlocks it; a second call does nothing."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            import fcntl

            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict):
        return "another process (it has not written its pid yet)"
    return (f"{info.get('command', 'another tomerge process')} (pid {info.get('pid')} on host {info.get('host')}, "
            f"since {info.get('since')})")


def lock_folder(folder: str | os.PathLike, command: str) -> FolderLock:
    """Locks ``folder`` for this process (``fcntl.flock`` on ``folder/tomerge.lock``, created if needed,
    which then names the pid, host, ``command`` and start time), or raises :class:`FolderInUseError`
    naming the holder. A lock file left by a process that died is taken over: the OS released its lock.
    Where locks are not available (no ``fcntl``, a file system without locks), warns and returns a lock
    that holds nothing.

    Example:
        >>> import tempfile; folder = tempfile.mkdtemp()
        >>> with lock_folder(folder, "tomerge ablate"):
        ...     lock_folder(folder, "tomerge ablate")            # doctest: +ELLIPSIS
        Traceback (most recent call last):
        tomerge.experiments.errors.FolderInUseError: ... is in use by tomerge ablate (pid ... on host ...); ...
    """
    folder = Path(folder)
    path = folder / LOCK_FILE
    try:
        import fcntl
    except ImportError:  # not POSIX
        warnings.warn(f"cannot lock {folder} here (no fcntl): make sure no other tomerge process writes to it",
                      stacklevel=2)
        return FolderLock(path, None)
    with writing(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise FolderInUseError(f"{folder} is in use by {holder}; one process writes to a folder at a time: wait "
                               f"for it to finish or stop it (its lock, {path}, goes with it), or write elsewhere") \
            from None
    except OSError as err:  # e.g. ENOLCK, EOPNOTSUPP: a file system without locks
        os.close(fd)
        warnings.warn(f"cannot lock {folder} ({err.strerror}): make sure no other tomerge process writes to it",
                      stacklevel=2)
        return FolderLock(path, None)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "since": datetime.datetime.now().isoformat(timespec="seconds")}
    try:
        with writing(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return FolderLock(path, fd)
