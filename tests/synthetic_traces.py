"""SpecDecode-Bench-shaped traces from a seeded RNG: the tests' trace data on machines that
have no copy of the benchmark's files.

A row carries the fields of a SpecDecode-Bench JSONL row (`id`, `prompt_token_ids`,
`generated_token_ids`, `acc_eagle.acc_len`, `acc_ngram.acc_len`), with random token ids.
Acceptance is bursty as in the real traces: the drafter agrees with the target in runs, so
`acc_len` counts down through a run (5 4 3 2 1), and each request agrees at its own rate.
The rate rises with the request's length, as in the benchmark's traces, where n-gram copying
and EAGLE both do better on long requests. The profiles' lengths and acceptance follow the
per-dataset summary statistics (means, spreads) of the benchmark's files; no row is copied.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 128_256
"""Token ids are drawn below Llama 3's vocabulary size; only their count matters."""
MAX_ACC_LEN = 21
"""The benchmark drafted at most 20 tokens per position: acc_len never exceeds 21."""
MAX_TOKENS = 8192
"""The benchmark's generation limit, and a bound on generated prompts."""


@dataclass(frozen=True, slots=True)
class DrafterShape:
    """How one drafter agrees with the target, before per-request variation."""

    share: float
    """Share of positions whose drafted token matches the target's."""
    run_len: float
    """Mean length of a run of agreement (the conditional acceptance is about 1 - 1/run_len)."""
    spread: float
    """SD of the request's latent predictability on the logit of `share` (and, halved, on
    the log of `run_len`): how much requests differ from one another."""


@dataclass(frozen=True, slots=True)
class TraceProfile:
    """One dataset's shape: log-normal lengths and two drafters' agreement."""

    requests: int
    """Rows, as many as the benchmark's file holds."""
    prompt_log_mean: float
    prompt_log_sd: float
    output_log_mean: float
    output_log_sd: float
    eagle: DrafterShape
    ngram: DrafterShape
    prompt_coupling: float
    """Correlation of a request's log prompt length with its predictability (n-gram drafts
    copy from the context)."""
    output_coupling: float
    """Correlation of a request's log output length with its predictability."""
    eagle_rerun_share: float
    """Requests whose EAGLE column came from a run of another length (as in the benchmark,
    where len(acc_eagle.acc_len) differs from len(generated_token_ids) for some rows)."""
    runaway_share: float
    """Requests that fall into repeating themselves until the generation limit: a few such
    long, well-copied requests are what makes n-gram acceptance rise with length."""


RUNAWAY_NGRAM = DrafterShape(0.93, 15.0, 0.0)
"""N-gram agreement inside a repetition loop: it copies the loop almost exactly."""

PROFILES: dict[str, TraceProfile] = {
    "sharegpt": TraceProfile(310, 5.2, 1.1, 6.1, 1.0, DrafterShape(0.66, 2.9, 0.5),
                             DrafterShape(0.17, 5.0, 1.5), prompt_coupling=0.4,
                             output_coupling=0.4, eagle_rerun_share=0.75, runaway_share=0.013),
    "gsm8k": TraceProfile(300, 4.5, 0.22, 5.1, 0.33, DrafterShape(0.72, 2.9, 0.3),
                          DrafterShape(0.16, 2.6, 0.5), prompt_coupling=0.4,
                          output_coupling=0.4, eagle_rerun_share=0.4, runaway_share=0.0),
    "instructcoder": TraceProfile(500, 5.1, 0.3, 4.9, 0.7, DrafterShape(0.72, 3.4, 0.5),
                                  DrafterShape(0.55, 14.0, 1.2), prompt_coupling=0.5,
                                  output_coupling=0.2, eagle_rerun_share=0.2,
                                  runaway_share=0.01),
}
"""Named after the benchmark's datasets they imitate, so `ngram_match_prob_for` reads the
same name from a generated file as from the real one."""


