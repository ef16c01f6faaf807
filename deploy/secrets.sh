#!/usr/bin/env bash
# deploy/secrets.sh DIR [NAME...] -- a private CA, a server certificate for 127.0.0.1,
# localhost and each NAME, and a token file, in DIR (docs/security.md explains each step):
#   ca.crt server.crt server.key   the CA and the servers' certificate and key
#   tokens                          the servers' --token-file: worker-token's token, one read-only token
#   worker-token                    the workers' TENSORKV_TOKEN
# The image runs as uid 65534: run as root, the key and the token files are made its own
# (mode 0600), so mounted read-only they are readable by the server and by no other user.
# The CA and the certificate last 365 days, and the CA's key is not kept: before they
# expire, run it again and give the servers and the workers the new files (a server takes
# renewed files on new connections without a restart; docs/security.md).
set -euo pipefail
dir=$1; shift
san="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do san="$san,DNS:$name"; done
mkdir -p "$dir"
chmod 0755 "$dir"  # the mount point of the secrets in the container, entered as uid 65534
cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
    -subj "/CN=tensorkv CA" -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=tensorkv" \
    -keyout server.key -out server.csr 2>/dev/null
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
    -extfile <(printf 'subjectAltName=%s' "$san") -out server.crt 2>/dev/null
rm -f server.csr ca.srl ca.key  # nothing else is signed with this CA
python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > worker-token
cp worker-token tokens
python3 -c 'import secrets; print(secrets.token_urlsafe(32), "ro")' >> tokens
chmod 0644 ca.crt server.crt
chmod 0600 server.key tokens worker-token
if [[ $(id -u) -eq 0 ]]; then
    chown 65534:65534 server.key tokens worker-token
else
    echo "$0: not root: server.key, tokens and worker-token are yours (mode 0600), which the image's user" \
         "(uid 65534) cannot read; run it as root, or chown 65534 them" >&2
fi
