#!/usr/bin/env bash
# Install vLLM 0.33.0 into a venv for the hicache-cp connector (hicache_cp.integrations.vllm)
# without its GB-sized dependency tree, keeping the CPU torch pin.
#
#   scripts/install_vllm.sh [PYTHON]          # default: .venv/bin/python
#
# vLLM's wheel pins torch==2.14.0, flashinfer, triton and more: a plain `pip install vllm`
# pulls GBs of CUDA packages. Here the wheel goes in with --no-deps, then exactly the small
# packages its imports need (the scheduler, the KV-connector API, config and model
# inspection of a DeepSeek config), also --no-deps and pinned to versions vLLM 0.33.0
# accepts. Only packages that are missing are installed: torch, numpy, transformers and
# anything already present are never upgraded or downgraded. Idempotent; a second run
# only checks (about a second). Needs transformers>=5.16.1,<5.21 already installed
# (the project's setup installs 5.20.x).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
VLLM_VERSION=0.33.0

# Module -> pinned distribution. The left column is what vLLM's imports ask for;
# pins follow vLLM 0.33.0's metadata where it pins (xgrammar, llguidance, fastapi,
# apache-tvm-ffi, oss-harmony) and are versions checked on this platform otherwise.
# xgrammar's own dependency on triton (about 1 GB) is left out: nothing imports it here.
PACKAGES=(
  "psutil:psutil==7.2.2"
  "zmq:pyzmq==27.3.0"
  "cbor2:cbor2==6.3.0"
  "aiohttp:aiohttp==3.14.5"
  "aiohappyeyeballs:aiohappyeyeballs==2.7.1"
  "aiosignal:aiosignal==1.4.0"
  "attr:attrs==26.1.0"
  "frozenlist:frozenlist==1.8.0"
  "multidict:multidict==7.2.1"
  "propcache:propcache==0.5.4"
  "yarl:yarl==1.25.1"
  "requests:requests==2.34.2"
  "urllib3:urllib3==2.8.0"
  "certifi:certifi==2026.10.19.post1"
  "charset_normalizer:charset-normalizer==3.5.3"
  "openai_harmony:oss-harmony==0.0.11"
  "openai:openai==3.57.0"
  "jiter:jiter==0.19.0"
  "sniffio:sniffio==1.3.1"
  "PIL:pillow==13.0.0"
  "pybase64:pybase64==1.5.1"
  "cachetools:cachetools==8.0.2"
  "msgspec:msgspec==0.23.0"
  "cloudpickle:cloudpickle==3.1.3"
  "uvloop:uvloop==0.23.0"
  "cpuinfo:py-cpuinfo==9.0.0"
  "prometheus_client:prometheus_client==0.26.0"
  "xgrammar:xgrammar==0.2.8"
  "tvm_ffi:apache-tvm-ffi==0.1.11"
  "fastapi:fastapi==0.136.3"
  "starlette:starlette==1.10.0"
  "annotated_doc:annotated-doc==0.0.7"
  "typing_inspection:typing-inspection==0.4.5"
  "partial_json_parser:partial-json-parser==0.2.1.1.post7"
  "llguidance:llguidance==1.7.6"
  "einops:einops==0.8.2"
  "opentelemetry:opentelemetry-api==1.45.2"
)

if ! "$PY" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then
  echo "error: $PY is not a virtual environment's python; refusing to install into it" >&2
  exit 2
fi
if ! "$PY" - <<'EOF'
import importlib.metadata as m, sys
try:
    v = tuple(int(x) for x in m.version("transformers").split(".")[:2])
except m.PackageNotFoundError:
    v = None
sys.exit(0 if v is not None and (5, 16) <= v < (5, 21) else 1)
EOF
then
  echo "error: vLLM $VLLM_VERSION needs transformers>=5.16.1,<5.21 installed first (the project's hf extra)" >&2
  exit 2
fi
need=()
if [ "$("$PY" -c "import importlib.metadata as m; print(m.version('vllm'))" 2>/dev/null || true)" != "$VLLM_VERSION" ]; then
  need+=("vllm==$VLLM_VERSION")
fi
mods=$(printf '%s\n' "${PACKAGES[@]}" | cut -d: -f1 | tr '\n' ' ')
missing=$("$PY" - $mods <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
)
for entry in "${PACKAGES[@]}"; do
  mod=${entry%%:*}
  if [[ " $missing " == *" $mod "* ]]; then need+=("${entry#*:}"); fi
done
if [ ${#need[@]} -eq 0 ]; then
  echo "vllm $VLLM_VERSION and its small dependencies are installed"
  exit 0
fi
torch_before=$("$PY" -c "import torch; print(torch.__version__)")
echo "installing (--no-deps): ${need[*]}"
"$PY" -m pip install -q --no-deps "${need[@]}"
torch_after=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
  echo "error: torch changed from $torch_before to $torch_after" >&2
  exit 1
fi
echo "vllm $VLLM_VERSION installed; torch $torch_after unchanged"
