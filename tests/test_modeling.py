"""Eagle3Config / Eagle3DraftModel: save-load, Auto classes, the cached tree-mask forward, compatibility errors."""

import json
import warnings

import pytest
import torch
from helpers import HIDDEN, LAYERS, VOCAB, tiny_draft, tiny_target
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.pipelines import base as pipelines_base

from hf_eagle3 import Eagle3Config, Eagle3DraftModel, check_compatibility
from hf_eagle3.commands import cli
from hf_eagle3.decoding.tree import ancestor_matrix


def test_config_defaults_follow_the_official_conventions():
    config = Eagle3Config(vocab_size=100, hidden_size=64, num_attention_heads=4, target_num_hidden_layers=32)
    assert config.target_layer_ids == [2, 16, 29]
    assert config.draft_vocab_size == 100 and config.target_hidden_size == 64 and config.head_dim == 16
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert Eagle3Config(rope_theta=5e5).rope_parameters["rope_theta"] == 5e5
    assert Eagle3Config(target_layer_ids=(27, 2, 15)).target_layer_ids == [2, 15, 27]
    # targets too shallow for three distinct official taps get three distinct ones
    assert [Eagle3Config(target_num_hidden_layers=n).target_layer_ids for n in (4, 6, 7)] == [
        [1, 2, 3], [1, 3, 5], [2, 3, 4]]


def test_a_draft_holds_no_weight_for_the_targets_embedding_until_it_is_attached(tmp_path, llama_target):
    draft = tiny_draft()
    assert draft.embed_tokens.weight is None and "embed_tokens.weight" not in draft.state_dict()
    draft.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path).to(torch.bfloat16)
    assert loaded.embed_tokens.weight is None  # nothing allocated, initialised or read for it
    loaded.attach_target(llama_target)
    assert loaded.embed_tokens.weight is llama_target.get_input_embeddings().weight
    assert "embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")


def test_casting_the_draft_leaves_the_targets_embedding_alone(llama_target, fitted_draft):
    target, draft = llama_target, fitted_draft
    prompt = torch.tensor([[5, 17, 33, 2, 61]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    target.generate(prompt, max_new_tokens=4, do_sample=False, assistant_model=draft)  # attaches the embedding
    draft.to(torch.bfloat16)
    assert target.get_input_embeddings().weight.dtype == torch.float32
    assert draft.embed_tokens.weight is target.get_input_embeddings().weight  # still shared, not copied
    assert draft.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in draft.parameters())
    assert torch.equal(target.generate(prompt, max_new_tokens=12, do_sample=False), expected)
    # a bfloat16 draft on a float32 target drafts in bfloat16; the target's logits decide every token
    output = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert torch.equal(output, expected)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(draft_vocab_size=200, vocab_size=100), "draft_vocab_size"),
        (dict(num_attention_heads=6, num_key_value_heads=4, hidden_size=48), "num_key_value_heads"),
        (dict(target_layer_ids=[1, 2]), "target_layer_ids"),
        (dict(tree_top_k=0), "tree_top_k"),
        (dict(hidden_size=96, target_hidden_size=32, num_attention_heads=4), "told apart"),
        (dict(target_layer_ids=[1, 2, 2]), "distinct"),
        (dict(num_key_value_heads=0), "num_key_value_heads must be >= 1"),
        (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be > 0"),
        (dict(rope_theta=-1.0), "rope_theta must be > 0"),
        (dict(max_position_embeddings=-1), "max_position_embeddings must be >= 1"),
        (dict(hidden_act="swish2"), "hidden_act 'swish2' is unknown"),
        (dict(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}), "rope_type 'mrope' is unknown"),
    ],
)
def test_config_rejects_unbuildable_shapes(fields, message):
    with pytest.raises(Exception, match=message):
        Eagle3Config(**fields)


