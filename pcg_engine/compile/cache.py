"""The on-disk compile cache: a verified, private directory per engine configuration.

Two ways to use an entry. By default (compile/saved_trace.py) a start that builds the entry saves
the whole traced, split and compiled forward in it, and later starts load that file without Dynamo
or Inductor; the key must then cover every trace-time decision (the PCG_* switches, Inductor's
TORCHINDUCTOR_* settings). With PCG_SAVED_TRACE=0 the entry is Inductor's own FX graph cache, which
keys each graph by its code, input metadata, Inductor config and versions. This file adds what
neither does: one directory per engine configuration, integrity checks, and refusal of
directories other users could tamper with.

  <root>/<key>/inductor/   TORCHINDUCTOR_CACHE_DIR while the set-up compiles
  <root>/<key>/triton/     TRITON_CACHE_DIR likewise
  <root>/<key>/trace-kv<N>x<B>.bin   a saved trace, one per KV-cache shape: N blocks of B tokens (saved_trace.py)
  <root>/<key>/manifest.json   sha256 and size of every file, written last and atomically

key = sha256(model config, sha256 of pcg_engine/**/*.py as imported, torch/triton/python versions, device,
dtype, buckets, mode, fuse/kernels, saved trace on/off, the PCG_* and TORCHINDUCTOR_* settings). At
start an entry with no manifest (an interrupted build), a manifest for other fields, a missing,
changed or unreadable file is deleted and rebuilt, never used, with a warning that says why; so is
an entry with a folder or file inside that another user owns or could write, or a symlink, and an
entry that is a symlink itself. A file the manifest does not list (a start killed while it added
to a hit, a temporary file) is removed and the verified rest used. Only what a start wrote itself
is hashed into the manifest: a hit never re-signs the files it checked.

A full disk never leaves a broken entry behind: a manifest that cannot be written leaves the start
running on what it compiled (compile/setup.py), and a compile that fails for lack of space is a
CompileCacheError naming compile_cache_dir; either way the half-built entry is removed. A start
that waits on the key's lock (another start builds the entry) says so.
"""

import contextlib
import errno
import functools
import hashlib
import json
import os
import platform
import shutil
import stat
import struct
import warnings
from pathlib import Path

import torch

from pcg_engine import _sources, switches
from pcg_engine.cache_home import cache_home
from pcg_engine.compile import saved_trace
from pcg_engine.errors import PcgError

MANIFEST = "manifest.json"
FORMAT = 1


class CompileCacheError(PcgError, PermissionError):
    """The compile cache's directory cannot be used (EngineConfig.compile_cache_dir)."""

    def __init__(self, message: str, unwritable: bool = False):
        self.field = "compile_cache_dir"
        # This user may not write there (a read-only mount, chmod 500): the set-up then starts
        # without the cache instead (setup.py). A directory others could write is refused.
        self.unwritable = unwritable
        super().__init__(f"compile_cache_dir: {message}")


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def default_cache_root() -> Path:
    return cache_home() / "compile"


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """Once per process: the sources as imported (pcg_engine/_sources.py). Files edited since then
    (the lazily imported modules, this one included, may run the edit) give a key of both hashes,
    which no process that imported either tree alone shares."""
    now = _sources.digest()
    return now if now == _sources.AT_IMPORT else f"{_sources.AT_IMPORT}+{now}"


def _versions() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}


def _config_json(hf_config) -> str:
    if hasattr(hf_config, "to_json_string"):
        return hf_config.to_json_string()
    return json.dumps(vars(hf_config), sort_keys=True, default=str)


def _device_key(device: torch.device) -> str:
    """The device as the saved code sees it. A CUDA device by its index too: the saved trace and
    the pieces are made for the device they were traced on, so two GPUs of one model in one host
    (cuda:0, cuda:1) get an entry each instead of one each start would find traced for the other.
    (Under CUDA_VISIBLE_DEVICES each process's GPU is cuda:0 to it, and one entry serves them all.)"""
    if device.type != "cuda":
        # Inductor's CPU code is built for this host's vector ISA (AVX-512 here, AVX2 under
        # ATEN_CPU_CAPABILITY=avx2 or on another CPU) and its thread count (OpenMP or not): an
        # entry of one loaded under another gave wrong tokens (found by a review).
        # (ATen's capability, which ATEN_CPU_CAPABILITY sets: Inductor's own probe compiles test
        # programs into the shared temporary directory.)
        return f"{device.type}:{torch.backends.cpu.get_cpu_capability()}:threads={torch.get_num_threads()}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index}:{torch.cuda.get_device_name(index)}"


