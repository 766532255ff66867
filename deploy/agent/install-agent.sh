#!/usr/bin/env bash
# Install the MirbadLLM agent on a Linux node: a virtual environment, the
# config file (written once, kept on reinstall), a systemd unit, and the
# enrollment with a single-use join token (from MIRBAD_JOIN_TOKEN or a prompt,
# never from argv).
#
#   MIRBAD_JOIN_TOKEN=... deploy/agent/install-agent.sh \
#       --enroll-url https://master:8443 --ca-hash sha256:... --node-id gpu-1 \
#       [--address https://gpu-1.lan:9443] [--port 9443] [--listen 0.0.0.0] \
#       [--root /] [--no-start]
#
# --root installs under another directory (tests, images); systemd is only
# driven when --root is / and systemctl exists.
set -euo pipefail

usage() { sed -n '2,13p' "$0" >&2; exit 2; }
die() { echo "install-agent: $*" >&2; exit 2; }

ENROLL_URL="" CA_HASH="" NODE_ID="" ADDRESS="" PORT=9443 LISTEN=0.0.0.0 ROOT=/ START=1
while [ $# -gt 0 ]; do
  case "$1" in
    --enroll-url) ENROLL_URL="$2"; shift 2 ;;
    --ca-hash) CA_HASH="$2"; shift 2 ;;
    --node-id) NODE_ID="$2"; shift 2 ;;
    --address) ADDRESS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --listen) LISTEN="$2"; shift 2 ;;
    --root) ROOT="$2"; shift 2 ;;
    --no-start) START=0; shift ;;
    --token) die "--token: a token on the command line is visible to every user; set MIRBAD_JOIN_TOKEN or answer the prompt" ;;
    -h|--help) usage ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[ -n "$ENROLL_URL" ] || die "--enroll-url is required (https://<master>:8443)"
[ -n "$CA_HASH" ] || die "--ca-hash is required (sha256:<base64>, shown by Add node)"
[[ "$NODE_ID" =~ ^[a-z0-9][a-z0-9-]{0,39}$ ]] || die "--node-id '$NODE_ID' is not a valid node id: lower-case letters, digits and '-'"
[[ "$PORT" =~ ^[0-9]+$ ]] && [ "$PORT" -ge 1 ] && [ "$PORT" -le 65535 ] || die "--port '$PORT' is not a port number"
PYTHON="${MIRBAD_PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install Python 3.11 with venv"

SRC="$(cd "$(dirname "$0")/../.." && pwd)"
ROOT="${ROOT%/}"
APP="$ROOT/opt/mirbad-agent"
ETC="$ROOT/etc/mirbad-agent"
STATE="$ROOT/var/lib/mirbad-agent"
MODELS="$ROOT/srv/mirbad/models"
UNIT="$ROOT/etc/systemd/system/mirbad-agent.service"

echo "install-agent: installing into ${ROOT:-/}"
mkdir -p "$APP" "$ETC" "$MODELS" "$(dirname "$UNIT")"
install -d -m 0700 "$STATE"

if [ ! -x "$APP/venv/bin/python" ]; then
  "$PYTHON" -m venv "$APP/venv"
fi
"$APP/venv/bin/python" -m pip install -q --disable-pip-version-check -r "$SRC/deploy/agent/requirements-agent.txt"
rm -rf "$APP/app.new"
mkdir -p "$APP/app.new"
# The agent and the contract it shares with the master (docs/architecture.md, "Layers").
cp -r "$SRC/agent" "$APP/app.new/agent"
cp -r "$SRC/protocol" "$APP/app.new/protocol"
find "$APP/app.new" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$APP/app" && mv "$APP/app.new" "$APP/app"

CONFIG="$ETC/agent.json"
if [ ! -f "$CONFIG" ]; then
  umask 077
  tmp="$(mktemp "$ETC/.agent.json.XXXXXX")"
  cat > "$tmp" <<JSON
{
  "NodeId": "$NODE_ID",
  "StateDirectory": "${STATE#"$ROOT"}",
  "ListenAddress": "$LISTEN",
  "Port": $PORT,
  "ModelsRoot": "${MODELS#"$ROOT"}",
  "Executables": []
}
JSON
  sync "$tmp" 2>/dev/null || true
  mv "$tmp" "$CONFIG"
  echo "install-agent: wrote $CONFIG"
else
  echo "install-agent: keeping the existing $CONFIG"
fi

cat > "$UNIT.new" <<UNIT
[Unit]
Description=MirbadLLM agent
After=network-online.target
Wants=network-online.target

[Service]
Environment=PYTHONPATH=/opt/mirbad-agent/app
ExecStart=/opt/mirbad-agent/venv/bin/python -m agent run --config /etc/mirbad-agent/agent.json
Restart=on-failure
RestartSec=5
# Engines are started in their own process groups and adopted after a restart.
KillMode=process
TimeoutStopSec=45

[Install]
WantedBy=multi-user.target
UNIT
mv "$UNIT.new" "$UNIT"

if [ ! -f "$STATE/agent.crt" ]; then
  if [ -z "${MIRBAD_JOIN_TOKEN:-}" ]; then
    [ -t 0 ] || die "no join token: set MIRBAD_JOIN_TOKEN (Add node in the console shows it)"
    read -r -s -p "Join token: " MIRBAD_JOIN_TOKEN; echo
  fi
  export MIRBAD_JOIN_TOKEN
  address_args=()
  [ -n "$ADDRESS" ] && address_args=(--address "$ADDRESS")
  PYTHONPATH="$APP/app" "$APP/venv/bin/python" -m agent join --enroll-url "$ENROLL_URL" \
    --ca-hash "$CA_HASH" --node-id "$NODE_ID" --state-dir "$STATE" --port "$PORT" "${address_args[@]}"
else
  echo "install-agent: already enrolled ($STATE/agent.crt); not joining again"
fi

if [ "$START" = 1 ] && [ -z "$ROOT" ] && command -v systemctl >/dev/null; then
  systemctl daemon-reload
  systemctl enable --now mirbad-agent.service
  echo "install-agent: started mirbad-agent.service; approve the node in the console"
else
  echo "install-agent: not starting the service (--no-start, --root or no systemd)"
fi
