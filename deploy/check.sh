#!/usr/bin/env bash
# Bring deploy/compose.yaml up with podman and check it as a production starting point: the
# two replicas share summaries through Redis (a compacted request answered by one replica is
# reused by the other, one summarizer call in all), each replica's /metrics is reachable on
# its own port and not through the balancer, the admin token from the env file opens
# /admin/usage, and the usage ledger survives a restart of Redis (append-only file on a
# volume). It builds images and takes minutes.
#
#   deploy/check.sh     exit 0: passed; 1: failed; 2: could not run (says what is missing)
#
# CI does not run it: .ci/run runs lint, types and the test suite, on a machine without
# podman. Run it by hand after changing the Dockerfile, deploy/ or what they start; a run
# that could not happen (exit 2) is not a pass.
#
# Needs podman with DNS on its networks and podman-compose (`apt-get install podman iptables
# golang-github-containernetworking-plugin-dnsname`, `pip install podman-compose`). The
# containers' open-files and process limits are compose.yaml's, lowered to this host's hard
# limits (`ulimit -Hn`, `ulimit -Hu`) when those are lower; the runtime is your containers.conf's.
# Without an image registry, a local stand-in for python:3.11-slim is made with debootstrap
# when the image is missing (Debian bookworm + python3; a few minutes, once).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
project=compaction-proxy-check

cannot_run() { echo "deploy/check.sh: NOT RUN: $*" >&2; exit 2; }
fail() { echo "deploy/check.sh: FAILED: $*"; exit 1; }

command -v podman >/dev/null || cannot_run "podman is not installed (apt-get install podman)"
if command -v podman-compose >/dev/null; then
  compose=(podman-compose)
elif python3 -c "import podman_compose" 2>/dev/null; then
  compose=(python3 -m podman_compose)
else
  cannot_run "podman-compose is not installed (pip install podman-compose)"
fi
compose+=(-p "$project" -f "$here/compose.yaml")

# The containers find each other by service name (nginx: proxy-1, proxy-2; the proxies:
# redis), which needs DNS on podman's network: netavark with aardvark-dns, or CNI with the
# dnsname plugin (a podman installed without recommends has neither).
if [ "$(podman info --format '{{.Host.NetworkBackend}}' 2>/dev/null)" = cni ]; then
  dnsname=no
  for dir in /usr/local/libexec/cni /usr/libexec/cni /usr/local/lib/cni /usr/lib/cni /opt/cni/bin; do
    [ -x "$dir/dnsname" ] && dnsname=yes
  done
  [ "$dnsname" = yes ] || cannot_run "podman's CNI networks have no DNS here" \
    "(apt-get install golang-github-containernetworking-plugin-dnsname)"
fi

base=docker.io/library/python:3.11-slim
if ! podman image exists "$base" && ! podman pull -q "$base" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || cannot_run "no $base image, no registry and no debootstrap"
  echo "making a local stand-in for $base with debootstrap..."
  rootfs=$(mktemp -d /var/tmp/compaction-proxy-rootfs.XXXXXX)
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -f "$rootfs"/usr/lib/python3.*/EXTERNALLY-MANAGED
  ln -sf python3 "$rootfs/usr/bin/python"
  tar -C "$rootfs" -c . | podman import \
    --change 'CMD ["python3"]' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' - "$base" >/dev/null
  rm -rf "$rootfs"
fi

# Container limits within this host's hard limits (compose.yaml's defaults may be above them).
at_most() { if [ "$1" = unlimited ] || [ "$1" -gt "$2" ]; then echo "$2"; else echo "$1"; fi; }
export CONTAINER_NOFILE=${CONTAINER_NOFILE:-$(at_most "$(ulimit -Hn)" 65536)}
export CONTAINER_NPROC=${CONTAINER_NPROC:-$(at_most "$(ulimit -Hu)" 4096)}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'; }
upstream_port=$(free_port)
PROXY_PORT=$(free_port)
export PROXY_PORT
export UPSTREAM_BASE_URL="http://host.containers.internal:$upstream_port/v1"
METRICS_PORT_1=$(free_port)
METRICS_PORT_2=$(free_port)
export METRICS_PORT_1 METRICS_PORT_2
key_a="pk-check-$RANDOM$RANDOM"
admin_token="admin-check-$RANDOM$RANDOM"
work=$(mktemp -d)
# The env file compose.yaml hands the replicas, as deploy/.env would be (.env.example).
export PROXY_ENV_FILE="$work/check.env"
cat > "$PROXY_ENV_FILE" <<ENV
PROXY_ADMIN_TOKEN=$admin_token
PROXY_KEY_TEAM_A=$key_a
PROXY_KEY_TEAM_B=pk-check-$RANDOM$RANDOM
ENV

