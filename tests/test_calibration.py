"""`tree_shape="auto"`: costs measured on this machine and cached per target, draft, dtype, thread count and batch
size; the predicted-fastest shape used by `generate`, or plain decoding (the draft not run) when no shape pays."""

import copy
import json

import pytest
import torch
from helpers import VOCAB, fit_draft, tiny_draft, tiny_target
from huggingface_hub.errors import StrictDataclassClassValidationError

from hf_eagle3 import Eagle3Config
from hf_eagle3.decoding.calibration import MIN_PREDICTED_SPEEDUP, calibrate, choose_tree, machine_description
from hf_eagle3.training.profile import acceptance_profile

PROMPT = torch.tensor([[5, 17, 33, 2, 61, 8]])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path))
    return tmp_path / "calibration"


@pytest.fixture(scope="module")
def profile():
    """The acceptance profile of `fitted_draft` on `llama_target` (measured once for the module)."""
    target = tiny_target("llama")
    draft = fit_draft(tiny_draft(draft_vocab_size=VOCAB), target)
    prompts = [torch.randint(1, 90, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return acceptance_profile(target, draft, prompts, top_ks=[1, 3], max_depth=3, max_total=8, max_new_tokens=16,
                              progress=False)


@pytest.fixture
def auto_draft(fitted_draft, profile):
    fitted_draft.config.acceptance_profile, fitted_draft.config.tree_shape = profile, "auto"
    return fitted_draft


def _rewrite_costs(path, **changes):
    """Edit a cached calibration file in place, as if this machine had measured other costs."""
    record = json.loads(path.read_text())
    for name, change in changes.items():
        record["costs"][name] = change(record["costs"][name])
    path.write_text(json.dumps(record))


def test_calibration_is_measured_once_then_read_from_the_cache(cache, llama_target, auto_draft):
    costs, path = calibrate(llama_target, auto_draft)
    assert path.parent == cache and path.is_file() and costs.machine == machine_description()
    written = path.stat().st_mtime_ns
    again, same_path = calibrate(llama_target, auto_draft)
    assert same_path == path and again == costs and path.stat().st_mtime_ns == written
    assert {(row["tree_depth"], row["tree_top_k"]) for row in auto_draft.config.acceptance_profile} == set(costs.draft)


def test_calibration_is_not_reused_for_another_dtype_thread_count_or_draft(cache, llama_target, auto_draft):
    _, path = calibrate(llama_target, auto_draft)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        _, other_threads = calibrate(llama_target, auto_draft)
    finally:
        torch.set_num_threads(threads)
    bf16_target = copy.deepcopy(llama_target).to(torch.bfloat16)
    bf16_draft = copy.deepcopy(auto_draft).to(torch.bfloat16)
    _, other_dtype = calibrate(bf16_target, bf16_draft)
    other_draft = fit_draft(tiny_draft(seed=1, draft_vocab_size=auto_draft.config.draft_vocab_size), llama_target,
                            steps=5)
    other_draft.config.acceptance_profile, other_draft.config.tree_shape = auto_draft.config.acceptance_profile, "auto"
    _, another_draft = calibrate(llama_target, other_draft)
    assert len({path, other_threads, other_dtype, another_draft}) == 4
    assert len(list(cache.glob("*.json"))) == 4


def test_auto_decodes_plainly_and_says_so_when_every_shape_loses(cache, llama_target, auto_draft, caplog):
    _, path = calibrate(llama_target, auto_draft)
    _rewrite_costs(path, verify=lambda verify: {n: 50 * seconds for n, seconds in verify.items()})
    choice = choose_tree(llama_target, auto_draft)
    assert choice.settings is None and "decodes plainly" in choice.reason

    expected = llama_target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    for _ in range(2):
        output = llama_target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=auto_draft)
        assert torch.equal(output, expected)
    stats = auto_draft.generation_stats
    assert stats.settings is None and stats.num_cycles == 0 and stats.shape_choice == choice.reason
    assert [record.message for record in caplog.records] == [choice.reason]  # said once, with the measured reason


def test_auto_decodes_with_the_predicted_fastest_shape(cache, llama_target, auto_draft):
    _, path = calibrate(llama_target, auto_draft)
    # A machine where verifying any number of tokens costs the same, and little: the tree of the highest τ is fastest
    _rewrite_costs(path, verify=lambda verify: {n: 1e-4 for n in verify},
                   draft=lambda draft: [[depth, top_k, 0.0] for depth, top_k, _ in draft], other=lambda other: 0.0)
    choice = choose_tree(llama_target, auto_draft)
    assert choice.predicted_speedup >= MIN_PREDICTED_SPEEDUP
    assert choice.settings == choice.predictions[0].settings
    assert choice.predictions[0].tau == max(row["tau"] for row in auto_draft.config.acceptance_profile)
    expected = llama_target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    output = llama_target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=auto_draft)
    assert torch.equal(output, expected)
    assert auto_draft.generation_stats.settings == choice.settings and auto_draft.generation_stats.num_cycles > 0


