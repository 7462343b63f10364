"""`--sync-mode auto`, settled for each session: the root times its link to every worker (ECHO
round trips, before SETUP), takes the slowest, and prices both modes with the collectives' cost
model (dllama.sync_config). Worker-to-worker links are assumed no slower than the root's own."""

from __future__ import annotations

import logging

from ..errors import DllamaError
from ..gguf_model import GGUFModel
from ..model import shard_tensors
from ..projection import Gather
from ..sync.auto import Auto
from ..sync_config import LinkFigures, SyncConfig

log = logging.getLogger("dllama.root")


def reduce_fits(model: GGUFModel, shards) -> bool:
    """Whether every node's slice can be cut for reduce mode (a K-quant attention output's columns
    must fall on its 256-value blocks; gather cuts rows, which always can)."""
    try:
        for shard in shards:
            for _ in shard_tensors(model, shard, "reduce"):
                pass
    except DllamaError:
        return False
    return True


async def time_links(workers) -> LinkFigures:
    """The slowest of the root's links to `workers` (WorkerLinks, probed), and a local reduction's cost."""
    timings = [await w.time_link() for w in workers]  # one at a time: at once they would share the root's link
    return LinkFigures(alpha=max((a for a, _ in timings), default=0.0), beta=max((b for _, b in timings), default=0.0),
                       gamma=Auto.time_reduce())


def gathers_q8(model: GGUFModel, shards) -> tuple[bool, bool]:
    """Whether gather mode's all-gathers of the attention's and the FFN's outputs may travel as Q8
    blocks (the matmul after each reads Q8 activations)."""
    down = "ffn_down_exps" if model.config.n_experts else "ffn_down"
    gather = Gather.of(shards, model.config.head_dim, q8=True)
    return tuple(gather.sends_q8(model.qtype_of(model.layer_name(0, part)), cols)
                 for part, cols in (("attn_output", "att"), (down, "ffn")))


async def settle_sync(requested: SyncConfig, model: GGUFModel, workers, shards) -> tuple[SyncConfig, dict | None]:
    """The sync configuration of a session over `workers` (WorkerLinks, probed) with the split
    plan's `shards`, and with auto the figures it was chosen from (None otherwise)."""
    if requested.mode != "auto":
        return requested, None
    if not workers:
        return requested.alone(), None
    candidates = requested.candidates()
    if not reduce_fits(model, shards):  # none left (a dtype only reduce carries): its load says why
        candidates = [c for c in candidates if c.mode != "reduce"] or candidates
    if len(candidates) == 1:
        reason = "the only mode this split and --sync-dtype allow"
        log.info("sync mode auto: %s, %s", candidates[0].label, reason)
        return candidates[0], {"chosen": candidates[0].label, "reason": reason}
    link = await time_links(workers)
    config = model.config
    q8_attention, q8_ffn = gathers_q8(model, shards)
    chosen, predicted = requested.choose(config, len(workers) + 1, link, q8_attention, q8_ffn, candidates)
    figures = {"chosen": chosen.label, "link": link.describe(), "alpha_s": link.alpha, "beta_s_per_byte": link.beta,
               "predicted_sync_ms_per_token": {label: t * 1e3 for label, t in predicted.items()}}
    log.info("sync mode auto: %s on the measured link (%s); predicted sync per token: %s", chosen.label,
             link.describe(), ", ".join(f"{label} {t * 1e3:.2f} ms" for label, t in predicted.items()))
    return chosen, figures
