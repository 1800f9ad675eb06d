"""Integrations of attnzoo with other libraries. Each submodule imports its library only when it is imported itself:
``attnzoo.integrations.transformers`` needs ``transformers`` (the ``attnzoo[transformers]`` extra)."""
