"""kvformat as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

``_backend`` (``KVFormatHiCache``: SGLang's storage calls translated to the engine-neutral cache in
:mod:`kvformat.cache`), ``_facts`` (what a deployment stores per page, read from SGLang's storage config and
host pool), ``_filetree`` (SGLang's built-in file backend pages -> kvformat files: ``kvformat compact --from
sglang``). ``KVFormatHiCache`` is imported on first use, so the converter and the CLI run without SGLang.
"""

from typing import Any

from ._facts import HOST_LAYOUTS, PageFacts, page_facts, page_plan
from ._filetree import compact_sglang

__all__ = ["KVFormatHiCache", "HOST_LAYOUTS", "PageFacts", "page_facts", "page_plan"]


def __getattr__(name: str) -> Any:
    # SGLang's dynamic loader does import_module("kvformat.sglang") then getattr(module, class_name).
    if name == "KVFormatHiCache":
        from ._backend import KVFormatHiCache

        return KVFormatHiCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Used by other kvformat packages, which import this face, never its private modules (issue 44).
__all__ += ["compact_sglang"]
