"""One engine, in its own process: ``python engine.py SPEC.json OUT.json``. Serves the prompts of the spec one at
a time, greedily, through the tiering config the spec gives, and writes what the engine reported (tokens,
first-token logprobs, num_cached_tokens per prompt, vLLM's own metrics). With ``dump`` in the spec, after each
prompt whose index is listed, every worker writes the KV-cache blocks that request used (all layers, read from
the worker's own KV-cache tensors through the engine's collective RPC) to ``<dump>.p<i>.rank<r>.pt``: the bytes
oracle of run_e2e.py. Run by run_e2e.py with the shim on PYTHONPATH."""

from __future__ import annotations

import json
import sys
from typing import Any


def _install_block_recorder(worker: Any) -> bool:
    """Runs on each worker: after every scheduler step, remember the block ids of the requests the model runner
    holds (max_num_seqs=1: at most one), so a dump after the request finished still knows its blocks (freed
    blocks keep their contents until another request is scheduled into them)."""
    mr = worker.model_runner
    orig = mr._update_states

    def update_states(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(scheduler_output, *args, **kwargs)
        if mr.requests:
            worker._e2e_blocks = {rid: [list(g) for g in st.block_ids] for rid, st in mr.requests.items()}
        return out

    mr._update_states = update_states
    return True


def _dump_blocks(worker: Any, path: str) -> list[int]:
    """Runs on each worker: the last request's blocks of every attention layer's KV cache, saved with torch."""
    import torch

    rid, groups = list(worker._e2e_blocks.items())[-1]
    ids = torch.tensor(groups[0], dtype=torch.long)
    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    layers = {}
    for name, layer in ctx.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if isinstance(kv, torch.Tensor) and kv.numel():
            layers[name] = kv[ids].contiguous().clone()
    torch.save({"req": rid, "block_ids": groups[0], "layers": layers}, f"{path}.rank{worker.rank}.pt")
    return list(groups[0])


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    # CPU_MLA named: on a CPU with AMX, vLLM's CPU build picks its AMX MLA backend, which takes bf16 weights only
    # (this model is float32 so that the engines' KV is exact to compare).
    llm = LLM(model=spec["model"], tensor_parallel_size=spec["tp"], dtype="float32",
              attention_config={"backend": "CPU_MLA"}, max_num_seqs=1, block_size=16, enforce_eager=True,
              max_model_len=512, seed=0, disable_log_stats=False,
              distributed_executor_backend="mp" if spec["tp"] > 1 else None,
              kv_transfer_config=KVTransferConfig(**spec["kv_transfer_config"]) if spec.get("kv_transfer_config")
              else None)
    dump = spec.get("dump")
    if dump:
        llm.collective_rpc(_install_block_recorder)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 4), logprobs=5)
    results = []
    for i, prompt in enumerate(spec["prompts"]):  # one at a time: the deterministic configuration (issue 36)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        comp = out.outputs[0]
        first = comp.logprobs[0] if comp.logprobs else {}
        results.append({"tokens": list(comp.token_ids), "num_cached_tokens": out.num_cached_tokens,
                        "prompt_tokens": len(out.prompt_token_ids or []),
                        "first_logprobs": {str(k): v.logprob for k, v in first.items()}})
        if dump and i in spec.get("dump_prompts", []):
            results[-1]["dumped_blocks"] = llm.collective_rpc(_dump_blocks, args=(f"{dump}.p{i}",))
    # vLLM's own counters (this process's Prometheus metrics): the oracle for hits and loaded bytes.
    metrics: dict[str, Any] = {}
    for m in llm.get_metrics():
        if any(s in m.name for s in ("kv_offload", "prefix_cache", "kvformat")):
            labels = ",".join(f"{k}={v}" for k, v in sorted(getattr(m, "labels", {}).items()) if k != "engine")
            value = getattr(m, "value", None)
            if value is None and hasattr(m, "count"):
                value = {"count": m.count, "sum": getattr(m, "sum", None)}
            metrics[f"{m.name}{{{labels}}}"] = value
    json.dump({"results": results, "metrics": metrics}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
