"""Recipes: the job a YAML/JSON file (and the flags that override it) describes, as
``(RunOptions, [stage configs])``. A single-method recipe is a job of one stage; a recipe with
``stages:`` runs several methods one after another on one model, in one job.

A recipe with a ``stages:`` list (YAML or JSON) names a method and its options per stage; the
other top-level keys are the job's options (:class:`~lmcompress.jobs.run.RunOptions`: checkpoint,
calibration, evaluation, output) and hold for every stage::

    checkpoint: smollm2-135m
    nsamples: 32
    eval: [wiki-test, lee]
    stages:
      - {method: sparsegpt, sparsity: "2:4"}
      - {method: int8}

Each stage calibrates on, and compresses, the model as the earlier stages left it, with its own
``include`` / ``exclude``. A layer an earlier stage compressed is left alone by a later stage
unless the two compose (:mod:`lmcompress.compressor.formats.compose`; a method declares what it
composes after, ``Method.composes_after``): int8 after N:M or unstructured pruning keeps the
zeros and is stored packed (``nm_packed_int8``); pruning after a low-rank stage prunes only the
layers the low-rank stage did not factorise ("on the rest"). A stage left with no layer at all
is an error, found before any weight is read where the model's skeleton tells.

The job scores the dense model once, then the model after every stage (one report per stage,
``results["stages"]``), and writes one export whose ``report`` is the stages' combined report.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import transformers
import yaml
from torch import nn

from lmcompress.cache import cache_dir
from lmcompress.compressor.config import MethodConfig
from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.io import gguf_export
from lmcompress.compressor.io.output import OutputDir
from lmcompress.compressor.method import Method
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.surgery import is_linear
from lmcompress.compressor.options import flag_name, option_fields, option_value, recipe_value
from lmcompress.errors import ConfigError, LmcompressError, cut, first_line, shown
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.preflight import Plan, output_of, preflight
from lmcompress.methods import get_method

# Run options that make no sense per stage or across stages.
_NOT_IN_RECIPES = ("streaming", "offload_activations")


# A recipe is a page of options: anything near these sizes is a mistake or an attack. PyYAML
# builds a 1 MiB list of numbers in seconds (libyaml) to half a minute (pure Python).
MAX_RECIPE_BYTES = 2**20
MAX_ALIAS_NODES = 10_000  # nodes that aliases add when expanded (a billion laughs adds 10⁹)


class RecipeLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """``yaml.safe_load`` with two refusals, each a one-line :class:`ConfigError` naming the
    file: a key given twice in one mapping (YAML keeps the last silently; spellings with ``-``
    and ``_`` are one key), and aliases whose expansion adds more than
    :data:`MAX_ALIAS_NODES` nodes, or refers to itself. The composed document is a graph in
    which an alias is the anchored node again, so its expanded size is counted, memoised per
    node, before anything is constructed: an alias bomb is refused in microseconds, not
    expanded by the first thing that walks the values (a check, a message). The parser is
    libyaml's where PyYAML has it (about 8 times faster), else PyYAML's own."""

    def __init__(self, stream: str, name: str) -> None:
        super().__init__(stream)
        self.name = name

    def get_single_node(self) -> yaml.Node | None:
        document = super().get_single_node()
        if document is None:  # an empty file
            return None
        sizes: dict[int, int] = {}  # one entry per node as written
        if expanded_size(document, sizes, self.name) - len(sizes) > MAX_ALIAS_NODES:
            raise ConfigError(
                f"recipe {self.name}: too many alias expansions (limit {MAX_ALIAS_NODES} nodes)"
            )
        return document

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, tuple[Any, int]] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            same = key.replace("-", "_") if isinstance(key, str) else key
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(same)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if first is not None:
                if first[0] != key:
                    where = f"line {first[1]} as {shown(first[0])}, line {line}"
                else:
                    where = f"line {line}" if first[1] == line else f"lines {first[1]} and {line}"
                raise ConfigError(f"recipe {self.name}: key {shown(key)} is given twice ({where})")
            lines[same] = (key, line)
        return super().construct_mapping(node, deep=deep)


def expanded_size(node: yaml.Node, sizes: dict[int, int], name: str) -> int:
    """Nodes in ``node`` with every alias written out (``sizes``: the memo, by node id; an
    entry of -1 marks a node being counted, so an alias inside its own anchor is caught)."""
    key = id(node)
    if key in sizes:
        if sizes[key] < 0:
            raise ConfigError(f"recipe {name}: an alias refers to the node that contains it")
        return sizes[key]
    sizes[key] = -1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    size = 1
    for child in children:
        size += expanded_size(child, sizes, name)
    sizes[key] = size
    return size


def load_recipe(path: str | Path) -> dict[str, Any]:
    """A YAML/JSON recipe as a mapping with ``_``-spelt keys; one-line errors otherwise: a
    missing file, one over :data:`MAX_RECIPE_BYTES`, invalid YAML/JSON, a key given twice, an
    alias bomb (:class:`RecipeLoader`), nesting deeper than Python recurses."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"recipe {path} not found")
    size = file.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise ConfigError(
            f"recipe {path} is {size / 2**20:.1f} MiB: a recipe is a page of options "
            f"(limit {MAX_RECIPE_BYTES // 2**20} MiB)"
        )
    try:
        loader = RecipeLoader(file.read_text(), name=str(path))
        try:
            recipe = loader.get_single_data()
        finally:
            loader.dispose()
    except ConfigError:
        raise
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as err:  # ValueError: int digits
        raise ConfigError(f"recipe {path} is not valid YAML/JSON: {cut(first_line(err))}") from None
    except RecursionError:
        raise ConfigError(f"recipe {path} is nested too deeply") from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"recipe {path} must be a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in recipe.items()}


