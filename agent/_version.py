"""The agent's version; the protocol versions it speaks are protocol.versions'."""

from protocol.versions import PROTOCOL_VERSIONS

__all__ = ["PROTOCOL_VERSIONS", "__version__"]

__version__ = "0.1.0"
