"""The layout model: deployment facts -> what a chunk file holds and where each byte sits in an engine's row.

``_rules`` (the model's rules: per-layer roles, dtypes, shapes, opaque form; one ``RowPlan`` per KV-cache
group), ``_types`` (its dataclasses and the slot <-> payload copies), ``_parallel`` (pipeline and
decode-context parallel rows), ``_sublayout`` (where a token's bytes sit inside a page, per role, dtype and
platform: the one description every token movement goes through). No engine import: the adapters extract
the facts and hand them in.
"""

from ._rules import (
    PACKED_DTYPES, ROLE_INDEXER, ROLE_MLA, ROLE_OPAQUE, DeploymentFacts, GroupFacts, LayerFacts, ParallelFacts,
    RowPlan, Shard, cp_canonical_token, formula_layer, plan_groups, pp_stage_names, role_from_name,
    stage_layer_facts,
)
from ._sublayout import PLATFORMS, SubLayout, canonical, describe, platform_dependent, token_runs
from ._types import page_runs

__all__ = [
    "ROLE_MLA", "ROLE_INDEXER", "ROLE_OPAQUE", "PACKED_DTYPES", "LayerFacts", "GroupFacts", "DeploymentFacts",
    "RowPlan", "Shard", "ParallelFacts", "plan_groups", "role_from_name", "formula_layer", "cp_canonical_token",
    "pp_stage_names", "stage_layer_facts", "PLATFORMS", "SubLayout", "describe", "token_runs",
]

# Used by other kvformat packages, which import this face, never its private modules (issue 44).
__all__ += ["canonical", "page_runs", "platform_dependent"]
