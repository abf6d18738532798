"""The demo's fleet: two groups of twin engines, each with a drift half-way.

Parametric acceptance (docs/TWIN.md, acceptance), so the demo runs without the shared traces.
- EAGLE group: ShareGPT-like chat, then a model update that makes the drafter weaker
  (conditional acceptance drops to ~0.45): the fitted table's K becomes too large.
- n-gram group: code-editing traffic (InstructCoder-like, long n-gram matches), then chat
  (ShareGPT-like): n-gram acceptance falls by half and the best K falls with it.
"""

from __future__ import annotations

from dataclasses import dataclass

_TEMPLATE = """
seed = {seed}
name = "{name}"
[engine]
max_num_seqs = 256
max_num_batched_tokens = 8192
max_k = 7
engine_id = "{engine_id}"
model = "llama-3.1-8b-instruct"
hardware = "twin-h100"
[cost]
profile = "h100-llama3.1-8b"
noise = 0.03
[drafter]
method = "{method}"
[[phases]]
name = "{before_name}"
duration_s = {phase_s}
concurrency = {concurrency}
acceptance = {before}
prompt_len = {prompt_len}
output_len = {output_len}
[[phases]]
name = "{after_name}"
duration_s = {phase_s}
concurrency = {concurrency}
acceptance = {after}
prompt_len = {prompt_len}
output_len = {output_len}
"""


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    method: str
    concurrency: int
    before_name: str
    before: tuple[float, ...]
    after_name: str
    after: tuple[float, ...]
    prompt_len: int
    output_len: int

    def scenario_text(self, engine_index: int, phase_s: float, seed: int = 1,
                      phases: int = 2, concurrency: int | None = None,
                      engine_id: str | None = None) -> str:
        text = _TEMPLATE.format(
            seed=seed + engine_index, name=f"{self.name}-{engine_index}",
            engine_id=engine_id or f"{self.name}-{engine_index}", method=self.method, phase_s=phase_s,
            concurrency=concurrency or self.concurrency, before_name=self.before_name,
            before=list(self.before), after_name=self.after_name, after=list(self.after),
            prompt_len=self.prompt_len, output_len=self.output_len)
        if phases == 1:
            text = text[: text.rindex("[[phases]]")]
        return text


GROUPS = (
    Group(name="eagle", method="eagle", concurrency=48,
          before_name="chat", before=(0.69, 0.66, 0.69, 0.73, 0.76, 0.78, 0.80),
          after_name="weaker-drafter", after=(0.45, 0.42, 0.42, 0.42, 0.42, 0.42, 0.42),
          prompt_len=355, output_len=728),
    Group(name="ngram", method="ngram", concurrency=128,
          before_name="code", before=(0.65, 0.93, 0.94, 0.95, 0.95, 0.95, 0.95),
          after_name="chat", after=(0.35, 0.84, 0.87, 0.90, 0.91, 0.91, 0.91),
          prompt_len=355, output_len=400),
)
