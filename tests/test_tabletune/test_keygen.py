"""Issue 31 defect 10 on the command line: `tabletune keygen` makes the key pair, and a
command started with a placeholder secret refuses to start in one line naming it."""

from __future__ import annotations

import pytest

from schemas import DraftTable, TableEnvelope, TableKey
from schemas.settings import Settings
from tabletune.cli import main


def _keygen(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, str]:
    assert main(["keygen", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_keygen_prints_a_key_pair_that_signs_and_verifies(capsys) -> None:
    env = _keygen(capsys, "--key-id", "2026-12")
    assert set(env) == {"TABLETUNE_SIGNING_KEY_ID", "TABLETUNE_SIGNING_KEY",
                        "TABLETUNE_VERIFY_KEYS"}
    assert env["TABLETUNE_VERIFY_KEYS"].startswith("2026-12:")
    service = Settings.from_env({k: v for k, v in env.items() if k != "TABLETUNE_VERIFY_KEYS"})
    engine = Settings.from_env({"TABLETUNE_VERIFY_KEYS": env["TABLETUNE_VERIFY_KEYS"]})
    assert service.signing_key is not None and engine.signing_key is None
    signed = TableEnvelope(key=TableKey("m", "d", "h"), version=1,
                           table=DraftTable.from_vllm([[1, 8, 2]]), startup_k_values=(0, 2),
                           max_batch=8, created_at="2026-12-01T00:00:00+00:00"
                           ).signed("2026-12", service.signing_key)
    signed.verify(engine.keyring())
    assert _keygen(capsys)["TABLETUNE_SIGNING_KEY"] != env["TABLETUNE_SIGNING_KEY"]


@pytest.mark.parametrize("argv", [["control"], ["controller", "pin", "m|d|h", "1"],
                                  ["tables", "follow", "--key", "m|d|h"]])
def test_a_placeholder_secret_stops_a_command_in_one_line(monkeypatch, capsys, argv) -> None:
    monkeypatch.setenv("TABLETUNE_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("TABLETUNE_SIGNING_KEY_ID", "2026-11")
    monkeypatch.setenv("TABLETUNE_SIGNING_KEY", "change-me-to-a-key-from-tabletune-keygen")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == ("error: TABLETUNE_SIGNING_KEY holds a placeholder ('change-me...') from an "
                   "example manifest: set the real value\n")
