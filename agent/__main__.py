"""Command line of the node agent.

    python -m agent run --config FILE
    python -m agent join --enroll-url URL --ca-hash sha256:B64 --node-id ID --state-dir DIR
                         [--address URL]... [--force]
    python -m agent install-llama-server --runtimes-dir DIR [--cache-dir DIR] [--config FILE]
    python -m agent stop-engines --config FILE
    python -m agent version

The join token comes from MIRBAD_JOIN_TOKEN or an interactive prompt, never from argv,
because argv is visible to every local user in the process list.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import sys
from pathlib import Path

from agent._config import load_config, normalize_address
from agent._errors import AgentError, ConfigError
from agent._run import configure_logging, run_agent
from agent._version import PROTOCOL_VERSIONS, __version__
from agent.engines import install_llama_server, stop_recorded_containers, stop_recorded_engines
from agent.identity import join
from protocol.names import node_id_problem

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m agent", description="MirbadLLM node agent")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve the agent API")
    run.add_argument(
        "--config",
        default=os.environ.get("MIRBAD_AGENT_CONFIG"),
        help="the JSON config file (default: $MIRBAD_AGENT_CONFIG)",
    )

    joiner = sub.add_parser("join", help="enroll this node with a master once, then exit")
    joiner.add_argument("--enroll-url", required=True, help="https://<master>:8443")
    joiner.add_argument("--ca-hash", required=True, help="sha256:<base64 of the CA's SPKI hash>")
    joiner.add_argument("--node-id", required=True)
    joiner.add_argument("--state-dir", required=True, type=Path)
    joiner.add_argument(
        "--address",
        action="append",
        default=[],
        help="an address the master can reach this agent at (repeatable)",
    )
    joiner.add_argument("--port", type=int, default=9443, help="port for --address without one")
    joiner.add_argument("--force", action="store_true", help="replace an existing identity")
    # Accepted only to refuse it with the fix: argv is visible to every user (ps, /proc).
    joiner.add_argument("--token", help=argparse.SUPPRESS)

    install = sub.add_parser("install-llama-server", help="build and lay out llama-server")
    install.add_argument("--runtimes-dir", required=True, type=Path)
    install.add_argument("--cache-dir", type=Path, default=None)
    install.add_argument(
        "--config",
        default=None,
        help="the agent's JSON config file, for ArchiveMaxMembers and ArchiveMaxBytes "
        "(their defaults without it)",
    )

    leftovers = sub.add_parser(
        "stop-engines",
        help="stop the engines a stopped or killed agent left running (from its own records)",
    )
    leftovers.add_argument(
        "--config",
        default=os.environ.get("MIRBAD_AGENT_CONFIG"),
        help="the agent's JSON config file (default: $MIRBAD_AGENT_CONFIG)",
    )

    sub.add_parser("version", help="print the agent version")
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    if not args.config:
        print("agent: --config: no config file given; pass --config FILE", file=sys.stderr)
        return EXIT_CONFIG
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return run_agent(config)


def _cmd_join(args: argparse.Namespace) -> int:
    if args.token is not None:
        print(
            "agent: --token: a token on the command line is visible to every user of this "
            "machine; set MIRBAD_JOIN_TOKEN or answer the prompt instead",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    problem = node_id_problem(args.node_id)
    if problem is not None:
        print(f"agent: --node-id: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging("INFO")
    token = os.environ.get("MIRBAD_JOIN_TOKEN", "")
    if not token and sys.stdin.isatty():
        token = getpass.getpass("Join token: ").strip()
    try:
        addresses = [normalize_address(a, args.port) for a in args.address]
    except ValueError as exc:
        print(f"agent: --address: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not addresses:
        addresses = [f"https://127.0.0.1:{args.port}"]
    try:
        identity = join(
            enroll_url=args.enroll_url,
            ca_hash=args.ca_hash,
            node_id=args.node_id,
            state_dir=args.state_dir,
            addresses=addresses,
            token=token,
            force=args.force,
        )
    except AgentError as exc:
        print(f"agent: join: {exc}", file=sys.stderr)
        return 1
    print(f"Enrolled node {identity.node_id}.")
    print(f"Certificate fingerprint (SPKI SHA-256): {identity.spki_sha256}")
    print("Compare it with the one the console shows before approving the node.")
    return 0


def _cmd_install(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config) if args.config else None
        entry = install_llama_server(
            runtimes_dir=args.runtimes_dir, cache_dir=args.cache_dir, config=config
        )
    except AgentError as exc:
        print(f"agent: install-llama-server: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(entry))
    return 0


def _cmd_stop_engines(args: argparse.Namespace) -> int:
    """Prints the stopped pids as JSON; only for when that agent is gone."""
    if not args.config:
        print("agent: --config: no config file given; pass --config FILE", file=sys.stderr)
        return EXIT_CONFIG
    try:
        config = load_config(args.config)
        stopped = stop_recorded_engines(config)
        containers = stop_recorded_containers(config)
    except (AgentError, OSError) as exc:
        print(f"agent: stop-engines: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"stopped": stopped, "containers": containers}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "join":
        return _cmd_join(args)
    if args.command == "install-llama-server":
        return _cmd_install(args)
    if args.command == "stop-engines":
        return _cmd_stop_engines(args)
    print(f"mirbad-agent {__version__} (protocol {', '.join(map(str, PROTOCOL_VERSIONS))})")
    return 0


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
