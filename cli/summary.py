"""The end-of-capture summary: top functions and stacks with their share, counts, losses and overhead."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aiflame.core.model import FrameKind, Profile
from aiflame.core.unwind import END, STOPS

_SKIP_KINDS = (FrameKind.PROCESS, FrameKind.SEPARATOR)


def _short_stack(names: list[str], width: int = 90) -> str:
    text = " ; ".join(names)
    return text if len(text) <= width else "… " + text[-(width - 2):]


def print_summary(console: Console, prof: Profile, top: int = 10, agent_cpu_s: float | None = None,
                  elapsed_s: float | None = None, stalls: Profile | None = None) -> None:
    """Print the summary of `prof` (CPU samples and runtime events) and, when given, of its stall view."""
    total = prof.total_weight
    if total == 0:
        console.print("[yellow]no samples collected[/] (was the target on CPU?)")
    else:
        funcs = Table(title=f"Top functions (self) of {total} samples", title_justify="left")
        funcs.add_column("self %", justify="right")
        funcs.add_column("total %", justify="right")
        funcs.add_column("samples", justify="right")
        funcs.add_column("function")
        funcs.add_column("module")
        inclusive = prof.inclusive_weights()
        by_name: Counter[tuple[str, str]] = Counter()
        for frame, w in prof.self_weights().items():  # lines differ per address: group by function
            by_name[(frame.name, frame.module)] += w
        for (name, module), w in by_name.most_common(top):
            funcs.add_row(f"{100 * w / total:.1f}", f"{100 * inclusive[name] / total:.1f}", str(w),
                          escape(name), escape(module))
        console.print(funcs)
        stacks = Table(title="Top stacks (root ; … ; leaf)", title_justify="left")
        stacks.add_column("%", justify="right")
        stacks.add_column("samples", justify="right")
        stacks.add_column("stack")
        by_names: Counter[tuple[str, ...]] = Counter()
        for stack, w in prof.aggregate().items():
            by_names[tuple(f.name for f in stack if f.kind not in _SKIP_KINDS)] += w
        for names_t, w in by_names.most_common(top):
            names = list(names_t)
            stacks.add_row(f"{100 * w / total:.1f}", str(w), escape(_short_stack(names)))
        console.print(stacks)
    c = prof.counters
    line = (f"samples {total}  lost {c.get('lost', 0)}  user-stack errors {c.get('ustack_err', 0)}  "
            f"kernel-stack errors {c.get('kstack_err', 0)}")
    if c.get("proc_lost"):
        line += f"  process events lost {c['proc_lost']}"
    if c.get("before_delay"):
        line += f"  left out before --delay {c['before_delay']}"
    py = ""
    if c.get("python_samples"):
        py = f"python: {c['python_samples']} samples with Python frames"
        if c.get("python_spliced"):
            py += f", {c['python_spliced']} spliced at the root (native unwinding stopped early)"
        if c.get("python_mismatched"):
            py += f", {c['python_mismatched']} with evaluator/frame count mismatches"
        if c.get("py_truncated"):
            py += f", {c['py_truncated']} truncated (deep recursion)"
    if agent_cpu_s is not None:
        line += f"  agent CPU {agent_cpu_s:.2f}s"
        if elapsed_s:
            line += f" ({100 * agent_cpu_s / elapsed_s:.2f}% of a core)"
    console.print(line)
    if (blocked := off_cpu_line(prof)):
        console.print(escape(blocked))
    if py:
        console.print(py)
    if (walked := unwind_line(prof)):
        console.print(escape(walked))  # file names such as `[unknown]` or `[vdso]` are text, not markup
    if prof.events:
        from aiflame.cli.summary_events import print_events

        print_events(console, prof, top=top)
    if stalls is not None and (stalls.samples or stalls.counters):
        from aiflame.cli.summary_events import print_stalls

        print_stalls(console, stalls, top=top)
    if c.get("calls") or c.get("call_lost"):
        console.print(f"runtime calls probed {c.get('calls', 0)}  lost {c.get('call_lost', 0)}  "
                      f"returns lost {c.get('returns_lost', 0)}")
    if c.get("stops"):  # what the probes cost the targets in time
        console.print(f"targets held stopped {c['stops']} times, {c.get('stopped_ms', 0)} ms in all (library opens, "
                      f"the loader, exit)")
    if c.get("call_skipped"):  # launches over the per-CPU record budget: counted, their stacks sampled
        console.print(f"launches: {c.get('calls_counted', 0)} counted, {c['call_skipped']} of them without a "
                      f"stack of their own (over the record budget; each record kept stands for the launches of its "
                      f"kernel since the one before, and {c.get('calls_unsent', 0)} left at the end have no stack)")
    held = {k: c[k] for k in ("stops_resumed_by_watchdog", "stops_late", "stops_unrecorded", "libs_seen_full",
                              "py_procs_full", "unwind_procs_full", "targets_full") if c.get(k)}
    if held:  # what a target did that we had to cut short (see docs/daemon.md, "Hostile targets")
        console.print("limits reached: " + ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in held.items()))


def unwind_line(prof: Profile) -> str:
    """One line on the CFI unwinder: walks, how many reached the outermost frame, why the rest stopped."""
    c = prof.counters
    walked = c.get("unwind_cfi", 0)
    if not walked:
        return ""
    ends = c.get("unwind_end", 0)
    stops = sorted(((n, key) for code, (key, _) in STOPS.items() if code != END and (n := c.get(f"unwind_{key}", 0))),
                   reverse=True)
    line = f"native unwinding (CFI): {walked} walks, {100 * ends / walked:.1f}% reached the outermost frame"
    if c.get("unwind_tables"):
        line += (f" ({c['unwind_tables']} file tables, {c.get('unwind_rows', 0) * 8 >> 20} MiB in BPF"
                 + (f", {c['unwind_tables_evicted']} evicted" if c.get("unwind_tables_evicted") else "")
                 + (f" ({c['unwind_tables_evicted_again']} of them again)" if c.get("unwind_tables_evicted_again")
                    else "")
                 + (f", {c['unwind_tables_reloaded']} back when walks stopped at them"
                    if c.get("unwind_tables_reloaded") else "")
                 + (f", {c['unwind_table_errors']} files without" if c.get("unwind_table_errors") else "") + ")")
    if c.get("unwind_scanned"):
        line += f"; {c['unwind_scanned']} past code without CFI by a stack scan"
    if stops:
        line += "; stopped early: " + ", ".join(f"{key.replace('_', ' ')} {n}" for n, key in stops)
    if prof.meta.get("unwind_worst"):
        line += f"; most in {prof.meta['unwind_worst']}"
    return line


def off_cpu_line(prof: Profile) -> str:
    """Time blocked (`profile --off-cpu`): in all, and what the CUDA sync and NCCL markers name; "" without."""
    if not prof.off_cpu and not prof.counters.get("offcpu"):
        return ""
    by_marker: Counter[str] = Counter()
    for s in prof.off_cpu:
        by_marker[s.stack[-1].name if s.stack else ""] += s.weight
    total = sum(by_marker.values())
    line = f"off-CPU: {total / 1e9:.2f} s blocked in {len(prof.off_cpu)} blocks"
    named = [f"{name.removeprefix('[off-cpu: ').removesuffix(']')} {w / 1e9:.2f} s"
             for name, w in sorted(by_marker.items()) if name.startswith("[off-cpu: ")]
    if named:
        line += " (" + ", ".join(named) + ")"
    c = prof.counters
    if c.get("offcpu_lost") or c.get("offcpu_unpaired"):
        line += f"  lost {c.get('offcpu_lost', 0)}  unpaired {c.get('offcpu_unpaired', 0)}"
    return line
