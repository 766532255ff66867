"""What every master app shares: the API error type and its JSON shape, the MIRBAD_*
settings and their parsers, JSON input checks, failure throttles and the supervision
record of ``./mirbad up``.

It sits below every app (docs/architecture.md, "Layers"): it imports no app, only
Django, its libraries and ``protocol``.
"""
