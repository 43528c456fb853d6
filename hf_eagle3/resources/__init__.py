"""What the commands load: models by name or path (`loading`), the embedded SmolLM2 target (`smollm2`), and the
prompt sets (`prompts`)."""
