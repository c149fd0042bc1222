"""Subnetworks of an untrained MLP on scikit-learn's bundled digits (issue 13): the ASLP setting
(Dupont et al., arXiv 2202.12986) at small scale, with the library's own subnet machinery.

    OMP_NUM_THREADS=1 python -m benchmarks.subnet_digits            # ~4 min on one core
    python -m benchmarks.subnet_digits --smoke          # seconds, into a scratch dir: the test
    python -m benchmarks.subnet_digits --render-only

``load_digits`` (1,797 real 8×8 digits, no download), features ÷ 16, one stratified 60/20/20
train/val/test split (split seed 0). MLP 64→256→256→10 with ReLU, Kaiming-normal fan-in
weights and U(±1/√fan_in) biases as the reference's ``PrunableLinear``; weights and biases stay
frozen at their random values. Per seed (0, 1, 2: network init, mask noise, data order):

- ``paper``: every weight's keep logit starts at 0, ``subnet.KeepLogitMask`` (hard Gumbel
  sample, τ 1, straight-through), the library ``Trainer`` with SGD lr 50 momentum 0.9 constant,
  batch 256; the layer scale (with rescaling) on SGD lr 1e-3; extraction keeps logit ≥ 0 (the
  sparsity emerges) and folds the scale in (``subnet.learning.extract_layer``);
- ``target s``: the same plus the keep-rate constraint (``KeepRateConstraint``) and top-k
  extraction at exactly sparsity ``s``;
- ``random``: a uniformly random mask with the same kept count per layer on the same weights,
  unscaled and rescaled by 1/keep-rate per layer;
- ``dense``: the same network with every weight and bias trained (Adam lr 1e-3, same epochs).

Every epoch the extracted (hard) subnetwork is scored on val; the test accuracy is that of the
epoch with the best val accuracy (first of ties), measured on the model ``extract_layer`` gives.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import Table, add_harness_args, run_table
from benchmarks.subnet_digits_data import accuracy, load_split, new_network, split_info
from benchmarks.subnet_digits_plot import plot, render
from lmcompress.compressor.training.trainer import TrainConfig, Trainer
from lmcompress.methods.subnet.config import SubnetConfig
from lmcompress.methods.subnet.learning import extract_layer, learnable, new_mask

log = logging.getLogger(__name__)

NAME = "subnet_digits"
LAYERS = ("fc1", "fc2", "fc3")
FULL: dict[str, Any] = {
    "seeds": [0, 1, 2],
    "hidden": 256,
    "epochs": 200,
    "batch_size": 256,
    "targets": [0.3, 0.5, 0.7, 0.9, 0.95],
    "constraint": "lagrangian",
    "constraint_weight": 0.01,
    "other_constraint": "penalty",  # compared at OTHER_TARGETS, with rescaling
    "other_constraint_weight": 1.0,
    "other_targets": [0.7, 0.9],
    # the constraint times layer size / mean size (constraint_scale="size"), both kinds
    "size_scaled": [["penalty", 1.0], ["lagrangian", 0.01]],
    "size_targets": [0.9, 0.95],
    "lr": 50.0,
    "momentum": 0.9,
    "scale_lr": 1e-3,
    "tau": 1.0,
    "dense_lr": 1e-3,
}
NOTE = (
    "At 95 % the keep-rate constraint collapses every seed: the logits of a layer start equal"
    " and move in lockstep, and at lr 50 with momentum the constraint (relative deviation 9 "
    "at the start, per-logit gradient ∝ 1/(target keep rate × layer size)) overshoots within "
    "~10 steps, driving every logit of fc1 and fc3 below the sigmoid's saturation (keep rate "
    "0), where neither the constraint nor the loss has a gradient left; top-k then picks "
    "among saturated logits. A constraint weight that holds 30-90 % (lagrangian 0.01, penalty"
    " 1) is too strong at 5 % kept; a probe with penalty 0.2 (seed 0, not in the table) "
    "reached 90 % test accuracy at 95 %. Size-scaled rows (`--constraint-scale size`: each "
    "layer's deviation × its size / the mean size, so that fc1 and fc3 are no longer pulled "
    "harder than fc2): with the penalty, 95 % no longer collapses (81.1 % against 22.5 %) and"
    " 90 % is as good (95.7 ± 0.7 against 95.3 ± 1.3); with the Lagrange multipliers 95 % "
    "still collapses (19.6 %): they grow while the rate is above target and keep pushing "
    "after it is met, so the overshoot is the multipliers', not only the layer sizes'."
)
QUICK: dict[str, Any] = {
    **FULL,
    "seeds": [0],
    "hidden": 128,
    "epochs": 12,
    "targets": [0.5],
    "other_targets": [],
    "size_scaled": [["penalty", 1.0]],
    "size_targets": [0.5],
}


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def mask_config(
    hp: dict[str, Any],
    target: float | None,
    rescale: bool,
    constraint: str,
    weight: float,
    scale: str = "relative",
) -> SubnetConfig:
    """Threshold extraction without a constraint (``target`` None: the sparsity emerges), else
    top-k at ``target``."""
    return SubnetConfig(
        sparsity=str(target if target is not None else 0.5),
        prior="none",
        scale="layer" if rescale else "none",
        scale_lr=hp["scale_lr"],
        tau=hp["tau"],
        extract="topk" if target is not None else "threshold",
        constraint=constraint if target is not None else "none",
        constraint_weight=weight,
        constraint_scale=scale,
    )


def train_config(data: dict[str, torch.Tensor], hp: dict[str, Any], seed: int) -> TrainConfig:
    """The paper's SGD, ``epochs`` passes over the training split, scored every epoch."""
    per_epoch = max(1, round(len(data["y_train"]) / hp["batch_size"]))
    return TrainConfig(
        steps=hp["epochs"] * per_epoch,
        lr=hp["lr"],
        optimizer="sgd",
        momentum=hp["momentum"],
        schedule="constant",
        weight_decay=0.0,
        grad_clip=0.0,
        batch_size=hp["batch_size"],
        eval_every=per_epoch,
        seed=seed,
    )


