"""The recipe: its typed schema, loading (YAML and overrides), stage resolution and resume identity."""
