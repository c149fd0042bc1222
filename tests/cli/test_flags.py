"""The flag generator and the recipe round trip on toy configs: Literal choices, value types
(Sparsity) and option groups (a nested dataclass whose fields are flat flags and recipe keys)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest

from lmcompress.cli.flags import add_dataclass_flags, describe
from lmcompress.compressor.config import MethodConfig, Sparsity
from lmcompress.compressor.options import flag_name, option_fields
from lmcompress.errors import ConfigError

Noise = Literal["exact", "pool"]


@dataclass(frozen=True)
class ToyTraining:
    """Stands in for the shared ``TrainingOptions`` group."""

    steps: int = field(default=100, metadata={"help": "optimiser steps"})
    lr: float = field(default=2e-4, metadata={"help": "learning rate"})
    tau: tuple[float, float] = field(default=(4.0, 0.05), metadata={"help": "START END"})
    noise: Noise = field(default="exact", metadata={"help": "Gumbel noise"})


@dataclass(frozen=True)
class ToyConfig(MethodConfig):
    method: ClassVar[str] = "toy"

    sparsity: Sparsity = field(default=Sparsity(2, 4), metadata={"help": "target"})
    training: ToyTraining = field(
        default_factory=lambda: ToyTraining(steps=7), metadata={"help": "group"}
    )
    refit: Literal["none", "sparsegpt"] = field(default="none", metadata={"help": "re-fit"})
    prior_from: str | None = field(default=None, metadata={"help": "a directory"})


@dataclass(frozen=True)
class ClashingConfig(MethodConfig):
    method: ClassVar[str] = "clash"

    steps: int = 3
    training: ToyTraining = field(default_factory=ToyTraining)


def _parse(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(exit_on_error=False)
    names = add_dataclass_flags(parser, ToyConfig)
    assert names == [o.name for o in option_fields(ToyConfig)]
    return vars(parser.parse_args(argv))


def test_group_fields_are_flat_flags_with_the_outer_default():
    names = [o.name for o in option_fields(ToyConfig)]
    assert names == [
        "include", "exclude", "sparsity", "steps", "lr", "tau", "noise", "refit", "prior_from"
    ]  # fmt: skip
    steps = next(o for o in option_fields(ToyConfig) if o.name == "steps")
    assert steps.path == ("training", "steps") and steps.default == 7  # the outer default wins
    args = _parse(["--steps", "5", "--tau", "2", "0.1", "--noise", "pool", "--sparsity", "1:4"])
    assert args == {"steps": 5, "tau": [2.0, 0.1], "noise": "pool", "sparsity": "1:4"}
    config = ToyConfig.from_dict(args)
    assert config.training == ToyTraining(steps=5, tau=(2.0, 0.1), noise="pool")
    assert config.sparsity == Sparsity(1, 4)
    assert ToyConfig.from_dict({"lr": 0.5}).training == ToyTraining(steps=7, lr=0.5)
    assert ToyConfig.from_dict({}).training == ToyTraining(steps=7)


def test_literal_annotations_become_choices():
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'gauss'"):
        _parse(["--noise", "gauss"])
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'wanda'"):
        _parse(["--refit", "wanda"])
    assert _parse(["--refit", "sparsegpt"]) == {"refit": "sparsegpt"}
    # constructed directly, the same Literal is the check (nested groups too)
    with pytest.raises(ConfigError, match="refit must be one of none, sparsegpt, got 'x'"):
        ToyConfig(refit="x")
    with pytest.raises(ConfigError, match="noise must be one of exact, pool"):
        ToyConfig.from_dict({"noise": "gauss"})


def test_to_dict_is_flat_json_and_round_trips():
    config = ToyConfig(sparsity="0.5", training=ToyTraining(steps=3, lr=1.0), refit="sparsegpt")
    recipe = config.to_dict()
    assert recipe == {
        "method": "toy",
        "include": [],
        "exclude": [],
        "sparsity": "0.5",
        "steps": 3,
        "lr": 1.0,
        "tau": [4.0, 0.05],
        "noise": "exact",
        "refit": "sparsegpt",
        "prior_from": None,
    }
    again = ToyConfig.from_dict(json.loads(json.dumps(recipe)))
    assert again == config and isinstance(again.training.tau, tuple)


def test_from_dict_accepts_a_nested_mapping_and_rejects_unknown_keys():
    nested = ToyConfig.from_dict({"training": {"steps": 2, "tau": [1, 0.5]}, "refit": "none"})
    assert nested.training == ToyTraining(steps=2, tau=(1, 0.5))
    assert ToyConfig(training={"lr": 0.1}).training == ToyTraining(lr=0.1)  # mapping on init
    with pytest.raises(ConfigError, match="unknown option.*: stepz"):
        ToyConfig.from_dict({"stepz": 2})
    with pytest.raises(ConfigError, match="unknown option.*: nope"):
        ToyConfig.from_dict({"training": {"nope": 1}})
    with pytest.raises(ConfigError, match="given twice"):
        ToyConfig.from_dict({"training": {"steps": 2}, "steps": 3})


def test_a_name_in_both_the_outer_config_and_a_group_is_refused():
    with pytest.raises(TypeError, match="'steps' is defined twice"):
        option_fields(ClashingConfig)
    with pytest.raises(TypeError, match="'steps' is defined twice"):
        ClashingConfig()


def test_describe_lists_group_options_with_defaults_and_choices():
    rows = {flag: (default, help_text) for flag, default, help_text in describe(ToyConfig)}
    assert rows["--sparsity"] == ("2:4", "target")  # as typed, not Python reprs
    assert rows["--steps"] == ("7", "optimiser steps")
    assert rows["--noise"] == ("exact", "Gumbel noise [exact|pool]")
    assert rows["--tau"] == ("4.0 0.05", "START END")
    assert rows["--prior-from"] == ("none", "a directory")
    assert "--training" not in rows
    include = "glob(s) of module names to compress"
    assert rows["--include"] == ("decoder linears", include)  # default_text: the default in words


def test_help_shows_value_types_as_text_and_groups_by_default():
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, ToyConfig)
    text = parser.format_help()
    assert "(default: 2:4)" in text and "--steps STEPS" in text and "{exact,pool}" in text
    assert "(default: 4.0 0.05)" in text


def test_every_registered_method_config_generates_flags():
    from lmcompress.methods import METHODS

    for method in METHODS.values():
        parser = argparse.ArgumentParser()
        names = add_dataclass_flags(parser, method.config_class)
        assert names == [o.name for o in option_fields(method.config_class)]
        default = method.config_class.from_dict({})
        assert method.config_class.from_dict(default.to_dict()) == default


# --- --help shows each default once, as a user types it -----------------------------------------


@dataclass(frozen=True)
class HelpConfig(MethodConfig):
    method: ClassVar[str] = "help"

    fast: bool = field(default=False, metadata={"help": "go fast"})
    dense: bool = field(default=True, metadata={"help": "keep a dense copy"})
    names: tuple[str, ...] = field(default=(), metadata={"help": "some names"})
    pair: tuple[float, float] = field(
        default=(4.0, 0.05), metadata={"help": "a pair", "metavar": ("START", "END")}
    )
    mode: Literal["x", "y"] = field(default="y", metadata={"help": "a mode"})
    where: str | None = field(default=None, metadata={"help": "a directory"})
    share: float = field(default=0.5, metadata={"help": "50% or so"})
    bare: int = 3


def _help_lines(cls: type) -> dict[str, str]:
    """{flag: its help line}, unwrapped (a very wide formatter)."""
    parser = argparse.ArgumentParser(
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=1000, max_help_position=80)
    )
    add_dataclass_flags(parser, cls)
    lines = [line.strip() for line in parser.format_help().splitlines()]
    return {line.split()[0].rstrip(","): line for line in lines if line.startswith("--")}


def test_help_shows_every_default_once_as_typed():
    lines = _help_lines(HelpConfig)
    assert set(lines) == {flag_name(o.name) for o in option_fields(HelpConfig)}
    for line in lines.values():
        assert line.count("(default:") == 1, line
        assert "(default: )" not in line and "None" not in line and "False" not in line, line
    assert lines["--fast"].endswith("go fast (default: off)")
    assert lines["--dense"].startswith("--dense, --no-dense")
    assert lines["--dense"].endswith("keep a dense copy (default: on)")
    assert lines["--names"].endswith("some names (default: none)")
    assert lines["--pair"].startswith("--pair START END")
    assert lines["--pair"].endswith("a pair (default: 4.0 0.05)")
    assert lines["--mode"].endswith("a mode (default: y)") and "{x,y}" in lines["--mode"]
    assert lines["--where"].endswith("a directory (default: none)")
    assert lines["--share"].endswith("50% or so (default: 0.5)")  # % is not a format
    assert lines["--bare"].startswith("--bare BARE") and lines["--bare"].endswith(" (default: 3)")
    assert lines["--include"].endswith("(default: decoder linears)")  # default_text


def test_switch_help_stays_ours_where_argparse_appends_a_default(monkeypatch):
    # Python 3.9-3.11.x BooleanOptionalAction append "(default: %(default)s)" themselves
    original = argparse.BooleanOptionalAction.__init__

    def appending(self, *args, help=None, **kwargs):
        original(self, *args, help=f"{help} (default: %(default)s)", **kwargs)

    monkeypatch.setattr(argparse.BooleanOptionalAction, "__init__", appending)
    line = _help_lines(HelpConfig)["--fast"]
    assert line.endswith("go fast (default: off)") and line.count("default") == 1, line


def test_switches_still_parse_both_ways():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_dataclass_flags(parser, HelpConfig)
    assert vars(parser.parse_args(["--fast", "--no-dense"])) == {"fast": True, "dense": False}
    assert vars(parser.parse_args([])) == {}  # SUPPRESS: recipes fill the rest


@pytest.mark.parametrize("name", ["magnitude", "wanda", "sparsegpt", "maskllm", "svd", "job"])
def test_real_help_has_no_empty_or_python_defaults(name):
    from lmcompress.jobs.options import RunOptions
    from lmcompress.methods import METHODS

    lines = _help_lines(RunOptions if name == "job" else METHODS[name].config_class)
    for line in lines.values():
        assert line.count("(default:") == 1, line
        assert "(default: )" not in line, line
        assert not any(f"(default: {v})" in line for v in ("None", "False", "True", "()")), line


def test_sparsity_and_ratio_helps_say_which_is_removed_and_which_kept():
    """--sparsity is the fraction removed, --ratio (low-rank) the fraction kept: each help says
    so and names the other."""
    from lmcompress.methods import METHODS

    checked = set()
    for method_class in METHODS.values():
        lines = _help_lines(method_class.config_class)
        for flag, own, other in (
            ("--sparsity", "removed", "--ratio"),
            ("--ratio", "kept", "--sparsity"),
        ):
            if flag in lines:
                help_text = lines[flag]
                assert f"fraction of weights {own}" in help_text or f"parameters {own}" in help_text
                assert "removed" in help_text and "kept" in help_text and other in help_text
                checked.add(flag)
    assert checked == {"--sparsity", "--ratio"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sparsity", "0.5", "--sparsity", "0.6"], "--sparsity is given twice: give it once"),
        (["-o", "a", "--output", "b"], "--output is given twice (as -o and --output)"),
        (["--dense-copy", "--no-dense-copy"], "given twice (as --dense-copy and --no-dense-"),
        (["--overw", "--overwrite"], "--overwrite is given twice"),  # an abbreviation
        (["-oa", "-o", "b"], "-o is given twice"),
        (["--config", "x.yaml", "--config", "y.yaml"], "--config is given twice"),
    ],
)
def test_a_flag_given_twice_is_refused_in_one_line(argv, message, capsys, monkeypatch):
    """argparse keeps the last value silently; a recipe refuses a key given twice, and the
    command line does too, whatever the spelling (issue 39, item 7)."""
    import lmcompress.jobs.run as pipeline
    from lmcompress.cli.main import main

    def never(*_args, **_kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipeline, "load_model", never)

    assert main(["smollm2-135m", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_negative_number_or_what_follows_double_dash_is_no_repeat():
    """``--seed -1`` is a value, and after ``--`` every token is a positional."""
    from lmcompress.cli.terminal import Parser

    parser = Parser()
    parser.add_argument("--seed", type=int)
    parser.add_argument("-o", "--output")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--seed", "-1", "--output=x", "--", "-o"])
    assert (args.seed, args.output, args.rest) == (-1, "x", ["-o"])