def cache_fields(runner, buckets, decode_buckets) -> dict:
    return {
        "format": FORMAT,
        "model_config": _config_json(runner.hf_config),
        "sources": source_hash(),
        **_versions(),
        "device": _device_key(runner.device),
        "dtype": str(runner.dtype),
        "buckets": list(buckets or []),
        "decode_buckets": list(decode_buckets or []),
        "mode": runner.mode,
        "fuse": bool(getattr(runner.model, "fused", False)),
        "kernels": bool(getattr(runner.model, "kernels", False)),
        # An entry with a saved trace holds standalone artifacts, one without Inductor's FX cache:
        # neither serves the other (compile/saved_trace.py).
        "saved_trace": saved_trace.enabled(),
        # The A/B switches: several decide at trace time what the graph calls (PCG_SKINNY_GEMM,
        # PCG_FUSED_ROPE_ATTENTION, ...), and Inductor's settings decide its code: a saved trace
        # keeps both.
        "switches": _switches(),
    }


# PCG_* variables that change nothing the cache holds (a label, the start-up's own switches).
_NOT_SWITCHES = {"PCG_COMMIT", "PCG_STARTUP_PROFILE", "PCG_PRECOMPILE", "PCG_PRECOMPILE_WORKERS"}


def _switches() -> dict:
    # The PCG_* switches as this process runs them: those read at import as they were read then
    # (pcg_engine/switches.py), not as the environment may say now.
    settings = {k: v for k, v in switches.effective().items() if k not in _NOT_SWITCHES}
    settings.update((k, v) for k, v in os.environ.items()
                    if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR")
    settings.update(_triton_settings())
    return dict(sorted(settings.items()))


def _triton_settings() -> dict:
    """The TRITON_* settings Triton keys its own kernel cache by (TRITON_DEFAULT_FP_FUSION, ...), as
    Triton reports them: a saved trace loads its kernels without Triton's cache, so an entry made
    under one value served a start under another (found by a review). Where Triton cannot
    say (not installed, or a version without the call): nothing."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        return {k: str(v) for k, v in get_cache_invalidating_env_vars().items()}
    except (ImportError, AttributeError):
        return {}


def _uid() -> int | None:
    """This user's id; None where the platform has none (no POSIX owners to compare)."""
    return os.getuid() if hasattr(os, "getuid") else None


def _owned_by_another(st) -> bool:
    return _uid() is not None and st.st_uid != _uid()


def _not_private(st) -> str | None:
    """None when this user owns the directory of stat `st` and neither group nor others can write it."""
    if _owned_by_another(st):
        return f"is owned by uid {st.st_uid}, not by this user (uid {_uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"(mode {oct(st.st_mode & 0o777)}) lets group or others write it"
    return None


def check_private(path: Path) -> None:
    """Refuse a directory another user owns or that group/others can write: they could plant code."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CompileCacheError(f"compile cache path {path} is not a directory")
    problem = _not_private(st)
    if problem is not None:
        hint = ("use compile_cache_dir= a directory of your own" if _owned_by_another(st)
                else "chmod 700 it or choose another compile_cache_dir")
        raise CompileCacheError(f"refusing compile cache directory {path}: {problem}; {hint}")


def check_parents(path: Path) -> None:
    """Refuse a cache directory under one that others can write without the sticky bit: they could
    rename the checked directory away and put theirs in its place before Inductor or the saved
    trace reads from it (under a sticky directory such as /tmp only the owner may rename). Group
    write counts as others' write unless the group is the user's own private group: with per-user
    groups (umask 002) ~/.cache is often group-writable, which lets no one else in, while a
    project directory shared by a team (root:team 2775) lets every member swap the cache."""
    absolute = Path(os.path.abspath(path))
    for parent in dict.fromkeys([*reversed(absolute.parents), *reversed(absolute.resolve().parents)]):
        try:
            st = os.stat(parent)
        except OSError:
            continue          # not there yet: open() creates it, as this user
        mode = st.st_mode
        # Its owner may rename what it holds whatever its mode: a folder another user made (an
        # XDG_CACHE_HOME under /tmp that someone created first) would let them swap the checked
        # root for theirs after the checks.
        if hasattr(os, "getuid") and st.st_uid not in (0, os.getuid()):
            raise CompileCacheError(f"refusing compile cache directory {path}: {parent} is owned by uid {st.st_uid}, "
                                    f"who could rename or replace what it holds; choose another compile_cache_dir")
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise CompileCacheError(f"refusing compile cache directory {path}: {parent} (mode {oct(mode & 0o7777)}) "
                                    f"lets anyone rename or replace what it holds (world-writable, no sticky bit); "
                                    f"choose another compile_cache_dir")
        # With an access ACL the group bits are its mask: a named user or group the ACL lets write
        # may, whoever owns the folder's group, so the private-group exemption does not cover them.
        writer = _acl_writer(parent) if mode & stat.S_IWGRP and not mode & stat.S_ISVTX else None
        if writer is not None:
            raise CompileCacheError(f"refusing compile cache directory {path}: {parent} (mode {oct(mode & 0o7777)}) "
                                    f"has an access ACL that lets {writer} rename or replace what it holds (no "
                                    f"sticky bit); choose another compile_cache_dir")
        if mode & stat.S_IWGRP and not mode & stat.S_ISVTX and not _private_group(st.st_gid):
            raise CompileCacheError(f"refusing compile cache directory {path}: {parent} (mode {oct(mode & 0o7777)}) "
                                    f"lets the members of group {st.st_gid} rename or replace what it holds "
                                    f"(group-writable, no sticky bit); choose another compile_cache_dir")


_ACL_USER, _ACL_GROUP, _ACL_WRITE = 0x02, 0x08, 0x02


def _acl_writer(path) -> str | None:
    """Who else a POSIX access ACL on `path` lets write it (Linux's system.posix_acl_access: a
    version, then (tag, permissions, id) entries), as words; None without such an entry. Only
    named users other than this one and named groups other than the user's private group count:
    an ACL that grants others read only (u:www-data:r-x) leaves the folder as private as before."""
    try:
        blob = os.getxattr(path, "system.posix_acl_access")
    except (AttributeError, OSError):   # no xattrs here (not Linux), none set (ENODATA), not supported
        return None
    for offset in range(4, len(blob) - 7, 8):
        tag, perm, who = struct.unpack_from("<HHI", blob, offset)
        if not perm & _ACL_WRITE:
            continue
        if tag == _ACL_USER and who != _uid():
            return f"user {who}"
        if tag == _ACL_GROUP and not _private_group(who):
            return f"the members of group {who}"
    return None


def _private_group(gid: int) -> bool:
    """gid is this user's own group: the user's primary group, named after the user, with no
    other listed member (the user-private-group scheme of most Linux distributions)."""
    try:
        import grp
        import pwd
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.getuid())
    except (ImportError, KeyError):
        return False              # no group database entry (or no such database): not known private
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(entry: Path) -> list[Path]:
    # Lock files are Inductor's and Triton's inter-process locks: empty, never loaded, and created
    # or removed by whoever compiles next, so they are neither listed nor checked.
    return sorted(p for p in entry.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not p.name.endswith(".lock"))


def _make_private_dirs(path: Path) -> None:
    """Create `path` and each missing folder above it, mode 0700 whatever the umask.
    os.makedirs gives its mode to the last folder only: under umask 000 the parents it made
    ($XDG_CACHE_HOME/pcg_engine) came out 0777, and check_parents refused the cache on every start."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:     # another start made it meanwhile: open()'s checks judge it
            continue
        os.chmod(folder, 0o700)     # mkdir's mode is masked by the umask


def _entry_paths(entry: Path):
    """(path relative to the entry, lstat) of every folder and file inside it, symlinks not followed."""
    for folder, dirs, names in os.walk(entry):
        for name in dirs + names:
            path = os.path.join(folder, name)
            yield os.path.relpath(path, entry), path, os.lstat(path)


_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _shared_path_in(entry: Path) -> str | None:
    """None when this user owns every folder and file in the entry and none is writable by group
    or others or is a symlink; else the first that is not (the entry is then rebuilt). Lock files
    are not checked, as _files leaves them out: never loaded."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for where, _, st in _entry_paths(entry):
        if where.endswith(".lock") and not stat.S_ISDIR(st.st_mode):
            continue
        if stat.S_ISLNK(st.st_mode):
            return f"{where} is a symlink"
        if uid is not None and st.st_uid != uid:
            return f"{where} is owned by uid {st.st_uid}, not by this user"
        if st.st_mode & _GROUP_OTHER_WRITE:
            return f"{where} (mode {oct(st.st_mode & 0o777)}) is writable by group or others"
    return None


def _remove_tree(entry: Path) -> None:
    """shutil.rmtree, after giving this user write on its own folders in the entry (one made read-
    only stopped the delete halfway, leaving a broken entry for every later start). A folder of
    another user is left as it is: rmtree then fails on it, and the caller says where."""
    uid = os.getuid() if hasattr(os, "getuid") else None

    def owner_rwx(path, st):
        # read and search too: a folder without them cannot be walked or emptied
        if stat.S_ISDIR(st.st_mode) and (uid is None or st.st_uid == uid) and \
                st.st_mode & stat.S_IRWXU != stat.S_IRWXU:
            os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
    owner_rwx(entry, os.lstat(entry))
    for _, path, st in _entry_paths(entry):     # a folder is fixed before the walk enters it
        owner_rwx(path, st)
    shutil.rmtree(entry)


def _drop_group_and_other_write(entry: Path) -> None:
    """Before an entry is signed: what Inductor and Triton made under a loose umask (0777 folders,
    0666 files) loses group and other write, so the next start's check does not reject the entry.
    Safe here: open() made the entry 0700 (a miss creates it so, a hit sets it), so no one else
    could reach into it while this start wrote."""
    for _, path, st in _entry_paths(entry):
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & _GROUP_OTHER_WRITE:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~_GROUP_OTHER_WRITE)


class CompileCache:
    def __init__(self, root, fields: dict):
        self.root = Path(root) if root is not None else default_cache_root()
        self.fields = fields
        blob = json.dumps(fields, sort_keys=True).encode()
        self.key = hashlib.sha256(blob).hexdigest()[:32]
        self.entry = self.root / self.key
        self.state: str | None = None       # "hit" (verified entry) or "miss" (new build)
        self.rejected: str | None = None    # why an existing entry was deleted
        self._lock_fd: int | None = None
        self._verified: dict = {}           # a hit's manifest records, as verify() checked them

    def open(self) -> str:
        """Create/verify the directories; returns 'hit' or 'miss'. Holds the key's lock until close()."""
        check_parents(self.root)
        if not self.root.exists():
            try:
                _make_private_dirs(self.root)
            except OSError as e:   # a path under a file, a read-only place
                raise CompileCacheError(f"cannot create {self.root}: {e.strerror or e}; choose another directory "
                                        "(or compile_cache=False)", unwritable=e.errno in _UNWRITABLE) from None
        # From here on the directory's real path, checked again: a symlink on the way (one in a
        # sticky /tmp is its creator's to replace) could otherwise be pointed elsewhere after the
        # checks, and Inductor and the saved trace would load from there.
        self.root = Path(os.path.realpath(self.root))
        self.entry = self.root / self.key
        check_parents(self.root)
        check_private(self.root)
        try:
            self._lock()
            return self._open_entry()
        except CompileCacheError:
            self.close()
            raise
        except OSError as e:
            # A directory this user cannot write (chmod 500, a read-only mount) fails on the key's
            # lock file or the entry: say which setting is at fault, not a bare PermissionError.
            self.close()
            raise CompileCacheError(f"cannot write {e.filename or self.root}: {e.strerror or e}; make "
                                    f"{self.root} writable, choose another directory (or compile_cache=False)",
                                    unwritable=e.errno in _UNWRITABLE) from e
        except BaseException:
            self.close()
            raise

    def _open_entry(self) -> str:
        if os.path.islink(self.entry):
            # The entry itself a symlink (its checks below would follow it, and a hit load from
            # wherever it points): the link is removed and the entry built afresh in its place.
            self._reject("the entry is a symlink", self.entry.unlink)
        elif self.entry.exists():
            # Damage of the entry itself (a file in its place, a chmod 777, a copy owned by
            # another user) is rebuilt like damage inside it: refusing it stopped every start
            # until someone deleted it by hand. A directory that cannot be removed is then said.
            st = os.lstat(self.entry)
            if not stat.S_ISDIR(st.st_mode):
                self._reject("the entry is not a directory", self.entry.unlink)
                return self._new_entry()
            problem = _not_private(st)
            if problem is not None:
                if not _owned_by_another(st):
                    # closed before the delete: while loose, others could add files to it (the
                    # delete then fails and the start with it) or race the delete's chmods
                    os.chmod(self.entry, 0o700)
                self._reject(f"the entry {problem}", lambda: _remove_tree(self.entry))
                return self._new_entry()
            # Ours and no one else's (checked), made 0700: private while this start may write into
            # it (a hit adds files: a new KV-cache shape's trace and Inductor's code, 0777 / 0666
            # under umask 000, and signs them), and deletable if rejected where this user made it
            # read-only.
            os.chmod(self.entry, 0o700)
            # Every folder and file inside too: the entry's own mode does not stop another user
            # from writing into a folder below it that they can reach and write (Inductor makes
            # its folders 0777 under umask 000), after verify() has read the file and before it
            # is loaded.
            problem = _shared_path_in(self.entry) or self.verify()
            if problem is None:
                self.state = "hit"
                return self.state
            self._reject(problem, lambda: _remove_tree(self.entry))
        return self._new_entry()

    def _new_entry(self) -> str:
        os.makedirs(self.entry, mode=0o700)
        os.chmod(self.entry, 0o700)
        self.state = "miss"
        return self.state

    def _reject(self, problem: str, remove) -> None:
        self.rejected = problem
        try:
            remove()
        except OSError as e:
            # unwritable: a read-only root (chmod 500) starts without the cache, as before (setup.py)
            raise CompileCacheError(f"compile cache entry {self.entry} is not usable ({problem}) and cannot be "
                                    f"deleted: {e.filename or self.entry}: {e.strerror or e}; delete it by hand, "
                                    "choose another directory (or compile_cache=False)",
                                    unwritable=e.errno in _UNWRITABLE) from None
        # Said, not only counted (timings' compile_cache_rebuilt): a start that was to be warm
        # compiles for minutes, and a damaged cache is worth knowing about.
        warnings.warn(f"compile cache entry {self.entry} not used ({problem}): deleted, compiling afresh")

    def verify(self) -> str | None:
        """None when the entry is complete and unchanged, else what is wrong with it."""
        path = self.entry / MANIFEST
        if not path.exists():
            return "no manifest (interrupted build)"
        try:
            manifest = json.loads(path.read_text())
            fields = manifest.get("fields")
            # Every file's record read here, inside the try: a damaged manifest can still be valid
            # JSON (one bit turns "size" into "sizg") and must be rejected, not raise at the start.
            files = {name: (meta["size"], meta["sha256"]) for name, meta in manifest["files"].items()}
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            return f"unreadable manifest ({type(e).__name__}: {e})"
        if fields != self.fields:
            return "manifest written for other versions or settings"
        present = {str(p.relative_to(self.entry)) for p in _files(self.entry)}
        missing = set(files) - present
        if missing:
            return f"files missing from the entry ({sorted(missing)[:3]})"
        for name, (size, sha256) in files.items():
            p = self.entry / name
            try:
                if p.stat().st_size != size or _sha256(p) != sha256:
                    return f"checksum mismatch in {name}"
            except OSError as e:       # chmod 000, an I/O error: not "cannot write" the directory
                return f"unreadable file {name} ({e.strerror or e})"
        # Files the manifest does not list: a start killed while it added to a hit (a new KV
        # shape's trace, Inductor's code of a new piece), a temporary file of an interrupted write,
        # or anything planted. None is loaded once removed (a listed file is what the entry was
        # signed as), so the verified rest stays a hit: rejecting the whole entry for them cost a
        # full cold compile.
        for name in sorted(present - set(files)):
            try:
                os.unlink(self.entry / name)
            except OSError as e:
                return f"unlisted file {name} cannot be removed ({e.strerror or e})"
        self._verified = manifest["files"]
        return None

    def _lock(self) -> None:
        """One process per key at a time: a second start waits for the first build and then hits,
        instead of deleting a build in progress as 'interrupted'."""
        if self._lock_fd is not None:
            return
        self._lock_fd = os.open(self.root / f"{self.key}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - no POSIX locks: builds are not serialised
            return
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Another start holds it (building this entry, or stopped while it did): said, since
            # the wait has no end of its own and printed nothing.
            warnings.warn(f"waiting for another start that holds {self.root / (self.key + '.lock')} (it builds "
                          f"or checks compile cache entry {self.entry}); compile_cache=False starts without it")
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)     # releases the flock
            self._lock_fd = None

    def commit(self, written=()) -> None:
        """Record every file of the entry; written last, atomically, so a partial build has none.

        Only what this start wrote is hashed: new files, and `written` (paths it replaced, such as
        a saved trace that failed to load). A hit keeps the records verify() checked for the other
        files it found: hashing them again would trust whatever is on disk now, so a file changed
        since the check would be signed as good for every later start instead of caught by the
        next one. (A hit adds files too: the saved trace of a new KV-cache shape.)"""
        _drop_group_and_other_write(self.entry)
        replaced = {str(Path(p).relative_to(self.entry)) for p in written}
        files = {}
        for p in _files(self.entry):
            name = str(p.relative_to(self.entry))
            kept = None if name in replaced else self._verified.get(name)
            files[name] = kept or {"size": p.stat().st_size, "sha256": _sha256(p)}
        if self.state == "hit" and files == self._verified:
            return                          # nothing new: the verified manifest stands
        tmp = self.entry / (MANIFEST + ".tmp")
        # Owner-only whatever the umask: the next start's check refuses a manifest others could write.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"fields": self.fields, "files": files}, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.entry / MANIFEST)

    def abandon(self) -> None:
        """A build that cannot be completed (no space left). A new entry's files are removed, so
        they free the space they took (it has no manifest: the next start rebuilds it). A hit's
        entry stays: its verified files are good, and what this start added unlisted is removed
        by the next start's check."""
        if self.state == "miss":
            with contextlib.suppress(OSError):
                _remove_tree(self.entry)

    @contextlib.contextmanager
    def activate(self):
        """Inductor and Triton read and write this entry (and only it) while the set-up compiles."""
        with _inductor_dirs(self.entry / "inductor", self.entry / "triton"), _fx_cache(True):
            yield self


@contextlib.contextmanager
def _set_env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _inductor_dirs(inductor_dir: Path, triton_dir: Path):
    # Inductor's in-memory caches are keyed by content hash, so modules already loaded in this
    # process stay valid whichever directory they came from; they are not cleared.
    inductor_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    triton_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _set_env("TORCHINDUCTOR_CACHE_DIR", str(inductor_dir)), _set_env("TRITON_CACHE_DIR", str(triton_dir)), \
            _no_shared_headers():
        yield


def _no_shared_headers():
    """Inductor's precompiled C++ headers off while the set-up compiles. Inductor keeps them in
    <tmp>/torchinductor_<user>/precompiled_headers whatever TORCHINDUCTOR_CACHE_DIR says (a path
    fixed when torch._inductor.codecache is imported) and includes a header it finds there in
    every CPU kernel it builds, unchecked: another user who made that directory first could put
    code into the libraries this start builds, and a compile cache entry would then sign and
    serve them. Without the header the same kernels build from the sources under the entry
    (a CPU start of the tiny model took as long either way: 19.5-20.1 s without, 20.7-21.2 with)."""
    import torch._inductor.config as inductor_config
    return _patched([(inductor_config, "cpp_cache_precompile_headers")], False)


def _fx_cache(enabled: bool):
    """Turn Inductor's local FX graph cache (and AOTAutograd's, built on it) on or off."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    return _patched([(inductor_config, "fx_graph_cache"), (functorch_config, "enable_autograd_cache")], enabled)


@contextlib.contextmanager
def _patched(settings, value):
    """Each (config module, name) of settings that this torch has set to value, restored after."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in settings if hasattr(mod, name)]
    for mod, name, _ in saved:
        setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, old in saved:
            setattr(mod, name, old)


@contextlib.contextmanager
def no_cache(scratch: Path):
    """compile_cache=False: every start compiles from scratch (nothing read or written). Turning
    Inductor's FX graph cache off is not enough: Inductor still writes its generated code and the
    libraries it builds under TORCHINDUCTOR_CACHE_DIR (/tmp/torchinductor_<user> by default), and
    loads a library already there under the same hash without building or checking it, so a start
    read what an earlier one (or anyone who could write there) left. While the set-up compiles,
    Inductor and Triton work in scratch instead: an empty private directory of this start only,
    and Inductor's shared precompiled headers are off (_no_shared_headers)."""
    with _inductor_dirs(scratch / "inductor", scratch / "triton"), _fx_cache(False):
        yield


def inductor_cache_counters() -> dict:
    from torch._dynamo.utils import counters
    return {"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
            "bypass": counters["inductor"]["fxgraph_cache_bypass"]}
