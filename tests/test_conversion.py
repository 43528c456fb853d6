"""Checkpoint conversion: every foreign format imports exactly, exports round-trip bit for bit, bad input writes
nothing.

Each fixture is written the way its project writes it (key names, config fields, dtypes, file type), and each
converted draft is checked against a reference forward written here from the format's semantics, in plain torch.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers import tiny_draft
from hf_eagle3.conversion import ConversionError, TargetInfo, convert
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle3 import Eagle3DraftModel, check_compatibility
from hf_eagle3.commands import cli

VOCAB = 160  # target vocabulary V
DRAFT_VOCAB = 48  # reduced draft vocabulary Vd
HIDDEN = 32  # draft hidden size k
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
INTERMEDIATE = 64
TARGET_LAYERS = 12  # N
DEFAULT_TAPS = [2, TARGET_LAYERS // 2, TARGET_LAYERS - 3]  # hidden_states indices
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass
class Fixture:
    """A foreign checkpoint as written to disk, and what its format says it computes."""

    tensors: dict[str, torch.Tensor]  # exactly what was saved, under the format's names
    layer_prefix: str  # "midlayer." or "layers.0."
    draft_to_target: torch.Tensor  # target id of each lm_head row, in the format's order
    rms_norm_eps: float
    inv_freq: torch.Tensor  # RoPE frequencies, [HEAD_DIM // 2]
    target_hidden: int
    expected_layer_ids: list[int]
    target: TargetInfo = field(default_factory=TargetInfo)
    # What the source engine computes beyond plain EAGLE-3: any of fc_norm, norm_before_fc, norm_before_residual,
    # norm_output, qk_norm (True), and the number of decoder layers (later ones stored as `layers.{i}.`).
    options: dict = field(default_factory=dict)
    num_layers: int = 1
    sliding_window: int | None = None  # of every layer
    first_position: int = 3000  # of the compared forward: far out, where the RoPE base and scaling matter


# --- fixtures, written as each project writes them -------------------------------------------------------------


def eagle3_weights(
    layer_prefix: str, target_hidden: int, dtype: torch.dtype, seed: int = 0, *, num_layers: int = 1,
    fc_norm: bool = False, norm_before_fc: bool = False, qk_norm: bool = False, intermediate: int = INTERMEDIATE,
) -> dict:
    """Random weights of one EAGLE-3 draft under the official key names, first decoder layer under `layer_prefix`,
    later ones (plain Llama layers) under `layers.{i}.`; optional EAGLE 3.1 / speculators norms."""
    generator = torch.Generator().manual_seed(seed)

    def linear(rows, columns):
        return (torch.randn(rows, columns, generator=generator) / math.sqrt(columns)).to(dtype)

    def norm(width=HIDDEN):
        return (1 + 0.1 * torch.randn(width, generator=generator)).to(dtype)

    def layer(index):
        width = 2 * HIDDEN if index == 0 else HIDDEN
        weights = {
            "self_attn.q_proj.weight": linear(HEADS * HEAD_DIM, width),
            "self_attn.k_proj.weight": linear(KV_HEADS * HEAD_DIM, width),
            "self_attn.v_proj.weight": linear(KV_HEADS * HEAD_DIM, width),
            "self_attn.o_proj.weight": linear(HIDDEN, HEADS * HEAD_DIM),
            "mlp.gate_proj.weight": linear(intermediate, HIDDEN),
            "mlp.up_proj.weight": linear(intermediate, HIDDEN),
            "mlp.down_proj.weight": linear(HIDDEN, intermediate),
            "input_layernorm.weight": norm(),
            "post_attention_layernorm.weight": norm(),
            **({"hidden_norm.weight": norm()} if index == 0 else {}),
            **({f"self_attn.{name}.weight": norm(HEAD_DIM) for name in ("q_norm", "k_norm")} if qk_norm else {}),
        }
        prefix = layer_prefix if index == 0 else f"layers.{index}."
        return {prefix + name: tensor for name, tensor in weights.items()}

    return {
        **{name: tensor for index in range(num_layers) for name, tensor in layer(index).items()},
        "norm.weight": norm(),
        "fc.weight": linear(HIDDEN, 3 * target_hidden),
        "lm_head.weight": linear(DRAFT_VOCAB, HIDDEN),
        **({f"fc_norm.{i}.weight": norm(target_hidden) for i in range(3)} if fc_norm else {}),
        **({"input_norm.weight": norm(3 * target_hidden)} if norm_before_fc else {}),
    }


def our_names(fixture: "Fixture") -> dict[str, torch.Tensor]:
    """The fixture's tensors under Eagle3DraftModel's names."""
    renamed = {}
    for name, tensor in fixture.tensors.items():
        if name.startswith(fixture.layer_prefix):
            name = "midlayer." + name.removeprefix(fixture.layer_prefix)
        elif name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            name = f"extra_layers.{int(index) - 1}.{rest}"
        renamed[name] = tensor
    return renamed


def sorted_vocabulary(seed: int = 1) -> torch.Tensor:
    """Draft vocabulary as EAGLE, SpecForge and speculators list it: ascending target ids."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB].sort().values


def mapping_buffers(draft_to_target: torch.Tensor) -> dict[str, torch.Tensor]:
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_to_target] = True
    return {"d2t": draft_to_target - torch.arange(DRAFT_VOCAB), "t2d": t2d}


def rope_frequencies(base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)


