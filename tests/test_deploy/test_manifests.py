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


def _k8s_pods():
    """(name, container, volumes) of every pod template in deploy/k8s."""
    for path, document in _documents():
        if path.parent.name != "k8s" or document.get("kind") not in ("Deployment", "Job"):
            continue
        spec = document["spec"]["template"]["spec"]
        for container in spec["containers"]:
            yield document["metadata"]["name"], document["spec"]["template"], container


def _k8s_sources(container: dict) -> tuple[dict[str, str], set[str]]:
    """A container's literal env, and the ConfigMaps and Secrets it takes whole."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    whole = {ref.get("configMapRef", ref.get("secretRef", {})).get("name")
             for ref in container.get("envFrom", [])}
    return env, whole


def _k8s_data() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("stringData") or d.get("data") or {}
            for path, d in _documents() if d.get("kind") in ("Secret", "ConfigMap")}


def test_only_the_control_service_holds_the_signing_key():
    """Engines verify with public keys and hold no private key (issue 31 defect 10): with
    the key that signs, an engine pod could forge the tables every engine runs."""
    data = _k8s_data()
    signing = {name for name, values in data.items() if "TABLETUNE_SIGNING_KEY" in values}
    assert signing == {"tabletune-signing-key"}
    holders = set()
    for name, _, container in _k8s_pods():
        env, whole = _k8s_sources(container)
        if "TABLETUNE_SIGNING_KEY" in env or whole & signing:
            holders.add(name)
        if "--scheduler-cls" in container.get("args", []):  # an engine
            verify = [data[w]["TABLETUNE_VERIFY_KEYS"] for w in whole
                      if "TABLETUNE_VERIFY_KEYS" in data.get(w, {})]
            assert verify, f"{name} gets no TABLETUNE_VERIFY_KEYS"
    assert holders == {"tabletune-control"}
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    with_key = {name for name, service in compose["services"].items()
                if "TABLETUNE_SIGNING_KEY" in (service.get("environment") or {})}
    assert with_key == {"control"}
    assert "TABLETUNE_VERIFY_KEYS" in compose["services"]["vllm"]["environment"]
    assert not any("TABLETUNE_SIGNING_SECRET" in p.read_text()
                   for p in MANIFESTS + sorted(DEPLOY.rglob(".env*")))


def test_metrics_are_widened_from_loopback_only_where_prometheus_scrapes():
    """The endpoint has no authentication and listens on 127.0.0.1 unless told otherwise:
    a pod or service that Prometheus scrapes sets TABLETUNE_METRICS_ADDR=0.0.0.0 itself."""
    scraped_pods = 0
    for name, template, container in _k8s_pods():
        env, _ = _k8s_sources(container)
        annotations = template.get("metadata", {}).get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            scraped_pods += 1
            assert env.get("TABLETUNE_METRICS_ADDR") == "0.0.0.0", name  # noqa: S104
        else:
            assert "TABLETUNE_METRICS_ADDR" not in env, name
    assert scraped_pods >= 1
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    prometheus = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    for job in prometheus["scrape_configs"]:
        for target in job["static_configs"][0]["targets"]:
            service, port = target.split(":")
            env = compose["services"][service].get("environment") or {}
            if str(env.get("TABLETUNE_METRICS_PORT")) == port:
                assert env.get("TABLETUNE_METRICS_ADDR") == "0.0.0.0", target  # noqa: S104
