"""kvformat as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

``_backend`` (``KVFormatHiCache``: SGLang's storage calls translated to the engine-neutral cache in
:mod:`kvformat.cache`), ``_facts`` (what a deployment stores per page, read from SGLang's storage config and
host pool), ``_filetree`` (SGLang's built-in file backend pages, for ``kvformat compact --from sglang``).
"""

from ._backend import KVFormatHiCache
from ._facts import HOST_LAYOUTS, PageFacts, page_facts, page_plan

__all__ = ["KVFormatHiCache", "HOST_LAYOUTS", "PageFacts", "page_facts", "page_plan"]
