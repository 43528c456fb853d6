"""Sizes given on the command line, refused by argparse when out of range, before anything is loaded or allocated:
the error names the option, the value and the range allowed (`hf-eagle3 bench: error: argument --max-new-tokens:
0 is out of range: allowed 1 to 65,536`)."""

import argparse
from collections.abc import Callable

# The largest values the commands accept: past them a run would only exhaust memory or time.
MAX_NEW_TOKENS = 1 << 16
MAX_CONTEXT = 1 << 17  # tokens in one sequence (Llama 3.1's context length)
MAX_BATCH = 1024
MAX_REPETITIONS = 1000
MAX_PROMPTS = 1 << 24  # prompts of a set, conversations of a data set
MAX_THREADS = 1024


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse `type`: an integer from `low` to `high`, both included."""
    return _in_range(int, "an integer", low, high, ",")


def float_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse `type`: a number from `low` to `high`, both included."""
    return _in_range(float, "a number", low, high, "g")


def _in_range(kind: type, name: str, low, high, spec: str) -> Callable[[str], int | float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value:{spec}} is out of range: allowed {low:{spec}} to {high:{spec}}")
        return value

    return parse
