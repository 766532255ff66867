"""Every flag of the built llama-server's --help that is off the allow-list is refused.

The flags come from the real engine (``llama-server --help``), not from our table: each
spelling (short, long, ``--no-`` and ``-no-`` forms), as ``FLAG VALUE`` and as
``FLAG=VALUE``, plus the ``_`` spelling llama-server also reads and a ``--no-`` form
of every long flag. Each goes to the master's save check (``POST /api/models`` with it
in ``extra_args``: 400 naming it) and to a real agent's spec check (``POST
/agent/v1/instances``: 422 spec_rejected naming it, nothing started). The allowed
flags are sent with hostile values (a path outside the model folder, shell
metacharacters, a newline, a NUL, a huge number) and must be refused the same way;
``--flag=value`` of an allowed flag too, and, to the agent, every ``LLAMA_ARG_*``
variable the engine reads as a flag, as the launch's env (issue 17, part 9).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID
from rest_framework.test import APIClient

from agent._config import AgentConfig
from agent.http._server import AgentServer
from protocol.engine_flags import EngineFlags, FloatRange, IntRange, engine_flags
from tests.e2e.conftest import ROOT, llama_server_or_fail
from tests.e2e.test_engine_flags_help import parse_help, read_help
from tests.parallel import engine_port_range

# The agent tests' helpers live beside them without a package (pytest puts their folder
# on sys.path the same way when it collects them).
sys.path.insert(0, str(ROOT / "tests" / "agent"))
from agent_support import (
    MASTER_URI,
    Pki,
    client_context,
    issue,
    launch_body,
    make_ca,
    make_identity,
    master_headers,
)
from test_end_to_end import llama_entry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# What every hostile value tries; each must be refused for every allowed flag that
# takes a value (the numbers only where the shape is a number: "1e999" is a fine name).
HOSTILE: dict[str, str] = {
    "a path outside the model folder": "/etc/passwd",
    "a relative path out": "../../../etc/passwd",
    "the model folder, escaped": "{model}/../../etc/passwd",
    "a shell substitution": "$(touch /tmp/mirbad-pwned)",
    "backquotes": "`id`",
    "a command separator": "1;id",
    "a pipe": "1|id",
    "a newline": "1\nid",
    "a NUL": "1\x00",
    "JSON": '{"a":1}',
    "a URL": "http://10.0.0.1/x",
    "a long text": "9" * 400,
}
HOSTILE_NUMBERS: dict[str, str] = {
    "a huge number": "99999999999999999999",
    "an exponent": "1e999",
    "infinity": "inf",
    "not a number": "nan",
    "hex": "0x10",
    "a number with a tail": "12abc",
}
# Values the agent refuses for the system's own flags (the master refuses the flags).
SYSTEM_HOSTILE: list[tuple[list[str], str]] = [
    (["--host", "0.0.0.0"], "--host"),
    (["--host", "::"], "--host"),
    (["--port", "22"], "--port"),
    (["-m", "/etc/passwd"], "-m"),
]

BUILDER_ARGS = ["-m", "{model}", "--alias", "tiny", "--host", "127.0.0.1", "--port", "{port}"]


@dataclass(frozen=True)
class Case:
    """Args to add, the token the refusal must name, and what the case is."""

    args: list[str]
    flag: str
    what: str


@dataclass(frozen=True)
class Cases:
    table: EngineFlags
    # Every spelling -> whether it was derived (not printed by --help itself).
    help_spellings: dict[str, bool]
    allowed: set[str]
    refused: list[Case]
    hostile: list[Case]
    env_names: list[str]


def _spellings_of_help(help_flags: dict[str, bool]) -> dict[str, tuple[bool, bool]]:
    """The help's spellings, plus what llama-server also reads or a user might guess.

    Each spelling -> (takes a value, derived). llama-server reads ``_`` for ``-`` in a
    long flag, so each gets its ``_`` spelling; every long flag gets a ``--no-`` form
    (most have one, some do not: either way it is refused unless the table lists it).
    """
    out = {name: (takes_value, False) for name, takes_value in help_flags.items()}
    for name, takes_value in help_flags.items():
        if name.startswith("--") and "-" in name[2:]:
            out.setdefault("--" + name[2:].replace("-", "_"), (takes_value, True))
        if name.startswith("--") and not name.startswith("--no-"):
            out.setdefault("--no-" + name[2:], (False, True))
    return out


@pytest.fixture(scope="module")
def cases() -> Cases:
    binary = llama_server_or_fail()
    text = read_help(binary)
    help_flags, _ = parse_help(text)
    version = json.loads((binary.parent / "manifest.json").read_text())["version"]
    table = engine_flags("llamacpp", version)
    allowed = {n for f in table.flags for n in f.names}
    spellings = _spellings_of_help(help_flags)
    refused: list[Case] = []
    for name, (takes_value, derived) in sorted(spellings.items()):
        if name in allowed:
            continue
        what = "derived, off the list" if derived else "off the list"
        refused.append(Case([name, "1"] if takes_value else [name], name, what))
        if not derived:  # the joined form of a name the engine does not know adds nothing
            refused.append(Case([f"{name}=1"], f"{name}=1", "off the list, joined"))
    hostile: list[Case] = []
    for flag in table.flags:
        for name in flag.names:
            # The joined form is never read, even for an allowed flag with a good value.
            hostile.append(Case([f"{name}=1"], f"{name}=1", "allowed, joined"))
            if not flag.shape.takes_value:
                # A value after a switch is a token of its own: refused, named.
                hostile.append(Case([name, "$(id)"], "$(id)", "a value after a switch"))
                continue
            values = dict(HOSTILE)
            if flag.names == ("-a", "--alias"):
                # A served name may hold ':' and '/' ("org/model:q8"); llama-server only
                # echoes it in /v1/models, so a URL-shaped name is just a name.
                del values["a URL"]
            if isinstance(flag.shape, IntRange | FloatRange):
                values |= HOSTILE_NUMBERS
            if name != flag.name:  # the same shape as the long name: one value will do
                values = {
                    "a path outside the model folder": values.pop("a path outside the model folder")
                }
            for what, value in values.items():
                hostile.append(Case([name, value], name, what))
    env_names = sorted(set(re.findall(r"\(env: (LLAMA_ARG_[A-Z0-9_]+)\)", text)))
    derived = {name: is_derived for name, (_value, is_derived) in spellings.items()}
    return Cases(table, derived, allowed, refused, hostile, env_names)


def test_the_help_has_the_flags_we_think(cases: Cases) -> None:
    """The parse is not empty, and the allow-list is a small part of the engine's flags."""
    in_help = [n for n, derived in cases.help_spellings.items() if not derived]
    derived = len(cases.help_spellings) - len(in_help)
    off_list = [n for n in in_help if n not in cases.allowed]
    print(
        f"\nllama-server --help: {len(in_help)} spellings, {len(cases.allowed)} allowed, "
        f"{len(off_list)} off the list; {derived} derived spellings (_ and --no-); cases: "
        f"{len(cases.refused)} off-list, "
        f"{len(cases.hostile)} hostile; LLAMA_ARG_ variables: {len(cases.env_names)}"
    )
    assert len(in_help) > 350 and len(cases.allowed) > 100 and len(off_list) > 250
    assert cases.allowed <= set(in_help)  # test_engine_flags_help says so too
    for name in ("--mcp-servers-json", "--tools", "--agent", "--api-key", "--log-file"):
        assert name in in_help and name not in cases.allowed
    assert len(cases.env_names) > 50


