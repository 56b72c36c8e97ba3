"""Which part of each chunk a rank holds when its group is pipeline- and/or decode-context parallel.

The same placement vLLM uses and the tier assembles (docs/layout.md): rank ``w`` is pipeline stage
``w // (pcp * tp)``, PCP rank ``(w // tp) % pcp`` and TP rank ``w % tp``; its DCP rank is ``tp rank % dcp``
(PCP ranks hold replicas of their TP group's KV, with or without DCP); a stage holds a contiguous range
of the layers, a DCP rank the tokens ``t`` of each logical block with ``(t // interleave) % dcp`` equal
to its rank. One *part* of a chunk is what one (stage, DCP rank) holds; the TP ranks sharing a part
hold it byte for byte (the MLA latent), and one of them writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import cp_canonical_token
from ..format import CanonicalLayout
from ..errors import StagingError

__all__ = ["RankPlacement"]


@dataclass(frozen=True)
class RankPlacement:
    """The group's parallel layout: ``tp`` x ``pcp`` x ``pp`` ranks, ``dcp`` DCP ranks in each TP group.

    ``stages``: per pipeline stage, the names of the layout's layers it holds (empty: one stage holding
    every layer). ``interleave``: vLLM's ``cp_kv_cache_interleave_size``.
    """

    tp: int
    pp: int = 1
    dcp: int = 1
    interleave: int = 1
    stages: tuple[tuple[str, ...], ...] = ()
    pcp: int = 1
    # The platform whose vLLM writers filled the pages (kvformat.layout._sublayout.PLATFORMS): where a token's
    # bytes sit in a page. None: unknown, so DCP is refused for layers whose order the platform decides.
    platform: str | None = None

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dcp, self.interleave, self.pcp) < 1 or self.tp % self.dcp:
            raise StagingError(f"placement: expected tp, pp, dcp, pcp, interleave >= 1 with dcp dividing tp, got "
                               f"tp={self.tp} pp={self.pp} dcp={self.dcp} pcp={self.pcp} interleave={self.interleave}")
        if self.stages and len(self.stages) != self.pp:
            raise StagingError(f"placement: {len(self.stages)} stages' layers for pp={self.pp}")
        if not self.stages and self.pp != 1:
            raise StagingError("placement: pp > 1 needs each stage's layers")

    @property
    def world(self) -> int:
        return self.tp * self.pcp * self.pp

    @property
    def parts(self) -> int:
        return self.pp * self.dcp

    def part_of(self, rank: int) -> int:
        """The part ``rank`` holds (``stage * dcp + DCP rank``)."""
        return (rank // (self.tp * self.pcp)) * self.dcp + (rank % self.tp) % self.dcp

    def replicas(self, part: int) -> list[int]:
        """The ranks holding ``part``, lowest first."""
        return [w for w in range(self.world) if self.part_of(w) == part]

    def describe(self, part: int) -> str:
        stage, r = divmod(part, self.dcp)
        return ", ".join(([f"pipeline stage {stage}"] if self.pp > 1 else [])
                         + ([f"DCP rank {r}"] if self.dcp > 1 else [])) or "the whole chunk"

    def layer_indices(self, layout: CanonicalLayout, rank: int) -> list[int]:
        """Indices into ``layout.layers`` of the layers ``rank`` holds, in its stage's order."""
        if not self.stages:
            return list(range(len(layout.layers)))
        index = {l.name: i for i, l in enumerate(layout.layers)}
        stage = rank // (self.tp * self.pcp)
        names = self.stages[stage]
        missing = [n for n in names if n not in index]
        if missing:
            raise StagingError(f"placement: stage {stage} holds {missing[0]}, which the layout has not")
        if sorted(index[n] for st in self.stages for n in st) != list(range(len(layout.layers))):
            raise StagingError("placement: the stages do not hold every layer of the layout exactly once")
        return [index[n] for n in names]

    def token_order(self, local_tokens: int, part: int) -> list[int]:
        """Logical token (in a block of ``local_tokens * dcp``) of each of a part's local tokens."""
        r = part % self.dcp
        if local_tokens % self.interleave:
            raise StagingError(f"placement: a {local_tokens}-token local block is not whole interleave runs of "
                               f"{self.interleave}")
        return [cp_canonical_token(t, r, self.dcp, self.interleave) for t in range(local_tokens)]
