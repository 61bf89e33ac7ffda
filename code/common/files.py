"""Files written whole or not at all, and read from the disk rather than from memory.

`write_atomic` writes to a temporary name in the same folder (`temp_name`: .<name>.<writer's pid>.<random>.tmp),
fsyncs, then renames over the file's name, so a writer killed half way leaves no half file under that name;
`remove_dead_writers` removes the temporary files of writers that no longer run. The written pages are dropped
from the OS page cache, so the next read comes from the disk; `drop_cache` does the same before a timed read,
and `page_cache_share` says how much of a file a read would find in memory instead.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

TEMP_SUFFIX = ".tmp"   # a file being written: .<name>.<writer pid>.<random>.tmp


def temp_name(path: Path) -> Path:
    """The temporary file a writer of `path` writes first: in the same folder (the rename stays on one file
    system), hidden, named by the writer's pid (remove_dead_writers reads it back) and a random tag."""
    return path.parent / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}{TEMP_SUFFIX}"


def write_atomic(path: Path, blob, mode: int = 0o600) -> None:
    """Write to a temporary name in the same folder, fsync, drop its pages from the page cache, rename over
    `path`, fsync the folder: a reader sees the whole file or none, even if this process is killed. The file
    is readable by its owner only (`mode`): what it holds can be a user's prompt. A write that fails (a full
    disk, a file-size limit) raises OSError and leaves neither the file nor its temporary behind."""
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        _fadvise_dontneed(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def remove_dead_writers(folder: Path) -> int:
    """Remove the temporary files of writers that are no longer running (killed mid-write). Returns how many."""
    n = 0
    for p in Path(folder).glob("." + "*" + TEMP_SUFFIX):
        parts = p.name.split(".")
        pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
        if pid is None or not pid_alive(pid):
            p.unlink(missing_ok=True)
            n += 1
    return n


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True   # no /proc (not Linux): kill(pid, 0) succeeded
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _fadvise_dontneed(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def drop_cache(path) -> bool:
    """Drop a file's pages from the OS page cache (fsync, then POSIX_FADV_DONTNEED), so the next read comes
    from the disk. False where the OS offers no posix_fadvise (the read may then come from the cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return _fadvise_dontneed(fd)
    finally:
        os.close(fd)


def page_cache_share(path) -> float | None:
    """Share of a file's pages in the OS page cache now (mincore(2) on a mapping of it), None where unknown:
    what a timed read of it will measure, the disk (0) or the cache (1)."""
    import ctypes
    import mmap
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        buf = (ctypes.c_char * size).from_buffer(mm)
        vec = (ctypes.c_ubyte * (-(-size // page)))()
        ok = mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) == 0
        del buf
    return float(np.frombuffer(vec, np.uint8).__and__(1).mean()) if ok else None
