"""The table envelope: a draft table plus what it is for, where it came from, and a signature.

Envelopes travel on the tables topic as canonical JSON, keyed by `model|drafter|hardware`.
Canonical JSON (sorted keys, no whitespace, no NaN) makes the bytes a pure function of the
content, so an Ed25519 signature over them (`schemas.signing`) verifies on any machine and
in any language.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from schemas.draft_budget import DraftBudget
from schemas.draft_table import DraftTable, TableError
from schemas.signing import ALGORITHM, REFUSED_ALGORITHMS, Keyring, sign_hex, signature_matches

ENVELOPE_FORMAT = 1
SIGNATURE_ALGORITHM = ALGORITHM
KEY_SEPARATOR = "|"
MAX_ENVELOPE_BYTES = 1 << 20
"""Kafka's default message limit (max.message.bytes, 1 MiB): a broker on defaults takes no
larger, and a fitted envelope is ~25 KB at max_batch 256. Checked before parsing."""
MAX_BATCH_SIZE = 1 << 14
"""Far above any vLLM max_num_seqs in service; bounds what a reader sizes per batch size."""
MAX_K = 64
"""Far above any drafter's num_speculative_tokens; bounds what a reader sizes per K (the
drift detector's (batch size, K) grid)."""
MAX_VERSION = 2**63 - 1
"""Versions are int64 in other readers (Java, Go); JSON alone allows any integer."""
MAX_EPOCH = 2**31
"""An epoch is a Kafka group generation (int32) plus one (`controller.fleet.ownership`)."""
MAX_NAME_CHARS = 256
"""Key fields, key ids, issuers, engine and control ids: HF model ids and GPU names are
under 100 characters."""
MAX_SIGNATURE_CHARS = 512
"""An Ed25519 signature is 128 hex digits (an HMAC-SHA256 of earlier releases 64)."""
MAX_TIME_CHARS = 64
"""An ISO-8601 time with microseconds and a zone is 32 characters."""
SURFACE_GRIDS = ("goodput_tok_s", "goodput_stderr_tok_s", "latency_s", "latency_stderr_s")
"""Surface fields with one number per (batch size, K) cell, which readers index by both."""
SURFACE_PER_K = ("acceptance_length", "acceptance_length_stderr", "tokens_per_request")
"""Surface fields with one number per K of `surface.k_values`."""
SURFACE_SCALARS = {"draft_share": 1.0, "draft_share_stderr": None,
                   "latency_residual_scale": None}
"""Surface numbers and their upper bounds (None: any finite value >= 0)."""


class EnvelopeError(ValueError):
    """A message that cannot be parsed or breaks a bound; the message names the field and
    `reason` is a stable code for the status topic."""

    def __init__(self, detail: str, reason: str = "bad_envelope") -> None:
        super().__init__(detail)
        self.reason = reason


