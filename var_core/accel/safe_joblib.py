"""Read the numbers of a joblib-pickled scikit-learn model WITHOUT executing the pickle.

SkipVAR (fakerone-li/SkipVAR) ships its decision models as ``joblib.dump`` files of a ``StandardScaler`` and a
``LogisticRegression``. Loading such a file with ``pickle``/``joblib`` runs whatever callables it names, so varscope
never does that. This reader walks the pickle with the pure-Python unpickler, but every global it names resolves
to an inert record of this module (never to the named class), and only the globals a fitted scaler / linear model
needs are accepted: anything else (``os.system``, ``builtins.eval``, an unknown estimator) is refused with
:class:`UnsafePickleError` before it could run. Arrays are rebuilt from the raw bytes joblib writes after each
``NumpyArrayWrapper`` record (a one-byte padding length, that many pad bytes when the record carries
``numpy_array_alignment_bytes``, then the C-order data).

The result is plain data: ``{"class": "module.Name", "state": {attribute: value}}`` with numpy arrays / scalars.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np

# (module, name) of every global a StandardScaler / LogisticRegression joblib file may name
ESTIMATORS = {
    ("sklearn.preprocessing._data", "StandardScaler"),
    ("sklearn.linear_model._logistic", "LogisticRegression"),
}
_ARRAY_WRAPPERS = {("joblib.numpy_pickle", "NumpyArrayWrapper")}
_NDARRAY = {("numpy", "ndarray")}
_DTYPE = {("numpy", "dtype")}
_SCALAR = {("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar")}


class UnsafePickleError(ValueError):
    """The file names something this reader does not accept (it was not executed)."""


class _Record:
    """Stand-in for an estimator: keeps the state the pickle would have set."""

    def __init__(self, qualname: str):
        self.qualname = qualname
        self.state: dict[str, Any] = {}


class _ArrayWrapper:
    """Stand-in for joblib's NumpyArrayWrapper: shape, order and dtype of the array whose bytes follow."""

    def __init__(self):
        self.state: dict[str, Any] = {}


class _DTypeRecord:
    def __init__(self, code: str):
        self.code = code
        self.byteorder = "="

    def resolve(self) -> np.dtype:
        order = {"<": "<", ">": ">", "|": "|", "=": "="}.get(self.byteorder, "=")
        return np.dtype(order + self.code if order != "|" else self.code)


def _dtype_factory(code, *_flags):
    if not isinstance(code, str):
        raise UnsafePickleError(f"numpy dtype built from {type(code).__name__}, expected a type code")
    return _DTypeRecord(code)


def _scalar_factory(dtype, raw=None):
    if not isinstance(dtype, _DTypeRecord) or not isinstance(raw, (bytes, bytearray)):
        raise UnsafePickleError("numpy scalar without a dtype and raw bytes")
    return np.frombuffer(bytes(raw), dtype=dtype.resolve())[0]


def _ndarray_marker(*_args):
    raise UnsafePickleError("numpy.ndarray reconstructed directly (only joblib's array records are read)")


class _InertUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcode table can be extended
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BufferedIOBase, source: str):
        super().__init__(file)
        self._file = file
        self._source = source

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in ESTIMATORS:
            return type("Inert" + name, (), {"__new__": lambda cls, *a: _Record(f"{module}.{name}")})
        if key in _ARRAY_WRAPPERS:
            return type("InertArrayWrapper", (), {"__new__": lambda cls, *a: _ArrayWrapper()})
        if key in _NDARRAY:
            return _ndarray_marker
        if key in _DTYPE:
            return _dtype_factory
        if key in _SCALAR:
            return _scalar_factory
        raise UnsafePickleError(f"{self._source}: names {module}.{name}, which a scikit-learn scaler / linear "
                                f"model file does not need; it was not loaded (nothing in it ran)")

    def _read_array(self, wrapper: _ArrayWrapper) -> np.ndarray:
        state = wrapper.state
        dtype = state.get("dtype")
        if not isinstance(dtype, _DTypeRecord):
            raise UnsafePickleError(f"{self._source}: array record without a plain dtype")
        dtype = dtype.resolve()
        if dtype.hasobject:
            raise UnsafePickleError(f"{self._source}: an object array (would need code to rebuild)")
        shape = tuple(int(s) for s in state.get("shape", ()))
        if state.get("numpy_array_alignment_bytes") is not None:
            pad = self._file.read(1)
            if len(pad) != 1:
                raise UnsafePickleError(f"{self._source}: truncated array padding")
            self._file.read(pad[0])
        count = int(np.prod(shape)) if shape else 1
        raw = self._file.read(count * dtype.itemsize)
        if len(raw) != count * dtype.itemsize:
            raise UnsafePickleError(f"{self._source}: truncated array data")
        array = np.frombuffer(raw, dtype=dtype).copy()
        order = state.get("order", "C")
        return array.reshape(shape, order="F" if order == "F" else "C")

    def _load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, _DTypeRecord):
            if isinstance(state, tuple) and len(state) > 1 and isinstance(state[1], str):
                inst.byteorder = state[1]
            return
        if isinstance(inst, (_Record, _ArrayWrapper)) and isinstance(state, dict):
            inst.state.update(state)
            if isinstance(inst, _ArrayWrapper):
                self.stack[-1] = self._read_array(inst)
            return
        raise UnsafePickleError(f"{self._source}: state set on a {type(inst).__name__}, which is not accepted")

    dispatch[pickle.BUILD[0]] = _load_build


def _plain(value: Any) -> Any:
    if isinstance(value, _Record):
        return {"class": value.qualname, "state": {k: _plain(v) for k, v in value.state.items()}}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, (_ArrayWrapper, _DTypeRecord)):
        raise UnsafePickleError("an incomplete array record")
    return value


def read_estimator(path: str | Path) -> dict[str, Any]:
    """``{"class": ..., "state": {...}}`` of a joblib-pickled scaler / linear model, read without running it."""
    path = Path(path)
    with open(path, "rb") as handle:
        try:
            obj = _InertUnpickler(handle, str(path)).load()
        except UnsafePickleError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise UnsafePickleError(f"{path}: not a readable joblib estimator file ({exc})") from None
    if not isinstance(obj, _Record):
        raise UnsafePickleError(f"{path}: holds a {type(obj).__name__}, not a scikit-learn estimator")
    return _plain(obj)
