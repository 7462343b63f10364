"""Placement: which KV cache slot a request takes, and what of its prompt it need not compute.

A request is admitted when a slot is idle and the KV budget can hold its prompt and its max_tokens;
until then it waits, in order of arrival (the server bounds that queue). It takes the idle slot
whose cache already holds the longest start of its prompt (the earlier turn of a conversation),
else an empty one, else the least recently used; idle slots are evicted, least recently used
first, when the budget needs their room. If another slot, running or idle, holds a longer start of
the prompt (the same system prompt, say), its keys and values are copied into the new slot on every
node instead of computed: the same tokens give the same bits. If a request admitted before it is
about to compute such a start (requests that arrive together), it copies it in the step that
computes it: every node makes a step's copies layer by layer, after the step's keys and values and
before its attention, so all of them start at once.
"""

from __future__ import annotations

from .engine import Engine
from .kv_cache import round_capacity
from .stream import Stream, _common_prefix

MIN_SHARE_WAIT = 16  # prompt tokens another request must be about to compute for this one to wait a step


def place(engine: Engine, active: list[Stream], last_used: list[float], s: Stream) -> bool:
    """Give the request an idle slot with room for its prompt and max_tokens, if the budget allows."""
    busy = {a.slot for a in active}
    idle = [i for i in range(engine.slots) if i not in busy and i not in engine.copy_sources]
    if not idle:
        return False
    # at least one prompt token must run, to produce logits
    reused = {i: min(_common_prefix(engine.contexts[i], s.prompt), len(s.prompt) - 1) for i in idle}
    slot = max(idle, key=lambda i: (reused[i], engine.capacities[i] == 0, -last_used[i]))
    need = len(s.prompt) + s.max_tokens
    held_by_running = sum(engine.capacities[a.slot] for a in active)
    if held_by_running + round_capacity(min(need, engine.ctx_size)) > engine.kv_budget:
        return False
    sources = engine.copy_sources
    for other in sorted((i for i in idle if i != slot and i not in sources), key=lambda i: last_used[i]):
        if engine.fits(slot, need):
            break
        if engine.capacities[other]:
            engine.release(other)
    if not engine.fits(slot, need) and engine.capacities[slot]:  # its own old size is in the way
        engine.release(slot)
        reused[slot] = 0
    if not engine.fits(slot, need):
        return False
    engine.rewind(reused[slot], slot)
    engine.reserve(slot, need)
    # another slot (running or idle) may hold a longer start of the prompt: the same system
    # prompt, or the conversation so far; its keys and values are copied, not computed
    own = reused[slot]
    unsure = engine.copy_targets | engine.freeing  # caches the next step still changes
    shared = {i: min(_common_prefix(engine.contexts[i], s.prompt), len(s.prompt) - 1)
              for i in range(engine.slots) if i != slot and i not in unsure}
    source = max(shared, key=lambda i: shared[i], default=None)
    if source is not None and shared[source] > own:
        engine.share_prefix(source, slot, shared[source])
        own = shared[source]
    s.start(slot, own)
    # a request admitted before it, still reading its prompt, may be about to compute a longer
    # start of this one (requests that arrive together share the system prompt): copy it in the
    # step that computes it (take_shared_start)
    ahead = {a: min(_common_prefix(a.prompt, s.prompt), len(s.prompt) - 1) for a in active if not a.decoding}
    leader = max(ahead, key=lambda a: ahead[a], default=None)
    if leader is not None and ahead[leader] >= own + MIN_SHARE_WAIT:
        s.share_from = (leader, ahead[leader])
    return True


def take_shared_start(engine: Engine, active: list[Stream], s: Stream, planned: dict[Stream, list[int]]) -> bool:
    """A request waiting for a leader's prompt start copies it once the leader's cache holds it
    or the step computes the rest of it (the copy is made in each layer after the step's keys
    and values), or computes it itself if the leader left; else it skips the step (False).
    planned: the prompt tokens each stream computes in this step."""
    leader, n = s.share_from
    upcoming = planned.get(leader, [])
    have = engine.contexts[leader.slot] + upcoming
    if leader in active and len(have) < n:
        return False  # not there yet
    s.share_from = None  # (a slot the step frees or copies into is no source: compute it)
    if leader.slot not in engine.copy_targets | engine.freeing \
            and have[:n] == s.prompt[:n] and n > len(engine.contexts[s.slot]):
        engine.share_prefix(leader.slot, s.slot, n, upcoming)
        s.pending = s.prompt[n:]
        s.out.prefill_tokens = len(s.pending)
    return True
