"""SkipVAR's decision models as plain numbers: a standard scaler and a multinomial logistic regression per decision.

SkipVAR (arXiv 2506.08908; code and models: fakerone-li/SkipVAR, ``SkipVAR/decision_model_ssim_*``) decides per
sample, after scale 9 of Infinity-1024, how many of the last scales to leave out (``c``, the "skip" model) and,
only when ``c = 0``, from which scale on the unconditional rows are dropped (``u``, the "uncond" model). Each model
is ``StandardScaler`` → ``LogisticRegression`` (lbfgs, multinomial) on two features (HF_Diff, HF_Ratio; the
``*_diff_only`` models read HF_Diff alone). The released code loads them with ``joblib.load``; varscope never
unpickles a third-party file at run time: the numbers of the released models ship as JSON in
``var_core/data/skipvar/`` (with each source file's sha256), and ``python -m var_core.accel.skipvar_models
FOLDER OUT.json`` converts another SkipVAR model folder by reading its pickles WITHOUT executing them
(:mod:`var_core.accel.safe_joblib`).

The decision is scikit-learn's ``predict``: ``z = (x − mean) / scale``; scores ``z · coefᵀ + intercept``; the
class of the highest score (the first on a tie, numpy's ``argmax``); a two-class model (one coefficient row)
picks ``classes[1]`` when its single score is > 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

SHIPPED = ("decision_model_ssim_84", "decision_model_ssim_86", "decision_model_ssim_88",
           "decision_model_ssim_84_diff_only")
DEFAULT_MODEL = "decision_model_ssim_84"  # the released infinity.py loads this folder (ToProVAR Table 8's "0.84")
SOURCE_REPOSITORY = "fakerone-li/SkipVAR"
SOURCE_COMMIT = "607be0efea96a91458ce1e6f6623a8b2ad0b01e6"
_FILES = {"skip": ("skip_model_scaler.pkl", "skip_model_Logistic_Regression.pkl"),
          "uncond": ("uncond_model_scaler.pkl", "uncond_model_Logistic_Regression.pkl")}


@dataclass(frozen=True)
class LogisticDecision:
    """One scaler + logistic-regression pair, as numbers."""

    mean: tuple[float, ...]
    scale: tuple[float, ...]
    coef: tuple[tuple[float, ...], ...]  # [classes (or 1), features]
    intercept: tuple[float, ...]
    classes: tuple[int, ...]

    def __post_init__(self):
        n = len(self.mean)
        if len(self.scale) != n or any(len(row) != n for row in self.coef) or len(self.coef) != len(self.intercept):
            raise ValueError("inconsistent decision model: scaler and coefficient sizes differ")
        if len(self.coef) not in (1, len(self.classes)) or (len(self.coef) == 1 and len(self.classes) != 2):
            raise ValueError("inconsistent decision model: coefficient rows do not match the classes")

    @property
    def num_features(self) -> int:
        return len(self.mean)

    def predict(self, features_BF: torch.Tensor) -> torch.Tensor:
        """int64 ``[B]``: the class each row of ``features_BF`` (``[B, num_features]``) is assigned."""
        x = features_BF.double()
        z = (x - torch.tensor(self.mean, dtype=torch.float64, device=x.device)) / torch.tensor(
            self.scale, dtype=torch.float64, device=x.device)
        scores = z @ torch.tensor(self.coef, dtype=torch.float64, device=x.device).T + torch.tensor(
            self.intercept, dtype=torch.float64, device=x.device)
        classes = torch.tensor(self.classes, dtype=torch.long, device=x.device)
        if len(self.coef) == 1:
            return classes[(scores[:, 0] > 0).long()]
        return classes[scores.argmax(dim=1)]

    def to_dict(self) -> dict:
        return dict(mean=list(self.mean), scale=list(self.scale), coef=[list(r) for r in self.coef],
                    intercept=list(self.intercept), classes=list(self.classes))

    @staticmethod
    def from_dict(data: dict) -> "LogisticDecision":
        return LogisticDecision(tuple(float(v) for v in data["mean"]), tuple(float(v) for v in data["scale"]),
                                tuple(tuple(float(v) for v in row) for row in data["coef"]),
                                tuple(float(v) for v in data["intercept"]), tuple(int(v) for v in data["classes"]))


@dataclass(frozen=True)
class DecisionModels:
    name: str
    skip: LogisticDecision  # c ∈ classes: the number of last scales left out
    uncond: LogisticDecision  # u: the number of last scales run on the conditional rows only (asked when c = 0)
    source: dict

    @property
    def num_features(self) -> int:
        return self.skip.num_features


def load_models(name_or_path: str = DEFAULT_MODEL) -> DecisionModels:
    """A shipped model by name (:data:`SHIPPED`) or a JSON file made by this module's converter."""
    if name_or_path in SHIPPED:
        text = resources.files("var_core").joinpath("data", "skipvar", f"{name_or_path}.json").read_text()
        origin = name_or_path
    else:
        path = Path(name_or_path)
        if not path.is_file():
            from difflib import get_close_matches
            near = get_close_matches(name_or_path, SHIPPED, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"SkipVAR decision model {name_or_path!r} is neither a shipped model {SHIPPED} nor a "
                             f"JSON file{hint}; convert a model folder with `python -m var_core.accel.skipvar_models "
                             f"FOLDER OUT.json`")
        text, origin = path.read_text(), str(path)
    try:
        data = json.loads(text)
        return DecisionModels(data.get("name", origin), LogisticDecision.from_dict(data["skip"]),
                              LogisticDecision.from_dict(data["uncond"]), data.get("source", {}))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{origin}: not a SkipVAR decision-model JSON ({exc})") from None


def convert_folder(folder: str | Path) -> dict:
    """The JSON-ready numbers of a SkipVAR model folder, read from its pickles without running them."""
    from .safe_joblib import read_estimator

    folder = Path(folder)
    out: dict = {"name": folder.name, "source": {"folder": folder.name, "sha256": {}}}
    for part, (scaler_file, model_file) in _FILES.items():
        scaler, model = read_estimator(folder / scaler_file), read_estimator(folder / model_file)
        for file in (scaler_file, model_file):
            out["source"]["sha256"][file] = hashlib.sha256((folder / file).read_bytes()).hexdigest()
        s, m = scaler["state"], model["state"]
        decision = LogisticDecision(
            tuple(float(v) for v in s["mean_"]), tuple(float(v) for v in s["scale_"]),
            tuple(tuple(float(v) for v in row) for row in m["coef_"]), tuple(float(v) for v in m["intercept_"]),
            tuple(int(v) for v in m["classes_"]))
        out[part] = decision.to_dict()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m var_core.accel.skipvar_models",
                                     description="Convert a SkipVAR decision-model folder (joblib pickles) to the "
                                                 "JSON varscope reads, without executing the pickles.")
    parser.add_argument("folder", help="folder holding skip_model_*.pkl and uncond_model_*.pkl")
    parser.add_argument("out", help="JSON file to write")
    args = parser.parse_args(argv)
    from .safe_joblib import UnsafePickleError
    try:
        data = convert_folder(args.folder)
    except (OSError, UnsafePickleError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}: skip classes {data['skip']['classes']}, uncond classes {data['uncond']['classes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
