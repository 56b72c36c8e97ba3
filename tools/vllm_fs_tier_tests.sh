#!/usr/bin/env bash
# vLLM's own fs-tier tests, run against KVFormatTier: tests/v1/kv_offload/tiering/test_fs_tier.py of vLLM 0.34.0's
# source release (the wheel ships no tests), with tools/vllm_fs_tier_swap.py building a KVFormatTier wherever
# the file builds vLLM's FileSystemTierManager. Every deliberate difference is one row of docs/vllm.md ("vLLM's
# own fs-tier tests"): xfail (runs and must fail) or deselected; anything else that fails, or skips, fails here.
#
# Usage: bash tools/vllm_fs_tier_tests.sh [pytest args]   (exit 0 = no failure). The last line is the summary.
#   KVFORMAT_VENV     venv with vLLM 0.34.0 (default .venv)
#   PIP_INDEX_URL     simple index the sdist comes from (default https://pypi.org/simple); the file is checked
#                     against the sha256 pinned below, so any mirror will do
#   KVFORMAT_CACHE    where the extracted test file is kept (default ~/.cache/kvformat); never the repository:
#                     vLLM's test code is not part of this project, it is fetched when the check runs
#   KVFORMAT_FS_TIER_ALL=1  run every test unmarked, nothing deselected (to re-check the differences)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
t0=$SECONDS
py=$(realpath -m "${KVFORMAT_VENV:-.venv}")/bin/python  # absolute: the run below is from the cache directory
version=0.34.0
sdist_sha256=fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113
member=tests/v1/kv_offload/tiering/test_fs_tier.py
cache=${KVFORMAT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvformat}/vllm-$version-tests
have=$("$py" -c 'import vllm; print(vllm.__version__)')
if [ "$have" != "$version" ]; then
  echo "vllm_fs_tier_tests: needs vLLM $version in ${KVFORMAT_VENV:-.venv} (found $have): the differences are listed for it" >&2
  exit 2
fi
if [ ! -f "$cache/$member" ]; then
  # Only the one test file is kept; the 50 MB sdist is read from a temporary file and dropped.
  "$py" - "$version" "$sdist_sha256" "$member" "$cache" "${PIP_INDEX_URL:-https://pypi.org/simple}" <<'EOF'
import hashlib, json, os, re, sys, tarfile, tempfile, urllib.parse, urllib.request

version, want, member, cache, index = sys.argv[1:]
name = f"vllm-{version}.tar.gz"
page_url = index.rstrip("/") + "/vllm/"
req = urllib.request.Request(page_url, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
with urllib.request.urlopen(req, timeout=60) as r:
    body = r.read().decode()
    json_page = "json" in r.headers.get("Content-Type", "")
if json_page:
    urls = [f["url"] for f in json.loads(body)["files"] if f["filename"] == name]
else:  # an HTML (PEP 503) index: the anchors' hrefs
    urls = [h for h in re.findall(r'href="([^"]+)"', body) if h.split("#")[0].rsplit("/", 1)[-1] == name]
if not urls:
    sys.exit(f"vllm_fs_tier_tests: {name} is not on {page_url}")
url = urllib.parse.urljoin(page_url, urls[0].split("#")[0])
with tempfile.TemporaryFile() as tmp:
    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=600) as r:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            tmp.write(chunk)
    if h.hexdigest() != want:
        sys.exit(f"vllm_fs_tier_tests: {url} has sha256 {h.hexdigest()}, expected {want}")
    tmp.seek(0)
    with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
        data = tar.extractfile(f"vllm-{version}/{member}").read()
dest = os.path.join(cache, member)
os.makedirs(os.path.dirname(dest), exist_ok=True)
with open(dest + ".part", "wb") as f:
    f.write(data)
os.replace(dest + ".part", dest)
with open(os.path.join(cache, "pytest.ini"), "w") as f:
    f.write("[pytest]\n")  # the rootdir's own config: no ini file of a directory above is picked up
print(f"vllm_fs_tier_tests: {member} of {name} ({url}) -> {dest}")
EOF
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
(cd "$cache" && PYTHONPATH="$repo:$repo/tools${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -q -p no:cacheprovider \
  -p vllm_fs_tier_swap -rfEX -W ignore::DeprecationWarning "$member" "$@") 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
# One line: the plugin's counts (tools/vllm_fs_tier_swap.py), the exit status and the wall time.
counts=$(grep -a '^vllm-fs-tier-tests: ' "$log" | tail -n 1 | sed 's/^vllm-fs-tier-tests: //')
echo "vllm_fs_tier_tests: vLLM $version ${counts:-(no counts: pytest stopped before the summary)}; exit $rc in $((SECONDS - t0)) s"
exit $rc
