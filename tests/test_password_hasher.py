"""Production hashes passwords with PBKDF2 at Django's full cost; only the suite does not.

The suite swaps in a cheap hasher (tests/conftest.py, ``FAST_HASHERS``): this test is the
one place that holds what a real master does, in a fresh process with real settings.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import FAST_HASHERS
from tests.fresh_django import run_django

CODE = """
import django
django.setup()
from django.conf import settings
from django.contrib.auth.hashers import check_password, make_password
encoded = make_password("a-password-of-twenty-chars")
assert check_password("a-password-of-twenty-chars", encoded)
print(settings.PASSWORD_HASHERS[0])
print(encoded.split("$")[0], encoded.split("$")[1])
"""


def test_production_hashes_with_pbkdf2_at_a_million_rounds_or_more(tmp_path: Path) -> None:
    done = run_django(tmp_path, CODE)
    assert done.returncode == 0, done.stderr
    hasher, encoded = done.stdout.splitlines()[-2:]
    assert hasher == "django.contrib.auth.hashers.PBKDF2PasswordHasher"
    algorithm, rounds = encoded.split()
    assert algorithm == "pbkdf2_sha256"
    assert int(rounds) >= 1_000_000


def test_the_suite_runs_with_the_cheap_hasher() -> None:
    from django.conf import settings

    assert settings.PASSWORD_HASHERS == FAST_HASHERS
