"""Templates printed by ``gemini template`` (installed as the ``gemini_templates`` package)."""