def write_traces(directory: str | Path, *, seed: int = 0) -> Path:
    """`{name}.jsonl` for every profile in `directory`, laid out like the benchmark's folder."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    for offset, name in enumerate(PROFILES):
        write_trace(folder / f"{name}.jsonl", name, seed=seed + offset)
    return folder


def write_trace(path: str | Path, profile: str, *, seed: int = 0,
                requests: int | None = None) -> Path:
    """One profile's trace as JSONL; `requests` overrides the dataset's count."""
    rng = np.random.default_rng(seed)
    shape = PROFILES[profile]
    with open(path, "w") as out:
        for row in trace_rows(shape, rng, requests or shape.requests):
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
    return Path(path)


def trace_rows(profile: TraceProfile, rng: np.random.Generator,
               requests: int) -> Iterator[dict[str, Any]]:
    """Rows in file order; one latent predictability per request ties its lengths to its
    acceptance, and a fixed count of runaways keeps a small trace's tail like a large one's."""
    runaways = set(rng.choice(requests, round(profile.runaway_share * requests),
                              replace=False).tolist())
    for index in range(requests):
        latent = float(rng.normal())
        prompt = _length(rng, profile.prompt_log_mean, profile.prompt_log_sd, latent,
                         profile.prompt_coupling)
        output = _length(rng, profile.output_log_mean, profile.output_log_sd, latent,
                         profile.output_coupling)
        ngram = _agreement_of(rng, output, profile.ngram, latent)
        if index in runaways and output < MAX_TOKENS:
            # it repeats itself up to the limit, and n-gram drafts copy the repetition
            loop = _agreement(rng, MAX_TOKENS - output, RUNAWAY_NGRAM.share,
                              RUNAWAY_NGRAM.run_len)
            ngram, output = np.concatenate([ngram, loop]), MAX_TOKENS
        eagle_output = output
        if rng.random() < profile.eagle_rerun_share:
            eagle_output = _clip(output * np.exp(rng.normal(0.0, 0.2)))
        eagle = _agreement_of(rng, eagle_output, profile.eagle, latent)
        yield {
            "id": str(index),
            "prompt_token_ids": rng.integers(0, VOCAB, prompt).tolist(),
            "generated_token_ids": rng.integers(0, VOCAB, output).tolist(),
            "acc_eagle": {"acc_len": _acc_len(eagle).tolist()},
            "acc_ngram": {"acc_len": _acc_len(ngram).tolist()},
        }


def _length(rng: np.random.Generator, log_mean: float, log_sd: float, latent: float,
            coupling: float) -> int:
    """A log-normal length whose log correlates `coupling` with the request's latent."""
    z = coupling * latent + np.sqrt(1.0 - coupling**2) * rng.normal()
    return _clip(np.exp(log_mean + log_sd * z))


def _clip(length: float) -> int:
    """A token count the benchmark could have recorded."""
    return int(np.clip(np.rint(length), 1, MAX_TOKENS))


def _agreement_of(rng: np.random.Generator, length: int, drafter: DrafterShape,
                  latent: float) -> np.ndarray:
    """The drafter's agreement per position for a request of this latent predictability."""
    logit = np.log(drafter.share / (1.0 - drafter.share)) + drafter.spread * latent
    share = float(1.0 / (1.0 + np.exp(-logit)))
    run_len = drafter.run_len * float(np.exp(0.5 * drafter.spread * latent))
    return _agreement(rng, length, share, max(run_len, 1.0))


def _acc_len(agree: np.ndarray) -> np.ndarray:
    """acc_len[t] = 1 + the run of agreement at positions t+1.. (capped): a countdown."""
    return np.minimum(1 + np.append(_runs_from(agree)[1:], 0), MAX_ACC_LEN)


def _agreement(rng: np.random.Generator, length: int, share: float,
               run_len: float) -> np.ndarray:
    """Alternating geometric runs of agreement (mean `run_len`) and disagreement, the latter
    sized so that about `share` of the positions agree; the first run's kind is drawn."""
    gap = max(1.0, run_len * (1.0 - share) / max(share, 1e-9))
    runs: list[np.ndarray] = []
    covered = 0
    while not runs or covered - int(runs[0][0]) < length:  # enough without the first run
        pairs = int(length / (run_len + gap)) + 4
        drawn = np.empty(2 * pairs, dtype=np.int64)
        drawn[0::2] = rng.geometric(1.0 / run_len, pairs)
        drawn[1::2] = rng.geometric(1.0 / gap, pairs)
        runs.append(drawn)
        covered += int(drawn.sum())
    lengths = np.concatenate(runs)
    kinds = np.resize([True, False], len(lengths))
    first = 0 if rng.random() < share else 1
    return np.repeat(kinds[first:], lengths[first:])[:length]


def _runs_from(agree: np.ndarray) -> np.ndarray:
    """run[t] = how many consecutive positions from t on agree."""
    backwards = agree[::-1].astype(np.int64)
    total = np.cumsum(backwards)
    at_last_miss = np.maximum.accumulate(np.where(backwards == 0, total, 0))
    return (total - at_last_miss)[::-1]
