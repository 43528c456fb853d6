"""Integration on the real embedded target, SmolLM2-135M-Instruct (float32, offline).

`HF_EAGLE3_FULL_CHECK=1` runs the full losslessness check of the issue (60 prompts: 30 MT-bench first turns and 30
HumanEval prompts, 128 new tokens, tree and chain); the default CI run takes 6 prompts and 48 new tokens (the random
draft, which rejects at every cycle, the first prompt of each set).
"""

import os

import pytest
import torch

from hf_eagle3 import Eagle3Config, Eagle3DraftModel
from hf_eagle3.resources.loading import SHIPPED_DRAFT, load_draft
from hf_eagle3.resources.prompts import chat_input_ids, humaneval_prompts, mt_bench_first_turns
from hf_eagle3.resources.smollm2 import load_smollm2
from hf_eagle3.training.features import target_forward
from hf_eagle3.training.ttt import TrainingTimeTest

pytestmark = pytest.mark.slow
FULL = os.environ.get("HF_EAGLE3_FULL_CHECK") == "1"
PROMPTS_PER_SET, NEW_TOKENS = (30, 128) if FULL else (3, 48)


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2(dtype=torch.float32)


def _random_draft(target) -> Eagle3DraftModel:
    torch.manual_seed(0)
    text = target.config
    config = Eagle3Config(
        vocab_size=text.vocab_size,
        draft_vocab_size=8192,
        hidden_size=text.hidden_size,
        intermediate_size=1536,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        target_num_hidden_layers=text.num_hidden_layers,
        tree_total_tokens=24,  # a random draft accepts nothing: keep its float32 verification affordable
    )
    return Eagle3DraftModel(config).eval()


def _drafts(target) -> dict[str, Eagle3DraftModel]:
    drafts = {"random": _random_draft(target)}
    if (SHIPPED_DRAFT / "model.safetensors").exists():
        drafts["shipped"] = load_draft("shipped", torch.float32)
    return drafts


def test_embedded_target_loads_offline_and_chats(smollm2):
    target, tokenizer = smollm2
    input_ids = chat_input_ids(tokenizer, "What is the capital of France?")
    output = target.generate(input_ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.timeout(3600)
def test_greedy_eagle3_equals_plain_generate_on_mt_bench_and_humaneval(smollm2):
    target, tokenizer = smollm2
    prompts = mt_bench_first_turns()[:PROMPTS_PER_SET] + humaneval_prompts()[:PROMPTS_PER_SET]
    drafts = _drafts(target)
    mismatches = []
    for index, prompt in enumerate(prompts):
        input_ids = chat_input_ids(tokenizer, prompt)
        expected = target.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        for name, draft in drafts.items():
            if name == "random" and index % PROMPTS_PER_SET and not FULL:  # it rejects at every cycle: a prompt a set
                continue
            for shape, kwargs in {"tree": {"tree_shape": "fixed"}, "chain": {"tree_top_k": 1}}.items():
                output = target.generate(
                    input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft, **kwargs
                )
                if not torch.equal(output, expected):
                    mismatches.append((index, name, shape))
    assert not mismatches


def _row_dependent_linear_layers(model, rows: list[int]) -> list[str]:
    """The model's linear layers whose output for one row changes with the number of rows in the matrix product
    (on some CPUs bf16 GEMM kernels differ by shape: exact attention cannot make those layers exact)."""
    generator = torch.Generator().manual_seed(0)
    dependent = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(("q_proj", "gate_proj", "down_proj", "lm_head")):
            x = torch.randn(max(rows), module.in_features, generator=generator).to(module.weight.dtype)
            alone = module(x[:1])
            if not all(torch.equal(module(x[:m])[:1], alone) for m in rows):
                dependent.append(name)
    return dependent


def test_exact_attention_makes_bfloat16_greedy_decoding_bit_identical():
    """bf16, where the default one-forward verification parts from plain decoding on near-ties: on these prompts it
    does within 10-29 tokens on our CPUs; with `exact_attention=True` every token is plain decoding's, wherever the
    CPU's bf16 matrix products give a row the same result whatever the number of rows (the Xeons with AMX; not the
    Ice Lake Xeon without AMX, whose bf16 lm_head product depends on it)."""
    target, tokenizer = load_smollm2(dtype=torch.bfloat16)
    draft = load_draft("shipped", torch.bfloat16)
    dependent = _row_dependent_linear_layers(target, [2, 3, 5, 9, 13])
    if dependent:
        pytest.skip(f"bf16 matrix products on this CPU depend on the number of rows ({', '.join(dependent[:3])}, ...): "
                    "no verification of several tokens in one forward can be bit-identical to plain decoding here")
    for prompt in [mt_bench_first_turns()[2], mt_bench_first_turns()[5], humaneval_prompts()[0]]:
        input_ids = chat_input_ids(tokenizer, prompt)
        expected = target.generate(input_ids, max_new_tokens=48, do_sample=False)
        output = target.generate(
            input_ids, max_new_tokens=48, do_sample=False, assistant_model=draft, exact_attention=True,
            tree_shape="fixed",
        )
        assert torch.equal(output, expected)
        assert draft.generation_stats.mean_acceptance_length > 1.5


def test_training_time_test_predicts_real_decoding(smollm2):
    """The trainer's unrolled steps are what decoding computes: replaying a chain-decoded answer through
    `TrainingTimeTest.unroll` (one full target forward) predicts the acceptance length of every decoding cycle."""
    target, tokenizer = smollm2
    draft = load_draft("shipped", torch.float32)
    input_ids, steps = chat_input_ids(tokenizer, mt_bench_first_turns()[0]), 5
    output = target.generate(input_ids, max_new_tokens=48, do_sample=False, assistant_model=draft,
                             tree_top_k=1, tree_depth=steps, tree_total_tokens=steps)
    with torch.no_grad():
        features, _ = target_forward(target, output, draft.config.target_layer_ids)
        # predictions[s][i]: the draft's guess for token i + s + 2 at row i, step s
        predictions = [draft.draft_to_target[draft.compute_logits(feature)[0].argmax(-1)]
                       for feature in TrainingTimeTest(draft, steps).unroll(output, features)]
    length, row, predicted = output.shape[1], input_ids.shape[1] - 1, []
    while row + 2 < length:  # a cycle whose root is token row + 1
        accepted = 0
        while (accepted < steps and row + accepted + 2 < length
               and predictions[accepted][row] == output[0, row + accepted + 2]):
            accepted += 1
        predicted.append(accepted + 1)
        row += accepted + 1
    actual = draft.generation_stats.acceptance_lengths[:-1]  # the last cycle was cut by max_new_tokens
    assert max(actual) > 1
    # float32 features from one forward vs from the verification forwards: at most a rare near-tie may differ
    assert sum(a != p for a, p in zip(actual, predicted)) <= 1 and len(predicted) >= len(actual)