@pytest.mark.parametrize("served_layout", [True, False])
def test_save_and_load_round_trip_is_identical(tmp_path, served_layout):
    draft = tiny_draft(tree_depth=5, tree_top_k=2, tree_total_tokens=9)
    draft.attach_target_embedding(tiny_target().get_input_embeddings())
    draft.save_pretrained(tmp_path, served_layout=served_layout)

    saved = load_file(tmp_path / "model.safetensors")
    assert "embed_tokens.weight" not in saved  # shared with the target, not duplicated on disk
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight", "midlayer.hidden_norm.weight"} <= set(saved)
    model_type = json.loads((tmp_path / "config.json").read_text())["model_type"]
    assert model_type == ("llama" if served_layout else "eagle3")

    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    if not served_layout:  # the serving engines' model_type is llama: the Auto classes build a LlamaModel there
        assert type(AutoModel.from_pretrained(tmp_path)) is Eagle3DraftModel
        assert type(AutoConfig.from_pretrained(tmp_path)) is Eagle3Config
    layout_fields = ("_name_or_path", "architectures", "auto_map")  # what the files say, not the draft
    loaded_fields = {k: v for k, v in loaded.config.to_dict().items() if k not in layout_fields}
    assert loaded_fields == {k: v for k, v in draft.config.to_dict().items() if k not in layout_fields}
    assert (loaded.config.tree_depth, loaded.config.tree_top_k, loaded.config.tree_total_tokens) == (5, 2, 9)
    original_state = draft.state_dict()
    for name, tensor in loaded.state_dict().items():
        if name != "embed_tokens.weight":
            assert tensor.dtype == original_state[name].dtype and torch.equal(tensor, original_state[name]), name


def test_a_checkpoint_carrying_its_own_embedding_saves_and_loads_it(tmp_path):
    draft = tiny_draft(share_target_embedding=False)
    draft.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.embed_tokens.weight, draft.embed_tokens.weight)


@pytest.mark.parametrize("missing", ["lm_head.weight", "embed_tokens.weight", "d2t"])
def test_loading_an_incomplete_checkpoint_is_refused(tmp_path, missing):
    from safetensors.torch import save_file

    draft = tiny_draft(share_target_embedding=False)  # so its checkpoint must carry the embedding
    draft.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state[missing]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=missing):
        Eagle3DraftModel.from_pretrained(tmp_path)


def test_forward_without_the_shared_embedding_explains_how_to_attach_it():
    draft = tiny_draft()
    with pytest.raises(RuntimeError, match=r"target's token embedding, which is not attached.*attach_target\(target\)"):
        draft(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 3 * HIDDEN))


def test_a_draft_sharing_the_targets_lm_head_uses_it_and_never_saves_it(tmp_path):
    """share_target_lm_head: logits are the target's lm_head over the draft's final norm (ModelOpt gpt-oss-120b)."""
    draft = tiny_draft(draft_vocab_size=VOCAB, share_target_lm_head=True)
    target = tiny_target()
    with pytest.raises(RuntimeError, match="token embedding and lm_head, which is not attached"):
        draft(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 3 * HIDDEN))
    draft.attach_target(target)
    assert draft.lm_head.weight is target.lm_head.weight
    assert "lm_head.weight" not in dict(draft.named_parameters())
    draft.to(torch.bfloat16)
    assert target.lm_head.weight.dtype == torch.float32  # the target's head is the target's
    draft.float()
    input_ids, features = torch.randint(0, VOCAB, (1, 4)), torch.randn(1, 4, 3 * HIDDEN)
    with torch.no_grad():
        output = draft(input_ids, features)
    torch.testing.assert_close(output.logits, target.lm_head(draft.norm(output.hidden_states)))
    draft.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert loaded.config.share_target_lm_head
    with pytest.raises(StrictDataclassClassValidationError, match="draft_vocab_size .* must equal vocab_size"):
        tiny_draft(share_target_lm_head=True)


def test_draft_vocabulary_maps_draft_ids_to_target_ids():
    draft = tiny_draft(draft_vocab_size=4)
    draft.set_draft_vocabulary(torch.tensor([90, 3, 17, 5]))
    assert draft.draft_to_target.tolist() == [3, 5, 17, 90]
    assert draft.t2d.nonzero().flatten().tolist() == [3, 5, 17, 90]
    with pytest.raises(ValueError, match="distinct"):
        draft.set_draft_vocabulary(torch.tensor([1, 1, 2, 3]))


