"""The README's Python examples, run as a user pastes them: every ```python block, in order, in one session.

A block right after a `<!-- not run: REASON -->` line needs what the test machine lacks (a GPU, the Hub): it is
compiled, and skipped with its reason. The others run offline as they are, with the embedded SmolLM2 target and the
shipped draft. They decode with `tree_shape="auto"`, so what they do depends on this machine's calibration; both
outcomes are run, from a calibration record written for each (one where short trees pay, one where none does and
`generate` decodes plainly), so an example that works on one kind of machine only fails here.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from hf_eagle3.decoding.calibration import MachineCosts, calibration_key, calibration_path, machine_description
from hf_eagle3.resources.loading import load_draft, load_target

README = Path(__file__).parents[1] / "README.md"
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->")
BATCH_SIZES = range(1, 9)  # every batch size an example may decode at gets its calibration record


def readme_examples() -> list[tuple[int, str, str | None]]:
    """(first line number, code, reason it is not run or None) of every ```python block of the README, in order."""
    lines = README.read_text().splitlines()
    examples, index = [], 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            end = lines.index("```", index + 1)
            previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
            marker = NOT_RUN.fullmatch(previous.strip())
            examples.append((index + 2, "\n".join(lines[index + 1:end]), marker.group(1) if marker else None))
            index = end
        index += 1
    return examples


def _compiled(first_line: int, code: str):
    return compile("\n" * (first_line - 1) + code, str(README), "exec")  # tracebacks name the README's lines


def _write_calibration(target, draft, trees_pay: bool) -> None:
    """A calibration record for `target` and `draft` at every batch size in `BATCH_SIZES`, as `calibrate` caches it:
    a CPU where verifying n drafted tokens costs a decode step and a fifth of one per token (short trees pay: 2x1x2
    is predicted fastest), or one where any verification costs ten decode steps (no tree pays)."""
    profile = draft.config.acceptance_profile
    costs = MachineCosts(
        machine=machine_description(target.device),
        plain_step=1.0,
        verify={row["tree_total_tokens"] + 1: 1.0 + 0.2 * row["tree_total_tokens"] if trees_pay else 10.0
                for row in profile},
        draft={(row["tree_depth"], row["tree_top_k"]): 0.02 * row["tree_depth"] for row in profile},
        other=0.0,
    )
    for batch_size in BATCH_SIZES:
        key = calibration_key(target, draft, batch_size)
        path = calibration_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "costs": costs.to_json()}))


def test_every_readme_example_is_python_and_every_skipped_one_says_why():
    examples = readme_examples()
    assert examples and any(reason is None for _, _, reason in examples)
    for first_line, code, _ in examples:
        _compiled(first_line, code)  # raises SyntaxError naming the README line


@pytest.mark.slow
@pytest.mark.parametrize("trees_pay", [True, False], ids=["short-trees-pay", "no-tree-pays"])
def test_readme_examples_run_offline_as_written(trees_pay, own_cache):
    target, _ = load_target("smollm2", torch.float32)
    _write_calibration(target, load_draft("shipped", torch.float32), trees_pay)
    namespace = {"__name__": "__readme__"}
    for first_line, code, reason in readme_examples():
        if reason is None:
            exec(_compiled(first_line, code), namespace)  # noqa: S102 (running the README is the test)
    stats = namespace["stats"]  # the batch example's statistics: the calibration decided as written above
    assert (stats.settings is not None) == trees_pay
    assert len(stats.rows) == (len(namespace["questions"]) if trees_pay else 0)


@pytest.mark.parametrize("first_line, reason", [pytest.param(first_line, reason, id=f"README.md:{first_line}")
                                                for first_line, _, reason in readme_examples() if reason is not None])
def test_readme_examples_that_need_what_this_machine_lacks(first_line, reason):
    pytest.skip(f"README.md line {first_line}: {reason}")
