"""check_types: a recipe value of the wrong type is a one-line ConfigError naming its key, raised
before any comparison (no TypeError traceback, no string iterated character by character)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest
import yaml

from lmcompress.compressor.config import MethodConfig, Sparsity
from lmcompress.compressor.options import check_types
from lmcompress.compressor.training.options import TrainingOptions
from lmcompress.errors import ConfigError
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.maskllm import MaskLLMConfig
from lmcompress.methods.sparsegpt import SparseGPTConfig
from lmcompress.methods.svd import SVDConfig


@dataclass(frozen=True)
class Group:
    steps: int = 3
    lr: float = 0.5


@dataclass(frozen=True)
class Toy(MethodConfig):
    """One option of every kind of annotation."""

    method: ClassVar[str] = "toy"

    count: int = 1
    scale: float = 1.0
    name: str = "a"
    flag: bool = False
    names: tuple[str, ...] = ()
    pair: tuple[float, float] = (1.0, 2.0)
    where: str | None = None
    mode: Literal["x", "y"] = "x"
    sparsity: Sparsity = Sparsity(2, 4)
    group: Group = field(default_factory=Group)


@dataclass(frozen=True)
class Job:
    """Shaped like the pipeline's RunOptions: any frozen dataclass can call check_types."""

    nsamples: int = 128
    eval: tuple[str, ...] = ("wiki-test",)
    output: str | None = None
    save_dtype: Literal["auto", "float32"] = "auto"
    overwrite: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        if self.nsamples < 1:  # would be a TypeError for a string without check_types
            raise ConfigError(f"nsamples must be at least 1, got {self.nsamples}")


