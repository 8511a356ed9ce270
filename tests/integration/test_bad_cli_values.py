"""Bad option *values* of the generation-side commands (issue 25, "Bad inputs and faults"): each ends in one
``error:`` line that says what was wrong and what to give instead, exit 2, no traceback, nothing generated.

Before these checks the same command lines raised tracebacks mid-run (``--cfg inf`` / ``1e308``: inf / nan
probabilities in ``torch.multinomial``; ``--seed -5``: numpy's bootstrap; ``--strategy foo``: Lightning;
``--strategy ddp_spawn --devices 2`` with one batch: an empty ``DataLoader`` in a worker; ``bench entropy --device
tpu``; ``preset-flops --proxy -1``: ``statistics.mean([])``; ``demo --cfg -3``; ``verify --threads -1``) or ran to
the end with exit 0 on a wrong input (``--temperature inf`` / ``1e-300``, ``--seed 10**30``, ``--out ''``, knobs
naming scales or blocks the model does not have, ``latency --breakdown-scale 99``, ``preset-flops --text-len -5`` /
``--threads 0``, ``demo --classes 11`` on a 10-class model, ``demo --cfg nan``, ``demo`` on a text-to-image model).

Every case runs in-process through ``run_cli(main, argv)`` (the ``__main__`` path); the parse-time ones load
nothing, the model-aware ones load only the official-tiny fixture (7 scales, 2 blocks, 10 classes).
"""

from __future__ import annotations

import math

import pytest
import torch

from studies import ablate, bench, calibrate, demo, latency, preset_flops, sensitivity, sweep
from studies._cli import run_cli
from var_core.verify import cli as verify_cli

COMMANDS = {"ablate": ablate.main, "sweep": sweep.main, "sensitivity": sensitivity.main, "latency": latency.main,
            "bench": bench.main, "demo": demo.main, "preset-flops": preset_flops.main, "verify": verify_cli.main,
            "calibrate": calibrate.main}


