"""The engines as `hf-eagle3 bench` methods: their names, the refusals before anything loads, their records and rows;
and, marked slow, llama.cpp run for real beside `generate` where `make engines` has built it."""

import json

import pytest

from hf_eagle3.commands.bench import markdown_table, methods_from_names, summarise
from hf_eagle3.commands.bench_engines import EngineMethod, check_engine_methods, engine_record
from hf_eagle3.commands.cli import main
from hf_eagle3.engines import ENGINE_METHODS, EngineNotBuilt, EngineOutput, engine_method, llama_cpp
from hf_eagle3.resources.prompts import mt_bench_first_turns

LLAMA_CPP = "llama-cpp-python==0.3.36 sdist, 0.5.0-dev (build 1, commit 0c1e570)"


def test_engine_method_names_name_the_engine_and_whether_a_draft_drafts():
    assert ENGINE_METHODS == ["vllm", "vllm+eagle3", "llama.cpp", "llama.cpp+eagle3", "openvino", "openvino+eagle3"]
    assert [engine_method(name) for name in ("vllm", "llama.cpp+eagle3", "openvino+eagle3", "chain", "sglang")] == [
        ("vllm", False), ("llama.cpp", True), ("openvino", True), None, None]
    methods = methods_from_names(["plain", "chain", "llama.cpp", "llama.cpp+eagle3"], 3, 1, 3)
    assert [(method.is_engine, method.is_eagle3) for method in methods] == [
        (False, False), (False, True), (True, False), (True, False)]  # an engine's draft is not generate's
    with pytest.raises(ValueError, match=r"Unknown method 'sglang\+eagle3'.*vllm, vllm\+eagle3, llama.cpp"):
        methods_from_names(["plain", "sglang+eagle3"], 3, 1, 3)


def test_an_engine_not_built_here_is_refused_naming_make_engines(own_cache):
    for engine, missing in (("vllm", "vllm-venv/bin/python"), ("llama.cpp", "llama.cpp/build/bin/llama-completion"),
                            ("openvino", "openvino-venv/bin/python")):
        with pytest.raises(EngineNotBuilt) as refusal:
            check_engine_methods(["plain", engine, engine + "+eagle3"], greedy=True)
        assert str(own_cache / "engines" / missing) in str(refusal.value)
        assert "run `make engines`" in str(refusal.value)


def test_an_engine_s_eagle3_method_needs_its_plain_one_and_greedy_decoding():
    with pytest.raises(ValueError, match=r"vllm\+eagle3 is checked against its engine's plain greedy output: add "
                                         r"`vllm` to --methods"):
        check_engine_methods(["plain", "vllm+eagle3"], greedy=True)
    with pytest.raises(ValueError, match=r"The engine methods \(llama.cpp\) decode greedily"):
        check_engine_methods(["plain", "llama.cpp", "llama.cpp+eagle3"], greedy=False)
    check_engine_methods(["plain", "chain"], greedy=False)  # no engine: nothing to check


def test_an_output_past_max_new_tokens_is_compared_up_to_the_plain_one():
    """llama.cpp's last speculative step can pass `-n`: its text is then compared up to the plain text's end."""
    plain = EngineOutput(" one two three", 1.0, 3)
    assert EngineOutput(" one two three four", 0.5, 4, 2, 2).same_as(plain, max_new_tokens=3)
    assert not EngineOutput(" one two four", 0.5, 3, 2, 1).same_as(plain, max_new_tokens=3)
    assert not EngineOutput(" one two three four", 0.5, 4, 2, 2).same_as(plain, max_new_tokens=4)


