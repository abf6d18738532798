from __future__ import annotations

import json
import subprocess
import sys

import pytest

from controller.fleet.loop_config import LoopConfig
from schemas import DraftTable, TableEnvelope, TableKey
from tabletune.cli import build_parser, main
from tabletune.control_commands import loop_config_of


def _write(tmp_path, data, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_validate_ok(tmp_path, capsys):
    path = _write(tmp_path, [[1, 16, 5], [17, 32, 4], [33, 64, 3]])
    assert main(["table", "validate", path, "--max-k", "5", "--max-batch", "64"]) == 0
    assert capsys.readouterr().out.strip() == "ok"


@pytest.mark.parametrize(
    ("triples", "message"),
    [
        ([[2, 64, 3]], "the first range must start at 1"),
        ([[1, 16, 3], [8, 64, 1]], "overlaps"),
        ([[1, 64, 6]], "K 6 exceeds the engine's max K 5"),
        ([[1, 32, 3]], "must cover up to max batch 64"),
    ],
)
def test_validate_names_the_problem(tmp_path, capsys, triples, message):
    path = _write(tmp_path, triples)
    assert main(["table", "validate", path, "--max-k", "5", "--max-batch", "64"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_validate_envelope_uses_its_limits(tmp_path, capsys):
    envelope = TableEnvelope(
        key=TableKey("m", "eagle", "h100"), version=2,
        table=DraftTable.from_vllm([[1, 8, 5], [9, 128, 2]]),
        startup_k_values=(0, 2, 5), max_batch=128, created_at="2026-11-29T00:00:00Z",
    )
    path = _write(tmp_path, envelope.to_dict())
    assert main(["table", "validate", path]) == 0
    bad = _write(tmp_path, {**envelope.to_dict(), "startup_k_values": [0, 5]}, "bad.json")
    assert main(["table", "validate", bad]) == 1
    assert "K values [2] are not in the engine's startup set [0, 5]" in capsys.readouterr().err


def test_validate_plain_table_needs_limits(tmp_path, capsys):
    assert main(["table", "validate", _write(tmp_path, [[1, 4, 1]])]) == 1
    assert "--max-k and --max-batch" in capsys.readouterr().err


def test_validate_unreadable_file(tmp_path, capsys):
    assert main(["table", "validate", str(tmp_path / "nope.json"), "--max-k", "1",
                 "--max-batch", "1"]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("to", "expected"),
    [
        ("vllm", [[1, 2, 3], [3, 4, 1]]),
        ("trtllm", {"2": 3, "4": 1}),
        ("dense", [3, 3, 1, 1]),
    ],
)
def test_convert(tmp_path, capsys, to, expected):
    path = _write(tmp_path, [[1, 2, 3], [3, 4, 1]])
    assert main(["table", "convert", path, "--to", to]) == 0
    assert json.loads(capsys.readouterr().out) == expected


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "tabletune.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for command in ("broker", "table"):
        assert command in out
    assert "TABLETUNE_BOOTSTRAP" in out


CONTROL_FLAGS = ("--refit-s", "--refit-spacing", "--reprofile-on-stale", "--no-reprofile-on-stale",
                 "--canary-share", "--force-grace-s", "--engine-idle-s",
                 "--guardrail-threshold", "--drift-acceptance-threshold")


def test_control_help_lists_the_operator_settings(capsys):
    assert main(["control", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in CONTROL_FLAGS:
        assert flag in out
    assert "TABLETUNE_EXPLORE_SHARE" in out


def test_control_without_flags_builds_the_default_loop_config():
    assert loop_config_of(build_parser().parse_args(["control"])) == LoopConfig()


def test_control_flags_reach_the_loop_config():
    args = build_parser().parse_args([
        "control", "--refit-s", "45", "--refit-spacing", "4", "--no-reprofile-on-stale", "--canary-share", "0.5",
        "--force-grace-s", "20", "--engine-idle-s", "15", "--guardrail-threshold", "0.05",
        "--drift-acceptance-threshold", "0.2", "--no-budgets"])
    config = loop_config_of(args)
    assert config.budgets is False and config.refit_spacing == 4.0
    assert (config.refit_interval_s, config.reprofile_on_stale, config.canary_share,
            config.force_grace_s, config.engine_idle_s) == (45.0, False, 0.5, 20.0, 15.0)
    assert config.guardrail.threshold == 0.05 and config.drift.acceptance_threshold == 0.2
    assert config.guardrail.z == LoopConfig().guardrail.z  # tuned constants untouched