# The upstream: answers chat completions (summarizer calls are the ones with max_tokens)
# and counts summarizer calls at GET /calls.
python3 - "$upstream_port" > "$work/upstream.log" 2>&1 <<'PY' &
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
calls = {"summarizer": 0, "forwarded": 0}
class Handler(BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.reply(calls if self.path == "/calls" else {"object": "list", "data": []})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        summary = "max_tokens" in body or "max_completion_tokens" in body
        calls["summarizer" if summary else "forwarded"] += 1
        text = "SUMMARY: a long talk about parsers." if summary else "the answer"
        self.reply({"id": "c", "object": "chat.completion", "model": body.get("model"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
PY
upstream_pid=$!

cleanup() {
  "${compose[@]}" logs > "$work/compose.log" 2>&1 || true
  "${compose[@]}" down -v -t 5 >/dev/null 2>&1 || true  # -v: the check's own Redis volume
  kill "$upstream_pid" 2>/dev/null || true
  echo "logs kept in $work"
}
trap cleanup EXIT

echo "building and starting deploy/compose.yaml ..."
"${compose[@]}" down -v >/dev/null 2>&1 || true  # what an interrupted run left: a fresh ledger
(cd "$root" && "${compose[@]}" build >"$work/build.log" 2>&1) || fail "build (see $work/build.log)"
"${compose[@]}" up -d >"$work/up.log" 2>&1 || fail "up (see $work/up.log)"

lb="http://127.0.0.1:$PROXY_PORT"
# Each replica ready, not only the balancer: nginx passes a request for a replica that is
# still starting to the other one, and the round-robin check below would then fail.
replica_ready() {  # $1: service; its /readyz from inside its container (replicas publish no port)
  podman exec "${project}_$1_1" python -c 'import urllib.request
urllib.request.urlopen("http://127.0.0.1:8080/readyz", timeout=2)' >/dev/null 2>&1
}
for _ in $(seq 1 180); do
  replica_ready proxy-1 && replica_ready proxy-2 && curl -fsS "$lb/readyz" >/dev/null 2>&1 && break
  sleep 1
done
for replica in proxy-1 proxy-2; do
  replica_ready "$replica" || fail "$replica: /readyz did not answer 200 within 180 s"
done
curl -fsS "$lb/readyz" >/dev/null || fail "$lb/readyz did not answer 200 within 180 s"

body=$(python3 -c '
import json
messages = [{"role": "system", "content": "You are a coding agent."}]
for i in range(8):
    messages += [{"role": "user", "content": f"turn {i}: please refactor the parser " * 20},
                 {"role": "assistant", "content": f"done {i}: changed the tokenizer " * 20}]
messages.append({"role": "user", "content": "What is the state now?"})
print(json.dumps({"model": "gpt-4o-mini", "messages": messages}))')

ask() {  # $1: request id; prints the x-compaction-status and x-compaction-cache headers
  curl -fsS -o /dev/null -D - "$lb/v1/chat/completions" \
    -H "authorization: Bearer $key_a" -H "content-type: application/json" \
    -H "x-compaction: force" -H "x-request-id: $1" -d "$body" \
    | tr -d '\r' | awk -F': ' 'tolower($1)=="x-compaction-status"{s=$2} tolower($1)=="x-compaction-cache"{c=$2} END{print s, c}'
}
first=$(ask check-first) || fail "first request"
second=$(ask check-second) || fail "second request"
calls=$(curl -fsS "http://127.0.0.1:$upstream_port/calls")
echo "first: $first; second: $second; upstream: $calls"

# Round robin: the two requests must have been answered by different replicas.
served() {  # $1: service; the check's request ids in its log (none is an answer too)
  podman logs "${project}_$1_1" 2>&1 | grep -o '"request_id": "check-[a-z]*"' | sort -u || true
}
one=$(served proxy-1)
two=$(served proxy-2)
echo "proxy-1 served: ${one:-nothing}; proxy-2 served: ${two:-nothing}"
[ "$first" = "compacted miss" ] || fail "first request: expected 'compacted miss', got '$first'"
[ "$second" = "reused hit" ] || fail "second request: expected 'reused hit', got '$second'"
[ -n "$one" ] && [ -n "$two" ] && [ "$one" != "$two" ] \
  || fail "the two requests were not answered by different replicas"
python3 -c 'import json,sys; sys.exit(json.loads(sys.argv[1])["summarizer"] != 1)' "$calls" \
  || fail "expected exactly one summarizer call across both replicas: $calls"

# Each replica's metrics on its own port; none through the balancer.
for port in "$METRICS_PORT_1" "$METRICS_PORT_2"; do
  scraped=$(curl -fsS "http://127.0.0.1:$port/metrics") || fail "127.0.0.1:$port/metrics"
  grep -q '^compaction_proxy_requests_total' <<<"$scraped" \
    || fail "no proxy metrics on 127.0.0.1:$port/metrics"
done
status=$(curl -s -o /dev/null -w '%{http_code}' "$lb/metrics")
[ "$status" = 404 ] || fail "/metrics through the balancer answered $status, expected 404"

# The admin token from the env file; the ledger's two requests, before and after Redis
# restarts (usage is written in 0.5 s batches: polled, bounded).
requests() {  # team-a's requests today, from /admin/usage (empty when unreachable)
  curl -fsS -H "authorization: Bearer $admin_token" "$lb/admin/usage?key=team-a" 2>/dev/null \
    | python3 -c 'import json,sys; print(sum(r["requests"] for r in json.load(sys.stdin)["data"]))' \
    2>/dev/null || true
}
for _ in $(seq 1 50); do [ "$(requests)" = 2 ] && break; sleep 0.2; done
[ "$(requests)" = 2 ] || fail "/admin/usage: expected 2 requests for team-a, got '$(requests)'"
"${compose[@]}" restart redis >"$work/restart.log" 2>&1 || fail "restart redis (see $work/restart.log)"
for _ in $(seq 1 60); do [ "$(requests)" = 2 ] && break; sleep 0.5; done
[ "$(requests)" = 2 ] || fail "after a Redis restart: expected 2 requests, got '$(requests)'"
echo "deploy/check.sh: PASSED: two replicas behind one port share summaries through Redis;" \
  "metrics per replica; the usage ledger survives a Redis restart"
