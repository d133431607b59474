"""Write ``tests/durations.json`` (seconds per test file, the order ``conftest.py`` hands the
files to the xdist workers in) from the output of a pytest run with ``--durations=0``.

    .venv/bin/python -m pytest -m "not serial" -n 3 --dist loadfile --durations=0 > LOG
    .venv/bin/python tests/durations.py LOG
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(?:\S*/)?(test_\w+\.py)::")
OUT = Path(__file__).with_name("durations.json")


def per_file(lines: list[str]) -> dict[str, int]:
    """Seconds per test file (setup, call and teardown summed), longest first; files under
    one second are left out."""
    took: Counter[str] = Counter()
    for line in lines:
        m = LINE.match(line)
        if m:
            took[m.group(2)] += float(m.group(1))
    return {f: round(s) for f, s in took.most_common() if s >= 1.0}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: tests/durations.py LOG (a pytest run's output with --durations=0)")
        return 2
    took = per_file(Path(argv[0]).read_text(errors="replace").splitlines())
    if not took:
        print(f"no --durations lines in {argv[0][:200]}")
        return 1
    OUT.write_text(json.dumps(took, indent=0) + "\n")
    print(f"{OUT}: {len(took)} files, {sum(took.values())} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