class SignatureError(ValueError):
    """An envelope whose signature is missing, unknown or wrong; `reason` is a stable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TableKey:
    """Which engines a table is for: the same model, drafter and hardware."""

    model: str
    drafter: str
    hardware: str

    def __post_init__(self) -> None:
        for name in ("model", "drafter", "hardware"):
            value = text(getattr(self, name), f"key.{name}")
            if KEY_SEPARATOR in value:
                raise EnvelopeError(f"key.{name} {value!r} must be non-empty without '|'")

    def __str__(self) -> str:
        return KEY_SEPARATOR.join((self.model, self.drafter, self.hardware))

    @classmethod
    def from_dict(cls, data: Any) -> TableKey:
        data = mapping(data, "key")
        return cls(data["model"], data["drafter"], data["hardware"])

    @classmethod
    def parse(cls, text: str) -> TableKey:
        parts = text.split(KEY_SEPARATOR)
        if len(parts) != 3:
            raise EnvelopeError(f"table key {text!r} is not model|drafter|hardware")
        return cls(*parts)


@dataclass(frozen=True, slots=True)
class Signature:
    key_id: str
    signature_hex: str
    """On the wire as `sig` (an HMAC of earlier releases was `mac`: parsed, then refused)."""
    algorithm: str = SIGNATURE_ALGORITHM

    def __post_init__(self) -> None:
        text(self.key_id, "signature.key_id")
        text(self.signature_hex, "signature.sig", MAX_SIGNATURE_CHARS)
        text(self.algorithm, "signature.algorithm")

    @classmethod
    def from_dict(cls, data: Any) -> Signature:
        data = mapping(data, "signature")
        if "sig" not in data and "mac" in data:  # an HMAC of an earlier release
            return cls(key_id=data["key_id"], signature_hex=data["mac"],
                       algorithm=data.get("algorithm", "HMAC-SHA256"))
        return cls(key_id=data["key_id"], signature_hex=data["sig"],
                   algorithm=data.get("algorithm", SIGNATURE_ALGORITHM))

    def to_dict(self) -> dict[str, str]:
        return {"key_id": self.key_id, "algorithm": self.algorithm, "sig": self.signature_hex}

    @classmethod
    def of(cls, payload: Mapping[str, Any], key_id: str,
           key: Ed25519PrivateKey) -> Signature:
        """`key`'s signature of `payload`'s canonical JSON."""
        return cls(key_id=key_id, signature_hex=sign_hex(key, canonical_json(payload)))


@dataclass(frozen=True, slots=True)
class TableEnvelope:
    """A versioned, attributable, optionally signed draft table for one `TableKey`."""

    key: TableKey
    version: int
    """Strictly increasing per key; engines refuse a version not newer than theirs."""
    table: DraftTable
    startup_k_values: tuple[int, ...]
    """The K values the engine was started with; a table may only use these."""
    max_batch: int
    created_at: str
    """ISO-8601 UTC time of the fit."""
    provenance: Mapping[str, Any] = field(default_factory=dict)
    """What the table was fitted from: record counts, time range, offsets, fitter version."""
    predicted_goodput_tok_s: tuple[float, ...] = ()
    """Predicted goodput at batch sizes 1..max_batch under this table (empty: unknown)."""
    surface: Mapping[str, Any] = field(default_factory=dict)
    """Per-cell predictions and uncertainty (batch_sizes, k_values, goodput, stderr)."""
    exploration: Mapping[str, Any] = field(default_factory=dict)
    """Exploration plan for the controller (which K to try at which batch sizes)."""
    epoch: int = 0
    """The sender's ownership epoch of the key (a control replica's group generation + 1);
    0: not sent by a control replica (an operator's, or an earlier release's): unfenced."""
    budget: DraftBudget | None = None
    """K per request by its n-gram match length (`schemas.draft_budget`), run in place of
    `table` by engines whose drafter reports match lengths; None: the table for all."""
    signature: Signature | None = None

    def __post_init__(self) -> None:
        """Every field against its bounds, so a reader can size arrays from any of them."""
        if not isinstance(self.key, TableKey) or not isinstance(self.table, DraftTable):
            raise EnvelopeError("an envelope needs a TableKey and a DraftTable")
        integer(self.version, "version", 1, MAX_VERSION)
        integer(self.epoch, "epoch", 0, MAX_EPOCH)
        integer(self.max_batch, "max_batch", 1, MAX_BATCH_SIZE)
        k_values = {integer(k, "startup_k_values", 0, MAX_K) for k in self.startup_k_values}
        if not k_values or len(k_values) != len(self.startup_k_values):
            raise EnvelopeError(f"startup_k_values {list(self.startup_k_values)} must be "
                                "distinct and at least one")
        timestamp(self.created_at, "created_at")
        mapping(self.provenance, "provenance")
        if self.predicted_goodput_tok_s and len(self.predicted_goodput_tok_s) != self.max_batch:
            raise EnvelopeError(
                f"predicted_goodput_tok_s has {len(self.predicted_goodput_tok_s)} values, "
                f"expected one per batch size 1..{self.max_batch}"
            )
        numbers(self.predicted_goodput_tok_s, "predicted_goodput_tok_s")
        _check_surface(mapping(self.surface, "surface"), self.max_batch, k_values)
        _check_exploration(mapping(self.exploration, "exploration"), self.max_batch, k_values)
        if self.signature is not None and not isinstance(self.signature, Signature):
            raise EnvelopeError("signature must be a Signature")
        if self.budget is not None and not isinstance(self.budget, DraftBudget):
            raise EnvelopeError("budget must be a DraftBudget")

    def validate(self) -> TableEnvelope:
        """The table (and budget) are well formed for this envelope's limits and use only
        startup K values."""
        self.table.validate(max(self.startup_k_values, default=0), self.max_batch)
        if self.budget is not None:
            self.budget.validate(max(self.startup_k_values, default=0), self.max_batch)
            unknown = sorted({k for _, _, ks in self.budget.ranges for k in ks}
                             - set(self.startup_k_values))
            if unknown:
                raise TableError(f"budget K values {unknown} are not in the engine's startup "
                                 f"set {sorted(self.startup_k_values)}")
        unknown = sorted(self.table.k_values - set(self.startup_k_values))
        if unknown:
            raise TableError(
                f"K values {unknown} are not in the engine's startup set "
                f"{sorted(self.startup_k_values)}"
            )
        return self

    def unsigned_payload(self) -> dict[str, Any]:
        payload = self.to_dict()
        payload.pop("signature", None)
        return payload

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": ENVELOPE_FORMAT,
            "key": {"model": self.key.model, "drafter": self.key.drafter,
                    "hardware": self.key.hardware},
            "version": self.version,
            "table": self.table.to_vllm(),
            "startup_k_values": list(self.startup_k_values),
            "max_batch": self.max_batch,
            "created_at": self.created_at,
            "provenance": dict(self.provenance),
            "predicted_goodput_tok_s": list(self.predicted_goodput_tok_s),
            "surface": dict(self.surface),
            "exploration": dict(self.exploration),
        }
        if self.epoch:  # absent at 0: an earlier release's signed bytes stay the same
            out["epoch"] = self.epoch
        if self.budget is not None:  # absent likewise
            out["budget"] = self.budget.to_json()
        if self.signature is not None:
            out["signature"] = self.signature.to_dict()
        return out

    def to_json(self) -> bytes:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableEnvelope:
        """Parse a JSON object; types are checked here, bounds in `__post_init__`."""
        try:
            if data.get("format", ENVELOPE_FORMAT) != ENVELOPE_FORMAT:
                raise EnvelopeError(f"format {data.get('format')!r} is unknown")
            signature = data.get("signature")
            return cls(
                key=TableKey.from_dict(data["key"]),
                version=integer(data["version"], "version"),
                table=DraftTable.from_vllm(data["table"]),
                startup_k_values=tuple(sequence(data["startup_k_values"], "startup_k_values")),
                max_batch=integer(data["max_batch"], "max_batch"),
                created_at=data["created_at"],
                provenance=dict(mapping(data.get("provenance", {}), "provenance")),
                predicted_goodput_tok_s=tuple(sequence(data.get("predicted_goodput_tok_s", ()),
                                                       "predicted_goodput_tok_s")),
                surface=dict(mapping(data.get("surface", {}), "surface")),
                exploration=dict(mapping(data.get("exploration", {}), "exploration")),
                epoch=integer(data.get("epoch", 0), "epoch"),
                budget=None if data.get("budget") is None else _budget(data["budget"]),
                signature=None if signature is None else Signature.from_dict(signature),
            )
        except KeyError as exc:
            raise EnvelopeError(f"envelope field {exc.args[0]!r} is missing") from None
        except (TypeError, AttributeError) as exc:
            raise EnvelopeError(f"envelope is malformed ({exc})") from None

    @classmethod
    def from_json(cls, raw: bytes | str) -> TableEnvelope:
        return cls.from_dict(load_json_object(raw, "envelope"))

    def signed(self, key_id: str, key: Ed25519PrivateKey) -> TableEnvelope:
        """This envelope signed by private `key`, named `key_id`."""
        return replace(self, signature=Signature.of(self.unsigned_payload(), key_id, key))

    def verify(self, keyring: Keyring) -> None:
        """Raise `SignatureError` unless signed by a key in `keyring` (key id -> public key)."""
        verify_signature(self.signature, canonical_json(self.unsigned_payload()), keyring)


def _budget(data: Any) -> DraftBudget:
    try:
        return DraftBudget.from_json(data)
    except TableError as exc:
        raise EnvelopeError(f"budget: {exc}") from None


def verify_signature(signature: Signature | None, payload: bytes, keyring: Keyring) -> None:
    """Raise `SignatureError` unless `signature` is a valid Ed25519 signature of `payload`
    by a key of `keyring`; the reason says which of unsigned, bad_algorithm (an HMAC of an
    earlier release among them), unknown_key, bad_signature."""
    if signature is None:
        raise SignatureError("unsigned", "the message carries no signature")
    if signature.algorithm != SIGNATURE_ALGORITHM:
        why = REFUSED_ALGORITHMS.get(signature.algorithm,
                                     f"only {SIGNATURE_ALGORITHM} signatures are accepted")
        raise SignatureError("bad_algorithm", f"algorithm {signature.algorithm!r}: {why}")
    public = keyring.get(signature.key_id)
    if public is None:
        raise SignatureError("unknown_key", f"key id {signature.key_id!r} is not known")
    if not signature_matches(public, payload, signature.signature_hex):
        raise SignatureError("bad_signature", f"the signature is not key {signature.key_id!r}'s "
                             "signature of this content")


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, NaN refused: equal content gives equal bytes."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def load_json_object(raw: bytes | str, what: str) -> dict[str, Any]:
    """`raw` as a JSON object: refused past `MAX_ENVELOPE_BYTES` before it is parsed, and
    refused when it holds what canonical JSON never writes (NaN, infinities, integers of
    thousands of digits) or nests deeper than the parser goes."""
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(f"{what} of {size} bytes is larger than the {MAX_ENVELOPE_BYTES} "
                            "bytes a tables-topic message may be", reason="too_large")
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise EnvelopeError(f"{what} is not JSON (nested too deeply)") from None
    except ValueError as exc:  # bad syntax or UTF-8, NaN, infinities, huge integers
        raise EnvelopeError(f"{what} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise EnvelopeError(f"{what} must be an object, got a JSON {type(data).__name__}")
    return data


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"{literal} overflows to {value}")
    return value


# ---- field checks: each names the field it refuses ------------------------------------------
def integer(value: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EnvelopeError(f"{name} must be an integer, got {value!r}"[:200])
    if low is not None and value < low:
        raise EnvelopeError(f"{name} {value} must be >= {low}")
    if high is not None and value > high:
        raise EnvelopeError(f"{name} {value} must be <= {high}")
    return value


def number(value: Any, name: str, low: float | None = 0.0, high: float | None = None,
           *, positive: bool = False) -> float:
    """A finite JSON number within [low, high] (> 0 when `positive`)."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        raise EnvelopeError(f"{name} must be a finite number, got {value!r}"[:200])
    if positive and value <= 0:
        raise EnvelopeError(f"{name} {value} must be > 0")
    if low is not None and value < low:
        raise EnvelopeError(f"{name} {value} must be >= {low}")
    if high is not None and value > high:
        raise EnvelopeError(f"{name} {value} must be <= {high}")
    return float(value)


