"""All-reduce benchmark in the style of nccl-tests: a row per algorithm x size x dtype (its columns,
and how to run it: benchmarks/README.md).

`bench_rank(group, config)` runs on every rank of a group (same config everywhere) and returns
the rows on rank 0 (None elsewhere). dtypes name what travels: f32/f64/i32/i64 exact arrays of
that type; f16 and q80 are float32 arrays sent with that codec.
"""

from __future__ import annotations

import hashlib
import re
import time

import numpy as np

from .codecs import get_codec
from .group import ALGORITHMS, ProcessGroup

DTYPES = {
    "f32": (np.float32, None), "f64": (np.float64, None), "i32": (np.int32, None), "i64": (np.int64, None),
    "f16": (np.float32, "f16"), "q80": (np.float32, "q80"),
}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'2K' -> 2048, '16M' -> 16 MiB, '576' -> 576 (bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"bad size {text!r} (examples: 2K, 16K, 1M, 16M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: int) -> str:
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= k and nbytes % k == 0:
            return f"{nbytes // k}{unit}"
    return f"{nbytes}B"


def exact_inputs(n: int, rank: int, dtype) -> np.ndarray:
    """Small integers: every partial sum is exact in any order, in every dtype (even f16)."""
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + rank * 13) % 17) - 8).astype(dtype)


def random_inputs(n: int, rank: int, dtype, seed: int = 1234) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, n])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def codec_bound(algo_cls, codec_name: str | None, p: int, partial_absmax_sum: float) -> float:
    """Worst-case |error| of a codec all-reduce: each encoding of a value whose block holds at
    most `partial_absmax_sum` in magnitude adds Codec.error_bound, plus float32 summation."""
    from .codecs import CODECS
    if codec_name is None:
        return 0.0
    per = CODECS[codec_name].error_bound(partial_absmax_sum)
    return algo_cls.encodings(p) * per + 2 * p * partial_absmax_sum * 2.0 ** -23


def _digest(a: np.ndarray) -> int:
    return int.from_bytes(hashlib.blake2b(a.tobytes(), digest_size=8).digest(), "little") >> 1


async def bench_rank(group: ProcessGroup, config: dict):
    """config: algos, sizes (bytes), dtypes, iters, warmup, op ('sum'). Same on every rank.
    Returns {"p", "rows", "auto": measured alpha/beta/gamma or None} on rank 0, None elsewhere."""
    p, r = group.size, group.rank
    iters, warmup = int(config.get("iters", 20)), int(config.get("warmup", 3))
    op = config.get("op", "sum")
    rows = []
    for algo in config["algos"]:
        for dname in config["dtypes"]:
            dtype, codec = DTYPES[dname]
            isz = np.dtype(dtype).itemsize
            for size in config["sizes"]:
                n = max(size // isz, 1)
                row = await _bench_one(group, algo, dtype, codec, n, iters, warmup, op)
                if r == 0:
                    row.update(algo=algo, p=p, size=n * isz, dtype=dname, count=n)
                    rows.append(row)
    if r != 0:
        return None
    auto = group.auto.describe() if group.auto.alpha is not None else None
    if auto is not None:
        auto.pop("decisions", None)
    return {"p": p, "rows": rows, "auto": auto}


async def _bench_one(group, algo, dtype, codec, n, iters, warmup, op):
    p, r = group.size, group.rank
    wire_n = get_codec(codec, np.dtype(dtype)).wire_nbytes(n, np.dtype(dtype).itemsize)
    chose = group.choose("all_reduce", wire_n, op) if algo == "auto" else algo
    algo_cls = ALGORITHMS[chose]
    # 1. correctness with exact inputs: zero tolerance unless a lossy codec is used
    x = exact_inputs(n, r, dtype)
    await group.all_reduce(x, op, codec, algo=algo)
    expect = np.sum([exact_inputs(n, q, np.float64) for q in range(p)], axis=0)
    if op == "avg":
        expect = expect / p
    absmax = float(sum(np.abs(exact_inputs(n, q, np.float64)).max() for q in range(p)))
    bound = codec_bound(algo_cls, codec, p, absmax)
    ok = bool(np.all(np.abs(x.astype(np.float64) - expect) <= bound))
    digest = _digest(x)
    # 2. error against the exact float64 sum, random inputs
    src = random_inputs(n, r, dtype)
    x = src.copy()
    await group.all_reduce(x, op, codec, algo=algo)
    exact = np.sum([random_inputs(n, q, dtype).astype(np.float64) for q in range(p)], axis=0)
    if op == "avg":
        exact = exact / p
    err = float(np.abs(x.astype(np.float64) - exact).max())
    scale = float(np.abs(exact).max()) or 1.0
    # 3. timing: every call on a fresh copy of the inputs (the copy is not timed)
    times = []
    sent0 = group.stats.bytes_sent
    await group.barrier()
    for i in range(warmup + iters):
        np.copyto(x, src)
        t0 = time.perf_counter()
        await group.all_reduce(x, op, codec, algo=algo)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    wire = (group.stats.bytes_sent - sent0) / (warmup + iters)
    median = float(np.median(times))
    # rank 0 reports the slowest rank's median and whether all ranks agree bit for bit
    info = np.array([median, float(ok), err], dtype=np.float64)
    everyone = await group.gather(info, root=0, algo="star")
    digests = await group.gather(np.array([digest], dtype=np.int64), root=0, algo="star")
    if r != 0:
        return None
    t = float(everyone[:, 0].max())
    size = n * np.dtype(dtype).itemsize
    algbw = size / t
    identical = bool(np.all(digests == digests[0]))
    allok = bool(np.all(everyone[:, 1] == 1.0))
    return {
        "time_us": t * 1e6, "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * 2 * (p - 1) / p / 1e9,
        "max_err": float(everyone[:, 2].max()), "rel_err": float(everyone[:, 2].max()) / scale,
        "check": "ok" if (allok and identical) else ("DIFFERS" if allok else "WRONG"),
        "wire_bytes_per_rank": wire,
        "chose": chose,
    }


def format_table(rows: list[dict], alpha_beta: dict | None = None) -> str:
    head = (f"{'algo':>13} {'p':>2} {'size':>6} {'dtype':>5} {'count':>9} {'time(us)':>10} "
            f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'max err':>9} {'rel err':>9} {'check':>7}")
    lines = [head, "-" * len(head)]
    for row in rows:
        algo = row["algo"] if row["algo"] != "auto" else f"auto>{row['chose']}"
        lines.append(
            f"{algo:>13} {row['p']:>2} {format_size(row['size']):>6} {row['dtype']:>5} {row['count']:>9} "
            f"{row['time_us']:>10.1f} {row['algbw_GBps']:>11.3f} {row['busbw_GBps']:>11.3f} "
            f"{row['max_err']:>9.2e} {row['rel_err']:>9.2e} {row['check']:>7}")
    return "\n".join(lines)