# -- the master's save check -------------------------------------------------------------


def _create(client: APIClient, extra: list[str]) -> Any:
    return client.post(
        "/api/models",
        {
            "servedName": "fuzz",
            "sourceFolder": "fuzz",
            "sourceFile": "fuzz.gguf",
            "settings": {"extra_args": extra},
        },
        format="json",
    )


def _master_problem(response: Any, case: Case, table: EngineFlags) -> str | None:
    """None when ``response`` is a 400 refusal of ``case``'s extra args naming its flag.

    A system flag (one the builder sets) is refused as such before its value is read;
    a NUL is refused where the JSON is read, naming the argument's position.
    """
    if response.status_code != 400:
        return f"{response.status_code} {response.content[:200]!r}"
    error = response.json()["error"]
    if "\x00" in case.args[-1]:
        where = f"settings.extra_args[{len(case.args) - 1}]: "
        if error["code"] == "invalid_request" and error["message"].startswith(where):
            return None
        return f"a NUL, {error['code']}: {error['message']}"
    if error.get("code") != "llamacpp_settings_invalid":
        return f"code {error.get('code')}: {error.get('message')}"
    flag = table.lookup(case.args[0])
    named = case.args[0] if flag is not None and not flag.operator else case.flag
    if repr(named) not in error["message"]:
        return f"does not name {named!r}: {error['message']}"
    return None


@pytest.mark.django_db
def test_the_master_refuses_every_flag_off_the_list_and_every_hostile_value(
    cases: Cases, admin_key: str
) -> None:
    from models_registry.models import ModelDefinition

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    control = _create(client, ["--temp", "0.2", "--jinja"])
    assert control.status_code == 201, control.json()  # the same request, allowed args
    ModelDefinition.objects.all().delete()
    failures = []
    for case in cases.refused + cases.hostile:
        problem = _master_problem(_create(client, case.args), case, cases.table)
        if problem:
            failures.append(f"{case.args!r} ({case.what}): {problem}")
    assert not ModelDefinition.objects.exists()
    print(
        f"\nmaster: {len(cases.refused)} off-list and {len(cases.hostile)} hostile "
        f"extra_args refused, {len(failures)} not"
    )
    assert failures == [], "\n".join(failures[:50])


