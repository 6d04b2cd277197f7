"""The ``gemini`` command line: click commands that parse, call ``launcher`` and render."""
