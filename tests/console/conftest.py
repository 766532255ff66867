"""Console tests reuse the in-process enrolled agent of the node tests."""

from tests.nodes.conftest import enrolled  # noqa: F401  (a fixture, used by name)
