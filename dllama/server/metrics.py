"""The server's counters and their Prometheus text exposition (format 0.0.4).

Written by hand rather than with prometheus_client: the format is a few lines of text, and the
library's process-wide default registry would mix the figures of two servers in one process
(as the tests run them); a worker-class device also gets one dependency fewer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..batching import STEP_KINDS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Family:
    name: str
    type: str  # "counter" or "gauge"
    help: str
    samples: list[tuple[dict, float]] = field(default_factory=list)

    def add(self, value: float, **labels) -> "Family":
        self.samples.append((labels, value))
        return self


def render(families: list[Family]) -> str:
    lines = []
    for f in families:
        lines.append(f"# HELP {f.name} {_escape_help(f.help)}")
        lines.append(f"# TYPE {f.name} {f.type}")
        for labels, value in f.samples:
            label_text = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
            lines.append(f"{f.name}{{{label_text}}} {_number(value)}" if labels else f"{f.name} {_number(value)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


class Metrics:
    """Counters since start-up and the figures of the last finished generation."""

    def __init__(self):
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.generations: Counter = Counter()  # finish_reason -> count
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.last: dict | None = None  # Generation.report() of the last generation

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests[(endpoint, str(status))] += 1

    def count_generation(self, prompt_tokens: int, cached_tokens: int, generation, report: dict) -> None:
        self.generations[generation.finish_reason] += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.generated_tokens += len(generation.tokens)
        if generation.decode_steps:  # a one-token answer has no decode step to measure
            self.last = report

    def families(self, *, ready: bool, queue_length: int, running: int, nodes: list[dict], info: dict,
                 ctx_size: int, kv_cached: int, kv_reserved: int, kv_in_use: int, kv_budget: int, events: int,
                 replans: int = 0, batcher=None,
                 connections=None) -> list[Family]:
        requests = Family("dllama_requests_total", "counter", "HTTP requests answered, by endpoint and status "
                          "(499: the client went away first).")
        for (endpoint, status), n in sorted(self.requests.items()):
            requests.add(n, endpoint=endpoint, status=status)
        generations = Family("dllama_generations_total", "counter", "Finished generations by finish_reason.")
        for reason, n in sorted(self.generations.items()):
            generations.add(n, finish_reason=reason)
        last = self.last or {}
        ms = last.get("ms_per_token", {})
        per_token = last.get("bytes_per_token", {})
        out = [
            Family("dllama_info", "gauge", "The model and how the cluster syncs.").add(1, **info),
            Family("dllama_up", "gauge", "1 when the engine is ready to generate.").add(int(ready)),
            requests,
            generations,
            Family("dllama_prompt_tokens_total", "counter", "Prompt tokens of finished generations.")
            .add(self.prompt_tokens),
            Family("dllama_prompt_tokens_cached_total", "counter",
                   "Prompt tokens taken from the KV cache instead of computed.").add(self.cached_tokens),
            Family("dllama_generated_tokens_total", "counter", "Tokens generated.").add(self.generated_tokens),
            Family("dllama_tokens_per_second", "gauge", "Decode speed of the last generation.")
            .add(last.get("tokens_per_s", 0.0)),
            Family("dllama_prefill_tokens_per_second", "gauge", "Prompt speed of the last generation.")
            .add(last.get("prefill_tokens_per_s", 0.0)),
            Family("dllama_ms_per_token", "gauge", "Milliseconds per generated token in the last generation: "
                   "total, and its compute and sync (all-reduce) parts.")
            .add(ms.get("total", 0.0), part="total").add(ms.get("compute", 0.0), part="compute")
            .add(ms.get("sync", 0.0), part="sync"),
            Family("dllama_bytes_per_token", "gauge", "Sync bytes per generated token on the root in the last "
                   "generation.").add(per_token.get("sent", 0.0), direction="sent")
            .add(per_token.get("recv", 0.0), direction="recv"),
            Family("dllama_queue_length", "gauge", "Requests waiting for a slot or KV budget.").add(queue_length),
            Family("dllama_requests_running", "gauge", "Requests generating now (sequences in the batch).")
            .add(running),
            Family("dllama_batch_steps_total", "counter", "Forward steps run.").add(0 if batcher is None else batcher.steps),
            Family("dllama_batch_sequences_total", "counter", "Sequences summed over steps (divided by "
                   "dllama_batch_steps_total: the mean batch size).").add(0 if batcher is None else batcher.step_sequences),
            Family("dllama_batch_tokens_total", "counter", "Tokens summed over steps (prompt chunks and decoded "
                   "tokens).").add(0 if batcher is None else batcher.step_tokens),
            Family("dllama_batch_size", "gauge", "Sequences in the last step.").add(0 if batcher is None else
                                                                                    batcher.last_batch),
            *_step_kinds(batcher),
            *_speculation(batcher),
            Family("dllama_context_tokens", "gauge", "Context size (one sequence's KV cache) in tokens.").add(ctx_size),
            Family("dllama_kv_cache_tokens", "gauge", "Tokens in the KV caches now (all slots, idle ones kept for "
                   "reuse included).").add(kv_cached),
            Family("dllama_kv_cache_reserved_tokens", "gauge", "Positions the KV caches hold (reserved for prompts "
                   "and max_tokens).").add(kv_reserved),
            Family("dllama_kv_cache_in_use_tokens", "gauge", "Positions reserved by the requests running now (the "
                   "rest of the reserved ones are idle slots' caches, given up whenever a request needs room).")
            .add(kv_in_use),
            Family("dllama_kv_cache_budget_tokens", "gauge", "Positions the KV caches may hold in all (--kv-budget).")
            .add(kv_budget),
            Family("dllama_nodes", "gauge", "Nodes taking part now (the root included).")
            .add(sum(n["up"] for n in nodes)),
            Family("dllama_cluster_events_total", "counter", "Node failures and recoveries the engine went through.")
            .add(events),
            Family("dllama_cluster_replans_total", "counter", "Times the cluster re-planned: after a failure (once "
                   "for every request in the step that failed), or for workers that came back.").add(replans),
        ]
        if connections is not None:  # a ConnectionCounts of the connection guard
            out += [
                Family("dllama_http_connections", "gauge", "HTTP connections open now.").add(connections.open),
                Family("dllama_http_connections_refused_total", "counter",
                       "HTTP connections refused (503, closed) because --max-connections were open.")
                .add(connections.refused),
                Family("dllama_http_timeouts_total", "counter", "HTTP connections dropped because a request head "
                       "(or the next request on a kept-alive connection) or a body did not arrive in time, or "
                       "the client read nothing of a streamed answer for --write-timeout.")
                .add(connections.header_timeouts, phase="header").add(connections.body_timeouts, phase="body")
                .add(connections.write_timeouts, phase="write"),
            ]
        up = Family("dllama_node_up", "gauge", "1 while the node takes part in the computation.")
        for n in nodes:
            up.add(int(n["up"]), node=n["node"])
        out.append(up)
        # what each worker measured during its last step
        step = Family("dllama_node_step_seconds", "gauge", "Duration of the node's last step.")
        sync = Family("dllama_node_sync_seconds", "gauge", "Time in all-reduces during the node's last step.")
        sent = Family("dllama_node_step_bytes", "gauge", "Sync bytes the node sent/received in its last step.")
        rss = Family("dllama_node_rss_bytes", "gauge", "Resident memory of the node at its last step.")
        for n in nodes:
            stats, node = n.get("stats") or {}, n["node"]
            if "step_s" in stats:
                step.add(float(stats["step_s"]), node=node)
            if "sync_s" in stats:
                sync.add(float(stats["sync_s"]), node=node)
            if "sent" in stats and "recv" in stats:
                sent.add(int(stats["sent"]), node=node, direction="sent").add(int(stats["recv"]), node=node,
                                                                               direction="recv")
            if "rss_mb" in stats:
                rss.add(float(stats["rss_mb"]) * 1024 * 1024, node=node)
        out += [f for f in (step, sync, sent, rss) if f.samples]
        return out


def _step_kinds(batcher) -> list[Family]:
    """The batcher's steps by what they carried (batching.STEP_KINDS), as llama-server's
    prompt_seconds_total and tokens_predicted_seconds_total: where the engine's time goes."""
    about = "decode: every sequence's next token; prompt: prompt tokens alone; mixed: both"
    steps = Family("dllama_batch_kind_steps_total", "counter", f"Forward steps by what they carried ({about}).")
    tokens = Family("dllama_batch_kind_tokens_total", "counter", f"Tokens of the forward steps by what they "
                    f"carried ({about}).")
    seconds = Family("dllama_batch_kind_seconds_total", "counter", f"Seconds in forward steps by what they carried "
                     f"({about}); a step paused while a prompt's step ran (one node) without the pause.")
    for kind in STEP_KINDS:
        steps.add(0 if batcher is None else batcher.kind_steps[kind], kind=kind)
        tokens.add(0 if batcher is None else batcher.kind_tokens[kind], kind=kind)
        seconds.add(0.0 if batcher is None else batcher.kind_seconds[kind], kind=kind)
    return [steps, tokens, seconds]


def _speculation(batcher) -> list[Family]:
    """Speculative decoding's drafts: accepted / drafted is the acceptance rate, accepted /
    verifications the tokens a verifying step gains over plain decoding."""
    drafted, accepted, verifications = (0, 0, 0) if batcher is None else \
        (batcher.drafted, batcher.accepted, batcher.verifications)
    return [Family("dllama_speculative_drafted_tokens_total", "counter", "Tokens drafted and verified.").add(drafted),
            Family("dllama_speculative_accepted_tokens_total", "counter", "Drafted tokens the sampler kept.")
            .add(accepted),
            Family("dllama_speculative_verifications_total", "counter", "Sequences' steps that verified drafts "
                   "(each also gives the token after the drafts it kept).").add(verifications)]
