"""Plain-text tables: the command line's, the study's reports' and the benchmarks'."""
from __future__ import annotations


def format_table(rows, cols):
    """Plain-text table of dict rows (a missing key prints empty)."""
    cell = lambda r, c: str(r.get(c, ""))  # noqa: E731
    widths = [max([len(c)] + [len(cell(r, c)) for r in rows]) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell(r, c).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)
