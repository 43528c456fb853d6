"""Publishing a draft: a Hub repository with its model card (`hub`)."""
