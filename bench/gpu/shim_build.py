"""Build the CUPTI injection library as a pip-torch host without CUDA's crt/ would: only CUPTI's own include
directory is searched, so aiflame's crt/ stand-in is used. Prints the library's path (issue #26's check that the
stand-in's build samples on a real GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

from aiflame.agent.accel import cupti_build


def main() -> int:
    install = cupti_build.find_cupti()
    if install is None:
        print("no CUPTI", file=sys.stderr)
        return 1
    cupti_build.crt_candidates = lambda c, env=None: [c.include]  # type: ignore[assignment]
    print(cupti_build.build_injection(install, Path(sys.argv[1])))
    print(install.library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
