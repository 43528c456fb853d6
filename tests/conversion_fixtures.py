"""Foreign checkpoints written as each project writes them, and the reference forward they are checked against."""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hf_eagle3.conversion import TargetInfo
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

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


def _rewrite(folder: Path, mutate_config=None, extra_tensors=None) -> None:
    config = json.loads((folder / "config.json").read_text())
    mutate_config(config)
    write_json(folder / "config.json", config)
    if extra_tensors:
        save_file({**load_file(folder / "model.safetensors"), **extra_tensors}, folder / "model.safetensors")


def saved_target(folder: Path, vocab_size: int, hidden_size: int) -> LlamaForCausalLM:
    """A tiny Llama target saved to `folder` with `save_pretrained`, whose input embedding exports may need."""
    torch.manual_seed(7)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    target.save_pretrained(folder)
    return target