def job_from(
    recipe: Mapping[str, Any], given: Mapping[str, Any], method_class: type[Method]
) -> tuple[RunOptions, list[MethodConfig]]:
    """The job of ``recipe`` with the options ``given`` (flags) overriding it: its
    :class:`RunOptions` and one config per stage. ``method_class`` is the method of a
    single-method recipe (from ``--method`` or the recipe); a multi-stage recipe's stages name
    theirs, and method options given outside the stages are refused."""
    run_fields = [o.name for o in option_fields(RunOptions)]
    run_keys = (*run_fields, "checkpoint")
    if is_multi_stage(recipe):
        shared, configs = parse_recipe(recipe, run_fields)
        method_flags = sorted(set(given) - set(run_keys) - {"method"})
        if method_flags:
            raise ConfigError(
                f"{flag_name(method_flags[0])}: a multi-stage recipe takes each "
                "method's options in its stages, not as flags"
            )
        options = RunOptions(**{**shared, **{k: v for k, v in given.items() if k in run_keys}})
        return options, configs
    config_class = method_class.config_class
    method_fields = [o.name for o in option_fields(config_class)]
    recipe = dict(recipe)
    for group in {o.path[0] for o in option_fields(config_class) if len(o.path) > 1}:
        if isinstance(recipe.get(group), dict):  # an option group as a mapping: flatten it
            recipe.update({str(k).replace("-", "_"): v for k, v in recipe.pop(group).items()})
    unknown = set(recipe) - set(run_fields) - set(method_fields) - {"method", "checkpoint"}
    if unknown:
        method = given.get("method", config_class.method)
        raise ConfigError(
            f"recipe has unknown option(s) for method {shown(method)}: "
            f"{cut(', '.join(sorted(unknown)))}"
        )
    merged = {**recipe, **given}
    if merged.get("streaming") and "eval" not in merged:
        merged["eval"] = ()  # the default corpus is not for a streamed job, --eval is refused
    options = RunOptions(**{k: merged[k] for k in run_keys if k in merged})
    config = config_class.from_dict({k: merged[k] for k in method_fields if k in merged})
    return options, [config]


def is_multi_stage(recipe: Mapping[str, Any]) -> bool:
    return "stages" in recipe


