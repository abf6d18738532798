"""Policy names -> factories: what `--policy NAME[:ARG]` accepts, in the order `--help` lists.

    make_policy("fixed:3") | make_policy("table:t.json") | make_policy("vllm-doc")
    register_policy("my-policy", factory)     # factory(arg: str | None) -> Policy
"""

from __future__ import annotations

from collections.abc import Callable

from twin.baselines import DsdGoodput, EmaAdaptive
from twin.policies import VLLM_DOC_TABLE, FixedK, Policy, PolicyError, StaticTable, table_policy

PolicyFactory = Callable[[str | None], Policy]


def _fixed(arg: str | None) -> Policy:
    if arg is None or not arg.lstrip("-").isdigit():
        raise PolicyError(f"fixed:K needs an integer K, got {arg!r}")
    return FixedK(int(arg))


def _table(arg: str | None) -> Policy:
    if not arg:
        raise PolicyError("table:FILE needs a file")
    return table_policy(arg)


def _vllm_doc(arg: str | None) -> Policy:
    if arg:
        raise PolicyError(f"vllm-doc takes no argument, got {arg!r}")
    return StaticTable(VLLM_DOC_TABLE, name="vllm-doc", clamp_k=True)


def _no_arg(name: str, factory: type[Policy]) -> PolicyFactory:
    def make(arg: str | None) -> Policy:
        if arg:
            raise PolicyError(f"{name} takes no argument, got {arg!r}")
        return factory()
    return make


def _tabletune(arg: str | None) -> Policy:
    # imported when chosen: the control service's stack (kafka's client, pyarrow.compute)
    # is this policy's alone and would nearly double every other run's start-up
    from twin.tabletune_policy import tabletune_policy

    return tabletune_policy(arg)


_REGISTRY: dict[str, tuple[PolicyFactory, str]] = {
    "fixed": (_fixed, "fixed:K"),
    "table": (_table, "table:FILE"),
    "vllm-doc": (_vllm_doc, "vllm-doc"),
    "dsd-goodput": (_no_arg("dsd-goodput", DsdGoodput), "dsd-goodput"),
    "ema-adaptive": (_no_arg("ema-adaptive", EmaAdaptive), "ema-adaptive"),
    "tabletune": (_tabletune, "tabletune[:explore=S,refit=S,threshold=F,budgets=0|1]"),
}


def register_policy(name: str, factory: PolicyFactory, *, usage: str | None = None) -> None:
    """Make `name[:ARG]` selectable; `factory` gets ARG (or None) and returns a Policy."""
    _REGISTRY[name] = (factory, usage or name)


def make_policy(spec: str) -> Policy:
    """`fixed:K`, `table:FILE`, `vllm-doc`, or any registered name."""
    name, _, arg = spec.partition(":")
    entry = _REGISTRY.get(name)
    if entry is None:
        known = ", ".join(usage for _, usage in _REGISTRY.values())
        raise PolicyError(f"unknown policy {spec!r} (known: {known})")
    return entry[0](arg or None)


def policy_usages() -> list[str]:
    return [usage for _, usage in _REGISTRY.values()]
