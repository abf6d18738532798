"""TableTune's n-gram proposer: vLLM's prompt lookup, the match length, and live budgets.

The proposer's kernel is numba-compiled; it runs in child processes here (proposer_child,
proposer_engine), because numba objects in this process break the vLLM engine the hook
tests start in it.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from producers.ngram_proposer import lookup_range_from_env
from producers.prompt_lookup import prompt_lookup
from producers.proposer_link import unmark
from schemas import DraftTable, TableEnvelope, TableKey
from schemas.draft_budget import DraftBudget
from schemas.settings import Settings
from schemas.signing import generate_private_key, public_key_text
from tabletune.broker import EmbeddedBroker
from tests.kafka_helpers import read_telemetry
from tests.test_producers import vllm_setup
from tests.test_producers.lookup_cases import lookup_cases

REPO = Path(__file__).resolve().parents[2]
TABLE_KEY = "tiny|ngram|proposer-cpu"
ENGINE_ID = "proposer-test-engine"
BATCHES = [{"count": 12, "offset": 0}, {"count": 12, "offset": 600}]
BUDGET = {"min_match": 1, "ranges": [[1, 16, [0, 4, 1]]]}
"""Lookup 1..3: a one-token match drafts nothing, two tokens draft 4, three tokens 1."""


def _child(command: str, data: object) -> object:
    run = subprocess.run([sys.executable, "-m", "tests.test_producers.proposer_child", command],
                         input=json.dumps(data), capture_output=True, text=True, timeout=300,
                         cwd=REPO, env={**os.environ, "TABLETUNE_PROMPT_LOOKUP_MIN": "1",
                                        "TABLETUNE_PROMPT_LOOKUP_MAX": "3"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_its_lookup_drafts_what_vllms_does_and_knows_the_match_length() -> None:
    cases = lookup_cases(seed=1, max_len=120)
    results = _child("lookup", cases)
    assert isinstance(results, list)
    matched = 0
    for case, result in zip(cases, results, strict=True):
        assert result["ours"] == result["theirs"], case
        plain = prompt_lookup(np.array(case["tokens"], dtype=np.int32), min_n=case["min_n"],
                              max_n=case["max_n"], k=case["k"],
                              max_model_len=case["max_model_len"])
        assert result["match"] == plain.match_length, case
        matched += result["match"] > 0
    assert matched > 1000  # the cases exercise matches, not only misses


ROWS = [[7, 8, 9, 7, 8, 9, 1, 2, 3, 4, 9, 1, 2],  # ends "9 1 2": a 3-token match
        [5, 6, 1, 2, 3, 4, 5, 6, 7, 6],  # ends "6": the longest earlier match is 1 token
        [1, 2, 3, 4, 5, 6, 7, 5, 6],  # ends "5 6": 2 tokens
        [1, 2, 3],  # no earlier occurrence at all
        [4, 4, 4, 4]]  # not looked up: sampled nothing this step (a prefill chunk)
SAMPLED = [[2], [6], [6], [3], []]


def test_under_the_hook_drafts_carry_their_match_length_and_are_cut_on_return() -> None:
    spec = {"k": 4, "max_model_len": 64, "rows": ROWS, "sampled": SAMPLED}
    alone = _child("propose", {**spec, "hook": False})
    assert alone["lookup_range"] == [1, 3]
    for row, draft in zip(ROWS[:4], alone["drafts"], strict=False):
        plain = prompt_lookup(np.array(row), min_n=1, max_n=3, k=4)
        assert draft == plain.draft.tolist()  # no hook: the engine's num_speculative_tokens
    assert alone["drafts"][0] == [3, 4, 9, 1] and alone["drafts"][3:] == [[], []]

    marked = _child("propose", {**spec, "hook": True})["drafts"]
    # each looked-up draft ends with -1 - its match length; a prefill chunk drafts nothing
    assert marked == [alone["drafts"][0] + [-4], alone["drafts"][1] + [-2],
                      alone["drafts"][2] + [-3], [-1], []]

    at_k2 = [list(d) for d in marked]
    assert unmark(at_k2, 2, None) == [3, 1, 2, 0, -1]
    assert at_k2 == [d[:2] for d in alone["drafts"]]

    budget = DraftBudget.from_json(BUDGET).k_by_match(batch_size=5, max_match=3)
    assert budget == (0, 0, 4, 1)
    budgeted = [list(d) for d in marked]
    unmark(budgeted, 2, budget)
    assert budgeted == [alone["drafts"][0][:1], [], alone["drafts"][2][:4], [], []]
    assert len(budgeted[2]) > 2  # the budget drafts past the table's K


def test_the_lookup_range_comes_from_the_environment_by_vllms_rules() -> None:
    assert lookup_range_from_env({}) == (5, 5)  # vLLM's default
    assert lookup_range_from_env({"TABLETUNE_PROMPT_LOOKUP_MAX": "4"}) == (4, 4)
    assert lookup_range_from_env({"TABLETUNE_PROMPT_LOOKUP_MIN": "2"}) == (2, 2)
    both = {"TABLETUNE_PROMPT_LOOKUP_MIN": "1", "TABLETUNE_PROMPT_LOOKUP_MAX": "4"}
    assert lookup_range_from_env(both) == (1, 4)
    for env, named in (({"TABLETUNE_PROMPT_LOOKUP_MAX": "four"}, "TABLETUNE_PROMPT_LOOKUP_MAX"),
                       ({"TABLETUNE_PROMPT_LOOKUP_MIN": "0"}, "TABLETUNE_PROMPT_LOOKUP_MIN"),
                       ({"TABLETUNE_PROMPT_LOOKUP_MAX": "65"}, "TABLETUNE_PROMPT_LOOKUP_MAX"),
                       ({"TABLETUNE_PROMPT_LOOKUP_MIN": "5", "TABLETUNE_PROMPT_LOOKUP_MAX": "3"},
                        "TABLETUNE_PROMPT_LOOKUP_MIN=5")):
        with pytest.raises(ValueError, match=named):
            lookup_range_from_env(env)


class Lines:
    """A child's stdout, line by line, with a deadline on each wait."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self._process = process
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put("")  # EOF

    def wait_for(self, prefix: str, timeout_s: float = 300.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            if line.startswith(prefix):
                return line[len(prefix):]
            if line == "" and self._process.poll() is not None:
                raise AssertionError(f"the engine exited ({self._process.returncode}) before "
                                     f"{prefix!r}")


@pytest.fixture(scope="module")
def proposer_broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as broker:
        yield broker


def test_an_engine_with_the_proposer_applies_a_published_budget_at_its_version(
        tiny_model_dir: str, proposer_broker: EmbeddedBroker,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    control_key = generate_private_key()
    bootstrap = proposer_broker.bootstrap
    env = {**os.environ,
           **vllm_setup.engine_environment(str(tmp_path_factory.mktemp("vllm-cache"))),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TABLETUNE_SINK": f"kafka://{bootstrap}",
           "TABLETUNE_BOOTSTRAP": bootstrap, "TABLETUNE_ENGINE_ID": ENGINE_ID,
           "TABLETUNE_HARDWARE": "proposer-cpu", "TABLETUNE_TABLE_KEY": TABLE_KEY,
           "TABLETUNE_VERIFY_KEYS": f"k1:{public_key_text(control_key)}",
           "TABLETUNE_EXPLORE_SHARE": "0", "TABLETUNE_PROMPT_LOOKUP_MIN": "1",
           "TABLETUNE_PROMPT_LOOKUP_MAX": "3"}
    logs = tmp_path_factory.mktemp("proposer-engine")
    with (logs / "stderr").open("w") as stderr:
        engine = subprocess.Popen(
            [sys.executable, "-m", "tests.test_producers.proposer_engine", tiny_model_dir,
             json.dumps(BATCHES)], cwd=REPO, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        lines = Lines(engine)
        assert json.loads(lines.wait_for("BUDGETS ")) == 3  # lookup 1..3, synchronous
        lines.wait_for("PUBLISH")
        from controller.fleet.table_log import publish

        envelope = TableEnvelope(
            key=TableKey.parse(TABLE_KEY), version=1, table=DraftTable.from_vllm([[1, 16, 2]]),
            startup_k_values=(1, 2, 4), max_batch=vllm_setup.MAX_NUM_SEQS,
            created_at="2026-12-05T00:00:00Z", budget=DraftBudget.from_json(BUDGET))
        publish(Settings(bootstrap_servers=(bootstrap,), signing_key_id="k1",
                         signing_key=control_key), envelope)
        assert engine.stdin is not None
        engine.stdin.write("go\n")
        engine.stdin.flush()
        result = json.loads(lines.wait_for("RESULT "))
        engine.wait(timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert result["version"] == 1, (logs / "stderr").read_text()[-3000:]
    assert result["drafts"] > 100 and result["differ"] == 0  # vLLM's drafts, cut only by K

    records = read_telemetry(bootstrap, engine_id=ENGINE_ID, min_records=20).to_pylist()
    by_version: dict[int, list[dict]] = {0: [], 1: []}
    for record in sorted(records, key=lambda r: r["step_seq"]):
        rows = record["by_match_length"] or []
        if rows:
            assert sum(r["draft_tokens"] for r in rows) == record["num_draft_tokens"]
        by_version[record["table_version"]].append(record)
    # A version's first step verifies drafts proposed under the one before.
    before = [r for r in by_version[0][1:] if not r["forced"]]
    after = [r for r in by_version[1][1:] if not r["forced"]]
    assert before and after

    def drafted(records: list[dict], length: int) -> tuple[int, int]:
        rows = [row for r in records for row in r["by_match_length"] or []
                if row["match_length"] == length]
        return sum(row["requests"] for row in rows), sum(row["draft_tokens"] for row in rows)

    # Before: the startup table's K for every match; after: K by match length.
    one_before, one_after = drafted(before, 1), drafted(after, 1)
    assert one_before[1] > 0 and one_after[0] > 0 and one_after[1] == 0
    three_requests, three_tokens = drafted(after, 3)
    assert three_requests > 0 and 0 < three_tokens <= three_requests
    assert any(row["match_length"] == 2 and row["draft_tokens"] > 2 * row["requests"]
               for r in after for row in r["by_match_length"] or [])  # past the table's K2
