"""The objects the benchmark moves: realistic built-in payloads, user payloads, and size parsing.

A payload makes one object per rank: ``payload.make(rank, size)``. Scalable payloads grow to
about ``size`` bytes (measured as their pickle size); fixed ones (a metrics dict, a config)
have their natural size whatever ``size`` is, and run once per payload.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

_CALIBRATION_ITEMS = 64
ARRAY_LENGTH = 100  # "arrays": each array's float64s (about 1 KB); the payload's size sets how many arrays
_WORDS = (
    "the model predicts a label for every sample in the batch while the loss goes down slowly "
    "and gradients flow through attention layers across ranks of the cluster"
).split()


@dataclass(frozen=True)
class Payload:
    """A named object factory: ``make(rank, size)`` returns the object rank ``rank`` sends."""

    name: str
    description: str
    make: Callable[[int, int], Any]
    scalable: bool = True


def reference_size(obj: Any) -> int:
    """The serializer-independent size of ``obj``: its pickle (protocol 5) length in bytes."""
    return len(pickle.dumps(obj, protocol=5))


def _scaled(build: Callable[[random.Random, int, int], Any]) -> Callable[[int, int], Any]:
    """Turn ``build(rng, rank, n_items)`` into ``make(rank, size)`` that sizes ``n`` to hit ``size`` bytes."""

    def make(rank: int, size: int) -> Any:
        sample = reference_size(build(random.Random(rank), rank, _CALIBRATION_ITEMS))
        empty = reference_size(build(random.Random(rank), rank, 0))
        per_item = max(1.0, (sample - empty) / _CALIBRATION_ITEMS)
        n = max(1, round((size - empty) / per_item))
        return build(random.Random(1000 + rank), rank, n)

    return make


def _metrics(rank: int, size: int) -> Dict[str, Any]:
    rng = random.Random(rank)
    return {
        "step": 1200,
        "epoch": 3,
        "rank": rank,
        "loss": 2.0 + rng.random(),
        "accuracy": rng.random(),
        "lr": 3e-4,
        "grad_norm": 1.0 + rng.random(),
        "samples_per_s": 900.0 + 100 * rng.random(),
    }


def _records(rng: random.Random, rank: int, n: int) -> List[Dict[str, Any]]:
    return [
        {
            "id": rank * 10_000_000 + i,
            "score": rng.random(),
            "label": rng.randrange(10),
            "pred": rng.randrange(10),
            "source": f"shard-{rank:02d}/sample-{i:07d}.jpg",
            "caption": " ".join(rng.choices(_WORDS, k=4)),
        }
        for i in range(n)
    ]


def _floats(rng: random.Random, rank: int, n: int) -> List[float]:
    return [rng.gauss(0.0, 1.0) for _ in range(n)]


def _strings(rng: random.Random, rank: int, n: int) -> List[str]:
    return [" ".join(rng.choices(_WORDS, k=rng.randrange(2, 8))) for _ in range(n)]


def _int_keys(rng: random.Random, rank: int, n: int) -> Dict[int, int]:
    return {1_000_000_000 + rank * 10_000_000 + i * 7: rng.randrange(100_000, 1_000_000) for i in range(n)}


def _config(rank: int, size: int) -> Dict[str, Any]:
    layer = {"dim": 1024, "heads": 16, "dropout": 0.1, "activation": "gelu", "kernel": (3, 3), "norm": None}
    return {
        "run": {"name": "pretrain-base", "seed": 1234 + rank, "tags": ["baseline", "bf16", f"rank{rank}"]},
        "model": {
            "arch": "transformer",
            "vocab": 32_000,
            "tie_embeddings": True,
            "layers": [dict(layer, index=i) for i in range(24)],
        },
        "optimizer": {
            "name": "adamw",
            "lr": 3e-4,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.01,
            "schedule": {"kind": "cosine", "warmup_steps": 2000, "min_lr": 1e-5},
        },
        "data": {
            "paths": [f"/datasets/corpus/part-{i:05d}.parquet" for i in range(16)],
            "batch_size": 32,
            "shuffle": True,
            "workers": 8,
        },
    }


def _numpy(rng: random.Random, rank: int, n: int) -> Dict[str, Any]:
    import numpy as np

    gen = np.random.default_rng(rng.randrange(1 << 30))
    return {"embeddings": gen.standard_normal((n, 64), dtype=np.float32), "labels": gen.integers(0, 10, n)}


def _arrays(rng: random.Random, rank: int, n: int) -> Dict[str, Any]:
    import numpy as np

    gen = np.random.default_rng(rng.randrange(1 << 30))
    return {f"layer{i:04d}.stats": gen.standard_normal(ARRAY_LENGTH) for i in range(n)}


def _tensors(rng: random.Random, rank: int, n: int) -> Dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return {
        "logits": torch.randn(n, 32, generator=gen),
        "targets": torch.randint(0, 32, (n,), generator=gen),
        "step": 1200,
    }


BUILTIN: Dict[str, Payload] = {
    p.name: p
    for p in [
        Payload("metrics", "a small metrics dict (fixed size)", _metrics, scalable=False),
        Payload("records", "per-rank prediction records: ids, scores, labels, strings", _scaled(_records)),
        Payload("floats", "a long list of Python floats", _scaled(_floats)),
        Payload("strings", "a list of short strings", _scaled(_strings)),
        Payload("int-keys", "a dict with int keys (id -> count)", _scaled(_int_keys)),
        Payload("config", "a nested config with tuples and None (fixed size)", _config, scalable=False),
        Payload("numpy", "numpy arrays: float32 embeddings and int64 labels", _scaled(_numpy)),
        Payload(
            "arrays",
            f"many small numpy arrays: a dict of {ARRAY_LENGTH}-float64 arrays (about 100 at 80KB)",
            _scaled(_arrays),
        ),
        Payload("tensors", "a dict holding torch tensors", _scaled(_tensors)),
    ]
}


def user_payload(spec: str) -> Payload:
    """Load ``module:function``; the function gets the rank (and the size, if it takes two arguments).

    Raises ``ValueError`` with what to fix when the spec is malformed or does not resolve.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--payload expects module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"--payload {spec}: cannot import {module_name!r} ({exc}); is it in the current directory or on PYTHONPATH?"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--payload {spec}: module {module_name!r} has no function {attr!r}")
    takes_size = _positional_params(fn) >= 2
    make = (lambda rank, size: fn(rank, size)) if takes_size else (lambda rank, size: fn(rank))
    return Payload(spec, f"user payload {spec}", make, scalable=takes_size)


def resolve_payload(name: str) -> Payload:
    """A built-in payload by name, or a user one by ``module:function``."""
    if ":" in name:
        return user_payload(name)
    if name not in BUILTIN:
        raise ValueError(f"unknown payload {name!r}; choose from {', '.join(BUILTIN)} or give module:function")
    return BUILTIN[name]


def _positional_params(fn: Callable[..., Any]) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds)


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"64KB"`` -> 65536 (KB, MB, GB are powers of 1024); raise ``ValueError`` on anything else."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: use a number with an optional unit B, KB, MB or GB, e.g. 64KB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"bad size {text!r}: sizes must be at least 1 byte")
    return size


def format_size(n: float) -> str:
    """Bytes for people: ``1536`` -> ``"1.5 KB"``."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 100 or value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"
