"""Bad input: one-line errors before anything is sent (the group stays usable), and ranks that
disagree (sizes, order of collectives) fail loudly on every rank instead of hanging."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dllama.errors import MalformedFrame, NetworkError, PeerAborted, ProtocolError
from dllama.sync import algo_name, init_process_group, local_cluster

from .cluster_helpers import free_port
from .sync_helpers import on_all


async def test_bad_arguments_are_refused_locally():
    async with local_cluster(2, algo="ring") as (g0, g1):
        x = np.ones(10, np.float32)
        with pytest.raises(TypeError, match="numpy array"):
            await g0.all_reduce([1.0, 2.0])
        with pytest.raises(ValueError, match="C-contiguous"):
            await g0.all_reduce(np.ones((4, 4), np.float32)[:, 1])
        ro = np.ones(3, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            await g0.all_reduce(ro)
        with pytest.raises(ValueError, match="unknown reduction op 'mean'"):
            await g0.all_reduce(x, "mean")
        with pytest.raises(ValueError, match="op 'band' needs an integer dtype"):
            await g0.all_reduce(x, "band")
        with pytest.raises(ValueError, match="op 'maxloc' needs a \\(value, index\\)"):
            await g0.all_reduce(x, "maxloc")
        with pytest.raises(ValueError, match="codec 'q80' needs a float array"):
            await g0.all_reduce(np.ones(3, np.int32), codec="q80")
        with pytest.raises(ValueError, match="only serves sum and avg"):
            await g0.all_reduce(x, "max", codec="f16")
        with pytest.raises(ValueError, match="unknown codec"):
            await g0.all_reduce(x, codec="q4")
        with pytest.raises(ValueError, match="unknown sync algorithm 'tree'"):
            await g0.all_reduce(x, algo="tree")
        with pytest.raises(ValueError, match="root must be a rank in 0..1"):
            await g0.broadcast(x, root=2)
        with pytest.raises(ValueError, match="counts add up to 3"):
            await g0.reduce_scatter(x, counts=[1, 2])
        # nothing was sent: the group still works
        outs = await on_all((g0, g1), lambda g, r: g.all_reduce(np.full(5, r + 1.0)))
        assert all(o.tolist() == [3.0] * 5 for o in outs)
        assert g0.failed is None and g1.failed is None
    assert algo_name("recursive-doubling") == "rd" and algo_name("master-worker") == "star"


@pytest.mark.parametrize("algo", ["ring", "mesh", "star", "rd", "rabenseifner"])
async def test_mismatched_sizes_fail_on_every_rank(algo):
    async with local_cluster(3, algo=algo, timeout=10) as groups:
        results = await asyncio.gather(
            *(g.all_reduce(np.ones(100 + (r == 2), np.float32)) for r, g in enumerate(groups)),
            return_exceptions=True)
        assert all(isinstance(e, NetworkError) for e in results), results
        assert any(isinstance(e, MalformedFrame) and "do all ranks pass arrays of the same size" in str(e)
                   for e in results)
        assert all(isinstance(e, (MalformedFrame, PeerAborted)) for e in results)
        with pytest.raises(NetworkError, match="unusable after an earlier failure"):
            await groups[0].barrier()


async def test_ranks_running_different_collectives_fail_loudly():
    async with local_cluster(2, algo="mesh", timeout=10) as (g0, g1):
        await on_all((g0, g1), lambda g, r: g.barrier())
        results = await asyncio.gather(g0.all_reduce(np.ones(4)), g1.barrier(), g1.all_reduce(np.ones(4)),
                                       return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        assert errors and all(isinstance(e, (ProtocolError, PeerAborted, RuntimeError)) for e in errors), results


async def test_overlapping_calls_are_refused():
    async with local_cluster(2, algo="ring") as (g0, g1):
        first = asyncio.ensure_future(g0.all_reduce(np.ones(4)))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="must not overlap"):
            await g0.all_reduce(np.ones(4))
        await g1.all_reduce(np.ones(4))
        await first


async def test_group_setup_errors():
    with pytest.raises(ValueError, match="rank 3 is not in 0..1"):
        await init_process_group(3, 2, [("127.0.0.1", 1), ("127.0.0.1", 2)])
    with pytest.raises(ValueError, match="need 3 addresses"):
        await init_process_group(0, 3, [("127.0.0.1", 1)])
    with pytest.raises(NetworkError, match=r"rank 1 \(127\.0\.0\.1:\d+\)"):
        # nobody listens at rank 1's address: refused until connect_timeout, then a clear error
        await init_process_group(0, 2, [None, ("127.0.0.1", free_port())], connect_timeout=0.5)
