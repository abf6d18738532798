"""Replace one marked section of a markdown file and nothing else.

The section lives between `<!-- suite:begin -->` and `<!-- suite:end -->`. A file without
the markers gets them appended at its end; a file with only one of them, or with them out of
order, is refused rather than guessed at (a hand edit went wrong; nothing is overwritten).
"""

from __future__ import annotations

import os
from pathlib import Path

BEGIN = "<!-- suite:begin -->"
END = "<!-- suite:end -->"


class MarkerError(ValueError):
    """The markers are not a well-formed pair; the message says what is wrong."""


def replace_section(text: str, section: str, *, begin: str = BEGIN, end: str = END) -> str:
    """`text` with everything between the markers replaced by `section`."""
    body = f"{begin}\n{section.strip(chr(10))}\n{end}"
    starts, ends = text.count(begin), text.count(end)
    if starts == 0 and ends == 0:
        head = text.rstrip("\n")
        return f"{head}\n\n{body}\n" if head else f"{body}\n"
    if starts != 1 or ends != 1:
        raise MarkerError(f"expected one {begin} and one {end}, found {starts} and {ends}")
    first, last = text.index(begin), text.index(end)
    if last < first:
        raise MarkerError(f"{end} comes before {begin}")
    return text[:first] + body + text[last + len(end):]


def write_section(path: str | Path, section: str) -> Path:
    """Rewrite `path` (created if missing) with the section replaced; atomic rename."""
    target = Path(path)
    text = target.read_text() if target.exists() else ""
    updated = replace_section(text, section)
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text(updated)
    os.replace(temporary, target)
    return target
