"""Objects made with troupe.put(): one file per object in a per-machine shared-memory directory.

Why files in /dev/shm: every process of the machine (drivers, actors, task workers, and the
nodes of a test bed's network namespaces) maps the same pages, so a get() is an mmap and the
numpy arrays it returns point into them (read-only, as Ray's plasma store returns them); a put()
is one copy, written with writev straight from the pickle-5 buffers. No daemon owns the memory,
so nothing has to be started, and an object's lifetime is its owner's (below).

Ownership, as Ray's: the process that put an object owns it. The owner counts its own refs and
deletes the object when the last one is gone, unless a ref was passed to another process (then
the object lives until the owner exits: borrowers do not report back). An owner that exits
deletes what it owns; one killed with -9 leaves files that the next process of the machine to
open the store sweeps (their owner pid is dead). A get() of an object whose owner is gone raises
ObjectLostError saying so.

Reuse: the file of a freed object (1 MB or more) that no other process could have mapped, and
whose mappings here are all closed, is kept and written over by a later put(): its pages are
already allocated, so that put() is one memcpy (a new file costs the kernel a zeroed page per
4 KB first). At most 1 GiB per process is kept, and never more than half of what the file
system has free when the object is freed: kept pages are memory the machine cannot use. A put()
that finds the file system full gives the kept files back and tries once more, and a flash
checkpoint short of room removes every process's kept files (named <pid>-free-<n>) first.

Directory: /dev/shm/troupe-objects-<uid> (or $TROUPE_OBJECT_DIR), which must be this user's with
mode 0700. Anyone can make that name first: when someone else did, this process puts its objects
in a fresh private directory beside it (troupe-objects-<uid>.<random>, made by mkdtemp) and says
so once on stderr; the ids of its objects then carry that directory's name, so other processes
of this user find them.

File: b"TOB1" | u32 count | u64 len(pickle) | u64 len(buffer) * count | pickle | buffers, each
buffer at a 64-byte aligned offset (so arrays map aligned).
"""
import errno
import itertools
import mmap
import os
import pickle
import re
import secrets
import socket
import stat
import struct
import sys
import tempfile
import threading
import weakref

import cloudpickle

from .exceptions import ObjectLostError, TroupeError

_MAGIC = b"TOB1"
_ALIGN = 64
_MAX_BUFFERS = 1 << 20
# Freed objects' files of at least this size are kept for reuse, up to this much per process.
RECYCLE_MIN_BYTES = 1 << 20
RECYCLE_MAX_BYTES = 1 << 30


_HOST = None  # (pid, host id of a process of no node given by use_node): forks read it again
# (directory, node id) of the node a driver found it runs on (use_node); workers have theirs in
# their environment, from their node agent.
_node = None
# How to reach other nodes' agents (set by _api): nodes.pull(node, name, path), .drop(node, name).
nodes = None


def host_id():
    """Where this process's objects live: its node's id, or (a process of no node) this machine
    (hostname and boot id). Processes with the same one share an object directory."""
    if _node is not None:
        return _node[1]
    global _HOST
    if _HOST is None or _HOST[0] != os.getpid():  # every call carries it: read the environment once
        node = os.environ.get("TROUPE_NODE_ID")
        _HOST = (os.getpid(), node if node and os.environ.get("TROUPE_OBJECT_DIR") else _machine())
    return _HOST[1]


def _machine():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _is_node(host):
    """Whether a host id names a node (whose agent serves its objects), not a bare machine."""
    return "/" not in host


def use_node(directory, node_id):
    """A driver's objects go to the directory of the node it runs on, which that node's agent
    serves to other nodes. Keeps the store as it is if it already owns objects."""
    global _node, _store
    if _node == (directory, node_id) or _private_dir_problem(directory) is not None:
        return  # a node of another user (its directory is closed to this one): objects stay here
    with _store_lock:
        if _store is not None and _store.pid == os.getpid() and _store.owned:
            return
        _node = (directory, node_id)
        _store = None


