"""The deploy manifests parse, and everything they reference exists in the code.

No Docker engine or cluster runs here; these checks catch what breaks silently: a renamed
command, a flag that no longer exists, an environment variable nobody reads.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from schemas import DraftTable
from schemas.settings import ENV_VARS
from tabletune.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted(DEPLOY.rglob("*.yml")) + sorted(DEPLOY.rglob("*.yaml"))


def _documents():
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path, document


def _walk(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_manifests_exist_and_parse():
    names = {p.name for p in MANIFESTS}
    assert {"docker-compose.yml", "prometheus.yml", "vllm-deployment.yaml", "control.yaml",
            "topics-job.yaml", "secret.yaml", "configmap.yaml"} <= names
    assert len(list(_documents())) >= 8


def _tabletune_commands():
    for path, document in _documents():
        for node in _walk(document):
            for field in ("command", "args"):
                value = node.get(field)
                if isinstance(value, list) and value and value[0] == "tabletune":
                    yield path, [str(v) for v in value[1:]]


def test_every_tabletune_command_parses_with_the_real_cli():
    commands = list(_tabletune_commands())
    assert {c[1][0] for c in commands} >= {"ingest", "control"}
    parser = build_parser()
    for path, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit as exc:  # argparse exits on unknown commands or flags
            pytest.fail(f"{path.name}: `tabletune {shlex.join(argv)}` does not parse ({exc})")


def test_every_tabletune_env_name_is_read_by_the_code():
    seen = set()
    for path in MANIFESTS + sorted(DEPLOY.rglob(".env*")):
        seen |= set(re.findall(r"\bTABLETUNE_[A-Z_]+\b", path.read_text()))
    assert seen, "manifests configure nothing"
    unknown = sorted(seen - set(ENV_VARS))
    assert not unknown, f"manifests set variables the code never reads: {unknown}"


def test_vllm_servers_attach_the_hook_with_a_valid_startup_table():
    servers = 0
    for path, document in _documents():
        for node in _walk(document):
            args = node.get("command") or node.get("args")
            if not isinstance(args, list) or "--scheduler-cls" not in args:
                continue
            servers += 1
            assert args[args.index("--scheduler-cls") + 1] == "producers.vllm.TableTuneScheduler"
            spec = json.loads(args[args.index("--speculative-config") + 1])
            max_seqs = int(args[args.index("--max-num-seqs") + 1])
            table = DraftTable.from_vllm(spec["num_speculative_tokens_per_batch_size"])
            table.validate(spec["num_speculative_tokens"], max_seqs)
            assert table.k_values == set(range(spec["num_speculative_tokens"] + 1)), path
    assert servers == 2
    import producers.vllm  # noqa: F401 - the class the manifests name is importable
