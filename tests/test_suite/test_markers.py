"""BENCHMARKS.md regeneration touches only the marked section."""

from __future__ import annotations

import pytest

from tabletune.suite.markers import BEGIN, END, MarkerError, replace_section, write_section

BEFORE = "# Benchmarks\n\nhand-written intro\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
AFTER = "\n## Later section\n\nmore hand-written text\n"


def test_appends_the_markers_when_missing(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(BEFORE)
    write_section(path, "## Suite\n\nfirst")
    text = path.read_text()
    assert text.startswith(BEFORE)
    assert text.endswith(f"{BEGIN}\n## Suite\n\nfirst\n{END}\n")


def test_replaces_only_between_the_markers(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(f"{BEFORE}\n{BEGIN}\nold table\n{END}\n{AFTER}")
    write_section(path, "new table")
    write_section(path, "newer table")
    assert path.read_text() == f"{BEFORE}\n{BEGIN}\nnewer table\n{END}\n{AFTER}"


def test_creates_a_missing_file(tmp_path):
    path = tmp_path / "new.md"
    write_section(path, "x")
    assert path.read_text() == f"{BEGIN}\nx\n{END}\n"


@pytest.mark.parametrize("text", [f"a\n{BEGIN}\nb\n", f"{END}\nb\n{BEGIN}\n",
                                  f"{BEGIN}\n{END}\n{BEGIN}\n{END}\n"])
def test_refuses_broken_markers_and_leaves_the_file_alone(tmp_path, text):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(text)
    with pytest.raises(MarkerError):
        write_section(path, "x")
    assert path.read_text() == text


def test_replace_section_is_idempotent():
    once = replace_section(BEFORE, "s")
    assert replace_section(once, "s") == once
