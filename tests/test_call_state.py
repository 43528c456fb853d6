"""A `generate` call changes no state beyond its own: the target's config is not swapped during a forward, the draft's
config is not rewritten, and each thread's statistics are its own and released with the thread."""

import copy
import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
from helpers import VOCAB, tiny_target

PROMPT = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(9))
EXACT_TREE = {"tree_depth": 4, "tree_top_k": 3, "tree_total_tokens": 12, "exact_attention": True}
GREEDY = {"do_sample": False, "max_new_tokens": 24}


def _in_threads(*work) -> None:
    """Run each of `work` in a thread of its own, all at once; a thread's exception is raised here."""
    start = threading.Barrier(len(work))

    def run(job):
        start.wait()
        job()

    with ThreadPoolExecutor(len(work)) as pool:  # its threads end when it closes
        futures = [pool.submit(run, job) for job in work]
    for future in futures:
        future.result()


def test_exact_attention_leaves_the_target_config_untouched(fitted_draft):
    target = tiny_target("llama")
    seen = []
    attention = target.model.layers[0].self_attn
    attention.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    out = target.generate(PROMPT, assistant_model=fitted_draft, **GREEDY, **EXACT_TREE)
    assert torch.equal(out, target.generate(PROMPT, **GREEDY))
    assert fitted_draft.generation_stats.num_cycles > 0 and set(seen) == {"sdpa"}


def test_threads_sharing_a_target_decode_with_exact_attention_and_plainly_at_once(llama_target, fitted_draft):
    batch = {"input_ids": torch.cat([torch.zeros(1, 5, dtype=torch.long), PROMPT], 1)}
    batch["attention_mask"] = (batch["input_ids"] != 0).long()  # left padding: plain decoding needs its mask
    expected_exact, expected_plain = llama_target.generate(PROMPT, **GREEDY), llama_target.generate(**batch, **GREEDY)
    exact_outputs, plain_outputs = [], []

    def exact():
        for _ in range(3):
            exact_outputs.append(llama_target.generate(PROMPT, assistant_model=fitted_draft, **GREEDY, **EXACT_TREE))

    def plain():
        for _ in range(6):
            plain_outputs.append(llama_target.generate(**batch, **GREEDY))

    _in_threads(exact, exact, plain)
    assert all(torch.equal(out, expected_exact) for out in exact_outputs) and len(exact_outputs) == 6
    assert all(torch.equal(out, expected_plain) for out in plain_outputs)
    assert llama_target.config._attn_implementation == "sdpa"


def test_threads_sharing_a_draft_do_not_leak_stats(llama_target, fitted_draft):
    main_stats = fitted_draft.generation_stats
    released, mismatched = [], []

    def decode():
        out = llama_target.generate(PROMPT, assistant_model=fitted_draft, return_dict_in_generate=True, **GREEDY)
        if fitted_draft.generation_stats is not out.eagle3_stats:
            mismatched.append(out)
        released.append(weakref.ref(out.eagle3_stats))

    _in_threads(*[decode] * 4)
    gc.collect()
    assert not mismatched and len(released) == 4
    assert all(ref() is None for ref in released)  # nothing holds a finished thread's statistics
    assert fitted_draft.generation_stats is main_stats  # this thread's own are untouched


def test_generate_leaves_the_drafts_config_untouched(llama_target, fitted_draft):
    draft = copy.deepcopy(fitted_draft)
    draft.config.target_layer_ids = None  # as an official EAGLE-3 checkpoint loads: taps from the target, per call
    before = draft.config.to_dict()
    out = llama_target.generate(PROMPT, assistant_model=draft, **GREEDY)
    assert torch.equal(out, llama_target.generate(PROMPT, **GREEDY)) and draft.generation_stats.num_cycles > 0
    assert draft.config.to_dict() == before  # neither the taps nor the target's special tokens were written
