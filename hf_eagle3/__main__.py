"""`python -m hf_eagle3 ...`: the `hf-eagle3` command (useful where the console script is not on PATH, and for
`accelerate launch -m hf_eagle3 train ...`)."""

from .cli import main

main()
