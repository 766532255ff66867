# One image for every master process and for the agent (the agent uses only agent/ and
# protocol/). docs/deploy.md says how to build and run it.
#
# BASE: any Debian-like image with Python 3.11 and venv: python:3.11-slim from a
# registry, or a bookworm root file system of your own where none is reachable.
ARG BASE=python:3.11-slim
FROM ${BASE}
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 LANG=C.UTF-8 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# A llama-server mounted into the agent links libgomp, which python:3.11-slim lacks; a
# base that has it needs no package index here.
RUN if ! ldconfig -p | grep -q 'libgomp\.so\.1'; then \
      apt-get update && apt-get install -y --no-install-recommends libgomp1 \
      && rm -rf /var/lib/apt/lists/*; \
    fi

RUN useradd --system --uid 1654 --home-dir /data --no-create-home mirbad \
 && mkdir -p /data /run/mirbad-bootstrap \
 && chown mirbad /data /run/mirbad-bootstrap

WORKDIR /app
# Packages come from PyPI, and from deploy/wheelhouse/ first when it holds wheels;
# PIP_OPTIONS=--no-index installs from the wheelhouse only (a build without network).
ARG PIP_OPTIONS=
COPY requirements.txt ./
COPY deploy/wheelhouse/ /tmp/wheelhouse/
RUN python3 -m venv /opt/venv \
 && pip install --no-cache-dir --find-links /tmp/wheelhouse $PIP_OPTIONS -r requirements.txt \
 && rm -rf /tmp/wheelhouse

COPY manage.py ./
COPY protocol/ protocol/
COPY agent/ agent/
COPY core/ core/
COPY nodes/ nodes/
COPY models_registry/ models_registry/
COPY router/ router/
COPY backups/ backups/
COPY console/ console/
COPY mirbad_site/ mirbad_site/

USER mirbad
EXPOSE 8080 8443 9443
CMD ["python", "-m", "uvicorn", "mirbad_site.asgi:application", "--http", "mirbad_site.http_limits:LimitedHttpToolsProtocol", "--host", "0.0.0.0", "--port", "8080"]
