"""Every command refuses bad input in one line, with the right exit status (issue 31, defect
11): a usage error (a flag out of bounds, a malformed argument) exits 2 naming the flag; a
failure (an unreadable, binary or huge file, an unreachable bootstrap, a message the broker
refuses, a port in use) exits 1 naming the file, the bootstrap or the port; never a
traceback, never a hang. In-process through `tabletune.cli.main` (a subprocess costs ~2 s
of imports), one subprocess for the real stderr of a dead bootstrap."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fitter.dataset import file_name, hive_path
from fitter.surface.synthetic import make_step_records
from schemas import DraftTable, TableEnvelope, TableKey
from tabletune.broker import free_port
from tabletune.cli import main
from twin.scenario_file import BUILTIN_SCENARIOS

SCENARIO = str(BUILTIN_SCENARIOS / "load-drift.toml")
KEY = "m|eagle|h100"
UNREACHABLE_WITHIN_S = 15.0
"""Far below kafka-python's 30 s of bootstrap retries, which ended in a traceback."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One of each kind of bad input file, and good ones to go with them."""
    root = tmp_path_factory.mktemp("bad-input")
    envelope = TableEnvelope(key=TableKey.parse(KEY), version=2,
                             table=DraftTable.from_vllm([[1, 8, 5], [9, 128, 2]]),
                             startup_k_values=(0, 2, 5), max_batch=128,
                             created_at="2026-11-29T00:00:00Z")
    (root / "envelope.json").write_text(json.dumps(envelope.to_dict()))
    padded = {**envelope.to_dict(), "provenance": {"pad": "x" * 6_000_000}}
    (root / "six-mb.json").write_text(json.dumps(padded))
    (root / "triples.json").write_text("[[1, 16, 5], [17, 64, 3]]")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 16)
    with open(root / "twenty-mb.json", "wb") as out:
        out.truncate(20 << 20)
    (root / "deep.json").write_text("[" * 200_000)
    return {"envelope": str(root / "envelope.json"), "six_mb": str(root / "six-mb.json"),
            "triples": str(root / "triples.json"), "binary": str(root / "binary.bin"),
            "twenty_mb": str(root / "twenty-mb.json"), "missing": str(root / "missing.json"),
            "deep": str(root / "deep.json"), "dir": str(root)}


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, the one stderr line), asserting there is exactly one line and
    no traceback."""
    status = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return status, out, lines[0]


USAGE = [  # (argv, what the error line must say)
    (["ingest", "--out", "{dir}", "--window-records", "-5"], "--window-records"),
    (["ingest", "--out", "{dir}", "--until-idle", "-1"], "--until-idle: must be a number > 0"),
    (["table", "convert", "{triples}", "--to", "dense", "--max-batch", "-3"],
     "--max-batch: must be an integer >= 1"),
    (["table", "validate", "{triples}", "--max-k", "5", "--max-batch", "-64"],
     "--max-batch"),
    (["twin", "run", "--scenario", SCENARIO, "--policy", "fixed:3", "--duration", "-5"],
     "--duration: must be a number > 0"),
    (["twin", "static", "--acceptance", "0.5", "--k", "-1"], "--k"),  # it used to hang
    (["twin", "static", "--acceptance", "1.5"], "--acceptance: must be a number in [0, 1]"),
    (["twin", "fleet", "--scenario", SCENARIO, "--engines", "0"], "--engines"),
    (["broker", "--port", "70000"], "--port: must be an integer in 1..65535"),
    (["broker", "--telemetry-partitions", "0"], "--telemetry-partitions"),
    (["controller", "pin", KEY, "x"], "version: must be an integer >= 1, got 'x'"),
    (["controller", "show", "not-a-key"], "model|drafter|hardware"),
    (["control", "--canary-share", "5"], "--canary-share: must be a number in (0, 1]"),
    (["control", "--lookback-s", "-5"], "--lookback-s"),
    (["control", "--refit-s", "0"], "--refit-s: must be a number > 0"),
    (["control", "--refit-spacing", "0.5"], "--refit-spacing: must be a number >= 1"),
    (["control", "--force-grace-s", "3595"], "--force-grace-s: must be a number in (0, 3594]"),
    (["control", "--engine-idle-s", "-1"], "--engine-idle-s: must be a number > 0"),
    (["control", "--guardrail-threshold", "1"],
     "--guardrail-threshold: must be a number in (0, 1)"),
    (["control", "--drift-acceptance-threshold", "nan"], "--drift-acceptance-threshold"),
    (["control", "--reprofile-on-stale", "no"], "unrecognized arguments: no"),
    (["fit", "--parquet", "{dir}", "--out", "x.json", "--startup-k", "-1"], "--startup-k"),
    (["fit", "--parquet", "{dir}", "--out", "x.json", "--half-life-s", "0"], "--half-life-s"),
    (["profile", "--engine", "twin:load-drift", "--out", "{dir}", "--budget-s", "-5"],
     "--budget-s"),
    (["profile", "--engine", "openai:http://127.0.0.1:1", "--out", "{dir}",
      "--k-values", "0,a"], "--k-values"),
    (["profile", "--engine", "twin:load-drift", "--out", "{dir}", "--key", KEY],
     "only apply to openai:URL"),
    (["demo", "--phase-s", "nan"], "--phase-s"),
    (["bench", "--out", "{dir}", "--processes", "0"], "--processes"),
    (["table"], "required: COMMAND"),
    (["twin"], "required: COMMAND"),
]


@pytest.mark.parametrize(("argv", "says"), USAGE, ids=[" ".join(a[:2]) + f" {i}"
                                                       for i, (a, _) in enumerate(USAGE)])
def test_a_usage_error_exits_2_naming_the_flag(capsys, files, argv, says):
    status, out, line = run(capsys, [part.format(**files) for part in argv])
    assert status == 2 and says in line and out == ""


FILES = [  # (argv, the file kind, what the error line must say)
    (["table", "validate", "{binary}", "--max-k", "5", "--max-batch", "64"],
     "binary.bin", "not a JSON text file"),
    (["table", "convert", "{binary}", "--to", "vllm"], "binary.bin", "not a JSON text"),
    (["table", "validate", "{missing}", "--max-k", "5", "--max-batch", "64"], "missing.json",
     "No such file"),
    (["table", "convert", "{twenty_mb}", "--to", "vllm"], "twenty-mb.json",
     "larger than a table file can be"),
    (["tables", "publish", "{binary}", "--bootstrap", "127.0.0.1:1"], "binary.bin",
     "not a JSON text file"),
    (["twin", "run", "--scenario", "{binary}", "--policy", "fixed:3"], "binary.bin",
     "not a TOML text file"),
    (["twin", "run", "--scenario", SCENARIO, "--policy", "table:{binary}",
      "--duration", "1"], "binary.bin", "not a JSON text file"),
    (["twin", "static", "--trace", "{binary}"], "binary.bin", "not UTF-8 text"),
    (["bench", "--out", "{binary}", "--no-markdown"], "binary.bin", "File exists"),
    # JSON nested past the parser's recursion limit: a RecursionError traceback before
    (["table", "validate", "{deep}", "--max-k", "5", "--max-batch", "64"], "deep.json",
     "nests deeper than the parser goes"),
    (["table", "convert", "{deep}", "--to", "vllm"], "deep.json", "nests deeper"),
    (["tables", "publish", "{deep}", "--bootstrap", "127.0.0.1:1"], "deep.json",
     "nests deeper"),
    (["twin", "run", "--scenario", SCENARIO, "--policy", "table:{deep}", "--duration", "1"],
     "deep.json", "nests deeper"),
]


@pytest.mark.parametrize(("argv", "name", "says"), FILES,
                         ids=[f"{a[0]} {a[1]} {n}" for a, n, _ in FILES])
def test_a_bad_file_exits_1_naming_it(capsys, files, argv, name, says):
    status, out, line = run(capsys, [part.format(**files) for part in argv])
    assert status == 1 and name in line and says in line and out == ""


@pytest.fixture(scope="module")
def dead() -> str:
    """A bootstrap nothing listens on."""
    return f"127.0.0.1:{free_port()}"


UNREACHABLE = [
    ["tables", "publish", "{envelope}", "--bootstrap", "{dead}"],
    ["tables", "follow", "--key", KEY, "--exit-when-idle", "--bootstrap", "{dead}"],
    ["controller", "show", KEY, "--bootstrap", "{dead}"],
    ["controller", "pin", KEY, "2", "--bootstrap", "{dead}"],
    ["controller", "rollback", KEY, "--bootstrap", "{dead}"],
    ["control", "--duration-s", "1", "--bootstrap", "{dead}"],
    ["ingest", "--out", "{dir}/ingest", "--until-idle", "1", "--bootstrap", "{dead}"],
    ["twin", "fleet", "--scenario", SCENARIO, "--duration", "1", "--bootstrap", "{dead}"],
    ["twin", "run", "--scenario", SCENARIO, "--policy", "fixed:3", "--duration", "1",
     "--sink", "kafka://{dead}"],
    ["profile", "--engine", "openai:http://127.0.0.1:1", "--out", "{dir}/profile", "--key",
     KEY, "--max-k", "3", "--bootstrap", "{dead}"],
]


@pytest.mark.parametrize("argv", UNREACHABLE, ids=[" ".join(a[:2]) for a in UNREACHABLE])
def test_an_unreachable_bootstrap_fails_at_once_naming_it(capsys, files, dead, argv):
    started = time.monotonic()
    status, out, line = run(capsys, [part.format(dead=dead, **files) for part in argv])
    assert time.monotonic() - started < UNREACHABLE_WITHIN_S
    assert status == 1 and f"cannot reach Kafka at {dead}" in line and out == ""


def test_an_unreachable_bootstrap_is_one_line_on_the_real_stderr(files, dead):
    """Through the console entry point: kafka-python's own log stays out of it too."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tabletune.cli", "tables", "publish",
                           files["envelope"], "--bootstrap", dead],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TABLETUNE_BOOTSTRAP": ""})
    assert time.monotonic() - started < UNREACHABLE_WITHIN_S + 5
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: cannot reach Kafka at {dead} (Connection refused): check --bootstrap or "
        "TABLETUNE_BOOTSTRAP"]


