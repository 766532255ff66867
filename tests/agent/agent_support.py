"""Plain helpers for the agent tests (the fixtures live in conftest.py)."""

from __future__ import annotations

import datetime as dt
import json
import ssl
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent._config import AgentConfig, ExecutableEntry
from agent.engines._executables import Catalogue, write_manifest
from agent.engines.process._runtime import ProcessRuntime
from agent.http._server import AgentServer
from agent.identity._tls import Identity, load_identity, store_identity
from agent.state._events import EventBus
from protocol.identity import node_spiffe_id

MASTER_URI = "spiffe://mirbadllm/master"


@dataclass(frozen=True)
class Issued:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def write(self, folder: Path, name: str) -> tuple[Path, Path]:
        folder.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
        cert_path.write_bytes(self.cert_pem)
        key_path.write_bytes(self.key_pem)
        return cert_path, key_path


def make_ca(name: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Issued(key, cert)


def issue(
    ca: Issued,
    *,
    cn: str,
    uris: list[str],
    eku: list[x509.ObjectIdentifier],
    public_key: ec.EllipticCurvePublicKey | None = None,
    dns: list[str] | None = None,
) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    sans += [x509.DNSName(d) for d in dns or []]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca.cert.subject)
        .public_key(public_key or key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if eku:
        builder = builder.add_extension(x509.ExtendedKeyUsage(eku), critical=False)
    return Issued(key, builder.sign(ca.key, hashes.SHA256()))


@dataclass(frozen=True)
class Pki:
    ca: Issued
    master: Issued
    other_ca: Issued
    other_master: Issued

    def node(self, node_id: str, **kw: Any) -> Issued:
        return issue(
            self.ca,
            cn=node_id,
            uris=[node_spiffe_id(node_id)],
            eku=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
            **kw,
        )


def client_context(pki: Pki, client: Issued | None, folder: Path) -> ssl.SSLContext:
    """A master-side client context: trust the test CA, present ``client``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=pki.ca.cert_pem.decode())
    if client is not None:
        cert_path, key_path = client.write(folder, f"client-{id(client)}")
        ctx.load_cert_chain(str(cert_path), str(key_path))
    return ctx


def make_identity(pki: Pki, state_dir: Path, node_id: str = "n1") -> Identity:
    node = pki.node(node_id)
    store_identity(state_dir, key=node.key, cert_pem=node.cert_pem, ca_pem=pki.ca.cert_pem)
    return load_identity(state_dir, node_id=node_id)


# The fake engines are driven by these variables; the test agents allow them the way
# a node's operator would (EngineEnvAllow), since no engine allow-list has them.
FAKE_ENGINE_ENV = (
    "FAKE_MODE",
    "FAKE_RELEASE_FILE",
    "FAKE_CHILD_PID_FILE",
    "FAKE_READY_DELAY",
    "FAKE_ENV_FILE",
    "FAKE_GPU_DIR",
    "FAKE_GPU_ALLOC_MIB",
    "FAKE_ALLOC_MIB",
    "FAKE_CHILD_ALLOC_MIB",
    "FAKE_GROW_MIB",
    "FAKE_GROW_AFTER",
)

FAKE_ENGINE = textwrap.dedent(
    r"""
    import json, os, signal, subprocess, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    def opt(name):
        return args[args.index(name) + 1] if name in args else None

    port, alias = int(opt("--port")), opt("--alias")
    key = os.environ.get("LLAMA_API_KEY", "")
    mode = os.environ.get("FAKE_MODE", "ok")
    release = os.environ.get("FAKE_RELEASE_FILE", "")
    print("fake engine: argv", args, "key set:", bool(key), flush=True)
    if mode == "exit_early":
        for i in range(5):
            print(f"fake engine: loading step {i}", flush=True)
        print("error: the model file is broken", flush=True)
        sys.exit(3)
    if mode == "child":
        child = subprocess.Popen(["sleep", "300"])
        with open(os.environ["FAKE_CHILD_PID_FILE"], "w") as f:
            f.write(str(child.pid))
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            print("fake engine:", fmt % a, flush=True)

        def send_json(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def authorized(self):
            return self.headers.get("Authorization") == f"Bearer {key}"

        def read_body(self):
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def chunk(self, data):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def handle_any(self):
            path = self.path.split("?")[0]
            if path == "/health":
                if mode == "never_ready":
                    return self.send_json(503, {"error": {"message": "Loading model"}})
                return self.send_json(200, {"status": "ok"})
            if not self.authorized():
                return self.send_json(401, {"error": {"message": "Invalid API Key"}})
            if path == "/v1/models":
                name = "someone-else" if mode == "wrong_alias" else alias
                return self.send_json(200, {"models": [{"name": name, "model": name}],
                                            "data": [{"id": name}]})
            if path == "/crash":
                self.send_json(200, {"crashing": True})
                self.wfile.flush()
                os._exit(7)
            if path == "/echo":
                body = self.read_body()
                return self.send_json(200, {"method": self.command, "path": self.path,
                                            "headers": dict(self.headers.items()),
                                            "body": body.decode("utf-8", "replace")})
            if path == "/sse":
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.chunk(b"data: first\n\n")
                deadline = time.time() + 10
                while release and not os.path.exists(release) and time.time() < deadline:
                    time.sleep(0.02)
                self.chunk(b"data: second\n\n")
                self.chunk(b"")
                return
            if path == "/stall":
                time.sleep(30)
                return
            return self.send_json(404, {"error": {"message": "not found"}})

        do_GET = do_POST = do_PUT = do_DELETE = handle_any

    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"fake engine: listening on {port}", flush=True)
    server.serve_forever()
    """
)


def launch_body(instance_id: str = "m-1", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "instanceId": instance_id,
        "modelId": 1,
        "servedName": "demo",
        "runtime": "llamacpp",
        "delivery": "process",
        "executable": {"name": "llama.cpp", "version": None},
        "model": {"folder": "demo", "file": "demo.gguf"},
        "args": ["-m", "{model}", "--alias", "demo", "--host", "127.0.0.1", "--port", "{port}"],
        "env": {},
    }
    body.update(overrides)
    return body


@dataclass
class RunningAgent:
    server: AgentServer
    session: aiohttp.ClientSession
    tmp: Path
    pki: Pki

    @property
    def base(self) -> str:
        return f"https://127.0.0.1:{self.server.port}"

    def url(self, path: str) -> str:
        return self.base + path


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def master_headers(epoch: int = 1, instance: str = "test-master", boot: str = "boot-1") -> dict:
    """The fencing headers every mutating request from the master carries."""
    return {
        "MirbadLLM-Master": f"{instance}/{epoch}/{boot}",
        "MirbadLLM-Request-Time": dt.datetime.now(dt.UTC).isoformat(),
    }


async def start_runtime(
    config: AgentConfig, *, ready_poll_interval: float = 0.1, **kw: Any
) -> ProcessRuntime:
    """A started ProcessRuntime on ``config``'s verified executables, quick to stop."""
    catalogue = Catalogue(entries=config.executables)
    catalogue.verify()
    runtime = ProcessRuntime(
        config=config,
        catalogue=catalogue,
        bus=EventBus(),
        ready_poll_interval=ready_poll_interval,
        stop_grace_seconds=kw.pop("stop_grace_seconds", 1.0),
        **kw,
    )
    await runtime.start()
    return runtime


def make_fake_engine(root: Path) -> ExecutableEntry:
    """A verified executable folder under ``root`` whose llama-server is FAKE_ENGINE."""
    folder = root / "runtimes" / "llama.cpp" / "fake-1"
    folder.mkdir(parents=True)
    script = folder / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + FAKE_ENGINE)
    script.chmod(0o755)
    write_manifest(folder, name="llama.cpp", version="fake-1")
    return ExecutableEntry(name="llama.cpp", version="fake-1", path=script, default=True)
