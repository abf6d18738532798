"""The docs stand on their own in a clone: links stay inside it, and nothing cites notes it lacks.

Every relative markdown link in a tracked *.md file must point to a file or folder of this
repository. No tracked text file may cite the internal notes the project was built from (the
calibration, vLLM, Kafka, architecture and style notes); what users need from them lives in
docs/TWIN.md and docs/VLLM.md, and a reference to docs/VLLM.md is the one allowed form.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]

INTERNAL_NOTES = ("CALIBRATION", "VLLM", "KAFKA", "ARCHITECTURE", "STYLE")
NOTE_MENTION = re.compile(r"\b(" + "|".join(INTERNAL_NOTES) + r")\.md\b")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[`~]*[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+[\"'(][^)\n]*)?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]\n]+\]:\s*(<[^>\n]*>|\S+)", re.MULTILINE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def tracked(*patterns: str) -> list[Path]:
    try:
        done = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=REPO,
                              capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (or git is missing)")
    names = [name for name in done.stdout.decode().split("\0") if name]
    return [REPO / name for name in names if (REPO / name).is_file()]


def link_targets(markdown: str) -> list[str]:
    """Link destinations outside code blocks and code spans."""
    prose = CODE_SPAN.sub("", FENCE.sub("", markdown))
    found = [m.group(1) for m in INLINE_LINK.finditer(prose)]
    found += [m.group(1) for m in REFERENCE_LINK.finditer(prose)]
    return [target.strip("<>") for target in found]


def broken_link(source: Path, target: str) -> str | None:
    """Why `target` (a link in `source`) does not resolve inside the repository, or None."""
    if not target or target.startswith(("#", "//")) or SCHEME.match(target):
        return None  # an anchor in the same page, or a URL
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if not path:
        return None
    base = REPO if path.startswith("/") else source.parent
    resolved = (base / path.lstrip("/")).resolve()
    if not resolved.is_relative_to(REPO):
        return "points outside the repository"
    if not resolved.exists():
        return "no such file"
    return None


def note_mentions(text: str) -> list[str]:
    """Mentions of the internal notes; `docs/VLLM.md` (this repository's page) is allowed."""
    bad = []
    for match in NOTE_MENTION.finditer(text):
        before = text[:match.start()]
        ours = (match.group(1) == "VLLM" and before.endswith("docs/")
                and not before.endswith("shared/docs/"))
        if not ours:
            bad.append(text[max(0, match.start() - 30):match.end()].replace("\n", " "))
    return bad


def test_every_relative_markdown_link_resolves_inside_the_repository() -> None:
    problems = []
    for source in tracked("*.md"):
        for target in link_targets(source.read_text(encoding="utf-8")):
            why = broken_link(source, target)
            if why:
                problems.append(f"{source.relative_to(REPO)}: ({target}) {why}")
    assert not problems, "\n".join(problems)


def test_no_tracked_file_cites_the_internal_notes() -> None:
    problems = []
    for path in tracked():
        if path == Path(__file__).resolve():
            continue  # its own examples name the notes on purpose
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        problems += [f"{path.relative_to(REPO)}: ...{hit}" for hit in note_mentions(text)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("text", "bad"), [
    ("see docs/VLLM.md, hooks", False),
    ("[vLLM](../docs/VLLM.md#hooks)", False),
    ("see " + "VLLM" + ".md", True),
    ("(" + "CALIBRATION" + ".md)", True),
    ("../shared/docs/" + "VLLM" + ".md", True),
    ("docs/" + "KAFKA" + ".md", True),
    ("MY_" + "STYLE.md and " + "VLLM" + ".mdx", False),
])
def test_note_mentions(text: str, bad: bool) -> None:
    assert bool(note_mentions(text)) is bad


@pytest.mark.parametrize(("markdown", "targets"), [
    ("[a](docs/TWIN.md#policies) and ![b](<x y.png> \"t\")", ["docs/TWIN.md#policies", "x y.png"]),
    ("`[not](a-link)`\n```\n[nor](this)\n```\n[ref]: docs/OPERATIONS.md", ["docs/OPERATIONS.md"]),
])
def test_link_targets(markdown: str, targets: list[str]) -> None:
    assert link_targets(markdown) == targets


def test_broken_link() -> None:
    readme = REPO / "README.md"
    assert broken_link(readme, "docs/TWIN.md#policies") is None
    assert broken_link(readme, "https://example.com/x.md") is None
    assert broken_link(readme, "#topics") is None
    assert broken_link(readme, "docs/NO-SUCH-PAGE.md") == "no such file"
    assert broken_link(readme, "../shared/docs/notes.md") == "points outside the repository"
