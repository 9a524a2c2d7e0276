#!/usr/bin/env bash
# Makes the TLS material of the remote verification tests (tests/data/tls): a test CA, a server
# certificate for localhost and 127.0.0.1, two client certificates (two clients the server tells
# apart by their certificates), all signed by that CA, and a
# second, unrelated CA whose client certificate the server must refuse. Test material only: the
# private keys are public in this repository. Valid for 100 years; run again to replace them.
set -euo pipefail
out="${1:-$(dirname "$0")/../tests/data/tls}"
mkdir -p "$out"
cd "$out"
days=36500
make_ca() {  # make_ca NAME SUBJECT
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.pem" \
    -days "$days" -subj "$2" -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign" 2>/dev/null
}
make_leaf() {  # make_leaf NAME CA SUBJECT EXTENSIONS
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.csr" -subj "$3" 2>/dev/null
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -out "$1.pem" -days "$days" \
    -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
make_ca ca "/CN=specdec test CA"
make_ca other-ca "/CN=specdec unrelated test CA"
make_leaf server ca "/CN=localhost" "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
make_leaf client ca "/CN=specdec test client" "extendedKeyUsage=clientAuth"
make_leaf second-client ca "/CN=specdec second test client" "extendedKeyUsage=clientAuth"
make_leaf stranger other-ca "/CN=specdec unrelated client" "extendedKeyUsage=clientAuth"
rm -f ./*.srl ca.key other-ca.key
echo "wrote $(ls | tr '\n' ' ')to $out"