def assert_one_error_line(rc: int, err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert len([line for line in lines if line.startswith("error:")]) == 1, err
    assert lines[-1].startswith("error:"), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def run(command: str, argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = run_cli(COMMANDS[command], argv)
    return rc, capsys.readouterr().err


# The leading words each command needs before the option under test ({out}: a fresh folder under tmp_path).
PREFIX = {
    "ablate": ["scorer", "--out", "{out}"],
    "sweep": ["nova", "--out", "{out}"],
    "sensitivity": ["tau", "--values", "0.7", "--out", "{out}"],
    "latency": ["--out", "{out}"],
    "bench": ["presets"],
    "demo": ["--out", "{out}/grid.png"],
    "calibrate": ["toprovar", "--out", "{out}"],
}
SAMPLING_COMMANDS = ("ablate", "sweep", "sensitivity", "latency", "bench")  # add_model_arguments
SEED_COMMANDS = ("ablate", "sweep", "sensitivity", "latency", "bench", "demo", "calibrate")

# (option, value, fragment of the message): the range in the message is what the user needs to fix it
CFG_CASES = [("--cfg", "inf", "finite number in [0, 100]"), ("--cfg", "1e308", "must be in [0, 100]"),
             ("--cfg", "nan", "finite number in [0, 100]"), ("--cfg", "-3", "must be in [0, 100]")]
TEMPERATURE_CASES = [("--temperature", "inf", "finite number in [0.01, 100]"),
                     ("--temperature", "1e-300", "must be in [0.01, 100]"),
                     ("--temperature", "0", "must be in [0.01, 100]")]
SEED_CASES = [("--seed", "-5", "[0, 4294967295]"), ("--seed", str(10**30), "[0, 4294967295]"),
              ("--seed", str(2**32), "[0, 4294967295]")]

PARSE_CASES = (
    [pytest.param(c, [*PREFIX[c], o, v], f, id=f"{c}{o}={v}") for c in SAMPLING_COMMANDS
     for o, v, f in CFG_CASES + TEMPERATURE_CASES]
    + [pytest.param("demo", [*PREFIX["demo"], o, v], f, id=f"demo{o}={v}") for o, v, f in CFG_CASES]
    + [pytest.param(c, [*PREFIX[c], o, v], f, id=f"{c}{o}={v}") for c in SEED_COMMANDS for o, v, f in SEED_CASES]
    + [
        pytest.param("ablate", ["scorer", "--strategy", "foo", "--out", "{out}"], "unknown strategy 'foo'",
                     id="ablate-strategy-foo"),
        pytest.param("ablate", ["scorer", "--strategy", "ddp_spwan", "--out", "{out}"], "Did you mean 'ddp_spawn'",
                     id="ablate-strategy-typo"),
        pytest.param("ablate", ["scorer", "--strategy", "fsdp", "--out", "{out}"], "shards a model",
                     id="ablate-strategy-fsdp"),
        pytest.param("ablate", ["scorer", "--out", ""], "--out: an empty folder name", id="ablate-out-empty"),
        pytest.param("latency", ["--out", " "], "--out: an empty folder name", id="latency-out-blank"),
        pytest.param("sweep", ["nova", "--out", ""], "--out: an empty folder name", id="sweep-out-empty"),
        pytest.param("demo", ["--out", ""], "--out: an empty file name", id="demo-out-empty"),
        pytest.param("ablate", ["scorer", "--save-images", "", "--out", "{out}"], "--save-images: an empty folder",
                     id="ablate-save-images-empty"),
        pytest.param("ablate", ["scorer", "--weights", "", "--out", "{out}"], "--weights: an empty path",
                     id="ablate-weights-empty"),
        pytest.param("bench", ["entropy", "--device", "tpu"], "unknown device 'tpu'", id="bench-entropy-device-tpu"),
        pytest.param("preset-flops", ["--proxy", "-1"], "--proxy: must be >= 0", id="preset-flops-proxy-negative"),
        pytest.param("preset-flops", ["--text-len", "-5"], "--text-len: must be >= 1",
                     id="preset-flops-text-len-negative"),
        pytest.param("preset-flops", ["--threads", "0"], "--threads: must be >= 1", id="preset-flops-threads-0"),
        pytest.param("preset-flops", ["--presets", "nvoa"], "Did you mean 'nova'", id="preset-flops-preset-typo"),
        pytest.param("verify", ["{out}", "--threads", "-1"], "--threads: must be >= 1", id="verify-threads-negative"),
        pytest.param("verify", ["{out}", "--threads", "0"], "--threads: must be >= 1", id="verify-threads-0"),
        pytest.param("verify", ["{out}", "--bogus"], "unrecognized arguments", id="verify-unknown-option"),
        pytest.param("latency", ["--breakdown-scale", "-1", "--out", "{out}"], "--breakdown-scale: must be >= 0",
                     id="latency-breakdown-scale-negative"),
        pytest.param("demo", ["--model", "random:infinity-tiny", "--out", "{out}/g.png"], "text-to-image model",
                     id="demo-text-model"),
    ]
)


@pytest.mark.parametrize("command, argv, fragment", PARSE_CASES)
def test_bad_value_is_one_error_line_before_anything_runs(command, argv, fragment, tmp_path, capsys):
    out = tmp_path / "out"
    rc, err = run(command, [a.format(out=out) for a in argv], capsys)
    assert_one_error_line(rc, err, fragment)
    assert not out.exists()  # refused while parsing: not even the results folder was made


def test_every_seed_option_takes_the_largest_seed(capsys):
    """The bound is inclusive: 2**32 - 1 parses (and ``demo``'s ``seed * 100_000 + i`` stays a valid torch seed)."""
    from studies._args import seed_int

    assert seed_int(str(2**32 - 1)) == 4294967295
    torch.Generator().manual_seed(4294967295 * 100_000 + 99)  # demo's largest derived seed: no overflow


def test_ddp_with_fewer_batches_than_processes_is_refused_up_front(tmp_path, capsys):
    """2 samples in batches of 2 are one batch for two processes: one process would get an empty DataLoader."""
    out = tmp_path / "out"
    rc, err = run("ablate", ["scorer", "--strategy", "ddp_spawn", "--devices", "2", "--samples", "2",
                             "--batch-size", "2", "--out", str(out)], capsys)
    # the fix the message gives must work: batch size <= 2 // 2 = 1, or samples >= (2 - 1) * 2 + 1 = 3
    assert_one_error_line(rc, err, "makes 1 batch(es) for 2 processes", "--batch-size 1 or less",
                          "--samples 3 or more")
    assert not out.exists()


def test_ddp_check_accepts_one_batch_per_process():
    from studies._args import check_devices

    check_devices("cpu", 2, 1, "ddp_spawn", samples=3, batch_size=2)  # 2 batches, 2 processes: fine
    check_devices("cpu", 1, 1, "auto", samples=2, batch_size=16)  # one process: any batch count


# ----- values that only the model can refuse (official-tiny: 7 scales, 2 blocks, 10 classes) -------------------
TINY = ["--model", "official-tiny", "--samples", "2", "--batch-size", "2", "--threads", "1", "--wandb", "disabled",
        "--timing-rounds", "0", "--no-plots", "--no-progress"]

MODEL_CASES = [
    pytest.param("ablate", ["activation", *TINY, "--set", "activation.start_scale=99"],
                 "official-tiny has 7 scales: give 0 … 6, or -1 … -7", id="start-scale-99"),
    pytest.param("ablate", ["activation", *TINY, "--set", "activation.start_scale=-8"],
                 "official-tiny has 7 scales", id="start-scale--8"),
    pytest.param("ablate", ["cache", *TINY, "--set", "restorer.cache_scale=-999"],
                 "official-tiny has 7 scales: give 0 … 6, or -1 … -7", id="cache-scale--999"),
    pytest.param("ablate", ["method", *TINY, "--arms", "nova", "--set", "exempt_first_blocks=1000000"],
                 "official-tiny has 2 blocks: give fewer than 2", id="exempt-first-blocks-huge"),
    pytest.param("ablate", ["method", *TINY, "--arms", "nova", "--set", "exempt_first_blocks=1",
                            "--set", "exempt_last_blocks=1"], "no block is left to prune", id="exempt-both-ends"),
    pytest.param("ablate", ["linkage", *TINY, "--arms", "dual", "--set", "schedule.layer_profile=nan,nan"],
                 "layer_profile=(nan, nan) must be finite", id="layer-profile-nan"),
    pytest.param("ablate", ["linkage", *TINY, "--arms", "dual", "--set", "schedule.layer_profile=1,2,3"],
                 "has 3 values but official-tiny has 2 blocks", id="layer-profile-length"),
    pytest.param("latency", ["--model", "official-tiny", "--threads", "1", "--breakdown-scale", "99"],
                 "official-tiny has 7 scales (0 … 6), got 99", id="latency-breakdown-scale-99"),
    pytest.param("demo", ["--model", "official-tiny", "--classes", "11"], "official-tiny has 10 classes, got 11",
                 id="demo-classes-11"),
]


@pytest.mark.parametrize("command, argv, fragment", MODEL_CASES)
def test_value_beyond_the_model_is_one_error_line_before_generation(command, argv, fragment, fixture_dir,
                                                                     tmp_path, capsys, monkeypatch):
    import var_core.engine.loop as loop

    def no_generation(*args, **kwargs):
        raise AssertionError("a generation started before the bad value was refused")

    monkeypatch.setattr(loop, "generate", no_generation)
    monkeypatch.setattr(loop, "_run_scale", no_generation)
    out = tmp_path / "out"
    target = ["--out", str(out / "grid.png")] if command == "demo" else ["--out", str(out)]
    rc, err = run(command, [*argv, *target], capsys)
    assert_one_error_line(rc, err, fragment)
    assert not (out / "arms").exists() or not any((out / "arms").iterdir())  # no arm record was written
    assert not (out / "grid.png").exists()


def test_model_problem_boundaries_by_hand():
    """``knobs.model_problem`` against the valid values worked out by hand for 7 scales and 2 blocks."""
    import dataclasses

    from var_core.accel.activation.fixed import FixedActivation
    from var_core.accel.knobs import model_problem
    from var_core.accel.policy import PolicyConfig
    from var_core.accel.schedules.layer_linkage import LayerLinkage
    from var_core.accel.schedules.toprovar_gate import ToProVARGate

    def field(cls, name):
        return {f.name: f for f in dataclasses.fields(cls)}[name]

    scale = field(FixedActivation.Config, "start_scale")  # index: -7 … 6
    assert [v for v in range(-10, 10) if model_problem(scale, v, 7, 2) is None] == [-7, -6, -5, -4, -3, -2, -1,
                                                                                     0, 1, 2, 3, 4, 5, 6]
    number = field(ToProVARGate.Config, "s_rep")  # 1-indexed: 1 … 7
    assert [v for v in range(-2, 10) if model_problem(number, v, 7, 2) is None] == [1, 2, 3, 4, 5, 6, 7]
    blocks = field(PolicyConfig, "exempt_first_blocks")  # a count of 2 blocks: 0 or 1
    assert [v for v in range(0, 5) if model_problem(blocks, v, 7, 2) is None] == [0, 1]
    profile = field(LayerLinkage.Config, "layer_profile")  # () or one value per block
    assert [n for n in range(5) if model_problem(profile, (0.5,) * n, 7, 2) is None] == [0, 2]


# ----- the sampler's guard: inf / nan logits mid-run ------------------------------------------------------------
@pytest.mark.parametrize("draw", ["multinomial", "inverse_cdf"])
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_non_finite_logits_are_one_error_line_not_a_multinomial_traceback(draw, bad, capsys):
    from var_core.engine.sampling import NonFiniteLogitsError, SamplingConfig, draw_categorical

    logits = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    logits[1, 2, 5] = bad  # one entry of one sample's row, as an overflowing guidance makes it
    sampling = SamplingConfig(cfg=3.0, top_k=4, top_p=0.9, temperature=1.0, draw=draw)
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    with pytest.raises(NonFiniteLogitsError):
        draw_categorical(logits, sampling, generators)

    def study(argv):  # the same error raised inside a command: one line, exit 2
        draw_categorical(logits, sampling, generators)

    rc = run_cli(study, [])
    assert_one_error_line(rc, capsys.readouterr().err, "inf or nan", "lower --cfg")


def test_finite_logits_still_draw():
    from var_core.engine.sampling import SamplingConfig, draw_categorical

    logits = torch.zeros(1, 2, 8)
    logits[..., 3] = 50.0  # all the mass on token 3
    tokens = draw_categorical(logits, SamplingConfig(top_k=4, top_p=0.9), [torch.Generator().manual_seed(0)])
    assert tokens.tolist() == [[3, 3]]


@pytest.mark.parametrize("field, value", [("cfg", math.inf), ("cfg", math.nan), ("temperature", math.inf),
                                          ("temperature", math.nan), ("top_p", math.nan)])
def test_sampling_config_refuses_non_finite_values(field, value):
    from var_core.engine.sampling import SamplingConfig

    with pytest.raises(ValueError):
        SamplingConfig(**{field: value})