def test_tree_settings_of_a_call_override_auto(cache, llama_target, auto_draft):
    llama_target.generate(PROMPT, max_new_tokens=8, do_sample=False, assistant_model=auto_draft, tree_top_k=1)
    assert auto_draft.generation_stats.settings.top_k == 1 and not cache.exists()  # nothing calibrated
    with pytest.raises(ValueError, match="drop tree_depth"):
        llama_target.generate(PROMPT, max_new_tokens=8, assistant_model=auto_draft, tree_shape="auto", tree_depth=2)
    with pytest.raises(ValueError, match="'fixed' or 'auto'"):
        llama_target.generate(PROMPT, max_new_tokens=8, assistant_model=auto_draft, tree_shape="fastest")


def test_auto_needs_an_acceptance_profile(cache, llama_target, fitted_draft):
    with pytest.raises(StrictDataclassClassValidationError, match="acceptance_profile"):
        Eagle3Config(tree_shape="auto")
    with pytest.raises(ValueError, match="tune-tree"):
        llama_target.generate(PROMPT, max_new_tokens=8, assistant_model=fitted_draft, tree_shape="auto")


def test_auto_reads_the_profile_rows_of_the_calls_ngram_setting(cache, llama_target, auto_draft):
    free_costs = dict(verify=lambda verify: {n: 1e-4 for n in verify},
                      draft=lambda draft: [[depth, top_k, 0.0] for depth, top_k, _ in draft], other=lambda other: 0.0)
    assert all(row["ngram_candidates"] for row in auto_draft.config.acceptance_profile)  # the draft's default
    with pytest.raises(ValueError, match="tune-tree --no-ngram-candidates"):
        llama_target.generate(PROMPT, max_new_tokens=4, assistant_model=auto_draft, ngram_candidates=False)
    # Rows without the candidates stand in for shapes the candidates' rows lack (a lower bound), and lose to them
    draft_only = [{name: value for name, value in row.items() if name != "ngram_candidates"}
                  for row in auto_draft.config.acceptance_profile]
    smallest = min(draft_only, key=lambda row: row["tree_total_tokens"])
    auto_draft.config.acceptance_profile = draft_only + [smallest | {"tau": 50.0, "ngram_candidates": True}]
    _, path = calibrate(llama_target, auto_draft)
    _rewrite_costs(path, **free_costs)
    choice = choose_tree(llama_target, auto_draft)
    assert (choice.settings.depth, choice.settings.top_k, choice.settings.total_tokens) == (
        smallest["tree_depth"], smallest["tree_top_k"], smallest["tree_total_tokens"])
    assert len(choice.predictions) == len(draft_only)
    assert choose_tree(llama_target, auto_draft, ngram_candidates=False).predictions[0].tau < 50.0


def test_a_batch_is_calibrated_at_its_size_and_decoded_with_its_own_choice(cache, llama_target, auto_draft):
    _, single = calibrate(llama_target, auto_draft)
    costs, batched = calibrate(llama_target, auto_draft, batch_size=4)
    assert batched != single and json.loads(batched.read_text())["key"]["batch_size"] == 4
    assert set(costs.verify) == set(calibrate(llama_target, auto_draft)[0].verify)  # the same sizes, at 4 rows
    # generate at batch size 4 reads the batch's calibration: here one where every tree pays
    _rewrite_costs(batched, verify=lambda verify: {n: 1e-4 for n in verify},
                   draft=lambda draft: [[depth, top_k, 0.0] for depth, top_k, _ in draft], other=lambda other: 0.0)
    choice = choose_tree(llama_target, auto_draft, batch_size=4)
    batch = torch.randint(1, 90, (4, 6), generator=torch.Generator().manual_seed(4))
    kwargs = dict(attention_mask=torch.ones_like(batch), max_new_tokens=16, do_sample=False)
    output = llama_target.generate(batch, assistant_model=auto_draft, return_dict_in_generate=True, **kwargs)
    assert torch.equal(output.sequences, llama_target.generate(batch, **kwargs))
    assert output.eagle3_stats.settings == choice.settings and "predicted" in output.eagle3_stats.shape_choice
