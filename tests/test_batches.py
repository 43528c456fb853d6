"""EAGLE-3 over left-padded batches: every row equals plain batched decoding, rows stop where plain decoding stops
them, sampling keeps each row's distribution, threads keep their own statistics, and the custom_generate entry
points decode as assistant_model does."""

import shutil
import threading
from pathlib import Path

import pytest
import torch
from helpers import (
    SAMPLES,
    SAMPLING_VOCAB,
    SETTINGS,
    SLIDING_TARGETS,
    TARGET_FAMILIES,
    VOCAB,
    chi_square_p_value,
    exact_joint,
    fit_draft,
    sliding_target,
    tiny_draft,
    tiny_target,
)
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from hf_eagle3.generation import Eagle3GenerateOutput, eagle3_generate
from hf_eagle3.utils.transformers_api import output_cache

PAD = 0
LENGTHS = (3, 9, 17, 5, 12, 1, 7, 14)  # prompt lengths of rows 0..7
TREE = dict(tree_depth=4, tree_top_k=3, tree_total_tokens=12)
CHAIN = dict(tree_depth=4, tree_top_k=1)


def left_padded(lengths, seed: int = 0) -> dict:
    """A batch as a left-padding tokenizer builds it: `input_ids` and `attention_mask`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def _plain(target, batch, **kwargs):
    return target.generate(**batch, do_sample=False, pad_token_id=PAD, **kwargs)


def _eagle(target, draft, batch, **kwargs):
    return target.generate(**batch, do_sample=False, pad_token_id=PAD, assistant_model=draft, **kwargs)


@pytest.fixture(params=sorted(TARGET_FAMILIES))
def family_target_and_draft(request):
    target = tiny_target(request.param)
    return request.param, target, fit_draft(tiny_draft(draft_vocab_size=VOCAB), target)


@pytest.mark.parametrize("batch_size", [1, 2, 4, 8])
def test_batched_greedy_equals_plain_batched_greedy_row_for_row(family_target_and_draft, batch_size):
    family, target, draft = family_target_and_draft
    batch = left_padded(LENGTHS[:batch_size], seed=batch_size)
    lengths = []
    for shape in (TREE, CHAIN):
        expected = _plain(target, batch, max_new_tokens=30)
        out = _eagle(target, draft, batch, max_new_tokens=30, return_dict_in_generate=True, **shape)
        assert torch.equal(out.sequences, expected), (family, shape)
        stats = out.eagle3_stats
        assert len(stats.rows) == batch_size and all(row.acceptance_lengths for row in stats.rows)
        for row in stats.rows:  # the prefill emits each row's first token, its cycles the other 29
            assert 1 + sum(row.acceptance_lengths) == 30
        lengths += stats.acceptance_lengths
    assert sum(lengths) > len(lengths)  # drafted tokens were accepted


def test_a_random_draft_is_lossless_on_batches_of_every_family():
    for family in sorted(TARGET_FAMILIES):
        target, draft = tiny_target(family), tiny_draft()
        batch = left_padded(LENGTHS[:4], seed=7)
        assert torch.equal(_eagle(target, draft, batch, max_new_tokens=20, **TREE),
                           _plain(target, batch, max_new_tokens=20)), family


@pytest.mark.parametrize("family", sorted(SLIDING_TARGETS))
def test_sliding_window_targets_are_lossless_on_batches(family):
    # a window of 5 over rows whose cache entries are interleaved with hidden ones: the window counts positions
    target = sliding_target(family)
    draft = fit_draft(tiny_draft(draft_vocab_size=VOCAB), target)
    batch = left_padded(LENGTHS[:4], seed=6)
    expected = _plain(target, batch, max_new_tokens=24)
    out = _eagle(target, draft, batch, max_new_tokens=24, return_dict_in_generate=True, **TREE)
    assert torch.equal(out.sequences, expected)
    lengths = out.eagle3_stats.acceptance_lengths
    assert sum(lengths) > len(lengths)  # rows accepted different numbers of tokens: hidden entries were made


def test_rows_stopping_at_eos_at_different_steps_are_padded_as_plain_decoding_pads_them(llama_target, fitted_draft):
    batch = left_padded(LENGTHS[:4], seed=3)
    continuations = _plain(llama_target, batch, max_new_tokens=30)[:, batch["input_ids"].shape[1] :]
    for eos in ([int(continuations[0, 9])], [int(continuations[1, 4]), int(continuations[2, 17])]):
        expected = _plain(llama_target, batch, max_new_tokens=30, eos_token_id=eos)
        out = _eagle(llama_target, fitted_draft, batch, max_new_tokens=30, eos_token_id=eos, **TREE)
        assert torch.equal(out, expected)
        assert (out[:, -1] == PAD).any()  # some row stopped early and was padded


def _character_tokenizer() -> PreTrainedTokenizerFast:
    """One printable ASCII character per token id of the tiny targets, so that stop strings can be matched."""
    backend = Tokenizer(models.BPE({chr(32 + i): i for i in range(VOCAB)}, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=" ")


@pytest.mark.parametrize("with_eos", [False, True], ids=["stop-strings", "stop-strings-and-eos"])
def test_rows_stopping_at_stop_strings_at_different_steps_match_plain_decoding(llama_target, fitted_draft, with_eos):
    # Without an EOS criterion plain decoding does not pad a row that stopped: it goes on decoding it until the last
    # row stops; with one it pads it.
    tokenizer = _character_tokenizer()
    batch = left_padded(LENGTHS[:4], seed=5)
    continuations = _plain(llama_target, batch, max_new_tokens=30)[:, batch["input_ids"].shape[1] :]
    text = tokenizer.batch_decode(continuations)
    stops = [text[0][5:7], text[1][9:11], text[2][3:5], text[3][14:16]]  # each row stops, at different steps
    kwargs = dict(max_new_tokens=30, stop_strings=stops, tokenizer=tokenizer)
    if with_eos:
        kwargs["eos_token_id"] = int(continuations[2, 11])
    expected = _plain(llama_target, batch, **kwargs)
    assert expected.shape[1] < batch["input_ids"].shape[1] + 30  # the stops were reached
    for shape in (TREE, CHAIN):
        assert torch.equal(_eagle(llama_target, fitted_draft, batch, **kwargs, **shape), expected)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_is_exact_for_every_row(llama_target, fitted_draft, max_new_tokens):
    batch = left_padded(LENGTHS[:4], seed=2)
    out = _eagle(llama_target, fitted_draft, batch, max_new_tokens=max_new_tokens, **TREE)
    assert out.shape[1] == batch["input_ids"].shape[1] + max_new_tokens
    assert torch.equal(out, _plain(llama_target, batch, max_new_tokens=max_new_tokens))


def test_logits_processors_and_context_candidates_on_batches(llama_target, fitted_draft):
    batch = left_padded(LENGTHS[:4], seed=4)
    batch = {name: torch.cat([value, value[:, -6:]], dim=1) for name, value in batch.items()}  # repeats: n-grams
    kwargs = dict(max_new_tokens=25, repetition_penalty=1.3)
    expected = _plain(llama_target, batch, **kwargs)
    out = _eagle(llama_target, fitted_draft, batch, ngram_candidates=True, return_dict_in_generate=True, **kwargs,
                 **TREE)
    assert torch.equal(out.sequences, expected)


REPEATS = 20  # copies of each prompt per batch


@pytest.mark.parametrize("shape", [dict(tree_depth=3, tree_top_k=3, tree_total_tokens=8),
                                   dict(tree_depth=3, tree_top_k=1)], ids=["tree", "sampled-chain"])
def test_sampling_keeps_every_rows_exact_distribution(sampling_target, sampling_draft, shape):
    """Two prompts of different lengths (one left-padded), each repeated `REPEATS` times in one batch."""
    target, draft = sampling_target, sampling_draft
    prompts = [torch.tensor([5, 17, 3, 9]), torch.tensor([11, 2])]
    batch = dict(input_ids=torch.tensor([[5, 17, 3, 9], [PAD, PAD, 11, 2]] * REPEATS),
                 attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]] * REPEATS))
    settings = SETTINGS["top-k-20"]
    torch.manual_seed(3)
    counts = torch.zeros(2, SAMPLING_VOCAB, SAMPLING_VOCAB, SAMPLING_VOCAB)
    accepted = 0
    for _ in range(SAMPLES // REPEATS):
        out = target.generate(**batch, do_sample=True, max_new_tokens=3, top_k=settings["top_k"],
                              temperature=settings["temperature"], pad_token_id=PAD, assistant_model=draft, **shape)
        for row, sequence in enumerate(out[:, 4:].tolist()):
            counts[(row % 2, *sequence)] += 1
        accepted += sum(length - 1 for length in draft.generation_stats.acceptance_lengths)
    for row, prompt in enumerate(prompts):
        assert chi_square_p_value(counts[row], exact_joint(target, settings, prompt[None])) > 1e-3, row
    assert accepted > 0  # drafted tokens were accepted: the acceptance rule, not only the bonus token, was sampled


def test_exact_attention_refuses_a_batch(llama_target, fitted_draft):
    batch = dict(input_ids=torch.randint(1, VOCAB, (2, 5)), attention_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="one sequence per call"):
        _eagle(llama_target, fitted_draft, batch, max_new_tokens=5, exact_attention=True)


def test_scores_of_a_batch_are_refused(llama_target, fitted_draft):
    batch = left_padded(LENGTHS[:2])
    with pytest.raises(ValueError, match="output_scores"):
        _eagle(llama_target, fitted_draft, batch, max_new_tokens=5, return_dict_in_generate=True, output_scores=True)


def test_stats_come_back_in_the_output(llama_target, fitted_draft):
    batch = left_padded(LENGTHS[:2])
    out = _eagle(llama_target, fitted_draft, batch, max_new_tokens=20, return_dict_in_generate=True, **TREE)
    assert isinstance(out, Eagle3GenerateOutput) and out.eagle3_stats is fitted_draft.generation_stats
    stats = out.eagle3_stats
    assert stats.settings.total_tokens == 12 and stats.num_cycles >= max(len(r.acceptance_lengths) for r in stats.rows)
    assert min(stats.prefill_seconds, stats.draft_seconds, stats.verify_seconds) > 0
    assert stats.total_seconds >= stats.prefill_seconds + stats.draft_seconds + stats.verify_seconds
    assert output_cache(out) is None  # a batch's cache holds rows that left and hidden entries


def test_two_threads_each_get_correct_outputs_and_their_own_stats(llama_target, fitted_draft):
    shapes = [TREE, dict(tree_depth=2, tree_top_k=2, tree_total_tokens=3)]
    drafts = [fitted_draft, fit_draft(tiny_draft(draft_vocab_size=VOCAB), llama_target, steps=60)]
    batches = [left_padded(LENGTHS[:2], seed=11), left_padded(LENGTHS[2:5], seed=12)]
    expected = [_plain(llama_target, batch, max_new_tokens=24) for batch in batches]
    results, errors = [[], []], []
    start = threading.Barrier(2)  # both threads decode at the same time

    def decode(index: int, draft):
        try:
            start.wait()
            for _ in range(3):
                out = _eagle(llama_target, draft, batches[index], max_new_tokens=24, return_dict_in_generate=True,
                             **shapes[index])
                results[index].append((out, draft.generation_stats))
        except Exception as error:  # reported in the main thread
            errors.append(error)

    # two threads with one draft each, then two threads sharing one draft
    for pair in ([drafts[0], drafts[1]], [drafts[1], drafts[1]]):
        results = [[], []]
        threads = [threading.Thread(target=decode, args=(index, draft)) for index, draft in enumerate(pair)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        for index in range(2):
            for out, thread_stats in results[index]:
                assert torch.equal(out.sequences, expected[index])
                assert thread_stats is out.eagle3_stats  # the thread's own call, not the other thread's
                assert thread_stats.settings.total_tokens == shapes[index]["tree_total_tokens"]
                assert len(thread_stats.rows) == batches[index]["input_ids"].shape[0]
                assert all(1 + sum(row.acceptance_lengths) == 24 for row in thread_stats.rows)


def test_custom_generate_callable_equals_assistant_model(llama_target, fitted_draft):
    batch = left_padded(LENGTHS[:3], seed=9)
    for shape in (TREE, CHAIN):
        expected = _eagle(llama_target, fitted_draft, batch, max_new_tokens=25, **shape)
        out = llama_target.generate(**batch, do_sample=False, pad_token_id=PAD, max_new_tokens=25,
                                    custom_generate=eagle3_generate, draft=fitted_draft, **shape)
        assert torch.equal(out, expected) and torch.equal(out, _plain(llama_target, batch, max_new_tokens=25))


def test_custom_generate_callable_needs_the_draft(llama_target):
    with pytest.raises(TypeError, match="draft=<Eagle3DraftModel>"):
        llama_target.generate(torch.tensor([[3, 4]]), max_new_tokens=3, custom_generate=eagle3_generate)


CUSTOM_GENERATE = Path(__file__).parents[1] / "hf_eagle3" / "assets" / "smollm2-eagle3" / "custom_generate"


def test_custom_generate_directory_of_a_draft_repository_equals_assistant_model(llama_target, fitted_draft,
                                                                                 tmp_path):
    repository = tmp_path / "draft-repo"
    fitted_draft.save_pretrained(repository)
    shutil.copytree(CUSTOM_GENERATE, repository / "custom_generate")
    batch = left_padded(LENGTHS[:2], seed=10)
    expected = _eagle(llama_target, fitted_draft, batch, max_new_tokens=20, **TREE)
    out = llama_target.generate(**batch, do_sample=False, pad_token_id=PAD, max_new_tokens=20,
                                custom_generate=str(repository), trust_remote_code=True, assistant_model=fitted_draft,
                                **TREE)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="trust_remote_code"):
        llama_target.generate(**batch, max_new_tokens=2, custom_generate=str(repository), assistant_model=fitted_draft)
    # no requirements.txt: transformers would check it on every trust_remote_code load of the draft, too
    assert not (repository / "custom_generate" / "requirements.txt").exists()


@pytest.mark.slow
def test_smollm2_batched_greedy_equals_plain_batched_greedy():
    from hf_eagle3.commands.bench_batches import chat_batch
    from hf_eagle3.resources.loading import load_draft, prompt_texts
    from hf_eagle3.resources.smollm2 import load_smollm2

    target, tokenizer = load_smollm2(dtype=torch.float32)
    draft = load_draft("shipped", torch.float32)
    texts = prompt_texts("mt-bench")[:2] + prompt_texts("humaneval")[:2] + ["Say hi.", "Name three colours."]
    batch = chat_batch(tokenizer, texts)  # mixed lengths, left-padded; the short answers stop at EOS early
    kwargs = dict(max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = target.generate(**batch, **kwargs)
    for shape in (dict(tree_shape="fixed"), dict(tree_top_k=1)):
        out = target.generate(**batch, **kwargs, assistant_model=draft, return_dict_in_generate=True, **shape)
        assert torch.equal(out.sequences, expected)
        assert out.eagle3_stats.mean_acceptance_length > 1.5


def test_throughput_counts_each_rows_tokens_up_to_its_end():
    from hf_eagle3.commands.bench_batches import generated_tokens

    sequences = torch.tensor([[7, 7, 1, 2, 3, 4], [0, 7, 1, 9, 0, 0], [0, 7, 9, 0, 0, 0]])  # prompt width 2; EOS 9
    assert generated_tokens(sequences, 2, {9}) == 4 + 2 + 1


def test_bench_batches_shows_a_call_that_decoded_plainly_as_plain_not_as_a_speedup():
    from hf_eagle3.commands.bench_batches import markdown_table

    plain_call = {"speedup": 1.01, "tree": "plain", "tau": None, "identical_rows": 2, "shape_choice": "no tree pays"}
    table = markdown_table([{"batch_size": 2, "generated_tokens": 40, "plain_tokens_per_second": 20.0,
                             "eagle3_tokens_per_second": 20.2, "eagle3": plain_call}])
    assert ("| 2 | EAGLE-3, tree_shape='auto' | 20.2 | plain decoding (no speedup to measure) | plain | n/a | n/a "
            "| 2/2 |") in table and "1.01x" not in table


def test_bench_batches_gives_each_tree_calls_draft_and_verification_milliseconds_per_cycle():
    from hf_eagle3.commands.bench_batches import markdown_table, milliseconds_per_cycle
    from hf_eagle3.decoding.drafter import TreeSettings
    from hf_eagle3.decoding.stats import Eagle3GenerationStats

    stats = Eagle3GenerationStats(TreeSettings(6, 8, 60), num_cycles=4, draft_seconds=0.4, verify_seconds=1.0)
    split = milliseconds_per_cycle(stats)
    assert split == pytest.approx({"draft": 100.0, "verify": 250.0})
    assert milliseconds_per_cycle(Eagle3GenerationStats(None)) == {"draft": None, "verify": None}
    fixed = {"speedup": 0.5, "tree": "depth 6, top-k 8, 60 tokens", "tau": 2.5, "identical_rows": 4,
             "shape_choice": None, "draft_ms_per_cycle": 100.0, "verify_ms_per_cycle": 250.0}
    table = markdown_table([{"batch_size": 4, "generated_tokens": 40, "plain_tokens_per_second": 20.0,
                             "fixed_tokens_per_second": 10.0, "fixed": fixed}])
    assert "| 4 | EAGLE-3, fixed tree | 10.0 | 0.50x | depth 6, top-k 8, 60 tokens | 2.50 | 100.0 / 250.0 | 4/4 |" \
        in table
