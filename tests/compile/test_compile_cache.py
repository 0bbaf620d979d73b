"""The on-disk compile cache: verification, rebuild of bad entries, permissions, warm starts."""

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from compile_helpers import make_runner, run_workload
import pcg_engine
from pcg_engine.compile import saved_trace
from pcg_engine.compile.cache import MANIFEST, CompileCache, CompileCacheError, default_cache_root

FIELDS = {"format": 1, "torch": "x", "mode": "piecewise"}


def _built(root, fields=FIELDS):
    cache = CompileCache(root, fields)
    assert cache.open() == "miss"
    (cache.entry / "inductor" / "ab").mkdir(parents=True)
    (cache.entry / "inductor" / "ab" / "graph.py").write_text("print('compiled')\n")
    (cache.entry / "triton" ).mkdir(exist_ok=True)
    (cache.entry / "triton" / "kernel.bin").write_bytes(b"\x00\x01" * 100)
    (cache.entry / "inductor" / "locks").mkdir()
    (cache.entry / "inductor" / "locks" / "x.lock").write_bytes(b"")
    cache.commit()
    cache.close()
    return cache


def test_second_open_is_a_hit(tmp_path):
    first = _built(tmp_path / "c")
    second = CompileCache(tmp_path / "c", FIELDS)
    assert second.open() == "hit" and second.rejected is None and second.entry == first.entry
    assert (os.stat(tmp_path / "c").st_mode & 0o777) == 0o700
    assert (os.stat(first.entry).st_mode & 0o777) == 0o700


@pytest.mark.parametrize("damage, reason", [
    (lambda e: (e / "inductor" / "ab" / "graph.py").write_text("print('evil')\n"), "checksum"),
    (lambda e: (e / "triton" / "kernel.bin").write_bytes(b"\x00"), "checksum"),
    (lambda e: (e / MANIFEST).unlink(), "no manifest"),
    (lambda e: (e / MANIFEST).write_text("{not json"), "unreadable manifest"),
    (lambda e: (e / "triton" / "kernel.bin").unlink(), "missing"),
    # One bit flipped in the manifest ("size" -> "sizg", "sha256" -> "sha254"): still valid JSON,
    # but a file's record lacks its field (a KeyError out of the start before).
    (lambda e: (e / MANIFEST).write_text((e / MANIFEST).read_text().replace('"size"', '"sizg"')),
     "unreadable manifest"),
    (lambda e: (e / MANIFEST).write_text((e / MANIFEST).read_text().replace('"sha256"', '"sha254"')),
     "unreadable manifest"),
])
def test_bad_entry_is_deleted_and_rebuilt(tmp_path, damage, reason):
    first = _built(tmp_path / "c")
    damage(first.entry)
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match=f"compile cache entry .*{again.key} not used .*{reason}"):   # said, not silent
        assert again.open() == "miss"
    assert reason in again.rejected
    assert list(again.entry.iterdir()) == []          # nothing of the bad entry survives


def test_lock_files_are_not_part_of_the_entry(tmp_path):
    first = _built(tmp_path / "c")
    (first.entry / "inductor" / "locks" / "x.lock").unlink()
    (first.entry / "inductor" / "locks" / "y.lock").write_bytes(b"")
    again = CompileCache(tmp_path / "c", FIELDS)
    assert again.open() == "hit"
    again.close()


@pytest.mark.parametrize("loosen, reason", [
    (lambda e: os.chmod(e / "inductor" / "ab", 0o777), "inductor/ab (mode 0o777) is writable by group or others"),
    (lambda e: os.chmod(e / "triton" / "kernel.bin", 0o664), "triton/kernel.bin (mode 0o664) is writable"),
    (lambda e: (e / "inductor" / "ab" / "elsewhere.py").symlink_to(e / "inductor" / "ab" / "graph.py"),
     "inductor/ab/elsewhere.py is a symlink"),
])
def test_an_entry_with_a_path_others_could_write_is_rebuilt(tmp_path, loosen, reason):
    """The entry's own mode does not protect a folder below it that others can reach and write
    (entry 0755, Inductor's folders 0777 under umask 000): another user could replace a .py there
    after verify() read it and before Inductor loads it. Every path inside is checked."""
    first = _built(tmp_path / "c")
    os.chmod(first.entry, 0o755)          # others may pass through, not write: still a usable entry
    loosen(first.entry)
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match="not used"):
        assert again.open() == "miss"
    assert reason in again.rejected
    again.close()


def test_a_hit_does_not_sign_a_file_changed_after_its_check(tmp_path):
    """commit() after a hit keeps the checked records: a file changed between the check and the
    commit is caught by the next start, not written into the manifest as good."""
    _built(tmp_path / "c")
    hit = CompileCache(tmp_path / "c", FIELDS)
    assert hit.open() == "hit"
    (hit.entry / "inductor" / "ab" / "graph.py").write_text("print('swapped after the check')\n")
    (hit.entry / "trace-kv8x16.bin").write_bytes(b"new trace")     # what a hit may add
    hit.commit()
    hit.close()
    listed = json.loads((hit.entry / MANIFEST).read_text())["files"]
    assert "trace-kv8x16.bin" in listed            # this start's own file is recorded
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match="checksum mismatch in inductor/ab/graph.py"):
        assert again.open() == "miss"
    again.close()


def test_a_build_under_umask_000_is_private_and_hits(tmp_path):
    """Under umask 000 the folders made for the cache root are 0700 (os.makedirs' mode reaches only
    the last one: the parents came out 0777 and the next start refused them), and what the build
    made 0777 / 0666 loses group and other write before it is signed, so the next start hits."""
    old = os.umask(0)
    try:
        root = tmp_path / "xdg" / "pcg_engine" / "compile"
        first = _built(root)
        os.chmod(first.entry / "inductor" / "ab", 0o777)     # as Inductor makes them under umask 000
        os.chmod(first.entry / "inductor" / "ab" / "graph.py", 0o666)
        first.commit()
        again = CompileCache(root, FIELDS)
        assert again.open() == "hit", again.rejected
        again.close()
    finally:
        os.umask(old)
    for folder in (tmp_path / "xdg", tmp_path / "xdg" / "pcg_engine", root):
        assert os.stat(folder).st_mode & 0o777 == 0o700, folder
    assert os.stat(first.entry / "inductor" / "ab").st_mode & 0o777 == 0o755


