"""The library side of `make interop`: runs in .interop-venv, with speculators and SpecForge and without hf-eagle3.

    python library_side.py build WORK   # drafts built and saved by each library's own classes, and their outputs
    python library_side.py run WORK     # drafts hf-eagle3 exported, loaded by each library's own loader, and outputs

`WORK/inputs.safetensors` holds the inputs of the compared draft step (`input_ids` `[1, T]`, the target's features
`[1, T, 3 k_t]` and the target's embedding); `WORK/target` is a target folder whose input embedding the libraries
load as they load a real target's. Each case folder gets `library.safetensors`: the logits and the fed-back state of
two training-time-test steps, computed by the library's own forward code in float32.
"""

import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3Config

SIZES = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 512}
DRAFT_VOCAB = 40
TAPS = [2, 4, 5]  # hidden_states indices of an 8-layer target (output-of-layer ids 1, 3, 4)
STEPS = 2
EAGER = "eager"  # speculators' `draft_attn_impl` for dense masks; its default flex attention needs 128-token blocks


# --- speculators -------------------------------------------------------------------------------------------------


def speculators_variants() -> dict[str, dict]:
    return {
        "eagle3": {},
        "fc_norm": {"fc_norm": True},
        "fc_norm+norm_output": {"fc_norm": True, "norm_output": True},
        "norm_before_residual": {"norm_before_residual": True},
        "norm_before_fc": {"norm_before_fc": True},
        "qwen3": {"layer": "qwen3"},
        "two_layers": {"num_hidden_layers": 2},
        "qwen3_sliding": {"layer": "qwen3", "num_hidden_layers": 2, "sliding_window": 4,
                          "layer_types": ["sliding_attention", "full_attention"]},
    }


def build_speculators(folder: Path, variant: dict, work: Path) -> None:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    variant = dict(variant)
    layer = variant.pop("layer", "llama")
    layer_fields = {**SIZES, "num_hidden_layers": variant.pop("num_hidden_layers", 1)}
    if "sliding_window" in variant:
        layer_fields.update(sliding_window=variant.pop("sliding_window"), layer_types=variant.pop("layer_types"),
                            use_sliding_window=True)
    layer_config = (Qwen3Config if layer == "qwen3" else LlamaConfig)(**layer_fields)
    layer_config._attn_implementation = EAGER
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=TAPS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(work / "target"), architectures=["LlamaForCausalLM"]),
        ),
        **variant,
    )
    model = Eagle3DraftModel(config)
    _randomise(model, seed=len(folder.name))
    embedding = load_file(work / "inputs.safetensors")["embedding"]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embedding)  # as speculators' trainer stores the verifier's
        _set_vocabulary(model.d2t, model.t2d)
    model.save_pretrained(folder)


def load_speculators(folder: Path, work: Path):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = EAGER  # speculators' dense-mask path (flex needs CUDA sizes)
    return Eagle3DraftModel.from_pretrained(folder, config=config).float().eval()


def run_speculators(model, inputs: dict) -> dict[str, torch.Tensor]:
    """Two TTT steps of speculators' own `forward`; logits and fed-back states taken with hooks on its modules."""
    captured = {"logits": [], "head_inputs": [], "layer_outputs": []}

    def head(module, args, output) -> None:
        captured["head_inputs"].append(args[0])
        captured["logits"].append(output)

    def last_layer(module, args, output) -> None:
        captured["layer_outputs"].append(output[0] if isinstance(output, tuple) else output)

    hooks = [model.lm_head.register_forward_hook(head), model.layers[-1].register_forward_hook(last_layer)]
    input_ids = inputs["input_ids"]
    length = input_ids.shape[1]
    with torch.no_grad():
        model(hidden_states=inputs["features"], input_ids=_shift_left(input_ids),
              document_ids=torch.zeros(1, length, dtype=torch.long), position_ids=torch.arange(length)[None],
              ttt_steps=STEPS)
    for hook in hooks:
        hook.remove()
    states = captured["head_inputs"] if model.config.norm_output else captured["layer_outputs"]
    return _outputs(captured["logits"], states)


# --- SpecForge ---------------------------------------------------------------------------------------------------


def specforge_variants() -> dict[str, dict]:
    return {"eagle3": {}, "fc_norm": {"fc_norm": True}}


