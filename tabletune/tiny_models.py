"""Small random-weight Llama models built offline, for tests, docs and CPU benchmarks.

No weights can be downloaded here, and latency and scheduling do not depend on weight values.
The tokenizer is a byte-level BPE trained on text that ships with Python itself. Random
models repeat themselves under greedy decoding, which gives n-gram drafting real matches.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 32
    """vLLM's CPU attention takes head sizes 32, 64, 80, ... only."""
    intermediate_size: int = 256
    max_position_embeddings: int = 2048
    seed: int = 0


def corpus_text(limit_chars: int = 400_000) -> list[str]:
    """English-ish training text from the docstrings of the standard library."""
    import pydoc
    import sys
    texts: list[str] = []
    total = 0
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in {"antigravity", "this", "idlelib", "tkinter"}:
            continue
        try:
            module = __import__(name)
        except Exception:  # noqa: S112 - some stdlib modules need optional C parts
            continue
        doc = pydoc.getdoc(module)
        if doc:
            texts.append(doc)
            total += len(doc)
        if total >= limit_chars:
            break
    return texts


def build_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))


def build_tiny_llama(directory: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write a random LlamaForCausalLM and its tokenizer to `directory` (idempotent)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyLlamaSpec()
    path = Path(directory)
    marker = path / "tabletune-spec.json"
    wanted = json.dumps(asdict(spec), sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return path
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, spec.vocab_size)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(path))
    marker.write_text(wanted)
    return path
