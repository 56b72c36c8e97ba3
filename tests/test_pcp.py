"""Prefill context parallel (PCP) ranks hold replicas, not token shards: established from vLLM 0.34 (issue 20 item 4).

vLLM's offloading ``canonical_mapping`` treats PCP as token sharding (``cp_size = dcp * pcp``), but the code that
decides where tokens live does not: the scheduler's KV-cache manager scales its block by DCP only, the model
runner's slot mapping shards tokens over DCP only, and ``PCPManager`` writes the KV gathered from every PCP
rank into every PCP rank's cache through the global batch's slot mappings. The tier therefore composes PCP as
one more replica of each (stage, DCP rank) part and checks those replicas on every store
(tests/test_parallel.py ``test_pcp_ranks_are_replicas_and_share_files``, PCP with and without DCP).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.single_type_kv_cache_manager")
if pytest.importorskip("vllm").__version__ < "0.34":
    pytest.skip("these are vLLM 0.34's PCP facts (its pcp_manager, scheduler and runner)", allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402


def _source(rel: str) -> str:
    import os

    import vllm

    with open(os.path.join(os.path.dirname(vllm.__file__), rel), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("dcp,pcp", [(1, 2), (2, 2), (2, 1), (4, 2)])
def test_vllms_kv_cache_manager_blocks_count_dcp_ranks_only(dcp, pcp):
    """vLLM's own manager (the real class): a block of a PCP x DCP deployment covers block_size x DCP tokens, so
    PCP ranks cannot each hold other tokens of it."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16)
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    m = FullAttentionManager(spec, pool, True, 0, scheduler_block_size=16 * dcp, dcp_world_size=dcp,
                             pcp_world_size=pcp)
    assert m.block_size == 16 * dcp


def test_vllms_scheduler_runner_and_pcp_manager_place_tokens_by_dcp_only():
    """The facts the tier's PCP rule rests on, as the installed vLLM's source states them (a vLLM that changes
    any of them fails here before a deployment stores a wrong part)."""
    sched = _source("v1/core/sched/scheduler.py")
    assert "dcp_world_size=self.dcp_world_size,\n            pcp_world_size=1," in sched
    runner = _source("v1/worker/gpu/model_runner.py")
    assert "cp_size=self.dcp_size,\n            cp_rank=self.dcp_rank," in runner
    pcp = _source("v1/worker/gpu/pcp_manager.py")
    assert "KV and hidden states are gathered back to every PCP rank" in pcp
    assert "global_batch_slot_mappings = self._block_tables.compute_slot_mappings(" in pcp
    assert "return self._convert_to_gathered_slot_mappings(global_batch_slot_mappings)" in pcp
    # The one place that disagrees (and is not what places the KV): noticed, not followed.
    cm = _source("distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py")
    assert "return self.dcp_size * self.pcp_size" in cm
