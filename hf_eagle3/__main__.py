"""`python -m hf_eagle3 ...`: the `hf-eagle3` command (useful where the console script is not on PATH, and for
`accelerate launch -m hf_eagle3 train ...`)."""

from .commands.cli import main

main()
