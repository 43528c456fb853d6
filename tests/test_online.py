"""The calibration checked against the call itself (`online.OnlineCheck`): a shape slower than plain decoding is
dropped within the call, after a bounded number of cycles, and tried again later in it; cached costs that proved wrong
are corrected toward the call's own, so that the next call measures nothing. Cycle times are injected, never
measured."""

import copy
import json
from dataclasses import replace

import pytest
import torch
from test_calibration import PROMPT, Measure, auto_draft, cache, profile  # noqa: F401  (fixtures)

from hf_eagle3.decoding import loop
from hf_eagle3.decoding.calibration import (
    MachineCosts,
    TreeChoice,
    calibrate,
    choose_tree,
    correct_calibration,
    predict,
)
from hf_eagle3.decoding.drafter import TreeSettings
from hf_eagle3.decoding.online import Decision, OnlineCheck


def cycle(seconds: float) -> dict[str, float]:
    """A cycle of `seconds`: a tenth drafting, eight tenths verifying, a tenth the rest."""
    return {"draft": 0.1 * seconds, "verify": 0.8 * seconds, "other": 0.1 * seconds}


def plain_cycle(step: float) -> dict[str, float]:
    """A trial's plain cycle whose step (verification and the rest) takes `step`, plus keeping the paused draft
    current."""
    return {"draft": 0.2 * step, "verify": 0.9 * step, "other": 0.1 * step}


def test_a_shape_slower_than_plain_decoding_is_dropped_after_a_trial_of_plain_decoding():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020, min_cycles=8)  # plain: 100 tokens/s
    decisions = [check.observe(cycle(0.020), 1.5) for _ in range(9)]  # 75 tokens/s
    assert decisions[:8] == [Decision.KEEP] * 8  # the first cycle (kernel selection) is not counted: 8 more decide
    assert decisions[8] is Decision.TRIAL and check.speedup == pytest.approx(0.75)
    # the trial: 9 plain cycles, the first not counted, at the calibrated step (the draft's upkeep not counted)
    trial = [check.observe(plain_cycle(0.010), 1.0) for _ in range(9)]
    assert trial == [Decision.TRIAL] * 8 + [Decision.PLAIN] and not check.settled
    assert check.measured_plain_step == pytest.approx(0.010) and check.measured_speedup == pytest.approx(0.75)
    assert not check.costs_disproved  # the cycles cost what was predicted: only τ was lower than the profile's
    # plainly for `retry_after` tokens, then the tree again
    plainly = [check.observe(plain_cycle(0.010), 1.0) for _ in range(check.retry_after)]
    assert plainly == [Decision.PLAIN] * (check.retry_after - 1) + [Decision.KEEP] and check.retries == 1


def retried(check: OnlineCheck, tree_seconds: float, tokens: float) -> list[Decision]:
    """Take `check` through a losing start and its trial (plain decoding at 10 ms a token) to plain decoding and its
    first retry; the retry's cycles take `tree_seconds` for `tokens` each. The decisions of the retry's cycles."""
    while check.observe(cycle(0.020), 1.5) is Decision.KEEP:
        pass
    while check.observe(plain_cycle(0.010), 1.0) is not Decision.KEEP:
        pass
    return [check.observe(cycle(tree_seconds), tokens) for _ in range(check.min_cycles + 1)]


def test_a_call_whose_tree_got_faster_later_in_the_answer_goes_back_to_it_for_good():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020)
    # the answer's start drafted badly (1.5 tokens a cycle), its body well: 2.5 tokens in 20 ms, 1.25x plain
    decisions = retried(check, 0.020, 2.5)
    assert decisions == [Decision.KEEP] * 9 and check.settled and check.measured_speedup == pytest.approx(1.25)
    assert check.observe(cycle(1.0), 1.0) is Decision.KEEP  # decided for the rest of the call


def test_a_retry_that_still_loses_goes_on_plainly_and_waits_twice_as_long_for_the_next():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020, retry_after=16)
    decisions = retried(check, 0.020, 1.6)  # 0.8x plain
    assert decisions == [Decision.KEEP] * 8 + [Decision.PLAIN] and not check.settled and check.retry_after == 32
    plainly = [check.observe(plain_cycle(0.010), 1.0) for _ in range(32)]
    assert plainly == [Decision.PLAIN] * 31 + [Decision.KEEP] and check.retries == 2
    # the costs were checked once, at the start: a retry sets the tree against plain decoding only
    assert check.measured_cycle == pytest.approx(0.020)


