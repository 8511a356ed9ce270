"""Every tensor generation reads moves with the model (issue 13: Infinity's RoPE tables and the T5 wrapper did not).

On a CPU-only machine a device move cannot be observed, so two stand-ins are used:

* a ``TorchDispatchMode`` records every tensor an operator of ``generate()`` reads that no operator of the same
  generation produced ("external" tensors). Each must be a parameter or buffer of the modules Lightning moves
  (``GenerationModule(adapter)``), the caller's own condition tensor, or a tensor built from Python data inside
  the generation (``torch.tensor(...)``, dispatched as ``lift_fresh``). A plain tensor attribute anywhere — on an
  adapter, a policy component, a module-level constant — shows up here, and it is exactly what stays behind on the
  CPU when the model moves to a GPU;
* moving the Lightning module to float64 (what ``.to(device)`` does for devices, with a dtype): a float32 tensor
  that did not move meets a float64 one in a matrix product and raises, as a CPU tensor meets a CUDA one; and every
  external floating tensor read afterwards must be float64.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from var_core.accel import build_policy
from var_core.accel.presets import get_preset
from var_core.engine import GenerationOptions, SamplingConfig, generate
from var_core.eval.lightning import GenerationModule
from var_core.zoo import load_model

PRESETS = (None, "nova", "fastvar", "ldpruning", "toprovar", "sparsevar", "skipvar", "stagevar")
SAMPLING = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)
OPTIONS = GenerationOptions(check_finite=False)


class ExternalTensors(TorchDispatchMode):
    """Records ``(tensor, op)`` for every operator input that no operator inside the mode produced."""

    def __init__(self):
        super().__init__()
        self._made: dict[int, weakref.ref] = {}
        self.external: dict[int, tuple[torch.Tensor, str]] = {}

    def _produced(self, t: torch.Tensor) -> bool:
        ref = self._made.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and not self._produced(t):
                self.external.setdefault(id(t), (t, str(func)))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._made[id(t)] = weakref.ref(t)
        return out


@pytest.fixture(scope="module")
def adapters(fixture_dir):
    return {"official-tiny": load_model("official-tiny", weights=fixture_dir),
            "random:infinity-tiny": load_model("random:infinity-tiny")}


def _config(preset: str, adapter):
    config = get_preset(preset)
    if preset == "toprovar" and adapter.num_scales <= 6:  # the paper's s_rep=6 needs more than 6 scales
        config = dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, s_rep=3))
    return config


def _stray(adapter, preset, module) -> tuple[list[str], list[tuple[str, torch.dtype]]]:
    owned = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    labels = torch.tensor([3, 7])
    policy = build_policy(_config(preset, adapter)) if preset else None
    recorder = ExternalTensors()
    with recorder:
        generate(adapter, labels, seeds=[0, 1], sampling=SAMPLING, policy=policy, options=OPTIONS)
    stray, dtypes = [], []
    for tensor, op in recorder.external.values():
        if tensor is labels or op == "aten.lift_fresh.default":
            continue
        if id(tensor) not in owned:
            stray.append(f"{op} read a {tuple(tensor.shape)} {tensor.dtype} tensor the modules do not own")
        elif tensor.is_floating_point():
            dtypes.append((op, tensor.dtype))
    return stray, dtypes


@pytest.mark.parametrize("model", ["official-tiny", "random:infinity-tiny"])
@pytest.mark.parametrize("preset", PRESETS)
def test_generation_reads_only_tensors_the_lightning_module_moves(adapters, model, preset):
    adapter = adapters[model]
    stray, _ = _stray(adapter, preset, GenerationModule(adapter))
    assert not stray, stray


def test_infinity_rope_tables_are_buffers_of_a_module(adapters):
    adapter = adapters["random:infinity-tiny"]
    buffers = dict(GenerationModule(adapter).named_buffers())
    assert "models.rope.cos" in buffers and "models.rope.sin" in buffers
    assert buffers["models.rope.cos"].shape == (adapter.total_tokens, adapter.cfg.head_dim // 2)
    assert "text_encoder" in adapter.modules()  # the random text encoder moves too


@pytest.mark.parametrize("model", ["official-tiny", "random:infinity-tiny"])
def test_moved_to_float64_generation_runs_and_reads_float64(fixture_dir, model):
    adapter = load_model(model, weights=fixture_dir if model == "official-tiny" else None)  # a copy of its own
    module = GenerationModule(adapter)
    module.to(torch.float64)  # every module of the adapter, as Lightning's .to(device) moves them
    stray, dtypes = _stray(adapter, "nova", module)
    assert not stray, stray
    assert dtypes and {d for _, d in dtypes} == {torch.float64}, sorted({(op, d) for op, d in dtypes
                                                                         if d != torch.float64})


class _WordTokenizer:
    """A stand-in for a T5 tokenizer: one id per word, then 1 (EOS), padded to the longest prompt."""

    def __call__(self, prompts, max_length=512, padding="longest", truncation=True, return_tensors="pt"):
        rows = [[2 + (sum(map(ord, w)) % 90) for w in p.split()][: max_length - 1] + [1] for p in prompts]
        L = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (L - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows])

        class Batch:
            input_ids, attention_mask = ids, mask

        return Batch()


def test_t5_wrapper_is_a_module_that_moves_with_the_model():
    transformers = pytest.importorskip("transformers")
    from var_core.models.text_encoder import T5TextEncoder

    config = transformers.T5Config(vocab_size=100, d_model=128, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                   dropout_rate=0.0)
    torch.manual_seed(0)
    encoder = T5TextEncoder.from_parts(transformers.T5EncoderModel(config), _WordTokenizer())
    assert isinstance(encoder, torch.nn.Module)
    adapter = load_model("random:infinity-tiny", text_encoder=encoder)
    module = GenerationModule(adapter)
    t5_params = {id(p) for p in encoder.model.parameters()}
    assert t5_params <= {id(p) for p in module.parameters()}  # Lightning moves T5 with the transformer
    module.to(torch.float64)
    assert {p.dtype for p in encoder.model.parameters()} == {torch.float64}
    recorder = ExternalTensors()
    owned = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    with recorder:
        images = generate(adapter, ["a red cat", "two dogs in the snow"], seeds=[0, 1], sampling=SAMPLING,
                          options=OPTIONS).images
    assert images.shape[0] == 2
    stray = [f"{op} {tuple(t.shape)} {t.dtype}" for t, op in recorder.external.values()
             if op != "aten.lift_fresh.default" and id(t) not in owned]
    assert not stray, stray
    read = {id(t) for t, _ in recorder.external.values()}
    assert t5_params & read  # the T5 weights were read by this generation (the prompts went through T5)