BAD = [
    ("count", "many", "count must be an integer, got 'many'"),
    ("count", 2.5, "count must be an integer, got 2.5"),
    ("count", True, "count must be an integer, got true"),
    ("count", None, "count must be an integer, got null"),
    ("scale", "big", "scale must be a finite number, got 'big'"),
    ("scale", False, "scale must be a finite number, got false"),
    ("scale", float("nan"), "scale must be a finite number, got nan"),
    ("scale", [1.0], r"scale must be a finite number, got \[1.0\]"),
    ("name", 3, "name must be a string, got 3"),
    ("flag", "yes", "flag must be true or false, got 'yes'"),
    ("flag", 1, "flag must be true or false, got 1"),
    ("names", "abc", r"names must be a list of strings, got the string 'abc' \(write \[abc\]\)"),
    ("names", ["a", 1], r"names must be a list of strings, got \['a', 1\]"),
    ("names", 5, "names must be a list of strings, got 5"),
    ("pair", [1.0], r"pair must be a list of 2 numbers, got \[1.0\]"),
    ("pair", [1.0, "x"], r"pair must be a list of 2 numbers, got \[1.0, 'x'\]"),
    ("where", 7, "where must be a string or null, got 7"),
    ("sparsity", [2, 4], r"sparsity must be an N:M pattern or a ratio .*, got \[2, 4\]"),
    ("sparsity", True, "sparsity must be an N:M pattern or a ratio .*, got true"),
    ("steps", "ten", "steps must be an integer, got 'ten'"),  # inside the option group
    ("lr", None, "lr must be a finite number, got null"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD)
def test_a_wrong_type_names_its_key_from_a_recipe(key, value, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        Toy.from_dict({key: value})


@pytest.mark.parametrize(("key", "value", "message"), BAD)
def test_a_wrong_type_names_its_key_on_construction(key, value, message):
    kwargs = {"group": {key: value}} if key in ("steps", "lr") else {key: value}
    with pytest.raises(ConfigError, match=f"^{message}$"):
        Toy(**kwargs)


def test_good_values_are_stored_normalised():
    config = Toy.from_dict(
        {"count": 2, "scale": 3, "names": ["a", "b"], "pair": [1, 2], "where": "d", "flag": True}
    )
    assert config.scale == 3.0 and type(config.scale) is float  # an int for a float: a float
    assert config.names == ("a", "b") and config.pair == (1.0, 2.0)  # lists: tuples
    assert all(type(v) is float for v in config.pair)
    assert (config.count, config.where, config.flag) == (2, "d", True)
    assert Toy(sparsity=0.5).sparsity == Sparsity(ratio=0.5)  # a number for a value type
    assert Toy(sparsity=Sparsity(1, 4)).sparsity == Sparsity(1, 4)
    assert Toy(where=None).where is None
    assert Toy.from_dict(Toy(count=5, names=("x",)).to_dict()) == Toy(count=5, names=("x",))


def test_numbers_written_as_text_are_numbers():
    # YAML 1.1 reads `lr: 2e-4` as the text "2e-4"
    recipe = yaml.safe_load("scale: 2e-4\ncount: '12'")
    assert recipe["scale"] == "2e-4"
    config = Toy.from_dict(recipe)
    assert config.scale == 2e-4 and config.count == 12
    assert MaskLLMConfig.from_dict({"lr": "1e-3"}).training.lr == 1e-3  # a group's own check
    with pytest.raises(ConfigError, match="count must be an integer, got '1.5'"):
        Toy.from_dict({"count": "1.5"})


def test_literal_values_are_left_to_check_choices():
    with pytest.raises(ConfigError, match="mode must be one of x, y, got 3"):
        Toy(mode=3)
    assert Toy(mode="y").mode == "y"


def test_an_option_group_must_be_a_mapping_of_its_options():
    with pytest.raises(ConfigError, match="group must be a mapping of options, got 'fast'"):
        Toy(group="fast")
    with pytest.raises(ConfigError, match="unknown option.* in group: stepz"):
        Toy(group={"stepz": 1})
    assert Toy(group={"lr": 2}).group == Group(lr=2.0)


def test_any_frozen_dataclass_like_the_job_options():
    with pytest.raises(ConfigError, match="^nsamples must be an integer, got 'many'$"):
        Job(nsamples="many")
    with pytest.raises(ConfigError, match=r"eval must be a list of strings, got the string"):
        Job(eval="wiki-test")  # not iterated as w, i, k, ...
    with pytest.raises(ConfigError, match="overwrite must be true or false, got 'no'"):
        Job(overwrite="no")
    assert Job(eval=["wiki-test", "c4"]).eval == ("wiki-test", "c4")
    assert Job(output="out").output == "out"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SparseGPTConfig.from_dict({"blocksize": "big"}), "blocksize must be an integer"),
        (lambda: SparseGPTConfig(percdamp="x"), "percdamp must be a finite number"),
        (lambda: SparseGPTConfig(calib_batch_size="8x"), "calib_batch_size must be an integer"),
        (lambda: MagnitudeConfig.from_dict({"include": "model.*"}), "include must be a list"),
        (lambda: MagnitudeConfig(layer_sparsity=[0.5]), "layer_sparsity must be a list of str"),
        (lambda: MaskLLMConfig.from_dict({"steps": "many"}), "steps must be an integer"),
        (lambda: MaskLLMConfig(tau=(1.0, "x")), "tau must be a list of 2 numbers"),
        (lambda: MaskLLMConfig.from_dict({"resume": "yes"}), "resume must be true or false"),
        (lambda: MaskLLMConfig(prior_from=3), "prior_from must be a string or null"),
        (lambda: TrainingOptions(lr="fast"), "lr must be a finite number"),
        (lambda: TrainingOptions(checkpoint_every=None), "checkpoint_every must be an integer"),
        (lambda: SVDConfig.from_dict({"ratio": [0.5]}), "ratio must be a finite number"),
    ],
)
def test_every_method_config_checks_types_before_comparing(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_method_configs_keep_accepting_good_values():
    assert SVDConfig.from_dict({"ratio": "0.6"}).ratio == 0.6
    assert SVDConfig(ratio=1).ratio == 1.0
    assert MaskLLMConfig.from_dict({"tau": [2, 1], "lr": "2e-4"}).tau == (2.0, 1.0)
    assert MaskLLMConfig.from_dict({"lr": "2e-4"}).training.lr == 2e-4
    assert TrainingOptions(lr=1).lr == 1.0


def test_unquoted_nm_in_yaml_is_named():
    recipe = yaml.safe_load("sparsity: 2:4")  # YAML 1.1: base 60, 2 * 60 + 4
    assert recipe == {"sparsity": 124}
    with pytest.raises(ConfigError, match='unquoted 2:4 as the number 124: quote it, "2:4"'):
        MagnitudeConfig.from_dict(recipe)