def build_specforge(folder: Path, variant: dict, work: Path) -> None:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    config = LlamaConfig(**SIZES, num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLMEagle3"],
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in TAPS],
                                       "use_aux_hidden_state": True}, **variant)
    model = LlamaForCausalLMEagle3(config)
    _randomise(model, seed=len(folder.name) + 100)
    with torch.no_grad():
        _set_vocabulary(model.d2t, model.t2d)
    state = {name: tensor for name, tensor in model.state_dict().items() if name != "embed_tokens.weight"}
    model.save_pretrained(folder, state_dict=state)  # SpecForge's trainer saves without the target's embedding


def load_specforge(folder: Path, work: Path):
    """As SpecForge's trainer and exporter load a draft (`specforge/export/checkpoint_io.py`): the model built from
    its config file, the checkpoint's weights loaded into it, the embedding taken from the target. (Its
    `from_pretrained` under transformers 5 builds on the meta device and leaves the non-persistent RoPE buffers
    uninitialised.)"""
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(folder / "config.json")))
    missing, unexpected = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    if unexpected or set(missing) - {"embed_tokens.weight"}:
        raise ValueError(f"{folder}: SpecForge finds unexpected weights {unexpected}, misses {missing}")
    model.load_embedding(str(work / "target"))
    return model.float().eval()


def run_specforge(model, inputs: dict) -> dict[str, torch.Tensor]:
    """Two TTT steps as SpecForge's `OnlineEagle3Model.forward` runs them (sdpa backend)."""
    input_ids = _shift_left(inputs["input_ids"])
    length = input_ids.shape[1]
    features = inputs["features"]
    position_ids = torch.arange(length)[None]
    with torch.no_grad():
        hidden_states = model.project_hidden_states(features)
        attention_mask = model.prepare_decoder_attention_mask(
            attention_mask=torch.ones(1, length, dtype=torch.bool), hidden_states=hidden_states, batch_size=1,
            seq_length=length, past_key_values_length=0)
        cache_hidden = [[], []]
        logits, states = [], []
        for _ in range(STEPS):
            embeds = model.embed_input_ids(input_ids).to(hidden_states.dtype)
            hidden_states = model.backbone(input_embeds=embeds, hidden_states=hidden_states, cache_hidden=cache_hidden,
                                           attention_mask=attention_mask, position_ids=position_ids)
            logits.append(model.compute_logits(hidden_states))
            states.append(hidden_states)
            input_ids = _shift_left(input_ids)
    return _outputs(logits, states)


LIBRARIES = {
    "speculators": (speculators_variants, build_speculators, load_speculators, run_speculators),
    "specforge": (specforge_variants, build_specforge, load_specforge, run_specforge),
}


# --- shared ------------------------------------------------------------------------------------------------------


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every weight random (norm weights around 1), so that a norm or a layer read differently shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else 0.2 * noise)


def _set_vocabulary(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """A reduced vocabulary in ascending target-id order (d2t offsets, t2d mask), as the libraries' trainers store."""
    used = torch.randperm(t2d.numel(), generator=torch.Generator().manual_seed(3))[: d2t.numel()].sort().values
    d2t.copy_(used - torch.arange(d2t.numel()))
    t2d.zero_()
    t2d[used] = True


def _shift_left(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)


def _outputs(logits: list[torch.Tensor], states: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**{f"logits{step}": tensor.float().contiguous() for step, tensor in enumerate(logits[:STEPS])},
            **{f"state{step}": tensor.float().contiguous() for step, tensor in enumerate(states[:STEPS])}}


def main(command: str, work: Path) -> None:
    inputs = load_file(work / "inputs.safetensors")
    cases = json.loads((work / "cases.json").read_text()) if command == "run" else {}
    if command == "build":
        for library, (variants, build, _, _) in LIBRARIES.items():
            for name, variant in variants().items():
                folder = work / "built" / f"{library}-{name}"
                build(folder, variant, work)
                cases[folder.name] = {"library": library, "folder": str(folder)}
    for case in cases.values():
        _, _, load, run = LIBRARIES[case["library"]]
        save_file(run(load(Path(case["folder"]), work), inputs), Path(case["folder"]) / "library.safetensors")
    if command == "build":
        (work / "built" / "cases.json").write_text(json.dumps(cases, indent=1))
    versions = {name: version(name) for name in ("speculators", "specforge", "torch", "transformers")}
    (work / f"versions-{command}.json").write_text(json.dumps(versions))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