# -- the agent's spec check --------------------------------------------------------------


@pytest.fixture
async def agent_session(tmp_path: Path) -> AsyncIterator[tuple[AgentServer, aiohttp.ClientSession]]:
    """A real AgentServer whose default executable is the built llama-server."""
    ca = make_ca("Test CA")
    eku = [ExtendedKeyUsageOID.CLIENT_AUTH]
    master = issue(ca, cn="master", uris=[MASTER_URI], eku=eku)
    pki = Pki(ca=ca, master=master, other_ca=ca, other_master=master)
    # The agent fsyncs its operation log twice per launch: on a shared disk the 2,500
    # refused launches took 80 s, on tmpfs 20 s (the checks under test never touch it).
    shm = Path("/dev/shm")
    scratch = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() else tmp_path
    try:
        async with _agent(pki, master, scratch / "state", tmp_path) as running:
            yield running
    finally:
        if scratch != tmp_path:
            shutil.rmtree(scratch)


@contextlib.asynccontextmanager
async def _agent(
    pki: Pki, master: Any, state: Path, tmp_path: Path
) -> AsyncIterator[tuple[AgentServer, aiohttp.ClientSession]]:
    state.mkdir(mode=0o700)
    entry = llama_entry(llama_server_or_fail(), tmp_path / "models")  # writes models/tiny
    config = AgentConfig(
        node_id="n1",
        state_directory=state,
        models_root=tmp_path / "models",
        port=0,
        port_range_start=engine_port_range()[0],
        port_range_end=engine_port_range()[1],
        stop_instances_on_shutdown=True,
        executables=(entry,),
    )
    server = AgentServer(config=config, identity=make_identity(pki, state), stop_grace_seconds=2.0)
    await server.start()
    ctx = client_context(pki, master, tmp_path / "client")
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=ctx), headers=master_headers()
    )
    try:
        yield server, session
    finally:
        await session.close()
        await server.stop()


def _body(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    return launch_body(
        servedName="tiny",
        model={"folder": "tiny", "file": "tiny.gguf"},
        args=args,
        env=env or {},
    )


def _without(args: list[str], names: tuple[str, ...]) -> list[str]:
    """``args`` with the flag spelled by any of ``names`` (and its value) taken out."""
    out: list[str] = []
    skip = False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in names:
            skip = index + 1 < len(args)
            continue
        out.append(arg)
    return out


async def _agent_problem(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], flag: str
) -> str | None:
    async with session.post(url, json=body) as resp:
        answer = await resp.json()
    if resp.status != 422 or answer["error"]["code"] != "spec_rejected":
        return f"{resp.status} {answer}"
    if answer["error"]["details"] != {"flag": flag}:
        return f"names {answer['error']['details']}, not {flag!r}: {answer['error']['message']}"
    return None


async def test_the_agent_refuses_every_flag_off_the_list_and_every_hostile_value(
    cases: Cases, agent_session: tuple[AgentServer, aiohttp.ClientSession]
) -> None:
    server, session = agent_session
    url = f"https://127.0.0.1:{server.port}/agent/v1/instances"
    table = cases.table
    failures = []
    checked = 0
    for case in cases.refused + cases.hostile:
        flag = table.lookup(case.args[0])
        base = _without(BUILDER_ARGS, flag.names) if flag is not None else BUILDER_ARGS
        problem = await _agent_problem(session, url, _body([*base, *case.args]), case.flag)
        checked += 1
        if problem:
            failures.append(f"{case.args!r} ({case.what}): {problem}")
    for extra, name in SYSTEM_HOSTILE:
        system = table.lookup(name)
        assert system is not None
        base = _without(BUILDER_ARGS, system.names)
        problem = await _agent_problem(session, url, _body([*base, *extra]), name)
        checked += 1
        if problem:
            failures.append(f"{extra!r} (a system flag's value): {problem}")
    for name in cases.env_names:
        problem = await _agent_problem(session, url, _body(BUILDER_ARGS, {name: "1"}), name)
        checked += 1
        if problem:
            failures.append(f"env {name}: {problem}")
    print(f"\nagent: {checked} launches refused with 422 spec_rejected, {len(failures)} not")
    assert failures == [], "\n".join(failures[:50])
    async with session.get(url) as resp:
        assert (await resp.json())["instances"] == []  # nothing was started
    # The control: the same launch with the builder's args and an allowed flag starts.
    async with session.post(url, json=_body([*BUILDER_ARGS, "--temp", "0.2"])) as resp:
        assert resp.status == 202, await resp.text()  # the fixture's agent stops it
