#!/usr/bin/env bash
# Set up a venv from scratch (idempotent: rerun it at will, or with another VLLM_VERSION to switch):
#   CPU torch first (a bare `torch` would pull a multi-GB CUDA build), then kvformat with its extras,
#   then vLLM without its CUDA dependency pins (--no-deps) plus its import-time deps.
# Environment:
#   VLLM_VERSION   vLLM release to install: 0.34.0 (default, the current release) or 0.33.0
#   KVFORMAT_VENV  venv directory (default .venv; .ci/run builds .venv-vllm033 for the 0.33 run)
#   KVFORMAT_SGLANG  1 (default with vLLM 0.34) installs SGLang 0.5.23's storage and host-pool modules into the same
#                  venv (the SGLang backend's tests and the cross-engine tests need both engines); 0 skips them
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.34.0}
VENV=${KVFORMAT_VENV:-.venv}
case "$VLLM_VERSION" in 0.34.*) SGLANG=${KVFORMAT_SGLANG:-1} ;; *) SGLANG=${KVFORMAT_SGLANG:-0} ;; esac
case "$VLLM_VERSION" in
  0.33.*|0.34.*) ;;
  *) echo "setup.sh: VLLM_VERSION=$VLLM_VERSION is not one kvformat supports (0.33.x, 0.34.x)" >&2; exit 2 ;;
esac
# libfuse2 for tests/hangfs.py (fusepy), the FUSE mount on which tests/test_read_deadline.py hangs a read (the
# library only: as root it mounts without fusermount, and Debian's fuse package would displace MooseFS's fuse3)
if ! ldconfig -p 2>/dev/null | grep -q 'libfuse\.so\.2'; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libfuse2 >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libfuse2 >/dev/null; }
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q torch==2.13.0 numpy
KVFORMAT_REQUIRE_NATIVE=1 pip install -q -e '.[test,s3,seal]' build
pip install -q --no-deps "vllm==$VLLM_VERSION" xgrammar==0.2.8
pip install -q -r requirements/vllm-cpu.txt -r requirements/lint.txt
case "$VLLM_VERSION" in
  # The oracle of the token-movement tests: vLLM 0.34's own Triton cache writers, run by Triton's interpreter
  # (tests/vllm_writers.py). CPU torch does not pull triton; 0.33 has no DeepSeek-V3.2 writers to run.
  0.34.*) pip install -q -r requirements/oracle.txt ;;
esac
if [ "$SGLANG" = 1 ]; then
  # SGLang without its CUDA pins (--no-deps), then what its storage and host-pool modules import. On a CPU torch
  # torchvision is the one snag: PyPI's torchvision wheels are CUDA builds, so its C++ ops do not load, which
  # torchvision tolerates (every op raises when called, SGLang's storage path calls none) except for two fake-op
  # registrations it makes unguarded; they get the same guard as the others (idempotent, and a changed file
  # fails the setup instead of being patched blindly). SGLang imports torchvision at module level
  # (sglang.srt.configs); transformers uses it when present. Nothing else is stubbed or patched. SGLang only
  # imports triton here (no kernel runs): the oracle's pinned triton serves both.
  pip install -q -r requirements/oracle.txt
  pip install -q --no-deps sglang==0.5.23 torchvision==0.28.0
  pip install -q -r requirements/sglang-cpu.txt
  python - <<'PY'
import importlib.util, pathlib
p = pathlib.Path(importlib.util.find_spec("torchvision").submodule_search_locations[0]) / "_meta_registrations.py"
s = p.read_text()
for name in ("torchvision::nms", "torchvision::qnms"):
    old = f'@torch.library.register_fake("{name}")'
    new = f'@(torch.library.register_fake("{name}") if torchvision.extension._has_ops() else (lambda fn: fn))'
    if new not in s:
        assert s.count(old) == 1, f"torchvision changed: {old} not found once in {p}"
        s = s.replace(old, new)
p.write_text(s)
PY
fi
# The integration tests import these; fail the setup here rather than let them skip.
python - "$VLLM_VERSION" "$SGLANG" <<'PY'
import sys

import cryptography, kvformat, moto, s3fs, torch, vllm
if sys.argv[1].startswith("0.34"):
    import triton  # the token-movement tests' oracle (tests/vllm_writers.py)
import vllm.distributed.kv_transfer.kv_connector.v1.offloading.events  # the KV event tracker (0.34 contract tests)
import vllm.v1.kv_offload.tiering.spec
import kvformat.vllm

assert vllm.__version__ == sys.argv[1], (vllm.__version__, sys.argv[1])
print("kvformat", kvformat.__version__, "torch", torch.__version__, "vllm", vllm.__version__)
if sys.argv[2] == "1":
    import sglang.srt.mem_cache.pool_host.mla, sglang.srt.mem_cache.storage, sglang.srt.mem_cache.utils
    import kvformat.sglang
    from importlib.metadata import version
    print("sglang", version("sglang"))
PY
