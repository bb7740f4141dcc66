"""Opening a file that another process could have replaced, as the C++ side does it
(troupe/runtime/safe_open.h): a FIFO at the path would block open() until a peer opens its other
end, a symbolic link would redirect the write, another user's file is not ours to use."""
import os
import stat


def open_regular(path, flags, mode=0o600, must_be_mine=True):
    """os.open(path, flags) with O_NOFOLLOW, O_NONBLOCK and O_CLOEXEC, checked on the descriptor to
    be a regular file (of this user, unless must_be_mine is False); O_NONBLOCK is cleared before
    it returns. Raises FileNotFoundError, or OSError naming what was found instead."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise
    except OSError as e:
        try:
            found = _kind(os.lstat(path).st_mode)
        except OSError:
            raise e from None
        raise OSError(e.errno, f"refusing {path}: it is {found}, not a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, f"refusing {path}: it is {_kind(st.st_mode)}, not a regular file")
        if must_be_mine and st.st_uid != os.geteuid():
            raise OSError(0, f"refusing {path}: it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode):
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"