def _tree_vs_paths(attn_implementation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft outputs for a tree fed with a cache and a 4D mask, and the same nodes recomputed path by path."""
    torch.manual_seed(0)
    draft = tiny_draft()
    draft.config._attn_implementation = attn_implementation
    draft.attach_target_embedding(torch.nn.Embedding(VOCAB, HIDDEN))
    prefix_tokens, prefix_features = torch.randint(VOCAB, (1, 7)), torch.randn(1, 7, 3 * HIDDEN)
    # A forest of two trees below the last prefix position, as tree expansion feeds it: 0 -> 1 -> 3 -> 4 -> 5 and
    # 2 -> 6 (roots are their own parents; numbering is topological).
    parents = torch.tensor([0, 0, 2, 1, 3, 4, 2])
    depths = torch.tensor([0, 1, 0, 2, 3, 4, 1])
    tokens, features = torch.randint(VOCAB, (1, 7)), torch.randn(1, 7, HIDDEN)
    ancestors = ancestor_matrix(parents, max_depth=4)

    cache = DynamicCache()
    draft(prefix_tokens, prefix_features, cache=cache)
    mask = torch.cat([torch.ones(7, 7, dtype=torch.bool), ancestors], dim=1)[None, None]
    tree_out = draft(tokens, features, position_ids=(7 + depths)[None], attention_mask=mask, cache=cache)

    path_outs = torch.empty_like(tree_out.hidden_states)
    for node in range(7):
        path = ancestors[node].nonzero().flatten()  # root first (topological numbering)
        fresh = DynamicCache()
        draft(prefix_tokens, prefix_features, cache=fresh)
        out = draft(tokens[:, path], features[:, path], position_ids=(7 + depths[path])[None], cache=fresh)
        path_outs[0, node] = out.hidden_states[0, -1]
    return tree_out.hidden_states, path_outs


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_tree_masked_forward_with_cache_equals_recomputing_each_path(attn_implementation):
    tree_out, path_outs = _tree_vs_paths(attn_implementation)
    assert (tree_out - path_outs).abs().max() <= 1e-5


def test_sdpa_and_eager_agree():
    sdpa, _ = _tree_vs_paths("sdpa")
    eager, _ = _tree_vs_paths("eager")
    assert (sdpa - eager).abs().max() <= 1e-5


def test_compatible_draft_passes_the_check():
    check_compatibility(tiny_draft().config, tiny_target())


@pytest.mark.parametrize(
    "draft_fields, message",
    [
        (dict(target_hidden_size=48), "target_hidden_size=48"),
        (dict(vocab_size=VOCAB + 1), "vocab_size=97"),
        (dict(target_layer_ids=[2, 4, LAYERS + 3]), "outside the target"),
        (dict(hidden_size=48, num_attention_heads=4), "input embedding has shape"),
    ],
)
def test_each_incompatibility_is_named(draft_fields, message):
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                  target_num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match=message):
        check_compatibility(Eagle3Config(**(fields | draft_fields)), tiny_target())


def test_every_mismatch_is_reported_at_once():
    config = Eagle3Config(vocab_size=VOCAB + 1, hidden_size=HIDDEN, target_hidden_size=40, target_layer_ids=[1, 2, 99])
    with pytest.raises(ValueError) as error:
        check_compatibility(config, tiny_target())
    assert all(part in str(error.value) for part in ("target_hidden_size=40", "vocab_size=97", "outside the target"))


def test_missing_config_fields_are_errors_not_guesses():
    config = Eagle3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4)  # no target_layer_ids
    with pytest.raises(ValueError, match="target_layer_ids"):
        check_compatibility(config, tiny_target())


def test_older_transformers_are_refused_and_newer_ones_warned_about_once_naming_the_range():
    from hf_eagle3.utils.transformers_api import check_version

    for version in ("5.16.1", "5.19.0", "5.25.0", "5.25.9"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_version(version)
    for version in ("5.16.0", "5.8.1", "4.57.1"):
        with pytest.raises(ImportError, match=r"needs transformers >=5.16.1 .* 'transformers>=5.16.1,<5.26'"):
            check_version(version)
    with pytest.warns(UserWarning, match=r"tested with transformers >=5.16.1,<5.26 \(newest tested: 5.25\); found"):
        check_version("5.26.0")


def test_a_draft_vocabulary_mapped_outside_the_target_vocabulary_is_refused_on_load(tmp_path):
    draft = tiny_draft(draft_vocab_size=4)
    draft.set_draft_vocabulary(torch.tensor([3, 5, 17, 90]))
    with torch.no_grad():
        draft.d2t[3] = VOCAB  # draft id 3 -> target id VOCAB + 3
    with pytest.raises(ValueError, match=f"outside the target vocabulary \\[0, {VOCAB}\\)"):
        draft.save_pretrained(tmp_path)  # the served layout is checked as it is written
    draft.save_pretrained(tmp_path, served_layout=False)
    with pytest.raises(ValueError, match=f"outside \\[0, {VOCAB}\\)"):
        Eagle3DraftModel.from_pretrained(tmp_path)


def test_a_truncated_checkpoint_is_named_on_load(tmp_path):
    tiny_draft().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated or damaged"):
        Eagle3DraftModel.from_pretrained(tmp_path)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("fc_norm", [False, True])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle_3_1_options_compute_their_published_formulas(fc_norm, norm_before_residual):
    """fc_norm normalises each captured target state before fc; norm_before_residual starts the residual from the
    normalised feature (vLLM's `_norm_before_residual`). Checked against the formulas written out."""
    draft = tiny_draft(fc_norm=fc_norm, norm_before_residual=norm_before_residual)
    draft.attach_target_embedding(tiny_target().get_input_embeddings())
    for name, parameter in draft.named_parameters():
        if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm"):
            torch.nn.init.uniform_(parameter, 0.5, 1.5)
    assert ("fc_norm.2.weight" in draft.state_dict()) == fc_norm
    eps, layer = draft.config.rms_norm_eps, draft.midlayer
    input_ids, features = torch.randint(0, VOCAB, (1, 5)), 3.0 * torch.randn(1, 5, 3 * HIDDEN)
    with torch.no_grad():
        output = draft(input_ids, features)
        captures = features.chunk(3, dim=-1)
        if fc_norm:
            captures = [_rms(c, norm.weight, eps) for c, norm in zip(captures, draft.fc_norm)]
        x = draft.fc(torch.cat(captures, dim=-1))
        normed = _rms(x, layer.hidden_norm.weight, eps)
        attn_input = torch.cat([_rms(draft.embed_tokens(input_ids), layer.input_layernorm.weight, eps), normed], -1)
        positions = torch.arange(5)[None]
        attn = layer.self_attn(attn_input, draft.rotary_emb(x, positions), _causal(5))
        h = (normed if norm_before_residual else x) + attn
        expected = h + layer.mlp(_rms(h, layer.post_attention_layernorm.weight, eps))
    assert torch.allclose(output.hidden_states, expected, atol=1e-5)
    assert torch.allclose(output.logits, draft.lm_head(_rms(expected, draft.norm.weight, eps)), atol=1e-5)


def _causal(length: int) -> torch.Tensor:
    return torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]


def test_eagle_3_1_options_survive_save_and_load(tmp_path):
    draft = tiny_draft(fc_norm=True, norm_before_residual=True)
    torch.nn.init.uniform_(draft.fc_norm[1].weight, 0.5, 1.5)
    draft.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert loaded.config.fc_norm and loaded.config.norm_before_residual
    assert torch.equal(loaded.fc_norm[1].weight, draft.fc_norm[1].weight)


@pytest.mark.parametrize("variant", [
    {"norm_output": True}, {"norm_before_fc": True}, {"qk_norm": True}, {"num_hidden_layers": 3},
    {"num_hidden_layers": 2, "qk_norm": True, "norm_output": True},
    {"num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 2},
], ids=lambda variant: "+".join(f"{k}={v}" for k, v in variant.items()))
def test_public_draft_variants_compute_their_formulas(variant):
    """norm_output feeds back norm(a); norm_before_fc norms [l ; m ; h] before fc; qk_norm norms each head's query and
    key before RoPE (Qwen3); later decoder layers are plain Llama layers over the feature (vLLM's llama_eagle3); a
    sliding-window layer sees the last `sliding_window` positions."""
    draft = tiny_draft(**variant)
    draft.attach_target_embedding(tiny_target().get_input_embeddings())
    for name, parameter in draft.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(parameter, 0.5, 1.5)
    eps, config = draft.config.rms_norm_eps, draft.config
    input_ids, features = torch.randint(0, VOCAB, (1, 5)), 3.0 * torch.randn(1, 5, 3 * HIDDEN)
    positions = torch.arange(5)[None]

    def attention(layer, attn_input, cos_sin):
        attn = layer.self_attn
        shape = (1, 5, -1, attn.head_dim)
        query, key = attn.q_proj(attn_input).view(shape), attn.k_proj(attn_input).view(shape)
        if config.qk_norm:
            query, key = _rms(query, attn.q_norm.weight, eps), _rms(key, attn.k_norm.weight, eps)
        query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), *cos_sin)
        value = attn.v_proj(attn_input).view(shape).transpose(1, 2)
        groups = config.num_attention_heads // config.num_key_value_heads
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        mask = _causal(5)
        if attn.layer_idx > 0 and config.layer_types:
            positions_apart = torch.arange(5)[:, None] - torch.arange(5)[None, :]
            mask = mask.masked_fill(positions_apart >= config.sliding_window, torch.finfo(torch.float32).min)
        scores = query @ key.transpose(-1, -2) * attn.head_dim**-0.5 + mask
        return attn.o_proj((scores.softmax(-1) @ value).transpose(1, 2).reshape(1, 5, -1))

    with torch.no_grad():
        output = draft(input_ids, features)
        x = draft.fc(_rms(features, draft.input_norm.weight, eps) if config.norm_before_fc else features)
        cos_sin = draft.rotary_emb(x, positions)
        layer = draft.midlayer
        attn_input = torch.cat([_rms(draft.embed_tokens(input_ids), layer.input_layernorm.weight, eps),
                                _rms(x, layer.hidden_norm.weight, eps)], -1)
        h = x + attention(layer, attn_input, cos_sin)
        x = h + layer.mlp(_rms(h, layer.post_attention_layernorm.weight, eps))
        for layer in draft.extra_layers:
            h = x + attention(layer, _rms(x, layer.input_layernorm.weight, eps), cos_sin)
            x = h + layer.mlp(_rms(h, layer.post_attention_layernorm.weight, eps))
        normed = _rms(x, draft.norm.weight, eps)
    assert len(draft.extra_layers) == config.num_hidden_layers - 1
    torch.testing.assert_close(output.hidden_states, normed if config.norm_output else x, rtol=0, atol=1e-5)
    torch.testing.assert_close(output.logits, draft.lm_head(normed), rtol=0, atol=1e-5)


