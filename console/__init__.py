"""The operator's console: every HTML page, its templates and static files, and the
websocket consumers that feed the live pages (docs/architecture.md, "Packages").

It sits above every other app (docs/architecture.md, "Layers"): pages read through the
apps' services; nothing below imports the console.
"""
