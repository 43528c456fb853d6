"""Model card templates of hf-eagle3 drafts (`huggingface_hub.ModelCard` Jinja templates)."""
