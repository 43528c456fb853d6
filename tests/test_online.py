"""The calibration checked against the call itself (`online.OnlineCheck`): a shape slower than plain decoding is
dropped within the call, after a bounded number of cycles, and cached costs that proved wrong are measured again.
Cycle times are injected, never measured."""

import copy

import pytest
import torch
from test_calibration import PROMPT, Measure, auto_draft, cache, profile  # noqa: F401  (fixtures)

from hf_eagle3.decoding.calibration import calibrate, choose_tree
from hf_eagle3.decoding.online import Decision, OnlineCheck


def test_a_shape_slower_than_plain_decoding_is_dropped_after_the_minimum_cycles():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020, min_cycles=8)  # plain: 100 tokens/s
    decisions = [check.observe(0.020, 1.5) for _ in range(12)]  # 75 tokens/s
    assert decisions[:8] == [Decision.KEEP] * 8  # the first cycle (kernel selection) is not counted: 8 more decide
    assert decisions[8:] == [Decision.PLAIN] * 4 and check.speedup == pytest.approx(0.75)
    assert not check.costs_disproved  # the cycles cost what was predicted: only τ was lower than the profile's


def test_a_shape_faster_than_plain_decoding_is_kept():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020)
    assert all(check.observe(0.020, 3.0) is Decision.KEEP for _ in range(100))
    assert check.cycles == 100
    assert check.speedup == pytest.approx(1.5)


def test_the_first_cycle_and_a_noise_margin_do_not_decide():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020, margin=0.10)
    check.observe(10.0, 1.0)  # a first cycle paying for kernel selection is not counted
    assert all(check.observe(0.020, 1.9) is Decision.KEEP for _ in range(20))  # 0.95x plain: within the margin
    assert check.cycles == 21 and check.seconds == pytest.approx(0.4)


def test_cycles_slower_than_predicted_disprove_the_cached_costs():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020)
    while check.observe(0.050, 2.0) is Decision.KEEP:
        pass
    assert check.cycles == 9 and check.costs_disproved


def test_generate_goes_on_plainly_when_the_chosen_shape_is_slower_here(cache, llama_target, auto_draft):  # noqa: F811
    # A record claiming plain decoding takes 0.1 ms a token: every tree is predicted to pay, none does for real
    _, path = calibrate(llama_target, auto_draft, measure=Measure(plain_step=1e-4, verify=5e-5))
    choice = choose_tree(llama_target, auto_draft)
    assert choice.settings is not None
    draft = copy.deepcopy(auto_draft)
    expected = llama_target.generate(PROMPT, max_new_tokens=48, do_sample=False)
    output = llama_target.generate(PROMPT, max_new_tokens=48, do_sample=False, assistant_model=draft,
                                   return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    stats = output.eagle3_stats
    assert "went on plainly" in stats.shape_choice and stats.settings == choice.settings
    plain_cycles = stats.acceptance_lengths[9:]
    assert plain_cycles and set(plain_cycles) == {1}  # after 9 cycles, one token per target forward
    assert not path.exists()  # the cycles cost far more than recorded: measured again by the next call