def test_a_tree_that_loses_only_to_a_step_calibrated_on_a_quieter_machine_goes_back_after_the_trial():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020)
    # the machine is 1.5x slower than when it was calibrated: the tree's 2.4 tokens take 30 ms (80 tokens/s, under
    # the calibrated 100), and plain decoding takes 15 ms a token (67 tokens/s)
    while check.observe(cycle(0.030), 2.4) is Decision.KEEP:
        pass
    while check.observe(plain_cycle(0.015), 1.0) is Decision.TRIAL:
        pass
    assert check.decision is Decision.KEEP and check.settled and check.measured_speedup == pytest.approx(1.2)
    assert check.observe(cycle(1.0), 1.0) is Decision.KEEP  # decided for the rest of the call
    assert check.retries == 0


def test_a_shape_faster_than_plain_decoding_is_kept():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020)
    assert all(check.observe(cycle(0.020), 3.0) is Decision.KEEP for _ in range(100))
    assert check.cycles == 100
    assert check.speedup == pytest.approx(1.5)


def test_the_first_cycle_and_a_noise_margin_do_not_decide():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020, margin=0.10)
    check.observe(cycle(10.0), 1.0)  # a first cycle paying for kernel selection is not counted
    assert all(check.observe(cycle(0.020), 1.9) is Decision.KEEP for _ in range(20))  # 0.95x plain: within the margin
    assert check.cycles == 21 and check.seconds == pytest.approx(0.4)


def test_cycles_dearer_than_predicted_send_even_a_winning_call_to_a_trial_of_plain_decoding():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020)
    # 4 tokens in 30 ms: faster than plain decoding's calibrated 100 tokens/s, but 50 % dearer than predicted: the
    # machine or the record, which only plain decoding measured here can tell apart
    while check.observe(cycle(0.030), 4.0) is Decision.KEEP:
        pass
    assert check.decision is Decision.TRIAL and check.cycles == 9 and check.speedup > 1
    assert check.costs_disproved and check.measured_cycle == pytest.approx(0.030)


def test_one_cycle_that_paid_for_something_else_neither_disproves_the_costs_nor_goes_into_them():
    check = OnlineCheck(plain_step=0.010, predicted_cycle=0.020)
    check.observe(cycle(0.020), 2.0)  # the first: not counted
    check.observe(cycle(0.500), 2.0)  # a compilation, say: 25 cycles' worth
    for _ in range(7):
        check.observe(cycle(0.021), 2.0)
    assert check.counted == check.min_cycles and not check.costs_disproved
    assert check.measured_cycle == pytest.approx(0.021)


def record_costs(path) -> MachineCosts:
    return MachineCosts.from_json(json.loads(path.read_text())["costs"])


