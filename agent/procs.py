"""What the agent asks about processes, answered by psutil: is a process alive, what state is it in, which
processes are below it, is an id a thread of another process; and the agent's own CPU time and memory."""

from __future__ import annotations

import resource

import psutil

GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)  # exited: nothing left to sample


def status(pid: int) -> str | None:
    """psutil's status of `pid` (psutil.STATUS_RUNNING, _SLEEPING, _STOPPED, _ZOMBIE, ...); None when there is
    no such process."""
    if pid <= 0:
        return None
    try:
        return str(psutil.Process(pid).status())
    except psutil.NoSuchProcess:  # ZombieProcess is a NoSuchProcess too, but status() answers for zombies
        return None
    except psutil.Error:
        return None


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    return status(pid) not in (None, *GONE)


def descendants(pid: int) -> list[int]:
    """The processes below `pid` now, parents before their children; [] when `pid` is gone."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def is_thread(tid: int) -> bool:
    """True when `tid` is not a process of its own: a thread of another process (psutil counts thread-group
    leaders only), or gone already."""
    return not psutil.pid_exists(tid)


def own_cpu_s() -> float:
    """CPU seconds this agent has used so far (all its threads, user and system). getrusage, not psutil's
    cpu_times(): the same kernel counters in microseconds rather than /proc's 10 ms clock ticks, which would
    round a short capture's agent CPU away."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def own_rss_bytes() -> int:
    """This agent's resident memory."""
    try:
        return int(psutil.Process().memory_info().rss)
    except psutil.Error:
        return 0
