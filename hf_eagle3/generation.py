"""The public home of EAGLE-3 decoding's entry points, `hf_eagle3.generation`: published drafts' `custom_generate/`
files and users' code import `eagle3_generate` from here. The loop itself lives in `hf_eagle3.decoding`."""

from .decoding.generate import Eagle3GenerateOutput, Eagle3GenerationStats, Eagle3RowStats, eagle3_generate

__all__ = ["Eagle3GenerateOutput", "Eagle3GenerationStats", "Eagle3RowStats", "eagle3_generate"]