def numbers(values: Any, name: str, length: int | None = None, *,
            positive: bool = False) -> None:
    """A list of finite numbers >= 0 (> 0 when `positive`), of `length` when given."""
    values = sequence(values, name)
    if length is not None and len(values) != length:
        raise EnvelopeError(f"{name} has {len(values)} values, expected {length}")
    for index, value in enumerate(values):
        number(value, f"{name}[{index}]", positive=positive)


def sequence(value: Any, name: str) -> Sequence[Any]:
    if not isinstance(value, list | tuple):
        raise EnvelopeError(f"{name} must be a list, got {type(value).__name__}")
    return value


def mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise EnvelopeError(f"{name} must be an object, got {type(value).__name__}")
    return value


def text(value: Any, name: str, max_chars: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str) or not value:
        raise EnvelopeError(f"{name} must be a non-empty string, got {value!r}"[:200])
    if len(value) > max_chars:
        raise EnvelopeError(f"{name} has {len(value)} characters, more than {max_chars}")
    return value


def timestamp(value: Any, name: str) -> datetime:
    """An ISO-8601 time (`datetime.fromisoformat`: 2026-12-01T12:00:00+00:00, or ...Z)."""
    try:
        return datetime.fromisoformat(text(value, name, MAX_TIME_CHARS))
    except ValueError:
        raise EnvelopeError(f"{name} {value!r} is not an ISO-8601 time") from None


