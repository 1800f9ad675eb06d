"""The on-disk build cache that attnzoo's built artifacts share (Triton kernel sources, the fused decoding
step's library): where it lives and the trust rules every file in it is read and written under.

Nothing in the cache is followed through a symbolic link (files and locks are opened with ``O_NOFOLLOW``,
directories checked with ``lstat``); a cache directory or file that another user can write (or owns; root excepted)
is refused with one line saying how to fix it (:class:`CacheError`), as ssh's ``StrictModes`` refuses such files.
Writes go to a temporary name and are renamed (atomic); a file lock keeps concurrent builds of one key apart. This
module imports nothing else from attnzoo but its errors, so any layer may use it.
"""

from __future__ import annotations

import errno
import functools
import os
import secrets
import stat
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import AttnzooError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted where a file belongs must not hang the open
CLOEXEC = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
FIX = "or set ATTNZOO_CACHE_DIR to a directory only you can write"


class CacheError(AttnzooError):
    """The artifact cache cannot be used safely or at all (a symbolic link, something another user can write, not
    a directory, not writable). One line: the path, what is wrong, how to fix it."""


def cache_dir() -> Path:
    """Where artifacts live: ``$ATTNZOO_CACHE_DIR`` or the per-user cache directory."""
    env = os.environ.get("ATTNZOO_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("attnzoo"))



def trusted_owners() -> set[int]:
    """Who may own the cache and what it holds: this user and root (ssh's ``StrictModes``)."""
    return {0, os.getuid()}


@functools.cache
def private_group(gid: int, uid: int) -> bool:
    """True if user ``uid`` is the only member of group ``gid`` (a user private group, where umask 002 is usual),
    so that group write is the owner's own (Debian's reading of ssh's ``StrictModes``)."""
    import grp
    import pwd

    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    primary = {p.pw_uid for p in pwd.getpwall() if p.pw_gid == gid}
    return primary <= {uid} and set(group.gr_mem) <= {user.pw_name} and bool(primary or group.gr_mem)


def writable_by_others(st: os.stat_result) -> int:
    """The mode bits through which a user other than the owner can write (0: none)."""
    bits = st.st_mode & stat.S_IWOTH
    if st.st_mode & stat.S_IWGRP and not private_group(st.st_gid, st.st_uid):
        bits |= stat.S_IWGRP
    return bits


def check_trusted(path: Path, st: os.stat_result) -> None:
    """Refuse ``path`` (:class:`CacheError`) if a user other than this one or root owns it or can write it."""
    if not hasattr(os, "getuid"):  # no POSIX owners and modes (Windows)
        return
    if st.st_uid not in trusted_owners():
        raise CacheError(f"{path}: owned by another user (uid {st.st_uid}), so attnzoo will not use it; remove it "
                         f"{FIX}")
    if writable_by_others(st):
        raise CacheError(f"{path}: other users can write it (mode {stat.filemode(st.st_mode)}), so attnzoo will "
                         f"not use it; fix: chmod go-w {path}, {FIX}")


def symlink_error(path: Path) -> CacheError:
    return CacheError(f"{path}: a symbolic link, which attnzoo never follows in its cache; remove it "
                      f"(rm {path}) {FIX}")


def failed(path: Path, doing: str, exc: OSError) -> CacheError:
    return CacheError(f"{path}: cannot {doing} ({exc.strerror or exc}); {FIX.removeprefix('or ')}")


def drop_others_write(path: Path | int) -> None:
    """Take away the write bits another user would have on what we just created (a umask of 000, say), so the
    cache never holds what it would refuse."""
    if not hasattr(os, "getuid"):
        return
    st = os.stat(path)
    if bits := writable_by_others(st):
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~bits)


def mkdir_private(path: Path, shown: Path, doing: str) -> None:
    """Create directory ``path`` (the umask applies, as to any directory) with no write bit another user would
    have; nothing if it exists; :class:`CacheError` naming ``shown`` otherwise."""
    try:
        os.mkdir(path, 0o777)
        drop_others_write(path)
    except FileExistsError:
        pass
    except OSError as exc:
        raise failed(shown, doing, exc) from None


