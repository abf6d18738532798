"""A self-speculative target/draft pair of random Llama models, built offline.

No trained weights can be downloaded here, yet a drafter needs a realistic acceptance rate for
the draft length to matter. The trick (docs/VLLM.md, "The self-speculative pair"): in the
target, every layer after the first has its `o_proj` and `down_proj` weights multiplied by a
small `scale`, so those layers only nudge the residual stream; the draft is the target's first
layer with the same embeddings, final norm and LM head. The draft then predicts the target's
greedy token most of the time, and `scale` sets how often (s = 0.04 gave per-position
acceptance of about .67 .46 .32).
Serve the pair with `speculative_config={"method": "draft_model", "model": <draft dir>, ...}`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from tabletune.tiny_models import build_tokenizer


@dataclass(frozen=True, slots=True)
class SpecPairSpec:
    vocab_size: int = 1024
    hidden_size: int = 2048
    num_layers: int = 12
    """Target layers; the draft has one."""
    num_heads: int = 32
    head_dim: int = 64
    """vLLM's CPU attention takes head sizes 32, 64, 80, ... only."""
    intermediate_size: int = 5504
    scale: float = 0.04
    """Multiplier on o_proj and down_proj of target layers 1..num_layers-1 (sets acceptance)."""
    max_position_embeddings: int = 2048
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 2:
            raise ValueError(f"num_layers={self.num_layers} must be >= 2 (the draft is layer 0)")
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"num_heads={self.num_heads} * head_dim={self.head_dim} must equal "
                             f"hidden_size={self.hidden_size}")
        if not 0.0 <= self.scale <= 1.0:
            raise ValueError(f"scale={self.scale} must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class SpecPair:
    target: Path
    draft: Path
    target_params: int
    draft_params: int


def build_spec_pair(directory: str | Path, spec: SpecPairSpec | None = None) -> SpecPair:
    """Write `directory/target` and `directory/draft` (models + tokenizer); idempotent."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or SpecPairSpec()
    root = Path(directory)
    target_dir, draft_dir = root / "target", root / "draft"
    marker = root / "tabletune-spec-pair.json"
    wanted = json.dumps(asdict(spec), sort_keys=True)
    if marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("spec") == wanted:
            return SpecPair(target_dir, draft_dir, saved["target_params"],
                            saved["draft_params"])
    root.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, spec.dtype)

    def config(layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=layers,
            num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
            head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype=spec.dtype,
        )

    torch.manual_seed(spec.seed)
    with torch.no_grad():
        target = LlamaForCausalLM(config(spec.num_layers)).to(dtype)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(spec.scale)
            layer.mlp.down_proj.weight.mul_(spec.scale)
        draft = LlamaForCausalLM(config(1)).to(dtype)
        draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
        draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        draft.lm_head.load_state_dict(target.lm_head.state_dict())
    for path, model in ((target_dir, target), (draft_dir, draft)):
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(path))
    build_tokenizer(target_dir, spec.vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, draft_dir / name)
    pair = SpecPair(target_dir, draft_dir, sum(p.numel() for p in target.parameters()),
                    sum(p.numel() for p in draft.parameters()))
    marker.write_text(json.dumps({"spec": wanted, "target_params": pair.target_params,
                                  "draft_params": pair.draft_params}))
    return pair
