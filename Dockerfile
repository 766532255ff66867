# One image for every master process and for the agent (the agent uses only agent/ and protocol/).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
RUN useradd --system --uid 1654 mirbad && mkdir -p /data && chown mirbad /data
USER mirbad
EXPOSE 8080 8443 9443
CMD ["python", "-m", "uvicorn", "mirbad_site.asgi:application", "--http", "mirbad_site.http_limits:LimitedHttpToolsProtocol", "--host", "0.0.0.0", "--port", "8080"]
