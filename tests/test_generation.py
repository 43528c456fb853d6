"""EAGLE-3 through `target.generate(assistant_model=draft)` on tiny random targets: lossless greedy decoding,
`generate`'s behaviour (stopping, streaming, outputs, PEFT), statistics and clear errors."""

import pytest
import torch
from helpers import SLIDING_TARGETS, TARGET_FAMILIES, VOCAB, fit_draft, sliding_target, tiny_draft, tiny_target
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, StaticCache
from transformers.generation.streamers import BaseStreamer

from hf_eagle3 import Eagle3DraftModel
from hf_eagle3.decoding.drafter import TreeSettings
from hf_eagle3.decoding.settings import resolve_settings
from hf_eagle3.utils.fingerprint import weights_fingerprint
from hf_eagle3.utils.transformers_api import CACHE, output_cache

PROMPTS = [torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 17)]
TREE = dict(tree_depth=4, tree_top_k=3, tree_total_tokens=12)
CHAIN = dict(tree_depth=4, tree_top_k=1)
EXACT_TREE = TREE | dict(exact_attention=True)


def _plain(target, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, **kwargs)


def _eagle(target, draft, prompt, **kwargs):
    return target.generate(prompt, do_sample=False, assistant_model=draft, **kwargs)


@pytest.mark.parametrize("family", sorted(TARGET_FAMILIES))
@pytest.mark.parametrize("shape", [TREE, CHAIN, EXACT_TREE], ids=["tree", "chain", "exact-tree"])
def test_greedy_equals_plain_decoding_on_every_family(family, shape):
    target, draft = tiny_target(family), tiny_draft()
    for prompt in PROMPTS:
        expected = _plain(target, prompt, max_new_tokens=24)
        assert torch.equal(_eagle(target, draft, prompt, max_new_tokens=24, **shape), expected)


@pytest.mark.parametrize("shape", [TREE, CHAIN, dict(tree_depth=6, tree_top_k=4, tree_total_tokens=30), EXACT_TREE],
                         ids=["tree", "chain", "wide-tree", "exact-tree"])
def test_greedy_equals_plain_decoding_with_a_draft_that_accepts(llama_target, fitted_draft, shape):
    for prompt in PROMPTS:
        expected = _plain(llama_target, prompt, max_new_tokens=40)
        assert torch.equal(_eagle(llama_target, fitted_draft, prompt, max_new_tokens=40, **shape), expected)
        assert fitted_draft.generation_stats.mean_acceptance_length > 1.0


def test_eager_attention_target_is_lossless(fitted_draft):
    target = tiny_target("llama", attn_implementation="eager")
    prompt = PROMPTS[1]
    expected = _plain(target, prompt, max_new_tokens=30)
    assert torch.equal(_eagle(target, fitted_draft, prompt, max_new_tokens=30), expected)


def test_tree_emits_more_tokens_per_target_forward_than_a_chain_of_the_same_depth(llama_target, fitted_draft):
    tau = {}
    for name, shape in {"tree": dict(tree_top_k=4, tree_total_tokens=24), "chain": dict(tree_top_k=1)}.items():
        lengths = []
        for prompt in PROMPTS:
            _eagle(llama_target, fitted_draft, prompt, max_new_tokens=48, tree_depth=5, **shape)
            lengths += fitted_draft.generation_stats.acceptance_lengths
        tau[name] = sum(lengths) / len(lengths)
    assert tau["tree"] > tau["chain"] > 1.0, tau


def test_left_padded_attention_mask_is_honoured(llama_target, fitted_draft):
    prompt = torch.cat([torch.zeros(1, 4, dtype=torch.long), PROMPTS[1]], dim=1)
    attention_mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(PROMPTS[1])], dim=1)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=30)
    assert torch.equal(_eagle(llama_target, fitted_draft, prompt, **kwargs), _plain(llama_target, prompt, **kwargs))


