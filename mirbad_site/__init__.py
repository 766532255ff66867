"""The MirbadLLM master."""

__version__ = "0.1.0"
