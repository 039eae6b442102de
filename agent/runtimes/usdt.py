"""USDT (SystemTap SDT) sites as probes: a note's argument locations (symbolize/usdt.py) become a ProbeSpec that
captures the registers they name and reads the memory they point at, plus how to find each argument's value in
the resulting Call. One spec per site: each site has its own locations."""

from __future__ import annotations

from aiflame.agent.runtimes.base import ARG0, DEREF0, MAX_DEREFS, MAX_REGS, Deref, ProbeSpec, UsdtValue
from aiflame.core.errors import Refused
from aiflame.symbolize.objfmt.usdt import UsdtNote


def usdt_spec(note: UsdtNote, call: str, string_arg: int = -1, stack: bool = True) -> ProbeSpec:
    """The probe of one SDT site; `string_arg` names the argument that is a char* to read (-1: none).
    Refused (an Unreadable) when the site needs more registers or reads than a probe has."""
    regs: list[int] = []
    derefs: list[Deref] = []
    values: list[UsdtValue] = []

    def slot(reg: int) -> int:
        if reg not in regs:
            if len(regs) >= MAX_REGS:
                raise Refused(f"{note.provider}:{note.name}: more than {MAX_REGS} registers")
            regs.append(reg)
        return ARG0 + regs.index(reg)

    for a in note.args:
        if a.kind == "const":
            values.append(UsdtValue(-1, a.size, a.signed, a.value))
        elif a.kind == "reg":
            values.append(UsdtValue(slot(a.reg), a.size, a.signed))
        else:
            if len(derefs) >= MAX_DEREFS:
                raise Refused(f"{note.provider}:{note.name}: more than {MAX_DEREFS} memory arguments")
            derefs.append(Deref(slot(a.reg), a.offset))
            values.append(UsdtValue(DEREF0 + len(derefs) - 1, a.size, a.signed))
    string = -1
    if 0 <= string_arg < len(values) and values[string_arg].src >= 0:
        string = values[string_arg].src
    return ProbeSpec((), call, stack=stack, derefs=tuple(derefs), string=string, regs=tuple(regs),
                     usdt=tuple(values), semaphore=max(note.semaphore_offset, 0))
