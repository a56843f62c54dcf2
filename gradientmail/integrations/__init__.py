"""Callbacks that put a trainer's model in a run: ``integrations.transformers`` (Hugging Face
``Trainer``) and ``integrations.lightning`` (Lightning ``Trainer``). Each imports its
framework when imported, and only then; see ``docs/integrations.md``."""
