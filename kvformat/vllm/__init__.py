"""kvformat as a vLLM secondary tier: ``{"type": "KVFormatTier", "module_path": "kvformat.vllm", ...}``.

``_tier`` (``KVFormatTier``: vLLM's calls translated to the engine-neutral cache in :mod:`kvformat.cache`),
``_facts`` (what a deployment stores, read from vLLM's spec, KV-cache config and vllm_config).
"""

from ._facts import deployment_facts, derive_layout, derive_plans
from ._tier import METRIC_PREFIX, KVFormatTier

__all__ = ["KVFormatTier", "METRIC_PREFIX", "deployment_facts", "derive_layout", "derive_plans"]
