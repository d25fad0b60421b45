# Sourced by the client scripts here: start `python -m ourobatch serve` on the shipped model in the
# background (needs PYTHON, MODEL, PORT, OUT), stop it on exit, and return once /health answers.
"$PYTHON" -m ourobatch serve --model "$MODEL" --served-model-name pointer-chase --port "$PORT" \
  --max-num-seqs 64 --log-level warning > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 300); do  # the server is up when /health answers (a process we poll, not a test)
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 "$server" 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 1
done
