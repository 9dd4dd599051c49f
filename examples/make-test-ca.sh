#!/usr/bin/env bash
# A throwaway CA and a server certificate it signed, to try fencegate's TLS
# (the listener, or an https:// upstream) on one machine. Not for production.
#
#   examples/make-test-ca.sh DIR [HOST]   # HOST: an IP or a name, default 127.0.0.1
#
# Writes DIR/ca.crt (trust this: --cacert, proxy.upstream_ca_file),
# DIR/server.crt and DIR/server.key (tls.cert_file, tls.key_file). Needs openssl.
set -euo pipefail
dir=${1:?usage: make-test-ca.sh DIR [HOST]}
host=${2:-127.0.0.1}
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=fencegate test CA" \
    -keyout ca.key -out ca.crt 2>/dev/null
if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then san="IP:$host"; else san="DNS:$host"; fi
openssl req -newkey rsa:2048 -nodes -subj "/CN=$host" -keyout server.key -out server.csr 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' "$san" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
    -extfile server.ext -out server.crt 2>/dev/null
rm -f server.csr server.ext ca.srl
chmod 600 ca.key server.key
echo "$dir: ca.crt, server.crt and server.key for $host"
