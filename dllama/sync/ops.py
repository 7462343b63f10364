"""Reduction operators, MPI-style: sum prod min max avg land lor band bor bxor maxloc minloc.

Every operator here is commutative and associative on exact values, and each collective
combines a given element in a fixed order, so all ranks end with bit-identical results.

maxloc/minloc reduce (value, index) pairs held in a structured array with fields "value" and
"index" (build one with `loc_array`); ties go to the smaller index, as in MPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
INT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
NUMERIC_DTYPES = FLOAT_DTYPES + INT_DTYPES
LOC_INDEX_DTYPES = INT_DTYPES


def loc_dtype(value_dtype=np.float32, index_dtype=np.int64) -> np.dtype:
    """The structured dtype of a maxloc/minloc element: (value, index), packed."""
    return np.dtype([("value", np.dtype(value_dtype)), ("index", np.dtype(index_dtype))])


def loc_array(values, index, index_dtype=np.int64) -> np.ndarray:
    """Pair values with indices (a scalar index, e.g. this rank, or an array) for maxloc/minloc."""
    values = np.asarray(values)
    out = np.empty(values.shape, dtype=loc_dtype(values.dtype, index_dtype))
    out["value"] = values
    out["index"] = index
    return out


def _is_loc(dt: np.dtype) -> bool:
    return (dt.names == ("value", "index") and dt.fields["value"][0] in NUMERIC_DTYPES
            and dt.fields["index"][0] in LOC_INDEX_DTYPES)


def _maxloc(acc, x):
    av, xv = acc["value"], x["value"]
    take = (xv > av) | ((xv == av) & (x["index"] < acc["index"]))
    np.copyto(acc, x, where=take)


def _minloc(acc, x):
    av, xv = acc["value"], x["value"]
    take = (xv < av) | ((xv == av) & (x["index"] < acc["index"]))
    np.copyto(acc, x, where=take)


def _ufunc_op(ufunc):
    def combine(acc, x):
        ufunc(acc, x, out=acc)
    return combine


def _logical_op(ufunc):
    def combine(acc, x):
        ufunc(acc, x, out=acc, casting="unsafe")
    return combine


def _to_bool_values(a):
    np.not_equal(a, 0, out=a, casting="unsafe")


@dataclass(frozen=True)
class Op:
    name: str
    combine: Callable  # combine(acc, x): acc = acc (op) x, in place
    dtypes: str  # "numeric", "float", "int", "loc"
    finish: Callable | None = None  # finish(a, p) applied once to the reduced values on every rank
    ufunc: np.ufunc | None = None  # when combine is this ufunc: ufunc(x, y, out=z) in one pass

    def accepts(self, dt: np.dtype) -> bool:
        if self.dtypes == "loc":
            return _is_loc(dt)
        if self.dtypes == "float":
            return dt in FLOAT_DTYPES
        if self.dtypes == "int":
            return dt in INT_DTYPES
        return dt in NUMERIC_DTYPES


def _avg_finish(a, p):
    if p > 1:
        np.divide(a, p, out=a)


OPS: dict[str, Op] = {
    "sum": Op("sum", _ufunc_op(np.add), "numeric", ufunc=np.add),
    "prod": Op("prod", _ufunc_op(np.multiply), "numeric", ufunc=np.multiply),
    "min": Op("min", _ufunc_op(np.minimum), "numeric", ufunc=np.minimum),
    "max": Op("max", _ufunc_op(np.maximum), "numeric", ufunc=np.maximum),
    "avg": Op("avg", _ufunc_op(np.add), "float", _avg_finish, ufunc=np.add),
    "land": Op("land", _logical_op(np.logical_and), "numeric", lambda a, p: _to_bool_values(a)),
    "lor": Op("lor", _logical_op(np.logical_or), "numeric", lambda a, p: _to_bool_values(a)),
    "band": Op("band", _ufunc_op(np.bitwise_and), "int", ufunc=np.bitwise_and),
    "bor": Op("bor", _ufunc_op(np.bitwise_or), "int", ufunc=np.bitwise_or),
    "bxor": Op("bxor", _ufunc_op(np.bitwise_xor), "int", ufunc=np.bitwise_xor),
    "maxloc": Op("maxloc", _maxloc, "loc"),
    "minloc": Op("minloc", _minloc, "loc"),
}


def get_op(op) -> Op:
    if isinstance(op, Op):
        return op
    try:
        return OPS[str(op).lower()]
    except KeyError:
        raise ValueError(f"unknown reduction op {op!r}; choose from {', '.join(OPS)}") from None


def check_op(op: Op, dt: np.dtype) -> None:
    if not op.accepts(dt):
        need = {"float": "a float dtype (f16/f32/f64)", "int": "an integer dtype (int32/int64)",
                "numeric": "f16/f32/f64/int32/int64",
                "loc": "a (value, index) structured dtype (see dllama.sync.ops.loc_array)"}[op.dtypes]
        raise ValueError(f"op {op.name!r} needs {need}, got {dt}")