def test_a_six_megabyte_publish_is_refused_in_one_line(capsys, files, broker):
    status, out, line = run(capsys, ["tables", "publish", files["six_mb"],
                                     "--bootstrap", broker.bootstrap])
    assert status == 1 and "bytes" in line and out == ""


def test_ingest_into_a_file_is_refused_naming_it(capsys, files, broker):
    status, _, line = run(capsys, ["ingest", "--out", files["binary"], "--until-idle",
                                   "1", "--bootstrap", broker.bootstrap])
    assert status == 1 and "binary.bin" in line


def test_a_broker_on_a_port_in_use_is_refused_without_touching_it(capsys):
    """It used to print its address, exit 0 and create its topics on whatever listened."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, out, line = run(capsys, ["broker", "--port", str(port)])
        taken.settimeout(0.2)
        with pytest.raises(TimeoutError):
            taken.accept()  # nothing connected to it
    assert status == 1 and out == "" and f"port {port} on 127.0.0.1 is already in use" in line


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A good dataset with a corrupt file, one with a foreign-schema file (whose nulls made
    the fit fail with "cannot convert float NaN to integer"), one with nothing but those."""
    records = make_step_records(6_000, seed=5, max_batch=64)
    made = {}
    for name, extra in (("corrupt", "corrupt"), ("foreign", "foreign"), ("only-bad", None)):
        root = tmp_path_factory.mktemp(name)
        folder = root / hive_path("m", "eagle", "h100", "2026-12-01", 1)
        folder.mkdir(parents=True)
        if extra is not None:
            pq.write_table(records, folder / file_name("tabletune.telemetry", 0, 0, 9))
        if extra != "foreign":
            (folder / file_name("tabletune.telemetry", 1, 0, 9)).write_bytes(
                b"PAR1" + bytes(range(256)) * 4)
        if extra != "corrupt":
            pq.write_table(pa.table({"engine_id": ["x"] * 3, "step_seq": [1, 2, 3],
                                     "ts_ns": [1, 2, 3], "step_latency_s": [0.1] * 3}),
                           folder / file_name("tabletune.telemetry", 2, 0, 9))
        made[name] = root
    return made


