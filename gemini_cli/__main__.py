"""``python -m gemini_cli`` runs the ``gemini`` command."""

from gemini_cli.main import entry

entry()