def test_a_second_start_waits_for_the_build_then_hits(tmp_path):
    builder = CompileCache(tmp_path / "c", FIELDS)
    assert builder.open() == "miss"
    result = {}

    def second():
        waiter = CompileCache(tmp_path / "c", FIELDS)
        result["state"] = waiter.open()
        waiter.close()
    thread = threading.Thread(target=second)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive()              # blocked on the key's lock, not deleting the build
    (builder.entry / "inductor").mkdir()
    (builder.entry / "inductor" / "graph.py").write_text("x = 1\n")
    builder.commit()
    builder.close()
    thread.join(10)
    assert result["state"] == "hit"


def test_version_mismatch_in_manifest_is_rejected(tmp_path):
    first = _built(tmp_path / "c")
    manifest = json.loads((first.entry / MANIFEST).read_text())
    manifest["fields"]["torch"] = "other"
    (first.entry / MANIFEST).write_text(json.dumps(manifest))
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match="other versions"):
        assert again.open() == "miss" and "other versions" in again.rejected


def test_different_fields_use_another_entry(tmp_path):
    a = _built(tmp_path / "c")
    b = CompileCache(tmp_path / "c", {**FIELDS, "mode": "compile"})
    assert b.open() == "miss" and b.entry != a.entry and a.entry.exists()


def test_each_gpu_index_gets_its_own_entry(monkeypatch):
    """Two GPUs of the same model shared one entry (the key named the device by model only): a start
    on cuda:1 found the trace made on cuda:0. "cuda" alone is the current device."""
    from pcg_engine.compile import cache as cache_mod
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    keys = [cache_mod._device_key(torch.device(d)) for d in ("cuda:0", "cuda:1", "cuda", "cpu")]
    assert keys[:3] == ["cuda:0:NVIDIA H200", "cuda:1:NVIDIA H200", "cuda:1:NVIDIA H200"]
    assert keys[3].startswith("cpu:")


def test_a_cpu_entry_is_keyed_by_the_vector_isa_and_threads(monkeypatch):
    """Inductor's CPU code is built for the host's vector ISA and thread count: an AVX-512 entry
    loaded under ATEN_CPU_CAPABILITY=avx2 gave wrong tokens (found by a review)."""
    from pcg_engine.compile import cache as cache_mod
    cpu = torch.device("cpu")
    base = cache_mod._device_key(cpu)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cache_mod._device_key(cpu) != base and "AVX2" in cache_mod._device_key(cpu)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cache_mod._device_key(cpu).endswith(f"threads={threads + 1}")
    finally:
        torch.set_num_threads(threads)


def test_refuses_group_or_world_writable_dir(tmp_path, monkeypatch):
    from pcg_engine.compile import cache as cache_mod
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(CompileCacheError, match=r"shared.*0o777.*group or others"):
        CompileCache(root, FIELDS).open()
    os.chmod(root, 0o700)
    cache = _built(root)
    os.chmod(cache.entry, 0o770)          # rebuilt, unless it cannot be deleted: then refused
    with monkeypatch.context() as m:
        m.setattr(cache_mod, "_remove_tree", lambda entry: os.rmdir(entry))
        with pytest.raises(CompileCacheError, match=f"{cache.key} is not usable \\(the entry \\(mode 0o770\\)"):
            CompileCache(root, FIELDS).open()
    os.chmod(cache.entry, 0o700)          # the refused open released the key's lock
    again = CompileCache(root, FIELDS)
    assert again.open() == "hit"
    again.close()


def test_refuses_dir_under_a_world_writable_parent(tmp_path):
    """Anyone may rename or replace what a world-writable directory without the sticky bit holds:
    the checked, private cache directory could be swapped for theirs between the check and the
    load. Such a parent is refused; a sticky one (/tmp) is not."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(CompileCacheError, match=r"shared.*0o777.*sticky"):
        CompileCache(shared / "cache", FIELDS).open()
    os.chmod(shared, 0o1777)
    cache = CompileCache(shared / "cache", FIELDS)
    assert cache.open() == "miss"
    cache.close()
    os.chmod(shared, 0o777)               # an existing cache directory under it: refused too
    with pytest.raises(CompileCacheError, match=r"shared.*sticky"):
        CompileCache(shared / "cache", FIELDS).open()


def test_refuses_dir_under_a_group_writable_parent_unless_the_group_is_private(tmp_path, monkeypatch):
    """Found by review: a group-writable parent without the sticky bit (a team's project directory,
    root:team 2775) passed, and any member could swap the checked cache directory for theirs before
    the saved trace (a pickle) was loaded. Refused now, unless the group is the user's own private
    group (umask 002 with per-user groups makes ~/.cache group-writable, letting no one else in)."""
    from pcg_engine.compile import cache as cache_module
    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, 0o2775)
    monkeypatch.setattr(cache_module, "_private_group", lambda gid: False)
    with pytest.raises(CompileCacheError, match=r"team \(mode 0o2775\) lets the members of group \d+ rename"):
        CompileCache(team / "cache", FIELDS).open()
    os.chmod(team, 0o3775)                # sticky: only an entry's owner may rename it
    sticky = CompileCache(team / "cache", FIELDS)
    assert sticky.open() == "miss"
    sticky.close()
    os.chmod(team, 0o2775)
    monkeypatch.setattr(cache_module, "_private_group", lambda gid: True)
    private = CompileCache(team / "cache2", FIELDS)
    assert private.open() == "miss"       # not refused
    private.close()


def _acl(**entries):
    """A POSIX access ACL as Linux stores it: (tag, permissions, id) entries after a version."""
    import struct
    tags = {"user_obj": 1, "user": 2, "group_obj": 4, "group": 8, "mask": 0x10, "other": 0x20}
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tags[tag], perm, uid)
                                           for tag, (perm, uid) in entries.items())


def test_an_acl_on_a_parent_voids_the_private_group_exemption(tmp_path, monkeypatch):
    """Found by review (session 40): a parent of the user's private group, mode 0775, passed, though
    an access ACL on it (setfacl -m u:someone:rwx) let another user swap the cache directory: with
    an ACL the group bits are its mask, not the group's own permissions."""
    from pcg_engine.compile import cache as cache_module
    monkeypatch.setattr(cache_module, "_private_group", lambda gid: True)
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, 0o775)
    none = 0xFFFFFFFF
    try:
        os.setxattr(home, "system.posix_acl_access",
                    _acl(user_obj=(7, none), user=(7, 65534), group_obj=(5, none), mask=(7, none), other=(5, none)))
    except (AttributeError, OSError) as e:
        pytest.skip(f"no POSIX ACLs here ({e})")
    assert os.stat(home).st_mode & 0o777 == 0o775     # the mask shows as the group bits
    with pytest.raises(CompileCacheError, match=r"home \(mode 0o775\) has an access ACL that lets user 65534 "):
        CompileCache(home / "cache", FIELDS).open()
    monkeypatch.setattr(cache_module, "_private_group", lambda gid: gid != 4242)
    os.setxattr(home, "system.posix_acl_access",        # a named group that may write, not the user's own
                _acl(user_obj=(7, none), group_obj=(7, none), group=(7, 4242), mask=(7, none), other=(5, none)))
    with pytest.raises(CompileCacheError, match=r"lets the members of group 4242 rename"):
        CompileCache(home / "cache", FIELDS).open()
    # An ACL that lets others read only (the mask still 0775) is as private as no ACL
    os.setxattr(home, "system.posix_acl_access",
                _acl(user_obj=(7, none), user=(5, 65534), group_obj=(7, none), mask=(7, none), other=(5, none)))
    cache = CompileCache(home / "cache", FIELDS)
    assert cache.open() == "miss"
    cache.close()
    os.removexattr(home, "system.posix_acl_access")   # the same mode without the ACL: the user's own group
    cache = CompileCache(home / "cache2", FIELDS)
    assert cache.open() == "miss"
    cache.close()


