"""What the OS did to this process while a benchmark ran: page faults, context switches, moves
between cores, and how much of its memory sits on transparent huge pages.

Why: batch-1 piecewise decode is host-bound, and on the H200 host one process runs it at ~1.07 ms
a token while the next reads 1.2-1.7 ms, with every host phase slower alike (docs/PERF.md, sessions
13-16). None of these figures told the two apart, nor did huge pages (session 16); the cause was
the machine's CPU speed, which bench/cpu_probe.py measures. P1 and scripts/host_drift.py still
record these figures with every run. Linux only: elsewhere the snapshot is empty.
"""

from __future__ import annotations

_COUNTERS = ("minflt", "majflt", "voluntary_switches", "involuntary_switches", "migrations")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _fields(text: str | None, keys: dict[str, str]) -> dict[str, int]:
    """{name: int} from 'key: value ...' lines, for the keys present."""
    out = {}
    for line in (text or "").splitlines():
        key, _, rest = line.partition(":")
        name = keys.get(key.strip())
        if name is not None and rest.split():
            try:
                out[name] = int(float(rest.split()[0]))
            except ValueError:
                pass
    return out


def snapshot() -> dict[str, int]:
    """The process's page faults, the calling thread's context switches, moves between cores and
    current core, and the process's resident and huge-page memory (kB)."""
    out: dict[str, int] = {}
    stat = _read("/proc/self/stat")
    if stat:
        rest = stat.rsplit(")", 1)[1].split()      # rest[0] is field 3 (state)
        out["minflt"], out["majflt"] = int(rest[7]), int(rest[9])
    thread = _read("/proc/thread-self/stat")
    if thread:
        out["cpu"] = int(thread.rsplit(")", 1)[1].split()[36])
    out.update(_fields(_read("/proc/thread-self/status"), {"voluntary_ctxt_switches": "voluntary_switches",
                                                           "nonvoluntary_ctxt_switches": "involuntary_switches"}))
    out.update(_fields(_read("/proc/thread-self/sched"), {"se.nr_migrations": "migrations"}))
    out.update(_fields(_read("/proc/self/smaps_rollup"), {"Rss": "rss_kb", "AnonHugePages": "anon_huge_kb"}))
    return out


def delta(before: dict, after: dict) -> dict[str, int]:
    """Counters as the difference; gauges (cpu, rss_kb, anon_huge_kb) as their value after."""
    return {k: (v - before.get(k, 0) if k in _COUNTERS else v) for k, v in after.items()}


def thp_mode() -> str | None:
    """The transparent huge page setting in force ('always', 'madvise', 'never'), None if unknown."""
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    if not text or "[" not in text:
        return None
    return text[text.index("[") + 1:text.index("]")]


def summary(d: dict, thp: str | None = None) -> str:
    """One line of a delta(), for logs."""
    if not d:
        return "not recorded (no /proc)"
    return (f"{d.get('minflt', '?')} minor faults, {d.get('migrations', '?')} core moves, "
            f"{d.get('involuntary_switches', '?')} involuntary switches, ended on core {d.get('cpu', '?')}, "
            f"huge pages {d.get('anon_huge_kb', 0) / 1024:.0f} of {d.get('rss_kb', 0) / 1024:.0f} MiB resident"
            + (f" (THP {thp})" if thp else ""))