@pytest.mark.parametrize("family", sorted(TARGET_FAMILIES))
def test_exact_attention_is_bit_identical_to_plain_decoding_in_bfloat16(family):
    # In bf16 the default one-forward verification can part from plain decoding at near-ties (here qwen2's third
    # prompt does on our CPU); exact attention reproduces plain decoding's attention node by node.
    target = tiny_target(family)
    draft = fit_draft(tiny_draft(draft_vocab_size=VOCAB), target).to(torch.bfloat16)
    target = target.to(torch.bfloat16)
    for prompt in PROMPTS:
        expected = _plain(target, prompt, max_new_tokens=40)
        assert torch.equal(_eagle(target, draft, prompt, max_new_tokens=40, **EXACT_TREE), expected)


def test_exact_attention_samples_too(llama_target, fitted_draft):
    torch.manual_seed(0)
    output = llama_target.generate(PROMPTS[1], do_sample=True, max_new_tokens=20, min_new_tokens=20,
                                   assistant_model=fitted_draft, **EXACT_TREE)
    assert output.shape == (1, PROMPTS[1].shape[1] + 20) and torch.equal(output[:, : PROMPTS[1].shape[1]], PROMPTS[1])
    assert fitted_draft.generation_stats.num_cycles < 20  # drafted tokens were accepted


def test_exact_attention_needs_sdpa_and_an_unpadded_prompt(llama_target, fitted_draft):
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        _eagle(tiny_target("llama", attn_implementation="eager"), fitted_draft, PROMPTS[1], max_new_tokens=5,
               exact_attention=True)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), PROMPTS[1]], dim=1)
    attention_mask = (padded != 0).long()
    with pytest.raises(ValueError, match="strip the padding"):
        _eagle(llama_target, fitted_draft, padded, attention_mask=attention_mask, max_new_tokens=5,
               exact_attention=True)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
def test_max_new_tokens_is_exact(llama_target, fitted_draft, max_new_tokens):
    prompt = PROMPTS[2]
    out = _eagle(llama_target, fitted_draft, prompt, max_new_tokens=max_new_tokens)
    assert out.shape[1] == prompt.shape[1] + max_new_tokens
    assert torch.equal(out, _plain(llama_target, prompt, max_new_tokens=max_new_tokens))
    assert _eagle(llama_target, fitted_draft, prompt, max_length=prompt.shape[1] + 7).shape[1] == prompt.shape[1] + 7