def test_private_group_is_the_users_own():
    """The user-private-group test on this machine's databases: another gid is never private."""
    from pcg_engine.compile.cache import _private_group
    grp, pwd = pytest.importorskip("grp"), pytest.importorskip("pwd")
    user = pwd.getpwuid(os.getuid())
    try:
        own = grp.getgrgid(user.pw_gid)
    except KeyError:
        pytest.skip("the user's primary group has no entry in the group database")
    assert _private_group(user.pw_gid) == (own.gr_name == user.pw_name and set(own.gr_mem) <= {user.pw_name})
    others = [g.gr_gid for g in grp.getgrall() if g.gr_gid != user.pw_gid]
    assert others and not any(_private_group(gid) for gid in others[:20])


def test_symlinked_cache_dir_is_used_through_its_target(tmp_path):
    """A cache directory reached through a symlink in a sticky shared directory (/tmp): whoever made
    the link may replace it at any time. Before, the checks passed on the link's first target (a
    private directory of this user) and Inductor and the saved trace then read the entry through
    the link, from wherever it pointed by then. Now the cache uses the real path it checked."""
    shared, mine, theirs = tmp_path / "shared", tmp_path / "mine", tmp_path / "theirs"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    mine.mkdir(mode=0o700)
    theirs.mkdir(mode=0o700)
    link = shared / "cache"
    link.symlink_to(mine)
    cache = CompileCache(link, FIELDS)
    assert cache.open() == "miss"
    link.unlink()
    link.symlink_to(theirs)               # swapped after the checks
    with cache.activate():
        assert os.path.realpath(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == str(mine / cache.key / "inductor")
    cache.commit()
    cache.close()
    assert (mine / cache.key / MANIFEST).exists() and list(theirs.iterdir()) == []


def _read_only_dir(root, monkeypatch):
    root.mkdir(mode=0o700)
    os.chmod(root, 0o500)
    if os.geteuid() == 0:      # root writes through a chmod: what the kernel tells anyone else, emulated
        real_open = os.open

        def open_read_only(path, flags, *args, **kwargs):
            if str(path).startswith(str(root)) and flags & os.O_CREAT:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kwargs)
        monkeypatch.setattr(os, "open", open_read_only)


