"""The extra args of issue 11 that an admin key could pass to llama-server, and more.

Each entry is (extra args, the flag a refusal must name). The master must refuse
them as ``extra_args`` and the agent, given them in a launch argv, with 422
spec_rejected naming the flag.
"""

from __future__ import annotations

# Starts `touch PWNED` as the agent's user when llama-server starts (issue 11).
MCP_JSON = '{"mcpServers":{"p":{"command":"touch","args":["PWNED"]}}}'

ISSUE_ATTACKS: list[tuple[list[str], str]] = [
    (["--mcp-servers-json", MCP_JSON], "--mcp-servers-json"),
    (["--tools", "all"], "--tools"),
    (["--agent"], "--agent"),
    (["--media-path", "."], "--media-path"),
    (["--log-prompts-dir", "prompts"], "--log-prompts-dir"),
    (["--models-dir", "."], "--models-dir"),
    (["-lcd", "cache.bin"], "-lcd"),
    (["--props"], "--props"),
    (["--slots"], "--slots"),
    (["--cors-origins", "*"], "--cors-origins"),
]

# Ways around a list of refused flags that an allow-list must catch as well.
BYPASSES: list[tuple[list[str], str]] = [
    # llama-server reads "_" as "-" in a long flag.
    (["--mcp_servers_json", MCP_JSON], "--mcp_servers_json"),
    (["--mcp-servers-config", "mcp.json"], "--mcp-servers-config"),
    (["--ui-mcp-proxy"], "--ui-mcp-proxy"),
    (["--ui"], "--ui"),
    (["--api-key", "k"], "--api-key"),
    (["--log-file", "x.log"], "--log-file"),
    (["--slot-save-path", "."], "--slot-save-path"),
    (["--chat-template-file", "t.jinja"], "--chat-template-file"),
    (["--chat-template-kwargs", '{"a":1}'], "--chat-template-kwargs"),
    (["-hf", "org/repo"], "-hf"),
    (["--rpc", "10.0.0.1:50052"], "--rpc"),
    (["--temp=0.2"], "--temp=0.2"),
    # A value that is not of the flag's shape.
    (["--temp", "nan"], "--temp"),
    (["--temp", "1e3"], "--temp"),
    (["--top-k", "40abc"], "--top-k"),
    (["--reasoning-format", "$(touch x)"], "--reasoning-format"),
    # A value that has no flag before it.
    (["0.2"], "0.2"),
]