def _axis(values: Any, name: str, low: int, high: int) -> list[int]:
    """A grid axis: distinct integers in [low, high], increasing, at least one."""
    axis = [integer(v, f"{name}[{i}]", low, high) for i, v in enumerate(sequence(values, name))]
    if not axis or any(b <= a for a, b in zip(axis, axis[1:], strict=False)):
        raise EnvelopeError(f"{name} must be increasing and non-empty, got {axis[:16]}")
    return axis


def _check_surface(surface: Mapping[str, Any], max_batch: int, k_allowed: set[int]) -> None:
    """The fields readers size arrays from or index (controller.drift, controller.fleet.refit_gate):
    axes within the envelope's batch sizes and startup K set, every cell a finite number.
    The fitter's other fields are any JSON, bounded by the message size."""
    if not surface:
        return
    batch = _axis(surface.get("batch_sizes"), "surface.batch_sizes", 1, max_batch)
    ks = _axis(surface.get("k_values"), "surface.k_values", 0, MAX_K)
    outside = sorted(set(ks) - k_allowed)
    if outside:
        raise EnvelopeError(f"surface.k_values {outside} are not in startup_k_values "
                            f"{sorted(k_allowed)}")
    for name in SURFACE_GRIDS:
        if name in surface:
            rows = sequence(surface[name], f"surface.{name}")
            if len(rows) != len(batch):
                raise EnvelopeError(f"surface.{name} has {len(rows)} rows, expected one per "
                                    f"batch size ({len(batch)})")
            for index, row in enumerate(rows):
                numbers(row, f"surface.{name}[{index}]", len(ks), positive=name == "latency_s")
    for name in SURFACE_PER_K:
        if name in surface:
            numbers(surface[name], f"surface.{name}", len(ks))
    if "latency_s" in surface and "acceptance_length" not in surface:
        raise EnvelopeError("surface.latency_s needs surface.acceptance_length")
    for name, high in SURFACE_SCALARS.items():
        if name in surface:
            number(surface[name], f"surface.{name}", 0.0, high)