def checked_dir(path: Path, create: bool = False) -> bool:
    """Check that ``path`` is a real directory (not a symbolic link) that only its owner, this user or root, can
    write; created first when ``create``. False if it is absent (and not created); :class:`CacheError` otherwise."""
    if create:
        mkdir_private(path, path, "create this directory")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise failed(path, "read this directory", exc) from None
    if stat.S_ISLNK(st.st_mode):
        raise symlink_error(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{path}: not a directory, where attnzoo keeps one; remove it {FIX}")
    check_trusted(path, st)
    return True


def cache_root(root: Path) -> Path:
    """``root`` as a cache directory: created if absent; refused (:class:`CacheError`, one line) if it is not a
    directory, or it or a directory above it can be written by another user (a sticky one such as /tmp excepted
    above it). The cache directory itself may be a symbolic link (as ``~/.cache`` often is): its target is checked."""
    root = Path(root)
    missing = []
    for path in (root, *root.parents):
        if os.path.lexists(path):
            break
        missing.append(path)
    for path in reversed(missing):  # as ``mkdir -p``, never writable by others
        mkdir_private(path, root, "create the cache directory")
    try:
        real = Path(os.path.realpath(root))
        st = os.stat(real)
    except OSError as exc:
        raise failed(root, "use it as the cache directory", exc) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{root}: not a directory, so it cannot be the cache directory; set ATTNZOO_CACHE_DIR (or "
                         f"--cache-dir) to a directory")
    check_trusted(root, st)
    for parent in real.parents:  # whoever can write a directory above can replace the cache
        pst = os.stat(parent)
        if not (pst.st_mode & stat.S_ISVTX and pst.st_uid in trusted_owners()):
            check_trusted(parent, pst)
    return root


def open_checked(path: Path):
    """``path``, a regular file in the cache, open for reading (a binary file object) without following a symbolic
    link; None if it is absent. :class:`CacheError` for a symbolic link, not a regular file, or one another user
    can write."""
    try:
        fd = os.open(path, os.O_RDONLY | NONBLOCK | NOFOLLOW | CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise symlink_error(path) from None
        raise failed(path, "read it", exc) from None
    f = os.fdopen(fd, "rb")
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path}: not a regular file, where attnzoo keeps one; remove it {FIX}")
        check_trusted(path, st)
    except BaseException:
        f.close()
        raise
    return f


def read_file(path: Path) -> bytes | None:
    """The bytes of ``path``, a regular file in the cache (:func:`open_checked`); None if it is absent."""
    f = open_checked(path)
    if f is None:
        return None
    with f:
        return f.read()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary name, then a rename), with the mode an ordinary file gets
    (``0o666`` less the umask, less any write bit another user would have), so a cache shared by CI jobs of one
    user stays readable by all of them. Never replaces a symbolic link, nor a file another user can write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise failed(path, "write it", exc) from None
    else:
        if stat.S_ISLNK(st.st_mode):
            raise symlink_error(path)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path}: not a regular file, where attnzoo keeps one; remove it {FIX}")
        check_trusted(path, st)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
    while True:  # mkstemp's names, but not its 0o600: os.open applies the umask to 0o666
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
        except OSError as exc:
            raise failed(path.parent, "write in it", exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            drop_others_write(f.fileno())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a rename: replaces the name, never writes through it
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class LockTimeout(CacheError):
    """Another process held a lock file in the cache for longer than the caller would wait (one line, naming it)."""


def _pid(fd: int) -> str:
    """`` (pid N)``: the process holding the ``flock`` on the open file ``fd``, where ``/proc/locks`` says (Linux);
    else nothing."""
    try:
        st = os.fstat(fd)
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()  # "1: FLOCK ADVISORY WRITE <pid> <maj>:<min>:<inode> 0 EOF" ("->": a waiter)
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == want and int(fields[4]) > 0:
                    return f" (pid {int(fields[4])})"
    except (OSError, ValueError, AttributeError):
        pass
    return ""


def _say(line: str) -> None:
    """One line on stderr, as attnzoo's command line and integrations report (nothing if stderr is gone)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass


@contextmanager
def locked(path: Path, timeout: float | None = None, waiting: str | None = None):
    """Hold the lock file ``path`` (created if absent; never followed through a symbolic link, never truncated).

    While another process holds it, says so once on stderr (one line: the file, the process holding it where
    ``/proc/locks`` tells, then ``waiting``: what the caller does meanwhile) and polls; after ``timeout`` seconds
    (None: as long as it takes) raises :class:`LockTimeout`, one line naming the file."""
    if waiting is None:
        waiting = "; waiting until it is released" if timeout is None else f"; giving up after {timeout:g} s"
    try:
        import fcntl
    except ImportError:  # not POSIX: filelock's own lock
        import filelock

        lock = filelock.FileLock(str(path))
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            _say(f"attnzoo: waiting for the lock {path}: another process holds it{waiting}")
            try:
                lock.acquire(timeout=-1 if timeout is None else timeout)
            except filelock.Timeout:
                raise LockTimeout(f"{path}: another process held this lock for {timeout:g} s") from None
        try:
            yield
        finally:
            lock.release()
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | NONBLOCK | NOFOLLOW | CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise symlink_error(path) from None
        raise failed(path, "create this lock file", exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{path}: not a regular file, where attnzoo keeps a lock file; remove it {FIX}")
        if st.st_uid == os.getuid():
            drop_others_write(fd)
        start, pause, said = time.monotonic(), 0.01, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as exc:  # no locks on this file system (ENOLCK), ...
                raise failed(path, "lock it", exc) from None
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                raise LockTimeout(f"{path}: another process{_pid(fd)} held this lock for {waited:.1f} s")
            if not said:
                _say(f"attnzoo: waiting for the lock {path}: another process{_pid(fd)} holds it{waiting}")
                said = True
            time.sleep(min(pause, 0.25) if timeout is None else min(pause, 0.25, timeout - waited))
            pause *= 2
        yield
    finally:
        os.close(fd)  # releases the lock
