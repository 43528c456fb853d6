"""Every format: foreign checkpoints import exactly, exports round-trip bit for bit."""

import json

import pytest
import torch
from conversion_fixtures import (
    FIXTURES,
    HIDDEN,
    LLAMA3_SCALING,
    TARGET_LAYERS,
    VOCAB,
    our_names,
    over_target_vocabulary,
    reference_forward,
    saved_target,
)
from helpers import tiny_draft
from hf_eagle3.conversion import ConversionError, TargetInfo, convert
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_eagle3 import Eagle3DraftModel
from hf_eagle3.decoding.compatibility import target_layer_ids


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
    # taps it does not record are the target's, chosen per call: the loaded config is left as it is
    assert target_layer_ids(direct.config, target) == converted.config.target_layer_ids == fixture.expected_layer_ids
    assert torch.equal(outputs[0], outputs[2]) and outputs[1] == outputs[3]


SGLANG_VARIANTS = [{}, {"fc_norm": True}]


SPECULATORS_VARIANTS = [
    *SGLANG_VARIANTS, {"fc_norm": True, "norm_output": True}, {"norm_before_residual": True, "qk_norm": True},
    {"norm_before_fc": True},
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
    draft.save_pretrained(tmp_path / "hub", served_layout=False)
    saved_target(tmp_path / "target", draft.config.vocab_size, draft.config.hidden_size)

    convert(tmp_path / "hub", tmp_path / export_format, to_format=export_format, target_embedding=tmp_path / "target")
    convert(tmp_path / export_format, tmp_path / "back")

    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "hub" / "model.safetensors"
    ).read_bytes()
    original, back = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("hub", "back"))
    assert back == original  # the target's id and layer count and the tree settings included


def test_import_only_formats_cannot_be_written(tmp_path):
    tiny_draft().save_pretrained(tmp_path / "hub", served_layout=False)
    with pytest.raises(ConversionError, match="import-only"):
        convert(tmp_path / "hub", tmp_path / "out", to_format="official")


@pytest.mark.parametrize("forced", ["sglang", "modelopt", "speculators", "official"])
def test_forcing_another_format_on_our_own_draft_is_refused(tmp_path, forced):
    """Read as another format, our `target_layer_ids` would be renumbered or replaced by defaults: refused."""
    tiny_draft(target_layer_ids=[0, 3, 4]).save_pretrained(tmp_path / "hub", served_layout=False)
    with pytest.raises(ConversionError, match=f"is a hub checkpoint, not {forced}.*--from hub"):
        convert(tmp_path / "hub", tmp_path / "out", from_format=forced)
    assert not (tmp_path / "out").exists()
    checkpoint, _ = convert(tmp_path / "hub", tmp_path / "out", from_format="hub")
    assert checkpoint.config.target_layer_ids == [0, 3, 4]
