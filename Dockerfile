# tensorkv server image: `podman build -t tensorkv .` then, with a certificate, its key and a
# token file in ./secrets (readable by uid 65534; see docs/security.md):
# `podman run -p 50051:50051 -p 50052:50052 -v "$PWD/secrets:/tensorkv/secrets:ro" tensorkv \
#      --tls-cert secrets/server.crt --tls-key secrets/server.key --token-file secrets/tokens \
#      --num-workers 2 --mode sync`
# It listens on 0.0.0.0, so without TLS and a token (or --tls-client-ca) it refuses to start unless
# given --insecure.
FROM python:3.11-slim

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY client client
COPY server server
RUN pip install --no-cache-dir . && cd / && rm -rf /src

# The server tunes glibc's malloc for tensor streams itself (tensorkv/wire/allocator.py); a
# GLIBC_TUNABLES given with `podman run -e` replaces that tuning.
ENV PYTHONUNBUFFERED=1
# Snapshots of the server's state (--state-dir): mount a volume here to keep them across containers.
RUN mkdir -p /var/lib/tensorkv && chown 65534:65534 /var/lib/tensorkv
VOLUME /var/lib/tensorkv
# Examples for a worker run from this image (`make cluster` trains examples/train.py).
COPY examples/train.py examples/tutorial_dist.py /tensorkv/examples/
USER 65534:65534
WORKDIR /tensorkv
# Prometheus metrics on 50053 (http://HOST:50053/metrics).
EXPOSE 50051 50052 50053
ENTRYPOINT ["tensorkv-server", "--host", "0.0.0.0", "--port", "50051", "--data-port", "50052", "--metrics-port", "50053", \
            "--state-dir", "/var/lib/tensorkv"]
CMD ["--num-workers", "1", "--mode", "sync"]
