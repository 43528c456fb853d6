"""`make interop`: hf-eagle3 against the published speculators and SpecForge, both directions, every variant.

Import: drafts built and saved by each library's own classes are loaded by `Eagle3DraftModel.from_pretrained`.
Export: drafts built by hf-eagle3 (a tiny `hf-eagle3 train` run among them) are exported and loaded by each library's
own loader, and SpecForge's loader also loads the folders `save_pretrained` wrote in the served layout as they are.
Either way the logits and the fed-back state of two training-time-test steps (the draft step and the one after it, as
the library's forward runs them) are compared in float32, tolerance 1e-5. The libraries run in their own virtualenv
(.interop-venv, created on first use: it needs the package registry), since they pin other transformers versions than
hf-eagle3; this script runs in hf-eagle3's. Prints a table; exits non-zero on any mismatch.
"""

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hf_eagle3.conversion import convert
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle3 import Eagle3Config, Eagle3DraftModel
from hf_eagle3.training.ttt import TrainingTimeTest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".interop-venv"
LIBRARY_SIDE = Path(__file__).with_name("library_side.py")
# What the libraries run on: both accept these versions (their own pins are looser or conflict with each other's).
REQUIREMENTS = ["torch==2.13.0", "transformers==5.8.1", "openai", "datasets", "hs-connectors", "loguru"]
LIBRARIES = ["speculators==0.9.0", "specforge==0.2.0"]  # with --no-deps: their serving and training stacks are not run
TOLERANCE = 1e-5
STEPS = 2
LENGTH = 9
TARGET = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 8,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
# hf-eagle3 drafts exported to each format: what the format can express.
EXPORTS = {
    "sglang": {"eagle3": {}, "fc_norm": {"fc_norm": True}},
    "speculators": {
        "eagle3": {}, "fc_norm": {"fc_norm": True}, "fc_norm+norm_output": {"fc_norm": True, "norm_output": True},
        "norm_before_residual": {"norm_before_residual": True}, "norm_before_fc": {"norm_before_fc": True},
        "qk_norm": {"qk_norm": True}, "two_layers": {"num_hidden_layers": 2},
        "qk_norm_sliding": {"qk_norm": True, "num_hidden_layers": 2, "sliding_window": 4,
                            "layer_types": ["sliding_attention", "full_attention"]},
    },
}
LOADER = {"sglang": "specforge", "speculators": "speculators"}


def ensure_venv() -> Path:
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    wanted = " ".join(REQUIREMENTS + LIBRARIES)
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if not stamp.is_file() or stamp.read_text() != wanted:
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, *REQUIREMENTS], check=True)
        subprocess.run([*pip, "--no-deps", *LIBRARIES], check=True)
        stamp.write_text(wanted)
    return python


def library_side(python: Path, command: str, work: Path) -> None:
    subprocess.run([str(python), str(LIBRARY_SIDE), command, str(work)], check=True)


def hf_eagle3_outputs(draft: Eagle3DraftModel, inputs: dict) -> dict[str, torch.Tensor]:
    """Logits and fed-back state of `STEPS` training-time-test steps of hf-eagle3's draft."""
    draft = draft.float().eval()
    with torch.no_grad():
        states = list(TrainingTimeTest(draft, steps=STEPS).unroll(inputs["input_ids"], inputs["features"]))
        return {**{f"logits{step}": draft.compute_logits(state) for step, state in enumerate(states)},
                **{f"state{step}": state for step, state in enumerate(states)}}


def compared_steps(config: Eagle3Config, library: str) -> int:
    """How many TTT steps are compared: speculators' training mask lets a sliding-window layer see one key more per
    TTT step (the step-0 block keeps its row-index window beside the new diagonal), where vLLM and hf-eagle3 apply the
    window by position; so for those drafts only the draft step itself is compared."""
    sliding = "sliding_attention" in (config.layer_types or [])
    return 1 if sliding and library == "speculators" else STEPS


def difference(ours: dict, theirs: dict, steps: int) -> tuple[float, str]:
    """The largest absolute difference over the compared tensors of the first `steps` steps (NaN where either side
    has NaN), and which tensors differ."""
    names = sorted(name for name in theirs if int(name[-1]) < steps)
    differences = {name: (ours[name] - theirs[name]).abs().max().item() for name in names}
    worst = max(differences.values(), key=lambda value: min(value, math.inf))  # NaN worst
    return worst, ", ".join(name for name, value in differences.items() if not value <= TOLERANCE)


def label(case: str, steps: int) -> str:
    variant = case.split("-", 1)[1]
    return variant if steps == STEPS else f"{variant} (draft step only: speculators' TTT window)"


def make_inputs(work: Path) -> tuple[LlamaForCausalLM, dict]:
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**TARGET)).eval()
    target.save_pretrained(work / "target")
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(TARGET["vocab_size"], (1, LENGTH), generator=generator),
              "features": torch.randn(1, LENGTH, 3 * TARGET["hidden_size"], generator=generator),
              "embedding": target.get_input_embeddings().weight.detach().clone()}
    save_file(inputs, work / "inputs.safetensors")
    return target, inputs


