"""The contract the master and the agent both import (docs/architecture.md, "Packages").

No Django, no agent runtime: the HTTP/1.1 wire client (``wire``, ``wire_response``),
the agent's error header and codes and the wire errors (``errors``), the fencing triple
(``fencing``), SPIFFE ids and the SPKI pin (``identity``), node, instance and folder
names (``names``), protocol versions (``versions``), instance states (``states``), the
listener limits (``http_limits``), the engine flag allow-lists (``engine_flags``), the
atomic write (``atomic``) and the tiny GGUF writer for demos and tests (``tinygguf``,
which alone needs numpy and gguf, imported only when called).
"""
