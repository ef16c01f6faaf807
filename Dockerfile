# tensorkv server image: `podman build -t tensorkv .` then
# `podman run --network=host tensorkv --num-workers 2 --mode sync`
FROM python:3.11-slim

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY client client
COPY server server
RUN pip install --no-cache-dir . && cd / && rm -rf /src

# Large tensors are received in many 1 MiB chunks: keep big buffers out of glibc's arenas.
ENV GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576:glibc.malloc.trim_threshold=268435456:glibc.malloc.arena_max=2 \
    PYTHONUNBUFFERED=1
USER 65534:65534
EXPOSE 50051
ENTRYPOINT ["tensorkv-server", "--host", "0.0.0.0", "--port", "50051"]
CMD ["--num-workers", "1", "--mode", "sync"]