def extract(config: SubnetConfig, modules: dict[str, nn.Module], state: dict) -> tuple[int, int]:
    """Fold the best epoch's masks (and scales) into the layers; (weights kept, weights)."""
    kept = total = 0
    for name, module in modules.items():
        logits, scale = state[name]
        report = extract_layer(config, name, module, logits, scale)
        kept, total = kept + report.params_kept, total + report.params
    return kept, total


def train_mask(
    data: dict[str, torch.Tensor],
    hp: dict[str, Any],
    seed: int,
    target: float | None,
    rescale: bool,
    constraint: str,
    constraint_weight: float,
    scale: str = "relative",
) -> dict[str, Any]:
    """One subnetwork of the seed's random network, learned with the library's Trainer; the
    extracted model at the epoch of best hard-mask val accuracy, scored on test."""
    started = time.perf_counter()
    model = new_network(hp["hidden"], seed)
    config = mask_config(hp, target, rescale, constraint, constraint_weight, scale)
    modules = {name: getattr(model, name) for name in LAYERS}
    masks = {name: new_mask(config, name, module, None) for name, module in modules.items()}
    training = train_config(data, hp, seed)
    trained = learnable(config, masks, training.steps)  # logits, scales, multipliers, keep rate
    params, options, keep_rate = trained.params, trained.param_options, trained.extra_loss

    def loss_fn(net: nn.Module, batch: tuple, step: int) -> tuple[torch.Tensor, dict]:
        x, y = batch
        loss = F.cross_entropy(net(x), y)
        term, logs = keep_rate(step)
        return loss + term, {"ce": float(loss.detach()), **logs}

    curve: list[float] = []
    best: dict[str, Any] = {"val": -1.0}

    def evaluate(_step: int) -> dict[str, float]:
        for mask in masks.values():
            mask.hard = True
        val = accuracy(model, data["X_val"], data["y_val"])
        for mask in masks.values():
            mask.hard = False
        curve.append(val)
        if val > best["val"]:
            best.update(val=val, epoch=len(curve), state=_snapshot(masks))
        return {"val_acc": val}

    torch.manual_seed(seed)  # the mask noise
    trainer = Trainer(
        model,
        params,
        training,
        loss_fn,
        evaluate=evaluate,
        collate=lambda _examples, idx: (data["X_train"][idx], data["y_train"][idx]),
        param_options=options,
        desc=f"seed {seed} target {target} rescale {rescale}",
        leave=False,
    )
    state = trainer.fit(torch.arange(len(data["y_train"])))
    last = state.history[-1]
    kept, total = extract(config, modules, best["state"])
    test = accuracy(model, data["X_test"], data["y_test"])
    keeps = {n: int(module.weight.ne(0).sum()) for n, module in modules.items()}
    return {
        "val_curve": curve,
        "best_epoch": best["epoch"],
        "val_acc": best["val"],
        "test_acc": test,
        "sparsity": 1.0 - kept / total,
        "kept_per_layer": keeps,
        "scales": {n: None if s is None else float(s) for n, (_, s) in best["state"].items()},
        "final_keep_dev": last.get("keep_dev"),
        "seconds": round(time.perf_counter() - started, 2),
        "peak_rss_mb": peak_rss_mb(),
    }


