"""DiskDirectory: where the disk tier's files live and why they are trusted. The directory must be
private to this user and locked by one process; it keeps the key seed, the blocks' MAC key, one
file per block under fan-out folders (opened without following links, written whole) and the
retention manifest.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import stat
from pathlib import Path

from radixkv.cache.disk_format import MAC_KEY_BYTES, BlockRejected
from radixkv.errors import ConfigError
from radixkv.private_files import check_private, private_secret, read_nofollow, write_atomic

logger = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_SEED_FILE = "seed"
_KEY_FILE = "key"  # the blocks' MAC key: a block made without it is a miss
_OLD_TENANT_SECRET_FILE = "tenant_secret"  # removed at open (radixkv.cli.tenant_secret_for)
_LOCK_FILE = "lock"  # flock'ed while a process has the tier open
_RETAINED_FILE = "retained.json"  # key -> (expiry, owner digest) of the live retentions
_MAX_MANIFEST_BYTES = 256 << 20
_BLOCKS = "blocks"
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class DiskDirectory:
    """One tier's directory. `open` checks and locks it and returns its secrets; the rest are
    file operations by block key, safe to call from the writer thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_handle = None  # the locked lock file, while the tier is open

    def open(self) -> tuple[bytes, bytes]:
        """Make (owner-only) or check the directory, hold its lock; (key seed, MAC key)."""
        self.path.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        try:
            check_private(self.path)
        except PermissionError as error:
            # Whoever else may write here could plant blocks, swap the seed or read the KV.
            raise ConfigError(
                f"kv_disk_dir must be private to this user (chmod go-w, or another directory): {error}", param="kv_disk_dir"
            ) from None
        self._lock()
        try:
            (self.path / _BLOCKS).mkdir(mode=_DIR_MODE, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(self.path / _BLOCKS).st_mode):
                raise NotADirectoryError(f"{self.path / _BLOCKS} is not a folder")
            os.chmod(self.path / _BLOCKS, _DIR_MODE)
            # The key seed: keys stay the same across restarts yet cannot be predicted (or made
            # to collide) by anyone without the file.
            return private_secret(self.path / _SEED_FILE, 8), private_secret(self.path / _KEY_FILE, MAC_KEY_BYTES)
        except BaseException:
            self.unlock()
            raise

    def _lock(self) -> None:
        """Hold the directory's lock file, so a second process (or engine) on the same directory
        fails at once instead of both evicting and overwriting each other's blocks."""
        fd = os.open(self.path / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise ConfigError(
                f"kv_disk_dir {self.path} is in use by another engine (its lock file is held); "
                "each process needs a directory of its own",
                param="kv_disk_dir",
            ) from None
        # A file object, so the lock goes with the tier even if close() is never called.
        self._lock_handle = open(fd, "rb", buffering=0)  # noqa: SIM115

    def unlock(self) -> None:
        handle, self._lock_handle = self._lock_handle, None
        if handle is not None:
            handle.close()  # closing the descriptor releases the flock

    def scan(self) -> list[tuple[int, int, int]]:
        """Every block file as (mtime_ns, key, size), least recently used first (a hit refreshes
        the mtime); no block file is read, nothing but regular files is listed. Torn temporary
        files are removed."""
        for entry in os.scandir(self.path):
            if entry.name.startswith(".tmp"):
                _unlink(Path(entry.path))  # a manifest torn by a crash
            elif entry.name == _OLD_TENANT_SECRET_FILE:
                # Earlier versions of `serve` kept the tenant secret here; it lives outside the
                # directory now, and a copy left here would tell anyone reading the directory
                # how to compute every key's cache salt.
                _unlink(Path(entry.path))
                logger.warning("removed %s: the tenant secret is kept outside kv_disk_dir now", entry.path)
        found = []
        for sub in os.scandir(self.path / _BLOCKS):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if entry.name.startswith(".tmp"):
                    _unlink(Path(entry.path))
                    continue
                key = _key_of(entry.name)
                if key is None:
                    continue
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    continue  # planted: a read would refuse it anyway
                found.append((info.st_mtime_ns, key, info.st_size))
        found.sort()
        return found

    # -- the retention manifest ------------------------------------------------------------------

    def read_manifest(self) -> dict[int, tuple[float, str]]:
        """The retentions a previous process left (key -> (expiry, owner digest)); an absent
        or damaged manifest means none, never an error."""
        try:
            data = read_nofollow(self.path / _RETAINED_FILE, _MAX_MANIFEST_BYTES)
            if data is None:
                return {}
            entries = json.loads(data)["retained"]
            return {int(key, 16): (float(expires_at_s), str(owner)) for key, expires_at_s, owner in entries}
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("disk KV retentions not restored (%s): the blocks stay, unretained", error)
            return {}

    def write_manifest(self, data: bytes) -> None:
        """Replace the manifest atomically, owner-only; raises OSError."""
        write_atomic(self.path / _RETAINED_FILE, data)

    # -- block files -----------------------------------------------------------------------------

    def block_path(self, key: int) -> Path:
        name = f"{key:032x}"
        return self.path / _BLOCKS / name[:2] / (name + _SUFFIX)

    def open_block(self, key: int) -> int:
        """A block file's descriptor, opened without following a symlink (neither the file nor
        its folder) and without blocking on a planted pipe; BlockRejected("symlink") for a
        link where a block belongs, OSError (FileNotFoundError: none) otherwise."""
        name = f"{key:032x}"
        try:
            folder = os.open(self.path / _BLOCKS / name[:2], _OPEN_DIR)
            try:
                return os.open(name + _SUFFIX, _OPEN_READ | os.O_NONBLOCK, dir_fd=folder)
            finally:
                os.close(folder)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                raise BlockRejected("symlink", "a link or other file where a block belongs") from None
            raise

    def write_block(self, key: int, data: bytes) -> bool:
        """Write a block whole (a temporary file renamed into place), owner-only, never through
        a planted link; False on any OS error (a full disk above all), with nothing left
        behind."""
        name = f"{key:032x}"
        folder_path = self.path / _BLOCKS / name[:2]
        tmp = f".tmp{secrets.token_hex(6)}"
        try:
            # Only the fan-out folder: a tier whose directory vanished stays without one (a
            # recreated parent would get the umask's permissions, not the owner's alone).
            try:
                folder_path.mkdir(mode=_DIR_MODE)
            except FileExistsError:
                pass
            folder = os.open(folder_path, _OPEN_DIR)
        except OSError as error:
            logger.warning("disk KV block not written (%s); it stays a miss", error)
            return False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE, dir_fd=folder)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, name + _SUFFIX, src_dir_fd=folder, dst_dir_fd=folder)
            return True
        except OSError as error:
            logger.warning("disk KV block not written (%s); it stays a miss", error)
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            return False
        finally:
            os.close(folder)

    def unlink_block(self, key: int) -> None:
        _unlink(self.block_path(key))


def _key_of(name: str) -> int | None:
    if not name.endswith(_SUFFIX) or len(name) != 32 + len(_SUFFIX):
        return None
    try:
        return int(name[:32], 16)
    except ValueError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass  # already gone, or the directory with it