def test_a_call_whose_tree_loses_to_the_calibrated_step_tries_plain_decoding_and_keeps_the_faster(
        cache, llama_target, auto_draft):  # noqa: F811
    # A record claiming plain decoding takes 0.1 ms a token: every tree is predicted to pay, none keeps up for real
    _, path = calibrate(llama_target, auto_draft, measure=Measure(plain_step=1e-4, verify=5e-5))
    choice = choose_tree(llama_target, auto_draft)
    assert choice.settings is not None
    expected = llama_target.generate(PROMPT, max_new_tokens=48, do_sample=False)
    output = llama_target.generate(PROMPT, max_new_tokens=48, do_sample=False,
                                   assistant_model=copy.deepcopy(auto_draft), return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    stats = output.eagle3_stats
    assert stats.settings == choice.settings
    assert "so it decoded plainly for 9 cycles to measure plain decoding here" in stats.shape_choice
    assert set(stats.acceptance_lengths[9:18]) == {1}  # after 9 cycles, the trial: one token per target forward
    # which of the two is faster here is the machine's to say; the call says which it kept
    went_on_plainly = "so it went on plainly" in stats.shape_choice
    assert went_on_plainly != ("so it went back to the tree" in stats.shape_choice)
    if went_on_plainly:
        assert set(stats.acceptance_lengths[18:]) == {1}
    # whatever the call found, what was measured stays in the record as it was measured
    assert replace(record_costs(path), speed_scale=1.0, cycle_scale=1.0) == choice.costs


def test_a_call_that_finds_its_tree_faster_than_plain_decoding_measured_in_the_call_goes_back_to_it(
        cache, llama_target, auto_draft, monkeypatch):  # noqa: F811
    calibrate(llama_target, auto_draft, measure=Measure(plain_step=1e-4, verify=5e-5))
    # the trial's verdict injected (which of the two is faster is the machine's to say): the tree, at 2x
    monkeypatch.setattr(OnlineCheck, "measured_speedup", property(lambda check: 2.0))
    expected = llama_target.generate(PROMPT, max_new_tokens=48, do_sample=False)
    output = llama_target.generate(PROMPT, max_new_tokens=48, do_sample=False,
                                   assistant_model=copy.deepcopy(auto_draft), return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    stats = output.eagle3_stats
    assert "so it went back to the tree" in stats.shape_choice and "went on plainly" not in stats.shape_choice
    # the draft was kept current through the trial: its trees are accepted again, as in a call with no trial
    lengths = stats.acceptance_lengths
    assert set(lengths[9:18]) == {1} and max(lengths[18:]) > 1
    untried = llama_target.generate(PROMPT, max_new_tokens=48, do_sample=False, assistant_model=copy.deepcopy(
        auto_draft), tree_depth=stats.settings.depth, tree_top_k=stats.settings.top_k,
        tree_total_tokens=stats.settings.total_tokens, return_dict_in_generate=True).eagle3_stats
    assert sum(lengths[18:]) / len(lengths[18:]) >= 0.8 * untried.mean_acceptance_length


def test_a_call_that_went_on_plainly_tries_its_tree_again_with_the_draft_caught_up(
        cache, llama_target, auto_draft, monkeypatch):  # noqa: F811
    calibrate(llama_target, auto_draft, measure=Measure(plain_step=1e-4, verify=5e-5))
    # the verdicts injected: plain decoding faster at the trial, the tree at the retry, which comes after 8 tokens
    monkeypatch.setattr(OnlineCheck, "measured_speedup", property(lambda check: 2.0 if check.retries else 0.5))
    online_check = loop.online_check

    def retrying_soon(settings):
        check = online_check(settings)
        return check and replace(check, retry_after=8)

    monkeypatch.setattr(loop, "online_check", retrying_soon)
    expected = llama_target.generate(PROMPT, max_new_tokens=96, do_sample=False)
    output = llama_target.generate(PROMPT, max_new_tokens=96, do_sample=False,
                                   assistant_model=copy.deepcopy(auto_draft), return_dict_in_generate=True)
    assert torch.equal(output.sequences, expected)
    stats = output.eagle3_stats
    assert "so it went on plainly (trying the tree again after 8 tokens)" in stats.shape_choice
    assert stats.shape_choice.endswith("the tree tried again (1), its tokens came 2.00x as fast as plain decoding's, "
                                       "so it went back to the tree")
    # 9 cycles with the tree, 9 of the trial, 8 plainly; then the tree, its draft told the 17 plain tokens at once
    lengths = stats.acceptance_lengths
    assert set(lengths[9:26]) == {1} and max(lengths[26:]) > 1
    # the plain steps are told apart: τ of the trees leaves them out
    assert stats.plain_cycles == list(range(9, 26))
    tree_lengths = lengths[:9] + lengths[26:]
    assert stats.mean_tree_acceptance_length == pytest.approx(sum(tree_lengths) / len(tree_lengths))
    untried = llama_target.generate(PROMPT, max_new_tokens=96, do_sample=False, assistant_model=copy.deepcopy(
        auto_draft), tree_depth=stats.settings.depth, tree_top_k=stats.settings.top_k,
        tree_total_tokens=stats.settings.total_tokens, return_dict_in_generate=True).eagle3_stats
    assert sum(lengths[26:]) / len(lengths[26:]) >= 0.8 * untried.mean_acceptance_length


def test_a_call_after_one_that_disproved_the_costs_measures_nothing(cache, llama_target, auto_draft):  # noqa: F811
    measure = Measure(plain_step=1e-4, verify=5e-5)
    _, path = calibrate(llama_target, auto_draft, measure=measure)
    expected = llama_target.generate(PROMPT, max_new_tokens=32, do_sample=False)
    for _ in range(3):
        output = llama_target.generate(PROMPT, max_new_tokens=32, do_sample=False,
                                       assistant_model=copy.deepcopy(auto_draft), return_dict_in_generate=True)
        assert torch.equal(output.sequences, expected)
        # at most 9 cycles with the tree and 9 of the trial, then whichever was faster
        assert output.eagle3_stats.num_cycles <= 18 + 32
    # Each call predicted from the record as the calls before it left it: none measured again (a measurement would
    # have replaced the injected plain step, and `measure` counts the calls it serves)
    assert measure.calls == 1 and record_costs(path).plain_step == 1e-4


SHAPES = [TreeSettings(2, 4, 8), TreeSettings(3, 4, 12), TreeSettings(4, 8, 24)]
PROFILE = [{"tree_depth": shape.depth, "tree_top_k": shape.top_k, "tree_total_tokens": shape.total_tokens, "tau": tau}
           for shape, tau in zip(SHAPES, [2.0, 2.4, 2.9])]


def recorded_choice(path, costs: MachineCosts) -> TreeChoice:
    """The choice `choose_tree` makes from `costs`, written as the cache record at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": {}, "costs": costs.to_json()}))
    predictions = predict(PROFILE, costs)
    return TreeChoice(predictions[0].settings, predictions[0].tokens_per_second * costs.plain_step, "test", costs,
                      predictions, path)


def test_a_call_on_a_machine_slower_than_when_it_was_calibrated_changes_no_predicted_speedup(tmp_path):
    costs = MachineCosts("a test machine", plain_step=0.050, verify={9: 0.045, 13: 0.050, 25: 0.080},
                         draft={(2, 4): 0.004, (3, 4): 0.006, (4, 8): 0.012}, other=0.002)
    choice = recorded_choice(tmp_path / "record.json", costs)
    assert choice.settings == TreeSettings(3, 4, 12)
    # one call at a noisy moment: its cycles and plain decoding's step both at 4x the prediction
    corrected = correct_calibration(choice, 4 * choice.prediction.cycle_seconds, 4 * choice.plain_step)
    assert corrected.speed_scale == pytest.approx(2.0) and corrected.cycle_scale == pytest.approx(1.0)
    assert record_costs(tmp_path / "record.json") == corrected
    before, after = predict(PROFILE, costs), predict(PROFILE, corrected)
    assert [p.settings for p in after] == [p.settings for p in before]  # the next call keeps the shape
    assert [p.cycle_seconds for p in after] == pytest.approx([2 * p.cycle_seconds for p in before])
    assert [p.tokens_per_second * corrected.plain_step_at(None) for p in after] == pytest.approx(
        [p.tokens_per_second * costs.plain_step_at(None) for p in before])  # and every predicted speedup
    assert replace(corrected, speed_scale=1.0) == costs  # what was measured stays as it was measured


def test_a_record_whose_cycles_are_wrong_against_plain_decoding_is_mended_within_a_few_calls(tmp_path):
    costs = MachineCosts("a test machine", plain_step=0.050, verify={9: 0.030, 13: 0.040, 25: 0.070},
                         draft={(2, 4): 0.004, (3, 4): 0.006, (4, 8): 0.012}, other=0.002)
    true_cycle = {shape: 1.6 * sum(costs.cycle_parts(shape).values()) for shape in SHAPES}  # 60 % above the record
    errors = []
    for _ in range(4):
        choice = recorded_choice(tmp_path / "record.json", costs)
        errors.append(true_cycle[choice.settings] / choice.prediction.cycle_seconds - 1)
        costs = correct_calibration(choice, true_cycle[choice.settings], 0.050)  # plain decoding as calibrated
    assert errors == pytest.approx([0.6, 1.6 ** 0.5 - 1, 1.6 ** 0.25 - 1, 1.6 ** 0.125 - 1])  # halved each call
    assert costs.cycle_scale == pytest.approx(1.6 ** (1 - 1 / 16)) and costs.speed_scale == pytest.approx(1.0)


def test_a_benchmarked_call_is_predicted_from_the_choice_it_decoded_with(cache, llama_target, auto_draft):  # noqa: F811
    from hf_eagle3.commands.bench import Call, prediction_entry

    calibrate(llama_target, auto_draft, measure=Measure())  # plain decoding at 1 token/s: every tree pays
    before = choose_tree(llama_target, auto_draft)
    calls = []
    for index in range(2):
        stats = llama_target.generate(PROMPT, max_new_tokens=32, do_sample=False,
                                      assistant_model=copy.deepcopy(auto_draft),
                                      return_dict_in_generate=True).eagle3_stats
        tau = stats.mean_acceptance_length if stats.settings else 1.0
        calls.append(Call(32, stats.prefill_seconds, tau, PROMPT.shape[1], None, stats.choice))
        if index == 0:  # measured again, on a machine where no tree pays: the next call decodes plainly
            calibrate(llama_target, auto_draft, recalibrate=True, measure=Measure(plain_step=1e-4, verify=1.0))
    first, second = (call.choice for call in calls)
    assert first.settings == before.settings and first.costs == before.costs
    assert second.settings is None and second.costs != before.costs
    entry = prediction_entry(before, 1.0, calls)
    # the second call is predicted as what it did, plain decoding (1.0x), not as the shape the first one used
    expected = (first.call_speedup(32, calls[0].prefill_seconds, first.prediction.tau, PROMPT.shape[1]) + 1.0) / 2
    assert entry["predicted_speedup"] == pytest.approx(expected)
    assert entry["predicted_tau"] == pytest.approx((first.prediction.tau + 1.0) / 2)