def trained_draft(work: Path, target: LlamaForCausalLM) -> Path:
    """A draft trained for a few steps by `hf-eagle3 train` on the target's own greedy continuations."""
    prompts = torch.randint(1, TARGET["vocab_size"], (24, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        sequences = target.generate(prompts, max_new_tokens=18, do_sample=False,
                                    attention_mask=torch.ones_like(prompts))
    data = work / "data"
    data.mkdir()
    records = [{"messages": [], "input_ids": sequence, "loss_mask": [0] * 6 + [1] * 18}
               for sequence in sequences.tolist()]
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    run = work / "run"
    subprocess.run([str(Path(sys.executable).with_name("hf-eagle3")), "train", "--data", str(data), "--target",
                    str(work / "target"), "--output-dir", str(run), "--draft-vocab-size", "40", "--intermediate-size",
                    "64", "--ttt-steps", "2", "--max-steps", "4", "--save-every", "4", "--eval-every", "1000",
                    "--eval-batches", "0", "--threads", "1", "--profile-prompts", "0"], check=True)
    return run / "draft"


def exported_cases(work: Path, target: LlamaForCausalLM, inputs: dict) -> dict[str, dict]:
    """hf-eagle3 drafts saved, exported to each format, and their outputs; the cases the libraries load."""
    embedding = target.get_input_embeddings()
    drafts = {}
    for format_name, variants in EXPORTS.items():
        for name, variant in variants.items():
            torch.manual_seed(len(name))
            config = Eagle3Config(**{k: TARGET[k] for k in TARGET if k != "num_hidden_layers"}, draft_vocab_size=40,
                                  target_num_hidden_layers=TARGET["num_hidden_layers"],
                                  target_name_or_path=str(work / "target"), **variant)
            draft = Eagle3DraftModel(config)
            with torch.no_grad():
                for parameter_name, parameter in draft.named_parameters():
                    if parameter_name.endswith("norm.weight"):
                        parameter.normal_(1.0, 0.3)
            draft.set_draft_vocabulary(torch.randperm(TARGET["vocab_size"])[:40])
            draft.save_pretrained(work / "saved" / f"{format_name}-{name}")
            drafts[f"{format_name}-{name}"] = (format_name, work / "saved" / f"{format_name}-{name}")
    trained = trained_draft(work, target)
    for format_name in EXPORTS:
        drafts[f"{format_name}-trained by hf-eagle3 train"] = (format_name, trained)
    cases = {}
    for case, (format_name, saved) in drafts.items():
        folder = work / "exported" / case.replace(" ", "_")
        convert(saved, folder, to_format=format_name, target_embedding=work / "target")
        draft = Eagle3DraftModel.from_pretrained(saved)
        draft.attach_target_embedding(embedding)
        outputs = hf_eagle3_outputs(draft, inputs)
        steps = compared_steps(draft.config, LOADER[format_name])
        # The folder save_pretrained wrote, loaded as it is: the layout the engines serve by id (drafts it cannot
        # express are saved in hf-eagle3's own layout, and only exported).
        loaded_as_saved = {f"{case}, as saved": saved} if json.loads((saved / "config.json").read_text()).get(
            "architectures") == ["LlamaForCausalLMEagle3"] and format_name == "sglang" else {}
        for name, case_folder in {case: folder, **loaded_as_saved}.items():
            save_file(outputs, case_folder / "hf_eagle3.safetensors")
            direction = "save_pretrained" if case_folder == saved else f"export --to {format_name}"
            cases[name] = {"library": LOADER[format_name], "folder": str(case_folder), "format": format_name,
                           "direction": direction, "steps": steps}
    (work / "cases.json").write_text(json.dumps(cases, indent=1))
    return cases


def main() -> int:
    python = ensure_venv()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-eagle3-interop-") as directory:
        work = Path(directory)
        target, inputs = make_inputs(work)
        embedding = target.get_input_embeddings()

        library_side(python, "build", work)
        for case, entry in json.loads((work / "built" / "cases.json").read_text()).items():
            draft = Eagle3DraftModel.from_pretrained(entry["folder"])
            draft.attach_target_embedding(embedding)
            theirs = load_file(Path(entry["folder"]) / "library.safetensors")
            steps = compared_steps(draft.config, entry["library"])
            rows.append(("import", entry["library"], label(case, steps),
                         difference(hf_eagle3_outputs(draft, inputs), theirs, steps)))

        cases = exported_cases(work, target, inputs)
        library_side(python, "run", work)
        for case, entry in cases.items():
            ours = load_file(Path(entry["folder"]) / "hf_eagle3.safetensors")
            theirs = load_file(Path(entry["folder"]) / "library.safetensors")
            steps = entry["steps"]
            rows.append((entry["direction"], entry["library"], label(case, steps), difference(ours, theirs, steps)))
        versions = json.loads((work / "versions-run.json").read_text())

    print(f"\nhf-eagle3 vs speculators {versions['speculators']}, specforge {versions['specforge']} (torch "
          f"{versions['torch']}, transformers {versions['transformers']}); fp32, {STEPS} TTT steps, tolerance "
          f"{TOLERANCE:g}\n")
    print("| direction | library | variant | max abs difference | |\n|---|---|---|---|---|")
    for direction, library, variant, (diff, where) in rows:
        verdict = "equal" if diff <= TOLERANCE else f"DIFFERS ({where})"
        print(f"| {direction} | {library} | {variant} | {diff:.2e} | {verdict} |")
    failed = sum(not diff <= TOLERANCE for *_, (diff, _) in rows)  # NaN differs
    print(f"\n{len(rows) - failed} of {len(rows)} cases equal.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