def test_variant_weights_have_the_names_public_checkpoints_use():
    names = set(tiny_draft(norm_before_fc=True, qk_norm=True, num_hidden_layers=2).state_dict())
    assert {"input_norm.weight", "midlayer.self_attn.q_norm.weight", "extra_layers.0.self_attn.k_norm.weight",
            "extra_layers.0.input_layernorm.weight"} <= names
    assert "extra_layers.0.hidden_norm.weight" not in names
    assert tiny_draft(num_hidden_layers=2).extra_layers[0].self_attn.q_proj.in_features == HIDDEN
    with pytest.raises(StrictDataclassClassValidationError, match="fc_norm and norm_before_fc are exclusive"):
        tiny_draft(fc_norm=True, norm_before_fc=True)


@pytest.mark.parametrize("name, value, message", [
    ("ngram_max_match", -1, "greater or equal to 1 and smaller or equal to 64, got -1"),
    ("ngram_max_match", 10**9, "smaller or equal to 64, got 1000000000"),  # sized a table of that many rows
    ("tree_depth", 0, "greater or equal to 1 and smaller or equal to 64, got 0"),
    ("tree_total_tokens", 40000, "smaller or equal to 512, got 40000"),
    ("tree_shape", "fastest", "expected one of \\('fixed', 'auto'\\)"),
    ("ngram_candidates", "no", "expected bool, got str"),
])
def test_decoding_settings_assigned_after_construction_are_validated_like_at_construction(name, value, message):
    draft = tiny_draft()
    with pytest.raises(StrictDataclassFieldValidationError, match=f"(?s)field '{name}'.*{message}"):
        setattr(draft.config, name, value)
    with pytest.raises(StrictDataclassFieldValidationError, match=f"(?s)field '{name}'.*{message}"):
        tiny_draft(**{name: value})
    draft.config.tree_depth = 3  # a valid one is kept and saved
    assert Eagle3Config.from_dict(draft.config.to_dict()).tree_depth == 3


