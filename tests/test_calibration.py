"""`tree_shape="auto"`: costs measured on this machine and cached per target, draft, dtype, thread count, batch size,
weight layout and compilation; the predicted-fastest shape used by `generate`, or plain decoding (the draft not run)
when no shape pays, the machine is too noisy, or the cache or the profile cannot be trusted. Costs are injected (a
measurement function that returns them) wherever a test depends on them: this machine's timings are not."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, fit_draft, tiny_draft, tiny_target
from transformers import CompileConfig

from hf_eagle3 import optimize
from hf_eagle3.commands.cli import build_parser
from hf_eagle3.commands.tune_tree import recalibrate, show_calibration
from hf_eagle3.decoding.calibration import (
    MAX_SPREAD,
    MIN_PREDICTED_SPEEDUP,
    PLAIN_CONTEXTS,
    MachineCosts,
    calibrate,
    calibration_key,
    calibration_path,
    choose_tree,
    machine_description,
    measure_costs,
    profile_shapes,
)
from hf_eagle3.training.profile import acceptance_profile
from hf_eagle3.utils.transformers_api import output_cache

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


class Measure:
    """A measurement that returns given costs for every profiled shape (by default a slow machine where every tree
    pays: plain decoding at 1 token/s), counting its calls."""

    def __init__(self, plain_step=1.0, verify=0.25, draft=1e-6, other=0.0, spread=0.0, plain_steps=None):
        self.costs = {"plain_step": plain_step, "verify": verify, "draft": draft, "other": other, "spread": spread}
        self.plain_steps = plain_steps or {}
        self.calls = 0

    def __call__(self, target, draft, profile, **kwargs) -> MachineCosts:
        self.calls += 1
        shapes = [shape for shape, _ in profile_shapes(profile)]
        costs = self.costs
        return MachineCosts(
            machine="a test machine", plain_step=costs["plain_step"],
            verify={1: costs["plain_step"]} | {shape.total_tokens + 1: costs["verify"] for shape in shapes},
            draft={(shape.depth, shape.top_k): costs["draft"] for shape in shapes}, other=costs["other"],
            spread=costs["spread"], plain_steps=self.plain_steps)


def _messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_calibration_is_measured_once_then_read_from_the_cache(cache, llama_target, auto_draft):
    measure = Measure()
    costs, path = calibrate(llama_target, auto_draft, measure=measure)
    assert path.parent == cache and path.is_file() and measure.calls == 1
    written = path.stat().st_mtime_ns
    again, same_path = calibrate(llama_target, auto_draft, measure=measure)
    assert same_path == path and again == costs and path.stat().st_mtime_ns == written and measure.calls == 1


def test_a_measurement_covers_every_profiled_shape_with_its_spread(llama_target, auto_draft):
    costs = measure_costs(llama_target, auto_draft, auto_draft.config.acceptance_profile, rounds=2)
    shapes = [shape for shape, _ in profile_shapes(auto_draft.config.acceptance_profile)]
    assert set(costs.draft) == {(shape.depth, shape.top_k) for shape in shapes}
    assert set(costs.verify) == {1} | {shape.total_tokens + 1 for shape in shapes}
    assert costs.machine == machine_description() and costs.plain_step > 0 and costs.other >= 0
    assert set(costs.plain_steps) == set(PLAIN_CONTEXTS) and costs.plain_steps[160] == costs.plain_step
    assert costs.spread >= 0 and MachineCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs


@pytest.mark.slow  # dynamo traces one graph per forward size (about a minute on a busy 2-core machine)
def test_the_compiled_path_is_measured_through_a_static_cache_and_the_compiled_forward(llama_target, auto_draft):
    compile_config = CompileConfig(backend="eager", fullgraph=False, dynamic=False)  # torch.compile, no codegen
    compile_config._compile_all_devices = True
    row = auto_draft.config.acceptance_profile[-1]  # one shape: each new size is one more graph
    costs = measure_costs(llama_target, auto_draft, [row], rounds=1, compile_config=compile_config)
    assert set(costs.verify) == {1, row["tree_total_tokens"] + 1} and costs.plain_step > 0
    assert set(costs.draft) == {(row["tree_depth"], row["tree_top_k"])}


def test_calibration_is_not_reused_for_another_path_dtype_thread_count_batch_layout_or_draft(
        cache, llama_target, auto_draft):
    def path(target=llama_target, draft=auto_draft, **kwargs):
        return calibration_path(calibration_key(target, draft, **kwargs))

    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        other_threads = path()
    finally:
        torch.set_num_threads(threads)
    compile_config = CompileConfig(fullgraph=False, dynamic=False)
    bf16_target = copy.deepcopy(llama_target).to(torch.bfloat16)
    bf16_draft = copy.deepcopy(auto_draft).to(torch.bfloat16)
    other_draft = fit_draft(tiny_draft(seed=1, draft_vocab_size=auto_draft.config.draft_vocab_size), llama_target,
                            steps=5)
    other_draft.config.acceptance_profile, other_draft.config.tree_shape = auto_draft.config.acceptance_profile, "auto"
    optimized = optimize(copy.deepcopy(llama_target), "column-major")  # not "auto": it may measure "standard"
    paths = [path(), other_threads, path(bf16_target, bf16_draft), path(draft=other_draft), path(batch_size=4),
             path(compile_config=compile_config), path(target=optimized), path(static_length=256),
             path(static_length=512), path(compile_config=compile_config, static_length=256)]
    assert len(set(paths)) == len(paths) and path() == paths[0]


def test_auto_decodes_plainly_and_says_so_once_when_every_shape_loses(cache, llama_target, auto_draft, caplog):
    steps = {48: 0.010, 160: 0.011, 320: 0.012}  # each call's reason names the step at its own context
    calibrate(llama_target, auto_draft, measure=Measure(plain_step=0.011, verify=0.5, plain_steps=steps))
    choice = choose_tree(llama_target, auto_draft)
    assert choice.settings is None and "decodes plainly" in choice.reason

    reasons = []
    for prompt in (PROMPT, PROMPT, torch.cat([PROMPT] * 6, dim=1)):
        expected = llama_target.generate(prompt, max_new_tokens=24, do_sample=False)
        output = llama_target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=auto_draft)
        assert torch.equal(output, expected)
        stats = auto_draft.generation_stats
        assert stats.settings is None and stats.num_cycles == 0 and "decodes plainly" in stats.shape_choice
        reasons.append(stats.shape_choice)
    assert len(set(reasons)) == 2  # the longer prompt's context: another reason, in its statistics
    calibrating, *said = _messages(caplog)  # the calibration says what it does first
    assert calibrating.startswith("Calibrating tree_shape='auto'")
    assert said == [reasons[0]]  # said once per calibration record, with the first call's reason


def test_auto_decodes_with_the_predicted_fastest_shape(cache, llama_target, auto_draft):
    calibrate(llama_target, auto_draft, measure=Measure())  # verifying any number of tokens costs the same
    choice = choose_tree(llama_target, auto_draft)
    assert choice.predicted_speedup >= MIN_PREDICTED_SPEEDUP
    assert choice.settings == choice.predictions[0].settings
    assert choice.predictions[0].tau == max(row["tau"] for row in auto_draft.config.acceptance_profile)
    expected = llama_target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    output = llama_target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=auto_draft)
    assert torch.equal(output, expected)
    assert auto_draft.generation_stats.settings == choice.settings and auto_draft.generation_stats.num_cycles > 0


def test_a_call_s_predicted_speedup_is_diluted_by_its_prefill_and_plain_tokens_and_reaches_the_decoding_one(
        cache, llama_target, auto_draft):
    calibrate(llama_target, auto_draft, measure=Measure(plain_step=0.05, verify=0.04, draft=0.01))
    choice = choose_tree(llama_target, auto_draft)
    tau = choice.prediction.tau
    assert choice.predicted_speedup == pytest.approx(tau * 0.05 / 0.05)  # a cycle costs a decode step here
    assert choice.call_speedup(1, prefill_seconds=0.5) == 1.0  # the prefill's token alone: nothing to speed up
    assert choice.call_speedup(1, prefill_seconds=0.0) == 1.0
    assert choice.call_speedup(65, prefill_seconds=0.0) == pytest.approx(choice.predicted_speedup)
    assert choice.call_speedup(65, prefill_seconds=0.5) == pytest.approx((0.5 + 64 * 0.05) / (0.5 + 64 * 0.05 / tau))
    assert choice.call_speedup(65, prefill_seconds=0.5, tau=1.0) == pytest.approx(1.0)  # at τ 1 a cycle is a step
    assert 1.0 < choice.call_speedup(65, 0.5) < choice.call_speedup(100_000, 0.5) < choice.predicted_speedup
    # a call that decoded 32 of its tokens plainly (the online check found its tree slower) paid a step for each
    assert choice.call_speedup(65, 0.5, tau, plain_tokens=32) == pytest.approx(
        (0.5 + 64 * 0.05) / (0.5 + 32 * 0.05 / tau + 32 * 0.05))
    assert choice.call_speedup(65, 0.5, tau, plain_tokens=64) == pytest.approx(1.0)


def test_a_prediction_for_prompts_of_one_set_reads_the_profile_s_tau_for_that_set(cache, llama_target, auto_draft):
    from hf_eagle3.commands.bench import Call, prediction_entry

    auto_draft.config.acceptance_profile = [row | {"tau_by_set": {"chat": 1.0 + (row["tau"] - 1) / 2,
                                                                  "code": row["tau"] + 0.5}}
                                            for row in auto_draft.config.acceptance_profile]
    calibrate(llama_target, auto_draft, measure=Measure(plain_step=0.05, verify=0.04, draft=0.01))
    choice = choose_tree(llama_target, auto_draft)
    prediction = choice.prediction
    assert prediction.tau_for("code") == pytest.approx(prediction.tau + 0.5)
    assert prediction.tau_for("unknown") == prediction.tau_for(None) == prediction.tau  # over every prompt
    chat = prediction_entry(choice, 1.0, [Call(65, 0.0, 1.5, 6, "chat")])
    assert chat["predicted_tau"] == prediction.tau_for("chat")
    assert chat["predicted_speedup"] == pytest.approx(choice.call_speedup(65, 0.0, prediction.tau_for("chat"), 6))
    mixed = prediction_entry(choice, 1.0, [Call(65, 0.0, 1.5, 6, "chat"), Call(65, 0.0, 1.5, 6, "code")])
    assert mixed["predicted_tau"] == pytest.approx((prediction.tau_for("chat") + prediction.tau_for("code")) / 2)


def test_plain_decoding_s_step_is_read_at_the_call_s_context(cache, llama_target, auto_draft):
    steps = {48: 0.02, 160: 0.05, 320: 0.06}
    calibrate(llama_target, auto_draft, measure=Measure(plain_step=0.05, verify=0.01, draft=0.001, plain_steps=steps))
    costs = choose_tree(llama_target, auto_draft).costs
    assert [costs.plain_step_at(c) for c in (None, 10, 48, 104, 160, 240, 1000)] == pytest.approx(
        [0.05, 0.02, 0.02, 0.035, 0.05, 0.055, 0.06])
    short, long = (choose_tree(llama_target, auto_draft, context_length=c) for c in (48, 320))
    assert short.plain_step == 0.02 and short.predicted_speedup == pytest.approx(long.predicted_speedup / 3)
    assert "a decode step takes 20.0 ms after 48 cached tokens" in short.reason
    assert long.call_speedup(65, 0.0, prompt_tokens=15) == pytest.approx(short.predicted_speedup)  # context 47.5
    # a short prompt's call: its check against plain decoding compares with the short-context step
    output = llama_target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=auto_draft,
                                   return_dict_in_generate=True)
    assert "after 18 cached tokens" in output.eagle3_stats.shape_choice  # 6 prompt tokens + 24 / 2


def test_tree_settings_of_a_call_override_auto(cache, llama_target, auto_draft):
    llama_target.generate(PROMPT, max_new_tokens=8, do_sample=False, assistant_model=auto_draft, tree_top_k=1)
    assert auto_draft.generation_stats.settings.top_k == 1 and not cache.exists()  # nothing calibrated
    with pytest.raises(ValueError, match="drop tree_depth"):
        llama_target.generate(PROMPT, max_new_tokens=8, assistant_model=auto_draft, tree_shape="auto", tree_depth=2)
    with pytest.raises(ValueError, match="'fixed' or 'auto'"):
        llama_target.generate(PROMPT, max_new_tokens=8, assistant_model=auto_draft, tree_shape="fastest")


def test_calibration_needs_an_acceptance_profile(cache, llama_target, fitted_draft):
    # (`generate` with tree_shape="auto" decodes with the fixed tree instead: tests/test_generation.py)
    with pytest.raises(ValueError, match="tune-tree"):
        calibrate(llama_target, fitted_draft)


def test_auto_reads_the_profile_rows_of_the_calls_ngram_setting(cache, llama_target, auto_draft):
    assert all(row["ngram_candidates"] for row in auto_draft.config.acceptance_profile)  # the draft's default
    with pytest.raises(ValueError, match="tune-tree --no-ngram-candidates"):
        llama_target.generate(PROMPT, max_new_tokens=4, assistant_model=auto_draft, ngram_candidates=False)
    # Rows without the candidates stand in for shapes the candidates' rows lack (a lower bound), and lose to them
    draft_only = [{name: value for name, value in row.items() if name != "ngram_candidates"}
                  for row in auto_draft.config.acceptance_profile]
    largest = max(draft_only, key=lambda row: row["tree_total_tokens"])
    best_tau = largest["tree_total_tokens"] + 1
    auto_draft.config.acceptance_profile = draft_only + [largest | {"tau": best_tau, "ngram_candidates": True}]
    calibrate(llama_target, auto_draft, measure=Measure(plain_step=1.0, verify=0.5))
    choice = choose_tree(llama_target, auto_draft)
    assert (choice.settings.depth, choice.settings.top_k, choice.settings.total_tokens) == (
        largest["tree_depth"], largest["tree_top_k"], largest["tree_total_tokens"])
    assert len(choice.predictions) == len(draft_only)
    assert choose_tree(llama_target, auto_draft, ngram_candidates=False).predictions[0].tau < best_tau


def test_a_batch_is_calibrated_at_its_size_and_decoded_with_its_own_choice(cache, llama_target, auto_draft):
    _, single = calibrate(llama_target, auto_draft, measure=Measure(plain_step=0.01, verify=0.5))
    _, batched = calibrate(llama_target, auto_draft, batch_size=4, measure=Measure())
    assert batched != single and json.loads(batched.read_text())["key"]["batch_size"] == 4
    assert choose_tree(llama_target, auto_draft).settings is None
    choice = choose_tree(llama_target, auto_draft, batch_size=4)  # where every tree pays
    batch = torch.randint(1, 90, (4, 6), generator=torch.Generator().manual_seed(4))
    kwargs = {"attention_mask": torch.ones_like(batch), "max_new_tokens": 16, "do_sample": False}
    output = llama_target.generate(batch, assistant_model=auto_draft, return_dict_in_generate=True, **kwargs)
    assert torch.equal(output.sequences, llama_target.generate(batch, **kwargs))
    assert output.eagle3_stats.settings == choice.settings and "predicted" in output.eagle3_stats.shape_choice


def test_a_noisy_measurement_is_taken_again_then_decodes_plainly_and_says_so(cache, llama_target, auto_draft):
    measure = Measure(spread=2 * MAX_SPREAD)
    calibrate(llama_target, auto_draft, measure=measure)
    assert measure.calls == 2  # measured again once
    choice = choose_tree(llama_target, auto_draft)
    assert choice.settings is None and "too noisy" in choice.reason and "--recalibrate" in choice.reason
    assert measure.calls == 2  # this process does not measure again at every call
    record = json.loads(choice.path.read_text())
    assert record["costs"]["spread"] == 2 * MAX_SPREAD  # recorded as noisy: `--show-calibration` shows why


# Issue 27 rows 2-5: the cache is an optimisation, never a point of failure


@pytest.mark.parametrize("blocker", ["the cache is a file", "the cache is under a file"])
def test_an_unwritable_cache_is_reported_once_and_the_costs_kept_in_memory(
        tmp_path, monkeypatch, llama_target, auto_draft, caplog, blocker):
    (tmp_path / "file").write_text("not a folder")
    cache = tmp_path / "file" if blocker == "the cache is a file" else tmp_path / "file" / "cache"
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(cache))  # writes fail with ENOTDIR, also as root (unlike chmod)
    measure = Measure()
    for _ in range(2):
        costs, path = calibrate(llama_target, auto_draft, measure=measure)
    warnings = [message for message in _messages(caplog) if "cannot write" in message]
    assert len(warnings) == 1 and str(path) in warnings[0] and "Set HF_EAGLE3_CACHE to a writable folder" in warnings[0]
    assert measure.calls == 1 and costs.plain_step == 1.0 and choose_tree(llama_target, auto_draft).settings
    expected = llama_target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(llama_target.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant_model=auto_draft),
                       expected)


def test_generate_decodes_on_when_the_cache_cannot_be_written(tmp_path, monkeypatch, llama_target, auto_draft):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("HF_EAGLE3_CACHE", str(tmp_path / "file"))
    expected = llama_target.generate(PROMPT, max_new_tokens=12, do_sample=False)  # measured here, for real
    assert torch.equal(llama_target.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant_model=auto_draft),
                       expected)


FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
import torch, test_calibration as t
from helpers import fit_draft, tiny_draft, tiny_target
from hf_eagle3.decoding.calibration import calibrate
target = tiny_target()
draft = tiny_draft(draft_vocab_size=96)
draft.config.acceptance_profile = [{{"tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 4, "tau": 2.0}}]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))
costs, path = calibrate(target, draft, measure=t.Measure())
print("decoded on with", costs.plain_step)
"""


