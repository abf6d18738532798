"""vLLM's table validator, loaded from its own file without importing vLLM, is vLLM's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from controller.vllm_compat import check_with_vllm, vllm_validator
from schemas import DraftTable
assert check_with_vllm(DraftTable.from_vllm([[1, 16, 3], [17, 64, 1]]))
assert "vllm" not in sys.modules, "the validator imported vLLM"
ours = vllm_validator()
from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule as theirs
assert ours.__code__.co_code == theirs.__code__.co_code
def _refused(validator, case):
    try:
        validator(case)
    except ValueError:
        return True
    return False
cases = [[[1, 16, 3], [17, 64, 1]], [[1, 4, 2], [3, 8, 1]], [[2, 8, 1]], [[1, 8, -1]], [],
         [[1, 8]], [[5, 2, 1]]]
for case in cases:
    outcomes = []
    for validator in (ours, theirs):
        try:
            outcomes.append(("ok", validator(case)))
        except ValueError as exc:
            outcomes.append(("refused", str(exc)))
    assert outcomes[0] == outcomes[1], (case, outcomes)
refused = [case for case in cases if _refused(ours, case)]
assert len(refused) == 6, refused  # overlap, no range at 1, K < 0, empty, short, reversed
"""


def test_the_validator_loads_without_vllm_and_judges_as_vllm_does():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
