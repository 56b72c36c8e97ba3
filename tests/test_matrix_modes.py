"""tools/parallel_matrix.py has one page model (issue 32): its default mode and ``--oracle`` (vLLM's own writers,
tests/vllm_writers.py) give the same verdict on every family the writers cover; before, the default's own DSA page
model reported WRONG for TP <-> DCP where vLLM's writers showed every cell hit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")
if not hasattr(__import__("vllm.v1.core.kv_cache_planning", fromlist=["x"]), "get_kv_cache_config_builder"):
    # The writers' page model and the PP/DCP deployments need 0.34's planning API, as tests/test_parallel.py does.
    pytest.skip("vLLM 0.34's KV-cache planning API is needed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import parallel_matrix  # noqa: E402
from vllm_harness import Deployment  # noqa: E402
from vllm_parallel import FAMILIES, ParallelDeployment  # noqa: E402

ARGS = ["--layers", "2", "--chunks", "1", "--bpc", "1", "--logical", "128", "--interleave", "8",
        "--layouts", "TP2,DCP2xTP2"]
# Every family vLLM's writers cover: the DSA families (ParallelDeployment.oracle_covers).
COVERED = [n for n, f in FAMILIES.items() if any("indexer" in k for k in f.specs(2, 64))
           and all(type(s).__name__ == "MLAAttentionSpec" for s in f.specs(2, 64).values())]


def _cells(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, list[str]]:
    rc = parallel_matrix.main(argv)
    out = capsys.readouterr().out.splitlines()
    return rc, [line for line in out if line.strip().startswith(("TP2", "DCP2xTP2"))][:2]


@pytest.mark.parametrize("family", COVERED)
def test_default_mode_gives_the_oracles_verdict(family: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert issubclass(ParallelDeployment, Deployment)
    rc_default, default = _cells(capsys, ["--family", family, *ARGS])
    rc_oracle, oracle = _cells(capsys, ["--family", family, "--oracle", *ARGS])
    assert len(default) == 2 and default == oracle and rc_default == rc_oracle, (default, oracle)