def test_unwritable_cache_dir_is_named_as_the_config_field(tmp_path, monkeypatch):
    """A cache directory this user cannot write (chmod 500, a read-only mount): a PcgError naming
    compile_cache_dir and the directory (a bare PermissionError on the key's lock file before)."""
    root = tmp_path / "ro"
    _read_only_dir(root, monkeypatch)
    with pytest.raises(CompileCacheError, match=r"^compile_cache_dir: cannot write .*ro.*Permission denied") as info:
        CompileCache(root, FIELDS).open()
    assert info.value.unwritable


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to chown")
def test_refuses_dir_owned_by_another_user(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(CompileCacheError, match=r"theirs.*owned by uid 65534"):
        CompileCache(root, FIELDS).open()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to chown")
def test_refuses_dir_under_a_parent_another_user_owns(tmp_path):
    """Found by review: a parent folder another user made (an XDG_CACHE_HOME under /tmp that
    someone created first) passed, as it was 0755. Its owner can rename the checked cache folder
    away after the checks and put theirs in its place: the saved trace is a pickle."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chown(shared, 65534, 65534)
    with pytest.raises(CompileCacheError, match=r"shared is owned by uid 65534, who could rename"):
        CompileCache(shared / "pcg_engine" / "compile", FIELDS).open()


def test_a_hit_makes_its_entry_private(tmp_path):
    """An entry others may enter but not write (0755) is used, and made 0700 for the start: a hit
    writes new files (Inductor makes them 0777 / 0666 under umask 000) that commit() then signs."""
    first = _built(tmp_path / "c")
    os.chmod(first.entry, 0o755)
    again = CompileCache(tmp_path / "c", FIELDS)
    assert again.open() == "hit"
    again.close()
    assert os.stat(first.entry).st_mode & 0o777 == 0o700


def test_sources_edited_after_import_are_not_keyed_as_the_edit(tmp_path):
    """The key's source hash is the code the process imported. It was hashed at the first engine's
    start: a file edited after the import (a notebook's kernel kept alive, a `git pull` under a
    running process) keyed the old code's compiled forward under the new sources' hash, and every
    later process running the new code loaded it."""
    src = tmp_path / "src"
    shutil.copytree(os.path.dirname(pcg_engine.__file__), src / "pcg_engine",
                    ignore=shutil.ignore_patterns("__pycache__"))
    edit = ("import pcg_engine.llm, pathlib; p = pathlib.Path(pcg_engine.__file__).parent / 'models' / 'qwen3.py'; "
            f"assert p.is_relative_to({str(src)!r}), p; "      # the copy, never the project's own file
            "p.write_text(p.read_text() + '# edited\\n'); ")
    key = "from pcg_engine.compile import cache; print(cache.source_hash())"

    def run(code):
        env = {**os.environ, "PYTHONPATH": str(src)}
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=src, check=True, capture_output=True,
                              text=True).stdout.strip()
    edited_meanwhile = run(edit + key)     # runs the old qwen3.py
    fresh = run(key)                       # a later process: runs the edited one
    assert edited_meanwhile != fresh
    assert run(key) == fresh               # and processes of one tree still share entries


def test_default_root_follows_xdg_cache_home(monkeypatch, tmp_path):
    """~/.cache/pcg_engine/compile, or under $XDG_CACHE_HOME when that is an absolute path (the
    XDG rule: a relative one is ignored), beside the default tiny model."""
    from pcg_engine.models.checkpoint_maker import default_model_dir

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "pcg_engine" / "compile"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "pcg_engine" / "compile"
    assert default_model_dir().parent == tmp_path / "xdg" / "pcg_engine" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert default_cache_root() == tmp_path / "home" / ".cache" / "pcg_engine" / "compile"
    assert default_model_dir().parent == tmp_path / "home" / ".cache" / "pcg_engine" / "models"


# ---- with the compiler ----------------------------------------------------------------------

def _same_as(eager, runner):
    def check(results, index):
        torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-4)
    run_workload([eager, runner], check)


def test_warm_start_loads_the_saved_trace(tiny_dense, cache_root, dense_piecewise, dense_eager):
    assert dense_piecewise.timings["compile_cache_hit"] in (0.0, 1.0)
    entry = dense_piecewise.compile_cache.entry
    manifest = json.loads((entry / MANIFEST).read_text())
    # written before the manifest, covered by it
    assert saved_trace.file_name(dense_piecewise.num_kv_blocks, dense_piecewise.block_size) in manifest["files"]
    # A new runner is a new model: it loads the trace the first one saved, with its pieces.
    warm = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(cache_root))
    t = warm.timings
    assert t["compile_cache_hit"] == 1.0 and t["saved_trace_loaded"] == 1.0
    assert warm.forward_fn.saved_trace_error is None
    stats = warm.forward_fn.stats
    assert stats.dynamo_traces == 0 and stats.inductor_compiles == 0
    assert stats.pieces == dense_piecewise.forward_fn.stats.pieces and stats.keys == dense_piecewise.forward_fn.stats.keys
    _same_as(dense_eager, warm)


def test_compile_mode_loads_the_saved_trace(tiny_dense, tmp_path, dense_eager):
    root = tmp_path / "cc"
    cold = make_runner(tiny_dense, "compile", compile_cache_dir=str(root))
    assert cold.timings["saved_trace_loaded"] == 0.0
    warm = make_runner(tiny_dense, "compile", compile_cache_dir=str(root))
    assert warm.timings["saved_trace_loaded"] == 1.0 and warm.forward_fn.stats.dynamo_traces == 0
    _same_as(dense_eager, warm)


def test_warm_start_without_saved_trace_hits_inductors_cache(tiny_dense, tmp_path, dense_eager, monkeypatch):
    monkeypatch.setenv(saved_trace.ENV, "0")
    root = tmp_path / "cc"
    cold = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    assert not any(p.name.startswith("trace-") for p in cold.compile_cache.entry.iterdir())
    # Dynamo traces the new model anew, Inductor finds every piece on disk.
    warm = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    t = warm.timings
    assert t["compile_cache_hit"] == 1.0 and t["saved_trace_loaded"] == 0.0
    assert warm.forward_fn.stats.dynamo_traces == 1
    assert t["inductor_cache_hits"] == t["inductor_compiles"] == 3 and t["inductor_cache_misses"] == 0
    _same_as(dense_eager, warm)


def test_saved_trace_failing_on_its_first_call_falls_back_to_tracing(tiny_dense, cache_root, dense_piecewise,
                                                                    dense_eager, monkeypatch):
    """Loaded, rebuilt, then refused on the first call (as failing guards would): the start traces,
    and nothing of the load is left in the counters or the split module."""
    real_load = saved_trace.load

    def load_then_refuse(path, backend):
        real_load(path, backend)          # rebuilds the split module and its wrappers

        def refuse(*args):
            raise RuntimeError("GuardManager check failed (test)")
        return refuse
    monkeypatch.setattr(saved_trace, "load", load_then_refuse)
    with pytest.warns(UserWarning, match="GuardManager check failed"):
        runner = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(cache_root))
    forward = runner.forward_fn
    assert runner.timings["compile_cache_hit"] == 1.0 and runner.timings["saved_trace_loaded"] == 0.0
    assert "GuardManager check failed (test)" in forward.saved_trace_error
    assert forward.stats.dynamo_traces == 1 and forward.stats.loaded_traces == 0 and forward.stats.set_ups == 1
    assert forward.stats.inductor_compiles == 3
    _same_as(dense_eager, runner)


def test_unreadable_saved_trace_falls_back_to_tracing(tiny_dense, cache_root, dense_piecewise, dense_eager, tmp_path):
    """A trace file the manifest accepts but this torch cannot read (another release's format):
    the start warns, traces instead, and saves a fresh file that the next start loads."""
    entry = dense_piecewise.compile_cache.entry
    name = saved_trace.file_name(dense_piecewise.num_kv_blocks, dense_piecewise.block_size)
    root = tmp_path / "copy"
    root.mkdir(mode=0o700)
    shutil.copytree(entry, root / entry.name)
    (root / entry.name / name).write_bytes(os.urandom(256))
    again = CompileCache(root, dense_piecewise.compile_cache.fields)
    assert again.open() == "miss" and "checksum" in again.rejected      # the manifest catches it...
    again.close()
    shutil.rmtree(root / entry.name)
    shutil.copytree(entry, root / entry.name)
    (root / entry.name / name).write_bytes(os.urandom(256))
    forged = CompileCache(root, dense_piecewise.compile_cache.fields)
    forged.commit()                                                     # ...unless it was written so
    with pytest.warns(UserWarning, match="not loaded, tracing instead"):
        runner = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    t = runner.timings
    assert t["compile_cache_hit"] == 1.0 and t["saved_trace_loaded"] == 0.0
    assert runner.forward_fn.saved_trace_error
    assert runner.forward_fn.stats.dynamo_traces == 1 and runner.forward_fn.stats.set_ups == 1
    _same_as(dense_eager, runner)
    repaired = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    assert repaired.timings["saved_trace_loaded"] == 1.0 and repaired.forward_fn.saved_trace_error is None
    _same_as(dense_eager, repaired)


def test_failed_save_does_not_stop_the_start(tiny_dense, tmp_path, dense_eager, monkeypatch):
    """A trace that cannot be written (a full disk) is used unsaved; the entry is still committed,
    without a trace file, and the next start saves one."""
    def no_space(traced, path):
        open(f"{path}.tmp", "wb").write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(saved_trace, "save", no_space)
    root = tmp_path / "cc"
    with pytest.warns(UserWarning, match="saved trace not written"):
        cold = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    forward = cold.forward_fn
    assert "No space left" in forward.saved_trace_error and forward.stats.set_ups == 1
    assert not any(p.name.startswith("trace-") for p in cold.compile_cache.entry.iterdir())
    assert CompileCache(root, cold.compile_cache.fields).verify() is None
    _same_as(dense_eager, cold)
    monkeypatch.undo()
    second = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    assert second.timings["compile_cache_hit"] == 1.0 and second.timings["saved_trace_loaded"] == 0.0
    assert (second.compile_cache.entry / saved_trace.file_name(second.num_kv_blocks, second.block_size)).exists()
    third = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    assert third.timings["saved_trace_loaded"] == 1.0
    _same_as(dense_eager, third)


def test_a_start_stopped_right_after_the_cache_opens_releases_its_lock(tiny_dense, tmp_path, monkeypatch):
    """Found by review (session 40): the saved trace's choice and Inductor's counters ran between
    the cache's open() (which takes the key's lock) and the try that closes it, so a start stopped
    there (a Ctrl-C) kept the lock, and the next start in the process waited on it for ever."""
    fcntl = pytest.importorskip("fcntl")
    from pcg_engine.compile import setup

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(setup, "inductor_cache_counters", interrupted)
    root = tmp_path / "cc"
    with pytest.raises(KeyboardInterrupt):
        make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    (lock,) = root.glob("*.lock")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)      # BlockingIOError while the start holds it
    finally:
        os.close(fd)


def test_failed_aot_trace_falls_back_to_a_plain_trace(tiny_dense, tmp_path, dense_eager, monkeypatch):
    def refuse(compiled, args):
        raise RuntimeError("cannot precompile (test)")
    monkeypatch.setattr(saved_trace, "trace", refuse)
    with pytest.warns(UserWarning, match="cannot precompile"):
        runner = make_runner(tiny_dense, "compile", compile_cache_dir=str(tmp_path / "cc"))
    assert runner.forward_fn.stats.set_ups == 1 and "cannot precompile" in runner.forward_fn.saved_trace_error
    _same_as(dense_eager, runner)


def test_each_kv_cache_size_gets_its_own_saved_trace(tiny_dense, tmp_path, dense_eager):
    """The KV caches are graph inputs of fixed shape: a start with another size (on CUDA it follows
    the free memory) must not load a trace made for the first; it adds its own to the entry."""
    root = tmp_path / "cc"
    first = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, num_kv_blocks=64, compile_cache_dir=str(root))
    other = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, num_kv_blocks=48, compile_cache_dir=str(root))
    assert other.timings["compile_cache_hit"] == 1.0 and other.timings["saved_trace_loaded"] == 0.0
    assert other.forward_fn.saved_trace_error is None
    names = set(json.loads((other.compile_cache.entry / MANIFEST).read_text())["files"])
    assert {saved_trace.file_name(64, 16), saved_trace.file_name(48, 16)} <= names
    _same_as(dense_eager, other)
    for blocks in (64, 48):
        runner = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, num_kv_blocks=blocks,
                             compile_cache_dir=str(root))
        assert runner.timings["saved_trace_loaded"] == 1.0
    assert first.compile_cache.entry == other.compile_cache.entry


def test_each_block_size_gets_its_own_saved_trace(tiny_dense, tmp_path):
    """block_size is part of the KV caches' shape but not of the cache key. Before, two starts that
    differed only in it shared one trace file (named by the number of blocks alone): each refused
    the other's trace ("GuardManager check failed"), warned, traced again and overwrote the file,
    so neither ever started warm. Now each shape has its own file and both load it."""
    root = tmp_path / "cc"
    settings = dict(max_capture_tokens=32, num_kv_blocks=48, compile_cache_dir=str(root))
    first = make_runner(tiny_dense, "piecewise", **settings)
    other = make_runner(tiny_dense, "piecewise", block_size=8, **settings)
    assert other.timings["compile_cache_hit"] == 1.0 and other.forward_fn.saved_trace_error is None
    names = set(json.loads((other.compile_cache.entry / MANIFEST).read_text())["files"])
    assert {saved_trace.file_name(48, 16), saved_trace.file_name(48, 8)} <= names
    for block_size in (16, 8):
        runner = make_runner(tiny_dense, "piecewise", block_size=block_size, **settings)
        assert runner.timings["saved_trace_loaded"] == 1.0, block_size
        assert runner.forward_fn.saved_trace_error is None
    assert first.compile_cache.entry == other.compile_cache.entry
    _same_as(make_runner(tiny_dense, "eager", block_size=8), other)


def test_saved_trace_off_where_inductor_caches_are(monkeypatch):
    import torch._inductor.config as inductor_config
    assert saved_trace.enabled()
    with inductor_config.patch(force_disable_caches=True):    # an alias: monkeypatch cannot restore it
        assert not saved_trace.enabled()
    assert saved_trace.enabled()
    monkeypatch.setenv(saved_trace.ENV, "0")
    assert not saved_trace.enabled()

def test_corrupt_cache_file_is_detected_and_rebuilt(tiny_dense, cache_root, dense_piecewise, dense_eager, tmp_path):
    entry = dense_piecewise.compile_cache.entry
    root = tmp_path / "copy"
    root.mkdir(mode=0o700)
    shutil.copytree(entry, root / entry.name)
    victim = next(p for p in sorted((root / entry.name / "inductor").rglob("*")) if p.is_file())
    with open(victim, "ab") as f:
        f.write(b"\n# tampered\n")
    rebuilt = make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(root))
    t = rebuilt.timings
    assert t["compile_cache_hit"] == 0.0 and t["compile_cache_rebuilt"] == 1.0
    assert "checksum" in rebuilt.compile_cache.rejected
    assert t["inductor_cache_hits"] == 0
    assert CompileCache(root, rebuilt.compile_cache.fields).verify() is None   # the new entry is sound
    _same_as(dense_eager, rebuilt)


def test_cache_disabled(tiny_dense, tmp_path, dense_eager, monkeypatch):
    """compile_cache=False reads and writes nothing that outlives the start: not the cache
    directory, and not Inductor's or Triton's own (Inductor wrote its code and built libraries to
    TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_<user> by default, and loaded a library found
    there under the same hash on a later start, unchecked)."""
    root = tmp_path / "unused"
    inductor, triton = tmp_path / "inductor", tmp_path / "triton"
    inductor.mkdir(mode=0o700)
    triton.mkdir(mode=0o700)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    runner = make_runner(tiny_dense, "compile", compile_cache=False, compile_cache_dir=str(root))
    assert runner.timings["compile_cache_hit"] == 0.0
    assert not root.exists()
    assert list(inductor.iterdir()) == [] and list(triton.iterdir()) == []
    assert runner.timings["inductor_cache_hits"] == 0
    _same_as(dense_eager, runner)


def test_unwritable_cache_dir_starts_without_the_cache(tiny_dense, tmp_path, dense_eager, monkeypatch):
    """The cache only saves time: a directory this user cannot write (a read-only mount) stopped the
    start with that error. It now starts as with compile_cache=False, saving nothing, and says so."""
    root = tmp_path / "ro"
    _read_only_dir(root, monkeypatch)
    with pytest.warns(UserWarning, match=r"compile_cache_dir: cannot write .*ro.*starting without the compile cache"):
        runner = make_runner(tiny_dense, "compile", compile_cache_dir=str(root))
    t = runner.timings
    assert t["compile_cache_hit"] == 0.0 and t["compile_cache_unwritable"] == 1.0
    assert getattr(runner, "compile_cache", None) is None and list(root.iterdir()) == []
    _same_as(dense_eager, runner)


def test_unusable_cache_path_is_named_as_the_config_field(tmp_path, capsys, monkeypatch):
    """A cache path under a file (or anywhere it cannot be created) and a shared cache directory
    are PcgErrors naming compile_cache_dir: `pcg generate` prints one line and exits 2 (a raw
    NotADirectoryError / a traceback before)."""
    from pcg_engine import cli
    from pcg_engine.errors import PcgError
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(CompileCacheError, match=r"^compile_cache_dir: cannot create .*f/sub") as info:
        CompileCache(a_file / "sub", FIELDS).open()
    assert isinstance(info.value, PcgError) and info.value.field == "compile_cache_dir"
    shared = tmp_path / ".cache" / "pcg_engine" / "compile"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o777)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli.main(["generate", "--device", "cpu", "--mode", "compile", "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    # (generate has a --compile-cache-dir flag since 28a4b03: the error names it, as it names --max-tokens)
    assert err.startswith("error: --compile-cache-dir (compile_cache_dir): refusing compile cache directory")
    assert "0o777" in err


def test_unlisted_files_are_removed_and_the_rest_still_hits(tmp_path):
    """Found by probing (session 31): a start killed while it added to a hit (a new KV shape's
    trace) or a stray temporary file left an unlisted file, and the next start threw the whole
    verified entry away for a full cold compile. Unlisted files are removed (none is ever loaded
    then); the listed ones, checked, stay a hit. A planted file is removed the same way."""
    first = _built(tmp_path / "c")
    (first.entry / "inductor" / "planted.py").write_text("x = 1\n")
    (first.entry / "trace-kv64x16.bin").write_bytes(b"half a trace")
    (first.entry / (MANIFEST + ".tmp")).write_text("{")
    again = CompileCache(tmp_path / "c", FIELDS)
    assert again.open() == "hit" and again.rejected is None
    assert not (first.entry / "inductor" / "planted.py").exists()
    assert not (first.entry / "trace-kv64x16.bin").exists() and not (first.entry / (MANIFEST + ".tmp")).exists()
    assert (first.entry / "inductor" / "ab" / "graph.py").read_text() == "print('compiled')\n"


def test_an_unreadable_file_rejects_the_entry(tmp_path, monkeypatch):
    """Found by probing (session 31): a file verify() could not read (chmod 000) raised out of the
    check, reported as "cannot write ...; make <root> writable", and every later start ran without
    the cache. It is now a bad entry, rebuilt. (Made unreadable by a patch: root reads any mode.)"""
    from pcg_engine.compile import cache as cache_mod
    first = _built(tmp_path / "c")
    real = cache_mod._sha256

    def refuse(path):
        if path.name == "kernel.bin":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(cache_mod, "_sha256", refuse)
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match="unreadable file triton/kernel.bin \\(Permission denied\\)"):
        assert again.open() == "miss"
    assert list(again.entry.iterdir()) == [] and first.entry == again.entry


def test_a_rejected_entry_with_a_read_only_folder_is_deleted_whole(tmp_path, monkeypatch):
    """Found by probing (session 31): a folder of the entry made read-only stopped the delete of a
    bad entry halfway ("cannot write main.cpp", a bare name), leaving a broken entry for every
    later start. This user's folders get write back first. (rmtree is watched rather than relied
    on to fail: root deletes whatever the modes.)"""
    from pcg_engine.compile import cache as cache_mod
    first = _built(tmp_path / "c")
    (first.entry / "inductor" / "ab" / "graph.py").write_text("print('evil')\n")
    os.chmod(first.entry / "inductor" / "ab", 0o500)
    os.chmod(first.entry / "triton", 0o300)        # no read: it could not be walked or emptied
    modes = {}
    real = cache_mod.shutil.rmtree

    def watched(path, *args, **kwargs):
        modes.update({d: os.stat(os.path.join(d)).st_mode & 0o777
                      for d, _, _ in os.walk(path)})
        return real(path, *args, **kwargs)
    monkeypatch.setattr(cache_mod.shutil, "rmtree", watched)
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert again.open() == "miss"
    assert modes[str(first.entry / "inductor" / "ab")] & 0o700 == 0o700
    assert modes[str(first.entry / "triton")] & 0o700 == 0o700
    assert list(again.entry.iterdir()) == []


def test_a_failed_delete_names_the_entry_and_the_path(tmp_path, monkeypatch):
    from pcg_engine.compile import cache as cache_mod
    first = _built(tmp_path / "c")
    (first.entry / "triton" / "kernel.bin").write_bytes(b"\x00")

    def fail(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(first.entry / "triton" / "kernel.bin"))
    monkeypatch.setattr(cache_mod.shutil, "rmtree", fail)
    with pytest.raises(CompileCacheError, match=f"compile_cache_dir: compile cache entry {first.entry} is not usable "
                                                "\\(checksum mismatch in triton/kernel.bin\\) and cannot be deleted: "
                                                f"{first.entry}/triton/kernel.bin: Permission denied; delete it by hand"):
        CompileCache(tmp_path / "c", FIELDS).open()


def test_an_entry_that_is_a_symlink_is_replaced(tmp_path):
    """Found by probing (session 31): an entry that was itself a symlink passed the symlink rule
    (its checks followed the link) and a hit loaded from outside the checked root; damaged as well,
    every start was refused with "Cannot call rmtree on a symbolic link; make <root> writable"."""
    first = _built(tmp_path / "c")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(first.entry), str(elsewhere))
    os.symlink(elsewhere, first.entry)
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match="the entry is a symlink"):
        assert again.open() == "miss"
    assert not os.path.islink(again.entry) and list(again.entry.iterdir()) == []
    assert (elsewhere / "inductor" / "ab" / "graph.py").exists()      # the link's target is not touched


def _entry_replaced_by_a_file(entry):
    shutil.rmtree(entry)
    entry.write_text("not an entry")


def _entry_owned_by_another_user(entry):
    if not hasattr(os, "getuid") or os.getuid() != 0:
        pytest.skip("needs root to chown")
    os.chown(entry, 65534, 65534)


@pytest.mark.parametrize("damage, reason", [
    (_entry_replaced_by_a_file, "the entry is not a directory"),
    (lambda e: os.chmod(e, 0o777), "the entry (mode 0o777) lets group or others write it"),
    (lambda e: os.chmod(e, 0o770), "the entry (mode 0o770) lets group or others write it"),
    (_entry_owned_by_another_user, "the entry is owned by uid 65534"),
])
def test_a_damaged_entry_itself_is_rebuilt(tmp_path, damage, reason):
    """Found by review (session 40): damage of the entry itself (a file in its place, chmod 777)
    raised out of open() on every start, until someone deleted it by hand; damage inside it was
    already rebuilt. Now both are: the entry is deleted, said, and built afresh."""
    first = _built(tmp_path / "c")
    damage(first.entry)
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match=f"{again.key} not used"):
        assert again.open() == "miss"
    assert reason in again.rejected
    assert again.entry.is_dir() and list(again.entry.iterdir()) == []
    assert os.stat(again.entry).st_mode & 0o777 == 0o700 and os.stat(again.entry).st_uid == os.getuid()
    again.close()


def test_a_loose_entry_is_closed_before_it_is_deleted(tmp_path, monkeypatch):
    """Found by a review: an entry of mode 0777 was deleted while still 0777, so others could add
    files to it meanwhile (the delete then failed and stopped the start) or race its chmods."""
    from pcg_engine.compile import cache as cache_mod
    first = _built(tmp_path / "c")
    os.chmod(first.entry, 0o777)
    modes, remove = [], cache_mod._remove_tree
    monkeypatch.setattr(cache_mod, "_remove_tree", lambda entry: (modes.append(os.stat(entry).st_mode & 0o777),
                                                                 remove(entry)))
    again = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match="not used"):
        assert again.open() == "miss"
    assert modes == [0o700]
    again.close()


def test_waiting_for_another_start_is_said(tmp_path):
    """Found by probing (session 31): a start that waited on another's build (or on one stopped
    with SIGSTOP) printed nothing however long it waited."""
    builder = CompileCache(tmp_path / "c", FIELDS)
    assert builder.open() == "miss"

    def finish():
        (builder.entry / "inductor").mkdir()
        (builder.entry / "inductor" / "graph.py").write_text("x = 1\n")
        builder.commit()
        builder.close()
    timer = threading.Timer(0.5, finish)
    timer.start()
    waiter = CompileCache(tmp_path / "c", FIELDS)
    with pytest.warns(UserWarning, match=f"waiting for another start that holds .*{builder.key}.lock"):
        assert waiter.open() == "hit"
    waiter.close()
    timer.join()


def test_a_manifest_that_cannot_be_written_does_not_stop_the_start(tiny_dense, tmp_path, dense_eager, monkeypatch):
    """Found by probing (session 31): a full disk failed commit() with an OSError traceback after
    everything had compiled, and the next start deleted the half-written entry, compiled and failed
    again. The start goes on with what it compiled; the entry is removed (its space freed)."""
    import errno
    root = tmp_path / "c"

    def full(self, written=()):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(CompileCache, "commit", full)
    with pytest.warns(UserWarning, match="not saved \\(No space left on device\\); the next start compiles again"):
        runner = make_runner(tiny_dense, "compile", compile_cache_dir=str(root))
    assert runner.timings["compile_cache_unsaved"] == 1.0
    assert [p for p in root.iterdir() if not p.name.endswith(".lock")] == []
    _same_as(dense_eager, runner)


def test_a_compile_out_of_space_names_the_cache_dir(tiny_dense, tmp_path, monkeypatch):
    """Found by probing (session 31): Inductor failing to write into the entry on a full disk ended
    in an InductorError traceback, on every start. Now one ConfigError-like line naming
    compile_cache_dir, and the half-built entry is removed, freeing what it took."""
    import errno
    from pcg_engine.compile import setup
    root = tmp_path / "c"

    def fail(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("InductorError: OSError") from e
    monkeypatch.setattr(setup, "_dummy_forward", fail)
    with pytest.raises(CompileCacheError, match="^compile_cache_dir: no space left on the device of .* while "
                                                "compiling into it \\(RuntimeError\\); free space there") as info:
        make_runner(tiny_dense, "compile", compile_cache_dir=str(root))
    assert info.value.field == "compile_cache_dir"
    assert [p for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_other_compile_failures_are_not_blamed_on_the_disk(tiny_dense, tmp_path, monkeypatch):
    from pcg_engine.compile import setup

    def fail(*args, **kwargs):
        raise RuntimeError("a bug in a piece")
    monkeypatch.setattr(setup, "_dummy_forward", fail)
    with pytest.raises(RuntimeError, match="a bug in a piece"):
        make_runner(tiny_dense, "compile", compile_cache_dir=str(tmp_path / "c"))


def test_a_rejected_entry_under_a_read_only_root_starts_without_the_cache(tmp_path, monkeypatch):
    """Found by review (session 31): a rejected entry that cannot be deleted (a root made chmod 500)
    stopped the start; it starts without the cache, as an unwritable root does (setup.py)."""
    import errno
    from pcg_engine.compile import cache as cache_mod
    first = _built(tmp_path / "c")
    (first.entry / MANIFEST).unlink()

    def fail(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(cache_mod.shutil, "rmtree", fail)
    with pytest.raises(CompileCacheError, match="cannot be deleted") as info:
        CompileCache(tmp_path / "c", FIELDS).open()
    assert info.value.unwritable


def test_a_hit_that_cannot_sign_what_it_added_keeps_its_entry(tiny_dense, tmp_path, dense_eager, monkeypatch):
    """Found by review (session 31): a hit adding a new KV shape's trace whose manifest write failed
    (a full disk) deleted the whole verified entry, and the next start compiled cold. The entry
    stays; the next start removes the unlisted trace and hits."""
    import errno
    root = tmp_path / "c"
    make_runner(tiny_dense, "compile", compile_cache_dir=str(root), num_kv_blocks=64)
    real = CompileCache.commit

    def full(self, written=()):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(CompileCache, "commit", full)
    with pytest.warns(UserWarning, match="not saved"):
        other_shape = make_runner(tiny_dense, "compile", compile_cache_dir=str(root), num_kv_blocks=48)
    assert other_shape.timings["compile_cache_hit"] == 1.0
    monkeypatch.setattr(CompileCache, "commit", real)
    again = make_runner(tiny_dense, "compile", compile_cache_dir=str(root), num_kv_blocks=64)
    assert again.timings["compile_cache_hit"] == 1.0 and again.timings["saved_trace_loaded"] == 1.0
    _same_as(dense_eager, again)


def test_a_model_error_on_a_full_disk_is_raised_as_it_is(tiny_dense, tmp_path, monkeypatch):
    """Found by review (session 31): any compile error on a disk with < 1 MiB free was reported as
    "no space left", hiding it. Only an ENOSPC among its causes, or a compiler's failure, is."""
    import collections
    from pcg_engine.compile import setup
    monkeypatch.setattr(setup.shutil, "disk_usage", lambda p: collections.namedtuple("U", "total used free")(1, 1, 0))

    def fail(*args, **kwargs):
        raise RuntimeError("a bug in a piece")
    monkeypatch.setattr(setup, "_dummy_forward", fail)
    with pytest.raises(RuntimeError, match="a bug in a piece"):
        make_runner(tiny_dense, "compile", compile_cache_dir=str(tmp_path / "c"))

    class CppCompileError(RuntimeError):
        pass

    def compiler(*args, **kwargs):
        raise CppCompileError("g++ failed")
    monkeypatch.setattr(setup, "_dummy_forward", compiler)
    with pytest.raises(CompileCacheError, match=r"no space left .*\(CppCompileError\)"):
        make_runner(tiny_dense, "compile", compile_cache_dir=str(tmp_path / "d"))