def test_a_tree_past_what_one_cycle_verifies_is_refused_before_anything_is_sized(llama_target, fitted_draft):
    prompt = torch.tensor([[5, 17, 33, 2, 61]])
    with pytest.raises(ValueError, match="past what one cycle verifies .*512 tokens"):
        llama_target.generate(prompt, max_new_tokens=4, do_sample=False, assistant_model=fitted_draft, tree_depth=80,
                              tree_top_k=8, tree_total_tokens=40000)


def test_ngram_candidates_given_to_generate_as_a_string_is_refused_not_read_as_true(llama_target, fitted_draft):
    prompt = torch.tensor([[5, 17, 33, 2, 61]])
    with pytest.raises(TypeError, match="ngram_candidates must be True or False, got 'no'"):
        llama_target.generate(prompt, max_new_tokens=4, do_sample=False, assistant_model=fitted_draft,
                              ngram_candidates="no")


@pytest.mark.parametrize("damage, message", [
    (lambda config: None, r"config\.json holds null, not an object of config fields"),
    (lambda config: [config], r"config\.json holds a JSON list, not an object of config fields"),
    (lambda config: config | {"hf_eagle3": "x"}, r"config\.json holds a str as 'hf_eagle3', not an object of fields"),
])
def test_a_damaged_config_is_refused_naming_the_file_wherever_a_draft_is_accepted(tmp_path, damage, message):
    tiny_draft().save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(damage(json.loads(config.read_text()))))
    with pytest.raises(ValueError, match=message):
        Eagle3DraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):  # pipeline(assistant_model=PATH) reads the config first
        pipelines_base.load_assistant_model(tiny_target(), str(tmp_path), None)
    with pytest.raises(SystemExit, match=message):  # bench, tune-tree and demo load drafts the same way
        cli.main(["tune-tree", "--draft", str(tmp_path), "--show-calibration"])


