"""The engine-neutral chunk cache behind the engine adapters (no engine import): ``_config`` (parameters), ``_lru``
(the LRU capacity index; ``_ghost``, the default one, segments it), ``_pool`` (the I/O thread pools), ``_rows`` (the
row <-> file engine: store, load, probe of one chunk), ``_counters`` (the metrics' counters), ``_scan`` (the
start-up scan of the root), ``_jobs`` (job bookkeeping, bounded shutdown), ``_autocodec`` (``compression="auto"``:
the rule, a pure function) and ``_measure`` (its measurements, bounded by a deadline). ``_open`` (``open_cache``:
the one assembly of them that every adapter drives). ``kvformat.vllm`` and ``kvformat.sglang`` adapt it to their
engine's API."""

from ._autocodec import CompressionChoice, choose_compression, expected_ratio
from ._config import TierConfig
from ._health import unusable_root
from ._jobs import CounterReport, Job, JobBook, shutdown_bounded
from ._keyscheme import ENGINE, ROPE_STYLES, TOKEN_CHAIN, chain_layer_name, chain_layout, page_chain
from ._log import CacheLog
from ._lru import LRUIndex
from ._measure import auto_compression, measure_decode
from ._open import Cache, open_cache
from ._ops import RootOps
from ._pool import DualPool
from ._rows import EXISTS, WRITTEN, RowEngine
from ._sealing import sealed_plans

# Used by the adapters, which import this face, never its private modules (issue 44).
__all__ = [
    "Cache", "open_cache",
    "ENGINE", "EXISTS", "ROPE_STYLES", "TOKEN_CHAIN", "WRITTEN", "CacheLog", "CounterReport", "DualPool", "Job",
    "JobBook", "LRUIndex", "RootOps", "RowEngine", "TierConfig", "chain_layer_name", "chain_layout", "page_chain",
    "sealed_plans", "shutdown_bounded", "unusable_root",
]
# compression="auto" (issue 45): the rule, its measurements, the choice the start-up line and metrics report.
__all__ += ["CompressionChoice", "auto_compression", "choose_compression", "expected_ratio", "measure_decode"]
