"""The target's forward compiled for verification: transformers' own compiled call (`get_compiled_call`, the one
`generate` compiles plain decoding with), allowed one graph per verification size.

`torch.compile` with static shapes traces a graph per input shape, and dynamo keeps at most `recompile_limit` of them
per function (8 by default): from the ninth shape on it runs the function eagerly, through its guards ("hit
config.recompile_limit"). A calibration measures every profiled tree size (13 for the shipped draft), and a call may
meet several (its tree, plain decoding's single token), so without more room the costs measured and the ones paid
would be of different code. The compiled verification forward raises the limit to `GRAPHS_PER_FORWARD` for its own
calls only; nothing else's compilation changes. It sets and restores the one setting itself: `config.patch` costs
0.7 ms a call on a 2-core Zen 4 EPYC (avx512_bf16), 1.4 % of a compiled SmolLM2 cycle; setting it costs 4 µs.
"""

from collections.abc import Callable

import torch

GRAPHS_PER_FORWARD = 64


def compiled_forward(model, compile_config) -> Callable:
    """`model`'s forward compiled with `compile_config` as transformers compiles it, with room for
    `GRAPHS_PER_FORWARD` graphs (one per number of tokens verified)."""
    compiled = model.get_compiled_call(compile_config)

    def forward(**kwargs):
        config = torch._dynamo.config
        limit = config.recompile_limit
        config.recompile_limit = max(limit, GRAPHS_PER_FORWARD)
        try:
            return compiled(**kwargs)
        finally:
            config.recompile_limit = limit

    return forward
