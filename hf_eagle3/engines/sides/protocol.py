"""What an engine's side script and hf-eagle3 (`hf_eagle3/engines/process.py`) say to each other, one JSON object a
line. The side script loads its engine once and writes `{"engine": NAME, "version": VERSION}`; then for each request
read on stdin, `{"prompt": [token ids], "max_new_tokens": N}`, it decodes greedily and writes `{"tokens": [new token
ids], "seconds": S, "cycles": C, "accepted": A}`: S the engine's generate call (the prompt's forward included), C the
target forwards that verified drafted tokens and A the drafted tokens they accepted, from the engine's own counters
(0 and 0 without a draft). The engines log to stdout too: their stdout goes to stderr, and the lines to the stdout the
process started with.

It imports the standard library only: it runs under each engine's own Python, beside the side scripts.
"""

import json
import os
import sys


def serve(load) -> None:
    """Answer requests until stdin closes. `load(settings)` (the settings are the JSON of the first argument) loads
    the engine and returns its `{"engine", "version"}` and `decode(prompt, max_new_tokens)`, which returns a result."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    engine, decode = load(json.loads(sys.argv[1]))
    _write(results, engine)
    for line in sys.stdin:
        request = json.loads(line)
        _write(results, decode(request["prompt"], request["max_new_tokens"]))


def _write(file, record: dict) -> None:
    file.write(json.dumps(record) + "\n")
    file.flush()