def parse_recipe(
    recipe: Mapping[str, Any], run_fields: Sequence[str]
) -> tuple[dict[str, Any], list[MethodConfig]]:
    """``(job options, stage configs)`` of a multi-stage recipe (keys already ``_``-spelt).

    One-line :class:`ConfigError` s for a malformed list, an unknown method, a stage's bad
    option (named with the stage's number), or a job option inside a stage."""
    if "method" in recipe:
        raise ConfigError("a recipe has either method (one stage) or stages, not both")
    stages = recipe["stages"]
    if not isinstance(stages, list) or not stages:
        raise ConfigError("recipe stages must be a non-empty list of mappings with a method")
    shared = {k: v for k, v in recipe.items() if k != "stages"}
    unknown = sorted(set(shared) - {*run_fields, "checkpoint"})
    if unknown:
        raise ConfigError(f"recipe has unknown job option(s): {cut(', '.join(unknown))}")
    configs = []
    for index, stage in enumerate(stages, 1):
        if not isinstance(stage, Mapping) or not isinstance(stage.get("method"), str):
            raise ConfigError(f"recipe stage {index} must be a mapping with a method name")
        values = {str(k).replace("-", "_"): v for k, v in stage.items()}
        where = f"recipe stage {index} ({cut(values['method'])})"
        job = sorted(set(values) & {*run_fields, "checkpoint"})
        if job:
            raise ConfigError(
                f"{where}: {', '.join(job)} is a job option; set it at the top of the recipe, "
                "for every stage"
            )
        try:
            configs.append(get_method(values["method"]).config_class.from_dict(values))
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    for name in _NOT_IN_RECIPES:
        if shared.get(name):
            raise ConfigError(f"{name} runs one method: it is not for a multi-stage recipe")
    return shared, configs


def recipe_of(options: RunOptions, configs: Sequence[MethodConfig]) -> dict[str, Any]:
    """The recipe that runs the job again: the job's options and each stage's that differ
    from their defaults (the output path left out)."""
    return {
        **_changed(options, skip=("output", "overwrite")),
        "stages": [{"method": c.method, **_changed(c)} for c in configs],
    }