def test_a_config_claiming_huge_sizes_is_refused_before_they_are_allocated(tmp_path):
    tiny_draft().save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"intermediate_size": 2**40}))
    # allocating the MLP at that size (140 TB) would fail with torch's allocation error, not this one
    with pytest.raises(ValueError, match=r"wrong shape midlayer\.mlp\.down_proj\.weight \(32, 64\) \(its config "
                                         r"expects \(32, 1099511627776\)\)"):
        Eagle3DraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("flag", [None, "yes"])
def test_a_saved_profile_row_whose_ngram_flag_is_no_boolean_is_refused_when_the_draft_loads(tmp_path, flag):
    profile = [{"tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 3, "tau": 1.5, "ngram_candidates": True}]
    tiny_draft(tree_shape="auto", acceptance_profile=profile).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hf_eagle3"]["acceptance_profile"][0]["ngram_candidates"] = flag
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(StrictDataclassClassValidationError, match="optionally ngram_candidates \\(true or false\\)"):
        Eagle3DraftModel.from_pretrained(tmp_path)


def _nan_weights(folder):
    weights = load_file(folder / "model.safetensors")
    save_file({name: tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor
               for name, tensor in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})


def _narrower_fc(folder):
    weights = load_file(folder / "model.safetensors")
    save_file(weights | {"fc.weight": weights["fc.weight"][:, :-1].contiguous()}, folder / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message, convert_message", [
    (_nan_weights, r"has NaN or infinite values in fc\.weight, .*midlayer\.self_attn\.q_proj\.weight",
     r"NaN or infinite values in fc\.weight"),
    (lambda folder: (folder / "config.json").write_text("[1, 2]"),
     r"config.json holds a JSON list, not an object of config fields", r"config.json holds a JSON list"),
    (_narrower_fc, r"wrong shape fc\.weight \(32, 95\) \(its config expects \(32, 96\)\)",
     r"fc\.weight \(32, 95\) \(expected \(32, 96\)\)"),
])
def test_a_damaged_draft_folder_is_refused_naming_what_is_wrong(tmp_path, damage, message, convert_message):
    tiny_draft().save_pretrained(tmp_path / "draft")
    damage(tmp_path / "draft")
    with pytest.raises((ValueError, OSError), match=message):
        Eagle3DraftModel.from_pretrained(tmp_path / "draft")
    with pytest.raises(SystemExit, match=convert_message):
        cli.main(["convert", str(tmp_path / "draft"), str(tmp_path / "converted")])


def test_default_taps_are_three_distinct_layers_below_the_last_and_a_target_too_shallow_is_refused():
    for layers in range(3, 40):
        taps = Eagle3Config(target_num_hidden_layers=layers).target_layer_ids
        assert len(set(taps)) == 3 and max(taps) < layers, (layers, taps)
    for layers in (1, 2):
        with pytest.raises(ValueError, match=f"A {layers}-layer target .* use a target of at least 3 decoder layers"):
            Eagle3Config(target_num_hidden_layers=layers)


def test_save_pretrained_onto_a_file_is_refused_and_leaves_the_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("kept")
    for served_layout in (True, False):
        with pytest.raises(NotADirectoryError, match="save_pretrained writes a folder, and .*notes.txt is a file"):
            tiny_draft().save_pretrained(path, served_layout=served_layout)
    assert path.read_text() == "kept"