def test_a_full_disk_is_reported_and_leaves_no_partial_file(tmp_path):
    script = FULL_DISK.format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False,
                            env={"HF_EAGLE3_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert "decoded on with 1.0" in result.stdout, result.stderr
    assert "cannot write the calibration record" in result.stderr and "HF_EAGLE3_CACHE" in result.stderr
    assert list((tmp_path / "calibration").iterdir()) == []  # no record, no .partial file


def _damage(path: Path, damage: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = json.loads(path.read_text()) if path.is_file() else None
    path.unlink(missing_ok=True)
    if damage == "empty":
        path.write_text("\n")
    elif damage == "a directory":
        path.mkdir()
    elif damage == "a symlink":
        (path.parent / "elsewhere.json").write_text(json.dumps(record))
        path.symlink_to(path.parent / "elsewhere.json")
    elif damage == "wrong types":
        path.write_text(json.dumps(record | {"costs": record["costs"] | {"verify": [], "draft": {}}}))
    else:  # a crafted cost, e.g. "plain_step=nan"
        name, value = damage.split("=")
        path.write_text(json.dumps(record | {"costs": record["costs"] | {name: float(value)}}))


@pytest.mark.parametrize("damage", ["empty", "a directory", "a symlink", "wrong types", "plain_step=nan",
                                    "plain_step=-1", "other=1e300", "plain_step=1e-12", "cycle_scale=1e3"])
def test_a_damaged_record_is_reported_once_and_measured_again(cache, llama_target, auto_draft, caplog, damage):
    _, path = calibrate(llama_target, auto_draft, measure=Measure())
    _damage(path, damage)
    measure = Measure()
    for _ in range(2):
        costs, _ = calibrate(llama_target, auto_draft, measure=measure)
    reports = [message for message in _messages(caplog) if "ignoring the calibration record" in message]
    assert len(reports) == 1 and str(path) in reports[0] and "--recalibrate" in reports[0]
    assert measure.calls == 1 and costs.plain_step == 1.0
    if damage != "a directory":  # replaced by a good record (a directory in its place is reported as unwritable)
        assert path.is_file() and not path.is_symlink() and MachineCosts.from_json(
            json.loads(path.read_text())["costs"]) == costs


def test_an_absurd_prediction_is_never_acted_on(cache, llama_target, auto_draft):
    calibrate(llama_target, auto_draft, measure=Measure(plain_step=1.0, verify=1e-5))  # valid values, 1e5x predicted
    choice = choose_tree(llama_target, auto_draft)
    assert choice.settings is None and "not believable" in choice.reason and str(choice.path) in choice.reason


@pytest.mark.parametrize("row", [{"tau": 1e300}, {"tau": float("nan")}, {"tree_total_tokens": 40000},
                                 {"tree_depth": 10**9}, {"tree_top_k": "2"}, {"tau_by_set": {"chat": 0.5}},
                                 {"tau_by_set": ["chat", 2.0]}, {"tau_by_set": {"chat": float("inf")}},
                                 {"ngram_candidates": None}, {"ngram_candidates": "yes"}, {"prompts": -1},
                                 {"cycles": "many"}])
def test_an_invalid_profile_row_decodes_plainly_before_anything_is_measured(cache, llama_target, auto_draft, row):
    auto_draft.config.acceptance_profile = [auto_draft.config.acceptance_profile[0] | row]
    choice = choose_tree(llama_target, auto_draft)
    assert choice.settings is None and "acceptance profile row" in choice.reason and "tune-tree" in choice.reason
    assert not cache.exists()  # nothing measured, nothing allocated for the row's sizes
    output = llama_target.generate(PROMPT, max_new_tokens=8, do_sample=False, assistant_model=auto_draft)
    assert torch.equal(output, llama_target.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_a_static_cache_call_reads_the_record_of_its_cache_length_rounded_up_to_a_block(
        cache, llama_target, auto_draft):
    # 6 prompt + 40 new tokens + the largest profiled tree (8): a 256-entry cache, whose costs are recorded
    _, path = calibrate(llama_target, auto_draft, static_length=256, measure=Measure())
    output = llama_target.generate(PROMPT, max_new_tokens=40, do_sample=False, assistant_model=auto_draft,
                                   cache_implementation="static", return_dict_in_generate=True)
    assert list(cache.iterdir()) == [path]  # read, not measured again for a cache of another length
    assert output_cache(output).layers[0].max_cache_len == 256
    assert "a static cache of 256" in output.eagle3_stats.shape_choice
    assert torch.equal(output.sequences, llama_target.generate(PROMPT, max_new_tokens=40, do_sample=False))


def test_a_static_cache_is_measured_at_its_length(llama_target, auto_draft):
    row = auto_draft.config.acceptance_profile[-1]
    costs = measure_costs(llama_target, auto_draft, [row], rounds=1, static_length=300)
    assert set(costs.verify) == {1, row["tree_total_tokens"] + 1} and costs.plain_step > 0
    assert costs.plain_steps == {}  # a static cache's step depends on its length, not on the tokens in it


def test_recalibrate_replaces_the_cached_record_and_show_calibration_prints_it(cache, llama_target, auto_draft):
    _, path = calibrate(llama_target, auto_draft, measure=Measure())
    shown = show_calibration(llama_target, auto_draft)
    assert shown.startswith(f"calibration record: {path}\n") and json.loads(shown.split("\n", 1)[1])["costs"][
        "machine"] == "a test machine"
    report = recalibrate(llama_target, auto_draft)  # measured here, for real
    record = json.loads(path.read_text())
    assert record["costs"]["machine"] == machine_description() and str(path) in report
    assert "tree_shape='auto' now: " in report
    args = build_parser().parse_args(["tune-tree", "--recalibrate", "--batch-size", "4", "--compiled",
                                      "--static-cache-length", "512", "--cpu-layout"])
    assert args.recalibrate and args.batch_size == 4 and args.compiled and args.cpu_layout
    assert args.static_cache_length == 512
    assert "none yet" in show_calibration(llama_target, auto_draft, batch_size=4)