def _changed(config: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    changed = {}
    for option in option_fields(type(config)):
        value = recipe_value(option_value(config, option))
        default = option.default
        if option.name in skip:
            continue
        if default is dataclasses.MISSING or value != recipe_value(default):
            changed[option.name] = value
    return changed


def matching_layers(model: nn.Module, config: MethodConfig) -> dict[str, nn.Module]:
    """The layers ``config``'s own patterns name, linear or already compressed."""
    include = tuple(config.include) or (f"{family_of(model).blocks}.*",)
    return {
        name: module
        for name, module in model.named_modules()
        if (is_linear(module) or isinstance(module, CompressedLinear))
        and any(fnmatch.fnmatchcase(name, p) for p in include)
        and not any(fnmatch.fnmatchcase(name, p) for p in config.exclude)
    }


def stage_method(
    model: nn.Module, configs: Sequence[MethodConfig], index: int, skip: Sequence[str]
) -> tuple[Method, list[str]]:
    """Stage ``index`` (0-based) as a method that leaves the ``skip`` layers alone, and the
    layers its patterns name that it skips; a :class:`ConfigError` if none is left to it."""
    config = configs[index]
    named = matching_layers(model, config)
    skip_set = set(skip)
    skipped = [
        name
        for name, module in named.items()
        if name in skip_set or isinstance(module, CompressedLinear)
    ]
    if named and len(skipped) == len(named):
        earlier = " + ".join(c.method for c in configs[:index])
        raise ConfigError(
            f"recipe stage {index + 1} ({config.method}) has no layer left: every layer it "
            f"selects was compressed by an earlier stage ({earlier}) and {config.method} does "
            "not compose with that; give it other layers (include/exclude)"
        )
    if skipped:
        config = dataclasses.replace(config, exclude=(*config.exclude, *skipped))
    return get_method(config.method)(config), skipped


def check_stages(
    options: RunOptions, configs: Sequence[MethodConfig], output: OutputDir | None = None
) -> Plan:
    """:func:`~lmcompress.jobs.preflight.preflight` for every stage, before any weight is read.

    On the model's skeleton each stage is checked on the layers it will get: those its patterns
    select less the ones earlier stages compressed in a format it does not compose after
    (``Method.composes_after``), the earlier stages' formats taken from their declarations
    (``Method.stored_format``), and a layer two stages compressed already left to none. So a
    recipe whose later stage has nothing left (``svd`` then ``int8``; ``int8`` twice) is
    refused before the first stage runs. (A low-rank stage may leave a layer dense where
    factorising would not pay: counted as compressed here, as it cannot be known yet.)
    Returns the first stage's plan with the largest stage's memory estimate (the stages run
    one after another: the job's peak is theirs). ``output``: the job's output directory
    (default: ``options.output``'s), one for every stage."""
    output = output or output_of(options)
    first = get_method(configs[0].method)(configs[0])
    plan = preflight(options, first, output)
    stored: dict[str, list[str | None]] = {}  # layer -> the formats earlier stages store it in
    grids: dict[str, tuple[Any, Any, Any] | None] = {}  # layer -> its last stage's low-bit grid
    for index in range(len(configs)):
        if index == 0:
            method = first
        else:
            keeps = get_method(configs[index].method)(configs[index]).composes_after
            skip = [n for n, f in stored.items() if len(f) > 1 or f[0] not in keeps]
            method, _ = stage_method(plan.skeleton, configs, index, skip)
            estimate = preflight(options, method, output).estimate
            if estimate.total > plan.estimate.total:
                plan.estimate = estimate
        for name in method.validate(plan.skeleton):
            stored.setdefault(name, []).append(method.stored_format(name))
            grids[name] = grid_of(configs[index])
    if options.export == "gguf":
        check_gguf(plan.skeleton.config, stored, grids)
        check_gguf_tokenizer(options.checkpoint, plan.skeleton.config.vocab_size)
    return plan


def check_gguf_tokenizer(checkpoint: str, vocab_size: int) -> None:
    """``--export gguf`` needs a byte-level BPE tokenizer: checked before the weights load
    where the checkpoint is a local directory (or an alias's cached copy) holding one."""
    local = Path(checkpoint).expanduser()
    path = local if local.is_dir() else cache_dir() / checkpoint
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return  # read with the model; the export checks it then
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        gguf_export.tokenizer_fields(tokenizer, vocab_size)
    except LmcompressError as err:
        raise ConfigError(first_line(err)) from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--export gguf: unreadable tokenizer: {first_line(err)}") from None


def grid_of(config: MethodConfig) -> tuple[Any, Any, Any] | None:
    """``(bits, group_size, symmetric)`` of a weight-only low-bit stage (its config's ``bits``,
    ``group_size`` and ``sym``), else ``None``."""
    if not hasattr(config, "bits"):
        return None
    symmetric = getattr(config, "sym", getattr(config, "symmetric", True))
    return config.bits, getattr(config, "group_size", None), symmetric


def check_gguf(
    model_config: Any,
    stored: dict[str, list[str | None]],
    grids: dict[str, tuple[Any, Any, Any] | None],
) -> None:
    """``--export gguf``, before any work: the family, and every compressed layer stored in a
    weight-only low-bit format (dense or N:M packed: both written dense as Q4_0/Q8_0) on a
    grid Q4_0/Q8_0 hold exactly (the stage that compressed it last)."""
    if why := gguf_export.family_refusal(model_config):
        raise ConfigError(why)
    if not stored:
        raise ConfigError("--export gguf: no layer is quantized")
    for name, formats in stored.items():
        last = formats[-1]
        if last not in gguf_export.LOW_BIT_FORMATS or grids.get(name) is None:
            kind = "a dense weight" if last is None else last
            raise ConfigError(
                f"--export gguf writes weight-only 4/8-bit layers (--method gptq or rtn), but "
                f"{name} would be stored as {kind}"
            )
        if why := gguf_export.grid_refusal(*grids[name]):
            raise ConfigError(why)
