"""Files radixkv writes and later trusts (the native library, the disk tier's directory, its
seed and key, the tenant secret): checked to belong to this user and be writable by no one
else, read without following a planted symlink, and written whole or not at all.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

FILE_MODE = 0o600


def check_private(*paths: Path) -> None:
    """PermissionError unless each path belongs to this user and no one else may write it:
    another user able to swap what radixkv trusts there (a shared or world-writable folder)
    could run their code in this process or feed it their data."""
    for path in paths:
        info = path.stat()
        if info.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to uid {info.st_uid}, not this user ({os.getuid()}); not using it")
        if info.st_mode & 0o022:
            raise PermissionError(f"{path} is writable by others (mode {info.st_mode & 0o777:o}); not using it")


def read_nofollow(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of a regular file of at most `max_bytes`, None where there is none; a symlink
    or anything else planted in its place raises OSError, and a larger file is not read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            raise OSError(f"{path} is not a regular file of at most {max_bytes} bytes")
        return os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, replace: bool = True) -> bool:
    """Write `data` to `path` owner-only and whole: a temporary file beside it, flushed to disk,
    then renamed over it and the folder flushed, so a crash leaves the old file or the new one,
    never a torn one. With replace=False an existing file wins (two processes creating the
    same secret at once agree on one); returns whether this call's bytes are the file's."""
    tmp = path.parent / f".tmp{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
            placed = True
        else:
            try:
                os.link(tmp, path)  # fails where the file exists: never overwrites another's
                placed = True
            except FileExistsError:
                placed = False
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # renamed into place
    fsync_dir(path.parent)
    return placed


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (a rename in it) to disk; a file system that cannot is let be."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def private_secret(path: Path, num_bytes: int) -> bytes:
    """A random secret of `num_bytes` kept in an owner-only file, made on first use (atomically:
    a crash never leaves a torn one that a restart would silently replace); one of another
    length is replaced. Raises OSError (PermissionError where the file or its folder is not
    private) rather than use a secret someone else could have read or written."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(path.parent)
    for _ in range(2):
        data = read_nofollow(path, num_bytes)
        if data is not None and len(data) == num_bytes:
            check_private(path)
            if os.stat(path).st_mode & 0o077:
                raise PermissionError(f"{path} is readable by others; not using it as a secret")
            return data
        # None: made now unless another process made it first; torn (an older radixkv): replaced.
        write_atomic(path, secrets.token_bytes(num_bytes), replace=data is not None)
    raise OSError(f"{path} could not be made")