def _snapshot(masks: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    return {
        name: (
            mask.logits.detach().clone(),
            None if mask.scale is None else mask.scale.detach().clone(),
        )
        for name, mask in masks.items()
    }


def random_subnet(
    data: dict[str, torch.Tensor], hp: dict[str, Any], seed: int, kept: dict[str, int]
) -> dict[str, Any]:
    """A uniformly random mask with ``kept`` weights per layer on the seed's random network:
    test accuracy unscaled and with every layer's kept weights × 1/keep-rate."""
    started = time.perf_counter()
    model = new_network(hp["hidden"], seed)
    generator = torch.Generator().manual_seed(10_000 + seed)
    out = {}
    for rescaled in (False, True):
        net = new_network(hp["hidden"], seed) if rescaled else model
        for name in LAYERS:
            W = getattr(net, name).weight
            generator.manual_seed(10_000 + seed + LAYERS.index(name))  # same mask both times
            keep = torch.zeros(W.numel(), dtype=torch.bool)
            keep[torch.randperm(W.numel(), generator=generator)[: kept[name]]] = True
            factor = W.numel() / max(kept[name], 1) if rescaled else 1.0
            W.mul_(keep.reshape(W.shape) * factor)
        out["test_acc_rescaled" if rescaled else "test_acc"] = accuracy(
            net, data["X_test"], data["y_test"]
        )
    out.update(seconds=round(time.perf_counter() - started, 2), peak_rss_mb=peak_rss_mb())
    return out


def train_dense(data: dict[str, torch.Tensor], hp: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every weight and bias of the seed's network trained with Adam (plain torch), same
    batches per epoch; test accuracy at the best val epoch."""
    started = time.perf_counter()
    model = new_network(hp["hidden"], seed).requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=hp["dense_lr"])
    generator = torch.Generator().manual_seed(seed)
    n, batch = len(data["y_train"]), hp["batch_size"]
    curve, best = [], (-1.0, 0, None)
    for epoch in range(hp["epochs"]):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            loss = F.cross_entropy(model(data["X_train"][idx]), data["y_train"][idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val = accuracy(model, data["X_val"], data["y_val"])
        curve.append(val)
        if val > best[0]:
            best = (val, epoch + 1, {k: v.clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[2])
    return {
        "val_curve": curve,
        "best_epoch": best[1],
        "val_acc": best[0],
        "test_acc": accuracy(model, data["X_test"], data["y_test"]),
        "seconds": round(time.perf_counter() - started, 2),
        "peak_rss_mb": peak_rss_mb(),
    }


def run(hp: dict[str, Any]) -> dict[str, Any]:
    """Every row at every seed; rows carry their per-seed results."""
    data = load_split()
    rows: list[dict[str, Any]] = []
    settings = [(None, r, "none", 0.0, "relative") for r in (True, False)]
    settings += [(t, r, hp["constraint"], hp["constraint_weight"], "relative")
                 for t in hp["targets"] for r in (True, False)]  # fmt: skip
    settings += [(t, True, hp["other_constraint"], hp["other_constraint_weight"], "relative")
                 for t in hp["other_targets"]]  # fmt: skip
    settings += [(t, True, kind, weight, "size")
                 for kind, weight in hp["size_scaled"] for t in hp["size_targets"]]  # fmt: skip
    for target, rescale, constraint, weight, scale in settings:
        row = {"kind": "extracted", "target": target, "rescale": rescale,
               "constraint": constraint, "constraint_weight": weight,
               "constraint_scale": scale, "seeds": {}}  # fmt: skip
        random_row = {"kind": "random", "target": target, "seeds": {}}
        for seed in hp["seeds"]:
            result = train_mask(data, hp, seed, target, rescale, constraint, weight, scale)
            row["seeds"][str(seed)] = result
            log.info("%s %s %s seed %d: test %.4f sparsity %.3f (%.1f s)", target, rescale,
                     constraint, seed, result["test_acc"], result["sparsity"],
                     result["seconds"])  # fmt: skip
            if rescale and scale == "relative" and constraint in (hp["constraint"], "none"):
                random_row["seeds"][str(seed)] = random_subnet(
                    data, hp, seed, result["kept_per_layer"]
                )
        rows.append(row)
        if random_row["seeds"]:
            rows.append(random_row)
    dense = {"kind": "dense", "target": None, "seeds": {}}
    for seed in hp["seeds"]:
        dense["seeds"][str(seed)] = train_dense(data, hp, seed)
    rows.append(dense)
    return {"rows": rows, "split": split_info(data)}


def measure(args: argparse.Namespace, _names: list[str], _previous: dict) -> Iterator[dict]:
    """The whole run (``--smoke``: the seconds-long one); its record."""
    hp = QUICK if args.smoke else FULL
    started = time.perf_counter()
    result = run(hp)
    yield {
        "quick": args.smoke,
        "note": None if args.smoke else NOTE,
        "hyperparameters": hp,
        **result,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "peak_rss_mb": peak_rss_mb(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, work=False)
    parser.add_argument(
        "--smoke", "--quick", action="store_true", help="a seconds-long run (to a scratch dir)"
    )
    return run_table(Table(NAME, render, measure, plot=plot), parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