def test_closed_engines_leave_no_dynamo_entry_nor_scratch_directory(tiny_dense, tmp_path, dense_eager):
    """Found by probing (session 31): each engine compiled without the saved trace left a Dynamo
    cache entry on the model class's forward code, never removed (~8,000 objects kept per closed
    engine; the 65th start of a process failed with FailOnRecompileLimitHit), and compile_cache=False's
    scratch directory outlived close(). Each engine now compiles its own copy of the code."""
    import gc
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from pcg_engine.models.qwen3 import Qwen3ForCausalLM
    code = Qwen3ForCausalLM.forward.__code__
    before = len(_debug_get_cache_entry_list(code))
    for _ in range(2):
        runner = make_runner(tiny_dense, "compile", compile_cache=False)
        scratch = runner.compile_scratch.name
        assert os.path.isdir(scratch)
        _same_as(dense_eager, runner)
        runner.close()
        assert not os.path.exists(scratch)
        del runner
        gc.collect()
    assert len(_debug_get_cache_entry_list(code)) == before


@pytest.mark.parametrize("cached", [True, False])
def test_compile_writes_no_shared_precompiled_header(tiny_dense, tmp_path, cached):
    """Inductor keeps precompiled C++ headers in <tmp>/torchinductor_<user>/precompiled_headers
    whatever TORCHINDUCTOR_CACHE_DIR says, and includes a header found there in every CPU kernel it
    builds: another user who made that directory first could put code into the kernels a start
    builds (and that a cache entry then signs and serves). A start in its own process, with TMPDIR
    a fresh directory, must leave nothing there, with the cache and without it (cache.py,
    _no_shared_headers)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("from pcg_engine.llm import LLM; "
            f"llm = LLM({str(tiny_dense)!r}, device='cpu', mode='compile', max_num_seqs=4, "
            f"compile_cache={cached}, compile_cache_dir={str(tmp_path / 'cc')!r}); "
            "print(llm.generate([[1, 2, 3]])[0].token_ids)")
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip().startswith("[")                          # it compiled and generated
    left = [p for p in tmp.rglob("*") if p.is_file()]
    assert left == [], f"files Inductor left in the shared temporary directory: {left}"


def test_background_compiles_finish_before_the_entry_is_signed(tiny_dense, tmp_path, monkeypatch):
    """Found by review: the kernel pre-compile's threads (engine/precompile.py, CUDA only) write
    Triton's cache into the entry while it is active, and commit() signed the entry before they had
    finished: a file written meanwhile could be signed half-made (the next start rebuilt the entry)
    or vanish under the signing (the fresh entry was deleted as unsaved). Now the set-up waits for
    them first, once, and the wait is not counted as Dynamo's time."""
    from pcg_engine.compile import cache as cache_module
    from pcg_engine.engine import precompile
    events = []
    background = object()
    monkeypatch.setattr(precompile, "start", lambda runner, buckets: background)
    # (the runner's other calls hand finish() no background, None: not recorded)
    monkeypatch.setattr(precompile, "finish", lambda runner, b: b is background and events.append(("finish", True)))
    real_commit = cache_module.CompileCache.commit

    def commit(self, *args, **kwargs):
        events.append(("commit", True))
        return real_commit(self, *args, **kwargs)
    monkeypatch.setattr(cache_module.CompileCache, "commit", commit)
    runner = make_runner(tiny_dense, "compile", compile_cache_dir=str(tmp_path / "cc"))
    assert events == [("finish", True), ("commit", True)]
    assert runner.timings["compile_cache_hit"] == 0.0


