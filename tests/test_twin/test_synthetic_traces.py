"""Generated traces: SpecDecode-Bench's row shape, bursty acceptance that differs by request."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.synthetic_traces import MAX_ACC_LEN, PROFILES, write_trace
from twin.workload import load_trace

FIELDS = {"id", "prompt_token_ids", "generated_token_ids", "acc_eagle", "acc_ngram"}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_have_the_benchmarks_fields_and_the_twin_reads_them(generated_traces):
    for name, profile in PROFILES.items():
        path = generated_traces / f"{name}.jsonl"
        rows = _rows(path)
        assert len(rows) == profile.requests
        assert all(set(row) == FIELDS and isinstance(row["id"], str) for row in rows)
        ngram_lengths = [len(r["acc_ngram"]["acc_len"]) for r in rows]
        assert ngram_lengths == [len(r["generated_token_ids"]) for r in rows]
        eagle = load_trace(path, "eagle")
        assert eagle.output_len.tolist() == [len(r["acc_eagle"]["acc_len"]) for r in rows]
        assert eagle.prompt_len.tolist() == [len(r["prompt_token_ids"]) for r in rows]
        assert load_trace(path, "ngram").output_len.tolist() == ngram_lengths


def test_acceptance_comes_in_runs_that_count_down(generated_traces):
    for row in _rows(generated_traces / "sharegpt.jsonl"):
        for method in ("acc_eagle", "acc_ngram"):
            acc = np.array(row[method]["acc_len"])
            assert acc.min() >= 1 and acc.max() <= MAX_ACC_LEN and acc[-1] == 1
            inside = (acc[:-1] > 1) & (acc[:-1] < MAX_ACC_LEN)
            assert np.array_equal(acc[1:][inside], acc[:-1][inside] - 1)
    acc = np.concatenate([r["acc_ngram"]["acc_len"] for r in _rows(
        generated_traces / "gsm8k.jsonl")])
    first = np.mean(acc > 1)
    assert np.mean(acc[acc > 1] > 2) > first + 0.3  # an accepted draft makes the next likely


def test_requests_accept_at_their_own_rates_and_long_ones_better(generated_traces):
    rows = [r for r in _rows(generated_traces / "sharegpt.jsonl")
            if len(r["acc_ngram"]["acc_len"]) >= 100]
    accepted = [np.array(r["acc_ngram"]["acc_len"]) > 1 for r in rows]
    rates = np.array([a.mean() for a in accepted])
    pooled = np.concatenate(accepted).mean()
    # one shared rate would spread the rates by a binomial sd at most about 0.05 here
    binomial_sd = np.sqrt(pooled * (1 - pooled) / np.array([len(a) for a in accepted]))
    assert rates.std() > 3 * binomial_sd.max()
    context = np.array([len(r["prompt_token_ids"]) + len(r["generated_token_ids"])
                        for r in rows])
    assert np.corrcoef(np.log(context), rates)[0, 1] > 0.2


def test_a_seed_gives_the_same_trace_and_another_seed_another(tmp_path):
    first = write_trace(tmp_path / "a.jsonl", "gsm8k", seed=3, requests=20).read_text()
    again = write_trace(tmp_path / "b.jsonl", "gsm8k", seed=3, requests=20).read_text()
    other = write_trace(tmp_path / "c.jsonl", "gsm8k", seed=4, requests=20).read_text()
    assert first == again and first != other
    assert len(first.splitlines()) == 20
