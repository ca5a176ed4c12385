#!/agentenv/bin/busybox sh
# Stands in for envd on a test tools disk: answers HTTP on --port (busybox httpd in the foreground)
# and records its pid, so a test can kill it and watch the supervisor start it again.
B=/agentenv/bin/busybox
PORT=49983
while [ $# -gt 0 ]; do
  case "$1" in --port) PORT="$2"; shift 2 ;; *) shift ;; esac
done
$B mkdir -p /run/fake-envd
echo envd >/run/fake-envd/health
echo $$ >/run/fake-envd/pid
exec $B httpd -f -p "$PORT" -h /run/fake-envd
