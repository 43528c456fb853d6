"""What transformers does and shows a user, observed before and after `import hf_eagle3` in one fresh interpreter
(run by tests/test_import_effects.py, which compares the two): `generate` without an EAGLE-3 draft, the pipelines'
assistant loader, the attention and mask registries, and the signatures of what hf_eagle3 wraps. Prints JSON."""

import inspect
import json
import sys
import tempfile

import torch
from transformers import GenerationMixin, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pipelines import base

PROMPT = torch.tensor([[5, 9, 3, 7, 5, 9]])
CALLS = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 8},
    "beam search": {"do_sample": False, "num_beams": 2},
    "transformers' assisted generation": {"do_sample": False, "assistant": True},
    "prompt lookup": {"do_sample": False, "prompt_lookup_num_tokens": 3},
    "static cache": {"do_sample": False, "cache_implementation": "static"},
}


def tiny_llama(seed: int, **fields) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **fields)
    return LlamaForCausalLM(config).eval()


def described(function) -> dict:
    return {"signature": str(inspect.signature(function)), "name": function.__name__,
            "qualname": function.__qualname__, "module": function.__module__, "doc": function.__doc__}


def outcome(call) -> str:
    try:
        return repr(call())
    except Exception as error:  # the error a user sees is part of the behaviour
        return f"{type(error).__name__}: {error}"


def observe(folder: str) -> dict:
    target, assistant = tiny_llama(0), tiny_llama(1)
    other_tokens = tiny_llama(1, eos_token_id=3)
    outputs = {}
    for name, kwargs in CALLS.items():
        kwargs = dict(kwargs)
        if kwargs.pop("assistant", False):
            kwargs["assistant_model"] = assistant
        torch.manual_seed(0)
        outputs[name] = outcome(lambda kwargs=kwargs: target.generate(
            PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=10, **kwargs).tolist())
    loader = {
        "model": outcome(lambda: base.load_assistant_model(target, assistant, None)[1]),
        "other tokenizer": outcome(lambda: base.load_assistant_model(target, other_tokens, None)),
        "path": outcome(lambda: base.load_assistant_model(target, folder, None)),
        "no assistant": outcome(lambda: base.load_assistant_model(target, None, None)),
    }
    return {
        "generate": outputs,
        "pipeline loader": loader,
        "functions": {"GenerationMixin.generate": described(GenerationMixin.generate),
                      "pipelines.base.load_assistant_model": described(base.load_assistant_model)},
        "attention functions": {name: id(function) for name, function in ALL_ATTENTION_FUNCTIONS.items()},
        "mask functions": {name: id(function) for name, function in ALL_MASK_ATTENTION_FUNCTIONS.items()},
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        tiny_llama(2).save_pretrained(folder)  # a plain causal LM without a tokenizer
        before = observe(folder)
        import hf_eagle3  # noqa: F401

        after = observe(folder)
    json.dump({"before": before, "after": after, "hf_eagle3": "hf_eagle3" in sys.modules}, sys.stdout)
