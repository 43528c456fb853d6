"""OpenVINO GenAI in its own virtualenv under the user cache, built by `make engines` from the package registry, with
`optimum-intel`'s exporter (transformers < 5.6): plain greedy decoding and EAGLE-3 drafting a tree, float32, in a side
process (`sides/openvino_side.py`)."""

import json
import shutil
import subprocess
from pathlib import Path

from .process import SideProcess
from .virtualenv import Virtualenv

NAME = "OpenVINO GenAI"
# The draft's export loads optimum-intel's model_patcher.py as remote code, and transformers refuses remote code whose
# imports are missing: einops and diffusers (0.39.0, the last to accept optimum-intel's huggingface-hub < 1.22).
# optimum-intel pulls the registry's torchvision.
REQUIREMENTS = ["torch==2.13.0", "openvino-genai==2026.4.1", "optimum-intel[openvino]==2.2.0", "einops",
                "diffusers==0.39.0"]
VENV = Virtualenv(NAME, "openvino-venv", [REQUIREMENTS], ["torchvision"])
# `draft_model(DIR, ...)` builds a tokenizer from DIR: the draft's export gets the target's.
TOKENIZER_FILES = ["openvino_tokenizer.xml", "openvino_tokenizer.bin", "openvino_detokenizer.xml",
                   "openvino_detokenizer.bin"]


def build() -> None:
    VENV.build()


def require_built() -> Path:
    """The virtualenv's python; `EngineNotBuilt` where `make engines` has not built it."""
    return VENV.python()


def export(model: Path, outdir: Path, *options: str) -> Path:
    """`model` exported to OpenVINO IR in float32 by `optimum-cli export openvino`, once (`outdir` is kept). A draft
    (`LlamaForCausalLMEagle3`) needs `--trust-remote-code`: optimum-intel points its `auto_map` at its own EAGLE-3
    classes."""
    if not (outdir / "openvino_model.xml").exists():
        subprocess.run([require_built().with_name("optimum-cli"), "export", "openvino", "--model", model, "--task",
                        "text-generation-with-past", "--weight-format", "fp32", *options, outdir], check=True,
                       capture_output=True)
    return outdir


def eagle_config_layers(draft: Path) -> list[int]:
    """`eagle_config`'s target layers (outputs of layers), the numbering of OpenVINO GenAI's `hidden_layers_list`."""
    return json.loads((draft / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def write_draft_layers(model_xml: Path, layers: list[int]) -> None:
    """Writes `layers` as the exported draft's `hidden_layers_list` rt_info, beside the `eagle3_mode` optimum-intel
    writes: OpenVINO GenAI reads it there (from Python the `draft_model` property is refused: a list arrives as
    64-bit integers, "hidden_layers_list must be a vector of int32_t values")."""
    mode = '<eagle3_mode value="True" />'
    text = model_xml.read_text()
    if text.count(mode) != 1:
        raise RuntimeError(f"{model_xml} has no single {mode}: not an EAGLE-3 draft exported by optimum-intel")
    model_xml.write_text(text.replace(mode, f'{mode}<hidden_layers_list value="{" ".join(map(str, layers))}" />'))


def start(target: Path, draft: Path | None, work: Path, tree: dict, tokenizer) -> SideProcess:
    """OpenVINO GenAI decoding with `target` (a transformers folder), plainly (`draft` None) or with the `draft`
    folder (as `save_pretrained` writes it) drafting `tree` (`tree_depth`, `tree_top_k`, `tree_total_tokens`), both
    exported into `work` once; the draft is fed `eagle_config`'s layers, as OpenVINO GenAI numbers outputs of layers
    too. `tokenizer` is not needed: the pipeline takes token ids."""
    python = require_built()
    settings = {"target": str(export(target, work / "ov-target")), "draft": None}
    if draft is not None:
        exported = work / "ov-draft"
        if not (exported / "openvino_model.xml").exists():
            export(draft, exported, "--trust-remote-code")
            for name in TOKENIZER_FILES:
                shutil.copy(work / "ov-target" / name, exported / name)
            write_draft_layers(exported / "openvino_model.xml", eagle_config_layers(draft))
        settings |= {"draft": str(exported), "tree_depth": tree["tree_depth"], "branching_factor": tree["tree_top_k"],
                     "num_assistant_tokens": tree["tree_total_tokens"]}
    return SideProcess(python, "openvino_side.py", settings)
