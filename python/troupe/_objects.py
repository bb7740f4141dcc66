"""Objects made with troupe.put(): one file per object in a per-machine shared-memory directory.

Why files in /dev/shm: every process of the machine (drivers, actors, task workers, and the
nodes of a test bed's network namespaces) maps the same pages, so a get() is an mmap and the
numpy arrays it returns point into them (read-only, as Ray's plasma store returns them); a put()
is one copy, straight from the pickle-5 buffers. No daemon owns the memory,
so nothing has to be started, and an object's lifetime is its owner's (below).

Ownership, as Ray's: the process that put an object owns it. The owner counts its own refs and
deletes the object when the last one is gone. Once it sends a ref to another process (as an
argument, in a result, inside another value), the object is held as Ray's borrowers hold it:
<directory>/.refs/<name>/ holds one file per process that has refs to it (services/
node_objects.h, "Holds"), and one per ref sent and not yet received; each process counts its own
refs and removes its file when its last one goes, and the one that leaves the directory empty
(rmdir: exactly one can) deletes the object. A process of this node does this on the files; one
of another node asks the object's node agent (NodeAgent.holdObject, lendObject, releaseObject).
The agent drops the files of holders that died (asking other nodes' agents about theirs), so a
borrower killed with -9 frees what it held. A call keeps the refs among its arguments until it
is over, so a retry finds them. An owner that exits deletes what it owns, even what others still
hold (their get() raises ObjectLostError naming the owner's death, as Ray's); one killed with -9
leaves files that the agent, or the next process of the machine to open the store, sweeps.
Objects of a process of no node (its machine's directory, which no agent serves) are not held:
one whose ref was sent lives until its owner exits.

Across nodes: a get() of an object of another node pulls it from that node's agent into a file
here (pull); a large put() object's copy is offered to other nodes' pullers meanwhile, which its
node's agent serves them as it arrives (services/node_objects.h, "Serving on").

Limit and spilling, as Ray's: a node's objects may hold up to its limit of memory (`troupe
start --object-store-memory`, default 30% of RAM; TROUPE_OBJECT_STORE_MEMORY in its workers).
A put() that would pass it first gives back the files kept for reuse (below), then moves the
oldest primary copies to the node's spill directory on disk (0700; TROUPE_OBJECT_SPILL_DIR),
skipping those this process has mapped (a value of get() may be using them). A get() of a spilled
object maps its spill file: the kernel reads it back into the page cache, and nothing is copied
back into shared memory, so a restore never needs room in the store nor spills another object.
A put() that cannot fit even then (larger than the limit, or everything left is in use) raises
ObjectStoreFullError and changes nothing. Flash checkpoints keep their own segments outside the
store. Cheap in the common case: the store is scanned only when the whole file system holds
more than the limit. Each file is written under a temporary name and renamed when complete, so
a spiller never copies half an object; spillers take the spill directory's lock, and a spiller
writes the spilled copy before it deletes the one in memory, so a reader finds one of the two.

Reuse: the file of a freed object (1 MB or more) that no other process could have mapped, and
whose mappings here are all closed, is kept and written over by a later put() or pull: its
pages are already allocated (a new file costs the kernel a zeroed page per 4 KB first). A put()
writes it through a writable mapping kept with the file (see reuse), so that put() is one
memcpy. A pulled copy's file is kept the same way once its mapping goes. At most
2 GiB per process (and a quarter of the store's limit) is kept, and never more than half of what
the file system has free when the object is freed: kept pages are memory the machine cannot use
(they count against the limit, and a put() short of room deletes them first). A put() that finds the file system full gives the kept files back and tries once more, and a flash
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
import fcntl
import itertools
import queue
import shutil
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
from typing import Any

import cloudpickle

from .exceptions import ObjectLostError, ObjectStoreFullError, TroupeError

_MAGIC = b"TOB1"
_ALIGN = 64
_MAX_BUFFERS = 1 << 20
# Freed objects' files of at least this size are kept for reuse, up to this much per process.
RECYCLE_MIN_BYTES = 1 << 20
# An object smaller than this is read into memory rather than mapped: cheaper for a few pages,
# and a mapping holds a file descriptor (Python's mmap keeps a dup) while its value lives, so a
# get() of thousands of small objects would run out of them.
READ_MAX_BYTES = 64 << 10
RECYCLE_MAX_BYTES = 2 << 30
# Names of complete objects a spiller may move: put() objects and handed-over results.
_SPILLABLE = re.compile(r"[0-9]+-h?[0-9]+-[0-9a-f]+")
_KEPT = re.compile(r"[0-9]+-free-[0-9]+")


_HOST = None  # (pid, host id of a process of no node given by use_node): forks read it again
# (directory, node id, spill directory, limit) of the node a driver found it runs on (use_node);
# workers have theirs in their environment, from their node agent.
_node = None
# How to reach other nodes' agents (set by _session): nodes.pull(node, name, path), .drop(node, name).
nodes: Any = None  # troupe._session._Nodes: other nodes' agents (set by _session)


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


def use_node(directory, node_id, spill=None, limit=None):
    """A driver's objects go to the directory of the node it runs on, which that node's agent
    serves to other nodes, under that node's limit. Keeps the store as it is if it already owns
    objects."""
    global _node, _store
    if _node == (directory, node_id, spill, limit) or _private_dir_problem(directory) is not None:
        return  # a node of another user (its directory is closed to this one): objects stay here
    with _store_lock:
        if _store is not None and _store.pid == os.getpid() and _store.owned:
            return
        _node = (directory, node_id, spill, limit)
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
        self.host = host_id()
        if _node is not None:
            spill, limit = _node[2], _node[3]
        elif _is_node(self.host):  # a worker: its node agent set these
            spill = os.environ.get("TROUPE_OBJECT_SPILL_DIR")
            limit = int(os.environ.get("TROUPE_OBJECT_STORE_MEMORY") or 0)
        else:
            spill, limit = None, 0
        self.limit = limit or default_limit(self.parent)
        self.spill = spill or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"troupe-spill-{os.getuid()}")
        self.spill_fd = None  # the spill directory, opened (and checked) on first use; its lock
        self.checked = {}  # another process's fallback directory -> whether it is ours and private
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.counter = itertools.count()
        self.owned = {}  # object id -> [local ref count, lent]
        self.maps = {}  # owned object id -> the mappings this process made of it (see recycle)
        self.free = []  # files of freed objects kept for reuse: (size, path, writable mapping or None)
        self.free_bytes = 0
        self.writers = {}  # owned object id -> the writable mapping its file was written through
        self.kept = queue.SimpleQueue()  # pulled copies' files kept once their mapping went
        self.pulled_files = {}  # path -> size of the pulled copies mapped now
        self.pulled = weakref.WeakValueDictionary()  # object id -> the mapping of its pulled copy
        self.refs = os.path.join(root, ".refs")  # holds (see the module's doc)
        self.held = {}  # object id -> this process's refs to an object it borrowed
        self.marked = set()  # object ids whose hold file for this process exists (owned or borrowed)
        self.contained = {}  # owned object id -> the holds of the refs pickled into it [(id, host, record)]
        self.releases = None  # holds of other nodes' objects to release, sent by a thread of their own
        self.offered = {}  # path of a pulled copy offered to other pullers: (host, object, offer)
        self.remote_id = f"{self.host}.{self.pid}" if _is_node(self.host) else f"x{secrets.token_hex(8)}.{self.pid}"
        self.sweep()

    def sweep(self):
        """Deletes the objects of owners that died without cleaning up (kill -9)."""
        for directory in (self.root, self.spill):
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                pid = _owner_pid(name)
                if pid and not _alive(pid):
                    _unlink(os.path.join(directory, name))

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

    def spilled(self, object_id):
        """Where an object's file is once spilled."""
        return os.path.join(self.spill, object_id.rpartition("/")[2])

    def open(self, object_id):
        """The object's file, opened for reading, in memory or spilled (a spiller writes the
        spilled copy before it deletes the other, so one of them is there unless it was freed)."""
        try:
            return os.open(self.path(object_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return os.open(self.spilled(object_id), os.O_RDONLY | os.O_CLOEXEC)

    def exists(self, object_id):
        """Whether an object's file is here, in memory or spilled."""
        return os.path.exists(self.path(object_id)) or os.path.exists(self.spilled(object_id))

    def delete(self, object_id):
        _unlink(self.path(object_id))
        _unlink(self.spilled(object_id))

    def new_id(self, kind=""):
        """kind "h": a result handed over to its caller, "p": a pulled copy (node_objects.h)."""
        name = f"{self.pid}-{kind}{next(self.counter)}-{secrets.token_hex(4)}"
        return f"{os.path.basename(self.root)}/{name}" if self.fallback else name

    def put(self, value):
        outer = getattr(_containing, "refs", None)  # a put() while pickling another's value
        _containing.refs = []  # the refs pickled into the value: it holds them while it lives
        try:
            main, raws = _pickle(value)
        finally:
            inner, _containing.refs = _containing.refs, outer
        object_id, size = self.write(main, raws, keep_writer=True)
        with self.lock:
            self.owned[object_id] = [0, False]
            if inner:
                self.contained[object_id] = inner
        return object_id, size

    def write(self, main, raws, kind="", to_disk_if_full=False, keep_writer=False):
        """Writes one object file (not owned: put() and handoffs decide who deletes it).
        to_disk_if_full: one that does not fit under the limit (a call's argument or result
        larger than the store) goes to the spill directory instead, where readers find it too,
        as Ray falls back to disk for what its store cannot hold. keep_writer: a put(), whose
        file comes back to this process's free list once freed: a reused file is written
        through a mapping kept with it (see reuse)."""
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
        temp = self.path(self.new_id("w"))  # renamed to path once complete: spillers skip it
        for attempt in range(2):
            writer = None
            try:
                fd, writer = self.reserve(offset, temp, keep_writer)
            except ObjectStoreFullError:
                if not to_disk_if_full:
                    raise
                os.makedirs(self.spill, mode=0o700, exist_ok=True)
                path, temp = self.spilled(object_id), f"{self.spilled(object_id)}.{self.pid}.tmp"
                fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            try:
                if writer is not None:
                    _copy_into(writer, parts)  # its pages are allocated: no fault, no SIGBUS
                else:
                    for start in range(0, len(parts), 512):  # IOV_MAX is 1024
                        chunk = parts[start:start + 512]
                        want = sum(memoryview(p).nbytes for p in chunk)
                        if os.writev(fd, chunk) != want:  # a regular file writes short only when it is full
                            raise OSError(errno.ENOSPC, "No space left on device")
                os.ftruncate(fd, offset)  # a reused or reserved file may be longer
            except OSError as e:
                os.close(fd)
                os.unlink(temp)
                self.unmap(writer)
                if e.errno == errno.ENOSPC and attempt == 0 and (self.trim() or self.make_room(offset)):
                    continue  # kept files went back to the system, or objects to disk: once more
                raise TroupeError(f"cannot store a {offset}-byte object in {self.root}: {e} "
                                  "(is the shared-memory file system full?)") from None
            os.close(fd)
            if writer is not None and keep_writer:
                with self.lock:  # before the rename, which makes it spillable
                    self.writers[object_id] = writer
            else:
                self.unmap(writer)  # a call's argument or result: its file leaves this process
            os.rename(temp, path)
            return object_id, offset

    def reserve(self, size, temp, keep_writer=False):
        """Opens `temp` for an object of `size` bytes, making room for it under the limit first
        when the store may be near it (then the file is sized at once, so that other puts count
        it); raises ObjectStoreFullError when there is no room. Returns (fd, the writable mapping
        of a reused file or None: see reuse)."""
        if size > self.limit:
            raise ObjectStoreFullError(
                f"a {size}-byte object does not fit in the object store of {self.root}, whose limit is {self.limit} "
                "bytes (troupe start --object-store-memory, init(object_store_memory=...))")
        if self.surely_fits(size):
            return self.create(size, temp, keep_writer)
        with self.spill_lock():
            over = self.scan()[0] + size - self.limit
            if over > 0 and self.make_room(over, locked=True) < over:
                raise ObjectStoreFullError(
                    f"a {size}-byte object does not fit in the object store of {self.root} (limit {self.limit} bytes): "
                    "what is left there is in use or being written; free some refs, or raise the limit")
            fd, writer = self.create(size, temp, keep_writer)
            os.ftruncate(fd, size)
            return fd, writer

    def surely_fits(self, size):
        """Whether `size` more bytes keep even the whole file system (ours or not) under the
        limit: one statvfs, so the common case scans no directory."""
        try:
            vfs = os.statvfs(self.root)
        except OSError:
            return False
        return (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize + size <= self.limit

    def room_for_copy(self, size):
        """Before a pull of `size` bytes: makes room under the limit as a put would (spilling
        this node's oldest unmapped objects). A pulled copy is made even where no room can be
        made: it is this process's while its value lives, then freed."""
        if not self.limit or not size or self.surely_fits(size):
            return
        with self.spill_lock():
            over = self.scan()[0] + size - self.limit
            if over > 0:
                self.make_room(over, locked=True)

    def create(self, size, temp, keep_writer=False):
        reused = self.reuse(size, temp, keep_writer)
        if reused is None:
            return os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600), None
        return reused

    def scan(self):
        """(bytes the directory's files hold, [(mtime, name, size)] of each)."""
        used, files = 0, []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return 0, []
        for entry in entries:
            if entry.name.startswith("."):
                continue  # .refs
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            used += st.st_size
            files.append((st.st_mtime_ns, entry.name, st.st_size))
        return used, files

    def spill_lock(self):
        """The spill directory's lock (flock: spillers of the node take turns)."""
        if self.spill_fd is None:
            try:
                os.makedirs(self.spill, mode=0o700, exist_ok=True)
            except OSError as e:
                raise ObjectStoreFullError(f"cannot make the spill directory {self.spill}: {e}") from None
            problem = _private_dir_problem(self.spill)
            if problem is not None:
                raise ObjectStoreFullError(f"the spill directory {self.spill} {problem}: not this user's with mode "
                                           "0700, so no object is spilled there")
            self.spill_fd = os.open(self.spill, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return _Flock(self.spill_fd)

    def make_room(self, want, locked=False):
        """Frees `want` bytes of the directory: kept files first, then the oldest spillable
        objects this process has not mapped go to disk. Returns the bytes freed."""
        if not locked:
            with self.spill_lock():
                return self.make_room(want, locked=True)
        freed = 0
        _, files = self.scan()
        files.sort()
        for _, name, have in files:
            if freed < want and _KEPT.fullmatch(name):
                _unlink(os.path.join(self.root, name))  # its process's reuse() finds it gone
                freed += have
        self.forget_gone()  # this process's among them: else their mappings would keep the pages
        with self.lock:
            mapped = {object_id.rpartition("/")[2] for object_id in self.maps}
            writers = {object_id.rpartition("/")[2]: object_id for object_id in self.writers}
        for _, name, have in files:
            if freed >= want:
                break
            if _SPILLABLE.fullmatch(name) and name not in mapped:
                if name in writers:
                    with self.lock:
                        writer = self.writers.pop(writers[name], None)
                    self.unmap(writer)
                freed += self.spill_one(name)
        return freed

    def spill_one(self, name):
        """Moves one object to the spill directory (the spill lock held); returns its size, 0 if
        it went meanwhile."""
        source, target = os.path.join(self.root, name), os.path.join(self.spill, name)
        temp = f"{target}.{self.pid}.tmp"
        try:
            src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        try:
            size = os.fstat(src).st_size
            dst = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            try:
                done = 0
                while done < size:
                    sent = os.sendfile(dst, src, done, min(size - done, 1 << 30))
                    if sent == 0:
                        break
                    done += sent
            except OSError as e:
                os.close(dst)
                _unlink(temp)
                raise ObjectStoreFullError(f"cannot spill object {name} to {self.spill}: {e}") from None
            os.close(dst)
        finally:
            os.close(src)
        os.rename(temp, target)
        try:
            os.unlink(source)
        except FileNotFoundError:
            _unlink(target)  # its owner freed it while it was copied
            return 0
        return size

    def trim(self):
        """Deletes the files kept for reuse (the machine is short of shared memory); True if any."""
        with self.lock:
            self.take_kept()
            free, self.free, self.free_bytes = self.free, [], 0
        for _, path, writer in free:
            _unlink(path)
            self.unmap(writer)
        return bool(free)

    def keep(self, path, size):
        """A freed file kept for reuse: renamed <pid>-free-<n>, and that path returned, while this
        process keeps at most 2 GiB, a quarter of the store's limit and half of what the file
        system has free (the kept files are not in it: they are allocated); else deleted (None).
        Takes no lock: the garbage collector calls it for pulled copies."""
        try:
            vfs = os.statvfs(self.root)
            room = vfs.f_bavail * vfs.f_frsize
        except OSError:
            room = 0
        if size < RECYCLE_MIN_BYTES or size > min(self.keep_cap(), room // 2) - self.free_bytes:
            _unlink(path)
            return None
        free = os.path.join(self.root, f"{self.pid}-free-{next(self.counter)}")
        try:
            os.rename(path, free)
        except OSError:
            _unlink(path)
            return None
        return free

    def take_kept(self):
        """Moves the files keep() queued into the free list (self.lock held)."""
        while True:
            try:
                have, free = self.kept.get_nowait()
            except queue.Empty:
                return
            self.free.append((have, free, None))
            self.free_bytes += have

    def pulled_gone(self, path, size):
        """The mapping of a pulled copy went (at any point of any thread, from the garbage
        collector): its file is kept for reuse, or deleted."""
        offered = self.offered.pop(path, None)
        if offered is not None:  # the next puller is not sent to a copy that is gone
            self.release(offered[1], offered[0], offered[2], "withdraw")
        if self.pulled_files.pop(path, None) is not None:  # else closed
            free = self.keep(path, size)
            if free is not None:
                self.kept.put((size, free))  # no lock here: the next reuse() lists it

    def reuse(self, size, path, keep_writer=False):
        """A freed object's file, renamed to `path` and opened for writing: its pages are already
        allocated, so writing into it costs a copy and no page allocation. None if none fits.
        Returns (fd, a writable mapping of it or None). The mapping is what makes a put() cost a
        memcpy: writing through a file descriptor costs the kernel's work on every 4 KiB page
        (about 15 ms for 100 MB here, a memcpy 5.5 ms), and so does mapping the pages afresh;
        a mapping kept with the file, whose page tables are filled, costs neither. So a put
        (keep_writer) maps a reused file once and keeps that mapping with it, on the live
        object and back on the free list, up to the cap of what this process keeps."""
        while True:
            with self.lock:
                self.take_kept()
                best = None
                for i, (have, _, _) in enumerate(self.free):
                    if size <= have <= 2 * size and (best is None or have < self.free[best][0]):
                        best = i
                if best is None:
                    return None
                have, old, writer = self.free.pop(best)
                self.free_bytes -= have
            try:
                os.rename(old, path)
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                break
            except OSError:
                # Another process deleted it to make room, and likely others kept here: their
                # mappings would keep their pages.
                self.unmap(writer)
                self.forget_gone()
        if writer is None and keep_writer and self.writer_bytes + have <= self.keep_cap():
            try:
                # (No MADV_DONTFORK: a forked child drops its copy of the store, whose mappings'
                # munmap would then hit whatever the child had mapped at those addresses since.)
                writer = mmap.mmap(fd, have, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                writer = None
        return fd, writer

    def forget_gone(self):
        """Drops the kept files that other processes deleted from the free list."""
        with self.lock:
            kept, gone = [], []
            for entry in self.free:
                (kept if os.path.exists(entry[1]) else gone).append(entry)
            self.free = kept
            self.free_bytes -= sum(entry[0] for entry in gone)
        for _, _, writer in gone:
            self.unmap(writer)

    def keep_cap(self):
        """The most bytes of kept files, and of writable mappings, this process holds."""
        return min(RECYCLE_MAX_BYTES, self.limit // 4)

    @property
    def writer_bytes(self):
        """What the writable mappings (of live objects and of kept files) span."""
        with self.lock:
            return sum(len(w) for w in self.writers.values()) + sum(len(w) for _, _, w in self.free if w is not None)

    @staticmethod
    def unmap(writer):
        """Closes a writable mapping (None: nothing)."""
        if writer is not None:
            writer.close()

    def recycle(self, object_id):
        """Deletes a freed object, or keeps its file for reuse when this process made the only
        mappings of it (it was never lent) and none is in use any more (closing a mapping
        that a live array still uses fails)."""
        path = self.path(object_id)
        with self.lock:
            maps = self.maps.pop(object_id, ())
            writer = self.writers.pop(object_id, None)
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # a value from get() still uses it
                self.delete(object_id)
                self.unmap(writer)
                return
        try:
            size = os.stat(path).st_size
        except OSError:
            self.delete(object_id)  # spilled, or being spilled (the spiller then deletes its copy)
            self.unmap(writer)
            return
        with self.lock:
            free = self.keep(path, size)
            if free is not None:
                self.free.append((size, free, writer))
                self.free_bytes += size
                writer = None
        self.unmap(writer)

    def pull(self, object_id, host, take=False, size=0):
        """The value of an object that lives on another node: its bytes are pulled from that
        node's agent into a file here (a freed one of about its `size` when one is kept: its
        pages are allocated), which is mapped (the mapping lives as long as the value's arrays,
        and a later get() while it lives maps it again); once the mapping goes, the file is kept
        for reuse or deleted, as a freed object's. take: a result handed over to this process,
        deleted there once pulled."""
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
            reused = self.reuse(size, path) if size >= RECYCLE_MIN_BYTES else None
            if reused is None:
                self.room_for_copy(size)
            else:
                os.close(reused[0])
                self.unmap(reused[1])
            # A copy of a large put() object is offered to other nodes' pullers: its node's agent
            # serves it while it arrives and while it is mapped here (services/node_objects.h).
            # TROUPE_OBJECT_RELAY=0 keeps this process's copies to itself (every puller then
            # costs the owner's node a copy: bench/objects.py measures that beside relays).
            relay = size > 8 << 20 and not self.fallback and os.environ.get("TROUPE_OBJECT_RELAY", "1") != "0"
            base = nodes.offer_base() if relay else ""
            offer = f"{base}/{os.path.basename(path)}" if base else ""
            try:
                size = nodes.pull(host, object_id, path, reused is not None, offer)
            except ObjectLostError:
                raise
            except TroupeError as e:
                raise ObjectLostError(f"object {object_id} cannot be pulled from node {host}: {e}") from None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if size < len(_MAGIC) + 12:
                        raise ObjectLostError(f"object {object_id} is corrupt: {size} bytes")
                    mm = _read_or_map(fd, size)
                finally:
                    os.close(fd)
            except BaseException:
                _unlink(path)
                raise
            if size >= RECYCLE_MIN_BYTES:
                self.pulled_files[path] = size
                if offer:
                    self.offered[path] = (host, object_id, offer)
                weakref.finalize(mm, self.pulled_gone, path, size).atexit = False  # close() deletes it
            else:
                _unlink(path)
            if take:
                try:
                    nodes.drop(host, object_id)
                except TroupeError:
                    pass  # its writer deletes it when it exits
            elif isinstance(mm, mmap.mmap):  # a small copy read into memory is pulled again
                self.pulled[object_id] = mm
        return _decode(memoryview(mm), object_id)

    def map(self, object_id):
        """The value of a file another process of this host wrote for this one (call arguments)."""
        try:
            fd = self.open(object_id)
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
            self.delete(object_id)

    def take(self, object_id):
        """The value of a handed-off object, which this process now holds alone: the file is
        mapped, then unlinked (the mapping lives as long as the value's arrays)."""
        try:
            fd = self.open(object_id)
        except FileNotFoundError:
            raise ObjectLostError(f"a result handed over in shared memory ({object_id}) is gone") from None
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
            self.delete(object_id)
        if mm is None:
            raise ObjectLostError(f"a result handed over in shared memory ({object_id}) is empty")
        return _decode(memoryview(mm), object_id)

    def get(self, object_id, host, owner, size=0):
        if host != self.host:
            return self.pull(object_id, host, size=size)
        if owner != self.pid and not _alive(owner):  # its file may be left (kill -9): it is lost all the same
            self.delete(object_id)
            raise ObjectLostError(f"object {object_id} is lost: its owner (pid {owner}) died, and its objects "
                                  "with it")
        try:
            fd = self.open(object_id)
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
            mm = _read_or_map(fd, size)
        finally:
            os.close(fd)
        with self.lock:
            if object_id in self.owned and isinstance(mm, mmap.mmap):
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
            held = object_id in self.marked
            self.marked.discard(object_id)
            maps = self.maps.pop(object_id, ()) if held else ()
            writer = self.writers.pop(object_id, None) if held else None
        self.unmap(writer)
        if not held:
            self.recycle(object_id)
            self.let_go(object_id)
            return
        for mm in maps:  # others may map the file: it is deleted, never reused
            try:
                mm.close()
            except BufferError:
                pass
        if self.release_here(object_id, str(self.pid)):
            self.let_go(object_id)
        # else others hold it: what it contains stays held until this process exits

    def let_go(self, object_id):
        """Releases the holds of the refs pickled into an object that is gone."""
        with self.lock:
            inner = self.contained.pop(object_id, ())
        for inner_id, host, record in inner:
            self.release(inner_id, host, record)

    def owns(self, object_id):
        with self.lock:
            return object_id in self.owned

    def lend(self, object_id, host, pin=False):
        """A ref to this object is being sent to another process: returns what its receiver names
        when it arrives (the sender's holder id and a token), or None for an object not held
        (of no node's directory: it then lives until its owner exits). pin: the ref was pickled
        out of band (by the user, or in a function's closure, which every worker that runs it
        unpickles): its record stays until this process exits, as Ray pins such an object."""
        if not _held_kind(object_id, host):
            with self.lock:
                entry = self.owned.get(object_id)
                if entry is not None:
                    entry[1] = True
            return None
        token = secrets.token_hex(4)
        if host == self.host:
            self.mark(object_id)
            holder = str(self.pid)
            _touch(os.path.join(self.refs, object_id, f"{holder}:{token}"), object_id)
        else:
            holder = self.remote_id
            _call_node(host, "lend", object_id, holder, token)
        container = getattr(_containing, "refs", None)
        if container is not None:  # into a put() value: the record is the value's until it goes
            container.append((object_id, host, f"{holder}:{token}"))
            return holder, token, True
        if pin:  # no arrival takes the record: it goes with this process
            return holder, token, True
        return holder, token

    def mark(self, object_id):
        """Makes this process's hold file of an object of this node (once). The first one of an
        object appears with its directory (made aside and renamed into place), so that nobody
        sees the directory empty and takes the object for freed."""
        with self.lock:
            if object_id in self.marked:
                return
            self.marked.add(object_id)
        target = os.path.join(self.refs, object_id)
        try:
            _touch(os.path.join(target, str(self.pid)), object_id)
            return
        except ObjectLostError:
            if not self.owns(object_id):
                return  # a borrower's object that was freed: a get() says so
            # no directory yet: this is the owner's first lend
        os.makedirs(self.refs, mode=0o700, exist_ok=True)
        temp = os.path.join(self.refs, f".new-{self.pid}-{next(self.counter)}")
        os.mkdir(temp, 0o700)
        _touch(os.path.join(temp, str(self.pid)), object_id)
        try:
            os.rename(temp, target)
        except OSError:  # made meanwhile by another holder
            shutil.rmtree(temp, ignore_errors=True)
            _touch(os.path.join(target, str(self.pid)), object_id)

    def hold(self, object_id, host, lent):
        """A ref to an object another process sent arrived here: counts it, makes this process's
        hold (its first ref of the object) and removes the sender's in-flight record. Returns
        whether the ref is counted (False for an object not held, see lend)."""
        if lent is None or not _held_kind(object_id, host):
            return False
        landed = "" if len(lent) > 2 else f"{lent[0]}:{lent[1]}"  # a value's record stays its own
        with self.lock:
            if object_id in self.owned:  # back at its owner
                self.owned[object_id][0] += 1
                first, owner = False, True
            else:
                first, owner = object_id not in self.held, False
                self.held[object_id] = self.held.get(object_id, 0) + 1
        try:
            if host == self.host:
                if first:
                    self.mark(object_id)
                if landed:
                    _unlink(os.path.join(self.refs, object_id, landed))
            else:
                _call_node(host, "hold", object_id, self.remote_id, landed)
        except (ObjectLostError, TroupeError):
            pass  # freed before it arrived (its sender died): a get() says so
        return not owner

    def unhold(self, object_id, host):
        """A borrowed ref was dropped: the last one of the object here releases this process's hold."""
        with self.lock:
            count = self.held.get(object_id, 0) - 1
            if count > 0:
                self.held[object_id] = count
                return
            self.held.pop(object_id, None)
            self.marked.discard(object_id)
        self.release(object_id, host, str(self.pid) if host == self.host else self.remote_id)

    def release(self, object_id, host, holder, op="release"):
        """Removes a hold (or a value's record) of this process; another node's by a thread of
        its own (refs are dropped anywhere, in __del__ too, where nothing may block). op
        "withdraw": `holder` is an offer of a pulled copy that went, for the object's agent to
        forget (see pull)."""
        if host == self.host and op == "release":
            self.release_here(object_id, holder)
            return
        if sys.is_finalizing():
            return  # no thread starts now: the agent drops this process's holds once it has exited
        with self.lock:
            if self.releases is None:
                self.releases = queue.SimpleQueue()
                threading.Thread(target=_send_releases, args=(self.releases,), name="troupe-object-releases",
                                 daemon=True).start()
        self.releases.put((op, host, object_id, holder))

    def release_here(self, object_id, holder):
        """Removes a hold file of an object of this node; the holder that empties its directory
        deletes the object."""
        directory = os.path.join(self.refs, object_id)
        _unlink(os.path.join(directory, holder))
        try:
            os.rmdir(directory)
        except OSError:
            return False  # others hold it (or it went already)
        self.delete(object_id)
        return True

    def close(self):
        """Deletes what this process owns (at exit), and the files it kept for reuse."""
        with self.lock:
            owned, self.owned = self.owned, {}
            held, self.held = self.held, {}
            contained, self.contained = self.contained, {}
            self.take_kept()
            free, self.free, self.free_bytes = self.free, [], 0
            writers, self.writers = list(self.writers.values()), {}
            self.maps.clear()
            self.marked.clear()
        for object_id in owned:
            self.delete(object_id)
            shutil.rmtree(os.path.join(self.refs, object_id), ignore_errors=True)
        for object_id in held:  # borrowed here; the agents drop this process's holds elsewhere
            if "/" not in object_id and os.path.isdir(os.path.join(self.refs, object_id)):
                self.release_here(object_id, str(self.pid))
        for inner in contained.values():
            for inner_id, host, record in inner:
                if host == self.host:
                    self.release_here(inner_id, record)
        for _, path, writer in free:
            _unlink(path)
            self.unmap(writer)
        for writer in writers:
            self.unmap(writer)
        for path in list(self.pulled_files):
            if self.pulled_files.pop(path, None) is not None:
                _unlink(path)
        if self.spill_fd is not None:
            os.close(self.spill_fd)
            self.spill_fd = None
        if self.fallback:
            try:
                os.rmdir(self.fallback)  # left if another process's handed-off file is still in it
            except OSError:
                pass


def _held_kind(object_id, host):
    """Whether an object is held (see the module's doc): it is in a node's directory."""
    return _is_node(host) and "/" not in object_id


def _touch(path, object_id):
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except FileNotFoundError:
        raise ObjectLostError(f"object {object_id} was freed: no ref to it was left") from None


def _call_node(host, op, name, holder, extra=""):
    if nodes is None:
        raise ObjectLostError(f"object {name} lives on node {host}, and this process is not connected to its cluster")
    nodes.hold(host, op, name, holder, extra)


def _send_releases(releases):
    while True:
        op, host, object_id, holder = releases.get()
        try:
            if op == "withdraw":
                _call_node(host, op, object_id, "", holder)
            else:
                _call_node(host, op, object_id, holder)
        except Exception:  # the node or cluster is gone: its agent's sweep drops the hold
            pass


class _Flock:
    def __init__(self, fd):
        self.fd = fd

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def default_limit(directory):
    """Ray's default: 30% of the machine's memory, at most what the file system holds."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 3 // 10
    try:
        vfs = os.statvfs(directory)
        limit = min(limit, vfs.f_blocks * vfs.f_frsize)
    except OSError:
        pass
    return limit


_ours = threading.local()  # .depth: Troupe itself is pickling on this thread (a call, a reply, a put)


class ours:
    """Marks Troupe's own pickling (puts here, calls and replies in _serialization): a ref
    pickled outside it (pickle.dumps by the user, a function's closure) is out of band, and
    pinned (see _refs._StoredRef.__reduce__)."""

    def __enter__(self):
        _ours.depth = getattr(_ours, "depth", 0) + 1

    def __exit__(self, *exc):
        _ours.depth -= 1


def pickling_ours():
    return getattr(_ours, "depth", 0) > 0


def _read_or_map(fd, size):
    if size < READ_MAX_BYTES:
        data = os.pread(fd, size, 0)
        if len(data) != size:
            raise OSError(errno.EIO, f"read {len(data)} of {size} bytes")
        return data
    return mmap.mmap(fd, size, prot=mmap.PROT_READ)


def _pickle(value):
    buffers = []
    with ours():
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


def _copy_into(mapping, parts):
    """Copies `parts` one after another into a mapping from its start."""
    view = memoryview(mapping)
    try:
        at = 0
        for part in parts:
            part = memoryview(part).cast("B")
            view[at:at + part.nbytes] = part
            at += part.nbytes
    finally:
        view.release()


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
_containing = threading.local()  # .refs: the holds of refs pickled into the value a put() writes


def store():
    global _store
    if _store is None or _store.pid != os.getpid():
        with _store_lock:
            if _store is None or _store.pid != os.getpid():
                _raise_open_files_limit()
                _store = _Store()
    return _store


def _raise_open_files_limit():
    """Each mapped object holds a file descriptor while its value lives: the soft limit
    (often 1024) goes up to the hard one (at most 65536), as Ray's processes do."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        pass


def close():
    global _node
    if _store is not None and _store.pid == os.getpid():
        _store.close()
    _node = None
