"""`--sync-mode auto`, settled for each session: the root times its link to every worker (ECHO
round trips, before SETUP), takes the slowest, and prices both modes with the collectives' cost
model (dllama.sync_config). Worker-to-worker links are assumed no slower than the root's own."""

from __future__ import annotations

import asyncio
import logging

from ..gguf_model import GGUFModel
from ..projection import travels_as_q8
from ..sync.auto import Auto
from ..sync_config import LinkFigures, SyncConfig

log = logging.getLogger("dllama.root")


async def settle_sync(requested: SyncConfig, model: GGUFModel, workers) -> tuple[SyncConfig, dict | None]:
    """The sync configuration of a session over `workers` (WorkerLinks, probed), and with auto the
    figures it was chosen from (None otherwise)."""
    if requested.mode != "auto":
        return requested, None
    if not workers:
        return requested.alone(), None
    timings = await asyncio.gather(*(w.time_link() for w in workers))
    link = LinkFigures(alpha=max(a for a, _ in timings), beta=max(b for _, b in timings), gamma=Auto.time_reduce())
    config = model.config
    down = "ffn_down_exps" if config.n_experts else "ffn_down"
    q8_attention, q8_ffn = (travels_as_q8(model.qtype_of(model.layer_name(0, part))) for part in ("attn_output", down))
    chosen, predicted = requested.choose(config, len(workers) + 1, link, q8_attention, q8_ffn)
    figures = {"chosen": chosen.label, "link": link.describe(), "alpha_s": link.alpha, "beta_s_per_byte": link.beta,
               "predicted_sync_ms_per_token": {label: t * 1e3 for label, t in predicted.items()}}
    log.info("sync mode auto: %s on the measured link (%s); predicted sync per token: %s", chosen.label,
             link.describe(), ", ".join(f"{label} {t * 1e3:.2f} ms" for label, t in predicted.items()))
    return chosen, figures