def test_tritons_own_cache_settings_are_keyed(monkeypatch):
    """Found by a review (session 40): TRITON_* settings that change Triton's code (Triton keys its
    own cache by them) were not in the entry's key, and a saved trace loads its kernels directly."""
    from pcg_engine.compile import cache
    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "get_cache_invalidating_env_vars"):
        pytest.skip("this Triton does not report the settings of its cache key")
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    before = cache._switches()
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    after = cache._switches()
    assert after != before and "TRITON_DEFAULT_FP_FUSION" in after and "TRITON_DEFAULT_FP_FUSION" not in before


def test_switches_read_at_import_are_keyed_as_read(tmp_path):
    """Found by a review: the key read the PCG_* switches from the environment at set-up, while
    several modules had read theirs at import. A process that changed its environment in between
    stored an entry under the variant it did not run (here, the skinny GEMM switched off by name
    while the traced model still calls it), and a later start with that setting loaded it."""
    code = ("import os, json; import pcg_engine.kernels.skinny_gemm as s; from pcg_engine.compile import cache; "
            "{change}; print(json.dumps([s.ENABLED, cache._switches()]))")

    def run(change="pass", **env):
        base = {k: v for k, v in os.environ.items() if not k.startswith("PCG_")}
        out = subprocess.run([sys.executable, "-c", code.format(change=change)], env={**base, **env}, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out)
    default, off = run(), run(PCG_SKINNY_GEMM="0")
    assert default[0] is True and off[0] is False and default[1] != off[1]
    # Switched off after the import: the module runs enabled, and the key says so.
    assert run("os.environ['PCG_SKINNY_GEMM'] = '0'") == default
    assert run("del os.environ['PCG_SKINNY_GEMM']", PCG_SKINNY_GEMM="0") == off
    # A switch read where it is used (not at import) is keyed as the environment says at set-up.
    assert run("os.environ['PCG_SPLIT_K'] = '0'")[1] == {**default[1], "PCG_SPLIT_K": "0"}