def llama3_frequencies(base: float, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, **_):
    """Llama 3.1's RoPE scaling, one frequency at a time as in Meta's reference code."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    scaled = []
    for frequency in rope_frequencies(base).tolist():
        wavelen = 2 * math.pi / frequency
        if wavelen < high_freq_wavelen:
            scaled.append(frequency)
        elif wavelen > low_freq_wavelen:
            scaled.append(frequency / factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            scaled.append((1 - smooth) * frequency / factor + smooth * frequency)
    return torch.tensor(scaled, dtype=torch.float64)


def llama_config(**fields) -> dict:
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        **fields,
    }


def eagle3_llama_config(**fields) -> dict:
    """The fields SpecForge and ModelOpt both write for a `LlamaForCausalLMEagle3` draft."""
    return llama_config(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        head_dim=HEAD_DIM,
        draft_vocab_size=DRAFT_VOCAB,
        tie_word_embeddings=False,
        **fields,
    )


def write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2))


def official_fixture(folder: Path) -> Fixture:
    """SafeAILab/EAGLE: DeepSpeed fp16 `pytorch_model.bin`, no embedding, no rope_theta, misstated layer count."""
    draft_to_target = sorted_vocabulary()
    tensors = {**eagle3_weights("midlayer.", HIDDEN, torch.float16), **mapping_buffers(draft_to_target)}
    torch.save(tensors, folder / "pytorch_model.bin")
    write_json(
        folder / "config.json",
        llama_config(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            num_hidden_layers=40,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            draft_vocab_size=DRAFT_VOCAB,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=0.02,
            tie_word_embeddings=False,
            torch_dtype="float16",
            transformers_version="4.28.1",
            use_cache=True,
        ),
    )
    return Fixture(
        tensors, "midlayer.", draft_to_target, 1e-5, rope_frequencies(10000.0), HIDDEN, DEFAULT_TAPS,
        target=TargetInfo(num_hidden_layers=TARGET_LAYERS),
    )  # fmt: skip


def sglang_fixture(folder: Path, target_hidden: int = 48) -> Fixture:
    """SpecForge `save_pretrained`: bf16 safetensors with its own embedding, a wider target, output-of-layer ids."""
    draft_to_target = sorted_vocabulary()
    generator = torch.Generator().manual_seed(2)
    tensors = {
        **eagle3_weights("midlayer.", target_hidden, torch.bfloat16),
        **mapping_buffers(draft_to_target),
        "embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16),
    }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    write_json(
        folder / "config.json",
        eagle3_llama_config(
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=None,
            attention_bias=False,
            mlp_bias=False,
            target_hidden_size=target_hidden,
            target_model_type="llama",
            torch_dtype="bfloat16",
            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 8], "use_aux_hidden_state": True},
        ),
    )
    return Fixture(tensors, "midlayer.", draft_to_target, 1e-5, rope_frequencies(500000.0), target_hidden, [2, 6, 9])


def speculators_settings(verifier: str, architecture: str) -> dict:
    """`speculators_config` as speculators writes it: greedy proposals of 3 tokens, the verifier named."""
    return {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0}
        ],
        "verifier": {"name_or_path": verifier, "architectures": [architecture]},
    }


def speculators_fixture(folder: Path) -> Fixture:
    """speculators: fp32, `layers.0.*`, HF-index ids, a layer config holding only non-default fields."""
    draft_to_target = sorted_vocabulary()
    tensors = {**eagle3_weights("layers.0.", HIDDEN, torch.float32), **mapping_buffers(draft_to_target)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    write_json(
        folder / "config.json",
        {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0",
            # `to_diff_dict()`: rms_norm_eps (LlamaConfig default 1e-6) and max_position_embeddings are left out.
            "transformer_layer_config": llama_config(model_type="llama", num_hidden_layers=1, rope_theta=1e6),
            "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": False,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [2, 6, 9],
            "embed_requires_grad": False,
            "speculators_config": speculators_settings("org/target-llama", "LlamaForCausalLM"),
            "torch_dtype": "float32",
        },
    )
    return Fixture(tensors, "layers.0.", draft_to_target, 1e-6, rope_frequencies(1e6), HIDDEN, [2, 6, 9])


def modelopt_fixture(folder: Path) -> Fixture:
    """ModelOpt: bf16, `layers.0.*`, d2t by token frequency (negative offsets), no t2d, llama3 RoPE, unsorted ids."""
    draft_to_target = sorted_vocabulary()[torch.randperm(DRAFT_VOCAB, generator=torch.Generator().manual_seed(3))]
    tensors = {
        **eagle3_weights("layers.0.", HIDDEN, torch.bfloat16),
        "d2t": draft_to_target - torch.arange(DRAFT_VOCAB),
    }
    assert (tensors["d2t"] < 0).any()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    write_json(
        folder / "config.json",
        eagle3_llama_config(
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_SCALING,
            torch_dtype="bfloat16",
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": [8, 1, 5],
                "use_aux_hidden_state": True,
                "use_input_layernorm_in_first_layer": True,
                "use_last_layernorm": True,
                "use_mtp_layernorm": False,
                "next_layer_regular": True,
                "parallel_draft_step": 1,
                "parallel_draft_heads_num_layers": 1,
            },
        ),
    )
    return Fixture(
        tensors, "layers.0.", draft_to_target, 1e-5, llama3_frequencies(500000.0, **LLAMA3_SCALING), HIDDEN,
        [2, 6, 9],
    )  # fmt: skip


def angelslim_vl_fixture(folder: Path) -> Fixture:
    """AngelSlim, mirroring Tencent/AngelSlim `train/configs/qwen3-vl-4b-eagle3-mrope.json`: vLLM's architecture
    name, no layer ids, `tie_word_embeddings: true` with a draft-vocabulary `lm_head`, Qwen3-VL's interleaved mrope."""
    draft_to_target = sorted_vocabulary()
    tensors = {**eagle3_weights("midlayer.", HIDDEN, torch.bfloat16), **mapping_buffers(draft_to_target)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    write_json(
        folder / "config.json",
        llama_config(
            architectures=["Eagle3LlamaForCausalLM"],
            model_type="llama",
            attention_bias=False,
            attention_dropout=0.0,
            bos_token_id=151643,
            dtype="bfloat16",
            eos_token_id=151645,
            head_dim=HEAD_DIM,
            initializer_range=0.02,
            max_position_embeddings=262144,
            num_hidden_layers=1,
            rms_norm_eps=1e-6,
            rope_scaling={"type": "default", "rope_type": "default", "mrope_interleaved": True,
                          "mrope_section": [2, 1, 1]},
            rope_theta=5000000,
            use_cache=True,
            tie_word_embeddings=True,
            transformers_version="4.57.1",
            draft_vocab_size=DRAFT_VOCAB,
            modal_type="VLM",
        ),
    )
    return Fixture(
        tensors, "midlayer.", draft_to_target, 1e-6, rope_frequencies(5e6), HIDDEN, DEFAULT_TAPS,
        target=TargetInfo(num_hidden_layers=TARGET_LAYERS),
    )  # fmt: skip


def specforge_vl_fixture(folder: Path) -> Fixture:
    """SpecForge's Qwen2.5-VL draft (`configs/qwen2.5-vl-32b-eagle3.json`): legacy `type: mrope` RoPE scaling, which
    transformers' LlamaConfig does not know."""
    fixture = sglang_fixture(folder, target_hidden=HIDDEN)
    config = json.loads((folder / "config.json").read_text())
    config.update(rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
    write_json(folder / "config.json", config)
    return Fixture(**{**fixture.__dict__, "inv_freq": rope_frequencies(1e6)})


def specforge_eagle31_fixture(folder: Path) -> Fixture:
    """SpecForge EAGLE 3.1, mirroring sgl-project/SpecForge `configs/qwen3-30B-A3B-eagle3.1.json`: `fc_norm` and
    `norm_output` (the state fed back is taken after the final norm), no layer ids, embedding dropped on save."""
    draft_to_target = sorted_vocabulary()
    tensors = {**eagle3_weights("midlayer.", HIDDEN, torch.bfloat16, fc_norm=True), **mapping_buffers(draft_to_target)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    write_json(
        folder / "config.json",
        eagle3_llama_config(
            attention_bias=False, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, fc_norm=True,
            initializer_range=0.02, max_position_embeddings=2048, max_window_layers=48, norm_output=True,
            rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000.0, sliding_window=None, torch_dtype="bfloat16",
            transformers_version="4.53.2", use_cache=True, use_sliding_window=False,
        ),
    )
    return Fixture(
        tensors, "midlayer.", draft_to_target, 1e-6, rope_frequencies(1e6), HIDDEN, DEFAULT_TAPS,
        target=TargetInfo(num_hidden_layers=TARGET_LAYERS), options={"fc_norm": True, "norm_output": True},
    )  # fmt: skip


def speculators_variant_fixture(
    folder: Path, options: dict, layer_config: dict | None = None, num_layers: int = 1, dtype=torch.bfloat16
) -> Fixture:
    """speculators `Eagle3Speculator` with the top-level option keys `options` and extra `transformer_layer_config`
    fields; `num_layers` decoder layers `layers.{i}.*`."""
    draft_to_target = sorted_vocabulary()
    tensors = {
        **eagle3_weights(
            "layers.0.", HIDDEN, dtype, num_layers=num_layers, fc_norm=options.get("fc_norm", False),
            norm_before_fc=options.get("norm_before_fc", False), qk_norm=options.get("qk_norm", False),
        ),
        **mapping_buffers(draft_to_target),
    }  # fmt: skip
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    layer_config = llama_config(**{"model_type": "llama", "num_hidden_layers": num_layers, "rope_theta": 1e6,
                                   **(layer_config or {})})
    write_json(
        folder / "config.json",
        {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "transformer_layer_config": layer_config,
            "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": False,
            **{name: value for name, value in options.items() if name != "qk_norm"},
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [2, 6, 9],
            "speculators_config": speculators_settings("org/target", "Qwen3ForCausalLM"),
            "torch_dtype": str(dtype).removeprefix("torch."),
        },
    )
    return Fixture(
        tensors, "layers.0.", draft_to_target, 1e-6, rope_frequencies(1e6), HIDDEN, [2, 6, 9], options=options,
        num_layers=num_layers,
    )  # fmt: skip


def speculators_qwen3_fixture(folder: Path) -> Fixture:
    """RedHatAI's Qwen3 speculators drafts (e.g. Qwen3-30B-A3B-Instruct-2507-speculator.eagle3): a `qwen3` layer
    config (per-head q / k norms; Qwen3Config's defaults for what `to_diff_dict` leaves out) and
    `norm_before_residual: true`. Reconstructed from speculators' and vLLM's code, not from a released file."""
    return speculators_variant_fixture(
        folder, {"norm_before_residual": True, "qk_norm": True}, {"model_type": "qwen3", "head_dim": HEAD_DIM}
    )


def speculators_gpt_oss_fixture(folder: Path) -> Fixture:
    """RedHatAI/gpt-oss-20b-speculator.eagle3 as public loaders describe it: `norm_before_fc` (`input_norm` over the
    concatenated taps) and `norm_before_residual`."""
    return speculators_variant_fixture(folder, {"norm_before_fc": True, "norm_before_residual": True})


def speculators_eagle31_fixture(folder: Path) -> Fixture:
    """speculators EAGLE 3.1: `fc_norm.{0,1,2}.weight` and `norm_output` (reconstructed from the EAGLE 3.1 notes)."""
    return speculators_variant_fixture(folder, {"fc_norm": True, "norm_output": True}, dtype=torch.float32)


def speculators_two_layer_fixture(folder: Path) -> Fixture:
    """A two-layer speculators draft (`layers.1.*` a plain Llama layer, as vLLM's llama_eagle3 builds it)."""
    return speculators_variant_fixture(folder, {}, num_layers=2)


def speculators_sliding_fixture(folder: Path) -> Fixture:
    """A speculators draft whose layer config sets `layer_types: ["sliding_attention"]` and `sliding_window` (as
    gpt-oss drafts do; vLLM applies the window). Compared from position 0, where the cache indexes positions."""
    fixture = speculators_variant_fixture(folder, {}, {"layer_types": ["sliding_attention"], "sliding_window": 3})
    return Fixture(**{**fixture.__dict__, "sliding_window": 3, "first_position": 0})


def sglang_llama4_fixture(folder: Path) -> Fixture:
    """A `llama4_text` draft layer config: SGLang's llama_eagle3 sizes the dense MLP by `intermediate_size_mlp`
    (`intermediate_size` is the MoE expert width). Reconstructed from SGLang's code."""
    fixture = sglang_fixture(folder, target_hidden=HIDDEN)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama4_text", intermediate_size=8, intermediate_size_mlp=INTERMEDIATE)
    write_json(folder / "config.json", config)
    return fixture


def sglang_sharded_fixture(folder: Path) -> Fixture:
    """The SpecForge draft saved in two safetensors shards with a `model.safetensors.index.json`, as
    `save_pretrained(max_shard_size=...)` writes large drafts."""
    fixture = sglang_fixture(folder)
    (folder / "model.safetensors").unlink()
    names = sorted(fixture.tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({name: fixture.tensors[name] for name in shard_names}, folder / shard, metadata={"format": "pt"})
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    return fixture


def modelopt_target_head_fixture(folder: Path) -> Fixture:
    """ModelOpt's gpt-oss-120b draft as the issue describes it: no lm_head (the target's is used), no d2t, the whole
    vocabulary. Reconstructed from that description and SGLang's `load_lm_head_from_target`."""
    fixture = modelopt_fixture(folder)
    tensors = {name: t for name, t in fixture.tensors.items() if name not in ("lm_head.weight", "d2t")}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(draft_vocab_size=VOCAB)
    write_json(folder / "config.json", config)
    return Fixture(**{**fixture.__dict__, "tensors": tensors, "draft_to_target": torch.arange(VOCAB)})


# family -> (format it is detected as, fixture)
FIXTURES = {
    "official": ("official", official_fixture),
    "sglang": ("sglang", sglang_fixture),
    "speculators": ("speculators", speculators_fixture),
    "modelopt": ("modelopt", modelopt_fixture),
    "angelslim-vl": ("sglang", angelslim_vl_fixture),
    "specforge-vl": ("sglang", specforge_vl_fixture),
    "specforge-eagle3.1": ("sglang", specforge_eagle31_fixture),
    "specforge-llama4": ("sglang", sglang_llama4_fixture),
    "speculators-qwen3": ("speculators", speculators_qwen3_fixture),
    "speculators-gpt-oss": ("speculators", speculators_gpt_oss_fixture),
    "speculators-eagle3.1": ("speculators", speculators_eagle31_fixture),
    "speculators-two-layers": ("speculators", speculators_two_layer_fixture),
    "speculators-sliding": ("speculators", speculators_sliding_fixture),
    "specforge-sharded": ("sglang", sglang_sharded_fixture),
    "modelopt-target-head": ("modelopt", modelopt_target_head_fixture),
}


# --- the reference forward, from the formats' shared semantics -------------------------------------------------


def reference_forward(fixture: Fixture, embedding: torch.Tensor, input_ids, features, positions, target_head=None):
    """One draft step on target features, in float32, as the source engine computes it (vLLM's / SGLang's
    `llama_eagle3`, speculators' `Eagle3Speculator`): logits over the draft vocabulary in the format's order, and the
    feature fed back at the next step."""
    weights = {name: tensor.float() for name, tensor in fixture.tensors.items()}
    options = fixture.options

    def layer_weights(prefix):
        return {name.removeprefix(prefix): t for name, t in weights.items() if name.startswith(prefix)}

    def rms_norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + fixture.rms_norm_eps)

    def rotate(x):  # rotate-half RoPE, [B, heads, T, D]
        angles = positions[:, None].double() * fixture.inv_freq[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos().float(), torch.cat([angles, angles], -1).sin().float()
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    def attention(layer, attn_in):
        def heads(projection, count, norm=None):
            x = (attn_in @ layer[projection].T).view(*attn_in.shape[:2], count, HEAD_DIM)
            return (rms_norm(x, layer[norm]) if norm and options.get("qk_norm") else x).transpose(1, 2)

        query = rotate(heads("self_attn.q_proj.weight", HEADS, "self_attn.q_norm.weight"))
        key = rotate(heads("self_attn.k_proj.weight", KV_HEADS, "self_attn.k_norm.weight"))
        key = key.repeat_interleave(HEADS // KV_HEADS, dim=1)
        value = heads("self_attn.v_proj.weight", KV_HEADS).repeat_interleave(HEADS // KV_HEADS, dim=1)
        length = input_ids.shape[1]
        scores = query @ key.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        if fixture.sliding_window is not None:
            apart = positions[:, None] - positions[None, :]
            scores = scores.masked_fill(apart >= fixture.sliding_window, float("-inf"))
        attended = (scores.softmax(-1) @ value).transpose(1, 2).reshape(*input_ids.shape, HEADS * HEAD_DIM)
        return attended @ layer["self_attn.o_proj.weight"].T

    def mlp(layer, x):
        normed = rms_norm(x, layer["post_attention_layernorm.weight"])
        gate = nn.functional.silu(normed @ layer["mlp.gate_proj.weight"].T) * (normed @ layer["mlp.up_proj.weight"].T)
        return x + gate @ layer["mlp.down_proj.weight"].T

    if options.get("fc_norm"):
        captures = features.chunk(3, dim=-1)
        features = torch.cat([rms_norm(c, weights[f"fc_norm.{i}.weight"]) for i, c in enumerate(captures)], -1)
    if options.get("norm_before_fc"):
        features = rms_norm(features, weights["input_norm.weight"])
    fused = features @ weights["fc.weight"].T
    layer = layer_weights(fixture.layer_prefix)
    normed = rms_norm(fused, layer["hidden_norm.weight"])
    residual = normed if options.get("norm_before_residual") else fused
    embedded = rms_norm(embedding[input_ids], layer["input_layernorm.weight"])
    hidden = residual + attention(layer, torch.cat([embedded, normed], -1))
    hidden = mlp(layer, hidden)
    for index in range(1, fixture.num_layers):  # vLLM: plain Llama layers over the feature
        layer = layer_weights(f"layers.{index}.")
        hidden = mlp(layer, hidden + attention(layer, rms_norm(hidden, layer["input_layernorm.weight"])))
    final = rms_norm(hidden, weights["norm.weight"])
    head = weights.get("lm_head.weight", target_head)  # a draft without its own head uses the target's
    return final @ head.T, final if options.get("norm_output") else hidden


def over_target_vocabulary(logits: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """Draft logits placed at their target ids; NaN where the draft has no entry."""
    full = torch.full((*logits.shape[:-1], VOCAB), float("nan"))
    full[..., draft_to_target] = logits
    return full


# --- imports -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FIXTURES))
def test_foreign_checkpoint_converts_exactly(tmp_path, family):
    format_name, write_fixture = FIXTURES[family]
    source, destination = tmp_path / family, tmp_path / "hub"
    source.mkdir()
    fixture = write_fixture(source)

    _, detected = convert(source, destination, target=fixture.target)

    assert detected == format_name
    # Every saved weight lands, unchanged and in its dtype; nothing is left over or invented.
    converted = load_file(destination / "model.safetensors")
    renamed = our_names(fixture)
    assert converted.keys() - {"d2t", "t2d"} == renamed.keys() - {"d2t", "t2d"}
    order = fixture.draft_to_target.argsort()
    for name, tensor in converted.items():
        expected = {
            "d2t": fixture.draft_to_target[order] - torch.arange(len(order)),
            "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, fixture.draft_to_target, True),
            **({"lm_head.weight": renamed["lm_head.weight"][order]} if "lm_head.weight" in renamed else {}),
        }.get(name, renamed.get(name))
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name

    draft = Eagle3DraftModel.from_pretrained(destination, dtype=torch.float32).eval()
    assert draft.config.target_layer_ids == fixture.expected_layer_ids
    generator = torch.Generator().manual_seed(4)
    embedding = renamed.get("embed_tokens.weight", torch.randn(VOCAB, HIDDEN, generator=generator)).float()
    if draft.config.share_target_embedding:
        draft.attach_target_embedding(nn.Embedding.from_pretrained(embedding))
    target_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    if draft.config.share_target_lm_head:
        draft.attach_target_lm_head(target_head)
    input_ids = torch.randint(VOCAB, (2, 7), generator=generator)
    features = torch.randn(2, 7, 3 * fixture.target_hidden, generator=generator)
    positions = torch.arange(fixture.first_position, fixture.first_position + 7)
    with torch.no_grad():
        output = draft(input_ids, features, position_ids=positions[None].expand(2, -1), use_cache=False)
    with torch.no_grad():
        expected, expected_feature = reference_forward(
            fixture, embedding, input_ids, features, positions, target_head.weight
        )
    logits = output.logits
    torch.testing.assert_close(output.hidden_states, expected_feature, rtol=0, atol=5e-5)

    torch.testing.assert_close(
        over_target_vocabulary(logits, draft.draft_to_target),
        over_target_vocabulary(expected, fixture.draft_to_target),
        rtol=0,
        atol=5e-5,  # float32 RoPE angles at positions past 3,000; a wrong base or scaling moves logits by O(1)
        equal_nan=True,
    )


@pytest.mark.parametrize("family", list(FIXTURES))
def test_from_pretrained_loads_every_foreign_format_as_its_conversion(tmp_path, family, caplog):
    """`Eagle3DraftModel.from_pretrained(foreign_dir)` converts in memory: the same draft, and the same `generate`,
    as loading the converted checkpoint; taps the checkpoint does not record come from the target."""
    format_name, write_fixture = FIXTURES[family]
    source = tmp_path / family
    source.mkdir()
    fixture = write_fixture(source)
    convert(source, tmp_path / "hub", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    converted = Eagle3DraftModel.from_pretrained(tmp_path / "hub")

    direct = Eagle3DraftModel.from_pretrained(source)

    assert any(f"is a {format_name} checkpoint: converted in memory" in record.message for record in caplog.records)
    assert direct.dtype == converted.dtype
    direct_weights, converted_weights = direct.state_dict(), converted.state_dict()
    assert direct_weights.keys() == converted_weights.keys()
    shared = {name for name, shared in (("embed_tokens.weight", converted.config.share_target_embedding),
                                        ("lm_head.weight", converted.config.share_target_lm_head)) if shared}
    assert all(torch.equal(direct_weights[name], converted_weights[name]) for name in converted_weights.keys() - shared)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=fixture.target_hidden, intermediate_size=64, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0,
    )).eval()  # fmt: skip
    prompt = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    outputs = []
    for draft in (direct.float(), converted.float()):
        outputs.append(target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=12,
                                       tree_depth=3, tree_top_k=2, tree_total_tokens=6))
        outputs.append(draft.generation_stats.acceptance_lengths)
    assert direct.config.target_layer_ids == converted.config.target_layer_ids == fixture.expected_layer_ids
    assert torch.equal(outputs[0], outputs[2]) and outputs[1] == outputs[3]


def test_older_modelopt_export_with_midlayer_names_is_still_modelopt(tmp_path):
    fixture = modelopt_fixture(tmp_path)
    save_file(
        {name.replace("layers.0.", "midlayer."): tensor for name, tensor in fixture.tensors.items()},
        tmp_path / "model.safetensors",
    )
    checkpoint, detected = convert(tmp_path, tmp_path / "hub")
    assert detected == "modelopt" and checkpoint.config.target_layer_ids == [2, 6, 9]


def test_a_llama_draft_with_rope_the_official_code_lacks_reads_as_sglang_on_request(tmp_path):
    """nebius/EAGLE3-gpt-oss-20b as public loaders describe it: a `LlamaForCausalLM` config with `midlayer.*` weights,
    `truncated_vocab_size` beside `draft_vocab_size` and YaRN RoPE, which the official code lacks."""
    official_fixture(tmp_path)
    yarn = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "rope_type": "yarn", "truncate": False}
    _rewrite(tmp_path, lambda config: config.update(rope_theta=150000, rope_scaling=yarn,
                                                    truncated_vocab_size=DRAFT_VOCAB, num_hidden_layers=1))
    with pytest.raises(ConversionError, match="'yarn'.*convert with --from sglang"):
        convert(tmp_path, tmp_path / "out", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    checkpoint, detected = convert(
        tmp_path, tmp_path / "out", from_format="sglang", target=TargetInfo(num_hidden_layers=TARGET_LAYERS)
    )
    assert detected == "sglang" and checkpoint.config.target_layer_ids == DEFAULT_TAPS
    assert checkpoint.config.rope_parameters == {"rope_theta": 150000, **yarn}


def test_speculators_records_target_and_speculative_tokens(tmp_path):
    speculators_fixture(tmp_path)
    checkpoint, _ = convert(tmp_path, tmp_path / "hub")
    assert checkpoint.config.target_name_or_path == "org/target-llama"
    assert checkpoint.config.tree_depth == 3
    assert checkpoint.config.rms_norm_eps == 1e-6  # LlamaConfig's default, as speculators reads it


def test_readings_where_engines_differ_are_recorded(tmp_path):
    angelslim_vl_fixture(tmp_path)
    checkpoint, _ = convert(tmp_path, tmp_path / "hub", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    record = json.loads((tmp_path / "hub" / "config.json").read_text())["converted_from"]
    assert record["format"] == "sglang" and checkpoint.config.converted_from == record
    assert any("mrope" in note for note in record["notes"])
    assert any("tie_word_embeddings=true ignored" in note for note in record["notes"])


def test_top_level_layer_ids_are_read_as_vllm_reads_them(tmp_path):
    sglang_fixture(tmp_path)
    _rewrite(tmp_path, lambda c: (c.pop("eagle_config"), c.update(eagle_aux_hidden_state_layer_ids=[9, 2, 6])))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub")
    assert checkpoint.config.target_layer_ids == [2, 6, 9]  # hidden_states indices, unlike eagle_config's


def test_layer_ids_that_disagree_between_engines_are_refused(tmp_path):
    sglang_fixture(tmp_path)  # eagle_config ids [1, 5, 8] = hidden_states [2, 6, 9]
    _rewrite(tmp_path, lambda config: config.update(eagle_aux_hidden_state_layer_ids=[1, 5, 8]))
    with pytest.raises(ConversionError, match="eagle_aux_hidden_state_layer_ids twice.*remove the one"):
        convert(tmp_path, tmp_path / "hub")
    _rewrite(tmp_path, lambda config: config.update(eagle_aux_hidden_state_layer_ids=[2, 6, 9]))
    assert convert(tmp_path, tmp_path / "hub")[0].config.target_layer_ids == [2, 6, 9]


def test_a_tap_on_the_targets_last_layer_is_never_fed_the_post_norm_state(tmp_path):
    """SGLang / vLLM capture the last layer's output before the final norm; hidden_states[N] is after it."""
    sglang_fixture(tmp_path)
    _rewrite(tmp_path, lambda config: config["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 5, 11]))
    with pytest.raises(ConversionError, match="output of the target's last layer.*final norm"):
        convert(tmp_path, tmp_path / "out", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    assert not (tmp_path / "out").exists()

    # Converted without the target's layer count, the draft is refused when it meets a target whose last layer it taps.
    checkpoint, _ = convert(tmp_path, tmp_path / "out")
    target = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=12,
                                          num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="converted from sglang, reads the output of the target's last layer"):
        check_compatibility(checkpoint.config, target)


@pytest.mark.parametrize("reading, attention_factor", [
    ("transformers", (0.1 * 1.0 * math.log(4.0) + 1) / (0.1 * 0.5 * math.log(4.0) + 1)),
    ("serving", 0.1 * math.log(4.0) + 1),
])
def test_yarn_mscale_reading_is_chosen_and_stated(tmp_path, reading, attention_factor):
    sglang_fixture(tmp_path)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0,
            "mscale_all_dim": 0.5}
    _rewrite(tmp_path, lambda config: config.update(rope_scaling=yarn))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub", yarn_mscale=reading)
    assert any(f"yarn_mscale='{reading}'" in note for note in checkpoint.config.converted_from["notes"])
    assert ("mscale" in checkpoint.config.rope_parameters) == (reading == "transformers")
    draft = Eagle3DraftModel.from_pretrained(tmp_path / "hub")
    assert draft.rotary_emb.attention_scaling == pytest.approx(attention_factor)


def test_identity_vocabulary_with_an_all_zero_t2d_loads_as_the_official_code_does(tmp_path):
    """Vicuna-style official drafts predict the whole vocabulary and store d2t = 0 and an all-false t2d."""
    fixture = official_fixture(tmp_path)
    tensors = dict(fixture.tensors)
    tensors.update(
        {"lm_head.weight": torch.randn(VOCAB, HIDDEN).half(), "d2t": torch.zeros(VOCAB, dtype=torch.long),
         "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
    )
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    _rewrite(tmp_path, lambda config: config.update(draft_vocab_size=VOCAB))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub", target=fixture.target)
    assert torch.equal(checkpoint.tensors["d2t"], torch.zeros(VOCAB, dtype=torch.long))
    assert bool(checkpoint.tensors["t2d"].all())
    assert any("d2t / t2d dropped" in note for note in checkpoint.config.converted_from["notes"])


def test_a_draft_that_cannot_share_the_narrower_target_embedding_is_refused(tmp_path):
    fixture = official_fixture(tmp_path)
    torch.save({**fixture.tensors, "fc.weight": torch.zeros(HIDDEN, 3 * 48).half()}, tmp_path / "pytorch_model.bin")
    _rewrite(tmp_path, lambda config: config.update(target_hidden_size=48))
    with pytest.raises(ConversionError, match="target_hidden_size=48 wide and the draft's hidden_size is 32"):
        convert(tmp_path, tmp_path / "out", target=fixture.target)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("write_fixture", [official_fixture, sglang_fixture, modelopt_fixture, speculators_fixture])
def test_tie_word_embeddings_is_read_the_same_way_by_every_reader(tmp_path, write_fixture):
    write_fixture(tmp_path)
    if write_fixture is speculators_fixture:
        _rewrite(tmp_path, lambda config: config["transformer_layer_config"].update(tie_word_embeddings=True))
    else:
        _rewrite(tmp_path, lambda config: config.update(tie_word_embeddings=True))
    checkpoint, _ = convert(tmp_path, tmp_path / "hub", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    assert any("tie_word_embeddings=true ignored" in note for note in checkpoint.config.converted_from["notes"])

    weights = tmp_path / ("pytorch_model.bin" if write_fixture is official_fixture else "model.safetensors")
    tensors = torch.load(weights) if weights.suffix == ".bin" else load_file(weights)
    tensors.pop("lm_head.weight")
    torch.save(tensors, weights) if weights.suffix == ".bin" else save_file(tensors, weights)
    with pytest.raises(ConversionError, match="tie_word_embeddings=true and the checkpoint has no lm_head.weight"):
        convert(tmp_path, tmp_path / "out", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))


def test_specforge_norm_output_false_is_plain_eagle3(tmp_path):
    """SpecForge's `norm_output: false` (the default) feeds back the pre-norm state, as Eagle3DraftModel does: the
    same draft as the checkpoint that leaves both fields out."""
    plain, stated = tmp_path / "plain", tmp_path / "stated"
    for folder in (plain, stated):
        folder.mkdir()
        fixture = sglang_fixture(folder)
    _rewrite(stated, lambda config: config.update(norm_output=False, fc_norm=False))
    checkpoints = [convert(folder, tmp_path / "hub" / folder.name)[0] for folder in (plain, stated)]

    plain_config, stated_config = ({k: v for k, v in checkpoint.config.to_dict().items() if k != "converted_from"}
                                   for checkpoint in checkpoints)
    assert stated_config == plain_config and stated_config["norm_output"] is stated_config["fc_norm"] is False
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(VOCAB, (2, 7), generator=generator)
    features = torch.randn(2, 7, 3 * fixture.target_hidden, generator=generator)
    outputs = []
    for folder in (plain, stated):
        draft = Eagle3DraftModel.from_pretrained(tmp_path / "hub" / folder.name, dtype=torch.float32).eval()
        with torch.no_grad():
            outputs.append(draft(input_ids, features, use_cache=False))
    assert torch.equal(outputs[1].logits, outputs[0].logits)
    assert torch.equal(outputs[1].hidden_states, outputs[0].hidden_states)  # the state fed back


# --- exports ----------------------------------------------------------------------------------------------------


SGLANG_VARIANTS = [{}, {"fc_norm": True, "norm_output": True}]
SPECULATORS_VARIANTS = [
    *SGLANG_VARIANTS, {"norm_before_residual": True, "qk_norm": True}, {"norm_before_fc": True},
    {"num_hidden_layers": 2, "norm_before_residual": True},
    {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64},
]
ROUND_TRIPS = [("sglang", variant) for variant in SGLANG_VARIANTS] + [
    ("speculators", variant) for variant in SPECULATORS_VARIANTS
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "export_format, variant", ROUND_TRIPS, ids=[f"{f}-{'+'.join(v) or 'eagle3'}" for f, v in ROUND_TRIPS]
)
def test_hub_to_foreign_to_hub_is_bit_exact(tmp_path, export_format, variant, dtype):
    draft = tiny_draft(
        **variant,
        draft_vocab_size=40,
        target_name_or_path="org/target",
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING, "original_max_position_embeddings": 256},
        tree_depth=2, tree_top_k=8, tree_total_tokens=12, tree_shape="auto",
        acceptance_profile=[{"tree_depth": 2, "tree_top_k": 8, "tree_total_tokens": 12, "tau": 1.9}],
    ).to(dtype)
    draft.save_pretrained(tmp_path / "hub")

    convert(tmp_path / "hub", tmp_path / export_format, to_format=export_format)
    convert(tmp_path / export_format, tmp_path / "back")

    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "hub" / "model.safetensors"
    ).read_bytes()
    original, back = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("hub", "back"))
    assert back == original  # the target's id and layer count and the tree settings included


@pytest.mark.parametrize("variant, setting", [
    ({"norm_before_residual": True}, "norm_before_residual=True"),
    ({"norm_before_fc": True}, "norm_before_fc=True"),
    ({"qk_norm": True}, "qk_norm=True"),
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 64}, "layer_types="),
])
def test_sglang_export_refuses_what_sglang_does_not_compute(tmp_path, variant, setting):
    tiny_draft(**variant).save_pretrained(tmp_path / "hub")
    with pytest.raises(ConversionError, match=f"{setting}.*Export to speculators"):
        convert(tmp_path / "hub", tmp_path / "out", to_format="sglang")
    assert not (tmp_path / "out").exists()


def test_exports_refuse_a_tap_on_the_targets_last_layer(tmp_path):
    tiny_draft(target_layer_ids=[2, 4, 8]).save_pretrained(tmp_path / "hub")  # an 8-layer target's hidden_states[8]
    for export_format in ("sglang", "speculators"):
        with pytest.raises(ConversionError, match="last layer.*before the target's final norm"):
            convert(tmp_path / "hub", tmp_path / export_format, to_format=export_format)


def test_draft_with_its_own_embedding_round_trips_through_speculators(tmp_path):
    tiny_draft(draft_vocab_size=40, share_target_embedding=False).save_pretrained(tmp_path / "hub")
    convert(tmp_path / "hub", tmp_path / "speculators", to_format="speculators")
    assert "embed_tokens.weight" in load_file(tmp_path / "speculators" / "model.safetensors")
    convert(tmp_path / "speculators", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "hub" / "model.safetensors"
    ).read_bytes()


def test_sglang_export_refuses_an_embedding_sglang_would_replace(tmp_path):
    source = tmp_path / "specforge"
    source.mkdir()
    sglang_fixture(source, target_hidden=HIDDEN)
    with pytest.raises(ConversionError, match="--share-target-embedding"):
        convert(source, tmp_path / "out", to_format="sglang")
    assert not (tmp_path / "out").exists()

    convert(source, tmp_path / "out", to_format="sglang", share_target_embedding=True)
    assert "embed_tokens.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def test_import_only_formats_cannot_be_written(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub")
    with pytest.raises(ConversionError, match="import-only"):
        convert(tmp_path / "hub", tmp_path / "out", to_format="official")


@pytest.mark.parametrize("forced", ["sglang", "modelopt", "speculators", "official"])
def test_forcing_another_format_on_our_own_draft_is_refused(tmp_path, forced):
    """Read as another format, our `target_layer_ids` would be renumbered or replaced by defaults: refused."""
    tiny_draft(target_layer_ids=[0, 3, 4]).save_pretrained(tmp_path / "hub")
    with pytest.raises(ConversionError, match=f"is a hub checkpoint, not {forced}.*--from hub"):
        convert(tmp_path / "hub", tmp_path / "out", from_format=forced)
    assert not (tmp_path / "out").exists()
    checkpoint, _ = convert(tmp_path / "hub", tmp_path / "out", from_format="hub")
    assert checkpoint.config.target_layer_ids == [0, 3, 4]


def test_sharded_checkpoint_is_read_whole(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub", max_shard_size="20KB")
    assert (tmp_path / "hub" / "model.safetensors.index.json").is_file()
    checkpoint, _ = convert(tmp_path / "hub", tmp_path / "out", to_format="speculators")
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == {
        name.replace("midlayer.", "layers.0.") for name in checkpoint.tensors
    }


# --- malformed and unfaithful inputs: a clear error, nothing written -------------------------------------------


def _drop(name):
    return lambda config, tensors: tensors.pop(name)


def _set_tensor(name, make):
    return lambda config, tensors: tensors.__setitem__(name, make(tensors))


def _set_config(path, value):
    def mutate(config, tensors):
        *parents, key = path.split(".")
        for parent in parents:
            config = config[parent]
        config[key] = value

    return mutate


def _count_one_more_token(tensors):
    t2d = tensors["t2d"].clone()
    t2d[(~t2d).nonzero()[0]] = True
    return t2d


MALFORMED = {
    "missing key": (_drop("midlayer.mlp.up_proj.weight"), r"missing \['midlayer.mlp.up_proj.weight'\]"),
    "unknown key": (_set_tensor("midlayer.extra.weight", lambda t: torch.zeros(3)), r"unknown \['midlayer.extra"),
    "wrong shape": (
        _set_tensor("fc.weight", lambda t: t["fc.weight"].T.contiguous()),
        r"fc.weight \(144, 32\) \(expected \(32, 144\)\)",
    ),
    "d2t out of range": (
        _set_tensor("d2t", lambda t: t["d2t"].clone().index_fill(0, torch.tensor([DRAFT_VOCAB - 1]), VOCAB)),
        "outside the target vocabulary",
    ),
    "duplicate d2t": (
        _set_tensor("d2t", lambda t: torch.zeros(DRAFT_VOCAB, dtype=torch.long).index_fill(0, torch.tensor([1]), -1)),
        "same target id",
    ),
    "t2d count": (_set_tensor("t2d", _count_one_more_token), f"marks {DRAFT_VOCAB + 1} target tokens"),
    "missing d2t": (_drop("d2t"), "no d2t"),
    "d2t dtype": (_set_tensor("d2t", lambda t: t["d2t"].int()), "d2t has dtype torch.int32"),
    "t2d dtype": (_set_tensor("t2d", lambda t: t["t2d"].to(torch.uint8)), "t2d has dtype torch.uint8"),
    "mixed weight dtypes": (_set_tensor("norm.weight", lambda t: t["norm.weight"].float()), "one floating-point dtype"),
    "layer ids outside the target": (
        _set_config("eagle_config.eagle_aux_hidden_state_layer_ids", [1, 5, 12]),
        r"outside a target with 12 layers",
    ),
    "fc_norm without its weights": (_set_config("fc_norm", True), r"missing \['fc_norm.0.weight'"),
    "no aux hidden states": (_set_config("eagle_config.use_aux_hidden_state", False), "EAGLE-1/2"),
    "invalid config": (_set_config("draft_vocab_size", VOCAB + 1), "draft_vocab_size"),
}


@pytest.mark.parametrize("mutation, message", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_checkpoint_is_refused_and_nothing_is_written(tmp_path, mutation, message):
    source = tmp_path / "specforge"
    source.mkdir()
    sglang_fixture(source)
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    mutation(config, tensors)
    write_json(source / "config.json", config)
    save_file(tensors, source / "model.safetensors")

    with pytest.raises(ConversionError, match=message):
        convert(source, tmp_path / "out" / "draft", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["specforge"]


def _rewrite(folder: Path, mutate_config=None, extra_tensors=None) -> None:
    config = json.loads((folder / "config.json").read_text())
    mutate_config(config)
    write_json(folder / "config.json", config)
    if extra_tensors:
        save_file({**load_file(folder / "model.safetensors"), **extra_tensors}, folder / "model.safetensors")


UNFAITHFUL = {
    "norm_before_residual unstated": (
        speculators_fixture, lambda c: c.pop("norm_before_residual"), None, "vLLM as true"
    ),
    "unknown layer type": (
        speculators_fixture, lambda c: c["transformer_layer_config"].update(model_type="gemma3"), None, "'gemma3' layer"
    ),
    "sliding window without its size": (
        speculators_fixture, lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"]), None,
        "sliding_window >= 1",
    ),
    "SGLang's extra layers": (sglang_fixture, lambda c: c.update(num_hidden_layers=2), None, "additional_layers"),
    "layer count disagrees with the weights": (
        speculators_fixture, lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), None,
        "disagree about the draft's depth",
    ),
    "no final norm": (
        modelopt_fixture, lambda c: c["eagle_config"].update(use_last_layernorm=False), None, "use_last_layernorm"
    ),
    "official llama3 rope": (
        official_fixture, lambda c: c.update(rope_theta=5e5, rope_scaling=LLAMA3_SCALING), None, "'llama3'"
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "write_fixture, mutate_config, extra_tensors, message", UNFAITHFUL.values(), ids=UNFAITHFUL.keys()
)
def test_unfaithful_conversion_is_refused(tmp_path, write_fixture, mutate_config, extra_tensors, message):
    source = tmp_path / "source"
    source.mkdir()
    write_fixture(source)
    _rewrite(source, mutate_config, extra_tensors)
    with pytest.raises(ConversionError, match=message):
        convert(source, tmp_path / "out", target=TargetInfo(num_hidden_layers=TARGET_LAYERS))
    assert not (tmp_path / "out").exists()


def test_a_draft_without_a_head_over_a_reduced_vocabulary_is_refused(tmp_path):
    """Without lm_head.weight only a whole-vocabulary draft can use the target's head."""
    fixture = modelopt_fixture(tmp_path)
    tensors = {name: t for name, t in fixture.tensors.items() if name != "lm_head.weight"}
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ConversionError, match="no lm_head.weight but a reduced draft vocabulary"):
        convert(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_draft_using_the_targets_head_round_trips_through_sglang_and_not_speculators(tmp_path):
    (tmp_path / "src").mkdir()
    modelopt_target_head_fixture(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "hub")
    convert(tmp_path / "hub", tmp_path / "sglang", to_format="sglang")
    assert json.loads((tmp_path / "sglang" / "config.json").read_text())["draft_vocab_size"] is None
    convert(tmp_path / "sglang", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "hub" / "model.safetensors"
    ).read_bytes()
    with pytest.raises(ConversionError, match="share_target_lm_head=True.*Export to sglang"):
        convert(tmp_path / "hub", tmp_path / "speculators", to_format="speculators")


def test_official_checkpoint_needs_the_target_layer_count(tmp_path):
    source = tmp_path / "official"
    source.mkdir()
    official_fixture(source)
    with pytest.raises(ConversionError, match="--target-num-layers"):
        convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bin_files_are_never_unpickled_beyond_tensors(tmp_path):
    source = tmp_path / "official"
    source.mkdir()
    fixture = official_fixture(source)
    torch.save({**fixture.tensors, "hook": print}, source / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="weights_only=True refuses"):
        convert(source, tmp_path / "out", target=fixture.target)
    assert not (tmp_path / "out").exists()


def test_existing_destination_is_not_overwritten(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        convert(tmp_path / "hub", tmp_path / "out", to_format="sglang")
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["keep.txt"]


# --- format detection and the command line ---------------------------------------------------------------------


@pytest.fixture
def only_our_commands(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["hf_eagle3.conversion.cli", "hf_eagle3.publishing.hub"])


def test_ambiguous_source_asks_for_the_format(tmp_path, capsys, only_our_commands):
    source = tmp_path / "bare"
    source.mkdir()
    official_fixture(source)
    _rewrite(source, lambda config: config.pop("architectures"))

    with pytest.raises(SystemExit, match="could be any of official, sglang.*Pass --from"):
        cli.main(["convert", str(source), str(tmp_path / "out"), "--target-num-layers", str(TARGET_LAYERS)])
    assert not (tmp_path / "out").exists()

    cli.main(["convert", str(source), str(tmp_path / "out"), "--from", "official", "--target-num-layers", "12"])
    assert "(official) ->" in capsys.readouterr().out


def test_unknown_source_lists_every_format(tmp_path):
    source = tmp_path / "gpt2"
    source.mkdir()
    write_json(source / "config.json", {"model_type": "gpt2"})
    save_file({"wte.weight": torch.zeros(4, 4)}, source / "model.safetensors")
    with pytest.raises(
        ConversionError, match="matches no known format.*hub .*official .*sglang .*speculators .*modelopt"
    ):
        convert(source, tmp_path / "out")


def test_cli_reads_the_target_config(tmp_path, capsys, only_our_commands):
    source = tmp_path / "official"
    source.mkdir()
    official_fixture(source)
    target_config = tmp_path / "target.json"
    write_json(
        target_config, {"model_type": "llama", "num_hidden_layers": 12, "hidden_size": HIDDEN, "vocab_size": VOCAB}
    )

    cli.main(["convert", str(source), str(tmp_path / "out"), "--target-config", str(target_config)])

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["target_layer_ids"] == DEFAULT_TAPS and config["target_model_type"] == "llama"
    assert f"target hidden_states {DEFAULT_TAPS}" in capsys.readouterr().out

    write_json(target_config, {"num_hidden_layers": 12, "hidden_size": HIDDEN, "vocab_size": VOCAB + 1})
    with pytest.raises(SystemExit, match="vocab_size"):
        cli.main(["convert", str(source), str(tmp_path / "out2"), "--target-config", str(target_config)])


def test_cli_picks_the_yarn_reading_and_prints_the_notes(tmp_path, capsys, only_our_commands):
    (tmp_path / "src").mkdir()
    sglang_fixture(tmp_path / "src")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 1.0}
    _rewrite(tmp_path / "src", lambda config: config.update(rope_scaling=yarn))

    cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--yarn-mscale", "serving"])

    assert "note: YaRN mscale dropped (yarn_mscale='serving')" in capsys.readouterr().out
    assert "mscale" not in json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]


def test_non_finite_weights_are_refused(tmp_path):
    draft = tiny_draft()
    with torch.no_grad():
        draft.fc.weight[0, 0] = float("inf")
    draft.save_pretrained(tmp_path / "hub")
    with pytest.raises(ConversionError, match="NaN or infinite values in fc.weight"):
        convert(tmp_path / "hub", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    ("no weight_map", "has no weight_map"),
    ("shard outside", "lies outside"),
    ("missing shard", "is missing from"),
    ("truncated safetensors", "not a readable safetensors file"),
    ("bin holding a list", "holds a list, not a state dict"),
    ("bin holding a tensor", "holds a Tensor, not a state dict"),
    ("garbage bin", "damaged, or holds objects other than tensors"),
])
def test_damaged_weight_files_are_named_not_tracebacks(tmp_path, damage, message):
    source = tmp_path / "hub"
    tiny_draft().save_pretrained(source, max_shard_size="20KB" if "shard" in damage or "map" in damage else "1GB")
    index = source / "model.safetensors.index.json"
    if damage == "no weight_map":
        index.write_text(json.dumps({"metadata": {}}))
    elif damage == "shard outside":
        weight_map = json.loads(index.read_text())["weight_map"]
        (tmp_path / "elsewhere.safetensors").write_bytes((source / next(iter(weight_map.values()))).read_bytes())
        index.write_text(json.dumps({"weight_map": {name: "../elsewhere.safetensors" for name in weight_map}}))
    elif damage == "missing shard":
        (source / next(iter(json.loads(index.read_text())["weight_map"].values()))).unlink()
    elif damage == "truncated safetensors":
        weights = source / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        (source / "model.safetensors").unlink()
        contents = {"bin holding a list": [torch.zeros(2)], "bin holding a tensor": torch.zeros(2)}.get(damage)
        if contents is None:
            (source / "pytorch_model.bin").write_bytes(b"garbage, not a pickle")
        else:
            torch.save(contents, source / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=message):
        convert(source, tmp_path / "out")


def test_a_killed_conversions_staging_folder_is_removed_by_the_next_run(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = tmp_path / f".hf-eagle3-convert-{dead.stdout.strip()}-abc123"
    (abandoned / "out").mkdir(parents=True)
    running = tmp_path / f".hf-eagle3-convert-{os.getpid()}-def456"  # a conversion still running: kept
    running.mkdir()
    convert(tmp_path / "hub", tmp_path / "out")
    assert not abandoned.exists() and running.exists()


def test_a_converted_folder_has_the_modes_of_a_folder_written_in_place(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub")
    convert(tmp_path / "hub", tmp_path / "out")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    assert all(path.stat().st_mode & 0o777 == 0o666 & ~umask for path in (tmp_path / "out").iterdir())


FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
from hf_eagle3.conversion import ConversionError, convert
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
    convert({source!r}, {destination!r})
except ConversionError as error:
    print(error)
"""


@pytest.mark.parametrize("limit", [8_000, 30_000])  # the failure lands in the code files / in the weights
def test_a_full_destination_writes_nothing_and_says_so(tmp_path, limit):
    tiny_draft().save_pretrained(tmp_path / "hub")
    script = FULL_DISK.format(tests=str(Path(__file__).parent), limit=limit, source=str(tmp_path / "hub"),
                              destination=str(tmp_path / "out"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "Nothing was written; free space" in result.stdout, result.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".hf-eagle3-convert-*"))