def test_engine_rows_sit_beside_generate_s_with_their_version_chain_tau_and_own_plain_decoding():
    methods = methods_from_names(["plain", "llama.cpp", "llama.cpp+eagle3"], 3, 1, 3)
    engines = {"llama.cpp": EngineMethod(None, f"llama.cpp {LLAMA_CPP}", None),
               "llama.cpp+eagle3": EngineMethod(None, f"llama.cpp {LLAMA_CPP}", "3x1x3")}
    records = []
    for prompt, (plain_seconds, eagle3_seconds, eagle3_text) in enumerate(((2.0, 1.0, " a b c d"),
                                                                           (2.0, 2.0, " a b x d"))):
        outputs = {"llama.cpp": EngineOutput(" a b c d", plain_seconds, 4),
                   "llama.cpp+eagle3": EngineOutput(eagle3_text, eagle3_seconds, 4, cycles=2, accepted=2)}
        common = {"set": "mt-bench", "prompt": prompt, "prompt_tokens": 7}
        records.append(common | {"method": "plain", "seconds": 4.0, "new_tokens": 4, "identical_to_plain": True})
        for name in engines:
            records.append(common | {"method": name, "seconds": outputs[name].seconds}
                           | engine_record(name, outputs, 4, engines[name]))
    assert [record.get("identical_to_plain") for record in records] == [True, None, True, True, None, False]
    assert records[2]["shape"] == "3x1x3" and records[2]["cycles"] == 2 and records[2]["accepted"] == 2
    entries = summarise(records, methods, True)["summary"]["mt-bench"]
    eagle3 = entries["llama.cpp+eagle3"]
    assert eagle3["tau"] == 2.0 and eagle3["shapes"] == ["3x1x3"] and eagle3["greedy_mismatches"] == [1]
    assert eagle3["speedup"] == 3.0 and eagle3["speedup_over_engine"] == 1.5  # medians of (4, 2) and (2, 1)
    assert entries["llama.cpp"]["greedy_mismatches"] == [] and entries["llama.cpp"]["compared_with"] is None
    table = markdown_table({"mt-bench": entries}).splitlines()
    assert table[3] == (f"| mt-bench | llama.cpp (llama.cpp {LLAMA_CPP}) | - | 2.00x | - | - | 2.0 | - | - | - | - | "
                        "- | - | - |")
    assert table[4] == (f"| mt-bench | llama.cpp+eagle3 (llama.cpp {LLAMA_CPP}) | 3x1x3 | 3.00x (1.50x over "
                        "llama.cpp) | - | - | 2.7 | 2.00 | - | - | - | - | - | 1 against llama.cpp |")


def _llama_cpp_built() -> bool:
    try:
        llama_cpp.require_built()
    except EngineNotBuilt:
        return False
    return True


@pytest.mark.slow  # SmolLM2 converted to GGUF, and llama.cpp's processes (about a minute on a 2-core machine)
@pytest.mark.skipif(not _llama_cpp_built(), reason="llama.cpp is not built here: `make engines` builds it")
def test_bench_runs_llama_cpp_beside_generate_and_its_eagle3_output_equals_its_plain_one(tmp_path):
    # MT-bench 71, held out from the draft's training (`make engines`' first prompt); on MT-bench 1 llama.cpp's
    # EAGLE-3 parts from its plain output at the sixth token, a near-tie in its batched verification
    prompts = tmp_path / "prompt.jsonl"  # the set's name in the results
    prompts.write_text(json.dumps({"prompt": mt_bench_first_turns()[70]}) + "\n")
    main(["bench", "--methods", "plain", "chain", "llama.cpp", "llama.cpp+eagle3", "--prompts", str(prompts),
          "--max-new-tokens", "8", "--repetitions", "1", "--tree-depth", "3",
          "--output", str(tmp_path / "bench")])
    result = json.loads((tmp_path / "bench" / "bench.json").read_text())
    engine = {record["method"]: record for record in result["records"] if record["method"].startswith("llama.cpp")}
    assert engine["llama.cpp+eagle3"]["identical_to_plain"] and engine["llama.cpp+eagle3"]["shape"] == "3x1x3"
    assert engine["llama.cpp"]["engine"].startswith("llama.cpp llama-cpp-python==0.3.36 sdist, ")
    assert engine["llama.cpp+eagle3"]["cycles"] >= 1 and engine["llama.cpp"]["new_tokens"] == 8
    entry = result["summary"][str(prompts)]["llama.cpp+eagle3"]
    assert entry["tau"] >= 1.0 and entry["greedy_mismatches"] == []
    assert f"| {prompts} | llama.cpp+eagle3 (llama.cpp llama-cpp-python==0.3.36 sdist, " in (
        tmp_path / "bench" / "bench.md").read_text()
    assert (tmp_path / "bench" / "bench.png").exists()