@pytest.mark.parametrize("kind", ["corrupt", "foreign"])
def test_fit_skips_a_bad_parquet_file_naming_and_counting_it(capsys, caplog, tmp_path,
                                                             datasets, kind):
    out_file = tmp_path / "candidate.json"
    assert main(["fit", "--parquet", str(datasets[kind]), "--out", str(out_file)]) == 0
    outcome = json.loads(capsys.readouterr().out)
    partition = 1 if kind == "corrupt" else 2
    bad = file_name("tabletune.telemetry", partition, 0, 9)
    assert outcome["records"] == 6_000 and out_file.exists()
    assert [Path(f["path"]).name for f in outcome["skipped_files"]] == [bad]
    reason = outcome["skipped_files"][0]["reason"]
    assert reason.startswith("not a readable Parquet file" if kind == "corrupt"
                             else "not step records: no schema_version")
    assert any(bad in message for message in caplog.messages)


def test_fit_strict_refuses_a_bad_parquet_file_naming_it(capsys, tmp_path, datasets):
    status, out, line = run(capsys, ["fit", "--parquet", str(datasets["corrupt"]), "--out",
                                     str(tmp_path / "c.json"), "--strict"])
    bad = file_name("tabletune.telemetry", 1, 0, 9)
    assert status == 1 and bad in line and "not a readable Parquet file" in line
    assert not (tmp_path / "c.json").exists()


def test_fit_of_nothing_but_bad_files_fails_in_one_line(capsys, tmp_path, datasets):
    status, _, line = run(capsys, ["fit", "--parquet", str(datasets["only-bad"]), "--out",
                                   str(tmp_path / "c.json")])
    assert status == 1 and "every Parquet file was skipped (2;" in line