def test_eos_stops_where_plain_decoding_stops(llama_target, fitted_draft):
    prompt = PROMPTS[0]
    continuation = _plain(llama_target, prompt, max_new_tokens=30)[0, prompt.shape[1] :].tolist()
    for eos in ([continuation[11]], [continuation[20], continuation[6]]):
        expected = _plain(llama_target, prompt, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
        out = _eagle(llama_target, fitted_draft, prompt, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out, expected) and out.shape[1] < prompt.shape[1] + 30


class _Collect(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.ended = True


def test_streamer_receives_the_same_tokens(llama_target, fitted_draft):
    prompt = PROMPTS[1]
    plain, ours = _Collect(), _Collect()
    _plain(llama_target, prompt, max_new_tokens=25, streamer=plain)
    _eagle(llama_target, fitted_draft, prompt, max_new_tokens=25, streamer=ours)
    assert ours.tokens == plain.tokens and ours.ended


def test_return_dict_outputs_match_plain_decoding(llama_target, fitted_draft):
    prompt = PROMPTS[1]
    kwargs = dict(max_new_tokens=20, return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = _plain(llama_target, prompt, **kwargs)
    ours = _eagle(llama_target, fitted_draft, prompt, **kwargs)
    assert torch.equal(ours.sequences, plain.sequences)
    assert len(ours.scores) == len(plain.scores) == len(ours.logits) == 20
    for mine, theirs in zip(ours.scores + ours.logits, plain.scores + plain.logits):
        assert mine.shape == theirs.shape and torch.allclose(mine, theirs, atol=1e-4)
    ours_cache, plain_cache = output_cache(ours), output_cache(plain)
    assert isinstance(ours_cache, DynamicCache) and ours_cache.get_seq_length() == plain_cache.get_seq_length()


@pytest.mark.parametrize("processors", [dict(repetition_penalty=1.3), dict(repetition_penalty=1.3, min_new_tokens=24),
                                        dict(repetition_penalty=1.3, no_repeat_ngram_size=3)],
                         ids=["repetition-penalty", "min-new-tokens", "no-repeat-ngram"])
def test_logits_processors_shape_greedy_decoding_as_in_plain_decoding(llama_target, fitted_draft, processors):
    """Every node scored at once along its path (a repetition penalty, a minimum length), or node by node (the
    n-gram ban); with `min_new_tokens`, the EOS is a token plain decoding would emit early without it."""
    prompt = PROMPTS[2]
    kwargs = dict(max_new_tokens=30, **processors)
    if "min_new_tokens" in processors:
        early = _plain(llama_target, prompt, max_new_tokens=30, repetition_penalty=1.3)[0, prompt.shape[1] + 4]
        kwargs["eos_token_id"] = int(early)
    plain = _plain(llama_target, prompt, **kwargs)
    assert plain.shape[1] > prompt.shape[1] + 20
    assert torch.equal(_eagle(llama_target, fitted_draft, prompt, **kwargs, **TREE), plain)


def test_peft_adapted_target_is_lossless(fitted_draft):
    from peft import LoraConfig, get_peft_model

    target = get_peft_model(tiny_target("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    for name, parameter in target.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(std=0.5)  # make the adapter change the target's outputs
    prompt = PROMPTS[1]
    expected = target.generate(input_ids=prompt, max_new_tokens=25, do_sample=False)
    out = target.generate(input_ids=prompt, max_new_tokens=25, do_sample=False, assistant_model=fitted_draft)
    assert torch.equal(out, expected)
    with target.disable_adapter():
        assert not torch.equal(target.generate(input_ids=prompt, max_new_tokens=25, do_sample=False), expected)


def test_statistics_describe_the_call(llama_target, fitted_draft):
    prompt = PROMPTS[0]
    out = _eagle(llama_target, fitted_draft, prompt, max_new_tokens=40, **TREE)
    stats = fitted_draft.generation_stats
    assert stats.settings.depth == 4 and stats.settings.top_k == 3 and stats.settings.total_tokens == 12
    # the prefill emits the first token, each cycle its acceptance length (the last one cut by max_new_tokens
    # counts only what it emitted)
    assert 1 + sum(stats.acceptance_lengths) == out.shape[1] - prompt.shape[1] == 40
    assert stats.num_cycles == len(stats.acceptance_lengths) > 0
    assert min(stats.draft_seconds, stats.verify_seconds, stats.other_seconds, stats.prefill_seconds) > 0
    assert stats.greedy_cycles == []  # kept only on request: a long generation does not hold every tree

    _eagle(llama_target, fitted_draft, prompt, max_new_tokens=40, record_greedy_cycles=True, **TREE)
    cycles, lengths = fitted_draft.generation_stats.greedy_cycles, fitted_draft.generation_stats.acceptance_lengths
    # each cycle emits its accepted path (drafted tokens + bonus); the last one only what max_new_tokens leaves
    assert [path.numel() for _, path in cycles[:-1]] == lengths[:-1] and cycles[-1][1].numel() >= lengths[-1]


def test_defaults_come_from_the_draft_config(llama_target):
    draft = tiny_draft(tree_depth=3, tree_top_k=2, tree_total_tokens=5)
    _eagle(llama_target, draft, PROMPTS[0], max_new_tokens=5)
    assert (draft.generation_stats.settings.depth, draft.generation_stats.settings.total_tokens) == (3, 5)


def test_other_assistants_and_prompt_lookup_are_untouched(llama_target):
    prompt = PROMPTS[2]
    expected = _plain(llama_target, prompt, max_new_tokens=20)
    assert torch.equal(_plain(llama_target, prompt, max_new_tokens=20, prompt_lookup_num_tokens=3), expected)
    assistant = tiny_target("llama", seed=3)
    assert torch.equal(_plain(llama_target, prompt, max_new_tokens=20, assistant_model=assistant), expected)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "greedy decoding and sampling"),
        (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
        (dict(output_attentions=True, return_dict_in_generate=True), "attentions"),
        (dict(tree_top_k=0), "tree_top_k"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup"),
    ],
)
def test_unsupported_settings_raise(llama_target, kwargs, message):
    kwargs = dict(do_sample=False, max_new_tokens=5) | kwargs
    with pytest.raises(ValueError, match=message):
        llama_target.generate(PROMPTS[0], assistant_model=tiny_draft(), **kwargs)


@pytest.mark.parametrize("shape", [TREE, CHAIN], ids=["tree", "chain"])
def test_static_cache_is_lossless(llama_target, fitted_draft, shape):
    for prompt in PROMPTS:
        expected = _plain(llama_target, prompt, max_new_tokens=30)
        out = _eagle(llama_target, fitted_draft, prompt, max_new_tokens=30, cache_implementation="static",
                     return_dict_in_generate=True, **shape)
        assert torch.equal(out.sequences, expected) and fitted_draft.generation_stats.mean_acceptance_length > 1.0
        cache = output_cache(out)
        assert isinstance(cache, StaticCache) and int(cache.get_seq_length()) == expected.shape[1] - 1


def test_a_static_cache_too_short_for_the_tree_is_replaced_when_empty_and_refused_when_filled(
    llama_target, fitted_draft
):
    prompt, kwargs = PROMPTS[1], dict(max_new_tokens=20) | TREE
    short = StaticCache(config=llama_target.config, max_cache_len=prompt.shape[1] + 20)  # no room for the last tree
    assert torch.equal(_eagle(llama_target, fitted_draft, prompt, **{CACHE: short}, **kwargs),
                       _plain(llama_target, prompt, max_new_tokens=20))
    filled = StaticCache(config=llama_target.config, max_cache_len=prompt.shape[1] + 20)
    llama_target(prompt[:, :4], **{CACHE: filled})
    with pytest.raises(ValueError, match="max_cache_len >= 41"):
        _eagle(llama_target, fitted_draft, prompt, **{CACHE: filled}, **kwargs)


@pytest.mark.parametrize(("own", "filled", "expected"), [(30, False, 256), (300, False, 300), (30, True, 30)],
                         ids=["short-rounded-up", "long-enough", "filled"])
def test_a_call_s_static_cache_length_is_its_own_or_rounded_up_to_a_block(llama_target, own, filled, expected):
    from hf_eagle3.decoding.settings import static_cache_length

    cache = StaticCache(config=llama_target.config, max_cache_len=own)
    if filled:
        llama_target(PROMPTS[1][:, :4], **{CACHE: cache})
    assert static_cache_length(cache, 60, 12) == expected and static_cache_length(DynamicCache(), 60, 12) is None


@pytest.mark.slow  # dynamo traces nine graphs (about 25 s on a 2-core machine)
def test_the_compiled_verification_forward_keeps_a_graph_for_every_size_past_dynamo_s_default_limit():
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from hf_eagle3.decoding.compiled import compiled_forward

    target = tiny_target("llama")
    forward = compiled_forward(target, CompileConfig(backend="eager", fullgraph=False, dynamic=False))
    graphs, limit = counters["stats"]["unique_graphs"], torch._dynamo.config.recompile_limit
    with torch.no_grad():
        for size in range(1, limit + 2):  # one size more than dynamo keeps
            forward(input_ids=torch.randint(1, 90, (1, size)), use_cache=False)
    assert counters["stats"]["unique_graphs"] - graphs == limit + 1
    assert torch._dynamo.config.recompile_limit == limit  # raised for the compiled forward's own calls only


def test_compiled_verification_is_lossless(fitted_draft):
    from hf_eagle3.commands.bench import compiled_kwargs

    target = tiny_target("llama")
    compiled = compiled_kwargs(max_cache_len=64)
    for prompt in PROMPTS:
        expected = _plain(target, prompt, max_new_tokens=24)
        assert torch.equal(_eagle(target, fitted_draft, prompt, max_new_tokens=24, **compiled, **TREE), expected)
    assert target._compiled_call is not None  # verification ran through transformers' compiled forward


def test_static_cache_with_exact_attention_raises(llama_target):
    with pytest.raises(ValueError, match="exact_attention=True verifies node by node over a dynamic cache"):
        _eagle(llama_target, tiny_draft(), PROMPTS[1], max_new_tokens=5, cache_implementation="static",
               exact_attention=True, **TREE)


def test_static_cache_with_a_batch_raises(llama_target):
    batch = torch.cat([PROMPTS[1], PROMPTS[1]])
    with pytest.raises(ValueError, match="static cache generates one sequence per call"):
        _eagle(llama_target, tiny_draft(), batch, attention_mask=torch.ones_like(batch), max_new_tokens=5,
               cache_implementation="static", **TREE)


@pytest.fixture(params=sorted(SLIDING_TARGETS))
def sliding_target_and_draft(request):
    target = sliding_target(request.param)
    return target, fit_draft(tiny_draft(draft_vocab_size=VOCAB), target)


@pytest.mark.parametrize("shape", [TREE, CHAIN], ids=["tree", "chain"])
def test_sliding_window_targets_are_lossless(sliding_target_and_draft, shape):
    target, draft = sliding_target_and_draft
    lengths = []
    for prompt in PROMPTS:
        expected = _plain(target, prompt, max_new_tokens=30)
        assert torch.equal(_eagle(target, draft, prompt, max_new_tokens=30, **shape), expected)
        lengths += draft.generation_stats.acceptance_lengths
    assert max(lengths) >= 2  # drafted nodes were verified and accepted, not only the root


def test_exact_attention_refuses_a_sliding_window(sliding_target_and_draft):
    target, draft = sliding_target_and_draft
    with pytest.raises(ValueError, match="sliding window"):
        _eagle(target, draft, PROMPTS[0], max_new_tokens=5, exact_attention=True)


def test_the_window_is_applied(sliding_target_and_draft):
    # Without the window the same weights decode differently: the tests above do exercise it.
    target, _ = sliding_target_and_draft
    windowed = _plain(target, PROMPTS[2], max_new_tokens=30)
    without_window = type(target)(target.config.__class__(**{**target.config.to_dict(), "sliding_window": None,
                                                              "use_sliding_window": False, "layer_types": None}))
    without_window.load_state_dict(target.state_dict())
    assert not torch.equal(_plain(without_window.eval(), PROMPTS[2], max_new_tokens=30), windowed)


def test_a_draft_for_another_target_raises(llama_target):
    with pytest.raises(ValueError, match="does not fit the target"):
        _eagle(llama_target, tiny_draft(target_layer_ids=[2, 4, 30]), PROMPTS[0], max_new_tokens=5)


def test_tree_settings_without_an_eagle3_assistant_raise(llama_target):
    with pytest.raises(TypeError, match="Eagle3DraftModel"):
        _plain(llama_target, PROMPTS[0], max_new_tokens=5, tree_depth=3)


def test_a_draft_for_another_vocabulary_names_the_mismatch_not_an_assistant_tokenizer(llama_target):
    with pytest.raises(ValueError, match=f"draft vocab_size={VOCAB + 4} but the target's vocab_size is {VOCAB}"):
        _eagle(llama_target, tiny_draft(vocab_size=VOCAB + 4), PROMPTS[0], max_new_tokens=5)


def test_inputs_embeds_instead_of_input_ids_is_a_clear_error(llama_target, fitted_draft):
    embeds = llama_target.get_input_embeddings()(PROMPTS[0])
    with pytest.raises(ValueError, match="pass input_ids instead of inputs_embeds"):
        llama_target.generate(inputs_embeds=embeds, max_new_tokens=5, assistant_model=fitted_draft)


def test_a_draft_trained_for_another_model_of_the_same_shapes_is_named(llama_target, tmp_path, caplog):
    other = tiny_target(seed=1)  # same shapes, other weights, loaded from a local folder
    other.save_pretrained(tmp_path / "other")
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "other")
    draft = tiny_draft(target_name_or_path="org/Llama-Tiny", target_fingerprint=weights_fingerprint(llama_target))
    _eagle(other, draft, PROMPTS[0], max_new_tokens=5)
    assert any("trained for 'org/Llama-Tiny'" in record.message and "is another model" in record.message
               for record in caplog.records)
    caplog.clear()
    _eagle(llama_target, tiny_draft(target_name_or_path="org/Mistral-Tiny"), PROMPTS[0], max_new_tokens=5)
    assert not any("trained for" in record.message for record in caplog.records)  # a model built here: no name


def test_a_local_copy_of_the_target_gets_no_warning_in_any_dtype(llama_target, tmp_path, caplog):
    llama_target.save_pretrained(tmp_path / "my-models" / "folder")  # a local folder named unlike the Hub id
    fingerprint = weights_fingerprint(llama_target)
    for dtype in (torch.float32, torch.bfloat16):
        target = AutoModelForCausalLM.from_pretrained(tmp_path / "my-models" / "folder", dtype=dtype)
        draft = tiny_draft(target_name_or_path="org/Llama-Tiny", target_fingerprint=fingerprint).to(dtype)
        _eagle(target, draft, PROMPTS[0], max_new_tokens=5)
        # a draft that records no fingerprint (the shipped one, converted ones): the same architecture at a local path
        _eagle(target, tiny_draft(target_name_or_path="org/Llama-Tiny", target_model_type="llama").to(dtype),
               PROMPTS[0], max_new_tokens=5)
    assert not any("trained for" in record.message for record in caplog.records)


def test_a_tree_size_beyond_what_the_tree_can_hold_is_refused(llama_target, fitted_draft):
    with pytest.raises(ValueError, match="tree_total_tokens=20 exceeds the 12 candidates"):
        _eagle(llama_target, fitted_draft, PROMPTS[0], max_new_tokens=5, tree_depth=2, tree_top_k=3,
               tree_total_tokens=20)


@pytest.mark.parametrize("setting", [{"num_assistant_tokens": 5}, {"assistant_confidence_threshold": 0.2}])
def test_settings_of_transformers_own_assisted_generation_are_refused_not_ignored(llama_target, fitted_draft,
                                                                                   setting):
    with pytest.raises(TypeError, match="EAGLE-3 replaces: drop them"):
        _eagle(llama_target, fitted_draft, PROMPTS[0], max_new_tokens=5, **setting)


def test_transformers_assisted_generation_sizes_in_the_drafts_generation_config_are_refused(llama_target):
    draft = tiny_draft()
    draft.generation_config.num_assistant_tokens = 5  # where transformers reads it from an assistant
    with pytest.raises(TypeError, match="The draft's generation_config sets num_assistant_tokens.*set tree_depth"):
        _eagle(llama_target, draft, PROMPTS[0], max_new_tokens=5)


def test_generation_stats_exist_before_the_first_call():
    assert tiny_draft().generation_stats is None


def test_a_bfloat16_checkpoint_loaded_with_from_pretrained_drafts_for_a_float32_target_in_its_own_dtype(
    llama_target, fitted_draft, tmp_path
):
    # save_pretrained of a bf16 copy, then `from_pretrained` as a transformers user loads it (dtype "auto")
    fitted_draft.save_pretrained(tmp_path / "float32")
    Eagle3DraftModel.from_pretrained(tmp_path / "float32").to(torch.bfloat16).save_pretrained(tmp_path / "bfloat16")
    draft = Eagle3DraftModel.from_pretrained(tmp_path / "bfloat16")
    assert isinstance(draft, Eagle3DraftModel) and draft.dtype == torch.bfloat16 and llama_target.dtype == torch.float32

    prompt = PROMPTS[1]
    expected = _plain(llama_target, prompt, max_new_tokens=30)
    assert torch.equal(_eagle(llama_target, draft, prompt, max_new_tokens=30, **TREE), expected)
    assert draft.generation_stats.mean_acceptance_length > 1  # the draft ran, in bf16, and its tokens were accepted
    assert draft.dtype == torch.bfloat16 and llama_target.dtype == torch.float32  # neither was cast


def test_a_draft_on_another_device_than_the_target_is_named_with_the_fix(llama_target):
    draft = tiny_draft().to("meta")
    with pytest.raises(ValueError, match=r"The draft is on meta and the target on cpu.*draft.to\(target.device\)"):
        _eagle(llama_target, draft, PROMPTS[0], max_new_tokens=5)


def _settings_used(draft) -> tuple[int, int, int]:
    settings = draft.generation_stats.settings
    return settings.depth, settings.top_k, settings.total_tokens


def test_tree_settings_saved_in_the_drafts_generation_config_json_are_read(llama_target, tmp_path):
    tiny_draft().save_pretrained(tmp_path)
    GenerationConfig(tree_depth=2, tree_top_k=2, tree_total_tokens=5).save_pretrained(tmp_path)  # as a user would
    draft = Eagle3DraftModel.from_pretrained(tmp_path)
    _eagle(llama_target, draft, PROMPTS[0], max_new_tokens=5)
    assert _settings_used(draft) == (2, 2, 5)

    draft.generation_config.tree_depth = 3  # set on the loaded draft, saved with it, read back
    draft.save_pretrained(tmp_path / "again")
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path / "again")
    _eagle(llama_target, reloaded, PROMPTS[0], max_new_tokens=5)
    assert _settings_used(reloaded) == (3, 2, 5)
    tiny_draft().save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "generation_config.json").exists()  # nothing set, nothing written


def test_tree_settings_follow_transformers_precedence_kwargs_then_generation_configs_then_the_draft():
    target = tiny_target("llama")  # its generation_config is changed below
    draft = tiny_draft(tree_depth=4, tree_top_k=3, tree_total_tokens=12)
    prompt = PROMPTS[0]
    _eagle(target, draft, prompt, max_new_tokens=5)
    assert _settings_used(draft) == (4, 3, 12)  # the draft config's defaults
    draft.generation_config.tree_depth = 3
    _eagle(target, draft, prompt, max_new_tokens=5)
    assert _settings_used(draft) == (3, 3, 12)  # the draft's generation_config over its config
    target.generation_config.tree_top_k = 2
    _eagle(target, draft, prompt, max_new_tokens=5)
    assert _settings_used(draft) == (3, 2, 10)  # the target's over the draft's (the default size capped)
    _eagle(target, draft, prompt, max_new_tokens=5, generation_config=GenerationConfig(tree_top_k=1, tree_depth=2))
    assert _settings_used(draft) == (2, 1, 2)  # the call's generation_config over the target's
    _eagle(target, draft, prompt, max_new_tokens=5, generation_config=GenerationConfig(tree_top_k=1), tree_top_k=3)
    assert _settings_used(draft) == (3, 3, 12)  # keyword arguments over everything


def test_a_draft_without_a_profile_decodes_with_its_fixed_tree_on_cpu_and_the_official_tree_on_cuda(monkeypatch):
    target, draft = tiny_target("llama"), tiny_draft(tree_depth=4, tree_top_k=3, tree_total_tokens=12)
    assert torch.equal(_eagle(target, draft, PROMPTS[0], max_new_tokens=12), _plain(target, PROMPTS[0],
                                                                                    max_new_tokens=12))
    assert _settings_used(draft) == (4, 3, 12)  # on the CPU: the config's fixed tree
    monkeypatch.setattr(type(target), "device", property(lambda self: torch.device("cuda")))
    on_cuda = resolve_settings(target, draft, target.generation_config, {}, batch_size=1)
    assert on_cuda.tree == TreeSettings(7, 10, 60) and on_cuda.shape_choice is None  # the official EAGLE-3 tree
    assert resolve_settings(target, draft, target.generation_config, {"tree_depth": 3}, batch_size=1).tree == (
        TreeSettings(3, 10, 60))  # a size set for the call still wins
    draft.config.acceptance_profile = [{"tree_depth": 1, "tree_top_k": 1, "tree_total_tokens": 1, "tau": 1.5}]
    assert resolve_settings(target, draft, target.generation_config, {}, batch_size=1).tree == (
        TreeSettings(4, 3, 12))  # a profiled draft's fixed tree is its own everywhere


def test_auto_without_a_profile_warns_once_and_decodes_with_the_fixed_tree(caplog):
    target, draft = tiny_target("llama"), tiny_draft(tree_shape="auto")
    for prompt in PROMPTS[:2]:
        assert torch.equal(_eagle(target, draft, prompt, max_new_tokens=12), _plain(target, prompt, max_new_tokens=12))
        assert _settings_used(draft) == (4, 3, 12)
    warnings = [record.getMessage() for record in caplog.records if "acceptance profile" in record.getMessage()]
    assert len(warnings) == 1 and "decoding with the fixed tree instead" in warnings[0]
NGRAM_PROMPTS = [torch.cat([p, p, p[:, :2]], dim=1) for p in PROMPTS]  # repeats: continuations are found


@pytest.mark.parametrize("family", sorted(TARGET_FAMILIES))
@pytest.mark.parametrize("shape", [TREE, CHAIN, EXACT_TREE, dict(tree_depth=1, tree_top_k=1, tree_total_tokens=1)],
                         ids=["tree", "chain", "exact-tree", "one-token"])
def test_greedy_with_context_ngram_candidates_equals_plain_decoding(family, shape):
    target, draft = tiny_target(family), tiny_draft()
    for prompt in PROMPTS + NGRAM_PROMPTS:
        expected = _plain(target, prompt, max_new_tokens=24)
        assert torch.equal(_eagle(target, draft, prompt, max_new_tokens=24, ngram_candidates=True, **shape), expected)


def test_context_ngram_candidates_raise_acceptance_on_repetitive_text(llama_target, fitted_draft):
    lengths = {}
    for enabled in (False, True):
        accepted = []
        for prompt in NGRAM_PROMPTS:
            _eagle(llama_target, fitted_draft, prompt, max_new_tokens=40, ngram_candidates=enabled, **TREE)
            accepted.append(fitted_draft.generation_stats.mean_acceptance_length)
            if enabled:
                assert fitted_draft.generation_stats.continuation_tokens > 0
        lengths[enabled] = sum(accepted) / len(accepted)
    assert lengths[True] > lengths[False], lengths


def test_the_config_switches_context_ngram_candidates_and_a_call_overrides_it(llama_target, fitted_draft):
    fitted_draft.config.ngram_candidates = True
    _eagle(llama_target, fitted_draft, NGRAM_PROMPTS[1], max_new_tokens=30, **TREE)
    assert fitted_draft.generation_stats.continuation_tokens > 0
    _eagle(llama_target, fitted_draft, NGRAM_PROMPTS[1], max_new_tokens=30, ngram_candidates=False, **TREE)
    assert fitted_draft.generation_stats.continuation_tokens == 0


def test_float64_target_and_draft_decode_as_plain_greedy(llama_target, fitted_draft):
    target, draft = llama_target.double(), fitted_draft.double()
    for shape in (TREE, CHAIN):
        expected = target.generate(PROMPTS[1], max_new_tokens=20, do_sample=False)
        assert torch.equal(_eagle(target, draft, PROMPTS[1], max_new_tokens=20, tree_shape="fixed", **shape), expected)