def _private_dir_problem(path):
    """None if `path` is a directory of this user closed to others (checked on an open descriptor,
    no link followed), else what it is instead: the one check of an object directory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return f"cannot be opened as a directory ({e.strerror})"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return f"belongs to uid {st.st_uid} with mode {oct(stat.S_IMODE(st.st_mode))}"
    return None


class _Store:
    """This process's view of the machine's object directory."""

    def __init__(self):
        root = (_node[0] if _node is not None else os.environ.get("TROUPE_OBJECT_DIR")) or \
            f"/dev/shm/troupe-objects-{os.getuid()}"
        if not os.path.isdir(os.path.dirname(root) or "/"):
            root = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"troupe-objects-{os.getuid()}")
        self.parent, self.name = os.path.split(root)
        self.fallback = None  # the private directory made because root was someone else's
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        problem = _private_dir_problem(root)
        if problem is not None:
            wanted, root = root, tempfile.mkdtemp(prefix=f"{self.name}.", dir=self.parent)
            self.fallback = root
            print(f"(troupe) the object directory {wanted} {problem}, not this user's with mode 0700 (another "
                  f"user made it?): this process keeps its objects in {root} instead", file=sys.stderr, flush=True)
        self.root = root
        self.checked = {}  # another process's fallback directory -> whether it is ours and private
        self.host = host_id()
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.counter = itertools.count()
        self.owned = {}  # object id -> [local ref count, lent]
        self.maps = {}  # owned object id -> the mappings this process made of it (see recycle)
        self.free = []  # files of freed objects kept for reuse: (size, path)
        self.free_bytes = 0
        self.pulled = weakref.WeakValueDictionary()  # object id -> the mapping of its pulled copy
        self.sweep()

    def sweep(self):
        """Deletes the objects of owners that died without cleaning up (kill -9)."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        for name in names:
            pid = _owner_pid(name)
            if pid and not _alive(pid):
                try:
                    os.unlink(os.path.join(self.root, name))
                except OSError:
                    pass

    def path(self, object_id):
        """Where an object's file is: in this store's directory, or, for an id of the form
        <directory>/<name>, in another process's fallback directory beside it (which must be
        this user's and private)."""
        directory, _, name = object_id.rpartition("/")
        if not directory:
            return os.path.join(self.root, object_id)
        if not re.fullmatch(re.escape(self.name) + r"\.[A-Za-z0-9_]+", directory) or not re.fullmatch(r"[0-9A-Za-z-]+", name):
            raise ObjectLostError(f"object {object_id!r} names no object directory of this user")
        if directory not in self.checked:
            self.checked[directory] = _private_dir_problem(os.path.join(self.parent, directory)) is None
        if not self.checked[directory]:
            raise ObjectLostError(f"object {object_id!r} is in a directory that is not this user's")
        return os.path.join(self.parent, directory, name)

    def new_id(self, kind=""):
        """kind "h": a result handed over to its caller, "p": a pulled copy (node_objects.h)."""
        name = f"{self.pid}-{kind}{next(self.counter)}-{secrets.token_hex(4)}"
        return f"{os.path.basename(self.root)}/{name}" if self.fallback else name

    def put(self, value):
        main, raws = _pickle(value)
        object_id, size = self.write(main, raws)
        with self.lock:
            self.owned[object_id] = [0, False]
        return object_id, size

    def write(self, main, raws, kind=""):
        """Writes one object file (not owned: put() and handoffs decide who deletes it)."""
        header = _MAGIC + struct.pack(f"<IQ{len(raws)}Q", len(raws), len(main), *[r.nbytes for r in raws])
        parts, offset = [header, main], len(header) + len(main)
        for raw in raws:
            pad = -offset % _ALIGN
            if pad:
                parts.append(b"\0" * pad)
            parts.append(raw)
            offset += pad + raw.nbytes
        object_id = self.new_id(kind)
        path = self.path(object_id)
        for attempt in range(2):
            fd = self.reuse(offset, path)
            if fd is None:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            try:
                for start in range(0, len(parts), 512):  # IOV_MAX is 1024
                    chunk = parts[start:start + 512]
                    want = sum(memoryview(p).nbytes for p in chunk)
                    if os.writev(fd, chunk) != want:  # a regular file writes short only when it is full
                        raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                if e.errno == errno.ENOSPC and attempt == 0 and self.trim():
                    continue  # the kept files' pages went back to the system: once more
                raise TroupeError(f"cannot store a {offset}-byte object in {self.root}: {e} "
                                  "(is the shared-memory file system full?)") from None
            os.close(fd)
            return object_id, offset

    def trim(self):
        """Deletes the files kept for reuse (the machine is short of shared memory); True if any."""
        with self.lock:
            free, self.free, self.free_bytes = self.free, [], 0
        for _, path in free:
            _unlink(path)
        return bool(free)

    def reuse(self, size, path):
        """A freed object's file, renamed to `path` and opened for writing: its pages are already
        allocated, so writing into it costs a copy and no page faults. None if none fits."""
        with self.lock:
            best = None
            for i, (have, _) in enumerate(self.free):
                if size <= have <= 2 * size and (best is None or have < self.free[best][0]):
                    best = i
            if best is None:
                return None
            have, old = self.free.pop(best)
            self.free_bytes -= have
        try:
            os.rename(old, path)
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            os.ftruncate(fd, size)
            return fd
        except OSError:
            return None

    def recycle(self, object_id):
        """Deletes a freed object, or keeps its file for reuse when this process made the only
        mappings of it (it was never lent) and none is in use any more (closing a mapping
        that a live array still uses fails)."""
        path = self.path(object_id)
        maps = self.maps.pop(object_id, ())
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # a value from get() still uses it
                _unlink(path)
                return
        try:
            size = os.stat(path).st_size
            vfs = os.statvfs(self.root)
        except OSError:
            return
        room = vfs.f_bavail * vfs.f_frsize  # the kept files are not in it: they are allocated
        with self.lock:
            if size >= RECYCLE_MIN_BYTES and self.free_bytes + size <= min(RECYCLE_MAX_BYTES, room // 2):
                free = os.path.join(self.root, f"{self.pid}-free-{next(self.counter)}")
                try:
                    os.rename(path, free)
                    self.free.append((size, free))
                    self.free_bytes += size
                    return
                except OSError:
                    pass
        _unlink(path)

    def pull(self, object_id, host, take=False):
        """The value of an object that lives on another node: its bytes are pulled from that
        node's agent into a file here, which is mapped and unlinked at once (the mapping lives
        as long as the value's arrays, and a later get() while it lives maps it again). take:
        a result handed over to this process, deleted there once pulled."""
        if not _is_node(host):
            raise ObjectLostError(f"object {object_id} lives on {host}, a machine where no Troupe node runs (it was "
                                  "put() by a process there): nothing can serve it to this one")
        if "/" in object_id:
            raise ObjectLostError(f"object {object_id} lives in a private directory of its owner on node {host}, "
                                  "which that node's agent does not serve")
        mm = self.pulled.get(object_id)
        if mm is None:
            if nodes is None:
                raise ObjectLostError(f"object {object_id} lives on node {host}, and this process is not connected "
                                      "to its cluster")
            path = self.path(self.new_id("p"))
            try:
                size = nodes.pull(host, object_id, path)
            except ObjectLostError:
                raise
            except TroupeError as e:
                raise ObjectLostError(f"object {object_id} cannot be pulled from node {host}: {e}") from None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if size < len(_MAGIC) + 12:
                        raise ObjectLostError(f"object {object_id} is corrupt: {size} bytes")
                    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
            finally:
                _unlink(path)
            if take:
                try:
                    nodes.drop(host, object_id)
                except TroupeError:
                    pass  # its writer deletes it when it exits
            else:
                self.pulled[object_id] = mm
        return _decode(memoryview(mm), object_id)

    def map(self, object_id):
        """The value of a file another process of this host wrote for this one (call arguments)."""
        try:
            fd = os.open(self.path(object_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectLostError(f"call arguments passed in shared memory ({object_id}) are gone: the caller "
                                  "is on another host, or ended") from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return _decode(memoryview(mm), object_id)

    def unlink(self, object_ids):
        for object_id in object_ids:
            _unlink(self.path(object_id))

    def take(self, object_id):
        """The value of a handed-off object, which this process now holds alone: the file is
        mapped, then unlinked (the mapping lives as long as the value's arrays)."""
        path = self.path(object_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectLostError(f"a result handed over in shared memory ({object_id}) is gone") from None
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
            os.unlink(path)
        if mm is None:
            raise ObjectLostError(f"a result handed over in shared memory ({object_id}) is empty")
        return _decode(memoryview(mm), object_id)

    def get(self, object_id, host, owner):
        if host != self.host:
            return self.pull(object_id, host)
        if owner != self.pid and not _alive(owner):  # its file may be left (kill -9): it is lost all the same
            try:
                os.unlink(self.path(object_id))
            except OSError:
                pass
            raise ObjectLostError(f"object {object_id} is lost: its owner (pid {owner}) died, and its objects "
                                  "with it")
        try:
            fd = os.open(self.path(object_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not _alive(owner):
                raise ObjectLostError(f"object {object_id} is lost: its owner (pid {owner}) died, and its objects "
                                      "with it") from None
            raise ObjectLostError(f"object {object_id} was freed by its owner (pid {owner}): no ref to it was "
                                  "left there") from None
        try:
            size = os.fstat(fd).st_size
            if size < len(_MAGIC) + 12:
                raise ObjectLostError(f"object {object_id} is corrupt: {size} bytes")
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with self.lock:
            if object_id in self.owned:
                self.maps.setdefault(object_id, []).append(mm)
        return _decode(memoryview(mm), object_id)

    def ref_added(self, object_id):
        with self.lock:
            entry = self.owned.get(object_id)
            if entry is not None:
                entry[0] += 1

    def ref_dropped(self, object_id):
        with self.lock:
            entry = self.owned.get(object_id)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] > 0 or entry[1]:
                return
            del self.owned[object_id]
        self.recycle(object_id)

    def lent(self, object_id):
        with self.lock:
            entry = self.owned.get(object_id)
            if entry is not None:
                entry[1] = True

    def close(self):
        """Deletes what this process owns (at exit), and the files it kept for reuse."""
        with self.lock:
            owned, self.owned = self.owned, {}
            free, self.free, self.free_bytes = self.free, [], 0
            self.maps.clear()
        for object_id in owned:
            _unlink(self.path(object_id))
        for _, path in free:
            _unlink(path)
        if self.fallback:
            try:
                os.rmdir(self.fallback)  # left if another process's handed-off file is still in it
            except OSError:
                pass


def _pickle(value):
    buffers = []
    try:
        main = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    except Exception:
        buffers = []
        main = cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return main, [b.raw() for b in buffers]


def _decode(view, object_id):
    """The value in a mapped object file; every size is checked against the file first."""
    if view[:4] != _MAGIC:
        raise ObjectLostError(f"object {object_id} is corrupt: bad magic")
    (count,) = struct.unpack_from("<I", view, 4)
    if count > _MAX_BUFFERS or 8 + 8 * (count + 1) > len(view):
        raise ObjectLostError(f"object {object_id} is corrupt: {count} buffers")
    sizes = struct.unpack_from(f"<Q{count}Q", view, 8)
    offset = 8 + 8 * (count + 1)
    if offset + sizes[0] > len(view):
        raise ObjectLostError(f"object {object_id} is corrupt: its pickle runs past the end")
    main = view[offset:offset + sizes[0]]
    offset += sizes[0]
    buffers = []
    for size in sizes[1:]:
        offset += -offset % _ALIGN
        if offset + size > len(view):
            raise ObjectLostError(f"object {object_id} is corrupt: a buffer runs past the end")
        buffers.append(view[offset:offset + size])
        offset += size
    return pickle.loads(main, buffers=buffers)


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _owner_pid(name):
    head = name.partition("-")[0]
    return int(head) if head.isdigit() else 0


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


_store = None
_store_lock = threading.Lock()


def store():
    global _store
    if _store is None or _store.pid != os.getpid():
        with _store_lock:
            if _store is None or _store.pid != os.getpid():
                _store = _Store()
    return _store


def close():
    global _node
    if _store is not None and _store.pid == os.getpid():
        _store.close()
    _node = None