def _check_exploration(plan: Mapping[str, Any], max_batch: int, k_allowed: set[int]) -> None:
    """What the engine's explorer reads (controller.exploration.plan_candidates): buckets
    within 1..max_batch that do not overlap, candidate K values in the startup set, and the
    plan's numbers finite."""
    for name in ("tolerance", "min_probability", "min_expected_gain"):
        if name in plan:
            number(plan[name], f"exploration.{name}")
    covered: list[tuple[int, int]] = []
    for index, bucket in enumerate(sequence(plan.get("buckets", []), "exploration.buckets")):
        where = f"exploration.buckets[{index}]"
        bucket = mapping(bucket, where)
        start = integer(bucket.get("batch_start"), f"{where}.batch_start", 1, max_batch)
        end = integer(bucket.get("batch_end"), f"{where}.batch_end", 1, max_batch)
        if start > end:
            raise EnvelopeError(f"{where} starts at batch size {start}, after its end {end}")
        if "chosen_k" in bucket:
            integer(bucket["chosen_k"], f"{where}.chosen_k", 0, MAX_K)
        if "expected_gain" in bucket:
            number(bucket["expected_gain"], f"{where}.expected_gain", None)
        ks = []
        for j, candidate in enumerate(sequence(bucket.get("candidates", []),
                                               f"{where}.candidates")):
            candidate = mapping(candidate, f"{where}.candidates[{j}]")
            ks.append(integer(candidate.get("k"), f"{where}.candidates[{j}].k", 0, MAX_K))
            for name in ("p_better", "expected_gain", "goodput_ratio"):
                if name in candidate:
                    number(candidate[name], f"{where}.candidates[{j}].{name}", None)
        if set(ks) - k_allowed or len(set(ks)) != len(ks):
            raise EnvelopeError(f"{where}.candidates K {ks} must be distinct and in "
                                f"startup_k_values {sorted(k_allowed)}")
        covered.append((start, end))
    covered.sort()
    for (_, end), (start, _) in zip(covered, covered[1:], strict=False):
        if start <= end:
            raise EnvelopeError(f"exploration.buckets overlap at batch size {start}")
